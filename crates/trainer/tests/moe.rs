//! Mixture-of-experts runs through the trainer: Megatron's --num-experts / --moe-* flags, the
//! layouts against one rank, resume bit for bit, the routers' losses in the log, bad flags named.

mod common;

use common::*;
use ferrotron_trainer::checkpoint;
use ferrotron_trainer::settings::{Launch, LoadMode, Paths, Settings, TrainArgs};
use ferrotron_trainer::train::train;

fn moe_args() -> TrainArgs {
    moe_args_on(tiny_args(true))
}

/// `base` with four experts of 24 (top 2, both router losses) and a shared expert of 16.
fn moe_args_on(base: TrainArgs) -> TrainArgs {
    TrainArgs {
        num_experts: Some(4),
        moe_ffn_hidden_size: Some(24),
        moe_router_topk: Some(2),
        moe_aux_loss_coeff: Some(1e-2),
        moe_z_loss_coeff: Some(1e-3),
        // Shared experts too: a dense MLP beside the routed ones, replicated over the
        // expert-parallel ranks.
        moe_shared_expert_intermediate_size: Some(16),
        global_batch_size: Some(4),
        micro_batch_size: Some(1),
        ..base
    }
}

/// Tensor parallel 2 with sequence parallelism over `s`: experts split (Megatron's default), and
/// whole experts (--expert-tensor-parallel-size 1) over an expert-parallel group of 2.
fn tp2_sp_layouts(s: &Settings) -> (Settings, Settings) {
    let mut tp = s.clone();
    tp.tensor_model_parallel_size = 2;
    tp.sequence_parallel = true;
    let mut etp1 = tp.clone();
    etp1.moe.as_mut().unwrap().expert_model_parallel_size = 2;
    etp1.moe.as_mut().unwrap().expert_tensor_parallel_size = Some(1);
    (tp, etp1)
}

/// The routers' loss values of a run, load-balancing and z-loss at each log line.
fn router_values(r: &ferrotron_trainer::train::Summary) -> Vec<(u64, f64)> {
    r.router_losses.iter().flat_map(|&(i, lb, z)| [(i, lb), (i, z)]).collect()
}

/// Each layout (settings, thread ranks) trains as `one` did: the same losses, gradient norms (each
/// expert's gradient counted once, on the rank that holds it) and routers' loss values.
fn follows_one_rank(one: &ferrotron_trainer::train::Summary, layouts: &[(&str, &Settings, usize)]) {
    for &(tag, s, n) in layouts {
        let run = train(s, &Paths { launch: Launch::Threads(n), ..Paths::default() })
            .unwrap_or_else(|e| panic!("{tag}: {e:#}"));
        close(tag, &run.losses, &one.losses);
        close(&format!("{tag} gradient norms"), &run.grad_norms, &one.grad_norms);
        close(&format!("{tag} router losses"), &router_values(&run), &router_values(one));
    }
}

/// GPT-style experts (GeLU, biases on every linear) under tensor parallelism, with and without
/// sequence parallelism: the experts' partial sums are reduced once after the combine, each fc2
/// bias counted once (rank 0's), the probabilities' gradient summed over the group; the same
/// losses and gradient norms as one rank.
#[test]
fn moe_with_biases_follows_one_rank_under_tp() {
    let s1 = settings(&moe_args_on(tiny_args(false)));
    let one = train(&s1, &Paths::default()).unwrap();
    for sp in [false, true] {
        let mut tp = s1.clone();
        tp.tensor_model_parallel_size = 2;
        tp.sequence_parallel = sp;
        let run = train(&tp, &Paths { launch: Launch::Threads(2), ..Paths::default() }).unwrap();
        close(&format!("tp2 sp {sp}"), &run.losses, &one.losses);
        close(&format!("tp2 sp {sp} gradient norms"), &run.grad_norms, &one.grad_norms);
    }
}

/// Data parallel (distributed optimizer, overlapped reduce and gather), pipeline parallel
/// (× data parallel, full recompute), expert parallel (alone, × expert data parallel, under a
/// pipeline) and tensor parallel (each expert split; with sequence parallelism; × expert
/// parallel) train the MoE model as one rank does: the same losses and the same routers' loss
/// values (each micro-batch's router losses scaled as its language-model loss is, then averaged
/// over the data-parallel ranks; each expert's gradient summed over the tokens sent to it).
#[test]
fn moe_layouts_follow_one_rank() {
    let s1 = settings(&moe_args());
    let one = train(&s1, &Paths::default()).unwrap();
    assert_eq!(one.router_losses.len(), 8, "a router-loss value at each log line");
    assert!(one.router_losses.iter().all(|&(_, lb, z)| lb >= 1.0 - 1e-6 && z > 0.0), "{:?}", one.router_losses);
    let mut dp = s1.clone();
    dp.use_distributed_optimizer = true;
    dp.overlap_grad_reduce = true;
    dp.overlap_param_gather = true;
    let mut pp = s1.clone();
    pp.pipeline_model_parallel_size = 2;
    pp.recompute_granularity = Some("full".into());
    // Expert parallel: 2 × expert-data-parallel 2 (distributed optimizer, overlap), 4 (every
    // expert on one rank), and 2 under a pipeline of 2.
    let ep = |n: usize, base: &Settings| {
        let mut e = base.clone();
        e.moe.as_mut().unwrap().expert_model_parallel_size = n;
        e
    };
    let (ep2, ep4, ep2pp) = (ep(2, &dp), ep(4, &s1), ep(2, &pp));
    let mut tp = s1.clone();
    tp.tensor_model_parallel_size = 2;
    let mut tp_sp = tp.clone();
    tp_sp.sequence_parallel = true;
    let tp_ep = ep(2, &tp_sp);
    // Whole experts under tp2 with sp (--expert-tensor-parallel-size 1): each tensor-parallel
    // rank routes its own slice; experts replicated over the two (ep 1), split between them
    // (ep 2: the expert-parallel group is the tensor-parallel pair), and ep 4 across tp2 × dp2
    // with the distributed optimizer.
    let etp1 = |n: usize, base: &Settings| {
        let mut e = ep(n, base);
        e.moe.as_mut().unwrap().expert_tensor_parallel_size = Some(1);
        e
    };
    let mut tp_sp_dist = tp_sp.clone();
    tp_sp_dist.use_distributed_optimizer = true;
    let (etp1_ep1, etp1_ep2, etp1_ep4) = (etp1(1, &tp_sp), etp1(2, &tp_sp), etp1(4, &tp_sp_dist));
    follows_one_rank(
        &one,
        &[
            ("dp2", &dp, 2),
            ("pp2 × dp2", &pp, 4),
            ("ep2 × edp2", &ep2, 4),
            ("ep4", &ep4, 4),
            ("pp2 × ep2", &ep2pp, 4),
            ("tp2", &tp, 2),
            ("tp2 sp", &tp_sp, 2),
            ("tp2 sp × ep2", &tp_ep, 4),
            ("tp2 sp, whole experts", &etp1_ep1, 2),
            ("tp2 sp, whole experts × ep2", &etp1_ep2, 2),
            ("tp2 sp × dp2, whole experts × ep4, distributed", &etp1_ep4, 4),
        ],
    );
}

/// --moe-router-force-load-balancing (Megatron's RandomSTE benchmark): the routers choose by
/// random normal logits keyed by sample, position and expert, so the routers' loss values are the
/// same whatever the model's weights (two initialisations: equal at every step, where without the
/// flag they differ), a run under tp2 sp (split and whole experts), ep2 × edp2, pp2 with full
/// recompute (the draw repeated) and cp2 follows one rank, and the run differs from the routed one.
#[test]
fn forced_load_balancing_ignores_the_weights_and_follows_one_rank() {
    let forced = |a: TrainArgs| settings(&TrainArgs { moe_router_force_load_balancing: true, ..a });
    let s1 = forced(moe_args());
    let one = train(&s1, &Paths::default()).unwrap();
    let routed = train(&settings(&moe_args()), &Paths::default()).unwrap();
    assert_ne!(one.losses, routed.losses);
    let wide = |a: TrainArgs| TrainArgs { init_method_std: Some(0.05), ..a };
    let other = train(&forced(wide(moe_args())), &Paths::default()).unwrap();
    assert_eq!(router_values(&other), router_values(&one), "the routers' losses follow the random logits alone");
    assert_ne!(other.losses, one.losses);
    let routed_other = train(&settings(&wide(moe_args())), &Paths::default()).unwrap();
    assert_ne!(router_values(&routed_other), router_values(&routed));
    let (tp_sp, etp1) = tp2_sp_layouts(&s1);
    let mut ep2 = s1.clone();
    ep2.use_distributed_optimizer = true;
    ep2.moe.as_mut().unwrap().expert_model_parallel_size = 2;
    let mut pp = s1.clone();
    pp.pipeline_model_parallel_size = 2;
    pp.recompute_granularity = Some("full".into());
    let mut cp = s1.clone();
    cp.context_parallel_size = 2;
    follows_one_rank(
        &one,
        &[
            ("forced, tp2 sp", &tp_sp, 2),
            ("forced, tp2 sp, whole experts × ep2", &etp1, 2),
            ("forced, ep2 × edp2", &ep2, 4),
            ("forced, pp2 full recompute", &pp, 2),
            ("forced, cp2", &cp, 2),
        ],
    );
}

/// Stopped halfway and resumed from its checkpoint, the MoE run's losses are the straight run's
/// bit for bit; the checkpoint holds every expert under Megatron's SequentialMLP names and records
/// the MoE flags (--use-checkpoint-args rebuilds the same model).
#[test]
fn moe_resume_is_bit_exact_and_the_checkpoint_names_the_experts() {
    let s = settings(&moe_args());
    let (a, b, c) = (tmp("moe-a"), tmp("moe-b"), tmp("moe-c"));
    let straight = train(&s, &Paths { save: Some(a.clone()), ..Paths::default() }).unwrap();
    train(&s, &Paths { save: Some(b.clone()), exit_interval: Some(4), ..Paths::default() }).unwrap();
    let second = train(&s, &Paths { save: Some(c.clone()), load: Some(b.clone()), ..Paths::default() }).unwrap();
    assert_eq!(bits(&straight.losses[4..]), bits(&second.losses));
    let ck = checkpoint::load_params(&a).unwrap();
    for name in [
        "decoder.layers.1.mlp.router.weight",
        "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight",
        "decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight",
        "decoder.layers.1.mlp.shared_experts.linear_fc1.weight",
    ] {
        assert!(ck.tensors.contains_key(name), "{name} missing from {:?}", ck.tensors.keys().collect::<Vec<_>>());
    }
    assert_eq!(ck.tensors["decoder.layers.1.mlp.router.weight"].0, vec![4, 32]);
    assert_eq!(ck.tensors["decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight"].0, vec![48, 32]);
    // --use-checkpoint-args takes the MoE flags from the checkpoint.
    let from_ck =
        Settings::resolve(&TrainArgs { load: Some(a.clone()), use_checkpoint_args: true, ..tiny_args(false) })
            .unwrap()
            .0;
    assert_eq!(from_ck.moe, s.moe);
    for d in [a, b, c] {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// The load-balancing loss does its job: with a large coefficient the routers' loss at the end is
/// lower than the same run's without it (both log it through the z-loss's records).
#[test]
fn the_load_balancing_loss_balances() {
    let run = |coeff: f64| {
        let mut a = moe_args();
        a.moe_aux_loss_coeff = Some(coeff);
        a.train_iters = Some(16);
        a.lr = Some(1e-2);
        let r = train(&settings(&a), &Paths::default()).unwrap();
        r.router_losses.last().unwrap().1
    };
    let (off, on) = (run(0.0), run(1.0));
    assert!(on < off, "load-balancing loss with the coefficient {on}, without {off}");
}

/// Saved by four expert-parallel ranks (2 × expert-data-parallel 2, distributed optimizer: each
/// rank writes its own experts' shares; then tensor parallel 2 with sequence parallelism × expert
/// parallel 2: each rank half of each of its experts), resumed on one rank, and the other way
/// round: the losses follow the one-rank run.
#[test]
fn an_expert_parallel_checkpoint_resumes_on_one_rank_and_back() {
    let s1 = settings(&moe_args());
    let straight = train(&s1, &Paths::default()).unwrap();
    let mut ep_edp = s1.clone();
    ep_edp.use_distributed_optimizer = true;
    ep_edp.moe.as_mut().unwrap().expert_model_parallel_size = 2;
    let mut tp_ep = ep_edp.clone();
    tp_ep.tensor_model_parallel_size = 2;
    tp_ep.sequence_parallel = true;
    let mut tp_etp1 = tp_ep.clone();
    tp_etp1.moe.as_mut().unwrap().expert_model_parallel_size = 4;
    tp_etp1.moe.as_mut().unwrap().expert_tensor_parallel_size = Some(1);
    for (tag, s4) in [("ep 4 ranks", &ep_edp), ("tp2 sp × ep2", &tp_ep), ("tp2 sp × whole experts ep4", &tp_etp1)] {
        let (a, b) = (tmp("moe-ep-a"), tmp("moe-ep-b"));
        let four = Launch::Threads(4);
        let half = Paths { save: Some(a.clone()), exit_interval: Some(4), launch: four.clone(), ..Paths::default() };
        let first = train(s4, &half).unwrap();
        let second = train(&s1, &Paths { load: Some(a.clone()), ..Paths::default() }).unwrap();
        train(&s1, &Paths { save: Some(b.clone()), exit_interval: Some(4), ..Paths::default() }).unwrap();
        let third = train(s4, &Paths { load: Some(b.clone()), launch: four, ..Paths::default() }).unwrap();
        let all: Vec<(u64, f64)> = first.losses.iter().chain(&second.losses).cloned().collect();
        close(&format!("{tag}, then 1"), &all, &straight.losses);
        close(&format!("1 rank, then {tag}"), &third.losses, &straight.losses[4..]);
        for d in [a, b] {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

/// DeepSeek-V3's routing through the trainer: sigmoid scores, group-limited choice (2 groups of
/// 2, a token's experts from its best group), the expert bias moved after every step by the load
/// summed over the ranks. Data parallel (distributed optimizer), expert parallel × expert data
/// parallel, tensor parallel with sequence parallelism (experts split, and whole experts under
/// expert parallelism) and a pipeline follow one rank; a resumed run is the straight run bit for
/// bit, the checkpoint holding each layer's bias, moved by whole steps of the rate; a checkpoint
/// without biases is refused by a run that keeps them.
#[test]
fn deepseek_routing_follows_one_rank_and_resumes() {
    let rate = 1e-2;
    let a = TrainArgs {
        moe_router_score_function: Some("sigmoid".into()),
        moe_router_num_groups: Some(2),
        moe_router_group_topk: Some(1),
        moe_router_enable_expert_bias: true,
        moe_router_bias_update_rate: Some(rate),
        moe_router_topk_scaling_factor: Some(2.5),
        ..moe_args()
    };
    let s1 = settings(&a);
    let one = train(&s1, &Paths::default()).unwrap();
    let mut dp = s1.clone();
    dp.use_distributed_optimizer = true;
    let mut ep = dp.clone();
    ep.moe.as_mut().unwrap().expert_model_parallel_size = 2;
    let (tp, etp1) = tp2_sp_layouts(&s1);
    let mut pp = s1.clone();
    pp.pipeline_model_parallel_size = 2;
    follows_one_rank(
        &one,
        &[
            ("dp2", &dp, 2),
            ("ep2 × edp2", &ep, 4),
            ("tp2 sp", &tp, 2),
            ("tp2 sp, whole experts × ep2", &etp1, 2),
            ("pp2", &pp, 2),
        ],
    );
    // The bias steers: without it the same run trains differently.
    let unbiased = train(
        &settings(&TrainArgs { moe_router_enable_expert_bias: false, moe_router_bias_update_rate: None, ..a.clone() }),
        &Paths::default(),
    )
    .unwrap();
    assert_ne!(bits(&unbiased.losses), bits(&one.losses));
    // Stopped after 3 steps (an odd count: with tokens this alike the bias flips the group choice
    // back and forth, so it is 0 after an even count) and resumed: the straight run bit for bit.
    let b_dir = tmp("moe-ds-b");
    train(&s1, &Paths { save: Some(b_dir.clone()), exit_interval: Some(3), ..Paths::default() }).unwrap();
    let second = train(&s1, &Paths { load: Some(b_dir.clone()), ..Paths::default() }).unwrap();
    assert_eq!(bits(&one.losses[3..]), bits(&second.losses));
    let ck = checkpoint::load_params(&b_dir).unwrap();
    for layer in 0..2 {
        let (shape, v) = &ck.tensors[&format!("decoder.layers.{layer}.mlp.router.expert_bias")];
        assert_eq!(shape, &vec![4]);
        // Three steps of ±rate (or 0) each: whole multiples of the rate, at most 3.
        assert!(v.iter().any(|&b| b != 0.0), "layer {layer}: {v:?}");
        for &b in v {
            let steps = b as f64 / rate;
            assert!((steps - steps.round()).abs() < 1e-3 && steps.abs() <= 3.0 + 1e-3, "layer {layer}: {v:?}");
        }
    }
    // Generation reads the biases back with the parameters (it refuses a checkpoint without them,
    // below's error).
    let g = ferrotron_trainer::generate::generate(&ferrotron_trainer::generate::GenerateArgs {
        load: &b_dir,
        prompt: "a",
        max_new_tokens: 4,
        temperature: 0.0,
        top_k: 0,
        seed: 1,
    })
    .unwrap();
    assert!(g.len() > 1, "{g:?}");
    // A checkpoint saved without the bias does not load into a run that keeps one: refused, naming
    // the missing bias and the flag.
    let plain = settings(&moe_args());
    let p_dir = tmp("moe-ds-plain");
    train(&plain, &Paths { save: Some(p_dir.clone()), exit_interval: Some(2), ..Paths::default() }).unwrap();
    let e = train(&s1, &Paths { load: Some(p_dir.clone()), ..Paths::default() }).map(|_| ()).unwrap_err();
    let e = format!("{e:#}");
    assert!(e.contains("expert bias `decoder.layers.0.mlp.router.expert_bias`"), "{e}");
    // --finetune from it starts the biases from zero: the first step routes as without a bias.
    let nobias =
        settings(&TrainArgs { moe_router_enable_expert_bias: false, moe_router_bias_update_rate: None, ..a.clone() });
    let tune = |s: &Settings| {
        train(s, &Paths { load: Some(p_dir.clone()), load_mode: LoadMode::Finetune, ..Paths::default() }).unwrap()
    };
    let (tuned, without) = (tune(&s1), tune(&nobias));
    assert_eq!(tuned.losses[0].1.to_bits(), without.losses[0].1.to_bits(), "zero biases route as none at step 1");
    assert_ne!(bits(&tuned.losses), bits(&without.losses), "the biases moved after step 1");
    for d in [b_dir, p_dir] {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// DeepSeek's sequence-level load-balancing loss (--moe-router-load-balancing-type seq_aux_loss,
/// two sequences a micro-batch): each sequence's counts are summed over the ranks that hold its
/// pieces (context parallel, whole experts under tensor parallelism), its tokens counted whole.
/// Context parallel (× expert parallel), tensor parallel with sequence parallelism (experts split,
/// and whole experts × ep2) and data parallel follow one rank, the routers' loss values too; and
/// the value is not the micro-batch's loss.
#[test]
fn sequence_level_balancing_loss_follows_one_rank() {
    let a = TrainArgs {
        moe_router_load_balancing_type: Some("seq_aux_loss".into()),
        micro_batch_size: Some(2),
        global_batch_size: Some(4),
        ..moe_args()
    };
    let s1 = settings(&a);
    let one = train(&s1, &Paths::default()).unwrap();
    let batch =
        train(&settings(&TrainArgs { moe_router_load_balancing_type: None, ..a.clone() }), &Paths::default()).unwrap();
    assert_ne!(one.router_losses[0].1, batch.router_losses[0].1, "the sequences' loss is the micro-batch's");
    let mut cp = s1.clone();
    cp.context_parallel_size = 2;
    let mut cp_ep = cp.clone();
    cp_ep.moe.as_mut().unwrap().expert_model_parallel_size = 2;
    let (tp, etp1) = tp2_sp_layouts(&s1);
    let mut dp = s1.clone();
    dp.use_distributed_optimizer = true;
    follows_one_rank(
        &one,
        &[
            ("cp2", &cp, 2),
            ("cp2 × ep2", &cp_ep, 4),
            ("tp2 sp", &tp, 2),
            ("tp2 sp, whole experts × ep2", &etp1, 2),
            ("dp2", &dp, 2),
        ],
    );
}

/// Megatron's global-batch load-balancing loss (--moe-router-load-balancing-type global_aux_loss).
/// Oracles: with one micro-batch a step on one rank it is the micro-batch's loss, bit for bit;
/// over several micro-batches it is not (the running mean of their counts). Context, pipeline and
/// tensor parallelism (sequence parallel, and whole experts × ep2) follow one rank. Over dp2 the
/// counts are the two ranks' micro-batches' together and each rank's loss is its share of theirs,
/// its gradient averaged over dp: one rank with micro-batches twice as large (each the union of
/// the ranks' micro-batches) and half the coefficient is the same run, the logged value the same.
#[test]
fn global_batch_balancing_loss_follows_one_rank() {
    let global = |a: TrainArgs| TrainArgs { moe_router_load_balancing_type: Some("global_aux_loss".into()), ..a };
    let single = TrainArgs { global_batch_size: Some(1), ..moe_args() };
    let (g1, a1) = (
        train(&settings(&global(single.clone())), &Paths::default()).unwrap(),
        train(&settings(&single), &Paths::default()).unwrap(),
    );
    assert_eq!(bits(&g1.losses), bits(&a1.losses), "one micro-batch a step: the micro-batch's loss");
    assert_eq!(g1.router_losses, a1.router_losses);
    let s1 = settings(&global(moe_args()));
    let one = train(&s1, &Paths::default()).unwrap();
    let micro = train(&settings(&moe_args()), &Paths::default()).unwrap();
    assert_ne!(bits(&one.losses[1..]), bits(&micro.losses[1..]), "four micro-batches a step: the running mean counts");
    let mut cp = s1.clone();
    cp.context_parallel_size = 2;
    let mut pp = s1.clone();
    pp.pipeline_model_parallel_size = 2;
    let (tp, etp1) = tp2_sp_layouts(&s1);
    follows_one_rank(
        &one,
        &[("cp2", &cp, 2), ("pp2", &pp, 2), ("tp2 sp", &tp, 2), ("tp2 sp, whole experts × ep2", &etp1, 2)],
    );
    // Two micro-batches of 2 a step on one rank at half the coefficient: dp2 (micro-batches of
    // 1), with the distributed optimizer and with experts over both ranks.
    let doubled =
        settings(&global(TrainArgs { micro_batch_size: Some(2), moe_aux_loss_coeff: Some(5e-3), ..moe_args() }));
    let want = train(&doubled, &Paths::default()).unwrap();
    let mut dp = s1.clone();
    dp.use_distributed_optimizer = true;
    let mut ep = dp.clone();
    ep.moe.as_mut().unwrap().expert_model_parallel_size = 2;
    follows_one_rank(&want, &[("dp2", &dp, 2), ("dp2 × ep2", &ep, 2)]);
}

/// Token dropping (--moe-expert-capacity-factor): below an even share it drops copies and the
/// run parts from the dropless one; far above it drops none and is the dropless run bit for bit.
/// Each rank drops among its own micro-batch's copies, so the layouts that route whole
/// micro-batches (data, expert, tensor with sequence, and pipeline parallel) follow one rank.
#[test]
fn capacity_factor_drops_tokens_and_follows_one_rank() {
    let capped = |factor: f64, policy: Option<&str>| TrainArgs {
        moe_expert_capacity_factor: Some(factor),
        moe_token_drop_policy: policy.map(Into::into),
        moe_token_dispatcher_type: Some("alltoall".into()),
        ..moe_args()
    };
    let dropless = train(&settings(&moe_args()), &Paths::default()).unwrap();
    let roomy = train(&settings(&capped(8.0, None)), &Paths::default()).unwrap();
    assert_eq!(roomy.losses, dropless.losses, "a capacity no expert reaches drops nothing");
    let by_position = train(&settings(&capped(0.5, Some("position"))), &Paths::default()).unwrap();
    let s1 = settings(&capped(0.5, None));
    let one = train(&s1, &Paths::default()).unwrap();
    for (tag, run) in [("probs", &one), ("position", &by_position)] {
        assert_ne!(run.losses, dropless.losses, "{tag}: capacity 0.5 dropped nothing");
        assert!(run.losses.last().unwrap().1 < run.losses[0].1, "{tag}: {:?}", run.losses);
    }
    assert_ne!(one.losses, by_position.losses, "the policies keep different copies");
    // --moe-pad-expert-input-to-capacity: Megatron's padded rows carry weight 0, the same run.
    let padded = TrainArgs { moe_pad_expert_input_to_capacity: true, ..capped(0.5, None) };
    assert_eq!(bits(&train(&settings(&padded), &Paths::default()).unwrap().losses), bits(&one.losses));
    let mut dp = s1.clone();
    dp.use_distributed_optimizer = true;
    let mut ep2 = dp.clone();
    ep2.moe.as_mut().unwrap().expert_model_parallel_size = 2;
    let (tp_sp, _) = tp2_sp_layouts(&s1);
    let mut pp = s1.clone();
    pp.pipeline_model_parallel_size = 2;
    follows_one_rank(&one, &[("dp2", &dp, 2), ("ep2 × edp2", &ep2, 4), ("tp2 sp", &tp_sp, 2), ("pp2", &pp, 2)]);
}

/// The shared experts' gate (--moe-shared-expert-gate, Qwen-MoE's): a run of its own, and under
/// tensor parallelism (the shared experts' partial sums: the gate's score gradient summed over
/// the group), with sequence parallelism, with whole experts (each rank gating its own slice)
/// and under expert × expert-data parallelism it follows one rank.
#[test]
fn shared_expert_gate_follows_one_rank() {
    let s1 = settings(&TrainArgs { moe_shared_expert_gate: true, ..moe_args() });
    let one = train(&s1, &Paths::default()).unwrap();
    let ungated = train(&settings(&moe_args()), &Paths::default()).unwrap();
    assert_ne!(one.losses, ungated.losses, "the gate changed nothing");
    let mut tp = s1.clone();
    tp.tensor_model_parallel_size = 2;
    let (tp_sp, etp1) = tp2_sp_layouts(&s1);
    let mut ep2 = s1.clone();
    ep2.use_distributed_optimizer = true;
    ep2.moe.as_mut().unwrap().expert_model_parallel_size = 2;
    follows_one_rank(
        &one,
        &[("tp2", &tp, 2), ("tp2 sp", &tp_sp, 2), ("tp2 sp, whole experts × ep2", &etp1, 2), ("ep2 × edp2", &ep2, 4)],
    );
}

/// --moe-router-dtype fp32: under --bf16 the routers compute in fp32 (a different run from the
/// bf16 routers', within bf16's reach of it); in an fp32 run it changes nothing, bit for bit; the
/// checkpoint records it.
#[test]
fn fp32_routers() {
    let bf16 = TrainArgs { bf16: true, ..moe_args() };
    let fp32_router = TrainArgs { moe_router_dtype: Some("fp32".into()), ..bf16.clone() };
    let (a, b) = (
        train(&settings(&bf16), &Paths::default()).unwrap(),
        train(&settings(&fp32_router), &Paths::default()).unwrap(),
    );
    assert_ne!(bits(&a.losses), bits(&b.losses), "the fp32 routers changed nothing under --bf16");
    for ((i, x), (_, y)) in a.losses.iter().zip(&b.losses) {
        assert!((x - y).abs() < 2e-2 * y.abs(), "iteration {i}: {x} vs {y}");
    }
    let plain = train(&settings(&moe_args()), &Paths::default()).unwrap();
    let s32 = settings(&TrainArgs { moe_router_dtype: Some("fp32".into()), ..moe_args() });
    let d = tmp("moe-fp32-router");
    let run = train(&s32, &Paths { save: Some(d.clone()), ..Paths::default() }).unwrap();
    assert_eq!(bits(&run.losses), bits(&plain.losses));
    let from_ck =
        Settings::resolve(&TrainArgs { load: Some(d.clone()), use_checkpoint_args: true, ..tiny_args(false) })
            .unwrap()
            .0;
    assert!(from_ck.moe.as_ref().unwrap().moe_router_fp32);
    let _ = std::fs::remove_dir_all(d);
}

/// --moe-layer-freq: layer 0 dense (--ffn-hidden-size), layer 1 an MoE layer. One rank against a
/// pipeline of two × expert parallel 2, where the first stage holds no expert at all; the
/// checkpoint records the pattern.
#[test]
fn dense_and_moe_layers_mixed() {
    use ferrotron_transformer::spec::MlpSpec;
    let s1 = settings(&TrainArgs { moe_layer_freq: Some("([0]+[1]*1)".into()), ..moe_args() });
    let c = s1.model_config().unwrap();
    assert!(matches!(c.layer.mlp_of(0), MlpSpec::Dense { .. }) && matches!(c.layer.mlp_of(1), MlpSpec::Custom(_)));
    let one = train(&s1, &Paths::default()).unwrap();
    let mut pp = s1.clone();
    pp.pipeline_model_parallel_size = 2;
    pp.moe.as_mut().unwrap().expert_model_parallel_size = 2;
    let run = train(&pp, &Paths { launch: Launch::Threads(4), ..Paths::default() }).unwrap();
    close("pp2 × ep2, dense layer 0", &run.losses, &one.losses);
    close("pp2 × ep2 gradient norms", &run.grad_norms, &one.grad_norms);
    let d = tmp("moe-freq");
    train(&s1, &Paths { save: Some(d.clone()), exit_interval: Some(2), ..Paths::default() }).unwrap();
    let ck = checkpoint::load_params(&d).unwrap();
    assert!(ck.tensors.contains_key("decoder.layers.0.mlp.linear_fc1.weight"));
    assert!(ck.tensors.contains_key("decoder.layers.1.mlp.router.weight"));
    assert!(!ck.tensors.contains_key("decoder.layers.0.mlp.router.weight"));
    let from_ck =
        Settings::resolve(&TrainArgs { load: Some(d.clone()), use_checkpoint_args: true, ..TrainArgs::default() })
            .unwrap()
            .0;
    assert_eq!(from_ck.model_config().unwrap().num_params(), c.num_params());
    assert_eq!(
        from_ck.moe,
        s1.moe
            .as_ref()
            .map(|m| ferrotron_trainer::settings::MoeSettings { moe_layer_freq: Some("[0,1]".into()), ..m.clone() })
    );
    let _ = std::fs::remove_dir_all(d);
}

#[test]
fn bad_moe_flags_are_named() {
    let err = |a: TrainArgs| Settings::resolve(&a).map(|_| ()).unwrap_err().to_string();
    let e = err(TrainArgs { moe_router_topk: Some(2), ..tiny_args(true) });
    assert!(e.contains("--moe-router-topk") && e.contains("--num-experts"), "{e}");
    let e = err(TrainArgs { moe_router_topk: Some(5), ..moe_args() });
    assert!(e.contains("--moe-router-topk 5") && e.contains("--num-experts 4"), "{e}");
    let e = err(TrainArgs { expert_model_parallel_size: Some(3), ..moe_args() });
    assert!(e.contains("--num-experts 4 is not divisible by --expert-model-parallel-size 3"), "{e}");
    let e = err(TrainArgs { expert_model_parallel_size: Some(2), nproc: Some(3), ..moe_args() });
    assert!(e.contains("not divisible by --expert-model-parallel-size 2"), "{e}");
    let e = err(TrainArgs { moe_layer_freq: Some("[1,0,1]".into()), ..moe_args() });
    assert!(e.contains("--moe-layer-freq [1,0,1] gives 3 layers but --num-layers is 2"), "{e}");
    let e = err(TrainArgs { moe_router_load_balancing_type: Some("sinkhorn".into()), ..moe_args() });
    assert!(e.contains("sinkhorn") && e.contains("not built yet") && e.contains("seq_aux_loss"), "{e}");
    let e = err(TrainArgs { moe_token_dispatcher_type: Some("alltoall_seq".into()), ..moe_args() });
    assert!(e.contains("--moe-token-dispatcher-type alltoall_seq: use allgather, alltoall or flex"), "{e}");
    let e = err(TrainArgs { moe_shared_expert_gate: true, moe_shared_expert_intermediate_size: None, ..moe_args() });
    assert!(
        e.contains("--moe-shared-expert-gate gates the shared experts: add --moe-shared-expert-intermediate-size"),
        "{e}"
    );
    let e = err(TrainArgs { moe_router_score_function: Some("tanh".into()), ..moe_args() });
    assert!(e.contains("--moe-router-score-function tanh: use softmax, sigmoid or sqrtsoftplus"), "{e}");
    let e = err(TrainArgs { moe_router_group_topk: Some(1), ..moe_args() });
    assert!(e.contains("--moe-router-group-topk 1") && e.contains("add --moe-router-num-groups"), "{e}");
    let e = err(TrainArgs { moe_router_num_groups: Some(3), moe_router_group_topk: Some(1), ..moe_args() });
    assert!(e.contains("4 experts cannot be split into 3 equal groups"), "{e}");
    let e = err(TrainArgs { moe_router_bias_update_rate: Some(1e-3), ..moe_args() });
    assert!(e.contains("add --moe-router-enable-expert-bias"), "{e}");
    let e = err(TrainArgs { moe_router_dtype: Some("fp64".into()), ..moe_args() });
    assert!(e.contains("--moe-router-dtype fp64 is not built: use fp32"), "{e}");
    let e = err(TrainArgs { moe_router_dtype: Some("bf16".into()), ..moe_args() });
    assert!(e.contains("--moe-router-dtype bf16: use fp32"), "{e}");
    let e = err(TrainArgs { moe_router_enable_expert_bias: true, ..moe_args() });
    assert!(e.contains("--moe-router-score-function sigmoid"), "{e}");
    let alltoall = || TrainArgs { moe_token_dispatcher_type: Some("alltoall".into()), ..moe_args() };
    // The flex dispatcher (DeepEP, HybridEP) is the same all-to-all: the same run, bit for bit.
    let flex = TrainArgs {
        moe_token_dispatcher_type: Some("flex".into()),
        moe_enable_deepep: true,
        moe_flex_dispatcher_backend: Some("deepep".into()),
        ..moe_args()
    };
    let run = |a: &TrainArgs| train(&settings(a), &Paths::default()).unwrap().losses;
    assert_eq!(bits(&run(&flex)), bits(&run(&alltoall())));
    let e = err(TrainArgs { moe_expert_capacity_factor: Some(1.0), ..moe_args() });
    assert!(e.contains("--moe-expert-capacity-factor") && e.contains("--moe-token-dispatcher-type alltoall"), "{e}");
    let e = err(TrainArgs { moe_token_drop_policy: Some("probs".into()), ..alltoall() });
    assert!(e.contains("--moe-token-drop-policy") && e.contains("add --moe-expert-capacity-factor"), "{e}");
    let e = err(TrainArgs {
        moe_expert_capacity_factor: Some(1.0),
        moe_token_drop_policy: Some("random".into()),
        ..alltoall()
    });
    assert!(e.contains("--moe-token-drop-policy random: use probs or position"), "{e}");
    let e = err(TrainArgs { moe_expert_capacity_factor: Some(0.0), ..alltoall() });
    assert!(e.contains("--moe-expert-capacity-factor 0 must be a finite value above 0"), "{e}");
    let e = err(TrainArgs { moe_pad_expert_input_to_capacity: true, ..alltoall() });
    assert!(e.contains("--moe-pad-expert-input-to-capacity") && e.contains("add --moe-expert-capacity-factor"), "{e}");
    let e = err(TrainArgs {
        moe_expert_capacity_factor: Some(1.0),
        moe_pad_expert_input_to_capacity: true,
        moe_router_enable_expert_bias: true,
        moe_router_score_function: Some("sigmoid".into()),
        ..alltoall()
    });
    assert!(e.contains("--moe-router-enable-expert-bias") && e.contains("drop one"), "{e}");
    // Megatron's negative factor: dropless.
    let s = settings(&TrainArgs { moe_expert_capacity_factor: Some(-1.0), ..alltoall() });
    assert_eq!(s.moe.unwrap().moe_expert_capacity_factor, None);
    let e = err(TrainArgs {
        tensor_model_parallel_size: Some(2),
        nproc: Some(2),
        moe_ffn_hidden_size: Some(25),
        ..moe_args()
    });
    assert!(e.contains("--moe-ffn-hidden-size 25 is not divisible by --tensor-model-parallel-size 2"), "{e}");
    let e = err(TrainArgs {
        tensor_model_parallel_size: Some(2),
        nproc: Some(2),
        expert_tensor_parallel_size: Some(1),
        ..moe_args()
    });
    assert!(e.contains("--expert-tensor-parallel-size 1") && e.contains("add --sequence-parallel"), "{e}");
    let e = err(TrainArgs {
        tensor_model_parallel_size: Some(4),
        sequence_parallel: true,
        nproc: Some(4),
        expert_tensor_parallel_size: Some(2),
        ..moe_args()
    });
    assert!(
        e.contains("--expert-tensor-parallel-size 2 differs from --tensor-model-parallel-size 4 and from 1"),
        "{e}"
    );
    assert!(
        Settings::resolve(&TrainArgs {
            tensor_model_parallel_size: Some(2),
            nproc: Some(2),
            expert_tensor_parallel_size: Some(2),
            ..moe_args()
        })
        .is_ok()
    );
}
