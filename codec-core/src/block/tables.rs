//! Which table codes each value symbol of a block (`spec/FORMAT.md` §6.1): the level's map gives
//! a base table per `(kind, channel)`, and the symbol's step exponent `e` follows its down link
//! `e` times. The encoder and the decoder both resolve it here, once per block.

use crate::profile::Profile;
use alloc::vec::Vec;

/// Table ids of one block, for every `(kind, exponent, channel)`: kind 0 (anchor rows) or 1
/// (delta rows), exponent below `n_exp` (1 when the block has no exponents).
#[derive(Debug, Default)]
pub(crate) struct BlockTables {
    ids: Vec<u8>,
    n_exp: usize,
    channels: usize,
}

impl BlockTables {
    /// Resolves the tables of block `(layer, kv)` at `level` for `n_exp` exponents (at least 1),
    /// reusing the allocation.
    pub fn resolve(&mut self, profile: &Profile, level: u8, layer: u32, kv: usize, n_exp: usize) {
        let n_exp = n_exp.max(1);
        self.ids.clear();
        for kind in 0..2 {
            let map = profile.table_map(level, layer, kv, kind);
            for e in 0..n_exp {
                let e = e as u8;
                self.ids
                    .extend(map.iter().map(|&t| profile.table_at(level, t, e)));
            }
        }
        self.n_exp = n_exp;
        self.channels = profile.channels();
    }

    /// All ids, `(kind * n_exp + e) * C + channel`.
    pub fn ids(&self) -> &[u8] {
        &self.ids
    }

    /// Offset in [`ids`](Self::ids) of head `head`'s channels (`head_dim` each) in a row of
    /// `kind` whose head has exponent `e`.
    #[inline]
    pub fn head_offset(&self, kind: usize, e: usize, head: usize, head_dim: usize) -> usize {
        (kind * self.n_exp + e) * self.channels + head * head_dim
    }
}
