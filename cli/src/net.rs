//! `kvc serve` and `kvc fetch`: multi-level stores over TCP (`spec/STREAM.md` §4).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use codec_core::adapt::Choice;
use codec_core::KvCache;
use kvc_io::sim::Trace;
use kvc_net::client::{fetch, FetchOptions, Fetched, Recompute};
use kvc_net::rate::Limiter;
use kvc_net::server::{Server, ServerConfig, Stats};
use llm::Model;

use crate::judge::load_model;
use crate::say::{note, out};
use crate::{output_file, read_text, Result};

/// Options of `kvc serve`.
#[derive(clap::Args)]
pub struct ServeArgs {
    /// The directory whose subdirectories are the stores served (`kvc encode --store DIR/NAME`);
    /// a client opens a context by its subdirectory's name.
    pub root: PathBuf,
    /// The address to listen on.
    #[arg(long, default_value = "127.0.0.1:7878")]
    pub addr: String,
    /// Replay this bandwidth trace on everything the server sends (rows `seconds Gbps`; its
    /// time 0 is the server's first byte sent).
    #[arg(long, conflicts_with = "gbps")]
    pub trace: Option<PathBuf>,
    /// Send at most this many Gbps, all connections together.
    #[arg(long)]
    pub gbps: Option<f64>,
    /// Connections served at once; one more is told the server is busy.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=65_536))]
    pub max_connections: u32,
    /// Seconds a client has to send each request, and each write to it may take.
    #[arg(long, default_value_t = 10.0)]
    pub timeout_s: f64,
    /// Seconds a connection may hold its slot: past them its next request is refused (or a
    /// reply being written cut off), so slow clients cannot keep every slot.
    #[arg(long, default_value_t = 600.0)]
    pub max_session_s: f64,
    /// Seconds the sessions in progress get to end after SIGTERM or Ctrl-C (no new
    /// connection is accepted meanwhile); those still going are then cut.
    #[arg(long, default_value_t = 20.0)]
    pub grace_s: f64,
    /// No line per connection on stderr.
    #[arg(long)]
    pub quiet: bool,
}

/// Serves until SIGTERM or Ctrl-C, then lets the sessions in progress end (within
/// `--grace-s`) and exits: a line per connection (unless `--quiet`), every
/// [`SUMMARY_EVERY`] in which something happened the totals and the throughput, and the totals
/// at the end.
pub fn cmd_serve(a: ServeArgs) -> Result<()> {
    let limiter = limiter(&a)?;
    if !a.root.is_dir() {
        return Err(format!("{}: not a directory", a.root.display()));
    }
    let contexts = contexts(&a.root)?;
    let timeout = positive_duration(a.timeout_s, "--timeout-s")?;
    let mut config = ServerConfig::new(a.root.clone());
    config.max_connections = a.max_connections as usize;
    config.read_timeout = timeout;
    config.write_timeout = timeout;
    config.max_session = positive_duration(a.max_session_s, "--max-session-s")?;
    config.report = !a.quiet;
    let grace = positive_duration(a.grace_s, "--grace-s")?;
    runtime()?.block_on(async move {
        let server = Server::bind(&a.addr, config, limiter)
            .await
            .map_err(|e| format!("cannot listen on {}: {e}", a.addr))?;
        let addr = server.local_addr().map_err(|e| e.to_string())?;
        for name in &contexts {
            // A broken store is reported (by the server, with the reason) and served as such:
            // clients asking for it are told it cannot be opened.
            let _ = server.preload(name).await;
        }
        note!(
            "kvc serve: listening on {addr}, {} contexts in {}: {}",
            contexts.len(),
            a.root.display(),
            contexts.join(", ")
        );
        let stats = server.stats();
        tokio::spawn(summaries(stats.clone()));
        let stopping = async {
            stop_signal().await;
            note!(
                "kvc serve: stopping: no new connections; {} in progress get up to {} s",
                in_progress(&stats),
                grace.as_secs_f64()
            );
        };
        let cut = server
            .run_until(stopping, grace)
            .await
            .map_err(|e| e.to_string())?;
        note!("kvc serve: stopped, {cut} sessions cut; {}", totals(&stats));
        Ok(())
    })
}

/// SIGTERM or Ctrl-C (SIGINT); never, where neither can be listened for.
async fn stop_signal() {
    #[cfg(unix)]
    let term = async {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut s) => s.recv().await,
            Err(_) => std::future::pending().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<Option<()>>();
    let interrupt = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    tokio::select! {
        _ = term => {}
        () = interrupt => {}
    }
}

/// Sessions accepted and not yet ended.
fn in_progress(stats: &Stats) -> u64 {
    let ended = Stats::get(&stats.completed) + Stats::get(&stats.refused);
    Stats::get(&stats.connections).saturating_sub(ended)
}

/// The server's counts so far, as its summary lines give them.
fn totals(stats: &Stats) -> String {
    format!(
        "{} connections ({} done, {} refused, {} busy), {:.1} MB sent",
        Stats::get(&stats.connections),
        Stats::get(&stats.completed),
        Stats::get(&stats.refused),
        Stats::get(&stats.busy),
        Stats::get(&stats.bytes_sent) as f64 / 1e6,
    )
}

/// Seconds between the server's summary lines.
pub const SUMMARY_EVERY: Duration = Duration::from_secs(10);

/// Prints the server's totals every [`SUMMARY_EVERY`] in which bytes were sent.
async fn summaries(stats: Arc<Stats>) {
    let mut last = 0;
    let mut tick = tokio::time::interval(SUMMARY_EVERY);
    tick.tick().await;
    loop {
        tick.tick().await;
        let sent = Stats::get(&stats.bytes_sent);
        if sent == last {
            continue;
        }
        let rate = (sent - last) as f64 / SUMMARY_EVERY.as_secs_f64() / 1e6;
        note!(
            "kvc serve: {}; {rate:.1} MB/s over the last {} s",
            totals(&stats),
            SUMMARY_EVERY.as_secs()
        );
        last = sent;
    }
}

/// The names of the stores under `root`.
fn contexts(root: &Path) -> Result<Vec<String>> {
    let entries =
        std::fs::read_dir(root).map_err(|e| format!("cannot read {}: {e}", root.display()))?;
    let mut names: Vec<String> = entries
        .filter_map(|e| e.ok())
        .filter(|e| e.path().join("store.json").is_file())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    Ok(names)
}

fn limiter(a: &ServeArgs) -> Result<Limiter> {
    match (&a.trace, a.gbps) {
        (Some(p), _) => Trace::parse(&read_text(p)?)
            .map(Limiter::new)
            .map_err(|e| format!("{}: {e}", p.display())),
        (None, Some(g)) if g.is_finite() && g > 0.0 => Ok(Limiter::new(Trace::constant(g))),
        (None, Some(g)) => Err(format!("--gbps {g}: give a positive rate")),
        (None, None) => Ok(Limiter::unlimited()),
    }
}

fn positive_duration(s: f64, what: &str) -> Result<Duration> {
    Duration::try_from_secs_f64(s)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| format!("{what} {s}: give a positive number of seconds"))
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the async runtime: {e}"))
}

/// Options of `kvc fetch`.
#[derive(clap::Args)]
pub struct FetchArgs {
    /// The server (`kvc serve`), host:port.
    pub addr: String,
    /// The context's name on the server.
    pub context: String,
    /// The safetensors dump to write the fetched cache to.
    pub output: PathBuf,
    /// Milliseconds from the start of the fetch by which every chunk should have arrived (a
    /// chunk sent as text: been recomputed): each chunk's level (or text) is chosen to meet it.
    #[arg(long)]
    pub deadline_ms: u64,
    /// Every chunk at this level instead of adapting.
    #[arg(long, conflicts_with = "text")]
    pub level: Option<u8>,
    /// Every chunk as text, recomputed on --model.
    #[arg(long, requires = "model")]
    pub text: bool,
    /// The model that recomputes chunks sent as text (tools/fetch-model prints its path);
    /// without it no chunk is asked for as text.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// The model's recompute time per token, ms (default: measured by a 256-token prefill
    /// before the fetch starts).
    #[arg(long, requires = "model")]
    pub text_ms_per_token: Option<f64>,
    /// Throughput assumed for the first chunk, Gbps (default: the first chunk goes at the
    /// middle level).
    #[arg(long)]
    pub prior_gbps: Option<f64>,
    /// Seconds to connect and to wait for each reply.
    #[arg(long, default_value_t = 10.0)]
    pub timeout_s: f64,
    /// Seconds the whole fetch may take (a server that answers each request in time but
    /// slowly cannot hold the client longer): past them it fails with a timeout.
    #[arg(long, default_value_t = 600.0)]
    pub max_time_s: f64,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Fetches the context, writes the cache, prints each chunk's transfer.
pub fn cmd_fetch(a: FetchArgs, force: bool) -> Result<()> {
    let mut inputs = Vec::new();
    inputs.extend(a.model.as_deref());
    let out = output_file(&a.output, &inputs, force)?;
    let opts = fetch_options(&a)?;
    let f = runtime()?
        .block_on(fetch(&a.addr, &a.context, &opts))
        .map_err(|e| format!("{} {}: {e}", a.addr, a.context))?;
    let written = Instant::now();
    kvc_io::write_dump(&out, &f.cache, &crate::codec::dump_metadata(&f.cache.meta))
        .map_err(|e| e.to_string())?;
    let write_s = written.elapsed().as_secs_f64();
    if a.json {
        print_json(&a, &f, write_s)
    } else {
        print_table(&a, &f, write_s)?;
        Ok(())
    }
}

fn fetch_options(a: &FetchArgs) -> Result<FetchOptions> {
    let mut opts = FetchOptions::new(Duration::from_millis(a.deadline_ms));
    opts.io_timeout = positive_duration(a.timeout_s, "--timeout-s")?;
    opts.max_time = positive_duration(a.max_time_s, "--max-time-s")?;
    opts.force = match (a.level, a.text) {
        (Some(l), _) => Some(Choice::Level(l)),
        (None, true) => Some(Choice::Text),
        (None, false) => None,
    };
    opts.prior_bytes_per_s = match a.prior_gbps {
        Some(g) if g.is_finite() && g > 0.0 => Some(g * 1e9 / 8.0),
        Some(g) => return Err(format!("--prior-gbps {g}: give a positive rate")),
        None => None,
    };
    if let Some(path) = &a.model {
        let model = load_model(path)?;
        let s_per_token = match a.text_ms_per_token {
            Some(ms) if ms.is_finite() && ms > 0.0 => ms / 1e3,
            Some(ms) => return Err(format!("--text-ms-per-token {ms}: give a positive time")),
            None => measure_text_cost(&model)?,
        };
        opts.recompute = Some(Arc::new(Runner { model, s_per_token }));
    }
    Ok(opts)
}

/// Tokens of the prefill that measures the model's recompute time.
const TEXT_PROBE_TOKENS: usize = 256;

/// Seconds per token of a [`TEXT_PROBE_TOKENS`]-token prefill.
fn measure_text_cost(model: &Model) -> Result<f64> {
    let s = model
        .time_prefill(TEXT_PROBE_TOKENS)
        .map_err(|e| e.to_string())?
        / TEXT_PROBE_TOKENS as f64;
    note!(
        "kvc fetch: text recompute measured at {:.2} ms per token",
        s * 1e3
    );
    Ok(s)
}

/// The model as the fetch's text fallback.
struct Runner {
    model: Model,
    s_per_token: f64,
}

impl Recompute for Runner {
    fn extend(&self, prefix: &KvCache, tokens: &[u32]) -> std::result::Result<KvCache, String> {
        self.model.extend(prefix, tokens).map_err(|e| e.to_string())
    }
    fn seconds_per_token(&self) -> f64 {
        self.s_per_token
    }
}

fn choice_name(c: Choice) -> String {
    match c {
        Choice::Level(l) => format!("level {l}"),
        Choice::Text => "text".into(),
    }
}

/// The context was there (the last chunk arrived, text chunks recomputed) by the deadline.
fn met(a: &FetchArgs, f: &Fetched) -> bool {
    f.ready_s() * 1e3 <= a.deadline_ms as f64
}

fn print_table(a: &FetchArgs, f: &Fetched, write_s: f64) -> Result<()> {
    out!(
        "{:>5}  {:>8}  {:>10}  {:>8}  {:>9}",
        "chunk",
        "sent as",
        "bytes",
        "ms",
        "MB/s"
    );
    for (i, r) in f.rows.iter().enumerate() {
        out!(
            "{i:>5}  {:>8}  {:>10}  {:>8.1}  {:>9.1}",
            choice_name(r.choice),
            r.bytes,
            r.seconds * 1e3,
            r.throughput() / 1e6
        );
    }
    let bytes: u64 = f.rows.iter().map(|r| r.bytes).sum();
    let met = if f.transfer_s * 1e3 <= a.deadline_ms as f64 {
        "met"
    } else {
        "MISSED"
    };
    out!(
        "{bytes} bytes in {:.1} ms ({:.1} MB/s): deadline {} ms {met}; cache whole at {:.1} ms; \
         {} written in {:.1} ms",
        f.transfer_s * 1e3,
        bytes as f64 / f.transfer_s.max(1e-9) / 1e6,
        a.deadline_ms,
        f.total_s * 1e3,
        a.output.display(),
        write_s * 1e3
    );
    Ok(())
}

fn print_json(a: &FetchArgs, f: &Fetched, write_s: f64) -> Result<()> {
    let rows: Vec<_> = f
        .rows
        .iter()
        .map(|r| {
            let (choice, level) = match r.choice {
                Choice::Level(l) => ("level", Some(l)),
                Choice::Text => ("text", None),
            };
            serde_json::json!({"choice": choice, "level": level, "bytes": r.bytes, "seconds": r.seconds})
        })
        .collect();
    let v = serde_json::json!({
        "context": a.context,
        "deadline_s": a.deadline_ms as f64 / 1e3,
        "levels_offered": f.levels,
        "transfer_s": f.transfer_s,
        "total_s": f.total_s,
        "ready_s": f.ready_s(),
        "deadline_met": met(a, f),
        "write_s": write_s,
        "chunks": rows,
    });
    out!(
        "{}",
        serde_json::to_string_pretty(&v).map_err(|e| e.to_string())?
    );
    Ok(())
}
