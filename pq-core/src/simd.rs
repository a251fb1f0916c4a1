//! Squared L2 distance and inner product over `f32` with a fixed summation order: 8 partial sums
//! (lane `l` takes elements `l, l+8, ...`), the tail added to lanes `0..`, then combined as
//! `((s0+s4)+(s2+s6)) + ((s1+s5)+(s3+s7))`. The fixed order makes results identical on every
//! platform, and the 8 independent lanes let the compiler vectorize without fast-math.

#[inline]
fn combine(s: [f32; 8]) -> f32 {
    ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]))
}

/// `sum_i (a_i - b_i)^2`. Slices must have equal length (checked by callers).
#[inline]
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
