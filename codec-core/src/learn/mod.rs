//! Learning a profile from sample caches (`kvc profile`, and self-contained encoding).
//!
//! Steps are allocated where the attention output is sensitive, measured rather than assumed:
//! - K: the error of a score `q . k` is `sum_c q_c e_c`, so a channel's step is made inversely
//!   proportional to the RMS of the queries that read it (averaged over each rotary pair, since
//!   rotation mixes the two channels of a pair). Without queries, steps follow each channel's
//!   standard deviation.
//! - V: the attention output weights all channels of V alike, so V gets one step per layer.
//! - Each `(layer, K/V)` is then scaled so that quantizing it alone at multiplier 1 gives the same
//!   attention-output error (`target_error / sqrt(2)`), measured on the samples' queries. Equal
//!   error per layer minimises the mean error over layers for a given number of bits.
//! - The anchor weight of each channel is the least-squares coefficient of `x - mean` on the
//!   anchor's `x - mean`, clamped to `[0, 1]` in sixteenths: on real caches many channels predict
//!   better from their mean than from the anchor, which plain anchor/delta coding ignores.
//!
//! With queries, the profile also stores the token-importance hints (`spec/FORMAT.md` §9.2): the
//! mean pre-rotary query per `(layer, KV head)` and a score threshold per head (a quantile of the
//! samples' scores); calibration and tables see the exponents the encoder will use.
//!
//! Frequency tables are then learned per level from the symbols the samples produce, indexed by
//! spread (the RMS of a channel's residual in steps, in quarter octaves): channels of the same
//! spread share a table, and each table links down to the table two quarter octaves narrower, the
//! one a symbol uses when its token's step is one exponent (half an octave) coarser.

use crate::consts::{group_is_valid, MAX_LEVELS, MAX_RADIUS, WEIGHT_ONE};
use crate::error::{EncodeError, ShapeError};
use crate::importance::{
    block_exponents, block_scores, reference_queries, ImportanceParams,
};
use crate::kv::{check_dims, KvShape, KvView, RopeStyle, TensorRef};
use crate::limits::Limits;
use crate::rope::rotate;
use crate::profile::{Importance, LevelTables, Parts, Profile, ProfileError, SymbolTable};
use crate::quant::{predict, quantize_block, BlockConsts, ChannelParams, Exps};
use crate::rans::FreqTable;
use alloc::vec;
use alloc::vec::Vec;

/// Queries recorded with a sample, used to measure attention-output error.
#[derive(Clone, Debug)]
pub struct Queries<'a> {
    /// Per layer, `[n_q, q_heads, head_dim]` (after rotary embedding if K is).
    pub q: Vec<&'a [f32]>,
    /// Query heads (a multiple of the cache's KV heads).
    pub q_heads: usize,
    /// Token index (within the sample) of the first query; query `i` attends to tokens
    /// `0..=q_start + i`.
    pub q_start: u64,
}

/// One sample cache, optionally with queries.
#[derive(Clone, Debug)]
pub struct Sample<'a> {
    /// The cache.
    pub kv: KvView<'a>,
    /// Its queries, if recorded.
    pub queries: Option<Queries<'a>>,
}

/// Settings of [`learn_profile`].
#[derive(Clone, Debug, PartialEq)]
pub struct LearnParams {
    /// Step multiplier of each level, finest first.
    pub level_mult: Vec<f32>,
    /// Attention-output error the calibration aims at for multiplier 1 (each of K and V gets
    /// `target_error / sqrt(2)`). Without queries, the relative reconstruction error aimed at.
    pub target_error: f32,
    /// Anchor step as a fraction of the delta step.
    pub anchor_ratio: f32,
    /// Token-group size used when collecting statistics (the stream's group should match).
    pub group: u32,
    /// Chunk size used when collecting statistics.
    pub chunk_tokens: u32,
    /// Sink tokens (absolute positions below this are stored exactly).
    pub n_sink: u16,
    /// Calibration rounds per `(layer, K/V)`.
    pub calibration_rounds: u32,
    /// At most this many queries per layer are used for calibration (evenly spaced).
    pub max_queries: usize,
    /// Token-importance policy (`spec/FORMAT.md` §9.2) to calibrate with and store in the
    /// profile; used only if some sample has queries (they give the mean query).
    pub importance: Option<ImportanceParams>,
}

impl Default for LearnParams {
    fn default() -> Self {
        LearnParams {
            level_mult: DEFAULT_LEVELS.to_vec(),
            target_error: 0.1,
            anchor_ratio: 0.5,
            group: 10,
            chunk_tokens: 1536,
            n_sink: 1,
            calibration_rounds: 3,
            max_queries: 32,
            importance: Some(ImportanceParams::default()),
        }
    }
}

/// Default level multipliers: level 0 near-lossless, the last about one bit per element.
///
/// Calibration aims at attention error `target_error * multiplier` on the samples (0.1 by
/// default); level 2 (`0.145`) is the coarsest level whose error on its own samples stays under
/// 0.015 (the README's results give the measurements behind the ladder).
pub const DEFAULT_LEVELS: [f32; 12] = [
    0.1, 0.12, 0.145, 0.17, 0.25, 0.35, 0.5, 0.65, 0.8, 0.95, 2.0, 4.5,
];

/// Learns a profile from samples. Deterministic: the same samples and parameters give the same
/// bytes on every platform.
pub fn learn_profile(samples: &[Sample<'_>], params: &LearnParams) -> Result<Profile, EncodeError> {
    let first = samples.first().ok_or(EncodeError::NoSamples)?;
    if samples.iter().all(|s| s.kv.shape.tokens == 0) {
        return Err(EncodeError::NoSamples);
    }
    let shape = first.kv.shape;
    check_params(params)?;
    check_samples(samples)?;
    let layers = shape.layers as usize;
    let c = shape.channels();
    let group = params.group as usize;
    let d = shape.head_dim as usize;
    let importance = match params.importance {
        Some(p) if samples.iter().any(|s| s.queries.is_some()) => {
            let query_mean = query_means(samples, layers, c, d);
            let tau = score_thresholds(samples, &query_mean, layers, c, d, p.quantile, params);
            Some(Importance {
                params: p,
                query_mean,
                tau,
            })
        }
        _ => None,
    };
    let exps = step_exponents(samples, layers, importance.as_ref(), params);
    let mut all_params = Vec::with_capacity(layers * 2 * c);
    for layer in 0..layers {
        let layer_exps: Vec<&[u8]> = exps.iter().map(|e| e[layer].as_slice()).collect();
        for kv in 0..2 {
            all_params.extend(learn_tensor(
                samples,
                &sample_tensors(samples, layer, kv),
                &layer_exps,
                layer,
                kv,
                c,
                group,
                params,
                d,
                first.kv.meta.rope.style,
            ));
        }
    }
    let mut levels = Vec::with_capacity(params.level_mult.len());
    for &mult in &params.level_mult {
        let stats = level_stats(samples, &exps, &all_params, mult, layers, c, d, params);
        levels.push(learn_tables(stats));
    }
    let parts = Parts {
        layers: shape.layers,
        kv_heads: shape.kv_heads,
        head_dim: shape.head_dim,
        level_mult: params.level_mult.clone(),
        params: all_params,
        importance,
        levels,
    };
    Profile::learned(&parts).map_err(|e| match e {
        ProfileError::TooLarge { got, max } => EncodeError::OverLimit {
            what: "profile bytes",
            got,
            max,
        },
        e => panic!("the learner's profile parts must be valid: {e}"),
    })
}

/// Step exponents of every sample and layer, as the encoder would choose them (none without
/// importance).
fn step_exponents(
    samples: &[Sample<'_>],
    layers: usize,
    importance: Option<&Importance>,
    params: &LearnParams,
) -> Vec<Vec<Vec<u8>>> {
    samples
        .iter()
        .map(|s| {
            (0..layers)
                .map(|layer| match importance {
                    Some(imp) => sample_exponents(s, layer, imp, params),
                    None => Vec::new(),
                })
                .collect()
        })
        .collect()
}

/// Every sample's K (`kv` 0) or V (1) of `layer` in f32, with its tokens.
fn sample_tensors(samples: &[Sample<'_>], layer: usize, kv: usize) -> Vec<(Vec<f32>, usize)> {
    samples
        .iter()
        .map(|s| {
            let t = if kv == 0 {
                s.kv.k[layer]
            } else {
                s.kv.v[layer]
            };
            (to_f32(t), s.kv.shape.tokens as usize)
        })
        .collect()
}

/// The learning parameters are in range.
fn check_params(params: &LearnParams) -> Result<(), EncodeError> {
    if params.level_mult.is_empty() || params.level_mult.len() > MAX_LEVELS {
        return Err(EncodeError::InvalidParam {
            what: "level count",
            got: params.level_mult.len() as u64,
        });
    }
    if params
        .level_mult
        .iter()
        .any(|m| !(m.is_finite() && *m > 0.0))
    {
        return Err(EncodeError::InvalidParam {
            what: "level multiplier",
            got: 0,
        });
    }
    if !group_is_valid(params.group) {
        return Err(EncodeError::InvalidParam {
            what: "group",
            got: params.group as u64,
        });
    }
    if params.chunk_tokens == 0 {
        return Err(EncodeError::InvalidParam {
            what: "chunk_tokens",
            got: 0,
        });
    }
    if !(params.target_error > 0.0 && params.anchor_ratio > 0.0) {
        return Err(EncodeError::InvalidParam {
            what: "target_error/anchor_ratio",
            got: 0,
        });
    }
    if let Some(imp) = &params.importance {
        if !imp.is_valid() {
            return Err(EncodeError::InvalidParam {
                what: "importance parameters",
                got: imp.max_exp as u64,
            });
        }
    }
    Ok(())
}

/// Every sample has the first one's shape, consistent tensors and, if any, queries of a
/// matching shape with finite values.
fn check_samples(samples: &[Sample<'_>]) -> Result<(), EncodeError> {
    let shape = samples[0].kv.shape;
    let dims = |s: KvShape| [s.layers, s.kv_heads, s.head_dim];
    for (i, s) in samples.iter().enumerate() {
        if dims(s.kv.shape) != dims(shape) {
            return Err(EncodeError::SampleShape {
                sample: i,
                shape: dims(s.kv.shape),
                first: dims(shape),
            });
        }
        s.kv.check()?;
        if let Some(q) = &s.queries {
            // One query's values; 0 (refused) if it overflows.
            let row = q.q_heads.checked_mul(shape.head_dim as usize).unwrap_or(0);
            if q.q.len() != shape.layers as usize
                || row == 0
                || q.q_heads % shape.kv_heads as usize != 0
                || q.q
                    .iter()
                    .any(|l| l.len() % row != 0 || l.len() != q.q[0].len())
            {
                return Err(EncodeError::ShapeMismatch { what: "queries" });
            }
            if let Some(layer) = q.q.iter().position(|l| l.iter().any(|x| !x.is_finite())) {
                return Err(EncodeError::InvalidParam {
                    what: "queries (not finite) of layer",
                    got: layer as u64,
                });
            }
        }
    }
    // Beyond these, decoders would refuse the profile.
    check_dims(shape.layers, shape.kv_heads, shape.head_dim, &Limits::DEFAULT).map_err(|e| match e {
        ShapeError::Layers { got, max } => EncodeError::OverLimit {
            what: "layers",
            got: got.into(),
            max: max.into(),
        },
        ShapeError::Channels { got, max } => EncodeError::OverLimit {
            what: "channels",
            got,
            max,
        },
        ShapeError::ZeroDimension { field } => EncodeError::InvalidParam { what: field, got: 0 },
    })?;
    Ok(())
}

/// Mean pre-rotary query per `(layer, kv_head, channel)` over the samples' queries.
fn query_means(samples: &[Sample<'_>], layers: usize, c: usize, d: usize) -> Vec<f32> {
    let heads = c / d;
    let mut out = Vec::with_capacity(layers * c);
    let mut q = vec![0f64; d];
    for layer in 0..layers {
        let mut acc = vec![0f64; c];
        let mut n = vec![0f64; heads];
        for s in samples {
            let Some(qs) = &s.queries else { continue };
            let per = qs.q_heads * d;
            let gsize = qs.q_heads / heads;
            for (i, row) in qs.q[layer].chunks_exact(per).enumerate() {
                let pos = s.kv.meta.first_position as f64 + qs.q_start as f64 + i as f64;
                for qh in 0..qs.q_heads {
                    let h = qh / gsize;
                    for (dst, &src) in q.iter_mut().zip(&row[qh * d..(qh + 1) * d]) {
                        *dst = src as f64;
                    }
                    rotate(&mut q, -pos, &s.kv.meta.rope);
                    for (a, b) in acc[h * d..(h + 1) * d].iter_mut().zip(&q) {
                        *a += b;
                    }
                    n[h] += 1.0;
                }
            }
        }
        out.extend(
            acc.iter()
                .enumerate()
                // Finite as f32 (FORMAT.md P16), even if rotation pushes a mean past f32::MAX.
                .map(|(i, a)| finite_f32(a / n[i / d].max(1.0))),
        );
    }
    out
}

/// Per `(layer, head)`, the `quantile` of the scores of all samples' non-sink tokens against the
/// mean query rotated to the position after each sample.
fn score_thresholds(
    samples: &[Sample<'_>],
    query_mean: &[f32],
    layers: usize,
    c: usize,
    d: usize,
    quantile: f32,
    params: &LearnParams,
) -> Vec<f32> {
    let heads = c / d;
    let mut tau = Vec::with_capacity(layers * heads);
    for layer in 0..layers {
        let mut per_head: Vec<Vec<f64>> = vec![Vec::new(); heads];
        for s in samples {
            let sh = s.kv.shape;
            let x = to_f32(s.kv.k[layer]);
            let qpos = s.kv.meta.first_position.saturating_add(sh.tokens as u64);
            let qref = reference_queries(
                &query_mean[layer * c..(layer + 1) * c],
                d,
                qpos,
                &s.kv.meta.rope,
            );
            let sink = (params.n_sink as u64)
                .saturating_sub(s.kv.meta.first_position)
                .min(sh.tokens as u64) as usize;
            let n = sh.tokens as usize - sink;
            let mut sc = vec![0f64; n * heads];
            block_scores(
                &x,
                c,
                d,
                sink,
                s.kv.meta.first_position,
                &qref,
                &s.kv.meta.rope,
                &mut sc,
            );
            for (i, v) in sc.iter().enumerate() {
                per_head[i % heads].push(*v);
            }
        }
        for mut v in per_head {
            v.sort_unstable_by(f64::total_cmp);
            let t = if v.is_empty() {
                0.0
            } else {
                let i = libm::floor(quantile as f64 * (v.len() - 1) as f64) as usize;
                v[i.min(v.len() - 1)]
            };
            // Scores of keys near f32::MAX can lie beyond the f32 range; tau must be finite.
            tau.push(finite_f32(t));
        }
    }
    tau
}

/// The exponents the encoder gives sample `s`'s layer `layer`, chunk after chunk (each chunk's
/// non-sink rows, row-major, one per head).
fn sample_exponents(
    s: &Sample<'_>,
    layer: usize,
    imp: &Importance,
    params: &LearnParams,
) -> Vec<u8> {
    let sh = s.kv.shape;
    let c = sh.channels();
    let d = sh.head_dim as usize;
    let x = to_f32(s.kv.k[layer]);
    let qpos = s.kv.meta.first_position.saturating_add(sh.tokens as u64);
    let qm = &imp.query_mean[layer * c..(layer + 1) * c];
    let qref = reference_queries(qm, d, qpos, &s.kv.meta.rope);
    let rows = sh.tokens as usize;
    let ct = params.chunk_tokens as usize;
    let mut out = Vec::new();
    let mut start = 0;
    while start < rows {
        let end = (start + ct).min(rows);
        let first = s.kv.meta.first_position.saturating_add(start as u64);
        let sink = (params.n_sink as u64)
            .saturating_sub(first)
            .min((end - start) as u64) as usize;
        block_exponents(
            &x[start * c..end * c],
            c,
            d,
            sink,
            first,
            &qref,
            &imp.tau[layer * (c / d)..(layer + 1) * (c / d)],
            &s.kv.meta.rope,
            &imp.params,
            &mut out,
        );
        start = end;
    }
    out
}

/// `x` rounded to f32, clamped to the finite range (a NaN stays NaN).
fn finite_f32(x: f64) -> f32 {
    x.clamp(-f32::MAX as f64, f32::MAX as f64) as f32
}

fn to_f32(t: TensorRef<'_>) -> Vec<f32> {
    let mut v = vec![0.0; t.len()];
    t.read_f32(0, &mut v);
    v
}

/// Per-channel statistics of one `(layer, K/V)` over the samples.
struct ChannelStats {
    mean: Vec<f64>,
    std: Vec<f64>,
    /// The RMS deviation over all channels (at least 1e-6).
    pooled_std: f64,
    /// The anchor weight of each channel, in sixteenths: the least-squares slope of a delta
    /// row's deviation on its anchor's, clamped to `0..=1`.
    weight: Vec<u8>,
}

/// Means, deviations and anchor weights of the samples' `tensors` (f64 accumulation in a fixed
/// order).
fn channel_stats(tensors: &[(Vec<f32>, usize)], c: usize, group: usize) -> ChannelStats {
    let mut sum = vec![0f64; c];
    let mut n = 0usize;
    for (x, t) in tensors {
        for row in x.chunks_exact(c).take(*t) {
            for (s, v) in sum.iter_mut().zip(row) {
                *s += *v as f64;
            }
        }
        n += t;
    }
    let mean: Vec<f64> = sum.iter().map(|s| s / n.max(1) as f64).collect();
    let mut var = vec![0f64; c];
    let (mut num, mut den) = (vec![0f64; c], vec![0f64; c]);
    for (x, _) in tensors {
        let rows: Vec<&[f32]> = x.chunks_exact(c).collect();
        for (r, row) in rows.iter().enumerate() {
            let a = rows[r - r % group];
            for ch in 0..c {
                let d = row[ch] as f64 - mean[ch];
                var[ch] += d * d;
                if r % group != 0 {
                    let da = a[ch] as f64 - mean[ch];
                    num[ch] += d * da;
                    den[ch] += da * da;
                }
            }
        }
    }
    let std = var
        .iter()
        .map(|v| libm::sqrt(v / n.max(1) as f64))
        .collect();
    let pooled_std = libm::sqrt(var.iter().sum::<f64>() / (n.max(1) * c) as f64).max(1e-6);
    let weight = (0..c)
        .map(|ch| {
            let w = if den[ch] > 0.0 {
                num[ch] / den[ch]
            } else {
                0.0
            };
            libm::round(w.clamp(0.0, 1.0) * WEIGHT_ONE as f64) as u8
        })
        .collect();
    ChannelStats {
        mean,
        std,
        pooled_std,
        weight,
    }
}

/// The relative step of each channel (the calibrated scale multiplies it): V one step per layer;
/// K inversely proportional to the RMS of the queries reading each channel when there are
/// queries, else proportional to the channel's deviation.
fn step_shape(
    stats: &ChannelStats,
    with_queries: &[(&Queries<'_>, usize)],
    layer: usize,
    kv: usize,
    head_dim: usize,
    rope: RopeStyle,
) -> Vec<f64> {
    let (c, pooled_std) = (stats.mean.len(), stats.pooled_std);
    if kv == 1 {
        vec![pooled_std; c]
    } else if !with_queries.is_empty() {
        let qms = query_mean_square(with_queries, layer, c, head_dim, rope);
        let mean_qms = qms.iter().sum::<f64>() / c as f64;
        qms.iter()
            .map(|m| pooled_std * libm::sqrt(mean_qms / m.max(mean_qms * 1e-4)))
            .collect()
    } else {
        stats.std.iter().map(|s| s.max(pooled_std * 1e-3)).collect()
    }
}

/// Per channel, the smallest anchor step that keeps every sample value representable at every
/// level.
///
/// The profile stores the mean as bf16, so even a channel that never varies (one sample token, a
/// constant channel) has a residual of up to 2^-9 of its magnitude. Steps calibrated on zero
/// variance would shrink until that residual needs more than `MAX_SYMBOL` steps and the encoder
/// clamps it, breaking the half-a-step bound on the profile's own samples. The floor: the largest
/// sample residual against the stored mean fits in 2^22 steps at the finest level (2^24 is the
/// clamp; the margin covers bf16 rounding of the steps); deltas get twice it, since their
/// predictor can sit on the other side of the mean. Real caches sit far above it.
fn step_floors(
    tensors: &[(Vec<f32>, usize)],
    mean: &[f64],
    c: usize,
    params: &LearnParams,
) -> Vec<f64> {
    let min_mult = params
        .level_mult
        .iter()
        .fold(f64::INFINITY, |m, x| m.min(*x as f64));
    let stored: Vec<f64> = mean
        .iter()
        .map(|m| {
            let bmax = half::bf16::MAX.to_f32() as f64;
            half::bf16::from_f32(m.clamp(-bmax, bmax) as f32).to_f32() as f64
        })
        .collect();
    let mut r = vec![0f64; c];
    for (x, _) in tensors {
        for row in x.chunks_exact(c) {
            for ch in 0..c {
                let d = libm::fabs(row[ch] as f64 - stored[ch]);
                if d > r[ch] {
                    r[ch] = d;
                }
            }
        }
    }
    r.iter()
        .map(|r| r / (min_mult * (1u64 << 22) as f64))
        .collect()
}

/// The channel parameters of one `(layer, K/V)` at step scale `scale`.
///
/// A version-3 profile holds means and steps as bf16 (FORMAT.md §4.2; `from_parts` rounds them).
/// They are kept inside bf16's finite range so that they round to finite values and steps stay
/// positive (P12): caches with values near f32::MAX would otherwise round them to infinity, and a
/// tiny anchor ratio to 0.
fn channel_params(
    stats: &ChannelStats,
    shape: &[f64],
    floor: &[f64],
    scale: f64,
    anchor_ratio: f32,
) -> Vec<ChannelParams> {
    let max = half::bf16::MAX.to_f32() as f64;
    let min_pos = half::bf16::from_bits(1).to_f32() as f64;
    (0..shape.len())
        .map(|ch| {
            // (`max` before `min`: a NaN product becomes the floor.)
            let step = (shape[ch] * scale).max(1e-30).max(2.0 * floor[ch]).min(max);
            let anchor = (step * anchor_ratio as f64)
                .max(min_pos)
                .max(floor[ch])
                .min(max);
            ChannelParams {
                mean: stats.mean[ch].clamp(-max, max) as f32,
                delta_step: step as f32,
                anchor_step: anchor as f32,
                weight: stats.weight[ch],
            }
        })
        .collect()
}

/// Channel parameters of one `(layer, K/V)`: statistics, the relative step of each channel, and
/// one scale calibrated so that the `(layer, K/V)` alone gives the target error on the samples.
#[allow(clippy::too_many_arguments)]
fn learn_tensor(
    samples: &[Sample<'_>],
    tensors: &[(Vec<f32>, usize)],
    exps: &[&[u8]],
    layer: usize,
    kv: usize,
    c: usize,
    group: usize,
    params: &LearnParams,
    head_dim: usize,
    rope: RopeStyle,
) -> Vec<ChannelParams> {
    let stats = channel_stats(tensors, c, group);
    let with_queries: Vec<(&Queries<'_>, usize)> = samples
        .iter()
        .enumerate()
        .filter_map(|(i, s)| s.queries.as_ref().map(|q| (q, i)))
        .collect();
    let shape = step_shape(&stats, &with_queries, layer, kv, head_dim, rope);
    let floor = step_floors(tensors, &stats.mean, c, params);
    let make = |scale: f64| channel_params(&stats, &shape, &floor, scale, params.anchor_ratio);
    let mut scale = 0.5;
    for _ in 0..params.calibration_rounds {
        let p = make(scale);
        let (err, target) = if with_queries.is_empty() {
            let err = recon_error(tensors, &p, c, group, params);
            (err, params.target_error as f64 * 0.5)
        } else {
            let err = attention_error(
                samples,
                &with_queries,
                tensors,
                exps,
                &p,
                layer,
                kv,
                c,
                group,
                params,
            );
            (err, params.target_error as f64 / core::f64::consts::SQRT_2)
        };
        if err.is_nan() || err <= 0.0 {
            break;
        }
        scale *= (target / err).clamp(0.125, 8.0);
    }
    make(scale)
}

/// Mean square of the queries reading each channel, averaged over each rotary pair.
fn query_mean_square(
    qs: &[(&Queries<'_>, usize)],
    layer: usize,
    c: usize,
    d: usize,
    rope: RopeStyle,
) -> Vec<f64> {
    let heads = c / d;
    let mut acc = vec![0f64; c];
    let mut cnt = vec![0f64; c];
    for (q, _) in qs {
        let group = q.q_heads / heads;
        for row in q.q[layer].chunks_exact(q.q_heads * d) {
            for qh in 0..q.q_heads {
                let h = qh / group;
                for j in 0..d {
                    let v = row[qh * d + j] as f64;
                    acc[h * d + j] += v * v;
                    cnt[h * d + j] += 1.0;
                }
            }
        }
    }
    let mut ms: Vec<f64> = acc.iter().zip(&cnt).map(|(a, n)| a / n.max(1.0)).collect();
    for h in 0..heads {
        let m = &mut ms[h * d..(h + 1) * d];
        match rope {
            RopeStyle::NeoX if d.is_multiple_of(2) => {
                for j in 0..d / 2 {
                    let avg = (m[j] + m[j + d / 2]) * 0.5;
                    m[j] = avg;
                    m[j + d / 2] = avg;
                }
            }
            RopeStyle::GptJ if d.is_multiple_of(2) => {
                for j in 0..d / 2 {
                    let avg = (m[2 * j] + m[2 * j + 1]) * 0.5;
                    m[2 * j] = avg;
                    m[2 * j + 1] = avg;
                }
            }
            _ => {}
        }
    }
    ms
}

/// Quantizes a whole sample tensor chunk by chunk as the encoder would; returns the reconstruction.
///
/// `exps` holds the step exponents of every chunk's non-sink rows in order (empty: all zero);
/// `on_symbols(chunk_start, sink, symbols, exps)` sees each chunk's symbols and exponents.
#[allow(clippy::too_many_arguments)]
fn simulate(
    x: &[f32],
    p: &[ChannelParams],
    mult: f32,
    c: usize,
    group: usize,
    params: &LearnParams,
    first_pos: u64,
    exps: &[u8],
    head_dim: usize,
    mut on_symbols: impl FnMut(usize, usize, &[i32], &[u8]),
) -> Vec<f32> {
    let consts = BlockConsts::new(p, mult);
    let rows = x.len() / c;
    let heads = c / head_dim;
    let mut rec = vec![0.0; x.len()];
    let mut symbols = Vec::new();
    let ct = params.chunk_tokens as usize;
    let mut start = 0;
    let mut e0 = 0;
    while start < rows {
        let end = (start + ct).min(rows);
        let sink = (params.n_sink as u64)
            .saturating_sub(first_pos.saturating_add(start as u64))
            .min((end - start) as u64) as usize;
        let ne = if exps.is_empty() {
            0
        } else {
            (end - start - sink) * heads
        };
        let ce = &exps[e0..e0 + ne];
        e0 += ne;
        symbols.clear();
        quantize_block(
            &x[start * c..end * c],
            &consts,
            group,
            sink,
            Exps { exps: ce, head_dim },
            &mut symbols,
            &mut rec[start * c..end * c],
        );
        on_symbols(start, sink, &symbols, ce);
        start = end;
    }
    rec
}

fn recon_error(
    tensors: &[(Vec<f32>, usize)],
    p: &[ChannelParams],
    c: usize,
    group: usize,
    params: &LearnParams,
) -> f64 {
    let (mut e, mut s) = (0f64, 0f64);
    for (x, _) in tensors {
        let rec = simulate(
            x,
            p,
            1.0,
            c,
            group,
            params,
            u64::MAX / 2,
            &[],
            1,
            |_, _, _, _| {},
        );
        for (a, b) in x.iter().zip(&rec) {
            let d = (a - b) as f64;
            e += d * d;
            s += *a as f64 * *a as f64;
        }
    }
    libm::sqrt(e / s.max(1e-30))
}

#[allow(clippy::too_many_arguments)]
fn attention_error(
    samples: &[Sample<'_>],
    qs: &[(&Queries<'_>, usize)],
    tensors: &[(Vec<f32>, usize)],
    exps: &[&[u8]],
    p: &[ChannelParams],
    layer: usize,
    kv: usize,
    c: usize,
    group: usize,
    params: &LearnParams,
) -> f64 {
    let mut errs = 0f64;
    for (q, si) in qs {
        let s = &samples[*si];
        let d = s.kv.shape.head_dim as usize;
        let (x, _) = &tensors[*si];
        let rec = simulate(
            x,
            p,
            1.0,
            c,
            group,
            params,
            s.kv.meta.first_position,
            exps[*si],
            d,
            |_, _, _, _| {},
        );
        let other = to_f32(if kv == 0 {
            s.kv.v[layer]
        } else {
            s.kv.k[layer]
        });
        let (k, v, kq, vq) = if kv == 0 {
            (x, &other, &rec, &other)
        } else {
            (&other, x, &other, &rec)
        };
        let exact = attention(q, layer, k, v, c, d, params.max_queries);
        let approx = attention(q, layer, kq, vq, c, d, params.max_queries);
        let (mut e, mut n) = (0f64, 0f64);
        for (a, b) in exact.iter().zip(&approx) {
            e += (a - b) * (a - b);
            n += a * a;
        }
        errs += libm::sqrt(e / n.max(1e-30));
    }
    errs / qs.len() as f64
}

/// Causal attention output of (a subset of) the sample's queries, in f64: every `stride`-th
/// query, each seeing the tokens up to its position (clamped to the sample). The arithmetic is
/// the attention oracle's ([`crate::attention`]), which the profile's bytes depend on.
pub(crate) fn attention(
    q: &Queries<'_>,
    layer: usize,
    k: &[f32],
    v: &[f32],
    c: usize,
    d: usize,
    max_queries: usize,
) -> Vec<f64> {
    let heads = c / d;
    let tokens = k.len() / c;
    let per = q.q_heads * d;
    let n_q = q.q[layer].len() / per;
    let stride = n_q.div_ceil(max_queries.max(1)).max(1);
    let queries: Vec<crate::attention::Query> = (0..n_q)
        .step_by(stride)
        .map(|i| {
            let last = (q.q_start.saturating_add(i as u64) as usize).min(tokens.saturating_sub(1));
            crate::attention::Query {
                row: i,
                len: (last + 1).min(tokens),
            }
        })
        .collect();
    let heads = crate::attention::Heads {
        q_heads: q.q_heads,
        kv_heads: heads,
        head_dim: d,
    };
    crate::attention::outputs(q.q[layer], heads, &queries, k, v)
}

/// Lowest and highest spread bucket (quarter octaves of the residual RMS in steps).
const B_PER_OCTAVE: i32 = 4;
const B_MIN: i32 = -4 * B_PER_OCTAVE;
const B_MAX: i32 = 10 * B_PER_OCTAVE;

/// What pass 1 of [`learn_tables`] gathers: every sample coded as the encoder would, giving the
/// mean square of the residual in base-step units per `(layer, kv, kind, channel)` (sum and
/// count) and every value symbol with its map slot and exponent.
struct LevelStats {
    ss: Vec<f64>,
    cnt: Vec<f64>,
    /// Symbols with their map slot and exponent, kept for pass 2.
    coded: Vec<(u32, u8, i32)>,
}

/// Pass 1 of [`learn_tables`] at one level multiplier.
#[allow(clippy::too_many_arguments)]
fn level_stats(
    samples: &[Sample<'_>],
    exps: &[Vec<Vec<u8>>],
    all: &[ChannelParams],
    mult: f32,
    layers: usize,
    c: usize,
    d: usize,
    params: &LearnParams,
) -> LevelStats {
    let group = params.group as usize;
    let heads = c / d;
    let n_map = layers * 4 * c;
    let mut stats = LevelStats {
        ss: vec![0f64; n_map],
        cnt: vec![0f64; n_map],
        coded: Vec::new(),
    };
    for (si, s) in samples.iter().enumerate() {
        for layer in 0..layers {
            for kv in 0..2 {
                let x = to_f32(if kv == 0 {
                    s.kv.k[layer]
                } else {
                    s.kv.v[layer]
                });
                let p = &all[(layer * 2 + kv) * c..(layer * 2 + kv + 1) * c];
                let consts = BlockConsts::new(p, mult);
                let mut chunks = Vec::new();
                let rec = simulate(
                    &x,
                    p,
                    mult,
                    c,
                    group,
                    params,
                    s.kv.meta.first_position,
                    &exps[si][layer],
                    d,
                    |start, sink, syms, ce| {
                        for (i, &v) in syms.iter().enumerate() {
                            let row = sink + i / c;
                            let ch = i % c;
                            let kind = usize::from(!row.is_multiple_of(group));
                            let e = if ce.is_empty() {
                                0
                            } else {
                                ce[(i / c) * heads + ch / d]
                            };
                            let slot = ((layer * 2 + kv) * 2 + kind) * c + ch;
                            stats.coded.push((slot as u32, e, v));
                        }
                        chunks.push((start, sink, syms.len() / c));
                    },
                );
                let block = (layer * 2 + kv) * 2;
                stats.add_residuals(&x, &rec, &consts, &chunks, block, c, group);
            }
        }
    }
    stats
}

impl LevelStats {
    /// Adds the squared residuals in step units of the rows of `chunks` (`(start, sink,
    /// rows)`, as `simulate` coded them) of one tensor `x`, reconstructed as `rec`, to its
    /// (kind, channel) slots from `block * c` on.
    #[allow(clippy::too_many_arguments)]
    fn add_residuals(
        &mut self,
        x: &[f32],
        rec: &[f32],
        consts: &BlockConsts,
        chunks: &[(usize, usize, usize)],
        block: usize,
        c: usize,
        group: usize,
    ) {
        for &(start, sink, n) in chunks {
            for r in sink..sink + n {
                let row = start + r;
                let kind = usize::from(r % group != 0);
                let arow = start + r - r % group;
                for ch in 0..c {
                    let xv = x[row * c + ch];
                    let (res, step) = if kind == 0 {
                        (xv - consts.mean[ch], consts.anchor_step[ch])
                    } else {
                        let pred = predict(consts.mean[ch], consts.weight[ch], rec[arow * c + ch]);
                        (xv - pred, consts.delta_step[ch])
                    };
                    let z = (res / step) as f64;
                    let slot = (block + kind) * c + ch;
                    self.ss[slot] += z * z;
                    self.cnt[slot] += 1.0;
                }
            }
        }
    }
}

/// Learns the frequency tables of one level.
///
/// Tables are indexed by *spread*: the RMS of a channel's residual in units of its step, in
/// quarter octaves (`round(4 log2 rms)`). A channel coded at step exponent `e` has a spread `2e`
/// quarter octaves lower, so the table of bucket `b` links down to bucket `b - 2`. Each table's
/// frequencies pool the symbols that are actually coded with it. `stats` is the level's
/// [`level_stats`].
fn learn_tables(stats: LevelStats) -> LevelTables {
    const HR: usize = MAX_RADIUS as usize;
    let LevelStats { ss, cnt, coded } = stats;
    let bucket0: Vec<i32> = ss
        .iter()
        .zip(&cnt)
        .map(|(s, n)| {
            let rms = libm::sqrt(s / n.max(1.0)).max(1e-9);
            (libm::round(B_PER_OCTAVE as f64 * libm::log2(rms)) as i32).clamp(B_MIN, B_MAX)
        })
        .collect();
    let bucket_of = |slot: usize, e: u8| (bucket0[slot] - (B_PER_OCTAVE / 2) * e as i32).max(B_MIN);
    let mut lo = *bucket0.iter().min().unwrap_or(&0);
    let hi = *bucket0.iter().max().unwrap_or(&0);
    for &(slot, e, _) in &coded {
        lo = lo.min(bucket_of(slot as usize, e));
    }
    let n_tables = (hi - lo + 1) as usize;
    // Pass 2: histograms per bucket over -127..=127 plus escapes.
    let mut hist = vec![[0u64; 2 * HR + 2]; n_tables];
    for &(slot, e, v) in &coded {
        let b = (bucket_of(slot as usize, e) - lo) as usize;
        let idx = if v.unsigned_abs() as usize <= HR {
            (v + HR as i32) as usize
        } else {
            2 * HR + 1
        };
        hist[b][idx] += 1;
    }
    // Empty buckets borrow the nearest non-empty bucket (below first).
    let filled: Vec<bool> = hist.iter().map(|h| h.iter().any(|&x| x > 0)).collect();
    let mut tables = Vec::with_capacity(n_tables);
    for b in 0..n_tables {
        let src = if filled[b] {
            b
        } else {
            (0..n_tables)
                .filter(|&o| filled[o])
                .min_by_key(|&o| (o.abs_diff(b), o > b))
                .unwrap_or(b)
        };
        tables.push(symbol_table(&hist[src]));
    }
    let down = (0..n_tables)
        .map(|t| t.saturating_sub(B_PER_OCTAVE as usize / 2) as u8)
        .collect();
    let map = bucket0.iter().map(|&b| (b - lo) as u8).collect();
    LevelTables { tables, down, map }
}

/// A table for a histogram over `-127..=127` plus escapes: radius 1.5 times the largest value
/// seen (at most 127), values beyond it escaped.
fn symbol_table(pooled: &[u64; 2 * MAX_RADIUS as usize + 2]) -> SymbolTable {
    const HR: usize = MAX_RADIUS as usize;
    let max_seen = (0..=HR)
        .rev()
        .find(|&r| pooled[HR + r] > 0 || pooled[HR - r] > 0)
        .unwrap_or(0);
    let radius = (max_seen + max_seen / 2 + 1).min(HR);
    let mut counts = vec![0u64; 2 * radius + 2];
    #[allow(clippy::needless_range_loop)]
    for v in 0..2 * HR + 1 {
        let val = v as i64 - HR as i64;
        if val.unsigned_abs() as usize <= radius {
            counts[(val + radius as i64) as usize] += pooled[v];
        } else {
            counts[2 * radius + 1] += pooled[v];
        }
    }
    counts[2 * radius + 1] += pooled[2 * HR + 1];
    SymbolTable {
        radius: radius as u8,
        freqs: FreqTable::from_counts(&counts),
    }
}
