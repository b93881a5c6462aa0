//! The loss a step reports is Megatron's: the sum of every unmasked token's loss over their count,
//! across micro-batches and data-parallel ranks, not the mean of the micro-batches' means (the
//! two differ when masks differ, as with --eod-mask-loss).

mod common;

use common::*;
use ferrotron_comm::run_ranks;
use ferrotron_core::{Cx, DType, Device};
use ferrotron_optim::{AdamConfig, GradSync, Optimizer, train_step};
use ferrotron_parallel::{Layout, ProcessGroups, TensorParallel};
use ferrotron_transformer::{Batch, GptModel};
use std::time::Duration;

/// Micro-batch j with all but `keep` of its positions masked out.
fn masked(j: usize, keep: usize) -> Batch {
    let b = micro_batch(j);
    let mask: Vec<f32> = (0..MICRO * SEQ).map(|i| if i < keep { 1.0 } else { 0.0 }).collect();
    Batch::masked(b.tokens.clone(), b.labels.clone(), mask).unwrap()
}

#[test]
fn a_step_reports_the_token_weighted_loss_on_one_rank_and_over_data_parallel_ranks() {
    let micros = [masked(0, MICRO * SEQ), masked(1, 3)];
    // Each micro-batch's mean and count before the update, from a plain forward.
    let (model, table) = GptModel::build(config(false), &Device::Cpu, DType::F32, 1234).unwrap();
    let cx = Cx::new(&table, false);
    let parts: Vec<(f64, f64)> = micros.iter().map(|b| (model.forward(&cx, b).unwrap().0, b.num_tokens())).collect();
    let weighted = parts.iter().map(|(m, n)| m * n).sum::<f64>() / parts.iter().map(|(_, n)| n).sum::<f64>();
    let mean_of_means = parts.iter().map(|(m, _)| m).sum::<f64>() / 2.0;
    assert!((weighted - mean_of_means).abs() > 1e-3, "the masks must make the two differ");
    // One rank with both micro-batches, then two data-parallel ranks with one each.
    for dp in [1, 2] {
        let losses = run_ranks(dp, Duration::from_secs(60), |rank, world| {
            let g = ProcessGroups::new(world, Layout::new(dp, 1, 1, 1, 1).unwrap()).unwrap();
            let tp = TensorParallel::new(g.tp.clone(), false);
            let (model, table) =
                GptModel::build_parallel(config(false), &tp, &Device::Cpu, DType::F32, 1234, 1).unwrap();
            let mut sync = GradSync::new(&table, g.dp_cp.clone(), g.tp.clone(), 2000, false, false);
            let mut opt = Optimizer::new_parallel(&table, AdamConfig::default(), &sync, g.mp.clone(), 0).unwrap();
            let mine: Vec<Batch> = micros.iter().skip(rank).step_by(dp).cloned().collect();
            train_step(&model, &table, &mut sync, &mut opt, &mine, 1e-3).unwrap().loss
        });
        for l in losses {
            let l = l.unwrap();
            assert!((l - weighted).abs() < 1e-5 * weighted, "dp {dp}: reported {l}, token-weighted {weighted}");
        }
    }
}
