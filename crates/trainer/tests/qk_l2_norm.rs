//! --qk-l2-norm (Llama 4's parameter-free L2 norm of each query and key head): it changes the run,
//! trains under tensor (with sequence) and context parallelism as one rank does, round-trips
//! through the model flags, and is refused by name beside --qk-layernorm, with multi-latent
//! attention and for a Hugging Face export.

mod common;

use common::*;
use ferrotron_trainer::settings::{Settings, TrainArgs};

#[test]
fn qk_l2_norm_trains_as_one_rank_under_tp_and_cp() {
    let s = settings(&TrainArgs { qk_l2_norm: true, ..tiny_args(true) });
    let c = s.model_config().unwrap();
    assert!(c.layer.attention.qk_l2_norm && !c.layer.attention.qk_layernorm);
    assert!(ferrotron_trainer::settings::model_args(&c).qk_l2_norm);
    let one = run(&s, 1);
    let plain = run(&settings(&tiny_args(true)), 1);
    assert_ne!(bits(&one.losses), bits(&plain.losses), "heads normalised");
    follows_tp_sp_and_cp(&s, &one);
    let e = ferrotron_models::hf::HfArch::of(&c).unwrap_err().to_string();
    assert!(e.contains("--qk-l2-norm"), "{e}");
}

#[test]
fn qk_l2_norm_is_refused_where_megatron_refuses_it() {
    let refused = |a: TrainArgs| format!("{:#}", Settings::resolve(&a).unwrap_err());
    let e = refused(TrainArgs { qk_l2_norm: true, qk_layernorm: true, ..tiny_args(true) });
    assert!(e.contains("--qk-layernorm and --qk-l2-norm"), "{e}");
    let e = refused(TrainArgs { qk_l2_norm: true, ..mla_args() });
    assert!(e.contains("--qk-l2-norm"), "{e}");
}
