//! The lane decode (`kernels/rans_decode.cu`, and `kernels/rans32_experiment.cu`'s 32-bit-state
//! variant): its argument struct, host run and device launch.

use std::ffi::c_int;

use cudarc::driver::{CudaFunction, CudaStream, DeviceRepr, ValidAsZeroBits};

use super::{
    host_ran, launch_args, launch_grid, launch_shape, table_entries, Addrs, DevBuf, OnDevice,
    OnHost, ResolveBlock, Space, LANES,
};
use crate::error::CudaError;
use crate::rans::{LaneBlock, LaneShape};

// The kernels compiled for the host (`build.rs`).
extern "C" {
    fn kvc_rans_lane_decode_host(
        args: *const LaneDecodeArgs<OnHost>,
        grid: u32,
        block: u32,
        shared_bytes: u64,
    ) -> c_int;
    #[cfg(test)]
    fn kvc_rans_lane_decode_layout(out: *mut u64, cap: u64) -> u64;
    fn kvc_rans_lane_decode_mapped_host(
        args: *const LaneMappedArgs<OnHost>,
        grid: u32,
        block: u32,
        shared_bytes: u64,
    ) -> c_int;
    fn kvc_rans_lane_decode_compact_host(
        args: *const LaneDecodeArgs<OnHost>,
        grid: u32,
        block: u32,
        shared_bytes: u64,
    ) -> c_int;
    fn kvc_rans_lane_decode_mapped_compact_host(
        args: *const LaneMappedArgs<OnHost>,
        grid: u32,
        block: u32,
        shared_bytes: u64,
    ) -> c_int;
    #[cfg(test)]
    fn kvc_rans_lane_mapped_layout(out: *mut u64, cap: u64) -> u64;
    fn kvc_rans32_lane_decode_experiment_host(
        args: *const LaneDecodeArgs<OnHost>,
        grid: u32,
        block: u32,
        shared_bytes: u64,
    ) -> c_int;
    #[cfg(test)]
    fn kvc_rans32_lane_decode_experiment_layout(out: *mut u64, cap: u64) -> u64;
}

/// `KvcLaneDecodeArgs` (invariant 1), and `KvcLane32Args` of the 32-bit-state experiment
/// (`kernels/rans32_experiment.cu`), whose `words` are 16-bit.
#[repr(C)]
#[derive(Debug)]
pub(crate) struct LaneDecodeArgs<S: Space> {
    /// The launch's words, `n_words` of its [`LaneWord`] type.
    words: S::Const<u8>,
    n_words: u64,
    tables: S::Const<u32>,
    n_tables: u64,
    table_list: S::Const<u32>,
    n_table_list: u64,
    symbol_table: S::Const<u16>,
    symbols: S::Mut<u8>,
    n_symbols: u64,
    blocks: S::Const<LaneBlock>,
    status: S::Mut<u32>,
    n_blocks: u64,
    shared_tables: u64,
}

/// `KvcLaneMappedArgs` (invariant 1): `kvc_rans_lane_decode_mapped`'s arguments.
#[repr(C)]
#[derive(Debug)]
struct LaneMappedArgs<S: Space> {
    lanes: LaneDecodeArgs<S>,
    maps: TableMapArgs<S>,
}

/// `KvcTableMaps` (invariant 1, `kernels/kvc_values.cuh`): where the table resolution, the
/// mapped lane decode and `kvc_map_escapes` find value symbols' tables.
#[repr(C)]
#[derive(Debug)]
pub(super) struct TableMapArgs<S: Space> {
    resolve: S::Const<ResolveBlock>,
    exps: S::Const<u8>,
    n_exps: u64,
    map: S::Const<u16>,
    n_map: u64,
    heads: u32,
    head_dim: u32,
}

impl TableMapArgs<OnHost> {
    /// `maps` as a host run reads them (`None`: a launch that does not read them).
    pub(super) fn host(maps: Option<&TableMaps<'_>>) -> Self {
        let none = TableMaps {
            resolve: &[],
            exps: &[],
            map: &[],
            heads: 0,
            head_dim: 0,
        };
        let m = maps.unwrap_or(&none);
        TableMapArgs {
            resolve: m.resolve.as_ptr(),
            exps: m.exps.as_ptr(),
            n_exps: m.exps.len() as u64,
            map: m.map.as_ptr(),
            n_map: m.map.len() as u64,
            heads: m.heads,
            head_dim: m.head_dim,
        }
    }
}

impl TableMapArgs<OnDevice> {
    /// `maps` as a launch reads them, their buffers' guards added to `a`.
    pub(super) fn device<'a>(
        maps: &TableMapsDev<'a>,
        a: &mut Addrs<'a>,
        stream: &'a CudaStream,
    ) -> Self {
        let (resolve, _) = a.of(maps.resolve, stream);
        let (exps, n_exps) = a.of(maps.exps, stream);
        let (map, n_map) = a.of(maps.map, stream);
        TableMapArgs {
            resolve,
            exps,
            n_exps,
            map,
            n_map,
            heads: maps.heads,
            head_dim: maps.head_dim,
        }
    }
}

/// Where a chain's value symbols find their tables (`KvcResolveBlock`, `kvc_values.cuh`): per
/// block its table resolution's record, the decoded exponents, the table maps, the row shape.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TableMaps<'a> {
    /// One per block of the launch.
    pub resolve: &'a [ResolveBlock],
    pub exps: &'a [u8],
    pub map: &'a [u16],
    pub heads: u32,
    pub head_dim: u32,
}

/// The word of a lane-decode kernel: `u32` for format v2's `kvc_rans_lane_decode`, `u16` for
/// the 32-bit-state experiment `kvc_rans32_lane_decode_experiment` (not part of any format).
pub(crate) trait LaneWord: DeviceRepr + ValidAsZeroBits + Copy + 'static {
    /// The kernel's entry point.
    const ENTRY: &'static str;
    /// Its host build (invariant 1: both take the same argument layout).
    const HOST: LaneHostFn;
    /// The host build of its entry over compact tables, if it has one.
    const HOST_COMPACT: Option<LaneHostFn>;
}

/// A host-built lane-decode kernel.
type LaneHostFn = unsafe extern "C" fn(*const LaneDecodeArgs<OnHost>, u32, u32, u64) -> c_int;

impl LaneWord for u32 {
    const ENTRY: &'static str = "kvc_rans_lane_decode";
    const HOST: LaneHostFn = kvc_rans_lane_decode_host;
    const HOST_COMPACT: Option<LaneHostFn> = Some(kvc_rans_lane_decode_compact_host);
}

impl LaneWord for u16 {
    const ENTRY: &'static str = "kvc_rans32_lane_decode_experiment";
    const HOST: LaneHostFn = kvc_rans32_lane_decode_experiment_host;
    const HOST_COMPACT: Option<LaneHostFn> = None;
}

/// The buffers of one lane-decode launch (words of `W`: see [`LaneWord`]).
#[derive(Debug)]
pub(crate) struct LaneDecodeIo<'a, W = u32> {
    pub words: &'a [W],
    /// Packed tables, [`SLOTS`](super::SLOTS) entries each, or (`compact`) tables in the
    /// compact form, [`COMPACT_ENTRIES`](super::COMPACT_ENTRIES) each (a partial last table
    /// is ignored).
    pub tables: &'a [u32],
    pub table_list: &'a [u32],
    pub symbol_table: &'a [u16],
    pub blocks: &'a [LaneBlock],
    pub symbols: &'a mut [u8],
    pub status: &'a mut [u32],
    /// Coded blocks per CUDA block, and tables each stages in shared memory.
    pub shape: LaneShape,
    /// Whether `tables` are in the compact form (`kvc_rans_lane_decode_compact`, format v2's
    /// words only), which no block stages.
    pub compact: bool,
}

/// Runs `kvc_rans_lane_decode` (or, for `u16` words, the experiment) on the host: one warp
/// per entry of `io.blocks`, `io.shape.warps()` of them per CUDA block.
pub(crate) fn host_lane_decode<W: LaneWord>(mut io: LaneDecodeIo<'_, W>) -> Result<(), CudaError> {
    let grid = lane_grid(io.blocks.len(), io.shape)?;
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
    let run = match (io.compact, W::HOST_COMPACT) {
        (false, _) => W::HOST,
        (true, Some(run)) => run,
        (true, None) => {
            return Err(CudaError::Input {
                what: "compact tables for a kernel that has no entry over them",
            })
        }
    };
    let args = host_lane_args(&mut io);
    let (threads, shared_bytes) = (io.shape.threads(), io.shape.shared_bytes());
    // SAFETY: invariant 1 (layout; `words` points to `n_words` words of the kernel's word
    // type W), 2 (every pointer/count pair is a live slice and its length; `io` borrows them
    // for the call, mutably for the outputs) and 3 (launch shape).
    let rc = unsafe { run(&args, grid, threads, u64::from(shared_bytes)) };
    host_ran(rc, W::ENTRY)
}

/// `io`'s buffers as a host run's arguments.
fn host_lane_args<W: LaneWord>(io: &mut LaneDecodeIo<'_, W>) -> LaneDecodeArgs<OnHost> {
    LaneDecodeArgs::<OnHost> {
        words: io.words.as_ptr().cast(),
        n_words: io.words.len() as u64,
        tables: io.tables.as_ptr(),
        n_tables: (io.tables.len() / table_entries(io.compact)) as u64,
        table_list: io.table_list.as_ptr(),
        n_table_list: io.table_list.len() as u64,
        symbol_table: io.symbol_table.as_ptr(),
        symbols: io.symbols.as_mut_ptr(),
        n_symbols: io.symbols.len() as u64,
        blocks: io.blocks.as_ptr(),
        status: io.status.as_mut_ptr(),
        n_blocks: io.blocks.len() as u64,
        shared_tables: u64::from(io.shape.shared_tables()),
    }
}

/// Runs `kvc_rans_lane_decode_mapped` on the host: [`host_lane_decode`] with each value
/// symbol's table found through `maps` (one resolve record per block) instead of in
/// `io.symbol_table`, which is not read (and may be empty).
pub(crate) fn host_lane_decode_mapped(
    mut io: LaneDecodeIo<'_>,
    maps: TableMaps<'_>,
) -> Result<(), CudaError> {
    let grid = lane_grid(io.blocks.len(), io.shape)?;
    if io.status.len() != io.blocks.len() * LANES {
        return Err(CudaError::Input {
            what: "lane-decode buffers of mismatched lengths",
        });
    }
    if maps.resolve.len() != io.blocks.len() {
        return Err(CudaError::Input {
            what: "table resolution records are not one per lane block",
        });
    }
    let args = LaneMappedArgs::<OnHost> {
        lanes: host_lane_args(&mut io),
        maps: TableMapArgs::host(Some(&maps)),
    };
    let (threads, shared_bytes) = (io.shape.threads(), io.shape.shared_bytes());
    // SAFETY: as in `host_lane_decode` (invariants 1-3), and `resolve` holds one record per
    // block.
    let run = match io.compact {
        true => kvc_rans_lane_decode_mapped_compact_host,
        false => kvc_rans_lane_decode_mapped_host,
    };
    let rc = unsafe { run(&args, grid, threads, u64::from(shared_bytes)) };
    host_ran(rc, "kvc_rans_lane_decode_mapped")
}

/// CUDA blocks for `blocks` coded blocks, `shape.warps()` per CUDA block.
fn lane_grid(blocks: usize, shape: LaneShape) -> Result<u32, CudaError> {
    launch_grid(blocks.div_ceil(shape.warps() as usize))
}

// SAFETY (invariant 7): `#[repr(C)]` integers (invariant 1).
unsafe impl DeviceRepr for LaneDecodeArgs<OnDevice> {}
// SAFETY: as above.
unsafe impl DeviceRepr for LaneMappedArgs<OnDevice> {}
device_values!(LaneBlock);

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
    /// Whether `tables` are in the compact form (for the `_compact` kernels).
    pub compact: bool,
}

/// Queues `kvc_rans_lane_decode` over `b` on `stream` in `shape` (the function's dynamic shared
/// memory limit must allow its tables: invariant 8).
pub(crate) fn launch_lane_decode<W: LaneWord>(
    stream: &CudaStream,
    func: &CudaFunction,
    b: &LaneDecodeDev<W>,
    shape: LaneShape,
) -> Result<(), CudaError> {
    let r = LaneDecodeRef {
        words: &b.words,
        tables: &b.tables,
        table_list: &b.table_list,
        symbol_table: Some(&b.symbol_table),
        blocks: &b.blocks,
        symbols: &b.symbols,
        status: &b.status,
        compact: b.compact,
    };
    launch_lane_decode_ref(stream, func, &r, shape, None)
}

/// [`TableMaps`] on the device.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TableMapsDev<'a> {
    pub resolve: &'a DevBuf<ResolveBlock>,
    pub exps: &'a DevBuf<u8>,
    pub map: &'a DevBuf<u16>,
    pub heads: u32,
    pub head_dim: u32,
}

/// Queues a lane decode over `b` on `stream` in `shape`: `func` is `kvc_rans_lane_decode`
/// (`maps` `None`) or `kvc_rans_lane_decode_mapped`, whose value symbols find their tables
/// through `maps` (invariant 8 as in [`launch_lane_decode`]).
pub(super) fn launch_lane_decode_ref<W: LaneWord>(
    stream: &CudaStream,
    func: &CudaFunction,
    b: &LaneDecodeRef<'_, W>,
    shape: LaneShape,
    maps: Option<TableMapsDev<'_>>,
) -> Result<(), CudaError> {
    let input = |what| CudaError::Input { what };
    let tables_given = match (maps, b.symbol_table) {
        (None, Some(t)) => t.len() == b.symbols.len(),
        (None, None) => false,
        (Some(_), _) => true,
    };
    if !tables_given || b.status.len() != b.blocks.len() * LANES {
        return Err(input("lane-decode buffers of mismatched lengths"));
    }
    if maps.is_some_and(|m| m.resolve.len() != b.blocks.len()) {
        return Err(input("table resolution records are not one per lane block"));
    }
    let grid = lane_grid(b.blocks.len(), shape)?;
    if grid == 0 {
        return Ok(());
    }
    let mut a = Addrs::default();
    let (words, n_words) = a.of(b.words, stream);
    let (tables, n_words_tables) = a.of(b.tables, stream);
    let (table_list, n_table_list) = a.of(b.table_list, stream);
    let (symbol_table, _) = a.of_opt(b.symbol_table, stream);
    let (symbols, n_symbols) = a.of(b.symbols, stream);
    let (blocks, n_blocks) = a.of(b.blocks, stream);
    let (status, _) = a.of(b.status, stream);
    let args = LaneDecodeArgs::<OnDevice> {
        words,
        n_words,
        tables,
        n_tables: n_words_tables / table_entries(b.compact) as u64,
        table_list,
        n_table_list,
        symbol_table,
        symbols,
        n_symbols,
        blocks,
        status,
        n_blocks,
        shared_tables: u64::from(shape.shared_tables()),
    };
    let cfg = launch_shape(grid, shape.threads(), shape.shared_bytes());
    let Some(m) = maps else {
        // SAFETY: invariants 1 (the argument struct's layout), 6 (every address/count pair is
        // a live device buffer and a count within it, kept alive by `b` until the stream is
        // synchronized by the caller, who holds `b`), 7 and 8 (launch shape and shared
        // memory).
        return unsafe { launch_args(stream, func, &args, cfg, a) };
    };
    let maps = TableMapArgs::device(&m, &mut a, stream);
    let args = LaneMappedArgs::<OnDevice> { lanes: args, maps };
    // SAFETY: as above, `maps` held by the caller too, `resolve` one record per block.
    unsafe { launch_args(stream, func, &args, cfg, a) }
}

/// A lane-decode launch's buffers, borrowed (the chain's symbol launch shares the exponent
/// launch's words and tables).
pub(super) struct LaneDecodeRef<'a, W> {
    pub(super) words: &'a DevBuf<W>,
    pub(super) tables: &'a DevBuf<u32>,
    pub(super) table_list: &'a DevBuf<u32>,
    /// Each symbol's table-list index; not read (and may be `None`) with table maps.
    pub(super) symbol_table: Option<&'a DevBuf<u16>>,
    pub(super) blocks: &'a DevBuf<LaneBlock>,
    pub(super) symbols: &'a DevBuf<u8>,
    pub(super) status: &'a DevBuf<u32>,
    pub(super) compact: bool,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ffi::host_layout;

    /// The sizes and offsets of [`LaneBlock`] and [`LaneDecodeArgs`] in space `S`, then the
    /// kernel's `KVC_LANES` and `KVC_PRECISION` as codec-core has them: what
    /// `kvc_rans_lane_decode_layout` reports.
    fn rust_layout<S: Space>() -> Vec<u64> {
        let mut v = layout![
            LaneBlock { word_start, symbol_start, n_symbols, table_start, table_count, lane_len },
            LaneDecodeArgs<S> {
                words, n_words, tables, n_tables, table_list, n_table_list, symbol_table, symbols,
                n_symbols, blocks, status, n_blocks, shared_tables
            },
        ];
        v.push(codec_core::consts::LANES as u64);
        v.push(u64::from(codec_core::consts::PRECISION));
        v.push(crate::ffi::COMPACT_ENTRIES as u64);
        v
    }

    /// Invariant 1: the Rust mirrors have the C++ layouts (the 32-bit-state experiment's
    /// and the mapped decode's too), and the kernel's constants are codec-core's.
    #[test]
    fn layouts_match_the_kernel() {
        for kernel in [
            kvc_rans_lane_decode_layout,
            kvc_rans32_lane_decode_experiment_layout,
        ] {
            assert_eq!(host_layout(kernel), rust_layout::<OnHost>());
            assert_eq!(host_layout(kernel), rust_layout::<OnDevice>());
        }
        assert_eq!(1 << codec_core::consts::PRECISION, crate::ffi::SLOTS);
        assert_eq!(codec_core::consts::LANES, LANES);
        fn mapped<S: Space>() -> Vec<u64> {
            layout![
                LaneMappedArgs<S> { lanes, maps },
                TableMapArgs<S> { resolve, exps, n_exps, map, n_map, heads, head_dim },
            ]
        }
        assert_eq!(host_layout(kvc_rans_lane_mapped_layout), mapped::<OnHost>());
        assert_eq!(
            host_layout(kvc_rans_lane_mapped_layout),
            mapped::<OnDevice>()
        );
    }
}
