//! transformers' `LlavaForConditionalGeneration` (model_type llava, LLaVA-1.5's layout): a CLIP
//! vision tower, a two-layer GeLU projector and a Llama language model.
//!
//! Names as transformers 5's save_pretrained writes them: the language model's are Llama's under
//! `language_model.` (`language_model.model.layers.N.*`, `language_model.lm_head.weight`); the
//! vision tower's `vision_tower.embeddings.*`, `…pre_layrnorm.*`, `…encoder.layers.N.{self_attn.
//! {q,k,v,out}_proj, layer_norm1, layer_norm2, mlp.fc1, mlp.fc2}.*`, `…post_layernorm.*`; the
//! projector's `multi_modal_projector.linear_1/2.*`. An import also reads the hub's LLaVA-1.5
//! files (the tower under `vision_tower.vision_model.`) and transformers 5's module names
//! (`model.language_model.*`, `lm_head.weight`, `model.vision_tower.*`,
//! `model.multi_modal_projector.*`).
//! LLaVA reads the tower's hidden states after layer `vision_feature_layer` (−2: all but the last
//! layer), before `post_layernorm`: an import keeps those layers and reads past the others; an
//! export writes the layers it has and `vision_feature_layer` −1.

use super::{HfArch, HfError, HostTensor, Result, TensorLookup, f64_of, group_qkv, opt, str_or, ungroup_qkv, usize_of};
use ferrotron_transformer::vision::clip_encoder;
use ferrotron_transformer::{TransformerConfig, VisionSpec};
use serde_json::{Value, json};

/// The vision half of a LLaVA config.json, as Ferrotron builds it.
#[derive(Clone, Debug)]
pub struct LlavaVision {
    pub spec: VisionSpec,
    /// The vision tower's layers in the HF files (`spec.encoder.num_layers` of them are used).
    pub hf_layers: usize,
}

const TOWER: &str = "vision_tower.";
const PROJECTOR: &str = "multi_modal_projector.";

/// The names a tensor may have in a file, the one transformers 5 writes first.
fn candidates(name: &str) -> Vec<String> {
    let mut c = vec![name.to_string()];
    if let Some(rest) = name.strip_prefix(TOWER) {
        c.push(format!("{TOWER}vision_model.{rest}"));
        c.push(format!("model.{name}"));
    } else if name.starts_with(PROJECTOR) {
        c.push(format!("model.{name}"));
    } else if let Some(rest) = name.strip_prefix("language_model.model.") {
        c.push(format!("model.language_model.{rest}"));
    } else if let Some(rest) = name.strip_prefix("language_model.") {
        c.push(rest.to_string());
    }
    c
}

fn refuse(msg: String) -> HfError {
    HfError::Config(msg)
}

/// The language model's config (Llama's) and the vision half, from a llava config.json.
pub(super) fn config(v: &Value) -> Result<(TransformerConfig, LlavaVision)> {
    let text = super::field(v, "text_config")?;
    let text_type = str_or(text, "model_type", "llama");
    if text_type != "llama" {
        return Err(refuse(format!(
            "text_config model_type `{text_type}`: Ferrotron converts LLaVA with a Llama language model"
        )));
    }
    let c = super::llama_config(text)?;
    let vc = super::field(v, "vision_config")?;
    let vision_type = str_or(vc, "model_type", "clip_vision_model");
    if vision_type != "clip_vision_model" {
        return Err(refuse(format!("vision_config model_type `{vision_type}`: Ferrotron's vision tower is CLIP's")));
    }
    for (key, got, want) in [
        ("vision_config.hidden_act", str_or(vc, "hidden_act", "quick_gelu"), "quick_gelu"),
        ("projector_hidden_act", str_or(v, "projector_hidden_act", "gelu"), "gelu"),
    ] {
        if got != want {
            return Err(refuse(format!("{key} `{got}`: Ferrotron's LLaVA has {want} there")));
        }
    }
    if !super::bool_or(v, "multimodal_projector_bias", true)? {
        return Err(refuse("multimodal_projector_bias false: Ferrotron's projection has biases".into()));
    }
    let eps = opt(vc, "layer_norm_eps", f64_of)?.unwrap_or(1e-5);
    if eps != 1e-5 {
        return Err(refuse(format!("vision_config.layer_norm_eps {eps}: Ferrotron's CLIP layers use 1e-5")));
    }
    let channels = opt(vc, "num_channels", usize_of)?.unwrap_or(3);
    if channels != 3 {
        return Err(refuse(format!("vision_config.num_channels {channels}: Ferrotron's images have 3")));
    }
    let drop_class_token = match str_or(v, "vision_feature_select_strategy", "default") {
        "default" => true,
        "full" => false,
        o => return Err(refuse(format!("vision_feature_select_strategy `{o}`: use default or full"))),
    };
    let hf_layers = usize_of(vc, "num_hidden_layers")?;
    let layer = v.get("vision_feature_layer").and_then(Value::as_i64).ok_or_else(|| {
        refuse("vision_feature_layer: Ferrotron reads one layer's hidden states (an integer), not several".into())
    })?;
    // hidden_states[k] is the output of k layers (0: the embeddings after pre_layrnorm).
    let used = if layer < 0 { hf_layers as i64 + 1 + layer } else { layer };
    if used < 1 || used > hf_layers as i64 {
        return Err(refuse(format!(
            "vision_feature_layer {layer} of {hf_layers} layers: pick a layer's output (−{hf_layers}..−1 or 1..{hf_layers})"
        )));
    }
    let std = opt(vc, "initializer_range", f64_of)?.unwrap_or(0.02) as f32;
    let size = usize_of(vc, "image_size")?;
    let image_token = v
        .get("image_token_index")
        .or_else(|| v.get("image_token_id"))
        .and_then(Value::as_u64)
        .ok_or_else(|| refuse("no `image_token_index`".into()))?;
    let encoder = clip_encoder(
        used as usize,
        usize_of(vc, "hidden_size")?,
        usize_of(vc, "num_attention_heads")?,
        usize_of(vc, "intermediate_size")?,
        std,
    );
    let patch = usize_of(vc, "patch_size")?;
    let spec = VisionSpec::llava((size, size, patch), encoder, drop_class_token, c.hidden_size, image_token as u32);
    spec.validate(c.vocab_size).map_err(|e| refuse(e.to_string()))?;
    Ok((c, LlavaVision { spec, hf_layers }))
}

/// config.json for `c` with `v` (the tower written with the layers Ferrotron has, read after the
/// last: `vision_feature_layer` −1).
pub fn to_config(c: &TransformerConfig, v: &VisionSpec, dtype: &str) -> Value {
    let mut text = super::to_hf_config(HfArch::Llama, c, dtype);
    if let Some(o) = text.as_object_mut() {
        o.remove("architectures");
        o.remove("torch_dtype");
    }
    let e = &v.encoder;
    json!({
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "image_token_index": v.image_token,
        "image_seq_length": v.image_tokens(),
        "projector_hidden_act": "gelu",
        "multimodal_projector_bias": true,
        "vision_feature_layer": -1,
        "vision_feature_select_strategy": if v.drop_class_token { "default" } else { "full" },
        "tie_word_embeddings": !c.untie_embeddings_and_output_weights,
        "text_config": text,
        "vision_config": {
            "model_type": "clip_vision_model",
            "hidden_size": e.hidden_size,
            "intermediate_size": e.ffn_hidden_size,
            "num_hidden_layers": e.num_layers,
            "num_attention_heads": e.num_attention_heads,
            "image_size": v.img_h,
            "patch_size": v.patch_dim,
            "num_channels": v.channels,
            "hidden_act": "quick_gelu",
            "layer_norm_eps": e.norm_epsilon,
            "initializer_range": super::decimal(e.init_method_std),
        },
        "torch_dtype": dtype,
    })
}

/// The language model's HF name inside LLaVA (a Llama's under `language_model.`).
fn text_name(llama: &str) -> String {
    format!("language_model.{llama}")
}

/// A vision tensor's Megatron name, HF name and HF shape; `Qkv` the fused projections.
enum VisionMap {
    Same { own: String, hf: String, shape: Vec<usize> },
    Qkv { own: String, hf: [String; 3], shape: Vec<usize> },
}

fn vision_maps(v: &VisionSpec) -> Vec<VisionMap> {
    let e = &v.encoder;
    let (c, f, p) = (e.hidden_size, e.ffn_hidden_size, v.patch_dim);
    let same = |own: String, hf: String, shape: Vec<usize>| VisionMap::Same { own, hf, shape };
    let mut m = vec![
        same(
            "vision_model.conv1.weight".into(),
            format!("{TOWER}embeddings.patch_embedding.weight"),
            vec![c, v.channels, p, p],
        ),
        same("vision_model.class_token".into(), format!("{TOWER}embeddings.class_embedding"), vec![c]),
        same(
            "vision_model.position_embeddings.weight".into(),
            format!("{TOWER}embeddings.position_embedding.weight"),
            vec![v.seq_len(), c],
        ),
    ];
    for x in ["weight", "bias"] {
        m.push(same(format!("vision_model.ln_pre.{x}"), format!("{TOWER}pre_layrnorm.{x}"), vec![c]));
    }
    for i in 0..e.num_layers {
        let (o, h) = (format!("vision_model.decoder.layers.{i}."), format!("{TOWER}encoder.layers.{i}."));
        for (x, shape) in [("weight", vec![c, c]), ("bias", vec![c])] {
            let hf = ["q", "k", "v"].map(|n| format!("{h}self_attn.{n}_proj.{x}"));
            m.push(VisionMap::Qkv { own: format!("{o}self_attention.linear_qkv.{x}"), hf, shape });
        }
        for (own, hf, w) in [
            ("self_attention.linear_proj", "self_attn.out_proj", vec![c, c]),
            ("mlp.linear_fc1", "mlp.fc1", vec![f, c]),
            ("mlp.linear_fc2", "mlp.fc2", vec![c, f]),
        ] {
            let rows = w[0];
            m.push(same(format!("{o}{own}.weight"), format!("{h}{hf}.weight"), w));
            m.push(same(format!("{o}{own}.bias"), format!("{h}{hf}.bias"), vec![rows]));
        }
        for (own, hf) in [("input_layernorm", "layer_norm1"), ("pre_mlp_layernorm", "layer_norm2")] {
            for x in ["weight", "bias"] {
                m.push(same(format!("{o}{own}.{x}"), format!("{h}{hf}.{x}"), vec![c]));
            }
        }
    }
    let hidden = v.projector_ffn;
    for (own, hf, w) in [("linear_fc1", "linear_1", vec![hidden, c]), ("linear_fc2", "linear_2", vec![hidden, hidden])]
    {
        let rows = w[0];
        m.push(same(format!("vision_projection.encoder.{own}.weight"), format!("{PROJECTOR}{hf}.weight"), w));
        m.push(same(format!("vision_projection.encoder.{own}.bias"), format!("{PROJECTOR}{hf}.bias"), vec![rows]));
    }
    m
}

/// Megatron's shape of a vision tensor whose HF shape is `hf` (the class token is [1, 1, C]).
fn own_shape(own: &str, hf: &[usize]) -> Vec<usize> {
    if own == "vision_model.class_token" { vec![1, 1, hf[0]] } else { hf.to_vec() }
}

/// Megatron-named tensors from a LLaVA checkpoint (`take` as `super::import`'s): the language
/// model's, then the vision tower's and projector's; the tower's layers past the ones LLaVA reads
/// and its `post_layernorm` are read past.
pub fn import(
    c: &TransformerConfig,
    v: &LlavaVision,
    take: &mut dyn FnMut(&str) -> Option<HostTensor>,
    emit: &mut dyn FnMut(String, HostTensor),
) -> Result<()> {
    let mut take = |n: &str| candidates(n).iter().find_map(|c| take(c));
    super::import(HfArch::Llama, c, &mut |n: &str| take(&text_name(n)), emit)?;
    let mut get = |name: &str, want: &[usize]| -> Result<HostTensor> {
        let t = take(name).ok_or_else(|| HfError::Missing(name.into()))?;
        if t.shape != want {
            return Err(HfError::Shape { name: name.into(), got: t.shape, want: want.to_vec() });
        }
        Ok(t)
    };
    let heads = v.spec.encoder.num_attention_heads;
    let d = v.spec.encoder.head_dim();
    for m in vision_maps(&v.spec) {
        match m {
            VisionMap::Same { own, hf, shape } => {
                let t = get(&hf, &shape)?;
                emit(own.clone(), HostTensor::new(own_shape(&own, &shape), t.data));
            }
            VisionMap::Qkv { own, hf, shape } => {
                let [q, k, vv] = [&hf[0], &hf[1], &hf[2]].map(|n| get(n, &shape));
                emit(own, group_qkv(&q?, &k?, &vv?, heads, heads, d));
            }
        }
    }
    // What LLaVA never reads: the tower's later layers and its pooled output's norm.
    let e = &v.spec.encoder;
    for i in e.num_layers..v.hf_layers {
        for n in [
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.out_proj",
            "layer_norm1",
            "layer_norm2",
            "mlp.fc1",
            "mlp.fc2",
        ] {
            for x in ["weight", "bias"] {
                let name = format!("{TOWER}encoder.layers.{i}.{n}.{x}");
                take(&name).ok_or_else(|| HfError::Missing(name.clone()))?;
            }
        }
    }
    for x in ["weight", "bias"] {
        let name = format!("{TOWER}post_layernorm.{x}");
        take(&name).ok_or(HfError::Missing(name))?;
    }
    Ok(())
}

/// HF-named tensors of a LLaVA model from Megatron-named ones (`get` as `super::export`'s); the
/// tower's `post_layernorm`, which LLaVA never reads, as ones and zeros.
pub fn export(
    c: &TransformerConfig,
    v: &VisionSpec,
    get: &TensorLookup,
    emit: &mut dyn FnMut(String, HostTensor),
) -> Result<()> {
    super::export(HfArch::Llama, c, get, &mut |n, t| emit(text_name(&n), t))?;
    let (heads, d) = (v.encoder.num_attention_heads, v.encoder.head_dim());
    let own = |name: &str, want: &[usize]| -> Result<HostTensor> {
        let t = get(name).ok_or_else(|| HfError::MissingOwn(name.into()))?;
        if t.shape != want {
            return Err(HfError::Shape { name: name.into(), got: t.shape, want: want.to_vec() });
        }
        Ok(t)
    };
    for m in vision_maps(v) {
        match m {
            VisionMap::Same { own: name, hf, shape } => {
                let t = own(&name, &own_shape(&name, &shape))?;
                emit(hf, HostTensor::new(shape, t.data));
            }
            VisionMap::Qkv { own: name, hf, shape } => {
                let rows = 3 * shape[0];
                let want = if shape.len() == 2 { vec![rows, shape[1]] } else { vec![rows] };
                let parts = ungroup_qkv(&own(&name, &want)?, heads, heads, d);
                for (n, t) in hf.into_iter().zip(parts) {
                    emit(n, t);
                }
            }
        }
    }
    let width = v.encoder.hidden_size;
    emit(format!("{TOWER}post_layernorm.weight"), HostTensor::new(vec![width], vec![1.0; width]));
    emit(format!("{TOWER}post_layernorm.bias"), HostTensor::new(vec![width], vec![0.0; width]));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(layer: i64, strategy: &str) -> Value {
        json!({
            "model_type": "llava", "image_token_index": 127, "vision_feature_layer": layer,
            "vision_feature_select_strategy": strategy, "projector_hidden_act": "gelu",
            "text_config": {"model_type": "llama", "vocab_size": 128, "hidden_size": 48, "intermediate_size": 96,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0},
            "vision_config": {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                "num_hidden_layers": 3, "num_attention_heads": 4, "image_size": 28, "patch_size": 14,
                "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5},
        })
    }

    #[test]
    fn the_feature_layer_picks_the_layers_kept() {
        let (c, v) = config(&cfg(-2, "default")).unwrap();
        assert_eq!((c.num_layers, v.hf_layers, v.spec.encoder.num_layers), (2, 3, 2));
        assert_eq!((v.spec.image_tokens(), v.spec.image_token, v.spec.projector_ffn), (4, 127, 48));
        let (_, full) = config(&cfg(3, "full")).unwrap();
        assert_eq!((full.spec.encoder.num_layers, full.spec.image_tokens()), (3, 5));
        for (bad, what) in [(cfg(0, "default"), "vision_feature_layer 0"), (cfg(-4, "default"), "of 3 layers")] {
            assert!(config(&bad).unwrap_err().to_string().contains(what), "{what}");
        }
        let mut act = cfg(-1, "default");
        act["vision_config"]["hidden_act"] = json!("gelu");
        assert!(config(&act).unwrap_err().to_string().contains("quick_gelu"));
        let back = to_config(&c, &v.spec, "float32");
        let (c2, v2) = config(&back).unwrap();
        assert_eq!((c2.num_layers, v2.hf_layers, v2.spec.encoder.num_layers), (2, 2, 2));
    }
}
