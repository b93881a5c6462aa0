//! The tiny model of both preset styles that the transformer tests share.

use ferrotron_core::{Device, ParamTable, Tensor, rng::Philox};
use ferrotron_transformer::spec::{
    Activation, AttentionSpec, LayerSpec, MlpSpec, NormKind, PositionEmbedding, SoftmaxType,
};
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
        position_embedding: if llama { PositionEmbedding::rope(10000.0) } else { PositionEmbedding::LearnedAbsolute },
        untie_embeddings_and_output_weights: llama,
        layer: LayerSpec {
            norm: if llama { NormKind::RmsNorm } else { NormKind::LayerNorm },
            zero_centred_gamma: false,
            attention: AttentionSpec {
                bias: !llama,
                qkv_bias: false,
                qk_layernorm: llama,
                qk_l2_norm: false,
                output_gate: false,
                softmax: SoftmaxType::Vanilla,
                window: None,
                causal: true,
                mla: None,
            },
            mlp: MlpSpec::Dense { activation: if llama { Activation::SwiGlu } else { Activation::Gelu }, bias: !llama },
            other_mlp: None,
            hybrid: None,
            window_layers: None,
        },
        norm_epsilon: 1e-5,
        // Large enough that every layer's gradient stands far above f32 round-off.
        init_method_std: 0.3,
        embedding_init_method_std: None,
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

/// One parameter's gradient check: the derivative of an objective along a fixed random direction
/// u, by central differences (±1e-3·u) and as main_grad · u.
#[allow(dead_code)] // not every test binary that shares this module uses it
pub struct Directional {
    pub name: String,
    pub numeric: f64,
    pub analytic: f64,
    /// The parameter's gradient as main_grad holds it.
    pub grad: Vec<f32>,
}

#[allow(dead_code)]
impl Directional {
    /// Within 2e-2 relative + 2e-3 absolute (f32 forward passes), `what` naming the case.
    pub fn assert_close(&self, what: &str) {
        let (n, a) = (self.numeric, self.analytic);
        assert!((n - a).abs() <= 2e-2 * a.abs() + 2e-3, "{what}{}: finite difference {n} vs backward {a}", self.name);
    }
}

/// Every parameter's `Directional`, main_grad already holding the gradient of `objective` (which
/// runs a forward on the table's current values; each parameter is shifted and put back).
#[allow(dead_code)]
pub fn directional_derivatives(table: &ParamTable, objective: impl Fn() -> f64) -> Vec<Directional> {
    let h = 1e-3f32;
    table
        .ids()
        .map(|id| {
            let p = table.param(id).unwrap();
            let mut u = vec![0f32; p.elem_count()];
            Philox::new(99).with_stream(id.0 as u64).fill_normal(0, 0.0, 1.0, &mut u);
            let grad = table.grad(id).unwrap().to_vec_f32().unwrap();
            let analytic: f64 = grad.iter().zip(&u).map(|(a, b)| *a as f64 * *b as f64).sum();
            let shift = |s: f32| p.update_f32("t", |v| v.iter_mut().zip(&u).for_each(|(x, d)| *x += s * d)).unwrap();
            shift(h);
            let lp = objective();
            shift(-2.0 * h);
            let lm = objective();
            shift(h);
            let numeric = (lp - lm) / (2.0 * h as f64);
            Directional { name: table.meta(id).name.clone(), numeric, analytic, grad }
        })
        .collect()
}
