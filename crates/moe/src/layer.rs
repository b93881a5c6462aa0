//! The MoE layer (Megatron-Core's MoELayer: TopKRouter, dropless dispatch, SequentialMLP
//! experts, optional shared experts).
//!
//! Forward, x [B, T, C] as N = B·T tokens:
//!   logits [N, E] = x · routerᵀ                      (router.weight [E, C])
//!   probs, experts [N, K] = top-k of logits           (`k::moe_route`; the expert bias, when
//!                                                      kept, steers the choice)
//!   kept = experts past capacity dropped              (`k::moe_sort_capped`, with a capacity)
//!   xp [R, C] = x[perm]                               (R = N·K kept copies sorted by expert,
//!                                                      tokens ascending)
//!   yp[rows of e] = expert_e(xp[rows of e])           (experts.local_experts.e: the dense MLP)
//!   y[n] = Σ_j probs[n, j] · yp[slot[n, j]]  (+ shared_experts(x)[n] with shared experts,
//!                                              times σ(x · gate_weightᵀ) with their gate,
//!                                              `gate.rs`; a dropped copy adds nothing)
//! Under expert parallelism `xp` goes to the ranks holding its experts and `yp` comes back by
//! all-to-all (`Dispatch`); each rank runs only its own experts.
//! Backward: dyp and dprobs from the combine; each expert's backward on its rows; dx = the
//! scatter-add of dxp by perm + dlogits · router, where dlogits is the top-k's backward plus, in
//! training, grad_scale · ∂(aux_coeff · load_balancing + z_coeff · z)/∂logits (the counts are
//! constants). Parameter gradients add into main_grad (`+=`); an expert that no token chose this
//! micro-batch adds nothing.
//!
//! Tensor parallelism (Megatron's expert tensor parallelism at the tensor-parallel size): every
//! expert's fc1 is column- and fc2 row-parallel over the tensor-parallel group, the router and
//! the routing replicated, so each tensor-parallel rank routes the same tokens the same way. The
//! experts (and shared experts) run on `TensorParallel::partial`: no collective of their own,
//! their outputs this rank's partial sums (fc2's bias on rank 0 only), which the combine keeps
//! partial, and the layer reduces once: summed over the group, or reduce-scattered to the
//! rank's slice of the sequence under sequence parallelism (gathered first), as Megatron's
//! token dispatcher does after its unpermute. Backward: the output gradient whole on every rank
//! (gathered under sequence parallelism); dprobs = dy · yp are partial and summed over the
//! group ([N, K], small) before the router's backward, which then runs alike on every rank; the
//! input gradient's partial sums (the router's part added on rank 0) reduced once, as the
//! forward's input was entered.
//!
//! Whole experts under tensor parallelism (--expert-tensor-parallel-size 1, which needs
//! sequence parallelism, as Megatron's MoE does): each tensor-parallel rank routes and
//! dispatches its own slice of the sequence, the expert-parallel group spanning tensor-parallel
//! ranks, and no tensor-parallel collective runs around the experts. The router's weight then
//! sees only the rank's tokens (its gradient summed over the group with the other
//! sequence-parallel ones), the routers' losses count the tokens of every rank of the group (as
//! under context parallelism), and the shared experts are a dense MLP of the tensor-parallel
//! group (gathered in, reduce-scattered out).

use crate::bias::ExpertBias;
use crate::dispatch::Dispatch;
use crate::gate::SharedGate;
use crate::global::GlobalCounts;
use crate::metrics::MoeMetrics;
use crate::spec::{ExpertGroup, LoadBalancing, MoeSpec};
use ferrotron_comm::ReduceOp;
use ferrotron_core::{Cx, Device, Module, ParamTableBuilder, Result, Saved, Tensor, invalid};
use ferrotron_kernels as k;
use ferrotron_parallel::{ContextParallel, TensorParallel};
use ferrotron_transformer::dropout::TokenKey;
use ferrotron_transformer::linear::Linear;
use ferrotron_transformer::mlp::Mlp;
use ferrotron_transformer::spec::FactoryCx;
use std::sync::Arc;

/// Token copies per expert of a choice `experts` [N, k] (read back to the host), per each of
/// `seqs` equal runs of rows: [seqs · E].
fn per_expert_counts(experts: &Tensor, num_experts: usize, seqs: usize) -> Result<Vec<usize>> {
    let mut c = vec![0usize; seqs * num_experts];
    let ix = experts.to_vec::<u32>()?;
    let per_seq = (ix.len() / seqs.max(1)).max(1);
    for (i, e) in ix.into_iter().enumerate().filter(|&(_, e)| (e as usize) < num_experts) {
        c[(i / per_seq).min(seqs - 1) * num_experts + e as usize] += 1;
    }
    Ok(c)
}

pub struct MoeLayer {
    /// `{prefix}.router.weight` [E, C].
    pub router: Linear,
    /// This rank's experts (all of them on one expert-parallel rank):
    /// `{prefix}.experts.local_experts.{e}` with e the global index, `first_expert` onwards.
    pub experts: Vec<Mlp>,
    pub first_expert: usize,
    /// `{prefix}.shared_experts`: every token's dense MLP beside the routed experts (a parameter
    /// of every rank, not an expert's).
    pub shared: Option<Mlp>,
    /// `{prefix}.shared_experts.gate_weight`: the shared experts' sigmoid gate.
    pub gate: Option<SharedGate>,
    num_experts: usize,
    /// The expert-parallel group the tokens are dispatched over (None: one rank).
    ep: Option<ExpertGroup>,
    /// Context parallelism over more than one rank: the micro-batch's other tokens' ranks.
    cp: Option<ExpertGroup>,
    topk: k::TopK,
    /// Token dropping: each expert's capacity of this rank's copies.
    capacity: Option<k::Capacity>,
    /// DeepSeek-V3's expert bias (`bias.rs`): steers the choice, counted in the backward.
    bias: Option<Arc<ExpertBias>>,
    aux_coeff: f32,
    /// The load-balancing loss per sequence (DeepSeek's seq_aux_loss), else per micro-batch.
    per_sequence: bool,
    /// The global-batch loss (global_aux_loss): its running counts, and the data-parallel group
    /// they are summed over (None: one rank).
    global: Option<(GlobalCounts, Option<ExpertGroup>)>,
    z_coeff: f32,
    hidden: usize,
    /// The parameter prefix, the layer's name in the metrics.
    name: String,
    metrics: MoeMetrics,
    /// The layer's tensor-parallel group (its sequence parallelism undone around the layer).
    tp: TensorParallel,
    /// Whole experts under tensor parallelism: each tensor-parallel rank routes its own slice of
    /// the sequence (the layer's input as it comes).
    own_slice: bool,
    /// --moe-router-force-load-balancing: the random logits' words, or None.
    force: Option<TokenKey>,
}

impl MoeLayer {
    pub fn new(p: &mut ParamTableBuilder, cx: &FactoryCx, spec: &MoeSpec) -> Result<Self> {
        let prefix = cx.prefix;
        let tp = cx.tp.size();
        let own_slice = tp > 1 && spec.expert_tensor_parallel_size == Some(1);
        if let Err(e) = ferrotron_transformer::spec::ModuleFactory::validate_tp(spec, tp) {
            return Err(invalid("MoeLayer", e));
        }
        if own_slice && !cx.tp.sp() {
            return Err(invalid(
                "MoeLayer",
                format!(
                    "--expert-tensor-parallel-size 1 under --tensor-model-parallel-size {tp} routes each rank's slice of the sequence: add --sequence-parallel (Megatron requires it with experts)"
                ),
            ));
        }
        let router = Linear::on_sequence_shards(
            p,
            &format!("{prefix}.router"),
            [cx.hidden, spec.num_experts],
            false,
            cx.std,
            own_slice,
        )?;
        let router = if spec.router.fp32 { router.in_fp32() } else { router };
        let ep = match (&spec.ep_group, spec.expert_parallel_size) {
            (_, 1) => None,
            (Some(g), n) if g.0.size() == n => Some(g.clone()),
            (g, n) => {
                return Err(invalid(
                    "MoeLayer",
                    format!(
                        "--expert-model-parallel-size {n} needs the expert-parallel group of {n} ranks (MoeSpec::with_group); got {}",
                        g.as_ref().map_or("none".into(), |g| format!("{} ranks", g.0.size()))
                    ),
                ));
            }
        };
        let local = spec.num_experts / spec.expert_parallel_size.max(1);
        let first_expert = ep.as_ref().map_or(0, |g| g.0.rank() * local);
        // The experts see whole token lists, not sequence slices, and leave their partial sums to
        // the layer: one reduction after the combine (the layer gathers and reduces around them).
        // Whole experts: a group of one.
        let etp = if own_slice {
            TensorParallel::new(ferrotron_comm::thread_world(1, std::time::Duration::from_secs(60)).remove(0), false)
        } else {
            TensorParallel::partial(cx.tp.comm.clone())
        };
        let start = p.len();
        let experts = (first_expert..first_expert + local)
            .map(|e| {
                Mlp::new(
                    p,
                    &format!("{prefix}.experts.local_experts.{e}"),
                    cx.hidden,
                    spec.ffn_hidden_size,
                    spec.activation,
                    spec.bias,
                    cx.std,
                    cx.out_std,
                    &etp,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        p.mark_expert_since(start);
        // With whole experts the shared experts are the tensor-parallel group's dense MLP.
        let shared_tp = if own_slice { cx.tp } else { &etp };
        let shared = match spec.shared_expert_ffn {
            Some(f) => Some(Mlp::new(
                p,
                &format!("{prefix}.shared_experts"),
                cx.hidden,
                f,
                spec.activation,
                spec.bias,
                cx.std,
                cx.out_std,
                shared_tp,
            )?),
            None => None,
        };
        let gate = match (spec.shared_expert_gate, &shared) {
            (true, Some(_)) => Some(SharedGate::new(p, prefix, cx.hidden, cx.std, own_slice)?),
            (true, None) => {
                return Err(invalid(
                    "MoeLayer",
                    "--moe-shared-expert-gate gates the shared experts: add --moe-shared-expert-intermediate-size",
                ));
            }
            (false, _) => None,
        };
        let r = &spec.router;
        Ok(MoeLayer {
            router,
            experts,
            first_expert,
            shared,
            gate,
            num_experts: spec.num_experts,
            ep,
            cp: spec.cp_group.clone().filter(|g| g.0.size() > 1),
            topk: k::TopK {
                score: r.score,
                groups: r.groups,
                ..k::TopK::new(r.topk, r.pre_softmax, r.topk_scaling_factor.unwrap_or(1.0))
            },
            capacity: r.capacity,
            bias: r
                .expert_bias_update_rate
                .map(|_| spec.biases.register(format!("{prefix}.router.expert_bias"), spec.num_experts)),
            aux_coeff: if r.load_balancing == LoadBalancing::None { 0.0 } else { r.aux_loss_coeff },
            per_sequence: r.load_balancing == LoadBalancing::SeqAuxLoss,
            global: (r.load_balancing == LoadBalancing::GlobalAuxLoss)
                .then(|| (spec.global_counts.clone(), spec.dp_group.clone().filter(|g| g.0.size() > 1))),
            z_coeff: r.z_loss_coeff.unwrap_or(0.0),
            hidden: cx.hidden,
            name: prefix.to_string(),
            metrics: spec.metrics.clone(),
            tp: cx.tp.clone(),
            own_slice,
            force: r.force_load_balancing.then(|| {
                // The router sees the whole sequence, or (whole experts) this rank's slice of it.
                let shard = own_slice.then(|| (cx.tp.rank(), cx.tp.size()));
                let mut key = TokenKey::new(&format!("{prefix}.router.force_load_balancing"), spec.num_experts, shard);
                if let Some(g) = spec.cp_group.as_ref() {
                    key.set_context_parallel(&ContextParallel::new(g.0.clone()));
                }
                key
            }),
        })
    }

    /// Standard normal logits in place of `logits` [N, E] for the tokens of `x` [B, T, C]
    /// (--moe-router-force-load-balancing; in evaluation without a draw, those of the run's first
    /// samples at seed 0). The router's backward takes their gradient as its logits' (straight
    /// through).
    fn forced(&self, cx: &Cx, key: &TokenKey, x: &Tensor, logits: Tensor) -> Result<Tensor> {
        const OP: &str = "--moe-router-force-load-balancing";
        let draw = match cx.draw {
            Some(d) => d,
            None if !cx.training => ferrotron_core::Draw { seed: 0, first_sample: 0 },
            None => {
                return Err(invalid(
                    OP,
                    "a training micro-batch without its sample index: build it with Batch::with_draw",
                ));
            }
        };
        let d = x.dims();
        if d.len() != 3 {
            return Err(invalid(OP, format!("the layer's input {d:?}: expected [batch, seq, hidden]")));
        }
        let dims = [d[0], d[1], self.num_experts];
        let random = k::normal(dims, logits.dtype(), logits.device(), &key.key(OP, draw, &dims)?)?;
        random.reshape(logits.dims().to_vec())
    }

    /// Runs `f` (an expert's forward or backward) on each local expert's rows of `rows`, writing
    /// its result into the same rows of a new tensor (`rows`' dtype, [rows, hidden]).
    fn per_expert(
        &self,
        rows: &Tensor,
        counts: &[usize],
        mut f: impl FnMut(usize, &Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let out = Tensor::empty([rows.dims()[0], self.hidden], rows.dtype(), rows.device())?;
        for (e, r) in Self::runs(counts).filter(|(_, r)| !r.is_empty()) {
            let y = f(e, &rows.narrow0(r.clone())?)?;
            k::copy_(&out.narrow0(r)?, &y)?;
        }
        Ok(out)
    }

    /// Sequences the load-balancing loss is taken over: the batch's (x is [B, T, C]) for the
    /// sequence-level loss, else one.
    fn seqs(&self, x: &Tensor) -> usize {
        match x.dims() {
            [b, _, _] if self.per_sequence => *b,
            _ => 1,
        }
    }

    /// Row ranges of the sorted copies, one per expert that has any.
    fn runs(counts: &[usize]) -> impl Iterator<Item = (usize, std::ops::Range<usize>)> + '_ {
        counts.iter().enumerate().scan(0, |off, (e, &c)| {
            let r = *off..*off + c;
            *off += c;
            Some((e, r))
        })
    }
}

const BWD: &str = "MoeLayer::backward";

impl Module for MoeLayer {
    fn forward(&self, cx: &Cx, x: &Tensor) -> Result<(Tensor, Saved)> {
        let c = self.hidden;
        if x.shape().last() != c {
            return Err(invalid(
                "MoeLayer::forward",
                format!("input width {} is not the hidden size {c}", x.shape().last()),
            ));
        }
        // Sequence parallel: the micro-batch's whole sequence on every tensor-parallel rank (or,
        // with whole experts, this rank's slice).
        let x = &if self.own_slice { x.clone() } else { self.tp.enter(x)? };
        let n = x.elem_count() / c;
        let x2 = x.reshape([n, c])?;
        let (logits, s_router) = self.router.forward(cx, &x2)?;
        let logits = match &self.force {
            Some(key) => self.forced(cx, key, x, logits)?,
            None => logits,
        };
        let bias = self.bias.as_ref().map(|b| b.tensor(logits.device())).transpose()?;
        let (probs, experts) = k::moe_route(&logits, &self.topk, bias.as_ref())?;
        // With a capacity the copies past it get no row (`experts` stays whole for the router's
        // backward; the dropped copies' dprobs come back 0).
        let sort = match &self.capacity {
            Some(cap) => k::moe_sort_capped(&experts, &probs, self.num_experts, cap)?,
            None => k::moe_sort(&experts, self.num_experts)?,
        };
        // The load-balancing loss counts a plain top-k of the scores (Megatron's scores for the
        // auxiliary loss), which the bias and the group limit may have moved the choice from,
        // before any copy is dropped; per sequence for the sequence-level loss.
        let seqs = self.seqs(x);
        let moved = self.bias.is_some() || self.topk.groups.is_some();
        let aux_counts = match (self.aux_coeff > 0.0 && cx.training, moved) {
            (true, true) => {
                let plain = k::TopK { groups: None, ..self.topk };
                per_expert_counts(&k::moe_route(&logits, &plain, None)?.1, self.num_experts, seqs)?
            }
            (true, false) if self.per_sequence => per_expert_counts(&experts, self.num_experts, seqs)?,
            _ => sort.routed_per_expert.clone(),
        };
        let xp = k::embedding_fwd(&sort.perm, &x2)?;
        let plan = match &self.ep {
            Some(g) => Some(Dispatch::plan(&*g.0, &sort.tokens_per_expert, x.device())?),
            None => None,
        };
        let xl = match (&self.ep, &plan) {
            (Some(g), Some(d)) => d.out(&*g.0, &xp)?,
            _ => xp,
        };
        let local_counts = plan.as_ref().map_or(&sort.tokens_per_expert, |d| &d.local_counts).clone();
        let mut children = vec![s_router];
        let yl = self.per_expert(&xl, &local_counts, |e, rows| {
            let (y, s) = self.experts[e].forward(cx, rows)?;
            children.push(s);
            Ok(y)
        })?;
        let yp = match (&self.ep, &plan) {
            (Some(g), Some(d)) => d.back(&*g.0, &yl)?,
            _ => yl,
        };
        let y = k::moe_unpermute(&yp, &sort.slot, &probs)?;
        if let Some(sh) = &self.shared {
            // With whole experts a sequence-parallel MLP: [B, T/tp, C] in and out.
            let (ys, s) = if self.own_slice { sh.forward(cx, x)? } else { sh.forward(cx, &x2)? };
            let ys = ys.reshape([n, c])?;
            let (ys, s) = match &self.gate {
                Some(g) => {
                    let (gated, sg) = g.forward(cx, &x2, &ys)?;
                    (gated, Saved::new(vec![], vec![s, sg]))
                }
                None => (ys, s),
            };
            k::add_(&y, &ys)?;
            children.push(s);
        }
        // This rank's partial sums of every token's output, reduced once (or reduce-scattered);
        // with whole experts its own tokens' outputs.
        let y = y.reshape(x.dims().to_vec())?;
        let y = if self.own_slice { y } else { self.tp.exit(&y)? };
        let host = |c: &[usize]| Tensor::from_vec(c.iter().map(|&c| c as u32).collect(), [c.len()], &Device::Cpu);
        let counts = host(&sort.tokens_per_expert)?;
        let mut saved = vec![logits, probs, experts, sort.perm, sort.slot, yp, counts, host(&aux_counts)?];
        // On one expert-parallel rank the local experts are all of them: `counts` serves both.
        if let Some(d) = plan {
            saved.extend(d.into_tensors()?);
        }
        Ok((y, Saved::new(saved, children)))
    }

    fn backward(&self, cx: &Cx, saved: Saved, dy: &Tensor) -> Result<Tensor> {
        let Saved { tensors, children } = saved;
        let mut t = tensors.into_iter();
        let mut next = |what: &str| t.next().ok_or_else(|| invalid(BWD, format!("saved {what} missing")));
        let (logits, probs, experts, perm, slot, yp) =
            (next("logits")?, next("probs")?, next("experts")?, next("perm")?, next("slot")?, next("yp")?);
        let counts: Vec<usize> = next("counts")?.to_vec::<u32>()?.into_iter().map(|c| c as usize).collect();
        let aux_counts = next("aux_counts")?.to_vec::<u32>()?;
        if let Some(b) = &self.bias {
            b.count(&counts);
        }
        let plan = match &self.ep {
            Some(g) => Some(Dispatch::from_tensors(g.0.size(), [next("splits")?, next("order")?, next("inverse")?])?),
            None => None,
        };
        let local_counts = plan.as_ref().map_or(&counts, |d| &d.local_counts).clone();
        let (n, c) = (logits.dims()[0], self.hidden);
        // Sequence parallel: the whole sequence's output gradient (each rank's slice, gathered).
        let dy = &if self.own_slice { dy.clone() } else { self.tp.exit_bwd(dy)? };
        let dy2 = dy.reshape([n, c])?;
        let (dyp, dprobs) = k::moe_unpermute_bwd(&yp, &slot, &probs, &dy2)?;
        // yp holds this rank's partial sums: so does dprobs, summed before the router's backward.
        if !self.own_slice {
            self.tp.all_reduce(&dprobs)?;
        }
        let mut children = children;
        // The shared experts' saved values come last (their input gradient added below; the
        // gate's, like the router's, added once).
        let mut dx_gate = None;
        let dx_shared = match &self.shared {
            Some(sh) => {
                let s = children.pop().ok_or_else(|| invalid(BWD, "shared experts' saved values missing"))?;
                let (s, dys) = match &self.gate {
                    Some(g) => {
                        let mut both = s.children;
                        let (sg, s) =
                            both.pop().zip(both.pop()).ok_or_else(|| invalid(BWD, "gate's saved values missing"))?;
                        let partial = (!self.own_slice).then_some(&self.tp);
                        let (dys, dxg) = g.backward(cx, sg, &dy2, partial)?;
                        dx_gate = Some(dxg);
                        (s, dys)
                    }
                    None => (s, dy2.clone()),
                };
                let d = if self.own_slice {
                    sh.backward(cx, s, &dys.reshape(dy.dims().to_vec())?)?
                } else {
                    sh.backward(cx, s, &dys)?
                };
                Some(d.reshape([n, c])?)
            }
            None => None,
        };
        let dyl = match (&self.ep, &plan) {
            (Some(g), Some(d)) => d.out(&*g.0, &dyp)?,
            _ => dyp,
        };
        let mut children = children.into_iter();
        let s_router = children.next().ok_or_else(|| invalid(BWD, "router's saved values missing"))?;
        let dxl = self.per_expert(&dyl, &local_counts, |e, rows| {
            let s = children.next().ok_or_else(|| invalid(BWD, format!("expert {e}'s saved values missing")))?;
            self.experts[e].backward(cx, s, rows)
        })?;
        let dxp = match (&self.ep, &plan) {
            (Some(g), Some(d)) => d.back(&*g.0, &dxl)?,
            _ => dxl,
        };
        let dx = match dx_shared {
            Some(d) if d.dtype() == dy.dtype() => d,
            Some(d) => k::cast(&d, dy.dtype())?,
            None => Tensor::zeros([n, c], dy.dtype(), dy.device())?,
        };
        k::embedding_bwd(&perm, &dxp, &dx)?;
        let dlogits = k::moe_route_bwd(&logits, &experts, &dprobs, &self.topk)?;
        if self.aux_coeff > 0.0 || self.z_coeff > 0.0 {
            // [E], or [B, E] per sequence.
            let seqs = aux_counts.len() / self.num_experts;
            let per_expert: Vec<f32> = aux_counts.iter().map(|&c| c as f32).collect();
            let shape = if seqs > 1 { vec![seqs, self.num_experts] } else { vec![self.num_experts] };
            let per_expert = Tensor::from_vec(per_expert, shape, &Device::Cpu)?.to_device(logits.device())?;
            // Under context parallelism the losses are the whole micro-batch's: counts and token
            // total over every cp rank (Megatron sums them over its tp × cp group). This rank's
            // share of their gradient is scaled by cp as its language-model loss is (the
            // gradients are averaged over data × context ranks), and so are the values recorded
            // (averaged over the ranks for the log, their shares sum to the whole). With whole
            // experts the tensor-parallel ranks' slices are counted likewise, their gradients at
            // scale 1 (each rank's tokens' own: the sequence-parallel regions are summed, not
            // averaged).
            let cp = match &self.cp {
                Some(g) => {
                    g.0.all_reduce(&per_expert, ReduceOp::Sum).map_err(|e| invalid(BWD, e.to_string()))?;
                    g.0.size()
                }
                None => 1,
            };
            let tp = if self.own_slice {
                self.tp.all_reduce(&per_expert)?;
                self.tp.size()
            } else {
                1
            };
            // The global-batch loss (Megatron's, over its tp × dp × cp group): the counts summed
            // over the data-parallel ranks too, averaged over the step's micro-batches so far,
            // the token total over dp ranks too, which the counts carry here as 1 / dp² (the
            // z-loss keeps this rank's total). Each rank's loss is its share of the whole, its
            // gradient then averaged over dp as every gradient is (Megatron's, to the bit of
            // its formula).
            let (per_expert, dp) = match &self.global {
                Some((counts, group)) => {
                    let dp = match group {
                        Some(g) => {
                            g.0.all_reduce(&per_expert, ReduceOp::Sum).map_err(|e| invalid(BWD, e.to_string()))?;
                            g.0.size()
                        }
                        None => 1,
                    };
                    (counts.add(&self.name, &per_expert, 1.0 / (dp * dp) as f32)?, dp)
                }
                None => (per_expert, 1),
            };
            let loss = k::RouterLoss {
                topk: self.topk.k,
                total_tokens: n * cp * tp,
                aux_coeff: self.aux_coeff,
                z_coeff: self.z_coeff,
                // Megatron's: × cp (each context-parallel rank's loss is over its share of the
                // sequence), or under --calculate-per-token-loss the batch's own scale.
                grad_scale: cx.grad_scale * cx.own_loss_scale.unwrap_or(cp as f32),
                score: self.topk.score,
                seqs,
            };
            let (values, dl) = k::moe_router_loss(&logits, &per_expert, &loss)?;
            let dl = if dl.dtype() == dlogits.dtype() { dl } else { k::cast(&dl, dlogits.dtype())? };
            k::add_(&dlogits, &dl)?;
            if cp * tp > 1 {
                k::scale_(&values, (cp * tp) as f32)?;
            }
            if dp > 1 {
                // The load-balancing value alone: the z-loss is this rank's own.
                k::scale_(&values.view(0, [1])?, dp as f32)?;
            }
            self.metrics.record(&self.name, values);
        }
        let dxr = self.router.backward(cx, s_router, &dlogits)?;
        // The experts' parts of dx are this rank's partial sums; the router's is the same on
        // every rank, so one rank adds it before the sum (under sequence parallelism the
        // reduce-scatter to this rank's slice).
        if self.own_slice || self.tp.rank() == 0 {
            k::add_(&dx, &dxr)?;
            if let Some(d) = &dx_gate {
                k::add_(&dx, &d.reshape([n, c])?)?;
            }
        }
        let dx = dx.reshape(dy.dims().to_vec())?;
        if self.own_slice { Ok(dx) } else { self.tp.enter_bwd(&dx) }
    }

    /// The experts' and the shared experts' products in FP8 (each expert's token list padded to
    /// whole 16-row tiles inside `k::fp8_linear_fwd`); the router and the shared gate stay in
    /// their dtypes, as Megatron keeps them.
    fn set_fp8(&mut self, fp8: Option<&ferrotron_core::Fp8Recipe>) -> Result<()> {
        for m in self.experts.iter_mut().chain(self.shared.iter_mut()) {
            m.set_fp8(fp8);
        }
        Ok(())
    }
}
