//! Every SIMD kernel of the crate: x86-64 AVX2 ([`avx2`]) and AVX-512 ([`avx512`]), picked at
//! run time. Compiled only with the `simd` feature on x86-64; the only module of the crate that
//! may use `unsafe` (the crate root denies `unsafe_code` everywhere else).
//!
//! The functions here are the safe entry points. Each checks that the CPU has every feature its
//! kernel needs and returns `None` (or `false`) when it does not; the caller then runs its
//! portable code. Every kernel computes exactly what that portable code computes: the same `f32`
//! operations in the same order (Rust neither reassociates nor contracts floating-point
//! operations, and no kernel uses fused multiply-add), and exact integer compares, counts and
//! compaction. Tests beside the portable code compare the two. Kernels that reinterpret pairs of
//! `u16` codes as one `u32` lane rely on x86-64 being little-endian (a correctness assumption,
//! not a safety one).
//!
//! This module imports only leaf modules (`crate::order`); the stages that use it (`sums`,
//! `search`) pass plain slices and arrays in.
//!
//! # Safety invariants
//!
//! Every `unsafe` block in `arch` names the invariants below that it relies on.
//!
//! 1. **Features detected.** A `#[target_feature(enable = ...)]` function is called from code
//!    compiled without those features only after `is_x86_feature_detected!` has reported, on
//!    this CPU, every feature it enables. (Calls between functions that enable the same
//!    features, and intrinsics called from them, need no `unsafe`.)
//! 2. **Whole registers in bounds.** Every unaligned 64-byte load or store goes through
//!    `avx512::load` / `avx512::store`, which take a reference to exactly 64 bytes of plain
//!    lanes (`[u16; 32]`, `[u32; 16]`, `[f32; 16]`, checked at compile time), so the access
//!    stays inside one live Rust object. Unaligned accesses have no alignment requirement.
//! 3. **Masked loads read only live lanes.** A masked load from a slice of `len` elements, at
//!    most one register's lanes, enables exactly the low `len` lanes; masked-off lanes are
//!    neither read nor able to fault.
//! 4. **Initialized before exposed.** A register stored into a `Vec`'s spare capacity fits in
//!    that capacity, and the length then grows by at most the lanes that store wrote; the lanes
//!    are plain integers, for which every bit pattern is a valid value.

mod avx2;
mod avx512;

use alloc::vec;
use alloc::vec::Vec;

/// Runs `f` compiled with AVX2 enabled and returns its result, or `None` (without running it)
/// if the CPU lacks AVX2. `f` should be an `#[inline(always)]` closure over
/// `#[inline(always)]` portable code, so that the portable code itself is what gets compiled
/// with AVX2.
#[inline]
pub(crate) fn with_avx2<R>(f: impl FnOnce() -> R) -> Option<R> {
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: (1) AVX2, the one feature `run` enables, was just detected.
        Some(unsafe { avx2::run(f) })
    } else {
        None
    }
}

/// [`with_avx2`] for AVX-512F: runs `f` compiled with AVX-512F enabled (where unsigned 32-bit
/// min/max and compares vectorize, which SSE2 lacks), or returns `None`.
#[inline]
pub(crate) fn with_avx512f<R>(f: impl FnOnce() -> R) -> Option<R> {
    if has_avx512f() {
        // SAFETY: (1) AVX-512F, the one feature `run` enables, was just detected.
        Some(unsafe { avx512::run(f) })
    } else {
        None
    }
}

#[inline]
fn has_avx512f() -> bool {
    std::is_x86_feature_detected!("avx512f")
}

/// The rows of an `m = 2` score table (`2^b` entries each) as two 64-entry arrays, the form
/// the `m = 2` kernels take, or `None` if a row is empty, longer than 64 or of another length
/// than the other. Entries past `2^b` repeat the row's first: checked codes never look them
/// up, and they move no row's minimum or maximum.
#[inline(always)]
fn m2_rows(rows: [&[f32]; 2]) -> Option<[[f32; 64]; 2]> {
    let k = rows[0].len();
    if k == 0 || k > 64 || rows[1].len() != k {
        return None;
    }
    let mut padded = [[rows[0][0]; 64], [rows[1][0]; 64]];
    padded[0][..k].copy_from_slice(rows[0]);
    padded[1][..k].copy_from_slice(rows[1]);
    Some(padded)
}

/// The scores of `m = 2` tokens (`codes`, token-major pairs, every code below the rows'
/// length) from the two rows of a score table: token `t` scores
/// `(0.0 + rows[0][c0]) + rows[1][c1]`, into `out` (`codes.len() / 2` values). Returns `false`,
/// with `out` untouched, without AVX-512F or for rows longer than 64.
#[inline]
pub(crate) fn scan_m2(codes: &[u16], rows: [&[f32]; 2], out: &mut [f32]) -> bool {
    debug_assert_eq!(out.len(), codes.len() / 2);
    if !has_avx512f() {
        return false;
    }
    let Some(rows) = m2_rows(rows) else {
        return false;
    };
    // SAFETY: (1) AVX-512F was just detected.
    unsafe { avx512::scan_m2(codes, &rows, out) };
    true
}

/// The ranking keys (`crate::order::order_key`) of the scores [`scan_m2`] computes, with their
/// `(min, max)`, or `None` where [`scan_m2`] would return `false`.
#[inline]
pub(crate) fn keys_m2(codes: &[u16], rows: [&[f32]; 2]) -> Option<(Vec<u32>, (u32, u32))> {
    if !has_avx512f() {
        return None;
    }
    let rows = m2_rows(rows)?;
    let mut keys = vec![0u32; codes.len() / 2];
    // SAFETY: (1) AVX-512F was just detected.
    let range = unsafe { avx512::keys_m2(codes, &rows, &mut keys) };
    Some((keys, range))
}

/// Appends to `out`, ascending, `base + i` for the `k` best tokens `i` of `codes` (`m = 2`,
/// scored as [`scan_m2`] does) in the order of `spec/PQ.md` §5.3, and returns `true`; or
/// returns `false` with `out` untouched: without AVX-512 F, BW and VBMI2, BMI2 and POPCNT, for
/// rows longer than 64, outside `512 <= T` and `0 < k < T`, or when the kernel declines (the
/// rows do not allow exact fixed-point keys, or its sampled bracket misses the `k`-th key).
/// When it runs, the result is exactly the portable top-k's.
#[inline]
pub(crate) fn take_best_m2(
    codes: &[u16],
    rows: [&[f32]; 2],
    base: u32,
    k: usize,
    out: &mut Vec<u32>,
) -> bool {
    let n = codes.len() / 2;
    if n >= avx512::BRACKET_MIN_TOKENS
        && 0 < k
        && k < n
        && has_avx512f()
        && std::is_x86_feature_detected!("avx512bw")
        && std::is_x86_feature_detected!("avx512vbmi2")
        && std::is_x86_feature_detected!("bmi2")
        && std::is_x86_feature_detected!("popcnt")
    {
        let Some(rows) = m2_rows(rows) else {
            return false;
        };
        // SAFETY: (1) every feature `take_best_m2_fixed` enables was just detected.
        unsafe { avx512::take_best_m2_fixed(codes, &rows, base, k, out) }
    } else {
        false
    }
}

/// The `js[i]`-th largest (from 0) of at most 64 keys `v` (every `js[i] < v.len()`), or `None`
/// without AVX-512F and POPCNT.
#[inline]
pub(crate) fn nth_largest<const N: usize>(v: &[u32], js: &[usize; N]) -> Option<[u32; N]> {
    if has_avx512f() && std::is_x86_feature_detected!("popcnt") {
        // SAFETY: (1) AVX-512F and POPCNT, the features the kernel enables, were just detected.
        Some(unsafe { avx512::nth_largest(v, *js) })
    } else {
        None
    }
}

/// The bitwise OR of all codes, or `None` without AVX-512F.
#[inline]
pub(crate) fn or_all(codes: &[u16]) -> Option<u16> {
    if has_avx512f() {
        // SAFETY: (1) AVX-512F was just detected.
        Some(unsafe { avx512::or_all(codes) })
    } else {
        None
    }
}

/// `(#keys >= t1, #keys >= t2)`, or `None` without AVX-512F.
#[inline]
pub(crate) fn count_ge2(keys: &[u32], t1: u32, t2: u32) -> Option<(usize, usize)> {
    if has_avx512f() {
        // SAFETY: (1) AVX-512F was just detected.
        Some(unsafe { avx512::count_ge2(keys, t1, t2) })
    } else {
        None
    }
}

/// The keys `x` with `a <= x <= a + w` (`x - a <= w` in wrapping arithmetic), in order, of
/// which there are exactly `count`; or `None` without AVX-512F.
#[inline]
pub(crate) fn collect_range(keys: &[u32], a: u32, w: u32, count: usize) -> Option<Vec<u32>> {
    if has_avx512f() {
        // SAFETY: (1) AVX-512F was just detected.
        Some(unsafe { avx512::collect_range(keys, a, w, count) })
    } else {
        None
    }
}

/// Appends `base + i`, ascending, for every key `> tau` and the first `ties` keys `== tau`
/// (`k` in all), and returns `true`; returns `false` with `out` untouched without AVX-512F.
#[inline]
pub(crate) fn emit(
    keys: &[u32],
    tau: u32,
    ties: usize,
    base: u32,
    k: usize,
    out: &mut Vec<u32>,
) -> bool {
    if has_avx512f() {
        // SAFETY: (1) AVX-512F was just detected.
        unsafe { avx512::emit(keys, tau, ties, base, k, out) };
        true
    } else {
        false
    }
}

/// `dot(q, rows[i])` for 16 rows, each sum in dim order from `0.0` (the crate's order, see
/// `crate::sums`), or `None` without AVX-512F or unless `q.len()` is a multiple of 16 and every
/// row has `q.len()` values.
#[inline]
pub(crate) fn dot_x16(q: &[f32], rows: [&[f32]; 16]) -> Option<[f32; 16]> {
    if has_avx512f() && q.len().is_multiple_of(16) && rows.iter().all(|r| r.len() == q.len()) {
        // SAFETY: (1) AVX-512F was just detected.
        Some(unsafe { avx512::dot_x16(q, rows) })
    } else {
        None
    }
}
