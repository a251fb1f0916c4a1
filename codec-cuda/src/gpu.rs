//! A CUDA device, opened through cudarc's run-time-loaded driver, and the kernels launched on it.
//!
//! The kernels are compiled by NVRTC to a CUBIN for the device's architecture once per process
//! and architecture (a process-wide cache), and loaded once per [`Gpu`]. Every launch goes on
//! the `Gpu`'s one stream ([`Gpu::fork`] gives another handle with a stream of its own, for
//! another host thread); each entry point uploads its batch (tables, words, block headers),
//! launches, synchronizes and downloads what the host needs next.
//!
//! Here: opening a device, the handle's settings, the kernels and their memory. A plan decoded
//! whole is in `uploaded`, in pieces in `pieces` (from page-locked bytes: `from_host`; each
//! piece's upload: `queued`; level constants kept on the device: `resident`), the encode in
//! `encode`, PQ search in `pq`, and the one-step launches for tests and benches in `stepwise`.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, PinnedHostSlice};
use cudarc::nvrtc::Ptx;

use crate::decode::DEFAULT_CHAIN_FUSED;
use crate::error::CudaError;
use crate::ffi;
use crate::host_threads;
use crate::levels::LevelCache;
use crate::nvrtc::{Nvrtc, KERNELS};
use crate::quant::OutDtype;
use crate::rans::LaneShape;

mod encode;
mod from_host;
mod pieces;
mod pq;
mod queued;
mod resident;
#[cfg(feature = "internals")]
mod stepwise;
mod uploaded;

pub use encode::{EncodeTimes, UploadedEncodePlan, DEFAULT_ENCODE_PIECE_BLOCKS};
pub use from_host::HostBuffer;
use from_host::WordSource;
pub use pieces::{
    PieceTimes, DEFAULT_PIECES_IN_FLIGHT, DEFAULT_PIECE_BLOCKS, MAX_PIECES_IN_FLIGHT,
};
pub use pq::UploadedPq;
use queued::QueuedChain;
use uploaded::check_page_size;
pub use uploaded::UploadedPlan;

/// Every kernel file's CUBIN for one architecture.
type Cubins = Arc<Vec<(&'static str, Vec<u8>)>>;
/// CUBINs by architecture: NVRTC runs once per architecture per process.
type CubinCache = HashMap<String, Cubins>;
static CUBINS: Mutex<Option<CubinCache>> = Mutex::new(None);

/// The loaded kernels' entry points.
#[derive(Debug)]
struct Kernels {
    lane_decode: CudaFunction,
    lane_decode_mapped: CudaFunction,
    lane_decode_compact: CudaFunction,
    lane_decode_mapped_compact: CudaFunction,
    dequant_f16: CudaFunction,
    dequant_bf16: CudaFunction,
    pq_search: CudaFunction,
    quantize: CudaFunction,
    lane_encode: CudaFunction,
    encode_blocks: CudaFunction,
    place_blocks: CudaFunction,
    write_blocks: CudaFunction,
    seal_chunks: CudaFunction,
    resolve_tables: CudaFunction,
    map_values: CudaFunction,
    map_escapes: CudaFunction,
    gather_words: CudaFunction,
    expand_tables: CudaFunction,
    check_chunks: CudaFunction,
    chain_verdict: CudaFunction,
    /// Dynamic shared memory a PQ search block may ask for: the device's opt-in maximum, to
    /// which the function's limit is raised.
    pq_shared_budget: u64,
    /// Not part of any format: the 32-bit-state experiment ([`crate::experiment`]).
    lane32_experiment: CudaFunction,
}

/// A CUDA device's primary context, a stream on it, and the kernels once loaded.
#[derive(Debug)]
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    ordinal: usize,
    arch: String,
    kernels: Mutex<Option<Arc<Kernels>>>,
    lane_shape: LaneShape,
    pq_shared_keys: u32,
    /// Pinned host memory every packed upload is staged in, kept for the next (grown when
    /// short); the pieces of a decode in pieces take turns, one buffer for each piece in
    /// flight (an encode's alternate between the first two).
    staging: Mutex<[Option<PinnedHostSlice<u8>>; MAX_PIECES_IN_FLIGHT]>,
    /// Threads that write a packed upload or copy encoded chunks into vectors (at least 1;
    /// see [`Gpu::set_upload_threads`]).
    upload_threads: usize,
    /// Pinned host memory encoded chunks are copied back through, kept for the next.
    readback: Mutex<Option<PinnedHostSlice<u8>>>,
    /// The device scratch of the decode and encode chains (symbols, their tables, values,
    /// words, chunk bytes), kept for the next upload (grown when short): every chain writes
    /// all of it that it reads, and chains run one at a time (`chain_lock`) but for a decode
    /// or an encode in pieces, whose pieces take turns as they do with the staging buffers.
    scratch: Mutex<[Option<Arc<CudaSlice<u8>>>; MAX_PIECES_IN_FLIGHT]>,
    /// The copy stream of a decode or an encode in pieces and the other compute streams of a
    /// decode's, made by the first.
    pipe: Mutex<Option<Arc<pieces::PipeStreams>>>,
    /// Coded blocks a piece of a decode holds, and its first piece
    /// ([`Gpu::set_decode_piece_blocks`], [`Gpu::set_decode_first_piece_blocks`]).
    piece_blocks: usize,
    first_piece_blocks: usize,
    /// Pieces of a decode whose launches may run at once ([`Gpu::set_decode_pieces_in_flight`]).
    pieces_in_flight: usize,
    /// Whether a decode from page-locked memory queues a piece's bytes before its chain is
    /// built ([`Gpu::set_decode_copy_early`]).
    copy_early: bool,
    /// Whether a decode runs the fused chain ([`Gpu::set_decode_chain_fused`]).
    fused: bool,
    /// Whether a chain's lane decodes read compact tables ([`Gpu::set_lane_tables_compact`]).
    compact_tables: bool,
    /// Coded blocks a piece of an encode holds ([`Gpu::set_encode_piece_blocks`]).
    encode_piece_blocks: usize,
    /// Held from a chain's first launch until its statuses are read (decode) or its chunks
    /// copied back (encode): the chains of several threads share the scratch, so one chain
    /// runs at a time.
    chain_lock: Mutex<()>,
    /// The level constants of the chains built so far (shared with forks).
    levels: Arc<LevelCache>,
    /// Their table maps and channel constants on this device (a handle's own).
    resident: Mutex<resident::Resident>,
}

/// Tables a lane-decode block stages in shared memory by default: [`LaneShape::DEFAULT`]'s,
/// none.
pub const DEFAULT_LANE_SHARED_TABLES: u32 = LaneShape::DEFAULT.shared_tables();

impl Gpu {
    /// Opens device `ordinal`. Errors, never panics, where CUDA is missing:
    /// [`CudaError::NoDriver`] without a driver library, [`CudaError::NoDevice`] if the driver
    /// has no such device, [`CudaError::Driver`] if a driver call fails.
    pub fn new(ordinal: usize) -> Result<Self, CudaError> {
        let ctx = ffi::driver_context(ordinal)?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(ffi::driver_err("cuDeviceGetAttribute"))?;
        let stream = ctx.default_stream();
        Ok(Gpu {
            ctx,
            stream,
            ordinal,
            arch: format!("sm_{major}{minor}"),
            kernels: Mutex::new(None),
            lane_shape: LaneShape::DEFAULT,
            pq_shared_keys: u32::MAX,
            piece_blocks: DEFAULT_PIECE_BLOCKS,
            first_piece_blocks: 0,
            pieces_in_flight: DEFAULT_PIECES_IN_FLIGHT,
            copy_early: false,
            fused: DEFAULT_CHAIN_FUSED,
            compact_tables: false,
            encode_piece_blocks: DEFAULT_ENCODE_PIECE_BLOCKS,
            staging: Mutex::default(),
            upload_threads: host_threads(0),
            readback: Mutex::new(None),
            scratch: Mutex::default(),
            pipe: Mutex::new(None),
            chain_lock: Mutex::new(()),
            levels: Arc::default(),
            resident: Mutex::default(),
        })
    }

    /// Another handle on the same device and context, with a stream of its own (non-blocking)
    /// and its own staging and scratch, the loaded kernels, level constants and settings
    /// shared. For decoding from several host threads, one handle each: their plans and chains
    /// are built on the host at once, beside one another's copies and kernels, where calls on
    /// one `Gpu` run one after the other. Buffers for one handle's calls are allocated on its
    /// [`stream`](Self::stream); a plan uploaded through one is not decoded by another.
    pub fn fork(&self) -> Result<Gpu, CudaError> {
        let stream = self
            .ctx
            .new_stream()
            .map_err(ffi::driver_err("cuStreamCreate"))?;
        let kernels = self
            .kernels
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        Ok(Gpu {
            ctx: self.ctx.clone(),
            stream,
            ordinal: self.ordinal,
            arch: self.arch.clone(),
            kernels: Mutex::new(kernels),
            lane_shape: self.lane_shape,
            pq_shared_keys: self.pq_shared_keys,
            piece_blocks: self.piece_blocks,
            first_piece_blocks: self.first_piece_blocks,
            pieces_in_flight: self.pieces_in_flight,
            copy_early: self.copy_early,
            fused: self.fused,
            compact_tables: self.compact_tables,
            encode_piece_blocks: self.encode_piece_blocks,
            staging: Mutex::default(),
            upload_threads: self.upload_threads,
            readback: Mutex::new(None),
            scratch: Mutex::default(),
            pipe: Mutex::new(None),
            chain_lock: Mutex::new(()),
            levels: self.levels.clone(),
            resident: Mutex::default(),
        })
    }

    /// Devices the driver reports ([`CudaError::NoDriver`] without a driver library).
    pub fn count() -> Result<usize, CudaError> {
        ffi::driver_device_count()
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The architecture the kernels are compiled for, e.g. `sm_90`.
    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// The device's cudarc context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream every launch goes on (a caller's device buffers for
    /// [`decode_into`](Self::decode_into) belong on it).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Sets how many tables a lane-decode block stages in shared memory (16 KiB each, with
    /// the warps per CUDA block at most [`LaneShape::MAX_SHARED_TABLES`] per CUDA block; see
    /// [`LaneShape::new`]); takes effect before the kernels are loaded.
    pub fn set_lane_shared_tables(&mut self, tables: u32) -> Result<(), CudaError> {
        self.set_lane_shape(LaneShape::new(self.lane_shape.warps(), tables)?);
        Ok(())
    }

    /// Sets how many coded blocks (one warp each) a lane-decode CUDA block holds, 1 to
    /// [`LaneShape::MAX_WARPS`] (see [`LaneShape::new`]): more let a large batch keep more
    /// warps on an SM than its limit of resident CUDA blocks allows. The output is the same.
    pub fn set_lane_warps(&mut self, warps: u32) -> Result<(), CudaError> {
        self.set_lane_shape(LaneShape::new(warps, self.lane_shape.shared_tables())?);
        Ok(())
    }

    /// How lane decodes are launched.
    pub fn lane_shape(&self) -> LaneShape {
        self.lane_shape
    }

    fn set_lane_shape(&mut self, shape: LaneShape) {
        self.lane_shape = shape;
        // Loaded again, with the function's shared memory limit raised for the new shape.
        *self.kernels.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }

    /// Sets whether a decode runs the fused chain: four launches, the symbol lanes, the value
    /// mapping and the dequantization each finding a value symbol's table through its
    /// block's table map, the value mapping writing only the escapes' values and the
    /// dequantization mapping the other symbols as it reads them. With `false` (the default),
    /// five: a table resolution writes every symbol's table (2 bytes a symbol) for the
    /// launches after it to read, and the value mapping every value (4 bytes) for the
    /// dequantization. The output is the same either way; the fused chain moves fewer bytes
    /// and its scratch holds no table index a symbol, but its launches took longer on a
    /// device (the crate's README). A plan uploaded by [`upload_plan`](Self::upload_plan) runs
    /// the chain set when it was uploaded.
    pub fn set_decode_chain_fused(&mut self, on: bool) {
        self.fused = on;
    }

    /// Sets whether a decode chain's tables are expanded on the device into the lane
    /// decoders' compact form (2 KiB a table: where each symbol's range of slots starts, and
    /// per symbol its frequency and cumulative frequency; one more dependent load a symbol)
    /// instead of the packed form (16 KiB a table: an entry per slot; the default). A level's
    /// tables then fit a streaming multiprocessor's L1 cache. The output is the same either
    /// way; which is faster is to be measured on a device. The lane decodes of a chain with
    /// compact tables stage none in shared memory. A plan uploaded by
    /// [`upload_plan`](Self::upload_plan) keeps the form set when it was uploaded.
    pub fn set_lane_tables_compact(&mut self, on: bool) {
        self.compact_tables = on;
    }

    /// Sets the longest query (in tokens) whose ranking keys a PQ search keeps in shared
    /// memory; longer ones keep theirs in a scratch buffer in device memory. By default every
    /// query's, as far as the device's shared memory per block holds them; 0 keeps none there.
    /// The selections are the same either way ([`crate::pq::PqBatch::search_host_keeping`]).
    pub fn set_pq_shared_keys(&mut self, tokens: u32) {
        self.pq_shared_keys = tokens;
    }

    /// Compiles (once per process and architecture) and loads the kernels, with NVRTC loaded
    /// as [`Nvrtc::load`] loads it from `nvrtc_dir`. The entry points call it with `None` if
    /// the kernels are not loaded yet.
    pub fn load_kernels(&self, nvrtc_dir: Option<&Path>) -> Result<(), CudaError> {
        self.kernels(nvrtc_dir).map(|_| ())
    }

    fn kernels(&self, nvrtc_dir: Option<&Path>) -> Result<Arc<Kernels>, CudaError> {
        let mut held = self.kernels.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(k) = held.as_ref() {
            return Ok(k.clone());
        }
        let cubins = cubins(&self.arch, nvrtc_dir)?;
        let load = |file: &str, entry: &'static str| -> Result<CudaFunction, CudaError> {
            let (_, cubin) = cubins
                .iter()
                .find(|(f, _)| *f == file)
                .ok_or(CudaError::Input {
                    what: "a kernel file missing from the kernel list",
                })?;
            let module = self
                .ctx
                .load_module(Ptx::from_binary(cubin.clone()))
                .map_err(ffi::driver_err("cuModuleLoadData"))?;
            module
                .load_function(entry)
                .map_err(ffi::driver_err("cuModuleGetFunction"))
        };
        let mut kernels = Kernels {
            lane_decode: load("rans_decode.cu", "kvc_rans_lane_decode")?,
            lane_decode_mapped: load("rans_decode.cu", "kvc_rans_lane_decode_mapped")?,
            lane_decode_compact: load("rans_decode.cu", "kvc_rans_lane_decode_compact")?,
            lane_decode_mapped_compact: load(
                "rans_decode.cu",
                "kvc_rans_lane_decode_mapped_compact",
            )?,
            dequant_f16: load("dequant.cu", "kvc_dequant_f16")?,
            dequant_bf16: load("dequant.cu", "kvc_dequant_bf16")?,
            pq_search: load("pq_search.cu", "kvc_pq_search")?,
            quantize: load("encode.cu", "kvc_quantize")?,
            lane_encode: load("encode.cu", "kvc_rans_lane_encode")?,
            encode_blocks: load("encode.cu", "kvc_encode_blocks")?,
            place_blocks: load("encode.cu", "kvc_place_blocks")?,
            write_blocks: load("encode.cu", "kvc_write_blocks")?,
            seal_chunks: load("encode.cu", "kvc_seal_chunks")?,
            resolve_tables: load("chain.cu", "kvc_resolve_tables")?,
            map_values: load("chain.cu", "kvc_map_values")?,
            map_escapes: load("chain.cu", "kvc_map_escapes")?,
            gather_words: load("chain.cu", "kvc_gather_words")?,
            expand_tables: load("chain.cu", "kvc_expand_tables")?,
            check_chunks: load("chain.cu", "kvc_check_chunks")?,
            chain_verdict: load("chain.cu", "kvc_chain_verdict")?,
            lane32_experiment: load("rans32_experiment.cu", "kvc_rans32_lane_decode_experiment")?,
            pq_shared_budget: 0,
        };
        let shared = self.lane_shape.shared_bytes();
        if shared > 48 * 1024 {
            use cudarc::driver::sys::CUfunction_attribute_enum as A;
            // Invariant 8 of src/ffi/mod.rs: the limit is raised before any launch asks for it.
            let k = &kernels;
            for f in [&k.lane_decode, &k.lane_decode_mapped, &k.lane32_experiment] {
                f.set_attribute(
                    A::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    shared as i32,
                )
                .map_err(ffi::driver_err("cuFuncSetAttribute"))?;
            }
        }
        kernels.pq_shared_budget = self.raise_pq_shared_limit(&kernels.pq_search)?;
        let kernels = Arc::new(kernels);
        *held = Some(kernels.clone());
        Ok(kernels)
    }

    /// Raises `pq_search`'s dynamic shared memory limit to the device's opt-in maximum per
    /// block (invariant 8 of src/ffi/mod.rs) and returns it.
    fn raise_pq_shared_limit(&self, pq_search: &CudaFunction) -> Result<u64, CudaError> {
        use cudarc::driver::sys::CUdevice_attribute_enum as D;
        use cudarc::driver::sys::CUfunction_attribute_enum as A;
        let optin = self
            .ctx
            .attribute(D::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(ffi::driver_err("cuDeviceGetAttribute"))?;
        pq_search
            .set_attribute(A::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, optin)
            .map_err(ffi::driver_err("cuFuncSetAttribute"))?;
        Ok(u64::try_from(optin).unwrap_or(0))
    }

    fn sync(&self) -> Result<(), CudaError> {
        self.stream
            .synchronize()
            .map_err(ffi::driver_err("cuStreamSynchronize"))
    }

    /// Uploads a launch's buffers with `upload`, queues `launch` once and synchronizes: the
    /// device buffers, for the caller's downloads.
    fn run_once<D>(
        &self,
        upload: impl FnOnce(&Self) -> Result<D, CudaError>,
        launch: impl FnOnce(&Self, &Kernels, &D) -> Result<(), CudaError>,
    ) -> Result<D, CudaError> {
        let k = self.kernels(None)?;
        let dev = upload(self)?;
        launch(self, &k, &dev)?;
        self.sync()?;
        Ok(dev)
    }

    /// Uploads a launch's buffers with `upload` once, then the best time in seconds of `reps`
    /// runs of `launch`, each synchronized (the kernel alone, for benches).
    fn time_launches<D>(
        &self,
        reps: usize,
        upload: impl FnOnce(&Self) -> Result<D, CudaError>,
        mut launch: impl FnMut(&Self, &Kernels, &D) -> Result<(), CudaError>,
    ) -> Result<f64, CudaError> {
        let k = self.kernels(None)?;
        let dev = upload(self)?;
        self.sync()?;
        best_time(reps, || {
            launch(self, &k, &dev)?;
            self.sync()
        })
    }

    /// Sets how many host threads write a packed upload into the pinned staging buffer (each
    /// 4 MiB step queued to the device as soon as it is written) and copy an encode's chunks
    /// out of pinned memory into vectors ([`copy_chunks`](crate::encode_plan::copy_chunks));
    /// 0, the default, takes every core the process may use, at most
    /// [`DEFAULT_MAX_HOST_THREADS`](crate::DEFAULT_MAX_HOST_THREADS). What is uploaded or
    /// returned is the same.
    pub fn set_upload_threads(&mut self, threads: usize) {
        self.upload_threads = host_threads(threads);
    }

    /// Keeps up to `bytes` of freed device memory mapped in the device's memory pool, the
    /// one every stream-ordered allocation draws from (a chain's uploads, statuses and
    /// words): the driver's default, 0, unmaps every freed byte at each synchronization, so
    /// that each call maps its allocations again. The pool is the device's, shared by every
    /// user of the device in this process; the bits decoded or encoded are the same.
    pub fn set_pool_release_threshold(&self, bytes: u64) -> Result<(), CudaError> {
        ffi::set_pool_release_threshold(&self.ctx, bytes)
    }

    /// `p` uploaded through the first kept staging buffer by the upload threads.
    fn packed_upload(&self, p: ffi::Packer<'_>) -> Result<Arc<CudaSlice<u8>>, CudaError> {
        let mut staging = self.staging.lock().unwrap_or_else(|e| e.into_inner());
        p.upload(&self.stream, &mut staging[0], self.upload_threads)
    }

    /// Frees the pinned staging and readback buffers, the chains' scratch and the level
    /// constants (tables, table maps, channel constants of each profile and level decoded)
    /// this `Gpu` keeps between calls (the next call allocates or builds them again; the
    /// level constants are shared with forks).
    pub fn free_cached(&self) {
        *self.staging.lock().unwrap_or_else(|e| e.into_inner()) = Default::default();
        *self.readback.lock().unwrap_or_else(|e| e.into_inner()) = None;
        *self.scratch.lock().unwrap_or_else(|e| e.into_inner()) = Default::default();
        *self.resident.lock().unwrap_or_else(|e| e.into_inner()) = Default::default();
        self.levels.clear();
    }

    /// The chains' scratch slot `slot` (below [`MAX_PIECES_IN_FLIGHT`]), at least `bytes`
    /// long: the kept one, or a new one allocated on `stream` and kept instead (a chain holds
    /// its scratch until it is done).
    fn scratch(
        &self,
        slot: usize,
        bytes: usize,
        stream: &Arc<CudaStream>,
    ) -> Result<Arc<CudaSlice<u8>>, CudaError> {
        let mut slots = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let held = slots.get_mut(slot).ok_or(CudaError::Input {
            what: "a scratch slot past the last",
        })?;
        if let Some(s) = held.as_ref().filter(|s| s.len() >= bytes) {
            return Ok(s.clone());
        }
        *held = None;
        let new = Arc::new(
            stream
                .alloc_zeros::<u8>(bytes.max(1))
                .map_err(ffi::driver_err("cuMemAllocAsync"))?,
        );
        *held = Some(new.clone());
        Ok(new)
    }
}

/// The dequantization entry point for `output`'s dtype.
fn dequant_kernel(k: &Kernels, output: crate::quant::Output) -> &CudaFunction {
    match output.dtype {
        OutDtype::F16 => &k.dequant_f16,
        OutDtype::Bf16 => &k.dequant_bf16,
    }
}

/// The best of `reps` (at least one) timed runs of `run`, in seconds.
fn best_time(
    reps: usize,
    mut run: impl FnMut() -> Result<(), CudaError>,
) -> Result<f64, CudaError> {
    let mut best = f64::INFINITY;
    for _ in 0..reps.max(1) {
        let t = std::time::Instant::now();
        run()?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(best)
}

/// Every kernel file compiled for `arch`, from the process-wide cache or NVRTC.
fn cubins(arch: &str, nvrtc_dir: Option<&Path>) -> Result<Cubins, CudaError> {
    let mut cache = CUBINS.lock().unwrap_or_else(|e| e.into_inner());
    let cache = cache.get_or_insert_with(HashMap::new);
    if let Some(c) = cache.get(arch) {
        return Ok(c.clone());
    }
    let nvrtc = Nvrtc::load(nvrtc_dir)?;
    let mut all = Vec::with_capacity(KERNELS.len());
    for k in KERNELS {
        all.push((k.file, nvrtc.cubin(k, arch)?));
    }
    let all = Arc::new(all);
    cache.insert(arch.to_owned(), all.clone());
    Ok(all)
}
