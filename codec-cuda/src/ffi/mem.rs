//! Device memory: buffers, views into one packed upload, pinned staging, and the addresses a
//! launch passes.

use std::marker::PhantomData;
use std::mem::size_of;
use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr, DeviceRepr, PinnedHostSlice,
    SyncOnDrop, ValidAsZeroBits,
};

use super::driver_err;
use crate::error::CudaError;

/// A buffer on the device and the number of elements kernels may touch in it (invariant 6:
/// `len <= slice.len()`, or for a view `offset + len * size_of::<T>() <= base.len()`; an empty
/// buffer is one zeroed element, since the driver allocates no empty buffer).
#[derive(Debug)]
pub(crate) struct DevBuf<T> {
    mem: DevMem<T>,
    len: usize,
}

/// Where a [`DevBuf`] lies: its own allocation, or a part of a packed upload or scratch
/// ([`Packer`]).
#[derive(Debug)]
enum DevMem<T> {
    Own(CudaSlice<T>),
    View {
        base: Arc<CudaSlice<u8>>,
        /// Bytes from the base's start: a multiple of [`PACK_ALIGN`].
        offset: usize,
        _t: PhantomData<T>,
    },
}

impl<T: DeviceRepr + ValidAsZeroBits> DevBuf<T> {
    /// Copies `data` to the device.
    pub(crate) fn upload(stream: &Arc<CudaStream>, data: &[T]) -> Result<Self, CudaError> {
        let slice = if data.is_empty() {
            stream.alloc_zeros(1)
        } else {
            stream.clone_htod(data)
        }
        .map_err(driver_err("cuMemcpyHtoDAsync"))?;
        Ok(DevBuf {
            mem: DevMem::Own(slice),
            len: data.len(),
        })
    }

    /// The ranges `runs` of `data` copied to the device back to back, a copy each (an input
    /// error if one lies outside `data`).
    pub(crate) fn upload_runs(
        stream: &Arc<CudaStream>,
        data: &[T],
        runs: &[std::ops::Range<usize>],
    ) -> Result<Self, CudaError> {
        let parts = (runs.iter())
            .map(|r| data.get(r.clone()))
            .collect::<Option<Vec<&[T]>>>()
            .ok_or(CudaError::Input {
                what: "a range to copy outside the bytes",
            })?;
        let len: usize = parts.iter().map(|p| p.len()).sum();
        // SAFETY: invariant 7 (`T` is a device value, valid in any bits): the allocation is
        // left unset, and the copies queued next on the same stream set every element (the
        // parts' lengths sum to `len`) before anything queued after them reads it; the one
        // element of an empty buffer (the driver allocates none empty) is counted 0, so no
        // launch reads it (invariant 6). Not zeroed: a memset is a kernel, which on a copy
        // stream can wait behind other streams' launches.
        let mut slice =
            unsafe { stream.alloc::<T>(len.max(1)) }.map_err(driver_err("cuMemAllocAsync"))?;
        let mut at = 0;
        for part in parts {
            let mut dst = (slice.try_slice_mut(at..at + part.len())).ok_or(CudaError::Input {
                what: "a range to copy past its buffer",
            })?;
            (stream.memcpy_htod(part, &mut dst)).map_err(driver_err("cuMemcpyHtoDAsync"))?;
            at += part.len();
        }
        Ok(DevBuf {
            mem: DevMem::Own(slice),
            len,
        })
    }

    /// `len` zeroed elements on the device.
    pub(crate) fn zeros(stream: &Arc<CudaStream>, len: usize) -> Result<Self, CudaError> {
        let slice = stream
            .alloc_zeros(len.max(1))
            .map_err(driver_err("cuMemAllocAsync"))?;
        Ok(DevBuf {
            mem: DevMem::Own(slice),
            len,
        })
    }

    /// The part `slot` of `base`, a packed upload or a scratch laid out by a [`Packer`].
    pub(crate) fn view(base: &Arc<CudaSlice<u8>>, slot: PackSlot<T>) -> Result<Self, CudaError> {
        let end = slot
            .len
            .checked_mul(size_of::<T>())
            .and_then(|b| b.checked_add(slot.offset));
        if end.is_none_or(|e| e > base.len()) || !slot.offset.is_multiple_of(PACK_ALIGN) {
            return Err(CudaError::Input {
                what: "a packed part outside its upload",
            });
        }
        Ok(DevBuf {
            mem: DevMem::View {
                base: base.clone(),
                offset: slot.offset,
                _t: PhantomData,
            },
            len: slot.len,
        })
    }

    /// Overwrites the buffer's elements with `data`, as many (buffers of their own only), on
    /// `stream`.
    pub(crate) fn write(&mut self, stream: &Arc<CudaStream>, data: &[T]) -> Result<(), CudaError> {
        let DevMem::Own(slice) = &mut self.mem else {
            return Err(CudaError::Input {
                what: "a packed input is not written",
            });
        };
        // cudarc asserts the destination holds the source: checked first.
        if data.len() != self.len || data.len() > slice.len() {
            return Err(CudaError::Input {
                what: "a write of another length than its buffer's",
            });
        }
        if data.is_empty() {
            return Ok(());
        }
        stream
            .memcpy_htod(data, slice)
            .map_err(driver_err("cuMemcpyHtoDAsync"))
    }

    /// Overwrites elements `at..at + data.len()` of the buffer with `data` (buffers of their
    /// own only), on `stream`.
    pub(crate) fn write_at(
        &mut self,
        stream: &Arc<CudaStream>,
        at: usize,
        data: &[T],
    ) -> Result<(), CudaError> {
        let outside = CudaError::Input {
            what: "a write outside its buffer",
        };
        let DevMem::Own(slice) = &mut self.mem else {
            return Err(CudaError::Input {
                what: "a packed input is not written",
            });
        };
        if data.is_empty() {
            return Ok(());
        }
        let end = at.checked_add(data.len()).filter(|&e| e <= self.len);
        // (`len <= slice.len()`, invariant 6: the part lies in the slice.)
        let part = end.and_then(|end| slice.try_slice_mut(at..end));
        let mut part = part.ok_or(outside)?;
        stream
            .memcpy_htod(data, &mut part)
            .map_err(driver_err("cuMemcpyHtoDAsync"))
    }

    /// Copies the buffer's `len` elements back (buffers of their own only: the launches'
    /// outputs).
    pub(crate) fn download(&self, stream: &Arc<CudaStream>) -> Result<Vec<T>, CudaError> {
        let DevMem::Own(slice) = &self.mem else {
            return Err(CudaError::Input {
                what: "a packed input is not downloaded",
            });
        };
        let mut v = stream
            .clone_dtoh(slice)
            .map_err(driver_err("cuMemcpyDtoHAsync"))?;
        v.truncate(self.len);
        Ok(v)
    }

    /// Elements kernels may touch.
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

impl DevBuf<u32> {
    /// The buffer's elements copied back on `stream` (synchronized): of a view, its part of
    /// its base only.
    pub(crate) fn download_part(&self, stream: &Arc<CudaStream>) -> Result<Vec<u32>, CudaError> {
        let DevMem::View { base, offset, .. } = &self.mem else {
            return self.download(stream);
        };
        if self.len == 0 {
            return Ok(Vec::new());
        }
        let end = self.len.checked_mul(4).and_then(|b| b.checked_add(*offset));
        let part = end.and_then(|end| base.try_slice(*offset..end));
        let part = part.ok_or(CudaError::Input {
            what: "a view outside its base",
        })?;
        let bytes = (stream.clone_dtoh(&part)).map_err(driver_err("cuMemcpyDtoHAsync"))?;
        let word = |b: &[u8]| u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        Ok(bytes.chunks_exact(4).map(word).collect())
    }

    /// A view's elements read from `base`, the bytes of its base as copied back (one copy
    /// for every status of a chain, [`download_base`]).
    pub(crate) fn read_in(&self, base: &[u8]) -> Result<Vec<u32>, CudaError> {
        let outside = CudaError::Input {
            what: "a status outside the bytes copied back",
        };
        let DevMem::View { offset, .. } = &self.mem else {
            return Err(outside);
        };
        let end = self.len.checked_mul(4).and_then(|b| b.checked_add(*offset));
        let bytes = end.and_then(|end| base.get(*offset..end)).ok_or(outside)?;
        let word = |b: &[u8]| u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        Ok(bytes.chunks_exact(4).map(word).collect())
    }
}

/// Every byte of `base` copied back to the host (the stream synchronized).
pub(crate) fn download_base(
    stream: &Arc<CudaStream>,
    base: &CudaSlice<u8>,
) -> Result<Vec<u8>, CudaError> {
    stream
        .clone_dtoh(base)
        .map_err(driver_err("cuMemcpyDtoHAsync"))
}

impl DevBuf<u8> {
    /// Copies bytes `0..ends.last()` back through `pinned` (page-locked memory the caller
    /// keeps for the next copy, grown when short) in parts, part `i` ending at `ends[i]`
    /// (not decreasing), and hands each part's bytes to `read` (`read(i, bytes[..ends[i]])`)
    /// as soon as it is there, while the parts after it are still being copied: the
    /// device's copies at the speed of pinned memory, beside `read`'s host work.
    pub(crate) fn download_pinned<R>(
        &self,
        stream: &Arc<CudaStream>,
        ends: &[usize],
        pinned: &mut Option<PinnedHostSlice<u8>>,
        mut read: impl FnMut(usize, &[u8]) -> Result<R, CudaError>,
    ) -> Result<Vec<R>, CudaError> {
        let (slice, offset) = match &self.mem {
            DevMem::Own(slice) => (slice, 0),
            DevMem::View { base, offset, .. } => (&**base, *offset),
        };
        let len = ends.last().copied().unwrap_or(0);
        if len > self.len || ends.windows(2).any(|w| w[0] > w[1]) {
            return Err(CudaError::Input {
                what: "a download outside its buffer",
            });
        }
        // Cached (not write-combined): the host reads it.
        let buf = pinned_at_least(stream, pinned, len.max(1), 0)?;
        let host = buf
            .as_mut_slice()
            .map_err(driver_err("cuEventSynchronize"))?;
        let copied = |host: &mut [u8]| -> Result<Vec<CudaEvent>, CudaError> {
            let mut start = 0;
            let mut events = Vec::with_capacity(ends.len());
            for &end in ends {
                if end > start {
                    // The destination is exactly the part: the driver copies its length.
                    let src = slice.slice(offset + start..offset + end);
                    (stream.memcpy_dtoh(&src, &mut host[start..end]))
                        .map_err(driver_err("cuMemcpyDtoHAsync"))?;
                }
                events.push(super::record_event(stream, false)?);
                start = end;
            }
            Ok(events)
        };
        let mut read_parts = |events: Vec<CudaEvent>, host: &[u8]| {
            let mut out = Vec::with_capacity(ends.len());
            for (i, (e, &end)) in events.iter().zip(ends).enumerate() {
                e.synchronize().map_err(driver_err("cuEventSynchronize"))?;
                out.push(read(i, &host[..end])?);
            }
            Ok(out)
        };
        let got = copied(host).and_then(|events| read_parts(events, host));
        // Every exit waits for the copies queued: `pinned` is the caller's again.
        stream
            .synchronize()
            .map_err(driver_err("cuStreamSynchronize"))?;
        got
    }
}

/// Device addresses of a launch's buffers, held with the guards that order the launch after
/// the buffers' earlier writes (dropped once the launch is queued).
#[derive(Default)]
pub(super) struct Addrs<'a> {
    pub(super) guards: Vec<SyncOnDrop<'a>>,
}

impl<'a> Addrs<'a> {
    pub(super) fn of<T>(&mut self, b: &'a DevBuf<T>, stream: &'a CudaStream) -> (u64, u64) {
        let (ptr, guard) = match &b.mem {
            DevMem::Own(slice) => slice.device_ptr(stream),
            DevMem::View { base, offset, .. } => {
                let (ptr, guard) = base.device_ptr(stream);
                (ptr + *offset as u64, guard)
            }
        };
        self.guards.push(guard);
        (ptr, b.len as u64)
    }

    /// [`of`](Self::of), or a null address and a count of 0 for `None`.
    pub(super) fn of_opt<T>(
        &mut self,
        b: Option<&'a DevBuf<T>>,
        stream: &'a CudaStream,
    ) -> (u64, u64) {
        b.map_or((0, 0), |b| self.of(b, stream))
    }
}

/// `held`, or when it is missing or shorter than `need` bytes (at most `isize::MAX / 4`), a new
/// zeroed page-locked buffer of the next power of two with the driver's `flags`, held there
/// instead: pinned memory a caller keeps between copies.
fn pinned_at_least<'p>(
    stream: &Arc<CudaStream>,
    held: &'p mut Option<PinnedHostSlice<u8>>,
    need: usize,
    flags: u32,
) -> Result<&'p mut PinnedHostSlice<u8>, CudaError> {
    if need > isize::MAX as usize / 4 {
        return Err(CudaError::Input {
            what: "a host copy over isize::MAX / 4 bytes",
        });
    }
    if held.as_ref().is_none_or(|p| p.len() < need) {
        *held = None;
        *held = Some(pinned_zeroed(
            stream.context(),
            need.next_power_of_two(),
            flags,
        )?);
    }
    held.as_mut().ok_or(CudaError::Input {
        what: "no pinned buffer",
    })
}

/// A new page-locked buffer of `len` bytes (at least 1, at most `isize::MAX / 4`) with the
/// driver's `flags`, zeroed.
pub(crate) fn pinned_zeroed(
    ctx: &Arc<CudaContext>,
    len: usize,
    flags: u32,
) -> Result<PinnedHostSlice<u8>, CudaError> {
    if len == 0 || len > isize::MAX as usize / 4 {
        return Err(CudaError::Input {
            what: "pinned memory of 0 bytes or over isize::MAX / 4",
        });
    }
    // SAFETY: alloc_pinned_with_flags' contract (the memory is uninitialized): it is zeroed
    // through the raw pointer below before any slice of it is formed. `len` is far below
    // isize::MAX and not 0 (checked above), so cudarc's size assertions hold.
    let mut p = unsafe { ctx.alloc_pinned_with_flags::<u8>(len, flags) }
        .map_err(driver_err("cuMemHostAlloc"))?;
    let ptr = p.as_mut_ptr().map_err(driver_err("cuEventSynchronize"))?;
    // SAFETY: `ptr` points to `len` bytes of pinned memory owned by `p`.
    unsafe { ptr.write_bytes(0, len) };
    Ok(p)
}

/// Bytes of a packed upload queued to the device at a time: the host fills the staging buffer
/// with the next step while the device copies the last.
const PACK_STEP: usize = 4 << 20;

/// Alignment of every part of a packed upload (the driver's allocations are at least this
/// aligned, so every part is aligned for its type).
pub(crate) const PACK_ALIGN: usize = 256;

/// Where [`Packer::add`] put an array: its byte offset and element count.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PackSlot<T> {
    offset: usize,
    len: usize,
    _t: PhantomData<T>,
}

impl<T> PackSlot<T> {
    /// Elements.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The elements from this slot's first up to `end`'s first (a slot laid out after it by
    /// the same [`Packer`]): the slots between and their alignment gaps. Empty when `end`
    /// does not lie after it.
    pub(crate) fn up_to(self, end: PackSlot<T>) -> PackSlot<T> {
        PackSlot {
            offset: self.offset,
            len: end.offset.saturating_sub(self.offset) / size_of::<T>(),
            _t: PhantomData,
        }
    }
}

/// Host arrays laid out one after another ([`PACK_ALIGN`]-aligned) and uploaded to one device
/// allocation by one copy from a pinned staging buffer, which the caller keeps for the next
/// upload (one copy instead of one per array, at the speed of pinned memory, and no
/// allocation of pinned memory per call). Room a part leaves after its array for a launch to
/// write is allocated but copied only if another part follows it.
#[derive(Debug, Default)]
pub(crate) struct Packer<'a> {
    /// Per part: its sources in order (their bytes), and its offset.
    parts: Vec<(Vec<&'a [u8]>, usize)>,
    total: usize,
    /// Bytes up to the end of the last part's sources: what an upload copies.
    copied: usize,
    /// Whether room follows the last part's arrays (its own, or reserved after it): an
    /// upload zeroes what follows them.
    room_after: bool,
}

/// The bytes of a slice of a device type, padding included (invariant 7: plain `#[repr(C)]`
/// values; the bytes are only copied, never read as numbers).
fn raw_bytes<T: DeviceRepr>(data: &[T]) -> &[u8] {
    // SAFETY: `data` is a live slice of `size_of_val(data)` bytes, borrowed for the result's
    // lifetime; u8 has alignment 1. Padding bytes of `T` (e.g. the tail of `LaneBlock`) are
    // only copied, by `copy_from_slice` (a memcpy, `ptr::copy_nonoverlapping`) in
    // `Packer::upload` and by the driver's DMA, never read as values.
    unsafe { std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), size_of_val(data)) }
}

impl<'a> Packer<'a> {
    /// Adds an array; where it will lie.
    pub(crate) fn add<T: DeviceRepr>(&mut self, data: &'a [T]) -> PackSlot<T> {
        self.add_gather(std::slice::from_ref(&data))
    }

    /// Room for `len` elements that nothing is copied into (a launch's output, in a
    /// [`Packer::total`]-byte scratch allocation); where it lies.
    pub(crate) fn reserve<T: DeviceRepr>(&mut self, len: usize) -> PackSlot<T> {
        self.room_after = true;
        let offset = self.total;
        self.total = offset + (len * size_of::<T>()).max(1).next_multiple_of(PACK_ALIGN);
        PackSlot {
            offset,
            len,
            _t: PhantomData,
        }
    }

    /// Bytes the parts take, gaps included.
    pub(crate) fn total(&self) -> usize {
        self.total
    }

    /// Adds the arrays `parts` joined into one.
    pub(crate) fn add_gather<T: DeviceRepr>(&mut self, parts: &[&'a [T]]) -> PackSlot<T> {
        self.add_with_room(parts, 0)
    }

    /// Adds the arrays `parts` joined into one, followed by room for `room` more elements
    /// that nothing is copied into (a launch writes them): the part holds both.
    pub(crate) fn add_with_room<T: DeviceRepr>(
        &mut self,
        parts: &[&'a [T]],
        room: usize,
    ) -> PackSlot<T> {
        let offset = self.total;
        let len: usize = parts.iter().map(|p| p.len()).sum();
        let bytes = len * size_of::<T>();
        self.parts
            .push((parts.iter().map(|p| raw_bytes(p)).collect(), offset));
        self.copied = offset + bytes;
        self.room_after = room > 0;
        let all = (len + room) * size_of::<T>();
        self.total = offset + all.max(1).next_multiple_of(PACK_ALIGN);
        PackSlot {
            offset,
            len: len + room,
            _t: PhantomData,
        }
    }

    /// Adds the bytes `parts` joined into one array of `T` (bytes in the device's order, as a
    /// stream stores its lane words): copied as they are.
    pub(crate) fn add_bytes_as<T: DeviceRepr>(&mut self, parts: &[&'a [u8]]) -> PackSlot<T> {
        let PackSlot { offset, len, .. } = self.add_gather(parts);
        PackSlot {
            offset,
            len: len / size_of::<T>(),
            _t: PhantomData,
        }
    }

    /// The copies that fill the packed bytes, by [`PACK_STEP`]-byte step: each source cut at
    /// the step boundaries, as (offset in its step, bytes).
    fn steps(&self) -> Vec<Vec<(usize, &'a [u8])>> {
        let mut steps = vec![Vec::new(); self.copied.max(1).div_ceil(PACK_STEP)];
        for (sources, offset) in &self.parts {
            let mut at = *offset;
            for &src in sources {
                let mut rest = src;
                while !rest.is_empty() {
                    let step = at / PACK_STEP;
                    let room = (step + 1) * PACK_STEP - at;
                    let (head, tail) = rest.split_at(room.min(rest.len()));
                    steps[step].push((at - step * PACK_STEP, head));
                    at += head.len();
                    rest = tail;
                }
            }
        }
        steps
    }

    /// Writes every part into `dst` (at least up to the end of the last part's arrays, at least
    /// one byte), one [`PACK_STEP`] at a time on up to `threads` threads (at least one), and
    /// hands each step, as soon as it is written, to `filled` with its byte range, on the
    /// caller's thread and in any order: the steps up to the end of the last part's arrays
    /// (its room and any reserved after it are not handed over). The gaps between parts are
    /// left as they were. An error from `filled` stops the fill and is returned.
    pub(crate) fn fill(
        &self,
        dst: &mut [u8],
        threads: usize,
        mut filled: impl FnMut(std::ops::Range<usize>, &[u8]) -> Result<(), CudaError>,
    ) -> Result<(), CudaError> {
        let need = self.copied.max(1);
        let jobs: Vec<_> = dst[..need]
            .chunks_mut(PACK_STEP)
            .zip(self.steps())
            .enumerate()
            .collect();
        let write = |step: &mut [u8], copies: &[(usize, &[u8])]| {
            for &(at, src) in copies {
                step[at..at + src.len()].copy_from_slice(src);
            }
        };
        let range = |i: usize, len: usize| i * PACK_STEP..i * PACK_STEP + len;
        let threads = threads.clamp(1, jobs.len());
        if threads == 1 {
            for (i, (step, copies)) in jobs {
                write(step, &copies);
                filled(range(i, step.len()), step)?;
            }
            return Ok(());
        }
        let queue = std::sync::Mutex::new(jobs.into_iter());
        let (done, steps_done) = std::sync::mpsc::channel::<(usize, &[u8])>();
        std::thread::scope(|scope| {
            for _ in 0..threads {
                let (queue, done) = (&queue, done.clone());
                scope.spawn(move || loop {
                    // The iterator is only advanced under the lock, never left half-updated.
                    let next = queue.lock().unwrap_or_else(|e| e.into_inner()).next();
                    let Some((i, (step, copies))) = next else {
                        break;
                    };
                    write(step, &copies);
                    // The receiver is gone when `filled` failed: stop.
                    if done.send((i, step)).is_err() {
                        break;
                    }
                });
            }
            drop(done);
            for (i, step) in steps_done {
                filled(range(i, step.len()), step)?;
            }
            Ok(())
        })
    }

    /// Copies every part into `staging` (pinned memory, grown to a power of two when short) on
    /// up to `threads` threads and from there to a new device allocation on `stream`, each
    /// step queued as soon as it is written, then synchronizes the stream (so that `staging`
    /// can be refilled): the allocation, for [`DevBuf::view`].
    pub(crate) fn upload(
        self,
        stream: &Arc<CudaStream>,
        staging: &mut Option<PinnedHostSlice<u8>>,
        threads: usize,
    ) -> Result<Arc<CudaSlice<u8>>, CudaError> {
        let dev = self.queue(stream, staging, threads)?;
        stream
            .synchronize()
            .map_err(driver_err("cuStreamSynchronize"))?;
        Ok(dev)
    }

    /// [`upload`](Self::upload) without the synchronization: the copies are queued on
    /// `stream`, and `staging` must not be written again (nor grown) before the stream has
    /// passed them.
    pub(crate) fn queue(
        self,
        stream: &Arc<CudaStream>,
        staging: &mut Option<PinnedHostSlice<u8>>,
        threads: usize,
    ) -> Result<Arc<CudaSlice<u8>>, CudaError> {
        // Write-combined: the host only writes it, and the device reads it faster so.
        let pinned = pinned_at_least(
            stream,
            staging,
            self.copied.max(1),
            cudarc::driver::sys::CU_MEMHOSTALLOC_WRITECOMBINED,
        )?;
        // Waits for any earlier copy from the staging buffer that recorded its event.
        let dst = pinned
            .as_mut_slice()
            .map_err(driver_err("cuEventSynchronize"))?;
        // Not zeroed as a whole: a memset on this (copy) stream is a kernel, which can wait
        // behind another stream's launches for the device's SMs, and the copies after it with
        // it.
        // SAFETY: invariant 7 (bytes, valid in any bits). The allocation is left unset; the
        // copies `fill` hands over below cover every byte before `copied`, and any room after
        // them is zeroed first, so that only the last part's alignment padding stays unset,
        // which no part's count covers (invariant 6) and no launch reads.
        let mut dev = unsafe { stream.alloc::<u8>(self.total.max(1)) }
            .map_err(driver_err("cuMemAllocAsync"))?;
        if self.room_after {
            let mut room = (dev.try_slice_mut(self.copied..)).ok_or(CudaError::Input {
                what: "a packed upload's room past its buffer",
            })?;
            (stream.memset_zeros(&mut room)).map_err(driver_err("cuMemsetD8Async"))?;
        }
        // A step queued to the device is not written again before the stream has passed it
        // (the caller's part). Writing the next steps overlaps the device's copies.
        self.fill(dst, threads, |range, bytes| {
            stream
                .memcpy_htod(bytes, &mut dev.slice_mut(range))
                .map_err(driver_err("cuMemcpyHtoDAsync"))
        })?;
        Ok(Arc::new(dev))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rans::LaneBlock;

    /// Invariant 6 for views: every packed part starts aligned, after the previous part's
    /// bytes, and an empty part still takes an aligned unit (its address is never shared).
    #[test]
    fn packed_parts_are_aligned_and_disjoint() {
        let (a, b, c) = ([1u8; 3], [0u32; 0], [LaneBlock::default(); 2]);
        let gather: [&[u16]; 2] = [&[1; 100], &[2; 29]];
        let mut p = Packer::default();
        let sa = p.add(&a[..]);
        let sb = p.add(&b[..]);
        let sc = p.add(&c[..]);
        let sg = p.add_gather(&gather);
        let stored: [&[u8]; 2] = [&[1, 0, 0, 0, 2, 0, 0, 0], &[3, 0, 0, 0]];
        let sw = p.add_bytes_as::<u32>(&stored);
        let slots = [
            (sa.offset, sa.len),
            (sb.offset, sb.len * 4),
            (sc.offset, sc.len * size_of::<LaneBlock>()),
            (sg.offset, sg.len * 2),
            (sw.offset, sw.len * 4),
        ];
        assert_eq!((sa.len, sb.len, sc.len, sg.len, sw.len), (3, 0, 2, 129, 3));
        for w in slots.windows(2) {
            assert_eq!(w[0].0 % PACK_ALIGN, 0);
            assert!(w[0].0 + w[0].1.max(1) <= w[1].0, "{slots:?}");
        }
        assert_eq!(p.total, sw.offset + PACK_ALIGN);
        let bytes: Vec<u8> = p.parts[3].0.concat();
        assert_eq!(bytes.len(), 258);
        assert_eq!(&bytes[198..202], &[1, 0, 2, 0]);
        assert_eq!(p.parts[4].0.concat(), [1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0]);
    }

    /// Parts across several steps (one source crossing three step boundaries off their
    /// start, parts gathered from pieces, one empty).
    fn big_packer<'a>(a: &'a [u8], b: &'a [u16], c: &'a [u8]) -> Packer<'a> {
        let mut p = Packer::default();
        p.add(&c[..5]);
        p.add(a);
        p.add::<u8>(&[]);
        p.add_gather(&[b, &b[..1000], b]);
        p.add_bytes_as::<u32>(&[c, &c[..8], c]);
        p
    }

    /// The packed bytes as a plain loop writes them, gaps left as `fill`.
    fn packed_by_hand(p: &Packer<'_>, fill: u8) -> Vec<u8> {
        let mut want = vec![fill; p.total];
        for (sources, offset) in &p.parts {
            let bytes = sources.concat();
            want[*offset..offset + bytes.len()].copy_from_slice(&bytes);
        }
        want
    }

    /// On any thread count every part lands where `add` said, each step is handed over once,
    /// whole, its range inside the packed bytes and the steps covering them; the gaps keep
    /// what the buffer held.
    #[test]
    fn fill_writes_every_part_in_place_on_any_thread_count() {
        let a: Vec<u8> = (0..(9 << 20) + 3).map(|i| (i * 7 % 251) as u8).collect();
        let b: Vec<u16> = (0..300_001).map(|i| (i * 13 % 65521) as u16).collect();
        let c: Vec<u8> = (0..4096 + 12).map(|i| (i % 256) as u8).collect();
        let p = big_packer(&a, &b, &c);
        let want = packed_by_hand(&p, 0xEE);
        assert!(p.copied > 2 * PACK_STEP);
        for threads in [1, 2, 3, 8, 64] {
            let mut dst = vec![0xEE; p.total + 100];
            let mut seen = Vec::new();
            p.fill(&mut dst, threads, |range, bytes| {
                assert_eq!(bytes, &want[range.clone()], "{threads} threads");
                seen.push(range);
                Ok(())
            })
            .unwrap();
            assert!(dst[..p.total] == want[..], "{threads} threads");
            assert!(dst[p.total..].iter().all(|&x| x == 0xEE));
            seen.sort_by_key(|r| r.start);
            assert_eq!(seen.len(), p.copied.div_ceil(PACK_STEP));
            assert_eq!(seen.first().map(|r| r.start), Some(0));
            assert_eq!(seen.last().map(|r| r.end), Some(p.copied));
            assert!(seen.windows(2).all(|w| w[0].end == w[1].start));
        }
    }

    /// A part's room lies after its array, inside the part; room after the last part's array
    /// is allocated (in `total`) but not handed over, room before another part is a gap.
    #[test]
    fn room_after_a_part_is_allocated_and_copied_only_when_a_part_follows() {
        let (a, b) = ([3u32; 5], [9u8; 7]);
        let mut p = Packer::default();
        let sa = p.add_with_room(&[&a[..]], 100);
        assert_eq!((sa.offset, sa.len), (0, 105));
        assert_eq!((p.copied, p.room_after), (20, true));
        assert_eq!(p.total, (105 * 4usize).next_multiple_of(PACK_ALIGN));
        let sb = p.add(&b[..]);
        assert!(sb.offset >= 105 * 4);
        // Only the last part's alignment padding follows the copied bytes: an upload leaves it.
        assert_eq!((p.copied, p.room_after), (sb.offset + 7, false));
        let sc = p.add_with_room::<u32>(&[&a[..2]], PACK_STEP);
        assert_eq!((p.copied, sc.len), (sc.offset + 8, 2 + PACK_STEP));
        assert!(p.room_after);
        assert!(p.total >= sc.offset + 4 * (2 + PACK_STEP));
        let mut dst = vec![0xEE; p.total];
        let mut last = 0;
        p.fill(&mut dst, 2, |range, _| {
            last = last.max(range.end);
            Ok(())
        })
        .unwrap();
        assert_eq!(last, p.copied);
        assert!(dst[20..sb.offset].iter().all(|&x| x == 0xEE));
        assert_eq!(&dst[sc.offset..sc.offset + 8], &[3, 0, 0, 0, 3, 0, 0, 0]);
        assert!(dst[p.copied..].iter().all(|&x| x == 0xEE));
        let mut r = Packer::default();
        r.add(&b[..]);
        r.reserve::<u32>(3);
        assert!(
            r.room_after,
            "room reserved after the parts is zeroed by an upload"
        );
    }

    /// An error from `filled` ends the fill with that error, on one thread or several; an
    /// empty packer still hands over one byte (the driver allocates no empty buffer).
    #[test]
    fn fill_stops_at_the_first_error() {
        let a = vec![1u8; 3 * PACK_STEP];
        let p = big_packer(&a, &[1; 1000], &[2; 8]);
        for threads in [1, 4] {
            let mut calls = 0;
            let got = p.fill(&mut vec![0; p.total], threads, |_, _| {
                calls += 1;
                if calls == 2 {
                    return Err(CudaError::Input { what: "stop" });
                }
                Ok(())
            });
            assert!(matches!(got, Err(CudaError::Input { what: "stop" })));
            assert_eq!(calls, 2, "{threads} threads");
        }
        let mut seen = Vec::new();
        Packer::default()
            .fill(&mut [7], 4, |range, bytes| {
                seen.push((range, bytes.to_vec()));
                Ok(())
            })
            .unwrap();
        assert_eq!(seen, [(0..1, vec![7])]);
    }
}
