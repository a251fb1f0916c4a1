//! # kvc codec-cuda
//!
//! The GPU companion of codec-core and pq-core: CUDA C kernels (`kernels/*.cu`) that decode and
//! encode kvc streams bit for bit as codec-core does and select tokens by PQ codes as pq-core
//! does, compiled at run time by NVRTC and launched through cudarc,
//! whose driver and NVRTC bindings are loaded at run time (`dynamic-loading`), so that the crate
//! builds, and its entry points return a [`CudaError`], on a machine without CUDA.
//!
//! The same kernel source is compiled for the host by `build.rs` (`kernels/host_shim.h` runs a
//! block's threads one after another, phase by phase): the `*_host` functions run it on the CPU,
//! and the tests compare their output with codec-core's, bit for bit, without a GPU.
//!
//! - [`rans`]: the rANS lane decode kernel's batches ([`rans::LaneBatch`]).
//! - [`quant`]: the dequantization kernel's batches ([`quant::DequantBatch`]), f16 or bf16,
//!   dense `[T, H, D]` or paged as vLLM keeps its cache.
//! - [`stream`]: a stream's chunks as lane-decode batches (exponents, then every symbol), their
//!   symbol values (escapes) and dequantization blocks.
//! - [`decode`]: a batch of chunks of one or several streams decoded by three launches into
//!   one output ([`decode::DecodePlan`]).
//! - [`pq`]: the PQ search kernel's batches ([`pq::PqBatch`]): score tables, scores and top-k
//!   for many queries over pq-core's packed codes, as `pq_core::search` selects.
//! - [`encode`]: the encode kernels' batches: quantization ([`encode::QuantBatch`]) and the
//!   32-lane rANS encoder ([`encode::LaneEncodeBatch`]), as codec-core's encoder computes them.
//! - [`encode_plan`]: chunks encoded from K/V where they lie (f32, f16 or bf16 `[T, H, D]`)
//!   by five launches, byte for byte codec-core's chunks ([`encode_plan::EncodePlan`]).
//! - [`experiment`]: not part of any format: a 32-bit-state lane coder (16-bit words) and its
//!   decode kernel, measured against format v2's 64-bit state (spec/FORMAT.md's appendix).
//! - `fuzzing` (feature `fuzzing`): the bodies of the cargo-fuzz targets `decode_chain` and
//!   `encode_chain`, the host-run kernels against codec-core on any stream and small caches.
//! - [`nvrtc`]: compiles every kernel with NVRTC and reports registers and spills.
//! - [`Gpu`]: a device (or the error saying why there is none), the kernels compiled for it
//!   once per process and loaded once, and every batch above uploaded, launched and downloaded
//!   on it.
//!
//! All `unsafe` code is in one private module, `ffi`, with its invariants written down.
#![warn(missing_docs)]

pub mod decode;
pub mod encode;
pub mod encode_plan;
mod error;
pub mod experiment;
mod ffi;
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
mod gpu;
mod levels;
pub mod nvrtc;
pub mod pq;
pub mod quant;
pub mod rans;
pub mod stream;

pub use error::CudaError;
pub use gpu::{
    EncodeTimes, Gpu, HostBuffer, PieceTimes, UploadedEncodePlan, UploadedPlan, UploadedPq,
    DEFAULT_ENCODE_PIECE_BLOCKS, DEFAULT_LANE_SHARED_TABLES, DEFAULT_PIECE_BLOCKS,
};
pub use nvrtc::{compile_report, KernelResources};
pub use rans::LaneShape;

/// Most host threads a call takes by default: threads that check a plan's chunks
/// ([`decode::DecodePlan::add_streams`]) or write a packed upload ([`Gpu::set_upload_threads`]).
pub const DEFAULT_MAX_HOST_THREADS: usize = 8;

/// The host threads `threads` asks for: itself, or with 0 the cores this process may use, at
/// most [`DEFAULT_MAX_HOST_THREADS`] (asked once per process: the count comes from the
/// operating system's files).
pub(crate) fn host_threads(threads: usize) -> usize {
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    match threads {
        0 => *CORES.get_or_init(|| {
            std::thread::available_parallelism()
                .map_or(1, |n| n.get())
                .min(DEFAULT_MAX_HOST_THREADS)
        }),
        n => n,
    }
}
