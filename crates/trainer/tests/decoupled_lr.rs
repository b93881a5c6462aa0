//! --decoupled-lr / --decoupled-min-lr (Megatron's decoupled parameter group: the word embedding
//! and the output layer on their own learning rate, the same warmup and decay shape). At --lr it
//! is the plain run bit for bit; at 0 those weights stay where they are while every other weight
//! moves; at another rate it changes the run and trains under tensor (with sequence) and pipeline
//! parallelism as one rank does (two stages hold the tied embedding's copies, each at the
//! decoupled rate; so does the MTP depths' copy on the last stage). Its flags are checked by name.

mod common;

use common::*;
use ferrotron_trainer::checkpoint;
use ferrotron_trainer::settings::{Paths, Settings, TrainArgs};
use ferrotron_trainer::train::train;

fn decoupled(lr: f64, min: Option<f64>, a: TrainArgs) -> TrainArgs {
    TrainArgs { decoupled_lr: Some(lr), decoupled_min_lr: min, ..a }
}

#[test]
fn the_main_rate_changes_nothing_and_zero_holds_the_embedding_and_output_layer() {
    let base = tiny_args(true);
    let s = settings(&base);
    let plain = run(&s, 1);
    let same = run(&settings(&decoupled(s.lr, None, base.clone())), 1);
    assert_eq!(bits(&same.losses), bits(&plain.losses), "--decoupled-lr at --lr");
    assert_eq!(bits(&same.grad_norms), bits(&plain.grad_norms));

    // Saved at iterations 4 and 8 (tiny_args' --save-interval 4).
    let dir = tmp("decoupled-zero");
    let held = settings(&decoupled(0.0, Some(0.0), base));
    train(&held, &Paths { save: Some(dir.clone()), ..Paths::default() }).unwrap();
    let load = |it: u64| checkpoint::load_params(&checkpoint::iter_dir(&dir, it)).unwrap().tensors;
    let (at4, at8) = (load(4), load(8));
    let mut held_names = vec![];
    for (name, (_, w8)) in &at8 {
        let w4 = &at4[name].1;
        let moved = w4.iter().zip(w8).any(|(a, b)| a != b);
        if name == "embedding.word_embeddings.weight" || name == "output_layer.weight" {
            assert!(!moved, "{name} moved at a decoupled rate of 0");
            held_names.push(name.as_str());
        } else if name.ends_with("linear_qkv.weight") || name.ends_with("linear_fc1.weight") {
            assert!(moved, "{name} did not move");
        }
    }
    held_names.sort();
    assert_eq!(held_names, ["embedding.word_embeddings.weight", "output_layer.weight"], "the Llama is untied");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_decoupled_rate_trains_as_one_rank_under_tp_and_on_two_stages() {
    // The GPT ties its embedding: under two pipeline stages the last holds a copy, which must
    // step at the decoupled rate as the first stage's table does.
    for llama in [false, true] {
        let s = settings(&decoupled(1e-2, Some(1e-3), tiny_args(llama)));
        let one = run(&s, 1);
        let plain = run(&settings(&tiny_args(llama)), 1);
        assert_ne!(bits(&one.losses), bits(&plain.losses), "llama {llama}: the decoupled rate changed nothing");
        let mut tp = s.clone();
        tp.tensor_model_parallel_size = 2;
        tp.sequence_parallel = true;
        follows(&format!("llama {llama}: tp2 with SP"), &run(&tp, 2), &one);
        let mut pp = s.clone();
        pp.pipeline_model_parallel_size = 2;
        follows(&format!("llama {llama}: pp2"), &run(&pp, 2), &one);
    }
}

#[test]
fn decoupled_rates_that_cannot_schedule_are_refused_by_name() {
    let refused = |a: TrainArgs| format!("{:#}", Settings::resolve(&a).unwrap_err());
    let e = refused(TrainArgs { decoupled_min_lr: Some(1e-5), ..tiny_args(true) });
    assert!(e.contains("--decoupled-min-lr 0.00001 is what --decoupled-lr decays to"), "{e}");
    // Below --min-lr (the default floor) without a floor of its own.
    let e = refused(decoupled(1e-5, None, tiny_args(true)));
    assert!(e.contains("--decoupled-lr 0.00001 decays to --min-lr"), "{e}");
    let e = refused(decoupled(1e-3, Some(2e-3), tiny_args(true)));
    assert!(e.contains("decays to --decoupled-min-lr 0.002"), "{e}");
}

/// Multi-token prediction under two pipeline stages: the untied Llama's last stage holds its own
/// copy of the word embedding for the depths, which Megatron puts in the decoupled group too; at
/// a decoupled rate the layout follows one rank only if that copy steps at it.
#[test]
fn the_mtp_depths_embedding_copy_steps_at_the_decoupled_rate() {
    let args = TrainArgs { mtp_num_layers: Some(1), ..decoupled(1e-2, Some(1e-3), tiny_args(true)) };
    let s = settings(&args);
    let one = run(&s, 1);
    let mut pp = s.clone();
    pp.pipeline_model_parallel_size = 2;
    follows("MTP, pp2", &run(&pp, 2), &one);
}
