//! `kvc pq eval` and `kvc pq select`: their arguments and options, the runs, and the table (or
//! JSON) of the figures.

use std::path::{Path, PathBuf};

use clap::Subcommand;
use kvc_io::gpu::GpuCodec;
use kvc_io::pq::{self, Figures, Report, Rerank, SecondSearch, Selector, Windows};
use kvc_io::{Dump, Output};

use crate::plot::{self, Chart, Series};
use crate::progress::Bars;
use crate::say::{note, out};
use crate::{load_with_queries, output_file, plot_file, Result};

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
        out!(
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
    if json {
        let s = dump.kv.shape;
        let t = s.tokens;
        let j = serde_json::json!({
            "input": input.display().to_string(),
            "shape": {"layers": s.layers, "kv_heads": s.kv_heads, "q_heads": dump.q_heads,
                      "head_dim": s.head_dim, "tokens": t, "queries": dump.n_q(), "q_start": dump.q_start},
            "k_t5": report.k_t5, "k_t10": report.k_t10, "n_init": w.n_init, "n_local": w.n_local,
            "rows": report.figures.iter().map(|f| figures_json(f, t as usize)).collect::<Vec<_>>(),
        });
        out!(
            "{}",
            serde_json::to_string_pretty(&j).map_err(|e| e.to_string())?
        );
        return Ok(());
    }
    print_table(input, dump, report, w)?;
    print_cache_and_gpu(&report.figures)?;
    Ok(())
}

/// The dump's shape and every selector's recall, mass and speed, a row each.
fn print_table(input: &Path, dump: &Dump, report: &Report, w: Windows) -> Result<()> {
    let s = dump.kv.shape;
    let k5 = report.k_t5;
    out!(
        "{}: {} layers x {} KV heads ({} query heads), {} tokens, {} queries from position {}",
        input.display(),
        s.layers,
        s.kv_heads,
        dump.q_heads,
        s.tokens,
        dump.n_q(),
        dump.q_start
    );
    out!(
        "recall of the exact top-k by q.k (k = T/5 = {k5}, T/10 = {}); mass: softmax mass of the top-{k5} \
         chosen among the rest plus the first {} and last {} tokens (README's union form in brackets)",
        report.k_t10, w.n_init, w.n_local
    );
    out!(
        "{:<44} {:>5} {:>9} {:>9} {:>15} {:>9} {:>10}",
        "method",
        "bits",
        "rec@T/5",
        "rec@T/10",
        "mass (union)",
        "train ms",
        "search ns"
    );
    for f in &report.figures {
        out!(
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
    Ok(())
}

/// Every selector's block-cache hit rates, then its GPU speeds where it ran on one.
fn print_cache_and_gpu(figures: &[Figures]) -> Result<()> {
    out!(
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
        out!("  {:<44} {}", f.name, parts.join(", "));
    }
    for f in figures {
        if let Some((whole, kernel)) = f.second_scores_per_s {
            let kernel = kernel.map_or_else(|| "-".into(), |k| format!("{:.2}", k / 1e9));
            out!(
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
    note!(
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

/// The subcommands of `kvc pq`.
#[derive(Subcommand)]
pub(crate) enum PqCmd {
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
        /// Also draw code bits per key against the miss rate (1 - recall@T/5) into this SVG file.
        #[arg(long, value_name = "FILE.svg")]
        plot: Option<PathBuf>,
        /// Also select every query head's tokens on GPU 0 with codec-cuda's PQ search kernel:
        /// its token-scores per second, and an error unless its selections are pq-core's.
        #[arg(long)]
        gpu: bool,
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

/// The options both `kvc pq` subcommands take: the codes, the selector and the windows.
#[derive(clap::Args, Clone, Debug)]
pub(crate) struct PqOpts {
    /// Quantizer: rq (residual, kvc's default) or pq (product, the PQCache paper's).
    #[arg(long, default_value = "rq", value_parser = ["rq", "pq"])]
    method: String,
    /// Codes per key (stages for rq, sub-spaces for pq).
    #[arg(long, default_value_t = 2)]
    m: usize,
    /// Bits per code.
    #[arg(long, default_value_t = 6)]
    b: u8,
    /// Lloyd iterations per k-means (at most 1000).
    #[arg(long, value_parser = clap::value_parser!(u32).range(0..=1000))]
    iters: Option<u32>,
    /// Refinement rounds (rq only; at most 16).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(0..=16))]
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
    /// The parameters checked against the dump's head dimension, in the options' terms; a
    /// note where the codebooks outgrow the keys they code (the work is then long).
    fn checked_params(&self, shape: codec_core::KvShape) -> Result<pq_core::PqParams> {
        let p = self.params()?;
        let head_dim = shape.head_dim as usize;
        p.check(head_dim).map_err(|e| {
            format!(
                "--method {} --m {} --b {} on keys of {head_dim} dimensions: {e}",
                self.method, self.m, self.b
            )
        })?;
        let book_dim = match p.method {
            pq_core::Method::Product => head_dim / p.m,
            pq_core::Method::Residual => head_dim,
        };
        // Checked above: m * 2^b * book_dim is within pq-core's codebook bound.
        let table = (p.m << p.b) * book_dim;
        let exact = shape.tokens as usize * head_dim;
        if table > exact {
            let heads = shape.layers as usize * shape.kv_heads as usize;
            note!(
                "kvc pq: --m {} --b {}: a query's score table takes {table} multiply-adds, more \
                 than scoring all {} keys exactly ({exact}); the {heads} codebooks come to {:.1} MB",
                self.m,
                self.b,
                shape.tokens,
                (heads * table * 4) as f64 / 1e6
            );
        }
        Ok(p)
    }
    fn selector(&self, with_rerank: bool) -> Result<Selector> {
        Ok(Selector {
            params: self.params()?,
            rerank: (with_rerank && self.rerank > 0.0).then(|| Rerank {
                factor: self.rerank,
                level: self.rerank_level,
                profile: self.rerank_profile.clone(),
            }),
        })
    }
    fn windows(&self) -> Windows {
        Windows {
            n_init: self.n_init,
            n_local: self.n_local,
        }
    }
}

/// Runs a `kvc pq` subcommand.
pub(crate) fn cmd_pq(cmd: PqCmd, force: bool) -> Result<()> {
    // The options first: they fail faster than a dump loads.
    match &cmd {
        PqCmd::Eval { opts, .. } | PqCmd::Select { opts, .. } => opts.params()?,
    };
    match cmd {
        PqCmd::Eval {
            input,
            opts,
            json,
            plot,
            gpu,
        } => {
            let plot = plot_file(plot.as_deref(), &[&input], force)?;
            let d = load_with_queries(&input)?;
            opts.checked_params(d.kv.shape)?;
            let mut sels = Vec::new();
            let paper = Selector {
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
            let out = Out {
                json,
                plot: plot.as_ref(),
            };
            cmd_eval(&input, &d, (&sels, opts.windows()), out, gpu)
        }
        PqCmd::Select {
            input,
            output,
            k,
            opts,
        } => {
            let mut inputs = vec![input.as_path()];
            inputs.extend(opts.rerank_profile.as_deref());
            let out = output_file(&output, &inputs, force)?;
            let d = load_with_queries(&input)?;
            opts.checked_params(d.kv.shape)?;
            cmd_select(&d, &out, &opts.selector(true)?, opts.windows(), k)
        }
    }
}
