//! The PQ search (`kernels/pq_search.cu`): scores and top-k per query over packed codes.

use std::ffi::c_int;

use cudarc::driver::{CudaFunction, CudaStream, DeviceRepr};

use super::{
    host_ran, launch_args, launch_grid, launch_shape, Addrs, DevBuf, OnDevice, OnHost, Space,
};
use crate::error::CudaError;
use crate::pq::PqQuery;

// The kernels compiled for the host (`build.rs`).
extern "C" {
    fn kvc_pq_search_host(
        args: *const PqArgs<OnHost>,
        grid: u32,
        block: u32,
        shared_bytes: u64,
    ) -> c_int;
    #[cfg(test)]
    fn kvc_pq_layout(out: *mut u64, cap: u64) -> u64;
}

/// `KvcPqArgs` (invariant 1).
#[repr(C)]
#[derive(Debug)]
pub(crate) struct PqArgs<S: Space> {
    queries: S::Const<f32>,
    n_queries: u64,
    codewords: S::Const<f32>,
    n_codewords: u64,
    codes: S::Const<u8>,
    n_codes: u64,
    keys: S::Mut<u32>,
    n_keys: u64,
    out: S::Mut<u32>,
    n_out: u64,
    items: S::Const<PqQuery>,
    status: S::Mut<u32>,
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
    let grid = launch_grid(io.items.len())?;
    if io.status.len() != io.items.len() {
        return Err(CudaError::Input {
            what: "status buffer is not one entry per query",
        });
    }
    let args = PqArgs::<OnHost> {
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

// SAFETY (invariant 7): `#[repr(C)]` integers (invariant 1).
unsafe impl DeviceRepr for PqArgs<OnDevice> {}
device_values!(PqQuery);

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
    let grid = launch_grid(b.items.len())?;
    if grid == 0 {
        return Ok(());
    }
    let shared_mem_bytes =
        u32::try_from(shape.shared_bytes()).map_err(|_| input("PQ shared memory over 4 GiB"))?;
    let mut a = Addrs::default();
    let (queries, n_queries) = a.of(&b.queries, stream);
    let (codewords, n_codewords) = a.of(&b.codewords, stream);
    let (codes, n_codes) = a.of(&b.codes, stream);
    let (keys, n_keys) = a.of(&b.keys, stream);
    let (out, n_out) = a.of(&b.out, stream);
    let (items, n_items) = a.of(&b.items, stream);
    let (status, _) = a.of(&b.status, stream);
    let args = PqArgs::<OnDevice> {
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
    let cfg = launch_shape(grid, shape.threads, shared_mem_bytes);
    // SAFETY: invariants 1, 6 (buffers live in `b`, held by the caller until the stream is
    // synchronized), 7, 3 (the host runs' launch shape and shared memory) and 8 (the shape's
    // shared memory is within the budget the function's limit was raised to).
    unsafe { launch_args(stream, func, &args, cfg, a) }?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ffi::host_layout;

    /// What `kvc_pq_layout` reports, from the mirrors in space `S`.
    fn rust_pq_layout<S: Space>() -> Vec<u64> {
        let mut v = layout![
            PqQuery {
                query_start, codebook_start, codes_start, keys_start, out_start, tokens,
                group_heads, k, n_init, n_local
            },
            PqArgs<S> {
                queries, n_queries, codewords, n_codewords, codes, n_codes, keys, n_keys, out,
                n_out, items, status, n_items, dim, m, bits, residual, table_capacity, key_capacity
            },
        ];
        v.push(PQ_SHARED_HEADER_BYTES);
        v.push(u64::from(PQ_MAX_THREADS));
        v
    }

    /// Invariant 1 for `kernels/pq_search.cu`.
    #[test]
    fn layouts_match_the_kernel() {
        assert_eq!(host_layout(kvc_pq_layout), rust_pq_layout::<OnHost>());
        assert_eq!(host_layout(kvc_pq_layout), rust_pq_layout::<OnDevice>());
    }
}
