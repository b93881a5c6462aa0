//! The loss head on one rank: a training forward writes dlogits over the logits in the same pass
//! (`cross_entropy_fwd_bwd_`); an inference forward leaves that to the backward's separate pass.
//! Either way the loss and every parameter gradient must be the same: to the bit at grad scale 1
//! (the same arithmetic), within f32 rounding at another scale (applied to h and dh instead).

mod common;

use common::{batch, config};
use ferrotron_core::{Cx, DType, Device, ParamTable};
use ferrotron_transformer::{Batch, GptModel};

/// (loss, every parameter's gradient) after a forward with `training` and a backward at `scale`.
fn run(model: &GptModel, table: &ParamTable, b: &Batch, training: bool, scale: f32) -> (f64, Vec<Vec<f32>>) {
    table.zero_grads().unwrap();
    let cx = Cx::new(table, training);
    let (loss, saved) = model.forward(&cx, b).unwrap();
    model.backward(&cx, saved, scale).unwrap();
    (loss, table.ids().map(|id| table.grad(id).unwrap().to_vec_f32().unwrap()).collect())
}

#[test]
fn a_training_forward_with_the_loss_gradient_equals_the_separate_backward() {
    for llama in [false, true] {
        let (model, table) = GptModel::build(config(llama), &Device::Cpu, DType::F32, 7).unwrap();
        let b = batch(2, 6, 11);
        let (l_sep, g_sep) = run(&model, &table, &b, false, 1.0);
        let (l_fused, g_fused) = run(&model, &table, &b, true, 1.0);
        assert_eq!(l_sep, l_fused, "llama {llama}: loss");
        assert!(g_sep.iter().any(|g| g.iter().any(|&x| x != 0.0)), "llama {llama}: no gradient at all");
        assert_eq!(g_sep, g_fused, "llama {llama}: gradients at scale 1");
        let (_, g_sep) = run(&model, &table, &b, false, 0.5);
        let (_, g_fused) = run(&model, &table, &b, true, 0.5);
        for (i, (s, f)) in g_sep.iter().zip(&g_fused).enumerate() {
            for (a, b) in s.iter().zip(f) {
                assert!((a - b).abs() <= 1e-5 * a.abs().max(1e-3), "llama {llama}: param {i} at scale 0.5: {a} vs {b}");
            }
        }
    }
}
