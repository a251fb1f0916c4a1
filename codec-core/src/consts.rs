//! The format's constants, one place for each: this module mirrors the table of `spec/FORMAT.md`
//! §8.2 row by row. Caller-set limits are [`crate::Limits`] (§8.1).

/// Magic bytes of a stream (§3.2).
pub const STREAM_MAGIC: [u8; 4] = *b"KVCS";
/// Stream format version written and read (§3.2, H2).
pub const STREAM_VERSION: u16 = 2;

/// Magic bytes of a profile (§4.1).
pub const PROFILE_MAGIC: [u8; 4] = *b"KVCP";
/// Profile format version written. Version 3 stores each channel's mean and steps as bf16
/// (7-byte records); version 2 stored them as f32 (13-byte records). Both are read (P3).
pub const PROFILE_VERSION: u16 = 3;
/// The oldest profile version still read (P3).
pub const PROFILE_VERSION_MIN: u16 = 2;
/// Profile flags bit 0: the importance hints (§4.3) are present; no other bit is defined (P8).
pub const PROFILE_FLAG_IMPORTANCE: u8 = 1;

/// Bytes of the stream header before the model id (§3.2).
pub const HEADER_FIXED_LEN: usize = 102;
/// Bytes of one chunk index entry (§3.3).
pub const INDEX_ENTRY_LEN: usize = 24;
/// Bytes of a CRC-32C trailer (§3.4).
pub const CRC_LEN: usize = 4;

/// Largest model id in bytes (H21).
pub const MAX_MODEL_ID_BYTES: usize = 1024;
/// Largest token-group size `G` (H18).
pub const MAX_GROUP: u32 = 1024;
/// Most levels in a profile (P7).
pub const MAX_LEVELS: usize = 16;
/// Most frequency tables per level; table ids are one byte (P17).
pub const MAX_TABLES_PER_LEVEL: usize = 256;
/// Largest table radius: a table codes the values `-radius..=radius` plus an escape (P18).
pub const MAX_RADIUS: u8 = 127;
/// Largest step exponent (`max_exp <= 15`, `n_exp <= 16`; P14, B2).
pub const MAX_EXP: u8 = 15;
/// Denominator of the anchor weight: the predictor uses `weight / 16` (§7.1).
pub const WEIGHT_ONE: u8 = 16;
/// Largest magnitude of a quantized symbol; the encoder clamps to it and decoders reject larger
/// escapes (§6.4, B7). 2^24 keeps `symbol as f32` exact.
pub const MAX_SYMBOL: i32 = 1 << 24;

/// Number of interleaved rANS lanes; symbol `g` is coded in lane `g % LANES` (§6.2).
pub const LANES: usize = 32;
/// rANS probability precision in bits: every frequency table sums to `1 << PRECISION` (§6.3).
pub const PRECISION: u32 = 12;

/// Step multiplier of each step exponent `e`: `2^(e/2)` as f32 (§7.1). Even `e` are exact powers
/// of two; odd `e` are `f32(sqrt 2) = 0x3FB504F3` times a power of two (exact). A token row's
/// step in a head with exponent `e` is `step * EXP_MULT[e]`, one f32 multiplication.
pub const EXP_MULT: [f32; 16] = {
    let r2 = f32::from_bits(0x3FB5_04F3);
    let mut m = [0f32; 16];
    let mut e = 0;
    while e < 16 {
        let p = (1u32 << (e / 2)) as f32;
        m[e] = if e % 2 == 0 { p } else { r2 * p };
        e += 1;
    }
    m
};

/// `true` if `group` is a valid token-group size, `1 <= G <= MAX_GROUP` (H18).
pub const fn group_is_valid(group: u32) -> bool {
    group >= 1 && group <= MAX_GROUP
}
