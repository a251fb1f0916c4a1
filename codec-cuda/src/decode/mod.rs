//! Decoding a batch of chunks (of one or several streams of the same model) with the kernels
//! into one f16/bf16 output: dense `[T, H, D]` tensors or vLLM's pages.
//!
//! A [`DecodePlan`] holds the chunks and where their rows go; adding a chunk checks its CRC
//! (C1) and block structure (B1-B5, C2), and borrows its lane words from the stream (with
//! [`DecodePlan::set_crc_at_decode`], the CRC is checked at decode instead: by the device, one
//! launch `kvc_check_chunks`, when the streams are copied there as they are).
//! `Gpu::decode` and `Gpu::decode_into` run a plan as one chain of five launches, with no host
//! step between them:
//!
//! 1. `kvc_rans_lane_decode` over the exponent prefix of every block of every chunk;
//! 2. `kvc_resolve_tables`: each value symbol's table, found through its block's table map
//!    from the decoded exponents (spec/FORMAT.md §6.1), written for the launches after it;
//! 3. `kvc_rans_lane_decode` over every symbol;
//! 4. `kvc_map_values`: every symbol's table index checked, mapped to its value, the escapes'
//!    values placed (§6.4);
//! 5. `kvc_dequant_f16` or `kvc_dequant_bf16` into the output.
//!
//! With `Gpu::set_decode_chain_fused(true)` the chain has four: no table resolution, the
//! symbol launch (`kvc_rans_lane_decode_mapped`), `kvc_map_escapes` (the escapes' values only)
//! and the dequantization each find a symbol's table through the table map; fewer bytes
//! moved, the same bits.
//!
//! `Gpu::decode_from` runs it on streams that lie in page-locked host memory, their bytes
//! copied to the device as they are and the lane words and escapes gathered there by one more
//! launch, `kvc_gather_words`.
//!
//! The plan is built here; its chain of launches is laid out in `chain`, where a decode from
//! page-locked bytes finds its inputs in them in `raw`, the chain run on the host in `host`,
//! and what every step checks, and the errors it reports, in `checks`.
//!
//! [`DecodePlan::decode_chain_host`] runs the same chain on the kernels compiled for the CPU
//! ([`DecodePlan::decode_chain_host_from`] with the words gathered as `Gpu::decode_from` does);
//! `DecodePlan::decode_host` (and `Gpu::decode_into_stepwise`, both with the feature
//! `internals`) the stepwise path, steps 2 and 4 on the host. Every path reports a failing chunk as [`CudaError::Stream`] (B6-B10 as the
//! launches find them), never panicking, and writes what codec-core decodes, bit for bit.
//!
//! ```
//! use codec_core::{encode, learn_profile, EncodeParams, KvCache, KvMeta, KvShape, Limits};
//! use codec_core::{LearnParams, ProfileMode, Sample, Stream, Tensor, TensorMut};
//! use codec_cuda::decode::DecodePlan;
//! use codec_cuda::OutDtype;
//!
//! // A tiny f32 cache (2 layers, 1 KV head of 4 channels, 8 tokens) coded in chunks of 4.
//! let shape = KvShape { layers: 2, kv_heads: 1, head_dim: 4, tokens: 8 };
//! let t = |s: f32| Tensor::F32((0..32).map(|i| (i as f32 * s).sin()).collect());
//! let cache = KvCache {
//!     shape,
//!     k: vec![t(0.3), t(0.5)],
//!     v: vec![t(0.7), t(1.1)],
//!     meta: KvMeta::default(),
//! };
//! let sample = Sample { kv: cache.view(), queries: None };
//! let profile = learn_profile(&[sample], &LearnParams::default()).unwrap();
//! let params = EncodeParams { chunk_tokens: 4, ..EncodeParams::default() };
//! let bytes = encode(&cache.view(), ProfileMode::Embedded(&profile), &params).unwrap();
//! let stream = Stream::open(&bytes, None, &Limits::DEFAULT).unwrap();
//!
//! // Both chunks into one f16 output: layer 0 K, layer 0 V, layer 1 K, layer 1 V.
//! let plan = DecodePlan::for_stream(&stream, OutDtype::F16).unwrap();
//! let bits = plan.decode_chain_host().unwrap();
//! assert_eq!(bits.len(), 4 * 32);
//!
//! // codec-core's decode into f16 tensors, bit for bit.
//! let mut k = vec![vec![half::f16::ZERO; 32]; 2];
//! let mut v = vec![vec![half::f16::ZERO; 32]; 2];
//! let mut km: Vec<TensorMut<'_>> = k.iter_mut().map(|t| TensorMut::F16(t)).collect();
//! let mut vm: Vec<TensorMut<'_>> = v.iter_mut().map(|t| TensorMut::F16(t)).collect();
//! stream.decode_into(&mut km, &mut vm).unwrap();
//! let want: Vec<u16> = [&k[0], &v[0], &k[1], &v[1]]
//!     .into_iter()
//!     .flat_map(|t| t.iter().map(|x| x.to_bits()))
//!     .collect();
//! assert_eq!(bits, want);
//! ```

use std::ops::Range;

use codec_core::Stream;

use crate::error::CudaError;
use crate::quant::{DequantBatch, OutDtype, OutLayout, Output};
use crate::rans::{LaneBatch, LaneDecoded, LaneShape, TableId};
use crate::stream::{ChunkLanes, Destination};

mod chain;
mod checks;
mod host;
mod raw;
#[cfg(test)]
mod tests;

pub(crate) use chain::{Chain, ChunkCrc};
pub(crate) use checks::{
    check_chain, check_crcs, check_crcs_host, check_dequant, check_expanded, check_gather,
    EXP_LANES_FAIL_FROM,
};
pub(crate) use raw::RawPlaces;

use chain::crc_checks;
use checks::check_chunk;

/// Whether a decode chain is fused by default (`Gpu::set_decode_chain_fused`): the
/// five-launch chain measured faster on a device (the crate's README, "2026-11-30").
pub(crate) const DEFAULT_CHAIN_FUSED: bool = false;

/// The bytes a chunk's CRC covers and the CRC stored after them.
type CrcCovered<'s> = (&'s [u8], u32);

/// A chunk of a plan: its blocks and where its rows go.
#[derive(Debug)]
struct PlannedChunk<'s> {
    /// Index of the chunk's profile in the plan's profiles.
    profile: usize,
    lanes: ChunkLanes<'s>,
    dest: Destination,
    /// Index of the chunk's first block in the plan's blocks.
    first_block: usize,
    /// The bytes its CRC covers and the CRC stored after them, if the CRC is checked at
    /// decode ([`DecodePlan::set_crc_at_decode`]).
    crc: Option<CrcCovered<'s>>,
}

/// Chunks to decode in one batch, and the output they are written to.
#[derive(Debug)]
pub struct DecodePlan<'s> {
    heads: u32,
    head_dim: u32,
    output: Output,
    page_tables: Vec<u32>,
    /// The plan's profiles by their SHA-256: chunks of streams with one profile, embedded in
    /// each or not, share its level tables, table maps and channel constants.
    profiles: Vec<[u8; 32]>,
    chunks: Vec<PlannedChunk<'s>>,
    blocks: usize,
    crc_at_decode: bool,
}

impl<'s> DecodePlan<'s> {
    /// An empty plan for streams of `heads` KV heads of `head_dim` channels, writing `output`.
    pub fn new(heads: u32, head_dim: u32, output: Output) -> Self {
        DecodePlan {
            heads,
            head_dim,
            output,
            page_tables: Vec::new(),
            profiles: Vec::new(),
            chunks: Vec::new(),
            blocks: 0,
            crc_at_decode: false,
        }
    }

    /// With `at_decode`, the chunks added after this call have their CRC (C1) checked when the
    /// plan is decoded (or uploaded) instead of when they are added: by the device for
    /// `Gpu::upload_plan_from` and `Gpu::decode_from` (in the bytes it copies, one launch
    /// beside the word gather), by the host on the other paths. The CPU's part of a decode is
    /// then reading each chunk's structure; the bits decoded are the same. A chunk whose CRC
    /// fails is reported as when it is added (a [`CudaError::Stream`] naming it), before what
    /// the kernels find in any chunk; a chunk whose structure is broken too is refused when
    /// added, for its structure.
    pub fn set_crc_at_decode(&mut self, at_decode: bool) {
        self.crc_at_decode = at_decode;
    }

    /// A plan decoding every chunk of `stream` into a dense output of its own: `dtype`
    /// elements, per layer K then V, each `[T, H, D]` (as codec-core decodes a stream).
    pub fn for_stream(stream: &'s Stream<'s>, dtype: OutDtype) -> Result<Self, CudaError> {
        Self::for_stream_with(stream, dtype, false)
    }

    /// [`for_stream`](Self::for_stream), with `crc_at_decode` the chunks' CRCs checked at
    /// decode ([`set_crc_at_decode`](Self::set_crc_at_decode)).
    pub fn for_stream_with(
        stream: &'s Stream<'s>,
        dtype: OutDtype,
        crc_at_decode: bool,
    ) -> Result<Self, CudaError> {
        let shape = stream.header().shape;
        let output = Output {
            dtype,
            layout: OutLayout::Dense,
            len: 2 * shape.layers as usize * shape.tensor_len(),
        };
        let mut plan = Self::new(shape.kv_heads, shape.head_dim, output);
        plan.set_crc_at_decode(crc_at_decode);
        plan.add_stream(stream, Destination::dense(shape.tokens, shape.channels()))?;
        Ok(plan)
    }

    /// The output the plan writes.
    pub fn output(&self) -> Output {
        self.output
    }

    /// Adds a sequence's page table (page ids, one per `page_size` tokens of the sequence);
    /// returns where it starts, for [`Destination::page_start`].
    pub fn add_page_table(&mut self, table: &[u32]) -> u64 {
        let start = self.page_tables.len() as u64;
        self.page_tables.extend_from_slice(table);
        start
    }

    /// Adds chunk `chunk` of `stream`, written to `dest`. Checks the chunk's CRC (C1) and block
    /// structure (B1-B5, C2), and that the stream has the plan's heads and head size.
    pub fn add_chunk(
        &mut self,
        stream: &'s Stream<'s>,
        chunk: usize,
        dest: Destination,
    ) -> Result<(), CudaError> {
        self.check_shape(stream)?;
        let (lanes, crc) = check_chunk(stream, chunk, self.crc_at_decode)?;
        self.push_chunk(lanes, crc, dest);
        Ok(())
    }

    /// Adds every chunk of `stream`, written to `dest`.
    pub fn add_stream(
        &mut self,
        stream: &'s Stream<'s>,
        dest: Destination,
    ) -> Result<(), CudaError> {
        for chunk in 0..stream.header().chunks.len() {
            self.add_chunk(stream, chunk, dest)?;
        }
        Ok(())
    }

    /// [`add_stream`](Self::add_stream) for each of `streams` in order, their chunks checked
    /// (CRCs, block structure) on up to `threads` threads (0: the cores this process may use,
    /// at most [`DEFAULT_MAX_HOST_THREADS`](crate::DEFAULT_MAX_HOST_THREADS)). The plan is the
    /// same for every thread count; on an error, the chunks before the first failing one (in
    /// order) are added, as `add_stream` leaves them.
    pub fn add_streams(
        &mut self,
        streams: &[(&'s Stream<'s>, Destination)],
        threads: usize,
    ) -> Result<(), CudaError> {
        let jobs: Vec<(&'s Stream<'s>, usize, Destination)> = streams
            .iter()
            .flat_map(|&(s, d)| (0..s.header().chunks.len()).map(move |c| (s, c, d)))
            .collect();
        let at_decode = self.crc_at_decode;
        let checked = parallel_map(&jobs, crate::host_threads(threads), |&(s, c, _)| {
            check_chunk(s, c, at_decode)
        });
        for (&(stream, _, dest), lanes) in jobs.iter().zip(checked) {
            self.check_shape(stream)?;
            let (lanes, crc) = lanes?;
            self.push_chunk(lanes, crc, dest);
        }
        Ok(())
    }

    /// An input error unless `stream` has the plan's heads and head size.
    fn check_shape(&self, stream: &Stream<'_>) -> Result<(), CudaError> {
        let shape = stream.header().shape;
        match shape.kv_heads == self.heads && shape.head_dim == self.head_dim {
            true => Ok(()),
            false => Err(CudaError::Input {
                what: "a stream's heads or head size differ from the plan's",
            }),
        }
    }

    /// Appends a checked chunk, its profile's index found (or added) by the profile's hash.
    fn push_chunk(
        &mut self,
        lanes: ChunkLanes<'s>,
        crc: Option<CrcCovered<'s>>,
        dest: Destination,
    ) {
        let id = lanes.stream().profile().hash();
        let index = match self.profiles.iter().position(|&p| p == id) {
            Some(i) => i,
            None => {
                self.profiles.push(id);
                self.profiles.len() - 1
            }
        };
        let first_block = self.blocks;
        self.blocks += lanes.blocks.len();
        self.chunks.push(PlannedChunk {
            profile: index,
            lanes,
            dest,
            first_block,
            crc,
        });
    }

    /// Chunks in the plan.
    pub fn chunks(&self) -> usize {
        self.chunks.len()
    }

    #[cfg(feature = "internals")]
    /// The first launch: every block's exponent prefix.
    pub fn exponent_batch(&self) -> Result<LaneBatch, CudaError> {
        let mut batch = LaneBatch::new();
        for c in &self.chunks {
            c.lanes.add_exponents_to(&mut batch)?;
        }
        Ok(batch)
    }

    #[cfg(feature = "internals")]
    /// Every block's exponents from the first launch's output; a block whose exponent lanes
    /// failed is the chunk's error.
    pub fn exponents<'a>(&self, out: &'a LaneDecoded) -> Result<Vec<&'a [u8]>, CudaError> {
        let mut exps = Vec::with_capacity(self.blocks);
        for c in &self.chunks {
            for b in 0..c.lanes.blocks.len() {
                let i = c.first_block + b;
                // A prefix does not end a lane: only range and table statuses are failures.
                let failed = out.status(i).iter().any(|s| {
                    matches!(
                        s,
                        crate::rans::LaneStatus::BadRange
                            | crate::rans::LaneStatus::BadTable
                            | crate::rans::LaneStatus::Unknown(_)
                    )
                });
                if failed {
                    return Err(CudaError::Stream {
                        chunk: c.lanes.chunk(),
                        what: "exponent lanes could not be decoded",
                    });
                }
                exps.push(out.symbols(i));
            }
        }
        Ok(exps)
    }

    #[cfg(feature = "internals")]
    /// The second launch: every symbol of every block, level tables shared per (profile, level).
    pub fn symbol_batch(&self, exps: &[&[u8]]) -> Result<LaneBatch, CudaError> {
        let mut batch = LaneBatch::new();
        let mut level_tables: Vec<((usize, u8), Vec<TableId>)> = Vec::new();
        for c in &self.chunks {
            let key = (c.profile, c.lanes.level());
            let tables = match level_tables.iter().position(|(k, _)| *k == key) {
                Some(i) => i,
                None => {
                    level_tables.push((key, c.lanes.add_level_tables(&mut batch)));
                    level_tables.len() - 1
                }
            };
            let block_exps = exps
                .get(c.first_block..c.first_block + c.lanes.blocks.len())
                .ok_or(CudaError::Input {
                    what: "fewer exponent lists than blocks",
                })?;
            c.lanes
                .add_symbols_to(&mut batch, block_exps, &level_tables[tables].1)?;
        }
        Ok(batch)
    }

    #[cfg(feature = "internals")]
    /// The third launch: every block's symbol values (escapes mapped, B7/B9 checked) into a
    /// dequantization batch writing the plan's output.
    pub fn dequant_batch(
        &self,
        symbols: &LaneDecoded,
        exps: &[&[u8]],
    ) -> Result<DequantBatch, CudaError> {
        let mut batch = DequantBatch::with_output(self.heads, self.head_dim, self.output);
        if matches!(self.output.layout, OutLayout::Paged { .. }) {
            batch.add_page_table(&self.page_tables);
        }
        for c in &self.chunks {
            let n = c.lanes.blocks.len();
            let mut values = Vec::with_capacity(n);
            for b in 0..n {
                let i = c.first_block + b;
                if symbols.outcome(i).is_err() {
                    return Err(CudaError::Stream {
                        chunk: c.lanes.chunk(),
                        what: "a lane's end checks failed (B6/B8)",
                    });
                }
                let e = exps.get(i).copied().unwrap_or(&[]);
                values.push(c.lanes.symbol_values(b, symbols.symbols(i), e)?);
            }
            let block_exps = exps.get(c.first_block..c.first_block + n).unwrap_or(&[]);
            c.lanes
                .add_to_dequant(&mut batch, &values, block_exps, c.dest)?;
        }
        Ok(batch)
    }

    #[cfg(feature = "internals")]
    /// Runs the three kernels compiled for the host: the output's f16 or bf16 bits (elements
    /// no chunk writes are 0).
    pub fn decode_host(&self) -> Result<Vec<u16>, CudaError> {
        self.check_crcs_host()?;
        let exp_out = self
            .exponent_batch()?
            .decode_host(LaneShape::MAX_SHARED_TABLES)?;
        let exps = self.exponents(&exp_out)?;
        let sym_out = self
            .symbol_batch(&exps)?
            .decode_host(LaneShape::MAX_SHARED_TABLES)?;
        let (out, status) = self.dequant_batch(&sym_out, &exps)?.decode_host()?;
        check_dequant(&status)?;
        Ok(out)
    }

    /// The plan's chunks cut into runs of about `piece_blocks` blocks each (0: one run of
    /// them all), none empty: the pieces a `Gpu` decodes one after another, each piece's
    /// upload beside the launches of the piece before. With `first_blocks` below
    /// `piece_blocks` (and not 0), the first run holds about `first_blocks` and each next one
    /// twice the one before up to `piece_blocks`, so that the device starts on a small piece
    /// while the larger ones cross; the rest is cut into runs of about equal blocks.
    pub(crate) fn pieces(&self, piece_blocks: usize, first_blocks: usize) -> Vec<Range<usize>> {
        let ends = piece_ends(self.blocks, piece_blocks, first_blocks);
        let mut pieces = Vec::with_capacity(ends.len() + 1);
        let mut ends = ends.into_iter().peekable();
        let mut start = 0;
        for (i, pc) in self.chunks.iter().enumerate() {
            let end = pc.first_block + pc.lanes.blocks.len();
            // A piece ends with the chunk that takes it to its end (or past it, and past the
            // ends of the pieces too small to hold a chunk).
            if ends.peek().is_some_and(|&e| end >= e) {
                pieces.push(start..i + 1);
                start = i + 1;
                while ends.next_if(|&e| end >= e).is_some() {}
            }
        }
        if start < self.chunks.len() || pieces.is_empty() {
            pieces.push(start..self.chunks.len());
        }
        pieces
    }
}

/// `f` of every item, in order, computed on up to `threads` threads (each taking the next item
/// not yet taken).
fn parallel_map<T: Sync, R: Send>(
    items: &[T],
    threads: usize,
    f: impl Fn(&T) -> R + Sync,
) -> Vec<R> {
    let threads = threads.clamp(1, items.len().max(1));
    if threads == 1 {
        return items.iter().map(f).collect();
    }
    let next = std::sync::atomic::AtomicUsize::new(0);
    let mut done: Vec<(usize, R)> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| {
                    let mut out = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(item) = items.get(i) else {
                            return out;
                        };
                        out.push((i, f(item)));
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    });
    done.sort_unstable_by_key(|&(i, _)| i);
    done.into_iter().map(|(_, r)| r).collect()
}

/// Where the pieces of `blocks` coded blocks end, in blocks from the first, the last piece's
/// end (`blocks`) left out: a ramp from `first_blocks` doubling up to `piece_blocks` (when
/// `first_blocks` is below it and not 0), then runs of about `piece_blocks` of about equal
/// blocks ([`DecodePlan::pieces`]).
fn piece_ends(blocks: usize, piece_blocks: usize, first_blocks: usize) -> Vec<usize> {
    let mut ends = Vec::new();
    if piece_blocks == 0 {
        return ends;
    }
    let (mut at, mut size) = (0usize, first_blocks);
    // Saturating: the sizes are a caller's settings, any usize.
    while size > 0 && size < piece_blocks && at.saturating_add(size) < blocks {
        at += size;
        ends.push(at);
        size = size.saturating_mul(2);
    }
    let rest = blocks - at;
    let n = ((rest + piece_blocks / 2) / piece_blocks).max(1);
    ends.extend((1..n).map(|k| at + k * rest / n));
    ends
}
