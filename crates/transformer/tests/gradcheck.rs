//! Whole-model gradient check: for every parameter, the directional derivative of the loss along a
//! random direction (central differences) equals main_grad · direction. Both preset styles.

mod common;

use common::config;
use ferrotron_core::{Cx, DType, Device, ParamTable, Tensor, rng::Philox};
use ferrotron_transformer::{Batch, GptModel};

fn batch(b: usize, t: usize, v: u32) -> Batch {
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

fn loss(model: &GptModel, table: &ParamTable, b: &Batch) -> f64 {
    model.forward(&Cx { params: table, training: true }, b).unwrap().0
}

fn check(llama: bool) {
    let (model, table) = GptModel::build(config(llama), &Device::Cpu, DType::F32, 3).unwrap();
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
    check(false);
}

#[test]
fn llama_style_gradients_match_finite_differences() {
    check(true);
}
