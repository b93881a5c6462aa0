//! Input validation shared by every op: dtype, device and shape checks that turn bad input into
//! typed errors naming the op, and output construction.

use ferrotron_core::{DType, Device, Error, Result, Shape, Tensor, shape_mismatch};

pub(crate) fn float(op: &'static str, t: &Tensor) -> Result<()> {
    if t.dtype().is_float() {
        Ok(())
    } else {
        Err(Error::DTypeMismatch { op, expected: "a float dtype".into(), got: t.dtype() })
    }
}

pub(crate) fn dtype(op: &'static str, t: &Tensor, want: DType) -> Result<()> {
    if t.dtype() == want {
        Ok(())
    } else {
        Err(Error::DTypeMismatch { op, expected: want.to_string(), got: t.dtype() })
    }
}

pub(crate) fn same_dtype(op: &'static str, a: &Tensor, b: &Tensor) -> Result<()> {
    dtype(op, b, a.dtype())
}

pub(crate) fn shape(op: &'static str, t: &Tensor, want: &[usize]) -> Result<()> {
    if t.dims() == want { Ok(()) } else { Err(shape_mismatch(op, want, t.dims())) }
}

pub(crate) fn rank(op: &'static str, t: &Tensor, r: usize) -> Result<()> {
    if t.shape().rank() == r { Ok(()) } else { Err(shape_mismatch(op, format!("rank {r}"), t.dims())) }
}

/// Every tensor on the CPU (the only backend so far); a CUDA tensor gets `NotImplemented` and mixed
/// devices get `DeviceMismatch`.
pub(crate) fn on_cpu(op: &'static str, ts: &[&Tensor]) -> Result<()> {
    for t in ts {
        if !t.device().same(ts[0].device()) {
            return Err(Error::DeviceMismatch { op, a: ts[0].device().name(), b: t.device().name() });
        }
        if !t.device().is_cpu() {
            return Err(Error::NotImplemented { op, device: t.device().name() });
        }
    }
    Ok(())
}

/// A new tensor of `dtype` from f32 results; f32 results are moved in, not copied.
pub(crate) fn out(data: Vec<f32>, shape: impl Into<Shape>, dtype: DType, device: &Device) -> Result<Tensor> {
    if dtype == DType::F32 && device.is_cpu() {
        return Tensor::from_vec(data, shape, device);
    }
    Tensor::from_f32(&data, shape, dtype, device)
}

thread_local! {
    static IDS_PRECHECKED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether this thread's callers have checked the token ids of device tensors already (off by
/// default). Checking ids held on a GPU means reading them back, which waits for everything queued
/// before: the trainer checks each batch on the host before uploading it and turns this on, so a
/// step never waits on such a read. The CUDA kernels stay within bounds either way (an id outside
/// the table reads a zero row and adds no gradient; a target outside the vocabulary counts as
/// another shard's).
pub fn set_device_ids_prechecked(on: bool) {
    IDS_PRECHECKED.with(|p| p.set(on));
}

/// Whether the ids of a device tensor are to be read back and checked (unless the caller has).
#[cfg(feature = "cuda")]
pub(crate) fn read_ids(t: &Tensor) -> bool {
    t.device().is_cpu() || !IDS_PRECHECKED.with(|p| p.get())
}

/// Token ids as u32, each checked against `bound`.
pub(crate) fn ids(op: &'static str, t: &Tensor, bound: usize, what: &'static str) -> Result<Vec<u32>> {
    dtype(op, t, DType::U32)?;
    let v = t.to_vec::<u32>()?;
    if let Some(&bad) = v.iter().find(|&&i| i as usize >= bound) {
        return Err(Error::IndexOutOfRange { op, what, index: bad as u64, bound: bound as u64 });
    }
    Ok(v)
}
