//! The CUDA driver, loaded at run time through cudarc: presence, devices, contexts, errors.

use cudarc::driver::{CudaEvent, CudaStream, DriverError};

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

/// An event recorded on `s` now: `timed`, for `cuEventElapsedTime`, or (cheaper) only to order
/// streams and wait on.
pub(crate) fn record_event(s: &CudaStream, timed: bool) -> Result<CudaEvent, CudaError> {
    use cudarc::driver::sys::CUevent_flags;
    let flags = match timed {
        true => CUevent_flags::CU_EVENT_DEFAULT,
        false => CUevent_flags::CU_EVENT_DISABLE_TIMING,
    };
    (s.record_event(Some(flags))).map_err(driver_err("cuEventRecord"))
}

/// Makes what is queued on `s` from now on wait for what was queued before `e`.
pub(crate) fn wait_event(s: &CudaStream, e: &CudaEvent) -> Result<(), CudaError> {
    s.wait(e).map_err(driver_err("cuStreamWaitEvent"))
}

/// Sets how many bytes of freed memory the current memory pool of `ctx`'s device keeps mapped
/// at a synchronization (`CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`; the driver's default, 0, returns
/// every freed byte to the system then, so that the next stream-ordered allocation maps it
/// again). The pool is the device's: every user of the device in the process shares it.
pub(crate) fn set_pool_release_threshold(
    ctx: &std::sync::Arc<cudarc::driver::CudaContext>,
    bytes: u64,
) -> Result<(), CudaError> {
    use cudarc::driver::sys;
    ctx.bind_to_thread()
        .map_err(driver_err("cuCtxSetCurrent"))?;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: the driver is loaded (a context exists, invariant 4); `pool` is a valid place
    // for the pool handle the call writes.
    unsafe { sys::cuDeviceGetMemPool(&mut pool, ctx.cu_device()) }
        .result()
        .map_err(driver_err("cuDeviceGetMemPool"))?;
    let mut value = bytes;
    // SAFETY: `pool` is the handle the driver gave; the release threshold is a `u64`, which
    // `value` is, alive for the call.
    unsafe {
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut value as *mut u64).cast(),
        )
    }
    .result()
    .map_err(driver_err("cuMemPoolSetAttribute"))
}
