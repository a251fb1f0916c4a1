//! The kernels launched one batch at a time, each step's output read back (feature
//! `internals`): lane decode and encode, dequantization, quantization and the stepwise decode,
//! for the crate's tests, benches and device bench.

use cudarc::driver::CudaSlice;

use crate::decode::{check_dequant, DecodePlan};
use crate::encode::{EncodeStatus, LaneEncodeBatch, LaneEncoded, QuantBatch};
use crate::error::CudaError;
use crate::experiment::Lane32Batch;
use crate::ffi::{self, DevBuf, LaneWord, LANES};
use crate::quant::{statuses, DequantBatch, DequantStatus, OutLayout};
use crate::rans::{LaneBatch, LaneBuffers, LaneDecoded};

use super::{dequant_kernel, Gpu};

impl Gpu {
    /// Decodes every block of `batch` on the device (as [`LaneBatch::decode_host`] does on the
    /// host): words, tables and block headers uploaded, one launch, symbols and statuses back.
    pub fn lane_decode(&self, batch: &LaneBatch) -> Result<LaneDecoded, CudaError> {
        let t = self.lane_shape;
        let dev = self.run_once(
            |g| g.upload_lanes(batch.buffers()),
            |g, k, d| ffi::launch_lane_decode(&g.stream, &k.lane_decode, d, t),
        )?;
        let s = &self.stream;
        Ok(batch.decoded(dev.symbols.download(s)?, dev.status.download(s)?))
    }

    fn upload_lanes<W: LaneWord>(
        &self,
        b: LaneBuffers<'_, W>,
    ) -> Result<ffi::LaneDecodeDev<W>, CudaError> {
        let s = &self.stream;
        Ok(ffi::LaneDecodeDev {
            words: DevBuf::upload(s, b.words)?,
            tables: DevBuf::upload(s, b.tables)?,
            table_list: DevBuf::upload(s, b.table_list)?,
            symbol_table: DevBuf::upload(s, b.symbol_table)?,
            blocks: DevBuf::upload(s, b.blocks)?,
            symbols: DevBuf::zeros(s, b.symbol_table.len())?,
            status: DevBuf::zeros(s, b.blocks.len() * LANES)?,
            compact: false,
        })
    }

    /// For benches: the best time in seconds of `reps` lane-decode launches over `batch`,
    /// uploaded once (the kernel alone: each launch queued, then the stream synchronized).
    pub fn time_lane_decode(&self, batch: &LaneBatch, reps: usize) -> Result<f64, CudaError> {
        let t = self.lane_shape;
        self.time_launches(
            reps,
            |g| g.upload_lanes(batch.buffers()),
            |g, k, d| ffi::launch_lane_decode(&g.stream, &k.lane_decode, d, t),
        )
    }

    /// Not part of any format: decodes `batch` with the 32-bit-state experiment's kernel (as
    /// [`Lane32Batch::decode_host`] does on the host).
    pub fn lane32_decode_experiment(&self, batch: &Lane32Batch) -> Result<LaneDecoded, CudaError> {
        let t = self.lane_shape;
        let dev = self.run_once(
            |g| g.upload_lanes(batch.buffers()),
            |g, k, d| ffi::launch_lane_decode(&g.stream, &k.lane32_experiment, d, t),
        )?;
        let s = &self.stream;
        Ok(batch.decoded(dev.symbols.download(s)?, dev.status.download(s)?))
    }

    /// For benches: [`time_lane_decode`](Self::time_lane_decode) for the 32-bit-state
    /// experiment's kernel.
    pub fn time_lane32_decode_experiment(
        &self,
        batch: &Lane32Batch,
        reps: usize,
    ) -> Result<f64, CudaError> {
        let t = self.lane_shape;
        self.time_launches(
            reps,
            |g| g.upload_lanes(batch.buffers()),
            |g, k, d| ffi::launch_lane_decode(&g.stream, &k.lane32_experiment, d, t),
        )
    }

    /// Runs the dequantization kernel over `batch` on the device into `out`, a device buffer of
    /// at least the batch's output length on [`stream`](Self::stream); the blocks' statuses.
    pub fn dequant_into(
        &self,
        batch: &DequantBatch,
        out: &mut CudaSlice<u16>,
    ) -> Result<Vec<DequantStatus>, CudaError> {
        if batch.output().layout == (OutLayout::Paged { page_size: 0 }) {
            return Err(CudaError::Input {
                what: "a page size of 0",
            });
        }
        let o = batch.output();
        let dev = self.run_once(
            |g| g.upload_dequant(batch),
            |g, k, d| ffi::launch_dequant(&g.stream, dequant_kernel(k, o), d, out, o.len),
        )?;
        Ok(statuses(dev.status.download(&self.stream)?))
    }

    fn upload_dequant(&self, batch: &DequantBatch) -> Result<ffi::DequantDev, CudaError> {
        let s = &self.stream;
        let io = batch.io(&mut [], &mut []);
        Ok(ffi::DequantDev {
            q: DevBuf::upload(s, io.q)?,
            exps: DevBuf::upload(s, io.exps)?,
            sink: DevBuf::upload(s, io.sink)?,
            consts: DevBuf::upload(s, io.consts)?,
            pages: DevBuf::upload(s, io.pages)?,
            blocks: DevBuf::upload(s, io.blocks)?,
            status: DevBuf::zeros(s, io.blocks.len())?,
            heads: io.heads,
            head_dim: io.head_dim,
            page_size: io.page_size,
        })
    }

    /// For benches: the best time in seconds of `reps` dequantization launches over `batch`
    /// into `out`, uploaded once (the kernel alone).
    pub fn time_dequant(
        &self,
        batch: &DequantBatch,
        out: &mut CudaSlice<u16>,
        reps: usize,
    ) -> Result<f64, CudaError> {
        let o = batch.output();
        self.time_launches(
            reps,
            |g| g.upload_dequant(batch),
            |g, k, d| ffi::launch_dequant(&g.stream, dequant_kernel(k, o), d, out, o.len),
        )
    }

    /// [`dequant_into`](Self::dequant_into) a zeroed buffer, downloaded: as
    /// [`DequantBatch::decode_host`] gives it.
    pub fn dequant(
        &self,
        batch: &DequantBatch,
    ) -> Result<(Vec<u16>, Vec<DequantStatus>), CudaError> {
        let len = batch.output().len;
        let mut out = self
            .stream
            .alloc_zeros::<u16>(len.max(1))
            .map_err(ffi::driver_err("cuMemAllocAsync"))?;
        let status = self.dequant_into(batch, &mut out)?;
        let mut host = self
            .stream
            .clone_dtoh(&out)
            .map_err(ffi::driver_err("cuMemcpyDtoHAsync"))?;
        host.truncate(len);
        Ok((host, status))
    }

    /// The three-launch path with the host's steps between launches (table resolution and
    /// value mapping on the host; [`DecodePlan::decode_host`]'s order), into `out`.
    pub fn decode_into_stepwise(
        &self,
        plan: &DecodePlan<'_>,
        out: &mut CudaSlice<u16>,
    ) -> Result<(), CudaError> {
        plan.check_crcs_host()?;
        let exp_out = self.lane_decode(&plan.exponent_batch()?)?;
        let exps = plan.exponents(&exp_out)?;
        let sym_out = self.lane_decode(&plan.symbol_batch(&exps)?)?;
        let batch = plan.dequant_batch(&sym_out, &exps)?;
        check_dequant(&self.dequant_into(&batch, out)?)
    }
}

impl Gpu {
    fn upload_quant(&self, batch: &QuantBatch) -> Result<ffi::QuantDev, CudaError> {
        let s = &self.stream;
        let io = batch.io(&mut [], &mut []);
        Ok(ffi::QuantDev {
            x: DevBuf::upload(s, io.x)?,
            exps: DevBuf::upload(s, io.exps)?,
            consts: DevBuf::upload(s, io.consts)?,
            q: DevBuf::zeros(s, batch.q_len())?,
            blocks: DevBuf::upload(s, io.blocks)?,
            status: DevBuf::zeros(s, io.blocks.len())?,
            heads: io.heads,
            head_dim: io.head_dim,
        })
    }

    /// Quantizes every block of `batch` on the device: as [`QuantBatch::quantize_host`]
    /// gives it.
    pub fn quantize(&self, batch: &QuantBatch) -> Result<Vec<(Vec<i32>, EncodeStatus)>, CudaError> {
        let dev = self.run_once(
            |g| g.upload_quant(batch),
            |g, k, d| ffi::launch_quantize(&g.stream, &k.quantize, d),
        )?;
        let s = &self.stream;
        Ok(batch.quantized(dev.q.download(s)?, dev.status.download(s)?))
    }

    /// For benches: the best time in seconds of `reps` quantization launches over `batch`,
    /// uploaded once (the kernel alone).
    pub fn time_quantize(&self, batch: &QuantBatch, reps: usize) -> Result<f64, CudaError> {
        self.time_launches(
            reps,
            |g| g.upload_quant(batch),
            |g, k, d| ffi::launch_quantize(&g.stream, &k.quantize, d),
        )
    }

    fn upload_lane_encode(&self, batch: &LaneEncodeBatch) -> Result<ffi::LaneEncodeDev, CudaError> {
        let s = &self.stream;
        let io = batch.io(&mut [], &mut [], &mut []);
        Ok(ffi::LaneEncodeDev {
            symbols: DevBuf::upload(s, io.symbols)?,
            symbol_table: DevBuf::upload(s, io.symbol_table)?,
            tables: DevBuf::upload(s, io.tables)?,
            table_list: DevBuf::upload(s, io.table_list)?,
            words: DevBuf::zeros(s, batch.n_words())?,
            lane_len: DevBuf::zeros(s, io.blocks.len() * LANES)?,
            blocks: DevBuf::upload(s, io.blocks)?,
            status: DevBuf::zeros(s, io.blocks.len() * LANES)?,
        })
    }

    /// Encodes every block of `batch` on the device: as [`LaneEncodeBatch::encode_host`]
    /// gives it.
    pub fn lane_encode(&self, batch: &LaneEncodeBatch) -> Result<LaneEncoded, CudaError> {
        let dev = self.run_once(
            |g| g.upload_lane_encode(batch),
            |g, k, d| ffi::launch_lane_encode(&g.stream, &k.lane_encode, d),
        )?;
        let s = &self.stream;
        Ok(batch.encoded(
            dev.words.download(s)?,
            dev.lane_len.download(s)?,
            dev.status.download(s)?,
        ))
    }

    /// For benches: the best time in seconds of `reps` lane-encode launches over `batch`,
    /// uploaded once (the kernel alone).
    pub fn time_lane_encode(&self, batch: &LaneEncodeBatch, reps: usize) -> Result<f64, CudaError> {
        self.time_launches(
            reps,
            |g| g.upload_lane_encode(batch),
            |g, k, d| ffi::launch_lane_encode(&g.stream, &k.lane_encode, d),
        )
    }
}
