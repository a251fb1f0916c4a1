//! Error metrics (relative error, attention-output error) and the minmax quantization baselines.
//!
//! Arithmetic is f32 (as an inference server computes attention); sums of squares, softmax
//! denominators and means are accumulated in f64.
#![allow(dead_code)]

use half::f16;

use crate::dump::Dump;

/// Relative L2 error `||orig - recon|| / ||orig||`.
///
/// Returns 0 when both are all-zero and infinity when only `orig` is. Panics if the lengths
/// differ.
pub fn rel_error(orig: &[f32], recon: &[f32]) -> f64 {
    assert_eq!(orig.len(), recon.len(), "rel_error: length mismatch");
    let mut num = 0.0f64;
    let mut den = 0.0f64;
    for (&a, &b) in orig.iter().zip(recon) {
        let d = (a - b) as f64;
        num += d * d;
        den += (a as f64) * (a as f64);
    }
    if den == 0.0 {
        if num == 0.0 {
            0.0
        } else {
            f64::INFINITY
        }
    } else {
        (num / den).sqrt()
    }
}

/// Query rows processed together (they share every K and V load).
const ROWS: usize = 4;
/// Lanes of a tile (tokens in the score pass, dimensions in the value pass).
const LANES: usize = 8;

/// Causal attention output of a layer's queries.
///
/// `q` is `[n_q, q_heads, head_dim]`; `k` and `v` are `[tokens, kv_heads, head_dim]`. Query `i`
/// sits at token position `p = q_start + i` and its head `h` reads KV head
/// `h / (q_heads / kv_heads)`; its output is `softmax(q . k[0..=p] / sqrt(head_dim)) . v[0..=p]`.
/// Returns `[n_q, q_heads, head_dim]`.
///
/// Panics if the slice lengths do not match the dimensions, if `q_heads` is not a multiple of
/// `kv_heads`, or if a query's position is not below `tokens`.
#[allow(clippy::too_many_arguments)]
pub fn attention_output(
    q: &[f32],
    n_q: usize,
    q_heads: usize,
    k: &[f32],
    v: &[f32],
    tokens: usize,
    kv_heads: usize,
    head_dim: usize,
    q_start: u64,
) -> Vec<f32> {
    let d = head_dim;
    assert!(kv_heads > 0 && d > 0, "attention_output: empty heads");
    assert_eq!(q.len(), n_q * q_heads * d, "attention_output: q length");
    assert_eq!(k.len(), tokens * kv_heads * d, "attention_output: k length");
    assert_eq!(v.len(), tokens * kv_heads * d, "attention_output: v length");
    assert!(
        q_heads % kv_heads == 0,
        "attention_output: q_heads {q_heads} is not a multiple of kv_heads {kv_heads}"
    );
    assert!(
        n_q == 0 || q_start + n_q as u64 <= tokens as u64,
        "attention_output: queries {q_start}..{} run past {tokens} tokens",
        q_start + n_q as u64
    );
    let mut out = vec![0.0f32; n_q * q_heads * d];
    if n_q == 0 || q_heads == 0 {
        return out;
    }
    let group = q_heads / kv_heads;
    let row = kv_heads * d;
    let scale = 1.0 / (d as f32).sqrt();
    // Keys any query can see.
    let t_max = q_start as usize + n_q;
    let t_pad = t_max.next_multiple_of(LANES);
    let d_pad = d.next_multiple_of(LANES);

    // Per KV head: K transposed to [d, t_pad] and V copied to [t_max, d_pad], both zero-padded.
    let mut kt = vec![0.0f32; d * t_pad];
    let mut vg = vec![0.0f32; t_max * d_pad];
    // A block of query rows: scaled queries, then scores / weights per row.
    let mut qb = vec![[0.0f32; ROWS]; d];
    let mut w = vec![[0.0f32; ROWS]; t_pad];
    // Rows (query, head) of the current KV head, ordered by query.
    let mut rows: Vec<(usize, usize)> = Vec::with_capacity(n_q * group);

    for g in 0..kv_heads {
        for t in 0..t_max {
            let src = &k[t * row + g * d..][..d];
            for (j, &x) in src.iter().enumerate() {
                kt[j * t_pad + t] = x;
            }
            vg[t * d_pad..t * d_pad + d].copy_from_slice(&v[t * row + g * d..][..d]);
        }
        rows.clear();
        for i in 0..n_q {
            for h in g * group..(g + 1) * group {
                rows.push((i, h));
            }
        }
        for block in rows.chunks(ROWS) {
            // Causal extents: keys 0..n[r]; the block computes up to the largest.
            let mut n = [0usize; ROWS];
            for (r, nr) in n.iter_mut().enumerate() {
                let (i, _) = block[r.min(block.len() - 1)];
                *nr = q_start as usize + i + 1;
            }
            let n_max = n.iter().copied().max().unwrap_or(0);
            let n_tiles = n_max.div_ceil(LANES);
            for (r, nr) in n.iter_mut().enumerate() {
                let (i, h) = block[r.min(block.len() - 1)];
                let qv = &q[(i * q_heads + h) * d..][..d];
                for (j, &x) in qv.iter().enumerate() {
                    qb[j][r] = x * scale;
                }
                if r >= block.len() {
                    *nr = n_max; // padding row: a copy of the last, never written out
                }
            }

            // Scores: ROWS x LANES tiles, accumulated over the head dimension.
            for tile in 0..n_tiles {
                let t0 = tile * LANES;
                let mut acc = [[0.0f32; LANES]; ROWS];
                for (j, qj) in qb.iter().enumerate() {
                    let kk: &[f32; LANES] = kt[j * t_pad + t0..][..LANES].try_into().unwrap();
                    for r in 0..ROWS {
                        for l in 0..LANES {
                            acc[r][l] += qj[r] * kk[l];
                        }
                    }
                }
                for l in 0..LANES {
                    for r in 0..ROWS {
                        w[t0 + l][r] = acc[r][l];
                    }
                }
            }

            // Softmax per row over its own causal extent; weights beyond it are zero.
            let mut inv = [0.0f32; ROWS];
            for r in 0..ROWS {
                let m = w[..n[r]]
                    .iter()
                    .fold(f32::NEG_INFINITY, |m, x| m.max(x[r]));
                let mut sum = 0.0f64;
                for x in w[..n[r]].iter_mut() {
                    let e = (x[r] - m).exp();
                    x[r] = e;
                    sum += e as f64;
                }
                for x in w[n[r]..n_max].iter_mut() {
                    x[r] = 0.0;
                }
                inv[r] = (1.0 / sum) as f32;
            }

            // Weighted sum of values: ROWS x LANES tiles of the output, accumulated over tokens.
            for d0 in (0..d_pad).step_by(LANES) {
                let mut acc = [[0.0f32; LANES]; ROWS];
                for (t, wt) in w[..n_max].iter().enumerate() {
                    let vv: &[f32; LANES] = vg[t * d_pad + d0..][..LANES].try_into().unwrap();
                    for r in 0..ROWS {
                        for l in 0..LANES {
                            acc[r][l] += wt[r] * vv[l];
                        }
                    }
                }
                let width = LANES.min(d - d0);
                for (r, &(i, h)) in block.iter().enumerate() {
                    let o = &mut out[(i * q_heads + h) * d + d0..][..width];
                    for (ol, al) in o.iter_mut().zip(&acc[r]) {
                        *ol = al * inv[r];
                    }
                }
            }
        }
    }
    out
}

/// Relative error of the attention output computed with reconstructed K/V against the original,
/// pooled over all queries and heads of the layer: `||out' - out|| / ||out||`.
/// Arguments as in [`attention_output`].
#[allow(clippy::too_many_arguments)]
pub fn attention_error(
    q: &[f32],
    n_q: usize,
    q_heads: usize,
    k_orig: &[f32],
    v_orig: &[f32],
    k_rec: &[f32],
    v_rec: &[f32],
    tokens: usize,
    kv_heads: usize,
    head_dim: usize,
    q_start: u64,
) -> f64 {
    let a = attention_output(
        q, n_q, q_heads, k_orig, v_orig, tokens, kv_heads, head_dim, q_start,
    );
    let b = attention_output(
        q, n_q, q_heads, k_rec, v_rec, tokens, kv_heads, head_dim, q_start,
    );
    rel_error(&a, &b)
}

/// Attention output of `dump`'s queries at `layer` over the given K/V (`[tokens, kv_heads,
/// head_dim]` f32, e.g. a reconstruction). `None` if the dump has no queries.
pub fn dump_attention_output(dump: &Dump, layer: usize, k: &[f32], v: &[f32]) -> Option<Vec<f32>> {
    let q = dump.q.as_ref()?.get(layer)?;
    let s = dump.kv.shape;
    Some(attention_output(
        q,
        dump.n_q(),
        dump.q_heads,
        k,
        v,
        s.tokens as usize,
        s.kv_heads as usize,
        s.head_dim as usize,
        dump.q_start,
    ))
}

/// Minmax quantization round trip: each run of `group` consecutive values (the last one may be
/// shorter) is stored as `bits`-bit codes with a minimum and a scale, both rounded to f16 as a
/// real format would store them: `q = clamp(round((x - min) / scale), 0, 2^bits - 1)`,
/// `x' = min + q * scale`. Costs `bits + 32 / group` bits per element.
///
/// Panics unless `group > 0` and `1 <= bits <= 16`.
pub fn minmax_quantize(x: &[f32], group: usize, bits: u32) -> Vec<f32> {
    assert!(group > 0, "minmax_quantize: group must be positive");
    assert!((1..=16).contains(&bits), "minmax_quantize: bits must be 1..=16");
    let levels = ((1u32 << bits) - 1) as f32;
    let mut out = Vec::with_capacity(x.len());
    for chunk in x.chunks(group) {
        let mut lo = f32::INFINITY;
        let mut hi = f32::NEG_INFINITY;
        for &v in chunk {
            lo = lo.min(v);
            hi = hi.max(v);
        }
        let mn = f16::from_f32(lo).to_f32();
        let scale = f16::from_f32((hi - mn) / levels).to_f32();
        if !(scale > 0.0 && scale.is_finite()) {
            out.extend(std::iter::repeat_n(mn, chunk.len()));
            continue;
        }
        for &v in chunk {
            let q = ((v - mn) / scale).round_ties_even().clamp(0.0, levels);
            out.push(mn + q * scale);
        }
    }
    out
}

/// One line of the baseline table.
#[derive(Clone, Debug, PartialEq)]
pub struct BaselineRow {
    /// Method name, e.g. `minmax int8`.
    pub name: String,
    /// Storage cost in bits per element.
    pub bits_per_element: f64,
    /// K relative error, mean over layers.
    pub k_rel: f64,
    /// V relative error, mean over layers.
    pub v_rel: f64,
    /// Attention-output relative error, mean over layers (NaN if the dump has no queries).
    pub attn: f64,
}

/// Per-token-head minmax baselines (one f16 min and scale per `head_dim` values) at each of
/// `bits`, over the whole dump: K, V and attention errors averaged over layers.
pub fn minmax_baselines(dump: &Dump, bits: &[u32]) -> Vec<BaselineRow> {
    let s = dump.kv.shape;
    let group = s.head_dim as usize;
    let layers = s.layers as usize;
    let mut sums = vec![(0.0f64, 0.0f64, 0.0f64); bits.len()];
    for l in 0..layers {
        let k = dump.kv.k[l].to_f32_vec();
        let v = dump.kv.v[l].to_f32_vec();
        let reference = dump_attention_output(dump, l, &k, &v);
        for (b, sum) in bits.iter().zip(sums.iter_mut()) {
            let kq = minmax_quantize(&k, group, *b);
            let vq = minmax_quantize(&v, group, *b);
            sum.0 += rel_error(&k, &kq);
            sum.1 += rel_error(&v, &vq);
            if let Some(r) = &reference {
                let out = dump_attention_output(dump, l, &kq, &vq).unwrap_or_default();
                sum.2 += rel_error(r, &out);
            }
        }
    }
    let n = layers.max(1) as f64;
    bits.iter()
        .zip(sums)
        .map(|(&b, (ks, vs, at))| BaselineRow {
            name: format!("minmax int{b}"),
            bits_per_element: b as f64 + 32.0 / group as f64,
            k_rel: ks / n,
            v_rel: vs / n,
            attn: if has_queries(dump) { at / n } else { f64::NAN },
        })
        .collect()
}

fn has_queries(dump: &Dump) -> bool {
    dump.q.is_some() && dump.n_q() > 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rel_error_basics() {
        assert_eq!(rel_error(&[3.0, 4.0], &[3.0, 4.0]), 0.0);
        assert!((rel_error(&[3.0, 4.0], &[0.0, 4.0]) - 0.6).abs() < 1e-12);
        assert_eq!(rel_error(&[0.0], &[0.0]), 0.0);
        assert!(rel_error(&[0.0], &[1.0]).is_infinite());
    }

    /// Straightforward f64 attention for cross-checking odd shapes.
    #[allow(clippy::too_many_arguments)]
    fn naive(
        q: &[f32],
        n_q: usize,
        hq: usize,
        k: &[f32],
        v: &[f32],
        hk: usize,
        d: usize,
        q_start: usize,
    ) -> Vec<f32> {
        let mut out = vec![0.0f32; n_q * hq * d];
        for i in 0..n_q {
            for h in 0..hq {
                let g = h / (hq / hk);
                let qv = &q[(i * hq + h) * d..][..d];
                let s: Vec<f64> = (0..=q_start + i)
                    .map(|t| {
                        let kv = &k[(t * hk + g) * d..][..d];
                        let dot: f64 = qv.iter().zip(kv).map(|(a, b)| (a * b) as f64).sum();
                        dot / (d as f64).sqrt()
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
                for (t, x) in s.iter().enumerate() {
                    let wt = (x - m).exp() / z;
                    for j in 0..d {
                        out[(i * hq + h) * d + j] += (wt * v[(t * hk + g) * d + j] as f64) as f32;
                    }
                }
            }
        }
        out
    }

    #[test]
    fn odd_shapes_match_naive() {
        // head_dim not a multiple of 8, group sizes 1..3, blocks not multiples of 4, few tokens.
        for &(n_q, hq, hk, d, tokens, q_start) in &[
            (1usize, 1usize, 1usize, 1usize, 1usize, 0usize),
            (3, 3, 3, 5, 4, 1),
            (5, 6, 2, 13, 9, 4),
            (2, 4, 1, 8, 20, 18),
            (7, 9, 3, 64, 33, 26),
        ] {
            let f = |n: usize, a: f32| -> Vec<f32> {
                (0..n).map(|i| ((i as f32 * a).sin() * 3.0)).collect()
            };
            let q = f(n_q * hq * d, 0.71);
            let k = f(tokens * hk * d, 0.37);
            let v = f(tokens * hk * d, 0.13);
            let fast = attention_output(&q, n_q, hq, &k, &v, tokens, hk, d, q_start as u64);
            let slow = naive(&q, n_q, hq, &k, &v, hk, d, q_start);
            let e = rel_error(&slow, &fast);
            assert!(e < 1e-5, "{n_q} {hq} {hk} {d} {tokens} {q_start}: {e}");
        }
    }

    #[test]
    fn minmax_exact_on_grid_and_bounded() {
        // Values on the quantization grid come back exactly.
        let x: Vec<f32> = (0..16).map(|i| i as f32 * 0.5).collect();
        assert_eq!(minmax_quantize(&x, 16, 4), x);
        // Error at most half a step (plus f16 rounding of min/scale), constant groups exact.
        let y: Vec<f32> = (0..100).map(|i| ((i * 37) % 101) as f32 / 7.0 - 3.0).collect();
        for bits in [3u32, 4, 8] {
            let r = minmax_quantize(&y, 10, bits);
            for (c, rc) in y.chunks(10).zip(r.chunks(10)) {
                let lo = c.iter().cloned().fold(f32::INFINITY, f32::min);
                let hi = c.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let step = (hi - lo) / ((1 << bits) - 1) as f32;
                for (a, b) in c.iter().zip(rc) {
                    assert!((a - b).abs() <= 0.5 * step + 2e-3 * (hi - lo) + 1e-3);
                }
            }
        }
        assert_eq!(minmax_quantize(&[1.25; 5], 4, 3), vec![1.25; 5]);
    }

    #[test]
    fn attention_single_key_and_causality() {
        // One KV head, two query heads, head_dim 2, 3 tokens.
        let k = [1.0, 0.0, 0.0, 1.0, 5.0, 5.0];
        let v = [1.0, 2.0, 3.0, 4.0, 100.0, 100.0];
        let q = [0.3, -0.2, 1.0, 1.0];
        // Query at position 0 sees only token 0: output = v[0] for both heads.
        let out = attention_output(&q, 1, 2, &k, &v, 3, 1, 2, 0);
        assert_eq!(out, vec![1.0, 2.0, 1.0, 2.0]);
        // At position 1, equal scores give the mean of v[0] and v[1]; token 2 is never seen.
        let q = [0.5, 0.5];
        let out = attention_output(&q, 1, 1, &k, &v, 3, 1, 2, 1);
        assert!((out[0] - 2.0).abs() < 1e-6 && (out[1] - 3.0).abs() < 1e-6);
    }
}
