//! Which bytes of a host buffer a decode from it copies to the device: the ranges its lane
//! words and checked chunks lie in, merged across short gaps, laid back to back on the device.
//! The bytes between streams (their headers, an embedded profile, whatever else the caller
//! keeps in the buffer) stay on the host.

use std::ops::Range;

use crate::error::CudaError;

/// The most bytes between two needed ranges that one copy takes along with both: each copy is
/// a call of its own to queue, and a gap this short crosses PCIe in about a microsecond (a
/// choice, not measured on a device).
pub(crate) const MERGE_GAP_BYTES: usize = 64 << 10;

/// Ranges of a buffer to copy, in order and disjoint, and where each lands when they are laid
/// back to back.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct CopyRuns {
    runs: Vec<Range<usize>>,
    /// Per run, its first byte's offset in the copy.
    at: Vec<usize>,
}

impl CopyRuns {
    /// The runs covering every one of `needed` (ranges of a buffer, in any order), two merged
    /// when at most `gap` bytes lie between them. Empty ranges need nothing.
    pub fn new(mut needed: Vec<Range<usize>>, gap: usize) -> Self {
        needed.retain(|r| r.start < r.end);
        // Stable: its sort finds the runs already in order (a chain's chunks, then its words)
        // and merges them.
        needed.sort_by_key(|r| r.start);
        let mut runs: Vec<Range<usize>> = Vec::new();
        for r in needed {
            match runs.last_mut() {
                Some(last) if r.start <= last.end.saturating_add(gap) => {
                    last.end = last.end.max(r.end);
                }
                _ => runs.push(r),
            }
        }
        let mut at = Vec::with_capacity(runs.len());
        let mut total = 0;
        for r in &runs {
            at.push(total);
            total += r.len();
        }
        CopyRuns { runs, at }
    }

    /// The ranges to copy, in order.
    pub fn runs(&self) -> &[Range<usize>] {
        &self.runs
    }

    /// Bytes copied in all.
    pub fn len(&self) -> usize {
        match (self.runs.last(), self.at.last()) {
            (Some(r), Some(&at)) => at + r.len(),
            _ => 0,
        }
    }

    /// Where the bytes `range` of the buffer start in the copy, if one run holds them all
    /// (`None` if not, or if `range` is empty). It looks first in run `*hint` and leaves
    /// there the run that holds them: a walk through ranges in order finds each in one step.
    pub fn offset(&self, range: Range<usize>, hint: &mut usize) -> Option<usize> {
        let holds = |r: &Range<usize>| r.start <= range.start && range.end <= r.end;
        if !self.runs.get(*hint).is_some_and(holds) {
            *hint = (self.runs)
                .partition_point(|r| r.start <= range.start)
                .saturating_sub(1);
        }
        let (run, at) = (self.runs.get(*hint)?, self.at.get(*hint)?);
        (holds(run) && !range.is_empty()).then(|| at + (range.start - run.start))
    }

    /// The runs of `bytes` laid back to back, as the device receives them (for the host-run
    /// chain); an input error if a run lies outside `bytes`.
    pub fn gather(&self, bytes: &[u8]) -> Result<Vec<u8>, CudaError> {
        let mut out = Vec::with_capacity(self.len().min(bytes.len()));
        for r in &self.runs {
            let part = bytes.get(r.clone()).ok_or(CudaError::Input {
                what: "a range to copy outside the bytes",
            })?;
            out.extend_from_slice(part);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn streams_far_apart_are_copied_apart_and_near_ones_together() {
        let runs = CopyRuns::new(
            vec![300..400, 0..100, 100..150, 150..150, 10_000..10_008],
            64,
        );
        assert_eq!(runs.runs(), &[0..150, 300..400, 10_000..10_008]);
        assert_eq!(runs.len(), 258);
        assert_eq!(runs.offset(120..150, &mut 0), Some(120));
        assert_eq!(runs.offset(300..301, &mut 0), Some(150));
        assert_eq!(runs.offset(10_007..10_008, &mut 0), Some(257));
        // A hint at another run, or past the runs, is only where the lookup starts.
        for start_at in [0, 1, 2, 99] {
            let mut hint = start_at;
            assert_eq!(runs.offset(310..400, &mut hint), Some(160));
            assert_eq!(hint, 1);
        }
        // Bytes outside every run, across a run's edge or two runs, or none at all.
        for outside in [150..151, 299..300, 400..401, 9_999..10_001, 10_008..10_009]
            .into_iter()
            .chain([140..151, 299..310, 390..401, 0..10_001, 100..100])
            .chain([usize::MAX..usize::MAX, usize::MAX - 1..usize::MAX])
        {
            assert_eq!(runs.offset(outside.clone(), &mut 0), None, "{outside:?}");
        }
        let merged = CopyRuns::new(vec![0..100, 164..200], 64);
        assert_eq!(merged.runs().to_vec(), vec![0..200]);
        assert_eq!(CopyRuns::new(vec![0..100, 165..200], 64).runs().len(), 2);
        assert_eq!(CopyRuns::new(vec![], 64).len(), 0);
        assert_eq!(CopyRuns::new(vec![], 64).offset(0..1, &mut 0), None);
    }

    proptest! {
        /// Every needed range, and every byte of it, lands in the copy at an offset that holds
        /// it, and a range reaching a byte more past its run is not found; the runs are in
        /// order, more than `gap` apart, and hold nothing beyond the needed ranges and the
        /// gaps merged between them.
        #[test]
        fn every_needed_byte_lands_where_the_copy_holds_it(
            needed in proptest::collection::vec((0usize..2000, 0usize..200), 0..20),
            gap in 0usize..300,
        ) {
            let needed: Vec<Range<usize>> = needed.iter().map(|&(s, n)| s..s + n).collect();
            let bytes: Vec<u8> = (0..2200).map(|i| (i * 131 % 251) as u8).collect();
            let runs = CopyRuns::new(needed.clone(), gap);
            let copy = runs.gather(&bytes).unwrap();
            prop_assert_eq!(copy.len(), runs.len());
            let mut hint = 0;
            for r in needed.iter().filter(|r| !r.is_empty()) {
                let at = runs.offset(r.clone(), &mut hint).unwrap();
                prop_assert_eq!(&copy[at..at + r.len()], &bytes[r.clone()]);
                for b in r.clone() {
                    prop_assert_eq!(runs.offset(b..b + 1, &mut 0), Some(at + (b - r.start)));
                }
                let run = runs.runs().iter().find(|run| run.contains(&r.start)).unwrap();
                prop_assert_eq!(runs.offset(r.start..run.end + 1, &mut hint), None);
            }
            for w in runs.runs().windows(2) {
                prop_assert!(w[0].end + gap < w[1].start);
            }
            for r in runs.runs() {
                prop_assert!(needed.iter().any(|n| n.start == r.start));
                prop_assert!(needed.iter().any(|n| n.end == r.end));
            }
        }
    }
}
