//! The crate's only unsafe code:
//! - the element-wise kernels of [`crate::ops`] compiled a second time for AVX2 and picked at run
//!   time. The code is the same (`#[inline(always)]` bodies), only the vector width changes: Rust
//!   never fuses multiply-adds, so both give the same bits;
//! - [`matmul`], the `gemm` crate's single-threaded f32 product (the kernel candle's matmul runs)
//!   on slices whose extents are checked first, for the attention that keeps its scores in cache.
#![allow(unsafe_code)]

use crate::ops::{CausalSoftmax, SwiGluKernel};

/// `true` if the running CPU has AVX2 (the detection is cached by std).
#[cfg(target_arch = "x86_64")]
fn avx2() -> bool {
    std::arch::is_x86_feature_detected!("avx2")
}

/// [`CausalSoftmax::row`], on AVX2 where the CPU has it.
pub(crate) fn softmax_row(op: &CausalSoftmax, seen: usize, row: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: the CPU has AVX2, checked just above; the function has no other requirement.
        return unsafe { softmax_row_avx2(op, seen, row) };
    }
    op.row(seen, row)
}

/// [`SwiGluKernel::apply`], on AVX2 where the CPU has it.
pub(crate) fn swiglu(gate: &mut [f32], up: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: as in `softmax_row`.
        return unsafe { swiglu_avx2(gate, up) };
    }
    SwiGluKernel::apply(gate, up)
}

/// A matrix operand: `data[rs * i + cs * j]` is element `(i, j)`.
#[derive(Clone, Copy)]
pub(crate) struct Mat<'a> {
    pub data: &'a [f32],
    pub rs: usize,
    pub cs: usize,
}

impl Mat<'_> {
    /// Whether every element of a `rows x cols` matrix lies inside `data`.
    fn holds(&self, rows: usize, cols: usize) -> bool {
        let last = (rows.saturating_sub(1))
            .checked_mul(self.rs)
            .zip((cols.saturating_sub(1)).checked_mul(self.cs))
            .and_then(|(a, b)| a.checked_add(b));
        rows == 0 || cols == 0 || last.is_some_and(|l| l < self.data.len())
    }
}

/// `dst = a b` for `a` `m x k`, `b` `k x n` and `dst` `m x n` row-major (row stride `n`), on
/// this thread. Panics if an operand does not hold its extent (a bug of the caller).
pub(crate) fn matmul(dst: &mut [f32], a: Mat<'_>, b: Mat<'_>, m: usize, k: usize, n: usize) {
    let d = Mat {
        data: dst,
        rs: n,
        cs: 1,
    };
    assert!(
        d.holds(m, n) && a.holds(m, k) && b.holds(k, n),
        "matmul {m}x{k}x{n}: an operand is too short"
    );
    if m == 0 || n == 0 {
        return;
    }
    let s = |x: usize| x as isize;
    // SAFETY: every element gemm reads or writes (`(i, j)` at `rs * i + cs * j` for `i` below
    // the rows and `j` below the columns of each operand) lies inside its slice, checked just
    // above, and `dst` is borrowed mutably, so it aliases neither input. With `read_dst` false
    // the destination's old values are not read; `Parallelism::None` runs on this thread.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            s(n),
            false,
            a.data.as_ptr(),
            s(a.cs),
            s(a.rs),
            b.data.as_ptr(),
            s(b.cs),
            s(b.rs),
            0.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn softmax_row_avx2(op: &CausalSoftmax, seen: usize, row: &mut [f32]) {
    op.row(seen, row)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn swiglu_avx2(gate: &mut [f32], up: &[f32]) {
    SwiGluKernel::apply(gate, up)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values in [-20, 20).
    fn data(n: usize) -> Vec<f32> {
        crate::ops::tests::data(n, 0x9e37_79b9_7f4a_7c15)
            .iter()
            .map(|x| x * 10.0)
            .collect()
    }

    #[test]
    fn dispatched_kernels_give_the_portable_bits() {
        let op = CausalSoftmax { scale: 0.125 };
        let x = data(5 * 42);
        let (mut a, mut b) = (x.clone(), x.clone());
        for (r, (ra, rb)) in a.chunks_mut(42).zip(b.chunks_mut(42)).enumerate() {
            softmax_row(&op, 38 + r, ra);
            op.row(38 + r, rb);
        }
        assert_eq!(a, b);
        let (up, mut g1) = (
            data(1001),
            data(1001).iter().map(|v| v * 0.3).collect::<Vec<_>>(),
        );
        let mut g2 = g1.clone();
        swiglu(&mut g1, &up);
        SwiGluKernel::apply(&mut g2, &up);
        assert_eq!(g1, g2);
    }
}
