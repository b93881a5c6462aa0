//! The spec's escape hatch: a user-defined MLP (SiLU, no gate) plugged into every layer of a GPT
//! through `MlpSpec::Custom`, then one forward and backward.
//!
//! Run: `cargo run --release -p ferrotron-examples --example custom_mlp`

use ferrotron_core::{Cx, DType, Device, Module, ParamTableBuilder, Result, Saved, Tensor};
use ferrotron_kernels as k;
use ferrotron_transformer::linear::Linear;
use ferrotron_transformer::spec::{
    AttentionSpec, FactoryCx, LayerSpec, MlpSpec, ModuleFactory, NormKind, ParamCount, PositionEmbedding, SoftmaxType,
};
use ferrotron_transformer::{Batch, GptModel, TransformerConfig};
use std::sync::Arc;

/// y = W2 · silu(W1 · x): our own module, built from the library's Linear and kernels.
struct SiluMlp {
    up: Linear,
    down: Linear,
}

impl Module for SiluMlp {
    fn forward(&self, cx: &Cx, x: &Tensor) -> Result<(Tensor, Saved)> {
        let (h, s_up) = self.up.forward(cx, x)?;
        let (y, s_down) = self.down.forward(cx, &k::silu(&h)?)?;
        Ok((y, Saved::new(vec![h], vec![s_up, s_down])))
    }

    fn backward(&self, cx: &Cx, saved: Saved, dy: &Tensor) -> Result<Tensor> {
        let Saved { tensors, mut children } = saved;
        let s_down = children.pop().unwrap_or_default();
        let s_up = children.pop().unwrap_or_default();
        let da = self.down.backward(cx, s_down, dy)?;
        self.up.backward(cx, s_up, &k::silu_bwd(&tensors[0], &da)?)
    }
}

#[derive(Debug)]
struct SiluMlpFactory {
    width: usize,
}

impl ModuleFactory for SiluMlpFactory {
    fn build(&self, cx: &FactoryCx, params: &mut ParamTableBuilder) -> Result<Box<dyn Module>> {
        let (prefix, hidden) = (cx.prefix, cx.hidden);
        Ok(Box::new(SiluMlp {
            up: Linear::new(params, &format!("{prefix}.up_proj"), hidden, self.width, false, cx.std)?,
            down: Linear::new(params, &format!("{prefix}.down_proj"), self.width, hidden, false, cx.out_std)?,
        }))
    }

    fn param_count(&self, hidden: usize) -> Option<ParamCount> {
        let n = 2 * hidden * self.width;
        Some(ParamCount { total: n, active: n })
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let config = TransformerConfig {
        num_layers: 2,
        hidden_size: 64,
        num_attention_heads: 4,
        num_query_groups: 4,
        kv_channels: None,
        ffn_hidden_size: 96, // only the built-in MLP reads it
        seq_length: 16,
        max_position_embeddings: 16,
        vocab_size: 256,
        make_vocab_size_divisible_by: 128,
        position_embedding: PositionEmbedding::rope(10000.0),
        untie_embeddings_and_output_weights: false,
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
            mlp: MlpSpec::Custom(Arc::new(SiluMlpFactory { width: 96 })),
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
    };
    let (model, table) = GptModel::build(config, &Device::Cpu, DType::F32, 0)?;
    for m in table.metas().iter().filter(|m| m.name.contains("layers.0.mlp")) {
        println!("{} {:?}", m.name, m.local_shape);
    }
    let dev = Device::Cpu;
    let text: Vec<u32> = b"a custom mlp, end to end".iter().map(|&b| b as u32).collect();
    let batch = Batch::new(
        Tensor::from_vec(text[..16].to_vec(), [1, 16], &dev)?,
        Tensor::from_vec(text[1..17].to_vec(), [1, 16], &dev)?,
        Tensor::from_vec(vec![1f32; 16], [1, 16], &dev)?,
    )?;
    let cx = Cx::new(&table, true);
    let (loss, saved) = model.forward(&cx, &batch)?;
    model.backward(&cx, saved, 1.0)?;
    let up = table.id("decoder.layers.0.mlp.up_proj.weight").ok_or("missing up_proj")?;
    println!(
        "loss {loss:.4} (ln 256 = {:.4}); |grad up_proj| = {:.3e}",
        (256f64).ln(),
        k::global_l2_norm(&[&table.grad(up)?])?
    );
    Ok(())
}
