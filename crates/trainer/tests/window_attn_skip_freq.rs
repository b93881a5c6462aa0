//! --window-attn-skip-freq: the sliding window in some layers only (Megatron's full-attention
//! layers among sliding-window ones, gpt-oss's alternation). Its oracles: a window in no layer
//! is no window, one in every layer is the plain window (bit for bit), and under tensor and
//! pipeline parallelism each layer keeps its own choice (the pipeline's second stage holds the
//! full-attention layer), as one rank has it. The forward against megatron-core itself:
//! tests/megatron_convert.rs's window_skip_dist.

mod common;

use common::*;
use ferrotron_trainer::settings::TrainArgs;

fn windowed(skip: Option<&str>) -> TrainArgs {
    TrainArgs { window_size: Some("(3,0)".into()), window_attn_skip_freq: skip.map(str::to_string), ..tiny_args(true) }
}

#[test]
fn full_attention_layers_among_windowed_ones_train_as_one_rank() {
    let plain = run(&settings(&tiny_args(true)), 1);
    let window = run(&settings(&windowed(None)), 1);
    assert_ne!(bits(&plain.losses), bits(&window.losses), "the window changed nothing");
    // Every layer full (N = 1): no window at all; every layer windowed: the plain window.
    assert_eq!(bits(&run(&settings(&windowed(Some("1"))), 1).losses), bits(&plain.losses));
    assert_eq!(bits(&run(&settings(&windowed(Some("[1]*2"))), 1).losses), bits(&window.losses));
    // Layer 1 windowed, layer 2 (counting from 1) full: neither.
    let s = settings(&windowed(Some("2")));
    let one = run(&s, 1);
    assert_ne!(bits(&one.losses), bits(&plain.losses));
    assert_ne!(bits(&one.losses), bits(&window.losses));
    follows_tp_sp_and_pp(&s, &one);
}
