//! Learning a profile from sample caches (`kvc profile`, and self-contained encoding).
//!
//! Steps are allocated where the attention output is sensitive, measured rather than assumed:
//! - K: the error of a score `q . k` is `sum_c q_c e_c`, so a channel's step is made inversely
//!   proportional to the RMS of the queries that read it (averaged over each rotary pair, since
//!   rotation mixes the two channels of a pair). Without queries, steps follow each channel's
//!   standard deviation.
//! - V: the attention output weights all channels of V alike, so V gets one step per layer.
//! - Each `(layer, K/V)` is then scaled so that quantizing it alone at multiplier 1 gives the same
//!   attention-output error (`target_error / sqrt(2)`), measured on the samples' queries. Equal
//!   error per layer minimises the mean error over layers for a given number of bits.
//! - The anchor weight of each channel is the least-squares coefficient of `x - mean` on the
//!   anchor's `x - mean`, clamped to `[0, 1]` in sixteenths: on real caches many channels predict
//!   better from their mean than from the anchor, which plain anchor/delta coding ignores.
//!
//! With queries, the profile also stores the token-importance hints (`spec/FORMAT.md` §9.2): the
//! mean pre-rotary query per `(layer, KV head)` and a score threshold per head (a quantile of the
//! samples' scores); calibration and tables see the exponents the encoder will use.
//!
//! Frequency tables are then learned per level from the symbols the samples produce, indexed by
//! spread (the RMS of a channel's residual in steps, in quarter octaves): channels of the same
//! spread share a table, and each table links down to the table two quarter octaves narrower, the
//! one a symbol uses when its token's step is one exponent (half an octave) coarser.
//!
//! Here: the parameters, the samples' checks and the order of the steps; the importance hints
//! in `importance`, each tensor's channel parameters and calibration in `steps`, the tables in
//! `tables`.

use crate::consts::{group_is_valid, MAX_LEVELS};
use crate::error::{EncodeError, ShapeError};
use crate::importance::ImportanceParams;
use crate::kv::{check_dims, KvShape, KvView, TensorRef};
use crate::limits::Limits;
use crate::profile::{Importance, Parts, Profile, ProfileError};
use alloc::vec;
use alloc::vec::Vec;

mod importance;
mod steps;
mod tables;

use importance::{query_means, score_thresholds, step_exponents};
use steps::learn_tensor;
use tables::{learn_tables, level_stats};

/// Queries recorded with a sample, used to measure attention-output error.
#[derive(Clone, Debug)]
pub struct Queries<'a> {
    /// Per layer, `[n_q, q_heads, head_dim]` (after rotary embedding if K is).
    pub q: Vec<&'a [f32]>,
    /// Query heads (a multiple of the cache's KV heads).
    pub q_heads: usize,
    /// Token index (within the sample) of the first query; query `i` attends to tokens
    /// `0..=q_start + i`.
    pub q_start: u64,
}

/// One sample cache, optionally with queries.
#[derive(Clone, Debug)]
pub struct Sample<'a> {
    /// The cache.
    pub kv: KvView<'a>,
    /// Its queries, if recorded.
    pub queries: Option<Queries<'a>>,
}

/// Settings of [`learn_profile`].
#[derive(Clone, Debug, PartialEq)]
pub struct LearnParams {
    /// Step multiplier of each level, finest first.
    pub level_mult: Vec<f32>,
    /// Attention-output error the calibration aims at for multiplier 1 (each of K and V gets
    /// `target_error / sqrt(2)`). Without queries, the relative reconstruction error aimed at.
    pub target_error: f32,
    /// Anchor step as a fraction of the delta step.
    pub anchor_ratio: f32,
    /// Token-group size used when collecting statistics (the stream's group should match).
    pub group: u32,
    /// Chunk size used when collecting statistics.
    pub chunk_tokens: u32,
    /// Sink tokens (absolute positions below this are stored exactly).
    pub n_sink: u16,
    /// Calibration rounds per `(layer, K/V)`.
    pub calibration_rounds: u32,
    /// At most this many queries per layer are used for calibration (evenly spaced).
    pub max_queries: usize,
    /// Token-importance policy (`spec/FORMAT.md` §9.2) to calibrate with and store in the
    /// profile; used only if some sample has queries (they give the mean query).
    pub importance: Option<ImportanceParams>,
}

impl Default for LearnParams {
    fn default() -> Self {
        LearnParams {
            level_mult: DEFAULT_LEVELS.to_vec(),
            target_error: 0.1,
            anchor_ratio: 0.5,
            group: 10,
            chunk_tokens: 1536,
            n_sink: 1,
            calibration_rounds: 3,
            max_queries: 32,
            importance: Some(ImportanceParams::default()),
        }
    }
}

/// Default level multipliers: level 0 near-lossless, the last about one bit per element.
///
/// Calibration aims at attention error `target_error * multiplier` on the samples (0.1 by
/// default); level 2 (`0.145`) is the coarsest level whose error on its own samples stays under
/// 0.015 (the README's results give the measurements behind the ladder).
pub const DEFAULT_LEVELS: [f32; 12] = [
    0.1, 0.12, 0.145, 0.17, 0.25, 0.35, 0.5, 0.65, 0.8, 0.95, 2.0, 4.5,
];

/// Learns a profile from samples. Deterministic: the same samples and parameters give the same
/// bytes on every platform.
pub fn learn_profile(samples: &[Sample<'_>], params: &LearnParams) -> Result<Profile, EncodeError> {
    let first = samples.first().ok_or(EncodeError::NoSamples)?;
    if samples.iter().all(|s| s.kv.shape.tokens == 0) {
        return Err(EncodeError::NoSamples);
    }
    let shape = first.kv.shape;
    check_params(params)?;
    check_samples(samples)?;
    let layers = shape.layers as usize;
    let c = shape.channels();
    let group = params.group as usize;
    let d = shape.head_dim as usize;
    let importance = match params.importance {
        Some(p) if samples.iter().any(|s| s.queries.is_some()) => {
            let query_mean = query_means(samples, layers, c, d);
            let tau = score_thresholds(samples, &query_mean, layers, c, d, p.quantile, params);
            Some(Importance {
                params: p,
                query_mean,
                tau,
            })
        }
        _ => None,
    };
    let exps = step_exponents(samples, layers, importance.as_ref(), params);
    let mut all_params = Vec::with_capacity(layers * 2 * c);
    for layer in 0..layers {
        let layer_exps: Vec<&[u8]> = exps.iter().map(|e| e[layer].as_slice()).collect();
        for kv in 0..2 {
            all_params.extend(learn_tensor(
                samples,
                &sample_tensors(samples, layer, kv),
                &layer_exps,
                layer,
                kv,
                c,
                group,
                params,
                d,
                first.kv.meta.rope.style,
            ));
        }
    }
    let mut levels = Vec::with_capacity(params.level_mult.len());
    for &mult in &params.level_mult {
        let stats = level_stats(samples, &exps, &all_params, mult, layers, c, d, params);
        levels.push(learn_tables(stats));
    }
    let parts = Parts {
        layers: shape.layers,
        kv_heads: shape.kv_heads,
        head_dim: shape.head_dim,
        level_mult: params.level_mult.clone(),
        params: all_params,
        importance,
        levels,
    };
    Profile::learned(&parts).map_err(|e| match e {
        ProfileError::TooLarge { got, max } => EncodeError::OverLimit {
            what: "profile bytes",
            got,
            max,
        },
        e => panic!("the learner's profile parts must be valid: {e}"),
    })
}

/// Every sample's K (`kv` 0) or V (1) of `layer` in f32, with its tokens.
fn sample_tensors(samples: &[Sample<'_>], layer: usize, kv: usize) -> Vec<(Vec<f32>, usize)> {
    samples
        .iter()
        .map(|s| {
            let t = if kv == 0 {
                s.kv.k[layer]
            } else {
                s.kv.v[layer]
            };
            (to_f32(t), s.kv.shape.tokens as usize)
        })
        .collect()
}

/// The learning parameters are in range.
fn check_params(params: &LearnParams) -> Result<(), EncodeError> {
    if params.level_mult.is_empty() || params.level_mult.len() > MAX_LEVELS {
        return Err(EncodeError::InvalidParam {
            what: "level count",
            got: params.level_mult.len() as u64,
        });
    }
    if params
        .level_mult
        .iter()
        .any(|m| !(m.is_finite() && *m > 0.0))
    {
        return Err(EncodeError::InvalidParam {
            what: "level multiplier",
            got: 0,
        });
    }
    if !group_is_valid(params.group) {
        return Err(EncodeError::InvalidParam {
            what: "group",
            got: params.group as u64,
        });
    }
    if params.chunk_tokens == 0 {
        return Err(EncodeError::InvalidParam {
            what: "chunk_tokens",
            got: 0,
        });
    }
    if !(params.target_error > 0.0 && params.anchor_ratio > 0.0) {
        return Err(EncodeError::InvalidParam {
            what: "target_error/anchor_ratio",
            got: 0,
        });
    }
    if let Some(imp) = &params.importance {
        if !imp.is_valid() {
            return Err(EncodeError::InvalidParam {
                what: "importance parameters",
                got: imp.max_exp as u64,
            });
        }
    }
    Ok(())
}

/// Every sample has the first one's shape, consistent tensors and, if any, queries of a
/// matching shape with finite values.
fn check_samples(samples: &[Sample<'_>]) -> Result<(), EncodeError> {
    let shape = samples[0].kv.shape;
    let dims = |s: KvShape| [s.layers, s.kv_heads, s.head_dim];
    for (i, s) in samples.iter().enumerate() {
        if dims(s.kv.shape) != dims(shape) {
            return Err(EncodeError::SampleShape {
                sample: i,
                shape: dims(s.kv.shape),
                first: dims(shape),
            });
        }
        s.kv.check()?;
        if let Some(q) = &s.queries {
            // One query's values; 0 (refused) if it overflows.
            let row = q.q_heads.checked_mul(shape.head_dim as usize).unwrap_or(0);
            if q.q.len() != shape.layers as usize
                || row == 0
                || q.q_heads % shape.kv_heads as usize != 0
                || q.q
                    .iter()
                    .any(|l| l.len() % row != 0 || l.len() != q.q[0].len())
            {
                return Err(EncodeError::ShapeMismatch { what: "queries" });
            }
            if let Some(layer) = q.q.iter().position(|l| l.iter().any(|x| !x.is_finite())) {
                return Err(EncodeError::InvalidParam {
                    what: "queries (not finite) of layer",
                    got: layer as u64,
                });
            }
        }
    }
    // Beyond these, decoders would refuse the profile.
    check_dims(shape.layers, shape.kv_heads, shape.head_dim, &Limits::DEFAULT).map_err(|e| match e {
        ShapeError::Layers { got, max } => EncodeError::OverLimit {
            what: "layers",
            got: got.into(),
            max: max.into(),
        },
        ShapeError::Channels { got, max } => EncodeError::OverLimit {
            what: "channels",
            got,
            max,
        },
        ShapeError::ZeroDimension { field } => EncodeError::InvalidParam { what: field, got: 0 },
    })?;
    Ok(())
}

/// `x` rounded to f32, clamped to the finite range (a NaN stays NaN).
fn finite_f32(x: f64) -> f32 {
    x.clamp(-f32::MAX as f64, f32::MAX as f64) as f32
}

fn to_f32(t: TensorRef<'_>) -> Vec<f32> {
    let mut v = vec![0.0; t.len()];
    t.read_f32(0, &mut v);
    v
}
