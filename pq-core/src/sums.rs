//! Squared L2 distances and inner products over `f32`, all with one summation order: **in dim
//! order, starting from `0.0`**: `s = 0; for d in 0..D { s += (a_d - b_d)^2 }` (resp.
//! `s += a_d * b_d`), every operation an IEEE `f32` operation (no fused multiply-add). The
//! fixed order makes results identical on every platform; a port reproduces them with a plain loop.
//!
//! The hot kernels compute many such sums at once against a *transposed* matrix (`[D, n]`, one
//! column per vector): the sums run in dim order along each column and are independent across
//! columns, so they vectorize across columns without changing any sum's order. With the `simd`
//! feature on x86-64, CPUs with AVX2 run the same code compiled for AVX2 (`crate::arch`).
/// `sum_d (a_d - b_d)^2` in dim order. Slices must have equal length (checked by callers).
#[inline]
pub(crate) fn sq_l2(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut s = 0.0f32;
    for (x, y) in a.iter().zip(b) {
        let d = x - y;
        s += d * d;
    }
    s
}

/// `sum_d a_d * b_d` in dim order.
#[inline]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut s = 0.0f32;
    for (x, y) in a.iter().zip(b) {
        s += x * y;
    }
    s
}

/// [`dot`] of `q` with 8 rows at once: 8 independent sums (each in dim order, equal to [`dot`]
/// bit for bit), so the additions of different rows overlap instead of waiting on each other.
#[inline]
pub(crate) fn dot_x8(q: &[f32], rows: [&[f32]; 8]) -> [f32; 8] {
    let mut acc = [0.0f32; 8];
    for (d, &x) in q.iter().enumerate() {
        for (a, r) in acc.iter_mut().zip(rows.iter()) {
            *a += x * r[d];
        }
    }
    acc
}

/// [`sq_l2`] of 8 pairs at once: 8 independent sums (each in dim order, equal to [`sq_l2`] bit
/// for bit), so that their additions overlap instead of waiting on each other.
#[inline]
pub(crate) fn sq_l2_x8(a: [&[f32]; 8], b: [&[f32]; 8]) -> [f32; 8] {
    let d = a[0].len();
    assert!(a.iter().chain(&b).all(|r| r.len() == d));
    let mut acc = [0.0f32; 8];
    for j in 0..d {
        for l in 0..8 {
            let t = a[l][j] - b[l][j];
            acc[l] += t * t;
        }
    }
    acc
}

/// The index of the first smallest of `v` under `<` (NaN never smaller), from `start`: the
/// first `c` with `v[c] < v[best]` strictly, scanning in order, as a loop
/// `if v[c] < best_v { best = c }` would find it, but by a vectorizable minimum first.
#[inline]
pub(crate) fn argmin_from(v: &[f32], start: usize) -> usize {
    let mut lanes = [f32::INFINITY; 8];
    let mut ch = v.chunks_exact(8);
    for c in &mut ch {
        for l in 0..8 {
            lanes[l] = if c[l] < lanes[l] { c[l] } else { lanes[l] };
        }
    }
    let mut m = lanes
        .iter()
        .fold(f32::INFINITY, |m, &x| if x < m { x } else { m });
    for &x in ch.remainder() {
        if x < m {
            m = x;
        }
    }
    if m < v[start] {
        v.iter().position(|&x| x == m).unwrap_or(start)
    } else {
        start
    }
}

/// Transposes `rows` (`[n, d]` row-major) into `[d, n]` row-major.
pub(crate) fn transpose(rows: &[f32], d: usize) -> alloc::vec::Vec<f32> {
    let n = rows.len() / d;
    let mut t = alloc::vec![0.0f32; rows.len()];
    for (i, r) in rows.chunks_exact(d).enumerate() {
        for (j, &v) in r.iter().enumerate() {
            t[j * n + i] = v;
        }
    }
    t
}

/// What a kernel sums per dim.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    /// `(x - c)^2`: squared L2 distance.
    SqL2,
    /// `x * c`: inner product.
    Dot,
}

/// `out[c] = sum_d op(x_d, cols[d * n + c])` for every column `c < n` of `cols` (`[x.len(), n]`
/// row-major), each sum in dim order from `0.0`: equal bit for bit to [`sq_l2`] / [`dot`] of `x`
/// and column `c`.
#[inline]
pub(crate) fn columns(op: Op, x: &[f32], cols: &[f32], out: &mut [f32]) {
    debug_assert_eq!(cols.len(), x.len() * out.len());
    // The AVX2 build of the same code: Rust neither reassociates nor contracts `f32`
    // operations, so it computes the portable results bit for bit (`kernels_are_bit_exact`).
    #[cfg(all(feature = "simd", target_arch = "x86_64"))]
    if crate::arch::with_avx2(
        #[inline(always)]
        || columns_portable(op, x, cols, out),
    )
    .is_some()
    {
        return;
    }
    columns_portable(op, x, cols, out)
}

#[inline(always)]
fn columns_portable(op: Op, x: &[f32], cols: &[f32], out: &mut [f32]) {
    match op {
        Op::SqL2 => columns_op(x, cols, out, |a, c| {
            let t = a - c;
            t * t
        }),
        Op::Dot => columns_op(x, cols, out, |a, c| a * c),
    }
}

#[inline(always)]
fn columns_op(x: &[f32], cols: &[f32], out: &mut [f32], f: impl Fn(f32, f32) -> f32 + Copy) {
    let n = out.len();
    let mut c0 = 0;
    while c0 + 64 <= n {
        block::<64>(x, cols, n, c0, out, f);
        c0 += 64;
    }
    while c0 + 8 <= n {
        block::<8>(x, cols, n, c0, out, f);
        c0 += 8;
    }
    while c0 < n {
        block::<1>(x, cols, n, c0, out, f);
        c0 += 1;
    }
}

/// Columns `c0..c0 + B`: `B` independent sums kept in registers while the dims are walked.
#[inline(always)]
fn block<const B: usize>(
    x: &[f32],
    cols: &[f32],
    n: usize,
    c0: usize,
    out: &mut [f32],
    f: impl Fn(f32, f32) -> f32,
) {
    let mut acc = [0.0f32; B];
    for (d, &a) in x.iter().enumerate() {
        let row: &[f32; B] = cols[d * n + c0..d * n + c0 + B]
            .try_into()
            .expect("B columns");
        for l in 0..B {
            acc[l] += f(a, row[l]);
        }
    }
    out[c0..c0 + B].copy_from_slice(&acc);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A xorshift64 stream from `seed` (non-zero).
    fn xorshift(mut s: u64) -> impl FnMut() -> u64 {
        move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        }
    }

    /// [`argmin_from`] equals the plain loop it replaces (first strictly smaller, in order,
    /// from `start`), with ties, signed zeros, infinities and NaN.
    #[test]
    fn argmin_from_equals_the_loop() {
        let mut next = xorshift(0x0123_4567_89ab_cdef);
        // Fewer draws under Miri, which interprets every step.
        let draws = if cfg!(miri) { 20 } else { 300 };
        for len in [1usize, 5, 8, 9, 64, 67] {
            for _ in 0..draws {
                let v: alloc::vec::Vec<f32> = (0..len)
                    .map(|_| match next() % 12 {
                        0 => f32::NAN,
                        1 => -0.0,
                        2 => 0.0,
                        3 => f32::INFINITY,
                        _ => (next() % 6) as f32,
                    })
                    .collect();
                let start = (next() as usize) % len;
                let mut best = start;
                for (c, &x) in v.iter().enumerate() {
                    if c != start && x < v[best] {
                        best = c;
                    }
                }
                assert_eq!(argmin_from(&v, start), best, "{v:?} from {start}");
            }
        }
    }

    /// The dispatched kernel (AVX2 where the CPU has it) equals the portable one and the scalar
    /// definitions bit for bit.
    #[test]
    fn kernels_are_bit_exact() {
        let mut bits = xorshift(0x1234_5678_9abc_def0);
        let mut next = || ((bits() >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 8.0;
        // A subset of the shapes under Miri, which interprets every step.
        let (dims, cols): (&[usize], &[usize]) = if cfg!(miri) {
            (&[1, 3, 13], &[1, 8, 13, 75])
        } else {
            (&[1, 3, 8, 13, 32, 64, 67], &[1, 3, 8, 13, 64, 75, 200])
        };
        for &d in dims {
            for &n in cols {
                let x: alloc::vec::Vec<f32> = (0..d).map(|_| next()).collect();
                let rows: alloc::vec::Vec<f32> = (0..d * n).map(|_| next()).collect();
                let cols = transpose(&rows, d);
                for op in [Op::SqL2, Op::Dot] {
                    let mut a = alloc::vec![0.0f32; n];
                    let mut b = alloc::vec![0.0f32; n];
                    columns(op, &x, &cols, &mut a);
                    columns_portable(op, &x, &cols, &mut b);
                    for c in 0..n {
                        let r = &rows[c * d..(c + 1) * d];
                        let want = match op {
                            Op::SqL2 => sq_l2(&x, r),
                            Op::Dot => dot(&x, r),
                        };
                        assert_eq!(a[c].to_bits(), b[c].to_bits());
                        assert_eq!(a[c].to_bits(), want.to_bits());
                    }
                    if op == Op::SqL2 && n >= 8 {
                        let r: [&[f32]; 8] = core::array::from_fn(|i| &rows[i * d..(i + 1) * d]);
                        let xs = [x.as_slice(); 8];
                        let got = sq_l2_x8(xs, r);
                        for (i, g) in got.iter().enumerate() {
                            assert_eq!(g.to_bits(), sq_l2(&x, r[i]).to_bits());
                        }
                    }
                    if n >= 8 {
                        let r: [&[f32]; 8] = core::array::from_fn(|i| &rows[i * d..(i + 1) * d]);
                        let got = dot_x8(&x, r);
                        for (i, g) in got.iter().enumerate() {
                            assert_eq!(g.to_bits(), dot(&x, r[i]).to_bits());
                        }
                    }
                }
            }
        }
    }
}
