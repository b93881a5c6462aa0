//! Mamba hybrids: Megatron's hybrid layer pattern (`--hybrid-override-pattern`, one character a
//! layer: `M` Mamba, `*` attention, `-` MLP, `E` mixture-of-experts MLP; `|` between pipeline
//! stages) both ways, and the spec that a pattern and a Mamba spec make.

use ferrotron_ssm::MambaSpec;
use ferrotron_transformer::TransformerConfig;
use ferrotron_transformer::spec::{Hybrid, LayerKind, MlpSpec, OtherMlp};
use std::sync::Arc;

/// A parsed pattern.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pattern {
    pub kinds: Vec<LayerKind>,
    /// Per layer: an `E` (mixture-of-experts) layer.
    pub moe: Vec<bool>,
    /// Layers per pipeline stage, in model order, when the pattern marks stages with `|`.
    pub stages: Option<Vec<usize>>,
}

/// A pattern's layers and stages.
pub fn parse_pattern(pattern: &str) -> Result<Pattern, String> {
    let mut kinds = Vec::new();
    let mut moe = Vec::new();
    let mut stages = vec![0usize];
    for (i, ch) in pattern.chars().enumerate() {
        let (k, e) = match ch {
            'M' => (LayerKind::Mixer, false),
            '*' => (LayerKind::Attention, false),
            '-' => (LayerKind::Mlp, false),
            'E' => (LayerKind::Mlp, true),
            '|' => {
                stages.push(0);
                continue;
            }
            c => {
                return Err(format!(
                    "--hybrid-override-pattern {pattern:?}: character {c:?} at {i} is not a layer; use M (Mamba), * (attention), - (MLP) or E (mixture of experts)"
                ));
            }
        };
        kinds.push(k);
        moe.push(e);
        *stages.last_mut().expect("one stage at least") += 1;
    }
    if kinds.is_empty() {
        return Err("--hybrid-override-pattern is empty: give one character per layer, e.g. M-M*-".into());
    }
    if stages.contains(&0) {
        return Err(format!("--hybrid-override-pattern {pattern:?}: a pipeline stage between '|' marks has no layers"));
    }
    Ok(Pattern { kinds, moe, stages: (stages.len() > 1).then_some(stages) })
}

/// The pattern of a config's layers (None when it is not a hybrid).
pub fn pattern_of(c: &TransformerConfig) -> Option<String> {
    let h = c.layer.hybrid.as_ref()?;
    let moe = crate::moe_spec(c).is_some();
    Some(
        h.kinds
            .iter()
            .enumerate()
            .map(|(i, k)| match k {
                LayerKind::Mixer => 'M',
                LayerKind::Attention => '*',
                // A dense layer among MoE ones takes `other_mlp`.
                LayerKind::Mlp if moe && !matches!(c.layer.mlp_of(i), MlpSpec::Dense { .. }) => 'E',
                LayerKind::Mlp => '-',
                LayerKind::Transformer => 'T',
            })
            .collect(),
    )
}

/// The Mamba spec of a hybrid config's mixer layers.
pub fn mamba_spec(c: &TransformerConfig) -> Option<&MambaSpec> {
    c.layer.hybrid.as_ref()?.mixer.as_ref()?.as_any()?.downcast_ref::<MambaSpec>()
}

/// Makes `c` the hybrid of `pattern` with `mamba` mixers. Its MLP (`c.layer.mlp`) is what `E`
/// layers take when it is a mixture of experts, else what `-` layers take; with a mixture of
/// experts, `-` layers take `dense`. Errors name the flag and the fix.
pub fn make_hybrid(c: &mut TransformerConfig, pattern: &str, mamba: MambaSpec, dense: MlpSpec) -> Result<(), String> {
    let Pattern { kinds, moe: moe_layers, .. } = parse_pattern(pattern)?;
    if kinds.len() != c.num_layers {
        return Err(format!(
            "--hybrid-override-pattern {pattern:?} has {} layers but --num-layers is {}: give one character per layer ('|' marks not counted)",
            kinds.len(),
            c.num_layers
        ));
    }
    let has_moe = crate::moe_spec(c).is_some();
    if moe_layers.contains(&true) && !has_moe {
        return Err(format!(
            "--hybrid-override-pattern {pattern:?} has mixture-of-experts (E) layers: add --num-experts N, or use - for dense MLPs"
        ));
    }
    if has_moe {
        if c.layer.other_mlp.is_some() {
            return Err("--moe-layer-freq and --hybrid-override-pattern both pick the MoE layers: keep the pattern (E for MoE layers)".into());
        }
        c.layer.other_mlp = Some(OtherMlp { mlp: dense, layers: moe_layers.iter().map(|&e| !e).collect() });
    }
    mamba.dims(c.hidden_size)?;
    c.layer.hybrid = Some(Hybrid { kinds, mixer: Some(Arc::new(mamba)) });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_parse_and_render() {
        let p = parse_pattern("M-|M*E").unwrap();
        use LayerKind::*;
        assert_eq!(p.kinds, vec![Mixer, Mlp, Mixer, Attention, Mlp]);
        assert_eq!(p.moe, vec![false, false, false, false, true]);
        assert_eq!(p.stages, Some(vec![2, 3]));
        assert_eq!(parse_pattern("M*").unwrap().stages, None);
        assert!(parse_pattern("").unwrap_err().contains("empty"));
        assert!(parse_pattern("M|").unwrap_err().contains("no layers"));
        let c = crate::mamba_hybrid(crate::MambaSize::Tiny);
        assert_eq!(pattern_of(&c).as_deref(), Some("M-M*M-"));
        assert_eq!(mamba_spec(&c).map(|m| m.head_dim), Some(32));
        assert_eq!(pattern_of(&crate::llama(crate::LlamaSize::Tiny)), None);
    }
}
