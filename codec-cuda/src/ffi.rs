//! The crate's only `unsafe` code: calls into the host-compiled kernels (`build.rs`), into NVRTC
//! and into the CUDA driver (both loaded at run time through cudarc). Everything here is wrapped
//! in safe functions whose checks establish the invariants below; each `// SAFETY:` comment
//! names the invariant it relies on.
//!
//! # Invariants
//!
//! 1. **Mirrored layouts.** [`LaneBlock`] (in `rans.rs`) and [`LaneDecodeArgsC`] have the layout of
//!    `KvcLaneBlock` and `KvcLaneDecodeArgs` in `kernels/rans_decode.cu`, and [`ChannelConsts`],
//!    [`DequantBlock`] (in `quant.rs`) and [`DequantArgsC`] those of `KvcChannelConsts`,
//!    `KvcDequantBlock` and `KvcDequantArgs` in `kernels/dequant.cu`, and [`PqQuery`] (in
//!    `pq.rs`) and [`PqArgsC`] those of `KvcPqQuery` and `KvcPqArgs` in `kernels/pq_search.cu`,
//!    [`QuantBlock`], [`LaneEncodeBlock`] (in `encode.rs`), [`QuantArgsC`] and
//!    [`LaneEncodeArgsC`] those of `kernels/encode.cu`, and [`ResolveBlock`], [`ValueBlock`],
//!    [`ResolveArgsC`] and [`ValueArgsC`] those of `kernels/chain.cu`, and [`LaneBlock`] and
//!    [`LaneDecodeArgsC`] also those of `KvcLane32Block` and `KvcLane32Args` in
//!    `kernels/rans32_experiment.cu` (words of the [`LaneWord`] type), and [`EncBlock`],
//!    [`EncResult`], [`ChunkOut`], [`ChunkResult`], [`SealResult`] (in `encode_plan.rs`),
//!    [`EncodeArgsC`], [`WriteArgsC`] and [`SealArgsC`] those of the encode chain in
//!    `kernels/encode.cu` (`#[repr(C)]`, fields in the same order and of the same sizes). The
//!    unit tests `*layouts_match_the_kernel` compare every size and offset with what the C++
//!    compiler reports.
//! 2. **Counted buffers.** Every pointer passed to a kernel comes from a live slice, and the
//!    count passed beside it is that slice's length (for `tables`, its length in whole tables of
//!    `KVC_SLOTS` words). The kernels read or write a buffer only below its count: they check each
//!    block's ranges against the counts before use (`kvc_block_range_ok`, `kvc_block_tables_ok`
//!    and a symbol's table index against its block's table count in the lane decode;
//!    `kvc_dequant_block_ok` and, per row of a paged output, `kvc_dequant_pages_ok` in the
//!    dequantization), so any *content* of the inputs is memory-safe; only the counts must be
//!    right, and [`host_lane_decode`] and [`host_dequant`] derive them from the slices. In the lane decode, `symbols` and
//!    `symbol_table` have the same length and `status` holds 32 entries per block; in the
//!    dequantization, `status` holds one entry per block; in the PQ search, one per query (the
//!    kernel checks each query's ranges, `kvc_pq_range_ok`, and the launch's shape,
//!    `kvc_pq_shape_ok`, before any read). In the encode chain the source is counted in whole
//!    elements of its dtype (`kvc_encode_blocks`) or in bytes (`kvc_write_chunks`), `symbols`
//!    and `symbol_table` have the same length, and results, lane statuses and lengths, chunk
//!    and seal results are one (32 per block for the lanes) per block or chunk; the kernels
//!    check every block's and chunk's ranges (`kvc_enc_ok`, `kvc_block_size`,
//!    `kvc_write_offsets`, `kvc_sealed_size` and `kvc_seal_place`), and mask or bound what
//!    another block may rewrite meanwhile on a device (a symbol's exponent, an escape's rank).
//! 3. **Launch shape.** The host runs get `grid = blocks.len()` (checked to fit `u32`); the lane
//!    decode 32 threads and `shared_tables * KVC_SLOTS * 4` bytes of shared memory, the amount
//!    the kernel assumes for `shared_tables` tables; the dequantization [`DEQUANT_THREADS`]
//!    threads and [`DEQUANT_SHARED_BYTES`] of shared memory; the PQ search its [`PqShape`]'s
//!    threads (at most [`PQ_MAX_THREADS`], which the kernel checks) and
//!    [`PQ_SHARED_HEADER_BYTES`] plus 4 bytes per table entry and per shared key, the
//!    `table_capacity` and `key_capacity` it is told (the kernel checks that the table fits
//!    the one, and keeps only queries of at most the other's tokens there); the encode chain [`CHAIN_THREADS`]
//!    threads and [`ENCODE_SHARED_BYTES`] (`kvc_encode_blocks`, one CUDA block per coded block)
//!    or [`WRITE_SHARED_BYTES`] (`kvc_write_chunks`, one per chunk) or [`SEAL_SHARED_BYTES`]
//!    (`kvc_seal_chunks`, one per chunk) of shared memory.
//! 4. **Libraries before symbols.** No cudarc NVRTC or driver function is called unless
//!    `is_culib_present()` said the library loads (cudarc panics otherwise, `DESIGN.md` §8), and
//!    no NVRTC function is called before [`nvrtc_missing_symbol`] found all of [`NVRTC_SYMBOLS`]
//!    in the loaded library (cudarc panics on a missing symbol).
//! 5. **Program lifetime.** An NVRTC program is created, used and destroyed inside
//!    [`nvrtc_compile`]; the source, name, header and option strings it points to outlive it.
//! 6. **Device buffers.** A [`DevBuf`]'s count never exceeds its allocation (for a view into a
//!    packed upload, its part: [`Packer`] lays the parts out disjoint and [`PACK_ALIGN`]-aligned
//!    within the one allocation, and [`DevBuf::view`] checks the part lies inside it), and every device
//!    launch passes each buffer's address with that count (as invariant 2 on the host), so the
//!    kernels' own range checks keep every access inside the buffers. The buffers outlive the
//!    launch: the launch functions borrow them, and `Gpu` synchronizes the stream before it
//!    drops or reads them.
//! 7. **Device values.** The types given to cudarc as [`DeviceRepr`] / [`ValidAsZeroBits`] are
//!    `#[repr(C)]` structs of integers and floats mirrored from the kernels (invariant 1, the
//!    `*ArgsDev` structs having 8-byte addresses where the kernels have pointers): any bit
//!    pattern is a valid value.
//! 8. **Shared memory.** A lane-decode launch asks for `shared_tables * 16 KiB` of dynamic
//!    shared memory only after `Gpu` raised the function's limit to at least that (or it is
//!    within the default 48 KiB); a PQ search launch asks for its [`PqShape`]'s bytes, shaped
//!    within the budget `Gpu` raised the function's limit to (the device's opt-in maximum).
#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, CStr, CString};
use std::marker::PhantomData;
use std::mem::size_of;
use std::path::Path;
use std::sync::Mutex;

use std::sync::Arc;

use cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, DriverError,
    LaunchConfig, PinnedHostSlice, PushKernelArg, SyncOnDrop, ValidAsZeroBits,
};
use cudarc::nvrtc::sys as nvrtc;

use crate::encode::{LaneEncodeBlock, QuantBlock};
use crate::encode_plan::{
    ChunkOut, ChunkResult, EncBlock, EncResult, ImportancePolicy, SealResult,
};
use crate::error::CudaError;
use crate::pq::PqQuery;
use crate::quant::{ChannelConsts, DequantBlock, OutDtype};
use crate::rans::LaneBlock;

/// Lanes per coded block (`KVC_LANES`).
pub(crate) const LANES: usize = 32;
/// Entries of one packed decode table (`KVC_SLOTS`).
pub(crate) const SLOTS: usize = 4096;

/// A host run's return code as a result: 0, or the shared memory could not be allocated or the
/// launch shape is one the device would reject.
fn host_ran(rc: c_int, entry: &'static str) -> Result<(), CudaError> {
    match rc {
        0 => Ok(()),
        _ => Err(CudaError::HostRun { entry }),
    }
}

/// `KvcLaneDecodeArgs` (invariant 1), and `KvcLane32Args` of the 32-bit-state experiment
/// (`kernels/rans32_experiment.cu`), whose `words` are 16-bit.
#[repr(C)]
#[derive(Debug)]
pub(crate) struct LaneDecodeArgsC {
    /// The launch's words, `n_words` of its [`LaneWord`] type.
    words: *const u8,
    n_words: u64,
    tables: *const u32,
    n_tables: u64,
    table_list: *const u32,
    n_table_list: u64,
    symbol_table: *const u16,
    symbols: *mut u8,
    n_symbols: u64,
    blocks: *const LaneBlock,
    status: *mut u32,
    n_blocks: u64,
    shared_tables: u64,
}

extern "C" {
    fn kvc_rans_lane_decode_host(
        args: *const LaneDecodeArgsC,
        grid: u32,
        block: u32,
        shared_bytes: u64,
    ) -> c_int;
    #[cfg(test)]
    fn kvc_rans_lane_decode_layout(out: *mut u64, cap: u64) -> u64;
    fn kvc_rans32_lane_decode_experiment_host(
        args: *const LaneDecodeArgsC,
        grid: u32,
        block: u32,
        shared_bytes: u64,
    ) -> c_int;
    #[cfg(test)]
    fn kvc_rans32_lane_decode_experiment_layout(out: *mut u64, cap: u64) -> u64;
    fn kvc_dequant_f16_host(
        args: *const DequantArgsC,
        grid: u32,
        block: u32,
        shared_bytes: u64,
    ) -> c_int;
    fn kvc_dequant_bf16_host(
        args: *const DequantArgsC,
        grid: u32,
        block: u32,
        shared_bytes: u64,
    ) -> c_int;
    #[cfg(test)]
    fn kvc_dequant_layout(out: *mut u64, cap: u64) -> u64;
    fn kvc_f32_to_f16_host(x: f32) -> u16;
    fn kvc_f32_to_bf16_host(x: f32) -> u16;
    fn kvc_pq_search_host(args: *const PqArgsC, grid: u32, block: u32, shared_bytes: u64) -> c_int;
    #[cfg(test)]
    fn kvc_pq_layout(out: *mut u64, cap: u64) -> u64;
    fn kvc_quantize_host(
        args: *const QuantArgsC,
        grid: u32,
        block: u32,
        shared_bytes: u64,
    ) -> c_int;
    fn kvc_rans_lane_encode_host(
        args: *const LaneEncodeArgsC,
        grid: u32,
        block: u32,
        shared_bytes: u64,
    ) -> c_int;
    #[cfg(test)]
    fn kvc_encode_layout(out: *mut u64, cap: u64) -> u64;
    fn kvc_encode_blocks_host(
        args: *const EncodeArgsC,
        grid: u32,
        block: u32,
        shared_bytes: u64,
    ) -> c_int;
    #[cfg(test)]
    fn kvc_encode_chain_layout(out: *mut u64, cap: u64) -> u64;
    fn kvc_write_chunks_host(
        args: *const WriteArgsC,
        grid: u32,
        block: u32,
        shared_bytes: u64,
    ) -> c_int;
    fn kvc_seal_chunks_host(
        args: *const SealArgsC,
        grid: u32,
        block: u32,
        shared_bytes: u64,
    ) -> c_int;
    fn kvc_quantize_one_host(r: f32, step: f32) -> i32;
    fn kvc_resolve_tables_host(
        args: *const ResolveArgsC,
        grid: u32,
        block: u32,
        shared_bytes: u64,
    ) -> c_int;
    fn kvc_map_values_host(
        args: *const ValueArgsC,
        grid: u32,
        block: u32,
        shared_bytes: u64,
    ) -> c_int;
    #[cfg(test)]
    fn kvc_chain_layout(out: *mut u64, cap: u64) -> u64;
}

/// `KvcResolveBlock` (invariant 1).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct ResolveBlock {
    pub symbol_start: u64,
    pub exp_start: u64,
    pub map_start: u64,
    pub n_e: u32,
    pub n_sym: u32,
    pub sink_rows: u32,
    pub group: u32,
    pub has_exps: u32,
    pub reserved: u32,
}

/// `KvcValueBlock` (invariant 1).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct ValueBlock {
    pub index_start: u64,
    pub list_start: u64,
    pub escape_start: u64,
    pub q_start: u64,
    pub n_sym: u32,
    pub n_escapes: u32,
    pub list_len: u32,
    pub reserved: u32,
}

/// `KvcResolveArgs` (invariant 1).
#[repr(C)]
#[derive(Debug)]
struct ResolveArgsC {
    symbol_table: *mut u16,
    n_symbol_table: u64,
    exps: *const u8,
    n_exps: u64,
    map: *const u16,
    n_map: u64,
    blocks: *const ResolveBlock,
    status: *mut u32,
    n_blocks: u64,
    heads: u32,
    head_dim: u32,
}

/// `KvcValueArgs` (invariant 1).
#[repr(C)]
#[derive(Debug)]
struct ValueArgsC {
    indices: *const u8,
    symbol_table: *const u16,
    n_indices: u64,
    table_list: *const u32,
    n_table_list: u64,
    radius: *const u8,
    n_radius: u64,
    escapes: *const i32,
    n_escapes: u64,
    q: *mut i32,
    n_q: u64,
    blocks: *const ValueBlock,
    status: *mut u32,
    n_blocks: u64,
}

/// Threads per block of the chain kernels.
pub(crate) const CHAIN_THREADS: u32 = 256;
/// Bytes of `KvcValueShared` (16 + 4 * `KVC_VALUE_TILES` + `KVC_VALUE_LIST`).
pub(crate) const VALUE_SHARED_BYTES: u32 = 16 + 4 * 4096 + 4096;

/// The buffers of one table-resolution launch.
#[derive(Debug)]
pub(crate) struct ResolveIo<'a> {
    pub symbol_table: &'a mut [u16],
    pub exps: &'a [u8],
    pub map: &'a [u16],
    pub blocks: &'a [ResolveBlock],
    pub status: &'a mut [u32],
    pub heads: u32,
    pub head_dim: u32,
}

/// Runs `kvc_resolve_tables` on the host.
pub(crate) fn host_resolve_tables(io: ResolveIo<'_>) -> Result<(), CudaError> {
    let input = |what| CudaError::Input { what };
    let grid = u32::try_from(io.blocks.len()).map_err(|_| input("over 2^32 - 1 blocks"))?;
    if io.status.len() != io.blocks.len() {
        return Err(input("status buffer is not one entry per block"));
    }
    let args = ResolveArgsC {
        symbol_table: io.symbol_table.as_mut_ptr(),
        n_symbol_table: io.symbol_table.len() as u64,
        exps: io.exps.as_ptr(),
        n_exps: io.exps.len() as u64,
        map: io.map.as_ptr(),
        n_map: io.map.len() as u64,
        blocks: io.blocks.as_ptr(),
        status: io.status.as_mut_ptr(),
        n_blocks: io.blocks.len() as u64,
        heads: io.heads,
        head_dim: io.head_dim,
    };
    // SAFETY: invariants 1, 2 (pointer/count pairs from live slices, borrowed for the call) and
    // 3 (CHAIN_THREADS threads, no shared memory).
    let rc = unsafe { kvc_resolve_tables_host(&args, grid, CHAIN_THREADS, 0) };
    host_ran(rc, "kvc_resolve_tables")
}

/// The buffers of one value-mapping launch.
#[derive(Debug)]
pub(crate) struct ValueIo<'a> {
    pub indices: &'a [u8],
    /// Same length as `indices`.
    pub symbol_table: &'a [u16],
    pub table_list: &'a [u32],
    pub radius: &'a [u8],
    pub escapes: &'a [i32],
    pub q: &'a mut [i32],
    pub blocks: &'a [ValueBlock],
    pub status: &'a mut [u32],
}

/// Runs `kvc_map_values` on the host.
pub(crate) fn host_map_values(io: ValueIo<'_>) -> Result<(), CudaError> {
    let input = |what| CudaError::Input { what };
    let grid = u32::try_from(io.blocks.len()).map_err(|_| input("over 2^32 - 1 blocks"))?;
    if io.status.len() != io.blocks.len() || io.indices.len() != io.symbol_table.len() {
        return Err(input("value-mapping buffers of mismatched lengths"));
    }
    let args = ValueArgsC {
        indices: io.indices.as_ptr(),
        symbol_table: io.symbol_table.as_ptr(),
        n_indices: io.indices.len() as u64,
        table_list: io.table_list.as_ptr(),
        n_table_list: io.table_list.len() as u64,
        radius: io.radius.as_ptr(),
        n_radius: io.radius.len() as u64,
        escapes: io.escapes.as_ptr(),
        n_escapes: io.escapes.len() as u64,
        q: io.q.as_mut_ptr(),
        n_q: io.q.len() as u64,
        blocks: io.blocks.as_ptr(),
        status: io.status.as_mut_ptr(),
        n_blocks: io.blocks.len() as u64,
    };
    let shared = u64::from(VALUE_SHARED_BYTES);
    // SAFETY: invariants 1, 2 (pointer/count pairs from live slices, borrowed for the call;
    // `indices` and `symbol_table` of one length) and 3 (CHAIN_THREADS threads, the shared
    // memory KvcValueShared needs).
    let rc = unsafe { kvc_map_values_host(&args, grid, CHAIN_THREADS, shared) };
    host_ran(rc, "kvc_map_values")
}

/// `KvcQuantArgs` (invariant 1).
#[repr(C)]
#[derive(Debug)]
struct QuantArgsC {
    x: *const f32,
    n_x: u64,
    exps: *const u8,
    n_exps: u64,
    consts: *const ChannelConsts,
    n_consts: u64,
    q: *mut i32,
    n_q: u64,
    blocks: *const QuantBlock,
    status: *mut u32,
    n_blocks: u64,
    heads: u32,
    head_dim: u32,
}

/// The buffers of one quantization launch.
#[derive(Debug)]
pub(crate) struct QuantIo<'a> {
    pub x: &'a [f32],
    pub exps: &'a [u8],
    pub consts: &'a [ChannelConsts],
    pub q: &'a mut [i32],
    pub blocks: &'a [QuantBlock],
    pub status: &'a mut [u32],
    pub heads: u32,
    pub head_dim: u32,
}

/// Runs `kvc_quantize` on the host: one block per entry of `io.blocks`, [`DEQUANT_THREADS`]
/// threads.
pub(crate) fn host_quantize(io: QuantIo<'_>) -> Result<(), CudaError> {
    let grid = u32::try_from(io.blocks.len()).map_err(|_| CudaError::Input {
        what: "more than 2^32 - 1 blocks in one launch",
    })?;
    if io.status.len() != io.blocks.len() {
        return Err(CudaError::Input {
            what: "status buffer is not one entry per block",
        });
    }
    let args = QuantArgsC {
        x: io.x.as_ptr(),
        n_x: io.x.len() as u64,
        exps: io.exps.as_ptr(),
        n_exps: io.exps.len() as u64,
        consts: io.consts.as_ptr(),
        n_consts: io.consts.len() as u64,
        q: io.q.as_mut_ptr(),
        n_q: io.q.len() as u64,
        blocks: io.blocks.as_ptr(),
        status: io.status.as_mut_ptr(),
        n_blocks: io.blocks.len() as u64,
        heads: io.heads,
        head_dim: io.head_dim,
    };
    // SAFETY: invariants 1, 2 (pointer/count pairs from live slices, borrowed for the call) and
    // 3 (launch shape: no shared memory).
    let rc = unsafe { kvc_quantize_host(&args, grid, DEQUANT_THREADS, 0) };
    host_ran(rc, "kvc_quantize")
}

/// The quantizer's rounding of `r / step`.
pub(crate) fn kernel_quantize_one(r: f32, step: f32) -> i32 {
    // SAFETY: a pure function of its arguments.
    unsafe { kvc_quantize_one_host(r, step) }
}

/// `KvcLaneEncodeArgs` (invariant 1).
#[repr(C)]
#[derive(Debug)]
struct LaneEncodeArgsC {
    symbols: *const u8,
    symbol_table: *const u16,
    n_symbols: u64,
    tables: *const u32,
    n_tables: u64,
    table_list: *const u32,
    n_table_list: u64,
    words: *mut u32,
    n_words: u64,
    lane_len: *mut u32,
    blocks: *const LaneEncodeBlock,
    status: *mut u32,
    n_blocks: u64,
}

/// The buffers of one lane-encode launch.
#[derive(Debug)]
pub(crate) struct LaneEncodeIo<'a> {
    pub symbols: &'a [u8],
    pub symbol_table: &'a [u16],
    /// Encode tables, 256 entries each (a partial last table is ignored).
    pub tables: &'a [u32],
    pub table_list: &'a [u32],
    pub words: &'a mut [u32],
    pub lane_len: &'a mut [u32],
    pub blocks: &'a [LaneEncodeBlock],
    pub status: &'a mut [u32],
}

/// Runs `kvc_rans_lane_encode` on the host: one block of 32 threads per entry of `io.blocks`.
pub(crate) fn host_lane_encode(io: LaneEncodeIo<'_>) -> Result<(), CudaError> {
    let input = |what| CudaError::Input { what };
    let grid = u32::try_from(io.blocks.len()).map_err(|_| input("over 2^32 - 1 blocks"))?;
    if io.symbols.len() != io.symbol_table.len() {
        return Err(input("symbol and symbol-table buffers differ in length"));
    }
    if io.status.len() != io.blocks.len() * LANES || io.lane_len.len() != io.status.len() {
        return Err(input(
            "status and lane-length buffers are not 32 entries per block",
        ));
    }
    let args = LaneEncodeArgsC {
        symbols: io.symbols.as_ptr(),
        symbol_table: io.symbol_table.as_ptr(),
        n_symbols: io.symbols.len() as u64,
        tables: io.tables.as_ptr(),
        n_tables: (io.tables.len() / 256) as u64,
        table_list: io.table_list.as_ptr(),
        n_table_list: io.table_list.len() as u64,
        words: io.words.as_mut_ptr(),
        n_words: io.words.len() as u64,
        lane_len: io.lane_len.as_mut_ptr(),
        blocks: io.blocks.as_ptr(),
        status: io.status.as_mut_ptr(),
        n_blocks: io.blocks.len() as u64,
    };
    // SAFETY: invariants 1, 2 (pointer/count pairs from live slices, borrowed for the call;
    // `lane_len` and `status` hold 32 entries per block) and 3 (32 threads, no shared memory).
    let rc = unsafe { kvc_rans_lane_encode_host(&args, grid, LANES as u32, 0) };
    host_ran(rc, "kvc_rans_lane_encode")
}

/// `KvcEncodeArgs` (invariant 1).
#[repr(C)]
#[derive(Debug)]
struct EncodeArgsC {
    src: *const u8,
    n_src: u64,
    dtype: u32,
    max_exp: u32,
    slope: f64,
    inv_sqrt_d: f64,
    qref: *const f64,
    n_qref: u64,
    tau: *const f32,
    n_tau: u64,
    rot: *const f64,
    n_rot: u64,
    consts: *const ChannelConsts,
    n_consts: u64,
    map: *const u16,
    n_map: u64,
    table_list: *const u32,
    n_table_list: u64,
    radius: *const u8,
    n_radius: u64,
    tables: *mut u32,
    n_tables: u64,
    symbols: *mut u8,
    symbol_table: *mut u16,
    n_symbols: u64,
    q: *mut i32,
    n_q: u64,
    escapes: *mut i32,
    n_escapes: u64,
    blocks: *const EncBlock,
    results: *mut EncResult,
    lane_blocks: *mut LaneEncodeBlock,
    n_blocks: u64,
    heads: u32,
    head_dim: u32,
    rope_style: u32,
    reserved: u32,
}

/// Bytes of `KvcEncShared` (6 counters, 16 counts, 16 frequencies, `KVC_ENC_TILES` tiles).
pub(crate) const ENCODE_SHARED_BYTES: u32 = 6 * 4 + 16 * 4 + 16 * 2 + 4 * 4096;

/// The buffers of one encode-chain launch (`kvc_encode_blocks`).
#[derive(Debug)]
pub(crate) struct EncodeIo<'a> {
    /// The source tensors' bytes, `dtype` elements (0 f32, 1 f16, 2 bf16).
    pub src: &'a [u8],
    pub dtype: u32,
    pub importance: Option<ImportancePolicy>,
    pub qref: &'a [f64],
    pub tau: &'a [f32],
    pub rot: &'a [f64],
    pub consts: &'a [ChannelConsts],
    pub map: &'a [u16],
    pub table_list: &'a [u32],
    pub radius: &'a [u8],
    /// Encode tables, 256 entries each.
    pub tables: &'a mut [u32],
    pub symbols: &'a mut [u8],
    /// Same length as `symbols`.
    pub symbol_table: &'a mut [u16],
    pub q: &'a mut [i32],
    pub escapes: &'a mut [i32],
    pub blocks: &'a [EncBlock],
    pub results: &'a mut [EncResult],
    pub lane_blocks: &'a mut [LaneEncodeBlock],
    pub heads: u32,
    pub head_dim: u32,
}

/// Runs `kvc_encode_blocks` on the host.
pub(crate) fn host_encode_blocks(io: EncodeIo<'_>) -> Result<(), CudaError> {
    let input = |what| CudaError::Input { what };
    let grid = u32::try_from(io.blocks.len()).map_err(|_| input("over 2^32 - 1 blocks"))?;
    if io.results.len() != io.blocks.len()
        || io.lane_blocks.len() != io.blocks.len()
        || io.symbols.len() != io.symbol_table.len()
    {
        return Err(input("encode-chain buffers of mismatched lengths"));
    }
    let size = if io.dtype == 0 { 4 } else { 2 };
    let policy = io.importance.unwrap_or_default();
    let args = EncodeArgsC {
        src: io.src.as_ptr(),
        n_src: (io.src.len() / size) as u64,
        dtype: io.dtype,
        max_exp: policy.max_exp,
        slope: policy.slope,
        inv_sqrt_d: policy.inv_sqrt_d,
        qref: io.qref.as_ptr(),
        n_qref: io.qref.len() as u64,
        tau: io.tau.as_ptr(),
        n_tau: io.tau.len() as u64,
        rot: io.rot.as_ptr(),
        n_rot: io.rot.len() as u64,
        consts: io.consts.as_ptr(),
        n_consts: io.consts.len() as u64,
        map: io.map.as_ptr(),
        n_map: io.map.len() as u64,
        table_list: io.table_list.as_ptr(),
        n_table_list: io.table_list.len() as u64,
        radius: io.radius.as_ptr(),
        n_radius: io.radius.len() as u64,
        tables: io.tables.as_mut_ptr(),
        n_tables: (io.tables.len() / 256) as u64,
        symbols: io.symbols.as_mut_ptr(),
        symbol_table: io.symbol_table.as_mut_ptr(),
        n_symbols: io.symbols.len() as u64,
        q: io.q.as_mut_ptr(),
        n_q: io.q.len() as u64,
        escapes: io.escapes.as_mut_ptr(),
        n_escapes: io.escapes.len() as u64,
        blocks: io.blocks.as_ptr(),
        results: io.results.as_mut_ptr(),
        lane_blocks: io.lane_blocks.as_mut_ptr(),
        n_blocks: io.blocks.len() as u64,
        heads: io.heads,
        head_dim: io.head_dim,
        rope_style: policy.rope_style,
        reserved: 0,
    };
    let shared = u64::from(ENCODE_SHARED_BYTES);
    // SAFETY: invariants 1, 2 (pointer/count pairs from live slices, borrowed for the call;
    // `src` counted in whole elements of its dtype, `tables` in whole tables; `symbols` and
    // `symbol_table` of one length, one result and lane record per block) and 3 (CHAIN_THREADS
    // threads, the shared memory KvcEncShared needs).
    let rc = unsafe { kvc_encode_blocks_host(&args, grid, CHAIN_THREADS, shared) };
    host_ran(rc, "kvc_encode_blocks")
}

/// `KvcWriteArgs` (invariant 1).
#[repr(C)]
#[derive(Debug)]
struct WriteArgsC {
    src: *const u8,
    n_src_bytes: u64,
    elem_bytes: u32,
    heads: u32,
    head_dim: u32,
    reserved: u32,
    blocks: *const EncBlock,
    results: *const EncResult,
    n_blocks: u64,
    escapes: *const i32,
    n_escapes: u64,
    words: *const u32,
    n_words: u64,
    lane_len: *const u32,
    lane_status: *const u32,
    chunks: *const ChunkOut,
    chunk_results: *mut ChunkResult,
    n_chunks: u64,
    out: *mut u8,
    n_out: u64,
}

/// Bytes of `KvcWriteShared` (two counters, the length, `KVC_CHUNK_BLOCKS` offsets).
pub(crate) const WRITE_SHARED_BYTES: u32 = 16 + 8 * 2048;

/// The buffers of one chunk-writing launch (`kvc_write_chunks`).
#[derive(Debug)]
pub(crate) struct WriteIo<'a> {
    pub src: &'a [u8],
    pub elem_bytes: u32,
    pub heads: u32,
    pub head_dim: u32,
    pub blocks: &'a [EncBlock],
    /// One per block.
    pub results: &'a [EncResult],
    pub escapes: &'a [i32],
    pub words: &'a [u32],
    /// 32 per block each.
    pub lane_len: &'a [u32],
    pub lane_status: &'a [u32],
    pub chunks: &'a [ChunkOut],
    /// One per chunk.
    pub chunk_results: &'a mut [ChunkResult],
    pub out: &'a mut [u8],
}

/// Runs `kvc_write_chunks` on the host.
pub(crate) fn host_write_chunks(io: WriteIo<'_>) -> Result<(), CudaError> {
    let input = |what| CudaError::Input { what };
    let grid = u32::try_from(io.chunks.len()).map_err(|_| input("over 2^32 - 1 chunks"))?;
    let n = io.blocks.len();
    if io.results.len() != n
        || io.lane_len.len() != n * LANES
        || io.lane_status.len() != n * LANES
        || io.chunk_results.len() != io.chunks.len()
    {
        return Err(input("chunk-writing buffers of mismatched lengths"));
    }
    let args = WriteArgsC {
        src: io.src.as_ptr(),
        n_src_bytes: io.src.len() as u64,
        elem_bytes: io.elem_bytes,
        heads: io.heads,
        head_dim: io.head_dim,
        reserved: 0,
        blocks: io.blocks.as_ptr(),
        results: io.results.as_ptr(),
        n_blocks: n as u64,
        escapes: io.escapes.as_ptr(),
        n_escapes: io.escapes.len() as u64,
        words: io.words.as_ptr(),
        n_words: io.words.len() as u64,
        lane_len: io.lane_len.as_ptr(),
        lane_status: io.lane_status.as_ptr(),
        chunks: io.chunks.as_ptr(),
        chunk_results: io.chunk_results.as_mut_ptr(),
        n_chunks: io.chunks.len() as u64,
        out: io.out.as_mut_ptr(),
        n_out: io.out.len() as u64,
    };
    let shared = u64::from(WRITE_SHARED_BYTES);
    // SAFETY: invariants 1, 2 (pointer/count pairs from live slices, borrowed for the call;
    // one result per block, 32 lane entries per block, one chunk result per chunk) and 3
    // (CHAIN_THREADS threads, the shared memory KvcWriteShared needs).
    let rc = unsafe { kvc_write_chunks_host(&args, grid, CHAIN_THREADS, shared) };
    host_ran(rc, "kvc_write_chunks")
}

/// `KvcSealArgs` (invariant 1).
#[repr(C)]
#[derive(Debug)]
pub(crate) struct SealArgsC {
    chunks: *const ChunkOut,
    chunk_results: *const ChunkResult,
    n_chunks: u64,
    out: *const u8,
    n_out: u64,
    sealed: *mut u8,
    n_sealed: u64,
    seal_results: *mut SealResult,
}

/// Bytes of `KvcSealShared` (status, start and length, the CRC table, 64 powers, and a sum
/// and a register per thread of `KVC_SEAL_THREADS` = [`CHAIN_THREADS`]).
pub(crate) const SEAL_SHARED_BYTES: u32 = 8 + 16 + 4 * 256 + 4 * 64 + (8 + 4) * CHAIN_THREADS;

/// The buffers of one sealing launch (`kvc_seal_chunks`).
#[derive(Debug)]
pub(crate) struct SealIo<'a> {
    pub chunks: &'a [ChunkOut],
    /// One per chunk, as the chunk-writing launch left them.
    pub chunk_results: &'a [ChunkResult],
    pub out: &'a [u8],
    pub sealed: &'a mut [u8],
    /// One per chunk.
    pub seal_results: &'a mut [SealResult],
}

/// Runs `kvc_seal_chunks` on the host.
pub(crate) fn host_seal_chunks(io: SealIo<'_>) -> Result<(), CudaError> {
    let input = |what| CudaError::Input { what };
    let grid = u32::try_from(io.chunks.len()).map_err(|_| input("over 2^32 - 1 chunks"))?;
    if io.chunk_results.len() != io.chunks.len() || io.seal_results.len() != io.chunks.len() {
        return Err(input("sealing buffers of mismatched lengths"));
    }
    let args = SealArgsC {
        chunks: io.chunks.as_ptr(),
        chunk_results: io.chunk_results.as_ptr(),
        n_chunks: io.chunks.len() as u64,
        out: io.out.as_ptr(),
        n_out: io.out.len() as u64,
        sealed: io.sealed.as_mut_ptr(),
        n_sealed: io.sealed.len() as u64,
        seal_results: io.seal_results.as_mut_ptr(),
    };
    let shared = u64::from(SEAL_SHARED_BYTES);
    // SAFETY: invariants 1, 2 (pointer/count pairs from live slices, borrowed for the call;
    // one chunk result and one seal result per chunk) and 3 (CHAIN_THREADS threads, the
    // shared memory KvcSealShared needs).
    let rc = unsafe { kvc_seal_chunks_host(&args, grid, CHAIN_THREADS, shared) };
    host_ran(rc, "kvc_seal_chunks")
}

/// `KvcPqArgs` (invariant 1).
#[repr(C)]
#[derive(Debug)]
pub(crate) struct PqArgsC {
    queries: *const f32,
    n_queries: u64,
    codewords: *const f32,
    n_codewords: u64,
    codes: *const u8,
    n_codes: u64,
    keys: *mut u32,
    n_keys: u64,
    out: *mut u32,
    n_out: u64,
    items: *const PqQuery,
    status: *mut u32,
    n_items: u64,
    dim: u32,
    m: u32,
    bits: u32,
    residual: u32,
    table_capacity: u32,
    key_capacity: u32,
}

/// Threads per block the PQ search kernel's shared counts hold (`KVC_PQ_MAX_THREADS`).
pub(crate) const PQ_MAX_THREADS: u32 = 1024;
/// Most ranking keys a PQ search launch keeps in shared memory per query
/// (`KVC_PQ_MAX_SHARED_KEYS`).
pub(crate) const PQ_MAX_SHARED_KEYS: u32 = 65536;
/// Bytes of `KvcPqShared`, before the table in the PQ kernel's shared memory: four words, two
/// histograms of 2048 bins, 64 bin-group sums, two counts per 32 threads, two counts per thread
/// padded by a word every 32 threads.
pub(crate) const PQ_SHARED_HEADER_BYTES: u64 =
    4 * (4 + 2 * 2048 + 64 + 2 * 32 + 2 * (PQ_MAX_THREADS as u64 + PQ_MAX_THREADS as u64 / 32));

/// The shape of a PQ search launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PqShape {
    /// Threads per block.
    pub threads: u32,
    /// Table entries (`m * 2^bits`) its shared memory holds.
    pub table_entries: u32,
    /// Ranking keys its shared memory holds after the table: a query of at most this many
    /// tokens keeps its keys there, a longer one in the scratch buffer.
    pub key_capacity: u32,
}

impl PqShape {
    /// For a launch whose longest query sees `max_tokens` tokens, with `m * 2^bits` table
    /// entries: threads by that query (256 under 4096 tokens, 512 under 16 384, else 1024, so
    /// that a thread's share of a pass stays at 16 tokens or more), and as many ranking keys in
    /// shared memory as `shared_keys`, the longest query, the kernel's limit and
    /// `shared_budget` bytes per block allow. Errs if the table does not fit the kernel.
    pub(crate) fn new(
        max_tokens: u32,
        m: u32,
        bits: u32,
        shared_keys: u32,
        shared_budget: u64,
    ) -> Result<Self, CudaError> {
        let entries = u64::from(m).checked_shl(bits).unwrap_or(u64::MAX);
        let table_entries = match u32::try_from(entries) {
            Ok(e) if e <= crate::pq::MAX_TABLE_ENTRIES => e,
            _ => {
                return Err(CudaError::Input {
                    what: "m * 2^bits table entries exceed the kernel's shared memory",
                })
            }
        };
        let threads = match max_tokens {
            0..4096 => 256,
            4096..16384 => 512,
            _ => PQ_MAX_THREADS,
        };
        let room = shared_budget.saturating_sub(PQ_SHARED_HEADER_BYTES + 4 * entries) / 4;
        let room = u32::try_from(room).unwrap_or(u32::MAX);
        let key_capacity = shared_keys
            .min(max_tokens)
            .min(PQ_MAX_SHARED_KEYS)
            .min(room);
        Ok(PqShape {
            threads,
            table_entries,
            key_capacity,
        })
    }

    /// Dynamic shared memory per block: the header, the table, the keys.
    pub(crate) fn shared_bytes(&self) -> u64 {
        PQ_SHARED_HEADER_BYTES + 4 * (u64::from(self.table_entries) + u64::from(self.key_capacity))
    }
}

/// The buffers of one PQ search launch.
#[derive(Debug)]
pub(crate) struct PqIo<'a> {
    pub queries: &'a [f32],
    pub codewords: &'a [f32],
    pub codes: &'a [u8],
    pub keys: &'a mut [u32],
    pub out: &'a mut [u32],
    pub items: &'a [PqQuery],
    pub status: &'a mut [u32],
    pub dim: u32,
    pub m: u32,
    pub bits: u32,
    pub residual: u32,
}

/// Runs `kvc_pq_search` on the host: one block per query.
pub(crate) fn host_pq_search(io: PqIo<'_>, shape: PqShape) -> Result<(), CudaError> {
    let grid = u32::try_from(io.items.len()).map_err(|_| CudaError::Input {
        what: "more than 2^32 - 1 queries in one launch",
    })?;
    if io.status.len() != io.items.len() {
        return Err(CudaError::Input {
            what: "status buffer is not one entry per query",
        });
    }
    let args = PqArgsC {
        queries: io.queries.as_ptr(),
        n_queries: io.queries.len() as u64,
        codewords: io.codewords.as_ptr(),
        n_codewords: io.codewords.len() as u64,
        codes: io.codes.as_ptr(),
        n_codes: io.codes.len() as u64,
        keys: io.keys.as_mut_ptr(),
        n_keys: io.keys.len() as u64,
        out: io.out.as_mut_ptr(),
        n_out: io.out.len() as u64,
        items: io.items.as_ptr(),
        status: io.status.as_mut_ptr(),
        n_items: io.items.len() as u64,
        dim: io.dim,
        m: io.m,
        bits: io.bits,
        residual: io.residual,
        table_capacity: shape.table_entries,
        key_capacity: shape.key_capacity,
    };
    // SAFETY: invariants 1 (layout), 2 (every pointer/count pair is a live slice and its
    // length, borrowed for the call, mutably for the outputs) and 3 (launch shape: the shared
    // memory holds KvcPqShared, `table_capacity` table entries and `key_capacity` keys).
    let rc = unsafe { kvc_pq_search_host(&args, grid, shape.threads, shape.shared_bytes()) };
    host_ran(rc, "kvc_pq_search")
}

/// `KvcDequantArgs` (invariant 1).
#[repr(C)]
#[derive(Debug)]
struct DequantArgsC {
    q: *const i32,
    n_q: u64,
    exps: *const u8,
    n_exps: u64,
    sink: *const f32,
    n_sink: u64,
    consts: *const ChannelConsts,
    n_consts: u64,
    out: *mut u16,
    n_out: u64,
    pages: *const u32,
    n_pages: u64,
    blocks: *const DequantBlock,
    status: *mut u32,
    n_blocks: u64,
    heads: u32,
    head_dim: u32,
    page_size: u32,
    reserved: u32,
}

/// Threads per block of the dequantization kernel.
pub(crate) const DEQUANT_THREADS: u32 = 128;
/// Dynamic shared memory of the dequantization kernel (`KvcDequantShared`).
pub(crate) const DEQUANT_SHARED_BYTES: u32 = 4;

/// The buffers of one dequantization launch.
#[derive(Debug)]
pub(crate) struct DequantIo<'a> {
    pub q: &'a [i32],
    pub exps: &'a [u8],
    pub sink: &'a [f32],
    pub consts: &'a [ChannelConsts],
    pub blocks: &'a [DequantBlock],
    pub out: &'a mut [u16],
    pub status: &'a mut [u32],
    pub heads: u32,
    pub head_dim: u32,
    pub pages: &'a [u32],
    pub page_size: u32,
    pub dtype: OutDtype,
}

/// Runs `kvc_dequant_f16` or `kvc_dequant_bf16` on the host: one block per entry of
/// `io.blocks`.
pub(crate) fn host_dequant(io: DequantIo<'_>) -> Result<(), CudaError> {
    let grid = u32::try_from(io.blocks.len()).map_err(|_| CudaError::Input {
        what: "more than 2^32 - 1 blocks in one launch",
    })?;
    if io.status.len() != io.blocks.len() {
        return Err(CudaError::Input {
            what: "status buffer is not one entry per block",
        });
    }
    let args = DequantArgsC {
        q: io.q.as_ptr(),
        n_q: io.q.len() as u64,
        exps: io.exps.as_ptr(),
        n_exps: io.exps.len() as u64,
        sink: io.sink.as_ptr(),
        n_sink: io.sink.len() as u64,
        consts: io.consts.as_ptr(),
        n_consts: io.consts.len() as u64,
        out: io.out.as_mut_ptr(),
        n_out: io.out.len() as u64,
        pages: io.pages.as_ptr(),
        n_pages: io.pages.len() as u64,
        blocks: io.blocks.as_ptr(),
        status: io.status.as_mut_ptr(),
        n_blocks: io.blocks.len() as u64,
        heads: io.heads,
        head_dim: io.head_dim,
        page_size: io.page_size,
        reserved: 0,
    };
    let run = match io.dtype {
        OutDtype::F16 => kvc_dequant_f16_host,
        OutDtype::Bf16 => kvc_dequant_bf16_host,
    };
    let shared = u64::from(DEQUANT_SHARED_BYTES);
    // SAFETY: invariants 1 (layout), 2 (every pointer/count pair is a live slice and its
    // length, borrowed for the call, mutably for the outputs) and 3 (launch shape).
    let rc = unsafe { run(&args, grid, DEQUANT_THREADS, shared) };
    host_ran(rc, io.dtype.entry())
}

/// The dequantization kernel's f32 to bf16 narrowing.
pub(crate) fn kernel_f32_to_bf16(x: f32) -> u16 {
    // SAFETY: a pure function of its argument.
    unsafe { kvc_f32_to_bf16_host(x) }
}

/// The dequantization kernel's f32 to f16 narrowing.
pub(crate) fn kernel_f32_to_f16(x: f32) -> u16 {
    // SAFETY: a pure function of its argument.
    unsafe { kvc_f32_to_f16_host(x) }
}

/// The word of a lane-decode kernel: `u32` for format v2's `kvc_rans_lane_decode`, `u16` for
/// the 32-bit-state experiment `kvc_rans32_lane_decode_experiment` (not part of any format).
pub(crate) trait LaneWord: DeviceRepr + ValidAsZeroBits + Copy + 'static {
    /// The kernel's entry point.
    const ENTRY: &'static str;
    /// Its host build (invariant 1: both take the same argument layout).
    const HOST: unsafe extern "C" fn(*const LaneDecodeArgsC, u32, u32, u64) -> c_int;
}

impl LaneWord for u32 {
    const ENTRY: &'static str = "kvc_rans_lane_decode";
    const HOST: unsafe extern "C" fn(*const LaneDecodeArgsC, u32, u32, u64) -> c_int =
        kvc_rans_lane_decode_host;
}

impl LaneWord for u16 {
    const ENTRY: &'static str = "kvc_rans32_lane_decode_experiment";
    const HOST: unsafe extern "C" fn(*const LaneDecodeArgsC, u32, u32, u64) -> c_int =
        kvc_rans32_lane_decode_experiment_host;
}

/// The buffers of one lane-decode launch (words of `W`: see [`LaneWord`]).
#[derive(Debug)]
pub(crate) struct LaneDecodeIo<'a, W = u32> {
    pub words: &'a [W],
    /// Packed tables, [`SLOTS`] entries each (a partial last table is ignored).
    pub tables: &'a [u32],
    pub table_list: &'a [u32],
    pub symbol_table: &'a [u16],
    pub blocks: &'a [LaneBlock],
    pub symbols: &'a mut [u8],
    pub status: &'a mut [u32],
    /// Tables the launch's shared memory holds.
    pub shared_tables: u32,
}

/// Runs `kvc_rans_lane_decode` (or, for `u16` words, the experiment) on the host: one block
/// per entry of `io.blocks`.
pub(crate) fn host_lane_decode<W: LaneWord>(io: LaneDecodeIo<'_, W>) -> Result<(), CudaError> {
    let grid = u32::try_from(io.blocks.len()).map_err(|_| CudaError::Input {
        what: "more than 2^32 - 1 blocks in one launch",
    })?;
    if io.symbols.len() != io.symbol_table.len() {
        return Err(CudaError::Input {
            what: "symbol and symbol-table buffers differ in length",
        });
    }
    if io.status.len() != io.blocks.len() * LANES {
        return Err(CudaError::Input {
            what: "status buffer is not 32 entries per block",
        });
    }
    let args = LaneDecodeArgsC {
        words: io.words.as_ptr().cast(),
        n_words: io.words.len() as u64,
        tables: io.tables.as_ptr(),
        n_tables: (io.tables.len() / SLOTS) as u64,
        table_list: io.table_list.as_ptr(),
        n_table_list: io.table_list.len() as u64,
        symbol_table: io.symbol_table.as_ptr(),
        symbols: io.symbols.as_mut_ptr(),
        n_symbols: io.symbols.len() as u64,
        blocks: io.blocks.as_ptr(),
        status: io.status.as_mut_ptr(),
        n_blocks: io.blocks.len() as u64,
        shared_tables: u64::from(io.shared_tables),
    };
    let shared_bytes = u64::from(io.shared_tables) * (SLOTS as u64) * 4;
    // SAFETY: invariant 1 (layout; `words` points to `n_words` words of the kernel's word
    // type W), 2 (every pointer/count pair is a live slice and its length; `io` borrows them
    // for the call, mutably for the outputs) and 3 (launch shape).
    let rc = unsafe { W::HOST(&args, grid, LANES as u32, shared_bytes) };
    host_ran(rc, W::ENTRY)
}

#[cfg(test)]
/// The sizes and offsets the C++ compiler gives the kernel's argument structs, then `KVC_LANES`
/// and `KVC_PRECISION` (see `kvc_rans_lane_decode_layout`).
pub(crate) fn host_lane_decode_layout() -> Vec<u64> {
    host_layout(kvc_rans_lane_decode_layout)
}

#[cfg(test)]
/// [`host_lane_decode_layout`] for the 32-bit-state experiment's kernel.
pub(crate) fn host_lane32_decode_layout() -> Vec<u64> {
    host_layout(kvc_rans32_lane_decode_experiment_layout)
}

#[cfg(test)]
/// What one of the kernels' `*_layout` functions reports: the sizes and offsets the C++
/// compiler gives their argument structs (at most 64 values).
fn host_layout(layout: unsafe extern "C" fn(*mut u64, u64) -> u64) -> Vec<u64> {
    let mut out = vec![0u64; 128];
    // SAFETY: every `*_layout` function writes at most `cap` (= out.len()) values to `out`.
    let n = unsafe { layout(out.as_mut_ptr(), out.len() as u64) };
    out.truncate((n as usize).min(128));
    out
}

#[cfg(test)]
/// The sizes and offsets of [`LaneBlock`] and the argument mirror, in the order of
/// [`host_lane_decode_layout`] (without the two constants).
pub(crate) fn rust_lane_decode_layout() -> Vec<u64> {
    use std::mem::{offset_of, size_of};
    type B = LaneBlock;
    type A = LaneDecodeArgsC;
    [
        size_of::<B>(),
        offset_of!(B, word_start),
        offset_of!(B, symbol_start),
        offset_of!(B, n_symbols),
        offset_of!(B, table_start),
        offset_of!(B, table_count),
        offset_of!(B, lane_len),
        size_of::<A>(),
        offset_of!(A, words),
        offset_of!(A, n_words),
        offset_of!(A, tables),
        offset_of!(A, n_tables),
        offset_of!(A, table_list),
        offset_of!(A, n_table_list),
        offset_of!(A, symbol_table),
        offset_of!(A, symbols),
        offset_of!(A, n_symbols),
        offset_of!(A, blocks),
        offset_of!(A, status),
        offset_of!(A, n_blocks),
        offset_of!(A, shared_tables),
    ]
    .map(|x| x as u64)
    .to_vec()
}

// ---------------------------------------------------------------------------------------------
// NVRTC

/// The NVRTC functions this crate calls (through cudarc), checked before the first call.
pub(crate) const NVRTC_SYMBOLS: [&str; 10] = [
    "nvrtcVersion",
    "nvrtcCreateProgram",
    "nvrtcCompileProgram",
    "nvrtcDestroyProgram",
    "nvrtcGetProgramLogSize",
    "nvrtcGetProgramLog",
    "nvrtcGetCUBINSize",
    "nvrtcGetCUBIN",
    "nvrtcGetErrorString",
    "nvrtcGetPTXSize",
];

/// Libraries loaded by full path, kept loaded for the life of the process so that cudarc's
/// load by name (`libnvrtc.so.13`) finds them: the dynamic loader matches an already loaded
/// library by its soname.
static PRELOADED: Mutex<Vec<libloading::Library>> = Mutex::new(Vec::new());

/// Loads `dir/libnvrtc.so.13` and, if present, `dir/libnvrtc-builtins.so.*` (NVRTC loads it by
/// name at compile time), and keeps them loaded.
pub(crate) fn nvrtc_preload(dir: &Path) -> Result<(), CudaError> {
    let mut paths = vec![dir.join("libnvrtc.so.13")];
    if let Ok(entries) = std::fs::read_dir(dir) {
        let mut builtins: Vec<_> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("libnvrtc-builtins.so"))
            })
            .collect();
        builtins.sort();
        // The builtins first: libnvrtc then finds them already loaded.
        paths.splice(0..0, builtins);
    }
    let mut held = PRELOADED.lock().unwrap_or_else(|e| e.into_inner());
    for path in paths {
        // SAFETY: loading a library runs its initialisers; NVRTC's have no preconditions. The
        // handle is kept in PRELOADED, so the library is never unloaded while cudarc uses it.
        let lib = unsafe { libloading::Library::new(&path) }.map_err(|e| CudaError::NvrtcLib {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
        held.push(lib);
    }
    Ok(())
}

/// Whether cudarc can load NVRTC by name (invariant 4).
pub(crate) fn nvrtc_present() -> bool {
    // SAFETY: only tries to load the library (running its initialisers), as nvrtc_preload does.
    unsafe { nvrtc::is_culib_present() }
}

/// The first of [`NVRTC_SYMBOLS`] the loaded NVRTC lacks. Call only after [`nvrtc_present`].
pub(crate) fn nvrtc_missing_symbol() -> Option<&'static str> {
    // SAFETY: nvrtc_present() returned true, so culib() loads without panicking (invariant 4);
    // the symbols are only looked up, not called.
    let lib = unsafe { nvrtc::culib() };
    NVRTC_SYMBOLS.into_iter().find(|name| {
        // SAFETY: as above; `*const ()` is never dereferenced.
        unsafe { lib.get::<*const ()>(name.as_bytes()) }.is_err()
    })
}

/// NVRTC's version `(major, minor)`. Call only once [`nvrtc_missing_symbol`] gave `None`.
pub(crate) fn nvrtc_version() -> Result<(i32, i32), CudaError> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: invariant 4; both pointers are to live locals.
    let r = unsafe { nvrtc::nvrtcVersion(&mut major, &mut minor) };
    nvrtc_ok("nvrtcVersion", r)?;
    Ok((major, minor))
}

/// What compiling one program gave.
#[derive(Debug)]
pub(crate) struct NvrtcOutput {
    /// Whether compilation succeeded.
    pub ok: bool,
    /// The program log (ptxas' resource report with `--ptxas-options=-v`).
    pub log: String,
    /// Bytes of the CUBIN (0 when compiled to PTX only or on failure).
    pub cubin_len: usize,
    /// The CUBIN (empty when compiled to PTX only or on failure).
    pub cubin: Vec<u8>,
}

/// One source to compile: its name, text, the headers it includes by name, and the options.
#[derive(Debug)]
pub(crate) struct NvrtcProgram<'a> {
    pub name: &'a str,
    pub source: &'a str,
    pub headers: &'a [(&'a str, &'a str)],
    pub options: &'a [String],
}

/// Compiles `program`. Call only once [`nvrtc_missing_symbol`] gave `None`.
pub(crate) fn nvrtc_compile(program: &NvrtcProgram<'_>) -> Result<NvrtcOutput, CudaError> {
    let input = |what: &'static str| move |_| CudaError::Input { what };
    let name = CString::new(program.name).map_err(input("NUL in a kernel name"))?;
    let source = CString::new(program.source).map_err(input("NUL in a kernel source"))?;
    let cstrings = |v: Vec<&str>, what| -> Result<Vec<CString>, CudaError> {
        v.into_iter()
            .map(|s| CString::new(s).map_err(input(what)))
            .collect()
    };
    let h_names = cstrings(
        program.headers.iter().map(|h| h.0).collect(),
        "NUL in a header",
    )?;
    let h_srcs = cstrings(
        program.headers.iter().map(|h| h.1).collect(),
        "NUL in a header",
    )?;
    let opts = cstrings(
        program.options.iter().map(|s| s.as_str()).collect(),
        "NUL in an option",
    )?;
    let ptrs = |v: &[CString]| v.iter().map(|s| s.as_ptr()).collect::<Vec<*const c_char>>();
    let (h_names, h_srcs, opts) = (ptrs(&h_names), ptrs(&h_srcs), ptrs(&opts));

    let mut prog: nvrtc::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: invariant 4; every pointer is to a NUL-terminated string that lives until this
    // function returns (invariant 5), the header arrays have `h_names.len()` entries each.
    let r = unsafe {
        nvrtc::nvrtcCreateProgram(
            &mut prog,
            source.as_ptr(),
            name.as_ptr(),
            h_names.len() as c_int,
            h_srcs.as_ptr(),
            h_names.as_ptr(),
        )
    };
    nvrtc_ok("nvrtcCreateProgram", r)?;
    let out = compile_created(prog, &opts);
    // SAFETY: `prog` was created above and is destroyed once (invariant 5).
    let r = unsafe { nvrtc::nvrtcDestroyProgram(&mut prog) };
    let out = out?;
    nvrtc_ok("nvrtcDestroyProgram", r)?;
    Ok(out)
}

/// Compiles a created program and reads its log and CUBIN size.
fn compile_created(
    prog: nvrtc::nvrtcProgram,
    opts: &[*const c_char],
) -> Result<NvrtcOutput, CudaError> {
    // SAFETY: `prog` is live (invariant 5); `opts` holds `opts.len()` live C strings.
    let r = unsafe { nvrtc::nvrtcCompileProgram(prog, opts.len() as c_int, opts.as_ptr()) };
    let ok = r == nvrtc::nvrtcResult::NVRTC_SUCCESS;
    if !ok && r != nvrtc::nvrtcResult::NVRTC_ERROR_COMPILATION {
        nvrtc_ok("nvrtcCompileProgram", r)?;
    }
    let mut len = 0usize;
    // SAFETY: `prog` is live; `len` is a live local.
    nvrtc_ok("nvrtcGetProgramLogSize", unsafe {
        nvrtc::nvrtcGetProgramLogSize(prog, &mut len)
    })?;
    let mut buf = vec![0u8; len.max(1)];
    // SAFETY: `buf` has room for the `len` bytes (NUL included) NVRTC reported.
    nvrtc_ok("nvrtcGetProgramLog", unsafe {
        nvrtc::nvrtcGetProgramLog(prog, buf.as_mut_ptr().cast())
    })?;
    let log = CStr::from_bytes_until_nul(&buf)
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut cubin_len = 0usize;
    if ok {
        // SAFETY: `prog` is live and compiled; `cubin_len` is a live local. A PTX-only
        // compilation reports an error here, which means "no CUBIN".
        let r = unsafe { nvrtc::nvrtcGetCUBINSize(prog, &mut cubin_len) };
        if r != nvrtc::nvrtcResult::NVRTC_SUCCESS {
            cubin_len = 0;
        }
    }
    let mut cubin = vec![0u8; cubin_len];
    if cubin_len > 0 {
        // SAFETY: `prog` is live and compiled; `cubin` has the `cubin_len` bytes NVRTC reported.
        nvrtc_ok("nvrtcGetCUBIN", unsafe {
            nvrtc::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast())
        })?;
    }
    Ok(NvrtcOutput {
        ok,
        log,
        cubin_len,
        cubin,
    })
}

/// `Ok` for NVRTC_SUCCESS, else the call's error with NVRTC's name for the code.
fn nvrtc_ok(call: &'static str, r: nvrtc::nvrtcResult) -> Result<(), CudaError> {
    if r == nvrtc::nvrtcResult::NVRTC_SUCCESS {
        return Ok(());
    }
    Err(CudaError::Nvrtc {
        call,
        code: format!("{r:?}"),
    })
}

// ---------------------------------------------------------------------------------------------
// Driver

/// Whether cudarc can load the CUDA driver library (invariant 4).
pub(crate) fn driver_present() -> bool {
    // SAFETY: only tries to load the library (running its initialisers).
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Initialises the driver and counts its devices; [`CudaError::NoDriver`] without a driver
/// library (invariant 4: cudarc panics then).
pub(crate) fn driver_device_count() -> Result<usize, CudaError> {
    if !driver_present() {
        return Err(CudaError::NoDriver);
    }
    let err = |call| {
        move |e: cudarc::driver::DriverError| CudaError::Driver {
            call,
            code: format!("{:?}", e.0),
        }
    };
    cudarc::driver::result::init().map_err(err("cuInit"))?;
    let n = cudarc::driver::result::device::get_count().map_err(err("cuDeviceGetCount"))?;
    Ok(usize::try_from(n).unwrap_or(0))
}

/// The primary context of device `ordinal`, once [`driver_device_count`] showed it exists.
pub(crate) fn driver_context(
    ordinal: usize,
) -> Result<std::sync::Arc<cudarc::driver::CudaContext>, CudaError> {
    let count = driver_device_count()?;
    if ordinal >= count {
        return Err(CudaError::NoDevice { ordinal, count });
    }
    cudarc::driver::CudaContext::new(ordinal).map_err(|e| CudaError::Driver {
        call: "cuDevicePrimaryCtxRetain",
        code: format!("{:?}", e.0),
    })
}

#[cfg(test)]
fn rust_dequant_layout() -> Vec<u64> {
    use std::mem::{offset_of, size_of};
    type K = ChannelConsts;
    type B = DequantBlock;
    type A = DequantArgsC;
    [
        size_of::<K>(),
        offset_of!(K, mean),
        offset_of!(K, anchor_step),
        offset_of!(K, delta_step),
        offset_of!(K, weight),
        size_of::<B>(),
        offset_of!(B, q_start),
        offset_of!(B, exp_start),
        offset_of!(B, sink_start),
        offset_of!(B, out_start),
        offset_of!(B, consts_start),
        offset_of!(B, rows),
        offset_of!(B, sink_rows),
        offset_of!(B, group),
        offset_of!(B, has_exps),
        offset_of!(B, token_start),
        offset_of!(B, page_start),
        size_of::<A>(),
        offset_of!(A, q),
        offset_of!(A, n_q),
        offset_of!(A, exps),
        offset_of!(A, n_exps),
        offset_of!(A, sink),
        offset_of!(A, n_sink),
        offset_of!(A, consts),
        offset_of!(A, n_consts),
        offset_of!(A, out),
        offset_of!(A, n_out),
        offset_of!(A, pages),
        offset_of!(A, n_pages),
        offset_of!(A, blocks),
        offset_of!(A, status),
        offset_of!(A, n_blocks),
        offset_of!(A, heads),
        offset_of!(A, head_dim),
        offset_of!(A, page_size),
    ]
    .map(|x| x as u64)
    .to_vec()
}

#[cfg(test)]
fn rust_encode_layout() -> Vec<u64> {
    use std::mem::{offset_of, size_of};
    type B = QuantBlock;
    type A = QuantArgsC;
    type E = LaneEncodeBlock;
    type L = LaneEncodeArgsC;
    [
        size_of::<B>(),
        offset_of!(B, x_start),
        offset_of!(B, exp_start),
        offset_of!(B, q_start),
        offset_of!(B, consts_start),
        offset_of!(B, rows),
        offset_of!(B, sink_rows),
        offset_of!(B, group),
        offset_of!(B, has_exps),
        size_of::<A>(),
        offset_of!(A, x),
        offset_of!(A, n_x),
        offset_of!(A, exps),
        offset_of!(A, n_exps),
        offset_of!(A, consts),
        offset_of!(A, n_consts),
        offset_of!(A, q),
        offset_of!(A, n_q),
        offset_of!(A, blocks),
        offset_of!(A, status),
        offset_of!(A, n_blocks),
        offset_of!(A, heads),
        offset_of!(A, head_dim),
        size_of::<E>(),
        offset_of!(E, symbol_start),
        offset_of!(E, word_start),
        offset_of!(E, n_symbols),
        offset_of!(E, lane_cap),
        offset_of!(E, table_start),
        offset_of!(E, table_count),
        size_of::<L>(),
        offset_of!(L, symbols),
        offset_of!(L, symbol_table),
        offset_of!(L, n_symbols),
        offset_of!(L, tables),
        offset_of!(L, n_tables),
        offset_of!(L, table_list),
        offset_of!(L, n_table_list),
        offset_of!(L, words),
        offset_of!(L, n_words),
        offset_of!(L, lane_len),
        offset_of!(L, blocks),
        offset_of!(L, status),
        offset_of!(L, n_blocks),
        codec_core::consts::MAX_SYMBOL as usize,
    ]
    .map(|x| x as u64)
    .to_vec()
}

#[cfg(test)]
fn rust_encode_chain_layout() -> Vec<u64> {
    use std::mem::{offset_of, size_of};
    type B = EncBlock;
    type R = EncResult;
    type A = EncodeArgsC;
    [
        size_of::<B>(),
        offset_of!(B, x_start),
        offset_of!(B, k_start),
        offset_of!(B, qref_start),
        offset_of!(B, tau_start),
        offset_of!(B, consts_start),
        offset_of!(B, map_start),
        offset_of!(B, sym_start),
        offset_of!(B, q_start),
        offset_of!(B, escape_start),
        offset_of!(B, word_start),
        offset_of!(B, rows),
        offset_of!(B, sink_rows),
        offset_of!(B, group),
        offset_of!(B, importance),
        offset_of!(B, table_start),
        offset_of!(B, table_count),
        offset_of!(B, lane_cap),
        offset_of!(B, rot_start),
        offset_of!(B, rotate),
        size_of::<R>(),
        offset_of!(R, status),
        offset_of!(R, n_e),
        offset_of!(R, n_escapes),
        offset_of!(R, n_exp),
        offset_of!(R, exp_freqs),
        size_of::<A>(),
        offset_of!(A, src),
        offset_of!(A, n_src),
        offset_of!(A, dtype),
        offset_of!(A, max_exp),
        offset_of!(A, slope),
        offset_of!(A, inv_sqrt_d),
        offset_of!(A, qref),
        offset_of!(A, n_qref),
        offset_of!(A, tau),
        offset_of!(A, n_tau),
        offset_of!(A, rot),
        offset_of!(A, n_rot),
        offset_of!(A, consts),
        offset_of!(A, n_consts),
        offset_of!(A, map),
        offset_of!(A, n_map),
        offset_of!(A, table_list),
        offset_of!(A, n_table_list),
        offset_of!(A, radius),
        offset_of!(A, n_radius),
        offset_of!(A, tables),
        offset_of!(A, n_tables),
        offset_of!(A, symbols),
        offset_of!(A, symbol_table),
        offset_of!(A, n_symbols),
        offset_of!(A, q),
        offset_of!(A, n_q),
        offset_of!(A, escapes),
        offset_of!(A, n_escapes),
        offset_of!(A, blocks),
        offset_of!(A, results),
        offset_of!(A, lane_blocks),
        offset_of!(A, n_blocks),
        offset_of!(A, heads),
        offset_of!(A, head_dim),
        offset_of!(A, rope_style),
        ENCODE_SHARED_BYTES as usize,
        size_of::<ChunkOut>(),
        offset_of!(ChunkOut, first_block),
        offset_of!(ChunkOut, out_start),
        offset_of!(ChunkOut, out_cap),
        offset_of!(ChunkOut, n_blocks),
        size_of::<ChunkResult>(),
        offset_of!(ChunkResult, len),
        offset_of!(ChunkResult, status),
        size_of::<WriteArgsC>(),
        offset_of!(WriteArgsC, src),
        offset_of!(WriteArgsC, n_src_bytes),
        offset_of!(WriteArgsC, elem_bytes),
        offset_of!(WriteArgsC, heads),
        offset_of!(WriteArgsC, head_dim),
        offset_of!(WriteArgsC, blocks),
        offset_of!(WriteArgsC, results),
        offset_of!(WriteArgsC, n_blocks),
        offset_of!(WriteArgsC, escapes),
        offset_of!(WriteArgsC, n_escapes),
        offset_of!(WriteArgsC, words),
        offset_of!(WriteArgsC, n_words),
        offset_of!(WriteArgsC, lane_len),
        offset_of!(WriteArgsC, lane_status),
        offset_of!(WriteArgsC, chunks),
        offset_of!(WriteArgsC, chunk_results),
        offset_of!(WriteArgsC, n_chunks),
        offset_of!(WriteArgsC, out),
        offset_of!(WriteArgsC, n_out),
        WRITE_SHARED_BYTES as usize,
        size_of::<SealResult>(),
        offset_of!(SealResult, start),
        offset_of!(SealResult, len),
        offset_of!(SealResult, status),
        size_of::<SealArgsC>(),
        offset_of!(SealArgsC, chunks),
        offset_of!(SealArgsC, chunk_results),
        offset_of!(SealArgsC, n_chunks),
        offset_of!(SealArgsC, out),
        offset_of!(SealArgsC, n_out),
        offset_of!(SealArgsC, sealed),
        offset_of!(SealArgsC, n_sealed),
        offset_of!(SealArgsC, seal_results),
        SEAL_SHARED_BYTES as usize,
    ]
    .map(|x| x as u64)
    .to_vec()
}

#[cfg(test)]
fn rust_chain_layout() -> Vec<u64> {
    use std::mem::{offset_of, size_of};
    type R = ResolveBlock;
    type RA = ResolveArgsC;
    type V = ValueBlock;
    type VA = ValueArgsC;
    [
        size_of::<R>(),
        offset_of!(R, symbol_start),
        offset_of!(R, exp_start),
        offset_of!(R, map_start),
        offset_of!(R, n_e),
        offset_of!(R, n_sym),
        offset_of!(R, sink_rows),
        offset_of!(R, group),
        offset_of!(R, has_exps),
        size_of::<RA>(),
        offset_of!(RA, symbol_table),
        offset_of!(RA, n_symbol_table),
        offset_of!(RA, exps),
        offset_of!(RA, n_exps),
        offset_of!(RA, map),
        offset_of!(RA, n_map),
        offset_of!(RA, blocks),
        offset_of!(RA, status),
        offset_of!(RA, n_blocks),
        offset_of!(RA, heads),
        offset_of!(RA, head_dim),
        size_of::<V>(),
        offset_of!(V, index_start),
        offset_of!(V, list_start),
        offset_of!(V, escape_start),
        offset_of!(V, q_start),
        offset_of!(V, n_sym),
        offset_of!(V, n_escapes),
        offset_of!(V, list_len),
        size_of::<VA>(),
        offset_of!(VA, indices),
        offset_of!(VA, symbol_table),
        offset_of!(VA, n_indices),
        offset_of!(VA, table_list),
        offset_of!(VA, n_table_list),
        offset_of!(VA, radius),
        offset_of!(VA, n_radius),
        offset_of!(VA, escapes),
        offset_of!(VA, n_escapes),
        offset_of!(VA, q),
        offset_of!(VA, n_q),
        offset_of!(VA, blocks),
        offset_of!(VA, status),
        offset_of!(VA, n_blocks),
        VALUE_SHARED_BYTES as usize,
    ]
    .map(|x| x as u64)
    .to_vec()
}

#[cfg(test)]
fn rust_pq_layout() -> Vec<u64> {
    use std::mem::{offset_of, size_of};
    type Q = PqQuery;
    type A = PqArgsC;
    [
        size_of::<Q>(),
        offset_of!(Q, query_start),
        offset_of!(Q, codebook_start),
        offset_of!(Q, codes_start),
        offset_of!(Q, keys_start),
        offset_of!(Q, out_start),
        offset_of!(Q, tokens),
        offset_of!(Q, group_heads),
        offset_of!(Q, k),
        offset_of!(Q, n_init),
        offset_of!(Q, n_local),
        size_of::<A>(),
        offset_of!(A, queries),
        offset_of!(A, n_queries),
        offset_of!(A, codewords),
        offset_of!(A, n_codewords),
        offset_of!(A, codes),
        offset_of!(A, n_codes),
        offset_of!(A, keys),
        offset_of!(A, n_keys),
        offset_of!(A, out),
        offset_of!(A, n_out),
        offset_of!(A, items),
        offset_of!(A, status),
        offset_of!(A, n_items),
        offset_of!(A, dim),
        offset_of!(A, m),
        offset_of!(A, bits),
        offset_of!(A, residual),
        offset_of!(A, table_capacity),
        offset_of!(A, key_capacity),
        PQ_SHARED_HEADER_BYTES as usize,
        PQ_MAX_THREADS as usize,
    ]
    .map(|x| x as u64)
    .to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Asserts that two structs have the same size and the same offsets of the fields named.
    macro_rules! same {
        ($a:ty, $b:ty, $($f:ident),*) => {
            assert_eq!(std::mem::size_of::<$a>(), std::mem::size_of::<$b>());
            $(assert_eq!(
                std::mem::offset_of!($a, $f),
                std::mem::offset_of!($b, $f),
                stringify!($f)
            );)*
        };
    }

    /// Invariant 7: the device argument structs have the host mirrors' layouts (addresses where
    /// the host has pointers), which `*layouts_match_the_kernel` compare with the C++ structs.
    #[test]
    fn device_layouts_match_the_host_mirrors() {
        same!(
            LaneDecodeArgsC,
            LaneDecodeArgsDev,
            words,
            n_words,
            tables,
            n_tables,
            table_list,
            n_table_list,
            symbol_table,
            symbols,
            n_symbols,
            blocks,
            status,
            n_blocks,
            shared_tables
        );
        same!(
            DequantArgsC,
            DequantArgsDev,
            q,
            n_q,
            exps,
            n_exps,
            sink,
            n_sink,
            consts,
            n_consts,
            out,
            n_out,
            pages,
            n_pages,
            blocks,
            status,
            n_blocks,
            heads,
            head_dim,
            page_size,
            reserved
        );
        same!(
            PqArgsC,
            PqArgsDev,
            queries,
            n_queries,
            codewords,
            n_codewords,
            codes,
            n_codes,
            keys,
            n_keys,
            out,
            n_out,
            items,
            status,
            n_items,
            dim,
            m,
            bits,
            residual,
            table_capacity,
            key_capacity
        );
    }

    /// Invariant 7 for the encode chain's two argument structs.
    #[test]
    fn encode_chain_device_layouts_match_the_host_mirrors() {
        same!(
            EncodeArgsC,
            EncodeArgsDev,
            src,
            n_src,
            dtype,
            max_exp,
            slope,
            inv_sqrt_d,
            qref,
            n_qref,
            tau,
            n_tau,
            rot,
            n_rot,
            consts,
            n_consts,
            map,
            n_map,
            table_list,
            n_table_list,
            radius,
            n_radius,
            tables,
            n_tables,
            symbols,
            symbol_table,
            n_symbols,
            q,
            n_q,
            escapes,
            n_escapes,
            blocks,
            results,
            lane_blocks,
            n_blocks,
            heads,
            head_dim,
            rope_style,
            reserved
        );
        same!(
            WriteArgsC,
            WriteArgsDev,
            src,
            n_src_bytes,
            elem_bytes,
            heads,
            head_dim,
            reserved,
            blocks,
            results,
            n_blocks,
            escapes,
            n_escapes,
            words,
            n_words,
            lane_len,
            lane_status,
            chunks,
            chunk_results,
            n_chunks,
            out,
            n_out
        );
        same!(
            SealArgsC,
            SealArgsDev,
            chunks,
            chunk_results,
            n_chunks,
            out,
            n_out,
            sealed,
            n_sealed,
            seal_results
        );
    }

    #[test]
    fn chain_layouts_match_the_kernel() {
        assert_eq!(host_layout(kvc_chain_layout), rust_chain_layout());
    }

    #[test]
    fn encode_layouts_match_the_kernel() {
        assert_eq!(host_layout(kvc_encode_layout), rust_encode_layout());
    }

    #[test]
    fn encode_chain_layouts_match_the_kernel() {
        assert_eq!(
            host_layout(kvc_encode_chain_layout),
            rust_encode_chain_layout()
        );
    }

    #[test]
    fn pq_layouts_match_the_kernel() {
        assert_eq!(host_layout(kvc_pq_layout), rust_pq_layout());
    }

    #[test]
    fn dequant_layouts_match_the_kernel() {
        assert_eq!(host_layout(kvc_dequant_layout), rust_dequant_layout());
    }

    /// A value block for [`map_values_match_a_plain_mapping`]: its symbols' table indices,
    /// table list, symbols and escapes, and the values a plain mapping gives.
    struct ValueCase {
        symbol_table: Vec<u16>,
        table_list: Vec<u32>,
        radius: Vec<u8>,
        indices: Vec<u8>,
        escapes: Vec<i32>,
        want: Vec<i32>,
    }

    fn value_case(list_len: u32, n_sym: u32, seed: u64) -> ValueCase {
        let mut x = seed | 1;
        let mut next = move |n: u32| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % u64::from(n)) as u32
        };
        let radius: Vec<u8> = (0..64).map(|_| next(11) as u8).collect();
        let table_list: Vec<u32> = (0..list_len).map(|_| next(64)).collect();
        let (mut symbol_table, mut indices) = (Vec::new(), Vec::new());
        let (mut escapes, mut want) = (Vec::new(), Vec::new());
        for _ in 0..n_sym {
            let t = next(list_len);
            let r = i32::from(radius[table_list[t as usize] as usize]);
            symbol_table.push(t as u16);
            if next(10) == 0 {
                // An escape: its value lies beyond the radius, either sign.
                let v = (r + 1 + next(1000) as i32) * if next(2) == 0 { 1 } else { -1 };
                indices.push((2 * r + 1) as u8);
                escapes.push(v);
                want.push(v);
            } else {
                let i = next(2 * r as u32 + 1) as i32;
                indices.push(i as u8);
                want.push(i - r);
            }
        }
        ValueCase {
            symbol_table,
            table_list,
            radius,
            indices,
            escapes,
            want,
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(48))]

        /// `kvc_map_values` against a plain mapping (a symbol i of a radius-r table is i - r,
        /// above 2r the next escape): table lists short enough for their radii to be staged in
        /// shared memory and too long for it, a second block after the first; a table index
        /// outside the list or an escape within the radius gives the block's error status.
        #[test]
        fn map_values_match_a_plain_mapping(
            list_len in proptest::prop_oneof![1u32..300, 4090u32..4200],
            n_sym in 0u32..3000,
            seed in proptest::prelude::any::<u64>(),
            corrupt in 0u8..3,
        ) {
            let mut c = value_case(list_len, n_sym, seed);
            let second = value_case(7, 100, !seed);
            let want_status = match corrupt {
                1 if n_sym > 0 => {
                    c.symbol_table[(seed % u64::from(n_sym)) as usize] = list_len as u16;
                    1
                }
                2 if !c.escapes.is_empty() => {
                    c.escapes[0] = 0;
                    2
                }
                _ => 0,
            };
            let block = |i: u64, l: u64, e: u64, case: &ValueCase, list_len: u32| ValueBlock {
                index_start: i,
                list_start: l,
                escape_start: e,
                q_start: i,
                n_sym: case.indices.len() as u32,
                n_escapes: case.escapes.len() as u32,
                list_len,
                reserved: 0,
            };
            let n = c.indices.len() as u64;
            let blocks = [
                block(0, 0, 0, &c, list_len),
                block(n, list_len.into(), c.escapes.len() as u64, &second, 7),
            ];
            // One radius table for both blocks: the second's table ids shifted past the first's.
            let mut radius = c.radius.clone();
            radius.extend(&second.radius);
            let mut table_list = c.table_list.clone();
            table_list.extend(second.table_list.iter().map(|t| t + 64));
            let cat = |a: &[u16], b: &[u16]| [a, b].concat();
            let symbol_table = cat(&c.symbol_table, &second.symbol_table);
            let indices = [&c.indices[..], &second.indices].concat();
            let escapes = [&c.escapes[..], &second.escapes].concat();
            let mut q = vec![0i32; indices.len()];
            let mut status = vec![9u32; 2];
            host_map_values(ValueIo {
                indices: &indices,
                symbol_table: &symbol_table,
                table_list: &table_list,
                radius: &radius,
                escapes: &escapes,
                q: &mut q,
                blocks: &blocks,
                status: &mut status,
            })
            .unwrap();
            proptest::prop_assert_eq!(status, vec![want_status, 0]);
            if want_status == 0 {
                proptest::prop_assert_eq!(&q[..n as usize], &c.want[..]);
            }
            proptest::prop_assert_eq!(&q[n as usize..], &second.want[..]);
        }
    }

    /// Invariant 6 for views: every packed part starts aligned, after the previous part's
    /// bytes, and an empty part still takes an aligned unit (its address is never shared).
    #[test]
    fn packed_parts_are_aligned_and_disjoint() {
        let (a, b, c) = ([1u8; 3], [0u32; 0], [LaneBlock::default(); 2]);
        let gather: [&[u16]; 2] = [&[1; 100], &[2; 29]];
        let mut p = Packer::default();
        let sa = p.add(&a[..]);
        let sb = p.add(&b[..]);
        let sc = p.add(&c[..]);
        let sg = p.add_gather(&gather);
        let slots = [
            (sa.offset, sa.len),
            (sb.offset, sb.len * 4),
            (sc.offset, sc.len * size_of::<LaneBlock>()),
            (sg.offset, sg.len * 2),
        ];
        assert_eq!((sa.len, sb.len, sc.len, sg.len), (3, 0, 2, 129));
        for w in slots.windows(2) {
            assert_eq!(w[0].0 % PACK_ALIGN, 0);
            assert!(w[0].0 + w[0].1.max(1) <= w[1].0, "{slots:?}");
        }
        assert_eq!(
            p.total,
            sg.offset + (129 * 2usize).next_multiple_of(PACK_ALIGN)
        );
        let bytes: Vec<u8> = p.parts[3].0.concat();
        assert_eq!(bytes.len(), 258);
        assert_eq!(&bytes[198..202], &[1, 0, 2, 0]);
    }

    /// Invariant 1: the Rust mirrors have the C++ layouts, and the kernel's constants are
    /// codec-core's.
    #[test]
    fn layouts_match_the_kernel() {
        let host = host_lane_decode_layout();
        let mut rust = rust_lane_decode_layout();
        rust.push(codec_core::consts::LANES as u64);
        rust.push(u64::from(codec_core::consts::PRECISION));
        assert_eq!(host, rust);
        assert_eq!(host_lane32_decode_layout(), rust);
        assert_eq!(1 << codec_core::consts::PRECISION, SLOTS);
        assert_eq!(codec_core::consts::LANES, LANES);
    }
}

// ---------------------------------------------------------------------------------------------
// Device launches

/// A buffer on the device and the number of elements kernels may touch in it (invariant 6:
/// `len <= slice.len()`, or for a view `offset + len * size_of::<T>() <= base.len()`; an empty
/// buffer is one zeroed element, since the driver allocates no empty buffer).
#[derive(Debug)]
pub(crate) struct DevBuf<T> {
    mem: DevMem<T>,
    len: usize,
}

/// Where a [`DevBuf`] lies: its own allocation, or a part of a packed upload ([`Packer`]).
#[derive(Debug)]
enum DevMem<T> {
    Own(CudaSlice<T>),
    View {
        base: Arc<CudaSlice<u8>>,
        /// Bytes from the base's start: a multiple of [`PACK_ALIGN`].
        offset: usize,
        _t: PhantomData<T>,
    },
}

/// A driver call's error as a [`CudaError`].
pub(crate) fn driver_err(call: &'static str) -> impl Fn(DriverError) -> CudaError {
    move |e| CudaError::Driver {
        call,
        code: format!("{:?}", e.0),
    }
}

impl<T: DeviceRepr + ValidAsZeroBits> DevBuf<T> {
    /// Copies `data` to the device.
    pub(crate) fn upload(stream: &Arc<CudaStream>, data: &[T]) -> Result<Self, CudaError> {
        let slice = if data.is_empty() {
            stream.alloc_zeros(1)
        } else {
            stream.clone_htod(data)
        }
        .map_err(driver_err("cuMemcpyHtoDAsync"))?;
        Ok(DevBuf {
            mem: DevMem::Own(slice),
            len: data.len(),
        })
    }

    /// `len` zeroed elements on the device.
    pub(crate) fn zeros(stream: &Arc<CudaStream>, len: usize) -> Result<Self, CudaError> {
        let slice = stream
            .alloc_zeros(len.max(1))
            .map_err(driver_err("cuMemAllocAsync"))?;
        Ok(DevBuf {
            mem: DevMem::Own(slice),
            len,
        })
    }

    /// The part `slot` of the packed upload `base` (an input: never downloaded).
    pub(crate) fn view(base: &Arc<CudaSlice<u8>>, slot: PackSlot<T>) -> Result<Self, CudaError> {
        let end = slot
            .len
            .checked_mul(size_of::<T>())
            .and_then(|b| b.checked_add(slot.offset));
        if end.is_none_or(|e| e > base.len()) || !slot.offset.is_multiple_of(PACK_ALIGN) {
            return Err(CudaError::Input {
                what: "a packed part outside its upload",
            });
        }
        Ok(DevBuf {
            mem: DevMem::View {
                base: base.clone(),
                offset: slot.offset,
                _t: PhantomData,
            },
            len: slot.len,
        })
    }

    /// Copies the buffer's `len` elements back (buffers of their own only: the launches'
    /// outputs).
    pub(crate) fn download(&self, stream: &Arc<CudaStream>) -> Result<Vec<T>, CudaError> {
        let DevMem::Own(slice) = &self.mem else {
            return Err(CudaError::Input {
                what: "a packed input is not downloaded",
            });
        };
        let mut v = stream
            .clone_dtoh(slice)
            .map_err(driver_err("cuMemcpyDtoHAsync"))?;
        v.truncate(self.len);
        Ok(v)
    }

    /// Elements kernels may touch.
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

impl DevBuf<u8> {
    /// Copies bytes `0..len` back through `pinned` (page-locked memory the caller keeps for
    /// the next copy, grown when short) and hands them to `read` (buffers of their own only):
    /// the device's copy at the speed of pinned memory, then one host copy, `read`'s.
    pub(crate) fn download_pinned<R>(
        &self,
        stream: &Arc<CudaStream>,
        len: usize,
        pinned: &mut Option<PinnedHostSlice<u8>>,
        read: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, CudaError> {
        let outside = CudaError::Input {
            what: "a download outside its buffer",
        };
        let DevMem::Own(slice) = &self.mem else {
            return Err(outside);
        };
        if len > self.len {
            return Err(outside);
        }
        if len == 0 {
            return Ok(read(&[]));
        }
        // Cached (not write-combined): the host reads it.
        let buf = pinned_at_least(stream, pinned, len, 0)?;
        let host = buf
            .as_mut_slice()
            .map_err(driver_err("cuEventSynchronize"))?;
        // The destination is exactly `len` bytes: the driver copies the destination's length.
        let dst = &mut host[..len];
        stream
            .memcpy_dtoh(&slice.slice(0..len), dst)
            .map_err(driver_err("cuMemcpyDtoHAsync"))?;
        stream
            .synchronize()
            .map_err(driver_err("cuStreamSynchronize"))?;
        Ok(read(dst))
    }
}

/// Queues `func` on `stream` with its one argument struct `args` and launch shape `cfg`, then
/// drops the address guards `a` (which ordered the launch after the buffers' earlier writes):
/// the one launch site of every kernel.
///
/// # Safety
///
/// `args` has the layout the kernel declares (invariants 1 and 7); every address in it is one
/// of `a`'s buffers with its count, live until the caller synchronizes the stream (invariant
/// 6); `cfg` gives the threads and shared memory the kernel assumes (invariants 3 and 8).
unsafe fn launch_args<A: DeviceRepr>(
    stream: &CudaStream,
    func: &CudaFunction,
    args: &A,
    cfg: LaunchConfig,
    a: Addrs<'_>,
) -> Result<(), CudaError> {
    let mut launch = stream.launch_builder(func);
    launch.arg(args);
    // SAFETY: this function's contract, which its callers state at each call.
    unsafe { launch.launch(cfg) }.map_err(driver_err("cuLaunchKernel"))?;
    drop(a);
    Ok(())
}

/// Device addresses of a launch's buffers, held with the guards that order the launch after
/// the buffers' earlier writes (dropped once the launch is queued).
struct Addrs<'a> {
    guards: Vec<SyncOnDrop<'a>>,
}

impl<'a> Addrs<'a> {
    fn of<T>(&mut self, b: &'a DevBuf<T>, stream: &'a CudaStream) -> (u64, u64) {
        let (ptr, guard) = match &b.mem {
            DevMem::Own(slice) => slice.device_ptr(stream),
            DevMem::View { base, offset, .. } => {
                let (ptr, guard) = base.device_ptr(stream);
                (ptr + *offset as u64, guard)
            }
        };
        self.guards.push(guard);
        (ptr, b.len as u64)
    }
}

/// `held`, or when it is missing or shorter than `need` bytes (at most `isize::MAX / 4`), a new
/// zeroed page-locked buffer of the next power of two with the driver's `flags`, held there
/// instead: pinned memory a caller keeps between copies.
fn pinned_at_least<'p>(
    stream: &Arc<CudaStream>,
    held: &'p mut Option<PinnedHostSlice<u8>>,
    need: usize,
    flags: u32,
) -> Result<&'p mut PinnedHostSlice<u8>, CudaError> {
    if need > isize::MAX as usize / 4 {
        return Err(CudaError::Input {
            what: "a host copy over isize::MAX / 4 bytes",
        });
    }
    if held.as_ref().is_none_or(|p| p.len() < need) {
        *held = None;
        let cap = need.next_power_of_two();
        // SAFETY: alloc_pinned_with_flags' contract (the memory is uninitialized): it is
        // zeroed through the raw pointer below before any slice of it is formed. `cap` is far
        // below isize::MAX (checked above), so cudarc's size assertions hold.
        let mut p = unsafe { stream.context().alloc_pinned_with_flags::<u8>(cap, flags) }
            .map_err(driver_err("cuMemHostAlloc"))?;
        let ptr = p.as_mut_ptr().map_err(driver_err("cuEventSynchronize"))?;
        // SAFETY: `ptr` points to `cap` bytes of pinned memory owned by `p`.
        unsafe { ptr.write_bytes(0, cap) };
        *held = Some(p);
    }
    held.as_mut().ok_or(CudaError::Input {
        what: "no pinned buffer",
    })
}

/// Bytes of a packed upload queued to the device at a time: the host fills the staging buffer
/// with the next step while the device copies the last.
const PACK_STEP: usize = 4 << 20;

/// Alignment of every part of a packed upload (the driver's allocations are at least this
/// aligned, so every part is aligned for its type).
pub(crate) const PACK_ALIGN: usize = 256;

/// Where [`Packer::add`] put an array: its byte offset and element count.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PackSlot<T> {
    offset: usize,
    len: usize,
    _t: PhantomData<T>,
}

/// Host arrays laid out one after another ([`PACK_ALIGN`]-aligned) and uploaded to one device
/// allocation by one copy from a pinned staging buffer, which the caller keeps for the next
/// upload (one copy instead of one per array, at the speed of pinned memory, and no
/// allocation of pinned memory per call).
#[derive(Debug, Default)]
pub(crate) struct Packer<'a> {
    /// Per part: its sources in order (their bytes), and its offset.
    parts: Vec<(Vec<&'a [u8]>, usize)>,
    total: usize,
}

/// The bytes of a slice of a device type, padding included (invariant 7: plain `#[repr(C)]`
/// values; the bytes are only copied, never read as numbers).
fn raw_bytes<T: DeviceRepr>(data: &[T]) -> &[u8] {
    // SAFETY: `data` is a live slice of `size_of_val(data)` bytes, borrowed for the result's
    // lifetime; u8 has alignment 1. Padding bytes of `T` (e.g. the tail of `LaneBlock`) are
    // only copied, by `copy_from_slice` (a memcpy, `ptr::copy_nonoverlapping`) in
    // `Packer::upload` and by the driver's DMA, never read as values.
    unsafe { std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), size_of_val(data)) }
}

impl<'a> Packer<'a> {
    /// Adds an array; where it will lie.
    pub(crate) fn add<T: DeviceRepr>(&mut self, data: &'a [T]) -> PackSlot<T> {
        self.add_gather(std::slice::from_ref(&data))
    }

    /// Room for `len` elements that nothing is copied into (a launch's output, in a
    /// [`Packer::total`]-byte scratch allocation); where it lies.
    pub(crate) fn reserve<T: DeviceRepr>(&mut self, len: usize) -> PackSlot<T> {
        let offset = self.total;
        self.total = offset + (len * size_of::<T>()).max(1).next_multiple_of(PACK_ALIGN);
        PackSlot {
            offset,
            len,
            _t: PhantomData,
        }
    }

    /// Bytes the parts take, gaps included.
    pub(crate) fn total(&self) -> usize {
        self.total
    }

    /// Adds the arrays `parts` joined into one.
    pub(crate) fn add_gather<T: DeviceRepr>(&mut self, parts: &[&'a [T]]) -> PackSlot<T> {
        let offset = self.total;
        let len: usize = parts.iter().map(|p| p.len()).sum();
        let bytes = len * size_of::<T>();
        self.parts
            .push((parts.iter().map(|p| raw_bytes(p)).collect(), offset));
        self.total = offset + bytes.max(1).next_multiple_of(PACK_ALIGN);
        PackSlot {
            offset,
            len,
            _t: PhantomData,
        }
    }

    /// Copies every part into `staging` (pinned memory, grown to a power of two when short)
    /// and from there to a new device allocation in one copy on `stream`, then synchronizes
    /// the stream (so that `staging` can be refilled): the allocation, for [`DevBuf::view`].
    pub(crate) fn upload(
        self,
        stream: &Arc<CudaStream>,
        staging: &mut Option<PinnedHostSlice<u8>>,
    ) -> Result<Arc<CudaSlice<u8>>, CudaError> {
        let need = self.total.max(1);
        // Write-combined: the host only writes it, and the device reads it faster so.
        let pinned = pinned_at_least(
            stream,
            staging,
            need,
            cudarc::driver::sys::CU_MEMHOSTALLOC_WRITECOMBINED,
        )?;
        // Waits for any earlier copy from the staging buffer (its event).
        let dst = pinned
            .as_mut_slice()
            .map_err(driver_err("cuEventSynchronize"))?;
        let mut dev = stream
            .alloc_zeros::<u8>(need)
            .map_err(driver_err("cuMemAllocAsync"))?;
        // Bytes [0, sent) are queued to the device; they are not written again before the
        // stream is synchronized below. Copying the next step into the staging buffer overlaps
        // the device's copy of the last.
        let mut sent = 0usize;
        let mut send = |upto: usize, sent: &mut usize, dst: &[u8]| -> Result<(), CudaError> {
            if upto > *sent {
                stream
                    .memcpy_htod(&dst[*sent..upto], &mut dev.slice_mut(*sent..upto))
                    .map_err(driver_err("cuMemcpyHtoDAsync"))?;
                *sent = upto;
            }
            Ok(())
        };
        for (sources, offset) in &self.parts {
            let mut at = *offset;
            for src in sources {
                dst[at..at + src.len()].copy_from_slice(src);
                at += src.len();
                if at >= sent + PACK_STEP {
                    send(at, &mut sent, dst)?;
                }
            }
        }
        send(need, &mut sent, dst)?;
        stream
            .synchronize()
            .map_err(driver_err("cuStreamSynchronize"))?;
        Ok(Arc::new(dev))
    }
}

// SAFETY (invariant 7): plain `#[repr(C)]` structs of integers and floats, with the layouts the
// kernels declare (invariant 1); every bit pattern, all zeros included, is a valid value.
unsafe impl DeviceRepr for LaneBlock {}
unsafe impl ValidAsZeroBits for LaneBlock {}
unsafe impl DeviceRepr for DequantBlock {}
unsafe impl ValidAsZeroBits for DequantBlock {}
unsafe impl DeviceRepr for ChannelConsts {}
unsafe impl ValidAsZeroBits for ChannelConsts {}
unsafe impl DeviceRepr for PqQuery {}
unsafe impl ValidAsZeroBits for PqQuery {}
unsafe impl DeviceRepr for QuantBlock {}
unsafe impl ValidAsZeroBits for QuantBlock {}
unsafe impl DeviceRepr for LaneEncodeBlock {}
unsafe impl ValidAsZeroBits for LaneEncodeBlock {}

/// `KvcLaneDecodeArgs` with device addresses (invariant 1: every pointer is 8 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct LaneDecodeArgsDev {
    words: u64,
    n_words: u64,
    tables: u64,
    n_tables: u64,
    table_list: u64,
    n_table_list: u64,
    symbol_table: u64,
    symbols: u64,
    n_symbols: u64,
    blocks: u64,
    status: u64,
    n_blocks: u64,
    shared_tables: u64,
}

/// `KvcDequantArgs` with device addresses.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct DequantArgsDev {
    q: u64,
    n_q: u64,
    exps: u64,
    n_exps: u64,
    sink: u64,
    n_sink: u64,
    consts: u64,
    n_consts: u64,
    out: u64,
    n_out: u64,
    pages: u64,
    n_pages: u64,
    blocks: u64,
    status: u64,
    n_blocks: u64,
    heads: u32,
    head_dim: u32,
    page_size: u32,
    reserved: u32,
}

/// `KvcPqArgs` with device addresses.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct PqArgsDev {
    queries: u64,
    n_queries: u64,
    codewords: u64,
    n_codewords: u64,
    codes: u64,
    n_codes: u64,
    keys: u64,
    n_keys: u64,
    out: u64,
    n_out: u64,
    items: u64,
    status: u64,
    n_items: u64,
    dim: u32,
    m: u32,
    bits: u32,
    residual: u32,
    table_capacity: u32,
    key_capacity: u32,
}

/// `KvcQuantArgs` with device addresses.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct QuantArgsDev {
    x: u64,
    n_x: u64,
    exps: u64,
    n_exps: u64,
    consts: u64,
    n_consts: u64,
    q: u64,
    n_q: u64,
    blocks: u64,
    status: u64,
    n_blocks: u64,
    heads: u32,
    head_dim: u32,
}

/// `KvcLaneEncodeArgs` with device addresses.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct LaneEncodeArgsDev {
    symbols: u64,
    symbol_table: u64,
    n_symbols: u64,
    tables: u64,
    n_tables: u64,
    table_list: u64,
    n_table_list: u64,
    words: u64,
    n_words: u64,
    lane_len: u64,
    blocks: u64,
    status: u64,
    n_blocks: u64,
}

// SAFETY (invariant 7): as above, plain `#[repr(C)]` integers passed by value.
unsafe impl DeviceRepr for QuantArgsDev {}
unsafe impl DeviceRepr for LaneEncodeArgsDev {}
unsafe impl DeviceRepr for LaneDecodeArgsDev {}
unsafe impl DeviceRepr for DequantArgsDev {}
unsafe impl DeviceRepr for PqArgsDev {}

/// A lane-decode launch's device buffers (invariant 2 on the device: built by
/// `Gpu::lane_decode` from one [`crate::rans::LaneBatch`]).
#[derive(Debug)]
pub(crate) struct LaneDecodeDev<W = u32> {
    pub words: DevBuf<W>,
    pub tables: DevBuf<u32>,
    pub table_list: DevBuf<u32>,
    pub symbol_table: DevBuf<u16>,
    pub blocks: DevBuf<LaneBlock>,
    pub symbols: DevBuf<u8>,
    pub status: DevBuf<u32>,
}

/// Queues `kvc_rans_lane_decode` over `b` on `stream`, `shared_tables` tables per block in
/// shared memory (the function's dynamic shared memory limit must allow it: invariant 8).
pub(crate) fn launch_lane_decode<W: LaneWord>(
    stream: &CudaStream,
    func: &CudaFunction,
    b: &LaneDecodeDev<W>,
    shared_tables: u32,
) -> Result<(), CudaError> {
    let r = LaneDecodeRef {
        words: &b.words,
        tables: &b.tables,
        table_list: &b.table_list,
        symbol_table: &b.symbol_table,
        blocks: &b.blocks,
        symbols: &b.symbols,
        status: &b.status,
    };
    launch_lane_decode_ref(stream, func, &r, shared_tables)
}

fn launch_lane_decode_ref<W: LaneWord>(
    stream: &CudaStream,
    func: &CudaFunction,
    b: &LaneDecodeRef<'_, W>,
    shared_tables: u32,
) -> Result<(), CudaError> {
    let input = |what| CudaError::Input { what };
    if b.symbols.len() != b.symbol_table.len() || b.status.len() != b.blocks.len() * LANES {
        return Err(input("lane-decode buffers of mismatched lengths"));
    }
    let grid = u32::try_from(b.blocks.len()).map_err(|_| input("over 2^31 - 1 blocks"))?;
    if grid == 0 {
        return Ok(());
    }
    let mut a = Addrs { guards: Vec::new() };
    let (words, n_words) = a.of(b.words, stream);
    let (tables, n_words_tables) = a.of(b.tables, stream);
    let (table_list, n_table_list) = a.of(b.table_list, stream);
    let (symbol_table, _) = a.of(b.symbol_table, stream);
    let (symbols, n_symbols) = a.of(b.symbols, stream);
    let (blocks, n_blocks) = a.of(b.blocks, stream);
    let (status, _) = a.of(b.status, stream);
    let args = LaneDecodeArgsDev {
        words,
        n_words,
        tables,
        n_tables: n_words_tables / SLOTS as u64,
        table_list,
        n_table_list,
        symbol_table,
        symbols,
        n_symbols,
        blocks,
        status,
        n_blocks,
        shared_tables: u64::from(shared_tables),
    };
    let cfg = LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (LANES as u32, 1, 1),
        shared_mem_bytes: shared_tables * (SLOTS as u32) * 4,
    };
    // SAFETY: invariants 1 (the argument struct's layout), 6 (every address/count pair is a
    // live device buffer and a count within it, kept alive by `b` until the stream is
    // synchronized by the caller, who holds `b`), 7 and 8 (launch shape and shared memory).
    unsafe { launch_args(stream, func, &args, cfg, a) }?;
    Ok(())
}

/// A dequantization launch's device buffers (the output is the caller's).
#[derive(Debug)]
pub(crate) struct DequantDev {
    pub q: DevBuf<i32>,
    pub exps: DevBuf<u8>,
    pub sink: DevBuf<f32>,
    pub consts: DevBuf<ChannelConsts>,
    pub pages: DevBuf<u32>,
    pub blocks: DevBuf<DequantBlock>,
    pub status: DevBuf<u32>,
    pub heads: u32,
    pub head_dim: u32,
    pub page_size: u32,
}

/// Queues a dequantization entry point over `b` on `stream`, writing the first `n_out`
/// elements of `out`.
pub(crate) fn launch_dequant(
    stream: &CudaStream,
    func: &CudaFunction,
    b: &DequantDev,
    out: &mut CudaSlice<u16>,
    n_out: usize,
) -> Result<(), CudaError> {
    launch_dequant_with(stream, func, b, &b.q, &b.exps, out, n_out)
}

/// [`launch_dequant`] reading symbol values `q` and exponents `exps` from other buffers (a
/// chain's earlier launches) instead of `b`'s.
fn launch_dequant_with(
    stream: &CudaStream,
    func: &CudaFunction,
    b: &DequantDev,
    q_buf: &DevBuf<i32>,
    exps_buf: &DevBuf<u8>,
    out: &mut CudaSlice<u16>,
    n_out: usize,
) -> Result<(), CudaError> {
    let input = |what| CudaError::Input { what };
    if b.status.len() != b.blocks.len() {
        return Err(input("dequantization buffers of mismatched lengths"));
    }
    if n_out > out.len() {
        return Err(input("the output buffer is shorter than the plan's output"));
    }
    let grid = u32::try_from(b.blocks.len()).map_err(|_| input("over 2^31 - 1 blocks"))?;
    if grid == 0 {
        return Ok(());
    }
    let mut a = Addrs { guards: Vec::new() };
    let (q, n_q) = a.of(q_buf, stream);
    let (exps, n_exps) = a.of(exps_buf, stream);
    let (sink, n_sink) = a.of(&b.sink, stream);
    let (consts, n_consts) = a.of(&b.consts, stream);
    let (out_ptr, out_guard) = out.device_ptr_mut(stream);
    a.guards.push(out_guard);
    let n_out = n_out as u64;
    let (pages, n_pages) = a.of(&b.pages, stream);
    let (blocks, n_blocks) = a.of(&b.blocks, stream);
    let (status, _) = a.of(&b.status, stream);
    let args = DequantArgsDev {
        q,
        n_q,
        exps,
        n_exps,
        sink,
        n_sink,
        consts,
        n_consts,
        out: out_ptr,
        n_out,
        pages,
        n_pages,
        blocks,
        status,
        n_blocks,
        heads: b.heads,
        head_dim: b.head_dim,
        page_size: b.page_size,
        reserved: 0,
    };
    let cfg = LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (DEQUANT_THREADS, 1, 1),
        shared_mem_bytes: DEQUANT_SHARED_BYTES,
    };
    // SAFETY: invariants 1, 6 (buffers live in `b` and `out`, held by the caller until the
    // stream is synchronized), 7 and 3 (the host runs' launch shape).
    unsafe { launch_args(stream, func, &args, cfg, a) }?;
    Ok(())
}

/// A PQ search launch's device buffers.
#[derive(Debug)]
pub(crate) struct PqDev {
    pub queries: DevBuf<f32>,
    pub codewords: DevBuf<f32>,
    pub codes: DevBuf<u8>,
    pub keys: DevBuf<u32>,
    pub out: DevBuf<u32>,
    pub items: DevBuf<PqQuery>,
    pub status: DevBuf<u32>,
    pub dim: u32,
    pub m: u32,
    pub bits: u32,
    pub residual: u32,
}

/// Queues `kvc_pq_search` over `b` on `stream`.
pub(crate) fn launch_pq(
    stream: &CudaStream,
    func: &CudaFunction,
    b: &PqDev,
    shape: PqShape,
) -> Result<(), CudaError> {
    let input = |what| CudaError::Input { what };
    if b.status.len() != b.items.len() {
        return Err(input("PQ buffers of mismatched lengths"));
    }
    let grid = u32::try_from(b.items.len()).map_err(|_| input("over 2^31 - 1 queries"))?;
    if grid == 0 {
        return Ok(());
    }
    let shared_mem_bytes =
        u32::try_from(shape.shared_bytes()).map_err(|_| input("PQ shared memory over 4 GiB"))?;
    let mut a = Addrs { guards: Vec::new() };
    let (queries, n_queries) = a.of(&b.queries, stream);
    let (codewords, n_codewords) = a.of(&b.codewords, stream);
    let (codes, n_codes) = a.of(&b.codes, stream);
    let (keys, n_keys) = a.of(&b.keys, stream);
    let (out, n_out) = a.of(&b.out, stream);
    let (items, n_items) = a.of(&b.items, stream);
    let (status, _) = a.of(&b.status, stream);
    let args = PqArgsDev {
        queries,
        n_queries,
        codewords,
        n_codewords,
        codes,
        n_codes,
        keys,
        n_keys,
        out,
        n_out,
        items,
        status,
        n_items,
        dim: b.dim,
        m: b.m,
        bits: b.bits,
        residual: b.residual,
        table_capacity: shape.table_entries,
        key_capacity: shape.key_capacity,
    };
    let cfg = LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (shape.threads, 1, 1),
        shared_mem_bytes,
    };
    // SAFETY: invariants 1, 6 (buffers live in `b`, held by the caller until the stream is
    // synchronized), 7, 3 (the host runs' launch shape and shared memory) and 8 (the shape's
    // shared memory is within the budget the function's limit was raised to).
    unsafe { launch_args(stream, func, &args, cfg, a) }?;
    Ok(())
}

/// A quantization launch's device buffers.
#[derive(Debug)]
pub(crate) struct QuantDev {
    pub x: DevBuf<f32>,
    pub exps: DevBuf<u8>,
    pub consts: DevBuf<ChannelConsts>,
    pub q: DevBuf<i32>,
    pub blocks: DevBuf<QuantBlock>,
    pub status: DevBuf<u32>,
    pub heads: u32,
    pub head_dim: u32,
}

/// Queues `kvc_quantize` over `b` on `stream`.
pub(crate) fn launch_quantize(
    stream: &CudaStream,
    func: &CudaFunction,
    b: &QuantDev,
) -> Result<(), CudaError> {
    let input = |what| CudaError::Input { what };
    if b.status.len() != b.blocks.len() {
        return Err(input("quantization buffers of mismatched lengths"));
    }
    let grid = u32::try_from(b.blocks.len()).map_err(|_| input("over 2^31 - 1 blocks"))?;
    if grid == 0 {
        return Ok(());
    }
    let mut a = Addrs { guards: Vec::new() };
    let (x, n_x) = a.of(&b.x, stream);
    let (exps, n_exps) = a.of(&b.exps, stream);
    let (consts, n_consts) = a.of(&b.consts, stream);
    let (q, n_q) = a.of(&b.q, stream);
    let (blocks, n_blocks) = a.of(&b.blocks, stream);
    let (status, _) = a.of(&b.status, stream);
    let args = QuantArgsDev {
        x,
        n_x,
        exps,
        n_exps,
        consts,
        n_consts,
        q,
        n_q,
        blocks,
        status,
        n_blocks,
        heads: b.heads,
        head_dim: b.head_dim,
    };
    let cfg = LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (DEQUANT_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: invariants 1, 6 (buffers live in `b`, held by the caller until the stream is
    // synchronized), 7 and 3 (the host runs' launch shape).
    unsafe { launch_args(stream, func, &args, cfg, a) }?;
    Ok(())
}

/// A lane-encode launch's device buffers.
#[derive(Debug)]
pub(crate) struct LaneEncodeDev {
    pub symbols: DevBuf<u8>,
    pub symbol_table: DevBuf<u16>,
    pub tables: DevBuf<u32>,
    pub table_list: DevBuf<u32>,
    pub words: DevBuf<u32>,
    pub lane_len: DevBuf<u32>,
    pub blocks: DevBuf<LaneEncodeBlock>,
    pub status: DevBuf<u32>,
}

/// Queues `kvc_rans_lane_encode` over `b` on `stream`.
pub(crate) fn launch_lane_encode(
    stream: &CudaStream,
    func: &CudaFunction,
    b: &LaneEncodeDev,
) -> Result<(), CudaError> {
    let input = |what| CudaError::Input { what };
    if b.symbols.len() != b.symbol_table.len()
        || b.status.len() != b.blocks.len() * LANES
        || b.lane_len.len() != b.status.len()
    {
        return Err(input("lane-encode buffers of mismatched lengths"));
    }
    let grid = u32::try_from(b.blocks.len()).map_err(|_| input("over 2^31 - 1 blocks"))?;
    if grid == 0 {
        return Ok(());
    }
    let mut a = Addrs { guards: Vec::new() };
    let (symbols, n_symbols) = a.of(&b.symbols, stream);
    let (symbol_table, _) = a.of(&b.symbol_table, stream);
    let (tables, n_table_words) = a.of(&b.tables, stream);
    let (table_list, n_table_list) = a.of(&b.table_list, stream);
    let (words, n_words) = a.of(&b.words, stream);
    let (lane_len, _) = a.of(&b.lane_len, stream);
    let (blocks, n_blocks) = a.of(&b.blocks, stream);
    let (status, _) = a.of(&b.status, stream);
    let args = LaneEncodeArgsDev {
        symbols,
        symbol_table,
        n_symbols,
        tables,
        n_tables: n_table_words / 256,
        table_list,
        n_table_list,
        words,
        n_words,
        lane_len,
        blocks,
        status,
        n_blocks,
    };
    let cfg = LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (LANES as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: invariants 1, 6 (buffers live in `b`, held by the caller until the stream is
    // synchronized), 7 and 3 (32 threads, no shared memory).
    unsafe { launch_args(stream, func, &args, cfg, a) }?;
    Ok(())
}

/// `KvcResolveArgs` with device addresses.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct ResolveArgsDev {
    symbol_table: u64,
    n_symbol_table: u64,
    exps: u64,
    n_exps: u64,
    map: u64,
    n_map: u64,
    blocks: u64,
    status: u64,
    n_blocks: u64,
    heads: u32,
    head_dim: u32,
}

/// `KvcValueArgs` with device addresses.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct ValueArgsDev {
    indices: u64,
    symbol_table: u64,
    n_indices: u64,
    table_list: u64,
    n_table_list: u64,
    radius: u64,
    n_radius: u64,
    escapes: u64,
    n_escapes: u64,
    q: u64,
    n_q: u64,
    blocks: u64,
    status: u64,
    n_blocks: u64,
}

// SAFETY (invariant 7): plain `#[repr(C)]` integers.
unsafe impl DeviceRepr for ResolveArgsDev {}
unsafe impl DeviceRepr for ValueArgsDev {}
unsafe impl DeviceRepr for ResolveBlock {}
unsafe impl ValidAsZeroBits for ResolveBlock {}
unsafe impl DeviceRepr for ValueBlock {}
unsafe impl ValidAsZeroBits for ValueBlock {}

/// A plan's chain on the device: every buffer of its five launches (invariant 6: each count
/// within its buffer; built from one `decode::Chain`).
#[derive(Debug)]
pub(crate) struct ChainDev {
    pub lanes_exp: LaneDecodeDev,
    pub sym_blocks: DevBuf<LaneBlock>,
    pub sym_table: DevBuf<u16>,
    pub symbols: DevBuf<u8>,
    pub sym_status: DevBuf<u32>,
    pub map: DevBuf<u16>,
    pub resolve: DevBuf<ResolveBlock>,
    pub resolve_status: DevBuf<u32>,
    pub radius: DevBuf<u8>,
    pub escapes: DevBuf<i32>,
    pub q: DevBuf<i32>,
    pub values: DevBuf<ValueBlock>,
    pub value_status: DevBuf<u32>,
    pub dequant: DequantDev,
    pub heads: u32,
    pub head_dim: u32,
}

/// The kernels of a chain.
#[derive(Debug)]
pub(crate) struct ChainKernels<'a> {
    pub lane: &'a CudaFunction,
    pub resolve: &'a CudaFunction,
    pub values: &'a CudaFunction,
    pub dequant: &'a CudaFunction,
}

/// Queues the five launches of a chain on `stream`: exponents, table resolution, symbols,
/// values, dequantization into the first `n_out` elements of `out`.
pub(crate) fn launch_chain(
    stream: &CudaStream,
    k: &ChainKernels<'_>,
    c: &ChainDev,
    shared_tables: u32,
    out: &mut CudaSlice<u16>,
    n_out: usize,
) -> Result<(), CudaError> {
    for stage in 0..5 {
        launch_chain_stage(stream, k, c, shared_tables, out, n_out, stage)?;
    }
    Ok(())
}

/// Queues launch `stage` (0-4) of a chain; the earlier ones must be queued before it.
pub(crate) fn launch_chain_stage(
    stream: &CudaStream,
    k: &ChainKernels<'_>,
    c: &ChainDev,
    shared_tables: u32,
    out: &mut CudaSlice<u16>,
    n_out: usize,
    stage: u8,
) -> Result<(), CudaError> {
    let input = |what| CudaError::Input { what };
    let l = &c.lanes_exp;
    let (lane, resolve, values, dequant) = (k.lane, k.resolve, k.values, k.dequant);
    if c.resolve_status.len() != c.resolve.len()
        || c.value_status.len() != c.values.len()
        || c.symbols.len() != c.sym_table.len()
        || c.sym_status.len() != c.sym_blocks.len() * LANES
    {
        return Err(input("chain buffers of mismatched lengths"));
    }
    let grid = |n: usize| u32::try_from(n).map_err(|_| input("over 2^31 - 1 blocks"));
    if stage == 0 {
        return launch_lane_decode(stream, lane, l, shared_tables);
    }
    let g = grid(c.resolve.len())?;
    if stage == 1 && g > 0 {
        let mut a = Addrs { guards: Vec::new() };
        let (symbol_table, n_symbol_table) = a.of(&c.sym_table, stream);
        let (exps, n_exps) = a.of(&l.symbols, stream);
        let (map, n_map) = a.of(&c.map, stream);
        let (blocks, n_blocks) = a.of(&c.resolve, stream);
        let (status, _) = a.of(&c.resolve_status, stream);
        let args = ResolveArgsDev {
            symbol_table,
            n_symbol_table,
            exps,
            n_exps,
            map,
            n_map,
            blocks,
            status,
            n_blocks,
            heads: c.heads,
            head_dim: c.head_dim,
        };
        let cfg = LaunchConfig {
            grid_dim: (g, 1, 1),
            block_dim: (CHAIN_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: invariants 1, 6 (buffers live in `c`, held by the caller until the stream is
        // synchronized), 7 and 3.
        unsafe { launch_args(stream, resolve, &args, cfg, a) }?;
    }
    let sym = LaneDecodeRef {
        words: &l.words,
        tables: &l.tables,
        table_list: &l.table_list,
        symbol_table: &c.sym_table,
        blocks: &c.sym_blocks,
        symbols: &c.symbols,
        status: &c.sym_status,
    };
    if stage == 2 {
        return launch_lane_decode_ref(stream, lane, &sym, shared_tables);
    }
    let g = grid(c.values.len())?;
    if stage == 3 && g > 0 {
        let mut a = Addrs { guards: Vec::new() };
        let (indices, n_indices) = a.of(&c.symbols, stream);
        let (symbol_table, _) = a.of(&c.sym_table, stream);
        let (table_list, n_table_list) = a.of(&l.table_list, stream);
        let (radius, n_radius) = a.of(&c.radius, stream);
        let (escapes, n_escapes) = a.of(&c.escapes, stream);
        let (q, n_q) = a.of(&c.q, stream);
        let (blocks, n_blocks) = a.of(&c.values, stream);
        let (status, _) = a.of(&c.value_status, stream);
        let args = ValueArgsDev {
            indices,
            symbol_table,
            n_indices,
            table_list,
            n_table_list,
            radius,
            n_radius,
            escapes,
            n_escapes,
            q,
            n_q,
            blocks,
            status,
            n_blocks,
        };
        let cfg = LaunchConfig {
            grid_dim: (g, 1, 1),
            block_dim: (CHAIN_THREADS, 1, 1),
            shared_mem_bytes: VALUE_SHARED_BYTES,
        };
        // SAFETY: invariants 1, 6, 7 and 3 (the shared memory KvcValueShared needs).
        unsafe { launch_args(stream, values, &args, cfg, a) }?;
    }
    if stage == 4 {
        return launch_dequant_with(stream, dequant, &c.dequant, &c.q, &l.symbols, out, n_out);
    }
    Ok(())
}

/// A lane-decode launch's buffers, borrowed (the chain's symbol launch shares the exponent
/// launch's words and tables).
struct LaneDecodeRef<'a, W> {
    words: &'a DevBuf<W>,
    tables: &'a DevBuf<u32>,
    table_list: &'a DevBuf<u32>,
    symbol_table: &'a DevBuf<u16>,
    blocks: &'a DevBuf<LaneBlock>,
    symbols: &'a DevBuf<u8>,
    status: &'a DevBuf<u32>,
}

/// `KvcEncodeArgs` with device addresses.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct EncodeArgsDev {
    src: u64,
    n_src: u64,
    dtype: u32,
    max_exp: u32,
    slope: f64,
    inv_sqrt_d: f64,
    qref: u64,
    n_qref: u64,
    tau: u64,
    n_tau: u64,
    rot: u64,
    n_rot: u64,
    consts: u64,
    n_consts: u64,
    map: u64,
    n_map: u64,
    table_list: u64,
    n_table_list: u64,
    radius: u64,
    n_radius: u64,
    tables: u64,
    n_tables: u64,
    symbols: u64,
    symbol_table: u64,
    n_symbols: u64,
    q: u64,
    n_q: u64,
    escapes: u64,
    n_escapes: u64,
    blocks: u64,
    results: u64,
    lane_blocks: u64,
    n_blocks: u64,
    heads: u32,
    head_dim: u32,
    rope_style: u32,
    reserved: u32,
}

/// `KvcWriteArgs` with device addresses.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct WriteArgsDev {
    src: u64,
    n_src_bytes: u64,
    elem_bytes: u32,
    heads: u32,
    head_dim: u32,
    reserved: u32,
    blocks: u64,
    results: u64,
    n_blocks: u64,
    escapes: u64,
    n_escapes: u64,
    words: u64,
    n_words: u64,
    lane_len: u64,
    lane_status: u64,
    chunks: u64,
    chunk_results: u64,
    n_chunks: u64,
    out: u64,
    n_out: u64,
}

/// `KvcSealArgs` with device addresses.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct SealArgsDev {
    chunks: u64,
    chunk_results: u64,
    n_chunks: u64,
    out: u64,
    n_out: u64,
    sealed: u64,
    n_sealed: u64,
    seal_results: u64,
}

// SAFETY (invariant 7): plain `#[repr(C)]` integers and floats passed by value or mirrored
// from the kernels.
unsafe impl DeviceRepr for EncodeArgsDev {}
unsafe impl DeviceRepr for WriteArgsDev {}
unsafe impl DeviceRepr for SealArgsDev {}
unsafe impl DeviceRepr for SealResult {}
unsafe impl ValidAsZeroBits for SealResult {}
unsafe impl DeviceRepr for EncBlock {}
unsafe impl ValidAsZeroBits for EncBlock {}
unsafe impl DeviceRepr for EncResult {}
unsafe impl ValidAsZeroBits for EncResult {}
unsafe impl DeviceRepr for ChunkOut {}
unsafe impl ValidAsZeroBits for ChunkOut {}
unsafe impl DeviceRepr for ChunkResult {}
unsafe impl ValidAsZeroBits for ChunkResult {}

/// The source tensors of an encode chain on the device: the caller's buffer, its length in
/// bytes, and its elements' type code and size.
pub(crate) struct DevSource<'a, T> {
    pub slice: &'a CudaSlice<T>,
    pub dtype: u32,
    pub elem_bytes: u32,
}

impl<T> DevSource<'_, T> {
    /// The buffer's address (guarded in `a`) and its length in bytes.
    fn addr<'s>(&'s self, a: &mut Addrs<'s>, stream: &'s CudaStream) -> (u64, u64) {
        let (ptr, guard) = self.slice.device_ptr(stream);
        a.guards.push(guard);
        let bytes = (self.slice.len() * size_of::<T>()) as u64;
        (ptr, bytes)
    }
}

/// An encode chain's device buffers (built by `Gpu::encode` from one
/// [`crate::encode_plan::EncodePlan`]); the four launches share them.
#[derive(Debug)]
pub(crate) struct EncodeDev {
    pub importance: Option<ImportancePolicy>,
    pub qref: DevBuf<f64>,
    pub tau: DevBuf<f32>,
    pub rot: DevBuf<f64>,
    pub consts: DevBuf<ChannelConsts>,
    pub map: DevBuf<u16>,
    pub radius: DevBuf<u8>,
    pub blocks: DevBuf<EncBlock>,
    pub chunks: DevBuf<ChunkOut>,
    pub q: DevBuf<i32>,
    pub escapes: DevBuf<i32>,
    pub results: DevBuf<EncResult>,
    /// The lane encoder's buffers; its symbols, tables and block records the first launch's.
    pub lanes: LaneEncodeDev,
    pub chunk_results: DevBuf<ChunkResult>,
    pub out: DevBuf<u8>,
    /// The chunks sealed and packed (the only part copied back), one result per chunk.
    pub sealed: DevBuf<u8>,
    pub seal_results: DevBuf<SealResult>,
    pub heads: u32,
    pub head_dim: u32,
}

/// The encode chain's four entry points.
pub(crate) struct EncodeKernels<'k> {
    pub blocks: &'k CudaFunction,
    pub lanes: &'k CudaFunction,
    pub write: &'k CudaFunction,
    pub seal: &'k CudaFunction,
}

/// Queues the encode chain over `d` on `stream`: `kvc_encode_blocks`, `kvc_rans_lane_encode`,
/// `kvc_write_chunks`, reading the source tensors `src`, and `kvc_seal_chunks`.
pub(crate) fn launch_encode_chain<T>(
    stream: &CudaStream,
    k: &EncodeKernels<'_>,
    d: &EncodeDev,
    src: &DevSource<'_, T>,
) -> Result<(), CudaError> {
    let input = |what| CudaError::Input { what };
    let n = d.blocks.len();
    if d.results.len() != n
        || d.lanes.blocks.len() != n
        || d.lanes.status.len() != n * LANES
        || d.lanes.lane_len.len() != n * LANES
        || d.lanes.symbols.len() != d.lanes.symbol_table.len()
        || d.chunk_results.len() != d.chunks.len()
        || d.seal_results.len() != d.chunks.len()
        || !(src.elem_bytes == 2 || src.elem_bytes == 4)
    {
        return Err(input("encode-chain buffers of mismatched lengths"));
    }
    let grid = u32::try_from(n).map_err(|_| input("over 2^31 - 1 blocks"))?;
    let chunk_grid = u32::try_from(d.chunks.len()).map_err(|_| input("over 2^31 - 1 chunks"))?;
    if grid == 0 || chunk_grid == 0 {
        return Ok(());
    }
    launch_encode_blocks(stream, k.blocks, d, src, grid)?;
    launch_lane_encode(stream, k.lanes, &d.lanes)?;
    launch_write_chunks(stream, k.write, d, src, chunk_grid)?;
    launch_seal_chunks(stream, k.seal, d, chunk_grid)
}

/// Queues `kvc_encode_blocks` over `d` (`grid` blocks, checked by [`launch_encode_chain`]).
fn launch_encode_blocks<T>(
    stream: &CudaStream,
    func: &CudaFunction,
    d: &EncodeDev,
    src: &DevSource<'_, T>,
    grid: u32,
) -> Result<(), CudaError> {
    let policy = d.importance.unwrap_or_default();
    let mut a = Addrs { guards: Vec::new() };
    let (src_ptr, src_bytes) = src.addr(&mut a, stream);
    let (qref, n_qref) = a.of(&d.qref, stream);
    let (tau, n_tau) = a.of(&d.tau, stream);
    let (rot, n_rot) = a.of(&d.rot, stream);
    let (consts, n_consts) = a.of(&d.consts, stream);
    let (map, n_map) = a.of(&d.map, stream);
    let (table_list, n_table_list) = a.of(&d.lanes.table_list, stream);
    let (radius, n_radius) = a.of(&d.radius, stream);
    let (tables, n_table_words) = a.of(&d.lanes.tables, stream);
    let (symbols, n_symbols) = a.of(&d.lanes.symbols, stream);
    let (symbol_table, _) = a.of(&d.lanes.symbol_table, stream);
    let (q, n_q) = a.of(&d.q, stream);
    let (escapes, n_escapes) = a.of(&d.escapes, stream);
    let (blocks, n_blocks) = a.of(&d.blocks, stream);
    let (results, _) = a.of(&d.results, stream);
    let (lane_blocks, _) = a.of(&d.lanes.blocks, stream);
    let args = EncodeArgsDev {
        src: src_ptr,
        n_src: src_bytes / u64::from(src.elem_bytes),
        dtype: src.dtype,
        max_exp: policy.max_exp,
        slope: policy.slope,
        inv_sqrt_d: policy.inv_sqrt_d,
        qref,
        n_qref,
        tau,
        n_tau,
        rot,
        n_rot,
        consts,
        n_consts,
        map,
        n_map,
        table_list,
        n_table_list,
        radius,
        n_radius,
        tables,
        n_tables: n_table_words / 256,
        symbols,
        symbol_table,
        n_symbols,
        q,
        n_q,
        escapes,
        n_escapes,
        blocks,
        results,
        lane_blocks,
        n_blocks,
        heads: d.heads,
        head_dim: d.head_dim,
        rope_style: policy.rope_style,
        reserved: 0,
    };
    let cfg = LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (CHAIN_THREADS, 1, 1),
        shared_mem_bytes: ENCODE_SHARED_BYTES,
    };
    // SAFETY: invariants 1, 6 (buffers live in `d` and `src`, held by the caller until the
    // stream is synchronized; `src` counted in whole elements), 7 and 3 (the host runs'
    // launch shape and shared memory, within the default 48 KiB).
    unsafe { launch_args(stream, func, &args, cfg, a) }?;
    Ok(())
}

/// Queues `kvc_write_chunks` over `d` (`chunk_grid` chunks, checked by
/// [`launch_encode_chain`]).
fn launch_write_chunks<T>(
    stream: &CudaStream,
    func: &CudaFunction,
    d: &EncodeDev,
    src: &DevSource<'_, T>,
    chunk_grid: u32,
) -> Result<(), CudaError> {
    let mut a = Addrs { guards: Vec::new() };
    let (src_ptr, src_bytes) = src.addr(&mut a, stream);
    let (blocks, n_blocks) = a.of(&d.blocks, stream);
    let (results, _) = a.of(&d.results, stream);
    let (escapes, n_escapes) = a.of(&d.escapes, stream);
    let (words, n_words) = a.of(&d.lanes.words, stream);
    let (lane_len, _) = a.of(&d.lanes.lane_len, stream);
    let (lane_status, _) = a.of(&d.lanes.status, stream);
    let (chunks, n_chunks) = a.of(&d.chunks, stream);
    let (chunk_results, _) = a.of(&d.chunk_results, stream);
    let (out, n_out) = a.of(&d.out, stream);
    let args = WriteArgsDev {
        src: src_ptr,
        n_src_bytes: src_bytes,
        elem_bytes: src.elem_bytes,
        heads: d.heads,
        head_dim: d.head_dim,
        reserved: 0,
        blocks,
        results,
        n_blocks,
        escapes,
        n_escapes,
        words,
        n_words,
        lane_len,
        lane_status,
        chunks,
        chunk_results,
        n_chunks,
        out,
        n_out,
    };
    let cfg = LaunchConfig {
        grid_dim: (chunk_grid, 1, 1),
        block_dim: (CHAIN_THREADS, 1, 1),
        shared_mem_bytes: WRITE_SHARED_BYTES,
    };
    // SAFETY: as `launch_encode_blocks`' (one result per block, 32 lane entries per block,
    // one chunk result per chunk, checked by `launch_encode_chain`).
    unsafe { launch_args(stream, func, &args, cfg, a) }?;
    Ok(())
}

/// Queues `kvc_seal_chunks` over `d` (`chunk_grid` chunks, checked by
/// [`launch_encode_chain`]).
fn launch_seal_chunks(
    stream: &CudaStream,
    func: &CudaFunction,
    d: &EncodeDev,
    chunk_grid: u32,
) -> Result<(), CudaError> {
    let mut a = Addrs { guards: Vec::new() };
    let (chunks, n_chunks) = a.of(&d.chunks, stream);
    let (chunk_results, _) = a.of(&d.chunk_results, stream);
    let (out, n_out) = a.of(&d.out, stream);
    let (sealed, n_sealed) = a.of(&d.sealed, stream);
    let (seal_results, _) = a.of(&d.seal_results, stream);
    let args = SealArgsDev {
        chunks,
        chunk_results,
        n_chunks,
        out,
        n_out,
        sealed,
        n_sealed,
        seal_results,
    };
    let cfg = LaunchConfig {
        grid_dim: (chunk_grid, 1, 1),
        block_dim: (CHAIN_THREADS, 1, 1),
        shared_mem_bytes: SEAL_SHARED_BYTES,
    };
    // SAFETY: as `launch_encode_blocks`' (one chunk result and one seal result per chunk,
    // checked by `launch_encode_chain`).
    unsafe { launch_args(stream, func, &args, cfg, a) }?;
    Ok(())
}
