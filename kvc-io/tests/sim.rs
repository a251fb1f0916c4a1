//! `kvc stream-sim`'s simulation: hand-worked times on a trace file, determinism with a seed,
//! and the adapter against fixed levels at the extremes of bandwidth.

use codec_core::adapt::Sizes;
use kvc_io::sim::{simulate, SimContext, SimParams, SimRow, Trace};

/// Four chunks of 500 tokens at levels 0 (8 MB), 5 (4 MB) and 10 (1 MB).
fn ctx() -> SimContext {
    SimContext {
        sizes: Sizes::new(
            vec![0, 5, 10],
            [8_000_000, 4_000_000, 1_000_000].repeat(4),
            4,
        )
        .unwrap(),
        tokens: vec![500; 4],
        errors: vec![0.01, 0.05, 0.2],
    }
}

fn get<'a>(rows: &'a [SimRow], policy: &str, slo: f64) -> &'a SimRow {
    rows.iter()
        .find(|r| r.policy == policy && r.slo_s == slo)
        .unwrap_or_else(|| panic!("no row {policy} {slo}"))
}

#[test]
fn a_trace_file_gives_hand_worked_times() {
    // 1 Gbps (125 MB/s) for 0.1 s, then 0.1 Gbps (12.5 MB/s).
    let trace = Trace::parse("# a drop\n0 1\n0.1 0.1  # after 100 ms\n").unwrap();
    assert!((trace.transfer(0.0, 12_500_000.0) - 0.1).abs() < 1e-12);
    assert!((trace.transfer(0.0, 25_000_000.0) - 1.1).abs() < 1e-12);
    assert!((trace.transfer(0.5, 1_250_000.0) - 0.6).abs() < 1e-12);
    let p = SimParams {
        slos: vec![1.0],
        ..SimParams::default()
    };
    let rows = simulate(&ctx(), &[trace], &p).unwrap();
    // Level 10: 4 MB, 1 MB per chunk; 12.5 MB fit the first 0.1 s: done at 0.032 s.
    assert!((get(&rows, "level-10", 1.0).ttft_p50_s - 0.032).abs() < 1e-12);
    // Level 0: 32 MB: 12.5 MB by 0.1 s, the other 19.5 MB at 12.5 MB/s: 1.66 s.
    let l0 = get(&rows, "level-0", 1.0);
    assert!((l0.ttft_p50_s - 1.66).abs() < 1e-12);
    assert_eq!((l0.violation_rate, l0.mean_error), (1.0, 0.01));
    // The adapter: chunk 0 at the middle level (4 MB in 0.032 s: 125 MB/s). Chunk 1: the 3
    // chunks left at level 0 would take 0.192 s of the 0.968 s left: level 0, done at 0.096 s
    // (12 MB fit before the drop). Chunk 2: 0.128 s of 0.904: level 0 again, which meets the
    // drop (0.5 MB by 0.1 s, 7.5 MB at 12.5 MB/s): done at 0.7 s, measured at 13.2 MB/s.
    // Chunk 3: 0.3 s left; level 0 needs 0.604 s, level 5 0.302 s, level 10 0.0755 s: level
    // 10, 1 MB at 12.5 MB/s, done at 0.78 s.
    let a = get(&rows, "adaptive", 1.0);
    assert_eq!(a.violation_rate, 0.0, "{a:?}");
    assert!((a.ttft_p50_s - 0.78).abs() < 1e-9, "{a:?}");
    assert!(
        (a.mean_error - (0.05 + 0.01 + 0.01 + 0.2) / 4.0).abs() < 1e-12,
        "{a:?}"
    );
}

#[test]
fn the_adapter_takes_the_finest_level_on_a_fast_link_and_the_coarsest_on_a_slow_one() {
    let p = SimParams {
        slos: vec![0.5],
        ..SimParams::default()
    };
    // 10 Gbps: 32 MB take 25.6 ms; after the first chunk (middle level) everything is level 0.
    let rows = simulate(&ctx(), &[Trace::constant(10.0)], &p).unwrap();
    let a = get(&rows, "adaptive", 0.5);
    assert_eq!(a.violation_rate, 0.0);
    assert!(
        (a.mean_error - (0.05 + 3.0 * 0.01) / 4.0).abs() < 1e-12,
        "{a:?}"
    );
    // 0.01 Gbps: nothing fits; after the first chunk, the coarsest level.
    let rows = simulate(&ctx(), &[Trace::constant(0.01)], &p).unwrap();
    let a = get(&rows, "adaptive", 0.5);
    assert_eq!(a.violation_rate, 1.0);
    assert!(
        (a.mean_error - (0.05 + 3.0 * 0.2) / 4.0).abs() < 1e-12,
        "{a:?}"
    );
}

#[test]
fn random_traces_are_seeded_and_fixed_levels_order_by_size() {
    let p = SimParams {
        slos: vec![1.0, 0.25],
        text_s_per_token: Some(0.001),
        concurrent: 1,
    };
    let traces = |seed: u64| Trace::random_walks(seed, 50, 30.0);
    let a = simulate(&ctx(), &traces(7), &p).unwrap();
    assert_eq!(
        a,
        simulate(&ctx(), &traces(7), &p).unwrap(),
        "same seed, same rows"
    );
    assert_ne!(a, simulate(&ctx(), &traces(8), &p).unwrap());
    // 2 adaptive rows, then 4 policies (3 levels, text) at 2 deadlines.
    assert_eq!(a.len(), 2 + 4 * 2);
    for slo in [1.0, 0.25] {
        let v: Vec<f64> = ["level-0", "level-5", "level-10"]
            .iter()
            .map(|l| get(&a, l, slo).ttft_p50_s)
            .collect();
        assert!(v[0] > v[1] && v[1] > v[2], "{v:?}");
        // Text: 2000 tokens at 1 ms each, 2 s, whatever the link: it misses both deadlines.
        let t = get(&a, "text", slo);
        assert_eq!((t.violation_rate, t.mean_error), (1.0, 0.0));
        assert!(t.ttft_p50_s > 2.0);
    }
    // A walk stays within 0.1-10 Gbps.
    let w = &Trace::random_walks(3, 1, 100.0)[0];
    let (lo, hi) = (w.transfer(0.0, 0.0), w.transfer(0.0, 1.25e10));
    assert_eq!(lo, 0.0);
    assert!((1.0..=100.0).contains(&hi), "10 GB took {hi} s");
}

#[test]
fn bad_traces_and_parameters_are_refused() {
    let e = |t: &str| Trace::parse(t).unwrap_err().to_string();
    assert!(e("0 1\n0.5 x").contains("line 2"));
    assert!(e("0 1\n0.5 -1").contains("positive"));
    assert!(e("0 1\n0 2").contains("ascend"));
    assert!(e("1 1").contains("start at 0"));
    assert!(e("0 1 2").contains("two numbers"));
    assert!(e("# nothing\n").contains("no rate"));
    let p = |slos: Vec<f64>| SimParams {
        slos,
        ..SimParams::default()
    };
    let one = [Trace::constant(1.0)];
    assert!(simulate(&ctx(), &one, &p(vec![])).is_err());
    assert!(simulate(&ctx(), &one, &p(vec![f64::NAN])).is_err());
    assert!(simulate(&ctx(), &[], &p(vec![1.0])).is_err());
    let mut c = ctx();
    c.errors.pop();
    assert!(simulate(&c, &one, &p(vec![1.0]))
        .unwrap_err()
        .to_string()
        .contains("error per level"));
}
