//! Each `(layer, K/V)`'s channel parameters: steps where the attention output is sensitive,
//! anchor weights, and the calibration of each tensor to an equal attention-output error.

use crate::consts::WEIGHT_ONE;
use crate::kv::RopeStyle;
use crate::quant::{quantize_block, BlockConsts, ChannelParams, Exps};
use alloc::vec;
use alloc::vec::Vec;

use super::{LearnParams, Queries, Sample, to_f32};

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
pub(super) fn learn_tensor(
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
pub(super) fn simulate(
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
fn attention(
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
