//! Self-attention: fused QKV projection (Megatron's grouped layout), optional QK-LayerNorm, RoPE,
//! causal (optionally windowed) GQA core attention, output projection. Tensor parallel: each rank
//! holds groups/tp query groups (their heads, keys and values) — a contiguous slice of the
//! grouped QKV weight — and the output projection is row-parallel.
//!
//! Shapes (per rank, h = heads/tp, g = groups/tp): x [B, T, C] (or [B, T/tp, C] under sequence
//! parallelism) → qkv [B, T, g·(h/g+2)·D] → q [B, T, h, D], k/v [B, T, g, D] → o [B, T, h, D] →
//! y [B, T, C] (or [B, T/tp, C]). Without QK-norm the core attention reads Q, K and V straight
//! from qkv and writes their gradients into dqkv (`k::attention_fwd_qkv`: no split or merge copy),
//! RoPE rotating qkv's query and key heads in place first (`k::rope_qkv_fwd_`; its backward, on
//! dqkv, `k::rope_qkv_bwd_`).
//!
//! Under context parallelism (`cp`) the rows are this rank's two chunks of each sequence: RoPE
//! rotates them at their global positions and the core attention is `ContextParallel`'s (K and V
//! gathered over the cp group), on the split Q, K, V.
//!
//! With an output gate (`AttentionSpec::output_gate`, Megatron's --attention-output-gate) each
//! group of the projection is [its g query heads | their g gates | key | value]; the gates are
//! cut out (`project`: the rest is the plain layout) and o·σ(gate) goes to the output
//! projection; the gates' gradient is put back in its place (`project_grad`).
//!
//! With a sink softmax (`AttentionSpec::softmax`, Megatron's --softmax-type) the core
//! attention's (o, lse) become the sink softmax's before anything reads them (`core_fused`,
//! `core`), and the sink's gradient is taken from them before the core backward (`Sink`).

use crate::concat::{cat_last, split_last};
use crate::norm::{HeadNorm, Norm};
use crate::sink::Sink;
use crate::spec::{AttentionSpec, NormSpec};
use ferrotron_core::rng::fnv1a64;
use ferrotron_core::{Cx, Module, ParamId, ParamTableBuilder, Result, Saved, Tensor, invalid};
use ferrotron_kernels::{self as k, AttnCfg, AttnDropout, RopeCfg};
use ferrotron_parallel::{ColumnParallelLinear, ContextParallel, RowParallelLinear, TensorParallel};

#[derive(Debug, Clone)]
pub struct SelfAttention {
    pub linear_qkv: ColumnParallelLinear,
    pub linear_proj: RowParallelLinear,
    pub q_layernorm: Option<HeadNorm>,
    pub k_layernorm: Option<HeadNorm>,
    pub rope: Option<RopeCfg>,
    /// Heads and query groups on this rank.
    pub heads: usize,
    pub groups: usize,
    pub head_dim: usize,
    /// Without document masks (a micro-batch's come with its `Cx::docs`).
    pub attn: AttnCfg<'static>,
    /// Selective recompute: keep Q, K, V (or qkv) only; redo the core attention in the backward.
    pub recompute_core: bool,
    /// Dropout of the attention probabilities in training (--attention-dropout), None at rate 0.
    pub dropout: Option<ProbDropout>,
    /// Context parallelism over more than one rank (`GptModel::set_context_parallel`), or None.
    pub cp: Option<ContextParallel>,
    /// A sigmoid gate on each head's output (`AttentionSpec::output_gate`).
    pub gate: bool,
    /// The sink softmax's logits (`AttentionSpec::softmax`), or None for the plain softmax.
    pub sink: Option<Sink>,
}

/// One layer's attention dropout: the rate, its Philox stream (a hash of the site's name, the
/// layer's global index in it), all heads' count and this rank's first head (tensor parallel).
/// The mask's words are indexed by global sample, head, query and key (`k::AttnDropout`), so any
/// layout draws the same mask for the same sample, and the backward draws it again.
#[derive(Debug, Clone)]
pub struct ProbDropout {
    p: f32,
    stream: u64,
    heads_total: usize,
    head_offset: usize,
}

pub struct AttentionDims {
    pub hidden: usize,
    /// Width of a head (the hidden size / heads unless --kv-channels sets it).
    pub head_dim: usize,
    pub heads: usize,
    pub groups: usize,
    /// The head norms' (`AttentionSpec::qk_layernorm`, `qk_l2_norm`).
    pub norm: NormSpec,
    pub std: f32,
    /// Output projection init std (Megatron scales it by 1/√(2·layers)).
    pub out_std: f32,
    /// RoPE at position 0 (`TransformerConfig::rope`), or None without it.
    pub rope: Option<RopeCfg>,
    /// --attention-dropout (0: none).
    pub attention_dropout: f32,
}

impl SelfAttention {
    pub fn new(
        p: &mut ParamTableBuilder,
        prefix: &str,
        d: &AttentionDims,
        spec: &AttentionSpec,
        tp: &TensorParallel,
    ) -> Result<Self> {
        let head_dim = d.head_dim;
        // The gates: one more head's width per query head.
        let gate_heads = if spec.output_gate { d.heads } else { 0 };
        let qkv_out = (d.heads + gate_heads + 2 * d.groups) * head_dim;
        let linear_qkv = ColumnParallelLinear::new(
            p,
            &format!("{prefix}.linear_qkv"),
            d.hidden,
            qkv_out,
            spec.bias || spec.qkv_bias,
            d.std,
            tp,
            1,
        )?;
        let linear_proj = RowParallelLinear::new(
            p,
            &format!("{prefix}.linear_proj"),
            d.heads * head_dim,
            d.hidden,
            spec.bias,
            d.out_std,
            tp,
        )?;
        let sink = Sink::new(p, prefix, spec.softmax, d.heads, d.std, tp)?;
        // Each rank normalises only its heads: the norm's grads are partial over the group.
        let split = tp.size() > 1;
        let (q_layernorm, k_layernorm) = if spec.qk_layernorm {
            let mut norm =
                |n: &str| Norm::new(p, &format!("{prefix}.{n}"), d.norm, head_dim, split).map(HeadNorm::Learned);
            (Some(norm("q_layernorm")?), Some(norm("k_layernorm")?))
        } else if spec.qk_l2_norm {
            let l2 = HeadNorm::L2 { eps: d.norm.eps };
            (Some(l2.clone()), Some(l2))
        } else {
            (None, None)
        };
        Ok(SelfAttention {
            linear_qkv,
            linear_proj,
            q_layernorm,
            k_layernorm,
            rope: d.rope,
            heads: d.heads / tp.size(),
            groups: d.groups / tp.size(),
            head_dim,
            attn: AttnCfg { causal: spec.causal, window: spec.window, ..AttnCfg::default() },
            recompute_core: false,
            dropout: (d.attention_dropout > 0.0).then(|| ProbDropout {
                p: d.attention_dropout,
                stream: fnv1a64(&format!("{prefix}.core_attention.dropout")),
                heads_total: d.heads,
                head_offset: tp.rank() * (d.heads / tp.size()),
            }),
            cp: None,
            gate: spec.output_gate,
            sink,
        })
    }
}

/// RoPE `r` for a local sequence of `t` rows: their global positions under context parallelism
/// (shared by the attention modules).
pub(crate) fn rope_at(cp: Option<&ContextParallel>, r: &RopeCfg, t: usize) -> RopeCfg {
    match cp {
        Some(cp) => cp.rope(r, t),
        None => *r,
    }
}

/// The core attention on split Q, K, V: (o, lse), over the whole sequence under context
/// parallelism.
pub(crate) fn core_fwd(
    cp: Option<&ContextParallel>,
    q: &Tensor,
    kk: &Tensor,
    v: &Tensor,
    cfg: &AttnCfg,
) -> Result<(Tensor, Tensor)> {
    match cp {
        Some(cp) => cp.attention_fwd(q, kk, v, cfg),
        None => k::attention_fwd(q, kk, v, cfg),
    }
}

/// `core_fwd`'s backward: (dq, dk, dv).
#[allow(clippy::too_many_arguments)]
pub(crate) fn core_bwd(
    cp: Option<&ContextParallel>,
    q: &Tensor,
    kk: &Tensor,
    v: &Tensor,
    o: &Tensor,
    lse: &Tensor,
    d_o: &Tensor,
    cfg: &AttnCfg,
) -> Result<(Tensor, Tensor, Tensor)> {
    match cp {
        Some(cp) => cp.attention_bwd(q, kk, v, o, lse, d_o, cfg),
        None => k::attention_bwd(q, kk, v, o, lse, d_o, cfg),
    }
}

impl SelfAttention {
    /// Whether the core attention reads Q, K and V straight from the fused projection output
    /// (no QK-norm to apply to them first; RoPE runs in place on it): `k::attention_fwd_qkv`, no
    /// split or merge copy.
    fn reads_fused(&self) -> bool {
        self.q_layernorm.is_none() && self.cp.is_none()
    }

    /// RoPE for a local sequence of `t` rows (their global positions under context parallelism).
    fn rope_for(&self, t: usize) -> Option<RopeCfg> {
        Some(rope_at(self.cp.as_ref(), self.rope.as_ref()?, t))
    }

    /// Where the heads sit in the fused projection output.
    fn qkv_heads(&self) -> k::QkvHeads {
        k::QkvHeads::new(self.groups, self.heads / self.groups, self.head_dim)
    }

    /// The core attention's settings for a [B, T, ·] micro-batch: its document masks (causal
    /// attention: a vision encoder's sees every patch), and with dropout in training its key from
    /// the micro-batch's draw (the same in the forward, a recomputed forward and the backward).
    fn cfg<'c>(&self, cx: &Cx<'c>, t: usize) -> Result<AttnCfg<'c>> {
        let attn = AttnCfg { docs: cx.docs.filter(|_| self.attn.causal), ..self.attn };
        let Some(dr) = self.dropout.as_ref().filter(|_| cx.training) else { return Ok(attn) };
        let Some(draw) = cx.draw else {
            return Err(invalid(
                "attention dropout",
                "a training micro-batch without its sample index: build it with Batch::with_draw (or set --attention-dropout 0)",
            ));
        };
        // The whole sequence's mask (under context parallelism `ContextParallel` picks each
        // chunk block's tiles of it).
        let whole = t * self.cp.as_ref().map_or(1, |c| c.size());
        let batch_stride = AttnDropout::blocks_per_sample(dr.heads_total, whole, whole);
        let dropout = AttnDropout {
            p: dr.p,
            seed: draw.seed,
            stream: dr.stream,
            base: draw.first_sample.wrapping_mul(batch_stride),
            batch_stride,
            head_offset: dr.head_offset as u64,
            tiles: None,
        };
        Ok(AttnCfg { dropout: Some(dropout), ..attn })
    }

    /// The QKV projection: (qkv in the plain [queries | key | value] group layout, the gates
    /// [B, T, h·D] under an output gate, the projection's saved).
    fn project(&self, cx: &Cx, x: &Tensor) -> Result<(Tensor, Option<Tensor>, Saved)> {
        let (out, s) = self.linear_qkv.forward(cx, x)?;
        if !self.gate {
            return Ok((out, None, s));
        }
        let (b, t, g, d) = (out.dims()[0], out.dims()[1], self.heads / self.groups, self.head_dim);
        let rows = out.reshape([b * t * self.groups, (2 * g + 2) * d])?;
        let parts = split_last(&rows, &[g * d, g * d, 2 * d])?;
        let qkv = cat_last(&[&parts[0], &parts[2]])?.reshape([b, t, self.groups * (g + 2) * d])?;
        Ok((qkv, Some(parts[1].reshape([b, t, self.heads * d])?), s))
    }

    /// `project`'s backward layout: dqkv (plain layout) and the gates' gradient back into the
    /// projection's output layout.
    fn project_grad(&self, dqkv: Tensor, dgate: Option<Tensor>) -> Result<Tensor> {
        let Some(dgate) = dgate else { return Ok(dqkv) };
        let (b, t, g, d) = (dqkv.dims()[0], dqkv.dims()[1], self.heads / self.groups, self.head_dim);
        let rows = dqkv.reshape([b * t * self.groups, (g + 2) * d])?;
        let parts = split_last(&rows, &[g * d, 2 * d])?;
        let dgate = dgate.reshape([b * t * self.groups, g * d])?;
        cat_last(&[&parts[0], &dgate, &parts[1]])?.reshape([b, t, self.groups * (2 * g + 2) * d])
    }

    /// The output projection's input from the core attention's o [B, T, h, D]: o, or o·σ(gate).
    fn gated(&self, o: &Tensor, gate: Option<&Tensor>) -> Result<Tensor> {
        let (b, t) = (o.dims()[0], o.dims()[1]);
        let o = o.reshape([b, t, self.heads * self.head_dim])?;
        match gate {
            Some(g) => k::sigmoid_gate(&o, g),
            None => Ok(o),
        }
    }

    /// dO [B, T, h, D] (and the gates' gradient) from the output projection's input gradient.
    fn gated_bwd(&self, o: &Tensor, gate: Option<&Tensor>, d_in: Tensor) -> Result<(Tensor, Option<Tensor>)> {
        let Some(g) = gate else { return Ok((d_in.reshape(o.dims().to_vec())?, None)) };
        let (b, t) = (o.dims()[0], o.dims()[1]);
        let (d_o, dgate) = k::sigmoid_gate_bwd(&o.reshape([b, t, self.heads * self.head_dim])?, g, &d_in)?;
        Ok((d_o.reshape(o.dims().to_vec())?, Some(dgate)))
    }

    /// The core attention on the fused projection output: (o, lse), the sink softmax's with one.
    fn core_fused(&self, cx: &Cx, qkv: &Tensor) -> Result<(Tensor, Tensor)> {
        let (o, lse) = k::attention_fwd_qkv(qkv, self.qkv_heads(), &self.cfg(cx, qkv.dims()[1])?)?;
        self.sink_(cx, &o, &lse)?;
        Ok((o, lse))
    }

    /// The core attention on split Q, K, V: (o, lse), the sink softmax's with one.
    fn core(&self, cx: &Cx, q: &Tensor, kk: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let (o, lse) = core_fwd(self.cp.as_ref(), q, kk, v, &self.cfg(cx, q.dims()[1])?)?;
        self.sink_(cx, &o, &lse)?;
        Ok((o, lse))
    }

    /// The plain softmax's (o, lse) become the sink softmax's (a no-op without one).
    fn sink_(&self, cx: &Cx, o: &Tensor, lse: &Tensor) -> Result<()> {
        self.sink.as_ref().map_or(Ok(()), |s| s.forward_(cx, o, lse))
    }

    /// The sink logits' gradient for dO (a no-op without learned ones).
    fn sink_bwd(&self, cx: &Cx, o: &Tensor, lse: &Tensor, d_o: &Tensor) -> Result<()> {
        self.sink.as_ref().map_or(Ok(()), |s| s.backward(cx, o, lse, d_o))
    }

    /// `forward` when `reads_fused`: saved [qkv, o, lse] (or [qkv] with the core recomputed), qkv
    /// with RoPE applied, then the gates under an output gate.
    fn forward_fused(&self, cx: &Cx, x: &Tensor) -> Result<(Tensor, Saved)> {
        let (qkv, gate, s_qkv) = self.project(cx, x)?;
        if let Some(r) = &self.rope {
            // qkv is this call's fresh projection output (or a fresh copy of part of it): nothing
            // else holds it.
            k::rope_qkv_fwd_(&qkv, self.groups, self.heads / self.groups, self.head_dim, r)?;
        }
        let (o, lse) = self.core_fused(cx, &qkv)?;
        let (y, mut s_proj) = self.linear_proj.forward(cx, &self.gated(&o, gate.as_ref())?)?;
        let mut tensors = if self.recompute_core {
            self.linear_proj.drop_input(&mut s_proj); // its input is from `o`, recomputed in the backward
            vec![qkv]
        } else {
            vec![qkv, o, lse]
        };
        tensors.extend(gate);
        Ok((y, Saved::new(tensors, vec![s_qkv, s_proj])))
    }

    /// The projection's backward, with its bias gradient or leaving it to the caller (`out_bias`).
    fn proj_backward(&self, cx: &Cx, s_proj: Saved, dy: &Tensor, proj_bias: bool) -> Result<Tensor> {
        self.linear_proj.backward_parts(cx, s_proj, dy, None, proj_bias)
    }

    fn backward_fused(&self, cx: &Cx, saved: Saved, dy: &Tensor, proj_bias: bool) -> Result<Tensor> {
        let Saved { mut tensors, children } = saved;
        let bad = || ferrotron_core::invalid("SelfAttention::backward", "saved tensors do not match forward");
        let [s_qkv, mut s_proj]: [Saved; 2] = children.try_into().map_err(|_| bad())?;
        let gate = if self.gate { Some(tensors.pop().ok_or_else(bad)?) } else { None };
        if self.recompute_core && tensors.len() == 1 {
            let (o, lse) = self.core_fused(cx, &tensors[0])?;
            s_proj = self.linear_proj.saved_for_input(&self.gated(&o, gate.as_ref())?, s_proj)?;
            tensors.extend([o, lse]);
        }
        let [qkv, o, lse]: [Tensor; 3] = tensors.try_into().map_err(|_| bad())?;
        let (d_o, dgate) = self.gated_bwd(&o, gate.as_ref(), self.proj_backward(cx, s_proj, dy, proj_bias)?)?;
        self.sink_bwd(cx, &o, &lse, &d_o)?;
        let (g, hd) = (self.heads / self.groups, self.head_dim);
        if let (Some(b), None, None) = (self.linear_qkv.bias, &self.rope, &dgate) {
            // The bias gradient is Σ rows of dQKV as the attention backward writes it (no RoPE
            // backward after), which its kernels can sum as they write.
            let (db, acc) = cx.params.grad_acc(b)?;
            let cfg = self.cfg(cx, qkv.dims()[1])?;
            let dqkv = k::attention_bwd_qkv_into(&qkv, &o, &lse, &d_o, self.qkv_heads(), &cfg, &db, acc)?;
            return self.linear_qkv.backward_bias_summed(cx, s_qkv, &dqkv);
        }
        let dqkv = k::attention_bwd_qkv(&qkv, &o, &lse, &d_o, self.qkv_heads(), &self.cfg(cx, qkv.dims()[1])?)?;
        if let Some(r) = &self.rope {
            k::rope_qkv_bwd_(&dqkv, self.groups, g, hd, r)?;
        }
        self.linear_qkv.backward(cx, s_qkv, &self.project_grad(dqkv, dgate)?)
    }
}

impl Module for SelfAttention {
    fn forward(&self, cx: &Cx, x: &Tensor) -> Result<(Tensor, Saved)> {
        if self.reads_fused() {
            return self.forward_fused(cx, x);
        }
        let (qkv, gate, s_qkv) = self.project(cx, x)?;
        let t = qkv.dims()[1];
        let (mut q, mut kk, v) = k::qkv_split(&qkv, self.groups, self.heads / self.groups, self.head_dim)?;
        let mut children = vec![s_qkv];
        if let (Some(qn), Some(kn)) = (&self.q_layernorm, &self.k_layernorm) {
            let (qq, sq) = qn.forward(cx, &q)?;
            let (kq, sk) = kn.forward(cx, &kk)?;
            (q, kk) = (qq, kq);
            children.extend([sq, sk]);
        }
        if let Some(r) = &self.rope_for(t) {
            q = k::rope_fwd(&q, r)?;
            kk = k::rope_fwd(&kk, r)?;
        }
        let (o, lse) = self.core(cx, &q, &kk, &v)?;
        let (y, mut s_proj) = self.linear_proj.forward(cx, &self.gated(&o, gate.as_ref())?)?;
        let mut tensors = if self.recompute_core {
            self.linear_proj.drop_input(&mut s_proj); // its input is from `o`, recomputed in the backward
            vec![q, kk, v]
        } else {
            vec![q, kk, v, o, lse]
        };
        tensors.extend(gate);
        children.push(s_proj);
        Ok((y, Saved::new(tensors, children)))
    }

    fn backward(&self, cx: &Cx, saved: Saved, dy: &Tensor) -> Result<Tensor> {
        self.backward_parts(cx, saved, dy, true)
    }

    fn out_bias(&self) -> Option<ParamId> {
        self.linear_proj.out_bias()
    }

    fn backward_without_out_bias(&self, cx: &Cx, saved: Saved, dy: &Tensor) -> Result<Tensor> {
        self.backward_parts(cx, saved, dy, false)
    }
}

impl SelfAttention {
    /// The backward, with the projection's bias gradient or without it (`out_bias`).
    fn backward_parts(&self, cx: &Cx, saved: Saved, dy: &Tensor, proj_bias: bool) -> Result<Tensor> {
        if self.reads_fused() {
            return self.backward_fused(cx, saved, dy, proj_bias);
        }
        let Saved { mut tensors, mut children } = saved;
        let bad = || ferrotron_core::invalid("SelfAttention::backward", "saved tensors do not match forward");
        let mut s_proj = children.pop().unwrap_or_default();
        let gate = if self.gate { Some(tensors.pop().ok_or_else(bad)?) } else { None };
        if self.recompute_core && tensors.len() == 3 {
            let (o, lse) = self.core(cx, &tensors[0], &tensors[1], &tensors[2])?;
            s_proj = self.linear_proj.saved_for_input(&self.gated(&o, gate.as_ref())?, s_proj)?;
            tensors.extend([o, lse]);
        }
        let [q, kk, v, o, lse]: [Tensor; 5] = tensors.try_into().map_err(|_| bad())?;
        let (d_o, dgate) = self.gated_bwd(&o, gate.as_ref(), self.proj_backward(cx, s_proj, dy, proj_bias)?)?;
        self.sink_bwd(cx, &o, &lse, &d_o)?;
        let (mut dq, mut dk, dv) =
            core_bwd(self.cp.as_ref(), &q, &kk, &v, &o, &lse, &d_o, &self.cfg(cx, q.dims()[1])?)?;
        if let Some(r) = &self.rope_for(q.dims()[1]) {
            dq = k::rope_bwd(&dq, r)?;
            dk = k::rope_bwd(&dk, r)?;
        }
        let mut children = children.into_iter();
        let s_qkv = children.next().unwrap_or_default();
        if let (Some(qn), Some(kn)) = (&self.q_layernorm, &self.k_layernorm) {
            dq = qn.backward(cx, children.next().unwrap_or_default(), &dq)?;
            dk = kn.backward(cx, children.next().unwrap_or_default(), &dk)?;
        }
        let dqkv = k::qkv_merge(&dq, &dk, &dv)?;
        self.linear_qkv.backward(cx, s_qkv, &self.project_grad(dqkv, dgate)?)
    }
}
