//! Page-locked host memory for copies that cross every step (an offloaded optimizer's
//! gradients and parameters): `Tensor::pin_host` registers a CPU tensor's storage with the driver
//! (`cuMemHostRegister`), so copies with the GPU move at the link's rate instead of through
//! pageable staging.

#[cfg(feature = "cuda")]
use crate::Error;
use crate::{Device, Result, Tensor};

/// A CPU tensor's storage page-locked for a GPU's copies (`Tensor::pin_host`): copies to and from
/// it run at the link's rate instead of through the driver's pageable staging. Unlocked when
/// dropped; it holds the tensor, so the memory outlives the lock (host storage never moves).
pub struct HostPin {
    #[cfg(feature = "cuda")]
    locked: Option<(u64, std::sync::Arc<cudarc::driver::CudaContext>)>,
    _keep: Tensor,
}

impl Tensor {
    /// Page-locks this CPU tensor's whole storage for copies with `device` (where it is a GPU:
    /// elsewhere, or without the `cuda` feature, the guard locks nothing). For buffers that cross
    /// every step, as an offloaded optimizer's gradients and parameters do.
    pub fn pin_host(&self, device: &Device) -> Result<HostPin> {
        #[cfg(feature = "cuda")]
        if let (Device::Cuda(d), Device::Cpu) = (device, self.device()) {
            let g = self.storage();
            let Some(s) = g.as_cpu() else { unreachable!("CPU storage on the CPU") };
            let bytes = s.bytes(0..s.len());
            if bytes.is_empty() {
                return Ok(HostPin { locked: None, _keep: self.clone() });
            }
            let ctx = d.context().clone();
            ctx.bind_to_thread().map_err(|e| Error::InvalidArgument { op: "pin_host", msg: format!("{e:?}") })?;
            let ptr = bytes.as_ptr() as *mut std::ffi::c_void;
            // SAFETY: the range is this storage's live allocation, kept alive (and never resized:
            // host storage has a fixed length) by the guard's clone until it unlocks it.
            unsafe { cudarc::driver::sys::cuMemHostRegister_v2(ptr, bytes.len(), 0) }
                .result()
                .map_err(|e| Error::InvalidArgument { op: "pin_host", msg: format!("cuMemHostRegister: {e:?}") })?;
            return Ok(HostPin { locked: Some((ptr as u64, ctx)), _keep: self.clone() });
        }
        let _ = device;
        Ok(HostPin {
            #[cfg(feature = "cuda")]
            locked: None,
            _keep: self.clone(),
        })
    }
}

impl Drop for HostPin {
    fn drop(&mut self) {
        #[cfg(feature = "cuda")]
        if let Some((ptr, ctx)) = self.locked.take() {
            // Errors here cannot be returned; the memory stays valid either way.
            if ctx.bind_to_thread().is_ok() {
                // SAFETY: `ptr` was registered by `pin_host` and not yet unregistered.
                let _ = unsafe { cudarc::driver::sys::cuMemHostUnregister(ptr as *mut std::ffi::c_void) };
            }
        }
    }
}
