//! The crate's only `unsafe` code: calls into the host-compiled kernels (`build.rs`), into NVRTC
//! and into the CUDA driver (both loaded at run time through cudarc). Everything here is wrapped
//! in safe functions whose checks establish the invariants below; each `// SAFETY:` comment
//! names the invariant it relies on.
//!
//! # Invariants
//!
//! 1. **Mirrored layouts.** Each argument struct here (`*Args`, declared once for both
//!    [`Space`]s) and each block struct it points to has the layout of its C++ namesake in the
//!    kernel file of its module: [`lanes`] mirrors `kernels/rans_decode.cu` (and
//!    `kernels/rans32_experiment.cu`, whose words are 16-bit, [`LaneWord`]), [`chain`]
//!    `kernels/chain.cu`, [`dequant`] `kernels/dequant.cu`, [`encode`] `kernels/encode.cu` and
//!    [`pq`] `kernels/pq_search.cu` (`#[repr(C)]`, fields in the same order and of the same sizes;
//!    the block structs live in `rans.rs`, `quant.rs`, `encode.rs`, `encode_plan.rs` and `pq.rs`).
//!    Each module's test `layouts_match_the_kernel` compares every size and offset, in both spaces,
//!    with what the C++ compiler reports.
//! 2. **Counted buffers.** Every pointer passed to a kernel comes from a live slice, and the
//!    count passed beside it is that slice's length (for `tables`, its length in whole tables of
//!    `KVC_SLOTS` words). The kernels read or write a buffer only below its count: they check each
//!    block's ranges against the counts before use (`kvc_block_range_ok`, `kvc_block_tables_ok` and
//!    a symbol's table index against its block's table count in the lane decode;
//!    `kvc_dequant_block_ok` (with `kvc_dequant_values_ok` for a launch that maps its value
//!    symbols), per row of a paged output `kvc_dequant_pages_ok` and per table of a block's
//!    list `kvc_dequant_stage` in the dequantization; each part's source bytes and destination words, `kvc_gather_ok`, in the
//!    word gather), so any *content* of the inputs is memory-safe; only the counts must be
//!    right, and [`host_lane_decode`] and [`host_dequant`] derive them from the slices. In the lane
//!    decode, `symbols` and `symbol_table` have the same length and `status` holds 32 entries per
//!    block (the mapped lane decode and `kvc_map_escapes` do not read `symbol_table`, which may
//!    then be empty, or a null address on the device); in the dequantization, `status` holds one entry per block; in `kvc_map_escapes` and
//!    a dequantization that maps its value symbols, `resolve` (and the dequantization's
//!    `values`) one record per block, which the kernels read by block index; in the PQ search, one per
//!    query (the kernel checks each query's ranges, `kvc_pq_range_ok`, and the launch's shape,
//!    `kvc_pq_shape_ok`, before any read). In the encode chain the source is counted in whole
//!    elements of its dtype (`kvc_encode_blocks`) or in bytes (the last three launches),
//!    `symbols` and `symbol_table` have the same length, and results, block places, lane
//!    statuses and lengths, chunk and seal results are one (32 per block for the lanes) per
//!    block or chunk; the kernels check every block's and chunk's ranges (`kvc_enc_ok`,
//!    `kvc_block_size`, `kvc_chunk_ok`, `kvc_sealed_size`, the places in `kvc_wb_place` and
//!    `kvc_seal_finish`), and mask or bound what another block may rewrite meanwhile on a device
//!    (a symbol's exponent, an escape's rank; a block's place is written only by the chunk the
//!    block names).
//! 3. **Launch shape.** The host runs get `grid = blocks.len()` (checked to fit `u32`); the lane
//!    decode `grid = blocks.len().div_ceil(warps)`, 32 threads per warp and `warps *
//!    shared_tables * KVC_SLOTS * 4` bytes of shared memory (its
//!    [`LaneShape`](crate::rans::LaneShape)), the amount the kernel assumes for `shared_tables`
//!    tables per warp; the dequantization and the quantization [`channel_threads`] threads
//!    (any count: they stride over the channels) and, the dequantization,
//!    [`DEQUANT_SHARED_BYTES`] of shared memory; the PQ search its [`PqShape`]'s threads (at most
//!    [`PQ_MAX_THREADS`], which the kernel checks) and [`PQ_SHARED_HEADER_BYTES`] plus 4 bytes per
//!    table entry and per shared key, the `table_capacity` and `key_capacity` it is told (the
//!    kernel checks that the table fits the one, and keeps only queries of at most the other's
//!    tokens there); the encode chain [`channel_threads`] threads (at least 16) and
//!    [`ENCODE_SHARED_BYTES`] (`kvc_encode_blocks`, one CUDA block per coded block), or
//!    [`CHAIN_THREADS`] threads and [`PLACE_SHARED_BYTES`] (`kvc_place_blocks`, one per chunk),
//!    [`WRITE_SHARED_BYTES`] (`kvc_write_blocks`, one per coded block) or
//!    [`SEAL_SHARED_BYTES`] (`kvc_seal_chunks`, one per chunk) of shared memory; the chain's
//!    verdict any grid of [`CHAIN_THREADS`] threads (they stride over the statuses) and none.
//! 4. **Libraries before symbols.** No cudarc NVRTC or driver function is called unless
//!    `is_culib_present()` said the library loads (cudarc panics otherwise, `DESIGN.md` §8), and no
//!    NVRTC function is called before [`nvrtc_missing_symbol`] found all of [`NVRTC_SYMBOLS`] in
//!    the loaded library (cudarc panics on a missing symbol).
//! 5. **Program lifetime.** An NVRTC program is created, used and destroyed inside
//!    [`nvrtc_compile`]; the source, name, header and option strings it points to outlive it.
//! 6. **Device buffers.** A [`DevBuf`]'s count never exceeds its allocation (for a view into a
//!    packed upload, its part: [`Packer`] lays the parts out disjoint and [`PACK_ALIGN`]-aligned
//!    within the one allocation, and [`DevBuf::view`] checks the part lies inside it), and every
//!    device launch passes each buffer's address with that count (as invariant 2 on the host), so
//!    the kernels' own range checks keep every access inside the buffers. The buffers outlive the
//!    launch: the launch functions borrow them, and `Gpu` synchronizes the stream before it drops
//!    or reads them.
//! 7. **Device values.** The types given to cudarc as `DeviceRepr` / `ValidAsZeroBits` are
//!    `#[repr(C)]` structs of integers and floats mirrored from the kernels (invariant 1, the
//!    argument structs in [`OnDevice`] having 8-byte addresses where the kernels have pointers):
//!    any bit pattern is a valid value.
//! 8. **Shared memory.** A lane-decode launch asks for `warps * shared_tables * 16 KiB` of dynamic
//!    shared memory only after `Gpu` raised the function's limit to at least that (or it is within
//!    the default 48 KiB); a PQ search launch asks for its [`PqShape`]'s bytes, shaped within the
//!    budget `Gpu` raised the function's limit to (the device's opt-in maximum).
#![allow(unsafe_code)]

use std::ffi::c_int;

use cudarc::driver::{CudaFunction, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg};

use crate::error::CudaError;

/// The size of each struct named, then the offset of each field named, in the order given:
/// what a kernel file's `*_layout` function reports for its C++ structs (invariant 1).
#[cfg(test)]
macro_rules! layout {
    ($($t:ty { $($f:ident),* $(,)? }),* $(,)?) => {{
        let mut v: Vec<u64> = Vec::new();
        $(
            v.push(std::mem::size_of::<$t>() as u64);
            $(v.push(std::mem::offset_of!($t, $f) as u64);)*
        )*
        v
    }};
}

/// Marks block structs mirrored from the kernels as values cudarc may copy to the device and
/// zero there.
macro_rules! device_values {
    ($($t:ty),* $(,)?) => {
        $(
            // SAFETY (invariant 7): `#[repr(C)]` integers and floats with the layout the kernels
            // declare (invariant 1); every bit pattern, all zeros included, is a valid value.
            unsafe impl cudarc::driver::DeviceRepr for $t {}
            // SAFETY: as above.
            unsafe impl cudarc::driver::ValidAsZeroBits for $t {}
        )*
    };
}

mod chain;
mod dequant;
mod driver;
mod encode;
mod lanes;
mod mem;
mod nvrtc;
mod pq;

pub(crate) use chain::*;
pub(crate) use dequant::*;
pub(crate) use driver::*;
pub(crate) use encode::*;
pub(crate) use lanes::*;
pub(crate) use mem::*;
pub(crate) use nvrtc::*;
pub(crate) use pq::*;

/// Lanes per coded block (`KVC_LANES`).
pub(crate) const LANES: usize = 32;
/// Entries of one packed decode table (`KVC_SLOTS`).
pub(crate) const SLOTS: usize = 4096;
/// Entries of one decode table in the compact form (`KVC_COMPACT_ENTRIES`).
pub(crate) const COMPACT_ENTRIES: usize = 512;

/// Entries of one decode table in the packed form or, when `compact`, the compact one.
pub(crate) const fn table_entries(compact: bool) -> usize {
    match compact {
        true => COMPACT_ENTRIES,
        false => SLOTS,
    }
}

/// Threads per block of the chain kernels.
pub(crate) const CHAIN_THREADS: u32 = 256;

/// The most blocks of one launch: CUDA's limit on `gridDim.x`, which the host runs keep too.
const MAX_GRID: usize = (1 << 31) - 1;

/// The grid of a launch over `n` blocks (coded blocks, chunks or queries: one each).
fn launch_grid(n: usize) -> Result<u32, CudaError> {
    match u32::try_from(n) {
        Ok(g) if n <= MAX_GRID => Ok(g),
        _ => Err(CudaError::Input {
            what: "over 2^31 - 1 blocks in one launch",
        }),
    }
}

/// The launch shape of a grid of `grid` blocks of `threads` threads with `shared` bytes of
/// dynamic shared memory each (invariants 3 and 8).
fn launch_shape(grid: u32, threads: u32, shared: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: shared,
    }
}

/// A host run's return code as a result: 0, or the shared memory could not be allocated or the
/// launch shape is one the device would reject.
fn host_ran(rc: c_int, entry: &'static str) -> Result<(), CudaError> {
    match rc {
        0 => Ok(()),
        _ => Err(CudaError::HostRun { entry }),
    }
}

/// What the addresses in a kernel's argument struct are: pointers into live slices for the
/// host runs ([`OnHost`]), device addresses for launches ([`OnDevice`], 8 bytes like the
/// kernels' pointers on the device). Each argument struct is declared once, generic over its
/// space, so the two cannot drift apart (invariants 1 and 7).
pub(crate) trait Space {
    /// The address of a buffer the kernel reads.
    type Const<T>: Copy + std::fmt::Debug;
    /// The address of a buffer the kernel writes.
    type Mut<T>: Copy + std::fmt::Debug;
}

/// Argument structs of the host runs: raw pointers.
#[derive(Clone, Copy, Debug)]
pub(crate) struct OnHost;

impl Space for OnHost {
    type Const<T> = *const T;
    type Mut<T> = *mut T;
}

/// Argument structs of device launches: device addresses.
#[derive(Clone, Copy, Debug)]
pub(crate) struct OnDevice;

impl Space for OnDevice {
    type Const<T> = u64;
    type Mut<T> = u64;
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

/// What one of the kernels' `*_layout` functions reports: the sizes and offsets the C++
/// compiler gives their argument structs (at most 128 values).
#[cfg(test)]
fn host_layout(layout: unsafe extern "C" fn(*mut u64, u64) -> u64) -> Vec<u64> {
    let mut out = vec![0u64; 128];
    // SAFETY: every `*_layout` function writes at most `cap` (= out.len()) values to `out`.
    let n = unsafe { layout(out.as_mut_ptr(), out.len() as u64) };
    out.truncate((n as usize).min(128));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A launch of more blocks than CUDA's grid holds is an input error, on the host runs too.
    #[test]
    fn grids_stop_at_cudas_limit() {
        assert_eq!(launch_grid(0).unwrap(), 0);
        assert_eq!(launch_grid(MAX_GRID).unwrap(), (1 << 31) - 1);
        assert!(matches!(
            launch_grid(MAX_GRID + 1),
            Err(CudaError::Input { .. })
        ));
        assert!(launch_grid(usize::MAX).is_err());
    }
}
