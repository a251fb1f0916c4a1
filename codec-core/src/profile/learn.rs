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
//! Frequency tables are then learned per level from the symbols the samples produce, and channels
//! whose symbol entropy falls in the same quarter-bit bucket share one table.

use super::{ChannelParams, LevelTables, Profile, SymbolTable, MAX_RADIUS, WEIGHT_ONE};
use crate::error::EncodeError;
use crate::kv::{KvView, RopeStyle, TensorRef};
use crate::limits::{MAX_GROUP, MAX_LEVELS, MAX_TABLES_PER_LEVEL};
use crate::quant::{quantize_block, BlockConsts};
use crate::rans::FreqTable;
use alloc::collections::BTreeMap;
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
        }
    }
}

/// Default level multipliers: level 0 near-lossless, the last about one bit per element.
pub const DEFAULT_LEVELS: [f32; 5] = [0.12, 0.5, 0.85, 2.0, 4.5];

/// Learns a profile from samples. Deterministic: the same samples and parameters give the same
/// bytes on every platform.
pub fn learn_profile(samples: &[Sample<'_>], params: &LearnParams) -> Result<Profile, EncodeError> {
    let first = samples.first().ok_or(EncodeError::NoSamples)?;
    let shape = first.kv.shape;
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
    if params.group == 0 || params.group > MAX_GROUP {
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
    for s in samples {
        let sh = s.kv.shape;
        if (sh.layers, sh.kv_heads, sh.head_dim) != (shape.layers, shape.kv_heads, shape.head_dim) {
            return Err(EncodeError::ProfileShape);
        }
        crate::codec::check_view(&s.kv)?;
        if let Some(q) = &s.queries {
            let d = shape.head_dim as usize;
            if q.q.len() != shape.layers as usize
                || q.q_heads == 0
                || q.q_heads % shape.kv_heads as usize != 0
                || q.q
                    .iter()
                    .any(|l| l.len() % (q.q_heads * d) != 0 || l.len() != q.q[0].len())
            {
                return Err(EncodeError::ShapeMismatch { what: "queries" });
            }
        }
    }
    let layers = shape.layers as usize;
    let c = shape.channels();
    let group = params.group as usize;
    let mut all_params = Vec::with_capacity(layers * 2 * c);
    for layer in 0..layers {
        for kv in 0..2 {
            let tensors: Vec<(Vec<f32>, usize)> = samples
                .iter()
                .map(|s| {
                    let t = if kv == 0 {
                        s.kv.k[layer]
                    } else {
                        s.kv.v[layer]
                    };
                    (to_f32(t), s.kv.shape.tokens as usize)
                })
                .collect();
            all_params.extend(learn_tensor(
                samples,
                &tensors,
                layer,
                kv,
                c,
                group,
                params,
                shape.head_dim as usize,
                first.kv.meta.rope.style,
            ));
        }
    }
    let mut levels = Vec::with_capacity(params.level_mult.len());
    for &mult in &params.level_mult {
        levels.push(learn_tables(samples, &all_params, mult, layers, c, params));
    }
    Ok(Profile::from_parts(
        shape.layers,
        shape.kv_heads,
        shape.head_dim,
        params.level_mult.clone(),
        all_params,
        levels,
    ))
}

fn to_f32(t: TensorRef<'_>) -> Vec<f32> {
    let mut v = vec![0.0; t.len()];
    t.read_f32(0, &mut v);
    v
}

/// Channel parameters of one `(layer, K/V)`.
#[allow(clippy::too_many_arguments)]
fn learn_tensor(
    samples: &[Sample<'_>],
    tensors: &[(Vec<f32>, usize)],
    layer: usize,
    kv: usize,
    c: usize,
    group: usize,
    params: &LearnParams,
    head_dim: usize,
    rope: RopeStyle,
) -> Vec<ChannelParams> {
    // Means and variances (f64 accumulation in a fixed order).
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
    let std: Vec<f64> = var
        .iter()
        .map(|v| libm::sqrt(v / n.max(1) as f64))
        .collect();
    let pooled_std = libm::sqrt(var.iter().sum::<f64>() / (n.max(1) * c) as f64).max(1e-6);
    let weight: Vec<u8> = (0..c)
        .map(|ch| {
            let w = if den[ch] > 0.0 {
                num[ch] / den[ch]
            } else {
                0.0
            };
            libm::round(w.clamp(0.0, 1.0) * WEIGHT_ONE as f64) as u8
        })
        .collect();

    // Shape of the steps across channels.
    let with_queries: Vec<(&Queries<'_>, usize)> = samples
        .iter()
        .enumerate()
        .filter_map(|(i, s)| s.queries.as_ref().map(|q| (q, i)))
        .collect();
    let shape: Vec<f64> = if kv == 1 {
        vec![pooled_std; c]
    } else if !with_queries.is_empty() {
        let qms = query_mean_square(&with_queries, layer, c, head_dim, rope);
        let mean_qms = qms.iter().sum::<f64>() / c as f64;
        qms.iter()
            .map(|m| pooled_std * libm::sqrt(mean_qms / m.max(mean_qms * 1e-4)))
            .collect()
    } else {
        std.iter().map(|s| s.max(pooled_std * 1e-3)).collect()
    };

    // Calibrate one scale for the whole (layer, K/V).
    let make = |scale: f64| -> Vec<ChannelParams> {
        (0..c)
            .map(|ch| {
                let step = (shape[ch] * scale).max(1e-30);
                ChannelParams {
                    mean: mean[ch] as f32,
                    delta_step: step as f32,
                    anchor_step: (step * params.anchor_ratio as f64) as f32,
                    weight: weight[ch],
                }
            })
            .collect()
    };
    let mut scale = 0.5;
    for _ in 0..params.calibration_rounds {
        let p = make(scale);
        let err = if with_queries.is_empty() {
            recon_error(tensors, &p, c, group, params)
        } else {
            attention_error(
                samples,
                &with_queries,
                tensors,
                &p,
                layer,
                kv,
                c,
                group,
                params,
            )
        };
        let target = if with_queries.is_empty() {
            params.target_error as f64 * 0.5
        } else {
            params.target_error as f64 / core::f64::consts::SQRT_2
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
            RopeStyle::NeoX if d % 2 == 0 => {
                for j in 0..d / 2 {
                    let avg = (m[j] + m[j + d / 2]) * 0.5;
                    m[j] = avg;
                    m[j + d / 2] = avg;
                }
            }
            RopeStyle::GptJ if d % 2 == 0 => {
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
#[allow(clippy::too_many_arguments)]
fn simulate(
    x: &[f32],
    p: &[ChannelParams],
    mult: f32,
    c: usize,
    group: usize,
    params: &LearnParams,
    first_pos: u64,
    mut on_symbols: impl FnMut(usize, &[i32]),
) -> Vec<f32> {
    let consts = BlockConsts::new(p, mult);
    let rows = x.len() / c;
    let mut rec = vec![0.0; x.len()];
    let mut symbols = Vec::new();
    let ct = params.chunk_tokens as usize;
    let mut start = 0;
    while start < rows {
        let end = (start + ct).min(rows);
        let sink = (params.n_sink as u64)
            .saturating_sub(first_pos + start as u64)
            .min((end - start) as u64) as usize;
        symbols.clear();
        quantize_block(
            &x[start * c..end * c],
            &consts,
            group,
            sink,
            &mut symbols,
            &mut rec[start * c..end * c],
        );
        on_symbols(sink, &symbols);
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
        let rec = simulate(x, p, 1.0, c, group, params, u64::MAX / 2, |_, _| {});
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
            |_, _| {},
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

/// Causal attention output of (a subset of) the sample's queries, in f64.
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
    let scale = 1.0 / libm::sqrt(d as f64);
    let gsize = q.q_heads / heads;
    let mut out = Vec::new();
    let mut scores = vec![0f64; tokens];
    let mut o = vec![0f64; d];
    for i in (0..n_q).step_by(stride) {
        let last = ((q.q_start + i as u64) as usize).min(tokens.saturating_sub(1));
        for qh in 0..q.q_heads {
            let h = qh / gsize;
            let qv = &q.q[layer][i * per + qh * d..i * per + (qh + 1) * d];
            let mut mx = f64::NEG_INFINITY;
            for (t, sc) in scores.iter_mut().enumerate().take(last + 1) {
                let kr = &k[t * c + h * d..t * c + (h + 1) * d];
                let mut acc = 0f32;
                for j in 0..d {
                    acc += qv[j] * kr[j];
                }
                *sc = acc as f64 * scale;
                mx = mx.max(*sc);
            }
            o.iter_mut().for_each(|x| *x = 0.0);
            let mut z = 0f64;
            for (t, sc) in scores.iter().enumerate().take(last + 1) {
                let w = libm::exp(sc - mx);
                z += w;
                let vr = &v[t * c + h * d..t * c + (h + 1) * d];
                for j in 0..d {
                    o[j] += w * vr[j] as f64;
                }
            }
            out.extend(o.iter().map(|x| x / z));
        }
    }
    out
}

/// Learns the frequency tables of one level.
fn learn_tables(
    samples: &[Sample<'_>],
    all: &[ChannelParams],
    mult: f32,
    layers: usize,
    c: usize,
    params: &LearnParams,
) -> LevelTables {
    const HR: usize = MAX_RADIUS as usize;
    // Histogram per (layer, kv, kind, channel) over -127..=127 plus escapes.
    let n_hist = layers * 4 * c;
    let mut hist = vec![[0u32; 2 * HR + 2]; n_hist];
    let group = params.group as usize;
    for s in samples {
        for layer in 0..layers {
            for kv in 0..2 {
                let x = to_f32(if kv == 0 {
                    s.kv.k[layer]
                } else {
                    s.kv.v[layer]
                });
                let p = &all[(layer * 2 + kv) * c..(layer * 2 + kv + 1) * c];
                let rows = x.len() / c;
                let ct = params.chunk_tokens as usize;
                let mut chunk_start = 0usize;
                simulate(
                    &x,
                    p,
                    mult,
                    c,
                    group,
                    params,
                    s.kv.meta.first_position,
                    |sink, syms| {
                        let chunk_rows = (rows - chunk_start).min(ct);
                        for (i, &v) in syms.iter().enumerate() {
                            let row = sink + i / c;
                            let ch = i % c;
                            let kind = if row % group == 0 { 0 } else { 1 };
                            let h = &mut hist[((layer * 2 + kv) * 2 + kind) * c + ch];
                            let idx = if v.unsigned_abs() as usize <= HR {
                                (v + HR as i32) as usize
                            } else {
                                2 * HR + 1
                            };
                            h[idx] += 1;
                        }
                        chunk_start += chunk_rows;
                    },
                );
            }
        }
    }
    // Bucket histograms by entropy (quarter bits), pool each bucket into one table.
    let mut buckets: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
    for (i, h) in hist.iter().enumerate() {
        let total: u64 = h.iter().map(|&x| x as u64).sum();
        let mut ent = 0f64;
        if total > 0 {
            for &x in h.iter() {
                if x > 0 {
                    let p = x as f64 / total as f64;
                    ent -= p * libm::log2(p);
                }
            }
        }
        buckets
            .entry(libm::floor(ent * 4.0) as u32)
            .or_default()
            .push(i);
    }
    // Merge the smallest-entropy neighbours if there are too many buckets.
    let mut groups: Vec<Vec<usize>> = buckets.into_values().collect();
    while groups.len() > MAX_TABLES_PER_LEVEL {
        let a = groups.remove(0);
        groups[0].extend(a);
    }
    let mut map = vec![0u8; n_hist];
    let mut tables = Vec::with_capacity(groups.len());
    for (tid, members) in groups.iter().enumerate() {
        let mut pooled = [0u64; 2 * HR + 2];
        for &m in members {
            map[m] = tid as u8;
            for (p, &x) in pooled.iter_mut().zip(hist[m].iter()) {
                *p += x as u64;
            }
        }
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
        tables.push(SymbolTable {
            radius: radius as u8,
            freqs: FreqTable::from_counts(&counts),
        });
    }
    LevelTables { tables, map }
}
