//! Each level's frequency tables, learned from the symbols the samples produce and indexed by
//! spread.

use crate::consts::MAX_RADIUS;
use crate::profile::{LevelTables, SymbolTable};
use crate::quant::{predict, BlockConsts, ChannelParams};
use crate::rans::FreqTable;
use alloc::vec;
use alloc::vec::Vec;

use super::steps::simulate;
use super::{to_f32, LearnParams, Sample};

/// Lowest and highest spread bucket (quarter octaves of the residual RMS in steps).
const B_PER_OCTAVE: i32 = 4;
const B_MIN: i32 = -4 * B_PER_OCTAVE;
const B_MAX: i32 = 10 * B_PER_OCTAVE;

/// What pass 1 of [`learn_tables`] gathers: every sample coded as the encoder would, giving the
/// mean square of the residual in base-step units per `(layer, kv, kind, channel)` (sum and
/// count) and every value symbol with its map slot and exponent.
pub(super) struct LevelStats {
    ss: Vec<f64>,
    cnt: Vec<f64>,
    /// Symbols with their map slot and exponent, kept for pass 2.
    coded: Vec<(u32, u8, i32)>,
}

/// Pass 1 of [`learn_tables`] at one level multiplier.
#[allow(clippy::too_many_arguments)]
pub(super) fn level_stats(
    samples: &[Sample<'_>],
    exps: &[Vec<Vec<u8>>],
    all: &[ChannelParams],
    mult: f32,
    layers: usize,
    c: usize,
    d: usize,
    params: &LearnParams,
) -> LevelStats {
    let group = params.group as usize;
    let heads = c / d;
    let n_map = layers * 4 * c;
    let mut stats = LevelStats {
        ss: vec![0f64; n_map],
        cnt: vec![0f64; n_map],
        coded: Vec::new(),
    };
    for (si, s) in samples.iter().enumerate() {
        for layer in 0..layers {
            for kv in 0..2 {
                let x = to_f32(if kv == 0 {
                    s.kv.k[layer]
                } else {
                    s.kv.v[layer]
                });
                let p = &all[(layer * 2 + kv) * c..(layer * 2 + kv + 1) * c];
                let consts = BlockConsts::new(p, mult);
                let mut chunks = Vec::new();
                let rec = simulate(
                    &x,
                    p,
                    mult,
                    c,
                    group,
                    params,
                    s.kv.meta.first_position,
                    &exps[si][layer],
                    d,
                    |start, sink, syms, ce| {
                        for (i, &v) in syms.iter().enumerate() {
                            let row = sink + i / c;
                            let ch = i % c;
                            let kind = usize::from(!row.is_multiple_of(group));
                            let e = if ce.is_empty() {
                                0
                            } else {
                                ce[(i / c) * heads + ch / d]
                            };
                            let slot = ((layer * 2 + kv) * 2 + kind) * c + ch;
                            stats.coded.push((slot as u32, e, v));
                        }
                        chunks.push((start, sink, syms.len() / c));
                    },
                );
                let block = (layer * 2 + kv) * 2;
                stats.add_residuals(&x, &rec, &consts, &chunks, block, c, group);
            }
        }
    }
    stats
}

impl LevelStats {
    /// Adds the squared residuals in step units of the rows of `chunks` (`(start, sink,
    /// rows)`, as `simulate` coded them) of one tensor `x`, reconstructed as `rec`, to its
    /// (kind, channel) slots from `block * c` on.
    #[allow(clippy::too_many_arguments)]
    fn add_residuals(
        &mut self,
        x: &[f32],
        rec: &[f32],
        consts: &BlockConsts,
        chunks: &[(usize, usize, usize)],
        block: usize,
        c: usize,
        group: usize,
    ) {
        for &(start, sink, n) in chunks {
            for r in sink..sink + n {
                let row = start + r;
                let kind = usize::from(r % group != 0);
                let arow = start + r - r % group;
                for ch in 0..c {
                    let xv = x[row * c + ch];
                    let (res, step) = if kind == 0 {
                        (xv - consts.mean[ch], consts.anchor_step[ch])
                    } else {
                        let pred = predict(consts.mean[ch], consts.weight[ch], rec[arow * c + ch]);
                        (xv - pred, consts.delta_step[ch])
                    };
                    let z = (res / step) as f64;
                    let slot = (block + kind) * c + ch;
                    self.ss[slot] += z * z;
                    self.cnt[slot] += 1.0;
                }
            }
        }
    }
}

/// Learns the frequency tables of one level.
///
/// Tables are indexed by *spread*: the RMS of a channel's residual in units of its step, in
/// quarter octaves (`round(4 log2 rms)`). A channel coded at step exponent `e` has a spread `2e`
/// quarter octaves lower, so the table of bucket `b` links down to bucket `b - 2`. Each table's
/// frequencies pool the symbols that are actually coded with it. `stats` is the level's
/// [`level_stats`].
pub(super) fn learn_tables(stats: LevelStats) -> LevelTables {
    const HR: usize = MAX_RADIUS as usize;
    let LevelStats { ss, cnt, coded } = stats;
    let bucket0: Vec<i32> = ss
        .iter()
        .zip(&cnt)
        .map(|(s, n)| {
            let rms = libm::sqrt(s / n.max(1.0)).max(1e-9);
            (libm::round(B_PER_OCTAVE as f64 * libm::log2(rms)) as i32).clamp(B_MIN, B_MAX)
        })
        .collect();
    let bucket_of = |slot: usize, e: u8| (bucket0[slot] - (B_PER_OCTAVE / 2) * e as i32).max(B_MIN);
    let mut lo = *bucket0.iter().min().unwrap_or(&0);
    let hi = *bucket0.iter().max().unwrap_or(&0);
    for &(slot, e, _) in &coded {
        lo = lo.min(bucket_of(slot as usize, e));
    }
    let n_tables = (hi - lo + 1) as usize;
    // Pass 2: histograms per bucket over -127..=127 plus escapes.
    let mut hist = vec![[0u64; 2 * HR + 2]; n_tables];
    for &(slot, e, v) in &coded {
        let b = (bucket_of(slot as usize, e) - lo) as usize;
        let idx = if v.unsigned_abs() as usize <= HR {
            (v + HR as i32) as usize
        } else {
            2 * HR + 1
        };
        hist[b][idx] += 1;
    }
    // Empty buckets borrow the nearest non-empty bucket (below first).
    let filled: Vec<bool> = hist.iter().map(|h| h.iter().any(|&x| x > 0)).collect();
    let mut tables = Vec::with_capacity(n_tables);
    for b in 0..n_tables {
        let src = if filled[b] {
            b
        } else {
            (0..n_tables)
                .filter(|&o| filled[o])
                .min_by_key(|&o| (o.abs_diff(b), o > b))
                .unwrap_or(b)
        };
        tables.push(symbol_table(&hist[src]));
    }
    let down = (0..n_tables)
        .map(|t| t.saturating_sub(B_PER_OCTAVE as usize / 2) as u8)
        .collect();
    let map = bucket0.iter().map(|&b| (b - lo) as u8).collect();
    LevelTables { tables, down, map }
}

/// A table for a histogram over `-127..=127` plus escapes: radius 1.5 times the largest value
/// seen (at most 127), values beyond it escaped.
fn symbol_table(pooled: &[u64; 2 * MAX_RADIUS as usize + 2]) -> SymbolTable {
    const HR: usize = MAX_RADIUS as usize;
    let max_seen = (0..=HR)
        .rev()
        .find(|&r| pooled[HR + r] > 0 || pooled[HR - r] > 0)
        .unwrap_or(0);
    let radius = (max_seen + max_seen / 2 + 1).min(HR);
    let mut counts = vec![0u64; 2 * radius + 2];
    #[allow(clippy::needless_range_loop)]
    for v in 0..2 * HR + 1 {
        let val = v as i64 - HR as i64;
        if val.unsigned_abs() as usize <= radius {
            counts[(val + radius as i64) as usize] += pooled[v];
        } else {
            counts[2 * radius + 1] += pooled[v];
        }
    }
    counts[2 * radius + 1] += pooled[2 * HR + 1];
    SymbolTable {
        radius: radius as u8,
        freqs: FreqTable::from_counts(&counts),
    }
}
