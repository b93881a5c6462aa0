//! --reset-position-ids: learned absolute positions count from 0 again after each end of
//! document in a sample. It changes a GPT-2 style run (whose samples hold several documents),
//! trains under tensor (with sequence), context and pipeline parallelism as one rank does (the
//! ids sliced, split into chunks, on the first stage), and changes nothing with rotary
//! embeddings, which take no position ids in Megatron Core. (The ids against Megatron's rule:
//! the data crate's unit test; their gradients: the transformer crate's gradcheck.)

mod common;

use common::*;
use ferrotron_trainer::settings::{Settings, TrainArgs};

fn reset(a: TrainArgs) -> TrainArgs {
    TrainArgs { reset_position_ids: true, ..a }
}

#[test]
fn reset_positions_train_as_one_rank_under_tp_cp_and_pp() {
    let s = settings(&reset(tiny_args(false)));
    let one = run(&s, 1);
    assert_ne!(bits(&one.losses), bits(&run(&settings(&tiny_args(false)), 1).losses), "nothing was reset");
    follows_tp_sp_and_cp(&s, &one);
    let mut pp = s.clone();
    pp.pipeline_model_parallel_size = 2;
    follows("pp2", &run(&pp, 2), &one);
}

#[test]
fn rotary_embeddings_take_no_position_ids() {
    let plain = run(&settings(&tiny_args(true)), 1);
    assert_eq!(bits(&run(&settings(&reset(tiny_args(true))), 1).losses), bits(&plain.losses));
}

#[test]
fn what_the_ids_do_not_reach_is_refused_by_name() {
    let mtp = reset(TrainArgs { mtp_num_layers: Some(1), ..tiny_args(false) });
    let e = format!("{:#}", Settings::resolve(&mtp).unwrap_err());
    assert!(e.contains("--reset-position-ids with learned positions and --mtp-num-layers"), "{e}");
}
