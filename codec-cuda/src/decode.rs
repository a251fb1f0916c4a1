//! Decoding a batch of chunks (of one or several streams of the same model) with the kernels:
//! three launches for the whole batch, however many chunks and layers it holds.
//!
//! 1. `kvc_rans_lane_decode` over the exponent prefix of every block of every chunk;
//! 2. `kvc_rans_lane_decode` over every symbol, each with its table resolved from the exponents
//!    (spec/FORMAT.md §6.1; on the host between the launches);
//! 3. `kvc_dequant_f16` or `kvc_dequant_bf16` over every block, after the table indices became
//!    symbol values with escapes (§6.4, on the host), into one output buffer: dense `[T, H, D]`
//!    tensors or vLLM's pages.
//!
//! [`DecodePlan::decode_host`] runs the kernels compiled for the CPU; `Gpu::decode` runs the
//! same three launches on a device. Both check every chunk's CRC (C1) and block structure
//! (B1-B10) and report a failing chunk as [`CudaError::Stream`], never panicking.

use codec_core::Stream;

use crate::error::CudaError;
use crate::quant::{DequantBatch, DequantStatus, OutLayout, Output};
use crate::rans::{LaneBatch, LaneDecoded, TableId};
use crate::stream::{ChunkLanes, Destination};

/// A chunk of a plan: its blocks and where its rows go.
#[derive(Debug)]
struct PlannedChunk<'s> {
    /// Index of the chunk's stream in the plan's streams.
    stream: usize,
    lanes: ChunkLanes<'s>,
    dest: Destination,
    /// Index of the chunk's first block in the plan's blocks.
    first_block: usize,
}

/// Chunks to decode in one batch, and the output they are written to.
#[derive(Debug)]
pub struct DecodePlan<'s> {
    heads: u32,
    head_dim: u32,
    output: Output,
    page_tables: Vec<u32>,
    /// The plan's streams by address (compared only, to share their level tables).
    streams: Vec<usize>,
    chunks: Vec<PlannedChunk<'s>>,
    blocks: usize,
}

impl<'s> DecodePlan<'s> {
    /// An empty plan for streams of `heads` KV heads of `head_dim` channels, writing `output`.
    pub fn new(heads: u32, head_dim: u32, output: Output) -> Self {
        DecodePlan {
            heads,
            head_dim,
            output,
            page_tables: Vec::new(),
            streams: Vec::new(),
            chunks: Vec::new(),
            blocks: 0,
        }
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
        let shape = stream.header().shape;
        if shape.kv_heads != self.heads || shape.head_dim != self.head_dim {
            return Err(CudaError::Input {
                what: "a stream's heads or head size differ from the plan's",
            });
        }
        let bad = |what| CudaError::Stream { chunk, what };
        let bytes = stream
            .chunk_bytes(chunk)
            .map_err(|_| bad("no such chunk"))?;
        let body_len = bytes
            .len()
            .checked_sub(4)
            .ok_or(bad("chunk shorter than its CRC"))?;
        let (body, crc) = bytes.split_at(body_len);
        if crc32c(body) != u32::from_le_bytes([crc[0], crc[1], crc[2], crc[3]]) {
            return Err(bad("chunk CRC mismatch (C1)"));
        }
        let lanes = ChunkLanes::from_body(stream, chunk, body)?;
        let id = stream as *const Stream<'s> as usize;
        let index = match self.streams.iter().position(|&s| s == id) {
            Some(i) => i,
            None => {
                self.streams.push(id);
                self.streams.len() - 1
            }
        };
        let first_block = self.blocks;
        self.blocks += lanes.blocks.len();
        self.chunks.push(PlannedChunk {
            stream: index,
            lanes,
            dest,
            first_block,
        });
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

    /// Chunks in the plan.
    pub fn chunks(&self) -> usize {
        self.chunks.len()
    }

    /// The first launch: every block's exponent prefix.
    pub fn exponent_batch(&self) -> Result<LaneBatch, CudaError> {
        let mut batch = LaneBatch::new();
        for c in &self.chunks {
            c.lanes.add_exponents_to(&mut batch)?;
        }
        Ok(batch)
    }

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

    /// The second launch: every symbol of every block, level tables shared per (stream, level).
    pub fn symbol_batch(&self, exps: &[&[u8]]) -> Result<LaneBatch, CudaError> {
        let mut batch = LaneBatch::new();
        let mut level_tables: Vec<((usize, u8), Vec<TableId>)> = Vec::new();
        for c in &self.chunks {
            let key = (c.stream, c.lanes.level());
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

    /// Runs the three kernels compiled for the host: the output's f16 or bf16 bits (elements
    /// no chunk writes are 0).
    pub fn decode_host(&self) -> Result<Vec<u16>, CudaError> {
        let exp_out = self
            .exponent_batch()?
            .decode_host(LaneBatch::MAX_SHARED_TABLES)?;
        let exps = self.exponents(&exp_out)?;
        let sym_out = self
            .symbol_batch(&exps)?
            .decode_host(LaneBatch::MAX_SHARED_TABLES)?;
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

/// CRC-32C (Castagnoli), as codec-core checks chunks (spec/FORMAT.md §1.4).
fn crc32c(bytes: &[u8]) -> u32 {
    const CRC: crc::Crc<u32, crc::Table<16>> =
        crc::Crc::<u32, crc::Table<16>>::new(&crc::CRC_32_ISCSI);
    CRC.checksum(bytes)
}
