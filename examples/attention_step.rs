//! One forward and backward pass of GQA causal attention using only ferrotron-core and
//! ferrotron-kernels: the kernels crate on its own is a usable op library.
//!
//! Run: `cargo run --release -p ferrotron-examples --example attention_step`

use ferrotron_core::{DType, Device, Tensor, rng::Philox};
use ferrotron_kernels as k;

fn randn(shape: &[usize], stream: u64) -> ferrotron_core::Result<Tensor> {
    let mut v = vec![0f32; shape.iter().product()];
    Philox::new(1234).with_stream(stream).fill_normal(0, 0.0, 1.0, &mut v);
    Tensor::from_f32(&v, shape.to_vec(), DType::F32, &Device::Cpu)
}

fn main() -> ferrotron_core::Result<()> {
    // batch 2, 16 tokens, 8 query heads sharing 2 kv heads, head dim 32, with RoPE on q and k.
    let (b, t, hq, hkv, d) = (2, 16, 8, 2, 32);
    let rope = k::RopeCfg::new(d, 10000.0);
    let q = k::rope_fwd(&randn(&[b, t, hq, d], 0)?, &rope)?;
    let kk = k::rope_fwd(&randn(&[b, t, hkv, d], 1)?, &rope)?;
    let v = randn(&[b, t, hkv, d], 2)?;
    let cfg = k::AttnCfg { causal: true, window: Some(8), scale: None, dropout: None, docs: None };
    let (o, lse) = k::attention_fwd(&q, &kk, &v, &cfg)?;
    let (dq, dk, dv) = k::attention_bwd(&q, &kk, &v, &o, &lse, &o, &cfg)?;
    let norm = |t: &Tensor| k::global_l2_norm(&[t]);
    println!("out {:?}  |out| = {:.4}", o.dims(), norm(&o)?);
    println!(
        "dq {:?} |dq| = {:.4}   dk {:?} |dk| = {:.4}   dv {:?} |dv| = {:.4}",
        dq.dims(),
        norm(&dq)?,
        dk.dims(),
        norm(&dk)?,
        dv.dims(),
        norm(&dv)?
    );
    Ok(())
}
