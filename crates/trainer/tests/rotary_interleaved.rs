//! --rotary-interleaved (rotary pairs of adjacent features, GPT-J's layout). It changes the run,
//! trains under tensor (with sequence) and context parallelism as one rank does, round-trips
//! through the model flags, resumes only under the flag it was saved with, and exports to a
//! Hugging Face Llama / Qwen3 (rotate-half) whose logits are the interleaved model's: the export
//! de-interleaves each query and key head (and QK-norm weight), and imported back it is a
//! half-split model computing the same function. Refused with learned positions and MLA.

mod common;

use common::*;
use ferrotron_core::{Cx, DType, Device, Tensor};
use ferrotron_trainer::checkpoint;
use ferrotron_trainer::convert::{ConvertArgs, convert};
use ferrotron_trainer::settings::{Paths, Settings, TrainArgs, model_args};
use ferrotron_transformer::spec::PositionEmbedding;
use ferrotron_transformer::{GptModel, TransformerConfig};
use std::path::Path;

fn interleaved(a: TrainArgs) -> TrainArgs {
    TrainArgs { rotary_interleaved: true, ..a }
}

#[test]
fn interleaved_pairs_train_as_one_rank_under_tp_and_cp_and_resume_only_as_saved() {
    let s = settings(&interleaved(tiny_args(true)));
    let c = s.model_config().unwrap();
    assert!(c.rope().unwrap().interleaved);
    assert!(model_args(&c).rotary_interleaved, "the model flags keep it");

    let dir = tmp("rope-interleaved");
    let one = ferrotron_trainer::train::train(&s, &Paths { save: Some(dir.clone()), ..Paths::default() }).unwrap();
    let plain = run(&settings(&tiny_args(true)), 1);
    assert_ne!(bits(&one.losses), bits(&plain.losses), "the pairs' layout changed nothing");
    follows_tp_sp_and_cp(&s, &one);

    let more = |a: TrainArgs| settings(&TrainArgs { train_iters: Some(10), ..a });
    let e =
        ferrotron_trainer::train::train(&more(tiny_args(true)), &Paths { load: Some(dir.clone()), ..Paths::default() })
            .unwrap_err();
    assert!(format!("{e:#}").contains("saved with --rotary-interleaved and this run is without it"), "{e:#}");
    let resumed = ferrotron_trainer::train::train(
        &more(interleaved(tiny_args(true))),
        &Paths { load: Some(dir.clone()), ..Paths::default() },
    )
    .unwrap();
    assert_eq!(resumed.losses.iter().map(|l| l.0).collect::<Vec<_>>(), [9, 10]);
    let _ = std::fs::remove_dir_all(dir);
}

/// The logits of `c` with the parameters of the checkpoint in `dir` on fixed tokens.
fn logits(c: TransformerConfig, dir: &Path) -> Vec<f32> {
    let (model, table) = GptModel::build(c, &Device::Cpu, DType::F32, 1).unwrap();
    checkpoint::restore_params(&checkpoint::load_params(dir).unwrap(), &table).unwrap();
    let ids: Vec<u32> = (0..2 * 24).map(|i| (i * 37 % 250) as u32).collect();
    let cx = Cx::new(&table, false);
    model.logits(&cx, &Tensor::from_vec(ids, [2, 24], &Device::Cpu).unwrap()).unwrap().to_vec_f32().unwrap()
}

#[test]
fn an_interleaved_model_exports_as_rotate_half_heads_with_the_same_logits() {
    for qk_norm in [false, true] {
        let tag = format!("rope-il-export-{qk_norm}");
        let (ck, hf_dir, back) = (tmp(&format!("{tag}-ck")), tmp(&format!("{tag}-hf")), tmp(&format!("{tag}-back")));
        // QK-norm's weights (Qwen3's q_norm / k_norm) are permuted with the heads.
        let a = TrainArgs { train_iters: Some(3), qk_layernorm: qk_norm, ..interleaved(tiny_args(true)) };
        let s = settings(&a);
        ferrotron_trainer::train::train(&s, &Paths { save: Some(ck.clone()), ..Paths::default() }).unwrap();
        let conv = ConvertArgs::new;
        convert(&conv("ferrotron", "hf", &ck, &hf_dir)).unwrap();
        convert(&conv("hf", "ferrotron", &hf_dir, &back)).unwrap();
        let imported = checkpoint::load_params(&back).unwrap().state.settings.model_config().unwrap();
        assert!(
            matches!(imported.position_embedding, PositionEmbedding::Rope { interleaved: false, .. }),
            "HF's heads are rotate-half"
        );
        let (want, got) = (logits(s.model_config().unwrap(), &ck), logits(imported, &back));
        let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
        assert!(scale > 0.1, "logits too flat to compare: {scale}");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!((g - w).abs() <= 1e-5 * scale.max(1.0), "qk-norm {qk_norm}: logit {i}: {g} vs {w}");
        }
        for d in [ck, hf_dir, back] {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

#[test]
fn interleaved_pairs_are_refused_where_they_cannot_apply() {
    let refused = |a: TrainArgs| format!("{:#}", Settings::resolve(&a).unwrap_err());
    let e = refused(interleaved(tiny_args(false)));
    assert!(e.contains("--rotary-interleaved") && e.contains("--position-embedding-type is learned_absolute"), "{e}");
    let e = refused(interleaved(mla_args()));
    assert!(e.contains("--rotary-interleaved with multi-latent attention"), "{e}");
}
