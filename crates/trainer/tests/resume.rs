//! N steps straight equals N/2 steps, save, load, N/2 steps: the same losses, parameters and
//! optimizer state, bit for bit (f32 with hidden dropout, bf16 with fp32 master weights, and bf16
//! with the precision-aware optimizer's bf16 moments, which checkpoints hold widened, offloaded to
//! host memory). And a checkpoint saved
//! under one parallel layout resumes under another. And a run measured in samples is the same run
//! measured in iterations.

mod common;

use common::*;
use ferrotron_trainer::checkpoint;
use ferrotron_trainer::settings::{Paths, Settings};
use ferrotron_trainer::train::train;

fn check(llama: bool, bf16: bool, bf16_moments: bool) {
    let mut args = tiny_args(llama);
    args.bf16 = bf16;
    if bf16_moments {
        // With the state in host memory too (--optimizer-cpu-offload): what a checkpoint holds.
        args.use_precision_aware_optimizer = true;
        args.exp_avg_dtype = Some("bf16".into());
        args.exp_avg_sq_dtype = Some("bf16".into());
        args.optimizer_cpu_offload = true;
    }
    // Hidden dropout in the GPT-2 style run, attention dropout in the Llama-style one: the resumed
    // steps draw the masks the straight run did.
    args.hidden_dropout = (!llama).then_some(0.1);
    args.attention_dropout = llama.then_some(0.1);
    let s = settings(&args);
    let tag = format!("resume-{llama}-{bf16}-{bf16_moments}");
    let straight_dir = tmp(&format!("{tag}-a"));
    let straight = train(&s, &Paths { save: Some(straight_dir.clone()), ..Paths::default() }).unwrap();

    // First half (the same 8-iteration run, stopped by --exit-interval), then resume its checkpoint.
    let half_dir = tmp(&format!("{tag}-b"));
    let first = train(&s, &Paths { save: Some(half_dir.clone()), exit_interval: Some(4), ..Paths::default() }).unwrap();
    assert_eq!(first.losses.len(), 4);
    let resume_dir = tmp(&format!("{tag}-c"));
    let second =
        train(&s, &Paths { save: Some(resume_dir.clone()), load: Some(half_dir.clone()), ..Paths::default() }).unwrap();

    let tail: Vec<u64> = straight.losses[4..].iter().map(|(_, l)| l.to_bits()).collect();
    let resumed: Vec<u64> = second.losses.iter().map(|(_, l)| l.to_bits()).collect();
    assert_eq!(second.losses.first().map(|x| x.0), Some(5));
    let head: Vec<u64> = straight.losses[..4].iter().map(|(_, l)| l.to_bits()).collect();
    assert_eq!(head, first.losses.iter().map(|(_, l)| l.to_bits()).collect::<Vec<_>>());
    assert_eq!(tail, resumed, "losses differ after resume: {:?} vs {:?}", &straight.losses[4..], second.losses);
    // Evaluations at 0, 4 and 8; the resumed one reads on through the validation split from where
    // the one at 4 stopped (the checkpoint keeps the count), as the straight run's does.
    assert_eq!(straight.evals.iter().map(|e| e.0).collect::<Vec<_>>(), [0, 4, 8]);
    assert_eq!(bits(&straight.evals), [bits(&first.evals), bits(&second.evals)].concat());
    let a = checkpoint::load(&straight_dir).unwrap();
    // Parameters alone: no optimizer state, the parameters the same.
    let p = checkpoint::load_params(&straight_dir).unwrap();
    assert!(
        p.tensors.keys().all(|n| !n.starts_with("optimizer.")) && a.tensors.keys().any(|n| n.starts_with("optimizer."))
    );
    assert!(p.tensors.iter().all(|(n, t)| a.tensors[n] == *t) && p.tensors.len() * 4 == a.tensors.len());
    let b = checkpoint::load(&resume_dir).unwrap();
    assert_eq!((a.state.iteration, a.state.consumed_valid_samples), (8, 2 * 2 * 8), "two evaluations of 2 × 8");
    assert_eq!((b.state.iteration, b.state.consumed_valid_samples), (8, 2 * 2 * 8));
    assert_eq!(a.tensors.len(), b.tensors.len());
    for (name, (shape, x)) in &a.tensors {
        let (shape_b, y) = &b.tensors[name];
        assert_eq!(shape, shape_b, "{name}");
        assert!(x.iter().zip(y).all(|(x, y)| x.to_bits() == y.to_bits()), "{name} differs after resume");
    }
    for d in [straight_dir, half_dir, resume_dir] {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[test]
fn gpt2_style_resume_is_bit_exact() {
    check(false, false, false);
}

#[test]
fn llama_style_bf16_resume_is_bit_exact() {
    check(true, true, false);
}

#[test]
fn bf16_moments_offloaded_resume_is_bit_exact() {
    check(true, true, true);
}

/// Saved by 4 thread ranks (TP 2 × DP 2 with sequence parallelism, or PP 2 × DP 2 with full
/// recompute; distributed optimizer), resumed on one rank and the other way round: the losses
/// follow the one-rank run (the layouts differ only in summation order).
#[test]
fn a_checkpoint_resumes_under_another_layout() {
    let mut args = tiny_args(true);
    args.global_batch_size = Some(4);
    args.micro_batch_size = Some(1);
    let s1 = settings(&args);
    let mut tp = s1.clone();
    tp.tensor_model_parallel_size = 2;
    tp.sequence_parallel = true;
    tp.use_distributed_optimizer = true;
    tp.overlap_grad_reduce = true;
    tp.overlap_param_gather = true; // the save settles the gathers still pending
    let mut pp = s1.clone();
    pp.pipeline_model_parallel_size = 2;
    pp.use_distributed_optimizer = true;
    pp.recompute_granularity = Some("full".into());
    relayout(&s1, &tp, "tp");
    relayout(&s1, &pp, "pp");
    // GPT-2 style: tied embedding, held by both pipeline stages.
    let mut args = tiny_args(false);
    args.global_batch_size = Some(4);
    args.micro_batch_size = Some(1);
    let g1 = settings(&args);
    let mut gpp = g1.clone();
    gpp.pipeline_model_parallel_size = 2;
    gpp.sequence_parallel = true;
    gpp.tensor_model_parallel_size = 2;
    relayout(&g1, &gpp, "tied-pp");
}

fn relayout(s1: &ferrotron_trainer::settings::Settings, s4: &ferrotron_trainer::settings::Settings, tag: &str) {
    use ferrotron_trainer::settings::Launch;
    let (s1, s4) = (s1.clone(), s4.clone());
    let threads = Launch::Threads(4);
    let straight = train(&s1, &Paths::default()).unwrap();
    let (dir_a, dir_b) = (tmp(&format!("relayout-{tag}-a")), tmp(&format!("relayout-{tag}-b")));
    let half = Paths { save: Some(dir_a.clone()), exit_interval: Some(4), launch: threads.clone(), ..Paths::default() };
    let first = train(&s4, &half).unwrap();
    let second = train(&s1, &Paths { load: Some(dir_a.clone()), ..Paths::default() }).unwrap();
    // And back: one rank saves, four ranks resume.
    let one_half = Paths { save: Some(dir_b.clone()), exit_interval: Some(4), ..Paths::default() };
    train(&s1, &one_half).unwrap();
    let third = train(&s4, &Paths { load: Some(dir_b.clone()), launch: threads, ..Paths::default() }).unwrap();
    let all: Vec<(u64, f64)> = first.losses.iter().chain(&second.losses).cloned().collect();
    assert_eq!(all.len(), straight.losses.len());
    for ((i, a), (_, b)) in all.iter().zip(&straight.losses) {
        assert!((a - b).abs() <= 1e-4 * b.abs(), "{tag} iteration {i}: {a} (4 ranks, then 1) vs {b} (1 rank)");
    }
    for ((i, a), (_, b)) in third.losses.iter().zip(&straight.losses[4..]) {
        assert!((a - b).abs() <= 1e-4 * b.abs(), "{tag} iteration {i}: {a} (1 rank, then 4) vs {b} (1 rank)");
    }
    // Evaluations too: the data-parallel ranks each evaluate their share of the batches.
    let evals: Vec<(u64, f64)> = first.evals.iter().chain(&second.evals).cloned().collect();
    assert_eq!(evals.iter().map(|e| e.0).collect::<Vec<_>>(), straight.evals.iter().map(|e| e.0).collect::<Vec<_>>());
    for ((i, a), (_, b)) in evals.iter().chain(&third.evals).zip(straight.evals.iter().chain(&straight.evals[2..])) {
        assert!((a - b).abs() <= 1e-4 * b.abs(), "{tag} validation at {i}: {a} vs {b} (1 rank)");
    }
    for d in [dir_a, dir_b] {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// Megatron's --no-load-optim and --finetune. Without the optimizer's state the run goes on at
/// the saved iteration with the saved parameters (its first loss is the resumed run's, bit for
/// bit) but a fresh Adam (the next ones differ); fine-tuning starts at iteration 1 on the data's
/// first batch with the trained parameters (lower than the untrained model's loss there).
#[test]
fn loading_without_the_optimizer_or_for_fine_tuning() {
    use ferrotron_trainer::settings::LoadMode;
    let s = settings(&tiny_args(false));
    let dir = tmp("load-modes");
    let scratch = train(&s, &Paths { save: Some(dir.clone()), exit_interval: Some(4), ..Paths::default() }).unwrap();
    let load = |load_mode| train(&s, &Paths { load: Some(dir.clone()), load_mode, ..Paths::default() }).unwrap();
    let (resumed, fresh, tuned) = (load(LoadMode::Resume), load(LoadMode::NoOptim), load(LoadMode::Finetune));
    assert_eq!((resumed.losses[0].0, fresh.losses[0].0), (5, 5));
    assert_eq!(fresh.losses[0].1.to_bits(), resumed.losses[0].1.to_bits(), "same parameters, same batch");
    assert_ne!(fresh.losses[1].1.to_bits(), resumed.losses[1].1.to_bits(), "a fresh optimizer steps differently");
    assert_eq!(tuned.losses.iter().map(|l| l.0).collect::<Vec<_>>(), (1..=8).collect::<Vec<_>>());
    assert!(tuned.losses[0].1 < scratch.losses[0].1, "{:?} vs {:?}", tuned.losses[0], scratch.losses[0]);
    let _ = std::fs::remove_dir_all(dir);
}

/// Losses are read back at log intervals (the steps between are only queued): every iteration's
/// loss still arrives, in order and bit for bit as when each step is read at once, also when
/// --exit-interval stops the run between log lines.
#[test]
fn losses_read_at_log_intervals_equal_per_step_reads() {
    let every = train(&settings(&tiny_args(false)), &Paths::default()).unwrap();
    let mut args = tiny_args(false);
    args.log_interval = Some(3);
    let s = settings(&args);
    let deferred = train(&s, &Paths::default()).unwrap();
    assert_eq!(every.losses.len(), 8);
    assert_eq!(bits(&deferred.losses), bits(&every.losses));
    let stopped = train(&s, &Paths { exit_interval: Some(4), ..Paths::default() }).unwrap();
    assert_eq!(bits(&stopped.losses), bits(&every.losses[..4]));
    // Four thread ranks, PP 2 × DP 2 with the distributed optimizer: the deferred reads are
    // collectives (the last stage's broadcast, the DP average), in the same order on every rank.
    let threads = Paths { launch: ferrotron_trainer::settings::Launch::Threads(4), ..Paths::default() };
    let mut args = tiny_args(false);
    args.global_batch_size = Some(4);
    args.micro_batch_size = Some(1);
    let mut s1 = settings(&args);
    s1.pipeline_model_parallel_size = 2;
    s1.use_distributed_optimizer = true;
    let mut s3 = s1.clone();
    s3.log_interval = 3;
    let (a, b) = (train(&s1, &threads).unwrap(), train(&s3, &threads).unwrap());
    assert_eq!(a.losses.len(), 8);
    assert_eq!(bits(&b.losses), bits(&a.losses));
    // The parameter gathers left to the next forward (--overlap-param-gather) interleave with
    // those reads and the evaluations, in the same order on every rank: the same bits.
    s3.overlap_param_gather = true;
    assert_eq!(bits(&train(&s3, &threads).unwrap().losses), bits(&a.losses));
}

/// The same run measured two ways: --train-samples with its schedule in samples, where the global
/// batch divides them, is --train-iters with the schedule in iterations, bit for bit.
#[test]
fn a_run_in_samples_equals_the_run_in_iterations() {
    let mut iters = tiny_args(false);
    (iters.lr_warmup_iters, iters.lr_decay_iters) = (Some(2), Some(6));
    let straight = train(&settings(&iters), &Paths::default()).unwrap();
    let mut samples = tiny_args(false);
    (samples.train_iters, samples.lr_warmup_iters) = (None, None);
    (samples.train_samples, samples.lr_warmup_samples, samples.lr_decay_samples) = (Some(64), Some(16), Some(48));
    let s = settings(&samples);
    assert_eq!(s.train_iters, 8);
    let other = train(&s, &Paths::default()).unwrap();
    assert_eq!(bits(&other.losses), bits(&straight.losses));
    assert_eq!(bits(&other.evals), bits(&straight.evals));
}

/// Megatron's --ckpt-step: the checkpoint of an earlier iteration rather than the tracker's,
/// resumed bit for bit as the straight run went on from there; one that is not there is named.
#[test]
fn ckpt_step_resumes_an_earlier_checkpoint() {
    let mut args = tiny_args(false);
    args.save_interval = Some(2);
    let s = settings(&args);
    let dir = tmp("ckpt-step");
    let straight = train(&s, &Paths { save: Some(dir.clone()), ..Paths::default() }).unwrap();
    assert_eq!(checkpoint::read_state(&dir).unwrap().iteration, 8, "the tracker names the last");
    let mut from = args.clone();
    (from.load, from.ckpt_step) = (Some(dir.clone()), Some(2));
    let (s2, paths) = ferrotron_trainer::settings::Settings::resolve(&from).unwrap();
    let resumed = train(&s2, &paths).unwrap();
    assert_eq!(bits(&resumed.losses), bits(&straight.losses[2..]));
    from.ckpt_step = Some(3);
    let e = ferrotron_trainer::settings::Settings::resolve(&from).err().unwrap().to_string();
    assert!(e.contains("no checkpoint of iteration 3") && e.contains("[2, 4, 6, 8]"), "{e}");
    let _ = std::fs::remove_dir_all(dir);
}

/// --skip-train: no step, one evaluation at the loaded iteration. From scratch it is the normal
/// run's iteration-0 evaluation to the bit; from a checkpoint it evaluates the saved model at
/// that iteration.
#[test]
fn skip_train_evaluates_once_and_exits() {
    let s = settings(&tiny_args(false));
    let straight = train(&s, &Paths::default()).unwrap();
    let only = train(&Settings { skip_train: true, ..s.clone() }, &Paths::default()).unwrap();
    assert!(only.losses.is_empty(), "no training step: {:?}", only.losses);
    assert_eq!(bits(&only.evals), bits(&straight.evals[..1]));
    let dir = tmp("skip-train");
    train(&s, &Paths { save: Some(dir.clone()), exit_interval: Some(4), ..Paths::default() }).unwrap();
    let loaded =
        train(&Settings { skip_train: true, ..s }, &Paths { load: Some(dir.clone()), ..Paths::default() }).unwrap();
    assert!(loaded.losses.is_empty());
    assert_eq!(loaded.evals.len(), 1);
    let (it, l) = loaded.evals[0];
    assert!(
        it == 4 && l.is_finite() && l < straight.evals[0].1,
        "{:?} against iteration 0's {:?}",
        loaded.evals,
        straight.evals[0]
    );
    let _ = std::fs::remove_dir_all(dir);
}
