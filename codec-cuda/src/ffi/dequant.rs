//! The dequantization (`kernels/dequant.cu`): closed-loop reconstruction written as f16/bf16
//! rows, contiguous or paged.

use std::ffi::c_int;

use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtrMut, DeviceRepr};

use super::{
    host_ran, launch_args, launch_grid, launch_shape, Addrs, DevBuf, OnDevice, OnHost, Space,
};
use super::{ResolveBlock, ValueBlock};
use crate::error::CudaError;
use crate::quant::{ChannelConsts, DequantBlock, OutDtype};

// The kernels compiled for the host (`build.rs`).
extern "C" {
    fn kvc_dequant_f16_host(
        args: *const DequantArgs<OnHost>,
        grid: u32,
        block: u32,
        shared_bytes: u64,
    ) -> c_int;
    fn kvc_dequant_bf16_host(
        args: *const DequantArgs<OnHost>,
        grid: u32,
        block: u32,
        shared_bytes: u64,
    ) -> c_int;
    #[cfg(test)]
    fn kvc_dequant_layout(out: *mut u64, cap: u64) -> u64;
    fn kvc_f32_to_f16_host(x: f32) -> u16;
    fn kvc_f32_to_bf16_host(x: f32) -> u16;
}

/// `KvcDequantArgs` (invariant 1).
#[repr(C)]
#[derive(Debug)]
struct DequantArgs<S: Space> {
    q: S::Const<i32>,
    n_q: u64,
    exps: S::Const<u8>,
    n_exps: u64,
    sink: S::Const<f32>,
    n_sink: u64,
    consts: S::Const<ChannelConsts>,
    n_consts: u64,
    out: S::Mut<u16>,
    n_out: u64,
    pages: S::Const<u32>,
    n_pages: u64,
    blocks: S::Const<DequantBlock>,
    status: S::Mut<u32>,
    n_blocks: u64,
    heads: u32,
    head_dim: u32,
    page_size: u32,
    reserved: u32,
    mapped: DequantValues<S>,
}

/// `KvcDequantValues` (invariant 1): all null and 0 for a launch given its values.
#[repr(C)]
#[derive(Debug)]
struct DequantValues<S: Space> {
    values: S::Const<ValueBlock>,
    resolve: S::Const<ResolveBlock>,
    n_values: u64,
    indices: S::Const<u8>,
    n_indices: u64,
    map: S::Const<u16>,
    n_map: u64,
    table_list: S::Const<u32>,
    n_table_list: u64,
    radius: S::Const<u8>,
    n_radius: u64,
}

impl DequantValues<OnHost> {
    const NONE: Self = DequantValues {
        values: std::ptr::null(),
        resolve: std::ptr::null(),
        n_values: 0,
        indices: std::ptr::null(),
        n_indices: 0,
        map: std::ptr::null(),
        n_map: 0,
        table_list: std::ptr::null(),
        n_table_list: 0,
        radius: std::ptr::null(),
        n_radius: 0,
    };
}

impl DequantValues<OnDevice> {
    const NONE: Self = DequantValues {
        values: 0,
        resolve: 0,
        n_values: 0,
        indices: 0,
        n_indices: 0,
        map: 0,
        n_map: 0,
        table_list: 0,
        n_table_list: 0,
        radius: 0,
        n_radius: 0,
    };
}

/// Most threads per block of the walks down a coded block's channels (the dequantization, the
/// quantization and the encode chain's `kvc_encode_blocks`).
pub(crate) const MAX_CHANNEL_THREADS: u32 = 256;

/// Threads per block of a walk down each of `heads * head_dim` channels: a thread per channel,
/// in as few rounds of at most [`MAX_CHANNEL_THREADS`] as hold them, in whole warps. A thread
/// walks its channels' rows one after another (the closed loop of spec/FORMAT.md §7.2), so a
/// block takes a walk per round: a fixed 128 threads took two over the 192 channels of 3
/// heads of 64, the second half idle. The kernels stride over the channels: any count gives
/// the same bits.
pub(crate) fn channel_threads(heads: u32, head_dim: u32) -> u32 {
    let c = u64::from(heads) * u64::from(head_dim);
    let max = u64::from(MAX_CHANNEL_THREADS);
    let per_round = c.div_ceil(c.div_ceil(max).max(1));
    per_round.next_multiple_of(32).clamp(32, max) as u32
}

/// Dynamic shared memory of the dequantization kernel (`KvcDequantShared`: 8 +
/// `KVC_VALUE_LIST`).
pub(crate) const DEQUANT_SHARED_BYTES: u32 = 8 + 4096;

/// The value symbols a dequantization maps itself (`kernels/kvc_values.cuh`), a decode
/// chain's: block `b`'s are those of `values[b]` (one per dequantization block), each
/// symbol's table found through the block's table map in `map` (where `resolve[b]` says),
/// its escapes' values in `q` where `kvc_map_escapes` placed them.
#[derive(Clone, Copy, Debug)]
pub(crate) struct MappedValues<'a> {
    pub values: &'a [ValueBlock],
    pub resolve: &'a [ResolveBlock],
    pub indices: &'a [u8],
    pub map: &'a [u16],
    pub table_list: &'a [u32],
    pub radius: &'a [u8],
}

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
    /// The value symbols mapped in the launch (only the escapes' values in `q`), or `None`
    /// when `q` holds every value.
    pub mapped: Option<MappedValues<'a>>,
}

/// Runs `kvc_dequant_f16` or `kvc_dequant_bf16` on the host: one block per entry of
/// `io.blocks`, [`channel_threads`] threads, as on a device.
pub(crate) fn host_dequant(io: DequantIo<'_>) -> Result<(), CudaError> {
    let threads = channel_threads(io.heads, io.head_dim);
    host_dequant_threads(io, threads)
}

/// [`host_dequant`] on `threads` threads per block (at least 1).
pub(crate) fn host_dequant_threads(io: DequantIo<'_>, threads: u32) -> Result<(), CudaError> {
    let grid = launch_grid(io.blocks.len())?;
    if io.status.len() != io.blocks.len() {
        return Err(CudaError::Input {
            what: "status buffer is not one entry per block",
        });
    }
    let mapped = match io.mapped {
        None => DequantValues::<OnHost>::NONE,
        Some(m) if m.values.len() != io.blocks.len() || m.resolve.len() != io.blocks.len() => {
            return Err(CudaError::Input {
                what: "value blocks are not one per dequantization block",
            })
        }
        Some(m) => DequantValues::<OnHost> {
            values: m.values.as_ptr(),
            resolve: m.resolve.as_ptr(),
            n_values: m.values.len() as u64,
            indices: m.indices.as_ptr(),
            n_indices: m.indices.len() as u64,
            map: m.map.as_ptr(),
            n_map: m.map.len() as u64,
            table_list: m.table_list.as_ptr(),
            n_table_list: m.table_list.len() as u64,
            radius: m.radius.as_ptr(),
            n_radius: m.radius.len() as u64,
        },
    };
    let args = DequantArgs::<OnHost> {
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
        mapped,
    };
    let run = match io.dtype {
        OutDtype::F16 => kvc_dequant_f16_host,
        OutDtype::Bf16 => kvc_dequant_bf16_host,
    };
    let shared = u64::from(DEQUANT_SHARED_BYTES);
    // SAFETY: invariants 1 (layout), 2 (every pointer/count pair is a live slice and its
    // length, borrowed for the call, mutably for the outputs) and 3 (launch shape).
    let rc = unsafe { run(&args, grid, threads.max(1), shared) };
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

// SAFETY (invariant 7): `#[repr(C)]` integers and floats (invariant 1).
unsafe impl DeviceRepr for DequantArgs<OnDevice> {}
device_values!(DequantBlock, ChannelConsts);

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
    let values = DequantValuesDev {
        q: &b.q,
        exps: &b.exps,
        mapped: None,
    };
    launch_dequant_with(stream, func, b, values, out, n_out)
}

/// Where a dequantization launch finds its symbol values and exponents on the device.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DequantValuesDev<'a> {
    pub q: &'a DevBuf<i32>,
    pub exps: &'a DevBuf<u8>,
    /// As [`DequantIo::mapped`].
    pub mapped: Option<MappedValuesDev<'a>>,
}

/// [`MappedValues`] on the device.
#[derive(Clone, Copy, Debug)]
pub(crate) struct MappedValuesDev<'a> {
    pub values: &'a DevBuf<ValueBlock>,
    pub resolve: &'a DevBuf<ResolveBlock>,
    pub indices: &'a DevBuf<u8>,
    pub map: &'a DevBuf<u16>,
    pub table_list: &'a DevBuf<u32>,
    pub radius: &'a DevBuf<u8>,
}

impl DequantValues<OnDevice> {
    /// `m` as a launch reads it, its buffers' guards added to `a` (as `TableMapArgs::device` does a table map).
    fn device<'a>(m: MappedValuesDev<'a>, a: &mut Addrs<'a>, stream: &'a CudaStream) -> Self {
        let (values, n_values) = a.of(m.values, stream);
        let (resolve, _) = a.of(m.resolve, stream);
        let (indices, n_indices) = a.of(m.indices, stream);
        let (map, n_map) = a.of(m.map, stream);
        let (table_list, n_table_list) = a.of(m.table_list, stream);
        let (radius, n_radius) = a.of(m.radius, stream);
        DequantValues {
            values,
            resolve,
            n_values,
            indices,
            n_indices,
            map,
            n_map,
            table_list,
            n_table_list,
            radius,
            n_radius,
        }
    }
}

/// [`launch_dequant`] reading symbol values and exponents from `values` (a chain's earlier
/// launches) instead of `b`'s.
pub(super) fn launch_dequant_with(
    stream: &CudaStream,
    func: &CudaFunction,
    b: &DequantDev,
    values: DequantValuesDev<'_>,
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
    let grid = launch_grid(b.blocks.len())?;
    if grid == 0 {
        return Ok(());
    }
    let mut a = Addrs::default();
    let (q, n_q) = a.of(values.q, stream);
    let (exps, n_exps) = a.of(values.exps, stream);
    let mapped = match values.mapped {
        None => DequantValues::<OnDevice>::NONE,
        Some(m) if m.values.len() != b.blocks.len() || m.resolve.len() != b.blocks.len() => {
            return Err(input("value blocks are not one per dequantization block"))
        }
        Some(m) => DequantValues::device(m, &mut a, stream),
    };
    let (sink, n_sink) = a.of(&b.sink, stream);
    let (consts, n_consts) = a.of(&b.consts, stream);
    let (out_ptr, out_guard) = out.device_ptr_mut(stream);
    a.guards.push(out_guard);
    let n_out = n_out as u64;
    let (pages, n_pages) = a.of(&b.pages, stream);
    let (blocks, n_blocks) = a.of(&b.blocks, stream);
    let (status, _) = a.of(&b.status, stream);
    let args = DequantArgs::<OnDevice> {
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
        mapped,
    };
    let threads = channel_threads(b.heads, b.head_dim);
    let cfg = launch_shape(grid, threads, DEQUANT_SHARED_BYTES);
    // SAFETY: invariants 1, 6 (buffers live in `b`, `values` and `out`, held by the caller
    // until the stream is synchronized), 7 and 3 (the host runs' launch shape).
    unsafe { launch_args(stream, func, &args, cfg, a) }?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ffi::host_layout;
    use crate::quant::{ChannelConsts, DequantBatch, DequantInput};

    /// A thread per channel in as few rounds of at most 256 as hold them, in whole warps.
    #[test]
    fn channel_walks_take_as_few_rounds_as_hold_the_channels() {
        for (heads, head_dim, threads) in [
            (3, 64, 192),
            (1, 64, 64),
            (5, 64, 160),
            (8, 128, 256),
            (2, 200, 224),
            (1, 1, 32),
            (0, 0, 32),
            (32, 128, 256),
        ] {
            assert_eq!(
                channel_threads(heads, head_dim),
                threads,
                "{heads} x {head_dim}"
            );
        }
    }

    /// The dequantization's bits do not depend on its threads per block: 320 channels (the
    /// walks' rounds of 160) on 32 to 512 threads.
    #[test]
    fn dequantization_is_the_same_on_any_thread_count() {
        let (heads, head_dim, rows) = (5u32, 64u32, 7u32);
        let c = (heads * head_dim) as usize;
        let consts: Vec<ChannelConsts> = (0..c)
            .map(|i| ChannelConsts {
                mean: (i % 13) as f32 * 0.25 - 1.5,
                anchor_step: 0.125 + (i % 5) as f32 * 0.03125,
                delta_step: 0.0625 + (i % 7) as f32 * 0.015625,
                weight: (i % 11) as f32 / 16.0,
            })
            .collect();
        let q: Vec<i32> = (0..(rows as usize - 1) * c)
            .map(|i| (i * 37 % 41) as i32 - 20)
            .collect();
        let exps: Vec<u8> = (0..(rows as usize - 1) * heads as usize)
            .map(|i| (i % 5) as u8)
            .collect();
        let sink: Vec<f32> = (0..c).map(|i| i as f32 * 0.01 - 1.0).collect();
        let mut batch = DequantBatch::new(heads, head_dim, 2 * rows as usize * c);
        let consts_start = batch.add_consts(&consts);
        for (b, exps) in [Some(&exps[..]), None].into_iter().enumerate() {
            let input = DequantInput {
                q: &q,
                exps,
                sink: &sink,
                consts_start,
                rows,
                group: 3,
                out_start: (b * rows as usize * c) as u64,
                token_start: 0,
                page_start: 0,
            };
            batch.add_block(input).unwrap();
        }
        let run = |threads: u32| {
            let mut out = vec![0u16; batch.output().len];
            let mut status = vec![7u32; batch.len()];
            host_dequant_threads(batch.io(&mut out, &mut status), threads).unwrap();
            assert_eq!(status, [0, 0], "{threads} threads");
            out
        };
        let want = run(channel_threads(heads, head_dim));
        assert!(want.iter().filter(|&&x| x != 0).count() > want.len() / 2);
        for threads in [32, 64, 96, 128, 256, 512] {
            assert!(run(threads) == want, "{threads} threads");
        }
    }

    /// What `kvc_dequant_layout` reports, from the mirrors in space `S`.
    fn rust_dequant_layout<S: Space>() -> Vec<u64> {
        let mut v = layout![
            ChannelConsts { mean, anchor_step, delta_step, weight },
            DequantBlock {
                q_start, exp_start, sink_start, out_start, consts_start, rows, sink_rows, group,
                has_exps, token_start, page_start
            },
            DequantArgs<S> {
                q, n_q, exps, n_exps, sink, n_sink, consts, n_consts, out, n_out, pages, n_pages,
                blocks, status, n_blocks, heads, head_dim, page_size, mapped
            },
            DequantValues<S> {
                values, resolve, n_values, indices, n_indices, map, n_map, table_list,
                n_table_list, radius, n_radius
            },
        ];
        v.push(u64::from(DEQUANT_SHARED_BYTES));
        v
    }

    /// Invariant 1 for `kernels/dequant.cu`.
    #[test]
    fn layouts_match_the_kernel() {
        assert_eq!(
            host_layout(kvc_dequant_layout),
            rust_dequant_layout::<OnHost>()
        );
        assert_eq!(
            host_layout(kvc_dequant_layout),
            rust_dequant_layout::<OnDevice>()
        );
    }
}
