//! Bandwidth traces integrate and invert; the token bucket, driven on a simulated clock, sends
//! at the trace's rate and follows its changes.

use kvc_io::sim::Trace;
use kvc_net::rate::Bucket;

#[test]
fn the_trace_integrates_and_inverts() {
    // 1000 B/s for 2 s, 10 B/s for 1 s, then 500 B/s.
    let t = Trace::parse("0 0.000008\n2 0.00000008\n3 0.000004\n").unwrap();
    assert_eq!(t.bytes_between(0.0, 1.0), 1000.0);
    assert!(close(t.bytes_between(1.5, 3.5), 500.0 + 10.0 + 250.0));
    assert!(close(t.bytes_between(2.2, 2.8), 6.0));
    assert_eq!(t.bytes_between(1.0, 1.0), 0.0);
    assert_eq!(t.bytes_between(1.0, 0.5), 0.0);
    assert_eq!(t.transfer(0.0, 2000.0), 2.0);
    // Bytes that do not fit before the slow second crawl through it.
    assert!(close(t.transfer(1.5, 1000.0), 3.0 + 490.0 / 500.0));
}

/// Sends `total` bytes in `piece`-byte reservations, sleeping as told on a simulated clock
/// starting at `t0`: the times each piece went out.
fn replay(b: &mut Bucket, t0: f64, total: u64, piece: u64) -> Vec<f64> {
    let mut now = t0;
    let mut times = Vec::new();
    for _ in 0..total / piece {
        now += b.reserve(piece, now);
        times.push(now);
    }
    times
}

#[test]
fn the_bucket_sends_at_the_trace_rate_across_a_drop() {
    // 80 Mbps (10 MB/s) for 1 s, then 8 Mbps (1 MB/s).
    let trace = Trace::parse("0 0.08\n1 0.008\n").unwrap();
    let mut b = Bucket::new(trace, 65536.0);
    // 20 MB in 64 KB pieces: the first 64 KB go at once (a full bucket), the first 10 MB
    // by 1 s, the rest at 1 MB/s.
    let piece = 65536;
    let times = replay(&mut b, 0.0, 20 << 20, piece);
    assert_eq!(times[0], 0.0);
    let sent_by = |t: f64| times.iter().filter(|&&x| x <= t + 1e-9).count() as f64 * piece as f64;
    let by_1s = sent_by(1.0);
    assert!((by_1s - 10e6 - 65536.0).abs() <= piece as f64, "{by_1s}");
    let end = *times.last().unwrap();
    let expected = 1.0 + (20.0 * 1048576.0 - 10e6 - 65536.0) / 1e6;
    assert!((end - expected).abs() < 1e-6, "{end} vs {expected}");
    // Over the second half, the rate is the trace's second rate.
    let rate = (sent_by(end) - sent_by(5.0)) / (end - 5.0);
    assert!((rate - 1e6).abs() / 1e6 < 0.02, "{rate}");
}

/// `a` equals `b` up to rounding.
fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

#[test]
fn an_idle_bucket_fills_only_to_its_burst_and_senders_queue() {
    let mut b = Bucket::new(Trace::constant(8e-6), 100.0);
    assert_eq!(b.reserve(100, 0.0), 0.0);
    // Idle for 10 s: 10 000 bytes of rate, but the bucket holds 100.
    assert_eq!(b.reserve(100, 10.0), 0.0);
    let w = b.reserve(100, 10.0);
    assert!(close(w, 0.1), "{w}");
    // Two senders at the same instant queue: the second waits for the first's bytes too.
    let w = b.reserve(500, 10.0);
    assert!(close(w, 0.6), "{w}");
    // A clock that steps back (two threads reading it) does not refill or panic.
    let w = b.reserve(100, 9.0);
    assert!(close(w, 1.7), "{w}");
}
