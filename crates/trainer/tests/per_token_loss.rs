//! `--calculate-per-token-loss` (Megatron's): the gradient of the mean over every loss token of
//! the global batch. The oracle is one micro-batch of the whole global batch on one rank, whose
//! own mean is that; on documents of a few tokens with `--eod-mask-loss` the micro-batches count
//! different tokens, so the default (the mean of the micro-batches' means) differs from it.

mod common;

use common::*;
use ferrotron_data::{TokenDtype, write_indexed};
use ferrotron_trainer::settings::{Settings, TrainArgs};

/// 3000 documents of 1 to 11 byte tokens, each ending in the byte tokenizer's end-of-document id (0).
fn short_documents() -> String {
    let docs: Vec<Vec<u32>> = (0..3000u32)
        .map(|i| {
            let mut d: Vec<u32> = (0..1 + (i * 7) % 11).map(|j| 1 + (i * 31 + j * 17) % 200).collect();
            d.push(0);
            d
        })
        .collect();
    let dir = tmp("per-token");
    std::fs::create_dir_all(&dir).unwrap();
    let prefix = dir.join("short_text_document");
    write_indexed(&prefix, &docs, TokenDtype::U16).unwrap();
    prefix.to_str().unwrap().to_string()
}

#[test]
fn per_token_loss_is_the_global_batchs_token_mean() {
    let base = TrainArgs {
        eod_mask_loss: true,
        micro_batch_size: Some(8),
        data_path: vec![short_documents()],
        ..tiny_args(false)
    };
    let whole = run(&settings(&base), 1);
    let split = |per_token: bool, dp: usize, cp: usize| -> Settings {
        let mut s = settings(&TrainArgs {
            micro_batch_size: Some(8 / (2 * dp)),
            calculate_per_token_loss: per_token,
            ..base.clone()
        });
        s.context_parallel_size = cp;
        s
    };
    // Two micro-batches of four on one rank; four of one over dp 2 × cp 2 (with the context-
    // parallel ranks' share of each sequence's count); two of two over dp 2.
    follows("per token, 2 micro-batches", &run(&split(true, 1, 1), 1), &whole);
    follows("per token, dp2 × cp2", &run(&split(true, 2, 2), 4), &whole);
    follows("per token, dp2", &run(&split(true, 2, 1), 2), &whole);
    // Without it the gradient follows the micro-batches' means: its norms part from the token
    // mean's by more than `follows` allows (the logged loss is token-weighted either way).
    let means = run(&split(false, 1, 1), 1);
    let rel = |a: &[(u64, f64)], b: &[(u64, f64)]| {
        a.iter().zip(b).map(|(x, y)| (x.1 - y.1).abs() / y.1.abs()).fold(0.0, f64::max)
    };
    let apart = rel(&means.grad_norms, &whole.grad_norms);
    assert!(apart > 1e-4, "the micro-batches count the same tokens: gradient norms within {apart:e}");
}

/// The routers' losses under --calculate-per-token-loss, as Megatron scales them: each
/// micro-batch's gradient at scale 1, then every gradient divided by the global batch's token
/// count. With every position counted, N tokens a micro-batch and M micro-batches, that is the
/// default run's (each micro-batch's at 1 / M) with the coefficients divided by N — the oracle
/// here, on one rank and under dp2 × ep2 and tp2 + sp.
#[test]
fn per_token_loss_scales_the_routers_losses_by_the_token_count() {
    let (aux, z) = (0.5, 0.05); // large enough to move the gradient norms well past 1e-4
    let moe = |per_token: bool, div: f64| {
        settings(&TrainArgs {
            num_experts: Some(4),
            moe_ffn_hidden_size: Some(24),
            moe_router_topk: Some(2),
            moe_aux_loss_coeff: Some(aux / div),
            moe_z_loss_coeff: Some(z / div),
            micro_batch_size: Some(2),
            calculate_per_token_loss: per_token,
            ..tiny_args(true)
        })
    };
    let s = moe(true, 1.0);
    let n = (s.micro_batch_size * s.seq_length) as f64; // no --eod-mask-loss: every position counts
    let oracle = run(&moe(false, n), 1);
    let one = run(&s, 1);
    close("losses", &one.losses, &oracle.losses);
    close("gradient norms", &one.grad_norms, &oracle.grad_norms);
    // The values logged are the losses before their coefficients: the same routing, the same values.
    assert_eq!(one.router_losses.len(), oracle.router_losses.len());
    for (&(i, lb, zl), &(_, lb0, z0)) in one.router_losses.iter().zip(&oracle.router_losses) {
        assert!(
            (lb - lb0).abs() <= 1e-4 * lb && (zl - z0).abs() <= 1e-4 * zl,
            "iteration {i}: {lb} {zl} vs {lb0} {z0}"
        );
    }
    // Without the division the routers' gradients are N times larger: the norms part.
    let plain = run(&moe(false, 1.0), 1);
    let apart = plain.grad_norms.iter().zip(&one.grad_norms).any(|(a, b)| (a.1 - b.1).abs() > 1e-3 * b.1);
    assert!(apart, "the routers' losses do not move the gradient: the test checks nothing");
    let mut dp_ep = s.clone();
    dp_ep.moe.as_mut().unwrap().expert_model_parallel_size = 2;
    follows("per token, dp2 × ep2", &run(&dp_ep, 2), &one);
    let mut tp = s.clone();
    (tp.tensor_model_parallel_size, tp.sequence_parallel) = (2, true);
    follows("per token, tp2 + sp", &run(&tp, 2), &one);
}
