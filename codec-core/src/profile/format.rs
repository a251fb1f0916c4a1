//! The profile's bytes (`spec/FORMAT.md` §4): [`write`] lays them out, [`parse`] reads and
//! validates them in the order of §4.6.
//!
//! ```text
//! offset          size        field
//!  0              4           magic "KVCP"
//!  4              2           version (3; 2 is read)
//!  6              2           reserved (0)
//!  8              12          layers, kv_heads, head_dim (u32 each)
//! 20              1           n_levels (1..=16)
//! 21              1           flags (bit 0: importance hints)
//! 22              2           reserved (0)
//! 24              4 n_levels  level multipliers (f32)
//! ...             r 2LC       channel records (r = 7 in v3: bf16 mean, delta, anchor, u8 weight;
//!                             r = 13 in v2: the same as f32)
//! ...             12+4(LC+LH) importance hints, if flags bit 0
//! ...                         per level: n_tables u16 | tables (radius u8, 2R+2 freqs u16) |
//!                             down u8[n_tables] | map u8[4LC]
//! len-4           4           CRC-32C of everything before
//! ```

use super::error::ProfileError;
use super::{Importance, LevelTables, SymbolTable};
use crate::bytes::{crc32c, split_crc, PutLe, Reader};
use crate::consts::{
    MAX_LEVELS, MAX_RADIUS, MAX_TABLES_PER_LEVEL, PROFILE_FLAG_IMPORTANCE, PROFILE_MAGIC,
    PROFILE_VERSION, PROFILE_VERSION_MIN, WEIGHT_ONE,
};
use crate::importance::ImportanceParams;
use crate::kv::check_dims;
use crate::limits::Limits;
use crate::quant::ChannelParams;
use crate::rans::FreqTable;
use alloc::vec::Vec;

/// Everything a profile's bytes hold.
#[derive(Clone, Debug)]
pub(crate) struct Parts {
    pub layers: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub level_mult: Vec<f32>,
    pub params: Vec<ChannelParams>,
    pub importance: Option<Importance>,
    pub levels: Vec<LevelTables>,
}

/// Bytes of one channel-parameter record in a profile of `version` (§4.2).
fn record_len(version: u16) -> u64 {
    if version >= 3 {
        7
    } else {
        13
    }
}

/// Serializes `p` in profile format `version` (2 or 3), CRC included. Lengths are the caller's
/// to get right: [`parse`] checks them.
pub(super) fn write(version: u16, p: &Parts) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(&PROFILE_MAGIC);
    b.put_u16(version);
    b.put_u16(0);
    b.put_u32(p.layers);
    b.put_u32(p.kv_heads);
    b.put_u32(p.head_dim);
    b.put_u8(p.level_mult.len() as u8);
    b.put_u8(if p.importance.is_some() {
        PROFILE_FLAG_IMPORTANCE
    } else {
        0
    });
    b.extend_from_slice(&[0, 0]);
    for m in &p.level_mult {
        b.put_f32(*m);
    }
    for c in &p.params {
        if version >= 3 {
            for x in [c.mean, c.delta_step, c.anchor_step] {
                b.put_u16(half::bf16::from_f32(x).to_bits());
            }
        } else {
            b.put_f32(c.mean);
            b.put_f32(c.delta_step);
            b.put_f32(c.anchor_step);
        }
        b.put_u8(c.weight);
    }
    if let Some(imp) = &p.importance {
        b.put_f32(imp.params.slope);
        b.put_f32(imp.params.quantile);
        b.put_u8(imp.params.max_exp);
        b.extend_from_slice(&[0, 0, 0]);
        for q in imp.query_mean.iter().chain(&imp.tau) {
            b.put_f32(*q);
        }
    }
    for lv in &p.levels {
        b.put_u16(lv.tables.len() as u16);
        for t in &lv.tables {
            b.put_u8(t.radius);
            for f in t.freqs.freqs() {
                b.put_u16(*f);
            }
        }
        b.extend_from_slice(&lv.down);
        b.extend_from_slice(&lv.map);
    }
    let crc = crc32c(&b);
    b.put_u32(crc);
    b
}

/// Parses and validates a profile's bytes (checks P1-P23, in order). Never panics; allocates
/// only after checking every count against `limits` and the bytes present.
pub(super) fn parse(bytes: &[u8], limits: &Limits) -> Result<Parts, ProfileError> {
    let (version, body) = check_preamble(bytes, limits)?;
    let mut r = Reader::new(body);
    r.take(8)?;
    let (layers, kv_heads, head_dim) = (r.u32()?, r.u32()?, r.u32()?);
    check_dims(layers, kv_heads, head_dim, limits).map_err(ProfileError::Shape)?;
    let c = kv_heads as usize * head_dim as usize;
    let n_levels = r.u8()?;
    if n_levels == 0 || usize::from(n_levels) > MAX_LEVELS {
        return Err(ProfileError::LevelCount { got: n_levels });
    }
    let flags = r.u8()?;
    if flags & !PROFILE_FLAG_IMPORTANCE != 0 {
        return Err(ProfileError::Flags { got: flags });
    }
    if r.take(2)? != [0, 0] {
        return Err(ProfileError::ReservedBytes);
    }
    let level_mult = read_multipliers(&mut r, n_levels)?;
    let params = read_params(&mut r, version, layers as usize * 2 * c)?;
    let importance = if flags & PROFILE_FLAG_IMPORTANCE != 0 {
        Some(read_hints(
            &mut r,
            layers as usize * c,
            (layers * kv_heads) as usize,
        )?)
    } else {
        None
    };
    let map_len = layers as usize * 4 * c;
    let levels = (0..n_levels)
        .map(|level| read_level(&mut r, level, map_len))
        .collect::<Result<Vec<_>, _>>()?;
    if r.remaining() != 0 {
        return Err(ProfileError::TrailingBytes {
            got: r.remaining() as u64,
        });
    }
    let parts = Parts {
        layers,
        kv_heads,
        head_dim,
        level_mult,
        params,
        importance,
        levels,
    };
    Ok(parts)
}

/// Checks P1-P5 and returns the version and the bytes the CRC covers.
fn check_preamble<'a>(bytes: &'a [u8], limits: &Limits) -> Result<(u16, &'a [u8]), ProfileError> {
    if bytes.len() as u64 > limits.max_profile_bytes {
        return Err(ProfileError::TooLarge {
            got: bytes.len() as u64,
            max: limits.max_profile_bytes,
        });
    }
    let mut r = Reader::new(bytes);
    let magic = r.bytes_n::<4>()?;
    if magic != PROFILE_MAGIC {
        return Err(ProfileError::BadMagic { got: magic });
    }
    let version = r.u16()?;
    if !(PROFILE_VERSION_MIN..=PROFILE_VERSION).contains(&version) {
        return Err(ProfileError::UnsupportedVersion { got: version });
    }
    let reserved = r.u16()?;
    if reserved != 0 {
        return Err(ProfileError::ReservedField { got: reserved });
    }
    // The checksum covers everything before it: check it before any other field so that
    // corruption is reported as such rather than as some odd field value.
    let (body, stored) =
        split_crc(bytes)
            .filter(|(body, _)| body.len() >= 4)
            .ok_or(ProfileError::Truncated {
                needed: 8,
                available: bytes.len() as u64,
            })?;
    let computed = crc32c(body);
    if stored != computed {
        return Err(ProfileError::Crc { stored, computed });
    }
    Ok((version, body))
}

/// P10: the level multipliers, each finite and `> 0`.
fn read_multipliers(r: &mut Reader<'_>, n_levels: u8) -> Result<Vec<f32>, ProfileError> {
    let mut level_mult = Vec::with_capacity(n_levels.into());
    for level in 0..n_levels {
        let m = r.f32()?;
        if !(m.is_finite() && m > 0.0) {
            let bits = m.to_bits();
            return Err(ProfileError::LevelMultiplier { level, bits });
        }
        level_mult.push(m);
    }
    Ok(level_mult)
}

/// P11-P12: `n` channel records of `version`'s layout, widened to f32 and checked.
fn read_params(
    r: &mut Reader<'_>,
    version: u16,
    n: usize,
) -> Result<Vec<ChannelParams>, ProfileError> {
    let needed = n as u64 * record_len(version);
    if r.need(needed).is_err() {
        let available = r.remaining() as u64;
        return Err(ProfileError::ParamsTruncated { needed, available });
    }
    let mut params = Vec::with_capacity(n);
    for record in 0..n as u64 {
        let (mean, delta_step, anchor_step) = if version >= 3 {
            let mut bf16 = || r.u16().map(|b| half::bf16::from_bits(b).to_f32());
            (bf16()?, bf16()?, bf16()?)
        } else {
            (r.f32()?, r.f32()?, r.f32()?)
        };
        let weight = r.u8()?;
        if !mean.is_finite() {
            let bits = mean.to_bits();
            return Err(ProfileError::ChannelMean { record, bits });
        }
        for s in [delta_step, anchor_step] {
            if !(s.is_finite() && s > 0.0) {
                let bits = s.to_bits();
                return Err(ProfileError::ChannelStep { record, bits });
            }
        }
        if weight > WEIGHT_ONE {
            return Err(ProfileError::AnchorWeight {
                record,
                got: weight,
            });
        }
        params.push(ChannelParams {
            mean,
            delta_step,
            anchor_step,
            weight,
        });
    }
    Ok(params)
}

/// P13-P16: the importance hints, `n_means` query means then `n_tau` thresholds.
fn read_hints(
    r: &mut Reader<'_>,
    n_means: usize,
    n_tau: usize,
) -> Result<Importance, ProfileError> {
    let slope = r.f32()?;
    let quantile = r.f32()?;
    let max_exp = r.u8()?;
    if r.take(3)? != [0, 0, 0] {
        return Err(ProfileError::HintsReserved);
    }
    let params = ImportanceParams {
        slope,
        quantile,
        max_exp,
    };
    if !params.is_valid() {
        return Err(ProfileError::ImportanceParams { max_exp });
    }
    let n = n_means + n_tau;
    let needed = n as u64 * 4;
    if r.need(needed).is_err() {
        let available = r.remaining() as u64;
        return Err(ProfileError::HintsTruncated { needed, available });
    }
    let mut query_mean = Vec::with_capacity(n);
    for index in 0..n as u64 {
        let q = r.f32()?;
        if !q.is_finite() {
            let bits = q.to_bits();
            return Err(ProfileError::HintValue { index, bits });
        }
        query_mean.push(q);
    }
    let tau = query_mean.split_off(n_means);
    Ok(Importance {
        params,
        query_mean,
        tau,
    })
}

/// P17-P22: one level's tables, down links and map (`map_len` entries).
fn read_level(r: &mut Reader<'_>, level: u8, map_len: usize) -> Result<LevelTables, ProfileError> {
    let n_tables = r.u16()?;
    if n_tables == 0 || usize::from(n_tables) > MAX_TABLES_PER_LEVEL {
        return Err(ProfileError::TableCount {
            level,
            got: n_tables,
        });
    }
    let n_tables = usize::from(n_tables);
    let mut tables = Vec::with_capacity(n_tables);
    for _ in 0..n_tables {
        let radius = r.u8()?;
        if radius > MAX_RADIUS {
            return Err(ProfileError::TableRadius { level, got: radius });
        }
        let n = 2 * radius as usize + 2;
        let mut freqs = [0u16; 256];
        for f in freqs.iter_mut().take(n) {
            *f = r.u16()?;
        }
        let freqs =
            FreqTable::new(&freqs[..n]).map_err(|err| ProfileError::Table { level, err })?;
        tables.push(SymbolTable { radius, freqs });
    }
    let down = r.take(n_tables)?.to_vec();
    if let Some(&got) = down.iter().find(|&&t| t as usize >= n_tables) {
        return Err(ProfileError::DownLink { level, got });
    }
    let map = r.take(map_len)?.to_vec();
    if let Some(&got) = map.iter().find(|&&t| t as usize >= n_tables) {
        return Err(ProfileError::MapEntry { level, got });
    }
    Ok(LevelTables { tables, down, map })
}
