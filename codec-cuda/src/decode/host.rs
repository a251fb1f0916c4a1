//! The chain run on the kernels compiled for the host, the twin of a device decode bit for bit
//! ([`DecodePlan::decode_chain_host`]).

use super::{check_crcs, check_crcs_host, check_gather, Chain, DecodePlan, DEFAULT_CHAIN_FUSED};
use crate::copy_runs::MERGE_GAP_BYTES;
use crate::error::CudaError;
use crate::ffi::{self, LANES};
use crate::quant::OutLayout;
use crate::rans::{LaneBlock, LaneShape};

impl DecodePlan<'_> {
    /// Runs the plan as one chain of launches of the kernels compiled for the host (as a
    /// device runs it by default): the output's f16 or bf16 bits.
    pub fn decode_chain_host(&self) -> Result<Vec<u16>, CudaError> {
        self.decode_chain_host_as((DEFAULT_CHAIN_FUSED, false))
    }

    #[cfg(feature = "internals")]
    /// [`decode_chain_host`](Self::decode_chain_host) with the tables in the lane decoders'
    /// compact form (as a `Gpu` decodes after `set_lane_tables_compact(true)`).
    pub fn decode_chain_host_compact(&self) -> Result<Vec<u16>, CudaError> {
        self.decode_chain_host_as((DEFAULT_CHAIN_FUSED, true))
    }

    #[cfg(feature = "internals")]
    /// [`decode_chain_host`](Self::decode_chain_host) as the fused chain (as a `Gpu` decodes
    /// after `set_decode_chain_fused(true)`).
    pub fn decode_chain_host_fused(&self) -> Result<Vec<u16>, CudaError> {
        self.decode_chain_host_as((true, false))
    }

    /// The chain run on the host, `fused` or not, its tables `compact` or packed.
    fn decode_chain_host_as(&self, fused_compact: (bool, bool)) -> Result<Vec<u16>, CudaError> {
        let ch = self.chain()?;
        check_crcs_host(&ch.checks)?;
        let mut out = vec![0u16; self.output.len];
        self.run_chain_host(&ch, &ch.words(), &ch.escapes(), &mut out, fused_compact)?;
        Ok(out)
    }

    /// [`decode_chain_host`](Self::decode_chain_host) with the lane words gathered from `raw`,
    /// the bytes every stream of the plan lies in, by the host-run word gather: as
    /// `Gpu::upload_plan_from` gathers them on a device from the bytes it copied.
    pub fn decode_chain_host_from(&self, raw: &[u8]) -> Result<Vec<u16>, CudaError> {
        self.decode_chain_host_from_runs(raw, MERGE_GAP_BYTES)
    }

    #[cfg(any(test, feature = "fuzzing"))]
    /// [`decode_chain_host_from`](Self::decode_chain_host_from) with every needed range of
    /// `raw` copied as a run of its own unless it touches the one before (no gap merged), so
    /// that the word gather and the chunk checks read every block's words and every chunk at
    /// an offset other than its place in `raw`.
    pub fn decode_chain_host_from_apart(&self, raw: &[u8]) -> Result<Vec<u16>, CudaError> {
        self.decode_chain_host_from_runs(raw, 0)
    }

    /// The chain run on the host with its lane words gathered from the runs of `raw` that
    /// hold them, merged across gaps of at most `gap` bytes.
    fn decode_chain_host_from_runs(&self, raw: &[u8], gap: usize) -> Result<Vec<u16>, CudaError> {
        let ch = self.chain()?;
        let places = ch.gather_parts(raw, gap)?;
        let copied = places.runs.gather(raw)?;
        let mut words = vec![0u32; ch.n_words];
        let mut escapes = vec![0i32; ch.n_escapes];
        let mut status = vec![0u32; places.parts.len()];
        ffi::host_gather_words(ffi::GatherIo {
            raw: &copied,
            words: &mut words,
            escapes: &mut escapes,
            parts: &places.parts,
            n_word_parts: places.word_parts,
            status: &mut status,
        })?;
        check_gather(&status)?;
        let mut status = vec![0u32; places.checks.len()];
        ffi::host_check_chunks(ffi::CheckIo {
            raw: &copied,
            checks: &places.checks,
            status: &mut status,
        })?;
        check_crcs(&ch.checks, &status)?;
        let mut out = vec![0u16; self.output.len];
        let fused = (DEFAULT_CHAIN_FUSED, false);
        self.run_chain_host(&ch, &words, &escapes, &mut out, fused)?;
        Ok(out)
    }

    /// The chain's launches on the host into `out` (the plan's output), `words` and
    /// `escapes` the chain's lane words and escape values; `fused` as [`ffi::ChainDev::fused`] (four launches, or five), and
    /// `compact` whether the lane decodes read compact tables ([`crate::Gpu`]'s
    /// `set_lane_tables_compact`).
    pub(super) fn run_chain_host(
        &self,
        ch: &Chain<'_>,
        words: &[u32],
        escapes: &[i32],
        out: &mut [u16],
        (fused, compact): (bool, bool),
    ) -> Result<(), CudaError> {
        if self.output.layout == (OutLayout::Paged { page_size: 0 }) {
            return Err(CudaError::Input {
                what: "a page size of 0",
            });
        }
        let (heads, head_dim) = (self.heads, self.head_dim);
        // Compact tables are read through the cache, none staged (as on a device).
        let staged = if compact {
            0
        } else {
            LaneShape::MAX_SHARED_TABLES
        };
        let shape = LaneShape::new(1, staged)?;
        let tables = ch.expanded_tables(compact)?;
        let words = LaneInputs {
            words,
            tables: &tables,
            compact,
        };
        let (exps, exp_status) = ch.host_exps(words, shape)?;
        let maps = ch.table_maps(&exps, (heads, head_dim));
        // The fused chain leaves the tables to the launches after (no table index a symbol);
        // its resolution status is 0.
        let mut sym_table = vec![0u16; if fused { 0 } else { ch.n_symbols }];
        let mut resolve_status = vec![0u32; ch.resolve.len()];
        if !fused {
            ffi::host_resolve_tables(ffi::ResolveIo {
                symbol_table: &mut sym_table,
                maps,
                status: &mut resolve_status,
            })?;
        }
        let mut symbols = vec![0u8; ch.n_symbols];
        let mut sym_status = vec![0u32; ch.sym_blocks.len() * LANES];
        let sym_out = (&mut symbols[..], &mut sym_status[..]);
        let sym_io = ch.lane_io(words, shape, (&sym_table, &ch.sym_blocks), sym_out);
        match fused {
            true => ffi::host_lane_decode_mapped(sym_io, maps)?,
            false => ffi::host_lane_decode(sym_io)?,
        }
        let mut q = vec![0i32; ch.n_q];
        let mut value_status = vec![0u32; ch.values.len()];
        ffi::host_map_values(ffi::ValueIo {
            indices: &symbols,
            symbol_table: &sym_table,
            table_list: &ch.table_list,
            radius: &ch.radius,
            escapes,
            q: &mut q,
            blocks: &ch.values,
            status: &mut value_status,
            from_map: fused.then_some(maps),
        })?;
        let mut dq_status = vec![0u32; ch.resolve.len()];
        let mut io = ch.dequant.io_with(&q, &exps, out, &mut dq_status);
        io.mapped = fused.then_some(ffi::MappedValues {
            values: &ch.values,
            resolve: &ch.resolve,
            indices: &symbols,
            map: &ch.map,
            table_list: &ch.table_list,
            radius: &ch.radius,
        });
        ffi::host_dequant(io)?;
        let (exp, resolve, sym, value) = (&exp_status, &resolve_status, &sym_status, &value_status);
        ch.check(exp, resolve, sym, value, &dq_status)
    }
}

impl Chain<'_> {
    /// The exponent lanes run on the host over `words` (the chain's lane words and expanded
    /// tables): the decoded exponents and the lanes' statuses.
    pub(super) fn host_exps(
        &self,
        words: LaneInputs<'_>,
        shape: LaneShape,
    ) -> Result<(Vec<u8>, Vec<u32>), CudaError> {
        let mut exps = vec![0u8; self.n_exps];
        let mut status = vec![0u32; self.exp_blocks.len() * LANES];
        let no_tables = vec![0u16; self.n_exps];
        let out = (&mut exps[..], &mut status[..]);
        ffi::host_lane_decode(self.lane_io(words, shape, (&no_tables, &self.exp_blocks), out))?;
        Ok((exps, status))
    }

    /// Where the chain's value symbols find their tables, given its decoded exponents `exps`
    /// and the row shape.
    pub(super) fn table_maps<'a>(
        &'a self,
        exps: &'a [u8],
        (heads, head_dim): (u32, u32),
    ) -> ffi::TableMaps<'a> {
        ffi::TableMaps {
            resolve: &self.resolve,
            exps,
            map: &self.map,
            heads,
            head_dim,
        }
    }

    /// A host-run lane decode of `blocks` over the chain's words and expanded tables (each
    /// symbol's table in `symbol_table`) into `(symbols, status)`.
    pub(super) fn lane_io<'a>(
        &'a self,
        inputs: LaneInputs<'a>,
        shape: LaneShape,
        (symbol_table, blocks): (&'a [u16], &'a [LaneBlock]),
        (symbols, status): (&'a mut [u8], &'a mut [u32]),
    ) -> ffi::LaneDecodeIo<'a> {
        ffi::LaneDecodeIo {
            words: inputs.words,
            tables: inputs.tables,
            compact: inputs.compact,
            table_list: &self.table_list,
            symbol_table,
            blocks,
            symbols,
            status,
            shape,
        }
    }
}

/// A host-run chain's lane inputs: its lane words, and its tables expanded in the packed or
/// (`compact`) the compact form.
#[derive(Clone, Copy, Debug)]
pub(super) struct LaneInputs<'a> {
    pub(super) words: &'a [u32],
    pub(super) tables: &'a [u32],
    pub(super) compact: bool,
}
