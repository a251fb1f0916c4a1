//! Attention metrics and minmax baselines, checked against a slow f64 reference and against the
//! figures published with the fixtures.

use std::path::PathBuf;
use std::time::Instant;

use codec_core::attention::Heads;
use half::f16;
use kvc_io::metrics::{
    attention_error, attention_output, minmax_baselines, minmax_quantize, rel_error, rel_error_f64,
};
use kvc_io::{load_dump, Dump};

fn sample() -> PathBuf {
    kvc_io::fixtures::sample()
}

fn heads(q_heads: usize, kv_heads: usize, head_dim: usize) -> Heads {
    Heads {
        q_heads,
        kv_heads,
        head_dim,
    }
}

/// Straightforward causal attention in f64: `[n_q, q_heads, d]`.
fn reference_attention(d: &Dump, layer: usize, k: &[f32], v: &[f32]) -> Vec<f64> {
    let q = &d.q.as_ref().unwrap()[layer];
    let s = d.kv.shape;
    let (hk, hd) = (s.kv_heads as usize, s.head_dim as usize);
    let hq = d.q_heads;
    let n_q = q.len() / (hq * hd);
    let mut out = vec![0.0f64; n_q * hq * hd];
    for i in 0..n_q {
        let p = d.q_start as usize + i;
        for h in 0..hq {
            let g = h / (hq / hk);
            let qv = &q[(i * hq + h) * hd..][..hd];
            let scores: Vec<f64> = (0..=p)
                .map(|t| {
                    let kv = &k[(t * hk + g) * hd..][..hd];
                    let dot: f64 = qv.iter().zip(kv).map(|(a, b)| *a as f64 * *b as f64).sum();
                    dot / (hd as f64).sqrt()
                })
                .collect();
            let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = scores.iter().map(|x| (x - m).exp()).collect();
            let z: f64 = w.iter().sum();
            let o = &mut out[(i * hq + h) * hd..][..hd];
            for (t, wt) in w.iter().enumerate() {
                let vv = &v[(t * hk + g) * hd..][..hd];
                for (oj, vj) in o.iter_mut().zip(vv) {
                    *oj += wt / z * *vj as f64;
                }
            }
        }
    }
    out
}

fn rel64(a: &[f64], b: &[f64]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
    let den: f64 = a.iter().map(|x| x * x).sum();
    (num / den).sqrt()
}

fn rel32(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).powi(2))
        .sum();
    let den: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum();
    (num / den).sqrt()
}

/// Independent per-row minmax with f16 min and scale.
fn reference_minmax(x: &[f32], row: usize, bits: u32) -> Vec<f32> {
    let levels = (2f64).powi(bits as i32) - 1.0;
    let mut out = Vec::new();
    for r in x.chunks(row) {
        let lo = r.iter().fold(f32::MAX, |a, b| a.min(*b));
        let hi = r.iter().fold(f32::MIN, |a, b| a.max(*b));
        let mn = f16::from_f32(lo).to_f32() as f64;
        let sc = f16::from_f32(((hi as f64 - mn) / levels) as f32).to_f32() as f64;
        for &v in r {
            let q = if sc > 0.0 {
                ((v as f64 - mn) / sc).round().clamp(0.0, levels)
            } else {
                0.0
            };
            out.push((mn + q * sc) as f32);
        }
    }
    out
}

fn close(a: f64, b: f64, rel: f64) -> bool {
    (a - b).abs() <= rel * b.abs()
}

#[test]
fn attention_matches_f64_reference() {
    let d = load_dump(&sample()).unwrap();
    for layer in [0usize, 13, 29] {
        let k = d.kv.k[layer].to_f32_vec();
        let v = d.kv.v[layer].to_f32_vec();
        let fast = attention_output(&d.q.as_ref().unwrap()[layer], d.heads(), d.q_start, &k, &v);
        let slow = reference_attention(&d, layer, &k, &v);
        let err = rel64(&slow, &fast);
        assert!(
            err < 1e-5,
            "layer {layer}: f32 vs f64 attention differ by {err}"
        );
    }
}

#[test]
fn attention_is_causal_and_uses_gqa_mapping() {
    let d = load_dump(&sample()).unwrap();
    let s = d.kv.shape;
    let (t, hk, hd) = (s.tokens as usize, s.kv_heads as usize, s.head_dim as usize);
    let q = &d.q.as_ref().unwrap()[5];
    let k = d.kv.k[5].to_f32_vec();
    let v = d.kv.v[5].to_f32_vec();
    let run = |k: &[f32], v: &[f32]| attention_output(q, d.heads(), d.q_start, k, v);
    let base = run(&k, &v);
    // Changing the last token only affects the last query.
    let mut v2 = v.clone();
    for x in &mut v2[(t - 1) * hk * hd..] {
        *x += 1.0;
    }
    let out = run(&k, &v2);
    let row = d.q_heads * hd;
    let n_q = d.n_q();
    assert_eq!(&out[..(n_q - 1) * row], &base[..(n_q - 1) * row]);
    assert_ne!(&out[(n_q - 1) * row..], &base[(n_q - 1) * row..]);
    // Changing KV head 2 only affects query heads 6..9.
    let mut v3 = v.clone();
    for tok in 0..t {
        for x in &mut v3[(tok * hk + 2) * hd..][..hd] {
            *x += 1.0;
        }
    }
    let out = run(&k, &v3);
    for i in 0..n_q {
        for h in 0..d.q_heads {
            let a = &out[(i * d.q_heads + h) * hd..][..hd];
            let b = &base[(i * d.q_heads + h) * hd..][..hd];
            if h < 6 {
                assert_eq!(a, b, "query {i} head {h}");
            } else {
                // Adding 1 to every value adds exactly 1 to the output (weights sum to 1).
                for (x, y) in a.iter().zip(b) {
                    assert!((x - y - 1.0).abs() < 1e-4, "query {i} head {h}");
                }
            }
        }
    }
    // Identical inputs give zero attention error.
    let e = attention_error(q, d.heads(), d.q_start, (&k, &v), (&k, &v));
    assert_eq!(e, 0.0);
}

#[test]
fn baselines_match_reference_on_sample() {
    let d = load_dump(&sample()).unwrap();
    let s = d.kv.shape;
    let bits = [8u32, 4, 3];
    let rows = minmax_baselines(&d, &bits);
    assert_eq!(rows.len(), 3);

    let row = s.head_dim as usize;
    let layers = s.layers as usize;
    let mut want = [[0.0f64; 3]; 3]; // [bits][k, v, attn]
    for l in 0..layers {
        let k = d.kv.k[l].to_f32_vec();
        let v = d.kv.v[l].to_f32_vec();
        let out = reference_attention(&d, l, &k, &v);
        for (bi, &b) in bits.iter().enumerate() {
            let kq = reference_minmax(&k, row, b);
            let vq = reference_minmax(&v, row, b);
            want[bi][0] += rel32(&k, &kq) / layers as f64;
            want[bi][1] += rel32(&v, &vq) / layers as f64;
            want[bi][2] += rel64(&out, &reference_attention(&d, l, &kq, &vq)) / layers as f64;
        }
    }
    for (bi, r) in rows.iter().enumerate() {
        eprintln!(
            "{}: {:.2} bpe  attn {:.4} (ref {:.4})  K {:.4} (ref {:.4})  V {:.4} (ref {:.4})",
            r.name,
            r.bits_per_element,
            r.attn,
            want[bi][2],
            r.k_rel,
            want[bi][0],
            r.v_rel,
            want[bi][1]
        );
        assert_eq!(r.name, format!("minmax int{}", bits[bi]));
        assert_eq!(r.bits_per_element, bits[bi] as f64 + 0.5);
        assert!(close(r.k_rel, want[bi][0], 2e-3), "{r:?} vs {:?}", want[bi]);
        assert!(close(r.v_rel, want[bi][1], 2e-3), "{r:?} vs {:?}", want[bi]);
        assert!(close(r.attn, want[bi][2], 5e-3), "{r:?} vs {:?}", want[bi]);
    }
    // More bits, less error.
    assert!(rows[0].attn < rows[1].attn && rows[1].attn < rows[2].attn);
    assert!(rows[0].k_rel < rows[1].k_rel && rows[1].k_rel < rows[2].k_rel);
}

#[test]
fn minmax_quantize_matches_reference() {
    let d = load_dump(&sample()).unwrap();
    let k = d.kv.k[3].to_f32_vec();
    for bits in [3u32, 4, 8] {
        let a = minmax_quantize(&k, 64, bits);
        let b = reference_minmax(&k, 64, bits);
        // Elements may differ only at rounding ties (f32 vs f64 division, ties-to-even vs
        // ties-away), by one quantization step, and rarely.
        let differ = a.iter().zip(&b).filter(|(x, y)| x != y).count();
        eprintln!("bits {bits}: {differ} of {} differ", a.len());
        assert!(
            differ * 1000 < a.len(),
            "bits {bits}: {differ} elements differ"
        );
        let e = rel_error(&k, &a);
        assert!((e - rel32(&k, &b)).abs() < 1e-3 * e, "bits {bits}");
    }
}

#[test]
fn baselines_match_published_figures_on_2048_fixture() {
    let Some(path) = kvc_io::fixtures::shared("smollm2-gpl3-2048.safetensors") else {
        eprintln!("note: ../shared/fixtures/smollm2-gpl3-2048.safetensors absent, skipping");
        return;
    };
    let d = load_dump(&path).unwrap();
    let t0 = Instant::now();
    let rows = minmax_baselines(&d, &[8, 4, 3]);
    eprintln!("minmax_baselines on 2048 tokens: {:?}", t0.elapsed());
    // (bpe, attn, K, V) from the fixtures' README.
    let published = [
        (8.50, 0.0123, 0.0075, 0.0059),
        (4.50, 0.211, 0.128, 0.101),
        (3.50, 0.461, 0.274, 0.216),
    ];
    for (r, p) in rows.iter().zip(published) {
        eprintln!(
            "{}: {:.2} bpe  attn {:.4}  K {:.4}  V {:.4}",
            r.name, r.bits_per_element, r.attn, r.k_rel, r.v_rel
        );
        assert_eq!(r.bits_per_element, p.0);
        assert!(close(r.attn, p.1, 0.10), "{r:?} vs {p:?}");
        assert!(close(r.k_rel, p.2, 0.10), "{r:?} vs {p:?}");
        assert!(close(r.v_rel, p.3, 0.10), "{r:?} vs {p:?}");
    }
}

#[test]
fn rel_error_basics() {
    assert_eq!(rel_error(&[3.0, 4.0], &[3.0, 4.0]), 0.0);
    assert!((rel_error(&[3.0, 4.0], &[0.0, 4.0]) - 0.6).abs() < 1e-12);
    assert_eq!(rel_error(&[0.0], &[0.0]), 0.0);
    assert!(rel_error(&[0.0], &[1.0]).is_infinite());
    assert_eq!(rel_error_f64(&[3.0, 4.0], &[3.0, 4.0]), 0.0);
    assert!((rel_error_f64(&[3.0, 4.0], &[0.0, 4.0]) - 0.6).abs() < 1e-12);
    assert_eq!(rel_error_f64(&[0.0], &[0.0]), 0.0);
    assert!(rel_error_f64(&[0.0], &[1.0]).is_infinite());
}

/// Straightforward f64 attention for cross-checking odd shapes.
#[allow(clippy::too_many_arguments)]
fn naive(
    q: &[f32],
    n_q: usize,
    hq: usize,
    k: &[f32],
    v: &[f32],
    hk: usize,
    d: usize,
    q_start: usize,
) -> Vec<f64> {
    let mut out = vec![0.0f64; n_q * hq * d];
    for i in 0..n_q {
        for h in 0..hq {
            let g = h / (hq / hk);
            let qv = &q[(i * hq + h) * d..][..d];
            let s: Vec<f64> = (0..=q_start + i)
                .map(|t| {
                    let kv = &k[(t * hk + g) * d..][..d];
                    let dot: f64 = qv.iter().zip(kv).map(|(a, b)| (a * b) as f64).sum();
                    dot / (d as f64).sqrt()
                })
                .collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
            for (t, x) in s.iter().enumerate() {
                let wt = (x - m).exp() / z;
                for j in 0..d {
                    out[(i * hq + h) * d + j] += wt * v[(t * hk + g) * d + j] as f64;
                }
            }
        }
    }
    out
}

#[test]
fn odd_shapes_match_naive() {
    // head_dim not a multiple of 8, group sizes 1..3, blocks not multiples of 4, few tokens.
    for &(n_q, hq, hk, d, tokens, q_start) in &[
        (1usize, 1usize, 1usize, 1usize, 1usize, 0usize),
        (3, 3, 3, 5, 4, 1),
        (5, 6, 2, 13, 9, 4),
        (2, 4, 1, 8, 20, 18),
        (7, 9, 3, 64, 33, 26),
    ] {
        let f =
            |n: usize, a: f32| -> Vec<f32> { (0..n).map(|i| (i as f32 * a).sin() * 3.0).collect() };
        let q = f(n_q * hq * d, 0.71);
        let k = f(tokens * hk * d, 0.37);
        let v = f(tokens * hk * d, 0.13);
        let fast = attention_output(&q, heads(hq, hk, d), q_start as u64, &k, &v);
        let slow = naive(&q, n_q, hq, &k, &v, hk, d, q_start);
        let e = rel_error_f64(&slow, &fast);
        assert!(e < 1e-5, "{n_q} {hq} {hk} {d} {tokens} {q_start}: {e}");
    }
}

#[test]
fn minmax_exact_on_grid_and_bounded() {
    // Values on the quantization grid come back exactly.
    let x: Vec<f32> = (0..16).map(|i| i as f32 * 0.5).collect();
    assert_eq!(minmax_quantize(&x, 16, 4), x);
    // Error at most half a step (plus f16 rounding of min/scale), constant groups exact.
    let y: Vec<f32> = (0..100)
        .map(|i| ((i * 37) % 101) as f32 / 7.0 - 3.0)
        .collect();
    for bits in [3u32, 4, 8] {
        let r = minmax_quantize(&y, 10, bits);
        for (c, rc) in y.chunks(10).zip(r.chunks(10)) {
            let lo = c.iter().cloned().fold(f32::INFINITY, f32::min);
            let hi = c.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let step = (hi - lo) / ((1 << bits) - 1) as f32;
            for (a, b) in c.iter().zip(rc) {
                assert!((a - b).abs() <= 0.5 * step + 2e-3 * (hi - lo) + 1e-3);
            }
        }
    }
    assert_eq!(minmax_quantize(&[1.25; 5], 4, 3), vec![1.25; 5]);
}

#[test]
fn attention_single_key_and_causality() {
    // One KV head, two query heads, head_dim 2, 3 tokens.
    let k = [1.0, 0.0, 0.0, 1.0, 5.0, 5.0];
    let v = [1.0, 2.0, 3.0, 4.0, 100.0, 100.0];
    let q = [0.3, -0.2, 1.0, 1.0];
    // Query at position 0 sees only token 0: output = v[0] for both heads.
    let out = attention_output(&q, heads(2, 1, 2), 0, &k, &v);
    assert_eq!(out, vec![1.0, 2.0, 1.0, 2.0]);
    // At position 1, equal scores give the mean of v[0] and v[1]; token 2 is never seen.
    let q = [0.5, 0.5];
    let out = attention_output(&q, heads(1, 1, 2), 1, &k, &v);
    assert!((out[0] - 2.0).abs() < 1e-6 && (out[1] - 3.0).abs() < 1e-6);
}
