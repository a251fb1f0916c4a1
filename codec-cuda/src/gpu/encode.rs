//! Encoding on a device: a plan's five launches over K/V already there, and the chunks
//! copied back ([`Gpu::encode`]).

use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DeviceRepr, PinnedHostSlice};

use super::resident::LevelViews;
use super::{best_time, Gpu, Kernels};
use crate::encode_plan::{copy_chunks, part_starts, split_sealed, EncodeChain, EncodePlan};
use crate::error::CudaError;
use crate::ffi::{self, DevBuf, LANES};

impl Gpu {
    /// Copies `data` to a new buffer on this device (e.g. a cache's
    /// [`Source::of_view`](crate::encode_plan::Source::of_view) bytes for [`encode`](Self::encode)).
    pub fn upload<T: DeviceRepr>(&self, data: &[T]) -> Result<CudaSlice<T>, CudaError> {
        self.stream
            .clone_htod(data)
            .map_err(ffi::driver_err("cuMemcpyHtoDAsync"))
    }

    /// Encodes every chunk of `plan` from `src`, a buffer on this device holding the plan's
    /// [`Source`](crate::encode_plan::Source) (e.g. a serving engine's K/V; `T` any type whose
    /// bytes are the source dtype's elements): what [`EncodePlan::encode_host`] returns. The
    /// plan is uploaded ([`upload_encode_plan`](Self::upload_encode_plan)), then encoded once
    /// ([`encode_uploaded`](Self::encode_uploaded)); or, where it holds more coded blocks
    /// than [`set_encode_piece_blocks`](Self::set_encode_piece_blocks) asks, in pieces: runs
    /// of whole chunks, each piece's chunks copied back while the next piece's launches run.
    pub fn encode<T>(
        &self,
        plan: &EncodePlan<'_, '_>,
        src: &CudaSlice<T>,
    ) -> Result<Vec<Vec<u8>>, CudaError> {
        let pieces = plan.pieces(self.encode_piece_blocks);
        if pieces.len() > 1 {
            return self.encode_in_pieces(plan, &pieces, src);
        }
        let threads = self.upload_threads;
        self.encode_whole(plan, src, |ch, readback| {
            read_vectors(ch, &self.stream, readback, threads)
        })
    }

    /// [`encode`](Self::encode) of `plan` whole, each chunk's sealed bytes handed to `read`
    /// where they lie after their copy back (as
    /// [`encode_uploaded_with`](Self::encode_uploaded_with) hands them over) instead of
    /// copied into a vector each. The plan's upload and launches are queued one after the
    /// other, with no wait between them.
    pub fn encode_with<T, R>(
        &self,
        plan: &EncodePlan<'_, '_>,
        src: &CudaSlice<T>,
        read: impl FnOnce(&[&[u8]]) -> R,
    ) -> Result<R, CudaError> {
        self.encode_whole(plan, src, |ch, readback| {
            read_sealed_once(ch, &self.stream, readback, read)
        })
    }

    /// `plan` encoded whole, its upload and launches queued one after the other, then
    /// `finish` given its chain, its buffers and the readback buffer to copy the chunks back.
    fn encode_whole<T, R>(
        &self,
        plan: &EncodePlan<'_, '_>,
        src: &CudaSlice<T>,
        finish: impl FnOnce(Finished<'_>, &mut Readback) -> Result<R, CudaError>,
    ) -> Result<R, CudaError> {
        let (ch, levels) = self.resident_encode_chain(plan, 0..plan.chunks())?;
        let _one_chain = self.chain_lock.lock().unwrap_or_else(|e| e.into_inner());
        let mut staging = self.staging.lock().unwrap_or_else(|e| e.into_inner());
        let encoded = (|| {
            let dev = self.queue_encode(&ch, levels, (&self.stream, &mut staging[0]), 0)?;
            let up = UploadedEncodePlan {
                ch,
                dev,
                stream: self.stream.clone(),
            };
            self.encode_launched(&up, src, None)?;
            let mut readback = self.readback.lock().unwrap_or_else(|e| e.into_inner());
            finish((&up.ch, &up.dev), &mut readback)
        })();
        // Every exit waits for what was queued: the staging buffer is free for the next call.
        self.sync()?;
        encoded
    }

    /// Sets the coded blocks of a piece of [`encode`](Self::encode): a plan of at least one
    /// and a half times as many is encoded in pieces of about this many blocks; 0 encodes
    /// every plan whole. Default: [`DEFAULT_ENCODE_PIECE_BLOCKS`]. The chunks are the same
    /// for every setting.
    pub fn set_encode_piece_blocks(&mut self, blocks: usize) {
        self.encode_piece_blocks = blocks;
    }

    /// Builds `plan`'s launch records and uploads them with its tables, constants and
    /// reference queries in one packed copy, its large outputs in this `Gpu`'s kept scratch:
    /// what [`encode_uploaded`](Self::encode_uploaded) needs to encode any source laid out as
    /// the plan's, as often as wanted (a server encoding each new context of one shape).
    pub fn upload_encode_plan(
        &self,
        plan: &EncodePlan<'_, '_>,
    ) -> Result<UploadedEncodePlan, CudaError> {
        let (ch, levels) = self.resident_encode_chain(plan, 0..plan.chunks())?;
        let dev = self.upload_encode(&ch, levels)?;
        Ok(UploadedEncodePlan {
            ch,
            dev,
            stream: self.stream.clone(),
        })
    }

    /// Encodes every chunk of the uploaded plan from `src` (as [`encode`](Self::encode)):
    /// five launches (blocks, lanes, blocks placed, blocks written packed with their CRC
    /// shares, chunks sealed) with no host step between them, then the chunks' places and
    /// their bytes copied back (two copies, the second through pinned memory kept for the
    /// next call). `up` is borrowed mutably: its statuses hold one encode at a time; encodes
    /// and decodes of one `Gpu` run one at a time (they share its scratch).
    pub fn encode_uploaded<T>(
        &self,
        up: &mut UploadedEncodePlan,
        src: &CudaSlice<T>,
    ) -> Result<Vec<Vec<u8>>, CudaError> {
        let threads = self.upload_threads;
        self.encode_uploaded_then(up, src, |ch, readback| {
            read_vectors(ch, &self.stream, readback, threads)
        })
    }

    /// [`encode_uploaded`](Self::encode_uploaded), each chunk's sealed bytes handed to `read`
    /// where they lie after their copy back (in pinned memory the `Gpu` keeps, borrowed for
    /// the call), instead of copied into a vector each: for a caller that sends or writes
    /// them on. `read` gets the chunks in order.
    pub fn encode_uploaded_with<T, R>(
        &self,
        up: &mut UploadedEncodePlan,
        src: &CudaSlice<T>,
        read: impl FnOnce(&[&[u8]]) -> R,
    ) -> Result<R, CudaError> {
        self.encode_uploaded_then(up, src, |ch, readback| {
            read_sealed_once(ch, &self.stream, readback, read)
        })
    }

    /// The uploaded plan's launches over `src`, then `finish` given its chain, its buffers
    /// and the readback buffer to copy the chunks back.
    fn encode_uploaded_then<T, R>(
        &self,
        up: &mut UploadedEncodePlan,
        src: &CudaSlice<T>,
        finish: impl FnOnce(Finished<'_>, &mut Readback) -> Result<R, CudaError>,
    ) -> Result<R, CudaError> {
        let _one_chain = self.chain_lock.lock().unwrap_or_else(|e| e.into_inner());
        self.encode_launched(up, src, None)?;
        let mut readback = self.readback.lock().unwrap_or_else(|e| e.into_inner());
        finish((&up.ch, &up.dev), &mut readback)
    }

    #[cfg(feature = "internals")]
    /// For benches: the best time in seconds over `reps` runs of [`encode`](Self::encode) and
    /// of each of its steps alone.
    pub fn time_encode<T>(
        &self,
        plan: &EncodePlan<'_, '_>,
        src: &CudaSlice<T>,
        reps: usize,
    ) -> Result<EncodeTimes, CudaError> {
        let whole = best_time(reps, || self.encode(plan, src).map(drop))?;
        let handed_over = best_time(reps, || self.encode_with(plan, src, |_| ()))?;
        let all = 0..plan.chunks();
        let chain = best_time(reps, || {
            self.resident_encode_chain(plan, all.clone()).map(drop)
        })?;
        let ch = self.resident_encode_chain(plan, all)?.0;
        let upload = best_time(reps, || {
            self.upload_encode(&ch, self.resident_views(&self.stream)?)
                .map(drop)
        })?;
        let mut up = self.upload_encode_plan(plan)?;
        let uploaded = best_time(reps, || self.encode_uploaded(&mut up, src).map(drop))?;
        let launches = best_time(reps, || {
            let _one_chain = self.chain_lock.lock().unwrap_or_else(|e| e.into_inner());
            self.encode_launched(&up, src, None)?;
            self.sync()
        })?;
        let mut stages = [f64::INFINITY; ffi::ENCODE_STAGES];
        for _ in 0..reps.max(1) {
            let _one_chain = self.chain_lock.lock().unwrap_or_else(|e| e.into_inner());
            self.sync()?;
            let mut t = std::time::Instant::now();
            let mut done = |stage: usize| {
                self.sync()?;
                stages[stage] = stages[stage].min(t.elapsed().as_secs_f64());
                t = std::time::Instant::now();
                Ok(())
            };
            self.encode_launched(&up, src, Some(&mut done))?;
        }
        let mut readback = self.readback.lock().unwrap_or_else(|e| e.into_inner());
        let (done, s, threads) = ((&up.ch, &up.dev), &self.stream, self.upload_threads);
        let copy_back = best_time(reps, || {
            read_vectors(done, s, &mut readback, threads).map(drop)
        })?;
        let read_back = best_time(reps, || read_sealed_once(done, s, &mut readback, |_| ()))?;
        Ok(EncodeTimes {
            whole,
            handed_over,
            chain,
            upload,
            uploaded,
            launches,
            stages,
            copy_back,
            read_back,
        })
    }

    /// Queues the uploaded plan's five launches over `src` (`stage_done` as
    /// [`ffi::launch_encode_chain`] takes it).
    fn encode_launched<T>(
        &self,
        up: &UploadedEncodePlan,
        src: &CudaSlice<T>,
        stage_done: Option<&mut dyn FnMut(usize) -> Result<(), CudaError>>,
    ) -> Result<(), CudaError> {
        if !Arc::ptr_eq(&up.stream, &self.stream) {
            return Err(CudaError::Input {
                what: "an encode plan uploaded through another Gpu",
            });
        }
        up.ch
            .check_source_bytes(src.len() * std::mem::size_of::<T>())?;
        let k = self.kernels(None)?;
        let source = up.ch.dev_source(src);
        ffi::launch_encode_chain(
            &self.stream,
            &encode_kernels(&k),
            &up.dev,
            &source,
            stage_done,
        )
    }

    /// [`queue_encode`](Self::queue_encode) on this `Gpu`'s stream through its first
    /// staging buffer and scratch, then the stream synchronized (the staging buffer free
    /// again).
    fn upload_encode(
        &self,
        ch: &EncodeChain,
        levels: LevelViews,
    ) -> Result<ffi::EncodeDev, CudaError> {
        let mut staging = self.staging.lock().unwrap_or_else(|e| e.into_inner());
        let dev = self.queue_encode(ch, levels, (&self.stream, &mut staging[0]), 0)?;
        self.sync()?;
        Ok(dev)
    }

    /// The encode chain's inputs in one packed upload queued on `s` through `staging` (the
    /// caller keeps it until `s` has passed the copy; the exponent slots of `tables` are
    /// written by the first launch), its table maps and channel constants those of `levels`
    /// (resident on the device, where `ch` placed them); its large outputs (symbols to the
    /// blocks' places and the sealed chunks, of which only these and their places are copied
    /// back) in scratch slot `slot`; its results and statuses zeroed.
    fn queue_encode(
        &self,
        ch: &EncodeChain,
        (map, consts): LevelViews,
        (s, staging): (&Arc<CudaStream>, &mut Option<PinnedHostSlice<u8>>),
        slot: usize,
    ) -> Result<ffi::EncodeDev, CudaError> {
        let n = ch.blocks.len();
        let mut p = ffi::Packer::default();
        let (qref, tau, rot) = (p.add(&ch.qref), p.add(&ch.tau), p.add(&ch.rot));
        let (table_list, radius) = (p.add(&ch.table_list), p.add(&ch.radius));
        let (blocks, chunks) = (p.add(&ch.blocks), p.add(&ch.chunks));
        // Last: its exponent slots, written by the first launch, are allocated, not copied.
        let tables = p.add_with_room(&[&ch.tables[..]], ch.blocks.len() * 256);
        let base = p.queue(s, staging, self.upload_threads)?;
        // The large outputs in the kept scratch, as they are: the launches write every byte
        // of them they read (a host-run test fills them with garbage first).
        let mut o = ffi::Packer::default();
        let symbols = o.reserve::<u8>(ch.n_symbols);
        let symbol_table = o.reserve::<u16>(ch.n_symbols);
        let (q, escapes) = (o.reserve::<i32>(ch.n_q), o.reserve::<i32>(ch.n_q));
        let words = o.reserve::<u32>(ch.n_words);
        let (block_at, sealed) = (o.reserve::<u64>(n), o.reserve::<u8>(ch.n_sealed()));
        let scratch = self.scratch(slot, o.total(), s)?;
        let (b, x) = (&base, &scratch);
        Ok(ffi::EncodeDev {
            importance: ch.importance,
            qref: DevBuf::view(b, qref)?,
            tau: DevBuf::view(b, tau)?,
            rot: DevBuf::view(b, rot)?,
            consts,
            map,
            radius: DevBuf::view(b, radius)?,
            blocks: DevBuf::view(b, blocks)?,
            chunks: DevBuf::view(b, chunks)?,
            q: DevBuf::view(x, q)?,
            escapes: DevBuf::view(x, escapes)?,
            results: DevBuf::zeros(s, n)?,
            lanes: ffi::LaneEncodeDev {
                symbols: DevBuf::view(x, symbols)?,
                symbol_table: DevBuf::view(x, symbol_table)?,
                tables: DevBuf::view(b, tables)?,
                table_list: DevBuf::view(b, table_list)?,
                words: DevBuf::view(x, words)?,
                lane_len: DevBuf::zeros(s, n * LANES)?,
                blocks: DevBuf::zeros(s, n)?,
                status: DevBuf::zeros(s, n * LANES)?,
            },
            block_at: DevBuf::view(x, block_at)?,
            chunk_results: DevBuf::zeros(s, ch.chunks.len())?,
            sealed: DevBuf::view(x, sealed)?,
            seal_results: DevBuf::zeros(s, ch.chunks.len())?,
            heads: ch.heads,
            head_dim: ch.head_dim,
        })
    }
}

/// Coded blocks a piece of [`Gpu::encode`] holds by default ([`Gpu::set_encode_piece_blocks`]):
/// a piece of fewer runs its launches on too little of a device for the copy back beside
/// them to pay (codec-cuda's README has the figures).
pub const DEFAULT_ENCODE_PIECE_BLOCKS: usize = 4096;

/// A piece of an encode whose launches are queued: its chain, buffers, first chunk in the
/// plan and the event after its last launch.
struct LaunchedPiece {
    ch: EncodeChain,
    dev: ffi::EncodeDev,
    first_chunk: usize,
    done: CudaEvent,
}

impl Gpu {
    /// [`encode`](Self::encode) of `plan` in `pieces` (runs of its chunks, in order), with
    /// the chunks copied into vectors.
    fn encode_in_pieces<T>(
        &self,
        plan: &EncodePlan<'_, '_>,
        pieces: &[Range<usize>],
        src: &CudaSlice<T>,
    ) -> Result<Vec<Vec<u8>>, CudaError> {
        let copy = self.pipe_streams()?.copy.clone();
        let _one_chain = self.chain_lock.lock().unwrap_or_else(|e| e.into_inner());
        let encoded = self.queue_pieces(plan, pieces, src, &copy);
        // Every exit waits for what was queued: the staging, scratch and readback buffers
        // are free for the next call.
        for s in [&copy, &self.stream] {
            s.synchronize()
                .map_err(ffi::driver_err("cuStreamSynchronize"))?;
        }
        encoded
    }

    /// Queues each piece (its chain built, uploaded and launched on this `Gpu`'s stream,
    /// after the piece before, with the staging buffer and scratch slot of its parity), then
    /// copies the piece before back on the copy stream and into vectors while this one's
    /// launches run.
    fn queue_pieces<T>(
        &self,
        plan: &EncodePlan<'_, '_>,
        pieces: &[Range<usize>],
        src: &CudaSlice<T>,
        copy: &Arc<CudaStream>,
    ) -> Result<Vec<Vec<u8>>, CudaError> {
        let k = self.kernels(None)?;
        let s = &self.stream;
        let mut staging = self.staging.lock().unwrap_or_else(|e| e.into_inner());
        let mut readback = self.readback.lock().unwrap_or_else(|e| e.into_inner());
        let mut chunks = Vec::with_capacity(plan.chunks());
        let mut launched: Option<LaunchedPiece> = None;
        for (i, range) in pieces.iter().enumerate() {
            let slot = i % 2;
            let (ch, levels) = self.resident_encode_chain(plan, range.clone())?;
            ch.check_source_bytes(src.len() * std::mem::size_of::<T>())?;
            // The slot's staging buffer and scratch were last used by the piece two back,
            // whose chunks were read back (after its launches, after its upload) last turn.
            let dev = self.queue_encode(&ch, levels, (s, &mut staging[slot]), slot)?;
            let source = ch.dev_source(src);
            ffi::launch_encode_chain(s, &encode_kernels(&k), &dev, &source, None)?;
            let first_chunk = range.start;
            let piece = LaunchedPiece {
                ch,
                dev,
                first_chunk,
                done: ffi::record_event(s, false)?,
            };
            if let Some(before) = launched.replace(piece) {
                chunks.extend(self.read_piece(before, copy, &mut readback)?);
            }
        }
        if let Some(last) = launched {
            chunks.extend(self.read_piece(last, copy, &mut readback)?);
        }
        Ok(chunks)
    }

    /// A launched piece's chunks, copied back on `copy` once its launches are done and into
    /// vectors; errors name the chunk's index in the plan.
    fn read_piece(
        &self,
        piece: LaunchedPiece,
        copy: &Arc<CudaStream>,
        readback: &mut Option<PinnedHostSlice<u8>>,
    ) -> Result<Vec<Vec<u8>>, CudaError> {
        ffi::wait_event(copy, &piece.done)?;
        let done = (&piece.ch, &piece.dev);
        read_vectors(done, copy, readback, self.upload_threads)
            .map_err(chunks_after(piece.first_chunk))
    }
}

/// An encode plan on one device ([`Gpu::upload_encode_plan`]): its launch records, tables and
/// constants uploaded and its scratch allocated, for [`Gpu::encode_uploaded`].
#[derive(Debug)]
pub struct UploadedEncodePlan {
    ch: EncodeChain,
    dev: ffi::EncodeDev,
    /// The stream (so the device) it was uploaded to.
    stream: Arc<CudaStream>,
}

impl UploadedEncodePlan {
    /// Chunks the plan encodes.
    pub fn chunks(&self) -> usize {
        self.ch.chunks.len()
    }
}

/// `Gpu::time_encode`'s figures (feature `internals`): best times in seconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EncodeTimes {
    /// The whole [`Gpu::encode`].
    pub whole: f64,
    /// The whole [`Gpu::encode_with`], the chunks handed over in pinned memory.
    pub handed_over: f64,
    /// Building the plan's chain on the host.
    pub chain: f64,
    /// Its inputs packed and uploaded, its outputs allocated.
    pub upload: f64,
    /// [`Gpu::encode_uploaded`] (the plan uploaded once): launches and copies back.
    pub uploaded: f64,
    /// The five launches alone.
    pub launches: f64,
    /// Each launch alone, synchronized: `kvc_encode_blocks` (quantization, exponents and
    /// their tables), the lane encoder, the blocks' places, the blocks written (with their
    /// CRC shares), the chunks sealed.
    pub stages: [f64; 5],
    /// The chunks' places and bytes copied back.
    pub copy_back: f64,
    /// The same, the chunks handed over where they lie in pinned memory
    /// ([`Gpu::encode_uploaded_with`]) instead of copied into vectors.
    pub read_back: f64,
}

/// An encode's chain and buffers once its launches are queued.
type Finished<'a> = (&'a EncodeChain, &'a ffi::EncodeDev);

/// The pinned memory a `Gpu` keeps for its encodes' copies back.
type Readback = Option<PinnedHostSlice<u8>>;

/// Copies back of a [`Gpu::encode`]'s chunks into vectors: each part's chunks copied into
/// vectors while the next part crosses.
const COPY_BACK_PARTS: usize = 4;

/// The chunks the launches of `done` sealed, copied back on `s` once they are done: their
/// places, then the sealed bytes through `readback` (pinned memory the caller keeps) in
/// `parts` copies of whole chunks and about equal bytes, each part's chunks handed to `read`
/// there as soon as they are (while the next part is copied), in order.
fn read_sealed<R>(
    (ch, dev): Finished<'_>,
    s: &Arc<CudaStream>,
    readback: &mut Readback,
    parts: usize,
    mut read: impl FnMut(&[&[u8]]) -> R,
) -> Result<Vec<R>, CudaError> {
    let places = ch.sealed_places(&dev.seal_results.download(s)?)?;
    let starts = part_starts(&places, parts);
    let end_of = |c: usize| c.checked_sub(1).map_or(0, |last| places[last].end);
    let ends: Vec<usize> = starts[1..].iter().map(|&c| end_of(c)).collect();
    dev.sealed.download_pinned(s, &ends, readback, |i, bytes| {
        let first = starts[i];
        let chunks = split_sealed(bytes, &places[first..starts[i + 1]]);
        let chunks = chunks.map_err(chunks_after(first))?;
        Ok(read(&chunks))
    })
}

/// An error of a run of chunks as an error of the whole, the run starting at chunk `first`.
fn chunks_after(first: usize) -> impl Fn(CudaError) -> CudaError {
    move |e| match e {
        CudaError::Encode { chunk, what } => CudaError::Encode {
            chunk: chunk + first,
            what,
        },
        e => e,
    }
}

/// [`read_sealed`] in one copy, every chunk handed to `read` at once.
fn read_sealed_once<R>(
    done: Finished<'_>,
    s: &Arc<CudaStream>,
    readback: &mut Readback,
    read: impl FnOnce(&[&[u8]]) -> R,
) -> Result<R, CudaError> {
    let mut read = Some(read);
    let mut got = read_sealed(done, s, readback, 1, |chunks| {
        read.take().map(|f| f(chunks))
    })?;
    got.pop().flatten().ok_or(CudaError::Input {
        what: "a copy back in one part read in another",
    })
}

/// [`read_sealed`] in [`COPY_BACK_PARTS`] copies, each part's chunks copied into vectors on
/// `threads` threads ([`copy_chunks`]).
fn read_vectors(
    done: Finished<'_>,
    s: &Arc<CudaStream>,
    readback: &mut Readback,
    threads: usize,
) -> Result<Vec<Vec<u8>>, CudaError> {
    let parts = read_sealed(done, s, readback, COPY_BACK_PARTS, |chunks| {
        copy_chunks(chunks, threads)
    })?;
    Ok(parts.into_iter().flatten().collect())
}

/// The encode chain's entry points.
fn encode_kernels(k: &Kernels) -> ffi::EncodeKernels<'_> {
    ffi::EncodeKernels {
        blocks: &k.encode_blocks,
        lanes: &k.lane_encode,
        place: &k.place_blocks,
        write: &k.write_blocks,
        seal: &k.seal_chunks,
    }
}
