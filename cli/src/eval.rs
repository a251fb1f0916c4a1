//! `kvc eval` and `kvc demo`: the table (or JSON) of every level against the baselines.

use std::path::Path;

use kvc_io::eval::{evaluate_with, Row, SecondDecoder};
use kvc_io::gpu::GpuCodec;
use kvc_io::policy::{self, ProfileUse};
use kvc_io::Output;

use crate::plot::{self, Chart, Series};
use crate::progress::Bars;
use crate::say::out;
use crate::Result;

/// Where `kvc eval` prints: JSON instead of a table, and a chart into an SVG file.
pub struct Out<'a> {
    /// Print JSON instead of a table.
    pub json: bool,
    /// Also draw bits per element against attention error into this file.
    pub plot: Option<&'a Output>,
}

/// Measures every level of a profile (`profile`, or self-contained: learned from the input and
/// embedded) on the dump at `input`, and prints the table or JSON; with a plot, also draws bits
/// per element against attention error. With `gpu`, every level's stream is also decoded on GPU
/// 0 (opened first: without one, an error before any work) and must equal the CPU decode.
pub fn cmd_eval(
    input: &Path,
    profile: Option<&Path>,
    out: Out<'_>,
    gpu: bool,
    threads: usize,
) -> Result<()> {
    let mut gpu = match gpu {
        true => Some(GpuCodec::open().map_err(|e| e.to_string())?),
        false => None,
    };
    let d = kvc_io::load_dump(input).map_err(|e| e.to_string())?;
    let mut bars = Bars::on_stderr();
    let (full, mode) = match profile {
        Some(p) => (
            policy::load_profile(p).map_err(|e| e.to_string())?,
            format!("profile {}", p.display()),
        ),
        None => (
            policy::learn(&[&d], &mut bars).map_err(|e| e.to_string())?,
            "self-contained".to_string(),
        ),
    };
    let how = match profile {
        Some(_) => ProfileUse::Referenced(&full),
        None => ProfileUse::SelfContained(&full),
    };
    let second = gpu.as_mut().map(|g| g as &mut dyn SecondDecoder);
    let rows = evaluate_with(&d, how, threads, &mut bars, second).map_err(|e| e.to_string())?;
    let mode = match &gpu {
        Some(g) => format!(
            "{mode}; every level also decoded on {}, bit for bit the CPU decode",
            g.name()
        ),
        None => mode,
    };
    if out.json {
        print_json(input, &d, &mode, full.as_bytes().len(), &rows)?;
    } else {
        print_table(input, &d, &mode, &rows)?;
    }
    match out.plot {
        Some(p) => plot::write(p, &chart(input, &rows)),
        None => Ok(()),
    }
}

/// The JSON object `--json` prints.
fn print_json(
    input: &Path,
    d: &kvc_io::Dump,
    mode: &str,
    profile_bytes: usize,
    rows: &[Row],
) -> Result<()> {
    let shape = d.kv.shape;
    let j = serde_json::json!({
        "input": input.display().to_string(),
        "mode": mode,
        "shape": {"layers": shape.layers, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim, "tokens": shape.tokens},
        "profile_bytes": profile_bytes,
        "rows": rows.iter().map(row_json).collect::<Vec<_>>(),
    });
    out!(
        "{}",
        serde_json::to_string_pretty(&j).map_err(|e| e.to_string())?
    );
    Ok(())
}

/// The table, a row per method, and what its columns mean.
fn print_table(input: &Path, d: &kvc_io::Dump, mode: &str, rows: &[Row]) -> Result<()> {
    let shape = d.kv.shape;
    out!(
        "{} ({} layers x {} tokens x {} channels, {}), {mode}",
        input.display(),
        shape.layers,
        shape.tokens,
        shape.channels(),
        d.kv.dtype().name()
    );
    let gpu = rows.iter().any(|r| r.second_decode_mb_s.is_some());
    let gpu_head = if gpu {
        format!(" {:>12}", "GPU dec MB/s")
    } else {
        String::new()
    };
    out!(
        "{:<28} {:>8} {:>9} {:>8} {:>8} {:>10} {:>10}{gpu_head}",
        "method",
        "bits/el",
        "attn err",
        "K rel",
        "V rel",
        "enc MB/s",
        "dec MB/s"
    );
    for r in rows {
        let f = |x: Option<f64>| x.map(|v| format!("{v:.0}")).unwrap_or_else(|| "-".into());
        let attn = if r.attn.is_nan() {
            "-".into()
        } else {
            format!("{:.4}", r.attn)
        };
        let gpu_col = if gpu {
            format!(" {:>12}", f(r.second_decode_mb_s))
        } else {
            String::new()
        };
        out!(
            "{:<28} {:>8.3} {attn:>9} {:>8.4} {:>8.4} {:>10} {:>10}{gpu_col}",
            r.name,
            r.bits_per_element,
            r.k_rel,
            r.v_rel,
            f(r.encode_mb_s),
            f(r.decode_mb_s)
        );
    }
    if d.q.is_none() {
        out!("(the dump has no queries q.{{i}}, so no attention error: `kvc dump` writes them)");
    }
    out!("(bits/element count every byte of the stream; attention error: ||out'-out||/||out|| on the dump's queries, mean over layers; MB/s of f16)");
    if gpu {
        out!("(GPU dec: codec-cuda's whole decode call, plan to output downloaded, best of two, each bit for bit the CPU decode)");
    }
    Ok(())
}

/// The level number of a row named like `kvc level 2 (x0.145)` (`None` for the baselines).
fn level_of(r: &Row) -> Option<&str> {
    r.name.strip_prefix("kvc level ")?.split(' ').next()
}

/// Bits per element against attention error (log): kvc's levels as one curve, each point
/// labelled with its level; each baseline as its own point.
fn chart(input: &Path, rows: &[Row]) -> Chart {
    let mut levels = Series {
        name: "kvc levels".into(),
        ..Series::default()
    };
    let mut baselines = Vec::new();
    for r in rows {
        let p = (r.bits_per_element, r.attn);
        match level_of(r) {
            Some(l) => {
                levels.points.push(p);
                levels.labels.push(l.to_string());
            }
            None => baselines.push(Series {
                name: r.name.clone(),
                points: vec![p],
                labels: vec![],
            }),
        }
    }
    Chart {
        title: format!("kvc eval: {}", plot::file_name(input)),
        x_label: "bits per element (every byte of the stream)".into(),
        y_label: "attention output error ||out'-out||/||out||".into(),
        log_y: true,
        curves: vec![levels],
        points: baselines,
    }
}

fn row_json(r: &Row) -> serde_json::Value {
    serde_json::json!({
        "name": r.name, "bits_per_element": r.bits_per_element, "bytes": r.bytes,
        "k_rel": r.k_rel, "v_rel": r.v_rel, "attn": r.attn,
        "k_rel_layers": r.k_rel_layers, "v_rel_layers": r.v_rel_layers, "attn_layers": r.attn_layers,
        "encode_mb_s": r.encode_mb_s, "decode_mb_s": r.decode_mb_s,
        "gpu_decode_mb_s": r.second_decode_mb_s,
    })
}
