//! Profiles: the per-model quantization parameters and entropy-coding tables
//! (`spec/FORMAT.md`, "Profile").
//!
//! A profile holds, per `(layer, K/V, channel)`, the channel mean, the base anchor and delta
//! steps and the anchor weight of the delta predictor; a multiplier per level; and per level a set
//! of frequency tables plus a map from `(layer, K/V, anchor/delta, channel)` to a table. It is
//! content-addressed: its identity is the SHA-256 of its serialized bytes, which every stream
//! carries.

mod learn;

pub use learn::{learn_profile, LearnParams, Queries, Sample};

use crate::bytes::{crc32c, PutLe, Reader};
use crate::error::DecodeError;
use crate::importance::{ImportanceParams, MAX_EXP};
use crate::limits::{Limits, MAX_LEVELS, MAX_TABLES_PER_LEVEL};
use crate::rans::{DecodeTable, FreqTable};
use alloc::vec::Vec;
use sha2::{Digest, Sha256};

/// Magic bytes of a profile.
pub const PROFILE_MAGIC: [u8; 4] = *b"KVCP";
/// Profile format version written ([`Profile::from_parts`] and the learner). Version 3 stores
/// each channel's mean and steps as bf16 (7-byte records); version 2 stored them as f32
/// (13-byte records). Both are read.
pub const PROFILE_VERSION: u16 = 3;
/// The oldest profile version still read.
pub const PROFILE_VERSION_MIN: u16 = 2;

/// Bytes of one channel-parameter record in a profile of `version`.
fn record_len(version: u16) -> u64 {
    if version >= 3 {
        7
    } else {
        13
    }
}

/// `x` rounded to the nearest bf16 (ties to even), widened back to f32: the values a version-3
/// profile can hold for a channel's mean and steps. Finite values beyond bf16's range round to
/// infinity.
pub fn to_bf16_value(x: f32) -> f32 {
    half::bf16::from_f32(x).to_f32()
}
/// Largest table radius: a table codes the values `-radius..=radius` plus an escape.
pub const MAX_RADIUS: u8 = 127;
/// Denominator of the anchor weight (`weight / 16`).
pub const WEIGHT_ONE: u8 = 16;

/// Quantization parameters of one channel of one tensor of one layer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ChannelParams {
    /// Channel mean: the anchor predictor, and the point deltas shrink towards.
    pub mean: f32,
    /// Base step of non-anchor tokens (multiplied by the level's multiplier).
    pub delta_step: f32,
    /// Base step of anchor tokens (multiplied by the level's multiplier).
    pub anchor_step: f32,
    /// Weight of the reconstructed anchor in the delta predictor, in sixteenths (0..=16).
    pub weight: u8,
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

/// Encoder hints for the token-importance policy ([`crate::importance`]); decoders ignore them.
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

/// A model profile. Construct with [`learn_profile`] or [`Profile::from_bytes`].
#[derive(Clone, Debug)]
pub struct Profile {
    layers: u32,
    kv_heads: u32,
    head_dim: u32,
    level_mult: Vec<f32>,
    params: Vec<ChannelParams>,
    importance: Option<Importance>,
    levels: Vec<LevelTables>,
    /// Per level, `down^e(t)` at index `e * n_tables + t`, `e < 16`.
    down_pow: Vec<Vec<u8>>,
    bytes: Vec<u8>,
    hash: [u8; 32],
    decode_tables: Vec<Vec<DecodeTable>>,
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
    /// that rounds to 0 or infinity); the learner never produces such parts.
    pub fn from_parts(
        layers: u32,
        kv_heads: u32,
        head_dim: u32,
        level_mult: Vec<f32>,
        params: Vec<ChannelParams>,
        importance: Option<Importance>,
        levels: Vec<LevelTables>,
    ) -> Self {
        Self::write(
            PROFILE_VERSION,
            layers,
            kv_heads,
            head_dim,
            level_mult,
            params,
            importance,
            levels,
        )
    }

    /// [`from_parts`](Self::from_parts) in profile version `version` (2 or 3).
    #[allow(clippy::too_many_arguments)]
    fn write(
        version: u16,
        layers: u32,
        kv_heads: u32,
        head_dim: u32,
        level_mult: Vec<f32>,
        params: Vec<ChannelParams>,
        importance: Option<Importance>,
        levels: Vec<LevelTables>,
    ) -> Self {
        let mut bytes = Vec::new();
        bytes.extend_from_slice(&PROFILE_MAGIC);
        bytes.put_u16(version);
        bytes.put_u16(0);
        bytes.put_u32(layers);
        bytes.put_u32(kv_heads);
        bytes.put_u32(head_dim);
        bytes.put_u8(level_mult.len() as u8);
        bytes.put_u8(u8::from(importance.is_some()));
        bytes.extend_from_slice(&[0, 0]);
        for m in &level_mult {
            bytes.put_f32(*m);
        }
        for p in &params {
            if version >= 3 {
                for x in [p.mean, p.delta_step, p.anchor_step] {
                    bytes.put_u16(half::bf16::from_f32(x).to_bits());
                }
            } else {
                bytes.put_f32(p.mean);
                bytes.put_f32(p.delta_step);
                bytes.put_f32(p.anchor_step);
            }
            bytes.put_u8(p.weight);
        }
        if let Some(imp) = &importance {
            bytes.put_f32(imp.params.slope);
            bytes.put_f32(imp.params.quantile);
            bytes.put_u8(imp.params.max_exp);
            bytes.extend_from_slice(&[0, 0, 0]);
            for q in imp.query_mean.iter().chain(&imp.tau) {
                bytes.put_f32(*q);
            }
        }
        for lv in &levels {
            bytes.put_u16(lv.tables.len() as u16);
            for t in &lv.tables {
                bytes.put_u8(t.radius);
                for f in t.freqs.freqs() {
                    bytes.put_u16(*f);
                }
            }
            bytes.extend_from_slice(&lv.down);
            bytes.extend_from_slice(&lv.map);
        }
        let crc = crc32c(&bytes);
        bytes.put_u32(crc);
        Profile::from_bytes(&bytes, &Limits::DEFAULT)
            .expect("profile parts must be valid (see Profile::from_parts)")
    }

    /// Parses and validates a serialized profile. Never panics; allocates only after checking
    /// every count against `limits` and the bytes present.
    pub fn from_bytes(bytes: &[u8], limits: &Limits) -> Result<Self, DecodeError> {
        if bytes.len() as u64 > limits.max_profile_bytes {
            return Err(DecodeError::LimitExceeded {
                what: "profile size",
                got: bytes.len() as u64,
                max: limits.max_profile_bytes,
            });
        }
        let mut r = Reader::new(bytes, "profile");
        let magic: [u8; 4] = r.take(4)?.try_into().unwrap_or([0; 4]);
        if magic != PROFILE_MAGIC {
            return Err(DecodeError::BadMagic {
                what: "profile",
                got: magic,
            });
        }
        let version = r.u16()?;
        if !(PROFILE_VERSION_MIN..=PROFILE_VERSION).contains(&version) {
            return Err(DecodeError::UnsupportedVersion {
                what: "profile",
                got: version,
            });
        }
        let reserved = r.u16()?;
        if reserved != 0 {
            return Err(DecodeError::InvalidField {
                what: "profile reserved field",
                got: reserved as u64,
            });
        }
        // The checksum covers everything before it: check it first so corruption is reported
        // as such rather than as some odd field value.
        if bytes.len() < 4 + 4 {
            return Err(DecodeError::Truncated {
                what: "profile",
                needed: 8,
                available: bytes.len() as u64,
            });
        }
        let body_len = bytes.len() - 4;
        let stored = u32::from_le_bytes([
            bytes[body_len],
            bytes[body_len + 1],
            bytes[body_len + 2],
            bytes[body_len + 3],
        ]);
        let computed = crc32c(&bytes[..body_len]);
        if stored != computed {
            return Err(DecodeError::ProfileCrc { stored, computed });
        }
        let mut r = Reader::new(&bytes[..body_len], "profile");
        r.take(8)?;
        let layers = r.u32()?;
        let kv_heads = r.u32()?;
        let head_dim = r.u32()?;
        check_shape(layers, kv_heads, head_dim, limits)?;
        let c = (kv_heads * head_dim) as usize;
        let n_levels = r.u8()? as usize;
        if n_levels == 0 || n_levels > MAX_LEVELS {
            return Err(DecodeError::InvalidField {
                what: "profile level count",
                got: n_levels as u64,
            });
        }
        let flags = r.u8()?;
        if flags > 1 {
            return Err(DecodeError::InvalidField {
                what: "profile flags",
                got: flags as u64,
            });
        }
        let res = r.take(2)?;
        if res != [0, 0] {
            return Err(DecodeError::InvalidField {
                what: "profile reserved field",
                got: 1,
            });
        }
        let mut level_mult = Vec::with_capacity(n_levels);
        for _ in 0..n_levels {
            let m = r.f32()?;
            if !(m.is_finite() && m > 0.0) {
                return Err(DecodeError::InvalidField {
                    what: "level multiplier",
                    got: m.to_bits() as u64,
                });
            }
            level_mult.push(m);
        }
        let n_params = layers as usize * 2 * c;
        let need = n_params as u64 * record_len(version);
        if need > r.remaining() as u64 {
            return Err(DecodeError::Truncated {
                what: "profile channel parameters",
                needed: need,
                available: r.remaining() as u64,
            });
        }
        let mut params = Vec::with_capacity(n_params);
        let bf16 = |r: &mut Reader<'_>| -> Result<f32, DecodeError> {
            Ok(half::bf16::from_bits(r.u16()?).to_f32())
        };
        for _ in 0..n_params {
            let (mean, delta_step, anchor_step) = if version >= 3 {
                (bf16(&mut r)?, bf16(&mut r)?, bf16(&mut r)?)
            } else {
                (r.f32()?, r.f32()?, r.f32()?)
            };
            let weight = r.u8()?;
            if !mean.is_finite() {
                return Err(DecodeError::InvalidField {
                    what: "channel mean",
                    got: mean.to_bits() as u64,
                });
            }
            for s in [delta_step, anchor_step] {
                if !(s.is_finite() && s > 0.0) {
                    return Err(DecodeError::InvalidField {
                        what: "channel step",
                        got: s.to_bits() as u64,
                    });
                }
            }
            if weight > WEIGHT_ONE {
                return Err(DecodeError::InvalidField {
                    what: "anchor weight",
                    got: weight as u64,
                });
            }
            params.push(ChannelParams {
                mean,
                delta_step,
                anchor_step,
                weight,
            });
        }
        let importance = if flags & 1 != 0 {
            let slope = r.f32()?;
            let quantile = r.f32()?;
            let max_exp = r.u8()?;
            if r.take(3)? != [0, 0, 0] {
                return Err(DecodeError::InvalidField {
                    what: "profile reserved field",
                    got: 2,
                });
            }
            let params = ImportanceParams {
                slope,
                quantile,
                max_exp,
            };
            if !params.is_valid() {
                return Err(DecodeError::InvalidField {
                    what: "importance parameters",
                    got: max_exp as u64,
                });
            }
            let n = layers as usize * c;
            let nt = layers as usize * kv_heads as usize;
            if (n + nt) as u64 * 4 > r.remaining() as u64 {
                return Err(DecodeError::Truncated {
                    what: "profile query means",
                    needed: (n + nt) as u64 * 4,
                    available: r.remaining() as u64,
                });
            }
            let mut vals = Vec::with_capacity(n + nt);
            for _ in 0..n + nt {
                let q = r.f32()?;
                if !q.is_finite() {
                    return Err(DecodeError::InvalidField {
                        what: "query mean or score threshold",
                        got: q.to_bits() as u64,
                    });
                }
                vals.push(q);
            }
            let tau = vals.split_off(n);
            Some(Importance {
                params,
                query_mean: vals,
                tau,
            })
        } else {
            None
        };
        let map_len = layers as usize * 4 * c;
        let mut levels = Vec::with_capacity(n_levels);
        for _ in 0..n_levels {
            let n_tables = r.u16()? as usize;
            if n_tables == 0 || n_tables > MAX_TABLES_PER_LEVEL {
                return Err(DecodeError::InvalidField {
                    what: "table count",
                    got: n_tables as u64,
                });
            }
            let mut tables = Vec::with_capacity(n_tables);
            for _ in 0..n_tables {
                let radius = r.u8()?;
                if radius > MAX_RADIUS {
                    return Err(DecodeError::InvalidField {
                        what: "table radius",
                        got: radius as u64,
                    });
                }
                let n = 2 * radius as usize + 2;
                let mut freqs = [0u16; 256];
                for f in freqs.iter_mut().take(n) {
                    *f = r.u16()?;
                }
                let freqs = FreqTable::new(&freqs[..n])?;
                tables.push(SymbolTable { radius, freqs });
            }
            let down = r.take(n_tables)?.to_vec();
            if let Some(&bad) = down.iter().find(|&&t| t as usize >= n_tables) {
                return Err(DecodeError::InvalidField {
                    what: "table id in down links",
                    got: bad as u64,
                });
            }
            let map = r.take(map_len)?.to_vec();
            if let Some(&bad) = map.iter().find(|&&t| t as usize >= n_tables) {
                return Err(DecodeError::InvalidField {
                    what: "table id in map",
                    got: bad as u64,
                });
            }
            levels.push(LevelTables { tables, down, map });
        }
        if r.remaining() != 0 {
            return Err(DecodeError::Inconsistent {
                what: "trailing bytes after profile tables",
            });
        }
        let hash: [u8; 32] = Sha256::digest(bytes).into();
        let decode_tables = levels
            .iter()
            .map(|lv| {
                lv.tables
                    .iter()
                    .map(|t| DecodeTable::from(&t.freqs))
                    .collect()
            })
            .collect();
        let down_pow = levels
            .iter()
            .map(|lv| {
                let n = lv.tables.len();
                let mut p = Vec::with_capacity(16 * n);
                p.extend(0..n as u8);
                for e in 1..=MAX_EXP as usize {
                    for t in 0..n {
                        let prev = p[(e - 1) * n + t];
                        p.push(lv.down[prev as usize]);
                    }
                }
                p
            })
            .collect();
        Ok(Profile {
            layers,
            kv_heads,
            head_dim,
            level_mult,
            params,
            importance,
            levels,
            down_pow,
            bytes: bytes.to_vec(),
            hash,
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
        self.layers
    }
    /// KV heads per layer.
    pub fn kv_heads(&self) -> u32 {
        self.kv_heads
    }
    /// Head dimension.
    pub fn head_dim(&self) -> u32 {
        self.head_dim
    }
    /// Channels per token row.
    pub fn channels(&self) -> usize {
        (self.kv_heads * self.head_dim) as usize
    }
    /// Number of levels.
    pub fn levels(&self) -> u8 {
        self.level_mult.len() as u8
    }
    /// Step multiplier of each level.
    pub fn level_multipliers(&self) -> &[f32] {
        &self.level_mult
    }
    /// Parameters of `(layer, kv, ·)`, one per channel (`kv`: 0 = K, 1 = V).
    pub fn channel_params(&self, layer: u32, kv: usize) -> &[ChannelParams] {
        let c = self.channels();
        let i = (layer as usize * 2 + kv) * c;
        &self.params[i..i + c]
    }
    /// Tables of a level.
    pub fn level_tables(&self, level: u8) -> &LevelTables {
        &self.levels[level as usize]
    }
    /// Table ids of `(layer, kv, kind)` for a level, one per channel (`kind`: 0 anchor, 1 delta).
    pub fn table_map(&self, level: u8, layer: u32, kv: usize, kind: usize) -> &[u8] {
        let c = self.channels();
        let i = ((layer as usize * 2 + kv) * 2 + kind) * c;
        &self.levels[level as usize].map[i..i + c]
    }
    /// The table that codes a symbol whose map entry is `table` at step exponent `exp` (< 16):
    /// `down` applied `exp` times.
    pub fn table_at(&self, level: u8, table: u8, exp: u8) -> u8 {
        let p = &self.down_pow[level as usize];
        let n = self.levels[level as usize].tables.len();
        p[(exp as usize & 15) * n + table as usize]
    }
    /// The token-importance hints, if the profile was learned with queries.
    pub fn importance(&self) -> Option<&Importance> {
        self.importance.as_ref()
    }
    pub(crate) fn decode_tables(&self, level: u8) -> &[DecodeTable] {
        &self.decode_tables[level as usize]
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

pub(crate) fn check_shape(
    layers: u32,
    kv_heads: u32,
    head_dim: u32,
    limits: &Limits,
) -> Result<(), DecodeError> {
    if layers == 0 {
        return Err(DecodeError::InvalidField {
            what: "layers",
            got: 0,
        });
    }
    if kv_heads == 0 {
        return Err(DecodeError::InvalidField {
            what: "kv_heads",
            got: 0,
        });
    }
    if head_dim == 0 {
        return Err(DecodeError::InvalidField {
            what: "head_dim",
            got: 0,
        });
    }
    if layers > limits.max_layers {
        return Err(DecodeError::LimitExceeded {
            what: "layers",
            got: layers as u64,
            max: limits.max_layers as u64,
        });
    }
    let c = kv_heads as u64 * head_dim as u64;
    if c > limits.max_channels as u64 {
        return Err(DecodeError::LimitExceeded {
            what: "channels (kv_heads * head_dim)",
            got: c,
            max: limits.max_channels as u64,
        });
    }
    Ok(())
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
        Profile::write(
            self.version(),
            self.layers,
            self.kv_heads,
            self.head_dim,
            levels
                .iter()
                .map(|&l| self.level_mult[l as usize])
                .collect(),
            self.params.clone(),
            self.importance.clone(),
            levels
                .iter()
                .map(|&l| self.levels[l as usize].clone())
                .collect(),
        )
    }

    /// This profile without its importance hints (§4.3 of `spec/FORMAT.md`): what a
    /// self-contained stream embeds, since decoding never reads them. Same version, levels and
    /// channel parameters, so it decodes every stream this profile encodes; its bytes, and hence
    /// its hash, differ when there were hints.
    pub fn without_importance(&self) -> Profile {
        if self.importance.is_none() {
            return self.clone();
        }
        Profile::write(
            self.version(),
            self.layers,
            self.kv_heads,
            self.head_dim,
            self.level_mult.clone(),
            self.params.clone(),
            None,
            self.levels.clone(),
        )
    }

    /// The profile format version of this profile's bytes (2 or 3): bytes 4..6, which
    /// parsing checked.
    pub fn version(&self) -> u16 {
        u16::from_le_bytes([self.bytes[4], self.bytes[5]])
    }
}
