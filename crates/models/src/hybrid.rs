//! Mamba hybrids: Megatron's hybrid layer pattern (`--hybrid-layer-pattern`, one character a
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
            '/' => {
                return Err(format!(
                    "--hybrid-layer-pattern {pattern:?}: multi-token prediction layers (after '/') are not built; drop them"
                ));
            }
            c @ ('G' | 'D' | '+') => {
                let what = match c {
                    'G' => "gated DeltaNet",
                    'D' => "DeepSeek sparse attention",
                    _ => "multi-latent attention",
                };
                return Err(format!(
                    "--hybrid-layer-pattern {pattern:?}: {what} layers ({c:?}) are not built; use M, *, - or E"
                ));
            }
            c => {
                return Err(format!(
                    "--hybrid-layer-pattern {pattern:?}: character {c:?} at {i} is not a layer; use M (Mamba), * (attention), - (MLP) or E (mixture of experts)"
                ));
            }
        };
        kinds.push(k);
        moe.push(e);
        *stages.last_mut().expect("one stage at least") += 1;
    }
    if kinds.is_empty() {
        return Err("--hybrid-layer-pattern is empty: give one character per layer, e.g. M-M*-".into());
    }
    if stages.contains(&0) {
        return Err(format!("--hybrid-layer-pattern {pattern:?}: a pipeline stage between '|' marks has no layers"));
    }
    Ok(Pattern { kinds, moe, stages: (stages.len() > 1).then_some(stages) })
}

/// Megatron's pattern from the deprecated ratio flags (`--hybrid-attention-ratio`,
/// `--hybrid-mlp-ratio`): attention layers spread evenly among Mamba ones, then MLP layers
/// spread evenly over the Mamba layers left (Megatron's `pattern_from_ratios`).
pub fn pattern_from_ratios(num_layers: usize, attention: f64, mlp: f64) -> Result<String, String> {
    let ok = |r: f64| (0.0..=1.0).contains(&r);
    if num_layers == 0 || !ok(attention) || !ok(mlp) || attention + mlp > 1.0 {
        return Err(format!(
            "--hybrid-attention-ratio {attention} and --hybrid-mlp-ratio {mlp} must each lie in [0, 1], their sum at most 1, over at least one layer"
        ));
    }
    // Walking the Mamba layers, one becomes `with` whenever the budget x falls below half a
    // layer; x starts at and grows by `step` Mamba layers per replacement.
    let spread = |kinds: &mut [char], step: f64, with: char| {
        let mut x = step;
        for k in kinds.iter_mut().filter(|k| **k == 'M') {
            if x < 0.5 {
                *k = with;
                x += step;
            } else {
                x -= 1.0;
            }
        }
    };
    let mut kinds = vec!['M'; num_layers];
    let attention_count = (num_layers as f64 * attention).round() as usize;
    let mamba = num_layers - attention_count;
    // attention_count + 1 runs of Mamba layers, attention between them.
    spread(&mut kinds, mamba as f64 / (attention_count + 1) as f64, '*');
    let mlp_count = (num_layers as f64 * mlp).round() as usize;
    if mlp_count > 0 {
        spread(&mut kinds, mamba.saturating_sub(mlp_count) as f64 / mlp_count as f64, '-');
    }
    Ok(kinds.into_iter().collect())
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
            "--hybrid-layer-pattern {pattern:?} has {} layers but --num-layers is {}: give one character per layer ('|' marks not counted)",
            kinds.len(),
            c.num_layers
        ));
    }
    let has_moe = crate::moe_spec(c).is_some();
    if moe_layers.contains(&true) && !has_moe {
        return Err(format!(
            "--hybrid-layer-pattern {pattern:?} has mixture-of-experts (E) layers: add --num-experts N, or use - for dense MLPs"
        ));
    }
    if has_moe {
        if c.layer.other_mlp.is_some() {
            return Err("--moe-layer-freq and --hybrid-layer-pattern both pick the MoE layers: keep the pattern (E for MoE layers)".into());
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
        for (c, what) in [('G', "gated DeltaNet"), ('D', "sparse attention"), ('+', "multi-latent")] {
            assert!(parse_pattern(&format!("M{c}")).unwrap_err().contains(what));
        }
        assert!(parse_pattern("M*/MM").unwrap_err().contains("multi-token prediction"));
    }

    /// Megatron's allocation, worked through by hand: 10 layers at 0.2 attention → x starts at
    /// 8/3 Mamba layers and turns layers 3 and 6; then 0.2 MLP → every third of the 8 Mamba ones.
    #[test]
    fn ratios_give_megatrons_pattern() {
        assert_eq!(pattern_from_ratios(10, 0.0, 0.0).unwrap(), "MMMMMMMMMM");
        assert_eq!(pattern_from_ratios(10, 0.2, 0.0).unwrap(), "MMM*MM*MMM");
        assert_eq!(pattern_from_ratios(10, 0.2, 0.2).unwrap(), "MMM*-M*MM-");
        assert_eq!(pattern_from_ratios(4, 0.5, 0.0).unwrap(), "M**M");
        assert_eq!(
            (pattern_from_ratios(1, 0.0, 0.0).unwrap(), pattern_from_ratios(1, 1.0, 0.0).unwrap()),
            ("M".into(), "*".into())
        );
        let p = pattern_from_ratios(10, 0.3, 0.3).unwrap();
        let n = |c| p.chars().filter(|x| *x == c).count();
        assert_eq!((n('*'), n('-'), n('M')), (3, 3, 4), "{p}");
        assert!(pattern_from_ratios(4, 0.7, 0.5).unwrap_err().contains("at most 1"));
    }
}
