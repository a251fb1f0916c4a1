//! `kvc`: encode, decode, inspect and evaluate KV-cache streams.

//!
//! Argument parsing and printing only: dumps, metrics, token selection and the encode policies
//! live in `kvc-io`.

mod blend;
mod eval;
mod gpu;
mod judge;
mod net;
mod plot;
mod pq;
mod progress;
mod sim;

use clap::{Parser, Subcommand};
use codec_core::profile::hex;
use codec_core::{EncodeParams, Limits, Stream};
use gpu::{decode_on_gpu, GpuCodec};
use kvc_io::policy::{self, ProfileUse};
use kvc_io::pq::{Rerank, Selector, Windows};
use kvc_io::{write_dump, Dump, Output};
use progress::Bars;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "kvc",
    version,
    about = "Compact, checksummed, chunked bitstreams for LLM KV caches"
)]
struct Cli {
    /// Replace output files that exist (an output that is one of the inputs is refused anyway).
    #[arg(short, long, global = true)]
    force: bool,
    /// Threads that encode and decode (0 = every core this process may use); the output is the
    /// same for every count.
    #[arg(long, global = true, default_value_t = 0, value_name = "N")]
    threads: usize,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Encode a safetensors KV dump (k.{i}, v.{i} [T, H, D]) into a .kvc stream, or into a
    /// multi-level store with --store.
    Encode {
        input: PathBuf,
        #[arg(required_unless_present = "store")]
        output: Option<PathBuf>,
        /// Write a multi-level store in this directory instead (spec/STREAM.md): every chunk at
        /// each of --levels, one profile (--profile, or learned from the input), the token ids.
        #[arg(long, conflicts_with_all = ["output", "level"], requires = "levels")]
        store: Option<PathBuf>,
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
        #[arg(long, default_value_t = EncodeParams::DEFAULT_CHUNK_TOKENS,
              value_parser = clap::value_parser!(u32).range(1..))]
        chunk_tokens: u32,
        /// Tokens per group (anchor + deltas).
        #[arg(long, default_value_t = EncodeParams::DEFAULT_GROUP,
              value_parser = clap::value_parser!(u32).range(1..=i64::from(EncodeParams::MAX_GROUP)))]
        group: u32,
        /// Leading tokens (attention sinks) stored exactly.
        #[arg(long, default_value_t = codec_core::EncodeParams::DEFAULT_SINK)]
        sink: u16,
        /// Same steps for every token: turn off the coarser steps for tokens that later queries
        /// barely read (use this if the cache will be read by queries at unusual positions).
        #[arg(long)]
        uniform_steps: bool,
        /// Code the chunks on GPU 0 (codec-cuda's encode chain; the same bytes as on the CPU).
        #[arg(long, conflicts_with = "store")]
        gpu: bool,
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
        /// Re-base the cache to start at this position (keys turned by the rotary shift).
        #[arg(long)]
        position: Option<u64>,
        /// Decode on GPU 0 with codec-cuda's kernels (f16 and bf16 streams; NVRTC from
        /// KVC_NVRTC_LIB, tools/fetch-nvrtc's folder, or the loader's path): the same bytes.
        #[arg(long)]
        gpu: bool,
    },
    /// Move a dump's cache to other positions: keys of tokens at --from P.. turned to --to Q..
    /// (the rotary shift CacheBlend applies to a reused chunk); values unchanged, queries dropped.
    Shift {
        input: PathBuf,
        output: PathBuf,
        /// Position of the dump's first token [default: its first_position metadata].
        #[arg(long)]
        from: Option<u64>,
        /// New position of the first token.
        #[arg(long)]
        to: u64,
        /// Rotary pairing [default: the dump's rope_style metadata].
        #[arg(long, value_parser = ["neox", "gptj"])]
        style: Option<String>,
        /// Rotary base [default: the dump's rope_theta metadata].
        #[arg(long)]
        theta: Option<f32>,
    },
    /// Print a stream's header, profile hash, chunks, levels and sizes.
    Inspect {
        input: PathBuf,
        /// The profile a referencing stream was coded with: shows its levels' multipliers.
        #[arg(long)]
        profile: Option<PathBuf>,
    },
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
        /// Also draw bits per element against attention error into this SVG file.
        #[arg(long, value_name = "FILE.svg")]
        plot: Option<PathBuf>,
        /// Also decode every level on GPU 0 with codec-cuda's kernels: its speed next to the
        /// CPU's, and an error unless its bytes are the CPU decode's.
        #[arg(long)]
        gpu: bool,
    },
    /// PQCache-style token selection on a dump's real queries (q.{i}).
    Pq {
        #[command(subcommand)]
        cmd: PqCmd,
    },
    /// Prefill a text with a GGUF model and write its KV cache (and last queries) as a dump.
    Dump {
        /// The model (tools/fetch-model fetches the reference one and prints its path).
        model: PathBuf,
        /// A text file.
        text: PathBuf,
        /// Output dump (.safetensors): k.{i}, v.{i} f16 [tokens, kv_heads, head_dim], q.{i}.
        output: PathBuf,
        /// Tokens of the text to prefill (from its start, no BOS token).
        #[arg(long)]
        tokens: usize,
        /// Post-rotary queries of this many last positions [default: 64, or --tokens if fewer].
        #[arg(long)]
        queries: Option<usize>,
        /// Store K before the rotary embedding.
        #[arg(long)]
        pre_rope: bool,
    },
    /// Judge the codec by the model: perplexity, KL and top-1 agreement of a continuation fed on
    /// top of each level's decoded cache, next to the minmax baselines.
    Judge {
        /// The model (tools/fetch-model fetches the reference one and prints its path).
        model: PathBuf,
        /// A text file: its first --ctx tokens are the cache, the next --cont are scored.
        text: PathBuf,
        /// Context tokens.
        #[arg(long, default_value_t = 2048)]
        ctx: usize,
        /// Continuation tokens scored on top of the cache.
        #[arg(long, default_value_t = 256)]
        cont: usize,
        /// Profile the streams reference (learned on other text, e.g. `kvc profile` on a `kvc
        /// dump` of it); without it each stream embeds one learned from the context.
        #[arg(long)]
        profile: Option<PathBuf>,
        /// Levels to judge, comma separated (default: every level of the profile).
        #[arg(long, value_delimiter = ',')]
        levels: Option<Vec<u8>>,
        /// Leave out the minmax int8/int4/int3 baselines.
        #[arg(long)]
        no_baselines: bool,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// Also draw bits per element against KL into this SVG file.
        #[arg(long, value_name = "FILE.svg")]
        plot: Option<PathBuf>,
    },
    /// CacheBlend on the model: chunk texts prefilled alone, stored, placed one after another,
    /// a question on top; every method against a full prefill.
    BlendEval(blend::EvalArgs),
    /// CacheBlend's loading controller: the recompute ratio and the cheapest storage tier whose
    /// loading hides behind the recompute.
    BlendPlan(blend::PlanArgs),
    /// A multi-level store streamed over bandwidth traces: the adapter against every fixed
    /// level (and text), per deadline: violation rate, mean error, TTFT.
    StreamSim(sim::SimArgs),
    /// Serve the multi-level stores under a directory over TCP (spec/STREAM.md §4), to many
    /// clients at once, optionally at the rates of a bandwidth trace.
    Serve(net::ServeArgs),
    /// Fetch a context from `kvc serve`, each chunk at the level (or as text) that meets the
    /// deadline at the throughput measured so far, and write the cache as a dump.
    Fetch(net::FetchArgs),
    /// `eval` on the built-in 512-token sample.
    Demo {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// Also draw bits per element against attention error into this SVG file.
        #[arg(long, value_name = "FILE.svg")]
        plot: Option<PathBuf>,
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
    /// The parameters checked against the dump's head dimension, in the options' terms.
    fn checked_params(&self, head_dim: u32) -> Result<pq_core::PqParams> {
        let p = self.params()?;
        p.check(head_dim as usize).map_err(|e| {
            format!(
                "--method {} --m {} --b {} on keys of {head_dim} dimensions: {e}",
                self.method, self.m, self.b
            )
        })?;
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

fn cmd_pq(cmd: PqCmd, force: bool) -> Result<()> {
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
            opts.checked_params(d.kv.shape.head_dim)?;
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
            let out = pq::Out {
                json,
                plot: plot.as_ref(),
            };
            pq::cmd_eval(&input, &d, (&sels, opts.windows()), out, gpu)
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
            opts.checked_params(d.kv.shape.head_dim)?;
            pq::cmd_select(&d, &out, &opts.selector(true)?, opts.windows(), k)
        }
    }
}

type Result<T> = std::result::Result<T, String>;

fn main() -> ExitCode {
    let cli = Cli::parse();
    // On Ctrl-C (or SIGTERM) no half-written temporary file stays behind.
    let _ = ctrlc::set_handler(|| {
        kvc_io::output::remove_temporaries();
        eprintln!("kvc: interrupted");
        std::process::exit(130);
    });
    let force = cli.force;
    let r = match cli.cmd {
        Cmd::Encode {
            input,
            output,
            store,
            level,
            levels,
            profile,
            chunk_tokens,
            group,
            sink,
            uniform_steps,
            gpu,
        } => {
            let params = EncodeParams {
                chunk_tokens,
                group,
                n_sink: sink,
                levels: levels.unwrap_or_else(|| vec![level]),
                token_importance: !uniform_steps,
            };
            match (store, output) {
                (Some(dir), _) => cmd_encode_store(
                    &input,
                    &dir,
                    profile.as_deref(),
                    params,
                    (force, cli.threads),
                ),
                (None, Some(out)) => cmd_encode(
                    &input,
                    &out,
                    profile.as_deref(),
                    params,
                    (force, cli.threads, gpu),
                ),
                (None, None) => Err("give an output file, or --store DIR".into()),
            }
        }
        Cmd::Decode {
            input,
            output,
            profile,
            level,
            position,
            gpu,
        } => cmd_decode(
            &input,
            &output,
            profile.as_deref(),
            (level, position, gpu),
            (force, cli.threads),
        ),
        Cmd::Shift {
            input,
            output,
            from,
            to,
            style,
            theta,
        } => output_file(&output, &[&input], force).and_then(|out| {
            let style = style.map(|s| match s.as_str() {
                "gptj" => codec_core::RopeStyle::GptJ,
                _ => codec_core::RopeStyle::NeoX,
            });
            cmd_shift(&input, &out, from, to, (style, theta))
        }),
        Cmd::Inspect { input, profile } => cmd_inspect(&input, profile.as_deref()),
        Cmd::Profile { output, samples } => cmd_profile(&output, &samples, force),
        Cmd::Eval {
            input,
            profile,
            json,
            plot,
            gpu,
        } => {
            let mut inputs = vec![input.as_path()];
            inputs.extend(profile.as_deref());
            plot_file(plot.as_deref(), &inputs, force).and_then(|plot| {
                let out = eval::Out {
                    json,
                    plot: plot.as_ref(),
                };
                eval::cmd_eval(&input, profile.as_deref(), out, gpu, cli.threads)
            })
        }
        Cmd::Pq { cmd } => cmd_pq(cmd, force),
        Cmd::Dump {
            model,
            text,
            output,
            tokens,
            queries,
            pre_rope,
        } => output_file(&output, &[&model, &text], force).and_then(|out| {
            let queries = queries.unwrap_or(tokens.min(64));
            judge::cmd_dump(&model, &text, &out, tokens, queries, pre_rope)
        }),
        Cmd::Judge {
            model,
            text,
            ctx,
            cont,
            profile,
            levels,
            no_baselines,
            json,
            plot,
        } => {
            let mut inputs = vec![model.as_path(), text.as_path()];
            inputs.extend(profile.as_deref());
            plot_file(plot.as_deref(), &inputs, force).and_then(|plot| {
                judge::cmd_judge(judge::JudgeArgs {
                    model: &model,
                    text: &text,
                    params: kvc_io::judge::JudgeParams {
                        ctx,
                        cont,
                        levels,
                        baselines: !no_baselines,
                    },
                    profile: profile.as_deref(),
                    json,
                    plot: plot.as_ref(),
                })
            })
        }
        Cmd::BlendEval(args) => blend::cmd_blend_eval(args),
        Cmd::BlendPlan(args) => blend::cmd_blend_plan(args),
        Cmd::StreamSim(args) => sim::cmd_stream_sim(args, force),
        Cmd::Serve(args) => net::cmd_serve(args),
        Cmd::Fetch(args) => net::cmd_fetch(args, force),
        Cmd::Demo { json, plot } => {
            let sample = kvc_io::fixtures::sample();
            plot_file(plot.as_deref(), &[&sample], force).and_then(|plot| {
                let out = eval::Out {
                    json,
                    plot: plot.as_ref(),
                };
                eval::cmd_eval(&sample, None, out, false, cli.threads)
            })
        }
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

/// An output file of the command: refused if it is one of `inputs`, or exists without --force.
fn output_file(path: &Path, inputs: &[&Path], force: bool) -> Result<Output> {
    Output::checked(path, inputs, force).map_err(|e| e.to_string())
}

fn load(path: &Path) -> Result<Dump> {
    use kvc_io::DumpError;
    kvc_io::load_dump(path).map_err(|e| match e {
        // These name the file already.
        DumpError::Io { .. } | DumpError::NotSafetensors { .. } => e.to_string(),
        e => format!("{}: {e}", path.display()),
    })
}

/// The `--plot` output, if asked for, checked as [`output_file`] checks.
fn plot_file(path: Option<&Path>, inputs: &[&Path], force: bool) -> Result<Option<Output>> {
    path.map(|p| output_file(p, inputs, force)).transpose()
}

/// A dump that has queries (token selection needs them).
fn load_with_queries(path: &Path) -> Result<Dump> {
    let d = load(path)?;
    match d.q {
        Some(_) => Ok(d),
        None => Err(format!("{}: {}", path.display(), kvc_io::Error::NoQueries)),
    }
}

fn cmd_encode(
    input: &Path,
    output: &Path,
    profile: Option<&Path>,
    params: EncodeParams,
    (force, threads, gpu): (bool, usize, bool),
) -> Result<()> {
    let mut inputs = vec![input];
    inputs.extend(profile);
    let out = output_file(output, &inputs, force)?;
    let codec = gpu
        .then(GpuCodec::open)
        .transpose()
        .map_err(|e| e.to_string())?;
    let d = load(input)?;
    let (full, mode) = match profile {
        Some(pp) => {
            let p = policy::load_profile(pp).map_err(|e| e.to_string())?;
            let mode = format!("referencing profile {}", &p.hash_hex()[..16]);
            (p, mode)
        }
        None => {
            let p = policy::learn(&[&d], &mut Bars::on_stderr()).map_err(|e| e.to_string())?;
            (p, "self-contained".to_string())
        }
    };
    let use_ = match profile {
        Some(_) => ProfileUse::Referenced(&full),
        None => ProfileUse::SelfContained(&full),
    };
    let view = d.kv.view();
    let encoded = match &codec {
        None => policy::encode(&view, use_, &params, threads).map_err(|e| e.to_string()),
        Some(c) => policy::encode_with(&view, use_, &params, |kv, m, p| c.encode_stream(kv, m, p))
            .map_err(|e| e.to_string()),
    };
    let bytes = encoded?.bytes;
    out.write(&bytes).map_err(|e| e.to_string())?;
    let bpe = bytes.len() as f64 * 8.0 / d.kv.shape.total_elements() as f64;
    let on = codec.map_or(String::new(), |c| format!(", chunks coded on {}", c.name()));
    eprintln!(
        "{}: {} bytes, {bpe:.3} bits/element, {mode}{on}",
        output.display(),
        bytes.len()
    );
    Ok(())
}

/// `kvc encode --store`: the input at every level of `params.levels`, as a store in `dir`.
fn cmd_encode_store(
    input: &Path,
    dir: &Path,
    profile: Option<&Path>,
    params: EncodeParams,
    (force, threads): (bool, usize),
) -> Result<()> {
    let d = load(input)?;
    let p = match profile {
        Some(pp) => policy::load_profile(pp).map_err(|e| e.to_string())?,
        None => policy::learn(&[&d], &mut Bars::on_stderr()).map_err(|e| e.to_string())?,
    };
    let store = kvc_io::store::Store::write(dir, &d, &p, &params, &params.levels, force, threads)
        .map_err(|e| e.to_string())?;
    let elements = d.kv.shape.total_elements() as f64;
    for &l in store.levels() {
        let bytes: usize = (0..store.chunks())
            .map(|i| store.chunk_bytes(i, l))
            .sum::<std::result::Result<usize, _>>()
            .map_err(|e| e.to_string())?;
        eprintln!(
            "level {l:>2}: {bytes} bytes, {:.3} bits/element",
            bytes as f64 * 8.0 / elements
        );
    }
    eprintln!(
        "{}: {} chunks at {} levels, profile {}, {}",
        dir.display(),
        store.chunks(),
        store.levels().len(),
        &p.hash_hex()[..16],
        if d.tokens.is_some() {
            "token ids kept (chunks can be recomputed from text)"
        } else {
            "no token ids in the dump (no text fallback; kvc dump records them)"
        }
    );
    Ok(())
}

/// The metadata of a dump of a cache with `m`: its model and rotary settings, as `kvc dump`
/// writes them.
fn dump_metadata(m: &codec_core::KvMeta) -> std::collections::BTreeMap<String, String> {
    let style = match m.rope.style {
        codec_core::RopeStyle::NeoX => "rotate_half (NeoX)",
        codec_core::RopeStyle::GptJ => "interleaved (GPT-J)",
        codec_core::RopeStyle::None => "none",
    };
    [
        ("model", m.model_id.clone()),
        ("rope_theta", m.rope.theta.to_string()),
        ("pre_rope", u8::from(m.rope.k_pre_rope).to_string()),
        ("first_position", m.first_position.to_string()),
        ("rope_style", style.to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

fn cmd_decode(
    input: &Path,
    output: &Path,
    profile: Option<&Path>,
    (level, position, gpu): (Option<u8>, Option<u64>, bool),
    (force, threads): (bool, usize),
) -> Result<()> {
    let mut inputs = vec![input];
    inputs.extend(profile);
    let out = output_file(output, &inputs, force)?;
    let bytes = read(input)?;
    let p = profile
        .map(policy::load_profile)
        .transpose()
        .map_err(|e| e.to_string())?;
    let s = Stream::open(&bytes, p.as_ref(), &Limits::DEFAULT)
        .map_err(|e| format!("{}: {e}", input.display()))?;
    if let Some(l) = level {
        let ladder = policy::ladder_levels(s.profile());
        let named = |e: &codec_core::ChunkEntry| ladder[e.level as usize].unwrap_or(e.level);
        if let Some(e) = s.header().chunks.iter().find(|e| named(e) != l) {
            return Err(format!(
                "{}: the chunk at token {} is coded at level {}, not {l} (a stream keeps the levels it was encoded at)",
                input.display(),
                e.token_start,
                named(e)
            ));
        }
    }
    let h = s.header();
    let done = |shape: codec_core::KvShape| {
        let dtype = h.dtype.name();
        let name = output.display();
        eprintln!(
            "{name}: {} layers x {} tokens, {dtype}",
            shape.layers, shape.tokens
        );
    };
    let in_err = |e: &dyn std::fmt::Display| format!("{}: {e}", input.display());
    if !gpu && position.is_none() {
        // Straight into the output file's buffer, written once.
        let metadata = dump_metadata(&h.meta);
        let mut file = kvc_io::dump::DumpFile::new(h.shape, h.dtype, &h.meta, &metadata)
            .map_err(|e| e.to_string())?;
        let (mut k, mut v) = file.kv_mut().map_err(|e| e.to_string())?;
        s.decode_range_into_threads(0..h.shape.tokens, &mut k, &mut v, threads)
            .map_err(|e| in_err(&e))?;
        drop((k, v));
        file.write(&out).map_err(|e| e.to_string())?;
        done(h.shape);
        return Ok(());
    }
    let mut cache = match gpu {
        true => decode_on_gpu(&s).map_err(|e| in_err(&e))?,
        false => s.decode().map_err(|e| in_err(&e))?,
    };
    if let Some(q) = position {
        codec_core::shift_cache(&mut cache, q)
            .map_err(|e| format!("{}: --position {q}: {e}", input.display()))?;
    }
    write_dump(&out, &cache, &dump_metadata(&cache.meta)).map_err(|e| e.to_string())?;
    done(cache.shape);
    Ok(())
}

/// `kvc shift`: the dump at `input` moved to start at `to`, with the rotary settings overridden
/// by `rope` (style, theta) where given.
fn cmd_shift(
    input: &Path,
    out: &Output,
    from: Option<u64>,
    to: u64,
    rope: (Option<codec_core::RopeStyle>, Option<f32>),
) -> Result<()> {
    let mut d = load(input)?;
    let meta = &mut d.kv.meta;
    meta.rope.style = rope.0.unwrap_or(meta.rope.style);
    meta.rope.theta = rope.1.unwrap_or(meta.rope.theta);
    meta.first_position = from.unwrap_or(meta.first_position);
    let from = meta.first_position;
    codec_core::shift_cache(&mut d.kv, to).map_err(|e| format!("{}: {e}", input.display()))?;
    write_dump(out, &d.kv, &d.metadata).map_err(|e| e.to_string())?;
    eprintln!(
        "{}: {} tokens moved from position {from} to {to} ({:?} pairing, theta {}){}",
        out.path().display(),
        d.kv.shape.tokens,
        d.kv.meta.rope.style,
        d.kv.meta.rope.theta,
        if d.q.is_some() {
            "; queries dropped"
        } else {
            ""
        }
    );
    Ok(())
}

fn cmd_inspect(input: &Path, profile: Option<&Path>) -> Result<()> {
    let bytes = read(input)?;
    let h = codec_core::Header::parse(&bytes, &Limits::DEFAULT)
        .map_err(|e| format!("{}: {e}", input.display()))?;
    print_header(input, &bytes, &h);
    let levels = stream_profile(&bytes, &h, profile)?;
    let s = h.shape;
    println!("chunk  tokens          level  multiplier  bytes       bits/element");
    for (i, e) in h.chunks.iter().enumerate() {
        let el = s.layers as f64 * 2.0 * e.tokens as f64 * s.channels() as f64;
        let (level, mult) = match &levels {
            Some(p) => {
                let ladder = policy::ladder_levels(p);
                let named = ladder.get(e.level as usize).copied().flatten();
                let m = p.level_multipliers().get(e.level as usize);
                (
                    named.map_or_else(|| format!("p{}", e.level), |l| l.to_string()),
                    m.map_or_else(|| "-".into(), |m| format!("x{m}")),
                )
            }
            None => (e.level.to_string(), "-".into()),
        };
        println!(
            "{i:<6} {:>6}..{:<7} {level:>5}  {mult:<10}  {:<10}  {:.4}",
            e.token_start,
            e.token_start + e.tokens,
            e.len_bytes,
            e.len_bytes as f64 * 8.0 / el
        );
    }
    if levels.is_none() {
        println!("(levels of the referenced profile; --profile FILE shows their multipliers)");
    }
    Ok(())
}

/// The profile whose levels the chunks name: the embedded one, or the referenced one if given
/// (and matching the stream's hash).
fn stream_profile(
    bytes: &[u8],
    h: &codec_core::Header,
    profile: Option<&Path>,
) -> Result<Option<codec_core::Profile>> {
    if h.profile_len > 0 {
        let at = h.header_len();
        let embedded = bytes
            .get(at..at + h.profile_len as usize)
            .ok_or("the stream is shorter than its embedded profile")?;
        return codec_core::Profile::from_bytes(embedded, &Limits::DEFAULT)
            .map(Some)
            .map_err(|e| format!("embedded profile: {e}"));
    }
    let Some(path) = profile else { return Ok(None) };
    let p = policy::load_profile(path).map_err(|e| e.to_string())?;
    if p.hash() != h.profile_hash {
        return Err(format!(
            "{} (profile {}) is not the profile the stream references ({})",
            path.display(),
            &p.hash_hex()[..16],
            &hex(&h.profile_hash)[..16]
        ));
    }
    Ok(Some(p))
}

/// The stream's header, one field per line.
fn print_header(input: &Path, bytes: &[u8], h: &codec_core::Header) {
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
}

fn cmd_profile(output: &Path, samples: &[PathBuf], force: bool) -> Result<()> {
    let inputs: Vec<&Path> = samples.iter().map(|p| p.as_path()).collect();
    let out = output_file(output, &inputs, force)?;
    let dumps = samples
        .iter()
        .map(|p| load(p))
        .collect::<Result<Vec<_>>>()?;
    let refs: Vec<&Dump> = dumps.iter().collect();
    let p = policy::learn(&refs, &mut Bars::on_stderr()).map_err(|e| e.to_string())?;
    out.write(p.as_bytes()).map_err(|e| e.to_string())?;
    eprintln!(
        "{}: profile {} ({} bytes, {} levels)",
        output.display(),
        p.hash_hex(),
        p.as_bytes().len(),
        p.levels()
    );
    Ok(())
}
