use crate::device_test;
use crate::util::*;
use ferrotron_core::Device;
use ferrotron_kernels::{self as k, AdamW};

/// PyTorch's AdamW update written out in f64.
fn reference(p: &mut [f64], g: &[f64], m: &mut [f64], v: &mut [f64], h: &AdamW) {
    let (b1, b2) = (h.beta1 as f64, h.beta2 as f64);
    for i in 0..p.len() {
        let gi = g[i] * h.grad_scale as f64;
        p[i] *= 1.0 - h.lr as f64 * h.weight_decay as f64;
        m[i] = b1 * m[i] + (1.0 - b1) * gi;
        v[i] = b2 * v[i] + (1.0 - b2) * gi * gi;
        let mh = m[i] / (1.0 - b1.powi(h.step as i32));
        let vh = v[i] / (1.0 - b2.powi(h.step as i32));
        p[i] -= h.lr as f64 * mh / (vh.sqrt() + h.eps as f64);
    }
}

device_test!(adamw_matches_reference_over_steps, |dev: &Device| {
    let n = 40_000; // spans several parallel chunks
    let mut p = randv(n, 1);
    let (mut m, mut v) = (vec![0.0; n], vec![0.0; n]);
    let (pt, mt, vt) = (t32(dev, &p, &[n]), t32(dev, &m, &[n]), t32(dev, &v, &[n]));
    for step in 1..=4u64 {
        let g = randv(n, 10 + step);
        let h = AdamW { lr: 1e-2, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, step, grad_scale: 0.5 };
        k::adamw_step(&pt, &t32(dev, &g, &[n]), &mt, &vt, &h).unwrap();
        reference(&mut p, &g, &mut m, &mut v, &h);
    }
    assert_close(&host(&pt), &p, 1e-5, 1e-6, "params");
    assert_close(&host(&mt), &m, 1e-5, 1e-6, "m");
    assert_close(&host(&vt), &v, 1e-4, 1e-7, "v");
});

device_test!(adamw_rejects_aliasing_and_step_zero, |dev: &Device| {
    let p = t32(dev, &randv(4, 1), &[4]);
    let g = t32(dev, &randv(4, 2), &[4]);
    let h = AdamW { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0, step: 1, grad_scale: 1.0 };
    assert!(k::adamw_step(&p, &g, &p, &g, &h).is_err());
    let (m, v) = (t32(dev, &[0.0; 4], &[4]), t32(dev, &[0.0; 4], &[4]));
    assert!(k::adamw_step(&p, &g, &m, &v, &AdamW { step: 0, ..h }).is_err());
});

device_test!(global_norm_matches_naive, |dev: &Device| {
    let (a, b) = (randv(50_000, 3), randv(17, 4));
    let want = a.iter().chain(&b).map(|x| x * x).sum::<f64>().sqrt();
    let got = k::global_l2_norm(&[&t32(dev, &a, &[50_000]), &t32(dev, &b, &[17])]).unwrap();
    assert!((got - want).abs() < 1e-6 * want, "{got} vs {want}");
});

device_test!(adamw_runs_updates_each_run_and_writes_params, |dev: &Device| {
    use ferrotron_core::DType;
    use k::{AdamRun, AdamRuns};
    // Three runs of a 10k flat buffer held in a 9k state: decay, no decay, decay; flat 3998..5001
    // belongs to no run (another rank's shard) and must come through untouched. The second run
    // ends two elements into a group of four, the third starts off a 16-byte boundary (the GPU's
    // one-element path) and is flagged for the decoupled rate (without a state: h's, decayed).
    let runs = vec![
        AdamRun { flat: 0, state: 0, len: 3000, decay: true, decoupled: false },
        AdamRun { flat: 3000, state: 3000, len: 998, decay: false, decoupled: false },
        AdamRun { flat: 5001, state: 4000, len: 4999, decay: true, decoupled: true },
    ];
    let (flat, state) = (10_000, 9_000);
    let mut p = randv(state, 1);
    let (mut m, mut v) = (vec![0.0; state], vec![0.0; state]);
    let (pt, mt, vt) = (t32(dev, &p, &[state]), t32(dev, &m, &[state]), t32(dev, &v, &[state]));
    let before = randv(flat, 2);
    let params = tensor(dev, &before, &[flat], DType::BF16);
    let table = AdamRuns::new(runs.clone(), dev).unwrap();
    for step in 1..=3u64 {
        let g = randv(flat, 10 + step);
        let h = AdamW { lr: 1e-2, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, step, grad_scale: 0.5 };
        k::adamw_runs(&pt, &mt, &vt, &t32(dev, &g, &[flat]), &params, &table, &h, None).unwrap();
        for r in &runs {
            let (s, f) = (r.state..r.state + r.len, r.flat..r.flat + r.len);
            let hr = AdamW { weight_decay: if r.decay { h.weight_decay } else { 0.0 }, ..h };
            reference(&mut p[s.clone()], &g[f], &mut m[s.clone()], &mut v[s], &hr);
        }
    }
    assert_close(&host(&pt), &p, 1e-5, 1e-6, "master");
    assert_close(&host(&mt), &m, 1e-5, 1e-6, "m");
    assert_close(&host(&vt), &v, 1e-4, 1e-7, "v");
    // Each run's parameters are its master weights rounded to bf16, bit for bit as a cast gives.
    let got = host(&params);
    for r in &runs {
        let want = host(&k::cast(&pt.view(r.state, [r.len]).unwrap(), DType::BF16).unwrap());
        assert_eq!(&got[r.flat..r.flat + r.len], &want[..], "params of {r:?}");
    }
    let untouched = host(&tensor(dev, &before[3998..5001], &[1003], DType::BF16));
    assert_eq!(&got[3998..5001], &untouched[..], "the gap between runs");
    // A run past the end of the flat buffer is refused before anything is written.
    let bad =
        AdamRuns::new(vec![AdamRun { flat: 9_500, state: 0, len: 1000, decay: true, decoupled: false }], dev).unwrap();
    let h = AdamW { lr: 1e-2, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, step: 4, grad_scale: 1.0 };
    let e = k::adamw_runs(&pt, &mt, &vt, &t32(dev, &before, &[flat]), &params, &bad, &h, None).unwrap_err().to_string();
    assert!(e.contains("reaches past"), "{e}");
    assert_eq!(host(&params), got, "a refused step wrote the parameters");
});

device_test!(adamw_runs_from_bf16_grads_as_from_the_same_f32_values, |dev: &Device| {
    use ferrotron_core::DType;
    use k::{AdamRun, AdamRuns};
    // A bf16 main_grad (`--grad-reduce-in-bf16`): the update widens each gradient exactly, so it
    // must equal, bit for bit, the update from an f32 buffer holding the same values. The second
    // run starts off an 8-byte boundary of the bf16 buffer (the GPU's one-element path).
    let runs = vec![
        AdamRun { flat: 0, state: 0, len: 4096, decay: true, decoupled: false },
        AdamRun { flat: 4097, state: 4096, len: 2001, decay: false, decoupled: false },
    ];
    let (flat, state) = (6100, 6097);
    let g16 = tensor(dev, &randv(flat, 3), &[flat], DType::BF16);
    let g32 = k::cast(&g16, DType::F32).unwrap();
    let table = AdamRuns::new(runs, dev).unwrap();
    let run = |g: &ferrotron_core::Tensor| {
        let p = t32(dev, &randv(state, 4), &[state]);
        let (m, v) = (t32(dev, &vec![0.0; state], &[state]), t32(dev, &vec![0.0; state], &[state]));
        let params = tensor(dev, &vec![0.0; flat], &[flat], DType::BF16);
        for step in 1..=2u64 {
            let h = AdamW { lr: 1e-2, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, step, grad_scale: 0.5 };
            k::adamw_runs(&p, &m, &v, g, &params, &table, &h, None).unwrap();
        }
        [p, m, v, params].map(|t| t.to_vec_f32().unwrap().iter().map(|x| x.to_bits()).collect::<Vec<_>>())
    };
    let (a, b) = (run(&g16), run(&g32));
    for (i, what) in ["master", "exp_avg", "exp_avg_sq", "params"].iter().enumerate() {
        assert_eq!(a[i], b[i], "{what}: bf16 grads against the same values in f32");
    }
    assert_ne!(a[0], run(&k::scale(&g32, 2.0).unwrap())[0], "the gradients reach the update");
});

device_test!(adamw_runs_with_bf16_moments_rounds_the_f32_update, |dev: &Device| {
    use ferrotron_core::{DType, Tensor};
    use k::{AdamRun, AdamRuns};
    // Megatron's precision-aware optimizer (--exp-avg-dtype / --exp-avg-sq-dtype bf16): each step
    // must be the f32 update from the same (widened) moments, the master weights and parameters
    // bit for bit, each bf16 moment that update's moment rounded to nearest even. Every pairing,
    // three steps each (the oracle restarts from the narrow state every step); the second run
    // starts off an 8-byte boundary of the bf16 moments (the GPU's one-element path).
    let runs = vec![
        AdamRun { flat: 0, state: 0, len: 4096, decay: true, decoupled: false },
        AdamRun { flat: 4096, state: 4097, len: 2001, decay: false, decoupled: false },
    ];
    let (flat, state) = (6097, 6098);
    let table = AdamRuns::new(runs, dev).unwrap();
    let bits = |t: &Tensor| t.to_vec_f32().unwrap().iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let widened = |t: &Tensor| k::cast(t, DType::F32).unwrap();
    for (m_dt, v_dt) in [(DType::BF16, DType::BF16), (DType::BF16, DType::F32), (DType::F32, DType::BF16)] {
        let p = t32(dev, &randv(state, 1), &[state]);
        let m = tensor(dev, &randv(state, 2).iter().map(|x| x * 1e-2).collect::<Vec<_>>(), &[state], m_dt);
        let v = tensor(dev, &randv(state, 3).iter().map(|x| x * x * 1e-4).collect::<Vec<_>>(), &[state], v_dt);
        let params = tensor(dev, &vec![0.0; flat], &[flat], DType::BF16);
        for step in 1..=3u64 {
            let g = t32(dev, &randv(flat, 10 + step), &[flat]);
            let h = AdamW { lr: 1e-2, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, step, grad_scale: 0.5 };
            let (rp, rm, rv) = (widened(&p), widened(&m), widened(&v));
            let rparams = tensor(dev, &vec![0.0; flat], &[flat], DType::BF16);
            k::adamw_runs(&rp, &rm, &rv, &g, &rparams, &table, &h, None).unwrap();
            k::adamw_runs(&p, &m, &v, &g, &params, &table, &h, None).unwrap();
            let what = format!("exp_avg {m_dt}, exp_avg_sq {v_dt}, step {step}");
            assert_eq!(bits(&p), bits(&rp), "master weights, {what}");
            assert_eq!(bits(&params), bits(&rparams), "parameters, {what}");
            assert_eq!(bits(&m), bits(&k::cast(&rm, m_dt).unwrap()), "exp_avg, {what}");
            assert_eq!(bits(&v), bits(&k::cast(&rv, v_dt).unwrap()), "exp_avg_sq, {what}");
            // The narrow moment really is narrower than the update's.
            let (narrow, wide) = if m_dt == DType::BF16 { (&m, &rm) } else { (&v, &rv) };
            assert_ne!(bits(&widened(narrow)), bits(wide), "a bf16 moment kept f32 bits, {what}");
        }
    }
    // An f16 moment is refused by name.
    let z = |dt| tensor(dev, &vec![0.0; state], &[state], dt);
    let h = AdamW { lr: 1e-2, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, step: 1, grad_scale: 1.0 };
    let e = k::adamw_runs(
        &z(DType::F32),
        &z(DType::F16),
        &z(DType::F32),
        &z(DType::F32),
        &z(DType::BF16),
        &table,
        &h,
        None,
    );
    assert!(e.is_err());
});

device_test!(adamw_runs_from_the_device_state, |dev: &Device| {
    use ferrotron_core::DType;
    use k::{AdamPrep, AdamRun, AdamRuns, adam_state as st};
    // The step settled on the device (Σ g², clip factor, skip flag, bias corrections, decays, each
    // step's own learning rates written into the state) against the reference fed the same values
    // from the host: two clipped steps, a skipped one (a NaN gradient: nothing moves, the count
    // stays), then an unclipped one. The last 1000 elements are two runs at the decoupled rate
    // (--decoupled-lr), one decayed, one not.
    let n = 5_000;
    let runs = vec![
        AdamRun { flat: 0, state: 0, len: 4000, decay: true, decoupled: false },
        AdamRun { flat: 4000, state: 4000, len: 600, decay: true, decoupled: true },
        AdamRun { flat: 4600, state: 4600, len: 400, decay: false, decoupled: true },
    ];
    let table = AdamRuns::new(runs, dev).unwrap();
    let mut p = randv(n, 1);
    let (mut m, mut v) = (vec![0.0; n], vec![0.0; n]);
    let (pt, mt, vt) = (t32(dev, &p, &[n]), t32(dev, &m, &[n]), t32(dev, &v, &[n]));
    let params = tensor(dev, &p, &[n], DType::F32);
    let state = ferrotron_core::Tensor::zeros([st::LEN], DType::F32, dev).unwrap();
    let base = AdamW { lr: 1e-2, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, step: 0, grad_scale: 1.0 };
    let mut steps = 0u64;
    for (i, clip) in [1.0f32, 1.0, 1.0, 1e6].into_iter().enumerate() {
        let mut g = randv(n, 20 + i as u64);
        if i == 2 {
            g[7] = f64::NAN;
        }
        let gt = t32(dev, &g, &[n]);
        let sq = k::sum_sq_dev(&[&gt], dev).unwrap();
        // The learning rates and weight decay of each step, as schedules move them.
        let (lr, wd) = (base.lr * (1.0 + 0.5 * i as f32), base.weight_decay * (1.0 + i as f32));
        let lr2 = 3e-3 * (4.0 - i as f32);
        state.view(st::LR, [3]).unwrap().copy_from_f32(&[lr, wd, lr2]).unwrap();
        let prep = AdamPrep { beta1: base.beta1, beta2: base.beta2, clip_grad: clip };
        k::adam_prepare(&sq, &state, &prep).unwrap();
        k::adamw_runs(&pt, &mt, &vt, &gt, &params, &table, &base, Some(&state)).unwrap();
        let s = host(&state);
        let norm = g.iter().map(|x| x * x).sum::<f64>().sqrt();
        if i == 2 {
            assert!(s[st::APPLIED] == 0.0 && !s[st::GRAD_NORM].is_finite(), "{s:?}");
        } else {
            steps += 1;
            let scale = if norm > clip as f64 { clip as f64 / (norm + 1e-6) } else { 1.0 };
            assert!(s[st::APPLIED] == 1.0 && (s[st::GRAD_NORM] - norm).abs() < 1e-5 * norm, "{s:?}");
            assert!((s[st::GRAD_SCALE] - scale).abs() < 1e-5 * scale, "{s:?} vs {scale}");
            let h = AdamW { step: steps, grad_scale: scale as f32, lr, weight_decay: wd, ..base };
            for (r, (lr, wd)) in [(0..4000, (lr, wd)), (4000..4600, (lr2, wd)), (4600..n, (lr2, 0.0))] {
                let hr = AdamW { lr, weight_decay: wd, ..h };
                reference(&mut p[r.clone()], &g[r.clone()], &mut m[r.clone()], &mut v[r], &hr);
            }
        }
        assert_eq!(s[st::STEPS], steps as f64, "step count after step {i}");
        assert_eq!(s[st::DECAY], (1.0 - lr * wd) as f64, "decay factor after step {i}");
        assert_eq!(s[st::DECAY_DECOUPLED], (1.0 - lr2 * wd) as f64, "decoupled decay factor after step {i}");
    }
    assert_close(&host(&pt), &p, 1e-5, 1e-6, "master");
    assert_close(&host(&mt), &m, 1e-5, 1e-6, "m");
    assert_close(&host(&vt), &v, 1e-4, 1e-7, "v");
    assert_eq!(host(&params), host(&pt), "the parameters are the master weights (f32)");
});

device_test!(count_zeros_matches_naive, |dev: &Device| {
    use ferrotron_core::DType;
    // Zeros of both signs, a NaN (not zero) and tiny values (nonzero in both types: bf16 has
    // f32's exponent range); in f32 and bf16, one length a multiple of eight (the GPU's 8-wide path) and an odd one,
    // and a view at an odd offset (its one-element path).
    let mut v = randv(40_000, 7);
    for (i, x) in v.iter_mut().enumerate() {
        match i % 7 {
            0 => *x = 0.0,
            3 if i % 2 == 0 => *x = -0.0,
            5 if i % 3 == 0 => *x = 1e-30,
            _ => {}
        }
    }
    v[11] = f64::NAN;
    for dtype in [DType::F32, DType::BF16] {
        let a = tensor(dev, &v, &[40_000], dtype);
        let b = tensor(dev, &v[..1001], &[1001], dtype);
        let c = a.view(3, [5000]).unwrap();
        let vals = |t: &ferrotron_core::Tensor| host(t).into_iter().filter(|x| *x == 0.0).count();
        let want = vals(&a) + vals(&b) + vals(&c);
        assert!(want > 9000 && want < 10_000, "{dtype:?}: {want} zeros");
        let got = k::count_zeros_dev(&[&a, &b, &c], dev).unwrap().to_vec_f32().unwrap();
        assert_eq!(got, vec![want as f32], "{dtype:?}");
        let none = k::count_zeros_dev(&[], dev).unwrap().to_vec_f32().unwrap();
        assert_eq!(none, vec![0.0]);
    }
});

/// PyTorch's SGD (momentum, dampening 0, L2 weight decay) written out in f64; the buffer starts as
/// the first step's gradient (PyTorch clones it; from zero the rule gives the same).
fn sgd_reference(p: &mut [f64], g: &[f64], buf: &mut [f64], first: bool, h: &k::Sgd) {
    for i in 0..p.len() {
        let d = g[i] * h.grad_scale as f64 + h.weight_decay as f64 * p[i];
        buf[i] = if first { d } else { h.momentum as f64 * buf[i] + d };
        p[i] -= h.lr as f64 * buf[i];
    }
}

device_test!(sgd_runs_follow_pytorchs_sgd, |dev: &Device| {
    use ferrotron_core::DType;
    use k::{AdamPrep, AdamRun, AdamRuns, Sgd, adam_state as st};
    // Three runs (decay; none, the decoupled rate; decay, off a 16-byte boundary) with a gap another
    // rank owns, bf16 parameters; three steps from the host's rates, then two settled on the
    // device (clip factor, skip flag, each step's rates in the state): a clipped one and a skipped
    // one (a NaN gradient: nothing moves).
    let runs = vec![
        AdamRun { flat: 0, state: 0, len: 3000, decay: true, decoupled: false },
        AdamRun { flat: 3000, state: 3000, len: 998, decay: false, decoupled: true },
        AdamRun { flat: 5001, state: 3998, len: 2001, decay: true, decoupled: false },
    ];
    let (flat, state) = (7002, 5999);
    let table = AdamRuns::new(runs.clone(), dev).unwrap();
    let mut p = randv(state, 1);
    let mut b = vec![0.0; state];
    let (pt, bt) = (t32(dev, &p, &[state]), t32(dev, &b, &[state]));
    let before = randv(flat, 2);
    let params = tensor(dev, &before, &[flat], DType::BF16);
    let h = Sgd { lr: 0.05, momentum: 0.9, weight_decay: 0.1, grad_scale: 0.5 };
    let reference_step = |p: &mut Vec<f64>, b: &mut Vec<f64>, g: &[f64], first: bool, h: &Sgd, lr2: f32| {
        for r in &runs {
            let (s, f) = (r.state..r.state + r.len, r.flat..r.flat + r.len);
            let hr = Sgd {
                weight_decay: if r.decay { h.weight_decay } else { 0.0 },
                lr: if r.decoupled { lr2 } else { h.lr },
                ..*h
            };
            sgd_reference(&mut p[s.clone()], &g[f], &mut b[s], first, &hr);
        }
    };
    for step in 0..3u64 {
        let g = randv(flat, 10 + step);
        k::sgd_runs(&pt, &bt, &t32(dev, &g, &[flat]), &params, &table, &h, None).unwrap();
        reference_step(&mut p, &mut b, &g, step == 0, &h, h.lr);
    }
    let st_t = ferrotron_core::Tensor::zeros([st::LEN], DType::F32, dev).unwrap();
    for (i, (lr, wd, lr2)) in [(0.02f32, 0.2f32, 0.01f32), (0.03, 0.1, 0.02)].into_iter().enumerate() {
        let mut g = randv(flat, 30 + i as u64);
        if i == 1 {
            g[11] = f64::NAN;
        }
        let gt = t32(dev, &g, &[flat]);
        st_t.view(st::LR, [3]).unwrap().copy_from_f32(&[lr, wd, lr2]).unwrap();
        k::adam_prepare(
            &k::sum_sq_dev(&[&gt], dev).unwrap(),
            &st_t,
            &AdamPrep { beta1: 0.9, beta2: 0.95, clip_grad: 1.0 },
        )
        .unwrap();
        k::sgd_runs(&pt, &bt, &gt, &params, &table, &h, Some(&st_t)).unwrap();
        let s = host(&st_t);
        if i == 0 {
            let norm = g.iter().map(|x| x * x).sum::<f64>().sqrt();
            let scale = if norm > 1.0 { 1.0 / (norm + 1e-6) } else { 1.0 };
            let hs = Sgd { lr, weight_decay: wd, grad_scale: scale as f32, ..h };
            reference_step(&mut p, &mut b, &g, false, &hs, lr2);
        } else {
            assert_eq!(s[st::APPLIED], 0.0, "a NaN gradient skips the step");
        }
    }
    assert_close(&host(&pt), &p, 1e-5, 1e-6, "master");
    assert_close(&host(&bt), &b, 1e-5, 1e-6, "momentum");
    let got = host(&params);
    for r in &runs {
        let want = host(&k::cast(&pt.view(r.state, [r.len]).unwrap(), DType::BF16).unwrap());
        assert_eq!(&got[r.flat..r.flat + r.len], &want[..], "params of {r:?}");
    }
    let untouched = host(&tensor(dev, &before[3998..5001], &[1003], DType::BF16));
    assert_eq!(&got[3998..5001], &untouched[..], "the gap between runs");
    // From a bf16 main_grad: bit for bit the update from the same values in f32.
    let g16 = tensor(dev, &randv(flat, 5), &[flat], DType::BF16);
    let g32 = k::cast(&g16, DType::F32).unwrap();
    let run = |g: &ferrotron_core::Tensor| {
        let (p, bb) = (t32(dev, &randv(state, 4), &[state]), t32(dev, &vec![0.0; state], &[state]));
        let params = tensor(dev, &vec![0.0; flat], &[flat], DType::BF16);
        for _ in 0..2 {
            k::sgd_runs(&p, &bb, g, &params, &table, &h, None).unwrap();
        }
        [p, bb, params].map(|t| t.to_vec_f32().unwrap().iter().map(|x| x.to_bits()).collect::<Vec<_>>())
    };
    assert_eq!(run(&g16), run(&g32), "bf16 grads against the same values in f32");
});
