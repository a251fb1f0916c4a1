//! Decoding a token range into the caller's tensors as independent jobs: one per block of each
//! chunk read, writing its own slice of one tensor (a block is one layer's K or V over its
//! chunk's tokens), run in stream order on one thread or spread over several
//! ([`crate::threads`]). Each job's output depends on its block alone, and the error reported is
//! the first in stream order, so bytes and verdict are the same for every thread count.

use super::error::DecodeError;
use super::stream::Stream;
use crate::block::{BlockDecoder, BlockError, ChunkAt, ChunkContext, RowSink};
use crate::error::Kv;
use crate::kv::{Dtype, TensorMut};
use alloc::vec::Vec;
use core::ops::Range;
use core::sync::atomic::{AtomicUsize, Ordering};

/// One block to decode: chunk-local rows `lo..hi` of it go to `out`.
struct Job<'a, 'o> {
    /// Position of the block among the jobs (stream order).
    index: usize,
    at: ChunkAt,
    /// The block's index in its chunk.
    block: usize,
    parts: crate::block::BlockParts<'a>,
    out: PieceWriter<'o>,
}

/// Decodes tokens `range` of `stream` into `k` and `v` (checked by the caller: one tensor per
/// layer, each `range.len() * channels` elements) on `threads` threads.
pub(super) fn decode_range(
    stream: &Stream<'_>,
    range: Range<u32>,
    k: &mut [TensorMut<'_>],
    v: &mut [TensorMut<'_>],
    threads: usize,
) -> Result<(), DecodeError> {
    let ctx = stream.context();
    let c = ctx.shape().channels();
    let dtype = ctx.dtype();
    // Per tensor (layer-major, K then V: a chunk's block order), what is left of it.
    let mut rest: Vec<TensorMut<'_>> = k
        .iter_mut()
        .zip(v.iter_mut())
        .flat_map(|(k, v)| [k.reborrow(), v.reborrow()])
        .collect();
    let mut jobs = Vec::new();
    let mut stop = None;
    // The chunks tile the tokens in order (check H28): those before the range are skipped by
    // a binary search, so decoding one chunk of many does not walk the whole index.
    let chunks = &stream.header().chunks;
    let first = chunks.partition_point(|e| e.token_start + e.tokens <= range.start);
    for (i, e) in chunks.iter().enumerate().skip(first) {
        let (s, t) = (e.token_start, e.token_start + e.tokens);
        if s >= range.end {
            break;
        }
        if t <= range.start {
            continue;
        }
        let (lo, hi) = (s.max(range.start) - s, t.min(range.end) - s);
        let at = ChunkAt {
            chunk: i as u32,
            token_start: s,
            rows: e.tokens,
            level: e.level,
        };
        let blocks = ctx.chunk_blocks(stream.chunk_bytes(i)?, &at);
        for (b, (parts, tensor)) in blocks.parts.into_iter().zip(&mut rest).enumerate() {
            let taken = core::mem::replace(tensor, empty(dtype));
            // The header's chunks tile the tokens (check H28) and the caller's tensors hold the
            // range: never short, but checked rather than trusted.
            let need = (hi - lo) as usize * c;
            if taken.len() < need {
                return Err(DecodeError::OutputMismatch {
                    what: "tensor length",
                });
            }
            let (piece, left) = taken.split_at(need);
            *tensor = left;
            let out = PieceWriter::new(piece, lo as usize..hi as usize, c, dtype);
            let index = jobs.len();
            jobs.push(Job {
                index,
                at,
                block: b,
                parts,
                out,
            });
        }
        if let Some(err) = blocks.error {
            stop = Some((jobs.len(), err));
            break;
        }
    }
    run_jobs(&ctx, jobs, stop, threads)
}

/// Runs the jobs; the error is the first in stream order: a job's, or `stop`'s (the chunk check
/// that ended the job list, at its position) if no earlier job fails.
fn run_jobs(
    ctx: &ChunkContext<'_>,
    jobs: Vec<Job<'_, '_>>,
    stop: Option<(usize, BlockError)>,
    threads: usize,
) -> Result<(), DecodeError> {
    // Jobs after a failed one need not run: the error reported is never theirs.
    let first_failed = AtomicUsize::new(usize::MAX);
    let results = crate::threads::run(
        jobs,
        threads,
        || None::<(u32, BlockDecoder<'_, '_>)>,
        |dec, mut job| {
            if job.index > first_failed.load(Ordering::Relaxed) {
                return Ok(());
            }
            // A thread's decoder serves the blocks of one chunk after another.
            if dec.as_ref().is_some_and(|(chunk, _)| *chunk != job.at.chunk) {
                *dec = None;
            }
            let (_, d) = dec.get_or_insert_with(|| (job.at.chunk, BlockDecoder::new(ctx, &job.at)));
            let r = d.block(&job.parts, job.block, &mut job.out);
            if r.is_err() {
                first_failed.fetch_min(job.index, Ordering::Relaxed);
            }
            r
        },
    );
    match results.into_iter().find_map(Result::err).or(stop.map(|s| s.1)) {
        Some(err) => Err(err.into()),
        None => Ok(()),
    }
}

/// An empty tensor of `dtype` (a placeholder while a tensor is split).
fn empty(dtype: Dtype) -> TensorMut<'static> {
    match dtype {
        Dtype::F16 => TensorMut::F16(&mut []),
        Dtype::Bf16 => TensorMut::Bf16(&mut []),
        Dtype::F32 => TensorMut::F32(&mut []),
    }
}

/// Writes chunk-local rows `rows` of one block into `out` (`rows.len() * channels` elements),
/// converting to its dtype; the sink rows are copied bit for bit when the dtypes agree.
pub(super) struct PieceWriter<'o> {
    out: TensorMut<'o>,
    rows: Range<usize>,
    channels: usize,
    /// The stream's dtype.
    dtype: Dtype,
}

impl<'o> PieceWriter<'o> {
    pub(super) fn new(out: TensorMut<'o>, rows: Range<usize>, channels: usize, dtype: Dtype) -> Self {
        PieceWriter {
            out,
            rows,
            channels,
            dtype,
        }
    }
}

impl RowSink for PieceWriter<'_> {
    fn rows(&mut self, _layer: u32, _kv: Kv, first: usize, values: &[f32]) {
        let c = self.channels;
        let lo = first.max(self.rows.start);
        let hi = (first + values.len() / c.max(1)).min(self.rows.end);
        if lo < hi {
            let vals = &values[(lo - first) * c..(hi - first) * c];
            self.out.write_f32((lo - self.rows.start) * c, vals);
        }
    }
    fn block_done(&mut self, _layer: u32, _kv: Kv, raw_sink: &[u8]) {
        // Sink rows: copy the stored bits when the dtypes agree (already exact through f32,
        // but NaN payloads and signed zeros stay untouched this way).
        let (c, size) = (self.channels, self.dtype.size_bytes());
        let sink_rows = raw_sink.len() / (c * size).max(1);
        let (lo, hi) = (self.rows.start, self.rows.end.min(sink_rows));
        if lo >= hi || self.out.dtype() != self.dtype {
            return;
        }
        let raw = &raw_sink[lo * c * size..hi * c * size];
        match &mut self.out {
            TensorMut::F16(d) => raw
                .chunks_exact(2)
                .zip(d.iter_mut())
                .for_each(|(b, o)| *o = half::f16::from_le_bytes([b[0], b[1]])),
            TensorMut::Bf16(d) => raw
                .chunks_exact(2)
                .zip(d.iter_mut())
                .for_each(|(b, o)| *o = half::bf16::from_le_bytes([b[0], b[1]])),
            TensorMut::F32(d) => raw
                .chunks_exact(4)
                .zip(d.iter_mut())
                .for_each(|(b, o)| *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        }
    }
}
