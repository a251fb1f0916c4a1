//! The model-backed parts of kvc-io: runner dumps against the shipped fixture (made by another
//! runtime from the same GGUF), and the judge's invariants. Skipped (and said so) without the
//! model; CI fetches it and sets `KVC_REQUIRE_MODEL=1`.

use kvc_io::judge::{self, JudgeParams, JudgeProfile};
use kvc_io::{fixtures, load_dump, Silent};
use llm::Model;
use std::path::Path;

fn model() -> Option<&'static Model> {
    llm::shared_test_model(&Path::new(env!("CARGO_MANIFEST_DIR")).join(".."))
}

fn gpl3() -> String {
    llm::test_text(&Path::new(env!("CARGO_MANIFEST_DIR")).join(".."), "GPL-3")
}

#[test]
fn runner_dump_matches_the_shipped_fixture() {
    let Some(m) = model() else { return };
    let sample = load_dump(&fixtures::sample()).unwrap();
    let d = judge::dump_text(m, &gpl3(), "GPL-3", 512, 64, false, &mut Silent).unwrap();
    // Same tokens as the fixture (its metadata pins their hash).
    assert_eq!(
        d.metadata["tokens_sha256_16"],
        sample.metadata["tokens_sha256_16"]
    );
    assert_eq!((d.kv.shape, d.q_start, d.n_q()), (sample.kv.shape, 448, 64));
    // The fixture came from another runtime in NeoX pairing: K agrees after the channel
    // permutation (GPT-J channel 2j is NeoX j, 2j + 1 is NeoX j + 32), V as is.
    let dim = 64;
    let mut worst: f64 = 0.0;
    for l in 0..30 {
        let (k, v) = (d.kv.k[l].to_f32_vec(), d.kv.v[l].to_f32_vec());
        let (sk, sv) = (sample.kv.k[l].to_f32_vec(), sample.kv.v[l].to_f32_vec());
        let mut kp = vec![0f32; k.len()];
        for (out, head) in kp.chunks_exact_mut(dim).zip(sk.chunks_exact(dim)) {
            for j in 0..dim / 2 {
                out[2 * j] = head[j];
                out[2 * j + 1] = head[j + dim / 2];
            }
        }
        worst = worst.max(kvc_io::metrics::rel_error(&kp, &k));
        worst = worst.max(kvc_io::metrics::rel_error(&sv, &v));
    }
    assert!(worst < 2e-3, "worst relative K/V difference {worst}");
}

#[test]
fn judge_is_zero_uncompressed_and_grows_with_the_level() {
    let Some(m) = model() else { return };
    let params = JudgeParams {
        ctx: 256,
        cont: 32,
        levels: Some(vec![0, 7, 11]),
        baselines: true,
    };
    let j = judge::judge(m, &gpl3(), &params, JudgeProfile::SelfLearned, &mut Silent).unwrap();
    let names: Vec<_> = j
        .rows
        .iter()
        .map(|r| (r.method.as_str(), r.level))
        .collect();
    assert_eq!(
        names,
        [
            ("uncompressed", None),
            ("kvc", Some(0)),
            ("kvc", Some(7)),
            ("kvc", Some(11)),
            ("minmax-int8", None),
            ("minmax-int4", None),
            ("minmax-int3", None)
        ]
    );
    let r = &j.rows;
    assert_eq!((r[0].kl, r[0].top1), (0.0, 1.0));
    assert!(r[0].ppl > 1.0 && r[0].ppl.is_finite());
    for w in [&r[1..4], &r[4..7]] {
        for p in w.windows(2) {
            assert!(p[0].kl < p[1].kl, "{p:?}");
            assert!(p[0].bits_per_elem > p[1].bits_per_elem, "{p:?}");
        }
        assert!(w[0].kl > 0.0);
    }
    assert!(r[1..4]
        .iter()
        .all(|x| x.encode_s.is_some() && x.decode_s.is_some()));
}

#[test]
fn short_texts_and_bad_lengths_are_errors() {
    let Some(m) = model() else { return };
    let e = judge::dump_text(m, "two words", "t", 512, 0, false, &mut Silent).unwrap_err();
    assert!(e.to_string().contains("tokens"), "{e}");
    let p = JudgeParams {
        ctx: 8,
        cont: 1,
        levels: None,
        baselines: false,
    };
    assert!(judge::judge(m, &gpl3(), &p, JudgeProfile::SelfLearned, &mut Silent).is_err());
}
