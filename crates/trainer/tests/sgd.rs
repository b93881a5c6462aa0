//! --optimizer sgd (Megatron's: momentum --sgd-momentum, L2 weight decay, PyTorch's SGD) through
//! the trainer: it learns, differs from AdamW, follows one rank under tensor × sequence parallel
//! and data parallel with the distributed optimizer (its momentum sharded), resumes bit for bit,
//! and a checkpoint's optimizer state is refused under the other optimizer by name. (The update
//! against PyTorch's rule: ferrotron-optim's tests/adam.rs and the kernels' ops tests.)

mod common;

use common::*;
use ferrotron_trainer::settings::{LoadMode, Paths, Settings, TrainArgs};
use ferrotron_trainer::train::train;

fn sgd() -> TrainArgs {
    TrainArgs { optimizer: Some("sgd".into()), sgd_momentum: Some(0.8), lr: Some(0.05), ..tiny_args(true) }
}

#[test]
fn sgd_trains_follows_one_rank_and_resumes() {
    let s1 = settings(&sgd());
    assert_eq!((s1.optimizer.as_str(), s1.sgd_momentum), ("sgd", 0.8));
    let one = run(&s1, 1);
    assert!(one.losses.last().unwrap().1 < one.losses[0].1, "{:?}", one.losses);
    let adam = run(&settings(&TrainArgs { lr: Some(0.05), ..tiny_args(true) }), 1);
    assert_ne!(one.losses, adam.losses);
    let with = |f: &dyn Fn(&mut Settings)| {
        let mut s = s1.clone();
        f(&mut s);
        s
    };
    let tp = with(&|s| (s.tensor_model_parallel_size, s.sequence_parallel) = (2, true));
    let dp = with(&|s| (s.use_distributed_optimizer, s.overlap_grad_reduce) = (true, true));
    follows("sgd tp2 sp", &run(&tp, 2), &one);
    follows("sgd dp2 distributed", &run(&dp, 2), &one);
    let dir = tmp("sgd-resume");
    let first = train(&s1, &Paths { save: Some(dir.clone()), exit_interval: Some(4), ..Paths::default() }).unwrap();
    assert_eq!(bits(&first.losses), bits(&one.losses[..4]));
    let rest = train(&s1, &Paths { load: Some(dir.clone()), ..Paths::default() }).unwrap();
    assert_eq!(bits(&rest.losses), bits(&one.losses[4..]), "resumed with its momentum");
    // AdamW cannot take SGD's state (nor the other way): named, with the way to load the weights.
    let adam_s = settings(&TrainArgs { lr: Some(0.05), ..tiny_args(true) });
    let e = train(&adam_s, &Paths { load: Some(dir.clone()), ..Paths::default() }).unwrap_err();
    assert!(format!("{e:#}").contains("--optimizer sgd's") && format!("{e:#}").contains("--no-load-optim"), "{e:#}");
    let weights_only = Paths { load: Some(dir.clone()), load_mode: LoadMode::NoOptim, ..Paths::default() };
    train(&adam_s, &weights_only).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_sgd_flags_are_named() {
    let e = |a: TrainArgs| format!("{:#}", ferrotron_trainer::settings::Settings::resolve(&a).unwrap_err());
    assert!(e(TrainArgs { sgd_momentum: Some(0.5), ..tiny_args(true) }).contains("add --optimizer sgd"));
    assert!(e(TrainArgs { sgd_momentum: Some(1.5), ..sgd() }).contains("--sgd-momentum 1.5 must be in [0, 1)"));
    assert!(e(TrainArgs { optimizer: Some("lamb".into()), ..tiny_args(true) }).contains("--optimizer lamb"));
}
