//! --attention-output-gate (a sigmoid gate on each head's output, projected beside the queries:
//! Qwen3-Next's gated attention, Megatron's layout). It changes the run, trains under tensor
//! (with sequence) and context parallelism as one rank does, with the core attention recomputed
//! (selective) as without, with QK-norm and without (the split and the fused attention paths),
//! round-trips through the model flags, and is refused by name with multi-latent attention and
//! for a Hugging Face export. (The layout against the plain model: the transformer crate's
//! gradcheck.)

mod common;

use common::*;
use ferrotron_trainer::settings::{Settings, TrainArgs};

#[test]
fn gated_attention_trains_as_one_rank_under_tp_cp_and_recompute() {
    for qk_layernorm in [false, true] {
        let s = settings(&TrainArgs { attention_output_gate: true, qk_layernorm, ..tiny_args(true) });
        let c = s.model_config().unwrap();
        assert!(c.layer.attention.output_gate);
        assert!(ferrotron_trainer::settings::model_args(&c).attention_output_gate);
        let one = run(&s, 1);
        let plain = run(&settings(&TrainArgs { qk_layernorm, ..tiny_args(true) }), 1);
        assert_ne!(bits(&one.losses), bits(&plain.losses), "qk-norm {qk_layernorm}: the gate changed nothing");
        follows_tp_sp_and_cp(&s, &one);
        let mut selective = s.clone();
        selective.recompute_granularity = Some("selective".into());
        assert_eq!(bits(&run(&selective, 1).losses), bits(&one.losses), "qk-norm {qk_layernorm}: recomputed core");
        let e = ferrotron_models::hf::HfArch::of(&c).unwrap_err().to_string();
        assert!(e.contains("--attention-output-gate"), "{e}");
    }
}

#[test]
fn gated_attention_is_refused_with_multi_latent_attention() {
    let e = format!("{:#}", Settings::resolve(&TrainArgs { attention_output_gate: true, ..mla_args() }).unwrap_err());
    assert!(e.contains("--attention-output-gate with multi-latent attention"), "{e}");
}
