use crate::device_test;
use crate::util::*;
use ferrotron_core::Device;
use ferrotron_kernels::{self as k, cpu::activation as act, cpu::softmax as sm};
use proptest::prelude::*;

fn gelu_ref(x: f64) -> f64 {
    0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh())
}
fn silu_ref(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn pointwise_fwd_and_fd(n in 1usize..40, seed: u64) {
        let dev = Device::Cpu;
        let (x, r) = (randv(n, seed).iter().map(|v| v * 3.0).collect::<Vec<_>>(), randv(n, seed ^ 9));
        let xt = t32(&dev, &x, &[n]);
        assert_close(&host(&k::gelu(&xt).unwrap()), &x.iter().map(|&v| gelu_ref(v)).collect::<Vec<_>>(), 1e-5, 1e-6, "gelu");
        assert_close(&host(&k::silu(&xt).unwrap()), &x.iter().map(|&v| silu_ref(v)).collect::<Vec<_>>(), 1e-5, 1e-6, "silu");
        assert_close(&host(&k::relu2(&xt).unwrap()), &x.iter().map(|&v| v.max(0.0).powi(2)).collect::<Vec<_>>(), 1e-5, 1e-6, "relu2");
        let phi = |v: f64| 0.5 * (1.0 + libm::erf(v / std::f64::consts::SQRT_2));
        assert_close(&host(&k::gelu_exact(&xt).unwrap()), &x.iter().map(|&v| v * phi(v)).collect::<Vec<_>>(), 1e-5, 1e-6, "gelu_exact");
        assert_close(&host(&k::quick_gelu(&xt).unwrap()), &x.iter().map(|&v| v / (1.0 + (-1.702 * v).exp())).collect::<Vec<_>>(), 1e-5, 1e-6, "quick_gelu");
        type F = fn(&[f64], &mut [f64]);
        type B = fn(&[f64], &[f64], &mut [f64]);
        for (name, f, b) in [("gelu", act::gelu_fwd::<f64> as F, act::gelu_bwd::<f64> as B), ("silu", act::silu_fwd::<f64>, act::silu_bwd::<f64>), ("relu2", act::relu2_fwd::<f64>, act::relu2_bwd::<f64>), ("quick_gelu", act::quick_gelu_fwd::<f64>, act::quick_gelu_bwd::<f64>), ("gelu_exact", act::gelu_exact_fwd::<f64>, act::gelu_exact_bwd::<f64>)] {
            // relu2's kink at 0 is out of reach of the differences' steps (1e-5) for these draws.
            if name == "relu2" && x.iter().any(|v| v.abs() < 1e-4) { continue; }
            let mut dx = vec![0.0; n];
            b(&x, &r, &mut dx);
            fd_check(&x, &dx, |x| { let mut y = vec![0.0; n]; f(x, &mut y); dot(&y, &r) }, name);
        }
    }

    #[test]
    fn swiglu_fwd_and_fd(rows in 1usize..4, f in 1usize..6, seed: u64) {
        let dev = Device::Cpu;
        let (x, r) = (randv(rows * 2 * f, seed), randv(rows * f, seed ^ 9));
        let want: Vec<f64> = x.chunks(2 * f).flat_map(|c| (0..f).map(move |i| silu_ref(c[i]) * c[f + i])).collect();
        let y = k::swiglu(&t32(&dev, &x, &[rows, 2 * f])).unwrap();
        prop_assert_eq!(y.dims(), &[rows, f]);
        assert_close(&host(&y), &want, 1e-5, 1e-6, "swiglu");
        let mut dx = vec![0.0; x.len()];
        act::swiglu_bwd(&x, &r, f, &mut dx);
        fd_check(&x, &dx, |x| { let mut y = vec![0.0; rows * f]; act::swiglu_fwd(x, f, &mut y); dot(&y, &r) }, "swiglu dx");
    }

    #[test]
    fn softmax_fwd_and_fd(rows in 1usize..4, c in 1usize..9, seed: u64) {
        let dev = Device::Cpu;
        let (x, r) = (randv(rows * c, seed), randv(rows * c, seed ^ 9));
        let want: Vec<f64> = x.chunks(c).flat_map(|row| {
            let z: f64 = row.iter().map(|v| v.exp()).sum();
            row.iter().map(move |v| v.exp() / z).collect::<Vec<_>>()
        }).collect();
        assert_close(&host(&k::softmax(&t32(&dev, &x, &[rows, c])).unwrap()), &want, 1e-5, 1e-6, "softmax");
        let mut y = vec![0.0; x.len()];
        sm::softmax_fwd(&x, c, &mut y);
        let mut dx = vec![0.0; x.len()];
        sm::softmax_bwd(&y, &r, c, &mut dx);
        fd_check(&x, &dx, |x| { let mut y = vec![0.0; x.len()]; sm::softmax_fwd(x, c, &mut y); dot(&y, &r) }, "softmax dx");
    }
}

device_test!(tensor_backwards_agree_with_f64, |dev: &Device| {
    let (x, r) = (randv(3 * 8, 1), randv(3 * 8, 2));
    let (xt, rt) = (t32(dev, &x, &[3, 8]), t32(dev, &r, &[3, 8]));
    let mut want = vec![0.0; 24];
    act::gelu_bwd(&x, &r, &mut want);
    assert_close(&host(&k::gelu_bwd(&xt, &rt).unwrap()), &want, 1e-5, 1e-6, "gelu_bwd");
    act::silu_bwd(&x, &r, &mut want);
    assert_close(&host(&k::silu_bwd(&xt, &rt).unwrap()), &want, 1e-5, 1e-6, "silu_bwd");
    act::relu2_bwd(&x, &r, &mut want);
    assert_close(&host(&k::relu2_bwd(&xt, &rt).unwrap()), &want, 1e-5, 1e-6, "relu2_bwd");
    act::gelu_exact_bwd(&x, &r, &mut want);
    assert_close(&host(&k::gelu_exact_bwd(&xt, &rt).unwrap()), &want, 1e-5, 1e-6, "gelu_exact_bwd");
    act::quick_gelu_bwd(&x, &r, &mut want);
    assert_close(&host(&k::quick_gelu_bwd(&xt, &rt).unwrap()), &want, 1e-5, 1e-6, "quick_gelu_bwd");
    let r4 = t32(dev, &r[..12], &[3, 4]);
    act::swiglu_bwd(&x, &r[..12], 4, &mut want);
    assert_close(&host(&k::swiglu_bwd(&xt, &r4).unwrap()), &want, 1e-5, 1e-6, "swiglu_bwd");
    let y = k::softmax(&xt).unwrap();
    let mut y64 = vec![0.0; 24];
    sm::softmax_fwd(&x, 8, &mut y64);
    sm::softmax_bwd(&y64, &r, 8, &mut want);
    assert_close(&host(&k::softmax_bwd(&y, &rt).unwrap()), &want, 1e-5, 1e-6, "softmax_bwd");
});

// gpt-oss's gated quick GeLU against its formula in f64 (offset 1, clamp 1.5 holding about a
// third of the inputs; and neither), its backward against finite differences of the formula
// (zero through a clamped input); widths of 16 (eight a thread on a GPU) and 5.
device_test!(quick_geglu_matches_formula_and_fd, |dev: &Device| {
    for (f, offset, clamp) in [(16usize, 1.0f32, Some(1.5f32)), (5, 0.0, None), (16, -0.5, None)] {
        let rows = 3;
        let x: Vec<f64> = randv(rows * 2 * f, 7).iter().map(|v| 3.0 * v).collect();
        let r = randv(rows * f, 8);
        let c = clamp.map_or(f64::INFINITY, f64::from);
        let qgelu = |z: f64| z / (1.0 + (-1.702 * z).exp());
        let formula = |x: &[f64]| -> Vec<f64> {
            x.chunks(2 * f)
                .flat_map(|row| (0..f).map(move |i| qgelu(row[i].min(c)) * (row[f + i].clamp(-c, c) + offset as f64)))
                .collect()
        };
        let tag = format!("quick_geglu f {f} offset {offset} clamp {clamp:?}");
        let xt = t32(dev, &x, &[rows, 2 * f]);
        let y = k::quick_geglu(&xt, offset, clamp).unwrap();
        assert_eq!(y.dims(), &[rows, f]);
        assert_close(&host(&y), &formula(&x), 1e-5, 1e-6, &tag);
        let dx = host(&k::quick_geglu_bwd(&xt, &t32(dev, &r, &[rows, f]), offset, clamp).unwrap());
        fd_check(&x, &dx, |x| dot(&formula(x), &r), &tag);
        if clamp.is_some() {
            let held = x
                .chunks(2 * f)
                .flat_map(|row| (0..2 * f).map(move |i| if i < f { row[i] > c } else { row[i].abs() > c }));
            let held: Vec<bool> = held.collect();
            assert!(held.iter().filter(|&&h| h).count() > x.len() / 8, "{tag}: the clamp holds too few inputs to test");
            assert!(held.iter().zip(&dx).all(|(h, d)| !h || *d == 0.0), "{tag}: a gradient through a clamped input");
        }
    }
    let odd = t32(dev, &randv(6, 1), &[2, 3]);
    assert!(k::quick_geglu(&odd, 0.0, None).unwrap_err().to_string().contains("quick_geglu"));
});

// The attention output gate x·σ(g) against the formula in f64, its backward against finite
// differences in x and g; the dtypes and shapes it takes are checked by name.
device_test!(sigmoid_gate_matches_formula_and_fd, |dev: &Device| {
    let n = 3 * 16;
    let (x, g, r) = (randv(n, 3), randv(n, 4).iter().map(|v| 2.0 * v).collect::<Vec<_>>(), randv(n, 5));
    let (xt, gt, rt) = (t32(dev, &x, &[3, 16]), t32(dev, &g, &[3, 16]), t32(dev, &r, &[3, 16]));
    let sig = |v: f64| 1.0 / (1.0 + (-v).exp());
    let want: Vec<f64> = x.iter().zip(&g).map(|(x, g)| x * sig(*g)).collect();
    assert_close(&host(&k::sigmoid_gate(&xt, &gt).unwrap()), &want, 1e-5, 1e-6, "sigmoid_gate");
    let (dx, dg) = k::sigmoid_gate_bwd(&xt, &gt, &rt).unwrap();
    let f = |x: &[f64], g: &[f64]| {
        let mut y = vec![0.0; n];
        act::sigmoid_gate_fwd(x, g, &mut y);
        dot(&y, &r)
    };
    fd_check(&x, &host(&dx), |x| f(x, &g), "sigmoid_gate dx");
    fd_check(&g, &host(&dg), |g| f(&x, g), "sigmoid_gate dg");
    let e = k::sigmoid_gate(&xt, &t32(dev, &g[..16], &[1, 16])).unwrap_err().to_string();
    assert!(e.contains("sigmoid_gate"), "{e}");
    let bf = tensor(dev, &g, &[3, 16], ferrotron_core::DType::BF16);
    assert!(k::sigmoid_gate(&xt, &bf).is_err(), "a gate of another dtype");
});

#[test]
fn swiglu_needs_even_width() {
    let e = k::swiglu(&t32(&Device::Cpu, &randv(6, 0), &[2, 3])).unwrap_err();
    assert!(e.to_string().contains("swiglu"), "{e}");
}
