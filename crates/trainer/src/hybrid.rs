//! Mamba hybrids' flags (`--hybrid-override-pattern`, `--mamba-*`) as a run records them, and the
//! spec they make.

use crate::settings::TrainArgs;
use anyhow::bail;
use ferrotron_ssm::MambaSpec;
use serde::{Deserialize, Serialize};

/// A hybrid run's layer pattern and Mamba-2 sizes, as Megatron names the flags.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct MambaSettings {
    pub hybrid_override_pattern: String,
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
        if a.hybrid_attention_ratio.is_some() || a.hybrid_mlp_ratio.is_some() {
            bail!(
                "--hybrid-attention-ratio / --hybrid-mlp-ratio (a pattern allocated from ratios) are not read: spell the layers out with --hybrid-override-pattern, e.g. M-M*-"
            );
        }
        let Some(pattern) = a.hybrid_override_pattern.clone() else {
            for (flag, given) in [
                ("--mamba-state-dim", a.mamba_state_dim.is_some()),
                ("--mamba-head-dim", a.mamba_head_dim.is_some()),
                ("--mamba-num-groups", a.mamba_num_groups.is_some()),
                ("--mamba-num-heads", a.mamba_num_heads.is_some()),
                ("--is-hybrid-model", a.is_hybrid_model),
                ("--mamba-norm-ungrouped", a.mamba_norm_ungrouped),
            ] {
                if given {
                    bail!("{flag} configures Mamba layers: add --hybrid-override-pattern (e.g. M-M*-), or drop it");
                }
            }
            return Ok(None);
        };
        let d = MambaSpec::default();
        Ok(Some(MambaSettings {
            hybrid_override_pattern: pattern,
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
    a.hybrid_override_pattern = Some(pattern);
    a.mamba_state_dim = Some(m.state_dim);
    a.mamba_head_dim = Some(m.head_dim);
    a.mamba_num_groups = Some(m.groups);
    a.mamba_num_heads = m.heads;
    a.mamba_norm_ungrouped = !m.norm_per_group;
    // A hybrid's MoE layers come from the pattern, not from --moe-layer-freq.
    a.moe_layer_freq = None;
}
