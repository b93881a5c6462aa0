//! transformers' `Mamba2ForCausalLM` (model_type mamba2): Mamba-2 layers alone, a hybrid whose
//! pattern is all `M`. Its parameter names are Megatron's under `backbone.` (the mixer's exactly);
//! its gated norm runs over the whole width (transformers' MambaRMSNormGated, unlike Megatron's and
//! mamba_ssm's per group), with config.json's `layer_norm_epsilon` for every norm.

use super::{HfArch, HfError, Map, Result, bool_or, f64_of, opt, str_or, usize_of};
use crate::hybrid::{make_hybrid, mamba_spec};
use ferrotron_ssm::MambaSpec;
use ferrotron_transformer::TransformerConfig;
use ferrotron_transformer::spec::{
    Activation, AttentionSpec, LayerKind, LayerSpec, MlpSpec, NormKind, PositionEmbedding, SoftmaxType,
};
use serde_json::{Value, json};

/// Sequence length a converted model trains at unless `--seq-length` says (Mamba has no
/// position table to take it from).
const SEQ: usize = 4096;

pub(super) fn config(v: &Value) -> Result<TransformerConfig> {
    for (key, want) in [("use_bias", false), ("use_conv_bias", true), ("rms_norm", true)] {
        if bool_or(v, key, want)? != want {
            return Err(HfError::Config(format!("{key} {}: Ferrotron's Mamba-2 mixer has it {want}", !want)));
        }
    }
    let act = str_or(v, "hidden_act", "silu");
    if act != "silu" {
        return Err(HfError::Config(format!("hidden_act `{act}`: Ferrotron's Mamba-2 mixer gates with silu")));
    }
    // (0, ∞): dt is not clamped. transformers 5 writes ∞ as {"__float__": "Infinity"}, 4 as a bare
    // `Infinity` (`parse_config` reads it as a string).
    if let Some(l) = v.get("time_step_limit").and_then(Value::as_array) {
        let unbounded = |x: &Value| {
            let x = x.get("__float__").unwrap_or(x);
            x.as_str().is_some_and(|s| s == "Infinity") || x.as_f64().is_some_and(|f| f >= 1e300)
        };
        if l.len() != 2 || l[0].as_f64() != Some(0.0) || !unbounded(&l[1]) {
            return Err(HfError::Config(format!(
                "time_step_limit {l:?}: Ferrotron's scan does not clamp dt (only [0.0, Infinity])"
            )));
        }
    }
    let hidden = usize_of(v, "hidden_size")?;
    let expand = usize_of(v, "expand")?;
    let (heads, head_dim) = (usize_of(v, "num_heads")?, usize_of(v, "head_dim")?);
    if heads * head_dim != expand * hidden {
        return Err(HfError::Config(format!(
            "num_heads {heads} × head_dim {head_dim} is not expand {expand} × hidden_size {hidden}: transformers' mixer needs them equal"
        )));
    }
    let eps = opt(v, "layer_norm_epsilon", f64_of)?.unwrap_or(1e-5);
    let layers = usize_of(v, "num_hidden_layers")?;
    let mut c = TransformerConfig {
        num_layers: layers,
        hidden_size: hidden,
        // No attention layers: the attention sizes are placeholders that divide the width.
        num_attention_heads: 1,
        num_query_groups: 1,
        kv_channels: None,
        ffn_hidden_size: hidden,
        seq_length: SEQ,
        max_position_embeddings: SEQ,
        vocab_size: usize_of(v, "vocab_size")?,
        make_vocab_size_divisible_by: crate::VOCAB_DIVISIBLE_BY,
        position_embedding: PositionEmbedding::None,
        untie_embeddings_and_output_weights: !bool_or(v, "tie_word_embeddings", false)?,
        layer: LayerSpec {
            norm: NormKind::RmsNorm,
            zero_centred_gamma: false,
            attention: AttentionSpec {
                bias: false,
                qkv_bias: false,
                qk_layernorm: false,
                qk_l2_norm: false,
                output_gate: false,
                softmax: SoftmaxType::Vanilla,
                window: None,
                causal: true,
                mla: None,
            },
            mlp: MlpSpec::Dense { activation: Activation::SwiGlu, bias: false },
            other_mlp: None,
            hybrid: None,
            window_layers: None,
        },
        norm_epsilon: eps,
        init_method_std: opt(v, "initializer_range", f64_of)?.unwrap_or(0.02) as f32,
        embedding_init_method_std: None,
        hidden_dropout: 0.0,
        attention_dropout: 0.0,
        mtp: None,
    };
    let spec = MambaSpec {
        state_dim: usize_of(v, "state_size")?,
        head_dim,
        groups: usize_of(v, "n_groups")?,
        heads: Some(heads),
        expand,
        conv_kernel: usize_of(v, "conv_kernel")?,
        norm_eps: eps,
        // transformers' MambaRMSNormGated takes the mean over the whole width, n_groups or not.
        norm_per_group: false,
        ..MambaSpec::default()
    };
    let dense = c.layer.mlp.clone();
    make_hybrid(&mut c, &"M".repeat(layers), spec, dense).map_err(HfError::Config)?;
    Ok(c)
}

/// Whether `c` is a Mamba2ForCausalLM, or what stops it.
pub(super) fn of(c: &TransformerConfig) -> Result<HfArch> {
    let none = |what: &str| Err(HfError::NoEquivalent(what.into()));
    let Some(m) = mamba_spec(c) else { return none("a hybrid without Mamba layers") };
    if (0..c.num_layers).any(|i| c.layer.kind_of(i) != LayerKind::Mixer) {
        return none("a hybrid with attention or MLP layers (transformers' Mamba2 holds Mamba layers alone)");
    }
    if c.layer.norm != NormKind::RmsNorm || c.position_embedding != PositionEmbedding::None {
        return none("a Mamba model with LayerNorm or position embeddings");
    }
    if m.norm_per_group && m.groups > 1 {
        return none(
            "a gated norm per group of heads with more than one group (transformers' Mamba2 normalises over the whole width: train with --mamba-norm-ungrouped, or --mamba-num-groups 1)",
        );
    }
    if m.norm_eps != c.norm_epsilon {
        return none("a gated-norm epsilon other than the layers' (transformers' Mamba2 has one layer_norm_epsilon)");
    }
    Ok(HfArch::Mamba2)
}

pub(super) fn to_config(c: &TransformerConfig, dtype: &str) -> Value {
    let m = mamba_spec(c).cloned().unwrap_or_default();
    let d = m.dims(c.hidden_size).ok();
    json!({
        "architectures": [HfArch::Mamba2.class()],
        "model_type": "mamba2",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_layers,
        "state_size": m.state_dim,
        "head_dim": m.head_dim,
        "num_heads": d.map_or(0, |d| d.heads),
        "n_groups": m.groups,
        "expand": d.map_or(m.expand, |d| d.d_inner / c.hidden_size.max(1)),
        "conv_kernel": m.conv_kernel,
        "layer_norm_epsilon": c.norm_epsilon,
        "use_bias": false,
        "use_conv_bias": true,
        "rms_norm": true,
        "hidden_act": "silu",
        "initializer_range": super::decimal(c.init_method_std),
        "tie_word_embeddings": !c.untie_embeddings_and_output_weights,
        "torch_dtype": dtype,
    })
}

/// The mixer's parameter names (below `mixer.`), the same on both sides.
const MIXER: [&str; 8] =
    ["in_proj.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D", "norm.weight", "out_proj.weight"];

pub(super) fn maps(c: &TransformerConfig) -> Vec<(String, Map)> {
    let mut m = vec![("embedding.word_embeddings.weight".into(), Map::Same("backbone.embeddings.weight".into()))];
    for i in 0..c.num_layers {
        let (o, h) = (format!("decoder.layers.{i}."), format!("backbone.layers.{i}."));
        m.push((format!("{o}norm.weight"), Map::Same(format!("{h}norm.weight"))));
        for p in MIXER {
            m.push((format!("{o}mixer.{p}"), Map::Same(format!("{h}mixer.{p}"))));
        }
    }
    m.push(("decoder.final_norm.weight".into(), Map::Same("backbone.norm_f.weight".into())));
    m
}

/// An HF tensor's shape (vocabulary rows unpadded).
pub(super) fn shape(c: &TransformerConfig, hf: &str) -> Vec<usize> {
    let h = c.hidden_size;
    let Some(d) = mamba_spec(c).and_then(|m| m.dims(h).ok()) else { return vec![] };
    let mixer = hf.split_once(".mixer.").map(|(_, p)| p);
    match mixer {
        Some("in_proj.weight") => vec![d.in_proj_out(), h],
        Some("conv1d.weight") => vec![d.conv_dim(), 1, d.conv_kernel],
        Some("conv1d.bias") => vec![d.conv_dim()],
        Some("dt_bias" | "A_log" | "D") => vec![d.heads],
        Some("norm.weight") => vec![d.d_inner],
        Some("out_proj.weight") => vec![h, d.d_inner],
        _ if hf.ends_with("embeddings.weight") || hf == super::LM_HEAD => vec![c.vocab_size, h],
        _ => vec![h],
    }
}

#[cfg(test)]
mod tests {
    use super::super::{HfArch, from_hf_config, parse_config, to_hf_config};

    const CONFIG: &str = r#"{"model_type": "mamba2", "vocab_size": 11, "hidden_size": 8, "num_hidden_layers": 2,
        "state_size": 4, "head_dim": 4, "num_heads": 4, "expand": 2, "n_groups": 2, "conv_kernel": 4,
        "layer_norm_epsilon": 1e-6, "tie_word_embeddings": true, "note": "Infinity stays a word here",
        "time_step_limit": [0.0, Infinity]}"#;

    #[test]
    fn transformers_4_infinity_and_the_round_trip() {
        let v = parse_config(CONFIG).unwrap();
        assert_eq!(v["note"], "Infinity stays a word here");
        let m = from_hf_config(&v).unwrap();
        assert_eq!(m.arch, HfArch::Mamba2);
        assert_eq!(HfArch::of(&m.config).unwrap(), HfArch::Mamba2);
        let back = to_hf_config(HfArch::Mamba2, &m.config, "float32");
        assert_eq!(
            (back["num_heads"].as_u64(), back["n_groups"].as_u64(), back["layer_norm_epsilon"].as_f64()),
            (Some(4), Some(2), Some(1e-6))
        );
        assert_eq!(from_hf_config(&back).unwrap().config.num_params(), m.config.num_params());
    }

    #[test]
    fn what_transformers_cannot_hold_is_named() {
        let clamp = CONFIG.replace("Infinity]", "1.0]");
        let e = from_hf_config(&parse_config(&clamp).unwrap()).unwrap_err().to_string();
        assert!(e.contains("time_step_limit"), "{e}");
        let wide = CONFIG.replace("\"num_heads\": 4", "\"num_heads\": 5");
        let e = from_hf_config(&parse_config(&wide).unwrap()).unwrap_err().to_string();
        assert!(e.contains("num_heads 5 × head_dim 4"), "{e}");
        let e = HfArch::of(&crate::mamba_hybrid(crate::MambaSize::Tiny)).unwrap_err().to_string();
        assert!(e.contains("attention or MLP layers"), "{e}");
        // Megatron's per-group norm with two groups: transformers would compute another model.
        let mut c = from_hf_config(&parse_config(CONFIG).unwrap()).unwrap().config;
        let mut spec = crate::hybrid::mamba_spec(&c).unwrap().clone();
        spec.norm_per_group = true;
        let dense = c.layer.mlp.clone();
        crate::hybrid::make_hybrid(&mut c, "MM", spec, dense).unwrap();
        let e = HfArch::of(&c).unwrap_err().to_string();
        assert!(e.contains("--mamba-norm-ungrouped"), "{e}");
    }
}
