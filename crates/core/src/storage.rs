//! Backing memory of tensors: typed host vectors, or device allocations behind the `cuda` feature.

use crate::{DType, Error, Result, WithDType};
use float8::{F8E4M3, F8E5M2};
use half::{bf16, f16};
use rayon::prelude::*;

/// Host memory, one variant per dtype so that no byte reinterpretation is ever needed.
#[derive(Clone, Debug, PartialEq)]
pub enum CpuStorage {
    F32(Vec<f32>),
    BF16(Vec<bf16>),
    F16(Vec<f16>),
    F8E4M3(Vec<F8E4M3>),
    F8E5M2(Vec<F8E5M2>),
    U32(Vec<u32>),
}

/// Elements from which a conversion is split over threads (and the pieces' length).
const PAR_MIN: usize = 1 << 16;

/// Applies `$body` to the typed vector inside a `CpuStorage`, whatever its dtype.
macro_rules! match_cpu {
    ($s:expr, |$v:ident| $body:expr) => {
        match $s {
            CpuStorage::F32($v) => $body,
            CpuStorage::BF16($v) => $body,
            CpuStorage::F16($v) => $body,
            CpuStorage::F8E4M3($v) => $body,
            CpuStorage::F8E5M2($v) => $body,
            CpuStorage::U32($v) => $body,
        }
    };
}

impl CpuStorage {
    pub fn zeros(dtype: DType, n: usize) -> Self {
        match dtype {
            DType::F32 => CpuStorage::F32(vec![0.0; n]),
            DType::BF16 => CpuStorage::BF16(vec![bf16::ZERO; n]),
            DType::F16 => CpuStorage::F16(vec![f16::ZERO; n]),
            DType::F8E4M3 => CpuStorage::F8E4M3(vec![F8E4M3::ZERO; n]),
            DType::F8E5M2 => CpuStorage::F8E5M2(vec![F8E5M2::ZERO; n]),
            DType::U32 => CpuStorage::U32(vec![0; n]),
        }
    }

    /// Takes ownership of `v` (no copy).
    pub fn from_vec<T: WithDType>(v: Vec<T>) -> Self {
        T::into_storage(v)
    }

    /// Converts f32 values into storage of `dtype` (rounding to nearest even for narrow floats).
    pub fn from_f32(v: &[f32], dtype: DType) -> Self {
        fn conv<T: WithDType>(v: &[f32]) -> Vec<T> {
            v.iter().map(|&x| T::from_f32(x)).collect()
        }
        match dtype {
            DType::F32 => CpuStorage::F32(v.to_vec()),
            DType::BF16 => CpuStorage::BF16(conv(v)),
            DType::F16 => CpuStorage::F16(conv(v)),
            DType::F8E4M3 => CpuStorage::F8E4M3(conv(v)),
            DType::F8E5M2 => CpuStorage::F8E5M2(conv(v)),
            DType::U32 => CpuStorage::U32(conv(v)),
        }
    }

    pub fn dtype(&self) -> DType {
        match self {
            CpuStorage::F32(_) => DType::F32,
            CpuStorage::BF16(_) => DType::BF16,
            CpuStorage::F16(_) => DType::F16,
            CpuStorage::F8E4M3(_) => DType::F8E4M3,
            CpuStorage::F8E5M2(_) => DType::F8E5M2,
            CpuStorage::U32(_) => DType::U32,
        }
    }

    pub fn len(&self) -> usize {
        match_cpu!(self, |v| v.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The typed slice when `T` is this storage's element type.
    pub fn as_slice<T: WithDType>(&self) -> Result<&[T]> {
        if T::DTYPE != self.dtype() {
            return Err(Error::DTypeMismatch { op: "as_slice", expected: T::DTYPE.to_string(), got: self.dtype() });
        }
        Ok(match_cpu!(self, |v| bytemuck::cast_slice(v.as_slice())))
    }

    pub fn as_mut_slice<T: WithDType>(&mut self) -> Result<&mut [T]> {
        let d = self.dtype();
        if T::DTYPE != d {
            return Err(Error::DTypeMismatch { op: "as_mut_slice", expected: T::DTYPE.to_string(), got: d });
        }
        Ok(match_cpu!(self, |v| bytemuck::cast_slice_mut(v.as_mut_slice())))
    }

    /// The raw little-endian bytes of elements `range`.
    pub fn bytes(&self, range: std::ops::Range<usize>) -> &[u8] {
        match_cpu!(self, |v| bytemuck::cast_slice(&v[range]))
    }

    /// Storage of `dtype` from raw bytes (a whole number of elements).
    pub fn from_bytes(dtype: DType, b: &[u8]) -> Result<Self> {
        let n = dtype.size_in_bytes();
        if b.len() % n != 0 {
            return Err(Error::InvalidArgument {
                op: "from_bytes",
                msg: format!("{} bytes are not a whole number of {dtype} elements", b.len()),
            });
        }
        let mut s = CpuStorage::zeros(dtype, b.len() / n);
        match_cpu!(&mut s, |v| bytemuck::cast_slice_mut::<_, u8>(v.as_mut_slice()).copy_from_slice(b));
        Ok(s)
    }

    /// Element `i` widened to f32.
    #[inline]
    pub fn get_f32(&self, i: usize) -> f32 {
        match_cpu!(self, |v| v[i].to_f32())
    }

    /// Elements `idx` widened to f32.
    pub fn gather_f32(&self, idx: impl Iterator<Item = usize>) -> Vec<f32> {
        match_cpu!(self, |v| idx.map(|i| v[i].to_f32()).collect())
    }

    /// Elements `r` widened to f32 (threads share a long range: a bf16 parameter buffer's).
    pub fn range_f32(&self, r: std::ops::Range<usize>) -> Vec<f32> {
        match_cpu!(self, |v| {
            let v = &v[r];
            if v.len() < PAR_MIN {
                v.iter().map(|x| x.to_f32()).collect()
            } else {
                v.par_iter().map(|x| x.to_f32()).collect()
            }
        })
    }

    /// Writes f32 values into `range`, narrowing to this storage's dtype (rounding each alone,
    /// so threads sharing a long range give the same bits).
    pub fn write_f32(&mut self, start: usize, src: &[f32]) {
        match_cpu!(self, |v| {
            let dst = &mut v[start..start + src.len()];
            let narrow = |d: &mut [_], s: &[f32]| d.iter_mut().zip(s).for_each(|(d, &s)| *d = WithDType::from_f32(s));
            if src.len() < PAR_MIN {
                narrow(dst, src);
            } else {
                dst.par_chunks_mut(PAR_MIN).zip(src.par_chunks(PAR_MIN)).for_each(|(d, s)| narrow(d, s));
            }
        })
    }
}

/// All of a storage's elements as mutable raw bytes.
pub(crate) fn bytes_mut(s: &mut CpuStorage) -> &mut [u8] {
    match_cpu!(s, |v| bytemuck::cast_slice_mut(v.as_mut_slice()))
}

/// Where a tensor's bytes live.
#[derive(Debug)]
pub enum Storage {
    Cpu(CpuStorage),
    #[cfg(feature = "cuda")]
    Cuda(crate::cuda::CudaStorage),
}

impl Storage {
    pub fn as_cpu(&self) -> Option<&CpuStorage> {
        match self {
            Storage::Cpu(s) => Some(s),
            #[cfg(feature = "cuda")]
            Storage::Cuda(_) => None,
        }
    }

    pub fn as_cpu_mut(&mut self) -> Option<&mut CpuStorage> {
        match self {
            Storage::Cpu(s) => Some(s),
            #[cfg(feature = "cuda")]
            Storage::Cuda(_) => None,
        }
    }

    pub fn dtype(&self) -> DType {
        match self {
            Storage::Cpu(s) => s.dtype(),
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => s.dtype(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_round_trip_is_exact_for_representable_values() {
        let vals: Vec<f32> = (-64..64).map(|i| i as f32 * 0.125).collect();
        let s = CpuStorage::from_f32(&vals, DType::BF16);
        let back = s.gather_f32(0..s.len());
        assert_eq!(back, vals);
    }

    #[test]
    fn bf16_rounding_error_is_bounded() {
        let vals: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.731).sin() * 37.0).collect();
        let s = CpuStorage::from_f32(&vals, DType::BF16);
        for (i, &v) in vals.iter().enumerate() {
            let r = s.get_f32(i);
            assert!((r - v).abs() <= v.abs() * 2f32.powi(-8), "{v} -> {r}");
        }
    }

    #[test]
    fn typed_slice_checks_dtype() {
        let s = CpuStorage::from_vec(vec![1u32, 2, 3]);
        assert_eq!(s.as_slice::<u32>().unwrap(), &[1, 2, 3]);
        assert!(s.as_slice::<f32>().is_err());
    }
}
