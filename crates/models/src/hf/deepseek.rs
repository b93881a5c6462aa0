//! transformers' `DeepseekV3ForCausalLM` (model_type deepseek_v3; DeepSeek-V3's, Kimi-K2's and
//! Moonlight's architecture): multi-latent attention in every layer (Megatron's
//! --multi-latent-attention), dense SwiGLU MLPs in the first `first_k_dense_replace` layers and
//! mixtures of experts after them (--moe-layer-freq), routed as Megatron's DeepSeek recipe does:
//! sigmoid scores, group-limited choice (--moe-router-num-groups / --moe-router-group-topk),
//! the top k renormalised and scaled (--moe-router-topk-scaling-factor), the expert-bias
//! correction in the choice alone (--moe-router-enable-expert-bias), ungated shared experts.
//!
//! Names (facts of the two formats): `self_attn.q_a_proj` / `q_a_layernorm` / `q_b_proj` (or
//! `q_proj`) are Megatron's `linear_q_down_proj` / `q_layernorm` / `linear_q_up_proj` (or
//! `linear_q_proj`); `kv_a_proj_with_mqa` / `kv_a_layernorm` / `kv_b_proj` its
//! `linear_kv_down_proj` / `kv_layernorm` / `linear_kv_up_proj`, `o_proj` its `linear_proj`, in
//! the same layouts (per head [nope | rope] and [nope | value]; the rotary part interleaved in both,
//! transformers' `rope_interleave`). `mlp.gate` is the router, `mlp.gate.e_score_correction_bias`
//! the router's expert bias (a buffer in both), `mlp.experts.E` and `mlp.shared_experts` the
//! experts' and shared experts' gate/up/down projections (fc1 [gate; up], fc2).
//! transformers' group score is the sum of each group's best two experts, Megatron's of its best
//! top-k / group-topk: configs where the two differ are refused. The multi-token prediction
//! layers some checkpoints carry (`num_nextn_predict_layers`) are not in transformers' model.

use super::{HfError, Map, Result, bool_or, f64_of, opt, str_or, usize_of};
use ferrotron_moe::{Groups, LoadBalancing, MoeSpec, RouterSpec, Score};
use ferrotron_transformer::mla::MlaSpec;
use ferrotron_transformer::spec::Yarn;
use ferrotron_transformer::spec::{Activation, MlpSpec, OtherMlp, PositionEmbedding};
use ferrotron_transformer::{MtpSpec, TransformerConfig};
use serde_json::{Value, json};
use std::sync::Arc;

/// Megatron's --moe-router-bias-update-rate default: the rate an imported model's expert bias
/// keeps moving at when it trains on (transformers' config has no such setting).
const BIAS_UPDATE_RATE: f32 = 1e-3;

/// The rotary settings (transformers 5's `rope_parameters`, 4's `rope_scaling`) when they are
/// YaRN: Megatron's (`Yarn`), or what it would compute otherwise. None for other kinds (plain
/// RoPE; the rest `llama_config` refuses).
fn yarn_of(v: &Value) -> Result<Option<Yarn>> {
    let params = v.get("rope_parameters").filter(|x| !x.is_null());
    let Some(p) = params.or_else(|| v.get("rope_scaling").filter(|x| !x.is_null())) else { return Ok(None) };
    if p.get("rope_type").or_else(|| p.get("type")).and_then(Value::as_str) != Some("yarn") {
        return Ok(None);
    }
    let original = f64_of(p, "original_max_position_embeddings")?;
    // transformers takes the context ratio where no factor is written.
    let factor = match opt(p, "factor", f64_of)? {
        Some(f) => f,
        None => usize_of(v, "max_position_embeddings")? as f64 / original,
    };
    // Megatron's --yarn-original-max-position-embeddings, --yarn-beta-fast, --yarn-beta-slow.
    let (beta_fast, beta_slow) =
        (opt(p, "beta_fast", f64_of)?.unwrap_or(32.0), opt(p, "beta_slow", f64_of)?.unwrap_or(1.0));
    let megatron = Yarn { original_max_position_embeddings: original, beta_fast, beta_slow, ..Yarn::megatron(factor) };
    if !bool_or(p, "truncate", true)? || opt(p, "attention_factor", f64_of)?.is_some() {
        return Err(HfError::Config(
            "YaRN with `truncate` false or an explicit `attention_factor`: Megatron's YaRN computes neither so".into(),
        ));
    }
    // transformers: cos and sin scaled by mscale(mscale) / mscale(mscale_all_dim) when both are
    // set, by mscale(1) otherwise; the softmax by mscale(mscale_all_dim)² when that is set.
    let (m, all) = (opt(p, "mscale", f64_of)?.unwrap_or(0.0), opt(p, "mscale_all_dim", f64_of)?.unwrap_or(0.0));
    let (mscale, mscale_all_dim) = match (m != 0.0, all != 0.0) {
        (true, true) => (m, all),
        (_, false) => (1.0, 0.0),
        (false, true) => {
            return Err(HfError::Config(
                "YaRN with mscale_all_dim but no mscale: transformers then scales cos and sin by mscale(1) and the softmax by mscale(mscale_all_dim)², which Megatron's two numbers cannot both give".into(),
            ));
        }
    };
    Ok(Some(Yarn { mscale, mscale_all_dim, ..megatron }))
}

pub(super) fn config(v: &Value) -> Result<TransformerConfig> {
    let yarn = yarn_of(v)?;
    // The YaRN settings are the attention's own (below): the rest reads as plain RoPE.
    let mut plain = v.clone();
    if yarn.is_some() {
        let theta = match v.get("rope_parameters").and_then(|p| p.get("rope_theta")) {
            Some(t) => t.clone(),
            None => json!(opt(v, "rope_theta", f64_of)?.unwrap_or(10000.0)),
        };
        plain["rope_parameters"] = json!({"rope_type": "default", "rope_theta": theta});
        plain["rope_scaling"] = Value::Null;
    }
    let v = &plain;
    let mut c = super::llama_config(v)?;
    if !bool_or(v, "rope_interleave", true)? {
        return Err(HfError::Config(
            "rope_interleave false: Ferrotron's multi-latent attention takes DeepSeek's interleaved rotary layout"
                .into(),
        ));
    }
    let score = str_or(v, "scoring_func", "sigmoid");
    let method = str_or(v, "topk_method", "noaux_tc");
    if score != "sigmoid" || method != "noaux_tc" {
        return Err(HfError::Config(format!(
            "scoring_func `{score}` with topk_method `{method}`: Ferrotron converts DeepSeek-V3's sigmoid routing with the bias correction (noaux_tc)"
        )));
    }
    if !bool_or(v, "norm_topk_prob", true)? {
        return Err(HfError::Config(
            "norm_topk_prob false: Megatron's sigmoid router renormalises the top k (set it true)".into(),
        ));
    }
    let heads = c.num_attention_heads;
    c.num_query_groups = heads;
    c.kv_channels = None;
    let mla = MlaSpec {
        q_lora_rank: opt(v, "q_lora_rank", usize_of)?,
        kv_lora_rank: usize_of(v, "kv_lora_rank")?,
        qk_head_dim: usize_of(v, "qk_nope_head_dim")?,
        qk_pos_emb_head_dim: usize_of(v, "qk_rope_head_dim")?,
        v_head_dim: usize_of(v, "v_head_dim")?,
        yarn,
    };
    c.layer.attention.mla = Some(mla);
    let experts = match opt(v, "n_routed_experts", usize_of)? {
        Some(n) => n,
        None => usize_of(v, "num_local_experts")?,
    };
    let (topk, groups, group_topk) =
        (usize_of(v, "num_experts_per_tok")?, usize_of(v, "n_group")?, usize_of(v, "topk_group")?);
    // One group: every expert eligible, whichever way a group is scored.
    if groups > 1 && (group_topk == 0 || topk != 2 * group_topk) {
        return Err(HfError::Config(format!(
            "num_experts_per_tok {topk} with topk_group {group_topk}: transformers scores a group by its best 2 experts, Megatron by its best num_experts_per_tok / topk_group; Ferrotron converts configs where both are 2"
        )));
    }
    let router = RouterSpec {
        topk,
        topk_scaling_factor: Some(opt(v, "routed_scaling_factor", f64_of)?.unwrap_or(1.0) as f32),
        load_balancing: LoadBalancing::None,
        score: Score::Sigmoid,
        groups: (groups > 1).then_some(Groups { num: groups, topk: group_topk }),
        expert_bias_update_rate: Some(BIAS_UPDATE_RATE),
        // transformers computes the router's logits in fp32 (DeepseekV3TopkRouter).
        fp32: true,
        ..RouterSpec::default()
    };
    let width = usize_of(v, "moe_intermediate_size")?;
    let shared = opt(v, "n_shared_experts", usize_of)?.unwrap_or(0);
    let moe = MoeSpec {
        shared_expert_ffn: (shared > 0).then_some(shared * width),
        ..MoeSpec::new(experts, width, Activation::SwiGlu, router)
    };
    moe.validate().map_err(HfError::Config)?;
    let dense_layers = opt(v, "first_k_dense_replace", usize_of)?.unwrap_or(0);
    let dense = c.layer.mlp.clone();
    c.layer.mlp = MlpSpec::Custom(Arc::new(moe));
    if dense_layers > 0 {
        let layers = (0..c.num_layers).map(|i| i < dense_layers).collect();
        c.layer.other_mlp = Some(OtherMlp { mlp: dense, layers });
    }
    // The multi-token prediction layers DeepSeek's checkpoints keep after the decoder's
    // (`model.layers.L…`; transformers' model has none and saves none: see `hf::mtp_probe`).
    let mtp = opt(v, "num_nextn_predict_layers", usize_of)?.unwrap_or(0);
    c.mtp = (mtp > 0).then_some(MtpSpec { num_layers: mtp, loss_scaling_factor: MTP_LOSS_SCALING });
    Ok(c)
}

/// Megatron's --mtp-loss-scaling-factor default: the weight an imported model's depths train at
/// (not in transformers' config).
const MTP_LOSS_SCALING: f32 = 0.1;

/// The HF name of MTP depth 0's projection: present in a folder that keeps the depths.
pub(super) fn mtp_probe(c: &TransformerConfig) -> String {
    format!("model.layers.{}.eh_proj.weight", c.num_layers)
}

/// Per-depth copies DeepSeek's format keeps of the shared embedding and output layer
/// (`model.layers.L+k.embed_tokens`, `….shared_head.head`): read past on import, written on
/// export from the model's own.
pub(super) fn is_shared_copy(hf_name: &str) -> bool {
    hf_name.starts_with("model.layers.")
        && (hf_name.ends_with(".shared_head.head.weight") || hf_name.ends_with(".embed_tokens.weight"))
}

/// The export's copies of the embedding and output layer for each MTP depth.
pub(super) fn shared_copies(
    c: &TransformerConfig,
    emb: &super::HostTensor,
    head: &super::HostTensor,
) -> Vec<(String, super::HostTensor)> {
    let Some(m) = c.mtp else { return vec![] };
    (0..m.num_layers)
        .flat_map(|k| {
            let p = format!("model.layers.{}.", c.num_layers + k);
            [(format!("{p}embed_tokens.weight"), emb.clone()), (format!("{p}shared_head.head.weight"), head.clone())]
        })
        .collect()
}

/// Whether `c` is a DeepSeek-V3 exactly (called for a model with multi-latent attention).
pub(super) fn check(c: &TransformerConfig) -> Result<()> {
    let problem = |p: &str| {
        Err(HfError::NoEquivalent(format!("a model with multi-latent attention as DeepseekV3ForCausalLM: {p}")))
    };
    let a = c.layer.attention;
    let Some(m) = crate::moe_spec(c) else { return problem("its MLPs past the dense ones are mixtures of experts") };
    let r = &m.router;
    let dense_first = match &c.layer.other_mlp {
        None => true,
        Some(o) => {
            let k = o.layers.iter().take_while(|&&d| d).count();
            o.layers[k..].iter().all(|&d| !d) && super::plain_swiglu(&o.mlp)
        }
    };
    let yarn = a.mla.and_then(|m| m.yarn);
    if c.layer.norm != ferrotron_transformer::spec::NormKind::RmsNorm
        || !matches!(c.position_embedding, PositionEmbedding::Rope { scaling: None, .. })
    {
        problem("its layers are RMSNorm with RoPE (plain or YaRN)")
    } else if yarn.is_some_and(|y| y.mscale_all_dim == 0.0 && y.mscale != 1.0) {
        problem("YaRN with --mscale but no --mscale-all-dim: transformers would scale cos and sin by mscale(1)")
    } else if a.bias || a.window.is_some() {
        problem("its attention has no bias and no window")
    } else if !dense_first {
        problem("its dense layers (--moe-layer-freq) come first, SwiGLU without biases")
    } else if m.activation != Activation::SwiGlu || m.bias || m.shared_expert_gate {
        problem("its experts are SwiGLU without biases, its shared experts ungated")
    } else if m.shared_expert_ffn.is_some_and(|f| f % m.ffn_hidden_size != 0) {
        problem("its shared experts are a whole number of experts wide")
    } else if r.score != Score::Sigmoid
        || r.expert_bias_update_rate.is_none()
        || r.pre_softmax
        || r.groups.is_some_and(|g| r.topk != 2 * g.topk)
    {
        problem(
            "its router is sigmoid scores with the expert bias (--moe-router-enable-expert-bias), groups scored by their best 2 (top-k = 2 × group top-k)",
        )
    } else {
        Ok(())
    }
}

pub(super) fn to_config(c: &TransformerConfig, dtype: &str) -> Value {
    let (Some(mla), Some(m)) = (c.layer.attention.mla, crate::moe_spec(c)) else { unreachable!("HfArch::of checked") };
    let PositionEmbedding::Rope { base, .. } = c.position_embedding else { unreachable!("HfArch::of checked") };
    let r = &m.router;
    let dense = c.layer.other_mlp.as_ref().map_or(0, |o| o.layers.iter().filter(|&&d| d).count());
    let (groups, group_topk) = r.groups.map_or((1, 1), |g| (g.num, g.topk));
    json!({
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.ffn_hidden_size,
        "moe_intermediate_size": m.ffn_hidden_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_attention_heads,
        "q_lora_rank": mla.q_lora_rank,
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_nope_head_dim": mla.qk_head_dim,
        "qk_rope_head_dim": mla.qk_pos_emb_head_dim,
        "v_head_dim": mla.v_head_dim,
        "n_routed_experts": m.num_experts,
        "n_shared_experts": m.shared_expert_ffn.map_or(0, |f| f / m.ffn_hidden_size),
        "num_experts_per_tok": r.topk,
        "n_group": groups,
        "topk_group": group_topk,
        "routed_scaling_factor": r.topk_scaling_factor.map_or(1.0, super::decimal),
        "norm_topk_prob": true,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "first_k_dense_replace": dense,
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.norm_epsilon,
        "rope_theta": base,
        "rope_scaling": a_yarn(mla.yarn),
        "rope_interleave": true,
        "hidden_act": "silu",
        "attention_bias": false,
        "attention_dropout": super::decimal(c.attention_dropout),
        "initializer_range": super::decimal(c.init_method_std),
        "tie_word_embeddings": !c.untie_embeddings_and_output_weights,
        "num_nextn_predict_layers": c.mtp.map_or(0, |m| m.num_layers),
        "torch_dtype": dtype,
    })
}

/// config.json's `rope_scaling` for `yarn` (null for plain RoPE).
fn a_yarn(yarn: Option<Yarn>) -> Value {
    match yarn {
        None => Value::Null,
        Some(y) => json!({
            "type": "yarn",
            "factor": y.factor,
            "original_max_position_embeddings": y.original_max_position_embeddings,
            "beta_fast": y.beta_fast,
            "beta_slow": y.beta_slow,
            "mscale": y.mscale,
            "mscale_all_dim": y.mscale_all_dim,
        }),
    }
}

/// (Megatron name, where its values come from) for every parameter and expert bias.
pub(super) fn maps(c: &TransformerConfig) -> Vec<(String, Map)> {
    use Map::*;
    let mut m = vec![("embedding.word_embeddings.weight".to_string(), Same("model.embed_tokens.weight".into()))];
    let moe = crate::moe_spec(c);
    let q_lora = c.layer.attention.mla.is_some_and(|a| a.q_lora_rank.is_some());
    let depths = c.mtp.map_or(0, |m| m.num_layers);
    // The decoder's layers, then each MTP depth's (HF: the layers after the decoder's; its
    // transformer layer is of the decoder's last layer's kind).
    for i in 0..c.num_layers + depths {
        let (o, h) = if i < c.num_layers {
            (format!("decoder.layers.{i}."), format!("model.layers.{i}."))
        } else {
            let (d, hf) = (format!("mtp.layers.{}.", i - c.num_layers), format!("model.layers.{i}."));
            for (own, name) in [
                ("enorm", "enorm"),
                ("hnorm", "hnorm"),
                ("eh_proj", "eh_proj"),
                ("final_layernorm", "shared_head.norm"),
            ] {
                m.push((format!("{d}{own}.weight"), Same(format!("{hf}{name}.weight"))));
            }
            (format!("{d}transformer_layer."), hf)
        };
        let kind = i.min(c.num_layers - 1);
        m.push((format!("{o}input_layernorm.weight"), Same(format!("{h}input_layernorm.weight"))));
        let mut attn = vec![
            ("linear_kv_down_proj", "kv_a_proj_with_mqa"),
            ("kv_layernorm", "kv_a_layernorm"),
            ("linear_kv_up_proj", "kv_b_proj"),
            ("linear_proj", "o_proj"),
        ];
        if q_lora {
            attn.extend([
                ("linear_q_down_proj", "q_a_proj"),
                ("q_layernorm", "q_a_layernorm"),
                ("linear_q_up_proj", "q_b_proj"),
            ]);
        } else {
            attn.push(("linear_q_proj", "q_proj"));
        }
        for (own, hf) in attn {
            m.push((format!("{o}self_attention.{own}.weight"), Same(format!("{h}self_attn.{hf}.weight"))));
        }
        m.push((format!("{o}pre_mlp_layernorm.weight"), Same(format!("{h}post_attention_layernorm.weight"))));
        let dense = c.layer.other_mlp.as_ref().is_some_and(|d| d.layers[kind]);
        let w = |p: &str, x: &str| format!("{h}mlp.{p}{x}_proj.weight");
        match moe {
            Some(spec) if !dense => {
                m.push((format!("{o}mlp.router.weight"), Same(format!("{h}mlp.gate.weight"))));
                let bias = Same(format!("{h}mlp.gate.e_score_correction_bias"));
                m.push((format!("{o}mlp.router.expert_bias"), bias));
                let experts = (0..spec.num_experts)
                    .map(|e| (format!("{o}mlp.experts.local_experts.{e}."), format!("experts.{e}.")));
                let shared =
                    spec.shared_expert_ffn.map(|_| (format!("{o}mlp.shared_experts."), "shared_experts.".to_string()));
                for (own, p) in experts.chain(shared) {
                    m.push((format!("{own}linear_fc1.weight"), GateUp(w(&p, "gate"), w(&p, "up"))));
                    m.push((format!("{own}linear_fc2.weight"), Same(w(&p, "down"))));
                }
            }
            _ => {
                m.push((format!("{o}mlp.linear_fc1.weight"), GateUp(w("", "gate"), w("", "up"))));
                m.push((format!("{o}mlp.linear_fc2.weight"), Same(w("", "down"))));
            }
        }
    }
    m.push(("decoder.final_layernorm.weight".into(), Same("model.norm.weight".into())));
    m
}

/// An HF tensor's shape (`hf` without prefix), vocabulary rows unpadded.
pub(super) fn shape(c: &TransformerConfig, hf: &str) -> Vec<usize> {
    let (h, v, heads) = (c.hidden_size, c.vocab_size, c.num_attention_heads);
    let Some(a) = c.layer.attention.mla else { return vec![] };
    let moe = crate::moe_spec(c);
    let (dn, r, dv, kvl) = (a.qk_head_dim, a.qk_pos_emb_head_dim, a.v_head_dim, a.kv_lora_rank);
    let ql = a.q_lora_rank.unwrap_or(h);
    let f = match moe {
        Some(m) if hf.contains(".experts.") => m.ffn_hidden_size,
        Some(m) if hf.contains(".shared_experts.") => m.shared_expert_ffn.unwrap_or(0),
        _ => c.ffn_hidden_size,
    };
    let e = moe.map_or(0, |m| m.num_experts);
    let last = hf.rsplit('.').nth(1).unwrap_or("");
    if hf.ends_with("e_score_correction_bias") {
        return vec![e];
    }
    match last {
        "embed_tokens" | "lm_head" => vec![v, h],
        "head" if hf.contains(".shared_head.") => vec![v, h],
        "q_a_proj" => vec![ql, h],
        "q_a_layernorm" => vec![ql],
        "q_b_proj" => vec![heads * (dn + r), ql],
        "q_proj" => vec![heads * (dn + r), h],
        "kv_a_proj_with_mqa" => vec![kvl + r, h],
        "kv_a_layernorm" => vec![kvl],
        "kv_b_proj" => vec![heads * (dn + dv), kvl],
        "o_proj" => vec![h, heads * dv],
        "eh_proj" => vec![h, 2 * h],
        "gate_proj" | "up_proj" => vec![f, h],
        "down_proj" => vec![h, f],
        "gate" => vec![e, h],
        _ => vec![h], // norms
    }
}
