//! The training step captured as a CUDA graph against eager steps (feature `cuda`; runs on the GPU
//! machine). In a binary of its own: a capture records everything queued on the device's one
//! compute stream, so no other test may queue work on it meanwhile (the tests of one binary run on
//! threads of one process and share that stream).
#![cfg(feature = "cuda")]

use ferrotron_comm::{Communicator, run_ranks};
use ferrotron_core::{DType, Device, Tensor};
use ferrotron_optim::{AdamConfig, GradSync, Optimizer, StepGraph, queue_train_step};
use ferrotron_parallel::{Layout, ProcessGroups, TensorParallel};
use ferrotron_trainer::settings::{Paths, Settings, TrainArgs};
use ferrotron_trainer::train::train;
use ferrotron_transformer::{Batch, GptModel};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The tests of this binary take turns: a capture records all work on the device's stream.
static TURN: Mutex<()> = Mutex::new(());

/// A training run of `s` on `gpu` under `--deterministic-mode`, eager or (`warmup`) with the step
/// graphed after that many eager steps.
fn train_deterministic(s: &Settings, gpu: &Device, warmup: Option<usize>) -> ferrotron_trainer::train::Summary {
    let paths = Paths { device: gpu.clone(), cuda_graph_warmup: warmup, deterministic: true, ..Paths::default() };
    train(s, &paths).unwrap()
}

/// `--cuda-graph-impl local --cuda-graph-scope full_iteration`: after two eager warm-up steps the
/// step is captured once and replayed for the other 18. A replay runs the eager step's kernels on
/// the same inputs, so under `--deterministic-mode` every loss equals the eager run's bit for bit
/// (without it two eager runs already part within a few steps: atomics' order), on both tiny
/// presets in bf16 with two micro-batches a step, the learning rate moving every step (warm-up
/// then cosine decay: it reaches the graph through the optimizer's state, as the weight decay
/// rising linearly from 0 to 0.5 over the run does), and losses read back
/// every 3 steps (replays queued before their losses are read each keep their own).
#[test]
fn graphed_steps_equal_eager_steps_bit_for_bit() {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let gpu = Device::cuda(0).expect("a CUDA device");
    // (preset, --reset-attention-mask: each replay copies its batches' document starts where the
    // captured kernels read them; one that kept the captured starts would part from step 4 on.)
    for (preset, masks) in [("tiny", false), ("llama-tiny", false), ("llama-tiny", true)] {
        let args = TrainArgs {
            preset: Some(preset.into()),
            bf16: true,
            reset_attention_mask: masks,
            train_iters: Some(20),
            lr_warmup_iters: Some(5),
            lr_decay_style: Some("cosine".into()),
            weight_decay_incr_style: Some("linear".into()),
            start_weight_decay: Some(0.0),
            end_weight_decay: Some(0.5),
            log_interval: Some(3),
            eval_interval: Some(20),
            eval_iters: Some(1),
            no_progress: true,
            ..TrainArgs::default()
        };
        let (s, _): (Settings, Paths) = Settings::resolve(&args).unwrap();
        let run = |warmup| train_deterministic(&s, &gpu, warmup);
        let eager = run(None);
        let graphed = run(Some(2));
        assert_eq!(eager.graphed_steps, 0);
        let preset = format!("{preset}, document masks {masks}");
        assert_eq!(graphed.graphed_steps, 18, "{preset}: steps 3-20 replay the graph");
        assert_eq!(eager.losses.len(), 20);
        assert_eq!(graphed.losses, eager.losses, "{preset}: graphed against eager losses");
        assert_eq!(graphed.evals, eager.evals, "{preset}: validation after the graphed steps");
    }
}

/// With hidden and attention dropout (0.1 each, and each alone) the masks move on every step
/// while the captured kernels hold the captured step's keys: each replay shifts them by its
/// batches' lead (`set_draw_shift`), so the graphed losses still equal the eager ones bit for bit,
/// on both tiny presets (a replay that reused the captured masks would part from step 4 on). Two
/// eager runs are compared first: the premise that the eager steps repeat to the bit.
#[test]
fn graphed_steps_with_dropout_draw_each_steps_masks() {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let gpu = Device::cuda(0).expect("a CUDA device");
    let mut failed = vec![];
    for preset in ["tiny", "llama-tiny"] {
        for (hidden, attention) in [(0.1, 0.1), (0.1, 0.0), (0.0, 0.1)] {
            let args = TrainArgs {
                preset: Some(preset.into()),
                bf16: true,
                train_iters: Some(12),
                hidden_dropout: Some(hidden),
                attention_dropout: Some(attention),
                log_interval: Some(1),
                eval_interval: Some(12),
                eval_iters: Some(1),
                no_progress: true,
                ..TrainArgs::default()
            };
            let (s, _): (Settings, Paths) = Settings::resolve(&args).unwrap();
            let run = |warmup| train_deterministic(&s, &gpu, warmup);
            let eager = run(None);
            let again = run(None);
            let graphed = run(Some(2));
            assert_eq!(graphed.graphed_steps, 10, "{preset}: steps 3-12 replay the graph");
            assert_eq!(eager.losses.len(), 12);
            let case = format!("{preset}, hidden dropout {hidden}, attention dropout {attention}");
            if again.losses != eager.losses {
                failed.push(format!("{case}: two eager runs differ: {:?} against {:?}", again.losses, eager.losses));
            } else if graphed.losses != eager.losses || graphed.evals != eager.evals {
                failed.push(format!("{case}: graphed {:?} against eager {:?}", graphed.losses, eager.losses));
            }
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

/// What a run of `graph_steps` saw of its `StepGraph`: replays, captures, and after each step
/// whether a graph was held.
#[derive(Debug, PartialEq)]
struct GraphTally {
    launches: u64,
    captures: u64,
    held: Vec<bool>,
}

/// Losses of `steps` steps of the tiny preset in bf16 on the GPU under deterministic kernels,
/// eagerly or (`warmup`) through a `StepGraph`, with loss masks whose token count changes from step
/// to step and `micro_of(step)` sequences in each of the two micro-batches.
fn graph_steps(
    warmup: Option<usize>,
    world: Arc<dyn Communicator>,
    steps: usize,
    micro_of: fn(usize) -> usize,
) -> (Vec<f64>, Option<GraphTally>) {
    ferrotron_kernels::cuda::set_deterministic(true);
    // The ids below are made within the vocabulary, as the trainer checks them before upload: a
    // read-back check inside the capture would be refused.
    ferrotron_kernels::set_device_ids_prechecked(true);
    let gpu = Device::cuda(0).expect("a CUDA device");
    let cfg = ferrotron_models::preset("tiny").unwrap();
    let (seq, vocab) = (cfg.seq_length, cfg.vocab_size as u32);
    let g = ProcessGroups::new(world, Layout::new(1, 1, 1, 1, 1).unwrap()).unwrap();
    let tp = TensorParallel::new(g.tp.clone(), false);
    let (model, table) = GptModel::build_parallel(cfg, &tp, &gpu, DType::BF16, 1234, 1).unwrap();
    let mut sync = GradSync::new(&table, g.dp_cp.clone(), g.tp.clone(), 1 << 20, false, false);
    let mut opt = Optimizer::new_parallel(&table, AdamConfig::default(), &sync, g.mp.clone(), 0).unwrap();
    let mut graph = warmup.map(StepGraph::new);
    let mut losses = vec![];
    let mut held = vec![];
    for step in 0..steps {
        let micro = micro_of(step);
        let micros: Vec<Batch> = (0..2usize)
            .map(|j| {
                let n = micro * seq;
                let ids: Vec<u32> = (0..n).map(|i| ((i * 7 + j * 13 + step * 5) as u32) % vocab).collect();
                let labels: Vec<u32> = (0..n).map(|i| ((i * 11 + j + step) as u32) % vocab).collect();
                // Every (3 + step % 4)-th position masked out: a count that changes each step.
                let mask: Vec<f32> = (0..n).map(|i| if (i + j) % (3 + step % 4) == 0 { 0.0 } else { 1.0 }).collect();
                Batch::new(
                    Tensor::from_vec(ids, [micro, seq], &gpu).unwrap(),
                    Tensor::from_vec(labels, [micro, seq], &gpu).unwrap(),
                    Tensor::from_vec(mask, [micro, seq], &gpu).unwrap(),
                )
                .unwrap()
            })
            .collect();
        let lr = 1e-3;
        let q = match graph.as_mut() {
            Some(gr) => gr.queue(&model, &table, &mut sync, &mut opt, &micros, lr),
            None => queue_train_step(&model, &table, &mut sync, &mut opt, &micros, lr),
        };
        losses.push(q.and_then(|q| q.read()).unwrap().loss);
        held.extend(graph.as_ref().map(|g| g.is_captured()));
    }
    let tally = graph.map(|g| GraphTally { launches: g.launches(), captures: g.captures(), held });
    (losses, tally)
}

/// A replayed step takes each batch's own 1 / loss-token count (copied into the tensor the fused
/// cross-entropy reads when it runs): with counts that change every step, the graphed run's
/// losses equal the eager run's bit for bit. Were the captured count replayed, the gradients of
/// step 2 on would be scaled wrongly and the later losses would part.
#[test]
fn graphed_steps_take_each_batchs_loss_token_count() {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let one = |warmup: Option<usize>| {
        run_ranks(1, Duration::from_secs(120), move |_, w| graph_steps(warmup, w, 8, |_| 2)).remove(0).unwrap()
    };
    let (eager, _) = one(None);
    let (graphed, tally) = one(Some(1));
    assert_eq!(eager.len(), 8);
    assert!(eager.iter().all(|l| l.is_finite()), "{eager:?}");
    let tally = tally.unwrap();
    assert_eq!(tally.launches, 7, "steps 2-8 replay the graph though their loss-token counts differ");
    assert_eq!(tally.captures, 1);
    assert_eq!(graphed, eager, "graphed against eager losses with changing loss masks");
}

/// A step whose batches have another shape (here one micro-batch of one sequence instead of two,
/// at step 5) releases the graph and runs eagerly; after the warm-up step that follows, the step is
/// captured again and replayed. Under deterministic kernels every loss equals the eager run's.
#[test]
fn a_batch_of_another_shape_releases_the_graph_and_it_is_captured_again() {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let micro_of = |step: usize| if step == 4 { 1 } else { 2 };
    let one = |warmup: Option<usize>| {
        run_ranks(1, Duration::from_secs(120), move |_, w| graph_steps(warmup, w, 10, micro_of)).remove(0).unwrap()
    };
    let (eager, _) = one(None);
    let (graphed, tally) = one(Some(1));
    assert!(eager.iter().all(|l| l.is_finite()), "{eager:?}");
    let want = GraphTally {
        // Steps 2-4 and 6-10 replay; step 1 warms up, step 5 (the other shape) runs eagerly and,
        // with a warm-up of one step, counts as the new warm-up.
        launches: 8,
        captures: 2,
        held: (0..10).map(|s| s != 0 && s != 4).collect(),
    };
    assert_eq!(tally.unwrap(), want);
    assert_eq!(graphed, eager, "graphed against eager losses across the change of shape");
}
