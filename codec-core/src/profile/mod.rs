//! Profiles: the per-model quantization parameters and entropy-coding tables
//! (`spec/FORMAT.md` §4).
//!
//! A profile holds, per `(layer, K/V, channel)`, the channel mean, the base anchor and delta
//! steps and the anchor weight of the delta predictor; a multiplier per level; and per level a set
//! of frequency tables plus a map from `(layer, K/V, anchor/delta, channel)` to a table. It is
//! content-addressed: its identity is the SHA-256 of its serialized bytes, which every stream
//! carries. The module `format` reads and writes the bytes; [`learn_profile`](crate::learn_profile)
//! learns one.

mod error;
mod format;

use crate::consts::{MAX_EXP, MAX_LEVELS, PROFILE_VERSION};
use crate::importance::ImportanceParams;
use crate::limits::Limits;
pub use crate::quant::ChannelParams;
use crate::rans::{DecodeTable, FreqTable};
use alloc::boxed::Box;
use alloc::vec::Vec;
pub use error::ProfileError;
pub(crate) use format::Parts;
use once_cell::race::OnceBox;
use sha2::{Digest, Sha256};

/// `x` rounded to the nearest bf16 (ties to even), widened back to f32: the values a version-3
/// profile can hold for a channel's mean and steps. Finite values beyond bf16's range round to
/// infinity.
pub fn to_bf16_value(x: f32) -> f32 {
    half::bf16::from_f32(x).to_f32()
}

/// An entropy-coding table: a frequency table over `-radius..=radius` and an escape symbol.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SymbolTable {
    /// Largest magnitude coded directly.
    pub radius: u8,
    /// Frequencies of `-radius..=radius` then of the escape (index `2 * radius + 1`).
    pub freqs: FreqTable,
}

impl SymbolTable {
    /// Index of the escape symbol.
    pub fn escape(&self) -> u8 {
        2 * self.radius + 1
    }
}

/// Tables of one level and the map that assigns them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LevelTables {
    /// The tables (at most 256).
    pub tables: Vec<SymbolTable>,
    /// Per table, the table that codes the same channels one step exponent coarser: a symbol
    /// whose map entry is `t` and whose exponent is `e` is coded with `down` applied `e` times
    /// to `t`.
    pub down: Vec<u8>,
    /// Table id per `(layer, kv, kind, channel)`, index `((layer * 2 + kv) * 2 + kind) * C + c`,
    /// kind 0 = anchor, 1 = delta.
    pub map: Vec<u8>,
}

/// Encoder hints for the token-importance policy (`spec/FORMAT.md` §9.2); decoders ignore them.
#[derive(Clone, Debug, PartialEq)]
pub struct Importance {
    /// Policy parameters the profile's steps were calibrated with.
    pub params: ImportanceParams,
    /// Mean query before the rotary embedding, per `(layer, kv_head, channel)` (`layers * C`
    /// values), averaged over each KV head's query group.
    pub query_mean: Vec<f32>,
    /// Score threshold per `(layer, kv_head)` (`layers * kv_heads` values).
    pub tau: Vec<f32>,
}

/// A model profile. Construct with [`learn_profile`](crate::learn_profile) or [`Profile::from_bytes`].
#[derive(Clone, Debug)]
pub struct Profile {
    parts: Parts,
    /// Per level, `down^e(t)` at index `e * n_tables + t`, `e < 16`.
    down_pow: Vec<Vec<u8>>,
    bytes: Vec<u8>,
    hash: [u8; 32],
    /// Per level, its tables' decode lookups, built on the level's first decode (21.5 KB a
    /// table: a stream at one level of a 12-level profile builds a twelfth of them). Threads
    /// decoding at once may each build a level's; one is kept, and all are the same.
    decode_tables: Vec<OnceBox<Vec<DecodeTable>>>,
}

impl PartialEq for Profile {
    fn eq(&self, other: &Self) -> bool {
        self.hash == other.hash
    }
}

impl Profile {
    /// Builds a profile from its parts, validating them and computing its bytes and hash. The
    /// profile is written in the current version ([`PROFILE_VERSION`]), which holds each
    /// channel's mean and steps as bf16: other values are rounded to the nearest bf16 (see
    /// [`to_bf16_value`]), and the profile's [`channel_params`](Self::channel_params) are the
    /// rounded values.
    ///
    /// # Panics
    /// If the parts are inconsistent (wrong lengths, bad steps, out-of-range table ids, a step
    /// that rounds to 0 or infinity), or a decoder with the default limits
    /// ([`Limits::DEFAULT`]) would refuse the profile (too many layers, channels or bytes).
    pub fn from_parts(
        layers: u32,
        kv_heads: u32,
        head_dim: u32,
        level_mult: Vec<f32>,
        params: Vec<ChannelParams>,
        importance: Option<Importance>,
        levels: Vec<LevelTables>,
    ) -> Self {
        let parts = Parts {
            layers,
            kv_heads,
            head_dim,
            level_mult,
            params,
            importance,
            levels,
        };
        Self::write(PROFILE_VERSION, &parts)
    }

    /// `parts` serialized in profile version `version` (2 or 3) and read back, so that the
    /// profile holds exactly what its bytes say.
    fn write(version: u16, parts: &Parts) -> Self {
        Self::try_write(version, parts)
            .expect("profile parts must be valid (see Profile::from_parts)")
    }

    /// A profile of `parts` in the current version, or why a decoder with the default limits
    /// would refuse its bytes (the learner's parts are valid otherwise).
    pub(crate) fn learned(parts: &Parts) -> Result<Self, ProfileError> {
        Self::try_write(PROFILE_VERSION, parts)
    }

    /// [`Profile::write`], or why a decoder with the default limits would refuse the bytes.
    fn try_write(version: u16, parts: &Parts) -> Result<Self, ProfileError> {
        Profile::from_bytes(&format::write(version, parts), &Limits::DEFAULT)
    }

    /// Parses and validates a serialized profile (`spec/FORMAT.md` §4.6). Never panics;
    /// allocates only after checking every count against `limits` and the bytes present.
    pub fn from_bytes(bytes: &[u8], limits: &Limits) -> Result<Self, ProfileError> {
        let parts = format::parse(bytes, limits)?;
        let decode_tables = parts.levels.iter().map(|_| OnceBox::new()).collect();
        let down_pow = parts.levels.iter().map(down_powers).collect();
        Ok(Profile {
            parts,
            down_pow,
            bytes: bytes.to_vec(),
            hash: Sha256::digest(bytes).into(),
            decode_tables,
        })
    }

    /// The serialized profile (what a `.kvcp` file holds, and what a self-contained stream embeds).
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }
    /// SHA-256 of [`Profile::as_bytes`]: the identity a stream names.
    pub fn hash(&self) -> [u8; 32] {
        self.hash
    }
    /// Number of layers.
    pub fn layers(&self) -> u32 {
        self.parts.layers
    }
    /// KV heads per layer.
    pub fn kv_heads(&self) -> u32 {
        self.parts.kv_heads
    }
    /// Head dimension.
    pub fn head_dim(&self) -> u32 {
        self.parts.head_dim
    }
    /// Channels per token row.
    pub fn channels(&self) -> usize {
        (self.parts.kv_heads * self.parts.head_dim) as usize
    }
    /// Number of levels.
    pub fn levels(&self) -> u8 {
        self.parts.level_mult.len() as u8
    }
    /// Step multiplier of each level.
    pub fn level_multipliers(&self) -> &[f32] {
        &self.parts.level_mult
    }
    /// Parameters of `(layer, kv, ·)`, one per channel (`kv`: 0 = K, 1 = V).
    pub fn channel_params(&self, layer: u32, kv: usize) -> &[ChannelParams] {
        let c = self.channels();
        let i = (layer as usize * 2 + kv) * c;
        &self.parts.params[i..i + c]
    }
    /// Tables of a level.
    pub fn level_tables(&self, level: u8) -> &LevelTables {
        &self.parts.levels[level as usize]
    }
    /// Table ids of `(layer, kv, kind)` for a level, one per channel (`kind`: 0 anchor, 1 delta).
    pub fn table_map(&self, level: u8, layer: u32, kv: usize, kind: usize) -> &[u8] {
        let c = self.channels();
        let i = ((layer as usize * 2 + kv) * 2 + kind) * c;
        &self.parts.levels[level as usize].map[i..i + c]
    }
    /// The table that codes a symbol whose map entry is `table` at step exponent `exp` (< 16):
    /// `down` applied `exp` times.
    pub fn table_at(&self, level: u8, table: u8, exp: u8) -> u8 {
        let p = &self.down_pow[level as usize];
        let n = self.parts.levels[level as usize].tables.len();
        p[(exp as usize & 15) * n + table as usize]
    }
    /// The token-importance hints, if the profile was learned with queries.
    pub fn importance(&self) -> Option<&Importance> {
        self.parts.importance.as_ref()
    }
    pub(crate) fn decode_tables(&self, level: u8) -> &[DecodeTable] {
        self.decode_tables[level as usize].get_or_init(|| {
            let tables = &self.parts.levels[level as usize].tables;
            Box::new(tables.iter().map(|t| DecodeTable::from(&t.freqs)).collect())
        })
    }
    /// Hex form of the hash (64 characters).
    pub fn hash_hex(&self) -> alloc::string::String {
        hex(&self.hash)
    }
}

/// Lower-case hex of a byte string.
pub fn hex(bytes: &[u8]) -> alloc::string::String {
    use core::fmt::Write;
    let mut s = alloc::string::String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

impl Profile {
    /// A profile holding only `levels` of this one (in that order), e.g. to embed just the levels
    /// a stream uses. Level `i` of the result is level `levels[i]` of `self`.
    ///
    /// # Panics
    /// If `levels` is empty, longer than [`MAX_LEVELS`], or names a level `self` lacks.
    pub fn with_levels(&self, levels: &[u8]) -> Profile {
        assert!(
            !levels.is_empty()
                && levels.len() <= MAX_LEVELS
                && levels.iter().all(|&l| l < self.levels())
        );
        let p = &self.parts;
        let parts = Parts {
            level_mult: levels.iter().map(|&l| p.level_mult[l as usize]).collect(),
            levels: levels
                .iter()
                .map(|&l| p.levels[l as usize].clone())
                .collect(),
            ..p.clone()
        };
        Profile::write(self.version(), &parts)
    }

    /// This profile without its importance hints (§4.3 of `spec/FORMAT.md`): what a
    /// self-contained stream embeds, since decoding never reads them. Same version, levels and
    /// channel parameters, so it decodes every stream this profile encodes; its bytes, and hence
    /// its hash, differ when there were hints.
    pub fn without_importance(&self) -> Profile {
        if self.parts.importance.is_none() {
            return self.clone();
        }
        let parts = Parts {
            importance: None,
            ..self.parts.clone()
        };
        Profile::write(self.version(), &parts)
    }

    /// The profile format version of this profile's bytes (2 or 3): bytes 4..6, which
    /// parsing checked.
    pub fn version(&self) -> u16 {
        u16::from_le_bytes([self.bytes[4], self.bytes[5]])
    }
}

/// `down^e(t)` for every `e <= MAX_EXP` and table `t` of a level, at index `e * n_tables + t`.
fn down_powers(lv: &LevelTables) -> Vec<u8> {
    let n = lv.tables.len();
    let mut p = Vec::with_capacity((usize::from(MAX_EXP) + 1) * n);
    p.extend(0..n as u8);
    for e in 1..=usize::from(MAX_EXP) {
        for t in 0..n {
            let prev = p[(e - 1) * n + t];
            p.push(lv.down[prev as usize]);
        }
    }
    p
}
