//! The encode policies and the token-selection evaluation through the library API.

use kvc_io::policy::{self, ProfileUse};
use kvc_io::pq::{self, Selector, Windows};
use kvc_io::{load_dump, Error, Silent};

#[test]
fn self_contained_keeps_only_the_levels_used() {
    let d = load_dump(&kvc_io::fixtures::sample()).unwrap();
    let full = policy::learn(&[&d], &mut Silent).unwrap();
    let (p, levels) = policy::self_contained(&full, &[7, 3, 7, 3]).unwrap();
    assert_eq!(levels, vec![1, 0, 1, 0]);
    assert_eq!(p.levels(), 2);
    assert_eq!(
        p.level_multipliers(),
        &[full.level_multipliers()[3], full.level_multipliers()[7]]
    );
    match policy::self_contained(&full, &[2, 12]) {
        Err(
            e @ Error::NoSuchLevel {
                level: 12,
                levels: 12,
            },
        ) => {
            assert_eq!(
                e.to_string(),
                "level 12 does not exist (the levels are 0 to 11)"
            )
        }
        other => panic!("expected NoSuchLevel, got {other:?}"),
    }
    // A self-contained stream embeds that cut-down profile and decodes alone.
    let params = codec_core::EncodeParams {
        levels: vec![7],
        ..Default::default()
    };
    let enc = policy::encode(&d.kv.view(), ProfileUse::SelfContained(&full), &params, 1).unwrap();
    assert_eq!(enc.embedded.as_ref().map(|p| p.levels()), Some(1));
    let s = codec_core::Stream::open(&enc.bytes, None, &codec_core::Limits::DEFAULT).unwrap();
    assert_eq!(s.decode().unwrap().shape, d.kv.shape);
    let refd = policy::encode(&d.kv.view(), ProfileUse::Referenced(&full), &params, 1).unwrap();
    assert!(refd.embedded.is_none() && refd.bytes.len() < enc.bytes.len());
}

#[test]
fn profile_file_errors_name_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("none.kvcp");
    let e = policy::load_profile(&missing).unwrap_err();
    assert!(matches!(e, Error::Read { .. }), "{e:?}");
    assert!(e.to_string().starts_with("cannot read ") && e.to_string().contains("none.kvcp"));
    let bad = dir.path().join("bad.kvcp");
    std::fs::write(&bad, b"not a profile").unwrap();
    let e = policy::load_profile(&bad).unwrap_err();
    assert!(matches!(e, Error::Profile { .. }), "{e:?}");
    assert!(std::error::Error::source(&e).is_some());
}

#[test]
fn pq_k_is_pq_cores_fraction_and_selection_is_causal() {
    let d = load_dump(&kvc_io::fixtures::sample()).unwrap();
    let sel = Selector {
        params: pq_core::PqParams::paper(),
        rerank: None,
    };
    let w = Windows {
        n_init: 4,
        n_local: 64,
    };
    let r = pq::evaluate(&d, std::slice::from_ref(&sel), w, &mut Silent).unwrap();
    assert_eq!(r.k_t5, pq_core::k_for_fraction(512, 1, 5).unwrap());
    assert_eq!(r.k_t10, pq_core::k_for_fraction(512, 1, 10).unwrap());
    assert_eq!((r.k_t5, r.k_t10), (102, 51));
    let f = &r.figures[0];
    assert!(f.recall_t5 > 0.2 && f.recall_t5 <= 1.0, "{f:?}");
    assert!(f.mass > 0.2 && f.mass <= 1.0 + 1e-9, "{f:?}");
    assert_eq!(f.cache.len(), 4);

    let s = pq::select(&d, &sel, w, 100, &mut Silent).unwrap();
    assert_eq!((s.n_q, s.q_heads, s.slots, s.k), (64, 9, 100, 32));
    for (row_i, row) in s.layers[0].chunks_exact(100).enumerate() {
        let pos = 448 + row_i / 9;
        assert!(row.iter().all(|&t| t >= 0 && t as usize <= pos));
        assert!(row.windows(2).all(|p| p[0] < p[1]));
    }
    match pq::select(&d, &sel, w, 513, &mut Silent) {
        Err(Error::SlotCount {
            slots: 513,
            tokens: 512,
        }) => {}
        other => panic!("expected SlotCount, got {other:?}"),
    }
    let mut no_q = d.clone();
    no_q.q = None;
    assert!(matches!(
        pq::evaluate(&no_q, &[sel], w, &mut Silent),
        Err(Error::NoQueries)
    ));
}
