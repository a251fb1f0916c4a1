//! Batches for the dequantization kernel (`kernels/dequant.cu`, spec/FORMAT.md §7): coded
//! blocks' symbol values, step exponents and sink rows to f16 or bf16 rows, many blocks (chunks,
//! layers, K and V, sequences) per launch, written into one output buffer: densely (e.g. per
//! layer K then V, each `[T, H, D]`) or into pages as vLLM keeps them (per tensor
//! `[num_pages, page_size, H, D]`, token `t` in page `table[t / page_size]`, slot
//! `t % page_size`).

use codec_core::quant::{BlockConsts, ChannelParams};

use crate::error::CudaError;
use crate::ffi;

/// The constants of one channel at a level (§7.1), as codec-core computes them
/// (`BlockConsts`). `#[repr(C)]`: the kernel reads it as is (`src/ffi/`, invariant 1).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ChannelConsts {
    /// Channel mean.
    pub mean: f32,
    /// `anchor_step * level multiplier`.
    pub anchor_step: f32,
    /// `delta_step * level multiplier`.
    pub delta_step: f32,
    /// `weight / 16`.
    pub weight: f32,
}

impl ChannelConsts {
    /// The constants of one `(layer, K/V)`'s channels at level multiplier `mult`.
    pub fn of_block(params: &[ChannelParams], mult: f32) -> Vec<Self> {
        let k = BlockConsts::new(params, mult);
        (0..k.channels())
            .map(|c| ChannelConsts {
                mean: k.mean[c],
                anchor_step: k.anchor_step[c],
                delta_step: k.delta_step[c],
                weight: k.weight[c],
            })
            .collect()
    }
}

/// A block's place in its batch's buffers (`KvcDequantBlock`). Any values are safe to launch:
/// the kernel checks them and reports [`DequantStatus::BadRange`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DequantBlock {
    /// Index of the symbol value of non-sink row 0, channel 0.
    pub q_start: u64,
    /// Index of the exponent of non-sink row 0, head 0 (if `has_exps`).
    pub exp_start: u64,
    /// Index of sink row 0, channel 0.
    pub sink_start: u64,
    /// Index in the output of the tensor's element 0 (token 0 dense, page 0 slot 0 paged).
    pub out_start: u64,
    /// Index in the batch's page tables of the sequence's table (paged output).
    pub page_start: u64,
    /// Index of channel 0's constants.
    pub consts_start: u64,
    /// Rows, sink rows first.
    pub rows: u32,
    /// Sink rows.
    pub sink_rows: u32,
    /// Token-group size (anchor rows are the rows `r` with `r % group == 0`).
    pub group: u32,
    /// 1 if the block has step exponents, 0 if they are all 0.
    pub has_exps: u32,
    /// The sequence position of row 0.
    pub token_start: u32,
    /// Unused (0).
    pub reserved: u32,
}

/// How a block ended (`KvcDequantStatus`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum DequantStatus {
    /// Every row written.
    Ok,
    /// The block's ranges lie outside the batch or its shape is invalid; nothing written.
    BadRange,
    /// Paged output: a row's page-table entry or page lies outside the batch; nothing written.
    BadPage,
    /// A code the kernel does not define (never written by the kernel).
    Unknown(u32),
}

/// One block to add to a [`DequantBatch`].
#[derive(Clone, Copy, Debug)]
pub struct DequantInput<'a> {
    /// Symbol values of the non-sink rows, row-major (`(rows - sink_rows) * C`).
    pub q: &'a [i32],
    /// Step exponents, one per (non-sink row, head), or `None` (all 0).
    pub exps: Option<&'a [u8]>,
    /// Sink rows widened to f32, row-major (`sink_rows * C`).
    pub sink: &'a [f32],
    /// Where the block's channel constants start ([`DequantBatch::add_consts`]).
    pub consts_start: u64,
    /// Rows, sink rows first.
    pub rows: u32,
    /// Token-group size.
    pub group: u32,
    /// Index in the output of the tensor's element 0: token `t`, channel `c` is element
    /// `out_start + t * C + c` (dense) or `out_start + (table[t / page_size] * page_size +
    /// t % page_size) * C + c` (paged, `table` the sequence's page table).
    pub out_start: u64,
    /// The sequence position of row 0 (the chunk's first token).
    pub token_start: u32,
    /// Where the sequence's page table starts ([`DequantBatch::add_page_table`]; paged output).
    pub page_start: u64,
}

/// The output's element type.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum OutDtype {
    /// IEEE binary16.
    #[default]
    F16,
    /// bfloat16.
    Bf16,
}

impl OutDtype {
    /// The kernel entry point that writes this type.
    pub fn entry(self) -> &'static str {
        match self {
            OutDtype::F16 => "kvc_dequant_f16",
            OutDtype::Bf16 => "kvc_dequant_bf16",
        }
    }
}

/// Where a launch writes its rows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum OutLayout {
    /// Each tensor `[T, H, D]`.
    #[default]
    Dense,
    /// Each tensor `[num_pages, page_size, H, D]` with a page table per sequence.
    Paged {
        /// Tokens per page (> 0).
        page_size: u32,
    },
}

/// A launch's output: its element type, layout and length in elements.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Output {
    /// Element type.
    pub dtype: OutDtype,
    /// Layout.
    pub layout: OutLayout,
    /// Elements (values no block writes stay as they were: 0 on the host).
    pub len: usize,
}

/// The buffers of one dequantization launch.
#[derive(Clone, Debug)]
pub struct DequantBatch {
    output: Output,
    pages: Vec<u32>,
    q: Vec<i32>,
    exps: Vec<u8>,
    sink: Vec<f32>,
    consts: Vec<ChannelConsts>,
    blocks: Vec<DequantBlock>,
    heads: u32,
    head_dim: u32,
}

impl DequantBatch {
    /// An empty batch of blocks with `heads * head_dim` channels, writing a dense output of
    /// `out_len` f16 values.
    pub fn new(heads: u32, head_dim: u32, out_len: usize) -> Self {
        let output = Output {
            len: out_len,
            ..Output::default()
        };
        Self::with_output(heads, head_dim, output)
    }

    /// An empty batch of blocks with `heads * head_dim` channels writing `output`.
    pub fn with_output(heads: u32, head_dim: u32, output: Output) -> Self {
        DequantBatch {
            output,
            pages: Vec::new(),
            q: Vec::new(),
            exps: Vec::new(),
            sink: Vec::new(),
            consts: Vec::new(),
            blocks: Vec::new(),
            heads,
            head_dim,
        }
    }

    /// The launch's output.
    pub fn output(&self) -> Output {
        self.output
    }

    /// Adds a sequence's page table (page ids, one per `page_size` tokens); returns where it
    /// starts, for [`DequantInput::page_start`].
    pub fn add_page_table(&mut self, table: &[u32]) -> u64 {
        let start = self.pages.len() as u64;
        self.pages.extend_from_slice(table);
        start
    }

    /// Adds one `(layer, K/V, level)`'s channel constants; returns where they start.
    pub fn add_consts(&mut self, consts: &[ChannelConsts]) -> u64 {
        let start = self.consts.len() as u64;
        self.consts.extend_from_slice(consts);
        start
    }

    /// Adds a block; returns its index. Refuses sizes that do not match the block's shape.
    pub fn add_block(&mut self, b: DequantInput<'_>) -> Result<usize, CudaError> {
        let input = |what| CudaError::Input { what };
        let c = self.heads as usize * self.head_dim as usize;
        let sink_rows = b.sink.len().checked_div(c).unwrap_or(0);
        let coded = (b.rows as usize)
            .checked_sub(sink_rows)
            .ok_or(input("sink rows > rows"))?;
        if b.sink.len() != sink_rows * c || b.q.len() != coded * c {
            return Err(input("symbol or sink values do not fill whole rows"));
        }
        if b.exps
            .is_some_and(|e| e.len() != coded * self.heads as usize)
        {
            return Err(input("not one exponent per non-sink row and head"));
        }
        self.blocks.push(DequantBlock {
            q_start: self.q.len() as u64,
            exp_start: self.exps.len() as u64,
            sink_start: self.sink.len() as u64,
            out_start: b.out_start,
            page_start: b.page_start,
            consts_start: b.consts_start,
            rows: b.rows,
            sink_rows: sink_rows as u32,
            group: b.group,
            has_exps: u32::from(b.exps.is_some()),
            token_start: b.token_start,
            reserved: 0,
        });
        self.q.extend_from_slice(b.q);
        self.exps.extend_from_slice(b.exps.unwrap_or(&[]));
        self.sink.extend_from_slice(b.sink);
        Ok(self.blocks.len() - 1)
    }

    /// Makes room for `blocks` more blocks with `sink` sink values in all.
    pub(crate) fn reserve_external(&mut self, blocks: usize, sink: usize) {
        self.blocks.reserve(blocks);
        self.sink.reserve(sink);
    }

    /// Adds a block whose symbol values and exponents another launch writes (at `q_start` and
    /// `exp_start` of those buffers), with its sink rows; returns its index.
    pub(crate) fn add_block_external(&mut self, mut block: DequantBlock, sink: &[f32]) -> usize {
        block.sink_start = self.sink.len() as u64;
        self.sink.extend_from_slice(sink);
        self.blocks.push(block);
        self.blocks.len() - 1
    }

    /// The launch's buffers with symbol values `q` and exponents `exps` from other launches.
    pub(crate) fn io_with<'a>(
        &'a self,
        q: &'a [i32],
        exps: &'a [u8],
        out: &'a mut [u16],
        status: &'a mut [u32],
    ) -> ffi::DequantIo<'a> {
        ffi::DequantIo {
            q,
            exps,
            ..self.io(out, status)
        }
    }

    /// The blocks, for tests that corrupt them (the kernel checks every field).
    pub fn blocks_mut(&mut self) -> &mut [DequantBlock] {
        &mut self.blocks
    }

    /// The launch's buffers, as the kernel reads them.
    pub(crate) fn io<'a>(
        &'a self,
        out: &'a mut [u16],
        status: &'a mut [u32],
    ) -> ffi::DequantIo<'a> {
        ffi::DequantIo {
            q: &self.q,
            exps: &self.exps,
            sink: &self.sink,
            consts: &self.consts,
            blocks: &self.blocks,
            out,
            status,
            heads: self.heads,
            head_dim: self.head_dim,
            pages: &self.pages,
            page_size: self.page_size(),
            dtype: self.output.dtype,
            mapped: None,
        }
    }

    /// Tokens per page, 0 for dense output.
    pub(crate) fn page_size(&self) -> u32 {
        match self.output.layout {
            OutLayout::Dense => 0,
            OutLayout::Paged { page_size } => page_size,
        }
    }

    /// Blocks in the batch.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether the batch has no block.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Runs the kernel compiled for the host: the output (f16 or bf16 bits; values no block
    /// wrote are 0) and each block's status.
    pub fn decode_host(&self) -> Result<(Vec<u16>, Vec<DequantStatus>), CudaError> {
        if self.output.layout == (OutLayout::Paged { page_size: 0 }) {
            return Err(CudaError::Input {
                what: "a page size of 0",
            });
        }
        let mut out = vec![0u16; self.output.len];
        let mut status = vec![0u32; self.blocks.len()];
        ffi::host_dequant(self.io(&mut out, &mut status))?;
        Ok((out, statuses(status)))
    }
}

/// The kernel's status codes as [`DequantStatus`].
pub(crate) fn statuses(codes: Vec<u32>) -> Vec<DequantStatus> {
    let status = codes.into_iter().map(|s| match s {
        0 => DequantStatus::Ok,
        1 => DequantStatus::BadRange,
        2 => DequantStatus::BadPage,
        c => DequantStatus::Unknown(c),
    });
    status.collect()
}

/// The kernel's f32 to f16 narrowing (spec/FORMAT.md §1.2), run on the host, for tests.
pub fn f32_to_f16_bits(x: f32) -> u16 {
    ffi::kernel_f32_to_f16(x)
}

/// The kernel's f32 to bf16 narrowing (spec/FORMAT.md §1.2), run on the host, for tests.
pub fn f32_to_bf16_bits(x: f32) -> u16 {
    ffi::kernel_f32_to_bf16(x)
}
