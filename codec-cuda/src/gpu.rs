//! A CUDA device, opened through cudarc's run-time-loaded driver.

use std::sync::Arc;

use cudarc::driver::CudaContext;

use crate::error::CudaError;
use crate::ffi;

/// A CUDA device's primary context. Kernel launches on it are still to come; today it proves
/// that a device is there (and says why not otherwise).
#[derive(Debug)]
pub struct Gpu {
    ctx: Arc<CudaContext>,
    ordinal: usize,
}

impl Gpu {
    /// Opens device `ordinal`. Errors, never panics, where CUDA is missing:
    /// [`CudaError::NoDriver`] without a driver library, [`CudaError::NoDevice`] if the driver
    /// has no such device, [`CudaError::Driver`] if a driver call fails.
    pub fn new(ordinal: usize) -> Result<Self, CudaError> {
        let ctx = ffi::driver_context(ordinal)?;
        Ok(Gpu { ctx, ordinal })
    }

    /// Devices the driver reports ([`CudaError::NoDriver`] without a driver library).
    pub fn count() -> Result<usize, CudaError> {
        ffi::driver_device_count()
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The device's cudarc context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
}
