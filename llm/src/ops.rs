//! The runner's own kernels, each one pass where candle would take several: causal attention a
//! block of query rows at a time ([`Attention`]), with the scaled, masked softmax of its scores
//! (no exponentials for masked entries), and the SwiGLU activation `silu(gate) * up` in place.
//! Both use [`exp_neg`], a vectorizing `e^x` for `x <= 0`.

use candle_core::{CpuStorage, CustomOp3, InplaceOp2, Layout, Shape};

use crate::arch::{matmul, Mat};
use rayon::prelude::*;

/// A row of attention scores whose query sees its first `seen` keys: those entries become
/// `softmax(scale * x)` over them, the others 0.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CausalSoftmax {
    pub scale: f32,
}

impl CausalSoftmax {
    #[inline(always)]
    pub(crate) fn row(&self, seen: usize, row: &mut [f32]) {
        let (seen, masked) = row.split_at_mut(seen);
        masked.fill(0.0);
        let max = lanes(seen, f32::NEG_INFINITY, f32::max);
        let scale = self.scale;
        seen.iter_mut()
            .for_each(|x| *x = exp_neg((*x - max) * scale));
        let inv = 1.0 / lanes(seen, 0.0, |a, b| a + b);
        seen.iter_mut().for_each(|x| *x *= inv);
    }
}

/// `v` reduced with `f` in 8 running lanes, then across them: a fixed order (hence result) that
/// vectorizes, unlike a single running value.
#[inline(always)]
fn lanes(v: &[f32], init: f32, f: impl Fn(f32, f32) -> f32) -> f32 {
    let mut acc = [init; 8];
    let chunks = v.chunks_exact(8);
    let rest = chunks.remainder().iter().fold(init, |a, &x| f(a, x));
    for c in chunks {
        for k in 0..8 {
            acc[k] = f(acc[k], c[k]);
        }
    }
    acc.iter().fold(rest, |a, &x| f(a, x))
}

/// `e^x` for `x <= 0` (softmax arguments after the max is subtracted), within about 2 ulp, in
/// plain f32 arithmetic that vectorizes: `x = n ln 2 + r` with `|r| <= ln 2 / 2`, a degree-6
/// polynomial for `e^r`, and `2^n` built in the exponent bits. Below -87 it returns 0 (the true
/// value is under 2^-125, and a softmax row's maximum contributes 1).
#[inline(always)]
fn exp_neg(x: f32) -> f32 {
    const LOG2E: f32 = core::f32::consts::LOG2_E;
    // ln 2 split so that n * LN2_HI is exact for |n| < 2^8.
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // Adding 1.5 * 2^23 (whose ulp is 1) rounds to the nearest integer n, held in the low
    // mantissa bits: n is the bit difference, without a (saturating, slow) float-to-int cast.
    const ROUND: f32 = 12_582_912.0;
    let x0 = x;
    let x = x.max(-87.0);
    let t = x * LOG2E + ROUND;
    let n_int = t.to_bits() as i32 - ROUND.to_bits() as i32;
    let n = t - ROUND;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    let scale = f32::from_bits(((n_int + 127) << 23) as u32);
    if x0 < -87.0 {
        0.0
    } else {
        p * scale
    }
}

/// `gate <- silu(gate) * up` element-wise, for `[t, ffn]` tensors of the same layout.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SwiGlu;

/// `x * sigmoid(x)`, with `sigmoid` from `e^-|x|` so that [`exp_neg`] serves both signs.
#[inline(always)]
fn silu(x: f32) -> f32 {
    let e = exp_neg(-x.abs());
    let s = if x >= 0.0 {
        1.0 / (1.0 + e)
    } else {
        e / (1.0 + e)
    };
    x * s
}

/// The SwiGLU loop itself (for [`crate::arch`]).
pub(crate) struct SwiGluKernel;

impl SwiGluKernel {
    #[inline(always)]
    pub(crate) fn apply(gate: &mut [f32], up: &[f32]) {
        gate.iter_mut()
            .zip(up)
            .for_each(|(g, &u)| *g = silu(*g) * u);
    }
}

impl InplaceOp2 for SwiGlu {
    fn name(&self) -> &'static str {
        "swiglu"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<()> {
        let (Some((a0, a1)), Some((b0, b1))) = (l1.contiguous_offsets(), l2.contiguous_offsets())
        else {
            candle_core::bail!("swiglu needs contiguous tensors");
        };
        let (CpuStorage::F32(gate), CpuStorage::F32(up)) = (s1, s2) else {
            candle_core::bail!("swiglu needs f32 tensors");
        };
        if a1 - a0 != b1 - b0 {
            candle_core::bail!("swiglu: {:?} and {:?} differ", l1.dims(), l2.dims());
        }
        const PIECE: usize = 1 << 14;
        gate[a0..a1]
            .par_chunks_mut(PIECE)
            .zip(up[b0..b1].par_chunks(PIECE))
            .for_each(|(g, u)| crate::arch::swiglu(g, u));
        Ok(())
    }
}

/// Causal attention of queries over a layer's keys and values, a block of query rows at a time:
/// each block's scores (`BLOCK_ROWS x` the keys it can see) stay in the core's cache from the
/// `q k^T` product through the softmax to the product with `v`, where a whole layer's scores
/// would go through memory five times.
///
/// Operands: `q` `[heads, t, d]` (rotated), `k` and `v` `[kv_heads, keys, d]`; query row `r` of
/// every head sees keys `0..seen[r]`; query head `h` reads KV head `h / (heads / kv_heads)`.
/// Output `[heads, t, d]`. Each block is computed alone on one thread, so the result does not
/// depend on the thread count.
#[derive(Clone, Debug)]
pub(crate) struct Attention {
    pub scale: f32,
    /// Keys each query row sees (at least 1, at most the keys).
    pub seen: Vec<usize>,
}

impl Attention {
    /// A step of `t` tokens after `past` cached ones: row `r` sees `past + r + 1` keys.
    pub(crate) fn step(past: usize, t: usize, scale: f32) -> Self {
        Attention {
            scale,
            seen: (past + 1..=past + t).collect(),
        }
    }
}

/// Query rows per block: 128 rows of scores over 4096 keys are 2 MiB, about a core's L2 (the
/// README gives the measurements behind the choice).
const BLOCK_ROWS: usize = 128;

thread_local! {
    /// Each worker's score block, reused across blocks and layers.
    static SCORES: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl Attention {
    /// The first row of each block: a block ends after [`BLOCK_ROWS`] rows, or before a row
    /// that sees more than `BLOCK_ROWS` keys beyond what the block's first row sees. Consecutive
    /// tokens (a prefill step) make blocks of `BLOCK_ROWS`; scattered ones (the tokens CacheBlend
    /// recomputes) make blocks of rows that see about as many keys, so that few scores are
    /// computed for keys a row does not see.
    fn block_starts(&self) -> Vec<usize> {
        let mut starts = Vec::new();
        for (r, &n) in self.seen.iter().enumerate() {
            match starts.last() {
                Some(&r0) if r - r0 < BLOCK_ROWS && n <= self.seen[r0] + BLOCK_ROWS => {}
                _ => starts.push(r),
            }
        }
        starts
    }

    /// Rows `r0..r0 + out.len() / d` of one head (`q` the head's rows, `k` and `v` its KV
    /// head's).
    fn block(&self, q: &[f32], k: &[f32], v: &[f32], r0: usize, out: &mut [f32]) {
        let d = q.len() / self.seen.len();
        let rows = out.len() / d;
        let seen = &self.seen[r0..r0 + rows];
        // Keys no row of the block sees are left out of its products.
        let keys = seen.iter().copied().max().unwrap_or(0);
        let sm = CausalSoftmax { scale: self.scale };
        SCORES.with_borrow_mut(|s| {
            s.resize(rows * keys, 0.0);
            let qm = Mat {
                data: &q[r0 * d..],
                rs: d,
                cs: 1,
            };
            // k^T: element (c, j) is channel c of key j.
            let kt = Mat {
                data: k,
                rs: 1,
                cs: d,
            };
            matmul(s, qm, kt, rows, d, keys);
            for (row, &n) in s.chunks_exact_mut(keys).zip(seen) {
                crate::arch::softmax_row(&sm, n, row);
            }
            let p = Mat {
                data: s,
                rs: keys,
                cs: 1,
            };
            let vm = Mat {
                data: v,
                rs: d,
                cs: 1,
            };
            matmul(out, p, vm, rows, keys, d);
        })
    }
}

impl CustomOp3 for Attention {
    fn name(&self) -> &'static str {
        "causal-attention"
    }

    fn cpu_fwd(
        &self,
        qs: &CpuStorage,
        ql: &Layout,
        ks: &CpuStorage,
        kl: &Layout,
        vs: &CpuStorage,
        vl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (q, k, v) = (f32s(qs, ql)?, f32s(ks, kl)?, f32s(vs, vl)?);
        let (heads, t, d) = ql.shape().dims3()?;
        let (kv_heads, total, dk) = kl.shape().dims3()?;
        let seen_ok = self.seen.len() == t && self.seen.iter().all(|&n| (1..=total).contains(&n));
        if vl.dims() != kl.dims() || dk != d || !seen_ok || kv_heads == 0 || heads % kv_heads != 0 {
            candle_core::bail!(
                "causal-attention: q {:?}, k {:?}, v {:?}, {} rows of seen keys",
                ql.dims(),
                kl.dims(),
                vl.dims(),
                self.seen.len()
            );
        }
        let group = heads / kv_heads;
        let mut out = vec![0.0f32; heads * t * d];
        let starts = self.block_starts();
        let mut blocks = Vec::with_capacity(heads * starts.len());
        for (h, mut oh) in out.chunks_mut(t * d).enumerate() {
            for (i, &r0) in starts.iter().enumerate() {
                let end = starts.get(i + 1).copied().unwrap_or(t);
                let (ob, rest) = oh.split_at_mut((end - r0) * d);
                blocks.push((h, r0, ob));
                oh = rest;
            }
        }
        blocks.into_par_iter().for_each(|(h, r0, ob)| {
            let kv = h / group;
            let span = kv * total * d..(kv + 1) * total * d;
            let (kh, vh) = (&k[span.clone()], &v[span]);
            self.block(&q[h * t * d..(h + 1) * t * d], kh, vh, r0, ob);
        });
        Ok((CpuStorage::F32(out), Shape::from((heads, t, d))))
    }
}

/// Calls `f` on the data of `t` (a contiguous f32 CPU tensor) without copying it.
pub(crate) fn with_f32s<R>(
    t: &candle_core::Tensor,
    f: impl FnOnce(&[f32]) -> R,
) -> candle_core::Result<R> {
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        candle_core::Storage::Cpu(s) => Ok(f(f32s(s, layout)?)),
        _ => candle_core::bail!("the runner works on CPU tensors"),
    }
}

/// The contiguous f32 data of a CPU tensor.
fn f32s<'a>(s: &'a CpuStorage, l: &Layout) -> candle_core::Result<&'a [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(v), Some((a, b))) => Ok(&v[a..b]),
        _ => candle_core::bail!("causal-attention needs contiguous f32 tensors"),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn exp_neg_matches_libm() {
        let mut worst = 0f64;
        let mut x = 0f32;
        while x > -87.0 {
            let want = f64::from(x).exp();
            let rel = ((f64::from(exp_neg(x)) - want) / want).abs();
            worst = worst.max(rel);
            x -= 0.000_37;
        }
        assert!(worst < 3e-7, "worst relative error {worst}");
        assert_eq!(exp_neg(0.0), 1.0);
        assert_eq!(exp_neg(-200.0), 0.0);
        assert_eq!(exp_neg(f32::NEG_INFINITY), 0.0);
    }

    #[test]
    fn rows_are_causal_softmaxes() {
        let op = CausalSoftmax { scale: 0.5 };
        // 2 heads x 3 step tokens x 5 cache rows, after 2 cached tokens.
        let mut v: Vec<f32> = (0..30).map(|i| ((i * 7) % 11) as f32 - 5.0).collect();
        let orig = v.clone();
        for (r, row) in v.chunks_mut(5).enumerate() {
            op.row(2 + r % 3 + 1, row);
        }
        for (r, (row, x)) in v.chunks(5).zip(orig.chunks(5)).enumerate() {
            let seen = 2 + r % 3 + 1;
            let z: f64 = x[..seen].iter().map(|&a| (0.5 * f64::from(a)).exp()).sum();
            for j in 0..5 {
                let want = if j < seen {
                    (0.5 * f64::from(x[j])).exp() / z
                } else {
                    0.0
                };
                assert!((f64::from(row[j]) - want).abs() < 1e-6, "row {r} col {j}");
            }
        }
    }

    #[test]
    fn silu_matches_its_definition() {
        for i in -2000..=2000 {
            let x = i as f32 * 0.05;
            let want = f64::from(x) / (1.0 + (-f64::from(x)).exp());
            let got = f64::from(silu(x));
            assert!(
                (got - want).abs() <= 1e-6 * want.abs().max(1e-3),
                "{x}: {got} vs {want}"
            );
        }
        assert_eq!(silu(-200.0), -0.0);
        assert_eq!(silu(200.0), 200.0);
    }

    /// Values in [-2, 2) from a fixed xorshift.
    pub(crate) fn data(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0
            })
            .collect()
    }

    /// Attention in f64, one query at a time; query row `r` sees keys `0..seen[r]`.
    fn naive(q: &[f32], k: &[f32], v: &[f32], dims: Dims, seen: &[usize]) -> Vec<f64> {
        let (heads, kv_heads, t, d) = dims;
        let total = k.len() / (kv_heads * d);
        let group = heads / kv_heads;
        let mut out = Vec::new();
        for h in 0..heads {
            let (kh, vh) = (&k[h / group * total * d..], &v[h / group * total * d..]);
            for r in 0..t {
                let qr = &q[(h * t + r) * d..][..d];
                let seen = seen[r];
                let s: Vec<f64> = (0..seen)
                    .map(|j| {
                        let dot: f64 = (0..d).map(|c| f64::from(qr[c] * kh[j * d + c])).sum();
                        dot / (d as f64).sqrt()
                    })
                    .collect();
                let max = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = s.iter().map(|x| (x - max).exp()).sum();
                for c in 0..d {
                    let o: f64 = (0..seen)
                        .map(|j| (s[j] - max).exp() / z * f64::from(vh[j * d + c]))
                        .sum();
                    out.push(o);
                }
            }
        }
        out
    }

    type Dims = (usize, usize, usize, usize);

    fn attend(q: &[f32], k: &[f32], v: &[f32], dims: Dims, seen: &[usize]) -> Vec<f32> {
        let (heads, kv_heads, t, d) = dims;
        let total = k.len() / (kv_heads * d);
        let dev = &candle_core::Device::Cpu;
        let q = candle_core::Tensor::from_slice(q, (heads, t, d), dev).unwrap();
        let k = candle_core::Tensor::from_slice(k, (kv_heads, total, d), dev).unwrap();
        let v = candle_core::Tensor::from_slice(v, (kv_heads, total, d), dev).unwrap();
        let op = Attention {
            scale: 1.0 / (d as f32).sqrt(),
            seen: seen.to_vec(),
        };
        let o = q.apply_op3_no_bwd(&k, &v, &op).unwrap();
        o.flatten_all().unwrap().to_vec1().unwrap()
    }

    #[test]
    fn attention_matches_a_naive_reference_on_any_thread_count() {
        // (heads, kv_heads, t, d, past): blocks that end inside a head, a step of one token, no
        // past, several query heads per KV head.
        for (heads, kv_heads, t, d, past) in
            [(3, 1, 130, 16, 70), (2, 2, 1, 8, 200), (4, 2, 64, 8, 0)]
        {
            let seen: Vec<usize> = (past + 1..=past + t).collect();
            check_attention((heads, kv_heads, t, d), past + t, &seen);
        }
        // Scattered rows, as CacheBlend recomputes them: far apart, close together, then a
        // run of consecutive ones (blocks cut by the keys they see, not only by row count).
        let mut seen: Vec<usize> = (0..150).map(|i| 1 + i * i % 700).collect();
        seen.sort_unstable();
        seen.dedup();
        seen.extend(701..=840);
        check_attention((3, 1, seen.len(), 8), 840, &seen);
    }

    #[test]
    fn blocks_are_cut_by_rows_and_by_keys_seen() {
        let step = Attention::step(1000, 300, 1.0);
        assert_eq!(step.block_starts(), [0, 128, 256]);
        let scattered = Attention {
            scale: 1.0,
            seen: vec![1, 2, 129, 130, 400, 401, 402, 2000],
        };
        assert_eq!(scattered.block_starts(), [0, 3, 4, 7]);
    }

    fn check_attention(dims: Dims, total: usize, seen: &[usize]) {
        let (heads, kv_heads, t, d) = dims;
        let q = data(heads * t * d, 1);
        let (k, v) = (data(kv_heads * total * d, 2), data(kv_heads * total * d, 3));
        let want = naive(&q, &k, &v, dims, seen);
        let got = attend(&q, &k, &v, dims, seen);
        let worst = got
            .iter()
            .zip(&want)
            .map(|(&a, b)| (f64::from(a) - b).abs())
            .fold(0.0, f64::max);
        assert!(worst < 1e-5, "{dims:?} of {total}: worst {worst}");
        let one = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        assert_eq!(
            one.install(|| attend(&q, &k, &v, dims, seen)),
            got,
            "{dims:?}"
        );
    }

    #[test]
    fn strided_matmul_matches_loops() {
        let (m, k, n) = (5, 7, 3);
        let a = data(m * k, 4);
        let b = data(n * k, 5); // read transposed: element (i, j) at j * k + i
        let mut dst = vec![f32::NAN; m * n];
        let am = Mat {
            data: &a,
            rs: k,
            cs: 1,
        };
        matmul(
            &mut dst,
            am,
            Mat {
                data: &b,
                rs: 1,
                cs: k,
            },
            m,
            k,
            n,
        );
        for i in 0..m {
            for j in 0..n {
                let want: f32 = (0..k).map(|c| a[i * k + c] * b[j * k + c]).sum();
                assert!((dst[i * n + j] - want).abs() < 1e-5, "({i}, {j})");
            }
        }
    }

    #[test]
    #[should_panic(expected = "too short")]
    fn matmul_refuses_short_operands() {
        let a = [0.0f32; 6];
        let mut dst = [0.0f32; 3]; // 2 x 2 needs 4
        matmul(
            &mut dst,
            Mat {
                data: &a,
                rs: 3,
                cs: 1,
            },
            Mat {
                data: &a,
                rs: 2,
                cs: 1,
            },
            2,
            3,
            2,
        );
    }
}
