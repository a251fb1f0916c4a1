//! The encode chain run on the kernels compiled for the host, the twin of a device encode byte
//! for byte ([`EncodePlan::encode_host`]).

use crate::encode::LaneEncodeBlock;
use crate::error::CudaError;
use crate::ffi::{self, LANES};

use super::{split_sealed, ChunkResult, EncResult, EncodeChain, EncodePlan, SealResult};

impl<'c, 'p> EncodePlan<'c, 'p> {
    /// Runs the chain on the kernels compiled for the host over `src` (the source buffer's
    /// bytes, little-endian elements): every chunk's bytes, blocks and CRC, as
    /// [`ChunkContext::encode_chunk`](codec_core::ChunkContext::encode_chunk) returns them.
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
            let ch = self.chain_of(&crate::levels::LevelCache::default(), piece)?;
            chunks.extend(self.run_chain_host(&ch, src, 0)?);
        }
        Ok(chunks)
    }

    /// [`encode_host`](Self::encode_host) with the launches' large outputs (those a `Gpu`
    /// keeps between calls, not zeroed) holding `fill` in every byte before the first.
    pub(super) fn encode_host_over(&self, src: &[u8], fill: u8) -> Result<Vec<Vec<u8>>, CudaError> {
        self.run_chain_host(&self.chain()?, src, fill)
    }

    /// The launches of `ch` (this plan's chain) run on the host over `src`, the outputs
    /// holding `fill` before the first as in [`encode_host_over`](Self::encode_host_over).
    pub(super) fn run_chain_host(
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
    pub(super) fn blocks_host(
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
    pub(super) fn write_host(
        &self,
        ch: &EncodeChain,
        src: &[u8],
        run: &mut HostRun,
    ) -> Result<(), CudaError> {
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
}

/// The launches' outputs of a host run.
#[derive(Debug)]
pub(super) struct HostRun {
    /// The levels' tables, then the exponent slots.
    tables: Vec<u32>,
    symbols: Vec<u8>,
    symbol_table: Vec<u16>,
    q: Vec<i32>,
    escapes: Vec<i32>,
    pub(super) results: Vec<EncResult>,
    lane_blocks: Vec<LaneEncodeBlock>,
    words: Vec<u32>,
    pub(super) lane_len: Vec<u32>,
    pub(super) lane_status: Vec<u32>,
    block_at: Vec<u64>,
    pub(super) chunk_results: Vec<ChunkResult>,
    sealed: Vec<u8>,
    pub(super) seal_results: Vec<SealResult>,
}

impl HostRun {
    /// Outputs for `ch`'s launches: those a `Gpu` keeps in its scratch (symbols, their
    /// tables, values, escapes, words, block places, sealed bytes) with `fill` in every byte,
    /// the rest (results, lane records, statuses) zeroed, as a `Gpu` zeroes them.
    pub(super) fn new(ch: &EncodeChain, fill: u8) -> Self {
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
    pub(super) fn lanes_host(&mut self, ch: &EncodeChain) -> Result<(), CudaError> {
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
