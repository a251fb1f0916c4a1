//! Squared L2 distance and inner product over `f32` with a fixed summation order: 8 partial sums
//! (lane `l` takes elements `l, l+8, ...`), the tail added to lanes `0..`, then combined as
//! `((s0+s4)+(s2+s6)) + ((s1+s5)+(s3+s7))`. The fixed order makes results identical on every
//! platform, and the 8 independent lanes let the compiler vectorize without fast-math.

#[inline(always)]
fn combine(s: [f32; 8]) -> f32 {
    ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]))
}

/// `sum_i (a_i - b_i)^2`. Slices must have equal length (checked by callers).
#[inline(always)]
pub(crate) fn sq_l2(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut s = [0.0f32; 8];
    let ca = a.chunks_exact(8);
    let cb = b.chunks_exact(8);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            let d = x[l] - y[l];
            s[l] += d * d;
        }
    }
    for (l, (x, y)) in ra.iter().zip(rb).enumerate() {
        let d = x - y;
        s[l] += d * d;
    }
    combine(s)
}

/// `sum_i a_i * b_i`, same summation order as [`sq_l2`].
#[inline]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut s = [0.0f32; 8];
    let ca = a.chunks_exact(8);
    let cb = b.chunks_exact(8);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            s[l] += x[l] * y[l];
        }
    }
    for (l, (x, y)) in ra.iter().zip(rb).enumerate() {
        s[l] += x * y;
    }
    combine(s)
}

/// [`sq_l2`] of one point against `R` rows at once: `out[r] = sq_l2(a, rows[r])`, bit for bit
/// (each distance keeps its own 8 partial sums in the same order), but the point is loaded once
/// for `R` rows, and the `R` independent sums hide the latency of the additions.
#[inline(always)]
pub(crate) fn sq_l2_xn<const R: usize>(a: &[f32], rows: [&[f32]; R]) -> [f32; R] {
    let n = a.len();
    debug_assert!(rows.iter().all(|r| r.len() == n));
    let full = n - n % 8;
    let mut s = [[0.0f32; 8]; R];
    let mut i = 0;
    while i < full {
        let x = &a[i..i + 8];
        for (acc, row) in s.iter_mut().zip(rows.iter()) {
            let y = &row[i..i + 8];
            for l in 0..8 {
                let d = x[l] - y[l];
                acc[l] += d * d;
            }
        }
        i += 8;
    }
    for (acc, row) in s.iter_mut().zip(rows.iter()) {
        for (l, j) in (full..n).enumerate() {
            let d = a[j] - row[j];
            acc[l] += d * d;
        }
    }
    let mut out = [0.0f32; R];
    for (o, acc) in out.iter_mut().zip(s) {
        *o = combine(acc);
    }
    out
}

/// Squared distances of `point` to every row of `rows` (`[k, point.len()]` row-major) into
/// `out[..k]`; each equals [`sq_l2`] bit for bit.
///
/// On x86-64 with `std`, CPUs with AVX2 run the same code compiled for AVX2 (see
/// [`x86`]): the same IEEE operations in the same order, so the same bits, about twice as fast.
#[inline]
pub(crate) fn sq_l2_all(point: &[f32], rows: &[f32], out: &mut [f32]) {
    #[cfg(all(feature = "std", target_arch = "x86_64"))]
    if x86::sq_l2_all(point, rows, out) {
        return;
    }
    sq_l2_all_portable(point, rows, out)
}

/// [`sq_l2_xn`] for a dimension known at compile time (no bounds checks in the loop).
#[inline(always)]
fn sq_l2_fixed<const R: usize, const D: usize>(a: &[f32; D], rows: [&[f32; D]; R]) -> [f32; R] {
    let mut s = [[0.0f32; 8]; R];
    let full = D - D % 8;
    let mut i = 0;
    while i < full {
        for (acc, row) in s.iter_mut().zip(rows.iter()) {
            for l in 0..8 {
                let d = a[i + l] - row[i + l];
                acc[l] += d * d;
            }
        }
        i += 8;
    }
    for (acc, row) in s.iter_mut().zip(rows.iter()) {
        for (l, j) in (full..D).enumerate() {
            let d = a[j] - row[j];
            acc[l] += d * d;
        }
    }
    let mut out = [0.0f32; R];
    for (o, acc) in out.iter_mut().zip(s) {
        *o = combine(acc);
    }
    out
}

/// [`sq_l2_all_portable`] for `D`-dim points: 8 rows at a time, then one by one.
#[inline(always)]
fn sq_l2_all_fixed<const D: usize>(point: &[f32; D], rows: &[f32], out: &mut [f32]) {
    let k = rows.len() / D;
    let mut c = 0;
    while c + 8 <= k {
        let r: [&[f32; D]; 8] = core::array::from_fn(|j| {
            rows[(c + j) * D..(c + j + 1) * D]
                .try_into()
                .expect("row of D values")
        });
        out[c..c + 8].copy_from_slice(&sq_l2_fixed(point, r));
        c += 8;
    }
    while c < k {
        let r: &[f32; D] = rows[c * D..(c + 1) * D]
            .try_into()
            .expect("row of D values");
        out[c] = sq_l2_fixed(point, [r])[0];
        c += 1;
    }
}

#[inline(always)]
fn sq_l2_all_portable(point: &[f32], rows: &[f32], out: &mut [f32]) {
    if let Ok(p) = <&[f32; 64]>::try_from(point) {
        return sq_l2_all_fixed(p, rows, out);
    }
    if let Ok(p) = <&[f32; 32]>::try_from(point) {
        return sq_l2_all_fixed(p, rows, out);
    }
    let d = point.len();
    let k = rows.len() / d;
    let mut c = 0;
    while c + 8 <= k {
        let r: [&[f32]; 8] = core::array::from_fn(|j| &rows[(c + j) * d..(c + j + 1) * d]);
        out[c..c + 8].copy_from_slice(&sq_l2_xn(point, r));
        c += 8;
    }
    while c + 4 <= k {
        let r: [&[f32]; 4] = core::array::from_fn(|j| &rows[(c + j) * d..(c + j + 1) * d]);
        out[c..c + 4].copy_from_slice(&sq_l2_xn(point, r));
        c += 4;
    }
    while c < k {
        out[c] = sq_l2(point, &rows[c * d..(c + 1) * d]);
        c += 1;
    }
}

/// For every row `i` of `points` (`[n, center.len()]` row-major), lowers `best[i]` to
/// `sq_l2(points[i], center)` if that is smaller (the k-means++ seeding update).
#[inline]
pub(crate) fn min_sq_l2_update(center: &[f32], points: &[f32], best: &mut [f32]) {
    #[cfg(all(feature = "std", target_arch = "x86_64"))]
    if x86::min_sq_l2_update(center, points, best) {
        return;
    }
    min_sq_l2_update_portable(center, points, best)
}

#[inline(always)]
fn min_sq_l2_update_portable(center: &[f32], points: &[f32], best: &mut [f32]) {
    let d = center.len();
    let n = points.len() / d;
    let mut i = 0;
    // sq_l2 is symmetric bit for bit: (a - b)^2 == (b - a)^2 exactly.
    while i + 8 <= n {
        let r: [&[f32]; 8] = core::array::from_fn(|j| &points[(i + j) * d..(i + j + 1) * d]);
        for (b, nd) in best[i..i + 8].iter_mut().zip(sq_l2_xn(center, r)) {
            if nd < *b {
                *b = nd;
            }
        }
        i += 8;
    }
    while i < n {
        let nd = sq_l2(&points[i * d..(i + 1) * d], center);
        if nd < best[i] {
            best[i] = nd;
        }
        i += 1;
    }
}

/// Runtime dispatch to AVX2 builds of the portable kernels above.
///
/// The kernels are written once, in safe portable Rust, and marked `#[inline(always)]`; the
/// functions here only compile that same code with AVX2 enabled. Rust never reassociates or
/// contracts floating-point operations (no FMA is enabled either), so an AVX2 build computes
/// exactly what the portable build computes, bit for bit; the tests compare both.
#[cfg(all(feature = "std", target_arch = "x86_64"))]
#[allow(unsafe_code)]
pub(crate) mod x86 {
    #[target_feature(enable = "avx2")]
    fn sq_l2_all_avx2(point: &[f32], rows: &[f32], out: &mut [f32]) {
        super::sq_l2_all_portable(point, rows, out)
    }

    #[target_feature(enable = "avx2")]
    fn min_sq_l2_update_avx2(center: &[f32], points: &[f32], best: &mut [f32]) {
        super::min_sq_l2_update_portable(center, points, best)
    }

    /// Runs the AVX2 build of [`super::min_sq_l2_update`] and returns `true` if the CPU has
    /// AVX2, else returns `false` and does nothing.
    #[inline]
    pub(crate) fn min_sq_l2_update(center: &[f32], points: &[f32], best: &mut [f32]) -> bool {
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: as in `sq_l2_all`: AVX2 support was just checked.
            unsafe { min_sq_l2_update_avx2(center, points, best) };
            true
        } else {
            false
        }
    }

    /// Runs the AVX2 build of [`super::sq_l2_all`] and returns `true` if the CPU has AVX2,
    /// else returns `false` and does nothing.
    #[inline]
    pub(crate) fn sq_l2_all(point: &[f32], rows: &[f32], out: &mut [f32]) -> bool {
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: the only precondition of a `#[target_feature(enable = "avx2")]` function
            // is that the CPU supports AVX2, which was just checked.
            unsafe { sq_l2_all_avx2(point, rows, out) };
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The dispatched kernel (AVX2 where the CPU has it) equals the portable one bit for bit.
    #[test]
    fn dispatch_is_bit_exact() {
        let mut x = 0x1234_5678_9abc_def0u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 8.0
        };
        for d in [1usize, 3, 8, 13, 32, 64, 67] {
            for k in [1usize, 3, 4, 7, 64] {
                let p: alloc::vec::Vec<f32> = (0..d).map(|_| next()).collect();
                let rows: alloc::vec::Vec<f32> = (0..d * k).map(|_| next()).collect();
                let mut a = alloc::vec![0.0f32; k];
                let mut b = alloc::vec![0.0f32; k];
                sq_l2_all(&p, &rows, &mut a);
                sq_l2_all_portable(&p, &rows, &mut b);
                for c in 0..k {
                    assert_eq!(a[c].to_bits(), b[c].to_bits());
                    assert_eq!(
                        a[c].to_bits(),
                        sq_l2(&p, &rows[c * d..(c + 1) * d]).to_bits()
                    );
                }
                let mut best = alloc::vec![f32::INFINITY; k];
                min_sq_l2_update(&p, &rows, &mut best);
                for c in 0..k {
                    assert_eq!(best[c].to_bits(), b[c].to_bits());
                }
            }
        }
    }
}
