//! `kvc dump` and `kvc judge`: the reference model making dumps and judging the codec.

use std::path::{Path, PathBuf};

use kvc_io::judge::{self, JudgeParams, JudgeProfile, JudgeRow};
use kvc_io::{policy, Output};
use llm::Model;

use crate::plot::{self, Chart, Series};
use crate::progress::Bars;
use crate::say::{note, out};
use crate::{read_text, Result};

pub fn load_model(path: &Path) -> Result<Model> {
    Model::load(path).map_err(|e| e.to_string())
}

/// The profile file at `path`, if one is given.
pub fn load_optional_profile(path: Option<&Path>) -> Result<Option<codec_core::Profile>> {
    path.map(policy::load_profile)
        .transpose()
        .map_err(|e| e.to_string())
}

/// The error's message, naming the text file where the text is the problem.
fn in_text(text: &Path, e: kvc_io::Error) -> String {
    match e {
        kvc_io::Error::TextTooShort { .. } => format!("{}: {e}", text.display()),
        e => e.to_string(),
    }
}

/// Prefills the first `tokens` tokens of `text` and writes the dump to `out`.
pub fn cmd_dump(
    model: &Path,
    text: &Path,
    out: &Output,
    tokens: usize,
    queries: usize,
    pre_rope: bool,
) -> Result<()> {
    let m = load_model(model)?;
    let t = read_text(text)?;
    let mut bars = Bars::on_stderr();
    let source = text.display().to_string();
    let d = judge::dump_text(&m, &t, &source, tokens, queries, pre_rope, &mut bars)
        .map_err(|e| in_text(text, e))?;
    kvc_io::write_full_dump(out, &d).map_err(|e| e.to_string())?;
    note!(
        "{}: {} layers x {} tokens x {} channels (f16, GPT-J pairing K{}), {} queries",
        out.path().display(),
        d.kv.shape.layers,
        d.kv.shape.tokens,
        d.kv.shape.channels(),
        if pre_rope { " before rotation" } else { "" },
        d.n_q()
    );
    Ok(())
}

/// Options of `kvc judge`.
pub struct JudgeArgs<'a> {
    pub model: &'a Path,
    pub text: &'a Path,
    pub params: JudgeParams,
    pub profile: Option<&'a Path>,
    pub json: bool,
    /// Also draw bits per element against KL into this SVG file.
    pub plot: Option<&'a Output>,
}

/// `kvc judge`'s arguments.
#[derive(clap::Args)]
pub struct JudgeCmd {
    /// The model (tools/fetch-model fetches the reference one and prints its path).
    pub model: PathBuf,
    /// A text file: its first --ctx tokens are the cache, the next --cont are scored.
    pub text: PathBuf,
    /// Context tokens.
    #[arg(long, default_value_t = 2048)]
    pub ctx: usize,
    /// Continuation tokens scored on top of the cache.
    #[arg(long, default_value_t = 256)]
    pub cont: usize,
    /// Profile the streams reference (learned on other text, e.g. `kvc profile` on a `kvc
    /// dump` of it); without it each stream embeds one learned from the context.
    #[arg(long)]
    pub profile: Option<PathBuf>,
    /// Levels to judge, comma separated (default: every level of the profile).
    #[arg(long, value_delimiter = ',')]
    pub levels: Option<Vec<u8>>,
    /// Leave out the minmax int8/int4/int3 baselines.
    #[arg(long)]
    pub no_baselines: bool,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Also draw bits per element against KL into this SVG file.
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
}

/// `kvc judge`: its outputs checked, then [`cmd_judge`].
pub fn cmd_judge_args(a: JudgeCmd, force: bool) -> Result<()> {
    let mut inputs = vec![a.model.as_path(), a.text.as_path()];
    inputs.extend(a.profile.as_deref());
    let plot = crate::plot_file(a.plot.as_deref(), &inputs, force)?;
    cmd_judge(JudgeArgs {
        model: &a.model,
        text: &a.text,
        params: JudgeParams {
            ctx: a.ctx,
            cont: a.cont,
            levels: a.levels,
            baselines: !a.no_baselines,
        },
        profile: a.profile.as_deref(),
        json: a.json,
        plot: plot.as_ref(),
    })
}

/// Judges every level (and the baselines) by the model on `a.text`; prints the table or JSON,
/// and with `a.plot` draws the chart.
pub fn cmd_judge(a: JudgeArgs<'_>) -> Result<()> {
    let m = load_model(a.model)?;
    let t = read_text(a.text)?;
    let loaded = load_optional_profile(a.profile)?;
    let how = JudgeProfile::or_self_learned(loaded.as_ref());
    let mut bars = Bars::on_stderr();
    let j = judge::judge(&m, &t, &a.params, how, &mut bars).map_err(|e| in_text(a.text, e))?;
    let mode = match a.profile {
        Some(p) => format!("profile {}", p.display()),
        None => "self-contained (profile learned from the context)".to_string(),
    };
    print(&a, &m, &j, &mode)?;
    match a.plot {
        Some(p) => plot::write(p, &chart(&a, &m, &j)),
        None => Ok(()),
    }
}

/// The table, or the JSON with `a.json`.
fn print(a: &JudgeArgs<'_>, m: &Model, j: &judge::Judgement, mode: &str) -> Result<()> {
    if a.json {
        let v = serde_json::json!({
            "model": m.model_id(),
            "text": a.text.display().to_string(),
            "ctx": j.ctx,
            "cont": j.cont,
            "mode": mode,
            "rows": j.rows.iter().map(row_json).collect::<Vec<_>>(),
        });
        out!(
            "{}",
            serde_json::to_string_pretty(&v).map_err(|e| e.to_string())?
        );
        return Ok(());
    }
    out!(
        "{} on {}: {} context tokens, {} scored, {mode}",
        m.model_id(),
        a.text.display(),
        j.ctx,
        j.cont
    );
    out!(
        "{:<14} {:>5} {:>8} {:>9} {:>10} {:>7} {:>8} {:>8}",
        "method",
        "level",
        "bits/el",
        "ppl",
        "KL nats",
        "top-1",
        "enc s",
        "dec s"
    );
    for r in &j.rows {
        let s = |x: Option<f64>| x.map_or_else(|| "-".into(), |v| format!("{v:.2}"));
        out!(
            "{:<14} {:>5} {:>8.3} {:>9.4} {:>10.6} {:>7.4} {:>8} {:>8}",
            r.method,
            r.level.map_or_else(|| "-".into(), |l| l.to_string()),
            r.bits_per_elem,
            r.ppl,
            r.kl,
            r.top1,
            s(r.encode_s),
            s(r.decode_s)
        );
    }
    out!("(KL(original || decoded) per scored token; top-1: argmax agreement with the original cache)");
    Ok(())
}

/// Bits per element against KL (log): the kvc levels as one curve labelled with their levels,
/// each minmax baseline as its own point. The uncompressed row (KL 0 by construction) is not
/// drawn.
fn chart(a: &JudgeArgs<'_>, m: &Model, j: &judge::Judgement) -> Chart {
    let mut levels = Series {
        name: "kvc levels".into(),
        ..Series::default()
    };
    let mut baselines = Vec::new();
    for r in &j.rows {
        let p = (r.bits_per_elem, r.kl);
        match (r.method.as_str(), r.level) {
            ("kvc", l) => {
                levels.points.push(p);
                levels
                    .labels
                    .push(l.map_or_else(String::new, |l| l.to_string()));
            }
            ("uncompressed", _) => {}
            (name, _) => baselines.push(Series {
                name: name.to_string(),
                points: vec![p],
                labels: vec![],
            }),
        }
    }
    Chart {
        title: format!(
            "kvc judge: {} on {} ({} + {} tokens)",
            m.model_id(),
            plot::file_name(a.text),
            j.ctx,
            j.cont
        ),
        x_label: "bits per element (every byte of the stream)".into(),
        y_label: "KL(original || decoded), nats per token".into(),
        log_y: true,
        curves: vec![levels],
        points: baselines,
    }
}

fn row_json(r: &JudgeRow) -> serde_json::Value {
    serde_json::json!({
        "method": r.method, "level": r.level, "bits_per_elem": r.bits_per_elem,
        "ppl": r.ppl, "kl": r.kl, "top1": r.top1,
        "encode_s": r.encode_s, "decode_s": r.decode_s,
    })
}
