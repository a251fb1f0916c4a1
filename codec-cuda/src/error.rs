//! The crate's one error type.

use std::fmt;

/// Why a GPU, NVRTC or host-kernel operation failed. Every entry point returns one of these where
/// CUDA is missing, instead of panicking.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum CudaError {
    /// The CUDA driver library (`libcuda.so`) could not be loaded.
    NoDriver,
    /// The driver is there but has no device `ordinal` (`count` devices).
    NoDevice {
        /// The device asked for.
        ordinal: usize,
        /// Devices the driver reports.
        count: usize,
    },
    /// A driver call failed.
    Driver {
        /// The call.
        call: &'static str,
        /// The driver's result code.
        code: String,
    },
    /// No NVRTC library (`libnvrtc.so.13` or another name cudarc searches) could be loaded: set
    /// `KVC_NVRTC_LIB` (see [`crate::nvrtc::NVRTC_LIB_ENV`]) or put its directory on
    /// `LD_LIBRARY_PATH`.
    NoNvrtc,
    /// The library named by `KVC_NVRTC_LIB` could not be loaded.
    NvrtcLib {
        /// The path tried.
        path: String,
        /// The loader's message.
        reason: String,
    },
    /// The loaded NVRTC lacks a function this crate calls (it is older than CUDA 11.2).
    NvrtcSymbol {
        /// The missing function.
        name: &'static str,
    },
    /// An NVRTC call other than the compilation itself failed.
    Nvrtc {
        /// The call.
        call: &'static str,
        /// NVRTC's result code.
        code: String,
    },
    /// NVRTC rejected a kernel's source.
    Compile {
        /// The kernel source's file name.
        kernel: &'static str,
        /// The target architecture, e.g. `sm_80`.
        arch: String,
        /// NVRTC's program log.
        log: String,
    },
    /// The compiler's log reports no registers and spills for an entry point of the kernel (its
    /// format changed, or the entry point is missing from the source).
    NoResources {
        /// The kernel source's file name.
        kernel: &'static str,
        /// The entry point.
        entry: &'static str,
    },
    /// A host run of a kernel could not start (its shared memory could not be allocated).
    HostRun {
        /// The entry point.
        entry: &'static str,
    },
    /// A chunk's block structure is malformed (spec/FORMAT.md §5.5, checks B1-B5 and C2).
    Stream {
        /// The chunk.
        chunk: usize,
        /// What is wrong, with the check it fails.
        what: &'static str,
    },
    /// A chunk of an encode plan could not be encoded (a kernel reported a bad block).
    Encode {
        /// The chunk's index in the plan.
        chunk: usize,
        /// What failed.
        what: &'static str,
    },
    /// Input to a launch is inconsistent.
    Input {
        /// What is wrong.
        what: &'static str,
    },
}

impl fmt::Display for CudaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CudaError::NoDriver => f.write_str("the CUDA driver library could not be loaded"),
            CudaError::NoDevice { ordinal, count } => {
                write!(f, "no CUDA device {ordinal} (the driver reports {count})")
            }
            CudaError::Driver { call, code } => write!(f, "CUDA driver call {call} failed: {code}"),
            CudaError::NoNvrtc => f.write_str(
                "no NVRTC library could be loaded (set KVC_NVRTC_LIB to libnvrtc.so.13 or its \
                 directory; tools/fetch-nvrtc fetches it)",
            ),
            CudaError::NvrtcLib { path, reason } => {
                write!(f, "KVC_NVRTC_LIB={path} could not be loaded: {reason}")
            }
            CudaError::NvrtcSymbol { name } => {
                write!(
                    f,
                    "the loaded NVRTC has no {name} (CUDA 11.2 or newer is needed)"
                )
            }
            CudaError::Nvrtc { call, code } => write!(f, "NVRTC call {call} failed: {code}"),
            CudaError::Compile { kernel, arch, log } => {
                write!(f, "NVRTC could not compile {kernel} for {arch}:\n{log}")
            }
            CudaError::NoResources { kernel, entry } => write!(
                f,
                "the compiler log of {kernel} reports no registers or spills for {entry}"
            ),
            CudaError::HostRun { entry } => {
                write!(
                    f,
                    "the host run of {entry} could not allocate its shared memory"
                )
            }
            CudaError::Stream { chunk, what } => write!(f, "chunk {chunk}: {what}"),
            CudaError::Encode { chunk, what } => {
                write!(
                    f,
                    "chunk {chunk} of the encode plan could not be encoded: {what}"
                )
            }
            CudaError::Input { what } => write!(f, "inconsistent launch input: {what}"),
        }
    }
}

impl std::error::Error for CudaError {}
