//! `ferrotron convert`: Hugging Face transformers checkpoints (`GPT2LMHeadModel`,
//! `LlamaForCausalLM`, `MistralForCausalLM`: config.json and safetensors, one file or shards with
//! model.safetensors.index.json) into a Ferrotron checkpoint and back, with the flag names of
//! Megatron's tools/checkpoint/convert.py (`--loader`, `--saver`, `--load-dir`, `--save-dir`).
//! Megatron-LM's own checkpoints come in through `convert_megatron.rs`.
//!
//! The names and layouts are `ferrotron_models::hf`'s; this file reads and writes the files. An
//! import holds parameters only (as Megatron's converted checkpoints do): train on it with
//! `--finetune` (or `--no-load-optim`) and `--use-checkpoint-args`.

use crate::checkpoint;
use crate::settings::{Settings, model_args};
use anyhow::{Context, bail};
use ferrotron_checkpoint::fp8;
use ferrotron_core::DType;
use ferrotron_models::hf::{self, HfArch, HostTensor};
use safetensors::Dtype;
use safetensors::SafeTensors;
use safetensors::tensor::Metadata;
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

#[derive(clap::Args, Clone, Debug)]
pub struct ConvertArgs {
    /// The format read: hf (a transformers folder), megatron (a Megatron-LM --save or iter_*
    /// folder, torch_dist or legacy torch; also spelled core, mcore, legacy) or ferrotron (a
    /// --save folder or iter_* folder).
    #[arg(long)]
    pub loader: String,
    /// The format written: ferrotron, hf, or megatron (a Megatron-LM --save folder in torch_dist,
    /// its default format; also spelled core, mcore).
    #[arg(long)]
    pub saver: String,
    #[arg(long)]
    pub load_dir: PathBuf,
    #[arg(long)]
    pub save_dir: PathBuf,
    /// hf → ferrotron: the tokenizer of the model's token ids, whose vocabulary must be
    /// config.json's vocab_size (default: the folder's own tokenizer.json as
    /// HuggingFaceTokenizer; without one gpt2 for 50257 ids, byte for 256).
    #[arg(long)]
    pub tokenizer_type: Option<String>,
    /// With --tokenizer-type HuggingFaceTokenizer: a transformers tokenizer folder.
    #[arg(long)]
    pub tokenizer_model: Option<PathBuf>,
    /// With --tokenizer-type NullTokenizer: ids below N and end-of-document N, i.e. config.json's
    /// vocab_size − 1.
    #[arg(long)]
    pub vocab_size: Option<usize>,
    /// hf → ferrotron: the sequence length recorded for training (default
    /// max_position_embeddings).
    #[arg(long)]
    pub seq_length: Option<usize>,
    /// The largest weights file ("5GB", "500MB", or bytes; default 5GB). ferrotron → hf: as
    /// transformers' save_pretrained takes it: above it the weights go into
    /// model-0000i-of-0000n.safetensors files with model.safetensors.index.json. hf → ferrotron:
    /// the checkpoint's shard files, written as the tensors are converted, so the import holds
    /// about one file's worth of weights (twice that for bf16: values are held as f32).
    /// ferrotron → megatron: the .distcp files' size limit, by the same spelling.
    #[arg(long)]
    pub max_shard_size: Option<String>,
    /// ferrotron → megatron: the tensor-parallel size the Megatron run will load with, which
    /// sets its vocabulary padding (default: the checkpoint's own run's).
    #[arg(long)]
    pub target_tensor_parallel_size: Option<usize>,
    /// ferrotron → megatron: the --transformer-impl whose names the Megatron run loads,
    /// transformer_engine (default, as Megatron-LM's) or local (they differ in MoE layers' pre-MLP
    /// norm and in multi-latent attention's norms).
    #[arg(long)]
    pub saver_transformer_impl: Option<String>,
}

impl ConvertArgs {
    /// `--loader L --saver S --load-dir LOAD --save-dir SAVE`, every other flag left out.
    pub fn new(loader: &str, saver: &str, load_dir: &Path, save_dir: &Path) -> ConvertArgs {
        ConvertArgs {
            loader: loader.into(),
            saver: saver.into(),
            load_dir: load_dir.into(),
            save_dir: save_dir.into(),
            tokenizer_type: None,
            tokenizer_model: None,
            vocab_size: None,
            seq_length: None,
            max_shard_size: None,
            target_tensor_parallel_size: None,
            saver_transformer_impl: None,
        }
    }
}

/// --max-shard-size's default, as transformers': 5GB.
pub(crate) const DEFAULT_SHARD: u64 = 5_000_000_000;

/// What a conversion wrote.
#[derive(Debug)]
pub struct Converted {
    pub dir: PathBuf,
    /// The transformers class converted (none for a Megatron-LM checkpoint).
    pub arch: Option<HfArch>,
    /// What was converted, for the summary line: the class, or the Megatron format.
    pub what: String,
    pub tensors: usize,
    /// Export: the tokenizer files copied beside the weights (from the run's
    /// `--tokenizer-model` folder), or why none were.
    pub tokenizer: Result<Vec<&'static str>, String>,
    /// Export: the checkpoint's multi-token prediction tensors (`mtp.*`) where the transformers
    /// class has no place for them (all but DeepSeek-V3's) and the export leaves them out.
    pub left_out: usize,
}

/// The files of a transformers tokenizer folder that an export copies where they exist.
const TOKENIZER_FILES: [&str; 6] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
];

pub fn convert(a: &ConvertArgs) -> anyhow::Result<Converted> {
    match (a.loader.as_str(), a.saver.as_str()) {
        ("hf", "ferrotron") => import(a),
        // Megatron's tools/checkpoint names its loaders core (mcore), legacy and megatron.
        ("megatron" | "mcore" | "core" | "legacy", "ferrotron") => crate::convert_megatron::import(a),
        ("ferrotron", saver @ ("hf" | "megatron" | "mcore" | "core")) => {
            if a.tokenizer_type.is_some()
                || a.vocab_size.is_some()
                || a.tokenizer_model.is_some()
                || a.seq_length.is_some()
            {
                bail!(
                    "--tokenizer-type, --vocab-size, --tokenizer-model and --seq-length describe an import: drop them (an export keeps the checkpoint's)"
                );
            }
            if saver != "hf" {
                return crate::convert_megatron_export::export(a);
            }
            if a.target_tensor_parallel_size.is_some() || a.saver_transformer_impl.is_some() {
                bail!(
                    "--target-tensor-parallel-size and --saver-transformer-impl describe a Megatron export: drop them for --saver hf"
                );
            }
            let shard = a.max_shard_size.as_deref().map(shard_bytes).transpose()?.unwrap_or(DEFAULT_SHARD);
            export(&a.load_dir, &a.save_dir, shard)
        }
        ("ferrotron", "legacy") => bail!(
            "--saver legacy: the legacy torch format is one file per model-parallel rank of one layout; write torch_dist (--saver megatron), Megatron's default, which loads under any layout"
        ),
        (l, s) => bail!(
            "--loader {l} --saver {s}: convert hf → ferrotron, megatron → ferrotron, ferrotron → hf or ferrotron → megatron"
        ),
    }
}

fn read_config(dir: &Path) -> anyhow::Result<hf::HfModel> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("--load-dir {}: no config.json (not a transformers model folder)", dir.display()))?;
    let v = hf::parse_config(&text).with_context(|| format!("{}: not valid JSON", path.display()))?;
    hf::from_hf_config(&v).with_context(|| path.display().to_string())
}

/// The tokenizer flags (type, NullTokenizer's vocabulary, HF folder) that the flags given name,
/// else the folder's own tokenizer, else the one a vocabulary size implies.
fn tokenizer_for(vocab: usize, a: &ConvertArgs) -> anyhow::Result<(String, Option<usize>, Option<PathBuf>)> {
    if let Some(t) = &a.tokenizer_type {
        return Ok((t.clone(), a.vocab_size, a.tokenizer_model.clone()));
    }
    if a.load_dir.join("tokenizer.json").is_file() {
        // Absolute: the checkpoint's settings are read later from anywhere (generate, training).
        let dir = a.load_dir.canonicalize().with_context(|| format!("--load-dir {}", a.load_dir.display()))?;
        return Ok(("HuggingFaceTokenizer".into(), None, Some(dir)));
    }
    Ok(match vocab {
        ferrotron_models::GPT2_VOCAB => ("gpt2".into(), None, None),
        ferrotron_models::BYTE_VOCAB => ("byte".into(), None, None),
        v => bail!(
            "config.json's vocab_size is {v} and the folder has no tokenizer.json: name the tokenizer of the model's ids, --tokenizer-type HuggingFaceTokenizer --tokenizer-model FOLDER, or NullTokenizer --vocab-size {} for data tokenized elsewhere (ids below it, end-of-document {0})",
            v.saturating_sub(1)
        ),
    })
}

/// The safetensors files of a transformers folder, memory-mapped, and which holds each tensor
/// (by name without GPT-2's `transformer.` prefix).
struct HfFiles {
    /// Each file mapped, where its data starts and its header, parsed once.
    maps: Vec<(PathBuf, memmap2::Mmap, usize, Metadata)>,
    index: HashMap<String, (usize, String)>,
    /// config.json's FP8 block size: F8_E4M3 weights are multiplied by their `_scale_inv`.
    fp8_block: Option<[usize; 2]>,
}

impl HfFiles {
    fn open(dir: &Path, arch: HfArch, fp8_block: Option<[usize; 2]>) -> anyhow::Result<HfFiles> {
        let index_path = dir.join("model.safetensors.index.json");
        let files: Vec<String> = if index_path.is_file() {
            let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&index_path)?)
                .with_context(|| format!("{}: not valid JSON", index_path.display()))?;
            let map =
                v["weight_map"].as_object().with_context(|| format!("{}: no weight_map", index_path.display()))?;
            let set: BTreeSet<String> = map.values().filter_map(|f| f.as_str().map(str::to_string)).collect();
            set.into_iter().collect()
        } else if dir.join("model.safetensors").is_file() {
            vec!["model.safetensors".into()]
        } else {
            bail!(
                "--load-dir {}: no model.safetensors or model.safetensors.index.json (pytorch_model.bin is not read: save the model with transformers' save_pretrained, which writes safetensors)",
                dir.display()
            );
        };
        let mut maps = vec![];
        let mut index = HashMap::new();
        for name in files {
            if name.contains('/') || name.contains('\\') {
                bail!("{}: shard name {name:?} is not a file in the folder", index_path.display());
            }
            let path = dir.join(&name);
            let f = std::fs::File::open(&path).with_context(|| format!("cannot open {}", path.display()))?;
            // SAFETY: read-only map; a file changed underneath the conversion is outside what any
            // reader can guard against.
            let map = unsafe { memmap2::Mmap::map(&f) }.with_context(|| format!("cannot map {}", path.display()))?;
            let (n, meta) = SafeTensors::read_metadata(&map)
                .with_context(|| format!("{}: not a safetensors file", path.display()))?;
            for t in meta.tensors().into_keys() {
                let key = hf::strip_prefix(arch, &t).to_string();
                if index.insert(key, (maps.len(), t.clone())).is_some() {
                    bail!("{}: tensor `{t}` is in more than one file", dir.display());
                }
            }
            maps.push((path, map, 8 + n, meta));
        }
        Ok(HfFiles { maps, index, fp8_block })
    }

    /// Tensor `name` of file `i`: its dtype, shape and bytes (the header checked them at open).
    fn raw(&self, i: usize, name: &str) -> anyhow::Result<(Dtype, &[usize], &[u8])> {
        let (path, map, start, meta) = &self.maps[i];
        let t = meta.info(name).with_context(|| format!("{}: no tensor `{name}`", path.display()))?;
        let (a, b) = t.data_offsets;
        let bytes = map
            .get(start + a..start + b)
            .with_context(|| format!("{}: corrupt file: `{name}` lies past its end", path.display()))?;
        Ok((t.dtype, &t.shape, bytes))
    }

    /// Tensor `name` of file `i` as f32 values (stored as f32, bf16 or f16).
    fn values(&self, i: usize, name: &str) -> anyhow::Result<(Vec<usize>, Vec<f32>)> {
        let (dtype, shape, bytes) = self.raw(i, name)?;
        let path = &self.maps[i].0;
        let mut v = Vec::with_capacity(shape.iter().product());
        if ferrotron_checkpoint::decode(dtype, bytes, &mut v).is_none() {
            bail!(
                "{}: tensor `{name}` has dtype {dtype:?} (f32, bf16, f16 and block-scaled F8_E4M3 are read)",
                path.display()
            );
        }
        if v.len() != shape.iter().product::<usize>() {
            bail!("{}: corrupt file: `{name}` has {} values for shape {shape:?}", path.display(), v.len());
        }
        Ok((shape.to_vec(), v))
    }

    fn read(&self, key: &str) -> anyhow::Result<Option<HostTensor>> {
        let Some((i, name)) = self.index.get(key) else { return Ok(None) };
        if self.raw(*i, name)?.0 == Dtype::F8_E4M3 {
            return self.dequantized(key, *i, name).map(Some);
        }
        let (shape, data) = self.values(*i, name)?;
        Ok(Some(HostTensor::new(shape, data)))
    }

    /// A block-scaled FP8 weight times its scales (`name_scale_inv`, in whichever file holds it).
    fn dequantized(&self, key: &str, i: usize, name: &str) -> anyhow::Result<HostTensor> {
        let path = &self.maps[i].0;
        let Some(block) = self.fp8_block else {
            bail!(
                "{}: tensor `{name}` is F8_E4M3 but config.json has no quantization_config (quant_method fp8 with weight_block_size) to say how its scales apply",
                path.display()
            );
        };
        let Some((j, scale_name)) = self.index.get(&format!("{key}_scale_inv")) else {
            bail!(
                "{}: FP8 tensor `{name}` has no `{name}_scale_inv` in the folder: its scales are missing",
                path.display()
            );
        };
        let (scale_shape, scales) = self.values(*j, scale_name)?;
        let (_, shape, bytes) = self.raw(i, name)?;
        let v = fp8::dequantize_blocks(name, bytes, shape, &scales, &scale_shape, block)
            .with_context(|| format!("{}", path.display()))?;
        Ok(HostTensor::new(shape.to_vec(), v))
    }
}

fn import(a: &ConvertArgs) -> anyhow::Result<Converted> {
    let mut model = read_config(&a.load_dir)?;
    let files = HfFiles::open(&a.load_dir, model.arch, model.fp8_block)?;
    // A DeepSeek-V3 saved by transformers counts MTP depths in config.json but keeps none.
    if let Some(probe) = hf::mtp_probe(model.arch, &model.config)
        && !files.index.contains_key(&probe)
    {
        model.config.mtp = None;
    }
    let (arch, c) = (model.arch, &model.config);
    let (tokenizer, null_vocab, tokenizer_model) = tokenizer_for(c.vocab_size, a)?;
    let mut args = model_args(c);
    args.tokenizer_type = Some(tokenizer.clone());
    args.vocab_size = null_vocab;
    args.tokenizer_model = tokenizer_model;
    args.seq_length = Some(a.seq_length.unwrap_or(c.seq_length));
    // Megatron's mixed precision for bf16 weights; float32 and float16 weights are kept in fp32.
    args.bf16 = model.dtype.as_deref() == Some("bfloat16");
    if let Some(v) = &model.vision {
        // LLaVA: the vision flags that build its tower (the layers it reads) and projector.
        crate::multimodal::spec_args(&v.spec, &mut args);
        args.image_token_id = Some(v.spec.image_token);
    }
    let (mut settings, _) = Settings::resolve(&args).context("the model config.json describes")?;
    settings.preset = format!("hf:{}", arch.class());
    let own = settings.model_config()?;
    if own.vocab_size != c.vocab_size {
        bail!(
            "--tokenizer-type {tokenizer} has {} ids but config.json's vocab_size is {}: name the tokenizer of the model's ids (HuggingFaceTokenizer with --tokenizer-model FOLDER, or NullTokenizer with --vocab-size {} for data tokenized elsewhere)",
            own.vocab_size,
            c.vocab_size,
            c.vocab_size.saturating_sub(1)
        );
    }
    // The settings must build the very model config.json describes.
    if hf::to_hf_config(arch, &own, "") != hf::to_hf_config(arch, c, "") {
        bail!("internal: the settings made from config.json describe another model");
    }
    if let Some(v) = &model.vision {
        let mine = settings.vision_spec()?.context("internal: the settings lost the vision flags")?;
        if hf::llava::to_config(&own, &mine, "") != hf::llava::to_config(c, &v.spec, "") {
            bail!("internal: the settings made from config.json describe another vision tower");
        }
    }
    // The folder against config.json before anything is written (LLaVA's names have variants:
    // checked after its import).
    if model.vision.is_none() {
        let (needed, optional) = hf::import_names(arch, c);
        if let Some(n) = needed.iter().find(|n| !files.index.contains_key(*n)) {
            return Err(hf::HfError::Missing(n.clone()))
                .with_context(|| format!("--load-dir {}", a.load_dir.display()));
        }
        let known: BTreeSet<&str> = needed.iter().chain(&optional).map(String::as_str).collect();
        leftover(&files, a, arch, &|k| known.contains(k))?;
    }
    let dtype = if settings.bf16 { DType::BF16 } else { DType::F32 };
    let max_bytes = a.max_shard_size.as_deref().map(shard_bytes).transpose()?.unwrap_or(DEFAULT_SHARD);
    // Written as the tensors come (shard files of about --max-shard-size); dropped unfinished on
    // any error below, which removes what was written.
    let mut writer = checkpoint::ParamsWriter::new(&a.save_dir, usize::try_from(max_bytes).unwrap_or(usize::MAX))?;
    let mut taken = BTreeSet::new();
    let mut failed = None;
    let mut take = |key: &str| match files.read(key) {
        Ok(t) => {
            taken.insert(key.to_string());
            t
        }
        Err(e) => {
            failed.get_or_insert(e);
            None
        }
    };
    let (mut n, mut write_failed) = (0, None);
    let mut emit = |name: String, t: HostTensor| {
        if write_failed.is_some() {
            return;
        }
        // The routers' expert biases (DeepSeek-V3's correction) are buffers, kept in fp32.
        let d = if name.ends_with(".router.expert_bias") { DType::F32 } else { dtype };
        n += 1;
        if let Err(e) = writer.add(name, d, t.shape, t.data) {
            write_failed = Some(e);
        }
    };
    let imported = match &model.vision {
        Some(v) => hf::llava::import(c, v, &mut take, &mut emit),
        None => hf::import(arch, c, &mut take, &mut emit),
    };
    if let Some(e) = failed.or(write_failed) {
        return Err(e);
    }
    imported.with_context(|| format!("--load-dir {}", a.load_dir.display()))?;
    leftover(&files, a, arch, &|k| taken.contains(k))?;
    let dir = writer.finish(dtype, &settings)?;
    Ok(Converted { dir, arch: Some(arch), what: arch.class().into(), tensors: n, tokenizer: Ok(vec![]), left_out: 0 })
}

/// Refuses a folder with tensors the model does not have: any but those `known` takes, buffers
/// and the FP8 scales of known weights.
fn leftover(files: &HfFiles, a: &ConvertArgs, arch: HfArch, known: &dyn Fn(&str) -> bool) -> anyhow::Result<()> {
    let scales_of_known = |k: &str| k.strip_suffix("_scale_inv").is_some_and(known);
    let mut left: Vec<&str> = files
        .index
        .keys()
        .map(String::as_str)
        .filter(|k| !known(k) && !hf::is_buffer(k) && !scales_of_known(k))
        .collect();
    if left.is_empty() {
        return Ok(());
    }
    left.sort();
    bail!(
        "--load-dir {}: {} tensor(s) that a {} does not have, e.g. {:?}: not converted (is config.json the one of these weights?)",
        a.load_dir.display(),
        left.len(),
        arch.class(),
        &left[..left.len().min(5)]
    )
}

/// "5GB", "500MB", "200KB" (powers of 1000, as transformers reads them) or bytes.
pub(crate) fn shard_bytes(s: &str) -> anyhow::Result<u64> {
    let t = s.trim().to_ascii_uppercase();
    let (digits, scale) = [("GB", 1_000_000_000u64), ("MB", 1_000_000), ("KB", 1_000), ("B", 1)]
        .iter()
        .find_map(|(u, k)| t.strip_suffix(u).map(|d| (d.trim(), *k)))
        .unwrap_or((t.as_str(), 1));
    match digits.parse::<u64>() {
        Ok(n) if n > 0 => Ok(n * scale),
        _ => bail!("--max-shard-size {s}: give a size such as 5GB, 500MB or a number of bytes"),
    }
}

/// Tensors in order into files of at most `max` bytes each (a larger tensor alone), as
/// transformers shards: returns the index of the file each tensor goes to, and the count.
fn export(load: &Path, save_dir: &Path, max_shard: u64) -> anyhow::Result<Converted> {
    crate::settings::check_dir(load, "--load-dir")?;
    let ck = checkpoint::ParamsSource::open(load)?;
    let c = ck.state.settings.model_config()?;
    let vision = ck.state.settings.vision_spec()?;
    let arch = HfArch::of(&c).context("--saver hf")?;
    let arch = match &vision {
        Some(_) if arch != HfArch::Llama => {
            bail!("--saver hf: a LLaVA model converts with a Llama language model, not a {}", arch.class())
        }
        Some(_) => HfArch::Llava,
        None => arch,
    };
    let (dtype, dtype_name) = match ck.state.params_dtype.as_str() {
        "bf16" => (DType::BF16, "bfloat16"),
        _ => (DType::F32, "float32"),
    };
    if save_dir.join("config.json").exists() || save_dir.join("model.safetensors.index.json").exists() {
        bail!("--save-dir {}: holds a model already; pick a new folder (nothing was written)", save_dir.display());
    }
    let made_dir = !save_dir.exists();
    std::fs::create_dir_all(save_dir)
        .with_context(|| format!("--save-dir {}: cannot create the folder", save_dir.display()))?;
    let mut files = WeightFiles::new(save_dir, dtype, max_shard);
    // Read one tensor at a time from the checkpoint's files, written as the export makes them.
    let read_failed = std::cell::RefCell::new(None);
    let get = |n: &str| match ck.read(n) {
        Ok(t) => t.map(|(shape, data)| HostTensor::new(shape, data)),
        Err(e) => {
            read_failed.borrow_mut().get_or_insert(e);
            None
        }
    };
    let mut emit = |name: String, t: HostTensor| files.add(name, t);
    let exported = match &vision {
        Some(v) => hf::llava::export(&c, v, &get, &mut emit),
        None => hf::export(arch, &c, &get, &mut emit),
    };
    let written = match (read_failed.into_inner(), exported) {
        (Some(e), _) => Err(e),
        (None, Err(e)) => Err(e.into()),
        (None, Ok(())) => files.finish(),
    };
    let tensors = match written {
        Ok(w) => w,
        Err(e) => {
            drop(files); // removes the files written so far
            if made_dir {
                let _ = std::fs::remove_dir(save_dir); // only if empty
            }
            return Err(e);
        }
    };
    let config = match &vision {
        Some(v) => hf::llava::to_config(&c, v, dtype_name),
        None => hf::to_hf_config(arch, &c, dtype_name),
    };
    let config = serde_json::to_string_pretty(&config)?;
    let tmp = save_dir.join(".config.json.tmp");
    std::fs::write(&tmp, config + "\n").with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, save_dir.join("config.json"))?;
    let tokenizer = copy_tokenizer(&ck.state.settings, save_dir)?;
    // DeepSeek-V3's folders keep the depths as the layers after the decoder's; others have none.
    let left_out = match hf::mtp_probe(arch, &c) {
        Some(_) => 0,
        None => ck.names().iter().filter(|n| n.starts_with("mtp.")).count(),
    };
    Ok(Converted {
        dir: save_dir.to_path_buf(),
        arch: Some(arch),
        what: arch.class().into(),
        tensors,
        tokenizer,
        left_out,
    })
}

/// An export's weights files, filled in order as the tensors come: a file is closed when the
/// next tensor would take it past `max` bytes (one tensor alone may exceed it), as
/// transformers' save_pretrained splits; the files get their final names, and the index its
/// weight map, once their number is known.
struct WeightFiles {
    dir: PathBuf,
    dtype: DType,
    max: u64,
    /// The open file's tensors, encoded.
    open: Vec<(String, Vec<usize>, Vec<u8>, safetensors::Dtype)>,
    used: u64,
    /// Each closed file's temporary name, and each tensor's file and size.
    closed: Vec<PathBuf>,
    placed: Vec<(String, usize, u64)>,
    failed: Option<anyhow::Error>,
}

impl WeightFiles {
    fn new(dir: &Path, dtype: DType, max: u64) -> WeightFiles {
        let dir = dir.to_path_buf();
        WeightFiles { dir, dtype, max, open: vec![], used: 0, closed: vec![], placed: vec![], failed: None }
    }

    fn add(&mut self, name: String, t: HostTensor) {
        if self.failed.is_some() {
            return;
        }
        if let Err(e) = self.try_add(name, t) {
            self.failed = Some(e);
        }
    }

    fn try_add(&mut self, name: String, t: HostTensor) -> anyhow::Result<()> {
        let (bytes, st) = ferrotron_checkpoint::encode(&name, self.dtype, &t.data)?;
        let b = bytes.len() as u64;
        if self.used > 0 && self.used + b > self.max {
            self.close()?;
        }
        self.used += b;
        self.placed.push((name.clone(), self.closed.len(), b));
        self.open.push((name, t.shape, bytes.into_owned(), st));
        Ok(())
    }

    /// Writes the open file under a temporary name.
    fn close(&mut self) -> anyhow::Result<()> {
        let views = self
            .open
            .iter()
            .map(|(name, shape, b, d)| Ok((name.as_str(), safetensors::tensor::TensorView::new(*d, shape.clone(), b)?)))
            .collect::<anyhow::Result<Vec<_>>>()?;
        // transformers reads only files that say which framework wrote them.
        let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
        let tmp = self.dir.join(format!(".model-part-{:05}.tmp", self.closed.len()));
        safetensors::serialize_to_file(views, Some(meta), &tmp)
            .with_context(|| format!("cannot write {}", tmp.display()))?;
        self.closed.push(tmp);
        self.open.clear();
        self.used = 0;
        Ok(())
    }

    /// The last file written, every file renamed into place, the index where there are several:
    /// the tensors' count.
    fn finish(&mut self) -> anyhow::Result<usize> {
        if let Some(e) = self.failed.take() {
            return Err(e);
        }
        if !self.open.is_empty() || self.closed.is_empty() {
            self.close()?;
        }
        let files = self.closed.len();
        let file_name = |i: usize| {
            if files == 1 {
                "model.safetensors".to_string()
            } else {
                format!("model-{:05}-of-{files:05}.safetensors", i + 1)
            }
        };
        for (i, tmp) in std::mem::take(&mut self.closed).into_iter().enumerate() {
            std::fs::rename(&tmp, self.dir.join(file_name(i)))?;
        }
        if files > 1 {
            let weight_map: serde_json::Map<String, serde_json::Value> =
                self.placed.iter().map(|(n, f, _)| (n.clone(), file_name(*f).into())).collect();
            let index = serde_json::json!({
                "metadata": { "total_size": self.placed.iter().map(|p| p.2).sum::<u64>() },
                "weight_map": weight_map,
            });
            let tmp = self.dir.join(".model.safetensors.index.json.tmp");
            std::fs::write(&tmp, serde_json::to_string_pretty(&index)? + "\n")
                .with_context(|| format!("cannot write {}", tmp.display()))?;
            std::fs::rename(&tmp, self.dir.join("model.safetensors.index.json"))?;
        }
        Ok(self.placed.len())
    }
}

/// An export that failed part-way (or never finished) leaves none of its files: `finish` takes
/// the closed ones as it renames them into place, so this removes only what it did not.
impl Drop for WeightFiles {
    fn drop(&mut self) {
        for tmp in self.closed.drain(..) {
            let _ = std::fs::remove_file(tmp);
        }
    }
}

/// The run's transformers tokenizer files into `save_dir`, so the export loads with
/// `AutoTokenizer` too; Err says why nothing was copied (another tokenizer, a folder gone).
fn copy_tokenizer(s: &Settings, save_dir: &Path) -> anyhow::Result<Result<Vec<&'static str>, String>> {
    let Some(src) = s.tokenizer_model.as_ref().filter(|_| s.tokenizer_type == "HuggingFaceTokenizer") else {
        return Ok(Err(format!("the run's tokenizer is {}, not a transformers folder", s.tokenizer_type)));
    };
    if !src.is_dir() {
        return Ok(Err(format!("its folder {} is gone", src.display())));
    }
    let mut copied = vec![];
    for f in TOKENIZER_FILES.into_iter().filter(|f| src.join(f).is_file()) {
        std::fs::copy(src.join(f), save_dir.join(f))
            .with_context(|| format!("copying the tokenizer's {} into {}", f, save_dir.display()))?;
        copied.push(f);
    }
    Ok(Ok(copied))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The files each tensor went to, for f32 tensors of `elems` values under `max` bytes.
    fn placed(elems: &[usize], max: u64) -> (Vec<usize>, usize) {
        let dir = std::env::temp_dir().join(format!("ferrotron-weightfiles-{}-{}", std::process::id(), elems.len()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mut w = WeightFiles::new(&dir, DType::F32, max);
        for (i, &n) in elems.iter().enumerate() {
            w.add(format!("t{i}"), HostTensor::new(vec![n], vec![i as f32; n]));
        }
        let files = w.placed.iter().map(|p| p.1 + 1).max().unwrap_or(1);
        let plan = w.placed.iter().map(|p| p.1).collect();
        assert_eq!(w.finish().unwrap(), elems.len());
        let _ = std::fs::remove_dir_all(&dir);
        (plan, files)
    }

    #[test]
    fn shards_fill_in_order_up_to_the_size() {
        // Bytes = 4 × elements: a file closes when the next tensor would take it past the size.
        assert_eq!(placed(&[6, 6, 2, 6, 2, 2], 40), (vec![0, 1, 1, 2, 2, 2], 3));
        assert_eq!(placed(&[12, 1], 40), (vec![0, 1], 2), "a tensor above the size goes alone");
        assert_eq!(placed(&[3, 3], 40), (vec![0, 0], 1));
        assert_eq!(shard_bytes("5GB").unwrap(), 5_000_000_000);
        assert_eq!((shard_bytes("200kb").unwrap(), shard_bytes("1234").unwrap()), (200_000, 1234));
        for bad in ["", "GB", "0", "-1MB", "5 TB"] {
            assert!(shard_bytes(bad).is_err(), "{bad}");
        }
    }
}
