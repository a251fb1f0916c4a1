//! What every block of one (profile, level) shares in a chain of launches: the level's tables
//! in the lane decoder's packed form, and per (layer, K/V) its value-table map and channel
//! constants. They depend on the profile and the level only, and building them (a map entry
//! per exponent, kind and channel of every layer) costs more than the rest of a chain, so a
//! [`LevelCache`] keeps them between calls: each `Gpu` keeps one, shared with its forks.

use std::sync::{Arc, Mutex};

use codec_core::Profile;

use crate::error::CudaError;
use crate::quant::ChannelConsts;
use crate::rans::value_table_map;

/// Bytes of level constants a [`LevelCache`] keeps at most (the oldest are dropped first).
const MAX_KEPT_BYTES: usize = 64 << 20;

/// The constants of one (profile, level).
#[derive(Debug)]
pub(crate) struct LevelConsts {
    /// The level's tables' frequencies, one table after another in the profile's order
    /// ([`table_ranges`](Self::table_ranges) says where each lies).
    pub freqs: Vec<u16>,
    /// Per table, how many frequencies it has.
    pub freq_lens: Vec<u32>,
    /// Per table, its radius.
    pub radius: Vec<u8>,
    /// Per (layer, K/V) in order (index `layer * 2 + kv`), its value-table map
    /// ([`value_table_map`]), [`map_len`](Self::map_len) entries each.
    pub maps: Vec<u16>,
    pub map_len: usize,
    /// Per (layer, K/V) in the same order, one per channel.
    pub consts: Vec<ChannelConsts>,
    pub channels: usize,
}

impl LevelConsts {
    /// The constants of `level` of `profile`; an error saying why if the level cannot be
    /// decoded by the kernels (no tables, or more than a table list's 16-bit indices hold).
    pub fn of(profile: &Profile, level: u8) -> Result<Self, &'static str> {
        if level >= profile.levels() {
            return Err("a level the profile does not have");
        }
        let level_tables = &profile.level_tables(level).tables;
        if level_tables.is_empty() || level_tables.len() + 1 > usize::from(u16::MAX) {
            return Err("a level without tables");
        }
        let freqs = level_tables.iter().flat_map(|t| t.freqs.freqs()).copied();
        let freq_lens = level_tables.iter().map(|t| t.freqs.freqs().len() as u32);
        let mult = profile.level_multipliers()[usize::from(level)];
        let (mut maps, mut consts) = (Vec::new(), Vec::new());
        for layer in 0..profile.layers() {
            for kv in 0..2 {
                maps.extend(value_table_map(profile, level, layer, kv));
                let params = profile.channel_params(layer, kv);
                consts.extend(ChannelConsts::of_block(params, mult));
            }
        }
        let tensors = 2 * profile.layers() as usize;
        Ok(LevelConsts {
            freqs: freqs.collect(),
            freq_lens: freq_lens.collect(),
            radius: level_tables.iter().map(|t| t.radius).collect(),
            map_len: maps.len() / tensors.max(1),
            maps,
            consts,
            channels: profile.channels(),
        })
    }

    /// Tables of the level.
    pub fn n_tables(&self) -> usize {
        self.radius.len()
    }

    /// Where each table's frequencies lie in [`freqs`](Self::freqs), in order.
    pub fn table_ranges(&self) -> impl Iterator<Item = std::ops::Range<usize>> + '_ {
        self.freq_lens.iter().scan(0usize, |at, &n| {
            let start = *at;
            *at += n as usize;
            Some(start..*at)
        })
    }

    /// Where (layer, K/V)'s map and constants start in [`maps`](Self::maps) and
    /// [`consts`](Self::consts).
    pub fn starts(&self, layer: u32, kv: usize) -> (usize, usize) {
        let tensor = layer as usize * 2 + kv;
        (tensor * self.map_len, tensor * self.channels)
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        2 * self.freqs.len()
            + 4 * self.freq_lens.len()
            + self.radius.len()
            + 2 * self.maps.len()
            + std::mem::size_of::<ChannelConsts>() * self.consts.len()
    }
}

/// For benches: the seconds `reps` runs of `build` take, given a cache kept from a run before
/// the first (`kept`) or a new cache each (as a `Gpu`'s first call builds every constant).
pub(crate) fn time_builds<T>(
    reps: usize,
    kept: bool,
    build: impl Fn(&LevelCache) -> Result<T, CudaError>,
) -> Result<f64, CudaError> {
    let cache = LevelCache::default();
    if kept {
        drop(build(&cache)?);
    }
    let t = std::time::Instant::now();
    for _ in 0..reps {
        match kept {
            true => drop(build(&cache)?),
            false => drop(build(&LevelCache::default())?),
        }
    }
    Ok(t.elapsed().as_secs_f64())
}

/// For benches: the seconds `reps` builds by `build` take, each level's constants kept from
/// the first build and placed by the placer `build` is given (each level at its own made-up
/// place, as a `Gpu` keeps them resident on its device after its first call).
pub(crate) fn time_placed_builds<T>(
    reps: usize,
    mut build: impl FnMut(&LevelCache, Placer<'_>) -> Result<T, CudaError>,
) -> Result<f64, CudaError> {
    let cache = LevelCache::default();
    let mut placed: Vec<([u8; 32], u8)> = Vec::new();
    let mut place = |hash: &[u8; 32], level: u8, c: &Arc<LevelConsts>| {
        let at = match placed.iter().position(|p| *p == (*hash, level)) {
            Some(at) => at,
            None => {
                placed.push((*hash, level));
                placed.len() - 1
            }
        };
        Ok(((at * c.maps.len()) as u64, (at * c.consts.len()) as u64))
    };
    drop(build(&cache, &mut place)?);
    let t = std::time::Instant::now();
    for _ in 0..reps {
        drop(build(&cache, &mut place)?);
    }
    Ok(t.elapsed().as_secs_f64())
}

/// Where a chain's level constants (table maps and channel constants) go: given the profile's
/// SHA-256, the level and its constants, where the level's map and constants start in the
/// arrays the chain's launches will read (a `Gpu` keeps them resident on its device). Decode
/// and encode chains take one.
pub(crate) type Placer<'a> =
    &'a mut dyn FnMut(&[u8; 32], u8, &Arc<LevelConsts>) -> Result<(u64, u64), CudaError>;

/// For tests: a placer that lays each level's table maps and channel constants out after other
/// bytes, in arrays of its own (as a `Gpu` keeps them resident among other levels').
#[cfg(test)]
pub(crate) struct PlacedElsewhere {
    pub maps: Vec<u16>,
    pub consts: Vec<ChannelConsts>,
    /// Per level placed: the profile's hash, the level, where its map and constants start.
    placed: Vec<([u8; 32], u8, (u64, u64))>,
}

#[cfg(test)]
impl PlacedElsewhere {
    pub fn new() -> Self {
        PlacedElsewhere {
            maps: vec![0xFFFF; 1000],
            consts: Vec::new(),
            placed: Vec::new(),
        }
    }

    /// A [`Placer`]'s answer: the level's starts, its arrays appended the first time.
    pub fn place(
        &mut self,
        hash: &[u8; 32],
        level: u8,
        c: &Arc<LevelConsts>,
    ) -> Result<(u64, u64), CudaError> {
        if let Some(p) = self.placed.iter().find(|p| p.0 == *hash && p.1 == level) {
            return Ok(p.2);
        }
        // Other constants before this level's.
        self.consts.extend_from_slice(&c.consts[..5]);
        let at = (self.maps.len() as u64, self.consts.len() as u64);
        self.maps.extend_from_slice(&c.maps);
        self.consts.extend_from_slice(&c.consts);
        self.placed.push((*hash, level, at));
        Ok(at)
    }

    /// Levels placed.
    pub fn levels(&self) -> usize {
        self.placed.len()
    }
}

/// A kept entry: the profile's hash, the level, its constants.
type Kept = ([u8; 32], u8, Arc<LevelConsts>);

/// [`LevelConsts`] by profile hash and level, built on first use and kept (up to 64 MiB, the
/// oldest dropped first) for the chains built after. Safe to share between threads.
#[derive(Debug)]
pub(crate) struct LevelCache {
    kept: Mutex<Vec<Kept>>,
    max_bytes: usize,
}

impl Default for LevelCache {
    fn default() -> Self {
        LevelCache {
            kept: Mutex::default(),
            max_bytes: MAX_KEPT_BYTES,
        }
    }
}

impl LevelCache {
    /// The constants of `level` of `profile`: the kept ones, or new ones, then kept.
    pub fn get(&self, profile: &Profile, level: u8) -> Result<Arc<LevelConsts>, &'static str> {
        let id = profile.hash();
        let found = self
            .lock()
            .iter()
            .find(|(h, l, _)| *h == id && *l == level)
            .map(|(_, _, c)| c.clone());
        if let Some(c) = found {
            return Ok(c);
        }
        // Built without the lock: other threads' chains go on meanwhile.
        let new = Arc::new(LevelConsts::of(profile, level)?);
        let mut kept = self.lock();
        if !kept.iter().any(|(h, l, _)| *h == id && *l == level) {
            kept.push((id, level, new.clone()));
            let mut total: usize = kept.iter().map(|(_, _, c)| c.bytes()).sum();
            while total > self.max_bytes && !kept.is_empty() {
                total -= kept.remove(0).2.bytes();
            }
        }
        Ok(new)
    }

    /// Drops every kept entry.
    pub fn clear(&self) {
        self.lock().clear();
    }

    /// (profile, level) entries kept.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Kept>> {
        self.kept.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use codec_core::{learn_profile, KvCache, KvMeta, KvShape, LearnParams, Limits, Sample};
    use codec_core::{Profile, Tensor};

    use super::*;

    /// A profile learned from a small cache (2 layers, 2 KV heads of 8 channels, 64 tokens).
    fn profile() -> Profile {
        let shape = KvShape {
            layers: 2,
            kv_heads: 2,
            head_dim: 8,
            tokens: 64,
        };
        let t = |s: f32| Tensor::F32((0..64 * 16).map(|i| (i as f32 * s).sin() * 3.0).collect());
        let cache = KvCache {
            shape,
            k: vec![t(0.31), t(0.53)],
            v: vec![t(0.71), t(1.13)],
            meta: KvMeta::default(),
        };
        let sample = Sample {
            kv: cache.view(),
            queries: None,
        };
        learn_profile(&[sample], &LearnParams::default()).expect("a profile")
    }

    #[test]
    fn constants_are_each_tensors_map_and_constants() {
        let p = profile();
        assert!(p.levels() > 1);
        for level in 0..p.levels() {
            let k = LevelConsts::of(&p, level).unwrap();
            let tables = &p.level_tables(level).tables;
            let each: Vec<&[u16]> = k.table_ranges().map(|r| &k.freqs[r]).collect();
            let want: Vec<&[u16]> = tables.iter().map(|t| t.freqs.freqs()).collect();
            assert_eq!(each, want);
            assert_eq!(k.n_tables(), tables.len());
            let radius: Vec<u8> = tables.iter().map(|t| t.radius).collect();
            assert_eq!(k.radius, radius);
            let mult = p.level_multipliers()[usize::from(level)];
            for layer in 0..p.layers() {
                for kv in 0..2 {
                    let map = value_table_map(&p, level, layer, kv);
                    let consts = ChannelConsts::of_block(p.channel_params(layer, kv), mult);
                    let (m, c) = k.starts(layer, kv);
                    assert_eq!(k.maps[m..m + map.len()], map[..], "{level} {layer} {kv}");
                    assert_eq!(k.consts[c..c + consts.len()], consts[..]);
                }
            }
            assert_eq!(k.maps.len(), 4 * k.map_len);
            assert_eq!(k.consts.len(), 4 * p.channels());
        }
    }

    #[test]
    fn a_level_the_profile_lacks_is_an_error() {
        let p = profile();
        assert!(LevelConsts::of(&p, p.levels()).is_err());
        assert!(LevelCache::default().get(&p, u8::MAX).is_err());
    }

    #[test]
    fn the_cache_keeps_one_entry_per_profile_and_level() {
        let p = profile();
        let cache = LevelCache::default();
        let first = cache.get(&p, 1).unwrap();
        assert!(Arc::ptr_eq(&first, &cache.get(&p, 1).unwrap()));
        // The same profile read again from its bytes (another object, the same hash).
        let again = Profile::from_bytes(p.as_bytes(), &Limits::DEFAULT).unwrap();
        assert!(Arc::ptr_eq(&first, &cache.get(&again, 1).unwrap()));
        let other = cache.get(&p, 0).unwrap();
        assert!(!Arc::ptr_eq(&first, &other));
        assert_ne!(first.maps, other.maps);
        assert_eq!(cache.len(), 2);
        cache.clear();
        assert_eq!(cache.len(), 0);
        assert!(!Arc::ptr_eq(&first, &cache.get(&p, 1).unwrap()));
    }

    #[test]
    fn the_cache_drops_the_oldest_beyond_its_bound() {
        let p = profile();
        let one = LevelConsts::of(&p, 0).unwrap().bytes();
        let cache = LevelCache {
            max_bytes: one + one / 2,
            ..LevelCache::default()
        };
        let first = cache.get(&p, 0).unwrap();
        cache.get(&p, 1).unwrap();
        assert_eq!(cache.len(), 1);
        // Level 0 was dropped: built again.
        assert!(!Arc::ptr_eq(&first, &cache.get(&p, 0).unwrap()));
        assert_eq!(cache.len(), 1);
        // An entry larger than the bound is returned, not kept.
        let none = LevelCache {
            max_bytes: 0,
            ..LevelCache::default()
        };
        assert_eq!(none.get(&p, 0).unwrap().maps, first.maps);
        assert_eq!(none.len(), 0);
    }
}
