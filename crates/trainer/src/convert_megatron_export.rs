//! `ferrotron convert --loader ferrotron --saver megatron`: a Ferrotron checkpoint into a
//! Megatron-LM `--save` folder in torch_dist, Megatron's default format, which it loads under
//! any parallel layout. The way back of `convert_megatron.rs`, through the same name table:
//! each parameter is one chunk of the tensor megatron-core saves it in (a stack over layers,
//! and experts, unless the layers differ; a Mamba hybrid's layers each under its number, its
//! mixers' in_proj and convolution in parts), with Transformer Engine's norm names, the vocabulary
//! padded as Megatron pads it, and each linear layer's (empty) `_extra_state` object, so the
//! folder holds what megatron-core's own save of the model holds.
//!
//! Model weights only, as Megatron's tools/checkpoint writes them: the recorded run says
//! `no_save_optim` and `no_save_rng`, so Megatron's `--load` takes the weights and starts its
//! optimizer afresh. The run's arguments are the model's flags under Megatron's names, for
//! `--use-checkpoint-args`.

use crate::checkpoint;
use crate::convert::{ConvertArgs, Converted};
use crate::convert_megatron::{COPIED, MAMBA, MOE, expert_of, model_tensors, parts_of};
use crate::settings::{Settings, TrainArgs};
use anyhow::{Context, bail};
use ferrotron_checkpoint::megatron::{MegatronSave, Py, TorchDtype};
use serde_json::Value;

/// `Py` of a JSON value of the run's flags (objects have no Namespace form: none).
fn py_of(v: &Value) -> Option<Py> {
    Some(match v {
        Value::Null => Py::None,
        Value::Bool(b) => Py::Bool(*b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => Py::Int(i),
            None => Py::Float(n.as_f64()?),
        },
        Value::String(s) => Py::Str(s.clone()),
        Value::Array(a) => Py::List(a.iter().filter_map(py_of).collect()),
        Value::Object(_) => return None,
    })
}

/// `--moe-layer-freq` as Megatron records it: the int, or the list its expression evaluates to.
fn layer_freq(s: &str, layers: usize) -> anyhow::Result<Py> {
    if let Ok(n) = s.trim().parse::<i64>() {
        return Ok(Py::Int(n));
    }
    let pattern = crate::layer_freq::parse(s, layers)?;
    Ok(Py::List(pattern.iter().map(|&moe| Py::Int(moe as i64)).collect()))
}

/// An argparse Namespace being filled: its attributes in the order set, a later set replacing.
struct Namespace(Vec<(String, Py)>);

impl Namespace {
    fn set(&mut self, k: &str, v: Py) {
        match self.0.iter_mut().find(|(n, _)| n == k) {
            Some(slot) => slot.1 = v,
            None => self.0.push((k.to_string(), v)),
        }
    }
    fn into_py(self) -> Py {
        Py::instance("argparse", "Namespace", Py::Dict(self.0.into_iter().map(|(k, v)| (Py::Str(k), v)).collect()))
    }
}

/// What the export knows of the model and the folder it writes.
struct Layout {
    /// Padded vocabulary rows (Megatron's padding for the target tensor-parallel size).
    padded_vocab: usize,
    tp: usize,
    dtype: TorchDtype,
    /// Layers stacked along a first dim (megatron-core's default), else each under its number
    /// (its "non-homogeneous" layers: MoE in some layers only).
    stacked: bool,
    layers: usize,
    experts: usize,
    /// Transformer Engine's names (Megatron-LM's default --transformer-impl), else megatron-core's
    /// local spec's: they differ in MoE layers' pre-MLP norm and in multi-latent attention's
    /// norms (`fused_norm`).
    te: bool,
    /// Multi-latent attention, whose layers' norms megatron-core names its own way.
    mla: bool,
    /// A Mamba hybrid's mixer sizes: its layers each under its number (megatron-core's MambaStack
    /// stacks none), Transformer Engine's names (its one spec), the mixers' in_proj and
    /// convolution in parts.
    mamba: Option<ferrotron_ssm::MambaDims>,
}

/// The run's arguments as Megatron-LM records them: the model flags `m` by their names (its
/// own where Ferrotron spells a flag as what it turns off), and what Megatron derives from them.
fn namespace(m: &TrainArgs, s: &Settings, l: &Layout, vocab: usize, samples: [u64; 2]) -> anyhow::Result<Py> {
    let mut ns = Namespace(vec![]);
    let Value::Object(flags) = serde_json::to_value(m)? else { bail!("the model's flags are not a record") };
    for (k, v) in &flags {
        let k = k.replace('-', "_");
        // The fields the import reads are recorded set or not (None, False), as Megatron records
        // every flag; others only where set.
        let read = [&COPIED[..], &MOE].iter().any(|f| f.contains(&k.as_str()))
            || (l.mamba.is_some() && MAMBA.contains(&k.as_str()));
        if !read && matches!(v, Value::Null | Value::Bool(false)) {
            continue;
        }
        match k.as_str() {
            "disable_bias_linear" | "no_bias_gelu_fusion" | "mamba_norm_ungrouped" => {}
            // megatron-core 0.16's name (later ones read it too); one stage: no '|' marks.
            "hybrid_layer_pattern" => {
                let p: String = v.as_str().unwrap_or_default().chars().filter(|c| *c != '|').collect();
                ns.set("hybrid_override_pattern", Py::Str(p));
            }
            // Megatron's is a tuple (left, right); the flag's spelling "(left,right)".
            "window_size" => {
                let text = v.as_str().unwrap_or_default();
                let ints: Option<Vec<i64>> =
                    text.trim_matches(|c| c == '(' || c == ')').split(',').map(|x| x.trim().parse().ok()).collect();
                let ints = ints.with_context(|| format!("--window-size {text}: not (left,right)"))?;
                ns.set(&k, Py::Tuple(ints.into_iter().map(Py::Int).collect()));
            }
            // Megatron's default is 0.0, not None.
            "glu_linear_offset" => ns.set(&k, Py::Float(v.as_f64().unwrap_or(0.0))),
            "moe_layer_freq" | "window_attn_skip_freq" => {
                ns.set(&k, layer_freq(v.as_str().unwrap_or_default(), s.num_layers)?)
            }
            // Megatron's is an int.
            "rotary_base" => match v.as_f64() {
                Some(b) if b.fract() == 0.0 => ns.set(&k, Py::Int(b as i64)),
                _ => ns.set(&k, py_of(v).unwrap_or(Py::None)),
            },
            _ => {
                if let Some(p) = py_of(v) {
                    ns.set(&k, p);
                }
            }
        }
    }
    // Flags Ferrotron spells as what they turn off, as Megatron records them.
    let on = |flag: &str| flags.get(flag) == Some(&Value::Bool(true));
    ns.set("add_bias_linear", Py::Bool(!on("disable-bias-linear")));
    // Megatron fuses no bias with the gated quick GeLU outside its experts' weighted path (its
    // gpt-oss script passes --no-bias-gelu-fusion).
    ns.set("bias_gelu_fusion", Py::Bool(!on("no-bias-gelu-fusion") && !on("quick-geglu")));
    let heads = s.num_attention_heads;
    ns.set("group_query_attention", Py::Bool(s.num_query_groups != heads));
    ns.set("num_query_groups", Py::Int(s.num_query_groups as i64));
    ns.set("kv_channels", Py::Int(s.kv_channels.unwrap_or(s.hidden_size / heads.max(1)) as i64));
    // Megatron's tokenizers: its GPT-2 BPE reads --vocab-file and --merge-file; bytes have no
    // tokenizer there: NullTokenizer over the same 256 ids (its end of document is 255, the byte
    // tokenizer's 0).
    match s.tokenizer_type.as_str() {
        "gpt2" => ns.set("tokenizer_type", Py::Str("GPT2BPETokenizer".into())),
        "byte" => {
            ns.set("tokenizer_type", Py::Str("NullTokenizer".into()));
            ns.set("vocab_size", Py::Int(vocab as i64 - 1));
        }
        _ => {}
    }
    ns.set("padded_vocab_size", Py::Int(l.padded_vocab as i64));
    // On whatever the run's flags said of it: Megatron's RoPE runs keep the default, and a
    // Megatron run compares its own (True unless --no-position-embedding) with this one.
    ns.set("add_position_embedding", Py::Bool(true));
    // Megatron-LM builds a hybrid from the pattern with its one Mamba spec (pretrain_mamba.py's
    // --spec); the ratios are what the pattern replaces.
    if l.mamba.is_some() {
        ns.set("is_hybrid_model", Py::Bool(true));
        ns.set("hybrid_attention_ratio", Py::Float(0.0));
        ns.set("hybrid_mlp_ratio", Py::Float(0.0));
        let spec = ["megatron.core.models.mamba.mamba_layer_specs", "mamba_stack_spec"];
        ns.set("spec", Py::List(spec.iter().map(|x| Py::Str(x.to_string())).collect()));
    }
    // Megatron's multi-latent attention normalises its latents under --qk-layernorm, as here.
    if m.multi_latent_attention {
        ns.set("qk_layernorm", Py::Bool(true));
    }
    ns.set("bf16", Py::Bool(l.dtype == TorchDtype::BF16));
    ns.set("fp16", Py::Bool(false));
    ns.set("params_dtype", Py::Global("torch".into(), l.dtype.torch_name().into()));
    ns.set("tensor_model_parallel_size", Py::Int(l.tp as i64));
    ns.set("pipeline_model_parallel_size", Py::Int(1));
    ns.set("ckpt_format", Py::Str("torch_dist".into()));
    ns.set("transformer_impl", Py::Str(if l.te { "transformer_engine" } else { "local" }.into()));
    ns.set("no_save_optim", Py::Bool(true));
    ns.set("no_save_rng", Py::Bool(true));
    ns.set("consumed_train_samples", Py::Int(samples[0] as i64));
    ns.set("consumed_valid_samples", Py::Int(samples[1] as i64));
    Ok(ns.into_py())
}

/// Why the model has no Megatron form here, if it has none: a Mamba gated norm over every group
/// (Megatron's normalises each apart), a vision encoder (LLaVA's Megatron tensors are not read
/// either).
fn unwritten(m: &TrainArgs, s: &Settings) -> Option<String> {
    if m.mamba_norm_ungrouped {
        return Some("--mamba-norm-ungrouped makes Mamba layers whose gated norm spans every group (transformers' Mamba2; Megatron's mixer normalises each group apart)".into());
    }
    s.vision.is_some().then(|| "it is a LLaVA-style model (a vision encoder)".into())
}

/// The name a layer's norm is saved under: megatron-core fuses some into the linear layer after
/// them (Transformer Engine's modules; its local spec renames to match), which differs by
/// `--transformer-impl` in MoE layers and by attention kind. `tail`: the name within the layer.
fn fused_norm(tail: &str, l: &Layout, moe: bool) -> Option<String> {
    let (norm, w) = tail.rsplit_once('.')?;
    let fused = match norm {
        // Grouped-query attention's fused QKV; multi-latent attention has none (its own norm).
        "input_layernorm" if !l.mla => "self_attention.linear_qkv",
        // Transformer Engine keeps an MoE layer's apart; the local spec files every layer's
        // under fc1, but not with multi-latent attention (its spec renames nothing).
        "pre_mlp_layernorm" if (l.te && !moe) || (!l.te && !l.mla) => "mlp.linear_fc1",
        // Multi-latent attention's latent norms, fused into the up-projections under TE.
        "self_attention.q_layernorm" if l.mla && l.te => "self_attention.linear_q_up_proj",
        "self_attention.kv_layernorm" if l.mla && l.te => "self_attention.linear_kv_up_proj",
        // A Mamba layer's, fused into the mixer's input projection (TE's; its only spec).
        "norm" if l.mamba.is_some() => "mixer.in_proj",
        _ => return None,
    };
    Some(format!("{fused}.layer_norm_{w}"))
}

/// The Megatron key of Ferrotron parameter `name` and its slice of it: layers stacked along a
/// first dim (and experts along a second) where `l.stacked`, else each layer under its number;
/// norms under their fused names (`fused_norm`). `moe_layers`: the name prefixes
/// (`decoder.layers.3.`) of the layers with experts.
fn megatron_key(name: &str, l: &Layout, moe_layers: &[String]) -> (String, Vec<usize>) {
    let moe = moe_layers.iter().any(|p| name.starts_with(p.as_str()));
    // A multi-token prediction depth's layer: under its own number, experts stacked alone.
    if let Some((depth, tail)) = name.split_once(".transformer_layer.").filter(|(d, _)| d.starts_with("mtp.layers.")) {
        let prefix = format!("{depth}.transformer_layer.");
        if let Some((e, t)) = expert_of(tail) {
            return (format!("{prefix}mlp.experts.experts.{t}"), vec![e]);
        }
        return (format!("{prefix}{}", fused_norm(tail, l, moe).unwrap_or_else(|| tail.to_string())), vec![]);
    }
    let Some((layer, tail)) = name
        .strip_prefix("decoder.layers.")
        .and_then(|r| r.split_once('.'))
        .and_then(|(i, t)| Some((i.parse::<usize>().ok()?, t)))
    else {
        return (name.to_string(), vec![]);
    };
    if let Some((e, t)) = expert_of(tail) {
        return match l.stacked {
            true => (format!("decoder.layers.mlp.experts.experts.{t}"), vec![layer, e]),
            false => (format!("decoder.layers.{layer}.mlp.experts.experts.{t}"), vec![e]),
        };
    }
    let tail = fused_norm(tail, l, moe).unwrap_or_else(|| tail.to_string());
    match l.stacked {
        true => (format!("decoder.layers.{tail}"), vec![layer]),
        false => (format!("decoder.layers.{layer}.{tail}"), vec![]),
    }
}

/// The shape of the leading dims `lead` of a stacked tensor indexes: layers, experts, or both.
fn lead_shape(l: &Layout, name: &str, lead: usize) -> Vec<usize> {
    let expert = name.contains(".mlp.experts.local_experts.");
    match (lead, expert) {
        (0, _) => vec![],
        (1, true) => vec![l.experts],
        (1, false) => vec![l.layers],
        _ => vec![l.layers, l.experts],
    }
}

/// The Megatron key of a linear layer's `_extra_state` object for weight `key` at `lead` of
/// `lead_shape` (megatron-core keys a sharded object by its offset and shape: `shard_1.3_2.4`;
/// a tensor of no stack by `shard_0_1`), or none for a tensor of no linear layer.
fn extra_state_key(key: &str, lead: &[usize], lead_shape: &[usize]) -> Option<String> {
    let module = key.strip_suffix(".weight")?;
    let last = module.rsplit('.').next()?;
    // The linear layers (and multi-token prediction's projection of the two inputs, a Mamba
    // mixer's projections).
    let mixer = module.ends_with(".mixer.in_proj") || module.ends_with(".mixer.out_proj");
    if !(key.starts_with("decoder.") || key.starts_with("mtp."))
        || !(last.starts_with("linear_") || last == "eh_proj" || mixer)
    {
        return None;
    }
    let join = |v: &[usize]| v.iter().map(usize::to_string).collect::<Vec<_>>().join(".");
    let (o, s) = if lead.is_empty() { ("0".into(), "1".into()) } else { (join(lead), join(lead_shape)) };
    Some(format!("{module}._extra_state/shard_{o}_{s}"))
}

/// Rows of each part `parts_of` names for a mixer's tensor `name` (z | x | B | C | dt of in_proj,
/// x | B | C of the convolution).
fn part_rows(name: &str, d: &ferrotron_ssm::MambaDims) -> Vec<usize> {
    let gn = d.groups * d.state;
    match name.ends_with(".in_proj.weight") {
        true => vec![d.d_inner, d.d_inner, gn, gn, d.heads],
        false => vec![d.d_inner, gn, gn],
    }
}

fn bytes_of(values: &[f32], dtype: TorchDtype) -> Vec<u8> {
    match dtype {
        TorchDtype::BF16 => values.iter().flat_map(|&x| half::bf16::from_f32(x).to_le_bytes()).collect(),
        _ => values.iter().flat_map(|&x| x.to_le_bytes()).collect(),
    }
}

pub(crate) fn export(a: &ConvertArgs) -> anyhow::Result<Converted> {
    crate::settings::check_dir(&a.load_dir, "--load-dir")?;
    let ck = checkpoint::ParamsSource::open(&a.load_dir)?;
    let s = &ck.state.settings;
    let config = s.model_config()?;
    let m = crate::settings::checkpoint_args(&a.load_dir)?;
    if let Some(why) = unwritten(&m, s) {
        bail!("--saver megatron: {why}, whose Megatron tensors this export does not write yet (nothing was written)");
    }
    let tp = a.target_tensor_parallel_size.unwrap_or(s.tensor_model_parallel_size).max(1);
    config.validate_tp(tp).context("--target-tensor-parallel-size")?;
    let freq = m.moe_layer_freq.as_deref().map(|f| layer_freq(f, config.num_layers)).transpose()?;
    let te = match a.saver_transformer_impl.as_deref() {
        None | Some("transformer_engine") => true,
        Some("local") => false,
        Some(x) => bail!("--saver-transformer-impl {x}: transformer_engine (Megatron-LM's default) or local"),
    };
    let mamba = ferrotron_models::hybrid::mamba_spec(&config)
        .map(|m| m.dims(config.hidden_size))
        .transpose()
        .map_err(anyhow::Error::msg)?;
    if mamba.is_some() && !te {
        bail!(
            "--saver-transformer-impl local: Megatron-LM builds Mamba hybrids with one spec, mamba_stack_spec, under Transformer Engine's names; drop the flag (nothing was written)"
        );
    }
    let l = Layout {
        te,
        mla: m.multi_latent_attention,
        padded_vocab: config.padded_vocab_size(tp),
        tp,
        dtype: if s.bf16 { TorchDtype::BF16 } else { TorchDtype::F32 },
        // megatron-core keys each layer apart where --moe-layer-freq is a list or above 1.
        stacked: mamba.is_none() && !matches!(freq, Some(Py::List(_))) && !matches!(freq, Some(Py::Int(n)) if n > 1),
        mamba,
        layers: config.num_layers,
        experts: m.num_experts.unwrap_or(0),
    };
    let max_file = a
        .max_shard_size
        .as_deref()
        .map(crate::convert::shard_bytes)
        .transpose()?
        .unwrap_or(crate::convert::DEFAULT_SHARD);
    let common = Py::Dict(vec![
        (
            Py::Str("args".into()),
            namespace(&m, s, &l, config.vocab_size, [ck.state.consumed_samples, ck.state.consumed_valid_samples])?,
        ),
        (Py::Str("checkpoint_version".into()), Py::Float(3.0)),
        (Py::Str("iteration".into()), Py::Int(ck.state.iteration as i64)),
        (Py::Str("num_floating_point_operations_so_far".into()), Py::Float(ck.state.floating_point_operations)),
    ]);
    let tensors_of = model_tensors(s, &config)?;
    // Layers with experts (a router): under Transformer Engine their pre-MLP norm stands alone.
    let moe_layers: Vec<String> =
        tensors_of.iter().filter_map(|t| t.name.strip_suffix("mlp.router.weight").map(str::to_string)).collect();
    let mut save = MegatronSave::create(&a.save_dir, ck.state.iteration, max_file)?;
    let extra_state = Py::List(vec![Py::None]);
    let mut tensors = 0;
    for t in tensors_of {
        let (shape, mut values) = ck.read(&t.name)?.with_context(|| {
            format!("--load-dir {}: no tensor `{}` in the checkpoint", a.load_dir.display(), t.name)
        })?;
        if shape != t.shape {
            bail!("--load-dir {}: `{}` is {shape:?}, its model's is {:?}", a.load_dir.display(), t.name, t.shape);
        }
        let (key, lead) = &megatron_key(&t.name, &l, &moe_layers);
        let outer = lead_shape(&l, &t.name, lead.len());
        anyhow::ensure!(outer.len() == lead.len(), "`{}`: {lead:?} is no slice of {outer:?}", t.name);
        let mut sizes = t.shape.clone();
        if t.vocab_rows {
            // Megatron's padding rows, zero.
            sizes[0] = l.padded_vocab;
            values.resize(sizes.iter().product(), 0.0);
        }
        let dtype = if t.fp32 { TorchDtype::F32 } else { l.dtype };
        // A mixer's in_proj and convolution: each part its own tensor, as megatron-core saves them.
        let parts: Vec<(String, usize)> = match (parts_of(&t.name), &l.mamba) {
            (Some(names), Some(d)) => {
                names.iter().zip(part_rows(&t.name, d)).map(|(p, rows)| (format!("{key}.{p}"), rows)).collect()
            }
            _ => vec![(key.clone(), sizes[0])],
        };
        anyhow::ensure!(
            parts.iter().map(|p| p.1).sum::<usize>() == sizes[0],
            "`{}` {sizes:?}: its parts' rows {parts:?} do not add up",
            t.name
        );
        let row: usize = sizes[1..].iter().product();
        let mut from = 0;
        for (k, rows) in parts {
            let mut part = sizes.clone();
            part[0] = rows;
            let global: Vec<usize> = outer.iter().chain(&part).copied().collect();
            let offsets: Vec<usize> = lead.iter().copied().chain(part.iter().map(|_| 0)).collect();
            let chunk: Vec<usize> = lead.iter().map(|_| 1).chain(part.iter().copied()).collect();
            let v = &values[from * row..(from + rows) * row];
            save.dcp().chunk(&k, dtype, &global, &offsets, &chunk, &bytes_of(v, dtype))?;
            from += rows;
        }
        if let Some(k) = extra_state_key(key, lead, &outer) {
            save.dcp().object(&k, &extra_state)?;
        }
        tensors += 1;
    }
    // megatron-core's MambaModel keeps the output layer's (GPTModel drops it), tied or not.
    if l.mamba.is_some() {
        save.dcp().object("output_layer._extra_state/shard_0_1", &extra_state)?;
    }
    let dir = save.finish(&common)?;
    let tokenizer = match s.tokenizer_type.as_str() {
        "gpt2" => Err("Megatron's GPT2BPETokenizer reads the GPT-2 files: pass --vocab-file and --merge-file".into()),
        "byte" => Err(
            "bytes are recorded as NullTokenizer over the same 256 ids; its end of document is 255, the byte tokenizer's 0"
                .into(),
        ),
        _ => Ok(vec![]),
    };
    Ok(Converted { dir, arch: None, what: "Megatron-LM torch_dist checkpoint".into(), tensors, tokenizer, left_out: 0 })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extra_state_keys_are_megatron_cores() {
        let k = |key: &str, lead: &[usize], shape: &[usize]| extra_state_key(key, lead, shape);
        assert_eq!(
            k("decoder.layers.self_attention.linear_qkv.weight", &[1], &[2]).as_deref(),
            Some("decoder.layers.self_attention.linear_qkv._extra_state/shard_1_2")
        );
        assert_eq!(
            k("decoder.layers.mlp.experts.experts.linear_fc2.weight", &[0, 3], &[2, 4]).as_deref(),
            Some("decoder.layers.mlp.experts.experts.linear_fc2._extra_state/shard_0.3_2.4")
        );
        assert_eq!(
            k("decoder.layers.5.mlp.linear_fc1.weight", &[], &[]).as_deref(),
            Some("decoder.layers.5.mlp.linear_fc1._extra_state/shard_0_1")
        );
        assert_eq!(
            k("mtp.layers.0.eh_proj.weight", &[], &[]).as_deref(),
            Some("mtp.layers.0.eh_proj._extra_state/shard_0_1")
        );
        assert_eq!(
            k("mtp.layers.0.transformer_layer.mlp.experts.experts.linear_fc1.weight", &[2], &[4]).as_deref(),
            Some("mtp.layers.0.transformer_layer.mlp.experts.experts.linear_fc1._extra_state/shard_2_4")
        );
        for none in [
            "decoder.layers.mlp.router.weight",
            "decoder.layers.self_attention.linear_qkv.layer_norm_weight",
            "decoder.layers.self_attention.linear_qkv.bias",
            "output_layer.weight",
        ] {
            assert_eq!(k(none, &[0], &[2]), None, "{none}");
        }
    }

    #[test]
    fn layer_freqs_are_recorded_evaluated() {
        assert_eq!(layer_freq("2", 4).unwrap(), Py::Int(2));
        assert_eq!(layer_freq("[0]+[1]*2", 3).unwrap(), Py::List(vec![Py::Int(0), Py::Int(1), Py::Int(1)]));
        assert!(layer_freq("[0,1]", 3).is_err());
    }
}
