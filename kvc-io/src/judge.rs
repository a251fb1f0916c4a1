//! The model as the judge: dumps made by the reference runner ([`dump_text`]) and `kvc judge`
//! ([`judge`]): prefill a context, round-trip its cache through each kvc level and the minmax
//! baselines, continue on top, and compare the model's predictions with the original cache's.

use std::collections::BTreeMap;
use std::time::Instant;

use codec_core::{CodingError, Dtype, EncodeParams, KvCache, Limits, Profile, Stream, Tensor};
use llm::{Model, Prefill, PrefillOptions};
use sha2::{Digest, Sha256};

use crate::compare::{log_softmax, Reference};
use crate::dump::Dump;
use crate::error::Error;
use crate::eval::BASELINE_BITS;
use crate::metrics::minmax_quantize;
use crate::policy::{self, ProfileUse};
use crate::progress::Progress;

/// The first `n` tokens of `text`, or [`Error::TextTooShort`].
pub fn first_tokens(model: &Model, text: &str, n: usize) -> Result<Vec<u32>, Error> {
    let mut t = model.tokenizer().encode(text)?;
    if t.len() < n || n == 0 {
        return Err(Error::TextTooShort {
            have: t.len(),
            need: n.max(1),
        });
    }
    t.truncate(n);
    Ok(t)
}

/// [`Error::OutOfRange`] unless `min <= got <= max`.
fn check_range(
    what: &'static str,
    got: usize,
    min: usize,
    max: usize,
    why: String,
) -> Result<(), Error> {
    if (min..=max).contains(&got) {
        return Ok(());
    }
    Err(Error::OutOfRange {
        what,
        got,
        min,
        max,
        why,
    })
}

fn context_note(context: usize) -> String {
    format!("the model's context is {context} tokens")
}

/// First 16 hex digits of the SHA-256 of `tokens` as little-endian u32 (the fixtures'
/// `tokens_sha256_16`).
pub fn tokens_sha256_16(tokens: &[u32]) -> String {
    let mut h = Sha256::new();
    tokens.iter().for_each(|t| h.update(t.to_le_bytes()));
    h.finalize()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A dump of `model` on the first `tokens` tokens of `text` (named `source` in the metadata), in
/// the fixtures' layout: K and V in f16, the post-rotary queries of the last `queries` positions,
/// K before the rotary embedding if `pre_rope`. The prefill is reported to `progress` in tokens.
pub fn dump_text(
    model: &Model,
    text: &str,
    source: &str,
    tokens: usize,
    queries: usize,
    pre_rope: bool,
    progress: &mut dyn Progress,
) -> Result<Dump, Error> {
    let context = model.config().context;
    check_range("tokens", tokens, 1, context, context_note(context))?;
    check_range(
        "queries",
        queries,
        0,
        tokens,
        "at most one per token".into(),
    )?;
    let ids = first_tokens(model, text, tokens)?;
    let pre = prefill(model, &ids, queries, pre_rope, progress)?;
    Ok(as_dump(model, &ids, pre, source))
}

/// [`Model::prefill_progress`] reported to `progress` in tokens.
fn prefill(
    model: &Model,
    ids: &[u32],
    queries: usize,
    pre_rope: bool,
    progress: &mut dyn Progress,
) -> Result<Prefill, Error> {
    let opt = PrefillOptions {
        queries,
        pre_rope_k: pre_rope,
        ..PrefillOptions::default()
    };
    progress.start("prefill (tokens)", ids.len() as u64);
    let mut done = 0;
    let pre = model.prefill_progress(ids, opt, &mut |n| {
        (done..n).for_each(|_| progress.step());
        done = n;
    })?;
    progress.finish();
    Ok(pre)
}

/// The prefill of `ids` as a dump in the fixtures' layout (K and V rounded to f16).
fn as_dump(model: &Model, ids: &[u32], pre: Prefill, source: &str) -> Dump {
    let kv = to_dtype(&pre.cache, Dtype::F16);
    let c = model.config();
    let n_q = pre
        .queries
        .first()
        .map_or(0, |q| q.len() / (c.heads * c.head_dim));
    let q_start = (ids.len() - n_q) as u64;
    let mut md = BTreeMap::new();
    for (k, v) in [
        ("format", "kvc-eval-dump/1".to_string()),
        ("model", model.model_id().to_string()),
        ("text", source.to_string()),
        ("tokens_sha256_16", tokens_sha256_16(ids)),
        ("q_heads", c.heads.to_string()),
        ("q_start", q_start.to_string()),
        ("model_dtype", "float32".to_string()),
        (
            "layout",
            "k.{i},v.{i}: [tokens, kv_heads, head_dim]; q.{i}: [n_q, q_heads, head_dim] post-RoPE"
                .to_string(),
        ),
        (
            "gqa",
            "q head h uses kv head h // (q_heads // kv_heads)".to_string(),
        ),
    ] {
        md.insert(k.to_string(), v);
    }
    Dump {
        kv,
        q: (n_q > 0).then_some(pre.queries),
        q_heads: c.heads,
        q_start,
        tokens: Some(ids.to_vec()),
        metadata: md,
    }
}

/// `cache` with every tensor rounded to `dtype`.
fn to_dtype(cache: &KvCache, dtype: Dtype) -> KvCache {
    let conv = |t: &Tensor| Tensor::from_f32(dtype, &t.to_f32_vec());
    KvCache {
        shape: cache.shape,
        k: cache.k.iter().map(conv).collect(),
        v: cache.v.iter().map(conv).collect(),
        meta: cache.meta.clone(),
    }
}

/// What `kvc judge` runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JudgeParams {
    /// Context tokens prefilled into the cache that is compressed.
    pub ctx: usize,
    /// Tokens fed on top of the cache and scored.
    pub cont: usize,
    /// kvc levels to judge (`None`: every level of the profile).
    pub levels: Option<Vec<u8>>,
    /// Also judge the minmax baselines.
    pub baselines: bool,
}

/// Where the judged streams' profile comes from.
#[derive(Clone, Copy, Debug)]
pub enum JudgeProfile<'a> {
    /// A profile learned elsewhere (streams reference it: it is not counted in their bits).
    Referenced(&'a Profile),
    /// Learn one from the context's own cache and queries; each stream embeds it, cut to its
    /// level (counted in its bits).
    SelfLearned,
}

impl<'a> JudgeProfile<'a> {
    /// `Referenced(p)` for a profile, `SelfLearned` without one.
    pub fn or_self_learned(profile: Option<&'a Profile>) -> Self {
        profile.map_or(JudgeProfile::SelfLearned, JudgeProfile::Referenced)
    }
}

/// One judged method.
#[derive(Clone, Debug, PartialEq)]
pub struct JudgeRow {
    /// `kvc`, `minmax-int8`, `minmax-int4`, `minmax-int3`, or `uncompressed` (the f32 cache
    /// itself: KL 0 by construction, the harness's zero).
    pub method: String,
    /// The kvc level (`None` for the others).
    pub level: Option<u8>,
    /// Bits per cache element: every stream byte (an embedded profile included) times 8 over
    /// the elements; for minmax, `bits + 32 / head_dim`.
    pub bits_per_elem: f64,
    /// Perplexity of the continuation's own tokens.
    pub ppl: f64,
    /// Mean KL(original || this) over the continuation's predictions, nats per token.
    pub kl: f64,
    /// Share of the continuation's predictions whose argmax equals the original's.
    pub top1: f64,
    /// Encode and decode time in seconds (kvc levels only).
    pub encode_s: Option<f64>,
    /// See `encode_s`.
    pub decode_s: Option<f64>,
}

/// The judge's verdict on one text.
#[derive(Clone, Debug, PartialEq)]
pub struct Judgement {
    /// Tokens of context and of continuation.
    pub ctx: usize,
    /// See `ctx`.
    pub cont: usize,
    /// One row per method, the uncompressed cache first.
    pub rows: Vec<JudgeRow>,
}

/// Judges the codec on `text`: prefills its first `ctx` tokens, encodes the cache (rounded to
/// f16, as a server stores it) at each level, decodes it, feeds the next `cont` tokens on top of
/// the decoded cache and compares the logits with those on the original (f32) cache.
///
/// Scoring: the `cont` tokens (text tokens `ctx..ctx + cont`, no BOS) are fed on top of the
/// cache, giving `cont` next-token distributions. KL and top-1 agreement are averaged over all
/// `cont` of them; the perplexity is over the `cont - 1` that predict a token of the text
/// (`ctx + 1 ..= ctx + cont - 1`). Reported to `progress`: the prefill, then one step per method.
pub fn judge(
    model: &Model,
    text: &str,
    params: &JudgeParams,
    profile: JudgeProfile<'_>,
    progress: &mut dyn Progress,
) -> Result<Judgement, Error> {
    check_params(model, params)?;
    let ids = first_tokens(model, text, params.ctx + params.cont)?;
    let (context, cont) = ids.split_at(params.ctx);
    let pre = prefill(model, context, queries_for(params.ctx), false, progress)?;
    // The original is the f32 cache; the codec gets it rounded to f16, as a server stores it.
    let original = pre.cache.clone();
    let dump = as_dump(model, context, pre, "judge context");
    let learned;
    let (prof, use_) = match profile {
        JudgeProfile::Referenced(p) => (p, ProfileUse::Referenced(p)),
        JudgeProfile::SelfLearned => {
            learned = policy::learn(&[&dump], progress)?;
            (&learned, ProfileUse::SelfContained(&learned))
        }
    };
    let levels: Vec<u8> = match &params.levels {
        Some(l) => l.clone(),
        None => (0..prof.levels()).collect(),
    };
    let baselines = if params.baselines {
        BASELINE_BITS.len()
    } else {
        0
    };
    let n_methods = 1 + levels.len() + baselines;
    progress.start("judging", n_methods as u64);
    let reference = Scorer::new(model, &original, cont)?;
    let mut rows = vec![reference.row("uncompressed", None, 32.0, &reference.logits)];
    progress.step();
    let elements = original.shape.total_elements() as f64;
    for level in levels {
        let coded = round_trip(&dump, level, true, prof, use_)?;
        let logits = model.forward_with_cache(&coded.cache, cont)?;
        let bits = coded.bytes as f64 * 8.0 / elements;
        let mut row = reference.row("kvc", Some(level), bits, &logits);
        (row.encode_s, row.decode_s) = (Some(coded.encode_s), Some(coded.decode_s));
        rows.push(row);
        progress.step();
    }
    if params.baselines {
        for bits in BASELINE_BITS {
            rows.push(baseline_row(model, &reference, &original, bits)?);
            progress.step();
        }
    }
    progress.finish();
    Ok(Judgement {
        ctx: params.ctx,
        cont: params.cont,
        rows,
    })
}

/// Checks `params.ctx` and `params.cont` against the model's context.
fn check_params(model: &Model, params: &JudgeParams) -> Result<(), Error> {
    let context = model.config().context;
    let why = format!("scoring needs 2; ctx + cont must fit the model's {context} tokens");
    check_range("cont (scored tokens)", params.cont, 2, context - 1, why)?;
    let max_ctx = context - params.cont;
    let why = format!("{} with cont = {}", context_note(context), params.cont);
    check_range("ctx (context tokens)", params.ctx, 1, max_ctx, why)?;
    Ok(())
}

/// The row of a `bits`-bit minmax quantization of `original`, a minimum and a scale per head's
/// `head_dim` values of a token ([`minmax_quantize`]), counted in its bits per element.
fn baseline_row(
    model: &Model,
    reference: &Scorer,
    original: &KvCache,
    bits: u32,
) -> Result<JudgeRow, Error> {
    let d = original.shape.head_dim as usize;
    let q = |t: &Tensor| Tensor::F32(minmax_quantize(&t.to_f32_vec(), d, bits));
    let cache = KvCache {
        k: original.k.iter().map(q).collect(),
        v: original.v.iter().map(q).collect(),
        ..original.clone()
    };
    let logits = model.forward_with_cache(&cache, reference.cont)?;
    let bpe = f64::from(bits) + 32.0 / d as f64;
    Ok(reference.row(&format!("minmax-int{bits}"), None, bpe, &logits))
}

/// A cache after a round trip through a kvc stream.
pub(crate) struct Coded {
    /// The decoded cache.
    pub cache: KvCache,
    /// The error its coding is expected to have left.
    pub error: CodingError,
    /// The stream's size.
    pub bytes: usize,
    /// Seconds to encode and to decode.
    pub encode_s: f64,
    pub decode_s: f64,
}

/// `dump`'s cache encoded at `level` as `use_` says (with per-token steps if
/// `token_importance`) and decoded (with `prof`, the profile the stream references or the one it
/// embeds a cut of).
pub(crate) fn round_trip(
    dump: &Dump,
    level: u8,
    token_importance: bool,
    prof: &Profile,
    use_: ProfileUse<'_>,
) -> Result<Coded, Error> {
    let params = EncodeParams {
        levels: vec![level],
        token_importance,
        ..EncodeParams::default()
    };
    let t0 = Instant::now();
    let enc = policy::encode(&dump.kv.view(), use_, &params, 0)?;
    let encode_s = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let reader = enc.embedded.as_ref().unwrap_or(prof);
    let (cache, error) =
        Stream::open(&enc.bytes, Some(reader), &Limits::DEFAULT)?.decode_with_error()?;
    Ok(Coded {
        cache,
        error,
        bytes: enc.bytes.len(),
        encode_s,
        decode_s: t1.elapsed().as_secs_f64(),
    })
}

/// `ids` prefilled alone as a dump (K/V in f16, the last queries kept for profile learning),
/// with the f32 cache it was rounded from.
pub(crate) fn prefill_dump(
    model: &Model,
    ids: &[u32],
    source: &str,
) -> Result<(Dump, KvCache), Error> {
    let pre = model.prefill_with(
        ids,
        PrefillOptions {
            queries: queries_for(ids.len()),
            ..PrefillOptions::default()
        },
    )?;
    let original = pre.cache.clone();
    Ok((as_dump(model, ids, pre, source), original))
}

/// Queries kept for a self-learned profile's token-importance hints: the last 64 positions, as
/// in the fixtures (fewer for a short context).
fn queries_for(ctx: usize) -> usize {
    ctx.min(64)
}

/// The original cache's predictions, against which every method is scored.
struct Scorer<'a> {
    cont: &'a [u32],
    logits: Vec<f32>,
    reference: Reference,
}

impl<'a> Scorer<'a> {
    fn new(model: &Model, original: &KvCache, cont: &'a [u32]) -> Result<Self, Error> {
        let logits = model.forward_with_cache(original, cont)?;
        let reference = Reference::new(&logits, model.config().vocab);
        Ok(Scorer {
            cont,
            logits,
            reference,
        })
    }

    /// The row of a method whose continuation logits are `logits`.
    fn row(&self, method: &str, level: Option<u8>, bits: f64, logits: &[f32]) -> JudgeRow {
        let n = self.cont.len();
        let (kl, top1) = self.reference.kl_top1(logits);
        let nll: f64 = logits
            .chunks_exact(self.reference.vocab())
            .zip(&self.cont[1..])
            .map(|(row, &next)| -log_softmax(row)[next as usize])
            .sum();
        JudgeRow {
            method: method.to_string(),
            level,
            bits_per_elem: bits,
            ppl: (nll / (n - 1) as f64).exp(),
            kl,
            top1,
            encode_s: None,
            decode_s: None,
        }
    }
}
