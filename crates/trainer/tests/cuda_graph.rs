//! The training step captured as a CUDA graph against eager steps (feature `cuda`; runs on the GPU
//! machine). In a binary of its own: a capture records everything queued on the device's one
//! compute stream, so no other test may queue work on it meanwhile (the tests of one binary run on
//! threads of one process and share that stream).
#![cfg(feature = "cuda")]

use ferrotron_core::Device;
use ferrotron_trainer::settings::{Paths, Settings, TrainArgs};
use ferrotron_trainer::train::train;

/// `--cuda-graph-impl local --cuda-graph-scope full_iteration`: after two eager warm-up steps the
/// step is captured once and replayed for the other 18. A replay runs the eager step's kernels on
/// the same inputs, so under `--deterministic-mode` every loss equals the eager run's bit for bit
/// (without it two eager runs already part within a few steps: atomics' order), on both tiny
/// presets in bf16 with two micro-batches a step, the learning rate moving every step (warm-up
/// then cosine decay: it reaches the graph through the optimizer's state), and losses read back
/// every 3 steps (replays queued before their losses are read each keep their own).
#[test]
fn graphed_steps_equal_eager_steps_bit_for_bit() {
    let gpu = Device::cuda(0).expect("a CUDA device");
    for preset in ["tiny", "llama-tiny"] {
        let args = TrainArgs {
            preset: Some(preset.into()),
            bf16: true,
            train_iters: Some(20),
            lr_warmup_iters: Some(5),
            lr_decay_style: Some("cosine".into()),
            log_interval: Some(3),
            eval_interval: Some(20),
            eval_iters: Some(1),
            no_progress: true,
            ..TrainArgs::default()
        };
        let (s, _): (Settings, Paths) = Settings::resolve(&args).unwrap();
        let run = |warmup: Option<usize>| {
            let paths =
                Paths { device: gpu.clone(), cuda_graph_warmup: warmup, deterministic: true, ..Paths::default() };
            train(&s, &paths).unwrap()
        };
        let eager = run(None);
        let graphed = run(Some(2));
        assert_eq!(eager.graphed_steps, 0);
        assert_eq!(graphed.graphed_steps, 18, "{preset}: steps 3-20 replay the graph");
        assert_eq!(eager.losses.len(), 20);
        assert_eq!(graphed.losses, eager.losses, "{preset}: graphed against eager losses");
        assert_eq!(graphed.evals, eager.evals, "{preset}: validation after the graphed steps");
    }
}
