use crate::device_test;
use crate::util::*;
use ferrotron_core::rng::Philox;
use ferrotron_core::{DType, Device, Tensor};
use ferrotron_kernels::cpu::attention::{self as at, AttnDims, AttnMask};
use ferrotron_kernels::cpu::attn_sink;
use ferrotron_kernels::{self as k, AttnCfg, AttnDropout};
use proptest::prelude::*;

/// Dropout's multiplier for probability (i, j) of head h of batch row b, straight from the
/// documented block (of Philox-4x32-7), word and half (`AttnDropout`): 1 / (1 − p) where the
/// 16-bit value is at least ⌈p · 2¹⁶⌉, else 0; 1 without dropout.
fn drop_factor(dr: Option<AttnDropout>, d: AttnDims, b: usize, h: usize, i: usize, j: usize) -> f64 {
    let Some(dr) = dr else { return 1.0 };
    let (tiles_t, tiles_s) = dr.tiles.unwrap_or((d.t.div_ceil(16) as u64, d.s.div_ceil(16) as u64));
    let tile = ((dr.head_offset + h as u64) * tiles_t + (i / 16) as u64) * tiles_s + (j / 16) as u64;
    let block = dr.base + b as u64 * dr.batch_stride + tile * 32 + (i % 8 * 4 + j % 8 / 2) as u64;
    let word = Philox::new(dr.seed).with_stream(dr.stream).block_rounds(block, 7)[i % 16 / 8 * 2 + j % 16 / 8];
    let u = if j % 2 == 0 { word & 0xffff } else { word >> 16 };
    let threshold = (dr.p as f64 * 65536.0).ceil() as u32;
    if u >= threshold { 1.0 / (1.0 - dr.p as f64) } else { 0.0 }
}

/// Naive attention: explicit loops over every (batch, head, query, key).
fn reference(q: &[f64], kk: &[f64], v: &[f64], d: AttnDims, mask: AttnMask) -> Vec<f64> {
    reference_sink(q, kk, v, d, mask, None)
}

/// `reference` with one more logit `sink[h]` in each row's softmax of head h, a key with no
/// value (the sink softmax, written out on its own).
fn reference_sink(q: &[f64], kk: &[f64], v: &[f64], d: AttnDims, mask: AttnMask, sink: Option<&[f64]>) -> Vec<f64> {
    let scale = 1.0 / (d.d as f64).sqrt();
    let mut o = vec![0.0; q.len()];
    for b in 0..d.b {
        for h in 0..d.hq {
            let kvh = h / (d.hq / d.hkv);
            for i in 0..d.t {
                let qi = &q[((b * d.t + i) * d.hq + h) * d.d..][..d.d];
                let allowed: Vec<usize> = (0..d.s).filter(|&j| mask.allows(b, d.t, i, j)).collect();
                let scores: Vec<f64> = allowed
                    .iter()
                    .map(|&j| {
                        let kj = &kk[((b * d.s + j) * d.hkv + kvh) * d.d..][..d.d];
                        scale * qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>()
                    })
                    .collect();
                let sink_h = sink.map(|s| s[h]);
                let max = scores.iter().copied().chain(sink_h).fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = scores.iter().copied().chain(sink_h).map(|s| (s - max).exp()).sum();
                for (&j, s) in allowed.iter().zip(&scores) {
                    let p = (s - max).exp() / z * drop_factor(mask.dropout, d, b, h, i, j);
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

/// The CPU backward's dq, dk, dv against finite differences of ⟨o, r⟩ on random inputs.
fn backward_against_finite_differences(d: AttnDims, mask: AttnMask, seed: u64) {
    let n = d.b * d.s * d.hkv * d.d;
    let (q, kk, v) = (randv(d.b * d.t * d.hq * d.d, seed), randv(n, seed ^ 1), randv(n, seed ^ 2));
    let r = randv(q.len(), seed ^ 3);
    let (o, lse) = run_f64(&q, &kk, &v, d, mask);
    let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; kk.len()], vec![0.0; v.len()]);
    at::attention_bwd(&q, &kk, &v, &o, &lse, &r, d, mask, 1.0 / (d.d as f64).sqrt(), &mut dq, &mut dk, &mut dv);
    fd_check(&q, &dq, |x| dot(&run_f64(x, &kk, &v, d, mask).0, &r), "dq");
    fd_check(&kk, &dk, |x| dot(&run_f64(&q, x, &v, d, mask).0, &r), "dk");
    fd_check(&v, &dv, |x| dot(&run_f64(&q, &kk, x, d, mask).0, &r), "dv");
}

fn dims_strategy() -> impl Strategy<Value = (AttnDims, AttnMask<'static>)> {
    dims_up_to(6)
}

/// Shapes of fewer than `t_end` rows.
fn dims_up_to(t_end: usize) -> impl Strategy<Value = (AttnDims, AttnMask<'static>)> {
    (1usize..3, 1usize..t_end, 1usize..3, 1usize..3, 1usize..5, any::<bool>(), prop::option::of(1usize..4)).prop_map(
        |(b, t, hkv, group, d, causal, window)| {
            (
                AttnDims { b, t, s: t, hq: hkv * group, hkv, d },
                AttnMask { causal: causal || window.is_some(), window, dropout: None, docs: None },
            )
        },
    )
}

/// Shapes up to 40 rows (the mask's 16 × 16 tiles and their 8-row halves, ragged ends) with
/// dropout of the probabilities at rate 0.3, from a random key (several micro-batch bases and head
/// offsets: a tensor-parallel rank's heads).
fn dropout_strategy() -> impl Strategy<Value = (AttnDims, AttnMask<'static>)> {
    (dims_up_to(40), any::<u64>(), 0u64..3, 0u64..1000).prop_map(|((d, mask), seed, head_offset, sample)| {
        let batch_stride = AttnDropout::blocks_per_sample(d.hq + head_offset as usize, d.t, d.s);
        let dropout = Some(AttnDropout {
            p: 0.3,
            seed,
            stream: seed >> 7,
            base: sample * batch_stride,
            batch_stride,
            head_offset,
            tiles: None,
        });
        (d, AttnMask { dropout, ..mask })
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn forward_with_dropout_matches_naive((d, mask) in dropout_strategy(), seed: u64) {
        let (q, kk, v) = (randv(d.b * d.t * d.hq * d.d, seed), randv(d.b * d.s * d.hkv * d.d, seed ^ 1), randv(d.b * d.s * d.hkv * d.d, seed ^ 2));
        let (o, lse) = run_f64(&q, &kk, &v, d, mask);
        let (_, lse0) = run_f64(&q, &kk, &v, d, AttnMask { dropout: None, ..mask });
        assert_close(&o, &reference(&q, &kk, &v, d, mask), 1e-9, 1e-9, "attention with dropout");
        // The saved log-sum-exp is the undropped softmax's (the backward recomputes P from it).
        prop_assert_eq!(lse, lse0);
    }

    #[test]
    fn backward_with_dropout_matches_finite_differences((d, mask) in dropout_strategy(), seed: u64) {
        backward_against_finite_differences(d, mask, seed);
    }

    #[test]
    fn forward_matches_naive((d, mask) in dims_strategy(), seed: u64) {
        let dev = Device::Cpu;
        let (q, kk, v) = (randv(d.b * d.t * d.hq * d.d, seed), randv(d.b * d.s * d.hkv * d.d, seed ^ 1), randv(d.b * d.s * d.hkv * d.d, seed ^ 2));
        let cfg = AttnCfg { causal: mask.causal, window: mask.window, scale: None, dropout: None, docs: None };
        let (o, lse) = k::attention_fwd(&t32(&dev, &q, &[d.b, d.t, d.hq, d.d]), &t32(&dev, &kk, &[d.b, d.s, d.hkv, d.d]), &t32(&dev, &v, &[d.b, d.s, d.hkv, d.d]), &cfg).unwrap();
        prop_assert_eq!(lse.dims(), &[d.b, d.hq, d.t]);
        assert_close(&host(&o), &reference(&q, &kk, &v, d, mask), 1e-5, 1e-5, "attention");
    }

    #[test]
    fn backward_matches_finite_differences((d, mask) in dims_strategy(), seed: u64) {
        backward_against_finite_differences(d, mask, seed);
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
    let cfg = AttnCfg { causal: true, window: Some(1), scale: None, dropout: None, docs: None };
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
            AttnCfg { causal: true, window: Some(3), scale: None, dropout: None, docs: None },
            AttnCfg { causal: false, window: None, scale: Some(0.3), dropout: None, docs: None },
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

// Attention dropout through the tensor ops: about p of the probabilities dropped (V = I shows
// P̃ itself), the fused-QKV path equal to the split one, the heads of a tensor-parallel rank
// (`head_offset`) equal to its part of the whole (on a GPU: the reference kernels, head dim 48).
device_test!(attention_dropout_through_the_ops, |dev: &Device| {
    let (b, t, h, dd) = (2usize, 48usize, 4usize, 48usize);
    let batch_stride = AttnDropout::blocks_per_sample(h, t, t);
    let dropout = Some(AttnDropout {
        p: 0.25,
        seed: 11,
        stream: 3,
        base: 7 * batch_stride,
        batch_stride,
        head_offset: 0,
        tiles: None,
    });
    let cfg = AttnCfg { causal: false, window: None, scale: None, dropout, docs: None };
    let q = t32(dev, &randv(b * t * h * dd, 1), &[b, t, h, dd]);
    let kk = t32(dev, &randv(b * t * h * dd, 2), &[b, t, h, dd]);
    // V's rows the unit vectors: O's row i is P̃'s row i.
    let eye: Vec<f64> = (0..b * t * h * dd).map(|x| if (x / (h * dd)) % t == x % dd { 1.0 } else { 0.0 }).collect();
    let v = t32(dev, &eye, &[b, t, h, dd]);
    let (o, _) = k::attention_fwd(&q, &kk, &v, &cfg).unwrap();
    let o = host(&o);
    let dropped = o.iter().filter(|&&x| x == 0.0).count() as f64 / o.len() as f64;
    assert!((dropped - 0.25).abs() < 0.02, "dropped {dropped}");
    // Rows of P̃ average 1 over the mask's draws (each kept value scaled by 1 / (1 − p)).
    let mean_row_sum = o.chunks(dd).map(|r| r.iter().sum::<f64>()).sum::<f64>() / (b * t * h) as f64;
    assert!((mean_row_sum - 1.0).abs() < 0.05, "mean row sum {mean_row_sum}");
    // Heads 2..4 alone, as a second tensor-parallel rank holds them: their part of the whole.
    let part = |x: &Tensor| -> Tensor {
        let v = host(x);
        let rows: Vec<f64> =
            v.chunks(dd).enumerate().filter(|(r, _)| r % h >= 2).flat_map(|(_, c)| c.to_vec()).collect();
        t32(dev, &rows, &[b, t, 2, dd])
    };
    let cfg2 = AttnCfg { dropout: dropout.map(|d| AttnDropout { head_offset: 2, ..d }), ..cfg };
    let (o2, _) = k::attention_fwd(&part(&q), &part(&kk), &part(&v), &cfg2).unwrap();
    let whole = t32(dev, &o, &[b, t, h, dd]);
    assert_eq!(host(&o2), host(&part(&whole)), "the rank's heads draw their part of the mask");
    // Q, K, V in place from a fused projection output: the same as split (forward and backward).
    let (hkv, g) = (2usize, 2usize);
    let qkv = t32(dev, &randv(b * t * hkv * (g + 2) * dd, 5), &[b, t, hkv * (g + 2) * dd]);
    let r = t32(dev, &randv(b * t * hkv * g * dd, 6), &[b, t, hkv * g, dd]);
    let heads = k::QkvHeads::new(hkv, g, dd);
    let causal = AttnCfg { causal: true, ..cfg };
    let (of, lf) = k::attention_fwd_qkv(&qkv, heads, &causal).unwrap();
    let (qs, ks, vs) = k::qkv_split(&qkv, hkv, g, dd).unwrap();
    let (os, ls) = k::attention_fwd(&qs, &ks, &vs, &causal).unwrap();
    assert_eq!(host(&of), host(&os), "fused against split, forward");
    let dqkv = k::attention_bwd_qkv(&qkv, &of, &lf, &r, heads, &causal).unwrap();
    let (dq, dk, dv) = k::attention_bwd(&qs, &ks, &vs, &os, &ls, &r, &causal).unwrap();
    // On a GPU the reference backward adds dK and dV by fp32 atomics, in no fixed order.
    let split = host(&k::qkv_merge(&dq, &dk, &dv).unwrap());
    if matches!(dev, Device::Cpu) {
        assert_eq!(host(&dqkv), split, "fused against split, backward");
    } else {
        assert_close(&host(&dqkv), &split, 1e-5, 1e-6, "fused against split, backward");
    }
});

/// [B, T, H, D] chunks a and b (host) as one [B, 2T, H, D] sequence: a's rows first in each batch row.
fn cat_seq(a: &[f64], b: &[f64], batch: usize) -> Vec<f64> {
    let (ra, rb) = (a.len() / batch, b.len() / batch);
    (0..batch).flat_map(|i| a[i * ra..][..ra].iter().chain(&b[i * rb..][..rb]).copied()).collect()
}

device_test!(merged_key_blocks_equal_one_causal_sequence, |dev: &Device| {
    // Context parallelism's decomposition on two chunks A (positions 0..T) and B (T..2T) of a
    // causal sequence: A's rows are A×A causal; B's rows merge B×A (every key) with B×B causal.
    // Backward: each block's gradients from the merged (o, lse) sum to the whole sequence's.
    for (b, t, hq, hkv, d) in [(2usize, 5usize, 4usize, 2usize, 16usize), (1, 9, 2, 1, 64)] {
        let (nq, nk) = (b * t * hq * d, b * t * hkv * d);
        let sizes = [nq, nq, nk, nk, nk, nk, nq, nq];
        let [qa, qb, ka, kb, va, vb, ga, gb]: [Vec<f64>; 8] =
            std::array::from_fn(|i| randv(sizes[i], 100 * t as u64 + i as u64));
        let causal = AttnCfg::default();
        let full = AttnCfg { causal: false, ..causal };
        // The oracle: one causal sequence of 2T on the CPU.
        let cpu = Device::Cpu;
        let seq = |a: &[f64], bb: &[f64], h: usize| t32(&cpu, &cat_seq(a, bb, b), &[b, 2 * t, h, d]);
        let (q2, k2, v2, g2) = (seq(&qa, &qb, hq), seq(&ka, &kb, hkv), seq(&va, &vb, hkv), seq(&ga, &gb, hq));
        let (o2, l2) = k::attention_fwd(&q2, &k2, &v2, &causal).unwrap();
        let (dq2, dk2, dv2) = k::attention_bwd(&q2, &k2, &v2, &o2, &l2, &g2, &causal).unwrap();
        // The blocks on `dev`.
        let on = |x: &[f64], h: usize| t32(dev, x, &[b, t, h, d]);
        let (qa_, qb_, ka_, kb_, va_, vb_, ga_, gb_) = (
            on(&qa, hq),
            on(&qb, hq),
            on(&ka, hkv),
            on(&kb, hkv),
            on(&va, hkv),
            on(&vb, hkv),
            on(&ga, hq),
            on(&gb, hq),
        );
        let (oa, la) = k::attention_fwd(&qa_, &ka_, &va_, &causal).unwrap();
        let (ob, lb) = k::attention_fwd(&qb_, &kb_, &vb_, &causal).unwrap();
        let (ox, lx) = k::attention_fwd(&qb_, &ka_, &va_, &full).unwrap();
        k::attention_merge_(&ob, &lb, &ox, &lx).unwrap();
        assert_close(&cat_seq(&host(&oa), &host(&ob), b), &host(&o2), 1e-5, 1e-6, "merged o");
        let lse2 = host(&l2);
        let lse_b: Vec<f64> = (0..b * hq).flat_map(|r| lse2[r * 2 * t + t..][..t].to_vec()).collect();
        assert_close(&host(&lb), &lse_b, 1e-5, 1e-6, "merged lse");
        let (dqa, dka, dva) = k::attention_bwd(&qa_, &ka_, &va_, &oa, &la, &ga_, &causal).unwrap();
        let (dqb, dkb, dvb) = k::attention_bwd(&qb_, &kb_, &vb_, &ob, &lb, &gb_, &causal).unwrap();
        let (dqx, dkx, dvx) = k::attention_bwd(&qb_, &ka_, &va_, &ob, &lb, &gb_, &full).unwrap();
        let sum = |a: &Tensor, c: &Tensor| host(a).iter().zip(host(c)).map(|(x, y)| x + y).collect::<Vec<_>>();
        assert_close(&cat_seq(&host(&dqa), &sum(&dqb, &dqx), b), &host(&dq2), 1e-4, 1e-5, "dq");
        assert_close(&cat_seq(&sum(&dka, &dkx), &host(&dkb), b), &host(&dk2), 1e-4, 1e-5, "dk");
        assert_close(&cat_seq(&sum(&dva, &dvx), &host(&dvb), b), &host(&dv2), 1e-4, 1e-5, "dv");
    }
});

#[test]
fn merge_refuses_a_running_sum_in_bf16() {
    let dev = Device::Cpu;
    let o = Tensor::zeros([1, 2, 1, 4], DType::BF16, &dev).unwrap();
    let l = Tensor::zeros([1, 1, 2], DType::F32, &dev).unwrap();
    let (op, lp) = (o.deep_copy().unwrap(), l.deep_copy().unwrap());
    let e = k::attention_merge_(&o, &l, &op, &lp).unwrap_err().to_string();
    assert!(e.contains("attention_merge_") && e.contains("f32"), "{e}");
}

// Multi-latent attention pads its heads to this width: a tensor-core kernel's head dim (64, 128,
// 192) on a GPU in bf16, nothing on the CPU or in f32, and past 192 nothing either.
device_test!(padded_width_is_a_tensor_core_head_dim_on_a_gpu_in_bf16, |dev: &Device| {
    let gpu = !matches!(dev, Device::Cpu);
    let w = |d: usize, dt: DType| k::attention_padded_width(d, dt, dev);
    let want = |tc: usize, d: usize| if gpu { tc } else { d };
    assert_eq!(w(24, DType::BF16), want(64, 24));
    assert_eq!(w(64, DType::BF16), 64);
    assert_eq!(w(96, DType::BF16), want(128, 96));
    assert_eq!(w(160, DType::BF16), want(192, 160));
    assert_eq!(w(192, DType::BF16), 192);
    assert_eq!(w(200, DType::BF16), 200);
    assert_eq!(w(24, DType::F32), 24);
});

/// The sink softmax in f64 on the CPU: the attention, then `attn_sink::sink_fwd` on its (o, lse).
fn run_sink_f64(q: &[f64], kk: &[f64], v: &[f64], d: AttnDims, mask: AttnMask, sink: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let (mut o, mut lse) = run_f64(q, kk, v, d, mask);
    attn_sink::sink_fwd(&mut o, &mut lse, sink, (d.b, d.t, d.hq, d.d, 1));
    (o, lse)
}

/// The sink softmax's gradients in f64 (the attention backward on the new (o, lse), the sink's
/// terms summed over rows) against finite differences of ⟨o, r⟩.
fn sink_backward_against_finite_differences(d: AttnDims, mask: AttnMask, seed: u64) {
    let n = d.b * d.s * d.hkv * d.d;
    let (q, kk, v) = (randv(d.b * d.t * d.hq * d.d, seed), randv(n, seed ^ 1), randv(n, seed ^ 2));
    let (r, sink) = (randv(q.len(), seed ^ 3), randv(d.hq, seed ^ 4));
    let (o, lse) = run_sink_f64(&q, &kk, &v, d, mask, &sink);
    let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; kk.len()], vec![0.0; v.len()]);
    at::attention_bwd(&q, &kk, &v, &o, &lse, &r, d, mask, 1.0 / (d.d as f64).sqrt(), &mut dq, &mut dk, &mut dv);
    let mut term = vec![0.0; d.b * d.t * d.hq];
    attn_sink::sink_bwd_terms(&o, &lse, &r, &sink, (d.b, d.t, d.hq, d.d, 1), &mut term);
    let ds: Vec<f64> = (0..d.hq).map(|h| term.iter().skip(h).step_by(d.hq).sum()).collect();
    let f = |q: &[f64], kk: &[f64], v: &[f64], s: &[f64]| dot(&run_sink_f64(q, kk, v, d, mask, s).0, &r);
    fd_check(&q, &dq, |x| f(x, &kk, &v, &sink), "sink softmax dq");
    fd_check(&kk, &dk, |x| f(&q, x, &v, &sink), "sink softmax dk");
    fd_check(&v, &dv, |x| f(&q, &kk, x, &sink), "sink softmax dv");
    fd_check(&sink, &ds, |x| f(&q, &kk, &v, x), "sink softmax dsink");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn sink_softmax_forward_matches_naive((d, mask) in dims_strategy(), seed: u64) {
        let n = d.b * d.s * d.hkv * d.d;
        let (q, kk, v) = (randv(d.b * d.t * d.hq * d.d, seed), randv(n, seed ^ 1), randv(n, seed ^ 2));
        let sink = randv(d.hq, seed ^ 4);
        let (o, lse) = run_sink_f64(&q, &kk, &v, d, mask, &sink);
        assert_close(&o, &reference_sink(&q, &kk, &v, d, mask, Some(&sink)), 1e-9, 1e-9, "sink softmax o");
        // The new lse: ln(e^lse + e^sink) of the plain one.
        let (_, lse0) = run_f64(&q, &kk, &v, d, mask);
        let want: Vec<f64> = lse0.iter().enumerate().map(|(i, l)| (l.exp() + sink[i / d.t % d.hq].exp()).ln()).collect();
        assert_close(&lse, &want, 1e-12, 1e-12, "sink softmax lse");
    }

    #[test]
    fn sink_softmax_backward_matches_finite_differences((d, mask) in dropout_strategy(), seed: u64, drop: bool) {
        sink_backward_against_finite_differences(d, AttnMask { dropout: mask.dropout.filter(|_| drop), ..mask }, seed);
    }
}

/// [B, H, T] → context parallelism's chunk-major [2, B, H, T/2] (T even).
fn chunk_major_lse(lse: &[f64], b: usize, h: usize, t: usize) -> Vec<f64> {
    let c = t / 2;
    (0..2).flat_map(|half| (0..b * h).flat_map(move |r| (0..c).map(move |i| lse[r * t + half * c + i]))).collect()
}

device_test!(sink_softmax_on_the_device_matches_f64_in_both_lse_layouts, |dev: &Device| {
    // The device's kernels (f32, and bf16 o / dO on a GPU) against the f64 CPU pipeline, with the
    // lse as the attention gives it and chunk-major as context parallelism keeps it.
    let gpu = !matches!(dev, Device::Cpu);
    for (b, t, h, d, seed) in [(2usize, 6usize, 3usize, 16usize, 1u64), (1, 10, 2, 64, 2), (3, 4, 5, 7, 3)] {
        let (o0, lse0, r, sink) = (
            randv(b * t * h * d, seed),
            randv(b * h * t, seed ^ 1),
            randv(b * t * h * d, seed ^ 2),
            randv(h, seed ^ 3),
        );
        let (mut o_want, mut lse_want) = (o0.clone(), lse0.clone());
        attn_sink::sink_fwd(&mut o_want, &mut lse_want, &sink, (b, t, h, d, 1));
        let mut term = vec![0.0; b * t * h];
        attn_sink::sink_bwd_terms(&o_want, &lse_want, &r, &sink, (b, t, h, d, 1), &mut term);
        let dtypes: &[DType] = if gpu { &[DType::F32, DType::BF16] } else { &[DType::F32] };
        for &dt in dtypes {
            let tol = if dt == DType::F32 { 1e-5 } else { 1e-2 };
            for chunked in [false, true] {
                let (lse_in, lse_shape) = if chunked {
                    (chunk_major_lse(&lse0, b, h, t), vec![2, b, h, t / 2])
                } else {
                    (lse0.clone(), vec![b, h, t])
                };
                // A chunk-major lse needs whole chunks.
                if chunked && t % 2 == 1 {
                    continue;
                }
                let what = format!("{dt} chunked {chunked} [{b}, {t}, {h}, {d}]");
                let o = tensor(dev, &o0, &[b, t, h, d], dt);
                let lse = t32(dev, &lse_in, &lse_shape);
                let s = t32(dev, &sink, &[h]);
                k::attention_sink_(&o, &lse, &s).unwrap();
                let lse_w = if chunked { chunk_major_lse(&lse_want, b, h, t) } else { lse_want.clone() };
                assert_close(&host(&lse), &lse_w, 1e-5, 1e-6, &format!("lse {what}"));
                // o as stored: the kernel's product rounded to dt, against f64 rounded the same way.
                let o_w = host(&tensor(&Device::Cpu, &o_want, &[b, t, h, d], dt));
                assert_close(&host(&o), &o_w, tol, 1e-6, &format!("o {what}"));
                let got = k::attention_sink_bwd(&o, &lse, &tensor(dev, &r, &[b, t, h, d], dt), &s).unwrap();
                assert_eq!(got.dims(), &[b, t, h]);
                // The terms from the device's own o (bf16-rounded on a bf16 run).
                let mut want = vec![0.0; b * t * h];
                let r_dt = host(&tensor(&Device::Cpu, &r, &[b, t, h, d], dt));
                attn_sink::sink_bwd_terms(&host(&o), &lse_want, &r_dt, &sink, (b, t, h, d, 1), &mut want);
                assert_close(&host(&got), &want, 1e-4, 1e-5, &format!("terms {what}"));
                if dt == DType::F32 {
                    assert_close(&host(&got), &term, 1e-4, 1e-5, &format!("terms against f64 {what}"));
                }
            }
        }
    }
});

#[test]
fn sink_softmax_refuses_a_bf16_lse_and_a_wrong_head_count() {
    let dev = Device::Cpu;
    let o = Tensor::zeros([1, 4, 2, 8], DType::F32, &dev).unwrap();
    let sink = Tensor::zeros([2], DType::F32, &dev).unwrap();
    let e = k::attention_sink_(&o, &Tensor::zeros([1, 2, 4], DType::BF16, &dev).unwrap(), &sink).unwrap_err();
    assert!(e.to_string().contains("attention_sink_") && e.to_string().contains("f32"), "{e}");
    let lse = Tensor::zeros([1, 2, 4], DType::F32, &dev).unwrap();
    let e = k::attention_sink_(&o, &lse, &Tensor::zeros([3], DType::F32, &dev).unwrap()).unwrap_err();
    assert!(e.to_string().contains("attention_sink_"), "{e}");
    let e = k::attention_sink_(&o, &Tensor::zeros([3, 1, 2, 1], DType::F32, &dev).unwrap(), &sink).unwrap_err();
    assert!(e.to_string().contains("chunk-major"), "{e}");
}

/// Document starts of `b` rows of `t` positions (`AttnCfg::docs`): each row cut where a seeded
/// normal draw passes 0.8 (about one position in five starts a document), always from 0.
fn doc_starts(b: usize, t: usize, seed: u64) -> Vec<u32> {
    let r = randv(b * t, seed);
    let mut out = Vec::with_capacity(b * t);
    for row in 0..b {
        let mut start = 0;
        for i in 0..t {
            if i > 0 && r[row * t + i] > 0.8 {
                start = i as u32;
            }
            out.push(start);
        }
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Document masks (--reset-attention-mask) in the CPU kernels: the forward against the
    /// naive loops (whose `allows` reads each query's start), the backward against finite
    /// differences; with sliding windows and dropout too.
    #[test]
    fn document_masks_match_naive_and_finite_differences((d, mask) in dims_up_to(14), drop: bool, seed: u64) {
        let docs = doc_starts(d.b, d.t, seed ^ 9);
        let dropout = drop.then(|| {
            let batch_stride = AttnDropout::blocks_per_sample(d.hq, d.t, d.s);
            AttnDropout { p: 0.3, seed, stream: 1, base: 0, batch_stride, head_offset: 0, tiles: None }
        });
        let mask = AttnMask { causal: true, docs: Some(&docs), dropout, ..mask };
        let (q, kk, v) = (randv(d.b * d.t * d.hq * d.d, seed), randv(d.b * d.s * d.hkv * d.d, seed ^ 1), randv(d.b * d.s * d.hkv * d.d, seed ^ 2));
        let (o, _) = run_f64(&q, &kk, &v, d, mask);
        assert_close(&o, &reference(&q, &kk, &v, d, mask), 1e-9, 1e-9, "document-masked attention");
        backward_against_finite_differences(d, mask, seed);
    }
}

// Each document of a packed row attends as if it were a row of its own: o and the gradients of
// the masked rows equal those of every document run alone (plain causal attention), GQA, in f32,
// separate and fused QKV (on a GPU the reference kernels take the masks, the flash kernels the
// documents alone).
device_test!(document_masked_rows_equal_each_document_alone, |dev: &Device| {
    let (b, t, hq, hkv, dd) = (2usize, 13usize, 4usize, 2usize, 8usize);
    let starts = [vec![0usize, 5, 6, 10], vec![0, 8]];
    let docs: Vec<u32> = (0..b)
        .flat_map(|r| {
            let s = starts[r].clone();
            (0..t).map(move |i| *s.iter().rfind(|&&x| x <= i).unwrap() as u32)
        })
        .collect();
    let docs_t = Tensor::from_vec(docs, [b, t], dev).unwrap();
    let cfg = AttnCfg { docs: Some(&docs_t), ..AttnCfg::default() };
    let (qv, kv, vv, rv) =
        (randv(b * t * hq * dd, 1), randv(b * t * hkv * dd, 2), randv(b * t * hkv * dd, 3), randv(b * t * hq * dd, 4));
    let (q, kk, v, r) = (
        t32(dev, &qv, &[b, t, hq, dd]),
        t32(dev, &kv, &[b, t, hkv, dd]),
        t32(dev, &vv, &[b, t, hkv, dd]),
        t32(dev, &rv, &[b, t, hq, dd]),
    );
    let (o, lse) = k::attention_fwd(&q, &kk, &v, &cfg).unwrap();
    let (dq, dk, dv) = k::attention_bwd(&q, &kk, &v, &o, &lse, &r, &cfg).unwrap();
    let (o, dq, dk, dv) = (host(&o), host(&dq), host(&dk), host(&dv));
    // Rows [s, e) of batch row `row` of x [B, T, h·D] as a [1, e − s, h, D] tensor, and back.
    let cut = |x: &[f64], h: usize, row: usize, s: usize, e: usize| {
        let w = h * dd;
        t32(dev, &x[(row * t + s) * w..(row * t + e) * w], &[1, e - s, h, dd])
    };
    for row in 0..b {
        let mut ends = starts[row][1..].to_vec();
        ends.push(t);
        for (&s, &e) in starts[row].iter().zip(&ends) {
            let (q1, k1, v1, r1) =
                (cut(&qv, hq, row, s, e), cut(&kv, hkv, row, s, e), cut(&vv, hkv, row, s, e), cut(&rv, hq, row, s, e));
            let (o1, l1) = k::attention_fwd(&q1, &k1, &v1, &AttnCfg::default()).unwrap();
            let (dq1, dk1, dv1) = k::attention_bwd(&q1, &k1, &v1, &o1, &l1, &r1, &AttnCfg::default()).unwrap();
            for (whole, alone, h, name) in
                [(&o, &o1, hq, "o"), (&dq, &dq1, hq, "dq"), (&dk, &dk1, hkv, "dk"), (&dv, &dv1, hkv, "dv")]
            {
                let w = h * dd;
                let part = &whole[(row * t + s) * w..(row * t + e) * w];
                assert_close(part, &host(alone), 1e-5, 1e-6, &format!("{name} of row {row}'s document [{s}, {e})"));
            }
        }
    }
    // The fused projection output's entry points take the same masks.
    let g = hq / hkv;
    let qkv = k::qkv_merge(&q, &kk, &v).unwrap();
    let heads = k::QkvHeads::new(hkv, g, dd);
    let (of, lf) = k::attention_fwd_qkv(&qkv, heads, &cfg).unwrap();
    let dqkv = k::attention_bwd_qkv(&qkv, &of, &lf, &r, heads, &cfg).unwrap();
    assert_close(&host(&of), &o, 1e-6, 1e-6, "fused o");
    let (dqf, dkf, dvf) = k::qkv_split(&dqkv, hkv, g, dd).unwrap();
    for (x, y, name) in [(&dqf, &dq, "fused dq"), (&dkf, &dk, "fused dk"), (&dvf, &dv, "fused dv")] {
        assert_close(&host(x), y, 1e-5, 1e-6, name);
    }
});

#[test]
fn bad_document_masks_are_errors_that_name_them() {
    let dev = Device::Cpu;
    let (b, t, h, dd) = (1, 4, 2, 4);
    let x = t32(&dev, &randv(b * t * h * dd, 1), &[b, t, h, dd]);
    let fails = |docs: &Tensor, cfg: AttnCfg| {
        k::attention_fwd(&x, &x, &x, &AttnCfg { docs: Some(docs), ..cfg }).unwrap_err().to_string()
    };
    let ok = Tensor::from_vec(vec![0u32, 0, 2, 2], [b, t], &dev).unwrap();
    assert!(k::attention_fwd(&x, &x, &x, &AttnCfg { docs: Some(&ok), ..AttnCfg::default() }).is_ok());
    let late = Tensor::from_vec(vec![0u32, 0, 3, 3], [b, t], &dev).unwrap();
    let e = fails(&late, AttnCfg::default());
    assert!(e.contains("document start 3 of position 2") && e.contains("at or before"), "{e}");
    // Starts that go back (the flash kernels skip key tiles by the first row's start).
    let back = Tensor::from_vec(vec![0u32, 1, 0, 3], [b, t], &dev).unwrap();
    let e = fails(&back, AttnCfg::default());
    assert!(e.contains("document start 0 of position 2") && e.contains("never decrease"), "{e}");
    let e = fails(&ok, AttnCfg { causal: false, ..AttnCfg::default() });
    assert!(e.contains("causal self-attention"), "{e}");
    let e = fails(&t32(&dev, &[0.0; 4], &[b, t]), AttnCfg::default());
    assert!(e.contains("must be u32"), "{e}");
    let e = fails(&Tensor::from_vec(vec![0u32; 3], [b, 3], &dev).unwrap(), AttnCfg::default());
    assert!(e.contains("attention_fwd"), "{e}");
}
