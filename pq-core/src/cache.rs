//! A block-level cache of selected tokens, as in PQCache §3.4.
//!
//! PQCache keeps the key/value pairs it fetches for the top-k tokens in a cache on the
//! accelerator, organised by *blocks* of consecutive tokens so that the bookkeeping is per block,
//! not per token. Token `t` belongs to block `t / block_tokens` ([`blocks_of`];
//! [`DEFAULT_BLOCK_TOKENS`] = 128 as in the paper). At each decode step the blocks holding the
//! selected tokens are looked up ([`BlockCache::access_step`]); a hit needs no transfer, a miss
//! fetches the block and inserts it, evicting one block when the cache is full.
//!
//! [`BlockCache`] only models the cache structure (which blocks are resident) and counts hits
//! and misses; it stores no key/value data. It is deterministic: the same accesses give the same
//! hits, misses and evictions on every platform. Each access costs `O(capacity)` (a linear scan),
//! meant for caches of at most a few hundred blocks.

use alloc::vec::Vec;

use crate::error::PqError;

/// Tokens per block in PQCache's experiments (§4.3.4: "128 tokens per block").
pub const DEFAULT_BLOCK_TOKENS: u32 = 128;

/// The sorted, distinct ids of the blocks holding `tokens`: token `t` is in block
/// `t / block_tokens`.
///
/// Errors with [`PqError::ZeroBlockTokens`] if `block_tokens` is zero.
///
/// ```
/// # use pq_core::cache::blocks_of;
/// assert_eq!(blocks_of(&[300, 5, 129, 127, 256], 128).unwrap(), [0, 1, 2]);
/// ```
pub fn blocks_of(tokens: &[u32], block_tokens: u32) -> Result<Vec<u32>, PqError> {
    if block_tokens == 0 {
        return Err(PqError::ZeroBlockTokens);
    }
    let mut blocks: Vec<u32> = tokens.iter().map(|&t| t / block_tokens).collect();
    blocks.sort_unstable();
    blocks.dedup();
    Ok(blocks)
}

/// Which block [`BlockCache`] evicts when a miss finds it full.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Policy {
    /// Least recently used: evict the block whose last access is oldest.
    Lru,
    /// Least frequently used: evict the block with the fewest accesses since it was inserted;
    /// ties go to the least recently used block, then to the lower block id.
    Lfu,
}

/// One resident block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Slot {
    block: u32,
    /// The clock value of the block's latest access.
    last_access: u64,
    /// Accesses since the block was inserted, the inserting miss included.
    accesses: u64,
}

/// A cache of at most `capacity` blocks with LRU or LFU eviction, counting hits and misses.
///
/// # Semantics
///
/// * A logical clock starts at 0 and is incremented by every [`access`](Self::access), hit or
///   miss (also when the capacity is 0). Each access stamps the block with the new clock value,
///   so no two resident blocks share a stamp.
/// * A hit refreshes the block's stamp and adds one to its access count.
/// * A miss inserts the block with an access count of 1. If the cache already holds `capacity`
///   blocks it first evicts one:
///   - [`Policy::Lru`]: the block with the oldest stamp (least recently used);
///   - [`Policy::Lfu`]: the block with the smallest access count; ties to the oldest stamp,
///     then to the lower block id. An evicted block's count is forgotten: if it comes back it
///     starts again at 1.
/// * With `capacity == 0` every access is a miss and nothing is stored.
///
/// The last tie-break (block id) cannot be reached while stamps are distinct; it is kept so
/// that the eviction order is total even if the clock ever saturated at `u64::MAX`.
///
/// ```
/// # use pq_core::cache::{BlockCache, Policy};
/// let mut cache = BlockCache::new(2, Policy::Lfu);
/// assert_eq!(cache.access_step(&[7, 3, 7]), (0, 2)); // blocks 3 then 7: two misses
/// assert_eq!(cache.access_step(&[3]), (1, 0));
/// assert!(!cache.access(9)); // full: evicts 7 (1 access) and keeps 3 (2 accesses)
/// assert!(cache.contains(3) && !cache.contains(7));
/// assert_eq!(cache.hit_rate(), 0.25);
/// ```
#[derive(Clone, Debug)]
pub struct BlockCache {
    capacity: usize,
    policy: Policy,
    /// The resident blocks in no particular order; `slots.len() <= capacity`.
    slots: Vec<Slot>,
    clock: u64,
    hits: u64,
    misses: u64,
}

impl BlockCache {
    /// An empty cache holding at most `capacity_blocks` blocks, evicting by `policy`.
    pub fn new(capacity_blocks: usize, policy: Policy) -> Self {
        BlockCache {
            capacity: capacity_blocks,
            policy,
            slots: Vec::new(),
            clock: 0,
            hits: 0,
            misses: 0,
        }
    }

    /// The largest number of resident blocks.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The eviction policy.
    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// The number of resident blocks.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// `true` if no block is resident.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// `true` if `block` is resident. Does not count as an access.
    pub fn contains(&self, block: u32) -> bool {
        self.slots.iter().any(|s| s.block == block)
    }

    /// The resident blocks, sorted.
    pub fn blocks(&self) -> Vec<u32> {
        let mut blocks: Vec<u32> = self.slots.iter().map(|s| s.block).collect();
        blocks.sort_unstable();
        blocks
    }

    /// Accesses `block`: `true` on a hit. A miss inserts the block, evicting one first if the
    /// cache is full (see the type's docs for the order).
    pub fn access(&mut self, block: u32) -> bool {
        self.clock = self.clock.saturating_add(1);
        if let Some(slot) = self.slots.iter_mut().find(|s| s.block == block) {
            slot.last_access = self.clock;
            slot.accesses = slot.accesses.saturating_add(1);
            self.hits = self.hits.saturating_add(1);
            return true;
        }
        self.misses = self.misses.saturating_add(1);
        if self.capacity == 0 {
            return false;
        }
        let slot = Slot {
            block,
            last_access: self.clock,
            accesses: 1,
        };
        if self.slots.len() < self.capacity {
            self.slots.push(slot);
        } else {
            let victim = self.victim();
            self.slots[victim] = slot;
        }
        false
    }

    /// Accesses each distinct block of `blocks` (the blocks one decode step reads, in any order,
    /// repeats allowed) once, in ascending block order. Returns `(hits, misses)` of this step.
    pub fn access_step(&mut self, blocks: &[u32]) -> (usize, usize) {
        let mut distinct = blocks.to_vec();
        distinct.sort_unstable();
        distinct.dedup();
        let hits = distinct.iter().filter(|&&b| self.access(b)).count();
        (hits, distinct.len() - hits)
    }

    /// Index in `slots` of the block to evict; `slots` is not empty.
    fn victim(&self) -> usize {
        let key = |s: &Slot| match self.policy {
            Policy::Lru => (0, s.last_access, s.block),
            Policy::Lfu => (s.accesses, s.last_access, s.block),
        };
        let mut best = 0;
        for (i, s) in self.slots.iter().enumerate().skip(1) {
            if key(s) < key(&self.slots[best]) {
                best = i;
            }
        }
        best
    }

    /// Accesses that hit since creation or the last [`reset_stats`](Self::reset_stats).
    pub fn hits(&self) -> u64 {
        self.hits
    }

    /// Accesses that missed since creation or the last [`reset_stats`](Self::reset_stats).
    pub fn misses(&self) -> u64 {
        self.misses
    }

    /// `hits / (hits + misses)`, or 0.0 before any access.
    pub fn hit_rate(&self) -> f64 {
        let total = self.hits.saturating_add(self.misses);
        if total == 0 {
            return 0.0;
        }
        self.hits as f64 / total as f64
    }

    /// Sets the hit and miss counters to zero; the resident blocks, their access counts and the
    /// clock are kept (e.g. to measure after a warm-up).
    pub fn reset_stats(&mut self) {
        self.hits = 0;
        self.misses = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::vec;

    /// Runs `trace` and returns the hit (true) / miss (false) of every access.
    fn run(cache: &mut BlockCache, trace: &[u32]) -> Vec<bool> {
        trace.iter().map(|&b| cache.access(b)).collect()
    }

    #[test]
    fn lru_and_lfu_differ_on_a_hand_worked_trace() {
        // Capacity 2, trace 1 1 2 3 1 2.
        // LRU: 1 miss {1}; 1 hit; 2 miss {1,2}; 3 miss, evicts 1 (stamp 2 < 3) {2,3};
        //      1 miss, evicts 2 (stamp 3 < 4) {3,1}; 2 miss, evicts 3 {1,2}.
        // LFU: 1 miss {1:1}; 1 hit {1:2}; 2 miss {1:2,2:1}; 3 miss, evicts 2 (count 1 < 2)
        //      {1:2,3:1}; 1 hit {1:3,3:1}; 2 miss, evicts 3 (count 1) {1:3,2:1}.
        let trace = [1, 1, 2, 3, 1, 2];
        let mut lru = BlockCache::new(2, Policy::Lru);
        assert_eq!(
            run(&mut lru, &trace),
            [false, true, false, false, false, false]
        );
        assert_eq!(lru.blocks(), [1, 2]);
        assert_eq!((lru.hits(), lru.misses()), (1, 5));
        let mut lfu = BlockCache::new(2, Policy::Lfu);
        assert_eq!(
            run(&mut lfu, &trace),
            [false, true, false, false, true, false]
        );
        assert_eq!(lfu.blocks(), [1, 2]);
        assert_eq!((lfu.hits(), lfu.misses()), (2, 4));
        assert!((lfu.hit_rate() - 2.0 / 6.0).abs() < 1e-12);
    }

    #[test]
    fn lfu_keeps_frequent_blocks_through_a_scan() {
        // Capacity 3. 4 and 6 get two accesses each, then a scan of one-off blocks 7 8 9 only
        // ever evicts the newest one-off (count 1); 4 and 6 stay resident and keep hitting.
        let mut lfu = BlockCache::new(3, Policy::Lfu);
        let trace = [5, 4, 6, 4, 6, 7, 8, 9, 4, 6, 10, 11, 4, 12];
        let (f, t) = (false, true);
        assert_eq!(
            run(&mut lfu, &trace),
            [f, f, f, t, t, f, f, f, t, t, f, f, t, f]
        );
        assert_eq!(lfu.blocks(), [4, 6, 12]);
        // LRU lets the scan push 4 and 6 out.
        let mut lru = BlockCache::new(3, Policy::Lru);
        assert_eq!(
            run(&mut lru, &trace),
            [f, f, f, t, t, f, f, f, f, f, f, f, f, f]
        );
        assert_eq!(lru.blocks(), [4, 11, 12]);
    }

    #[test]
    fn lfu_ties_go_to_the_least_recently_used() {
        // 1 2 3 all at count 1: 3 evicts 1, the oldest.
        let mut lfu = BlockCache::new(2, Policy::Lfu);
        assert_eq!(run(&mut lfu, &[1, 2, 3]), [false; 3]);
        assert_eq!(lfu.blocks(), [2, 3]);
        // 2 and 3 each get a second access, 3 last: 4 evicts 2 (count 2, older stamp).
        assert_eq!(run(&mut lfu, &[2, 3, 4]), [true, true, false]);
        assert_eq!(lfu.blocks(), [3, 4]);
        // A lower block id does not matter while the stamps differ: 9 then 8, 7 evicts 9.
        let mut lfu = BlockCache::new(2, Policy::Lfu);
        assert_eq!(run(&mut lfu, &[9, 8, 7]), [false; 3]);
        assert_eq!(lfu.blocks(), [7, 8]);
    }

    #[test]
    fn lru_evicts_by_recency_not_frequency() {
        // 1 is used three times, then 2 and 3: LRU evicts 1 at the access of 3, LFU keeps it.
        let trace = [1, 1, 1, 2, 3, 1];
        let mut lru = BlockCache::new(2, Policy::Lru);
        assert_eq!(
            run(&mut lru, &trace),
            [false, true, true, false, false, false]
        );
        assert_eq!(lru.blocks(), [1, 3]);
        let mut lfu = BlockCache::new(2, Policy::Lfu);
        assert_eq!(
            run(&mut lfu, &trace),
            [false, true, true, false, false, true]
        );
        assert_eq!(lfu.blocks(), [1, 3]);
    }

    #[test]
    fn capacity_zero_never_hits() {
        for policy in [Policy::Lru, Policy::Lfu] {
            let mut cache = BlockCache::new(0, policy);
            assert_eq!(cache.hit_rate(), 0.0);
            assert_eq!(run(&mut cache, &[1, 1, 1, 2]), [false; 4]);
            assert!(cache.is_empty() && !cache.contains(1));
            assert_eq!((cache.hits(), cache.misses()), (0, 4));
            assert_eq!(cache.access_step(&[3, 3, 1]), (0, 2));
            assert_eq!(cache.hit_rate(), 0.0);
        }
    }

    #[test]
    fn capacity_one_keeps_the_last_block() {
        for policy in [Policy::Lru, Policy::Lfu] {
            let mut cache = BlockCache::new(1, policy);
            // LFU with one slot: the only resident block is always the victim.
            assert_eq!(
                run(&mut cache, &[4, 4, 4, 5, 4, 4]),
                [false, true, true, false, false, true]
            );
            assert_eq!(cache.blocks(), [4]);
            assert_eq!(cache.len(), 1);
            assert_eq!(cache.hit_rate(), 0.5);
        }
    }

    #[test]
    fn access_step_dedups_and_sorts() {
        let mut cache = BlockCache::new(2, Policy::Lru);
        // Distinct ascending: 2, 5, 9. 9 evicts 2 (oldest).
        assert_eq!(cache.access_step(&[9, 2, 5, 2, 9]), (0, 3));
        assert_eq!(cache.blocks(), [5, 9]);
        assert_eq!(cache.access_step(&[]), (0, 0));
        // 5 hits, 7 misses and evicts 9 (5 was just refreshed).
        assert_eq!(cache.access_step(&[7, 5, 7]), (1, 1));
        assert_eq!(cache.blocks(), [5, 7]);
        assert_eq!((cache.hits(), cache.misses()), (1, 4));
    }

    #[test]
    fn reset_stats_keeps_the_contents() {
        let mut cache = BlockCache::new(4, Policy::Lfu);
        cache.access_step(&[1, 2, 3]);
        cache.reset_stats();
        assert_eq!(
            (cache.hits(), cache.misses(), cache.hit_rate()),
            (0, 0, 0.0)
        );
        assert_eq!(cache.access_step(&[1, 2, 3, 4]), (3, 1));
        assert_eq!(cache.hit_rate(), 0.75);
        assert_eq!(cache.capacity(), 4);
        assert_eq!(cache.policy(), Policy::Lfu);
    }

    #[test]
    fn blocks_of_groups_tokens() {
        assert_eq!(blocks_of(&[], 128).unwrap(), Vec::<u32>::new());
        assert_eq!(
            blocks_of(&[0, 127, 128, 255, 256, u32::MAX], 128).unwrap(),
            [0, 1, 2, u32::MAX / 128]
        );
        assert_eq!(blocks_of(&[3, 1, 3, 2], 1).unwrap(), [1, 2, 3]);
        assert_eq!(blocks_of(&[5], u32::MAX).unwrap(), [0]);
        assert_eq!(blocks_of(&[5], 0), Err(PqError::ZeroBlockTokens));
        assert_eq!(blocks_of(&[], 0), Err(PqError::ZeroBlockTokens));
        assert_eq!(
            blocks_of(&[1000, 10, 500], DEFAULT_BLOCK_TOKENS).unwrap(),
            vec![0, 3, 7]
        );
    }
}
