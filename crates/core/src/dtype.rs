//! Element types. Math on CPU is f32; narrower types are storage formats converted at the edges.

use float8::{F8E4M3, F8E5M2};
use half::{bf16, f16};

/// The element type of a tensor's storage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    BF16,
    F16,
    /// FP8 with 4 exponent / 3 mantissa bits (forward activations and weights).
    F8E4M3,
    /// FP8 with 5 exponent / 2 mantissa bits (gradients).
    F8E5M2,
    /// Token ids and other indices.
    U32,
}

impl DType {
    pub const ALL: [DType; 6] = [DType::F32, DType::BF16, DType::F16, DType::F8E4M3, DType::F8E5M2, DType::U32];

    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 | DType::U32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::F8E4M3 | DType::F8E5M2 => 1,
        }
    }

    pub fn is_float(self) -> bool {
        !matches!(self, DType::U32)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::F8E4M3 => "f8e4m3",
            DType::F8E5M2 => "f8e5m2",
            DType::U32 => "u32",
        }
    }

    /// Parses the names `as_str` prints (and the usual aliases `float32`, `bfloat16`, `float16`).
    pub fn parse(s: &str) -> Option<DType> {
        Some(match s.to_ascii_lowercase().as_str() {
            "f32" | "fp32" | "float32" => DType::F32,
            "bf16" | "bfloat16" => DType::BF16,
            "f16" | "fp16" | "float16" => DType::F16,
            "f8e4m3" | "fp8e4m3" | "e4m3" => DType::F8E4M3,
            "f8e5m2" | "fp8e5m2" | "e5m2" => DType::F8E5M2,
            "u32" | "uint32" => DType::U32,
            _ => return None,
        })
    }
}

/// Megatron's `--fp8-format`: which FP8 type each operand of a linear layer's products takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fp8Format {
    /// E4M3 everywhere.
    E4M3,
    /// E4M3 forward (inputs, weights), E5M2 for gradients (their wider range).
    Hybrid,
}

impl Fp8Format {
    /// Parses Megatron's names (`e4m3`, `hybrid`).
    pub fn parse(s: &str) -> Option<Fp8Format> {
        match s {
            "e4m3" => Some(Fp8Format::E4M3),
            "hybrid" => Some(Fp8Format::Hybrid),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Fp8Format::E4M3 => "e4m3",
            Fp8Format::Hybrid => "hybrid",
        }
    }

    /// The type of inputs and weights.
    pub fn forward(self) -> DType {
        DType::F8E4M3
    }

    /// The type of output gradients.
    pub fn gradient(self) -> DType {
        match self {
            Fp8Format::E4M3 => DType::F8E4M3,
            Fp8Format::Hybrid => DType::F8E5M2,
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A Rust scalar type that can be the element of a tensor's storage.
pub trait WithDType: Copy + Send + Sync + 'static + bytemuck::Pod {
    const DTYPE: DType;
    fn to_f32(self) -> f32;
    fn from_f32(v: f32) -> Self;
    /// The host storage variant holding `v`, without copying.
    fn into_storage(v: Vec<Self>) -> crate::CpuStorage;
}

macro_rules! with_dtype {
    ($t:ty, $d:ident, |$a:ident| $to:expr, |$b:ident| $from:expr) => {
        impl WithDType for $t {
            const DTYPE: DType = DType::$d;
            #[inline]
            fn to_f32(self) -> f32 {
                let $a = self;
                $to
            }
            #[inline]
            fn from_f32(v: f32) -> Self {
                let $b = v;
                $from
            }
            fn into_storage(v: Vec<Self>) -> crate::CpuStorage {
                crate::CpuStorage::$d(v)
            }
        }
    };
}

with_dtype!(f32, F32, |x| x, |v| v);
with_dtype!(bf16, BF16, |x| x.to_f32(), |v| bf16::from_f32(v));
with_dtype!(f16, F16, |x| x.to_f32(), |v| f16::from_f32(v));
// Widen through f16's non-const path: float8's own `to_f32` (via half's const fallback) hangs when
// inlined at opt-level 3 (seen with float8 0.7 / half 2.7 / rustc 1.95).
with_dtype!(F8E4M3, F8E4M3, |x| x.to_f16().to_f32(), |v| F8E4M3::from_f32(v));
with_dtype!(F8E5M2, F8E5M2, |x| x.to_f16().to_f32(), |v| F8E5M2::from_f32(v));
// Indices convert exactly up to 2^24, far above any vocabulary.
with_dtype!(u32, U32, |x| x as f32, |v| v as u32);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for d in DType::ALL {
            assert_eq!(DType::parse(d.as_str()), Some(d));
        }
        assert_eq!(DType::parse("bfloat16"), Some(DType::BF16));
        assert_eq!(DType::parse("f64"), None);
    }

    #[test]
    fn sizes_match_rust_types() {
        assert_eq!(DType::F32.size_in_bytes(), std::mem::size_of::<f32>());
        assert_eq!(DType::BF16.size_in_bytes(), std::mem::size_of::<bf16>());
        assert_eq!(DType::F8E4M3.size_in_bytes(), std::mem::size_of::<F8E4M3>());
        assert_eq!(DType::U32.size_in_bytes(), std::mem::size_of::<u32>());
    }

    #[test]
    fn fp8_saturates_and_rounds() {
        // e4m3 saturates at 448, e5m2 at 57344; both hold small integers exactly.
        let bb = std::hint::black_box;
        assert_eq!(<F8E4M3 as WithDType>::from_f32(bb(3.0)).to_f32(), 3.0);
        assert_eq!(<F8E5M2 as WithDType>::from_f32(bb(-2.0)).to_f32(), -2.0);
        assert_eq!(WithDType::to_f32(<F8E4M3 as WithDType>::from_f32(bb(1000.0))), 448.0);
        assert_eq!(WithDType::to_f32(<F8E5M2 as WithDType>::from_f32(bb(1e6))), 57344.0);
    }
}
