//! Decoding a plan in pieces on one [`Gpu`]: each piece's chain is built on a host thread
//! while the piece before is queued, and its upload queued on a copy stream while the
//! launches of the pieces before run on compute streams of their own (several pieces' launches
//! at once: [`Gpu::set_decode_pieces_in_flight`]), so that the host's work, the copy across
//! PCIe and the kernels overlap instead of following one another. Pieces are runs of whole
//! chunks, which write disjoint parts of the output: the bits are the whole plan's.

use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaSlice, CudaStream};

use super::from_host::EarlyCopy;
use super::queued::Verdicts;
use super::{check_page_size, Gpu, HostBuffer, WordSource};
use crate::copy_runs::MERGE_GAP_BYTES;
use crate::decode::{check_chain, check_crcs_host, DecodePlan};
use crate::error::CudaError;
use crate::ffi::{self, DevBuf};

/// Coded blocks a piece of a decode holds by default ([`Gpu::set_decode_piece_blocks`]).
pub const DEFAULT_PIECE_BLOCKS: usize = 2048;

/// Pieces of a decode whose launches may run at once by default
/// ([`Gpu::set_decode_pieces_in_flight`]).
pub const DEFAULT_PIECES_IN_FLIGHT: usize = 4;

/// The most pieces of a decode whose launches may run at once: each has a compute stream,
/// a staging buffer and a scratch slot of its own.
pub const MAX_PIECES_IN_FLIGHT: usize = 8;

/// The streams of a decode or an encode in pieces besides the `Gpu`'s own: a copy stream (a
/// decode's uploads, an encode's copies back) and the other compute streams (piece `i` of a
/// decode launches on compute stream `i % n` of the `Gpu`'s and these, `n` pieces in flight,
/// so that one piece's launches fill the device beside the tails of the ones before; an
/// encode's run one after another on the `Gpu`'s, so that each piece's copy back starts as
/// early as it can).
#[derive(Debug)]
pub(super) struct PipeStreams {
    pub(super) copy: Arc<CudaStream>,
    sides: Vec<Arc<CudaStream>>,
}

impl PipeStreams {
    /// The compute streams of `n` pieces in flight: the `Gpu`'s `own`, then `n - 1` of these.
    fn computes<'a>(&'a self, own: &'a Arc<CudaStream>, n: usize) -> Vec<&'a Arc<CudaStream>> {
        let sides = self.sides.iter().take(n.saturating_sub(1));
        std::iter::once(own).chain(sides).collect()
    }
}

/// A piece queued and launched: its chain on the device and what its statuses are checked
/// against.
type Launched<'p> = (
    super::QueuedChain,
    Vec<usize>,
    Vec<crate::decode::ChunkCrc<'p>>,
);

/// What a decode in pieces queues on: its copy stream, its compute streams (a piece's is
/// the one of its index modulo their count), and a verdict word per piece.
type Pipe<'a> = (
    (&'a Arc<CudaStream>, &'a [&'a Arc<CudaStream>]),
    &'a Verdicts,
);

/// A piece's chain built on the host: the chain, the views of its level constants, and where
/// its words lie in the caller's bytes (a decode from them).
type BuiltPiece<'p> = (
    crate::decode::Chain<'p>,
    super::resident::LevelViews,
    Option<crate::decode::RawPlaces>,
);

/// For benches: when a piece's steps happened, in milliseconds from the decode's start
/// (`Gpu::time_decode_pieces`, feature `internals`): on the host, its chain taken from the
/// builder thread, its upload queued, its launches queued; on the device, its upload's start
/// and end on the copy stream, its launches' start and end.
pub type PieceTimes = [f64; 7];

/// The events a timed decode in pieces records: its start (on the `Gpu`'s stream), and per
/// piece the host's times (from just before the start is recorded) and four device events.
struct Timeline {
    start: CudaEvent,
    pieces: Vec<([f64; 3], [CudaEvent; 4])>,
}

impl Gpu {
    /// Sets the coded blocks of a piece of [`decode_into`](Self::decode_into) and
    /// [`decode_from`](Self::decode_from): a plan of more is decoded in pieces of about this
    /// many blocks, each piece's upload overlapping the launches of the piece before; 0
    /// decodes every plan whole (one upload, then one chain of launches). Default:
    /// [`DEFAULT_PIECE_BLOCKS`]. The bits are the same for every setting.
    pub fn set_decode_piece_blocks(&mut self, blocks: usize) {
        self.piece_blocks = blocks;
    }

    /// Sets the coded blocks of the first piece of a decode in pieces: with `blocks` below
    /// the piece size ([`set_decode_piece_blocks`](Self::set_decode_piece_blocks)), the
    /// first piece holds about `blocks` and each next twice the one before up to the piece
    /// size, so that the device starts on a small piece while larger ones cross. 0, the
    /// default, cuts every piece alike. The bits are the same for every setting.
    pub fn set_decode_first_piece_blocks(&mut self, blocks: usize) {
        self.first_piece_blocks = blocks;
    }

    /// Sets how many pieces of a decode in pieces may have their launches on the device at
    /// once, each on a compute stream of its own (clamped to 1 to
    /// [`MAX_PIECES_IN_FLIGHT`]; default [`DEFAULT_PIECES_IN_FLIGHT`]): a piece's lane
    /// decode keeps a warp busy per coded block, so small pieces leave the device's
    /// multiprocessors idle unless several run side by side. Each piece in flight keeps a
    /// staging buffer and a scratch slot. The bits are the same for every setting.
    pub fn set_decode_pieces_in_flight(&mut self, pieces: usize) {
        self.pieces_in_flight = pieces.clamp(1, MAX_PIECES_IN_FLIGHT);
    }

    /// Sets whether [`decode_from`](Self::decode_from) queues each piece's bytes for the
    /// device before its chain is built, on the host, beside it: the chunks checked at decode
    /// (every stream's chunk holds its blocks' words) are known from the plan, so their copy
    /// across PCIe need not wait for the chain that says where each block's words lie in it.
    /// A plan of one piece is then decoded as one of several is (its chain built on a thread
    /// of its own). Default off, until measured on a device (`device_bench`'s `early`
    /// section). The bits are the same for every setting.
    pub fn set_decode_copy_early(&mut self, on: bool) {
        self.copy_early = on;
    }

    /// The copy stream and the other compute streams (of a decode or an encode in pieces),
    /// made on the first call.
    pub(super) fn pipe_streams(&self) -> Result<Arc<PipeStreams>, CudaError> {
        let mut held = self.pipe.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = held.as_ref() {
            return Ok(p.clone());
        }
        let new = || {
            self.ctx
                .new_stream()
                .map_err(ffi::driver_err("cuStreamCreate"))
        };
        let sides = (1..MAX_PIECES_IN_FLIGHT)
            .map(|_| new())
            .collect::<Result<_, _>>()?;
        let made = Arc::new(PipeStreams {
            copy: new()?,
            sides,
        });
        *held = Some(made.clone());
        Ok(made)
    }

    #[cfg(feature = "internals")]
    /// For benches: [`decode_from`](Self::decode_from) (with `host`) or
    /// [`decode_into`](Self::decode_into) of `plan` in at least two pieces (or one, copying
    /// early from `host`), and when each piece's steps happened.
    pub fn time_decode_pieces(
        &self,
        plan: &DecodePlan<'_>,
        host: Option<&HostBuffer>,
        out: &mut CudaSlice<u16>,
    ) -> Result<Vec<PieceTimes>, CudaError> {
        let mut timeline = None;
        self.decode_in_pieces_timed(plan, host, out, Some(&mut timeline))?;
        let Some(t) = timeline else {
            return Err(CudaError::Input {
                what: "a plan of one piece",
            });
        };
        let since = |e: &CudaEvent| {
            (t.start.elapsed_ms(e))
                .map(f64::from)
                .map_err(ffi::driver_err("cuEventElapsedTime"))
        };
        let piece = |(host, events): &([f64; 3], [CudaEvent; 4])| {
            let mut times = [0.0; 7];
            times[..3].copy_from_slice(host);
            for (t, e) in times[3..].iter_mut().zip(events) {
                *t = since(e)?;
            }
            Ok(times)
        };
        t.pieces.iter().map(piece).collect()
    }

    /// Decodes `plan` into `out` in pieces (one piece: upload, then launches), its words
    /// copied as they lie in `host` or packed without it. Errors in the whole plan's order:
    /// the host's (a chain's build, CRCs checked on the host) in the pieces' order, then the
    /// device's, each piece's word gather and chunk checks in the pieces' order, then every
    /// piece's launches as one chain's: the first failing chunk is the one a whole decode
    /// names (a test holds the two to each other).
    pub(super) fn decode_in_pieces(
        &self,
        plan: &DecodePlan<'_>,
        host: Option<&HostBuffer>,
        out: &mut CudaSlice<u16>,
    ) -> Result<(), CudaError> {
        self.decode_in_pieces_timed(plan, host, out, None)
    }

    /// [`decode_in_pieces`](Self::decode_in_pieces); with `timeline`, its events recorded
    /// there.
    fn decode_in_pieces_timed(
        &self,
        plan: &DecodePlan<'_>,
        host: Option<&HostBuffer>,
        out: &mut CudaSlice<u16>,
        timeline: Option<&mut Option<Timeline>>,
    ) -> Result<(), CudaError> {
        check_page_size(plan)?;
        let pieces = plan.pieces(self.piece_blocks, self.first_piece_blocks);
        if pieces.len() < 2 && !(self.copy_early && host.is_some()) {
            let up = self.upload_plan_timed(plan, host, None)?;
            return self.decode_uploaded_into(&up, out);
        }
        let bytes = host.map(HostBuffer::as_slice).transpose()?;
        let streams = self.pipe_streams()?;
        let computes = streams.computes(&self.stream, self.pieces_in_flight);
        let _one_chain = self.chain_lock.lock().unwrap_or_else(|e| e.into_inner());
        // Allocated before the pieces' launches, which wait for what the `Gpu`'s stream did.
        let verdicts = Verdicts::new(&self.stream, pieces.len())?;
        let pipe = ((&streams.copy, &computes[..]), &verdicts);
        let launched = self.launch_pieces(plan, &pieces, bytes, pipe, out, timeline);
        // Every exit waits for what was queued: the staging buffers, `host` and `out` are
        // the caller's again.
        for s in std::iter::once(&streams.copy).chain(computes.iter().copied()) {
            s.synchronize()
                .map_err(ffi::driver_err("cuStreamSynchronize"))?;
        }
        let launched = launched?;
        if verdicts.all_passed(&self.stream)? {
            return Ok(());
        }
        let mut chunk_of = Vec::new();
        let mut statuses: [Vec<u32>; 5] = Default::default();
        for (queued, piece_chunks, crcs) in &launched {
            let bytes = ffi::download_base(&self.stream, &queued.statuses)?;
            queued.check_gathered(&bytes, crcs)?;
            for (all, piece) in statuses.iter_mut().zip(queued.chain_statuses(&bytes)?) {
                all.extend(piece);
            }
            chunk_of.extend_from_slice(piece_chunks);
        }
        let [exp, resolve, sym, value, dequant] = &statuses;
        check_chain(&chunk_of, [exp, resolve, sym, value, dequant])
    }

    /// Queues every piece: its chain built (on a builder thread, a piece ahead of the
    /// queueing), its upload on the copy stream, its launches on its compute stream once the
    /// upload is done. Nothing synchronized but a staging buffer's last copy before it is
    /// refilled.
    fn launch_pieces<'p>(
        &self,
        plan: &'p DecodePlan<'_>,
        pieces: &[std::ops::Range<usize>],
        bytes: Option<&'p [u8]>,
        pipe: Pipe<'_>,
        out: &mut CudaSlice<u16>,
        timeline: Option<&mut Option<Timeline>>,
    ) -> Result<Vec<Launched<'p>>, CudaError> {
        let copy = pipe.0 .0;
        std::thread::scope(|scope| {
            // One piece waits built while the next is built: the host's chains stay bounded.
            let (tx, built) = std::sync::mpsc::sync_channel(1);
            scope.spawn(move || {
                for range in pieces {
                    let piece = self.build_piece(plan, range.clone(), bytes, copy);
                    let failed = piece.is_err();
                    // A closed channel: the queueing stopped on an error of its own.
                    if tx.send(piece).is_err() || failed {
                        break;
                    }
                }
            });
            // Returning drops `built`, so that a builder still at work stops at its next piece.
            let to_queue = (pieces, built);
            let launched = self.queue_built_pieces(plan, to_queue, bytes, pipe, out, timeline)?;
            if launched.len() != pieces.len() {
                return Err(CudaError::Input {
                    what: "a piece's chain was not built",
                });
            }
            Ok(launched)
        })
    }

    /// A piece's chain of `plan`'s chunks `range`, its level views, and where its words lie
    /// in `bytes` (decoding from them), or its chunks' CRCs checked on the host (without).
    fn build_piece<'p>(
        &self,
        plan: &'p DecodePlan<'_>,
        range: std::ops::Range<usize>,
        bytes: Option<&[u8]>,
        copy: &Arc<CudaStream>,
    ) -> Result<BuiltPiece<'p>, CudaError> {
        let (chain, levels) = self.resident_chain(plan, range, copy)?;
        let raw = match bytes {
            None => {
                check_crcs_host(&chain.checks)?;
                None
            }
            Some(b) => Some(chain.gather_parts(b, MERGE_GAP_BYTES)?),
        };
        Ok((chain, levels, raw))
    }

    /// Queues the pieces `pieces` as the builder hands them over, in order
    /// ([`launch_pieces`](Self::launch_pieces)), each piece's bytes copied early
    /// ([`copy_early`]) before its chain is waited for.
    fn queue_built_pieces<'p>(
        &self,
        plan: &'p DecodePlan<'_>,
        (pieces, built): (
            &[std::ops::Range<usize>],
            std::sync::mpsc::Receiver<Result<BuiltPiece<'p>, CudaError>>,
        ),
        bytes: Option<&'p [u8]>,
        ((copy, computes), verdicts): Pipe<'_>,
        out: &mut CudaSlice<u16>,
        mut timeline: Option<&mut Option<Timeline>>,
    ) -> Result<Vec<Launched<'p>>, CudaError> {
        let k = self.kernels(None)?;
        let m = Marker::new(timeline.is_some());
        // What the caller queued on its stream before (the output's allocation) comes first.
        let start = m.event(&self.stream)?;
        for s in std::iter::once(copy).chain(computes[1..].iter().copied()) {
            ffi::wait_event(s, &start)?;
        }
        let mut staging = self.staging.lock().unwrap_or_else(|e| e.into_inner());
        let mut uploaded: Vec<Option<CudaEvent>> = computes.iter().map(|_| None).collect();
        let mut launched = Vec::new();
        let mut marks = Vec::new();
        let early_from = bytes.filter(|_| self.copy_early);
        let mut handed = built.iter();
        for (i, range) in pieces.iter().enumerate() {
            let slot = i % computes.len();
            // The piece's upload starts with its early copy, if any, else after the wait below.
            let (early_start, early) = match early_from {
                Some(b) => (m.mark(copy)?, copy_early(plan, range.clone(), b, copy)),
                None => (None, None),
            };
            // The builder stopped early only on an error it handed over, or on none.
            let Some(piece) = handed.next() else { break };
            let (chain, levels, places) = piece?;
            let raw = bytes.zip(places);
            let built = m.ms();
            // The slot's staging buffer was last copied from as many pieces back as are in
            // flight; its scratch is the last piece's on the same compute stream.
            if let Some(e) = uploaded[slot].take() {
                e.synchronize()
                    .map_err(ffi::driver_err("cuEventSynchronize"))?;
            }
            let copy_start = match early_start {
                Some(e) => Some(e),
                None => m.mark(copy)?,
            };
            let source = WordSource::of(&raw, early);
            let on = (copy, &mut staging[slot]);
            let compute = computes[slot];
            let queued = self.queue_chain(&chain, source, on, slot, Some(levels), compute)?;
            let done = m.event(copy)?;
            let (copy_end, queued_at) = (m.mark(copy)?, m.ms());
            ffi::wait_event(compute, &done)?;
            let launch_start = m.mark(compute)?;
            self.launch_chain(compute, &k, &queued.dev, plan.output(), out)?;
            queued.judge(compute, &k.chain_verdict, verdicts.word(i)?)?;
            let launch_end = m.mark(compute)?;
            uploaded[slot] = Some(done);
            if let (Some(a), Some(b), Some(c), Some(d)) =
                (copy_start, copy_end, launch_start, launch_end)
            {
                marks.push(([built, queued_at, m.ms()], [a, b, c, d]));
            }
            launched.push((queued, chain.chunk_of, chain.checks));
        }
        if let Some(t) = timeline.as_mut() {
            **t = Some(Timeline {
                start,
                pieces: marks,
            });
        }
        Ok(launched)
    }
}

/// The events a decode in pieces records on its streams: those that order them and, where a
/// timeline is kept, those that time its steps (timed events cost more, so only then), with the
/// host's milliseconds since it began.
struct Marker {
    timed: bool,
    host_start: std::time::Instant,
}

impl Marker {
    fn new(timed: bool) -> Self {
        Marker {
            timed,
            host_start: std::time::Instant::now(),
        }
    }

    /// An event on `s` now (timed where a timeline is kept).
    fn event(&self, s: &CudaStream) -> Result<CudaEvent, CudaError> {
        ffi::record_event(s, self.timed)
    }

    /// A timed event on `s` now where a timeline is kept; none otherwise.
    fn mark(&self, s: &CudaStream) -> Result<Option<CudaEvent>, CudaError> {
        self.timed.then(|| self.event(s)).transpose()
    }

    /// Milliseconds since the marker was made, on the host.
    fn ms(&self) -> f64 {
        self.host_start.elapsed().as_secs_f64() * 1e3
    }
}

/// The runs of `bytes` a decode copies for `plan`'s chunks `range` when their words lie in
/// their checked chunks ([`DecodePlan::checked_runs`]), queued on `copy` now, before the
/// piece's chain is built ([`Gpu::set_decode_copy_early`]). `None` where there is nothing to
/// copy early or it could not be queued: the piece's bytes are then copied once its chain is
/// built, as without the setting, and that reports what failed, in the plan's order.
fn copy_early(
    plan: &DecodePlan<'_>,
    range: std::ops::Range<usize>,
    bytes: &[u8],
    copy: &Arc<CudaStream>,
) -> Option<EarlyCopy> {
    let runs = plan.checked_runs(range, bytes, MERGE_GAP_BYTES).ok()?;
    if runs.len() == 0 {
        return None;
    }
    let copied = DevBuf::upload_runs(copy, bytes, runs.runs()).ok()?;
    Some((runs, copied))
}
