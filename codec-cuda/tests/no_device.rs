//! The run-time entry points return typed errors, never panic, where there is no CUDA driver,
//! no device or no NVRTC (cudarc panics there unless its library checks come first,
//! `DESIGN.md` §8). On a machine with a GPU they open it instead. Its own test binary: nothing
//! here may find an NVRTC that another test loaded.

use codec_cuda::nvrtc::{Nvrtc, NVRTC_LIB_ENV};
use codec_cuda::{CudaError, Gpu};

#[test]
fn gpu_is_a_device_or_a_typed_error() {
    match Gpu::count() {
        Err(CudaError::NoDriver) => {
            println!("no CUDA driver library: Gpu::new gives NoDriver");
            assert_eq!(Gpu::new(0).unwrap_err(), CudaError::NoDriver);
        }
        Err(e) => {
            println!("driver present, no usable device: {e}");
            assert!(Gpu::new(0).is_err());
        }
        Ok(count) => {
            println!("{count} CUDA devices");
            let beyond = Gpu::new(count).unwrap_err();
            assert_eq!(
                beyond,
                CudaError::NoDevice {
                    ordinal: count,
                    count
                }
            );
            if count > 0 {
                assert_eq!(Gpu::new(0).unwrap().ordinal(), 0);
            }
        }
    }
}

#[test]
fn nvrtc_without_a_library_is_a_typed_error() {
    if std::env::var_os(NVRTC_LIB_ENV).is_some() {
        println!("{NVRTC_LIB_ENV} is set: NVRTC is expected to load");
        assert!(Nvrtc::load(None).is_ok());
        return;
    }
    match Nvrtc::load(None) {
        Ok(n) => println!("a system NVRTC {:?} loads by name", n.version()),
        Err(e) => {
            println!("no NVRTC on the search path: {e}");
            assert_eq!(e, CudaError::NoNvrtc);
        }
    }
}
