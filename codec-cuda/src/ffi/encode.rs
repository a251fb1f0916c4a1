//! The encode kernels (`kernels/encode.cu`): quantization and lane encode, and the encode
//! chain from K/V rows to sealed chunks.

use std::ffi::c_int;

use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr};

use super::{
    channel_threads, host_ran, launch_args, launch_grid, launch_shape, Addrs, DevBuf, OnDevice,
    OnHost, Space, CHAIN_THREADS, LANES,
};
use crate::encode::{LaneEncodeBlock, QuantBlock};
use crate::encode_plan::{
    ChunkOut, ChunkResult, EncBlock, EncResult, ImportancePolicy, SealResult,
};
use crate::error::CudaError;
use crate::quant::ChannelConsts;

// The kernels compiled for the host (`build.rs`).
extern "C" {
    fn kvc_quantize_host(
        args: *const QuantArgs<OnHost>,
        grid: u32,
        block: u32,
        shared_bytes: u64,
    ) -> c_int;
    fn kvc_rans_lane_encode_host(
        args: *const LaneEncodeArgs<OnHost>,
        grid: u32,
        block: u32,
        shared_bytes: u64,
    ) -> c_int;
    #[cfg(test)]
    fn kvc_encode_layout(out: *mut u64, cap: u64) -> u64;
    #[cfg(test)]
    fn kvc_lane_divmod_test(x: u64, f: u32, rem: *mut u64) -> u64;
    fn kvc_encode_blocks_host(
        args: *const EncodeArgs<OnHost>,
        grid: u32,
        block: u32,
        shared_bytes: u64,
    ) -> c_int;
    #[cfg(test)]
    fn kvc_encode_chain_layout(out: *mut u64, cap: u64) -> u64;
    fn kvc_place_blocks_host(
        args: *const WriteArgs<OnHost>,
        grid: u32,
        block: u32,
        shared_bytes: u64,
    ) -> c_int;
    fn kvc_write_blocks_host(
        args: *const WriteArgs<OnHost>,
        grid: u32,
        block: u32,
        shared_bytes: u64,
    ) -> c_int;
    fn kvc_seal_chunks_host(
        args: *const WriteArgs<OnHost>,
        grid: u32,
        block: u32,
        shared_bytes: u64,
    ) -> c_int;
    fn kvc_quantize_one_host(r: f32, step: f32) -> i32;
}

/// `KvcQuantArgs` (invariant 1).
#[repr(C)]
#[derive(Debug)]
struct QuantArgs<S: Space> {
    x: S::Const<f32>,
    n_x: u64,
    exps: S::Const<u8>,
    n_exps: u64,
    consts: S::Const<ChannelConsts>,
    n_consts: u64,
    q: S::Mut<i32>,
    n_q: u64,
    blocks: S::Const<QuantBlock>,
    status: S::Mut<u32>,
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

/// Runs `kvc_quantize` on the host: one block per entry of `io.blocks`, [`channel_threads`]
/// threads.
pub(crate) fn host_quantize(io: QuantIo<'_>) -> Result<(), CudaError> {
    let grid = launch_grid(io.blocks.len())?;
    if io.status.len() != io.blocks.len() {
        return Err(CudaError::Input {
            what: "status buffer is not one entry per block",
        });
    }
    let args = QuantArgs::<OnHost> {
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
    let threads = channel_threads(io.heads, io.head_dim);
    let rc = unsafe { kvc_quantize_host(&args, grid, threads, 0) };
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
struct LaneEncodeArgs<S: Space> {
    symbols: S::Const<u8>,
    symbol_table: S::Const<u16>,
    n_symbols: u64,
    tables: S::Const<u32>,
    n_tables: u64,
    table_list: S::Const<u32>,
    n_table_list: u64,
    words: S::Mut<u32>,
    n_words: u64,
    lane_len: S::Mut<u32>,
    blocks: S::Const<LaneEncodeBlock>,
    status: S::Mut<u32>,
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
    let grid = launch_grid(io.blocks.len())?;
    if io.symbols.len() != io.symbol_table.len() {
        return Err(input("symbol and symbol-table buffers differ in length"));
    }
    if io.status.len() != io.blocks.len() * LANES || io.lane_len.len() != io.status.len() {
        return Err(input(
            "status and lane-length buffers are not 32 entries per block",
        ));
    }
    let args = LaneEncodeArgs::<OnHost> {
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
struct EncodeArgs<S: Space> {
    src: S::Const<u8>,
    n_src: u64,
    dtype: u32,
    max_exp: u32,
    slope: f64,
    inv_sqrt_d: f64,
    qref: S::Const<f64>,
    n_qref: u64,
    tau: S::Const<f32>,
    n_tau: u64,
    rot: S::Const<f64>,
    n_rot: u64,
    consts: S::Const<ChannelConsts>,
    n_consts: u64,
    map: S::Const<u16>,
    n_map: u64,
    table_list: S::Const<u32>,
    n_table_list: u64,
    radius: S::Const<u8>,
    n_radius: u64,
    tables: S::Mut<u32>,
    n_tables: u64,
    symbols: S::Mut<u8>,
    symbol_table: S::Mut<u16>,
    n_symbols: u64,
    q: S::Mut<i32>,
    n_q: u64,
    escapes: S::Mut<i32>,
    n_escapes: u64,
    blocks: S::Const<EncBlock>,
    results: S::Mut<EncResult>,
    lane_blocks: S::Mut<LaneEncodeBlock>,
    n_blocks: u64,
    heads: u32,
    head_dim: u32,
    rope_style: u32,
    reserved: u32,
}

/// Bytes of `KvcEncShared` (6 counters, 16 counts, 16 frequencies, `KVC_ENC_TILES` tiles,
/// `KVC_SCAN_THREADS` shares, `KVC_ENC_LIST` radii).
pub(crate) const ENCODE_SHARED_BYTES: u32 = 6 * 4 + 16 * 4 + 16 * 2 + 4 * 4096 + 4 * 256 + 256;

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
    let grid = launch_grid(io.blocks.len())?;
    if io.results.len() != io.blocks.len()
        || io.lane_blocks.len() != io.blocks.len()
        || io.symbols.len() != io.symbol_table.len()
    {
        return Err(input("encode-chain buffers of mismatched lengths"));
    }
    let size = if io.dtype == 0 { 4 } else { 2 };
    let policy = io.importance.unwrap_or_default();
    let args = EncodeArgs::<OnHost> {
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
    // `symbol_table` of one length, one result and lane record per block) and 3
    // (channel_threads threads, the shared memory KvcEncShared needs).
    let threads = channel_threads(io.heads, io.head_dim);
    let rc = unsafe { kvc_encode_blocks_host(&args, grid, threads, shared) };
    host_ran(rc, "kvc_encode_blocks")
}

/// `KvcWriteArgs` (invariant 1): the arguments of the chain's last three launches.
#[repr(C)]
#[derive(Debug)]
struct WriteArgs<S: Space> {
    src: S::Const<u8>,
    n_src_bytes: u64,
    elem_bytes: u32,
    heads: u32,
    head_dim: u32,
    reserved: u32,
    blocks: S::Const<EncBlock>,
    results: S::Const<EncResult>,
    n_blocks: u64,
    escapes: S::Const<i32>,
    n_escapes: u64,
    words: S::Const<u32>,
    n_words: u64,
    lane_len: S::Const<u32>,
    lane_status: S::Const<u32>,
    block_at: S::Mut<u64>,
    chunks: S::Const<ChunkOut>,
    chunk_results: S::Mut<ChunkResult>,
    n_chunks: u64,
    sealed: S::Mut<u8>,
    n_sealed: u64,
    seal_results: S::Mut<SealResult>,
}

/// Bytes of `KvcPlaceShared` (a size per block of a chunk, `KVC_CHUNK_BLOCKS` of them).
pub(crate) const PLACE_SHARED_BYTES: u32 = 8 * 2048;

/// Bytes of `KvcBlockShared`: two counters, seven places and sizes, the block's result, its
/// lane lengths and their 33 running sums, the CRC table, 4 bytes of padding, a sum per thread
/// of `KVC_CRC_THREADS` = [`CHAIN_THREADS`].
pub(crate) const WRITE_SHARED_BYTES: u32 =
    2 * 4 + 7 * 8 + 48 + 4 * 32 + 4 * 33 + 4 * 256 + 4 + 8 * CHAIN_THREADS;

/// Bytes of `KvcSealShared` (a sum per thread).
pub(crate) const SEAL_SHARED_BYTES: u32 = 8 * CHAIN_THREADS;

/// The buffers of the chain's last three launches (`kvc_place_blocks`, `kvc_write_blocks`,
/// `kvc_seal_chunks`).
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
    /// One per block.
    pub block_at: &'a mut [u64],
    pub chunks: &'a [ChunkOut],
    /// One per chunk.
    pub chunk_results: &'a mut [ChunkResult],
    pub sealed: &'a mut [u8],
    /// One per chunk.
    pub seal_results: &'a mut [SealResult],
}

/// Runs `kvc_place_blocks`, `kvc_write_blocks` and `kvc_seal_chunks` on the host.
pub(crate) fn host_write_chunks(io: WriteIo<'_>) -> Result<(), CudaError> {
    let input = |what| CudaError::Input { what };
    let (grid, chunk_grid) = (launch_grid(io.blocks.len())?, launch_grid(io.chunks.len())?);
    let (n, n_chunks) = (io.blocks.len(), io.chunks.len());
    if io.results.len() != n
        || io.lane_len.len() != n * LANES
        || io.lane_status.len() != n * LANES
        || io.block_at.len() != n
        || io.chunk_results.len() != n_chunks
        || io.seal_results.len() != n_chunks
    {
        return Err(input("chunk-writing buffers of mismatched lengths"));
    }
    let args = WriteArgs::<OnHost> {
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
        block_at: io.block_at.as_mut_ptr(),
        chunks: io.chunks.as_ptr(),
        chunk_results: io.chunk_results.as_mut_ptr(),
        n_chunks: n_chunks as u64,
        sealed: io.sealed.as_mut_ptr(),
        n_sealed: io.sealed.len() as u64,
        seal_results: io.seal_results.as_mut_ptr(),
    };
    let t = CHAIN_THREADS;
    // SAFETY (the three calls): invariants 1, 2 (pointer/count pairs from live slices,
    // borrowed for the call; one result, block place and 32 lane entries per block, one chunk
    // result and seal result per chunk) and 3 (CHAIN_THREADS threads, the shared memory each
    // kernel's struct needs).
    let rc = unsafe { kvc_place_blocks_host(&args, chunk_grid, t, PLACE_SHARED_BYTES.into()) };
    host_ran(rc, "kvc_place_blocks")?;
    let rc = unsafe { kvc_write_blocks_host(&args, grid, t, WRITE_SHARED_BYTES.into()) };
    host_ran(rc, "kvc_write_blocks")?;
    let rc = unsafe { kvc_seal_chunks_host(&args, chunk_grid, t, SEAL_SHARED_BYTES.into()) };
    host_ran(rc, "kvc_seal_chunks")
}

// SAFETY (invariant 7): `#[repr(C)]` integers and floats (invariant 1).
unsafe impl DeviceRepr for QuantArgs<OnDevice> {}
unsafe impl DeviceRepr for LaneEncodeArgs<OnDevice> {}
unsafe impl DeviceRepr for EncodeArgs<OnDevice> {}
unsafe impl DeviceRepr for WriteArgs<OnDevice> {}
device_values!(
    QuantBlock,
    LaneEncodeBlock,
    EncBlock,
    EncResult,
    ChunkOut,
    ChunkResult,
    SealResult
);

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
    let grid = launch_grid(b.blocks.len())?;
    if grid == 0 {
        return Ok(());
    }
    let mut a = Addrs::default();
    let (x, n_x) = a.of(&b.x, stream);
    let (exps, n_exps) = a.of(&b.exps, stream);
    let (consts, n_consts) = a.of(&b.consts, stream);
    let (q, n_q) = a.of(&b.q, stream);
    let (blocks, n_blocks) = a.of(&b.blocks, stream);
    let (status, _) = a.of(&b.status, stream);
    let args = QuantArgs::<OnDevice> {
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
    let cfg = launch_shape(grid, channel_threads(b.heads, b.head_dim), 0);
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
    let grid = launch_grid(b.blocks.len())?;
    if grid == 0 {
        return Ok(());
    }
    let mut a = Addrs::default();
    let (symbols, n_symbols) = a.of(&b.symbols, stream);
    let (symbol_table, _) = a.of(&b.symbol_table, stream);
    let (tables, n_table_words) = a.of(&b.tables, stream);
    let (table_list, n_table_list) = a.of(&b.table_list, stream);
    let (words, n_words) = a.of(&b.words, stream);
    let (lane_len, _) = a.of(&b.lane_len, stream);
    let (blocks, n_blocks) = a.of(&b.blocks, stream);
    let (status, _) = a.of(&b.status, stream);
    let args = LaneEncodeArgs::<OnDevice> {
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
    let cfg = launch_shape(grid, LANES as u32, 0);
    // SAFETY: invariants 1, 6 (buffers live in `b`, held by the caller until the stream is
    // synchronized), 7 and 3 (32 threads, no shared memory).
    unsafe { launch_args(stream, func, &args, cfg, a) }?;
    Ok(())
}

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
/// [`crate::encode_plan::EncodePlan`]); the five launches share them.
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
    /// Per block its place in its chunk.
    pub block_at: DevBuf<u64>,
    pub chunk_results: DevBuf<ChunkResult>,
    /// The chunks sealed and packed (the only part copied back), one result per chunk.
    pub sealed: DevBuf<u8>,
    pub seal_results: DevBuf<SealResult>,
    pub heads: u32,
    pub head_dim: u32,
}

/// The encode chain's five entry points.
pub(crate) struct EncodeKernels<'k> {
    pub blocks: &'k CudaFunction,
    pub lanes: &'k CudaFunction,
    pub place: &'k CudaFunction,
    pub write: &'k CudaFunction,
    pub seal: &'k CudaFunction,
}

/// Launches in the encode chain.
pub(crate) const ENCODE_STAGES: usize = 5;

/// Queues the encode chain over `d` on `stream`: `kvc_encode_blocks`, `kvc_rans_lane_encode`,
/// `kvc_place_blocks`, `kvc_write_blocks` and `kvc_seal_chunks`, reading the source tensors
/// `src`; with `stage_done`, calls it after each launch is queued with the launch's index (0
/// to [`ENCODE_STAGES`] - 1: for benches, to time each launch alone).
pub(crate) fn launch_encode_chain<T>(
    stream: &CudaStream,
    k: &EncodeKernels<'_>,
    d: &EncodeDev,
    src: &DevSource<'_, T>,
    mut stage_done: Option<&mut dyn FnMut(usize) -> Result<(), CudaError>>,
) -> Result<(), CudaError> {
    let input = |what| CudaError::Input { what };
    let n = d.blocks.len();
    if d.results.len() != n
        || d.lanes.blocks.len() != n
        || d.lanes.status.len() != n * LANES
        || d.lanes.lane_len.len() != n * LANES
        || d.lanes.symbols.len() != d.lanes.symbol_table.len()
        || d.block_at.len() != n
        || d.chunk_results.len() != d.chunks.len()
        || d.seal_results.len() != d.chunks.len()
        || !(src.elem_bytes == 2 || src.elem_bytes == 4)
    {
        return Err(input("encode-chain buffers of mismatched lengths"));
    }
    let grid = launch_grid(n)?;
    let chunk_grid = launch_grid(d.chunks.len())?;
    if grid == 0 || chunk_grid == 0 {
        return Ok(());
    }
    for stage in 0..ENCODE_STAGES {
        match stage {
            0 => launch_encode_blocks(stream, k.blocks, d, src, grid)?,
            1 => launch_lane_encode(stream, k.lanes, &d.lanes)?,
            2 => launch_write(stream, k.place, d, src, (chunk_grid, PLACE_SHARED_BYTES))?,
            3 => launch_write(stream, k.write, d, src, (grid, WRITE_SHARED_BYTES))?,
            _ => launch_write(stream, k.seal, d, src, (chunk_grid, SEAL_SHARED_BYTES))?,
        }
        if let Some(done) = stage_done.as_mut() {
            done(stage)?;
        }
    }
    Ok(())
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
    let mut a = Addrs::default();
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
    let args = EncodeArgs::<OnDevice> {
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
    let threads = channel_threads(d.heads, d.head_dim);
    let cfg = launch_shape(grid, threads, ENCODE_SHARED_BYTES);
    // SAFETY: invariants 1, 6 (buffers live in `d` and `src`, held by the caller until the
    // stream is synchronized; `src` counted in whole elements), 7 and 3 (the host runs'
    // launch shape and shared memory, within the default 48 KiB).
    unsafe { launch_args(stream, func, &args, cfg, a) }?;
    Ok(())
}

/// Queues one of the chain's last three launches (`func`, taking `KvcWriteArgs`) over `d` with
/// `shape`'s grid (checked by [`launch_encode_chain`]) and shared memory.
fn launch_write<T>(
    stream: &CudaStream,
    func: &CudaFunction,
    d: &EncodeDev,
    src: &DevSource<'_, T>,
    shape: (u32, u32),
) -> Result<(), CudaError> {
    let mut a = Addrs::default();
    let (src_ptr, src_bytes) = src.addr(&mut a, stream);
    let (blocks, n_blocks) = a.of(&d.blocks, stream);
    let (results, _) = a.of(&d.results, stream);
    let (escapes, n_escapes) = a.of(&d.escapes, stream);
    let (words, n_words) = a.of(&d.lanes.words, stream);
    let (lane_len, _) = a.of(&d.lanes.lane_len, stream);
    let (lane_status, _) = a.of(&d.lanes.status, stream);
    let (block_at, _) = a.of(&d.block_at, stream);
    let (chunks, n_chunks) = a.of(&d.chunks, stream);
    let (chunk_results, _) = a.of(&d.chunk_results, stream);
    let (sealed, n_sealed) = a.of(&d.sealed, stream);
    let (seal_results, _) = a.of(&d.seal_results, stream);
    let args = WriteArgs::<OnDevice> {
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
        block_at,
        chunks,
        chunk_results,
        n_chunks,
        sealed,
        n_sealed,
        seal_results,
    };
    let cfg = launch_shape(shape.0, CHAIN_THREADS, shape.1);
    // SAFETY: as `launch_encode_blocks`' (one result, block place and 32 lane entries per
    // block, one chunk result and seal result per chunk, checked by `launch_encode_chain`).
    unsafe { launch_args(stream, func, &args, cfg, a) }?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ffi::host_layout;

    /// The lane encoder's quotient and remainder (host build).
    fn lane_divmod(x: u64, f: u32) -> (u64, u64) {
        let mut rem = u64::MAX;
        // SAFETY: a plain function of two integers writing one through a live pointer.
        let q = unsafe { kvc_lane_divmod_test(x, f, &mut rem) };
        (q, rem)
    }

    /// The largest state the lane encoder divides by `f`: below `f * 2^52` (after
    /// renormalisation) or, for `f` of 2^12 and more, any.
    fn largest_state(f: u32) -> u64 {
        (u64::from(f) << 52)
            .checked_sub(1)
            .filter(|_| f < 1 << 12)
            .unwrap_or(u64::MAX)
    }

    /// The lane encoder's division without a 64-bit divide is the division, at the edges of
    /// its states (0, around powers of two and multiples of `f`, the largest) and for every
    /// frequency a table may hold.
    #[test]
    fn lane_divmod_is_the_division_at_the_edges() {
        for f in (1..=4097).chain([8191, 65535, u32::from(u16::MAX) + 7]) {
            let top = largest_state(f);
            let f64_ = u64::from(f);
            let mut xs = vec![
                0,
                1,
                f64_ - 1,
                f64_,
                f64_ + 1,
                top,
                top - 1,
                top / 2,
                top / 3,
            ];
            xs.extend((40..64).map(|b| 1u64 << b).filter(|&x| x <= top));
            xs.extend([top / f64_ * f64_, (top / f64_ * f64_).saturating_sub(1)]);
            for x in xs.into_iter().filter(|&x| x <= top) {
                assert_eq!(lane_divmod(x, f), (x / f64_, x % f64_), "{x} / {f}");
            }
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(4096))]

        /// ... and at any state.
        #[test]
        fn lane_divmod_is_the_division(f in 1u32..70000, at in proptest::prelude::any::<u64>()) {
            let x = largest_state(f).checked_add(1).map_or(at, |n| at % n);
            let f64_ = u64::from(f);
            proptest::prop_assert_eq!(lane_divmod(x, f), (x / f64_, x % f64_));
        }
    }

    /// What `kvc_encode_layout` reports, from the mirrors in space `S`.
    fn rust_encode_layout<S: Space>() -> Vec<u64> {
        let mut v = layout![
            QuantBlock {
                x_start, exp_start, q_start, consts_start, rows, sink_rows, group, has_exps
            },
            QuantArgs<S> {
                x, n_x, exps, n_exps, consts, n_consts, q, n_q, blocks, status, n_blocks, heads,
                head_dim
            },
            LaneEncodeBlock {
                symbol_start, word_start, n_symbols, lane_cap, table_start, table_count
            },
            LaneEncodeArgs<S> {
                symbols, symbol_table, n_symbols, tables, n_tables, table_list, n_table_list, words,
                n_words, lane_len, blocks, status, n_blocks
            },
        ];
        v.push(codec_core::consts::MAX_SYMBOL as u64);
        v
    }

    /// What `kvc_encode_chain_layout` reports, from the mirrors in space `S`.
    fn rust_encode_chain_layout<S: Space>() -> Vec<u64> {
        let mut v = layout![
            EncBlock {
                x_start, k_start, qref_start, tau_start, consts_start, map_start, sym_start,
                q_start, escape_start, word_start, rows, sink_rows, group, importance, table_start,
                table_count, lane_cap, rot_start, rotate, chunk
            },
            EncResult { status, n_e, n_escapes, n_exp, exp_freqs },
            EncodeArgs<S> {
                src, n_src, dtype, max_exp, slope, inv_sqrt_d, qref, n_qref, tau, n_tau, rot, n_rot,
                consts, n_consts, map, n_map, table_list, n_table_list, radius, n_radius, tables,
                n_tables, symbols, symbol_table, n_symbols, q, n_q, escapes, n_escapes, blocks,
                results, lane_blocks, n_blocks, heads, head_dim, rope_style
            },
        ];
        v.push(u64::from(ENCODE_SHARED_BYTES));
        v.extend(layout![
            ChunkOut { first_block, cap, n_blocks },
            ChunkResult { len, status, crc },
            SealResult { start, len, status },
            WriteArgs<S> {
                src, n_src_bytes, elem_bytes, heads, head_dim, blocks, results, n_blocks, escapes,
                n_escapes, words, n_words, lane_len, lane_status, block_at, chunks, chunk_results,
                n_chunks, sealed, n_sealed, seal_results
            },
        ]);
        v.push(u64::from(PLACE_SHARED_BYTES));
        v.push(u64::from(WRITE_SHARED_BYTES));
        v.push(u64::from(SEAL_SHARED_BYTES));
        v
    }

    /// Invariant 1 for `kernels/encode.cu`: its single kernels and its chain.
    #[test]
    fn layouts_match_the_kernel() {
        let (single, chain) = (kvc_encode_layout, kvc_encode_chain_layout);
        assert_eq!(host_layout(single), rust_encode_layout::<OnHost>());
        assert_eq!(host_layout(single), rust_encode_layout::<OnDevice>());
        assert_eq!(host_layout(chain), rust_encode_chain_layout::<OnHost>());
        assert_eq!(host_layout(chain), rust_encode_chain_layout::<OnDevice>());
    }
}
