use crate::device_test;
use crate::util::*;
use ferrotron_core::Device;
use ferrotron_kernels::{self as k, RopeCfg, RopeScaling, cpu::rope};
use proptest::prelude::*;

/// Pair i's frequency written as transformers' `_compute_llama3_parameters` computes it (whole
/// vectors there): low frequencies divided by the factor, then the medium band replaced by the
/// blend.
fn hf_freq(cfg: &RopeCfg, i: usize) -> f64 {
    let f = 1.0 / cfg.base.powf(2.0 * i as f64 / cfg.rot as f64);
    if let Some(y) = cfg.yarn {
        return hf_yarn_freq(cfg.rot, cfg.base, &y, i);
    }
    let Some(s) = cfg.scaling else { return f };
    let (low_wavelen, high_wavelen) = (
        s.original_max_position_embeddings / s.low_freq_factor,
        s.original_max_position_embeddings / s.high_freq_factor,
    );
    let wavelen = 2.0 * std::f64::consts::PI / f;
    let llama = if wavelen > low_wavelen { f / s.factor } else { f };
    let smooth =
        (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
    let smoothed = (1.0 - smooth) * llama / s.factor + smooth * llama;
    let medium = wavelen >= high_wavelen && wavelen <= low_wavelen; // ~(w < high) & ~(w > low)
    if medium { smoothed } else { llama }
}

/// Pair i's frequency as transformers' `_compute_yarn_parameters` computes it (whole vectors
/// there): the correction range from the betas (floored, ceiled, clamped to [0, dim − 1]), the
/// linear ramp mask over dim / 2 pairs, and the blend of the interpolated (÷ factor) and
/// extrapolated frequencies by 1 − mask.
fn hf_yarn_freq(dim: usize, base: f64, y: &k::Yarn, i: usize) -> f64 {
    let correction = |turns: f64| {
        (dim as f64 * (y.original_max_position_embeddings / (turns * 2.0 * std::f64::consts::PI)).ln())
            / (2.0 * base.ln())
    };
    let low = correction(y.beta_fast).floor().max(0.0);
    let mut high = correction(y.beta_slow).ceil().min(dim as f64 - 1.0);
    if low == high {
        high += 0.001;
    }
    let pos_freq = base.powf(2.0 * i as f64 / dim as f64);
    let (extrapolation, interpolation) = (1.0 / pos_freq, 1.0 / (y.factor * pos_freq));
    let extrapolation_factor = 1.0 - ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
    interpolation * (1.0 - extrapolation_factor) + extrapolation * extrapolation_factor
}

/// transformers' attention factor: mscale(factor, mscale) / mscale(factor, mscale_all_dim).
fn hf_attention_factor(y: &k::Yarn) -> f64 {
    let get = |s: f64, m: f64| if s <= 1.0 { 1.0 } else { 0.1 * m * s.ln() + 1.0 };
    get(y.factor, y.mscale) / get(y.factor, y.mscale_all_dim)
}

/// Naive RoPE written from the formula, angle per (position, pair): pair i is (x[i], x[i + half]),
/// or, interleaved, Megatron's `_rotate_half` on adjacent features (x[2i], x[2i + 1]).
fn reference(x: &[f64], b: usize, t: usize, h: usize, d: usize, cfg: &RopeCfg) -> Vec<f64> {
    let mut y = x.to_vec();
    let half = cfg.rot / 2;
    for bb in 0..b {
        for p in 0..t {
            for hh in 0..h {
                let base = ((bb * t + p) * h + hh) * d;
                for i in 0..half {
                    // A split's rows (context parallelism's second chunk) restart at its position.
                    let pos = match cfg.split {
                        Some(sp) if p >= sp.at => sp.pos + p - sp.at,
                        _ => cfg.pos0 + p,
                    };
                    // Linear interpolation as transformers' rope_type linear: the frequencies divided.
                    let theta = pos as f64 * hf_freq(cfg, i) / cfg.interpolation.unwrap_or(1.0);
                    let m = cfg.yarn.map_or(1.0, |y| hf_attention_factor(&y));
                    let (a, b) =
                        if cfg.interleaved { (base + 2 * i, base + 2 * i + 1) } else { (base + i, base + i + half) };
                    let (x1, x2) = (x[a], x[b]);
                    y[a] = m * (x1 * theta.cos() - x2 * theta.sin());
                    y[b] = m * (x2 * theta.cos() + x1 * theta.sin());
                }
            }
        }
    }
    y
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn fwd_matches_formula_and_bwd_matches_fd(b in 1usize..3, t in 1usize..5, h in 1usize..3, pairs in 1usize..4, extra in 0usize..3, pos0 in 0usize..50, scaled: bool, split in proptest::option::of((0usize..5, 0usize..60)), interpolation in proptest::option::of(0.5f64..8.0), interleaved: bool, seed: u64) {
        let d = 2 * pairs + extra;
        // Scaled at a base where three pairs fall in the kept, blended and divided bands.
        let (base, scaling) = if scaled { (1e8, Some(RopeScaling::llama3(8.0))) } else { (10000.0, None) };
        let split = split.map(|(at, pos)| k::RopeSplit { at, pos });
        let cfg = RopeCfg { rot: 2 * pairs, base, pos0, scaling, split, yarn: None, interpolation, interleaved };
        let (x, r) = (randv(b * t * h * d, seed), randv(b * t * h * d, seed ^ 1));
        let dev = Device::Cpu;
        let y = k::rope_fwd(&t32(&dev, &x, &[b, t, h, d]), &cfg).unwrap();
        assert_close(&host(&y), &reference(&x, b, t, h, d, &cfg), 1e-5, 1e-5, "rope");
        let mut dx = vec![0.0; x.len()];
        rope::rope_bwd(&r, t, h, d, &cfg, &mut dx);
        fd_check(&x, &dx, |x| { let mut y = vec![0.0; x.len()]; rope::rope_fwd(x, t, h, d, &cfg, &mut y); dot(&y, &r) }, "rope dx");
    }
}

device_test!(backward_inverts_forward, |dev: &Device| {
    let cfg = RopeCfg { pos0: 3, ..RopeCfg::new(8, 500000.0) };
    let x = randv(2 * 6 * 3 * 8, 5);
    let xt = t32(dev, &x, &[2, 6, 3, 8]);
    let back = k::rope_bwd(&k::rope_fwd(&xt, &cfg).unwrap(), &cfg).unwrap();
    assert_close(&host(&back), &x, 1e-5, 1e-5, "R(-θ)R(θ)x");
});

#[test]
fn llama3_scaling_keeps_divides_and_blends_by_wavelength() {
    let cfg = RopeCfg { scaling: Some(RopeScaling::llama3(8.0)), ..RopeCfg::new(6, 1e8) };
    let plain = RopeCfg { scaling: None, ..cfg };
    // Wavelengths 2π, ≈ 2917 and ≈ 1.35e6 against the bands' edges 8192 / 4 and 8192 / 1.
    assert_eq!(cfg.freq(0), plain.freq(0));
    assert!(cfg.freq(1) < plain.freq(1) && cfg.freq(1) > plain.freq(1) / 8.0);
    assert_eq!(cfg.freq(2), plain.freq(2) / 8.0);
    for i in 0..3 {
        assert!((cfg.freq(i) - hf_freq(&cfg, i)).abs() <= 1e-15 * hf_freq(&cfg, i));
    }
    let bad = RopeCfg { scaling: Some(RopeScaling { high_freq_factor: 0.5, ..RopeScaling::llama3(8.0) }), ..cfg };
    let x = t32(&Device::Cpu, &randv(12, 0), &[1, 2, 1, 6]);
    assert!(k::rope_fwd(&x, &bad).unwrap_err().to_string().contains("high_freq_factor"));
}

/// YaRN against transformers' formula (DeepSeek-V3's numbers: factor 40, original context 4096,
/// mscale 1 and mscale_all_dim 1, so cos and sin unscaled; and Megatron's defaults, mscale_all_dim
/// 0, whose factor 0.1·ln 40 + 1 scales them), with a ramp whose ends fall inside the 32 pairs of
/// a 64-wide rotation; the backward against finite differences.
#[test]
fn yarn_matches_transformers_formula() {
    let deepseek = k::Yarn { mscale_all_dim: 1.0, ..k::Yarn::megatron(40.0) };
    let (lo, hi) = deepseek.range(64, 10000.0);
    assert!(lo > 0.0 && hi < 31.0 && lo < hi, "the ramp lies inside the pairs: {lo}..{hi}");
    assert_eq!(deepseek.attention_factor(), 1.0);
    assert!((k::Yarn::megatron(40.0).attention_factor() - (0.1 * 40f64.ln() + 1.0)).abs() < 1e-15);
    assert!((deepseek.softmax_factor() - (0.1 * 40f64.ln() + 1.0).powi(2)).abs() < 1e-12);
    // Kimi-K2's: betas 1 and 1 (Megatron's --yarn-beta-fast / --yarn-beta-slow), factor 32.
    let kimi = k::Yarn { beta_fast: 1.0, beta_slow: 1.0, mscale_all_dim: 1.0, ..k::Yarn::megatron(32.0) };
    assert_ne!(kimi.range(64, 10000.0), deepseek.range(64, 10000.0));
    for yarn in [deepseek, k::Yarn::megatron(40.0), kimi] {
        let cfg = RopeCfg { yarn: Some(yarn), ..RopeCfg::new(64, 10000.0) };
        for i in 0..32 {
            assert!((cfg.freq(i) - hf_freq(&cfg, i)).abs() <= 1e-14 * hf_freq(&cfg, i), "pair {i}");
        }
        // Pairs below the ramp keep their frequency, those past it are divided by the factor.
        let plain = RopeCfg { yarn: None, ..cfg };
        assert_eq!(cfg.freq(0), plain.freq(0));
        assert!((cfg.freq(31) - plain.freq(31) / yarn.factor).abs() < 1e-18);
        let (b, t, h, d) = (1, 5, 2, 68);
        let (x, r) = (randv(b * t * h * d, 3), randv(b * t * h * d, 4));
        let y = k::rope_fwd(&t32(&Device::Cpu, &x, &[b, t, h, d]), &cfg).unwrap();
        assert_close(&host(&y), &reference(&x, b, t, h, d, &cfg), 1e-5, 1e-5, "yarn rope");
        let mut dx = vec![0.0; x.len()];
        rope::rope_bwd(&r, t, h, d, &cfg, &mut dx);
        fd_check(
            &x,
            &dx,
            |x| {
                let mut y = vec![0.0; x.len()];
                rope::rope_fwd(x, t, h, d, &cfg, &mut y);
                dot(&y, &r)
            },
            "yarn rope dx",
        );
    }
    let both = RopeCfg { scaling: Some(RopeScaling::llama3(8.0)), yarn: Some(deepseek), ..RopeCfg::new(64, 10000.0) };
    let x = t32(&Device::Cpu, &randv(64, 0), &[1, 1, 1, 64]);
    assert!(k::rope_fwd(&x, &both).unwrap_err().to_string().contains("keep one"));
}

#[test]
fn odd_rotary_dim_is_an_error() {
    let x = t32(&Device::Cpu, &randv(2 * 5, 0), &[1, 1, 2, 5]);
    let e = k::rope_fwd(&x, &RopeCfg::new(5, 10000.0)).unwrap_err();
    assert!(e.to_string().contains("must be even"), "{e}");
}

// RoPE in place on a fused QKV tensor equals splitting it, rotating q and k, and merging back, to
// the bit (the same arithmetic per element); its backward likewise. GQA with 2 query heads per
// group, a rotary dim below the head dim, a non-zero first position; f32 and bf16.
device_test!(rope_on_fused_qkv_equals_split_rope_merge, |dev: &Device| {
    use ferrotron_core::DType;
    let (b, t, hkv, g, d) = (2, 5, 3, 2, 16);
    let w = hkv * (g + 2) * d;
    for (dt, cfg) in
        [(DType::F32, RopeCfg { pos0: 7, ..RopeCfg::new(12, 10000.0) }), (DType::BF16, RopeCfg::new(16, 500000.0))]
    {
        let x = tensor(dev, &randv(b * t * w, 41), &[b, t, w], dt);
        for (sign, name) in [(1.0, "fwd"), (-1.0, "bwd")] {
            let (q, kk, v) = k::qkv_split(&x, hkv, g, d).unwrap();
            let rot = |x: &ferrotron_core::Tensor| if sign > 0.0 { k::rope_fwd(x, &cfg) } else { k::rope_bwd(x, &cfg) };
            let want = k::qkv_merge(&rot(&q).unwrap(), &rot(&kk).unwrap(), &v).unwrap();
            let got = x.deep_copy().unwrap();
            if sign > 0.0 {
                k::rope_qkv_fwd_(&got, hkv, g, d, &cfg).unwrap();
            } else {
                k::rope_qkv_bwd_(&got, hkv, g, d, &cfg).unwrap();
            }
            assert_eq!(host(&got), host(&want), "rope_qkv {name} {dt:?}");
            assert_ne!(host(&got), host(&x), "rope_qkv {name} {dt:?} changed nothing");
        }
    }
});

#[test]
fn fused_qkv_rope_names_a_width_that_does_not_fit_its_groups() {
    let x = t32(&Device::Cpu, &randv(2 * 3 * 40, 0), &[2, 3, 40]);
    let cfg = RopeCfg::new(8, 10000.0);
    let e = k::rope_qkv_fwd_(&x, 2, 2, 8, &cfg).unwrap_err().to_string();
    assert!(e.contains("rope_qkv_fwd_") && e.contains("2·(2+2)·8 = 64"), "{e}");
    let e =
        k::rope_qkv_bwd_(&t32(&Device::Cpu, &randv(2 * 3 * 64, 0), &[2, 3, 64]), 2, 2, 8, &RopeCfg { rot: 10, ..cfg });
    assert!(e.unwrap_err().to_string().contains("at most the head dim 8"));
}

// Interleaved RoPE is rotate-half RoPE on the features permuted so that the even ones come first
// (the permutation Megatron's MLA and transformers' DeepSeek apply before rotating), permuted
// back: on both kernels (a half of 12, one pair a thread; 32, eight pairs a thread, with 16
// features passed through), forward and backward, and in place on fused QKV.
device_test!(interleaved_is_rotate_half_on_deinterleaved_features, |dev: &Device| {
    use ferrotron_core::DType;
    // Feature j of the de-interleaved head is feature perm[j] of the interleaved one.
    let perm = |rot: usize, d: usize| -> Vec<usize> {
        (0..rot / 2).map(|i| 2 * i).chain((0..rot / 2).map(|i| 2 * i + 1)).chain(rot..d).collect()
    };
    let gather = |x: &[f64], d: usize, idx: &[usize]| -> Vec<f64> {
        x.chunks(d).flat_map(|h| idx.iter().map(|&j| h[j]).collect::<Vec<_>>()).collect()
    };
    let scatter = |x: &[f64], d: usize, idx: &[usize]| -> Vec<f64> {
        let mut y = vec![0.0; x.len()];
        for (yh, xh) in y.chunks_mut(d).zip(x.chunks(d)) {
            for (j, &i) in idx.iter().enumerate() {
                yh[i] = xh[j];
            }
        }
        y
    };
    for (dims, rot, base, pos0) in [([2, 5, 3, 16], 12, 10000.0, 7), ([2, 4, 2, 80], 64, 500000.0, 3000)] {
        let d = dims[3];
        let half = RopeCfg { pos0, ..RopeCfg::new(rot, base) };
        let il = RopeCfg { interleaved: true, ..half };
        let p = perm(rot, d);
        let x = randv(dims.iter().product(), 17);
        let xt = t32(dev, &x, &dims);
        let xp = t32(dev, &gather(&x, d, &p), &dims);
        let fwd = scatter(&host(&k::rope_fwd(&xp, &half).unwrap()), d, &p);
        assert_close(&host(&k::rope_fwd(&xt, &il).unwrap()), &fwd, 1e-6, 1e-6, "interleaved fwd");
        let bwd = scatter(&host(&k::rope_bwd(&xp, &half).unwrap()), d, &p);
        assert_close(&host(&k::rope_bwd(&xt, &il).unwrap()), &bwd, 1e-6, 1e-6, "interleaved bwd");
        assert!(host(&k::rope_fwd(&xt, &il).unwrap()) != host(&k::rope_fwd(&xt, &half).unwrap()), "the layouts differ");
        // In place on fused QKV: the query and key heads as rope_fwd turns them, value heads kept.
        let (hkv, g) = (1, 2);
        let qkv = tensor(dev, &randv(2 * 3 * hkv * (g + 2) * d, 19), &[2, 3, hkv * (g + 2) * d], DType::F32);
        let (q, kk, v) = k::qkv_split(&qkv, hkv, g, d).unwrap();
        let want = k::qkv_merge(&k::rope_fwd(&q, &il).unwrap(), &k::rope_fwd(&kk, &il).unwrap(), &v).unwrap();
        k::rope_qkv_fwd_(&qkv, hkv, g, d, &il).unwrap();
        assert_eq!(host(&qkv), host(&want), "interleaved rope_qkv");
    }
});
