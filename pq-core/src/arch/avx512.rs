//! AVX-512 kernels: the `m = 2` score scan and its ranking keys, the counting, compaction and
//! order-statistic steps of the top-k, the 16-row dot product of re-ranking, and the two-pass
//! top-k on 16-bit fixed-point keys ([`take_best_m2_fixed`]). Callers are the safe entry points
//! in `arch/mod.rs`, which detect the features first (invariant 1 of the module docs there).
//!
//! Memory is touched through [`load`], [`store`], [`load_live_u16`], [`load_live_u32`] and
//! [`push_lanes`] only; those hold this file's `unsafe` blocks (invariants 2 to 4).
use alloc::vec::Vec;
use core::arch::x86_64::*;

use crate::order::order_key;

/// Runs `f` in a function compiled with AVX-512F enabled (see `super::with_avx512f`).
#[target_feature(enable = "avx512f")]
pub(super) fn run<R>(f: impl FnOnce() -> R) -> R {
    f()
}

// ---- Memory access (invariants 2 to 4) ----

/// Exactly 64 bytes of plain lanes: what one register is loaded from or stored to.
trait Block64: Sized {
    /// Evaluated by every [`load`] and [`store`]: a type of any other size fails to compile.
    const IS_64_BYTES: () = assert!(size_of::<Self>() == 64);
}
impl Block64 for [u16; 32] {}
impl Block64 for [u32; 16] {}
impl Block64 for [f32; 16] {}

/// One register loaded from `src`.
#[inline]
#[target_feature(enable = "avx512f")]
fn load<T: Block64>(src: &T) -> __m512i {
    let () = T::IS_64_BYTES;
    // SAFETY: (2) `src` is a live reference to exactly 64 bytes; the load is unaligned.
    unsafe { _mm512_loadu_si512((src as *const T).cast()) }
}

/// Stores one register into `dst`.
#[inline]
#[target_feature(enable = "avx512f")]
fn store<T: Block64>(dst: &mut T, v: __m512i) {
    let () = T::IS_64_BYTES;
    // SAFETY: (2) `dst` is a live, unique reference to exactly 64 bytes of plain lanes, valid
    // for any bits; the store is unaligned.
    unsafe { _mm512_storeu_si512((dst as *mut T).cast(), v) }
}

/// The two registers of 64 words.
#[inline]
#[target_feature(enable = "avx512f")]
fn load2(c: &[u16; 64]) -> [__m512i; 2] {
    let (a, b) = c.as_chunks::<32>().0.split_at(1);
    [load(&a[0]), load(&b[0])]
}

/// The low `len` bits set (`len <= 32`).
#[inline(always)]
fn low_bits(len: usize) -> u32 {
    if len >= 32 {
        u32::MAX
    } else {
        (1u32 << len) - 1
    }
}

/// The words of `c` (at most 32) in the low lanes of a register, the others zero, and the mask
/// of those live lanes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn load_live_u16(c: &[u16]) -> (__m512i, __mmask32) {
    assert!(c.len() <= 32);
    let live = low_bits(c.len());
    // SAFETY: (3) `live` enables exactly the `c.len()` lanes inside `c` (checked above).
    (
        unsafe { _mm512_maskz_loadu_epi16(live, c.as_ptr().cast()) },
        live,
    )
}

/// [`load_live_u16`] for at most 16 `u32`.
#[inline]
#[target_feature(enable = "avx512f")]
fn load_live_u32(c: &[u32]) -> (__m512i, __mmask16) {
    assert!(c.len() <= 16);
    let live = ((1u32 << c.len()) - 1) as __mmask16;
    // SAFETY: (3) `live` enables exactly the `c.len()` lanes inside `c` (checked above).
    (
        unsafe { _mm512_maskz_loadu_epi32(live, c.as_ptr().cast()) },
        live,
    )
}

/// Integer lane types a register is appended as ([`push_lanes`]).
trait Lane: Copy {}
impl Lane for u16 {}
impl Lane for u32 {}

/// Appends the first `count` lanes of `packed` (as `64 / size_of::<T>()` lanes of `T`) to `v`
/// by storing the whole register into its spare capacity: callers reserve one register's lanes
/// beyond what they keep, and the lanes past `count` are overwritten by the next store or left
/// outside `v.len()`. The buffer is not zero-filled first.
#[inline]
#[target_feature(enable = "avx512f")]
fn push_lanes<T: Lane>(v: &mut Vec<T>, packed: __m512i, count: usize) {
    let lanes = 64 / size_of::<T>();
    let spare = v.spare_capacity_mut();
    assert!(spare.len() >= lanes && count <= lanes);
    // SAFETY: (4) `spare` holds at least `lanes` slots of `T` (checked), that is 64 bytes,
    // valid for one unaligned 64-byte store; `T` is a plain integer (`Lane`), so afterwards the
    // first `count <= lanes` spare slots are initialized and `len + count` covers only
    // initialized elements.
    unsafe {
        _mm512_storeu_si512(spare.as_mut_ptr().cast(), packed);
        v.set_len(v.len() + count);
    }
}

/// [`push_lanes`] of 16 `u32` lanes.
#[inline]
#[target_feature(enable = "avx512f")]
fn push16(v: &mut Vec<u32>, packed: __m512i, count: usize) {
    push_lanes(v, packed, count);
}

/// [`push_lanes`] of 32 `u16` lanes.
#[inline]
#[target_feature(enable = "avx512f")]
fn push32(v: &mut Vec<u16>, packed: __m512i, count: usize) {
    push_lanes(v, packed, count);
}

// ---- The `m = 2` scan and its keys ----

/// The two 64-entry rows of an `m = 2` table, four registers each.
#[inline]
#[target_feature(enable = "avx512f")]
fn load_rows(rows: &[[f32; 64]; 2]) -> [[__m512; 4]; 2] {
    core::array::from_fn(|r| {
        let quarters = rows[r].as_chunks::<16>().0;
        core::array::from_fn(|q| _mm512_castsi512_ps(load(&quarters[q])))
    })
}

/// The scores of 16 tokens whose code pairs are the 16 u32 lanes of `v` (`code0 | code1 <<
/// 16`, codes < 64): each row looked up with two two-register permutes and a blend on bit 5,
/// summed as `(0.0 + t0) + t1` per lane, the portable scan's `f32` additions.
#[inline]
#[target_feature(enable = "avx512f")]
fn sums16(t: &[[__m512; 4]; 2], v: __m512i) -> __m512 {
    let bit5 = _mm512_set1_epi32(32);
    let look = |t: &[__m512; 4], i: __m512i| {
        let lo = _mm512_permutex2var_ps(t[0], i, t[1]);
        let hi = _mm512_permutex2var_ps(t[2], i, t[3]);
        _mm512_mask_blend_ps(_mm512_test_epi32_mask(i, bit5), lo, hi)
    };
    let i0 = _mm512_and_si512(v, _mm512_set1_epi32(0xFFFF));
    let i1 = _mm512_srli_epi32::<16>(v);
    _mm512_add_ps(
        _mm512_add_ps(_mm512_setzero_ps(), look(&t[0], i0)),
        look(&t[1], i1),
    )
}

/// The scalar score of one token, as [`sums16`] computes it per lane.
#[inline(always)]
fn score_m2(rows: &[[f32; 64]; 2], c0: u16, c1: u16) -> f32 {
    (0.0 + rows[0][usize::from(c0)]) + rows[1][usize::from(c1)]
}

/// `out[t] = (0.0 + rows[0][c0]) + rows[1][c1]` for every token `t` of `codes` (pairs, codes
/// below 64), 16 tokens per step: the portable scan's `f32` additions.
#[target_feature(enable = "avx512f")]
pub(super) fn scan_m2(codes: &[u16], rows: &[[f32; 64]; 2], out: &mut [f32]) {
    let t = load_rows(rows);
    // 32 codes are 16 tokens; lane j of a register loaded from them holds
    // code(j, 0) | code(j, 1) << 16 (x86-64 is little-endian).
    let (cs, code_rest) = codes.as_chunks::<32>();
    let (os, out_rest) = out.as_chunks_mut::<16>();
    for (c, o) in cs.iter().zip(os) {
        let c: &[u16; 32] = c;
        store(o, _mm512_castps_si512(sums16(&t, load(c))));
    }
    for (p, o) in code_rest.chunks_exact(2).zip(out_rest) {
        *o = score_m2(rows, p[0], p[1]);
    }
}

/// The ranking keys of [`scan_m2`]'s scores (`order_key`, mapped in-register) into `keys`
/// (`codes.len() / 2` of them), and their `(min, max)`.
#[target_feature(enable = "avx512f")]
pub(super) fn keys_m2(codes: &[u16], rows: &[[f32; 64]; 2], keys: &mut [u32]) -> (u32, u32) {
    let t = load_rows(rows);
    let (mut vmin, mut vmax) = (_mm512_set1_epi32(-1), _mm512_setzero_si512());
    let (cs, code_rest) = codes.as_chunks::<32>();
    let (ks, key_rest) = keys.as_chunks_mut::<16>();
    for (c, o) in cs.iter().zip(ks) {
        let c: &[u16; 32] = c;
        let key = order_keys16(sums16(&t, load(c)));
        vmin = _mm512_min_epu32(vmin, key);
        vmax = _mm512_max_epu32(vmax, key);
        store(o, key);
    }
    let (mut lo, mut hi) = (_mm512_reduce_min_epu32(vmin), _mm512_reduce_max_epu32(vmax));
    for (p, o) in code_rest.chunks_exact(2).zip(key_rest) {
        *o = order_key(score_m2(rows, p[0], p[1]));
        lo = lo.min(*o);
        hi = hi.max(*o);
    }
    (lo, hi)
}

/// The `order_key` of 16 scores, in-register: NaN as -inf, then all bits of negatives
/// flipped and the top bit of the rest set.
#[inline]
#[target_feature(enable = "avx512f")]
fn order_keys16(s: __m512) -> __m512i {
    let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(s, s);
    let neg_inf = _mm512_set1_ps(f32::NEG_INFINITY);
    let bits = _mm512_castps_si512(_mm512_mask_blend_ps(nan, s, neg_inf));
    let flip = _mm512_or_si512(_mm512_srai_epi32::<31>(bits), _mm512_set1_epi32(i32::MIN));
    _mm512_xor_si512(bits, flip)
}

// ---- Steps of the general top-k on `u32` ranking keys ----

/// The bitwise OR of all codes, 64 words per step.
#[target_feature(enable = "avx512f")]
pub(super) fn or_all(codes: &[u16]) -> u16 {
    let (mut acc0, mut acc1) = (_mm512_setzero_si512(), _mm512_setzero_si512());
    let (pairs, rest) = codes.as_chunks::<64>();
    for c in pairs {
        let [v0, v1] = load2(c);
        acc0 = _mm512_or_si512(acc0, v0);
        acc1 = _mm512_or_si512(acc1, v1);
    }
    let x = _mm512_reduce_or_epi32(_mm512_or_si512(acc0, acc1)) as u32;
    let folded = (x | x >> 16) as u16;
    rest.iter().fold(folded, |a, &c| a | c)
}

/// `(#keys >= t1, #keys >= t2)`, 16 keys per step.
#[target_feature(enable = "avx512f")]
pub(super) fn count_ge2(keys: &[u32], t1: u32, t2: u32) -> (usize, usize) {
    let (u1, u2) = (_mm512_set1_epi32(t1 as i32), _mm512_set1_epi32(t2 as i32));
    let one = _mm512_set1_epi32(1);
    // Per-lane counts (each <= keys.len() / 16 + 1 < 2^31), summed at the end.
    let (mut acc1, mut acc2) = (_mm512_setzero_si512(), _mm512_setzero_si512());
    for c in keys.chunks(16) {
        let (v, live) = load_live_u32(c);
        acc1 = _mm512_mask_add_epi32(acc1, live & _mm512_cmpge_epu32_mask(v, u1), acc1, one);
        acc2 = _mm512_mask_add_epi32(acc2, live & _mm512_cmpge_epu32_mask(v, u2), acc2, one);
    }
    (
        _mm512_reduce_add_epi32(acc1) as u32 as usize,
        _mm512_reduce_add_epi32(acc2) as u32 as usize,
    )
}

/// The keys `x` with `x - a <= w` (wrapping), in order; `count` of them.
#[target_feature(enable = "avx512f")]
pub(super) fn collect_range(keys: &[u32], a: u32, w: u32, count: usize) -> Vec<u32> {
    // `count` matching keys plus 16 spare slots for the last full-width store. The cursor
    // never passes `count` (it counts matches), so every store fits.
    let mut out = Vec::with_capacity(count.min(keys.len()) + 16);
    let (av, wv) = (_mm512_set1_epi32(a as i32), _mm512_set1_epi32(w as i32));
    let (chunks, rest) = keys.as_chunks::<16>();
    for c in chunks {
        let v = load(c);
        let m = _mm512_cmple_epu32_mask(_mm512_sub_epi32(v, av), wv);
        let packed = _mm512_maskz_compress_epi32(m, v);
        push16(&mut out, packed, m.count_ones() as usize);
    }
    out.extend(rest.iter().filter(|&&x| x.wrapping_sub(a) <= w));
    out
}

/// Appends `base + i`, ascending, for every key `> tau` and the first `ties` keys `== tau`
/// (`k` in all), 16 keys per step.
#[target_feature(enable = "avx512f")]
pub(super) fn emit(
    keys: &[u32],
    tau: u32,
    mut ties: usize,
    base: u32,
    k: usize,
    out: &mut Vec<u32>,
) {
    // k = (#keys > tau) + ties values are taken; 16 spare slots for the last full-width store.
    out.reserve(k + 16);
    let tv = _mm512_set1_epi32(tau as i32);
    let step = _mm512_set1_epi32(16);
    let mut idx = _mm512_add_epi32(
        _mm512_set1_epi32(base as i32),
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
    );
    let (chunks, rest) = keys.as_chunks::<16>();
    for c in chunks {
        let v = load(c);
        let mut take = _mm512_cmpgt_epu32_mask(v, tv);
        let eq = _mm512_cmpeq_epu32_mask(v, tv);
        if eq != 0 && ties > 0 {
            // Rare: take the first `ties` equal keys, in index order.
            let mut e = eq;
            while e != 0 && ties > 0 {
                let low = e & e.wrapping_neg();
                take |= low;
                e &= !low;
                ties -= 1;
            }
        }
        // Compress in a register, then store all 16 lanes (a compressing store to memory is
        // microcoded on AMD Zen 4: `spec/PQ.md` §6). Only taken keys advance the length, k in
        // all, so 16 spare slots remain.
        let packed = _mm512_maskz_compress_epi32(take, idx);
        push16(out, packed, take.count_ones() as usize);
        idx = _mm512_add_epi32(idx, step);
    }
    let i = 16 * chunks.len();
    for (j, &key) in rest.iter().enumerate() {
        let tie = key == tau && ties > 0;
        ties -= usize::from(tie);
        if key > tau || tie {
            out.push(base + (i + j) as u32);
        }
    }
}

/// Branch-free order statistics of at most 64 keys: each key's count of larger keys `g`
/// (one broadcast compare per key and register), then the `j`-th largest is the smallest
/// key with `g <= j` (the keys with at most `j` keys above them are the `j + 1` largest,
/// with all ties of the last).
#[target_feature(enable = "avx512f,popcnt")]
pub(super) fn nth_largest<const N: usize>(v: &[u32], js: [usize; N]) -> [u32; N] {
    let n = v.len().min(64);
    let mut arr = [0u32; 64];
    arr[..n].copy_from_slice(&v[..n]);
    let quarters = arr.as_chunks::<16>().0;
    let regs: [__m512i; 4] = core::array::from_fn(|r| load(&quarters[r]));
    let live: [__mmask16; 4] = core::array::from_fn(|r| {
        let l = n.saturating_sub(16 * r).min(16);
        ((1u32 << l) - 1) as __mmask16
    });
    let used = n.div_ceil(16);
    let one = _mm512_set1_epi32(1);
    let mut g = [_mm512_setzero_si512(); 4];
    for &x in &arr[..n] {
        let b = _mm512_set1_epi32(x as i32);
        for r in 0..used {
            let gt = _mm512_cmpgt_epu32_mask(b, regs[r]);
            g[r] = _mm512_mask_add_epi32(g[r], gt, g[r], one);
        }
    }
    js.map(|j| {
        let jv = _mm512_set1_epi32(j as i32);
        let mut best = u32::MAX;
        for r in 0..used {
            let m = live[r] & _mm512_cmple_epu32_mask(g[r], jv);
            best = best.min(_mm512_mask_reduce_min_epu32(m, regs[r]));
        }
        best
    })
}

// ---- Re-ranking ----

/// `dot(q, rows[i])` for 16 rows (each of `q.len()` floats, a multiple of 16), lane `i` summing
/// row `i` in dim order from `0.0`: per 16 dims the rows' 16x16 block is transposed in
/// registers (two unpack stages and two 128-bit shuffle stages), then each dim's column is
/// multiplied by `q[d]` and added, dims in order.
#[target_feature(enable = "avx512f")]
pub(super) fn dot_x16(q: &[f32], rows: [&[f32]; 16]) -> [f32; 16] {
    let mut acc = _mm512_setzero_ps();
    for (b, qb) in q.chunks_exact(16).enumerate() {
        let r: [__m512; 16] = core::array::from_fn(|i| {
            let c: &[f32; 16] = rows[i][16 * b..16 * b + 16].try_into().expect("16 values");
            _mm512_castsi512_ps(load(c))
        });
        // Lane group k of t[2p] / t[2p+1]: rows 2p, 2p+1 at dims 4k, 4k+1 / 4k+2, 4k+3.
        let t: [__m512; 16] = core::array::from_fn(|i| {
            let (a, c) = (r[i & !1], r[i | 1]);
            if i % 2 == 0 {
                _mm512_unpacklo_ps(a, c)
            } else {
                _mm512_unpackhi_ps(a, c)
            }
        });
        // u[4g + s]: rows 4g..4g+4 at dim 4k + s in lane group k.
        let u: [__m512d; 16] = core::array::from_fn(|i| {
            let (g, s) = (i / 4, i % 4);
            let a = _mm512_castps_pd(t[4 * g + (s / 2)]);
            let c = _mm512_castps_pd(t[4 * g + 2 + (s / 2)]);
            if s % 2 == 0 {
                _mm512_unpacklo_pd(a, c)
            } else {
                _mm512_unpackhi_pd(a, c)
            }
        });
        let u: [__m512; 16] = u.map(|x| _mm512_castpd_ps(x));
        let mut col = [_mm512_setzero_ps(); 16];
        for s in 0..4 {
            let (g0, g1, g2, g3) = (u[s], u[4 + s], u[8 + s], u[12 + s]);
            let v0 = _mm512_shuffle_f32x4::<0b10_00_10_00>(g0, g1);
            let v1 = _mm512_shuffle_f32x4::<0b10_00_10_00>(g2, g3);
            let w0 = _mm512_shuffle_f32x4::<0b11_01_11_01>(g0, g1);
            let w1 = _mm512_shuffle_f32x4::<0b11_01_11_01>(g2, g3);
            col[s] = _mm512_shuffle_f32x4::<0b10_00_10_00>(v0, v1);
            col[8 + s] = _mm512_shuffle_f32x4::<0b11_01_11_01>(v0, v1);
            col[4 + s] = _mm512_shuffle_f32x4::<0b10_00_10_00>(w0, w1);
            col[12 + s] = _mm512_shuffle_f32x4::<0b11_01_11_01>(w0, w1);
        }
        for (c, &x) in col.iter().zip(qb) {
            acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_set1_ps(x), *c));
        }
    }
    let mut out = [0.0f32; 16];
    store(&mut out, _mm512_castps_si512(acc));
    out
}

// ---- The two-pass top-k on 16-bit fixed-point keys ----

/// The fewest tokens for which [`take_best_m2_fixed`] samples a bracket.
pub(super) const BRACKET_MIN_TOKENS: usize = 512;

/// Sample size and half-width (in sample ranks) of the bracket of [`take_best_m2_fixed`].
/// With 64 samples the `k`-th key's sample rank has a standard deviation of about 3.2 at
/// `k = T/5`; +-9 misses about once in 200 searches.
const SAMPLE: usize = 64;
const HALF_WIDTH: usize = 9;

/// The largest key gap [`fixed_rows`] accepts (a wider one would leave too many tokens to
/// rank exactly; the exact path runs instead).
const MAX_GAP: u32 = 1024;

/// The most tokens near the `k`-th key that [`take_best_m2_fixed`] ranks by their `f32`
/// scores (more, from many equal keys, leave it to the exact path).
const MAX_CANDIDATES: usize = 256;

/// Scale of the fixed-point keys: the two rows' ranges together map onto `0..=60000`.
const KEY_SPAN: f32 = 60000.0;

/// Word indices `0, 2, 4, ..` and `1, 3, 5, ..`: the first and second codes of 32 tokens
/// held in two registers (a two-register word permute reads word `i` of the pair).
const EVEN: [u16; 32] = {
    let mut a = [0u16; 32];
    let mut i = 0;
    while i < 32 {
        a[i] = 2 * i as u16;
        i += 1;
    }
    a
};
const ODD: [u16; 32] = {
    let mut a = [0u16; 32];
    let mut i = 0;
    while i < 32 {
        a[i] = 2 * i as u16 + 1;
        i += 1;
    }
    a
};

/// The 16-bit fixed-point rows of an `m = 2` table (two registers of 32 words per row) and
/// the key gap at which fixed-point keys order the `f32` scores exactly.
///
/// Entry `Q_j[c] = trunc(((t_j[c] - min_j) * s) + 0.5)` in `f32` operations, with
/// `s = min(KEY_SPAN / (range_0 + range_1), 1 / u)` (`u` below), so a token's key
/// `K = Q_0[c0] + Q_1[c1]` is at most 60001 and fits a `u16`. Error bound:
/// `(t - min) * s <= 60000 (1 + 2^-22)`; the `f32` subtraction, multiplication and addition of
/// 0.5 err by at most 0.0072 + 0.0072 + 0.002, so each entry lies within 0.52 of the exact
/// `(t_j[c] - min_j) * s`, and a key within 1.04 of `s` times the exact sum
/// `t_0[c0] + t_1[c1]` less `min_0 + min_1`. Two tokens whose keys differ by `gap` or more
/// therefore have exact sums `y` that differ by at least `(gap - 2.08) / s > u`, where
/// `u = U * 2^-23 + 2^-149` and `U >= |y|` for every token: `u` exceeds the two roundings to
/// `f32` of such sums together (`|fl(y) - y| <= 2^-24 |y|`, or `2^-150` below the normal
/// range), so their `f32` scores `(0.0 + t_0) + t_1` differ in the same direction.
/// `gap = 3 + ceil(u * s)`, at most 5 (`u * s <= 1` up to rounding).
///
/// `None` when an entry is not finite, all sums are equal, `U >= 2^126` (a sum could round
/// to infinity), or the gap would exceed [`MAX_GAP`]; the exact path runs then.
#[target_feature(enable = "avx512f,avx512bw")]
fn fixed_rows(rows: &[[f32; 64]; 2]) -> Option<([[__m512i; 2]; 2], u32)> {
    let t = load_rows(rows);
    let mut lo = [0.0f32; 2];
    let mut hi = [0.0f32; 2];
    for r in 0..2 {
        let mn = _mm512_min_ps(
            _mm512_min_ps(t[r][0], t[r][1]),
            _mm512_min_ps(t[r][2], t[r][3]),
        );
        let mx = _mm512_max_ps(
            _mm512_max_ps(t[r][0], t[r][1]),
            _mm512_max_ps(t[r][2], t[r][3]),
        );
        lo[r] = _mm512_reduce_min_ps(mn);
        hi[r] = _mm512_reduce_max_ps(mx);
    }
    // A NaN entry can hide from min/max: `x - x` is NaN exactly where `x` is not finite.
    let mut bad = 0u16;
    for x in t.iter().flatten() {
        bad |= _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(_mm512_sub_ps(*x, *x), _mm512_setzero_ps());
    }
    if bad != 0 {
        return None;
    }
    let total = (hi[0] - lo[0]) + (hi[1] - lo[1]);
    if !(total > 0.0 && total.is_finite()) {
        return None;
    }
    let mag = |r: usize| f64::from(lo[r].abs().max(hi[r].abs()));
    let big_u = (mag(0) + mag(1)) * (1.0 + 1e-12);
    if big_u >= 2f64.powi(126) {
        return None;
    }
    let u = big_u * 2f64.powi(-23) + 2f64.powi(-149);
    // No finer than the `f32` spacing `u` (finer keys would only widen the gap).
    let s = (f64::from(KEY_SPAN / total)).min(1.0 / u) as f32;
    if !(s.is_finite() && s > 0.0) {
        return None;
    }
    let gap = 3.0 + (u * f64::from(s)).ceil();
    if gap > f64::from(MAX_GAP) {
        return None;
    }
    let (sv, half) = (_mm512_set1_ps(s), _mm512_set1_ps(0.5));
    let q = core::array::from_fn(|r| {
        let lv = _mm512_set1_ps(lo[r]);
        let w: [__m256i; 4] = core::array::from_fn(|i| {
            let x = _mm512_add_ps(_mm512_mul_ps(_mm512_sub_ps(t[r][i], lv), sv), half);
            _mm512_cvtepi32_epi16(_mm512_cvttps_epi32(x))
        });
        [
            _mm512_inserti64x4::<1>(_mm512_castsi256_si512(w[0]), w[1]),
            _mm512_inserti64x4::<1>(_mm512_castsi256_si512(w[2]), w[3]),
        ]
    });
    Some((q, gap as u32))
}

/// How many of `v` are `>= t1` and how many `>= t2`, 32 per step.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,popcnt")]
fn count_ge2_u16(v: &[u16], t1: u32, t2: u32) -> (usize, usize) {
    let (u1, u2) = (
        _mm512_set1_epi16(t1 as u16 as i16),
        _mm512_set1_epi16(t2 as u16 as i16),
    );
    let (mut n1, mut n2) = (0usize, 0usize);
    for c in v.chunks(32) {
        let (x, live) = load_live_u16(c);
        n1 += _mm512_mask_cmpge_epu16_mask(live, x, u1).count_ones() as usize;
        n2 += _mm512_mask_cmpge_epu16_mask(live, x, u2).count_ones() as usize;
    }
    (n1, n2)
}

/// The `js[i]`-th largest (from 0) of at most 64 keys `v` (every `js[i] < v.len()`):
/// each key's count of larger keys `g` (one broadcast compare per key and register), then
/// the `j`-th largest is the smallest key with `g <= j`.
#[target_feature(enable = "avx512f,avx512bw")]
fn nth_largest_u16<const N: usize>(v: &[u16], js: [usize; N]) -> [u16; N] {
    let n = v.len().min(64);
    let mut arr = [0u16; 64];
    arr[..n].copy_from_slice(&v[..n]);
    let regs = load2(&arr);
    let live = [low_bits(n), low_bits(n.saturating_sub(32))];
    let one = _mm512_set1_epi16(1);
    let mut g = [_mm512_setzero_si512(); 2];
    for &x in &arr[..n] {
        let b = _mm512_set1_epi16(x as i16);
        for r in 0..2 {
            let gt = _mm512_cmpgt_epu16_mask(b, regs[r]);
            g[r] = _mm512_mask_add_epi16(g[r], gt, g[r], one);
        }
    }
    js.map(|j| {
        let jv = _mm512_set1_epi16(j as i16);
        let ones = _mm512_set1_epi16(-1);
        let pick = |r: usize| {
            let m = live[r] & _mm512_cmple_epu16_mask(g[r], jv);
            _mm512_mask_blend_epi16(m, ones, regs[r])
        };
        let mut lanes = [0u16; 32];
        store(&mut lanes, _mm512_min_epu16(pick(0), pick(1)));
        lanes.iter().copied().min().unwrap_or(u16::MAX)
    })
}

/// The `j`-th largest (from 0) of `v`, whose keys all lie in `lo..=hi` (`j < v.len()`).
///
/// Counting passes with two thresholds each, aimed by interpolation a margin either side of
/// the rank sought (halving instead after a pass that kept more than half), narrow
/// `[a, b]` until at most 64 keys lie in it; those are collected and ranked.
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi2,popcnt")]
fn kth_u16(v: &[u16], j: usize, lo: u16, hi: u16) -> u16 {
    // Invariants: the answer is in [a, b]; ca = #keys >= a > j; cb = #keys > b <= j.
    let (mut a, mut b) = (u32::from(lo), u32::from(hi));
    let (mut ca, mut cb) = (v.len(), 0usize);
    let mut halve = false;
    while ca - cb > 64 && a < b {
        let width = ca - cb;
        let (t1, t2) = if halve {
            let mid = (a + b).div_ceil(2);
            (mid, mid)
        } else {
            let (w, span) = (width as f64, f64::from(b - a));
            let margin = (w / 16.0).max(8.0);
            let need = (j - cb) as f64 + 0.5;
            let at = |from_top: f64| {
                let f = (from_top / w).clamp(0.0, 1.0);
                ((f64::from(b) - f * span).round() as u32).clamp(a + 1, b)
            };
            (at(need + margin), at(need - margin))
        };
        let (c1, c2) = count_ge2_u16(v, t1, t2);
        for (t, c) in [(t1, c1), (t2, c2)] {
            if c > j {
                if t > a {
                    (a, ca) = (t, c);
                }
            } else if t <= b {
                (b, cb) = (t - 1, c);
            }
        }
        halve = (ca - cb) * 2 > width;
    }
    if a == b {
        return a as u16;
    }
    // At most 64 keys lie in [a, b]; 32 spare slots for the last full-width store.
    let mut buf = [0u16; 96];
    let mut len = 0usize;
    let (av, wv) = (
        _mm512_set1_epi16(a as u16 as i16),
        _mm512_set1_epi16((b - a) as u16 as i16),
    );
    for c in v.chunks(32) {
        let (x, live) = load_live_u16(c);
        let m = _mm512_mask_cmple_epu16_mask(live, _mm512_sub_epi16(x, av), wv);
        let dst: &mut [u16; 32] = (&mut buf[len..len + 32]).try_into().expect("32 words");
        store(dst, _mm512_maskz_compress_epi16(m, x));
        len += m.count_ones() as usize;
    }
    // Branch-free bisection over the collected keys (two registers): the largest t in
    // [a, b] with more than j - cb of them >= t.
    let regs = load2(buf.first_chunk::<64>().expect("64 words"));
    let live = [low_bits(len), low_bits(len.saturating_sub(32))];
    let jj = j - cb;
    let steps = 32 - (b - a).leading_zeros();
    for _ in 0..steps {
        let mid = (a + b).div_ceil(2);
        let tv = _mm512_set1_epi16(mid as u16 as i16);
        let c = _mm512_mask_cmpge_epu16_mask(live[0], regs[0], tv).count_ones()
            + _mm512_mask_cmpge_epu16_mask(live[1], regs[1], tv).count_ones();
        let up = c as usize > jj;
        a = if up { mid } else { a };
        b = if up { b } else { mid - 1 };
    }
    a as u16
}

/// The fixed-point rows of [`fixed_rows`] in registers, with the word permutes that split
/// code pairs: turns 32 tokens' codes into their keys.
#[derive(Clone, Copy)]
struct FixedKeys {
    rows: [[__m512i; 2]; 2],
    even: __m512i,
    odd: __m512i,
}

impl FixedKeys {
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn new(rows: [[__m512i; 2]; 2]) -> Self {
        Self {
            rows,
            even: load(&EVEN),
            odd: load(&ODD),
        }
    }

    /// The keys of 32 tokens whose code pairs are the words of `a` (16 tokens) then `b`: the
    /// first and second codes split by two word permutes, each looked up in its row.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    fn keys32(&self, a: __m512i, b: __m512i) -> __m512i {
        let c0 = _mm512_permutex2var_epi16(a, self.even, b);
        let c1 = _mm512_permutex2var_epi16(a, self.odd, b);
        _mm512_add_epi16(
            _mm512_permutex2var_epi16(self.rows[0][0], c0, self.rows[0][1]),
            _mm512_permutex2var_epi16(self.rows[1][0], c1, self.rows[1][1]),
        )
    }
}

/// Step 1 of [`take_best_m2_fixed`]: a bracket `[lo, hi]` of keys that likely holds the `k`-th
/// largest of the `n` tokens' keys: sample ranks `r +- HALF_WIDTH` around the expected rank
/// `r` of the `k`-th among 64 evenly spaced tokens (open-ended where that passes an end).
#[target_feature(enable = "avx512f,avx512bw")]
fn sample_bracket(codes: &[u16], fk: &FixedKeys, n: usize, k: usize) -> (u16, u16) {
    let stride = n / SAMPLE;
    let pairs: [u16; 2 * SAMPLE] =
        core::array::from_fn(|i| codes[2 * ((i / 2) * stride + stride / 2) + i % 2]);
    let mut sample = [0u16; SAMPLE];
    let dst = sample.as_chunks_mut::<32>().0;
    for (out, c) in dst.iter_mut().zip(pairs.as_chunks::<64>().0) {
        let [a, b] = load2(c);
        store(out, fk.keys32(a, b));
    }
    let r = k * SAMPLE / n;
    if r + HALF_WIDTH < SAMPLE {
        let [lo, hi] = nth_largest_u16(&sample, [r + HALF_WIDTH, r.saturating_sub(HALF_WIDTH)]);
        (lo, if r >= HALF_WIDTH { hi } else { u16::MAX })
    } else {
        (0, u16::MAX)
    }
}

/// Top-k in two passes over the tokens on 16-bit fixed-point keys ([`fixed_rows`]), with
/// the `f32` scores consulted only near the `k`-th key, so that the result is exactly the
/// portable top-k's on the `f32` scores:
/// 1. a bracket `[lo, hi]` of keys from a 64-token sample ([`sample_bracket`]), widened by
///    `gap - 1` each side into the band;
/// 2. pass one, 32 tokens per step: their keys ([`FixedKeys::keys32`]), a mask of those above
///    the band and a mask of those in it, whose keys are compacted in index order;
/// 3. the `k`-th key `tau` among the band's keys ([`kth_u16`]: counting passes aimed by
///    interpolation, then a bisection over the last 64 or fewer);
/// 4. every token whose key is `>= tau + gap` is among the `k` best `f32` scores (at most
///    the tokens with keys `> tau`, fewer than `k`, can outrank it) and every token whose key
///    is `<= tau - gap` is not (the `k` or more tokens with keys `>= tau` outrank it), so only
///    the tokens within `gap - 1` of `tau` are ranked by their `f32` scores and ties, to fill
///    the rest ([`rank_near`]); each band key gets a taken bit;
/// 5. pass two over the masks ([`emit_taken`]): the taken mask is the above mask plus the
///    block's taken bits deposited (`pdep`) at its band positions; the taken indices are
///    compacted.
///
/// Returns `false`, with `out` untouched, when the tables do not allow fixed-point keys or
/// the bracket misses (the caller then runs the general path).
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi2,bmi2,popcnt")]
pub(super) fn take_best_m2_fixed(
    codes: &[u16],
    rows: &[[f32; 64]; 2],
    base: u32,
    k: usize,
    out: &mut Vec<u32>,
) -> bool {
    let n = codes.len() / 2;
    let Some((tq, gap)) = fixed_rows(rows) else {
        return false;
    };
    let near = gap - 1;
    let fk = FixedKeys::new(tq);
    // 1. The bracket, widened into the band.
    let (lo, hi) = sample_bracket(codes, &fk, n, k);
    let band_lo = u32::from(lo).saturating_sub(near);
    let band_hi = (u32::from(hi) + near).min(0xFFFF);
    // 2. Pass one.
    let (hi_v, lo_v, w_v) = (
        _mm512_set1_epi16(band_hi as u16 as i16),
        _mm512_set1_epi16(band_lo as u16 as i16),
        _mm512_set1_epi16((band_hi - band_lo) as u16 as i16),
    );
    let blocks = n.div_ceil(32);
    // Per block of 32 tokens: the above-band mask in the low 32 bits, the band mask in the
    // high 32.
    let mut masks_stack = [0u64; 128];
    let mut masks_heap = Vec::new();
    let masks: &mut [u64] = if blocks <= masks_stack.len() {
        &mut masks_stack[..blocks]
    } else {
        masks_heap.resize(blocks, 0);
        &mut masks_heap
    };
    // The band's keys; 32 spare slots for the last full-width store (the cursor counts band
    // keys of the blocks before, at most `32 * blocks - 32`).
    let mut band: Vec<u16> = Vec::with_capacity(32 * blocks + 32);
    let mut n_above = 0usize;
    macro_rules! block {
        ($a:expr, $b:expr, $j:expr, $valid:expr) => {{
            let key = fk.keys32($a, $b);
            let above = _mm512_mask_cmpgt_epu16_mask($valid, key, hi_v);
            let inside = _mm512_mask_cmple_epu16_mask($valid, _mm512_sub_epi16(key, lo_v), w_v);
            push32(
                &mut band,
                _mm512_maskz_compress_epi16(inside, key),
                inside.count_ones() as usize,
            );
            n_above += above.count_ones() as usize;
            masks[$j] = u64::from(above) | u64::from(inside) << 32;
        }};
    }
    let (full, rem) = codes.as_chunks::<64>();
    for (j, c) in full.iter().enumerate() {
        let [a, b] = load2(c);
        block!(a, b, j, u32::MAX);
    }
    if !rem.is_empty() {
        let mut pad = [0u16; 64];
        pad[..rem.len()].copy_from_slice(rem);
        let [a, b] = load2(&pad);
        block!(a, b, blocks - 1, low_bits(rem.len() / 2));
    }
    // 3. The k-th key, within the band.
    let n_band = band.len();
    if n_above >= k || n_above + n_band < k {
        return false;
    }
    let tau = u32::from(kth_u16(
        &band,
        k - n_above - 1,
        band_lo as u16,
        band_hi as u16,
    ));
    // Every key within `near` of tau must be in the band (so whenever tau is in [lo, hi]).
    if (band_lo > 0 && tau < band_lo + near) || (band_hi < 0xFFFF && tau + near > band_hi) {
        return false;
    }
    // 4. Taken bits of the band keys, 32 per word in band order (two spare zero words so
    // that pass two can read any word and the next).
    let words = n_band.div_ceil(32) + 2;
    let mut taken_stack = [0u32; 136];
    let mut taken_heap = Vec::new();
    let taken: &mut [u32] = if words <= taken_stack.len() {
        &mut taken_stack[..words]
    } else {
        taken_heap.resize(words, 0);
        &mut taken_heap
    };
    let near_tau = NearTau { tau, gap };
    if !rank_near(&band, masks, codes, rows, near_tau, k - n_above, taken) {
        return false;
    }
    // 5. Pass two.
    emit_taken(masks, taken, base, k, out);
    true
}

/// Step 5 of [`take_best_m2_fixed`]: appends `base + i` for every token `i` taken, ascending:
/// per block of 32 tokens (`masks`: above-band bits low, band bits high), those above the band
/// and those band tokens whose taken bit is set (`taken`, in band order, two spare zero words
/// at the end). `k` tokens in all.
#[inline]
#[target_feature(enable = "avx512f,bmi2,popcnt")]
fn emit_taken(masks: &[u64], taken: &[u32], base: u32, k: usize, out: &mut Vec<u32>) {
    // 32 spare slots for the last full-width stores.
    out.reserve(k + 32);
    let lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    let mut idx = _mm512_add_epi32(_mm512_set1_epi32(base as i32), lanes);
    let (sixteen, step) = (_mm512_set1_epi32(16), _mm512_set1_epi32(32));
    let mut cursor = 0usize;
    for &mask in masks {
        let (above, inside) = (mask as u32, (mask >> 32) as u32);
        let at = cursor / 32;
        let window = u64::from(taken[at]) | u64::from(taken[at + 1]) << 32;
        let bits = (window >> (cursor % 32)) as u32;
        cursor += inside.count_ones() as usize;
        let take = above | _pdep_u32(bits, inside);
        let (t0, t1) = (take as u16, (take >> 16) as u16);
        push16(
            out,
            _mm512_maskz_compress_epi32(t0, idx),
            t0.count_ones() as usize,
        );
        let idx1 = _mm512_add_epi32(idx, sixteen);
        push16(
            out,
            _mm512_maskz_compress_epi32(t1, idx1),
            t1.count_ones() as usize,
        );
        idx = _mm512_add_epi32(idx, step);
    }
}

/// The `k`-th key `tau` of [`take_best_m2_fixed`] and the key gap beyond which keys order the
/// `f32` scores exactly.
#[derive(Clone, Copy)]
struct NearTau {
    tau: u32,
    gap: u32,
}

/// Step 4 of [`take_best_m2_fixed`]: sets the taken bit (`taken`, 32 band positions per word,
/// all zero on entry) of every band key `>= tau + gap`, then of the best band tokens within
/// `gap - 1` of `tau` by their `f32` scores (ties to the lower index) until `need` tokens
/// (the `k` best less those above the band) are taken. Returns `false` when more than
/// `MAX_CANDIDATES` tokens are that close (many equal keys; the exact path runs instead) or,
/// never in a correct build, when the candidates cannot fill `need`.
#[target_feature(enable = "avx512f,avx512bw,bmi2,popcnt")]
fn rank_near(
    band: &[u16],
    masks: &[u64],
    codes: &[u16],
    rows: &[[f32; 64]; 2],
    near_tau: NearTau,
    need: usize,
    taken: &mut [u32],
) -> bool {
    let NearTau { tau, gap } = near_tau;
    let near = gap - 1;
    // The candidates near tau: their band positions, ascending.
    let mut cands = [0u32; MAX_CANDIDATES];
    let mut n_cands = 0usize;
    let take_at = tau + gap;
    let near_lo = tau.saturating_sub(near);
    let (take_v, near_lo_v, near_w_v) = (
        _mm512_set1_epi16(take_at.min(0xFFFF) as u16 as i16),
        _mm512_set1_epi16(near_lo as u16 as i16),
        _mm512_set1_epi16(((tau + near).min(0xFFFF) - near_lo) as u16 as i16),
    );
    let mut n_taken = 0usize;
    for (w, c) in band.chunks(32).enumerate() {
        let (v, live) = load_live_u16(c);
        let ge = if take_at <= 0xFFFF {
            _mm512_mask_cmpge_epu16_mask(live, v, take_v)
        } else {
            0
        };
        let mut close =
            _mm512_mask_cmple_epu16_mask(live, _mm512_sub_epi16(v, near_lo_v), near_w_v);
        taken[w] = ge;
        n_taken += ge.count_ones() as usize;
        if n_cands + close.count_ones() as usize > MAX_CANDIDATES {
            return false;
        }
        while close != 0 {
            cands[n_cands] = 32 * w as u32 + close.trailing_zeros();
            n_cands += 1;
            close &= close - 1;
        }
    }
    let cands = &cands[..n_cands];
    // At least one and at most all candidates are needed (the argument above); a miss
    // would be a bug, and the exact path still answers right.
    let need = need.wrapping_sub(n_taken);
    if need == 0 || need > n_cands {
        debug_assert!(false, "fixed-point bracket: need {need} of {n_cands}");
        return false;
    }
    // The candidates' exact ranking keys, from their tokens (found from their band
    // positions); then the `need` best by key, ties to the lower token (= candidate) index.
    let mut exact = [(0u32, 0u32); MAX_CANDIDATES];
    let (mut ci, mut seen) = (0usize, 0u32);
    for (j, &mask) in masks.iter().enumerate() {
        if ci == n_cands {
            break;
        }
        let inside = (mask >> 32) as u32;
        let count = inside.count_ones();
        while ci < n_cands && cands[ci] < seen + count {
            let lane = _pdep_u32(1 << (cands[ci] - seen), inside).trailing_zeros() as usize;
            let tok = 32 * j + lane;
            let (c0, c1) = (codes[2 * tok] & 63, codes[2 * tok + 1] & 63);
            exact[ci] = (order_key(score_m2(rows, c0, c1)), ci as u32);
            ci += 1;
        }
        seen += count;
    }
    let exact = &mut exact[..n_cands];
    exact.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    for &(_, i) in &exact[..need] {
        let p = cands[i as usize];
        taken[p as usize / 32] |= 1 << (p % 32);
    }
    true
}
