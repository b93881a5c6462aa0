//! ferrotron-models: presets. A preset is a function from a size to a `TransformerConfig`, not a
//! factory with a dozen flags: `gpt2(GptSize::Gpt124m)`, `llama(LlamaSize::Llama1b)` or
//! `mixtral(MixtralSize::Tiny)` (its MLP a ferrotron-moe spec), `mamba_hybrid(MambaSize::Tiny)`
//! (Mamba-2 mixers from ferrotron-ssm among attention and MLP layers, `hybrid`). Trainer flags then override single
//! fields.
//!
//! FLOP and parameter counts come with the config (`num_params`, `flops_per_token`) so that MFU can
//! be reported for any preset.
//!
//! `hf` maps these models to and from Hugging Face transformers' GPT-2, Llama and Mistral checkpoints
//! (config.json and parameter names and layouts), for `ferrotron convert`.

pub mod hf;
pub mod hybrid;

use ferrotron_moe::{MoeSpec, RouterSpec};
use ferrotron_transformer::TransformerConfig;
use ferrotron_transformer::spec::{
    Activation, AttentionSpec, LayerSpec, MlpSpec, NormKind, PositionEmbedding, SoftmaxType,
};
use std::sync::Arc;

/// Megatron pads the vocabulary to a multiple of this (times the tensor-parallel size).
pub const VOCAB_DIVISIBLE_BY: usize = 128;

/// GPT-2 BPE vocabulary (50257 tokens).
pub const GPT2_VOCAB: usize = 50257;
/// Byte-level vocabulary of the tiny presets.
pub const BYTE_VOCAB: usize = 256;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GptSize {
    /// 4 layers, hidden 128, byte-level: trains on a laptop CPU in minutes.
    Tiny,
    /// 6 layers, hidden 384, GPT-2 BPE.
    Small,
    /// GPT-2 124M: 12 layers, hidden 768, seq 1024.
    Gpt124m,
    /// GPT 1.3B: 24 layers, hidden 2048, 16 heads, seq 2048.
    Gpt1_3b,
    /// GPT 6.7B (GPT-3's shape): 32 layers, hidden 4096, 32 heads, seq 2048: the model of the
    /// multi-GPU layout table.
    Gpt6_7b,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LlamaSize {
    /// 4 layers, hidden 128, GQA 4 heads / 2 groups, byte-level.
    Tiny,
    /// Llama-style 1B: 16 layers, hidden 2048, 32 heads / 8 groups, ffn 8192, seq 4096.
    Llama1b,
}

/// GPT-2 style: LayerNorm, GeLU, learned absolute positions, biases, tied embeddings.
pub fn gpt2(size: GptSize) -> TransformerConfig {
    let (layers, hidden, heads, seq, vocab) = match size {
        GptSize::Tiny => (4, 128, 4, 128, BYTE_VOCAB),
        GptSize::Small => (6, 384, 6, 256, GPT2_VOCAB),
        GptSize::Gpt124m => (12, 768, 12, 1024, GPT2_VOCAB),
        GptSize::Gpt1_3b => (24, 2048, 16, 2048, GPT2_VOCAB),
        GptSize::Gpt6_7b => (32, 4096, 32, 2048, GPT2_VOCAB),
    };
    TransformerConfig {
        num_layers: layers,
        hidden_size: hidden,
        num_attention_heads: heads,
        num_query_groups: heads,
        kv_channels: None,
        ffn_hidden_size: 4 * hidden,
        seq_length: seq,
        max_position_embeddings: seq,
        vocab_size: vocab,
        make_vocab_size_divisible_by: VOCAB_DIVISIBLE_BY,
        position_embedding: PositionEmbedding::LearnedAbsolute,
        untie_embeddings_and_output_weights: false,
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
        norm_epsilon: 1e-5,
        init_method_std: 0.02,
        embedding_init_method_std: None,
        hidden_dropout: 0.0,
        attention_dropout: 0.0,
        mtp: None,
    }
}

/// Llama style: RMSNorm, SwiGLU, RoPE, GQA, no biases, untied output layer.
pub fn llama(size: LlamaSize) -> TransformerConfig {
    let (layers, hidden, heads, groups, ffn, seq, vocab) = match size {
        LlamaSize::Tiny => (4, 128, 4, 2, 352, 128, BYTE_VOCAB),
        LlamaSize::Llama1b => (16, 2048, 32, 8, 8192, 4096, GPT2_VOCAB),
    };
    TransformerConfig {
        num_layers: layers,
        hidden_size: hidden,
        num_attention_heads: heads,
        num_query_groups: groups,
        kv_channels: None,
        ffn_hidden_size: ffn,
        seq_length: seq,
        max_position_embeddings: seq,
        vocab_size: vocab,
        make_vocab_size_divisible_by: VOCAB_DIVISIBLE_BY,
        position_embedding: PositionEmbedding::rope(500000.0),
        untie_embeddings_and_output_weights: true,
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
        norm_epsilon: 1e-5,
        init_method_std: 0.02,
        embedding_init_method_std: None,
        hidden_dropout: 0.0,
        attention_dropout: 0.0,
        mtp: None,
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MixtralSize {
    /// llama-tiny's attention with 8 experts of width 176 in every layer, 2 per token: the same
    /// products per token as llama-tiny's MLP (2 × 176 = 352), four times its MLP parameters.
    Tiny,
}

/// Mixtral style: Llama's layers with a mixture-of-experts MLP (SwiGLU experts, top-2 with the
/// top-k softmax renormalised, the load-balancing loss at 1e-2 and the z-loss at 1e-3).
pub fn mixtral(size: MixtralSize) -> TransformerConfig {
    let (base, experts, ffn) = match size {
        MixtralSize::Tiny => (llama(LlamaSize::Tiny), 8, 176),
    };
    let router = RouterSpec { aux_loss_coeff: 1e-2, z_loss_coeff: Some(1e-3), ..RouterSpec::default() };
    let moe = MoeSpec::new(experts, ffn, Activation::SwiGlu, router);
    TransformerConfig {
        ffn_hidden_size: ffn,
        layer: LayerSpec { mlp: MlpSpec::Custom(Arc::new(moe)), ..base.layer },
        ..base
    }
}

/// DeepSeek-V3's architecture in miniature (Megatron's DeepSeek-V3 recipe's flags at llama-tiny's
/// width): multi-latent attention (a query latent of 64, a key/value latent of 32, heads of 32 + a
/// rotary 16, values of 32) with YaRN at factor 40 (mscale and mscale_all_dim 1); the first layer
/// dense, then 8 SwiGLU experts of 88 in 4 groups, 4 per token from the best 2 groups, sigmoid
/// scores renormalised and scaled by 2.5, the expert bias moved at 1e-3, the sequence-level
/// balancing loss at 1e-4, fp32 routers, one shared expert of 88; one multi-token prediction depth
/// weighted 0.1.
pub fn deepseek_v3_tiny() -> TransformerConfig {
    use ferrotron_moe::{Groups, LoadBalancing, Score};
    use ferrotron_transformer::mla::MlaSpec;
    use ferrotron_transformer::spec::{OtherMlp, Yarn};
    let base = llama(LlamaSize::Tiny);
    let router = RouterSpec {
        topk: 4,
        topk_scaling_factor: Some(2.5),
        load_balancing: LoadBalancing::SeqAuxLoss,
        aux_loss_coeff: 1e-4,
        score: Score::Sigmoid,
        groups: Some(Groups { num: 4, topk: 2 }),
        expert_bias_update_rate: Some(1e-3),
        fp32: true,
        ..RouterSpec::default()
    };
    let moe = MoeSpec { shared_expert_ffn: Some(88), ..MoeSpec::new(8, 88, Activation::SwiGlu, router) };
    let yarn = Yarn { mscale: 1.0, mscale_all_dim: 1.0, ..Yarn::megatron(40.0) };
    let mla = MlaSpec {
        q_lora_rank: Some(64),
        kv_lora_rank: 32,
        qk_head_dim: 32,
        qk_pos_emb_head_dim: 16,
        v_head_dim: 32,
        yarn: Some(yarn),
    };
    let dense = base.layer.mlp.clone();
    let layers = (0..base.num_layers).map(|i| i == 0).collect();
    TransformerConfig {
        num_query_groups: base.num_attention_heads,
        position_embedding: PositionEmbedding::rope(10000.0),
        layer: LayerSpec {
            attention: AttentionSpec { mla: Some(mla), ..base.layer.attention },
            mlp: MlpSpec::Custom(Arc::new(moe)),
            other_mlp: Some(OtherMlp { mlp: dense, layers }),
            ..base.layer
        },
        mtp: Some(ferrotron_transformer::MtpSpec { num_layers: 1, loss_scaling_factor: 0.1 }),
        ..base
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MambaSize {
    /// 6 layers `M-M*M-` at hidden 128 (Mamba-2 mixers of 8 heads × 32 channels, 2 groups of 16
    /// state channels; one attention layer of 4 heads; two SwiGLU MLPs), byte-level.
    Tiny,
}

/// A Mamba-2 hybrid as Megatron's MambaModel builds them: RMSNorm, no position embedding (the
/// scans carry order), SwiGLU MLPs, no biases, untied output, layers per the pattern.
pub fn mamba_hybrid(size: MambaSize) -> TransformerConfig {
    let (pattern, mamba) = match size {
        MambaSize::Tiny => {
            ("M-M*M-", ferrotron_ssm::MambaSpec { state_dim: 16, head_dim: 32, groups: 2, ..Default::default() })
        }
    };
    let base = llama(LlamaSize::Tiny);
    let mut c = TransformerConfig { num_layers: pattern.len(), position_embedding: PositionEmbedding::None, ..base };
    let dense = c.layer.mlp.clone();
    hybrid::make_hybrid(&mut c, pattern, mamba, dense).expect("the preset's pattern is valid");
    c
}

/// The MoE spec of a config's layers, if they are mixture-of-experts.
pub fn moe_spec(c: &TransformerConfig) -> Option<&MoeSpec> {
    match &c.layer.mlp {
        MlpSpec::Custom(f) => f.as_any()?.downcast_ref::<MoeSpec>(),
        MlpSpec::Dense { .. } => None,
    }
}

/// Preset names the trainer accepts for `--preset`.
pub const PRESETS: &[&str] = &[
    "tiny",
    "small",
    "124m",
    "1.3b",
    "6.7b",
    "llama-tiny",
    "llama-1b",
    "mixtral-tiny",
    "deepseek-v3-tiny",
    "mamba-tiny",
    "llava-tiny",
];

/// Looks a preset up by name (see `PRESETS`); also accepts `gpt2-124m` and `gpt-1.3b`.
pub fn preset(name: &str) -> Option<TransformerConfig> {
    Some(match name {
        "tiny" | "gpt2-tiny" => gpt2(GptSize::Tiny),
        "small" | "gpt2-small" => gpt2(GptSize::Small),
        "124m" | "gpt2-124m" => gpt2(GptSize::Gpt124m),
        "1.3b" | "gpt-1.3b" => gpt2(GptSize::Gpt1_3b),
        "6.7b" | "gpt-6.7b" => gpt2(GptSize::Gpt6_7b),
        "llama-tiny" => llama(LlamaSize::Tiny),
        "llama-1b" => llama(LlamaSize::Llama1b),
        "mixtral-tiny" => mixtral(MixtralSize::Tiny),
        "deepseek-v3-tiny" => deepseek_v3_tiny(),
        "mamba-tiny" => mamba_hybrid(MambaSize::Tiny),
        // LLaVA's language model; `llava_vision` gives its image path.
        "llava-tiny" => llama(LlamaSize::Tiny),
        _ => return None,
    })
}

/// A LLaVA preset's vision encoder and projection (None for text presets): llava-tiny's is a
/// 2-layer CLIP encoder of width 64 over 16 × 16 images in 4 × 4 patches, whose 16 patch rows
/// (class token dropped, as LLaVA-1.5 does) take the first 16 of llama-tiny's 128 positions.
/// The placeholder is one id past the language model's vocabulary.
pub fn llava_vision(name: &str) -> Option<ferrotron_transformer::VisionSpec> {
    let lm = preset(name)?;
    let (img, patch, layers, hidden, heads, ffn) = match name {
        "llava-tiny" => (16, 4, 2, 64, 4, 256),
        _ => return None,
    };
    let encoder = ferrotron_transformer::vision::clip_encoder(layers, hidden, heads, ffn, lm.init_method_std);
    let token = lm.vocab_size as u32;
    Some(ferrotron_transformer::VisionSpec::llava((img, img, patch), encoder, true, lm.hidden_size, token))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_preset_is_valid() {
        for name in PRESETS {
            let c = preset(name).unwrap();
            c.validate().unwrap_or_else(|e| panic!("{name}: {e}"));
            if let Some(v) = llava_vision(name) {
                v.validate(c.vocab_size + 1).unwrap_or_else(|e| panic!("{name}: {e}"));
                assert!(v.image_tokens() < c.seq_length, "{name}: text after the image");
            }
        }
        assert!(preset("gpt5").is_none());
    }

    #[test]
    fn gpt2_124m_has_the_known_parameter_count() {
        // GPT-2 small: 124,439,808 parameters with the 50257 vocab; Megatron pads to 50304
        // (+47·768) and keeps the 1024 learned positions.
        let c = gpt2(GptSize::Gpt124m);
        assert_eq!(c.padded_vocab_size(1), 50304);
        assert_eq!(c.num_params(), 124_439_808 + 47 * 768);
    }

    #[test]
    fn flops_per_token_follow_6n_plus_attention() {
        let c = gpt2(GptSize::Gpt1_3b);
        let n = (c.num_params() - c.max_position_embeddings * c.hidden_size) as f64;
        assert_eq!(c.flops_per_token(), 6.0 * n + 12.0 * 24.0 * 2048.0 * 2048.0);
        assert!((1.2e9..1.5e9).contains(&(c.num_params() as f64)));
    }

    #[test]
    fn gpt_6_7b_has_gpt3s_size() {
        let c = gpt2(GptSize::Gpt6_7b);
        let n = c.num_params() as f64;
        assert!((6.5e9..6.9e9).contains(&n), "{n}");
        c.validate_tp(8).unwrap();
    }

    #[test]
    fn mixtral_tiny_counts_its_experts() {
        let (c, dense) = (mixtral(MixtralSize::Tiny), llama(LlamaSize::Tiny));
        let spec = moe_spec(&c).unwrap();
        assert_eq!((spec.num_experts, spec.router.topk), (8, 2));
        assert!(moe_spec(&dense).is_none());
        // Per layer: the router (8 × 128) and 8 experts of 3 × 128 × 176, of which 2 are active.
        let expert = 3 * 128 * 176;
        let mlp_dense = 3 * 128 * 352;
        assert_eq!(c.num_params(), dense.num_params() + 4 * (8 * 128 + 8 * expert - mlp_dense));
        assert_eq!(c.active_params(), dense.num_params() + 4 * 8 * 128);
    }

    #[test]
    fn vocab_padding_is_a_multiple_of_128_tp() {
        let gpt = gpt2(GptSize::Gpt124m);
        assert_eq!((gpt.padded_vocab_size(1), gpt.padded_vocab_size(4)), (50304, 50688));
        let tiny = gpt2(GptSize::Tiny);
        assert_eq!((tiny.padded_vocab_size(2), tiny.padded_vocab_size(4)), (256, 512));
    }
}
