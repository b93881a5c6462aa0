//! Mamba hybrids through the trainer (--hybrid-override-pattern, --mamba-*): the layouts that
//! split them (context parallelism too) train as one rank does, a run resumes bit for bit, the flags round-trip through a
//! checkpoint's settings, and what is not built is refused by name.

mod common;

use common::*;
use ferrotron_trainer::checkpoint;
use ferrotron_trainer::settings::{Launch, Paths, Settings, TrainArgs};
use ferrotron_trainer::train::train;

/// `M*-M` at hidden 32: Mamba mixers of 8 heads × 8 channels, 2 groups of 4 state channels.
fn hybrid_args() -> TrainArgs {
    TrainArgs {
        preset: Some("mamba-tiny".into()),
        num_layers: Some(4),
        hybrid_layer_pattern: Some("M*-M".into()),
        mamba_head_dim: Some(8),
        mamba_state_dim: Some(4),
        mamba_num_groups: Some(2),
        ..tiny_args(true)
    }
}

/// Data parallel (distributed optimizer, overlapped reduce and gather), pipeline (1F1B, with full
/// recompute, and in the stages a pattern's '|' marks), tensor parallel (each rank a group of
/// heads; with sequence parallelism too), and combinations: the same losses, gradient norms and
/// validation losses as one rank.
#[test]
fn hybrid_layouts_follow_one_rank() {
    let s1 = settings(&hybrid_args());
    let one = run(&s1, 1);
    assert!(one.losses.last().unwrap().1 < one.losses[0].1, "it learns: {:?}", one.losses);
    let with = |f: &dyn Fn(&mut Settings)| {
        let mut s = s1.clone();
        f(&mut s);
        s
    };
    let dp = with(&|s| {
        s.use_distributed_optimizer = true;
        s.overlap_grad_reduce = true;
        s.overlap_param_gather = true;
    });
    let pp = with(&|s| s.pipeline_model_parallel_size = 2);
    let pp_recompute = with(&|s| {
        s.pipeline_model_parallel_size = 2;
        s.recompute_granularity = Some("full".into());
        s.recompute_method = Some("uniform".into());
        s.recompute_num_layers = Some(1);
    });
    let dp_pp = with(&|s| {
        s.pipeline_model_parallel_size = 2;
        s.use_distributed_optimizer = true;
    });
    let tp = with(&|s| s.tensor_model_parallel_size = 2);
    let tp_sp = with(&|s| {
        s.tensor_model_parallel_size = 2;
        s.sequence_parallel = true;
    });
    let tp_pp = with(&|s| {
        s.tensor_model_parallel_size = 2;
        s.pipeline_model_parallel_size = 2;
    });
    for (tag, s, n) in [
        ("dp2", &dp, 2),
        ("pp2", &pp, 2),
        ("pp2 recompute", &pp_recompute, 2),
        ("dp2 × pp2", &dp_pp, 4),
        ("tp2", &tp, 2),
        ("tp2 sp", &tp_sp, 2),
        ("tp2 × pp2", &tp_pp, 4),
    ] {
        let got = run(s, n);
        follows(tag, &got, &one);
    }
}

/// Context parallelism: each rank two chunks of every sequence, the mixers trading rows for
/// heads around their scans and the attention gathering K and V; alone, with sequence and
/// tensor parallelism, and with data parallelism and the distributed optimizer. With 4 groups
/// each rank takes its own; with 2, under cp4 or cp2 × tp2, ranks share a group (B and C
/// repeated to them, their gradients summed back); the attention by all-to-all as well. The same
/// losses, gradient norms and validation losses as one rank.
#[test]
fn hybrid_context_parallel_follows_one_rank() {
    for groups in [4, 2] {
        let s1 = settings(&TrainArgs { mamba_num_groups: Some(groups), ..hybrid_args() });
        let one = run(&s1, 1);
        let with = |cp: usize, f: &dyn Fn(&mut Settings)| {
            let mut s = s1.clone();
            s.context_parallel_size = cp;
            f(&mut s);
            s
        };
        let tp_sp = |s: &mut Settings| {
            s.tensor_model_parallel_size = 2;
            s.sequence_parallel = true;
        };
        let cases = match groups {
            4 => vec![
                ("cp2", with(2, &|_| {}), 2),
                ("cp2 × tp2 sp", with(2, &tp_sp), 4),
                ("cp2 × dp2", with(2, &|s| s.use_distributed_optimizer = true), 4),
                // The attention layer trading rows for heads too (--cp-comm-type a2a).
                ("cp2, attention by all-to-all", with(2, &|s| s.cp_comm_type = vec!["a2a".into()]), 2),
            ],
            _ => vec![("cp4, groups shared", with(4, &|_| {}), 4), ("cp2 × tp2 sp, groups shared", with(2, &tp_sp), 4)],
        };
        for (tag, s, n) in cases {
            follows(&format!("{groups} groups {tag}"), &run(&s, n), &one);
        }
    }
}

/// Mamba, attention and mixture-of-experts layers together (`M*EM`) under tensor and sequence
/// parallelism: each kind splits its own way (heads and groups, heads, every expert) and the run
/// follows one rank.
#[test]
fn a_hybrid_with_experts_follows_one_rank_under_tp() {
    let args = TrainArgs {
        hybrid_layer_pattern: Some("M*EM".into()),
        num_experts: Some(4),
        moe_ffn_hidden_size: Some(24),
        moe_aux_loss_coeff: Some(1e-2),
        ..hybrid_args()
    };
    let s1 = settings(&args);
    let one = run(&s1, 1);
    let mut tp = s1.clone();
    tp.tensor_model_parallel_size = 2;
    tp.sequence_parallel = true;
    follows("tp2 sp", &run(&tp, 2), &one);
}

/// Four steps, save, load, four steps: the straight run's losses and parameters, bit for bit;
/// the checkpoint holds Megatron's names and records the hybrid flags.
#[test]
fn hybrid_resume_is_bit_exact() {
    let s = settings(&hybrid_args());
    let (a, b, c) = (tmp("mamba-a"), tmp("mamba-b"), tmp("mamba-c"));
    let straight = train(&s, &Paths { save: Some(a.clone()), ..Paths::default() }).unwrap();
    train(&s, &Paths { save: Some(b.clone()), exit_interval: Some(4), ..Paths::default() }).unwrap();
    let second = train(&s, &Paths { save: Some(c.clone()), load: Some(b.clone()), ..Paths::default() }).unwrap();
    assert_eq!(bits(&straight.losses[4..]), bits(&second.losses));
    let (ka, kc) = (checkpoint::load(&a).unwrap(), checkpoint::load(&c).unwrap());
    for name in [
        "decoder.layers.0.mixer.in_proj.weight",
        "decoder.layers.0.mixer.conv1d.weight",
        "decoder.layers.0.mixer.A_log",
        "decoder.layers.0.norm.weight",
        "decoder.layers.1.self_attention.linear_qkv.weight",
        "decoder.layers.2.mlp.linear_fc1.weight",
        "decoder.layers.3.mixer.dt_bias",
        "decoder.final_norm.weight",
    ] {
        assert!(ka.tensors.contains_key(name), "{name} missing");
    }
    assert_eq!(ka.tensors["decoder.layers.0.mixer.conv1d.weight"].0, vec![64 + 2 * 2 * 4, 1, 4]);
    for (name, (_, x)) in &ka.tensors {
        assert!(x.iter().zip(&kc.tensors[name].1).all(|(x, y)| x.to_bits() == y.to_bits()), "{name} differs");
    }
    let m = ka.state.settings.mamba.as_ref().expect("the hybrid flags are recorded");
    assert_eq!((m.hybrid_layer_pattern.as_str(), m.mamba_head_dim, m.mamba_state_dim), ("M*-M", 8, 4));
    for d in [a, b, c] {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// The preset's flags come back from its config (what --use-checkpoint-args and a preset's
/// defaults go through), and an `E` layer takes the mixture of experts (also under expert
/// parallelism, against one rank).
#[test]
fn hybrid_flags_round_trip() {
    let s = settings(&TrainArgs { preset: Some("mamba-tiny".into()), ..TrainArgs::default() });
    let m = s.mamba.as_ref().expect("mamba-tiny is a hybrid");
    assert_eq!(
        (m.hybrid_layer_pattern.as_str(), m.mamba_head_dim, m.mamba_state_dim, m.mamba_num_groups),
        ("M-M*M-", 32, 16, 2)
    );
    let c = s.model_config().unwrap();
    assert_eq!(ferrotron_models::hybrid::pattern_of(&c).as_deref(), Some("M-M*M-"));
    let moe = settings(&TrainArgs {
        hybrid_layer_pattern: Some("ME*-".into()),
        num_experts: Some(4),
        moe_router_topk: Some(2),
        ..hybrid_args()
    });
    let c = moe.model_config().unwrap();
    assert_eq!(ferrotron_models::hybrid::pattern_of(&c).as_deref(), Some("ME*-"));
    let one = run(&moe, 1);
    assert!(one.losses.iter().all(|(_, l)| l.is_finite()));
    // The E layer's experts over two expert-parallel ranks train as one rank does.
    let mut ep = moe.clone();
    ep.moe.as_mut().unwrap().expert_model_parallel_size = 2;
    let got = run(&ep, 2);
    follows("E layers under ep2", &got, &one);
}

/// Megatron's current rules: the pattern sets the layer count over --num-layers, the deprecated
/// --hybrid-override-pattern still reads, the ratio flags allocate Megatron's pattern, and a
/// pattern of 2 × pp segments interleaves two virtual stages per pipeline rank.
#[test]
fn patterns_set_the_layers_and_the_stages() {
    let s = settings(&TrainArgs { num_layers: Some(7), hybrid_layer_pattern: Some("M*-".into()), ..hybrid_args() });
    assert_eq!(s.num_layers, 3);
    let old = settings(&TrainArgs {
        hybrid_layer_pattern: None,
        hybrid_override_pattern: Some("MM*".into()),
        ..hybrid_args()
    });
    assert_eq!((old.num_layers, old.mamba.as_ref().unwrap().hybrid_layer_pattern.as_str()), (3, "MM*"));
    let r = settings(&TrainArgs {
        preset: Some("llama-tiny".into()),
        hybrid_layer_pattern: None,
        num_layers: Some(10),
        hybrid_attention_ratio: Some(0.2),
        hybrid_mlp_ratio: Some(0.2),
        ..hybrid_args()
    });
    assert_eq!(r.mamba.as_ref().unwrap().hybrid_layer_pattern, "MMM*-M*MM-");
    // A preset's pattern gives way to ratios on the command line.
    let r = settings(&TrainArgs {
        hybrid_layer_pattern: None,
        num_layers: Some(4),
        hybrid_attention_ratio: Some(0.25),
        ..hybrid_args()
    });
    assert_eq!(r.mamba.as_ref().unwrap().hybrid_layer_pattern, "MM*M");

    let s1 = settings(&hybrid_args());
    let one = run(&s1, 1);
    let mut vpp = s1.clone();
    vpp.pipeline_model_parallel_size = 2;
    vpp.mamba.as_mut().unwrap().hybrid_layer_pattern = "M|*|-|M".into();
    assert_eq!(vpp.virtual_stages().unwrap(), 2);
    assert_eq!(vpp.stage_plan(0).unwrap().chunks, vec![0..1, 2..3]);
    let got = run(&vpp, 2);
    follows("pp2 × 2 virtual stages from the pattern", &got, &one);
}

#[test]
fn what_is_not_built_is_refused_by_name() {
    let err = |a: TrainArgs| -> String {
        match Settings::resolve(&a) {
            Err(e) => format!("{e:#}"),
            Ok((s, _)) => format!("{:#}", train(&s, &Paths::default()).unwrap_err()),
        }
    };
    let e = err(TrainArgs {
        tensor_model_parallel_size: Some(2),
        nproc: Some(2),
        mamba_num_groups: Some(1),
        ..hybrid_args()
    });
    assert!(e.contains("--tensor-model-parallel-size 2 does not divide --mamba-num-groups 1"), "{e}");
    let e = err(TrainArgs {
        context_parallel_size: Some(4),
        nproc: Some(4),
        mamba_num_groups: Some(6),
        mamba_num_heads: Some(12),
        ..hybrid_args()
    });
    assert!(e.contains("6 Mamba groups") && e.contains("must divide one another"), "{e}");
    let e = err(TrainArgs {
        hybrid_layer_pattern: Some("M*-M".into()),
        hybrid_override_pattern: Some("M*-M".into()),
        ..hybrid_args()
    });
    assert!(e.contains("keep --hybrid-layer-pattern"), "{e}");
    let e = err(TrainArgs { hybrid_attention_ratio: Some(0.25), ..hybrid_args() });
    assert!(e.contains("both place the layers"), "{e}");
    let e = err(TrainArgs { hybrid_layer_pattern: Some("ME*-".into()), ..hybrid_args() });
    assert!(e.contains("add --num-experts"), "{e}");
    let e = err(TrainArgs {
        hybrid_layer_pattern: Some("M|*|-M".into()),
        pipeline_model_parallel_size: Some(2),
        nproc: Some(2),
        ..hybrid_args()
    });
    assert!(e.contains("has 3 pipeline segments") && e.contains("--pipeline-model-parallel-size 2"), "{e}");
    let e = err(TrainArgs { hybrid_layer_pattern: Some("M||*-M".into()), ..hybrid_args() });
    assert!(e.contains("has no layers"), "{e}");
    let e = err(TrainArgs { hybrid_layer_pattern: Some("M*x-".into()), ..hybrid_args() });
    assert!(e.contains("'x' at 2"), "{e}");
    let e = err(TrainArgs { mamba_head_dim: Some(24), ..hybrid_args() });
    assert!(e.contains("--mamba-head-dim 24"), "{e}");
    let e = err(TrainArgs {
        hybrid_layer_pattern: Some("M|*|-|M".into()),
        pipeline_model_parallel_size: Some(2),
        num_layers_per_virtual_pipeline_stage: Some(1),
        nproc: Some(2),
        ..hybrid_args()
    });
    assert!(e.contains("drop --num-layers-per-virtual-pipeline-stage"), "{e}");
    let e = err(TrainArgs { mamba_state_dim: Some(8), preset: Some("llama-tiny".into()), ..tiny_args(true) });
    assert!(e.contains("--mamba-state-dim configures Mamba layers"), "{e}");
}

/// Saved under pp2 in the stages a pattern's '|' marks, resumed on one rank without the marks, and
/// saved under tp2 resumed on one rank and back: the straight run's losses (the checkpoint holds
/// whole tensors by name, whatever the layout).
#[test]
fn a_hybrid_checkpoint_resumes_under_another_layout() {
    let s1 = settings(&hybrid_args());
    let straight = run(&s1, 1);
    let mut s2 = s1.clone();
    s2.pipeline_model_parallel_size = 2;
    s2.mamba.as_mut().unwrap().hybrid_layer_pattern = "M|*-M".into();
    let dir = tmp("mamba-relayout");
    let half =
        Paths { save: Some(dir.clone()), exit_interval: Some(4), launch: Launch::Threads(2), ..Paths::default() };
    train(&s2, &half).unwrap();
    let second = train(&s1, &Paths { load: Some(dir.clone()), ..Paths::default() }).unwrap();
    close("resumed on one rank", &second.losses, &straight.losses[4..]);
    let _ = std::fs::remove_dir_all(dir);

    // Tensor-parallel parts (in_proj's z | x | B | C | dt blocks each cut in two) stored whole
    // by name: saved under tp2 and resumed on one rank, and the other way round.
    let mut tp2 = s1.clone();
    tp2.tensor_model_parallel_size = 2;
    for (tag, save, load, ranks) in [("tp2 → 1", &tp2, &s1, (2, 1)), ("1 → tp2", &s1, &tp2, (1, 2))] {
        let dir = tmp("mamba-tp-relayout");
        let launch = |n| if n == 1 { Launch::default() } else { Launch::Threads(n) };
        let half =
            Paths { save: Some(dir.clone()), exit_interval: Some(4), launch: launch(ranks.0), ..Paths::default() };
        train(save, &half).unwrap();
        let resumed = train(load, &Paths { load: Some(dir.clone()), launch: launch(ranks.1), ..Paths::default() });
        close(tag, &resumed.unwrap().losses, &straight.losses[4..]);
        let _ = std::fs::remove_dir_all(dir);
    }
}
