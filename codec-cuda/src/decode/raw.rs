//! Where a chain's inputs lie in the page-locked bytes its streams lie in (`Gpu::decode_from`):
//! the runs a decode copies to the device as they are, and where each block's lane words,
//! escapes and checked chunk lie in that copy.

use std::ops::Range;

use super::{crc_checks, Chain, ChunkCrc, DecodePlan};
use crate::copy_runs::{CopyRuns, MERGE_GAP_BYTES};
use crate::error::CudaError;
use crate::ffi;
use crate::rans::LaneWords;

/// Where a chain's inputs lie in the bytes its streams lie in ([`Chain::gather_parts`]).
#[derive(Debug)]
pub(crate) struct RawPlaces {
    /// The ranges to copy, laid back to back.
    pub runs: CopyRuns,
    /// The gather parts, their offsets counted in the copy: each block's lane words, then each
    /// block's escape values (blocks without any have no part).
    pub parts: Vec<ffi::GatherPart>,
    /// How many of `parts` are lane words.
    pub word_parts: usize,
    /// Each chunk checked at decode, its offset counted in the copy.
    pub checks: Vec<ffi::ChunkCheck>,
}

/// The input error of a range that [`CopyRuns`] built to hold it does not (a bug).
const OUTSIDE_THE_RUNS: CudaError = CudaError::Input {
    what: "a byte outside the ranges copied",
};

/// The bytes a plan's streams lie in, and where a slice of them lies.
#[derive(Clone, Copy)]
struct RawPlace<'r>(&'r [u8]);

impl RawPlace<'_> {
    /// Where `bytes` lies in the raw bytes (`None` if empty); an input error if outside them.
    fn of(self, bytes: &[u8]) -> Result<Option<Range<usize>>, CudaError> {
        if bytes.is_empty() {
            return Ok(None);
        }
        let start = (bytes.as_ptr() as usize).wrapping_sub(self.0.as_ptr() as usize);
        if start > self.0.len() || bytes.len() > self.0.len() - start {
            return Err(CudaError::Input {
                what: "a plan whose streams lie outside the given bytes",
            });
        }
        Ok(Some(start..start + bytes.len()))
    }
}

/// The ranges of the raw bytes that `checks`' chunks lie in (none for an empty chunk).
fn checked_ranges(
    checks: &[ChunkCrc<'_>],
    place: RawPlace,
) -> Result<Vec<Range<usize>>, CudaError> {
    let mut needed = Vec::with_capacity(checks.len());
    for c in checks {
        needed.extend(place.of(c.covered)?);
    }
    Ok(needed)
}

/// Appends to `parts` a gather part for each non-empty one of `blocks` (words that lie in the
/// raw bytes), its offset counted in the copy of `runs` and its destination after the blocks
/// before; false if one lies outside the runs.
fn parts_of(
    blocks: &[LaneWords<'_>],
    runs: &CopyRuns,
    place: RawPlace,
    parts: &mut Vec<ffi::GatherPart>,
) -> Result<bool, CudaError> {
    let (mut hint, mut dst) = (0, 0);
    for w in blocks {
        if let Some(at) = place.of(w.as_le_bytes())? {
            let Some(src) = runs.offset(at, &mut hint) else {
                return Ok(false);
            };
            parts.push(ffi::GatherPart {
                src: src as u64,
                dst: dst as u64,
                n_words: w.len() as u64,
            });
        }
        dst += w.len();
    }
    Ok(true)
}

impl Chain<'_> {
    /// Where every block's lane words and escape values and every chunk checked at decode lie
    /// in `raw`, the bytes the plan's streams lie in: the ranges of `raw` that hold them (to
    /// be copied, laid back to back, the bytes between streams left out: [`CopyRuns`]), each
    /// block's gather parts and each chunk's check, their offsets counted in the copy; ranges
    /// at most `gap` bytes apart are copied as one run. An input error if some block's words
    /// or escapes or some checked chunk lie outside `raw`.
    pub(crate) fn gather_parts(&self, raw: &[u8], gap: usize) -> Result<RawPlaces, CudaError> {
        let place = RawPlace(raw);
        let mut needed = checked_ranges(&self.checks, place)?;
        // Most often every block's words and escapes lie in a checked chunk: those chunks
        // alone make the runs, and the words need neither sorting in nor a second look.
        let mut runs = CopyRuns::new(needed.clone(), gap);
        let (parts, word_parts) = match self.parts_in(&runs, place)? {
            Some(parts) => parts,
            None => {
                for w in self.word_parts.iter().chain(&self.escape_parts) {
                    needed.extend(place.of(w.as_le_bytes())?);
                }
                runs = CopyRuns::new(needed, gap);
                self.parts_in(&runs, place)?.ok_or(OUTSIDE_THE_RUNS)?
            }
        };
        let mut hint = 0;
        let mut checks = Vec::with_capacity(self.checks.len());
        for c in &self.checks {
            // An empty chunk body is checked at offset 0 of the copy.
            let src = match place.of(c.covered)? {
                Some(at) => runs.offset(at, &mut hint).ok_or(OUTSIDE_THE_RUNS)?,
                None => 0,
            };
            checks.push(ffi::ChunkCheck {
                src: src as u64,
                len: c.covered.len() as u64,
                crc: c.crc,
                reserved: 0,
            });
        }
        Ok(RawPlaces {
            runs,
            parts,
            word_parts,
            checks,
        })
    }

    /// Each block's gather parts, their offsets counted in the copy of `runs`: its lane words'
    /// (into the chain's words), then its escapes' (into its escapes), and how many are
    /// words'; `None` if some block's words or escapes lie outside the runs.
    fn parts_in(
        &self,
        runs: &CopyRuns,
        place: RawPlace,
    ) -> Result<Option<(Vec<ffi::GatherPart>, usize)>, CudaError> {
        let n = self.word_parts.len() + self.escape_parts.len();
        let mut parts = Vec::with_capacity(n);
        if !parts_of(&self.word_parts, runs, place, &mut parts)? {
            return Ok(None);
        }
        let word_parts = parts.len();
        match parts_of(&self.escape_parts, runs, place, &mut parts)? {
            true => Ok(Some((parts, word_parts))),
            false => Ok(None),
        }
    }
}

impl DecodePlan<'_> {
    #[cfg(feature = "internals")]
    /// For benches: the bytes a decode from `raw` (the bytes the plan's streams lie in, as
    /// `Gpu::decode_from` is given them) copies to the device whole: the runs its lane words,
    /// escapes and checked chunks lie in, merged across gaps of at most 64 KiB.
    pub fn bytes_copied_from(&self, raw: &[u8]) -> Result<usize, CudaError> {
        Ok(self.chain()?.gather_parts(raw, MERGE_GAP_BYTES)?.runs.len())
    }

    /// The ranges of `raw` (the bytes the plan's streams lie in) that a decode from it copies
    /// for the plan's chunks `chunks` when every block's lane words lie in a chunk checked at
    /// decode, as a stream's do: those chunks' bytes, merged across gaps of at most `gap`
    /// bytes; none when no chunk is checked at decode. Found without building the chain, so
    /// that the bytes can cross while it is built; they are the runs
    /// [`Chain::gather_parts`] finds for the chain of the same chunks unless some words lie
    /// outside them (a test holds the two to each other). An input error if a checked chunk
    /// lies outside `raw` or `chunks` past the plan's.
    pub(crate) fn checked_runs(
        &self,
        chunks: Range<usize>,
        raw: &[u8],
        gap: usize,
    ) -> Result<CopyRuns, CudaError> {
        let chunks = self.chunks.get(chunks).ok_or(CudaError::Input {
            what: "chunks past the plan's",
        })?;
        let needed = checked_ranges(&crc_checks(chunks), RawPlace(raw))?;
        Ok(CopyRuns::new(needed, gap))
    }

    #[cfg(feature = "internals")]
    /// For benches: the seconds `reps` findings of the chain's lane words and checked chunks
    /// in `raw`, the bytes its streams lie in, take (what a decode from page-locked memory
    /// does after building the chain: the ranges to copy and the offsets there).
    pub fn time_gather_parts(&self, raw: &[u8], reps: usize) -> Result<f64, CudaError> {
        let ch = self.chain()?;
        let t = std::time::Instant::now();
        for _ in 0..reps {
            drop(ch.gather_parts(raw, MERGE_GAP_BYTES)?);
        }
        Ok(t.elapsed().as_secs_f64())
    }
}
