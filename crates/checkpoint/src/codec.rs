//! f32 values to and from safetensors' little-endian f32, bf16 and f16 bytes.

use crate::{CheckpointError, Result};
use ferrotron_core::{DType, bf16};
use safetensors::Dtype;
use std::borrow::Cow;

/// `v` as `dtype`'s bytes (rounded to nearest even for bf16 and f16), and safetensors' name for it.
pub fn encode<'a>(key: &str, dtype: DType, v: &'a [f32]) -> Result<(Cow<'a, [u8]>, Dtype)> {
    let st = stored_dtype(key, dtype)?;
    Ok((encode_as(st, v), st))
}

/// safetensors' name for a dtype values can be stored in.
pub(crate) fn stored_dtype(key: &str, dtype: DType) -> Result<Dtype> {
    match dtype {
        DType::F32 => Ok(Dtype::F32),
        DType::BF16 => Ok(Dtype::BF16),
        DType::F16 => Ok(Dtype::F16),
        d => Err(CheckpointError::Dtype { key: key.to_string(), dtype: d.to_string() }),
    }
}

/// `v` as little-endian bytes of `st` (one of `stored_dtype`'s).
pub(crate) fn encode_as(st: Dtype, v: &[f32]) -> Cow<'_, [u8]> {
    match st {
        Dtype::F32 if cfg!(target_endian = "little") => Cow::Borrowed(bytemuck::cast_slice(v)),
        Dtype::BF16 => Cow::Owned(v.iter().flat_map(|&x| bf16::from_f32(x).to_bits().to_le_bytes()).collect()),
        Dtype::F16 => Cow::Owned(v.iter().flat_map(|&x| half::f16::from_f32(x).to_bits().to_le_bytes()).collect()),
        _ => Cow::Owned(v.iter().flat_map(|x| x.to_le_bytes()).collect()),
    }
}

/// Bytes of safetensors dtype `dtype` appended to `out` as f32 values; None for other dtypes.
pub fn decode(dtype: Dtype, bytes: &[u8], out: &mut Vec<f32>) -> Option<()> {
    match dtype {
        Dtype::F32 => out.extend(bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))),
        Dtype::BF16 => {
            out.extend(bytes.chunks_exact(2).map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32()))
        }
        Dtype::F16 => {
            out.extend(bytes.chunks_exact(2).map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32()))
        }
        _ => return None,
    }
    Some(())
}

pub(crate) fn width(dtype: Dtype) -> Option<usize> {
    match dtype {
        Dtype::F32 => Some(4),
        Dtype::BF16 | Dtype::F16 => Some(2),
        _ => None,
    }
}
