use crate::device_test;
use crate::util::*;
use ferrotron_core::{DType, Device, Tensor};
use ferrotron_kernels::cpu::attention::{self as at, AttnDims, AttnMask};
use ferrotron_kernels::{self as k, AttnCfg};
use proptest::prelude::*;

/// Naive attention: explicit loops over every (batch, head, query, key).
fn reference(q: &[f64], kk: &[f64], v: &[f64], d: AttnDims, mask: AttnMask) -> Vec<f64> {
    let scale = 1.0 / (d.d as f64).sqrt();
    let mut o = vec![0.0; q.len()];
    for b in 0..d.b {
        for h in 0..d.hq {
            let kvh = h / (d.hq / d.hkv);
            for i in 0..d.t {
                let qi = &q[((b * d.t + i) * d.hq + h) * d.d..][..d.d];
                let allowed: Vec<usize> = (0..d.s).filter(|&j| mask.allows(i, j)).collect();
                let scores: Vec<f64> = allowed
                    .iter()
                    .map(|&j| {
                        let kj = &kk[((b * d.s + j) * d.hkv + kvh) * d.d..][..d.d];
                        scale * qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>()
                    })
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = scores.iter().map(|s| (s - max).exp()).sum();
                for (&j, s) in allowed.iter().zip(&scores) {
                    let p = (s - max).exp() / z;
                    for e in 0..d.d {
                        o[((b * d.t + i) * d.hq + h) * d.d + e] += p * v[((b * d.s + j) * d.hkv + kvh) * d.d + e];
                    }
                }
            }
        }
    }
    o
}

fn run_f64(q: &[f64], kk: &[f64], v: &[f64], d: AttnDims, mask: AttnMask) -> (Vec<f64>, Vec<f64>) {
    let mut o = vec![0.0; q.len()];
    let mut lse = vec![0.0; d.b * d.hq * d.t];
    at::attention_fwd(q, kk, v, d, mask, 1.0 / (d.d as f64).sqrt(), &mut o, &mut lse);
    (o, lse)
}

fn dims_strategy() -> impl Strategy<Value = (AttnDims, AttnMask)> {
    (1usize..3, 1usize..6, 1usize..3, 1usize..3, 1usize..5, any::<bool>(), prop::option::of(1usize..4)).prop_map(
        |(b, t, hkv, group, d, causal, window)| {
            (AttnDims { b, t, s: t, hq: hkv * group, hkv, d }, AttnMask { causal: causal || window.is_some(), window })
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn forward_matches_naive((d, mask) in dims_strategy(), seed: u64) {
        let dev = Device::Cpu;
        let (q, kk, v) = (randv(d.b * d.t * d.hq * d.d, seed), randv(d.b * d.s * d.hkv * d.d, seed ^ 1), randv(d.b * d.s * d.hkv * d.d, seed ^ 2));
        let cfg = AttnCfg { causal: mask.causal, window: mask.window, scale: None };
        let (o, lse) = k::attention_fwd(&t32(&dev, &q, &[d.b, d.t, d.hq, d.d]), &t32(&dev, &kk, &[d.b, d.s, d.hkv, d.d]), &t32(&dev, &v, &[d.b, d.s, d.hkv, d.d]), &cfg).unwrap();
        prop_assert_eq!(lse.dims(), &[d.b, d.hq, d.t]);
        assert_close(&host(&o), &reference(&q, &kk, &v, d, mask), 1e-5, 1e-5, "attention");
    }

    #[test]
    fn backward_matches_finite_differences((d, mask) in dims_strategy(), seed: u64) {
        let (q, kk, v) = (randv(d.b * d.t * d.hq * d.d, seed), randv(d.b * d.s * d.hkv * d.d, seed ^ 1), randv(d.b * d.s * d.hkv * d.d, seed ^ 2));
        let r = randv(q.len(), seed ^ 3);
        let (o, lse) = run_f64(&q, &kk, &v, d, mask);
        let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; kk.len()], vec![0.0; v.len()]);
        at::attention_bwd(&q, &kk, &v, &o, &lse, &r, d, mask, 1.0 / (d.d as f64).sqrt(), &mut dq, &mut dk, &mut dv);
        fd_check(&q, &dq, |x| dot(&run_f64(x, &kk, &v, d, mask).0, &r), "dq");
        fd_check(&kk, &dk, |x| dot(&run_f64(&q, x, &v, d, mask).0, &r), "dk");
        fd_check(&v, &dv, |x| dot(&run_f64(&q, &kk, x, d, mask).0, &r), "dv");
    }
}

device_test!(gqa_equals_mha_with_repeated_kv, |dev: &Device| {
    let (b, t, hq, hkv, dd) = (2, 7, 6, 2, 4);
    let (q, kk, v, r) =
        (randv(b * t * hq * dd, 1), randv(b * t * hkv * dd, 2), randv(b * t * hkv * dd, 3), randv(b * t * hq * dd, 4));
    // Repeat each kv head for its group of hq / hkv query heads.
    let rep = |x: &[f64]| -> Vec<f64> {
        let mut out = Vec::new();
        for row in x.chunks(hkv * dd) {
            for h in 0..hq {
                out.extend_from_slice(&row[(h / (hq / hkv)) * dd..][..dd]);
            }
        }
        out
    };
    let cfg = AttnCfg::default();
    let (qt, rt) = (t32(dev, &q, &[b, t, hq, dd]), t32(dev, &r, &[b, t, hq, dd]));
    let (kg, vg) = (t32(dev, &kk, &[b, t, hkv, dd]), t32(dev, &v, &[b, t, hkv, dd]));
    let (km, vm) = (t32(dev, &rep(&kk), &[b, t, hq, dd]), t32(dev, &rep(&v), &[b, t, hq, dd]));
    let (og, lg) = k::attention_fwd(&qt, &kg, &vg, &cfg).unwrap();
    let (om, lm) = k::attention_fwd(&qt, &km, &vm, &cfg).unwrap();
    assert_close(&host(&og), &host(&om), 1e-6, 1e-6, "o");
    let (dqg, dkg, dvg) = k::attention_bwd(&qt, &kg, &vg, &og, &lg, &rt, &cfg).unwrap();
    let (dqm, dkm, dvm) = k::attention_bwd(&qt, &km, &vm, &om, &lm, &rt, &cfg).unwrap();
    assert_close(&host(&dqg), &host(&dqm), 1e-5, 1e-6, "dq");
    // The GQA kv gradient is the sum over each group of the MHA per-head gradients.
    let sum_groups = |x: &[f64]| -> Vec<f64> {
        let mut out = Vec::new();
        for row in x.chunks(hq * dd) {
            for g in 0..hkv {
                for e in 0..dd {
                    out.push((0..hq / hkv).map(|i| row[(g * (hq / hkv) + i) * dd + e]).sum());
                }
            }
        }
        out
    };
    assert_close(&host(&dkg), &sum_groups(&host(&dkm)), 1e-5, 1e-6, "dk");
    assert_close(&host(&dvg), &sum_groups(&host(&dvm)), 1e-5, 1e-6, "dv");
});

device_test!(sliding_window_hides_old_keys, |dev: &Device| {
    // With window 1 every query sees only itself: the output is v at the same position.
    let (b, t, h, dd) = (1, 5, 2, 3);
    let (q, kk, v) = (randv(b * t * h * dd, 1), randv(b * t * h * dd, 2), randv(b * t * h * dd, 3));
    let cfg = AttnCfg { causal: true, window: Some(1), scale: None };
    let sh = [b, t, h, dd];
    let (o, _) = k::attention_fwd(&t32(dev, &q, &sh), &t32(dev, &kk, &sh), &t32(dev, &v, &sh), &cfg).unwrap();
    assert_close(&host(&o), &v, 1e-6, 1e-6, "window 1");
});

#[test]
fn bad_head_counts_are_errors() {
    let dev = Device::Cpu;
    let q = t32(&dev, &randv(2 * 3 * 4, 0), &[1, 2, 3, 4]);
    let kv = t32(&dev, &randv(2 * 2 * 4, 0), &[1, 2, 2, 4]);
    let e = k::attention_fwd(&q, &kv, &kv, &AttnCfg::default()).unwrap_err();
    assert!(e.to_string().contains("multiple of kv heads"), "{e}");
}

#[test]
fn fused_qkv_attention_equals_split_then_merge() {
    // Q, K and V read in place from the fused projection output [B, T, Hkv·(G+2)·D] (and the
    // gradients written into its slots) give the same bits as splitting, attending and merging:
    // GQA with 2 groups of 3 heads, one group of 1, causal, windowed and full, f32 and bf16.
    let dev = Device::Cpu;
    for (hkv, g, dt) in [(2usize, 3usize, DType::F32), (1, 1, DType::F32), (2, 3, DType::BF16)] {
        let (b, t, d) = (2, 7, 4);
        let qkv = tensor(&dev, &randv(b * t * hkv * (g + 2) * d, 1), &[b, t, hkv * (g + 2) * d], dt);
        let dout = tensor(&dev, &randv(b * t * hkv * g * d, 2), &[b, t, hkv * g, d], dt);
        for cfg in [
            AttnCfg::default(),
            AttnCfg { causal: true, window: Some(3), scale: None },
            AttnCfg { causal: false, window: None, scale: Some(0.3) },
        ] {
            let (o, lse) = k::attention_fwd_qkv(&qkv, k::QkvHeads::new(hkv, g, d), &cfg).unwrap();
            let dqkv = k::attention_bwd_qkv(&qkv, &o, &lse, &dout, k::QkvHeads::new(hkv, g, d), &cfg).unwrap();
            let (q, kk, v) = k::qkv_split(&qkv, hkv, g, d).unwrap();
            let (o2, lse2) = k::attention_fwd(&q, &kk, &v, &cfg).unwrap();
            let (dq, dk, dv) = k::attention_bwd(&q, &kk, &v, &o2, &lse2, &dout, &cfg).unwrap();
            let dqkv2 = k::qkv_merge(&dq, &dk, &dv).unwrap();
            let what = format!("hkv {hkv} g {g} {dt} {cfg:?}");
            assert_eq!(o.dims(), o2.dims(), "{what}");
            for (x, y, name) in [(&o, &o2, "o"), (&lse, &lse2, "lse"), (&dqkv, &dqkv2, "dqkv")] {
                assert_eq!(x.dtype(), y.dtype(), "{what} {name}");
                let bits = |t: &Tensor| t.to_vec_f32().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(x), bits(y), "{what} {name}");
            }
        }
    }
    let bad = t32(&dev, &randv(2 * 7 * 19, 3), &[2, 7, 19]);
    let e = k::attention_fwd_qkv(&bad, k::QkvHeads::new(2, 3, 4), &AttnCfg::default()).unwrap_err();
    assert!(e.to_string().contains("attention_qkv"), "{e}");
}

#[test]
fn fused_qkv_backward_into_adds_the_bias_gradient() {
    // attention_bwd_qkv_into = attention_bwd_qkv, plus Σ rows of dQKV stored into (acc false) or
    // added onto (acc true) the bias gradient, as bias_grad_into gives it; a destination of the
    // wrong width, or one sharing an input's storage, is an error that leaves it untouched.
    let dev = Device::Cpu;
    let (b, t, d, hkv, g) = (2, 9, 4, 2, 2);
    let w = hkv * (g + 2) * d;
    let qkv = t32(&dev, &randv(b * t * w, 5), &[b, t, w]);
    let dout = t32(&dev, &randv(b * t * hkv * g * d, 6), &[b, t, hkv * g, d]);
    let cfg = AttnCfg::default();
    let (o, lse) = k::attention_fwd_qkv(&qkv, k::QkvHeads::new(hkv, g, d), &cfg).unwrap();
    let dqkv = k::attention_bwd_qkv(&qkv, &o, &lse, &dout, k::QkvHeads::new(hkv, g, d), &cfg).unwrap();
    let start = randv(w, 7);
    for acc in [false, true] {
        let (db, want) = (t32(&dev, &start, &[w]), t32(&dev, &start, &[w]));
        k::bias_grad_into(&want, &dqkv, acc).unwrap();
        let got =
            k::attention_bwd_qkv_into(&qkv, &o, &lse, &dout, k::QkvHeads::new(hkv, g, d), &cfg, &db, acc).unwrap();
        assert_eq!(host(&got), host(&dqkv), "dqkv, acc {acc}");
        assert_eq!(host(&db), host(&want), "bias gradient, acc {acc}");
    }
    let narrow = t32(&dev, &start[..w - 1], &[w - 1]);
    let e =
        k::attention_bwd_qkv_into(&qkv, &o, &lse, &dout, k::QkvHeads::new(hkv, g, d), &cfg, &narrow, true).unwrap_err();
    assert!(e.to_string().contains("attention_bwd_qkv_into"), "{e}");
    assert_eq!(host(&narrow), start[..w - 1].to_vec());
    let inside = qkv.view(w, [w]).unwrap();
    let e =
        k::attention_bwd_qkv_into(&qkv, &o, &lse, &dout, k::QkvHeads::new(hkv, g, d), &cfg, &inside, true).unwrap_err();
    assert!(e.to_string().contains("shares storage"), "{e}");
}
