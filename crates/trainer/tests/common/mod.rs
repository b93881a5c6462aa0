//! Tiny settings shared by the trainer tests: small enough to train in seconds.
#![allow(dead_code)] // each test binary uses part of it

use ferrotron_trainer::settings::{Launch, Paths, Settings, TrainArgs};
use ferrotron_trainer::train::{Summary, train};
use std::path::PathBuf;

pub fn tiny_args(llama: bool) -> TrainArgs {
    TrainArgs {
        preset: Some(if llama { "llama-tiny" } else { "tiny" }.into()),
        num_layers: Some(2),
        hidden_size: Some(32),
        num_attention_heads: Some(4),
        num_query_groups: Some(if llama { 2 } else { 4 }),
        ffn_hidden_size: Some(64),
        seq_length: Some(32),
        max_position_embeddings: Some(32),
        micro_batch_size: Some(4),
        global_batch_size: Some(8),
        train_iters: Some(8),
        lr_warmup_iters: Some(2),
        eval_interval: Some(4),
        eval_iters: Some(2),
        save_interval: Some(4),
        log_interval: Some(1),
        corpus_docs: Some(400),
        no_progress: true,
        ..TrainArgs::default()
    }
}

pub fn settings(args: &TrainArgs) -> Settings {
    Settings::resolve(args).expect("valid settings").0
}

pub fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ferrotron-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Losses by iteration as their bits, for comparisons that must be exact.
pub fn bits(l: &[(u64, f64)]) -> Vec<(u64, u64)> {
    l.iter().map(|(i, x)| (*i, x.to_bits())).collect()
}

/// `s` trained on one rank, or on `ranks` thread ranks.
pub fn run(s: &Settings, ranks: usize) -> Summary {
    let launch = if ranks == 1 { Launch::Single } else { Launch::Threads(ranks) };
    train(s, &Paths { launch, ..Paths::default() }).unwrap()
}

/// The same iterations' values within 1e-4 relative of one rank's.
pub fn close(tag: &str, got: &[(u64, f64)], want: &[(u64, f64)]) {
    assert_eq!(got.len(), want.len(), "{tag}");
    for ((i, a), (_, b)) in got.iter().zip(want) {
        assert!((a - b).abs() <= 1e-4 * b.abs(), "{tag} iteration {i}: {a} vs {b} (1 rank)");
    }
}

/// A layout's losses, gradient norms and validation losses `close` to one rank's.
pub fn follows(tag: &str, got: &Summary, one: &Summary) {
    close(tag, &got.losses, &one.losses);
    close(&format!("{tag} gradient norms"), &got.grad_norms, &one.grad_norms);
    close(&format!("{tag} validation"), &got.evals, &one.evals);
}

/// `args` on `ranks` ranks is refused (by `Settings::resolve` or `validate_layout`, before
/// anything runs) with an error that contains `needle`.
pub fn refused(args: TrainArgs, ranks: usize, needle: &str) {
    let e = match Settings::resolve(&TrainArgs { nproc: Some(ranks), ..args }) {
        Err(e) => e,
        Ok((s, _)) => match s.validate_layout(ranks) {
            Err(e) => e,
            Ok(_) => panic!("{needle}: accepted"),
        },
    };
    assert!(format!("{e:#}").contains(needle), "{needle}: {e:#}");
}

/// `s` under tensor parallelism 2 with sequence parallelism, and under context parallelism 2,
/// each `follows` one rank's run `one`.
pub fn follows_tp_sp_and_cp(s: &Settings, one: &Summary) {
    let mut tp = s.clone();
    tp.tensor_model_parallel_size = 2;
    tp.sequence_parallel = true;
    follows("tp2 with SP", &run(&tp, 2), one);
    let mut cp = s.clone();
    cp.context_parallel_size = 2;
    follows("cp2", &run(&cp, 2), one);
}

/// `s` under tensor parallelism with sequence parallelism, and under two pipeline stages, each
/// `follows` one rank's run `one`.
pub fn follows_tp_sp_and_pp(s: &Settings, one: &Summary) {
    let mut tp = s.clone();
    tp.tensor_model_parallel_size = 2;
    tp.sequence_parallel = true;
    follows("tp2 with SP", &run(&tp, 2), one);
    let mut pp = s.clone();
    pp.pipeline_model_parallel_size = 2;
    follows("pp2", &run(&pp, 2), one);
}

/// Multi-latent attention on the Llama-style tiny model: latents of 16 (queries) and 12 (keys and
/// values), heads of 8 + 4 rotary features, values 6 wide.
pub fn mla_args() -> TrainArgs {
    TrainArgs {
        multi_latent_attention: true,
        q_lora_rank: Some(16),
        kv_lora_rank: Some(12),
        qk_head_dim: Some(8),
        qk_pos_emb_head_dim: Some(4),
        v_head_dim: Some(6),
        ..tiny_args(true)
    }
}
