//! Which table codes each value symbol of a block (`spec/FORMAT.md` §6.1): the level's map gives
//! a base table per `(kind, channel)`, and the symbol's step exponent `e` follows its down link
//! `e` times. The encoder and the decoder both resolve it here, per block, one head's channels
//! at a time as rows first use them: a block of a few rows resolves a few heads' worth instead
//! of every `(kind, exponent, channel)`.

use crate::profile::Profile;
use alloc::vec::Vec;

/// Table ids of one block, for every `(kind, exponent, channel)`: kind 0 (anchor rows) or 1
/// (delta rows), exponent below `n_exp` (1 when the block has no exponents), resolved a head at
/// a time on first use.
#[derive(Debug, Default)]
pub(crate) struct BlockTables {
    /// Ids at `(kind * n_exp + e) * C + channel`; only the resolved heads' are meaningful.
    ids: Vec<u8>,
    /// Per `(kind * n_exp + e) * heads + head`: whether its ids are resolved.
    ready: Vec<bool>,
    n_exp: usize,
    head_dim: usize,
    heads: usize,
    level: u8,
    layer: u32,
    kv: usize,
}

impl BlockTables {
    /// Starts block `(layer, kv)` at `level` with `n_exp` exponents (at least 1), in heads of
    /// `head_dim` channels: no id is resolved yet. Reuses the allocations.
    pub fn start(
        &mut self,
        profile: &Profile,
        (level, layer, kv): (u8, u32, usize),
        n_exp: usize,
        head_dim: usize,
    ) {
        let n_exp = n_exp.max(1);
        let c = profile.channels();
        self.heads = c / head_dim.max(1);
        self.ids.resize(2 * n_exp * c, 0);
        self.ready.clear();
        self.ready.resize(2 * n_exp * self.heads, false);
        (self.n_exp, self.head_dim) = (n_exp, head_dim);
        (self.level, self.layer, self.kv) = (level, layer, kv);
    }

    /// Resolves every head's ids (an encoder's block uses them all).
    pub fn resolve_all(&mut self, profile: &Profile) {
        for kind in 0..2 {
            for e in 0..self.n_exp {
                for head in 0..self.heads {
                    self.head(profile, kind, e, head);
                }
            }
        }
    }

    /// Offset in [`ids`](Self::ids) of head `head`'s channels in a row of `kind` whose head has
    /// exponent `e` (< `n_exp`).
    #[inline]
    pub fn offset(&self, kind: usize, e: usize, head: usize) -> usize {
        ((kind * self.n_exp + e) * self.heads + head) * self.head_dim
    }

    /// [`offset`](Self::offset), its ids resolved first if no call has yet, and whether this
    /// call resolved them.
    #[inline]
    pub fn head(&mut self, profile: &Profile, kind: usize, e: usize, head: usize) -> (usize, bool) {
        let d = self.head_dim;
        let slab = (kind * self.n_exp + e) * self.heads + head;
        let from = self.offset(kind, e, head);
        if self.ready[slab] {
            return (from, false);
        }
        let map = profile.table_map(self.level, self.layer, self.kv, kind);
        let base = &map[head * d..(head + 1) * d];
        let e = e as u8;
        for (id, &t) in self.ids[from..from + d].iter_mut().zip(base) {
            *id = profile.table_at(self.level, t, e);
        }
        self.ready[slab] = true;
        (from, true)
    }

    /// The ids, `(kind * n_exp + e) * C + channel` (those of heads [`head`](Self::head) resolved).
    pub fn ids(&self) -> &[u8] {
        &self.ids
    }
}
