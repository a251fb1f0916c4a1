//! The `k`-th largest ranking key in time linear in the number of keys, for the top-k
//! (`topk.rs`): counting passes over the keys, each testing two thresholds aimed by
//! interpolation around the rank sought, narrow an interval of key values until few enough keys
//! lie in it to collect and rank them.
use alloc::vec::Vec;

#[cfg(all(feature = "simd", target_arch = "x86_64"))]
use crate::arch;
use crate::order::{key_value, order_key};

/// For `1 <= k <= keys.len()`: the `k`-th largest key `tau`, and how many keys equal to `tau` the
/// `k` best hold (the others rank above `tau`).
///
/// Bracketing over the key values between the smallest and largest key: each counting pass
/// (vectorized) tests two keys aimed by interpolation around the rank sought ([`aim`]), and
/// once 32 or fewer keys lie in the interval they are collected and ranked ([`nth_largest`]).
#[inline(always)]
pub(super) fn kth_key(keys: &[u32], k: usize, range: Option<(u32, u32)>) -> (u32, usize) {
    let (lo, hi) = range.unwrap_or_else(|| {
        let (mut lo, mut hi) = (u32::MAX, 0u32);
        for &x in keys {
            lo = lo.min(x);
            hi = hi.max(x);
        }
        (lo, hi)
    });
    // Invariants: at least k keys are >= a (ca of them), fewer than k are >= b (cb of them).
    let (mut a, mut b) = (u64::from(lo), u64::from(hi) + 1);
    let (mut ca, mut cb) = (keys.len(), 0usize);
    // A first bracket from two order statistics of a 64-key sample around the expected rank; kept where
    // the counts confirm it (a sample is a guess, the counts are exact).
    let n = keys.len();
    if n >= 1024 {
        let stride = n / 64;
        let sample: [u32; 64] = core::array::from_fn(|i| keys[i * stride]);
        let r = k * 64 / n;
        let [ga, gb] = nth_largest(&sample, [(r + 6).min(63), r.saturating_sub(6)]);
        let inside = |g: u64| (g > a && g < b).then_some(g);
        let (guess_a, guess_b) = (inside(u64::from(ga)), inside(u64::from(gb) + 1));
        if let Some(t) = guess_a.or(guess_b) {
            // Both guesses counted in one pass (a missing one stands in for the other).
            let (t1, t2) = (t, guess_b.unwrap_or(t));
            let (c1, c2) = count_ge2(keys, t1 as u32, t2 as u32);
            if guess_a.is_some() && c1 >= k {
                (a, ca) = (t1, c1);
            }
            if guess_b.is_some() && c2 < k {
                (b, cb) = (t2, c2);
            }
        }
    }
    // Once the interval holds a small share of the keys, they are collected once and the
    // bisection counts only them: for a < t < b, #keys >= t is cb0 + #work >= t.
    let mut work: Vec<u32> = Vec::new();
    let mut in_work = false;
    let mut cb0 = 0usize;
    while b - a > 1 {
        let here: &[u32] = if in_work { &work } else { keys };
        if ca - cb <= 32 {
            let c = collect_range(here, a as u32, (b - a - 1) as u32, ca - cb);
            // The k-th largest key overall is the `need`-th largest of `c`.
            let need = k - cb;
            let [tau] = nth_largest(&c, [need - 1]);
            let above = c.iter().filter(|&&x| x > tau).count();
            return (tau, need - above);
        }
        if !in_work && (ca - cb) * 4 <= n {
            work = collect_range(keys, a as u32, (b - a - 1) as u32, ca - cb);
            in_work = true;
            cb0 = cb;
            continue;
        }
        // Two thresholds per counting pass, aimed by interpolation a little above and below
        // the rank sought (falling back to halving), each of which moves one end.
        let (t1, t2) = aim(a, b, ca, cb, k);
        let (c1, c2) = count_ge2(here, t1 as u32, t2 as u32);
        let base = if in_work { cb0 } else { 0 };
        for (t, c) in [(t1, base + c1), (t2, base + c2)] {
            if c >= k {
                if t > a {
                    (a, ca) = (t, c);
                }
            } else if t < b {
                (b, cb) = (t, c);
            }
        }
    }
    (a as u32, k - cb)
}

/// The keys `x` with `a <= x <= a + w` (one unsigned compare: `x - a <= w`), in order; there
/// are exactly `count` of them.
#[inline]
pub(super) fn collect_range(keys: &[u32], a: u32, w: u32, count: usize) -> Vec<u32> {
    let _ = count; // a capacity hint for the vectorized kernel
    #[cfg(all(feature = "simd", target_arch = "x86_64"))]
    if let Some(v) = arch::collect_range(keys, a, w, count) {
        return v;
    }
    keys.iter()
        .copied()
        .filter(|&x| x.wrapping_sub(a) <= w)
        .collect()
}

/// The `js[i]`-th largest (from 0) of at most 64 keys (each `js[i] < v.len()`).
#[inline]
fn nth_largest<const N: usize>(v: &[u32], js: [usize; N]) -> [u32; N] {
    #[cfg(all(feature = "simd", target_arch = "x86_64"))]
    if let Some(x) = arch::nth_largest(v, &js) {
        return x;
    }
    let mut v = v.to_vec();
    v.sort_unstable();
    js.map(|j| v[v.len() - 1 - j])
}

/// A key strictly between `a` and `b` (`b - a >= 2`): the key of the midpoint of their scores when
/// that is strictly inside (so that bisection halves the score range, not the key range, which
/// near 0 is mostly tiny magnitudes), else the midpoint of the keys.
#[inline]
fn split(a: u64, b: u64) -> u64 {
    let key_mid = a + (b - a) / 2;
    let (va, vb) = (key_value(a as u32), key_value((b - 1) as u32));
    if va.is_finite() && vb.is_finite() {
        let m = ((f64::from(va) + f64::from(vb)) * 0.5) as f32;
        let km = u64::from(order_key(m));
        if km > a && km < b {
            return km;
        }
    }
    key_mid
}

/// Two keys `a < t1 <= t2 < b` (`b - a >= 2`) to count at in one pass: where the scores
/// between `a` and `b` are finite, interpolated as if the `ca - cb` keys in `[a, b)` were spread
/// evenly in score, at a margin of `max(12, width / 16)` keys either side of the `k`-th;
/// otherwise, or where that falls outside, [`split`]'s halving point.
#[inline]
fn aim(a: u64, b: u64, ca: usize, cb: usize, k: usize) -> (u64, u64) {
    let half = split(a, b);
    let (va, vb) = (key_value(a as u32), key_value((b - 1) as u32));
    if !(va.is_finite() && vb.is_finite()) || ca <= cb {
        return (half, half);
    }
    let width = (ca - cb) as f64;
    let margin = (width / 16.0).max(12.0);
    let span = f64::from(vb) - f64::from(va);
    let at = |keys_from_top: f64| {
        let f = (keys_from_top / width).clamp(0.0, 1.0);
        let key = u64::from(order_key((f64::from(vb) - f * span) as f32));
        if key > a && key < b {
            key
        } else {
            half
        }
    };
    let need = (k - cb) as f64;
    let (t1, t2) = (at(need + margin), at(need - margin));
    (t1.min(t2), t1.max(t2))
}

/// How many keys are `>= t1` and how many `>= t2`, in one pass.
#[inline]
pub(super) fn count_ge2(keys: &[u32], t1: u32, t2: u32) -> (usize, usize) {
    #[cfg(all(feature = "simd", target_arch = "x86_64"))]
    if let Some(n) = arch::count_ge2(keys, t1, t2) {
        return n;
    }
    keys.iter().fold((0, 0), |(c1, c2), &x| {
        (c1 + usize::from(x >= t1), c2 + usize::from(x >= t2))
    })
}

#[cfg(test)]
mod tests {
    use super::super::test_util::Xs;
    use super::*;

    #[test]
    fn nth_largest_equals_sorting() {
        let mut x = Xs(7);
        // Every length up to 64 and every rank, or a few of each under Miri, which interprets
        // every step.
        let (lens, rank_step): (Vec<usize>, usize) = if cfg!(miri) {
            (vec![1, 2, 17, 64], 7)
        } else {
            ((1..=64).collect(), 1)
        };
        for n in lens {
            for spread in [3u64, 1 << 32] {
                let v: Vec<u32> = (0..n).map(|_| (x.next() % spread) as u32).collect();
                let mut sorted = v.clone();
                sorted.sort_unstable_by(|a, b| b.cmp(a));
                for (j, &want) in sorted.iter().enumerate().step_by(rank_step) {
                    assert_eq!(nth_largest(&v, [j]), [want], "n {n} j {j}");
                    let i = n - 1 - j;
                    assert_eq!(nth_largest(&v, [j, i]), [want, sorted[i]], "n {n} j {j}");
                }
            }
        }
    }
}
