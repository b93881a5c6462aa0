//! Spec choices that cannot work together are rejected when the model is built, with the flag named.

use ferrotron_core::{DType, Device};
use ferrotron_transformer::spec::{
    Activation, AttentionSpec, LayerSpec, MlpSpec, NormKind, PositionEmbedding, SoftmaxType,
};
use ferrotron_transformer::{GptModel, TransformerConfig};

fn base() -> TransformerConfig {
    TransformerConfig {
        num_layers: 1,
        hidden_size: 12,
        num_attention_heads: 4,
        num_query_groups: 4,
        kv_channels: None,
        ffn_hidden_size: 8,
        seq_length: 8,
        max_position_embeddings: 8,
        vocab_size: 16,
        make_vocab_size_divisible_by: 1,
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

fn err(c: TransformerConfig) -> String {
    match GptModel::build(c, &Device::Cpu, DType::F32, 0) {
        Ok(_) => panic!("config was accepted"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn valid_base_builds_with_megatron_names() {
    let (_, table) = GptModel::build(base(), &Device::Cpu, DType::F32, 0).unwrap();
    for name in [
        "embedding.word_embeddings.weight",
        "embedding.position_embeddings.weight",
        "decoder.layers.0.input_layernorm.weight",
        "decoder.layers.0.self_attention.linear_qkv.weight",
        "decoder.layers.0.self_attention.linear_proj.bias",
        "decoder.layers.0.pre_mlp_layernorm.bias",
        "decoder.layers.0.mlp.linear_fc1.weight",
        "decoder.layers.0.mlp.linear_fc2.weight",
        "decoder.final_layernorm.weight",
    ] {
        assert!(table.id(name).is_some(), "missing {name}");
    }
    assert_eq!(table.numel(), base().num_params());
}

#[test]
fn rope_with_odd_head_dim_is_rejected() {
    // 12 / 4 = 3: odd head dim.
    let e = err(TransformerConfig { position_embedding: PositionEmbedding::rope(10000.0), ..base() });
    assert!(e.contains("even head dim") && e.contains("--num-attention-heads"), "{e}");
}

#[test]
fn indivisible_sizes_are_rejected_with_the_flag() {
    let e = err(TransformerConfig { num_attention_heads: 5, num_query_groups: 5, ..base() });
    assert!(e.contains("--hidden-size 12 is not divisible by --num-attention-heads 5"), "{e}");
    let e = err(TransformerConfig { num_query_groups: 3, ..base() });
    assert!(e.contains("--num-query-groups 3"), "{e}");
    let e = err(TransformerConfig { seq_length: 9, ..base() });
    assert!(e.contains("--max-position-embeddings"), "{e}");
}

#[test]
fn param_count_matches_table_for_llama_style() {
    let c = TransformerConfig {
        hidden_size: 16,
        num_query_groups: 2,
        kv_channels: None,
        position_embedding: PositionEmbedding::rope(10000.0),
        untie_embeddings_and_output_weights: true,
        layer: LayerSpec {
            norm: NormKind::RmsNorm,
            zero_centred_gamma: false,
            attention: AttentionSpec {
                bias: false,
                qkv_bias: false,
                qk_layernorm: true,
                qk_l2_norm: false,
                output_gate: false,
                softmax: SoftmaxType::Vanilla,
                window: Some(4),
                causal: true,
                mla: None,
            },
            mlp: MlpSpec::Dense { activation: Activation::SwiGlu, bias: false },
            other_mlp: None,
            hybrid: None,
            window_layers: None,
        },
        ..base()
    };
    let (_, table) = GptModel::build(c.clone(), &Device::Cpu, DType::F32, 0).unwrap();
    assert_eq!(table.numel(), c.num_params());
    // With a bias on the QKV projection alone (Qwen2): one more vector a layer.
    let mut q = c.clone();
    q.layer.attention.qkv_bias = true;
    let (_, qt) = GptModel::build(q.clone(), &Device::Cpu, DType::F32, 0).unwrap();
    assert_eq!(qt.numel(), q.num_params());
    assert!(qt.metas().iter().any(|m| m.name == "decoder.layers.0.self_attention.linear_qkv.bias"));
    assert!(!qt.metas().iter().any(|m| m.name == "decoder.layers.0.self_attention.linear_proj.bias"));
    // Heads of width 6 (--kv-channels) against hidden 16 / 4 heads; and no hidden size
    // divisible by the heads needed then.
    for (hidden, heads) in [(16, 4), (18, 4)] {
        let k =
            TransformerConfig { kv_channels: Some(6), hidden_size: hidden, num_attention_heads: heads, ..c.clone() };
        k.validate().unwrap();
        let (_, table) = GptModel::build(k.clone(), &Device::Cpu, DType::F32, 0).unwrap();
        assert_eq!(table.numel(), k.num_params(), "hidden {hidden}");
        let qkv = table.id("decoder.layers.0.self_attention.linear_qkv.weight").unwrap();
        assert_eq!(table.meta(qkv).global_shape.dims(), &[(heads + 2 * 2) * 6, hidden]);
    }
    let e = err(TransformerConfig { kv_channels: Some(0), ..c.clone() });
    assert!(e.contains("--kv-channels"), "{e}");
}
