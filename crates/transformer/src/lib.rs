//! ferrotron-transformer: transformer layers with explicit forward and backward, the typed layer
//! spec, and the GPT model built from it.
//!
//! Every layer implements `ferrotron_core::Module`: forward returns (y, Saved), backward takes the
//! Saved back and returns dx while adding parameter gradients into main_grad. Parameters are
//! registered by name (Megatron's names) in a `ParamTableBuilder` when a layer is built, so the
//! optimizer, DDP and checkpoints see one table. Layers call only ferrotron-kernels ops, so the same
//! code runs on every device.

pub mod attention;
pub mod concat;
pub mod config;
pub mod dropout;
pub mod gpt;
pub mod layer;
pub mod linear;
pub mod mla;
pub mod mlp;
pub mod mtp;
pub mod norm;
pub mod recompute;
pub mod sink;
pub mod spec;
pub mod vision;

pub use config::TransformerConfig;
pub use gpt::{Batch, ChunkOut, GptModel, GptSaved, MicroLoss};
pub use mtp::MtpSpec;
pub use recompute::Recompute;
pub use vision::{Images, VisionModel, VisionSpec};

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("invalid model configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Core(ferrotron_core::Error),
}

pub type Result<T, E = ModelError> = std::result::Result<T, E>;
