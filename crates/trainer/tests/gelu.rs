//! Megatron's GeLU: the tanh approximation through its fused bias-GeLU (biases on, the default),
//! erf without the fusion (--no-bias-gelu-fusion, or no biases: --disable-bias-linear), tanh
//! always under --openai-gelu. Each pick builds that activation, the erf one changes the run,
//! model flags keep it across --use-checkpoint-args, a checkpoint resumes only under its form,
//! and tensor parallelism follows one rank.

mod common;

use common::*;
use ferrotron_trainer::settings::{Paths, TrainArgs, model_args};
use ferrotron_trainer::train::train;
use ferrotron_transformer::spec::{Activation, MlpSpec};

fn activation(a: &TrainArgs) -> Activation {
    match settings(a).model_config().unwrap().layer.mlp {
        MlpSpec::Dense { activation, .. } => activation,
        _ => panic!("not a dense MLP"),
    }
}

#[test]
fn megatrons_gelu_is_tanh_when_fused_and_erf_otherwise() {
    let base = tiny_args(false);
    let unfused = TrainArgs { no_bias_gelu_fusion: true, ..base.clone() };
    let no_bias = TrainArgs { disable_bias_linear: true, ..base.clone() };
    let openai = |a: &TrainArgs| TrainArgs { openai_gelu: true, ..a.clone() };
    assert_eq!(activation(&base), Activation::Gelu);
    assert_eq!(activation(&unfused), Activation::GeluExact);
    assert_eq!(activation(&no_bias), Activation::GeluExact);
    assert_eq!(activation(&openai(&unfused)), Activation::Gelu);
    assert_eq!(activation(&openai(&no_bias)), Activation::Gelu);
    // The model flags give back the same activation (what --use-checkpoint-args reads).
    for a in [&base, &unfused, &no_bias, &openai(&no_bias)] {
        let back = model_args(&settings(a).model_config().unwrap());
        let mut again = base.clone();
        (again.no_bias_gelu_fusion, again.openai_gelu, again.disable_bias_linear) =
            (back.no_bias_gelu_fusion, back.openai_gelu, back.disable_bias_linear);
        assert_eq!(activation(&again), activation(a), "{a:?}");
    }
    let dir = tmp("gelu-erf");
    let paths = |load: bool| Paths {
        save: Some(dir.clone()).filter(|_| !load),
        load: Some(dir.clone()).filter(|_| load),
        ..Paths::default()
    };
    let (tanh, erf) = (run(&settings(&base), 1), train(&settings(&unfused), &paths(false)).unwrap());
    assert_ne!(bits(&tanh.losses), bits(&erf.losses), "erf and tanh GeLU ran the same");
    // Resumed as tanh (the fused default) the MLPs would compute another function: refused.
    let more = |a: &TrainArgs| settings(&TrainArgs { train_iters: Some(10), ..a.clone() });
    let e = train(&more(&base), &paths(true)).unwrap_err();
    assert!(format!("{e:#}").contains("GeLU as erf and this run's is the tanh approximation"), "{e:#}");
    assert_eq!(train(&more(&unfused), &paths(true)).unwrap().losses.last().map(|l| l.0), Some(10));
    let _ = std::fs::remove_dir_all(&dir);
    let mut tp = settings(&unfused);
    tp.tensor_model_parallel_size = 2;
    follows("erf GeLU tp2", &run(&tp, 2), &erf);
}
