//! The typed layer spec: which norm, attention and MLP a transformer layer is built from.
//!
//! Megatron's ModuleSpec with Rust enums instead of import strings: every built-in choice is a
//! variant, checked when the model is built (`crate::config::TransformerConfig::validate`). The
//! escape hatch is `MlpSpec::Custom`: any `ModuleFactory` the user writes (see examples/).

use ferrotron_core::{Module, ParamTableBuilder, Result};
pub use ferrotron_kernels::RopeScaling;
use std::sync::Arc;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormKind {
    LayerNorm,
    RmsNorm,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum PositionEmbedding {
    /// Learned absolute positions added to the token embedding (GPT-2).
    LearnedAbsolute,
    /// Rotary embedding on q and k, with this base (Llama: 10000 or 500000) and, for Llama 3.1
    /// and later, its frequency scaling.
    Rope { base: f64, scaling: Option<RopeScaling> },
    /// No position information (NoPE).
    None,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// GeLU (tanh approximation) on a [C → F] projection.
    Gelu,
    /// SiLU-gated linear unit on a [C → 2F] projection.
    SwiGlu,
}

/// Self-attention choices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionSpec {
    /// Biases on the QKV and output projections.
    pub bias: bool,
    /// A bias on the QKV projection even without `bias` (Megatron's --add-qkv-bias; Qwen2).
    pub qkv_bias: bool,
    pub qk_layernorm: bool,
    /// Sliding window in tokens (Mistral style); None = full causal.
    pub window: Option<usize>,
}

/// Builds a user-defined module in place of a built-in one.
pub trait ModuleFactory: Send + Sync + std::fmt::Debug {
    /// `prefix` is the module's parameter-name prefix (e.g. `decoder.layers.3.mlp`); the module maps
    /// [B, T, hidden] to [B, T, hidden].
    fn build(&self, prefix: &str, hidden: usize, params: &mut ParamTableBuilder) -> Result<Box<dyn Module>>;
}

#[derive(Clone, Debug)]
pub enum MlpSpec {
    Dense { activation: Activation, bias: bool },
    Custom(Arc<dyn ModuleFactory>),
}

/// One transformer layer: pre-norm attention and MLP with residuals.
#[derive(Clone, Debug)]
pub struct LayerSpec {
    pub norm: NormKind,
    pub attention: AttentionSpec,
    pub mlp: MlpSpec,
}
