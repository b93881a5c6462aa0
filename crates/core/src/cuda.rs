//! CUDA storage and device handles (feature `cuda`). cudarc loads the driver at run time, so this
//! compiles on machines without CUDA; opening a device there returns an error naming the library.

use crate::{CpuStorage, DType, Error, Result, WithDType};
use cudarc::driver::{CudaContext, CudaGraph, CudaSlice, CudaStream, DevicePtr};
use float8::{F8E4M3, F8E5M2};
use half::{bf16, f16};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// One GPU: its context and its compute stream. One per ordinal and process: every
/// `CudaDevice::new(n)` hands out the same stream.
///
/// Architecture invariant: all work on a GPU (copies, kernels, GEMMs) goes to its one compute
/// stream; only collectives run elsewhere, each communicator on a stream of its own, fenced
/// against this one by events (ferrotron-comm's NCCL backend). Event tracking is off, so two
/// handles' streams for one GPU would race: the kernel backend is cached per ordinal and launches
/// on the stream of the device it was first built for, while a tensor's copies run on its own
/// device's stream. (Two tests that each opened `cuda(0)` once
/// raced exactly so: a kernel ran before the upload of its input had landed.)
#[derive(Clone)]
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    compute: Arc<CudaStream>,
    /// Page-locked buffers small uploads go through (`staging`).
    staging: Arc<std::sync::Mutex<crate::staging::Staging>>,
    /// Set while the compute stream is being captured into a CUDA graph (`capture`).
    capturing: Arc<AtomicBool>,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaDevice({})", self.ctx.ordinal())
    }
}

fn driver_err(e: impl std::fmt::Debug) -> Error {
    Error::Cuda(format!("{e:?}"))
}

impl CudaDevice {
    pub fn new(ordinal: usize) -> Result<Self> {
        static OPEN: std::sync::Mutex<Vec<CudaDevice>> = std::sync::Mutex::new(Vec::new());
        let mut open = OPEN.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(d) = open.iter().find(|d| d.ordinal() == ordinal) {
            return Ok(d.clone());
        }
        let d = Self::open(ordinal)?;
        open.push(d.clone());
        Ok(d)
    }

    fn open(ordinal: usize) -> Result<Self> {
        // cudarc panics when libcuda cannot be loaded; check first so the user gets an error instead.
        // SAFETY: only probes for the shared library.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(Error::Cuda(
                "the CUDA driver library (libcuda.so) was not found: install the NVIDIA driver or add \
                 its folder to LD_LIBRARY_PATH"
                    .into(),
            ));
        }
        let ctx = CudaContext::new(ordinal).map_err(driver_err)?;
        // SAFETY: every allocation, copy, kernel and collective of a rank is issued on its compute
        // stream, so stream order already orders all uses; cudarc's per-allocation events are pure
        // overhead here. (Communicators' own streams synchronise with it by events.)
        unsafe { ctx.disable_event_tracking() };
        keep_freed_memory(&ctx);
        let compute = ctx.new_stream().map_err(driver_err)?;
        let staging = Arc::new(std::sync::Mutex::new(crate::staging::Staging::new()));
        Ok(CudaDevice { ctx, compute, staging, capturing: Arc::new(AtomicBool::new(false)) })
    }

    /// The memory pool's bytes (`Device::memory_stats`).
    pub fn memory_stats(&self) -> Result<crate::MemoryStats> {
        pool_stats(&self.ctx)
    }

    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
    /// The stream every kernel of this rank runs on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.compute
    }
    pub fn synchronize(&self) -> Result<()> {
        self.compute.synchronize().map_err(driver_err)
    }

    /// Captures the work `f` queues on the compute stream into a CUDA graph instead of running it,
    /// and gives the graph with `f`'s result. Nothing runs until [`DeviceGraph::launch`]; each
    /// launch replays the same kernels on the same addresses. So what the graph reads must be
    /// written into buffers allocated before the capture, and every buffer allocated inside it
    /// must be freed inside it (the allocator's stream-ordered allocations become the graph's own).
    /// Copies between host and device are refused while capturing: a replay would not see new
    /// host values.
    pub fn capture<R, E: From<Error>>(
        &self,
        f: impl FnOnce() -> std::result::Result<R, E>,
    ) -> std::result::Result<(DeviceGraph, R), E> {
        use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
        if self.capturing.swap(true, Ordering::SeqCst) {
            let msg = format!("cuda:{}: a CUDA graph capture is already under way", self.ordinal());
            return Err(Error::Cuda(msg).into());
        }
        // Cleared however this returns (an error or a panic in `f` included).
        struct Capturing<'a>(&'a AtomicBool);
        impl Drop for Capturing<'_> {
            fn drop(&mut self) {
                self.0.store(false, Ordering::SeqCst);
            }
        }
        let _flag = Capturing(&self.capturing);
        let s = self.stream();
        // The graph allocates from a pool of its own: hand the blocks the default pool keeps
        // (`keep_freed_memory`) back to the driver first, or both would hold a step's activations.
        s.synchronize().map_err(driver_err)?;
        trim_freed_memory(&self.ctx);
        // Thread-local: calls that would synchronise are refused on this thread only, so other
        // ranks' threads and the host's own threads go on.
        s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| Error::Cuda(format!("starting a CUDA graph capture: {e:?}")))?;
        let r = f();
        let g = s.end_capture(CUgraphInstantiate_flags(0));
        let r = r?;
        match g {
            Ok(Some(graph)) => Ok((DeviceGraph { graph, stream: s.clone() }, r)),
            Ok(None) => Err(Error::Cuda("the CUDA graph capture recorded no work".into()).into()),
            Err(e) => Err(Error::Cuda(format!(
                "capturing work into a CUDA graph failed ({e:?}): an operation queued inside it cannot be captured"
            ))
            .into()),
        }
    }

    /// Whether the compute stream is being captured (`capture`).
    pub fn is_capturing(&self) -> bool {
        self.capturing.load(Ordering::SeqCst)
    }

    fn refuse_in_capture(&self, what: &str) -> Result<()> {
        if self.is_capturing() {
            return Err(Error::Cuda(format!(
                "{what} inside a CUDA graph capture on cuda:{}: a replay would not repeat it; queue it before the captured work",
                self.ordinal()
            )));
        }
        Ok(())
    }

    /// Opens (`true`) or closes the range a profiler started with `--profile-from-start off`
    /// (Nsight Compute) or `--capture-range=cudaProfilerApi` (Nsight Systems) records: the work
    /// queued in between. Without a profiler attached it does nothing.
    pub fn profiler_range(&self, on: bool) -> Result<()> {
        self.ctx.bind_to_thread().map_err(driver_err)?;
        let r = if on { cudarc::driver::profiler_start() } else { cudarc::driver::profiler_stop() };
        r.map_err(driver_err)
    }
}

/// Work captured from a device's compute stream (`CudaDevice::capture`).
pub struct DeviceGraph {
    graph: CudaGraph,
    stream: Arc<CudaStream>,
}

impl DeviceGraph {
    /// Queues one replay on the compute stream it was captured from.
    pub fn launch(&self) -> Result<()> {
        self.graph.launch().map_err(|e| Error::Cuda(format!("launching a CUDA graph: {e:?}")))
    }

    /// Drops the graph once the work queued on its stream (replays included) has finished, and
    /// hands the memory its captured allocations held back to the driver: work queued next does
    /// not sit beside it. Waits for the stream.
    pub fn release(self) -> Result<()> {
        self.stream.synchronize().map_err(driver_err)?;
        let ctx = self.stream.context().clone();
        drop(self.graph);
        // SAFETY: a plain driver call on a live context's device; it frees only graph memory
        // that no graph in flight uses (none is: the stream has drained).
        let r = unsafe { cudarc::driver::sys::cuDeviceGraphMemTrim(ctx.cu_device()) };
        match r {
            cudarc::driver::sys::CUresult::CUDA_SUCCESS => Ok(()),
            e => Err(Error::Cuda(format!("handing a released CUDA graph's memory back: {e:?}"))),
        }
    }
}

/// A new device copy of `v`: small ones through the page-locked ring (queued without waiting for
/// the stream, `staging`), larger ones from pageable memory (the driver waits for the stream).
fn upload<T: cudarc::driver::DeviceRepr>(dev: &CudaDevice, v: &[T]) -> Result<CudaSlice<T>> {
    if v.is_empty() {
        return dev.stream().clone_htod(v).map_err(driver_err);
    }
    // SAFETY: filled by the copy queued next, before any use on this stream.
    let mut d = unsafe { dev.stream().alloc::<T>(v.len()) }.map_err(driver_err)?;
    write_into(dev, &mut d, 0, v)?;
    Ok(d)
}

/// Host values into elements `start..` of `d`: small ones through the page-locked ring (no wait
/// for the stream: an optimizer's learning rate each step), larger ones from pageable memory.
fn write_into<T: cudarc::driver::DeviceRepr>(
    dev: &CudaDevice,
    d: &mut CudaSlice<T>,
    start: usize,
    h: &[T],
) -> Result<()> {
    dev.refuse_in_capture("a copy from the host")?;
    let s = dev.stream();
    let end = start + h.len();
    if end > d.len() {
        return Err(Error::InvalidArgument {
            op: "write_range",
            msg: format!("elements {start}..{end} reach past the buffer's {}", d.len()),
        });
    }
    if h.is_empty() || std::mem::size_of_val(h) > crate::staging::SLOT_BYTES {
        return s.memcpy_htod(h, &mut d.slice_mut(start..end)).map_err(driver_err);
    }
    let dst = d.device_ptr(s).0 + (start * std::mem::size_of::<T>()) as u64;
    let mut ring = dev.staging.lock().unwrap_or_else(|e| e.into_inner());
    // SAFETY: elements start..end lie inside `d` (checked), which is only freed on this stream.
    unsafe { ring.upload(&dev.ctx, s, h, dst) }.map_err(driver_err)
}

/// An allocation failure, naming the size asked for and what the device has in use.
fn alloc_err(dev: &CudaDevice, dtype: DType, n: usize, e: cudarc::driver::DriverError) -> Error {
    let bytes = n * dtype.size_in_bytes();
    let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
    if e.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        let usage = match dev.context().mem_get_info() {
            Ok((free, total)) => {
                format!("{:.2} GiB of {:.2} GiB in use, {:.2} GiB free", gib(total - free), gib(total), gib(free))
            }
            Err(_) => "usage unknown".into(),
        };
        return Error::Cuda(format!(
            "out of memory on cuda:{} allocating {bytes} bytes ({n} × {dtype}, {:.2} GiB); {usage}: lower --micro-batch-size or the model size",
            dev.ordinal(),
            gib(bytes)
        ));
    }
    Error::Cuda(format!("allocating {bytes} bytes on cuda:{}: {e:?}", dev.ordinal()))
}

/// The caching allocator: allocations are stream-ordered (`cuMemAllocAsync`) from the device's
/// default memory pool; raising its release threshold keeps freed blocks in the pool across
/// synchronisations instead of returning them to the driver, so steady-state steps do not allocate.
fn keep_freed_memory(ctx: &CudaContext) {
    use cudarc::driver::sys;
    let mut pool = std::mem::MaybeUninit::<sys::CUmemoryPool>::uninit();
    // SAFETY: plain driver calls on a live context's device; on failure the pool keeps its default.
    unsafe {
        if sys::cuDeviceGetDefaultMemPool(pool.as_mut_ptr(), ctx.cu_device()) == sys::CUresult::CUDA_SUCCESS {
            let mut threshold = u64::MAX;
            let _ = sys::cuMemPoolSetAttribute(
                pool.assume_init(),
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut threshold as *mut u64).cast(),
            );
        }
    }
}

/// The default pool's reserved and used bytes, now and at their highs.
fn pool_stats(ctx: &CudaContext) -> Result<crate::MemoryStats> {
    use cudarc::driver::sys;
    use sys::CUmemPool_attribute as A;
    let mut pool = std::mem::MaybeUninit::<sys::CUmemoryPool>::uninit();
    // SAFETY: plain driver queries on a live context's device into u64 outputs (cuuint64_t, as
    // these four attributes are documented).
    unsafe {
        let r = sys::cuDeviceGetDefaultMemPool(pool.as_mut_ptr(), ctx.cu_device());
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(Error::Cuda(format!("the device's memory pool: {r:?}")));
        }
        let pool = pool.assume_init();
        let get = |a: A| -> Result<u64> {
            let mut v = 0u64;
            match sys::cuMemPoolGetAttribute(pool, a, (&mut v as *mut u64).cast()) {
                sys::CUresult::CUDA_SUCCESS => Ok(v),
                r => Err(Error::Cuda(format!("memory pool attribute {a:?}: {r:?}"))),
            }
        };
        Ok(crate::MemoryStats {
            reserved: get(A::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?,
            max_reserved: get(A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)?,
            allocated: get(A::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
            max_allocated: get(A::CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
        })
    }
}

/// Returns the default pool's unused blocks to the driver (after a synchronisation, so that the
/// stream's frees have landed).
fn trim_freed_memory(ctx: &CudaContext) {
    use cudarc::driver::sys;
    let mut pool = std::mem::MaybeUninit::<sys::CUmemoryPool>::uninit();
    // SAFETY: plain driver calls on a live context's device; a failure leaves the pool as it was.
    unsafe {
        if sys::cuDeviceGetDefaultMemPool(pool.as_mut_ptr(), ctx.cu_device()) == sys::CUresult::CUDA_SUCCESS {
            let _ = sys::cuMemPoolTrimTo(pool.assume_init(), 0);
        }
    }
}

/// Device memory, one variant per dtype like `CpuStorage`.
#[derive(Debug)]
pub enum CudaStorage {
    F32(CudaSlice<f32>),
    BF16(CudaSlice<bf16>),
    F16(CudaSlice<f16>),
    F8E4M3(CudaSlice<F8E4M3>),
    F8E5M2(CudaSlice<F8E5M2>),
    U32(CudaSlice<u32>),
}

impl CudaStorage {
    pub fn dtype(&self) -> DType {
        match self {
            CudaStorage::F32(_) => DType::F32,
            CudaStorage::BF16(_) => DType::BF16,
            CudaStorage::F16(_) => DType::F16,
            CudaStorage::F8E4M3(_) => DType::F8E4M3,
            CudaStorage::F8E5M2(_) => DType::F8E5M2,
            CudaStorage::U32(_) => DType::U32,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Elements in the buffer.
    pub fn len(&self) -> usize {
        match self {
            CudaStorage::F32(v) => v.len(),
            CudaStorage::BF16(v) => v.len(),
            CudaStorage::F16(v) => v.len(),
            CudaStorage::F8E4M3(v) => v.len(),
            CudaStorage::F8E5M2(v) => v.len(),
            CudaStorage::U32(v) => v.len(),
        }
    }

    /// Raw device address of element 0, for kernel arguments. Every kernel of a rank runs on its one
    /// compute stream, so stream order alone keeps reads after writes.
    pub fn raw_ptr(&self, dev: &CudaDevice) -> u64 {
        let s = dev.stream();
        match self {
            CudaStorage::F32(v) => v.device_ptr(s).0,
            CudaStorage::BF16(v) => v.device_ptr(s).0,
            CudaStorage::F16(v) => v.device_ptr(s).0,
            CudaStorage::F8E4M3(v) => v.device_ptr(s).0,
            CudaStorage::F8E5M2(v) => v.device_ptr(s).0,
            CudaStorage::U32(v) => v.device_ptr(s).0,
        }
    }

    /// Copies `src`'s elements to this storage's as `rects` say (`copy_plan`: offsets and pitches
    /// in elements), one `cuMemcpy2DAsync` each on the compute stream. Same dtype; every
    /// rectangle inside both buffers (checked).
    pub fn copy_rects_from(
        &mut self,
        dev: &CudaDevice,
        rects: &[crate::shape::Copy2d],
        src: &CudaStorage,
    ) -> Result<()> {
        use cudarc::driver::sys;
        const OP: &str = "copy_rects_from";
        if self.dtype() != src.dtype() {
            return Err(Error::DTypeMismatch { op: OP, expected: self.dtype().to_string(), got: src.dtype() });
        }
        let e = self.dtype().size_in_bytes();
        let (dlen, slen) = (self.len(), src.len());
        let end = |at: usize, r: &crate::shape::Copy2d, pitch: usize| at + (r.rows - 1) * pitch + r.width;
        if let Some(r) = rects
            .iter()
            .find(|r| r.rows > 0 && (end(r.dst, r, r.dst_pitch) > dlen || end(r.src, r, r.src_pitch) > slen))
        {
            return Err(Error::InvalidArgument {
                op: OP,
                msg: format!("{r:?} reaches past a buffer ({dlen} elements written, {slen} read)"),
            });
        }
        let (dbase, sbase) = (self.raw_ptr(dev), src.raw_ptr(dev));
        let stream = dev.stream().cu_stream();
        for r in rects.iter().filter(|r| r.rows > 0 && r.width > 0) {
            // Every field named: a zeroed struct is not a valid value (its memory-type enums have
            // no zero variant), and the host and array fields are unused for device copies.
            let p = sys::CUDA_MEMCPY2D {
                srcXInBytes: 0,
                srcY: 0,
                srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
                srcHost: std::ptr::null(),
                srcDevice: sbase + (r.src * e) as u64,
                srcArray: std::ptr::null_mut(),
                srcPitch: r.src_pitch * e,
                dstXInBytes: 0,
                dstY: 0,
                dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
                dstHost: std::ptr::null_mut(),
                dstDevice: dbase + (r.dst * e) as u64,
                dstArray: std::ptr::null_mut(),
                dstPitch: r.dst_pitch * e,
                WidthInBytes: r.width * e,
                Height: r.rows,
            };
            // SAFETY: both rectangles lie inside their buffers (checked above), which live on
            // this stream until the copy is done.
            let res = unsafe { sys::cuMemcpy2DAsync_v2(&p, stream) };
            if res != sys::CUresult::CUDA_SUCCESS {
                return Err(Error::Cuda(format!("{OP}: cuMemcpy2DAsync of {r:?} failed: {res:?}")));
            }
        }
        Ok(())
    }

    /// Zeroes elements `r` on the compute stream.
    pub fn zero_range(&mut self, dev: &CudaDevice, r: std::ops::Range<usize>) -> Result<()> {
        let s = dev.stream();
        match self {
            CudaStorage::F32(v) => s.memset_zeros(&mut v.slice_mut(r)),
            CudaStorage::BF16(v) => s.memset_zeros(&mut v.slice_mut(r)),
            CudaStorage::F16(v) => s.memset_zeros(&mut v.slice_mut(r)),
            CudaStorage::F8E4M3(v) => s.memset_zeros(&mut v.slice_mut(r)),
            CudaStorage::F8E5M2(v) => s.memset_zeros(&mut v.slice_mut(r)),
            CudaStorage::U32(v) => s.memset_zeros(&mut v.slice_mut(r)),
        }
        .map_err(driver_err)
    }

    /// Copies host values of the same dtype to elements `start..` (queued on the compute stream;
    /// small copies do not wait for it).
    pub fn write_range(&mut self, dev: &CudaDevice, start: usize, src: &CpuStorage) -> Result<()> {
        self.write_range_of(dev, start, src, 0..src.len())
    }

    /// `write_range` of `src`'s elements `r` alone.
    pub fn write_range_of(
        &mut self,
        dev: &CudaDevice,
        start: usize,
        src: &CpuStorage,
        r: std::ops::Range<usize>,
    ) -> Result<()> {
        match (self, src) {
            (CudaStorage::F32(v), CpuStorage::F32(h)) => write_into(dev, v, start, &h[r]),
            (CudaStorage::BF16(v), CpuStorage::BF16(h)) => write_into(dev, v, start, &h[r]),
            (CudaStorage::F16(v), CpuStorage::F16(h)) => write_into(dev, v, start, &h[r]),
            (CudaStorage::U32(v), CpuStorage::U32(h)) => write_into(dev, v, start, &h[r]),
            (d, h) => Err(Error::DTypeMismatch { op: "write_range", expected: d.dtype().to_string(), got: h.dtype() }),
        }
    }

    /// Elements `r` copied into `dst`'s elements `at..` (same dtype; waits for the compute stream).
    pub fn read_range_into(
        &self,
        dev: &CudaDevice,
        r: std::ops::Range<usize>,
        dst: &mut CpuStorage,
        at: usize,
    ) -> Result<()> {
        dev.refuse_in_capture("a copy to the host")?;
        if r.end > self.len() || r.start > r.end || at + r.len() > dst.len() {
            return Err(Error::InvalidArgument {
                op: "read_range_into",
                msg: format!("elements {r:?} of {} into {at}.. of {}", self.len(), dst.len()),
            });
        }
        let s = dev.stream();
        let end = at + r.len();
        match (self, dst) {
            (CudaStorage::F32(v), CpuStorage::F32(h)) => s.memcpy_dtoh(&v.slice(r), &mut h[at..end]),
            (CudaStorage::BF16(v), CpuStorage::BF16(h)) => s.memcpy_dtoh(&v.slice(r), &mut h[at..end]),
            (CudaStorage::F16(v), CpuStorage::F16(h)) => s.memcpy_dtoh(&v.slice(r), &mut h[at..end]),
            (CudaStorage::F8E4M3(v), CpuStorage::F8E4M3(h)) => s.memcpy_dtoh(&v.slice(r), &mut h[at..end]),
            (CudaStorage::F8E5M2(v), CpuStorage::F8E5M2(h)) => s.memcpy_dtoh(&v.slice(r), &mut h[at..end]),
            (CudaStorage::U32(v), CpuStorage::U32(h)) => s.memcpy_dtoh(&v.slice(r), &mut h[at..end]),
            (d, h) => {
                return Err(Error::DTypeMismatch {
                    op: "read_range_into",
                    expected: d.dtype().to_string(),
                    got: h.dtype(),
                });
            }
        }
        .map_err(driver_err)?;
        // The copy above is ordered on the stream; the host reads `dst` next.
        s.synchronize().map_err(driver_err)
    }

    /// Copies `src`'s elements `r` to elements `start..` (same dtype), on the compute stream.
    pub fn copy_range_from(
        &mut self,
        dev: &CudaDevice,
        start: usize,
        src: &CudaStorage,
        r: std::ops::Range<usize>,
    ) -> Result<()> {
        let s = dev.stream();
        let end = start + r.len();
        match (self, src) {
            (CudaStorage::F32(d), CudaStorage::F32(f)) => s.memcpy_dtod(&f.slice(r), &mut d.slice_mut(start..end)),
            (CudaStorage::BF16(d), CudaStorage::BF16(f)) => s.memcpy_dtod(&f.slice(r), &mut d.slice_mut(start..end)),
            (CudaStorage::F16(d), CudaStorage::F16(f)) => s.memcpy_dtod(&f.slice(r), &mut d.slice_mut(start..end)),
            (CudaStorage::F8E4M3(d), CudaStorage::F8E4M3(f)) => {
                s.memcpy_dtod(&f.slice(r), &mut d.slice_mut(start..end))
            }
            (CudaStorage::F8E5M2(d), CudaStorage::F8E5M2(f)) => {
                s.memcpy_dtod(&f.slice(r), &mut d.slice_mut(start..end))
            }
            (CudaStorage::U32(d), CudaStorage::U32(f)) => s.memcpy_dtod(&f.slice(r), &mut d.slice_mut(start..end)),
            (d, f) => {
                return Err(Error::DTypeMismatch {
                    op: "copy_range_from",
                    expected: d.dtype().to_string(),
                    got: f.dtype(),
                });
            }
        }
        .map_err(driver_err)
    }

    pub fn zeros(dev: &CudaDevice, dtype: DType, n: usize) -> Result<Self> {
        let s = dev.stream();
        let oom = |e: cudarc::driver::DriverError| alloc_err(dev, dtype, n, e);
        Ok(match dtype {
            DType::F32 => CudaStorage::F32(s.alloc_zeros(n).map_err(oom)?),
            DType::BF16 => CudaStorage::BF16(s.alloc_zeros(n).map_err(oom)?),
            DType::F16 => CudaStorage::F16(s.alloc_zeros(n).map_err(oom)?),
            DType::F8E4M3 => CudaStorage::F8E4M3(s.alloc_zeros(n).map_err(oom)?),
            DType::F8E5M2 => CudaStorage::F8E5M2(s.alloc_zeros(n).map_err(oom)?),
            DType::U32 => CudaStorage::U32(s.alloc_zeros(n).map_err(oom)?),
        })
    }

    /// Device memory of `n` elements with unspecified contents (no memset): for kernel outputs
    /// that write every element before anything reads it.
    pub fn empty(dev: &CudaDevice, dtype: DType, n: usize) -> Result<Self> {
        let s = dev.stream();
        let oom = |e: cudarc::driver::DriverError| alloc_err(dev, dtype, n, e);
        // SAFETY: the buffers hold plain numbers of any bit pattern; callers write before reading.
        unsafe {
            Ok(match dtype {
                DType::F32 => CudaStorage::F32(s.alloc(n).map_err(oom)?),
                DType::BF16 => CudaStorage::BF16(s.alloc(n).map_err(oom)?),
                DType::F16 => CudaStorage::F16(s.alloc(n).map_err(oom)?),
                DType::F8E4M3 => CudaStorage::F8E4M3(s.alloc(n).map_err(oom)?),
                DType::F8E5M2 => CudaStorage::F8E5M2(s.alloc(n).map_err(oom)?),
                DType::U32 => CudaStorage::U32(s.alloc(n).map_err(oom)?),
            })
        }
    }

    pub fn from_cpu(dev: &CudaDevice, src: &CpuStorage) -> Result<Self> {
        Ok(match src {
            CpuStorage::F32(v) => CudaStorage::F32(upload(dev, v)?),
            CpuStorage::BF16(v) => CudaStorage::BF16(upload(dev, v)?),
            CpuStorage::F16(v) => CudaStorage::F16(upload(dev, v)?),
            CpuStorage::F8E4M3(v) => CudaStorage::F8E4M3(upload(dev, v)?),
            CpuStorage::F8E5M2(v) => CudaStorage::F8E5M2(upload(dev, v)?),
            CpuStorage::U32(v) => CudaStorage::U32(upload(dev, v)?),
        })
    }

    /// Elements `r` copied to the host (waits for the compute stream).
    pub fn read_range(&self, dev: &CudaDevice, r: std::ops::Range<usize>) -> Result<CpuStorage> {
        let mut h = CpuStorage::zeros(self.dtype(), r.len());
        self.read_range_into(dev, r, &mut h, 0)?;
        Ok(h)
    }

    pub fn to_cpu(&self, dev: &CudaDevice) -> Result<CpuStorage> {
        dev.refuse_in_capture("a copy to the host")?;
        fn get<T: WithDType + cudarc::driver::DeviceRepr>(dev: &CudaDevice, v: &CudaSlice<T>) -> Result<Vec<T>> {
            dev.stream().clone_dtoh(v).map_err(driver_err)
        }
        Ok(match self {
            CudaStorage::F32(v) => CpuStorage::F32(get(dev, v)?),
            CudaStorage::BF16(v) => CpuStorage::BF16(get(dev, v)?),
            CudaStorage::F16(v) => CpuStorage::F16(get(dev, v)?),
            CudaStorage::F8E4M3(v) => CpuStorage::F8E4M3(get(dev, v)?),
            CudaStorage::F8E5M2(v) => CpuStorage::F8E5M2(get(dev, v)?),
            CudaStorage::U32(v) => CpuStorage::U32(get(dev, v)?),
        })
    }
}
