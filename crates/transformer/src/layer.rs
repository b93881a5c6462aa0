//! Pre-norm transformer layer and the block of layers.
//!
//! layer: x1 = x + attn(input_layernorm(x)); y = x1 + mlp(pre_mlp_layernorm(x1)).
//! Backward: the residual stream adds: dx1 = dy + ln2ᵀ(mlpᵀ(dy)); dx = dx1 + ln1ᵀ(attnᵀ(dx1)).

use crate::attention::{AttentionDims, SelfAttention};
use crate::config::TransformerConfig;
use crate::mlp::Mlp;
use crate::norm::Norm;
use crate::spec::{MlpSpec, PositionEmbedding};
use ferrotron_core::{Cx, Module, ParamTableBuilder, Result, Saved, Tensor, invalid};
use ferrotron_kernels as k;
use ferrotron_parallel::TensorParallel;

pub struct TransformerLayer {
    pub input_layernorm: Norm,
    pub self_attention: SelfAttention,
    pub pre_mlp_layernorm: Norm,
    pub mlp: Box<dyn Module>,
}

impl TransformerLayer {
    pub fn new(p: &mut ParamTableBuilder, prefix: &str, c: &TransformerConfig, tp: &TensorParallel) -> Result<Self> {
        let (h, eps, norm, sp) = (c.hidden_size, c.norm_epsilon, c.layer.norm, tp.sp());
        let std = c.init_method_std;
        let out_std = std / (2.0 * c.num_layers as f32).sqrt();
        let dims = AttentionDims {
            hidden: h,
            heads: c.num_attention_heads,
            groups: c.num_query_groups,
            norm,
            eps,
            std,
            out_std,
            rope_base: match c.position_embedding {
                PositionEmbedding::Rope { base } => Some(base),
                _ => None,
            },
        };
        let input_layernorm = Norm::new(p, &format!("{prefix}.input_layernorm"), norm, h, eps, sp)?;
        let self_attention = SelfAttention::new(p, &format!("{prefix}.self_attention"), &dims, &c.layer.attention, tp)?;
        let pre_mlp_layernorm = Norm::new(p, &format!("{prefix}.pre_mlp_layernorm"), norm, h, eps, sp)?;
        let mlp: Box<dyn Module> = match &c.layer.mlp {
            MlpSpec::Dense { activation, bias } => Box::new(Mlp::new(
                p,
                &format!("{prefix}.mlp"),
                h,
                c.ffn_hidden_size,
                *activation,
                *bias,
                std,
                out_std,
                tp,
            )?),
            MlpSpec::Custom(f) => f.build(&format!("{prefix}.mlp"), h, p)?,
        };
        Ok(TransformerLayer { input_layernorm, self_attention, pre_mlp_layernorm, mlp })
    }
}

fn four(op: &'static str, s: Saved) -> Result<[Saved; 4]> {
    s.children.try_into().map_err(|_| invalid(op, "saved values do not match forward"))
}

impl Module for TransformerLayer {
    fn forward(&self, cx: &Cx, x: &Tensor) -> Result<(Tensor, Saved)> {
        let (h1, s1) = self.input_layernorm.forward(cx, x)?;
        let (a, s2) = self.self_attention.forward(cx, &h1)?;
        let x1 = k::add(x, &a)?;
        let (h2, s3) = self.pre_mlp_layernorm.forward(cx, &x1)?;
        let (m, s4) = self.mlp.forward(cx, &h2)?;
        Ok((k::add(&x1, &m)?, Saved::new(vec![], vec![s1, s2, s3, s4])))
    }

    fn backward(&self, cx: &Cx, saved: Saved, dy: &Tensor) -> Result<Tensor> {
        let [s1, s2, s3, s4] = four("TransformerLayer::backward", saved)?;
        let dh2 = self.mlp.backward(cx, s4, dy)?;
        let dx1 = k::add(dy, &self.pre_mlp_layernorm.backward(cx, s3, &dh2)?)?;
        let dh1 = self.self_attention.backward(cx, s2, &dx1)?;
        k::add(&dx1, &self.input_layernorm.backward(cx, s1, &dh1)?)
    }
}

/// The decoder: layers then the final norm.
pub struct TransformerBlock {
    pub layers: Vec<TransformerLayer>,
    pub final_layernorm: Norm,
}

/// Lowest flat offset of the parameters registered from `first` on (they are registered in
/// order, so every later parameter lies above it).
fn offset(cx: &Cx, first: ferrotron_core::ParamId) -> usize {
    cx.params.range(first).start
}

impl TransformerBlock {
    /// Backward that reports, after the final norm and after each layer, the lowest flat offset
    /// whose gradients this backward has finished (for overlapping the data-parallel reduce).
    pub fn backward_with(
        &self,
        cx: &Cx,
        saved: Saved,
        dy: &Tensor,
        done: &mut dyn FnMut(usize) -> Result<()>,
    ) -> Result<Tensor> {
        let mut children = saved.children;
        let s_final = children.pop().ok_or_else(|| invalid("TransformerBlock::backward", "nothing saved"))?;
        let mut d = self.final_layernorm.backward(cx, s_final, dy)?;
        done(offset(cx, self.final_layernorm.weight))?;
        for (l, s) in self.layers.iter().zip(children).rev() {
            d = l.backward(cx, s, &d)?;
            done(offset(cx, l.input_layernorm.weight))?;
        }
        Ok(d)
    }
}

impl TransformerBlock {
    pub fn new(p: &mut ParamTableBuilder, prefix: &str, c: &TransformerConfig, tp: &TensorParallel) -> Result<Self> {
        let layers = (0..c.num_layers)
            .map(|i| TransformerLayer::new(p, &format!("{prefix}.layers.{i}"), c, tp))
            .collect::<Result<_>>()?;
        let final_layernorm =
            Norm::new(p, &format!("{prefix}.final_layernorm"), c.layer.norm, c.hidden_size, c.norm_epsilon, tp.sp())?;
        Ok(TransformerBlock { layers, final_layernorm })
    }
}

impl Module for TransformerBlock {
    fn forward(&self, cx: &Cx, x: &Tensor) -> Result<(Tensor, Saved)> {
        let mut h = x.clone();
        let mut children = Vec::with_capacity(self.layers.len() + 1);
        for l in &self.layers {
            let (y, s) = l.forward(cx, &h)?;
            children.push(s);
            h = y;
        }
        let (y, s) = self.final_layernorm.forward(cx, &h)?;
        children.push(s);
        Ok((y, Saved::new(vec![], children)))
    }

    fn backward(&self, cx: &Cx, saved: Saved, dy: &Tensor) -> Result<Tensor> {
        self.backward_with(cx, saved, dy, &mut |_| Ok(()))
    }
}
