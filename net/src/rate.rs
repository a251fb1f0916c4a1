//! The server's sending rate (`spec/STREAM.md` §4.7): unlimited, constant, or a bandwidth trace
//! (`kvc_io::sim::Trace`, the same traces `kvc stream-sim` replays) replayed by a token bucket
//! that every connection draws from.
//!
//! The bucket's arithmetic takes the time as an argument ([`Bucket::reserve`]), so tests drive
//! it on a simulated clock; [`Limiter`] puts it on the wall clock for the server.
//!
//! ```
//! use kvc_io::sim::Trace;
//! use kvc_net::rate::Bucket;
//!
//! // 8 Gbps (1 GB/s) for 1 s, then 0.8 Gbps (100 MB/s).
//! let trace = Trace::parse("# drop at 1 s\n0 8\n1 0.8\n")?;
//! let mut b = Bucket::new(trace, 0.0);
//! assert_eq!(b.reserve(500_000_000, 0.0), 0.5);   // half a second of the first rate
//! // Queued behind those: 500 MB more fill the first second, the last 100 MB take 1 s.
//! assert_eq!(b.reserve(600_000_000, 0.0), 2.0);
//! # Ok::<(), kvc_io::Error>(())
//! ```

use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use kvc_io::sim::Trace;

/// A token bucket filled at a trace's rate, holding at most `burst` bytes. Reservations may
/// overdraw it: the debt is paid off by later filling, so that reservations queue in order.
#[derive(Clone, Debug)]
pub struct Bucket {
    trace: Trace,
    burst: f64,
    tokens: f64,
    /// Time of the last fill, seconds.
    last: f64,
}

impl Bucket {
    /// A full bucket at time 0.
    pub fn new(trace: Trace, burst: f64) -> Bucket {
        Bucket {
            trace,
            burst: burst.max(0.0),
            tokens: burst.max(0.0),
            last: 0.0,
        }
    }

    /// Takes `bytes` at time `now` (seconds since the trace started) and returns how long the
    /// sender must wait before sending them, in seconds (0 if the bucket held them).
    pub fn reserve(&mut self, bytes: u64, now: f64) -> f64 {
        if now > self.last {
            let fill = self.trace.bytes_between(self.last, now);
            self.tokens = (self.tokens + fill).min(self.burst);
            self.last = now;
        }
        self.tokens -= bytes as f64;
        if self.tokens >= 0.0 {
            return 0.0;
        }
        (self.trace.transfer(self.last, -self.tokens) - now).max(0.0)
    }
}

/// The shortest wait a sender sleeps: shorter waits are skipped (the bucket remembers the debt,
/// so the rate holds on average), since timers do not sleep less than a millisecond.
pub const MIN_SLEEP: Duration = Duration::from_millis(1);

/// Bytes the bucket holds when full: one write's worth, so that the link's rate shows within
/// a chunk.
pub const BURST_BYTES: f64 = 64.0 * 1024.0;

/// The server's rate, shared by every connection, on the wall clock: the trace's time 0 is the
/// first reservation (the server's first byte sent).
#[derive(Debug)]
pub struct Limiter {
    bucket: Option<Mutex<Bucket>>,
    epoch: OnceLock<Instant>,
}

impl Limiter {
    /// No limit.
    pub fn unlimited() -> Limiter {
        Limiter {
            bucket: None,
            epoch: OnceLock::new(),
        }
    }

    /// Replays `trace`.
    pub fn new(trace: Trace) -> Limiter {
        Limiter {
            bucket: Some(Mutex::new(Bucket::new(trace, BURST_BYTES))),
            epoch: OnceLock::new(),
        }
    }

    /// Takes `bytes` now: how long to sleep before sending them (zero under [`MIN_SLEEP`]).
    pub fn delay(&self, bytes: u64) -> Duration {
        let Some(bucket) = &self.bucket else {
            return Duration::ZERO;
        };
        let now = self.epoch.get_or_init(Instant::now).elapsed().as_secs_f64();
        // A poisoned lock only means another sender panicked mid-update; the numbers stand.
        let mut b = bucket.lock().unwrap_or_else(|e| e.into_inner());
        let wait = Duration::try_from_secs_f64(b.reserve(bytes, now)).unwrap_or(Duration::MAX);
        if wait < MIN_SLEEP {
            Duration::ZERO
        } else {
            wait
        }
    }
}
