//! The tiny model of both preset styles that the transformer tests share.

use ferrotron_core::{Device, Tensor, rng::Philox};
use ferrotron_transformer::spec::{Activation, AttentionSpec, LayerSpec, MlpSpec, NormKind, PositionEmbedding};
use ferrotron_transformer::{Batch, TransformerConfig};

/// GPT-2 style (LayerNorm, GeLU, learned positions, biases, tied) or Llama style (RMSNorm,
/// SwiGLU, RoPE, GQA, QK-norm, no biases, untied): 2 layers, hidden 16, 4 heads.
pub fn config(llama: bool) -> TransformerConfig {
    TransformerConfig {
        num_layers: 2,
        hidden_size: 16,
        num_attention_heads: 4,
        num_query_groups: if llama { 2 } else { 4 },
        kv_channels: None,
        ffn_hidden_size: 24,
        seq_length: 6,
        max_position_embeddings: 8,
        vocab_size: 11,
        make_vocab_size_divisible_by: 1,
        position_embedding: if llama {
            PositionEmbedding::Rope { base: 10000.0, scaling: None }
        } else {
            PositionEmbedding::LearnedAbsolute
        },
        untie_embeddings_and_output_weights: llama,
        layer: LayerSpec {
            norm: if llama { NormKind::RmsNorm } else { NormKind::LayerNorm },
            attention: AttentionSpec {
                bias: !llama,
                qkv_bias: false,
                qk_layernorm: llama,
                window: None,
                causal: true,
                mla: None,
            },
            mlp: MlpSpec::Dense { activation: if llama { Activation::SwiGlu } else { Activation::Gelu }, bias: !llama },
            other_mlp: None,
            hybrid: None,
        },
        norm_epsilon: 1e-5,
        // Large enough that every layer's gradient stands far above f32 round-off.
        init_method_std: 0.3,
        hidden_dropout: 0.0,
        attention_dropout: 0.0,
        mtp: None,
    }
}

/// A CPU batch of b × t random token ids below `v` (labels likewise), every fifth token masked.
#[allow(dead_code)] // not every test binary that shares this module uses it
pub fn batch(b: usize, t: usize, v: u32) -> Batch {
    let dev = Device::Cpu;
    let ids = |s: u64| (0..b * t).map(|i| Philox::new(s).u32_at(i as u64) % v).collect::<Vec<_>>();
    let mask: Vec<f32> = (0..b * t).map(|i| if i % 5 == 3 { 0.0 } else { 1.0 }).collect();
    Batch::new(
        Tensor::from_vec(ids(1), [b, t], &dev).unwrap(),
        Tensor::from_vec(ids(2), [b, t], &dev).unwrap(),
        Tensor::from_vec(mask, [b, t], &dev).unwrap(),
    )
    .unwrap()
}
