//! Megatron's growing global batch: `--rampup-batch-size` and `--step-batch-size-schedule`. A
//! ramped run takes the sizes and samples Megatron's formulas give (metrics.jsonl), trains its
//! first iterations as the run at its start size does (bit for bit), resumes in the middle of
//! the ramp bit for bit, and two data-parallel ranks follow one. Bad schedules are named.

mod common;

use common::*;
use ferrotron_trainer::settings::{Launch, Paths, Settings, TrainArgs};
use ferrotron_trainer::train::train;

/// 30 samples with the ramp 2 → 6 by 2 over 8 samples, micro-batches of 1; warm-up over 4
/// samples and decay over the run, both in samples.
fn ramp_args() -> TrainArgs {
    let mut a = tiny_args(false);
    (a.train_iters, a.lr_warmup_iters) = (None, None);
    (a.train_samples, a.lr_warmup_samples) = (Some(30), Some(4));
    (a.micro_batch_size, a.global_batch_size) = (Some(1), Some(6));
    a.rampup_batch_size = vec![2, 2, 8];
    a.eval_interval = Some(100);
    a
}

/// (global batch, consumed samples) of every log line of a run's metrics file.
fn batches(metrics: &std::path::Path) -> Vec<(u64, u64)> {
    std::fs::read_to_string(metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|m| m.get("global_batch_size").is_some())
        .map(|m| (m["global_batch_size"].as_u64().unwrap(), m["consumed_samples"].as_u64().unwrap()))
        .collect()
}

#[test]
fn a_ramped_run_takes_megatrons_sizes() {
    let s = settings(&ramp_args());
    // Consumed 0, 2, 4, 8, 14 in the ramp, then (30 − 14) / 6 = 2 whole batches.
    assert_eq!(s.train_iters, 6);
    let dir = tmp("ramp");
    let metrics = dir.join("metrics.jsonl");
    let ramped = train(&s, &Paths { metrics: Some(metrics.clone()), ..Paths::default() }).unwrap();
    assert_eq!(batches(&metrics), [(2, 2), (2, 4), (4, 8), (6, 14), (6, 20), (6, 26)]);
    // Its first two iterations are those of the run at the start size: the same samples at the
    // same learning rates (the schedule is in samples).
    let mut two = ramp_args();
    (two.rampup_batch_size, two.global_batch_size) = (vec![], Some(2));
    let constant = train(&settings(&two), &Paths::default()).unwrap();
    assert_eq!(bits(&ramped.losses[..2]), bits(&constant.losses[..2]));
    assert_ne!(ramped.losses[2].1.to_bits(), constant.losses[2].1.to_bits(), "iteration 3 trains on 4 samples");
    // Saved at iteration 3, in the middle of the ramp, and resumed: the straight run's losses.
    let half = Paths { save: Some(dir.join("ck")), exit_interval: Some(3), ..Paths::default() };
    train(&s, &half).unwrap();
    let rest = train(&s, &Paths { load: Some(dir.join("ck")), ..Paths::default() }).unwrap();
    assert_eq!(bits(&rest.losses), bits(&ramped.losses[3..]));
    // Two data-parallel ranks, each half of every global batch.
    let dp = train(&s, &Paths { launch: Launch::Threads(2), ..Paths::default() }).unwrap();
    assert_eq!(dp.losses.len(), 6);
    for ((i, a), (_, b)) in dp.losses.iter().zip(&ramped.losses) {
        assert!((a - b).abs() <= 1e-4 * b.abs(), "iteration {i}: {a} (2 ranks) vs {b} (1 rank)");
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_step_schedule_switches_at_its_token_thresholds() {
    let mut a = ramp_args();
    (a.rampup_batch_size, a.global_batch_size) = (vec![], None);
    // Sequences of 32 tokens: the second size from sample 4 on, the third from sample 12 on.
    a.step_batch_size_schedule = Some("0:2 128:4 384:8".into());
    a.train_samples = Some(24);
    let dir = tmp("steps");
    let metrics = dir.join("metrics.jsonl");
    let (s, _): (Settings, Paths) = Settings::resolve(&a).unwrap();
    // Megatron's count: iterations until 24 samples are reached (the last one passes them).
    assert_eq!((s.train_iters, s.global_batch_size), (6, 1), "evaluation: one micro-batch a rank");
    train(&s, &Paths { metrics: Some(metrics.clone()), ..Paths::default() }).unwrap();
    assert_eq!(batches(&metrics), [(2, 2), (2, 4), (4, 8), (4, 12), (8, 20), (8, 28)]);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn schedules_that_do_not_fit_are_named() {
    let fails = |a: TrainArgs, want: &str| {
        let e = Settings::resolve(&a).err().map(|e| format!("{e:#}")).unwrap_or_default();
        assert!(e.contains(want), "expected {want:?} in {e:?}");
    };
    let mut a = ramp_args();
    (a.train_samples, a.train_iters) = (None, Some(8));
    a.lr_warmup_samples = None;
    fails(a, "go with --train-samples");
    let mut a = ramp_args();
    (a.micro_batch_size, a.rampup_batch_size) = (Some(3), vec![2, 4, 8]);
    fails(a, "a global batch of --rampup-batch-size 2 is not a multiple of --micro-batch-size 3");
    let mut a = ramp_args();
    a.rampup_batch_size = vec![2, 3, 8];
    fails(a, "must exceed the start size by a multiple of the increment");
    let mut a = ramp_args();
    a.step_batch_size_schedule = Some("0:2".into());
    fails(a, "drop --global-batch-size");
    let mut a = ramp_args();
    (a.rampup_batch_size, a.global_batch_size) = (vec![], None);
    a.step_batch_size_schedule = Some("0:2 x:4".into());
    fails(a, "entry \"x:4\"");
}
