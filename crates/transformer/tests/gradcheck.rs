//! Whole-model gradient check: for every parameter, the directional derivative of the loss along a
//! random direction (central differences) equals main_grad · direction. Both preset styles.

mod common;

use common::{batch, config, directional_derivatives};
use ferrotron_core::{Cx, DType, Device, ParamTable};
use ferrotron_transformer::{Batch, GptModel};

fn loss(model: &GptModel, table: &ParamTable, b: &Batch) -> f64 {
    model.forward(&Cx::new(table, true), b).unwrap().0
}

fn check(cfg: ferrotron_transformer::TransformerConfig) {
    check_batch(cfg, batch(2, 6, 11));
}

fn check_batch(cfg: ferrotron_transformer::TransformerConfig, b: Batch) {
    let (model, table) = GptModel::build(cfg, &Device::Cpu, DType::F32, 3).unwrap();
    let cx = Cx::new(&table, true);
    let (_, saved) = model.forward(&cx, &b).unwrap();
    model.backward(&cx, saved, 1.0).unwrap();
    for d in directional_derivatives(&table, || loss(&model, &table, &b)) {
        d.assert_close("");
    }
}

#[test]
fn gpt2_style_gradients_match_finite_differences() {
    check(config(false));
}

#[test]
fn llama_style_gradients_match_finite_differences() {
    check(config(true));
}

/// Heads wider than hidden / heads (--kv-channels 6 against 16 / 4): the projections are sized
/// by heads × head width, not the hidden size.
#[test]
fn kv_channels_gradients_match_finite_differences() {
    for llama in [false, true] {
        check(ferrotron_transformer::TransformerConfig { kv_channels: Some(6), ..config(llama) });
    }
}

/// Without QK-norm the attention takes the fused path: RoPE in place on the QKV projection
/// output and on its gradient (`rope_qkv_fwd_` / `rope_qkv_bwd_`), Q, K, V read in place.
#[test]
fn llama_style_without_qk_norm_gradients_match_finite_differences() {
    let mut cfg = config(true);
    cfg.layer.attention.qk_layernorm = false;
    check(cfg);
}

/// Squared-ReLU MLPs (Nemotron-H's), with biases and without.
#[test]
fn squared_relu_gradients_match_finite_differences() {
    for bias in [true, false] {
        let mut cfg = config(bias);
        cfg.layer.mlp = ferrotron_transformer::spec::MlpSpec::Dense {
            activation: ferrotron_transformer::spec::Activation::SquaredRelu,
            bias: !bias,
        };
        check(cfg);
    }
}

/// Qwen2's attention: a bias on the QKV projection alone (--add-qkv-bias), with RoPE applied
/// after it, in the fused path and the QK-norm one.
#[test]
fn qkv_bias_without_other_biases_gradients_match_finite_differences() {
    for qk_layernorm in [false, true] {
        let mut cfg = config(true);
        cfg.layer.attention.qkv_bias = true;
        cfg.layer.attention.qk_layernorm = qk_layernorm;
        check(cfg);
    }
}

/// Hidden dropout and attention dropout, each alone (a fixed draw: the same masks in every
/// forward): the backward applies the forward's masks, so the finite differences still match; and
/// the masks do act (the loss differs from the model's without dropout, and from another draw's).
#[test]
fn dropout_gradients_match_finite_differences() {
    use ferrotron_core::Draw;
    let draw = Draw { seed: 5, first_sample: 40 };
    for (llama, hidden, attention) in [(false, 0.3, 0.0), (true, 0.3, 0.0), (false, 0.0, 0.3), (true, 0.0, 0.3)] {
        let cfg = ferrotron_transformer::TransformerConfig {
            hidden_dropout: hidden,
            attention_dropout: attention,
            ..config(llama)
        };
        check_batch(cfg.clone(), batch(2, 6, 11).with_draw(draw));
        let (model, table) = GptModel::build(cfg.clone(), &Device::Cpu, DType::F32, 3).unwrap();
        let plain = GptModel::build(config(llama), &Device::Cpu, DType::F32, 3).unwrap().0;
        let with = loss(&model, &table, &batch(2, 6, 11).with_draw(draw));
        assert_eq!(with, loss(&model, &table, &batch(2, 6, 11).with_draw(draw)), "the same draw, the same loss");
        assert_ne!(with, loss(&plain, &table, &batch(2, 6, 11)), "dropout changed nothing");
        let other = loss(&model, &table, &batch(2, 6, 11).with_draw(Draw { first_sample: 41, ..draw }));
        assert_ne!(with, other, "another sample index, another mask");
        // Outside training there is no dropout and no draw is needed.
        let eval = model.forward(&Cx::new(&table, false), &batch(2, 6, 11)).unwrap().0;
        assert_eq!(eval, plain.forward(&Cx::new(&table, false), &batch(2, 6, 11)).unwrap().0);
        let Err(e) = model.forward(&Cx::new(&table, true), &batch(2, 6, 11)) else {
            panic!("training with dropout and no draw should be an error")
        };
        assert!(e.to_string().contains("Batch::with_draw"), "{e}");
    }
}

/// --rotary-percent 0.5 (heads 8 wide: the first 4 features rotate, the last 4 pass), on the
/// QK-norm path and the fused in-place one: each attention's RoPE covers ⌊8 · 0.5⌋ features, the
/// loss moves off whole-head RoPE's, and the gradients match finite differences.
#[test]
fn partial_rotary_gradients_match_finite_differences() {
    use ferrotron_transformer::layer::Sublayer;
    use ferrotron_transformer::spec::PositionEmbedding;
    for qk_layernorm in [true, false] {
        let mut cfg = ferrotron_transformer::TransformerConfig { kv_channels: Some(8), ..config(true) };
        cfg.layer.attention.qk_layernorm = qk_layernorm;
        let whole = cfg.clone();
        cfg.position_embedding = PositionEmbedding::Rope {
            base: 10000.0,
            scaling: None,
            percent: 0.5,
            interpolation: None,
            interleaved: false,
        };
        let (model, table) = GptModel::build(cfg.clone(), &Device::Cpu, DType::F32, 3).unwrap();
        for layer in &model.chunks[0].layers {
            let Sublayer::Attention(a) = &layer.branches[0].f else { panic!("not an attention") };
            assert_eq!(a.rope.map(|r| r.rot), Some(4));
        }
        let (wm, wt) = GptModel::build(whole, &Device::Cpu, DType::F32, 3).unwrap();
        let b = batch(2, 6, 11);
        assert_ne!(loss(&model, &table, &b), loss(&wm, &wt, &b), "half the features rotate");
        check(cfg);
    }
}

/// Zero-centred norms (--apply-layernorm-1p): their weights start at 0, the model with weights w
/// gives the loss and gradients of the plain model whose norm weights are 1 + w (every norm: the
/// layers', QK-norm's, the final one), and its gradients match finite differences.
#[test]
fn zero_centred_norms_equal_plain_norms_at_one_plus_w() {
    for llama in [false, true] {
        let plain_cfg = config(llama);
        let mut cfg = plain_cfg.clone();
        cfg.layer.zero_centred_gamma = true;
        let (model, table) = GptModel::build(cfg.clone(), &Device::Cpu, DType::F32, 3).unwrap();
        let (pm, pt) = GptModel::build(plain_cfg, &Device::Cpu, DType::F32, 3).unwrap();
        let is_norm = |t: &ParamTable, id| t.meta(id).name.ends_with("layernorm.weight");
        let norms = table.ids().filter(|&id| is_norm(&table, id)).count();
        assert_eq!(norms, if llama { 2 * 4 + 1 } else { 2 * 2 + 1 }, "llama {llama}: norm weights");
        for (id, pid) in table.ids().zip(pt.ids()) {
            let (p, q) = (table.param(id).unwrap(), pt.param(pid).unwrap());
            assert_eq!(table.meta(id).name, pt.meta(pid).name);
            if is_norm(&table, id) {
                assert!(p.to_vec_f32().unwrap().iter().all(|&v| v == 0.0), "{} starts at 0", table.meta(id).name);
                // Away from 0, so a scale of w (not 1 + w) would show.
                p.update_f32("t", |v| v.iter_mut().enumerate().for_each(|(i, x)| *x = 0.1 * (i % 5) as f32 - 0.2))
                    .unwrap();
            }
            let shift = if is_norm(&table, id) { 1.0 } else { 0.0 };
            let w = p.to_vec_f32().unwrap();
            q.update_f32("t", |v| v.iter_mut().zip(&w).for_each(|(x, w)| *x = w + shift)).unwrap();
        }
        let b = batch(2, 6, 11);
        let (cx, pcx) = (Cx::new(&table, true), Cx::new(&pt, true));
        let (l, saved) = model.forward(&cx, &b).unwrap();
        let (pl, psaved) = pm.forward(&pcx, &b).unwrap();
        assert!((l - pl).abs() <= 1e-6 * pl.abs(), "llama {llama}: loss {l} vs plain {pl}");
        model.backward(&cx, saved, 1.0).unwrap();
        pm.backward(&pcx, psaved, 1.0).unwrap();
        for (id, pid) in table.ids().zip(pt.ids()) {
            let (g, pg) = (table.grad(id).unwrap().to_vec_f32().unwrap(), pt.grad(pid).unwrap().to_vec_f32().unwrap());
            for (a, b) in g.iter().zip(&pg) {
                assert!((a - b).abs() <= 1e-5 * b.abs() + 1e-6, "llama {llama} {}: {a} vs {b}", table.meta(id).name);
            }
        }
        check(cfg);
    }
}

/// Linear position interpolation (--rotary-seq-len-interpolation-factor 2.5) on the QK-norm path
/// and the fused in-place one: the loss moves off plain RoPE's, and the gradients match finite
/// differences.
#[test]
fn interpolated_rope_gradients_match_finite_differences() {
    use ferrotron_transformer::spec::PositionEmbedding;
    for qk_layernorm in [true, false] {
        let mut cfg = config(true);
        cfg.layer.attention.qk_layernorm = qk_layernorm;
        let plain = cfg.clone();
        cfg.position_embedding = PositionEmbedding::Rope {
            base: 10000.0,
            scaling: None,
            percent: 1.0,
            interpolation: Some(2.5),
            interleaved: false,
        };
        assert_eq!(cfg.rope().and_then(|r| r.interpolation), Some(2.5));
        let (model, table) = GptModel::build(cfg.clone(), &Device::Cpu, DType::F32, 3).unwrap();
        let (pm, pt) = GptModel::build(plain, &Device::Cpu, DType::F32, 3).unwrap();
        let b = batch(2, 6, 11);
        assert_ne!(loss(&model, &table, &b), loss(&pm, &pt, &b), "positions interpolated");
        check(cfg);
    }
}

/// Llama 4's L2 norm of each query and key head (--qk-l2-norm): no parameters (the model's count
/// is the one without QK-norm), each normalised head's mean square is 1 (less eps), the loss moves
/// off the model's without it, and the gradients match finite differences.
#[test]
fn qk_l2_norm_gradients_match_finite_differences() {
    use ferrotron_core::Module;
    let mut plain = config(true);
    plain.layer.attention.qk_layernorm = false;
    let mut cfg = plain.clone();
    cfg.layer.attention.qk_l2_norm = true;
    let (model, table) = GptModel::build(cfg.clone(), &Device::Cpu, DType::F32, 3).unwrap();
    let (pm, pt) = GptModel::build(plain, &Device::Cpu, DType::F32, 3).unwrap();
    assert_eq!(table.metas().len(), pt.metas().len(), "no parameters of its own");
    let b = batch(2, 6, 11);
    assert_ne!(loss(&model, &table, &b), loss(&pm, &pt, &b), "heads normalised");
    let l2 = ferrotron_transformer::norm::HeadNorm::L2 { eps: 1e-6 };
    let x =
        ferrotron_core::Tensor::from_vec((0..24).map(|i| (i as f32 - 7.0) * 0.3).collect(), [2, 3, 4], &Device::Cpu)
            .unwrap();
    let (y, _) = l2.forward(&Cx::new(&table, false), &x).unwrap();
    for row in y.to_vec_f32().unwrap().chunks(4) {
        let ms = row.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / 4.0;
        assert!((ms - 1.0).abs() < 1e-4, "mean square {ms}");
    }
    check(cfg);
}

/// The attention output gate (--attention-output-gate), on the QK-norm path and the fused one:
/// with its gate rows at zero (σ(0) = ½, where Megatron lays them: each group's [queries | gates
/// | key | value]) the model is the plain one with the output projection halved, loss and
/// gradients of every shared weight; and its gradients match finite differences.
#[test]
fn output_gate_gradients_match_finite_differences() {
    for qk_layernorm in [true, false] {
        let mut plain = config(true);
        plain.layer.attention.qk_layernorm = qk_layernorm;
        let mut cfg = plain.clone();
        cfg.layer.attention.output_gate = true;
        let (model, table) = GptModel::build(cfg.clone(), &Device::Cpu, DType::F32, 3).unwrap();
        let (pm, pt) = GptModel::build(plain.clone(), &Device::Cpu, DType::F32, 3).unwrap();
        assert_eq!(table.numel(), cfg.num_params(), "the gates' rows counted");
        let (d, heads, groups) = (plain.head_dim(), plain.num_attention_heads, plain.num_query_groups);
        let g = heads / groups;
        for (id, pid) in table.ids().zip(pt.ids()) {
            let name = &table.meta(id).name;
            assert_eq!(name, &pt.meta(pid).name);
            let w = pt.param(pid).unwrap().to_vec_f32().unwrap();
            let p = table.param(id).unwrap();
            if name.ends_with("linear_qkv.weight") {
                let c = plain.hidden_size;
                let (plain_group, gated_group) = ((g + 2) * d * c, (2 * g + 2) * d * c);
                p.update_f32("t", |v| {
                    for (gv, pv) in v.chunks_mut(gated_group).zip(w.chunks(plain_group)) {
                        gv[..g * d * c].copy_from_slice(&pv[..g * d * c]);
                        gv[g * d * c..2 * g * d * c].fill(0.0);
                        gv[2 * g * d * c..].copy_from_slice(&pv[g * d * c..]);
                    }
                })
                .unwrap();
            } else {
                let half = name.ends_with("linear_proj.weight");
                p.update_f32("t", |v| v.iter_mut().zip(&w).for_each(|(x, w)| *x = if half { 2.0 * w } else { *w }))
                    .unwrap();
            }
        }
        let b = batch(2, 6, 11);
        let (cx, pcx) = (Cx::new(&table, true), Cx::new(&pt, true));
        let (l, saved) = model.forward(&cx, &b).unwrap();
        let (pl, psaved) = pm.forward(&pcx, &b).unwrap();
        assert!((l - pl).abs() <= 1e-6 * pl.abs(), "qk-norm {qk_layernorm}: loss {l} vs plain {pl}");
        model.backward(&cx, saved, 1.0).unwrap();
        pm.backward(&pcx, psaved, 1.0).unwrap();
        for (id, pid) in table.ids().zip(pt.ids()) {
            let name = &table.meta(id).name;
            let (gr, pg) = (table.grad(id).unwrap().to_vec_f32().unwrap(), pt.grad(pid).unwrap().to_vec_f32().unwrap());
            if name.ends_with("linear_qkv.weight") || name.ends_with("linear_proj.weight") {
                continue; // other shapes or scales: covered by the differences below
            }
            for (a, b) in gr.iter().zip(&pg) {
                assert!((a - b).abs() <= 1e-5 * b.abs() + 1e-6, "qk-norm {qk_layernorm} {name}: {a} vs {b}");
            }
        }
        check(cfg);
    }
}

/// The sink softmax (--softmax-type), on the QK-norm path and the fused one: learned logits of
/// −10⁴ vanish against every row's keys (σ(lse + 10⁴) = 1 in f32), so the model is the plain one
/// bit for bit with no gradient on them; at 0 it is the off-by-one model bit for bit; and its
/// gradients (the logits' too) match finite differences.
#[test]
fn sink_softmax_gradients_match_finite_differences() {
    use ferrotron_transformer::spec::SoftmaxType;
    for qk_layernorm in [true, false] {
        let with = |softmax| {
            let mut c = config(true);
            c.layer.attention.qk_layernorm = qk_layernorm;
            c.layer.attention.softmax = softmax;
            c
        };
        let b = batch(2, 6, 11);
        // (loss, every gradient but the logits', the logits' gradients) with the logits at `at`.
        let run = |softmax, at: Option<f32>| {
            let (model, table) = GptModel::build(with(softmax), &Device::Cpu, DType::F32, 3).unwrap();
            assert_eq!(table.numel(), model.config.num_params(), "the logits counted");
            let offsets: Vec<_> = table.ids().filter(|&id| table.meta(id).name.ends_with("softmax_offset")).collect();
            assert_eq!(offsets.len(), if softmax == SoftmaxType::Learnable { 2 } else { 0 }, "one per layer");
            for &id in &offsets {
                let m = table.meta(id);
                assert!(!m.weight_decay && m.local_shape.dims() == [4], "{m:?}");
                table.param(id).unwrap().update_f32("t", |v| v.fill(at.unwrap())).unwrap();
            }
            let cx = Cx::new(&table, true);
            let (l, saved) = model.forward(&cx, &b).unwrap();
            model.backward(&cx, saved, 1.0).unwrap();
            let grads = |sink: bool| -> Vec<f32> {
                let ids = table.ids().filter(|&id| offsets.contains(&id) == sink);
                ids.flat_map(|id| table.grad(id).unwrap().to_vec_f32().unwrap()).collect()
            };
            (l, grads(false), grads(true))
        };
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let plain = run(SoftmaxType::Vanilla, None);
        let far = run(SoftmaxType::Learnable, Some(-1e4));
        assert_eq!((far.0.to_bits(), bits(&far.1)), (plain.0.to_bits(), bits(&plain.1)), "qk-norm {qk_layernorm}");
        assert!(far.2.iter().all(|&g| g == 0.0), "{:?}", far.2);
        let one = run(SoftmaxType::OffByOne, None);
        let zero = run(SoftmaxType::Learnable, Some(0.0));
        assert_ne!(one.0, plain.0, "qk-norm {qk_layernorm}: off-by-one changed nothing");
        assert_eq!((zero.0.to_bits(), bits(&zero.1)), (one.0.to_bits(), bits(&one.1)), "qk-norm {qk_layernorm}");
        assert!(zero.2.iter().all(|&g| g != 0.0), "every head's logit has a gradient: {:?}", zero.2);
        check(with(SoftmaxType::Learnable));
    }
}

/// Learned position ids given with the batch (Megatron's --reset-position-ids): the rows' own
/// positions given so train as without them (loss and every gradient), and reset ones (each
/// row counting from 0 again mid-row) change the loss, their gradients (scattered by id) matching
/// finite differences.
#[test]
fn batch_position_ids_gradients_match_finite_differences() {
    let cfg = config(false);
    let b = batch(2, 6, 11);
    let run = |b: &Batch| {
        let (model, table) = GptModel::build(cfg.clone(), &Device::Cpu, DType::F32, 3).unwrap();
        let cx = Cx::new(&table, true);
        let (l, saved) = model.forward(&cx, b).unwrap();
        model.backward(&cx, saved, 1.0).unwrap();
        let grads: Vec<Vec<f32>> = table.ids().map(|id| table.grad(id).unwrap().to_vec_f32().unwrap()).collect();
        (l, grads)
    };
    let plain = run(&b);
    let own: Vec<u32> = (0..2).flat_map(|_| 0..6).collect();
    let given = run(&b.clone().with_position_ids(own).unwrap());
    assert_eq!(given.0.to_bits(), plain.0.to_bits());
    for (g, p) in given.1.iter().zip(&plain.1) {
        for (a, b) in g.iter().zip(p) {
            assert!((a - b).abs() <= 1e-6 * b.abs() + 1e-7, "{a} vs {b}");
        }
    }
    let reset = b.clone().with_position_ids(vec![0, 1, 2, 0, 1, 0, 0, 1, 2, 3, 4, 5]).unwrap();
    assert_ne!(run(&reset).0, plain.0, "the ids changed nothing");
    check_batch(cfg.clone(), reset);
    assert!(b.with_position_ids(vec![0; 5]).is_err(), "one id a token");
}

/// Document-wise attention masks (Megatron's --reset-attention-mask): a document packed behind
/// another trains as it would leading a row of its own. With RoPE (relative positions) the loss
/// of its tokens and every gradient equal those of the same tokens at the start of a row (the
/// loss counting only them in both); without the masks they differ. The gradients under masks
/// match finite differences.
#[test]
fn document_masks_train_a_packed_document_as_if_alone() {
    let cfg = config(true);
    let dev = Device::Cpu;
    let (a, b, c) = ([3u32, 7], [1u32, 9, 4, 2], [5u32, 6]);
    let (b_next, c_next) = ([9u32, 4, 2, 8], [0u32, 10]);
    // Row 0: A then B, the loss on B's positions; row 1: B then C, the loss on B's.
    let tokens = |x: &[u32], y: &[u32]| ferrotron_core::Tensor::from_vec([x, y].concat(), [1, 6], &dev).unwrap();
    let packed = Batch::masked(tokens(&a, &b), tokens(&[4, 0], &b_next), vec![0., 0., 1., 1., 1., 1.]).unwrap();
    let alone = Batch::masked(tokens(&b, &c), tokens(&b_next, &c_next), vec![1., 1., 1., 1., 0., 0.]).unwrap();
    let masked = packed.clone().with_document_starts(vec![0, 0, 2, 2, 2, 2]).unwrap();
    let run = |batch: &Batch| {
        let (model, table) = GptModel::build(cfg.clone(), &dev, DType::F32, 3).unwrap();
        let cx = Cx::new(&table, true);
        let (l, saved) = model.forward(&cx, batch).unwrap();
        model.backward(&cx, saved, 1.0).unwrap();
        let grads: Vec<Vec<f32>> = table.ids().map(|id| table.grad(id).unwrap().to_vec_f32().unwrap()).collect();
        (l, grads)
    };
    let (want, masked_run, unmasked) = (run(&alone), run(&masked), run(&packed));
    assert!((masked_run.0 - want.0).abs() <= 1e-6 * want.0.abs(), "loss {} vs {}", masked_run.0, want.0);
    for (g, w) in masked_run.1.iter().zip(&want.1) {
        for (x, y) in g.iter().zip(w) {
            assert!((x - y).abs() <= 1e-4 * y.abs() + 1e-6, "gradient {x} vs {y}");
        }
    }
    assert!((unmasked.0 - want.0).abs() > 1e-4, "without the masks B saw A, yet the loss did not move");
    check_batch(cfg.clone(), masked.clone());
    // Bad starts are the batch's error, not a kernel's.
    let e = packed.clone().with_document_starts(vec![0, 2, 2, 2, 2, 2]).unwrap_err().to_string();
    assert!(e.contains("document start 2 of position 1"), "{e}");
    let e = packed.clone().with_document_starts(vec![0, 0, 2, 2, 0, 2]).unwrap_err().to_string();
    assert!(e.contains("document start 0 of position 4") && e.contains("never decrease"), "{e}");
    assert!(packed.with_document_starts(vec![0; 5]).is_err(), "one start a token");
}
