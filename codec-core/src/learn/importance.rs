//! The token-importance hints a profile stores (`spec/FORMAT.md` §9.2), and the step exponents
//! the encoder will choose with them, which calibration and tables see.

use crate::importance::{
    block_exponents, block_scores, reference_queries,
};
use crate::rope::rotate;
use crate::profile::Importance;
use alloc::vec;
use alloc::vec::Vec;

use super::{LearnParams, Sample, finite_f32, to_f32};

/// Step exponents of every sample and layer, as the encoder would choose them (none without
/// importance).
pub(super) fn step_exponents(
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

/// Mean pre-rotary query per `(layer, kv_head, channel)` over the samples' queries.
pub(super) fn query_means(samples: &[Sample<'_>], layers: usize, c: usize, d: usize) -> Vec<f32> {
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
pub(super) fn score_thresholds(
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
