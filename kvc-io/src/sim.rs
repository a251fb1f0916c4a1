//! `kvc stream-sim`: a context streamed over bandwidth traces, chunk by chunk, by the adapter
//! ([`codec_core::adapt`]) and by every fixed choice, against a deadline (CacheGen §5.3, figure
//! 13): the share of requests that miss it, the mean error of what was delivered, and the time
//! to the whole context (TTFT, taken as the arrival of the last chunk).
//!
//! Time advances chunk by chunk: a level's bytes take the time the trace gives them from the
//! moment the chunk starts; a text chunk takes its token ids' transfer and then its recompute.
//! The adapter sees each chunk's bytes over its transfer time, as a client would.
//!
//! ```
//! use codec_core::adapt::Sizes;
//! use kvc_io::sim::{simulate, SimContext, SimParams, Trace};
//!
//! // Two chunks at levels 1 (10 MB) and 9 (2 MB); a link at 1 Gbps (125 MB/s).
//! let ctx = SimContext {
//!     sizes: Sizes::new(vec![1, 9], vec![10_000_000, 2_000_000, 10_000_000, 2_000_000], 2)?,
//!     tokens: vec![1000, 1000],
//!     errors: vec![0.01, 0.1],
//! };
//! let params = SimParams { slos: vec![0.1], ..SimParams::default() };
//! let rows = simulate(&ctx, &[Trace::constant(1.0)], &params)?;
//! let level1 = rows.iter().find(|r| r.policy == "level-1").unwrap();
//! assert!((level1.ttft_p50_s - 0.16).abs() < 1e-9); // 20 MB at 125 MB/s: misses 0.1 s
//! assert_eq!(level1.violation_rate, 1.0);
//! let adaptive = rows.iter().find(|r| r.policy == "adaptive").unwrap();
//! assert_eq!(adaptive.violation_rate, 0.0); // level 9 after the first chunk's measurement
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use codec_core::adapt::{AdaptParams, Adapter, Choice, Sizes, TEXT_BYTES_PER_TOKEN};

use crate::error::Error;

/// Bytes per second in one Gbps.
const BYTES_PER_GBPS: f64 = 1e9 / 8.0;

/// A bandwidth trace: piecewise constant, each step's rate holding from its start to the next
/// step's (the last one forever).
#[derive(Clone, Debug, PartialEq)]
pub struct Trace {
    /// (start in seconds, bytes per second), starts ascending from 0.
    steps: Vec<(f64, f64)>,
}

impl Trace {
    /// A constant rate, in Gbps.
    pub fn constant(gbps: f64) -> Trace {
        Trace {
            steps: vec![(0.0, gbps * BYTES_PER_GBPS)],
        }
    }

    /// A trace file: one `seconds Gbps` pair per line ("from this time on, this rate"), `#`
    /// starting a comment; times ascending, the first 0, rates positive.
    pub fn parse(text: &str) -> Result<Trace, Error> {
        let mut steps: Vec<(f64, f64)> = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let bad = |why: &str| Error::Trace {
                line: i + 1,
                text: line.to_string(),
                why: why.to_string(),
            };
            let f: Vec<f64> = line
                .split_whitespace()
                .map(|x| x.parse::<f64>().map_err(|_| bad("not a number")))
                .collect::<Result<_, _>>()?;
            let &[t, gbps] = f.as_slice() else {
                return Err(bad("expected two numbers: seconds and Gbps"));
            };
            let after = steps.last().map_or(-1.0, |s| s.0);
            if !(t.is_finite() && t > after) || (steps.is_empty() && t != 0.0) {
                return Err(bad("times must start at 0 and ascend"));
            }
            if !(gbps.is_finite() && gbps > 0.0) {
                return Err(bad("the rate must be a positive number of Gbps"));
            }
            steps.push((t, gbps * BYTES_PER_GBPS));
        }
        if steps.is_empty() {
            return Err(Error::Trace {
                line: 0,
                text: String::new(),
                why: "the trace has no rate".into(),
            });
        }
        Ok(Trace { steps })
    }

    /// `n` seeded random walks between 0.1 and 10 Gbps, as in the paper, each `seconds` long
    /// (its last rate holds after): a log-uniform start, then every 100 ms the rate times
    /// `10^u` with `u` uniform in [-0.25, 0.25], reflected at the bounds. Each walk has its own
    /// generator, seeded from `seed` and its index, so no two seeds share walks.
    pub fn random_walks(seed: u64, n: usize, seconds: f64) -> Vec<Trace> {
        (0..n as u64)
            .map(|k| Trace::random_walk(mix(mix(seed) ^ k), seconds))
            .collect()
    }

    fn random_walk(seed: u64, seconds: f64) -> Trace {
        let mut rng = XorShift::new(seed);
        let mut log = -1.0 + 2.0 * rng.unit();
        let n = (seconds / WALK_STEP_S).ceil().max(1.0) as usize;
        let mut steps = Vec::with_capacity(n);
        for k in 0..n {
            steps.push((k as f64 * WALK_STEP_S, 10f64.powf(log) * BYTES_PER_GBPS));
            log += 0.5 * rng.unit() - 0.25;
            if log > 1.0 {
                log = 2.0 - log;
            } else if log < -1.0 {
                log = -2.0 - log;
            }
        }
        Trace { steps }
    }

    /// The `(start in seconds, bytes per second)` steps, starts ascending from 0.
    pub fn steps(&self) -> &[(f64, f64)] {
        &self.steps
    }

    /// Bytes the link carries from `t0` to `t1` seconds (0 unless `t0 < t1`).
    pub fn bytes_between(&self, t0: f64, t1: f64) -> f64 {
        let mut sum = 0.0;
        let first = self.steps.partition_point(|s| s.0 <= t0).max(1) - 1;
        for (k, &(start, rate)) in self.steps.iter().enumerate().skip(first) {
            let end = self.steps.get(k + 1).map_or(f64::INFINITY, |s| s.0);
            let (a, b) = (start.max(t0), end.min(t1));
            if b > a {
                sum += (b - a) * rate;
            }
            if end >= t1 {
                break;
            }
        }
        sum
    }

    /// When `bytes` sent from `start_s` have arrived (never, for a byte count or a start that
    /// is not a finite number).
    pub fn transfer(&self, start_s: f64, bytes: f64) -> f64 {
        if !(bytes.is_finite() && start_s.is_finite()) {
            return f64::INFINITY;
        }
        let mut left = bytes;
        let mut t = start_s;
        let mut k = self.steps.partition_point(|s| s.0 <= start_s).max(1) - 1;
        loop {
            let rate = self.steps[k].1;
            let end = self.steps.get(k + 1).map_or(f64::INFINITY, |s| s.0);
            let can = (end - t) * rate;
            if can >= left {
                return t + left / rate;
            }
            left -= can;
            t = end;
            k += 1;
        }
    }
}

const WALK_STEP_S: f64 = 0.1;

/// The context the simulation streams.
#[derive(Clone, Debug)]
pub struct SimContext {
    /// Each chunk's size at each level on offer (already scaled, if scaling is wanted).
    pub sizes: Sizes,
    /// Each chunk's tokens.
    pub tokens: Vec<u32>,
    /// The error of each level on offer (in the order of `sizes.levels()`); text counts 0.
    pub errors: Vec<f64>,
}

/// What to simulate.
#[derive(Clone, Debug, PartialEq)]
pub struct SimParams {
    /// Deadlines to meet, seconds.
    pub slos: Vec<f64>,
    /// The consumer's recompute time per token (`None`: no text policy, and the adapter does
    /// not offer text).
    pub text_s_per_token: Option<f64>,
    /// Requests batched on the link.
    pub concurrent: u32,
}

impl Default for SimParams {
    fn default() -> Self {
        SimParams {
            slos: vec![1.0],
            text_s_per_token: None,
            concurrent: 1,
        }
    }
}

/// One policy at one deadline, over all traces.
#[derive(Clone, Debug, PartialEq)]
pub struct SimRow {
    /// `adaptive`, `level-N` or `text`.
    pub policy: String,
    /// The deadline, seconds.
    pub slo_s: f64,
    /// Share of the traces whose TTFT exceeds the deadline.
    pub violation_rate: f64,
    /// Mean error of what was delivered (token-weighted over the chunks; text counts 0).
    pub mean_error: f64,
    /// Median TTFT, seconds.
    pub ttft_p50_s: f64,
    /// 95th-percentile TTFT, seconds.
    pub ttft_p95_s: f64,
}

/// Every policy at every deadline over `traces`.
pub fn simulate(ctx: &SimContext, traces: &[Trace], p: &SimParams) -> Result<Vec<SimRow>, Error> {
    check(ctx, traces, p)?;
    let mut rows = Vec::new();
    for &slo in &p.slos {
        let runs = traces
            .iter()
            .map(|t| run(ctx, t, p, Policy::Adaptive(slo)))
            .collect::<Result<Vec<_>, Error>>()?;
        rows.push(row("adaptive".into(), slo, &runs));
    }
    let mut fixed: Vec<(String, Policy)> = ctx
        .sizes
        .levels()
        .iter()
        .map(|&l| (format!("level-{l}"), Policy::Fixed(Choice::Level(l))))
        .collect();
    if p.text_s_per_token.is_some() {
        fixed.push(("text".into(), Policy::Fixed(Choice::Text)));
    }
    for (name, policy) in fixed {
        let runs = traces
            .iter()
            .map(|t| run(ctx, t, p, policy))
            .collect::<Result<Vec<_>, Error>>()?;
        for &slo in &p.slos {
            rows.push(row(name.clone(), slo, &runs));
        }
    }
    Ok(rows)
}

#[derive(Clone, Copy, Debug)]
enum Policy {
    /// The adapter, with this deadline.
    Adaptive(f64),
    Fixed(Choice),
}

/// One request over one trace: (TTFT, mean error).
fn run(
    ctx: &SimContext,
    trace: &Trace,
    p: &SimParams,
    policy: Policy,
) -> Result<(f64, f64), Error> {
    let params = AdaptParams {
        deadline_s: match policy {
            Policy::Adaptive(slo) => slo,
            Policy::Fixed(_) => 0.0,
        },
        text_s_per_token: p.text_s_per_token,
        prior_bytes_per_s: None,
        concurrent: p.concurrent,
    };
    let mut a = Adapter::new(ctx.sizes.clone(), ctx.tokens.clone(), params)?;
    let n = f64::from(p.concurrent);
    let (mut t, mut err, mut tokens) = (0.0, 0.0, 0.0);
    for i in 0..ctx.sizes.chunks() {
        let c = match policy {
            Policy::Adaptive(_) => a.choose(i, t),
            Policy::Fixed(c) => c,
        };
        let k = f64::from(ctx.tokens[i]);
        let (bytes, compute, e) = match c {
            Choice::Level(l) => {
                let j = ctx.sizes.levels().iter().position(|&x| x == l).unwrap_or(0);
                let b = ctx.sizes.bytes(i, l).unwrap_or(0) as f64;
                (b, 0.0, ctx.errors[j])
            }
            Choice::Text => {
                let s = p.text_s_per_token.unwrap_or(0.0);
                (TEXT_BYTES_PER_TOKEN * k, n * s * k, 0.0)
            }
        };
        let end = trace.transfer(t, n * bytes);
        a.observe((n * bytes) as u64, end - t);
        t = end + compute;
        err += e * k;
        tokens += k;
    }
    Ok((t, err / tokens.max(1.0)))
}

/// The row of `runs` (TTFT, error) at deadline `slo`.
fn row(policy: String, slo: f64, runs: &[(f64, f64)]) -> SimRow {
    let mut ttft: Vec<f64> = runs.iter().map(|r| r.0).collect();
    ttft.sort_by(f64::total_cmp);
    let n = runs.len() as f64;
    SimRow {
        policy,
        slo_s: slo,
        violation_rate: runs.iter().filter(|r| r.0 > slo).count() as f64 / n,
        mean_error: runs.iter().map(|r| r.1).sum::<f64>() / n,
        ttft_p50_s: percentile(&ttft, 0.50),
        ttft_p95_s: percentile(&ttft, 0.95),
    }
}

/// The `q` quantile of ascending `v` (nearest rank).
fn percentile(v: &[f64], q: f64) -> f64 {
    let i = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
    v[i]
}

fn check(ctx: &SimContext, traces: &[Trace], p: &SimParams) -> Result<(), Error> {
    let bad = |what: &'static str| Err(Error::Sim { what });
    if traces.is_empty() {
        return bad("no trace to simulate");
    }
    if p.slos.is_empty() || p.slos.iter().any(|s| !(s.is_finite() && *s > 0.0)) {
        return bad("deadlines must be positive seconds");
    }
    if ctx.errors.len() != ctx.sizes.levels().len() {
        return bad("one error per level on offer is needed");
    }
    if ctx.tokens.len() != ctx.sizes.chunks() {
        return bad("one token count per chunk is needed");
    }
    Ok(())
}

/// SplitMix64's finaliser: spreads a seed over all 64 bits.
fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A seeded xorshift64*, for the traces.
struct XorShift(u64);

impl XorShift {
    fn new(seed: u64) -> XorShift {
        XorShift(seed ^ 0x9e37_79b9_7f4a_7c15 | 1)
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64
    }
}
