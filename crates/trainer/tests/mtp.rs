//! Multi-token prediction through the trainer (Megatron's --mtp-num-layers and
//! --mtp-loss-scaling-factor): the layouts against one rank (losses, gradient norms and the
//! depths' losses), with MoE layers, resume bit for bit with Megatron's names in the checkpoint,
//! and the combinations not built refused by name.

mod common;

use common::*;
use ferrotron_trainer::checkpoint;
use ferrotron_trainer::convert::{ConvertArgs, convert};
use ferrotron_trainer::settings::{Launch, Paths, Settings, TrainArgs};
use ferrotron_trainer::train::{Summary, train};

fn mtp_args(llama: bool) -> TrainArgs {
    TrainArgs { mtp_num_layers: Some(2), mtp_loss_scaling_factor: Some(0.3), ..tiny_args(llama) }
}

/// Each depth's losses of a run, as (iteration, value) per depth in turn.
fn depth_losses(r: &Summary) -> Vec<(u64, f64)> {
    let depths = r.mtp_losses.first().map_or(0, |m| m.1.len());
    (0..depths).flat_map(|d| r.mtp_losses.iter().map(move |(i, l)| (*i, l[d]))).collect()
}

fn follows_one_rank(one: &Summary, layouts: &[(&str, &Settings, usize)]) {
    for &(tag, s, n) in layouts {
        let run = train(s, &Paths { launch: Launch::Threads(n), ..Paths::default() })
            .unwrap_or_else(|e| panic!("{tag}: {e:#}"));
        follows(tag, &run, one);
        close(&format!("{tag} MTP losses"), &depth_losses(&run), &depth_losses(one));
    }
}

/// Llama style (RoPE, untied: under a pipeline the last stage keeps its own copy of the word
/// embedding for the depths, summed with the first stage's) and GPT-2 style (tied, learned
/// positions): data parallel (distributed optimizer, overlapped), tensor parallel with and
/// without sequence parallelism, pipeline parallel (× data parallel, full recompute), context
/// parallel (the depths' inputs rolled along the whole sequences before the split; × tensor
/// parallel with sequence parallelism).
#[test]
fn mtp_layouts_follow_one_rank() {
    let s1 = settings(&mtp_args(true));
    let one = train(&s1, &Paths::default()).unwrap();
    assert_eq!(one.mtp_losses.len(), 8, "the depths' losses at every iteration");
    assert!(one.mtp_losses.iter().all(|(_, l)| l.len() == 2 && l.iter().all(|&x| x > 0.0)), "{:?}", one.mtp_losses);
    // The depths learn: their losses fall as the model's does.
    let (first, last) = (&one.mtp_losses[0].1, &one.mtp_losses[7].1);
    assert!(last[0] < first[0] && last[1] < first[1], "{first:?} → {last:?}");
    let mut dp = s1.clone();
    dp.use_distributed_optimizer = true;
    dp.overlap_grad_reduce = true;
    dp.overlap_param_gather = true;
    let mut tp = s1.clone();
    tp.tensor_model_parallel_size = 2;
    let mut tp_sp = tp.clone();
    tp_sp.sequence_parallel = true;
    let mut pp = s1.clone();
    pp.pipeline_model_parallel_size = 2;
    let mut pp_dp = pp.clone();
    pp_dp.recompute_granularity = Some("full".into());
    // Context parallel from weights drawn at std 0.2, where the depths' rolled tokens and the
    // positions move the losses well past the comparison's tolerance.
    let wide = settings(&TrainArgs { init_method_std: Some(0.2), ..mtp_args(true) });
    let wide_one = train(&wide, &Paths::default()).unwrap();
    let mut cp = wide.clone();
    cp.context_parallel_size = 2;
    let mut cp_tp = cp.clone();
    (cp_tp.tensor_model_parallel_size, cp_tp.sequence_parallel) = (2, true);
    follows_one_rank(
        &one,
        &[
            ("dp2", &dp, 2),
            ("tp2", &tp, 2),
            ("tp2 sp", &tp_sp, 2),
            ("pp2", &pp, 2),
            ("pp2 × dp2, full recompute", &pp_dp, 4),
        ],
    );
    follows_one_rank(&wide_one, &[("cp2", &cp, 2), ("cp2 × tp2 sp", &cp_tp, 4)]);
    let g1 = settings(&mtp_args(false));
    let one = train(&g1, &Paths::default()).unwrap();
    let mut g_tp_sp = g1.clone();
    g_tp_sp.tensor_model_parallel_size = 2;
    g_tp_sp.sequence_parallel = true;
    follows_one_rank(&one, &[("gpt-2 style, tp2 sp", &g_tp_sp, 2)]);
}

/// Mixture-of-experts layers: the depth's layer is an MoE layer too (the decoder's last layer's
/// kind), its router's losses logged with the decoder's; expert parallel and tensor parallel runs
/// follow one rank.
#[test]
fn mtp_with_moe_layers_follows_one_rank() {
    let args = TrainArgs {
        num_experts: Some(4),
        moe_ffn_hidden_size: Some(24),
        moe_router_topk: Some(2),
        moe_aux_loss_coeff: Some(1e-2),
        global_batch_size: Some(4),
        micro_batch_size: Some(1),
        mtp_num_layers: Some(1),
        ..tiny_args(true)
    };
    let s1 = settings(&args);
    let one = train(&s1, &Paths::default()).unwrap();
    assert_eq!(one.mtp_losses.first().map(|m| m.1.len()), Some(1));
    let mut ep = s1.clone();
    ep.moe.as_mut().unwrap().expert_model_parallel_size = 2;
    let mut tp_sp = s1.clone();
    tp_sp.tensor_model_parallel_size = 2;
    tp_sp.sequence_parallel = true;
    follows_one_rank(&one, &[("ep2", &ep, 2), ("tp2 sp", &tp_sp, 2)]);
    for (tag, s) in [("ep2", &ep), ("tp2 sp", &tp_sp)] {
        let run = train(s, &Paths { launch: Launch::Threads(2), ..Paths::default() }).unwrap();
        let lb = |r: &Summary| r.router_losses.iter().map(|&(i, lb, _)| (i, lb)).collect::<Vec<_>>();
        close(&format!("{tag} router losses"), &lb(&run), &lb(&one));
    }
}

/// Stopped halfway and resumed, the losses (the depths' too) are the straight run's bit for bit;
/// the checkpoint holds the depths under Megatron's names, and --use-checkpoint-args rebuilds them.
#[test]
fn mtp_resume_is_bit_exact_and_the_checkpoint_names_the_depths() {
    let s = settings(&mtp_args(true));
    let (a, b, c) = (tmp("mtp-a"), tmp("mtp-b"), tmp("mtp-c"));
    let straight = train(&s, &Paths { save: Some(a.clone()), ..Paths::default() }).unwrap();
    train(&s, &Paths { save: Some(b.clone()), exit_interval: Some(4), ..Paths::default() }).unwrap();
    let second = train(&s, &Paths { save: Some(c.clone()), load: Some(b.clone()), ..Paths::default() }).unwrap();
    assert_eq!(bits(&straight.losses[4..]), bits(&second.losses));
    let depth = |r: &Summary, d: usize| r.mtp_losses.iter().map(|(i, l)| (*i, l[d])).collect::<Vec<_>>();
    assert_eq!(bits(&depth(&straight, 1)[4..]), bits(&depth(&second, 1)));
    let ck = checkpoint::load_params(&a).unwrap();
    for name in [
        "mtp.layers.0.enorm.weight",
        "mtp.layers.0.hnorm.weight",
        "mtp.layers.1.eh_proj.weight",
        "mtp.layers.1.transformer_layer.self_attention.linear_qkv.weight",
        "mtp.layers.1.transformer_layer.mlp.linear_fc2.weight",
        "mtp.layers.1.final_layernorm.weight",
    ] {
        assert!(ck.tensors.contains_key(name), "{name} missing from {:?}", ck.tensors.keys().collect::<Vec<_>>());
    }
    assert_eq!(ck.tensors["mtp.layers.0.eh_proj.weight"].0, vec![32, 64]);
    let from_ck =
        Settings::resolve(&TrainArgs { load: Some(a.clone()), use_checkpoint_args: true, ..tiny_args(false) })
            .unwrap()
            .0;
    assert_eq!((from_ck.mtp_num_layers, from_ck.mtp_loss_scaling_factor), (Some(2), 0.3));
    // A Hugging Face export has no place for the depths: left out, and said so.
    let hf = tmp("mtp-hf");
    let done = convert(&ConvertArgs::new("ferrotron", "hf", &a, &hf)).unwrap();
    let mtp = ck.tensors.keys().filter(|n| n.starts_with("mtp.")).count();
    assert_eq!(done.left_out, mtp);
    // Megatron-LM's torch_dist keeps the depths (each its own keys) and its run the flags: back
    // in, the same tensors.
    let (meg, back) = (tmp("mtp-megatron"), tmp("mtp-megatron-back"));
    convert(&ConvertArgs::new("ferrotron", "megatron", &a, &meg)).unwrap();
    let shapes = ferrotron_checkpoint::megatron::MegatronCheckpoint::open(&meg).unwrap().shapes();
    assert!(
        shapes.contains_key("mtp.layers.1.eh_proj.weight") && !shapes.keys().any(|k| k.starts_with("mtp.layers.2"))
    );
    convert(&ConvertArgs::new("megatron", "ferrotron", &meg, &back)).unwrap();
    let again = checkpoint::load(&back).unwrap();
    assert_eq!(again.state.settings.mtp_num_layers, Some(2));
    for (k, (_, v)) in again.tensors.iter().filter(|(k, _)| k.starts_with("mtp.")) {
        assert_eq!(&ck.tensors[k].1, v, "{k}");
    }
    let _ = (std::fs::remove_dir_all(&meg), std::fs::remove_dir_all(&back));
    assert!(mtp >= 2 * 8, "{mtp}");
    let written = std::fs::read(hf.join("model.safetensors")).unwrap();
    let names = safetensors::SafeTensors::deserialize(&written)
        .unwrap()
        .names()
        .into_iter()
        .map(String::from)
        .collect::<Vec<_>>();
    assert_eq!(names.len(), done.tensors);
    assert!(names.iter().all(|n| !n.contains("mtp")), "{names:?}");
    for d in [a, b, c, hf] {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// What is not built is refused by name before anything runs.
#[test]
fn mtp_combinations_not_built_are_refused() {
    refused(
        TrainArgs { context_parallel_size: Some(2), ..mtp_args(false) },
        2,
        "--context-parallel-size 2 with --mtp-num-layers and learned absolute",
    );
    refused(TrainArgs { pipeline_model_parallel_size: Some(2), ..mtp_args(false) }, 2, "learned absolute");
    refused(TrainArgs { mtp_loss_scaling_factor: Some(-1.0), ..mtp_args(true) }, 1, "--mtp-loss-scaling-factor");
    // Megatron takes 0 depths as none.
    assert_eq!(settings(&TrainArgs { mtp_num_layers: Some(0), ..tiny_args(true) }).mtp_num_layers, None);
}
