//! What the host-kernel tests share: codec-core's lane decoder as the reference, and the
//! comparison of a decoded block with it.
#![allow(dead_code)] // each test binary uses a part

use codec_core::consts::LANES;
use codec_core::rans::{DecodeTable, FreqTable, LaneDecoder, RansError};
use codec_cuda::rans::{LaneDecoded, LaneStatus};

/// codec-core's decode of one block: its symbols (as far as it got) and its outcome.
pub fn reference(
    words: &[u32],
    lane_len: [usize; LANES],
    tables: &[&FreqTable],
) -> (Vec<u8>, Result<(), RansError>) {
    // One DecodeTable per distinct table (they are 5-21 KiB each).
    let mut distinct: Vec<(&FreqTable, DecodeTable)> = Vec::new();
    let mut index = Vec::with_capacity(tables.len());
    for &t in tables {
        let i = match distinct.iter().position(|(d, _)| std::ptr::eq(*d, t)) {
            Some(i) => i,
            None => {
                distinct.push((t, DecodeTable::new(t)));
                distinct.len() - 1
            }
        };
        index.push(i);
    }
    let per_symbol: Vec<&DecodeTable> = index.iter().map(|&i| &distinct[i].1).collect();
    let mut out = vec![0u8; tables.len()];
    match LaneDecoder::from_concatenated(words, lane_len) {
        Err(e) => (out, Err(e)),
        Ok(mut dec) => {
            let decoded = dec.decode(0, &per_symbol, &mut out);
            assert_eq!(decoded, Ok(()), "reference decode of a whole block");
            (out, dec.finish())
        }
    }
}

/// Block `b` of `got`, as codec-core reports a block: `Err` with codec-core's error of the
/// deciding lane; a status codec-core has no error for is a test failure.
pub fn outcome(got: &LaneDecoded, b: usize) -> Result<(), RansError> {
    got.outcome(b).map_err(|f| {
        f.status
            .rans_error(f.lane)
            .unwrap_or_else(|| panic!("block {b}: lane {} has status {:?}", f.lane, f.status))
    })
}

/// Asserts that block `b` of `got` matches codec-core's decode of the same words and tables
/// bit for bit: same outcome, and same symbols unless a lane's last word is 0 (then codec-core
/// decodes nothing).
pub fn assert_matches_reference(
    got: &LaneDecoded,
    b: usize,
    words: &[u32],
    lane_len: [usize; LANES],
    tables: &[&FreqTable],
) {
    let (want_symbols, want) = reference(words, lane_len, tables);
    assert_eq!(outcome(got, b), want, "block {b}: outcome");
    if !matches!(want, Err(RansError::ZeroFinalWord { .. })) {
        assert!(got.symbols(b) == want_symbols, "block {b}: symbols differ");
    }
    assert!(got
        .status(b)
        .iter()
        .all(|s| !matches!(s, LaneStatus::Unknown(_))));
}
