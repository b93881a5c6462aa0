//! ferrotron-core: the vocabulary every other Ferrotron crate speaks.
//!
//! Dtypes (f32, bf16, f16, fp8 e4m3/e5m2, u32 ids), shapes and strided layouts, a `Tensor` over CPU
//! or CUDA storage, the `Device` it lives on, typed errors, the `Module` trait and the parameter
//! table (every layer above implements and uses them), and a counter-based Philox RNG whose
//! output is a pure function of (seed, stream, offset) so that results never depend on thread count,
//! rank count or call order.
//!
//! Why one small crate at the bottom: kernels, communication, parallel layers and models all pass
//! tensors and errors across their boundaries, and none of them may depend on each other's internals.
//! This crate knows nothing of ops beyond copies and casts; the math lives in ferrotron-kernels.

#[cfg(feature = "cuda")]
pub mod cuda;
mod device;
mod dtype;
mod error;
mod fp8;
pub mod gpu_trace;
mod module;
mod params;
mod pin;
pub mod rng;
mod shape;
#[cfg(feature = "cuda")]
mod staging;
mod storage;
mod tensor;

pub use device::{Device, Graph, MemoryStats};
pub use dtype::{DType, Fp8Format, WithDType};
pub use error::{Error, Result, invalid, shape_mismatch};
pub use float8::{F8E4M3, F8E5M2};
pub use fp8::{AmaxAlgo, AmaxReduce, DelayedScaling, Fp8Linear, Fp8Metas, Fp8Recipe, Fp8Slot, MetaTensors};
pub use half::{bf16, f16};
pub use module::{Cx, Draw, Module, Saved};
pub use params::{Blocks, Init, ParamId, ParamMeta, ParamTable, ParamTableBuilder, PendingParams, Shard};
pub use pin::HostPin;
pub use shape::{Layout, Shape};
pub use storage::{CpuStorage, Storage};
pub use tensor::{F32Read, Tensor};
