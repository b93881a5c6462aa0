//! --squared-relu (Megatron's; Nemotron-H's MLPs): it replaces a preset's SwiGLU, trains under
//! tensor parallelism as one rank does, round-trips through the model flags, and is refused
//! beside --swiglu on one command line.

mod common;

use common::*;
use ferrotron_trainer::settings::{Settings, TrainArgs};

#[test]
fn squared_relu_trains_as_one_rank_under_tensor_parallelism() {
    let s = settings(&TrainArgs { squared_relu: true, ..tiny_args(true) });
    assert!(s.squared_relu && !s.swiglu, "the flag replaces llama-tiny's SwiGLU");
    let c = s.model_config().unwrap();
    assert!(matches!(
        c.layer.mlp,
        ferrotron_transformer::spec::MlpSpec::Dense {
            activation: ferrotron_transformer::spec::Activation::SquaredRelu,
            ..
        }
    ));
    let back = ferrotron_trainer::settings::model_args(&c);
    assert!(back.squared_relu && !back.swiglu);
    let one = run(&s, 1);
    assert!(one.losses.last().unwrap().1 < one.losses[0].1);
    let mut tp = s.clone();
    tp.tensor_model_parallel_size = 2;
    tp.sequence_parallel = true;
    follows("tp2 with SP", &run(&tp, 2), &one);
    let e = Settings::resolve(&TrainArgs { squared_relu: true, swiglu: true, ..tiny_args(true) }).unwrap_err();
    assert!(format!("{e:#}").contains("keep one"), "{e:#}");
}
