//! **Experiment, not part of any format**: a 32-lane rANS coder with a 32-bit state and 16-bit
//! words (`kernels/rans32_experiment.cu` has its arithmetic), to measure whether format v2's
//! 64-bit state bounds the GPU lane decoder (issue 19, item 5; spec/FORMAT.md, appendix
//! "Proposed: format v3 lane coder"). v2 streams are untouched: [`Lane32Batch::encode`]
//! re-encodes the symbols a v2 [`LaneBatch`] decoded to, with the same tables, so that the v2
//! kernel and this one decode the same symbols, and [`Lane32Batch::payload_bytes`] compares the
//! sizes with [`LaneBatch::payload_bytes`].

use std::collections::HashMap;

use crate::error::CudaError;
use crate::ffi::{LANES, SLOTS};
use crate::rans::{decode_host_parts, LaneBatch, LaneBlock, LaneBuffers, LaneDecoded, LaneShape};

/// The state's lower bound `L` (the interval is `[2^16, 2^32)`).
const L: u32 = 1 << 16;
/// Table precision (as v2: 4096 slots).
const PRECISION: u32 = 12;

/// A lane batch of the 32-bit coder: the buffers of a [`LaneBatch`] (tables, table lists,
/// per-symbol table indices, blocks) with 16-bit words; block word counts are in 16-bit words.
#[derive(Clone, Debug, Default)]
pub struct Lane32Batch {
    words: Vec<u16>,
    tables: Vec<u32>,
    table_list: Vec<u32>,
    symbol_table: Vec<u16>,
    blocks: Vec<LaneBlock>,
}

/// Per symbol value, its frequency and cumulative frequency, read from a packed table.
fn freq_cdf(packed: &[u32]) -> [(u32, u32); 256] {
    let mut out = [(0u32, 0u32); 256];
    for (slot, &e) in packed.iter().enumerate() {
        if e >> 20 == 0 {
            out[(e & 0xFF) as usize] = ((e >> 8) & 0xFFF, slot as u32);
        }
    }
    out
}

/// One lane's words: `symbols` (with their `(freq, cdf)`), encoded last to first, then the
/// state flushed low half first (the decoder reads from the end).
fn encode_lane(symbols: impl DoubleEndedIterator<Item = (u32, u32)>) -> Option<Vec<u16>> {
    let mut x = L;
    let mut words = Vec::new();
    for (f, c) in symbols.rev() {
        if f == 0 {
            return None;
        }
        if x >= f << 20 {
            words.push(x as u16);
            x >>= 16;
        }
        x = ((x / f) << PRECISION) + x % f + c;
    }
    words.push(x as u16);
    words.push((x >> 16) as u16);
    Some(words)
}

impl Lane32Batch {
    /// Re-encodes every block of `batch` with the 32-bit coder: the symbols `decoded` holds
    /// (the v2 kernel's output for `batch`), each with the table `batch` gives it. Errors if a
    /// block did not decode or names a symbol its table does not have.
    pub fn encode(batch: &LaneBatch, decoded: &LaneDecoded) -> Result<Self, CudaError> {
        let bad = |what| CudaError::Input { what };
        let b = batch.buffers();
        let mut tables: HashMap<u32, [(u32, u32); 256]> = HashMap::new();
        let mut out = Lane32Batch {
            tables: b.tables.to_vec(),
            table_list: b.table_list.to_vec(),
            symbol_table: b.symbol_table.to_vec(),
            ..Lane32Batch::default()
        };
        for (i, blk) in b.blocks.iter().enumerate() {
            decoded
                .outcome(i)
                .map_err(|_| bad("a block the v2 kernel did not decode"))?;
            let symbols = decoded.symbols(i);
            let start = blk.symbol_start as usize;
            let list = b
                .table_list
                .get(blk.table_start as usize..)
                .ok_or(bad("a block's table list outside the batch"))?;
            let mut new = LaneBlock {
                word_start: out.words.len() as u64,
                ..*blk
            };
            for lane in 0..LANES {
                let mut pairs = Vec::new();
                for p in (lane..symbols.len()).step_by(LANES) {
                    let id = *list
                        .get(usize::from(b.symbol_table[start + p]))
                        .ok_or(bad("a symbol's table outside its block's list"))?;
                    let packed = b
                        .tables
                        .get(id as usize * SLOTS..(id as usize + 1) * SLOTS)
                        .ok_or(bad("a table outside the batch"))?;
                    let fc = tables.entry(id).or_insert_with(|| freq_cdf(packed));
                    pairs.push(fc[usize::from(symbols[p])]);
                }
                let words =
                    encode_lane(pairs.into_iter()).ok_or(bad("a symbol its table lacks"))?;
                new.lane_len[lane] = words.len() as u32;
                out.words.extend(words);
            }
            out.blocks.push(new);
        }
        Ok(out)
    }

    /// Bytes of every block's lane words (2 per word).
    pub fn payload_bytes(&self) -> usize {
        self.words.len() * 2
    }

    /// The words, for tests that corrupt them (the kernel checks every range).
    pub fn words_mut(&mut self) -> &mut [u16] {
        &mut self.words
    }

    /// The blocks, for tests that corrupt them.
    pub fn blocks_mut(&mut self) -> &mut [LaneBlock] {
        &mut self.blocks
    }

    /// The launch's input buffers.
    pub(crate) fn buffers(&self) -> LaneBuffers<'_, u16> {
        LaneBuffers {
            words: &self.words,
            tables: &self.tables,
            table_list: &self.table_list,
            symbol_table: &self.symbol_table,
            blocks: &self.blocks,
        }
    }

    /// A launch's output as [`LaneDecoded`] (statuses as [`crate::rans::LaneStatus`]: a lane
    /// of fewer than 2 words is `ZeroFinalWord`, a final state other than `2^16`
    /// `BadFinalState`).
    pub(crate) fn decoded(&self, symbols: Vec<u8>, status: Vec<u32>) -> LaneDecoded {
        LaneDecoded::new(symbols, status, self.blocks.clone())
    }

    /// Decodes every block with the experiment's kernel compiled for the host,
    /// `shared_tables` tables per block staged in shared memory, one block per CUDA block.
    pub fn decode_host(&self, shared_tables: u32) -> Result<LaneDecoded, CudaError> {
        self.decode_host_shaped(LaneShape::new(1, shared_tables)?)
    }

    /// Decodes every block with the experiment's kernel compiled for the host, launched in
    /// `shape`.
    pub fn decode_host_shaped(&self, shape: LaneShape) -> Result<LaneDecoded, CudaError> {
        let (symbols, status) = decode_host_parts(
            &self.words,
            (&self.tables, &self.table_list, &self.symbol_table),
            &self.blocks,
            shape,
        )?;
        Ok(self.decoded(symbols, status))
    }
}
