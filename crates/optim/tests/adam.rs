//! The optimizer against a per-parameter AdamW written out by hand, with clipping and decay groups.

use ferrotron_core::{DType, Device, Init, ParamMeta, ParamTableBuilder};
use ferrotron_optim::{AdamConfig, Optimizer};

#[test]
fn decay_groups_clipping_and_master_copy() {
    let mut b = ParamTableBuilder::default();
    let w = b.add(ParamMeta::replicated("l.weight", [3], Init::Ones, true)).unwrap();
    let bias = b.add(ParamMeta::replicated("l.bias", [2], Init::Ones, false)).unwrap();
    let table = b.build(&Device::Cpu, DType::BF16, 0).unwrap();
    let cfg = AdamConfig { beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.5, clip_grad: 1.0 };
    let mut opt = Optimizer::new(&table, cfg).unwrap();
    // Grad norm 5 → clipped by 1/5.
    table.flat_grads().update_f32("t", |g| g.copy_from_slice(&[3.0, 0.0, 0.0, 4.0, 0.0])).unwrap();
    let stats = opt.step(&table, 0.1).unwrap();
    assert!((stats.grad_norm - 5.0).abs() < 1e-9 && stats.applied);
    // First Adam step moves each element by lr·sign(g) (bias-corrected m/√v = ±1) after decay.
    let ([m, _, _], step) = opt.full_state(table.flat_len()).unwrap();
    assert_eq!(step, 1);
    let decayed = 1.0 * (1.0 - 0.1 * 0.5);
    assert!((m[0] - (decayed - 0.1)).abs() < 1e-5, "{m:?}"); // weight with grad: decay + step
    assert!((m[1] - decayed).abs() < 1e-6, "{m:?}"); // weight without grad: decay only
    assert!((m[3] - (1.0 - 0.1)).abs() < 1e-5, "{m:?}"); // bias: no decay
    assert!((m[4] - 1.0).abs() < 1e-6, "{m:?}");
    // The bf16 parameters are the rounded master.
    let p = table.param(w).unwrap().to_vec_f32().unwrap();
    assert!((p[0] - m[0]).abs() < 4e-3 && table.param(bias).unwrap().dtype() == DType::BF16);
}

#[test]
fn non_finite_gradients_skip_the_step() {
    let mut b = ParamTableBuilder::default();
    b.add(ParamMeta::replicated("x", [2], Init::Ones, true)).unwrap();
    let table = b.build(&Device::Cpu, DType::F32, 0).unwrap();
    let mut opt = Optimizer::new(&table, AdamConfig::default()).unwrap();
    table.flat_grads().update_f32("t", |g| g[0] = f32::NAN).unwrap();
    let s = opt.step(&table, 0.1).unwrap();
    assert!(!s.applied);
    assert_eq!(opt.steps(), 0);
    assert_eq!(table.flat_params().to_vec_f32().unwrap(), vec![1.0, 1.0]);
}
