//! `Tensor`: shared storage + layout + dtype + device.
//!
//! Cloning a tensor is cheap and shares storage (like a PyTorch view); `deep_copy` copies. Views
//! (`reshape`, `view`, `transpose`) share storage too, which is how the flat parameter and gradient
//! buffers hand out per-parameter tensors. Storage sits behind a `RwLock` so that in-place ops on a
//! view (optimizer steps, `+=` into main_grad) are safe across rank threads.

use crate::storage::{CpuStorage, Storage};
use crate::{DType, Device, Error, Layout, Result, Shape, WithDType, shape_mismatch};
use std::ops::{Deref, Range};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

#[derive(Clone)]
pub struct Tensor {
    storage: Arc<RwLock<Storage>>,
    layout: Layout,
    dtype: DType,
    device: Device,
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tensor({}, {}, {})", self.shape(), self.dtype, self.device)
    }
}

/// f32 view of a CPU tensor's elements: borrowed when already contiguous f32, converted otherwise.
pub enum F32Read<'a> {
    Borrowed(RwLockReadGuard<'a, Storage>, Range<usize>),
    Owned(Vec<f32>),
}

impl Deref for F32Read<'_> {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        match self {
            F32Read::Owned(v) => v,
            F32Read::Borrowed(g, r) => match &**g {
                Storage::Cpu(CpuStorage::F32(v)) => &v[r.clone()],
                // Borrowed is only built for contiguous CPU f32 storage.
                #[allow(unreachable_patterns)]
                _ => &[],
            },
        }
    }
}

impl Tensor {
    fn from_storage(storage: Storage, shape: Shape, device: Device) -> Self {
        let dtype = storage.dtype();
        Tensor { storage: Arc::new(RwLock::new(storage)), layout: Layout::contiguous(shape), dtype, device }
    }

    fn place(cpu: CpuStorage, shape: Shape, device: &Device) -> Result<Self> {
        let storage = match device {
            Device::Cpu => Storage::Cpu(cpu),
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => Storage::Cuda(crate::cuda::CudaStorage::from_cpu(d, &cpu)?),
        };
        Ok(Self::from_storage(storage, shape, device.clone()))
    }

    pub fn zeros(shape: impl Into<Shape>, dtype: DType, device: &Device) -> Result<Self> {
        let shape = shape.into();
        let n = shape.elem_count();
        let storage = match device {
            Device::Cpu => Storage::Cpu(CpuStorage::zeros(dtype, n)),
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => Storage::Cuda(crate::cuda::CudaStorage::zeros(d, dtype, n)?),
        };
        Ok(Self::from_storage(storage, shape, device.clone()))
    }

    /// A tensor whose contents are unspecified until written: kernel outputs that set every
    /// element (no memset pass on a GPU; zeros on the CPU, where safe Rust has no uninitialised
    /// buffers). Kernel tests poison these with NaN to catch an element left unwritten.
    pub fn empty(shape: impl Into<Shape>, dtype: DType, device: &Device) -> Result<Self> {
        let shape = shape.into();
        match device {
            Device::Cpu => Self::zeros(shape, dtype, device),
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => {
                let storage = Storage::Cuda(crate::cuda::CudaStorage::empty(d, dtype, shape.elem_count())?);
                Ok(Self::from_storage(storage, shape, device.clone()))
            }
        }
    }

    /// A tensor of `shape` holding `data` (row-major); the dtype is `T`'s.
    pub fn from_vec<T: WithDType>(data: Vec<T>, shape: impl Into<Shape>, device: &Device) -> Result<Self> {
        let shape = shape.into();
        if data.len() != shape.elem_count() {
            return Err(shape_mismatch("Tensor::from_vec", shape, format!("{} elements", data.len())));
        }
        Self::place(CpuStorage::from_vec(data), shape, device)
    }

    /// A tensor of `dtype` from f32 values, rounding to nearest for narrow dtypes.
    pub fn from_f32(data: &[f32], shape: impl Into<Shape>, dtype: DType, device: &Device) -> Result<Self> {
        let shape = shape.into();
        if data.len() != shape.elem_count() {
            return Err(shape_mismatch("Tensor::from_f32", shape, format!("{} elements", data.len())));
        }
        Self::place(CpuStorage::from_f32(data, dtype), shape, device)
    }

    pub fn shape(&self) -> &Shape {
        self.layout.shape()
    }
    pub fn dims(&self) -> &[usize] {
        self.layout.shape().dims()
    }
    pub fn elem_count(&self) -> usize {
        self.shape().elem_count()
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn device(&self) -> &Device {
        &self.device
    }
    pub fn layout(&self) -> &Layout {
        &self.layout
    }
    pub fn is_contiguous(&self) -> bool {
        self.layout.is_contiguous()
    }

    /// True when both tensors view the same allocation.
    pub fn shares_storage(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(&self.storage, &other.storage)
    }

    /// Read access to the raw storage (for kernels).
    pub fn storage(&self) -> RwLockReadGuard<'_, Storage> {
        self.storage.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Write access to the raw storage (for in-place kernels). Holding it while reading another view of
    /// the same storage deadlocks: check `shares_storage` first.
    pub fn storage_mut(&self) -> RwLockWriteGuard<'_, Storage> {
        self.storage.write().unwrap_or_else(|e| e.into_inner())
    }

    fn cpu_only(&self, op: &'static str) -> Result<()> {
        if self.device.is_cpu() { Ok(()) } else { Err(Error::NotImplemented { op, device: self.device.name() }) }
    }

    /// The elements as f32 in row-major order, for a CPU tensor of any dtype and layout.
    pub fn read_f32(&self) -> Result<F32Read<'_>> {
        self.cpu_only("read_f32")?;
        let g = self.storage();
        if self.dtype == DType::F32 {
            if let Some(r) = self.layout.contiguous_range() {
                return Ok(F32Read::Borrowed(g, r));
            }
        }
        let Some(s) = g.as_cpu() else {
            return Err(Error::NotImplemented { op: "read_f32", device: self.device.name() });
        };
        Ok(F32Read::Owned(match self.layout.contiguous_range() {
            Some(r) => s.range_f32(r),
            None => s.gather_f32(self.layout.storage_indices()),
        }))
    }

    /// Runs `f` on the contiguous f32 elements of a CPU tensor in place. Narrow dtypes are widened,
    /// updated and rounded back.
    pub fn update_f32<R>(&self, op: &'static str, f: impl FnOnce(&mut [f32]) -> R) -> Result<R> {
        self.cpu_only(op)?;
        let r = self.layout.contiguous_range().ok_or(Error::NotContiguous { op })?;
        let mut g = self.storage_mut();
        let Some(s) = g.as_cpu_mut() else {
            return Err(Error::NotImplemented { op, device: self.device.name() });
        };
        if let CpuStorage::F32(v) = s {
            return Ok(f(&mut v[r]));
        }
        let mut tmp = s.range_f32(r.clone());
        let out = f(&mut tmp);
        s.write_f32(r.start, &tmp);
        Ok(out)
    }

    /// Sets every element to zero in place (contiguous tensors; any device).
    pub fn zero_(&self) -> Result<()> {
        const OP: &str = "zero_";
        #[cfg(feature = "cuda")]
        if let Device::Cuda(d) = &self.device {
            let r = self.layout.contiguous_range().ok_or(Error::NotContiguous { op: OP })?;
            let mut g = self.storage_mut();
            if let Storage::Cuda(c) = &mut *g {
                return c.zero_range(d, r);
            }
        }
        self.update_f32(OP, |v| v.fill(0.0))
    }

    /// Overwrites the elements (contiguous, row-major) with `src`, rounded to this tensor's dtype.
    pub fn copy_from_f32(&self, src: &[f32]) -> Result<()> {
        const OP: &str = "copy_from_f32";
        if src.len() != self.elem_count() {
            return Err(shape_mismatch(OP, self.shape(), format!("{} values", src.len())));
        }
        #[cfg(feature = "cuda")]
        if let Device::Cuda(d) = &self.device {
            let r = self.layout.contiguous_range().ok_or(Error::NotContiguous { op: OP })?;
            let host = CpuStorage::from_f32(src, self.dtype);
            let mut g = self.storage_mut();
            if let Storage::Cuda(c) = &mut *g {
                return c.write_range(d, r.start, &host);
            }
        }
        self.update_f32(OP, |v| v.copy_from_slice(src))
    }

    /// Overwrites the elements with `src`'s, bit for bit: same dtype and element count, in
    /// different storage. On a GPU a device-to-device copy queued on the compute stream (token ids
    /// too, which the float kernels do not take). Strided views (`narrow`, `transpose`) of the
    /// same shape copy as rectangles (`copy_plan`): on a GPU one `cuMemcpy2DAsync` each, at most
    /// `MAX_RECTS` of them. Between the host and a GPU both must be contiguous: the range alone
    /// crosses (a copy to the host waits for the stream).
    pub fn copy_from(&self, src: &Tensor) -> Result<()> {
        const OP: &str = "copy_from";
        if src.dtype != self.dtype || src.elem_count() != self.elem_count() {
            let got = format!("{} {} elements", src.elem_count(), src.dtype);
            return Err(shape_mismatch(OP, self.shape(), got));
        }
        #[cfg(feature = "cuda")]
        if !self.device.same(&src.device) {
            return self.copy_across(src);
        }
        if !self.device.same(&src.device) || self.shares_storage(src) {
            return Err(Error::InvalidArgument {
                op: OP,
                msg: "source and destination must be distinct storage on the same device".into(),
            });
        }
        let (Some(d), Some(r)) = (self.layout.contiguous_range(), src.layout.contiguous_range()) else {
            return self.copy_strided_from(src);
        };
        let from = src.storage();
        let mut to = self.storage_mut();
        match (&mut *to, &*from) {
            (Storage::Cpu(t), Storage::Cpu(f)) => {
                let n = self.dtype.size_in_bytes();
                crate::storage::bytes_mut(t)[d.start * n..d.end * n].copy_from_slice(f.bytes(r));
                Ok(())
            }
            #[cfg(feature = "cuda")]
            (Storage::Cuda(t), Storage::Cuda(f)) => {
                let Device::Cuda(dev) = &self.device else { unreachable!("CUDA storage on a CUDA device") };
                t.copy_range_from(dev, d.start, f, r)
            }
            #[cfg(feature = "cuda")]
            _ => unreachable!("storage on the same device is of the same kind"),
        }
    }

    /// `copy_from` between the host and a GPU (or two GPUs, through the host): contiguous views,
    /// only their ranges moved.
    #[cfg(feature = "cuda")]
    fn copy_across(&self, src: &Tensor) -> Result<()> {
        const OP: &str = "copy_from";
        let (Some(d), Some(r)) = (self.layout.contiguous_range(), src.layout.contiguous_range()) else {
            return Err(Error::NotContiguous { op: OP });
        };
        // Distinct devices: distinct storage, so both locks can be held.
        let (from, mut to) = (src.storage(), self.storage_mut());
        match (&*from, &src.device, &mut *to, &self.device) {
            (Storage::Cpu(f), _, Storage::Cuda(t), Device::Cuda(dev)) => t.write_range_of(dev, d.start, f, r),
            (Storage::Cuda(f), Device::Cuda(dev), Storage::Cpu(t), _) => f.read_range_into(dev, r, t, d.start),
            (Storage::Cuda(f), Device::Cuda(a), Storage::Cuda(t), Device::Cuda(b)) => {
                t.write_range(b, d.start, &f.read_range(a, r)?)
            }
            _ => unreachable!("storage of a device's kind on each side"),
        }
    }

    /// `copy_from` between layouts of the same shape that are not both contiguous.
    fn copy_strided_from(&self, src: &Tensor) -> Result<()> {
        let plan = crate::shape::copy_plan(&self.layout, &src.layout)?;
        let from = src.storage();
        let mut to = self.storage_mut();
        match (&mut *to, &*from) {
            (Storage::Cpu(t), Storage::Cpu(f)) => {
                let n = self.dtype.size_in_bytes();
                let (dst, all) = (crate::storage::bytes_mut(t), f.bytes(0..f.len()));
                for r in &plan {
                    for i in 0..r.rows {
                        let (d, s) = ((r.dst + i * r.dst_pitch) * n, (r.src + i * r.src_pitch) * n);
                        dst[d..d + r.width * n].copy_from_slice(&all[s..s + r.width * n]);
                    }
                }
                Ok(())
            }
            #[cfg(feature = "cuda")]
            (Storage::Cuda(t), Storage::Cuda(f)) => {
                // Rectangles one copy may take on a GPU (each a driver call).
                const MAX_RECTS: usize = 4096;
                if plan.len() > MAX_RECTS {
                    return Err(Error::InvalidArgument {
                        op: "copy_from",
                        msg: format!(
                            "a strided copy of {:?} as {} rectangles (at most {MAX_RECTS}): make one side contiguous first",
                            self.dims(),
                            plan.len()
                        ),
                    });
                }
                let Device::Cuda(dev) = &self.device else { unreachable!("CUDA storage on a CUDA device") };
                t.copy_rects_from(dev, &plan, f)
            }
            #[cfg(feature = "cuda")]
            _ => unreachable!("storage on the same device is of the same kind"),
        }
    }

    /// The elements' raw bytes in row-major order, on the host (any device, layout).
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let t = self.to_device(&Device::Cpu)?.contiguous()?;
        let g = t.storage();
        let (Some(s), Some(r)) = (g.as_cpu(), t.layout.contiguous_range()) else {
            return Err(Error::NotContiguous { op: "to_bytes" });
        };
        Ok(s.bytes(r).to_vec())
    }

    /// Overwrites the elements (contiguous) with raw bytes of this tensor's dtype, as `to_bytes`
    /// gives them (any device).
    pub fn copy_from_bytes(&self, src: &[u8]) -> Result<()> {
        const OP: &str = "copy_from_bytes";
        let host = CpuStorage::from_bytes(self.dtype, src)?;
        if host.len() != self.elem_count() {
            return Err(shape_mismatch(OP, self.shape(), format!("{} bytes", src.len())));
        }
        let r = self.layout.contiguous_range().ok_or(Error::NotContiguous { op: OP })?;
        let mut g = self.storage_mut();
        match &mut *g {
            Storage::Cpu(s) => {
                let n = self.dtype.size_in_bytes();
                let all: &mut [u8] = crate::storage::bytes_mut(s);
                all[r.start * n..r.end * n].copy_from_slice(src);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Storage::Cuda(c) => {
                let Device::Cuda(d) = &self.device else { unreachable!("CUDA storage on a CUDA device") };
                c.write_range(d, r.start, &host)
            }
        }
    }

    /// Copies all elements to the host as f32 (any device, dtype, layout).
    pub fn to_vec_f32(&self) -> Result<Vec<f32>> {
        let t = self.to_device(&Device::Cpu)?;
        Ok(t.read_f32()?.to_vec())
    }

    /// Copies all elements to the host as `T`, which must be the tensor's dtype.
    pub fn to_vec<T: WithDType>(&self) -> Result<Vec<T>> {
        let t = self.to_device(&Device::Cpu)?.contiguous()?;
        let g = t.storage();
        let Some(s) = g.as_cpu() else {
            return Err(Error::NotImplemented { op: "to_vec", device: t.device.name() });
        };
        let r = t.layout.contiguous_range().ok_or(Error::NotContiguous { op: "to_vec" })?;
        Ok(s.as_slice::<T>()?[r].to_vec())
    }

    /// Same elements, new shape. Shares storage; needs a contiguous tensor.
    pub fn reshape(&self, shape: impl Into<Shape>) -> Result<Tensor> {
        let shape = shape.into();
        if shape.elem_count() != self.elem_count() {
            return Err(shape_mismatch("reshape", self.shape(), shape));
        }
        if !self.is_contiguous() {
            return Err(Error::NotContiguous { op: "reshape" });
        }
        Ok(Tensor { layout: Layout::contiguous_at(shape, self.layout.offset()), ..self.clone() })
    }

    /// The `shape.elem_count()` elements starting at flat element `start`, as a tensor of `shape`.
    /// Shares storage: this is how parameters view a flat buffer.
    pub fn view(&self, start: usize, shape: impl Into<Shape>) -> Result<Tensor> {
        let shape = shape.into();
        if !self.is_contiguous() {
            return Err(Error::NotContiguous { op: "view" });
        }
        let end = start + shape.elem_count();
        if end > self.elem_count() {
            return Err(Error::IndexOutOfRange {
                op: "view",
                what: "flat elements",
                index: end as u64,
                bound: self.elem_count() as u64,
            });
        }
        Ok(Tensor { layout: Layout::contiguous_at(shape, self.layout.offset() + start), ..self.clone() })
    }

    /// Rows `range` of the outermost dimension, sharing storage.
    pub fn narrow0(&self, range: Range<usize>) -> Result<Tensor> {
        let dims = self.dims();
        if dims.is_empty() || range.end > dims[0] || range.start > range.end {
            return Err(Error::IndexOutOfRange {
                op: "narrow0",
                what: "dimension 0",
                index: range.end as u64,
                bound: dims.first().copied().unwrap_or(0) as u64,
            });
        }
        let row: usize = dims[1..].iter().product();
        let mut shape = dims.to_vec();
        shape[0] = range.len();
        self.view(range.start * row, shape)
    }

    /// Indices `range` of dimension `dim`, sharing storage (a strided view unless `dim` is the
    /// outermost: a matrix's columns; `copy_from` and `contiguous` copy it out).
    pub fn narrow(&self, dim: usize, range: Range<usize>) -> Result<Tensor> {
        Ok(Tensor { layout: self.layout.narrow(dim, range)?, ..self.clone() })
    }

    /// Swaps two dimensions without copying (the result is strided).
    pub fn transpose(&self, a: usize, b: usize) -> Result<Tensor> {
        Ok(Tensor { layout: self.layout.transpose(a, b)?, ..self.clone() })
    }

    /// A contiguous tensor with the same elements (self when already contiguous).
    pub fn contiguous(&self) -> Result<Tensor> {
        if self.is_contiguous() {
            return Ok(self.clone());
        }
        self.deep_copy()
    }

    /// A contiguous copy in fresh storage on the same device. On a GPU a layout whose elements
    /// fall into at most `DEVICE_RUNS` contiguous runs (a transposed outer dimension: the
    /// sequence-parallel and context-parallel reorders) is copied run by run on the device's
    /// stream, with no host round trip; others go through the host.
    pub fn deep_copy(&self) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(d) = &self.device {
            const DEVICE_RUNS: usize = 4096;
            let (run, starts) = self.layout.runs();
            if starts.len() <= DEVICE_RUNS {
                let g = self.storage();
                if let Storage::Cuda(src) = &*g {
                    let mut dst = crate::cuda::CudaStorage::empty(d, self.dtype, self.elem_count())?;
                    for (i, &s) in starts.iter().enumerate() {
                        dst.copy_range_from(d, i * run, src, s..s + run)?;
                    }
                    return Ok(Self::from_storage(Storage::Cuda(dst), self.shape().clone(), self.device.clone()));
                }
            }
        }
        let data = gather(&self.host_view()?)?;
        Self::place(data, self.shape().clone(), &self.device)
    }

    /// A copy on `device` (self when already there).
    pub fn to_device(&self, device: &Device) -> Result<Tensor> {
        if self.device.same(device) {
            return Ok(self.clone());
        }
        let data = gather(&self.host_view()?)?;
        Self::place(data, self.shape().clone(), device)
    }

    /// Self for a CPU tensor; for a CUDA tensor, its whole storage copied to the host, same layout
    /// (a contiguous view: its range, laid out from 0).
    fn host_view(&self) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(d) = &self.device {
            let g = self.storage();
            if let Storage::Cuda(c) = &*g {
                // A contiguous view brings its range alone (a parameter of the flat buffer).
                if let Some(r) = self.layout.contiguous_range().filter(|r| r.len() < c.len()) {
                    return Ok(Tensor {
                        storage: Arc::new(RwLock::new(Storage::Cpu(c.read_range(d, r)?))),
                        layout: Layout::contiguous(self.shape().clone()),
                        dtype: self.dtype,
                        device: Device::Cpu,
                    });
                }
                let cpu = c.to_cpu(d)?;
                return Ok(Tensor {
                    storage: Arc::new(RwLock::new(Storage::Cpu(cpu))),
                    layout: self.layout.clone(),
                    dtype: self.dtype,
                    device: Device::Cpu,
                });
            }
        }
        Ok(self.clone())
    }
}

/// The elements of a CPU tensor in row-major order, in fresh storage of the same dtype.
fn gather(t: &Tensor) -> Result<CpuStorage> {
    let g = t.storage();
    let Some(s) = g.as_cpu() else {
        return Err(Error::NotImplemented { op: "gather", device: t.device.name() });
    };
    if let Some(r) = t.layout.contiguous_range() {
        if r.start == 0 && r.end == s.len() {
            return Ok(s.clone());
        }
    }
    let idx: Vec<usize> = t.layout.storage_indices().collect();
    Ok(match s {
        CpuStorage::U32(v) => CpuStorage::U32(idx.iter().map(|&i| v[i]).collect()),
        _ => CpuStorage::from_f32(&s.gather_f32(idx.into_iter()), t.dtype),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strided_copies_move_exactly_the_view() {
        // Columns 1..3 of rows 1..3 of a [2, 4, 5] into columns 2..4 of a [2, 2, 6] of -1s.
        let src = Tensor::from_vec((0..40).map(|i| i as f32).collect(), [2, 4, 5], &Device::Cpu).unwrap();
        let dst = Tensor::from_vec(vec![-1f32; 24], [2, 2, 6], &Device::Cpu).unwrap();
        let s = src.narrow(1, 1..3).unwrap().narrow(2, 1..3).unwrap();
        dst.narrow(2, 2..4).unwrap().copy_from(&s).unwrap();
        let got = dst.to_vec_f32().unwrap();
        let mut want = vec![-1f32; 24];
        for (b, r, c) in (0..2).flat_map(|b| (0..2).flat_map(move |r| (0..2).map(move |c| (b, r, c)))) {
            want[b * 12 + r * 6 + 2 + c] = (b * 20 + (r + 1) * 5 + 1 + c) as f32;
        }
        assert_eq!(got, want);
        // The view's own elements, as `contiguous` gives them.
        assert_eq!(s.contiguous().unwrap().to_vec_f32().unwrap(), [6., 7., 11., 12., 26., 27., 31., 32.]);
        assert!(dst.narrow(2, 2..5).unwrap().copy_from(&s).is_err(), "shapes differ");
        assert!(src.narrow(1, 2..5).is_err(), "past the dimension");
    }

    #[test]
    fn from_vec_checks_length() {
        let e = Tensor::from_vec(vec![1f32, 2.0], [3], &Device::Cpu).unwrap_err();
        assert!(e.to_string().contains("Tensor::from_vec"), "{e}");
    }

    #[test]
    fn views_share_storage_and_see_updates() {
        let flat = Tensor::zeros([10], DType::F32, &Device::Cpu).unwrap();
        let a = flat.view(2, [2, 2]).unwrap();
        a.update_f32("test", |s| s.iter_mut().for_each(|x| *x = 1.0)).unwrap();
        assert_eq!(flat.to_vec_f32().unwrap(), vec![0., 0., 1., 1., 1., 1., 0., 0., 0., 0.]);
        assert!(flat.view(8, [3]).is_err());
        assert!(a.shares_storage(&flat));
    }

    #[test]
    fn copy_from_copies_bits_between_views_and_refuses_mismatches() {
        let src = Tensor::from_vec(vec![7u32, 8, 9, u32::MAX], [4], &Device::Cpu).unwrap();
        let flat = Tensor::zeros([6], DType::U32, &Device::Cpu).unwrap();
        flat.view(1, [2, 2]).unwrap().copy_from(&src).unwrap();
        assert_eq!(flat.to_vec::<u32>().unwrap(), vec![0, 7, 8, 9, u32::MAX, 0]);
        let e = flat.view(0, [3]).unwrap().copy_from(&src).unwrap_err().to_string();
        assert!(e.contains("copy_from"), "{e}");
        let f = Tensor::zeros([4], DType::F32, &Device::Cpu).unwrap();
        assert!(f.copy_from(&src).is_err(), "u32 into f32");
        assert!(flat.view(0, [4]).unwrap().copy_from(&flat.view(2, [4]).unwrap()).is_err(), "overlapping storage");
    }

    #[test]
    fn transpose_then_contiguous_moves_data() {
        let t = Tensor::from_vec((0..6).map(|i| i as f32).collect(), [2, 3], &Device::Cpu).unwrap();
        let tt = t.transpose(0, 1).unwrap();
        assert!(tt.reshape([6]).is_err());
        let c = tt.contiguous().unwrap();
        assert_eq!(c.to_vec_f32().unwrap(), vec![0., 3., 1., 4., 2., 5.]);
        assert!(!c.shares_storage(&t));
    }

    #[test]
    fn bf16_tensor_round_trips_and_updates_in_place() {
        let t = Tensor::from_f32(&[1.0, 2.5, -3.0], [3], DType::BF16, &Device::Cpu).unwrap();
        assert_eq!(t.dtype(), DType::BF16);
        t.update_f32("test", |s| s.iter_mut().for_each(|x| *x *= 2.0)).unwrap();
        assert_eq!(t.to_vec_f32().unwrap(), vec![2.0, 5.0, -6.0]);
        assert!(t.to_vec::<f32>().is_err());
        assert_eq!(t.to_vec::<crate::bf16>().unwrap()[0].to_f32(), 2.0);
    }

    #[test]
    fn narrow0_selects_rows() {
        let t = Tensor::from_vec((0..6u32).collect(), [3, 2], &Device::Cpu).unwrap();
        assert_eq!(t.narrow0(1..3).unwrap().to_vec::<u32>().unwrap(), vec![2, 3, 4, 5]);
        assert!(t.narrow0(2..4).is_err());
    }
}
