//! `kvc pq`: PQCache-style token selection on a dump's real queries.
//!
//! `eval` trains the codebooks of every (layer, KV head), scores the dump's stored queries and
//! reports recall of the exact top-k, the softmax mass the selection captures, timings and the
//! block-cache hit rate; `select` writes the selected token indices for an outside harness.
use crate::dump::{write_file_atomic, Dump};
use crate::progress::Progress;
use crate::Result;
use codec_core::{EncodeParams, Limits, ProfileMode, Stream};
use pq_core::cache::{blocks_of, BlockCache, Policy};
use pq_core::{rerank, score_table, search, select, Codebook, PqParams};
use std::collections::HashMap;
use std::path::Path;
use std::time::Instant;

/// How tokens are chosen: the quantizer, and optionally a re-ranking stage.
#[derive(Clone, Debug)]
pub struct Selector {
    /// Codebook training parameters.
    pub params: PqParams,
    /// Re-rank `factor * k` PQ candidates with the codec's decoded keys (`None`: no re-ranking).
    pub rerank: Option<Rerank>,
}

/// The re-ranking stage.
#[derive(Clone, Debug)]
pub struct Rerank {
    /// Short-list size as a multiple of `k`.
    pub factor: f64,
    /// kvc level of the stream whose decoded keys re-score the short list.
    pub level: u8,
    /// Profile the stream references (`None`: self-contained, learned from the dump).
    pub profile: Option<std::path::PathBuf>,
}

impl Selector {
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

/// `round(t / den)`, half up: the `k` of "T/5" (2048/5 -> 410, as the fixtures README counts).
pub fn k_of(t: usize, den: usize) -> usize {
    (2 * t + den) / (2 * den)
}

/// Everything `kvc pq` needs from a dump, in f32.
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
    fn new(dump: &Dump) -> Result<Self> {
        let s = dump.kv.shape;
        let (layers, kv_heads, d, t) = (
            s.layers as usize,
            s.kv_heads as usize,
            s.head_dim as usize,
            s.tokens as usize,
        );
        let q = dump
            .q
            .clone()
            .ok_or("the dump has no queries (q.{i} tensors); kvc pq needs them")?;
        let n_q = dump.n_q();
        if n_q == 0 {
            return Err("the dump's q.{i} tensors hold no query".into());
        }
        let q_heads = dump.q_heads;
        if q_heads == 0 || !q_heads.is_multiple_of(kv_heads) {
            return Err(format!(
                "{q_heads} query heads is not a multiple of the {kv_heads} KV heads"
            ));
        }
        let q_start = usize::try_from(dump.q_start).map_err(|_| "q_start out of range")?;
        if q_start + n_q > t {
            return Err(format!(
                "queries at positions {q_start}..{} but the dump has {t} tokens",
                q_start + n_q
            ));
        }
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
}

/// Keys decoded from a kvc stream of the dump at `level`, per layer `[T, H, D]`, and the
/// stream's bits per element. With `profile` (a profile learned once per model, e.g. on other
/// text) the stream references it; without, the stream is self-contained, its profile learned
/// from the dump's keys and values only (its queries are the test set) and counted in the size.
fn codec_keys(dump: &Dump, level: u8, profile: Option<&Path>) -> Result<(Vec<Vec<f32>>, f64)> {
    let mut kv_only = dump.clone();
    kv_only.q = None;
    let full = match profile {
        Some(p) => crate::load_profile(p)?,
        None => {
            let sample = crate::sample_of(&kv_only);
            codec_core::learn_profile(&[sample], &codec_core::LearnParams::default())
                .map_err(|e| e.to_string())?
        }
    };
    if level >= full.levels() {
        return Err(format!(
            "level {level} does not exist (the profile has {})",
            full.levels()
        ));
    }
    let embedded;
    let (mode, params) = match profile {
        Some(_) => (
            ProfileMode::Referenced(&full),
            EncodeParams {
                levels: vec![level],
                ..EncodeParams::default()
            },
        ),
        None => {
            embedded = full.with_levels(&[level]);
            (
                ProfileMode::Embedded(&embedded),
                EncodeParams {
                    levels: vec![0],
                    ..EncodeParams::default()
                },
            )
        }
    };
    let bytes = codec_core::encode(&kv_only.kv.view(), mode, &params).map_err(|e| e.to_string())?;
    let bpe = bytes.len() as f64 * 8.0 / kv_only.kv.shape.total_elements() as f64;
    let stream = Stream::open(&bytes, profile.map(|_| &full), &Limits::DEFAULT)
        .map_err(|e| e.to_string())?;
    let rec = stream.decode().map_err(|e| e.to_string())?;
    Ok((
        (0..rec.shape.layers as usize)
            .map(|l| rec.k[l].to_f32_vec())
            .collect(),
        bpe,
    ))
}

/// A trained selector over a whole dump.
struct Trained {
    /// Per (layer, KV head): codebook and codes `[T, m]`.
    books: Vec<(Codebook, Vec<u16>)>,
    /// Per (layer, KV head) re-ranking keys `[T, D]` (with re-ranking).
    rerank_keys: Option<Vec<Vec<f32>>>,
    /// Bits per element of the stream the re-ranking keys come from.
    rerank_bpe: Option<f64>,
    /// Training seconds per (layer, head).
    train_s: Vec<f64>,
}

fn train(data: &Data, dump: &Dump, sel: &Selector, bar: &Progress) -> Result<Trained> {
    let mut books = Vec::with_capacity(data.layers * data.kv_heads);
    let mut train_s = Vec::new();
    for l in 0..data.layers {
        for h in 0..data.kv_heads {
            let keys = data.head_keys(&data.k[l], h);
            let params = PqParams {
                seed: sel.params.seed ^ ((l * data.kv_heads + h) as u64),
                ..sel.params
            };
            let t0 = Instant::now();
            let cb = Codebook::train(&keys, data.d, &params)
                .map_err(|e| format!("layer {l} head {h}: {e}"))?;
            let codes = cb.encode(&keys).map_err(|e| e.to_string())?;
            train_s.push(t0.elapsed().as_secs_f64());
            books.push((cb, codes));
        }
        bar.inc(1);
    }
    let (rerank_keys, rerank_bpe) = match &sel.rerank {
        Some(r) => {
            let (k, bpe) = codec_keys(dump, r.level, r.profile.as_deref())?;
            let per_head = (0..data.layers * data.kv_heads)
                .map(|i| data.head_keys(&k[i / data.kv_heads], i % data.kv_heads))
                .collect();
            (Some(per_head), Some(bpe))
        }
        None => (None, None),
    };
    Ok(Trained {
        books,
        rerank_keys,
        rerank_bpe,
        train_s,
    })
}

/// The tokens chosen for one query head at causal length `len`: `n_init` first, `n_local` last,
/// and `k` more, by PQ score or re-ranked.
#[allow(clippy::too_many_arguments)]
fn choose(
    data: &Data,
    tr: &Trained,
    sel: &Selector,
    l: usize,
    i: usize,
    qh: usize,
    k: usize,
    n_init: usize,
    n_local: usize,
) -> Result<Vec<u32>> {
    let h = qh / (data.q_heads / data.kv_heads);
    let len = data.q_start + i + 1;
    let (cb, codes) = &tr.books[l * data.kv_heads + h];
    let q = data.query(l, i, qh);
    let table = score_table(q, cb).map_err(|e| e.to_string())?;
    let codes = &codes[..len * cb.m()];
    match (&sel.rerank, &tr.rerank_keys) {
        (Some(r), Some(keys)) => {
            let short = ((k as f64) * r.factor).round() as usize;
            let cand = search(codes, &table, short, n_init, n_local).map_err(|e| e.to_string())?;
            // The window tokens are kept as they are; only the rest is re-ranked.
            let local_start = len - n_local.min(len);
            let init_end = n_init.min(len);
            let (mut fixed, rest): (Vec<u32>, Vec<u32>) = cand.into_iter().partition(|&t| {
                (t as usize) < init_end || (t as usize) >= local_start.max(init_end)
            });
            let hk = &keys[l * data.kv_heads + h];
            let best = rerank(&rest, &hk[..len * data.d], q, k).map_err(|e| e.to_string())?;
            fixed.extend(best);
            fixed.sort_unstable();
            Ok(fixed)
        }
        _ => search(codes, &table, k, n_init, n_local).map_err(|e| e.to_string()),
    }
}

/// Options shared by `eval` and `select`.
#[derive(Clone, Debug)]
pub struct Common {
    pub n_init: usize,
    pub n_local: usize,
}

/// Figures of one selector.
struct Figures {
    name: String,
    bits_per_key: usize,
    codebook_floats: usize,
    recall5: f64,
    recall10: f64,
    mass: f64,
    mass_union: f64,
    train_ms_mean: f64,
    search_ns_per_query_head: f64,
    rerank_bpe: Option<f64>,
    cache: Vec<(String, usize, f64)>,
}

fn exact_scores(data: &Data, l: usize, i: usize, qh: usize) -> Vec<f32> {
    let h = qh / (data.q_heads / data.kv_heads);
    let len = data.q_start + i + 1;
    let q = data.query(l, i, qh);
    let keys = &data.k[l];
    (0..len)
        .map(|t| {
            let at = (t * data.kv_heads + h) * data.d;
            let mut acc = 0.0f32;
            for (a, b) in q.iter().zip(&keys[at..at + data.d]) {
                acc += a * b;
            }
            acc
        })
        .collect()
}

/// Softmax weights of `scores / sqrt(D)` (f64).
fn softmax(scores: &[f32], d: usize) -> Vec<f64> {
    let scale = 1.0 / (d as f64).sqrt();
    let max = scores.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let w: Vec<f64> = scores
        .iter()
        .map(|&s| ((s as f64 - max) * scale).exp())
        .collect();
    let total: f64 = w.iter().sum();
    w.into_iter().map(|x| x / total).collect()
}

fn evaluate(data: &Data, dump: &Dump, sel: &Selector, c: &Common) -> Result<Figures> {
    let bar = Progress::new(data.layers as u64 * 2, &sel.name());
    let tr = train(data, dump, sel, &bar)?;
    let (k5, k10) = (k_of(data.t, 5), k_of(data.t, 10));
    let (mut r5, mut r10, mut mass, mut mass_u, mut n) = (0.0, 0.0, 0.0, 0.0, 0usize);
    let group = data.q_heads / data.kv_heads;
    let block_tokens = 128u32;
    let n_blocks = data.t.div_ceil(block_tokens as usize);
    let capacities = [n_blocks / 4, n_blocks / 2];
    let mut caches: Vec<(String, usize, u64, u64)> = Vec::new();
    for &cap in &capacities {
        for p in [Policy::Lru, Policy::Lfu] {
            caches.push((format!("{p:?}"), cap, 0, 0));
        }
    }
    for l in 0..data.layers {
        let mut layer_caches: Vec<Vec<BlockCache>> = caches
            .iter()
            .map(|(p, cap, _, _)| {
                let pol = if p == "Lru" { Policy::Lru } else { Policy::Lfu };
                (0..data.kv_heads)
                    .map(|_| BlockCache::new(*cap, pol))
                    .collect()
            })
            .collect();
        for i in 0..data.n_q {
            let mut step_tokens: Vec<Vec<u32>> = vec![Vec::new(); data.kv_heads];
            for qh in 0..data.q_heads {
                let ex = exact_scores(data, l, i, qh);
                let w = softmax(&ex, data.d);
                let truth5 = select(&ex, k5, 0, 0).map_err(|e| e.to_string())?;
                let truth10 = select(&ex, k10, 0, 0).map_err(|e| e.to_string())?;
                let got5 = choose(data, &tr, sel, l, i, qh, k5, 0, 0)?;
                let got10 = choose(data, &tr, sel, l, i, qh, k10, 0, 0)?;
                r5 += overlap(&truth5, &got5) as f64 / truth5.len().max(1) as f64;
                r10 += overlap(&truth10, &got10) as f64 / truth10.len().max(1) as f64;
                let with_win = choose(data, &tr, sel, l, i, qh, k5, c.n_init, c.n_local)?;
                mass += with_win.iter().map(|&t| w[t as usize]).sum::<f64>();
                // The fixtures README's definition: top-k over all tokens, united with the windows.
                let len = ex.len();
                let mut union = got5.clone();
                union.extend(0..c.n_init.min(len) as u32);
                union.extend((len - c.n_local.min(len)) as u32..len as u32);
                union.sort_unstable();
                union.dedup();
                mass_u += union.iter().map(|&t| w[t as usize]).sum::<f64>();
                n += 1;
                step_tokens[qh / group].extend_from_slice(&with_win);
            }
            // The windows stay resident; the cache serves the chosen tokens in between. A
            // token hits if its block was cached when the step began; then every chosen
            // token touches its block once (LFU counts tokens, so blocks many tokens need
            // stay).
            let len = data.q_start + i + 1;
            let lo = c.n_init.min(len) as u32;
            let hi = (len - c.n_local.min(len)) as u32;
            for (h, toks) in step_tokens.iter_mut().enumerate() {
                toks.retain(|&t| t >= lo && t < hi.max(lo));
                toks.sort_unstable();
                let blocks = blocks_of(toks, block_tokens).map_err(|e| e.to_string())?;
                for (ci, cs) in layer_caches.iter_mut().enumerate() {
                    let cache = &mut cs[h];
                    let cached: Vec<bool> = blocks.iter().map(|&b| cache.contains(b)).collect();
                    for &t in toks.iter() {
                        let b = t / block_tokens;
                        let at = blocks.binary_search(&b).expect("block of a chosen token");
                        if cached[at] {
                            caches[ci].2 += 1;
                        } else {
                            caches[ci].3 += 1;
                        }
                        cache.access(b);
                    }
                }
            }
        }
        bar.inc(1);
    }
    bar.finish();
    // Search timing: table + scores + top-k (with windows) for every stored query head, alone.
    let t0 = Instant::now();
    let mut searches = 0usize;
    let mut sink = 0u64;
    for l in 0..data.layers {
        for i in 0..data.n_q {
            for qh in 0..data.q_heads {
                let s = choose(data, &tr, sel, l, i, qh, k5, c.n_init, c.n_local)?;
                sink = sink.wrapping_add(s.len() as u64);
                searches += 1;
            }
        }
    }
    let search_ns = t0.elapsed().as_secs_f64() * 1e9 / searches.max(1) as f64;
    std::hint::black_box(sink);
    let cb = &tr.books[0].0;
    Ok(Figures {
        name: sel.name(),
        bits_per_key: cb.m() * usize::from(cb.bits()),
        codebook_floats: cb.centroids().len(),
        recall5: r5 / n as f64,
        recall10: r10 / n as f64,
        mass: mass / n as f64,
        mass_union: mass_u / n as f64,
        train_ms_mean: tr.train_s.iter().sum::<f64>() * 1e3 / tr.train_s.len() as f64,
        search_ns_per_query_head: search_ns,
        rerank_bpe: tr.rerank_bpe,
        cache: caches
            .iter()
            .map(|(p, cap, hit, miss)| {
                let total = hit + miss;
                let rate = if total == 0 {
                    0.0
                } else {
                    *hit as f64 / total as f64
                };
                (p.clone(), *cap, rate)
            })
            .collect(),
    })
}

fn overlap(a: &[u32], b: &[u32]) -> usize {
    // Both sorted ascending.
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

/// `kvc pq eval`: every selector in `sels` on the dump.
pub fn cmd_eval(
    input: &Path,
    dump: &Dump,
    sels: &[Selector],
    c: &Common,
    json: bool,
) -> Result<()> {
    let data = Data::new(dump)?;
    let figs: Vec<Figures> = sels
        .iter()
        .map(|s| evaluate(&data, dump, s, c))
        .collect::<Result<_>>()?;
    let (k5, k10) = (k_of(data.t, 5), k_of(data.t, 10));
    if json {
        let j = serde_json::json!({
            "input": input.display().to_string(),
            "shape": {"layers": data.layers, "kv_heads": data.kv_heads, "q_heads": data.q_heads,
                      "head_dim": data.d, "tokens": data.t, "queries": data.n_q, "q_start": data.q_start},
            "k_t5": k5, "k_t10": k10, "n_init": c.n_init, "n_local": c.n_local,
            "rows": figs.iter().map(|f| serde_json::json!({
                "name": f.name, "bits_per_key_per_head": f.bits_per_key,
                "codebook_floats_per_head": f.codebook_floats,
                "recall_t5": f.recall5, "recall_t10": f.recall10,
                "mass_t5_windows": f.mass, "mass_t5_union_windows": f.mass_union,
                "train_ms_per_head": f.train_ms_mean,
                "search_ns_per_query_head": f.search_ns_per_query_head,
                "token_scores_per_s": data.t as f64 / (f.search_ns_per_query_head * 1e-9),
                "rerank_stream_bits_per_element": f.rerank_bpe,
                "block_cache": f.cache.iter().map(|(p, cap, rate)| serde_json::json!({
                    "policy": p, "capacity_blocks": cap, "block_tokens": 128, "hit_rate": rate})).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
        });
        println!(
            "{}",
            serde_json::to_string_pretty(&j).map_err(|e| e.to_string())?
        );
        return Ok(());
    }
    println!(
        "{}: {} layers x {} KV heads ({} query heads), {} tokens, {} queries from position {}",
        input.display(),
        data.layers,
        data.kv_heads,
        data.q_heads,
        data.t,
        data.n_q,
        data.q_start
    );
    println!(
        "recall of the exact top-k by q.k (k = T/5 = {k5}, T/10 = {k10}); mass: softmax mass of the top-{k5} \
         chosen among the rest plus the first {} and last {} tokens (README's union form in brackets)",
        c.n_init, c.n_local
    );
    println!(
        "{:<44} {:>5} {:>9} {:>9} {:>15} {:>9} {:>10}",
        "method", "bits", "rec@T/5", "rec@T/10", "mass (union)", "train ms", "search ns"
    );
    for f in &figs {
        println!(
            "{:<44} {:>5} {:>9.4} {:>9.4} {:>7.4} ({:.4}) {:>9.2} {:>10.0}",
            f.name,
            f.bits_per_key,
            f.recall5,
            f.recall10,
            f.mass,
            f.mass_union,
            f.train_ms_mean,
            f.search_ns_per_query_head
        );
    }
    println!(
        "block cache: token hit rate of the chosen tokens outside the windows (128-token blocks, \
         one cache per layer and KV head of 1/4 and 1/2 of the blocks, the GQA group's selections \
         of each stored query in order):"
    );
    for f in &figs {
        let parts: Vec<String> = f
            .cache
            .iter()
            .map(|(p, cap, rate)| format!("{p} {cap} blocks {rate:.3}"))
            .collect();
        println!("  {:<44} {}", f.name, parts.join(", "));
    }
    Ok(())
}

/// `kvc pq select`: writes `sel.{i}` int32 `[n_q, q_heads, n]` per layer.
pub fn cmd_select(dump: &Dump, output: &Path, sel: &Selector, c: &Common, n: usize) -> Result<()> {
    let data = Data::new(dump)?;
    if n == 0 || n > data.t {
        return Err(format!(
            "--k {n}: the slots per query head must be within 1..={} (the dump's tokens)",
            data.t
        ));
    }
    let bar = Progress::new(data.layers as u64 * 2, "select");
    let tr = train(&data, dump, sel, &bar)?;
    let n_init = c.n_init.min(n);
    let n_local = c.n_local.min(n - n_init);
    let k = n - n_init - n_local;
    let mut tensors: Vec<(String, Vec<u8>)> = Vec::with_capacity(data.layers);
    for l in 0..data.layers {
        let mut buf = Vec::with_capacity(data.n_q * data.q_heads * n * 4);
        for i in 0..data.n_q {
            for qh in 0..data.q_heads {
                let s = choose(&data, &tr, sel, l, i, qh, k, n_init, n_local)?;
                debug_assert!(s.len() <= n);
                for slot in 0..n {
                    let v: i32 = s.get(slot).map_or(-1, |&t| t as i32);
                    buf.extend_from_slice(&v.to_le_bytes());
                }
            }
        }
        tensors.push((format!("sel.{l}"), buf));
        bar.inc(1);
    }
    bar.finish();
    let shape = vec![data.n_q, data.q_heads, n];
    let mut views = Vec::with_capacity(tensors.len());
    for (name, bytes) in &tensors {
        let v = safetensors::tensor::TensorView::new(safetensors::Dtype::I32, shape.clone(), bytes)
            .map_err(|e| e.to_string())?;
        views.push((name.as_str(), v));
    }
    let p = &sel.params;
    let mut md: HashMap<String, String> = HashMap::new();
    md.insert("method".into(), sel.name());
    md.insert("quantizer".into(), p.method.name().into());
    md.insert("m".into(), p.m.to_string());
    md.insert("b".into(), p.b.to_string());
    md.insert("max_iters".into(), p.max_iters.to_string());
    md.insert("refine_rounds".into(), p.refine_rounds.to_string());
    md.insert("seed".into(), p.seed.to_string());
    md.insert("n".into(), n.to_string());
    md.insert("n_init".into(), n_init.to_string());
    md.insert("n_local".into(), n_local.to_string());
    md.insert("k".into(), k.to_string());
    md.insert("tokens".into(), data.t.to_string());
    md.insert("q_start".into(), data.q_start.to_string());
    md.insert("layers".into(), data.layers.to_string());
    md.insert("q_heads".into(), data.q_heads.to_string());
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
    let bytes = crate::dump::serialize_safetensors(views, md)?;
    write_file_atomic(output, &bytes).map_err(|e| e.to_string())?;
    eprintln!(
        "{}: {} layers x {} queries x {} query heads, {} slots ({} first, {} last, {} chosen by {})",
        output.display(),
        data.layers,
        data.n_q,
        data.q_heads,
        n,
        n_init,
        n_local,
        k,
        sel.name()
    );
    Ok(())
}
