//! The Mamba-2 mixer against a naive per-step reference (Megatron's in_proj layout z | x | B | C |
//! dt), its gradients against finite differences, its init, and a hybrid GPT (`M*-M-`) end to end.

use ferrotron_core::{Cx, DType, Device, Module, ParamTable, ParamTableBuilder, Tensor, rng::Philox};
use ferrotron_parallel::{ProcessGroups, TensorParallel};
use ferrotron_ssm::MambaSpec;
use ferrotron_transformer::spec::{
    Activation, AttentionSpec, FactoryCx, Hybrid, LayerKind, LayerSpec, MlpSpec, ModuleFactory, NormKind,
    PositionEmbedding, SoftmaxType,
};
use ferrotron_transformer::{Batch, GptModel, TransformerConfig};
use std::sync::Arc;

const C: usize = 8;

/// 4 heads of 4 channels (expand 2 × 8), 2 groups of 3 state channels, 3 taps.
fn spec() -> MambaSpec {
    MambaSpec { state_dim: 3, head_dim: 4, groups: 2, conv_kernel: 3, ..MambaSpec::default() }
}

fn mixer(s: &MambaSpec, seed: u64) -> (Box<dyn Module>, ParamTable) {
    let tp = TensorParallel::new(ProcessGroups::single().tp, false);
    let mut p = ParamTableBuilder::default();
    let cx = FactoryCx { prefix: "decoder.layers.0.mixer", hidden: C, std: 0.5, out_std: 0.3, tp: &tp };
    let m = s.build(&cx, &mut p).unwrap();
    (m, p.build(&Device::Cpu, DType::F32, seed).unwrap())
}

fn randn(n: usize, seed: u64, std: f32) -> Vec<f32> {
    let mut v = vec![0f32; n];
    Philox::new(seed).fill_normal(0, 0.0, std, &mut v);
    v
}

fn get(t: &ParamTable, name: &str) -> Vec<f64> {
    let id = t.id(&format!("decoder.layers.0.mixer.{name}")).unwrap();
    t.param(id).unwrap().to_vec_f32().unwrap().into_iter().map(f64::from).collect()
}

fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

/// The mixer step by step in f64: x [B, T, C] → [B, T, C].
fn reference(t: &ParamTable, s: &MambaSpec, x: &[f64], b: usize, seq: usize) -> Vec<f64> {
    let d = s.dims(C).unwrap();
    let (di, cd, hh, p, n, g, kk) = (d.d_inner, d.conv_dim(), d.heads, d.head_dim, d.state, d.groups, d.conv_kernel);
    let (w_in, cw, cb) = (get(t, "in_proj.weight"), get(t, "conv1d.weight"), get(t, "conv1d.bias"));
    let (dt_bias, a_log, dd, nw, w_out) =
        (get(t, "dt_bias"), get(t, "A_log"), get(t, "D"), get(t, "norm.weight"), get(t, "out_proj.weight"));
    let rows_out = d.in_proj_out();
    let mut out = vec![0.0; b * seq * C];
    for bi in 0..b {
        // in_proj per step: [z | x B C | dt]
        let proj: Vec<Vec<f64>> = (0..seq)
            .map(|ti| {
                let xr = &x[(bi * seq + ti) * C..][..C];
                (0..rows_out).map(|o| (0..C).map(|i| w_in[o * C + i] * xr[i]).sum()).collect()
            })
            .collect();
        let conv: Vec<Vec<f64>> = (0..seq)
            .map(|ti| {
                (0..cd)
                    .map(|ch| {
                        let mut v = cb[ch];
                        for j in 0..kk {
                            if ti + j + 1 >= kk {
                                v += cw[ch * kk + j] * proj[ti + j + 1 - kk][di + ch];
                            }
                        }
                        silu(v)
                    })
                    .collect()
            })
            .collect();
        let mut state = vec![vec![0.0; n * p]; hh];
        for ti in 0..seq {
            let u = &conv[ti];
            let mut y = vec![0.0; di];
            for h in 0..hh {
                let gi = h / (hh / g);
                let dt = (1.0 + (proj[ti][di + cd + h] + dt_bias[h]).exp()).ln();
                let a = (-a_log[h].exp() * dt).exp();
                for j in 0..n {
                    let (bj, cj) = (u[di + gi * n + j], u[di + g * n + gi * n + j]);
                    for q in 0..p {
                        let sv = &mut state[h][j * p + q];
                        *sv = a * *sv + dt * bj * u[h * p + q];
                        y[h * p + q] += cj * *sv;
                    }
                }
                for q in 0..p {
                    y[h * p + q] += dd[h] * u[h * p + q];
                }
            }
            // gated RMSNorm over each group's d_inner / G channels
            let z = &proj[ti][..di];
            let v: Vec<f64> = (0..di).map(|i| y[i] * silu(z[i])).collect();
            let gs = di / g;
            let mut normed = vec![0.0; di];
            for gi in 0..g {
                let ms = v[gi * gs..(gi + 1) * gs].iter().map(|a| a * a).sum::<f64>() / gs as f64;
                for i in gi * gs..(gi + 1) * gs {
                    normed[i] = v[i] / (ms + s.norm_eps).sqrt() * nw[i];
                }
            }
            for o in 0..C {
                out[(bi * seq + ti) * C + o] = (0..di).map(|i| w_out[o * di + i] * normed[i]).sum();
            }
        }
    }
    out
}

#[test]
fn forward_matches_the_step_by_step_reference() {
    let s = spec();
    let (m, table) = mixer(&s, 3);
    let (b, seq) = (2, 7);
    let x = randn(b * seq * C, 5, 1.0);
    let (y, _) =
        m.forward(&Cx::new(&table, true), &Tensor::from_vec(x.clone(), [b, seq, C], &Device::Cpu).unwrap()).unwrap();
    let want = reference(&table, &s, &x.iter().map(|&v| v as f64).collect::<Vec<_>>(), b, seq);
    for (i, (g, w)) in y.to_vec_f32().unwrap().iter().zip(&want).enumerate() {
        assert!((*g as f64 - w).abs() <= 1e-4 * (1.0 + w.abs()), "y[{i}]: {g} vs {w}");
    }
}

/// Directional finite differences of ⟨y, r⟩ for every parameter and the input against the backward.
#[test]
fn gradients_match_finite_differences() {
    let s = spec();
    let (m, table) = mixer(&s, 4);
    let (b, seq) = (2, 6);
    let x = Tensor::from_vec(randn(b * seq * C, 5, 1.0), [b, seq, C], &Device::Cpu).unwrap();
    let r = randn(b * seq * C, 6, 1.0);
    let objective = |x: &Tensor| {
        let (y, _) = m.forward(&Cx::new(&table, true), x).unwrap();
        y.to_vec_f32().unwrap().iter().zip(&r).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>()
    };
    table.defer_zero_grads();
    let cx = Cx::new(&table, true);
    let (_, saved) = m.forward(&cx, &x).unwrap();
    let dx = m.backward(&cx, saved, &Tensor::from_vec(r.clone(), [b, seq, C], &Device::Cpu).unwrap()).unwrap();
    let h = 1e-3f32;
    let check = |name: &str, base: &Tensor, analytic: &[f32]| {
        let u = randn(base.elem_count(), name.len() as u64 + 99, 1.0);
        let shift = |sgn: f32| base.update_f32("t", |v| v.iter_mut().zip(&u).for_each(|(x, d)| *x += sgn * d)).unwrap();
        shift(h);
        let lp = objective(&x);
        shift(-2.0 * h);
        let lm = objective(&x);
        shift(h);
        let numeric = (lp - lm) / (2.0 * h as f64);
        let want: f64 = analytic.iter().zip(&u).map(|(a, b)| *a as f64 * *b as f64).sum();
        assert!(want.abs() > 1e-3, "{name}: a gradient this small tests nothing ({want})");
        assert!(
            (numeric - want).abs() <= 1e-2 * want.abs() + 1e-3,
            "{name}: finite difference {numeric} vs backward {want}"
        );
    };
    for id in table.ids() {
        check(&table.meta(id).name, &table.param(id).unwrap(), &table.grad(id).unwrap().to_vec_f32().unwrap());
    }
    check("input", &x.clone(), &dx.to_vec_f32().unwrap());
}

#[test]
fn init_follows_megatron() {
    let s = MambaSpec { heads: Some(64), head_dim: 2, groups: 4, ..spec() };
    let (_, t) = mixer(&s, 9);
    let a = get(&t, "A_log");
    assert!(a.iter().all(|v| (0.0..=16f64.ln()).contains(v)), "{a:?}");
    assert!(a.iter().any(|v| *v > 1.0) && a.iter().any(|v| *v < 1.0), "spread over ln 1 .. ln 16: {a:?}");
    let dt: Vec<f64> = get(&t, "dt_bias").iter().map(|v| v.exp().ln_1p()).collect();
    assert!(dt.iter().all(|v| (0.000999..=0.1001).contains(v)), "softplus(dt_bias) in [dt_min, dt_max]: {dt:?}");
    assert!(get(&t, "D").iter().chain(&get(&t, "norm.weight")).all(|v| *v == 1.0));
    let bound = 1.0 / (s.conv_kernel as f64).sqrt();
    let cw = get(&t, "conv1d.weight");
    assert!(cw.iter().all(|v| v.abs() <= bound) && cw.iter().any(|v| v.abs() > bound / 2.0));
    // No weight decay on the per-head and norm parameters, as Megatron's 1-D rule.
    for (name, decay) in
        [("in_proj.weight", true), ("conv1d.weight", true), ("A_log", false), ("dt_bias", false), ("D", false)]
    {
        let id = t.id(&format!("decoder.layers.0.mixer.{name}")).unwrap();
        assert_eq!(t.meta(id).weight_decay, decay, "{name}");
    }
}

#[test]
fn bad_sizes_are_named() {
    let e = MambaSpec { head_dim: 3, ..spec() }.dims(C).unwrap_err();
    assert!(e.contains("--mamba-head-dim 3") && e.contains("16"), "{e}");
    let e = MambaSpec { groups: 3, ..spec() }.dims(C).unwrap_err();
    assert!(e.contains("--mamba-num-groups 3") && e.contains("4 Mamba heads"), "{e}");
    // Tensor parallelism gives each rank whole groups, normalised on their own.
    let e = MambaSpec { groups: 2, ..spec() }.validate_tp(4).unwrap_err();
    assert!(e.contains("--tensor-model-parallel-size 4") && e.contains("--mamba-num-groups 2"), "{e}");
    let e = MambaSpec { groups: 2, norm_per_group: false, ..spec() }.validate_tp(2).unwrap_err();
    assert!(e.contains("--mamba-norm-ungrouped"), "{e}");
    assert!(MambaSpec { groups: 2, ..spec() }.validate_tp(2).is_ok());
}

/// `M*-M-`: Mamba, attention alone, MLP alone, Mamba, MLP.
pub fn hybrid_config() -> TransformerConfig {
    use LayerKind::*;
    TransformerConfig {
        num_layers: 5,
        hidden_size: C,
        num_attention_heads: 2,
        num_query_groups: 2,
        kv_channels: None,
        ffn_hidden_size: 12,
        seq_length: 6,
        max_position_embeddings: 6,
        vocab_size: 11,
        make_vocab_size_divisible_by: 1,
        position_embedding: PositionEmbedding::None,
        untie_embeddings_and_output_weights: true,
        layer: LayerSpec {
            norm: NormKind::RmsNorm,
            zero_centred_gamma: false,
            attention: AttentionSpec {
                bias: false,
                qkv_bias: false,
                qk_layernorm: false,
                qk_l2_norm: false,
                output_gate: false,
                softmax: SoftmaxType::Vanilla,
                window: None,
                causal: true,
                mla: None,
            },
            mlp: MlpSpec::Dense { activation: Activation::SwiGlu, bias: false },
            other_mlp: None,
            hybrid: Some(Hybrid { kinds: vec![Mixer, Attention, Mlp, Mixer, Mlp], mixer: Some(Arc::new(spec())) }),
            window_layers: None,
        },
        norm_epsilon: 1e-5,
        init_method_std: 0.3,
        embedding_init_method_std: None,
        hidden_dropout: 0.0,
        attention_dropout: 0.0,
        mtp: None,
    }
}

/// A hybrid GPT: Megatron's names, the config's count equal to the table's, and the whole loss's
/// gradient against finite differences along a random direction.
#[test]
fn hybrid_gpt_counts_names_and_differentiates() {
    let cfg = hybrid_config();
    let (model, table) = GptModel::build(cfg.clone(), &Device::Cpu, DType::F32, 4).unwrap();
    assert_eq!(cfg.num_params(), table.numel());
    let names: Vec<&str> = table.metas().iter().map(|m| m.name.as_str()).collect();
    for want in [
        "decoder.layers.0.norm.weight",
        "decoder.layers.0.mixer.in_proj.weight",
        "decoder.layers.0.mixer.A_log",
        "decoder.layers.1.input_layernorm.weight",
        "decoder.layers.1.self_attention.linear_qkv.weight",
        "decoder.layers.2.pre_mlp_layernorm.weight",
        "decoder.layers.2.mlp.linear_fc1.weight",
        "decoder.layers.3.mixer.out_proj.weight",
        "decoder.final_norm.weight",
    ] {
        assert!(names.contains(&want), "{want} missing from {names:?}");
    }
    assert!(
        !names
            .iter()
            .any(|n| n.starts_with("decoder.layers.0.self_attention") || n.starts_with("decoder.layers.1.mlp"))
    );
    // FLOPs: 6N plus attention for one layer and two scans.
    let n = (table.numel()) as f64;
    let d = spec().dims(C).unwrap();
    let want = 6.0 * n + 12.0 * (C * 6) as f64 + 2.0 * 18.0 * (d.d_inner * d.state) as f64;
    assert!((cfg.flops_per_token() - want).abs() < 1e-6 * want, "{} vs {want}", cfg.flops_per_token());

    let dev = Device::Cpu;
    let ids = |s: u64| (0..12).map(|i| Philox::new(s).u32_at(i) % 11).collect::<Vec<_>>();
    let batch = Batch::unmasked(
        Tensor::from_vec(ids(1), [2, 6], &dev).unwrap(),
        Tensor::from_vec(ids(2), [2, 6], &dev).unwrap(),
    )
    .unwrap();
    let loss = |table: &ParamTable| model.forward(&Cx::new(table, true), &batch).unwrap().0;
    table.defer_zero_grads();
    let cx = Cx::new(&table, true);
    let (_, saved) = model.forward(&cx, &batch).unwrap();
    model.backward(&cx, saved, 1.0).unwrap();
    let grads: Vec<Vec<f32>> = table.ids().map(|id| table.grad(id).unwrap().to_vec_f32().unwrap()).collect();
    assert!(grads.iter().all(|g| g.iter().any(|v| *v != 0.0)), "every parameter gets a gradient");
    let u: Vec<Vec<f32>> =
        table.ids().map(|id| randn(table.param(id).unwrap().elem_count(), id.0 as u64 + 7, 1.0)).collect();
    let shift = |sgn: f32| {
        for (id, d) in table.ids().zip(&u) {
            table.param(id).unwrap().update_f32("t", |v| v.iter_mut().zip(d).for_each(|(x, d)| *x += sgn * d)).unwrap();
        }
    };
    let h = 1e-3f32;
    shift(h);
    let fp = loss(&table);
    shift(-2.0 * h);
    let fm = loss(&table);
    shift(h);
    let numeric = (fp - fm) / (2.0 * h as f64);
    let analytic: f64 =
        grads.iter().zip(&u).flat_map(|(g, d)| g.iter().zip(d)).map(|(a, b)| *a as f64 * *b as f64).sum();
    assert!(
        (numeric - analytic).abs() <= 1e-2 * analytic.abs() + 1e-3,
        "finite difference {numeric} vs backward {analytic}"
    );
}

/// Causal: changing step t's input changes no output before t (bit for bit), and changes t's.
#[test]
fn outputs_depend_only_on_earlier_steps() {
    let s = spec();
    let (m, table) = mixer(&s, 5);
    let (b, seq) = (2, 80); // past one saved-state chunk
    let x = randn(b * seq * C, 7, 1.0);
    let run = |x: &[f32]| {
        let t = Tensor::from_vec(x.to_vec(), [b, seq, C], &Device::Cpu).unwrap();
        m.forward(&Cx::new(&table, true), &t).unwrap().0.to_vec_f32().unwrap()
    };
    let y0 = run(&x);
    for t0 in [0, 1, 5, 64, 79] {
        let mut x1 = x.clone();
        for v in &mut x1[(seq + t0) * C..(seq + t0 + 1) * C] {
            *v += 0.5;
        }
        let y1 = run(&x1);
        for t in 0..seq {
            let (a, c) = (&y0[(seq + t) * C..(seq + t + 1) * C], &y1[(seq + t) * C..(seq + t + 1) * C]);
            if t < t0 {
                assert_eq!(a, c, "step {t} changed when step {t0} did");
            } else if t == t0 {
                assert_ne!(a, c, "step {t0} ignores its own input");
            }
        }
        assert_eq!(y0[..seq * C], y1[..seq * C], "the other sequence changed");
    }
}

/// The whole hybrid is causal: a token's change moves no earlier position's logits.
#[test]
fn hybrid_gpt_is_causal() {
    let (model, table) = GptModel::build(hybrid_config(), &Device::Cpu, DType::F32, 4).unwrap();
    let ids: Vec<u32> = (0..6).map(|i| Philox::new(3).u32_at(i) % 11).collect();
    let logits = |ids: &[u32]| {
        let t = Tensor::from_vec(ids.to_vec(), [1, 6], &Device::Cpu).unwrap();
        model.logits(&Cx::new(&table, false), &t).unwrap().to_vec_f32().unwrap()
    };
    let l0 = logits(&ids);
    let v = l0.len() / 6;
    for t0 in 0..6 {
        let mut changed = ids.clone();
        changed[t0] = (changed[t0] + 1) % 11;
        let l1 = logits(&changed);
        assert_eq!(l0[..t0 * v], l1[..t0 * v], "positions before {t0} moved");
        assert_ne!(l0[t0 * v..(t0 + 1) * v], l1[t0 * v..(t0 + 1) * v], "position {t0} ignores its token");
    }
}
