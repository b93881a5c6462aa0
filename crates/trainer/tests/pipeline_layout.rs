//! --pipeline-model-parallel-layout (Megatron's explicit stage layout): uneven stages, stages
//! that hold only the embedding or only the loss, interleaved (virtual) stages the layout sets,
//! and the MTP depths with the loss each train as one rank does; layouts that do not fit the
//! model, or that another stage flag contradicts, are refused by name. (The string's grammar:
//! the parallel crate's `pipeline::layout` tests.)

mod common;

use common::*;
use ferrotron_trainer::settings::{Settings, TrainArgs};

/// The tiny Llama at four layers, its stages given by `layout` over `pp` thread ranks.
fn laid_out(base: TrainArgs, pp: usize, layout: &str) -> Settings {
    settings(&TrainArgs {
        pipeline_model_parallel_size: Some(pp),
        pipeline_model_parallel_layout: Some(layout.into()),
        nproc: Some(pp),
        ..base
    })
}

fn four_layers() -> TrainArgs {
    TrainArgs { num_layers: Some(4), ..tiny_args(true) }
}

#[test]
fn explicit_layouts_train_as_one_rank() {
    let one = run(&settings(&four_layers()), 1);
    for (pp, layout, chunks) in [
        (2, "Et|tttL", vec![vec![0..1], vec![1..4]]),
        (4, "E|tt|tt|L", vec![vec![0..0], vec![0..2], vec![2..4], vec![4..4]]),
        (2, "Et|t|t|tL", vec![vec![0..1, 2..3], vec![1..2, 3..4]]),
        (2, "E(t|)*3tL", vec![vec![0..1, 2..3], vec![1..2, 3..4]]),
    ] {
        let s = laid_out(four_layers(), pp, layout);
        for (rank, want) in chunks.iter().enumerate() {
            assert_eq!(&s.stage_plan(rank).unwrap().chunks, want, "{layout} rank {rank}");
        }
        follows(layout, &run(&s, pp), &one);
    }
}

#[test]
fn mtp_depths_go_with_the_loss() {
    let mtp = TrainArgs { mtp_num_layers: Some(1), ..four_layers() };
    let one = run(&settings(&mtp), 1);
    follows("Ett|ttmL", &run(&laid_out(mtp.clone(), 2, "Ett|ttmL"), 2), &one);
    refused(
        TrainArgs {
            pipeline_model_parallel_size: Some(2),
            pipeline_model_parallel_layout: Some("Ett|tt|m|L".into()),
            ..mtp
        },
        2,
        "MTP on a stage of its own is not built",
    );
}

#[test]
fn layouts_that_do_not_fit_are_refused_by_name() {
    let with = |pp: usize, layout: &str, more: TrainArgs| TrainArgs {
        pipeline_model_parallel_size: Some(pp),
        pipeline_model_parallel_layout: Some(layout.into()),
        ..more
    };
    refused(with(2, "Et|tL", four_layers()), 2, "2 decoder layers (t) for --num-layers 4");
    refused(with(2, "Et|t|ttL", four_layers()), 2, "3 stages, not a multiple of --pipeline-model-parallel-size 2");
    refused(with(2, "tE|tttL", four_layers()), 2, "the embedding E must come first");
    let first = TrainArgs { decoder_first_pipeline_num_layers: Some(1), ..four_layers() };
    refused(with(2, "Et|tttL", first), 2, "and so does --decoder-first-pipeline-num-layers");
    let virtual_stages = TrainArgs { num_layers_per_virtual_pipeline_stage: Some(1), ..four_layers() };
    refused(with(2, "Et|t|t|tL", virtual_stages), 2, "and so does --num-layers-per-virtual-pipeline-stage");
    // Megatron's `None` is no layout.
    let s = settings(&with(1, "None", four_layers()));
    assert_eq!(s.pipeline_model_parallel_layout, None);
    assert_eq!(s.stage_plan(0).unwrap(), ferrotron_parallel::pipeline::StagePlan::whole(4));
}
