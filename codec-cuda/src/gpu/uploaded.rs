//! A decode plan uploaded whole ([`UploadedPlan`]) and its chain of launches, and the decodes
//! built on it.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};

use crate::copy_runs::MERGE_GAP_BYTES;
use crate::decode::{check_chain, check_crcs_host, Chain, DecodePlan};
use crate::error::CudaError;
use crate::ffi;
use crate::quant::{OutLayout, Output};

use super::{dequant_kernel, queued, Gpu, HostBuffer, Kernels, QueuedChain, WordSource};

/// An input error for a paged output of page size 0.
pub(super) fn check_page_size(plan: &DecodePlan<'_>) -> Result<(), CudaError> {
    match plan.output().layout {
        OutLayout::Paged { page_size: 0 } => Err(CudaError::Input {
            what: "a page size of 0",
        }),
        _ => Ok(()),
    }
}

/// A [`DecodePlan`]'s chain uploaded to one device ([`Gpu::upload_plan`]): every input of its
/// launches (words, tables, table maps, block headers, sink rows, constants, page tables)
/// in one device allocation, decoded by [`Gpu::decode_uploaded_into`] any number of times with
/// no host work but the launches and the statuses.
#[derive(Debug)]
pub struct UploadedPlan {
    queued: QueuedChain,
    /// Per block, its chunk (for errors).
    chunk_of: Vec<usize>,
    output: Output,
    /// The stream (so the device) it was uploaded to.
    stream: Arc<CudaStream>,
}

impl UploadedPlan {
    /// The output the plan writes.
    pub fn output(&self) -> Output {
        self.output
    }
}

impl Gpu {
    /// Decodes every chunk of `plan` into `out`, a device buffer of at least the plan's output
    /// length (e.g. a serving engine's KV pages) on [`stream`](Self::stream): every input
    /// uploaded at once ([`upload_plan`](Self::upload_plan)), then one chain of launches
    /// (exponents, symbols, values with escapes, dequantization; see
    /// [`set_decode_chain_fused`](Self::set_decode_chain_fused)) with no host step between
    /// them, then the statuses. A plan of more than about
    /// [`set_decode_piece_blocks`](Self::set_decode_piece_blocks) coded blocks goes in pieces,
    /// each piece's upload beside the launches of the one before; the bits are the same.
    pub fn decode_into(
        &self,
        plan: &DecodePlan<'_>,
        out: &mut CudaSlice<u16>,
    ) -> Result<(), CudaError> {
        self.decode_in_pieces(plan, None, out)
    }

    /// Builds `plan`'s chain and uploads every input of its launches to this device in one
    /// copy from pinned memory (each block's words copied once, from the plan into the
    /// staging buffer), to be decoded by [`decode_uploaded_into`](Self::decode_uploaded_into)
    /// once or many times.
    pub fn upload_plan(&self, plan: &DecodePlan<'_>) -> Result<UploadedPlan, CudaError> {
        self.upload_plan_timed(plan, None, None)
    }

    /// [`upload_plan`](Self::upload_plan); with `times`, the seconds of building the chain, of
    /// its upload queued and done (the packed copy, and with `host` the copy of the bytes as
    /// they lie, the word gather and the chunk checks) and of its statuses read and checked.
    pub(super) fn upload_plan_timed(
        &self,
        plan: &DecodePlan<'_>,
        host: Option<&HostBuffer>,
        times: Option<&mut [f64; 3]>,
    ) -> Result<UploadedPlan, CudaError> {
        check_page_size(plan)?;
        let t0 = std::time::Instant::now();
        let (chain, levels) = self.resident_chain(plan, 0..plan.chunks(), &self.stream)?;
        let raw = match host {
            None => {
                check_crcs_host(&chain.checks)?;
                None
            }
            Some(h) => {
                let bytes = h.as_slice()?;
                Some((bytes, chain.gather_parts(bytes, MERGE_GAP_BYTES)?))
            }
        };
        let source = WordSource::of(&raw, None);
        let t1 = std::time::Instant::now();
        let queued = {
            let mut staging = self.staging.lock().unwrap_or_else(|e| e.into_inner());
            let on = (&self.stream, &mut staging[0]);
            let mut q = self.queue_chain(&chain, source, on, 0, Some(levels), &self.stream)?;
            self.sync()?;
            q.free_raw();
            q
        };
        let t2 = std::time::Instant::now();
        queued.check_gathered_on(&self.stream, &chain.checks)?;
        if let Some(times) = times {
            let secs = |a: std::time::Instant, b: std::time::Instant| (b - a).as_secs_f64();
            *times = [secs(t0, t1), secs(t1, t2), t2.elapsed().as_secs_f64()];
        }
        Ok(UploadedPlan {
            queued,
            chunk_of: chain.chunk_of,
            output: plan.output(),
            stream: self.stream.clone(),
        })
    }

    /// Runs an uploaded plan's chain of launches into `out` (as
    /// [`decode_into`](Self::decode_into)), then reads its verdict, and its statuses to name
    /// the failing chunk when the verdict fails.
    pub fn decode_uploaded_into(
        &self,
        up: &UploadedPlan,
        out: &mut CudaSlice<u16>,
    ) -> Result<(), CudaError> {
        if !Arc::ptr_eq(&up.stream, &self.stream) {
            return Err(CudaError::Input {
                what: "a plan uploaded through another Gpu",
            });
        }
        let k = self.kernels(None)?;
        let _one_chain = self.chain_lock.lock().unwrap_or_else(|e| e.into_inner());
        self.launch_chain(&self.stream, &k, &up.queued.dev, up.output, out)?;
        let verdict = queued::Verdicts::new(&self.stream, 1)?;
        up.queued
            .judge(&self.stream, &k.chain_verdict, verdict.word(0)?)?;
        if verdict.all_passed(&self.stream)? {
            return Ok(());
        }
        let statuses = ffi::download_base(&self.stream, &up.queued.statuses)?;
        let [exp, resolve, sym, value, dequant] = up.queued.chain_statuses(&statuses)?;
        check_chain(&up.chunk_of, [&exp, &resolve, &sym, &value, &dequant])
    }

    #[cfg(feature = "internals")]
    /// For benches: the best time in seconds over `reps` runs of [`upload_plan`](Self::upload_plan)
    /// (the chain built from the plan, packed, copied from pinned memory to the device, its
    /// statuses read), or with `host` of [`upload_plan_from`](Self::upload_plan_from), and of
    /// each of those three steps (each synchronized; the words' copy and gather and the chunk
    /// checks count in the second).
    pub fn time_upload_plan(
        &self,
        plan: &DecodePlan<'_>,
        host: Option<&HostBuffer>,
        reps: usize,
    ) -> Result<[f64; 4], CudaError> {
        self.kernels(None)?;
        let mut best = [f64::INFINITY; 4];
        for _ in 0..reps.max(1) {
            let mut parts = [0.0; 3];
            let t = std::time::Instant::now();
            drop(self.upload_plan_timed(plan, host, Some(&mut parts))?);
            best[0] = best[0].min(t.elapsed().as_secs_f64());
            for (b, p) in best[1..].iter_mut().zip(parts) {
                *b = b.min(p);
            }
        }
        Ok(best)
    }

    #[cfg(feature = "internals")]
    /// For benches: the best time in seconds of `reps` runs of `plan`'s chain of launches,
    /// its inputs uploaded once (the kernels alone).
    pub fn time_decode_chain(
        &self,
        plan: &DecodePlan<'_>,
        out: &mut CudaSlice<u16>,
        reps: usize,
    ) -> Result<f64, CudaError> {
        let chain = plan.chain_with(&self.levels)?;
        let _one_chain = self.chain_lock.lock().unwrap_or_else(|e| e.into_inner());
        self.time_launches(
            reps,
            |g| g.upload_chain(&chain),
            |g, k, q| g.launch_chain(&g.stream, k, &q.dev, plan.output(), out),
        )
    }

    /// Queues the chain `dev`'s launches into `out` on `stream`.
    pub(super) fn launch_chain(
        &self,
        stream: &CudaStream,
        k: &Kernels,
        dev: &ffi::ChainDev,
        output: crate::quant::Output,
        out: &mut CudaSlice<u16>,
    ) -> Result<(), CudaError> {
        let kernels = chain_kernels(k, output);
        ffi::launch_chain(stream, &kernels, dev, self.lane_shape, out, output.len)
    }

    #[cfg(feature = "internals")]
    /// For benches: the best time in seconds of each of the chain's five launches (exponents,
    /// table resolution, symbols, values, dequantization) over `reps` runs, each launch
    /// synchronized alone (the fused chain's table resolution is no launch: about 0).
    pub fn time_decode_chain_stages(
        &self,
        plan: &DecodePlan<'_>,
        out: &mut CudaSlice<u16>,
        reps: usize,
    ) -> Result<[f64; 5], CudaError> {
        let k = self.kernels(None)?;
        let chain = plan.chain_with(&self.levels)?;
        let _one_chain = self.chain_lock.lock().unwrap_or_else(|e| e.into_inner());
        let dev = self.upload_chain(&chain)?.dev;
        let kernels = chain_kernels(&k, plan.output());
        let n_out = plan.output().len;
        self.sync()?;
        let mut best = [f64::INFINITY; 5];
        for _ in 0..reps.max(1) {
            for (stage, b) in best.iter_mut().enumerate() {
                let t = std::time::Instant::now();
                ffi::launch_chain_stage(
                    &self.stream,
                    &kernels,
                    &dev,
                    self.lane_shape,
                    out,
                    n_out,
                    stage as u8,
                )?;
                self.sync()?;
                *b = b.min(t.elapsed().as_secs_f64());
            }
        }
        Ok(best)
    }

    /// `ch` uploaded with its words packed, on this `Gpu`'s stream (synchronized): for the
    /// benches of its launches.
    fn upload_chain(&self, ch: &Chain<'_>) -> Result<QueuedChain, CudaError> {
        let mut staging = self.staging.lock().unwrap_or_else(|e| e.into_inner());
        let on = (&self.stream, &mut staging[0]);
        let queued = self.queue_chain(ch, WordSource::Packed, on, 0, None, &self.stream)?;
        self.sync()?;
        Ok(queued)
    }

    /// Decodes every chunk of `plan` on the device: the output's f16 or bf16 bits, as
    /// [`DecodePlan::decode_chain_host`] gives them.
    pub fn decode(&self, plan: &DecodePlan<'_>) -> Result<Vec<u16>, CudaError> {
        self.decode_to_vec(plan, |out| self.decode_into(plan, out))
    }

    /// The output of `plan` decoded by `decode` into a new device buffer, copied back.
    pub(super) fn decode_to_vec(
        &self,
        plan: &DecodePlan<'_>,
        decode: impl FnOnce(&mut CudaSlice<u16>) -> Result<(), CudaError>,
    ) -> Result<Vec<u16>, CudaError> {
        let len = plan.output().len;
        let mut out = self
            .stream
            .alloc_zeros::<u16>(len.max(1))
            .map_err(ffi::driver_err("cuMemAllocAsync"))?;
        decode(&mut out)?;
        let mut host = self
            .stream
            .clone_dtoh(&out)
            .map_err(ffi::driver_err("cuMemcpyDtoHAsync"))?;
        host.truncate(len);
        Ok(host)
    }
}

/// The chain's kernels for `output`'s dtype.
pub(super) fn chain_kernels(k: &Kernels, output: crate::quant::Output) -> ffi::ChainKernels<'_> {
    ffi::ChainKernels {
        lane: &k.lane_decode,
        lane_mapped: &k.lane_decode_mapped,
        lane_compact: &k.lane_decode_compact,
        lane_mapped_compact: &k.lane_decode_mapped_compact,
        resolve: &k.resolve_tables,
        map_values: &k.map_values,
        map_escapes: &k.map_escapes,
        dequant: dequant_kernel(k, output),
    }
}
