//! Encoding chunks from K/V where a server keeps them, in five launches for a whole batch:
//!
//! 1. `kvc_encode_blocks` (`kernels/encode.cu`): per coded block, the layer's step exponents
//!    from its K (spec/FORMAT.md §9.2), their table, the quantized values (§7), each symbol's
//!    table and index with the escapes in order (§6.4), and the lane encoder's block record;
//! 2. `kvc_rans_lane_encode` over those records (§6.3);
//! 3. `kvc_place_blocks`: each block's size and place in its chunk (§5.2), each chunk's length;
//! 4. `kvc_write_blocks`: each block's bytes, the chunks packed one after another, and its
//!    share of its chunk's CRC-32C (§5.2);
//! 5. `kvc_seal_chunks`: each chunk's CRC after it, so that one copy brings the batch back.
//!
//! The host only checks where each chunk lies and splits the copy. The source is one buffer of
//! f32, f16 or bf16 elements holding every layer's K and V as `[T, H, D]` ([`Source`]); the
//! chunks are exactly
//! [`ChunkContext::encode_chunk`]'s, byte for byte. `Gpu::encode` runs the chain on a device,
//! [`EncodePlan::encode_host`] on the kernels compiled for the CPU.
//!
//! ```
//! use codec_core::{learn_profile, ChunkContext, Dtype, KvCache, KvMeta, KvShape};
//! use codec_core::{LearnParams, Rope, Sample, Tensor};
//! use codec_cuda::encode_plan::{EncodePlan, Source};
//!
//! // A tiny f32 cache: 2 layers, 1 KV head of 4 channels, 8 tokens.
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
//! let ctx = ChunkContext::new(shape, Dtype::F32, 0, 4, 1, &profile, Rope::default()).unwrap();
//! // The source buffer: layer 0 K, layer 0 V, layer 1 K, layer 1 V, each [T, C].
//! let (src, source) = Source::of_view(&cache.view());
//! assert_eq!(source, Source { dtype: Dtype::F32, base: 0, tensor_stride: 32 });
//! let mut plan = EncodePlan::new(&ctx, source).unwrap();
//! plan.add_chunk(0..8, 0).unwrap();
//! plan.add_chunk(3..8, 2).unwrap();
//! let chunks = plan.encode_host(&src).unwrap();
//! assert_eq!(chunks[0], ctx.encode_chunk(&cache.view(), 0..8, 0).unwrap());
//! assert_eq!(chunks[1], ctx.encode_chunk(&cache.view(), 3..8, 2).unwrap());
//! ```

use std::collections::hash_map::{Entry, HashMap};
use std::ops::Range;
use std::sync::Arc;

use codec_core::importance::reference_queries;
use codec_core::rans::FreqTable;
use codec_core::rope::pair_sin_cos;
use codec_core::{ChunkContext, Dtype, KvView, Profile, RopeStyle, TensorRef};

use crate::encode::{encode_table, LaneEncodeBlock};
use crate::error::CudaError;
use crate::ffi::{self, LANES};
use crate::levels::{time_builds, time_placed_builds, LevelCache, LevelConsts, Placer};
use crate::quant::ChannelConsts;

/// Where the source tensors lie in one buffer of `dtype` elements: tensor `(layer, K/V)` starts
/// at element `base + (2 * layer + kv) * tensor_stride`, its token `t` `t * C` elements later.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Source {
    /// The elements' type (the stream's dtype: its sink rows are stored in it).
    pub dtype: Dtype,
    /// Element index of layer 0's K, token 0.
    pub base: u64,
    /// Elements from one tensor to the next (at least `tokens * C`).
    pub tensor_stride: u64,
}

impl Source {
    /// `view`'s tensors copied into one buffer (layer 0 K, layer 0 V, layer 1 K, ...), as
    /// little-endian bytes, and its description: for a cache that is not on the device yet
    /// (upload the bytes with [`Gpu::upload`](crate::Gpu::upload)).
    pub fn of_view(view: &KvView<'_>) -> (Vec<u8>, Source) {
        let mut bytes = Vec::new();
        for (k, v) in view.k.iter().zip(&view.v) {
            for t in [k, v] {
                match t {
                    TensorRef::F32(x) => x.iter().for_each(|e| bytes.extend(e.to_le_bytes())),
                    TensorRef::F16(x) => x.iter().for_each(|e| bytes.extend(e.to_le_bytes())),
                    TensorRef::Bf16(x) => x.iter().for_each(|e| bytes.extend(e.to_le_bytes())),
                }
            }
        }
        let shape = view.shape;
        let source = Source {
            dtype: view.k.first().map_or(Dtype::F32, TensorRef::dtype),
            base: 0,
            tensor_stride: u64::from(shape.tokens) * shape.channels() as u64,
        };
        (bytes, source)
    }

    fn code(&self) -> u32 {
        match self.dtype {
            Dtype::F32 => 0,
            Dtype::F16 => 1,
            Dtype::Bf16 => 2,
        }
    }

    fn elem_bytes(&self) -> usize {
        if self.dtype == Dtype::F32 {
            4
        } else {
            2
        }
    }
}

/// A coded block of an encode-chain launch (`KvcEncBlock`, `src/ffi/` invariant 1).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct EncBlock {
    pub x_start: u64,
    pub k_start: u64,
    pub qref_start: u64,
    pub tau_start: u64,
    pub consts_start: u64,
    pub map_start: u64,
    pub sym_start: u64,
    pub q_start: u64,
    pub escape_start: u64,
    pub word_start: u64,
    pub rot_start: u64,
    pub rows: u32,
    pub sink_rows: u32,
    pub group: u32,
    pub importance: u32,
    pub table_start: u32,
    pub table_count: u32,
    pub lane_cap: u32,
    pub rotate: u32,
    /// The chunk it belongs to.
    pub chunk: u32,
    pub reserved: u32,
}

/// What the kernel found for a block (`KvcEncResult`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct EncResult {
    pub status: u32,
    pub n_e: u32,
    pub n_escapes: u32,
    pub n_exp: u32,
    pub exp_freqs: [u16; 16],
}

/// A chunk of an encode chain (`KvcChunkOut`): its blocks and the bytes its body may take.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct ChunkOut {
    pub first_block: u64,
    pub cap: u64,
    pub n_blocks: u32,
    pub reserved: u32,
}

/// What the chain found for a chunk (`KvcChunkResult`): its body's length and status
/// (`kvc_place_blocks`), the XOR of its blocks' CRC shares (`kvc_write_blocks`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct ChunkResult {
    pub len: u64,
    pub status: u32,
    pub crc: u32,
}

/// Where the sealing launch put a chunk (`KvcSealResult`): its bytes and CRC at `start..start +
/// len` of the sealed buffer (`len` 0 if it is not sealed).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct SealResult {
    pub start: u64,
    pub len: u64,
    pub status: u32,
    pub reserved: u32,
}

/// The importance policy's constants as the kernel takes them.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct ImportancePolicy {
    pub slope: f64,
    /// `1 / sqrt(head_dim)`.
    pub inv_sqrt_d: f64,
    pub max_exp: u32,
    /// The pairing keys stored before the rotary embedding are rotated with: 1 NeoX, 2 GPT-J;
    /// 0 when they are not rotated (post-rotary keys, no pairing or an odd head size).
    pub rope_style: u32,
}

/// Chunks of one stream to encode in one chain, from one [`Source`].
#[derive(Debug)]
pub struct EncodePlan<'c, 'p> {
    ctx: &'c ChunkContext<'p>,
    source: Source,
    chunks: Vec<(Range<u32>, u8)>,
}

impl<'c, 'p> EncodePlan<'c, 'p> {
    /// An empty plan for chunks of `ctx`'s stream read from `source`, which must have the
    /// context's dtype and room for its tokens.
    pub fn new(ctx: &'c ChunkContext<'p>, source: Source) -> Result<Self, CudaError> {
        let input = |what| CudaError::Input { what };
        if source.dtype != ctx.dtype() {
            return Err(input("the source's dtype is not the stream's"));
        }
        let shape = ctx.shape();
        if (shape.tokens as u64).saturating_mul(shape.channels() as u64) > source.tensor_stride {
            return Err(input(
                "the source's tensor stride is below tokens * channels",
            ));
        }
        Ok(EncodePlan {
            ctx,
            source,
            chunks: Vec::new(),
        })
    }

    /// Adds the chunk of tokens `tokens` at `level` (as [`ChunkContext::encode_chunk`]).
    pub fn add_chunk(&mut self, tokens: Range<u32>, level: u8) -> Result<(), CudaError> {
        let input = |what| CudaError::Input { what };
        if level >= self.ctx.profile().levels() {
            return Err(input("a level the profile does not have"));
        }
        if tokens.start >= tokens.end || tokens.end > self.ctx.shape().tokens {
            return Err(input("a chunk's token range is empty or beyond the stream"));
        }
        self.chunks.push((tokens, level));
        Ok(())
    }

    /// Chunks in the plan.
    pub fn chunks(&self) -> usize {
        self.chunks.len()
    }

    /// The plan's chunks cut into runs of about `piece_blocks` coded blocks each (0: one run
    /// of them all), in order, none empty unless the plan is: the pieces a `Gpu` encodes one
    /// after another, each piece's copy back beside the launches of the next.
    pub(crate) fn pieces(&self, piece_blocks: usize) -> Vec<Range<usize>> {
        let per_chunk = 2 * self.ctx.shape().layers as usize;
        let n = self.chunks.len();
        let total = n.saturating_mul(per_chunk);
        let pieces = match piece_blocks {
            0 => 1,
            b => ((total + b / 2) / b).clamp(1, n.max(1)),
        };
        // Every chunk has a block per layer and K/V: equal shares of chunks are of blocks.
        (0..pieces)
            .map(|p| p * n / pieces..(p + 1) * n / pieces)
            .collect()
    }

    /// Runs the chain on the kernels compiled for the host over `src` (the source buffer's
    /// bytes, little-endian elements): every chunk's bytes, blocks and CRC, as
    /// [`ChunkContext::encode_chunk`] returns them.
    pub fn encode_host(&self, src: &[u8]) -> Result<Vec<Vec<u8>>, CudaError> {
        self.encode_host_over(src, 0)
    }

    /// [`encode_host`](Self::encode_host) in pieces of about `piece_blocks` coded blocks
    /// ([`pieces`](Self::pieces)), each piece's chain run alone, as `Gpu::encode` runs them:
    /// the same chunks (for the fuzz target).
    #[cfg(feature = "fuzzing")]
    pub(crate) fn encode_host_in_pieces(
        &self,
        src: &[u8],
        piece_blocks: usize,
    ) -> Result<Vec<Vec<u8>>, CudaError> {
        let mut chunks = Vec::with_capacity(self.chunks.len());
        for piece in self.pieces(piece_blocks) {
            let ch = self.chain_of(&LevelCache::default(), piece)?;
            chunks.extend(self.run_chain_host(&ch, src, 0)?);
        }
        Ok(chunks)
    }

    /// [`encode_host`](Self::encode_host) with the launches' large outputs (those a `Gpu`
    /// keeps between calls, not zeroed) holding `fill` in every byte before the first.
    fn encode_host_over(&self, src: &[u8], fill: u8) -> Result<Vec<Vec<u8>>, CudaError> {
        self.run_chain_host(&self.chain()?, src, fill)
    }

    /// The launches of `ch` (this plan's chain) run on the host over `src`, the outputs
    /// holding `fill` before the first as in [`encode_host_over`](Self::encode_host_over).
    fn run_chain_host(
        &self,
        ch: &EncodeChain,
        src: &[u8],
        fill: u8,
    ) -> Result<Vec<Vec<u8>>, CudaError> {
        ch.check_source_bytes(src.len())?;
        let mut run = HostRun::new(ch, fill);
        self.blocks_host(ch, src, &mut run)?;
        run.lanes_host(ch)?;
        self.write_host(ch, src, &mut run)?;
        let chunks = split_sealed(&run.sealed, &ch.sealed_places(&run.seal_results)?)?;
        Ok(chunks.into_iter().map(<[u8]>::to_vec).collect())
    }

    /// The first launch on the host: `kvc_encode_blocks`.
    fn blocks_host(
        &self,
        ch: &EncodeChain,
        src: &[u8],
        run: &mut HostRun,
    ) -> Result<(), CudaError> {
        ffi::host_encode_blocks(ffi::EncodeIo {
            src,
            dtype: self.source.code(),
            importance: ch.importance,
            qref: &ch.qref,
            tau: &ch.tau,
            rot: &ch.rot,
            consts: &ch.consts,
            map: &ch.map,
            table_list: &ch.table_list,
            radius: &ch.radius,
            tables: &mut run.tables,
            symbols: &mut run.symbols,
            symbol_table: &mut run.symbol_table,
            q: &mut run.q,
            escapes: &mut run.escapes,
            blocks: &ch.blocks,
            results: &mut run.results,
            lane_blocks: &mut run.lane_blocks,
            heads: self.ctx.shape().kv_heads,
            head_dim: self.ctx.shape().head_dim,
        })
    }

    /// The last three launches on the host: `kvc_place_blocks`, `kvc_write_blocks`,
    /// `kvc_seal_chunks`.
    fn write_host(&self, ch: &EncodeChain, src: &[u8], run: &mut HostRun) -> Result<(), CudaError> {
        ffi::host_write_chunks(ffi::WriteIo {
            src,
            elem_bytes: self.source.elem_bytes() as u32,
            heads: self.ctx.shape().kv_heads,
            head_dim: self.ctx.shape().head_dim,
            blocks: &ch.blocks,
            results: &run.results,
            escapes: &run.escapes,
            words: &run.words,
            lane_len: &run.lane_len,
            lane_status: &run.lane_status,
            block_at: &mut run.block_at,
            chunks: &ch.chunks,
            chunk_results: &mut run.chunk_results,
            sealed: &mut run.sealed,
            seal_results: &mut run.seal_results,
        })
    }

    /// The plan's launches' inputs ([`EncodeChain`]).
    pub(crate) fn chain(&self) -> Result<EncodeChain, CudaError> {
        self.chain_with(&LevelCache::default())
    }

    /// [`chain`](Self::chain), each level's table maps and channel constants taken from
    /// `cache` (and kept there).
    pub(crate) fn chain_with(&self, cache: &LevelCache) -> Result<EncodeChain, CudaError> {
        self.chain_of(cache, 0..self.chunks.len())
    }

    /// [`chain_with`](Self::chain_with) of the plan's chunks `chunks` alone (each chain's
    /// chunks are sealed one after another from its own start: the pieces of
    /// [`pieces`](Self::pieces) give the whole plan's chunks, in order).
    pub(crate) fn chain_of(
        &self,
        cache: &LevelCache,
        chunks: Range<usize>,
    ) -> Result<EncodeChain, CudaError> {
        self.chain_placed(cache, chunks, None)
    }

    /// [`chain_of`](Self::chain_of), each level's table maps and channel constants placed by
    /// `place` instead of appended to the chain (its `map` and `consts` stay empty).
    pub(crate) fn chain_placed(
        &self,
        cache: &LevelCache,
        chunks: Range<usize>,
        mut place: Option<Placer<'_>>,
    ) -> Result<EncodeChain, CudaError> {
        let chunks = self.chunks.get(chunks).ok_or(CudaError::Input {
            what: "chunks past the plan's",
        })?;
        let ctx = self.ctx;
        let profile = ctx.profile();
        let shape = ctx.shape();
        let (d, c) = (shape.head_dim as usize, shape.channels());
        let mut ch = EncodeChain {
            importance: self.importance()?,
            src_dtype: self.source.code(),
            elem_bytes: self.source.elem_bytes() as u32,
            heads: shape.kv_heads,
            head_dim: shape.head_dim,
            ..EncodeChain::default()
        };
        if ch.importance.is_some() {
            let imp = profile.importance().expect("importance() checked it");
            let pos = ctx.query_position().expect("importance() checked it");
            // Every layer's at once: the rotations are the same for all of their heads.
            let means = imp.query_mean.get(..shape.layers as usize * c);
            let means = means.ok_or(CudaError::Input {
                what: "a profile's query means short of the stream's layers",
            })?;
            ch.qref = reference_queries(means, d, pos, ctx.rope());
            ch.tau = imp.tau.clone();
        }
        // Per level its tables' ids, its constants and where they start in the chain.
        let mut levels: HashMap<u8, ChainLevel> = HashMap::new();
        for (tokens, level) in chunks {
            let (first_block, room_start) = (ch.blocks.len(), ch.rooms);
            let chunk = u32::try_from(ch.chunks.len()).map_err(|_| CudaError::Input {
                what: "over 2^32 chunks in a plan",
            })?;
            let rot_start = ch.add_rotations(ctx, tokens);
            let lv = match levels.entry(*level) {
                Entry::Occupied(e) => e.into_mut(),
                Entry::Vacant(e) => e.insert(ch.add_level(cache, profile, *level, &mut place)?),
            };
            for layer in 0..shape.layers {
                for kv in 0..2 {
                    let (map, consts) = lv.consts.starts(layer, kv);
                    let (map_start, consts_start) =
                        (lv.map_base + map as u64, lv.consts_base + consts as u64);
                    let at = BlockAt {
                        rot_start,
                        layer,
                        kv,
                        map_start,
                        consts_start,
                        chunk,
                    };
                    ch.push_block(self, tokens, &lv.ids, at)?;
                }
            }
            ch.chunks.push(ChunkOut {
                first_block: first_block as u64,
                cap: (ch.rooms - room_start) as u64,
                n_blocks: (ch.blocks.len() - first_block) as u32,
                reserved: 0,
            });
        }
        ch.place_exponent_slots()?;
        Ok(ch)
    }

    #[cfg(feature = "internals")]
    /// For benches: the seconds `reps` builds of the plan's chain take on the host (the first
    /// step of every `Gpu::encode`): with `kept`, each level's table maps and channel
    /// constants built before the first and kept, as a `Gpu` keeps them after its first call.
    pub fn time_chain(&self, reps: usize, kept: bool) -> Result<f64, CudaError> {
        time_builds(reps, kept, |cache| self.chain_with(cache))
    }

    #[cfg(feature = "internals")]
    /// For benches: [`time_chain`](Self::time_chain) with the constants kept and each level's
    /// table maps and channel constants resident where the chain's launches read them (as a
    /// `Gpu` keeps them on its device after its first call): the host's part of every later
    /// `Gpu::encode`.
    pub fn time_chain_resident(&self, reps: usize) -> Result<f64, CudaError> {
        let all = 0..self.chunks.len();
        time_placed_builds(reps, |cache, place| {
            self.chain_placed(cache, all.clone(), Some(place))
        })
    }

    /// The importance policy's constants, if the context turns it on and it can change a step
    /// (codec-core's `ChunkEncoder` codes no exponents otherwise).
    fn importance(&self) -> Result<Option<ImportancePolicy>, CudaError> {
        let ctx = self.ctx;
        let (Some(_), Some(imp)) = (ctx.query_position(), ctx.profile().importance()) else {
            return Ok(None);
        };
        let p = imp.params;
        if p.slope == 0.0 || p.max_exp == 0 {
            return Ok(None);
        }
        let (rope, d) = (ctx.rope(), ctx.shape().head_dim);
        let rope_style = match rope.style {
            _ if !rope.k_pre_rope || d % 2 != 0 => 0,
            RopeStyle::NeoX => 1,
            RopeStyle::GptJ => 2,
            RopeStyle::None => 0,
        };
        Ok(Some(ImportancePolicy {
            slope: f64::from(p.slope),
            inv_sqrt_d: 1.0 / f64::from(d).sqrt(),
            max_exp: u32::from(p.max_exp),
            rope_style,
        }))
    }
}

/// A level in a chain: its constants and where they are.
struct ChainLevel {
    /// Its tables' ids.
    ids: Vec<u32>,
    consts: Arc<LevelConsts>,
    /// Where its first table map and channel constants are.
    map_base: u64,
    consts_base: u64,
}

/// Where a block sits: its layer, K/V and its (layer, K/V, level)'s map and constants.
struct BlockAt {
    /// Where its chunk's rotations start (if its keys are rotated).
    rot_start: u64,
    layer: u32,
    kv: usize,
    map_start: u64,
    consts_start: u64,
    /// Its chunk.
    chunk: u32,
}

/// The inputs of a plan's launches.
#[derive(Debug, Default)]
pub(crate) struct EncodeChain {
    pub importance: Option<ImportancePolicy>,
    /// Per layer its reference queries (C values).
    pub qref: Vec<f64>,
    /// Per (layer, head) its score threshold.
    pub tau: Vec<f32>,
    /// Per chunk with rotated keys, per non-sink row and rotary pair: its sine and cosine.
    pub rot: Vec<f64>,
    pub consts: Vec<ChannelConsts>,
    pub map: Vec<u16>,
    pub table_list: Vec<u32>,
    /// Per level table id its radius.
    pub radius: Vec<u8>,
    /// Encode tables of the levels, 256 entries each. A launch's tables hold one slot per
    /// block after them ([`EncodeChain::n_tables`]), where the first launch writes the block's
    /// exponent table: the slots are neither built nor uploaded.
    pub tables: Vec<u32>,
    pub blocks: Vec<EncBlock>,
    /// Per chunk its blocks and room.
    pub chunks: Vec<ChunkOut>,
    pub n_symbols: usize,
    /// Value symbols (also the escape buffer's room).
    pub n_q: usize,
    pub n_words: usize,
    /// Bytes of the chunks' rooms (each its blocks at their largest).
    pub rooms: usize,
    /// Elements the source must hold.
    pub src_elems: u64,
    /// The source's dtype code and bytes per element, the stream's heads and head size.
    pub src_dtype: u32,
    pub elem_bytes: u32,
    pub heads: u32,
    pub head_dim: u32,
}

/// The launches' outputs of a host run.
#[derive(Debug)]
struct HostRun {
    /// The levels' tables, then the exponent slots.
    tables: Vec<u32>,
    symbols: Vec<u8>,
    symbol_table: Vec<u16>,
    q: Vec<i32>,
    escapes: Vec<i32>,
    results: Vec<EncResult>,
    lane_blocks: Vec<LaneEncodeBlock>,
    words: Vec<u32>,
    lane_len: Vec<u32>,
    lane_status: Vec<u32>,
    block_at: Vec<u64>,
    chunk_results: Vec<ChunkResult>,
    sealed: Vec<u8>,
    seal_results: Vec<SealResult>,
}

impl HostRun {
    /// Outputs for `ch`'s launches: those a `Gpu` keeps in its scratch (symbols, their
    /// tables, values, escapes, words, block places, sealed bytes) with `fill` in every byte,
    /// the rest (results, lane records, statuses) zeroed, as a `Gpu` zeroes them.
    fn new(ch: &EncodeChain, fill: u8) -> Self {
        let n = ch.blocks.len();
        let x16 = u16::from_le_bytes([fill; 2]);
        let x32 = u32::from_le_bytes([fill; 4]);
        let mut tables = ch.tables.clone();
        tables.resize(ch.n_tables() * 256, x32);
        HostRun {
            tables,
            symbols: vec![fill; ch.n_symbols],
            symbol_table: vec![x16; ch.n_symbols],
            q: vec![x32 as i32; ch.n_q],
            escapes: vec![x32 as i32; ch.n_q],
            results: vec![EncResult::default(); n],
            lane_blocks: vec![LaneEncodeBlock::default(); n],
            words: vec![x32; ch.n_words],
            lane_len: vec![0; n * LANES],
            lane_status: vec![0; n * LANES],
            block_at: vec![u64::from_le_bytes([fill; 8]); n],
            chunk_results: vec![ChunkResult::default(); ch.chunks.len()],
            sealed: vec![fill; ch.n_sealed()],
            seal_results: vec![SealResult::default(); ch.chunks.len()],
        }
    }

    /// The second launch on the host: `kvc_rans_lane_encode` over the first's records.
    fn lanes_host(&mut self, ch: &EncodeChain) -> Result<(), CudaError> {
        ffi::host_lane_encode(ffi::LaneEncodeIo {
            symbols: &self.symbols,
            symbol_table: &self.symbol_table,
            tables: &self.tables,
            table_list: &ch.table_list,
            words: &mut self.words,
            lane_len: &mut self.lane_len,
            blocks: &self.lane_blocks,
            status: &mut self.lane_status,
        })
    }
}

impl EncodeChain {
    /// Adds `table` with its radius; returns its id.
    fn add_table(&mut self, table: &FreqTable, radius: u8) -> u32 {
        let id = self.radius.len() as u32;
        self.tables.extend(encode_table(table));
        self.radius.push(radius);
        id
    }

    /// Adds the rotations of chunk `tokens`' non-sink rows (per row, per rotary pair its sine
    /// and cosine at the row's position, as codec-core's importance policy rotates them) if the
    /// policy rotates keys; returns where they start.
    fn add_rotations(&mut self, ctx: &ChunkContext<'_>, tokens: &Range<u32>) -> u64 {
        let start = self.rot.len() as u64;
        if self.importance.is_none_or(|p| p.rope_style == 0) {
            return start;
        }
        let d = ctx.shape().head_dim as usize;
        let sink = ctx.sink_rows(tokens.start, tokens.end - tokens.start);
        let first = ctx.position(tokens.start);
        for row in sink..(tokens.end - tokens.start) as usize {
            let pos = first.saturating_add(row as u64) as f64;
            for j in 0..d / 2 {
                let (s, c) = pair_sin_cos(ctx.rope(), d, j, pos);
                self.rot.extend([s, c]);
            }
        }
        start
    }

    /// Adds the tables of `level`, its table maps and channel constants (from `cache`; placed
    /// by `place` if given); returns where they are.
    fn add_level(
        &mut self,
        cache: &LevelCache,
        profile: &Profile,
        level: u8,
        place: &mut Option<Placer<'_>>,
    ) -> Result<ChainLevel, CudaError> {
        let consts = cache
            .get(profile, level)
            .map_err(|what| CudaError::Input { what })?;
        let tables = &profile.level_tables(level).tables;
        let ids = tables
            .iter()
            .map(|t| self.add_table(&t.freqs, t.radius))
            .collect();
        let (map_base, consts_base) = match place.as_mut() {
            Some(place) => place(&profile.hash(), level, &consts)?,
            None => {
                let at = (self.map.len() as u64, self.consts.len() as u64);
                self.map.extend_from_slice(&consts.maps);
                self.consts.extend_from_slice(&consts.consts);
                at
            }
        };
        Ok(ChainLevel {
            ids,
            consts,
            map_base,
            consts_base,
        })
    }

    /// Appends the block at `at` of chunk `tokens`: its table list (a fresh exponent slot, then
    /// the level's tables `level_ids`) and its room in every buffer.
    fn push_block(
        &mut self,
        plan: &EncodePlan<'_, '_>,
        tokens: &Range<u32>,
        level_ids: &[u32],
        at: BlockAt,
    ) -> Result<(), CudaError> {
        let input = |what| CudaError::Input { what };
        let ctx = plan.ctx;
        let shape = ctx.shape();
        let (heads, c) = (shape.kv_heads as usize, shape.channels());
        let rows = tokens.end - tokens.start;
        let sink = ctx.sink_rows(tokens.start, rows);
        let coded = rows as usize - sink;
        let n_all = coded * (heads + c);
        let lane_cap = u32::try_from(n_all.div_ceil(LANES) + 2)
            .map_err(|_| input("over 2^32 symbols in a block"))?;
        let tensor = |kv: u64| {
            let t = u64::from(at.layer) * 2 + kv;
            t.checked_mul(plan.source.tensor_stride)
                .and_then(|x| x.checked_add(plan.source.base))
                .and_then(|x| x.checked_add(u64::from(tokens.start) * c as u64))
                .ok_or(input("source offsets overflow"))
        };
        let (x_start, k_start) = (tensor(at.kv as u64)?, tensor(0)?);
        self.src_elems = self.src_elems.max(x_start + u64::from(rows) * c as u64);
        let table_start = u32::try_from(self.table_list.len())
            .map_err(|_| input("over 2^32 table-list entries"))?;
        // The block's exponent slot, placed after the levels' tables by `place_exponent_slots`.
        self.table_list.push(u32::MAX);
        self.table_list.extend_from_slice(level_ids);
        self.blocks.push(EncBlock {
            x_start,
            k_start,
            qref_start: u64::from(at.layer) * c as u64,
            tau_start: u64::from(at.layer) * heads as u64,
            consts_start: at.consts_start,
            map_start: at.map_start,
            sym_start: self.n_symbols as u64,
            q_start: self.n_q as u64,
            escape_start: self.n_q as u64,
            word_start: self.n_words as u64,
            rot_start: at.rot_start,
            rows,
            sink_rows: sink as u32,
            group: ctx.group() as u32,
            importance: u32::from(self.importance.is_some()),
            table_start,
            table_count: level_ids.len() as u32 + 1,
            lane_cap,
            rotate: u32::from(self.importance.is_some_and(|p| p.rope_style != 0)),
            chunk: at.chunk,
            reserved: 0,
        });
        // The block's largest size: fields, sink rows, an escape per value, full lane slots.
        let sink_bytes = sink * c * plan.source.elem_bytes();
        self.rooms +=
            4 + 4 * LANES + 1 + 2 * 16 + sink_bytes + 4 * coded * c + 4 * LANES * lane_cap as usize;
        self.n_symbols += n_all;
        self.n_q += coded * c;
        self.n_words += lane_cap as usize * LANES;
        Ok(())
    }

    /// Tables of a launch: the levels', then one exponent slot per block.
    pub(crate) fn n_tables(&self) -> usize {
        self.radius.len() + self.blocks.len()
    }

    /// Gives block i's exponent table the slot `levels + i`, after the levels' tables.
    fn place_exponent_slots(&mut self) -> Result<(), CudaError> {
        let levels = self.radius.len();
        for (i, b) in self.blocks.iter().enumerate() {
            let slot = u32::try_from(levels + i).map_err(|_| CudaError::Input {
                what: "over 2^32 tables in a plan",
            })?;
            self.table_list[b.table_start as usize] = slot;
        }
        Ok(())
    }

    /// Whether a source buffer of `bytes` holds every tensor row the chain reads.
    pub(crate) fn check_source_bytes(&self, bytes: usize) -> Result<(), CudaError> {
        let need = self.src_elems.saturating_mul(u64::from(self.elem_bytes));
        if (bytes as u64) < need {
            return Err(CudaError::Input {
                what: "the source buffer is shorter than the plan's tensors",
            });
        }
        Ok(())
    }

    /// `src` as the chain's source on a device.
    pub(crate) fn dev_source<'s, T>(
        &self,
        src: &'s cudarc::driver::CudaSlice<T>,
    ) -> ffi::DevSource<'s, T> {
        ffi::DevSource {
            slice: src,
            dtype: self.src_dtype,
            elem_bytes: self.elem_bytes,
        }
    }

    /// Bytes of the sealed buffer: every chunk's room and its CRC.
    pub(crate) fn n_sealed(&self) -> usize {
        self.rooms + 4 * self.chunks.len()
    }

    /// Where every chunk lies in the sealed buffer (bytes and CRC), from the sealing launch's
    /// results: one after another from 0, each within the buffer.
    pub(crate) fn sealed_places(
        &self,
        results: &[SealResult],
    ) -> Result<Vec<Range<usize>>, CudaError> {
        let mut places = Vec::with_capacity(self.chunks.len());
        let mut at = 0u64;
        for chunk in 0..self.chunks.len() {
            let bad = |what| CudaError::Encode { chunk, what };
            let r = results.get(chunk).ok_or(bad("no result"))?;
            if r.status != 0 {
                return Err(bad("a block's ranges, tables or lanes (a kernel's status)"));
            }
            if r.start != at || r.len < 4 || r.len > self.n_sealed() as u64 - at {
                return Err(bad("the chunk's place in the sealed buffer"));
            }
            places.push(at as usize..(at + r.len) as usize);
            at += r.len;
        }
        Ok(places)
    }
}

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

#[cfg(test)]
mod tests {
    //! Malformed launch records: the kernels (run on the host) give defined statuses and touch
    //! nothing outside their buffers, whatever a block's, a chunk's or a result's fields hold.
    use super::*;
    use crate::levels::PlacedElsewhere;
    use codec_core::{learn_profile, KvCache, KvMeta, KvShape, LearnParams, Queries, Rope};
    use codec_core::{Sample, Tensor};
    use proptest::prelude::*;

    /// A 2-layer f32 cache of 12 tokens (2 heads of 4) with outliers, its profile (learned
    /// with queries: the importance policy is on) and its source bytes.
    fn setup() -> (KvCache, Profile, Vec<u8>) {
        let shape = KvShape {
            layers: 2,
            kv_heads: 2,
            head_dim: 4,
            tokens: 12,
        };
        let t = |s: f32| {
            let x = (0..96).map(|i| (i as f32 * s).sin() * if i % 17 == 0 { 90.0 } else { 1.0 });
            Tensor::F32(x.collect())
        };
        let cache = KvCache {
            shape,
            k: vec![t(0.3), t(0.5)],
            v: vec![t(0.7), t(1.1)],
            meta: KvMeta::default(),
        };
        let q: Vec<f32> = (0..96).map(|i| (i as f32 * 0.9).cos()).collect();
        let queries = Queries {
            q: vec![&q, &q],
            q_heads: 2,
            q_start: 0,
        };
        let sample = Sample {
            kv: cache.view(),
            queries: Some(queries),
        };
        let profile = learn_profile(&[sample], &LearnParams::default()).unwrap();
        let src = [0.3f32, 0.7, 0.5, 1.1]
            .into_iter()
            .flat_map(|s| t(s).to_f32_vec())
            .flat_map(f32::to_le_bytes)
            .collect();
        (cache, profile, src)
    }

    /// Edge values for a field.
    fn wild() -> impl Strategy<Value = u64> {
        prop_oneof![
            Just(0u64),
            Just(1),
            Just(u64::from(u32::MAX)),
            Just(u64::MAX),
            Just(u64::MAX / 4 + 1),
            0u64..4096,
        ]
    }

    /// Sets field `f` (of 18) of `b` to `v` (truncated for 32-bit fields).
    fn set_block_field(b: &mut EncBlock, f: usize, v: u64) {
        let w = v as u32;
        match f {
            0 => b.x_start = v,
            1 => b.k_start = v,
            2 => b.qref_start = v,
            3 => b.tau_start = v,
            4 => b.consts_start = v,
            5 => b.map_start = v,
            6 => b.sym_start = v,
            7 => b.q_start = v,
            8 => b.escape_start = v,
            9 => b.word_start = v,
            10 => b.rows = w,
            11 => b.sink_rows = w,
            12 => b.group = w,
            13 => b.importance = w,
            14 => b.table_start = w,
            15 => b.table_count = w,
            16 => b.lane_cap = w,
            _ => b.chunk = w,
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        #[test]
        fn malformed_records_give_defined_statuses(
            block in 0usize..8,
            field in 0usize..18,
            value in wild(),
            chunk_field in 0usize..4,
            chunk_value in wild(),
            result_field in 0usize..5,
            result_value in wild(),
            lane in 0usize..32,
        ) {
            let (cache, profile, src) = setup();
            let ctx = context(&cache, &profile);
            let mut plan = EncodePlan::new(&ctx, SOURCE).unwrap();
            plan.add_chunk(0..7, 0).unwrap();
            plan.add_chunk(5..12, 1).unwrap();
            let mut ch = plan.chain().unwrap();
            set_block_field(&mut ch.blocks[block], field, value);
            let mut run = HostRun::new(&ch, 0);
            plan.blocks_host(&ch, &src, &mut run).unwrap();
            prop_assert!(run.results.iter().all(|r| r.status <= 2));
            run.lanes_host(&ch).unwrap();
            prop_assert!(run.lane_status.iter().all(|&s| s <= 2));
            // Results and lane lengths as a malformed launch might leave them.
            let r = &mut run.results[block];
            let w = result_value as u32;
            match result_field {
                0 => r.status = w,
                1 => r.n_escapes = w,
                2 => r.n_exp = w,
                3 => run.lane_len[block * LANES + lane] = w,
                _ => {}
            }
            let c = &mut ch.chunks[block / 4];
            match chunk_field {
                0 => c.first_block = chunk_value,
                1 => c.cap = chunk_value,
                2 => c.n_blocks = chunk_value as u32,
                _ => {}
            }
            plan.write_host(&ch, &src, &mut run).unwrap();
            for (c, r) in ch.chunks.iter().zip(&run.chunk_results) {
                prop_assert!(r.status <= 1);
                prop_assert!(r.status != 0 || r.len <= c.cap);
            }
            for (c, r) in run.chunk_results.iter().zip(&run.seal_results) {
                prop_assert!(r.status <= 1);
                prop_assert!(r.status != 0 || r.len == c.len + 4);
                prop_assert!(r.start.saturating_add(r.len) <= ch.n_sealed() as u64);
            }
        }

        /// The last three launches against a plain writer of §5.2's block layout and a second
        /// CRC-32C (the `crc` crate): every chunk whose blocks all ended well and whose body
        /// fits its room, after the ones before it, its CRC after it; the others left out.
        /// Blocks of any size (no lane words to hundreds, sink rows, escapes, exponent
        /// tables), chunks of 0-4 blocks, the kept outputs filled with garbage first.
        #[test]
        fn written_chunks_are_a_plain_writers_with_their_crcs(
            chunks in prop::collection::vec(
                (prop::collection::vec(any_block(), 0..5), 0u64..4),
                1..6,
            ),
            seed in any::<u64>(),
        ) {
            let mut w = SyntheticWrite::new(seed);
            for (blocks, room) in &chunks {
                w.add_chunk(blocks, *room);
            }
            let crc32c = crc::Crc::<u32>::new(&crc::CRC_32_ISCSI);
            let got = w.run();
            let mut at = 0usize;
            for (c, want) in w.want.iter().enumerate() {
                let r = &got.seal_results[c];
                prop_assert_eq!(r.start, at as u64);
                let Some(body) = want else {
                    prop_assert_eq!((r.len, r.status), (0, 1));
                    continue;
                };
                prop_assert_eq!((r.len, r.status), (body.len() as u64 + 4, 0));
                prop_assert_eq!(&got.sealed[at..at + body.len()], &body[..]);
                let crc = crc32c.checksum(body).to_le_bytes();
                prop_assert_eq!(&got.sealed[at + body.len()..at + body.len() + 4], &crc[..]);
                at += body.len() + 4;
            }
        }
    }

    /// A synthetic block for [`SyntheticWrite`]: sink rows, escapes, exponent symbols (1
    /// stands for none), words per lane (up to the lane's room), and how it ends (0: its
    /// result failed, 1: a lane failed, else well).
    type AnyBlock = (u32, u32, u32, Vec<u32>, u32);

    fn any_block() -> impl Strategy<Value = AnyBlock> {
        (0u32..3, 0u32..40, 0u32..17, 0u32..12).prop_flat_map(|(sink, esc, exp, cap)| {
            let lanes = prop::collection::vec(0..=cap, 32);
            (Just(sink), Just(esc), Just(exp), lanes, 0u32..12)
        })
    }

    /// The inputs of the last three launches built by hand, and what a plain writer makes of
    /// each chunk (`None` if it is left out).
    struct SyntheticWrite {
        rng: u64,
        src: Vec<u8>,
        blocks: Vec<EncBlock>,
        results: Vec<EncResult>,
        escapes: Vec<i32>,
        words: Vec<u32>,
        lane_len: Vec<u32>,
        lane_status: Vec<u32>,
        chunks: Vec<ChunkOut>,
        want: Vec<Option<Vec<u8>>>,
    }

    /// What the launches leave: the sealed buffer and the seal results.
    struct Written {
        sealed: Vec<u8>,
        seal_results: Vec<SealResult>,
    }

    /// Channels of the synthetic blocks (one head of 4), bytes per source element.
    const SYN_C: u32 = 4;
    const SYN_ELEM: usize = 2;

    impl SyntheticWrite {
        fn new(seed: u64) -> Self {
            let mut w = SyntheticWrite {
                rng: seed | 1,
                src: Vec::new(),
                blocks: Vec::new(),
                results: Vec::new(),
                escapes: Vec::new(),
                words: Vec::new(),
                lane_len: Vec::new(),
                lane_status: Vec::new(),
                chunks: Vec::new(),
                want: Vec::new(),
            };
            w.src = (0..64 * SYN_C as usize * SYN_ELEM)
                .map(|_| w.next() as u8)
                .collect();
            w
        }

        /// A xorshift step.
        fn next(&mut self) -> u32 {
            self.rng ^= self.rng << 13;
            self.rng ^= self.rng >> 7;
            self.rng ^= self.rng << 17;
            (self.rng >> 32) as u32
        }

        /// Adds a chunk of `blocks`; its room is its body's length, one byte less (`room`
        /// 0) or more.
        fn add_chunk(&mut self, blocks: &[AnyBlock], room: u64) {
            let first_block = self.blocks.len() as u64;
            let mut body = Some(Vec::new());
            for b in blocks {
                let bytes = self.add_block(b, self.chunks.len() as u32);
                body = body.zip(bytes).map(|(mut body, bytes)| {
                    body.extend(bytes);
                    body
                });
            }
            let len = body.as_ref().map_or(0, |b| b.len() as u64);
            let cap = if room == 0 {
                len.saturating_sub(1)
            } else {
                len + room
            };
            self.want.push(body.filter(|b| b.len() as u64 <= cap));
            self.chunks.push(ChunkOut {
                first_block,
                cap,
                n_blocks: blocks.len() as u32,
                reserved: 0,
            });
        }

        /// Adds a block of chunk `chunk`; returns its bytes as §5.2 lays them out, if it
        /// ends well.
        fn add_block(&mut self, b: &AnyBlock, chunk: u32) -> Option<Vec<u8>> {
            let (sink, n_escapes, exp, lens, ends) = b;
            let n_exp = if *exp == 1 { 0 } else { *exp };
            let lane_cap = lens.iter().copied().max().unwrap_or(0) + ends % 3;
            let x_row = self.next() % (64 - sink);
            let mut freqs = [0u16; 16];
            freqs.iter_mut().for_each(|f| *f = self.next() as u16);
            let block = EncBlock {
                x_start: u64::from(x_row * SYN_C),
                escape_start: self.escapes.len() as u64,
                word_start: self.words.len() as u64,
                sink_rows: *sink,
                lane_cap,
                chunk,
                ..EncBlock::default()
            };
            let result = EncResult {
                status: u32::from(*ends == 0),
                n_escapes: *n_escapes,
                n_exp,
                exp_freqs: freqs,
                ..EncResult::default()
            };
            for _ in 0..*n_escapes {
                let e = self.next() as i32;
                self.escapes.push(e);
            }
            for _ in 0..lane_cap as usize * LANES {
                let w = self.next();
                self.words.push(w);
            }
            self.lane_len.extend(lens);
            let failed_lane = (self.next() % 32) as usize;
            self.lane_status
                .extend((0..LANES).map(|l| u32::from(*ends == 1 && l == failed_lane)));
            self.blocks.push(block);
            self.results.push(result);
            (*ends > 1).then(|| self.plain_block(&block, &result, lens))
        }

        /// A block's bytes written plainly: n_escapes, the lane lengths, n_exp and the
        /// exponent table, the sink rows' stored bytes, the escape values, the lane words.
        fn plain_block(&self, b: &EncBlock, r: &EncResult, lens: &[u32]) -> Vec<u8> {
            let mut o = r.n_escapes.to_le_bytes().to_vec();
            lens.iter().for_each(|l| o.extend(l.to_le_bytes()));
            o.push(r.n_exp as u8);
            let freqs = &r.exp_freqs[..r.n_exp as usize];
            freqs.iter().for_each(|f| o.extend(f.to_le_bytes()));
            let x = b.x_start as usize * SYN_ELEM;
            o.extend(&self.src[x..x + (b.sink_rows * SYN_C) as usize * SYN_ELEM]);
            let escapes = &self.escapes[b.escape_start as usize..][..r.n_escapes as usize];
            escapes.iter().for_each(|e| o.extend(e.to_le_bytes()));
            for (l, &n) in lens.iter().enumerate() {
                let first = b.word_start as usize + l * b.lane_cap as usize;
                let lane = &self.words[first..first + n as usize];
                lane.iter().for_each(|w| o.extend(w.to_le_bytes()));
            }
            o
        }

        /// The three launches on the host, over outputs holding garbage.
        fn run(&self) -> Written {
            let rooms: u64 = self.chunks.iter().map(|c| c.cap).sum();
            let mut sealed = vec![0xA5; rooms as usize + 4 * self.chunks.len()];
            let mut seal_results = vec![SealResult::default(); self.chunks.len()];
            let mut block_at = vec![0x5A5A_5A5A_5A5A_5A5A; self.blocks.len()];
            let mut chunk_results = vec![ChunkResult::default(); self.chunks.len()];
            ffi::host_write_chunks(ffi::WriteIo {
                src: &self.src,
                elem_bytes: SYN_ELEM as u32,
                heads: 1,
                head_dim: SYN_C,
                blocks: &self.blocks,
                results: &self.results,
                escapes: &self.escapes,
                words: &self.words,
                lane_len: &self.lane_len,
                lane_status: &self.lane_status,
                block_at: &mut block_at,
                chunks: &self.chunks,
                chunk_results: &mut chunk_results,
                sealed: &mut sealed,
                seal_results: &mut seal_results,
            })
            .unwrap();
            Written {
                sealed,
                seal_results,
            }
        }
    }

    /// The chunk context of [`setup`]'s cache (importance policy on: queries at 12).
    fn context<'p>(cache: &KvCache, profile: &'p Profile) -> ChunkContext<'p> {
        ChunkContext::new(cache.shape, Dtype::F32, 0, 3, 2, profile, Rope::default())
            .unwrap()
            .with_query_position(Some(12))
    }

    /// [`setup`]'s source bytes: f32, every tensor 96 elements after the one before.
    const SOURCE: Source = Source {
        dtype: Dtype::F32,
        base: 0,
        tensor_stride: 96,
    };

    /// Unaltered records: every block and chunk ends well (the test above alters one of each).
    #[test]
    fn intact_records_end_well() {
        let (cache, profile, src) = setup();
        let ctx = context(&cache, &profile);
        let mut plan = EncodePlan::new(&ctx, SOURCE).unwrap();
        plan.add_chunk(0..7, 0).unwrap();
        plan.add_chunk(5..12, 1).unwrap();
        let got = plan.encode_host(&src).unwrap();
        assert_eq!(got[1], ctx.encode_chunk(&cache.view(), 5..12, 1).unwrap());
    }

    /// Chunks copied into vectors on any thread count are the chunks, in order.
    #[test]
    fn chunks_copied_on_threads_are_the_chunks() {
        let big: Vec<u8> = (0..3 << 20).map(|i| (i * 7 % 251) as u8).collect();
        let cuts = [0, 5, 5, 700_000, 1 << 20, 1_500_001, 3 << 20];
        let chunks: Vec<&[u8]> = cuts.windows(2).map(|w| &big[w[0]..w[1]]).collect();
        for threads in [1, 2, 3, 4, 6, 7, 64] {
            let got = copy_chunks(&chunks, threads);
            assert!(
                got.iter().map(Vec::as_slice).eq(chunks.iter().copied()),
                "{threads}"
            );
        }
        assert!(copy_chunks(&[], 4).is_empty());
        assert_eq!(copy_chunks(&[&[1, 2][..], &[]], 2), [vec![1, 2], vec![]]);
    }

    /// The copy-back parts of chunks one after another: runs of whole chunks from the first
    /// to the last, none empty, at most as many as asked, as many where the chunks are
    /// equal and enough, each within a chunk of its equal share of the bytes.
    #[test]
    fn copy_back_parts_are_runs_of_about_equal_bytes() {
        let places = |lens: &[usize]| -> Vec<Range<usize>> {
            let mut at = 0;
            lens.iter()
                .map(|&n| {
                    at += n;
                    at - n..at
                })
                .collect()
        };
        assert_eq!(part_starts(&[], 4), [0, 0]);
        assert_eq!(part_starts(&places(&[9]), 4), [0, 1]);
        assert_eq!(part_starts(&places(&[10; 10]), 4), [0, 3, 5, 8, 10]);
        assert_eq!(part_starts(&places(&[10; 8]), 0), [0, 8]);
        let cases: [&[usize]; 4] = [
            &[1, 1000, 1, 1],
            &[0, 0, 5, 0, 7],
            &[3; 17],
            &[500, 1, 1, 1],
        ];
        for lens in cases {
            let p = places(lens);
            let total = p.last().map_or(0, |r| r.end);
            let largest = lens.iter().max().copied().unwrap_or(0);
            for parts in 1..8 {
                let starts = part_starts(&p, parts);
                assert_eq!((starts[0], *starts.last().unwrap()), (0, p.len()));
                assert!(starts.windows(2).all(|w| w[0] < w[1]), "{lens:?} {parts}");
                assert!(starts.len() - 1 <= parts, "{lens:?} {parts}");
                for (k, &c) in starts[1..starts.len() - 1].iter().enumerate() {
                    let end = p[c - 1].end;
                    let share = total * (k + 1) / parts;
                    assert!(end + largest >= share && end <= share + largest, "{lens:?}");
                }
            }
        }
    }

    /// A plan cut into pieces of about so many blocks: runs of whole chunks, in order, of
    /// about equal blocks, none empty; each piece's chain run on the host alone seals its
    /// chunks as the whole plan's chain does, so the pieces' chunks in order are the plan's.
    #[test]
    fn pieces_encode_to_the_whole_plans_chunks() {
        let (cache, profile, src) = setup();
        let ctx = context(&cache, &profile);
        let mut plan = EncodePlan::new(&ctx, SOURCE).unwrap();
        for i in 0..6u32 {
            plan.add_chunk(i..12 - i, (i % 3) as u8).unwrap();
        }
        let want = plan.encode_host(&src).unwrap();
        // 6 chunks of 2 layers' K and V: 24 blocks.
        for (piece_blocks, n) in [(0, 1), (24, 1), (100, 1), (12, 2), (8, 3), (5, 5), (1, 6)] {
            let pieces = plan.pieces(piece_blocks);
            assert_eq!(pieces.len(), n, "{piece_blocks} blocks a piece: {pieces:?}");
            assert_eq!(pieces.first().map(|p| p.start), Some(0));
            assert_eq!(pieces.last().map(|p| p.end), Some(plan.chunks()));
            assert!(pieces.windows(2).all(|w| w[0].end == w[1].start));
            let sizes: Vec<usize> = pieces.iter().map(ExactSizeIterator::len).collect();
            assert!(
                sizes.iter().all(|&s| s > 0 && s.abs_diff(sizes[0]) <= 1),
                "{sizes:?}"
            );
            let mut got = Vec::new();
            for p in pieces {
                let ch = plan.chain_of(&LevelCache::default(), p).unwrap();
                got.extend(plan.run_chain_host(&ch, &src, 0xA5).unwrap());
            }
            assert!(got == want, "{piece_blocks} blocks a piece");
        }
        let past = plan.chain_of(&LevelCache::default(), 5..7);
        assert!(matches!(past, Err(CudaError::Input { .. })));
        let empty = EncodePlan::new(&ctx, SOURCE).unwrap();
        for piece_blocks in [0, 8] {
            assert_eq!(empty.pieces(piece_blocks), vec![0..0]);
        }
    }

    /// Level constants placed elsewhere (after other constants, as a `Gpu` keeps them resident
    /// on its device): the chain's blocks point at them, and the launches over those arrays
    /// write the chain's own chunks.
    #[test]
    fn placed_level_constants_encode_as_the_chains_own() {
        let (cache, profile, src) = setup();
        let ctx = context(&cache, &profile);
        let mut plan = EncodePlan::new(&ctx, SOURCE).unwrap();
        for (tokens, level) in [(0..4, 0), (4..12, 1), (0..12, 0), (9..12, 2)] {
            plan.add_chunk(tokens, level).unwrap();
        }
        let want = plan.encode_host(&src).unwrap();
        let mut elsewhere = PlacedElsewhere::new();
        let mut place = |h: &[u8; 32], l: u8, c: &Arc<LevelConsts>| elsewhere.place(h, l, c);
        let cache = LevelCache::default();
        let mut ch = plan
            .chain_placed(&cache, 0..plan.chunks(), Some(&mut place))
            .unwrap();
        assert!(ch.map.is_empty() && ch.consts.is_empty());
        assert_eq!(elsewhere.levels(), 3);
        (ch.map, ch.consts) = (elsewhere.maps, elsewhere.consts);
        assert_eq!(plan.run_chain_host(&ch, &src, 0).unwrap(), want);
    }

    /// Table lists longer than the radii `kvc_encode_blocks` keeps in shared memory (256
    /// entries): each block's list given 256 more entries before its level's tables (the maps'
    /// indices moved past them), the radii of the indices past 256 read from device memory: the
    /// same chunks.
    #[test]
    fn long_table_lists_encode_the_same_chunks() {
        let (cache, profile, src) = setup();
        let ctx = context(&cache, &profile);
        let mut plan = EncodePlan::new(&ctx, SOURCE).unwrap();
        plan.add_chunk(0..12, 0).unwrap();
        plan.add_chunk(3..9, 2).unwrap();
        let want = plan.encode_host(&src).unwrap();
        let mut ch = plan.chain().unwrap();
        let old = std::mem::take(&mut ch.table_list);
        for b in &mut ch.blocks {
            let list = &old[b.table_start as usize..][..b.table_count as usize];
            b.table_start = ch.table_list.len() as u32;
            b.table_count += 256;
            ch.table_list.push(list[0]);
            ch.table_list.extend(std::iter::repeat_n(list[1], 256));
            ch.table_list.extend_from_slice(&list[1..]);
        }
        ch.map.iter_mut().for_each(|i| *i += 256);
        assert_eq!(plan.run_chain_host(&ch, &src, 0).unwrap(), want);
    }

    /// The launches read none of their large outputs before writing them: whatever those
    /// buffers hold before the first launch (a `Gpu` keeps them from call to call, unzeroed),
    /// the chunks are codec-core's, byte for byte.
    #[test]
    fn chunks_do_not_depend_on_what_the_kept_outputs_held() {
        let (cache, profile, src) = setup();
        let ctx = context(&cache, &profile);
        let mut plan = EncodePlan::new(&ctx, SOURCE).unwrap();
        let chunks = [(0..4, 0), (4..12, 1), (0..12, 2), (9..12, 0)];
        for (tokens, level) in chunks.iter().cloned() {
            plan.add_chunk(tokens, level).unwrap();
        }
        let want: Vec<Vec<u8>> = chunks
            .iter()
            .map(|(t, l)| ctx.encode_chunk(&cache.view(), t.clone(), *l).unwrap())
            .collect();
        for fill in [0x00, 0x01, 0x5A, 0xA5, 0x80, 0xFF] {
            assert_eq!(
                plan.encode_host_over(&src, fill).unwrap(),
                want,
                "fill {fill:#x}"
            );
        }
    }
}
