//! A block leaves each layer's output add (x1 + mlp(…)) to the next layer's input norm or the
//! final norm (`Residual::Pending`). Its output and gradients must equal, bit for bit, those of
//! the same layers run one by one through `Module::forward` (which adds first, in its own kernel)
//! and then the final norm: bf16, where the sum's rounding before the norm shows; both styles;
//! with full recompute too (which sums at its groups' inputs).

mod common;

use ferrotron_core::{Cx, DType, Device, Module, ParamTableBuilder, Tensor, rng::Philox};
use ferrotron_parallel::{ProcessGroups, TensorParallel};
use ferrotron_transformer::layer::TransformerBlock;
use ferrotron_transformer::recompute::{Granularity, Method};
use ferrotron_transformer::{Recompute, TransformerConfig};

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_vec_f32().unwrap().iter().map(|v| v.to_bits()).collect()
}

fn check(llama: bool, recompute: Recompute) {
    // Three layers: two pending adds between layers and one into the final norm.
    let c = TransformerConfig { num_layers: 3, ..common::config(llama) };
    let tp = TensorParallel::new(ProcessGroups::single().tp.clone(), false);
    let mut p = ParamTableBuilder::default();
    let block = TransformerBlock::stage(&mut p, "decoder", &c, &tp, 0..c.num_layers, true, recompute).unwrap();
    let table = p.build(&Device::Cpu, DType::BF16, 5).unwrap();
    let cx = Cx::new(&table, true);
    let n = 2 * 6 * 16;
    let mut v = vec![0f32; n];
    Philox::new(7).fill_normal(0, 0.0, 1.0, &mut v);
    let x = k_cast(Tensor::from_vec(v.clone(), [2, 6, 16], &Device::Cpu).unwrap());
    Philox::new(8).fill_normal(0, 0.0, 1.0, &mut v);
    let dy = k_cast(Tensor::from_vec(v, [2, 6, 16], &Device::Cpu).unwrap());

    // Layer by layer, each output added before the next norm.
    let mut h = x.clone();
    for l in &block.layers {
        h = l.forward(&cx, &h).unwrap().0;
    }
    let want = block.final_layernorm.as_ref().unwrap().forward(&cx, &h).unwrap().0;

    let (got, saved) = block.forward(&cx, &x).unwrap();
    assert_eq!(bits(&got), bits(&want), "llama {llama}, {recompute:?}: block output");
    let dx = block.backward(&cx, saved, &dy).unwrap();
    let grads: Vec<Vec<u32>> = table.ids().map(|id| bits(&table.grad(id).unwrap())).collect();
    assert!(dx.to_vec_f32().unwrap().iter().any(|v| *v != 0.0), "the input gradient is all zeros");

    // The same gradients from the recompute-free block built alike (its forward saved every layer).
    let mut p2 = ParamTableBuilder::default();
    let plain =
        TransformerBlock::stage(&mut p2, "decoder", &c, &tp, 0..c.num_layers, true, Recompute::default()).unwrap();
    let t2 = p2.build(&Device::Cpu, DType::BF16, 5).unwrap();
    let cx2 = Cx::new(&t2, true);
    let (_, s2) = plain.forward(&cx2, &x).unwrap();
    let dx2 = plain.backward(&cx2, s2, &dy).unwrap();
    assert_eq!(bits(&dx), bits(&dx2), "llama {llama}, {recompute:?}: input gradient");
    for (id, g) in t2.ids().zip(&grads) {
        assert_eq!(&bits(&t2.grad(id).unwrap()), g, "llama {llama}, {recompute:?}: {}", t2.meta(id).name);
    }
}

fn k_cast(t: Tensor) -> Tensor {
    ferrotron_kernels::cast(&t, DType::BF16).unwrap()
}

#[test]
fn pending_adds_equal_adding_first() {
    let full = Recompute { granularity: Granularity::Full, method: Method::Uniform, num_layers: 1 };
    for llama in [false, true] {
        check(llama, Recompute::default());
        check(llama, full);
    }
}
