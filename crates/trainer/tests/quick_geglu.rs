//! --quick-geglu with --glu-linear-offset and --activation-func-clamp-value: gpt-oss's gated
//! quick GeLU in the MLPs and experts. It changes the run (and each of its extras does), trains
//! under tensor (with sequence) parallelism as one rank does (the gate and linear blocks split
//! apart, as SwiGLU's), round-trips through the model flags, and the flags that mean nothing
//! without it are refused. The kernel against its formula and finite differences: the kernels
//! crate's ops tests; the layer against megatron-core: tests/megatron_convert.rs's gptoss_dist.

mod common;

use common::*;
use ferrotron_trainer::settings::{Paths, Settings, TrainArgs, model_args};
use ferrotron_transformer::spec::{Activation, GluParams, MlpSpec};

fn geglu(offset: Option<f64>, clamp: Option<f64>, a: TrainArgs) -> TrainArgs {
    TrainArgs { swiglu: false, quick_geglu: true, glu_linear_offset: offset, activation_func_clamp_value: clamp, ..a }
}

#[test]
fn the_gated_quick_gelu_trains_as_one_rank_under_tp() {
    let s = settings(&geglu(Some(1.0), Some(0.05), tiny_args(true)));
    let c = s.model_config().unwrap();
    let MlpSpec::Dense { activation, .. } = c.layer.mlp else { panic!("dense") };
    assert_eq!(activation, Activation::QuickGeGlu(GluParams { offset: 1.0, clamp: Some(0.05) }));
    let m = model_args(&c);
    assert_eq!((m.quick_geglu, m.glu_linear_offset, m.activation_func_clamp_value), (true, Some(1.0), Some(0.05)));
    assert!(!m.swiglu);
    let one = run(&s, 1);
    // Each part moves the run: the activation, the offset, the clamp (0.05 holds most inputs).
    for other in [tiny_args(true), geglu(None, Some(0.05), tiny_args(true)), geglu(Some(1.0), None, tiny_args(true))] {
        assert_ne!(bits(&run(&settings(&other), 1).losses), bits(&one.losses));
    }
    let mut tp = s.clone();
    tp.tensor_model_parallel_size = 2;
    tp.sequence_parallel = true;
    follows("tp2 with SP", &run(&tp, 2), &one);
    let e = ferrotron_models::hf::HfArch::of(&c).unwrap_err().to_string();
    assert!(e.contains("SwiGlu") || e.contains("QuickGeGlu"), "{e}");
}

#[test]
fn experts_take_the_gated_quick_gelu_and_train_as_one_rank_under_ep() {
    let a = TrainArgs {
        num_experts: Some(4),
        moe_ffn_hidden_size: Some(24),
        moe_router_topk: Some(2),
        ..geglu(Some(1.0), Some(0.5), tiny_args(true))
    };
    let s = settings(&a);
    let m = ferrotron_models::moe_spec(&s.model_config().unwrap()).cloned().unwrap();
    assert_eq!(m.activation, Activation::QuickGeGlu(GluParams { offset: 1.0, clamp: Some(0.5) }));
    let one = run(&s, 1);
    let swiglu =
        TrainArgs { swiglu: true, quick_geglu: false, glu_linear_offset: None, activation_func_clamp_value: None, ..a };
    assert_ne!(bits(&run(&settings(&swiglu), 1).losses), bits(&one.losses));
    let mut ep = s.clone();
    ep.moe.as_mut().unwrap().expert_model_parallel_size = 2;
    follows("ep2", &run(&ep, 2), &one);
}

#[test]
fn glu_extras_without_the_gated_quick_gelu_are_refused() {
    for (a, needle) in [
        (TrainArgs { glu_linear_offset: Some(1.0), ..tiny_args(true) }, "--glu-linear-offset"),
        (TrainArgs { activation_func_clamp_value: Some(7.0), ..tiny_args(false) }, "--activation-func-clamp-value"),
        (geglu(None, Some(-1.0), tiny_args(true)), "positive bound"),
        (TrainArgs { squared_relu: true, ..geglu(None, None, tiny_args(true)) }, "keep one"),
    ] {
        let e = format!("{:#}", Settings::resolve(&a).unwrap_err());
        assert!(e.contains(needle), "{needle}: {e}");
    }
}

/// A checkpoint resumes only under its gated unit: SwiGLU's fc1 has the same shape, and the
/// offset and clamp leave no trace in the weights.
#[test]
fn a_checkpoint_resumes_only_under_its_gated_unit() {
    let dir = tmp("quick-geglu-resume");
    let a = geglu(Some(1.0), Some(7.0), tiny_args(true));
    ferrotron_trainer::train::train(&settings(&a), &Paths { save: Some(dir.clone()), ..Paths::default() }).unwrap();
    let more = |a: TrainArgs| settings(&TrainArgs { train_iters: Some(10), ..a });
    let load = || Paths { load: Some(dir.clone()), ..Paths::default() };
    for other in [tiny_args(true), geglu(None, Some(7.0), tiny_args(true)), geglu(Some(1.0), None, tiny_args(true))] {
        let e = ferrotron_trainer::train::train(&more(other), &load()).unwrap_err();
        assert!(format!("{e:#}").contains("trained with --quick-geglu with --glu-linear-offset 1"), "{e:#}");
    }
    let resumed = ferrotron_trainer::train::train(&more(a), &load()).unwrap();
    assert_eq!(resumed.losses.iter().map(|l| l.0).collect::<Vec<_>>(), [9, 10]);
    let _ = std::fs::remove_dir_all(dir);
}
