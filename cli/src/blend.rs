//! `kvc blend-eval`: CacheBlend against its baselines on the reference model.

use std::path::PathBuf;

use codec_core::blend::plan::{plan, Plan, Request, Tier};
use codec_core::blend::{Norm, SelectParams, Tensors};
use kvc_io::blend::{blend_eval, BlendParams, BlendReport, BlendRow, METHODS};
use kvc_io::judge::JudgeProfile;

use crate::judge::{load_model, load_optional_profile};
use crate::progress::Bars;
use crate::say::out;
use crate::{read_text, Result};

/// Options of `kvc blend-eval`.
#[derive(clap::Args)]
pub struct EvalArgs {
    /// The model (tools/fetch-model fetches the reference one and prints its path).
    pub model: PathBuf,
    /// Chunk text files, comma separated (each prefilled alone from position 0).
    #[arg(long, value_delimiter = ',', required = true)]
    pub chunks: Vec<PathBuf>,
    /// The question text file: run after the chunks, its last --scored tokens scored.
    #[arg(long)]
    pub question: PathBuf,
    /// Recompute ratios in percent, comma separated.
    #[arg(long, value_delimiter = ',', default_values_t = [0.0, 5.0, 10.0, 15.0, 20.0, 30.0, 50.0, 100.0])]
    pub ratio: Vec<f64>,
    /// kvc level the chunks are also stored at (they are always also used as computed), or
    /// `none`.
    #[arg(long, default_value = "7", value_parser = parse_level)]
    pub level: StoreLevel,
    /// Store the chunks with one step per channel for all tokens (no per-token steps from the
    /// token-importance policy), as `kvc encode --uniform-steps`.
    #[arg(long)]
    pub uniform_steps: bool,
    /// CacheBlend: rank stored chunks' tokens by their deviations as measured, without taking
    /// out the error the codec is expected to have left in each.
    #[arg(long)]
    pub raw_deviations: bool,
    /// Tokens per chunk (each text's first ones).
    #[arg(long, default_value_t = 512)]
    pub chunk_tokens: usize,
    /// The question's last tokens scored.
    #[arg(long, default_value_t = 128)]
    pub scored: usize,
    /// A profile for the stored chunks (learned elsewhere, referenced by the streams, not
    /// counted in their bits); without it each stream embeds one learned from its own chunk.
    #[arg(long)]
    pub profile: Option<PathBuf>,
    /// Seed of the random selection.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// The methods run, comma separated [default: all].
    #[arg(long, value_delimiter = ',', value_parser = METHODS)]
    pub methods: Vec<String>,
    /// CacheBlend: the tensor whose deviation ranks tokens.
    #[arg(long, value_parser = TENSORS.map(tensors_name), default_value = tensors_name(SelectParams::DEFAULT.tensors))]
    pub tensors: String,
    /// CacheBlend: the norm of a token's deviation.
    #[arg(long, value_parser = NORMS.map(norm_name), default_value = norm_name(SelectParams::DEFAULT.norm))]
    pub norm: String,
    /// CacheBlend: the share the first check keeps, as a multiple of the ratio (capped at
    /// 100%; the default keeps 20% for 15%).
    #[arg(long, default_value_t = SelectParams::DEFAULT.first_ratio / SelectParams::DEFAULT.ratio)]
    pub first_share: f32,
    /// CacheBlend: checks over which the share narrows to the ratio.
    #[arg(long, default_value_t = SelectParams::DEFAULT.narrow_layers)]
    pub narrow: u32,
    /// Run each method this many times and report the fastest (the other figures do not
    /// change).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub repeat: u32,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Every `--tensors` and `--norm` choice; their names are [`tensors_name`] and [`norm_name`].
const TENSORS: [Tensors; 3] = [Tensors::K, Tensors::V, Tensors::KV];
const NORMS: [Norm; 3] = [Norm::L1, Norm::L2, Norm::Max];

/// `--tensors`' name for `t`.
fn tensors_name(t: Tensors) -> &'static str {
    match t {
        Tensors::K => "k",
        Tensors::V => "v",
        Tensors::KV => "kv",
    }
}

/// `--norm`'s name for `n`.
fn norm_name(n: Norm) -> &'static str {
    match n {
        Norm::L1 => "l1",
        Norm::L2 => "l2",
        Norm::Max => "max",
    }
}

/// A `--level`: a kvc level, or none.
#[derive(Clone, Copy, Debug)]
pub struct StoreLevel(Option<u8>);

fn parse_level(s: &str) -> std::result::Result<StoreLevel, String> {
    if s == "none" {
        return Ok(StoreLevel(None));
    }
    s.parse::<u8>()
        .map(|l| StoreLevel(Some(l)))
        .map_err(|_| format!("{s:?} is not a level (0..=11) or `none`"))
}

impl EvalArgs {
    /// The measurement's parameters, checked.
    fn params(&self) -> Result<BlendParams> {
        if let Some(p) = self.ratio.iter().find(|p| !(0.0..=100.0).contains(*p)) {
            return Err(format!(
                "--ratio {p}: ratios are percentages within 0..=100"
            ));
        }
        // clap accepts only the names of these choices.
        let tensors = TENSORS
            .into_iter()
            .find(|&t| tensors_name(t) == self.tensors);
        let norm = NORMS.into_iter().find(|&n| norm_name(n) == self.norm);
        let (Some(tensors), Some(norm)) = (tensors, norm) else {
            return Err(format!(
                "--tensors {} --norm {}: unknown",
                self.tensors, self.norm
            ));
        };
        let share = self.first_share;
        if !(share.is_finite() && share >= 1.0) {
            return Err(format!(
                "--first-share {share}: the first check keeps at least the ratio (1 or more)"
            ));
        }
        let defaults = BlendParams::default();
        Ok(BlendParams {
            chunk_tokens: self.chunk_tokens,
            scored: self.scored,
            ratios: self.ratio.iter().map(|p| p / 100.0).collect(),
            level: self.level.0,
            token_importance: !self.uniform_steps,
            less_coding_error: !self.raw_deviations,
            seed: self.seed,
            select: SelectParams {
                ratio: 1.0,
                first_ratio: share,
                narrow_layers: self.narrow,
                tensors,
                norm,
            },
            methods: if self.methods.is_empty() {
                defaults.methods
            } else {
                self.methods.clone()
            },
            repeat: self.repeat as usize,
        })
    }
}

/// Runs the methods and prints the table or JSON.
pub fn cmd_blend_eval(a: EvalArgs) -> Result<()> {
    let params = a.params()?;
    let m = load_model(&a.model)?;
    let texts = a
        .chunks
        .iter()
        .map(|p| read_text(p))
        .collect::<Result<Vec<_>>>()?;
    let question = read_text(&a.question)?;
    let loaded = load_optional_profile(a.profile.as_deref())?;
    let how = JudgeProfile::or_self_learned(loaded.as_ref());
    let mut bars = Bars::on_stderr();
    let r =
        blend_eval(&m, &texts, &question, &params, how, &mut bars).map_err(|e| e.to_string())?;
    if a.json {
        let v = serde_json::json!({
            "model": m.model_id(),
            "chunks": a.chunks.iter().map(|p| p.display().to_string()).collect::<Vec<_>>(),
            "question": a.question.display().to_string(),
            "profile": a.profile.as_ref().map(|p| p.display().to_string()),
            "reused_tokens": r.reused_tokens,
            "question_tokens": r.question_tokens,
            "scored": params.scored,
            "full_prefill_ms": r.full_prefill_ms,
            "storages": r.storages.iter().map(|s| serde_json::json!({
                "storage": s.storage, "codec_kl": s.codec_kl, "bits_per_elem": s.bits_per_elem,
            })).collect::<Vec<_>>(),
            "rows": r.rows.iter().map(row_json).collect::<Vec<_>>(),
        });
        out!(
            "{}",
            serde_json::to_string_pretty(&v).map_err(|e| e.to_string())?
        );
        return Ok(());
    }
    print_table(&m, &a, &params, &r)?;
    Ok(())
}

fn print_table(m: &llm::Model, a: &EvalArgs, params: &BlendParams, r: &BlendReport) -> Result<()> {
    out!(
        "{}: {} chunks, {} reused tokens, {} question tokens ({} scored); full prefill {:.0} ms",
        m.model_id(),
        a.chunks.len(),
        r.reused_tokens,
        r.question_tokens,
        params.scored,
        r.full_prefill_ms
    );
    for s in r.storages.iter().filter(|s| s.bits_per_elem.is_some()) {
        out!(
            "{} ({}): {:.3} bits per element; the codec's own KL on this context {:.6}",
            s.storage,
            a.profile.as_ref().map_or_else(
                || "self-contained".to_string(),
                |p| format!("profile {}", p.display())
            ),
            s.bits_per_elem.unwrap_or(0.0),
            s.codec_kl
        );
    }
    out!(
        "{:<16} {:<12} {:>6} {:>10} {:>6} {:>9} {:>6} {:>7}",
        "method",
        "storage",
        "ratio",
        "KL nats",
        "top-1",
        "ms",
        "FLOPs",
        "recall"
    );
    for row in &r.rows {
        out!(
            "{:<16} {:<12} {:>5.0}% {:>10.6} {:>6.3} {:>9.0} {:>5.0}% {:>7}",
            row.method,
            row.storage,
            row.ratio * 100.0,
            row.kl,
            row.top1,
            row.prefill_ms,
            row.flop_share * 100.0,
            row.recall.map_or_else(|| "-".into(), |x| format!("{x:.3}"))
        );
    }
    out!("(KL(full prefill || method) per scored token; FLOPs: share of a full prefill's; recall: recomputed tokens among as many most deviating from the full prefill, mean over layers)");
    Ok(())
}

fn row_json(r: &BlendRow) -> serde_json::Value {
    serde_json::json!({
        "method": r.method, "storage": r.storage, "ratio": r.ratio, "kl": r.kl, "top1": r.top1,
        "prefill_ms": r.prefill_ms, "flop_share": r.flop_share, "recall": r.recall,
    })
}

/// Options of `kvc blend-plan`.
#[derive(clap::Args)]
pub struct PlanArgs {
    /// Tiers file: one `name GB/s cost-per-GB` per line (`#` comments).
    #[arg(long)]
    pub tiers: PathBuf,
    /// Context tokens.
    #[arg(long)]
    pub tokens: u64,
    /// Seconds to prefill the context on the serving model.
    #[arg(long, conflicts_with = "model")]
    pub prefill_s: Option<f64>,
    /// Measure the prefill time on this GGUF model (the reference runner) instead.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// A stream of the context (or one like it): its layers and its actual bytes per token.
    #[arg(long, conflicts_with_all = ["bytes_per_token", "layers"])]
    pub stream: Option<PathBuf>,
    /// Stored bytes per token over all layers (without --stream).
    #[arg(long)]
    pub bytes_per_token: Option<f64>,
    /// The model's layers (without --stream).
    #[arg(long)]
    pub layers: Option<u32>,
    /// The smallest ratio with a negligible quality drop (r*).
    #[arg(long, default_value_t = 0.15)]
    pub min_ratio: f64,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Prints the loading controller's decision: ratio and tier.
pub fn cmd_blend_plan(a: PlanArgs) -> Result<()> {
    let text = read_text(&a.tiers)?;
    let specs =
        kvc_io::blend::parse_tiers(&text).map_err(|e| format!("{}: {e}", a.tiers.display()))?;
    let (layers, bytes_per_token) = stored_size(&a)?;
    let prefill_s = match (a.prefill_s, &a.model) {
        (Some(s), _) => s,
        (None, Some(m)) => measure_prefill(m, a.tokens)?,
        (None, None) => {
            return Err("give --prefill-s SECONDS or --model MODEL.gguf to measure it".into())
        }
    };
    let req = Request {
        prefill_s,
        layers,
        layer_bytes: bytes_per_token * a.tokens as f64 / f64::from(layers),
        min_ratio: a.min_ratio,
    };
    let tiers: Vec<Tier<'_>> = specs
        .iter()
        .map(|t| Tier {
            name: &t.name,
            gb_per_s: t.gb_per_s,
            cost_per_gb: t.cost_per_gb,
        })
        .collect();
    let p = plan(&req, &tiers).map_err(|e| e.to_string())?;
    if a.json {
        let v = plan_json(&req, &tiers, &p);
        out!(
            "{}",
            serde_json::to_string_pretty(&v).map_err(|e| e.to_string())?
        );
    } else {
        print_plan(a.tokens, &req, &tiers, &p)?;
    }
    Ok(())
}

/// `kvc blend-plan --json`: the decision `p` for `req`, and every tier's load time.
fn plan_json(req: &Request, tiers: &[Tier<'_>], p: &Plan) -> serde_json::Value {
    serde_json::json!({
        "tier": tiers[p.tier].name, "ratio": p.ratio, "hidden": p.hidden,
        "recompute_ms_per_layer": p.recompute_s * 1e3, "load_ms_per_layer": p.load_s * 1e3,
        "prefill_s": req.prefill_s, "layers": req.layers, "layer_bytes": req.layer_bytes,
        "tiers": tiers.iter().map(|t| serde_json::json!({
            "name": t.name, "gb_per_s": t.gb_per_s, "cost_per_gb": t.cost_per_gb,
            "load_ms_per_layer": req.load_s(t) * 1e3,
        })).collect::<Vec<_>>(),
    })
}

/// `kvc blend-plan`'s table: the request of `tokens` tokens, every tier, the decision `p`.
fn print_plan(tokens: u64, req: &Request, tiers: &[Tier<'_>], p: &Plan) -> Result<()> {
    out!(
        "context {tokens} tokens, {} layers, {:.2} MB per layer stored, prefill {:.3} s \
         ({:.2} ms per layer), minimal ratio {:.0}%",
        req.layers,
        req.layer_bytes / 1e6,
        req.prefill_s,
        req.recompute_s(1.0) * 1e3,
        req.min_ratio * 100.0
    );
    out!(
        "{:<16} {:>8} {:>10} {:>14} {:>9}",
        "tier",
        "GB/s",
        "cost/GB",
        "load ms/layer",
        "ratio"
    );
    for t in tiers {
        out!(
            "{:<16} {:>8.2} {:>10.3} {:>14.3} {:>8.0}%",
            t.name,
            t.gb_per_s,
            t.cost_per_gb,
            req.load_s(t) * 1e3,
            req.ratio(t) * 100.0
        );
    }
    out!(
        "plan: {} at ratio {:.0}% (recompute {:.3} ms, load {:.3} ms per layer){}",
        tiers[p.tier].name,
        p.ratio * 100.0,
        p.recompute_s * 1e3,
        p.load_s * 1e3,
        if p.hidden {
            ""
        } else {
            "; no tier hides its load behind the minimal recompute, so the fastest is taken"
        }
    );
    Ok(())
}

/// Layers and stored bytes per token (all layers): from a stream's actual size, or given.
fn stored_size(a: &PlanArgs) -> Result<(u32, f64)> {
    if let Some(path) = &a.stream {
        let bytes = crate::read(path, kvc_io::store::MAX_LEVEL_BYTES)?;
        let h = codec_core::Header::parse(&bytes, &codec_core::Limits::DEFAULT)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        let tokens = f64::from(h.shape.tokens.max(1));
        return Ok((h.shape.layers, bytes.len() as f64 / tokens));
    }
    match (a.layers, a.bytes_per_token) {
        (Some(l), Some(b)) if l > 0 && b.is_finite() && b >= 0.0 => Ok((l, b)),
        _ => Err("give --stream FILE.kvc, or --layers and --bytes-per-token".into()),
    }
}

/// Seconds the reference runner takes to prefill `tokens` tokens.
fn measure_prefill(model: &std::path::Path, tokens: u64) -> Result<f64> {
    let tokens = usize::try_from(tokens).map_err(|e| e.to_string())?;
    load_model(model)?
        .time_prefill(tokens)
        .map_err(|e| e.to_string())
}
