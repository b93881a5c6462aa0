//! Whole-model gradient check: for every parameter, the directional derivative of the loss along a
//! random direction (central differences) equals main_grad · direction. Both preset styles.

mod common;

use common::{batch, config};
use ferrotron_core::{Cx, DType, Device, ParamTable, rng::Philox};
use ferrotron_transformer::{Batch, GptModel};

fn loss(model: &GptModel, table: &ParamTable, b: &Batch) -> f64 {
    model.forward(&Cx { params: table, training: true }, b).unwrap().0
}

fn check(cfg: ferrotron_transformer::TransformerConfig) {
    let (model, table) = GptModel::build(cfg, &Device::Cpu, DType::F32, 3).unwrap();
    let b = batch(2, 6, 11);
    let cx = Cx { params: &table, training: true };
    let (_, saved) = model.forward(&cx, &b).unwrap();
    model.backward(&cx, saved, 1.0).unwrap();
    let h = 1e-3f32;
    for id in table.ids() {
        let p = table.param(id).unwrap();
        let n = p.elem_count();
        let mut u = vec![0f32; n];
        Philox::new(99).with_stream(id.0 as u64).fill_normal(0, 0.0, 1.0, &mut u);
        let g = table.grad(id).unwrap().to_vec_f32().unwrap();
        let analytic: f64 = g.iter().zip(&u).map(|(a, b)| *a as f64 * *b as f64).sum();
        let shift = |s: f32| p.update_f32("t", |v| v.iter_mut().zip(&u).for_each(|(x, d)| *x += s * d)).unwrap();
        shift(h);
        let lp = loss(&model, &table, &b);
        shift(-2.0 * h);
        let lm = loss(&model, &table, &b);
        shift(h);
        let numeric = (lp - lm) / (2.0 * h as f64);
        let name = &table.meta(id).name;
        assert!(
            (numeric - analytic).abs() <= 2e-2 * analytic.abs() + 2e-3,
            "{name}: finite difference {numeric} vs backward {analytic}"
        );
    }
}

#[test]
fn gpt2_style_gradients_match_finite_differences() {
    check(config(false));
}

#[test]
fn llama_style_gradients_match_finite_differences() {
    check(config(true));
}

/// Heads wider than hidden / heads (--kv-channels 6 against 16 / 4): the projections are sized
/// by heads × head width, not the hidden size.
#[test]
fn kv_channels_gradients_match_finite_differences() {
    for llama in [false, true] {
        check(ferrotron_transformer::TransformerConfig { kv_channels: Some(6), ..config(llama) });
    }
}

/// Without QK-norm the attention takes the fused path: RoPE in place on the QKV projection
/// output and on its gradient (`rope_qkv_fwd_` / `rope_qkv_bwd_`), Q, K, V read in place.
#[test]
fn llama_style_without_qk_norm_gradients_match_finite_differences() {
    let mut cfg = config(true);
    cfg.layer.attention.qk_layernorm = false;
    check(cfg);
}
