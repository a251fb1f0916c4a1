//! `kvc blend-eval`: CacheBlend measured on the reference runner. Chunk texts are prefilled
//! alone (from position 0, no BOS token), stored (as computed, or through a kvc stream at a
//! level), placed one after the other, and a question is run on top by each method: CacheBlend's
//! gradual filtering, a single check layer by K or by V (as the public implementations select),
//! random tokens at the same ratio, an oracle that knows the full prefill, full reuse, full
//! recompute and prefix caching. Each is compared with a full prefill of chunks and question:
//! KL and top-1 over the question's last tokens, compute time and operations, and the recall of
//! the tokens whose reused K/V deviate most from the full prefill's, layer by layer.

use std::time::Instant;

use codec_core::blend::{deviations, top, Norm, SelectParams, Tensors};
use codec_core::{CodingError, KvCache};
use llm::{Model, Recompute};

use crate::compare::Reference;
use crate::dump::Dump;
use crate::error::Error;
use crate::judge::{first_tokens, prefill_dump, round_trip, Coded, JudgeProfile};
use crate::policy::{self, ProfileUse};
use crate::progress::Progress;

/// The methods `kvc blend-eval` compares, by name.
pub const METHODS: [&str; 8] = [
    "cacheblend",
    "single-layer-k",
    "single-layer-v",
    "random",
    "oracle",
    "full-reuse",
    "full-recompute",
    "prefix-caching",
];

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
    /// Whether the stored chunks get per-token steps (the encoder's token-importance policy,
    /// which assumes the queries that read a cache come right after it).
    pub token_importance: bool,
    /// Whether the selections take the stored chunks' expected coding error out of the
    /// deviations they measure (L2 only; [`codec_core::blend::less_coding_error`]).
    pub less_coding_error: bool,
    /// Seed of the random selection.
    pub seed: u64,
    /// CacheBlend's selection, moved to each ratio with [`SelectParams::at_ratio`].
    pub select: SelectParams,
    /// The methods run (names from [`METHODS`]).
    pub methods: Vec<String>,
    /// Runs of each method (and of the full prefill) whose fastest time is reported; the
    /// figures other than time are the same in every run.
    pub repeat: usize,
}

impl Default for BlendParams {
    fn default() -> Self {
        BlendParams {
            chunk_tokens: 512,
            scored: 128,
            ratios: vec![0.0, 0.05, 0.10, 0.15, 0.20, 0.30, 0.50, 1.0],
            level: Some(7),
            token_importance: true,
            less_coding_error: true,
            seed: 0,
            select: SelectParams::DEFAULT,
            methods: METHODS.iter().map(|m| m.to_string()).collect(),
            repeat: 1,
        }
    }
}

/// One method at one ratio.
#[derive(Clone, Debug, PartialEq)]
pub struct BlendRow {
    /// `cacheblend`, `single-layer-k`, `single-layer-v`, `random`, `oracle`, `full-reuse`,
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
    /// Wall time of the method's run on the runner, without the logits of the question tokens
    /// before the last (scoring needs them, a prefill does not), milliseconds.
    pub prefill_ms: f64,
    /// Its operations over a full recompute's.
    pub flop_share: f64,
    /// Mean over the layers that recompute some but not all reused tokens of the share of
    /// them among as many tokens deviating most from the full prefill (`None`: no such layer).
    pub recall: Option<f64>,
}

/// How the chunks were stored, and what that storage costs on its own.
#[derive(Clone, Debug, PartialEq)]
pub struct StorageRow {
    /// `lossless` (as computed, f32) or `kvc level N`.
    pub storage: String,
    /// The codec's own KL on this context: the full prefill's cache stored the same way, the
    /// question run on it, KL(full prefill || that) per scored token (0 for `lossless`).
    pub codec_kl: f64,
    /// Bits per element of the chunks' streams (`None` for `lossless`).
    pub bits_per_elem: Option<f64>,
}

/// The rows, and the full prefill's time.
#[derive(Clone, Debug, PartialEq)]
pub struct BlendReport {
    /// Reused tokens (all chunks).
    pub reused_tokens: usize,
    /// Question tokens.
    pub question_tokens: usize,
    /// Milliseconds of the full prefill of chunks and question, in one prefill (the fastest of
    /// `repeat`).
    pub full_prefill_ms: f64,
    /// Each storage.
    pub storages: Vec<StorageRow>,
    /// Every method's row.
    pub rows: Vec<BlendRow>,
}

/// The chunks' texts and the question's, prepared and measured against a full prefill.
pub fn blend_eval(
    model: &Model,
    chunks: &[String],
    question: &str,
    params: &BlendParams,
    profile: JudgeProfile<'_>,
    progress: &mut dyn Progress,
) -> Result<BlendReport, Error> {
    check_params(params)?;
    let (texts, q) = blend_tokens(model, chunks, question, params)?;
    let tokens: Vec<u32> = texts.concat();
    let n = tokens.len();
    let runs = methods(params, n, texts[0].len());
    let stores = 1 + usize::from(params.level.is_some());
    progress.start(
        "blending",
        (params.repeat + stores * (runs.len() + 1)) as u64,
    );
    // The full prefill, timed as a server runs it: chunks and question in one prefill, the last
    // token's logits only. The reference's logits after every question token come apart.
    let everything = [&tokens[..], &q].concat();
    let (full_prefill_ms, _) = fastest(params.repeat, || {
        let p = model.prefill(&everything)?;
        progress.step();
        Ok(p)
    })?;
    let full = model.prefill(&tokens)?.cache;
    let reference_logits = model.forward_with_cache(&full, &q)?;
    let scored_from = q.len() - params.scored;
    let vocab = model.config().vocab;
    let reference = Reference::new(&reference_logits[scored_from * vocab..], vocab);
    let run = Run {
        model,
        tokens: &tokens,
        question: &q,
        scored_from,
        reference: &reference,
        repeat: params.repeat,
        token_importance: params.token_importance,
        less_coding_error: params.less_coding_error,
    };
    let alone: Vec<(Dump, KvCache)> = texts
        .iter()
        .enumerate()
        .map(|(i, t)| prefill_dump(model, t, &format!("blend chunk {i}")))
        .collect::<Result<_, Error>>()?;
    let full_flops = model.full_flops(n + q.len());
    let mut rows = Vec::new();
    let mut storages = Vec::new();
    for level in std::iter::once(None).chain(params.level.map(Some)) {
        let stored = run.store(&alone, level, &profile)?;
        progress.step();
        rows.extend(run.rows(&runs, &stored, &full, full_flops, progress)?);
        storages.push(stored.0);
    }
    progress.finish();
    Ok(BlendReport {
        reused_tokens: n,
        question_tokens: q.len(),
        full_prefill_ms,
        storages,
        rows,
    })
}

/// The chunks' first tokens and the question's, refused when there are no chunks or the
/// question is shorter than the tokens scored.
fn blend_tokens(
    model: &Model,
    chunks: &[String],
    question: &str,
    params: &BlendParams,
) -> Result<(Vec<Vec<u32>>, Vec<u32>), Error> {
    if chunks.is_empty() {
        return Err(Error::OutOfRange {
            what: "chunks",
            got: 0,
            min: 1,
            max: usize::MAX,
            why: String::new(),
        });
    }
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
    Ok((texts, q))
}

/// Refuses unknown methods, a zero repeat and selections that cannot be run.
fn check_params(p: &BlendParams) -> Result<(), Error> {
    if let Some(m) = p.methods.iter().find(|m| !METHODS.contains(&m.as_str())) {
        return Err(Error::UnknownMethod { name: m.clone() });
    }
    if p.repeat == 0 {
        return Err(Error::OutOfRange {
            what: "repeat (runs timed per method)",
            got: 0,
            min: 1,
            max: usize::MAX,
            why: String::new(),
        });
    }
    for &r in &p.ratios {
        p.select.at_ratio(r as f32).check()?;
    }
    Ok(())
}

/// How a method picks the reused tokens it recomputes.
enum Pick {
    /// As the fusor is told.
    Recompute(Recompute),
    /// The oracle: this many tokens, those deviating most from the full prefill (known only
    /// once it has run; see [`most_deviating`]), at every layer.
    Oracle(usize),
}

/// Every method asked for at every ratio, and the baselines once: (name, ratio, pick).
fn methods(p: &BlendParams, n: usize, first_chunk: usize) -> Vec<(&'static str, f64, Pick)> {
    let mut out = Vec::new();
    for &r in &p.ratios {
        let single = |tensors| SelectParams {
            ratio: r as f32,
            first_ratio: r as f32,
            narrow_layers: 0,
            tensors,
            norm: Norm::L2,
        };
        let count = (r * n as f64).ceil() as usize;
        let select = |s| Pick::Recompute(Recompute::Select(s));
        out.push(("cacheblend", r, select(p.select.at_ratio(r as f32))));
        out.push(("single-layer-k", r, select(single(Tensors::K))));
        out.push(("single-layer-v", r, select(single(Tensors::V))));
        let random = Recompute::Fixed(random_tokens(n, count, p.seed));
        out.push(("random", r, Pick::Recompute(random)));
        out.push(("oracle", r, Pick::Oracle(count)));
    }
    let fixed = |set| Pick::Recompute(Recompute::Fixed(set));
    let rest: Vec<u32> = (first_chunk as u32..n as u32).collect();
    let prefix_share = rest.len() as f64 / n as f64;
    out.push(("full-reuse", 0.0, fixed(Vec::new())));
    out.push(("full-recompute", 1.0, fixed((0..n as u32).collect())));
    out.push(("prefix-caching", prefix_share, fixed(rest)));
    out.retain(|(m, _, _)| p.methods.iter().any(|x| x == m));
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

/// `dump` through a kvc stream at `level`: referencing `profile`, or embedding one learned from
/// the dump itself.
fn stored(
    dump: &Dump,
    level: u8,
    importance: bool,
    profile: &JudgeProfile<'_>,
) -> Result<Coded, Error> {
    match profile {
        JudgeProfile::Referenced(p) => {
            round_trip(dump, level, importance, p, ProfileUse::Referenced(p))
        }
        JudgeProfile::SelfLearned => {
            let learned = policy::learn(&[dump], &mut crate::Silent)?;
            let use_ = ProfileUse::SelfContained(&learned);
            round_trip(dump, level, importance, &learned, use_)
        }
    }
}

/// The oracle's tokens: the `count` reused tokens (ascending) whose deviation from the full
/// prefill (`truth`, per layer and token), summed over the layers, is largest. It needs the full
/// prefill, so no server can run it: it shows how much of full reuse's KL a fixed set of tokens
/// can remove at a ratio, against which a selection's ranking is judged.
fn most_deviating(truth: &[Vec<f32>], count: usize) -> Result<Vec<u32>, Error> {
    let n = truth.first().map_or(0, Vec::len);
    let mut sum = vec![0.0f32; n];
    for layer in truth {
        for (s, d) in sum.iter_mut().zip(layer) {
            *s += d;
        }
    }
    let all: Vec<u32> = (0..n as u32).collect();
    Ok(top(&all, &sum, count.min(n))?)
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

/// A storage's row, its decoded chunks, and their expected coding error (if stored through a
/// stream and the selections take it out).
type Stored = (StorageRow, Vec<KvCache>, Option<CodingError>);

/// What every method's run shares.
struct Run<'a> {
    model: &'a Model,
    tokens: &'a [u32],
    question: &'a [u32],
    scored_from: usize,
    reference: &'a Reference,
    repeat: usize,
    token_importance: bool,
    less_coding_error: bool,
}

impl Run<'_> {
    /// The chunks' caches as stored at `level` (`None`: as computed), and the codec's own KL:
    /// the full prefill's cache stored the same way with the question run on it.
    fn store(
        &self,
        alone: &[(Dump, KvCache)],
        level: Option<u8>,
        profile: &JudgeProfile<'_>,
    ) -> Result<Stored, Error> {
        let Some(level) = level else {
            let row = StorageRow {
                storage: "lossless".into(),
                codec_kl: 0.0,
                bits_per_elem: None,
            };
            let caches = alone.iter().map(|(_, c)| c.clone()).collect();
            return Ok((row, caches, None));
        };
        let (mut bytes, mut elements) = (0, 0);
        let mut caches = Vec::with_capacity(alone.len());
        let mut error: Option<CodingError> = None;
        for (dump, _) in alone {
            let coded = stored(dump, level, self.token_importance, profile)?;
            bytes += coded.bytes;
            elements += dump.kv.shape.total_elements();
            caches.push(coded.cache);
            match error.as_mut() {
                None => error = Some(coded.error),
                Some(e) => e.append(&coded.error).ok_or(Error::ChunkShapes)?,
            }
        }
        let (full, _) = prefill_dump(self.model, self.tokens, "blend context")?;
        let logits = self.model.forward_with_cache(
            &stored(&full, level, self.token_importance, profile)?.cache,
            self.question,
        )?;
        let vocab = self.model.config().vocab;
        let (codec_kl, _) = self.reference.kl_top1(&logits[self.scored_from * vocab..]);
        let row = StorageRow {
            storage: format!("kvc level {level}"),
            codec_kl,
            bits_per_elem: Some(8.0 * bytes as f64 / elements.max(1) as f64),
        };
        Ok((row, caches, error.filter(|_| self.less_coding_error)))
    }

    /// Every method's row of `runs` on the chunks as `stored`, placed one after another,
    /// against `full` (the full prefill's cache, `full_flops` its operations), a progress step
    /// each.
    fn rows(
        &self,
        runs: &[(&'static str, f64, Pick)],
        (store, caches, error): &Stored,
        full: &KvCache,
        full_flops: f64,
        progress: &mut dyn Progress,
    ) -> Result<Vec<BlendRow>, Error> {
        let placed = llm::place_chunks(caches)?;
        let truth = truth(&placed, full)?;
        let mut rows = Vec::with_capacity(runs.len());
        for (method, ratio, pick) in runs {
            let oracle;
            let how = match pick {
                Pick::Recompute(how) => how,
                Pick::Oracle(count) => {
                    oracle = Recompute::Fixed(most_deviating(&truth, *count)?);
                    &oracle
                }
            };
            let mut row = self.row(&placed, error.as_ref(), how, &truth)?;
            row.method = method;
            row.storage = store.storage.clone();
            row.ratio = *ratio;
            row.flop_share /= full_flops;
            rows.push(row);
            progress.step();
        }
        Ok(rows)
    }

    /// One method's figures (its name, storage and ratio filled in by the caller); the time is
    /// the fastest of `repeat` runs.
    fn row(
        &self,
        placed: &KvCache,
        error: Option<&CodingError>,
        how: &Recompute,
        truth: &[Vec<f32>],
    ) -> Result<BlendRow, Error> {
        // A run's time less its scoring logits (a prefill computes the last token's only).
        let mut prefill_ms = f64::INFINITY;
        let (_, b) = fastest(self.repeat, || {
            let t0 = Instant::now();
            let b = (self.model).blend(placed, error, self.tokens, self.question, how)?;
            let ms = (t0.elapsed().as_secs_f64() - b.scoring_s) * 1e3;
            prefill_ms = prefill_ms.min(ms);
            Ok(b)
        })?;
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

/// Runs `f` `repeat` times (at least once): the fastest run's milliseconds and the first
/// run's result.
fn fastest<T>(repeat: usize, mut f: impl FnMut() -> Result<T, Error>) -> Result<(f64, T), Error> {
    let t0 = Instant::now();
    let first = f()?;
    let mut best = t0.elapsed().as_secs_f64() * 1e3;
    for _ in 1..repeat {
        let t0 = Instant::now();
        f()?;
        best = best.min(t0.elapsed().as_secs_f64() * 1e3);
    }
    Ok((best, first))
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

#[cfg(test)]
mod tests {
    use super::most_deviating;

    #[test]
    fn the_oracle_takes_the_largest_deviations_summed_over_layers() {
        // Token 2 leads at no single layer but in sum; token 0 leads at layer 0 alone.
        let truth = vec![vec![5.0, 0.0, 3.0, 1.0], vec![0.0, 4.0, 3.0, 0.5]];
        assert_eq!(most_deviating(&truth, 1).unwrap(), [2]);
        assert_eq!(most_deviating(&truth, 2).unwrap(), [0, 2]);
        assert_eq!(most_deviating(&truth, 3).unwrap(), [0, 1, 2]);
        assert_eq!(most_deviating(&truth, 9).unwrap(), [0, 1, 2, 3]);
        assert!(most_deviating(&[], 3).unwrap().is_empty());
    }
}
