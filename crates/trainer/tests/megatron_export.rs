//! `ferrotron convert --saver megatron` (a Ferrotron checkpoint into Megatron-LM's torch_dist).
//! Held to megatron-core's own saves: each fixture of tests/fixtures/megatron is imported and
//! exported again, and the export must hold the same tensors (names, global shapes) and
//! sharded objects as megatron-core's original, and import back to the very same parameters.
//! That megatron-core loads the exports (strictly) and computes the fixtures' logits from them
//! is check_megatron_export.py's job, run where PyTorch is (see benches/NOTES.md).

mod common;

use common::{settings, tiny_args, tmp};
use ferrotron_checkpoint::megatron::{MegatronCheckpoint, Py};
use ferrotron_trainer::checkpoint;
use ferrotron_trainer::convert::{ConvertArgs, convert};
use ferrotron_trainer::settings::{Paths, TrainArgs};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/megatron").join(name)
}

fn model_keys(ck: &MegatronCheckpoint) -> BTreeMap<String, Vec<usize>> {
    let model = |k: &String| ["embedding.", "decoder.", "output_layer.", "mtp."].iter().any(|p| k.starts_with(p));
    ck.shapes().into_iter().filter(|(k, _)| model(k)).collect()
}

/// Every tensor of two Ferrotron checkpoints, bit for bit.
fn same_tensors(a: &Path, b: &Path) {
    let (a, b) = (checkpoint::load(a).unwrap(), checkpoint::load(b).unwrap());
    let names = |l: &checkpoint::Loaded| {
        let mut n: Vec<String> = l.tensors.keys().cloned().collect();
        n.sort();
        n
    };
    assert_eq!(names(&a), names(&b));
    for (k, (shape, v)) in &a.tensors {
        let (shape_b, w) = &b.tensors[k];
        assert_eq!(shape, shape_b, "{k}");
        assert!(v.iter().zip(w).all(|(x, y)| x.to_bits() == y.to_bits()), "{k} differs");
    }
}

#[test]
fn exports_hold_megatron_cores_tensors_and_import_back_exactly() {
    let fixtures = [
        "llama_dist",
        "mixtral_dist",
        "deepseek_dist",
        "gpt_legacy",
        "mla_dist",
        "mla_yarn_dist",
        "mtp_dist",
        "window_dist",
        "window_skip_dist",
        "gptoss_dist",
    ];
    for name in fixtures {
        let (imported, exported, again) =
            (tmp(&format!("mx-{name}-in")), tmp(&format!("mx-{name}-out")), tmp(&format!("mx-{name}-again")));
        convert(&ConvertArgs::new("megatron", "ferrotron", &fixture(name), &imported)).unwrap();
        // Transformer Engine's names (the default, as Megatron-LM's --transformer-impl).
        let te = tmp(&format!("mx-{name}-te"));
        let done = convert(&ConvertArgs::new("ferrotron", "megatron", &imported, &te)).unwrap();
        assert!(done.what.contains("torch_dist"), "{}", done.what);
        // megatron-core's local spec's names, which the fixtures were saved under.
        let mut a = ConvertArgs::new("ferrotron", "megatron", &imported, &exported);
        a.saver_transformer_impl = Some("local".into());
        convert(&a).unwrap();
        let ours = MegatronCheckpoint::open(&exported).unwrap();
        assert_eq!(ours.format, "torch_dist");
        let te_keys = model_keys(&MegatronCheckpoint::open(&te).unwrap());
        if name != "gpt_legacy" {
            // megatron-core's own save of the same model: the same tensors and objects.
            let theirs = MegatronCheckpoint::open(&fixture(name)).unwrap();
            assert_eq!(model_keys(&ours), model_keys(&theirs), "{name}");
            assert_eq!(ours.objects(), theirs.objects(), "{name}: the _extra_state objects");
            // Under Transformer Engine an MoE layer's pre-MLP norm stands apart; multi-latent
            // attention's latent norms and dense pre-MLP norm are fused; else alike.
            let mut want = model_keys(&theirs);
            let renames: &[(&str, &str)] = match name {
                "mixtral_dist" | "deepseek_dist" | "mtp_dist" | "gptoss_dist" => {
                    &[("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight")]
                }
                "mla_dist" | "mla_yarn_dist" => &[
                    ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
                    ("self_attention.q_layernorm.weight", "self_attention.linear_q_up_proj.layer_norm_weight"),
                    ("self_attention.kv_layernorm.weight", "self_attention.linear_kv_up_proj.layer_norm_weight"),
                ],
                _ => &[],
            };
            for (from, to) in renames {
                let norm = want.remove(&format!("decoder.layers.{from}")).unwrap();
                want.insert(format!("decoder.layers.{to}"), norm);
            }
            // The prediction depth's layer (with experts, as the decoder's) likewise.
            if name == "mtp_dist" {
                let layer = "mtp.layers.0.transformer_layer";
                let norm = want.remove(&format!("{layer}.mlp.linear_fc1.layer_norm_weight")).unwrap();
                want.insert(format!("{layer}.pre_mlp_layernorm.weight"), norm);
            }
            assert_eq!(te_keys, want, "{name}: Transformer Engine's names");
        } else {
            assert_eq!(te_keys, model_keys(&ours), "a dense model's names are alike");
            // Tied embeddings: no output layer; biases and learned positions.
            let keys = model_keys(&ours);
            assert!(!keys.contains_key("output_layer.weight"));
            assert_eq!(keys["embedding.position_embeddings.weight"], vec![16, 64]);
            assert_eq!(keys["decoder.layers.self_attention.linear_qkv.layer_norm_bias"], vec![2, 64]);
            assert_eq!(keys["decoder.layers.mlp.linear_fc1.bias"], vec![2, 256]);
        }
        // The run's arguments under Megatron's names, with what it derives.
        let a = &ours.args;
        assert_eq!(a.class(), Some(("argparse", "Namespace")));
        for (k, v) in [
            ("num_layers", Py::Int(2)),
            ("hidden_size", Py::Int(64)),
            ("padded_vocab_size", Py::Int(128)),
            ("no_save_optim", Py::Bool(true)),
            ("no_save_rng", Py::Bool(true)),
            ("add_bias_linear", Py::Bool(name == "gpt_legacy")),
            ("swiglu", Py::Bool(!["gpt_legacy", "gptoss_dist"].contains(&name))),
            ("params_dtype", Py::Global("torch".into(), "float32".into())),
            ("tokenizer_type", Py::Str("NullTokenizer".into())),
        ] {
            assert_eq!(a.get(k), Some(&v), "{name}: {k}");
        }
        let windowed = name.starts_with("window") || name == "gptoss_dist";
        let window = windowed.then(|| Py::Tuple(vec![Py::Int(3), Py::Int(0)]));
        assert_eq!(a.get("window_size").cloned(), window, "{name}: Megatron's (left, right)");
        // The layers it applies in, as the list Megatron evaluates its flag to.
        let skip = ["window_skip_dist", "gptoss_dist"].contains(&name).then(|| Py::List(vec![Py::Int(1), Py::Int(0)]));
        assert_eq!(a.get("window_attn_skip_freq").cloned(), skip, "{name}");
        // gpt-oss's activation and sinks under Megatron's names.
        if name == "gptoss_dist" {
            for (k, v) in [
                ("quick_geglu", Py::Bool(true)),
                ("glu_linear_offset", Py::Float(1.0)),
                ("activation_func_clamp_value", Py::Float(2.0)),
                ("softmax_type", Py::Str("learnable".into())),
            ] {
                assert_eq!(a.get(k), Some(&v), "{name}: {k}");
            }
        }
        // Back in: the same parameters (and expert biases), bit for bit.
        convert(&ConvertArgs::new("megatron", "ferrotron", &exported, &again)).unwrap();
        same_tensors(&imported, &again);
        let _ = std::fs::remove_dir_all(&again);
        convert(&ConvertArgs::new("megatron", "ferrotron", &te, &again)).unwrap();
        same_tensors(&imported, &again);
        for d in [imported, exported, again, te] {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

/// A run trained here in bf16 with experts in its second layer only: megatron-core keys such
/// layers apart (`decoder.layers.1.…`, experts stacked alone); the vocabulary is padded for the
/// target tensor-parallel size with zero rows; the values are the parameters in bf16.
#[test]
fn a_bf16_run_with_layers_that_differ_exports_per_layer() {
    let (run_dir, exported, again) = (tmp("mx-run"), tmp("mx-run-out"), tmp("mx-run-again"));
    let s = settings(&TrainArgs {
        bf16: true,
        num_experts: Some(4),
        moe_ffn_hidden_size: Some(24),
        moe_router_topk: Some(2),
        moe_layer_freq: Some("[0,1]".into()),
        train_iters: Some(2),
        global_batch_size: Some(4),
        micro_batch_size: Some(2),
        save_interval: Some(2),
        ..tiny_args(true)
    });
    ferrotron_trainer::train::train(&s, &Paths { save: Some(run_dir.clone()), ..Paths::default() }).unwrap();
    let mut a = ConvertArgs::new("ferrotron", "megatron", &run_dir, &exported);
    a.target_tensor_parallel_size = Some(2);
    convert(&a).unwrap();
    let mut ours = MegatronCheckpoint::open(&exported).unwrap();
    let keys = model_keys(&ours);
    let vocab = checkpoint::read_state(&run_dir).unwrap().vocab_size;
    let padded = vocab.div_ceil(256) * 256;
    assert_eq!(keys["embedding.word_embeddings.weight"], vec![padded, 32]);
    assert_eq!(keys["decoder.layers.0.mlp.linear_fc1.weight"], vec![128, 32], "layer 0: dense, SwiGLU");
    assert_eq!(keys["decoder.layers.1.mlp.experts.experts.linear_fc1.weight"], vec![4, 48, 32]);
    assert_eq!(keys["decoder.layers.1.mlp.router.weight"], vec![4, 32]);
    // Transformer Engine's names (the default): the MoE layer's pre-MLP norm apart, the dense
    // layer's fused into its fc1.
    assert_eq!(keys["decoder.layers.1.pre_mlp_layernorm.weight"], vec![32]);
    assert_eq!(keys["decoder.layers.0.mlp.linear_fc1.layer_norm_weight"], vec![32]);
    assert!(!keys.keys().any(|k| k.starts_with("decoder.layers.mlp")), "no stacks: {keys:?}");
    assert!(ours.objects().contains(&"decoder.layers.1.mlp.experts.experts.linear_fc2._extra_state/shard_3_4".into()));
    assert!(ours.objects().contains(&"decoder.layers.0.self_attention.linear_qkv._extra_state/shard_0_1".into()));
    assert_eq!(ours.args.get("params_dtype"), Some(&Py::Global("torch".into(), "bfloat16".into())));
    assert_eq!(ours.args.get("moe_layer_freq"), Some(&Py::List(vec![Py::Int(0), Py::Int(1)])));
    assert_eq!(ours.args.get("tensor_model_parallel_size"), Some(&Py::Int(2)));
    // The padding rows are zero, the others the run's bf16 parameters.
    let (shape, rows) = ours.read("embedding.word_embeddings.weight", &[], None).unwrap();
    assert!(rows[vocab * shape[1]..].iter().all(|&x| x == 0.0));
    let trained = checkpoint::load(&run_dir).unwrap();
    let (_, want) = &trained.tensors["embedding.word_embeddings.weight"];
    let bf16 = |x: f32| half::bf16::from_f32(x).to_f32();
    assert!(want.iter().zip(&rows).all(|(w, g)| bf16(*w).to_bits() == g.to_bits()));
    // Back in: every tensor as the export wrote it.
    convert(&ConvertArgs::new("megatron", "ferrotron", &exported, &again)).unwrap();
    let back = checkpoint::load(&again).unwrap();
    for (k, (_, v)) in &back.tensors {
        let (_, w) = &trained.tensors[k];
        assert!(v.iter().zip(w).all(|(x, y)| x.to_bits() == bf16(*y).to_bits()), "{k}");
    }
    for d in [run_dir, exported, again] {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[test]
fn exports_that_cannot_be_written_are_refused_and_nothing_is_lost() {
    let (imported, exported) = (tmp("mx-refuse-in"), tmp("mx-refuse-out"));
    convert(&ConvertArgs::new("megatron", "ferrotron", &fixture("llama_dist"), &imported)).unwrap();
    let fails = |a: &ConvertArgs, needle: &str| {
        let e = format!("{:#}", convert(a).unwrap_err());
        assert!(e.contains(needle), "{needle}: {e}");
    };
    // A tensor-parallel size the heads do not divide by: refused before anything is written.
    let mut a = ConvertArgs::new("ferrotron", "megatron", &imported, &exported);
    a.target_tensor_parallel_size = Some(3);
    fails(&a, "--target-tensor-parallel-size");
    assert!(!exported.exists(), "nothing written");
    a.target_tensor_parallel_size = None;
    // A folder that holds a Megatron checkpoint already keeps it.
    convert(&a).unwrap();
    let before = std::fs::read(exported.join("iter_0000000/.metadata")).unwrap();
    fails(&a, "holds a Megatron checkpoint already");
    assert_eq!(std::fs::read(exported.join("iter_0000000/.metadata")).unwrap(), before);
    let mut b = ConvertArgs::new("ferrotron", "megatron", &imported, &tmp("mx-refuse-impl"));
    b.saver_transformer_impl = Some("te".into());
    fails(&b, "transformer_engine (Megatron-LM's default) or local");
    // The Megatron export's own flags mean nothing to a Hugging Face one.
    let mut h = ConvertArgs::new("ferrotron", "hf", &imported, &tmp("mx-refuse-hf"));
    h.saver_transformer_impl = Some("local".into());
    fails(&h, "describe a Megatron export");
    for (saver, needle) in [("legacy", "write torch_dist"), ("nemo", "ferrotron → megatron")] {
        fails(&ConvertArgs::new("ferrotron", saver, &imported, &tmp("mx-refuse-other")), needle);
    }
    let mut t = ConvertArgs::new("ferrotron", "megatron", &imported, &tmp("mx-refuse-tok"));
    t.tokenizer_type = Some("NullTokenizer".into());
    fails(&t, "describe an import");
    for d in [imported, exported] {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// A Mamba hybrid (hybrid_dist: Mamba, attention, Mamba, MLP and expert layers): megatron-core's
/// MambaModel saves each layer under its number, the mixers' in_proj and convolution in parts,
/// every norm under Transformer Engine's names (its one spec; the local names are refused).
#[test]
fn a_mamba_hybrid_exports_as_megatron_cores_mamba_model_saves() {
    let (imported, exported, again) = (tmp("mx-hybrid-in"), tmp("mx-hybrid-out"), tmp("mx-hybrid-again"));
    convert(&ConvertArgs::new("megatron", "ferrotron", &fixture("hybrid_dist"), &imported)).unwrap();
    convert(&ConvertArgs::new("ferrotron", "megatron", &imported, &exported)).unwrap();
    let (ours, theirs) =
        (MegatronCheckpoint::open(&exported).unwrap(), MegatronCheckpoint::open(&fixture("hybrid_dist")).unwrap());
    let keys = model_keys(&ours);
    assert_eq!(keys, model_keys(&theirs));
    assert_eq!(ours.objects(), theirs.objects(), "the _extra_state objects (the output layer's too)");
    assert_eq!(keys["decoder.layers.0.mixer.in_proj.weight.z"], vec![128, 64]);
    assert_eq!(keys["decoder.layers.2.mixer.in_proj.weight.dt"], vec![4, 64]);
    assert_eq!(keys["decoder.layers.0.mixer.conv1d.weight.B"], vec![32, 1, 4]);
    assert_eq!(keys["decoder.layers.0.mixer.in_proj.layer_norm_weight"], vec![64]);
    assert_eq!(keys["decoder.layers.4.pre_mlp_layernorm.weight"], vec![64], "the expert layer's norm apart");
    let a = &ours.args;
    for (k, v) in [
        ("num_layers", Py::Int(5)),
        ("hybrid_override_pattern", Py::Str("M*M-E".into())),
        ("is_hybrid_model", Py::Bool(true)),
        ("mamba_state_dim", Py::Int(16)),
        ("mamba_head_dim", Py::Int(32)),
        ("mamba_num_groups", Py::Int(2)),
        ("position_embedding_type", Py::Str("none".into())),
        ("transformer_impl", Py::Str("transformer_engine".into())),
    ] {
        assert_eq!(a.get(k), Some(&v), "{k}");
    }
    let spec = ["megatron.core.models.mamba.mamba_layer_specs", "mamba_stack_spec"];
    assert_eq!(a.get("spec"), Some(&Py::List(spec.iter().map(|s| Py::Str(s.to_string())).collect())));
    // Back in, bit for bit; and the same model from its two tensor-parallel ranks' legacy files.
    convert(&ConvertArgs::new("megatron", "ferrotron", &exported, &again)).unwrap();
    same_tensors(&imported, &again);
    let _ = std::fs::remove_dir_all(&again);
    convert(&ConvertArgs::new("megatron", "ferrotron", &fixture("hybrid_tp2"), &again)).unwrap();
    same_tensors(&imported, &again);
    // Megatron-LM has no local-spec hybrid: refused, nothing written.
    let local = tmp("mx-hybrid-local");
    let mut l = ConvertArgs::new("ferrotron", "megatron", &imported, &local);
    l.saver_transformer_impl = Some("local".into());
    let e = format!("{:#}", convert(&l).unwrap_err());
    assert!(e.contains("mamba_stack_spec") && e.contains("drop the flag"), "{e}");
    assert!(!local.exists());
    for d in [imported, exported, again] {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// A hybrid whose gated norm spans every group (transformers' Mamba2, `--mamba-norm-ungrouped`)
/// has no Megatron form: refused by name, nothing written.
#[test]
fn a_hybrid_with_ungrouped_norms_is_refused() {
    let (run_dir, exported) = (tmp("mx-ungrouped"), tmp("mx-ungrouped-out"));
    let s = settings(&TrainArgs {
        preset: Some("mamba-tiny".into()),
        mamba_norm_ungrouped: true,
        train_iters: Some(1),
        global_batch_size: Some(2),
        micro_batch_size: Some(2),
        seq_length: Some(16),
        save_interval: Some(1),
        eval_iters: Some(0),
        mock_data: true,
        ..TrainArgs::default()
    });
    ferrotron_trainer::train::train(&s, &Paths { save: Some(run_dir.clone()), ..Paths::default() }).unwrap();
    let e = format!("{:#}", convert(&ConvertArgs::new("ferrotron", "megatron", &run_dir, &exported)).unwrap_err());
    assert!(e.contains("--mamba-norm-ungrouped") && e.contains("nothing was written"), "{e}");
    assert!(!exported.exists());
    let _ = std::fs::remove_dir_all(run_dir);
}
