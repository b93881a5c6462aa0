//! CUDA storage and device handles (feature `cuda`). cudarc loads the driver at run time, so this
//! compiles on machines without CUDA; opening a device there returns an error naming the library.

use crate::{CpuStorage, DType, Error, Result, WithDType};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use float8::{F8E4M3, F8E5M2};
use half::{bf16, f16};
use std::sync::Arc;

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
        Ok(CudaDevice { ctx, compute, staging })
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

    /// Opens (`true`) or closes the range a profiler started with `--profile-from-start off`
    /// (Nsight Compute) or `--capture-range=cudaProfilerApi` (Nsight Systems) records: the work
    /// queued in between. Without a profiler attached it does nothing.
    pub fn profiler_range(&self, on: bool) -> Result<()> {
        self.ctx.bind_to_thread().map_err(driver_err)?;
        let r = if on { cudarc::driver::profiler_start() } else { cudarc::driver::profiler_stop() };
        r.map_err(driver_err)
    }
}

/// A new device copy of `v`: small ones through the page-locked ring (queued without waiting for
/// the stream, `staging`), larger ones from pageable memory (the driver waits for the stream).
fn upload<T: cudarc::driver::DeviceRepr>(dev: &CudaDevice, v: &[T]) -> Result<CudaSlice<T>> {
    let s = dev.stream();
    if v.is_empty() || std::mem::size_of_val(v) > crate::staging::SLOT_BYTES {
        return s.clone_htod(v).map_err(driver_err);
    }
    // SAFETY: filled by the copy queued next, before any use on this stream.
    let mut d = unsafe { s.alloc::<T>(v.len()) }.map_err(driver_err)?;
    let mut ring = dev.staging.lock().unwrap_or_else(|e| e.into_inner());
    ring.upload(&dev.ctx, s, v, &mut d).map_err(driver_err)?;
    Ok(d)
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

    /// Raw device address of element 0, for kernel arguments. Every kernel of a rank runs on its one
    /// compute stream, so stream order alone keeps reads after writes.
    pub fn raw_ptr(&self, dev: &CudaDevice) -> u64 {
        use cudarc::driver::DevicePtr;
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

    /// Copies host values of the same dtype to elements `start..`.
    pub fn write_range(&mut self, dev: &CudaDevice, start: usize, src: &CpuStorage) -> Result<()> {
        let s = dev.stream();
        let end = start + src.len();
        match (self, src) {
            (CudaStorage::F32(v), CpuStorage::F32(h)) => s.memcpy_htod(h, &mut v.slice_mut(start..end)),
            (CudaStorage::BF16(v), CpuStorage::BF16(h)) => s.memcpy_htod(h, &mut v.slice_mut(start..end)),
            (CudaStorage::F16(v), CpuStorage::F16(h)) => s.memcpy_htod(h, &mut v.slice_mut(start..end)),
            (CudaStorage::U32(v), CpuStorage::U32(h)) => s.memcpy_htod(h, &mut v.slice_mut(start..end)),
            (d, h) => {
                return Err(Error::DTypeMismatch {
                    op: "write_range",
                    expected: d.dtype().to_string(),
                    got: h.dtype(),
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

    pub fn to_cpu(&self, dev: &CudaDevice) -> Result<CpuStorage> {
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
