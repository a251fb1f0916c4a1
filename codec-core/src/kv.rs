//! The KV-cache model: shape, element types, borrowed views and owned caches.
//!
//! A cache has `layers` layers; each layer holds a K and a V tensor laid out `[tokens, kv_heads,
//! head_dim]` (token-major, as servers hand them over). A *channel* is one `(head, dim)` pair, so a
//! token row of one tensor has `channels = kv_heads * head_dim` values.

use crate::error::{EncodeError, Kv, ShapeError};
use crate::limits::Limits;
use alloc::string::String;
use alloc::vec::Vec;
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

/// Element type of a tensor, as stored in the stream header (`spec/FORMAT.md`, "Header").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Dtype {
    /// IEEE 754 binary16.
    F16 = 0,
    /// bfloat16.
    Bf16 = 1,
    /// IEEE 754 binary32.
    F32 = 2,
}

impl Dtype {
    /// Bytes per element.
    pub const fn size_bytes(self) -> usize {
        match self {
            Dtype::F16 | Dtype::Bf16 => 2,
            Dtype::F32 => 4,
        }
    }
    /// The wire code of this dtype.
    pub const fn code(self) -> u8 {
        self as u8
    }
    /// Parses a wire code.
    pub const fn from_code(code: u8) -> Option<Self> {
        match code {
            0 => Some(Dtype::F16),
            1 => Some(Dtype::Bf16),
            2 => Some(Dtype::F32),
            _ => None,
        }
    }
    /// Name as used by safetensors (`F16`, `BF16`, `F32`).
    pub const fn name(self) -> &'static str {
        match self {
            Dtype::F16 => "F16",
            Dtype::Bf16 => "BF16",
            Dtype::F32 => "F32",
        }
    }
}

/// The dimensions of a KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KvShape {
    /// Number of transformer layers.
    pub layers: u32,
    /// Number of KV heads per layer.
    pub kv_heads: u32,
    /// Dimension of one head.
    pub head_dim: u32,
    /// Number of tokens.
    pub tokens: u32,
}

impl KvShape {
    /// Values in one token row of one tensor (`kv_heads * head_dim`).
    pub fn channels(&self) -> usize {
        self.kv_heads as usize * self.head_dim as usize
    }
    /// Values in one tensor (`tokens * channels`).
    pub fn tensor_len(&self) -> usize {
        self.tokens as usize * self.channels()
    }
    /// [`tensor_len`](Self::tensor_len), or `None` where it overflows a `usize`: the form for
    /// a shape nobody has checked yet (a caller's), which empty tensors would otherwise match
    /// after wrapping.
    pub fn checked_tensor_len(&self) -> Option<usize> {
        u64::from(self.kv_heads)
            .checked_mul(u64::from(self.head_dim))
            .and_then(|c| c.checked_mul(u64::from(self.tokens)))
            .and_then(|n| usize::try_from(n).ok())
    }
    /// Values in the whole cache (`layers * 2 * tokens * channels`).
    pub fn total_elements(&self) -> u64 {
        self.layers as u64 * 2 * self.tokens as u64 * self.kv_heads as u64 * self.head_dim as u64
    }
}

/// How rotary position embedding pairs channels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum RopeStyle {
    /// No rotary embedding (or unknown).
    None = 0,
    /// "rotate_half" (GPT-NeoX, Llama): channel `j` pairs with `j + head_dim/2`.
    NeoX = 1,
    /// Interleaved (GPT-J): channel `2j` pairs with `2j + 1`.
    GptJ = 2,
}

impl RopeStyle {
    /// Parses a wire code.
    pub const fn from_code(code: u8) -> Option<Self> {
        match code {
            0 => Some(RopeStyle::None),
            1 => Some(RopeStyle::NeoX),
            2 => Some(RopeStyle::GptJ),
            _ => None,
        }
    }
}

/// Rotary settings that travel with the stream so a consumer can re-position K.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rope {
    /// Base `theta` of the rotary frequencies (`angle = pos * theta^(-2j/head_dim)`).
    pub theta: f32,
    /// Pairing of channels.
    pub style: RopeStyle,
    /// Linear position scaling factor (1.0 for none).
    pub scaling: f32,
    /// `true` if K is stored before the rotary embedding was applied.
    pub k_pre_rope: bool,
}

impl Default for Rope {
    fn default() -> Self {
        Rope {
            theta: 10000.0,
            style: RopeStyle::None,
            scaling: 1.0,
            k_pre_rope: false,
        }
    }
}

/// Metadata that travels with a stream.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct KvMeta {
    /// Free-form model identifier (UTF-8, at most [`crate::consts::MAX_MODEL_ID_BYTES`] bytes).
    pub model_id: String,
    /// Rotary settings.
    pub rope: Rope,
    /// Absolute position of the first token.
    pub first_position: u64,
}

/// A borrowed tensor of one of the supported element types.
#[derive(Clone, Copy, Debug)]
pub enum TensorRef<'a> {
    /// f16 elements.
    F16(&'a [f16]),
    /// bf16 elements.
    Bf16(&'a [bf16]),
    /// f32 elements.
    F32(&'a [f32]),
}

impl TensorRef<'_> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            TensorRef::F16(s) => s.len(),
            TensorRef::Bf16(s) => s.len(),
            TensorRef::F32(s) => s.len(),
        }
    }
    /// `true` if there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Element type.
    pub fn dtype(&self) -> Dtype {
        match self {
            TensorRef::F16(_) => Dtype::F16,
            TensorRef::Bf16(_) => Dtype::Bf16,
            TensorRef::F32(_) => Dtype::F32,
        }
    }
    /// Element `i` widened to f32 (exact for every supported dtype).
    #[inline]
    pub fn get_f32(&self, i: usize) -> f32 {
        match self {
            TensorRef::F16(s) => s[i].to_f32(),
            TensorRef::Bf16(s) => s[i].to_f32(),
            TensorRef::F32(s) => s[i],
        }
    }
    /// `true` if no value is NaN or infinite.
    pub fn all_finite(&self) -> bool {
        // A value is not finite when its exponent bits are all ones. Blocks of 256 are tested
        // without an early exit, so the test vectorizes (`Iterator::all` does not).
        fn none_all_ones<T: Copy>(s: &[T], bits: impl Fn(T) -> u32, exp: u32) -> bool {
            s.chunks(256)
                .all(|c| c.iter().fold(0u32, |acc, &x| acc | u32::from(bits(x) & exp == exp)) == 0)
        }
        match self {
            TensorRef::F16(s) => none_all_ones(s, |x| u32::from(x.to_bits()), 0x7C00),
            TensorRef::Bf16(s) => none_all_ones(s, |x| u32::from(x.to_bits()), 0x7F80),
            TensorRef::F32(s) => none_all_ones(s, f32::to_bits, 0x7F80_0000),
        }
    }
    /// Copies `dst.len()` elements starting at `start`, widened to f32.
    pub fn read_f32(&self, start: usize, dst: &mut [f32]) {
        let n = dst.len();
        match self {
            // Exact widenings; `half`'s slice conversions use the CPU's instructions (F16C).
            TensorRef::F16(s) => s[start..start + n].convert_to_f32_slice(dst),
            TensorRef::Bf16(s) => s[start..start + n].convert_to_f32_slice(dst),
            TensorRef::F32(s) => dst.copy_from_slice(&s[start..start + n]),
        }
    }
}

/// An owned tensor of one of the supported element types.
#[derive(Clone, Debug, PartialEq)]
pub enum Tensor {
    /// f16 elements.
    F16(Vec<f16>),
    /// bf16 elements.
    Bf16(Vec<bf16>),
    /// f32 elements.
    F32(Vec<f32>),
}

impl Tensor {
    /// A zero-filled tensor of `len` elements.
    ///
    /// Allocated as zeroed memory (`alloc_zeroed`), which the system can hand out without
    /// writing it: a decoder that overwrites every element then touches each page once.
    pub fn zeros(dtype: Dtype, len: usize) -> Self {
        use half::vec::HalfBitsVecExt;
        match dtype {
            Dtype::F16 => Tensor::F16(alloc::vec![0u16; len].reinterpret_into()),
            Dtype::Bf16 => Tensor::Bf16(alloc::vec![0u16; len].reinterpret_into()),
            Dtype::F32 => Tensor::F32(alloc::vec![0.0; len]),
        }
    }
    /// Borrows the tensor.
    pub fn as_ref(&self) -> TensorRef<'_> {
        match self {
            Tensor::F16(v) => TensorRef::F16(v),
            Tensor::Bf16(v) => TensorRef::Bf16(v),
            Tensor::F32(v) => TensorRef::F32(v),
        }
    }
    /// Borrows the tensor mutably.
    pub fn as_mut(&mut self) -> TensorMut<'_> {
        match self {
            Tensor::F16(v) => TensorMut::F16(v),
            Tensor::Bf16(v) => TensorMut::Bf16(v),
            Tensor::F32(v) => TensorMut::F32(v),
        }
    }
    /// Element type.
    pub fn dtype(&self) -> Dtype {
        self.as_ref().dtype()
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.as_ref().len()
    }
    /// `true` if there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// A tensor of `dtype` holding `values` rounded to it (to nearest, ties to even).
    pub fn from_f32(dtype: Dtype, values: &[f32]) -> Self {
        let mut t = Tensor::zeros(dtype, values.len());
        t.as_mut().write_f32(0, values);
        t
    }
    /// All elements widened to f32.
    pub fn to_f32_vec(&self) -> Vec<f32> {
        let r = self.as_ref();
        let mut out = alloc::vec![0.0; r.len()];
        r.read_f32(0, &mut out);
        out
    }
}

/// A mutably borrowed tensor (the caller's output buffer).
#[derive(Debug)]
pub enum TensorMut<'a> {
    /// f16 elements.
    F16(&'a mut [f16]),
    /// bf16 elements.
    Bf16(&'a mut [bf16]),
    /// f32 elements.
    F32(&'a mut [f32]),
}

impl<'a> TensorMut<'a> {
    /// The same elements, borrowed for a shorter time.
    pub(crate) fn reborrow(&mut self) -> TensorMut<'_> {
        match self {
            TensorMut::F16(s) => TensorMut::F16(s),
            TensorMut::Bf16(s) => TensorMut::Bf16(s),
            TensorMut::F32(s) => TensorMut::F32(s),
        }
    }
    /// Elements `..mid` and `mid..` (`mid` at most [`len`](Self::len)).
    pub(crate) fn split_at(self, mid: usize) -> (TensorMut<'a>, TensorMut<'a>) {
        match self {
            TensorMut::F16(s) => {
                let (a, b) = s.split_at_mut(mid);
                (TensorMut::F16(a), TensorMut::F16(b))
            }
            TensorMut::Bf16(s) => {
                let (a, b) = s.split_at_mut(mid);
                (TensorMut::Bf16(a), TensorMut::Bf16(b))
            }
            TensorMut::F32(s) => {
                let (a, b) = s.split_at_mut(mid);
                (TensorMut::F32(a), TensorMut::F32(b))
            }
        }
    }
}

impl TensorMut<'_> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            TensorMut::F16(s) => s.len(),
            TensorMut::Bf16(s) => s.len(),
            TensorMut::F32(s) => s.len(),
        }
    }
    /// `true` if there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Element type.
    pub fn dtype(&self) -> Dtype {
        match self {
            TensorMut::F16(_) => Dtype::F16,
            TensorMut::Bf16(_) => Dtype::Bf16,
            TensorMut::F32(_) => Dtype::F32,
        }
    }
    /// Writes `src` at `start`, rounding to nearest-even into the tensor's dtype.
    pub fn write_f32(&mut self, start: usize, src: &[f32]) {
        let n = src.len();
        match self {
            // `half`'s slice conversions use the CPU's conversion instructions where available
            // (F16C on x86); they round to nearest-even exactly as the scalar conversions do.
            TensorMut::F16(d) => d[start..start + n].convert_from_f32_slice(src),
            TensorMut::Bf16(d) => d[start..start + n].convert_from_f32_slice(src),
            TensorMut::F32(d) => d[start..start + n].copy_from_slice(src),
        }
    }
}

/// A borrowed KV cache: the encoder's input.
#[derive(Clone, Debug)]
pub struct KvView<'a> {
    /// Dimensions.
    pub shape: KvShape,
    /// Per layer, K `[tokens, kv_heads, head_dim]`.
    pub k: Vec<TensorRef<'a>>,
    /// Per layer, V `[tokens, kv_heads, head_dim]`.
    pub v: Vec<TensorRef<'a>>,
    /// Metadata stored in the stream.
    pub meta: KvMeta,
}

impl KvView<'_> {
    /// Checks the tensors against the shape (count, lengths, one dtype) and for non-finite
    /// values: what every encoder and the profile learner require of their input.
    pub fn check(&self) -> Result<(), EncodeError> {
        let shape = self.shape;
        let mismatch = |what| Err(EncodeError::ShapeMismatch { what });
        if self.k.len() != shape.layers as usize || self.v.len() != shape.layers as usize {
            return mismatch("number of layers");
        }
        if shape.layers == 0 || shape.kv_heads == 0 || shape.head_dim == 0 {
            return mismatch("zero dimension");
        }
        let n = shape
            .checked_tensor_len()
            .ok_or(EncodeError::ShapeMismatch {
                what: "tokens * kv_heads * head_dim overflows",
            })?;
        let dtype = self.k[0].dtype();
        for (layer, (k, v)) in self.k.iter().zip(&self.v).enumerate() {
            if k.len() != n || v.len() != n {
                return mismatch("tensor length is not tokens * kv_heads * head_dim");
            }
            if k.dtype() != dtype || v.dtype() != dtype {
                return mismatch("tensors of mixed dtypes");
            }
            for (t, kv) in [(k, Kv::K), (v, Kv::V)] {
                if !t.all_finite() {
                    let layer = layer as u32;
                    return Err(EncodeError::NonFinite { layer, kv });
                }
            }
        }
        Ok(())
    }
}

/// Checks a cache's dimensions against `limits`: checks H11-H13 of a stream header and P6 of a
/// profile (`spec/FORMAT.md` §3.7, §4.6).
pub(crate) fn check_dims(
    layers: u32,
    kv_heads: u32,
    head_dim: u32,
    limits: &Limits,
) -> Result<(), ShapeError> {
    for (field, n) in [
        ("layers", layers),
        ("kv_heads", kv_heads),
        ("head_dim", head_dim),
    ] {
        if n == 0 {
            return Err(ShapeError::ZeroDimension { field });
        }
    }
    if layers > limits.max_layers {
        return Err(ShapeError::Layers {
            got: layers,
            max: limits.max_layers,
        });
    }
    let channels = u64::from(kv_heads) * u64::from(head_dim);
    if channels > u64::from(limits.max_channels) {
        return Err(ShapeError::Channels {
            got: channels,
            max: u64::from(limits.max_channels),
        });
    }
    Ok(())
}

/// An owned KV cache: the decoder's output.
#[derive(Clone, Debug, PartialEq)]
pub struct KvCache {
    /// Dimensions.
    pub shape: KvShape,
    /// Per layer, K `[tokens, kv_heads, head_dim]`.
    pub k: Vec<Tensor>,
    /// Per layer, V `[tokens, kv_heads, head_dim]`.
    pub v: Vec<Tensor>,
    /// Metadata read from the stream.
    pub meta: KvMeta,
}

impl KvCache {
    /// A zero-filled cache.
    pub fn zeros(shape: KvShape, dtype: Dtype, meta: KvMeta) -> Self {
        let n = shape.tensor_len();
        let k = (0..shape.layers).map(|_| Tensor::zeros(dtype, n)).collect();
        let v = (0..shape.layers).map(|_| Tensor::zeros(dtype, n)).collect();
        KvCache { shape, k, v, meta }
    }
    /// Borrows the cache as an encoder input.
    pub fn view(&self) -> KvView<'_> {
        KvView {
            shape: self.shape,
            k: self.k.iter().map(Tensor::as_ref).collect(),
            v: self.v.iter().map(Tensor::as_ref).collect(),
            meta: self.meta.clone(),
        }
    }
    /// Element type of the tensors (F32 for an empty cache).
    pub fn dtype(&self) -> Dtype {
        self.k.first().map(Tensor::dtype).unwrap_or(Dtype::F32)
    }
}

/// What a decoded cache's coding is expected to have cost it: per layer, per (token, KV head),
/// the expected squared error of the head's `head_dim` values, the sum over its channels of
/// `step^2 / 12` (the variance of rounding to a grid of that step) with each channel's step as
/// the stream coded that token (its level, anchor or delta, the token's step exponent); 0 for
/// tokens stored exactly. [`Stream::decode_with_error`](crate::Stream::decode_with_error)
/// reports it; CacheBlend's selection takes it out of the deviations it measures, so that
/// coarsely coded tokens do not pass for deviating ones.
#[derive(Clone, Debug, PartialEq)]
pub struct CodingError {
    /// Tokens.
    pub tokens: u32,
    /// KV heads per token.
    pub kv_heads: u32,
    /// Per layer, K's expected squared errors `[tokens, kv_heads]`.
    pub k: Vec<Vec<f32>>,
    /// Per layer, V's expected squared errors `[tokens, kv_heads]`.
    pub v: Vec<Vec<f32>>,
}

impl CodingError {
    /// No error, for `shape`'s tokens (a cache kept as computed).
    pub fn zeros(shape: KvShape) -> Self {
        let n = shape.tokens as usize * shape.kv_heads as usize;
        let layers = shape.layers as usize;
        CodingError {
            tokens: shape.tokens,
            kv_heads: shape.kv_heads,
            k: alloc::vec![alloc::vec![0.0; n]; layers],
            v: alloc::vec![alloc::vec![0.0; n]; layers],
        }
    }

    /// Appends `other`'s tokens after these (caches placed one after another); `None` if the
    /// layers or heads differ or the token count overflows.
    pub fn append(&mut self, other: &CodingError) -> Option<()> {
        let same = (self.kv_heads, self.k.len(), self.v.len())
            == (other.kv_heads, other.k.len(), other.v.len());
        let tokens = self.tokens.checked_add(other.tokens)?;
        if !same {
            return None;
        }
        for (a, b) in self.k.iter_mut().zip(&other.k) {
            a.extend_from_slice(b);
        }
        for (a, b) in self.v.iter_mut().zip(&other.v) {
            a.extend_from_slice(b);
        }
        self.tokens = tokens;
        Some(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// `all_finite` is `is_finite` of every element, in every dtype, wherever a NaN or an
        /// infinity sits (finite bit patterns with 0-2 NaNs or infinities put in).
        #[test]
        fn all_finite_is_every_element_finite(
            raw in prop::collection::vec(any::<u32>(), 0..700),
            specials in prop::collection::vec((0usize..700, 0u8..3), 0..3),
        ) {
            // Clearing bit 30 (and 14) keeps every dtype's exponent below all ones.
            let mut bits: Vec<u32> = raw.iter().map(|b| b & 0xBFFF_BFFF).collect();
            for &(at, which) in &specials {
                if let Some(b) = bits.get_mut(at) {
                    *b = [0x7F80_0000, 0xFF80_0000, 0x7FC0_0001][which as usize] | 0x7C00;
                }
            }
            let f32s: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
            let f16s: Vec<f16> = bits.iter().map(|&b| f16::from_bits(b as u16)).collect();
            let bf16s: Vec<bf16> = bits.iter().map(|&b| bf16::from_bits((b >> 16) as u16)).collect();
            prop_assert_eq!(TensorRef::F32(&f32s).all_finite(), f32s.iter().all(|x| x.is_finite()));
            prop_assert_eq!(TensorRef::F16(&f16s).all_finite(), f16s.iter().all(|x| x.is_finite()));
            prop_assert_eq!(TensorRef::Bf16(&bf16s).all_finite(), bf16s.iter().all(|x| x.is_finite()));
        }
    }
}
