//! The tiny GPT configurations, data and helpers shared by the layout tests.
#![allow(dead_code)] // each test binary uses part of it

use ferrotron_core::{Device, ParamTable, Tensor};
use ferrotron_parallel::{ProcessGroups, gather_param};
use ferrotron_transformer::spec::{
    Activation, AttentionSpec, LayerSpec, MlpSpec, NormKind, PositionEmbedding, SoftmaxType,
};
use ferrotron_transformer::{Batch, TransformerConfig};
use std::collections::BTreeMap;

pub const SEQ: usize = 8;
pub const MICRO: usize = 2;
pub const GLOBAL_MICROS: usize = 4;
pub const STEPS: usize = 5;
pub const VOCAB: usize = 40;

pub fn config(llama: bool) -> TransformerConfig {
    config_layers(llama, 2)
}

pub fn config_layers(llama: bool, layers: usize) -> TransformerConfig {
    let (norm, act, bias, pos) = if llama {
        (NormKind::RmsNorm, Activation::SwiGlu, false, PositionEmbedding::rope(10000.0))
    } else {
        (NormKind::LayerNorm, Activation::Gelu, true, PositionEmbedding::LearnedAbsolute)
    };
    TransformerConfig {
        num_layers: layers,
        hidden_size: 32,
        num_attention_heads: if llama { 8 } else { 4 },
        num_query_groups: 4,
        // Llama style: heads wider than hidden / heads (--kv-channels), as some presets have.
        kv_channels: llama.then_some(6),
        ffn_hidden_size: if llama { 48 } else { 64 },
        seq_length: SEQ,
        max_position_embeddings: SEQ,
        vocab_size: VOCAB,
        make_vocab_size_divisible_by: 8,
        position_embedding: pos,
        untie_embeddings_and_output_weights: llama,
        layer: LayerSpec {
            norm,
            zero_centred_gamma: false,
            attention: AttentionSpec {
                bias,
                qkv_bias: false,
                qk_layernorm: llama,
                qk_l2_norm: false,
                output_gate: false,
                softmax: SoftmaxType::Vanilla,
                window: None,
                causal: true,
                mla: None,
            },
            mlp: MlpSpec::Dense { activation: act, bias },
            other_mlp: None,
            hybrid: None,
            window_layers: None,
        },
        norm_epsilon: 1e-5,
        init_method_std: 0.05,
        embedding_init_method_std: None,
        hidden_dropout: 0.0,
        attention_dropout: 0.0,
        mtp: None,
    }
}

/// Micro-batch `j` of the global batch (same on every layout; every step sees the same batch, so
/// the loss must fall).
pub fn micro_batch(j: usize) -> Batch {
    let rng = ferrotron_core::rng::Philox::new(99).with_stream(j as u64);
    let mut u = vec![0f32; MICRO * (SEQ + 1)];
    rng.fill_uniform(0, &mut u);
    let ids: Vec<u32> = u.iter().map(|x| (x * VOCAB as f32) as u32 % VOCAB as u32).collect();
    let (mut tokens, mut labels) = (vec![], vec![]);
    for r in ids.chunks(SEQ + 1) {
        tokens.extend_from_slice(&r[..SEQ]);
        labels.extend_from_slice(&r[1..]);
    }
    Batch::new(
        Tensor::from_vec(tokens, [MICRO, SEQ], &Device::Cpu).unwrap(),
        Tensor::from_vec(labels, [MICRO, SEQ], &Device::Cpu).unwrap(),
        Tensor::from_vec(vec![1f32; MICRO * SEQ], [MICRO, SEQ], &Device::Cpu).unwrap(),
    )
    .unwrap()
}

/// Every parameter of this rank, whole (gathered over TP), by name; the padding rows of the
/// vocabulary are dropped (their number depends on the TP size).
pub fn whole_params(table: &ParamTable, g: &ProcessGroups) -> BTreeMap<String, Vec<f32>> {
    let mut out = BTreeMap::new();
    for id in table.ids() {
        let m = table.meta(id);
        let mut v = gather_param(&g.tp, m, &table.param(id).unwrap()).unwrap();
        if m.name.ends_with("word_embeddings.weight") || m.name == "output_layer.weight" {
            v.truncate(VOCAB * m.global_shape.dims()[1]);
        }
        out.insert(m.name.clone(), v);
    }
    out
}

pub fn close(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= 1e-5 * (1.0 + y.abs()), "{what}[{i}]: {x} vs {y}");
    }
}
