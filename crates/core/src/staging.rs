//! Small host-to-device copies (a batch's token ids and labels) staged through page-locked
//! memory. The CUDA driver synchronises the stream before a copy from pageable memory starts, so
//! uploading each batch from a `Vec` made the host wait for the step before to finish; the GPU
//! then sat idle while the host queued the second copy and the step's first kernels (GPU
//! timelines, benches/NOTES.md session 17: 145–166 µs between a step's two uploads). From
//! page-locked memory the copy is queued like a kernel and the host runs on.
//!
//! A ring of `SLOTS` buffers of `SLOT_BYTES`: an upload takes the next slot, waits for that slot's
//! previous copy to have finished (it was queued `SLOTS` uploads ago), fills it and queues the
//! copy, then records an event. Larger copies (parameter init, checkpoints) stay pageable.

use cudarc::driver::{CudaContext, CudaEvent, CudaStream, DeviceRepr, result, sys};
use std::sync::Arc;

/// The largest copy staged, in bytes (a 1.3B batch's ids: 64 KB).
pub(crate) const SLOT_BYTES: usize = 1 << 20;
const SLOTS: usize = 8;

struct Slot {
    ptr: *mut u8,
    done: CudaEvent,
}

// SAFETY: the page-locked buffer is owned by the slot and only touched under the ring's mutex.
unsafe impl Send for Slot {}

pub(crate) struct Staging {
    slots: Vec<Slot>,
    next: usize,
}

impl Staging {
    pub(crate) fn new() -> Self {
        Staging { slots: Vec::new(), next: 0 }
    }

    /// Queues the copy of `src` (at most `SLOT_BYTES`) to device address `dst` through the next slot.
    ///
    /// # Safety
    /// `dst` must address at least `size_of_val(src)` bytes of device memory that stay allocated
    /// until the copy, queued on `stream`, has run.
    pub(crate) unsafe fn upload<T: DeviceRepr>(
        &mut self,
        ctx: &Arc<CudaContext>,
        stream: &CudaStream,
        src: &[T],
        dst: sys::CUdeviceptr,
    ) -> Result<(), cudarc::driver::DriverError> {
        let bytes = std::mem::size_of_val(src);
        debug_assert!(bytes <= SLOT_BYTES);
        if self.slots.len() < SLOTS {
            ctx.bind_to_thread()?;
            // SAFETY: a fresh page-locked allocation, freed in Drop.
            let ptr = unsafe { result::malloc_host(SLOT_BYTES, sys::CU_MEMHOSTALLOC_WRITECOMBINED) }? as *mut u8;
            self.slots.push(Slot { ptr, done: ctx.new_event(None)? });
        }
        let slot = &self.slots[self.next];
        self.next = (self.next + 1) % SLOTS;
        // The copy this slot held last (never recorded: returns at once).
        slot.done.synchronize()?;
        // SAFETY: the slot holds SLOT_BYTES ≥ bytes and no copy reads it any more; src is plain
        // data of `bytes` bytes; the queued copy reads the slot, which is not written again before
        // its event (recorded right after) has completed; `dst` is the caller's promise.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr() as *const u8, slot.ptr, bytes);
            result::memcpy_htod_async(
                dst,
                std::slice::from_raw_parts(slot.ptr as *const T, src.len()),
                stream.cu_stream(),
            )?;
        }
        slot.done.record(stream)
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        for s in &self.slots {
            let _ = s.done.synchronize();
            // SAFETY: allocated by malloc_host in `upload`; no copy reads it after the wait.
            let _ = unsafe { result::free_host(s.ptr as *mut std::ffi::c_void) };
        }
    }
}
