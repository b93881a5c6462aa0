//! A step whose gradient norm is not finite (a learning rate that blows the model up): the run
//! stops there by default, naming the iteration, on every rank of a layout alike (Megatron's
//! --check-for-nan-in-loss-and-grad); with --no-check-for-nan-in-loss-and-grad it skips such
//! steps' updates, counts them, and its checkpoints hold the last finite step's parameters.

mod common;

use common::*;
use ferrotron_trainer::checkpoint;
use ferrotron_trainer::settings::{Launch, Paths, Settings, TrainArgs};
use ferrotron_trainer::train::train;

fn blowing_up() -> TrainArgs {
    TrainArgs { lr: Some(1e10), lr_warmup_iters: Some(0), ..tiny_args(true) }
}

#[test]
fn a_non_finite_step_stops_the_run_on_every_layout() {
    let s = settings(&blowing_up());
    assert!(s.check_for_nan_in_loss_and_grad, "on by default, as Megatron's");
    for (tag, launch, f) in [
        ("one rank", Launch::Single, (|_: &mut Settings| {}) as fn(&mut Settings)),
        ("dp2", Launch::Threads(2), |s: &mut Settings| s.use_distributed_optimizer = true),
        ("pp2", Launch::Threads(2), |s: &mut Settings| s.pipeline_model_parallel_size = 2),
        ("tp2", Launch::Threads(2), |s: &mut Settings| s.tensor_model_parallel_size = 2),
    ] {
        let mut s = s.clone();
        f(&mut s);
        let e = format!("{:#}", train(&s, &Paths { launch, ..Paths::default() }).unwrap_err());
        assert!(
            e.contains("iteration 2: the loss is")
                && e.contains("gradient norm NaN, not finite")
                && e.contains("--no-check-for-nan-in-loss-and-grad"),
            "{tag}: {e}"
        );
    }
}

#[test]
fn without_the_check_non_finite_steps_are_skipped_and_counted() {
    let s = settings(&TrainArgs { no_check_for_nan_in_loss_and_grad: true, ..blowing_up() });
    let dir = tmp("nan-skip");
    let r = train(&s, &Paths { save: Some(dir.clone()), ..Paths::default() }).unwrap();
    assert_eq!(r.skipped, (2..=8).collect::<Vec<u64>>(), "{:?}", r.losses);
    assert!(r.grad_norms[0].1.is_finite() && r.grad_norms[1].1.is_nan());
    // The saved parameters are iteration 1's: finite.
    let ck = checkpoint::load_params(&dir).unwrap();
    assert!(ck.tensors.values().all(|(_, v)| v.iter().all(|x| x.is_finite())));
    let _ = std::fs::remove_dir_all(dir);
    let both = TrainArgs {
        check_for_nan_in_loss_and_grad: true,
        ..TrainArgs { no_check_for_nan_in_loss_and_grad: true, ..blowing_up() }
    };
    let e = Settings::resolve(&both).unwrap_err().to_string();
    assert!(e.contains("keep one"), "{e}");
}
