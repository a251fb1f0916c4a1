//! `kvc`: encode, decode, inspect and evaluate KV-cache streams.
//!
//! Argument parsing and printing only: dumps, metrics, token selection and the encode policies
//! live in `kvc-io`.

mod blend;
mod codec;
mod eval;
mod judge;
mod net;
mod plot;
mod pq;
mod progress;
mod say;
mod sim;

use clap::{Parser, Subcommand};
use codec::{cmd_decode, cmd_inspect, cmd_profile, cmd_shift};
use kvc_io::{Dump, Output};
use pq::{cmd_pq, PqCmd};
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
    Encode(codec::EncodeArgs),
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
    Judge(judge::JudgeCmd),
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

type Result<T> = std::result::Result<T, String>;

fn main() -> ExitCode {
    let cli = Cli::parse();
    // On Ctrl-C (or SIGTERM) no half-written temporary file stays behind. The server writes
    // no file and stops on these signals itself, letting its sessions end.
    if !matches!(cli.cmd, Cmd::Serve(_)) {
        let _ = ctrlc::set_handler(|| {
            kvc_io::output::remove_temporaries();
            say::write_note(format_args!("kvc: interrupted"));
            std::process::exit(130);
        });
    }
    match run(cli.cmd, cli.force, cli.threads) {
        Ok(()) => ExitCode::SUCCESS,
        // The reader of the results stopped reading: not a failure of the command.
        Err(_) if say::reader_gone() => ExitCode::SUCCESS,
        Err(e) => {
            say::write_note(format_args!("kvc: error: {e}"));
            ExitCode::FAILURE
        }
    }
}

/// Runs the command `cmd` (`force` and `threads` its global options).
fn run(cmd: Cmd, force: bool, threads: usize) -> Result<()> {
    match cmd {
        Cmd::Encode(args) => codec::cmd_encode_args(args, (force, threads)),
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
            (force, threads),
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
        } => eval_to(
            &input,
            profile.as_deref(),
            (json, plot.as_deref()),
            gpu,
            force,
            threads,
        ),
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
        Cmd::Judge(args) => judge::cmd_judge_args(args, force),
        Cmd::BlendEval(args) => blend::cmd_blend_eval(args),
        Cmd::BlendPlan(args) => blend::cmd_blend_plan(args),
        Cmd::StreamSim(args) => sim::cmd_stream_sim(args, force),
        Cmd::Serve(args) => net::cmd_serve(args),
        Cmd::Fetch(args) => net::cmd_fetch(args, force),
        Cmd::Demo { json, plot } => {
            let sample = kvc_io::fixtures::sample();
            eval_to(
                &sample,
                None,
                (json, plot.as_deref()),
                false,
                force,
                threads,
            )
        }
    }
}

/// Largest text file a command reads (texts, tiers files, traces): 64 MiB.
const MAX_TEXT_BYTES: u64 = 64 << 20;

/// The bytes of the input file `path`: a regular file (not a device or a FIFO) of at most
/// `limit` bytes.
fn read(path: &Path, limit: u64) -> Result<Vec<u8>> {
    kvc_io::input::read_limited(path, limit)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))
}

/// The UTF-8 text file `path`, of at most [`MAX_TEXT_BYTES`].
fn read_text(path: &Path) -> Result<String> {
    String::from_utf8(read(path, MAX_TEXT_BYTES)?)
        .map_err(|_| format!("cannot read {}: not UTF-8 text", path.display()))
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

/// `kvc eval` of the dump at `input`, as a table or `json`, with its chart in `plot`.
fn eval_to(
    input: &Path,
    profile: Option<&Path>,
    (json, plot): (bool, Option<&Path>),
    gpu: bool,
    force: bool,
    threads: usize,
) -> Result<()> {
    let mut inputs = vec![input];
    inputs.extend(profile);
    let plot = plot_file(plot, &inputs, force)?;
    let out = eval::Out {
        json,
        plot: plot.as_ref(),
    };
    eval::cmd_eval(input, profile, out, gpu, threads)
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
