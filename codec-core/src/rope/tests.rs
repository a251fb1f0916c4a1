use super::*;
use crate::kv::{Dtype, KvMeta, KvShape, Tensor};
use proptest::prelude::*;

fn rope(style: RopeStyle, theta: f32, scaling: f32) -> Rope {
    Rope {
        theta,
        style,
        scaling,
        k_pre_rope: false,
    }
}

/// One head `v` (pre-rotary) rotated to `pos` in f64.
fn at(v: &[f32], pos: f64, r: &Rope) -> Vec<f64> {
    let mut h: Vec<f64> = v.iter().map(|&x| x as f64).collect();
    rotate(&mut h, pos, r);
    h
}

fn close(a: &[f32], b: &[f64], tol: f64) -> Result<(), TestCaseError> {
    let norm = b.iter().map(|x| x * x).sum::<f64>().sqrt().max(1e-30);
    let err = a
        .iter()
        .zip(b)
        .map(|(&x, y)| (x as f64 - y).powi(2))
        .sum::<f64>()
        .sqrt();
    prop_assert!(err / norm < tol, "relative error {}", err / norm);
    Ok(())
}

fn style() -> impl Strategy<Value = RopeStyle> {
    prop_oneof![Just(RopeStyle::NeoX), Just(RopeStyle::GptJ)]
}

proptest! {
    #[test]
    fn shift_equals_rotating_from_scratch(
        style in style(),
        half in 1usize..80,
        theta in prop_oneof![Just(10_000.0f32), Just(100_000.0), Just(500_000.0), 2.0f32..1e6],
        scaling in prop_oneof![Just(1.0f32), 0.25f32..8.0],
        p in 0u64..20_000,
        q in 0u64..20_000,
        seed in any::<u64>(),
    ) {
        let r = rope(style, theta, scaling);
        let d = 2 * half;
        let mut s = seed | 1;
        let x: Vec<f32> = (0..d).map(|_| { s ^= s << 13; s ^= s >> 7; s ^= s << 17; (s >> 40) as f32 / 8e6 - 1.0 }).collect();
        let mut k: Vec<f32> = at(&x, p as f64, &r).iter().map(|&v| v as f32).collect();
        Shift::new(&r, d as u32, q as i64 - p as i64).unwrap().apply(&mut k);
        close(&k, &at(&x, q as f64, &r), 1e-5)?;
    }

    /// Heads turned by one table of rotations are turned as each turned alone by the pairs'
    /// own sines and cosines, bit for bit; unpaired or odd heads stay as they are.
    #[test]
    fn a_table_of_rotations_turns_heads_as_each_pair_alone(
        style in prop_oneof![style(), Just(RopeStyle::None)],
        d in 1usize..40,
        heads in 1usize..5,
        pos in prop_oneof![Just(0.0f64), -1e5f64..1e5],
        x in proptest::collection::vec(-4.0f64..4.0, 160),
    ) {
        let r = rope(style, 500_000.0, 1.0);
        let x = &x[..d * heads];
        let mut each = x.to_vec();
        for h in each.chunks_exact_mut(d) {
            for j in 0..d / 2 {
                let (Some((a, b)), true) = (pair(style, d, j), d % 2 == 0) else { break };
                let (s, c) = pair_sin_cos(&r, d, j, pos);
                let (x1, x2) = (h[a], h[b]);
                h[a] = x1 * c - x2 * s;
                h[b] = x2 * c + x1 * s;
            }
        }
        let rotations = pair_rotations(&r, d, pos);
        let mut table = x.to_vec();
        table.chunks_exact_mut(d).for_each(|h| rotate_by(h, style, &rotations));
        let mut one = x.to_vec();
        one.chunks_exact_mut(d).for_each(|h| rotate(h, pos, &r));
        let bits = |v: &[f64]| v.iter().map(|y| y.to_bits()).collect::<Vec<_>>();
        prop_assert_eq!(bits(&table), bits(&each));
        prop_assert_eq!(bits(&one), bits(&each));
        prop_assert_eq!(rotations.is_empty(), d % 2 == 1 || style == RopeStyle::None);
    }

    #[test]
    fn shifts_compose_and_invert(
        style in style(),
        half in 1usize..64,
        a in -5000i64..5000,
        b in -5000i64..5000,
        x in proptest::collection::vec(-4.0f32..4.0, 128),
    ) {
        let r = rope(style, 100_000.0, 1.0);
        let d = 2 * half;
        let x = &x[..d];
        let shift = |v: &mut [f32], n| Shift::new(&r, d as u32, n).unwrap().apply(v);
        let (mut two, mut one) = (x.to_vec(), x.to_vec());
        shift(&mut two, a);
        shift(&mut two, b);
        shift(&mut one, a + b);
        let one64: Vec<f64> = one.iter().map(|&v| v as f64).collect();
        close(&two, &one64, 1e-5)?;
        shift(&mut two, -(a + b));
        let x64: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        close(&two, &x64, 1e-5)?;
    }
}

#[test]
fn zero_shift_is_the_identity_and_heads_are_independent() {
    let r = rope(RopeStyle::GptJ, 10_000.0, 1.0);
    let x: Vec<f32> = (0..3 * 8).map(|i| i as f32 - 7.5).collect();
    let mut k = x.clone();
    Shift::new(&r, 8, 0).unwrap().apply(&mut k);
    assert_eq!(k, x);
    // Three heads shifted at once equal each head shifted alone.
    let s = Shift::new(&r, 8, 77).unwrap();
    let mut all = x.clone();
    s.apply(&mut all);
    for (h, got) in x.chunks(8).zip(all.chunks(8)) {
        let mut one = h.to_vec();
        s.apply(&mut one);
        assert_eq!(one, got);
    }
}

#[test]
fn pre_rotary_keys_rotate_to_their_positions() {
    let r = rope(RopeStyle::NeoX, 100_000.0, 2.0);
    let (heads, d, tokens) = (3usize, 16usize, 5usize);
    let x: Vec<f32> = (0..tokens * heads * d)
        .map(|i| ((i * 37) % 23) as f32 / 7.0 - 1.5)
        .collect();
    let mut k = x.clone();
    rotate_to_positions(&mut k, heads, 1000, &r, d as u32).unwrap();
    for (i, (tok, got)) in x
        .chunks(heads * d)
        .zip(k.chunks(heads * d))
        .enumerate()
    {
        for (h, g) in tok.chunks(d).zip(got.chunks(d)) {
            let want = at(h, (1000 + i) as f64, &r);
            close(g, &want, 1e-6).unwrap();
        }
    }
}

#[test]
fn refusals() {
    let none = rope(RopeStyle::None, 10_000.0, 1.0);
    assert_eq!(Shift::new(&none, 8, 1), Err(RopeError::NoRotary));
    let r = rope(RopeStyle::NeoX, 10_000.0, 1.0);
    assert_eq!(Shift::new(&r, 7, 1), Err(RopeError::OddHeadDim { head_dim: 7 }));
    for (theta, scaling) in [(1.0, 1.0), (f32::NAN, 1.0), (1e4, 0.0), (1e4, f32::INFINITY)] {
        let bad = rope(RopeStyle::GptJ, theta, scaling);
        assert!(matches!(Shift::new(&bad, 8, 1), Err(RopeError::Settings { .. })));
    }
    assert!(matches!(Shift::new(&r, 8, i64::MIN), Err(RopeError::Position { .. })));
    let mut k = [0.0f32; 8];
    assert!(matches!(
        rotate_to_positions(&mut k, 1, u64::MAX, &r, 8),
        Err(RopeError::Position { .. })
    ));
    for e in [RopeError::NoRotary, RopeError::OddHeadDim { head_dim: 7 }] {
        assert!(!alloc::format!("{e}").is_empty());
    }
}

fn cache(pre_rope: bool) -> KvCache {
    let shape = KvShape {
        layers: 2,
        kv_heads: 2,
        head_dim: 8,
        tokens: 4,
    };
    let n = 4 * 2 * 8;
    let t = |o: usize| {
        let mut t = Tensor::zeros(Dtype::F16, n);
        let v: Vec<f32> = (0..n).map(|i| ((i + o) % 13) as f32 / 4.0 - 1.5).collect();
        t.as_mut().write_f32(0, &v);
        t
    };
    KvCache {
        shape,
        meta: KvMeta {
            rope: Rope {
                k_pre_rope: pre_rope,
                ..rope(RopeStyle::NeoX, 10_000.0, 1.0)
            },
            first_position: 100,
            ..KvMeta::default()
        },
        k: alloc::vec![t(0), t(1)],
        v: alloc::vec![t(2), t(3)],
    }
}

#[test]
fn caches_move_their_keys_not_their_values() {
    let orig = cache(false);
    let mut c = orig.clone();
    shift_cache(&mut c, 40).unwrap();
    assert_eq!(c.meta.first_position, 40);
    assert_eq!(c.v, orig.v);
    assert_ne!(c.k, orig.k);
    shift_cache(&mut c, 100).unwrap();
    for (a, b) in c.k.iter().zip(&orig.k) {
        let (a, b) = (a.to_f32_vec(), b.to_f32_vec());
        // Two f16 roundings.
        assert!(a.iter().zip(&b).all(|(x, y)| (x - y).abs() < 4e-3));
    }
    // Pre-rotary keys carry no position: only the metadata moves.
    let orig = cache(true);
    let mut c = orig.clone();
    shift_cache(&mut c, 7).unwrap();
    assert_eq!((c.k, c.meta.first_position), (orig.k, 7));
    let mut c = cache(false);
    assert!(shift_cache(&mut c, u64::MAX - 2).is_err());
    assert_eq!(c, cache(false));
}
