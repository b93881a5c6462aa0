//! The optimizer against a per-parameter AdamW written out by hand, with clipping and decay groups.

use ferrotron_core::{DType, Device, Init, ParamMeta, ParamTableBuilder};
use ferrotron_optim::{AdamConfig, Optimizer};

#[test]
fn decay_groups_clipping_and_master_copy() {
    let mut b = ParamTableBuilder::default();
    let w = b.add(ParamMeta::replicated("l.weight", [3], Init::Ones, true)).unwrap();
    let bias = b.add(ParamMeta::replicated("l.bias", [2], Init::Ones, false)).unwrap();
    let table = b.build(&Device::Cpu, DType::BF16, 0).unwrap();
    let cfg =
        AdamConfig { beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.5, clip_grad: 1.0, ..Default::default() };
    let mut opt = Optimizer::new(&table, cfg).unwrap();
    // Grad norm 5 → clipped by 1/5.
    table.flat_grads().update_f32("t", |g| g.copy_from_slice(&[3.0, 0.0, 0.0, 4.0, 0.0])).unwrap();
    opt.step(&table, 0.1).unwrap();
    let stats = opt.last_stats().unwrap();
    assert!((stats.grad_norm - 5.0).abs() < 1e-9 && stats.applied);
    // --log-num-zeros-in-grad: three of the five gradients are zero (clipping leaves them so).
    assert_eq!(opt.num_zeros_in_grad(&table).unwrap(), 3.0);
    // First Adam step moves each element by lr·sign(g) (bias-corrected m/√v = ±1) after decay.
    let (state, step) = opt.full_state(table.flat_len()).unwrap();
    let m = &state[0];
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
    opt.step(&table, 0.1).unwrap();
    assert!(!opt.last_stats().unwrap().applied);
    assert_eq!(opt.steps().unwrap(), 0);
    assert_eq!(table.flat_params().to_vec_f32().unwrap(), vec![1.0, 1.0]);
}

/// Decoupled AdamW on one element, as written in the kernels' reference (f32 throughout).
fn adamw_ref(p: &mut f32, g: f32, m: &mut f32, v: &mut f32, c: &AdamConfig, lr: f32, wd: f32, step: i32) {
    let bc1 = 1.0 - (c.beta1 as f64).powi(step);
    let bc2 = 1.0 - (c.beta2 as f64).powi(step);
    let (step_size, bc2_sqrt) = ((lr as f64 / bc1) as f32, bc2.sqrt() as f32);
    *m = c.beta1 * *m + (1.0 - c.beta1) * g;
    *v = c.beta2 * *v + (1.0 - c.beta2) * g * g;
    *p = *p * (1.0 - lr * wd) - step_size * *m / (v.sqrt() / bc2_sqrt + c.eps);
}

#[test]
fn merged_decay_runs_equal_per_element_adamw_bit_for_bit() {
    // Decay, decay, no decay, decay, decay: the optimizer updates runs of neighbours that share
    // the decay choice in one call; every element must come out as the per-element formula, at
    // each step's own weight decay (`set_weight_decay`, as --weight-decay-incr-style moves it).
    let spec = [
        ("a.weight", 5, true),
        ("b.weight", 7, true),
        ("c.bias", 3, false),
        ("d.weight", 4, true),
        ("e.weight", 6, true),
    ];
    let mut b = ParamTableBuilder::default();
    for (name, n, decay) in spec {
        b.add(ParamMeta::replicated(name, [n], Init::Normal { std: 0.5 }, decay)).unwrap();
    }
    let table = b.build(&Device::Cpu, DType::F32, 3).unwrap();
    let cfg =
        AdamConfig { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, clip_grad: 0.0, ..Default::default() };
    let mut opt = Optimizer::new(&table, cfg).unwrap();
    let mut p = table.flat_params().to_vec_f32().unwrap();
    let decays: Vec<bool> = spec.iter().flat_map(|&(_, n, d)| std::iter::repeat_n(d, n)).collect();
    let (mut m, mut v) = (vec![0f32; p.len()], vec![0f32; p.len()]);
    for step in 1..=3 {
        let g: Vec<f32> = (0..p.len()).map(|i| ((i * 37 + step * 11) % 19) as f32 / 7.0 - 1.3).collect();
        table.flat_grads().update_f32("t", |x| x[..g.len()].copy_from_slice(&g)).unwrap();
        let step_wd = 0.05 * step as f32;
        opt.set_weight_decay(step_wd);
        opt.step(&table, 0.01).unwrap();
        for i in 0..p.len() {
            let wd = if decays[i] { step_wd } else { 0.0 };
            adamw_ref(&mut p[i], g[i], &mut m[i], &mut v[i], &cfg, 0.01, wd, step as i32);
        }
    }
    let (state, _) = opt.full_state(table.flat_len()).unwrap();
    let [master, exp_avg, exp_avg_sq] = &state[..] else { panic!("AdamW keeps three buffers") };
    let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&master[..p.len()]), bits(&p));
    assert_eq!(bits(&exp_avg[..p.len()]), bits(&m));
    assert_eq!(bits(&exp_avg_sq[..p.len()]), bits(&v));
}

/// --optimizer sgd: the optimizer's SGD step against PyTorch's rule written out (momentum 0.8,
/// L2 weight decay where the parameter takes it, gradients clipped first), over three steps, one
/// of them skipped for a NaN gradient; two state buffers (8 bytes an element), the momentum's
/// checkpoint name.
#[test]
fn sgd_steps_follow_pytorchs_sgd() {
    use ferrotron_optim::Algorithm;
    let mut b = ParamTableBuilder::default();
    b.add(ParamMeta::replicated("l.weight", [3], Init::Ones, true)).unwrap();
    b.add(ParamMeta::replicated("l.bias", [2], Init::Ones, false)).unwrap();
    let table = b.build(&Device::Cpu, DType::F32, 0).unwrap();
    let algorithm = Algorithm::Sgd { momentum: 0.8 };
    let cfg = AdamConfig { weight_decay: 0.5, clip_grad: 1.0, algorithm, ..Default::default() };
    let mut opt = Optimizer::new(&table, cfg).unwrap();
    assert_eq!(opt.state_bytes(), 2 * 4 * table.flat_len());
    assert_eq!(algorithm.state_names(), ["master", "momentum_buffer"]);
    let (mut p, mut buf) = (vec![1.0f64; 5], vec![0.0f64; 5]);
    let decays = [true, true, true, false, false];
    for (step, (g, lr)) in
        [([3.0, 0.0, 0.0, 4.0, 0.0], 0.1), ([f32::NAN, 1.0, 0.0, 0.0, 0.0], 0.1), ([0.1, -0.2, 0.3, 0.0, 0.2], 0.05)]
            .into_iter()
            .enumerate()
    {
        table.flat_grads().update_f32("t", |x| x.copy_from_slice(&g)).unwrap();
        opt.step(&table, lr).unwrap();
        let stats = opt.last_stats().unwrap();
        if step == 1 {
            assert!(!stats.applied, "a NaN gradient skips the step");
            continue;
        }
        let norm = g.iter().map(|&x| (x as f64).powi(2)).sum::<f64>().sqrt();
        let clip = if norm > 1.0 { 1.0 / (norm + 1e-6) } else { 1.0 };
        for i in 0..5 {
            let d = g[i] as f64 * clip + if decays[i] { 0.5 * p[i] } else { 0.0 };
            buf[i] = 0.8 * buf[i] + d;
            p[i] -= lr as f64 * buf[i];
        }
    }
    let got = table.flat_params().to_vec_f32().unwrap();
    for (i, (a, b)) in got.iter().zip(&p).enumerate() {
        assert!((*a as f64 - b).abs() < 1e-6, "parameter {i}: {a} vs {b}");
    }
    let (state, steps) = opt.full_state(table.flat_len()).unwrap();
    assert_eq!((state.len(), steps), (2, 2));
    for (i, (a, b)) in state[1].iter().zip(&buf).enumerate() {
        assert!((*a as f64 - b).abs() < 1e-6, "momentum {i}: {a} vs {b}");
    }
    // The state round-trips, and AdamW's three buffers are refused by name.
    let mut other = Optimizer::new(&table, cfg).unwrap();
    other.load_owned_state(&state, steps).unwrap();
    let e = other.load_owned_state(&[state[0].clone(), state[1].clone(), state[1].clone()], 2).unwrap_err();
    assert!(e.to_string().contains("3 state buffers given"), "{e}");
}

/// The precision-aware optimizer's bf16 moments (--exp-avg-dtype / --exp-avg-sq-dtype bf16):
/// 12 → 8 bytes of state an element; every step the per-element f32 formula from the stored
/// (bf16) moments, the moments then rounded to bf16; the state leaves and returns through f32
/// (a checkpoint), and SGD refuses them.
#[test]
fn bf16_moments_step_as_f32_from_the_rounded_state() {
    use ferrotron_core::Tensor;
    use ferrotron_optim::Algorithm;
    let mut b = ParamTableBuilder::default();
    b.add(ParamMeta::replicated("a.weight", [9], Init::Normal { std: 0.5 }, true)).unwrap();
    b.add(ParamMeta::replicated("a.bias", [4], Init::Normal { std: 0.5 }, false)).unwrap();
    let table = b.build(&Device::Cpu, DType::F32, 5).unwrap();
    let cfg = AdamConfig {
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        clip_grad: 0.0,
        exp_avg_dtype: DType::BF16,
        exp_avg_sq_dtype: DType::BF16,
        ..Default::default()
    };
    let mut opt = Optimizer::new(&table, cfg).unwrap();
    assert_eq!(opt.state_bytes(), (4 + 2 + 2) * table.flat_len());
    let mut p = table.flat_params().to_vec_f32().unwrap();
    let (mut m, mut v) = (vec![0f32; p.len()], vec![0f32; p.len()]);
    // To bf16 and back (round to nearest even).
    let round = |x: &mut Vec<f32>| {
        *x = Tensor::from_f32(x, [x.len()], DType::BF16, &Device::Cpu).unwrap().to_vec_f32().unwrap();
    };
    for step in 1..=4 {
        let g: Vec<f32> = (0..p.len()).map(|i| ((i * 29 + step * 7) % 17) as f32 / 5.0 - 1.6).collect();
        table.flat_grads().update_f32("t", |x| x.copy_from_slice(&g)).unwrap();
        opt.step(&table, 0.01).unwrap();
        for i in 0..p.len() {
            let wd = if i < 9 { 0.1 } else { 0.0 };
            adamw_ref(&mut p[i], g[i], &mut m[i], &mut v[i], &cfg, 0.01, wd, step as i32);
        }
        round(&mut m);
        round(&mut v);
    }
    let (state, steps) = opt.full_state(table.flat_len()).unwrap();
    let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&state[0]), bits(&p), "master weights");
    assert_eq!(bits(&state[1]), bits(&m), "exp_avg");
    assert_eq!(bits(&state[2]), bits(&v), "exp_avg_sq");
    // f32 moments from the same start take other steps (the rounding is real).
    let f32_cfg = AdamConfig { exp_avg_dtype: DType::F32, exp_avg_sq_dtype: DType::F32, ..cfg };
    let mut wide = Optimizer::new(&table, f32_cfg).unwrap();
    wide.load_owned_state(&state, steps).unwrap();
    let mut narrow = Optimizer::new(&table, cfg).unwrap();
    narrow.load_owned_state(&state, steps).unwrap();
    assert_eq!(narrow.full_state(table.flat_len()).unwrap().0, state, "a checkpoint's state round-trips");
    for o in [&mut wide, &mut narrow] {
        table
            .flat_grads()
            .update_f32("t", |x| x.iter_mut().enumerate().for_each(|(i, y)| *y = i as f32 * 0.1))
            .unwrap();
        o.step(&table, 0.01).unwrap();
    }
    let (a, b) = (wide.full_state(table.flat_len()).unwrap().0, narrow.full_state(table.flat_len()).unwrap().0);
    assert_eq!(bits(&a[0]), bits(&b[0]), "one step from the same state: the same master weights");
    assert_ne!(bits(&a[1]), bits(&b[1]), "the bf16 exp_avg is rounded");
    let sgd = AdamConfig { algorithm: Algorithm::Sgd { momentum: 0.9 }, ..cfg };
    let e = Optimizer::new(&table, sgd).err().expect("SGD with bf16 moments").to_string();
    assert!(e.contains("SGD") && e.contains("--optimizer adam"), "{e}");
}

/// --optimizer-cpu-offload: the update staged through the host's compact buffers (the owned
/// ranges back to back, the runs re-based onto them) gives the direct update's bits, step by
/// step, through a skipped step (a NaN gradient: the parameters left alone) and around a frozen
/// parameter (never written back), for AdamW with bf16 moments and for SGD.
#[test]
fn cpu_offload_updates_as_the_direct_update() {
    use ferrotron_optim::Algorithm;
    let build = || {
        let mut b = ParamTableBuilder::default();
        b.add(ParamMeta::replicated("a.weight", [7], Init::Normal { std: 0.5 }, true)).unwrap();
        b.add(ParamMeta::replicated("f.weight", [5], Init::Normal { std: 0.5 }, true)).unwrap();
        b.add(ParamMeta::replicated("a.bias", [3], Init::Normal { std: 0.5 }, false)).unwrap();
        let mut table = b.build(&Device::Cpu, DType::BF16, 9).unwrap();
        assert_eq!(table.freeze(|m| m.name == "f.weight"), 1);
        table
    };
    let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    let moments = AdamConfig { exp_avg_dtype: DType::BF16, exp_avg_sq_dtype: DType::BF16, ..Default::default() };
    for base in [moments, AdamConfig { algorithm: Algorithm::Sgd { momentum: 0.9 }, ..Default::default() }] {
        let (direct_t, host_t) = (build(), build());
        let mut direct = Optimizer::new(&direct_t, base).unwrap();
        let mut host = Optimizer::new(&host_t, AdamConfig { cpu_offload: true, ..base }).unwrap();
        assert!(host.offloaded() && !direct.offloaded());
        let frozen = host_t.flat_params().to_vec_f32().unwrap()[7..12].to_vec();
        for step in 0..4 {
            let g: Vec<f32> =
                (0..15).map(|i| if step == 1 && i == 3 { f32::NAN } else { (i + step) as f32 * 0.1 - 0.6 }).collect();
            for (t, o) in [(&direct_t, &mut direct), (&host_t, &mut host)] {
                t.flat_grads().update_f32("t", |x| x[..15].copy_from_slice(&g)).unwrap();
                o.step(t, 0.05).unwrap();
                assert_eq!(o.last_stats().unwrap().applied, step != 1);
            }
            let (a, b) = (direct_t.flat_params().to_vec_f32().unwrap(), host_t.flat_params().to_vec_f32().unwrap());
            assert_eq!(bits(&a), bits(&b), "{:?} step {step}: parameters", base.algorithm);
            assert_eq!(bits(&b[7..12]), bits(&frozen), "the frozen parameter moved");
            assert_ne!(bits(&b[..7]), bits(&build().flat_params().to_vec_f32().unwrap()[..7]), "nothing trained");
            let n = direct_t.flat_len();
            let (sa, sb) = (direct.full_state(n).unwrap(), host.full_state(n).unwrap());
            assert_eq!(sa.1, sb.1, "step counts");
            for (x, y) in sa.0.iter().zip(&sb.0) {
                assert_eq!(bits(x), bits(y), "{:?} step {step}: state", base.algorithm);
            }
        }
        assert_eq!(host.params_norm(&host_t).unwrap(), direct.params_norm(&direct_t).unwrap());
    }
}
