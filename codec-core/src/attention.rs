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
//! Every sum has a fixed order, so loops are rearranged only where each sum keeps its own: keys
//! are laid out in blocks of 8 tokens, dimension-major ([`TransposedKeys`]), so that one pass
//! over the dimensions advances 8 scores held in registers, each token still adding its
//! products in dimension order; values are read as panels of 4 channels; four query rows of a
//! KV head share every key and value load; `exp` is `libm::exp`'s own algorithm written without
//! branches, so that it vectorizes. The unit tests hold the results bit for bit to the plain
//! scalar loops and to `libm::exp`.

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

/// A layer's keys laid out for step 1: each KV head's tokens in blocks of 8, each block
/// dimension-major (`[kv_heads, ceil(tokens / 8), head_dim, 8]`, the last block zero-padded), so that one pass over the dimensions advances the scores of a block of tokens
/// held in registers, each token still adding its products in dimension order.
#[derive(Clone, Debug, PartialEq)]
pub struct TransposedKeys {
    kv_heads: usize,
    head_dim: usize,
    tokens: usize,
    blocks: Vec<[f32; LANES]>,
}

/// Tokens whose scores one pass over the dimensions keeps in registers.
const LANES: usize = 8;

impl TransposedKeys {
    /// Lays out `k`, which is `[tokens, kv_heads, head_dim]`.
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
        let per_head = tokens.div_ceil(LANES) * head_dim;
        let mut blocks = vec![[0.0f32; LANES]; kv_heads * per_head];
        for (t, row) in k.chunks_exact(c).enumerate() {
            let (tb, lane) = (t / LANES, t % LANES);
            for (h, key) in row.chunks_exact(head_dim).enumerate() {
                let at = h * per_head + tb * head_dim;
                for (b, &x) in blocks[at..at + head_dim].iter_mut().zip(key) {
                    b[lane] = x;
                }
            }
        }
        TransposedKeys {
            kv_heads,
            head_dim,
            tokens,
            blocks,
        }
    }

    /// Number of tokens.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// The blocks of KV head `h`.
    fn head(&self, h: usize) -> &[[f32; LANES]] {
        let n = self.tokens.div_ceil(LANES) * self.head_dim;
        &self.blocks[h * n..(h + 1) * n]
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
        score_rows(self.head(kv_head), self.head_dim, [q], n, out);
    }
}

/// Query rows that share each key and value load.
const ROWS: usize = 4;

/// Step 1 for `R` query rows of one KV head: `out[r * n + t] = qs[r] . k_t` for `t < n`, from
/// the head's [`TransposedKeys`] blocks.
fn score_rows<const R: usize>(
    blocks: &[[f32; LANES]],
    d: usize,
    qs: [&[f32]; R],
    n: usize,
    out: &mut [f32],
) {
    for (tb, block) in blocks.chunks_exact(d).take(n.div_ceil(LANES)).enumerate() {
        let mut acc = [[0.0f32; LANES]; R];
        for (j, kj) in block.iter().enumerate() {
            for (a, q) in acc.iter_mut().zip(&qs) {
                let x = q[j];
                for (al, &k) in a.iter_mut().zip(kj) {
                    *al += x * k;
                }
            }
        }
        let t0 = tb * LANES;
        let m = LANES.min(n - t0);
        for (r, a) in acc.iter().enumerate() {
            out[r * n + t0..r * n + t0 + m].copy_from_slice(&a[..m]);
        }
    }
}

/// Steps 2 and 3 up to the sum, in place: turns the scores `x[t] = f64(s_t)` into the weights
/// `w_t = exp(x_t * scale - m)`.
fn weights_in_place(x: &mut [f64], scale: f64) {
    for s in x.iter_mut() {
        *s *= scale;
    }
    let m = max_of(x);
    for s in x.iter_mut() {
        *s -= m;
    }
    exp_in_place(x);
}

/// The largest element (NaNs ignored; -inf for none), in eight lanes. A fold in token order
/// could differ only in the sign of a zero maximum (`f64::max` may return either zero), and
/// `x - m` then differs only in the sign of a zero difference, whose `exp` is 1 either way.
fn max_of(x: &[f64]) -> f64 {
    let chunks = x.chunks_exact(8);
    let tail = chunks
        .remainder()
        .iter()
        .fold(f64::NEG_INFINITY, |m, &a| m.max(a));
    let mut lanes = [f64::NEG_INFINITY; 8];
    for c in chunks {
        for (l, &a) in lanes.iter_mut().zip(c) {
            *l = l.max(a);
        }
    }
    lanes.iter().fold(tail, |m, &a| m.max(a))
}

/// `libm::exp`'s argument reduction and rational approximation (FreeBSD's `e_exp.c`), for
/// `|x| < 708.39` (below the `libm::exp` special cases), written without branches so that
/// loops over it vectorize. The same operations in the same order as `libm::exp`, so the same
/// bits; the tests hold it to `libm::exp`.
#[inline(always)]
fn exp_reduced(x: f64) -> f64 {
    const LN2HI: f64 = f64::from_bits(0x3fe6_2e42_fee0_0000);
    const LN2LO: f64 = f64::from_bits(0x3dea_39ef_3579_3c76);
    const INVLN2: f64 = f64::from_bits(0x3ff7_1547_652b_82fe);
    const P1: f64 = f64::from_bits(0x3fc5_5555_5555_553e);
    const P2: f64 = f64::from_bits(0xbf66_c16c_16be_bd93);
    const P3: f64 = f64::from_bits(0x3f11_566a_af25_de2c);
    const P4: f64 = f64::from_bits(0xbebb_bd41_c5d2_6bf1);
    const P5: f64 = f64::from_bits(0x3e66_3769_72be_a4d0);
    let high = (x.to_bits() >> 32) as u32;
    let negative = high >> 31 == 1;
    let hx = high & 0x7fff_ffff;
    // x = k ln2 + r: k = trunc(x / ln2 +- 1/2) above 1.5 ln2, +-1 above ln2 / 2, else 0. The
    // truncation is done in f64 (no saturating integer cast, which does not vectorize): adding
    // and removing 1.5 * 2^52 rounds to an integer, then one step towards zero where rounding
    // went away from it. |v| < 1024 here, so every step is exact.
    const MAGIC: f64 = 6_755_399_441_055_744.0;
    let v = INVLN2 * x + if negative { -0.5 } else { 0.5 };
    let rounded = (v + MAGIC) - MAGIC;
    let k_far = if rounded > v && v >= 0.0 {
        rounded - 1.0
    } else if rounded < v && v < 0.0 {
        rounded + 1.0
    } else {
        rounded
    };
    let k_near = if negative { -1.0 } else { 1.0 };
    let kf = if hx >= 0x3ff0_a2b2 {
        k_far
    } else if hx > 0x3fd6_2e42 {
        k_near
    } else {
        0.0
    };
    let hi = x - kf * LN2HI;
    let lo = kf * LN2LO;
    let r = hi - lo;
    let rr = r * r;
    let c = r - rr * (P1 + rr * (P2 + rr * (P3 + rr * (P4 + rr * P5))));
    let y = 1.0 + (r * c / (2.0 - c) - lo + hi);
    // scalbn(y, k): |k| <= 1022 here, so one multiplication by 2^k, whose exponent field is
    // k + 1023 (k read back from the low bits of kf + 1.5 * 2^52).
    let k = ((kf + MAGIC).to_bits() as i64).wrapping_sub(MAGIC.to_bits() as i64);
    let scaled = y * f64::from_bits((k.wrapping_add(0x3ff) as u64) << 52);
    let general = if kf == 0.0 { y } else { scaled };
    // |x| <= 2^-28: libm returns 1 + x.
    if hx <= 0x3e30_0000 {
        1.0 + x
    } else {
        general
    }
}

/// `x <- libm::exp(x)` for every element, bit for bit: [`exp_reduced`] eight at a time, and
/// `libm::exp` itself for any group holding an argument beyond its range (or NaN).
fn exp_in_place(xs: &mut [f64]) {
    const GROUP: usize = 8;
    let reduced = |x: f64| ((x.to_bits() >> 32) as u32 & 0x7fff_ffff) < 0x4086_232b;
    for g in xs.chunks_mut(GROUP) {
        if g.iter().fold(true, |ok, &x| ok & reduced(x)) {
            for x in g.iter_mut() {
                *x = exp_reduced(*x);
            }
        } else {
            for x in g.iter_mut() {
                *x = libm::exp(*x);
            }
        }
    }
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
    weights_in_place(out, score_scale(head_dim));
    let z = out.iter().fold(0.0, |z, &w| z + w);
    for w in out.iter_mut() {
        *w /= z;
    }
}

/// One KV head's values as `[ceil(head_dim / 4), tokens]` groups of four channels (the last
/// group zero-padded): step 4 then streams each group's tokens in order.
fn value_panel(v: &[f32], c: usize, g: usize, d: usize, panel: &mut Vec<[f32; 4]>) {
    let tokens = v.len() / c;
    let d4 = d.div_ceil(4);
    panel.clear();
    panel.resize(d4 * tokens, [0.0; 4]);
    for (t, row) in v.chunks_exact(c).enumerate() {
        for (j4, ch) in row[g * d..(g + 1) * d].chunks(4).enumerate() {
            panel[j4 * tokens + t][..ch.len()].copy_from_slice(ch);
        }
    }
}

/// Step 4 for `R` rows over the tokens `range`: `o[r][j] += w[r][t] * v_tj` and `z[r] += w[r][t]`,
/// each sum in token order. `panel` is [`value_panel`]'s, `o` holds the rows' sums as `R` runs of
/// `ceil(d / 4)` groups of four channels.
fn weighted_sums<const R: usize>(
    w: [&[f64]; R],
    panel: &[[f32; 4]],
    tokens: usize,
    range: core::ops::Range<usize>,
    o: &mut [[f64; 4]],
    z: &mut [f64],
) {
    let d4 = panel.len() / tokens.max(1);
    let ws: [&[f64]; R] = w.map(|x| &x[range.clone()]);
    // R independent chains, so that each addition's latency overlaps the others'.
    for i in 0..range.len() {
        for (zr, wr) in z.iter_mut().zip(&ws) {
            *zr += wr[i];
        }
    }
    for j4 in 0..d4 {
        let vs = &panel[j4 * tokens..(j4 + 1) * tokens][range.clone()];
        // Four channels of R rows stay in registers while the tokens stream past.
        let mut acc = [[0.0f64; 4]; R];
        for (r, a) in acc.iter_mut().enumerate() {
            *a = o[r * d4 + j4];
        }
        for (i, v) in vs.iter().enumerate() {
            let vf = [v[0] as f64, v[1] as f64, v[2] as f64, v[3] as f64];
            for (a, wr) in acc.iter_mut().zip(&ws) {
                let wt = wr[i];
                for (al, &x) in a.iter_mut().zip(&vf) {
                    *al += wt * x;
                }
            }
        }
        for (r, a) in acc.iter().enumerate() {
            o[r * d4 + j4] = *a;
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
    let kt = checked_keys(q, heads, queries, k, v);
    let d = heads.head_dim;
    let row_len = heads.q_heads * d;
    let group = heads.q_heads / heads.kv_heads;
    let mut out = vec![0.0f64; queries.len() * row_len];
    let mut scratch = RowBlock::new(queries, d, score_scale(d));
    let mut panel = Vec::new();
    // (index into `queries`, query head) of one KV head's rows, query by query.
    let mut rows: Vec<(usize, usize)> = Vec::with_capacity(queries.len() * group);
    for g in 0..heads.kv_heads {
        value_panel(v, heads.kv_heads * d, g, d, &mut panel);
        rows.clear();
        for qi in 0..queries.len() {
            rows.extend((g * group..(g + 1) * group).map(|qh| (qi, qh)));
        }
        for block in rows.chunks(ROWS) {
            let lens: Vec<usize> = block.iter().map(|&(qi, _)| queries[qi].len).collect();
            let mut qs: [&[f32]; ROWS] = [&[]; ROWS];
            for (slot, &(qi, qh)) in qs.iter_mut().zip(block) {
                let at = queries[qi].row * row_len + qh * d;
                *slot = &q[at..at + d];
            }
            scratch.attend(kt.head(g), &panel, kt.tokens, &qs[..block.len()], &lens);
            for (r, &(qi, qh)) in block.iter().enumerate() {
                scratch.output(r, &mut out[(qi * heads.q_heads + qh) * d..][..d]);
            }
        }
    }
    out
}

/// [`outputs`]' argument checks (it panics as documented there); the keys transposed.
fn checked_keys(
    q: &[f32],
    heads: Heads,
    queries: &[Query],
    k: &[f32],
    v: &[f32],
) -> TransposedKeys {
    heads.check();
    let d = heads.head_dim;
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
    kt
}

/// [`outputs`]' scratch for a block of up to [`ROWS`] query rows of one KV head: their scores,
/// softmax weights, weighted value sums and normalizers.
struct RowBlock {
    d: usize,
    scale: f64,
    /// A block's rows lie its longest row's length apart.
    scores: Vec<f32>,
    weights: Vec<f64>,
    sums: Vec<[f64; 4]>,
    z: [f64; ROWS],
}

impl RowBlock {
    fn new(queries: &[Query], d: usize, scale: f64) -> RowBlock {
        let n_max_all = queries.iter().map(|qr| qr.len).max().unwrap_or(0);
        RowBlock {
            d,
            scale,
            scores: vec![0.0f32; ROWS * n_max_all],
            weights: vec![0.0f64; ROWS * n_max_all],
            sums: vec![[0.0f64; 4]; ROWS * d.div_ceil(4)],
            z: [0.0; ROWS],
        }
    }

    /// Attends rows `qs` (each seeing its first `lens[r]` tokens) over one KV head's keys
    /// `head` and value `panel`.
    fn attend(
        &mut self,
        head: &[[f32; LANES]],
        panel: &[[f32; 4]],
        tokens: usize,
        qs: &[&[f32]],
        lens: &[usize],
    ) {
        let (d, d4) = (self.d, self.d.div_ceil(4));
        let n = lens.iter().copied().max().unwrap_or(0);
        match <[&[f32]; ROWS]>::try_from(qs) {
            Ok(full) => score_rows(head, d, full, n, &mut self.scores),
            Err(_) => {
                for (q, out) in qs.iter().zip(self.scores.chunks_mut(n.max(1))) {
                    score_rows(head, d, [*q], n, out);
                }
            }
        }
        for (r, &len) in lens.iter().enumerate() {
            let w = &mut self.weights[r * n..r * n + len];
            for (x, &s) in w.iter_mut().zip(&self.scores[r * n..r * n + len]) {
                *x = s as f64;
            }
            weights_in_place(w, self.scale);
        }
        self.z = [0.0; ROWS];
        self.sums.fill([0.0; 4]);
        // All rows of a full block share each value load over their common tokens; each
        // row then adds its own remaining tokens.
        let weights = &self.weights;
        let common = if qs.len() == ROWS {
            let n_min = lens.iter().copied().min().unwrap_or(0);
            let w: [&[f64]; ROWS] = core::array::from_fn(|r| &weights[r * n..(r + 1) * n]);
            weighted_sums(w, panel, tokens, 0..n_min, &mut self.sums, &mut self.z);
            n_min
        } else {
            0
        };
        for (r, &len) in lens.iter().enumerate() {
            let w = [&weights[r * n..(r + 1) * n]];
            let o = &mut self.sums[r * d4..(r + 1) * d4];
            weighted_sums(w, panel, tokens, common..len, o, &mut self.z[r..r + 1]);
        }
    }

    /// Row `r`'s output of the block last attended.
    fn output(&self, r: usize, o: &mut [f64]) {
        let d4 = self.d.div_ceil(4);
        let s = self.sums[r * d4..(r + 1) * d4].as_flattened();
        for (oj, &sj) in o.iter_mut().zip(s) {
            *oj = sj / self.z[r];
        }
    }
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
    fn exp_matches_libm_bit_for_bit() {
        let mut xs: Vec<f64> = Vec::new();
        // Around every branch point of libm::exp, both signs, a few ulps either side.
        for edge in [
            0.0f64,
            f64::from_bits(0x3e30_0000_0000_0000),
            f64::from_bits(0x3fd6_2e42_ffff_ffff),
            f64::from_bits(0x3ff0_a2b2_0000_0000),
            f64::from_bits(0x4086_232b_0000_0000),
            0.5 * core::f64::consts::LN_2,
            1.5 * core::f64::consts::LN_2,
            708.396_418_532_264_1,
            709.782_712_893_384,
            745.133_219_101_941_1,
        ] {
            for sign in [1.0, -1.0] {
                let b = (edge * sign).to_bits();
                for d in 0..64u64 {
                    xs.push(f64::from_bits(b.wrapping_add(d)));
                    xs.push(f64::from_bits(b.wrapping_sub(d)));
                }
            }
        }
        xs.extend([
            f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
            -0.0,
            1e-300,
            -1e-300,
        ]);
        // Every multiple of ln2 / 64 up to the range, and pseudo-random arguments: uniform over
        // [-750, 750] and arbitrary bit patterns.
        xs.extend((-70_000..70_000).map(|i| i as f64 * core::f64::consts::LN_2 / 64.0));
        let mut s = 0x2545_f491_4f6c_dd1du64;
        for i in 0..4_000_000u32 {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            xs.push(if i % 4 == 0 {
                f64::from_bits(s)
            } else {
                ((s >> 11) as f64 / (1u64 << 53) as f64 - 0.5) * 1500.0
            });
        }
        let mut got = xs.clone();
        exp_in_place(&mut got);
        for (x, y) in xs.iter().zip(&got) {
            assert_eq!(y.to_bits(), libm::exp(*x).to_bits(), "exp({x:e})");
        }
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
