//! What a decode checks and how a failure is reported: chunk CRCs (C1) on the host or from the
//! device's statuses, and every launch's statuses read into the first failing chunk's error.

use codec_core::Stream;

use super::{crc_checks, parallel_map, Chain, ChunkCrc, CrcCovered, DecodePlan};
use crate::error::CudaError;
use crate::ffi::{self, LANES};
use crate::quant::DequantStatus;
use crate::stream::ChunkLanes;

/// Every block of the dequantization launch wrote its rows.
pub(crate) fn check_dequant(status: &[DequantStatus]) -> Result<(), CudaError> {
    match status.iter().find(|s| **s != DequantStatus::Ok) {
        None => Ok(()),
        Some(DequantStatus::BadPage) => Err(CudaError::Input {
            what: "a page-table entry or page lies outside the output",
        }),
        Some(_) => Err(CudaError::Input {
            what: "a chunk's rows lie outside the output",
        }),
    }
}

/// CRC-32C (Castagnoli), as codec-core checks chunks (spec/FORMAT.md §1.4, check C1).
fn crc32c(bytes: &[u8]) -> u32 {
    crc32c::crc32c(bytes)
}

/// The first failing check's error, from each check's status (0, 1 when outside the copied
/// bytes, [`ffi::CHECK_BAD_CRC`]).
pub(crate) fn check_crcs(checks: &[ChunkCrc<'_>], status: &[u32]) -> Result<(), CudaError> {
    let outside = CudaError::Input {
        what: "a chunk checked outside the copied bytes",
    };
    if status.len() != checks.len() {
        return Err(outside);
    }
    for (c, &st) in checks.iter().zip(status) {
        match st {
            0 => {}
            ffi::CHECK_BAD_CRC => {
                return Err(CudaError::Stream {
                    chunk: c.chunk,
                    what: CRC_MISMATCH,
                })
            }
            _ => return Err(outside),
        }
    }
    Ok(())
}

/// `checks` done on the host (on up to the default host threads): the first failing one's
/// error.
pub(crate) fn check_crcs_host(checks: &[ChunkCrc<'_>]) -> Result<(), CudaError> {
    let status = parallel_map(checks, crate::host_threads(0), |c| {
        match crc32c(c.covered) == c.crc {
            true => 0,
            false => ffi::CHECK_BAD_CRC,
        }
    });
    check_crcs(checks, &status)
}

/// Chunk `chunk` of `stream` read into its blocks after its CRC (C1) is checked, or with
/// `crc_at_decode` read with the bytes its CRC covers and the CRC, to be checked at decode.
pub(super) fn check_chunk<'s>(
    stream: &'s Stream<'s>,
    chunk: usize,
    crc_at_decode: bool,
) -> Result<(ChunkLanes<'s>, Option<CrcCovered<'s>>), CudaError> {
    let bad = |what| CudaError::Stream { chunk, what };
    let bytes = stream
        .chunk_bytes(chunk)
        .map_err(|_| bad("no such chunk"))?;
    let body_len = bytes
        .len()
        .checked_sub(4)
        .ok_or(bad("chunk shorter than its CRC"))?;
    let (body, crc) = bytes.split_at(body_len);
    let crc = u32::from_le_bytes([crc[0], crc[1], crc[2], crc[3]]);
    if !crc_at_decode && crc32c(body) != crc {
        return Err(bad(CRC_MISMATCH));
    }
    let lanes = ChunkLanes::from_body(stream, chunk, body)?;
    Ok((lanes, crc_at_decode.then_some((body, crc))))
}

/// What a chunk whose CRC fails is reported as.
pub(super) const CRC_MISMATCH: &str = "chunk CRC mismatch (C1)";

impl DecodePlan<'_> {
    /// The CRCs of the chunks whose CRCs are checked at decode, checked on the host.
    pub(crate) fn check_crcs_host(&self) -> Result<(), CudaError> {
        check_crcs_host(&crc_checks(&self.chunks))
    }
}

impl Chain<'_> {
    /// Every launch's statuses: the first failing block's chunk and what failed. As a `Gpu`
    /// reads a chain's, only when their verdict (`kvc_chain_verdict`, host-run) fails them.
    pub(crate) fn check(
        &self,
        exp_status: &[u32],
        resolve_status: &[u32],
        sym_status: &[u32],
        value_status: &[u32],
        dq_status: &[u32],
    ) -> Result<(), CudaError> {
        let statuses = [
            exp_status,
            resolve_status,
            sym_status,
            value_status,
            dq_status,
        ];
        let rule = ffi::VerdictRule {
            lenient: exp_status.len(),
            lenient_below: EXP_LANES_FAIL_FROM,
        };
        if ffi::host_chain_verdict(&statuses.concat(), rule)? == 0 {
            return Ok(());
        }
        check_chain(&self.chunk_of, statuses)
    }
}

/// A table expansion's statuses: the host built every table from a checked stream's or
/// profile's, so any failure is a fault of the plan's own arithmetic, reported as an input
/// error.
pub(crate) fn check_expanded(status: &[u32]) -> Result<(), CudaError> {
    match status.iter().all(|&s| s == 0) {
        true => Ok(()),
        false => Err(CudaError::Input {
            what: "a table expanded from frequencies outside its buffers or not a rANS table's",
        }),
    }
}

/// A word gather's statuses: any part outside its buffers is a fault of the plan's own
/// arithmetic, reported as an input error.
pub(crate) fn check_gather(status: &[u32]) -> Result<(), CudaError> {
    match status.iter().all(|&s| s == 0) {
        true => Ok(()),
        false => Err(CudaError::Input {
            what: "lane words gathered from outside the copied bytes",
        }),
    }
}

/// An exponent lane's status from which it fails (`KVC_LANE_BAD_TABLE`): the end checks below
/// it do not fail a lane whose exponents are a prefix of its block's.
pub(crate) const EXP_LANES_FAIL_FROM: u32 = 4;

/// A chain's statuses (exponent lanes, table resolution, symbol lanes, values,
/// dequantization), its blocks' chunks `chunk_of`: the first failing block's chunk and what
/// failed.
pub(crate) fn check_chain(chunk_of: &[usize], statuses: [&[u32]; 5]) -> Result<(), CudaError> {
    let [exp_status, resolve_status, sym_status, value_status, dq_status] = statuses;
    for (b, &chunk) in chunk_of.iter().enumerate() {
        let bad = |what| Err(CudaError::Stream { chunk, what });
        let lanes = |s: &[u32]| s.get(b * LANES..(b + 1) * LANES).map(|l| l.to_vec());
        if lanes(exp_status).is_none_or(|l| l.iter().any(|&s| s >= EXP_LANES_FAIL_FROM)) {
            return bad("exponent lanes could not be decoded");
        }
        if resolve_status.get(b) != Some(&0) {
            return bad("value tables could not be resolved");
        }
        if lanes(sym_status).is_none_or(|l| l.iter().any(|&s| s != 0)) {
            return bad("a lane's end checks failed (B6/B8)");
        }
        if value_status.get(b) != Some(&0) {
            return bad("escape values (B7/B9)");
        }
    }
    let status: Vec<DequantStatus> = crate::quant::statuses(dq_status.to_vec());
    check_dequant(&status)
}
