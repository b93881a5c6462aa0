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
    let cases: [(TrainArgs, &[&str]); 4] = [
        (TrainArgs { context_parallel_size: Some(3), ..tiny_args(true) }, &["--seq-length 32", "multiple of 6"]),
        (
            TrainArgs { context_parallel_size: Some(2), attention_dropout: Some(0.1), ..tiny_args(true) },
            &["--attention-dropout", "multiple of 64"],
        ),
        (
            TrainArgs { context_parallel_size: Some(2), window_size: Some("(8,0)".into()), ..tiny_args(true) },
            &["--window-size"],
        ),
        (
            TrainArgs { context_parallel_size: Some(2), cp_comm_type: Some("a2a".into()), ..tiny_args(true) },
            &["--cp-comm-type a2a", "allgather"],
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
