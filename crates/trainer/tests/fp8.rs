//! --fp8-format with --fp8-recipe tensorwise (and delayed: its own test below) through the
//! trainer (the CPU's FP8 emulation: the
//! same bytes the GPU's quantization writes, ferrotron-kernels' ops tests): it learns beside the
//! bf16 run without matching it, the two formats differ, a data-parallel run with the distributed
//! optimizer and a pipeline split follow one rank within 1e-5 (the same tensors quantized),
//! activation recompute (full, and selective: the output projection's FP8 input quantized again)
//! bit for bit, tensor × sequence and context parallelism (whose ranks scale
//! their own shards and chunks) within 2e-3 (8 steps differ by about 1.6e-4), a run resumes bit
//! for bit (tensorwise scaling keeps no state), --first-last-layers-bf16 keeps its layers' bf16
//! bits, multi-latent attention's, the experts' and Mamba mixers' products run in FP8 too, and bad flags are
//! named.

mod common;

use common::*;
use ferrotron_trainer::settings::{Paths, Settings, TrainArgs};
use ferrotron_trainer::train::{Summary, train};

fn fp8(format: &str) -> TrainArgs {
    TrainArgs { bf16: true, fp8_format: Some(format.into()), fp8_recipe: Some("tensorwise".into()), ..tiny_args(true) }
}

/// Megatron's default recipe: delayed scaling.
fn delayed(format: &str) -> TrainArgs {
    TrainArgs { bf16: true, fp8_format: Some(format.into()), ..tiny_args(true) }
}

/// `s` changed by `f`.
fn with(s: &Settings, f: impl Fn(&mut Settings)) -> Settings {
    let mut t = s.clone();
    f(&mut t);
    t
}

/// Megatron's full recompute, one layer a group.
fn full_recompute(t: &mut Settings) {
    t.recompute_granularity = Some("full".into());
    t.recompute_method = Some("uniform".into());
    t.recompute_num_layers = Some(1);
}

/// `s` saved after 4 steps and resumed: both halves `one`'s bits.
fn resumes_bit_for_bit(tag: &str, s: &Settings, one: &Summary) {
    let dir = tmp(tag);
    let first = train(s, &Paths { save: Some(dir.clone()), exit_interval: Some(4), ..Paths::default() }).unwrap();
    assert_eq!(bits(&first.losses), bits(&one.losses[..4]), "{tag}");
    let rest = train(s, &Paths { load: Some(dir.clone()), ..Paths::default() }).unwrap();
    assert_eq!(bits(&rest.losses), bits(&one.losses[4..]), "{tag}: resumed");
    let _ = std::fs::remove_dir_all(&dir);
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
    assert_eq!(s.fp8().unwrap(), Some((ferrotron_kernels::Fp8Format::Hybrid, None)));
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
    // The same tensors quantized as on one rank: within fp32 sums' reordering.
    let dp = with(&s, |t| (t.use_distributed_optimizer, t.overlap_grad_reduce) = (true, true));
    within("fp8 dp2 distributed", &run(&dp, 2), &one, 1e-5);
    within("fp8 pp2", &run(&with(&s, |t| t.pipeline_model_parallel_size = 2), 2), &one, 1e-5);
    let recompute = with(&s, full_recompute);
    assert_eq!(bits(&run(&recompute, 1).losses), bits(&one.losses), "a recomputed forward quantizes alike");
    let selective = with(&s, |t| t.recompute_granularity = Some("selective".into()));
    assert_eq!(bits(&run(&selective, 1).losses), bits(&one.losses), "the projection's input recomputed");
    // Each rank scales its own weight shards and row-parallel inputs (or sequence chunks).
    let tp = with(&s, |t| (t.tensor_model_parallel_size, t.sequence_parallel) = (2, true));
    within("fp8 tp2 sp", &run(&tp, 2), &one, 2e-3);
    within("fp8 cp2", &run(&with(&s, |t| t.context_parallel_size = 2), 2), &one, 2e-3);
    // No scaling state: a resumed run continues bit for bit.
    resumes_bit_for_bit("fp8-resume", &s, &one);
}

#[test]
fn bad_fp8_flags_are_named() {
    let args = fp8("hybrid");
    refused(TrainArgs { fp8_recipe: Some("mxfp8".into()), ..args.clone() }, 1, "block-scaled FP8");
    refused(TrainArgs { fp8_amax_history_len: Some(4), ..args.clone() }, 1, "--fp8-amax-history-len sets delayed");
    refused(TrainArgs { fp8_margin: Some(1), ..args.clone() }, 1, "--fp8-margin sets delayed scaling's");
    let delayed = delayed("hybrid");
    refused(TrainArgs { fp8_amax_history_len: Some(0), ..delayed.clone() }, 1, "--fp8-amax-history-len 0");
    refused(TrainArgs { fp8_amax_compute_algo: Some("mean".into()), ..delayed.clone() }, 1, "most_recent and max");
    refused(TrainArgs { fp8_margin: Some(100), ..delayed.clone() }, 1, "within ±64");
    refused(TrainArgs { fp8_recipe: Some("rowwise".into()), ..args.clone() }, 1, "the recipes are");
    refused(TrainArgs { fp8_format: Some("e5m2".into()), ..args.clone() }, 1, "the formats are e4m3");
    refused(TrainArgs { bf16: false, ..args.clone() }, 1, "needs --bf16");
    refused(TrainArgs { num_layers_at_start_in_bf16: Some(2), ..args.clone() }, 1, "--first-last-layers-bf16 keeps");
    let no_fp8 = TrainArgs { fp8_format: None, first_last_layers_bf16: true, ..args.clone() };
    refused(no_fp8, 1, "it goes with --fp8-format");
    let experts = TrainArgs { num_experts: Some(4), moe_ffn_hidden_size: Some(40), ..args.clone() };
    refused(experts, 1, "--moe-ffn-hidden-size / --expert-tensor-parallel-size is 40");
    let mamba = TrainArgs { preset: Some("mamba-tiny".into()), ..fp8("hybrid") };
    refused(mamba, 1, "--mamba-num-heads / --tensor-model-parallel-size is 2");
    refused(mla_fp8(), 1, "--kv-lora-rank is 12");
    // Widths that cuBLASLt's FP8 products cannot take, named with the fix.
    refused(TrainArgs { hidden_size: Some(40), ..args.clone() }, 1, "--hidden-size is 40");
    let tp2 = TrainArgs { ffn_hidden_size: Some(48), tensor_model_parallel_size: Some(2), ..args.clone() };
    refused(tp2, 2, "--ffn-hidden-size / --tensor-model-parallel-size is 24");
}

/// The mixture-of-experts layer's experts and shared experts in FP8: every expert's token list
/// (any length) padded to whole 16-row tiles inside the linear layers; it learns beside its bf16
/// run without matching it, and expert parallelism (each expert's tokens from both ranks at once,
/// so scaled together) stays within 2e-3 of one rank, under tensorwise and delayed scaling. A
/// micro-batch of 24 tokens trains too.
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
    // Delayed scaling: each expert's slots (an expert with no tokens in a pass records 0,
    // and its scale stays); ep2's ranks reduce the amaxes of the experts at the same local index
    // together, as Megatron's amax reduction does.
    let d = settings(&moe(delayed("hybrid")));
    let d1 = run(&d, 1);
    assert!(d1.losses.last().unwrap().1 < d1.losses[0].1 * 0.95, "{:?}", d1.losses);
    assert_ne!(bits(&d1.losses), bits(&one.losses), "delayed, not tensorwise");
    within("moe delayed beside bf16", &d1, &bf16, 5e-3);
    let mut ep = d.clone();
    ep.moe.as_mut().unwrap().expert_model_parallel_size = 2;
    within("moe delayed ep2", &run(&ep, 2), &d1, 2e-3);
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

/// --fp8-recipe delayed (Megatron's default): each tensor quantized by a scale from its amax
/// history, amaxes reduced over the stage's ranks. It learns beside bf16 and differs from
/// tensorwise scaling and from another history; a pipeline split follows one rank within 1e-5
/// (each micro-batch's forward and backward find the same scales in either schedule); tensor ×
/// sequence and context parallelism quantize by the whole tensors' amaxes (reduced), so they
/// follow one rank closer than tensorwise scaling's ranks can; data parallelism reduces its
/// ranks' micro-batches' amaxes together (one rank's come one after another), so it stays near;
/// full and selective recompute replay the forward's scales bit for bit; and a resumed run
/// continues bit for bit from the scales and histories in the checkpoint.
#[test]
fn delayed_scaling_trains_and_layouts_follow_one_rank() {
    use ferrotron_core::{AmaxAlgo, DelayedScaling};
    let s = settings(&delayed("hybrid"));
    let want = DelayedScaling { history_len: 1, algo: AmaxAlgo::MostRecent, margin: 0 };
    assert_eq!(s.fp8().unwrap(), Some((ferrotron_kernels::Fp8Format::Hybrid, Some(want))));
    let one = run(&s, 1);
    let bf16 = run(&settings(&TrainArgs { bf16: true, ..tiny_args(true) }), 1);
    assert!(one.losses.last().unwrap().1 < one.losses[0].1 * 0.95, "{:?}", one.losses);
    assert_ne!(bits(&one.losses), bits(&bf16.losses), "the products were quantized");
    within("delayed beside bf16", &one, &bf16, 5e-3);
    let tensorwise = run(&settings(&fp8("hybrid")), 1);
    assert_ne!(bits(&tensorwise.losses), bits(&one.losses), "scales from the history, not the tensor");
    let history =
        TrainArgs { fp8_amax_history_len: Some(4), fp8_amax_compute_algo: Some("max".into()), ..delayed("hybrid") };
    let history = run(&settings(&history), 1);
    assert_ne!(bits(&history.losses), bits(&one.losses), "the history's max");
    within("history 4 max beside 1", &history, &one, 5e-3);
    within("delayed pp2", &run(&with(&s, |t| t.pipeline_model_parallel_size = 2), 2), &one, 1e-5);
    let recompute = with(&s, full_recompute);
    assert_eq!(bits(&run(&recompute, 1).losses), bits(&one.losses), "a recomputed forward replays the scales");
    let selective = with(&s, |t| t.recompute_granularity = Some("selective".into()));
    assert_eq!(bits(&run(&selective, 1).losses), bits(&one.losses), "the projection's input by its scale");
    let tp = with(&s, |t| (t.tensor_model_parallel_size, t.sequence_parallel) = (2, true));
    within("delayed tp2 sp", &run(&tp, 2), &one, 2e-4);
    within("delayed cp2", &run(&with(&s, |t| t.context_parallel_size = 2), 2), &one, 2e-4);
    let dp = with(&s, |t| (t.use_distributed_optimizer, t.overlap_grad_reduce) = (true, true));
    within("delayed dp2", &run(&dp, 2), &one, 5e-3);
    // The scales and histories come back from the checkpoint (from scale 1 the resumed
    // run's first micro-batch would quantize otherwise).
    resumes_bit_for_bit("fp8-delayed-resume", &s, &one);
}

/// Mamba-2 hybrids in FP8: each mixer's in_proj blocks (z, xBC, dt: three FP8 layers on views
/// of the one weight) and out_proj beside the attention and MLP layers' products, at widths of
/// multiples of 16 (32 heads of 2: 16 a rank under tp2). Under delayed and tensorwise scaling it learns beside its
/// bf16 run without matching it; with delayed scaling tp2 × sp follows one rank within 2e-3
/// (6e-4 seen: the ranks' bf16 sums differ by ≈ 8e-5, as the bf16 runs' do, and values near an
/// FP8 rounding boundary land on the other code) and a full recompute replays it bit for bit.
#[test]
fn mamba_hybrids_run_in_fp8() {
    let mamba = |a: TrainArgs| TrainArgs { preset: Some("mamba-tiny".into()), mamba_head_dim: Some(2), ..a };
    let s = settings(&mamba(delayed("hybrid")));
    let one = run(&s, 1);
    let bf16 = run(&settings(&mamba(TrainArgs { bf16: true, ..tiny_args(true) })), 1);
    assert!(one.losses.last().unwrap().1 < one.losses[0].1 * 0.95, "{:?}", one.losses);
    assert_ne!(bits(&one.losses), bits(&bf16.losses), "the products were quantized");
    within("mamba delayed beside bf16", &one, &bf16, 5e-3);
    let tensorwise = run(&settings(&mamba(fp8("hybrid"))), 1);
    assert_ne!(bits(&tensorwise.losses), bits(&one.losses));
    within("mamba tensorwise beside bf16", &tensorwise, &bf16, 5e-3);
    let tp = with(&s, |t| (t.tensor_model_parallel_size, t.sequence_parallel) = (2, true));
    within("mamba delayed tp2 sp", &run(&tp, 2), &one, 2e-3);
    assert_eq!(bits(&run(&with(&s, full_recompute), 1).losses), bits(&one.losses), "recomputed alike");
}
