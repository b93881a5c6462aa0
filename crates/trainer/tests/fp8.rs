//! --fp8-format with --fp8-recipe tensorwise through the trainer (the CPU's FP8 emulation: the
//! same bytes the GPU's quantization writes, ferrotron-kernels' ops tests): it learns beside the
//! bf16 run without matching it, the two formats differ, a data-parallel run with the distributed
//! optimizer and a pipeline split follow one rank within 1e-5 (the same tensors quantized),
//! activation recompute (full, and selective: the output projection's FP8 input quantized again)
//! bit for bit, tensor × sequence and context parallelism (whose ranks scale
//! their own shards and chunks) within 2e-3 (8 steps differ by about 1.6e-4), a run resumes bit
//! for bit (tensorwise scaling keeps no state), --first-last-layers-bf16 keeps its layers' bf16
//! bits, multi-latent attention's and the experts' products run in FP8 too, and bad flags are
//! named.

mod common;

use common::*;
use ferrotron_trainer::settings::{Paths, Settings, TrainArgs};
use ferrotron_trainer::train::{Summary, train};

fn fp8(format: &str) -> TrainArgs {
    TrainArgs { bf16: true, fp8_format: Some(format.into()), fp8_recipe: Some("tensorwise".into()), ..tiny_args(true) }
}

/// Every loss (training and validation) within `rtol` of `want`'s.
fn within(tag: &str, got: &Summary, want: &Summary, rtol: f64) {
    let worst = got.losses.iter().zip(&want.losses).map(|((_, a), (_, b))| ((a - b) / b).abs()).fold(0.0, f64::max);
    eprintln!("{tag}: largest relative difference {worst:.2e}");
    for (g, w) in [(&got.losses, &want.losses), (&got.evals, &want.evals)] {
        assert_eq!(g.len(), w.len(), "{tag}");
        for ((i, a), (_, b)) in g.iter().zip(w.iter()) {
            assert!((a - b).abs() <= rtol * b.abs(), "{tag} iteration {i}: {a} vs {b}");
        }
    }
}

#[test]
fn fp8_trains_beside_bf16_and_layouts_follow_one_rank() {
    let s = settings(&fp8("hybrid"));
    assert_eq!(s.fp8().unwrap(), Some(ferrotron_kernels::Fp8Format::Hybrid));
    let one = run(&s, 1);
    let bf16 = run(&settings(&TrainArgs { bf16: true, ..tiny_args(true) }), 1);
    assert!(one.losses.last().unwrap().1 < one.losses[0].1 * 0.95, "{:?}", one.losses);
    assert_ne!(bits(&one.losses), bits(&bf16.losses), "the products were quantized");
    within("fp8 beside bf16", &one, &bf16, 5e-3);
    let e4m3 = run(&settings(&fp8("e4m3")), 1);
    assert_ne!(bits(&e4m3.losses), bits(&one.losses), "gradients in E4M3, not E5M2");
    within("e4m3 beside hybrid", &e4m3, &one, 5e-3);
    // --first-last-layers-bf16 on two layers: both in bf16, the bf16 run's bits; the first alone
    // in bf16: neither run.
    let ends = settings(&TrainArgs { first_last_layers_bf16: true, ..fp8("hybrid") });
    assert_eq!(ends.fp8_bf16_ends, [1, 1]);
    assert_eq!(bits(&run(&ends, 1).losses), bits(&bf16.losses), "every layer kept in bf16");
    let first = TrainArgs { first_last_layers_bf16: true, num_layers_at_end_in_bf16: Some(0), ..fp8("hybrid") };
    let first = run(&settings(&first), 1);
    assert_ne!(bits(&first.losses), bits(&bf16.losses), "the last layer in FP8");
    assert_ne!(bits(&first.losses), bits(&one.losses), "the first layer in bf16");
    let with = |f: &dyn Fn(&mut Settings)| {
        let mut t = s.clone();
        f(&mut t);
        t
    };
    // The same tensors quantized as on one rank: within fp32 sums' reordering.
    let dp = with(&|t| (t.use_distributed_optimizer, t.overlap_grad_reduce) = (true, true));
    within("fp8 dp2 distributed", &run(&dp, 2), &one, 1e-5);
    let pp = with(&|t| t.pipeline_model_parallel_size = 2);
    within("fp8 pp2", &run(&pp, 2), &one, 1e-5);
    let recompute = with(&|t| {
        t.recompute_granularity = Some("full".into());
        t.recompute_method = Some("uniform".into());
        t.recompute_num_layers = Some(1);
    });
    assert_eq!(bits(&run(&recompute, 1).losses), bits(&one.losses), "a recomputed forward quantizes alike");
    let selective = with(&|t| t.recompute_granularity = Some("selective".into()));
    assert_eq!(bits(&run(&selective, 1).losses), bits(&one.losses), "the projection's input recomputed");
    // Each rank scales its own weight shards and row-parallel inputs (or sequence chunks).
    let tp = with(&|t| (t.tensor_model_parallel_size, t.sequence_parallel) = (2, true));
    within("fp8 tp2 sp", &run(&tp, 2), &one, 2e-3);
    let cp = with(&|t| t.context_parallel_size = 2);
    within("fp8 cp2", &run(&cp, 2), &one, 2e-3);
    // No scaling state: a resumed run continues bit for bit.
    let dir = tmp("fp8-resume");
    let first = train(&s, &Paths { save: Some(dir.clone()), exit_interval: Some(4), ..Paths::default() }).unwrap();
    assert_eq!(bits(&first.losses), bits(&one.losses[..4]));
    let rest = train(&s, &Paths { load: Some(dir.clone()), ..Paths::default() }).unwrap();
    assert_eq!(bits(&rest.losses), bits(&one.losses[4..]));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_fp8_flags_are_named() {
    let args = fp8("hybrid");
    refused(TrainArgs { fp8_recipe: None, ..args.clone() }, 1, "pass --fp8-recipe tensorwise");
    refused(TrainArgs { fp8_recipe: Some("delayed".into()), ..args.clone() }, 1, "amax history");
    refused(TrainArgs { fp8_recipe: Some("mxfp8".into()), ..args.clone() }, 1, "block-scaled FP8");
    refused(TrainArgs { fp8_recipe: Some("rowwise".into()), ..args.clone() }, 1, "the recipes are");
    refused(TrainArgs { fp8_format: Some("e5m2".into()), ..args.clone() }, 1, "the formats are e4m3");
    refused(TrainArgs { bf16: false, ..args.clone() }, 1, "needs --bf16");
    refused(TrainArgs { num_layers_at_start_in_bf16: Some(2), ..args.clone() }, 1, "--first-last-layers-bf16 keeps");
    let no_fp8 = TrainArgs { fp8_format: None, first_last_layers_bf16: true, ..args.clone() };
    refused(no_fp8, 1, "it goes with --fp8-format");
    let experts = TrainArgs { num_experts: Some(4), moe_ffn_hidden_size: Some(40), ..args.clone() };
    refused(experts, 1, "--moe-ffn-hidden-size / --expert-tensor-parallel-size is 40");
    let mamba = TrainArgs { preset: Some("mamba-tiny".into()), ..fp8("hybrid") };
    refused(mamba, 1, "Mamba hybrids (--hybrid-layer-pattern) have no FP8 products yet");
    refused(mla_fp8(), 1, "--kv-lora-rank is 12");
    // Widths that cuBLASLt's FP8 products cannot take, named with the fix.
    refused(TrainArgs { hidden_size: Some(40), ..args.clone() }, 1, "--hidden-size is 40");
    let tp2 = TrainArgs { ffn_hidden_size: Some(48), tensor_model_parallel_size: Some(2), ..args.clone() };
    refused(tp2, 2, "--ffn-hidden-size / --tensor-model-parallel-size is 24");
}

/// The mixture-of-experts layer's experts and shared experts in FP8: every expert's token list
/// (any length) padded to whole 16-row tiles inside the linear layers; it learns beside its bf16
/// run without matching it, and expert parallelism (each expert's tokens from both ranks at once,
/// so scaled together) stays within 2e-3 of one rank. A micro-batch of 24 tokens trains too.
#[test]
fn experts_run_in_fp8() {
    let moe = |a: TrainArgs| TrainArgs {
        num_experts: Some(4),
        moe_router_topk: Some(2),
        moe_shared_expert_intermediate_size: Some(32),
        ..a
    };
    let s = settings(&moe(fp8("hybrid")));
    let one = run(&s, 1);
    let bf16 = run(&settings(&moe(TrainArgs { bf16: true, ..tiny_args(true) })), 1);
    assert!(one.losses.last().unwrap().1 < one.losses[0].1 * 0.95, "{:?}", one.losses);
    assert_ne!(bits(&one.losses), bits(&bf16.losses), "the experts' products were quantized");
    within("moe fp8 beside bf16", &one, &bf16, 5e-3);
    let mut ep = s.clone();
    ep.moe.as_mut().unwrap().expert_model_parallel_size = 2;
    within("moe fp8 ep2", &run(&ep, 2), &one, 2e-3);
    let short = TrainArgs {
        micro_batch_size: Some(1),
        global_batch_size: Some(2),
        seq_length: Some(24),
        max_position_embeddings: Some(24),
        ..fp8("hybrid")
    };
    let short = run(&settings(&short), 1);
    assert!(short.losses.iter().all(|(_, l)| l.is_finite()), "{:?}", short.losses);
}

fn mla_fp8() -> TrainArgs {
    TrainArgs { bf16: true, fp8_format: Some("hybrid".into()), fp8_recipe: Some("tensorwise".into()), ..mla_args() }
}

/// Multi-latent attention's five products (the query's and the keys' and values' down- and
/// up-projections, the output projection) in FP8, at widths of multiples of 16: it learns beside
/// its bf16 run without matching it, and tp2 × sp follows one rank.
#[test]
fn multi_latent_attention_runs_in_fp8() {
    let wide =
        |a: TrainArgs| TrainArgs { kv_lora_rank: Some(16), qk_pos_emb_head_dim: Some(16), v_head_dim: Some(8), ..a };
    let s = settings(&wide(mla_fp8()));
    let one = run(&s, 1);
    let bf16 = run(&settings(&wide(TrainArgs { fp8_format: None, fp8_recipe: None, ..mla_fp8() })), 1);
    assert!(one.losses.last().unwrap().1 < one.losses[0].1 * 0.95, "{:?}", one.losses);
    assert_ne!(bits(&one.losses), bits(&bf16.losses), "the products were quantized");
    within("mla fp8 beside bf16", &one, &bf16, 5e-3);
    let mut tp = s.clone();
    (tp.tensor_model_parallel_size, tp.sequence_parallel) = (2, true);
    within("mla fp8 tp2 sp", &run(&tp, 2), &one, 2e-3);
}
