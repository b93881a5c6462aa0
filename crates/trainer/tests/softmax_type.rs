//! --softmax-type off-by-one / learnable (the sink softmax: one more logit a head in every
//! attention row, a key with no value; learned, it is gpt-oss's attention sinks). Each changes
//! the run, trains under tensor (with sequence) and context parallelism as one rank does, with
//! the core attention recomputed (selective) as without, on the split (QK-norm) and fused
//! attention paths and under multi-latent attention; the learned logits are Megatron's
//! `core_attention.softmax_offset`, split with the heads; the type round-trips through the model
//! flags, a checkpoint resumes only under its own type, and a Hugging Face export is refused.
//! (The kernels against a naive softmax and finite differences: the kernels crate's ops tests;
//! the model's gradients: the transformer crate's gradcheck.)

mod common;

use common::*;
use ferrotron_core::{DType, Device};
use ferrotron_trainer::settings::{Paths, Settings, TrainArgs, model_args};
use ferrotron_transformer::GptModel;
use ferrotron_transformer::spec::SoftmaxType;

fn typed(kind: &str, a: TrainArgs) -> TrainArgs {
    TrainArgs { softmax_type: Some(kind.into()), ..a }
}

#[test]
fn sink_softmaxes_train_as_one_rank_under_tp_cp_and_recompute() {
    for (kind, want) in [("off-by-one", SoftmaxType::OffByOne), ("learnable", SoftmaxType::Learnable)] {
        for qk_layernorm in [false, true] {
            let tag = format!("{kind} qk-norm {qk_layernorm}");
            let s = settings(&typed(kind, TrainArgs { qk_layernorm, ..tiny_args(true) }));
            let c = s.model_config().unwrap();
            assert_eq!(c.layer.attention.softmax, want);
            assert_eq!(model_args(&c).softmax_type.as_deref(), Some(kind), "the model flags keep it");
            let one = run(&s, 1);
            let plain = run(&settings(&TrainArgs { qk_layernorm, ..tiny_args(true) }), 1);
            assert_ne!(bits(&one.losses), bits(&plain.losses), "{tag}: the sink changed nothing");
            follows_tp_sp_and_cp(&s, &one);
            let mut selective = s.clone();
            selective.recompute_granularity = Some("selective".into());
            assert_eq!(bits(&run(&selective, 1).losses), bits(&one.losses), "{tag}: recomputed core");
            let e = ferrotron_models::hf::HfArch::of(&c).unwrap_err().to_string();
            assert!(e.contains(&format!("--softmax-type {kind}")), "{e}");
        }
    }
}

#[test]
fn learned_sinks_are_megatrons_softmax_offsets_split_with_the_heads() {
    let s = settings(&typed("learnable", tiny_args(true)));
    let (_, table) = GptModel::build(s.model_config().unwrap(), &Device::Cpu, DType::F32, 1).unwrap();
    let names: Vec<_> = table.metas().iter().filter(|m| m.name.ends_with("softmax_offset")).collect();
    assert_eq!(names.len(), 2, "one a layer");
    let m = names[0];
    assert_eq!(m.name, "decoder.layers.0.self_attention.core_attention.softmax_offset");
    assert_eq!((m.global_shape.dims(), m.split_dim, m.weight_decay), (&[4usize][..], Some(0), false));
    // Initialised as the other weights (normal, --init-method-std), not to a constant.
    let v = table.param(table.id(&m.name).unwrap()).unwrap().to_vec_f32().unwrap();
    assert!(v.iter().all(|x| x.abs() < 0.2) && v.windows(2).any(|w| w[0] != w[1]), "{v:?}");
}

#[test]
fn sinks_on_multi_latent_attention_train_as_one_rank_under_tp_and_cp() {
    let s = settings(&typed("learnable", mla_args()));
    let one = run(&s, 1);
    assert_ne!(bits(&one.losses), bits(&run(&settings(&mla_args()), 1).losses), "the sink changed nothing");
    follows_tp_sp_and_cp(&s, &one);
}

#[test]
fn a_checkpoint_resumes_only_under_its_softmax_type() {
    let dir = tmp("softmax-type");
    let s = settings(&typed("off-by-one", tiny_args(true)));
    ferrotron_trainer::train::train(&s, &Paths { save: Some(dir.clone()), ..Paths::default() }).unwrap();
    let more = |a: TrainArgs| settings(&TrainArgs { train_iters: Some(10), ..a });
    let load = || Paths { load: Some(dir.clone()), ..Paths::default() };
    for other in [tiny_args(true), typed("learnable", tiny_args(true))] {
        let e = ferrotron_trainer::train::train(&more(other), &load()).unwrap_err();
        assert!(format!("{e:#}").contains("saved with --softmax-type off-by-one"), "{e:#}");
    }
    let resumed = ferrotron_trainer::train::train(&more(typed("off-by-one", tiny_args(true))), &load()).unwrap();
    assert_eq!(resumed.losses.iter().map(|l| l.0).collect::<Vec<_>>(), [9, 10]);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn an_unknown_softmax_type_is_refused_by_name() {
    let e = format!("{:#}", Settings::resolve(&typed("sparsemax", tiny_args(true))).unwrap_err());
    assert!(e.contains("--softmax-type sparsemax: use vanilla, off-by-one or learnable"), "{e}");
}
