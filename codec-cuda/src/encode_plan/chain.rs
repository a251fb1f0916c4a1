//! A plan's encode chain laid out on the host ([`EncodeChain`]): every coded block's launch
//! records, tables, level constants and rotations, and where each chunk's bytes land.

use std::collections::hash_map::{Entry, HashMap};
use std::ops::Range;
use std::sync::Arc;

use codec_core::importance::reference_queries;
use codec_core::rans::FreqTable;
use codec_core::rope::pair_sin_cos;
use codec_core::{ChunkContext, Profile, RopeStyle};

use crate::encode::encode_table;
use crate::error::CudaError;
use crate::ffi::{self, LANES};
use crate::levels::{time_builds, time_placed_builds, LevelCache, LevelConsts, Placer};
use crate::quant::ChannelConsts;

use super::EncodePlan;

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

impl<'c, 'p> EncodePlan<'c, 'p> {
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
