//! `kvc pq eval` and `kvc pq select`: options, and the table (or JSON) of the figures.

use std::path::Path;

use kvc_io::pq::{self, Figures, Report, SecondSearch, Selector, Windows};
use kvc_io::{Dump, Output};

use crate::gpu::GpuCodec;
use crate::plot::{self, Chart, Series};
use crate::progress::Bars;
use crate::Result;

/// Where `kvc pq eval` prints: JSON instead of a table, and a chart into an SVG file.
pub struct Out<'a> {
    /// Print JSON instead of a table.
    pub json: bool,
    /// Also draw code bits per key against the miss rate into this file.
    pub plot: Option<&'a Output>,
}

/// `kvc pq eval`: every selector in `sels` on the dump with windows `w`, printed as a table or
/// JSON; with a plot, also drawn (code bits per key against the miss rate). With `gpu`, every
/// stored query head's selection is also made on GPU 0 (opened first: without one, an error
/// before any work) and must equal pq-core's.
pub fn cmd_eval(
    input: &Path,
    dump: &Dump,
    (sels, w): (&[Selector], Windows),
    out: Out<'_>,
    gpu: bool,
) -> Result<()> {
    let mut gpu = match gpu {
        true => Some(GpuCodec::open().map_err(|e| e.to_string())?),
        false => None,
    };
    let second = gpu.as_mut().map(|g| g as &mut dyn SecondSearch);
    let report = pq::evaluate_with(dump, sels, w, &mut Bars::on_stderr(), second)
        .map_err(|e| e.to_string())?;
    print(input, dump, &report, w, out.json)?;
    if let (Some(g), false) = (&gpu, out.json) {
        println!(
            "{}: every selector's PQ selections (top-T/5 with the windows, no re-ranking) of \
             every stored query head, one launch: the same tokens as pq-core's",
            g.name()
        );
    }
    match out.plot {
        Some(p) => plot::write(p, &chart(input, &report)),
        None => Ok(()),
    }
}

/// The table, or the JSON with `json`.
fn print(input: &Path, dump: &Dump, report: &Report, w: Windows, json: bool) -> Result<()> {
    let s = dump.kv.shape;
    let (layers, kv_heads, t) = (s.layers, s.kv_heads, s.tokens);
    let Report {
        k_t5: k5,
        k_t10: k10,
        figures,
    } = report;
    if json {
        let j = serde_json::json!({
            "input": input.display().to_string(),
            "shape": {"layers": layers, "kv_heads": kv_heads, "q_heads": dump.q_heads,
                      "head_dim": s.head_dim, "tokens": t, "queries": dump.n_q(), "q_start": dump.q_start},
            "k_t5": k5, "k_t10": k10, "n_init": w.n_init, "n_local": w.n_local,
            "rows": figures.iter().map(|f| figures_json(f, t as usize)).collect::<Vec<_>>(),
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
        layers,
        kv_heads,
        dump.q_heads,
        t,
        dump.n_q(),
        dump.q_start
    );
    println!(
        "recall of the exact top-k by q.k (k = T/5 = {k5}, T/10 = {k10}); mass: softmax mass of the top-{k5} \
         chosen among the rest plus the first {} and last {} tokens (README's union form in brackets)",
        w.n_init, w.n_local
    );
    println!(
        "{:<44} {:>5} {:>9} {:>9} {:>15} {:>9} {:>10}",
        "method", "bits", "rec@T/5", "rec@T/10", "mass (union)", "train ms", "search ns"
    );
    for f in figures {
        println!(
            "{:<44} {:>5} {:>9.4} {:>9.4} {:>7.4} ({:.4}) {:>9.2} {:>10.0}",
            f.name,
            f.bits_per_key,
            f.recall_t5,
            f.recall_t10,
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
    for f in figures {
        let parts: Vec<String> = f
            .cache
            .iter()
            .map(|c| {
                format!(
                    "{:?} {} blocks {:.3}",
                    c.policy, c.capacity_blocks, c.hit_rate
                )
            })
            .collect();
        println!("  {:<44} {}", f.name, parts.join(", "));
    }
    for f in figures {
        if let Some((whole, kernel)) = f.second_scores_per_s {
            let kernel = kernel.map_or_else(|| "-".into(), |k| format!("{:.2}", k / 1e9));
            println!(
                "  {:<44} GPU: {:.2} G token-scores/s (uploads included), kernel alone {kernel} G/s",
                f.name,
                whole / 1e9
            );
        }
    }
    Ok(())
}

/// Code bits per key against the miss rate 1 - recall@T/5 (log): one point per selector, named
/// by it and labelled with its miss rate. A re-ranking selector also reads a kvc stream (its
/// level is in the name) that these bits do not count.
fn chart(input: &Path, report: &Report) -> Chart {
    let points = report
        .figures
        .iter()
        .map(|f| {
            let miss = 1.0 - f.recall_t5;
            Series {
                name: f.name.clone(),
                points: vec![(f.bits_per_key as f64, miss)],
                labels: vec![format!("{miss:.3}")],
            }
        })
        .collect();
    Chart {
        title: format!("kvc pq eval: {}", plot::file_name(input)),
        x_label: "code bits per key (per KV head)".into(),
        y_label: format!("miss rate 1 - recall of the exact top-{}", report.k_t5),
        log_y: true,
        curves: vec![],
        points,
    }
}

fn figures_json(f: &Figures, tokens: usize) -> serde_json::Value {
    serde_json::json!({
        "name": f.name, "bits_per_key_per_head": f.bits_per_key,
        "codebook_floats_per_head": f.codebook_floats,
        "recall_t5": f.recall_t5, "recall_t10": f.recall_t10,
        "mass_t5_windows": f.mass, "mass_t5_union_windows": f.mass_union,
        "train_ms_per_head": f.train_ms_mean,
        "search_ns_per_query_head": f.search_ns_per_query_head,
        "token_scores_per_s": tokens as f64 / (f.search_ns_per_query_head * 1e-9),
        "rerank_stream_bits_per_element": f.rerank_bpe,
        "gpu_token_scores_per_s": f.second_scores_per_s.map(|s| s.0),
        "gpu_kernel_token_scores_per_s": f.second_scores_per_s.and_then(|s| s.1),
        "block_cache": f.cache.iter().map(|c| serde_json::json!({
            "policy": format!("{:?}", c.policy), "capacity_blocks": c.capacity_blocks,
            "block_tokens": pq::BLOCK_TOKENS, "hit_rate": c.hit_rate})).collect::<Vec<_>>(),
    })
}

/// `kvc pq select`: writes `sel.{i}` int32 `[n_q, q_heads, slots]` per layer to `output`.
pub fn cmd_select(
    dump: &Dump,
    output: &Output,
    sel: &Selector,
    w: Windows,
    slots: usize,
) -> Result<()> {
    let s = match pq::select(dump, sel, w, slots, &mut Bars::on_stderr()) {
        Ok(s) => s,
        Err(kvc_io::Error::SlotCount { slots, tokens }) => {
            return Err(format!(
            "--k {slots}: the slots per query head must be within 1..={tokens} (the dump's tokens)"
        ))
        }
        Err(e) => return Err(e.to_string()),
    };
    pq::write_selection(output, &s).map_err(|e| e.to_string())?;
    eprintln!(
        "{}: {} layers x {} queries x {} query heads, {} slots ({} first, {} last, {} chosen by {})",
        output.path().display(),
        s.layers.len(),
        s.n_q,
        s.q_heads,
        s.slots,
        s.windows.n_init,
        s.windows.n_local,
        s.k,
        sel.name()
    );
    Ok(())
}
