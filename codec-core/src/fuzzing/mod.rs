//! Fuzz harnesses (feature `fuzzing`): the bodies of the cargo-fuzz targets in `fuzz/`.
//!
//! Each target in `fuzz/fuzz_targets/` is one line calling a function of this module, and
//! `tests/fuzz_regressions.rs` replays the committed inputs in `fuzz/seeds/<target>/` and
//! `fuzz/regressions/<target>/` through the same function, so a crash found by fuzzing stays
//! fixed under plain `cargo test`. A harness returns normally for every input; it panics (a
//! crash, for the fuzzer) only when the code under test panics or one of the harness's invariant
//! assertions fails.
//!
//! | target | entry points | invariants asserted |
//! |---|---|---|
//! | [`decode_stream`] | [`crate::decode`], [`Stream::decode_tokens`] | no panic; a partial decode equals the same tokens of the full decode; a decode into another dtype rounds to the same values |
//! | [`decode_stream_profile`] | [`Profile::from_bytes`], [`crate::decode`] with a separate profile | no panic (the input may have its profile hash and CRCs fixed up so mutations reach the chunks) |
//! | [`decode_profile`] | [`Profile::from_bytes`] | no panic; a parsed profile's bytes are the input, re-parse to the same hash, and [`Profile::from_parts`] of its parts writes the same bytes; `table_at` follows the down links |
//! | [`decode_chunk`] | [`ChunkContext::decode_chunk`] (fixed profile [`chunk_profile`]) | no panic; each block's output has `rows * C` values and its sink rows' raw bytes |
//! | [`freq_table`] | [`FreqTable::new`], [`FreqTable::from_counts`], [`DecodeTable::new`], [`LaneDecoder`] | errors are the documented ones; every lookup slot matches the cdf; `from_counts` is valid and (small alphabets) equals its documented greedy definition; lanes decode as the reference decoder does |
//! | [`rans_lanes`] | [`LaneDecoder::new`], [`LaneDecoder::decode`], [`LaneDecoder::finish`] | no panic; symbols and errors equal a plain reference decoder of `spec/FORMAT.md` §6.3 |
//! | [`roundtrip_rans`] | [`encode_lanes`] then [`LaneDecoder`] | the symbols come back, every lane ends clean, lane lengths obey the bound of [`crate::container::max_lane_words`] |
//! | [`roundtrip_codec`] | [`crate::learn_profile`], [`crate::encode`], [`crate::decode`] | decoding gives exactly [`expected_reconstruction`]; the stream is at most [`max_encoded_len`] bytes; a partial decode matches |
//!
//! Input layouts are documented on each function; `fuzz/README.md` says how the seeds are made.
//!
//! [`Stream::decode_tokens`]: crate::Stream::decode_tokens
//! [`Profile::from_bytes`]: crate::Profile::from_bytes
//! [`Profile::from_parts`]: crate::Profile::from_parts
//! [`ChunkContext::decode_chunk`]: crate::ChunkContext::decode_chunk
//! [`FreqTable::new`]: crate::rans::FreqTable::new
//! [`FreqTable::from_counts`]: crate::rans::FreqTable::from_counts
//! [`DecodeTable::new`]: crate::rans::DecodeTable::new
//! [`FreqTable`]: crate::rans::FreqTable
//! [`DecodeTable`]: crate::rans::DecodeTable
//! [`LaneDecoder`]: crate::rans::LaneDecoder
//! [`LaneDecoder::new`]: crate::rans::LaneDecoder::new
//! [`LaneDecoder::decode`]: crate::rans::LaneDecoder::decode
//! [`LaneDecoder::finish`]: crate::rans::LaneDecoder::finish
//! [`encode_lanes`]: crate::rans::encode_lanes
//! [`max_encoded_len`]: crate::container::max_encoded_len

mod decode;
mod input;
mod rans;
mod roundtrip;

pub use decode::{
    chunk_input, chunk_profile, decode_chunk, decode_profile, decode_stream, decode_stream_profile,
    fix_profile_crc, fix_stream_crcs, profile_input, stream_profile_input, ChunkCase,
    StreamProfileCase, CHUNK_CASE_LEN, CHUNK_PROFILE_BYTES, PROFILE_FIX_CRC,
    STREAM_PROFILE_FIX_CRCS, STREAM_PROFILE_FIX_HASH,
};
pub use input::Input;
pub use rans::{
    fixed_tables, freq_table, freq_table_input, rans_lanes, rans_lanes_input,
    reference_lane_decode, roundtrip_rans, LaneDecodeResult, FIXED_TABLES,
};
pub use roundtrip::{expected_reconstruction, roundtrip_codec, RoundtripCase};

use crate::limits::Limits;
use crate::profile::Profile;

/// Limits of the decoding harnesses: small enough that no input makes a harness allocate more
/// than some tens of MiB, large enough for every golden vector.
pub const LIMITS: Limits = Limits {
    max_layers: 64,
    max_channels: 4096,
    max_tokens: 1 << 16,
    max_chunks: 1 << 12,
    max_elements: 1 << 22,
    max_profile_bytes: 1 << 24,
};

/// The fuzz targets, one per file in `fuzz/fuzz_targets/` (same names).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// [`decode_stream`].
    DecodeStream,
    /// [`decode_stream_profile`].
    DecodeStreamProfile,
    /// [`decode_profile`].
    DecodeProfile,
    /// [`decode_chunk`].
    DecodeChunk,
    /// [`freq_table`].
    FreqTable,
    /// [`rans_lanes`].
    RansLanes,
    /// [`roundtrip_rans`].
    RoundtripRans,
    /// [`roundtrip_codec`].
    RoundtripCodec,
}

impl Target {
    /// Every target.
    pub const ALL: [Target; 8] = [
        Target::DecodeStream,
        Target::DecodeStreamProfile,
        Target::DecodeProfile,
        Target::DecodeChunk,
        Target::FreqTable,
        Target::RansLanes,
        Target::RoundtripRans,
        Target::RoundtripCodec,
    ];

    /// The cargo-fuzz target name (and the directory name under `fuzz/seeds/` and
    /// `fuzz/regressions/`).
    pub const fn name(self) -> &'static str {
        match self {
            Target::DecodeStream => "decode_stream",
            Target::DecodeStreamProfile => "decode_stream_profile",
            Target::DecodeProfile => "decode_profile",
            Target::DecodeChunk => "decode_chunk",
            Target::FreqTable => "freq_table",
            Target::RansLanes => "rans_lanes",
            Target::RoundtripRans => "roundtrip_rans",
            Target::RoundtripCodec => "roundtrip_codec",
        }
    }

    /// The target called `name`.
    pub fn from_name(name: &str) -> Option<Target> {
        Target::ALL.into_iter().find(|t| t.name() == name)
    }
}

/// Runs any target on one input, holding the state some targets share between inputs (the
/// parsed [`chunk_profile`]). What the regression test uses.
#[derive(Debug)]
pub struct Harness {
    chunk_profile: Profile,
}

impl Default for Harness {
    fn default() -> Self {
        Harness::new()
    }
}

impl Harness {
    /// Parses the fixed profile of [`decode_chunk`].
    pub fn new() -> Self {
        Harness {
            chunk_profile: chunk_profile(),
        }
    }

    /// Runs `target` on `data`.
    pub fn run(&self, target: Target, data: &[u8]) {
        match target {
            Target::DecodeStream => decode_stream(data),
            Target::DecodeStreamProfile => decode_stream_profile(data),
            Target::DecodeProfile => decode_profile(data),
            Target::DecodeChunk => decode_chunk(&self.chunk_profile, data),
            Target::FreqTable => freq_table(data),
            Target::RansLanes => rans_lanes(data),
            Target::RoundtripRans => roundtrip_rans(data),
            Target::RoundtripCodec => roundtrip_codec(data),
        }
    }
}
