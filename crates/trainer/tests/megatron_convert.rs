//! `ferrotron convert --loader megatron` against megatron-core itself: the checkpoints of
//! tests/fixtures/megatron (written by megatron-core's GPTModel and dist_checkpointing, see
//! make_megatron_fixtures.py) are imported, and Ferrotron's logits for the fixture's tokens must
//! be megatron-core's. Three torch_dist checkpoints (Llama-style: RMSNorm, SwiGLU, RoPE, GQA,
//! untied; the same with four experts in every layer, top-2; and with DeepSeek-V3's routing:
//! sigmoid scores with expert biases, group-limited, a gated shared expert), a legacy torch one
//! (GPT-2-style: LayerNorm, biases, fused bias-GeLU, learned positions, tied), and the first two
//! again in the legacy format over several ranks (tensor 2 × pipeline 2; tensor 2 × expert 2),
//! each rank's file its part of the model as megatron-core split it; and a Mamba hybrid
//! (megatron-core's MambaModel, with mamba_ssm's kernels in plain PyTorch) in both formats.

mod common;

use common::tmp;
use ferrotron_core::{Cx, DType, Device, Tensor};
use ferrotron_trainer::checkpoint;
use ferrotron_trainer::convert::{ConvertArgs, convert};
use ferrotron_transformer::{Batch, GptModel};
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/megatron").join(name)
}

fn args(loader: &str, load: &Path, save: &Path) -> ConvertArgs {
    ConvertArgs::new(loader, "ferrotron", load, save)
}

/// Ferrotron's logits on the import against megatron-core's: the largest difference.
fn max_logit_error(name: &str, ck: &checkpoint::Loaded) -> f64 {
    let config = ck.state.settings.model_config().unwrap();
    let (model, table) = GptModel::build(config, &Device::Cpu, DType::F32, 1).unwrap();
    checkpoint::restore_params(ck, &table).unwrap();
    // The routers' expert biases (buffers), where the run had them.
    if let Some(m) = ferrotron_models::moe_spec(&model.config) {
        checkpoint::restore_biases(ck, &m.biases.layers(), false).unwrap();
    }
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture(name).join("reference.json")).unwrap()).unwrap();
    let rows: Vec<Vec<u32>> = r["input_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|row| row.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect())
        .collect();
    let want: Vec<f64> = r["logits"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
    let (b, t) = (rows.len(), rows[0].len());
    let cx = Cx::new(&table, false);
    let logits = model.logits(&cx, &Tensor::from_vec(rows.concat(), [b, t], &Device::Cpu).unwrap()).unwrap();
    let got = logits.to_vec_f32().unwrap();
    assert_eq!(got.len(), want.len(), "{name}: 128 logits a token, as megatron-core's");
    let scale = want.iter().fold(0f64, |m, x| m.max(x.abs()));
    assert!(scale > 2.0, "{name}: the fixture's logits are too flat to test anything ({scale})");
    got.iter().zip(&want).map(|(g, w)| (*g as f64 - w).abs()).fold(0f64, f64::max)
}

/// Ferrotron's loss and first multi-token prediction depth's loss on the import, each against
/// megatron-core's (reference.json's `loss` and `mtp_losses`): their differences.
fn losses(ck: &checkpoint::Loaded, name: &str) -> (f64, f64) {
    let config = ck.state.settings.model_config().unwrap();
    let (model, table) = GptModel::build(config, &Device::Cpu, DType::F32, 1).unwrap();
    checkpoint::restore_params(ck, &table).unwrap();
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture(name).join("reference.json")).unwrap()).unwrap();
    let ids = |k: &str| -> Vec<u32> {
        r[k].as_array()
            .unwrap()
            .iter()
            .flat_map(|row| row.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32))
            .collect()
    };
    let (tokens, labels) = (ids("input_ids"), ids("labels"));
    let b = r["input_ids"].as_array().unwrap().len();
    let t = tokens.len() / b;
    let batch = Batch::unmasked(
        Tensor::from_vec(tokens, [b, t], &Device::Cpu).unwrap(),
        Tensor::from_vec(labels, [b, t], &Device::Cpu).unwrap(),
    )
    .unwrap();
    let cx = Cx::new(&table, false);
    let (loss, _) = model.forward_deferred(&cx, &batch).unwrap();
    let depth = loss.mtp[0].mean().unwrap();
    let (want, want_depth) = (r["loss"].as_f64().unwrap(), r["mtp_losses"][0].as_f64().unwrap());
    let (d0, d1) = ((loss.mean().unwrap() - want).abs(), (depth - want_depth).abs());
    assert!(d0 < 1e-5 && d1 < 1e-5, "{name}: loss {} vs {want}, depth {depth} vs {want_depth}", loss.mean().unwrap());
    (d0, d1)
}

#[test]
fn megatron_checkpoints_import_to_megatron_cores_logits() {
    let fixtures = [
        ("llama_dist", "megatron", "torch_dist"),
        ("mixtral_dist", "core", "torch_dist"),
        ("deepseek_dist", "mcore", "torch_dist"),
        ("gpt_legacy", "legacy", "torch"),
        // llama_dist and mixtral_dist split by megatron-core over tensor × pipeline and tensor ×
        // expert parallel ranks, one legacy file a rank.
        ("llama_tp2pp2", "legacy", "torch"),
        ("mixtral_tp2ep2", "megatron", "torch"),
        // Multi-latent attention (latents normalised; plain RoPE, and YaRN).
        ("mla_dist", "core", "torch_dist"),
        ("mla_yarn_dist", "mcore", "torch_dist"),
        // mixtral_dist's model with a multi-token prediction depth.
        ("mtp_dist", "megatron", "torch_dist"),
        // llama_dist's with sliding-window attention: each token and the 3 before it.
        ("window_dist", "megatron", "torch_dist"),
        // The window in the first of the two layers only (--window-attn-skip-freq 2).
        ("window_skip_dist", "megatron", "torch_dist"),
        // gpt-oss's layers: experts with the gated quick GeLU (offset, clamp), learned sinks, the
        // window in one layer of two.
        ("gptoss_dist", "core", "torch_dist"),
        // A Mamba hybrid (Mamba, attention, Mamba, MLP and expert layers; the mixers' in_proj and
        // convolution saved in parts), and the same split over two tensor-parallel ranks.
        ("hybrid_dist", "megatron", "torch_dist"),
        ("hybrid_tp2", "legacy", "torch"),
    ];
    for (name, loader, format) in fixtures {
        let out = tmp(&format!("megatron-import-{name}"));
        let done = convert(&args(loader, &fixture(name), &out)).unwrap();
        assert_eq!(done.arch, None);
        assert!(done.what.contains(format), "{}", done.what);
        let ck = checkpoint::load(&out).unwrap();
        assert!(!ck.state.optimizer_state, "an import holds parameters only");
        let s = &ck.state.settings;
        let llama = name != "gpt_legacy";
        let hybrid = name.starts_with("hybrid");
        // The run's own flags, read from its arguments.
        let layers = if hybrid { 5 } else { 2 };
        assert_eq!((s.num_layers, s.hidden_size, s.ffn_hidden_size), (layers, 64, if llama { 96 } else { 256 }));
        let mamba = s.mamba.as_ref().map(|m| {
            (
                m.hybrid_layer_pattern.as_str(),
                m.mamba_state_dim,
                m.mamba_head_dim,
                m.mamba_num_groups,
                m.mamba_norm_ungrouped,
            )
        });
        assert_eq!(mamba, hybrid.then_some(("M*M-E", 16, 32, 2, false)));
        assert_eq!(s.swiglu, llama && name != "gptoss_dist");
        let glu = (s.quick_geglu, s.glu_linear_offset, s.activation_func_clamp_value, s.softmax_type.as_str());
        let gptoss = (true, 1.0, Some(2.0), "learnable");
        assert_eq!(glu.0, name == "gptoss_dist");
        if name == "gptoss_dist" {
            assert_eq!(glu, gptoss);
        }
        assert_eq!(s.untie_embeddings_and_output_weights, llama);
        // mixtral_*, deepseek_dist: four experts of width 48, top-2, in every layer.
        let moe = name.starts_with("mixtral") || ["deepseek_dist", "mtp_dist", "gptoss_dist"].contains(&name) || hybrid;
        let experts = s.moe.as_ref().map(|m| (m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size));
        assert_eq!(experts, moe.then_some((4, 2, 48)));
        if name == "deepseek_dist" {
            let m = s.moe.as_ref().unwrap();
            assert_eq!((m.moe_router_score_function.as_str(), m.moe_router_group_topk), ("sigmoid", Some(1)));
            assert_eq!((m.moe_shared_expert_intermediate_size, m.moe_router_bias_update_rate), (Some(32), Some(1e-3)));
        }
        let windowed = name.starts_with("window") || name == "gptoss_dist";
        assert_eq!(s.window_size, windowed.then_some(3));
        let skip = ["window_skip_dist", "gptoss_dist"].contains(&name);
        assert_eq!(s.window_attn_skip_freq.as_deref(), skip.then_some("2"));
        if name.starts_with("mla") {
            let m = s.mla.as_ref().expect("multi-latent attention");
            assert_eq!((m.q_lora_rank, m.kv_lora_rank, m.qk_pos_emb_head_dim), (Some(16), 12, 4));
            assert_eq!(m.yarn.is_some(), name == "mla_yarn_dist");
        }
        if name == "mtp_dist" {
            assert_eq!((s.mtp_num_layers, s.mtp_loss_scaling_factor), (Some(1), 0.3));
            let (loss, depth) = losses(&ck, name);
            eprintln!("{name}: |loss − megatron-core's| {loss:.2e}, depth 1's {depth:.2e}");
        }
        let worst = max_logit_error(name, &ck);
        // fp32 both sides: rounding only. A wrong head order, norm or gate/up order moves logits
        // of this size by whole units. The hybrid's reference is exact (megatron-core in fp64);
        // Ferrotron's chunked scan takes differences of running sums of the decays' logs (about
        // 100 here), which lose ~1e-5 of each decay in fp32, as mamba_ssm's kernels do.
        let bound = if hybrid { 2e-4 } else { 1e-4 };
        assert!(worst < bound, "{name}: max |logit − megatron-core's| = {worst:e}");
        eprintln!("{name} ({format}): max |logit − megatron-core's| {worst:.2e}");
        let _ = std::fs::remove_dir_all(&out);
    }
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dst = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &dst);
        } else {
            std::fs::copy(e.path(), dst).unwrap();
        }
    }
}

#[test]
fn megatron_checkpoints_that_cannot_be_read_are_refused_by_name_and_nothing_is_written() {
    let fails = |a: ConvertArgs, needles: &[&str]| {
        let e = format!("{:#}", convert(&a).unwrap_err());
        for n in needles {
            assert!(e.contains(n), "`{n}` not in: {e}");
        }
        assert!(!a.save_dir.exists(), "a failed import leaves nothing: {}", a.save_dir.display());
    };
    // A tokenizer with more ids than the embedding has rows.
    let mut a = args("megatron", &fixture("llama_dist"), &tmp("megatron-bad-vocab"));
    a.tokenizer_type = Some("NullTokenizer".into());
    a.vocab_size = Some(300);
    fails(a, &["301 ids", "128 rows"]);

    // A corrupt .metadata, a .distcp file cut short.
    for (file, keep, needle) in [(".metadata", 100, ".metadata"), ("__0_1.distcp", 1000, "__0_1.distcp")] {
        let src = tmp(&format!("megatron-cut-{keep}"));
        copy_dir(&fixture("llama_dist"), &src);
        let f = src.join("iter_0000020").join(file);
        let bytes = std::fs::read(&f).unwrap();
        std::fs::write(&f, &bytes[..keep]).unwrap();
        fails(args("megatron", &src, &tmp(&format!("megatron-cut-out-{keep}"))), &[needle]);
        let _ = std::fs::remove_dir_all(&src);
    }

    // A legacy checkpoint with a rank folder more than its run's layout has.
    let src = tmp("megatron-two-ranks");
    copy_dir(&fixture("gpt_legacy"), &src);
    let it = src.join("iter_0000010");
    copy_dir(&it.join("mp_rank_00"), &it.join("mp_rank_01"));
    fails(args("legacy", &src, &tmp("megatron-two-ranks-out")), &["2 rank folders", "1 × 1 × 1", "missing or extra"]);
    let _ = std::fs::remove_dir_all(&src);

    // A rank's file missing from a legacy checkpoint of several ranks.
    let src = tmp("megatron-rank-missing");
    copy_dir(&fixture("llama_tp2pp2"), &src);
    std::fs::remove_dir_all(src.join("iter_0000020/mp_rank_01_001")).unwrap();
    fails(args("legacy", &src, &tmp("megatron-rank-missing-out")), &["3 rank folders", "2 × 2 × 1"]);
    let _ = std::fs::remove_dir_all(&src);

    // Not a Megatron checkpoint at all.
    let hf = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/llama");
    fails(args("megatron", &hf, &tmp("megatron-not")), &["neither a torch_dist checkpoint"]);
}

fn ferrotron(a: &[&str]) -> (bool, String) {
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_ferrotron")).args(a).output().expect("run ferrotron");
    (o.status.success(), String::from_utf8_lossy(&o.stderr).into_owned())
}

#[test]
fn a_megatron_import_fine_tunes_and_a_megatron_folder_is_not_loaded_as_it_is() {
    let src = fixture("llama_dist");
    let s = src.to_str().unwrap();
    // --load on Megatron's folder (or one of its iterations) names the import instead of
    // starting over or failing on a missing state.toml.
    for load in [s.to_string(), src.join("iter_0000020").to_str().unwrap().to_string()] {
        let (ok, e) = ferrotron(&["train", "--preset", "tiny", "--load", &load, "--train-iters", "1"]);
        assert!(!ok && e.contains("a Megatron-LM checkpoint") && e.contains("--loader megatron"), "{e}");
    }
    let (ck, run) = (tmp("megatron-cli-ck"), tmp("megatron-cli-run"));
    let (c, r) = (ck.to_str().unwrap(), run.to_str().unwrap());
    let (ok, e) =
        ferrotron(&["convert", "--loader", "megatron", "--saver", "ferrotron", "--load-dir", s, "--save-dir", c]);
    assert!(ok && e.contains("Megatron-LM torch_dist checkpoint"), "{e}");
    // The run's own tokenizer (NullTokenizer, 127 ids + end-of-document) comes with the import.
    let st = checkpoint::read_state(&ck).unwrap().settings;
    assert_eq!((st.tokenizer_type.as_str(), st.vocab_size), ("NullTokenizer", Some(127)));
    let (ok, e) = ferrotron(&[
        "train",
        "--load",
        c,
        "--finetune",
        "--use-checkpoint-args",
        "--mock-data",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "2",
        "--train-iters",
        "3",
        "--lr",
        "1e-4",
        "--log-interval",
        "1",
        "--save",
        r,
    ]);
    assert!(ok, "{e}");
    assert!(e.contains("iteration 3/3"), "{e}");
    let done = checkpoint::read_state(&run).unwrap();
    assert_eq!((done.iteration, done.settings.num_layers, done.settings.swiglu), (3, 2, true));
    let _ = std::fs::remove_dir_all(&ck);
    let _ = std::fs::remove_dir_all(&run);
}
