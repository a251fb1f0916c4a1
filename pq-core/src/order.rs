//! The ranking order of scores (`spec/PQ.md` §5.3) as unsigned integer keys: score descending
//! under IEEE `totalOrder` (`-0.0` below `+0.0`), NaN ranked as `-inf`. A larger key ranks
//! higher, so selection works on `u32` compares, which vectorize and have no NaN cases.

/// The ranking key of a score: a larger key ranks higher. It orders scores as IEEE `totalOrder`
/// does (`-0.0` below `+0.0`), with NaN mapped to the key of `-inf`.
#[inline(always)]
pub(crate) fn order_key(s: f32) -> u32 {
    let b = if s.is_nan() {
        f32::NEG_INFINITY.to_bits()
    } else {
        s.to_bits()
    };
    if b & 0x8000_0000 != 0 {
        !b
    } else {
        b | 0x8000_0000
    }
}

/// The score of a key (the inverse of [`order_key`] on non-NaN scores).
#[inline]
pub(crate) fn key_value(key: u32) -> f32 {
    f32::from_bits(if key & 0x8000_0000 != 0 {
        key & 0x7FFF_FFFF
    } else {
        !key
    })
}
