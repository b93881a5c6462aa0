//! Every op on CUDA against the CPU reference on the same fresh random inputs (feature `cuda`, run
//! on a GPU machine by `cargo xtask gpu-test`). Outputs are poisoned with NaN before each kernel.
//! Tolerances: f32 1e-5 relative, bf16 1e-2.
#![cfg(feature = "cuda")]

use crate::util::*;
use ferrotron_core::{DType, Device, Tensor};
use ferrotron_kernels::{self as k, AdamW, AttnCfg, CrossEntropyCfg, RopeCfg, RopeScaling};

fn gpu() -> Device {
    ferrotron_kernels::cuda::set_poisoning(true);
    Device::cuda(0).expect("a CUDA device")
}

fn rnd(shape: &[usize], seed: u64, dt: DType) -> Tensor {
    tensor(&Device::Cpu, &randv(shape.iter().product(), seed), shape, dt)
}

fn on(t: &Tensor, d: &Device) -> Tensor {
    t.to_device(d).unwrap()
}

fn tol(dt: DType) -> (f64, f64) {
    if dt == DType::F32 { (1e-5, 1e-5) } else { (1e-2, 2e-2) }
}

#[track_caller]
fn same(cpu: &Tensor, cuda: &Tensor, dt: DType, what: &str) {
    assert_eq!(cpu.dims(), cuda.dims(), "{what}: shape");
    let (r, a) = tol(dt);
    assert_close(&host(cuda), &host(cpu), r, a, what);
}

/// Runs `f` on CPU copies and on CUDA copies of `inputs`, comparing every output.
fn check(name: &str, dt: DType, inputs: &[Tensor], f: impl Fn(&[Tensor]) -> Vec<Tensor>) {
    check_by(name, dt, inputs, f, same)
}

/// `check` with bf16 outputs compared as whole tensors: ‖got − want‖ ≤ 1e-2 ‖want‖ (f32 as `same`).
/// For kernels that round intermediates to bf16 on purpose (the tensor-core attention backward
/// multiplies bf16 P and dS, as FlashAttention does): one element's error then scales with the
/// magnitudes summed, not with the element, while a wrong index or tile is still far off.
fn check_norm(name: &str, dt: DType, inputs: &[Tensor], f: impl Fn(&[Tensor]) -> Vec<Tensor>) {
    check_by(name, dt, inputs, f, same_in_norm)
}

/// `check_norm`'s comparison of one output.
#[track_caller]
fn same_in_norm(cpu: &Tensor, cuda: &Tensor, dt: DType, what: &str) {
    if dt == DType::F32 {
        return same(cpu, cuda, dt, what);
    }
    assert_eq!(cpu.dims(), cuda.dims(), "{what}: shape");
    let (want, got) = (host(cpu), host(cuda));
    assert!(got.iter().all(|x| x.is_finite()), "{what}: not finite");
    let err = want.iter().zip(&got).map(|(w, g)| (w - g) * (w - g)).sum::<f64>().sqrt();
    let norm = want.iter().map(|w| w * w).sum::<f64>().sqrt();
    assert!(err <= 1e-2 * norm, "{what}: ‖got − want‖ = {err:.3e} > 1e-2 × ‖want‖ = {norm:.3e}");
}

fn check_by(
    name: &str,
    dt: DType,
    inputs: &[Tensor],
    f: impl Fn(&[Tensor]) -> Vec<Tensor>,
    cmp: impl Fn(&Tensor, &Tensor, DType, &str),
) {
    let g = gpu();
    let cpu_out = f(inputs);
    let gpu_in: Vec<Tensor> = inputs.iter().map(|t| on(t, &g)).collect();
    let gpu_out = f(&gpu_in);
    for (i, (c, d)) in cpu_out.iter().zip(&gpu_out).enumerate() {
        assert!(matches!(d.device(), Device::Cuda(_)), "{name}: output {i} not on the GPU");
        cmp(c, d, dt, &format!("{name} [{dt}] output {i}"));
    }
}

#[test]
fn every_op_matches_cpu() {
    for dt in [DType::F32, DType::BF16] {
        let x = rnd(&[3, 5, 64], 1, dt);
        let y = rnd(&[3, 5, 64], 2, dt);
        let w = rnd(&[64], 3, dt);
        let b = rnd(&[64], 4, dt);
        check("add", dt, &[x.clone(), y.clone()], |t| vec![k::add(&t[0], &t[1]).unwrap()]);
        check("scale", dt, std::slice::from_ref(&x), |t| vec![k::scale(&t[0], -1.5).unwrap()]);
        check("bias", dt, &[x.clone(), b.clone()], |t| {
            vec![k::bias_add(&t[0], &t[1]).unwrap(), k::bias_grad(&t[0]).unwrap()]
        });
        check("cast", dt, std::slice::from_ref(&x), |t| {
            vec![k::cast(&t[0], DType::F32).unwrap(), k::cast(&t[0], DType::BF16).unwrap()]
        });
        check("gelu", dt, &[x.clone(), y.clone()], |t| {
            vec![k::gelu(&t[0]).unwrap(), k::gelu_bwd(&t[0], &t[1]).unwrap()]
        });
        check("silu", dt, &[x.clone(), y.clone()], |t| {
            vec![k::silu(&t[0]).unwrap(), k::silu_bwd(&t[0], &t[1]).unwrap()]
        });
        check("relu2", dt, &[x.clone(), y.clone()], |t| {
            vec![k::relu2(&t[0]).unwrap(), k::relu2_bwd(&t[0], &t[1]).unwrap()]
        });
        check("gelu_exact", dt, &[x.clone(), y.clone()], |t| {
            vec![k::gelu_exact(&t[0]).unwrap(), k::gelu_exact_bwd(&t[0], &t[1]).unwrap()]
        });
        check("quick_gelu", dt, &[x.clone(), y.clone()], |t| {
            vec![k::quick_gelu(&t[0]).unwrap(), k::quick_gelu_bwd(&t[0], &t[1]).unwrap()]
        });
        let half = rnd(&[3, 5, 32], 5, dt);
        check("swiglu", dt, &[x.clone(), half.clone()], |t| {
            vec![k::swiglu(&t[0]).unwrap(), k::swiglu_bwd(&t[0], &t[1]).unwrap()]
        });
        // gpt-oss's gated quick GeLU, its clamp holding some inputs (x is 64 wide: halves of 32,
        // eight a thread; and a width of 3, one a thread).
        check("quick_geglu", dt, &[x.clone(), half], |t| {
            vec![
                k::quick_geglu(&t[0], 1.0, Some(0.4)).unwrap(),
                k::quick_geglu_bwd(&t[0], &t[1], 1.0, Some(0.4)).unwrap(),
            ]
        });
        let (odd, odd_half) = (rnd(&[4, 6], 6, dt), rnd(&[4, 3], 7, dt));
        check("quick_geglu odd", dt, &[odd, odd_half], |t| {
            vec![k::quick_geglu(&t[0], -0.5, None).unwrap(), k::quick_geglu_bwd(&t[0], &t[1], -0.5, None).unwrap()]
        });
        // The same Philox words on both devices: the same mask (a shard's offset and a batch
        // stride larger than the rows held, as under sequence parallelism).
        let key =
            k::DropoutKey { seed: 11, stream: 0xfeed, base: (1 << 33) + 5, batch_stride: 1000, offset: 7, split: None };
        check("dropout", dt, std::slice::from_ref(&x), |t| vec![k::dropout(&t[0], 0.3, &key).unwrap()]);
        // Context parallelism's two chunks: from element 5 of each row on, words far along.
        let split = k::DropoutKey { split: Some(k::DropSplit { at: 5, offset: 600 }), ..key };
        check("dropout split", dt, std::slice::from_ref(&x), |t| vec![k::dropout(&t[0], 0.3, &split).unwrap()]);
        check("softmax", dt, &[x.clone(), y.clone()], |t| {
            let s = k::softmax(&t[0]).unwrap();
            vec![k::softmax_bwd(&s, &t[1]).unwrap(), s]
        });
        check("layernorm", dt, &[x.clone(), w.clone(), b.clone(), y.clone()], |t| {
            let (o, m, r) = k::layernorm_fwd(&t[0], &t[1], Some(&t[2]), 1e-5).unwrap();
            let (dx, dw, db) = k::layernorm_bwd(&t[3], &t[0], &t[1], &m, &r).unwrap();
            vec![o, m, r, dx, dw, db]
        });
        check("rmsnorm", dt, &[x.clone(), w.clone(), y.clone()], |t| {
            let (o, r) = k::rmsnorm_fwd(&t[0], &t[1], 1e-5).unwrap();
            let (dx, dw) = k::rmsnorm_bwd(&t[2], &t[0], &t[1], &r).unwrap();
            vec![o, r, dx, dw]
        });
        // 154 rows: the parameter gradients' column sums span several partial chunks, the last short.
        let (xl, dyl, wl, bl) =
            (rnd(&[2, 77, 48], 21, dt), rnd(&[2, 77, 48], 22, dt), rnd(&[48], 23, dt), rnd(&[48], 24, dt));
        check("column sums over chunks", dt, &[xl, dyl, wl, bl], |t| {
            let (_, m, r) = k::layernorm_fwd(&t[0], &t[2], Some(&t[3]), 1e-5).unwrap();
            let (_, dw, db) = k::layernorm_bwd(&t[1], &t[0], &t[2], &m, &r).unwrap();
            let (_, r2) = k::rmsnorm_fwd(&t[0], &t[2], 1e-5).unwrap();
            let (_, dw2) = k::rmsnorm_bwd(&t[1], &t[0], &t[2], &r2).unwrap();
            vec![k::bias_grad(&t[1]).unwrap(), dw, db, dw2]
        });
        let (a2, b2, c2) = (rnd(&[2, 33, 17], 6, dt), rnd(&[2, 17, 9], 7, dt), rnd(&[9, 17], 8, dt));
        // The bias as a view at element 0 and at element 1 (2 bytes off 16-byte alignment in bf16:
        // cuBLASLt's epilogue for the first, a separate add for the second).
        let bias10 = rnd(&[10], 20, dt);
        check("matmul", dt, &[a2.clone(), b2.clone(), c2.clone(), bias10], |t| {
            let p = k::matmul(&t[0], &t[1], false, false).unwrap();
            let lin = k::matmul(&t[0], &t[2], false, true).unwrap();
            let (da, db) = k::matmul_bwd(&t[0], &t[1], &p, false, false).unwrap();
            let (dl, dw) = k::matmul_bwd(&t[0], &t[2], &lin, false, true).unwrap();
            let tt = k::matmul(&t[1], &t[0], true, true).unwrap();
            let lin_b = k::matmul_bias(&t[0], &t[2], &t[3].view(0, [9]).unwrap(), false, true).unwrap();
            let lin_odd = k::matmul_bias(&t[0], &t[2], &t[3].view(1, [9]).unwrap(), false, true).unwrap();
            vec![p, lin, da, db, dl, dw, tt, lin_b, lin_odd]
        });
        let rope = |rot, base, pos0| RopeCfg { pos0, ..RopeCfg::new(rot, base) };
        // RoPE one pair per thread (a half of 6), then eight pairs per thread from the angle table
        // (halves of 32 and 24, the latter with 16 dims passed through), at long positions.
        let heads = rnd(&[2, 6, 4, 16], 9, dt);
        let heads64 = rnd(&[2, 9, 3, 64], 31, dt);
        for (x, rope) in [
            (&heads, rope(12, 10000.0, 3)),
            (&heads64, rope(64, 500000.0, 4000)),
            (&heads64, rope(48, 10000.0, 7)),
            // Llama 3.x's scaled frequencies (every band) on both kernels.
            (&heads, RopeCfg { scaling: Some(RopeScaling::llama3(32.0)), ..rope(12, 10000.0, 3) }),
            (&heads64, RopeCfg { scaling: Some(RopeScaling::llama3(8.0)), ..rope(64, 500000.0, 4000) }),
            // YaRN (DeepSeek-V3's numbers; Megatron's defaults, whose factor scales cos and sin)
            // on both kernels.
            (
                &heads64,
                RopeCfg {
                    yarn: Some(k::Yarn { mscale_all_dim: 1.0, ..k::Yarn::megatron(40.0) }),
                    ..rope(64, 10000.0, 4000)
                },
            ),
            (&heads, RopeCfg { yarn: Some(k::Yarn::megatron(40.0)), ..rope(12, 10000.0, 3) }),
            // Linear position interpolation (with Llama 3's scaling on the table kernel, with
            // context parallelism's split on the one-pair kernel).
            (
                &heads64,
                RopeCfg {
                    scaling: Some(RopeScaling::llama3(8.0)),
                    interpolation: Some(4.0),
                    ..rope(64, 500000.0, 4000)
                },
            ),
            (
                &heads,
                RopeCfg {
                    split: Some(k::RopeSplit { at: 3, pos: 40 }),
                    interpolation: Some(2.5),
                    ..rope(12, 10000.0, 3)
                },
            ),
            // Interleaved pairs on both kernels (with Llama 3's scaling on the table kernel).
            (&heads, RopeCfg { interleaved: true, ..rope(12, 10000.0, 3) }),
            (
                &heads64,
                RopeCfg { interleaved: true, scaling: Some(RopeScaling::llama3(8.0)), ..rope(48, 500000.0, 4000) },
            ),
            // Context parallelism's two chunks: rows from 3 (or 4) on restart far along.
            (&heads, RopeCfg { split: Some(k::RopeSplit { at: 3, pos: 40 }), ..rope(12, 10000.0, 3) }),
            (&heads64, RopeCfg { split: Some(k::RopeSplit { at: 4, pos: 9000 }), ..rope(64, 500000.0, 8) }),
        ] {
            check(&format!("rope {rope:?}"), dt, std::slice::from_ref(x), |t| {
                vec![k::rope_fwd(&t[0], &rope).unwrap(), k::rope_bwd(&t[0], &rope).unwrap()]
            });
        }
        // RoPE in place on fused QKV (3 groups of 2 query heads at head dim 64): query and key
        // heads rotate, value heads stay; eight-wide and, with a rotary dim of 36 (positions
        // interpolated), one pair a thread; rotate-half and interleaved.
        let qkv = rnd(&[2, 9, 3 * 4 * 64], 32, dt);
        for rope in [
            RopeCfg { scaling: Some(RopeScaling::llama3(8.0)), ..rope(64, 500000.0, 0) },
            RopeCfg { interpolation: Some(3.0), ..rope(36, 10000.0, 5) },
            RopeCfg { split: Some(k::RopeSplit { at: 5, pos: 700 }), ..rope(64, 10000.0, 5) },
            RopeCfg { interleaved: true, ..rope(64, 10000.0, 5) },
            RopeCfg { interleaved: true, ..rope(36, 10000.0, 5) },
        ] {
            check(&format!("rope_qkv {rope:?}"), dt, std::slice::from_ref(&qkv), |t| {
                let (f, b) = (t[0].deep_copy().unwrap(), t[0].deep_copy().unwrap());
                k::rope_qkv_fwd_(&f, 3, 2, 64, &rope).unwrap();
                k::rope_qkv_bwd_(&b, 3, 2, 64, &rope).unwrap();
                vec![f, b]
            });
        }
        let (q, kk, v, dout) = (
            rnd(&[2, 7, 4, 16], 10, dt),
            rnd(&[2, 7, 2, 16], 11, dt),
            rnd(&[2, 7, 2, 16], 12, dt),
            rnd(&[2, 7, 4, 16], 13, dt),
        );
        // The reference kernels (head dim 16): dk/dv by atomics, and in deterministic mode by
        // `attn_bwd_kv`'s ordered sums.
        for det in [false, true] {
            ferrotron_kernels::cuda::set_deterministic(det);
            for cfg in
                [AttnCfg::default(), AttnCfg { causal: true, window: Some(3), scale: None, dropout: None, docs: None }]
            {
                check(
                    &format!("attention deterministic {det}"),
                    dt,
                    &[q.clone(), kk.clone(), v.clone(), dout.clone()],
                    |t| attention_fwd_bwd(t, &cfg),
                );
            }
        }
        ferrotron_kernels::cuda::set_deterministic(false);
        // Head dims with a flash kernel: sequence lengths across several 32- and 64-row tiles and
        // ragged ends, GQA, causal, windowed and full (bf16 at 64/128 runs the tensor-core kernels).
        // 2100 rows at head dim 64: the forward with two m-tiles per warp (from 2048 rows on),
        // 128-row blocks with a ragged last one; 2060 at 128: several key tiles per block and a
        // ragged last block in the warp-specialised forward (128-row blocks) on sm_90. Head dim 192
        // (multi-latent attention; bf16 on the mma.sync kernels in every mode, f32 on the
        // reference kernels): one ragged block, and GQA over several key tiles.
        let shapes = [
            (45usize, 4usize, 2usize, 32usize),
            (70, 2, 2, 64),
            (33, 4, 1, 128),
            (130, 4, 2, 64),
            (150, 2, 1, 128),
            (2100, 2, 1, 64),
            (2060, 2, 1, 128),
            (70, 2, 1, 192),
            (150, 4, 2, 192),
        ];
        // bf16 on an sm_90 GPU: the wgmma kernels with warpgroups in lockstep (the backward's dQ
        // by bulk reductions, then, deterministic, by its own kernel), the warp-specialised
        // forward and backward (its forward's K/V copied by TMA, then by cp.async), then the
        // mma.sync ones (wgmma off).
        let modes = [
            (true, false, false, true),
            (true, true, false, true),
            (true, false, true, true),
            (true, false, true, false),
            (false, false, false, true),
        ];
        for ((wg, det, ws, tma), (t, hq, hkv, d)) in modes.into_iter().flat_map(|m| shapes.map(|s| (m, s))) {
            if dt == DType::F32 && (!wg || det || ws) {
                continue; // the same f32 kernels either way
            }
            ferrotron_kernels::cuda::set_wgmma(wg);
            ferrotron_kernels::cuda::set_deterministic(det);
            ferrotron_kernels::cuda::set_flash_ws(ws);
            ferrotron_kernels::cuda::set_flash_tma(tma);
            if dt == DType::F32 && t > 100 {
                // The long shapes are for the bf16 tensor-core kernels; f32 sums over 150 rows
                // drift past the 1e-5 f32 tolerance by accumulation order alone.
                continue;
            }
            let (q, kk, v, dout) = (
                rnd(&[2, t, hq, d], 20, dt),
                rnd(&[2, t, hkv, d], 21, dt),
                rnd(&[2, t, hkv, d], 22, dt),
                rnd(&[2, t, hq, d], 23, dt),
            );
            for cfg in [
                AttnCfg::default(),
                AttnCfg { causal: true, window: None, scale: None, dropout: None, docs: None },
                AttnCfg { causal: true, window: Some(9), scale: None, dropout: None, docs: None },
                AttnCfg { causal: false, window: Some(40), scale: Some(0.3), dropout: None, docs: None },
                // A vision encoder's: every query sees every key.
                AttnCfg { causal: false, window: None, scale: None, dropout: None, docs: None },
            ] {
                check_norm(
                    &format!("flash attention t{t} d{d} wgmma {wg} deterministic {det} ws {ws} tma {tma} {cfg:?}"),
                    dt,
                    &[q.clone(), kk.clone(), v.clone(), dout.clone()],
                    |t| attention_fwd_bwd(t, &cfg),
                );
            }
            // Q, K, V read in place from the fused projection output, dQ, dK, dV written into the
            // slots of its gradient (bf16 at 64/128; every other case splits first). Every slot
            // of dQKV must be written (outputs are poisoned).
            let g = hq / hkv;
            let qkv = rnd(&[2, t, hkv * (g + 2) * d], 24, dt);
            let cfg = AttnCfg::default();
            check_norm(
                &format!(
                    "flash attention fused qkv t{t} d{d} hq{hq} hkv{hkv} wgmma {wg} deterministic {det} ws {ws} tma {tma}"
                ),
                dt,
                &[qkv, dout.clone()],
                |t| attention_qkv_fwd_bwd(t, k::QkvHeads::new(hkv, g, d), &cfg),
            );
        }
        ferrotron_kernels::cuda::set_wgmma(true);
        ferrotron_kernels::cuda::set_flash_ws(true);
        ferrotron_kernels::cuda::set_flash_tma(true);
        if dt == DType::BF16 {
            // The warp-specialised forward persistent (one block per SM walking the query tiles:
            // 512 tiles here, so every block takes several, in both directions of its walk) and
            // not, causal and full, GQA; at head dim 128 (320 tiles) the static walk is built only
            // one block per tile, so both of those choices run that kernel. Then the dynamic walk
            // (tiles from the device's counter, which each launch must leave at zero for the next:
            // every case here launches several in a row), forward and backward, with the heads in
            // groups of 3 (the last group of 64 query heads, or of 16 K/V heads, smaller) and in the
            // default groups (one here).
            for (t, hq, hkv, d) in [(1000usize, 32usize, 8usize, 64usize), (520, 32, 8, 128)] {
                let x: Vec<Tensor> = [hq, hkv, hkv, hq]
                    .iter()
                    .enumerate()
                    .map(|(i, h)| rnd(&[2, t, *h, d], 40 + i as u64, dt))
                    .collect();
                let modes = [(true, false, None), (false, false, None), (true, true, Some(3)), (true, true, None)];
                for (persist, dynamic, groups) in modes {
                    ferrotron_kernels::cuda::set_flash_persist(persist);
                    ferrotron_kernels::cuda::set_flash_dyn(dynamic);
                    ferrotron_kernels::cuda::set_flash_bwd_dyn(dynamic);
                    ferrotron_kernels::cuda::set_flash_group_heads(groups);
                    for causal in [true, false] {
                        let cfg = AttnCfg { causal, window: None, scale: None, dropout: None, docs: None };
                        let name = format!(
                            "flash attention t{t} d{d} persistent {persist} dynamic {dynamic} groups {groups:?} {cfg:?}"
                        );
                        check_norm(&name, dt, &x, |t| attention_fwd_bwd(t, &cfg));
                    }
                }
            }
            ferrotron_kernels::cuda::set_flash_persist(true);
            ferrotron_kernels::cuda::set_flash_dyn(true);
            ferrotron_kernels::cuda::set_flash_bwd_dyn(true);
            ferrotron_kernels::cuda::set_flash_group_heads(None);
            // The head dim 64 forward with three consumer warpgroups (192-row tiles; under a
            // causal mask laid from the last row back, so the first tile starts before row 0):
            // fewer rows than one tile, a ragged first tile with GQA, several heads' groups, a
            // window, and Q, K, V read in place from the fused projection output.
            ferrotron_kernels::cuda::set_flash_fwd_consumers(Some(3));
            for (t, hq, hkv) in [(70usize, 2usize, 2usize), (1000, 32, 8), (2100, 2, 1)] {
                let x: Vec<Tensor> =
                    [hq, hkv, hkv, hq].iter().zip(50..).map(|(&h, seed)| rnd(&[2, t, h, 64], seed, dt)).collect();
                for cfg in [
                    AttnCfg::default(),
                    AttnCfg { causal: true, window: None, scale: None, dropout: None, docs: None },
                    AttnCfg { causal: true, window: Some(9), scale: None, dropout: None, docs: None },
                    AttnCfg { causal: false, window: Some(40), scale: Some(0.3), dropout: None, docs: None },
                ] {
                    check_norm(&format!("flash attention t{t} d64 three consumers {cfg:?}"), dt, &x, |t| {
                        attention_fwd_bwd(t, &cfg)
                    });
                }
            }
            let (hkv, g) = (2, 2);
            let qkv = rnd(&[2, 400, hkv * (g + 2) * 64], 60, dt);
            let cfg = AttnCfg { causal: true, window: None, scale: None, dropout: None, docs: None };
            check_norm(
                "flash attention fused qkv d64 three consumers",
                dt,
                &[qkv, rnd(&[2, 400, hkv * g, 64], 61, dt)],
                |t| attention_qkv_fwd_bwd(t, k::QkvHeads::new(hkv, g, 64), &cfg),
            );
            ferrotron_kernels::cuda::set_flash_fwd_consumers(None);
        }
        if dt == DType::BF16 {
            // Deterministic mode: the backward twice on the GPU gives the same bits, at head dim
            // 128 and 192 (flash) and 48 (the reference kernels; GQA, many query rows per key row).
            ferrotron_kernels::cuda::set_deterministic(true);
            let g = gpu();
            for (hq, hkv, d) in [(2, 2, 128), (4, 2, 192), (4, 2, 48)] {
                let shape = |h: usize| [2, 300, h, d];
                let x: Vec<Tensor> =
                    [hq, hkv, hkv, hq].iter().zip(30..).map(|(&h, seed)| on(&rnd(&shape(h), seed, dt), &g)).collect();
                let cfg = AttnCfg { causal: true, window: None, scale: None, dropout: None, docs: None };
                let (o, lse) = k::attention_fwd(&x[0], &x[1], &x[2], &cfg).unwrap();
                let run = || k::attention_bwd(&x[0], &x[1], &x[2], &o, &lse, &x[3], &cfg).unwrap();
                let (a, b) = (run(), run());
                for (u, w) in [(&a.0, &b.0), (&a.1, &b.1), (&a.2, &b.2)] {
                    assert_eq!(
                        host(u),
                        host(w),
                        "deterministic attention backward (head dim {d}) differs between two runs"
                    );
                }
            }
        }
        ferrotron_kernels::cuda::set_deterministic(false);
        if dt == DType::BF16 {
            // The QKV bias gradient summed by the flash backward's own kernels (the default;
            // `set_flash_bias_grad(false)` sums the written dQKV instead): the same bits as bias_grad_into over the dQKV it wrote,
            // stored (acc false) and added; against the CPU within bf16 tolerance. T 192 at head
            // dim 128 leaves the last 128-key block half empty (its second consumer has no
            // chunk); T 130 is not whole chunks (the backward does not sum, bias_grad_into does).
            let g = gpu();
            // The first two again with both dynamic walks (the backward's partials per tile taken).
            for (t, hq, hkv, d, tma, dynamic) in [
                (128usize, 4usize, 2usize, 64usize, true, false),
                (192, 2, 1, 128, true, false),
                (256, 4, 1, 64, false, false),
                (130, 2, 1, 64, true, false),
                (128, 4, 2, 64, true, true),
                (192, 2, 1, 128, true, true),
            ] {
                ferrotron_kernels::cuda::set_flash_tma(tma);
                ferrotron_kernels::cuda::set_flash_dyn(dynamic);
                ferrotron_kernels::cuda::set_flash_bwd_dyn(dynamic);
                let (gq, w) = (hq / hkv, hkv * (hq / hkv + 2) * d);
                let (qkv, dout) = (rnd(&[2, t, w], 50, dt), rnd(&[2, t, hq, d], 51, dt));
                // The bias gradient's destination: an f32 main_grad view, or a bf16 one
                // (`--grad-reduce-in-bf16`).
                for (causal, acc, gdt) in
                    [(true, true, DType::F32), (false, false, DType::F32), (true, true, DType::BF16)]
                {
                    let start = || rnd(&[w], 52, gdt);
                    let cfg = AttnCfg { causal, window: None, scale: None, dropout: None, docs: None };
                    let what = format!(
                        "flash bias grad t{t} d{d} hq{hq} hkv{hkv} tma {tma} dynamic {dynamic} causal {causal} acc {acc} into {gdt}"
                    );
                    let (qc, dc) = (on(&qkv, &g), on(&dout, &g));
                    let (o, lse) = k::attention_fwd_qkv(&qc, k::QkvHeads::new(hkv, gq, d), &cfg).unwrap();
                    ferrotron_kernels::cuda::set_flash_bias_grad(true);
                    let db = on(&start(), &g);
                    let runs = ferrotron_kernels::cuda::flash_bias_grad_runs();
                    let dqkv =
                        k::attention_bwd_qkv_into(&qc, &o, &lse, &dc, k::QkvHeads::new(hkv, gq, d), &cfg, &db, acc)
                            .unwrap();
                    let fused = ferrotron_kernels::cuda::flash_bias_grad_runs() > runs;
                    assert_eq!(fused, t % 64 == 0, "{what}: the kernels summed the bias (whole chunks only)");
                    ferrotron_kernels::cuda::set_flash_bias_grad(false);
                    let want = on(&start(), &g);
                    k::bias_grad_into(&want, &dqkv, acc).unwrap();
                    let bits = |t: &Tensor| t.to_vec_f32().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&db), bits(&want), "{what}: fused sums against bias_grad_into");
                    let (oc, lc) = k::attention_fwd_qkv(&qkv, k::QkvHeads::new(hkv, gq, d), &cfg).unwrap();
                    let cpu_db = start();
                    let cpu_dqkv = k::attention_bwd_qkv_into(
                        &qkv,
                        &oc,
                        &lc,
                        &dout,
                        k::QkvHeads::new(hkv, gq, d),
                        &cfg,
                        &cpu_db,
                        acc,
                    )
                    .unwrap();
                    same_in_norm(&cpu_dqkv, &dqkv, dt, &format!("{what}: dqkv"));
                    same_in_norm(&cpu_db, &db, dt, &format!("{what}: bias gradient"));
                }
            }
            ferrotron_kernels::cuda::set_flash_tma(true);
            ferrotron_kernels::cuda::set_flash_dyn(true);
            ferrotron_kernels::cuda::set_flash_bwd_dyn(true);
            ferrotron_kernels::cuda::set_flash_bias_grad(true);
        }
        // Head dim 8: eight per thread; head dim 6: a warp per segment.
        for d in [8, 6] {
            let fused = rnd(&[2, 3, 2 * 4 * d], 14, dt);
            check(&format!("qkv d{d}"), dt, &[fused], |t| {
                let (q, k2, v) = k::qkv_split(&t[0], 2, 2, d).unwrap();
                vec![k::qkv_merge(&q, &k2, &v).unwrap(), q, k2, v]
            });
        }
        let logits = rnd(&[6, 300], 15, dt);
        let targets = Tensor::from_vec(vec![0u32, 299, 5, 17, 17, 100], [6], &Device::Cpu).unwrap();
        let mask = rnd(&[6], 16, DType::F32);
        let dl = rnd(&[6], 17, DType::F32);
        let cfg = CrossEntropyCfg { ignore_index: Some(5), ..Default::default() };
        check("cross_entropy", dt, &[logits, targets, mask, dl], |t| {
            let (l, lse) = k::cross_entropy_fwd(&t[0], &t[1], Some(&t[2]), cfg).unwrap();
            let d = k::cross_entropy_bwd(&t[0], &t[1], Some(&t[2]), &lse, &t[3], cfg).unwrap();
            vec![l, lse, d]
        });
        // 296 columns (8 | 296: the eight-wide kernels), a vocabulary shard from column 100 with
        // padding from column 390 of the whole (the shard's last 6 columns): targets below,
        // inside and past the shard.
        let logits = rnd(&[6, 296], 25, dt);
        let targets = Tensor::from_vec(vec![3u32, 100, 250, 389, 5, 200], [6], &Device::Cpu).unwrap();
        let (mask, dl) = (rnd(&[6], 26, DType::F32), rnd(&[6], 27, DType::F32));
        let cfg = CrossEntropyCfg { ignore_index: Some(5), vocab_start: 100, vocab_total: Some(390) };
        check("cross_entropy eight-wide shard", dt, &[logits, targets, mask, dl], |t| {
            let (l, lse) = k::cross_entropy_fwd(&t[0], &t[1], Some(&t[2]), cfg).unwrap();
            let d = k::cross_entropy_bwd(&t[0], &t[1], Some(&t[2]), &lse, &t[3], cfg).unwrap();
            vec![l, lse, d]
        });
        // Forward and backward in one pass, over the logits (one element a thread, then eight).
        for (v, total) in [(300usize, None), (296, Some(290u32))] {
            let logits = rnd(&[6, v], 28, dt);
            let targets = Tensor::from_vec(vec![0u32, 289, 5, 17, 17, 100], [6], &Device::Cpu).unwrap();
            let cfg = CrossEntropyCfg { ignore_index: Some(5), vocab_start: 0, vocab_total: total };
            check(&format!("cross_entropy_fwd_bwd_ {v}"), dt, &[logits, targets, rnd(&[6], 29, DType::F32)], |t| {
                let x = t[0].deep_copy().unwrap();
                let (l, lse) =
                    k::cross_entropy_fwd_bwd_(&x, &t[1], Some(&t[2]), cfg, k::RowScale::Value(0.25)).unwrap();
                vec![l, lse, x]
            });
        }
        let ids = Tensor::from_vec(vec![3u32, 0, 3, 9, 1], [5], &Device::Cpu).unwrap();
        let table = rnd(&[10, 24], 18, dt);
        let dout = rnd(&[5, 24], 19, dt);
        check("embedding", dt, &[ids, table, dout], |t| {
            let out = k::embedding_fwd(&t[0], &t[1]).unwrap();
            let g = Tensor::zeros([10, 24], DType::F32, t[1].device()).unwrap();
            k::embedding_bwd(&t[0], &t[2], &g).unwrap();
            vec![out, g]
        });
        // Rows of 24 take the eight-wide forward, rows of 20 the one-element one; a vocabulary
        // shard [4, 8) leaves the ids outside it as zero rows.
        for c in [24, 20] {
            let ids = Tensor::from_vec(vec![3u32, 0, 5, 9, 7, 4], [6], &Device::Cpu).unwrap();
            let table = rnd(&[4, c], 20, dt);
            check(&format!("embedding shard c{c}"), dt, &[ids, table], |t| {
                vec![k::embedding_fwd_shard(&t[0], &t[1], 4, 10).unwrap()]
            });
        }
    }
}

/// Attention forward then backward on (q, k, v, dout): o, lse, dq, dk, dv.
fn attention_fwd_bwd(t: &[Tensor], cfg: &AttnCfg) -> Vec<Tensor> {
    let (o, lse) = k::attention_fwd(&t[0], &t[1], &t[2], cfg).unwrap();
    let (dq, dk, dv) = k::attention_bwd(&t[0], &t[1], &t[2], &o, &lse, &t[3], cfg).unwrap();
    vec![o, lse, dq, dk, dv]
}

/// The same reading Q, K, V in place from the fused projection output (qkv, dout): o, lse, dQKV.
fn attention_qkv_fwd_bwd(t: &[Tensor], heads: k::QkvHeads, cfg: &AttnCfg) -> Vec<Tensor> {
    let (o, lse) = k::attention_fwd_qkv(&t[0], heads, cfg).unwrap();
    let dqkv = k::attention_bwd_qkv(&t[0], &o, &lse, &t[1], heads, cfg).unwrap();
    vec![o, lse, dqkv]
}

/// Attention dropout on every GPU path against the CPU's mask: the reference kernels (head dims
/// 16 and 48, atomics and deterministic), the SIMT flash kernels (f32, and head dim 32), and the
/// tensor-core `_drop` builds at head dims 64 and 128 (bf16): the warp-specialised forward and
/// backward, wgmma in lockstep with the fused dK/dV/dQ, the mma.sync pair in deterministic mode,
/// mma.sync alone with wgmma off; at head dim 192 the mma.sync builds in every mode; ragged ends, GQA, causal,
/// windowed and full masks, a nonzero micro-batch base and head offset (a tensor-parallel rank),
/// and the fused-QKV entry points. The CPU kernel is checked against a naive reference with the
/// documented mask (tests/ops/attention.rs).
#[test]
fn attention_dropout_matches_cpu() {
    let key = |hq: usize, t: usize| {
        let batch_stride = k::AttnDropout::blocks_per_sample(hq + 1, t, t);
        Some(k::AttnDropout {
            p: 0.2,
            seed: 77,
            stream: 5,
            base: 3 * batch_stride,
            batch_stride,
            head_offset: 1,
            tiles: None,
        })
    };
    let shapes = [
        (7usize, 4usize, 2usize, 16usize),
        (40, 2, 1, 48),
        (45, 4, 2, 32),
        (70, 2, 2, 64),
        (130, 4, 2, 64),
        (33, 4, 1, 128),
        (150, 2, 1, 128),
        (150, 4, 2, 192),
    ];
    // (wgmma, deterministic, warp-specialised)
    let modes = [(true, false, true), (true, false, false), (true, true, true), (false, false, false)];
    for dt in [DType::F32, DType::BF16] {
        for ((wg, det, ws), (t, hq, hkv, d)) in modes.into_iter().flat_map(|m| shapes.map(|s| (m, s))) {
            if dt == DType::F32 && (t > 100 || !wg || !ws) {
                continue; // f32 runs the same kernels either way; long f32 sums drift past 1e-5
            }
            ferrotron_kernels::cuda::set_wgmma(wg);
            ferrotron_kernels::cuda::set_deterministic(det);
            ferrotron_kernels::cuda::set_flash_ws(ws);
            let x: Vec<Tensor> =
                [hq, hkv, hkv, hq].iter().zip(70..).map(|(&h, seed)| rnd(&[2, t, h, d], seed, dt)).collect();
            for (causal, window) in [(true, None), (true, Some(9)), (false, None)] {
                let cfg = AttnCfg { causal, window, scale: None, dropout: key(hq, t), docs: None };
                let name = format!(
                    "attention dropout t{t} d{d} hq{hq} hkv{hkv} wgmma {wg} deterministic {det} ws {ws} {cfg:?}"
                );
                check_norm(&name, dt, &x, |t| attention_fwd_bwd(t, &cfg));
            }
            let g = hq / hkv;
            let qkv = rnd(&[2, t, hkv * (g + 2) * d], 79, dt);
            let cfg = AttnCfg { dropout: key(hq, t), ..AttnCfg::default() };
            check_norm(
                &format!("attention dropout fused qkv t{t} d{d} wgmma {wg} det {det} ws {ws}"),
                dt,
                &[qkv, x[3].clone()],
                |t| attention_qkv_fwd_bwd(t, k::QkvHeads::new(hkv, g, d), &cfg),
            );
        }
    }
    ferrotron_kernels::cuda::set_wgmma(true);
    ferrotron_kernels::cuda::set_deterministic(false);
    ferrotron_kernels::cuda::set_flash_ws(true);
}

/// Document-wise masks (--reset-attention-mask) on the GPU against the CPU's: f32 on the
/// reference kernels (atomics and deterministic), bf16 on the tensor-core kernels; dropout; a
/// window; the fused-QKV entry points; head dims 64 and 128, short rows (one key tile).
#[test]
fn attention_document_masks_match_cpu() {
    let docs_of = |b: usize, t: usize| -> Tensor {
        // Row r cut every 7 + 4r positions.
        let v: Vec<u32> = (0..b).flat_map(|r| (0..t).map(move |i| (i - i % (7 + 4 * r)) as u32)).collect();
        Tensor::from_vec(v, [b, t], &Device::Cpu).unwrap()
    };
    for dt in [DType::F32, DType::BF16] {
        for det in [false, true] {
            ferrotron_kernels::cuda::set_deterministic(det);
            for (t, hq, hkv, d) in [(40usize, 4usize, 2usize, 64usize), (33, 2, 1, 128)] {
                let mut x: Vec<Tensor> =
                    [hq, hkv, hkv, hq].iter().zip(90..).map(|(&h, seed)| rnd(&[2, t, h, d], seed, dt)).collect();
                x.push(docs_of(2, t));
                let batch_stride = k::AttnDropout::blocks_per_sample(hq, t, t);
                let drop =
                    k::AttnDropout { p: 0.2, seed: 5, stream: 1, base: 0, batch_stride, head_offset: 0, tiles: None };
                for (window, dropout) in [(None, None), (Some(5), None), (None, Some(drop))] {
                    let name =
                        format!("document masks t{t} d{d} det {det} window {window:?} dropout {}", dropout.is_some());
                    check_norm(&name, dt, &x, |t| {
                        let cfg = AttnCfg { window, dropout, docs: Some(&t[4]), ..AttnCfg::default() };
                        attention_fwd_bwd(t, &cfg)
                    });
                }
                let g = hq / hkv;
                let qkv = rnd(&[2, t, hkv * (g + 2) * d], 99, dt);
                check_norm(
                    &format!("document masks fused qkv t{t} d{d} det {det}"),
                    dt,
                    &[qkv, x[3].clone(), x[4].clone()],
                    |t| {
                        let cfg = AttnCfg { docs: Some(&t[2]), ..AttnCfg::default() };
                        attention_qkv_fwd_bwd(t, k::QkvHeads::new(hkv, g, d), &cfg)
                    },
                );
            }
        }
    }
    ferrotron_kernels::cuda::set_deterministic(false);
}

/// Document masks on the tensor-core kernels (bf16; the warp-specialised forward, wgmma in lockstep
/// and mma.sync; head dims 64,
/// 128 and 192; GQA; with a window, with dropout; the fused-QKV entry points) against the CPU,
/// compared document by document (‖got − want‖ ≤ 2e-2 ‖want‖ over each document's rows of o, dQ,
/// dK, dV, and lse elementwise): documents of one token, documents crossing the kernels' 64-row
/// and 64-key tiles, starting on a tile boundary, and a row that is one document. A packed row of
/// 12,800 tokens passes too, which the reference kernels refuse (one score row in 48 KiB of
/// shared memory): those calls ran on the tensor-core kernels.
#[test]
fn attention_document_masks_on_tensor_cores_match_cpu_per_document() {
    // Row 0 cut at `cuts` (1, 2: one-token documents; 128, 192: on tile boundaries) and, past
    // 1000 tokens, every 997 from 300 on (the CPU's work stays small); row 1 every `every`
    // positions (or not at all).
    let starts = |t: usize, cuts: &[usize], every: Option<usize>| -> Vec<Vec<usize>> {
        let far = if t > 1000 { (300..t).step_by(997).collect() } else { vec![] };
        let row0 = [0].into_iter().chain(cuts.iter().copied().filter(|&c| c < t)).chain(far).collect();
        let row1 = match every {
            Some(e) => (0..t).step_by(e).collect(),
            None => vec![0],
        };
        vec![row0, row1]
    };
    let docs_of = |st: &[Vec<usize>], t: usize| -> Tensor {
        let v: Vec<u32> =
            st.iter().flat_map(|s| (0..t).map(move |i| *s.iter().rfind(|&&x| x <= i).unwrap() as u32)).collect();
        Tensor::from_vec(v, [st.len(), t], &Device::Cpu).unwrap()
    };
    let cuts = [1usize, 2, 70, 128, 133, 134, 192, 255];
    let dt = DType::BF16;
    let g = gpu();
    // Each document's rows [s, e) of batch row `row` in x [B, T, ...], compared in norm.
    let per_doc = |name: &str, cpu: &Tensor, cuda: &Tensor, st: &[Vec<usize>]| {
        assert_eq!(cpu.dims(), cuda.dims(), "{name}: shape");
        let (want, got) = (host(cpu), host(cuda));
        let t = cpu.dims()[1];
        let w = cpu.elem_count() / (cpu.dims()[0] * t);
        for (row, s) in st.iter().enumerate() {
            let ends: Vec<usize> = s[1..].iter().copied().chain([t]).collect();
            for (&a, &e) in s.iter().zip(&ends) {
                let r = (row * t + a) * w..(row * t + e) * w;
                let (wv, gv) = (&want[r.clone()], &got[r]);
                assert!(gv.iter().all(|x| x.is_finite()), "{name}: not finite in row {row}'s document [{a}, {e})");
                let err = wv.iter().zip(gv).map(|(x, y)| (x - y) * (x - y)).sum::<f64>().sqrt();
                let norm = wv.iter().map(|x| x * x).sum::<f64>().sqrt();
                // (A one-token document's dK is zero but for rounding: P = 1, dS = dP − delta.)
                assert!(
                    err <= 2e-2 * norm + 1e-5 * (wv.len() as f64).sqrt(),
                    "{name}: row {row}'s document [{a}, {e}): ‖got − want‖ = {err:.3e}, ‖want‖ = {norm:.3e}"
                );
            }
        }
    };
    let cases = [
        (300usize, 4usize, 2usize, 64usize, Some(37usize)),
        (256, 2, 1, 128, None),
        (200, 4, 2, 192, Some(64)),
        (12_800, 2, 1, 64, Some(701)),
    ];
    for (t, hq, hkv, d, every) in cases {
        let st = starts(t, &cuts, every);
        let docs = docs_of(&st, t);
        let x: Vec<Tensor> =
            [hq, hkv, hkv, hq].iter().zip(110..).map(|(&h, seed)| rnd(&[2, t, h, d], seed, dt)).collect();
        let batch_stride = k::AttnDropout::blocks_per_sample(hq, t, t);
        let drop = k::AttnDropout { p: 0.2, seed: 9, stream: 2, base: 0, batch_stride, head_offset: 0, tiles: None };
        let long = t > 1000;
        for (wg, ws) in [(true, true), (true, false), (false, false)] {
            ferrotron_kernels::cuda::set_wgmma(wg);
            ferrotron_kernels::cuda::set_flash_ws(ws);
            let variants: &[(Option<usize>, Option<k::AttnDropout>)] =
                if long { &[(None, None)] } else { &[(None, None), (Some(100), None), (None, Some(drop))] };
            for &(window, dropout) in variants {
                let name = format!(
                    "document masks t{t} d{d} hq{hq} hkv{hkv} wgmma {wg} ws {ws} window {window:?} dropout {}",
                    dropout.is_some()
                );
                let run = |x: &[Tensor], docs: &Tensor| {
                    attention_fwd_bwd(x, &AttnCfg { window, dropout, docs: Some(docs), ..AttnCfg::default() })
                };
                let want = run(&x, &docs);
                let gx: Vec<Tensor> = x.iter().map(|t| on(t, &g)).collect();
                let got = run(&gx, &on(&docs, &g));
                for (i, what) in [(0, "o"), (2, "dq"), (3, "dk"), (4, "dv")] {
                    per_doc(&format!("{name}: {what}"), &want[i], &got[i], &st);
                }
                same(&want[1], &got[1], dt, &format!("{name}: lse"));
            }
            if long {
                continue;
            }
            let gr = hq / hkv;
            let qkv = rnd(&[2, t, hkv * (gr + 2) * d], 119, dt);
            let heads = k::QkvHeads::new(hkv, gr, d);
            let cfg_of = |docs| AttnCfg { docs: Some(docs), ..AttnCfg::default() };
            let want = attention_qkv_fwd_bwd(&[qkv.clone(), x[3].clone()], heads, &cfg_of(&docs));
            let gd = on(&docs, &g);
            let got = attention_qkv_fwd_bwd(&[on(&qkv, &g), on(&x[3], &g)], heads, &cfg_of(&gd));
            let name = format!("document masks fused qkv t{t} d{d} wgmma {wg} ws {ws}");
            per_doc(&format!("{name}: o"), &want[0], &got[0], &st);
            per_doc(&format!("{name}: dqkv"), &want[2], &got[2], &st);
            // The QKV bias gradient summed by the backward's own kernels (the warp-specialised
            // build at T % 64 == 0) has the bits of Σ rows of the dQKV they wrote.
            let (gq, go, glse, gdo) = (on(&qkv, &g), &got[0], &got[1], on(&x[3], &g));
            let zeros = || Tensor::zeros([qkv.shape().last()], DType::F32, &g).unwrap();
            let (db, want) = (zeros(), zeros());
            let runs = ferrotron_kernels::cuda::flash_bias_grad_runs();
            let dqkv = k::attention_bwd_qkv_into(&gq, go, glse, &gdo, heads, &cfg_of(&gd), &db, false).unwrap();
            let fused = ferrotron_kernels::cuda::flash_bias_grad_runs() > runs;
            assert_eq!(fused, wg && ws && t % 64 == 0 && d != 192, "{name}: the kernels summed the bias");
            k::bias_grad_into(&want, &dqkv, false).unwrap();
            let bits = |t: &Tensor| t.to_vec_f32().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&db), bits(&want), "{name}: the bias gradient against bias_grad_into");
        }
    }
    ferrotron_kernels::cuda::set_wgmma(true);
    ferrotron_kernels::cuda::set_flash_ws(true);
}

/// The elementwise ops on `x`, `y` (same shape) and `b` (one row): everything with an eight-wide
/// kernel and a one-element twin.
fn elementwise_ops(x: &Tensor, y: &Tensor, b: &Tensor) -> Vec<Tensor> {
    let acc = k::cast(y, DType::F32).unwrap();
    k::add_(&acc, x).unwrap();
    let half = y.view(0, [y.elem_count() / 2]).unwrap();
    let gate = x.view(0, [x.elem_count() / 2, 2]).unwrap();
    // The attention output gate x·σ(y), its backward from dy = −0.7·x.
    let (gate_dx, gate_dg) = k::sigmoid_gate_bwd(x, y, &k::scale(x, -0.7).unwrap()).unwrap();
    vec![
        k::add(x, y).unwrap(),
        k::scale(x, -1.5).unwrap(),
        k::bias_add(x, b).unwrap(),
        k::cast(x, DType::BF16).unwrap(),
        acc,
        k::gelu(x).unwrap(),
        k::gelu_bwd(x, y).unwrap(),
        k::silu(x).unwrap(),
        k::silu_bwd(x, y).unwrap(),
        k::relu2(x).unwrap(),
        k::relu2_bwd(x, y).unwrap(),
        k::gelu_exact(x).unwrap(),
        k::gelu_exact_bwd(x, y).unwrap(),
        k::quick_gelu(x).unwrap(),
        k::quick_gelu_bwd(x, y).unwrap(),
        k::sigmoid_gate(x, y).unwrap(),
        gate_dx,
        gate_dg,
        k::swiglu(&gate).unwrap(),
        k::swiglu_bwd(&gate, &half.reshape([x.elem_count() / 2, 1]).unwrap()).unwrap(),
    ]
}

#[test]
fn elementwise_kernels_take_both_paths() {
    for dt in [DType::F32, DType::BF16] {
        // 8 | count, 16-byte aligned: the eight-wide kernels (SwiGLU over rows of 2 × 8).
        let (x, y, b) = (rnd(&[4, 32], 1, dt), rnd(&[4, 32], 2, dt), rnd(&[32], 3, dt));
        check("elementwise, eight-wide", dt, &[x, y, b], |t| {
            let gate = t[0].reshape([8, 16]).unwrap();
            let mut out = elementwise_ops(&t[0], &t[1], &t[2]);
            let dy = t[1].view(0, [8, 8]).unwrap();
            out.extend([k::swiglu(&gate).unwrap(), k::swiglu_bwd(&gate, &dy).unwrap()]);
            out
        });
        // A count of 3·7 and rows of 7: the one-element kernels.
        let (x, y, b) = (rnd(&[3, 7], 4, dt), rnd(&[3, 7], 5, dt), rnd(&[7], 6, dt));
        check("elementwise, odd count", dt, &[x, y, b], |t| elementwise_ops(&t[0], &t[1], &t[2]));
        // Count 64, but views starting one element in: not 16-byte aligned, one-element kernels.
        let (x, y, b) = (rnd(&[65], 7, dt), rnd(&[65], 8, dt), rnd(&[9], 9, dt));
        check("elementwise, unaligned views", dt, &[x, y, b], |t| {
            let (x, y, b) = (t[0].view(1, [8, 8]).unwrap(), t[1].view(1, [8, 8]).unwrap(), t[2].view(1, [8]).unwrap());
            elementwise_ops(&x, &y, &b)
        });
    }
}

#[test]
fn gelu_gemm_epilogues_match_cpu() {
    // bf16 runs cuBLASLt's GELU_AUX(_BIAS) and DGELU epilogues (or, where it has no algorithm,
    // the composed ops); f32 the composed ops. Widths 40 and 36 (an aux row not a multiple of 8).
    // x is scaled so that h stays within about ±2: deep in GeLU's negative tail its derivative
    // is 1 − tanh² of a value near −1, where f32 keeps few digits on either device (the first
    // run, unscaled, failed f32 by 2% on an element of 5e-4).
    for dt in [DType::F32, DType::BF16] {
        for n in [40, 36] {
            let x = k::scale(&rnd(&[2, 9, 24], 1, dt), 0.3).unwrap();
            let (w, b) = (rnd(&[n, 24], 2, dt), rnd(&[n + 1], 3, dt));
            let (dy, w2) = (rnd(&[2, 9, 16], 4, dt), rnd(&[16, n], 5, dt));
            check(&format!("linear_gelu / matmul_dgelu n{n}"), dt, &[x, w, b, dy, w2], |t| {
                let (a, h) = k::linear_gelu(&t[0], &t[1], Some(&t[2].view(0, [n]).unwrap())).unwrap();
                let (a0, h0) = k::linear_gelu(&t[0], &t[1], None).unwrap();
                // A bias off 16-byte alignment: the composed ops.
                let (a1, h1) = k::linear_gelu(&t[0], &t[1], Some(&t[2].view(1, [n]).unwrap())).unwrap();
                let dh = k::matmul_dgelu(&t[3], &t[4], &h).unwrap();
                vec![a, h, a0, h0, a1, h1, dh]
            });
        }
    }
}

#[test]
fn own_gemm_kernels_match_cpu() {
    // kernels/gemm.cu (on sm_90) against the CPU, in every build: clusters of two blocks, single
    // blocks, 256-row tiles (17 of them, the last 104 rows deep) and 256-column tiles (5 of
    // them, the last 8 columns wide; alone and in clusters of two):
    // 33 × 9 output tiles of 128 × 128, more than two a block on 132 SMs (both warpgroups,
    // several rounds each), with m (4200), n (1032) and k (200) none a multiple of its tile
    // (zero-filled boxes past the edges, stores cut there; 33 m-tiles leave the last cluster's
    // second block a tile wholly past m).
    // x is scaled so that h stays within a few units (GeLU's tail, as above). The GeLU gradient
    // takes an h given to both devices: one from each device's own forward may differ by a bf16
    // step, which the gradient's slope times a product of ≈ 14 turns into more than bf16's
    // tolerance.
    // Depths 200 and 72 (4 and 2 k-steps): the cooperative builds spread the epilogue over a
    // tile's k-steps from the fourth (dGeLU) or second (GeLU) on, and do it whole at the tile's
    // end below that.
    // The plain products go through `matmul` and `matmul_bias` too (`set_own_gemm_plain`): with
    // an aligned bias in the epilogue, and with one off 16-byte alignment, which cuBLASLt takes.
    let (m, n) = (4200, 1032);
    let dt = DType::BF16;
    ferrotron_kernels::cuda::set_own_gemm(true);
    ferrotron_kernels::cuda::set_own_gemm_plain(true);
    let before = ferrotron_kernels::cuda::own_gemm_runs();
    use ferrotron_kernels::cuda::OwnGemmBuild;
    let builds = [
        OwnGemmBuild::Clusters2,
        OwnGemmBuild::PingPong,
        OwnGemmBuild::M256,
        OwnGemmBuild::N256,
        OwnGemmBuild::N256Clusters2,
    ];
    let depths = [200, 72];
    for kd in depths {
        let x = k::scale(&rnd(&[m, kd], 1, dt), 0.1).unwrap();
        let (w, b) = (rnd(&[n, kd], 2, dt), rnd(&[n + 1], 3, dt));
        let (dy, w2, h) = (rnd(&[m, kd], 4, dt), rnd(&[kd, n], 5, dt), rnd(&[m, n], 6, dt));
        for build in builds {
            ferrotron_kernels::cuda::set_own_gemm_build(build);
            check(
                &format!("own GEMM kernels, build {build:?}, k {kd}"),
                dt,
                &[x.clone(), w.clone(), b.clone(), dy.clone(), w2.clone(), h.clone()],
                |t| {
                    let bias = t[2].view(0, [n]).unwrap();
                    let (a, h) = k::linear_gelu(&t[0], &t[1], Some(&bias)).unwrap();
                    let dh = k::matmul_dgelu(&t[3], &t[4], &t[5]).unwrap();
                    // The plain products: ours on the GPU where it runs, the reference matmul elsewhere.
                    let own = |b: &Tensor, tb: bool| {
                        let got = ferrotron_kernels::cuda::own_matmul(&t[0], b, tb).unwrap();
                        got.unwrap_or_else(|| k::matmul(&t[0], b, false, tb).unwrap())
                    };
                    let biased = k::matmul_bias(&t[0], &t[1], &bias, false, true).unwrap();
                    let odd = k::matmul_bias(&t[0], &t[1], &t[2].view(1, [n]).unwrap(), false, true).unwrap();
                    let nn = k::matmul(&t[3], &t[4], false, false).unwrap();
                    vec![a, h, dh, own(&t[1], true), own(&t[4], false), biased, odd, nn]
                },
            );
        }
    }
    ferrotron_kernels::cuda::set_own_gemm_build(OwnGemmBuild::PingPong);
    ferrotron_kernels::cuda::set_own_gemm(false);
    ferrotron_kernels::cuda::set_own_gemm_plain(false);
    let ran = ferrotron_kernels::cuda::own_gemm_runs() - before;
    if ferrotron_kernels::cuda::wgmma_device(&gpu()).unwrap() {
        // GeLU, dGeLU, two by own_matmul, the biased and the NN product by matmul(_bias); the
        // one with its bias off alignment goes to cuBLASLt.
        let want = 6 * (builds.len() * depths.len()) as u64;
        assert_eq!(ran, want, "our builds' products at each depth");
    }
}

#[test]
fn gemm_algorithm_timing_leaves_every_output_as_one_product() {
    // A new shape's first call times cuBLASLt's candidates (`tune`): in D itself when the product
    // overwrites it, in scratch when it accumulates. Were a timed run to land in an accumulated D,
    // main_grad would gain the product a dozen times. Each mode gets shapes of its own, as the
    // choice is cached per shape: sizes where the heuristic offers several algorithms.
    for (tuned, m) in [(true, 264), (false, 392)] {
        ferrotron_kernels::cuda::set_gemm_tuning(tuned);
        let (a, b, bias) =
            (rnd(&[m, 320], 1, DType::BF16), rnd(&[448, 320], 2, DType::BF16), rnd(&[448], 3, DType::BF16));
        let (dy, acc) = (rnd(&[m, 448], 4, DType::BF16), rnd(&[448, 320], 5, DType::F32));
        let (dg, w2) = (rnd(&[m, 256], 6, DType::BF16), rnd(&[256, 448], 7, DType::BF16));
        check(&format!("GEMMs, tuning {tuned}"), DType::BF16, &[a, b, bias, dy, acc, dg, w2], |t| {
            let y = k::matmul_bias(&t[0], &t[1], &t[2], false, true).unwrap();
            let (g, h) = k::linear_gelu(&t[0], &t[1], Some(&t[2])).unwrap();
            let dh = k::matmul_dgelu(&t[5], &t[6], &h).unwrap();
            let acc = t[4].deep_copy().unwrap();
            // main_grad += dyᵀ·a, twice: the second call finds the shape cached.
            k::matmul_into(&acc, &t[3], &t[0], true, false, true).unwrap();
            k::matmul_into(&acc, &t[3], &t[0], true, false, true).unwrap();
            vec![y, g, h, dh, acc]
        });
    }
    ferrotron_kernels::cuda::set_gemm_tuning(false);
}

#[test]
fn norm_kernels_take_both_paths() {
    // Widths: 20 (not a multiple of 8: the one-element row kernels), 776 (eight-wide, one group
    // per thread) and 8200 (eight-wide, 1025 groups over a 512-thread block: thread 0 holds
    // three). 70 rows: two chunks of the parameter-gradient column sums. At 8200 only 3 rows: a
    // weight gradient sums rows of ≈ ±1 terms to ≈ 0.01, so the f32 statistics' last-bit
    // differences from the CPU (mean and rstd over 8200 values) pass 1e-5 on the result only
    // when few rows cancel. Widths 256, 768 and 2048 take the backward with the parameter
    // gradients fused (`norm_bwd_cols`: 8, 5 and 2 teams of rows; at 256 the short last chunk
    // leaves two teams without a row) in each of its builds (v5; v6: a LayerNorm's bias sums in
    // shared memory; v6np: that without the L2 prefetch), and run again with it off.
    for dt in [DType::F32, DType::BF16] {
        for (c, fused) in [(20, false), (776, false), (8200, false), (256, true), (768, true), (2048, true)] {
            let modes: &[(bool, &str)] =
                if fused { &[(true, "v5"), (true, "v6"), (true, "v6np"), (false, "v5")] } else { &[(true, "v5")] };
            for &(on, build) in modes {
                ferrotron_kernels::cuda::set_norm_fused(on);
                ferrotron_kernels::cuda::set_norm_bwd_build(build);
                norm_cases(dt, c, &format!("c{c} fused {} {build}", fused && on));
            }
        }
    }
    ferrotron_kernels::cuda::set_norm_fused(true);
    ferrotron_kernels::cuda::set_norm_bwd_build("v5");
}

fn norm_cases(dt: DType, c: usize, what: &str) {
    let rows = if c > 1000 { 3 } else { 70 };
    let (x, dy, w, b) = (rnd(&[rows, c], 1, dt), rnd(&[rows, c], 2, dt), rnd(&[c], 3, dt), rnd(&[c], 4, dt));
    check(&format!("norms {what}"), dt, &[x, dy, w, b], |t| {
        let (o, m, r) = k::layernorm_fwd(&t[0], &t[2], Some(&t[3]), 1e-5).unwrap();
        let (dx, dw, db) = k::layernorm_bwd(&t[1], &t[0], &t[2], &m, &r).unwrap();
        let (o2, r2) = k::rmsnorm_fwd(&t[0], &t[2], 1e-5).unwrap();
        let (dx2, dw2) = k::rmsnorm_bwd(&t[1], &t[0], &t[2], &r2).unwrap();
        vec![o, m, r, dx, dw, db, o2, r2, dx2, dw2, k::bias_grad(&t[1]).unwrap()]
    });
    // Zero-centred weights (1 + w, the 1 added in the kernels), with the fused residual add and
    // the backward into main_grad-like destinations (the fused column sums where the width takes them).
    let (x, dy, w, b) = (rnd(&[rows, c], 21, dt), rnd(&[rows, c], 22, dt), rnd(&[c], 23, dt), rnd(&[c], 24, dt));
    let ins: Vec<Tensor> =
        [x, dy, w, b].into_iter().chain([25, 26, 27, 28].map(|s| rnd(&[c], s, DType::F32))).collect();
    check(&format!("zero-centred norms {what}"), dt, &ins, |t| {
        let d: Vec<Tensor> = t[4..8].iter().map(|x| x.deep_copy().unwrap()).collect();
        let g = k::Gamma::one_plus(&t[2]);
        let (o, m, r) = k::layernorm_fwd(&t[0], g, Some(&t[3]), 1e-5).unwrap();
        let (dx, dw, db) = k::layernorm_bwd(&t[1], &t[0], g, &m, &r).unwrap();
        let (s, o2, m2, r2) = k::add_layernorm_fwd(&t[0], &t[1], g, Some(&t[3]), 1e-5).unwrap();
        let dx2 = k::layernorm_bwd_into(&t[1], &s, g, &m2, &r2, Some(&t[0]), &d[0], &d[1], true).unwrap();
        let (o3, r3) = k::rmsnorm_fwd(&t[0], g, 1e-5).unwrap();
        let (dx3, dw3) = k::rmsnorm_bwd(&t[1], &t[0], g, &r3).unwrap();
        let (s4, o4, r4) = k::add_rmsnorm_fwd(&t[0], &t[1], g, 1e-5).unwrap();
        let dx4 = k::rmsnorm_bwd_into_bias(&t[1], &s4, g, &r4, &t[0], &d[2], &d[3], true).unwrap();
        vec![
            o,
            m,
            r,
            dx,
            dw,
            db,
            s,
            o2,
            dx2,
            o3,
            dx3,
            dw3,
            s4,
            o4,
            dx4,
            d[0].clone(),
            d[1].clone(),
            d[2].clone(),
            d[3].clone(),
        ]
    });
    // The residual adds fused into the norms: x + dy normalised, and dx + x.
    let (x, dy, w, b) = (rnd(&[rows, c], 5, dt), rnd(&[rows, c], 6, dt), rnd(&[c], 7, dt), rnd(&[c], 8, dt));
    check(&format!("norms with residual adds {what}"), dt, &[x, dy, w, b], |t| {
        let (s, o, m, r) = k::add_layernorm_fwd(&t[0], &t[1], &t[2], Some(&t[3]), 1e-5).unwrap();
        let (dx, dw, db) = k::layernorm_bwd_add(&t[1], &s, &t[2], &m, &r, &t[0]).unwrap();
        let (s2, o2, r2) = k::add_rmsnorm_fwd(&t[0], &t[1], &t[2], 1e-5).unwrap();
        let (dx2, dw2) = k::rmsnorm_bwd_add(&t[1], &s2, &t[2], &r2, &t[0]).unwrap();
        vec![s, o, m, r, dx, dw, db, s2, o2, r2, dx2, dw2]
    });
    // The residual's column sums (a linear layer's bias gradient) in the norm's own backward,
    // into f32 main_grad-like destinations: added into values they hold, then stored over them.
    let dst = |seed| rnd(&[c], seed, DType::F32);
    let ins = [rnd(&[rows, c], 9, dt), rnd(&[rows, c], 10, dt), rnd(&[c], 11, dt), rnd(&[c], 12, dt)];
    let ins: Vec<Tensor> = ins.into_iter().chain([13, 14, 15, 16, 17].map(dst)).collect();
    check(&format!("norms with the residual's bias gradient {what}"), dt, &ins, |t| {
        let d: Vec<Tensor> = t[4..9].iter().map(|x| x.deep_copy().unwrap()).collect();
        let (s, _, m, r) = k::add_layernorm_fwd(&t[0], &t[1], &t[2], Some(&t[3]), 1e-5).unwrap();
        let dx = k::layernorm_bwd_into_bias(&t[1], &s, &t[2], &m, &r, &t[0], &d[0], &d[1], &d[2], true).unwrap();
        let (s2, _, r2) = k::add_rmsnorm_fwd(&t[0], &t[1], &t[2], 1e-5).unwrap();
        let dx2 = k::rmsnorm_bwd_into_bias(&t[1], &s2, &t[2], &r2, &t[0], &d[3], &d[4], true).unwrap();
        let stored = d[2].deep_copy().unwrap();
        k::layernorm_bwd_into_bias(&t[1], &s, &t[2], &m, &r, &t[0], &d[0], &d[1], &stored, false).unwrap();
        // On each device, the stored sums against the plain column sum of the residual.
        let plain = k::bias_grad(&t[0]).unwrap();
        assert_close(&host(&stored), &host(&plain), 1e-5, 1e-5, &format!("residual sums {what} [{dt}]"));
        vec![dx, d[0].clone(), d[1].clone(), d[2].clone(), dx2, d[3].clone(), d[4].clone(), stored]
    });
}

/// The parameter-gradient ops into a bf16 main_grad (`--grad-reduce-in-bf16`): the column sums
/// (bias, norm weights, the residual's bias) finish in f32 and round once, so they must give the
/// bits of the f32 destination's result rounded to bf16; the embedding's scatter-add (sums in f32,
/// then added) and the weight-gradient product against the CPU within bf16 tolerance.
#[test]
fn bf16_main_grad_takes_the_f32_sums_rounded_once() {
    let g = gpu();
    let bits = |t: &Tensor| t.to_vec_f32().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    let rounded = |t: &Tensor| bits(&k::cast(t, DType::BF16).unwrap());
    for (c, acc) in [(20usize, true), (768, false), (768, true)] {
        let what = format!("c{c} acc {acc}");
        let dt = DType::BF16;
        let (x, dy, w, b) = (rnd(&[70, c], 1, dt), rnd(&[70, c], 2, dt), rnd(&[c], 3, dt), rnd(&[c], 4, dt));
        let (x, dy, w, b) = (on(&x, &g), on(&dy, &g), on(&w, &g), on(&b, &g));
        // Starting values representable in bf16, so both destinations start equal.
        let start = |seed, gdt| on(&k::cast(&rnd(&[c], seed, DType::BF16), gdt).unwrap(), &g);
        let sums = |gdt: DType| {
            let d: Vec<Tensor> = (0..5).map(|i| start(20 + i, gdt)).collect();
            k::bias_grad_into(&d[0], &dy, acc).unwrap();
            let (s, _, m, r) = k::add_layernorm_fwd(&x, &dy, &w, Some(&b), 1e-5).unwrap();
            k::layernorm_bwd_into_bias(&dy, &s, &w, &m, &r, &x, &d[1], &d[2], &d[3], acc).unwrap();
            let (s2, _, r2) = k::add_rmsnorm_fwd(&x, &dy, &w, 1e-5).unwrap();
            k::rmsnorm_bwd_into(&dy, &s2, &w, &r2, None, &d[4], acc).unwrap();
            let (_, m3, r3) = k::layernorm_fwd(&x, &w, Some(&b), 1e-5).unwrap();
            let dd = [start(30, gdt), start(31, gdt)];
            k::layernorm_bwd_into(&dy, &x, &w, &m3, &r3, None, &dd[0], &dd[1], acc).unwrap();
            d.into_iter().chain(dd).collect::<Vec<_>>()
        };
        let (wide, narrow) = (sums(DType::F32), sums(DType::BF16));
        for (i, (a, n)) in wide.iter().zip(&narrow).enumerate() {
            assert_eq!(n.dtype(), DType::BF16);
            assert_eq!(bits(n), rounded(a), "{what}: sum {i} into bf16 against the f32 sum rounded");
        }
    }
    // Embedding: from zero in deterministic mode the f32 table holds the position-order sums,
    // which the bf16 path rounds once; from nonzero values, against the CPU.
    let (n, v, c) = (300usize, 37usize, 24usize);
    let ids: Vec<u32> = (0..n).map(|i| ((i * 7 + i / 5) % v) as u32).collect();
    let ids = Tensor::from_vec(ids, [n], &Device::Cpu).unwrap();
    let dout = rnd(&[n, c], 5, DType::BF16);
    ferrotron_kernels::cuda::set_deterministic(true);
    let (t32z, t16z) =
        (Tensor::zeros([v, c], DType::F32, &g).unwrap(), Tensor::zeros([v, c], DType::BF16, &g).unwrap());
    k::embedding_bwd(&on(&ids, &g), &on(&dout, &g), &t32z).unwrap();
    k::embedding_bwd(&on(&ids, &g), &on(&dout, &g), &t16z).unwrap();
    assert_eq!(bits(&t16z), rounded(&t32z), "embedding into bf16 from zero");
    ferrotron_kernels::cuda::set_deterministic(false);
    let table = rnd(&[v, c], 6, DType::BF16);
    let (cpu_t, gpu_t) = (table.deep_copy().unwrap(), on(&table, &g));
    k::embedding_bwd(&ids, &dout, &cpu_t).unwrap();
    k::embedding_bwd(&on(&ids, &g), &on(&dout, &g), &gpu_t).unwrap();
    same(&cpu_t, &gpu_t, DType::BF16, "embedding into bf16");
    assert_ne!(bits(&gpu_t), bits(&on(&table, &g)), "the embedding gradient reached the table");
    // The device's persistent scratch (outside deterministic mode): calls of other sizes and
    // vocabulary shards in turn, each against the CPU. A scratch not left zeroed, or a flag left
    // set, by one call would show in the next; the second call grows it. The first three widths
    // (multiples of 4) take four columns a thread (one vector reduction); the last, 18, one.
    for (round, (v2, c2, start)) in
        [(37usize, 24usize, 0usize), (90, 40, 20), (37, 24, 0), (60, 18, 30)].into_iter().enumerate()
    {
        let total = start + v2 + 10;
        let ids: Vec<u32> = (0..n).map(|i| ((i * 13 + round * 5 + i / 7) % total) as u32).collect();
        let ids = Tensor::from_vec(ids, [n], &Device::Cpu).unwrap();
        let dout = rnd(&[n, c2], 40 + round as u64, DType::BF16);
        let table = rnd(&[v2, c2], 50 + round as u64, DType::BF16);
        let (cpu_t, gpu_t) = (table.deep_copy().unwrap(), on(&table, &g));
        k::embedding_bwd_shard(&ids, &dout, &cpu_t, start, total).unwrap();
        k::embedding_bwd_shard(&on(&ids, &g), &on(&dout, &g), &gpu_t, start, total).unwrap();
        same(&cpu_t, &gpu_t, DType::BF16, &format!("embedding into bf16 through the scratch, call {round}"));
        assert_ne!(bits(&gpu_t), bits(&on(&table, &g)), "call {round}: the gradient reached the table");
    }
    // Position embeddings into bf16 (and f32) from a bf16 dout: the CPU's bits (the same sums in
    // the same order, rounded once into bf16).
    let pdout = rnd(&[4, 30, 24], 60, DType::BF16);
    for gdt in [DType::BF16, DType::F32] {
        let table = rnd(&[40, 24], 61, gdt);
        let (cpu_t, gpu_t) = (table.deep_copy().unwrap(), on(&table, &g));
        k::position_embedding_bwd(&pdout, &cpu_t, 7).unwrap();
        k::position_embedding_bwd(&on(&pdout, &g), &gpu_t, 7).unwrap();
        assert_eq!(bits(&gpu_t), bits(&cpu_t), "position embedding gradient into {gdt}");
        assert_ne!(bits(&gpu_t), bits(&table), "position embedding gradient into {gdt} reached the table");
    }
    // The weight gradient into a bf16 main_grad view: stored, then added.
    let (a, b) = (rnd(&[40, 24], 7, DType::BF16), rnd(&[40, 16], 8, DType::BF16));
    let (cpu_c, gpu_c) = (rnd(&[24, 16], 9, DType::BF16), on(&rnd(&[24, 16], 9, DType::BF16), &g));
    for accumulate in [false, true] {
        k::matmul_into(&cpu_c, &a, &b, true, false, accumulate).unwrap();
        k::matmul_into(&gpu_c, &on(&a, &g), &on(&b, &g), true, false, accumulate).unwrap();
        same(&cpu_c, &gpu_c, DType::BF16, &format!("matmul_into bf16 accumulate {accumulate}"));
    }
}

#[test]
fn optimizer_ops_match_cpu() {
    let n = 70_000;
    let p = rnd(&[n], 1, DType::F32);
    let g = rnd(&[n], 2, DType::F32);
    let h = AdamW { lr: 1e-2, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, step: 3, grad_scale: 0.7 };
    check("adamw", DType::F32, &[p, g], |t| {
        let (p, m, v) = (
            t[0].deep_copy().unwrap(),
            Tensor::zeros([n], DType::F32, t[0].device()).unwrap(),
            Tensor::zeros([n], DType::F32, t[0].device()).unwrap(),
        );
        k::adamw_step(&p, &t[1], &m, &v, &h).unwrap();
        k::adamw_step(&p, &t[1], &m, &v, &AdamW { step: 4, ..h }).unwrap();
        vec![p, m, v]
    });
    let x = rnd(&[n], 3, DType::F32);
    let (c, d) = (k::sum_sq(&x).unwrap(), k::sum_sq(&on(&x, &gpu())).unwrap());
    assert!((c - d).abs() <= 1e-9 * c, "sum_sq {c} vs {d}");
    // Accumulate-into: f32 main_grad += bf16 product.
    let (a, b) = (rnd(&[8, 12], 4, DType::BF16), rnd(&[12, 5], 5, DType::BF16));
    let acc_cpu = rnd(&[8, 5], 6, DType::F32);
    let acc_gpu = on(&acc_cpu, &gpu());
    k::matmul_into(&acc_cpu, &a, &b, false, false, true).unwrap();
    k::matmul_into(&acc_gpu, &on(&a, &gpu()), &on(&b, &gpu()), false, false, true).unwrap();
    same(&acc_cpu, &acc_gpu, DType::BF16, "matmul_into f32 += bf16");
}

#[test]
fn prechecked_device_ids_are_trusted_and_stay_in_bounds() {
    // With the caller vouching for the ids (the trainer checks each batch on the host), the ops
    // do not read them back; an id past the table then reads a zero row and a target past the
    // vocabulary counts as another shard's (loss = lse), never memory outside the buffers.
    let g = gpu();
    let table = rnd(&[5, 2], 1, DType::F32);
    let logits = rnd(&[2, 4], 2, DType::F32);
    let (ids, targets) = (vec![0u32, 7, 2], vec![1u32, 9]);
    ferrotron_kernels::set_device_ids_prechecked(true);
    let out = k::embedding_fwd(&Tensor::from_vec(ids.clone(), [3], &g).unwrap(), &on(&table, &g)).unwrap();
    let t_gpu = Tensor::from_vec(targets.clone(), [2], &g).unwrap();
    let (loss, lse) = k::cross_entropy_fwd(&on(&logits, &g), &t_gpu, None, CrossEntropyCfg::default()).unwrap();
    ferrotron_kernels::set_device_ids_prechecked(false);
    let (out, t) = (host(&out), host(&table));
    assert_eq!([out[0], out[1], out[4], out[5]], [t[0], t[1], t[4], t[5]]);
    assert_eq!([out[2], out[3]], [0.0, 0.0], "an id past the table reads a zero row");
    let (loss, lse) = (host(&loss), host(&lse));
    assert!((loss[1] - lse[1]).abs() < 1e-6, "a target past the vocabulary: loss {} vs lse {}", loss[1], lse[1]);
    let cpu_t = Tensor::from_vec(vec![1u32, 0], [2], &Device::Cpu).unwrap();
    let (want, _) = k::cross_entropy_fwd(&logits, &cpu_t, None, CrossEntropyCfg::default()).unwrap();
    assert!((loss[0] - host(&want)[0]).abs() < 1e-5, "row 0 as on the CPU");
    // Off again (the default), a bad id is an error on the GPU too.
    let e = k::embedding_fwd(&Tensor::from_vec(ids, [3], &g).unwrap(), &on(&table, &g)).unwrap_err();
    assert!(matches!(e, ferrotron_core::Error::IndexOutOfRange { index: 7, bound: 5, .. }), "{e}");
}

#[test]
fn out_of_memory_names_the_size_and_usage() {
    let g = gpu();
    // 2^38 f32 = 1 TiB: more than any single GPU holds.
    let e = Tensor::zeros([1usize << 38], DType::F32, &g).unwrap_err().to_string();
    assert!(e.contains("out of memory") && e.contains("1099511627776 bytes") && e.contains("GiB in use"), "{e}");
}

/// Small uploads go through a ring of page-locked buffers (ferrotron-core `staging`) and are
/// queued without waiting for the stream. Many more of them than the ring has slots, queued
/// behind a long product and in several dtypes, each read back equal to what was sent: a slot is
/// never refilled before its last copy has landed.
#[test]
fn staged_uploads_behind_queued_work_arrive_whole() {
    let dev = gpu();
    let big = rnd(&[1024, 1024], 1, DType::F32).to_device(&dev).unwrap();
    let _busy = k::matmul(&big, &big, false, false).unwrap(); // queued work ahead of the copies
    let mut sent = Vec::new();
    for i in 0..40u32 {
        let ids: Vec<u32> = (0..1000 + i).map(|j| j.wrapping_mul(2_654_435_761) ^ i).collect();
        let vals: Vec<f32> = (0..500 + i).map(|j| (j as f32 + i as f32) * 0.25).collect();
        let t = Tensor::from_vec(ids.clone(), [ids.len()], &dev).unwrap();
        let f = Tensor::from_f32(&vals, [vals.len()], DType::BF16, &dev).unwrap();
        sent.push((ids, vals, t, f));
    }
    for (ids, vals, t, f) in &sent {
        assert_eq!(&t.to_vec::<u32>().unwrap(), ids);
        let back = f.to_vec_f32().unwrap();
        let want: Vec<f32> = vals.iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect();
        assert_eq!(back, want);
    }
}

/// The MoE routing family: the same experts chosen (ties to the lower index on both), weights,
/// gradients, the router's losses and the weighted combine within the dtype's tolerance.
#[test]
fn moe_routing_matches_cpu() {
    let g = gpu();
    let (n, e, c) = (37, 8, 24);
    let bias = rnd(&[e], 7, DType::F32);
    // Softmax after and before the top-k, then the per-expert scores with DeepSeek-V3's group
    // limit (4 groups of 2, the best 2 groups) and expert bias.
    let grouped = Some(k::Groups { num: 4, topk: 2 });
    let cases = [
        (k::TopK::new(2, false, 1.0), false),
        (k::TopK::new(3, true, 2.5), false),
        (k::TopK { groups: grouped, ..k::TopK::new(3, false, 1.0) }, false),
        (k::TopK { score: k::Score::Sigmoid, groups: grouped, ..k::TopK::new(4, false, 2.5) }, true),
        (k::TopK { score: k::Score::SqrtSoftplus, ..k::TopK::new(1, false, 1.0) }, true),
    ];
    for dt in [DType::F32, DType::BF16] {
        for (r, biased) in cases {
            let (kk, b) = (r.k, biased.then_some(&bias));
            let logits = rnd(&[n, e], 1, dt);
            let (p_c, ix_c) = k::moe_route(&logits, &r, b).unwrap();
            let (p_g, ix_g) = k::moe_route(&on(&logits, &g), &r, b.map(|b| on(b, &g)).as_ref()).unwrap();
            assert!(matches!(ix_g.device(), Device::Cuda(_)));
            assert_eq!(ix_g.to_vec::<u32>().unwrap(), ix_c.to_vec::<u32>().unwrap(), "experts [{dt}] k {kk}");
            same(&p_c, &p_g, DType::F32, &format!("probs [{dt}] k {kk}"));
            let dp = rnd(&[n, kk], 2, DType::F32);
            let dl_c = k::moe_route_bwd(&logits, &ix_c, &dp, &r).unwrap();
            let dl_g = k::moe_route_bwd(&on(&logits, &g), &ix_g, &on(&dp, &g), &r).unwrap();
            same(&dl_c, &dl_g, dt, &format!("moe_route_bwd [{dt}] k {kk}"));

            let sort_c = k::moe_sort(&ix_c, e).unwrap();
            let sort_g = k::moe_sort(&ix_g, e).unwrap();
            assert_eq!(sort_g.tokens_per_expert, sort_c.tokens_per_expert);
            assert_eq!(sort_g.slot.to_vec::<u32>().unwrap(), sort_c.slot.to_vec::<u32>().unwrap());
            let counts = Tensor::from_vec(
                sort_c.tokens_per_expert.iter().map(|&x| x as f32).collect::<Vec<_>>(),
                [e],
                &Device::Cpu,
            )
            .unwrap();
            // More tokens than rows (context parallelism's micro-batch): the z-loss's mean too.
            let l = k::RouterLoss {
                topk: kk,
                total_tokens: n + 3,
                aux_coeff: 0.3,
                z_coeff: 0.05,
                grad_scale: 0.5,
                score: r.score,
                seqs: 1,
            };
            let (v_c, d_c) = k::moe_router_loss(&logits, &counts, &l).unwrap();
            let (v_g, d_g) = k::moe_router_loss(&on(&logits, &g), &on(&counts, &g), &l).unwrap();
            same(&v_c, &v_g, DType::F32, &format!("router loss values [{dt}]"));
            same(&d_c, &d_g, DType::F32, &format!("router loss dlogits [{dt}]"));
            // Per sequence (seq_aux_loss): 36 of the rows as 4 sequences of 9, each its counts.
            let rows = logits.narrow0(0..36).unwrap().contiguous().unwrap();
            let per_seq = rnd(&[4, e], 8, DType::F32);
            let l = k::RouterLoss { seqs: 4, total_tokens: 40, ..l };
            let (v_c, d_c) = k::moe_router_loss(&rows, &per_seq, &l).unwrap();
            let (v_g, d_g) = k::moe_router_loss(&on(&rows, &g), &on(&per_seq, &g), &l).unwrap();
            same(&v_c, &v_g, DType::F32, &format!("sequence router loss values [{dt}]"));
            same(&d_c, &d_g, DType::F32, &format!("sequence router loss dlogits [{dt}]"));

            let yp = rnd(&[n * kk, c], 3, dt);
            let dy = rnd(&[n, c], 4, dt);
            let y_c = k::moe_unpermute(&yp, &sort_c.slot, &p_c).unwrap();
            let y_g = k::moe_unpermute(&on(&yp, &g), &sort_g.slot, &p_g).unwrap();
            same(&y_c, &y_g, dt, &format!("moe_unpermute [{dt}]"));
            let (dyp_c, dp_c) = k::moe_unpermute_bwd(&yp, &sort_c.slot, &p_c, &dy).unwrap();
            let (dyp_g, dp_g) = k::moe_unpermute_bwd(&on(&yp, &g), &sort_g.slot, &p_g, &on(&dy, &g)).unwrap();
            same(&dyp_c, &dyp_g, dt, &format!("moe_unpermute_bwd dyp [{dt}]"));
            same(&dp_c, &dp_g, dt, &format!("moe_unpermute_bwd dprobs [{dt}]"));

            // Token dropping at half an even share: fewer expert rows than copies, the dropped
            // copies' slots past them (the kernels must skip them, and give them no dprobs).
            for policy in [k::DropPolicy::Probs, k::DropPolicy::Position] {
                let cap = k::Capacity { factor: 0.5, policy };
                let kept_c = k::moe_drop(&ix_c, &p_c, e, &cap).unwrap();
                let kept_g = k::moe_drop(&ix_g, &p_g, e, &cap).unwrap();
                let kept = kept_c.to_vec::<u32>().unwrap();
                assert_eq!(kept_g.to_vec::<u32>().unwrap(), kept, "moe_drop [{dt}] {policy:?}");
                assert!(kept.contains(&k::DROPPED), "capacity 0.5 dropped nothing");
                let (sort_c, sort_g) = (k::moe_sort(&kept_c, e).unwrap(), k::moe_sort(&kept_g, e).unwrap());
                let rows = sort_c.perm.dims()[0];
                let yp = rnd(&[rows, c], 5, dt);
                let y_c = k::moe_unpermute(&yp, &sort_c.slot, &p_c).unwrap();
                let y_g = k::moe_unpermute(&on(&yp, &g), &sort_g.slot, &p_g).unwrap();
                same(&y_c, &y_g, dt, &format!("dropped moe_unpermute [{dt}]"));
                let (dyp_c, dp_c) = k::moe_unpermute_bwd(&yp, &sort_c.slot, &p_c, &dy).unwrap();
                let (dyp_g, dp_g) = k::moe_unpermute_bwd(&on(&yp, &g), &sort_g.slot, &p_g, &on(&dy, &g)).unwrap();
                assert_eq!(dyp_g.dims(), &[rows, c]);
                same(&dyp_c, &dyp_g, dt, &format!("dropped moe_unpermute_bwd dyp [{dt}]"));
                same(&dp_c, &dp_g, dt, &format!("dropped moe_unpermute_bwd dprobs [{dt}]"));
                let dp = dp_g.to_vec_f32().unwrap();
                assert!(kept.iter().zip(&dp).all(|(&x, &d)| x != k::DROPPED || d == 0.0), "a dropped copy's dprobs");
            }
        }
    }
}

/// Strided copies (`Tensor::narrow` views into and out of dense and strided tensors: the column
/// blocks and sequence chunks context parallelism moves) as rectangles on the GPU, bit for bit
/// the CPU's, the elements outside the destination's view left as they were.
#[test]
fn strided_copies_match_cpu() {
    let g = gpu();
    for dt in [DType::F32, DType::BF16] {
        let src = rnd(&[3, 10, 12], 901, dt);
        let dst = rnd(&[3, 8, 7], 902, dt);
        let copies = |src: &Tensor, dst: &Tensor| {
            // Columns 4..9 of every row: one rectangle of 30 rows.
            let a = Tensor::zeros([3, 10, 5], dt, src.device()).unwrap();
            a.copy_from(&src.narrow(2, 4..9).unwrap()).unwrap();
            // Rows 2..6 and columns 1..4 of every sample into rows 4..8, columns 3..6 of another
            // strided tensor: one rectangle a sample.
            let d = dst.deep_copy().unwrap();
            let view = d.narrow(1, 4..8).unwrap().narrow(2, 3..6).unwrap();
            view.copy_from(&src.narrow(1, 2..6).unwrap().narrow(2, 1..4).unwrap()).unwrap();
            // A transposed view into a dense one: width-1 rectangles.
            let t = Tensor::zeros([12, 10], dt, src.device()).unwrap();
            t.copy_from(&src.narrow(0, 1..2).unwrap().reshape([10, 12]).unwrap().transpose(0, 1).unwrap()).unwrap();
            [a, d, t]
        };
        let want = copies(&src, &dst);
        let got = copies(&on(&src, &g), &on(&dst, &g));
        for (i, (w, x)) in want.iter().zip(&got).enumerate() {
            assert_eq!(w.dims(), x.dims());
            let bits = |t: &Tensor| host(t).iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(w), bits(x), "strided copy {i} [{dt}]");
        }
    }
}

/// `copy_from` between the host and the GPU moves a contiguous view's range alone, both ways,
/// bit for bit, f32 and bf16; a view's `to_device` / `to_vec_f32` reads its range alone; a strided
/// view is refused; elements around the range stay as they were; page-locked host memory
/// (`Tensor::pin_host`) copies the same.
#[test]
fn views_cross_between_host_and_gpu() {
    let g = gpu();
    for dt in [DType::F32, DType::BF16] {
        let n = 1000;
        let host_buf = tensor(&Device::Cpu, &randv(n, 5), &[n], dt);
        let vals = host(&host_buf);
        let dev_buf = tensor(&g, &vec![7.0; n], &[n], dt);
        // Up: host 100..400 into device 500..800.
        dev_buf.view(500, [300]).unwrap().copy_from(&host_buf.view(100, [300]).unwrap()).unwrap();
        let got = host(&dev_buf);
        assert!(got[..500].iter().chain(&got[800..]).all(|&x| x == 7.0), "{dt}: outside the range");
        assert_eq!(&got[500..800], &vals[100..400], "{dt}: up");
        // Down: device 550..650 into host 0..100.
        let back = tensor(&Device::Cpu, &vec![3.0; n], &[n], dt);
        back.view(0, [100]).unwrap().copy_from(&dev_buf.view(550, [100]).unwrap()).unwrap();
        assert_eq!(&host(&back)[..100], &vals[150..250], "{dt}: down");
        assert!(host(&back)[100..].iter().all(|&x| x == 3.0), "{dt}: down, outside");
        // A view's own read: its range only, laid out from 0.
        let v = dev_buf.view(510, [20]).unwrap().to_device(&Device::Cpu).unwrap();
        assert_eq!((host(&v), v.dims().to_vec()), (vals[110..130].to_vec(), vec![20]), "{dt}: to_device");
    }
    // Through page-locked host memory (`pin_host`), both ways, before and after the lock.
    let n = 1 << 20;
    let pinned = tensor(&Device::Cpu, &randv(n, 9), &[n], DType::BF16);
    let want = host(&pinned);
    let pin = pinned.pin_host(&g).unwrap();
    let d = tensor(&g, &vec![0.0; n], &[n], DType::BF16);
    d.copy_from(&pinned).unwrap();
    assert_eq!(host(&d), want, "up from pinned memory");
    pinned.view(0, [n / 2]).unwrap().copy_from(&d.view(n / 2, [n / 2]).unwrap()).unwrap();
    assert_eq!(host(&pinned)[..n / 2], want[n / 2..], "down into pinned memory");
    drop(pin);
    d.copy_from(&pinned).unwrap();
    assert_eq!(host(&d)[..n / 2], want[n / 2..], "after the lock");
    let m = tensor(&g, &randv(64, 1), &[8, 8], DType::F32);
    let strided = m.narrow(1, 0..4).unwrap();
    let dst = tensor(&Device::Cpu, &[0.0; 32], &[8, 4], DType::F32);
    assert!(dst.copy_from(&strided).is_err(), "a strided view across devices");
}

/// --disable-bf16-reduced-precision-matmul: with fp32 split-K sums switched on, bf16 products of
/// a long inner dim (where cuBLASLt's heuristic splits K) are the fp32 products of the same
/// inputs rounded once, within a bf16 step (a bf16 sum of the split partials is not).
#[test]
fn bf16_products_sum_split_k_partials_in_fp32_when_asked() {
    let dev = gpu();
    ferrotron_kernels::cuda::set_fp32_split_k_sums(true);
    for (m, n, kk) in [(16usize, 16usize, 65536usize), (64, 32, 16384), (128, 128, 8192)] {
        let (a, b) = (rnd(&[m, kk], 21, DType::BF16), rnd(&[kk, n], 22, DType::BF16));
        let want =
            k::matmul(&k::cast(&a, DType::F32).unwrap(), &k::cast(&b, DType::F32).unwrap(), false, false).unwrap();
        let got = k::matmul(&on(&a, &dev), &on(&b, &dev), false, false).unwrap();
        let (want, got) = (host(&want), host(&got.to_device(&Device::Cpu).unwrap()));
        for (i, (w, g)) in want.iter().zip(&got).enumerate() {
            // One bf16 rounding of the fp32 sum: within 2⁻⁸ relative (and a little for order).
            assert!((w - g).abs() <= w.abs() / 256.0 + 1e-3, "{m}×{n}×{kk} [{i}]: {g} vs {w}");
        }
    }
    ferrotron_kernels::cuda::set_fp32_split_k_sums(false);
}
