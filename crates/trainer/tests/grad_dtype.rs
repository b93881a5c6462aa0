//! `--grad-reduce-in-bf16`: main_grad held in bf16. The losses follow the fp32-main_grad run
//! within bf16 tolerance, on one rank and on two data-parallel thread ranks whose reduce-scatter
//! (distributed optimizer, overlapped with the backward) moves bf16 buckets; and the flag is
//! refused without --bf16. The precision-aware optimizer's bf16 moments the same way, and
//! `--main-grads-dtype bf16` as the bf16 main_grad it names. `--optimizer-cpu-offload` (the same
//! update staged through the host) gives the same losses bit for bit.

mod common;

use common::*;
use ferrotron_trainer::settings::{Launch, Paths, Settings};
use ferrotron_trainer::train::train;

fn losses(s: &Settings, ranks: usize) -> Vec<f64> {
    let paths =
        Paths { launch: if ranks > 1 { Launch::Threads(ranks) } else { Launch::default() }, ..Paths::default() };
    train(s, &paths).unwrap().losses.into_iter().map(|(_, l)| l).collect()
}

#[track_caller]
fn close(a: &[f64], b: &[f64], what: &str) {
    assert_eq!(a.len(), 8, "{what}: steps");
    assert_eq!(a.len(), b.len(), "{what}: steps");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= 2e-2 * x.abs(), "{what} step {}: {x} against {y}", i + 1);
    }
}

#[test]
fn bf16_main_grad_trains_like_fp32_main_grad() {
    for llama in [false, true] {
        let mut args = tiny_args(llama);
        args.bf16 = true;
        let wide = settings(&args);
        args.grad_reduce_in_bf16 = true;
        let narrow = settings(&args);
        let (a, b) = (losses(&wide, 1), losses(&narrow, 1));
        close(&a, &b, &format!("llama {llama}: fp32 against bf16 main_grad"));
        // Two micro-batches a step, summed in bf16: not the fp32 run's bits.
        assert_ne!(a, b, "llama {llama}: --grad-reduce-in-bf16 changed nothing");
        let mut dp = narrow.clone();
        dp.use_distributed_optimizer = true;
        dp.overlap_grad_reduce = true;
        close(&b, &losses(&dp, 2), &format!("llama {llama}: bf16 main_grad, one rank against DP 2"));
    }
}

#[test]
fn grad_reduce_in_bf16_needs_bf16() {
    let mut args = tiny_args(false);
    args.grad_reduce_in_bf16 = true;
    let e = Settings::resolve(&args).map(drop).expect_err("refused without --bf16").to_string();
    assert!(e.contains("--grad-reduce-in-bf16") && e.contains("--bf16"), "{e}");
}

#[test]
fn bf16_moments_train_like_fp32_moments() {
    let mut args = tiny_args(true);
    args.bf16 = true;
    let wide = settings(&args);
    args.use_precision_aware_optimizer = true;
    args.exp_avg_dtype = Some("bf16".into());
    args.exp_avg_sq_dtype = Some("bf16".into());
    let narrow = settings(&args);
    assert!(narrow.exp_avg_bf16 && narrow.exp_avg_sq_bf16 && !narrow.grad_reduce_in_bf16);
    let (a, b) = (losses(&wide, 1), losses(&narrow, 1));
    close(&a, &b, "fp32 against bf16 moments");
    // The first update takes the unrounded moments: the second step's loss is the fp32 run's.
    assert_eq!(a[..2], b[..2], "the first update is the f32 one");
    assert_ne!(a, b, "bf16 moments changed nothing");
    let mut dp = narrow.clone();
    dp.use_distributed_optimizer = true;
    close(&b, &losses(&dp, 2), "bf16 moments, one rank against DP 2 sharding them");
    // --main-grads-dtype bf16 is the bf16 main_grad.
    args.main_grads_dtype = Some("bf16".into());
    assert!(settings(&args).grad_reduce_in_bf16);
}

#[test]
fn cpu_offload_trains_as_the_direct_update() {
    let mut args = tiny_args(true);
    args.bf16 = true;
    let direct = settings(&args);
    args.optimizer_cpu_offload = true;
    args.optimizer_offload_fraction = Some(1.0);
    args.overlap_cpu_optimizer_d2h_h2d = true;
    let host = settings(&args);
    assert!(host.optimizer_cpu_offload && !direct.optimizer_cpu_offload);
    let bits = |l: Vec<f64>| l.into_iter().map(f64::to_bits).collect::<Vec<_>>();
    assert_eq!(bits(losses(&direct, 1)), bits(losses(&host, 1)), "one rank");
    let dp = |s: &Settings| Settings { use_distributed_optimizer: true, ..s.clone() };
    assert_eq!(bits(losses(&dp(&direct), 2)), bits(losses(&dp(&host), 2)), "DP 2, sharded");
    args.optimizer_offload_fraction = Some(0.5);
    let e = Settings::resolve(&args).map(drop).expect_err("a partial offload").to_string();
    assert!(e.contains("--optimizer-offload-fraction 0.5") && e.contains("not built"), "{e}");
}
