//! CacheBlend's loading controller (paper §5.1): the recompute ratio and the storage tier of a
//! request, so that recomputing the selected tokens of a layer hides behind loading the next
//! layer's KV, or the other way round.
//!
//! Per layer, recomputing a share `r` of the tokens takes `r * prefill_s / layers`
//! (`T_recompute`), and loading the layer's stored KV takes `layer_bytes / throughput`
//! (`T_load`). The ratio is `max(r*, r where T_recompute = T_load)` (at most 1): when loading is
//! slow, recomputing more costs nothing. The tier is the cheapest whose `T_load` stays under
//! `T_recompute(r*)`.
//!
//! ```
//! use codec_core::blend::plan::{plan, Request, Tier};
//!
//! // The paper's Llama-7B example: 4K tokens, 15% recomputed in 3 ms per layer, 16 ms to load
//! // a layer (64 MiB of fp16 KV) from an NVMe SSD.
//! let req = Request { prefill_s: 32.0 * 0.020, layers: 32, layer_bytes: 64.0 * 1048576.0, min_ratio: 0.15 };
//! let nvme = Tier { name: "nvme", gb_per_s: 4.194304, cost_per_gb: 0.1 };
//! let ram = Tier { name: "ram", gb_per_s: 64.0, cost_per_gb: 3.0 };
//! let p = plan(&req, &[nvme, ram])?;
//! assert_eq!(p.tier, 1); // the SSD would delay the request: only RAM hides 3 ms
//! assert!((req.load_s(&nvme) - 0.016).abs() < 1e-9);
//! assert!((req.ratio(&nvme) - 0.8).abs() < 1e-9); // from the SSD, 80% is free
//! # Ok::<(), codec_core::blend::BlendError>(())
//! ```

use super::BlendError;

/// A storage tier KV caches can be loaded from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Tier<'a> {
    /// Its name.
    pub name: &'a str,
    /// Read throughput, GB/s (10^9 bytes per second).
    pub gb_per_s: f64,
    /// Cost of keeping a GB there.
    pub cost_per_gb: f64,
}

/// What the controller knows of a request.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Request {
    /// Seconds to prefill the whole context with the model (`Prefill(LLM, L)`, profiled on the
    /// runner).
    pub prefill_s: f64,
    /// The model's layers.
    pub layers: u32,
    /// Bytes of one layer's stored K and V for the context (the codec's actual bytes at the
    /// chosen level).
    pub layer_bytes: f64,
    /// The smallest ratio whose quality drop is negligible (`r*`, 0.15 in the paper).
    pub min_ratio: f64,
}

impl Request {
    /// Checks that every figure is finite and in range.
    pub fn check(&self) -> Result<(), BlendError> {
        let pos = |x: f64| x.is_finite() && x > 0.0;
        let ok = pos(self.prefill_s)
            && self.layers > 0
            && self.layer_bytes.is_finite()
            && self.layer_bytes >= 0.0
            && (0.0..=1.0).contains(&self.min_ratio);
        if !ok {
            return Err(BlendError::Plan {
                reason: "prefill time and layers must be positive, layer bytes at least 0, the \
                         minimal ratio within 0..=1",
            });
        }
        Ok(())
    }

    /// Seconds to recompute a share `ratio` of the tokens of one layer.
    pub fn recompute_s(&self, ratio: f64) -> f64 {
        ratio * self.prefill_s / f64::from(self.layers)
    }

    /// Seconds to load one layer's KV from `tier`.
    pub fn load_s(&self, tier: &Tier<'_>) -> f64 {
        self.layer_bytes / (tier.gb_per_s * 1e9)
    }

    /// The ratio for a cache loaded from `tier`: `max(r*, r where T_recompute = T_load)`, at
    /// most 1.
    pub fn ratio(&self, tier: &Tier<'_>) -> f64 {
        let even = self.load_s(tier) / self.recompute_s(1.0);
        even.max(self.min_ratio).min(1.0)
    }
}

/// The controller's decision.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Plan {
    /// Index of the chosen tier.
    pub tier: usize,
    /// The recompute ratio.
    pub ratio: f64,
    /// Seconds to recompute that ratio of one layer.
    pub recompute_s: f64,
    /// Seconds to load one layer from the tier.
    pub load_s: f64,
    /// Whether loading hides behind recomputing `r*` (false: no tier could, so the fastest was
    /// taken and loading adds `load_s - recompute_s` per layer).
    pub hidden: bool,
}

/// The cheapest tier whose load time stays under the recompute time at `r*` (ties: the first
/// listed), or the fastest tier when none does, with its ratio.
pub fn plan(req: &Request, tiers: &[Tier<'_>]) -> Result<Plan, BlendError> {
    req.check()?;
    let usable =
        |t: &Tier<'_>| t.gb_per_s.is_finite() && t.gb_per_s > 0.0 && t.cost_per_gb.is_finite();
    if !tiers.iter().all(usable) {
        return Err(BlendError::Plan {
            reason: "every tier needs a positive, finite throughput and a finite cost",
        });
    }
    let budget = req.recompute_s(req.min_ratio);
    let hiding = (0..tiers.len())
        .filter(|&i| req.load_s(&tiers[i]) <= budget)
        .min_by(|&a, &b| tiers[a].cost_per_gb.total_cmp(&tiers[b].cost_per_gb));
    let fastest = (0..tiers.len()).max_by(|&a, &b| {
        // The first of equally fast tiers wins: compare reversed indices on ties.
        (tiers[a].gb_per_s.total_cmp(&tiers[b].gb_per_s)).then(b.cmp(&a))
    });
    let (tier, hidden) = match (hiding, fastest) {
        (Some(i), _) => (i, true),
        (None, Some(i)) => (i, false),
        (None, None) => {
            return Err(BlendError::Plan {
                reason: "no storage tier given",
            })
        }
    };
    let ratio = req.ratio(&tiers[tier]);
    Ok(Plan {
        tier,
        ratio,
        recompute_s: req.recompute_s(ratio),
        load_s: req.load_s(&tiers[tier]),
        hidden,
    })
}
