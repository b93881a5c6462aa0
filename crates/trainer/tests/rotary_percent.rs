//! --rotary-percent (Megatron's; GLM's and Qwen3-Next's partial rotary): RoPE over the first
//! ⌊head_dim · percent⌋ features of each head. It changes the run, trains under tensor (with
//! sequence) and context parallelism as one rank does, round-trips through the model flags, and
//! is refused by name where it cannot apply (a rotary dim that is odd; a Hugging Face export).

mod common;

use common::*;
use ferrotron_trainer::settings::TrainArgs;

#[test]
fn partial_rotary_trains_as_one_rank_under_tp_and_cp() {
    let s = settings(&TrainArgs { rotary_percent: Some(0.5), ..tiny_args(true) });
    let c = s.model_config().unwrap();
    assert_eq!((c.head_dim(), c.rotary_dim()), (8, 4));
    let back = ferrotron_trainer::settings::model_args(&c);
    assert_eq!(back.rotary_percent, Some(0.5));
    let one = run(&s, 1);
    let whole = run(&settings(&tiny_args(true)), 1);
    assert_ne!(bits(&one.losses), bits(&whole.losses), "half of each head rotates");
    follows_tp_sp_and_cp(&s, &one);
    let e = ferrotron_models::hf::HfArch::of(&c).unwrap_err().to_string();
    assert!(e.contains("--rotary-percent 0.5"), "{e}");
}
