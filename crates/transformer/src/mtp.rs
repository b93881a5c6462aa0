//! Multi-token prediction (DeepSeek-V3's MTP; Megatron's `--mtp-num-layers`): after the decoder,
//! depth k = 1..D predicts the token k + 1 places ahead of each position.
//!
//! Depth k, at position i: e = embed(token[i + k]) (word + learned position i + k, and the
//! embedding's dropout), h = the previous depth's output (depth 1: the decoder's, after its final
//! norm); x = eh_proj([enorm(e) | hnorm(h)]) (a column-parallel [H, 2H] projection, output gathered,
//! then split along the sequence under sequence parallelism); out = final_layernorm(layer(x)), a
//! transformer layer of the decoder's last layer's kind. The shared output layer turns `out` into
//! logits for label[i + k]; the last k positions (rolled in as token 0, label 0, mask 0) do not
//! count. The objective adds (loss_scaling_factor / D) × Σ_k mean_k, each depth's mean over its
//! own (rolled) loss tokens, to the language-model loss.
//!
//! Shapes: tokens, labels, loss mask [B, T]; e, h, out [B, T, H] ([B, T/tp, H] under sequence
//! parallelism); the concatenation [B, T(/tp), 2H]. Backward: dout → final norm → layer → (gather
//! along T under SP) → eh_proj → split into d[enorm(e)] | d[hnorm(h)] → the two norms: d e goes
//! to the embedding, d h adds into the previous depth's (or the decoder's) output gradient.
//!
//! Parameter names are Megatron's: `mtp.layers.{k}.{enorm,hnorm,eh_proj,final_layernorm}.weight`
//! and `mtp.layers.{k}.transformer_layer.…` (k from 0).

use crate::concat::{cat_last, split_last};
use crate::config::TransformerConfig;
use crate::dropout::HiddenDropout;
use crate::layer::{Residual, TransformerLayer};
use crate::norm::Norm;
use ferrotron_core::{Cx, Module, ParamId, ParamTableBuilder, Result, Saved, Tensor, invalid};
use ferrotron_parallel::{ColumnParallelLinear, TensorParallel, VocabParallelEmbedding};

/// What `--mtp-num-layers` and `--mtp-loss-scaling-factor` ask for.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MtpSpec {
    /// D: how many tokens past the next one are predicted (one layer each).
    pub num_layers: usize,
    /// The MTP losses' weight against the language-model loss (Megatron's default 0.1), shared
    /// by the depths.
    pub loss_scaling_factor: f32,
}

impl MtpSpec {
    /// Each depth's weight in the objective: loss_scaling_factor / D.
    pub fn depth_weight(&self) -> f64 {
        self.loss_scaling_factor as f64 / self.num_layers.max(1) as f64
    }
}

/// One depth's modules.
pub struct MtpLayer {
    pub enorm: Norm,
    pub hnorm: Norm,
    pub eh_proj: ColumnParallelLinear,
    pub layer: TransformerLayer,
    pub final_layernorm: Norm,
    /// The embedding's dropout at this depth (its own draws).
    pub dropout: Option<HiddenDropout>,
    tp: TensorParallel,
}

/// What a depth's forward keeps.
pub struct MtpLayerSaved {
    enorm: Saved,
    hnorm: Saved,
    proj: Saved,
    layer: Saved,
    final_norm: Saved,
}

impl MtpLayerSaved {
    /// Activation bytes held.
    pub fn bytes(&self) -> usize {
        [&self.enorm, &self.hnorm, &self.proj, &self.layer, &self.final_norm].iter().map(|s| s.bytes()).sum()
    }
}

/// The MTP depths of the last pipeline stage, and the word (and position) embedding they look up.
pub struct Mtp {
    pub spec: MtpSpec,
    pub layers: Vec<MtpLayer>,
    /// The word embedding: the model's own on a stage that also embeds, else the last stage's
    /// copy of it (the tied output layer, or a copy kept for MTP alone when untied).
    pub embedding: VocabParallelEmbedding,
    /// Learned absolute positions (only where the stage holds the model's own table).
    pub position_embeddings: Option<ParamId>,
}

impl MtpLayer {
    /// Depth `k` (0-based), its transformer layer built as the decoder's last layer.
    pub fn new(p: &mut ParamTableBuilder, k: usize, c: &TransformerConfig, tp: &TensorParallel) -> Result<Self> {
        let prefix = format!("mtp.layers.{k}");
        let (h, norm, sp) = (c.hidden_size, c.norm_spec(), tp.sp());
        let enorm = Norm::new(p, &format!("{prefix}.enorm"), norm, h, sp)?;
        let hnorm = Norm::new(p, &format!("{prefix}.hnorm"), norm, h, sp)?;
        let std = c.init_method_std;
        let eh_proj = ColumnParallelLinear::new(p, &format!("{prefix}.eh_proj"), 2 * h, h, false, std, tp, 1)?
            .with_gather_output(true);
        let last = c.num_layers.saturating_sub(1);
        let layer = TransformerLayer::new(p, &format!("{prefix}.transformer_layer"), c, tp, last)?;
        let final_layernorm = Norm::new(p, &format!("{prefix}.final_layernorm"), norm, h, sp)?;
        let dropout = HiddenDropout::new(c.hidden_dropout, &format!("{prefix}.embedding.dropout"), h, tp);
        Ok(MtpLayer { enorm, hnorm, eh_proj, layer, final_layernorm, dropout, tp: tp.clone() })
    }

    /// out = final_layernorm(layer(eh_proj([enorm(e) | hnorm(h)]))), from this depth's
    /// embedding `e` and the previous depth's output `h`.
    pub fn forward(&self, cx: &Cx, e: &Tensor, h: &Tensor) -> Result<(Tensor, MtpLayerSaved)> {
        let (en, s_e) = self.enorm.forward(cx, e)?;
        let (hn, s_h) = self.hnorm.forward(cx, h)?;
        let (x, s_p) = self.eh_proj.forward(cx, &cat_last(&[&en, &hn])?)?;
        // The projection's output is whole (gathered); the layer takes this rank's sequence part.
        let x = if self.tp.sp() { self.tp.split_seq(&x)? } else { x };
        let (r, s_l) = self.layer.forward_parts(cx, Residual::Sum(x))?;
        let (_, out, s_f) = r.norm(cx, &self.final_layernorm)?;
        Ok((out, MtpLayerSaved { enorm: s_e, hnorm: s_h, proj: s_p, layer: s_l, final_norm: s_f }))
    }

    /// (d e, d h) from d out; parameter gradients added into main_grad.
    pub fn backward(&self, cx: &Cx, s: MtpLayerSaved, dout: &Tensor) -> Result<(Tensor, Tensor)> {
        let d = self.final_layernorm.backward(cx, s.final_norm, dout)?;
        let d = self.layer.backward(cx, s.layer, &d)?;
        let d = if self.tp.sp() { self.tp.gather_seq(&d)? } else { d };
        let dcat = self.eh_proj.backward(cx, s.proj, &d)?;
        let [den, dhn]: [Tensor; 2] = split_last(&dcat, &[dcat.shape().last() / 2; 2])?
            .try_into()
            .map_err(|_| invalid("mtp split", "two halves"))?;
        let de = self.enorm.backward(cx, s.enorm, &den)?;
        let dh = self.hnorm.backward(cx, s.hnorm, &dhn)?;
        Ok((de, dh))
    }
}

/// x [B, T] (token ids, labels or the loss mask) moved `k` places left along T, the last k
/// columns zero (Megatron's `roll_tensor` applied k times).
pub fn roll_left(x: &Tensor, k: usize) -> Result<Tensor> {
    let dims = x.dims();
    if dims.len() != 2 {
        return Err(invalid("mtp roll", format!("expected [batch, seq], got {dims:?}")));
    }
    let t = dims[1];
    let out = Tensor::zeros(dims.to_vec(), x.dtype(), x.device())?;
    if k < t {
        out.narrow(1, 0..t - k)?.copy_from(&x.narrow(1, k..t)?)?;
    }
    Ok(out)
}

impl Mtp {
    /// Ids of the learned positions depth `k` embeds for rows `start..start + len` of each of `b`
    /// sequences of `t` tokens: i + k, and 0 where that passes the end (as the rolled tokens).
    pub fn positions(b: usize, t: usize, start: usize, len: usize, k: usize) -> Vec<u32> {
        let row = (start..start + len).map(|i| if i + k < t { (i + k) as u32 } else { 0 });
        let row: Vec<u32> = row.collect();
        (0..b).flat_map(|_| row.iter().copied()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrotron_core::Device;

    #[test]
    fn rolling_moves_columns_left_and_zeroes_the_tail() {
        let x = Tensor::from_vec(vec![1u32, 2, 3, 4, 5, 6, 7, 8], [2, 4], &Device::Cpu).unwrap();
        assert_eq!(roll_left(&x, 1).unwrap().to_vec::<u32>().unwrap(), [2, 3, 4, 0, 6, 7, 8, 0]);
        assert_eq!(roll_left(&x, 3).unwrap().to_vec::<u32>().unwrap(), [4, 0, 0, 0, 8, 0, 0, 0]);
        assert_eq!(roll_left(&x, 4).unwrap().to_vec::<u32>().unwrap(), [0; 8]);
        assert!(roll_left(&x.reshape([8]).unwrap(), 1).is_err());
    }

    #[test]
    fn positions_follow_the_rolled_tokens() {
        assert_eq!(Mtp::positions(2, 4, 0, 4, 1), [1, 2, 3, 0, 1, 2, 3, 0]);
        // A sequence-parallel rank's second half of each row, two places ahead.
        assert_eq!(Mtp::positions(1, 4, 2, 2, 2), [0, 0]);
        assert_eq!(Mtp::positions(1, 6, 2, 2, 2), [4, 5]);
    }
}
