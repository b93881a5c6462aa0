//! Context parallelism through the trainer (Megatron's --context-parallel-size): every layout
//! that splits sequences trains as one rank does (losses, gradient norms, validation losses),
//! its checkpoint resumes on one rank, and the runs it cannot split are refused by name.

mod common;

use common::*;
use ferrotron_trainer::settings::{Launch, Paths, Settings, TrainArgs};
use ferrotron_trainer::train::{Summary, train};

/// The Llama-style model (RoPE at the chunks' global positions, GQA, SwiGLU) and the GPT-2-style
/// one (learned absolute positions, --eod-mask-loss so that the chunks hold different numbers of
/// counted tokens) under cp 2 and 4, cp × sequence-parallel tp, cp × data parallel (distributed
/// optimizer, overlapped reduce and gather), cp × pipeline (with selective recompute): the same
/// losses, gradient norms and validation losses as one rank. Weights drawn at std 0.2: near-uniform
/// attention at the default init would hide wrong positions below the comparison's tolerance.
#[test]
fn context_parallel_layouts_follow_one_rank() {
    for llama in [true, false] {
        let args = TrainArgs { eod_mask_loss: !llama, init_method_std: Some(0.2), ..tiny_args(llama) };
        let s1 = settings(&args);
        let one = run(&s1, 1);
        let with = |f: &dyn Fn(&mut Settings)| {
            let mut s = s1.clone();
            s.context_parallel_size = 2;
            f(&mut s);
            s
        };
        let cp2 = with(&|_| {});
        let cp4 = with(&|s| s.context_parallel_size = 4);
        let cp_tp = with(&|s| {
            s.tensor_model_parallel_size = 2;
            s.sequence_parallel = true;
        });
        let cp_dp = with(&|s| {
            s.use_distributed_optimizer = true;
            s.overlap_grad_reduce = true;
            s.overlap_param_gather = true;
        });
        let cp_pp = with(&|s| {
            s.pipeline_model_parallel_size = 2;
            s.recompute_granularity = Some("selective".into());
        });
        for (tag, s, n) in [
            ("cp2", &cp2, 2),
            ("cp4", &cp4, 4),
            ("cp2 × tp2 sp", &cp_tp, 4),
            ("cp2 × dp2", &cp_dp, 4),
            ("cp2 × pp2", &cp_pp, 4),
        ] {
            follows(&format!("{} {tag}", if llama { "llama" } else { "gpt" }), &run(s, n), &one);
        }
    }
}

/// --cp-comm-type a2a (the core attention on 1/cp of the heads over the whole sequence, by
/// all-to-all): GQA, tensor × sequence parallel, a sliding window and attention dropout on chunks
/// of 8 tokens (both refused by the all-gather), a per-layer list mixing both exchanges, the
/// learned sink softmax (it reads the lse the all-to-all trades back) and multi-latent attention
/// train as one rank does.
#[test]
fn all_to_all_context_parallelism_follows_one_rank() {
    let a2a = |s: &Settings, cp: usize, f: &dyn Fn(&mut Settings)| {
        let mut s = s.clone();
        s.context_parallel_size = cp;
        s.cp_comm_type = vec!["a2a".into()];
        f(&mut s);
        s
    };
    let wide = |a: TrainArgs| settings(&TrainArgs { init_method_std: Some(0.2), ..a });
    let (llama, gpt) = (wide(tiny_args(true)), wide(tiny_args(false)));
    let window = wide(TrainArgs { window_size: Some("(8,0)".into()), ..tiny_args(true) });
    let dropout = wide(TrainArgs { hidden_dropout: Some(0.1), attention_dropout: Some(0.1), ..tiny_args(false) });
    let sink = wide(TrainArgs { softmax_type: Some("learnable".into()), ..tiny_args(true) });
    let mla = wide(mla_args());
    let (llama_one, gpt_one) = (run(&llama, 1), run(&gpt, 1));
    let cases: [(&str, Settings, usize, Summary); 7] = [
        ("a2a cp2, GQA", a2a(&llama, 2, &|_| {}), 2, llama_one.clone()),
        (
            "a2a cp2 × tp2 sp",
            a2a(&gpt, 2, &|s| (s.tensor_model_parallel_size, s.sequence_parallel) = (2, true)),
            4,
            gpt_one.clone(),
        ),
        (
            "a2a cp2, layer 0 a2a, layer 1 allgather",
            a2a(&llama, 2, &|s| s.cp_comm_type.push("allgather".into())),
            2,
            llama_one,
        ),
        ("a2a cp2, sliding window", a2a(&window, 2, &|_| {}), 2, run(&window, 1)),
        ("a2a cp2, dropout on chunks of 8", a2a(&dropout, 2, &|_| {}), 2, run(&dropout, 1)),
        ("a2a cp2, learned sink", a2a(&sink, 2, &|_| {}), 2, run(&sink, 1)),
        ("a2a cp2, multi-latent attention", a2a(&mla, 2, &|_| {}), 2, run(&mla, 1)),
    ];
    for (tag, s, n, one) in &cases {
        follows(tag, &run(s, *n), one);
    }
    // The window and the dropout do change the run (the cases test something).
    assert_ne!(cases[3].3.losses, cases[0].3.losses);
    assert_ne!(cases[4].3.losses, gpt_one.losses);
}

/// Hidden and attention dropout under context parallelism (GPT-2's 0.1 each): each rank draws the
/// whole sequence's masks at its chunks' places (hidden: by position; attention: the mask's tiles
/// of each chunk block), so cp 2 and cp 2 × sequence-parallel tp 2 train as one rank does.
#[test]
fn dropout_under_context_parallelism_follows_one_rank() {
    let args = TrainArgs {
        seq_length: Some(64),
        max_position_embeddings: Some(64),
        hidden_dropout: Some(0.1),
        attention_dropout: Some(0.1),
        ..tiny_args(false)
    };
    let s1 = settings(&args);
    let one = run(&s1, 1);
    let mut cp = s1.clone();
    cp.context_parallel_size = 2;
    let mut cp_tp = cp.clone();
    cp_tp.tensor_model_parallel_size = 2;
    cp_tp.sequence_parallel = true;
    for (tag, s, n) in [("dropout cp2", &cp, 2), ("dropout cp2 × tp2 sp", &cp_tp, 4)] {
        follows(tag, &run(s, n), &one);
    }
}

/// Mixture of experts under context parallelism, alone and with expert parallelism (cp 2 × ep 2:
/// the expert grid folds cp into expert data parallelism): the same losses, gradient norms and
/// routers' loss values as one rank (the load-balancing and z-losses count the micro-batch's
/// tokens over every cp rank: with the local counts and totals both the values and the gradients
/// differ).
#[test]
fn moe_under_context_parallelism_follows_one_rank() {
    let args = TrainArgs {
        num_experts: Some(4),
        moe_ffn_hidden_size: Some(24),
        moe_aux_loss_coeff: Some(1e-2),
        moe_z_loss_coeff: Some(1e-3),
        global_batch_size: Some(4),
        micro_batch_size: Some(1),
        ..tiny_args(true)
    };
    let s1 = settings(&args);
    let one = run(&s1, 1);
    let mut cp = s1.clone();
    cp.context_parallel_size = 2;
    let mut cp_ep = cp.clone();
    cp_ep.moe.as_mut().unwrap().expert_model_parallel_size = 2;
    let rl =
        |r: &Summary| -> Vec<(u64, f64)> { r.router_losses.iter().flat_map(|&(i, lb, z)| [(i, lb), (i, z)]).collect() };
    for (tag, s, n) in [("moe cp2", &cp, 2), ("moe cp2 × ep2", &cp_ep, 4)] {
        let r = run(s, n);
        follows(tag, &r, &one);
        close(&format!("{tag} router losses"), &rl(&r), &rl(&one));
    }
}

/// The distributed optimizer shards over data × context ranks: with cp 2 × dp 2 the flat
/// buffers must be padded to a multiple of 4, not of dp 2 (a GPT with an odd MLP width has
/// 26,498 parameters, 2 mod 4: padded to 2 only, the last bucket's two trailing elements would be
/// nobody's shard and never updated).
#[test]
fn the_distributed_optimizer_shards_over_data_and_context_ranks() {
    let s1 = settings(&TrainArgs { ffn_hidden_size: Some(65), ..tiny_args(false) });
    let one = run(&s1, 1);
    let mut s = s1.clone();
    s.context_parallel_size = 2;
    s.use_distributed_optimizer = true;
    follows("cp2 × dp2 distributed optimizer, odd parameter count", &run(&s, 4), &one);
}

/// A run saved under cp 2 × dp 2 (each parameter written once, by the first data × context rank)
/// resumes on one rank where the one-rank run stood.
#[test]
fn a_context_parallel_checkpoint_resumes_on_one_rank() {
    let dir = tmp("cp-resume");
    let s1 = settings(&tiny_args(true));
    let one = run(&s1, 1);
    let mut cp = s1.clone();
    cp.context_parallel_size = 2;
    let paths =
        Paths { launch: Launch::Threads(4), save: Some(dir.clone()), exit_interval: Some(4), ..Paths::default() };
    let first = train(&cp, &paths).unwrap();
    close("cp2 × dp2 first half", &first.losses, &one.losses[..4]);
    let rest = train(&s1, &Paths { load: Some(dir.clone()), ..Paths::default() }).unwrap();
    close("resumed on one rank", &rest.losses, &one.losses[4..]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn what_context_parallelism_cannot_split_is_refused_by_name() {
    let cases: [(TrainArgs, &[&str]); 7] = [
        (TrainArgs { context_parallel_size: Some(3), ..tiny_args(true) }, &["--seq-length 32", "multiple of 6"]),
        (
            TrainArgs { context_parallel_size: Some(2), attention_dropout: Some(0.1), ..tiny_args(true) },
            &["--attention-dropout", "multiple of 64"],
        ),
        (
            TrainArgs { context_parallel_size: Some(2), window_size: Some("(8,0)".into()), ..tiny_args(true) },
            &["--window-size", "--cp-comm-type a2a"],
        ),
        (
            TrainArgs { context_parallel_size: Some(2), cp_comm_type: Some(vec!["a2a+p2p".into()]), ..tiny_args(true) },
            &["--cp-comm-type a2a+p2p", "--hierarchical-context-parallel-sizes"],
        ),
        // The llama model's 2 query groups over 4 ranks.
        (
            TrainArgs { context_parallel_size: Some(4), cp_comm_type: Some(vec!["a2a".into()]), ..tiny_args(true) },
            &["2 query groups", "multiples of 4", "--cp-comm-type allgather"],
        ),
        (
            TrainArgs {
                context_parallel_size: Some(2),
                cp_comm_type: Some(vec!["a2a".into(), "p2p".into(), "a2a".into()]),
                ..tiny_args(true)
            },
            &["3 types for 2 layers"],
        ),
        (
            TrainArgs { context_parallel_size: Some(2), cp_comm_type: Some(vec!["ring".into()]), ..tiny_args(true) },
            &["--cp-comm-type ring", "a2a"],
        ),
    ];
    for (args, want) in cases {
        let args = TrainArgs { nproc: args.context_parallel_size, ..args };
        let e = format!("{:#}", ferrotron_trainer::settings::Settings::resolve(&args).unwrap_err());
        for w in want {
            assert!(e.contains(w), "{e}: should name {w}");
        }
    }
}
