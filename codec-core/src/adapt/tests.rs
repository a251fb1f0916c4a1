use super::*;
use alloc::vec;

/// Two chunks of 1000 tokens at levels 0 (8 MB), 5 (4 MB) and 10 (1 MB).
fn two() -> Sizes {
    Sizes::new(
        vec![0, 5, 10],
        [8_000_000, 4_000_000, 1_000_000].repeat(2),
        2,
    )
    .unwrap()
}

fn params(deadline_s: f64) -> AdaptParams {
    AdaptParams {
        deadline_s,
        text_s_per_token: None,
        prior_bytes_per_s: None,
        concurrent: 1,
    }
}

#[test]
fn the_first_chunk_goes_at_the_middle_level_or_by_the_prior() {
    let a = Adapter::new(two(), vec![1000; 2], params(1.0)).unwrap();
    assert_eq!(a.choose(0, 0.0), Choice::Level(5));
    let four = Sizes::new(vec![1, 2, 3, 4], vec![4, 3, 2, 1], 1).unwrap();
    let a = Adapter::new(four, vec![10], params(1.0)).unwrap();
    assert_eq!(
        a.choose(0, 0.0),
        Choice::Level(2),
        "the finer of the two middle levels"
    );
    // 20 MB/s known in advance: both chunks at level 0 take 0.8 s, within 1 s.
    let p = AdaptParams {
        prior_bytes_per_s: Some(20e6),
        ..params(1.0)
    };
    let a = Adapter::new(two(), vec![1000; 2], p).unwrap();
    assert_eq!(a.choose(0, 0.0), Choice::Level(0));
}

#[test]
fn each_choice_is_the_finest_that_fits_the_time_left() {
    let mut a = Adapter::new(two(), vec![1000; 2], params(1.0)).unwrap();
    a.observe(4_000_000, 0.4); // 10 MB/s
                               // Two chunks in 1 s: level 0 needs 1.6 s, level 5 0.8 s.
    assert_eq!(a.choose(0, 0.0), Choice::Level(5));
    // One chunk in 0.6 s after 0.4: level 0 needs 0.8 s, level 5 0.4 s.
    assert_eq!(a.choose(1, 0.4), Choice::Level(5));
    // One chunk in 0.85 s: level 0 (0.8 s) fits.
    assert_eq!(a.choose(1, 0.15), Choice::Level(0));
    // Nothing fits 0.05 s: the fastest, the coarsest level.
    assert_eq!(a.choose(1, 0.95), Choice::Level(10));
    // Past the deadline, still the fastest.
    assert_eq!(a.choose(1, 7.0), Choice::Level(10));
}

#[test]
fn text_wins_when_recomputing_fits_and_loses_when_slow() {
    let p = AdaptParams {
        text_s_per_token: Some(0.0002), // 0.2 s per 1000-token chunk
        ..params(1.0)
    };
    let mut a = Adapter::new(two(), vec![1000; 2], p).unwrap();
    a.observe(1_000_000, 1.0); // 1 MB/s: even level 10 takes 1 s per chunk
                               // Text: 4 KB of ids (4 ms) + 0.2 s per chunk: 0.408 s for both, within 1 s.
    assert_eq!(a.choose(0, 0.0), Choice::Text);
    assert!((a.chunk_s(0, Choice::Text, 1e6) - 0.204).abs() < 1e-12);
    let slow = AdaptParams {
        text_s_per_token: Some(0.01), // 10 s per chunk
        ..params(1.0)
    };
    let mut a = Adapter::new(two(), vec![1000; 2], slow).unwrap();
    a.observe(1_000_000, 0.1); // 10 MB/s
    assert_eq!(a.choose(0, 0.0), Choice::Level(5));
    // When nothing fits, the faster of text and the coarsest level.
    a.observe(1_000_000, 100.0); // 10 KB/s: level 10 takes 100 s, text 10.4 s
    assert_eq!(a.choose(0, 0.0), Choice::Text);
}

#[test]
fn batched_requests_share_the_link() {
    let p = AdaptParams {
        concurrent: 2,
        ..params(1.0)
    };
    let mut a = Adapter::new(two(), vec![1000; 2], p).unwrap();
    a.observe(8_000_000, 0.4); // 20 MB/s for the batch
                               // Alone, level 0 would take 0.8 s for both chunks; two requests double it.
    assert_eq!(a.choose(0, 0.0), Choice::Level(5));
    assert!((a.remaining_s(0, Choice::Level(5), 20e6) - 0.8).abs() < 1e-12);
}

#[test]
fn measurements_too_short_to_time_are_ignored() {
    let mut a = Adapter::new(two(), vec![1000; 2], params(1.0)).unwrap();
    a.observe(1000, 0.0);
    a.observe(0, 1.0);
    a.observe(1000, f64::NAN);
    assert_eq!(a.throughput(), None);
    a.observe(1000, 0.001);
    assert_eq!(a.throughput(), Some(1e6));
}

#[test]
fn refusals() {
    let e = |r: Result<Sizes, AdaptError>| r.unwrap_err();
    assert_eq!(e(Sizes::new(vec![], vec![], 0)), AdaptError::Levels);
    assert_eq!(e(Sizes::new(vec![3, 3], vec![1, 1], 1)), AdaptError::Levels);
    assert!(matches!(
        e(Sizes::new(vec![1, 2], vec![1, 2, 3], 2)),
        AdaptError::Sizes { got: 3, .. }
    ));
    assert!(matches!(
        e(Sizes::new(vec![1], vec![], usize::MAX)),
        AdaptError::Sizes { .. }
    ));
    let new = |tokens: Vec<u32>, p| Adapter::new(two(), tokens, p).unwrap_err();
    assert!(matches!(
        new(vec![1], params(1.0)),
        AdaptError::Tokens { got: 1, chunks: 2 }
    ));
    for bad in [
        params(f64::NAN),
        params(-1.0),
        AdaptParams {
            text_s_per_token: Some(-1.0),
            ..params(1.0)
        },
        AdaptParams {
            prior_bytes_per_s: Some(0.0),
            ..params(1.0)
        },
        AdaptParams {
            concurrent: 0,
            ..params(1.0)
        },
    ] {
        assert!(matches!(new(vec![1, 1], bad), AdaptError::Param { .. }));
    }
    assert!(AdaptError::Levels.to_string().contains("ascending"));
}
