//! Level constants resident on a device: every (profile, level)'s table maps and channel
//! constants (1.3 MB for the 30-layer fixture's) uploaded once per [`Gpu`] and read by every
//! later decode or encode chain there, instead of copied into each chain on the host and
//! packed into each upload.

use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};

use super::Gpu;
use crate::decode::{Chain, DecodePlan};
use crate::encode_plan::{EncodeChain, EncodePlan};
use crate::error::CudaError;
use crate::ffi::{self, DevBuf, PackSlot};
use crate::levels::{LevelConsts, Placer};
use crate::quant::ChannelConsts;

/// Bytes of resident level constants a `Gpu` keeps at most: past it, the next chain starts
/// them afresh (chains in flight keep theirs).
const MAX_RESIDENT_BYTES: usize = 64 << 20;

/// The levels placed on the device, in order, and the one allocation holding all of their
/// maps, then all of their channel constants.
#[derive(Debug, Default)]
pub(super) struct Resident {
    placed: Vec<([u8; 32], u8, Arc<LevelConsts>)>,
    uploaded: Option<Uploaded>,
}

/// The device copy of the placed levels' maps and constants, and where each array lies in it.
#[derive(Debug)]
struct Uploaded {
    base: Arc<CudaSlice<u8>>,
    maps: PackSlot<u16>,
    consts: PackSlot<ChannelConsts>,
}

/// A chain's table maps and channel constants on the device.
pub(super) type LevelViews = (DevBuf<u16>, DevBuf<ChannelConsts>);

impl Resident {
    /// Where level `level` of the profile `hash`'s map and constants start in the resident
    /// arrays: placed after the others (the arrays uploaded again, all of them, and `s`
    /// synchronized) the first time.
    fn place(
        &mut self,
        s: &Arc<CudaStream>,
        (hash, level): (&[u8; 32], u8),
        consts: &Arc<LevelConsts>,
    ) -> Result<(u64, u64), CudaError> {
        let starts = |placed: &[([u8; 32], u8, Arc<LevelConsts>)]| {
            let maps = placed.iter().map(|p| p.2.maps.len()).sum::<usize>();
            let consts = placed.iter().map(|p| p.2.consts.len()).sum::<usize>();
            (maps as u64, consts as u64)
        };
        if let Some(at) = self
            .placed
            .iter()
            .position(|p| p.0 == *hash && p.1 == level)
        {
            return Ok(starts(&self.placed[..at]));
        }
        let at = starts(&self.placed);
        self.placed.push((*hash, level, consts.clone()));
        let mut p = ffi::Packer::default();
        let maps: Vec<&[u16]> = self.placed.iter().map(|p| &p.2.maps[..]).collect();
        let all_consts: Vec<&[ChannelConsts]> =
            self.placed.iter().map(|p| &p.2.consts[..]).collect();
        let (maps, consts) = (p.add_gather(&maps), p.add_gather(&all_consts));
        // Rare (once per level): a staging buffer of its own, so that a caller holding the
        // `Gpu`'s may place levels.
        let base = p.upload(s, &mut None, 1)?;
        self.uploaded = Some(Uploaded { base, maps, consts });
        Ok(at)
    }

    /// The resident arrays as a chain's launches read them (empty views where no level is
    /// placed).
    fn views(&self, s: &Arc<CudaStream>) -> Result<LevelViews, CudaError> {
        match &self.uploaded {
            Some(u) => Ok((
                DevBuf::view(&u.base, u.maps)?,
                DevBuf::view(&u.base, u.consts)?,
            )),
            None => Ok((DevBuf::zeros(s, 0)?, DevBuf::zeros(s, 0)?)),
        }
    }

    /// Starts afresh if over [`MAX_RESIDENT_BYTES`] (between chains only: a chain's levels
    /// all lie in the arrays its build ends with).
    fn trim(&mut self) {
        let bytes: usize = self.placed.iter().map(|p| p.2.bytes()).sum();
        if bytes > MAX_RESIDENT_BYTES {
            *self = Resident::default();
        }
    }
}

impl Gpu {
    /// `plan`'s chain of `chunks`, its level constants resident on this device (placed on
    /// `s`), and the views of them its launches read.
    pub(super) fn resident_chain<'p>(
        &self,
        plan: &'p DecodePlan<'_>,
        chunks: Range<usize>,
        s: &Arc<CudaStream>,
    ) -> Result<(Chain<'p>, LevelViews), CudaError> {
        self.with_resident(s, |place| {
            plan.chain_placed(&self.levels, chunks, Some(place))
        })
    }

    /// The encode chain of `plan`'s chunks `chunks`, its level constants resident on this
    /// device (placed on this `Gpu`'s stream), and the views of them its launches read.
    pub(super) fn resident_encode_chain(
        &self,
        plan: &EncodePlan<'_, '_>,
        chunks: Range<usize>,
    ) -> Result<(EncodeChain, LevelViews), CudaError> {
        self.with_resident(&self.stream, |place| {
            plan.chain_placed(&self.levels, chunks, Some(place))
        })
    }

    /// The views of this `Gpu`'s resident arrays as they stand (for benches: a chain built
    /// before placed its levels there).
    pub(super) fn resident_views(&self, s: &Arc<CudaStream>) -> Result<LevelViews, CudaError> {
        let resident = self.resident.lock().unwrap_or_else(|e| e.into_inner());
        resident.views(s)
    }

    /// What `build` builds with the levels it meets placed in this `Gpu`'s resident arrays
    /// (on `s`), and the views of those arrays.
    fn with_resident<T>(
        &self,
        s: &Arc<CudaStream>,
        build: impl FnOnce(Placer<'_>) -> Result<T, CudaError>,
    ) -> Result<(T, LevelViews), CudaError> {
        let mut resident = self.resident.lock().unwrap_or_else(|e| e.into_inner());
        resident.trim();
        let mut place = |hash: &[u8; 32], level: u8, consts: &Arc<LevelConsts>| {
            resident.place(s, (hash, level), consts)
        };
        let built = build(&mut place)?;
        let views = resident.views(s)?;
        Ok((built, views))
    }
}
