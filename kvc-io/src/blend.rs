//! `kvc blend-eval`: CacheBlend measured on the reference runner. Chunk texts are prefilled
//! alone (from position 0, no BOS token), stored (as computed, or through a kvc stream at a
//! level), placed one after the other, and a question is run on top by each method: CacheBlend's
//! gradual filtering, a single check layer by K or by V (as the public implementations select),
//! random tokens at the same ratio, full reuse, full recompute and prefix caching. Each is
//! compared with a full prefill of chunks and question: KL and top-1 over the question's last
//! tokens, compute time and operations, and the recall of the tokens whose reused K/V deviate
//! most from the full prefill's, layer by layer.

use std::time::Instant;

use codec_core::blend::{deviations, top, Norm, SelectParams, Tensors};
use codec_core::{Dtype, EncodeParams, KvCache, Limits, Stream, Tensor};
use llm::{Blended, Model, Recompute};

use crate::compare::Reference;
use crate::error::Error;
use crate::judge::first_tokens;
use crate::policy::{self, ProfileUse};
use crate::progress::Progress;

/// What `kvc blend-eval` runs.
#[derive(Clone, Debug, PartialEq)]
pub struct BlendParams {
    /// Tokens of each chunk (its text's first ones).
    pub chunk_tokens: usize,
    /// The question's last tokens scored.
    pub scored: usize,
    /// Recompute ratios (0 to 1) of the selecting methods.
    pub ratios: Vec<f64>,
    /// The kvc level chunks are also stored at (`None`: stored as computed only).
    pub level: Option<u8>,
    /// Seed of the random selection.
    pub seed: u64,
}

impl Default for BlendParams {
    fn default() -> Self {
        BlendParams {
            chunk_tokens: 512,
            scored: 128,
            ratios: vec![0.0, 0.05, 0.10, 0.15, 0.20, 0.30, 0.50, 1.0],
            level: Some(7),
            seed: 0,
        }
    }
}

/// One method at one ratio.
#[derive(Clone, Debug, PartialEq)]
pub struct BlendRow {
    /// `cacheblend`, `single-layer-k`, `single-layer-v`, `random`, `full-reuse`,
    /// `full-recompute` or `prefix-caching`.
    pub method: &'static str,
    /// How the chunks were stored: `lossless` (as computed, f32) or `kvc level N`.
    pub storage: String,
    /// Share of the reused tokens recomputed per layer (after the narrowing, for CacheBlend).
    pub ratio: f64,
    /// KL(full prefill || method) in nats per scored token.
    pub kl: f64,
    /// Top-1 agreement with the full prefill over the scored tokens.
    pub top1: f64,
    /// Wall time of the method's run on the runner, milliseconds.
    pub prefill_ms: f64,
    /// Its operations over a full recompute's.
    pub flop_share: f64,
    /// Mean over the layers that recompute some but not all reused tokens of the share of
    /// them among as many tokens deviating most from the full prefill (`None`: no such layer).
    pub recall: Option<f64>,
}

/// The rows, and the full prefill's time.
#[derive(Clone, Debug, PartialEq)]
pub struct BlendReport {
    /// Reused tokens (all chunks).
    pub reused_tokens: usize,
    /// Question tokens.
    pub question_tokens: usize,
    /// Milliseconds of the full prefill (the runner's own, in steps).
    pub full_prefill_ms: f64,
    /// Every method's row.
    pub rows: Vec<BlendRow>,
}

/// The chunks' texts and the question's, prepared and measured against a full prefill.
pub fn blend_eval(
    model: &Model,
    chunks: &[String],
    question: &str,
    params: &BlendParams,
    progress: &mut dyn Progress,
) -> Result<BlendReport, Error> {
    let texts: Vec<Vec<u32>> = chunks
        .iter()
        .map(|t| first_tokens(model, t, params.chunk_tokens))
        .collect::<Result<_, _>>()?;
    let q = model.tokenizer().encode(question)?;
    if q.len() < params.scored || params.scored == 0 {
        return Err(Error::TextTooShort {
            have: q.len(),
            need: params.scored.max(1),
        });
    }
    let tokens: Vec<u32> = texts.concat();
    let n = tokens.len();
    let t0 = Instant::now();
    let full = model.prefill(&tokens)?.cache;
    let scored_from = q.len() - params.scored;
    let reference_logits = model.forward_with_cache(&full, &q)?;
    let full_prefill_ms = t0.elapsed().as_secs_f64() * 1e3;
    let vocab = model.config().vocab;
    let reference = Reference::new(&reference_logits[scored_from * vocab..], vocab);
    let alone: Vec<KvCache> = texts
        .iter()
        .map(|t| Ok(model.prefill(t)?.cache))
        .collect::<Result<_, Error>>()?;
    let mut storages = vec![("lossless".to_string(), alone.clone())];
    if let Some(level) = params.level {
        let stored = alone
            .iter()
            .map(|c| through_level(c, level))
            .collect::<Result<_, _>>()?;
        storages.push((format!("kvc level {level}"), stored));
    }
    let runs = methods(params, n, texts[0].len());
    progress.start("blending", (storages.len() * runs.len()) as u64);
    let mut rows = Vec::new();
    let run = Run {
        model,
        tokens: &tokens,
        question: &q,
        scored_from,
        reference: &reference,
    };
    let full_flops = model.full_flops(n + q.len());
    for (storage, caches) in &storages {
        let placed = llm::place_chunks(caches)?;
        let truth = truth(&placed, &full)?;
        for (method, ratio, how) in &runs {
            let mut row = run.row(&placed, how, &truth)?;
            row.method = method;
            row.storage = storage.clone();
            row.ratio = *ratio;
            row.flop_share /= full_flops;
            rows.push(row);
            progress.step();
        }
    }
    progress.finish();
    Ok(BlendReport {
        reused_tokens: n,
        question_tokens: q.len(),
        full_prefill_ms,
        rows,
    })
}

/// Every method at every ratio, and the baselines once: (name, ratio, recompute).
fn methods(p: &BlendParams, n: usize, first_chunk: usize) -> Vec<(&'static str, f64, Recompute)> {
    let mut out = Vec::new();
    for &r in &p.ratios {
        let r32 = r as f32;
        let gradual = SelectParams {
            ratio: r32,
            first_ratio: (r32 * 4.0 / 3.0).min(1.0),
            ..SelectParams::DEFAULT
        };
        let single = |tensors| SelectParams {
            ratio: r32,
            first_ratio: r32,
            narrow_layers: 0,
            tensors,
            norm: Norm::L2,
        };
        out.push(("cacheblend", r, Recompute::Select(gradual)));
        out.push(("single-layer-k", r, Recompute::Select(single(Tensors::K))));
        out.push(("single-layer-v", r, Recompute::Select(single(Tensors::V))));
        let count = (r * n as f64).ceil() as usize;
        out.push((
            "random",
            r,
            Recompute::Fixed(random_tokens(n, count, p.seed)),
        ));
    }
    let rest: Vec<u32> = (first_chunk as u32..n as u32).collect();
    let prefix_share = rest.len() as f64 / n as f64;
    out.push(("full-reuse", 0.0, Recompute::Fixed(Vec::new())));
    out.push((
        "full-recompute",
        1.0,
        Recompute::Fixed((0..n as u32).collect()),
    ));
    out.push(("prefix-caching", prefix_share, Recompute::Fixed(rest)));
    out
}

/// `count` distinct tokens of `0..n`, ascending, drawn with a seeded xorshift.
fn random_tokens(n: usize, count: usize, seed: u64) -> Vec<u32> {
    let mut s = seed ^ 0x9e37_79b9_7f4a_7c15;
    let mut order: Vec<u32> = (0..n as u32).collect();
    for i in (1..n).rev() {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        order.swap(i, (s % (i as u64 + 1)) as usize);
    }
    let mut out = order[..count.min(n)].to_vec();
    out.sort_unstable();
    out
}

/// `cache` stored as a self-contained kvc stream at `level` (its f16 rounding coded, its
/// profile learned from itself) and decoded.
fn through_level(cache: &KvCache, level: u8) -> Result<KvCache, Error> {
    let f16 = |t: &Tensor| Tensor::from_f32(Dtype::F16, &t.to_f32_vec());
    let rounded = KvCache {
        k: cache.k.iter().map(f16).collect(),
        v: cache.v.iter().map(f16).collect(),
        ..cache.clone()
    };
    let sample = codec_core::Sample {
        kv: rounded.view(),
        queries: None,
    };
    let learned = codec_core::learn_profile(&[sample], &codec_core::LearnParams::default())?;
    let params = EncodeParams {
        levels: vec![level],
        ..EncodeParams::default()
    };
    let enc = policy::encode(
        &rounded.view(),
        ProfileUse::SelfContained(&learned),
        &params,
    )?;
    let reader = enc.embedded.as_ref().unwrap_or(&learned);
    Ok(Stream::open(&enc.bytes, Some(reader), &Limits::DEFAULT)?.decode()?)
}

/// Per layer, each reused token's deviation (K and V, L2) from the full prefill's.
fn truth(placed: &KvCache, full: &KvCache) -> Result<Vec<Vec<f32>>, Error> {
    let row = placed.shape.channels();
    (0..placed.shape.layers as usize)
        .map(|l| {
            let (pk, fk) = (placed.k[l].to_f32_vec(), full.k[l].to_f32_vec());
            let (pv, fv) = (placed.v[l].to_f32_vec(), full.v[l].to_f32_vec());
            Ok(deviations(
                Tensors::KV,
                Norm::L2,
                row,
                (&pk, &fk),
                (&pv, &fv),
            )?)
        })
        .collect()
}

/// What every method's run shares.
struct Run<'a> {
    model: &'a Model,
    tokens: &'a [u32],
    question: &'a [u32],
    scored_from: usize,
    reference: &'a Reference,
}

impl Run<'_> {
    /// One method's figures (its name, storage and ratio filled in by the caller).
    fn row(
        &self,
        placed: &KvCache,
        how: &Recompute,
        truth: &[Vec<f32>],
    ) -> Result<BlendRow, Error> {
        let t0 = Instant::now();
        let b: Blended = self.model.blend(placed, self.tokens, self.question, how)?;
        let prefill_ms = t0.elapsed().as_secs_f64() * 1e3;
        let vocab = self.model.config().vocab;
        let (kl, top1) = self
            .reference
            .kl_top1(&b.logits[self.scored_from * vocab..]);
        Ok(BlendRow {
            method: "",
            storage: String::new(),
            ratio: 0.0,
            kl,
            top1,
            prefill_ms,
            flop_share: b.flops,
            recall: recall(&b.recomputed, truth),
        })
    }
}

/// Mean, over the layers that recompute some but not all reused tokens, of the share of
/// recomputed tokens among the same number of truly most deviating ones.
fn recall(recomputed: &[Vec<u32>], truth: &[Vec<f32>]) -> Option<f64> {
    let mut shares = Vec::new();
    for (sel, dev) in recomputed.iter().zip(truth) {
        if sel.is_empty() || sel.len() == dev.len() {
            continue;
        }
        let all: Vec<u32> = (0..dev.len() as u32).collect();
        let best = top(&all, dev, sel.len()).ok()?;
        let hit = sel.iter().filter(|t| best.binary_search(t).is_ok()).count();
        shares.push(hit as f64 / sel.len() as f64);
    }
    (!shares.is_empty()).then(|| shares.iter().sum::<f64>() / shares.len() as f64)
}

/// A storage tier read from a tiers file.
#[derive(Clone, Debug, PartialEq)]
pub struct TierSpec {
    /// Its name.
    pub name: String,
    /// Read throughput, GB/s.
    pub gb_per_s: f64,
    /// Cost per GB stored.
    pub cost_per_gb: f64,
}

/// Parses a tiers file: one tier per line, `name GB/s cost-per-GB` separated by spaces or tabs;
/// `#` starts a comment; blank lines are skipped.
pub fn parse_tiers(text: &str) -> Result<Vec<TierSpec>, Error> {
    let mut tiers = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let f: Vec<&str> = line.split_whitespace().collect();
        let num = |s: &str| s.parse::<f64>().ok().filter(|x| x.is_finite() && *x >= 0.0);
        match (
            f.as_slice(),
            f.get(1).and_then(|s| num(s)),
            f.get(2).and_then(|s| num(s)),
        ) {
            ([name, _, _], Some(gb_per_s), Some(cost_per_gb)) if gb_per_s > 0.0 => {
                tiers.push(TierSpec {
                    name: name.to_string(),
                    gb_per_s,
                    cost_per_gb,
                })
            }
            _ => {
                return Err(Error::Tiers {
                    line: i + 1,
                    text: line.to_string(),
                })
            }
        }
    }
    Ok(tiers)
}
