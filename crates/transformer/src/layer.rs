//! Pre-norm transformer layer and the block of layers.
//!
//! layer: x1 = x + attn(input_layernorm(x)); y = x1 + mlp(pre_mlp_layernorm(x1)), each branch's
//! output through hidden dropout (in training, at a rate above 0) before its add.
//! Backward: the residual stream adds: dx1 = dy + ln2ᵀ(mlpᵀ(dy)); dx = dx1 + ln1ᵀ(attnᵀ(dx1)).
//! The adds next to a norm run inside its kernel (`Norm::forward_add`, `Norm::backward_add`):
//! in a block the layer's own output add x1 + mlp(…) too, in the next layer's input norm or the
//! final norm ([`Residual::Pending`]); only a block without a final norm (a pipeline stage that
//! does not end the model) or a recompute group's saved input ends with a separate add.

use crate::attention::{AttentionDims, SelfAttention};
use crate::config::TransformerConfig;
use crate::dropout::{HiddenDropout, maybe};
use crate::mlp::Mlp;
use crate::norm::Norm;
use crate::recompute::Recompute;
use crate::spec::{MlpSpec, PositionEmbedding};
use ferrotron_core::{Cx, Module, ParamTableBuilder, Result, Saved, Tensor, invalid};
use ferrotron_kernels as k;
use ferrotron_parallel::TensorParallel;

pub struct TransformerLayer {
    pub input_layernorm: Norm,
    pub self_attention: SelfAttention,
    pub pre_mlp_layernorm: Norm,
    pub mlp: Box<dyn Module>,
    /// Hidden dropout on the attention's and the MLP's outputs (None at rate 0).
    attention_dropout_out: Option<HiddenDropout>,
    mlp_dropout_out: Option<HiddenDropout>,
}

impl TransformerLayer {
    /// Layer `index` of the model (0-based; it picks the layer's MLP, `LayerSpec::mlp_of`).
    pub fn new(
        p: &mut ParamTableBuilder,
        prefix: &str,
        c: &TransformerConfig,
        tp: &TensorParallel,
        index: usize,
    ) -> Result<Self> {
        let (h, eps, norm, sp) = (c.hidden_size, c.norm_epsilon, c.layer.norm, tp.sp());
        let std = c.init_method_std;
        let out_std = std / (2.0 * c.num_layers as f32).sqrt();
        let dims = AttentionDims {
            hidden: h,
            head_dim: c.head_dim(),
            heads: c.num_attention_heads,
            groups: c.num_query_groups,
            norm,
            eps,
            std,
            out_std,
            rope: match c.position_embedding {
                PositionEmbedding::Rope { base, scaling } => Some((base, scaling)),
                _ => None,
            },
            attention_dropout: c.attention_dropout,
        };
        let input_layernorm = Norm::new(p, &format!("{prefix}.input_layernorm"), norm, h, eps, sp)?;
        let self_attention = SelfAttention::new(p, &format!("{prefix}.self_attention"), &dims, &c.layer.attention, tp)?;
        let pre_mlp_layernorm = Norm::new(p, &format!("{prefix}.pre_mlp_layernorm"), norm, h, eps, sp)?;
        let mlp: Box<dyn Module> = match c.layer.mlp_of(index) {
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
            MlpSpec::Custom(f) => {
                let prefix = format!("{prefix}.mlp");
                f.build(&crate::spec::FactoryCx { prefix: &prefix, hidden: h, std, out_std, tp }, p)?
            }
        };
        let drop = |site: &str| HiddenDropout::new(c.hidden_dropout, &format!("{prefix}.{site}"), h, tp);
        Ok(TransformerLayer {
            input_layernorm,
            self_attention,
            pre_mlp_layernorm,
            mlp,
            attention_dropout_out: drop("self_attention.dropout"),
            mlp_dropout_out: drop("mlp.dropout"),
        })
    }
}

impl TransformerLayer {
    /// Under context parallelism (more than one rank): the attention over the whole sequence and
    /// the hidden dropouts' masks of this rank's chunks.
    pub fn set_context_parallel(&mut self, cp: &ferrotron_parallel::ContextParallel) {
        self.self_attention.cp = (cp.size() > 1).then(|| cp.clone());
        for d in [&mut self.attention_dropout_out, &mut self.mlp_dropout_out].into_iter().flatten() {
            d.set_context_parallel(cp);
        }
    }
}

/// The residual stream between layers: a tensor, or a layer's output x1 + m not yet summed (the
/// next norm adds it in its own kernel: one pass over the activations fewer per layer).
pub enum Residual {
    Sum(Tensor),
    Pending(Tensor, Tensor),
}

impl Residual {
    /// The stream as one tensor (the add, when still pending).
    pub fn into_sum(self) -> Result<Tensor> {
        match self {
            Residual::Sum(x) => Ok(x),
            Residual::Pending(a, b) => k::add(&a, &b),
        }
    }

    /// `norm` of the stream: (the stream summed, norm(stream), what `norm.backward` takes).
    fn norm(self, cx: &Cx, norm: &Norm) -> Result<(Tensor, Tensor, Saved)> {
        match self {
            Residual::Sum(x) => {
                let (y, s) = norm.forward(cx, &x)?;
                Ok((x, y, s))
            }
            Residual::Pending(a, b) => norm.forward_add(cx, &a, &b),
        }
    }
}

fn four(op: &'static str, s: Saved) -> Result<[Saved; 4]> {
    s.children.try_into().map_err(|_| invalid(op, "saved values do not match forward"))
}

impl TransformerLayer {
    /// Forward from the residual stream `x` (a pending add is summed by the input norm's kernel),
    /// leaving the output's add pending. The saved values are `forward`'s: the backward is the same.
    pub fn forward_parts(&self, cx: &Cx, x: Residual) -> Result<(Residual, Saved)> {
        let (x, h1, s1) = x.norm(cx, &self.input_layernorm)?;
        let (a, s2) = self.self_attention.forward(cx, &h1)?;
        let a = maybe(&self.attention_dropout_out, cx, a)?;
        let (x1, h2, s3) = self.pre_mlp_layernorm.forward_add(cx, &x, &a)?;
        let (m, s4) = self.mlp.forward(cx, &h2)?;
        let m = maybe(&self.mlp_dropout_out, cx, m)?;
        Ok((Residual::Pending(x1, m), Saved::new(vec![], vec![s1, s2, s3, s4])))
    }
}

impl Module for TransformerLayer {
    fn forward(&self, cx: &Cx, x: &Tensor) -> Result<(Tensor, Saved)> {
        let (y, s) = self.forward_parts(cx, Residual::Sum(x.clone()))?;
        Ok((y.into_sum()?, s))
    }

    /// A branch's output linear has a bias whose gradient is Σ rows of the branch's output
    /// gradient; with no dropout between, that is the residual gradient the norm's backward reads
    /// next, so the norm sums it there (`Norm::backward_add_bias`) and the branch skips its pass.
    fn backward(&self, cx: &Cx, saved: Saved, dy: &Tensor) -> Result<Tensor> {
        let [s1, s2, s3, s4] = four("TransformerLayer::backward", saved)?;
        let dx1 = match self.mlp.out_bias().filter(|_| self.mlp_dropout_out.is_none()) {
            Some(b) => {
                let dh2 = self.mlp.backward_without_out_bias(cx, s4, dy)?;
                self.pre_mlp_layernorm.backward_add_bias(cx, s3, &dh2, dy, b)?
            }
            None => {
                let dh2 = self.mlp.backward(cx, s4, &maybe(&self.mlp_dropout_out, cx, dy.clone())?)?;
                self.pre_mlp_layernorm.backward_add(cx, s3, &dh2, dy)?
            }
        };
        match self.self_attention.out_bias().filter(|_| self.attention_dropout_out.is_none()) {
            Some(b) => {
                let dh1 = self.self_attention.backward_without_out_bias(cx, s2, &dx1)?;
                self.input_layernorm.backward_add_bias(cx, s1, &dh1, &dx1, b)
            }
            None => {
                let dh1 =
                    self.self_attention.backward(cx, s2, &maybe(&self.attention_dropout_out, cx, dx1.clone())?)?;
                self.input_layernorm.backward_add(cx, s1, &dh1, &dx1)
            }
        }
    }
}

/// A run of decoder layers (all of them, or one pipeline stage's chunk), then the final norm when
/// this chunk ends the model.
pub struct TransformerBlock {
    pub layers: Vec<TransformerLayer>,
    /// Global index of `layers[0]` (parameter names use global indices).
    pub first_layer: usize,
    pub final_layernorm: Option<Norm>,
    /// Groups of local layer indices, and whether each is recomputed in the backward.
    groups: Vec<(std::ops::Range<usize>, bool)>,
}

/// Lowest flat offset of the parameters registered from `first` on (they are registered in
/// order, so every later parameter lies above it).
fn offset(cx: &Cx, first: ferrotron_core::ParamId) -> usize {
    cx.params.range(first).start
}

impl TransformerBlock {
    /// Every layer and the final norm (one stage).
    pub fn new(p: &mut ParamTableBuilder, prefix: &str, c: &TransformerConfig, tp: &TensorParallel) -> Result<Self> {
        Self::stage(p, prefix, c, tp, 0..c.num_layers, true, Recompute::default())
    }

    /// Layers `layers` (global indices), with the final norm when `final_norm`.
    pub fn stage(
        p: &mut ParamTableBuilder,
        prefix: &str,
        c: &TransformerConfig,
        tp: &TensorParallel,
        layers: std::ops::Range<usize>,
        final_norm: bool,
        recompute: Recompute,
    ) -> Result<Self> {
        let first_layer = layers.start;
        let mut built: Vec<TransformerLayer> = layers
            .map(|i| TransformerLayer::new(p, &format!("{prefix}.layers.{i}"), c, tp, i))
            .collect::<Result<_>>()?;
        for l in &mut built {
            l.self_attention.recompute_core = recompute.selective();
        }
        let final_layernorm = if final_norm {
            Some(Norm::new(
                p,
                &format!("{prefix}.final_layernorm"),
                c.layer.norm,
                c.hidden_size,
                c.norm_epsilon,
                tp.sp(),
            )?)
        } else {
            None
        };
        let groups = recompute.groups(built.len());
        Ok(TransformerBlock { layers: built, first_layer, final_layernorm, groups })
    }

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
        let mut d = dy.clone();
        if let Some(norm) = &self.final_layernorm {
            let s_final = children.pop().ok_or_else(|| invalid("TransformerBlock::backward", "nothing saved"))?;
            d = norm.backward(cx, s_final, &d)?;
            done(offset(cx, norm.weight))?;
        }
        if children.len() != self.groups.len() {
            return Err(invalid("TransformerBlock::backward", "saved values do not match forward"));
        }
        for ((range, recompute), s) in self.groups.iter().zip(children).rev() {
            let per_layer = if *recompute {
                // Run the group's forward again from its saved input, keeping everything this time.
                let x = s.tensors.into_iter().next().ok_or_else(|| invalid("recompute", "no saved input"))?;
                let mut h = Residual::Sum(x);
                let mut v = Vec::with_capacity(range.len());
                for l in &self.layers[range.clone()] {
                    let (y, sl) = l.forward_parts(cx, h)?;
                    v.push(sl);
                    h = y;
                }
                v
            } else {
                s.children
            };
            for (l, sl) in self.layers[range.clone()].iter().zip(per_layer).rev() {
                d = l.backward(cx, sl, &d)?;
                done(offset(cx, l.input_layernorm.weight))?;
            }
        }
        Ok(d)
    }
}

impl Module for TransformerBlock {
    fn forward(&self, cx: &Cx, x: &Tensor) -> Result<(Tensor, Saved)> {
        let mut h = Residual::Sum(x.clone());
        let mut children = Vec::with_capacity(self.groups.len() + 1);
        for (range, recompute) in &self.groups {
            // A recompute group keeps one tensor of its input (the pending add summed here).
            let input = if *recompute {
                let x = h.into_sum()?;
                h = Residual::Sum(x.clone());
                vec![x]
            } else {
                vec![]
            };
            let mut per_layer = vec![];
            for l in &self.layers[range.clone()] {
                let (y, s) = l.forward_parts(cx, h)?;
                if !recompute {
                    per_layer.push(s);
                }
                h = y;
            }
            children.push(if *recompute { Saved::new(input, vec![]) } else { Saved::new(vec![], per_layer) });
        }
        let out = match &self.final_layernorm {
            Some(norm) => {
                let (_, y, s) = h.norm(cx, norm)?;
                children.push(s);
                y
            }
            None => h.into_sum()?,
        };
        Ok((out, Saved::new(vec![], children)))
    }

    fn backward(&self, cx: &Cx, saved: Saved, dy: &Tensor) -> Result<Tensor> {
        self.backward_with(cx, saved, dy, &mut |_| Ok(()))
    }
}
