//! GPU 0 through codec-cuda's kernels (feature `gpu`): `kvc encode`, `kvc decode`, `kvc eval`
//! and `kvc pq eval` with `--gpu`.
//!
//! [`GpuCodec::open`] opens the device and loads the kernels once (the typed [`GpuError`] says
//! why not, e.g. on a machine without a CUDA driver); it then encodes caches and decodes streams
//! as codec-core does ([`GpuCodec::encode_stream`], [`GpuCodec::decode`], and
//! [`GpuCodec::decode_from`] for a file [read](GpuCodec::read_file) into page-locked memory)
//! and selects tokens as pq-core does ([`GpuCodec::select`]). The eval hooks
//! ([`crate::eval::SecondDecoder`], [`crate::pq::SecondSearch`]) compare every output with the
//! CPU's and fail loudly on any difference.

use std::fmt;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Instant;

use codec_core::{Dtype, EncodeParams, KvCache, KvView, ProfileMode, Stream, Tensor};
use codec_cuda::decode::DecodePlan;
use codec_cuda::encode_plan::{EncodePlan, Source};
use codec_cuda::pq::{PqBatch, PqStatus};
use codec_cuda::{CudaError, Gpu, HostBuffer, OutDtype};
use half::vec::HalfBitsVecExt;
use pq_core::Codebook;

use crate::pq::{SearchQuery, Searched};

/// Why a `--gpu` run failed.
#[derive(Debug)]
pub enum GpuError {
    /// No usable GPU 0 or kernels: no driver, no device, no NVRTC, a failed compile or load.
    Unavailable(CudaError),
    /// The stream's dtype is not decoded on the GPU.
    Dtype(Dtype),
    /// A kernel run (upload, launch, statuses) failed.
    Run(CudaError),
    /// The stream could not be framed or assembled (codec-core's checks), or its profile
    /// chosen.
    Encode(String),
    /// The GPU's output differs from the CPU's.
    Mismatch {
        /// What differs, where first.
        what: String,
    },
    /// A file could not be read into page-locked memory.
    Read {
        /// The file.
        path: PathBuf,
        /// Why not.
        reason: String,
    },
}

impl fmt::Display for GpuError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GpuError::Unavailable(e) => write!(f, "--gpu: no usable GPU 0: {e}"),
            GpuError::Dtype(d) => {
                write!(f, "--gpu decodes f16 and bf16 streams, not {}", d.name())
            }
            GpuError::Run(e) => write!(f, "--gpu: {e}"),
            GpuError::Encode(e) => write!(f, "--gpu: {e}"),
            GpuError::Mismatch { what } => {
                write!(f, "--gpu: the GPU's output differs from the CPU's: {what}")
            }
            GpuError::Read { path, reason } => {
                write!(f, "cannot read {}: {reason}", path.display())
            }
        }
    }
}

impl From<crate::Error> for GpuError {
    fn from(e: crate::Error) -> Self {
        GpuError::Encode(e.to_string())
    }
}

impl std::error::Error for GpuError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            GpuError::Unavailable(e) | GpuError::Run(e) => Some(e),
            _ => None,
        }
    }
}

/// GPU 0 with the kernels loaded.
#[derive(Debug)]
pub struct GpuCodec {
    gpu: Gpu,
}

impl GpuCodec {
    /// Opens GPU 0 and compiles and loads the kernels (NVRTC from `KVC_NVRTC_LIB`,
    /// tools/fetch-nvrtc's folder, or the loader's path).
    pub fn open() -> Result<Self, GpuError> {
        let gpu = Gpu::new(0).map_err(GpuError::Unavailable)?;
        gpu.load_kernels(None).map_err(GpuError::Unavailable)?;
        Ok(GpuCodec { gpu })
    }

    /// The device, e.g. `GPU 0 (sm_90)`.
    pub fn name(&self) -> String {
        format!("GPU {} ({})", self.gpu.ordinal(), self.gpu.arch())
    }

    /// Encodes `kv` on the GPU into the stream `codec_core::encode` writes with `mode` and
    /// `params`, byte for byte: the cache uploaded once, every chunk coded by codec-cuda's
    /// encode chain, the stream assembled around them.
    pub fn encode_stream(
        &self,
        kv: &KvView<'_>,
        mode: ProfileMode<'_>,
        params: &EncodeParams,
    ) -> Result<Vec<u8>, GpuError> {
        let refused = |e: codec_core::EncodeError| GpuError::Encode(e.to_string());
        let frame = codec_core::stream_frame(kv, mode, params).map_err(refused)?;
        let (bytes, source) = Source::of_view(kv);
        let src = self.gpu.upload(&bytes).map_err(GpuError::Run)?;
        let mut plan = EncodePlan::new(&frame.context, source).map_err(GpuError::Run)?;
        for e in &frame.header.chunks {
            let tokens = e.token_start..e.token_start + e.tokens;
            plan.add_chunk(tokens, e.level).map_err(GpuError::Run)?;
        }
        let chunks = self.gpu.encode(&plan, &src).map_err(GpuError::Run)?;
        let parts: Vec<(u8, &[u8])> = (frame.header.chunks.iter().zip(&chunks))
            .map(|(e, c)| (e.level, c.as_slice()))
            .collect();
        codec_core::assemble(&frame.header, &parts, &frame.profile).map_err(refused)
    }

    /// Decodes `s` on the GPU: the cache `Stream::decode` gives, bit for bit (the kernels are
    /// checked against codec-core). Streams of f16 or bf16 only.
    pub fn decode(&self, s: &Stream<'_>) -> Result<KvCache, GpuError> {
        self.decode_with(s, false, |plan| self.gpu.decode(plan))
    }

    /// [`decode`](Self::decode) for a stream whose bytes lie in `host` (from
    /// [`read_file`](Self::read_file)): copied to the device as they are, with no host copy of
    /// their lane words, the chunks' CRCs checked there.
    pub fn decode_from(&self, s: &Stream<'_>, host: &HostBuffer) -> Result<KvCache, GpuError> {
        self.decode_with(s, true, |plan| self.gpu.decode_vec_from(plan, host))
    }

    /// The file at `path` read into page-locked memory of the device, for
    /// [`decode_from`](Self::decode_from).
    pub fn read_file(&self, path: &Path) -> Result<HostBuffer, GpuError> {
        let why = |e: &dyn fmt::Display| GpuError::Read {
            path: path.to_path_buf(),
            reason: e.to_string(),
        };
        let mut file = File::open(path).map_err(|e| why(&e))?;
        let len = file.metadata().map_err(|e| why(&e))?.len();
        let len = usize::try_from(len).map_err(|e| why(&e))?;
        let mut host = self.gpu.host_buffer(len).map_err(|e| why(&e))?;
        file.read_exact(host.as_mut_slice().map_err(|e| why(&e))?)
            .map_err(|e| why(&e))?;
        if file.read(&mut [0u8]).map_err(|e| why(&e))? != 0 {
            return Err(why(&"it grew while it was read"));
        }
        Ok(host)
    }

    /// `s` decoded by `decode`, which gives the bits of its plan's output (its chunks' CRCs
    /// checked at decode or not).
    fn decode_with(
        &self,
        s: &Stream<'_>,
        crc_at_decode: bool,
        decode: impl FnOnce(&DecodePlan<'_>) -> Result<Vec<u16>, CudaError>,
    ) -> Result<KvCache, GpuError> {
        let h = s.header();
        let dtype = match h.dtype {
            Dtype::F16 => OutDtype::F16,
            Dtype::Bf16 => OutDtype::Bf16,
            d => return Err(GpuError::Dtype(d)),
        };
        let per_tensor = h.shape.tensor_len();
        let plan = DecodePlan::for_stream_with(s, dtype, crc_at_decode).map_err(GpuError::Run)?;
        let bits = decode(&plan).map_err(GpuError::Run)?;
        // Per layer K then V, each [T, H, D].
        let mut tensors = bits.chunks_exact(per_tensor.max(1)).map(|t| match h.dtype {
            Dtype::Bf16 => Tensor::Bf16(t.to_vec().reinterpret_into()),
            _ => Tensor::F16(t.to_vec().reinterpret_into()),
        });
        let mut cache = KvCache::zeros(h.shape, h.dtype, h.meta.clone());
        for layer in 0..h.shape.layers as usize {
            if let (Some(k), Some(v)) = (tensors.next(), tensors.next()) {
                (cache.k[layer], cache.v[layer]) = (k, v);
            }
        }
        Ok(cache)
    }

    /// Selects tokens for every query with the PQ search kernel (one launch), as
    /// `pq_core::search` does; the selections, the call's seconds (uploads included, best of 2)
    /// and the kernel's alone (best of 3).
    pub fn select(
        &self,
        heads: &[(Codebook, Vec<u16>)],
        queries: &[SearchQuery<'_>],
    ) -> Result<Searched, GpuError> {
        let run = GpuError::Run;
        let Some((first, _)) = heads.first() else {
            return Ok(Searched {
                selections: vec![Vec::new(); queries.len()],
                seconds: 0.0,
                kernel_seconds: None,
            });
        };
        let mut batch = PqBatch::new(first).map_err(run)?;
        let mut ids = Vec::with_capacity(heads.len());
        for (cb, codes) in heads {
            let tokens = codes.len() / cb.m().max(1);
            let packed = pq_core::pack(codes, cb.bits()).map_err(|e| GpuError::Mismatch {
                what: format!("codes pq-core cannot pack: {e}"),
            })?;
            ids.push(batch.add_head(cb, &packed, tokens).map_err(run)?);
        }
        for q in queries {
            let id = *ids.get(q.head).ok_or(GpuError::Run(CudaError::Input {
                what: "a query of a head not given",
            }))?;
            let w = q.windows;
            batch
                .add_query(id, q.query, q.tokens, q.k, w.n_init, w.n_local)
                .map_err(run)?;
        }
        // Best of two calls: the first also loads the kernel's code onto the device.
        let (mut out, mut seconds) = (None, f64::INFINITY);
        for _ in 0..2 {
            let t = Instant::now();
            out = Some(self.gpu.search(&batch).map_err(run)?);
            seconds = seconds.min(t.elapsed().as_secs_f64());
        }
        let out = out.ok_or(GpuError::Run(CudaError::Input {
            what: "no search ran",
        }))?;
        let kernel = self.gpu.time_search(&batch, 3).map_err(run)?;
        let mut selections = Vec::with_capacity(out.len());
        for i in 0..out.len() {
            if out.status(i) != Some(PqStatus::Ok) {
                return Err(GpuError::Mismatch {
                    what: format!("query {i} ended with {:?}", out.status(i)),
                });
            }
            selections.push(out.tokens(i).to_vec());
        }
        Ok(Searched {
            selections,
            seconds,
            kernel_seconds: Some(kernel),
        })
    }
}

/// The bits of a tensor's elements (f32 as two 16-bit halves), to compare decodes exactly.
fn tensor_bits(t: &Tensor) -> Vec<u16> {
    match t {
        Tensor::F16(v) => v.iter().map(|x| x.to_bits()).collect(),
        Tensor::Bf16(v) => v.iter().map(|x| x.to_bits()).collect(),
        Tensor::F32(v) => v
            .iter()
            .flat_map(|x| [x.to_bits() as u16, (x.to_bits() >> 16) as u16])
            .collect(),
    }
}

/// Where `gpu` and `cpu` first differ (`None` if bit for bit equal).
fn first_difference(gpu: &KvCache, cpu: &KvCache) -> Option<String> {
    if gpu.shape != cpu.shape || gpu.dtype() != cpu.dtype() {
        return Some("shape or dtype".into());
    }
    let layers = gpu.k.iter().zip(&gpu.v).zip(cpu.k.iter().zip(&cpu.v));
    for (l, ((gk, gv), (ck, cv))) in layers.enumerate() {
        for (name, g, c) in [("K", gk, ck), ("V", gv, cv)] {
            let (g, c) = (tensor_bits(g), tensor_bits(c));
            if let Some(i) = g.iter().zip(&c).position(|(a, b)| a != b) {
                return Some(format!(
                    "layer {l} {name} element {i}: {:#06x} on the GPU, {:#06x} on the CPU",
                    g[i], c[i]
                ));
            }
            if g.len() != c.len() {
                return Some(format!(
                    "layer {l} {name}: {} elements, not {}",
                    g.len(),
                    c.len()
                ));
            }
        }
    }
    None
}

impl crate::eval::SecondDecoder for GpuCodec {
    /// The best of two decodes (the first also loads the kernels' code onto the device), each
    /// compared with the CPU's bit for bit.
    fn decode_and_compare(
        &mut self,
        stream: &Stream<'_>,
        cpu: &KvCache,
    ) -> Result<f64, Box<dyn std::error::Error + Send + Sync>> {
        let mut best = f64::INFINITY;
        for _ in 0..2 {
            let t = Instant::now();
            let gpu = self.decode(stream)?;
            best = best.min(t.elapsed().as_secs_f64());
            if let Some(what) = first_difference(&gpu, cpu) {
                return Err(Box::new(GpuError::Mismatch { what }));
            }
        }
        Ok(best)
    }
}

impl crate::pq::SecondSearch for GpuCodec {
    fn search(
        &mut self,
        heads: &[(Codebook, Vec<u16>)],
        queries: &[SearchQuery<'_>],
    ) -> Result<Searched, Box<dyn std::error::Error + Send + Sync>> {
        Ok(self.select(heads, queries)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use codec_core::{KvMeta, KvShape};
    use half::f16;

    fn cache(values: &[f32]) -> KvCache {
        let shape = KvShape {
            layers: 1,
            kv_heads: 1,
            head_dim: values.len() as u32,
            tokens: 1,
        };
        let mut c = KvCache::zeros(shape, Dtype::F16, KvMeta::default());
        c.k[0] = Tensor::F16(values.iter().map(|&x| f16::from_f32(x)).collect());
        c
    }

    #[test]
    fn any_flipped_bit_is_a_difference_and_none_is_not() {
        let a = cache(&[1.0, -2.5, 0.0, 7.0]);
        assert_eq!(first_difference(&a, &a.clone()), None);
        // -0.0 == 0.0 as numbers, but not as bytes.
        let b = cache(&[1.0, -2.5, -0.0, 7.0]);
        let why = first_difference(&b, &a).unwrap();
        assert_eq!(
            why,
            "layer 0 K element 2: 0x8000 on the GPU, 0x0000 on the CPU"
        );
        let mut c = a.clone();
        c.v[0] = Tensor::F16(vec![f16::from_bits(1); 4]);
        assert!(first_difference(&c, &a)
            .unwrap()
            .starts_with("layer 0 V element 0"));
        let e = GpuError::Mismatch { what: why };
        assert!(e
            .to_string()
            .starts_with("--gpu: the GPU's output differs from the CPU's"));
    }
}
