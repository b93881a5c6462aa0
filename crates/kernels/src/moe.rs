//! Mixture-of-experts routing family (`cpu/moe.rs` has the math and the shapes): top-k routing
//! and its backward, the router's auxiliary losses, token dropping past an expert's capacity
//! (`moe_drop`, `moe_sort_capped`, on the host), the sort of token copies by expert, and the probability-weighted
//! combine of the experts' outputs. The permutation itself is a row gather
//! (`embedding_fwd` with the sort's `perm` as ids) and its backward a scatter-add
//! (`embedding_bwd`).
//!
//! On a GPU (kernels/moe.cu) the indices a combine reads are not read back to be checked: an
//! out-of-range one is skipped by the kernel. `moe_sort` reads the experts back (the counts size
//! each expert's products on the host), so a forward waits for its router there.

use crate::{buf, check, cpu};
use ferrotron_core::{DType, Result, Tensor, invalid};

pub use cpu::moe::{DROPPED, DropPolicy, Groups, Score};

/// How `moe_route` turns a token's logits into its experts' weights.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TopK {
    /// Experts per token (Megatron's --moe-router-topk).
    pub k: usize,
    /// Softmax over all experts before taking the top k (--moe-router-pre-softmax); otherwise the
    /// softmax runs over the k chosen logits. Softmax scores only.
    pub pre_softmax: bool,
    /// Multiplies the weights (--moe-router-topk-scaling-factor; 1 without it).
    pub scale: f32,
    /// --moe-router-score-function.
    pub score: Score,
    /// --moe-router-num-groups / --moe-router-group-topk.
    pub groups: Option<Groups>,
}

impl TopK {
    /// Softmax top-`k` routing with no group limit.
    pub fn new(k: usize, pre_softmax: bool, scale: f32) -> Self {
        TopK { k, pre_softmax, scale, score: Score::Softmax, groups: None }
    }

    fn routing<'a>(&self, bias: Option<&'a [f32]>) -> cpu::moe::Routing<'a, f32> {
        cpu::moe::Routing {
            k: self.k,
            pre_softmax: self.pre_softmax,
            scale: self.scale,
            score: self.score,
            groups: self.groups,
            bias,
        }
    }

    /// The choices checked against `e` experts.
    pub fn check(&self, e: usize) -> std::result::Result<(), String> {
        if self.k == 0 || self.k > e {
            return Err(format!("top-k {} must be between 1 and the {e} experts", self.k));
        }
        if let Some(g) = self.groups {
            if g.num == 0 || e % g.num != 0 {
                return Err(format!("{e} experts cannot be split into {} equal groups", g.num));
            }
            if g.num > 256 {
                return Err(format!("{} expert groups: at most 256 are built", g.num));
            }
            if g.topk == 0 || g.topk > g.num || self.k < g.topk || self.k > g.topk * (e / g.num) {
                return Err(format!(
                    "group top-k {} of {} groups of {} experts cannot hold top-k {}: it must be between 1 and the groups, at most top-k, and its groups must hold k experts",
                    g.topk,
                    g.num,
                    e / g.num,
                    self.k
                ));
            }
        }
        Ok(())
    }
}

fn dims2(op: &'static str, t: &Tensor) -> Result<(usize, usize)> {
    check::rank(op, t, 2)?;
    Ok((t.dims()[0], t.dims()[1]))
}

fn route_shape(op: &'static str, logits: &Tensor, r: &TopK) -> Result<(usize, usize)> {
    check::float(op, logits)?;
    let (n, e) = dims2(op, logits)?;
    r.check(e).map_err(|m| invalid(op, m))?;
    Ok((n, e))
}

/// logits [N, E] → (probs [N, k] f32, experts [N, k] u32), best expert first. `bias` [E] f32
/// (DeepSeek-V3's expert bias, a per-expert score function only) is added to the scores the
/// experts are chosen by, not to their weights.
pub fn moe_route(logits: &Tensor, r: &TopK, bias: Option<&Tensor>) -> Result<(Tensor, Tensor)> {
    const OP: &str = "moe_route";
    let (n, e) = route_shape(OP, logits, r)?;
    if let Some(b) = bias {
        if r.score == Score::Softmax {
            return Err(invalid(OP, "an expert bias needs a per-expert score function (sigmoid), not softmax"));
        }
        check::dtype(OP, b, DType::F32)?;
        check::shape(OP, b, &[e])?;
    }
    let mut on = vec![logits];
    on.extend(bias);
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &on)? {
        return crate::cuda::ops::moe_route(&g, logits, r, bias);
    }
    check::on_cpu(OP, &on)?;
    let lv = logits.read_f32()?;
    let bv = bias.map(|b| b.read_f32()).transpose()?;
    // SAFETY: topk_route writes every weight and index.
    let mut probs = unsafe { buf::uninit::<f32>(n * r.k) };
    let mut experts = vec![0u32; n * r.k];
    cpu::moe::topk_route(&lv, e, &r.routing(bv.as_deref()), &mut probs, &mut experts);
    Ok((Tensor::from_vec(probs, [n, r.k], logits.device())?, Tensor::from_vec(experts, [n, r.k], logits.device())?))
}

/// dlogits [N, E] (logits' dtype) from dprobs [N, k]; logits and experts as `moe_route` had them
/// (the bias and the group limit change only the choice, so the backward needs neither).
pub fn moe_route_bwd(logits: &Tensor, experts: &Tensor, dprobs: &Tensor, r: &TopK) -> Result<Tensor> {
    const OP: &str = "moe_route_bwd";
    let (n, e) = route_shape(OP, logits, r)?;
    check::dtype(OP, experts, DType::U32)?;
    check::shape(OP, experts, &[n, r.k])?;
    check::float(OP, dprobs)?;
    check::shape(OP, dprobs, &[n, r.k])?;
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[logits, experts, dprobs])? {
        return crate::cuda::ops::moe_route_bwd(&g, logits, experts, dprobs, r);
    }
    check::on_cpu(OP, &[logits, experts, dprobs])?;
    let (lv, dp, ix) = (logits.read_f32()?, dprobs.read_f32()?, experts.to_vec::<u32>()?);
    if let Some(&bad) = ix.iter().find(|&&x| x as usize >= e) {
        return Err(invalid(OP, format!("expert index {bad} is not below the {e} experts")));
    }
    // SAFETY: topk_route_bwd writes every row in full.
    let mut dl = unsafe { buf::uninit::<f32>(n * e) };
    cpu::moe::topk_route_bwd(&lv, &ix, &dp, e, &r.routing(None), &mut dl);
    check::out(dl, [n, e], logits.dtype(), logits.device())
}

/// The router's auxiliary losses (`cpu::moe::router_loss`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RouterLoss {
    pub topk: usize,
    /// Tokens `tokens_per_expert` was counted over, and over which the z-loss is a mean: the
    /// micro-batch's (more than the logits' rows when its tokens lie on several context-parallel
    /// ranks, whose counts were summed).
    pub total_tokens: usize,
    /// Load-balancing coefficient (--moe-aux-loss-coeff); 0: none.
    pub aux_coeff: f32,
    /// z-loss coefficient (--moe-z-loss-coeff); 0: none.
    pub z_coeff: f32,
    /// The micro-batch's loss scale (what the language-model loss's gradient is multiplied by).
    pub grad_scale: f32,
    /// The router's score function: the load-balancing loss's probabilities are its values
    /// normalised over the row.
    pub score: Score,
    /// Sequences the logits' rows (consecutive equal runs) and the counts ([seqs, E]) split into:
    /// 1, the micro-batch's loss (Megatron's aux_loss); the batch size, DeepSeek's
    /// sequence-level loss (seq_aux_loss). `total_tokens` counts every sequence's tokens.
    pub seqs: usize,
}

/// logits [N, E] and tokens_per_expert [E] ([seqs, E] per sequence) → (values [2] f32:
/// load-balancing loss and z-loss, without their coefficients; dlogits [N, E] f32 of
/// grad_scale · (aux_coeff · aux + z_coeff · z)).
pub fn moe_router_loss(logits: &Tensor, tokens_per_expert: &Tensor, l: &RouterLoss) -> Result<(Tensor, Tensor)> {
    const OP: &str = "moe_router_loss";
    check::float(OP, logits)?;
    let (n, e) = dims2(OP, logits)?;
    check::float(OP, tokens_per_expert)?;
    if l.seqs <= 1 {
        check::shape(OP, tokens_per_expert, &[e])?;
    } else {
        check::shape(OP, tokens_per_expert, &[l.seqs, e])?;
    }
    if l.topk == 0 || l.total_tokens == 0 {
        return Err(invalid(OP, format!("top-k {} and total tokens {} must be positive", l.topk, l.total_tokens)));
    }
    if l.seqs == 0 || n % l.seqs != 0 || l.total_tokens % l.seqs != 0 {
        return Err(invalid(
            OP,
            format!("{n} rows ({} tokens in all) do not split into {} sequences", l.total_tokens, l.seqs),
        ));
    }
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[logits, tokens_per_expert])? {
        return crate::cuda::ops::moe_router_loss(&g, logits, tokens_per_expert, l);
    }
    check::on_cpu(OP, &[logits, tokens_per_expert])?;
    let (lv, cv) = (logits.read_f32()?, tokens_per_expert.read_f32()?);
    // SAFETY: router_loss writes every row in full.
    let mut dl = unsafe { buf::uninit::<f32>(n * e) };
    let c = cpu::moe::RouterLossCoeffs {
        topk: l.topk,
        total_tokens: l.total_tokens as f32,
        aux: l.aux_coeff,
        z: l.z_coeff,
        grad_scale: l.grad_scale,
        score: l.score,
        seqs: l.seqs,
    };
    let (aux, z) = cpu::moe::router_loss(&lv, e, &cv, c, &mut dl);
    Ok((Tensor::from_vec(vec![aux, z], [2], logits.device())?, Tensor::from_vec(dl, [n, e], logits.device())?))
}

/// The token copies sorted by expert (`cpu::moe::sort_by_expert`). `perm` [N·k] and `slot` [N, k]
/// are u32 tensors on the experts' device; the counts are on the host (they size each expert's
/// products).
#[derive(Clone, Debug)]
pub struct ExpertSort {
    pub perm: Tensor,
    pub slot: Tensor,
    pub tokens_per_expert: Vec<usize>,
    /// The copies routed to each expert before a capacity dropped any (`tokens_per_expert`
    /// without one): what the load-balancing loss counts.
    pub routed_per_expert: Vec<usize>,
}

/// Token dropping (Megatron's --moe-expert-capacity-factor and --moe-token-drop-policy): each
/// expert takes at most its capacity of a micro-batch's token copies, the rest skip it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Capacity {
    /// The capacity in units of an even share: an expert takes ⌈copies / E · factor⌉.
    pub factor: f64,
    pub policy: DropPolicy,
}

impl Capacity {
    /// An expert's capacity for `tokens` tokens routed top-`k` over `experts` experts (Megatron's
    /// `get_capacity`, in f64 as Python computes it).
    pub fn per_expert(&self, tokens: usize, k: usize, experts: usize) -> usize {
        ((tokens * k) as f64 / experts.max(1) as f64 * self.factor).ceil().max(0.0) as usize
    }
}

/// experts [N, k] u32 → the sort; indices ≥ `num_experts` are an error naming the index, except
/// `DROPPED`, whose copies get no row (their slot is `DROPPED`).
pub fn moe_sort(experts: &Tensor, num_experts: usize) -> Result<ExpertSort> {
    const OP: &str = "moe_sort";
    check::dtype(OP, experts, DType::U32)?;
    let (n, k) = dims2(OP, experts)?;
    let ix = experts.to_vec::<u32>()?;
    sort_read(OP, &ix, [n, k], num_experts, experts.device(), None)
}

/// `moe_sort` of the experts with `moe_drop`'s capacity applied, the experts read back once.
pub fn moe_sort_capped(experts: &Tensor, probs: &Tensor, num_experts: usize, cap: &Capacity) -> Result<ExpertSort> {
    const OP: &str = "moe_sort_capped";
    let (ix, kept, n, k) = drop_read(OP, experts, probs, num_experts, cap)?;
    sort_read(OP, &kept, [n, k], num_experts, experts.device(), Some(&ix))
}

/// The sort of the read-back experts `ix` ([n, k], `DROPPED` allowed), on `device`; `routed`: the
/// experts before a capacity (None: `ix` itself).
fn sort_read(
    op: &'static str,
    ix: &[u32],
    [n, k]: [usize; 2],
    num_experts: usize,
    device: &ferrotron_core::Device,
    routed: Option<&[u32]>,
) -> Result<ExpertSort> {
    if let Some(&bad) = ix.iter().find(|&&x| x as usize >= num_experts && x != DROPPED) {
        return Err(invalid(op, format!("expert index {bad} is not below the {num_experts} experts")));
    }
    let (perm, slot, counts) = cpu::moe::sort_by_expert(ix, k, num_experts);
    let routed_per_expert = match routed {
        Some(r) => {
            let mut c = vec![0usize; num_experts];
            r.iter().filter(|&&e| (e as usize) < num_experts).for_each(|&e| c[e as usize] += 1);
            c
        }
        None => counts.clone(),
    };
    let rows = perm.len();
    Ok(ExpertSort {
        perm: Tensor::from_vec(perm, [rows], device)?,
        slot: Tensor::from_vec(slot, [n, k], device)?,
        tokens_per_expert: counts,
        routed_per_expert,
    })
}

/// experts [N, k] u32 and their weights probs [N, k] → the same experts with each copy beyond its
/// expert's capacity (`cap` for the N tokens) replaced by `DROPPED`. Read back to the host, as
/// `moe_sort` reads the experts.
pub fn moe_drop(experts: &Tensor, probs: &Tensor, num_experts: usize, cap: &Capacity) -> Result<Tensor> {
    let (_, kept, n, k) = drop_read("moe_drop", experts, probs, num_experts, cap)?;
    Tensor::from_vec(kept, [n, k], experts.device())
}

/// The experts read back, and with the capacity applied: (routed, kept, n, k).
fn drop_read(
    op: &'static str,
    experts: &Tensor,
    probs: &Tensor,
    num_experts: usize,
    cap: &Capacity,
) -> Result<(Vec<u32>, Vec<u32>, usize, usize)> {
    check::dtype(op, experts, DType::U32)?;
    let (n, k) = dims2(op, experts)?;
    check::float(op, probs)?;
    check::shape(op, probs, &[n, k])?;
    if !(cap.factor.is_finite() && cap.factor > 0.0) {
        return Err(invalid(op, format!("capacity factor {} must be a finite value above 0", cap.factor)));
    }
    let ix = experts.to_vec::<u32>()?;
    // Only the probs policy reads the weights.
    let pv = match cap.policy {
        DropPolicy::Probs => probs.to_vec_f32()?,
        DropPolicy::Position => vec![0.0; n * k],
    };
    let kept = cpu::moe::drop_over_capacity(&ix, &pv, num_experts, cap.per_expert(n, k, num_experts), cap.policy);
    Ok((ix, kept, n, k))
}

fn combine_shapes(op: &'static str, yp: &Tensor, slot: &Tensor, probs: &Tensor) -> Result<(usize, usize, usize)> {
    check::float(op, yp)?;
    let (rows, c) = dims2(op, yp)?;
    check::dtype(op, slot, DType::U32)?;
    let (n, k) = dims2(op, slot)?;
    // Fewer rows than copies when a capacity dropped some.
    if rows > n * k {
        return Err(invalid(op, format!("{rows} expert rows for {n} tokens × top-{k}")));
    }
    check::float(op, probs)?;
    check::shape(op, probs, &[n, k])?;
    Ok((n, k, c))
}

fn slots(op: &'static str, slot: &Tensor, rows: usize) -> Result<Vec<u32>> {
    let s = slot.to_vec::<u32>()?;
    if let Some(&bad) = s.iter().find(|&&r| r as usize >= rows && r != DROPPED) {
        return Err(invalid(op, format!("slot {bad} is not below the {rows} expert rows")));
    }
    Ok(s)
}

/// y [N, C] = Σ_j probs[n, j] · yp[slot[n, j]], in yp's dtype.
pub fn moe_unpermute(yp: &Tensor, slot: &Tensor, probs: &Tensor) -> Result<Tensor> {
    const OP: &str = "moe_unpermute";
    let (n, k, c) = combine_shapes(OP, yp, slot, probs)?;
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[yp, slot, probs])? {
        return crate::cuda::ops::moe_unpermute(&g, yp, slot, probs);
    }
    check::on_cpu(OP, &[yp, slot, probs])?;
    let s = slots(OP, slot, yp.dims()[0])?;
    let (yv, pv) = (yp.read_f32()?, probs.read_f32()?);
    // SAFETY: unpermute writes every row.
    let mut y = unsafe { buf::uninit::<f32>(n * c) };
    cpu::moe::unpermute(&yv, &s, &pv, c, k, &mut y);
    check::out(y, [n, c], yp.dtype(), yp.device())
}

/// (dyp [rows, C] in dy's dtype, rows yp's, dprobs [N, k] f32) from dy [N, C].
pub fn moe_unpermute_bwd(yp: &Tensor, slot: &Tensor, probs: &Tensor, dy: &Tensor) -> Result<(Tensor, Tensor)> {
    const OP: &str = "moe_unpermute_bwd";
    let (n, k, c) = combine_shapes(OP, yp, slot, probs)?;
    check::float(OP, dy)?;
    check::shape(OP, dy, &[n, c])?;
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[yp, slot, probs, dy])? {
        return crate::cuda::ops::moe_unpermute_bwd(&g, yp, slot, probs, dy);
    }
    check::on_cpu(OP, &[yp, slot, probs, dy])?;
    let rows = yp.dims()[0];
    let s = slots(OP, slot, rows)?;
    let mut seen = vec![false; rows];
    let kept = s.iter().filter(|&&r| r != DROPPED);
    if kept.clone().any(|&r| std::mem::replace(&mut seen[r as usize], true)) || kept.count() != rows {
        return Err(invalid(OP, "the kept token copies do not name every expert row once: slot is not a permutation"));
    }
    let (yv, pv, gv) = (yp.read_f32()?, probs.read_f32()?, dy.read_f32()?);
    // SAFETY: every row of dyp has exactly one slot (checked above); dprobs is written in full.
    let mut dyp = unsafe { buf::uninit::<f32>(rows * c) };
    let mut dp = unsafe { buf::uninit::<f32>(n * k) };
    cpu::moe::unpermute_bwd(&yv, &s, &pv, &gv, c, k, &mut dyp, &mut dp);
    Ok((check::out(dyp, [rows, c], dy.dtype(), dy.device())?, Tensor::from_vec(dp, [n, k], dy.device())?))
}
