//! --embedding-init-method-std: the word and learned position embeddings start at their own std
//! (Megatron's), the other weights and an untied output layer at --init-method-std; a tied
//! embedding's last-stage copy starts as the first stage's table, so two pipeline stages train as
//! one rank does.

mod common;

use common::*;
use ferrotron_core::{DType, Device};
use ferrotron_trainer::settings::TrainArgs;
use ferrotron_transformer::GptModel;

/// The root mean square of a parameter's initial values (the inits have mean 0).
fn rms(v: &[f32]) -> f64 {
    (v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>() / v.len() as f64).sqrt()
}

#[test]
fn embeddings_start_at_their_own_std() {
    for llama in [false, true] {
        let args = TrainArgs { embedding_init_method_std: Some(0.5), init_method_std: Some(0.02), ..tiny_args(llama) };
        let s = settings(&args);
        let (_, table) = GptModel::build(s.model_config().unwrap(), &Device::Cpu, DType::F32, 1).unwrap();
        let mut seen = 0;
        for id in table.ids() {
            let (name, v) = (&table.meta(id).name, table.param(id).unwrap().to_vec_f32().unwrap());
            let want = match name.as_str() {
                "embedding.word_embeddings.weight" | "embedding.position_embeddings.weight" => 0.5,
                n if n.ends_with("linear_qkv.weight") || n == "output_layer.weight" => 0.02,
                _ => continue,
            };
            let got = rms(&v);
            assert!((got - want).abs() < 0.15 * want, "llama {llama} {name}: rms {got} for std {want}");
            seen += 1;
        }
        // Word embeddings and two QKV projections; learned positions (GPT) or the output layer (Llama).
        assert_eq!(seen, 4, "llama {llama}");
    }
}

#[test]
fn a_tied_embedding_at_its_own_std_trains_on_two_stages_as_one_rank() {
    let s = settings(&TrainArgs { embedding_init_method_std: Some(0.2), ..tiny_args(false) });
    let one = run(&s, 1);
    let plain = run(&settings(&tiny_args(false)), 1);
    assert_ne!(bits(&one.losses), bits(&plain.losses), "the embeddings' std changes the run");
    let mut pp = s.clone();
    pp.pipeline_model_parallel_size = 2;
    follows("pp2", &run(&pp, 2), &one);
}
