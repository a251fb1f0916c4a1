//! `kvc blend-eval`: CacheBlend against its baselines on the reference model.

use std::path::PathBuf;

use codec_core::blend::plan::{plan, Request, Tier};
use kvc_io::blend::{blend_eval, BlendParams, BlendRow};

use crate::judge::{load_model, read_text};
use crate::progress::Bars;
use crate::Result;

/// Options of `kvc blend-eval`.
pub struct BlendArgs {
    pub model: PathBuf,
    pub chunks: Vec<PathBuf>,
    pub question: PathBuf,
    pub params: BlendParams,
    pub json: bool,
}

/// Runs every method and prints the table or JSON.
pub fn cmd_blend_eval(a: BlendArgs) -> Result<()> {
    let m = load_model(&a.model)?;
    let texts = a
        .chunks
        .iter()
        .map(|p| read_text(p))
        .collect::<Result<Vec<_>>>()?;
    let question = read_text(&a.question)?;
    let mut bars = Bars::on_stderr();
    let r = blend_eval(&m, &texts, &question, &a.params, &mut bars).map_err(|e| e.to_string())?;
    if a.json {
        let v = serde_json::json!({
            "model": m.model_id(),
            "chunks": a.chunks.iter().map(|p| p.display().to_string()).collect::<Vec<_>>(),
            "question": a.question.display().to_string(),
            "reused_tokens": r.reused_tokens,
            "question_tokens": r.question_tokens,
            "scored": a.params.scored,
            "full_prefill_ms": r.full_prefill_ms,
            "rows": r.rows.iter().map(row_json).collect::<Vec<_>>(),
        });
        println!(
            "{}",
            serde_json::to_string_pretty(&v).map_err(|e| e.to_string())?
        );
        return Ok(());
    }
    println!(
        "{}: {} chunks, {} reused tokens, {} question tokens ({} scored); full prefill {:.0} ms",
        m.model_id(),
        a.chunks.len(),
        r.reused_tokens,
        r.question_tokens,
        a.params.scored,
        r.full_prefill_ms
    );
    println!(
        "{:<16} {:<12} {:>6} {:>10} {:>6} {:>9} {:>6} {:>7}",
        "method", "storage", "ratio", "KL nats", "top-1", "ms", "FLOPs", "recall"
    );
    for row in &r.rows {
        println!(
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
    println!("(KL(full prefill || method) per scored token; FLOPs: share of a full prefill's; recall: recomputed tokens among as many most deviating from the full prefill, mean over layers)");
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
    let chosen = &specs[p.tier];
    if a.json {
        let v = serde_json::json!({
            "tier": chosen.name, "ratio": p.ratio, "hidden": p.hidden,
            "recompute_ms_per_layer": p.recompute_s * 1e3, "load_ms_per_layer": p.load_s * 1e3,
            "prefill_s": prefill_s, "layers": layers, "layer_bytes": req.layer_bytes,
            "tiers": specs.iter().map(|t| serde_json::json!({
                "name": t.name, "gb_per_s": t.gb_per_s, "cost_per_gb": t.cost_per_gb,
                "load_ms_per_layer": req.load_s(&Tier { name: &t.name, gb_per_s: t.gb_per_s, cost_per_gb: t.cost_per_gb }) * 1e3,
            })).collect::<Vec<_>>(),
        });
        println!(
            "{}",
            serde_json::to_string_pretty(&v).map_err(|e| e.to_string())?
        );
        return Ok(());
    }
    println!(
        "context {} tokens, {layers} layers, {:.2} MB per layer stored, prefill {prefill_s:.3} s \
         ({:.2} ms per layer), minimal ratio {:.0}%",
        a.tokens,
        req.layer_bytes / 1e6,
        req.recompute_s(1.0) * 1e3,
        a.min_ratio * 100.0
    );
    println!(
        "{:<16} {:>8} {:>10} {:>14} {:>9}",
        "tier", "GB/s", "cost/GB", "load ms/layer", "ratio"
    );
    for t in &tiers {
        println!(
            "{:<16} {:>8.2} {:>10.3} {:>14.3} {:>8.0}%",
            t.name,
            t.gb_per_s,
            t.cost_per_gb,
            req.load_s(t) * 1e3,
            req.ratio(t) * 100.0
        );
    }
    println!(
        "plan: {} at ratio {:.0}% (recompute {:.3} ms, load {:.3} ms per layer){}",
        chosen.name,
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
        let bytes =
            std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
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

/// Seconds the reference runner takes to prefill `tokens` tokens (of GPL-3, repeated).
fn measure_prefill(model: &std::path::Path, tokens: u64) -> Result<f64> {
    let m = load_model(model)?;
    let text = read_text(std::path::Path::new("/usr/share/common-licenses/GPL-3"))?;
    let once = m.tokenizer().encode(&text).map_err(|e| e.to_string())?;
    let ids: Vec<u32> = once.iter().copied().cycle().take(tokens as usize).collect();
    let t0 = std::time::Instant::now();
    m.prefill(&ids).map_err(|e| e.to_string())?;
    Ok(t0.elapsed().as_secs_f64())
}
