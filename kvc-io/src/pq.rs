//! PQCache-style token selection on a dump's real queries: what `kvc pq eval` and `kvc pq
//! select` compute.
//!
//! [`evaluate`] trains the codebooks of every (layer, KV head), a layer at a time (only one
//! layer's codebooks are held), scores the dump's stored queries and measures recall of the
//! exact top-k, the softmax mass the selection captures, timings and the block-cache hit rate;
//! [`select`] computes the selected token indices for an outside harness and
//! [`write_selection`] stores them. The exact scores and softmax weights are the
//! attention oracle's ([`codec_core::attention`]); `k` for "a fraction of the tokens" is
//! [`pq_core::k_for_fraction`]'s (the floor: T/5 of 2048 tokens is 409).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use codec_core::attention::{self, TransposedKeys};
use codec_core::{EncodeParams, Limits, Stream};
use pq_core::cache::{blocks_of, BlockCache, Policy};
use pq_core::{k_for_fraction, rerank, score_table, search, Codebook, PqError, PqParams};

use crate::dump::{Dump, DumpError};
use crate::error::Error;
use crate::output::Output;
use crate::policy::{self, ProfileUse};
use crate::progress::Progress;
use crate::tensorfile::{FileBuffer, Planned};

/// How tokens are chosen: the quantizer, and optionally a re-ranking stage.
#[derive(Clone, Debug, PartialEq)]
pub struct Selector {
    /// Codebook training parameters.
    pub params: PqParams,
    /// Re-rank `factor * k` PQ candidates with the codec's decoded keys (`None`: no re-ranking).
    pub rerank: Option<Rerank>,
}

/// The re-ranking stage.
#[derive(Clone, Debug, PartialEq)]
pub struct Rerank {
    /// Short-list size as a multiple of `k`.
    pub factor: f64,
    /// kvc level of the stream whose decoded keys re-score the short list.
    pub level: u8,
    /// Profile the stream references (`None`: self-contained, learned from the dump).
    pub profile: Option<PathBuf>,
}

impl Selector {
    /// A one-line name, e.g. `rq m=2 b=6 + rerank x2 (kvc level 9)`.
    pub fn name(&self) -> String {
        let p = &self.params;
        let mut s = format!("{} m={} b={}", p.method.name(), p.m, p.b);
        if let Some(r) = &self.rerank {
            s += &format!(" + rerank x{} (kvc level {}", r.factor, r.level);
            if let Some(p) = &r.profile {
                let name = p
                    .file_name()
                    .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
                s += &format!(", profile {name}");
            }
            s += ")";
        }
        s
    }
}

/// Tokens always selected: the first `n_init` (attention sinks) and the last `n_local` (local
/// window) a query sees.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Windows {
    /// First tokens always selected.
    pub n_init: usize,
    /// Last tokens always selected.
    pub n_local: usize,
}

impl Windows {
    /// No window: every token is chosen by score.
    pub const NONE: Windows = Windows {
        n_init: 0,
        n_local: 0,
    };
}

/// Tokens per block of the simulated block cache.
pub const BLOCK_TOKENS: u32 = 128;

/// Hit rate of one simulated block cache.
#[derive(Clone, Debug, PartialEq)]
pub struct CacheFigure {
    /// Replacement policy.
    pub policy: Policy,
    /// Capacity in blocks of [`BLOCK_TOKENS`] tokens.
    pub capacity_blocks: usize,
    /// Share of the chosen tokens outside the windows whose block was cached.
    pub hit_rate: f64,
}

/// Figures of one selector.
#[derive(Clone, Debug, PartialEq)]
pub struct Figures {
    /// [`Selector::name`].
    pub name: String,
    /// Code bits per key per head.
    pub bits_per_key: usize,
    /// Codebook size in `f32` per head.
    pub codebook_floats: usize,
    /// Recall of the exact top-T/5 by `q . k`, mean over query heads.
    pub recall_t5: f64,
    /// Recall of the exact top-T/10.
    pub recall_t10: f64,
    /// Softmax mass of the top-T/5 chosen among the tokens outside the windows, plus the windows.
    pub mass: f64,
    /// Softmax mass of the top-T/5 over all tokens united with the windows (the fixtures
    /// README's definition).
    pub mass_union: f64,
    /// Training and encoding time per (layer, KV head), milliseconds.
    pub train_ms_mean: f64,
    /// Score table + search (with windows) per query head, nanoseconds.
    pub search_ns_per_query_head: f64,
    /// Bits per element of the stream whose keys re-rank (with re-ranking).
    pub rerank_bpe: Option<f64>,
    /// LRU and LFU block caches holding 1/4 and 1/2 of the blocks.
    pub cache: Vec<CacheFigure>,
    /// The second search's ([`SecondSearch`]) token-scores per second, the call whole and its
    /// kernel alone (with [`evaluate_with`] given one only).
    pub second_scores_per_s: Option<(f64, Option<f64>)>,
}

/// One query of a [`SecondSearch`]: query head values `query` over the first `tokens` keys of
/// `heads[head]` (index `layer * kv_heads + kv_head`), `k` tokens chosen outside `windows`.
#[derive(Clone, Copy, Debug)]
pub struct SearchQuery<'a> {
    /// Index of the (layer, KV head) in the heads given.
    pub head: usize,
    /// The query head's values (`head_dim` of them).
    pub query: &'a [f32],
    /// Tokens the query sees (a causal prefix).
    pub tokens: usize,
    /// Tokens chosen by score outside the windows.
    pub k: usize,
    /// Tokens always chosen.
    pub windows: Windows,
}

/// What a [`SecondSearch`] selected, and how long it took.
#[derive(Clone, Debug, PartialEq)]
pub struct Searched {
    /// Per query, its tokens, ascending.
    pub selections: Vec<Vec<u32>>,
    /// Seconds of the whole search (uploads included).
    pub seconds: f64,
    /// Seconds of the search alone (e.g. a GPU kernel without its uploads), where measured.
    pub kernel_seconds: Option<f64>,
}

/// A second token selector that [`evaluate_with`] runs beside pq-core (`kvc pq eval --gpu`:
/// codec-cuda's PQ search kernel); its selections must be `pq_core::search`'s.
pub trait SecondSearch {
    /// Selects tokens for every query over `heads` (codebook and codes `[T, m]` per (layer, KV
    /// head)).
    fn search(
        &mut self,
        heads: &[(Codebook, Vec<u16>)],
        queries: &[SearchQuery<'_>],
    ) -> Result<Searched, Box<dyn std::error::Error + Send + Sync>>;
}

/// What [`evaluate`] measured.
#[derive(Clone, Debug, PartialEq)]
pub struct Report {
    /// `k` of the T/5 figures ([`pq_core::k_for_fraction`]`(T, 1, 5)`).
    pub k_t5: usize,
    /// `k` of the T/10 figures.
    pub k_t10: usize,
    /// Per selector, in the order given.
    pub figures: Vec<Figures>,
}

/// Everything token selection needs from a dump, in f32.
struct Data {
    layers: usize,
    kv_heads: usize,
    q_heads: usize,
    d: usize,
    t: usize,
    n_q: usize,
    q_start: usize,
    /// Per layer, `[T, H, D]`.
    k: Vec<Vec<f32>>,
    /// Per layer, `[n_q, q_heads, D]`.
    q: Vec<Vec<f32>>,
}

impl Data {
    fn new(dump: &Dump) -> Result<Self, Error> {
        let s = dump.kv.shape;
        let (layers, kv_heads, d, t) = (
            s.layers as usize,
            s.kv_heads as usize,
            s.head_dim as usize,
            s.tokens as usize,
        );
        let q = dump.q.clone().ok_or(Error::NoQueries)?;
        let n_q = dump.n_q();
        let layout = |reason: String| Err(Error::QueryLayout { reason });
        if n_q == 0 {
            return layout("the dump's q.{i} tensors hold no query".into());
        }
        let q_heads = dump.q_heads;
        if q_heads == 0 || !q_heads.is_multiple_of(kv_heads) {
            return layout(format!(
                "{q_heads} query heads is not a multiple of the {kv_heads} KV heads"
            ));
        }
        let q_start = match usize::try_from(dump.q_start) {
            Ok(s) if s.saturating_add(n_q) <= t => s,
            _ => {
                return layout(format!(
                    "queries at positions {}..{} but the dump has {t} tokens",
                    dump.q_start,
                    dump.q_start.saturating_add(n_q as u64)
                ))
            }
        };
        let k = (0..layers).map(|l| dump.kv.k[l].to_f32_vec()).collect();
        Ok(Self {
            layers,
            kv_heads,
            q_heads,
            d,
            t,
            n_q,
            q_start,
            k,
            q,
        })
    }

    /// Keys of one (layer, head) as a flat `[T, D]` buffer.
    fn head_keys(&self, keys: &[f32], h: usize) -> Vec<f32> {
        let (hh, d) = (self.kv_heads, self.d);
        let mut out = Vec::with_capacity(self.t * d);
        for tok in 0..self.t {
            let at = (tok * hh + h) * d;
            out.extend_from_slice(&keys[at..at + d]);
        }
        out
    }

    fn query(&self, l: usize, i: usize, qh: usize) -> &[f32] {
        let at = (i * self.q_heads + qh) * self.d;
        &self.q[l][at..at + self.d]
    }

    fn kv_head(&self, qh: usize) -> usize {
        qh / (self.q_heads / self.kv_heads)
    }
}

/// Keys decoded from a kvc stream of the dump at `level`, per layer `[T, H, D]`, and the
/// stream's bits per element. With `profile` (a profile learned once per model, e.g. on other
/// text) the stream references it; without, the stream is self-contained, its profile learned
/// from the dump's keys and values only (its queries are the test set) and counted in the size.
fn codec_keys(
    dump: &Dump,
    level: u8,
    profile: Option<&Path>,
) -> Result<(Vec<Vec<f32>>, f64), Error> {
    let mut kv_only = dump.clone();
    kv_only.q = None;
    let full = match profile {
        Some(p) => policy::load_profile(p)?,
        None => codec_core::learn_profile(&[kv_only.sample()], &Default::default())?,
    };
    if level >= full.levels() {
        return Err(Error::NoSuchLevel {
            level,
            levels: full.levels(),
        });
    }
    let how = match profile {
        Some(_) => ProfileUse::Referenced(&full),
        None => ProfileUse::SelfContained(&full),
    };
    let params = EncodeParams {
        levels: vec![level],
        ..EncodeParams::default()
    };
    let enc = policy::encode(&kv_only.kv.view(), how, &params, 0)?;
    let bpe = enc.bytes.len() as f64 * 8.0 / kv_only.kv.shape.total_elements() as f64;
    let reader = profile.map(|_| &full);
    let rec = Stream::open(&enc.bytes, reader, &Limits::DEFAULT)?.decode()?;
    let keys = (0..rec.shape.layers as usize)
        .map(|l| rec.k[l].to_f32_vec())
        .collect();
    Ok((keys, bpe))
}

/// The keys that re-rank a short list, per (layer, KV head) `[T, D]`, and the bits per element
/// of the stream they were decoded from.
struct Reranking {
    keys: Vec<Vec<f32>>,
    bpe: f64,
}

/// `sel`'s re-ranking keys, if it re-ranks.
fn reranking(data: &Data, dump: &Dump, sel: &Selector) -> Result<Option<Reranking>, Error> {
    let Some(r) = &sel.rerank else {
        return Ok(None);
    };
    let (k, bpe) = codec_keys(dump, r.level, r.profile.as_deref())?;
    let keys = (0..data.layers * data.kv_heads)
        .map(|i| data.head_keys(&k[i / data.kv_heads], i % data.kv_heads))
        .collect();
    Ok(Some(Reranking { keys, bpe }))
}

/// A selector trained on one layer: only that layer's codebooks are held at a time, however
/// large the options make them.
struct Trained<'r> {
    layer: usize,
    /// Per KV head: codebook and codes `[T, m]`.
    books: Vec<(Codebook, Vec<u16>)>,
    /// The re-ranking keys (of every layer), where `sel` re-ranks.
    rerank: Option<&'r Reranking>,
}

/// Trains `sel` on every KV head of layer `l`, adding each head's training seconds to
/// `train_s`.
fn train_layer<'r>(
    data: &Data,
    sel: &Selector,
    l: usize,
    rerank: Option<&'r Reranking>,
    train_s: &mut Vec<f64>,
) -> Result<Trained<'r>, Error> {
    let mut books = Vec::with_capacity(data.kv_heads);
    for h in 0..data.kv_heads {
        let keys = data.head_keys(&data.k[l], h);
        let params = PqParams {
            seed: sel.params.seed ^ ((l * data.kv_heads + h) as u64),
            ..sel.params
        };
        let t0 = Instant::now();
        let cb = Codebook::train(&keys, data.d, &params).map_err(|source| Error::Pq {
            at: format!("layer {l} head {h}"),
            source,
        })?;
        let codes = cb.encode(&keys)?;
        train_s.push(t0.elapsed().as_secs_f64());
        books.push((cb, codes));
    }
    Ok(Trained {
        layer: l,
        books,
        rerank,
    })
}

/// The tokens chosen for query `i`'s head `qh` at the trained layer: the windows, and `k` more,
/// by PQ score or re-ranked. Ascending.
fn choose(
    data: &Data,
    tr: &Trained<'_>,
    sel: &Selector,
    (i, qh): (usize, usize),
    k: usize,
    w: Windows,
) -> Result<Vec<u32>, PqError> {
    let (l, h) = (tr.layer, data.kv_head(qh));
    let len = data.q_start + i + 1;
    let (cb, codes) = &tr.books[h];
    let q = data.query(l, i, qh);
    let table = score_table(q, cb)?;
    let codes = &codes[..len * cb.m()];
    match (&sel.rerank, tr.rerank) {
        (Some(r), Some(rr)) => {
            let short = ((k as f64) * r.factor).round() as usize;
            let cand = search(codes, &table, short, w.n_init, w.n_local)?;
            // The window tokens are kept as they are; only the rest is re-ranked.
            let local_start = len - w.n_local.min(len);
            let init_end = w.n_init.min(len);
            let (mut fixed, rest): (Vec<u32>, Vec<u32>) = cand.into_iter().partition(|&t| {
                (t as usize) < init_end || (t as usize) >= local_start.max(init_end)
            });
            let hk = &rr.keys[l * data.kv_heads + h];
            fixed.extend(rerank(&rest, &hk[..len * data.d], q, k)?);
            fixed.sort_unstable();
            Ok(fixed)
        }
        _ => search(codes, &table, k, w.n_init, w.n_local),
    }
}

/// The LRU and LFU caches of 1/4 and 1/2 of the blocks, with their hit and miss counts.
struct Caches {
    /// (policy, capacity in blocks, hits, misses).
    kinds: Vec<(Policy, usize, u64, u64)>,
}

impl Caches {
    fn new(tokens: usize) -> Self {
        let n_blocks = tokens.div_ceil(BLOCK_TOKENS as usize);
        let mut kinds = Vec::new();
        for cap in [n_blocks / 4, n_blocks / 2] {
            for p in [Policy::Lru, Policy::Lfu] {
                kinds.push((p, cap, 0, 0));
            }
        }
        Caches { kinds }
    }

    /// One empty cache per kind and KV head, for a layer.
    fn layer(&self, kv_heads: usize) -> Vec<Vec<BlockCache>> {
        self.kinds
            .iter()
            .map(|&(p, cap, _, _)| (0..kv_heads).map(|_| BlockCache::new(cap, p)).collect())
            .collect()
    }

    /// One decode step of one KV head: `toks` (its GQA group's chosen tokens, the windows
    /// removed, ascending) are served by each kind's cache `caches[kind][h]`. A token hits if its
    /// block was cached when the step began; then every token touches its block once (LFU
    /// counts tokens, so blocks many tokens need stay).
    fn step(
        &mut self,
        caches: &mut [Vec<BlockCache>],
        h: usize,
        toks: &[u32],
    ) -> Result<(), Error> {
        let blocks = blocks_of(toks, BLOCK_TOKENS)?;
        for (ci, cs) in caches.iter_mut().enumerate() {
            let cache = &mut cs[h];
            let cached: Vec<bool> = blocks.iter().map(|&b| cache.contains(b)).collect();
            for &t in toks {
                let b = t / BLOCK_TOKENS;
                if blocks.binary_search(&b).is_ok_and(|at| cached[at]) {
                    self.kinds[ci].2 += 1;
                } else {
                    self.kinds[ci].3 += 1;
                }
                cache.access(b);
            }
        }
        Ok(())
    }

    fn figures(&self) -> Vec<CacheFigure> {
        self.kinds
            .iter()
            .map(|&(policy, capacity_blocks, hit, miss)| CacheFigure {
                policy,
                capacity_blocks,
                hit_rate: if hit + miss == 0 {
                    0.0
                } else {
                    hit as f64 / (hit + miss) as f64
                },
            })
            .collect()
    }
}

/// Sums of the accuracy figures over query heads.
#[derive(Default)]
struct Sums {
    recall_t5: f64,
    recall_t10: f64,
    mass: f64,
    mass_union: f64,
    n: usize,
}

/// Recall, mass and cache figures of `sel` on the trained layer, added to `sums` and `caches`.
fn score_layer(
    data: &Data,
    tr: &Trained<'_>,
    sel: &Selector,
    ((k5, k10), w): ((usize, usize), Windows),
    sums: &mut Sums,
    caches: &mut Caches,
) -> Result<(), Error> {
    let l = tr.layer;
    let mut layer_caches = caches.layer(data.kv_heads);
    let keys = TransposedKeys::new(&data.k[l], data.kv_heads, data.d);
    let mut exact = vec![0.0f32; data.t];
    let mut weights = Vec::new();
    let group = data.q_heads / data.kv_heads;
    for i in 0..data.n_q {
        let len = data.q_start + i + 1;
        let mut step_tokens: Vec<Vec<u32>> = vec![Vec::new(); data.kv_heads];
        for qh in 0..data.q_heads {
            let ex = &mut exact[..len];
            keys.scores_into(data.kv_head(qh), data.query(l, i, qh), ex);
            attention::softmax_into(ex, data.d, &mut weights);
            let truth5 = pq_core::select(ex, k5, 0, 0)?;
            let truth10 = pq_core::select(ex, k10, 0, 0)?;
            let got5 = choose(data, tr, sel, (i, qh), k5, Windows::NONE)?;
            let got10 = choose(data, tr, sel, (i, qh), k10, Windows::NONE)?;
            sums.recall_t5 += overlap(&truth5, &got5) as f64 / truth5.len().max(1) as f64;
            sums.recall_t10 += overlap(&truth10, &got10) as f64 / truth10.len().max(1) as f64;
            let with_win = choose(data, tr, sel, (i, qh), k5, w)?;
            sums.mass += with_win.iter().map(|&t| weights[t as usize]).sum::<f64>();
            // The fixtures README's definition: top-k over all tokens, united with the windows.
            let mut union = got5;
            union.extend(0..w.n_init.min(len) as u32);
            union.extend((len - w.n_local.min(len)) as u32..len as u32);
            union.sort_unstable();
            union.dedup();
            sums.mass_union += union.iter().map(|&t| weights[t as usize]).sum::<f64>();
            sums.n += 1;
            step_tokens[qh / group].extend_from_slice(&with_win);
        }
        // The windows stay resident; the cache serves the chosen tokens in between.
        let lo = w.n_init.min(len) as u32;
        let hi = (len - w.n_local.min(len)) as u32;
        for (h, toks) in step_tokens.iter_mut().enumerate() {
            toks.retain(|&t| t >= lo && t < hi.max(lo));
            toks.sort_unstable();
            caches.step(&mut layer_caches, h, toks)?;
        }
    }
    Ok(())
}

/// Times the score table and search (with windows) of every stored query head of the trained
/// layer, alone: adds the seconds and the searches to `total`.
fn time_searches(
    data: &Data,
    tr: &Trained<'_>,
    sel: &Selector,
    (k, w): (usize, Windows),
    total: &mut (f64, usize),
) -> Result<(), Error> {
    let t0 = Instant::now();
    let mut sink = 0u64;
    for i in 0..data.n_q {
        for qh in 0..data.q_heads {
            let s = choose(data, tr, sel, (i, qh), k, w)?;
            sink = sink.wrapping_add(s.len() as u64);
        }
    }
    std::hint::black_box(sink);
    total.0 += t0.elapsed().as_secs_f64();
    total.1 += data.n_q * data.q_heads;
    Ok(())
}

/// Every stored query head's PQ selection (`k` tokens outside the windows `w`, no re-ranking)
/// by `second`, checked against `pq_core::search`'s; token-scores per second, whole and kernel.
fn second_search(
    data: &Data,
    books: &[(Codebook, Vec<u16>)],
    sel: &Selector,
    (k, w): (usize, Windows),
    second: &mut dyn SecondSearch,
) -> Result<(f64, Option<f64>), Error> {
    let mut queries = Vec::with_capacity(data.layers * data.n_q * data.q_heads);
    for l in 0..data.layers {
        for i in 0..data.n_q {
            for qh in 0..data.q_heads {
                queries.push(SearchQuery {
                    head: l * data.kv_heads + data.kv_head(qh),
                    query: data.query(l, i, qh),
                    tokens: data.q_start + i + 1,
                    k,
                    windows: w,
                });
            }
        }
    }
    let companion = |at: String, source| Error::Companion { at, source };
    let got = second
        .search(books, &queries)
        .map_err(|e| companion(sel.name(), e))?;
    if got.selections.len() != queries.len() {
        let why = format!(
            "{} selections for {} queries",
            got.selections.len(),
            queries.len()
        );
        return Err(companion(sel.name(), why.into()));
    }
    for (n, (q, sel_got)) in queries.iter().zip(&got.selections).enumerate() {
        let (cb, codes) = &books[q.head];
        let table = score_table(q.query, cb)?;
        let want = search(&codes[..q.tokens * cb.m()], &table, k, w.n_init, w.n_local)?;
        if *sel_got != want {
            let (l, i, qh) = (
                n / (data.n_q * data.q_heads),
                (n / data.q_heads) % data.n_q,
                n % data.q_heads,
            );
            let why = format!("selected {sel_got:?}, pq-core {want:?}");
            return Err(companion(
                format!("{}: layer {l}, query {i}, head {qh}", sel.name()),
                why.into(),
            ));
        }
    }
    let scores = queries.iter().map(|q| q.tokens as f64).sum::<f64>();
    Ok((scores / got.seconds, got.kernel_seconds.map(|s| scores / s)))
}

/// Trains and measures one selector (and `second`'s selections, where given); `2 * layers`
/// progress steps.
fn evaluate_one(
    data: &Data,
    dump: &Dump,
    sel: &Selector,
    (ks, w): ((usize, usize), Windows),
    progress: &mut dyn Progress,
    second: Option<&mut dyn SecondSearch>,
) -> Result<Figures, Error> {
    progress.start(&sel.name(), data.layers as u64 * 2);
    let rr = reranking(data, dump, sel)?;
    let (mut sums, mut caches) = (Sums::default(), Caches::new(data.t));
    let (mut train_s, mut searched) = (Vec::new(), (0.0, 0));
    // The second search takes every layer's codebooks at once; without it one layer's are held.
    let mut kept = Vec::new();
    let mut first = None;
    for l in 0..data.layers {
        let tr = train_layer(data, sel, l, rr.as_ref(), &mut train_s)?;
        progress.step();
        score_layer(data, &tr, sel, (ks, w), &mut sums, &mut caches)?;
        time_searches(data, &tr, sel, (ks.0, w), &mut searched)?;
        progress.step();
        let cb = &tr.books[0].0;
        first.get_or_insert((cb.m() * usize::from(cb.bits()), cb.centroids().len()));
        if second.is_some() {
            kept.extend(tr.books);
        }
    }
    progress.finish();
    let second_scores_per_s = match second {
        Some(s) => Some(second_search(data, &kept, sel, (ks.0, w), s)?),
        None => None,
    };
    let (bits_per_key, codebook_floats) = first.unwrap_or_default();
    let n = sums.n as f64;
    Ok(Figures {
        name: sel.name(),
        bits_per_key,
        codebook_floats,
        recall_t5: sums.recall_t5 / n,
        recall_t10: sums.recall_t10 / n,
        mass: sums.mass / n,
        mass_union: sums.mass_union / n,
        train_ms_mean: train_s.iter().sum::<f64>() * 1e3 / train_s.len() as f64,
        search_ns_per_query_head: searched.0 * 1e9 / searched.1.max(1) as f64,
        rerank_bpe: rr.map(|r| r.bpe),
        cache: caches.figures(),
        second_scores_per_s,
    })
}

/// Number of common elements of two ascending lists.
fn overlap(a: &[u32], b: &[u32]) -> usize {
    let (mut i, mut j, mut n) = (0, 0, 0);
    while i < a.len() && j < b.len() {
        match a[i].cmp(&b[j]) {
            std::cmp::Ordering::Less => i += 1,
            std::cmp::Ordering::Greater => j += 1,
            std::cmp::Ordering::Equal => {
                n += 1;
                i += 1;
                j += 1;
            }
        }
    }
    n
}

/// Every selector of `sels` on the dump's stored queries (`kvc pq eval`): recall of the exact
/// top-T/5 and top-T/10 by `q . k` (no windows), softmax mass of the top-T/5 with the windows
/// `w`, timings and block-cache hit rates.
pub fn evaluate(
    dump: &Dump,
    sels: &[Selector],
    w: Windows,
    progress: &mut dyn Progress,
) -> Result<Report, Error> {
    evaluate_with(dump, sels, w, progress, None)
}

/// [`evaluate`], and with `second` also that selector's PQ selections of every stored query
/// head (top-T/5 with the windows `w`, no re-ranking): they must be `pq_core::search`'s (else
/// [`Error::Companion`]); its speed goes into [`Figures::second_scores_per_s`].
pub fn evaluate_with(
    dump: &Dump,
    sels: &[Selector],
    w: Windows,
    progress: &mut dyn Progress,
    mut second: Option<&mut dyn SecondSearch>,
) -> Result<Report, Error> {
    let data = Data::new(dump)?;
    let k_t5 = k_for_fraction(data.t, 1, 5)?;
    let k_t10 = k_for_fraction(data.t, 1, 10)?;
    let mut figures = Vec::with_capacity(sels.len());
    for s in sels {
        let ks = ((k_t5, k_t10), w);
        // A shorter-lived reborrow for each selector (a trait object's lifetime shrinks).
        let again: Option<&mut dyn SecondSearch> = match &mut second {
            Some(x) => Some(&mut **x),
            None => None,
        };
        figures.push(evaluate_one(&data, dump, s, ks, progress, again)?);
    }
    Ok(Report {
        k_t5,
        k_t10,
        figures,
    })
}

/// Selected token indices (`kvc pq select`).
#[derive(Clone, Debug, PartialEq)]
pub struct Selection {
    /// Per layer, `[n_q, q_heads, slots]`: token indices up to each query's position,
    /// ascending, `-1` padding.
    pub layers: Vec<Vec<i32>>,
    /// Stored queries.
    pub n_q: usize,
    /// Query heads.
    pub q_heads: usize,
    /// Slots per query head.
    pub slots: usize,
    /// The windows actually kept (clamped to the slots).
    pub windows: Windows,
    /// Tokens chosen by score per query head (`slots` minus the windows).
    pub k: usize,
    /// Tokens of the dump.
    pub tokens: usize,
    /// Position of the first query.
    pub q_start: usize,
    /// The selector used.
    pub selector: Selector,
}

/// `slots` tokens per stored query head: the windows `w` (clamped to the slots) and the best of
/// the rest by `sel`. `2 * layers` progress steps.
///
/// Errors with [`Error::SlotCount`] unless `1 <= slots <= tokens`.
pub fn select(
    dump: &Dump,
    sel: &Selector,
    w: Windows,
    slots: usize,
    progress: &mut dyn Progress,
) -> Result<Selection, Error> {
    let data = Data::new(dump)?;
    if slots == 0 || slots > data.t {
        return Err(Error::SlotCount {
            slots,
            tokens: data.t,
        });
    }
    progress.start("select", data.layers as u64 * 2);
    let rr = reranking(&data, dump, sel)?;
    let n_init = w.n_init.min(slots);
    let n_local = w.n_local.min(slots - n_init);
    let windows = Windows { n_init, n_local };
    let k = slots - n_init - n_local;
    let mut layers = Vec::with_capacity(data.layers);
    for l in 0..data.layers {
        let tr = train_layer(&data, sel, l, rr.as_ref(), &mut Vec::new())?;
        progress.step();
        let mut sel_l = Vec::with_capacity(data.n_q * data.q_heads * slots);
        for i in 0..data.n_q {
            for qh in 0..data.q_heads {
                let s = choose(&data, &tr, sel, (i, qh), k, windows)?;
                sel_l.extend((0..slots).map(|slot| s.get(slot).map_or(-1, |&t| t as i32)));
            }
        }
        layers.push(sel_l);
        progress.step();
    }
    progress.finish();
    Ok(Selection {
        layers,
        n_q: data.n_q,
        q_heads: data.q_heads,
        slots,
        windows,
        k,
        tokens: data.t,
        q_start: data.q_start,
        selector: sel.clone(),
    })
}

/// Writes a selection as safetensors, atomically: per layer `sel.{i}` int32 `[n_q, q_heads,
/// slots]`, and metadata naming the selector, its parameters and the layout. The header's keys
/// are sorted, so the same selection gives the same bytes.
pub fn write_selection(out: &Output, s: &Selection) -> Result<(), Error> {
    let plan: Vec<Planned> = (0..s.layers.len())
        .map(|l| Planned {
            name: format!("sel.{l}"),
            dtype: safetensors::Dtype::I32,
            shape: vec![s.n_q, s.q_heads, s.slots],
        })
        .collect();
    let serialize = |reason| DumpError::Serialize { reason };
    let mut file = FileBuffer::new(&plan, selection_metadata(s)).map_err(serialize)?;
    for (place, layer) in file.tensors_mut().into_iter().zip(&s.layers) {
        let to: Result<&mut [i32], _> = bytemuck::try_cast_slice_mut(place);
        to.map_err(|e| serialize(format!("{e:?}")))?
            .copy_from_slice(layer);
    }
    file.write(out).map_err(DumpError::from)?;
    Ok(())
}

fn selection_metadata(s: &Selection) -> HashMap<String, String> {
    let sel = &s.selector;
    let p = &sel.params;
    let mut md: HashMap<String, String> = HashMap::new();
    md.insert("method".into(), sel.name());
    md.insert("quantizer".into(), p.method.name().into());
    md.insert("m".into(), p.m.to_string());
    md.insert("b".into(), p.b.to_string());
    md.insert("max_iters".into(), p.max_iters.to_string());
    md.insert("refine_rounds".into(), p.refine_rounds.to_string());
    md.insert("seed".into(), p.seed.to_string());
    md.insert("n".into(), s.slots.to_string());
    md.insert("n_init".into(), s.windows.n_init.to_string());
    md.insert("n_local".into(), s.windows.n_local.to_string());
    md.insert("k".into(), s.k.to_string());
    md.insert("tokens".into(), s.tokens.to_string());
    md.insert("q_start".into(), s.q_start.to_string());
    md.insert("layers".into(), s.layers.len().to_string());
    md.insert("q_heads".into(), s.q_heads.to_string());
    if let Some(r) = &sel.rerank {
        md.insert("rerank_factor".into(), r.factor.to_string());
        md.insert("rerank_level".into(), r.level.to_string());
        if let Some(p) = &r.profile {
            md.insert("rerank_profile".into(), p.display().to_string());
        }
    }
    md.insert(
        "layout".into(),
        "sel.{i}: int32 [n_q, q_heads, n], token indices <= the query's position, ascending, -1 padding".into(),
    );
    md
}
