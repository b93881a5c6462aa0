//! --pipeline-model-parallel-layout (Megatron's explicit stage layout): uneven stages, stages
//! that hold only the embedding or only the loss, interleaved (virtual) stages the layout sets,
//! and the MTP depths with the loss each train as one rank does; layouts that do not fit the
//! model, or that another stage flag contradicts, are refused by name. The same for
//! --account-for-embedding/loss-in-pipeline-split's even split. (The string's grammar: the
//! parallel crate's `pipeline::layout` tests.)
// A rank's chunks are a Vec of ranges: one range without virtual stages.
#![allow(clippy::single_range_in_vec_init)]

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

/// --account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split: the
/// embedding and the loss counted as layers in the even split (Megatron's), the first and last
/// stages holding a decoder layer fewer, with virtual stages too; each trains as one rank does.
#[test]
fn the_embedding_and_loss_counted_as_layers_train_as_one_rank() {
    let layers = |n: usize| TrainArgs { num_layers: Some(n), ..tiny_args(true) };
    let pp2 = |a: TrainArgs| TrainArgs { pipeline_model_parallel_size: Some(2), nproc: Some(2), ..a };
    let both = |a: TrainArgs| TrainArgs {
        account_for_embedding_in_pipeline_split: true,
        account_for_loss_in_pipeline_split: true,
        ..pp2(a)
    };
    let six = run(&settings(&layers(6)), 1);
    // 6 layers + the embedding + the loss = 8 over 2 stages, and over 2 × 2 virtual ones.
    let interleaved = TrainArgs { num_virtual_stages_per_pipeline_rank: Some(2), ..both(layers(6)) };
    for (tag, args, ranks) in [
        ("both", both(layers(6)), [vec![0..3], vec![3..6]]),
        ("both, 2 virtual stages", interleaved, [vec![0..1, 3..5], vec![1..3, 5..6]]),
    ] {
        let s = settings(&args);
        for (rank, want) in ranks.iter().enumerate() {
            assert_eq!(&s.stage_plan(rank).unwrap().chunks, want, "{tag} rank {rank}");
        }
        follows(tag, &run(&s, 2), &six);
    }
    // The embedding alone: 5 + 1 over 2 stages.
    let s = settings(&TrainArgs { account_for_embedding_in_pipeline_split: true, ..pp2(layers(5)) });
    assert_eq!((s.stage_plan(0).unwrap().chunks, s.stage_plan(1).unwrap().chunks), (vec![0..2], vec![2..5]));
    follows("embedding", &run(&s, 2), &run(&settings(&layers(5)), 1));
    let first = TrainArgs { decoder_first_pipeline_num_layers: Some(1), ..both(layers(6)) };
    refused(first, 2, "which --decoder-first/last-pipeline-num-layers replace");
    let four = TrainArgs { pipeline_model_parallel_size: Some(4), ..both(layers(4)) };
    refused(
        four,
        4,
        "--num-layers 4 counted as 6 under --account-for-embedding-in-pipeline-split and --account-for-loss-in-pipeline-split does not divide over 4 pipeline stages",
    );
    let laid = TrainArgs { pipeline_model_parallel_layout: Some("Ettt|tttL".into()), ..both(layers(6)) };
    refused(laid, 2, "and so does --account-for-embedding/loss-in-pipeline-split");
}
