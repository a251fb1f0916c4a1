//! The runner against an fp32 reference and against itself (cache paths). Runs when
//! `tools/fetch-model` has fetched the model; CI sets `KVC_REQUIRE_MODEL=1` so that none skip.

use codec_core::blend::SelectParams;
use codec_core::{KvCache, RopeStyle, Tensor as KvTensor};
use kvc_llm::{Model, PrefillOptions, Recompute};
use std::path::Path;

fn model() -> Option<&'static Model> {
    kvc_llm::shared_test_model(&Path::new(env!("CARGO_MANIFEST_DIR")).join(".."))
}

fn gpl3_tokens(m: &Model, n: usize) -> Vec<u32> {
    let text = kvc_llm::test_text(&Path::new(env!("CARGO_MANIFEST_DIR")).join(".."), "GPL-3");
    let t = m.tokenizer().encode(&text).unwrap();
    assert!(t.len() >= n);
    t[..n].to_vec()
}

/// `max |a - b| / max |b|`.
fn rel(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let d = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    d / b.iter().map(|y| y.abs()).fold(0f32, f32::max)
}

#[test]
fn gpl3_next_token_top5_matches_fp32_reference() {
    let Some(m) = model() else { return };
    let p = m.prefill(&gpl3_tokens(m, 64)).unwrap();
    let mut idx: Vec<usize> = (0..p.logits.len()).collect();
    idx.sort_by(|&a, &b| p.logits[b].total_cmp(&p.logits[a]));
    let want = [
        (260, 27.02),
        (355, 24.23),
        (357, 19.19),
        (1195, 18.69),
        (451, 17.46),
    ];
    for (&i, (id, logit)) in idx.iter().zip(want) {
        assert_eq!(i, id);
        // The reference's figures are given to 2 decimals.
        assert!((p.logits[i] - logit).abs() < 0.006, "{i}: {}", p.logits[i]);
    }
}

#[test]
fn prefill_then_continuation_equals_one_forward() {
    let Some(m) = model() else { return };
    // 300 + 40: the prefill crosses a step boundary, the continuation starts mid-step.
    let t = gpl3_tokens(m, 340);
    let full = m.forward(&t).unwrap();
    let vocab = m.config().vocab;
    let pre = m.prefill(&t[..300]).unwrap();
    assert!(rel(&pre.logits, &full[299 * vocab..300 * vocab]) < 1e-4);
    let cont = m.forward_with_cache(&pre.cache, &t[300..]).unwrap();
    let r = rel(&cont, &full[300 * vocab..]);
    assert!(r < 1e-4, "relative difference {r}");
}

#[test]
fn shifted_or_twice_rotated_cache_changes_the_result() {
    let Some(m) = model() else { return };
    let t = gpl3_tokens(m, 200);
    let pre = m.prefill(&t[..160]).unwrap();
    let good = m.forward_with_cache(&pre.cache, &t[160..]).unwrap();
    let mut shifted = pre.cache.clone();
    shifted.meta.first_position = 1;
    let s = m.forward_with_cache(&shifted, &t[160..]).unwrap();
    assert!(rel(&s, &good) > 1e-3, "a one-token shift went unnoticed");
    let mut twice = pre.cache.clone();
    twice.meta.rope.k_pre_rope = true;
    let r2 = m.forward_with_cache(&twice, &t[160..]).unwrap();
    assert!(rel(&r2, &good) > 1e-3, "a second rotation went unnoticed");
}

#[test]
fn shifted_keys_equal_a_prefill_at_the_new_positions() {
    let Some(m) = model() else { return };
    let t = gpl3_tokens(m, 96);
    let at = |first_position| {
        let opt = PrefillOptions {
            first_position,
            ..PrefillOptions::default()
        };
        m.prefill_with(&t, opt).unwrap().cache
    };
    let (at0, at1000) = (at(0), at(1000));
    assert_eq!(at1000.meta.first_position, 1000);
    let mut moved = at0.clone();
    codec_core::shift_cache(&mut moved, 1000).unwrap();
    let diff = |a: &KvCache, l: usize| rel(&a.k[l].to_f32_vec(), &at1000.k[l].to_f32_vec());
    assert!(diff(&moved, 0) < 1e-3, "layer 0: {}", diff(&moved, 0));
    assert!(diff(&at0, 0) > 0.1, "the positions did not matter");
    // Deeper layers see only relative positions: they agree too, to rounding.
    assert!(diff(&moved, 29) < 1e-3, "layer 29: {}", diff(&moved, 29));
    // Back again, the values never moved.
    codec_core::shift_cache(&mut moved, 0).unwrap();
    assert!(diff(&moved, 0) > 0.1 && moved.v == at0.v);
}

#[test]
fn pre_rope_and_neox_caches_continue_alike() {
    let Some(m) = model() else { return };
    let t = gpl3_tokens(m, 120);
    let opt = PrefillOptions {
        queries: 8,
        pre_rope_k: true,
        ..PrefillOptions::default()
    };
    let pre = m.prefill_with(&t[..100], opt).unwrap();
    assert!(pre.cache.meta.rope.k_pre_rope);
    let c = m.config();
    assert_eq!(pre.queries.len(), c.layers);
    assert!(pre
        .queries
        .iter()
        .all(|q| q.len() == 8 * c.heads * c.head_dim));
    let post = m.prefill(&t[..100]).unwrap();
    assert!(rel(&pre.logits, &post.logits) < 1e-6);
    let a = m.forward_with_cache(&pre.cache, &t[100..]).unwrap();
    let b = m.forward_with_cache(&post.cache, &t[100..]).unwrap();
    assert!(rel(&a, &b) < 1e-5);
    let neox = to_neox(&post.cache, c.head_dim);
    let n = m.forward_with_cache(&neox, &t[100..]).unwrap();
    assert!(rel(&n, &b) < 1e-6);
}

/// The cache with each head's K channels in NeoX order (the inverse of the runner's import).
fn to_neox(cache: &KvCache, d: usize) -> KvCache {
    let mut out = cache.clone();
    out.meta.rope.style = RopeStyle::NeoX;
    for k in &mut out.k {
        let mut v = k.to_f32_vec();
        for head in v.chunks_exact_mut(d) {
            let g = head.to_vec();
            for j in 0..d / 2 {
                head[j] = g[2 * j];
                head[j + d / 2] = g[2 * j + 1];
            }
        }
        *k = KvTensor::F32(v);
    }
    out
}

/// Tokens `from..` of `cache` as f32 vectors, per layer (K then V).
fn tail(cache: &KvCache, from: usize) -> Vec<Vec<f32>> {
    let c = cache.shape.channels();
    cache
        .k
        .iter()
        .chain(&cache.v)
        .map(|t| t.to_f32_vec()[from * c..].to_vec())
        .collect()
}

#[test]
fn extend_equals_the_tail_of_one_prefill_in_every_convention() {
    let Some(m) = model() else { return };
    // 300 + 40: the prefix crosses a step boundary, the extension starts mid-step.
    let t = gpl3_tokens(m, 340);
    let d = m.config().head_dim;
    for pre_rope_k in [false, true] {
        let opt = PrefillOptions {
            pre_rope_k,
            ..PrefillOptions::default()
        };
        let full = m.prefill_with(&t, opt).unwrap().cache;
        let prefix = m.prefill_with(&t[..300], opt).unwrap().cache;
        let ext = m.extend(&prefix, &t[300..]).unwrap();
        assert_eq!(ext.shape.tokens, 40);
        assert_eq!(ext.meta.first_position, 300);
        assert_eq!(ext.meta.rope, full.meta.rope);
        for (i, (a, b)) in tail(&ext, 0).iter().zip(tail(&full, 300)).enumerate() {
            let r = rel(a, &b);
            assert!(r < 1e-4, "pre_rope_k {pre_rope_k}, tensor {i}: {r}");
        }
        // A NeoX-paired prefix gets a NeoX-paired extension.
        let neox = m.extend(&to_neox(&prefix, d), &t[300..]).unwrap();
        assert_eq!(neox.meta.rope.style, RopeStyle::NeoX);
        let back = tail(&to_neox(&ext, d), 0);
        for (a, b) in tail(&neox, 0).iter().zip(&back) {
            assert!(rel(a, b) < 1e-5);
        }
    }
    // On an empty cache at position 0, extending is prefilling.
    let mut empty = m.prefill(&t[..1]).unwrap().cache;
    empty.shape.tokens = 0;
    for x in empty.k.iter_mut().chain(empty.v.iter_mut()) {
        *x = KvTensor::F32(Vec::new());
    }
    let ext = m.extend(&empty, &t[..40]).unwrap();
    let pre = m.prefill(&t[..40]).unwrap().cache;
    for (a, b) in tail(&ext, 0).iter().zip(tail(&pre, 0)) {
        assert!(rel(a, &b) < 1e-4);
    }
}

#[test]
fn bad_inputs_are_errors() {
    let Some(m) = model() else { return };
    assert!(m.prefill(&[]).is_err());
    assert!(m.prefill(&[m.config().vocab as u32]).is_err());
    let pre = m.prefill(&[1, 2, 3]).unwrap();
    let mut wrong = pre.cache.clone();
    wrong.meta.rope.theta = 10_000.0;
    let e = m.forward_with_cache(&wrong, &[4]).unwrap_err();
    assert!(e.to_string().contains("rotary"), "{e}");
    let mut far = pre.cache.clone();
    far.meta.first_position = m.config().context as u64;
    assert!(m.forward_with_cache(&far, &[4]).is_err());
    far.meta.first_position = u64::MAX;
    assert!(m.forward_with_cache(&far, &[4]).is_err());
    far.meta.rope.k_pre_rope = true;
    assert!(m.forward_with_cache(&far, &[4]).is_err());
    let missing = Model::load(Path::new("/nonexistent/model.gguf")).unwrap_err();
    assert!(
        missing.to_string().contains("tools/fetch-model"),
        "{missing}"
    );
}

/// Two 64-token chunks of GPL-3 prefilled alone, placed one after the other, and a 32-token
/// suffix: (reused cache, chunk tokens, suffix).
fn two_chunks(m: &Model) -> (KvCache, Vec<u32>, Vec<u32>) {
    let t = gpl3_tokens(m, 400);
    let (a, b, q) = (&t[..64], &t[200..264], &t[300..332]);
    let chunks = [m.prefill(a).unwrap().cache, m.prefill(b).unwrap().cache];
    let placed = kvc_llm::place_chunks(&chunks).unwrap();
    (placed, [a, b].concat(), q.to_vec())
}

#[test]
fn the_fusor_spans_full_reuse_to_full_prefill() {
    let Some(m) = model() else { return };
    let (reused, tokens, suffix) = two_chunks(m);
    assert_eq!((reused.shape.tokens, reused.meta.first_position), (128, 0));
    let vocab = m.config().vocab;
    // Full reuse: the suffix on the placed caches as they are.
    let reuse = m.forward_with_cache(&reused, &suffix).unwrap();
    let none = m
        .blend(&reused, None, &tokens, &suffix, &Recompute::Fixed(vec![]))
        .unwrap();
    assert!(
        rel(&none.logits, &reuse) < 1e-4,
        "{}",
        rel(&none.logits, &reuse)
    );
    let zero = SelectParams {
        ratio: 0.0,
        first_ratio: 0.0,
        ..SelectParams::DEFAULT
    };
    let sel0 = m
        .blend(&reused, None, &tokens, &suffix, &Recompute::Select(zero))
        .unwrap();
    assert!(rel(&sel0.logits, &reuse) < 1e-4);
    // The first layer is recomputed in full (its K/V equal the reused ones to rounding).
    assert_eq!(sel0.recomputed[0].len(), 128);
    assert!(sel0.recomputed[1..].iter().all(|r| r.is_empty()));
    // Full recompute: a prefill of everything.
    let full = m.forward(&[&tokens[..], &suffix].concat()).unwrap();
    let full = &full[128 * vocab..];
    let all = SelectParams {
        ratio: 1.0,
        first_ratio: 1.0,
        ..SelectParams::DEFAULT
    };
    let sel1 = m
        .blend(&reused, None, &tokens, &suffix, &Recompute::Select(all))
        .unwrap();
    assert!(
        rel(&sel1.logits, full) < 1e-4,
        "{}",
        rel(&sel1.logits, full)
    );
    assert!(sel1.recomputed.iter().all(|r| r.len() == 128));
    // The reused caches differ from a full prefill: full reuse is measurably off.
    assert!(rel(&reuse, full) > 1e-3);
    // CacheBlend at the default 15% lands in between, narrowing as it goes.
    let cb = m
        .blend(
            &reused,
            None,
            &tokens,
            &suffix,
            &Recompute::Select(SelectParams::DEFAULT),
        )
        .unwrap();
    let counts: Vec<usize> = cb.recomputed.iter().map(|r| r.len()).collect();
    assert_eq!(
        (counts[0], counts[1]),
        (128, 26),
        "all, then 20% of 128 rounded up"
    );
    assert_eq!(counts[29], 20, "15% of 128, rounded up");
    assert!(counts.windows(2).all(|w| w[0] >= w[1]));
    assert!(
        cb.flops < 0.5 * sel1.flops,
        "{} of {}",
        cb.flops,
        sel1.flops
    );
    // A coding error is taken out of the deviations: none changes nothing; a large one on the
    // tokens picked changes the pick; one for another cache is refused.
    let how = Recompute::Select(SelectParams::DEFAULT);
    let mut error = codec_core::CodingError::zeros(reused.shape);
    let same = m
        .blend(&reused, Some(&error), &tokens, &suffix, &how)
        .unwrap();
    assert_eq!(same.recomputed, cb.recomputed);
    for &t in &cb.recomputed[1] {
        let heads = error.kv_heads as usize;
        for l in error.k.iter_mut().chain(error.v.iter_mut()) {
            l[t as usize * heads..][..heads].fill(1e9);
        }
    }
    let moved = m
        .blend(&reused, Some(&error), &tokens, &suffix, &how)
        .unwrap();
    assert!(moved.recomputed[1]
        .iter()
        .all(|t| !cb.recomputed[1].contains(t)));
    let short = codec_core::CodingError::zeros(codec_core::KvShape {
        tokens: 127,
        ..reused.shape
    });
    let refused = m.blend(&reused, Some(&short), &tokens, &suffix, &how);
    assert!(refused.is_err_and(|e| e.to_string().contains("127 tokens")));
}

#[test]
fn time_prefill_times_a_prefill_and_refuses_what_prefill_refuses() {
    let Some(m) = model() else { return };
    let s = m.time_prefill(32).unwrap();
    assert!(s.is_finite() && s > 0.0, "{s}");
    // Checked before any layer runs, as prefill checks its tokens.
    assert!(m.time_prefill(0).is_err());
    assert!(m.time_prefill(m.config().context + 1).is_err());
    // Refused before any id is made (this count's ids would not fit in memory).
    let e = m.time_prefill(usize::MAX).unwrap_err().to_string();
    assert!(e.contains("is not in 1..=8192"), "{e}");
}
