//! The typed layer spec: which norm, attention and MLP a transformer layer is built from.
//!
//! Megatron's ModuleSpec with Rust enums instead of import strings: every built-in choice is a
//! variant, checked when the model is built (`crate::config::TransformerConfig::validate`). The
//! escape hatch is `MlpSpec::Custom`: any `ModuleFactory` the user writes (see examples/). A hybrid
//! model (`Hybrid`) gives each layer a `LayerKind`, and its mixer layers a factory's module.

use ferrotron_core::{Module, ParamTableBuilder, Result};
pub use ferrotron_kernels::{RopeScaling, Yarn};
use ferrotron_parallel::TensorParallel;
use std::sync::Arc;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormKind {
    LayerNorm,
    RmsNorm,
}

/// A norm as a layer builds it (`TransformerConfig::norm_spec`): its kind and epsilon, and whether
/// its weight is zero-centred (scale 1 + w, w initialised to 0: Megatron's --apply-layernorm-1p).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NormSpec {
    pub kind: NormKind,
    pub eps: f64,
    pub zero_centred: bool,
}

impl NormSpec {
    /// A norm whose scale is its weight.
    pub fn plain(kind: NormKind, eps: f64) -> Self {
        NormSpec { kind, eps, zero_centred: false }
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum PositionEmbedding {
    /// Learned absolute positions added to the token embedding (GPT-2).
    LearnedAbsolute,
    /// Rotary embedding on q and k, with this base (Llama: 10000 or 500000), for Llama 3.1 and
    /// later its frequency scaling, the share of each head it rotates (Megatron's
    /// --rotary-percent: the first ⌊head_dim · percent⌋ features; 1.0 for whole heads), and
    /// linear position interpolation (--rotary-seq-len-interpolation-factor: positions divided by
    /// it; None for none), and whether pairs are adjacent features (--rotary-interleaved) rather
    /// than a head's two halves.
    Rope { base: f64, scaling: Option<RopeScaling>, percent: f64, interpolation: Option<f64>, interleaved: bool },
    /// No position information (NoPE).
    None,
}

impl PositionEmbedding {
    /// Rotary embedding at `base` over whole heads: no scaling or interpolation, rotate-half.
    pub fn rope(base: f64) -> Self {
        PositionEmbedding::Rope { base, scaling: None, percent: 1.0, interpolation: None, interleaved: false }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// GeLU (tanh approximation) on a [C → F] projection.
    Gelu,
    /// SiLU-gated linear unit on a [C → 2F] projection.
    SwiGlu,
    /// Squared ReLU, max(x, 0)², on a [C → F] projection (Primer's; Megatron's --squared-relu,
    /// Nemotron-H's MLPs).
    SquaredRelu,
    /// x·σ(1.702·x) on a [C → F] projection: CLIP's vision MLPs (Megatron's quick_gelu).
    QuickGelu,
    /// Exact GeLU, x·Φ(x) (erf), on a [C → F] projection: PyTorch's `F.gelu`, LLaVA's vision
    /// projection (`Gelu` is the tanh approximation).
    GeluExact,
    /// gpt-oss's gated quick GeLU on a [C → 2F] projection (gate | linear):
    /// qgelu(min(gate, c))·(clamp(linear, −c, c) + offset) (Megatron's --quick-geglu,
    /// --glu-linear-offset, --activation-func-clamp-value).
    QuickGeGlu(GluParams),
}

/// A gated linear unit's extras (Megatron's glu_linear_offset, activation_func_clamp_value).
#[derive(Clone, Copy, Debug, Default)]
pub struct GluParams {
    /// Added to the linear half before gating (0: none).
    pub offset: f64,
    /// Both halves clamped: the gate from above, the linear half to [−c, c]; None: unclamped.
    pub clamp: Option<f64>,
}

/// Equal by value, bit for bit (the floats are flags' values, never NaN).
impl PartialEq for GluParams {
    fn eq(&self, o: &Self) -> bool {
        self.offset.to_bits() == o.offset.to_bits() && self.clamp.map(f64::to_bits) == o.clamp.map(f64::to_bits)
    }
}
impl Eq for GluParams {}

impl Activation {
    /// Blocks in fc1's output: 2 (gate | value) for SwiGLU, 1 for the others.
    pub fn fc1_blocks(self) -> usize {
        match self {
            Activation::SwiGlu | Activation::QuickGeGlu(_) => 2,
            Activation::Gelu | Activation::SquaredRelu | Activation::QuickGelu | Activation::GeluExact => 1,
        }
    }
}

/// Self-attention choices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionSpec {
    /// Biases on the QKV and output projections.
    pub bias: bool,
    /// A bias on the QKV projection even without `bias` (Megatron's --add-qkv-bias; Qwen2).
    pub qkv_bias: bool,
    pub qk_layernorm: bool,
    /// Llama 4's parameter-free L2 norm over each query and key head where QK-norm would be
    /// (Megatron's --qk-l2-norm; not with `qk_layernorm`).
    pub qk_l2_norm: bool,
    /// A sigmoid gate on each head's output, o·σ(gate), the gate projected beside the queries
    /// (Megatron's --attention-output-gate, Qwen3-Next's gated attention): the QKV projection's
    /// groups are [queries | gates | key | value].
    pub output_gate: bool,
    /// The softmax over each row's keys: plain, or with a sink logit a head (Megatron's
    /// --softmax-type).
    pub softmax: SoftmaxType,
    /// Sliding window in tokens (Mistral style); None = the whole (causal) context.
    pub window: Option<usize>,
    /// Causal (a language model's); false lets every position see every other (a vision
    /// encoder's: Megatron's AttnMaskType.no_mask).
    pub causal: bool,
    /// Multi-latent attention's sizes (Megatron's --multi-latent-attention), or None: the
    /// grouped-query attention of the fields above.
    pub mla: Option<crate::mla::MlaSpec>,
}

/// The attention's softmax (Megatron's --softmax-type): plain, or with one more logit a head in
/// every row, a key with no value, so that a row's probabilities may sum to less than one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum SoftmaxType {
    #[default]
    Vanilla,
    /// The extra logit is 0 (the denominator's "+1" of "attention is off by one").
    OffByOne,
    /// The extra logit is learned per head (`core_attention.softmax_offset`; gpt-oss's attention
    /// sinks).
    Learnable,
}

impl SoftmaxType {
    /// Its --softmax-type value.
    pub fn flag(self) -> &'static str {
        match self {
            SoftmaxType::Vanilla => "vanilla",
            SoftmaxType::OffByOne => "off-by-one",
            SoftmaxType::Learnable => "learnable",
        }
    }
}

/// What a `ModuleFactory` builds one module from.
pub struct FactoryCx<'a> {
    /// The module's parameter-name prefix (e.g. `decoder.layers.3.mlp`).
    pub prefix: &'a str,
    /// The layer's width: the module maps [B, T, hidden] to [B, T, hidden].
    pub hidden: usize,
    /// Init std of input-side weights, and of output-side ones (scaled by the depth, Megatron's
    /// output_layer_init_method).
    pub std: f32,
    pub out_std: f32,
    /// The tensor-parallel group the layer runs on (size 1 unless `validate_tp` accepts more).
    pub tp: &'a TensorParallel,
}

/// Parameter counts of one module built by a factory, for `TransformerConfig::num_params` and
/// the model FLOPs: all of them, and those one token runs through (fewer for mixture-of-experts).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ParamCount {
    pub total: usize,
    pub active: usize,
}

/// Builds a module in place of a built-in one: a user's module (see examples/), or one from a
/// crate above this one (ferrotron-moe's MoE layer).
pub trait ModuleFactory: Send + Sync + std::fmt::Debug {
    fn build(&self, cx: &FactoryCx, params: &mut ParamTableBuilder) -> Result<Box<dyn Module>>;

    /// The parameters one module has, or None when unknown (then counted as a dense MLP's).
    fn param_count(&self, hidden: usize) -> Option<ParamCount> {
        let _ = hidden;
        None
    }

    /// FLOPs per token of one forward + backward beyond 6 × its parameters (a sequence mixer's
    /// scan), at sequence length `seq`; counted in the model FLOPs (MFU).
    fn flops_per_token(&self, hidden: usize, seq: usize) -> f64 {
        let _ = (hidden, seq);
        0.0
    }

    /// Whether the module can run at tensor-parallel size `tp`; the error names the fix.
    fn validate_tp(&self, tp: usize) -> std::result::Result<(), String> {
        if tp > 1 {
            return Err(format!(
                "a custom MLP module is not tensor-parallel: use --tensor-model-parallel-size 1 (got {tp})"
            ));
        }
        Ok(())
    }

    /// Whether the module runs under context parallelism over `cp` ranks (its input a rank's two
    /// chunks of each sequence, `ContextParallel`); the error names the fix. A module that works
    /// token by token (an MLP, MoE) runs under any; one that mixes positions must say.
    fn validate_cp(&self, cp: usize) -> std::result::Result<(), String> {
        let _ = cp;
        Ok(())
    }

    /// The factory as `Any`, for code that recognises a factory type of its own (the trainer
    /// mapping an MoE spec back to its flags).
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        None
    }
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
    /// Every norm of the model (the layers', QK-norm, the final one, MTP's) scales by 1 + w with w
    /// initialised to 0 (Megatron's --apply-layernorm-1p; Gemma's and Nemotron's norms).
    pub zero_centred_gamma: bool,
    pub attention: AttentionSpec,
    pub mlp: MlpSpec,
    /// Layers that take another MLP than `mlp` (None: every layer takes `mlp`). Megatron's
    /// --moe-layer-freq: dense layers among mixture-of-experts ones.
    pub other_mlp: Option<OtherMlp>,
    /// A hybrid model's layers (None: every layer attention then MLP).
    pub hybrid: Option<Hybrid>,
    /// Per layer whether `attention.window` applies (Megatron's --window-attn-skip-freq: full
    /// attention in the layers where false); None: in every layer.
    pub window_layers: Option<Vec<bool>>,
}

/// What one layer holds: a character of Megatron's hybrid layer pattern
/// (`--hybrid-layer-pattern`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerKind {
    /// Attention, then the MLP: every layer of a plain transformer.
    Transformer,
    /// `*`: attention alone.
    Attention,
    /// `-` and `E`: the MLP alone (`E` where `LayerSpec::mlp_of` gives the mixture of experts).
    Mlp,
    /// `M`: the sequence mixer alone (`Hybrid::mixer`, ferrotron-ssm's Mamba-2), after a norm
    /// named `norm`.
    Mixer,
}

/// `LayerSpec::hybrid`: each layer's kind, and the module a `Mixer` layer holds.
#[derive(Clone, Debug)]
pub struct Hybrid {
    pub kinds: Vec<LayerKind>,
    pub mixer: Option<Arc<dyn ModuleFactory>>,
}

/// `LayerSpec::other_mlp`: the MLP, and per layer whether it takes it.
#[derive(Clone, Debug)]
pub struct OtherMlp {
    pub mlp: MlpSpec,
    pub layers: Vec<bool>,
}

impl LayerSpec {
    /// What layer `i` (0-based, over the whole model) holds.
    pub fn kind_of(&self, i: usize) -> LayerKind {
        self.hybrid.as_ref().and_then(|h| h.kinds.get(i).copied()).unwrap_or(LayerKind::Transformer)
    }

    /// The attention of layer `i` (0-based, over the whole model): `attention`, without its
    /// window where `window_layers` says the layer attends to the whole context.
    pub fn attention_of(&self, i: usize) -> AttentionSpec {
        let windowed = self.window_layers.as_ref().is_none_or(|w| w.get(i).copied().unwrap_or(true));
        AttentionSpec { window: self.attention.window.filter(|_| windowed), ..self.attention }
    }

    /// The MLP of layer `i` (0-based, over the whole model).
    pub fn mlp_of(&self, i: usize) -> &MlpSpec {
        match &self.other_mlp {
            Some(o) if o.layers.get(i).copied().unwrap_or(false) => &o.mlp,
            _ => &self.mlp,
        }
    }
}
