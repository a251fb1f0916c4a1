//! The runner's own element-wise kernels, in place, each one pass where candle would take
//! several: the scaled, causally masked softmax of the attention scores (no exponentials for
//! masked entries) and the SwiGLU activation `silu(gate) * up`. Both use [`exp_neg`], a
//! vectorizing `e^x` for `x <= 0`.

use candle_core::{CpuStorage, InplaceOp1, InplaceOp2, Layout};
use rayon::prelude::*;

/// For scores `[rows, past + t]` whose row `r` belongs to step token `r % t`: row entries
/// `j <= past + r % t` become `softmax(scale * x)` over those entries, the others 0.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CausalSoftmax {
    pub past: usize,
    pub t: usize,
    pub scale: f32,
}

impl CausalSoftmax {
    #[inline(always)]
    pub(crate) fn row(&self, r: usize, row: &mut [f32]) {
        let (seen, masked) = row.split_at_mut(self.past + r % self.t + 1);
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

impl InplaceOp1 for CausalSoftmax {
    fn name(&self) -> &'static str {
        "causal-softmax"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let total = self.past + self.t;
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("causal-softmax needs contiguous scores");
        };
        let CpuStorage::F32(v) = storage else {
            candle_core::bail!("causal-softmax needs f32 scores");
        };
        let scores = &mut v[start..end];
        if layout.dims().last() != Some(&total) || scores.len() % (total * self.t) != 0 {
            candle_core::bail!(
                "causal-softmax: scores {:?} for t {} past {}",
                layout.dims(),
                self.t,
                self.past
            );
        }
        scores
            .par_chunks_mut(total)
            .enumerate()
            .for_each(|(r, row)| crate::arch::softmax_row(self, r, row));
        Ok(())
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

#[cfg(test)]
mod tests {
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
        let op = CausalSoftmax {
            past: 2,
            t: 3,
            scale: 0.5,
        };
        // 2 heads x 3 step tokens x 5 cache rows.
        let mut v: Vec<f32> = (0..30).map(|i| ((i * 7) % 11) as f32 - 5.0).collect();
        let orig = v.clone();
        for (r, row) in v.chunks_mut(5).enumerate() {
            op.row(r, row);
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
}
