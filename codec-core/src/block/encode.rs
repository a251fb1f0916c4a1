//! The chunk encoder: quantizes each block (§7), maps its symbols to table indices and escapes
//! (§6.4), codes them over the lanes (§6.5) and lays the block out ([`super::layout`]).

use super::layout::{write_block, BlockOut};
use super::tables::BlockTables;
use super::ChunkContext;
use crate::bytes::{crc32c, PutLe};
use crate::error::EncodeError;
use crate::importance::{block_exponents, reference_queries};
use crate::kv::{KvView, TensorRef};
use crate::profile::{LevelTables, SymbolTable};
use crate::quant::{quantize_block, BlockConsts, Exps};
use crate::rans::{encode_lanes_into, FreqTable, LANES};
use alloc::vec::Vec;
use core::ops::Range;

impl<'p> ChunkContext<'p> {
    /// Encodes tokens `tokens` of `view` at `level` into a chunk (blocks and CRC), the unit a
    /// streamer sends. `view` must have this context's shape except for its token count.
    ///
    /// To encode many chunks, `ChunkEncoder::append_chunk` (public with the `internals`
    /// feature) reuses one set of buffers; [`encode_threads`](crate::encode_threads) codes a
    /// whole stream on several threads.
    pub fn encode_chunk(
        &self,
        view: &KvView<'_>,
        tokens: Range<u32>,
        level: u8,
    ) -> Result<Vec<u8>, EncodeError> {
        let mut out = Vec::new();
        ChunkEncoder::new(self).append_chunk(view, tokens, level, &mut out)?;
        Ok(out)
    }
}

/// A chunk encoder over one [`ChunkContext`]; its buffers are reused from block to block and
/// from chunk to chunk.
#[derive(Debug)]
pub struct ChunkEncoder<'c, 'p> {
    ctx: &'c ChunkContext<'p>,
    level: u8,
    level_tables: &'p LevelTables,
    mult: f32,
    /// First token of the current chunk, and its leading sink rows.
    start: usize,
    sink: usize,
    /// One block's values and their reconstruction, `rows * C`.
    x: Vec<f32>,
    recon: Vec<f32>,
    symbols: Vec<i32>,
    /// The exponents then the value symbols' table indices: the block's rANS message.
    indices: Vec<u8>,
    escapes: Vec<i32>,
    /// The layer's step exponents, one per (non-sink row, head); empty if all are 0.
    exps: Vec<u8>,
    consts: BlockConsts,
    tables: BlockTables,
    /// Table id of every value symbol.
    tids: Vec<u8>,
    lanes: [Vec<u32>; LANES],
}

impl<'c, 'p> ChunkEncoder<'c, 'p> {
    /// An encoder for chunks of `ctx`'s stream.
    pub fn new(ctx: &'c ChunkContext<'p>) -> Self {
        let profile = ctx.profile();
        ChunkEncoder {
            ctx,
            level: 0,
            level_tables: profile.level_tables(0),
            mult: profile.level_multipliers()[0],
            start: 0,
            sink: 0,
            x: Vec::new(),
            recon: Vec::new(),
            symbols: Vec::new(),
            indices: Vec::new(),
            escapes: Vec::new(),
            exps: Vec::new(),
            consts: BlockConsts::default(),
            tables: BlockTables::default(),
            tids: Vec::new(),
            lanes: core::array::from_fn(|_| Vec::new()),
        }
    }

    /// Appends the chunk of tokens `tokens` of `view` at `level` (blocks and CRC) to `out`: the
    /// bytes [`ChunkContext::encode_chunk`] returns.
    pub fn append_chunk(
        &mut self,
        view: &KvView<'_>,
        tokens: Range<u32>,
        level: u8,
        out: &mut Vec<u8>,
    ) -> Result<(), EncodeError> {
        self.start_chunk(view, tokens, level)?;
        let first = out.len();
        for layer in 0..self.ctx.shape().layers {
            self.append_layer(view, layer, out);
        }
        let crc = crc32c(&out[first..]);
        out.put_u32(crc);
        Ok(())
    }

    /// Prepares to encode the chunk of tokens `tokens` of `view` at `level`, layer by layer
    /// ([`append_layer`](Self::append_layer)); its bytes are then the layers' in order and a
    /// CRC-32C of them.
    pub(crate) fn start_chunk(
        &mut self,
        view: &KvView<'_>,
        tokens: Range<u32>,
        level: u8,
    ) -> Result<(), EncodeError> {
        let profile = self.ctx.profile();
        let levels = profile.levels();
        if level >= levels {
            return Err(EncodeError::UnknownLevel { level, levels });
        }
        if tokens.start >= tokens.end || tokens.end > view.shape.tokens {
            let got = u64::from(tokens.end);
            return Err(EncodeError::InvalidParam {
                what: "chunk token range",
                got,
            });
        }
        let rows = tokens.end - tokens.start;
        self.level = level;
        self.level_tables = profile.level_tables(level);
        self.mult = profile.level_multipliers()[level as usize];
        self.start = tokens.start as usize;
        self.sink = self.ctx.sink_rows(tokens.start, rows);
        let n = rows as usize * self.channels();
        self.x.resize(n, 0.0);
        self.recon.resize(n, 0.0);
        Ok(())
    }

    /// Appends the K and V blocks of `layer` of the chunk [`start_chunk`](Self::start_chunk)
    /// prepared.
    pub(crate) fn append_layer(&mut self, view: &KvView<'_>, layer: u32, out: &mut Vec<u8>) {
        let k_in_x = self.exponents(view, layer);
        // Non-empty exps hold a nonzero exponent, so the alphabet has at least 2 symbols.
        let n_exp = self.exps.iter().max().map_or(0, |&m| m as usize + 1);
        let exp_table = (n_exp > 0).then(|| {
            let mut counts = [0u64; 16];
            self.exps.iter().for_each(|&e| counts[e as usize] += 1);
            FreqTable::from_counts(&counts[..n_exp])
        });
        for (kv, t) in [view.k[layer as usize], view.v[layer as usize]]
            .into_iter()
            .enumerate()
        {
            if !(kv == 0 && k_in_x) {
                t.read_f32(self.start * self.channels(), &mut self.x);
            }
            self.block(t, layer, kv, n_exp, exp_table.as_ref(), out);
        }
    }

    fn channels(&self) -> usize {
        self.ctx.shape().channels()
    }

    /// Sets the layer's step exponents from its K by the importance policy (empty if the policy
    /// is off or gives every token exponent 0). Returns `true` if `x` now holds the layer's K.
    fn exponents(&mut self, view: &KvView<'_>, layer: u32) -> bool {
        self.exps.clear();
        let ctx = self.ctx;
        let (Some(pos), Some(imp)) = (ctx.query_position(), ctx.profile().importance()) else {
            return false;
        };
        let (c, l) = (self.channels(), layer as usize);
        let (d, heads) = (ctx.shape().head_dim as usize, ctx.shape().kv_heads as usize);
        view.k[l].read_f32(self.start * c, &mut self.x);
        let qref = reference_queries(&imp.query_mean[l * c..(l + 1) * c], d, pos, ctx.rope());
        block_exponents(
            &self.x,
            c,
            d,
            self.sink,
            ctx.position(self.start as u32),
            &qref,
            &imp.tau[l * heads..(l + 1) * heads],
            ctx.rope(),
            &imp.params,
            &mut self.exps,
        );
        if self.exps.iter().all(|&e| e == 0) {
            self.exps.clear();
        }
        true
    }

    /// Quantizes and codes the block `(layer, kv)` whose values are in `x`, and appends it.
    fn block(
        &mut self,
        tensor: TensorRef<'_>,
        layer: u32,
        kv: usize,
        n_exp: usize,
        exp_table: Option<&FreqTable>,
        out: &mut Vec<u8>,
    ) {
        let (c, group) = (self.channels(), self.ctx.group());
        let profile = self.ctx.profile();
        self.consts
            .fill(profile.channel_params(layer, kv), self.mult);
        self.symbols.clear();
        let exps = Exps {
            exps: &self.exps,
            head_dim: self.ctx.shape().head_dim as usize,
        };
        quantize_block(
            &self.x,
            &self.consts,
            group,
            self.sink,
            exps,
            &mut self.symbols,
            &mut self.recon,
        );
        let shape = self.ctx.shape();
        let head_dim = shape.head_dim as usize;
        self.tables.start(profile, (self.level, layer, kv), n_exp, head_dim);
        self.tables.resolve_all(profile);
        let rows = RowLayout {
            channels: c,
            head_dim,
            sink: self.sink,
            group,
        };
        self.tids.clear();
        self.tids.resize(self.symbols.len(), 0);
        debug_assert!(n_exp == 0 || !self.exps.is_empty());
        value_tables(&mut self.tids, &self.tables, &self.exps, &rows);
        map_symbols(
            &self.exps,
            &self.symbols,
            &self.tids,
            &self.level_tables.tables,
            &mut self.indices,
            &mut self.escapes,
        );
        let n_e = self.exps.len();
        // Slices, not the Vecs: their bounds then stay in registers through the coding loop.
        let (tids, tables): (&[u8], &[SymbolTable]) = (&self.tids, &self.level_tables.tables);
        let table_of = |i: usize| -> &FreqTable {
            match exp_table {
                Some(et) if i < n_e => et,
                _ => &tables[tids[i - n_e] as usize].freqs,
            }
        };
        encode_lanes_into(&self.indices, table_of, &mut self.lanes);
        let block = BlockOut {
            lanes: &self.lanes,
            exp_table,
            escapes: &self.escapes,
        };
        let first = self.start * c;
        write_block(out, &block, tensor, first..first + self.sink * c);
    }
}


/// Where a block's value symbols sit: rows of `channels` in heads of `head_dim`, after `sink`
/// sink rows, in groups of `group` rows.
struct RowLayout {
    channels: usize,
    head_dim: usize,
    sink: usize,
    group: usize,
}

/// The table id of every value symbol (row-major over the non-sink rows): per row, each head's
/// slice of the block's resolved ids, by the row's kind and the head's exponent in `exps`.
fn value_tables(tids: &mut [u8], tables: &BlockTables, exps: &[u8], rows: &RowLayout) {
    let (c, d) = (rows.channels, rows.head_dim);
    let heads = c / d;
    let ids = tables.ids();
    for (i, row_ids) in tids.chunks_exact_mut(c).enumerate() {
        let kind = usize::from(!(rows.sink + i).is_multiple_of(rows.group));
        for (h, seg) in row_ids.chunks_exact_mut(d).enumerate() {
            let e = exps.get(i * heads + h).map_or(0, |&e| e as usize);
            let from = tables.offset(kind, e, h);
            seg.copy_from_slice(&ids[from..from + d]);
        }
    }
}

/// The block's rANS message: its exponents `exps`, then each value symbol as an index of its
/// table (`s + radius`), or the table's escape index with `s` appended to `escapes` (§6.4).
/// `tids` holds the table id of each symbol.
fn map_symbols(
    exps: &[u8],
    symbols: &[i32],
    tids: &[u8],
    tables: &[SymbolTable],
    indices: &mut Vec<u8>,
    escapes: &mut Vec<i32>,
) {
    indices.clear();
    indices.extend_from_slice(exps);
    escapes.clear();
    // One `extend` of an exact-length iterator: a single reservation, no per-symbol length check.
    indices.extend(symbols.iter().zip(tids).map(|(&s, &t)| {
        let table = &tables[t as usize];
        if s.unsigned_abs() <= u32::from(table.radius) {
            (s + i32::from(table.radius)) as u8
        } else {
            escapes.push(s);
            table.escape()
        }
    }));
}
