//! Multi-latent attention: the whole model's gradients against central differences (with and
//! without a query latent, values narrower and wider than the scores' heads, tied and untied), and
//! the settings it is not built with refused by name.

mod common;

use common::{batch, config, directional_derivatives};
use ferrotron_core::{Cx, DType, Device, ParamTable};
use ferrotron_transformer::mla::MlaSpec;
use ferrotron_transformer::spec::{NormKind, NormSpec};
use ferrotron_transformer::{Batch, GptModel, TransformerConfig};

fn mla(q_lora_rank: Option<usize>, v_head_dim: usize) -> TransformerConfig {
    let mut c = config(true);
    c.layer.attention.qk_layernorm = false;
    c.layer.attention.mla =
        Some(MlaSpec { q_lora_rank, kv_lora_rank: 6, qk_head_dim: 4, qk_pos_emb_head_dim: 4, v_head_dim, yarn: None });
    c
}

fn loss(model: &GptModel, table: &ParamTable, b: &Batch) -> f64 {
    model.forward(&Cx::new(table, true), b).unwrap().0
}

fn check(cfg: TransformerConfig) {
    let b = batch(2, 6, 11);
    let (model, table) = GptModel::build(cfg, &Device::Cpu, DType::F32, 3).unwrap();
    assert_eq!(model.config.num_params(), table.numel(), "the count the FLOPs and the log take");
    let cx = Cx::new(&table, true);
    let (_, saved) = model.forward(&cx, &b).unwrap();
    model.backward(&cx, saved, 1.0).unwrap();
    let mut latent = 0;
    for d in directional_derivatives(&table, || loss(&model, &table, &b)) {
        let name = &d.name;
        if name.contains("_proj") || name.contains("kv_layernorm") || name.contains("q_layernorm") {
            latent += 1;
        }
        d.assert_close("");
    }
    assert!(latent >= 2 * 5, "the latent projections are in the table ({latent})");
}

#[test]
fn mla_with_a_query_latent_gradients_match_finite_differences() {
    check(mla(Some(5), 3));
}

#[test]
fn mla_without_a_query_latent_gradients_match_finite_differences() {
    check(mla(None, 3));
}

/// Values wider than the scores' heads (dn + r = 8 < 10): queries and keys padded instead.
#[test]
fn mla_with_wide_values_gradients_match_finite_differences() {
    let mut c = mla(Some(5), 10);
    c.untie_embeddings_and_output_weights = false;
    check(c);
}

/// The names Megatron's MLASelfAttention gives its parameters.
#[test]
fn mla_parameters_have_megatrons_names() {
    let (_, table) = GptModel::build(mla(Some(5), 3), &Device::Cpu, DType::F32, 3).unwrap();
    let names: Vec<String> = table.ids().map(|id| table.meta(id).name.clone()).collect();
    for (n, shape) in [
        ("decoder.layers.0.self_attention.linear_q_down_proj.weight", vec![5, 16]),
        ("decoder.layers.0.self_attention.q_layernorm.weight", vec![5]),
        ("decoder.layers.0.self_attention.linear_q_up_proj.weight", vec![4 * 8, 5]),
        ("decoder.layers.0.self_attention.linear_kv_down_proj.weight", vec![6 + 4, 16]),
        ("decoder.layers.0.self_attention.kv_layernorm.weight", vec![6]),
        ("decoder.layers.1.self_attention.linear_kv_up_proj.weight", vec![4 * (4 + 3), 6]),
        ("decoder.layers.1.self_attention.linear_proj.weight", vec![16, 4 * 3]),
    ] {
        let id = table.ids().find(|&id| table.meta(id).name == n).unwrap_or_else(|| panic!("{n} not in {names:?}"));
        assert_eq!(table.meta(id).global_shape.dims(), shape.as_slice(), "{n}");
    }
    assert!(!names.iter().any(|n| n.contains("linear_qkv")), "{names:?}");
}

/// transformers' DeepseekV3Attention (5.25, `fixtures/mla/make_mla_fixture.py`) on a fixed input:
/// its weights loaded under Megatron's names (q_a_proj → linear_q_down_proj, kv_a_proj_with_mqa →
/// linear_kv_down_proj, kv_b_proj → linear_kv_up_proj, …, the layouts the same), the layer's output
/// within 2e-5 × its largest value of transformers' (f32 rounding), with a query latent and
/// without, and with YaRN (factor 40, mscale_all_dim 0.8: blended frequencies, cos and sin and the
/// softmax scaled).
#[test]
fn mla_matches_transformers_deepseek_v3_attention() {
    use ferrotron_core::{Module, ParamTableBuilder, Tensor};
    use ferrotron_parallel::{ProcessGroups, TensorParallel};
    use ferrotron_transformer::mla::{MlaAttention, MlaDims};
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mla/mla.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let get = |n: &str| -> Vec<f32> {
        let t = st.tensor(n).unwrap_or_else(|e| panic!("{n}: {e}"));
        t.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
    };
    let yarn = ferrotron_kernels::Yarn { mscale: 1.0, mscale_all_dim: 0.8, ..ferrotron_kernels::Yarn::megatron(40.0) };
    for (prefix, q_lora_rank, yarn) in
        [("lora.", Some(5), None), ("direct.", None, None), ("yarn.", Some(5), Some(yarn))]
    {
        let spec =
            MlaSpec { q_lora_rank, kv_lora_rank: 6, qk_head_dim: 4, qk_pos_emb_head_dim: 4, v_head_dim: 3, yarn };
        let dims = MlaDims {
            hidden: 16,
            heads: 4,
            norm: NormSpec::plain(NormKind::RmsNorm, 1e-5),
            std: 0.02,
            out_std: 0.02,
            bias: false,
            rope: (10000.0, None),
            softmax: Default::default(),
        };
        let tp = TensorParallel::new(ProcessGroups::single().tp, false);
        let mut p = ParamTableBuilder::default();
        let attn = MlaAttention::new(&mut p, "attn", spec, &dims, &tp).unwrap();
        let table = p.build(&Device::Cpu, DType::F32, 0).unwrap();
        for id in table.ids() {
            let ours = &table.meta(id).name;
            let hf = [
                ("linear_q_down_proj", "q_a_proj"),
                ("q_layernorm", "q_a_layernorm"),
                ("linear_q_up_proj", "q_b_proj"),
                ("linear_q_proj", "q_proj"),
                ("linear_kv_down_proj", "kv_a_proj_with_mqa"),
                ("kv_layernorm", "kv_a_layernorm"),
                ("linear_kv_up_proj", "kv_b_proj"),
                ("linear_proj", "o_proj"),
            ]
            .iter()
            .find(|(m, _)| ours == &format!("attn.{m}.weight"))
            .map(|(_, h)| format!("{prefix}{h}.weight"))
            .unwrap_or_else(|| panic!("{ours} has no transformers name"));
            table.param(id).unwrap().copy_from_f32(&get(&hf)).unwrap();
        }
        let x = Tensor::from_vec(get(&format!("{prefix}x")), [2, 6, 16], &Device::Cpu).unwrap();
        let (y, _) = attn.forward(&Cx::new(&table, false), &x).unwrap();
        let (y, want) = (y.to_vec_f32().unwrap(), get(&format!("{prefix}y")));
        let err = y.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        let scale = want.iter().map(|v| v.abs()).fold(0f32, f32::max);
        assert!(scale > 0.1, "a fixture output of substance");
        assert!(
            err <= 2e-6 * scale.max(1.0) * 10.0,
            "{prefix} largest difference from transformers {err} (outputs up to {scale})"
        );
    }
}

/// What it is not built with is refused by name.
#[test]
fn mla_refuses_what_it_is_not_built_with() {
    let bad = |c: TransformerConfig| GptModel::build(c, &Device::Cpu, DType::F32, 3).err().unwrap().to_string();
    let mut c = mla(Some(5), 3);
    c.layer.attention.qk_layernorm = true;
    assert!(bad(c).contains("--qk-layernorm"));
    let mut c = mla(Some(5), 3);
    c.position_embedding = ferrotron_transformer::spec::PositionEmbedding::LearnedAbsolute;
    assert!(bad(c).contains("rope"));
    let mut c = mla(Some(5), 3);
    c.layer.attention.mla.as_mut().unwrap().qk_pos_emb_head_dim = 3;
    assert!(bad(c).contains("--qk-pos-emb-head-dim"));
}

/// The sink softmax on multi-latent attention's padded heads (the values padded to the scores'
/// width, then the queries and keys): its logits' gradients and the rest against differences.
#[test]
fn mla_with_a_learned_sink_gradients_match_finite_differences() {
    for v_head_dim in [3, 10] {
        let mut c = mla(Some(5), v_head_dim);
        c.layer.attention.softmax = ferrotron_transformer::spec::SoftmaxType::Learnable;
        check(c);
    }
}
