//! `BlockCache` against a naive reference model on random traces.
//!
//! The reference keeps the whole access history and recomputes everything from it at each
//! eviction, with no incremental state to get wrong:
//!
//! * the resident set is a plain list of block ids, each with the history index at which it was
//!   (last) inserted;
//! * a block's recency is the index of its last occurrence in the history;
//! * a block's LFU count is the number of its occurrences in the history since its insertion.
use pq_core::cache::{blocks_of, BlockCache, Policy};
use proptest::prelude::*;

mod common;
use common::proptest_config;

struct Reference {
    capacity: usize,
    policy: Policy,
    history: Vec<u32>,
    /// (block, history index of the access that inserted it)
    resident: Vec<(u32, usize)>,
    hits: u64,
    misses: u64,
}

impl Reference {
    fn new(capacity: usize, policy: Policy) -> Self {
        Reference {
            capacity,
            policy,
            history: Vec::new(),
            resident: Vec::new(),
            hits: 0,
            misses: 0,
        }
    }

    fn last_use(&self, block: u32) -> usize {
        self.history.iter().rposition(|&b| b == block).unwrap()
    }

    fn uses_since(&self, block: u32, inserted: usize) -> usize {
        self.history[inserted..]
            .iter()
            .filter(|&&b| b == block)
            .count()
    }

    fn access(&mut self, block: u32) -> bool {
        let hit = self.resident.iter().any(|&(b, _)| b == block);
        if hit {
            self.hits += 1;
            self.history.push(block);
            return true;
        }
        self.misses += 1;
        if self.capacity > 0 {
            if self.resident.len() == self.capacity {
                // Pick the victim by scanning all resident blocks for the smallest key.
                let mut victim = 0;
                let mut best: Option<(usize, usize, u32)> = None;
                for (i, &(b, inserted)) in self.resident.iter().enumerate() {
                    let key = match self.policy {
                        Policy::Lru => (0, self.last_use(b), b),
                        Policy::Lfu => (self.uses_since(b, inserted), self.last_use(b), b),
                    };
                    if best.is_none_or(|k| key < k) {
                        best = Some(key);
                        victim = i;
                    }
                }
                self.resident.remove(victim);
            }
            self.resident.push((block, self.history.len()));
        }
        self.history.push(block);
        false
    }

    fn blocks(&self) -> Vec<u32> {
        let mut b: Vec<u32> = self.resident.iter().map(|&(b, _)| b).collect();
        b.sort_unstable();
        b
    }
}

fn policy() -> impl Strategy<Value = Policy> {
    prop_oneof![Just(Policy::Lru), Just(Policy::Lfu)]
}

proptest! {
    #![proptest_config(proptest_config(Some(512)))]

    /// Single accesses: the same hit/miss sequence, resident set and counters as the reference.
    #[test]
    fn access_matches_reference(
        capacity in 0usize..7,
        policy in policy(),
        trace in prop::collection::vec(0u32..12, 0..200),
    ) {
        let mut cache = BlockCache::new(capacity, policy);
        let mut reference = Reference::new(capacity, policy);
        for (i, &block) in trace.iter().enumerate() {
            prop_assert_eq!(cache.access(block), reference.access(block), "access {}", i);
            prop_assert_eq!(cache.blocks(), reference.blocks(), "after access {}", i);
            prop_assert!(cache.len() <= capacity);
        }
        prop_assert_eq!(cache.hits(), reference.hits);
        prop_assert_eq!(cache.misses(), reference.misses);
        prop_assert_eq!(cache.hits() + cache.misses(), trace.len() as u64);
    }

    /// Decode steps: `access_step` equals accessing the step's distinct blocks in ascending
    /// order on the reference, and its (hits, misses) are that step's.
    #[test]
    fn access_step_matches_reference(
        capacity in 0usize..9,
        policy in policy(),
        steps in prop::collection::vec(prop::collection::vec(0u32..20, 0..10), 0..40),
    ) {
        let mut cache = BlockCache::new(capacity, policy);
        let mut reference = Reference::new(capacity, policy);
        for (i, step) in steps.iter().enumerate() {
            let mut distinct = step.clone();
            distinct.sort();
            distinct.dedup();
            let hits = distinct.iter().filter(|&&b| reference.access(b)).count();
            prop_assert_eq!(cache.access_step(step), (hits, distinct.len() - hits), "step {}", i);
            prop_assert_eq!(cache.blocks(), reference.blocks(), "after step {}", i);
        }
        let total = reference.hits + reference.misses;
        let rate = if total == 0 { 0.0 } else { reference.hits as f64 / total as f64 };
        prop_assert_eq!(cache.hit_rate(), rate);
    }

    /// `blocks_of` is the sorted set of `t / block_tokens`.
    #[test]
    fn blocks_of_is_the_set_of_quotients(
        tokens in prop::collection::vec(any::<u32>(), 0..50),
        block_tokens in 1u32..300,
    ) {
        let got = blocks_of(&tokens, block_tokens).unwrap();
        let want: std::collections::BTreeSet<u32> =
            tokens.iter().map(|t| t / block_tokens).collect();
        prop_assert_eq!(got, want.into_iter().collect::<Vec<_>>());
    }
}
