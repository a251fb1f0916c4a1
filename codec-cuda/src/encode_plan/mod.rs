//! Encoding chunks from K/V where a server keeps them, in five launches for a whole batch:
//!
//! 1. `kvc_encode_blocks` (`kernels/encode.cu`): per coded block, the layer's step exponents
//!    from its K (spec/FORMAT.md §9.2), their table, the quantized values (§7), each symbol's
//!    table and index with the escapes in order (§6.4), and the lane encoder's block record;
//! 2. `kvc_rans_lane_encode` over those records (§6.3);
//! 3. `kvc_place_blocks`: each block's size and place in its chunk (§5.2), each chunk's length;
//! 4. `kvc_write_blocks`: each block's bytes, the chunks packed one after another, and its
//!    share of its chunk's CRC-32C (§5.2);
//! 5. `kvc_seal_chunks`: each chunk's CRC after it, so that one copy brings the batch back.
//!
//! The host only checks where each chunk lies and splits the copy. The source is one buffer of
//! f32, f16 or bf16 elements holding every layer's K and V as `[T, H, D]` ([`Source`]); the
//! chunks are exactly
//! [`ChunkContext::encode_chunk`]'s, byte for byte. `Gpu::encode` runs the chain on a device,
//! [`EncodePlan::encode_host`] on the kernels compiled for the CPU.
//!
//! The plan is built here; its chain's layout is in `chain`, the chain run on the host in
//! `host`, and the chunks' copy out of the sealed buffer in `copy`.
//!
//! ```
//! use codec_core::{learn_profile, ChunkContext, Dtype, KvCache, KvMeta, KvShape};
//! use codec_core::{LearnParams, Rope, Sample, Tensor};
//! use codec_cuda::encode_plan::{EncodePlan, Source};
//!
//! // A tiny f32 cache: 2 layers, 1 KV head of 4 channels, 8 tokens.
//! let shape = KvShape { layers: 2, kv_heads: 1, head_dim: 4, tokens: 8 };
//! let t = |s: f32| Tensor::F32((0..32).map(|i| (i as f32 * s).sin()).collect());
//! let cache = KvCache {
//!     shape,
//!     k: vec![t(0.3), t(0.5)],
//!     v: vec![t(0.7), t(1.1)],
//!     meta: KvMeta::default(),
//! };
//! let sample = Sample { kv: cache.view(), queries: None };
//! let profile = learn_profile(&[sample], &LearnParams::default()).unwrap();
//! let ctx = ChunkContext::new(shape, Dtype::F32, 0, 4, 1, &profile, Rope::default()).unwrap();
//! // The source buffer: layer 0 K, layer 0 V, layer 1 K, layer 1 V, each [T, C].
//! let (src, source) = Source::of_view(&cache.view());
//! assert_eq!(source, Source { dtype: Dtype::F32, base: 0, tensor_stride: 32 });
//! let mut plan = EncodePlan::new(&ctx, source).unwrap();
//! plan.add_chunk(0..8, 0).unwrap();
//! plan.add_chunk(3..8, 2).unwrap();
//! let chunks = plan.encode_host(&src).unwrap();
//! assert_eq!(chunks[0], ctx.encode_chunk(&cache.view(), 0..8, 0).unwrap());
//! assert_eq!(chunks[1], ctx.encode_chunk(&cache.view(), 3..8, 2).unwrap());
//! ```

use std::ops::Range;

use codec_core::{ChunkContext, Dtype, KvView, TensorRef};

use crate::error::CudaError;

mod chain;
mod copy;
mod host;
#[cfg(test)]
mod tests;

pub(crate) use chain::{
    ChunkOut, ChunkResult, EncBlock, EncResult, EncodeChain, ImportancePolicy, SealResult,
};
pub use copy::copy_chunks;
pub(crate) use copy::{part_starts, split_sealed};

/// Where the source tensors lie in one buffer of `dtype` elements: tensor `(layer, K/V)` starts
/// at element `base + (2 * layer + kv) * tensor_stride`, its token `t` `t * C` elements later.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Source {
    /// The elements' type (the stream's dtype: its sink rows are stored in it).
    pub dtype: Dtype,
    /// Element index of layer 0's K, token 0.
    pub base: u64,
    /// Elements from one tensor to the next (at least `tokens * C`).
    pub tensor_stride: u64,
}

impl Source {
    /// `view`'s tensors copied into one buffer (layer 0 K, layer 0 V, layer 1 K, ...), as
    /// little-endian bytes, and its description: for a cache that is not on the device yet
    /// (upload the bytes with [`Gpu::upload`](crate::Gpu::upload)).
    pub fn of_view(view: &KvView<'_>) -> (Vec<u8>, Source) {
        let mut bytes = Vec::new();
        for (k, v) in view.k.iter().zip(&view.v) {
            for t in [k, v] {
                match t {
                    TensorRef::F32(x) => x.iter().for_each(|e| bytes.extend(e.to_le_bytes())),
                    TensorRef::F16(x) => x.iter().for_each(|e| bytes.extend(e.to_le_bytes())),
                    TensorRef::Bf16(x) => x.iter().for_each(|e| bytes.extend(e.to_le_bytes())),
                }
            }
        }
        let shape = view.shape;
        let source = Source {
            dtype: view.k.first().map_or(Dtype::F32, TensorRef::dtype),
            base: 0,
            tensor_stride: u64::from(shape.tokens) * shape.channels() as u64,
        };
        (bytes, source)
    }

    fn code(&self) -> u32 {
        match self.dtype {
            Dtype::F32 => 0,
            Dtype::F16 => 1,
            Dtype::Bf16 => 2,
        }
    }

    fn elem_bytes(&self) -> usize {
        if self.dtype == Dtype::F32 {
            4
        } else {
            2
        }
    }
}

/// Chunks of one stream to encode in one chain, from one [`Source`].
#[derive(Debug)]
pub struct EncodePlan<'c, 'p> {
    ctx: &'c ChunkContext<'p>,
    source: Source,
    chunks: Vec<(Range<u32>, u8)>,
}

impl<'c, 'p> EncodePlan<'c, 'p> {
    /// An empty plan for chunks of `ctx`'s stream read from `source`, which must have the
    /// context's dtype and room for its tokens.
    pub fn new(ctx: &'c ChunkContext<'p>, source: Source) -> Result<Self, CudaError> {
        let input = |what| CudaError::Input { what };
        if source.dtype != ctx.dtype() {
            return Err(input("the source's dtype is not the stream's"));
        }
        let shape = ctx.shape();
        if (shape.tokens as u64).saturating_mul(shape.channels() as u64) > source.tensor_stride {
            return Err(input(
                "the source's tensor stride is below tokens * channels",
            ));
        }
        Ok(EncodePlan {
            ctx,
            source,
            chunks: Vec::new(),
        })
    }

    /// Adds the chunk of tokens `tokens` at `level` (as [`ChunkContext::encode_chunk`]).
    pub fn add_chunk(&mut self, tokens: Range<u32>, level: u8) -> Result<(), CudaError> {
        let input = |what| CudaError::Input { what };
        if level >= self.ctx.profile().levels() {
            return Err(input("a level the profile does not have"));
        }
        if tokens.start >= tokens.end || tokens.end > self.ctx.shape().tokens {
            return Err(input("a chunk's token range is empty or beyond the stream"));
        }
        self.chunks.push((tokens, level));
        Ok(())
    }

    /// Chunks in the plan.
    pub fn chunks(&self) -> usize {
        self.chunks.len()
    }

    /// The plan's chunks cut into runs of about `piece_blocks` coded blocks each (0: one run
    /// of them all), in order, none empty unless the plan is: the pieces a `Gpu` encodes one
    /// after another, each piece's copy back beside the launches of the next.
    pub(crate) fn pieces(&self, piece_blocks: usize) -> Vec<Range<usize>> {
        let per_chunk = 2 * self.ctx.shape().layers as usize;
        let n = self.chunks.len();
        let total = n.saturating_mul(per_chunk);
        let pieces = match piece_blocks {
            0 => 1,
            b => ((total + b / 2) / b).clamp(1, n.max(1)),
        };
        // Every chunk has a block per layer and K/V: equal shares of chunks are of blocks.
        (0..pieces)
            .map(|p| p * n / pieces..(p + 1) * n / pieces)
            .collect()
    }
}
