//! NVRTC, loaded at run time through cudarc: compiling the kernels and reading the log.

use std::ffi::{c_char, c_int, CStr, CString};
use std::path::Path;
use std::sync::Mutex;

use cudarc::nvrtc::sys as nvrtc;

use crate::error::CudaError;

/// The NVRTC functions this crate calls (through cudarc), checked before the first call.
pub(crate) const NVRTC_SYMBOLS: [&str; 10] = [
    "nvrtcVersion",
    "nvrtcCreateProgram",
    "nvrtcCompileProgram",
    "nvrtcDestroyProgram",
    "nvrtcGetProgramLogSize",
    "nvrtcGetProgramLog",
    "nvrtcGetCUBINSize",
    "nvrtcGetCUBIN",
    "nvrtcGetErrorString",
    "nvrtcGetPTXSize",
];

/// Libraries loaded by full path, kept loaded for the life of the process so that cudarc's
/// load by name (`libnvrtc.so.13`) finds them: the dynamic loader matches an already loaded
/// library by its soname.
static PRELOADED: Mutex<Vec<libloading::Library>> = Mutex::new(Vec::new());

/// Loads `dir/libnvrtc.so.13` and, if present, `dir/libnvrtc-builtins.so.*` (NVRTC loads it by
/// name at compile time), and keeps them loaded.
pub(crate) fn nvrtc_preload(dir: &Path) -> Result<(), CudaError> {
    let mut paths = vec![dir.join("libnvrtc.so.13")];
    if let Ok(entries) = std::fs::read_dir(dir) {
        let mut builtins: Vec<_> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("libnvrtc-builtins.so"))
            })
            .collect();
        builtins.sort();
        // The builtins first: libnvrtc then finds them already loaded.
        paths.splice(0..0, builtins);
    }
    let mut held = PRELOADED.lock().unwrap_or_else(|e| e.into_inner());
    for path in paths {
        // SAFETY: loading a library runs its initialisers; NVRTC's have no preconditions. The
        // handle is kept in PRELOADED, so the library is never unloaded while cudarc uses it.
        let lib = unsafe { libloading::Library::new(&path) }.map_err(|e| CudaError::NvrtcLib {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
        held.push(lib);
    }
    Ok(())
}

/// Whether cudarc can load NVRTC by name (invariant 4).
pub(crate) fn nvrtc_present() -> bool {
    // SAFETY: only tries to load the library (running its initialisers), as nvrtc_preload does.
    unsafe { nvrtc::is_culib_present() }
}

/// The first of [`NVRTC_SYMBOLS`] the loaded NVRTC lacks. Call only after [`nvrtc_present`].
pub(crate) fn nvrtc_missing_symbol() -> Option<&'static str> {
    // SAFETY: nvrtc_present() returned true, so culib() loads without panicking (invariant 4);
    // the symbols are only looked up, not called.
    let lib = unsafe { nvrtc::culib() };
    NVRTC_SYMBOLS.into_iter().find(|name| {
        // SAFETY: as above; `*const ()` is never dereferenced.
        unsafe { lib.get::<*const ()>(name.as_bytes()) }.is_err()
    })
}

/// NVRTC's version `(major, minor)`. Call only once [`nvrtc_missing_symbol`] gave `None`.
pub(crate) fn nvrtc_version() -> Result<(i32, i32), CudaError> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: invariant 4; both pointers are to live locals.
    let r = unsafe { nvrtc::nvrtcVersion(&mut major, &mut minor) };
    nvrtc_ok("nvrtcVersion", r)?;
    Ok((major, minor))
}

/// What compiling one program gave.
#[derive(Debug)]
pub(crate) struct NvrtcOutput {
    /// Whether compilation succeeded.
    pub ok: bool,
    /// The program log (ptxas' resource report with `--ptxas-options=-v`).
    pub log: String,
    /// Bytes of the CUBIN (0 when compiled to PTX only or on failure).
    pub cubin_len: usize,
    /// The CUBIN (empty when compiled to PTX only or on failure).
    pub cubin: Vec<u8>,
}

/// One source to compile: its name, text, the headers it includes by name, and the options.
#[derive(Debug)]
pub(crate) struct NvrtcProgram<'a> {
    pub name: &'a str,
    pub source: &'a str,
    pub headers: &'a [(&'a str, &'a str)],
    pub options: &'a [String],
}

/// Compiles `program`. Call only once [`nvrtc_missing_symbol`] gave `None`.
pub(crate) fn nvrtc_compile(program: &NvrtcProgram<'_>) -> Result<NvrtcOutput, CudaError> {
    let input = |what: &'static str| move |_| CudaError::Input { what };
    let name = CString::new(program.name).map_err(input("NUL in a kernel name"))?;
    let source = CString::new(program.source).map_err(input("NUL in a kernel source"))?;
    let cstrings = |v: Vec<&str>, what| -> Result<Vec<CString>, CudaError> {
        v.into_iter()
            .map(|s| CString::new(s).map_err(input(what)))
            .collect()
    };
    let h_names = cstrings(
        program.headers.iter().map(|h| h.0).collect(),
        "NUL in a header",
    )?;
    let h_srcs = cstrings(
        program.headers.iter().map(|h| h.1).collect(),
        "NUL in a header",
    )?;
    let opts = cstrings(
        program.options.iter().map(|s| s.as_str()).collect(),
        "NUL in an option",
    )?;
    let ptrs = |v: &[CString]| v.iter().map(|s| s.as_ptr()).collect::<Vec<*const c_char>>();
    let (h_names, h_srcs, opts) = (ptrs(&h_names), ptrs(&h_srcs), ptrs(&opts));

    let mut prog: nvrtc::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: invariant 4; every pointer is to a NUL-terminated string that lives until this
    // function returns (invariant 5), the header arrays have `h_names.len()` entries each.
    let r = unsafe {
        nvrtc::nvrtcCreateProgram(
            &mut prog,
            source.as_ptr(),
            name.as_ptr(),
            h_names.len() as c_int,
            h_srcs.as_ptr(),
            h_names.as_ptr(),
        )
    };
    nvrtc_ok("nvrtcCreateProgram", r)?;
    let out = compile_created(prog, &opts);
    // SAFETY: `prog` was created above and is destroyed once (invariant 5).
    let r = unsafe { nvrtc::nvrtcDestroyProgram(&mut prog) };
    let out = out?;
    nvrtc_ok("nvrtcDestroyProgram", r)?;
    Ok(out)
}

/// Compiles a created program and reads its log and CUBIN size.
fn compile_created(
    prog: nvrtc::nvrtcProgram,
    opts: &[*const c_char],
) -> Result<NvrtcOutput, CudaError> {
    // SAFETY: `prog` is live (invariant 5); `opts` holds `opts.len()` live C strings.
    let r = unsafe { nvrtc::nvrtcCompileProgram(prog, opts.len() as c_int, opts.as_ptr()) };
    let ok = r == nvrtc::nvrtcResult::NVRTC_SUCCESS;
    if !ok && r != nvrtc::nvrtcResult::NVRTC_ERROR_COMPILATION {
        nvrtc_ok("nvrtcCompileProgram", r)?;
    }
    let mut len = 0usize;
    // SAFETY: `prog` is live; `len` is a live local.
    nvrtc_ok("nvrtcGetProgramLogSize", unsafe {
        nvrtc::nvrtcGetProgramLogSize(prog, &mut len)
    })?;
    let mut buf = vec![0u8; len.max(1)];
    // SAFETY: `buf` has room for the `len` bytes (NUL included) NVRTC reported.
    nvrtc_ok("nvrtcGetProgramLog", unsafe {
        nvrtc::nvrtcGetProgramLog(prog, buf.as_mut_ptr().cast())
    })?;
    let log = CStr::from_bytes_until_nul(&buf)
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut cubin_len = 0usize;
    if ok {
        // SAFETY: `prog` is live and compiled; `cubin_len` is a live local. A PTX-only
        // compilation reports an error here, which means "no CUBIN".
        let r = unsafe { nvrtc::nvrtcGetCUBINSize(prog, &mut cubin_len) };
        if r != nvrtc::nvrtcResult::NVRTC_SUCCESS {
            cubin_len = 0;
        }
    }
    let mut cubin = vec![0u8; cubin_len];
    if cubin_len > 0 {
        // SAFETY: `prog` is live and compiled; `cubin` has the `cubin_len` bytes NVRTC reported.
        nvrtc_ok("nvrtcGetCUBIN", unsafe {
            nvrtc::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast())
        })?;
    }
    Ok(NvrtcOutput {
        ok,
        log,
        cubin_len,
        cubin,
    })
}

/// `Ok` for NVRTC_SUCCESS, else the call's error with NVRTC's name for the code.
fn nvrtc_ok(call: &'static str, r: nvrtc::nvrtcResult) -> Result<(), CudaError> {
    if r == nvrtc::nvrtcResult::NVRTC_SUCCESS {
        return Ok(());
    }
    Err(CudaError::Nvrtc {
        call,
        code: format!("{r:?}"),
    })
}
