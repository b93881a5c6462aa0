//! `ferrotron convert` against Hugging Face transformers: the small models of
//! tests/fixtures/hf (written by transformers' own classes, see make_hf_fixtures.py) are imported,
//! and Ferrotron's logits for the fixture's tokens must be transformers' (computed there in
//! float64); exporting the import back must give transformers' files again, tensor for tensor.

mod common;

use common::tmp;
use ferrotron_core::{Cx, DType, Device, Tensor};
use ferrotron_data::{Tokenizer, TokenizerKind};
use ferrotron_models::hf;
use ferrotron_trainer::checkpoint;
use ferrotron_trainer::convert::{ConvertArgs, convert};
use ferrotron_transformer::GptModel;
use safetensors::SafeTensors;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

const FIXTURES: [&str; 11] = [
    "gpt2",
    "llama",
    "llama_tied",
    "mistral",
    "qwen2",
    "mixtral",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "mamba2",
    "deepseek_v3",
];

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf").join(name)
}

fn args(loader: &str, saver: &str, load: &Path, save: &Path) -> ConvertArgs {
    ConvertArgs::new(loader, saver, load, save)
}

struct Reference {
    input_ids: Vec<Vec<u32>>,
    logits: Vec<f64>,
}

fn reference(name: &str) -> Reference {
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture(name).join("reference.json")).unwrap()).unwrap();
    let input_ids = v["input_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|row| row.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect())
        .collect();
    let logits = v["logits"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
    Reference { input_ids, logits }
}

/// Every tensor of a transformers folder, by name without GPT-2's `transformer.` prefix.
fn hf_tensors(dir: &Path) -> HashMap<String, (Vec<usize>, Vec<u8>)> {
    let mut out = HashMap::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "safetensors") {
            let bytes = std::fs::read(&p).unwrap();
            let st = SafeTensors::deserialize(&bytes).unwrap();
            for (n, t) in st.tensors() {
                let key = n.strip_prefix("transformer.").unwrap_or(&n).to_string();
                out.insert(key, (t.shape().to_vec(), t.data().to_vec()));
            }
        }
    }
    out
}

/// Ferrotron's logits for the fixture's tokens against transformers': the largest difference.
fn max_logit_error(name: &str, config: ferrotron_transformer::TransformerConfig, ck: &checkpoint::Loaded) -> f64 {
    let (model, table) = GptModel::build(config, &Device::Cpu, DType::F32, 1).unwrap();
    checkpoint::restore_params(ck, &table).unwrap();
    // DeepSeek-V3's expert-bias corrections (the routers' buffers) as the import wrote them.
    if let Some(m) = ferrotron_models::moe_spec(&model.config) {
        checkpoint::restore_biases(ck, &m.biases.layers(), false).unwrap();
    }
    let r = reference(name);
    let (b, t) = (r.input_ids.len(), r.input_ids[0].len());
    let ids: Vec<u32> = r.input_ids.concat();
    let cx = Cx::new(&table, false);
    let logits = model.logits(&cx, &Tensor::from_vec(ids, [b, t], &Device::Cpu).unwrap()).unwrap();
    let logits = logits.to_vec_f32().unwrap();
    let vocab = 256;
    let padded = model.config.padded_vocab_size(1);
    assert_eq!(logits.len(), b * t * padded);
    let (mut worst, mut scale) = (0f64, 0f64);
    for row in 0..b * t {
        for v in 0..vocab {
            let want = r.logits[row * vocab + v];
            worst = worst.max((logits[row * padded + v] as f64 - want).abs());
            scale = scale.max(want.abs());
        }
    }
    // fp32 against float64: rounding only. A wrong head order, transpose or gate/up order moves
    // logits of this size by whole units.
    assert!(scale > 2.0, "{name}: the fixture's logits are too flat to test anything ({scale})");
    assert!(worst < 1e-4, "{name}: max |logit − transformers'| = {worst:e} (largest logit {scale}, {padded} rows)");
    worst
}

#[test]
fn imported_models_give_transformers_logits() {
    for name in FIXTURES {
        let out = tmp(&format!("hf-import-{name}"));
        let done = convert(&args("hf", "ferrotron", &fixture(name), &out)).unwrap();
        let arch = match name {
            "gpt2" => hf::HfArch::Gpt2,
            "mistral" => hf::HfArch::Mistral,
            "qwen2" => hf::HfArch::Qwen2,
            "mixtral" => hf::HfArch::Mixtral,
            "qwen2_moe" => hf::HfArch::Qwen2Moe,
            "qwen3" => hf::HfArch::Qwen3,
            "qwen3_moe" => hf::HfArch::Qwen3Moe,
            "mamba2" => hf::HfArch::Mamba2,
            "deepseek_v3" => hf::HfArch::DeepseekV3,
            _ => hf::HfArch::Llama,
        };
        assert_eq!(done.arch, Some(arch));
        let ck = checkpoint::load(&out).unwrap();
        assert!(!ck.state.optimizer_state, "an import holds parameters only");
        let s = &ck.state.settings;
        // llama_tied has Llama 3.2's RoPE scaling: Megatron's flags for it.
        assert_eq!(
            (s.use_rope_scaling, s.rope_scaling_factor),
            (name == "llama_tied", if name == "llama_tied" { 32.0 } else { 8.0 })
        );
        let mut config = ck.state.settings.model_config().unwrap();
        // HF's 256 rows padded to 288 here: the padding rows (zeros) must not matter.
        for divisible_by in [128, 96] {
            config.make_vocab_size_divisible_by = divisible_by;
            let worst = max_logit_error(name, config.clone(), &ck);
            eprintln!(
                "{name} (vocabulary padded to a multiple of {divisible_by}): max |logit − transformers'| {worst:.2e}"
            );
        }
        let _ = std::fs::remove_dir_all(&out);
    }
}

#[test]
fn an_import_exported_again_is_transformers_files_tensor_for_tensor() {
    for name in FIXTURES {
        let (ck, back) = (tmp(&format!("hf-rt-{name}")), tmp(&format!("hf-rt-{name}-out")));
        convert(&args("hf", "ferrotron", &fixture(name), &ck)).unwrap();
        let done = convert(&args("ferrotron", "hf", &ck, &back)).unwrap();
        // The import took the folder's own tokenizer where it has one; the export copies it back.
        if fixture(name).join("tokenizer.json").is_file() {
            assert_eq!(done.tokenizer, Ok(vec!["tokenizer.json", "tokenizer_config.json"]), "{name}");
            for f in ["tokenizer.json", "tokenizer_config.json"] {
                assert_eq!(std::fs::read(back.join(f)).unwrap(), std::fs::read(fixture(name).join(f)).unwrap());
            }
        } else {
            assert!(done.tokenizer.as_ref().is_err_and(|e| e.contains("not a transformers folder")), "{name}");
        }
        let (want, got) = (hf_tensors(&fixture(name)), hf_tensors(&back));
        // The same in files of at most 100 kB (40 kB for mamba2's 98 kB), with transformers' index;
        // read back by the import.
        let (small, again) = (tmp(&format!("hf-rt-{name}-small")), tmp(&format!("hf-rt-{name}-again")));
        let limit = if name == "mamba2" { "40KB" } else { "100KB" };
        convert(&ConvertArgs { max_shard_size: Some(limit.into()), ..args("ferrotron", "hf", &ck, &small) }).unwrap();
        let index: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(small.join("model.safetensors.index.json")).unwrap())
                .unwrap();
        let files: std::collections::BTreeSet<&str> =
            index["weight_map"].as_object().unwrap().values().map(|v| v.as_str().unwrap()).collect();
        assert!(files.len() > 1 && files.iter().all(|f| small.join(f).is_file()), "{name}: {files:?}");
        assert!(hf_tensors(&small) == got, "{name}: the sharded export holds other tensors");
        convert(&args("hf", "ferrotron", &small, &again)).unwrap();
        let (x, y) = (checkpoint::load(&ck).unwrap(), checkpoint::load(&again).unwrap());
        assert!(x.tensors == y.tensors, "{name}: the sharded export imports to other tensors");
        for d in [small, again] {
            let _ = std::fs::remove_dir_all(d);
        }
        let mut names: Vec<&String> = want.keys().collect();
        names.sort();
        assert_eq!(got.len(), want.len(), "{name}: {:?}", got.keys().collect::<Vec<_>>());
        for n in names {
            assert!(got[n] == want[n], "{name}: `{n}` differs after import and export");
        }
        let read = |d: &Path| {
            let v: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(d.join("config.json")).unwrap()).unwrap();
            let m = hf::from_hf_config(&v).unwrap();
            let mut v = hf::to_hf_config(m.arch, &m.config, "");
            // transformers' DeepSeek-V3 counts an MTP depth in config.json but saves none: the
            // import drops the count, the export writes 0.
            if let Some(o) = v.as_object_mut() {
                o.remove("num_nextn_predict_layers");
            }
            v
        };
        if name == "deepseek_v3" {
            assert_eq!(checkpoint::load(&ck).unwrap().state.settings.mtp_num_layers, None);
        }
        assert_eq!(read(&back), read(&fixture(name)), "{name}: config.json");
        // A folder that holds a model already is not written over.
        let e = convert(&args("ferrotron", "hf", &ck, &back)).unwrap_err().to_string();
        assert!(e.contains("holds a model already"), "{e}");
        let _ = std::fs::remove_dir_all(&ck);
        let _ = std::fs::remove_dir_all(&back);
    }
}

fn ferrotron(a: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_ferrotron")).args(a).output().expect("run ferrotron")
}

fn ok(o: &std::process::Output) -> String {
    let e = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "{e}");
    e
}

fn fails(o: &std::process::Output, needle: &str) {
    let e = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(!o.status.success() && e.contains(needle), "expected an error naming {needle:?}, got: {e}");
}

#[test]
fn the_hf_tokenizer_encodes_and_decodes_as_transformers() {
    // llama: a Metaspace BPE with Llama 2's template; tokenizer_llama3: a byte-level BPE behind
    // Llama 3's regex split (its lookahead runs through fancy-regex).
    for name in ["llama", "tokenizer_llama3"] {
        let dir = fixture(name);
        let r: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("tokenizer_reference.json")).unwrap()).unwrap();
        let tok = Tokenizer::new(TokenizerKind::HuggingFace(dir.clone())).unwrap();
        assert_eq!(tok.vocab_size(), r["len"].as_u64().unwrap() as usize, "{name}");
        assert_eq!(tok.eod(), r["eos_token_id"].as_u64().unwrap() as u32, "{name}");
        let texts = r["texts"].as_array().unwrap();
        for (i, text) in texts.iter().enumerate() {
            let want: Vec<u32> =
                r["input_ids"][i].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
            let ids = tok.encode(text.as_str().unwrap()).unwrap();
            assert_eq!(ids, want, "{name}: {text}");
            assert_eq!(tok.decode(&ids).unwrap(), r["decoded"][i].as_str().unwrap(), "{name}: {text}");
        }
    }
    let dir = fixture("llama");
    // Megatron's flags: the folder is HuggingFaceTokenizer's and only its.
    let e = TokenizerKind::parse("HuggingFaceTokenizer").unwrap_err().to_string();
    assert!(e.contains("--tokenizer-model"), "{e}");
    let e = TokenizerKind::parse_with("gpt2", None, Some(&dir)).unwrap_err().to_string();
    assert!(e.contains("--tokenizer-model") && e.contains("gpt2"), "{e}");
    let e = Tokenizer::new(TokenizerKind::HuggingFace(fixture("gpt2"))).err().unwrap().to_string();
    assert!(e.contains("no tokenizer.json"), "{e}");
}

#[test]
fn an_import_fine_tunes_on_its_own_tokenizers_data_and_samples() {
    let (ck, run, data) = (tmp("hf-cli-ck"), tmp("hf-cli-run"), tmp("hf-cli-data"));
    let (c, r) = (ck.to_str().unwrap(), run.to_str().unwrap());
    let src = fixture("llama");
    let s = src.to_str().unwrap();
    let e = ok(&ferrotron(&["convert", "--loader", "hf", "--saver", "ferrotron", "--load-dir", s, "--save-dir", c]));
    assert!(e.contains("LlamaForCausalLM") && e.contains("--use-checkpoint-args"), "{e}");
    let st = checkpoint::read_state(&ck).unwrap().settings;
    assert_eq!(st.tokenizer_type, "HuggingFaceTokenizer", "the folder's own tokenizer.json");
    assert_eq!(st.tokenizer_model.as_deref(), Some(src.canonicalize().unwrap().as_path()));
    // Data in the model's tokenizer, as Megatron's preprocess_data.py makes it.
    std::fs::create_dir_all(&data).unwrap();
    let jsonl = data.join("docs.jsonl");
    let docs: Vec<String> = (0..60)
        .map(|i| format!("{{\"text\": \"the quick brown fox {i} jumps over the lazy dog near the river stone\"}}"))
        .collect();
    std::fs::write(&jsonl, docs.join("\n")).unwrap();
    let prefix = data.join("my");
    let (j, p) = (jsonl.to_str().unwrap(), prefix.to_str().unwrap());
    ok(&ferrotron(&[
        "preprocess",
        "--input",
        j,
        "--output-prefix",
        p,
        "--tokenizer-type",
        "HuggingFaceTokenizer",
        "--tokenizer-model",
        s,
        "--append-eod",
    ]));
    let tokens = ferrotron_data::IndexedDataset::open(data.join("my_text_document")).unwrap();
    let want = Tokenizer::new(TokenizerKind::HuggingFace(src.clone())).unwrap();
    let mut first = want.encode("the quick brown fox 0 jumps over the lazy dog near the river stone").unwrap();
    first.push(want.eod());
    let mut read = vec![0u32; tokens.sequence_length(0) as usize];
    tokens.read(tokens.sequence_start(0), &mut read).unwrap();
    assert_eq!(read, first);
    // Resuming needs optimizer state, which an import does not have.
    fails(&ferrotron(&["train", "--load", c, "--use-checkpoint-args", "--train-iters", "2"]), "--finetune");
    // The tiny GPT preset's model flags give way to the checkpoint's (a Llama, hidden 64).
    let d = data.join("my_text_document");
    let train = [
        "train",
        "--load",
        c,
        "--finetune",
        "--use-checkpoint-args",
        "--data-path",
        d.to_str().unwrap(),
        "--split",
        "90,10,0",
        "--seq-length",
        "16",
        "--micro-batch-size",
        "4",
        "--global-batch-size",
        "4",
        "--train-iters",
        "3",
        "--eval-interval",
        "3",
        "--eval-iters",
        "1",
        "--lr",
        "1e-4",
        "--min-lr",
        "1e-5",
        "--no-progress",
        "--save",
        r,
    ];
    ok(&ferrotron(&train));
    let s = checkpoint::read_state(&run).unwrap().settings;
    assert_eq!((s.hidden_size, s.num_query_groups, s.ffn_hidden_size, s.seq_length), (64, 2, 96, 16));
    assert!(s.swiglu && s.untie_embeddings_and_output_weights && s.normalization == "RMSNorm", "{s:?}");
    assert_eq!((s.norm_epsilon, s.tokenizer_type.as_str()), (1e-6, "HuggingFaceTokenizer"));
    let o = ferrotron(&["generate", "--load", c, "--prompt", "the fox", "--max-new-tokens", "4", "--temperature", "0"]);
    ok(&o);
    assert!(String::from_utf8_lossy(&o.stdout).starts_with("<s> the fox"), "{}", String::from_utf8_lossy(&o.stdout));
    fails(&ferrotron(&["train", "--use-checkpoint-args"]), "--load");
    for dir in [ck, run, data] {
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// A copy of the llama fixture whose weights `edit` changed.
fn edited_llama(name: &str, edit: impl FnOnce(&mut Vec<(String, Vec<usize>, Vec<u8>)>)) -> PathBuf {
    let dir = tmp(name);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(fixture("llama").join("config.json"), dir.join("config.json")).unwrap();
    let mut t: Vec<(String, Vec<usize>, Vec<u8>)> =
        hf_tensors(&fixture("llama")).into_iter().map(|(n, (s, b))| (n, s, b)).collect();
    t.sort_by(|a, b| a.0.cmp(&b.0));
    edit(&mut t);
    let views: Vec<_> = t
        .iter()
        .map(|(n, s, b)| {
            (n.as_str(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b).unwrap())
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    dir
}

#[test]
fn hf_folders_that_do_not_fit_are_refused_by_name() {
    let out = tmp("hf-bad-out");
    let import = |d: &Path| convert(&args("hf", "ferrotron", d, &out)).unwrap_err();
    let missing = edited_llama("hf-missing", |t| t.retain(|(n, _, _)| n != "model.layers.1.mlp.up_proj.weight"));
    let e = format!("{:#}", import(&missing));
    assert!(e.contains("model.layers.1.mlp.up_proj.weight") && e.contains("missing"), "{e}");
    let extra = edited_llama("hf-extra", |t| {
        let first = t[0].clone();
        t.push(("model.layers.0.self_attn.q_norm.weight".into(), first.1, first.2));
    });
    let e = format!("{:#}", import(&extra));
    assert!(e.contains("q_norm") && e.contains("not converted"), "{e}");
    let shapes = edited_llama("hf-shape", |t| {
        let i = t.iter().position(|(n, _, _)| n == "model.norm.weight").unwrap();
        t[i].1 = vec![32];
        t[i].2.truncate(32 * 4);
    });
    let e = format!("{:#}", import(&shapes));
    assert!(e.contains("model.norm.weight") && e.contains("[32]") && e.contains("[64]"), "{e}");
    // The tokenizer must have the model's vocabulary.
    let mut a = args("hf", "ferrotron", &fixture("llama"), &out);
    a.tokenizer_type = Some("gpt2".into());
    let e = format!("{:#}", convert(&a).unwrap_err());
    assert!(e.contains("50257") && e.contains("vocab_size is 256"), "{e}");
    let e = format!("{:#}", convert(&args("hf", "ferrotron", &out, &out)).unwrap_err());
    assert!(e.contains("config.json"), "{e}");
    let e = format!("{:#}", convert(&args("hf", "hf", &fixture("llama"), &out)).unwrap_err());
    assert!(e.contains("--loader hf --saver hf"), "{e}");
    assert!(!out.exists(), "a refused conversion writes nothing");
    for d in [missing, extra, shapes] {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// transformers' `LlavaForConditionalGeneration` (tests/fixtures/hf/llava: a CLIP tower of 3
/// layers read after the second, a GeLU projector, a Llama): the import's logits for the fixture's
/// tokens and images are transformers'; the export writes transformers' tensors again (the third
/// tower layer, which LLaVA never reads, left out, and `vision_feature_layer` −1 in its place),
/// and imports back to the same checkpoint.
#[test]
fn llava_converts_both_ways_with_transformers_logits() {
    use ferrotron_parallel::{ProcessGroups, TensorParallel, pipeline::StagePlan};
    use ferrotron_transformer::{Images, Recompute};
    let out = tmp("hf-import-llava");
    let done = convert(&args("hf", "ferrotron", &fixture("llava"), &out)).unwrap();
    assert_eq!(done.arch, Some(hf::HfArch::Llava));
    let ck = checkpoint::load(&out).unwrap();
    let s = &ck.state.settings;
    let v = s.vision_spec().unwrap().expect("the vision flags are recorded");
    assert_eq!((v.encoder.num_layers, v.image_tokens(), v.image_token, v.drop_class_token), (2, 4, 255, true));
    let config = s.model_config().unwrap();
    assert_eq!(config.vocab_size, 256, "the image token is one of config.json's ids");
    let tp = TensorParallel::new(ProcessGroups::single().tp, false);
    let plan = StagePlan::whole(config.num_layers);
    let (model, table) =
        GptModel::build_multimodal(config, &v, &tp, &plan, Recompute::default(), &Device::Cpu, DType::F32, 1, 1)
            .unwrap();
    checkpoint::restore_params(&ck, &table).unwrap();
    let r = reference("llava");
    let raw: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("llava").join("reference.json")).unwrap()).unwrap();
    let pixels: Vec<f32> = raw["pixel_values"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect();
    let (b, t) = (r.input_ids.len(), r.input_ids[0].len());
    let ids: Vec<u32> = r.input_ids.concat();
    let dev = Device::Cpu;
    let patches = Tensor::from_vec(v.patchify(&pixels, b).unwrap(), [b, v.seq_len(), v.patch_len()], &dev).unwrap();
    let images = Images::new(patches, &ids, v.image_token);
    let tokens = Tensor::from_vec(ids, [b, t], &dev).unwrap();
    let cx = Cx::new(&table, false);
    let logits = model.logits_with(&cx, &tokens, Some(&images)).unwrap().to_vec_f32().unwrap();
    let (mut worst, mut scale) = (0f64, 0f64);
    for (got, want) in logits.iter().zip(&r.logits) {
        worst = worst.max((*got as f64 - want).abs());
        scale = scale.max(want.abs());
    }
    assert_eq!(logits.len(), r.logits.len());
    assert!(scale > 2.0, "the fixture's logits are too flat to test anything ({scale})");
    assert!(worst < 1e-4, "llava: max |logit − transformers'| = {worst:e} (largest {scale})");
    eprintln!("llava: max |logit − transformers'| {worst:.2e}");
    // Without the images the placeholders' own embeddings are read: other logits, far apart.
    let text = model.logits(&cx, &tokens).unwrap().to_vec_f32().unwrap();
    let moved = text.iter().zip(&r.logits).map(|(a, b)| (*a as f64 - b).abs()).fold(0f64, f64::max);
    assert!(moved > 1e-2, "the images change the logits ({moved})");

    let back = tmp("hf-export-llava");
    let done = convert(&args("ferrotron", "hf", &out, &back)).unwrap();
    assert_eq!(done.arch, Some(hf::HfArch::Llava));
    let (want, got) = (hf_tensors(&fixture("llava")), hf_tensors(&back));
    for (n, t) in &got {
        if n.starts_with("vision_tower.post_layernorm.") {
            continue; // LLaVA never reads it: written as ones and zeros
        }
        assert!(want.get(n) == Some(t), "`{n}` differs from transformers' file after import and export");
    }
    let unused: Vec<&String> = want.keys().filter(|n| !got.contains_key(*n)).collect();
    assert!(unused.iter().all(|n| n.starts_with("vision_tower.encoder.layers.2.")), "{unused:?}");
    assert_eq!(unused.len(), 16);
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(back.join("config.json")).unwrap()).unwrap();
    assert_eq!(
        (config["vision_feature_layer"].as_i64(), config["vision_config"]["num_hidden_layers"].as_u64()),
        (Some(-1), Some(2))
    );
    let again = tmp("hf-reimport-llava");
    convert(&args("hf", "ferrotron", &back, &again)).unwrap();
    let (x, y) = (checkpoint::load(&out).unwrap(), checkpoint::load(&again).unwrap());
    assert!(x.tensors == y.tensors, "the export imports to other tensors");
    for d in [out, back, again] {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// A DeepSeek-V3 with a multi-token prediction depth (the deepseek-v3-tiny preset, trained two
/// steps) exported as DeepSeek's checkpoints lay it out (the depth as the layer after the
/// decoder's, with its copies of the embedding and output layer) and imported back: every
/// tensor, the depth's and the routers' expert biases included, comes back bit for bit, and the
/// depth is kept.
#[test]
fn a_deepseek_v3_with_an_mtp_depth_converts_both_ways() {
    use ferrotron_trainer::settings::{Paths, Settings, TrainArgs};
    let (ck, hf_dir, back) = (tmp("ds-mtp-ck"), tmp("ds-mtp-hf"), tmp("ds-mtp-back"));
    let train_args = TrainArgs {
        preset: Some("deepseek-v3-tiny".into()),
        seq_length: Some(32),
        micro_batch_size: Some(2),
        global_batch_size: Some(2),
        train_iters: Some(2),
        eval_iters: Some(0),
        corpus_docs: Some(100),
        no_progress: true,
        ..TrainArgs::default()
    };
    let (s, _) = Settings::resolve(&train_args).unwrap();
    ferrotron_trainer::train::train(&s, &Paths { save: Some(ck.clone()), ..Paths::default() }).unwrap();
    assert_eq!(convert(&args("ferrotron", "hf", &ck, &hf_dir)).unwrap().left_out, 0, "nothing left out");
    let files = hf_tensors(&hf_dir);
    for n in [
        "model.layers.4.eh_proj.weight",
        "model.layers.4.shared_head.head.weight",
        "model.layers.4.mlp.gate.e_score_correction_bias",
    ] {
        assert!(files.contains_key(n), "{n} not exported");
    }
    convert(&args("hf", "ferrotron", &hf_dir, &back)).unwrap();
    let (x, y) = (checkpoint::load_params(&ck).unwrap(), checkpoint::load(&back).unwrap());
    assert_eq!(y.state.settings.mtp_num_layers, Some(1));
    let mut names: Vec<&String> = x.tensors.keys().collect();
    names.sort();
    assert!(names.iter().any(|n| n.starts_with("mtp.layers.0.transformer_layer.mlp.router.expert_bias")));
    for n in names {
        let (a, b) = (&x.tensors[n], y.tensors.get(n).unwrap_or_else(|| panic!("{n} not imported")));
        assert_eq!(a.0, b.0, "{n}");
        assert!(a.1.iter().zip(&b.1).all(|(p, q)| p.to_bits() == q.to_bits()), "{n} differs");
    }
    for d in [ck, hf_dir, back] {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// A copy of deepseek_v3_fp8 with `config` edited, the tensors `drop` names left out and
/// `copy`'s (new name, of tensor) added.
fn edited_fp8(
    name: &str,
    config: impl FnOnce(&mut serde_json::Value),
    drop: &[&str],
    copy: &[(&str, &str)],
) -> PathBuf {
    let (src, dir) = (fixture("deepseek_v3_fp8"), tmp(name));
    std::fs::create_dir_all(&dir).unwrap();
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    config(&mut v);
    std::fs::write(dir.join("config.json"), v.to_string()).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut kept: Vec<_> = st.tensors().into_iter().filter(|(n, _)| !drop.contains(&n.as_str())).collect();
    assert_eq!(kept.len() + drop.len(), st.len(), "{drop:?} are not all in the fixture");
    for (new, of) in copy {
        kept.push((new.to_string(), st.tensor(of).unwrap()));
    }
    safetensors::serialize_to_file(kept, None, &dir.join("model.safetensors")).unwrap();
    dir
}

/// DeepSeek's FP8 release format (tests/fixtures/hf/deepseek_v3_fp8: every linear weight of the
/// decoder layers in F8_E4M3 with a float32 scale per 16 × 16 tile, some tiles partial): the
/// import decodes each weight with its own tiles' scales, so its logits are transformers' for the
/// weights the files decode to (which differ from the unquantized model's by far more than the
/// tolerance); scales that are missing, misshapen or unexplained by config.json are refused.
#[test]
fn block_scaled_fp8_weights_import_to_transformers_logits() {
    let name = "deepseek_v3_fp8";
    let out = tmp("hf-fp8");
    let done = convert(&args("hf", "ferrotron", &fixture(name), &out)).unwrap();
    assert_eq!(done.arch, Some(hf::HfArch::DeepseekV3));
    let ck = checkpoint::load(&out).unwrap();
    assert!(ck.state.settings.bf16, "DeepSeek's FP8 folders say bfloat16: trained in Megatron's bf16");
    let config = ck.state.settings.model_config().unwrap();
    let worst = max_logit_error(name, config, &ck);
    eprintln!("{name}: max |logit − transformers'| {worst:.2e}");
    let _ = std::fs::remove_dir_all(&out);

    let import = |d: &Path| format!("{:#}", convert(&args("hf", "ferrotron", d, &out)).unwrap_err());
    let scale = "model.layers.1.self_attn.q_b_proj.weight_scale_inv";
    let missing = edited_fp8("hf-fp8-missing", |_| {}, &[scale], &[]);
    let e = import(&missing);
    assert!(e.contains(scale) && e.contains("missing"), "{e}");
    let no_config =
        edited_fp8("hf-fp8-noq", |v| drop(v.as_object_mut().unwrap().remove("quantization_config")), &[], &[]);
    let e = import(&no_config);
    assert!(e.contains("F8_E4M3") && e.contains("quantization_config"), "{e}");
    let block = edited_fp8(
        "hf-fp8-block",
        |v| v["quantization_config"]["weight_block_size"] = serde_json::json!([128, 128]),
        &[],
        &[],
    );
    let e = import(&block);
    assert!(e.contains("weight_block_size") && e.contains("[128, 128]"), "{e}");
    // A scale whose weight the model does not have is not silently dropped.
    let stray = "model.layers.0.self_attn.k_proj.weight_scale_inv";
    let orphan = edited_fp8("hf-fp8-orphan", |_| {}, &[], &[(stray, scale)]);
    let e = import(&orphan);
    assert!(e.contains(stray) && e.contains("not converted"), "{e}");
    assert!(!out.exists(), "a refused conversion writes nothing");
    for d in [missing, no_config, block, orphan] {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// Both directions write as the tensors are converted (so a large model is never held whole):
/// an import in checkpoint shard files of about --max-shard-size, several of which load to the
/// same tensors as one file; an export reading the checkpoint a tensor at a time. A conversion
/// that fails part-way (a missing tensor, a corrupt checkpoint file) removes what it wrote.
#[test]
fn conversions_stream_and_clean_up_after_a_failure() {
    let (one, many) = (tmp("hf-stream-one"), tmp("hf-stream-many"));
    convert(&args("hf", "ferrotron", &fixture("mixtral"), &one)).unwrap();
    let a = ConvertArgs { max_shard_size: Some("20KB".into()), ..args("hf", "ferrotron", &fixture("mixtral"), &many) };
    convert(&a).unwrap();
    let files = checkpoint::read_state(&many).unwrap().tensor_files.len();
    assert_eq!(checkpoint::read_state(&one).unwrap().tensor_files.len(), 1);
    assert!(files > 3, "20KB files of a ~190KB model: {files}");
    let (x, y) = (checkpoint::load(&one).unwrap(), checkpoint::load(&many).unwrap());
    assert!(x.tensors == y.tensors, "the sharded import holds other tensors");
    // A missing tensor is found before anything is written (the folder against config.json).
    let late = "model.layers.2.mlp.experts.7.down_proj.weight";
    let missing = edited_fp8("hf-stream-missing", |_| {}, &[late], &[]);
    let out = tmp("hf-stream-refused");
    let a = ConvertArgs { max_shard_size: Some("1KB".into()), ..args("hf", "ferrotron", &missing, &out) };
    let e = format!("{:#}", convert(&a).unwrap_err());
    assert!(e.contains(late) && e.contains("missing"), "{e}");
    assert!(!out.exists(), "a refused import writes nothing");
    // Refused after some files were written: a late weight's scales have another weight's shape.
    let (scale, other) = (format!("{late}_scale_inv"), "model.layers.2.mlp.experts.7.up_proj.weight_scale_inv");
    let bad = edited_fp8("hf-stream-late", |_| {}, &[scale.as_str()], &[(scale.as_str(), other)]);
    let a = ConvertArgs { max_shard_size: Some("1KB".into()), ..args("hf", "ferrotron", &bad, &out) };
    let e = format!("{:#}", convert(&a).unwrap_err());
    assert!(e.contains(late) && e.contains("weight_block_size"), "{e}");
    assert!(!out.exists(), "a refused import leaves nothing behind");
    // An export from the many small files gives the one-file import's export.
    let (back_one, back_many) = (tmp("hf-stream-back-one"), tmp("hf-stream-back-many"));
    convert(&args("ferrotron", "hf", &one, &back_one)).unwrap();
    convert(&ConvertArgs { max_shard_size: Some("30KB".into()), ..args("ferrotron", "hf", &many, &back_many) })
        .unwrap();
    assert!(hf_tensors(&back_one) == hf_tensors(&back_many), "the exports differ");
    assert!(back_many.join("model.safetensors.index.json").is_file());
    // A checkpoint file corrupted on disk: the export stops at its first read and removes its files.
    let state = checkpoint::read_state(&many).unwrap();
    let last = checkpoint::resolve(&many).unwrap().join(&state.tensor_files.last().unwrap().file);
    let mut bytes = std::fs::read(&last).unwrap();
    let end = bytes.len() - 1;
    bytes[end] ^= 0x55;
    std::fs::write(&last, bytes).unwrap();
    let out = tmp("hf-stream-export-refused");
    let a = ConvertArgs { max_shard_size: Some("1KB".into()), ..args("ferrotron", "hf", &many, &out) };
    let e = format!("{:#}", convert(&a).unwrap_err());
    assert!(e.contains("corrupt") && e.contains(&state.tensor_files.last().unwrap().file), "{e}");
    assert!(!out.exists(), "a failed export leaves nothing behind");
    for d in [one, many, missing, bad, back_one, back_many] {
        let _ = std::fs::remove_dir_all(d);
    }
}
