//! The hooks `kvc eval --gpu` and `kvc pq eval --gpu` run a second implementation through
//! (`eval::SecondDecoder`, `pq::SecondSearch`): what they are given, and that a failure or a
//! different selection is an error naming where, checked here without a GPU.

use kvc_io::eval::{evaluate_with, SecondDecoder};
use kvc_io::policy::{self, ProfileUse};
use kvc_io::pq::{self, SearchQuery, Searched, SecondSearch, Selector, Windows};
use kvc_io::{load_dump, Error, Silent};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Checks that it is given codec-core's decode of the stream; fails at level `fail_at`.
struct Checker {
    levels_seen: usize,
    fail_at: Option<usize>,
}

impl SecondDecoder for Checker {
    fn decode_and_compare(
        &mut self,
        stream: &codec_core::Stream<'_>,
        cpu: &codec_core::KvCache,
    ) -> Result<f64, BoxError> {
        assert!(stream.decode().unwrap() == *cpu);
        self.levels_seen += 1;
        if self.fail_at == Some(self.levels_seen - 1) {
            return Err("bytes differ".into());
        }
        Ok(1e-3)
    }
}

#[test]
fn a_second_decoder_sees_every_level_and_its_failure_names_the_level() {
    // Two layers: each evaluation below codes and decodes every level.
    let mut d = load_dump(&kvc_io::fixtures::sample()).unwrap();
    d.keep_layers(2);
    let full = policy::learn(&[&d], &mut Silent).unwrap();
    let how = ProfileUse::Referenced(&full);
    let mut ok = Checker {
        levels_seen: 0,
        fail_at: None,
    };
    let rows = evaluate_with(&d, how, 0, &mut Silent, Some(&mut ok)).unwrap();
    assert_eq!(ok.levels_seen, usize::from(full.levels()));
    let elements = d.kv.shape.total_elements() as f64;
    for r in &rows {
        match r.bytes {
            // 1 ms per decode of the f16 cache.
            Some(_) => assert_eq!(r.second_decode_mb_s, Some(elements * 2.0 / 1e6 / 1e-3)),
            None => assert_eq!(r.second_decode_mb_s, None, "{}", r.name),
        }
    }
    let mut bad = Checker {
        levels_seen: 0,
        fail_at: Some(2),
    };
    match evaluate_with(&d, how, 0, &mut Silent, Some(&mut bad)) {
        Err(e @ Error::Companion { .. }) => assert_eq!(e.to_string(), "level 2: bytes differ"),
        other => panic!("expected Companion, got {other:?}"),
    }
    let plain = kvc_io::eval::evaluate(&d, how, 0, &mut Silent).unwrap();
    assert!(plain.iter().all(|r| r.second_decode_mb_s.is_none()));
}

/// pq-core's own search, with one token of query `spoil` replaced.
struct CpuSearch {
    spoil: Option<usize>,
    queries_seen: usize,
}

impl SecondSearch for CpuSearch {
    fn search(
        &mut self,
        heads: &[(pq_core::Codebook, Vec<u16>)],
        queries: &[SearchQuery<'_>],
    ) -> Result<Searched, BoxError> {
        self.queries_seen = queries.len();
        let mut selections = Vec::new();
        for q in queries {
            let (cb, codes) = &heads[q.head];
            let table = pq_core::score_table(q.query, cb)?;
            let w = q.windows;
            let codes = &codes[..q.tokens * cb.m()];
            selections.push(pq_core::search(codes, &table, q.k, w.n_init, w.n_local)?);
        }
        if let Some(s) = self.spoil {
            let last = selections[s].last_mut().unwrap();
            *last = last.wrapping_add(1);
        }
        Ok(Searched {
            selections,
            seconds: 0.5,
            kernel_seconds: None,
        })
    }
}

#[test]
fn a_second_search_must_select_what_pq_core_selects() {
    let d = load_dump(&kvc_io::fixtures::sample()).unwrap();
    let sel = Selector {
        params: pq_core::PqParams::default(),
        rerank: None,
    };
    let w = Windows {
        n_init: 4,
        n_local: 64,
    };
    let sels = std::slice::from_ref(&sel);
    let mut same = CpuSearch {
        spoil: None,
        queries_seen: 0,
    };
    let r = pq::evaluate_with(&d, sels, w, &mut Silent, Some(&mut same)).unwrap();
    let s = d.kv.shape;
    let per_layer = d.n_q() * d.q_heads;
    assert_eq!(same.queries_seen, s.layers as usize * per_layer);
    // Every query sees its causal prefix: scores = layers * q_heads * sum of the prefixes.
    let prefixes: usize = (0..d.n_q()).map(|i| d.q_start as usize + i + 1).sum();
    let scores = (s.layers as usize * d.q_heads * prefixes) as f64;
    assert_eq!(r.figures[0].second_scores_per_s, Some((scores / 0.5, None)));

    // The second query of layer 1: query 0, head 1.
    let mut spoiled = CpuSearch {
        spoil: Some(per_layer + 1),
        queries_seen: 0,
    };
    match pq::evaluate_with(&d, sels, w, &mut Silent, Some(&mut spoiled)) {
        Err(e @ Error::Companion { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains("layer 1, query 0, head 1: selected"), "{msg}");
        }
        other => panic!("expected Companion, got {other:?}"),
    }
}
