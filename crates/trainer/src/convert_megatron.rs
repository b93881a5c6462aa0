//! `ferrotron convert --loader megatron`: a Megatron-LM checkpoint (torch_dist, its default, under
//! any parallel layout; or the legacy torch format, one file a rank) into a Ferrotron checkpoint. The
//! model's flags come from the run's own arguments in the checkpoint (Megatron's argparse
//! Namespace, whose names are the flags Ferrotron reads); the tensors keep their Megatron names,
//! less torch_dist's three changes: a stack of every layer's tensor along a first dim (none in a
//! Mamba hybrid: each layer under its number), Transformer Engine's names for the norms fused
//! into the next linear layer, and a Mamba mixer's in_proj and convolution saved in parts.

use crate::checkpoint;
use crate::convert::{ConvertArgs, Converted};
use crate::settings::{Settings, TrainArgs};
use anyhow::{Context, bail};
use ferrotron_checkpoint::megatron::{MegatronCheckpoint, Py, TpCut};
use ferrotron_core::DType;
use ferrotron_transformer::{GptModel, TransformerConfig};
use serde_json::{Map, Value};
use std::collections::BTreeMap;

/// Namespace fields copied to the flag of the same name where set.
pub(crate) const COPIED: [&str; 37] = [
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "kv_channels",
    "group_query_attention",
    "max_position_embeddings",
    "seq_length",
    "position_embedding_type",
    // Older Megatron-LM's spellings of rotary and no positions.
    "use_rotary_position_embeddings",
    "no_position_embedding",
    "rotary_base",
    "rotary_percent",
    "rotary_interleaved",
    "rotary_seq_len_interpolation_factor",
    "use_rope_scaling",
    "rope_scaling_factor",
    "normalization",
    "norm_epsilon",
    "apply_layernorm_1p",
    "swiglu",
    "squared_relu",
    // gpt-oss's gated quick GeLU and attention sinks.
    "quick_geglu",
    "glu_linear_offset",
    "activation_func_clamp_value",
    "softmax_type",
    "add_qkv_bias",
    "untie_embeddings_and_output_weights",
    "qk_layernorm",
    "make_vocab_size_divisible_by",
    "bf16",
    "init_method_std",
    "hidden_dropout",
    "attention_dropout",
    "openai_gelu",
    "tokenizer_type",
    "vocab_size",
];

/// Mixture-of-experts fields, copied where the run had experts (Megatron records their defaults
/// for every run).
pub(crate) const MOE: [&str; 18] = [
    "num_experts",
    "moe_ffn_hidden_size",
    "moe_router_topk",
    "moe_router_load_balancing_type",
    "moe_aux_loss_coeff",
    "moe_z_loss_coeff",
    "moe_router_pre_softmax",
    "moe_router_topk_scaling_factor",
    "moe_router_score_function",
    "moe_router_num_groups",
    "moe_router_group_topk",
    "moe_router_dtype",
    "moe_router_enable_expert_bias",
    "moe_router_bias_update_rate",
    "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate",
    "moe_expert_capacity_factor",
    "moe_token_drop_policy",
];

/// Multi-latent attention's fields, copied where the run had it; YaRN's only where its rotary
/// features were YaRN's (Megatron records their defaults for every run).
pub(crate) const MLA: [&str; 6] =
    ["q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type"];
pub(crate) const YARN: [&str; 6] = [
    "rotary_scaling_factor",
    "mscale",
    "mscale_all_dim",
    "yarn_beta_fast",
    "yarn_beta_slow",
    "yarn_original_max_position_embeddings",
];

/// Mamba hybrids' Mamba-2 sizes, copied where the run was one (Megatron records their defaults
/// for every run).
pub(crate) const MAMBA: [&str; 4] = ["mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads"];

/// The spec Megatron-LM's Mamba scripts pass (`--spec`), whose model is a hybrid.
const MAMBA_SPEC: &str = "mamba_stack_spec";

/// A Megatron-LM Mamba run's layer pattern, or None for a GPT run: its pattern (the deprecated
/// and the current flag's name), else the layers its ratios place among Mamba ones (none: every
/// layer Mamba), as Megatron's allocation does. `ns`: the run's arguments.
fn hybrid_pattern(ns: &Py, dir: &std::path::Path) -> anyhow::Result<Option<String>> {
    for field in ["hybrid_layer_pattern", "hybrid_override_pattern"] {
        if let Some(p) = ns.get(field).and_then(Py::as_str).filter(|p| !p.is_empty()) {
            return Ok(Some(p.to_string()));
        }
    }
    let spec = match ns.get("spec") {
        Some(Py::List(v) | Py::Tuple(v)) => v.iter().any(|x| x.as_str() == Some(MAMBA_SPEC)),
        _ => false,
    };
    let ratio = |f: &str| match ns.get(f) {
        Some(Py::Float(x)) => *x,
        Some(Py::Int(i)) => *i as f64,
        _ => 0.0,
    };
    let (att, mlp) = (ratio("hybrid_attention_ratio"), ratio("hybrid_mlp_ratio"));
    if !(spec || set(ns.get("is_hybrid_model")) || att > 0.0 || mlp > 0.0) {
        return Ok(None);
    }
    let n = ns
        .get("num_layers")
        .and_then(Py::as_int)
        .with_context(|| format!("{}: a Mamba run without num_layers", dir.display()))?;
    let pattern = ferrotron_models::hybrid::pattern_from_ratios(n as usize, att, mlp)
        .map_err(|e| anyhow::anyhow!("{}: {e}", dir.display()))?;
    Ok(Some(pattern))
}

fn json_of(v: &Py) -> Option<Value> {
    Some(match v {
        Py::Bool(b) => Value::Bool(*b),
        Py::Int(i) => Value::from(*i),
        Py::Float(f) => Value::from(*f),
        Py::Str(s) => Value::String(s.clone()),
        _ => return None,
    })
}

/// Whether a Namespace value means "on" (a flag set, a count above 0, a name).
fn set(v: Option<&Py>) -> bool {
    match v {
        None | Some(Py::None) | Some(Py::Bool(false)) => false,
        Some(Py::Int(i)) => *i != 0,
        Some(Py::Float(f)) => *f != 0.0,
        Some(Py::Str(s)) => !s.is_empty(),
        Some(_) => true,
    }
}

/// A per-layer frequency field of the run's (`moe_layer_freq`, `window_attn_skip_freq`) as its
/// flag spells it: the int, or the list Megatron evaluated from its expression; None if unset.
fn layer_freq_flag(ns: &Py, field: &str, dir: &std::path::Path) -> anyhow::Result<Option<String>> {
    Ok(match ns.get(field) {
        Some(Py::Int(n)) => Some(n.to_string()),
        Some(Py::List(l)) => {
            let v: Option<Vec<String>> = l.iter().map(|x| x.as_int().map(|i| i.to_string())).collect();
            let v = v.with_context(|| format!("{}: {field} {l:?} is not a list of 0s and 1s", dir.display()))?;
            Some(format!("[{}]", v.join(",")))
        }
        _ => None,
    })
}

/// The model's flags from the run's arguments `ns` (of the checkpoint in `dir`), and the
/// tokenizer flags of `a` over the run's.
fn model_args(ns: &Py, ck_dir: &std::path::Path, a: &ConvertArgs) -> anyhow::Result<TrainArgs> {
    let dir = ck_dir.display();
    if ns.class() != Some(("argparse", "Namespace")) {
        bail!("{dir}: the checkpoint's `args` is not Megatron-LM's argparse Namespace");
    }
    let mut m = Map::new();
    let experts = set(ns.get("num_experts"));
    // Megatron records a drop policy whether or not experts have a capacity to drop at.
    let capacity = set(ns.get("moe_expert_capacity_factor"));
    for field in COPIED.iter().chain(if experts { &MOE[..] } else { &[] }) {
        if *field == "moe_token_drop_policy" && !capacity {
            continue;
        }
        let Some(v) = ns.get(field).and_then(json_of) else { continue };
        if v == Value::Bool(false) {
            continue;
        }
        m.insert(field.replace('_', "-"), v);
    }
    if set(ns.get("multi_latent_attention")) {
        // Ferrotron's latents are normalised, as DeepSeek's and Megatron's with --qk-layernorm.
        if !set(ns.get("qk_layernorm")) {
            bail!(
                "{dir}: the run's multi-latent attention has no latent norms (no --qk-layernorm); Ferrotron's normalises its query and key-value latents, as DeepSeek's"
            );
        }
        m.remove("qk-layernorm");
        // Megatron records hidden / heads there for every run; --qk-head-dim and --v-head-dim
        // size these heads.
        m.remove("kv-channels");
        m.insert("multi-latent-attention".into(), Value::Bool(true));
        let yarn = matches!(ns.get("rope_type"), None | Some(Py::None))
            || ns.get("rope_type").and_then(Py::as_str) == Some("yarn");
        for field in MLA.iter().chain(if yarn { &YARN[..] } else { &[] }) {
            if let Some(v) = ns.get(field).and_then(json_of) {
                m.insert(field.replace('_', "-"), v);
            }
        }
    }
    // A Mamba hybrid: its pattern and Mamba-2 sizes (Megatron's mixer normalises per group, as
    // Ferrotron's by default).
    if let Some(pattern) = hybrid_pattern(ns, ck_dir)? {
        m.insert("hybrid-layer-pattern".into(), Value::String(pattern));
        for field in MAMBA {
            if let Some(v) = ns.get(field).and_then(json_of) {
                m.insert(field.replace('_', "-"), v);
            }
        }
    }
    // Sliding windows: Megatron's (left, right) tuple, Ferrotron's flag's spelling; the layers
    // they apply in.
    match ns.get("window_size") {
        None | Some(Py::None) => {}
        Some(w) => {
            let Some([l, r]) = w.as_ints().and_then(|v| <[i64; 2]>::try_from(v).ok()) else {
                bail!("{dir}: window_size {w:?} is not Megatron's (left, right)");
            };
            m.insert("window-size".into(), Value::String(format!("({l},{r})")));
            if let Some(f) = layer_freq_flag(ns, "window_attn_skip_freq", ck_dir)? {
                m.insert("window-attn-skip-freq".into(), Value::String(f));
            }
        }
    }
    // Multi-token prediction (Megatron records a loss scale for every run).
    if set(ns.get("mtp_num_layers")) {
        for field in ["mtp_num_layers", "mtp_loss_scaling_factor"] {
            if let Some(v) = ns.get(field).and_then(json_of) {
                m.insert(field.replace('_', "-"), v);
            }
        }
    }
    // A hybrid's expert layers are its pattern's `E`s (Megatron records a layer frequency anyway).
    if experts && !m.contains_key("hybrid-layer-pattern") {
        if set(ns.get("moe_pad_expert_input_to_capacity")) {
            m.insert("moe-pad-expert-input-to-capacity".into(), Value::Bool(true));
        }
        if let Some(f) = layer_freq_flag(ns, "moe_layer_freq", ck_dir)? {
            m.insert("moe-layer-freq".into(), Value::String(f));
        }
    }
    // Older Megatron-LM spelled the norm's epsilon after LayerNorm.
    if !m.contains_key("norm-epsilon")
        && let Some(v) = ns.get("layernorm_epsilon").and_then(json_of)
    {
        m.insert("norm-epsilon".into(), v);
    }
    if set(ns.get("group_query_attention"))
        && let Some(v) = ns.get("num_query_groups").and_then(json_of)
    {
        m.insert("num-query-groups".into(), v);
    }
    // Flags Megatron stores as what they turn off.
    if matches!(ns.get("add_bias_linear"), Some(Py::Bool(false))) {
        m.insert("disable-bias-linear".into(), Value::Bool(true));
    }
    if matches!(ns.get("bias_gelu_fusion"), Some(Py::Bool(false))) {
        m.insert("no-bias-gelu-fusion".into(), Value::Bool(true));
    }
    // The tokenizer's files where they are here (absolute: the checkpoint's settings are read
    // from anywhere later); the command line's tokenizer over the run's.
    for field in ["vocab_file", "merge_file", "tokenizer_model"] {
        if let Some(p) = ns.get(field).and_then(Py::as_str).and_then(|p| std::fs::canonicalize(p).ok()) {
            m.insert(field.replace('_', "-"), Value::String(p.to_string_lossy().into_owned()));
        }
    }
    let mut args: TrainArgs = serde_json::from_value(Value::Object(m))
        .with_context(|| format!("{dir}: the run's arguments do not make Ferrotron flags"))?;
    if a.tokenizer_type.is_some() {
        args.tokenizer_type = a.tokenizer_type.clone();
        args.vocab_size = a.vocab_size;
        args.tokenizer_model = a.tokenizer_model.clone();
        args.vocab_file = None;
        args.merge_file = None;
    }
    if let Some(s) = a.seq_length {
        args.seq_length = Some(s);
    }
    Ok(args)
}

/// Where a Ferrotron parameter is in a Megatron checkpoint: each (name, leading indices) tried
/// in order (the indices pick a layer, and a layer's expert, out of a torch_dist stack).
pub(crate) fn sources(name: &str) -> Vec<(String, Vec<usize>)> {
    let whole = || vec![(name.to_string(), vec![])];
    // A multi-token prediction depth's layer: never stacked, its experts stacked alone.
    if let Some((depth, tail)) = name.split_once(".transformer_layer.").filter(|(d, _)| d.starts_with("mtp.layers.")) {
        let prefix = format!("{depth}.transformer_layer.");
        if let Some((e, t)) = expert_of(tail) {
            return vec![(format!("{prefix}mlp.experts.experts.{t}"), vec![e]), (name.to_string(), vec![])];
        }
        let te = te_norm_name(tail).map(|t| (format!("{prefix}{t}"), vec![]));
        return te.into_iter().chain(whole()).collect();
    }
    let Some(rest) = name.strip_prefix("decoder.layers.") else { return whole() };
    let Some((layer, tail)) = rest.split_once('.') else { return whole() };
    let Ok(layer) = layer.parse::<usize>() else { return whole() };
    // An expert's tensor: stacked over layers and experts, over experts alone (layers that
    // differ), one tensor each (legacy), or Transformer Engine's grouped GEMM's `weightE`.
    if let Some((e, t)) = expert_of(tail) {
        let mut out = vec![
            (format!("decoder.layers.mlp.experts.experts.{t}"), vec![layer, e]),
            (format!("decoder.layers.{layer}.mlp.experts.experts.{t}"), vec![e]),
            (name.to_string(), vec![]),
        ];
        if let Some(fc) = t.strip_suffix(".weight") {
            out.push((format!("decoder.layers.{layer}.mlp.experts.{fc}.weight{e}"), vec![]));
        }
        return out;
    }
    let te = te_norm_name(tail);
    let mut out = vec![];
    for t in te.into_iter().chain([tail]) {
        out.push((format!("decoder.layers.{t}"), vec![layer]));
        out.push((format!("decoder.layers.{layer}.{t}"), vec![]));
    }
    out
}

/// The parts megatron-core's torch_dist saves a Mamba mixer's tensor in, each its own tensor
/// (`….in_proj.weight.z`), joined along the first dim in this order; None for a tensor saved
/// whole. (Its legacy format saves each whole.)
pub(crate) fn parts_of(name: &str) -> Option<&'static [&'static str]> {
    if name.ends_with(".mixer.in_proj.weight") {
        Some(&["z", "x", "B", "C", "dt"])
    } else if name.ends_with(".mixer.conv1d.weight") || name.ends_with(".mixer.conv1d.bias") {
        Some(&["x", "B", "C"])
    } else {
        None
    }
}

/// A layer's expert tensor's expert and name within the expert (`mlp.experts.local_experts.E.T`).
pub(crate) fn expert_of(tail: &str) -> Option<(usize, &str)> {
    let (e, t) = tail.strip_prefix("mlp.experts.local_experts.")?.split_once('.')?;
    Some((e.parse().ok()?, t))
}

/// Transformer Engine's name for a layer's norm fused with the linear layer after it (the norm's
/// weights under the linear layer), where it has one.
fn te_norm_name(tail: &str) -> Option<&'static str> {
    Some(match tail {
        "input_layernorm.weight" => "self_attention.linear_qkv.layer_norm_weight",
        "input_layernorm.bias" => "self_attention.linear_qkv.layer_norm_bias",
        "pre_mlp_layernorm.weight" => "mlp.linear_fc1.layer_norm_weight",
        "pre_mlp_layernorm.bias" => "mlp.linear_fc1.layer_norm_bias",
        // A Mamba layer's, fused into the mixer's input projection.
        "norm.weight" => "mixer.in_proj.layer_norm_weight",
        "norm.bias" => "mixer.in_proj.layer_norm_bias",
        // Multi-latent attention's latent norms, fused into the up-projections.
        "self_attention.q_layernorm.weight" => "self_attention.linear_q_up_proj.layer_norm_weight",
        "self_attention.kv_layernorm.weight" => "self_attention.linear_kv_up_proj.layer_norm_weight",
        _ => return None,
    })
}

/// Whether a torch_dist or legacy key is the model's (not the optimizer's, the RNG's, or
/// Transformer Engine's extra state).
fn is_model_tensor(k: &str) -> bool {
    !k.contains("_extra_state")
        && ["embedding.", "decoder.", "output_layer.", "mtp.", "vision_model.", "encoder."]
            .iter()
            .any(|p| k.starts_with(p))
}

/// What of the checkpoint's model the import did not take, if anything: a tensor the model has
/// no place for (a part the flags did not build), or a stack with more layers or experts than
/// the model took. `taken`: each key read, with its leading dims indexed and the slices read.
fn untaken(shapes: &BTreeMap<String, Vec<usize>>, taken: &BTreeMap<String, (usize, usize)>) -> Option<String> {
    for (k, shape) in shapes.iter().filter(|(k, _)| is_model_tensor(k)) {
        match taken.get(k) {
            None => {
                return Some(format!(
                    "the checkpoint has `{k}`, which the model its arguments describe has no place for"
                ));
            }
            Some(&(lead, n)) => {
                let slices: usize = shape[..lead].iter().product();
                if n != slices {
                    return Some(format!(
                        "`{k}` {shape:?} holds {slices} slices along its first {lead} dims but the model its arguments describe took {n}"
                    ));
                }
            }
        }
    }
    None
}

/// A tensor of the model in a checkpoint: its Ferrotron name and whole shape (vocabulary rows
/// unpadded), whether its first dim is the vocabulary's, and whether it stays fp32 whatever the
/// parameters' type (the routers' expert biases: buffers).
pub(crate) struct ModelTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub vocab_rows: bool,
    pub fp32: bool,
    /// Its tensor-parallel cut (dim and blocks), to join a legacy checkpoint's rank parts.
    pub cut: Option<TpCut>,
}

/// The tensors of the model `settings` describe (`config` its model), in parameter order, the
/// routers' expert biases after them: what an import fills and an export writes.
pub(crate) fn model_tensors(settings: &Settings, config: &TransformerConfig) -> anyhow::Result<Vec<ModelTensor>> {
    let metas = GptModel::param_metas(config.clone(), None)?;
    let mut out = vec![];
    for meta in &metas {
        let mut shape = meta.global_shape.dims().to_vec();
        let vocab_rows = meta.name.ends_with("word_embeddings.weight") || meta.name == "output_layer.weight";
        if vocab_rows {
            shape[0] = config.vocab_size;
        }
        let cut = meta.split_dim.map(|d| (d, meta.shard.blocks));
        out.push(ModelTensor { name: meta.name.clone(), shape, vocab_rows, fp32: false, cut });
    }
    // DeepSeek-V3's routers keep a bias per expert beside their parameters.
    if settings.moe.as_ref().is_some_and(|m| m.moe_router_bias_update_rate.is_some()) {
        for meta in metas.iter().filter(|m| m.name.ends_with(".mlp.router.weight")) {
            let name = meta.name.replace(".mlp.router.weight", ".mlp.router.expert_bias");
            out.push(ModelTensor {
                name,
                shape: meta.global_shape.dims()[..1].to_vec(),
                vocab_rows: false,
                fp32: true,
                cut: None,
            });
        }
    }
    Ok(out)
}

pub(crate) fn import(a: &ConvertArgs) -> anyhow::Result<Converted> {
    let mut ck = MegatronCheckpoint::open(&a.load_dir)?;
    let mut args = model_args(&ck.args, &ck.dir, a)?;
    // No data is read here; a NullTokenizer run's would be ids already (Megatron's mock data
    // stands in for them while resolving, and is not recorded).
    args.mock_data = true;
    let (mut settings, _) =
        Settings::resolve(&args).context("the model the Megatron checkpoint's arguments describe")?;
    settings.mock_data = false;
    settings.preset = format!("megatron:{}", ck.format);
    let config = settings.model_config()?;
    let vocab = config.vocab_size;
    if let Some(p) = ck.args.get("padded_vocab_size").and_then(Py::as_int)
        && (p as usize) < vocab
    {
        bail!(
            "--tokenizer-type {} has {vocab} ids but the checkpoint's embedding has {p} rows: name the tokenizer of the model's ids (--tokenizer-type with its files, or NullTokenizer with --vocab-size)",
            settings.tokenizer_type
        );
    }
    let shapes = ck.shapes();
    let dtype = if settings.bf16 { DType::BF16 } else { DType::F32 };
    let max_bytes = a
        .max_shard_size
        .as_deref()
        .map(crate::convert::shard_bytes)
        .transpose()?
        .unwrap_or(crate::convert::DEFAULT_SHARD);
    let mut writer = checkpoint::ParamsWriter::new(&a.save_dir, usize::try_from(max_bytes).unwrap_or(usize::MAX))?;
    // Each checkpoint tensor taken, and how many slices of it (a stack's layers or experts).
    let mut taken: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    let mut tensors = 0;
    let mut copy = |t: &ModelTensor, dtype: DType| -> anyhow::Result<()> {
        let (name, want, vocab_rows) = (t.name.as_str(), &t.shape[..], t.vocab_rows);
        let rank = |k: &str, lead: &[usize]| shapes.get(k).is_some_and(|s| s.len() == want.len() + lead.len());
        // Saved whole, else in parts (every part there).
        let parts = parts_of(name).unwrap_or(&[]);
        let found = sources(name).into_iter().find_map(|(k, lead)| {
            if rank(&k, &lead) {
                return Some((vec![k], lead));
            }
            let keys: Vec<String> = parts.iter().map(|p| format!("{k}.{p}")).collect();
            (!keys.is_empty() && keys.iter().all(|k| rank(k, &lead))).then_some((keys, lead))
        });
        let Some((keys, lead)) = found else {
            bail!(
                "{}: no tensor for `{name}` (looked for {}): the checkpoint's arguments describe another model",
                ck.dir.display(),
                sources(name).iter().map(|(k, _)| format!("`{k}`")).collect::<Vec<_>>().join(", ")
            );
        };
        let (mut shape, mut values) = ck.read(&keys[0], &lead, t.cut)?;
        for k in &keys[1..] {
            let (s, v) = ck.read(k, &lead, t.cut)?;
            if s[1..] != shape[1..] {
                bail!("{}: `{k}` is {s:?}, unlike `{}`'s {shape:?} beside it", ck.dir.display(), keys[0]);
            }
            shape[0] += s[0];
            values.extend(v);
        }
        let key = keys.join(" + ");
        let fits = if vocab_rows { shape[1..] == want[1..] && shape[0] >= want[0] } else { shape == want };
        if !fits {
            bail!(
                "{}: `{key}` is {shape:?} where `{name}` is {want:?}: the checkpoint's arguments describe another model",
                ck.dir.display()
            );
        }
        // Vocabulary rows unpadded, as every Ferrotron checkpoint keeps them.
        values.truncate(want.iter().product());
        for k in keys {
            taken.entry(k).or_insert((lead.len(), 0)).1 += 1;
        }
        tensors += 1;
        writer.add(name.to_string(), dtype, want.to_vec(), values)
    };
    for t in model_tensors(&settings, &config)? {
        copy(&t, if t.fp32 { DType::F32 } else { dtype })?;
    }
    if let Some(why) = untaken(&shapes, &taken) {
        bail!("{}: {why}; nothing was written", ck.dir.display());
    }
    let dir = writer.finish(dtype, &settings)?;
    Ok(Converted {
        dir,
        arch: None,
        what: format!("Megatron-LM {} checkpoint", ck.format),
        tensors,
        tokenizer: Ok(vec![]),
        left_out: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An argparse Namespace as a pickle reads one: `fields` its attributes.
    fn namespace(fields: &[(&str, Py)]) -> Py {
        Py::with_attrs("argparse", "Namespace", fields.to_vec())
    }

    #[test]
    fn the_runs_arguments_become_flags() {
        let a = ConvertArgs::new("megatron", "ferrotron", "in".as_ref(), "out".as_ref());
        let dir = std::path::Path::new("ck");
        // Defaults Megatron records for every run: the MoE ones stay out without experts, a
        // stored tokenizer path that is not here is not taken, the older epsilon's name is read.
        let dense = namespace(&[
            ("num_layers", Py::Int(3)),
            ("moe_router_topk", Py::Int(2)),
            ("moe_token_drop_policy", Py::Str("probs".into())),
            ("add_bias_linear", Py::Bool(false)),
            ("swiglu", Py::Bool(false)),
            ("layernorm_epsilon", Py::Float(1e-6)),
            ("group_query_attention", Py::Bool(false)),
            ("num_query_groups", Py::Int(1)),
            ("tokenizer_type", Py::Str("HuggingFaceTokenizer".into())),
            ("tokenizer_model", Py::Str("/nowhere/tokenizer".into())),
            // A relative path that is here (tests run in the crate's folder): made absolute.
            ("vocab_file", Py::Str("Cargo.toml".into())),
        ]);
        let t = model_args(&dense, dir, &a).unwrap();
        assert_eq!(
            (t.num_layers, t.num_experts, t.moe_router_topk, t.moe_token_drop_policy),
            (Some(3), None, None, None)
        );
        assert!(t.disable_bias_linear && !t.swiglu);
        assert_eq!((t.norm_epsilon, t.num_query_groups), (Some(1e-6), None));
        assert_eq!(t.tokenizer_model, None);
        assert_eq!(t.vocab_file, Some(std::fs::canonicalize("Cargo.toml").unwrap()));

        let moe = namespace(&[
            ("num_experts", Py::Int(8)),
            ("moe_router_topk", Py::Int(2)),
            ("moe_token_drop_policy", Py::Str("probs".into())),
            ("moe_layer_freq", Py::List(vec![Py::Int(0), Py::Int(1), Py::Int(1)])),
            ("group_query_attention", Py::Bool(true)),
            ("num_query_groups", Py::Int(4)),
        ]);
        let t = model_args(&moe, dir, &a).unwrap();
        assert_eq!((t.num_experts, t.moe_router_topk, t.num_query_groups), (Some(8), Some(2), Some(4)));
        // No capacity factor: Megatron's recorded drop policy is not passed on.
        assert_eq!(t.moe_token_drop_policy, None);
        assert_eq!(t.moe_layer_freq.as_deref(), Some("[0,1,1]"));

        // Convert's own tokenizer flags win over the run's.
        let mut over = a.clone();
        over.tokenizer_type = Some("NullTokenizer".into());
        over.vocab_size = Some(99);
        let t = model_args(&dense, dir, &over).unwrap();
        assert_eq!((t.tokenizer_type.as_deref(), t.vocab_size, t.vocab_file), (Some("NullTokenizer"), Some(99), None));

        // The layers a window applies in: Megatron's int, or its evaluated list; nothing without
        // a window (Megatron records the field for every run).
        let window = |skip: Py| {
            let w = Py::Tuple(vec![Py::Int(3), Py::Int(0)]);
            model_args(&namespace(&[("window_size", w), ("window_attn_skip_freq", skip)]), dir, &a).unwrap()
        };
        assert_eq!(window(Py::Int(2)).window_attn_skip_freq.as_deref(), Some("2"));
        let list = Py::List(vec![Py::Int(1), Py::Int(0)]);
        assert_eq!(window(list).window_attn_skip_freq.as_deref(), Some("[1,0]"));
        let t = model_args(&namespace(&[("window_attn_skip_freq", Py::Int(2))]), dir, &a).unwrap();
        assert_eq!(t.window_attn_skip_freq, None);
        // Mamba hybrids: the pattern (either name), else the ratios over the layers (Megatron's
        // allocation), else every layer Mamba where the run's --spec was Megatron's Mamba spec;
        // the Mamba sizes only then, the layer frequency never.
        let hybrid = |extra: &[(&str, Py)]| {
            let mut f = vec![
                ("num_layers", Py::Int(4)),
                ("mamba_state_dim", Py::Int(16)),
                ("num_experts", Py::Int(4)),
                ("moe_layer_freq", Py::Int(1)),
                ("hybrid_attention_ratio", Py::Float(0.0)),
                ("hybrid_mlp_ratio", Py::Float(0.0)),
            ];
            f.retain(|(k, _)| !extra.iter().any(|(e, _)| e == k));
            f.extend(extra.iter().cloned());
            model_args(&namespace(&f), dir, &a).unwrap()
        };
        let t = hybrid(&[("hybrid_override_pattern", Py::Str("M*ME".into()))]);
        assert_eq!((t.hybrid_layer_pattern.as_deref(), t.mamba_state_dim), (Some("M*ME"), Some(16)));
        assert_eq!(t.moe_layer_freq, None, "a hybrid's experts are its pattern's");
        let t = hybrid(&[("hybrid_layer_pattern", Py::Str("M-M*".into()))]);
        assert_eq!(t.hybrid_layer_pattern.as_deref(), Some("M-M*"));
        let t = hybrid(&[("hybrid_attention_ratio", Py::Float(0.25))]);
        assert_eq!(t.hybrid_layer_pattern.as_deref(), Some("MM*M"));
        let spec = Py::List(vec![
            Py::Str("megatron.core.models.mamba.mamba_layer_specs".into()),
            Py::Str("mamba_stack_spec".into()),
        ]);
        assert_eq!(hybrid(&[("spec", spec)]).hybrid_layer_pattern.as_deref(), Some("MMMM"));
        let t = hybrid(&[]);
        assert_eq!((t.hybrid_layer_pattern, t.mamba_state_dim), (None, None), "a GPT run records Mamba defaults too");
        assert_eq!(t.moe_layer_freq.as_deref(), Some("1"));
        // Multi-latent attention: its fields only with it, YaRN's only for YaRN; latents unnormalised
        // are refused.
        let mla = |rope: &str, qk_norm: bool| {
            namespace(&[
                ("multi_latent_attention", Py::Bool(true)),
                ("qk_layernorm", Py::Bool(qk_norm)),
                ("kv_lora_rank", Py::Int(12)),
                ("rope_type", Py::Str(rope.into())),
                ("mscale", Py::Float(1.0)),
            ])
        };
        let t = model_args(&mla("rope", true), dir, &a).unwrap();
        assert!(t.multi_latent_attention && !t.qk_layernorm);
        assert_eq!((t.kv_lora_rank, t.mscale), (Some(12), None));
        assert_eq!(model_args(&mla("yarn", true), dir, &a).unwrap().mscale, Some(1.0));
        let e = model_args(&mla("rope", false), dir, &a).unwrap_err().to_string();
        assert!(e.contains("no latent norms"), "{e}");
        let t = model_args(&namespace(&[("window_size", Py::Tuple(vec![Py::Int(3), Py::Int(0)]))]), dir, &a).unwrap();
        assert_eq!(t.window_size.as_deref(), Some("(3,0)"));
        let t = model_args(&namespace(&[("kv_lora_rank", Py::Int(32))]), dir, &a).unwrap();
        assert_eq!(t.kv_lora_rank, None, "Megatron's default for every run");
        let e = model_args(&Py::Dict(vec![]), dir, &a).unwrap_err().to_string();
        assert!(e.contains("not Megatron-LM's argparse Namespace"), "{e}");
    }

    #[test]
    fn model_tensors_not_taken_whole_are_named() {
        let shapes: BTreeMap<String, Vec<usize>> = [
            ("decoder.layers.mlp.linear_fc2.weight", vec![4, 8, 16]),
            ("embedding.word_embeddings.weight", vec![32, 8]),
            ("optimizer.state.exp_avg.embedding.word_embeddings.weight", vec![32, 8]),
            ("decoder.layers.mlp.linear_fc2._extra_state/shard_0_4", vec![1]),
        ]
        .into_iter()
        .map(|(k, s)| (k.to_string(), s))
        .collect();
        let mut taken: BTreeMap<String, (usize, usize)> =
            [("decoder.layers.mlp.linear_fc2.weight".to_string(), (1, 4))].into_iter().collect();
        let e = untaken(&shapes, &taken).unwrap();
        assert!(e.contains("`embedding.word_embeddings.weight`") && e.contains("no place"), "{e}");
        taken.insert("embedding.word_embeddings.weight".into(), (0, 1));
        assert_eq!(untaken(&shapes, &taken), None, "the optimizer's state and TE's extra state are not the model's");
        // A stack of four layers of which the model took two.
        taken.insert("decoder.layers.mlp.linear_fc2.weight".into(), (1, 2));
        let e = untaken(&shapes, &taken).unwrap();
        assert!(e.contains("holds 4 slices") && e.contains("took 2"), "{e}");
    }

    #[test]
    fn layer_tensors_are_looked_for_stacked_and_by_layer_under_both_norm_names() {
        let s = sources("decoder.layers.3.input_layernorm.weight");
        assert_eq!(s[0], ("decoder.layers.self_attention.linear_qkv.layer_norm_weight".into(), vec![3]));
        assert_eq!(s[1], ("decoder.layers.3.self_attention.linear_qkv.layer_norm_weight".into(), vec![]));
        assert_eq!(s[2], ("decoder.layers.input_layernorm.weight".into(), vec![3]));
        assert_eq!(s[3], ("decoder.layers.3.input_layernorm.weight".into(), vec![]));
        assert_eq!(sources("decoder.layers.0.mlp.linear_fc2.weight").len(), 2);
        assert_eq!(sources("output_layer.weight"), vec![("output_layer.weight".into(), vec![])]);
        let e = sources("decoder.layers.2.mlp.experts.local_experts.5.linear_fc1.weight");
        assert_eq!(e[0], ("decoder.layers.mlp.experts.experts.linear_fc1.weight".into(), vec![2, 5]));
        assert_eq!(e[1], ("decoder.layers.2.mlp.experts.experts.linear_fc1.weight".into(), vec![5]));
        assert_eq!(e[2].0, "decoder.layers.2.mlp.experts.local_experts.5.linear_fc1.weight");
        assert_eq!(e[3], ("decoder.layers.2.mlp.experts.linear_fc1.weight5".into(), vec![]));
        assert!(is_model_tensor("decoder.layers.mlp.linear_fc1.weight"));
        assert!(!is_model_tensor("decoder.layers.mlp.linear_fc1._extra_state/shard_0_2"));
        assert!(!is_model_tensor("optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight"));
    }
}
