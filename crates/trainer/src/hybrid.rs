//! Mamba hybrids' flags (`--hybrid-layer-pattern`, its deprecated `--hybrid-override-pattern`,
//! Megatron's ratios, `--mamba-*`) as a run records them, and the spec they make.

use crate::settings::TrainArgs;
use anyhow::{Context, bail};
use ferrotron_ssm::MambaSpec;
use serde::{Deserialize, Serialize};

/// A hybrid run's layer pattern and Mamba-2 sizes, as Megatron names the flags.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct MambaSettings {
    /// Megatron's --hybrid-layer-pattern (recorded by earlier builds as hybrid-override-pattern).
    #[serde(alias = "hybrid-override-pattern")]
    pub hybrid_layer_pattern: String,
    pub mamba_state_dim: usize,
    pub mamba_head_dim: usize,
    pub mamba_num_groups: usize,
    #[serde(default)]
    pub mamba_num_heads: Option<usize>,
    /// The gated norm over the whole width (transformers' Mamba2).
    #[serde(default)]
    pub mamba_norm_ungrouped: bool,
}

impl MambaSettings {
    /// The flags gathered, Megatron's defaults filled in; None without a pattern (a Mamba flag is
    /// then an error naming it).
    pub fn from_args(a: &TrainArgs) -> anyhow::Result<Option<MambaSettings>> {
        let ratios = a.hybrid_attention_ratio.is_some() || a.hybrid_mlp_ratio.is_some();
        let pattern = match (&a.hybrid_layer_pattern, &a.hybrid_override_pattern) {
            (Some(_), Some(_)) => bail!(
                "--hybrid-layer-pattern and --hybrid-override-pattern (its deprecated name) both given: keep --hybrid-layer-pattern"
            ),
            (Some(p), None) | (None, Some(p)) if ratios => bail!(
                "--hybrid-layer-pattern {p} and --hybrid-attention-ratio / --hybrid-mlp-ratio both place the layers: keep the pattern"
            ),
            (Some(p), None) | (None, Some(p)) => Some(p.clone()),
            (None, None) if ratios => {
                let n = a.num_layers.context("--hybrid-attention-ratio / --hybrid-mlp-ratio need --num-layers")?;
                let (att, mlp) = (a.hybrid_attention_ratio.unwrap_or(0.0), a.hybrid_mlp_ratio.unwrap_or(0.0));
                Some(ferrotron_models::hybrid::pattern_from_ratios(n, att, mlp).map_err(anyhow::Error::msg)?)
            }
            (None, None) => None,
        };
        let Some(pattern) = pattern else {
            for (flag, given) in [
                ("--mamba-state-dim", a.mamba_state_dim.is_some()),
                ("--mamba-head-dim", a.mamba_head_dim.is_some()),
                ("--mamba-num-groups", a.mamba_num_groups.is_some()),
                ("--mamba-num-heads", a.mamba_num_heads.is_some()),
                ("--is-hybrid-model", a.is_hybrid_model),
                ("--mamba-norm-ungrouped", a.mamba_norm_ungrouped),
            ] {
                if given {
                    bail!("{flag} configures Mamba layers: add --hybrid-layer-pattern (e.g. M-M*-), or drop it");
                }
            }
            return Ok(None);
        };
        let d = MambaSpec::default();
        Ok(Some(MambaSettings {
            hybrid_layer_pattern: pattern,
            mamba_state_dim: a.mamba_state_dim.unwrap_or(d.state_dim),
            mamba_head_dim: a.mamba_head_dim.unwrap_or(d.head_dim),
            mamba_num_groups: a.mamba_num_groups.unwrap_or(d.groups),
            mamba_num_heads: a.mamba_num_heads,
            mamba_norm_ungrouped: a.mamba_norm_ungrouped,
        }))
    }

    /// The spec; the gated norm's epsilon is the layers' (`--norm-epsilon`; Megatron's mixer fixes
    /// it at 1e-5, its default norm epsilon).
    pub fn spec(&self, norm_eps: f64) -> MambaSpec {
        MambaSpec {
            norm_eps,
            state_dim: self.mamba_state_dim,
            head_dim: self.mamba_head_dim,
            groups: self.mamba_num_groups,
            heads: self.mamba_num_heads,
            norm_per_group: !self.mamba_norm_ungrouped,
            ..MambaSpec::default()
        }
    }
}

/// The hybrid flags that rebuild `c` (all None for a plain transformer).
pub fn model_args(c: &ferrotron_transformer::TransformerConfig, a: &mut TrainArgs) {
    let (Some(pattern), Some(m)) = (ferrotron_models::hybrid::pattern_of(c), ferrotron_models::hybrid::mamba_spec(c))
    else {
        return;
    };
    a.hybrid_layer_pattern = Some(pattern);
    a.hybrid_override_pattern = None;
    (a.hybrid_attention_ratio, a.hybrid_mlp_ratio) = (None, None);
    a.mamba_state_dim = Some(m.state_dim);
    a.mamba_head_dim = Some(m.head_dim);
    a.mamba_num_groups = Some(m.groups);
    a.mamba_num_heads = m.heads;
    a.mamba_norm_ungrouped = !m.norm_per_group;
    // A hybrid's MoE layers come from the pattern, not from --moe-layer-freq.
    a.moe_layer_freq = None;
}
