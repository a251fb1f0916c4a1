//! Rotary position embedding (RoPE) on stored keys: the angle of each channel pair, one head
//! vector rotated to a position (what token importance uses), and keys moved from positions
//! `p..p + n` to `q..q + n` (what CacheBlend does to a chunk's cache reused at another place).
//!
//! Pair `j` of a head of `d` channels turns by `pos / scaling * theta^(-2j/d)`: channels
//! `(j, j + d/2)` for NeoX pairing, `(2j, 2j + 1)` for GPT-J. Turning is additive, so moving
//! post-rotary keys by `delta = q - p` positions turns every token's pair `j` by the same angle,
//! whatever its position: a [`Shift`] precomputes those cosines and sines once.

use core::fmt;

use crate::kv::{KvCache, Rope, RopeStyle};
use alloc::vec::Vec;

/// Why keys cannot be rotated.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub enum RopeError {
    /// The cache records no rotary pairing, so its keys carry no position to move.
    NoRotary,
    /// Rotary pairs need an even head dimension.
    OddHeadDim {
        /// The head dimension.
        head_dim: u32,
    },
    /// `theta` must be finite and above 1, `scaling` finite and above 0.
    Settings {
        /// The base.
        theta: f32,
        /// The linear position scaling.
        scaling: f32,
    },
    /// A position outside `0..2^53` (where f64 stops counting exactly).
    Position {
        /// The position.
        pos: u64,
    },
}

impl fmt::Display for RopeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RopeError::NoRotary => f.write_str(
                "the cache records no rotary pairing (NeoX or GPT-J): its keys cannot be moved",
            ),
            RopeError::OddHeadDim { head_dim } => {
                write!(f, "head dimension {head_dim} is odd: rotary pairs need an even one")
            }
            RopeError::Settings { theta, scaling } => write!(
                f,
                "rotary theta {theta} and scaling {scaling}: theta must be finite and above 1, \
                 scaling finite and above 0"
            ),
            RopeError::Position { pos } => write!(f, "position {pos} is beyond 2^53"),
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for RopeError {}

/// Largest position kept exact in the f64 angle arithmetic.
const MAX_POSITION: u64 = 1 << 53;

/// Frequency of rotary pair `j` of a head of `d` channels at position `pos`, in radians. Settings
/// out of range fall back to theta 10000 and scaling 1 (the importance hints tolerate any
/// header; [`Shift::new`] refuses them instead).
pub fn pair_angle(rope: &Rope, d: usize, j: usize, pos: f64) -> f64 {
    let scaling = if rope.scaling.is_finite() && rope.scaling > 0.0 {
        rope.scaling as f64
    } else {
        1.0
    };
    let theta = if rope.theta.is_finite() && rope.theta > 1.0 {
        rope.theta as f64
    } else {
        10000.0
    };
    (pos / scaling) * libm::pow(theta, -2.0 * j as f64 / d as f64)
}

/// The channels of rotary pair `j` of a head of `d` channels (`None` without pairing).
pub fn pair(style: RopeStyle, d: usize, j: usize) -> Option<(usize, usize)> {
    match style {
        RopeStyle::NeoX => Some((j, j + d / 2)),
        RopeStyle::GptJ => Some((2 * j, 2 * j + 1)),
        RopeStyle::None => None,
    }
}

/// The sine and cosine of rotary pair `j`'s angle at position `pos` ([`pair_angle`]), as
/// [`rotate`] applies them: `v[a] = x1 * c - x2 * s`, `v[b] = x2 * c + x1 * s` for the pair's
/// channels `(a, b)` ([`pair`]) holding `(x1, x2)`.
pub fn pair_sin_cos(rope: &Rope, d: usize, j: usize, pos: f64) -> (f64, f64) {
    let ang = pair_angle(rope, d, j, pos);
    (libm::sin(ang), libm::cos(ang))
}

/// Rotates one head vector `v` (`d` values) to position `pos` (negative: un-rotates), in f64.
pub fn rotate(v: &mut [f64], pos: f64, rope: &Rope) {
    rotate_by(v, rope.style, &pair_rotations(rope, v.len(), pos));
}

/// The sine and cosine of every rotary pair of a head of `d` channels at position `pos`
/// ([`pair_sin_cos`]), for [`rotate_by`] to turn any number of heads with: empty where
/// [`rotate`] leaves a head as it is (an odd `d`, no pairing).
pub fn pair_rotations(rope: &Rope, d: usize, pos: f64) -> Vec<(f64, f64)> {
    if !d.is_multiple_of(2) || pair(rope.style, d, 0).is_none() {
        return Vec::new();
    }
    (0..d / 2).map(|j| pair_sin_cos(rope, d, j, pos)).collect()
}

/// Rotates one head vector `v` by `rotations` ([`pair_rotations`] for `v.len()` channels and
/// pairing `style`; [`rotate`] computes them for one head). A table of another length leaves
/// `v` as it is.
pub fn rotate_by(v: &mut [f64], style: RopeStyle, rotations: &[(f64, f64)]) {
    let d = v.len();
    if rotations.len() * 2 != d {
        return;
    }
    for (j, &(s, c)) in rotations.iter().enumerate() {
        let Some((a, b)) = pair(style, d, j) else {
            return;
        };
        let (x1, x2) = (v[a], v[b]);
        v[a] = x1 * c - x2 * s;
        v[b] = x2 * c + x1 * s;
    }
}

/// The checks every rotation of stored keys makes.
fn check(rope: &Rope, head_dim: u32) -> Result<(), RopeError> {
    if rope.style == RopeStyle::None {
        return Err(RopeError::NoRotary);
    }
    if !head_dim.is_multiple_of(2) {
        return Err(RopeError::OddHeadDim { head_dim });
    }
    let theta_ok = rope.theta.is_finite() && rope.theta > 1.0;
    if !(theta_ok && rope.scaling.is_finite() && rope.scaling > 0.0) {
        return Err(RopeError::Settings {
            theta: rope.theta,
            scaling: rope.scaling,
        });
    }
    Ok(())
}

/// The rotation of post-rotary head vectors by `delta` positions: per pair, its cosine and
/// sine (computed in f64, rounded to f32).
#[derive(Clone, Debug, PartialEq)]
pub struct Shift {
    style: RopeStyle,
    head_dim: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl Shift {
    /// The rotation by `delta` positions (negative moves keys earlier) for heads of `head_dim`
    /// channels.
    pub fn new(rope: &Rope, head_dim: u32, delta: i64) -> Result<Shift, RopeError> {
        check(rope, head_dim)?;
        if delta.unsigned_abs() > MAX_POSITION {
            return Err(RopeError::Position {
                pos: delta.unsigned_abs(),
            });
        }
        let d = head_dim as usize;
        let angles = (0..d / 2).map(|j| pair_angle(rope, d, j, delta as f64));
        let (cos, sin) = angles
            .map(|a| (libm::cos(a) as f32, libm::sin(a) as f32))
            .unzip();
        Ok(Shift {
            style: rope.style,
            head_dim: d,
            cos,
            sin,
        })
    }

    /// Rotates every head vector of `k` (consecutive `head_dim` values; a trailing partial head
    /// is left as it is).
    pub fn apply(&self, k: &mut [f32]) {
        let (c, s) = (&self.cos[..], &self.sin[..]);
        for head in k.chunks_exact_mut(self.head_dim) {
            match self.style {
                RopeStyle::NeoX => {
                    let (lo, hi) = head.split_at_mut(self.head_dim / 2);
                    for (((x1, x2), &c), &s) in lo.iter_mut().zip(hi).zip(c).zip(s) {
                        let (a, b) = (*x1, *x2);
                        *x1 = a * c - b * s;
                        *x2 = b * c + a * s;
                    }
                }
                _ => {
                    for ((p, &c), &s) in head.chunks_exact_mut(2).zip(c).zip(s) {
                        let (a, b) = (p[0], p[1]);
                        p[0] = a * c - b * s;
                        p[1] = b * c + a * s;
                    }
                }
            }
        }
    }
}

/// Rotates pre-rotary head vectors `k` (`[tokens, heads, head_dim]`, token `i` at position
/// `first + i`) to their positions: the keys a model would have stored.
pub fn rotate_to_positions(
    k: &mut [f32],
    heads: usize,
    first: u64,
    rope: &Rope,
    head_dim: u32,
) -> Result<(), RopeError> {
    check(rope, head_dim)?;
    let d = head_dim as usize;
    let row = heads * d;
    if row == 0 {
        return Ok(());
    }
    let tokens = (k.len() / row) as u64;
    let last = first.checked_add(tokens).filter(|&p| p <= MAX_POSITION);
    if last.is_none() {
        return Err(RopeError::Position {
            pos: first.saturating_add(tokens),
        });
    }
    let mut v = Vec::with_capacity(d);
    for (i, token) in k.chunks_exact_mut(row).enumerate() {
        for head in token.chunks_exact_mut(d) {
            v.clear();
            v.extend(head.iter().map(|&x| x as f64));
            rotate(&mut v, (first + i as u64) as f64, rope);
            head.iter_mut().zip(&v).for_each(|(x, &y)| *x = y as f32);
        }
    }
    Ok(())
}

/// Moves a cache to start at position `to`: post-rotary keys are turned by `to - first_position`
/// (in the cache's dtype, through f32), pre-rotary keys are left as they are; `first_position`
/// becomes `to`. Values never change.
pub fn shift_cache(cache: &mut KvCache, to: u64) -> Result<(), RopeError> {
    let rope = cache.meta.rope;
    check(&rope, cache.shape.head_dim)?;
    let from = cache.meta.first_position;
    let end = to.checked_add(u64::from(cache.shape.tokens));
    if to > MAX_POSITION || from > MAX_POSITION || end.is_none_or(|e| e > MAX_POSITION) {
        return Err(RopeError::Position { pos: to.max(from) });
    }
    if !rope.k_pre_rope {
        let shift = Shift::new(&rope, cache.shape.head_dim, to as i64 - from as i64)?;
        // Through a small f32 buffer (whole heads), so that the keys stay in cache.
        let mut buf = alloc::vec![0.0f32; 64 * cache.shape.head_dim as usize];
        for t in &mut cache.k {
            for start in (0..t.len()).step_by(buf.len()) {
                let x = &mut buf[..(t.len() - start).min(64 * shift.head_dim)];
                t.as_ref().read_f32(start, x);
                shift.apply(x);
                t.as_mut().write_f32(start, x);
            }
        }
    }
    cache.meta.first_position = to;
    Ok(())
}

#[cfg(test)]
mod tests;
