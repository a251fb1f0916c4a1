//! The CUDA driver, loaded at run time through cudarc: presence, devices, contexts, errors.

use cudarc::driver::DriverError;

use crate::error::CudaError;

/// Whether cudarc can load the CUDA driver library (invariant 4).
pub(crate) fn driver_present() -> bool {
    // SAFETY: only tries to load the library (running its initialisers).
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Initialises the driver and counts its devices; [`CudaError::NoDriver`] without a driver
/// library (invariant 4: cudarc panics then).
pub(crate) fn driver_device_count() -> Result<usize, CudaError> {
    if !driver_present() {
        return Err(CudaError::NoDriver);
    }
    let err = |call| {
        move |e: cudarc::driver::DriverError| CudaError::Driver {
            call,
            code: format!("{:?}", e.0),
        }
    };
    cudarc::driver::result::init().map_err(err("cuInit"))?;
    let n = cudarc::driver::result::device::get_count().map_err(err("cuDeviceGetCount"))?;
    Ok(usize::try_from(n).unwrap_or(0))
}

/// The primary context of device `ordinal`, once [`driver_device_count`] showed it exists.
pub(crate) fn driver_context(
    ordinal: usize,
) -> Result<std::sync::Arc<cudarc::driver::CudaContext>, CudaError> {
    let count = driver_device_count()?;
    if ordinal >= count {
        return Err(CudaError::NoDevice { ordinal, count });
    }
    cudarc::driver::CudaContext::new(ordinal).map_err(|e| CudaError::Driver {
        call: "cuDevicePrimaryCtxRetain",
        code: format!("{:?}", e.0),
    })
}

/// A driver call's error as a [`CudaError`].
pub(crate) fn driver_err(call: &'static str) -> impl Fn(DriverError) -> CudaError {
    move |e| CudaError::Driver {
        call,
        code: format!("{:?}", e.0),
    }
}
