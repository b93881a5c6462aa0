//! Typed errors of the core crate; every layer above wraps or reuses them.

use crate::{DType, Shape};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{op}: shape mismatch: expected {expected}, got {got}")]
    ShapeMismatch { op: &'static str, expected: String, got: String },
    #[error("{op}: dtype mismatch: expected {expected}, got {got}")]
    DTypeMismatch { op: &'static str, expected: String, got: DType },
    #[error("{op}: index {index} out of range for {what} of size {bound}")]
    IndexOutOfRange { op: &'static str, what: &'static str, index: u64, bound: u64 },
    #[error("dimension {dim} out of range for shape {shape}")]
    DimOutOfRange { dim: isize, shape: Shape },
    #[error("{op}: invalid argument: {msg}")]
    InvalidArgument { op: &'static str, msg: String },
    #[error("{op}: tensors live on different devices ({a} and {b}); move one with Tensor::to_device")]
    DeviceMismatch { op: &'static str, a: String, b: String },
    #[error("{op} is not implemented on {device} yet")]
    NotImplemented { op: &'static str, device: String },
    #[error("{op}: needs a contiguous tensor; call Tensor::contiguous first")]
    NotContiguous { op: &'static str },
    #[error("device {device} requested but this build has no CUDA support: rebuild with `--features cuda`")]
    CudaNotBuilt { device: String },
    #[error("CUDA error: {0}")]
    Cuda(String),
    /// A failure from a layer above core (e.g. a collective inside a tensor-parallel module's
    /// forward), kept whole so callers can downcast it.
    #[error(transparent)]
    External(Box<dyn std::error::Error + Send + Sync>),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Shorthand for the common "shape A vs shape B" mismatch.
pub fn shape_mismatch(op: &'static str, expected: impl std::fmt::Debug, got: impl std::fmt::Debug) -> Error {
    Error::ShapeMismatch { op, expected: format!("{expected:?}"), got: format!("{got:?}") }
}

/// Shorthand for `InvalidArgument`.
pub fn invalid(op: &'static str, msg: impl Into<String>) -> Error {
    Error::InvalidArgument { op, msg: msg.into() }
}
