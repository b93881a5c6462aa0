//! The shared experts' gate (Qwen-MoE's, Megatron's --moe-shared-expert-gate): the shared
//! experts' output scaled per token by σ(x · gate_weightᵀ), gate_weight [1, C] named
//! `{prefix}.shared_experts.gate_weight`.
//!
//! It is a one-expert sigmoid router, and runs on the router's kernels: `moe_route` with top-1
//! sigmoid scores gives s = σ(g) unrenormalised, `moe_unpermute` with one slot per token scales
//! the rows (ys · s) and its backward gives d(ys) = s · dy and ds = ⟨ys, dy⟩, `moe_route_bwd`
//! turns ds into dg = ds · s (1 − s).
//!
//! Forward, x and ys [N, C]:
//!   g [N, 1] = x · gate_weightᵀ;  s = σ(g);  out[n] = s[n] · ys[n]
//! Backward: d(ys) = s · dout; ds = ⟨ys, dout⟩ (summed over the tensor-parallel group when ys
//! holds partial sums); dg = ds · s (1 − s); dx = dg · gate_weight (returned, `=`),
//! d(gate_weight) += dgᵀ · x into main_grad.

use ferrotron_core::{Cx, Module, ParamTableBuilder, Result, Saved, Tensor, invalid};
use ferrotron_kernels as k;
use ferrotron_parallel::TensorParallel;
use ferrotron_transformer::linear::Linear;

pub struct SharedGate {
    pub linear: Linear,
}

/// Top-1 σ scores: the gate's weight is σ(g) itself (a single score is not renormalised).
fn sigmoid_top1() -> k::TopK {
    k::TopK { score: k::Score::Sigmoid, ..k::TopK::new(1, false, 1.0) }
}

const BWD: &str = "SharedGate::backward";

impl SharedGate {
    /// `{prefix}.shared_experts.gate_weight` [1, hidden], N(0, std) as Megatron's init method;
    /// `sequence_shards` as the router's (each rank sees only its slice of the sequence).
    pub fn new(
        p: &mut ParamTableBuilder,
        prefix: &str,
        hidden: usize,
        std: f32,
        sequence_shards: bool,
    ) -> Result<Self> {
        let name = format!("{prefix}.shared_experts.gate_weight");
        Ok(SharedGate { linear: Linear::named_weight(p, &name, [hidden, 1], std, sequence_shards)? })
    }

    /// x, ys [N, C] → s · ys [N, C] (ys's dtype).
    pub fn forward(&self, cx: &Cx, x: &Tensor, ys: &Tensor) -> Result<(Tensor, Saved)> {
        let (g, s_lin) = self.linear.forward(cx, x)?;
        let (s, one) = k::moe_route(&g, &sigmoid_top1(), None)?;
        let n = g.dims()[0];
        let rows = Tensor::from_vec((0..n as u32).collect(), [n, 1], ys.device())?;
        let out = k::moe_unpermute(ys, &rows, &s)?;
        Ok((out, Saved::new(vec![g, s, one, ys.clone(), rows], vec![s_lin])))
    }

    /// (d(ys), dx) from dout [N, C]; `partial`: ys held this rank's partial sums over `partial`'s
    /// group (ds is summed over it before the gate's own backward).
    pub fn backward(
        &self,
        cx: &Cx,
        saved: Saved,
        dout: &Tensor,
        partial: Option<&TensorParallel>,
    ) -> Result<(Tensor, Tensor)> {
        let Saved { tensors, mut children } = saved;
        let [g, s, one, ys, rows] =
            <[Tensor; 5]>::try_from(tensors).map_err(|_| invalid(BWD, "saved values missing"))?;
        let s_lin = children.pop().ok_or_else(|| invalid(BWD, "the gate's saved input missing"))?;
        let (dys, ds) = k::moe_unpermute_bwd(&ys, &rows, &s, dout)?;
        if let Some(tp) = partial {
            tp.all_reduce(&ds)?;
        }
        let dg = k::moe_route_bwd(&g, &one, &ds, &sigmoid_top1())?;
        let dx = self.linear.backward(cx, s_lin, &dg)?;
        Ok((dys, dx))
    }
}
