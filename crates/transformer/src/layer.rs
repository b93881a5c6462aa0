//! Pre-norm transformer layer and the block of layers.
//!
//! layer: x1 = x + attn(input_layernorm(x)); y = x1 + mlp(pre_mlp_layernorm(x1)), each branch's
//! output through hidden dropout (in training, at a rate above 0) before its add. A hybrid
//! model's layer has one branch: attention, MLP, or a sequence mixer after its `norm`.
//! Backward: the residual stream adds: dx1 = dy + ln2ᵀ(mlpᵀ(dy)); dx = dx1 + ln1ᵀ(attnᵀ(dx1)).
//! The adds next to a norm run inside its kernel (`Norm::forward_add`, `Norm::backward_add`):
//! in a block the layer's own output add x1 + mlp(…) too, in the next layer's input norm or the
//! final norm ([`Residual::Pending`]); only a block without a final norm (a pipeline stage that
//! does not end the model) or a recompute group's saved input ends with a separate add.

use crate::attention::{AttentionDims, SelfAttention};
use crate::config::TransformerConfig;
use crate::dropout::{HiddenDropout, maybe};
use crate::mla::{MlaAttention, MlaDims};
use crate::mlp::Mlp;
use crate::norm::Norm;
use crate::recompute::Recompute;
use crate::spec::{FactoryCx, LayerKind, MlpSpec, PositionEmbedding};
use ferrotron_core::{Cx, Module, ParamTableBuilder, Result, Saved, Tensor, invalid};
use ferrotron_kernels as k;
use ferrotron_parallel::TensorParallel;

/// What a branch computes between its norm and its residual add.
pub enum Sublayer {
    Attention(Box<SelfAttention>),
    /// Multi-latent attention (its own module: latent projections, a rotary part of its own).
    Mla(Box<MlaAttention>),
    /// The dense MLP.
    Mlp(Box<Mlp>),
    /// A factory's MLP (MoE, a user's) or a sequence mixer (ferrotron-ssm's Mamba-2).
    Module(Box<dyn Module>),
}

impl Sublayer {
    fn module(&self) -> &dyn Module {
        match self {
            Sublayer::Attention(a) => a.as_ref(),
            Sublayer::Mla(a) => a.as_ref(),
            Sublayer::Mlp(m) => m.as_ref(),
            Sublayer::Module(m) => m.as_ref(),
        }
    }
}

/// One pre-norm residual branch: x + dropout(f(norm(x))).
pub struct Branch {
    pub norm: Norm,
    pub f: Sublayer,
    /// Hidden dropout on f's output (None at rate 0).
    dropout: Option<HiddenDropout>,
}

/// A decoder layer: its branches in order. A transformer layer has two (attention, then MLP);
/// a hybrid model's layers one each (`LayerKind`).
pub struct TransformerLayer {
    pub branches: Vec<Branch>,
}

impl TransformerLayer {
    /// Layer `index` of the model (0-based; it picks the layer's kind, `LayerSpec::kind_of`, and its
    /// MLP, `LayerSpec::mlp_of`).
    pub fn new(
        p: &mut ParamTableBuilder,
        prefix: &str,
        c: &TransformerConfig,
        tp: &TensorParallel,
        index: usize,
    ) -> Result<Self> {
        let (h, norm, sp) = (c.hidden_size, c.norm_spec(), tp.sp());
        let std = c.init_method_std;
        let out_std = std / (2.0 * c.num_layers as f32).sqrt();
        // Each branch registers its norm, then its f: a layer's first parameter is its first norm's
        // weight (`first_norm`, the offsets the data-parallel overlap reports).
        let attention = |p: &mut ParamTableBuilder| -> Result<Branch> {
            let pre = Norm::new(p, &format!("{prefix}.input_layernorm"), norm, h, sp)?;
            let site = format!("{prefix}.self_attention.dropout");
            let dropout = HiddenDropout::new(c.hidden_dropout, &site, h, tp);
            if let Some(spec) = c.layer.attention.mla {
                // `TransformerConfig::validate` refused --rotary-percent with it.
                let PositionEmbedding::Rope { base, scaling, .. } = c.position_embedding else {
                    return Err(invalid("TransformerLayer::new", "multi-latent attention needs rotary embeddings"));
                };
                let dims = MlaDims {
                    hidden: h,
                    heads: c.num_attention_heads,
                    norm,
                    std,
                    out_std,
                    bias: c.layer.attention.bias,
                    rope: (base, scaling),
                    softmax: c.layer.attention.softmax,
                };
                let a = MlaAttention::new(p, &format!("{prefix}.self_attention"), spec, &dims, tp)?;
                return Ok(Branch { norm: pre, f: Sublayer::Mla(Box::new(a)), dropout });
            }
            let dims = AttentionDims {
                hidden: h,
                head_dim: c.head_dim(),
                heads: c.num_attention_heads,
                groups: c.num_query_groups,
                norm,
                std,
                out_std,
                rope: c.rope(),
                attention_dropout: c.attention_dropout,
            };
            let a =
                SelfAttention::new(p, &format!("{prefix}.self_attention"), &dims, &c.layer.attention_of(index), tp)?;
            Ok(Branch { norm: pre, f: Sublayer::Attention(Box::new(a)), dropout })
        };
        let mlp = |p: &mut ParamTableBuilder| -> Result<Branch> {
            let pre = Norm::new(p, &format!("{prefix}.pre_mlp_layernorm"), norm, h, sp)?;
            let f = match c.layer.mlp_of(index) {
                MlpSpec::Dense { activation, bias } => Sublayer::Mlp(Box::new(Mlp::new(
                    p,
                    &format!("{prefix}.mlp"),
                    h,
                    c.ffn_hidden_size,
                    *activation,
                    *bias,
                    std,
                    out_std,
                    tp,
                )?)),
                MlpSpec::Custom(f) => {
                    let prefix = format!("{prefix}.mlp");
                    Sublayer::Module(f.build(&FactoryCx { prefix: &prefix, hidden: h, std, out_std, tp }, p)?)
                }
            };
            let site = format!("{prefix}.mlp.dropout");
            Ok(Branch { norm: pre, f, dropout: HiddenDropout::new(c.hidden_dropout, &site, h, tp) })
        };
        let branches = match c.layer.kind_of(index) {
            LayerKind::Transformer => vec![attention(p)?, mlp(p)?],
            LayerKind::Attention => vec![attention(p)?],
            LayerKind::Mlp => vec![mlp(p)?],
            LayerKind::Mixer => {
                let f = c.layer.hybrid.as_ref().and_then(|hy| hy.mixer.clone()).ok_or_else(|| {
                    invalid(
                        "TransformerLayer::new",
                        format!("layer {index} is a mixer layer but the spec has no mixer"),
                    )
                })?;
                let pre = Norm::new(p, &format!("{prefix}.norm"), norm, h, sp)?;
                let prefix_m = format!("{prefix}.mixer");
                let m = f.build(&FactoryCx { prefix: &prefix_m, hidden: h, std, out_std, tp }, p)?;
                vec![Branch {
                    norm: pre,
                    f: Sublayer::Module(m),
                    dropout: HiddenDropout::new(c.hidden_dropout, &format!("{prefix}.mixer.dropout"), h, tp),
                }]
            }
        };
        Ok(TransformerLayer { branches })
    }

    /// The layer's attention, if it has one.
    pub fn attention_mut(&mut self) -> Option<&mut SelfAttention> {
        self.branches.iter_mut().find_map(|b| match &mut b.f {
            Sublayer::Attention(a) => Some(a.as_mut()),
            _ => None,
        })
    }

    /// The products of the attention's and the dense MLP's linear layers in FP8 (`fp8`,
    /// Megatron's --fp8-format and recipe) or not (None); multi-latent attention's too, and a factory's
    /// module's as it says (`Module::set_fp8`: the MoE layer's experts; a sequence mixer refuses).
    pub fn set_fp8(&mut self, fp8: Option<&ferrotron_core::Fp8Recipe>) -> Result<()> {
        for b in &mut self.branches {
            match &mut b.f {
                Sublayer::Attention(a) => {
                    a.linear_qkv.fp8 = fp8.map(|r| r.linear(a.linear_qkv.weight));
                    a.linear_proj.fp8 = fp8.map(|r| r.linear(a.linear_proj.weight));
                }
                Sublayer::Mlp(m) => m.set_fp8(fp8),
                Sublayer::Mla(a) => a.set_fp8(fp8),
                Sublayer::Module(m) => m.set_fp8(fp8)?,
            }
        }
        Ok(())
    }

    /// The first branch's norm: its weight is the layer's first parameter (lowest flat offset).
    pub fn first_norm(&self) -> &Norm {
        &self.branches[0].norm
    }

    /// Under context parallelism (more than one rank): the attention over the whole sequence (by
    /// `cp.kind`'s exchange; the all-to-all needs the heads divisible by the group) and the hidden
    /// dropouts' masks of this rank's chunks.
    pub fn set_context_parallel(&mut self, cp: &ferrotron_parallel::ContextParallel) -> Result<()> {
        if let Some(a) = self.attention_mut() {
            if cp.size() > 1 && cp.kind == ferrotron_parallel::CpCommType::AllToAll {
                cp.check_heads(a.heads, a.groups)?;
            }
            a.cp = (cp.size() > 1).then(|| cp.clone());
        }
        for b in &mut self.branches {
            if let Sublayer::Mla(a) = &mut b.f {
                a.set_context_parallel(cp)?;
            }
        }
        for d in self.branches.iter_mut().filter_map(|b| b.dropout.as_mut()) {
            d.set_context_parallel(cp);
        }
        Ok(())
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
    pub(crate) fn norm(self, cx: &Cx, norm: &Norm) -> Result<(Tensor, Tensor, Saved)> {
        match self {
            Residual::Sum(x) => {
                let (y, s) = norm.forward(cx, &x)?;
                Ok((x, y, s))
            }
            Residual::Pending(a, b) => norm.forward_add(cx, &a, &b),
        }
    }
}

impl TransformerLayer {
    /// Forward from the residual stream `x` (a pending add is summed by the first norm's kernel),
    /// leaving the output's add pending. Saved: each branch's norm, then its f.
    pub fn forward_parts(&self, cx: &Cx, x: Residual) -> Result<(Residual, Saved)> {
        let mut r = x;
        let mut saved = Vec::with_capacity(2 * self.branches.len());
        for b in &self.branches {
            let (x, h, s_norm) = r.norm(cx, &b.norm)?;
            let (o, s_f) = b.f.module().forward(cx, &h)?;
            saved.extend([s_norm, s_f]);
            r = Residual::Pending(x, maybe(&b.dropout, cx, o)?);
        }
        Ok((r, Saved::new(vec![], saved)))
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
        let mut children = saved.children;
        if children.len() != 2 * self.branches.len() {
            return Err(invalid("TransformerLayer::backward", "saved values do not match forward"));
        }
        let mut d = dy.clone();
        for b in self.branches.iter().rev() {
            let (s_f, s_norm) = match (children.pop(), children.pop()) {
                (Some(f), Some(n)) => (f, n),
                _ => return Err(invalid("TransformerLayer::backward", "saved values do not match forward")),
            };
            let f = b.f.module();
            d = match f.out_bias().filter(|_| b.dropout.is_none()) {
                Some(bias) => {
                    let dh = f.backward_without_out_bias(cx, s_f, &d)?;
                    b.norm.backward_add_bias(cx, s_norm, &dh, &d, bias)?
                }
                None => {
                    let dh = f.backward(cx, s_f, &maybe(&b.dropout, cx, d.clone())?)?;
                    b.norm.backward_add(cx, s_norm, &dh, &d)?
                }
            };
        }
        Ok(d)
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
    /// FP8 delayed scaling's state (`GptModel::set_fp8`): a recomputed group's forward replays
    /// the scales of its first run, copied then.
    pub fp8_metas: Option<std::sync::Arc<ferrotron_core::Fp8Metas>>,
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
        for a in built.iter_mut().filter_map(TransformerLayer::attention_mut) {
            a.recompute_core = recompute.selective();
        }
        let final_layernorm = if final_norm {
            Some(Norm::new(
                p,
                // Megatron's MambaStack names it final_norm, its TransformerBlock final_layernorm.
                &format!("{prefix}.{}", if c.layer.hybrid.is_some() { "final_norm" } else { "final_layernorm" }),
                c.norm_spec(),
                c.hidden_size,
                tp.sp(),
            )?)
        } else {
            None
        };
        let groups = recompute.groups(built.len());
        Ok(TransformerBlock { layers: built, first_layer, final_layernorm, groups, fp8_metas: None })
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
                // Run the group's forward again from its saved input, keeping everything this time
                // (by the FP8 scales of the first run, where it saved them).
                let mut kept = s.tensors.into_iter();
                let x = kept.next().ok_or_else(|| invalid("recompute", "no saved input"))?;
                let scales = kept.next();
                let cx = &cx.with_fp8_replay(scales.as_ref());
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
                done(offset(cx, l.first_norm().weight))?;
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
                // Delayed scaling's forward scales as this run quantizes by (they move on after
                // the chunk's forward, before this group's recompute).
                let scales = match (&self.fp8_metas, cx.training) {
                    (Some(m), true) => Some(m.tensors()?.fwd_scale.deep_copy()?),
                    _ => None,
                };
                [vec![x], scales.into_iter().collect()].concat()
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
