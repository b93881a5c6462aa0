//! Multi-token prediction: the objective's gradients against central differences (both preset
//! styles, tied and untied, with dropout), which tokens each depth sees and predicts, and a zero
//! weight leaving the rest of the model's gradients as they are without MTP.

mod common;

use common::{batch, config, directional_derivatives};
use ferrotron_core::{Cx, DType, Device, Draw, ParamTable, Tensor, rng::Philox};
use ferrotron_transformer::{Batch, GptModel, MtpSpec, TransformerConfig};

fn with_mtp(llama: bool, depths: usize, factor: f32) -> TransformerConfig {
    TransformerConfig { mtp: Some(MtpSpec { num_layers: depths, loss_scaling_factor: factor }), ..config(llama) }
}

/// The objective: the next token's mean loss + factor / D × Σ the depths' means.
fn objective(model: &GptModel, table: &ParamTable, b: &Batch) -> f64 {
    let (l, _) = model.forward_deferred(&Cx::new(table, true), b).unwrap();
    let w = model.config.mtp.map_or(0.0, |m| m.depth_weight());
    l.mean().unwrap() + w * l.mtp.iter().map(|d| d.mean().unwrap()).sum::<f64>()
}

fn check(cfg: TransformerConfig, b: Batch) {
    let (model, table) = GptModel::build(cfg, &Device::Cpu, DType::F32, 3).unwrap();
    let cx = Cx::new(&table, true);
    let (l, saved) = model.forward_deferred(&cx, &b).unwrap();
    assert_eq!(l.mtp.len(), model.config.mtp.unwrap().num_layers, "one loss per depth");
    model.backward(&cx, saved, 1.0).unwrap();
    let mut mtp_params = 0;
    for d in directional_derivatives(&table, || objective(&model, &table, &b)) {
        if d.name.starts_with("mtp.") {
            mtp_params += 1;
            assert!(d.analytic.abs() > 1e-6, "{}: no gradient reached it", d.name);
        }
        d.assert_close("");
    }
    assert!(mtp_params >= 2 * 5, "every depth's parameters are in the table ({mtp_params})");
    assert_eq!(model.config.num_params(), table.numel(), "the count the FLOPs and the log take");
}

#[test]
fn gpt2_style_mtp_gradients_match_finite_differences() {
    check(with_mtp(false, 2, 0.3), batch(2, 6, 11));
}

#[test]
fn llama_style_mtp_gradients_match_finite_differences() {
    check(with_mtp(true, 2, 0.3), batch(2, 6, 11));
}

/// Each depth's embedding draws a dropout mask of its own; the backward applies it again.
#[test]
fn mtp_with_dropout_gradients_match_finite_differences() {
    let draw = Draw { seed: 5, first_sample: 40 };
    for llama in [false, true] {
        let cfg = TransformerConfig { hidden_dropout: 0.2, ..with_mtp(llama, 1, 0.5) };
        check(cfg, batch(2, 6, 11).with_draw(draw));
    }
}

/// The per-token losses of the next-token head and of each depth with token `j` (or label `j`)
/// replaced: which positions change says what each prediction sees. Depth k at position i reads
/// tokens ..= i + k and predicts label i + k; the last k positions never count.
#[test]
fn each_depth_sees_k_more_tokens_and_predicts_k_further() {
    let (b, t, v) = (1, 6, 11u32);
    let model = GptModel::build(with_mtp(true, 2, 0.3), &Device::Cpu, DType::F32, 3).unwrap();
    let (model, table) = model;
    let ids: Vec<u32> = (0..t).map(|i| Philox::new(1).u32_at(i as u64) % v).collect();
    let labels: Vec<u32> = (0..t).map(|i| Philox::new(2).u32_at(i as u64) % v).collect();
    let losses = |tok: &[u32], lab: &[u32]| -> Vec<Vec<f32>> {
        let dev = Device::Cpu;
        let batch = Batch::unmasked(
            Tensor::from_vec(tok.to_vec(), [b, t], &dev).unwrap(),
            Tensor::from_vec(lab.to_vec(), [b, t], &dev).unwrap(),
        )
        .unwrap();
        let (l, _) = model.forward_deferred(&Cx::new(&table, false), &batch).unwrap();
        std::iter::once(&l).chain(&l.mtp).map(|d| d.per_token.to_vec_f32().unwrap()).collect()
    };
    let base = losses(&ids, &labels);
    for (k, d) in base.iter().enumerate() {
        assert!(d[t - k..].iter().all(|&x| x == 0.0), "depth {k}: the rolled-in tail counts: {d:?}");
        assert!(d[..t - k].iter().all(|&x| x > 0.0), "depth {k}: {d:?}");
    }
    let changed = |a: &[f32], b: &[f32]| (0..t).filter(|&i| a[i] != b[i]).collect::<Vec<_>>();
    let j = 3;
    let mut tok = ids.clone();
    tok[j] = (tok[j] + 1) % v;
    let moved = losses(&tok, &labels);
    for k in 0..3 {
        // Position i sees token j when j ≤ i + k (and i is not in the masked tail).
        let expect: Vec<usize> = (0..t - k).filter(|&i| j <= i + k).collect();
        assert_eq!(changed(&base[k], &moved[k]), expect, "depth {k} after token {j} changed");
    }
    let mut lab = labels.clone();
    lab[j] = (lab[j] + 1) % v;
    let moved = losses(&ids, &lab);
    for k in 0..3 {
        let expect: Vec<usize> = if j >= k { vec![j - k] } else { vec![] };
        assert_eq!(changed(&base[k], &moved[k]), expect, "depth {k} after label {j} changed");
    }
}

/// With --mtp-loss-scaling-factor 0 the depths run but weigh nothing: the loss and every shared
/// parameter's gradient are the model's without MTP (built from the same seed: parameters are
/// drawn by name), and the depths' own gradients are zero.
#[test]
fn a_zero_weight_leaves_the_rest_of_the_model_alone() {
    for llama in [false, true] {
        let b = batch(2, 6, 11);
        let (plain, pt) = GptModel::build(config(llama), &Device::Cpu, DType::F32, 3).unwrap();
        let (mtp, mt) = GptModel::build(with_mtp(llama, 2, 0.0), &Device::Cpu, DType::F32, 3).unwrap();
        let (cp, cm) = (Cx::new(&pt, true), Cx::new(&mt, true));
        let (lp, sp) = plain.forward(&cp, &b).unwrap();
        let (lm, sm) = mtp.forward(&cm, &b).unwrap();
        assert_eq!(lp, lm);
        plain.backward(&cp, sp, 1.0).unwrap();
        mtp.backward(&cm, sm, 1.0).unwrap();
        for id in mt.ids() {
            let name = &mt.meta(id).name;
            let g = mt.grad(id).unwrap().to_vec_f32().unwrap();
            match pt.ids().find(|&p| &pt.meta(p).name == name) {
                Some(p) => assert_eq!(g, pt.grad(p).unwrap().to_vec_f32().unwrap(), "{name}"),
                None => {
                    assert!(name.starts_with("mtp."), "{name}");
                    assert!(g.iter().all(|&x| x == 0.0), "{name}: {g:?}");
                }
            }
        }
    }
}

/// The depths' counts: depth k counts the loss tokens from position k on (the mask rolled left).
#[test]
fn depth_counts_follow_the_rolled_mask() {
    let b = batch(2, 6, 11); // every fifth token masked: flat positions 3 and 8 (row 0: 3; row 1: 2)
    assert_eq!(b.num_tokens(), 10.0);
    assert_eq!((b.mask_count_from(0), b.mask_count_from(1), b.mask_count_from(3)), (10.0, 8.0, 5.0));
    let (model, table) = GptModel::build(with_mtp(false, 2, 0.3), &Device::Cpu, DType::F32, 3).unwrap();
    let (l, _) = model.forward_deferred(&Cx::new(&table, false), &b).unwrap();
    assert_eq!(l.mtp.iter().map(|d| d.num_tokens).collect::<Vec<_>>(), [8.0, 6.0]);
}

/// Under --calculate-per-token-loss a batch's denominator is its share of the global batch's
/// tokens; each depth's is scaled as the batch's is (Megatron: the depth's per-token losses
/// weighed by the main count over the depth's, then divided by the global count). Doubling the
/// batch's denominator halves every depth's parameter gradient exactly.
#[test]
fn depth_denominators_scale_with_the_batchs() {
    let (model, table) = GptModel::build(with_mtp(true, 2, 0.3), &Device::Cpu, DType::F32, 3).unwrap();
    let grads = |b: Batch| {
        let cx = Cx::new(&table, true);
        table.zero_grads().unwrap();
        let (_, saved) = model.forward(&cx, &b).unwrap();
        model.backward(&cx, saved, 1.0).unwrap();
        let mtp = table.ids().filter(|&id| table.meta(id).name.starts_with("mtp."));
        mtp.flat_map(|id| table.grad(id).unwrap().to_vec_f32().unwrap()).collect::<Vec<_>>()
    };
    let b = batch(2, 6, 11);
    let n = b.num_tokens();
    let (own, doubled) = (grads(b.clone()), grads(b.with_num_tokens(2.0 * n).unwrap()));
    assert!(own.iter().any(|&g| g != 0.0));
    for (a, d) in own.iter().zip(&doubled) {
        assert!((a - 2.0 * d).abs() <= 1e-6 * a.abs().max(1e-3), "{a} vs 2 × {d}");
    }
}

/// Bad settings are refused by name.
#[test]
fn mtp_settings_are_checked() {
    let bad = |cfg: TransformerConfig| GptModel::build(cfg, &Device::Cpu, DType::F32, 3).err().unwrap().to_string();
    assert!(bad(with_mtp(true, 0, 0.1)).contains("--mtp-num-layers"));
    assert!(bad(with_mtp(true, 1, f32::NAN)).contains("--mtp-loss-scaling-factor"));
    assert!(bad(with_mtp(true, 1, -1.0)).contains("--mtp-loss-scaling-factor"));
}
