//! NVRTC compiles every kernel for sm_80 and sm_90 (a CUBIN each, through ptxas), and no decode
//! kernel spills. Runs where `KVC_NVRTC_LIB` names NVRTC's directory or `tools/fetch-nvrtc` has
//! put it in `target/nvrtc/13.5.37/lib`; otherwise it says why it skips, unless
//! `KVC_REQUIRE_NVRTC=1` (CI), which makes a missing NVRTC a failure.

use std::path::{Path, PathBuf};

use codec_cuda::nvrtc::{parse_ptxas_log, Nvrtc, ARCHS, KERNELS, NVRTC_LIB_ENV};
use codec_cuda::{compile_report, CudaError};

/// NVRTC's directory, or why there is none.
fn find_nvrtc() -> Result<PathBuf, String> {
    if let Some(dir) = std::env::var_os(NVRTC_LIB_ENV) {
        return Ok(PathBuf::from(dir));
    }
    let fetched = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/nvrtc/13.5.37/lib");
    if fetched.join("libnvrtc.so.13").is_file() {
        return Ok(fetched);
    }
    Err(format!(
        "{NVRTC_LIB_ENV} is not set and {} has no libnvrtc.so.13 (run tools/fetch-nvrtc)",
        fetched.display()
    ))
}

/// NVRTC's directory, or `None` after printing why the test skips (a panic under
/// `KVC_REQUIRE_NVRTC=1`).
fn nvrtc_dir() -> Option<PathBuf> {
    match find_nvrtc() {
        Ok(dir) => Some(dir),
        Err(why) if std::env::var("KVC_REQUIRE_NVRTC").as_deref() == Ok("1") => {
            panic!("KVC_REQUIRE_NVRTC=1 but NVRTC is missing: {why}")
        }
        Err(why) => {
            println!("skipped: {why}");
            None
        }
    }
}

#[test]
fn every_kernel_compiles_for_sm80_and_sm90_and_no_decode_kernel_spills() {
    let Some(dir) = nvrtc_dir() else {
        return;
    };
    let version = Nvrtc::load(Some(&dir)).unwrap().version();
    println!("NVRTC {}.{} from {}", version.0, version.1, dir.display());
    let report = compile_report(Some(&dir)).unwrap();
    for r in &report {
        println!("{r}");
    }
    for k in KERNELS {
        for entry in k.entries {
            for arch in ARCHS {
                let found = report.iter().any(|r| r.entry == *entry && r.arch == arch);
                assert!(found, "{} {entry} {arch} missing from the report", k.file);
            }
        }
    }
    let spills: Vec<_> = report.iter().filter(|r| r.decode && r.spills()).collect();
    assert!(spills.is_empty(), "decode kernels spill: {spills:#?}");
    // The PQ search launches up to 1024 threads per block for long contexts: a block of them
    // must fit an SM's 65 536 registers, or the launch fails.
    for r in report.iter().filter(|r| r.entry == "kvc_pq_search") {
        assert!(
            r.registers <= 64,
            "kvc_pq_search {}: {} registers",
            r.arch,
            r.registers
        );
    }
    assert!(report.iter().all(|r| r.registers > 0 && r.cubin_bytes > 0));
}

/// What a device loads: every kernel file as a CUBIN (an ELF image) for sm_80 and sm_90.
#[test]
fn every_kernel_compiles_to_a_loadable_cubin() {
    let Some(dir) = nvrtc_dir() else {
        return;
    };
    let nvrtc = Nvrtc::load(Some(&dir)).unwrap();
    for k in KERNELS {
        for arch in ARCHS {
            let cubin = nvrtc.cubin(k, arch).unwrap();
            assert_eq!(&cubin[..4], b"\x7fELF", "{} {arch}", k.file);
            println!("{} {arch}: {} B cubin", k.file, cubin.len());
        }
    }
}

/// `KERNELS` lists every `kernels/*.cu`, with the text of the file.
#[test]
fn kernel_list_is_the_kernels_folder() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.ends_with(".cu"))
        .collect();
    files.sort();
    let mut listed: Vec<String> = KERNELS.iter().map(|k| k.file.to_owned()).collect();
    listed.sort();
    assert_eq!(files, listed);
    for k in KERNELS {
        assert_eq!(std::fs::read_to_string(dir.join(k.file)).unwrap(), k.source);
    }
}

#[test]
fn ptxas_reports_parse() {
    // NVRTC 13.5's log for kvc_rans_lane_decode (sm_80), then a made-up entry with spills,
    // static shared memory and a stack frame.
    let log = "\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'kvc_rans_lane_decode' for 'sm_80'
ptxas info    : Function properties for kvc_rans_lane_decode
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 32 registers, used 1 barriers, 456 bytes cmem[0]
ptxas info    : Compile time = 20.984 ms
ptxas info    : Compiling entry function 'spiller' for 'sm_90'
ptxas info    : Function properties for spiller
ptxas         .     24 bytes stack frame, 16 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 255 registers, used 2 barriers, 4096 bytes smem, 400 bytes cmem[0]
";
    let r = parse_ptxas_log(log);
    assert_eq!(r.len(), 2);
    assert_eq!(
        (r[0].entry.as_str(), r[0].arch.as_str()),
        ("kvc_rans_lane_decode", "sm_80")
    );
    assert_eq!(
        (r[0].registers, r[0].barriers, r[0].spills()),
        (32, 1, false)
    );
    assert_eq!(
        (r[1].entry.as_str(), r[1].arch.as_str()),
        ("spiller", "sm_90")
    );
    assert_eq!(
        (
            r[1].registers,
            r[1].stack_frame_bytes,
            r[1].spill_stores_bytes
        ),
        (255, 24, 16)
    );
    assert_eq!(
        (r[1].spill_loads_bytes, r[1].shared_bytes, r[1].barriers),
        (12, 4096, 2)
    );
    assert!(r[1].spills());
    assert!(parse_ptxas_log("").is_empty());
    assert!(parse_ptxas_log("Used 3 registers\n'").is_empty());
}

#[test]
fn a_named_nvrtc_that_does_not_load_is_an_error() {
    let missing = Path::new("/nonexistent/kvc-nvrtc");
    match Nvrtc::load(Some(missing)) {
        Err(CudaError::NvrtcLib { path, .. }) => assert!(path.starts_with("/nonexistent")),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        compile_report(Some(missing)),
        Err(CudaError::NvrtcLib { .. })
    ));
}
