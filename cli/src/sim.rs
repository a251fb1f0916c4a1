//! `kvc stream-sim`: a store streamed over bandwidth traces by the adapter, every fixed level and
//! always-text, against deadlines.

use std::path::PathBuf;

use codec_core::adapt::Sizes;
use kvc_io::sim::{simulate, SimContext, SimParams, SimRow, Trace};
use kvc_io::store::Store;

use crate::plot::{self, Chart, Series};
use crate::read_text;
use crate::say::out;
use crate::{output_file, Result};

/// Options of `kvc stream-sim`.
#[derive(clap::Args)]
pub struct SimArgs {
    /// A multi-level store (`kvc encode --store`).
    pub store: PathBuf,
    /// Seeded random-walk traces (0.1-10 Gbps) to simulate (without --trace).
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub traces: u32,
    /// Seed of the random traces.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// A trace file instead (one `seconds Gbps` per line, `#` comments).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Deadlines in seconds, comma separated.
    #[arg(long, value_delimiter = ',', required = true)]
    pub slo: Vec<f64>,
    /// Multiply every chunk's size by this (e.g. 22.75 sizes SmolLM2's 11,520 K/V values per
    /// token as Llama-7B's 262,144).
    #[arg(long, default_value_t = 1.0)]
    pub bytes_scale: f64,
    /// The consumer recomputes a chunk from its text at this many milliseconds per token (needs
    /// the store's token ids); adds the always-text policy.
    #[arg(long)]
    pub text_ms_per_token: Option<f64>,
    /// Requests batched on the link.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub concurrent: u32,
    /// Each level's error from `kvc judge --json` output (its KL); without it, the profile's
    /// calibrated attention error, 0.1 x the level's multiplier.
    #[arg(long)]
    pub judge: Option<PathBuf>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Also draw violation rate against mean error into this SVG file.
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
}

/// Runs the simulation and prints the table or JSON.
pub fn cmd_stream_sim(a: SimArgs, force: bool) -> Result<()> {
    let plot_out = a
        .plot
        .as_deref()
        .map(|p| output_file(p, &[&a.store], force))
        .transpose()?;
    let store = Store::open(&a.store).map_err(|e| e.to_string())?;
    let (errors, error_kind) = level_errors(&store, a.judge.as_ref())?;
    let ctx = context(&store, a.bytes_scale, errors)?;
    if a.text_ms_per_token.is_some() && store.chunk_token_ids(0).is_none() {
        return Err(format!(
            "{}: the store has no token ids, so no chunk can be sent as text (make the dump with \
             kvc dump, which records them)",
            a.store.display()
        ));
    }
    let traces = match &a.trace {
        Some(p) => vec![Trace::parse(&read_text(p)?).map_err(|e| format!("{}: {e}", p.display()))?],
        None => Trace::random_walks(a.seed, a.traces as usize, TRACE_S),
    };
    let params = SimParams {
        slos: a.slo.clone(),
        text_s_per_token: a.text_ms_per_token.map(|ms| ms / 1e3),
        concurrent: a.concurrent,
    };
    let rows = simulate(&ctx, &traces, &params).map_err(|e| e.to_string())?;
    let report = Report {
        a: &a,
        store: &store,
        traces: traces.len(),
        kind: error_kind,
        rows: &rows,
    };
    if a.json {
        report.print_json()?;
    } else {
        report.print_table()?;
    }
    match plot_out {
        Some(out) => plot::write(&out, &chart(&rows, error_kind)),
        None => Ok(()),
    }
}

/// Seconds of each random-walk trace (its last rate holds after).
const TRACE_S: f64 = 60.0;

/// The store's chunk sizes (scaled) and token counts.
fn context(store: &Store, scale: f64, errors: Vec<f64>) -> Result<SimContext> {
    if !(scale.is_finite() && scale > 0.0) {
        return Err(format!("--bytes-scale {scale}: give a positive factor"));
    }
    let mut bytes = Vec::with_capacity(store.chunks() * store.levels().len());
    let mut tokens = Vec::with_capacity(store.chunks());
    for i in 0..store.chunks() {
        for &l in store.levels() {
            let b = store.chunk_bytes(i, l).map_err(|e| e.to_string())?;
            bytes.push((b as f64 * scale).round() as u64);
        }
        tokens.push(store.chunk_range(i).map_or(0, |r| r.end - r.start));
    }
    let sizes =
        Sizes::new(store.levels().to_vec(), bytes, store.chunks()).map_err(|e| e.to_string())?;
    Ok(SimContext {
        sizes,
        tokens,
        errors,
    })
}

/// Each level's error, and what it is.
fn level_errors(store: &Store, judge: Option<&PathBuf>) -> Result<(Vec<f64>, &'static str)> {
    let Some(path) = judge else {
        let mult = store.profile().level_multipliers();
        let aim = |l: u8| 0.1 * f64::from(mult.get(l as usize).copied().unwrap_or(f32::NAN));
        return Ok((
            store.levels().iter().map(|&l| aim(l)).collect(),
            "attention error (calibrated aim)",
        ));
    };
    let v: serde_json::Value = serde_json::from_str(&read_text(path)?)
        .map_err(|e| format!("{}: not kvc judge --json output ({e})", path.display()))?;
    let rows = v["rows"].as_array().cloned().unwrap_or_default();
    let kl = |l: u8| {
        rows.iter()
            .find(|r| r["method"] == "kvc" && r["level"].as_u64() == Some(u64::from(l)))
            .and_then(|r| r["kl"].as_f64())
    };
    let errors = store
        .levels()
        .iter()
        .map(|&l| kl(l).ok_or_else(|| format!("{}: no kvc row at level {l}", path.display())))
        .collect::<Result<Vec<f64>>>()?;
    Ok((errors, "KL (kvc judge)"))
}

/// What `kvc stream-sim` found, to print: on `store` over `traces` traces, `rows` (errors of
/// the `kind` named).
struct Report<'a> {
    a: &'a SimArgs,
    store: &'a Store,
    traces: usize,
    kind: &'a str,
    rows: &'a [SimRow],
}

impl Report<'_> {
    fn print_table(&self) -> Result<()> {
        let (a, store) = (self.a, self.store);
        out!(
            "{}: {} chunks at levels {:?}, bytes x{}, {} trace(s); error: {}",
            a.store.display(),
            store.chunks(),
            store.levels(),
            a.bytes_scale,
            self.traces,
            self.kind
        );
        out!(
            "{:<10} {:>7} {:>10} {:>11} {:>9} {:>9}",
            "policy",
            "SLO s",
            "violation",
            "mean error",
            "TTFT p50",
            "TTFT p95"
        );
        for r in self.rows {
            out!(
                "{:<10} {:>7.3} {:>9.1}% {:>11.5} {:>8.3}s {:>8.3}s",
                r.policy,
                r.slo_s,
                r.violation_rate * 100.0,
                r.mean_error,
                r.ttft_p50_s,
                r.ttft_p95_s
            );
        }
        Ok(())
    }

    fn print_json(&self) -> Result<()> {
        let (a, store) = (self.a, self.store);
        let v = serde_json::json!({
            "store": a.store.display().to_string(),
            "chunks": store.chunks(),
            "levels": store.levels(),
            "bytes_scale": a.bytes_scale,
            "traces": self.traces,
            "seed": a.trace.is_none().then_some(a.seed),
            "error": self.kind,
            "rows": self.rows.iter().map(|r| serde_json::json!({
                "policy": r.policy, "slo_s": r.slo_s, "violation_rate": r.violation_rate,
                "mean_error": r.mean_error, "ttft_p50_s": r.ttft_p50_s, "ttft_p95_s": r.ttft_p95_s,
            })).collect::<Vec<_>>(),
        });
        out!(
            "{}",
            serde_json::to_string_pretty(&v).map_err(|e| e.to_string())?
        );
        Ok(())
    }
}

/// Per deadline: the fixed levels as a curve (labelled with their levels), the adaptive policy
/// and always-text as points; violation rate against mean error.
fn chart(rows: &[SimRow], kind: &str) -> Chart {
    let mut slos: Vec<f64> = rows.iter().map(|r| r.slo_s).collect();
    slos.sort_by(f64::total_cmp);
    slos.dedup();
    let pct = |r: &SimRow| (r.mean_error, r.violation_rate * 100.0);
    let mut chart = Chart {
        title: "Streaming under changing bandwidth: deadline misses against quality".into(),
        x_label: format!("mean {kind} of what was delivered"),
        y_label: "requests over the deadline (%)".into(),
        log_y: false,
        ..Chart::default()
    };
    for slo in slos {
        let at: Vec<&SimRow> = rows.iter().filter(|r| r.slo_s == slo).collect();
        let levels: Vec<&&SimRow> = at
            .iter()
            .filter(|r| r.policy.starts_with("level-"))
            .collect();
        chart.curves.push(Series {
            name: format!("fixed level, SLO {slo} s"),
            points: levels.iter().map(|r| pct(r)).collect(),
            labels: levels
                .iter()
                .map(|r| r.policy["level-".len()..].to_string())
                .collect(),
        });
        for r in at.iter().filter(|r| !r.policy.starts_with("level-")) {
            chart.points.push(Series {
                name: format!("{}, SLO {slo} s", r.policy),
                points: vec![pct(r)],
                labels: Vec::new(),
            });
        }
    }
    chart
}
