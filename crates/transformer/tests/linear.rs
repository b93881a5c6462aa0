//! The linear layer computing in fp32 under bf16 parameters (the MoE router's
//! --moe-router-dtype fp32): its output, input gradient and weight gradient against an f64
//! reference on the same bf16 values, with main_grad in fp32 and in bf16.

use ferrotron_core::{Cx, DType, Device, Module, ParamTableBuilder, Tensor, rng::Philox};
use ferrotron_transformer::linear::Linear;

fn randn(n: usize, seed: u64) -> Vec<f32> {
    let mut v = vec![0f32; n];
    Philox::new(seed).fill_normal(0, 0.0, 1.0, &mut v);
    v
}

/// y[r, o] = Σ_i x[r, i] · w[o, i] in f64.
fn product(x: &[f64], w: &[f64], rows: usize, inp: usize, out: usize) -> Vec<f64> {
    (0..rows * out).map(|j| (0..inp).map(|i| x[j / out * inp + i] * w[j % out * inp + i]).sum()).collect()
}

fn close(got: &[f32], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!((g as f64 - w).abs() <= tol * (1.0 + w.abs()), "{what}[{i}]: {g} vs {w}");
    }
}

#[test]
fn fp32_compute_under_bf16_parameters() {
    let (rows, inp, out) = (6, 40, 5);
    for grad in [DType::F32, DType::BF16] {
        let mut p = ParamTableBuilder::default();
        let lin = Linear::new(&mut p, "router", inp, out, false, 1.0).unwrap().in_fp32();
        let mut table = p.build(&Device::Cpu, DType::BF16, 3).unwrap();
        table.set_grad_dtype(grad).unwrap();
        let x = Tensor::from_f32(&randn(rows * inp, 1), [rows, inp], DType::BF16, &Device::Cpu).unwrap();
        let x64: Vec<f64> = x.to_vec_f32().unwrap().into_iter().map(f64::from).collect();
        let w64: Vec<f64> = table.param(lin.weight).unwrap().to_vec_f32().unwrap().into_iter().map(f64::from).collect();
        let cx = Cx::new(&table, true);
        let (y, saved) = lin.forward(&cx, &x).unwrap();
        assert_eq!(y.dtype(), DType::F32, "the logits in fp32");
        close(&y.to_vec_f32().unwrap(), &product(&x64, &w64, rows, inp, out), 1e-5, "y");
        // In bf16 the same product is rounded: the fp32 layer is not the plain one.
        let mut plain = lin.clone();
        plain.compute = None;
        let yb = plain.forward(&cx, &x).unwrap().0;
        assert_eq!(yb.dtype(), DType::BF16);
        assert_ne!(yb.to_vec_f32().unwrap(), y.to_vec_f32().unwrap());

        let dy = Tensor::from_vec(randn(rows * out, 2), [rows, out], &Device::Cpu).unwrap();
        let dy64: Vec<f64> = dy.to_vec_f32().unwrap().into_iter().map(f64::from).collect();
        let dx = lin.backward(&cx, saved, &dy).unwrap();
        assert_eq!(dx.dtype(), DType::BF16, "dx in the input's dtype");
        // dx = dy · W: [rows, out] × [out, inp].
        let wt: Vec<f64> = (0..inp * out).map(|j| w64[j % out * inp + j / out]).collect();
        close(&dx.to_vec_f32().unwrap(), &product(&dy64, &wt, rows, out, inp), 1e-2, "dx (bf16)");
        // dW = dyᵀ · x: [out, rows] × [rows, inp].
        let dyt: Vec<f64> = (0..rows * out).map(|j| dy64[j % rows * out + j / rows]).collect();
        let xt: Vec<f64> = (0..rows * inp).map(|j| x64[j % rows * inp + j / rows]).collect();
        let tol = if grad == DType::F32 { 1e-5 } else { 1e-2 };
        close(
            &table.grad(lin.weight).unwrap().to_vec_f32().unwrap(),
            &product(&dyt, &xt, out, rows, inp),
            tol,
            &format!("dW into {grad} main_grad"),
        );
    }
}
