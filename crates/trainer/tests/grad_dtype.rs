//! `--grad-reduce-in-bf16`: main_grad held in bf16. The losses follow the fp32-main_grad run
//! within bf16 tolerance, on one rank and on two data-parallel thread ranks whose reduce-scatter
//! (distributed optimizer, overlapped with the backward) moves bf16 buckets; and the flag is
//! refused without --bf16.

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
