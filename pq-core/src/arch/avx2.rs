//! AVX2: no hand-written kernels, only the portable column sums (`crate::sums`) compiled with
//! AVX2 enabled, which is what brings k-means training under its time target (`spec/PQ.md` §6).

/// Runs `f` in a function compiled with AVX2 enabled; an `#[inline(always)]` closure is
/// compiled into it, and so is the `#[inline(always)]` code it calls.
#[target_feature(enable = "avx2")]
pub(super) fn run<R>(f: impl FnOnce() -> R) -> R {
    f()
}
