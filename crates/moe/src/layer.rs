//! The MoE layer (Megatron-Core's MoELayer: TopKRouter, dropless dispatch on one rank,
//! SequentialMLP experts).
//!
//! Forward, x [B, T, C] as N = B·T tokens:
//!   logits [N, E] = x · routerᵀ                      (router.weight [E, C])
//!   probs, experts [N, K] = top-k of logits           (`k::moe_route`)
//!   xp [N·K, C] = x[perm]                             (copies sorted by expert, tokens ascending)
//!   yp[rows of e] = expert_e(xp[rows of e])           (experts.local_experts.e: the dense MLP)
//!   y[n] = Σ_j probs[n, j] · yp[slot[n, j]]
//! Backward: dyp and dprobs from the combine; each expert's backward on its rows; dx = the
//! scatter-add of dxp by perm + dlogits · router, where dlogits is the top-k's backward plus, in
//! training, grad_scale · ∂(aux_coeff · load_balancing + z_coeff · z)/∂logits (the counts are
//! constants). Parameter gradients add into main_grad (`+=`); an expert that no token chose this
//! micro-batch adds nothing.

use crate::metrics::MoeMetrics;
use crate::spec::{LoadBalancing, MoeSpec};
use ferrotron_core::{Cx, Module, ParamTableBuilder, Result, Saved, Tensor, invalid};
use ferrotron_kernels as k;
use ferrotron_transformer::linear::Linear;
use ferrotron_transformer::mlp::Mlp;
use ferrotron_transformer::spec::FactoryCx;

pub struct MoeLayer {
    /// `{prefix}.router.weight` [E, C].
    pub router: Linear,
    /// `{prefix}.experts.local_experts.{e}`: expert e's dense MLP.
    pub experts: Vec<Mlp>,
    topk: k::TopK,
    aux_coeff: f32,
    z_coeff: f32,
    hidden: usize,
    /// The parameter prefix, the layer's name in the metrics.
    name: String,
    metrics: MoeMetrics,
}

impl MoeLayer {
    pub fn new(p: &mut ParamTableBuilder, cx: &FactoryCx, spec: &MoeSpec) -> Result<Self> {
        let prefix = cx.prefix;
        let router = Linear::new(p, &format!("{prefix}.router"), cx.hidden, spec.num_experts, false, cx.std)?;
        let experts = (0..spec.num_experts)
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
                    cx.tp,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        let r = &spec.router;
        Ok(MoeLayer {
            router,
            experts,
            topk: k::TopK { k: r.topk, pre_softmax: r.pre_softmax, scale: r.topk_scaling_factor.unwrap_or(1.0) },
            aux_coeff: if r.load_balancing == LoadBalancing::AuxLoss { r.aux_loss_coeff } else { 0.0 },
            z_coeff: r.z_loss_coeff.unwrap_or(0.0),
            hidden: cx.hidden,
            name: prefix.to_string(),
            metrics: spec.metrics.clone(),
        })
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
        let n = x.elem_count() / c;
        let x2 = x.reshape([n, c])?;
        let (logits, s_router) = self.router.forward(cx, &x2)?;
        let (probs, experts) = k::moe_route(&logits, &self.topk)?;
        let sort = k::moe_sort(&experts, self.experts.len())?;
        let xp = k::embedding_fwd(&sort.perm, &x2)?;
        let yp = Tensor::empty([n * self.topk.k, c], x.dtype(), x.device())?;
        let mut children = vec![s_router];
        for (e, rows) in Self::runs(&sort.tokens_per_expert).filter(|(_, r)| !r.is_empty()) {
            let (ye, se) = self.experts[e].forward(cx, &xp.narrow0(rows.clone())?)?;
            k::copy_(&yp.narrow0(rows)?, &ye)?;
            children.push(se);
        }
        let y = k::moe_unpermute(&yp, &sort.slot, &probs)?.reshape(x.dims().to_vec())?;
        let counts: Vec<u32> = sort.tokens_per_expert.iter().map(|&c| c as u32).collect();
        let counts = Tensor::from_vec(counts, [self.experts.len()], &ferrotron_core::Device::Cpu)?;
        Ok((y, Saved::new(vec![logits, probs, experts, sort.perm, sort.slot, yp, counts], children)))
    }

    fn backward(&self, cx: &Cx, saved: Saved, dy: &Tensor) -> Result<Tensor> {
        let Saved { tensors, children } = saved;
        let [logits, probs, experts, perm, slot, yp, counts]: [Tensor; 7] =
            tensors.try_into().map_err(|_| invalid(BWD, "saved values do not match forward"))?;
        let counts: Vec<usize> = counts.to_vec::<u32>()?.into_iter().map(|c| c as usize).collect();
        let (n, c) = (logits.dims()[0], self.hidden);
        let (dyp, dprobs) = k::moe_unpermute_bwd(&yp, &slot, &probs, &dy.reshape([n, c])?)?;
        let mut children = children.into_iter();
        let s_router = children.next().ok_or_else(|| invalid(BWD, "router's saved values missing"))?;
        let dxp = Tensor::empty([n * self.topk.k, c], dy.dtype(), dy.device())?;
        for (e, rows) in Self::runs(&counts).filter(|(_, r)| !r.is_empty()) {
            let s = children.next().ok_or_else(|| invalid(BWD, format!("expert {e}'s saved values missing")))?;
            let dxe = self.experts[e].backward(cx, s, &dyp.narrow0(rows.clone())?)?;
            k::copy_(&dxp.narrow0(rows)?, &dxe)?;
        }
        let dx = Tensor::zeros([n, c], dy.dtype(), dy.device())?;
        k::embedding_bwd(&perm, &dxp, &dx)?;
        let dlogits = k::moe_route_bwd(&logits, &experts, &dprobs, &self.topk)?;
        if self.aux_coeff > 0.0 || self.z_coeff > 0.0 {
            let per_expert: Vec<f32> = counts.iter().map(|&c| c as f32).collect();
            let per_expert = Tensor::from_vec(per_expert, [counts.len()], logits.device())?;
            let loss = k::RouterLoss {
                topk: self.topk.k,
                total_tokens: n,
                aux_coeff: self.aux_coeff,
                z_coeff: self.z_coeff,
                grad_scale: cx.grad_scale,
            };
            let (values, dl) = k::moe_router_loss(&logits, &per_expert, &loss)?;
            k::add_(&dlogits, &k::cast(&dl, dlogits.dtype())?)?;
            self.metrics.record(&self.name, values);
        }
        let dxr = self.router.backward(cx, s_router, &dlogits)?;
        k::add_(&dx, &dxr)?;
        dx.reshape(dy.dims().to_vec())
    }
}
