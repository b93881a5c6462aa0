//! The MoE crate on its own: one mixture-of-experts layer (8 SwiGLU experts, top-2, with the
//! load-balancing and z-losses) built into its own parameter table, a forward that shows how many
//! tokens each expert took, and a backward that adds the router's losses at a loss scale.
//!
//! `cargo run --release -p ferrotron-examples --example moe_layer`

use ferrotron_core::{Cx, DType, Device, ParamTableBuilder, Tensor, rng::Philox};
use ferrotron_moe::{MoeSpec, RouterSpec};
use ferrotron_parallel::{ProcessGroups, TensorParallel};
use ferrotron_transformer::spec::{Activation, FactoryCx, ModuleFactory};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (hidden, tokens) = (64, 512);
    let router = RouterSpec { topk: 2, aux_loss_coeff: 1e-2, z_loss_coeff: Some(1e-3), ..RouterSpec::default() };
    let spec = MoeSpec::new(8, 96, Activation::SwiGlu, router);
    let tp = TensorParallel::new(ProcessGroups::single().tp, false);
    let mut builder = ParamTableBuilder::default();
    let cx = FactoryCx { prefix: "decoder.layers.0.mlp", hidden, std: 0.02, out_std: 0.01, tp: &tp };
    let layer = spec.build(&cx, &mut builder)?;
    let table = builder.build(&Device::Cpu, DType::F32, 0)?;
    let count = spec.param_count(hidden).ok_or("the MoE spec counts its parameters")?;
    assert_eq!(count.total, table.numel());
    println!("{} parameters, {} of them used by each token", count.total, count.active);

    let mut x = vec![0f32; tokens * hidden];
    Philox::new(1).fill_normal(0, 0.0, 1.0, &mut x);
    let x = Tensor::from_vec(x, [tokens, hidden], &Device::Cpu)?;
    // A backward at loss scale 1/4 (four micro-batches): the router's losses are scaled as the
    // language-model loss would be.
    let cx = Cx::new(&table, true).with_grad_scale(0.25);
    let (y, saved) = layer.forward(&cx, &x)?;
    let experts = saved.tensors[2].to_vec::<u32>()?;
    let mut per_expert = vec![0usize; spec.num_experts];
    experts.iter().for_each(|&e| per_expert[e as usize] += 1);
    assert_eq!(per_expert.iter().sum::<usize>(), tokens * spec.router.topk);
    println!("tokens per expert: {per_expert:?}; output {:?}", y.dims());
    let dx = layer.backward(
        &cx,
        saved,
        &Tensor::from_vec(vec![1e-3f32; tokens * hidden], [tokens, hidden], &Device::Cpu)?,
    )?;
    let values = spec.metrics.take()?;
    println!(
        "load-balancing loss {:.4} (1 is balanced), z-loss {:.4}; input gradient {:?}",
        values.load_balancing_sum,
        values.z_sum,
        dx.dims()
    );
    Ok(())
}
