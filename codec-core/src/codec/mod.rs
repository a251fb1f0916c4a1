//! The container: header, chunk index, chunks and blocks (`spec/FORMAT.md`, "Container"), and
//! the encode/decode API.
//!
//! ```text
//! stream  = header | [embedded profile] | chunk 0 | chunk 1 | ...
//! header  = fixed fields | model id | chunk index (24 bytes per chunk) | CRC-32C
//! chunk   = block(layer 0, K) | block(layer 0, V) | block(layer 1, K) | ... | CRC-32C
//! block   = n_escapes u32 | lane word counts 32 x u32 | sink rows | escapes i32 | lane words
//! ```

mod bound;
mod header;

pub use bound::{max_block_words, max_encoded_len, max_lane_words, BLOCK_FIXED_MAX};
pub use header::{
    ChunkEntry, Header, HEADER_FIXED_LEN, INDEX_ENTRY_LEN, STREAM_MAGIC, STREAM_VERSION,
};

use crate::bytes::{crc32c, PutLe, Reader};
use crate::error::{DecodeError, EncodeError, Kv};
use crate::importance::{block_exponents, reference_queries, MAX_EXP};
use crate::kv::{Dtype, KvCache, KvShape, KvView, TensorMut, TensorRef};
use crate::limits::{Limits, MAX_GROUP};
use crate::profile::Profile;
use crate::quant::{
    dequantize_indices, dequantize_one, quantize_block, BlockConsts, Exps, MAX_SYMBOL,
};
use crate::rans::{encode_lanes_into, DecodeTable, FreqTable, LaneDecoder, LANES};
use alloc::borrow::Cow;
use alloc::vec;
use alloc::vec::Vec;
use core::ops::Range;

/// Default chunk size in tokens (CacheGen's ~1.5K).
pub const DEFAULT_CHUNK_TOKENS: u32 = 1536;
/// Default token-group size.
pub const DEFAULT_GROUP: u32 = 10;
/// Default number of sink tokens stored exactly.
pub const DEFAULT_SINK: u16 = 1;

/// How the stream refers to its profile.
#[derive(Clone, Copy, Debug)]
pub enum ProfileMode<'a> {
    /// The stream carries only the profile's hash; decoding needs the same profile.
    Referenced(&'a Profile),
    /// The stream embeds the profile and decodes alone (self-contained). What is embedded is
    /// the profile without its importance hints ([`Profile::without_importance`]), which
    /// decoding never reads; the stream's profile hash is that profile's.
    Embedded(&'a Profile),
}

impl<'a> ProfileMode<'a> {
    fn profile(&self) -> &'a Profile {
        match self {
            ProfileMode::Referenced(p) | ProfileMode::Embedded(p) => p,
        }
    }
}

/// Encoding parameters.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EncodeParams {
    /// Tokens per chunk.
    pub chunk_tokens: u32,
    /// Tokens per group (anchor + deltas).
    pub group: u32,
    /// Tokens at absolute positions below this are stored exactly.
    pub n_sink: u16,
    /// Level of each chunk; a single entry applies to all chunks.
    pub levels: Vec<u8>,
    /// Give tokens that future queries will barely read coarser steps ([`crate::importance`]),
    /// when the profile carries the hints for it.
    pub token_importance: bool,
}

impl Default for EncodeParams {
    fn default() -> Self {
        EncodeParams {
            chunk_tokens: DEFAULT_CHUNK_TOKENS,
            group: DEFAULT_GROUP,
            n_sink: DEFAULT_SINK,
            levels: vec![7],
            token_importance: true,
        }
    }
}

/// Checks a view's tensors against its shape and for non-finite values.
pub(crate) fn check_view(view: &KvView<'_>) -> Result<(), EncodeError> {
    let n = view.shape.tensor_len();
    if view.k.len() != view.shape.layers as usize || view.v.len() != view.shape.layers as usize {
        return Err(EncodeError::ShapeMismatch {
            what: "number of layers",
        });
    }
    if view.shape.layers == 0 || view.shape.kv_heads == 0 || view.shape.head_dim == 0 {
        return Err(EncodeError::ShapeMismatch {
            what: "zero dimension",
        });
    }
    let dtype = view.k[0].dtype();
    for (i, (k, v)) in view.k.iter().zip(&view.v).enumerate() {
        if k.len() != n || v.len() != n {
            return Err(EncodeError::ShapeMismatch {
                what: "tensor length is not tokens * kv_heads * head_dim",
            });
        }
        if k.dtype() != dtype || v.dtype() != dtype {
            return Err(EncodeError::ShapeMismatch {
                what: "tensors of mixed dtypes",
            });
        }
        for (t, kv) in [(k, Kv::K), (v, Kv::V)] {
            let finite = match t {
                TensorRef::F16(s) => s.iter().all(|x| x.is_finite()),
                TensorRef::Bf16(s) => s.iter().all(|x| x.is_finite()),
                TensorRef::F32(s) => s.iter().all(|x| x.is_finite()),
            };
            if !finite {
                return Err(EncodeError::NonFinite {
                    layer: i as u32,
                    kv,
                });
            }
        }
    }
    Ok(())
}

/// Number of leading rows of a chunk that are sinks.
fn sink_rows(n_sink: u16, first_position: u64, token_start: u32, rows: u32) -> usize {
    let pos = first_position.saturating_add(token_start as u64);
    (n_sink as u64).saturating_sub(pos).min(rows as u64) as usize
}

/// Everything a chunk encoder or decoder needs besides the chunk itself.
#[derive(Clone, Debug)]
pub struct ChunkContext<'p> {
    /// Shape of the whole stream.
    pub shape: KvShape,
    /// Dtype of the source (sink rows are stored in it).
    pub dtype: Dtype,
    /// Absolute position of the stream's first token.
    pub first_position: u64,
    /// Group size.
    pub group: u32,
    /// Sink count.
    pub n_sink: u16,
    /// The profile.
    pub profile: &'p Profile,
    /// Rotary settings of the cache (the encoder's importance policy rotates with them).
    pub rope: crate::kv::Rope,
    /// Encoder only: absolute position of the queries that will read the cache (usually the
    /// position after the stream's last token), or `None` for uniform steps. Importance needs a
    /// profile with [`crate::profile::Importance`] hints; without them steps stay uniform.
    pub query_position: Option<u64>,
}

impl ChunkContext<'_> {
    fn check(&self) -> Result<(), EncodeError> {
        let p = self.profile;
        if (p.layers(), p.kv_heads(), p.head_dim())
            != (self.shape.layers, self.shape.kv_heads, self.shape.head_dim)
        {
            return Err(EncodeError::ProfileShape);
        }
        if self.group == 0 || self.group > MAX_GROUP {
            return Err(EncodeError::InvalidParam {
                what: "group",
                got: self.group as u64,
            });
        }
        Ok(())
    }

    /// Encodes tokens `tokens` of `view` at `level` into a chunk (blocks and CRC), the unit a
    /// streamer sends. `view` must have this context's shape except for its token count.
    pub fn encode_chunk(
        &self,
        view: &KvView<'_>,
        tokens: Range<u32>,
        level: u8,
    ) -> Result<Vec<u8>, EncodeError> {
        self.check()?;
        if level >= self.profile.levels() {
            return Err(EncodeError::UnknownLevel {
                level,
                levels: self.profile.levels(),
            });
        }
        if tokens.start >= tokens.end || tokens.end > view.shape.tokens {
            return Err(EncodeError::InvalidParam {
                what: "chunk token range",
                got: tokens.end as u64,
            });
        }
        let c = self.shape.channels();
        let rows = (tokens.end - tokens.start) as usize;
        let sink = sink_rows(self.n_sink, self.first_position, tokens.start, rows as u32);
        let group = self.group as usize;
        let level_tables = self.profile.level_tables(level);
        let mult = self.profile.level_multipliers()[level as usize];
        let mut out = Vec::new();
        let mut x = vec![0f32; rows * c];
        let mut recon = vec![0f32; rows * c];
        let mut symbols: Vec<i32> = Vec::with_capacity(rows * c);
        let mut indices: Vec<u8> = Vec::with_capacity(rows * c);
        let mut escapes: Vec<i32> = Vec::new();
        let mut exps: Vec<u8> = Vec::new();
        let mut consts = BlockConsts::default();
        let d = self.shape.head_dim as usize;
        let heads = self.shape.kv_heads as usize;
        let importance = self
            .query_position
            .and_then(|pos| self.profile.importance().map(|imp| (pos, imp)));
        let mut lanes: [Vec<u32>; LANES] = core::array::from_fn(|_| Vec::new());
        let mut block_ids: Vec<u8> = Vec::new();
        let mut tids: Vec<u8> = Vec::new();
        for layer in 0..self.shape.layers {
            exps.clear();
            // Whether `x` already holds this layer's K (read for the importance scores).
            let mut k_in_x = false;
            if let Some((pos, imp)) = importance {
                let kt = view.k[layer as usize];
                kt.read_f32(tokens.start as usize * c, &mut x);
                k_in_x = true;
                let qm = &imp.query_mean[layer as usize * c..(layer as usize + 1) * c];
                let qref = reference_queries(qm, d, pos, &self.rope);
                block_exponents(
                    &x,
                    c,
                    d,
                    sink,
                    self.first_position.saturating_add(tokens.start as u64),
                    &qref,
                    &imp.tau[layer as usize * heads..(layer as usize + 1) * heads],
                    &self.rope,
                    &imp.params,
                    &mut exps,
                );
                if exps.iter().all(|&e| e == 0) {
                    exps.clear();
                }
            }
            // Non-empty exps hold a nonzero exponent, so the alphabet has at least 2 symbols.
            let n_exp = exps.iter().max().map_or(0, |&m| m as usize + 1);
            let exp_table = (n_exp > 0).then(|| {
                let mut counts = [0u64; 16];
                exps.iter().for_each(|&e| counts[e as usize] += 1);
                FreqTable::from_counts(&counts[..n_exp])
            });
            for (kvi, t) in [view.k[layer as usize], view.v[layer as usize]]
                .into_iter()
                .enumerate()
            {
                if !(kvi == 0 && k_in_x) {
                    t.read_f32(tokens.start as usize * c, &mut x);
                }
                consts.fill(self.profile.channel_params(layer, kvi), mult);
                symbols.clear();
                let ex = Exps {
                    exps: &exps,
                    head_dim: d,
                };
                quantize_block(&x, &consts, group, sink, ex, &mut symbols, &mut recon);
                let maps = [
                    self.profile.table_map(level, layer, kvi, 0),
                    self.profile.table_map(level, layer, kvi, 1),
                ];
                // Table id of every value symbol (row-major over the non-sink rows): resolve
                // each (kind, exponent, channel) once, then copy a head's slice per row.
                let n_el = n_exp.max(1);
                block_ids.clear();
                for map in maps {
                    for e in 0..n_el {
                        block_ids.extend(
                            map.iter()
                                .map(|&t| self.profile.table_at(level, t, e as u8)),
                        );
                    }
                }
                tids.clear();
                tids.resize(symbols.len(), 0);
                for (i, row_ids) in tids.chunks_exact_mut(c).enumerate() {
                    let kind = usize::from(!(sink + i).is_multiple_of(group));
                    for (h, ids) in row_ids.chunks_exact_mut(d).enumerate() {
                        let e = exps.get(i * heads + h).map_or(0, |&e| e as usize);
                        let from = (kind * n_el + e) * c + h * d;
                        ids.copy_from_slice(&block_ids[from..from + d]);
                    }
                }
                indices.clear();
                indices.extend_from_slice(&exps);
                escapes.clear();
                for (&s, &t) in symbols.iter().zip(&tids) {
                    let table = &level_tables.tables[t as usize];
                    if s.unsigned_abs() <= table.radius as u32 {
                        indices.push((s + table.radius as i32) as u8);
                    } else {
                        indices.push(table.escape());
                        escapes.push(s);
                    }
                }
                let n_e = exps.len();
                let table_of = |i: usize| -> &FreqTable {
                    match &exp_table {
                        Some(et) if i < n_e => et,
                        _ => &level_tables.tables[tids[i - n_e] as usize].freqs,
                    }
                };
                encode_lanes_into(&indices, table_of, &mut lanes);
                out.put_u32(escapes.len() as u32);
                for l in &lanes {
                    out.put_u32(l.len() as u32);
                }
                out.put_u8(n_exp as u8);
                if let Some(et) = &exp_table {
                    for f in et.freqs() {
                        out.put_u16(*f);
                    }
                }
                write_rows(&mut out, t, tokens.start as usize * c, sink * c);
                for e in &escapes {
                    out.extend_from_slice(&e.to_le_bytes());
                }
                for l in &lanes {
                    for w in l {
                        out.put_u32(*w);
                    }
                }
            }
        }
        let crc = crc32c(&out);
        out.put_u32(crc);
        Ok(out)
    }

    /// Decodes one chunk (as produced by [`ChunkContext::encode_chunk`]) holding `rows` tokens
    /// starting at stream token `token_start`, at `level`, calling `sink(layer, kv, values)` with
    /// each block's reconstruction (`rows * channels` f32 values; sink rows are passed as their
    /// stored values widened to f32, and their raw bytes through `raw_sink`).
    /// `chunk_id` only labels errors.
    ///
    /// A block is passed on only once it has passed every check of `spec/FORMAT.md` §5; on an
    /// error, the blocks before the failing one have been passed on.
    #[allow(clippy::too_many_arguments)]
    pub fn decode_chunk(
        &self,
        chunk: &[u8],
        chunk_id: u32,
        token_start: u32,
        rows: u32,
        level: u8,
        out: impl FnMut(u32, Kv, &[f32], &[u8]),
    ) -> Result<(), DecodeError> {
        let mut collect = BlockCollect {
            block: Vec::new(),
            out,
        };
        self.decode_chunk_rows(chunk, chunk_id, token_start, rows, level, &mut collect)
    }

    /// The decoder of [`decode_chunk`](Self::decode_chunk), passing the reconstruction on one
    /// token group at a time (so it is still in the first-level cache when the caller converts
    /// it) and each block's raw sink bytes once the block has passed its checks.
    fn decode_chunk_rows(
        &self,
        chunk: &[u8],
        chunk_id: u32,
        token_start: u32,
        rows: u32,
        level: u8,
        out: &mut impl RowSink,
    ) -> Result<(), DecodeError> {
        // The context's fields are public: check what the stream header would have.
        if self.group == 0 || self.group > MAX_GROUP {
            return Err(DecodeError::InvalidField {
                what: "group",
                got: u64::from(self.group),
            });
        }
        let p = self.profile;
        if (p.layers(), p.kv_heads(), p.head_dim())
            != (self.shape.layers, self.shape.kv_heads, self.shape.head_dim)
        {
            return Err(DecodeError::ProfileShape);
        }
        if level >= self.profile.levels() {
            return Err(DecodeError::UnknownLevel {
                level,
                levels: self.profile.levels(),
            });
        }
        if chunk.len() < 4 {
            return Err(DecodeError::Truncated {
                what: "chunk",
                needed: 4,
                available: chunk.len() as u64,
            });
        }
        let body = &chunk[..chunk.len() - 4];
        let stored = u32::from_le_bytes([
            chunk[body.len()],
            chunk[body.len() + 1],
            chunk[body.len() + 2],
            chunk[body.len() + 3],
        ]);
        let computed = crc32c(body);
        if stored != computed {
            return Err(DecodeError::ChunkCrc {
                chunk: chunk_id,
                stored,
                computed,
            });
        }
        let c = self.shape.channels();
        let rows = rows as usize;
        let sink = sink_rows(self.n_sink, self.first_position, token_start, rows as u32);
        let n_sym = (rows - sink) * c;
        let group = self.group as usize;
        let dsize = self.dtype.size_bytes();
        let mult = self.profile.level_multipliers()[level as usize];
        let level_tables = self.profile.level_tables(level);
        let dec_tables = self.profile.decode_tables(level);
        let mut r = Reader::new(body, "chunk block");
        let d = self.shape.head_dim as usize;
        let heads = self.shape.kv_heads as usize;
        let n_exps = (rows - sink) * heads;
        // One token group's reconstruction: a delta row needs only its group's anchor row.
        let mut recon = vec![0f32; group.min(rows) * c];
        let mut indices = vec![0u8; c];
        let mut exps = vec![0u8; n_exps];
        let mut words: Vec<u32> = Vec::new();
        let mut consts = BlockConsts::default();
        let mut row_tables: Vec<&DecodeTable> = Vec::with_capacity(c);
        // Per head, the offset in `block_tables` its slice of `row_tables` was copied from.
        let mut head_from = vec![usize::MAX; heads];
        let mut block_tables: Vec<&DecodeTable> = Vec::new();
        let mut block_radii: Vec<i32> = Vec::new();
        for layer in 0..self.shape.layers {
            for (kvi, kv) in [Kv::K, Kv::V].into_iter().enumerate() {
                let n_escapes = r.u32()? as usize;
                if n_escapes > n_sym {
                    return Err(DecodeError::LimitExceeded {
                        what: "escape count",
                        got: n_escapes as u64,
                        max: n_sym as u64,
                    });
                }
                let mut lane_len = [0usize; LANES];
                let mut total_words = 0u64;
                for l in lane_len.iter_mut() {
                    *l = r.u32()? as usize;
                    total_words += *l as u64;
                }
                let n_exp = r.u8()? as usize;
                if n_exp == 1 || n_exp > MAX_EXP as usize + 1 {
                    return Err(DecodeError::InvalidField {
                        what: "step exponent alphabet size",
                        got: n_exp as u64,
                    });
                }
                let exp_table = if n_exp > 0 {
                    let mut f = [0u16; 16];
                    for x in f.iter_mut().take(n_exp) {
                        *x = r.u16()?;
                    }
                    Some(DecodeTable::from(&FreqTable::new(&f[..n_exp])?))
                } else {
                    None
                };
                let raw_sink = r.take(sink * c * dsize)?;
                let esc_bytes = r.take(n_escapes * 4)?;
                if total_words * 4 > r.remaining() as u64 {
                    return Err(DecodeError::Truncated {
                        what: "lane words",
                        needed: total_words * 4,
                        available: r.remaining() as u64,
                    });
                }
                let words_bytes = r.take(total_words as usize * 4)?;
                words.clear();
                words.extend(
                    words_bytes
                        .chunks_exact(4)
                        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])),
                );
                let rans_err = |err| DecodeError::Rans {
                    chunk: chunk_id,
                    layer,
                    kv,
                    err,
                };
                let mut dec = LaneDecoder::from_concatenated(&words, lane_len).map_err(rans_err)?;
                let n_e = if let Some(et) = &exp_table {
                    let tabs = vec![et; n_exps];
                    dec.decode(0, &tabs, &mut exps).map_err(rans_err)?;
                    n_exps
                } else {
                    0
                };
                let maps = [
                    self.profile.table_map(level, layer, kvi, 0),
                    self.profile.table_map(level, layer, kvi, 1),
                ];
                // Every (kind, exponent, channel) table of the block, resolved once; a row then
                // copies the slices of the heads whose kind or exponent changed.
                let n_el = if n_e > 0 { n_exp } else { 1 };
                block_tables.clear();
                block_radii.clear();
                for map in maps {
                    for e in 0..n_el {
                        for &t in map {
                            let t = self.profile.table_at(level, t, e as u8) as usize;
                            block_tables.push(&dec_tables[t]);
                            block_radii.push(i32::from(level_tables.tables[t].radius));
                        }
                    }
                }
                row_tables.clear();
                row_tables.extend_from_slice(&block_tables[..c]);
                head_from.iter_mut().for_each(|f| *f = usize::MAX);
                let mut esc = esc_bytes
                    .chunks_exact(4)
                    .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]));
                let sinks_finite = raw_sink_finite(raw_sink, self.dtype);
                consts.fill(self.profile.channel_params(layer, kvi), mult);
                let ex = Exps {
                    exps: if n_e > 0 { &exps } else { &[] },
                    head_dim: d,
                };
                let mut g0 = 0;
                while g0 < rows {
                    let g1 = (g0 + group).min(rows);
                    let (anchor_row, rest) = recon.split_at_mut(c);
                    for row in g0..g1 {
                        if row < sink {
                            // Sink rows are stored; delta rows may take them as anchors.
                            let dst = if row == g0 {
                                &mut anchor_row[..]
                            } else {
                                &mut rest[(row - g0 - 1) * c..(row - g0) * c]
                            };
                            read_rows(
                                &raw_sink[row * c * dsize..(row + 1) * c * dsize],
                                self.dtype,
                                dst,
                            );
                            continue;
                        }
                        let kind = usize::from(row != g0);
                        let i = row - sink;
                        // The row's tables depend only on its kind and its heads' exponents.
                        for (h, from_h) in head_from.iter_mut().enumerate() {
                            let e = if n_e > 0 {
                                exps[i * heads + h] as usize
                            } else {
                                0
                            };
                            let from = (kind * n_el + e) * c + h * d;
                            if *from_h != from {
                                *from_h = from;
                                row_tables[h * d..(h + 1) * d]
                                    .copy_from_slice(&block_tables[from..from + d]);
                            }
                        }
                        dec.decode(n_e + i * c, &row_tables, &mut indices)
                            .map_err(rans_err)?;
                        // Index `i` of a radius-`R` table is the value `i - R`, and the escape
                        // (index `2R + 1`) maps to `R + 1`: map the row branch-free, then
                        // replace the (rare) escapes in increasing channel order.
                        // Map the indices and reconstruct in one pass per head; index `i`
                        // of a radius-`R` table is the value `i - R`, and the escape (index
                        // `2R + 1`) maps to `R + 1`, so escapes are recognised afterwards and
                        // their channels redone with the escape values, in channel order.
                        let (dst, anchor) = if row == g0 {
                            (&mut anchor_row[..], None)
                        } else {
                            (
                                &mut rest[(row - g0 - 1) * c..(row - g0) * c],
                                Some(&anchor_row[..]),
                            )
                        };
                        let mut any_escape = false;
                        for (h, &from) in head_from.iter().enumerate() {
                            let seg = h * d..(h + 1) * d;
                            any_escape |= dequantize_indices(
                                &indices[seg.clone()],
                                &block_radii[from..from + d],
                                &consts,
                                h * d,
                                ex.seg_mult(i, heads, h),
                                anchor.map(|a| &a[seg.clone()]),
                                &mut dst[seg],
                            );
                        }
                        if any_escape {
                            for (h, &from) in head_from.iter().enumerate() {
                                let m = ex.seg_mult(i, heads, h);
                                for k in 0..d {
                                    let ch = h * d + k;
                                    let radius = block_radii[from + k];
                                    if i32::from(indices[ch]) - radius <= radius {
                                        continue;
                                    }
                                    let e = esc
                                        .next()
                                        .ok_or(DecodeError::BadEscape { chunk: chunk_id })?;
                                    if e.unsigned_abs() <= radius as u32
                                        || e.unsigned_abs() > MAX_SYMBOL as u32
                                    {
                                        return Err(DecodeError::BadEscape { chunk: chunk_id });
                                    }
                                    dst[ch] =
                                        dequantize_one(&consts, ch, e, m, anchor.map(|a| a[ch]));
                                }
                            }
                        }
                    }
                    out.rows(layer, kv, g0, &recon[..(g1 - g0) * c]);
                    g0 = g1;
                }
                dec.finish().map_err(rans_err)?;
                if esc.next().is_some() {
                    return Err(DecodeError::Inconsistent {
                        what: "more escape values than escape symbols",
                    });
                }
                if !sinks_finite {
                    return Err(DecodeError::InvalidField {
                        what: "sink value (not finite)",
                        got: layer as u64,
                    });
                }
                out.block_done(layer, kv, raw_sink);
            }
        }
        if r.remaining() != 0 {
            return Err(DecodeError::Inconsistent {
                what: "trailing bytes in chunk",
            });
        }
        Ok(())
    }
}

/// Receives a chunk's reconstruction from [`ChunkContext::decode_chunk_rows`].
trait RowSink {
    /// Rows `first .. first + values.len() / C` of block `(layer, kv)` (chunk-local rows; sink
    /// rows widened to f32). Called in row order, before the block's final checks.
    fn rows(&mut self, layer: u32, kv: Kv, first: usize, values: &[f32]);
    /// Block `(layer, kv)` passed every check; `raw_sink` holds its sink rows' stored bytes.
    fn block_done(&mut self, layer: u32, kv: Kv, raw_sink: &[u8]);
}

/// Collects whole blocks for [`ChunkContext::decode_chunk`]'s callback.
struct BlockCollect<F> {
    block: Vec<f32>,
    out: F,
}

impl<F: FnMut(u32, Kv, &[f32], &[u8])> RowSink for BlockCollect<F> {
    fn rows(&mut self, _layer: u32, _kv: Kv, first: usize, values: &[f32]) {
        if first == 0 {
            self.block.clear();
        }
        self.block.extend_from_slice(values);
    }
    fn block_done(&mut self, layer: u32, kv: Kv, raw_sink: &[u8]) {
        (self.out)(layer, kv, &self.block, raw_sink);
    }
}

/// Writes the rows of chunk-local rows `lo..hi` of each block into the caller's tensors, row
/// `lo` going to element `dst` (for [`Stream::decode_range_into`]).
struct RangeWriter<'w, 'o> {
    k: &'w mut [TensorMut<'o>],
    v: &'w mut [TensorMut<'o>],
    lo: usize,
    hi: usize,
    dst: usize,
    channels: usize,
    dtype: Dtype,
}

impl<'o> RangeWriter<'_, 'o> {
    fn tensor(&mut self, layer: u32, kv: Kv) -> &mut TensorMut<'o> {
        match kv {
            Kv::K => &mut self.k[layer as usize],
            Kv::V => &mut self.v[layer as usize],
        }
    }
}

impl RowSink for RangeWriter<'_, '_> {
    fn rows(&mut self, layer: u32, kv: Kv, first: usize, values: &[f32]) {
        let c = self.channels;
        let (lo, hi) = (first.max(self.lo), (first + values.len() / c).min(self.hi));
        if lo >= hi {
            return;
        }
        let at = self.dst + (lo - self.lo) * c;
        let vals = &values[(lo - first) * c..(hi - first) * c];
        self.tensor(layer, kv).write_f32(at, vals);
    }
    fn block_done(&mut self, layer: u32, kv: Kv, raw_sink: &[u8]) {
        // Sink rows: copy the stored bits when the dtypes agree (already exact through f32,
        // but NaN payloads and signed zeros stay untouched this way).
        let (c, dtype) = (self.channels, self.dtype);
        let size = dtype.size_bytes();
        let sink_rows = raw_sink.len() / (c * size).max(1);
        let (lo, hi) = (self.lo, self.hi.min(sink_rows));
        if lo >= hi {
            return;
        }
        let at = self.dst;
        let raw = &raw_sink[lo * c * size..hi * c * size];
        let dst = self.tensor(layer, kv);
        if dst.dtype() != dtype {
            return;
        }
        let n = raw.len() / size;
        match dst {
            TensorMut::F16(d) => raw
                .chunks_exact(2)
                .zip(&mut d[at..at + n])
                .for_each(|(b, o)| *o = half::f16::from_le_bytes([b[0], b[1]])),
            TensorMut::Bf16(d) => raw
                .chunks_exact(2)
                .zip(&mut d[at..at + n])
                .for_each(|(b, o)| *o = half::bf16::from_le_bytes([b[0], b[1]])),
            TensorMut::F32(d) => raw
                .chunks_exact(4)
                .zip(&mut d[at..at + n])
                .for_each(|(b, o)| *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        }
    }
}

/// `true` if every stored sink value, widened to f32, is finite (check B10).
fn raw_sink_finite(raw: &[u8], dtype: Dtype) -> bool {
    match dtype {
        Dtype::F16 => raw
            .chunks_exact(2)
            .all(|b| half::f16::from_le_bytes([b[0], b[1]]).is_finite()),
        Dtype::Bf16 => raw
            .chunks_exact(2)
            .all(|b| half::bf16::from_le_bytes([b[0], b[1]]).is_finite()),
        Dtype::F32 => raw
            .chunks_exact(4)
            .all(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]).is_finite()),
    }
}

fn write_rows(out: &mut Vec<u8>, t: TensorRef<'_>, start: usize, n: usize) {
    match t {
        TensorRef::F16(s) => s[start..start + n]
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        TensorRef::Bf16(s) => s[start..start + n]
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        TensorRef::F32(s) => s[start..start + n]
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
    }
}

fn read_rows(raw: &[u8], dtype: Dtype, out: &mut [f32]) {
    match dtype {
        Dtype::F16 => raw
            .chunks_exact(2)
            .zip(out)
            .for_each(|(b, o)| *o = half::f16::from_le_bytes([b[0], b[1]]).to_f32()),
        Dtype::Bf16 => raw
            .chunks_exact(2)
            .zip(out)
            .for_each(|(b, o)| *o = half::bf16::from_le_bytes([b[0], b[1]]).to_f32()),
        Dtype::F32 => raw
            .chunks_exact(4)
            .zip(out)
            .for_each(|(b, o)| *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
    }
}

/// Encodes a cache into a stream.
pub fn encode(
    view: &KvView<'_>,
    profile: ProfileMode<'_>,
    params: &EncodeParams,
) -> Result<Vec<u8>, EncodeError> {
    check_view(view)?;
    let p = profile.profile();
    if params.chunk_tokens == 0 {
        return Err(EncodeError::InvalidParam {
            what: "chunk_tokens",
            got: 0,
        });
    }
    if params.group == 0 || params.group > MAX_GROUP {
        return Err(EncodeError::InvalidParam {
            what: "group",
            got: params.group as u64,
        });
    }
    if view.meta.model_id.len() > crate::limits::MAX_MODEL_ID_BYTES {
        return Err(EncodeError::InvalidParam {
            what: "model id length",
            got: view.meta.model_id.len() as u64,
        });
    }
    // The header stores them and decoders reject non-finite ones (spec/FORMAT.md §3.7, H16).
    for x in [view.meta.rope.theta, view.meta.rope.scaling] {
        if !x.is_finite() {
            return Err(EncodeError::InvalidParam {
                what: "rope theta/scaling (not finite)",
                got: u64::from(x.to_bits()),
            });
        }
    }
    let tokens = view.shape.tokens;
    let n_chunks = tokens.div_ceil(params.chunk_tokens);
    if params.levels.is_empty()
        || (params.levels.len() != 1 && params.levels.len() != n_chunks as usize)
    {
        return Err(EncodeError::InvalidParam {
            what: "number of chunk levels",
            got: params.levels.len() as u64,
        });
    }
    let ctx = ChunkContext {
        shape: view.shape,
        dtype: view.k[0].dtype(),
        first_position: view.meta.first_position,
        group: params.group,
        n_sink: params.n_sink,
        profile: p,
        rope: view.meta.rope,
        query_position: params
            .token_importance
            .then(|| view.meta.first_position.saturating_add(tokens as u64)),
    };
    ctx.check()?;
    let mut chunks = Vec::with_capacity(n_chunks as usize);
    let mut entries = Vec::with_capacity(n_chunks as usize);
    for i in 0..n_chunks {
        let start = i * params.chunk_tokens;
        let end = (start + params.chunk_tokens).min(tokens);
        let level = if params.levels.len() == 1 {
            params.levels[0]
        } else {
            params.levels[i as usize]
        };
        let bytes = ctx.encode_chunk(view, start..end, level)?;
        entries.push(ChunkEntry {
            offset: 0,
            len_bytes: bytes.len() as u32,
            token_start: start,
            tokens: end - start,
            level,
        });
        chunks.push(bytes);
    }
    // A self-contained stream embeds the profile without its importance hints: decoding never
    // reads them (FORMAT.md §4.3), and they cost ~4 bytes per (layer, channel).
    let embedded = match profile {
        ProfileMode::Embedded(p) => Some(p.without_importance()),
        ProfileMode::Referenced(_) => None,
    };
    let header = Header {
        version: STREAM_VERSION,
        shape: view.shape,
        dtype: ctx.dtype,
        meta: view.meta.clone(),
        chunk_tokens: params.chunk_tokens,
        group: params.group as u16,
        n_sink: params.n_sink,
        profile_hash: embedded.as_ref().unwrap_or(p).hash(),
        profile_len: embedded.as_ref().map_or(0, |e| e.as_bytes().len() as u64),
        chunks: entries,
    };
    let mut out = header.to_bytes();
    if let Some(e) = &embedded {
        out.extend_from_slice(e.as_bytes());
    }
    for c in chunks {
        out.extend_from_slice(&c);
    }
    Ok(out)
}

/// A parsed stream: header validated, profile resolved; chunks are checked as they are decoded.
#[derive(Debug)]
pub struct Stream<'a> {
    bytes: &'a [u8],
    header: Header,
    profile: Cow<'a, Profile>,
}

impl<'a> Stream<'a> {
    /// Parses a stream's header and index and resolves its profile: the embedded one, or
    /// `profile`, which must then have the hash the stream names.
    pub fn open(
        bytes: &'a [u8],
        profile: Option<&'a Profile>,
        limits: &Limits,
    ) -> Result<Self, DecodeError> {
        let header = Header::parse(bytes, limits)?;
        let profile = if header.profile_len > 0 {
            let start = header.header_len();
            let end = start + header.profile_len as usize;
            let p = Profile::from_bytes(&bytes[start..end], limits)?;
            if p.hash() != header.profile_hash {
                return Err(DecodeError::ProfileMismatch {
                    expected: header.profile_hash,
                    got: p.hash(),
                });
            }
            Cow::Owned(p)
        } else {
            let p = profile.ok_or(DecodeError::ProfileRequired {
                hash: header.profile_hash,
            })?;
            if p.hash() != header.profile_hash {
                return Err(DecodeError::ProfileMismatch {
                    expected: header.profile_hash,
                    got: p.hash(),
                });
            }
            Cow::Borrowed(p)
        };
        if (profile.layers(), profile.kv_heads(), profile.head_dim())
            != (
                header.shape.layers,
                header.shape.kv_heads,
                header.shape.head_dim,
            )
        {
            return Err(DecodeError::ProfileShape);
        }
        for e in &header.chunks {
            if e.level >= profile.levels() {
                return Err(DecodeError::UnknownLevel {
                    level: e.level,
                    levels: profile.levels(),
                });
            }
        }
        Ok(Stream {
            bytes,
            header,
            profile,
        })
    }

    /// The header.
    pub fn header(&self) -> &Header {
        &self.header
    }
    /// The profile in use.
    pub fn profile(&self) -> &Profile {
        &self.profile
    }
    /// The chunk context.
    pub fn context(&self) -> ChunkContext<'_> {
        ChunkContext {
            shape: self.header.shape,
            dtype: self.header.dtype,
            first_position: self.header.meta.first_position,
            group: self.header.group as u32,
            n_sink: self.header.n_sink,
            profile: &self.profile,
            rope: self.header.meta.rope,
            query_position: None,
        }
    }
    /// The raw bytes of chunk `i` (with its CRC).
    pub fn chunk_bytes(&self, i: usize) -> Result<&'a [u8], DecodeError> {
        let e = self
            .header
            .chunks
            .get(i)
            .ok_or(DecodeError::OutOfRange { what: "chunk" })?;
        Ok(&self.bytes[e.offset as usize..e.offset as usize + e.len_bytes as usize])
    }

    /// Decodes the whole stream into an owned cache in the stream's dtype.
    pub fn decode(&self) -> Result<KvCache, DecodeError> {
        self.decode_tokens(0..self.header.shape.tokens)
    }

    /// Decodes tokens `range` into an owned cache (reads only the chunks that overlap it).
    pub fn decode_tokens(&self, range: Range<u32>) -> Result<KvCache, DecodeError> {
        if range.start > range.end || range.end > self.header.shape.tokens {
            return Err(DecodeError::OutOfRange {
                what: "token range",
            });
        }
        let mut shape = self.header.shape;
        shape.tokens = range.end - range.start;
        let mut meta = self.header.meta.clone();
        meta.first_position = meta.first_position.saturating_add(range.start as u64);
        let mut cache = KvCache::zeros(shape, self.header.dtype, meta);
        {
            let (k, v) = (&mut cache.k, &mut cache.v);
            let mut ks: Vec<TensorMut<'_>> = k.iter_mut().map(|t| t.as_mut()).collect();
            let mut vs: Vec<TensorMut<'_>> = v.iter_mut().map(|t| t.as_mut()).collect();
            self.decode_range_into(range, &mut ks, &mut vs)?;
        }
        Ok(cache)
    }

    /// Decodes the whole stream into the caller's buffers: per layer a K and a V tensor of
    /// `tokens * channels` elements each, of any dtype (values are rounded into it).
    pub fn decode_into<'o>(
        &self,
        k: &mut [TensorMut<'o>],
        v: &mut [TensorMut<'o>],
    ) -> Result<(), DecodeError> {
        self.decode_range_into(0..self.header.shape.tokens, k, v)
    }

    /// Decodes tokens `range` into the caller's buffers (each `range.len() * channels` elements).
    pub fn decode_range_into<'o>(
        &self,
        range: Range<u32>,
        k: &mut [TensorMut<'o>],
        v: &mut [TensorMut<'o>],
    ) -> Result<(), DecodeError> {
        let shape = self.header.shape;
        if range.start > range.end || range.end > shape.tokens {
            return Err(DecodeError::OutOfRange {
                what: "token range",
            });
        }
        let c = shape.channels();
        let want = (range.end - range.start) as usize * c;
        if k.len() != shape.layers as usize || v.len() != shape.layers as usize {
            return Err(DecodeError::OutputMismatch {
                what: "number of layers",
            });
        }
        if k.iter().chain(v.iter()).any(|t| t.len() != want) {
            return Err(DecodeError::OutputMismatch {
                what: "tensor length",
            });
        }
        let ctx = self.context();
        for (i, e) in self.header.chunks.iter().enumerate() {
            let (s, t) = (e.token_start, e.token_start + e.tokens);
            if t <= range.start || s >= range.end {
                continue;
            }
            let lo = s.max(range.start);
            let hi = t.min(range.end);
            let mut writer = RangeWriter {
                k: &mut *k,
                v: &mut *v,
                lo: (lo - s) as usize,
                hi: (hi - s) as usize,
                dst: (lo - range.start) as usize * c,
                channels: c,
                dtype: self.header.dtype,
            };
            ctx.decode_chunk_rows(
                self.chunk_bytes(i)?,
                i as u32,
                s,
                e.tokens,
                e.level,
                &mut writer,
            )?;
        }
        Ok(())
    }
}

/// Decodes a whole stream (convenience for [`Stream::open`] + [`Stream::decode`]).
pub fn decode(
    bytes: &[u8],
    profile: Option<&Profile>,
    limits: &Limits,
) -> Result<KvCache, DecodeError> {
    Stream::open(bytes, profile, limits)?.decode()
}
