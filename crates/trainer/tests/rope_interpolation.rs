//! --rotary-seq-len-interpolation-factor (linear position interpolation: positions divided by the
//! factor, transformers' rope_type linear). It changes the run, trains under tensor (with
//! sequence) and context parallelism as one rank does, round-trips through the model flags and a
//! Hugging Face config, and is refused by name where it cannot apply (learned positions,
//! multi-latent attention, beside Llama 3's scaling in a Hugging Face config).

mod common;

use common::*;
use ferrotron_models::hf;
use ferrotron_trainer::settings::{Settings, TrainArgs};

#[test]
fn interpolated_positions_train_as_one_rank_under_tp_and_cp() {
    let args = TrainArgs { rotary_seq_len_interpolation_factor: Some(4.0), ..tiny_args(true) };
    let s = settings(&args);
    let c = s.model_config().unwrap();
    assert_eq!(c.rope().and_then(|r| r.interpolation), Some(4.0));
    assert_eq!(ferrotron_trainer::settings::model_args(&c).rotary_seq_len_interpolation_factor, Some(4.0));
    // 1 (as Megatron scripts pass it) is no interpolation.
    let one_arg = settings(&TrainArgs { rotary_seq_len_interpolation_factor: Some(1.0), ..tiny_args(true) });
    assert_eq!(one_arg.model_config().unwrap().rope().and_then(|r| r.interpolation), None);

    let one = run(&s, 1);
    let plain = run(&settings(&tiny_args(true)), 1);
    assert_ne!(bits(&one.losses), bits(&plain.losses), "positions interpolated");
    follows_tp_sp_and_cp(&s, &one);

    // Hugging Face: rope_scaling {rope_type linear, factor 4} and back.
    let arch = hf::HfArch::of(&c).unwrap();
    let v = hf::to_hf_config(arch, &c, "float32");
    assert_eq!(
        (v["rope_scaling"]["rope_type"].as_str(), v["rope_scaling"]["factor"].as_f64()),
        (Some("linear"), Some(4.0))
    );
    assert_eq!(hf::from_hf_config(&v).unwrap().config.position_embedding, c.position_embedding);
}

#[test]
fn interpolation_is_refused_where_it_cannot_apply() {
    let refused = |a: TrainArgs| format!("{:#}", Settings::resolve(&a).unwrap_err());
    let factor = |f: f64, a: TrainArgs| TrainArgs { rotary_seq_len_interpolation_factor: Some(f), ..a };
    let e = refused(factor(2.0, tiny_args(false)));
    assert!(e.contains("--position-embedding-type is learned_absolute"), "{e}");
    let e = refused(factor(2.0, mla_args()));
    assert!(e.contains("--rotary-seq-len-interpolation-factor 2 with multi-latent attention"), "{e}");
    let e = refused(factor(-1.0, tiny_args(true)));
    assert!(e.contains("-1 must be positive"), "{e}");
    let c = settings(&factor(2.0, TrainArgs { use_rope_scaling: true, ..tiny_args(true) })).model_config().unwrap();
    let e = hf::HfArch::of(&c).unwrap_err().to_string();
    assert!(e.contains("linear position interpolation (2)"), "{e}");
}
