//! Tiny settings shared by the trainer tests: small enough to train in seconds.
#![allow(dead_code)] // each test binary uses part of it

use ferrotron_trainer::settings::{Settings, TrainArgs};
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
