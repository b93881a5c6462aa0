//! Hugging Face checkpoints: which transformers class a config is (`GPT2LMHeadModel`,
//! `LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM`, `MixtralForCausalLM`,
//! `Qwen2MoeForCausalLM`, `Qwen3ForCausalLM`, `Qwen3MoeForCausalLM`, `DeepseekV3ForCausalLM`), its
//! config.json in Megatron's terms and back, and every parameter's HF
//! name and layout next to the Megatron name Ferrotron uses. Pure: tensors come and go as host
//! f32 values; reading and writing files is the trainer's (`ferrotron convert`).
//!
//! Layouts that differ (facts of the two formats):
//! - GPT-2's projections are `Conv1D`s, weight [in, out]; Megatron's linears are [out, in].
//! - GPT-2's `c_attn` rows are [all q heads | all k heads | all v heads]; Llama's q/k/v are three
//!   tensors. Megatron's `linear_qkv` is grouped: for each query group its q heads, then its k
//!   head, then its v head (HF's GQA gives query head h the group h / (heads / groups) as well).
//!   Qwen2's q/k/v biases are grouped the same way into `linear_qkv.bias`.
//! - Llama's `gate_proj` and `up_proj` are Megatron's `linear_fc1` [gate; up] (silu on the first);
//!   so are each Mixtral expert's `w1` and `w3` (`w2` its `linear_fc2`), and Mixtral's
//!   `block_sparse_moe.gate` is Megatron's `mlp.router`. Mixtral's routing (softmax over all
//!   experts, top-k, renormalised) is Megatron's top-k softmax without --moe-router-pre-softmax.
//! - Qwen2-MoE's `mlp.gate` is the router, its experts' and `shared_expert`'s gate/up/down
//!   projections the experts' and `shared_experts`' fc1 [gate; up] and fc2, `shared_expert_gate`
//!   the shared experts' `gate_weight`. Its routing is the softmax over all experts read at the
//!   top k, renormalised only with `norm_topk_prob` (without it Megatron's
//!   --moe-router-pre-softmax). Qwen3-MoE's experts and router are named as Qwen2-MoE's, with no
//!   shared experts.
//! - Qwen3's `q_norm` / `k_norm` (RMSNorm over each head's width, before RoPE) are Megatron's
//!   `q_layernorm` / `k_layernorm` (--qk-layernorm).
//! - HF keeps the real vocabulary; Megatron pads it (the checkpoint drops the padding rows).
//! - RoPE is rotate-half in both (HF's Llama weights are already permuted for it). A model with
//!   interleaved pairs (--rotary-interleaved) exports each query and key head's rows (and QK-norm
//!   weights) de-interleaved, evens first: HF's pair (j, j + d/2) is then its pair (2j, 2j + 1),
//!   and every score is the same (one permutation of both q and k).

use ferrotron_moe::{LoadBalancing, MoeSpec, RouterSpec};
use ferrotron_transformer::TransformerConfig;
use ferrotron_transformer::spec::{
    Activation, AttentionSpec, LayerSpec, MlpSpec, NormKind, OtherMlp, PositionEmbedding, RopeScaling, SoftmaxType,
};
use serde_json::{Value, json};
use std::sync::Arc;

mod deepseek;
pub mod llava;
mod mamba2;

/// A whole tensor on the host.
#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

impl HostTensor {
    pub fn new(shape: Vec<usize>, data: Vec<f32>) -> Self {
        HostTensor { shape, data }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum HfError {
    #[error("config.json: {0}")]
    Config(String),
    #[error("HF tensor `{0}` is missing from the checkpoint's safetensors files")]
    Missing(String),
    #[error("HF tensor `{name}` is {got:?} but the config makes it {want:?}")]
    Shape { name: String, got: Vec<usize>, want: Vec<usize> },
    #[error("the model has no Hugging Face equivalent: {0}")]
    NoEquivalent(String),
    #[error("Ferrotron tensor `{0}` is missing from the checkpoint")]
    MissingOwn(String),
    #[error("tie_word_embeddings is true but `{0}` differs from the input embedding")]
    UntiedHead(String),
}

pub type Result<T> = std::result::Result<T, HfError>;

/// The transformers classes Ferrotron converts to and from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HfArch {
    /// `GPT2LMHeadModel` (model_type gpt2).
    Gpt2,
    /// `LlamaForCausalLM` (model_type llama).
    Llama,
    /// `MistralForCausalLM` (model_type mistral): Llama's layers and names with an optional
    /// sliding window.
    Mistral,
    /// `Qwen2ForCausalLM` (model_type qwen2, Qwen2 and Qwen2.5): Llama's layers and names with
    /// biases on q, k and v (Megatron's --add-qkv-bias).
    Qwen2,
    /// `Mamba2ForCausalLM` (model_type mamba2): Mamba-2 layers alone (`hf/mamba2.rs`).
    Mamba2,
    /// `MixtralForCausalLM` (model_type mixtral): Mistral's attention with a mixture-of-experts
    /// MLP (ferrotron-moe's layer).
    Mixtral,
    /// `Qwen2MoeForCausalLM` (model_type qwen2_moe, Qwen1.5-MoE and Qwen2-MoE): Qwen2's attention
    /// with a mixture-of-experts MLP whose shared experts are gated.
    Qwen2Moe,
    /// `Qwen3ForCausalLM` (model_type qwen3): Llama's layers with QK-norm (--qk-layernorm), no
    /// q/k/v biases.
    Qwen3,
    /// `Qwen3MoeForCausalLM` (model_type qwen3_moe): Qwen3's attention with a mixture of experts
    /// (no shared experts).
    Qwen3Moe,
    /// `LlavaForConditionalGeneration` (model_type llava): a CLIP vision tower and projector
    /// before a Llama (`hf/llava.rs`); the text functions here treat it as its Llama.
    Llava,
    /// `DeepseekV3ForCausalLM` (model_type deepseek_v3): multi-latent attention, dense layers
    /// first, then sigmoid-routed grouped experts with the bias correction (`hf/deepseek.rs`).
    DeepseekV3,
}

impl HfArch {
    pub fn class(self) -> &'static str {
        match self {
            HfArch::Gpt2 => "GPT2LMHeadModel",
            HfArch::Llama => "LlamaForCausalLM",
            HfArch::Mistral => "MistralForCausalLM",
            HfArch::Qwen2 => "Qwen2ForCausalLM",
            HfArch::Mixtral => "MixtralForCausalLM",
            HfArch::Qwen2Moe => "Qwen2MoeForCausalLM",
            HfArch::Qwen3 => "Qwen3ForCausalLM",
            HfArch::Qwen3Moe => "Qwen3MoeForCausalLM",
            HfArch::Mamba2 => "Mamba2ForCausalLM",
            HfArch::Llava => "LlavaForConditionalGeneration",
            HfArch::DeepseekV3 => "DeepseekV3ForCausalLM",
        }
    }

    /// Which class can hold `c` exactly, or what stops it.
    pub fn of(c: &TransformerConfig) -> Result<HfArch> {
        if let PositionEmbedding::Rope { percent, .. } = c.position_embedding
            && percent != 1.0
        {
            return Err(HfError::NoEquivalent(format!(
                "rotary embeddings over part of each head (--rotary-percent {percent}): the Hugging Face classes here rotate whole heads"
            )));
        }
        if c.layer.attention.output_gate {
            return Err(HfError::NoEquivalent(
                "a sigmoid gate on the attention output (--attention-output-gate): no Hugging Face class here has it"
                    .into(),
            ));
        }
        if c.layer.attention.softmax != SoftmaxType::Vanilla {
            return Err(HfError::NoEquivalent(format!(
                "an attention softmax with a sink logit (--softmax-type {}): no Hugging Face class here has it (gpt-oss's sinks come with its MoE and alternating windows)",
                c.layer.attention.softmax.flag()
            )));
        }
        if c.layer.attention.qk_l2_norm {
            return Err(HfError::NoEquivalent(
                "Llama 4's L2 norm of the query and key heads (--qk-l2-norm): no Hugging Face class here has it".into(),
            ));
        }
        if c.layer.window_layers.is_some() {
            return Err(HfError::NoEquivalent(
                "full-attention layers among sliding-window ones (--window-attn-skip-freq): the Hugging Face classes here window every layer or none".into(),
            ));
        }
        if let PositionEmbedding::Rope { scaling: Some(_), interpolation: Some(f), .. } = c.position_embedding {
            return Err(HfError::NoEquivalent(format!(
                "Llama 3's frequency scaling with linear position interpolation ({f}): a Hugging Face config holds one rope_scaling"
            )));
        }
        if c.layer.hybrid.is_some() {
            return mamba2::of(c);
        }
        if c.layer.attention.mla.is_some() {
            return deepseek::check(c).map(|_| HfArch::DeepseekV3);
        }
        if let Some(m) = crate::moe_spec(c) {
            return match (c.layer.attention.qk_layernorm, m.shared_expert_ffn.is_some()) {
                (true, _) => qwen_moe_of(c, m, HfArch::Qwen3Moe),
                (false, true) => qwen_moe_of(c, m, HfArch::Qwen2Moe),
                (false, false) => mixtral_of(c, m),
            };
        }
        let MlpSpec::Dense { activation, bias: mlp_bias } = c.layer.mlp else {
            return Err(HfError::NoEquivalent("a custom MLP module".into()));
        };
        let a = c.layer.attention;
        let llama_like = c.layer.norm == NormKind::RmsNorm
            && activation == Activation::SwiGlu
            && !a.bias
            && !mlp_bias
            && matches!(c.position_embedding, PositionEmbedding::Rope { .. });
        if a.qk_layernorm {
            return match (llama_like, a.qkv_bias, a.window) {
                (true, false, None) => Ok(HfArch::Qwen3),
                _ => Err(HfError::NoEquivalent(
                    "QK-LayerNorm (--qk-layernorm) is Qwen3's alone here: RMSNorm, SwiGLU and RoPE without linear biases or a window".into(),
                )),
            };
        }
        let gpt2 = (NormKind::LayerNorm, Activation::Gelu, true, true);
        let llama = (NormKind::RmsNorm, Activation::SwiGlu, false, false);
        let got = (c.layer.norm, activation, a.bias, mlp_bias);
        match (got, c.position_embedding) {
            (g, PositionEmbedding::LearnedAbsolute) if g == gpt2 => {
                if a.window.is_some() {
                    return Err(HfError::NoEquivalent("GPT-2 has no sliding-window attention (--window-size)".into()));
                }
                if c.num_query_groups != c.num_attention_heads {
                    return Err(HfError::NoEquivalent("GPT-2 has no grouped-query attention".into()));
                }
                if c.head_dim() * c.num_attention_heads != c.hidden_size {
                    return Err(HfError::NoEquivalent("GPT-2's heads are hidden / heads wide (--kv-channels)".into()));
                }
                Ok(HfArch::Gpt2)
            }
            // A window makes it a Mistral (the same layers and names), a QKV bias a Qwen2.
            (g, PositionEmbedding::Rope { .. }) if g == llama => match (a.qkv_bias, a.window) {
                (false, None) => Ok(HfArch::Llama),
                (false, Some(_)) => Ok(HfArch::Mistral),
                (true, None) => Ok(HfArch::Qwen2),
                (true, Some(_)) => Err(HfError::NoEquivalent(
                    "a QKV bias with a sliding window: Qwen2's window covers only its upper layers".into(),
                )),
            },
            _ => Err(HfError::NoEquivalent(format!(
                "{:?} + {activation:?} + {:?} with linear biases {}/{}: GPT-2 is LayerNorm + GeLU + learned positions with biases, Llama RMSNorm + SwiGLU + RoPE without",
                c.layer.norm, c.position_embedding, a.bias, mlp_bias
            ))),
        }
    }
}

/// Whether `m` is the dense MLP the HF MoE classes keep in their dense layers: SwiGLU, no biases.
fn plain_swiglu(m: &MlpSpec) -> bool {
    matches!(m, MlpSpec::Dense { activation: Activation::SwiGlu, bias: false })
}

/// An MoE model as a Mixtral, or what stops it.
fn mixtral_of(c: &TransformerConfig, m: &MoeSpec) -> Result<HfArch> {
    let a = c.layer.attention;
    let r = &m.router;
    let problem = if c.layer.norm != NormKind::RmsNorm
        || !matches!(c.position_embedding, PositionEmbedding::Rope { .. })
    {
        Some("Mixtral's layers are RMSNorm with RoPE")
    } else if m.activation != Activation::SwiGlu || m.bias {
        Some("Mixtral's experts are SwiGLU without biases")
    } else if m.shared_expert_ffn.is_some() {
        Some("Mixtral has no shared experts")
    } else if c.layer.other_mlp.is_some() {
        Some("every Mixtral layer is an MoE layer (no --moe-layer-freq)")
    } else if a.bias || a.qkv_bias || a.qk_layernorm {
        Some("Mixtral's attention has no biases and no QK-LayerNorm")
    } else if r.pre_softmax || r.topk_scaling_factor.is_some() {
        Some("Mixtral renormalises the top-k weights (no --moe-router-pre-softmax, no scaling factor)")
    } else if r.score != ferrotron_moe::Score::Softmax || r.groups.is_some() || r.expert_bias_update_rate.is_some() {
        Some("Mixtral's router is a softmax top-k (no sigmoid scores, expert groups or expert bias)")
    } else {
        None
    };
    match problem {
        Some(p) => Err(HfError::NoEquivalent(format!("an MoE model as MixtralForCausalLM: {p}"))),
        None => Ok(HfArch::Mixtral),
    }
}

/// An MoE model as a Qwen2-MoE (gated shared experts, q/k/v biases) or a Qwen3-MoE (QK-norm, no
/// shared experts), or what stops it.
fn qwen_moe_of(c: &TransformerConfig, m: &MoeSpec, arch: HfArch) -> Result<HfArch> {
    let a = c.layer.attention;
    let r = &m.router;
    let qwen3 = arch == HfArch::Qwen3Moe;
    let problem = if c.layer.norm != NormKind::RmsNorm
        || !matches!(c.position_embedding, PositionEmbedding::Rope { .. })
    {
        Some("its layers are RMSNorm with RoPE")
    } else if m.activation != Activation::SwiGlu || m.bias {
        Some("its experts are SwiGLU without biases")
    } else if qwen3 && m.shared_expert_ffn.is_some() {
        Some("Qwen3-MoE has no shared experts")
    } else if !qwen3 && !m.shared_expert_gate {
        Some("Qwen2-MoE gates its shared experts (--moe-shared-expert-gate)")
    } else if c.layer.other_mlp.as_ref().is_some_and(|o| !plain_swiglu(&o.mlp)) {
        Some("its dense layers (--moe-layer-freq) are SwiGLU without biases")
    } else if a.bias || a.window.is_some() || a.qkv_bias == qwen3 || a.qk_layernorm != qwen3 {
        Some(
            "Qwen2-MoE's attention has q/k/v biases (--add-qkv-bias), Qwen3-MoE's QK-norm (--qk-layernorm), neither both, no other bias and no window",
        )
    } else if r.topk_scaling_factor.is_some() {
        Some("it does not scale the top-k weights")
    } else if r.score != ferrotron_moe::Score::Softmax || r.groups.is_some() || r.expert_bias_update_rate.is_some() {
        Some("its router is a softmax top-k (no sigmoid scores, expert groups or expert bias)")
    } else {
        None
    };
    match problem {
        Some(p) => Err(HfError::NoEquivalent(format!("an MoE model as {}: {p}", arch.class()))),
        None => Ok(arch),
    }
}

/// A config.json read: the class, the model in Megatron's terms, and the weights' dtype name.
#[derive(Clone, Debug)]
pub struct HfModel {
    pub arch: HfArch,
    pub config: TransformerConfig,
    /// `torch_dtype` (or transformers 5's `dtype`): float32, bfloat16, float16; None if absent.
    pub dtype: Option<String>,
    /// A LLaVA model's vision tower and projector (`config` is then its language model's).
    pub vision: Option<llava::LlavaVision>,
    /// `quantization_config`'s `weight_block_size` where the weights are block-scaled FP8
    /// (DeepSeek-V3's, Kimi-K2's, Qwen3-FP8's): [rows, columns] a scale covers.
    pub fp8_block: Option<[usize; 2]>,
}

/// `quantization_config`: None for unquantized weights, the FP8 block size for transformers'
/// `quant_method: "fp8"` with `weight_block_size`; any other scheme is refused by name.
fn fp8_block(v: &Value) -> Result<Option<[usize; 2]>> {
    let Some(q) = v.get("quantization_config") else { return Ok(None) };
    let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("(none)");
    if method != "fp8" {
        return Err(HfError::Config(format!(
            "quantization_config.quant_method `{method}`: Ferrotron reads unquantized weights and block-scaled FP8 (quant_method fp8 with weight_block_size, as DeepSeek-V3 publishes); dequantize these to bfloat16 first"
        )));
    }
    if let Some(fmt) = q.get("fmt").and_then(Value::as_str)
        && fmt != "e4m3"
    {
        return Err(HfError::Config(format!("quantization_config.fmt `{fmt}`: FP8 weights are read as e4m3")));
    }
    let block: Option<Vec<usize>> = q
        .get("weight_block_size")
        .and_then(Value::as_array)
        .and_then(|a| a.iter().map(|x| x.as_u64().map(|x| x as usize)).collect());
    match block.as_deref() {
        Some(&[r, c]) if r > 0 && c > 0 => Ok(Some([r, c])),
        _ => Err(HfError::Config(format!(
            "quantization_config.weight_block_size {}: FP8 weights are read with one scale per block of [rows, columns] (per-tensor or per-channel scales are not)",
            q.get("weight_block_size").map_or("(absent)".into(), |b| b.to_string())
        ))),
    }
}

fn field<'a>(v: &'a Value, key: &str) -> Result<&'a Value> {
    v.get(key).filter(|x| !x.is_null()).ok_or_else(|| HfError::Config(format!("no `{key}`")))
}

fn usize_of(v: &Value, key: &str) -> Result<usize> {
    field(v, key)?.as_u64().map(|x| x as usize).ok_or_else(|| HfError::Config(format!("`{key}` is not a count")))
}

fn f64_of(v: &Value, key: &str) -> Result<f64> {
    field(v, key)?.as_f64().ok_or_else(|| HfError::Config(format!("`{key}` is not a number")))
}

fn opt<T>(v: &Value, key: &str, read: impl Fn(&Value, &str) -> Result<T>) -> Result<Option<T>> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(_) => read(v, key).map(Some),
    }
}

fn bool_or(v: &Value, key: &str, default: bool) -> Result<bool> {
    opt(v, key, |v, k| field(v, k)?.as_bool().ok_or_else(|| HfError::Config(format!("`{k}` is not true/false"))))
        .map(|b| b.unwrap_or(default))
}

fn str_or<'a>(v: &'a Value, key: &str, default: &'a str) -> &'a str {
    v.get(key).and_then(Value::as_str).unwrap_or(default)
}

/// Parses config.json text as Python's json module writes it: a bare `Infinity`, `-Infinity` or
/// `NaN` outside strings (Mamba2's `time_step_limit`), which JSON has no number for, is read as a
/// string of that name.
pub fn parse_config(text: &str) -> serde_json::Result<Value> {
    let mut out = String::with_capacity(text.len() + 16);
    let (mut in_str, mut escaped) = (false, false);
    let mut rest = text;
    while let Some(c) = rest.chars().next() {
        if !in_str {
            if let Some(w) = ["-Infinity", "Infinity", "NaN"].into_iter().find(|w| rest.starts_with(w)) {
                out.push('"');
                out.push_str(w);
                out.push('"');
                rest = &rest[w.len()..];
                continue;
            }
        }
        if in_str {
            in_str = escaped || c != '"';
            escaped = !escaped && c == '\\';
        } else {
            in_str = c == '"';
        }
        out.push(c);
        rest = &rest[c.len_utf8()..];
    }
    serde_json::from_str(&out)
}

/// Reads a config.json (transformers 4's or 5's keys) into a Megatron-style config. Everything the
/// config says that Ferrotron's model cannot do is refused by name rather than dropped.
pub fn from_hf_config(v: &Value) -> Result<HfModel> {
    let model_type = field(v, "model_type")?.as_str().unwrap_or("");
    let dtype = v.get("torch_dtype").or_else(|| v.get("dtype")).and_then(Value::as_str).map(str::to_string);
    let fp8_block = fp8_block(v)?;
    let (arch, config) = match model_type {
        "gpt2" => (HfArch::Gpt2, gpt2_config(v)?),
        "llama" => (HfArch::Llama, llama_config(v)?),
        "qwen2" => (HfArch::Qwen2, qwen2_config(v)?),
        "qwen2_moe" => (HfArch::Qwen2Moe, qwen_moe_config(v, qwen2_config(v)?, true)?),
        "qwen3" => (HfArch::Qwen3, qwen3_config(v)?),
        "qwen3_moe" => (HfArch::Qwen3Moe, qwen_moe_config(v, qwen3_config(v)?, false)?),
        "mixtral" => {
            let mut c = llama_config(v)?;
            c.layer.attention.window = opt(v, "sliding_window", usize_of)?;
            if opt(v, "router_jitter_noise", f64_of)?.is_some_and(|j| j != 0.0) {
                return Err(HfError::Config("router_jitter_noise: Ferrotron's router adds no noise".into()));
            }
            let router = RouterSpec {
                topk: usize_of(v, "num_experts_per_tok")?,
                load_balancing: LoadBalancing::AuxLoss,
                // transformers' coefficient as Megatron's: per layer, where transformers weighs
                // one loss over all layers' routing (k times Megatron's for the same routing).
                aux_loss_coeff: opt(v, "router_aux_loss_coef", f64_of)?.unwrap_or(0.0) as f32,
                ..RouterSpec::default()
            };
            let moe = MoeSpec::new(usize_of(v, "num_local_experts")?, c.ffn_hidden_size, Activation::SwiGlu, router);
            moe.validate().map_err(HfError::Config)?;
            c.layer.mlp = MlpSpec::Custom(Arc::new(moe));
            (HfArch::Mixtral, c)
        }
        "mamba2" => (HfArch::Mamba2, mamba2::config(v)?),
        "deepseek_v3" => (HfArch::DeepseekV3, deepseek::config(v)?),
        "llava" => {
            let (config, vision) = llava::config(v)?;
            // The text model's dtype where the top level has none.
            let text = v.get("text_config");
            let dtype = dtype.or_else(|| {
                text.and_then(|t| t.get("torch_dtype").or_else(|| t.get("dtype")))
                    .and_then(Value::as_str)
                    .map(str::to_string)
            });
            config.validate().map_err(|e| HfError::Config(e.to_string()))?;
            return Ok(HfModel { arch: HfArch::Llava, config, dtype, vision: Some(vision), fp8_block });
        }
        "mistral" => {
            let mut c = llama_config(v)?;
            // transformers' window: each query sees the `sliding_window` keys up to and including
            // itself, as Ferrotron's (Megatron's --window-size (W − 1, 0)).
            c.layer.attention.window = opt(v, "sliding_window", usize_of)?;
            (HfArch::Mistral, c)
        }
        o => {
            return Err(HfError::Config(format!(
                "model_type `{o}`: Ferrotron converts gpt2 (GPT2LMHeadModel), llama (LlamaForCausalLM), mistral (MistralForCausalLM), qwen2 (Qwen2ForCausalLM), mixtral (MixtralForCausalLM), qwen2_moe (Qwen2MoeForCausalLM), qwen3 (Qwen3ForCausalLM), qwen3_moe (Qwen3MoeForCausalLM), mamba2 (Mamba2ForCausalLM), deepseek_v3 (DeepseekV3ForCausalLM) and llava (LlavaForConditionalGeneration)"
            )));
        }
    };
    config.validate().map_err(|e| HfError::Config(e.to_string()))?;
    Ok(HfModel { arch, config, dtype, vision: None, fp8_block })
}

fn gpt2_config(v: &Value) -> Result<TransformerConfig> {
    let act = str_or(v, "activation_function", "gelu_new");
    // All three are 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))), the GeLU Ferrotron computes.
    if !matches!(act, "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast") {
        return Err(HfError::Config(format!(
            "activation_function `{act}`: Ferrotron's GeLU is the tanh approximation (gelu_new)"
        )));
    }
    if !bool_or(v, "scale_attn_weights", true)? || bool_or(v, "scale_attn_by_inverse_layer_idx", false)? {
        return Err(HfError::Config(
            "attention scaled other than by 1/√head_dim (scale_attn_weights / scale_attn_by_inverse_layer_idx)".into(),
        ));
    }
    if bool_or(v, "add_cross_attention", false)? {
        return Err(HfError::Config("add_cross_attention: a GPT is decoder-only".into()));
    }
    let hidden = usize_of(v, "n_embd")?;
    let positions = usize_of(v, "n_positions")?;
    let dropout = |k: &str| opt(v, k, f64_of).map(|p| p.unwrap_or(0.1) as f32);
    Ok(TransformerConfig {
        num_layers: usize_of(v, "n_layer")?,
        hidden_size: hidden,
        num_attention_heads: usize_of(v, "n_head")?,
        num_query_groups: usize_of(v, "n_head")?,
        kv_channels: None,
        ffn_hidden_size: opt(v, "n_inner", usize_of)?.unwrap_or(4 * hidden),
        seq_length: positions,
        max_position_embeddings: positions,
        vocab_size: usize_of(v, "vocab_size")?,
        make_vocab_size_divisible_by: crate::VOCAB_DIVISIBLE_BY,
        position_embedding: PositionEmbedding::LearnedAbsolute,
        untie_embeddings_and_output_weights: !bool_or(v, "tie_word_embeddings", true)?,
        layer: LayerSpec {
            norm: NormKind::LayerNorm,
            zero_centred_gamma: false,
            attention: AttentionSpec {
                bias: true,
                qkv_bias: false,
                qk_layernorm: false,
                qk_l2_norm: false,
                output_gate: false,
                softmax: SoftmaxType::Vanilla,
                window: None,
                causal: true,
                mla: None,
            },
            mlp: MlpSpec::Dense { activation: Activation::Gelu, bias: true },
            other_mlp: None,
            hybrid: None,
            window_layers: None,
        },
        norm_epsilon: opt(v, "layer_norm_epsilon", f64_of)?.unwrap_or(1e-5),
        init_method_std: opt(v, "initializer_range", f64_of)?.unwrap_or(0.02) as f32,
        embedding_init_method_std: None,
        // One rate for the embedding's and the branches' outputs in Ferrotron (and Megatron).
        hidden_dropout: dropout("resid_pdrop")?,
        attention_dropout: dropout("attn_pdrop")?,
        mtp: None,
    })
}

/// RoPE from transformers 4's `rope_theta` / `rope_scaling` or 5's `rope_parameters`: the base,
/// Llama 3.1's scaling (rope_type `llama3`) with the constants Megatron's `--use-rope-scaling`
/// fixes, and linear position interpolation (rope_type `linear`: Megatron's
/// --rotary-seq-len-interpolation-factor); other scaled variants (yarn, dynamic, longrope) are
/// refused.
fn rope(v: &Value) -> Result<PositionEmbedding> {
    let params = v.get("rope_parameters").filter(|x| !x.is_null());
    let (mut scaling, mut interpolation) = (None, None);
    for p in [params, v.get("rope_scaling").filter(|x| !x.is_null())].into_iter().flatten() {
        let kind = p.get("rope_type").or_else(|| p.get("type")).and_then(Value::as_str).unwrap_or("default");
        match kind {
            "default" => {}
            "llama3" => {
                let num =
                    |k: &str| f64_of(p, k).map_err(|_| HfError::Config(format!("rope_type llama3 without `{k}`")));
                let s = RopeScaling {
                    factor: num("factor")?,
                    low_freq_factor: num("low_freq_factor")?,
                    high_freq_factor: num("high_freq_factor")?,
                    original_max_position_embeddings: num("original_max_position_embeddings")?,
                };
                let fixed = RopeScaling::llama3(s.factor);
                if s != fixed {
                    return Err(HfError::Config(format!(
                        "rope_type llama3 with low_freq_factor {}, high_freq_factor {}, original_max_position_embeddings {}: Megatron's --use-rope-scaling (and Ferrotron's) fixes them at {}, {}, {}",
                        s.low_freq_factor,
                        s.high_freq_factor,
                        s.original_max_position_embeddings,
                        fixed.low_freq_factor,
                        fixed.high_freq_factor,
                        fixed.original_max_position_embeddings
                    )));
                }
                scaling = Some(s);
            }
            "linear" => {
                let f = f64_of(p, "factor").map_err(|_| HfError::Config("rope_type linear without `factor`".into()))?;
                interpolation = Some(f);
            }
            _ => {
                return Err(HfError::Config(format!(
                    "rope_type `{kind}`: this scaled RoPE is not implemented in Ferrotron (plain RoPE, llama3's and linear are)"
                )));
            }
        }
        if p.get("partial_rotary_factor").and_then(Value::as_f64).is_some_and(|f| f != 1.0) {
            return Err(HfError::Config("partial_rotary_factor: Ferrotron rotates whole heads".into()));
        }
    }
    let base = match params.and_then(|p| p.get("rope_theta")) {
        Some(t) => t.as_f64().ok_or_else(|| HfError::Config("`rope_parameters.rope_theta` is not a number".into()))?,
        None => opt(v, "rope_theta", f64_of)?.unwrap_or(10000.0),
    };
    Ok(PositionEmbedding::Rope { base, scaling, percent: 1.0, interpolation, interleaved: false })
}

/// Qwen2's layers: Llama's with biases on q, k and v, full attention in every layer.
fn qwen2_config(v: &Value) -> Result<TransformerConfig> {
    let mut c = qwen_layers(v)?;
    c.layer.attention.qkv_bias = bool_or(v, "qkv_bias", true)?;
    Ok(c)
}

/// Qwen3's layers: Llama's with QK-norm, full attention in every layer.
fn qwen3_config(v: &Value) -> Result<TransformerConfig> {
    let mut c = qwen_layers(v)?;
    c.layer.attention.qk_layernorm = true;
    Ok(c)
}

/// Llama's layers as the Qwen configs give them: their sliding window (upper layers only) refused.
fn qwen_layers(v: &Value) -> Result<TransformerConfig> {
    if bool_or(v, "use_sliding_window", false)? {
        return Err(HfError::Config(
            "use_sliding_window true: Qwen2's window covers only the layers from max_window_layers on, which Ferrotron's attention does not".into(),
        ));
    }
    // transformers 5 also lists each layer's kind.
    let types = v.get("layer_types").and_then(Value::as_array).into_iter().flatten();
    if let Some(t) = types.filter_map(Value::as_str).find(|t| *t != "full_attention") {
        return Err(HfError::Config(format!(
            "layer_types has `{t}`: Ferrotron converts Qwen2 with full attention in every layer"
        )));
    }
    llama_config(v)
}

/// Qwen2-MoE (`shared`: gated shared experts) and Qwen3-MoE: `c`'s layers with a mixture of
/// experts, except where `mlp_only_layers` or `decoder_sparse_step` leave the dense MLP of
/// `intermediate_size` (Megatron's `--moe-layer-freq` pattern).
fn qwen_moe_config(v: &Value, mut c: TransformerConfig, shared: bool) -> Result<TransformerConfig> {
    let step = opt(v, "decoder_sparse_step", usize_of)?.unwrap_or(1);
    if step == 0 {
        return Err(HfError::Config("decoder_sparse_step 0: transformers puts experts in layers i with (i + 1) % step == 0, so it must be at least 1".into()));
    }
    let mut dense: Vec<bool> = (0..c.num_layers).map(|i| (i + 1) % step != 0).collect();
    if let Some(only) = v.get("mlp_only_layers").and_then(Value::as_array) {
        for l in only {
            match l.as_u64().map(|l| l as usize) {
                Some(i) if i < c.num_layers => dense[i] = true,
                _ => {
                    return Err(HfError::Config(format!(
                        "mlp_only_layers has {l}: not a layer of the {} (0-based)",
                        c.num_layers
                    )));
                }
            }
        }
    }
    if dense.iter().all(|&d| d) {
        return Err(HfError::Config(
            "no layer has experts (mlp_only_layers and decoder_sparse_step leave every layer dense): convert it as the dense model it is".into(),
        ));
    }
    let shared = match shared {
        true => match usize_of(v, "shared_expert_intermediate_size")? {
            0 => {
                return Err(HfError::Config(
                    "shared_expert_intermediate_size 0: Qwen2-MoE's shared experts are needed".into(),
                ));
            }
            f => Some(f),
        },
        false => None,
    };
    let router = RouterSpec {
        topk: usize_of(v, "num_experts_per_tok")?,
        // Softmax over all experts read at the top k: renormalised only with norm_topk_prob.
        pre_softmax: !bool_or(v, "norm_topk_prob", false)?,
        load_balancing: LoadBalancing::AuxLoss,
        // Per layer, as Megatron's (see Mixtral's).
        aux_loss_coeff: opt(v, "router_aux_loss_coef", f64_of)?.unwrap_or(0.0) as f32,
        ..RouterSpec::default()
    };
    // transformers 5 writes Qwen3-MoE's count as num_local_experts; the published configs (and
    // Qwen2-MoE's) as num_experts.
    let experts = match opt(v, "num_local_experts", usize_of)? {
        Some(n) => n,
        None => usize_of(v, "num_experts")?,
    };
    let width = usize_of(v, "moe_intermediate_size")?;
    let moe = MoeSpec {
        shared_expert_ffn: shared,
        shared_expert_gate: shared.is_some(),
        ..MoeSpec::new(experts, width, Activation::SwiGlu, router)
    };
    moe.validate().map_err(HfError::Config)?;
    // The dense layers keep the Llama MLP `c` was built with (intermediate_size wide).
    if dense.iter().any(|&d| d) {
        c.layer.other_mlp = Some(OtherMlp { mlp: c.layer.mlp.clone(), layers: dense });
    }
    c.layer.mlp = MlpSpec::Custom(Arc::new(moe));
    Ok(c)
}

fn llama_config(v: &Value) -> Result<TransformerConfig> {
    let act = str_or(v, "hidden_act", "silu");
    if act != "silu" {
        return Err(HfError::Config(format!("hidden_act `{act}`: Ferrotron's gated MLP is SwiGLU (silu)")));
    }
    for key in ["attention_bias", "mlp_bias"] {
        if bool_or(v, key, false)? {
            return Err(HfError::Config(format!("{key} true: Ferrotron's Llama has no linear biases")));
        }
    }
    let hidden = usize_of(v, "hidden_size")?;
    let heads = usize_of(v, "num_attention_heads")?;
    let head_dim = opt(v, "head_dim", usize_of)?.unwrap_or(hidden / heads.max(1));
    let positions = usize_of(v, "max_position_embeddings")?;
    Ok(TransformerConfig {
        num_layers: usize_of(v, "num_hidden_layers")?,
        hidden_size: hidden,
        num_attention_heads: heads,
        num_query_groups: opt(v, "num_key_value_heads", usize_of)?.unwrap_or(heads),
        kv_channels: (head_dim * heads != hidden).then_some(head_dim),
        ffn_hidden_size: usize_of(v, "intermediate_size")?,
        seq_length: positions,
        max_position_embeddings: positions,
        vocab_size: usize_of(v, "vocab_size")?,
        make_vocab_size_divisible_by: crate::VOCAB_DIVISIBLE_BY,
        position_embedding: rope(v)?,
        untie_embeddings_and_output_weights: !bool_or(v, "tie_word_embeddings", false)?,
        layer: LayerSpec {
            norm: NormKind::RmsNorm,
            zero_centred_gamma: false,
            attention: AttentionSpec {
                bias: false,
                qkv_bias: false,
                qk_layernorm: false,
                qk_l2_norm: false,
                output_gate: false,
                softmax: SoftmaxType::Vanilla,
                window: None,
                causal: true,
                mla: None,
            },
            mlp: MlpSpec::Dense { activation: Activation::SwiGlu, bias: false },
            other_mlp: None,
            hybrid: None,
            window_layers: None,
        },
        norm_epsilon: opt(v, "rms_norm_eps", f64_of)?.unwrap_or(1e-6),
        init_method_std: opt(v, "initializer_range", f64_of)?.unwrap_or(0.02) as f32,
        embedding_init_method_std: None,
        hidden_dropout: 0.0,
        attention_dropout: opt(v, "attention_dropout", f64_of)?.unwrap_or(0.0) as f32,
        mtp: None,
    })
}

/// An f32 setting as the decimal it was written as (0.02, not 0.019999999552965164).
fn decimal(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(x as f64)
}

/// config.json for `c` as `arch` (see `HfArch::of`), weights in `dtype` (float32 or bfloat16).
pub fn to_hf_config(arch: HfArch, c: &TransformerConfig, dtype: &str) -> Value {
    let tied = !c.untie_embeddings_and_output_weights;
    match arch {
        HfArch::Mamba2 => mamba2::to_config(c, dtype),
        HfArch::DeepseekV3 => deepseek::to_config(c, dtype),
        HfArch::Gpt2 => json!({
            "architectures": [arch.class()],
            "model_type": "gpt2",
            "vocab_size": c.vocab_size,
            "n_positions": c.max_position_embeddings,
            "n_embd": c.hidden_size,
            "n_layer": c.num_layers,
            "n_head": c.num_attention_heads,
            "n_inner": c.ffn_hidden_size,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": c.norm_epsilon,
            "initializer_range": decimal(c.init_method_std),
            "resid_pdrop": decimal(c.hidden_dropout),
            "embd_pdrop": decimal(c.hidden_dropout),
            "attn_pdrop": decimal(c.attention_dropout),
            "scale_attn_weights": true,
            "tie_word_embeddings": tied,
            "torch_dtype": dtype,
        }),
        HfArch::Llama
        | HfArch::Mistral
        | HfArch::Qwen2
        | HfArch::Mixtral
        | HfArch::Qwen2Moe
        | HfArch::Qwen3
        | HfArch::Qwen3Moe
        | HfArch::Llava => {
            let PositionEmbedding::Rope { base, scaling, interpolation, .. } = c.position_embedding else {
                unreachable!("HfArch::of checked")
            };
            // At most one of them (`HfArch::of` checked).
            let rope_scaling = scaling
                .map(|s| {
                    json!({
                        "rope_type": "llama3",
                        "factor": s.factor,
                        "low_freq_factor": s.low_freq_factor,
                        "high_freq_factor": s.high_freq_factor,
                        "original_max_position_embeddings": s.original_max_position_embeddings,
                    })
                })
                .or_else(|| interpolation.map(|f| json!({"rope_type": "linear", "factor": f})));
            let mut v = json!({
                "architectures": [arch.class()],
                "model_type": match arch {
                    HfArch::Mistral => "mistral",
                    HfArch::Qwen2 => "qwen2",
                    HfArch::Mixtral => "mixtral",
                    HfArch::Qwen2Moe => "qwen2_moe",
                    HfArch::Qwen3 => "qwen3",
                    HfArch::Qwen3Moe => "qwen3_moe",
                    _ => "llama",
                },
                "vocab_size": c.vocab_size,
                "hidden_size": c.hidden_size,
                "intermediate_size": c.ffn_hidden_size,
                "num_hidden_layers": c.num_layers,
                "num_attention_heads": c.num_attention_heads,
                "num_key_value_heads": c.num_query_groups,
                "head_dim": c.head_dim(),
                "max_position_embeddings": c.max_position_embeddings,
                "rms_norm_eps": c.norm_epsilon,
                "rope_theta": base,
                "rope_scaling": rope_scaling,
                "hidden_act": "silu",
                "attention_bias": false,
                "mlp_bias": false,
                "attention_dropout": decimal(c.attention_dropout),
                "initializer_range": decimal(c.init_method_std),
                "tie_word_embeddings": tied,
                "torch_dtype": dtype,
            });
            if matches!(arch, HfArch::Mistral | HfArch::Mixtral) {
                v["sliding_window"] = json!(c.layer.attention.window);
            }
            if let (HfArch::Mixtral, Some(m)) = (arch, crate::moe_spec(c)) {
                if let Some(o) = v.as_object_mut() {
                    o.remove("attention_bias");
                    o.remove("mlp_bias");
                }
                v["intermediate_size"] = json!(m.ffn_hidden_size);
                v["num_local_experts"] = json!(m.num_experts);
                v["num_experts_per_tok"] = json!(m.router.topk);
                v["router_aux_loss_coef"] = json!(decimal(m.router.aux_loss_coeff));
                v["router_jitter_noise"] = json!(0.0);
                v["output_router_logits"] = json!(false);
            }
            if matches!(arch, HfArch::Qwen2 | HfArch::Qwen2Moe | HfArch::Qwen3 | HfArch::Qwen3Moe) {
                // The Qwen configs' own keys: Qwen2's biases are on q, k and v by construction,
                // Qwen3 has attention_bias (false) and no mlp_bias.
                if let Some(o) = v.as_object_mut() {
                    if matches!(arch, HfArch::Qwen2 | HfArch::Qwen2Moe) {
                        o.remove("attention_bias");
                    }
                    o.remove("mlp_bias");
                }
                v["use_sliding_window"] = json!(false);
                v["max_window_layers"] = json!(c.num_layers);
            }
            if let (HfArch::Qwen2Moe | HfArch::Qwen3Moe, Some(m)) = (arch, crate::moe_spec(c)) {
                v["moe_intermediate_size"] = json!(m.ffn_hidden_size);
                if arch == HfArch::Qwen2Moe {
                    v["shared_expert_intermediate_size"] = json!(m.shared_expert_ffn);
                }
                v["num_experts"] = json!(m.num_experts);
                v["num_experts_per_tok"] = json!(m.router.topk);
                v["norm_topk_prob"] = json!(!m.router.pre_softmax);
                v["decoder_sparse_step"] = json!(1);
                let dense = c.layer.other_mlp.as_ref().map(|o| o.layers.as_slice()).unwrap_or_default();
                let only: Vec<usize> = (0..dense.len()).filter(|&i| dense[i]).collect();
                v["mlp_only_layers"] = json!(only);
                v["router_aux_loss_coef"] = json!(decimal(m.router.aux_loss_coeff));
                v["output_router_logits"] = json!(false);
            }
            v
        }
    }
}

/// HF names that hold buffers, not parameters (old GPT-2 files' causal masks, RoPE's
/// frequencies): read past on import.
pub fn is_buffer(hf_name: &str) -> bool {
    hf_name.ends_with(".attn.bias") // not `.c_attn.bias`, a parameter
        || hf_name.ends_with(".attn.masked_bias")
        || hf_name.ends_with("rotary_emb.inv_freq")
        || deepseek::is_shared_copy(hf_name)
}

/// A tensor that a folder of `c` as `arch` holds only when it keeps the multi-token prediction
/// depths its config.json counts (DeepSeek-V3's `num_nextn_predict_layers`: transformers' model
/// saves none, though its config keeps the count); None where `c` has no depths.
pub fn mtp_probe(arch: HfArch, c: &TransformerConfig) -> Option<String> {
    (arch == HfArch::DeepseekV3 && c.mtp.is_some()).then(|| deepseek::mtp_probe(c))
}

/// GPT-2 files are written with and without the `transformer.` prefix; names here are without.
pub fn strip_prefix(arch: HfArch, hf_name: &str) -> &str {
    match arch {
        HfArch::Gpt2 => hf_name.strip_prefix("transformer.").unwrap_or(hf_name),
        _ => hf_name,
    }
}

fn transpose(t: &HostTensor) -> HostTensor {
    let (r, c) = (t.shape[0], t.shape[1]);
    let mut out = vec![0f32; r * c];
    for i in 0..r {
        for j in 0..c {
            out[j * r + i] = t.data[i * c + j];
        }
    }
    HostTensor::new(vec![c, r], out)
}

/// The row blocks of `parts`, one after the other.
fn concat_rows(parts: &[&HostTensor]) -> HostTensor {
    let mut shape = parts[0].shape.clone();
    shape[0] = parts.iter().map(|p| p.shape[0]).sum();
    HostTensor::new(shape, parts.iter().flat_map(|p| p.data.iter().copied()).collect())
}

fn row_block(t: &HostTensor, start: usize, rows: usize) -> HostTensor {
    let width: usize = t.shape[1..].iter().product();
    let mut shape = t.shape.clone();
    shape[0] = rows;
    HostTensor::new(shape, t.data[start * width..(start + rows) * width].to_vec())
}

/// Megatron's grouped QKV rows from separate q [H·D, ..], k [G·D, ..], v [G·D, ..].
fn group_qkv(q: &HostTensor, k: &HostTensor, v: &HostTensor, heads: usize, groups: usize, d: usize) -> HostTensor {
    let per = heads / groups;
    let mut blocks = vec![];
    for g in 0..groups {
        blocks.push(row_block(q, g * per * d, per * d));
        blocks.push(row_block(k, g * d, d));
        blocks.push(row_block(v, g * d, d));
    }
    concat_rows(&blocks.iter().collect::<Vec<_>>())
}

/// The inverse of `group_qkv`: (q, k, v).
fn ungroup_qkv(qkv: &HostTensor, heads: usize, groups: usize, d: usize) -> [HostTensor; 3] {
    let per = heads / groups;
    let stride = (per + 2) * d;
    let pick = |offset: usize, rows: usize| {
        let blocks: Vec<HostTensor> = (0..groups).map(|g| row_block(qkv, g * stride + offset, rows)).collect();
        concat_rows(&blocks.iter().collect::<Vec<_>>())
    };
    [pick(0, per * d), pick(per * d, d), pick((per + 1) * d, d)]
}

/// Where a Megatron parameter lives in the HF files, and how its layout changes there.
enum Map {
    /// The same tensor under another name.
    Same(String),
    /// A GPT-2 Conv1D weight: [in, out] in HF.
    Transposed(String),
    /// Megatron's grouped linear_qkv from HF's parts: GPT-2's c_attn (weight transposed first)
    /// or Llama's q/k/v projections.
    Qkv(QkvSource),
    /// Llama's fc1 [gate; up].
    GateUp(String, String),
}

enum QkvSource {
    Gpt2 {
        name: String,
        weight: bool,
    },
    /// Llama's q/k/v projections' weights or (Qwen2) biases.
    Llama {
        q: String,
        k: String,
        v: String,
        weight: bool,
    },
}

/// Every Megatron parameter of `c` with its HF counterpart, in the model's order.
fn maps(arch: HfArch, c: &TransformerConfig) -> Vec<(String, Map)> {
    use Map::*;
    let mut m = vec![];
    let tied = !c.untie_embeddings_and_output_weights;
    match arch {
        HfArch::Mamba2 => m = mamba2::maps(c),
        HfArch::DeepseekV3 => m = deepseek::maps(c),
        HfArch::Gpt2 => {
            m.push(("embedding.word_embeddings.weight".into(), Same("wte.weight".into())));
            m.push(("embedding.position_embeddings.weight".into(), Same("wpe.weight".into())));
            for i in 0..c.num_layers {
                let (o, h) = (format!("decoder.layers.{i}."), format!("h.{i}."));
                for (own, hf) in [("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2")] {
                    for p in ["weight", "bias"] {
                        m.push((format!("{o}{own}.{p}"), Same(format!("{h}{hf}.{p}"))));
                    }
                }
                for weight in [true, false] {
                    let p = if weight { "weight" } else { "bias" };
                    let name = format!("{h}attn.c_attn.{p}");
                    m.push((format!("{o}self_attention.linear_qkv.{p}"), Qkv(QkvSource::Gpt2 { name, weight })));
                }
                for (own, hf) in [
                    ("self_attention.linear_proj", "attn.c_proj"),
                    ("mlp.linear_fc1", "mlp.c_fc"),
                    ("mlp.linear_fc2", "mlp.c_proj"),
                ] {
                    m.push((format!("{o}{own}.weight"), Transposed(format!("{h}{hf}.weight"))));
                    m.push((format!("{o}{own}.bias"), Same(format!("{h}{hf}.bias"))));
                }
            }
            for p in ["weight", "bias"] {
                m.push((format!("decoder.final_layernorm.{p}"), Same(format!("ln_f.{p}"))));
            }
        }
        HfArch::Llama
        | HfArch::Mistral
        | HfArch::Qwen2
        | HfArch::Mixtral
        | HfArch::Qwen2Moe
        | HfArch::Qwen3
        | HfArch::Qwen3Moe
        | HfArch::Llava => {
            m.push(("embedding.word_embeddings.weight".into(), Same("model.embed_tokens.weight".into())));
            for i in 0..c.num_layers {
                let (o, h) = (format!("decoder.layers.{i}."), format!("model.layers.{i}."));
                m.push((format!("{o}input_layernorm.weight"), Same(format!("{h}input_layernorm.weight"))));
                let proj = |x: &str| format!("{h}self_attn.{x}_proj.weight");
                let qkv = QkvSource::Llama { q: proj("q"), k: proj("k"), v: proj("v"), weight: true };
                m.push((format!("{o}self_attention.linear_qkv.weight"), Qkv(qkv)));
                if matches!(arch, HfArch::Qwen2 | HfArch::Qwen2Moe) {
                    let b = |x: &str| format!("{h}self_attn.{x}_proj.bias");
                    let qkv = QkvSource::Llama { q: b("q"), k: b("k"), v: b("v"), weight: false };
                    m.push((format!("{o}self_attention.linear_qkv.bias"), Qkv(qkv)));
                }
                if c.layer.attention.qk_layernorm {
                    for x in ["q", "k"] {
                        let hf = format!("{h}self_attn.{x}_norm.weight");
                        m.push((format!("{o}self_attention.{x}_layernorm.weight"), Same(hf)));
                    }
                }
                m.push((format!("{o}self_attention.linear_proj.weight"), Same(proj("o"))));
                m.push((format!("{o}pre_mlp_layernorm.weight"), Same(format!("{h}post_attention_layernorm.weight"))));
                if let (HfArch::Mixtral, Some(moe)) = (arch, crate::moe_spec(c)) {
                    let b = format!("{h}block_sparse_moe.");
                    m.push((format!("{o}mlp.router.weight"), Same(format!("{b}gate.weight"))));
                    for e in 0..moe.num_experts {
                        let (own, w) =
                            (format!("{o}mlp.experts.local_experts.{e}."), |x| format!("{b}experts.{e}.{x}.weight"));
                        m.push((format!("{own}linear_fc1.weight"), GateUp(w("w1"), w("w3"))));
                        m.push((format!("{own}linear_fc2.weight"), Same(w("w2"))));
                    }
                } else if let (HfArch::Qwen2Moe | HfArch::Qwen3Moe, Some(moe), false) =
                    (arch, crate::moe_spec(c), c.layer.other_mlp.as_ref().is_some_and(|o| o.layers[i]))
                {
                    let b = format!("{h}mlp.");
                    m.push((format!("{o}mlp.router.weight"), Same(format!("{b}gate.weight"))));
                    let experts = (0..moe.num_experts)
                        .map(|e| (format!("{o}mlp.experts.local_experts.{e}."), format!("{b}experts.{e}.")));
                    let shared = moe
                        .shared_expert_ffn
                        .map(|_| (format!("{o}mlp.shared_experts."), format!("{b}shared_expert.")));
                    for (own, hf) in experts.chain(shared) {
                        let w = |x: &str| format!("{hf}{x}_proj.weight");
                        m.push((format!("{own}linear_fc1.weight"), GateUp(w("gate"), w("up"))));
                        m.push((format!("{own}linear_fc2.weight"), Same(w("down"))));
                    }
                    if moe.shared_expert_gate {
                        let gate = Same(format!("{b}shared_expert_gate.weight"));
                        m.push((format!("{o}mlp.shared_experts.gate_weight"), gate));
                    }
                } else {
                    let mlp = |x: &str| format!("{h}mlp.{x}_proj.weight");
                    m.push((format!("{o}mlp.linear_fc1.weight"), GateUp(mlp("gate"), mlp("up"))));
                    m.push((format!("{o}mlp.linear_fc2.weight"), Same(mlp("down"))));
                }
            }
            m.push(("decoder.final_layernorm.weight".into(), Same("model.norm.weight".into())));
        }
    }
    if !tied {
        m.push(("output_layer.weight".into(), Same(LM_HEAD.into())));
    }
    m
}

/// The output layer's HF name (both classes).
const LM_HEAD: &str = "lm_head.weight";

/// Every HF tensor's shape for `c` (vocabulary rows unpadded), by HF name without prefix.
fn hf_shape(arch: HfArch, c: &TransformerConfig, hf: &str) -> Vec<usize> {
    if arch == HfArch::Mamba2 {
        return mamba2::shape(c, hf);
    }
    if arch == HfArch::DeepseekV3 {
        return deepseek::shape(c, hf);
    }
    let (h, v) = (c.hidden_size, c.vocab_size);
    // The MLP's width: Qwen2-MoE's experts and shared experts have their own.
    let moe = crate::moe_spec(c);
    let f = match moe {
        Some(m) if hf.contains(".experts.") => m.ffn_hidden_size,
        Some(m) if hf.contains(".shared_expert.") => m.shared_expert_ffn.unwrap_or(0),
        _ => c.ffn_hidden_size,
    };
    let (q, kv) = (c.num_attention_heads * c.head_dim(), c.num_query_groups * c.head_dim());
    let last = hf.rsplit('.').nth(1).unwrap_or("");
    let is_bias = hf.ends_with(".bias");
    let dims: Vec<usize> = match (arch, last) {
        (_, "wte" | "embed_tokens" | "lm_head") => vec![v, h],
        (_, "wpe") => vec![c.max_position_embeddings, h],
        (HfArch::Gpt2, "c_attn") => vec![h, 3 * h],
        (HfArch::Gpt2, "c_fc") => vec![h, f],
        (HfArch::Gpt2, "c_proj") if hf.contains("mlp.") => vec![f, h],
        (HfArch::Gpt2, "c_proj") => vec![h, h],
        (_, "q_proj") => vec![q, h],
        (_, "k_proj" | "v_proj") => vec![kv, h],
        (_, "o_proj") => vec![h, q],
        (_, "gate_proj" | "up_proj" | "w1" | "w3") => vec![f, h],
        (_, "down_proj" | "w2") => vec![h, f],
        (HfArch::Mixtral | HfArch::Qwen2Moe | HfArch::Qwen3Moe, "gate") => vec![moe.map_or(0, |m| m.num_experts), h],
        (_, "q_norm" | "k_norm") => vec![c.head_dim()],
        (HfArch::Qwen2Moe, "shared_expert_gate") => vec![1, h],
        _ => vec![h], // norms
    };
    // A bias has the output's length: GPT-2's Conv1D weights are [in, out], the others [out, in].
    let out = if arch == HfArch::Gpt2 { dims.last() } else { dims.first() };
    if is_bias { vec![*out.unwrap_or(&h)] } else { dims }
}

/// The shape of the Megatron tensor that `map` makes (vocabulary rows unpadded).
fn own_shape(arch: HfArch, c: &TransformerConfig, map: &Map) -> Vec<usize> {
    let qkv_rows = (c.num_attention_heads + 2 * c.num_query_groups) * c.head_dim();
    match map {
        Map::Same(n) => hf_shape(arch, c, n),
        Map::Transposed(n) => hf_shape(arch, c, n).into_iter().rev().collect(),
        Map::Qkv(QkvSource::Gpt2 { weight: false, .. } | QkvSource::Llama { weight: false, .. }) => vec![qkv_rows],
        Map::Qkv(_) => vec![qkv_rows, c.hidden_size],
        Map::GateUp(gate, _) => {
            let s = hf_shape(arch, c, gate);
            vec![2 * s[0], s[1]]
        }
    }
}

/// Megatron-named tensors from an HF checkpoint. `take` hands out an HF tensor by name (without
/// GPT-2's `transformer.` prefix) or None; the caller then checks that nothing was left over.
/// Each Megatron tensor goes to `emit` as soon as it is made, so a caller that writes them out
/// as they come holds one tensor at a time, not the model. A tied model's `lm_head.weight`,
/// where a file has it, must equal the embedding.
pub fn import(
    arch: HfArch,
    c: &TransformerConfig,
    take: &mut dyn FnMut(&str) -> Option<HostTensor>,
    emit: &mut dyn FnMut(String, HostTensor),
) -> Result<()> {
    let mut get = |name: &str| -> Result<HostTensor> {
        let t = take(name).ok_or_else(|| HfError::Missing(name.into()))?;
        let want = hf_shape(arch, c, name);
        if t.shape != want {
            return Err(HfError::Shape { name: name.into(), got: t.shape, want });
        }
        Ok(t)
    };
    let (heads, groups, d) = (c.num_attention_heads, c.num_query_groups, c.head_dim());
    let tied = !c.untie_embeddings_and_output_weights;
    for (i, (own, map)) in maps(arch, c).into_iter().enumerate() {
        let t = match map {
            Map::Same(n) => get(&n)?,
            Map::Transposed(n) => transpose(&get(&n)?),
            Map::Qkv(QkvSource::Gpt2 { name, weight }) => {
                let t = get(&name)?;
                let t = if weight { transpose(&t) } else { t };
                let h = c.hidden_size;
                let [q, k, v] = [0, 1, 2].map(|i| row_block(&t, i * h, h));
                group_qkv(&q, &k, &v, heads, groups, d)
            }
            Map::Qkv(QkvSource::Llama { q, k, v, .. }) => group_qkv(&get(&q)?, &get(&k)?, &get(&v)?, heads, groups, d),
            Map::GateUp(gate, up) => concat_rows(&[&get(&gate)?, &get(&up)?]),
        };
        // The first map is the embedding: a tied head is compared with it here, so that it
        // need not be kept to the end.
        if tied && i == 0 {
            match get(LM_HEAD) {
                Ok(head) if head != t => return Err(HfError::UntiedHead(LM_HEAD.into())),
                Ok(_) | Err(HfError::Missing(_)) => {}
                Err(e) => return Err(e),
            }
        }
        emit(own, t);
    }
    Ok(())
}

/// The HF tensors `import` reads for `c` (names without GPT-2's prefix): the ones it needs, and
/// the ones it takes where present (a tied model's `lm_head.weight`), so that a converter can
/// check a folder against config.json before converting anything.
pub fn import_names(arch: HfArch, c: &TransformerConfig) -> (Vec<String>, Vec<String>) {
    let needed = maps(arch, c)
        .into_iter()
        .flat_map(|(_, m)| match m {
            Map::Same(n) | Map::Transposed(n) | Map::Qkv(QkvSource::Gpt2 { name: n, .. }) => vec![n],
            Map::Qkv(QkvSource::Llama { q, k, v, .. }) => vec![q, k, v],
            Map::GateUp(gate, up) => vec![gate, up],
        })
        .collect();
    let optional = if c.untie_embeddings_and_output_weights { vec![] } else { vec![LM_HEAD.to_string()] };
    (needed, optional)
}

/// `import` into one list: for models that fit in memory (tests, small checkpoints).
pub fn import_all(
    arch: HfArch,
    c: &TransformerConfig,
    take: &mut dyn FnMut(&str) -> Option<HostTensor>,
) -> Result<Vec<(String, HostTensor)>> {
    let mut out = vec![];
    import(arch, c, take, &mut |name, t| out.push((name, t)))?;
    Ok(out)
}

/// A whole tensor by Megatron name (read when asked for: a checkpoint need not be in memory).
pub type TensorLookup<'a> = dyn Fn(&str) -> Option<HostTensor> + 'a;

/// HF-named tensors (GPT-2's with the `transformer.` prefix that save_pretrained writes) from
/// Megatron-named ones: `get` gives a tensor by Megatron name, its vocabulary rows unpadded. Each
/// goes to `emit` as soon as it is made, in a fixed order, so a caller that writes them as they
/// come holds a file's worth, not the model.
pub fn export(
    arch: HfArch,
    c: &TransformerConfig,
    get: &TensorLookup,
    emit: &mut dyn FnMut(String, HostTensor),
) -> Result<()> {
    let (heads, groups, d) = (c.num_attention_heads, c.num_query_groups, c.head_dim());
    // Each tensor checked against its shape before any layout change reads it.
    let own = |name: &str, map: &Map| -> Result<HostTensor> {
        let t = get(name).ok_or_else(|| HfError::MissingOwn(name.into()))?;
        let want = own_shape(arch, c, map);
        let vocab = name.ends_with("word_embeddings.weight") || name == "output_layer.weight";
        // Vocabulary padding rows, if any were kept, are not HF's.
        let padded = vocab && t.shape.len() == 2 && t.shape[1] == want[1] && t.shape[0] > want[0];
        if t.shape != want && !padded {
            return Err(HfError::Shape { name: name.into(), got: t.shape, want });
        }
        if c.layer.zero_centred_gamma && zero_centred_norm(name) {
            // HF's norms hold the scale itself.
            return Ok(HostTensor::new(t.shape, t.data.iter().map(|w| w + 1.0).collect()));
        }
        Ok(if padded { row_block(&t, 0, c.vocab_size) } else { t })
    };
    // Query and key heads in HF's rotate-half order (the module doc).
    let interleaved = matches!(c.position_embedding, PositionEmbedding::Rope { interleaved: true, .. });
    let rotary_order = |t: HostTensor| if interleaved { deinterleave_heads(&t, d) } else { t };
    let prefix = if arch == HfArch::Gpt2 { "transformer." } else { "" };
    let named = |n: &str| if n == LM_HEAD { n.to_string() } else { format!("{prefix}{n}") };
    let mut put = |n: String, t: HostTensor| -> Result<()> {
        let want = hf_shape(arch, c, strip_prefix(arch, &n));
        if t.shape != want {
            return Err(HfError::Shape { name: n, got: t.shape, want });
        }
        emit(n, t);
        Ok(())
    };
    for (name, map) in maps(arch, c) {
        let t = own(&name, &map)?;
        match map {
            Map::Same(n) if name.ends_with("q_layernorm.weight") || name.ends_with("k_layernorm.weight") => {
                put(named(&n), rotary_order(t))?
            }
            Map::Same(n) => put(named(&n), t)?,
            Map::Transposed(n) => put(named(&n), transpose(&t))?,
            Map::Qkv(QkvSource::Gpt2 { name, weight }) => {
                let [q, k, v] = ungroup_qkv(&t, heads, groups, d);
                let joined = concat_rows(&[&rotary_order(q), &rotary_order(k), &v]);
                put(named(&name), if weight { transpose(&joined) } else { joined })?;
            }
            Map::Qkv(QkvSource::Llama { q, k, v, .. }) => {
                let [tq, tk, tv] = ungroup_qkv(&t, heads, groups, d);
                for (n, part) in [q, k, v].iter().zip([rotary_order(tq), rotary_order(tk), tv]) {
                    put(named(n), part)?;
                }
            }
            Map::GateUp(gate, up) => {
                let f = t.shape[0] / 2;
                put(named(&gate), row_block(&t, 0, f))?;
                put(named(&up), row_block(&t, f, f))?;
            }
        }
    }
    // DeepSeek-V3's MTP depths carry their own copies of the embedding and the head.
    if arch == HfArch::DeepseekV3 && c.mtp.is_some() {
        let emb = own("embedding.word_embeddings.weight", &Map::Same("model.embed_tokens.weight".into()))?;
        let head = match c.untie_embeddings_and_output_weights {
            true => own("output_layer.weight", &Map::Same(LM_HEAD.into()))?,
            false => emb.clone(),
        };
        for (n, t) in deepseek::shared_copies(c, &emb, &head) {
            put(n, t)?;
        }
    }
    Ok(())
}

/// Each `d`-row head of `t` [heads·d, ..] with its rows reordered from interleaved rotary pairs
/// (2j, 2j + 1) to rotate-half ones (j, j + d/2): row j of a head takes row 2j for j < d/2,
/// row 2(j − d/2) + 1 after.
fn deinterleave_heads(t: &HostTensor, d: usize) -> HostTensor {
    let width: usize = t.shape[1..].iter().product();
    let half = d / 2;
    let mut data = Vec::with_capacity(t.data.len());
    for head in 0..t.shape[0] / d {
        for j in 0..d {
            let row = head * d + if j < half { 2 * j } else { 2 * (j - half) + 1 };
            data.extend_from_slice(&t.data[row * width..(row + 1) * width]);
        }
    }
    HostTensor::new(t.shape.clone(), data)
}

/// Whether Megatron-named `name` is the weight of one of the model's norms (`Norm` modules:
/// the layers', QK-norm's, MLA's latent norms, MTP's, the final one), which a zero-centred model
/// (--apply-layernorm-1p) holds as the scale less 1. A Mamba mixer's gated norm and the vision
/// encoder's norms are plain ones, in Megatron too.
fn zero_centred_norm(name: &str) -> bool {
    if name.starts_with("vision_model.") || name.contains(".mixer.") {
        return false;
    }
    let Some(stem) = name.strip_suffix(".weight") else { return false };
    let module = stem.rsplit('.').next().unwrap_or(stem);
    module.ends_with("layernorm") || matches!(module, "enorm" | "hnorm" | "norm" | "final_norm")
}

/// `export` into one list: for models that fit in memory (tests, small checkpoints).
pub fn export_all(arch: HfArch, c: &TransformerConfig, get: &TensorLookup) -> Result<Vec<(String, HostTensor)>> {
    let mut out = vec![];
    export(arch, c, get, &mut |n, t| out.push((n, t)))?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn tiny(arch: HfArch) -> TransformerConfig {
        let v = match arch {
            HfArch::Gpt2 => json!({"model_type": "gpt2", "vocab_size": 11, "n_positions": 6, "n_embd": 8,
                "n_layer": 2, "n_head": 2, "n_inner": 12}),
            HfArch::Mixtral => json!({"model_type": "mixtral", "sliding_window": 5, "vocab_size": 11,
                "hidden_size": 8, "intermediate_size": 6, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 6, "max_position_embeddings": 16,
                "tie_word_embeddings": false, "num_local_experts": 3, "num_experts_per_tok": 2,
                "router_aux_loss_coef": 0.02}),
            // Every width its own: dense 6, experts 5, shared experts 7.
            HfArch::Qwen2Moe => json!({"model_type": "qwen2_moe", "vocab_size": 11, "hidden_size": 8,
                "intermediate_size": 6, "moe_intermediate_size": 5, "shared_expert_intermediate_size": 7,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 6,
                "max_position_embeddings": 16, "tie_word_embeddings": false, "num_experts": 3,
                "num_experts_per_tok": 2, "norm_topk_prob": false, "router_aux_loss_coef": 0.001}),
            HfArch::Qwen3 => json!({"model_type": "qwen3", "vocab_size": 11, "hidden_size": 8,
                "intermediate_size": 6, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 6, "max_position_embeddings": 16, "tie_word_embeddings": true}),
            HfArch::Qwen3Moe => json!({"model_type": "qwen3_moe", "vocab_size": 11, "hidden_size": 8,
                "intermediate_size": 6, "moe_intermediate_size": 5, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 6, "max_position_embeddings": 16, "tie_word_embeddings": false,
                "num_experts": 3, "num_experts_per_tok": 2, "norm_topk_prob": true}),
            // A dense first layer, then 4 experts of 5 in 2 groups (top 2 from the best group) and
            // a shared expert; a query latent of 4, a key/value latent of 3.
            HfArch::DeepseekV3 => json!({"model_type": "deepseek_v3", "vocab_size": 11, "hidden_size": 8,
                "intermediate_size": 6, "moe_intermediate_size": 5, "num_hidden_layers": 2, "num_attention_heads": 2,
                "num_key_value_heads": 2, "q_lora_rank": 4, "kv_lora_rank": 3, "qk_nope_head_dim": 2,
                "qk_rope_head_dim": 2, "v_head_dim": 3, "n_routed_experts": 4, "n_shared_experts": 1,
                "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5,
                "first_k_dense_replace": 1, "max_position_embeddings": 16, "tie_word_embeddings": false,
                "num_nextn_predict_layers": 1}),
            HfArch::Mamba2 => json!({"model_type": "mamba2", "vocab_size": 11, "hidden_size": 8,
                "num_hidden_layers": 2, "state_size": 3, "head_dim": 4, "num_heads": 4, "expand": 2, "n_groups": 2,
                "conv_kernel": 4, "tie_word_embeddings": false}),
            // LLaVA's own tests are hf/llava.rs's; its language model is a Llama.
            HfArch::Llama | HfArch::Mistral | HfArch::Qwen2 | HfArch::Llava => {
                json!({"model_type": match arch { HfArch::Llama | HfArch::Llava => "llama", HfArch::Qwen2 => "qwen2", _ => "mistral" },
                "sliding_window": 5, "vocab_size": 11, "hidden_size": 8,
                "intermediate_size": 6, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 6, "max_position_embeddings": 16,
                "tie_word_embeddings": false})
            }
        };
        from_hf_config(&v).unwrap().config
    }

    /// Distinct values everywhere, so any misplaced element shows.
    fn numbered(shape: &[usize], seed: usize) -> HostTensor {
        let n: usize = shape.iter().product();
        HostTensor::new(shape.to_vec(), (0..n).map(|i| (seed * 1000 + i) as f32).collect())
    }

    #[test]
    fn grouped_qkv_puts_each_groups_heads_then_its_key_and_value() {
        // 4 query heads in 2 groups, head width 1: q0 q1 k0 v0 | q2 q3 k1 v1.
        let col = |v: Vec<f32>| HostTensor::new(vec![v.len(), 1], v);
        let g = group_qkv(&col(vec![0., 1., 2., 3.]), &col(vec![10., 11.]), &col(vec![20., 21.]), 4, 2, 1);
        assert_eq!(g.data, [0., 1., 10., 20., 2., 3., 11., 21.]);
        let [q, k, v] = ungroup_qkv(&g, 4, 2, 1);
        assert_eq!((q.data, k.data, v.data), (vec![0., 1., 2., 3.], vec![10., 11.], vec![20., 21.]));
    }

    /// Tensors by name, in order.
    type Named = Vec<(String, HostTensor)>;

    /// Numbered tensors of every name `maps` gives for `c` (shapes as a checkpoint holds them:
    /// Megatron's, vocabulary unpadded), exported as `c`, imported as `into`: (the tensors, what
    /// came back, the exported files the import did not read).
    fn export_then_import(
        arch: HfArch,
        c: &TransformerConfig,
        into: &TransformerConfig,
    ) -> (Named, Named, HashMap<String, HostTensor>) {
        let own: Named = maps(arch, c)
            .iter()
            .enumerate()
            .map(|(i, (name, _))| (name.clone(), numbered(&own_shape(c, name), i)))
            .collect();
        let by_name: HashMap<&str, &HostTensor> = own.iter().map(|(n, t)| (n.as_str(), t)).collect();
        let hf = export_all(arch, c, &|n| by_name.get(n).map(|&t| t.clone())).unwrap();
        let mut files: HashMap<String, HostTensor> =
            hf.into_iter().map(|(n, t)| (strip_prefix(arch, &n).to_string(), t)).collect();
        let back = import_all(arch, into, &mut |n| files.remove(n)).unwrap();
        (own, back, files)
    }

    #[test]
    fn export_then_import_gives_every_tensor_back() {
        for arch in [
            HfArch::Gpt2,
            HfArch::Llama,
            HfArch::Mistral,
            HfArch::Qwen2,
            HfArch::Mixtral,
            HfArch::Qwen2Moe,
            HfArch::Qwen3,
            HfArch::Qwen3Moe,
            HfArch::Mamba2,
            HfArch::DeepseekV3,
        ] {
            let c = tiny(arch);
            assert_eq!(HfArch::of(&c).unwrap(), arch);
            let (own, back, mut files) = export_then_import(arch, &c, &c);
            // What the import reads past: DeepSeek's per-depth copies of the shared layers.
            files.retain(|n, _| !is_buffer(n));
            assert!(files.is_empty(), "{arch:?}: left over {:?}", files.keys());
            assert_eq!(back, own, "{arch:?}");
        }
    }

    /// A zero-centred model (--apply-layernorm-1p) exports as the plain class with every norm
    /// weight (the built model's zero-initialised weights: its `Norm`s) 1 more, the rest as is.
    #[test]
    fn zero_centred_norms_export_as_their_scale() {
        for arch in [HfArch::Gpt2, HfArch::Qwen3, HfArch::Qwen3Moe, HfArch::Mamba2, HfArch::DeepseekV3] {
            let plain = tiny(arch);
            let c = TransformerConfig {
                layer: LayerSpec { zero_centred_gamma: true, ..plain.layer.clone() },
                ..plain.clone()
            };
            assert_eq!(HfArch::of(&c).unwrap(), arch);
            let (_, table) = ferrotron_transformer::GptModel::build(
                c.clone(),
                &ferrotron_core::Device::Cpu,
                ferrotron_core::DType::F32,
                1,
            )
            .unwrap();
            let norms: Vec<&str> = table
                .metas()
                .iter()
                .filter(|m| m.name.ends_with(".weight") && m.init == ferrotron_core::Init::Zeros)
                .map(|m| m.name.as_str())
                .collect();
            let (own, back, _) = export_then_import(arch, &c, &plain);
            let mut shifted = 0;
            for ((name, t), (_, b)) in own.iter().zip(&back) {
                let norm = norms.contains(&name.as_str());
                let want: Vec<f32> = t.data.iter().map(|v| v + if norm { 1.0 } else { 0.0 }).collect();
                assert_eq!(b.data, want, "{arch:?} {name}");
                shifted += usize::from(norm);
            }
            assert_eq!(shifted, norms.len(), "{arch:?}: every norm exported");
            assert!(shifted > c.num_layers, "{arch:?}: {norms:?}");
        }
    }

    /// DeepSeek-V3's MTP depth is the layer after the decoder's (here layer 2): its projection,
    /// norms and the shared head's norm as Megatron's `mtp.layers.0`, its layer's MoE router as
    /// the depth's `transformer_layer`'s, and the export writes the per-depth copies of the
    /// embedding and output layer.
    #[test]
    fn deepseek_v3_mtp_depths_are_the_layers_after_the_decoders() {
        let c = tiny(HfArch::DeepseekV3);
        assert_eq!(c.mtp.map(|m| m.num_layers), Some(1));
        let m = maps(HfArch::DeepseekV3, &c);
        let hf_of = |own: &str| match m.iter().find(|(o, _)| o == own).map(|(_, map)| map) {
            Some(Map::Same(n)) => n.clone(),
            _ => panic!("{own}: not mapped as the same tensor"),
        };
        assert_eq!(hf_of("mtp.layers.0.eh_proj.weight"), "model.layers.2.eh_proj.weight");
        assert_eq!(hf_of("mtp.layers.0.final_layernorm.weight"), "model.layers.2.shared_head.norm.weight");
        assert_eq!(hf_of("mtp.layers.0.transformer_layer.mlp.router.weight"), "model.layers.2.mlp.gate.weight");
        assert_eq!(
            hf_of("mtp.layers.0.transformer_layer.self_attention.linear_kv_down_proj.weight"),
            "model.layers.2.self_attn.kv_a_proj_with_mqa.weight"
        );
        assert_eq!(mtp_probe(HfArch::DeepseekV3, &c).as_deref(), Some("model.layers.2.eh_proj.weight"));
        let own: Vec<(String, HostTensor)> =
            m.iter().enumerate().map(|(i, (name, _))| (name.clone(), numbered(&own_shape(&c, name), i))).collect();
        let by_name: HashMap<&str, &HostTensor> = own.iter().map(|(n, t)| (n.as_str(), t)).collect();
        let hf = export_all(HfArch::DeepseekV3, &c, &|n| by_name.get(n).map(|&t| t.clone())).unwrap();
        let get = |n: &str| hf.iter().find(|(name, _)| name == n).map(|(_, t)| t.clone()).unwrap();
        assert_eq!(get("model.layers.2.shared_head.head.weight"), get("lm_head.weight"));
        assert_eq!(get("model.layers.2.embed_tokens.weight"), get("model.embed_tokens.weight"));
    }

    fn own_shape(c: &TransformerConfig, name: &str) -> Vec<usize> {
        if name.ends_with(".router.expert_bias") {
            // A buffer of the router's, one value per expert.
            return vec![crate::moe_spec(c).map_or(0, |m| m.num_experts)];
        }
        if c.layer.hybrid.is_some() || crate::moe_spec(c).is_some() || c.layer.attention.qk_layernorm {
            // A Mamba, MoE or QK-norm model's shapes as the built model registers them
            // (vocabulary unpadded): the experts' and shared experts' widths are their own, the
            // QK-norms a head's.
            let (_, table) = ferrotron_transformer::GptModel::build(
                TransformerConfig { make_vocab_size_divisible_by: 1, ..c.clone() },
                &ferrotron_core::Device::Cpu,
                ferrotron_core::DType::F32,
                1,
            )
            .unwrap();
            return table.metas().iter().find(|m| m.name == name).unwrap().global_shape.dims().to_vec();
        }
        let (h, d) = (c.hidden_size, c.head_dim());
        let qkv = (c.num_attention_heads + 2 * c.num_query_groups) * d;
        let blocks = if c.layer.norm == NormKind::RmsNorm { 2 } else { 1 };
        let bias = name.ends_with(".bias");
        let w = |rows: usize, cols: usize| if bias { vec![rows] } else { vec![rows, cols] };
        match name.rsplit('.').nth(1).unwrap() {
            "word_embeddings" | "output_layer" => vec![c.vocab_size, h],
            "router" => vec![crate::moe_spec(c).unwrap().num_experts, h],
            "position_embeddings" => vec![c.max_position_embeddings, h],
            "linear_qkv" => w(qkv, h),
            "linear_proj" => w(h, c.num_attention_heads * d),
            "linear_fc1" => w(blocks * c.ffn_hidden_size, h),
            "linear_fc2" => w(h, c.ffn_hidden_size),
            _ => vec![h],
        }
    }

    #[test]
    fn gpt2_conv1d_weights_are_transposed_and_c_attn_regrouped() {
        let c = tiny(HfArch::Gpt2);
        let h = c.hidden_size;
        let mut files: HashMap<String, HostTensor> = HashMap::new();
        for (i, n) in gpt2_names(&c).iter().enumerate() {
            files.insert(n.clone(), numbered(&hf_shape(HfArch::Gpt2, &c, n), i));
        }
        let c_attn = files["h.0.attn.c_attn.weight"].clone(); // [in h, out 3h]
        let c_fc = files["h.1.mlp.c_fc.weight"].clone();
        let own: HashMap<String, HostTensor> =
            import_all(HfArch::Gpt2, &c, &mut |n| files.remove(n)).unwrap().into_iter().collect();
        let fc1 = &own["decoder.layers.1.mlp.linear_fc1.weight"]; // [out f, in h]
        assert_eq!(fc1.shape, [c.ffn_hidden_size, h]);
        assert_eq!(fc1.data[3 * h + 5], c_fc.data[5 * c.ffn_hidden_size + 3]);
        // Head 1's key (HF output column h + d + j) is grouped row 1·3d + d + j.
        let qkv = &own["decoder.layers.0.self_attention.linear_qkv.weight"];
        let d = c.head_dim();
        for j in 0..d {
            for input in 0..h {
                assert_eq!(qkv.data[(3 * d + d + j) * h + input], c_attn.data[input * 3 * h + h + d + j]);
            }
        }
    }

    fn gpt2_names(c: &TransformerConfig) -> Vec<String> {
        let mut v = vec!["wte.weight".to_string(), "wpe.weight".into(), "ln_f.weight".into(), "ln_f.bias".into()];
        for i in 0..c.num_layers {
            for n in ["ln_1", "ln_2", "attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"] {
                v.push(format!("h.{i}.{n}.weight"));
                v.push(format!("h.{i}.{n}.bias"));
            }
        }
        v
    }

    #[test]
    fn missing_and_misshapen_tensors_are_named() {
        let c = tiny(HfArch::Llama);
        let e = import_all(HfArch::Llama, &c, &mut |_| None).unwrap_err().to_string();
        assert!(e.contains("model.embed_tokens.weight") && e.contains("missing"), "{e}");
        let e = import_all(HfArch::Llama, &c, &mut |n| Some(numbered(&[3, 3], n.len()))).unwrap_err().to_string();
        assert!(e.contains("model.embed_tokens.weight") && e.contains("[3, 3]") && e.contains("[11, 8]"), "{e}");
    }

    #[test]
    fn an_export_names_a_tensor_of_the_wrong_shape_instead_of_reading_past_it() {
        let c = tiny(HfArch::Llama);
        // Every tensor right (the embedding with 5 padding rows) but layer 1's QKV, 4 rows short.
        let tensors: HashMap<String, HostTensor> = maps(HfArch::Llama, &c)
            .iter()
            .map(|(name, map)| {
                let mut shape = super::own_shape(HfArch::Llama, &c, map);
                if name.ends_with("word_embeddings.weight") {
                    shape[0] += 5;
                }
                if name == "decoder.layers.1.self_attention.linear_qkv.weight" {
                    shape[0] -= 4;
                }
                (name.clone(), numbered(&shape, 1))
            })
            .collect();
        let get = |n: &str| tensors.get(n).cloned();
        let e = export_all(HfArch::Llama, &c, &get).unwrap_err().to_string();
        assert!(e.contains("decoder.layers.1.self_attention.linear_qkv.weight") && e.contains("[44, 8]"), "{e}");
    }

    #[test]
    fn a_tied_head_that_differs_from_the_embedding_is_refused() {
        let mut c = tiny(HfArch::Llama);
        c.untie_embeddings_and_output_weights = false;
        let mut take = |n: &str| Some(numbered(&hf_shape(HfArch::Llama, &c, n), if n == LM_HEAD { 1 } else { 0 }));
        let e = import_all(HfArch::Llama, &c, &mut take).unwrap_err();
        assert!(matches!(e, HfError::UntiedHead(_)), "{e}");
        let mut same = |n: &str| Some(numbered(&hf_shape(HfArch::Llama, &c, n), 0));
        assert!(import_all(HfArch::Llama, &c, &mut same).is_ok());
    }

    #[test]
    fn config_json_round_trips() {
        for arch in [HfArch::Gpt2, HfArch::Llama, HfArch::Mistral, HfArch::Qwen2Moe, HfArch::Qwen3, HfArch::Qwen3Moe] {
            let c = tiny(arch);
            let back = from_hf_config(&to_hf_config(arch, &c, "bfloat16")).unwrap();
            assert_eq!(back.arch, arch);
            assert_eq!(back.dtype.as_deref(), Some("bfloat16"));
            let b = back.config;
            assert_eq!(
                (b.num_layers, b.hidden_size, b.num_attention_heads, b.num_query_groups, b.head_dim()),
                (c.num_layers, c.hidden_size, c.num_attention_heads, c.num_query_groups, c.head_dim())
            );
            assert_eq!(
                (b.ffn_hidden_size, b.vocab_size, b.max_position_embeddings),
                (c.ffn_hidden_size, 11, c.max_position_embeddings)
            );
            assert_eq!(b.position_embedding, c.position_embedding);
            assert_eq!(b.untie_embeddings_and_output_weights, c.untie_embeddings_and_output_weights);
            assert_eq!(b.layer.attention, c.layer.attention);
            assert_eq!(b.norm_epsilon, c.norm_epsilon);
        }
    }

    #[test]
    fn block_scaled_fp8_is_read_and_other_quantization_refused() {
        let mut v = to_hf_config(HfArch::Llama, &tiny(HfArch::Llama), "bfloat16");
        assert_eq!(from_hf_config(&v).unwrap().fp8_block, None);
        let q = |v: &mut Value, q: Value| v.as_object_mut().unwrap().insert("quantization_config".into(), q);
        q(
            &mut v,
            json!({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 64]}),
        );
        assert_eq!(from_hf_config(&v).unwrap().fp8_block, Some([128, 64]));
        for (bad, needle) in [
            (json!({"quant_method": "gptq", "bits": 4}), "quant_method `gptq`"),
            (json!({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}), "fmt `e5m2`"),
            (json!({"quant_method": "fp8", "activation_scheme": "static"}), "weight_block_size (absent)"),
            (json!({"quant_method": "fp8", "weight_block_size": [0, 128]}), "weight_block_size [0,128]"),
        ] {
            q(&mut v, bad);
            let e = from_hf_config(&v).unwrap_err().to_string();
            assert!(e.contains(needle), "{e}");
        }
    }

    #[test]
    fn transformers_5_rope_parameters_are_read_and_scaled_rope_refused() {
        let mut v = to_hf_config(HfArch::Llama, &tiny(HfArch::Llama), "float32");
        let o = v.as_object_mut().unwrap();
        o.remove("rope_theta");
        o.insert("rope_parameters".into(), json!({"rope_type": "default", "rope_theta": 500000.0}));
        let rope = |v: &Value| from_hf_config(v).unwrap().config.position_embedding;
        assert_eq!(rope(&v), PositionEmbedding::rope(500000.0));
        // Llama 3.2's scaling, as transformers 5 writes it; then with a constant Megatron fixes changed.
        v["rope_parameters"] = json!({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
        let llama32 = PositionEmbedding::Rope {
            base: 500000.0,
            scaling: Some(RopeScaling::llama3(32.0)),
            percent: 1.0,
            interpolation: None,
            interleaved: false,
        };
        assert_eq!(rope(&v), llama32);
        let c = from_hf_config(&v).unwrap().config;
        assert_eq!(
            rope(&to_hf_config(HfArch::Llama, &c, "float32")),
            llama32,
            "exported as transformers 4's rope_scaling"
        );
        v["rope_parameters"]["original_max_position_embeddings"] = json!(4096);
        let e = from_hf_config(&v).unwrap_err().to_string();
        assert!(e.contains("original_max_position_embeddings 4096") && e.contains("--use-rope-scaling"), "{e}");
        v["rope_parameters"]["rope_type"] = json!("yarn");
        let e = from_hf_config(&v).unwrap_err().to_string();
        assert!(e.contains("yarn") && e.contains("not implemented"), "{e}");
        let mut v = to_hf_config(HfArch::Llama, &tiny(HfArch::Llama), "float32");
        // transformers' linear interpolation is Megatron's --rotary-seq-len-interpolation-factor;
        // dynamic NTK scaling is not built.
        v["rope_scaling"] = json!({"type": "linear", "factor": 2.0});
        assert!(matches!(rope(&v), PositionEmbedding::Rope { interpolation: Some(2.0), scaling: None, .. }));
        v["rope_scaling"] = json!({"type": "dynamic", "factor": 2.0});
        assert!(from_hf_config(&v).unwrap_err().to_string().contains("dynamic"));
    }

    #[test]
    fn what_ferrotron_cannot_compute_is_refused_by_name() {
        let mut v = to_hf_config(HfArch::Gpt2, &tiny(HfArch::Gpt2), "float32");
        v["activation_function"] = json!("gelu");
        assert!(from_hf_config(&v).unwrap_err().to_string().contains("tanh approximation"));
        let mut v = to_hf_config(HfArch::Llama, &tiny(HfArch::Llama), "float32");
        v["attention_bias"] = json!(true);
        assert!(from_hf_config(&v).unwrap_err().to_string().contains("attention_bias"));
        v["model_type"] = json!("mixtral");
        assert!(from_hf_config(&v).unwrap_err().to_string().contains("attention_bias"));
        let mut v = to_hf_config(HfArch::Mixtral, &tiny(HfArch::Mixtral), "float32");
        assert_eq!((v["num_local_experts"].clone(), v["num_experts_per_tok"].clone()), (json!(3), json!(2)));
        v["router_jitter_noise"] = json!(0.1);
        assert!(from_hf_config(&v).unwrap_err().to_string().contains("router_jitter_noise"));
        // Qwen2-MoE: its widths and routing read back; what it has that Ferrotron does not, named.
        let q = tiny(HfArch::Qwen2Moe);
        let qv = to_hf_config(HfArch::Qwen2Moe, &q, "float32");
        let m = crate::moe_spec(&q).unwrap();
        assert_eq!((m.ffn_hidden_size, m.shared_expert_ffn, q.ffn_hidden_size), (5, Some(7), 6));
        assert!(m.shared_expert_gate && m.router.pre_softmax && q.layer.attention.qkv_bias);
        assert_eq!(from_hf_config(&qv).unwrap().arch, HfArch::Qwen2Moe);
        // Dense layers among the experts' (transformers: experts where i ∉ mlp_only_layers and
        // (i + 1) % decoder_sparse_step == 0) as --moe-layer-freq, written back as mlp_only_layers.
        let layers = q.num_layers;
        assert!(layers >= 2, "the test needs two layers");
        for (step, only, dense) in
            [(1, json!([0]), vec![0]), (2, json!([]), (0..layers).step_by(2).collect::<Vec<_>>())]
        {
            let mut w = qv.clone();
            (w["decoder_sparse_step"], w["mlp_only_layers"]) = (json!(step), only);
            let c = from_hf_config(&w).unwrap().config;
            let o = c.layer.other_mlp.as_ref().unwrap();
            assert_eq!((0..layers).filter(|&i| o.layers[i]).collect::<Vec<_>>(), dense, "step {step}");
            assert!(matches!(o.mlp, MlpSpec::Dense { activation: Activation::SwiGlu, bias: false }));
            let back = to_hf_config(HfArch::of(&c).unwrap(), &c, "float32");
            assert_eq!(
                (back["decoder_sparse_step"].clone(), back["mlp_only_layers"].clone()),
                (json!(1), json!(dense))
            );
        }
        for (key, val, want) in [
            ("decoder_sparse_step", json!(0), "decoder_sparse_step 0"),
            ("decoder_sparse_step", json!(layers + 1), "no layer has experts"),
            ("mlp_only_layers", json!([layers]), "mlp_only_layers has"),
            ("shared_expert_intermediate_size", json!(0), "shared_expert_intermediate_size 0"),
            ("use_sliding_window", json!(true), "use_sliding_window"),
        ] {
            let mut w = qv.clone();
            w[key] = val;
            let e = from_hf_config(&w).unwrap_err().to_string();
            assert!(e.contains(want), "{key}: {e}");
        }
        let ungated = TransformerConfig {
            layer: LayerSpec {
                mlp: MlpSpec::Custom(Arc::new(MoeSpec { shared_expert_gate: false, ..m.clone() })),
                ..q.layer.clone()
            },
            ..q.clone()
        };
        let e = HfArch::of(&ungated).unwrap_err().to_string();
        assert!(e.contains("Qwen2MoeForCausalLM") && e.contains("--moe-shared-expert-gate"), "{e}");
        v["model_type"] = json!("gemma2");
        assert!(from_hf_config(&v).unwrap_err().to_string().contains("gemma2"));
        // DeepSeek-V3's: what Megatron's router (or Ferrotron's RoPE) would compute otherwise.
        let ds = || {
            json!({"model_type": "deepseek_v3", "vocab_size": 11, "hidden_size": 8, "intermediate_size": 6,
                "moe_intermediate_size": 5, "num_hidden_layers": 2, "num_attention_heads": 2, "q_lora_rank": 4,
                "kv_lora_rank": 3, "qk_nope_head_dim": 2, "qk_rope_head_dim": 2, "v_head_dim": 3,
                "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 2,
                "topk_group": 1, "first_k_dense_replace": 1, "max_position_embeddings": 16})
        };
        assert!(from_hf_config(&ds()).is_ok());
        // One group: no group limit, whatever the top-k (and written back so).
        let mut one = ds();
        (one["n_group"], one["topk_group"], one["num_experts_per_tok"]) = (json!(1), json!(1), json!(3));
        let c = from_hf_config(&one).unwrap().config;
        assert_eq!(crate::moe_spec(&c).map(|m| (m.router.topk, m.router.groups)), Some((3, None)));
        assert!(from_hf_config(&to_hf_config(HfArch::DeepseekV3, &c, "float32")).is_ok());
        // DeepSeek-V3's YaRN (transformers 5's rope_parameters): Megatron's at factor 40 with both
        // mscales, written back as rope_scaling, read again the same.
        let mut y = ds();
        y["rope_parameters"] = json!({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
            "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0});
        let c = from_hf_config(&y).unwrap().config;
        let yarn = c.layer.attention.mla.and_then(|m| m.yarn).unwrap();
        assert_eq!((yarn.factor, yarn.mscale, yarn.mscale_all_dim), (40.0, 1.0, 1.0));
        assert_eq!(c.position_embedding, PositionEmbedding::rope(10000.0));
        let back = to_hf_config(HfArch::DeepseekV3, &c, "float32");
        assert_eq!(from_hf_config(&back).unwrap().config.layer.attention.mla, c.layer.attention.mla);
        // Kimi-K2's YaRN: betas 1 and 1 over a context of 4096, kept and written back.
        y["rope_parameters"] = json!({"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0,
            "original_max_position_embeddings": 4096, "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0});
        let c = from_hf_config(&y).unwrap().config;
        let yarn = c.layer.attention.mla.and_then(|m| m.yarn).unwrap();
        assert_eq!(
            (yarn.factor, yarn.beta_fast, yarn.beta_slow, yarn.original_max_position_embeddings),
            (32.0, 1.0, 1.0, 4096.0)
        );
        let back = to_hf_config(HfArch::DeepseekV3, &c, "float32");
        assert_eq!(from_hf_config(&back).unwrap().config.layer.attention.mla, c.layer.attention.mla);
        for (key, value, needle) in [
            ("topk_group", json!(2), "best 2"),
            ("scoring_func", json!("softmax"), "noaux_tc"),
            ("norm_topk_prob", json!(false), "norm_topk_prob"),
            ("rope_interleave", json!(false), "interleaved"),
            (
                "rope_scaling",
                json!({"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale_all_dim": 1.0}),
                "no mscale",
            ),
            (
                "rope_scaling",
                json!({"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "attention_factor": 1.0}),
                "attention_factor",
            ),
        ] {
            let mut v = ds();
            v[key] = value;
            let e = from_hf_config(&v).unwrap_err().to_string();
            assert!(e.contains(needle), "{key}: {e}");
        }
        let mut c = tiny(HfArch::Mixtral);
        let mut m = crate::moe_spec(&c).unwrap().clone();
        m.router.pre_softmax = true;
        c.layer.mlp = MlpSpec::Custom(Arc::new(m));
        assert!(HfArch::of(&c).unwrap_err().to_string().contains("renormalises"));
        let mut c = tiny(HfArch::Mixtral);
        let mut m = crate::moe_spec(&c).unwrap().clone();
        m.router.score = ferrotron_moe::Score::Sigmoid;
        c.layer.mlp = MlpSpec::Custom(Arc::new(m));
        assert!(HfArch::of(&c).unwrap_err().to_string().contains("softmax top-k"));
        // QK-norm makes a Llama a Qwen3; with q/k/v biases it is neither.
        let mut c = tiny(HfArch::Llama);
        c.layer.attention.qk_layernorm = true;
        assert_eq!(HfArch::of(&c).unwrap(), HfArch::Qwen3);
        c.layer.attention.qkv_bias = true;
        assert!(HfArch::of(&c).unwrap_err().to_string().contains("QK-LayerNorm"));
        let mut c = tiny(HfArch::Gpt2);
        c.num_query_groups = 1;
        assert!(HfArch::of(&c).unwrap_err().to_string().contains("grouped-query"));
    }
}
