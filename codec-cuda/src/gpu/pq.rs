//! PQ search on a [`Gpu`]: a batch's codes and queries uploaded and scored in one launch, or
//! the codes kept on the device ([`UploadedPq`]) and only the queries uploaded per call.

use std::sync::Arc;

use cudarc::driver::CudaStream;

use crate::error::CudaError;
use crate::ffi::{self, DevBuf};
use crate::pq::{PqBatch, PqSelected};

use super::{Gpu, Kernels};

/// A [`PqBatch`] on one device ([`Gpu::upload_pq`]): its codebooks, codes and query records
/// uploaded once, searched by [`Gpu::search_uploaded`] with new query values each time, its
/// heads grown by [`Gpu::append_pq`].
#[derive(Debug)]
pub struct UploadedPq {
    dev: ffi::PqDev,
    layout: crate::pq::PqLayout,
    /// The stream (so the device) it was uploaded to.
    stream: Arc<CudaStream>,
}

impl UploadedPq {
    /// Query values a search takes (all of the batch's).
    pub fn query_values(&self) -> usize {
        self.dev.queries.len()
    }
}

impl Gpu {
    /// Runs the PQ search over `batch` on the device: as [`PqBatch::search_host`] gives it.
    pub fn search(&self, batch: &PqBatch) -> Result<PqSelected, CudaError> {
        let upload = |g: &Self| g.upload_pq_with(batch, false);
        let dev = self.run_once(upload, |g, k, d| g.launch_pq(k, d, batch))?;
        let s = &self.stream;
        let out = dev.out.download(s)?;
        let status = dev.status.download(s)?;
        Ok(batch.selected(out, status))
    }

    /// For benches: the best time in seconds of `reps` PQ search launches over `batch`,
    /// uploaded once (the kernel alone).
    pub fn time_search(&self, batch: &PqBatch, reps: usize) -> Result<f64, CudaError> {
        self.time_launches(
            reps,
            |g| g.upload_pq_with(batch, false),
            |g, k, d| g.launch_pq(k, d, batch),
        )
    }

    /// Uploads `batch` once for [`search_uploaded`](Self::search_uploaded): its codebooks,
    /// codes and query records stay on the device, as a server keeps a context's codes
    /// between decode steps.
    pub fn upload_pq(&self, batch: &PqBatch) -> Result<UploadedPq, CudaError> {
        let dev = self.upload_pq_with(batch, true)?;
        self.sync()?;
        Ok(UploadedPq {
            dev,
            layout: batch.layout().clone(),
            stream: self.stream.clone(),
        })
    }

    /// Runs the PQ search of the batch uploaded as `up` with `values` in place of its query
    /// values (as [`PqBatch::set_query_values`] takes them: a decode step's queries over the
    /// same heads and tokens): only those are uploaded. As [`PqBatch::search_host`] gives it
    /// for the batch with those values. `up` is borrowed mutably: its buffers hold one search
    /// at a time.
    pub fn search_uploaded(
        &self,
        up: &mut UploadedPq,
        values: &[f32],
    ) -> Result<PqSelected, CudaError> {
        if !Arc::ptr_eq(&up.stream, &self.stream) {
            return Err(CudaError::Input {
                what: "a PQ batch uploaded through another Gpu",
            });
        }
        crate::pq::check_query_values(up.dev.queries.len(), values)?;
        let s = &self.stream;
        up.dev.queries.write(s, values)?;
        let k = self.kernels(None)?;
        let shape = up.layout.shape(self.pq_shared_keys, k.pq_shared_budget)?;
        ffi::launch_pq(s, &k.pq_search, &up.dev, shape)?;
        let out = up.dev.out.download(s)?;
        let status = up.dev.status.download(s)?;
        Ok(up.layout.selected(out, status))
    }

    /// Appends the codes of more tokens to `head` of the batch uploaded as `up`, as
    /// [`PqBatch::append_tokens`] does to a batch (the head added with room for them; the
    /// queries that saw all of its tokens see the new ones too): only the bytes of the codes
    /// that change and the query records are uploaded, so a decode step adds its new keys
    /// without uploading the context's codes again. An error changes nothing on the host; a
    /// failed copy may leave the device's codes partly appended, which the next successful
    /// append of the same codes writes whole.
    pub fn append_pq(
        &self,
        up: &mut UploadedPq,
        head: crate::pq::HeadId,
        codes: &[u16],
    ) -> Result<(), CudaError> {
        if !Arc::ptr_eq(&up.stream, &self.stream) {
            return Err(CudaError::Input {
                what: "a PQ batch uploaded through another Gpu",
            });
        }
        let mut layout = up.layout.clone();
        let (at, bytes) = layout.append(head, codes)?;
        let at = usize::try_from(at).map_err(|_| CudaError::Input {
            what: "codes past the address space",
        })?;
        up.dev.codes.write_at(&self.stream, at, &bytes)?;
        up.dev.items.write(&self.stream, layout.items())?;
        up.layout = layout;
        Ok(())
    }

    fn launch_pq(&self, k: &Kernels, d: &ffi::PqDev, batch: &PqBatch) -> Result<(), CudaError> {
        let shape = batch.shape(self.pq_shared_keys, k.pq_shared_budget)?;
        ffi::launch_pq(&self.stream, &k.pq_search, d, shape)
    }

    /// The batch's inputs in one packed upload (see [`ffi::Packer`]), its scratch keys and
    /// outputs in allocations of their own; `resident` (a batch kept for later searches),
    /// its query values, codes and query records in allocations of their own too (which
    /// searches and appends overwrite).
    fn upload_pq_with(&self, batch: &PqBatch, resident: bool) -> Result<ffi::PqDev, CudaError> {
        let s = &self.stream;
        let (keys_len, out_len) = batch.lens();
        let io = batch.io(&mut [], &mut [], &mut []);
        let mut p = ffi::Packer::default();
        let packed = (!resident).then(|| (p.add(io.queries), p.add(io.codes), p.add(io.items)));
        let codewords = p.add(io.codewords);
        let base = self.packed_upload(p)?;
        let (queries, codes, items) = match packed {
            Some((queries, codes, items)) => (
                DevBuf::view(&base, queries)?,
                DevBuf::view(&base, codes)?,
                DevBuf::view(&base, items)?,
            ),
            None => (
                DevBuf::upload(s, io.queries)?,
                DevBuf::upload(s, io.codes)?,
                DevBuf::upload(s, io.items)?,
            ),
        };
        Ok(ffi::PqDev {
            queries,
            codewords: DevBuf::view(&base, codewords)?,
            codes,
            keys: DevBuf::zeros(s, keys_len)?,
            out: DevBuf::zeros(s, out_len)?,
            items,
            status: DevBuf::zeros(s, io.items.len())?,
            dim: io.dim,
            m: io.m,
            bits: io.bits,
            residual: io.residual,
        })
    }
}
