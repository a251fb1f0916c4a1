//! Sealed chunks copied out of one buffer into vectors of their own, on several threads.

use std::ops::Range;

use crate::error::CudaError;

/// The chunks at `places` of `sealed` (the sealed buffer's start).
pub(crate) fn split_sealed<'a>(
    sealed: &'a [u8],
    places: &[Range<usize>],
) -> Result<Vec<&'a [u8]>, CudaError> {
    places
        .iter()
        .enumerate()
        .map(|(chunk, p)| {
            let what = "the sealed buffer's length";
            sealed
                .get(p.clone())
                .ok_or(CudaError::Encode { chunk, what })
        })
        .collect()
}

/// Where each of about `parts` runs of the chunks at `places` (one after another) starts, of
/// about equal bytes and at least one chunk each (one run where there are none), then
/// `places.len()`.
pub(crate) fn part_starts(places: &[Range<usize>], parts: usize) -> Vec<usize> {
    let total = places.last().map_or(0, |p| p.end);
    let parts = parts.clamp(1, places.len().max(1));
    let mut starts = vec![0];
    for (i, p) in places.iter().enumerate() {
        let more = i + 1 < places.len() && starts.len() < parts;
        if more && p.end.saturating_mul(parts) >= total.saturating_mul(starts.len()) {
            starts.push(i + 1);
        }
    }
    starts.push(places.len());
    starts
}

/// Bytes below which [`copy_chunks`] copies on one thread.
const PARALLEL_COPY_BYTES: usize = 1 << 20;

/// `chunks` (e.g. what [`Gpu::encode_uploaded_with`](crate::Gpu::encode_uploaded_with) hands
/// over in pinned memory), each copied into a vector of its own, on up to `threads` threads
/// (0: the cores this process may use, at most
/// [`DEFAULT_MAX_HOST_THREADS`](crate::DEFAULT_MAX_HOST_THREADS)), each a run of chunks of
/// about equal bytes: what `Gpu::encode` returns.
pub fn copy_chunks(chunks: &[&[u8]], threads: usize) -> Vec<Vec<u8>> {
    let bytes: usize = chunks.iter().map(|c| c.len()).sum();
    let threads = crate::host_threads(threads).clamp(1, chunks.len().max(1));
    let copy = |run: &[&[u8]]| run.iter().map(|c| c.to_vec()).collect::<Vec<_>>();
    if threads == 1 || bytes < PARALLEL_COPY_BYTES {
        return copy(chunks);
    }
    // Run r ends with the chunk that takes the bytes copied to its share.
    let mut runs = Vec::with_capacity(threads);
    let (mut start, mut copied) = (0, 0);
    for (i, c) in chunks.iter().enumerate() {
        copied += c.len();
        if copied * threads >= bytes * (runs.len() + 1) && runs.len() + 1 < threads {
            runs.push(&chunks[start..i + 1]);
            start = i + 1;
        }
    }
    runs.push(&chunks[start..]);
    std::thread::scope(|scope| {
        let copies: Vec<_> = runs
            .iter()
            .map(|&run| scope.spawn(move || copy(run)))
            .collect();
        let joined = copies.into_iter().map(|h| h.join());
        // A copy thread only allocates and copies: it does not panic but where the whole
        // process would (allocation failure aborts), so its panic is passed on as it is.
        joined
            .flat_map(|r| r.unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    })
}
