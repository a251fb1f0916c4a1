//! The decode chain's word gather, table resolution and value mapping (`kernels/chain.cu`),
//! and the chain of launches from lane words to f16/bf16 rows.

use std::ffi::c_int;

use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DeviceRepr};

use super::{
    host_ran, launch_args, launch_dequant_with, launch_grid, launch_lane_decode,
    launch_lane_decode_ref, launch_shape, Addrs, DequantDev, DequantValuesDev, DevBuf,
    LaneDecodeDev, LaneDecodeRef, MappedValuesDev, OnDevice, OnHost, Space, TableMapArgs,
    TableMaps, TableMapsDev, CHAIN_THREADS, LANES,
};
use crate::error::CudaError;
use crate::rans::{LaneBlock, LaneShape};

// The kernels compiled for the host (`build.rs`).
extern "C" {
    fn kvc_gather_words_host(
        args: *const GatherArgs<OnHost>,
        grid: u32,
        block: u32,
        shared_bytes: u64,
    ) -> c_int;
    fn kvc_expand_tables_host(
        args: *const ExpandArgs<OnHost>,
        grid: u32,
        block: u32,
        shared_bytes: u64,
    ) -> c_int;
    fn kvc_check_chunks_host(
        args: *const CheckArgs<OnHost>,
        grid: u32,
        block: u32,
        shared_bytes: u64,
    ) -> c_int;
    fn kvc_resolve_tables_host(
        args: *const ResolveArgs<OnHost>,
        grid: u32,
        block: u32,
        shared_bytes: u64,
    ) -> c_int;
    fn kvc_map_values_host(
        args: *const ValueArgs<OnHost>,
        grid: u32,
        block: u32,
        shared_bytes: u64,
    ) -> c_int;
    fn kvc_map_escapes_host(
        args: *const ValueArgs<OnHost>,
        grid: u32,
        block: u32,
        shared_bytes: u64,
    ) -> c_int;
    fn kvc_chain_verdict_host(
        args: *const VerdictArgs<OnHost>,
        grid: u32,
        block: u32,
        shared_bytes: u64,
    ) -> c_int;
    #[cfg(test)]
    fn kvc_chain_layout(out: *mut u64, cap: u64) -> u64;
}

/// `KvcGatherPart` (invariant 1): one coded block's lane words, or its escape values, in the
/// bytes a plan's streams were copied from.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct GatherPart {
    /// Byte offset of the first word in the copied bytes.
    pub src: u64,
    /// Index of the first word in the chain's words (or escapes).
    pub dst: u64,
    pub n_words: u64,
}

/// `KvcGatherArgs` (invariant 1).
#[repr(C)]
#[derive(Debug)]
struct GatherArgs<S: Space> {
    raw: S::Const<u8>,
    n_raw: u64,
    words: S::Mut<u32>,
    n_words: u64,
    /// The escapes (`i32`), written as their bits.
    escapes: S::Mut<u32>,
    n_escapes: u64,
    parts: S::Const<GatherPart>,
    status: S::Mut<u32>,
    n_parts: u64,
    /// Parts below this index go to `words`, the others to `escapes`.
    n_word_parts: u64,
}

/// `KvcTableFreqs` (invariant 1): one table to expand, its frequencies
/// `freqs[freq_start..][..n_freqs]` (symbol `s`'s at `s`) into packed table `table`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct TableFreqs {
    pub freq_start: u64,
    pub n_freqs: u32,
    pub table: u32,
}

/// `KvcExpandArgs` (invariant 1).
#[repr(C)]
#[derive(Debug)]
struct ExpandArgs<S: Space> {
    freqs: S::Const<u16>,
    n_freqs: u64,
    tables: S::Mut<u32>,
    n_tables: u64,
    items: S::Const<TableFreqs>,
    status: S::Mut<u32>,
    n_items: u64,
    compact: u32,
    reserved: u32,
}

/// Bytes of `KvcExpandShared` (a status, 257 cumulative frequencies and 257 ranks).
pub(crate) const EXPAND_SHARED_BYTES: u32 = 4 + 2 * 4 * 257;

/// A table expansion's status: the frequencies are not a rANS table's.
#[cfg(test)]
pub(crate) const EXPAND_BAD_TABLE: u32 = 4;

/// The buffers of one table expansion.
#[derive(Debug)]
pub(crate) struct ExpandIo<'a> {
    pub freqs: &'a [u16],
    /// Whole tables of [`SLOTS`](super::SLOTS) entries, or in the compact form of
    /// [`COMPACT_ENTRIES`](super::COMPACT_ENTRIES).
    pub tables: &'a mut [u32],
    pub items: &'a [TableFreqs],
    /// One entry per item: 0, 1 (outside the buffers) or `EXPAND_BAD_TABLE`.
    pub status: &'a mut [u32],
    pub compact: bool,
}

/// Runs `kvc_expand_tables` on the host.
pub(crate) fn host_expand_tables(io: ExpandIo<'_>) -> Result<(), CudaError> {
    let grid = launch_grid(io.items.len())?;
    if io.status.len() != io.items.len() {
        return Err(CudaError::Input {
            what: "status buffer is not one entry per table",
        });
    }
    let args = ExpandArgs::<OnHost> {
        freqs: io.freqs.as_ptr(),
        n_freqs: io.freqs.len() as u64,
        tables: io.tables.as_mut_ptr(),
        n_tables: (io.tables.len() / super::table_entries(io.compact)) as u64,
        items: io.items.as_ptr(),
        status: io.status.as_mut_ptr(),
        n_items: io.items.len() as u64,
        compact: u32::from(io.compact),
        reserved: 0,
    };
    let shared = u64::from(EXPAND_SHARED_BYTES);
    // SAFETY: invariants 1, 2 (pointer/count pairs from live slices, borrowed for the call; the
    // table count rounded down to whole tables) and 3 (CHAIN_THREADS threads, the shared memory
    // KvcExpandShared needs).
    let rc = unsafe { kvc_expand_tables_host(&args, grid, CHAIN_THREADS, shared) };
    host_ran(rc, "kvc_expand_tables")
}

/// Queues `kvc_expand_tables` on `stream`: every item's frequencies into its table of
/// `tables` (packed, or in the compact form when `compact`), a status per item.
pub(crate) fn launch_expand_tables(
    stream: &CudaStream,
    expand: &CudaFunction,
    (freqs, items): (&DevBuf<u16>, &DevBuf<TableFreqs>),
    (tables, compact): (&DevBuf<u32>, bool),
    status: &DevBuf<u32>,
) -> Result<(), CudaError> {
    if status.len() != items.len() {
        return Err(CudaError::Input {
            what: "status buffer is not one entry per table",
        });
    }
    let g = launch_grid(items.len())?;
    if g == 0 {
        return Ok(());
    }
    let mut a = Addrs::default();
    let (freqs, n_freqs) = a.of(freqs, stream);
    let (tables_ptr, n_entries) = a.of(tables, stream);
    let (items, n_items) = a.of(items, stream);
    let (status, _) = a.of(status, stream);
    let args = ExpandArgs::<OnDevice> {
        freqs,
        n_freqs,
        tables: tables_ptr,
        n_tables: n_entries / super::table_entries(compact) as u64,
        items,
        status,
        n_items,
        compact: u32::from(compact),
        reserved: 0,
    };
    let cfg = launch_shape(g, CHAIN_THREADS, EXPAND_SHARED_BYTES);
    // SAFETY: invariants 1, 6 (the buffers are borrowed by the caller, which synchronizes the
    // stream before it drops them; the table count rounded down to whole tables), 7 and 3 (the
    // shared memory KvcExpandShared needs).
    unsafe { launch_args(stream, expand, &args, cfg, a) }
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
struct ResolveArgs<S: Space> {
    symbol_table: S::Mut<u16>,
    n_symbol_table: u64,
    /// The blocks are `maps.resolve`.
    maps: TableMapArgs<S>,
    status: S::Mut<u32>,
    n_blocks: u64,
}

/// `KvcValueArgs` (invariant 1).
#[repr(C)]
#[derive(Debug)]
struct ValueArgs<S: Space> {
    indices: S::Const<u8>,
    symbol_table: S::Const<u16>,
    n_indices: u64,
    table_list: S::Const<u32>,
    n_table_list: u64,
    radius: S::Const<u8>,
    n_radius: u64,
    escapes: S::Const<i32>,
    n_escapes: u64,
    q: S::Mut<i32>,
    n_q: u64,
    blocks: S::Const<ValueBlock>,
    status: S::Mut<u32>,
    n_blocks: u64,
    maps: TableMapArgs<S>,
}

/// Bytes of `KvcValueShared` (16 + 4 * `KVC_VALUE_TILES` + 4 * `KVC_SCAN_THREADS` +
/// `KVC_VALUE_LIST`).
pub(crate) const VALUE_SHARED_BYTES: u32 = 16 + 4 * 4096 + 4 * 256 + 4096;

/// `KvcChunkCheck` (invariant 1): a chunk whose CRC (C1) is checked in the bytes a plan's
/// streams were copied from.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct ChunkCheck {
    /// Byte offset of the chunk in the copied bytes.
    pub src: u64,
    /// Bytes the CRC covers: the chunk without its CRC.
    pub len: u64,
    /// The CRC stored after them.
    pub crc: u32,
    pub reserved: u32,
}

/// `KvcCheckArgs` (invariant 1).
#[repr(C)]
#[derive(Debug)]
struct CheckArgs<S: Space> {
    raw: S::Const<u8>,
    n_raw: u64,
    checks: S::Const<ChunkCheck>,
    status: S::Mut<u32>,
    n_checks: u64,
}

/// Bytes of `KvcCrcShared` (the CRC table, a register per thread of
/// `KVC_CRC_THREADS` = [`CHAIN_THREADS`]).
pub(crate) const CRC_SHARED_BYTES: u32 = 4 * 256 + 4 * CHAIN_THREADS;

/// A chunk check's status: its CRC differs from the one stored (C1).
pub(crate) const CHECK_BAD_CRC: u32 = 3;

/// The buffers of one chunk check.
#[derive(Debug)]
pub(crate) struct CheckIo<'a> {
    pub raw: &'a [u8],
    pub checks: &'a [ChunkCheck],
    /// One entry per check: 0, 1 (outside `raw`) or [`CHECK_BAD_CRC`].
    pub status: &'a mut [u32],
}

/// Runs `kvc_check_chunks` on the host.
pub(crate) fn host_check_chunks(io: CheckIo<'_>) -> Result<(), CudaError> {
    let grid = launch_grid(io.checks.len())?;
    if io.status.len() != io.checks.len() {
        return Err(CudaError::Input {
            what: "status buffer is not one entry per check",
        });
    }
    let args = CheckArgs::<OnHost> {
        raw: io.raw.as_ptr(),
        n_raw: io.raw.len() as u64,
        checks: io.checks.as_ptr(),
        status: io.status.as_mut_ptr(),
        n_checks: io.checks.len() as u64,
    };
    // SAFETY: invariants 1, 2 (pointer/count pairs from live slices, borrowed for the call) and
    // 3 (CHAIN_THREADS threads, the shared memory KvcCrcShared needs).
    let rc =
        unsafe { kvc_check_chunks_host(&args, grid, CHAIN_THREADS, u64::from(CRC_SHARED_BYTES)) };
    host_ran(rc, "kvc_check_chunks")
}

/// Queues `kvc_check_chunks` on `stream`: every check's CRC in `raw`, a status per check.
pub(crate) fn launch_check_chunks(
    stream: &CudaStream,
    check: &CudaFunction,
    raw: &DevBuf<u8>,
    checks: &DevBuf<ChunkCheck>,
    status: &DevBuf<u32>,
) -> Result<(), CudaError> {
    if status.len() != checks.len() {
        return Err(CudaError::Input {
            what: "status buffer is not one entry per check",
        });
    }
    let g = launch_grid(checks.len())?;
    if g == 0 {
        return Ok(());
    }
    let mut a = Addrs::default();
    let (raw, n_raw) = a.of(raw, stream);
    let (checks, n_checks) = a.of(checks, stream);
    let (status, _) = a.of(status, stream);
    let args = CheckArgs::<OnDevice> {
        raw,
        n_raw,
        checks,
        status,
        n_checks,
    };
    let cfg = launch_shape(g, CHAIN_THREADS, CRC_SHARED_BYTES);
    // SAFETY: invariants 1, 6 (the buffers are borrowed by the caller, which synchronizes the
    // stream before it drops them), 7 and 3 (the shared memory KvcCrcShared needs).
    unsafe { launch_args(stream, check, &args, cfg, a) }
}

/// `KvcVerdictArgs` (invariant 1).
#[repr(C)]
#[derive(Debug)]
struct VerdictArgs<S: Space> {
    status: S::Const<u32>,
    n_status: u64,
    n_lenient: u64,
    lenient_below: u32,
    reserved: u32,
    verdict: S::Mut<u32>,
}

/// Statuses each thread of a verdict reads, about: a grid of one thread per this many.
const VERDICT_PER_THREAD: usize = 8;

/// The grid of a verdict over `n` statuses: a thread per [`VERDICT_PER_THREAD`], in at most
/// 1024 blocks of [`CHAIN_THREADS`] (the threads stride over the rest).
fn verdict_grid(n: usize) -> u32 {
    let blocks = n.div_ceil(CHAIN_THREADS as usize * VERDICT_PER_THREAD);
    blocks.clamp(1, 1024) as u32
}

/// What a chain's statuses are judged by: the first `lenient` of `status` pass below
/// `lenient_below`, the others at 0 only.
#[derive(Clone, Copy, Debug)]
pub(crate) struct VerdictRule {
    pub lenient: usize,
    pub lenient_below: u32,
}

/// Runs `kvc_chain_verdict` on the host: 0 when every status passes `rule`, else 1.
pub(crate) fn host_chain_verdict(status: &[u32], rule: VerdictRule) -> Result<u32, CudaError> {
    let mut verdict = 0u32;
    let args = VerdictArgs::<OnHost> {
        status: status.as_ptr(),
        n_status: status.len() as u64,
        n_lenient: rule.lenient as u64,
        lenient_below: rule.lenient_below,
        reserved: 0,
        verdict: &mut verdict,
    };
    let grid = verdict_grid(status.len());
    // SAFETY: invariants 1, 2 (a pointer/count pair from a live slice, and one word, borrowed
    // for the call) and 3 (CHAIN_THREADS threads, no shared memory).
    let rc = unsafe { kvc_chain_verdict_host(&args, grid, CHAIN_THREADS, 0) };
    host_ran(rc, "kvc_chain_verdict")?;
    Ok(verdict)
}

/// Queues `kvc_chain_verdict` on `stream`: `verdict` (one zeroed word) marked if any of
/// `status` fails `rule`.
pub(crate) fn launch_chain_verdict(
    stream: &CudaStream,
    judge: &CudaFunction,
    status: &DevBuf<u32>,
    rule: VerdictRule,
    verdict: &DevBuf<u32>,
) -> Result<(), CudaError> {
    if verdict.len() != 1 {
        return Err(CudaError::Input {
            what: "a verdict is one word",
        });
    }
    let mut a = Addrs::default();
    let (status_ptr, n_status) = a.of(status, stream);
    let (verdict, _) = a.of(verdict, stream);
    let args = VerdictArgs::<OnDevice> {
        status: status_ptr,
        n_status,
        n_lenient: rule.lenient as u64,
        lenient_below: rule.lenient_below,
        reserved: 0,
        verdict,
    };
    let cfg = launch_shape(verdict_grid(status.len()), CHAIN_THREADS, 0);
    // SAFETY: invariants 1, 6 (the buffers are borrowed by the caller, which synchronizes the
    // stream before it drops them), 7 and 3 (any grid, no shared memory).
    unsafe { launch_args(stream, judge, &args, cfg, a) }
}

/// The buffers of one word gather.
#[derive(Debug)]
pub(crate) struct GatherIo<'a> {
    pub raw: &'a [u8],
    pub words: &'a mut [u32],
    pub escapes: &'a mut [i32],
    /// The word parts, then the escape parts.
    pub parts: &'a [GatherPart],
    pub n_word_parts: usize,
    /// One entry per part.
    pub status: &'a mut [u32],
}

/// Runs `kvc_gather_words` on the host.
pub(crate) fn host_gather_words(io: GatherIo<'_>) -> Result<(), CudaError> {
    let grid = launch_grid(io.parts.len())?;
    check_gather_counts(io.parts.len(), io.n_word_parts, io.status.len())?;
    let args = GatherArgs::<OnHost> {
        raw: io.raw.as_ptr(),
        n_raw: io.raw.len() as u64,
        words: io.words.as_mut_ptr(),
        n_words: io.words.len() as u64,
        escapes: io.escapes.as_mut_ptr().cast::<u32>(),
        n_escapes: io.escapes.len() as u64,
        parts: io.parts.as_ptr(),
        status: io.status.as_mut_ptr(),
        n_parts: io.parts.len() as u64,
        n_word_parts: io.n_word_parts as u64,
    };
    // SAFETY: invariants 1, 2 (pointer/count pairs from live slices, borrowed for the call; i32
    // and u32 have one size and alignment) and 3 (CHAIN_THREADS threads, no shared memory).
    let rc = unsafe { kvc_gather_words_host(&args, grid, CHAIN_THREADS, 0) };
    host_ran(rc, "kvc_gather_words")
}

/// An input error unless a gather has one status per part and at most as many word parts as
/// parts.
fn check_gather_counts(parts: usize, word_parts: usize, status: usize) -> Result<(), CudaError> {
    match (status == parts, word_parts <= parts) {
        (true, true) => Ok(()),
        (false, _) => Err(CudaError::Input {
            what: "status buffer is not one entry per part",
        }),
        (_, false) => Err(CudaError::Input {
            what: "more word parts than parts",
        }),
    }
}

/// A word gather's buffers on the device ([`GatherIo`]).
pub(crate) struct GatherDev<'a> {
    pub raw: &'a DevBuf<u8>,
    pub words: &'a DevBuf<u32>,
    pub escapes: &'a DevBuf<i32>,
    pub parts: &'a DevBuf<GatherPart>,
    pub n_word_parts: usize,
    pub status: &'a DevBuf<u32>,
}

/// Queues `kvc_gather_words` on `stream`: every part of `raw` into `words` or `escapes`, a
/// status per part.
pub(crate) fn launch_gather_words(
    stream: &CudaStream,
    gather: &CudaFunction,
    io: GatherDev<'_>,
) -> Result<(), CudaError> {
    check_gather_counts(io.parts.len(), io.n_word_parts, io.status.len())?;
    let g = launch_grid(io.parts.len())?;
    if g == 0 {
        return Ok(());
    }
    let mut a = Addrs::default();
    let (raw, n_raw) = a.of(io.raw, stream);
    let (words, n_words) = a.of(io.words, stream);
    let (escapes, n_escapes) = a.of(io.escapes, stream);
    let (parts, n_parts) = a.of(io.parts, stream);
    let (status, _) = a.of(io.status, stream);
    let args = GatherArgs::<OnDevice> {
        raw,
        n_raw,
        words,
        n_words,
        escapes,
        n_escapes,
        parts,
        status,
        n_parts,
        n_word_parts: io.n_word_parts as u64,
    };
    let cfg = launch_shape(g, CHAIN_THREADS, 0);
    // SAFETY: invariants 1, 6 (the buffers are borrowed by the caller, which synchronizes the
    // stream before it drops them), 7 and 3.
    unsafe { launch_args(stream, gather, &args, cfg, a) }
}

/// The buffers of one table-resolution launch.
#[derive(Debug)]
pub(crate) struct ResolveIo<'a> {
    pub symbol_table: &'a mut [u16],
    /// The blocks are `maps.resolve`.
    pub maps: TableMaps<'a>,
    pub status: &'a mut [u32],
}

/// Runs `kvc_resolve_tables` on the host.
pub(crate) fn host_resolve_tables(io: ResolveIo<'_>) -> Result<(), CudaError> {
    let input = |what| CudaError::Input { what };
    let n_blocks = io.maps.resolve.len();
    let grid = launch_grid(n_blocks)?;
    if io.status.len() != n_blocks {
        return Err(input("status buffer is not one entry per block"));
    }
    let args = ResolveArgs::<OnHost> {
        symbol_table: io.symbol_table.as_mut_ptr(),
        n_symbol_table: io.symbol_table.len() as u64,
        maps: TableMapArgs::host(Some(&io.maps)),
        status: io.status.as_mut_ptr(),
        n_blocks: n_blocks as u64,
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
    /// Same length as `indices` (not read, and may be empty, with `from_map`).
    pub symbol_table: &'a [u16],
    pub table_list: &'a [u32],
    pub radius: &'a [u8],
    pub escapes: &'a [i32],
    pub q: &'a mut [i32],
    pub blocks: &'a [ValueBlock],
    pub status: &'a mut [u32],
    /// `Some`: `kvc_map_escapes`, which writes only the escapes' values to `q` (for a
    /// dequantization that maps the value symbols itself) and finds each symbol's table
    /// through these table maps rather than in `symbol_table`; `None`: `kvc_map_values`.
    pub from_map: Option<TableMaps<'a>>,
}

/// Runs `kvc_map_values` (or `kvc_map_escapes`) on the host.
pub(crate) fn host_map_values(io: ValueIo<'_>) -> Result<(), CudaError> {
    let input = |what| CudaError::Input { what };
    let grid = launch_grid(io.blocks.len())?;
    let tables_given = io.from_map.is_some() || io.indices.len() == io.symbol_table.len();
    if io.status.len() != io.blocks.len() || !tables_given {
        return Err(input("value-mapping buffers of mismatched lengths"));
    }
    if io
        .from_map
        .is_some_and(|m| m.resolve.len() != io.blocks.len())
    {
        return Err(input(
            "table resolution records are not one per value block",
        ));
    }
    let args = ValueArgs::<OnHost> {
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
        maps: TableMapArgs::host(io.from_map.as_ref()),
    };
    let run = match io.from_map {
        None => kvc_map_values_host,
        Some(_) => kvc_map_escapes_host,
    };
    let shared = u64::from(VALUE_SHARED_BYTES);
    // SAFETY: invariants 1, 2 (pointer/count pairs from live slices, borrowed for the call;
    // `indices` and `symbol_table` of one length; for kvc_map_escapes, `resolve` one record
    // per block) and 3 (CHAIN_THREADS threads, the shared memory KvcValueShared needs).
    let rc = unsafe { run(&args, grid, CHAIN_THREADS, shared) };
    host_ran(rc, "kvc_map_values")
}

// SAFETY (invariant 7): `#[repr(C)]` integers (invariant 1).
unsafe impl DeviceRepr for ResolveArgs<OnDevice> {}
unsafe impl DeviceRepr for ValueArgs<OnDevice> {}
unsafe impl DeviceRepr for GatherArgs<OnDevice> {}
unsafe impl DeviceRepr for CheckArgs<OnDevice> {}
unsafe impl DeviceRepr for VerdictArgs<OnDevice> {}
unsafe impl DeviceRepr for ExpandArgs<OnDevice> {}
device_values!(ResolveBlock, ValueBlock, GatherPart, ChunkCheck, TableFreqs);

/// A plan's chain on the device: every buffer of its launches (invariant 6: each count
/// within its buffer; built from one `decode::Chain`).
#[derive(Debug)]
pub(crate) struct ChainDev {
    pub lanes_exp: LaneDecodeDev,
    pub sym_blocks: DevBuf<LaneBlock>,
    /// Each value symbol's table-list index, written by the table resolution for the
    /// five-launch chain; `None` in a chain uploaded for the fused chain, which finds the
    /// tables through the table maps instead (and runs fused).
    pub sym_table: Option<DevBuf<u16>>,
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

impl ChainDev {
    /// Whether this chain runs fused ([`ChainKernels`]): whether it was uploaded without a
    /// table index a symbol.
    pub fn fused(&self) -> bool {
        self.sym_table.is_none()
    }

    /// Where the chain's value symbols find their tables: the blocks' resolve records, the
    /// exponent launch's output, the table maps.
    fn table_maps(&self) -> TableMapsDev<'_> {
        TableMapsDev {
            resolve: &self.resolve,
            exps: &self.lanes_exp.symbols,
            map: &self.map,
            heads: self.heads,
            head_dim: self.head_dim,
        }
    }
}

/// The kernels of a chain.
#[derive(Debug)]
pub(crate) struct ChainKernels<'a> {
    pub lane: &'a CudaFunction,
    /// `kvc_rans_lane_decode_mapped`, the symbol launch of a fused chain.
    pub lane_mapped: &'a CudaFunction,
    /// The two over compact tables, for a chain whose tables are compact.
    pub lane_compact: &'a CudaFunction,
    pub lane_mapped_compact: &'a CudaFunction,
    pub resolve: &'a CudaFunction,
    /// The five-launch chain's value mapping.
    pub map_values: &'a CudaFunction,
    /// The fused chain's value mapping.
    pub map_escapes: &'a CudaFunction,
    pub dequant: &'a CudaFunction,
}

/// Queues the launches of a chain on `stream`: exponents, table resolution (not fused),
/// symbols, values, dequantization into the first `n_out` elements of `out`.
///
/// A fused chain ([`ChainDev::fused`], `kernels/kvc_values.cuh`) has no table resolution
/// launch: the symbol launch, the value mapping and the dequantization find each value
/// symbol's table through its block's table map, the value mapping (`kvc_map_escapes`)
/// writes only the escapes' values and the dequantization maps the other symbols as it reads
/// them. Otherwise the table resolution writes every symbol's table for the launches after it
/// and the value mapping (`kvc_map_values`) every value for the dequantization. The same bits
/// either way.
pub(crate) fn launch_chain(
    stream: &CudaStream,
    k: &ChainKernels<'_>,
    c: &ChainDev,
    lane_shape: LaneShape,
    out: &mut CudaSlice<u16>,
    n_out: usize,
) -> Result<(), CudaError> {
    for stage in 0..5 {
        launch_chain_stage(stream, k, c, lane_shape, out, n_out, stage)?;
    }
    Ok(())
}

/// Queues launch `stage` (0-4) of a chain; the earlier ones must be queued before it. Stage 1,
/// the table resolution, is no launch in the fused chain.
pub(crate) fn launch_chain_stage(
    stream: &CudaStream,
    k: &ChainKernels<'_>,
    c: &ChainDev,
    lane_shape: LaneShape,
    out: &mut CudaSlice<u16>,
    n_out: usize,
    stage: u8,
) -> Result<(), CudaError> {
    let input = |what| CudaError::Input { what };
    let l = &c.lanes_exp;
    if c.resolve_status.len() != c.resolve.len()
        || c.value_status.len() != c.values.len()
        || c.sym_table
            .as_ref()
            .is_some_and(|t| t.len() != c.symbols.len())
        || c.sym_status.len() != c.sym_blocks.len() * LANES
    {
        return Err(input("chain buffers of mismatched lengths"));
    }
    let fused = c.fused();
    let (lane, lane_mapped) = match l.compact {
        true => (k.lane_compact, k.lane_mapped_compact),
        false => (k.lane, k.lane_mapped),
    };
    // Compact tables are read through the cache, none staged.
    let lane_shape = match l.compact {
        true => LaneShape::new(lane_shape.warps(), 0)?,
        false => lane_shape,
    };
    match stage {
        0 => launch_lane_decode(stream, lane, l, lane_shape),
        1 => match &c.sym_table {
            Some(sym_table) => launch_resolve(stream, k.resolve, c, sym_table),
            // The symbol launch finds the tables itself (its resolution status stays 0).
            None => Ok(()),
        },
        2 => {
            let sym = LaneDecodeRef {
                words: &l.words,
                tables: &l.tables,
                table_list: &l.table_list,
                symbol_table: c.sym_table.as_ref(),
                blocks: &c.sym_blocks,
                symbols: &c.symbols,
                status: &c.sym_status,
                compact: l.compact,
            };
            match fused {
                true => {
                    let maps = Some(c.table_maps());
                    launch_lane_decode_ref(stream, lane_mapped, &sym, lane_shape, maps)
                }
                false => launch_lane_decode_ref(stream, lane, &sym, lane_shape, None),
            }
        }
        3 => match fused {
            true => launch_values(stream, k.map_escapes, c),
            false => launch_values(stream, k.map_values, c),
        },
        4 => {
            let mapped = MappedValuesDev {
                values: &c.values,
                resolve: &c.resolve,
                indices: &c.symbols,
                map: &c.map,
                table_list: &l.table_list,
                radius: &c.radius,
            };
            let values = DequantValuesDev {
                q: &c.q,
                exps: &l.symbols,
                mapped: fused.then_some(mapped),
            };
            launch_dequant_with(stream, k.dequant, &c.dequant, values, out, n_out)
        }
        _ => Err(input("a chain has five stages")),
    }
}

/// Queues the chain's table resolution (launch 1) into `sym_table`.
fn launch_resolve(
    stream: &CudaStream,
    f: &CudaFunction,
    c: &ChainDev,
    sym_table: &DevBuf<u16>,
) -> Result<(), CudaError> {
    let g = launch_grid(c.resolve.len())?;
    if g == 0 {
        return Ok(());
    }
    let mut a = Addrs::default();
    let (symbol_table, n_symbol_table) = a.of(sym_table, stream);
    let maps = TableMapArgs::device(&c.table_maps(), &mut a, stream);
    let (status, _) = a.of(&c.resolve_status, stream);
    let args = ResolveArgs::<OnDevice> {
        symbol_table,
        n_symbol_table,
        maps,
        status,
        n_blocks: c.resolve.len() as u64,
    };
    let cfg = launch_shape(g, CHAIN_THREADS, 0);
    // SAFETY: invariants 1, 6 (buffers live in `c`, held by the caller until the stream is
    // synchronized), 7 and 3.
    unsafe { launch_args(stream, f, &args, cfg, a) }
}

/// Queues the chain's value mapping with escapes (launch 3): `f` is `kvc_map_values` (which
/// reads the symbols' tables) or, for a fused chain, `kvc_map_escapes` (the table maps).
fn launch_values(stream: &CudaStream, f: &CudaFunction, c: &ChainDev) -> Result<(), CudaError> {
    let g = launch_grid(c.values.len())?;
    if g == 0 {
        return Ok(());
    }
    if c.resolve.len() != c.values.len() {
        return Err(CudaError::Input {
            what: "table resolution records are not one per value block",
        });
    }
    let mut a = Addrs::default();
    let (indices, n_indices) = a.of(&c.symbols, stream);
    let (symbol_table, _) = a.of_opt(c.sym_table.as_ref(), stream);
    let (table_list, n_table_list) = a.of(&c.lanes_exp.table_list, stream);
    let (radius, n_radius) = a.of(&c.radius, stream);
    let (escapes, n_escapes) = a.of(&c.escapes, stream);
    let (q, n_q) = a.of(&c.q, stream);
    let (blocks, n_blocks) = a.of(&c.values, stream);
    let (status, _) = a.of(&c.value_status, stream);
    let maps = TableMapArgs::device(&c.table_maps(), &mut a, stream);
    let args = ValueArgs::<OnDevice> {
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
        maps,
    };
    let cfg = launch_shape(g, CHAIN_THREADS, VALUE_SHARED_BYTES);
    // SAFETY: invariants 1, 6 (as in `launch_resolve`; `resolve` one record per block), 7 and
    // 3 (the shared memory KvcValueShared needs).
    unsafe { launch_args(stream, f, &args, cfg, a) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ffi::{host_dequant, host_layout, MappedValues};
    use crate::quant::{ChannelConsts, DequantBatch, DequantBlock};

    /// What `kvc_chain_layout` reports, from the mirrors in space `S`.
    fn rust_chain_layout<S: Space>() -> Vec<u64> {
        let mut v = layout![
            ResolveBlock {
                symbol_start, exp_start, map_start, n_e, n_sym, sink_rows, group, has_exps
            },
            ResolveArgs<S> { symbol_table, n_symbol_table, maps, status, n_blocks },
            ValueBlock {
                index_start, list_start, escape_start, q_start, n_sym, n_escapes, list_len
            },
            ValueArgs<S> {
                indices, symbol_table, n_indices, table_list, n_table_list, radius, n_radius,
                escapes, n_escapes, q, n_q, blocks, status, n_blocks, maps
            },
        ];
        v.push(u64::from(VALUE_SHARED_BYTES));
        v.extend(layout![
            GatherPart { src, dst, n_words },
            GatherArgs<S> {
                raw, n_raw, words, n_words, escapes, n_escapes, parts, status, n_parts,
                n_word_parts
            },
            ChunkCheck { src, len, crc, reserved },
            CheckArgs<S> { raw, n_raw, checks, status, n_checks },
        ]);
        v.push(u64::from(CRC_SHARED_BYTES));
        v.extend(layout![
            VerdictArgs<S> { status, n_status, n_lenient, lenient_below, reserved, verdict },
            TableFreqs { freq_start, n_freqs, table },
            ExpandArgs<S> {
                freqs, n_freqs, tables, n_tables, items, status, n_items, compact, reserved
            },
        ]);
        v.push(u64::from(EXPAND_SHARED_BYTES));
        v
    }

    /// `host_gather_words` of `parts` (the first `n_word_parts` of them words) from `raw` into
    /// `words` and `escapes`, with `n_status` statuses (9 before): its result and the statuses.
    fn gather_into(
        raw: &[u8],
        (parts, n_word_parts): (&[GatherPart], usize),
        (words, escapes): (&mut [u32], &mut [i32]),
        n_status: usize,
    ) -> (Result<(), CudaError>, Vec<u32>) {
        let mut status = vec![9u32; n_status];
        let got = host_gather_words(GatherIo {
            raw,
            words,
            escapes,
            parts,
            n_word_parts,
            status: &mut status,
        });
        (got, status)
    }

    /// A gather given more word parts than parts, or statuses not one a part, is an input
    /// error before it runs: nothing written.
    #[test]
    fn a_gather_with_counts_that_disagree_is_refused() {
        let raw = [7u8; 8];
        let parts = [GatherPart {
            src: 0,
            dst: 0,
            n_words: 2,
        }];
        for (n_word_parts, n_status) in [(2, 1), (0, 2), (1, 0)] {
            let (mut words, mut escapes) = ([0u32; 2], [0i32; 2]);
            let dst = (&mut words[..], &mut escapes[..]);
            let (got, _) = gather_into(&raw, (&parts, n_word_parts), dst, n_status);
            assert!(
                matches!(got, Err(CudaError::Input { .. })),
                "{n_word_parts} {n_status}"
            );
            assert_eq!((words, escapes), ([0; 2], [0; 2]));
        }
    }

    /// Invariant 1 for `kernels/chain.cu`.
    #[test]
    fn layouts_match_the_kernel() {
        assert_eq!(host_layout(kvc_chain_layout), rust_chain_layout::<OnHost>());
        assert_eq!(
            host_layout(kvc_chain_layout),
            rust_chain_layout::<OnDevice>()
        );
    }

    /// Frequencies of `n` symbols summing to 4096 (some 0 when `zeros`, at either end too),
    /// from `seed`.
    fn freqs_of(n: usize, zeros: bool, seed: u64) -> Vec<u16> {
        let mut x = seed | 1;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut f = vec![0u16; n];
        let live: Vec<usize> = (0..n).filter(|_| !zeros || next() % 3 != 0).collect();
        let live = if live.is_empty() { vec![n - 1] } else { live };
        // One each, then the rest of the 4096 at random (none reaching 4096 alone).
        for &s in &live {
            f[s] = 1;
        }
        for _ in live.len()..4096 {
            let s = live[(next() % live.len() as u64) as usize];
            f[s] += 1;
        }
        if f.contains(&4096) {
            return freqs_of(n.max(2), false, seed + 1);
        }
        f
    }

    /// The packed table of `freqs`, slot by slot (the kernel's form: symbol, frequency, slot -
    /// cdf).
    fn packed_plainly(freqs: &[u16]) -> Vec<u32> {
        let mut out = Vec::new();
        for (s, &f) in freqs.iter().enumerate() {
            for k in 0..u32::from(f) {
                out.push(s as u32 | u32::from(f) << 8 | k << 20);
            }
        }
        out
    }

    /// The compact form of `freqs` (`kvc_kernel.cuh`), plainly: per group of 64 slots the
    /// map of the slots where a symbol of nonzero frequency starts, and how many start
    /// before; per rank the symbol, its frequency and cdf.
    fn compact_plainly(freqs: &[u16]) -> Vec<u32> {
        let mut starts = vec![false; crate::ffi::SLOTS];
        let mut info = Vec::new();
        let mut cdf = 0u32;
        for (s, &f) in freqs.iter().enumerate() {
            if f > 0 {
                starts[cdf as usize] = true;
                info.push(s as u32 | u32::from(f) << 8 | cdf << 20);
            }
            cdf += u32::from(f);
        }
        let mut out = Vec::new();
        let mut before = 0;
        for group in starts.chunks_exact(64) {
            let bits = (group.iter().enumerate()).fold(0u64, |b, (k, &on)| b | u64::from(on) << k);
            out.extend([bits as u32, (bits >> 32) as u32, before, 0]);
            before += bits.count_ones();
        }
        info.resize(256, 0);
        out.extend(info);
        out
    }

    /// Tables expanded by the host-run kernel (packed, or `compact`): the tables and
    /// statuses.
    fn expand_as(
        freqs: &[u16],
        items: &[TableFreqs],
        n_tables: usize,
        compact: bool,
    ) -> (Vec<u32>, Vec<u32>) {
        let mut tables = vec![0xABCD_u32; n_tables * crate::ffi::table_entries(compact)];
        let mut status = vec![9u32; items.len()];
        host_expand_tables(ExpandIo {
            freqs,
            tables: &mut tables,
            items,
            status: &mut status,
            compact,
        })
        .unwrap();
        (tables, status)
    }

    fn expand(freqs: &[u16], items: &[TableFreqs], n_tables: usize) -> (Vec<u32>, Vec<u32>) {
        expand_as(freqs, items, n_tables, false)
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(48))]

        /// Tables of 1-256 symbols (frequency-0 symbols anywhere, or none), several per launch
        /// in any order of their ids: each expanded table is the plain packing of its
        /// frequencies, and `packed_table`'s for a `FreqTable`, and in the compact form the
        /// plain compact form; every status 0.
        #[test]
        fn expanded_tables_are_packed_as_the_host_packs_them(
            sizes in proptest::collection::vec((1usize..=256, proptest::bool::ANY), 1..5),
            seed in proptest::prelude::any::<u64>(),
            reversed in proptest::bool::ANY,
        ) {
            let mut freqs = Vec::new();
            let mut items = Vec::new();
            let mut each = Vec::new();
            for (i, &(n, zeros)) in sizes.iter().enumerate() {
                let f = freqs_of(n, zeros, seed.wrapping_add(i as u64));
                let table = if reversed { sizes.len() - 1 - i } else { i } as u32;
                items.push(TableFreqs {
                    freq_start: freqs.len() as u64,
                    n_freqs: f.len() as u32,
                    table,
                });
                freqs.extend_from_slice(&f);
                each.push((table, f));
            }
            let (tables, status) = expand(&freqs, &items, sizes.len());
            proptest::prop_assert!(status.iter().all(|&s| s == 0));
            let (compact, status) = expand_as(&freqs, &items, sizes.len(), true);
            proptest::prop_assert!(status.iter().all(|&s| s == 0));
            let n = crate::ffi::COMPACT_ENTRIES;
            for (table, f) in &each {
                let got = &compact[*table as usize * n..][..n];
                proptest::prop_assert_eq!(got, &compact_plainly(f)[..]);
            }
            for (table, f) in each {
                let got = &tables[table as usize * crate::ffi::SLOTS..][..crate::ffi::SLOTS];
                proptest::prop_assert_eq!(got, &packed_plainly(&f)[..]);
                if let Ok(t) = codec_core::rans::FreqTable::new(&f) {
                    proptest::prop_assert_eq!(got, &crate::rans::packed_table(&t)[..]);
                }
            }
        }
    }

    /// Items outside the buffers or whose frequencies are not a table's (none, over 256, one of
    /// 4096 or more, a sum other than 4096) are refused with their status and leave their table
    /// as it was; the good item beside them is expanded.
    #[test]
    fn bad_table_items_are_refused() {
        let good = freqs_of(5, false, 7);
        let mut freqs = good.clone();
        let item = |freq_start: usize, n_freqs: usize, table: u32| TableFreqs {
            freq_start: freq_start as u64,
            n_freqs: n_freqs as u32,
            table,
        };
        let at = freqs.len();
        freqs.extend_from_slice(&[4096, 0]);
        let short = freqs.len();
        freqs.extend_from_slice(&[2000, 2000]);
        let long = freqs.len();
        freqs.extend(std::iter::repeat_n(16u16, 257));
        let items = [
            item(0, good.len(), 1),
            item(0, good.len(), 2),  // past the tables
            item(at, 2, 0),          // a frequency of 4096
            item(short, 2, 0),       // sum 4000
            item(long, 257, 0),      // 257 symbols summing to 4112
            item(long, 0, 0),        // no symbols
            item(freqs.len(), 1, 0), // past the frequencies
            item(usize::MAX >> 1, 2, 0),
        ];
        let (tables, status) = expand(&freqs, &items, 2);
        let range = 1;
        assert_eq!(
            status,
            [
                0,
                range,
                EXPAND_BAD_TABLE,
                EXPAND_BAD_TABLE,
                range,
                range,
                range,
                range
            ]
        );
        assert!(tables[..crate::ffi::SLOTS].iter().all(|&e| e == 0xABCD));
        assert_eq!(tables[crate::ffi::SLOTS..], packed_plainly(&good)[..]);
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
        /// Per symbol, whether it takes an escape value.
        escaped: Vec<bool>,
    }

    fn value_case(list_len: u32, n_sym: u32, seed: u64) -> ValueCase {
        value_case_of(list_len, seed, |next, _| next(list_len) as u16, n_sym)
    }

    /// A value case of `n_sym` symbols whose tables `table_of(next, g)` gives (g the symbol).
    fn value_case_of(
        list_len: u32,
        seed: u64,
        mut table_of: impl FnMut(&mut dyn FnMut(u32) -> u32, u32) -> u16,
        n_sym: u32,
    ) -> ValueCase {
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
        let (mut escapes, mut want, mut escaped) = (Vec::new(), Vec::new(), Vec::new());
        for g in 0..n_sym {
            let t = table_of(&mut next, g);
            let r = i32::from(radius[table_list[usize::from(t)] as usize]);
            symbol_table.push(t);
            escaped.push(next(10) == 0);
            if escaped[escaped.len() - 1] {
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
            escaped,
        }
    }

    /// A value block whose symbols' tables come from a table map, as a chain's do: the case,
    /// its exponents, the map (after 5 other entries), its resolve record and value block.
    struct MappedCase {
        case: ValueCase,
        exps: Vec<u8>,
        map: Vec<u16>,
        resolve: ResolveBlock,
        block: ValueBlock,
    }

    /// The shape of a [`MappedCase`]: table-list length, rows, sink rows, group, exponents.
    type Shape = (u32, u32, u32, u32, bool);

    /// Heads and head dim of every [`MappedCase`].
    const HEADS: (u32, u32) = (2, 8);

    fn mapped_case((list_len, rows, sink_rows, group, with_exps): Shape, seed: u64) -> MappedCase {
        let (heads, head_dim) = HEADS;
        let c = (heads * head_dim) as usize;
        let coded = (rows - sink_rows) as usize;
        // Exponents (some above 15, which the table resolution masks), and a table map after 5
        // other entries: each symbol's table as kvc_resolve_tables finds it.
        let exps: Vec<u8> = (0..coded * heads as usize)
            .map(|i| (i % 18) as u8)
            .collect();
        let mut x = seed;
        let map: Vec<u16> = (0..5 + 32 * c)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((x >> 33) % u64::from(list_len)) as u16
            })
            .collect();
        let table_of = |_: &mut dyn FnMut(u32) -> u32, g: u32| {
            let (i, ch) = (g as usize / c, g as usize % c);
            let kind = u64::from(!(sink_rows as usize + i).is_multiple_of(group as usize));
            let e = match with_exps {
                true => u64::from(exps[i * heads as usize + ch / head_dim as usize] & 15),
                false => 0,
            };
            map[5 + ((kind * 16 + e) * c as u64) as usize + ch]
        };
        let n_sym = (coded * c) as u32;
        let case = value_case_of(list_len, seed, table_of, n_sym);
        let resolve = ResolveBlock {
            symbol_start: 0,
            exp_start: 0,
            map_start: 5,
            n_e: 0,
            n_sym,
            sink_rows,
            group,
            has_exps: u32::from(with_exps),
            reserved: 0,
        };
        let block = ValueBlock {
            index_start: 0,
            list_start: 0,
            escape_start: 0,
            q_start: 0,
            n_sym,
            n_escapes: case.escapes.len() as u32,
            list_len,
            reserved: 0,
        };
        MappedCase {
            case,
            exps,
            map,
            resolve,
            block,
        }
    }

    /// What a value mapping of `m`'s block writes into a buffer of `UNWRITTEN`s, and its status:
    /// `kvc_map_values` with `maps` `None`, else `kvc_map_escapes` through them.
    fn map_case(m: &MappedCase, maps: Option<TableMaps<'_>>) -> (Vec<i32>, u32) {
        let mut q = vec![UNWRITTEN; m.case.indices.len()];
        let mut status = [9u32];
        host_map_values(ValueIo {
            indices: &m.case.indices,
            symbol_table: &m.case.symbol_table,
            table_list: &m.case.table_list,
            radius: &m.case.radius,
            escapes: &m.case.escapes,
            q: &mut q,
            blocks: &[m.block],
            status: &mut status,
            from_map: maps,
        })
        .unwrap();
        (q, status[0])
    }

    const UNWRITTEN: i32 = i32::MIN;

    /// Table-list lengths staged in shared memory and too long for it.
    fn list_len() -> impl proptest::strategy::Strategy<Value = u32> {
        proptest::prop_oneof![1u32..300, 4090u32..4200]
    }

    /// A [`Shape`]: 1-40 rows, sink rows among them, groups 1-5, with and without exponents.
    fn shape() -> impl proptest::strategy::Strategy<Value = Shape> {
        use proptest::strategy::Strategy;
        (
            list_len(),
            1u32..40,
            0u32..3,
            1u32..6,
            proptest::prelude::any::<bool>(),
        )
            .prop_map(|(l, rows, sink, group, e)| (l, rows, sink.min(rows), group, e))
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(48))]

        /// `kvc_map_values` against a plain mapping (a symbol i of a radius-r table is i - r,
        /// above 2r the next escape): table lists short enough for their radii to be staged in
        /// shared memory and too long for it, a second block after the first; a table index
        /// outside the list or an escape within the radius gives the block's error status.
        #[test]
        fn map_values_match_a_plain_mapping(
            list_len in list_len(),
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
            let mut q = vec![UNWRITTEN; indices.len()];
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
                from_map: None,
            })
            .unwrap();
            proptest::prop_assert_eq!(status, vec![want_status, 0]);
            if want_status == 0 {
                proptest::prop_assert_eq!(&q[..n as usize], &c.want[..]);
            }
            proptest::prop_assert_eq!(&q[n as usize..], &second.want[..]);
        }

        /// `kvc_map_escapes`, each symbol's table found through the table map, places exactly
        /// the escapes' values `kvc_map_values` places, and writes nothing else, with the same
        /// status (an escape within its radius: `BAD_ESCAPES`). A resolve record unlike its
        /// block (other symbols, no group, exponents or map past their buffers) is
        /// `BAD_RANGE`, nothing written.
        #[test]
        fn map_escapes_places_what_map_values_places(
            shape in shape(),
            seed in proptest::prelude::any::<u64>(),
            corrupt in 0u8..6,
        ) {
            let mut m = mapped_case(shape, seed);
            if corrupt == 1 && !m.case.escapes.is_empty() {
                m.case.escapes[0] = 0;
            }
            let (all, all_status) = map_case(&m, None);
            let mut r = m.resolve;
            let mut map = m.map.clone();
            match corrupt {
                2 => r.n_sym += HEADS.0 * HEADS.1,
                3 => r.group = 0,
                4 => r.exp_start = 1 + u64::from(r.has_exps) * u64::MAX / 2,
                5 => map.truncate(map.len() - 1),
                _ => {}
            }
            let maps = TableMaps {
                resolve: &[r],
                exps: &m.exps,
                map: &map,
                heads: HEADS.0,
                head_dim: HEADS.1,
            };
            let (got, status) = map_case(&m, Some(maps));
            // A bad exponent range only matters with exponents.
            if corrupt >= 2 && !(corrupt == 4 && r.has_exps == 0) {
                proptest::prop_assert_eq!(status, 1);
                proptest::prop_assert!(got.iter().all(|&v| v == UNWRITTEN));
            } else {
                proptest::prop_assert_eq!(status, all_status);
                let escapes_of = |v: &[i32]| -> Vec<i32> {
                    let both = v.iter().zip(&m.case.escaped);
                    both.map(|(&v, &e)| if e { v } else { UNWRITTEN }).collect()
                };
                proptest::prop_assert_eq!(&got, &escapes_of(&all));
            }
        }

        /// A dequantization that maps the value symbols itself, after `kvc_map_escapes`, gives
        /// the bits of one given every value by `kvc_map_values`: blocks of 1-40 rows (sink
        /// rows among them), with and without step exponents, table lists staged in shared
        /// memory and too long for it. A table id of the list outside the radii, a value
        /// block reaching past the symbols or the table list, or a table map past its buffer
        /// gives the block `BadRange` and writes nothing.
        #[test]
        fn dequantization_maps_values_as_the_value_mapping_does(
            shape in shape(),
            seed in proptest::prelude::any::<u64>(),
            corrupt in 0u8..7,
        ) {
            let (heads, head_dim) = HEADS;
            let c = (heads * head_dim) as usize;
            let (list_len, rows, sink_rows, group, with_exps) = shape;
            let m = mapped_case(shape, seed);
            let maps = TableMaps {
                resolve: &[m.resolve],
                exps: &m.exps,
                map: &m.map,
                heads,
                head_dim,
            };
            let (all, escapes_only) = (map_case(&m, None), map_case(&m, Some(maps)));
            proptest::prop_assert_eq!((all.1, escapes_only.1), (0, 0));
            let sink: Vec<f32> = (0..sink_rows as usize * c).map(|i| i as f32 * 0.5).collect();
            let mut batch = DequantBatch::new(heads, head_dim, rows as usize * c);
            let consts: Vec<ChannelConsts> = (0..c)
                .map(|i| ChannelConsts {
                    mean: i as f32 * 0.125 - 1.0,
                    anchor_step: 0.25,
                    delta_step: 0.0625 + (i % 3) as f32 * 0.03125,
                    weight: (i % 9) as f32 / 16.0,
                })
                .collect();
            let consts_start = batch.add_consts(&consts);
            let dq = DequantBlock {
                consts_start,
                rows,
                sink_rows,
                group,
                has_exps: u32::from(with_exps),
                ..DequantBlock::default()
            };
            batch.add_block_external(dq, &sink);
            let (mut table_list, mut map) = (m.case.table_list.clone(), m.map.clone());
            let mut bad = m.block;
            match corrupt {
                1 => table_list[(seed % u64::from(list_len)) as usize] = m.case.radius.len() as u32,
                2 => bad.index_start = 1,
                3 => bad.index_start = u64::MAX - 3,
                4 => bad.list_len += 1,
                5 => bad.list_start = u64::MAX,
                6 => map.truncate(map.len() - 1),
                _ => {}
            }
            let dequant = |q: &[i32], mapped: Option<MappedValues<'_>>| {
                let mut out = vec![0u16; batch.output().len];
                let mut status = [9u32];
                let mut io = batch.io_with(q, &m.exps, &mut out, &mut status);
                io.mapped = mapped;
                host_dequant(io).unwrap();
                (out, status[0])
            };
            let (want, want_status) = dequant(&all.0, None);
            proptest::prop_assert_eq!(want_status, 0);
            let mapped = MappedValues {
                values: &[bad],
                resolve: &[m.resolve],
                indices: &m.case.indices,
                map: &map,
                table_list: &table_list,
                radius: &m.case.radius,
            };
            let (got, status) = dequant(&escapes_only.0, Some(mapped));
            if corrupt != 0 {
                proptest::prop_assert_eq!(status, 1);
                proptest::prop_assert!(got.iter().all(|&x| x == 0));
            } else {
                proptest::prop_assert_eq!(status, 0);
                proptest::prop_assert!(got == want);
            }
        }

        /// `kvc_gather_words` against a plain gather: parts at any byte offset and of any
        /// length (more than a block's threads), each into its own words, the first
        /// `word_parts` into the words and the rest into the escapes (of another length); a
        /// part reaching past the bytes or its destination gets `KVC_CHAIN_BAD_RANGE` and
        /// writes nothing.
        #[test]
        fn gather_words_match_a_plain_gather(
            raw in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..4000),
            parts in proptest::collection::vec((0u64..4100, 0u64..700, 0u64..1000), 0..6),
            word_parts in 0usize..7,
        ) {
            let (n_words, n_escapes) = (1500, 900);
            let word_parts = word_parts.min(parts.len());
            let parts: Vec<GatherPart> = parts
                .into_iter()
                .map(|(src, n_words, dst)| GatherPart { src, dst, n_words })
                .collect();
            let mut words = vec![0xDEAD_BEEF_u32; n_words];
            let mut escapes = vec![-7i32; n_escapes];
            let dst = (&mut words[..], &mut escapes[..]);
            let (got, status) = gather_into(&raw, (&parts, word_parts), dst, parts.len());
            proptest::prop_assert!(got.is_ok());
            // Parts applied in order, as the kernel's blocks run on the host.
            let mut want = vec![0xDEAD_BEEF_u32; n_words];
            let mut want_escapes = vec![-7i32 as u32; n_escapes];
            for (i, (p, &st)) in parts.iter().zip(&status).enumerate() {
                let to = if i < word_parts { &mut want } else { &mut want_escapes };
                let (src, dst, n) = (p.src as usize, p.dst as usize, p.n_words as usize);
                let fits = src + 4 * n <= raw.len() && dst + n <= to.len();
                proptest::prop_assert_eq!(st, u32::from(!fits));
                if fits {
                    for (w, b) in to[dst..dst + n].iter_mut().zip(raw[src..].chunks_exact(4)) {
                        *w = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                    }
                }
            }
            proptest::prop_assert_eq!(words, want);
            let escapes: Vec<u32> = escapes.iter().map(|&e| e as u32).collect();
            proptest::prop_assert_eq!(escapes, want_escapes);
        }

        /// A part whose end overflows 64 bits is refused, not wrapped.
        #[test]
        fn gather_parts_near_u64_max_are_bad_range(src in proptest::prelude::any::<u64>()) {
            let raw = [1u8; 64];
            let mut words = [0u32; 16];
            let parts = [
                GatherPart { src, dst: 0, n_words: u64::MAX / 4 + 1 },
                GatherPart { src: 0, dst: u64::MAX - 1, n_words: 2 },
                GatherPart { src: src | (1 << 63), dst: 0, n_words: 1 },
            ];
            let mut escapes = [0i32; 16];
            for n_word_parts in [0, 3] {
                let dst = (&mut words[..], &mut escapes[..]);
                let (got, status) = gather_into(&raw, (&parts, n_word_parts), dst, 3);
                proptest::prop_assert!(got.is_ok());
                proptest::prop_assert_eq!(status, [1, 1, 1]);
            }
            proptest::prop_assert_eq!(words, [0u32; 16]);
            proptest::prop_assert_eq!(escapes, [0i32; 16]);
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

        /// `kvc_chain_verdict` against a plain reading: statuses all passing but for at most
        /// a few, anywhere (in the lenient part or not, at its edge, past a thread's first
        /// stride), any lenient part and bound.
        #[test]
        fn chain_verdicts_match_a_plain_reading(
            n in 0usize..6000,
            lenient in 0usize..7000,
            below in 0u32..6,
            failing in proptest::collection::vec((0usize..6000, 1u32..8), 0..3),
        ) {
            let lenient = lenient.min(n);
            let mut status: Vec<u32> = (0..n)
                .map(|i| if i < lenient { (i as u32 % 7).min(below.saturating_sub(1)) } else { 0 })
                .collect();
            for (at, v) in failing {
                if let Some(s) = status.get_mut(at) {
                    *s = v;
                }
            }
            let passes = |(i, &s): (usize, &u32)| match i < lenient {
                true => s < below,
                false => s == 0,
            };
            let want = u32::from(!status.iter().enumerate().all(passes));
            let rule = VerdictRule { lenient, lenient_below: below };
            proptest::prop_assert_eq!(host_chain_verdict(&status, rule).unwrap(), want);
        }

        /// `kvc_check_chunks` against the CRC-32C of the host: chunks at any byte offset and of
        /// any length (0, under and over a thread's share, several thousand bytes), their CRCs
        /// right or one bit off, and chunks reaching past the bytes.
        #[test]
        fn chunk_checks_match_the_host_crc(
            raw in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..9000),
            chunks in proptest::collection::vec((0u64..9100, 0u64..9100, 0u32..3), 0..12),
        ) {
            let mut checks = Vec::new();
            let mut want = Vec::new();
            for (src, len, kind) in chunks {
                let inside = src <= raw.len() as u64 && len <= raw.len() as u64 - src;
                let crc = match inside {
                    true => crc32c::crc32c(&raw[src as usize..(src + len) as usize]),
                    false => 0,
                };
                let flip = if kind == 0 { 1u32 << (len % 32) } else { 0 };
                checks.push(ChunkCheck { src, len, crc: crc ^ flip, reserved: 0 });
                want.push(match (inside, flip) {
                    (false, _) => 1,
                    (true, 0) => 0,
                    (true, _) => CHECK_BAD_CRC,
                });
            }
            let mut status = vec![7u32; checks.len()];
            host_check_chunks(CheckIo { raw: &raw, checks: &checks, status: &mut status })
                .unwrap();
            proptest::prop_assert_eq!(status, want);
        }
    }
}
