//! Decoding streams that lie in page-locked host memory: their bytes copied to the device as
//! they are, by DMA, and each block's lane words gathered there (`kvc_gather_words`), instead
//! of the host copying every word into the staging buffer first (the copy that bounds
//! [`Gpu::decode_into`] for a fresh plan).

use cudarc::driver::{CudaSlice, PinnedHostSlice};

use super::Gpu;
use crate::copy_runs::CopyRuns;
use crate::decode::{DecodePlan, RawPlaces};
use crate::error::CudaError;
use crate::ffi::{self, ChunkCheck, DevBuf, GatherPart, PackSlot};
use crate::UploadedPlan;

/// Page-locked host memory of a [`Gpu`]'s device, zeroed when allocated, that streams are read
/// or received into so that [`Gpu::upload_plan_from`] and [`Gpu::decode_from`] copy them to the
/// device straight from it.
///
/// ```no_run
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use codec_core::{Limits, Stream};
/// use codec_cuda::decode::DecodePlan;
/// use codec_cuda::OutDtype;
/// use codec_cuda::Gpu;
///
/// let gpu = Gpu::new(0)?;
/// gpu.load_kernels(None)?;
/// let mut file = std::fs::File::open("cache.kvc")?;
/// let len = file.metadata()?.len() as usize;
/// let mut host = gpu.host_buffer(len)?;
/// std::io::Read::read_exact(&mut file, host.as_mut_slice()?)?;
/// let stream = Stream::open(host.as_slice()?, None, &Limits::DEFAULT)?;
/// let plan = DecodePlan::for_stream(&stream, OutDtype::F16)?;
/// let mut out = gpu.stream().alloc_zeros::<u16>(plan.output().len)?;
/// gpu.decode_from(&plan, &host, &mut out)?;
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct HostBuffer {
    pinned: PinnedHostSlice<u8>,
    len: usize,
}

impl HostBuffer {
    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes, once every copy the device was reading them for has finished.
    pub fn as_slice(&self) -> Result<&[u8], CudaError> {
        let all = self
            .pinned
            .as_slice()
            .map_err(ffi::driver_err("cuEventSynchronize"))?;
        Ok(&all[..self.len])
    }

    /// The bytes to write, once every copy the device was reading them for has finished.
    pub fn as_mut_slice(&mut self) -> Result<&mut [u8], CudaError> {
        let all = self
            .pinned
            .as_mut_slice()
            .map_err(ffi::driver_err("cuEventSynchronize"))?;
        Ok(&mut all[..self.len])
    }
}

/// Where an upload takes a chain's lane words from.
#[derive(Debug)]
pub(super) enum WordSource<'a> {
    /// The streams wherever they lie: each block's words copied by the host into the packed
    /// upload.
    Packed,
    /// `raw`, page-locked bytes the streams lie in, the ranges `places.runs` of it copied
    /// to the device as they are, back to back; `places` says where each block's words and
    /// escapes are in that copy, and each chunk whose CRC is checked at decode
    /// ([`crate::decode::Chain::gather_parts`]); `copied`, those runs already queued for the
    /// device on the stream the upload is queued on.
    Raw {
        raw: &'a [u8],
        places: &'a RawPlaces,
        copied: Option<DevBuf<u8>>,
    },
}

/// Runs of a host buffer queued for the device before the chain that reads them was built,
/// and where they landed ([`Gpu::set_decode_copy_early`]).
pub(super) type EarlyCopy = (CopyRuns, DevBuf<u8>);

impl<'a> WordSource<'a> {
    /// Words copied as they lie in `raw`'s bytes, from the places a chain found in them
    /// ([`crate::decode::Chain::gather_parts`]), the copy queued `early` taken when it holds
    /// the runs found; without `raw`, packed.
    pub(super) fn of(raw: &'a Option<(&'a [u8], RawPlaces)>, early: Option<EarlyCopy>) -> Self {
        match raw {
            None => WordSource::Packed,
            Some((bytes, places)) => WordSource::Raw {
                raw: bytes,
                places,
                copied: early
                    .filter(|(r, _)| *r == places.runs)
                    .map(|(_, copied)| copied),
            },
        }
    }
}

/// Where an upload put the lane words and escapes: in the packed upload, or in bytes copied
/// as they are with the gather parts (that many of words) and chunk checks in the packed
/// upload.
pub(super) enum Words {
    Packed(PackSlot<u32>, PackSlot<i32>),
    Raw(
        DevBuf<u8>,
        (PackSlot<GatherPart>, usize),
        PackSlot<ChunkCheck>,
    ),
}

impl Gpu {
    /// A zeroed page-locked host buffer of `len` bytes (at least 1) on this device's context,
    /// for [`upload_plan_from`](Self::upload_plan_from).
    pub fn host_buffer(&self, len: usize) -> Result<HostBuffer, CudaError> {
        Ok(HostBuffer {
            pinned: ffi::pinned_zeroed(&self.ctx, len, 0)?,
            len,
        })
    }

    /// [`upload_plan`](Self::upload_plan) for a plan whose streams all lie in `host`: the
    /// parts of `host` that hold their lane words (and their chunks, when the CRCs are checked
    /// at decode) go to the device straight from it, a copy per run of them (the bytes
    /// between runs, such as the streams' headers and embedded profiles, stay on the host),
    /// where one launch gathers each block's words (the rest of the chain, a few bytes per
    /// symbol less, goes up as in `upload_plan`). An input error if some chunk of the plan
    /// lies outside `host`.
    pub fn upload_plan_from(
        &self,
        plan: &DecodePlan<'_>,
        host: &HostBuffer,
    ) -> Result<UploadedPlan, CudaError> {
        self.upload_plan_timed(plan, Some(host), None)
    }

    /// [`decode_into`](Self::decode_into) through
    /// [`upload_plan_from`](Self::upload_plan_from) (in pieces as `decode_into`): the same
    /// bits.
    pub fn decode_from(
        &self,
        plan: &DecodePlan<'_>,
        host: &HostBuffer,
        out: &mut CudaSlice<u16>,
    ) -> Result<(), CudaError> {
        self.decode_in_pieces(plan, Some(host), out)
    }

    /// [`decode`](Self::decode) through [`upload_plan_from`](Self::upload_plan_from): the
    /// output's f16 or bf16 bits, copied back to the host.
    pub fn decode_vec_from(
        &self,
        plan: &DecodePlan<'_>,
        host: &HostBuffer,
    ) -> Result<Vec<u16>, CudaError> {
        self.decode_to_vec(plan, |out| self.decode_from(plan, host, out))
    }
}
