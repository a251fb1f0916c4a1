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
//! copied to the device as they are and the lane words gathered there by one more launch,
//! `kvc_gather_words`.
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
use std::sync::Arc;

use codec_core::Stream;

use crate::copy_runs::{CopyRuns, MERGE_GAP_BYTES};
use crate::error::CudaError;
use crate::ffi::{self, ResolveBlock, ValueBlock, LANES};
use crate::levels::{time_builds, time_placed_builds, LevelCache, LevelConsts, Placer};
use crate::quant::{DequantBatch, DequantBlock, DequantStatus, OutDtype, OutLayout, Output};
use crate::rans::{LaneBatch, LaneBlock, LaneDecoded, LaneShape, LaneWords, TableId};
use crate::stream::{ChunkLanes, CodedBlock, Destination};

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
}

/// Every block of the dequantization launch wrote its rows.
pub(crate) fn check_dequant(status: &[DequantStatus]) -> Result<(), CudaError> {
    match status.iter().find(|s| **s != DequantStatus::Ok) {
        None => Ok(()),
        Some(DequantStatus::BadPage) => Err(CudaError::Input {
            what: "a page-table entry or page lies outside the output",
        }),
        Some(_) => Err(CudaError::Input {
            what: "a chunk's rows lie outside the output",
        }),
    }
}

/// CRC-32C (Castagnoli), as codec-core checks chunks (spec/FORMAT.md §1.4, check C1).
pub(crate) fn crc32c(bytes: &[u8]) -> u32 {
    crc32c::crc32c(bytes)
}

/// A plan as one chain of launches whose inputs are all uploaded at once: the exponent lane
/// decode, table resolution (`kvc_resolve_tables`, skipped by the fused chain), the symbol
/// lane decode, value mapping and dequantization, each reading the previous launches' outputs
/// where they are (on the device, no host round trip).
#[derive(Debug)]
pub(crate) struct Chain<'p> {
    /// Every block's lane words, in order, as the chunks store them (little-endian): borrowed
    /// from the streams, so that an upload copies them once, straight into its staging buffer
    /// ([`Chain::words`] joins them).
    pub word_parts: Vec<LaneWords<'p>>,
    /// Words in `word_parts`.
    pub n_words: usize,
    /// Every table's frequencies, one after another, and per table (its id) where they lie:
    /// the device expands them into the lane decoders' packed tables (`kvc_expand_tables`)
    /// instead of an upload carrying 16 KiB a table ([`Chain::expanded_tables`] on the host).
    pub table_freqs: Vec<u16>,
    pub table_items: Vec<ffi::TableFreqs>,
    /// The last exponent table added, which the next block with the same frequencies shares
    /// (kvc's encoder gives a layer's K and V blocks one).
    last_exp_table: Option<u32>,
    pub table_list: Vec<u32>,
    pub exp_blocks: Vec<LaneBlock>,
    pub n_exps: usize,
    pub sym_blocks: Vec<LaneBlock>,
    pub n_symbols: usize,
    pub map: Vec<u16>,
    pub resolve: Vec<ResolveBlock>,
    pub radius: Vec<u8>,
    /// Every block's escape values, in order, as stored (little-endian i32), borrowed as
    /// `word_parts` are ([`Chain::escapes`] joins them).
    pub escape_parts: Vec<LaneWords<'p>>,
    /// Escapes in `escape_parts`.
    pub n_escapes: usize,
    pub values: Vec<ValueBlock>,
    pub n_q: usize,
    pub dequant: DequantBatch,
    /// Per block, its chunk (for errors).
    pub chunk_of: Vec<usize>,
    /// The chunks whose CRCs are checked at decode.
    pub checks: Vec<ChunkCrc<'p>>,
}

/// A chunk whose CRC (C1) a decode checks: the bytes it covers, the CRC stored after them and
/// the chunk (for errors).
#[derive(Clone, Copy, Debug)]
pub(crate) struct ChunkCrc<'p> {
    pub covered: &'p [u8],
    pub crc: u32,
    pub chunk: usize,
}

/// The first failing check's error, from each check's status (0, 1 when outside the copied
/// bytes, [`ffi::CHECK_BAD_CRC`]).
pub(crate) fn check_crcs(checks: &[ChunkCrc<'_>], status: &[u32]) -> Result<(), CudaError> {
    let outside = CudaError::Input {
        what: "a chunk checked outside the copied bytes",
    };
    if status.len() != checks.len() {
        return Err(outside);
    }
    for (c, &st) in checks.iter().zip(status) {
        match st {
            0 => {}
            ffi::CHECK_BAD_CRC => {
                return Err(CudaError::Stream {
                    chunk: c.chunk,
                    what: CRC_MISMATCH,
                })
            }
            _ => return Err(outside),
        }
    }
    Ok(())
}

/// `checks` done on the host (on up to the default host threads): the first failing one's
/// error.
pub(crate) fn check_crcs_host(checks: &[ChunkCrc<'_>]) -> Result<(), CudaError> {
    let status = parallel_map(checks, crate::host_threads(0), |c| {
        match crc32c(c.covered) == c.crc {
            true => 0,
            false => ffi::CHECK_BAD_CRC,
        }
    });
    check_crcs(checks, &status)
}

impl<'p> Chain<'p> {
    /// Every block's words in one buffer (for the host-run chain).
    pub fn words(&self) -> Vec<u32> {
        self.word_parts.iter().flat_map(|w| w.iter()).collect()
    }

    /// Every block's escapes in one buffer (for the host-run chain).
    pub fn escapes(&self) -> Vec<i32> {
        let parts = self.escape_parts.iter();
        parts.flat_map(|e| e.iter().map(|x| x as i32)).collect()
    }

    /// Adds a table with its radius; returns its id.
    fn add_table(&mut self, t: &codec_core::rans::FreqTable, radius: u8) -> u32 {
        let id = self.radius.len() as u32;
        self.push_freqs(t.freqs());
        self.radius.push(radius);
        id
    }

    /// The id of a block's exponent table `t`: the last exponent table's when it has the same
    /// frequencies, else a new table's.
    fn exp_table_id(&mut self, t: &codec_core::rans::FreqTable) -> u32 {
        if let Some(id) = self.last_exp_table {
            let item = &self.table_items[id as usize];
            let start = item.freq_start as usize;
            if self.table_freqs[start..start + item.n_freqs as usize] == *t.freqs() {
                return id;
            }
        }
        let id = self.add_table(t, 0);
        self.last_exp_table = Some(id);
        id
    }

    /// Appends one table's frequencies (its id the next).
    fn push_freqs(&mut self, freqs: &[u16]) {
        self.table_items.push(ffi::TableFreqs {
            freq_start: self.table_freqs.len() as u64,
            n_freqs: freqs.len() as u32,
            table: self.table_items.len() as u32,
        });
        self.table_freqs.extend_from_slice(freqs);
    }

    /// Every table in the lane decoders' packed form ([`ffi::SLOTS`] entries each) or, when
    /// `compact`, their compact form, expanded from its frequencies by the host-run
    /// `kvc_expand_tables`.
    pub fn expanded_tables(&self, compact: bool) -> Result<Vec<u32>, CudaError> {
        let mut tables = vec![0u32; self.table_items.len() * ffi::table_entries(compact)];
        let mut status = vec![0u32; self.table_items.len()];
        ffi::host_expand_tables(ffi::ExpandIo {
            freqs: &self.table_freqs,
            tables: &mut tables,
            items: &self.table_items,
            status: &mut status,
            compact,
        })?;
        check_expanded(&status)?;
        Ok(tables)
    }

    /// Appends one coded block of `lanes` (its chunk) to every launch of the chain: `level_ids`
    /// are the chunk level's tables, `map_start` and `consts_start` where its (layer, K/V)'s
    /// table map and channel constants start, `dest` where the chunk's output goes.
    fn push_block(
        &mut self,
        lanes: &ChunkLanes<'_>,
        blk: &'p CodedBlock<'p>,
        level_ids: &[u32],
        (map_start, consts_start): (u64, u64),
        dest: Destination,
    ) -> Result<(), CudaError> {
        let n = BlockCounts::of(blk)?;
        let (list_start, list_len) = self.push_table_list(blk, level_ids)?;
        self.push_lane_blocks(blk, &n, list_start, list_len);
        let group = u32::from(lanes.stream().header().group);
        let has_exps = u32::from(blk.exp_table.is_some());
        self.resolve.push(ResolveBlock {
            symbol_start: self.n_symbols as u64,
            exp_start: self.n_exps as u64,
            map_start,
            n_e: n.n_e,
            n_sym: n.n_sym,
            sink_rows: lanes.sink_rows() as u32,
            group,
            has_exps,
            reserved: 0,
        });
        self.values.push(ValueBlock {
            index_start: (self.n_symbols + blk.n_e) as u64,
            list_start: u64::from(list_start),
            escape_start: self.n_escapes as u64,
            q_start: self.n_q as u64,
            n_sym: n.n_sym,
            n_escapes: n.n_escapes,
            list_len,
            reserved: 0,
        });
        self.escape_parts.push(blk.escapes);
        self.n_escapes += blk.escapes.len();
        self.push_dequant_block(lanes, blk, consts_start, dest)?;
        self.n_exps += blk.n_e;
        self.n_symbols += blk.n_e + blk.n_sym;
        self.n_q += blk.n_sym;
        self.chunk_of.push(lanes.chunk());
        Ok(())
    }

    /// Appends the block's table list (its exponent table, or a stand-in, then the level's
    /// tables) and returns where it starts and its length.
    fn push_table_list(
        &mut self,
        blk: &CodedBlock<'_>,
        level_ids: &[u32],
    ) -> Result<(u32, u32), CudaError> {
        let start = u32::try_from(self.table_list.len()).map_err(|_| CudaError::Input {
            what: "over 2^32 table-list entries",
        })?;
        let exp_id = match &blk.exp_table {
            Some(t) => self.exp_table_id(t),
            None => level_ids[0],
        };
        self.table_list.push(exp_id);
        self.table_list.extend_from_slice(level_ids);
        Ok((start, (level_ids.len() + 1) as u32))
    }

    /// Appends the block's two lane decodes, of its exponents and of all its symbols, over
    /// the same words and table list.
    fn push_lane_blocks(
        &mut self,
        blk: &'p CodedBlock<'p>,
        n: &BlockCounts,
        table_start: u32,
        table_count: u32,
    ) {
        let word_start = self.n_words as u64;
        self.word_parts.push(blk.words);
        self.n_words += blk.words.len();
        let block = |symbol_start: usize, n_symbols| LaneBlock {
            word_start,
            symbol_start: symbol_start as u64,
            n_symbols,
            table_start,
            table_count,
            lane_len: n.lane_len,
        };
        self.exp_blocks.push(block(self.n_exps, n.n_e));
        self.sym_blocks.push(block(self.n_symbols, n.n_all));
    }

    /// Appends the block's dequantization into tensor (layer, K/V) of `dest`.
    fn push_dequant_block(
        &mut self,
        lanes: &ChunkLanes<'_>,
        blk: &CodedBlock<'_>,
        consts_start: u64,
        dest: Destination,
    ) -> Result<(), CudaError> {
        let h = lanes.stream().header();
        let block = DequantBlock {
            q_start: self.n_q as u64,
            exp_start: self.n_exps as u64,
            sink_start: 0,
            out_start: dest.tensor_start(blk.layer, blk.kv)?,
            page_start: dest.page_start,
            consts_start,
            rows: lanes.rows() as u32,
            sink_rows: lanes.sink_rows() as u32,
            group: u32::from(h.group),
            has_exps: u32::from(blk.exp_table.is_some()),
            token_start: h.chunks[lanes.chunk()].token_start,
            reserved: 0,
        };
        self.dequant.add_block_external(block, &blk.sink);
        Ok(())
    }
}

/// Those of `chunks` whose CRCs are checked at decode, in order.
fn crc_checks<'p>(chunks: &[PlannedChunk<'p>]) -> Vec<ChunkCrc<'p>> {
    let checks = chunks.iter().filter_map(|pc| {
        pc.crc.map(|(covered, crc)| ChunkCrc {
            covered,
            crc,
            chunk: pc.lanes.chunk(),
        })
    });
    checks.collect()
}

/// A coded block's counts as the launches' 32-bit fields hold them.
struct BlockCounts {
    /// Exponent symbols.
    n_e: u32,
    /// Value symbols.
    n_sym: u32,
    /// Both: what the symbol launch decodes.
    n_all: u32,
    /// Escape values.
    n_escapes: u32,
    /// Words per lane.
    lane_len: [u32; LANES],
}

impl BlockCounts {
    fn of(blk: &CodedBlock<'_>) -> Result<Self, CudaError> {
        let input = |what| CudaError::Input { what };
        let mut lane_len = [0u32; LANES];
        for (d, &l) in lane_len.iter_mut().zip(&blk.lane_len) {
            *d = u32::try_from(l).map_err(|_| input("over 2^32 words in a lane"))?;
        }
        let n_e = u32::try_from(blk.n_e).map_err(|_| input("over 2^32 symbols"))?;
        let n_sym = u32::try_from(blk.n_sym).map_err(|_| input("over 2^32 symbols"))?;
        Ok(BlockCounts {
            n_e,
            n_sym,
            n_all: n_e.checked_add(n_sym).ok_or(input("over 2^32 symbols"))?,
            n_escapes: u32::try_from(blk.escapes.len()).map_err(|_| input("over 2^32 escapes"))?,
            lane_len,
        })
    }
}

/// Chunk `chunk` of `stream` read into its blocks after its CRC (C1) is checked, or with
/// `crc_at_decode` read with the bytes its CRC covers and the CRC, to be checked at decode.
fn check_chunk<'s>(
    stream: &'s Stream<'s>,
    chunk: usize,
    crc_at_decode: bool,
) -> Result<(ChunkLanes<'s>, Option<CrcCovered<'s>>), CudaError> {
    let bad = |what| CudaError::Stream { chunk, what };
    let bytes = stream
        .chunk_bytes(chunk)
        .map_err(|_| bad("no such chunk"))?;
    let body_len = bytes
        .len()
        .checked_sub(4)
        .ok_or(bad("chunk shorter than its CRC"))?;
    let (body, crc) = bytes.split_at(body_len);
    let crc = u32::from_le_bytes([crc[0], crc[1], crc[2], crc[3]]);
    if !crc_at_decode && crc32c(body) != crc {
        return Err(bad(CRC_MISMATCH));
    }
    let lanes = ChunkLanes::from_body(stream, chunk, body)?;
    Ok((lanes, crc_at_decode.then_some((body, crc))))
}

/// What a chunk whose CRC fails is reported as.
const CRC_MISMATCH: &str = "chunk CRC mismatch (C1)";

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

/// Where one (profile, level)'s constants start in a chain: its tables' ids, and the first of
/// its table maps and of its channel constants (every (layer, K/V)'s, in order).
struct LevelStarts {
    ids: Vec<u32>,
    consts: Arc<LevelConsts>,
    map_base: u64,
    consts_base: u64,
}

/// The (profile, level)s a chain's blocks use so far, each's constants taken from `cache` and
/// appended to the chain once, or placed by `place`.
struct Shared<'c, 'p> {
    cache: &'c LevelCache,
    levels: Vec<((usize, u8), LevelStarts)>,
    place: Option<Placer<'p>>,
}

impl<'c, 'p> Shared<'c, 'p> {
    fn new(cache: &'c LevelCache, place: Option<Placer<'p>>) -> Self {
        Shared {
            cache,
            levels: Vec::new(),
            place,
        }
    }

    /// Where `pc`'s (profile, level) constants start in `ch`, appended the first time.
    fn level(&mut self, ch: &mut Chain<'_>, pc: &PlannedChunk<'_>) -> Result<usize, CudaError> {
        let key = (pc.profile, pc.lanes.level());
        if let Some(i) = self.levels.iter().position(|(k, _)| *k == key) {
            return Ok(i);
        }
        let consts = self
            .cache
            .get(pc.lanes.stream().profile(), key.1)
            .map_err(|what| CudaError::Stream {
                chunk: pc.lanes.chunk(),
                what,
            })?;
        let first = ch.radius.len() as u32;
        for range in consts.table_ranges() {
            ch.push_freqs(&consts.freqs[range]);
        }
        ch.radius.extend_from_slice(&consts.radius);
        let ids = (first..first + consts.n_tables() as u32).collect();
        let (map_base, consts_base) = match self.place.as_mut() {
            Some(place) => place(&pc.lanes.stream().profile().hash(), key.1, &consts)?,
            None => {
                let map_base = ch.map.len() as u64;
                ch.map.extend_from_slice(&consts.maps);
                (map_base, ch.dequant.add_consts(&consts.consts))
            }
        };
        let starts = LevelStarts {
            ids,
            consts,
            map_base,
            consts_base,
        };
        self.levels.push((key, starts));
        Ok(self.levels.len() - 1)
    }
}

impl DecodePlan<'_> {
    /// The plan's chain of launches ([`Chain`]).
    pub(crate) fn chain(&self) -> Result<Chain<'_>, CudaError> {
        self.chain_with(&LevelCache::default())
    }

    /// [`chain`](Self::chain), each (profile, level)'s constants taken from `cache` (and kept
    /// there).
    pub(crate) fn chain_with(&self, cache: &LevelCache) -> Result<Chain<'_>, CudaError> {
        self.chain_of(cache, 0..self.chunks.len())
    }

    /// [`chain_with`](Self::chain_with) of the plan's chunks `chunks` alone (the pieces of
    /// [`pieces`](Self::pieces) write disjoint parts of the output, as the whole plan does).
    pub(crate) fn chain_of(
        &self,
        cache: &LevelCache,
        chunks: Range<usize>,
    ) -> Result<Chain<'_>, CudaError> {
        self.chain_placed(cache, chunks, None)
    }

    /// [`chain_of`](Self::chain_of), each level's table maps and channel constants placed by
    /// `place` instead of appended to the chain (its `map` and channel constants stay empty).
    pub(crate) fn chain_placed(
        &self,
        cache: &LevelCache,
        chunks: Range<usize>,
        place: Option<Placer<'_>>,
    ) -> Result<Chain<'_>, CudaError> {
        if self.heads == 0 || self.head_dim == 0 {
            return Err(CudaError::Input {
                what: "no channels",
            });
        }
        let chunks = self.chunks.get(chunks).ok_or(CudaError::Input {
            what: "chunks past the plan's",
        })?;
        let mut ch = self.empty_chain(chunks);
        ch.checks = crc_checks(chunks);
        let mut shared = Shared::new(cache, place);
        for pc in chunks {
            let at = shared.level(&mut ch, pc)?;
            let level = &shared.levels[at].1;
            for blk in &pc.lanes.blocks {
                let (map, consts) = level.consts.starts(blk.layer, blk.kv);
                let starts = (
                    level.map_base + map as u64,
                    level.consts_base + consts as u64,
                );
                ch.push_block(&pc.lanes, blk, &level.ids, starts, pc.dest)?;
            }
        }
        Ok(ch)
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

    /// A chain with no blocks yet, with room for all of `chunks`' (and the plan's page
    /// tables).
    fn empty_chain(&self, chunks: &[PlannedChunk<'_>]) -> Chain<'_> {
        let blocks = chunks.iter().map(|pc| pc.lanes.blocks.len()).sum();
        let mut ch = Chain {
            word_parts: Vec::with_capacity(blocks),
            n_words: 0,
            table_freqs: Vec::new(),
            table_items: Vec::new(),
            last_exp_table: None,
            table_list: Vec::new(),
            exp_blocks: Vec::with_capacity(blocks),
            n_exps: 0,
            sym_blocks: Vec::with_capacity(blocks),
            n_symbols: 0,
            map: Vec::new(),
            resolve: Vec::with_capacity(blocks),
            radius: Vec::new(),
            escape_parts: Vec::with_capacity(blocks),
            n_escapes: 0,
            values: Vec::with_capacity(blocks),
            n_q: 0,
            dequant: DequantBatch::with_output(self.heads, self.head_dim, self.output),
            chunk_of: Vec::with_capacity(blocks),
            checks: Vec::new(),
        };
        if matches!(self.output.layout, OutLayout::Paged { .. }) {
            ch.dequant.add_page_table(&self.page_tables);
        }
        // Room for every block's sink rows at once (no regrowth while copying).
        let all_blocks = || chunks.iter().flat_map(|pc| &pc.lanes.blocks);
        let sink = all_blocks().map(|b| b.sink.len()).sum();
        ch.dequant.reserve_external(blocks, sink);
        ch
    }

    /// The CRCs of the chunks whose CRCs are checked at decode, checked on the host.
    pub(crate) fn check_crcs_host(&self) -> Result<(), CudaError> {
        check_crcs_host(&crc_checks(&self.chunks))
    }

    #[cfg(feature = "internals")]
    /// For benches: the seconds `reps` builds of the plan's chain of launches take on the host
    /// (the first step of every `Gpu` upload): with `kept`, each (profile, level)'s constants
    /// built before the first and kept, as a `Gpu` keeps them after its first call; without,
    /// built in every build, as in a `Gpu`'s first call.
    pub fn time_chain(&self, reps: usize, kept: bool) -> Result<f64, CudaError> {
        time_builds(reps, kept, |cache| self.chain_with(cache))
    }

    #[cfg(feature = "internals")]
    /// For benches: [`time_chain`](Self::time_chain) with the constants kept and each level's
    /// table maps and channel constants resident where the chain's launches read them (as a
    /// `Gpu` keeps them on its device after its first call): the host's part of every later
    /// call, without copying them into the chain.
    pub fn time_chain_resident(&self, reps: usize) -> Result<f64, CudaError> {
        let all = 0..self.chunks.len();
        time_placed_builds(reps, |cache, place| {
            self.chain_placed(cache, all.clone(), Some(place))
        })
    }

    #[cfg(feature = "internals")]
    /// For benches: the bytes a decode from `raw` (the bytes the plan's streams lie in, as
    /// `Gpu::decode_from` is given them) copies to the device whole: the runs its lane words,
    /// escapes and checked chunks lie in, merged across gaps of at most 64 KiB.
    pub fn bytes_copied_from(&self, raw: &[u8]) -> Result<usize, CudaError> {
        Ok(self.chain()?.gather_parts(raw, MERGE_GAP_BYTES)?.runs.len())
    }

    /// The ranges of `raw` (the bytes the plan's streams lie in) that a decode from it copies
    /// for the plan's chunks `chunks` when every block's lane words lie in a chunk checked at
    /// decode, as a stream's do: those chunks' bytes, merged across gaps of at most `gap`
    /// bytes; none when no chunk is checked at decode. Found without building the chain, so
    /// that the bytes can cross while it is built; they are the runs
    /// [`Chain::gather_parts`] finds for the chain of the same chunks unless some words lie
    /// outside them (a test holds the two to each other). An input error if a checked chunk
    /// lies outside `raw` or `chunks` past the plan's.
    pub(crate) fn checked_runs(
        &self,
        chunks: Range<usize>,
        raw: &[u8],
        gap: usize,
    ) -> Result<CopyRuns, CudaError> {
        let chunks = self.chunks.get(chunks).ok_or(CudaError::Input {
            what: "chunks past the plan's",
        })?;
        let needed = checked_ranges(&crc_checks(chunks), RawPlace(raw))?;
        Ok(CopyRuns::new(needed, gap))
    }

    #[cfg(feature = "internals")]
    /// For benches: the seconds `reps` findings of the chain's lane words and checked chunks
    /// in `raw`, the bytes its streams lie in, take (what a decode from page-locked memory
    /// does after building the chain: the ranges to copy and the offsets there).
    pub fn time_gather_parts(&self, raw: &[u8], reps: usize) -> Result<f64, CudaError> {
        let ch = self.chain()?;
        let t = std::time::Instant::now();
        for _ in 0..reps {
            drop(ch.gather_parts(raw, MERGE_GAP_BYTES)?);
        }
        Ok(t.elapsed().as_secs_f64())
    }

    /// Runs the plan as one chain of launches of the kernels compiled for the host (as a
    /// device runs it by default): the output's f16 or bf16 bits.
    pub fn decode_chain_host(&self) -> Result<Vec<u16>, CudaError> {
        self.decode_chain_host_as((DEFAULT_CHAIN_FUSED, false))
    }

    #[cfg(feature = "internals")]
    /// [`decode_chain_host`](Self::decode_chain_host) with the tables in the lane decoders'
    /// compact form (as a `Gpu` decodes after `set_lane_tables_compact(true)`).
    pub fn decode_chain_host_compact(&self) -> Result<Vec<u16>, CudaError> {
        self.decode_chain_host_as((DEFAULT_CHAIN_FUSED, true))
    }

    #[cfg(feature = "internals")]
    /// [`decode_chain_host`](Self::decode_chain_host) as the fused chain (as a `Gpu` decodes
    /// after `set_decode_chain_fused(true)`).
    pub fn decode_chain_host_fused(&self) -> Result<Vec<u16>, CudaError> {
        self.decode_chain_host_as((true, false))
    }

    /// The chain run on the host, `fused` or not, its tables `compact` or packed.
    fn decode_chain_host_as(&self, fused_compact: (bool, bool)) -> Result<Vec<u16>, CudaError> {
        let ch = self.chain()?;
        check_crcs_host(&ch.checks)?;
        let mut out = vec![0u16; self.output.len];
        self.run_chain_host(&ch, &ch.words(), &ch.escapes(), &mut out, fused_compact)?;
        Ok(out)
    }

    /// [`decode_chain_host`](Self::decode_chain_host) with the lane words gathered from `raw`,
    /// the bytes every stream of the plan lies in, by the host-run word gather: as
    /// `Gpu::upload_plan_from` gathers them on a device from the bytes it copied.
    pub fn decode_chain_host_from(&self, raw: &[u8]) -> Result<Vec<u16>, CudaError> {
        self.decode_chain_host_from_runs(raw, MERGE_GAP_BYTES)
    }

    #[cfg(any(test, feature = "fuzzing"))]
    /// [`decode_chain_host_from`](Self::decode_chain_host_from) with every needed range of
    /// `raw` copied as a run of its own unless it touches the one before (no gap merged), so
    /// that the word gather and the chunk checks read every block's words and every chunk at
    /// an offset other than its place in `raw`.
    pub fn decode_chain_host_from_apart(&self, raw: &[u8]) -> Result<Vec<u16>, CudaError> {
        self.decode_chain_host_from_runs(raw, 0)
    }

    /// The chain run on the host with its lane words gathered from the runs of `raw` that
    /// hold them, merged across gaps of at most `gap` bytes.
    fn decode_chain_host_from_runs(&self, raw: &[u8], gap: usize) -> Result<Vec<u16>, CudaError> {
        let ch = self.chain()?;
        let places = ch.gather_parts(raw, gap)?;
        let copied = places.runs.gather(raw)?;
        let mut words = vec![0u32; ch.n_words];
        let mut escapes = vec![0i32; ch.n_escapes];
        let mut status = vec![0u32; places.parts.len()];
        ffi::host_gather_words(ffi::GatherIo {
            raw: &copied,
            words: &mut words,
            escapes: &mut escapes,
            parts: &places.parts,
            n_word_parts: places.word_parts,
            status: &mut status,
        })?;
        check_gather(&status)?;
        let mut status = vec![0u32; places.checks.len()];
        ffi::host_check_chunks(ffi::CheckIo {
            raw: &copied,
            checks: &places.checks,
            status: &mut status,
        })?;
        check_crcs(&ch.checks, &status)?;
        let mut out = vec![0u16; self.output.len];
        let fused = (DEFAULT_CHAIN_FUSED, false);
        self.run_chain_host(&ch, &words, &escapes, &mut out, fused)?;
        Ok(out)
    }

    /// The chain's launches on the host into `out` (the plan's output), `words` and
    /// `escapes` the chain's lane words and escape values; `fused` as [`ffi::ChainDev::fused`] (four launches, or five), and
    /// `compact` whether the lane decodes read compact tables ([`crate::Gpu`]'s
    /// `set_lane_tables_compact`).
    fn run_chain_host(
        &self,
        ch: &Chain<'_>,
        words: &[u32],
        escapes: &[i32],
        out: &mut [u16],
        (fused, compact): (bool, bool),
    ) -> Result<(), CudaError> {
        if self.output.layout == (OutLayout::Paged { page_size: 0 }) {
            return Err(CudaError::Input {
                what: "a page size of 0",
            });
        }
        let (heads, head_dim) = (self.heads, self.head_dim);
        // Compact tables are read through the cache, none staged (as on a device).
        let staged = if compact {
            0
        } else {
            LaneShape::MAX_SHARED_TABLES
        };
        let shape = LaneShape::new(1, staged)?;
        let tables = ch.expanded_tables(compact)?;
        let words = LaneInputs {
            words,
            tables: &tables,
            compact,
        };
        let (exps, exp_status) = ch.host_exps(words, shape)?;
        let maps = ch.table_maps(&exps, (heads, head_dim));
        // The fused chain leaves the tables to the launches after (no table index a symbol);
        // its resolution status is 0.
        let mut sym_table = vec![0u16; if fused { 0 } else { ch.n_symbols }];
        let mut resolve_status = vec![0u32; ch.resolve.len()];
        if !fused {
            ffi::host_resolve_tables(ffi::ResolveIo {
                symbol_table: &mut sym_table,
                maps,
                status: &mut resolve_status,
            })?;
        }
        let mut symbols = vec![0u8; ch.n_symbols];
        let mut sym_status = vec![0u32; ch.sym_blocks.len() * LANES];
        let sym_out = (&mut symbols[..], &mut sym_status[..]);
        let sym_io = ch.lane_io(words, shape, (&sym_table, &ch.sym_blocks), sym_out);
        match fused {
            true => ffi::host_lane_decode_mapped(sym_io, maps)?,
            false => ffi::host_lane_decode(sym_io)?,
        }
        let mut q = vec![0i32; ch.n_q];
        let mut value_status = vec![0u32; ch.values.len()];
        ffi::host_map_values(ffi::ValueIo {
            indices: &symbols,
            symbol_table: &sym_table,
            table_list: &ch.table_list,
            radius: &ch.radius,
            escapes,
            q: &mut q,
            blocks: &ch.values,
            status: &mut value_status,
            from_map: fused.then_some(maps),
        })?;
        let mut dq_status = vec![0u32; ch.resolve.len()];
        let mut io = ch.dequant.io_with(&q, &exps, out, &mut dq_status);
        io.mapped = fused.then_some(ffi::MappedValues {
            values: &ch.values,
            resolve: &ch.resolve,
            indices: &symbols,
            map: &ch.map,
            table_list: &ch.table_list,
            radius: &ch.radius,
        });
        ffi::host_dequant(io)?;
        let (exp, resolve, sym, value) = (&exp_status, &resolve_status, &sym_status, &value_status);
        ch.check(exp, resolve, sym, value, &dq_status)
    }
}

impl Chain<'_> {
    /// The exponent lanes run on the host over `words` (the chain's lane words and expanded
    /// tables): the decoded exponents and the lanes' statuses.
    fn host_exps(
        &self,
        words: LaneInputs<'_>,
        shape: LaneShape,
    ) -> Result<(Vec<u8>, Vec<u32>), CudaError> {
        let mut exps = vec![0u8; self.n_exps];
        let mut status = vec![0u32; self.exp_blocks.len() * LANES];
        let no_tables = vec![0u16; self.n_exps];
        let out = (&mut exps[..], &mut status[..]);
        ffi::host_lane_decode(self.lane_io(words, shape, (&no_tables, &self.exp_blocks), out))?;
        Ok((exps, status))
    }

    /// Where the chain's value symbols find their tables, given its decoded exponents `exps`
    /// and the row shape.
    fn table_maps<'a>(
        &'a self,
        exps: &'a [u8],
        (heads, head_dim): (u32, u32),
    ) -> ffi::TableMaps<'a> {
        ffi::TableMaps {
            resolve: &self.resolve,
            exps,
            map: &self.map,
            heads,
            head_dim,
        }
    }

    /// A host-run lane decode of `blocks` over the chain's words and expanded tables (each
    /// symbol's table in `symbol_table`) into `(symbols, status)`.
    fn lane_io<'a>(
        &'a self,
        inputs: LaneInputs<'a>,
        shape: LaneShape,
        (symbol_table, blocks): (&'a [u16], &'a [LaneBlock]),
        (symbols, status): (&'a mut [u8], &'a mut [u32]),
    ) -> ffi::LaneDecodeIo<'a> {
        ffi::LaneDecodeIo {
            words: inputs.words,
            tables: inputs.tables,
            compact: inputs.compact,
            table_list: &self.table_list,
            symbol_table,
            blocks,
            symbols,
            status,
            shape,
        }
    }
}

/// A host-run chain's lane inputs: its lane words, and its tables expanded in the packed or
/// (`compact`) the compact form.
#[derive(Clone, Copy, Debug)]
struct LaneInputs<'a> {
    words: &'a [u32],
    tables: &'a [u32],
    compact: bool,
}

/// Where a chain's inputs lie in the bytes its streams lie in ([`Chain::gather_parts`]).
#[derive(Debug)]
pub(crate) struct RawPlaces {
    /// The ranges to copy, laid back to back.
    pub runs: CopyRuns,
    /// The gather parts, their offsets counted in the copy: each block's lane words, then each
    /// block's escape values (blocks without any have no part).
    pub parts: Vec<ffi::GatherPart>,
    /// How many of `parts` are lane words.
    pub word_parts: usize,
    /// Each chunk checked at decode, its offset counted in the copy.
    pub checks: Vec<ffi::ChunkCheck>,
}

/// The input error of a range that [`CopyRuns`] built to hold it does not (a bug).
const OUTSIDE_THE_RUNS: CudaError = CudaError::Input {
    what: "a byte outside the ranges copied",
};

/// The bytes a plan's streams lie in, and where a slice of them lies.
#[derive(Clone, Copy)]
struct RawPlace<'r>(&'r [u8]);

impl RawPlace<'_> {
    /// Where `bytes` lies in the raw bytes (`None` if empty); an input error if outside them.
    fn of(self, bytes: &[u8]) -> Result<Option<Range<usize>>, CudaError> {
        if bytes.is_empty() {
            return Ok(None);
        }
        let start = (bytes.as_ptr() as usize).wrapping_sub(self.0.as_ptr() as usize);
        if start > self.0.len() || bytes.len() > self.0.len() - start {
            return Err(CudaError::Input {
                what: "a plan whose streams lie outside the given bytes",
            });
        }
        Ok(Some(start..start + bytes.len()))
    }
}

/// The ranges of the raw bytes that `checks`' chunks lie in (none for an empty chunk).
fn checked_ranges(
    checks: &[ChunkCrc<'_>],
    place: RawPlace,
) -> Result<Vec<Range<usize>>, CudaError> {
    let mut needed = Vec::with_capacity(checks.len());
    for c in checks {
        needed.extend(place.of(c.covered)?);
    }
    Ok(needed)
}

/// Appends to `parts` a gather part for each non-empty one of `blocks` (words that lie in the
/// raw bytes), its offset counted in the copy of `runs` and its destination after the blocks
/// before; false if one lies outside the runs.
fn parts_of(
    blocks: &[LaneWords<'_>],
    runs: &CopyRuns,
    place: RawPlace,
    parts: &mut Vec<ffi::GatherPart>,
) -> Result<bool, CudaError> {
    let (mut hint, mut dst) = (0, 0);
    for w in blocks {
        if let Some(at) = place.of(w.as_le_bytes())? {
            let Some(src) = runs.offset(at, &mut hint) else {
                return Ok(false);
            };
            parts.push(ffi::GatherPart {
                src: src as u64,
                dst: dst as u64,
                n_words: w.len() as u64,
            });
        }
        dst += w.len();
    }
    Ok(true)
}

impl Chain<'_> {
    /// Where every block's lane words and escape values and every chunk checked at decode lie
    /// in `raw`, the bytes the plan's streams lie in: the ranges of `raw` that hold them (to
    /// be copied, laid back to back, the bytes between streams left out: [`CopyRuns`]), each
    /// block's gather parts and each chunk's check, their offsets counted in the copy; ranges
    /// at most `gap` bytes apart are copied as one run. An input error if some block's words
    /// or escapes or some checked chunk lie outside `raw`.
    pub(crate) fn gather_parts(&self, raw: &[u8], gap: usize) -> Result<RawPlaces, CudaError> {
        let place = RawPlace(raw);
        let mut needed = checked_ranges(&self.checks, place)?;
        // Most often every block's words and escapes lie in a checked chunk: those chunks
        // alone make the runs, and the words need neither sorting in nor a second look.
        let mut runs = CopyRuns::new(needed.clone(), gap);
        let (parts, word_parts) = match self.parts_in(&runs, place)? {
            Some(parts) => parts,
            None => {
                for w in self.word_parts.iter().chain(&self.escape_parts) {
                    needed.extend(place.of(w.as_le_bytes())?);
                }
                runs = CopyRuns::new(needed, gap);
                self.parts_in(&runs, place)?.ok_or(OUTSIDE_THE_RUNS)?
            }
        };
        let mut hint = 0;
        let mut checks = Vec::with_capacity(self.checks.len());
        for c in &self.checks {
            // An empty chunk body is checked at offset 0 of the copy.
            let src = match place.of(c.covered)? {
                Some(at) => runs.offset(at, &mut hint).ok_or(OUTSIDE_THE_RUNS)?,
                None => 0,
            };
            checks.push(ffi::ChunkCheck {
                src: src as u64,
                len: c.covered.len() as u64,
                crc: c.crc,
                reserved: 0,
            });
        }
        Ok(RawPlaces {
            runs,
            parts,
            word_parts,
            checks,
        })
    }

    /// Each block's gather parts, their offsets counted in the copy of `runs`: its lane words'
    /// (into the chain's words), then its escapes' (into its escapes), and how many are
    /// words'; `None` if some block's words or escapes lie outside the runs.
    fn parts_in(
        &self,
        runs: &CopyRuns,
        place: RawPlace,
    ) -> Result<Option<(Vec<ffi::GatherPart>, usize)>, CudaError> {
        let n = self.word_parts.len() + self.escape_parts.len();
        let mut parts = Vec::with_capacity(n);
        if !parts_of(&self.word_parts, runs, place, &mut parts)? {
            return Ok(None);
        }
        let word_parts = parts.len();
        match parts_of(&self.escape_parts, runs, place, &mut parts)? {
            true => Ok(Some((parts, word_parts))),
            false => Ok(None),
        }
    }

    /// Every launch's statuses: the first failing block's chunk and what failed. As a `Gpu`
    /// reads a chain's, only when their verdict (`kvc_chain_verdict`, host-run) fails them.
    pub(crate) fn check(
        &self,
        exp_status: &[u32],
        resolve_status: &[u32],
        sym_status: &[u32],
        value_status: &[u32],
        dq_status: &[u32],
    ) -> Result<(), CudaError> {
        let statuses = [
            exp_status,
            resolve_status,
            sym_status,
            value_status,
            dq_status,
        ];
        let rule = ffi::VerdictRule {
            lenient: exp_status.len(),
            lenient_below: EXP_LANES_FAIL_FROM,
        };
        if ffi::host_chain_verdict(&statuses.concat(), rule)? == 0 {
            return Ok(());
        }
        check_chain(&self.chunk_of, statuses)
    }
}

/// A table expansion's statuses: the host built every table from a checked stream's or
/// profile's, so any failure is a fault of the plan's own arithmetic, reported as an input
/// error.
pub(crate) fn check_expanded(status: &[u32]) -> Result<(), CudaError> {
    match status.iter().all(|&s| s == 0) {
        true => Ok(()),
        false => Err(CudaError::Input {
            what: "a table expanded from frequencies outside its buffers or not a rANS table's",
        }),
    }
}

/// A word gather's statuses: any part outside its buffers is a fault of the plan's own
/// arithmetic, reported as an input error.
pub(crate) fn check_gather(status: &[u32]) -> Result<(), CudaError> {
    match status.iter().all(|&s| s == 0) {
        true => Ok(()),
        false => Err(CudaError::Input {
            what: "lane words gathered from outside the copied bytes",
        }),
    }
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

/// An exponent lane's status from which it fails (`KVC_LANE_BAD_TABLE`): the end checks below
/// it do not fail a lane whose exponents are a prefix of its block's.
pub(crate) const EXP_LANES_FAIL_FROM: u32 = 4;

/// A chain's statuses (exponent lanes, table resolution, symbol lanes, values,
/// dequantization), its blocks' chunks `chunk_of`: the first failing block's chunk and what
/// failed.
pub(crate) fn check_chain(chunk_of: &[usize], statuses: [&[u32]; 5]) -> Result<(), CudaError> {
    let [exp_status, resolve_status, sym_status, value_status, dq_status] = statuses;
    for (b, &chunk) in chunk_of.iter().enumerate() {
        let bad = |what| Err(CudaError::Stream { chunk, what });
        let lanes = |s: &[u32]| s.get(b * LANES..(b + 1) * LANES).map(|l| l.to_vec());
        if lanes(exp_status).is_none_or(|l| l.iter().any(|&s| s >= EXP_LANES_FAIL_FROM)) {
            return bad("exponent lanes could not be decoded");
        }
        if resolve_status.get(b) != Some(&0) {
            return bad("value tables could not be resolved");
        }
        if lanes(sym_status).is_none_or(|l| l.iter().any(|&s| s != 0)) {
            return bad("a lane's end checks failed (B6/B8)");
        }
        if value_status.get(b) != Some(&0) {
            return bad("escape values (B7/B9)");
        }
    }
    let status: Vec<DequantStatus> = crate::quant::statuses(dq_status.to_vec());
    check_dequant(&status)
}

#[cfg(test)]
mod tests {
    use codec_core::{encode, learn_profile, EncodeParams, KvCache, KvMeta, KvShape, Limits};
    use codec_core::{LearnParams, ProfileMode, Sample, Stream, Tensor};

    use super::*;
    use crate::levels::PlacedElsewhere;

    /// An empty plan for `streams` (of one shape), each into dense f16 tensors of its own, and
    /// their destinations.
    fn layout<'s>(
        streams: &[&'s Stream<'s>],
    ) -> (DecodePlan<'s>, Vec<(&'s Stream<'s>, Destination)>) {
        let shape = streams[0].header().shape;
        let per = 2 * shape.layers as usize * shape.tensor_len();
        let output = Output {
            dtype: OutDtype::F16,
            layout: OutLayout::Dense,
            len: streams.len() * per,
        };
        let plan = DecodePlan::new(shape.kv_heads, shape.head_dim, output);
        let dests = streams.iter().enumerate().map(|(i, &s)| {
            let dest = Destination {
                base: (i * per) as u64,
                ..Destination::dense(shape.tokens, shape.channels())
            };
            (s, dest)
        });
        (plan, dests.collect())
    }

    /// A plan of `streams`, each into dense f16 tensors of its own.
    fn plan_of<'s>(streams: &[&'s Stream<'s>]) -> DecodePlan<'s> {
        let (mut plan, dests) = layout(streams);
        for (s, dest) in dests {
            plan.add_stream(s, dest).unwrap();
        }
        plan
    }

    /// A small stream (2 layers, 1 head of 8 channels, 64 tokens in chunks of 16), its profile
    /// embedded.
    fn small_stream() -> Vec<u8> {
        small_stream_with(EncodeParams::default())
    }

    /// [`small_stream`] coded with `params` (in chunks of 16 tokens).
    fn small_stream_with(params: EncodeParams) -> Vec<u8> {
        let shape = KvShape {
            layers: 2,
            kv_heads: 1,
            head_dim: 8,
            tokens: 64,
        };
        let t = |s: f32| Tensor::F32((0..512).map(|i| (i as f32 * s).sin()).collect());
        let cache = KvCache {
            shape,
            k: vec![t(0.3), t(0.5)],
            v: vec![t(0.7), t(1.1)],
            meta: KvMeta::default(),
        };
        let sample = Sample {
            kv: cache.view(),
            queries: None,
        };
        let profile = learn_profile(&[sample], &LearnParams::default()).unwrap();
        let params = EncodeParams {
            chunk_tokens: 16,
            ..params
        };
        encode(&cache.view(), ProfileMode::Embedded(&profile), &params).unwrap()
    }

    /// A plan's pieces are runs of its chunks in order, none empty, about `piece_blocks`
    /// blocks each; their chains run on the host one after another into one output give the
    /// whole chain's bits.
    #[test]
    fn pieces_decode_to_the_whole_plans_bits() {
        let bytes = small_stream();
        let stream = Stream::open(&bytes, None, &Limits::DEFAULT).unwrap();
        let plan = plan_of(&[&stream, &stream, &stream]);
        let want = plan.decode_chain_host().unwrap();
        // 3 streams of 4 chunks of 2 layers' K and V: 48 blocks.
        assert_eq!(plan.blocks, 48);
        for (piece_blocks, n) in [(0, 1), (48, 1), (100, 1), (24, 2), (16, 3), (8, 6), (1, 12)] {
            let pieces = plan.pieces(piece_blocks, 0);
            assert_eq!(pieces.len(), n, "{piece_blocks} blocks a piece: {pieces:?}");
            assert_eq!(pieces.first().map(|p| p.start), Some(0));
            assert_eq!(pieces.last().map(|p| p.end), Some(plan.chunks()));
            assert!(pieces.windows(2).all(|w| w[0].end == w[1].start));
            assert!(pieces.iter().all(|p| !p.is_empty()));
            assert!(
                decode_pieces_host(&plan, pieces) == want,
                "{piece_blocks} a piece"
            );
        }
        let past = plan.chain_of(&LevelCache::default(), 11..13);
        assert!(matches!(past, Err(CudaError::Input { .. })));
    }

    /// A ramp of pieces starts at the first piece's size and doubles up to the piece size,
    /// then cuts the rest evenly; every end lies inside the plan, in order.
    #[test]
    fn piece_ends_ramp_from_the_first_then_cut_the_rest_evenly() {
        let sizes = |blocks, piece, first| {
            let mut ends = piece_ends(blocks, piece, first);
            ends.push(blocks);
            let starts = std::iter::once(0).chain(ends.clone());
            ends.iter()
                .zip(starts)
                .map(|(e, s)| e - s)
                .collect::<Vec<_>>()
        };
        assert_eq!(sizes(7680, 2048, 256), [256, 512, 1024, 1962, 1963, 1963]);
        assert_eq!(sizes(7680, 2048, 0), [1920; 4]);
        assert_eq!(sizes(7680, 2048, 4096), [1920; 4]);
        assert_eq!(sizes(1000, 2048, 256), [256, 512, 232]);
        assert_eq!(sizes(100, 2048, 256), [100]);
        assert_eq!(sizes(100, 0, 16), [100]);
        assert_eq!(sizes(100, usize::MAX, usize::MAX - 1), [100]);
        assert_eq!(sizes(100, usize::MAX, 40), [40, 60]);
        for blocks in [1, 2, 7, 100, 1919, 7680] {
            for (piece, first) in [(1, 0), (3, 1), (64, 5), (512, 100), (4096, 1)] {
                let s = sizes(blocks, piece, first);
                assert_eq!(s.iter().sum::<usize>(), blocks);
                assert!(s.iter().all(|&n| n > 0), "{blocks} {piece} {first}: {s:?}");
                // The ramp: the doublings below the piece size that end inside the plan.
                let ramp: Vec<_> = (0..16)
                    .map(|k| first << k)
                    .take_while(|&n| n > 0 && n < piece)
                    .scan(0, |at, n| {
                        *at += n;
                        (*at < blocks).then_some(n)
                    })
                    .collect();
                assert_eq!(s[..ramp.len()], ramp, "{blocks} {piece} {first}: {s:?}");
                let rest = &s[ramp.len()..];
                let (lo, hi) = (rest.iter().min(), rest.iter().max());
                assert!(hi.zip(lo).is_some_and(|(h, l)| h - l <= 1), "{s:?}");
                assert!(rest.len() == 1 || rest.iter().all(|&n| 2 * n >= piece && n < 2 * piece));
            }
        }
    }

    /// Pieces of a ramp hold whole chunks, in order, and decode to the whole plan's bits.
    #[test]
    fn a_ramp_of_pieces_decodes_to_the_whole_plans_bits() {
        let bytes = small_stream();
        let stream = Stream::open(&bytes, None, &Limits::DEFAULT).unwrap();
        let plan = plan_of(&[&stream, &stream, &stream]);
        let want = plan.decode_chain_host().unwrap();
        // 48 blocks in chunks of 4: ramp ends at 4 and 12, then 36 blocks in two.
        let pieces = plan.pieces(16, 4);
        assert_eq!(pieces, [0..1, 1..3, 3..8, 8..12]);
        assert!(decode_pieces_host(&plan, pieces) == want);
    }

    /// `plan` decoded by the host-run chains of `pieces`, one after another, into one output.
    fn decode_pieces_host(plan: &DecodePlan<'_>, pieces: Vec<Range<usize>>) -> Vec<u16> {
        let mut out = vec![0u16; plan.output().len];
        for p in pieces {
            let ch = plan.chain_of(&LevelCache::default(), p).unwrap();
            plan.run_chain_host(&ch, &ch.words(), &ch.escapes(), &mut out, (true, false))
                .unwrap();
        }
        out
    }

    /// The five-launch chain (tables resolved into a buffer, every value written; the default,
    /// which the tests against codec-core run) decodes to the bits of the fused one, on
    /// streams with escapes.
    #[test]
    fn fused_and_five_launch_chains_decode_alike() {
        let (a, b) = (small_stream(), small_stream_with(EncodeParams::default()));
        let sa = Stream::open(&a, None, &Limits::DEFAULT).unwrap();
        let sb = Stream::open(&b, None, &Limits::DEFAULT).unwrap();
        let plan = plan_of(&[&sa, &sb]);
        let ch = plan.chain().unwrap();
        assert!(ch.n_escapes > 0, "the streams have no escapes");
        let run = |fused| {
            let mut out = vec![0u16; plan.output().len];
            plan.run_chain_host(&ch, &ch.words(), &ch.escapes(), &mut out, (fused, false))
                .unwrap();
            out
        };
        let compact = |fused| {
            let mut out = vec![0u16; plan.output().len];
            plan.run_chain_host(&ch, &ch.words(), &ch.escapes(), &mut out, (fused, true))
                .unwrap();
            out
        };
        assert!(compact(true) == run(true) && compact(false) == run(true));
        let want = run(false);
        assert!(want.iter().filter(|&&x| x != 0).count() > want.len() / 2);
        assert!(run(true) == want);
    }

    /// The real fixture (8 layers) with step exponents (a profile learned with its queries, so
    /// every coded block has an exponent table, a layer's K and V blocks the same one, which
    /// the chain uploads once) at three levels in four chunks: the host-run chain with compact
    /// tables decodes the bits of the one with packed tables, fused and in
    /// five launches, and these are codec-core's.
    #[test]
    fn compact_tables_decode_the_fixture_as_packed_ones() {
        let mut d = kvc_io::load_dump(&kvc_io::fixtures::sample()).unwrap();
        d.keep_layers(8);
        let profile = learn_profile(&[d.sample()], &LearnParams::default()).unwrap();
        let (mid, last) = (profile.levels() / 2, profile.levels() - 1);
        let params = EncodeParams {
            chunk_tokens: 128,
            levels: vec![0, mid, last, mid],
            token_importance: true,
            ..EncodeParams::default()
        };
        let bytes = encode(&d.kv.view(), ProfileMode::Embedded(&profile), &params).unwrap();
        let stream = Stream::open(&bytes, None, &Limits::DEFAULT).unwrap();
        let plan = plan_of(&[&stream]);
        let ch = plan.chain().unwrap();
        let exp_ids: Vec<u32> = (ch.resolve.iter().zip(&ch.values))
            .filter(|(r, _)| r.has_exps == 1)
            .map(|(_, v)| ch.table_list[v.list_start as usize])
            .collect();
        assert!(exp_ids.len() == ch.sym_blocks.len(), "no exponent tables");
        // A layer's K and V blocks (one after the other) share their exponent table.
        assert!(exp_ids.chunks(2).all(|kv| kv[0] == kv[1]));
        let run = |form| {
            let mut out = vec![0u16; plan.output().len];
            plan.run_chain_host(&ch, &ch.words(), &ch.escapes(), &mut out, form)
                .unwrap();
            out
        };
        let want = run((true, false));
        assert!(run((true, true)) == want && run((false, true)) == want);
        let cpu = crate::fuzzing::codec_core_bits(&stream, OutDtype::F16).unwrap();
        assert!(cpu.concat() == want, "not codec-core's bits");
    }

    /// The fused chain's symbol lanes (`kvc_rans_lane_decode_mapped`) decode what the lanes
    /// given the resolved tables decode; a block whose resolve record does not describe it
    /// (other symbols, a map or exponents past their buffers, no group) is
    /// `KVC_LANE_BAD_RANGE` on every lane, the other blocks decoded as before.
    #[test]
    fn mapped_lanes_decode_as_the_resolved_ones_and_check_their_records() {
        let bytes = small_stream();
        let stream = Stream::open(&bytes, None, &Limits::DEFAULT).unwrap();
        let plan = plan_of(&[&stream]);
        let ch = plan.chain().unwrap();
        let (heads, head_dim) = (plan.heads, plan.head_dim);
        let shape = LaneShape::new(1, 0).unwrap();
        let (words, tables) = (ch.words(), ch.expanded_tables(false).unwrap());
        let inputs = LaneInputs {
            words: &words,
            tables: &tables,
            compact: false,
        };
        let (exps, _) = ch.host_exps(inputs, shape).unwrap();
        let mut sym_table = vec![0u16; ch.n_symbols];
        let mut resolve_status = vec![9u32; ch.resolve.len()];
        let maps = ch.table_maps(&exps, (heads, head_dim));
        ffi::host_resolve_tables(ffi::ResolveIo {
            symbol_table: &mut sym_table,
            maps,
            status: &mut resolve_status,
        })
        .unwrap();
        assert!(resolve_status.iter().all(|&s| s == 0));
        let lanes = |resolve: Option<&[ResolveBlock]>| {
            let mut symbols = vec![0u8; ch.n_symbols];
            let mut status = vec![9u32; ch.sym_blocks.len() * LANES];
            let out = (&mut symbols[..], &mut status[..]);
            let io = ch.lane_io(inputs, shape, (&sym_table, &ch.sym_blocks), out);
            match resolve {
                None => ffi::host_lane_decode(io).unwrap(),
                Some(resolve) => {
                    let maps = ffi::TableMaps { resolve, ..maps };
                    ffi::host_lane_decode_mapped(io, maps).unwrap()
                }
            }
            (symbols, status)
        };
        let want = lanes(None);
        assert!(want.1.iter().all(|&s| s == 0));
        assert!(lanes(Some(&ch.resolve)) == want);
        let first = ch.resolve[0];
        let n = first.n_e as usize + first.n_sym as usize;
        let corruptions: [fn(&mut ResolveBlock); 4] = [
            |r| r.n_sym -= 1,
            |r| r.map_start = u64::MAX - 7,
            |r| (r.has_exps, r.exp_start) = (1, u64::MAX / 2),
            |r| r.group = 0,
        ];
        for corrupt in corruptions {
            let mut resolve = ch.resolve.clone();
            corrupt(&mut resolve[0]);
            let (symbols, status) = lanes(Some(&resolve));
            assert!(status[..LANES].iter().all(|&s| s == 5), "{:?}", resolve[0]);
            assert_eq!(status[LANES..], want.1[LANES..]);
            assert_eq!(symbols[n..], want.0[n..]);
        }
    }

    /// Level constants placed outside the chain (as a `Gpu` keeps them resident on its
    /// device), after other bytes and each level once, decode to the chain's own bits: every
    /// block's map and constants start follows the placer's.
    #[test]
    fn placed_level_constants_decode_as_the_chains_own() {
        let (a, b) = (small_stream(), small_stream_with(EncodeParams::default()));
        let sa = Stream::open(&a, None, &Limits::DEFAULT).unwrap();
        let sb = Stream::open(&b, None, &Limits::DEFAULT).unwrap();
        let plan = plan_of(&[&sa, &sb, &sa]);
        let want = plan.decode_chain_host().unwrap();
        let mut elsewhere = PlacedElsewhere::new();
        let mut place = |h: &[u8; 32], l: u8, c: &Arc<LevelConsts>| elsewhere.place(h, l, c);
        let all = 0..plan.chunks();
        let cache = LevelCache::default();
        let mut ch = plan.chain_placed(&cache, all, Some(&mut place)).unwrap();
        assert!(ch.map.is_empty() && ch.dequant.io(&mut [], &mut []).consts.is_empty());
        assert!(elsewhere.levels() > 0);
        ch.map = elsewhere.maps;
        assert_eq!(ch.dequant.add_consts(&elsewhere.consts), 0);
        let mut out = vec![0u16; plan.output().len];
        plan.run_chain_host(&ch, &ch.words(), &ch.escapes(), &mut out, (true, false))
            .unwrap();
        assert!(out == want);
    }

    /// `add_streams` on 1-5 threads builds the plan `add_stream` builds one stream at a time:
    /// the same chunks, decoded to the same bits; with a chunk whose CRC fails, the same
    /// error and the same chunks added before it.
    #[test]
    fn add_streams_on_any_threads_is_add_stream_in_order() {
        let bytes = small_stream();
        let stream = Stream::open(&bytes, None, &Limits::DEFAULT).unwrap();
        let mut bad = bytes.clone();
        bad[stream.header().chunks[2].offset as usize + 9] ^= 0x10;
        let broken = Stream::open(&bad, None, &Limits::DEFAULT).unwrap();
        for (streams, fails) in [
            (vec![&stream, &stream, &stream], false),
            (vec![&stream, &broken, &stream], true),
        ] {
            let (mut serial, dests) = layout(&streams);
            let serial_result = dests.iter().try_for_each(|&(s, d)| serial.add_stream(s, d));
            assert_eq!(serial_result.is_err(), fails);
            let want = (serial.chunks(), serial.decode_chain_host().unwrap());
            for threads in 1..=5 {
                let (mut plan, dests) = layout(&streams);
                let result = plan.add_streams(&dests, threads);
                assert_eq!(result, serial_result, "{threads} threads");
                let got = (plan.chunks(), plan.decode_chain_host().unwrap());
                assert!(got == want, "{threads} threads");
            }
        }
    }

    /// Two streams over two copies of one stream's bytes (one embedded profile) add no table
    /// map and no channel constants to the chain of one: the plan shares them by the
    /// profile's SHA-256, not by the stream.
    #[test]
    fn streams_of_one_profile_share_table_maps_and_constants() {
        let bytes = small_stream();
        let copy = bytes.clone();
        let one = Stream::open(&bytes, None, &Limits::DEFAULT).unwrap();
        let two = Stream::open(&copy, None, &Limits::DEFAULT).unwrap();
        let single = plan_of(&[&one]);
        let both = plan_of(&[&one, &two]);
        let (a, b) = (single.chain().unwrap(), both.chain().unwrap());
        assert!(!a.map.is_empty());
        assert_eq!(a.map, b.map);
        let consts = |c: &Chain<'_>| c.dequant.io(&mut [], &mut []).consts.len();
        assert_eq!(consts(&a), consts(&b));
        assert_eq!(b.values.len(), 2 * a.values.len());
    }

    /// A chain whose level constants come from a cache that other chains filled (in another
    /// order, with a level this plan lacks) is the chain built with none kept: the same
    /// tables, maps, constants and blocks, so the same bits.
    #[test]
    fn a_chain_from_kept_level_constants_is_the_one_built_afresh() {
        let at = |level| {
            small_stream_with(EncodeParams {
                levels: vec![level],
                ..EncodeParams::default()
            })
        };
        let (b0, b2, b5) = (at(0), at(2), at(5));
        let open = |b| Stream::open(b, None, &Limits::DEFAULT).unwrap();
        let (s0, s2, s5) = (open(&b0), open(&b2), open(&b5));
        let plan = plan_of(&[&s2, &s0, &s2]);
        let cache = LevelCache::default();
        plan_of(&[&s5, &s0]).chain_with(&cache).unwrap();
        let afresh = format!("{:?}", plan.chain().unwrap());
        for _ in 0..2 {
            assert_eq!(format!("{:?}", plan.chain_with(&cache).unwrap()), afresh);
        }
        assert_eq!(cache.len(), 3);
    }

    /// A plan whose CRCs are checked at decode decodes the bits of one checked when chunks are
    /// added, on every host path; a chunk whose lane words or stored CRC were altered (its
    /// structure intact) is added, then refused at decode with the error the other plan gives
    /// when adding it, naming the chunk of the right stream.
    #[test]
    fn crcs_checked_at_decode_refuse_what_adding_refuses() {
        fn at_decode<'s>(streams: &[&'s Stream<'s>]) -> Result<DecodePlan<'s>, CudaError> {
            let (mut plan, dests) = layout(streams);
            plan.set_crc_at_decode(true);
            plan.add_streams(&dests, 2)?;
            Ok(plan)
        }
        let bytes = small_stream();
        let stream = Stream::open(&bytes, None, &Limits::DEFAULT).unwrap();
        let want = plan_of(&[&stream, &stream]).decode_chain_host().unwrap();
        let plan = at_decode(&[&stream, &stream]).unwrap();
        assert_eq!(
            crc_checks(&plan.chunks).len(),
            2 * stream.header().chunks.len()
        );
        assert_eq!(plan.decode_chain_host().unwrap(), want);
        assert_eq!(plan.decode_chain_host_from(&bytes).unwrap(), want);
        assert_eq!(plan.decode_host().unwrap(), want);
        let chunk = stream.chunk_bytes(2).unwrap();
        let end = chunk.as_ptr() as usize - bytes.as_ptr() as usize + chunk.len();
        // Both copies of the stream in one buffer: the second's chunk 2 altered.
        for at in [end - 5, end - 1] {
            let mut two = [&bytes[..], &bytes[..]].concat();
            two[bytes.len() + at] ^= 0x10;
            let (good, bad) = two.split_at(bytes.len());
            let open = |b| Stream::open(b, None, &Limits::DEFAULT).unwrap();
            let (good, bad) = (open(good), open(bad));
            let (mut checked, dests) = layout(&[&good, &bad]);
            let refused = checked.add_streams(&dests, 2).unwrap_err();
            let want_err = CudaError::Stream {
                chunk: 2,
                what: CRC_MISMATCH,
            };
            assert_eq!(refused, want_err);
            let plan = at_decode(&[&good, &bad]).unwrap();
            assert_eq!(plan.decode_chain_host(), Err(want_err.clone()));
            assert_eq!(plan.decode_chain_host_from(&two), Err(want_err.clone()));
            assert_eq!(plan.decode_host(), Err(want_err));
        }
    }

    /// Two streams in one buffer with more than [`MERGE_GAP_BYTES`] of other bytes between
    /// them: a decode from the buffer copies one run a stream (never its header, nor the bytes
    /// between the streams), from its first chunk to its last when the chunks are checked at
    /// decode, within them when not, and decodes both streams' bits.
    #[test]
    fn a_decode_from_host_bytes_copies_the_chunks_and_not_what_lies_between() {
        let bytes = small_stream();
        let gap = vec![0xEE; MERGE_GAP_BYTES + 1];
        let buf = [&bytes[..], &gap, &bytes].concat();
        let second = bytes.len() + gap.len();
        let open = |b| Stream::open(b, None, &Limits::DEFAULT).unwrap();
        let (a, b) = (open(&buf[..bytes.len()]), open(&buf[second..]));
        let entries = &a.header().chunks;
        let first = entries.first().unwrap().offset as usize;
        let last = entries.last().unwrap();
        let chunks = first..last.offset as usize + last.len_bytes as usize - 4;
        let second_chunks = chunks.start + second..chunks.end + second;
        for crc_at_decode in [true, false] {
            let (mut plan, dests) = layout(&[&a, &b]);
            plan.set_crc_at_decode(crc_at_decode);
            plan.add_streams(&dests, 1).unwrap();
            let ch = plan.chain().unwrap();
            let places = ch.gather_parts(&buf, MERGE_GAP_BYTES).unwrap();
            let (runs, parts, checks) = (places.runs, places.parts, places.checks);
            let with_escapes = ch.escape_parts.iter().filter(|e| !e.is_empty()).count();
            assert_eq!(plan.bytes_copied_from(&buf).unwrap(), runs.len());
            // The runs found before the chain is built: these, or none to copy early.
            let early = plan.checked_runs(0..plan.chunks(), &buf, MERGE_GAP_BYTES);
            match crc_at_decode {
                true => assert_eq!(early.unwrap(), runs),
                false => assert_eq!(early.unwrap().len(), 0),
            }
            assert_eq!(places.word_parts, ch.word_parts.len());
            assert_eq!(parts.len(), ch.word_parts.len() + with_escapes);
            if crc_at_decode {
                assert_eq!(runs.runs(), &[chunks.clone(), second_chunks.clone()]);
                assert_eq!(checks.len(), 2 * entries.len());
            } else {
                let [one, two] = runs.runs() else {
                    panic!("{:?}", runs.runs());
                };
                assert!(
                    chunks.start <= one.start && one.end <= chunks.end,
                    "{one:?}"
                );
                assert!(second_chunks.start <= two.start && two.end <= second_chunks.end);
                assert!(checks.is_empty());
            }
            let want = plan_of(&[&a, &b]).decode_chain_host().unwrap();
            assert_eq!(plan.decode_chain_host_from(&buf).unwrap(), want);
        }
    }

    /// The runs a decode in pieces copies before a piece's chain is built are the ones the
    /// piece's chain finds, for every piece of a plan of streams apart in one buffer, gaps
    /// merged or not; a checked chunk outside the buffer, or chunks past the plan's, are
    /// input errors.
    #[test]
    fn each_pieces_early_runs_are_the_ones_its_chain_finds() {
        let bytes = small_stream();
        let between = vec![0xEE; 100];
        let buf = [&bytes[..], &between, &bytes, &between, &bytes].concat();
        let at = |i: usize| i * (bytes.len() + between.len());
        let open = |i| Stream::open(&buf[at(i)..at(i) + bytes.len()], None, &Limits::DEFAULT);
        let streams: Vec<Stream<'_>> = (0..3).map(|i| open(i).unwrap()).collect();
        let (mut plan, dests) = layout(&streams.iter().collect::<Vec<_>>());
        plan.set_crc_at_decode(true);
        plan.add_streams(&dests, 1).unwrap();
        let cache = LevelCache::default();
        for piece_blocks in [0, 1, 8, 16, 24] {
            for gap in [0, 100, MERGE_GAP_BYTES] {
                for piece in plan.pieces(piece_blocks, 0) {
                    let early = plan.checked_runs(piece.clone(), &buf, gap).unwrap();
                    let ch = plan.chain_of(&cache, piece.clone()).unwrap();
                    let runs = ch.gather_parts(&buf, gap).unwrap().runs;
                    assert!(early.len() > 0, "{piece:?}");
                    assert_eq!(early, runs, "{piece_blocks} blocks, gap {gap}, {piece:?}");
                }
            }
        }
        let elsewhere = bytes.clone();
        let outside = plan.checked_runs(0..plan.chunks(), &elsewhere, 0);
        assert!(matches!(outside, Err(CudaError::Input { .. })));
        let past = plan.checked_runs(0..plan.chunks() + 1, &buf, 0);
        assert!(matches!(past, Err(CudaError::Input { .. })));
    }
}
