//! The lane decoder with AVX-512 (x86-64 with the `std` feature, chosen at run time when the CPU
//! reports `avx512f` and `avx512dq`).
//!
//! The arithmetic is the portable `decode_step`'s, lane for lane, on 64-bit integers, so the
//! symbols, states and word positions are identical bit for bit (tests compare the two on random
//! tables, words and call splits): four 512-bit registers hold the 32 lanes' states and four their
//! word positions. Per 8 lanes a step is one gather of the slots' packed entries (symbol,
//! frequency, `slot - cdf`; see [`DecodeTable`]), a multiply-add, and the refill from a word read
//! ahead: each lane's next unread word is gathered as soon as the previous one is taken, so the
//! word read is off the state's dependency chain. Partial rounds (a call that starts or ends in
//! the middle of a round) run the same steps under a lane mask.
//!
//! This is the crate's only `unsafe` code. [`decode`] checks the invariant every load relies on
//! before it calls the `unsafe` function; the `SAFETY` comments say why each access is in bounds.

use core::arch::x86_64::*;

use super::table::DecodeTable;
use super::{LANES, TOTAL};

/// Byte offset of `DecodeTable::packed` (after `sym: [u8; 4096]` and `info: [u32; 256]`).
const PACKED_OFFSET: i64 = TOTAL as i64 + 4 * 256;
const _: () = assert!(core::mem::offset_of!(DecodeTable, packed) as i64 == PACKED_OFFSET);

/// Whether this CPU can run the vector path (detected once by `std`, then an atomic load).
#[inline]
pub(super) fn available() -> bool {
    std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512dq")
}

/// Decodes `out.len()` symbols with global indices `first..` (symbol `first + i` from lane
/// `(first + i) % 32` with `tables[i]`), exactly as the portable `decode_step` loop would, and
/// returns `true`; returns `false` without touching anything if the vector path cannot run: the
/// CPU lacks AVX-512 F and DQ, `tables` is shorter than `out`, `words` is empty, or some lane's
/// `start_of[l] <= pos[l] <= words.len()` does not hold (it always does for a `LaneDecoder`).
#[inline]
pub(super) fn decode(
    state: &mut [u64; LANES],
    pos: &mut [usize; LANES],
    start_of: &[usize; LANES],
    words: &[u32],
    first: usize,
    tables: &[&DecodeTable],
    out: &mut [u8],
) -> bool {
    if !available()
        || tables.len() < out.len()
        || words.is_empty()
        || pos
            .iter()
            .zip(start_of)
            .any(|(&p, &s)| s > p || p > words.len())
    {
        return false;
    }
    // SAFETY: AVX-512 F and DQ were just detected, and the checks above are the function's other
    // preconditions.
    unsafe { decode_avx512(state, pos, start_of, words, first, tables, out) };
    true
}

/// Constants of the step, in registers.
#[derive(Clone, Copy)]
struct Consts {
    slot_mask: __m512i,
    packed: __m512i,
    low8: __m512i,
    low12: __m512i,
    two32: __m512i,
    one: __m512i,
    zero: __m512i,
}

/// One lane group's registers: 8 lanes' states, word positions, first word positions and next
/// words (read ahead).
#[derive(Clone, Copy)]
struct Group {
    x: __m512i,
    p: __m512i,
    start: __m512i,
    next_word: __m512i,
}

/// One decode step of the 8 lanes of `g` selected by `m`, with the table pointers `tp`; returns
/// the symbols (in the low byte of each 64-bit lane; unselected lanes are unspecified).
///
/// # Safety
///
/// AVX-512 F and DQ; for every selected lane, `tp` is a `&DecodeTable`'s address; for every lane,
/// `start <= p <= words.len()` and `words` is not empty (`wbase` is its start).
#[inline]
#[target_feature(enable = "avx512f,avx512dq")]
unsafe fn step(g: &mut Group, m: __mmask8, tp: __m512i, c: &Consts, wbase: *const i32) -> __m512i {
    let slot = _mm512_and_si512(g.x, c.slot_mask);
    let addr = _mm512_add_epi64(_mm512_add_epi64(tp, c.packed), _mm512_slli_epi64::<2>(slot));
    // SAFETY: for each selected lane, `packed[slot]` (`slot < 4096`) of a live table (absolute
    // addresses, so the base is null); unselected lanes are not read.
    let e = _mm512_cvtepu32_epi64(unsafe {
        _mm512_mask_i64gather_epi32::<1>(_mm256_setzero_si256(), m, addr, core::ptr::null())
    });
    let sym = _mm512_and_si512(e, c.low8);
    let freq = _mm512_and_si512(_mm512_srli_epi64::<8>(e), c.low12);
    let bias = _mm512_srli_epi64::<20>(e);
    // (x >> 12) < 2^52 and freq < 2^12: no overflow, as in `decode_step`.
    let xn = _mm512_add_epi64(_mm512_mullo_epi64(_mm512_srli_epi64::<12>(g.x), freq), bias);
    let refill = _mm512_cmplt_epu64_mask(xn, c.two32) & _mm512_cmpgt_epu64_mask(g.p, g.start) & m;
    let refilled = _mm512_mask_or_epi64(xn, refill, _mm512_slli_epi64::<32>(xn), g.next_word);
    g.x = _mm512_mask_mov_epi64(g.x, m, refilled);
    g.p = _mm512_mask_sub_epi64(g.p, refill, g.p, c.one);
    // Read ahead the lanes' next words: `words[max(p - 1, 0)]`, in bounds since `p <=
    // words.len()` and `words` is not empty. (When `p == start` the word read is another lane's
    // or, for `p == 0`, word 0; it is never used, since such a lane does not refill.)
    let i = _mm512_max_epi64(_mm512_sub_epi64(g.p, c.one), c.zero);
    // SAFETY: `i` is in `0..words.len()` (see above); only refilled lanes are read.
    g.next_word = _mm512_cvtepu32_epi64(unsafe {
        _mm512_mask_i64gather_epi32::<4>(_mm512_cvtepi64_epi32(g.next_word), refill, i, wbase)
    });
    sym
}

/// The vector decoder.
///
/// # Safety
///
/// The CPU supports AVX-512 F and DQ; `tables.len() >= out.len()`; `words` is not empty; every
/// lane has `start_of[l] <= pos[l] <= words.len()`.
#[target_feature(enable = "avx512f,avx512dq")]
unsafe fn decode_avx512(
    state: &mut [u64; LANES],
    pos: &mut [usize; LANES],
    start_of: &[usize; LANES],
    words: &[u32],
    first: usize,
    tables: &[&DecodeTable],
    out: &mut [u8],
) {
    const _: () = assert!(core::mem::size_of::<&DecodeTable>() == 8);
    const _: () = assert!(core::mem::size_of::<usize>() == 8);
    let c = Consts {
        slot_mask: _mm512_set1_epi64(i64::from(TOTAL - 1)),
        packed: _mm512_set1_epi64(PACKED_OFFSET),
        low8: _mm512_set1_epi64(0xFF),
        low12: _mm512_set1_epi64(0xFFF),
        two32: _mm512_set1_epi64(1 << 32),
        one: _mm512_set1_epi64(1),
        zero: _mm512_setzero_si512(),
    };
    let wbase: *const i32 = words.as_ptr().cast();
    // SAFETY (the loads and stores of the 32-lane arrays): `state`, `pos` and `start_of` are 32
    // 8-byte values each, 4 registers of 8.
    let mut g: [Group; 4] = core::array::from_fn(|v| {
        let (x, p, start) = unsafe {
            (
                _mm512_loadu_si512(state[8 * v..].as_ptr().cast()),
                _mm512_loadu_si512(pos[8 * v..].as_ptr().cast()),
                _mm512_loadu_si512(start_of[8 * v..].as_ptr().cast()),
            )
        };
        let i = _mm512_max_epi64(_mm512_sub_epi64(p, c.one), c.zero);
        // SAFETY: `i` is in `0..words.len()`, as in `step`.
        let next_word = _mm512_cvtepu32_epi64(unsafe { _mm512_i64gather_epi32::<4>(i, wbase) });
        Group {
            x,
            p,
            start,
            next_word,
        }
    });

    let n = out.len();
    let tptr: *const i64 = tables.as_ptr().cast();
    let optr: *mut i8 = out.as_mut_ptr().cast();
    let mut i = 0;
    while i < n {
        // This round covers lanes `lane0..lane0 + cnt`, symbols `out[i..i + cnt]`; lane `l`'s
        // symbol and table are at index `i + l - lane0`.
        let lane0 = (first + i) % LANES;
        let cnt = (LANES - lane0).min(n - i);
        if cnt == LANES {
            for (v, gv) in g.iter_mut().enumerate() {
                // SAFETY: `tables[i + 8 v..][..8]`, in bounds (`i + 32 <= n <= tables.len()`);
                // references are 8-byte pointers.
                let tp = unsafe { _mm512_loadu_si512(tptr.add(i + 8 * v).cast()) };
                // SAFETY: every lane's table pointer is a reference; `g`'s invariant holds.
                let sym = unsafe { step(gv, 0xFF, tp, &c, wbase) };
                // SAFETY: `out[i + 8 v..][..8]`, in bounds.
                unsafe { _mm_storel_epi64(optr.add(i + 8 * v).cast(), _mm512_cvtepi64_epi8(sym)) };
            }
        } else {
            let lanes: u32 = ((1u64 << cnt) - 1) as u32;
            let mask = lanes << lane0;
            // Addresses of lane 0's slots (possibly outside the slices: only masked loads and
            // stores use them, and they touch the selected lanes, which are inside).
            let tbase = tptr.wrapping_add(i).wrapping_sub(lane0);
            let obase = optr.wrapping_add(i).wrapping_sub(lane0);
            for (v, gv) in g.iter_mut().enumerate() {
                let m = (mask >> (8 * v)) as u8;
                if m == 0 {
                    continue;
                }
                // SAFETY: the selected lanes `l` are `tables[i + l - lane0]` with `l - lane0 <
                // cnt <= n - i`: in bounds; masked-off elements are not accessed.
                let tp = unsafe { _mm512_maskz_loadu_epi64(m, tbase.wrapping_add(8 * v)) };
                // SAFETY: as above.
                let sym = unsafe { step(gv, m, tp, &c, wbase) };
                // SAFETY: `out[i + l - lane0]` for the selected lanes, in bounds.
                unsafe { _mm512_mask_cvtepi64_storeu_epi8(obase.wrapping_add(8 * v), m, sym) };
            }
        }
        i += cnt;
    }
    for (v, gv) in g.iter().enumerate() {
        // SAFETY: as for the loads above.
        unsafe {
            _mm512_storeu_si512(state[8 * v..].as_mut_ptr().cast(), gv.x);
            _mm512_storeu_si512(pos[8 * v..].as_mut_ptr().cast(), gv.p);
        }
    }
}
