//! Batches for the encode kernels (`kernels/encode.cu`): quantization of coded blocks' rows to
//! symbol values (spec/FORMAT.md §7, codec-core's `quantize_block`) and the 32-lane rANS
//! encoder (§6.3, codec-core's `encode_lanes`), many blocks per launch, bit for bit codec-core.

use codec_core::rans::FreqTable;

use crate::error::CudaError;
use crate::ffi::{self, LANES};
use crate::quant::ChannelConsts;

/// How a block (quantization) or a lane (lane encode) ended (`KvcEncodeStatus`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum EncodeStatus {
    /// Done.
    Ok,
    /// The block's ranges lie outside the batch or its shape is invalid; nothing written.
    BadRange,
    /// A symbol's table index is out of range or its table gives it frequency 0; the lane
    /// stopped there.
    BadSymbol,
    /// A code the kernel does not define (never written by the kernel).
    Unknown(u32),
}

impl EncodeStatus {
    fn from_code(code: u32) -> Self {
        match code {
            0 => EncodeStatus::Ok,
            1 => EncodeStatus::BadRange,
            2 => EncodeStatus::BadSymbol,
            c => EncodeStatus::Unknown(c),
        }
    }
}

/// A block's place in a quantization launch (`KvcQuantBlock`). Any values are safe to launch:
/// the kernel checks them. `#[repr(C)]`: the kernel reads it as is (`src/ffi/`, invariant 1).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QuantBlock {
    /// Index of row 0 (sink rows first), channel 0 in the batch's values.
    pub x_start: u64,
    /// Index of the exponent of non-sink row 0, head 0 (if `has_exps`).
    pub exp_start: u64,
    /// Index of the symbol of non-sink row 0, channel 0 in the output.
    pub q_start: u64,
    /// Index of channel 0's constants.
    pub consts_start: u64,
    /// Rows, sink rows first.
    pub rows: u32,
    /// Sink rows (not quantized; anchors as they are).
    pub sink_rows: u32,
    /// Token-group size.
    pub group: u32,
    /// 1 if the block has step exponents.
    pub has_exps: u32,
}

/// The buffers of one quantization launch.
#[derive(Clone, Debug)]
pub struct QuantBatch {
    x: Vec<f32>,
    exps: Vec<u8>,
    consts: Vec<ChannelConsts>,
    blocks: Vec<QuantBlock>,
    q_len: usize,
    heads: u32,
    head_dim: u32,
}

impl QuantBatch {
    /// An empty batch of blocks with `heads * head_dim` channels.
    pub fn new(heads: u32, head_dim: u32) -> Self {
        QuantBatch {
            x: Vec::new(),
            exps: Vec::new(),
            consts: Vec::new(),
            blocks: Vec::new(),
            q_len: 0,
            heads,
            head_dim,
        }
    }

    /// Adds one `(layer, K/V, level)`'s channel constants; returns where they start.
    pub fn add_consts(&mut self, consts: &[ChannelConsts]) -> u64 {
        let start = self.consts.len() as u64;
        self.consts.extend_from_slice(consts);
        start
    }

    /// Adds a block: `x` its rows (`rows * C`, sink rows first, row-major), `exps` one step
    /// exponent per (non-sink row, head) or `None`. Returns the block's index.
    pub fn add_block(
        &mut self,
        x: &[f32],
        sink_rows: u32,
        group: u32,
        exps: Option<&[u8]>,
        consts_start: u64,
    ) -> Result<usize, CudaError> {
        let input = |what| CudaError::Input { what };
        let c = self.heads as usize * self.head_dim as usize;
        if c == 0 || !x.len().is_multiple_of(c) {
            return Err(input("values do not fill whole rows"));
        }
        let rows = u32::try_from(x.len() / c).map_err(|_| input("over 2^32 rows"))?;
        let coded = rows
            .checked_sub(sink_rows)
            .ok_or(input("sink rows > rows"))? as usize;
        if exps.is_some_and(|e| e.len() != coded * self.heads as usize) {
            return Err(input("not one exponent per non-sink row and head"));
        }
        self.blocks.push(QuantBlock {
            x_start: self.x.len() as u64,
            exp_start: self.exps.len() as u64,
            q_start: self.q_len as u64,
            consts_start,
            rows,
            sink_rows,
            group,
            has_exps: u32::from(exps.is_some()),
        });
        self.x.extend_from_slice(x);
        self.exps.extend_from_slice(exps.unwrap_or(&[]));
        self.q_len += coded * c;
        Ok(self.blocks.len() - 1)
    }

    /// The blocks, for tests that corrupt them (the kernel checks every field).
    pub fn blocks_mut(&mut self) -> &mut [QuantBlock] {
        &mut self.blocks
    }

    /// Runs the kernel compiled for the host: every block's symbol values (empty for a block
    /// that is not [`EncodeStatus::Ok`]) and statuses.
    pub fn quantize_host(&self) -> Result<Vec<(Vec<i32>, EncodeStatus)>, CudaError> {
        let mut q = vec![0i32; self.q_len];
        let mut status = vec![0u32; self.blocks.len()];
        ffi::host_quantize(self.io(&mut q, &mut status))?;
        Ok(self.quantized(q, status))
    }

    /// The launch's buffers, as the kernel reads them.
    pub(crate) fn io<'a>(&'a self, q: &'a mut [i32], status: &'a mut [u32]) -> ffi::QuantIo<'a> {
        ffi::QuantIo {
            x: &self.x,
            exps: &self.exps,
            consts: &self.consts,
            q,
            blocks: &self.blocks,
            status,
            heads: self.heads,
            head_dim: self.head_dim,
        }
    }

    /// Symbol values in the launch's output.
    pub(crate) fn q_len(&self) -> usize {
        self.q_len
    }

    /// A launch's output as each block's values and status.
    pub(crate) fn quantized(&self, q: Vec<i32>, status: Vec<u32>) -> Vec<(Vec<i32>, EncodeStatus)> {
        let c = self.heads as usize * self.head_dim as usize;
        let out = self.blocks.iter().zip(status).map(|(b, s)| {
            let s = EncodeStatus::from_code(s);
            let len = (b.rows - b.sink_rows.min(b.rows)) as usize * c;
            let start = usize::try_from(b.q_start).unwrap_or(usize::MAX);
            let values = match s {
                EncodeStatus::Ok => q.get(start..start + len).unwrap_or(&[]).to_vec(),
                _ => Vec::new(),
            };
            (values, s)
        });
        out.collect()
    }
}

/// A table added to a [`LaneEncodeBatch`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EncTableId(u32);

/// A block's place in a lane-encode launch (`KvcLaneEncodeBlock`). `#[repr(C)]`: the kernel
/// reads it as is (`src/ffi/`, invariant 1).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LaneEncodeBlock {
    /// Index of the block's symbol 0.
    pub symbol_start: u64,
    /// Index of lane 0's output slot.
    pub word_start: u64,
    /// Symbols in the block.
    pub n_symbols: u32,
    /// Words per lane slot.
    pub lane_cap: u32,
    /// The block's tables in the table list.
    pub table_start: u32,
    /// See `table_start`.
    pub table_count: u32,
}

/// The buffers of one lane-encode launch.
#[derive(Clone, Debug, Default)]
pub struct LaneEncodeBatch {
    symbols: Vec<u8>,
    symbol_table: Vec<u16>,
    tables: Vec<u32>,
    table_list: Vec<u32>,
    blocks: Vec<LaneEncodeBlock>,
    n_words: usize,
}

/// Entries of one encode table.
const ENC_TABLE: usize = 256;

/// `table` in the lane encoder's form: per symbol its frequency (bits 0..16) and cumulative
/// frequency (bits 16..32), 0 beyond its symbols.
pub(crate) fn encode_table(table: &FreqTable) -> [u32; ENC_TABLE] {
    let mut entries = [0u32; ENC_TABLE];
    for (s, e) in entries.iter_mut().enumerate().take(table.len()) {
        *e = table.freq(s) | table.cdf(s) << 16;
    }
    entries
}

impl LaneEncodeBatch {
    /// An empty batch.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `table` in the kernel's encode form (per symbol its frequency and cumulative
    /// frequency, 1 KiB).
    pub fn add_table(&mut self, table: &FreqTable) -> EncTableId {
        let id = EncTableId((self.tables.len() / ENC_TABLE) as u32);
        self.tables.extend_from_slice(&encode_table(table));
        id
    }

    /// Adds a block: `symbols[p]` (a table index) is coded with table `tables[p]`. Returns the
    /// block's index.
    pub fn add_block(&mut self, symbols: &[u8], tables: &[EncTableId]) -> Result<usize, CudaError> {
        let input = |what| CudaError::Input { what };
        if symbols.len() != tables.len() {
            return Err(input("not one table per symbol"));
        }
        let n_tables = (self.tables.len() / ENC_TABLE) as u32;
        if tables.iter().any(|t| t.0 >= n_tables) {
            return Err(input("a symbol's table is not in the batch"));
        }
        let n_symbols = u32::try_from(symbols.len()).map_err(|_| input("over 2^32 symbols"))?;
        let lane_cap = n_symbols.div_ceil(LANES as u32) + 2;
        let table_start = u32::try_from(self.table_list.len())
            .map_err(|_| input("over 2^32 table-list entries"))?;
        let mut list: Vec<u32> = Vec::new();
        let mut index = Vec::with_capacity(tables.len());
        let mut slot_of = std::collections::HashMap::new();
        for t in tables {
            let i = match slot_of.get(&t.0) {
                Some(&i) => i,
                None => {
                    let i = u16::try_from(list.len()).map_err(|_| input("over 65536 tables"))?;
                    list.push(t.0);
                    slot_of.insert(t.0, i);
                    i
                }
            };
            index.push(i);
        }
        self.blocks.push(LaneEncodeBlock {
            symbol_start: self.symbols.len() as u64,
            word_start: self.n_words as u64,
            n_symbols,
            lane_cap,
            table_start,
            table_count: list.len() as u32,
        });
        self.symbols.extend_from_slice(symbols);
        self.symbol_table.extend(index);
        self.table_list.extend(list);
        self.n_words += lane_cap as usize * LANES;
        Ok(self.blocks.len() - 1)
    }

    /// The blocks, for tests that corrupt them (the kernel checks every field).
    pub fn blocks_mut(&mut self) -> &mut [LaneEncodeBlock] {
        &mut self.blocks
    }

    /// Runs the kernel compiled for the host: every block's lanes.
    pub fn encode_host(&self) -> Result<LaneEncoded, CudaError> {
        let mut words = vec![0u32; self.n_words];
        let mut lane_len = vec![0u32; self.blocks.len() * LANES];
        let mut status = vec![0u32; self.blocks.len() * LANES];
        ffi::host_lane_encode(self.io(&mut words, &mut lane_len, &mut status))?;
        Ok(self.encoded(words, lane_len, status))
    }

    /// The launch's buffers, as the kernel reads them.
    pub(crate) fn io<'a>(
        &'a self,
        words: &'a mut [u32],
        lane_len: &'a mut [u32],
        status: &'a mut [u32],
    ) -> ffi::LaneEncodeIo<'a> {
        ffi::LaneEncodeIo {
            symbols: &self.symbols,
            symbol_table: &self.symbol_table,
            tables: &self.tables,
            table_list: &self.table_list,
            words,
            lane_len,
            blocks: &self.blocks,
            status,
        }
    }

    /// Words of the launch's lane slots.
    pub(crate) fn n_words(&self) -> usize {
        self.n_words
    }

    /// A launch's output as [`LaneEncoded`].
    pub(crate) fn encoded(
        &self,
        words: Vec<u32>,
        lane_len: Vec<u32>,
        status: Vec<u32>,
    ) -> LaneEncoded {
        LaneEncoded {
            words,
            lane_len,
            status: status.into_iter().map(EncodeStatus::from_code).collect(),
            blocks: self.blocks.clone(),
        }
    }
}

/// The output of a lane-encode launch.
#[derive(Clone, Debug)]
pub struct LaneEncoded {
    words: Vec<u32>,
    lane_len: Vec<u32>,
    status: Vec<EncodeStatus>,
    blocks: Vec<LaneEncodeBlock>,
}

impl LaneEncoded {
    /// Block `b`'s lanes' words (as codec-core's `encode_lanes` returns them), or the first
    /// failing lane and its status.
    pub fn lanes(&self, b: usize) -> Result<[Vec<u32>; LANES], (usize, EncodeStatus)> {
        let blk = self.blocks.get(b).ok_or((0, EncodeStatus::BadRange))?;
        let mut out: [Vec<u32>; LANES] = std::array::from_fn(|_| Vec::new());
        for (l, lane) in out.iter_mut().enumerate() {
            let at = b * LANES + l;
            let s = self
                .status
                .get(at)
                .copied()
                .unwrap_or(EncodeStatus::BadRange);
            if s != EncodeStatus::Ok {
                return Err((l, s));
            }
            let start = blk.word_start as usize + blk.lane_cap as usize * l;
            let len = (self.lane_len[at] as usize).min(blk.lane_cap as usize);
            *lane = self.words.get(start..start + len).unwrap_or(&[]).to_vec();
        }
        Ok(out)
    }
}

/// The quantizer's rounding of `r / step` (round half away from zero, clamped to
/// `±MAX_SYMBOL`, NaN to 0), run on the host, for tests.
pub fn quantize_one(r: f32, step: f32) -> i32 {
    ffi::kernel_quantize_one(r, step)
}
