//! The attention oracle: causal softmax attention of recorded queries over a cache, computed the
//! same way wherever kvc measures attention.
//!
//! Profile learning calibrates its steps against this arithmetic, so a profile's bytes depend on
//! every rounding below; the tools measure with the same functions (`kvc eval`'s attention
//! error, `kvc pq eval`'s exact top-k and softmax mass). Per query head, over the tokens
//! `0..len` the query sees:
//!
//! 1. score `s_t = q . k_t` in `f32`: the products `q_j * k_tj` added to 0 in dimension order;
//! 2. `x_t = f64(s_t) * (1 / sqrt(head_dim))` in `f64` (`libm::sqrt`), and `m = max_t x_t`;
//! 3. weight `w_t = exp(x_t - m)` in `f64` (`libm::exp`), and `z = sum_t w_t` in token order;
//! 4. output `o_j = (sum_t w_t * f64(v_tj)) / z`, the sum in token order, divided at the end.
//!
//! Query head `h` reads KV head `h / (q_heads / kv_heads)` (grouped-query attention).
//!
//! Every sum has a fixed order, so loops are rearranged only where each sum keeps its own: the
//! keys of each KV head are transposed to `[head_dim, tokens]` ([`TransposedKeys`]) so that one
//! pass over a dimension advances the scores of a whole tile of tokens, each token still adding
//! its products in dimension order; up to four query rows of a KV head share every key and value
//! load. The unit tests hold the results bit for bit to the plain scalar loops.

use alloc::vec;
use alloc::vec::Vec;

/// Heads and head dimension of one layer's attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Heads {
    /// Query heads, a multiple of `kv_heads`.
    pub q_heads: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Channels per head.
    pub head_dim: usize,
}

impl Heads {
    /// The KV head that query head `qh` reads.
    pub fn kv_head(&self, qh: usize) -> usize {
        qh / (self.q_heads / self.kv_heads)
    }

    /// Panics unless the heads are non-empty and the query heads form whole groups.
    fn check(&self) {
        assert!(
            self.kv_heads > 0 && self.head_dim > 0 && self.q_heads > 0,
            "attention: empty heads {self:?}"
        );
        assert!(
            self.q_heads.is_multiple_of(self.kv_heads),
            "attention: {} query heads is not a multiple of {} KV heads",
            self.q_heads,
            self.kv_heads
        );
    }
}

/// One stored query (a row of `q`, with all its heads) and how many tokens it attends to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Query {
    /// Index of the query's row in `q` (`[n_q, q_heads, head_dim]`).
    pub row: usize,
    /// The query sees tokens `0..len` (causal attention: its position plus one).
    pub len: usize,
}

/// A layer's keys with each KV head transposed to `[head_dim, tokens]`: the layout in which step
/// 1 runs over many tokens at once.
#[derive(Clone, Debug, PartialEq)]
pub struct TransposedKeys {
    kv_heads: usize,
    head_dim: usize,
    tokens: usize,
    /// `[kv_heads, head_dim, tokens]`.
    data: Vec<f32>,
}

impl TransposedKeys {
    /// Transposes `k`, laid out `[tokens, kv_heads, head_dim]`.
    ///
    /// Panics if `kv_heads` or `head_dim` is zero, or if `k.len()` is not a multiple of
    /// `kv_heads * head_dim`.
    pub fn new(k: &[f32], kv_heads: usize, head_dim: usize) -> Self {
        let c = kv_heads * head_dim;
        assert!(
            c > 0 && k.len().is_multiple_of(c),
            "attention: {} keys do not form rows of {kv_heads} x {head_dim}",
            k.len()
        );
        let tokens = k.len() / c;
        let mut data = vec![0.0f32; k.len()];
        for (t, row) in k.chunks_exact(c).enumerate() {
            for (ch, &x) in row.iter().enumerate() {
                data[ch * tokens + t] = x;
            }
        }
        TransposedKeys {
            kv_heads,
            head_dim,
            tokens,
            data,
        }
    }

    /// Number of tokens.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// The `[head_dim, tokens]` block of KV head `h`.
    fn head(&self, h: usize) -> &[f32] {
        let n = self.head_dim * self.tokens;
        &self.data[h * n..(h + 1) * n]
    }

    /// Step 1 for one query head: `out[t] = q . k_t` for the tokens `t < out.len()` of KV head
    /// `kv_head`.
    ///
    /// Panics if `kv_head` is out of range, `q.len() != head_dim` or `out.len() > tokens`.
    pub fn scores_into(&self, kv_head: usize, q: &[f32], out: &mut [f32]) {
        assert!(kv_head < self.kv_heads, "attention: KV head {kv_head}");
        assert_eq!(q.len(), self.head_dim, "attention: query length");
        assert!(
            out.len() <= self.tokens,
            "attention: more scores than tokens"
        );
        let n = out.len();
        score_rows(self.head(kv_head), self.tokens, &[q], n, out);
    }
}

/// Tokens per tile of the score pass: one dimension's keys and the rows' scores of a tile stay
/// in L1 while every dimension is added.
const TILE: usize = 512;

/// Query rows that share each key and value load.
const ROWS: usize = 4;

/// Step 1 for several query rows of one KV head: `out[r * n + t] = qs[r] . k_t` for `t < n`.
/// `kt` is the head's `[head_dim, tokens]` block.
fn score_rows(kt: &[f32], tokens: usize, qs: &[&[f32]], n: usize, out: &mut [f32]) {
    for t0 in (0..n).step_by(TILE) {
        let t1 = (t0 + TILE).min(n);
        for r in 0..qs.len() {
            out[r * n + t0..r * n + t1].fill(0.0);
        }
        for (j, kj) in kt.chunks_exact(tokens).enumerate() {
            let kj = &kj[t0..t1];
            for (r, q) in qs.iter().enumerate() {
                let a = q[j];
                for (s, &x) in out[r * n + t0..r * n + t1].iter_mut().zip(kj) {
                    *s += a * x;
                }
            }
        }
    }
}

/// Steps 2 and 3 in place: turns the scores `x[t] = f64(s_t)` into `w_t = exp(x_t * scale - m)`
/// and returns `z`, the sum of the weights in token order.
fn weights_in_place(x: &mut [f64], scale: f64) -> f64 {
    let mut m = f64::NEG_INFINITY;
    for s in x.iter_mut() {
        *s *= scale;
        m = m.max(*s);
    }
    let mut z = 0.0f64;
    for s in x.iter_mut() {
        *s = libm::exp(*s - m);
        z += *s;
    }
    z
}

/// `1 / sqrt(head_dim)` as step 2 computes it.
fn score_scale(head_dim: usize) -> f64 {
    1.0 / libm::sqrt(head_dim as f64)
}

/// Steps 2 and 3, normalized: `out[t] = w_t / z`, the softmax of the scores `s_t` of one query
/// head (as [`TransposedKeys::scores_into`] computes them). Empty scores give no weights.
pub fn softmax_into(scores: &[f32], head_dim: usize, out: &mut Vec<f64>) {
    out.clear();
    out.extend(scores.iter().map(|&s| s as f64));
    let z = weights_in_place(out, score_scale(head_dim));
    for w in out.iter_mut() {
        *w /= z;
    }
}

/// Step 4 for one row: `o[j] += w[t] * v_tj` over `t < w.len()` in token order, where `v_tj` is
/// `v[t * stride + j]`.
fn add_weighted(w: &[f64], v: &[f32], stride: usize, o: &mut [f64]) {
    let d = o.len();
    for (t, &wt) in w.iter().enumerate() {
        for (oj, &x) in o.iter_mut().zip(&v[t * stride..t * stride + d]) {
            *oj += wt * x as f64;
        }
    }
}

/// Causal attention outputs of the given queries, in `f64`: `[queries.len(), q_heads,
/// head_dim]`, query by query in the order given.
///
/// `q` is `[n_q, q_heads, head_dim]`; `k` and `v` are `[tokens, kv_heads, head_dim]`. A query
/// that sees no token (`len == 0`) gives NaN (`0 / 0`).
///
/// Panics if the heads are empty or do not form whole groups, if the slice lengths do not fit
/// the heads, or if a query's row or length is out of range.
pub fn outputs(q: &[f32], heads: Heads, queries: &[Query], k: &[f32], v: &[f32]) -> Vec<f64> {
    heads.check();
    let d = heads.head_dim;
    let c = heads.kv_heads * d;
    assert_eq!(k.len(), v.len(), "attention: K and V lengths differ");
    let row_len = heads.q_heads * d;
    assert!(
        q.len().is_multiple_of(row_len),
        "attention: queries do not form rows of {} x {d}",
        heads.q_heads
    );
    let kt = TransposedKeys::new(k, heads.kv_heads, d);
    let tokens = kt.tokens;
    for qr in queries {
        assert!(
            (qr.row + 1) * row_len <= q.len() && qr.len <= tokens,
            "attention: query {qr:?} out of range ({} rows, {tokens} tokens)",
            q.len() / row_len
        );
    }
    let group = heads.q_heads / heads.kv_heads;
    let scale = score_scale(d);
    let mut out = vec![0.0f64; queries.len() * row_len];
    let n_max_all = queries.iter().map(|qr| qr.len).max().unwrap_or(0);
    let mut scores = vec![0.0f32; ROWS * n_max_all];
    let mut weights = vec![0.0f64; n_max_all];
    // (index into `queries`, query head) of one KV head's rows, query by query.
    let mut rows: Vec<(usize, usize)> = Vec::with_capacity(queries.len() * group);
    for g in 0..heads.kv_heads {
        rows.clear();
        for qi in 0..queries.len() {
            rows.extend((g * group..(g + 1) * group).map(|qh| (qi, qh)));
        }
        for block in rows.chunks(ROWS) {
            let n = block
                .iter()
                .map(|&(qi, _)| queries[qi].len)
                .max()
                .unwrap_or(0);
            let mut qs: [&[f32]; ROWS] = [&[]; ROWS];
            for (slot, &(qi, qh)) in qs.iter_mut().zip(block) {
                let at = queries[qi].row * row_len + qh * d;
                *slot = &q[at..at + d];
            }
            score_rows(kt.head(g), tokens, &qs[..block.len()], n, &mut scores);
            for (r, &(qi, qh)) in block.iter().enumerate() {
                let len = queries[qi].len;
                let w = &mut weights[..len];
                for (x, &s) in w.iter_mut().zip(&scores[r * n..r * n + len]) {
                    *x = s as f64;
                }
                let z = weights_in_place(w, scale);
                let o = &mut out[(qi * heads.q_heads + qh) * d..][..d];
                add_weighted(w, &v[g * d..], c, o);
                for oj in o.iter_mut() {
                    *oj /= z;
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The oracle as plain scalar loops (the arithmetic profile learning has always used).
    fn reference(q: &[f32], heads: Heads, queries: &[Query], k: &[f32], v: &[f32]) -> Vec<f64> {
        let d = heads.head_dim;
        let c = heads.kv_heads * d;
        let per = heads.q_heads * d;
        let scale = 1.0 / libm::sqrt(d as f64);
        let mut out = Vec::new();
        let mut o = vec![0f64; d];
        for qr in queries {
            for qh in 0..heads.q_heads {
                let h = heads.kv_head(qh);
                let qv = &q[qr.row * per + qh * d..qr.row * per + (qh + 1) * d];
                let mut scores = vec![0f64; qr.len];
                let mut mx = f64::NEG_INFINITY;
                for (t, sc) in scores.iter_mut().enumerate() {
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
                for (t, sc) in scores.iter().enumerate() {
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

    /// Deterministic pseudo-random values of a wide dynamic range.
    fn values(n: usize, seed: u64, spread: f32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                let u = (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                u * spread * (1.0 + (s & 7) as f32)
            })
            .collect()
    }

    fn bits(x: &[f64]) -> Vec<u64> {
        x.iter().map(|v| v.to_bits()).collect()
    }

    #[test]
    fn outputs_match_scalar_loops_bit_for_bit() {
        // (n_q, q_heads, kv_heads, head_dim, tokens): odd sizes, groups of 1..4, more than a
        // tile of tokens, blocks of rows that straddle queries.
        for (case, &(n_q, hq, hk, d, tokens)) in [
            (1usize, 1usize, 1usize, 1usize, 1usize),
            (3, 3, 3, 5, 4),
            (5, 6, 2, 13, 9),
            (2, 4, 1, 8, 20),
            (7, 9, 3, 64, 33),
            (4, 9, 3, 64, 1100),
            (3, 8, 2, 17, 600),
        ]
        .iter()
        .enumerate()
        {
            let heads = Heads {
                q_heads: hq,
                kv_heads: hk,
                head_dim: d,
            };
            let seed = case as u64 * 4 + 1;
            let q = values(n_q * hq * d, seed, 4.0);
            let k = values(tokens * hk * d, seed + 1, 3.0);
            let v = values(tokens * hk * d, seed + 2, 2.0);
            // Causal lengths ending at the last token, a strided subset, and an empty one.
            let causal: Vec<Query> = (0..n_q)
                .map(|i| Query {
                    row: i,
                    len: tokens - n_q.min(tokens) + i + 1,
                })
                .filter(|qr| qr.len <= tokens)
                .collect();
            let mixed = [
                Query {
                    row: n_q - 1,
                    len: tokens,
                },
                Query { row: 0, len: 0 },
                Query {
                    row: n_q / 2,
                    len: 1.max(tokens / 3),
                },
            ];
            for queries in [&causal[..], &mixed[..]] {
                let fast = outputs(&q, heads, queries, &k, &v);
                let slow = reference(&q, heads, queries, &k, &v);
                assert_eq!(bits(&fast), bits(&slow), "case {case}: {queries:?}");
            }
        }
    }

    #[test]
    fn scores_and_softmax_match_scalar_loops_bit_for_bit() {
        let (hk, d, tokens) = (3usize, 64usize, 700usize);
        let k = values(tokens * hk * d, 7, 3.0);
        let q = values(d, 8, 4.0);
        let kt = TransposedKeys::new(&k, hk, d);
        assert_eq!(kt.tokens(), tokens);
        let mut s = vec![0.0f32; 650];
        let mut w = Vec::new();
        for h in 0..hk {
            kt.scores_into(h, &q, &mut s);
            let mut want = Vec::new();
            for t in 0..s.len() {
                let mut acc = 0f32;
                for j in 0..d {
                    acc += q[j] * k[(t * hk + h) * d + j];
                }
                want.push(acc);
            }
            let got: Vec<u32> = s.iter().map(|x| x.to_bits()).collect();
            let want_bits: Vec<u32> = want.iter().map(|x| x.to_bits()).collect();
            assert_eq!(got, want_bits, "head {h}");
            softmax_into(&s, d, &mut w);
            let scale = 1.0 / libm::sqrt(d as f64);
            let x: Vec<f64> = want.iter().map(|&a| a as f64 * scale).collect();
            let m = x.iter().fold(f64::NEG_INFINITY, |m, &a| m.max(a));
            let e: Vec<f64> = x.iter().map(|&a| libm::exp(a - m)).collect();
            let z = e.iter().fold(0.0, |z, &a| z + a);
            let want_w: Vec<f64> = e.iter().map(|a| a / z).collect();
            assert_eq!(bits(&w), bits(&want_w), "head {h}");
        }
        softmax_into(&[], d, &mut w);
        assert!(w.is_empty());
    }

    #[test]
    fn one_visible_token_returns_its_value() {
        // One KV head read by two query heads, head_dim 2, 3 tokens; query 0 sees token 0 only.
        let heads = Heads {
            q_heads: 2,
            kv_heads: 1,
            head_dim: 2,
        };
        let k = [1.0, 0.0, 0.0, 1.0, 5.0, 5.0];
        let v = [1.0, 2.0, 3.0, 4.0, 100.0, 100.0];
        let q = [0.3, -0.2, 1.0, 1.0];
        let out = outputs(&q, heads, &[Query { row: 0, len: 1 }], &k, &v);
        assert_eq!(out, vec![1.0, 2.0, 1.0, 2.0]);
        assert_eq!(heads.kv_head(1), 0);
    }
}
