//! Compiling the kernels with NVRTC (loaded at run time through cudarc) and reading the
//! resources ptxas reports for each entry point: registers, spills, stack and shared memory.
//!
//! No GPU is needed: NVRTC compiles CUDA C to PTX and, for a real architecture such as `sm_80`,
//! on to a CUBIN, and with `--ptxas-options=-v` its program log has ptxas' report. The PyPI wheel
//! `nvidia-cuda-nvrtc` 13.5 holds the library (`tools/fetch-nvrtc`).

use std::fmt;
use std::path::{Path, PathBuf};

use crate::error::CudaError;
use crate::ffi;

/// Environment variable naming the directory that holds `libnvrtc.so.13` (or the library file).
pub const NVRTC_LIB_ENV: &str = "KVC_NVRTC_LIB";

/// The architectures every kernel is compiled for: A100 (`sm_80`) and H100 (`sm_90`).
pub const ARCHS: [&str; 2] = ["sm_80", "sm_90"];

/// One kernel source file and its entry points.
#[derive(Clone, Copy, Debug)]
pub struct KernelSource {
    /// File name in `kernels/`.
    pub file: &'static str,
    /// Its text.
    pub source: &'static str,
    /// Its `extern "C" __global__` entry points.
    pub entries: &'static [&'static str],
    /// Whether it decodes (a decode kernel must not spill).
    pub decode: bool,
}

/// Every kernel in `kernels/*.cu` (a test checks the list against the folder).
pub const KERNELS: &[KernelSource] = &[
    KernelSource {
        file: "chain.cu",
        source: include_str!("../kernels/chain.cu"),
        entries: &[
            "kvc_gather_words",
            "kvc_expand_tables",
            "kvc_check_chunks",
            "kvc_resolve_tables",
            "kvc_map_values",
            "kvc_map_escapes",
            "kvc_chain_verdict",
        ],
        decode: true,
    },
    KernelSource {
        file: "dequant.cu",
        source: include_str!("../kernels/dequant.cu"),
        entries: &["kvc_dequant_f16", "kvc_dequant_bf16"],
        decode: true,
    },
    KernelSource {
        file: "encode.cu",
        source: include_str!("../kernels/encode.cu"),
        entries: &[
            "kvc_quantize",
            "kvc_rans_lane_encode",
            "kvc_encode_blocks",
            "kvc_place_blocks",
            "kvc_write_blocks",
            "kvc_seal_chunks",
        ],
        decode: false,
    },
    KernelSource {
        file: "pq_search.cu",
        source: include_str!("../kernels/pq_search.cu"),
        entries: &["kvc_pq_search"],
        decode: false,
    },
    KernelSource {
        file: "rans32_experiment.cu",
        source: include_str!("../kernels/rans32_experiment.cu"),
        entries: &["kvc_rans32_lane_decode_experiment"],
        decode: true,
    },
    KernelSource {
        file: "rans_decode.cu",
        source: include_str!("../kernels/rans_decode.cu"),
        entries: &[
            "kvc_rans_lane_decode",
            "kvc_rans_lane_decode_mapped",
            "kvc_rans_lane_decode_compact",
            "kvc_rans_lane_decode_mapped_compact",
        ],
        decode: true,
    },
];

/// The headers kernels include by name, given to NVRTC as in-memory files.
const HEADERS: &[(&str, &str)] = &[
    ("kvc_kernel.cuh", include_str!("../kernels/kvc_kernel.cuh")),
    ("kvc_crc.cuh", include_str!("../kernels/kvc_crc.cuh")),
    ("kvc_lanes.cuh", include_str!("../kernels/kvc_lanes.cuh")),
    ("kvc_values.cuh", include_str!("../kernels/kvc_values.cuh")),
];

/// A loaded NVRTC.
#[derive(Debug)]
pub struct Nvrtc {
    version: (i32, i32),
}

impl Nvrtc {
    /// Loads NVRTC from `dir` (the directory holding `libnvrtc.so.13`); without `dir`, from the
    /// directory or file `KVC_NVRTC_LIB` names; without either, from the loader's search path.
    /// Errors, never panics: [`CudaError::NvrtcLib`] if the named library does not load,
    /// [`CudaError::NoNvrtc`] if none is found, [`CudaError::NvrtcSymbol`] if it is too old.
    pub fn load(dir: Option<&Path>) -> Result<Self, CudaError> {
        let env = std::env::var_os(NVRTC_LIB_ENV).map(PathBuf::from);
        if let Some(dir) = dir.map(Path::to_path_buf).or(env) {
            let dir = if dir.is_file() {
                dir.parent().map(Path::to_path_buf).unwrap_or_default()
            } else {
                dir
            };
            ffi::nvrtc_preload(&dir)?;
        }
        if !ffi::nvrtc_present() {
            return Err(CudaError::NoNvrtc);
        }
        if let Some(name) = ffi::nvrtc_missing_symbol() {
            return Err(CudaError::NvrtcSymbol { name });
        }
        Ok(Nvrtc {
            version: ffi::nvrtc_version()?,
        })
    }

    /// NVRTC's version, `(major, minor)`.
    pub fn version(&self) -> (i32, i32) {
        self.version
    }

    /// Compiles `kernel` to a CUBIN for `arch` (e.g. `sm_80`) and returns the resources of each
    /// of its entry points.
    pub fn resources(
        &self,
        kernel: &KernelSource,
        arch: &str,
    ) -> Result<Vec<KernelResources>, CudaError> {
        let out = self.compile(kernel, arch, true)?;
        let found = parse_ptxas_log(&out.log);
        let mut res = Vec::new();
        for &entry in kernel.entries {
            let Some(r) = found.iter().find(|r| r.entry == entry && r.arch == arch) else {
                let kernel = kernel.file;
                return Err(CudaError::NoResources { kernel, entry });
            };
            res.push(KernelResources {
                kernel: kernel.file,
                decode: kernel.decode,
                cubin_bytes: out.cubin_len,
                ..r.clone()
            });
        }
        Ok(res)
    }
}

impl Nvrtc {
    /// Compiles `kernel` for `arch` with the options every build of the kernels uses (and
    /// ptxas' resource report with `verbose`); a rejected source is [`CudaError::Compile`].
    fn compile(
        &self,
        kernel: &KernelSource,
        arch: &str,
        verbose: bool,
    ) -> Result<ffi::NvrtcOutput, CudaError> {
        let mut options = vec![
            format!("--gpu-architecture={arch}"),
            "--std=c++17".to_owned(),
            // The kernels round every f32 operation as codec-core does (spec/FORMAT.md §1.2),
            // without flushing subnormals to zero.
            "--fmad=false".to_owned(),
            "--ftz=false".to_owned(),
        ];
        if verbose {
            options.push("--ptxas-options=-v".to_owned());
        }
        let out = ffi::nvrtc_compile(&ffi::NvrtcProgram {
            name: kernel.file,
            source: kernel.source,
            headers: HEADERS,
            options: &options,
        })?;
        if !out.ok {
            return Err(CudaError::Compile {
                kernel: kernel.file,
                arch: arch.to_owned(),
                log: out.log,
            });
        }
        Ok(out)
    }

    /// `kernel` compiled to a CUBIN for `arch` (e.g. `sm_90`), for loading on a device.
    pub fn cubin(&self, kernel: &KernelSource, arch: &str) -> Result<Vec<u8>, CudaError> {
        let out = self.compile(kernel, arch, false)?;
        if out.cubin.is_empty() {
            return Err(CudaError::Nvrtc {
                call: "nvrtcGetCUBIN",
                code: format!("no CUBIN for {} on {arch}", kernel.file),
            });
        }
        Ok(out.cubin)
    }
}

/// What ptxas reports for one entry point compiled for one architecture.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KernelResources {
    /// The kernel source's file name.
    pub kernel: &'static str,
    /// The entry point.
    pub entry: String,
    /// The architecture, e.g. `sm_80`.
    pub arch: String,
    /// Whether the kernel decodes (then it must not spill).
    pub decode: bool,
    /// Registers per thread.
    pub registers: u32,
    /// Bytes of spill stores and spill loads per thread.
    pub spill_stores_bytes: u32,
    /// See `spill_stores_bytes`.
    pub spill_loads_bytes: u32,
    /// Bytes of stack frame per thread.
    pub stack_frame_bytes: u32,
    /// Barriers the kernel uses.
    pub barriers: u32,
    /// Bytes of static shared memory per block (dynamic shared memory is set at launch).
    pub shared_bytes: u32,
    /// Bytes of the program's CUBIN.
    pub cubin_bytes: usize,
}

impl KernelResources {
    /// Whether ptxas reports any spill.
    pub fn spills(&self) -> bool {
        self.spill_stores_bytes > 0 || self.spill_loads_bytes > 0
    }
}

impl fmt::Display for KernelResources {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {} {}: {} registers, {} B spill stores, {} B spill loads, {} B stack, {} B \
             static shared, {} barriers, {} B cubin",
            self.kernel,
            self.entry,
            self.arch,
            self.registers,
            self.spill_stores_bytes,
            self.spill_loads_bytes,
            self.stack_frame_bytes,
            self.shared_bytes,
            self.barriers,
            self.cubin_bytes
        )
    }
}

/// Loads NVRTC (as [`Nvrtc::load`] with `dir`) and compiles every kernel of [`KERNELS`] for
/// every architecture of [`ARCHS`]: the resources of each entry point, kernel by kernel.
pub fn compile_report(dir: Option<&Path>) -> Result<Vec<KernelResources>, CudaError> {
    let nvrtc = Nvrtc::load(dir)?;
    let mut all = Vec::new();
    for kernel in KERNELS {
        for arch in ARCHS {
            all.extend(nvrtc.resources(kernel, arch)?);
        }
    }
    Ok(all)
}

/// Reads ptxas' `-v` report: per "Compiling entry function 'E' for 'sm_XX'", the following
/// lines' stack frame, spill stores, spill loads, registers, barriers and static shared memory
/// (`smem`).
pub fn parse_ptxas_log(log: &str) -> Vec<KernelResources> {
    let mut out: Vec<KernelResources> = Vec::new();
    for line in log.lines() {
        if let Some((entry, arch)) = entry_line(line) {
            out.push(KernelResources {
                entry: entry.to_owned(),
                arch: arch.to_owned(),
                ..KernelResources::default()
            });
            continue;
        }
        let Some(r) = out.last_mut() else { continue };
        for part in line.split(',') {
            read_quantity(r, part);
        }
    }
    out
}

/// `(entry, arch)` from "ptxas info : Compiling entry function 'E' for 'sm_XX'".
fn entry_line(line: &str) -> Option<(&str, &str)> {
    let rest = line.split("Compiling entry function '").nth(1)?;
    let (entry, rest) = rest.split_once('\'')?;
    let arch = rest.split('\'').nth(1)?;
    Some((entry, arch))
}

/// One "N unit name" item of a report line, after any prefix ("ptxas info : Used 32
/// registers", "0 bytes spill stores", "16 bytes smem", "used 1 barriers").
fn read_quantity(r: &mut KernelResources, part: &str) {
    let mut words = part
        .split_whitespace()
        .skip_while(|w| w.parse::<u32>().is_err());
    let Some(Ok(n)) = words.next().map(str::parse::<u32>) else {
        return;
    };
    let unit: Vec<&str> = words.collect();
    match unit[..] {
        ["registers", ..] => r.registers = n,
        ["barriers", ..] => r.barriers = n,
        ["bytes", "stack", "frame", ..] => r.stack_frame_bytes = n,
        ["bytes", "spill", "stores", ..] => r.spill_stores_bytes = n,
        ["bytes", "spill", "loads", ..] => r.spill_loads_bytes = n,
        ["bytes", "smem", ..] => r.shared_bytes = n,
        _ => {}
    }
}
