//! A CUDA device, opened through cudarc's run-time-loaded driver, and the kernels launched on it.
//!
//! The kernels are compiled by NVRTC to a CUBIN for the device's architecture once per process
//! and architecture (a process-wide cache), and loaded once per [`Gpu`]. Every launch goes on
//! the `Gpu`'s one stream ([`Gpu::fork`] gives another handle with a stream of its own, for
//! another host thread); each entry point uploads its batch (tables, words, block headers),
//! launches, synchronizes and downloads what the host needs next.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, PinnedHostSlice};
use cudarc::nvrtc::Ptx;

use crate::copy_runs::MERGE_GAP_BYTES;
use crate::decode::DEFAULT_CHAIN_FUSED;
use crate::decode::{check_chain, check_crcs_host, check_dequant, Chain, DecodePlan};
use crate::encode::{EncodeStatus, LaneEncodeBatch, LaneEncoded, QuantBatch};
use crate::error::CudaError;
use crate::experiment::Lane32Batch;
use crate::ffi::{self, DevBuf, LaneWord, LANES};
use crate::host_threads;
use crate::levels::LevelCache;
use crate::nvrtc::{Nvrtc, KERNELS};
use crate::pq::{PqBatch, PqSelected};
use crate::quant::{statuses, DequantBatch, DequantStatus, OutDtype, OutLayout, Output};
use crate::rans::{LaneBatch, LaneBuffers, LaneDecoded, LaneShape};

mod encode;
mod from_host;
mod pieces;
mod queued;
mod resident;

pub use encode::{EncodeTimes, UploadedEncodePlan, DEFAULT_ENCODE_PIECE_BLOCKS};
pub use from_host::HostBuffer;
use from_host::WordSource;
pub use pieces::{
    PieceTimes, DEFAULT_PIECES_IN_FLIGHT, DEFAULT_PIECE_BLOCKS, MAX_PIECES_IN_FLIGHT,
};
use queued::QueuedChain;

/// Every kernel file's CUBIN for one architecture.
type Cubins = Arc<Vec<(&'static str, Vec<u8>)>>;
/// CUBINs by architecture: NVRTC runs once per architecture per process.
type CubinCache = HashMap<String, Cubins>;
static CUBINS: Mutex<Option<CubinCache>> = Mutex::new(None);

/// An input error for a paged output of page size 0.
fn check_page_size(plan: &DecodePlan<'_>) -> Result<(), CudaError> {
    match plan.output().layout {
        OutLayout::Paged { page_size: 0 } => Err(CudaError::Input {
            what: "a page size of 0",
        }),
        _ => Ok(()),
    }
}

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

/// A [`DecodePlan`]'s chain uploaded to one device ([`Gpu::upload_plan`]): every input of its
/// launches (words, tables, table maps, block headers, sink rows, constants, page tables)
/// in one device allocation, decoded by [`Gpu::decode_uploaded_into`] any number of times with
/// no host work but the launches and the statuses.
#[derive(Debug)]
pub struct UploadedPlan {
    queued: QueuedChain,
    /// Per block, its chunk (for errors).
    chunk_of: Vec<usize>,
    output: Output,
    /// The stream (so the device) it was uploaded to.
    stream: Arc<CudaStream>,
}

impl UploadedPlan {
    /// The output the plan writes.
    pub fn output(&self) -> Output {
        self.output
    }
}

/// A [`PqBatch`] on one device ([`Gpu::upload_pq`]): its codebooks, codes and query records
/// uploaded once, searched by [`Gpu::search_uploaded`] with new query values each time, its
/// heads grown by [`Gpu::append_pq`].
#[derive(Debug)]
pub struct UploadedPq {
    dev: ffi::PqDev,
    layout: crate::pq::PqLayout,
    /// The stream (so the device) it was uploaded to.
    stream: Arc<CudaStream>,
}

impl UploadedPq {
    /// Query values a search takes (all of the batch's).
    pub fn query_values(&self) -> usize {
        self.dev.queries.len()
    }
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
    /// The selections are the same either way ([`PqBatch::search_host_keeping`]).
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

    #[cfg(feature = "internals")]
    /// Decodes every block of `batch` on the device (as [`LaneBatch::decode_host`] does on the
    /// host): words, tables and block headers uploaded, one launch, symbols and statuses back.
    pub fn lane_decode(&self, batch: &LaneBatch) -> Result<LaneDecoded, CudaError> {
        let t = self.lane_shape;
        let dev = self.run_once(
            |g| g.upload_lanes(batch.buffers()),
            |g, k, d| ffi::launch_lane_decode(&g.stream, &k.lane_decode, d, t),
        )?;
        let s = &self.stream;
        Ok(batch.decoded(dev.symbols.download(s)?, dev.status.download(s)?))
    }

    fn upload_lanes<W: LaneWord>(
        &self,
        b: LaneBuffers<'_, W>,
    ) -> Result<ffi::LaneDecodeDev<W>, CudaError> {
        let s = &self.stream;
        Ok(ffi::LaneDecodeDev {
            words: DevBuf::upload(s, b.words)?,
            tables: DevBuf::upload(s, b.tables)?,
            table_list: DevBuf::upload(s, b.table_list)?,
            symbol_table: DevBuf::upload(s, b.symbol_table)?,
            blocks: DevBuf::upload(s, b.blocks)?,
            symbols: DevBuf::zeros(s, b.symbol_table.len())?,
            status: DevBuf::zeros(s, b.blocks.len() * LANES)?,
            compact: false,
        })
    }

    #[cfg(feature = "internals")]
    /// For benches: the best time in seconds of `reps` lane-decode launches over `batch`,
    /// uploaded once (the kernel alone: each launch queued, then the stream synchronized).
    pub fn time_lane_decode(&self, batch: &LaneBatch, reps: usize) -> Result<f64, CudaError> {
        let t = self.lane_shape;
        self.time_launches(
            reps,
            |g| g.upload_lanes(batch.buffers()),
            |g, k, d| ffi::launch_lane_decode(&g.stream, &k.lane_decode, d, t),
        )
    }

    #[cfg(feature = "internals")]
    /// Not part of any format: decodes `batch` with the 32-bit-state experiment's kernel (as
    /// [`Lane32Batch::decode_host`] does on the host).
    pub fn lane32_decode_experiment(&self, batch: &Lane32Batch) -> Result<LaneDecoded, CudaError> {
        let t = self.lane_shape;
        let dev = self.run_once(
            |g| g.upload_lanes(batch.buffers()),
            |g, k, d| ffi::launch_lane_decode(&g.stream, &k.lane32_experiment, d, t),
        )?;
        let s = &self.stream;
        Ok(batch.decoded(dev.symbols.download(s)?, dev.status.download(s)?))
    }

    #[cfg(feature = "internals")]
    /// For benches: [`time_lane_decode`](Self::time_lane_decode) for the 32-bit-state
    /// experiment's kernel.
    pub fn time_lane32_decode_experiment(
        &self,
        batch: &Lane32Batch,
        reps: usize,
    ) -> Result<f64, CudaError> {
        let t = self.lane_shape;
        self.time_launches(
            reps,
            |g| g.upload_lanes(batch.buffers()),
            |g, k, d| ffi::launch_lane_decode(&g.stream, &k.lane32_experiment, d, t),
        )
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

    #[cfg(feature = "internals")]
    /// Runs the dequantization kernel over `batch` on the device into `out`, a device buffer of
    /// at least the batch's output length on [`stream`](Self::stream); the blocks' statuses.
    pub fn dequant_into(
        &self,
        batch: &DequantBatch,
        out: &mut CudaSlice<u16>,
    ) -> Result<Vec<DequantStatus>, CudaError> {
        if batch.output().layout == (OutLayout::Paged { page_size: 0 }) {
            return Err(CudaError::Input {
                what: "a page size of 0",
            });
        }
        let o = batch.output();
        let dev = self.run_once(
            |g| g.upload_dequant(batch),
            |g, k, d| ffi::launch_dequant(&g.stream, dequant_kernel(k, o), d, out, o.len),
        )?;
        Ok(statuses(dev.status.download(&self.stream)?))
    }

    fn upload_dequant(&self, batch: &DequantBatch) -> Result<ffi::DequantDev, CudaError> {
        let s = &self.stream;
        let io = batch.io(&mut [], &mut []);
        Ok(ffi::DequantDev {
            q: DevBuf::upload(s, io.q)?,
            exps: DevBuf::upload(s, io.exps)?,
            sink: DevBuf::upload(s, io.sink)?,
            consts: DevBuf::upload(s, io.consts)?,
            pages: DevBuf::upload(s, io.pages)?,
            blocks: DevBuf::upload(s, io.blocks)?,
            status: DevBuf::zeros(s, io.blocks.len())?,
            heads: io.heads,
            head_dim: io.head_dim,
            page_size: io.page_size,
        })
    }

    #[cfg(feature = "internals")]
    /// For benches: the best time in seconds of `reps` dequantization launches over `batch`
    /// into `out`, uploaded once (the kernel alone).
    pub fn time_dequant(
        &self,
        batch: &DequantBatch,
        out: &mut CudaSlice<u16>,
        reps: usize,
    ) -> Result<f64, CudaError> {
        let o = batch.output();
        self.time_launches(
            reps,
            |g| g.upload_dequant(batch),
            |g, k, d| ffi::launch_dequant(&g.stream, dequant_kernel(k, o), d, out, o.len),
        )
    }

    #[cfg(feature = "internals")]
    /// [`dequant_into`](Self::dequant_into) a zeroed buffer, downloaded: as
    /// [`DequantBatch::decode_host`] gives it.
    pub fn dequant(
        &self,
        batch: &DequantBatch,
    ) -> Result<(Vec<u16>, Vec<DequantStatus>), CudaError> {
        let len = batch.output().len;
        let mut out = self
            .stream
            .alloc_zeros::<u16>(len.max(1))
            .map_err(ffi::driver_err("cuMemAllocAsync"))?;
        let status = self.dequant_into(batch, &mut out)?;
        let mut host = self
            .stream
            .clone_dtoh(&out)
            .map_err(ffi::driver_err("cuMemcpyDtoHAsync"))?;
        host.truncate(len);
        Ok((host, status))
    }

    /// Decodes every chunk of `plan` into `out`, a device buffer of at least the plan's output
    /// length (e.g. a serving engine's KV pages) on [`stream`](Self::stream): every input
    /// uploaded at once ([`upload_plan`](Self::upload_plan)), then one chain of launches
    /// (exponents, symbols, values with escapes, dequantization; see
    /// [`set_decode_chain_fused`](Self::set_decode_chain_fused)) with no host step between
    /// them, then the statuses. A plan of more than about
    /// [`set_decode_piece_blocks`](Self::set_decode_piece_blocks) coded blocks goes in pieces,
    /// each piece's upload beside the launches of the one before; the bits are the same.
    pub fn decode_into(
        &self,
        plan: &DecodePlan<'_>,
        out: &mut CudaSlice<u16>,
    ) -> Result<(), CudaError> {
        self.decode_in_pieces(plan, None, out)
    }

    /// Builds `plan`'s chain and uploads every input of its launches to this device in one
    /// copy from pinned memory (each block's words copied once, from the plan into the
    /// staging buffer), to be decoded by [`decode_uploaded_into`](Self::decode_uploaded_into)
    /// once or many times.
    pub fn upload_plan(&self, plan: &DecodePlan<'_>) -> Result<UploadedPlan, CudaError> {
        self.upload_plan_timed(plan, None, None)
    }

    /// [`upload_plan`](Self::upload_plan); with `times`, the seconds of building the chain, of
    /// its upload queued and done (the packed copy, and with `host` the copy of the bytes as
    /// they lie, the word gather and the chunk checks) and of its statuses read and checked.
    fn upload_plan_timed(
        &self,
        plan: &DecodePlan<'_>,
        host: Option<&HostBuffer>,
        times: Option<&mut [f64; 3]>,
    ) -> Result<UploadedPlan, CudaError> {
        check_page_size(plan)?;
        let t0 = std::time::Instant::now();
        let (chain, levels) = self.resident_chain(plan, 0..plan.chunks(), &self.stream)?;
        let raw = match host {
            None => {
                check_crcs_host(&chain.checks)?;
                None
            }
            Some(h) => {
                let bytes = h.as_slice()?;
                Some((bytes, chain.gather_parts(bytes, MERGE_GAP_BYTES)?))
            }
        };
        let source = WordSource::of(&raw, None);
        let t1 = std::time::Instant::now();
        let queued = {
            let mut staging = self.staging.lock().unwrap_or_else(|e| e.into_inner());
            let on = (&self.stream, &mut staging[0]);
            let mut q = self.queue_chain(&chain, source, on, 0, Some(levels), &self.stream)?;
            self.sync()?;
            q.free_raw();
            q
        };
        let t2 = std::time::Instant::now();
        queued.check_gathered_on(&self.stream, &chain.checks)?;
        if let Some(times) = times {
            let secs = |a: std::time::Instant, b: std::time::Instant| (b - a).as_secs_f64();
            *times = [secs(t0, t1), secs(t1, t2), t2.elapsed().as_secs_f64()];
        }
        Ok(UploadedPlan {
            queued,
            chunk_of: chain.chunk_of,
            output: plan.output(),
            stream: self.stream.clone(),
        })
    }

    /// Runs an uploaded plan's chain of launches into `out` (as
    /// [`decode_into`](Self::decode_into)), then reads its verdict, and its statuses to name
    /// the failing chunk when the verdict fails.
    pub fn decode_uploaded_into(
        &self,
        up: &UploadedPlan,
        out: &mut CudaSlice<u16>,
    ) -> Result<(), CudaError> {
        if !Arc::ptr_eq(&up.stream, &self.stream) {
            return Err(CudaError::Input {
                what: "a plan uploaded through another Gpu",
            });
        }
        let k = self.kernels(None)?;
        let _one_chain = self.chain_lock.lock().unwrap_or_else(|e| e.into_inner());
        self.launch_chain(&self.stream, &k, &up.queued.dev, up.output, out)?;
        let verdict = queued::Verdicts::new(&self.stream, 1)?;
        up.queued
            .judge(&self.stream, &k.chain_verdict, verdict.word(0)?)?;
        if verdict.all_passed(&self.stream)? {
            return Ok(());
        }
        let statuses = ffi::download_base(&self.stream, &up.queued.statuses)?;
        let [exp, resolve, sym, value, dequant] = up.queued.chain_statuses(&statuses)?;
        check_chain(&up.chunk_of, [&exp, &resolve, &sym, &value, &dequant])
    }

    #[cfg(feature = "internals")]
    /// For benches: the best time in seconds over `reps` runs of [`upload_plan`](Self::upload_plan)
    /// (the chain built from the plan, packed, copied from pinned memory to the device, its
    /// statuses read), or with `host` of [`upload_plan_from`](Self::upload_plan_from), and of
    /// each of those three steps (each synchronized; the words' copy and gather and the chunk
    /// checks count in the second).
    pub fn time_upload_plan(
        &self,
        plan: &DecodePlan<'_>,
        host: Option<&HostBuffer>,
        reps: usize,
    ) -> Result<[f64; 4], CudaError> {
        self.kernels(None)?;
        let mut best = [f64::INFINITY; 4];
        for _ in 0..reps.max(1) {
            let mut parts = [0.0; 3];
            let t = std::time::Instant::now();
            drop(self.upload_plan_timed(plan, host, Some(&mut parts))?);
            best[0] = best[0].min(t.elapsed().as_secs_f64());
            for (b, p) in best[1..].iter_mut().zip(parts) {
                *b = b.min(p);
            }
        }
        Ok(best)
    }

    #[cfg(feature = "internals")]
    /// For benches: the best time in seconds of `reps` runs of `plan`'s chain of launches,
    /// its inputs uploaded once (the kernels alone).
    pub fn time_decode_chain(
        &self,
        plan: &DecodePlan<'_>,
        out: &mut CudaSlice<u16>,
        reps: usize,
    ) -> Result<f64, CudaError> {
        let chain = plan.chain_with(&self.levels)?;
        let _one_chain = self.chain_lock.lock().unwrap_or_else(|e| e.into_inner());
        self.time_launches(
            reps,
            |g| g.upload_chain(&chain),
            |g, k, q| g.launch_chain(&g.stream, k, &q.dev, plan.output(), out),
        )
    }

    /// Queues the chain `dev`'s launches into `out` on `stream`.
    fn launch_chain(
        &self,
        stream: &CudaStream,
        k: &Kernels,
        dev: &ffi::ChainDev,
        output: crate::quant::Output,
        out: &mut CudaSlice<u16>,
    ) -> Result<(), CudaError> {
        let kernels = chain_kernels(k, output);
        ffi::launch_chain(stream, &kernels, dev, self.lane_shape, out, output.len)
    }

    #[cfg(feature = "internals")]
    /// For benches: the best time in seconds of each of the chain's five launches (exponents,
    /// table resolution, symbols, values, dequantization) over `reps` runs, each launch
    /// synchronized alone (the fused chain's table resolution is no launch: about 0).
    pub fn time_decode_chain_stages(
        &self,
        plan: &DecodePlan<'_>,
        out: &mut CudaSlice<u16>,
        reps: usize,
    ) -> Result<[f64; 5], CudaError> {
        let k = self.kernels(None)?;
        let chain = plan.chain_with(&self.levels)?;
        let _one_chain = self.chain_lock.lock().unwrap_or_else(|e| e.into_inner());
        let dev = self.upload_chain(&chain)?.dev;
        let kernels = chain_kernels(&k, plan.output());
        let n_out = plan.output().len;
        self.sync()?;
        let mut best = [f64::INFINITY; 5];
        for _ in 0..reps.max(1) {
            for (stage, b) in best.iter_mut().enumerate() {
                let t = std::time::Instant::now();
                ffi::launch_chain_stage(
                    &self.stream,
                    &kernels,
                    &dev,
                    self.lane_shape,
                    out,
                    n_out,
                    stage as u8,
                )?;
                self.sync()?;
                *b = b.min(t.elapsed().as_secs_f64());
            }
        }
        Ok(best)
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

    /// `ch` uploaded with its words packed, on this `Gpu`'s stream (synchronized): for the
    /// benches of its launches.
    fn upload_chain(&self, ch: &Chain<'_>) -> Result<QueuedChain, CudaError> {
        let mut staging = self.staging.lock().unwrap_or_else(|e| e.into_inner());
        let on = (&self.stream, &mut staging[0]);
        let queued = self.queue_chain(ch, WordSource::Packed, on, 0, None, &self.stream)?;
        self.sync()?;
        Ok(queued)
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

    #[cfg(feature = "internals")]
    /// The three-launch path with the host's steps between launches (table resolution and
    /// value mapping on the host; [`DecodePlan::decode_host`]'s order), into `out`.
    pub fn decode_into_stepwise(
        &self,
        plan: &DecodePlan<'_>,
        out: &mut CudaSlice<u16>,
    ) -> Result<(), CudaError> {
        plan.check_crcs_host()?;
        let exp_out = self.lane_decode(&plan.exponent_batch()?)?;
        let exps = plan.exponents(&exp_out)?;
        let sym_out = self.lane_decode(&plan.symbol_batch(&exps)?)?;
        let batch = plan.dequant_batch(&sym_out, &exps)?;
        check_dequant(&self.dequant_into(&batch, out)?)
    }

    /// Decodes every chunk of `plan` on the device: the output's f16 or bf16 bits, as
    /// [`DecodePlan::decode_chain_host`] gives them.
    pub fn decode(&self, plan: &DecodePlan<'_>) -> Result<Vec<u16>, CudaError> {
        self.decode_to_vec(plan, |out| self.decode_into(plan, out))
    }

    /// The output of `plan` decoded by `decode` into a new device buffer, copied back.
    fn decode_to_vec(
        &self,
        plan: &DecodePlan<'_>,
        decode: impl FnOnce(&mut CudaSlice<u16>) -> Result<(), CudaError>,
    ) -> Result<Vec<u16>, CudaError> {
        let len = plan.output().len;
        let mut out = self
            .stream
            .alloc_zeros::<u16>(len.max(1))
            .map_err(ffi::driver_err("cuMemAllocAsync"))?;
        decode(&mut out)?;
        let mut host = self
            .stream
            .clone_dtoh(&out)
            .map_err(ffi::driver_err("cuMemcpyDtoHAsync"))?;
        host.truncate(len);
        Ok(host)
    }

    /// Runs the PQ search over `batch` on the device: as [`PqBatch::search_host`] gives it.
    pub fn search(&self, batch: &PqBatch) -> Result<PqSelected, CudaError> {
        let upload = |g: &Self| g.upload_pq_with(batch, false);
        let dev = self.run_once(upload, |g, k, d| g.launch_pq(k, d, batch))?;
        let s = &self.stream;
        let out = dev.out.download(s)?;
        let status = dev.status.download(s)?;
        Ok(batch.selected(out, status))
    }

    /// For benches: the best time in seconds of `reps` PQ search launches over `batch`,
    /// uploaded once (the kernel alone).
    pub fn time_search(&self, batch: &PqBatch, reps: usize) -> Result<f64, CudaError> {
        self.time_launches(
            reps,
            |g| g.upload_pq_with(batch, false),
            |g, k, d| g.launch_pq(k, d, batch),
        )
    }

    /// Uploads `batch` once for [`search_uploaded`](Self::search_uploaded): its codebooks,
    /// codes and query records stay on the device, as a server keeps a context's codes
    /// between decode steps.
    pub fn upload_pq(&self, batch: &PqBatch) -> Result<UploadedPq, CudaError> {
        let dev = self.upload_pq_with(batch, true)?;
        self.sync()?;
        Ok(UploadedPq {
            dev,
            layout: batch.layout().clone(),
            stream: self.stream.clone(),
        })
    }

    /// Runs the PQ search of the batch uploaded as `up` with `values` in place of its query
    /// values (as [`PqBatch::set_query_values`] takes them: a decode step's queries over the
    /// same heads and tokens): only those are uploaded. As [`PqBatch::search_host`] gives it
    /// for the batch with those values. `up` is borrowed mutably: its buffers hold one search
    /// at a time.
    pub fn search_uploaded(
        &self,
        up: &mut UploadedPq,
        values: &[f32],
    ) -> Result<PqSelected, CudaError> {
        if !Arc::ptr_eq(&up.stream, &self.stream) {
            return Err(CudaError::Input {
                what: "a PQ batch uploaded through another Gpu",
            });
        }
        crate::pq::check_query_values(up.dev.queries.len(), values)?;
        let s = &self.stream;
        up.dev.queries.write(s, values)?;
        let k = self.kernels(None)?;
        let shape = up.layout.shape(self.pq_shared_keys, k.pq_shared_budget)?;
        ffi::launch_pq(s, &k.pq_search, &up.dev, shape)?;
        let out = up.dev.out.download(s)?;
        let status = up.dev.status.download(s)?;
        Ok(up.layout.selected(out, status))
    }

    /// Appends the codes of more tokens to `head` of the batch uploaded as `up`, as
    /// [`PqBatch::append_tokens`] does to a batch (the head added with room for them; the
    /// queries that saw all of its tokens see the new ones too): only the bytes of the codes
    /// that change and the query records are uploaded, so a decode step adds its new keys
    /// without uploading the context's codes again. An error changes nothing on the host; a
    /// failed copy may leave the device's codes partly appended, which the next successful
    /// append of the same codes writes whole.
    pub fn append_pq(
        &self,
        up: &mut UploadedPq,
        head: crate::pq::HeadId,
        codes: &[u16],
    ) -> Result<(), CudaError> {
        if !Arc::ptr_eq(&up.stream, &self.stream) {
            return Err(CudaError::Input {
                what: "a PQ batch uploaded through another Gpu",
            });
        }
        let mut layout = up.layout.clone();
        let (at, bytes) = layout.append(head, codes)?;
        let at = usize::try_from(at).map_err(|_| CudaError::Input {
            what: "codes past the address space",
        })?;
        up.dev.codes.write_at(&self.stream, at, &bytes)?;
        up.dev.items.write(&self.stream, layout.items())?;
        up.layout = layout;
        Ok(())
    }

    fn launch_pq(&self, k: &Kernels, d: &ffi::PqDev, batch: &PqBatch) -> Result<(), CudaError> {
        let shape = batch.shape(self.pq_shared_keys, k.pq_shared_budget)?;
        ffi::launch_pq(&self.stream, &k.pq_search, d, shape)
    }

    /// The batch's inputs in one packed upload (see [`ffi::Packer`]), its scratch keys and
    /// outputs in allocations of their own; `resident` (a batch kept for later searches),
    /// its query values, codes and query records in allocations of their own too (which
    /// searches and appends overwrite).
    fn upload_pq_with(&self, batch: &PqBatch, resident: bool) -> Result<ffi::PqDev, CudaError> {
        let s = &self.stream;
        let (keys_len, out_len) = batch.lens();
        let io = batch.io(&mut [], &mut [], &mut []);
        let mut p = ffi::Packer::default();
        let packed = (!resident).then(|| (p.add(io.queries), p.add(io.codes), p.add(io.items)));
        let codewords = p.add(io.codewords);
        let base = self.packed_upload(p)?;
        let (queries, codes, items) = match packed {
            Some((queries, codes, items)) => (
                DevBuf::view(&base, queries)?,
                DevBuf::view(&base, codes)?,
                DevBuf::view(&base, items)?,
            ),
            None => (
                DevBuf::upload(s, io.queries)?,
                DevBuf::upload(s, io.codes)?,
                DevBuf::upload(s, io.items)?,
            ),
        };
        Ok(ffi::PqDev {
            queries,
            codewords: DevBuf::view(&base, codewords)?,
            codes,
            keys: DevBuf::zeros(s, keys_len)?,
            out: DevBuf::zeros(s, out_len)?,
            items,
            status: DevBuf::zeros(s, io.items.len())?,
            dim: io.dim,
            m: io.m,
            bits: io.bits,
            residual: io.residual,
        })
    }
}

impl Gpu {
    fn upload_quant(&self, batch: &QuantBatch) -> Result<ffi::QuantDev, CudaError> {
        let s = &self.stream;
        let io = batch.io(&mut [], &mut []);
        Ok(ffi::QuantDev {
            x: DevBuf::upload(s, io.x)?,
            exps: DevBuf::upload(s, io.exps)?,
            consts: DevBuf::upload(s, io.consts)?,
            q: DevBuf::zeros(s, batch.q_len())?,
            blocks: DevBuf::upload(s, io.blocks)?,
            status: DevBuf::zeros(s, io.blocks.len())?,
            heads: io.heads,
            head_dim: io.head_dim,
        })
    }

    #[cfg(feature = "internals")]
    /// Quantizes every block of `batch` on the device: as [`QuantBatch::quantize_host`]
    /// gives it.
    pub fn quantize(&self, batch: &QuantBatch) -> Result<Vec<(Vec<i32>, EncodeStatus)>, CudaError> {
        let dev = self.run_once(
            |g| g.upload_quant(batch),
            |g, k, d| ffi::launch_quantize(&g.stream, &k.quantize, d),
        )?;
        let s = &self.stream;
        Ok(batch.quantized(dev.q.download(s)?, dev.status.download(s)?))
    }

    #[cfg(feature = "internals")]
    /// For benches: the best time in seconds of `reps` quantization launches over `batch`,
    /// uploaded once (the kernel alone).
    pub fn time_quantize(&self, batch: &QuantBatch, reps: usize) -> Result<f64, CudaError> {
        self.time_launches(
            reps,
            |g| g.upload_quant(batch),
            |g, k, d| ffi::launch_quantize(&g.stream, &k.quantize, d),
        )
    }

    fn upload_lane_encode(&self, batch: &LaneEncodeBatch) -> Result<ffi::LaneEncodeDev, CudaError> {
        let s = &self.stream;
        let io = batch.io(&mut [], &mut [], &mut []);
        Ok(ffi::LaneEncodeDev {
            symbols: DevBuf::upload(s, io.symbols)?,
            symbol_table: DevBuf::upload(s, io.symbol_table)?,
            tables: DevBuf::upload(s, io.tables)?,
            table_list: DevBuf::upload(s, io.table_list)?,
            words: DevBuf::zeros(s, batch.n_words())?,
            lane_len: DevBuf::zeros(s, io.blocks.len() * LANES)?,
            blocks: DevBuf::upload(s, io.blocks)?,
            status: DevBuf::zeros(s, io.blocks.len() * LANES)?,
        })
    }

    #[cfg(feature = "internals")]
    /// Encodes every block of `batch` on the device: as [`LaneEncodeBatch::encode_host`]
    /// gives it.
    pub fn lane_encode(&self, batch: &LaneEncodeBatch) -> Result<LaneEncoded, CudaError> {
        let dev = self.run_once(
            |g| g.upload_lane_encode(batch),
            |g, k, d| ffi::launch_lane_encode(&g.stream, &k.lane_encode, d),
        )?;
        let s = &self.stream;
        Ok(batch.encoded(
            dev.words.download(s)?,
            dev.lane_len.download(s)?,
            dev.status.download(s)?,
        ))
    }

    #[cfg(feature = "internals")]
    /// For benches: the best time in seconds of `reps` lane-encode launches over `batch`,
    /// uploaded once (the kernel alone).
    pub fn time_lane_encode(&self, batch: &LaneEncodeBatch, reps: usize) -> Result<f64, CudaError> {
        self.time_launches(
            reps,
            |g| g.upload_lane_encode(batch),
            |g, k, d| ffi::launch_lane_encode(&g.stream, &k.lane_encode, d),
        )
    }
}

/// The dequantization entry point for `output`'s dtype.
fn dequant_kernel(k: &Kernels, output: crate::quant::Output) -> &CudaFunction {
    match output.dtype {
        OutDtype::F16 => &k.dequant_f16,
        OutDtype::Bf16 => &k.dequant_bf16,
    }
}

/// The chain's kernels for `output`'s dtype.
fn chain_kernels(k: &Kernels, output: crate::quant::Output) -> ffi::ChainKernels<'_> {
    ffi::ChainKernels {
        lane: &k.lane_decode,
        lane_mapped: &k.lane_decode_mapped,
        lane_compact: &k.lane_decode_compact,
        lane_mapped_compact: &k.lane_decode_mapped_compact,
        resolve: &k.resolve_tables,
        map_values: &k.map_values,
        map_escapes: &k.map_escapes,
        dequant: dequant_kernel(k, output),
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
