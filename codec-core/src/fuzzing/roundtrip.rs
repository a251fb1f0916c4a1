//! The codec round trip: learn a profile from an arbitrary small cache, encode, decode, compare.

use super::decode::assert_part_of;
use super::input::Input;
use crate::container::{max_encoded_len, EncodeParams, ProfileMode, Stream};
use crate::importance::{block_exponents, reference_queries, ImportanceParams};
use crate::kv::{Dtype, KvCache, KvMeta, KvShape, Rope, RopeStyle, Tensor};
use crate::learn::{learn_profile, LearnParams, Queries, Sample};
use crate::limits::Limits;
use crate::profile::Profile;
use crate::quant::{quantize_block, BlockConsts, Exps};
use alloc::string::String;
use alloc::vec;
use alloc::vec::Vec;
use half::{bf16, f16};

/// The reconstruction the format promises for `cache` encoded with `profile` and `params`:
/// each chunk quantized with the reference quantizer ([`quantize_block`]) at its level, with
/// the step exponents the encoder's importance policy gives ([`block_exponents`] on K, shared
/// by K and V), narrowed to the cache's dtype (sink rows exact). What a decoder must output.
pub fn expected_reconstruction(
    cache: &KvCache,
    profile: &Profile,
    params: &EncodeParams,
) -> KvCache {
    let s = cache.shape;
    let c = s.channels();
    let d = s.head_dim as usize;
    let heads = s.kv_heads as usize;
    let first = cache.meta.first_position;
    let chunk_tokens = params.chunk_tokens.max(1) as usize;
    let mut out = KvCache::zeros(s, cache.dtype(), cache.meta.clone());
    for layer in 0..s.layers {
        let l = layer as usize;
        let kx = cache.k[l].to_f32_vec();
        for kv in 0..2 {
            let x = if kv == 0 {
                kx.clone()
            } else {
                cache.v[l].to_f32_vec()
            };
            let mut rec = vec![0f32; x.len()];
            let mut start = 0;
            let mut chunk = 0;
            while start < s.tokens as usize {
                let end = start.saturating_add(chunk_tokens).min(s.tokens as usize);
                let level = params.levels[if params.levels.len() == 1 { 0 } else { chunk }];
                let consts = BlockConsts::new(
                    profile.channel_params(layer, kv),
                    profile.level_multipliers()[level as usize],
                );
                let pos = first.saturating_add(start as u64);
                let sink = u64::from(params.n_sink)
                    .saturating_sub(pos)
                    .min((end - start) as u64) as usize;
                // Step exponents: chosen from K by the importance policy, shared by K and V.
                let mut exps = Vec::new();
                if let (true, Some(imp)) = (params.token_importance, profile.importance()) {
                    let qm = &imp.query_mean[l * c..(l + 1) * c];
                    let qpos = first.saturating_add(u64::from(s.tokens));
                    let qref = reference_queries(qm, d, qpos, &cache.meta.rope);
                    block_exponents(
                        &kx[start * c..end * c],
                        c,
                        d,
                        sink,
                        pos,
                        &qref,
                        &imp.tau[l * heads..(l + 1) * heads],
                        &cache.meta.rope,
                        &imp.params,
                        &mut exps,
                    );
                }
                let mut symbols = Vec::new();
                quantize_block(
                    &x[start * c..end * c],
                    &consts,
                    params.group as usize,
                    sink,
                    Exps {
                        exps: &exps,
                        head_dim: d,
                    },
                    &mut symbols,
                    &mut rec[start * c..end * c],
                );
                start = end;
                chunk += 1;
            }
            let dst = if kv == 0 {
                &mut out.k[l]
            } else {
                &mut out.v[l]
            };
            dst.as_mut().write_f32(0, &rec);
        }
    }
    out
}

/// A tensor of `dtype` holding `values` rounded to it; values that round to an infinity are
/// replaced by 0 (the encoder takes finite caches only).
fn finite_tensor(dtype: Dtype, values: &[f32]) -> Tensor {
    match dtype {
        Dtype::F16 => Tensor::F16(
            values
                .iter()
                .map(|&x| Some(f16::from_f32(x)).filter(|h| h.is_finite()))
                .map(|h| h.unwrap_or(f16::ZERO))
                .collect(),
        ),
        Dtype::Bf16 => Tensor::Bf16(
            values
                .iter()
                .map(|&x| Some(bf16::from_f32(x)).filter(|h| h.is_finite()))
                .map(|h| h.unwrap_or(bf16::ZERO))
                .collect(),
        ),
        Dtype::F32 => Tensor::F32(
            values
                .iter()
                .map(|&x| if x.is_finite() { x } else { 0.0 })
                .collect(),
        ),
    }
}

/// `2^(e / 8)`, `e` in `-128..128`, exactly enough for a scale.
fn scale_of(b: u8) -> f32 {
    libm::exp2f((f32::from(b) - 128.0) / 8.0)
}

/// A small cache with a profile learned from itself, encoded, decoded and compared
/// (`fuzz_targets/roundtrip_codec.rs`).
///
/// Input (one byte each unless said; the pseudo-random stream of [`Input`] takes over for the
/// values and queries once the input ends):
///
/// 1. `layers` (`1 + b % 3`), `kv_heads` (`1 + b % 3`), `head_dim` (`1 + b % 16`), `tokens`
///    (`b % 81`); dtype (`b % 3`), rope style (`b / 3 % 3`), `k_pre_rope` (`b / 9 % 2`);
/// 2. `flags`: bit 0 embed the profile, bit 1 token importance, bit 2 record queries, bit 3
///    custom importance parameters, bit 4 one level per chunk, bits 5–6 `first_position` kind
///    (0; a `u16`; a `u64`; `u64::MAX - u8`), bit 7 raw rope theta and scaling (two `u32`);
/// 3. `chunk_tokens` (`1 + b % 96`, 255: `u32::MAX`), `group` (`1 + b % 64`, 255: 1024),
///    `n_sink` (`b % 24`), then the `first_position` and rope fields the flags ask for;
/// 4. levels: count (`1 + b % 3`), one multiplier byte each (`2^((b - 128) / 8)`), the chunk
///    levels; model id length (`b % 8`) and bytes; target error, calibration rounds, and (bit 3)
///    slope, quantile and `max_exp`;
/// 5. values: per tensor (layer 0 K, layer 0 V, ...) a scale byte `s` (`scale = 2^((s / 2 -
///    64) / 8)`, with `s` offset by 128), one offset byte `o` per channel (`(o as i8) / 32 *
///    scale`), then per element a byte `v`: `(v as i8) / 16 * scale` plus its channel's offset,
///    except `0x80` (an outlier, `4096 * scale`) and, for f32 caches, `0x81` (the next 4 bytes as
///    raw f32 bits); values that do not fit the dtype become 0;
/// 6. queries (bit 2): heads multiplier (`1 + b % 2`), count (`1 + b % 4`), `q_start`, values.
///
/// Asserts: [`learn_profile`] (from one zero token for a cache of none) and
/// [`encode`](crate::encode) succeed (encoding may refuse only a
/// non-finite rope theta or scaling); the stream decodes to exactly [`expected_reconstruction`]
/// (bit for bit), with the input's shape and metadata; its length is at most
/// [`max_encoded_len`]; a token range decodes to the same bits as the full decode.
pub fn roundtrip_codec(data: &[u8]) {
    let mut input = Input::new(data);
    let case = RoundtripCase::read(&mut input);
    let Some(bytes) = case.encode() else {
        return;
    };
    let (cache, profile, params) = (&case.cache, &case.profile, &case.params);
    let profile_len = if case.embedded {
        profile.as_bytes().len() as u64
    } else {
        0
    };
    let bound = max_encoded_len(
        &cache.shape,
        cache.dtype(),
        params,
        profile_len,
        cache.meta.model_id.len(),
    );
    assert!(
        bytes.len() as u64 <= bound,
        "stream of {} bytes exceeds max_encoded_len {bound}",
        bytes.len()
    );
    let supplied = if case.embedded { None } else { Some(profile) };
    check_decode(&mut input, &bytes, supplied, cache, profile, params);
}

/// What a [`roundtrip_codec`] input codes (items 1-6 of its layout): also the input of
/// codec-cuda's `encode_chain` target, which encodes it on the host-run kernels.
#[derive(Debug)]
pub struct RoundtripCase {
    /// The cache.
    pub cache: KvCache,
    /// The profile learned from it.
    pub profile: Profile,
    /// How it is encoded.
    pub params: EncodeParams,
    /// Whether the stream embeds the profile (else references it).
    pub embedded: bool,
}

impl RoundtripCase {
    /// Reads the case from the front of `input`; panics if [`learn_profile`] fails on its
    /// cache (a harness failure).
    pub fn read(input: &mut Input<'_>) -> Self {
        let case = CodecCase::read(input);
        let cache = case.cache(input);
        let q_data = case.queries(input);
        let queries = q_data.as_ref().map(|(q, q_heads, q_start)| Queries {
            q: q.iter().map(Vec::as_slice).collect(),
            q_heads: *q_heads,
            q_start: *q_start,
        });
        // A profile is not learned from no tokens (`EncodeError::NoSamples`): an empty cache is
        // coded with the profile of one zero token of its shape.
        let one_token = (cache.shape.tokens == 0).then(|| {
            let shape = KvShape {
                tokens: 1,
                ..cache.shape
            };
            KvCache::zeros(shape, cache.dtype(), cache.meta.clone())
        });
        let sample = match &one_token {
            Some(zeros) => Sample {
                kv: zeros.view(),
                queries: None,
            },
            None => Sample {
                kv: cache.view(),
                queries,
            },
        };
        let profile = match learn_profile(&[sample], &case.learn) {
            Ok(p) => p,
            Err(e) => panic!("learn_profile failed on a valid cache: {e}"),
        };
        RoundtripCase {
            cache,
            profile,
            params: case.params,
            embedded: case.flags & 1 != 0,
        }
    }

    /// The stream [`encode`](crate::encode) writes; `None` if it refuses the case, which it
    /// may only for a non-finite rope theta or scaling (asserted).
    pub fn encode(&self) -> Option<Vec<u8>> {
        match crate::encode(&self.cache.view(), self.mode(), &self.params) {
            Ok(b) => Some(b),
            Err(e) => {
                let rope = self.cache.meta.rope;
                assert!(
                    !(rope.theta.is_finite() && rope.scaling.is_finite()),
                    "encode failed on a valid cache: {e}"
                );
                None
            }
        }
    }

    /// The profile mode the stream is written with.
    pub fn mode(&self) -> ProfileMode<'_> {
        if self.embedded {
            ProfileMode::Embedded(&self.profile)
        } else {
            ProfileMode::Referenced(&self.profile)
        }
    }
}

/// The stream `bytes` of `cache` decodes to exactly [`expected_reconstruction`] with the
/// cache's shape and metadata, and a token range drawn from `input` to the same bits.
fn check_decode(
    input: &mut Input<'_>,
    bytes: &[u8],
    supplied: Option<&Profile>,
    cache: &KvCache,
    profile: &Profile,
    params: &EncodeParams,
) {
    let stream = match Stream::open(bytes, supplied, &Limits::DEFAULT) {
        Ok(s) => s,
        Err(e) => panic!("an encoded stream opens: {e}"),
    };
    let decoded = match stream.decode() {
        Ok(d) => d,
        Err(e) => panic!("an encoded stream decodes: {e}"),
    };
    assert_eq!(decoded.shape, cache.shape);
    assert_eq!(decoded.meta.first_position, cache.meta.first_position);
    assert_eq!(decoded.meta.model_id, cache.meta.model_id);
    assert_eq!(
        decoded.meta.rope.theta.to_bits(),
        cache.meta.rope.theta.to_bits()
    );
    let expected = expected_reconstruction(cache, profile, params);
    assert_part_of(&decoded, &expected, 0);
    let tokens = cache.shape.tokens;
    if tokens > 0 {
        let start = u32::from(input.u8()) % tokens;
        let end = start + 1 + u32::from(input.u8()) % (tokens - start);
        match stream.decode_tokens(start..end) {
            Ok(part) => assert_part_of(&part, &decoded, start),
            Err(e) => panic!("a token range of a decodable stream decodes: {e}"),
        }
    }
}

/// The settings [`roundtrip_codec`] reads first (items 1-4 of its input layout).
struct CodecCase {
    shape: KvShape,
    dtype: Dtype,
    flags: u8,
    meta: KvMeta,
    learn: LearnParams,
    params: EncodeParams,
}

impl CodecCase {
    fn read(input: &mut Input<'_>) -> Self {
        let layers = 1 + u32::from(input.u8() % 3);
        let kv_heads = 1 + u32::from(input.u8() % 3);
        let head_dim = 1 + u32::from(input.u8() % 16);
        let tokens = u32::from(input.u8()) % 81;
        let b = input.u8();
        let dtype = Dtype::from_code(b % 3).unwrap_or(Dtype::F16);
        let style = RopeStyle::from_code(b / 3 % 3).unwrap_or(RopeStyle::None);
        let k_pre_rope = b / 9 % 2 == 1;
        let flags = input.u8();
        let chunk_tokens = match input.u8() {
            255 => u32::MAX,
            b => 1 + u32::from(b % 96),
        };
        let group = match input.u8() {
            255 => 1024,
            b => 1 + u32::from(b % 64),
        };
        let n_sink = u16::from(input.u8() % 24);
        let first_position = match (flags >> 5) & 3 {
            0 => 0,
            1 => u64::from(input.u16()),
            2 => input.u64(),
            _ => u64::MAX - u64::from(input.u8()),
        };
        let (theta, scaling) = if flags & 0x80 != 0 {
            (f32::from_bits(input.u32()), f32::from_bits(input.u32()))
        } else {
            let theta = [10000.0, 500000.0, 1.0, 0.5][usize::from(input.u8() % 4)];
            (theta, 1.0)
        };
        let shape = KvShape {
            layers,
            kv_heads,
            head_dim,
            tokens,
        };
        let n_chunks = tokens.div_ceil(chunk_tokens) as usize;
        let n_levels = 1 + input.u8() % 3;
        let level_mult: Vec<f32> = (0..n_levels).map(|_| scale_of(input.u8())).collect();
        let levels: Vec<u8> = if flags & 0x10 != 0 && n_chunks > 0 {
            (0..n_chunks).map(|_| input.u8() % n_levels).collect()
        } else {
            vec![input.u8() % n_levels]
        };
        let id_len = usize::from(input.u8() % 8);
        let model_id = String::from_utf8_lossy(input.bytes(id_len)).into_owned();
        let target_error = [0.1, 0.02, 0.5, 0.005][usize::from(input.u8() % 4)];
        let calibration_rounds = u32::from(input.u8() % 3);
        let importance = if flags & 8 != 0 {
            Some(ImportanceParams {
                slope: [0.0, 0.5, 1.0, 4.0][usize::from(input.u8() % 4)],
                quantile: [0.0, 0.5, 0.95, 1.0][usize::from(input.u8() % 4)],
                max_exp: input.u8() % 16,
            })
        } else {
            Some(ImportanceParams::default())
        };
        let rope = Rope {
            theta,
            style,
            scaling,
            k_pre_rope,
        };
        CodecCase {
            shape,
            dtype,
            flags,
            meta: KvMeta {
                model_id,
                rope,
                first_position,
            },
            learn: LearnParams {
                level_mult,
                target_error,
                anchor_ratio: 0.5,
                group,
                chunk_tokens,
                n_sink,
                calibration_rounds,
                max_queries: 8,
                importance,
            },
            params: EncodeParams {
                chunk_tokens,
                group,
                n_sink,
                levels,
                token_importance: flags & 2 != 0,
            },
        }
    }

    /// Item 5 of the input layout: the cache's values.
    fn cache(&self, input: &mut Input<'_>) -> KvCache {
        let (c, n) = (self.shape.channels(), self.shape.tensor_len());
        let (mut k, mut v) = (Vec::new(), Vec::new());
        for i in 0..2 * self.shape.layers {
            let scale = scale_of(input.u8_or_rng().wrapping_add(128) / 2 + 64);
            let offsets: Vec<f32> = (0..c)
                .map(|_| f32::from(input.u8_or_rng() as i8) / 32.0 * scale)
                .collect();
            let mut values = Vec::with_capacity(n);
            for j in 0..n {
                let b = input.u8_or_rng();
                let x = match b {
                    0x80 => 4096.0 * scale,
                    0x81 if self.dtype == Dtype::F32 => {
                        f32::from_bits(u32::from_le_bytes(core::array::from_fn(|_| {
                            input.u8_or_rng()
                        })))
                    }
                    _ => f32::from(b as i8) / 16.0 * scale + offsets[j % c],
                };
                values.push(x);
            }
            let t = finite_tensor(self.dtype, &values);
            if i % 2 == 0 {
                k.push(t)
            } else {
                v.push(t)
            }
        }
        let (shape, meta) = (self.shape, self.meta.clone());
        KvCache { shape, k, v, meta }
    }

    /// Item 6 of the input layout: per layer the queries, their query heads and `q_start`, if
    /// flags bit 2 asks for them.
    #[allow(clippy::type_complexity)]
    fn queries(&self, input: &mut Input<'_>) -> Option<(Vec<Vec<f32>>, usize, u64)> {
        if self.flags & 4 == 0 {
            return None;
        }
        let s = self.shape;
        let q_heads = s.kv_heads as usize * (1 + usize::from(input.u8() % 2));
        let n_q = 1 + usize::from(input.u8() % 4);
        let q_start = u64::from(input.u8()) % (u64::from(s.tokens) + 1);
        let per = n_q * q_heads * s.head_dim as usize;
        let q = (0..s.layers)
            .map(|_| {
                (0..per)
                    .map(|_| f32::from(input.u8_or_rng() as i8) / 32.0)
                    .collect()
            })
            .collect();
        Some((q, q_heads, q_start))
    }
}
