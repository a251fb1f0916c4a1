//! `kvc`: encode, decode, inspect and evaluate KV-cache streams.

mod dump;
mod metrics;
mod pq;
mod progress;

use clap::{Parser, Subcommand};
use codec_core::profile::hex;
use codec_core::{
    EncodeParams, KvCache, LearnParams, Limits, Profile, ProfileMode, Queries, Sample, Stream,
};
use dump::{load_dump, write_dump, write_file_atomic, Dump};
use progress::Progress;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

/// The built-in sample: 512 tokens of SmolLM2-135M's KV cache (see testdata/).
const BUILTIN_SAMPLE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../testdata/smollm2-gpl3-512.safetensors"
);

#[derive(Parser)]
#[command(
    name = "kvc",
    version,
    about = "Compact, checksummed, chunked bitstreams for LLM KV caches"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Encode a safetensors KV dump (k.{i}, v.{i} [T, H, D]) into a .kvc stream.
    Encode {
        input: PathBuf,
        output: PathBuf,
        /// Level for every chunk (0 = finest).
        #[arg(long, default_value_t = 7, conflicts_with = "levels")]
        level: u8,
        /// Level per chunk, comma separated.
        #[arg(long, value_delimiter = ',')]
        levels: Option<Vec<u8>>,
        /// Profile to reference (without it the stream embeds a profile learned from the input).
        #[arg(long)]
        profile: Option<PathBuf>,
        /// Tokens per chunk.
        #[arg(long, default_value_t = codec_core::EncodeParams::DEFAULT_CHUNK_TOKENS)]
        chunk_tokens: u32,
        /// Tokens per group (anchor + deltas).
        #[arg(long, default_value_t = codec_core::EncodeParams::DEFAULT_GROUP)]
        group: u32,
        /// Leading tokens (attention sinks) stored exactly.
        #[arg(long, default_value_t = codec_core::EncodeParams::DEFAULT_SINK)]
        sink: u16,
        /// Same steps for every token: turn off the coarser steps for tokens that later queries
        /// barely read (use this if the cache will be read by queries at unusual positions).
        #[arg(long)]
        uniform_steps: bool,
    },
    /// Decode a .kvc stream into a safetensors dump in the original dtype.
    Decode {
        input: PathBuf,
        output: PathBuf,
        /// The profile the stream references (not needed for self-contained streams).
        #[arg(long)]
        profile: Option<PathBuf>,
        /// Only check that the stream was coded at this level (streams carry their levels).
        #[arg(long)]
        level: Option<u8>,
    },
    /// Print a stream's header, profile hash, chunks, levels and sizes.
    Inspect { input: PathBuf },
    /// Learn a profile (.kvcp) from one or more sample dumps.
    Profile {
        /// Output profile path.
        #[arg(short, long)]
        output: PathBuf,
        /// Sample dumps (queries q.{i} are used when present).
        #[arg(required = true)]
        samples: Vec<PathBuf>,
    },
    /// Measure every level on a dump: bits per element, errors, speed, against baselines.
    Eval {
        input: PathBuf,
        /// Profile to use (default: self-contained, learned from the input and embedded).
        #[arg(long)]
        profile: Option<PathBuf>,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// PQCache-style token selection on a dump's real queries (q.{i}).
    Pq {
        #[command(subcommand)]
        cmd: PqCmd,
    },
    /// `eval` on the built-in 512-token sample.
    Demo {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum PqCmd {
    /// Train codes on every (layer, KV head), search with the dump's queries, and report recall
    /// of the exact top-k, attention mass, timings and block-cache hit rates, next to the
    /// PQCache paper's product quantization.
    Eval {
        input: PathBuf,
        #[command(flatten)]
        opts: PqOpts,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Write the selected token indices: per layer `sel.{i}` int32 [n_q, q_heads, K] (token
    /// indices up to each query's position, ascending, -1 padding).
    Select {
        input: PathBuf,
        output: PathBuf,
        /// Slots per query head: the first --n-init and last --n-local tokens, and the best of
        /// the rest.
        #[arg(long)]
        k: usize,
        #[command(flatten)]
        opts: PqOpts,
    },
}

#[derive(clap::Args, Clone, Debug)]
struct PqOpts {
    /// Quantizer: rq (residual, kvc's default) or pq (product, the PQCache paper's).
    #[arg(long, default_value = "rq", value_parser = ["rq", "pq"])]
    method: String,
    /// Codes per key (stages for rq, sub-spaces for pq).
    #[arg(long, default_value_t = 2)]
    m: usize,
    /// Bits per code.
    #[arg(long, default_value_t = 6)]
    b: u8,
    /// Lloyd iterations per k-means.
    #[arg(long)]
    iters: Option<u32>,
    /// Refinement rounds (rq only).
    #[arg(long, default_value_t = 1)]
    refine: u32,
    /// Seed of the k-means++ draws.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Re-rank a short list of this many times k with the codec's decoded keys (0: off).
    #[arg(long, default_value_t = 2.0)]
    rerank: f64,
    /// kvc level of the stream whose decoded keys re-rank the short list.
    #[arg(long, default_value_t = 9)]
    rerank_level: u8,
    /// Profile for that stream (learned once per model, e.g. `kvc profile` on other text); without
    /// it the stream is self-contained, its profile learned from the dump's keys and values.
    #[arg(long)]
    rerank_profile: Option<PathBuf>,
    /// First tokens always selected (attention sinks).
    #[arg(long, default_value_t = 4)]
    n_init: usize,
    /// Last tokens always selected (local window).
    #[arg(long, default_value_t = 64)]
    n_local: usize,
}

impl PqOpts {
    fn params(&self) -> Result<pq_core::PqParams> {
        let method = if self.method == "pq" {
            pq_core::Method::Product
        } else {
            pq_core::Method::Residual
        };
        let base = if method == pq_core::Method::Product {
            pq_core::PqParams::paper()
        } else {
            pq_core::PqParams::default()
        };
        if !(self.rerank == 0.0 || (self.rerank >= 1.0 && self.rerank <= 64.0)) {
            return Err(format!(
                "--rerank {} must be 0 or within 1..=64",
                self.rerank
            ));
        }
        Ok(pq_core::PqParams {
            method,
            m: self.m,
            b: self.b,
            max_iters: self.iters.unwrap_or(base.max_iters),
            seed: self.seed,
            refine_rounds: if method == pq_core::Method::Residual {
                self.refine
            } else {
                0
            },
        })
    }
    fn selector(&self, with_rerank: bool) -> Result<pq::Selector> {
        Ok(pq::Selector {
            params: self.params()?,
            rerank: (with_rerank && self.rerank > 0.0).then(|| pq::Rerank {
                factor: self.rerank,
                level: self.rerank_level,
                profile: self.rerank_profile.clone(),
            }),
        })
    }
    fn common(&self) -> pq::Common {
        pq::Common {
            n_init: self.n_init,
            n_local: self.n_local,
        }
    }
}

fn cmd_pq(cmd: PqCmd) -> Result<()> {
    match cmd {
        PqCmd::Eval { input, opts, json } => {
            let d = load(&input)?;
            let mut sels = Vec::new();
            let paper = pq::Selector {
                params: pq_core::PqParams {
                    seed: opts.seed,
                    ..pq_core::PqParams::paper()
                },
                rerank: None,
            };
            let mine = opts.selector(false)?;
            if mine.params != paper.params {
                sels.push(paper);
            }
            sels.push(mine);
            if opts.rerank > 0.0 {
                sels.push(opts.selector(true)?);
            }
            pq::cmd_eval(&input, &d, &sels, &opts.common(), json)
        }
        PqCmd::Select {
            input,
            output,
            k,
            opts,
        } => {
            let d = load(&input)?;
            pq::cmd_select(&d, &output, &opts.selector(true)?, &opts.common(), k)
        }
    }
}

type Result<T> = std::result::Result<T, String>;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Encode {
            input,
            output,
            level,
            levels,
            profile,
            chunk_tokens,
            group,
            sink,
            uniform_steps,
        } => {
            let params = EncodeParams {
                chunk_tokens,
                group,
                n_sink: sink,
                levels: levels.unwrap_or_else(|| vec![level]),
                token_importance: !uniform_steps,
            };
            cmd_encode(&input, &output, profile.as_deref(), params)
        }
        Cmd::Decode {
            input,
            output,
            profile,
            level,
        } => cmd_decode(&input, &output, profile.as_deref(), level),
        Cmd::Inspect { input } => cmd_inspect(&input),
        Cmd::Profile { output, samples } => cmd_profile(&output, &samples),
        Cmd::Eval {
            input,
            profile,
            json,
        } => cmd_eval(&input, profile.as_deref(), json),
        Cmd::Pq { cmd } => cmd_pq(cmd),
        Cmd::Demo { json } => cmd_eval(Path::new(BUILTIN_SAMPLE), None, json),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvc: error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn read(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))
}

fn load(path: &Path) -> Result<Dump> {
    load_dump(path).map_err(|e| e.to_string())
}

fn load_profile(path: &Path) -> Result<Profile> {
    let bytes = read(path)?;
    Profile::from_bytes(&bytes, &Limits::DEFAULT).map_err(|e| format!("{}: {e}", path.display()))
}

fn sample_of(d: &Dump) -> Sample<'_> {
    Sample {
        kv: d.kv.view(),
        queries: d.q.as_ref().map(|q| Queries {
            q: q.iter().map(|l| l.as_slice()).collect(),
            q_heads: d.q_heads,
            q_start: d.q_start,
        }),
    }
}

fn learn(dumps: &[&Dump]) -> Result<Profile> {
    let samples: Vec<Sample<'_>> = dumps.iter().map(|d| sample_of(d)).collect();
    let bar = Progress::new(1, "learning profile");
    let p =
        codec_core::learn_profile(&samples, &LearnParams::default()).map_err(|e| e.to_string())?;
    bar.finish();
    Ok(p)
}

fn cmd_encode(
    input: &Path,
    output: &Path,
    profile: Option<&Path>,
    params: EncodeParams,
) -> Result<()> {
    let d = load(input)?;
    let (bytes, mode) = match profile {
        Some(pp) => {
            let p = load_profile(pp)?;
            let b = codec_core::encode(&d.kv.view(), ProfileMode::Referenced(&p), &params)
                .map_err(|e| e.to_string())?;
            (b, format!("referencing profile {}", &p.hash_hex()[..16]))
        }
        None => {
            let full = learn(&[&d])?;
            let mut used: Vec<u8> = params.levels.clone();
            used.sort_unstable();
            used.dedup();
            if let Some(&bad) = used.iter().find(|&&l| l >= full.levels()) {
                return Err(format!(
                    "level {bad} does not exist (levels 0..{})",
                    full.levels()
                ));
            }
            let p = full.with_levels(&used);
            let mut params = params;
            params.levels = params
                .levels
                .iter()
                .map(|l| used.iter().position(|u| u == l).unwrap_or(0) as u8)
                .collect();
            let b = codec_core::encode(&d.kv.view(), ProfileMode::Embedded(&p), &params)
                .map_err(|e| e.to_string())?;
            (b, "self-contained".to_string())
        }
    };
    write_file_atomic(output, &bytes).map_err(|e| e.to_string())?;
    let bpe = bytes.len() as f64 * 8.0 / d.kv.shape.total_elements() as f64;
    eprintln!(
        "{}: {} bytes, {bpe:.3} bits/element, {mode}",
        output.display(),
        bytes.len()
    );
    Ok(())
}

fn cmd_decode(
    input: &Path,
    output: &Path,
    profile: Option<&Path>,
    level: Option<u8>,
) -> Result<()> {
    let bytes = read(input)?;
    let p = profile.map(load_profile).transpose()?;
    let s = Stream::open(&bytes, p.as_ref(), &Limits::DEFAULT)
        .map_err(|e| format!("{}: {e}", input.display()))?;
    if let Some(l) = level {
        if let Some(e) = s.header().chunks.iter().find(|e| e.level != l) {
            return Err(format!("chunk at token {} is coded at level {}, not {l} (levels are chosen at encode time)", e.token_start, e.level));
        }
    }
    let cache = s
        .decode()
        .map_err(|e| format!("{}: {e}", input.display()))?;
    let mut meta = std::collections::BTreeMap::new();
    meta.insert("model".to_string(), cache.meta.model_id.clone());
    meta.insert(
        "rope_theta".to_string(),
        format!("{}", cache.meta.rope.theta),
    );
    meta.insert(
        "pre_rope".to_string(),
        (cache.meta.rope.k_pre_rope as u8).to_string(),
    );
    meta.insert(
        "first_position".to_string(),
        cache.meta.first_position.to_string(),
    );
    meta.insert(
        "rope_style".to_string(),
        match cache.meta.rope.style {
            codec_core::RopeStyle::NeoX => "rotate_half (NeoX)",
            codec_core::RopeStyle::GptJ => "interleaved (GPT-J)",
            codec_core::RopeStyle::None => "none",
        }
        .to_string(),
    );
    write_dump(output, &cache, &meta).map_err(|e| e.to_string())?;
    eprintln!(
        "{}: {} layers x {} tokens, {}",
        output.display(),
        cache.shape.layers,
        cache.shape.tokens,
        cache.dtype().name()
    );
    Ok(())
}

fn cmd_inspect(input: &Path) -> Result<()> {
    let bytes = read(input)?;
    let h = codec_core::Header::parse(&bytes, &Limits::DEFAULT)
        .map_err(|e| format!("{}: {e}", input.display()))?;
    let s = h.shape;
    println!(
        "file            {} ({} bytes)",
        input.display(),
        bytes.len()
    );
    println!("format          kvc stream v{}", h.version);
    println!(
        "model           {}",
        if h.meta.model_id.is_empty() {
            "(none)"
        } else {
            &h.meta.model_id
        }
    );
    println!(
        "shape           {} layers x {} kv heads x {} head dim, {} tokens, {}",
        s.layers,
        s.kv_heads,
        s.head_dim,
        s.tokens,
        h.dtype.name()
    );
    println!(
        "rope            {:?}, theta {}, scaling {}, K {}-RoPE",
        h.meta.rope.style,
        h.meta.rope.theta,
        h.meta.rope.scaling,
        if h.meta.rope.k_pre_rope {
            "pre"
        } else {
            "post"
        }
    );
    println!("first position  {}", h.meta.first_position);
    println!(
        "chunking        {} tokens/chunk, groups of {}, {} sink token(s)",
        h.chunk_tokens, h.group, h.n_sink
    );
    println!(
        "profile         {} ({})",
        hex(&h.profile_hash),
        if h.profile_len > 0 {
            // The embedded profile's format version (its bytes 4..6), when present.
            let at = h.header_len();
            match bytes.get(at + 4..at + 6) {
                Some(v) => format!(
                    "embedded, {} bytes, profile v{}",
                    h.profile_len,
                    u16::from_le_bytes([v[0], v[1]])
                ),
                None => format!("embedded, {} bytes", h.profile_len),
            }
        } else {
            "referenced".to_string()
        }
    );
    let total = s.total_elements().max(1) as f64;
    println!("header          {} bytes", h.header_len());
    println!(
        "total           {:.4} bits/element",
        bytes.len() as f64 * 8.0 / total
    );
    println!("chunk  tokens          level  bytes       bits/element");
    for (i, e) in h.chunks.iter().enumerate() {
        let el = s.layers as f64 * 2.0 * e.tokens as f64 * s.channels() as f64;
        println!(
            "{i:<6} {:>6}..{:<7} {:>5}  {:<10}  {:.4}",
            e.token_start,
            e.token_start + e.tokens,
            e.level,
            e.len_bytes,
            e.len_bytes as f64 * 8.0 / el
        );
    }
    Ok(())
}

fn cmd_profile(output: &Path, samples: &[PathBuf]) -> Result<()> {
    let dumps = samples
        .iter()
        .map(|p| load(p))
        .collect::<Result<Vec<_>>>()?;
    let refs: Vec<&Dump> = dumps.iter().collect();
    let p = learn(&refs)?;
    write_file_atomic(output, p.as_bytes()).map_err(|e| e.to_string())?;
    eprintln!(
        "{}: profile {} ({} bytes, {} levels)",
        output.display(),
        p.hash_hex(),
        p.as_bytes().len(),
        p.levels()
    );
    Ok(())
}

struct Row {
    name: String,
    bits_per_element: f64,
    k_rel: f64,
    v_rel: f64,
    attn: f64,
    k_rel_layers: Vec<f64>,
    v_rel_layers: Vec<f64>,
    attn_layers: Vec<f64>,
    encode_mb_s: Option<f64>,
    decode_mb_s: Option<f64>,
    bytes: Option<usize>,
}

fn mean(x: &[f64]) -> f64 {
    if x.is_empty() {
        f64::NAN
    } else {
        x.iter().sum::<f64>() / x.len() as f64
    }
}

#[allow(clippy::needless_range_loop)]
fn errors(d: &Dump, orig_attn: &[Option<Vec<f32>>], rec: &KvCache, name: String, bpe: f64) -> Row {
    let (mut kl, mut vl, mut al) = (Vec::new(), Vec::new(), Vec::new());
    for l in 0..d.kv.shape.layers as usize {
        let (k, v) = (d.kv.k[l].to_f32_vec(), d.kv.v[l].to_f32_vec());
        let (k2, v2) = (rec.k[l].to_f32_vec(), rec.v[l].to_f32_vec());
        kl.push(metrics::rel_error(&k, &k2));
        vl.push(metrics::rel_error(&v, &v2));
        if let (Some(a), Some(b)) = (
            &orig_attn[l],
            metrics::dump_attention_output(d, l, &k2, &v2),
        ) {
            al.push(metrics::rel_error(a, &b));
        }
    }
    Row {
        name,
        bits_per_element: bpe,
        k_rel: mean(&kl),
        v_rel: mean(&vl),
        attn: mean(&al),
        k_rel_layers: kl,
        v_rel_layers: vl,
        attn_layers: al,
        encode_mb_s: None,
        decode_mb_s: None,
        bytes: None,
    }
}

fn cmd_eval(input: &Path, profile: Option<&Path>, json: bool) -> Result<()> {
    let d = load(input)?;
    let shape = d.kv.shape;
    let elements = shape.total_elements();
    let f16_mb = elements as f64 * 2.0 / 1e6;
    let (full, mode) = match profile {
        Some(p) => (load_profile(p)?, format!("profile {}", p.display())),
        None => (learn(&[&d])?, "self-contained".to_string()),
    };
    let orig_attn: Vec<Option<Vec<f32>>> = (0..shape.layers as usize)
        .map(|l| {
            metrics::dump_attention_output(&d, l, &d.kv.k[l].to_f32_vec(), &d.kv.v[l].to_f32_vec())
        })
        .collect();
    let mut rows = Vec::new();
    let bar = Progress::new(full.levels() as u64, "levels");
    for level in 0..full.levels() {
        let params = EncodeParams {
            levels: vec![if profile.is_some() { level } else { 0 }],
            ..EncodeParams::default()
        };
        let embedded;
        let (mode, prof) = if profile.is_some() {
            (ProfileMode::Referenced(&full), &full)
        } else {
            embedded = full.with_levels(&[level]);
            (ProfileMode::Embedded(&embedded), &embedded)
        };
        let view = d.kv.view();
        let t0 = Instant::now();
        let bytes = codec_core::encode(&view, mode, &params).map_err(|e| e.to_string())?;
        let enc_s = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let stream =
            Stream::open(&bytes, Some(prof), &Limits::DEFAULT).map_err(|e| e.to_string())?;
        let rec = stream.decode().map_err(|e| e.to_string())?;
        let dec_s = t1.elapsed().as_secs_f64();
        let bpe = bytes.len() as f64 * 8.0 / elements as f64;
        let mut row = errors(
            &d,
            &orig_attn,
            &rec,
            format!(
                "kvc level {level} (x{})",
                full.level_multipliers()[level as usize]
            ),
            bpe,
        );
        row.encode_mb_s = Some(f16_mb / enc_s);
        row.decode_mb_s = Some(f16_mb / dec_s);
        row.bytes = Some(bytes.len());
        rows.push(row);
        bar.inc(1);
    }
    bar.finish();
    for b in metrics::minmax_baselines(&d, &[8, 4, 3]) {
        rows.push(Row {
            name: b.name.clone(),
            bits_per_element: b.bits_per_element,
            k_rel: b.k_rel,
            v_rel: b.v_rel,
            attn: b.attn,
            k_rel_layers: vec![],
            v_rel_layers: vec![],
            attn_layers: vec![],
            encode_mb_s: None,
            decode_mb_s: None,
            bytes: None,
        });
    }
    if json {
        let j = serde_json::json!({
            "input": input.display().to_string(),
            "mode": mode,
            "shape": {"layers": shape.layers, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim, "tokens": shape.tokens},
            "profile_bytes": full.as_bytes().len(),
            "rows": rows.iter().map(|r| serde_json::json!({
                "name": r.name, "bits_per_element": r.bits_per_element, "bytes": r.bytes,
                "k_rel": r.k_rel, "v_rel": r.v_rel, "attn": r.attn,
                "k_rel_layers": r.k_rel_layers, "v_rel_layers": r.v_rel_layers, "attn_layers": r.attn_layers,
                "encode_mb_s": r.encode_mb_s, "decode_mb_s": r.decode_mb_s,
            })).collect::<Vec<_>>(),
        });
        println!(
            "{}",
            serde_json::to_string_pretty(&j).map_err(|e| e.to_string())?
        );
    } else {
        println!(
            "{} ({} layers x {} tokens x {} channels, {}), {mode}",
            input.display(),
            shape.layers,
            shape.tokens,
            shape.channels(),
            d.kv.dtype().name()
        );
        println!(
            "{:<28} {:>8} {:>9} {:>8} {:>8} {:>10} {:>10}",
            "method", "bits/el", "attn err", "K rel", "V rel", "enc MB/s", "dec MB/s"
        );
        for r in &rows {
            let f = |x: Option<f64>| x.map(|v| format!("{v:.0}")).unwrap_or_else(|| "-".into());
            println!(
                "{:<28} {:>8.3} {:>9.4} {:>8.4} {:>8.4} {:>10} {:>10}",
                r.name,
                r.bits_per_element,
                r.attn,
                r.k_rel,
                r.v_rel,
                f(r.encode_mb_s),
                f(r.decode_mb_s)
            );
        }
        println!("(bits/element count every byte of the stream; attention error: ||out'-out||/||out|| on the dump's queries, mean over layers; MB/s of f16)");
    }
    Ok(())
}
