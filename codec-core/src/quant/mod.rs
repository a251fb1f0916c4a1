//! Anchor/delta quantization of one block (one layer's K or V over one chunk's tokens)
//! (`spec/FORMAT.md`, "Quantization").
//!
//! Tokens of a chunk form groups of `group` rows starting at the chunk's first row. The first row
//! of a group is its *anchor*: each channel is coded as `round((x - mean) / anchor_step)`. Every
//! other row is a *delta* against the predictor `mean + w * (a' - mean)`, where `a'` is the
//! anchor as the decoder reconstructs it (closed loop) and `w = weight / 16`. Rows whose absolute
//! position is below the stream's sink count are stored exactly and produce no symbols.
//!
//! All arithmetic is f32 with round-to-nearest-even and no fused multiply-add, in the order
//! written here, so that every implementation reconstructs identical values.

use crate::consts::{EXP_MULT, MAX_SYMBOL};
use alloc::vec::Vec;

/// Quantization parameters of one channel of one tensor of one layer (a profile stores them per
/// `(layer, K/V, channel)`, §4.2).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ChannelParams {
    /// Channel mean: the anchor predictor, and the point deltas shrink towards.
    pub mean: f32,
    /// Base step of non-anchor tokens (multiplied by the level's multiplier).
    pub delta_step: f32,
    /// Base step of anchor tokens (multiplied by the level's multiplier).
    pub anchor_step: f32,
    /// Weight of the reconstructed anchor in the delta predictor, in sixteenths (0..=16).
    pub weight: u8,
}

/// Per-channel constants of one block at one level, precomputed once.
#[derive(Clone, Debug, Default)]
pub struct BlockConsts {
    /// Channel means.
    pub mean: Vec<f32>,
    /// Anchor steps (`anchor_step * multiplier`).
    pub anchor_step: Vec<f32>,
    /// Delta steps (`delta_step * multiplier`).
    pub delta_step: Vec<f32>,
    /// Anchor weights as f32 (`weight / 16`, exact).
    pub weight: Vec<f32>,
}

impl BlockConsts {
    /// Derives the block constants of one `(layer, K/V)` at a level multiplier.
    pub fn new(params: &[ChannelParams], mult: f32) -> Self {
        let mut k = BlockConsts::default();
        k.fill(params, mult);
        k
    }
    /// Refills the constants, reusing the allocations.
    pub fn fill(&mut self, params: &[ChannelParams], mult: f32) {
        self.mean.clear();
        self.anchor_step.clear();
        self.delta_step.clear();
        self.weight.clear();
        for p in params {
            self.mean.push(p.mean);
            self.anchor_step.push(p.anchor_step * mult);
            self.delta_step.push(p.delta_step * mult);
            self.weight.push(p.weight as f32 * 0.0625);
        }
    }
    /// Channels.
    pub fn channels(&self) -> usize {
        self.mean.len()
    }
}

/// Quantizes to a symbol: `round_half_away_from_zero(r / step)`, clamped to ±[`MAX_SYMBOL`]
/// (NaN gives 0).
///
/// Identical to `libm::roundf(r / step)` followed by the clamp (a unit test checks it on
/// every half-integer boundary and on random values), but without a libm call and without a
/// branch, so that the block's loops vectorize: the quotient is clamped first (NaN stays NaN and
/// converts to 0); for `|q| < 2^23`, `q - trunc(q)` is exact, so comparing it with `±0.5` rounds
/// exactly, and from `2^23` up `q` is an integer, its fraction 0.
#[inline]
fn quantize(r: f32, step: f32) -> i32 {
    let max = MAX_SYMBOL as f32; // 2^24, exact
    let q = (r / step).clamp(-max, max);
    let t = q as i32;
    let f = q - t as f32;
    t + i32::from(f >= 0.5) - i32::from(f <= -0.5)
}

/// The reference form of [`quantize`] (libm's `roundf`), for tests.
#[cfg(test)]
fn quantize_ref(r: f32, step: f32) -> i32 {
    let q = libm::roundf(r / step);
    if q >= MAX_SYMBOL as f32 {
        MAX_SYMBOL
    } else if q <= -(MAX_SYMBOL as f32) {
        -MAX_SYMBOL
    } else {
        q as i32
    }
}

/// The delta predictor `mean + w * (anchor - mean)`, in this operation order.
#[inline]
pub fn predict(mean: f32, w: f32, anchor: f32) -> f32 {
    mean + w * (anchor - mean)
}

/// Step exponents of one block: one per `(non-sink row, head)`, row-major, each `< 16`; an
/// empty slice means all zero.
#[derive(Clone, Copy, Debug)]
pub struct Exps<'a> {
    /// The exponents (`(rows - sink_rows) * heads` of them, or none).
    pub exps: &'a [u8],
    /// Channels per head.
    pub head_dim: usize,
}

impl Exps<'_> {
    /// All exponents zero.
#[cfg_attr(not(feature = "internals"), allow(dead_code))] // used by tests, benches and fuzzing
    pub const NONE: Exps<'static> = Exps {
        exps: &[],
        head_dim: 1,
    };
    /// Step multiplier of channel `ch` of non-sink row `i` (`heads` heads per row).
    /// Channels per exponent segment of a `c`-channel row: one head, or the whole row when
    /// there are no exponents.
    #[inline]
    fn seg(&self, c: usize) -> usize {
        if self.exps.is_empty() {
            c
        } else {
            self.head_dim.max(1)
        }
    }

    /// Step multiplier of segment `j` of non-sink row `i` (`heads` segments per row).
    #[inline]
    pub(crate) fn seg_mult(&self, i: usize, heads: usize, j: usize) -> f32 {
        if self.exps.is_empty() {
            1.0
        } else {
            EXP_MULT[(self.exps[i * heads + j] & 15) as usize]
        }
    }
}

/// Quantizes one block.
///
/// `x` holds `rows * C` values (row-major, `C = consts.channels()`); the first `sink_rows` rows
/// are sinks. Channel `ch` of non-sink row `i` uses the step `step[ch] * EXP_MULT[e]`, `e` its
/// head's exponent in `exps`. Symbols of the non-sink rows are appended to `symbols` in row-major
/// order, and `recon` (same size as `x`) receives the decoder's reconstruction (sinks: `x`
/// itself).
pub fn quantize_block(
    x: &[f32],
    consts: &BlockConsts,
    group: usize,
    sink_rows: usize,
    exps: Exps<'_>,
    symbols: &mut Vec<i32>,
    recon: &mut [f32],
) {
    let c = consts.channels();
    let rows = x.len() / c;
    let heads = c / exps.head_dim.max(1);
    debug_assert_eq!(recon.len(), x.len());
    let start = symbols.len();
    symbols.resize(start + rows.saturating_sub(sink_rows) * c, 0);
    let syms = &mut symbols[start..];
    let seg = exps.seg(c);
    for row in 0..rows {
        let xr = &x[row * c..(row + 1) * c];
        if row < sink_rows {
            recon[row * c..(row + 1) * c].copy_from_slice(xr);
            continue;
        }
        let i = row - sink_rows;
        let row_syms = &mut syms[i * c..(i + 1) * c];
        let mults = |j: usize| exps.seg_mult(i, heads, j);
        if row % group == 0 {
            let out = &mut recon[row * c..(row + 1) * c];
            quantize_anchor_row(xr, consts, seg, mults, row_syms, out);
        } else {
            let a0 = (row - row % group) * c;
            let (head, tail) = recon.split_at_mut(row * c);
            let anchor = &head[a0..a0 + c];
            quantize_delta_row(xr, anchor, consts, seg, mults, row_syms, &mut tail[..c]);
        }
    }
}

/// An anchor row: each value quantized against its channel's mean, with the anchor step times
/// `mult(j)` in segment `j` (`seg` channels each). Its loop and the delta row's are kept apart:
/// one loop over an iterator of predictions encoded measurably slower (criterion, `codec`).
#[inline(always)]
fn quantize_anchor_row(
    xr: &[f32],
    consts: &BlockConsts,
    seg: usize,
    mult: impl Fn(usize) -> f32,
    syms: &mut [i32],
    out: &mut [f32],
) {
    for j in 0..xr.len() / seg {
        let m = mult(j);
        let r = j * seg..(j + 1) * seg;
        for ((((o, q), &x), &mean), &st) in out[r.clone()]
            .iter_mut()
            .zip(&mut syms[r.clone()])
            .zip(&xr[r.clone()])
            .zip(&consts.mean[r.clone()])
            .zip(&consts.anchor_step[r])
        {
            let step = st * m;
            let s = quantize(x - mean, step);
            *q = s;
            *o = mean + s as f32 * step;
        }
    }
}

/// A delta row: each value quantized against its prediction from the group's reconstructed
/// `anchor` row, with the delta step times `mult(j)` in segment `j`.
#[inline(always)]
fn quantize_delta_row(
    xr: &[f32],
    anchor: &[f32],
    consts: &BlockConsts,
    seg: usize,
    mult: impl Fn(usize) -> f32,
    syms: &mut [i32],
    out: &mut [f32],
) {
    for j in 0..xr.len() / seg {
        let m = mult(j);
        let r = j * seg..(j + 1) * seg;
        for (((((o, q), &x), &a), &mean), (&w, &st)) in out[r.clone()]
            .iter_mut()
            .zip(&mut syms[r.clone()])
            .zip(&xr[r.clone()])
            .zip(&anchor[r.clone()])
            .zip(&consts.mean[r.clone()])
            .zip(consts.weight[r.clone()].iter().zip(&consts.delta_step[r]))
        {
            let step = st * m;
            let pred = predict(mean, w, a);
            let s = quantize(x - pred, step);
            *q = s;
            *o = pred + s as f32 * step;
        }
    }
}

/// Reconstructs one block from its symbols (the decoder's arithmetic, reference form).
///
/// `recon` holds `rows * C` values; its first `sink_rows` rows must already hold the sink values.
/// `symbols` holds the non-sink rows' symbols in row-major order.
#[cfg_attr(not(feature = "internals"), allow(dead_code))] // used by tests, benches and fuzzing
pub fn dequantize_block(
    symbols: &[i32],
    consts: &BlockConsts,
    group: usize,
    sink_rows: usize,
    exps: Exps<'_>,
    recon: &mut [f32],
) {
    let c = consts.channels();
    let rows = recon.len() / c;
    for (row, s) in (sink_rows..rows).zip(symbols.chunks_exact(c)) {
        dequantize_row(s, consts, row, group, sink_rows, exps, recon);
    }
}

/// Reconstructs row `row` (a non-sink row) of a block from its `C` symbols `s`, writing
/// `recon[row * C..(row + 1) * C]`; a delta row reads its anchor row, which must already be
/// reconstructed in `recon`. [`dequantize_block`] is this for every non-sink row in order.
#[inline]
pub fn dequantize_row(
    s: &[i32],
    consts: &BlockConsts,
    row: usize,
    group: usize,
    sink_rows: usize,
    exps: Exps<'_>,
    recon: &mut [f32],
) {
    let c = consts.channels();
    let i = row - sink_rows;
    if row.is_multiple_of(group) {
        dequantize_into(s, consts, None, i, exps, &mut recon[row * c..(row + 1) * c]);
    } else {
        let a0 = (row - row % group) * c;
        let (head, tail) = recon.split_at_mut(row * c);
        dequantize_into(s, consts, Some(&head[a0..a0 + c]), i, exps, &mut tail[..c]);
    }
}

/// The arithmetic of [`dequantize_row`] with the anchor row and the output passed directly:
/// `anchor` is `None` for an anchor row and the reconstructed anchor row for a delta row; `i`
/// is the row's index among the block's non-sink rows (it selects the exponents); `out` gets
/// the `C` reconstructed values.
#[inline]
pub fn dequantize_into(
    s: &[i32],
    consts: &BlockConsts,
    anchor: Option<&[f32]>,
    i: usize,
    exps: Exps<'_>,
    out: &mut [f32],
) {
    let c = consts.channels();
    let heads = c / exps.head_dim.max(1);
    let seg = exps.seg(c);
    match anchor {
        None => {
            for j in 0..c / seg {
                let m = exps.seg_mult(i, heads, j);
                let r = j * seg..(j + 1) * seg;
                for (((o, &q), &mean), &st) in out[r.clone()]
                    .iter_mut()
                    .zip(&s[r.clone()])
                    .zip(&consts.mean[r.clone()])
                    .zip(&consts.anchor_step[r])
                {
                    *o = mean + q as f32 * (st * m);
                }
            }
        }
        Some(anchor) => {
            for j in 0..c / seg {
                let m = exps.seg_mult(i, heads, j);
                let r = j * seg..(j + 1) * seg;
                for ((((o, &q), &a), &mean), (&w, &st)) in out[r.clone()]
                    .iter_mut()
                    .zip(&s[r.clone()])
                    .zip(&anchor[r.clone()])
                    .zip(&consts.mean[r.clone()])
                    .zip(consts.weight[r.clone()].iter().zip(&consts.delta_step[r]))
                {
                    *o = predict(mean, w, a) + q as f32 * (st * m);
                }
            }
        }
    }
}

/// One segment of a row reconstructed straight from its table indices (the decoder's fused form
/// of the index mapping of `spec/FORMAT.md` §6.4 and [`dequantize_into`]): channel `k` of the
/// segment has index `idx[k]` in a table of radius `radius[k]`, so its symbol is
/// `idx[k] - radius[k]`, and constants `consts` at channels `first + k`; `m` is the segment's
/// step multiplier and `anchor` the segment of the anchor row (`None` for an anchor row).
///
/// Returns `true` if some index is an escape (symbol `> radius`): those outputs are not final,
/// and the caller replaces them with [`dequantize_one`] of the escape value.
#[allow(clippy::too_many_arguments)]
#[inline]
pub fn dequantize_indices(
    idx: &[u8],
    radius: &[i32],
    consts: &BlockConsts,
    first: usize,
    m: f32,
    anchor: Option<&[f32]>,
    out: &mut [f32],
) -> bool {
    let n = out.len();
    let r = first..first + n;
    let mut escape = false;
    match anchor {
        None => {
            for ((o, (&i, &rad)), (&mean, &st)) in out
                .iter_mut()
                .zip(idx.iter().zip(radius))
                .zip(consts.mean[r.clone()].iter().zip(&consts.anchor_step[r]))
            {
                let q = i32::from(i) - rad;
                escape |= q > rad;
                *o = mean + q as f32 * (st * m);
            }
        }
        Some(anchor) => {
            for (((o, (&i, &rad)), &a), ((&mean, &w), &st)) in
                out.iter_mut().zip(idx.iter().zip(radius)).zip(anchor).zip(
                    consts.mean[r.clone()]
                        .iter()
                        .zip(&consts.weight[r.clone()])
                        .zip(&consts.delta_step[r]),
                )
            {
                let q = i32::from(i) - rad;
                escape |= q > rad;
                *o = predict(mean, w, a) + q as f32 * (st * m);
            }
        }
    }
    escape
}

/// Channel `ch` of a row reconstructed from symbol `q` with step multiplier `m` and, for a
/// delta row, the reconstructed anchor value `anchor`: the arithmetic of [`dequantize_into`] for
/// one channel.
#[inline]
pub fn dequantize_one(consts: &BlockConsts, ch: usize, q: i32, m: f32, anchor: Option<f32>) -> f32 {
    match anchor {
        None => consts.mean[ch] + q as f32 * (consts.anchor_step[ch] * m),
        Some(a) => {
            predict(consts.mean[ch], consts.weight[ch], a) + q as f32 * (consts.delta_step[ch] * m)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::vec;

    fn consts(c: usize) -> BlockConsts {
        let params: Vec<ChannelParams> = (0..c)
            .map(|i| ChannelParams {
                mean: i as f32 * 0.1,
                delta_step: 0.05,
                anchor_step: 0.025,
                weight: (i % 17) as u8,
            })
            .collect();
        BlockConsts::new(&params, 1.0)
    }

    #[test]
    fn fast_rounding_equals_roundf() {
        // Every half-integer and its neighbours up to 2^24, then random bit patterns.
        let mut k = 0u32;
        while k < (1 << 25) {
            let h = k as f32 * 0.5;
            for x in [h, -h] {
                for v in [
                    f32::from_bits(x.to_bits().wrapping_sub(1)),
                    x,
                    f32::from_bits(x.to_bits() + 1),
                ] {
                    assert_eq!(quantize(v, 1.0), quantize_ref(v, 1.0), "{v}");
                }
            }
            k += if k < 1 << 16 { 1 } else { 997 };
        }
        let mut z = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..2_000_000 {
            z ^= z << 13;
            z ^= z >> 7;
            z ^= z << 17;
            let (r, st) = (f32::from_bits(z as u32), f32::from_bits((z >> 32) as u32));
            assert_eq!(quantize(r, st), quantize_ref(r, st), "{r} / {st}");
        }
        for v in [
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            8_388_607.5,
            16_777_216.0,
            3e9,
            -3e9,
        ] {
            assert_eq!(quantize(v, 1.0), quantize_ref(v, 1.0), "{v}");
        }
    }

    #[test]
    fn closed_loop_error_is_bounded_by_half_step() {
        let c = 8;
        let k = consts(c);
        let rows = 23;
        let x: Vec<f32> = (0..rows * c)
            .map(|i| libm::sinf(i as f32 * 0.37) * 3.0)
            .collect();
        let mut sym = Vec::new();
        let mut rec = vec![0.0; x.len()];
        quantize_block(&x, &k, 10, 2, Exps::NONE, &mut sym, &mut rec);
        assert_eq!(sym.len(), (rows - 2) * c);
        for (i, (a, b)) in x.iter().zip(&rec).enumerate() {
            let row = i / c;
            let step = if row < 2 {
                0.0
            } else if row % 10 == 0 {
                0.025
            } else {
                0.05
            };
            assert!((a - b).abs() <= step * 0.5 + 1e-6, "row {row}: {a} vs {b}");
        }
        let mut dec = vec![0.0; x.len()];
        dec[..2 * c].copy_from_slice(&x[..2 * c]);
        dequantize_block(&sym, &k, 10, 2, Exps::NONE, &mut dec);
        assert_eq!(
            dec, rec,
            "decoder must reproduce the encoder's reconstruction bit for bit"
        );
    }

    #[test]
    fn exponents_scale_the_step_and_round_trip() {
        assert_eq!(EXP_MULT[0], 1.0);
        assert_eq!(EXP_MULT[2], 2.0);
        assert_eq!(EXP_MULT[1].to_bits(), 0x3FB5_04F3);
        assert_eq!(EXP_MULT[15], EXP_MULT[1] * 128.0);
        let c = 8;
        let k = consts(c);
        let rows = 25;
        let x: Vec<f32> = (0..rows * c)
            .map(|i| libm::sinf(i as f32 * 0.91) * 2.0)
            .collect();
        // Two heads of 4 channels; 24 non-sink rows.
        let exps: Vec<u8> = (0..24 * 2).map(|i| (i * 7 % 16) as u8).collect();
        let e = Exps {
            exps: &exps,
            head_dim: 4,
        };
        let mut sym = Vec::new();
        let mut rec = vec![0.0; x.len()];
        quantize_block(&x, &k, 10, 1, e, &mut sym, &mut rec);
        for (i, (a, b)) in x.iter().zip(&rec).enumerate().skip(c) {
            let row = i / c;
            let m = EXP_MULT[exps[(row - 1) * 2 + (i % c) / 4] as usize];
            let base = if row % 10 == 0 { 0.025 } else { 0.05 };
            assert!((a - b).abs() <= base * m * 0.5 * 1.0001, "row {row}");
        }
        let mut dec = vec![0.0; x.len()];
        dec[..c].copy_from_slice(&x[..c]);
        dequantize_block(&sym, &k, 10, 1, e, &mut dec);
        assert_eq!(dec, rec);
    }
}
