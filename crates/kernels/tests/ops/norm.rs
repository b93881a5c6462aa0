use crate::device_test;
use crate::util::*;
use ferrotron_core::Device;
use ferrotron_kernels::{self as k, cpu::norm};
use proptest::prelude::*;

fn ln_ref(x: &[f64], w: &[f64], b: &[f64], c: usize, eps: f64) -> Vec<f64> {
    x.chunks(c)
        .flat_map(|r| {
            let mu = r.iter().sum::<f64>() / c as f64;
            let var = r.iter().map(|v| (v - mu).powi(2)).sum::<f64>() / c as f64;
            r.iter().enumerate().map(move |(i, v)| (v - mu) / (var + eps).sqrt() * w[i] + b[i]).collect::<Vec<_>>()
        })
        .collect()
}

fn rms_ref(x: &[f64], w: &[f64], c: usize, eps: f64) -> Vec<f64> {
    x.chunks(c)
        .flat_map(|r| {
            let ms = r.iter().map(|v| v * v).sum::<f64>() / c as f64;
            r.iter().enumerate().map(move |(i, v)| v / (ms + eps).sqrt() * w[i]).collect::<Vec<_>>()
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn layernorm_fwd_and_fd(rows in 1usize..5, c in 1usize..9, seed: u64) {
        let eps = 1e-5;
        let (x, w, b, r) = (randv(rows * c, seed), randv(c, seed ^ 1), randv(c, seed ^ 2), randv(rows * c, seed ^ 3));
        let dev = Device::Cpu;
        let (y, _, _) = k::layernorm_fwd(&t32(&dev, &x, &[rows, c]), &t32(&dev, &w, &[c]), Some(&t32(&dev, &b, &[c])), eps).unwrap();
        assert_close(&host(&y), &ln_ref(&x, &w, &b, c, eps), 1e-4, 1e-4, "layernorm");
        if c < 2 { return Ok(()); } // a single feature normalises to exactly b: no x gradient to check
        let f = |x: &[f64], w: &[f64], b: &[f64]| {
            let (mut y, mut m, mut s) = (vec![0.0; rows * c], vec![0.0; rows], vec![0.0; rows]);
            norm::layernorm_fwd(x, w, Some(b), eps, c, &mut y, &mut m, &mut s);
            dot(&y, &r)
        };
        let (mut y, mut m, mut s) = (vec![0.0; rows * c], vec![0.0; rows], vec![0.0; rows]);
        norm::layernorm_fwd(&x, &w, Some(&b), eps, c, &mut y, &mut m, &mut s);
        let mut dx = vec![0.0; rows * c];
        let (dw, db) = norm::layernorm_bwd(&r, &x, &w, &m, &s, c, &mut dx);
        fd_check(&x, &dx, |x| f(x, &w, &b), "ln dx");
        fd_check(&w, &dw, |w| f(&x, w, &b), "ln dw");
        fd_check(&b, &db, |b| f(&x, &w, b), "ln db");
    }

    #[test]
    fn rmsnorm_fwd_and_fd(rows in 1usize..5, c in 1usize..9, seed: u64) {
        let eps = 1e-5;
        let (x, w, r) = (randv(rows * c, seed), randv(c, seed ^ 1), randv(rows * c, seed ^ 3));
        let dev = Device::Cpu;
        let (y, _) = k::rmsnorm_fwd(&t32(&dev, &x, &[rows, c]), &t32(&dev, &w, &[c]), eps).unwrap();
        assert_close(&host(&y), &rms_ref(&x, &w, c, eps), 1e-4, 1e-4, "rmsnorm");
        let f = |x: &[f64], w: &[f64]| {
            let (mut y, mut s) = (vec![0.0; rows * c], vec![0.0; rows]);
            norm::rmsnorm_fwd(x, w, eps, c, &mut y, &mut s);
            dot(&y, &r)
        };
        let (mut y, mut s) = (vec![0.0; rows * c], vec![0.0; rows]);
        norm::rmsnorm_fwd(&x, &w, eps, c, &mut y, &mut s);
        let mut dx = vec![0.0; rows * c];
        let dw = norm::rmsnorm_bwd(&r, &x, &w, &s, c, &mut dx);
        fd_check(&x, &dx, |x| f(x, &w), "rms dx");
        fd_check(&w, &dw, |w| f(&x, w), "rms dw");
    }
}

device_test!(tensor_backward_agrees_with_f64, |dev: &Device| {
    let (rows, c) = (70, 12); // more rows than one reduction chunk
    let (x, w, b, r) = (randv(rows * c, 1), randv(c, 2), randv(c, 3), randv(rows * c, 4));
    let (xt, wt) = (t32(dev, &x, &[rows, c]), t32(dev, &w, &[c]));
    let (_, mean, rstd) = k::layernorm_fwd(&xt, &wt, Some(&t32(dev, &b, &[c])), 1e-5).unwrap();
    let (dx, dw, db) = k::layernorm_bwd(&t32(dev, &r, &[rows, c]), &xt, &wt, &mean, &rstd).unwrap();
    let (mut y, mut m, mut s) = (vec![0.0; rows * c], vec![0.0; rows], vec![0.0; rows]);
    norm::layernorm_fwd(&x, &w, Some(&b), 1e-5, c, &mut y, &mut m, &mut s);
    let mut dx64 = vec![0.0; rows * c];
    let (dw64, db64) = norm::layernorm_bwd(&r, &x, &w, &m, &s, c, &mut dx64);
    assert_close(&host(&dx), &dx64, 1e-4, 1e-4, "dx");
    assert_close(&host(&dw), &dw64, 1e-4, 1e-4, "dw");
    assert_close(&host(&db), &db64, 1e-4, 1e-4, "db");
});

device_test!(bf16_layernorm_close_to_f32, |dev: &Device| {
    let (x, w, b) = (randv(8 * 32, 1), randv(32, 2), randv(32, 3));
    let bf = |v: &[f64], s: &[usize]| tensor(dev, v, s, ferrotron_core::DType::BF16);
    let (y, _, _) = k::layernorm_fwd(&bf(&x, &[8, 32]), &bf(&w, &[32]), Some(&bf(&b, &[32])), 1e-5).unwrap();
    assert_eq!(y.dtype(), ferrotron_core::DType::BF16);
    assert_close(&host(&y), &ln_ref(&x, &w, &b, 32, 1e-5), 2e-2, 5e-2, "bf16 layernorm");
});

// Zero-centred weights (`Gamma::one_plus`, --apply-layernorm-1p): every norm op scales by 1 + w,
// as the same op given the tensor w + 1 does, with the weight's gradient unchanged. Widths 12 (the
// one-element row kernels on a GPU) and 256 (eight-wide, and the backward with the parameter
// gradients fused); the forward also against the f64 reference.
device_test!(zero_centred_weights_scale_by_one_plus_w, |dev: &Device| {
    for c in [12, 256] {
        let rows = 70;
        let (x, x2, w, b) = (randv(rows * c, 1), randv(rows * c, 2), randv(c, 3), randv(c, 4));
        let w1: Vec<f64> = w.iter().map(|v| v + 1.0).collect();
        let (xt, x2t, wt, w1t, bt) = (
            t32(dev, &x, &[rows, c]),
            t32(dev, &x2, &[rows, c]),
            t32(dev, &w, &[c]),
            t32(dev, &w1, &[c]),
            t32(dev, &b, &[c]),
        );
        let (dy, res) = (t32(dev, &randv(rows * c, 5), &[rows, c]), t32(dev, &randv(rows * c, 6), &[rows, c]));
        let g = k::Gamma::one_plus(&wt);
        let what = |s: &str| format!("{s} c{c}");

        let (y, m, r) = k::layernorm_fwd(&xt, g, Some(&bt), 1e-5).unwrap();
        let (y1, m1, r1) = k::layernorm_fwd(&xt, &w1t, Some(&bt), 1e-5).unwrap();
        assert_close(&host(&y), &host(&y1), 1e-6, 1e-6, &what("layernorm 1p"));
        assert_close(&host(&y), &ln_ref(&x, &w1, &b, c, 1e-5), 1e-4, 1e-4, &what("layernorm 1p vs f64"));
        let (dx, dw, db) = k::layernorm_bwd(&dy, &xt, g, &m, &r).unwrap();
        let (dx1, dw1, db1) = k::layernorm_bwd(&dy, &xt, &w1t, &m1, &r1).unwrap();
        for (a, b, n) in [(&dx, &dx1, "dx"), (&dw, &dw1, "dw"), (&db, &db1, "db")] {
            assert_close(&host(a), &host(b), 1e-6, 1e-6, &what(&format!("layernorm 1p {n}")));
        }
        // The fused residual add and the main_grad backward.
        let (s, y, m, r) = k::add_layernorm_fwd(&xt, &x2t, g, Some(&bt), 1e-5).unwrap();
        let (_, y1, _, _) = k::add_layernorm_fwd(&xt, &x2t, &w1t, Some(&bt), 1e-5).unwrap();
        assert_close(&host(&y), &host(&y1), 1e-6, 1e-6, &what("add_layernorm 1p"));
        let grads = || t32(dev, &vec![0.0; c], &[c]);
        let (gw, gb, gr) = (grads(), grads(), grads());
        let dx = k::layernorm_bwd_into_bias(&dy, &s, g, &m, &r, &res, &gw, &gb, &gr, false).unwrap();
        let (dx1, dw1, db1) = k::layernorm_bwd_add(&dy, &s, &w1t, &m, &r, &res).unwrap();
        for (a, b, n) in [(&dx, &dx1, "dx"), (&gw, &dw1, "dw"), (&gb, &db1, "db")] {
            assert_close(&host(a), &host(b), 1e-6, 1e-6, &what(&format!("layernorm_bwd_into_bias 1p {n}")));
        }

        let (y, r) = k::rmsnorm_fwd(&xt, g, 1e-5).unwrap();
        assert_close(&host(&y), &rms_ref(&x, &w1, c, 1e-5), 1e-4, 1e-4, &what("rmsnorm 1p vs f64"));
        let (dx, dw) = k::rmsnorm_bwd(&dy, &xt, g, &r).unwrap();
        let (dx1, dw1) = k::rmsnorm_bwd(&dy, &xt, &w1t, &r).unwrap();
        assert_close(&host(&dx), &host(&dx1), 1e-6, 1e-6, &what("rmsnorm 1p dx"));
        assert_close(&host(&dw), &host(&dw1), 1e-6, 1e-6, &what("rmsnorm 1p dw"));
        let (s, y, r) = k::add_rmsnorm_fwd(&xt, &x2t, g, 1e-5).unwrap();
        let (_, y1, _) = k::add_rmsnorm_fwd(&xt, &x2t, &w1t, 1e-5).unwrap();
        assert_close(&host(&y), &host(&y1), 1e-6, 1e-6, &what("add_rmsnorm 1p"));
        let (gw, gr) = (grads(), grads());
        let dx = k::rmsnorm_bwd_into_bias(&dy, &s, g, &r, &res, &gw, &gr, false).unwrap();
        let (dx1, dw1) = k::rmsnorm_bwd_add(&dy, &s, &w1t, &r, &res).unwrap();
        assert_close(&host(&dx), &host(&dx1), 1e-6, 1e-6, &what("rmsnorm_bwd_into_bias 1p dx"));
        assert_close(&host(&gw), &host(&dw1), 1e-6, 1e-6, &what("rmsnorm_bwd_into_bias 1p dw"));
    }
});

#[test]
fn weight_of_wrong_size_is_an_error() {
    let dev = Device::Cpu;
    let e = k::rmsnorm_fwd(&t32(&dev, &randv(12, 0), &[3, 4]), &t32(&dev, &randv(5, 0), &[5]), 1e-5).unwrap_err();
    assert!(e.to_string().contains("rmsnorm_fwd") && e.to_string().contains("[4]"), "{e}");
}

// The `_into` backwards add their parameter gradients into views of one flat f32 buffer (as
// main_grad), at an offset off 16-byte alignment and with values already there, or with `acc`
// false store them over what is there (the first op of a step to reach a parameter); dx (+ res)
// and every other element of the buffer are left as the plain backward gives them.
device_test!(parameter_gradients_add_into_main_grad_views, |dev: &Device| {
    let (rows, c) = (150, 24); // several reduction chunks, the last short
    let (x, w, b, r, res) = (randv(rows * c, 1), randv(c, 2), randv(c, 3), randv(rows * c, 4), randv(rows * c, 5));
    let (xt, wt, rt, rest) =
        (t32(dev, &x, &[rows, c]), t32(dev, &w, &[c]), t32(dev, &r, &[rows, c]), t32(dev, &res, &[rows, c]));
    let flat0 = randv(4 * c + 3, 6);
    let flat = t32(dev, &flat0, &[4 * c + 3]);
    let (dw_v, db_v, rw_v) =
        (flat.view(1, [c]).unwrap(), flat.view(c + 2, [c]).unwrap(), flat.view(3 * c + 3, [c]).unwrap());
    let (_, mean, rstd) = k::layernorm_fwd(&xt, &wt, Some(&t32(dev, &b, &[c])), 1e-5).unwrap();
    let dx = k::layernorm_bwd_into(&rt, &xt, &wt, &mean, &rstd, Some(&rest), &dw_v, &db_v, true).unwrap();
    let (dx_ref, dw, db) = k::layernorm_bwd_add(&rt, &xt, &wt, &mean, &rstd, &rest).unwrap();
    assert_close(&host(&dx), &host(&dx_ref), 1e-6, 1e-6, "layernorm dx + res");
    let (_, rs) = k::rmsnorm_fwd(&xt, &wt, 1e-5).unwrap();
    let dx2 = k::rmsnorm_bwd_into(&rt, &xt, &wt, &rs, None, &rw_v, true).unwrap();
    let (dx2_ref, rw) = k::rmsnorm_bwd(&rt, &xt, &wt, &rs).unwrap();
    assert_close(&host(&dx2), &host(&dx2_ref), 1e-6, 1e-6, "rmsnorm dx");
    let mut want = flat0.clone();
    for (at, g) in [(1, host(&dw)), (c + 2, host(&db)), (3 * c + 3, host(&rw))] {
        want[at..at + c].iter_mut().zip(&g).for_each(|(v, g)| *v += g);
    }
    assert_close(&host(&flat), &want, 1e-6, 1e-6, "main_grad after the norms");
    // The bias gradient of bf16 activations, into the same buffer's first view.
    let dy = tensor(dev, &r, &[rows, c], ferrotron_core::DType::BF16);
    k::bias_grad_into(&dw_v, &dy, true).unwrap();
    let bg = host(&k::bias_grad(&dy).unwrap());
    want[1..1 + c].iter_mut().zip(&bg).for_each(|(v, g)| *v += g);
    assert_close(&host(&flat), &want, 1e-6, 1e-6, "main_grad after the bias gradient");
    // Stored over the old values: the views then hold the gradients alone.
    k::layernorm_bwd_into(&rt, &xt, &wt, &mean, &rstd, Some(&rest), &dw_v, &db_v, false).unwrap();
    k::rmsnorm_bwd_into(&rt, &xt, &wt, &rs, None, &rw_v, false).unwrap();
    for (at, g) in [(1, host(&dw)), (c + 2, host(&db)), (3 * c + 3, host(&rw))] {
        want[at..at + c].copy_from_slice(&g);
    }
    assert_close(&host(&flat), &want, 1e-6, 1e-6, "main_grad after the norms, stored");
    k::bias_grad_into(&db_v, &dy, false).unwrap();
    want[c + 2..2 * c + 2].copy_from_slice(&bg);
    assert_close(&host(&flat), &want, 1e-6, 1e-6, "main_grad after the bias gradient, stored");
});

// The `_into_bias` backwards also sum the residual's rows into a third view (a linear layer's
// bias gradient; on a GPU inside the norm's kernel at this width): added, then stored, each
// against the plain backward and the plain column sum of the residual.
device_test!(residual_bias_gradient_rides_in_the_norm_backward, |dev: &Device| {
    let (rows, c) = (150, 256);
    let (x, w, b, r, res) = (randv(rows * c, 1), randv(c, 2), randv(c, 3), randv(rows * c, 4), randv(rows * c, 5));
    let (xt, wt, rt, rest) =
        (t32(dev, &x, &[rows, c]), t32(dev, &w, &[c]), t32(dev, &r, &[rows, c]), t32(dev, &res, &[rows, c]));
    let flat0 = randv(5 * c, 6);
    let flat = t32(dev, &flat0, &[5 * c]);
    let v: Vec<ferrotron_core::Tensor> = (0..5).map(|i| flat.view(i * c, [c]).unwrap()).collect();
    let (_, mean, rstd) = k::layernorm_fwd(&xt, &wt, Some(&t32(dev, &b, &[c])), 1e-5).unwrap();
    let (_, rs) = k::rmsnorm_fwd(&xt, &wt, 1e-5).unwrap();
    let (dx_ref, dw, db) = k::layernorm_bwd_add(&rt, &xt, &wt, &mean, &rstd, &rest).unwrap();
    let (dx2_ref, rw) = k::rmsnorm_bwd_add(&rt, &xt, &wt, &rs, &rest).unwrap();
    let sums = host(&k::bias_grad(&rest).unwrap());
    for acc in [true, false] {
        let dx = k::layernorm_bwd_into_bias(&rt, &xt, &wt, &mean, &rstd, &rest, &v[0], &v[1], &v[2], acc).unwrap();
        let dx2 = k::rmsnorm_bwd_into_bias(&rt, &xt, &wt, &rs, &rest, &v[3], &v[4], acc).unwrap();
        assert_close(&host(&dx), &host(&dx_ref), 1e-6, 1e-6, "layernorm dx + res");
        assert_close(&host(&dx2), &host(&dx2_ref), 1e-6, 1e-6, "rmsnorm dx + res");
        let mut want = if acc { flat0.clone() } else { vec![0.0; 5 * c] };
        for (i, g) in [host(&dw), host(&db), sums.clone(), host(&rw), sums.clone()].iter().enumerate() {
            want[i * c..(i + 1) * c].iter_mut().zip(g).for_each(|(v, g)| *v += g);
        }
        assert_close(&host(&flat), &want, 1e-5, 1e-5, &format!("main_grad, acc {acc}"));
    }
});

#[test]
fn a_gradient_destination_of_the_wrong_size_is_an_error() {
    let dev = Device::Cpu;
    let (x, w) = (t32(&dev, &randv(12, 0), &[3, 4]), t32(&dev, &randv(4, 1), &[4]));
    let (_, rstd) = k::rmsnorm_fwd(&x, &w, 1e-5).unwrap();
    let e = k::rmsnorm_bwd_into(&x, &x, &w, &rstd, None, &t32(&dev, &randv(5, 2), &[5]), true).unwrap_err();
    assert!(e.to_string().contains("rmsnorm_bwd") && e.to_string().contains("[4]"), "{e}");
    let e = k::bias_grad_into(&t32(&dev, &randv(3, 2), &[3]), &x, true).unwrap_err();
    assert!(e.to_string().contains("bias_grad_into") && e.to_string().contains("[4]"), "{e}");
}

// No rows (c = 256 takes the fused backward on a GPU): empty outputs, parameter gradients of
// zero, and no kernel indexing a row that is not there.
device_test!(norms_of_no_rows_are_empty_with_zero_parameter_gradients, |dev: &Device| {
    let c = 256;
    let (x, w, b) = (t32(dev, &[], &[0, c]), t32(dev, &randv(c, 2), &[c]), t32(dev, &randv(c, 3), &[c]));
    let (y, mean, rstd) = k::layernorm_fwd(&x, &w, Some(&b), 1e-5).unwrap();
    assert_eq!((y.dims(), mean.elem_count()), (&[0, c][..], 0));
    let (dx, dw, db) = k::layernorm_bwd(&x, &x, &w, &mean, &rstd).unwrap();
    assert_eq!(dx.dims(), &[0, c]);
    assert_eq!((host(&dw), host(&db)), (vec![0.0; c], vec![0.0; c]));
    let (_, r) = k::rmsnorm_fwd(&x, &w, 1e-5).unwrap();
    let (dx, dw) = k::rmsnorm_bwd(&x, &x, &w, &r).unwrap();
    assert_eq!((dx.elem_count(), host(&dw)), (0, vec![0.0; c]));
});
