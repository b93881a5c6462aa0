//! The GPU's own timeline of a stretch of work: every kernel, copy and memset the process's CUDA
//! contexts ran between `start` and `stop`, with the start and end times the GPU stamped on it
//! (CUPTI's activity API, the source Nsight Systems and PyTorch's profiler read).
//!
//! Why here and not a profiler: Nsight Compute times each kernel alone, at the clock an idle card
//! holds, so it cannot say how long a running training step leaves the GPU idle between kernels
//! (launch gaps, host waits) nor how long the kernels take at the power-capped clock of a loaded
//! card; Nsight Systems is not on every GPU machine (it is not on the H200 machines this project
//! measures on). `ferrotron train --profile-trace` records with this and `cargo xtask trace` reads
//! the result beside a PyTorch profiler trace of the same model.
//!
//! Architecture invariant: recording is process-wide (CUPTI has one activity buffer per process),
//! so `start` while a recording runs is an error rather than a second, silently merged recording.

use crate::Result;

/// What a traced activity was.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActivityKind {
    Kernel,
    Memcpy,
    Memset,
}

/// One kernel, copy or memset as the GPU ran it. Times are CUPTI's nanosecond timestamps (one
/// clock for every device of the process).
#[derive(Clone, Debug, PartialEq)]
pub struct GpuActivity {
    pub kind: ActivityKind,
    /// The kernel's name as compiled (C++ kernels mangled); "memcpy" or "memset" otherwise.
    pub name: String,
    pub start_ns: u64,
    pub end_ns: u64,
    pub device: u32,
    pub stream: u32,
    /// Bytes moved or set (0 for kernels).
    pub bytes: u64,
}

/// A recording: the activities in start order, and how many CUPTI dropped for want of buffer.
#[derive(Clone, Debug, Default)]
pub struct GpuTrace {
    pub activities: Vec<GpuActivity>,
    pub dropped: usize,
}

/// Starts recording the GPU activity of every CUDA context of this process.
pub fn start() -> Result<()> {
    #[cfg(feature = "cuda")]
    {
        cupti::start()
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(crate::Error::CudaNotBuilt { device: "a GPU trace".into() })
    }
}

/// Whether a recording can start here: the CUPTI library loads (checked before training starts,
/// so a missing library is reported before the steps it would have traced).
pub fn available() -> Result<()> {
    #[cfg(feature = "cuda")]
    {
        cupti::available()
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(crate::Error::CudaNotBuilt { device: "a GPU trace".into() })
    }
}

/// Stops recording and returns what ran since `start`. Work still queued is not waited for:
/// synchronise the devices first.
pub fn stop() -> Result<GpuTrace> {
    #[cfg(feature = "cuda")]
    {
        cupti::stop()
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(crate::Error::CudaNotBuilt { device: "a GPU trace".into() })
    }
}

#[cfg(feature = "cuda")]
mod cupti {
    use super::{ActivityKind, GpuActivity, GpuTrace};
    use crate::{Error, Result};
    use cudarc::cupti::{result::activity, sys};
    use std::alloc::{Layout, alloc, dealloc};
    use std::sync::Mutex;

    fn trace_err(what: &str, e: impl std::fmt::Debug) -> Error {
        Error::Cuda(format!("GPU trace (CUPTI): {what}: {e:?}"))
    }

    /// What the completed-buffer callback has parsed so far; `None` while not recording.
    static RECORDS: Mutex<Option<Vec<GpuActivity>>> = Mutex::new(None);
    /// Bytes per activity buffer CUPTI asks for (≈ 40k kernel records each).
    const BUFFER: usize = 8 << 20;
    const KINDS: [sys::CUpti_ActivityKind; 3] = [
        sys::CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL,
        sys::CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_MEMCPY,
        sys::CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_MEMSET,
    ];

    fn layout() -> Layout {
        // BUFFER and 8 are a valid size and alignment: this cannot fail.
        Layout::from_size_align(BUFFER, 8).unwrap_or_else(|_| Layout::new::<u64>())
    }

    unsafe extern "C" fn requested(buffer: *mut *mut u8, size: *mut usize, max_records: *mut usize) {
        // SAFETY: CUPTI passes valid out-pointers; a null buffer (allocation failed) with size 0
        // makes it drop records and count them, which `stop` reports.
        unsafe {
            let p = alloc(layout());
            *buffer = p;
            *size = if p.is_null() { 0 } else { BUFFER };
            *max_records = 0; // as many as fit
        }
    }

    unsafe extern "C" fn completed(
        _ctx: cudarc::driver::sys::CUcontext,
        _stream: u32,
        buffer: *mut u8,
        _size: usize,
        valid: usize,
    ) {
        if buffer.is_null() {
            return;
        }
        // SAFETY: `buffer` is one `requested` allocated, holding `valid` bytes of records.
        let parsed = unsafe { parse(buffer, valid) };
        let mut records = RECORDS.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(r) = records.as_mut() {
            r.extend(parsed);
        }
        // SAFETY: allocated by `requested` with the same layout; CUPTI is done with it.
        unsafe { dealloc(buffer, layout()) };
    }

    /// The records of one buffer. Only the fields every record version since CUDA 11 keeps at the
    /// same place are read (kind, times, device, stream, bytes, the kernel's name), so a newer
    /// CUPTI than the headers cudarc was built against reads the same.
    unsafe fn parse(buffer: *mut u8, valid: usize) -> Vec<GpuActivity> {
        let mut out = Vec::new();
        let mut rec: *mut sys::CUpti_Activity = std::ptr::null_mut();
        // SAFETY: CUPTI walks its own buffer; each record is read as the struct its kind names.
        while unsafe { activity::get_next_record(buffer, valid, &mut rec) }.is_ok() {
            let kind = unsafe { (*rec).kind };
            let a = match kind {
                sys::CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL
                | sys::CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_KERNEL => {
                    let k = unsafe { &*(rec as *const sys::CUpti_ActivityKernel10) };
                    let name = if k.name.is_null() {
                        "?".to_string()
                    } else {
                        unsafe { std::ffi::CStr::from_ptr(k.name) }.to_string_lossy().into_owned()
                    };
                    GpuActivity {
                        kind: ActivityKind::Kernel,
                        name,
                        start_ns: k.start,
                        end_ns: k.end,
                        device: k.deviceId,
                        stream: k.streamId,
                        bytes: 0,
                    }
                }
                sys::CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_MEMCPY => {
                    let m = unsafe { &*(rec as *const sys::CUpti_ActivityMemcpy6) };
                    GpuActivity {
                        kind: ActivityKind::Memcpy,
                        name: "memcpy".into(),
                        start_ns: m.start,
                        end_ns: m.end,
                        device: m.deviceId,
                        stream: m.streamId,
                        bytes: m.bytes,
                    }
                }
                sys::CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_MEMSET => {
                    let m = unsafe { &*(rec as *const sys::CUpti_ActivityMemset4) };
                    GpuActivity {
                        kind: ActivityKind::Memset,
                        name: "memset".into(),
                        start_ns: m.start,
                        end_ns: m.end,
                        device: m.deviceId,
                        stream: m.streamId,
                        bytes: m.bytes,
                    }
                }
                _ => continue,
            };
            out.push(a);
        }
        out
    }

    pub(super) fn available() -> Result<()> {
        // cudarc panics when the library cannot be loaded: check first.
        // SAFETY: only probes for the shared library.
        if !unsafe { sys::is_culib_present() } {
            return Err(Error::Cuda(
                "GPU trace: the CUPTI library (libcupti.so) was not found: add the folder holding it (the CUDA \
                 toolkit's extras/CUPTI/lib64, or a CUDA wheel's nvidia/*/lib) to LD_LIBRARY_PATH"
                    .into(),
            ));
        }
        Ok(())
    }

    pub(super) fn start() -> Result<()> {
        available()?;
        {
            let mut records = RECORDS.lock().unwrap_or_else(|e| e.into_inner());
            if records.is_some() {
                return Err(trace_err("start", "a recording is already running in this process; stop it first"));
            }
            *records = Some(Vec::new());
        }
        // Not under the lock: CUPTI may hand over a buffer (`completed` takes it) at any time.
        let on = || -> Result<()> {
            activity::register_callbacks(Some(requested), Some(completed)).map_err(|e| trace_err("register", e))?;
            for k in KINDS {
                activity::enable(k).map_err(|e| trace_err("enable", e))?;
            }
            Ok(())
        };
        on().inspect_err(|_| {
            for k in KINDS {
                let _ = activity::disable(k);
            }
            *RECORDS.lock().unwrap_or_else(|e| e.into_inner()) = None;
        })
    }

    pub(super) fn stop() -> Result<GpuTrace> {
        // The flush hands every buffer, full or not, to `completed` before it returns. The lock
        // is not held here: `completed` takes it.
        let flushed = activity::flush_all(sys::CUpti_ActivityFlag::CUPTI_ACTIVITY_FLAG_FLUSH_FORCED as u32);
        for k in KINDS {
            let _ = activity::disable(k);
        }
        let mut dropped = 0usize;
        // SAFETY: a null context and stream 0 ask for the records dropped outside any context's
        // buffer; a plain out-pointer.
        let _ = unsafe { activity::get_num_dropped_records(std::ptr::null_mut(), 0, &mut dropped) };
        let taken = RECORDS.lock().unwrap_or_else(|e| e.into_inner()).take();
        flushed.map_err(|e| trace_err("flush", e))?;
        let mut activities = taken.ok_or_else(|| trace_err("stop", "no recording is running; start one first"))?;
        activities.sort_by_key(|a| (a.start_ns, a.end_ns));
        Ok(GpuTrace { activities, dropped })
    }
}
