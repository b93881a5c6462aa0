//! `StepGraph` on the CPU, where there is nothing to capture: its warm-up steps are plain eager
//! steps (the same losses as `queue_train_step`, with dropout too), and the capture after them is
//! refused with an error naming the device. (Capture and replay themselves, dropout's shifted
//! masks included, run on a GPU: the trainer's `cuda_graph` test.)

mod common;

use common::*;
use ferrotron_comm::{Communicator, run_ranks};
use ferrotron_core::{DType, Device, Draw};
use ferrotron_optim::{AdamConfig, GradSync, Optimizer, StepGraph, queue_train_step};
use ferrotron_parallel::{Layout, ProcessGroups, TensorParallel};
use ferrotron_transformer::{Batch, GptModel, TransformerConfig};
use std::sync::Arc;
use std::time::Duration;

/// Losses of `steps` steps, through a `StepGraph` with `warmup` eager steps or (None) plain
/// `queue_train_step`; the first error ends the run and is returned with the losses before it.
fn run(
    cfg: TransformerConfig,
    warmup: Option<usize>,
    steps: usize,
    world: Arc<dyn Communicator>,
) -> (Vec<f64>, Option<String>) {
    let g = ProcessGroups::new(world, Layout::new(1, 1, 1, 1, 1).unwrap()).unwrap();
    let tp = TensorParallel::new(g.tp.clone(), false);
    let (model, table) = GptModel::build_parallel(cfg, &tp, &Device::Cpu, DType::F32, 1234, 1).unwrap();
    let mut sync = GradSync::new(&table, g.dp_cp.clone(), g.tp.clone(), 2000, false, false);
    let mut opt = Optimizer::new_parallel(&table, AdamConfig::default(), &sync, g.mp.clone(), 0).unwrap();
    let mut graph = warmup.map(StepGraph::new);
    let mut losses = vec![];
    for step in 0..steps {
        // Each micro-batch's draws from its first sample's place in the run (dropout).
        let micros: Vec<Batch> = (0..GLOBAL_MICROS)
            .map(|j| {
                micro_batch(j).with_draw(Draw { seed: 7, first_sample: ((step * GLOBAL_MICROS + j) * MICRO) as u64 })
            })
            .collect();
        let lr = 1e-3 * (step + 1) as f32;
        let q = match graph.as_mut() {
            Some(gr) => gr.queue(&model, &table, &mut sync, &mut opt, &micros, lr),
            None => queue_train_step(&model, &table, &mut sync, &mut opt, &micros, lr),
        };
        match q.and_then(|q| q.read()) {
            Ok(out) => losses.push(out.loss),
            Err(e) => return (losses, Some(e.to_string())),
        }
    }
    (losses, None)
}

fn one_rank(cfg: TransformerConfig, warmup: Option<usize>, steps: usize) -> (Vec<f64>, Option<String>) {
    run_ranks(1, Duration::from_secs(60), |_, w| run(cfg.clone(), warmup, steps, w)).remove(0).unwrap()
}

#[test]
fn warm_up_steps_are_eager_and_the_cpu_capture_is_refused() {
    let (eager, err) = one_rank(config(false), None, 3);
    assert!(err.is_none(), "{err:?}");
    let (graphed, err) = one_rank(config(false), Some(2), 3);
    assert_eq!(graphed, eager[..2], "the warm-up steps are the eager steps");
    let err = err.expect("the third step's capture on the CPU");
    assert!(err.contains("graph capture") && err.contains("cpu"), "{err}");
}

/// Dropout is no reason to refuse: the warm-up steps draw the eager steps' masks (which differ
/// from step to step: the losses of a model without dropout are not them), and the capture is
/// refused for the device alone.
#[test]
fn with_dropout_the_warm_up_steps_are_eager_and_only_the_cpu_capture_is_refused() {
    let cfg = TransformerConfig { hidden_dropout: 0.1, attention_dropout: 0.1, ..config(false) };
    let (eager, err) = one_rank(cfg.clone(), None, 3);
    assert!(err.is_none(), "{err:?}");
    let (plain, _) = one_rank(config(false), None, 3);
    assert_ne!(eager, plain, "dropout changes the losses");
    let (graphed, err) = one_rank(cfg, Some(2), 3);
    assert_eq!(graphed, eager[..2], "the warm-up steps are the eager steps");
    let err = err.expect("the third step's capture on the CPU");
    assert!(err.contains("graph capture") && err.contains("cpu"), "{err}");
}
