//! The receiving end's decoder: chunks as they arrive, in order, into one cache in the stream's
//! dtype (run on a blocking thread while the next chunks are fetched).

use std::sync::Arc;

use codec_core::{ChunkContext, DecodeError, Dtype, Header, KvCache, Profile, TensorMut};
use tokio::sync::mpsc::UnboundedReceiver;

use super::{FetchError, Recompute};

/// What arrived for a chunk.
#[derive(Debug)]
pub(super) enum Part {
    /// Its bytes at `level`.
    Coded {
        chunk: usize,
        level: u8,
        bytes: Vec<u8>,
    },
    /// Its token ids, to recompute.
    Text { chunk: usize, tokens: Vec<u32> },
}

/// Builds the cache chunk by chunk.
pub(super) struct Assembler {
    pub header: Header,
    pub profile: Profile,
    pub recompute: Option<Arc<dyn Recompute>>,
}

impl Assembler {
    /// Takes parts until the sender is dropped, then returns the cache. A part that fails ends
    /// the work (the fetch loop sees the channel closed and collects this error).
    pub fn run(self, mut parts: UnboundedReceiver<Part>) -> Result<KvCache, FetchError> {
        let h = &self.header;
        // The context first: it checks the profile against the header's shape, before the
        // cache that shape sizes is allocated.
        let ctx = ChunkContext::new(
            h.shape,
            h.dtype,
            h.meta.first_position,
            u32::from(h.group),
            h.n_sink,
            &self.profile,
            h.meta.rope,
        )
        .map_err(|e| FetchError::Stream(e.to_string()))?;
        let mut cache = KvCache::zeros(h.shape, h.dtype, h.meta.clone());
        while let Some(part) = parts.blocking_recv() {
            match part {
                Part::Coded {
                    chunk,
                    level,
                    bytes,
                } => self.decode(&ctx, &mut cache, chunk, level, &bytes)?,
                Part::Text { chunk, tokens } => self.recompute(&mut cache, chunk, &tokens)?,
            }
        }
        Ok(cache)
    }

    /// Decodes chunk `i` into its rows of `cache`, as `Stream::decode` would: the values
    /// rounded into the dtype, then the sink rows' stored bits.
    fn decode(
        &self,
        ctx: &ChunkContext<'_>,
        cache: &mut KvCache,
        i: usize,
        level: u8,
        bytes: &[u8],
    ) -> Result<(), FetchError> {
        let e = self.header.chunks[i];
        let at = e.token_start as usize * cache.shape.channels();
        let dtype = self.header.dtype;
        let (ks, vs) = (&mut cache.k, &mut cache.v);
        let write = |layer: u32, kv: codec_core::Kv, values: &[f32], raw_sink: &[u8]| {
            let t = match kv {
                codec_core::Kv::K => &mut ks[layer as usize],
                codec_core::Kv::V => &mut vs[layer as usize],
            };
            let mut t = t.as_mut();
            t.write_f32(at, values);
            write_raw(&mut t, at, raw_sink, dtype);
        };
        ctx.decode_chunk(bytes, i as u32, e.token_start, e.tokens, level, write)
            .map_err(|err| FetchError::Stream(format!("chunk {i}: {}", DecodeError::from(err))))
    }

    /// Recomputes chunk `i` from its token ids on top of the chunks before it.
    fn recompute(&self, cache: &mut KvCache, i: usize, tokens: &[u32]) -> Result<(), FetchError> {
        let e = self.header.chunks[i];
        let fail = |why: String| FetchError::Recompute { chunk: i, why };
        let model = self
            .recompute
            .as_ref()
            .ok_or_else(|| fail("no model to recompute text with".into()))?;
        let prefix = prefix(cache, e.token_start as usize);
        let new = model.extend(&prefix, tokens).map_err(fail)?;
        let mut want = cache.shape;
        want.tokens = e.tokens;
        if new.shape != want || new.meta.rope != cache.meta.rope {
            let why = format!(
                "the model returned {:?} with {:?}, not the stream's {want:?} with {:?}",
                new.shape, new.meta.rope, cache.meta.rope
            );
            return Err(fail(why));
        }
        let at = e.token_start as usize * cache.shape.channels();
        for (dst, src) in cache.k.iter_mut().zip(&new.k) {
            dst.as_mut().write_f32(at, &src.to_f32_vec());
        }
        for (dst, src) in cache.v.iter_mut().zip(&new.v) {
            dst.as_mut().write_f32(at, &src.to_f32_vec());
        }
        Ok(())
    }
}

/// The first `tokens` tokens of `cache`, copied.
fn prefix(cache: &KvCache, tokens: usize) -> KvCache {
    let n = tokens * cache.shape.channels();
    let cut = |t: &codec_core::Tensor| match t {
        codec_core::Tensor::F16(v) => codec_core::Tensor::F16(v[..n].to_vec()),
        codec_core::Tensor::Bf16(v) => codec_core::Tensor::Bf16(v[..n].to_vec()),
        codec_core::Tensor::F32(v) => codec_core::Tensor::F32(v[..n].to_vec()),
    };
    let mut shape = cache.shape;
    shape.tokens = tokens as u32;
    KvCache {
        shape,
        k: cache.k.iter().map(cut).collect(),
        v: cache.v.iter().map(cut).collect(),
        meta: cache.meta.clone(),
    }
}

/// Copies a block's stored sink rows (`raw`, in `dtype`) over its first rows at `at`: their
/// bits as stored, NaN payloads and signed zeros included. (The decoder has checked the sink
/// rows against the chunk, so they fit; rows that would not are left as the values wrote them.)
fn write_raw(t: &mut TensorMut<'_>, at: usize, raw: &[u8], dtype: Dtype) {
    if t.dtype() != dtype {
        return;
    }
    let n = raw.len() / dtype.size_bytes();
    let range = at..at + n;
    match t {
        TensorMut::F16(d) => raw
            .chunks_exact(2)
            .zip(d.get_mut(range).unwrap_or_default())
            .for_each(|(b, o)| *o = half::f16::from_le_bytes([b[0], b[1]])),
        TensorMut::Bf16(d) => raw
            .chunks_exact(2)
            .zip(d.get_mut(range).unwrap_or_default())
            .for_each(|(b, o)| *o = half::bf16::from_le_bytes([b[0], b[1]])),
        TensorMut::F32(d) => raw
            .chunks_exact(4)
            .zip(d.get_mut(range).unwrap_or_default())
            .for_each(|(b, o)| *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
    }
}
