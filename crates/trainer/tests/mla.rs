//! Multi-latent attention through the trainer (Megatron's --multi-latent-attention and its size
//! flags): data, tensor (with and without sequence parallelism), pipeline and context parallel
//! runs follow one rank (the per-parameter comparison, tighter, is ferrotron-optim's
//! `mla_and_mtp_layouts_match_one_rank`); the checkpoint keeps Megatron's names and the sizes (--use-checkpoint-args); what is
//! not built is refused by name.

mod common;

use common::*;
use ferrotron_trainer::checkpoint;
use ferrotron_trainer::settings::{Launch, Paths, Settings, TrainArgs};
use ferrotron_trainer::train::train;

#[test]
fn mla_layouts_follow_one_rank() {
    let s1 = settings(&mla_args());
    let one = train(&s1, &Paths::default()).unwrap();
    let mut dp = s1.clone();
    dp.use_distributed_optimizer = true;
    dp.overlap_grad_reduce = true;
    let mut tp = s1.clone();
    tp.tensor_model_parallel_size = 2;
    let mut tp_sp = tp.clone();
    tp_sp.sequence_parallel = true;
    let mut pp = s1.clone();
    pp.pipeline_model_parallel_size = 2;
    // Context parallel: the rotary part at its chunks' global positions, the core attention over
    // the whole sequence. Weights drawn wider (std 0.2) so that the scores, and so the positions,
    // move the losses by more than `follows` allows (near-uniform attention at init hides them).
    let wide = settings(&TrainArgs { init_method_std: Some(0.2), ..mla_args() });
    let wide_one = train(&wide, &Paths::default()).unwrap();
    let mut cp = wide.clone();
    cp.context_parallel_size = 2;
    let mut cp_tp = cp.clone();
    (cp_tp.tensor_model_parallel_size, cp_tp.sequence_parallel) = (2, true);
    // Without a query latent, under tensor and sequence parallelism.
    let direct = settings(&TrainArgs { q_lora_rank: None, ..mla_args() });
    let direct_one = train(&direct, &Paths::default()).unwrap();
    let mut direct_tp = direct.clone();
    direct_tp.tensor_model_parallel_size = 2;
    direct_tp.sequence_parallel = true;
    for (tag, s, n, base) in [
        ("dp2", &dp, 2, &one),
        ("tp2", &tp, 2, &one),
        ("tp2 sp", &tp_sp, 2, &one),
        ("pp2", &pp, 2, &one),
        ("cp2", &cp, 2, &wide_one),
        ("cp2 × tp2 sp", &cp_tp, 4, &wide_one),
        ("no query latent, tp2 sp", &direct_tp, 2, &direct_one),
    ] {
        let run = train(s, &Paths { launch: Launch::Threads(n), ..Paths::default() })
            .unwrap_or_else(|e| panic!("{tag}: {e:#}"));
        follows(tag, &run, base);
    }
    assert!(one.losses.last().unwrap().1 < one.losses[0].1, "it learns: {:?}", one.losses);
}

#[test]
fn an_mla_checkpoint_keeps_megatrons_names_and_the_sizes() {
    let s = settings(&mla_args());
    let dir = tmp("mla-ck");
    train(&s, &Paths { save: Some(dir.clone()), ..Paths::default() }).unwrap();
    let ck = checkpoint::load_params(&dir).unwrap();
    for (name, shape) in [
        ("decoder.layers.0.self_attention.linear_q_down_proj.weight", vec![16, 32]),
        ("decoder.layers.0.self_attention.q_layernorm.weight", vec![16]),
        ("decoder.layers.0.self_attention.linear_q_up_proj.weight", vec![4 * 12, 16]),
        ("decoder.layers.1.self_attention.linear_kv_down_proj.weight", vec![12 + 4, 32]),
        ("decoder.layers.1.self_attention.kv_layernorm.weight", vec![12]),
        ("decoder.layers.1.self_attention.linear_kv_up_proj.weight", vec![4 * (8 + 6), 12]),
        ("decoder.layers.1.self_attention.linear_proj.weight", vec![32, 4 * 6]),
    ] {
        let t = ck.tensors.get(name).unwrap_or_else(|| panic!("{name} missing"));
        assert_eq!(t.0, shape, "{name}");
    }
    let from_ck =
        Settings::resolve(&TrainArgs { load: Some(dir.clone()), use_checkpoint_args: true, ..tiny_args(true) })
            .unwrap()
            .0;
    assert_eq!(from_ck.mla, s.mla);
    assert_eq!(from_ck.model_config().unwrap().num_params(), s.model_config().unwrap().num_params());
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn mla_flags_not_built_are_refused() {
    refused(
        TrainArgs { rope_type: Some("yarn".into()), rotary_scaling_factor: Some(40.0), ..tiny_args(true) },
        1,
        "built for multi-latent attention",
    );
    refused(TrainArgs { rope_type: Some("rope".into()), rotary_scaling_factor: Some(40.0), ..mla_args() }, 1, "YaRN's");
    refused(TrainArgs { rotary_scaling_factor: Some(-2.0), ..mla_args() }, 1, "must be positive");
    refused(TrainArgs { rope_type: Some("rope".into()), yarn_beta_fast: Some(1.0), ..mla_args() }, 1, "--yarn-*");
    let yarn = TrainArgs { rotary_scaling_factor: Some(40.0), ..mla_args() };
    refused(TrainArgs { yarn_beta_slow: Some(0.0), ..yarn.clone() }, 1, "--yarn-beta-slow");
    refused(TrainArgs { no_yarn_correction_range_round_to_int: true, ..yarn }, 1, "floored and ceiled");
    refused(TrainArgs { multi_latent_attention: false, ..mla_args() }, 1, "add --multi-latent-attention");
    refused(TrainArgs { qk_layernorm: true, ..mla_args() }, 1, "--qk-layernorm");
    refused(
        TrainArgs { rotary_percent: Some(0.5), ..mla_args() },
        1,
        "--rotary-percent 0.5 with multi-latent attention",
    );
    // YaRN at factor 1 is plain RoPE (Megatron's MLA default).
    assert_eq!(settings(&TrainArgs { rope_type: Some("yarn".into()), ..mla_args() }).mla.unwrap().yarn, None);
}

/// YaRN on the rotary part (Megatron's MLA default type, here at factor 40 with
/// --mscale-all-dim 1 as DeepSeek-V3, and --yarn-beta-fast 0.5 / --yarn-beta-slow 0.25, which
/// move the ramp of the tiny rotary part's two pairs: 1..2 against Megatron's 0..1 at base
/// 500000): tensor × sequence parallel follows one rank, it changes the run (and so do the
/// betas), and the checkpoint keeps it (--use-checkpoint-args).
#[test]
fn mla_with_yarn_follows_one_rank_and_is_kept() {
    let args = TrainArgs {
        rotary_scaling_factor: Some(40.0),
        mscale_all_dim: Some(1.0),
        yarn_beta_fast: Some(0.5),
        yarn_beta_slow: Some(0.25),
        ..mla_args()
    };
    let s1 = settings(&args);
    let y = s1.mla.unwrap().yarn.unwrap();
    assert_eq!((y.factor, y.mscale, y.mscale_all_dim, y.beta_fast, y.beta_slow), (40.0, 1.0, 1.0, 0.5, 0.25));
    assert_eq!(y.yarn().range(4, s1.rotary_base), (1.0, 2.0));
    assert_eq!(y.original_max_position_embeddings, 4096.0);
    let dir = tmp("mla-yarn");
    let one = train(&s1, &Paths { save: Some(dir.clone()), ..Paths::default() }).unwrap();
    let plain = train(&settings(&mla_args()), &Paths::default()).unwrap();
    assert_ne!(one.losses[0].1, plain.losses[0].1, "YaRN left the first loss unchanged");
    let megatron_betas =
        train(&settings(&TrainArgs { yarn_beta_fast: None, yarn_beta_slow: None, ..args.clone() }), &Paths::default())
            .unwrap();
    assert_ne!(bits(&one.losses), bits(&megatron_betas.losses), "the betas moved no frequency");
    let mut tp = s1.clone();
    tp.tensor_model_parallel_size = 2;
    tp.sequence_parallel = true;
    let run = train(&tp, &Paths { launch: Launch::Threads(2), ..Paths::default() }).unwrap();
    follows("yarn tp2 sp", &run, &one);
    let mut cp = s1.clone();
    cp.context_parallel_size = 2;
    let run = train(&cp, &Paths { launch: Launch::Threads(2), ..Paths::default() }).unwrap();
    follows("yarn cp2", &run, &one);
    let from_ck =
        Settings::resolve(&TrainArgs { load: Some(dir.clone()), use_checkpoint_args: true, ..tiny_args(true) })
            .unwrap()
            .0;
    assert_eq!(from_ck.mla, s1.mla);
    let _ = std::fs::remove_dir_all(dir);
}

/// The `deepseek-v3-tiny` preset (MLA with YaRN, a dense first layer, grouped sigmoid experts
/// with the expert bias and a shared expert, one MTP depth) as Megatron's DeepSeek-V3 recipe runs
/// it: tensor × sequence parallel, expert parallel over the data-parallel ranks, a pipeline (the
/// MTP depth on the last stage with its own copy of the untied embedding) and context parallel,
/// each as one rank: losses, gradient norms, the MTP loss and the routers' balancing loss.
#[test]
fn the_deepseek_v3_tiny_preset_follows_one_rank() {
    let args = TrainArgs {
        preset: Some("deepseek-v3-tiny".into()),
        seq_length: Some(32),
        micro_batch_size: Some(2),
        global_batch_size: Some(4),
        train_iters: Some(4),
        lr_warmup_iters: Some(1),
        eval_interval: Some(4),
        eval_iters: Some(1),
        log_interval: Some(1),
        corpus_docs: Some(200),
        no_progress: true,
        ..TrainArgs::default()
    };
    let s1 = settings(&args);
    assert!(s1.mla.and_then(|m| m.yarn).is_some() && s1.mtp_num_layers == Some(1));
    let one = train(&s1, &Paths::default()).unwrap();
    assert_eq!(one.mtp_losses.len(), 4);
    let mut tp = s1.clone();
    tp.tensor_model_parallel_size = 2;
    tp.sequence_parallel = true;
    let mut ep = s1.clone();
    ep.moe.as_mut().unwrap().expert_model_parallel_size = 2;
    let mut pp = s1.clone();
    pp.pipeline_model_parallel_size = 2;
    let mut cp = s1.clone();
    cp.context_parallel_size = 2;
    for (tag, s) in [("tp2 sp", &tp), ("dp2 × ep2", &ep), ("pp2", &pp), ("cp2", &cp)] {
        let run = train(s, &Paths { launch: Launch::Threads(2), ..Paths::default() })
            .unwrap_or_else(|e| panic!("{tag}: {e:#}"));
        follows(tag, &run, &one);
        let mtp =
            |r: &ferrotron_trainer::train::Summary| r.mtp_losses.iter().map(|(i, l)| (*i, l[0])).collect::<Vec<_>>();
        close(&format!("{tag} MTP"), &mtp(&run), &mtp(&one));
        let lb = |r: &ferrotron_trainer::train::Summary| {
            r.router_losses.iter().map(|&(i, lb, _)| (i, lb)).collect::<Vec<_>>()
        };
        close(&format!("{tag} balancing"), &lb(&run), &lb(&one));
    }
}
