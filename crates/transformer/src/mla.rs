//! Multi-latent attention (DeepSeek-V2/V3's MLA; Megatron's MLASelfAttention,
//! `--multi-latent-attention`): queries and keys/values through low-rank latents, a RoPE part of
//! the heads whose key is shared by all heads.
//!
//! Per token (n heads; r = qk_pos_emb_head_dim, dn = qk_head_dim, dv = v_head_dim):
//!   q = q_up(q_norm(q_down(x)))        [n·(dn + r)]   (or q_proj(x) without a q latent rank)
//!   [c | k_pe] = kv_down(x)            [kv_lora_rank + r]
//!   kv = kv_up(kv_norm(c))             [n·(dn + dv)]
//!   per head: Q = [q_nope | rope(q_pe)], K = [k_nope | rope(k_pe)] (k_pe the same for every
//!   head), V = v; o = softmax(Q·Kᵀ / √(dn + r)) · V; y = linear_proj(o)  [n·dv → hidden].
//! The rotary part is laid out in interleaved pairs (DeepSeek's checkpoints; Megatron and
//! transformers de-interleave it before a half-split rotation): here the interleaved rotation
//! (`RopeCfg::interleaved`) turns each pair where it lies. Its output keeps the interleaved order
//! where theirs is de-interleaved, the same permutation of every query's and key's rotary
//! features, which no score changes (a dot product). The core attention runs on Q, K, V padded with zeros to one head
//! width, max(dn + r, dv), on a GPU in bf16 further to the next head dim with tensor-core kernels
//! (`k::attention_padded_width`: 192 at DeepSeek-V3's sizes); padding changes no score and no
//! output column that is kept.
//!
//! Tensor parallel: the down projections and their norms are replicated (on the sequence shards
//! under sequence parallelism, their gradients summed over the group), the up projections
//! column-parallel by heads, the output projection row-parallel; k_pe is gathered along the
//! sequence under sequence parallelism, and its gradient, partial over each rank's heads, summed
//! back (`TensorParallel::enter` / `enter_bwd`).
//!
//! Shapes per rank (h = n/tp heads): x [B, T(/tp), C]; q [B, T, h, dn + r]; kv [B, T, h, dn + dv];
//! k_pe [B, T, 1, r]; Q, K, V [B, T, h, D]; o [B, T, h, D] → [B, T, h·dv] → y [B, T(/tp), C].

use crate::attention::{core_bwd, core_fwd, rope_at};
use crate::concat::{cat_last, pad_last, split_last};
use crate::linear::Linear;
use crate::norm::Norm;
use crate::sink::Sink;
use crate::spec::{NormKind, NormSpec, SoftmaxType};
use ferrotron_core::{Cx, Module, ParamTableBuilder, Result, Saved, Tensor, invalid};
use ferrotron_kernels::{self as k, AttnCfg, RopeCfg};
use ferrotron_parallel::{ColumnParallelLinear, ContextParallel, CpCommType, RowParallelLinear, TensorParallel};
use std::sync::Mutex;

/// MLA's sizes (Megatron's --q-lora-rank, --kv-lora-rank, --qk-head-dim, --qk-pos-emb-head-dim,
/// --v-head-dim).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MlaSpec {
    /// The query's latent width; None: queries straight from the hidden state (`linear_q_proj`).
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    /// A head's width without position (dn).
    pub qk_head_dim: usize,
    /// A head's rotary width (r), shared by the heads' keys.
    pub qk_pos_emb_head_dim: usize,
    pub v_head_dim: usize,
    /// YaRN on the rotary part (Megatron's --rope-type yarn at a --rotary-scaling-factor above
    /// 1), which also scales the softmax by its `softmax_factor`; None: plain RoPE.
    pub yarn: Option<k::Yarn>,
}

/// Layer specs compare whole (`AttentionSpec: Eq`); YaRN's numbers are checked finite
/// (`problem`) before a model is built from them.
impl Eq for MlaSpec {}

impl MlaSpec {
    /// What the sizes cannot be, naming the flag.
    pub fn problem(&self) -> Option<String> {
        let zero = [
            (self.kv_lora_rank, "--kv-lora-rank"),
            (self.qk_head_dim, "--qk-head-dim"),
            (self.v_head_dim, "--v-head-dim"),
            (self.q_lora_rank.unwrap_or(1), "--q-lora-rank"),
        ];
        if let Some((_, flag)) = zero.iter().find(|(v, _)| *v == 0) {
            return Some(format!("{flag} must be at least 1"));
        }
        let r = self.qk_pos_emb_head_dim;
        if r == 0 || r % 2 != 0 {
            return Some(format!("--qk-pos-emb-head-dim {r} must be even and at least 2 (the rotary part)"));
        }
        self.yarn
            .and_then(|y| y.problem())
            .map(|p| format!("{p} (--rotary-scaling-factor, --mscale, --mscale-all-dim)"))
    }

    /// The core attention's head width: queries' and keys' dn + r, or values' dv if wider (on a GPU
    /// in bf16 padded further to a tensor-core kernel's: `k::attention_padded_width`).
    pub fn core_width(&self) -> usize {
        (self.qk_head_dim + self.qk_pos_emb_head_dim).max(self.v_head_dim)
    }

    /// One layer's attention parameters (norms of `norm` kind), `heads` heads of hidden `h`, with
    /// an output bias when `bias`.
    pub fn param_count(&self, h: usize, heads: usize, norm: NormKind, bias: bool) -> usize {
        let norm = |n: usize| if norm == NormKind::LayerNorm { 2 * n } else { n };
        let (dn, r, dv, kvl) = (self.qk_head_dim, self.qk_pos_emb_head_dim, self.v_head_dim, self.kv_lora_rank);
        let q = match self.q_lora_rank {
            Some(ql) => h * ql + norm(ql) + ql * heads * (dn + r),
            None => h * heads * (dn + r),
        };
        q + h * (kvl + r) + norm(kvl) + kvl * heads * (dn + dv) + heads * dv * h + if bias { h } else { 0 }
    }
}

/// How the query is made.
enum QueryPath {
    Latent { down: Linear, norm: Norm, up: ColumnParallelLinear },
    Direct(ColumnParallelLinear),
}

pub struct MlaAttention {
    q: QueryPath,
    kv_down: Linear,
    kv_norm: Norm,
    kv_up: ColumnParallelLinear,
    linear_proj: RowParallelLinear,
    spec: MlaSpec,
    /// Heads on this rank.
    heads: usize,
    rope: RopeCfg,
    tp: TensorParallel,
    /// Context parallelism over more than one rank (`set_context_parallel`): the rows are this
    /// rank's chunks (their global positions for RoPE), the core attention over the whole sequence.
    cp: Option<ContextParallel>,
    /// The shared key's row ids per head (`head_ids`), the last few shapes: uploaded once, so a
    /// step replayed as a CUDA graph copies nothing from the host.
    ids: Mutex<Vec<Tensor>>,
    /// The sink softmax's logits (`MlaDims::softmax`), or None for the plain softmax.
    sink: Option<Sink>,
}

/// What `MlaAttention::new` takes beyond the spec.
pub struct MlaDims {
    pub hidden: usize,
    pub heads: usize,
    /// The latent norms'.
    pub norm: NormSpec,
    pub std: f32,
    pub out_std: f32,
    /// A bias on the output projection (Megatron's --add-bias-linear).
    pub bias: bool,
    /// RoPE's base and scaling.
    pub rope: (f64, Option<k::RopeScaling>),
    /// The core attention's softmax (`AttentionSpec::softmax`).
    pub softmax: SoftmaxType,
}

impl MlaAttention {
    /// Every product of the attention in FP8 (`fp8`) or not: the query's and the keys' and
    /// values' down- and up-projections and the output projection.
    pub fn set_fp8(&mut self, fp8: Option<&ferrotron_core::Fp8Recipe>) {
        match &mut self.q {
            QueryPath::Latent { down, up, .. } => {
                down.fp8 = fp8.map(|r| r.linear(down.weight));
                up.fp8 = fp8.map(|r| r.linear(up.weight));
            }
            QueryPath::Direct(c) => c.fp8 = fp8.map(|r| r.linear(c.weight)),
        }
        self.kv_down.fp8 = fp8.map(|r| r.linear(self.kv_down.weight));
        self.kv_up.fp8 = fp8.map(|r| r.linear(self.kv_up.weight));
        self.linear_proj.fp8 = fp8.map(|r| r.linear(self.linear_proj.weight));
    }

    pub fn new(
        p: &mut ParamTableBuilder,
        prefix: &str,
        spec: MlaSpec,
        d: &MlaDims,
        tp: &TensorParallel,
    ) -> Result<Self> {
        if let Some(problem) = spec.problem() {
            return Err(invalid("MlaAttention", problem));
        }
        if d.heads % tp.size() != 0 {
            return Err(invalid(
                "MlaAttention",
                format!(
                    "--num-attention-heads {} is not divisible by --tensor-model-parallel-size {}",
                    d.heads,
                    tp.size()
                ),
            ));
        }
        let (dn, r, dv) = (spec.qk_head_dim, spec.qk_pos_emb_head_dim, spec.v_head_dim);
        let (h, sp) = (d.hidden, tp.sp());
        let col = |p: &mut ParamTableBuilder, name: &str, i: usize, o: usize| {
            ColumnParallelLinear::new(p, &format!("{prefix}.{name}"), i, o, false, d.std, tp, 1)
        };
        let q = match spec.q_lora_rank {
            Some(ql) => {
                let down =
                    Linear::on_sequence_shards(p, &format!("{prefix}.linear_q_down_proj"), [h, ql], false, d.std, sp)?;
                let norm = Norm::new(p, &format!("{prefix}.q_layernorm"), d.norm, ql, sp)?;
                let up = col(p, "linear_q_up_proj", ql, d.heads * (dn + r))?;
                QueryPath::Latent { down, norm, up }
            }
            None => QueryPath::Direct(col(p, "linear_q_proj", h, d.heads * (dn + r))?),
        };
        let kvl = spec.kv_lora_rank;
        let kv_down =
            Linear::on_sequence_shards(p, &format!("{prefix}.linear_kv_down_proj"), [h, kvl + r], false, d.std, sp)?;
        let kv_norm = Norm::new(p, &format!("{prefix}.kv_layernorm"), d.norm, kvl, sp)?;
        let kv_up = col(p, "linear_kv_up_proj", kvl, d.heads * (dn + dv))?;
        let linear_proj =
            RowParallelLinear::new(p, &format!("{prefix}.linear_proj"), d.heads * dv, h, d.bias, d.out_std, tp)?;
        let sink = Sink::new(p, prefix, d.softmax, d.heads, d.std, tp)?;
        if spec.yarn.is_some() && d.rope.1.is_some() {
            return Err(invalid(
                "MlaAttention",
                "YaRN and Llama 3's RoPE scaling (--use-rope-scaling) both rescale: keep one",
            ));
        }
        let rope = RopeCfg { scaling: d.rope.1, yarn: spec.yarn, interleaved: true, ..RopeCfg::new(r, d.rope.0) };
        Ok(MlaAttention {
            q,
            kv_down,
            kv_norm,
            kv_up,
            linear_proj,
            spec,
            heads: d.heads / tp.size(),
            rope,
            tp: tp.clone(),
            cp: None,
            ids: Mutex::new(Vec::new()),
            sink,
        })
    }

    /// The core attention's settings: causal, the micro-batch's document masks, the scale of
    /// the heads' real width.
    fn cfg<'c>(&self, cx: &Cx<'c>) -> AttnCfg<'c> {
        let width = self.spec.qk_head_dim + self.spec.qk_pos_emb_head_dim;
        let yarn = self.spec.yarn.map_or(1.0, |y| y.softmax_factor());
        AttnCfg { scale: Some(yarn / (width as f64).sqrt()), docs: cx.docs, ..AttnCfg::default() }
    }

    /// Under context parallelism (more than one rank): this rank's chunks, attending over the
    /// whole sequence (by all-to-all, only with the heads divisible by the group).
    pub fn set_context_parallel(&mut self, cp: &ContextParallel) -> Result<()> {
        if cp.size() > 1 && cp.kind == CpCommType::AllToAll {
            cp.check_heads(self.heads, self.heads)?;
        }
        self.cp = (cp.size() > 1).then(|| cp.clone());
        Ok(())
    }

    /// RoPE for x [B, T, H, r] (global positions under context parallelism).
    fn rope_for(&self, x: &Tensor) -> RopeCfg {
        rope_at(self.cp.as_ref(), &self.rope, x.dims()[1])
    }

    /// The interleaved rotation of x [B, T, H, r].
    fn rotate(&self, x: &Tensor) -> Result<Tensor> {
        k::rope_fwd(x, &self.rope_for(x))
    }

    /// The gradient of `rotate`'s input.
    fn rotate_bwd(&self, dy: &Tensor) -> Result<Tensor> {
        k::rope_bwd(dy, &self.rope_for(dy))
    }

    /// Row ids that repeat each of `rows` rows `heads` times (k_pe's broadcast over the heads as a
    /// row gather; its gradient the matching scatter-add).
    fn head_ids(&self, rows: usize, like: &Tensor) -> Result<Tensor> {
        let heads = self.heads;
        let mut cached = self.ids.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(t) = cached.iter().find(|t| t.elem_count() == rows * heads && t.device().same(like.device())) {
            return Ok(t.clone());
        }
        let ids: Vec<u32> = (0..rows as u32).flat_map(|i| std::iter::repeat_n(i, heads)).collect();
        let t = Tensor::from_vec(ids, [rows * heads], like.device())?;
        if cached.len() == 4 {
            cached.remove(0);
        }
        cached.push(t.clone());
        Ok(t)
    }
}

impl Module for MlaAttention {
    fn forward(&self, cx: &Cx, x: &Tensor) -> Result<(Tensor, Saved)> {
        let (dn, r, dv) = (self.spec.qk_head_dim, self.spec.qk_pos_emb_head_dim, self.spec.v_head_dim);
        let hl = self.heads;
        let mut children = vec![];
        // Queries.
        let q = match &self.q {
            QueryPath::Latent { down, norm, up } => {
                let (c, s1) = down.forward(cx, x)?;
                let (cn, s2) = norm.forward(cx, &c)?;
                let (q, s3) = up.forward(cx, &cn)?;
                children.extend([s1, s2, s3]);
                q
            }
            QueryPath::Direct(l) => {
                let (q, s) = l.forward(cx, x)?;
                children.push(s);
                q
            }
        };
        // Keys and values.
        let (ckv, s_kd) = self.kv_down.forward(cx, x)?;
        let [c, k_pe]: [Tensor; 2] =
            split_last(&ckv, &[self.spec.kv_lora_rank, r])?.try_into().map_err(|_| invalid("mla", "kv split"))?;
        let (cn, s_kn) = self.kv_norm.forward(cx, &c)?;
        let (kv, s_ku) = self.kv_up.forward(cx, &cn)?;
        children.extend([s_kd, s_kn, s_ku]);
        let k_pe = self.tp.enter(&k_pe)?;
        let (b, t) = (kv.dims()[0], kv.dims()[1]);
        let [q_nope, q_pe]: [Tensor; 2] =
            split_last(&q.reshape([b, t, hl, dn + r])?, &[dn, r])?.try_into().map_err(|_| invalid("mla", "q split"))?;
        let [k_nope, v]: [Tensor; 2] = split_last(&kv.reshape([b, t, hl, dn + dv])?, &[dn, dv])?
            .try_into()
            .map_err(|_| invalid("mla", "kv split"))?;
        let q_pe = self.rotate(&q_pe)?;
        let k_pe = self.rotate(&k_pe.reshape([b, t, 1, r])?)?;
        let ids = self.head_ids(b * t, &k_pe)?;
        let k_pe = k::embedding_fwd(&ids, &k_pe.reshape([b * t, r])?)?.reshape([b, t, hl, r])?;
        let qk = cat_last(&[&q_nope, &q_pe])?;
        let width = k::attention_padded_width(self.spec.core_width(), qk.dtype(), qk.device());
        let (qq, kk) = (pad_last(&qk, width - dn - r)?, pad_last(&cat_last(&[&k_nope, &k_pe])?, width - dn - r)?);
        let vv = pad_last(&v, width - dv)?;
        let (o, lse) = core_fwd(self.cp.as_ref(), &qq, &kk, &vv, &self.cfg(cx))?;
        if let Some(s) = &self.sink {
            s.forward_(cx, &o, &lse)?;
        }
        let ov = if width == dv { o.clone() } else { split_last(&o, &[dv, width - dv])?.swap_remove(0) };
        let (y, s_p) = self.linear_proj.forward(cx, &ov.reshape([b, t, hl * dv])?)?;
        children.push(s_p);
        Ok((y, Saved::new(vec![qq, kk, vv, o, lse, ids], children)))
    }

    fn backward(&self, cx: &Cx, saved: Saved, dy: &Tensor) -> Result<Tensor> {
        let (dn, r, dv) = (self.spec.qk_head_dim, self.spec.qk_pos_emb_head_dim, self.spec.v_head_dim);
        let hl = self.heads;
        let [qq, kk, vv, o, lse, ids]: [Tensor; 6] =
            saved.tensors.try_into().map_err(|_| invalid("MlaAttention::backward", "saved tensors do not match"))?;
        let mut children = saved.children;
        let s_p = children.pop().ok_or_else(|| invalid("MlaAttention::backward", "nothing saved"))?;
        let dov = self.linear_proj.backward(cx, s_p, dy)?;
        let (b, t, width) = (qq.dims()[0], qq.dims()[1], qq.dims()[3]);
        let d_o = pad_last(&dov.reshape([b, t, hl, dv])?, width - dv)?;
        if let Some(s) = &self.sink {
            s.backward(cx, &o, &lse, &d_o)?;
        }
        let (dq, dk, dvv) = core_bwd(self.cp.as_ref(), &qq, &kk, &vv, &o, &lse, &d_o, &self.cfg(cx))?;
        // The parts that matter, without the padding (no zero-width part: nothing to copy).
        let pad = width - dn - r;
        let widths: &[usize] = if pad == 0 { &[dn, r] } else { &[dn, r, pad] };
        let mut dq_parts = split_last(&dq, widths)?;
        let mut dk_parts = split_last(&dk, widths)?;
        let dv_part = if width == dv { dvv } else { split_last(&dvv, &[dv, width - dv])?.swap_remove(0) };
        let dq_pe = self.rotate_bwd(&dq_parts.swap_remove(1))?;
        let dq = cat_last(&[&dq_parts[0], &dq_pe])?.reshape([b, t, hl * (dn + r)])?;
        // k_pe's gradient: summed over the heads, then through the rotation.
        let dk_pe_h = dk_parts.swap_remove(1).reshape([b * t * hl, r])?;
        let dk_pe = Tensor::zeros([b * t, r], dk_pe_h.dtype(), dk_pe_h.device())?;
        k::embedding_bwd(&ids, &dk_pe_h, &dk_pe)?;
        let dk_pe = self.rotate_bwd(&dk_pe.reshape([b, t, 1, r])?)?.reshape([b, t, r])?;
        let dkv = cat_last(&[&dk_parts[0], &dv_part])?.reshape([b, t, hl * (dn + dv)])?;
        // Each rank's k_pe gradient comes from its own heads: summed (reduce-scattered under SP).
        let dk_pe = self.tp.enter_bwd(&dk_pe)?;
        let s_ku = children.pop().ok_or_else(|| invalid("MlaAttention::backward", "nothing saved"))?;
        let s_kn = children.pop().ok_or_else(|| invalid("MlaAttention::backward", "nothing saved"))?;
        let s_kd = children.pop().ok_or_else(|| invalid("MlaAttention::backward", "nothing saved"))?;
        let dcn = self.kv_up.backward(cx, s_ku, &dkv)?;
        let dc = self.kv_norm.backward(cx, s_kn, &dcn)?;
        let dx = self.kv_down.backward(cx, s_kd, &cat_last(&[&dc, &dk_pe])?)?;
        let dxq = match &self.q {
            QueryPath::Latent { down, norm, up } => {
                let (s3, s2, s1) = match (children.pop(), children.pop(), children.pop()) {
                    (Some(a), Some(b), Some(c)) => (a, b, c),
                    _ => return Err(invalid("MlaAttention::backward", "saved values do not match forward")),
                };
                let dcn = up.backward(cx, s3, &dq)?;
                let dc = norm.backward(cx, s2, &dcn)?;
                down.backward(cx, s1, &dc)?
            }
            QueryPath::Direct(l) => {
                let s = children.pop().ok_or_else(|| invalid("MlaAttention::backward", "nothing saved"))?;
                l.backward(cx, s, &dq)?
            }
        };
        k::add_(&dxq, &dx)?;
        Ok(dxq)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_checked_by_flag() {
        let ok = MlaSpec {
            q_lora_rank: Some(8),
            kv_lora_rank: 8,
            qk_head_dim: 4,
            qk_pos_emb_head_dim: 2,
            v_head_dim: 3,
            yarn: None,
        };
        assert_eq!(ok.problem(), None);
        assert_eq!(ok.core_width(), 6);
        assert!(MlaSpec { qk_pos_emb_head_dim: 3, ..ok }.problem().unwrap().contains("--qk-pos-emb-head-dim"));
        assert!(MlaSpec { q_lora_rank: Some(0), ..ok }.problem().unwrap().contains("--q-lora-rank"));
        assert!(MlaSpec { kv_lora_rank: 0, ..ok }.problem().unwrap().contains("--kv-lora-rank"));
        assert_eq!(MlaSpec { v_head_dim: 9, ..ok }.core_width(), 9);
    }
}
