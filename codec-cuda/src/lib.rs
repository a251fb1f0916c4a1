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
//! - [`Gpu`]: a device (or the error saying why there is none), the kernels compiled for it
//!   once per process and loaded once; it decodes plans of many streams' chunks into f16 or
//!   bf16 K/V, dense `[T, H, D]` or paged as vLLM keeps its cache ([`Destination`],
//!   [`OutLayout`]), encodes caches where they lie, and searches PQ codes.
//! - [`decode`]: a batch of chunks of one or several streams decoded by one chain of launches
//!   into one output ([`decode::DecodePlan`]).
//! - [`encode_plan`]: chunks encoded from K/V where they lie (f32, f16 or bf16 `[T, H, D]`),
//!   byte for byte codec-core's chunks ([`encode_plan::EncodePlan`]).
//! - [`pq`]: the PQ search kernel's batches ([`pq::PqBatch`]): score tables, scores and top-k
//!   for many queries over pq-core's packed codes, as `pq_core::search` selects.
//! - [`nvrtc`]: compiles every kernel with NVRTC and reports registers and spills.
//! - With the feature `internals` (the crate's tests, benches and device bench; not a stable
//!   API): the kernels' stepwise batches as modules, `rans` (lane decode), `quant`
//!   (dequantization), `stream` (a stream's chunks as lane batches), `encode` (quantization
//!   and lane encode) and `experiment` (a 32-bit-state lane coder, not part of any format,
//!   measured against format v2's 64-bit state in spec/FORMAT.md's appendix), and `Gpu`'s
//!   launches of each and its timings.
//! - `fuzzing` (feature `fuzzing`): the bodies of the cargo-fuzz targets `decode_chain` and
//!   `encode_chain`, the host-run kernels against codec-core on any stream and small caches.
//!
//! All `unsafe` code is in one private module, `ffi`, with its invariants written down.
#![warn(missing_docs)]
// Without `internals` the stepwise batches are the chain's private parts: what only their
// public launches used is not built into anything.
#![cfg_attr(
    not(feature = "internals"),
    allow(dead_code, private_interfaces, unused_imports)
)]

/// The modules public with the `internals` feature, private without.
macro_rules! internal_mods {
    ($($name:ident),*) => {$(
        #[cfg(feature = "internals")]
        pub mod $name;
        #[cfg(not(feature = "internals"))]
        mod $name;
    )*};
}

mod copy_runs;
pub mod decode;
pub mod encode_plan;
mod error;
mod ffi;
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
mod gpu;
mod levels;
pub mod nvrtc;
pub mod pq;
internal_mods!(encode, experiment, quant, rans, stream);

pub use error::CudaError;
#[cfg(feature = "internals")]
pub use gpu::{EncodeTimes, PieceTimes};
pub use gpu::{
    Gpu, HostBuffer, UploadedEncodePlan, UploadedPlan, UploadedPq, DEFAULT_ENCODE_PIECE_BLOCKS,
    DEFAULT_LANE_SHARED_TABLES, DEFAULT_PIECES_IN_FLIGHT, DEFAULT_PIECE_BLOCKS,
    MAX_PIECES_IN_FLIGHT,
};
pub use nvrtc::{compile_report, KernelResources};
pub use quant::{OutDtype, OutLayout, Output};
pub use rans::LaneShape;
pub use stream::Destination;

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
