use super::*;
use proptest::prelude::*;

fn params(ratio: f32, first_ratio: f32, narrow_layers: u32) -> SelectParams {
    SelectParams {
        ratio,
        first_ratio,
        narrow_layers,
        ..SelectParams::DEFAULT
    }
}

proptest! {
    #[test]
    fn top_keeps_the_most_deviating_in_token_order(
        dev in proptest::collection::vec(0.0f32..10.0, 0..200),
        n in 0usize..220,
    ) {
        let cands: Vec<u32> = (0..dev.len() as u32).map(|i| 3 * i + 1).collect();
        let kept = top(&cands, &dev, n).unwrap();
        prop_assert_eq!(kept.len(), n.min(dev.len()));
        prop_assert!(kept.windows(2).all(|w| w[0] < w[1]));
        let at = |t: u32| ((t - 1) / 3) as usize;
        let least_kept = kept.iter().map(|&t| dev[at(t)]).fold(f32::INFINITY, f32::min);
        for (i, &t) in cands.iter().enumerate() {
            if !kept.contains(&t) {
                prop_assert!(dev[i] <= least_kept);
            }
        }
    }

    #[test]
    fn the_schedule_narrows_from_first_ratio_to_ratio(
        ratio in 0.0f32..=1.0,
        extra in 0.0f32..=1.0,
        narrow in 0u32..8,
        tokens in 0usize..5000,
    ) {
        let first = ratio + (1.0 - ratio) * extra;
        let p = params(ratio, first, narrow);
        prop_assert!(p.check().is_ok());
        let kept: Vec<usize> = (0..12).map(|i| p.kept(i, tokens)).collect();
        prop_assert!(kept.windows(2).all(|w| w[0] >= w[1]), "{:?}", kept);
        prop_assert!(kept.iter().all(|&k| k <= tokens));
        prop_assert_eq!(kept[11], (ratio * tokens as f32).ceil() as usize);
        if narrow > 0 {
            prop_assert_eq!(kept[0], (first * tokens as f32).ceil() as usize);
        }
    }
}

#[test]
fn filters_at_the_extremes() {
    let dev: Vec<f32> = (0..10).map(|i| (i * 7 % 10) as f32).collect();
    let mut all = Filter::new(params(1.0, 1.0, 3), 10).unwrap();
    for _ in 0..5 {
        let n = all.candidates().len();
        all.narrow(&dev[..n]).unwrap();
        assert_eq!(all.candidates(), (0..10).collect::<Vec<_>>().as_slice());
    }
    let mut none = Filter::new(params(0.0, 0.0, 0), 10).unwrap();
    none.narrow(&dev).unwrap();
    assert!(none.candidates().is_empty());
    none.narrow(&[]).unwrap();
    assert!(none.candidates().is_empty());
}

#[test]
fn deviations_per_tensor_and_norm() {
    // Two tokens of rows of 2: K differs by (3, 4) and (0, 0), V by (1, 0) and (0, -2).
    let (k0, k1) = ([3.0f32, 4.0, 1.0, 1.0], [0.0f32, 0.0, 1.0, 1.0]);
    let (v0, v1) = ([1.0f32, 0.0, 0.0, -2.0], [0.0f32; 4]);
    let (k, v) = ((&k0[..], &k1[..]), (&v0[..], &v1[..]));
    let d = |t, n| deviations(t, n, 2, k, v).unwrap();
    assert_eq!(d(Tensors::K, Norm::L2), [5.0, 0.0]);
    assert_eq!(d(Tensors::K, Norm::L1), [7.0, 0.0]);
    assert_eq!(d(Tensors::V, Norm::Max), [1.0, 2.0]);
    assert_eq!(d(Tensors::KV, Norm::L1), [8.0, 2.0]);
    assert_eq!(d(Tensors::KV, Norm::Max), [4.0, 2.0]);
    assert_eq!(d(Tensors::KV, Norm::L2), [26f32.sqrt(), 2.0]);
    // V may be left empty when only K is measured; not when it is used.
    assert!(deviations(Tensors::K, Norm::L2, 2, k, (&[], &[])).is_ok());
    assert!(matches!(
        deviations(Tensors::KV, Norm::L2, 2, k, (&v0, &v1[..3])),
        Err(BlendError::Length { .. })
    ));
}

#[test]
fn coding_error_is_taken_out_of_l2_deviations() {
    let mut dev = [5.0f32, 3.0, 0.0, 2.0];
    less_coding_error(&mut dev, &[9.0, 16.0, 0.0, 0.0]).unwrap();
    assert_eq!(dev, [4.0, 0.0, 0.0, 2.0]);
    assert!(matches!(
        less_coding_error(&mut dev, &[1.0]),
        Err(BlendError::Length { .. })
    ));
}

proptest! {
    /// A coded token's measured deviation is its true one plus independent noise of known
    /// variance: taken out, the noise no longer decides which tokens rank first.
    #[test]
    fn noisy_rows_rank_by_their_true_deviation(seed in 0u64..1000) {
        let mut s = seed * 2 + 1;
        let mut unit = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 11) as f32 / (1u64 << 53) as f32 - 0.5
        };
        // 200 tokens of 64 values: true deviations of 0.15 per value (odd tokens) or 0.05
        // (even ones); the even tokens were coded coarsely, with a uniform error of 0.25 RMS.
        let (n, row) = (200usize, 64usize);
        let mut reused = vec![0f32; n * row];
        let fresh = vec![0f32; n * row];
        let mut noise = vec![0f32; n];
        for t in 0..n {
            let (truth, sigma) = if t % 2 == 1 { (0.15, 0.0) } else { (0.05, 0.25) };
            for x in &mut reused[t * row..][..row] {
                *x = truth * if unit() < 0.0 { -1.0 } else { 1.0 } + sigma * unit() * 12f32.sqrt();
            }
            noise[t] = row as f32 * sigma * sigma;
        }
        let none: (&[f32], &[f32]) = (&[], &[]);
        let mut dev = deviations(Tensors::K, Norm::L2, row, (&reused, &fresh), none).unwrap();
        let all: Vec<u32> = (0..n as u32).collect();
        let noisy = top(&all, &dev, 50).unwrap();
        less_coding_error(&mut dev, &noise).unwrap();
        let clean = top(&all, &dev, 50).unwrap();
        // As measured, the coded tokens rank first; corrected, the truly deviating ones.
        let odd = |sel: &[u32]| sel.iter().filter(|&&t| t % 2 == 1).count();
        prop_assert!(odd(&noisy) <= 5, "{:?}", noisy);
        prop_assert!(odd(&clean) >= 40, "{:?}", clean);
    }
}

#[test]
fn a_schedule_moves_to_another_ratio() {
    let d = SelectParams::DEFAULT;
    let half = d.at_ratio(0.075);
    assert_eq!((half.ratio, half.first_ratio), (0.075, 0.1));
    assert_eq!(half.narrow_layers, d.narrow_layers);
    assert_eq!(d.at_ratio(0.9).first_ratio, 1.0);
    assert_eq!(d.at_ratio(0.0).first_ratio, 0.0);
    let single = params(0.0, 0.0, 0).at_ratio(0.3);
    assert_eq!((single.ratio, single.first_ratio), (0.3, 0.3));
    // Out of range stays out of range, for check() to refuse, and never panics.
    assert!(d.at_ratio(1.5).check().is_err());
    assert!(d.at_ratio(f32::NAN).check().is_err());
}

#[test]
fn refusals() {
    for (r, r1) in [(0.2, 0.1), (-0.1, 0.5), (0.1, 1.5), (f32::NAN, 0.5)] {
        let e = Filter::new(params(r, r1, 2), 10).unwrap_err();
        assert!(matches!(e, BlendError::Ratios { .. }), "{e}");
    }
    assert!(matches!(
        top(&[1, 2], &[0.5, f32::NAN], 1),
        Err(BlendError::NotANumber { at: 1 })
    ));
    let mut f = Filter::new(SelectParams::DEFAULT, 10).unwrap();
    assert!(matches!(
        f.narrow(&[1.0; 9]),
        Err(BlendError::Length { .. })
    ));
    assert_eq!(f.candidates().len(), 10, "a refused step changes nothing");
}

mod controller {
    use crate::blend::plan::{plan, Request, Tier};
    use crate::blend::BlendError;

    const MIB: f64 = 1048576.0;
    // An NVMe SSD at 4.19 GB/s loads 64 MiB in 16 ms (the paper's figures for Llama-7B).
    const NVME: Tier<'static> = Tier {
        name: "nvme",
        gb_per_s: 4.194304,
        cost_per_gb: 0.1,
    };
    const RAM: Tier<'static> = Tier {
        name: "ram",
        gb_per_s: 64.0,
        cost_per_gb: 3.0,
    };
    const S3: Tier<'static> = Tier {
        name: "object store",
        gb_per_s: 0.5,
        cost_per_gb: 0.02,
    };

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn llama_7b_4k_loads_slower_than_it_recomputes() {
        // 32 layers, 15% recomputed in 3 ms per layer: 20 ms per layer for all tokens. K and V
        // of 4K tokens, 32 heads of 128, fp16: 64 MiB per layer.
        let req = Request {
            prefill_s: 32.0 * 0.020,
            layers: 32,
            layer_bytes: 64.0 * MIB,
            min_ratio: 0.15,
        };
        assert!(close(req.recompute_s(0.15), 0.003));
        assert!(close(req.load_s(&NVME), 0.016));
        // From the SSD, recomputing up to 16/20 of the tokens adds no delay.
        assert!(close(req.ratio(&NVME), 0.8));
        // Only RAM hides 15% (3 ms): the SSD and the object store would delay the request.
        let p = plan(&req, &[S3, NVME, RAM]).unwrap();
        assert_eq!((p.tier, p.hidden), (2, true));
        assert!(close(p.ratio, 0.15), "{p:?}");
    }

    #[test]
    fn llama_70b_4k_recomputes_slower_than_it_loads() {
        // 80 layers, 15% in 7 ms per layer. 8 KV heads of 128, fp16, 4K tokens: 16 MiB per
        // layer, 4 ms from the SSD.
        let req = Request {
            prefill_s: 80.0 * 0.007 / 0.15,
            layers: 80,
            layer_bytes: 16.0 * MIB,
            min_ratio: 0.15,
        };
        assert!(close(req.recompute_s(0.15), 0.007));
        assert!(close(req.load_s(&NVME), 0.004));
        assert!(close(req.ratio(&NVME), 0.15));
        // The SSD hides behind the recompute and is cheaper than RAM; the object store is
        // cheaper still but too slow (33.5 ms).
        let p = plan(&req, &[RAM, NVME, S3]).unwrap();
        assert_eq!((p.tier, p.hidden), (1, true));
        assert!(close(p.recompute_s, 0.007) && close(p.load_s, 0.004));
    }

    #[test]
    fn without_a_hiding_tier_the_fastest_is_taken() {
        let req = Request {
            prefill_s: 1.0,
            layers: 10,
            layer_bytes: 1e9,
            min_ratio: 0.15,
        };
        let p = plan(&req, &[S3, NVME]).unwrap();
        assert_eq!((p.tier, p.hidden), (1, false));
        assert!(close(p.ratio, 1.0), "the ratio is capped at 1: {p:?}");
        assert!(matches!(plan(&req, &[]), Err(BlendError::Plan { .. })));
        let bad = Tier {
            gb_per_s: 0.0,
            ..NVME
        };
        assert!(plan(&req, &[bad]).is_err());
        let bad = Request { layers: 0, ..req };
        assert!(plan(&bad, &[NVME]).is_err());
    }
}
