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

/// Query rows processed together (they share every K and V load). The kernels below are
/// written out for exactly four.
const ROWS: usize = 4;
/// Tokens per tile of the score pass (keeps the score rows in L1).
const TILE: usize = 512;

/// `e^x` for `x <= 0` in f32 arithmetic, written without calls or branches so that loops over it
/// vectorize. Relative error about 2e-7; inputs below -87 give 0.
#[inline(always)]
fn exp_nonpos(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split so that n * LN2_HI is exact for |n| < 2^10.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding 1.5 * 2^23 rounds to the nearest integer (ties to even) for |v| < 2^22.
    const MAGIC: f32 = 12_582_912.0;
    let xc = if x < -87.0 { -87.0 } else { x };
    let shifted = xc * LOG2E + MAGIC;
    let n = shifted - MAGIC;
    // Reduced argument, |r| <= ln2 / 2.
    let r = (xc - n * LN2_HI) - n * LN2_LO;
    // Taylor series to r^7: truncation error below 1e-8 on |r| <= 0.35.
    let p = 1.0
        + r * (1.0
            + r * (1.0 / 2.0
                + r * (1.0 / 6.0
                    + r * (1.0 / 24.0
                        + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r * (1.0 / 5040.0)))))));
    // 2^n from the integer in the low mantissa bits of `shifted` (n in -126..=0).
    let ni = (shifted.to_bits() as i32).wrapping_sub(MAGIC.to_bits() as i32);
    let pow2 = f32::from_bits((ni.wrapping_add(127) as u32) << 23);
    if x < -87.0 {
        0.0
    } else {
        p * pow2
    }
}

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
        q_heads.is_multiple_of(kv_heads),
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
    let t_max = q_start as usize + n_q; // keys any query can see

    // K of one KV head transposed to [d, t_max], so score rows accumulate contiguously.
    let mut kt = vec![0.0f32; d * t_max];
    // Per block row: scaled query [d], scores then weights [t_max], output accumulator [d].
    let mut qb = vec![0.0f32; ROWS * d];
    let mut w = vec![0.0f32; ROWS * t_max];
    let mut acc = vec![0.0f32; ROWS * d];
    // Rows (query, head) of the current KV head, ordered by query.
    let mut rows: Vec<(usize, usize)> = Vec::with_capacity(n_q * group);

    for g in 0..kv_heads {
        for t in 0..t_max {
            for (j, &x) in k[t * row + g * d..][..d].iter().enumerate() {
                kt[j * t_max + t] = x;
            }
        }
        rows.clear();
        for i in 0..n_q {
            for h in g * group..(g + 1) * group {
                rows.push((i, h));
            }
        }
        for block in rows.chunks(ROWS) {
            // Row r (padded by repeating the last) sees keys 0..n[r]; the block computes up to
            // the largest extent and zeroes each row's weights beyond its own.
            let mut n = [0usize; ROWS];
            for (r, nr) in n.iter_mut().enumerate() {
                let (i, h) = block[r.min(block.len() - 1)];
                *nr = q_start as usize + i + 1;
                for (o, &x) in qb[r * d..(r + 1) * d]
                    .iter_mut()
                    .zip(&q[(i * q_heads + h) * d..][..d])
                {
                    *o = x * scale;
                }
            }
            let n_max = n.iter().copied().max().unwrap_or(0);

            // Scores: w[r][t] = sum_j qb[r][j] * kt[j][t], tile by tile.
            {
                let (w0, rest) = w.split_at_mut(t_max);
                let (w1, rest) = rest.split_at_mut(t_max);
                let (w2, w3) = rest.split_at_mut(t_max);
                for t0 in (0..n_max).step_by(TILE) {
                    let t1 = (t0 + TILE).min(n_max);
                    let (w0, w1, w2, w3) = (
                        &mut w0[t0..t1],
                        &mut w1[t0..t1],
                        &mut w2[t0..t1],
                        &mut w3[t0..t1],
                    );
                    w0.fill(0.0);
                    w1.fill(0.0);
                    w2.fill(0.0);
                    w3.fill(0.0);
                    for j in 0..d {
                        let kj = &kt[j * t_max + t0..j * t_max + t1];
                        let (a0, a1, a2, a3) = (qb[j], qb[d + j], qb[2 * d + j], qb[3 * d + j]);
                        for t in 0..kj.len() {
                            let x = kj[t];
                            w0[t] += a0 * x;
                            w1[t] += a1 * x;
                            w2[t] += a2 * x;
                            w3[t] += a3 * x;
                        }
                    }
                }
            }

            // Softmax of each row over its own extent.
            let mut inv = [0.0f32; ROWS];
            for r in 0..ROWS {
                let wr = &mut w[r * t_max..r * t_max + n_max];
                let (live, dead) = wr.split_at_mut(n[r]);
                dead.fill(0.0);
                let mut mx = [f32::NEG_INFINITY; 8];
                let chunks = live.chunks_exact(8);
                let mut m = chunks
                    .remainder()
                    .iter()
                    .fold(f32::NEG_INFINITY, |m, &x| m.max(x));
                for c in chunks {
                    for l in 0..8 {
                        mx[l] = mx[l].max(c[l]);
                    }
                }
                m = mx.iter().fold(m, |m, &x| m.max(x));
                for x in live.iter_mut() {
                    *x = exp_nonpos(*x - m);
                }
                let mut sums = [0.0f64; 4];
                let chunks = live.chunks_exact(4);
                let tail: f64 = chunks.remainder().iter().map(|&x| x as f64).sum();
                for c in chunks {
                    for l in 0..4 {
                        sums[l] += c[l] as f64;
                    }
                }
                let sum = (sums[0] + sums[1]) + (sums[2] + sums[3]) + tail;
                inv[r] = (1.0 / sum) as f32;
            }

            // Outputs: acc[r] = sum_t w[r][t] * v[t], four rows per V load.
            {
                acc.fill(0.0);
                let (c0, rest) = acc.split_at_mut(d);
                let (c1, rest) = rest.split_at_mut(d);
                let (c2, c3) = rest.split_at_mut(d);
                for t in 0..n_max {
                    let vt = &v[t * row + g * d..][..d];
                    let (b0, b1, b2, b3) = (w[t], w[t_max + t], w[2 * t_max + t], w[3 * t_max + t]);
                    for j in 0..d {
                        let x = vt[j];
                        c0[j] += b0 * x;
                        c1[j] += b1 * x;
                        c2[j] += b2 * x;
                        c3[j] += b3 * x;
                    }
                }
            }
            for (r, &(i, h)) in block.iter().enumerate() {
                let o = &mut out[(i * q_heads + h) * d..][..d];
                for (ol, &al) in o.iter_mut().zip(&acc[r * d..(r + 1) * d]) {
                    *ol = al * inv[r];
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
    assert!(
        (1..=16).contains(&bits),
        "minmax_quantize: bits must be 1..=16"
    );
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
            // Clamp, then round half to even by adding and removing 1.5 * 2^23 (exact for
            // values below 2^22, which the clamp guarantees).
            let c = ((v - mn) / scale).clamp(0.0, levels);
            let q = (c + ROUND_MAGIC) - ROUND_MAGIC;
            out.push(mn + q * scale);
        }
    }
    out
}

const ROUND_MAGIC: f32 = 12_582_912.0;

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
    fn exp_matches_std() {
        let mut worst = 0.0f64;
        let mut x = 0.0f32;
        while x > -90.0 {
            let want = (x as f64).exp();
            let got = exp_nonpos(x) as f64;
            if x >= -87.0 {
                worst = worst.max((got - want).abs() / want);
            } else {
                assert_eq!(got, 0.0);
            }
            x -= 0.0137;
        }
        assert!(worst < 5e-7, "worst relative error {worst}");
        assert_eq!(exp_nonpos(0.0), 1.0);
        assert_eq!(exp_nonpos(f32::NEG_INFINITY), 0.0);
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
                (0..n).map(|i| (i as f32 * a).sin() * 3.0).collect()
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
        let y: Vec<f32> = (0..100)
            .map(|i| ((i * 37) % 101) as f32 / 7.0 - 3.0)
            .collect();
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
