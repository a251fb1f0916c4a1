//! The chunk decoder: checks the chunk (§5.5), reads each block ([`super::layout`]), decodes its
//! lanes (§6.3), maps indices and escapes to symbols (§6.4) and reconstructs the rows (§7.2),
//! one token group at a time.

use super::error::BlockError;
use super::layout::{read_block, BlockParts};
use super::tables::BlockTables;
use super::ChunkContext;
use crate::bytes::{crc32c, split_crc, Reader};
use crate::consts::{EXP_MULT, MAX_SYMBOL};
use crate::error::Kv;
use crate::kv::Dtype;
use crate::quant::{dequantize_indices, dequantize_one, BlockConsts, Exps};
use crate::rans::{DecodeTable, FreqTable, LaneDecoder, RansError};
use alloc::boxed::Box;
use alloc::vec;
use alloc::vec::Vec;

/// Receives a chunk's reconstruction from the decoder.
pub(crate) trait RowSink {
    /// Rows `first .. first + values.len() / C` of block `(layer, kv)` (chunk-local rows; sink
    /// rows widened to f32). Called in row order, before the block's final checks.
    fn rows(&mut self, layer: u32, kv: Kv, first: usize, values: &[f32]);
    /// Block `(layer, kv)` passed every check; `raw_sink` holds its sink rows' stored bytes.
    fn block_done(&mut self, layer: u32, kv: Kv, raw_sink: &[u8]);
    /// Whether the sink takes the expected coding error ([`errors`](Self::errors)).
    const ERRORS: bool = false;
    /// The expected squared error of rows `first ..` of block `(layer, kv)`, one per (row, KV
    /// head) (see [`crate::CodingError`]); called after [`rows`](Self::rows) for the same rows,
    /// only if [`ERRORS`](Self::ERRORS).
    fn errors(&mut self, _layer: u32, _kv: Kv, _first: usize, _errors: &[f32]) {}
}

impl ChunkContext<'_> {
    /// Decodes one chunk (as produced by [`ChunkContext::encode_chunk`]) holding `rows` tokens
    /// starting at stream token `token_start`, at `level`, calling `out(layer, kv, values,
    /// raw_sink)` with each block's reconstruction (`rows * channels` f32 values; sink rows are
    /// passed as their stored values widened to f32, and their raw bytes in `raw_sink`).
    /// `chunk_id` only labels errors.
    ///
    /// A block is passed on only once it has passed every check of `spec/FORMAT.md` §5.5; on an
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
    ) -> Result<(), BlockError> {
        let mut collect = BlockCollect {
            block: Vec::new(),
            out,
        };
        let at = ChunkAt {
            chunk: chunk_id,
            token_start,
            rows,
            level,
        };
        self.decode_chunk_rows(chunk, &at, &mut collect)
    }

    /// The decoder of [`decode_chunk`](Self::decode_chunk), passing the reconstruction on one
    /// token group at a time (so that it is still in the first-level cache when the caller
    /// converts it) and each block's raw sink bytes once the block has passed its checks.
    pub(crate) fn decode_chunk_rows(
        &self,
        chunk: &[u8],
        at: &ChunkAt,
        out: &mut impl RowSink,
    ) -> Result<(), BlockError> {
        let blocks = self.chunk_blocks(chunk, at);
        // A block read means the chunk's checks passed, its level among them.
        if !blocks.parts.is_empty() {
            let mut dec = BlockDecoder::new(self, at);
            for (b, parts) in blocks.parts.iter().enumerate() {
                dec.block(parts, b, out)?;
            }
        }
        blocks.error.map_or(Ok(()), Err)
    }

    /// Checks chunk `chunk` (its level, CRC C1 and trailing bytes) and reads its blocks'
    /// layouts (B1-B5), in stream order, up to the first that fails. Decoding the blocks read
    /// in order, then reporting [`ChunkBlocks::error`], is decoding the chunk.
    pub(crate) fn chunk_blocks<'a>(&self, chunk: &'a [u8], at: &ChunkAt) -> ChunkBlocks<'a> {
        let mut blocks = ChunkBlocks {
            parts: Vec::new(),
            error: None,
        };
        if let Err(e) = self.read_blocks(chunk, at, &mut blocks.parts) {
            blocks.error = Some(e);
        }
        blocks
    }

    fn read_blocks<'a>(
        &self,
        chunk: &'a [u8],
        at: &ChunkAt,
        parts: &mut Vec<BlockParts<'a>>,
    ) -> Result<(), BlockError> {
        let levels = self.profile().levels();
        if at.level >= levels {
            let level = at.level;
            return Err(BlockError::UnknownLevel { level, levels });
        }
        let (body, stored) = split_crc(chunk).ok_or(BlockError::ChunkTooShort {
            len: chunk.len() as u64,
        })?;
        let computed = crc32c(body);
        if stored != computed {
            let chunk = at.chunk;
            return Err(BlockError::Crc {
                chunk,
                stored,
                computed,
            });
        }
        let shape = self.shape();
        let c = shape.channels();
        let sink = self.sink_rows(at.token_start, at.rows);
        let (n_sym, sink_bytes) = ((at.rows as usize - sink) * c, sink * c * self.dtype().size_bytes());
        let mut r = Reader::new(body);
        parts.reserve(2 * shape.layers as usize);
        for _ in 0..2 * shape.layers {
            parts.push(read_block(&mut r, n_sym, sink_bytes)?);
        }
        if r.remaining() != 0 {
            let got = r.remaining() as u64;
            return Err(BlockError::TrailingBytes { got });
        }
        Ok(())
    }
}

/// A chunk's blocks as they lie in it ([`ChunkContext::chunk_blocks`]).
pub(crate) struct ChunkBlocks<'a> {
    /// The blocks that passed the chunk's checks and their own layout checks, block `b` being
    /// layer `b / 2`, K if `b` is even, V if odd.
    pub parts: Vec<BlockParts<'a>>,
    /// Why the chunk fails after its blocks `parts` (a chunk check, a layout check of the next
    /// block, or bytes after the last block), if it does.
    pub error: Option<BlockError>,
}

/// Where a chunk sits in its stream.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ChunkAt {
    /// Index of the chunk (labels errors).
    pub chunk: u32,
    /// Stream index of its first token.
    pub token_start: u32,
    /// Its tokens.
    pub rows: u32,
    /// Its level.
    pub level: u8,
}

/// Exponents decoded by one call of the lane decoder (a multiple of its 32 lanes).
const EXPS_PER_PIECE: usize = 1024;

/// The state of one chunk's decoding; buffers are reused from block to block.
pub(crate) struct BlockDecoder<'c, 'p> {
    ctx: &'c ChunkContext<'p>,
    at: ChunkAt,
    rows: usize,
    sink: usize,
    mult: f32,
    /// One token group's reconstruction: a delta row needs only its group's anchor row.
    recon: Vec<f32>,
    /// One row's table indices.
    indices: Vec<u8>,
    /// The block's step exponents, one per (non-sink row, head).
    exps: Vec<u8>,
    words: Vec<u32>,
    consts: BlockConsts,
    /// The last block's exponent table and its lookup (kvc's encoder gives a layer's K and V
    /// blocks the same one).
    exp_table: Option<(FreqTable, Box<DecodeTable>)>,
    tables: BlockTables,
    /// The decode table and radius of every table id of the block that `tables` resolved (at
    /// the same offsets; the others are stale).
    block_tables: Vec<&'p DecodeTable>,
    block_radii: Vec<i32>,
    /// One row's decode tables, and per head the offset its slice was copied from.
    row_tables: Vec<&'p DecodeTable>,
    head_from: Vec<usize>,
    /// Per head, the sum of its channels' squared steps: anchor rows', then delta rows'.
    step_energy: Vec<f32>,
    /// One token group's expected squared errors, one per (row, head).
    errors: Vec<f32>,
}

impl<'c, 'p> BlockDecoder<'c, 'p> {
    /// A decoder for the blocks of the chunk at `at`, whose level [`ChunkContext::chunk_blocks`]
    /// has checked.
    pub(crate) fn new(ctx: &'c ChunkContext<'p>, at: &ChunkAt) -> Self {
        let shape = ctx.shape();
        let (c, rows) = (shape.channels(), at.rows as usize);
        let sink = ctx.sink_rows(at.token_start, at.rows);
        BlockDecoder {
            ctx,
            at: *at,
            rows,
            sink,
            // The level was checked with the chunk (`chunk_blocks`) before any block is
            // decoded; `get` keeps a wrong call from indexing out of bounds.
            mult: (ctx.profile().level_multipliers())
                .get(at.level as usize)
                .copied()
                .unwrap_or(1.0),
            recon: vec![0f32; ctx.group().min(rows) * c],
            indices: vec![0u8; c],
            exps: vec![0u8; (rows - sink) * shape.kv_heads as usize],
            words: Vec::new(),
            consts: BlockConsts::default(),
            exp_table: None,
            tables: BlockTables::default(),
            block_tables: Vec::new(),
            block_radii: Vec::new(),
            row_tables: Vec::with_capacity(c),
            head_from: vec![usize::MAX; shape.kv_heads as usize],
            step_energy: Vec::new(),
            errors: Vec::new(),
        }
    }

    /// Decodes block `b` of the chunk (layer `b / 2`, K or V), read by
    /// [`ChunkContext::chunk_blocks`], and passes its rows to `out`: checks B6-B10.
    pub(crate) fn block(
        &mut self,
        parts: &BlockParts<'_>,
        b: usize,
        out: &mut impl RowSink,
    ) -> Result<(), BlockError> {
        let (layer, kvi) = ((b / 2) as u32, b % 2);
        let kv = [Kv::K, Kv::V][kvi];
        let mut words = core::mem::take(&mut self.words);
        words.clear();
        words.extend(
            parts
                .words
                .chunks_exact(4)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        );
        let done = self.decode_lanes(parts, &words, layer, kvi, kv, out);
        self.words = words;
        done?;
        if !raw_sink_finite(parts.raw_sink, self.ctx.dtype()) {
            return Err(BlockError::SinkNotFinite { layer, kv });
        }
        out.block_done(layer, kv, parts.raw_sink);
        Ok(())
    }

    /// Decodes the block's exponents and rows from its lane words `words`, passing the rows to
    /// `out` one token group at a time: checks B6-B9.
    fn decode_lanes<O: RowSink>(
        &mut self,
        parts: &BlockParts<'_>,
        words: &[u32],
        layer: u32,
        kvi: usize,
        kv: Kv,
        out: &mut O,
    ) -> Result<(), BlockError> {
        let chunk = self.at.chunk;
        let rans_err = |err| BlockError::Rans {
            chunk,
            layer,
            kv,
            err,
        };
        let mut dec = LaneDecoder::from_concatenated(words, parts.lane_len).map_err(rans_err)?;
        let n_e = match &parts.exp_table {
            Some(et) => {
                // Every exponent has the same table: a piece at a time, so that the table
                // list stays small whatever the block's size (it was 8 bytes an exponent).
                let et = exp_decode_table(&mut self.exp_table, et);
                let tabs = [et; EXPS_PER_PIECE];
                for piece in self.exps.chunks_mut(EXPS_PER_PIECE) {
                    dec.decode(dec.position(), &tabs, piece)
                        .map_err(rans_err)?;
                }
                self.exps.len()
            }
            None => 0,
        };
        let n_exp = match (&parts.exp_table, n_e) {
            (Some(t), 1..) => t.len(),
            _ => 0,
        };
        self.resolve_tables(layer, kvi, n_exp);
        self.consts
            .fill(self.ctx.profile().channel_params(layer, kvi), self.mult);
        if O::ERRORS {
            self.fill_step_energy();
        }
        let c = self.ctx.shape().channels();
        let mut esc = parts.escape_values();
        let mut g0 = 0;
        while g0 < self.rows {
            let g1 = (g0 + self.ctx.group()).min(self.rows);
            for row in g0..g1 {
                self.row(parts, row, g0, n_e, &mut dec, &mut esc)
                    .map_err(|e| e.at(chunk, layer, kv))?;
            }
            out.rows(layer, kv, g0, &self.recon[..(g1 - g0) * c]);
            if O::ERRORS {
                self.group_errors(g0, g1, n_e);
                out.errors(layer, kv, g0, &self.errors);
            }
            g0 = g1;
        }
        dec.finish().map_err(rans_err)?;
        if esc.next().is_some() {
            return Err(BlockError::ExtraEscapes { layer, kv });
        }
        Ok(())
    }

    /// Per head, the sums of the squared anchor and delta steps of the block's level.
    fn fill_step_energy(&mut self) {
        let d = self.ctx.shape().head_dim as usize;
        let sq = |steps: &[f32]| -> Vec<f32> {
            steps
                .chunks_exact(d.max(1))
                .map(|h| h.iter().map(|s| s * s).sum())
                .collect()
        };
        self.step_energy = sq(&self.consts.anchor_step);
        self.step_energy.extend(sq(&self.consts.delta_step));
    }

    /// The expected squared errors of rows `g0..g1` (a token group, `g0` its anchor), per
    /// (row, head): the head's squared steps times its exponent's multiplier squared, over 12;
    /// 0 for sink rows.
    fn group_errors(&mut self, g0: usize, g1: usize, n_e: usize) {
        let heads = self.head_from.len();
        self.errors.clear();
        for row in g0..g1 {
            if row < self.sink {
                self.errors.extend(core::iter::repeat_n(0.0, heads));
                continue;
            }
            let i = row - self.sink;
            let energy = &self.step_energy[usize::from(row != g0) * heads..][..heads];
            for (h, &e) in energy.iter().enumerate() {
                let m = match n_e {
                    0 => 1.0,
                    _ => EXP_MULT[usize::from(self.exps[i * heads + h] & 15)],
                };
                self.errors.push(e * (m * m) / 12.0);
            }
        }
    }

    /// Starts the block's table resolution (each head's tables are resolved as rows first use
    /// them, [`row_tables_for`](Self::row_tables_for)); no row has tables yet.
    fn resolve_tables(&mut self, layer: u32, kvi: usize, n_exp: usize) {
        let (profile, level) = (self.ctx.profile(), self.at.level);
        let d = self.ctx.shape().head_dim as usize;
        self.tables.start(profile, (level, layer, kvi), n_exp, d);
        // Placeholders until resolved: a level has at least one table (profile check P17).
        let first = &profile.decode_tables(level)[0];
        let n = self.tables.ids().len();
        self.block_tables.resize(n, first);
        self.block_radii.resize(n, 0);
        self.row_tables.resize(profile.channels(), first);
        self.head_from.iter_mut().for_each(|f| *f = usize::MAX);
    }

    /// Resolves the decode tables and radii of the `d` ids at `from` (a head's).
    fn resolve_head(&mut self, from: usize, d: usize) {
        let (profile, level) = (self.ctx.profile(), self.at.level);
        let (dec_tables, level_tables) = (
            profile.decode_tables(level),
            &profile.level_tables(level).tables,
        );
        let ids = &self.tables.ids()[from..from + d];
        let tables = self.block_tables[from..from + d].iter_mut();
        let radii = self.block_radii[from..from + d].iter_mut();
        for ((&t, table), radius) in ids.iter().zip(tables).zip(radii) {
            *table = &dec_tables[t as usize];
            *radius = i32::from(level_tables[t as usize].radius);
        }
    }

    /// Reconstructs chunk row `row` of the group starting at row `g0` into `recon`.
    fn row(
        &mut self,
        parts: &BlockParts<'_>,
        row: usize,
        g0: usize,
        n_e: usize,
        dec: &mut LaneDecoder<'_>,
        esc: &mut impl Iterator<Item = i32>,
    ) -> Result<(), RowError> {
        let c = self.ctx.shape().channels();
        let at = (row - g0) * c;
        if row < self.sink {
            // Sink rows are stored; delta rows may take them as anchors.
            let dsize = self.ctx.dtype().size_bytes();
            let raw = &parts.raw_sink[row * c * dsize..(row + 1) * c * dsize];
            read_rows(raw, self.ctx.dtype(), &mut self.recon[at..at + c]);
            return Ok(());
        }
        let i = row - self.sink;
        let kind = usize::from(row != g0);
        self.row_tables_for(i, kind, n_e);
        dec.decode(n_e + i * c, &self.row_tables, &mut self.indices)
            .map_err(RowError::Rans)?;
        // The group's anchor row is its first; a delta row reads it.
        let (anchor_row, rest) = self.recon.split_at_mut(c);
        let (recon, anchor) = match row == g0 {
            true => (anchor_row, None),
            false => (&mut rest[at - c..at], Some(&anchor_row[..])),
        };
        let ex = Exps {
            exps: if n_e > 0 { &self.exps } else { &[] },
            head_dim: self.ctx.shape().head_dim as usize,
        };
        let rec = RowRecon {
            indices: &self.indices,
            head_from: &self.head_from,
            radii: &self.block_radii,
            consts: &self.consts,
            exps: ex,
            i,
        };
        if rec.values(anchor, recon) {
            rec.escapes(anchor, recon, esc)?;
        }
        Ok(())
    }

    /// Points each head's slice of `row_tables` at the tables of non-sink row `i` of `kind`
    /// (copying only the heads whose kind or exponent changed, resolving a head's tables of a
    /// kind and exponent on their first use in the block).
    fn row_tables_for(&mut self, i: usize, kind: usize, n_e: usize) {
        let d = self.ctx.shape().head_dim as usize;
        let profile = self.ctx.profile();
        let heads = self.head_from.len();
        for h in 0..heads {
            let e = if n_e > 0 {
                self.exps[i * heads + h] as usize
            } else {
                0
            };
            let (from, resolved) = self.tables.head(profile, kind, e, h);
            if resolved {
                self.resolve_head(from, d);
            }
            if self.head_from[h] != from {
                self.head_from[h] = from;
                self.row_tables[h * d..(h + 1) * d]
                    .copy_from_slice(&self.block_tables[from..from + d]);
            }
        }
    }
}

/// The lookup of a block's exponent table `table`, from `cache` (the last block's), rebuilt in
/// place only when the table differs.
fn exp_decode_table<'t>(
    cache: &'t mut Option<(FreqTable, Box<DecodeTable>)>,
    table: &FreqTable,
) -> &'t DecodeTable {
    let (last, lookup) =
        cache.get_or_insert_with(|| (table.clone(), Box::new(DecodeTable::new(table))));
    if last != table {
        last.clone_from(table);
        lookup.rebuild(table);
    }
    lookup
}

/// A row's failure before the block's location is known.
enum RowError {
    Rans(RansError),
    BadEscape,
}

impl RowError {
    fn at(self, chunk: u32, layer: u32, kv: Kv) -> BlockError {
        match self {
            RowError::Rans(err) => BlockError::Rans {
                chunk,
                layer,
                kv,
                err,
            },
            RowError::BadEscape => BlockError::BadEscape { chunk, layer, kv },
        }
    }
}

/// What reconstructing one non-sink row from its table indices needs.
struct RowRecon<'a> {
    indices: &'a [u8],
    /// Per head, the offset of its tables in `radii`.
    head_from: &'a [usize],
    radii: &'a [i32],
    consts: &'a BlockConsts,
    exps: Exps<'a>,
    /// The row's index among the block's non-sink rows.
    i: usize,
}

impl RowRecon<'_> {
    /// Maps the indices and reconstructs the row in one pass per head (index `i` of a
    /// radius-`R` table is the value `i - R`). Returns `true` if some index is an escape (it
    /// maps to `R + 1`): those channels are redone by [`escapes`](Self::escapes).
    fn values(&self, anchor: Option<&[f32]>, out: &mut [f32]) -> bool {
        let d = self.exps.head_dim;
        let heads = self.head_from.len();
        let mut any_escape = false;
        for (h, &from) in self.head_from.iter().enumerate() {
            let seg = h * d..(h + 1) * d;
            any_escape |= dequantize_indices(
                &self.indices[seg.clone()],
                &self.radii[from..from + d],
                self.consts,
                h * d,
                self.exps.seg_mult(self.i, heads, h),
                anchor.map(|a| &a[seg.clone()]),
                &mut out[seg],
            );
        }
        any_escape
    }

    /// Replaces the escaped channels, in channel order, with the next escape values: check B7.
    fn escapes(
        &self,
        anchor: Option<&[f32]>,
        out: &mut [f32],
        esc: &mut impl Iterator<Item = i32>,
    ) -> Result<(), RowError> {
        let d = self.exps.head_dim;
        let heads = self.head_from.len();
        for (h, &from) in self.head_from.iter().enumerate() {
            let m = self.exps.seg_mult(self.i, heads, h);
            for k in 0..d {
                let ch = h * d + k;
                let radius = self.radii[from + k];
                if i32::from(self.indices[ch]) - radius <= radius {
                    continue;
                }
                let e = esc.next().ok_or(RowError::BadEscape)?;
                if e.unsigned_abs() <= radius as u32 || e.unsigned_abs() > MAX_SYMBOL as u32 {
                    return Err(RowError::BadEscape);
                }
                out[ch] = dequantize_one(self.consts, ch, e, m, anchor.map(|a| a[ch]));
            }
        }
        Ok(())
    }
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

/// Stored sink values widened to f32.
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
