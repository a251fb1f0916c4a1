//! A stream's chunks as lane-decode batches (spec/FORMAT.md §5, §6.1).
//!
//! A value symbol's table depends on its row's step exponent, which other lanes code, so a
//! block decodes in two launches of the same kernel: [`ChunkLanes::exponent_batch`] decodes the
//! first `n_e` symbols of every block (the exponents; the lanes' end checks do not apply to a
//! prefix), then [`ChunkLanes::symbol_batch`] decodes all `n_e + n_sym` symbols with every
//! symbol's table resolved from those exponents, and its lane statuses are the block's checks
//! B6 and B8.
//!
//! This module reads the block structure only (checks B1-B5); the chunk's CRC (C1), escapes
//! (B7, B9) and sink values (B10) are checked by the decoder that uses the symbols.

use codec_core::consts::MAX_SYMBOL;
use codec_core::consts::{LANES, MAX_EXP};
use codec_core::rans::FreqTable;
use codec_core::{Dtype, Stream};
use half::slice::HalfFloatSliceExt;

use crate::error::CudaError;
use crate::quant::{ChannelConsts, DequantBatch, DequantInput};
use crate::rans::{LaneBatch, LaneWords, TableId};

/// One block of a chunk as stored (§5.2), with what decoding its lanes needs.
#[derive(Clone, Debug)]
pub struct CodedBlock<'b> {
    /// Layer.
    pub layer: u32,
    /// 0 for K, 1 for V.
    pub kv: usize,
    /// Words per lane.
    pub lane_len: [usize; LANES],
    /// The lanes' words, lane 0's first, as stored in the chunk.
    pub words: LaneWords<'b>,
    /// The exponent table, if the block has an exponent section.
    pub exp_table: Option<FreqTable>,
    /// Exponent symbols (`(rows - S) * H` with an exponent section, else 0).
    pub n_e: usize,
    /// Value symbols, `(rows - S) * C`.
    pub n_sym: usize,
    /// The escape values in stored order, as stored: each a little-endian i32 (its bits are
    /// the words [`LaneWords::iter`] gives).
    pub escapes: LaneWords<'b>,
    /// The sink rows widened to f32 (§1.2), row-major.
    pub sink: Vec<f32>,
}

/// A chunk's blocks and what resolving their tables needs.
#[derive(Debug)]
pub struct ChunkLanes<'s> {
    stream: &'s Stream<'s>,
    chunk: usize,
    level: u8,
    /// Rows in the chunk, sink rows first.
    rows: usize,
    /// Sink rows.
    sink: usize,
    /// The blocks, layer 0 K, layer 0 V, layer 1 K, ...
    pub blocks: Vec<CodedBlock<'s>>,
}

impl<'s> ChunkLanes<'s> {
    /// Reads chunk `chunk` of `stream` into its blocks (checks B1-B5, and that no byte follows
    /// the last block, C2).
    pub fn read(stream: &'s Stream<'s>, chunk: usize) -> Result<Self, CudaError> {
        let bad = |what| CudaError::Stream { chunk, what };
        let bytes = stream
            .chunk_bytes(chunk)
            .map_err(|_| bad("no such chunk"))?;
        let body = bytes.get(..bytes.len().saturating_sub(4)).unwrap_or(&[]);
        Self::from_body(stream, chunk, body)
    }

    /// [`read`](Self::read) with the chunk's bytes before its CRC given as `body`.
    pub fn from_body(
        stream: &'s Stream<'s>,
        chunk: usize,
        body: &'s [u8],
    ) -> Result<Self, CudaError> {
        let bad = |what| CudaError::Stream { chunk, what };
        let h = stream.header();
        let entry = h.chunks.get(chunk).ok_or(bad("no such chunk"))?;
        let rows = entry.tokens as usize;
        let start = h
            .meta
            .first_position
            .saturating_add(u64::from(entry.token_start));
        let sink = (u64::from(h.n_sink).saturating_sub(start)).min(rows as u64) as usize;
        let c = h.shape.channels();
        let shape = BlockShape {
            n_sym: (rows - sink) * c,
            n_e: (rows - sink) * h.shape.kv_heads as usize,
            sink_bytes: sink * c * h.dtype.size_bytes(),
            dtype: h.dtype,
        };
        let mut r = body;
        // Layers are bounded by the limits the stream was opened with.
        let mut blocks = Vec::with_capacity(2 * h.shape.layers as usize);
        for layer in 0..h.shape.layers {
            for kv in 0..2 {
                let b = read_block(&mut r, &shape, layer, kv).map_err(bad)?;
                blocks.push(b);
            }
        }
        if !r.is_empty() {
            return Err(bad("trailing bytes in chunk"));
        }
        Ok(ChunkLanes {
            stream,
            chunk,
            level: entry.level,
            rows,
            sink,
            blocks,
        })
    }

    /// A batch decoding the first `n_e` symbols (the exponents) of every block, in block order.
    pub fn exponent_batch(&self) -> Result<LaneBatch, CudaError> {
        let mut batch = LaneBatch::new();
        self.add_exponents_to(&mut batch)?;
        Ok(batch)
    }

    /// Adds every block's exponent prefix to `batch`, in block order.
    pub fn add_exponents_to(&self, batch: &mut LaneBatch) -> Result<(), CudaError> {
        for b in &self.blocks {
            let ids = match &b.exp_table {
                Some(t) => vec![batch.add_table(t); b.n_e],
                None => Vec::new(),
            };
            batch.add_stored_block(b.words, b.lane_len, &ids)?;
        }
        Ok(())
    }

    /// A batch decoding every symbol of every block, in block order; `exps[b]` are block `b`'s
    /// exponents (the first `n_e` symbols the exponent batch decoded; ignored without an
    /// exponent section).
    pub fn symbol_batch(&self, exps: &[&[u8]]) -> Result<LaneBatch, CudaError> {
        let mut batch = LaneBatch::new();
        let level = self.add_level_tables(&mut batch);
        self.add_symbols_to(&mut batch, exps, &level)?;
        Ok(batch)
    }

    /// Adds the tables of the chunk's level to `batch` (for [`Self::add_symbols_to`]; chunks
    /// of one stream at one level can share them).
    pub fn add_level_tables(&self, batch: &mut LaneBatch) -> Vec<TableId> {
        let profile = self.stream.profile();
        let tables = &profile.level_tables(self.level).tables;
        tables.iter().map(|t| batch.add_table(&t.freqs)).collect()
    }

    /// Adds every symbol of every block to `batch`, in block order, with `level` the ids of
    /// the chunk's level tables in `batch` ([`Self::add_level_tables`]).
    pub fn add_symbols_to(
        &self,
        batch: &mut LaneBatch,
        exps: &[&[u8]],
        level: &[TableId],
    ) -> Result<(), CudaError> {
        for (i, b) in self.blocks.iter().enumerate() {
            let exp = b.exp_table.as_ref().map(|t| batch.add_table(t));
            let block_exps = exps.get(i).copied().unwrap_or(&[]);
            let ids: Vec<TableId> = self
                .table_ids(b, block_exps)
                // `table_ids` yields `Exponent` only for a block with an exponent table.
                .filter_map(|t| match t {
                    SymbolTable::Exponent => exp,
                    SymbolTable::Level(t) => level.get(usize::from(t)).copied(),
                })
                .collect();
            if ids.len() != b.n_e + b.n_sym {
                return Err(CudaError::Stream {
                    chunk: self.chunk,
                    what: "a symbol's table is not in the level's tables",
                });
            }
            batch.add_stored_block(b.words, b.lane_len, &ids)?;
        }
        Ok(())
    }

    /// The chunk's stream.
    pub fn stream(&self) -> &'s Stream<'s> {
        self.stream
    }

    /// The chunk's index in its stream.
    pub fn chunk(&self) -> usize {
        self.chunk
    }

    /// The chunk's level.
    pub fn level(&self) -> u8 {
        self.level
    }

    /// Block `b`'s table of every symbol (as [`symbol_batch`](Self::symbol_batch) resolves
    /// them), for a reference decoder; empty if there is no block `b`.
    pub fn symbol_tables(&self, b: usize, exps: &[u8]) -> Vec<&FreqTable> {
        let Some(blk) = self.blocks.get(b) else {
            return Vec::new();
        };
        let tables = &self.stream.profile().level_tables(self.level).tables;
        self.table_ids(blk, exps)
            .filter_map(|t| match t {
                SymbolTable::Exponent => blk.exp_table.as_ref(),
                SymbolTable::Level(t) => tables.get(usize::from(t)).map(|t| &t.freqs),
            })
            .collect()
    }

    /// Every symbol's table: the exponent table for the first `n_e`, then each value symbol's.
    fn table_ids<'a>(
        &'a self,
        b: &'a CodedBlock<'_>,
        exps: &'a [u8],
    ) -> impl Iterator<Item = SymbolTable> + 'a {
        let exps = if b.exp_table.is_some() { exps } else { &[] };
        let values = (0..b.n_sym).map(move |g| SymbolTable::Level(self.value_table(b, exps, g)));
        std::iter::repeat_n(SymbolTable::Exponent, b.n_e).chain(values)
    }

    /// The level table id of value symbol `g` of block `b` (§6.1): the map's table for its
    /// kind and channel, followed down its exponent's number of times.
    fn value_table(&self, b: &CodedBlock<'_>, exps: &[u8], g: usize) -> u8 {
        let h = self.stream.header();
        let (c, d, heads) = (
            h.shape.channels(),
            h.shape.head_dim as usize,
            h.shape.kv_heads,
        );
        let (r, ch) = (self.sink + g / c, g % c);
        let kind = usize::from(r % usize::from(h.group.max(1)) != 0);
        let e = exps
            .get((r - self.sink) * heads as usize + ch / d)
            .copied()
            .unwrap_or(0);
        let profile = self.stream.profile();
        let base = profile.table_map(self.level, b.layer, b.kv, kind)[ch];
        profile.table_at(self.level, base, e)
    }

    /// Block `b`'s value symbols from its decoded table indices `indices` (all `n_e + n_sym`
    /// symbols of the symbol launch) and exponents (§6.4): index `i` of a radius-`R` table is
    /// `i - R`, and `2R + 1` takes the next escape value. Checks B7 and B9.
    pub fn symbol_values(
        &self,
        b: usize,
        indices: &[u8],
        exps: &[u8],
    ) -> Result<Vec<i32>, CudaError> {
        let bad = |what| CudaError::Stream {
            chunk: self.chunk,
            what,
        };
        let blk = self.blocks.get(b).ok_or(bad("no such block"))?;
        let values = indices
            .get(blk.n_e..blk.n_e + blk.n_sym)
            .ok_or(bad("too few symbols"))?;
        let tables = &self.stream.profile().level_tables(self.level).tables;
        let exps = if blk.exp_table.is_some() { exps } else { &[] };
        let mut escapes = blk.escapes.iter();
        let mut out = Vec::with_capacity(values.len());
        for (g, &i) in values.iter().enumerate() {
            let t = tables.get(usize::from(self.value_table(blk, exps, g)));
            let radius = i32::from(t.ok_or(bad("unknown table"))?.radius);
            let q = i32::from(i) - radius;
            if q <= radius {
                out.push(q);
                continue;
            }
            let e = escapes.next().ok_or(bad("escape without a value (B7)"))? as i32;
            if e.unsigned_abs() <= radius as u32 || e.unsigned_abs() > MAX_SYMBOL as u32 {
                return Err(bad("escape value out of range (B7)"));
            }
            out.push(e);
        }
        if escapes.next().is_some() {
            return Err(bad("unused escape values (B9)"));
        }
        Ok(out)
    }

    /// Adds every block of the chunk to `batch`. `values[b]` and `exps[b]` are block `b`'s
    /// symbol values and exponents; `dest` says where the sequence's tensors are (per layer K
    /// then V, `dest.tensor_stride` elements apart from `dest.base`).
    pub fn add_to_dequant(
        &self,
        batch: &mut DequantBatch,
        values: &[Vec<i32>],
        exps: &[&[u8]],
        dest: Destination,
    ) -> Result<(), CudaError> {
        let h = self.stream.header();
        let profile = self.stream.profile();
        let mult = profile.level_multipliers()[usize::from(self.level)];
        let token_start = h.chunks[self.chunk].token_start;
        for (b, blk) in self.blocks.iter().enumerate() {
            let consts = ChannelConsts::of_block(profile.channel_params(blk.layer, blk.kv), mult);
            let consts_start = batch.add_consts(&consts);
            let out_start = dest.tensor_start(blk.layer, blk.kv)?;
            batch.add_block(DequantInput {
                q: values.get(b).map(Vec::as_slice).unwrap_or(&[]),
                exps: blk
                    .exp_table
                    .as_ref()
                    .map(|_| exps.get(b).copied().unwrap_or(&[])),
                sink: &blk.sink,
                consts_start,
                rows: self.rows as u32,
                group: u32::from(h.group),
                out_start,
                token_start,
                page_start: dest.page_start,
            })?;
        }
        Ok(())
    }

    /// Rows in the chunk.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Sink rows of the chunk (§5.3).
    pub fn sink_rows(&self) -> usize {
        self.sink
    }
}

/// Where a sequence's decoded tensors go in a decode's output: tensor `(layer, kv)` starts at
/// element `base + (2 * layer + kv) * tensor_stride`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Destination {
    /// Element of layer 0's K tensor.
    pub base: u64,
    /// Elements from one tensor to the next: `T * C` for dense `[T, H, D]` tensors,
    /// `num_pages * page_size * C` for paged ones.
    pub tensor_stride: u64,
    /// Where the sequence's page table starts in the plan
    /// ([`DecodePlan::add_page_table`](crate::decode::DecodePlan::add_page_table); paged only).
    pub page_start: u64,
}

impl Destination {
    /// Dense `[tokens, H, D]` tensors of `channels` channels, per layer K then V, from element 0.
    pub fn dense(tokens: u32, channels: usize) -> Self {
        Destination {
            base: 0,
            tensor_stride: u64::from(tokens) * channels as u64,
            page_start: 0,
        }
    }

    /// The element tensor `(layer, kv)` starts at; an input error where it overflows.
    pub(crate) fn tensor_start(&self, layer: u32, kv: usize) -> Result<u64, CudaError> {
        (u64::from(layer) * 2 + kv as u64)
            .checked_mul(self.tensor_stride)
            .and_then(|x| x.checked_add(self.base))
            .ok_or(CudaError::Input {
                what: "output offsets overflow",
            })
    }
}

/// The table of one coded symbol.
#[derive(Clone, Copy)]
enum SymbolTable {
    /// The block's exponent table.
    Exponent,
    /// A table of the chunk's level.
    Level(u8),
}

/// Sizes every block of a chunk shares.
struct BlockShape {
    n_sym: usize,
    n_e: usize,
    sink_bytes: usize,
    dtype: Dtype,
}

/// Reads one block from the front of `r` (checks B1-B5).
fn read_block<'b>(
    r: &mut &'b [u8],
    shape: &BlockShape,
    layer: u32,
    kv: usize,
) -> Result<CodedBlock<'b>, &'static str> {
    let n_escapes = take_u32(r)? as usize;
    if n_escapes > shape.n_sym {
        return Err("escape count above the symbol count (B1)");
    }
    let mut lane_len = [0usize; LANES];
    for l in lane_len.iter_mut() {
        *l = take_u32(r)? as usize;
    }
    let n_exp = usize::from(take(r, 1)?[0]);
    if n_exp == 1 || n_exp > usize::from(MAX_EXP) + 1 {
        return Err("step exponent alphabet size (B2)");
    }
    let exp_table = match n_exp {
        0 => None,
        n => {
            let f = take(r, 2 * n)?;
            let freqs: Vec<u16> = f
                .chunks_exact(2)
                .map(|b| u16::from_le_bytes([b[0], b[1]]))
                .collect();
            Some(FreqTable::new(&freqs).map_err(|_| "exponent table (B3)")?)
        }
    };
    let sink = widen(take(r, shape.sink_bytes)?, shape.dtype);
    if !sink.iter().all(|x| x.is_finite()) {
        return Err("sink value not finite (B10)");
    }
    let escapes = LaneWords::from_le_bytes(take(r, 4 * n_escapes)?).ok_or("escapes (B4)")?;
    let total: usize = lane_len.iter().sum();
    let words = take(r, total.checked_mul(4).ok_or("lane words (B5)")?)?;
    let words = LaneWords::from_le_bytes(words).ok_or("lane words (B5)")?;
    Ok(CodedBlock {
        layer,
        kv,
        lane_len,
        words,
        n_e: if exp_table.is_some() { shape.n_e } else { 0 },
        exp_table,
        n_sym: shape.n_sym,
        escapes,
        sink,
    })
}

/// The first `n` bytes of `r`, which then starts after them.
fn take<'a>(r: &mut &'a [u8], n: usize) -> Result<&'a [u8], &'static str> {
    if r.len() < n {
        return Err("truncated block (B4/B5)");
    }
    let (head, rest) = r.split_at(n);
    *r = rest;
    Ok(head)
}

fn take_u32(r: &mut &[u8]) -> Result<u32, &'static str> {
    let b = take(r, 4)?;
    Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

/// Stored values in `dtype`, little-endian, widened to f32 (exact; §1.2).
fn widen(raw: &[u8], dtype: Dtype) -> Vec<f32> {
    match dtype {
        Dtype::F16 => {
            // The slice conversion uses the CPU's F16C where it has it (8 at a time).
            let stored: Vec<half::f16> = (raw.chunks_exact(2))
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]))
                .collect();
            let mut wide = vec![0.0f32; stored.len()];
            stored.convert_to_f32_slice(&mut wide);
            wide
        }
        Dtype::Bf16 => raw
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::F32 => raw
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
    }
}
