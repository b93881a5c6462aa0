//! Column- and row-parallel linear layers, y = x·Wᵀ + b with W [out, in] split across the
//! tensor-parallel group.
//!
//! Column: W split along out (dim 0); input replicated (or gathered along T under sequence
//! parallelism); output split along features unless `gather_output`.
//! Row: W split along in (dim 1); input split along features (`input_is_parallel`, else sliced
//! here); partial outputs summed (or reduce-scattered along T); the bias is added once, after.
//!
//! Backward follows the region mappings of `tp`: dx = dy·W, then the entry's backward; parameter
//! grads are added (`+=`) into main_grad from the whole (gathered) activations.

use crate::tp::TensorParallel;
use ferrotron_core::{
    Blocks, Cx, Init, Module, ParamId, ParamMeta, ParamTableBuilder, Result, Saved, Shard, Tensor, invalid,
};
use ferrotron_kernels as k;

fn saved_one<'a>(op: &'static str, s: &'a Saved) -> Result<&'a Tensor> {
    s.tensors.first().ok_or_else(|| invalid(op, "nothing saved by forward"))
}

/// dW += dyᵀ·x, db += Σ dy over rows (or = where the step reaches them first: `grad_acc`).
fn param_grads(cx: &Cx, w: ParamId, b: Option<ParamId>, x: &Tensor, dy: &Tensor) -> Result<()> {
    let (out, inp) = (dy.shape().last(), x.shape().last());
    let rows = dy.elem_count() / out.max(1);
    let (dw, acc) = cx.params.grad_acc(w)?;
    k::matmul_into(&dw, &dy.reshape([rows, out])?, &x.reshape([rows, inp])?, true, false, acc)?;
    if let Some(b) = b {
        let (db, acc) = cx.params.grad_acc(b)?;
        k::bias_grad_into(&db, dy, acc)?;
    }
    Ok(())
}

#[derive(Debug, Clone)]
pub struct ColumnParallelLinear {
    pub weight: ParamId,
    pub bias: Option<ParamId>,
    pub in_features: usize,
    /// Whole output width (all ranks).
    pub out_features: usize,
    pub gather_output: bool,
    pub tp: TensorParallel,
}

impl ColumnParallelLinear {
    /// `blocks` > 1 when the output is several equal blocks each split separately (SwiGLU's
    /// gate|value: 2), so that every rank holds its part of each block.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        p: &mut ParamTableBuilder,
        prefix: &str,
        in_features: usize,
        out_features: usize,
        bias: bool,
        std: f32,
        tp: &TensorParallel,
        blocks: usize,
    ) -> Result<Self> {
        let shard = Shard { rank: tp.rank(), size: tp.size(), blocks: Blocks::Equal(blocks) };
        let weight = p.add(ParamMeta::split(
            format!("{prefix}.weight"),
            [out_features, in_features],
            0,
            shard,
            Init::Normal { std },
            true,
        )?)?;
        let bias = if bias {
            Some(p.add(ParamMeta::split(format!("{prefix}.bias"), [out_features], 0, shard, Init::Zeros, false)?)?)
        } else {
            None
        };
        Ok(ColumnParallelLinear { weight, bias, in_features, out_features, gather_output: false, tp: tp.clone() })
    }

    pub fn with_gather_output(mut self, yes: bool) -> Self {
        self.gather_output = yes;
        self
    }

    /// `forward` then GeLU: (gelu(y), y, saved), with the GeLU in the GEMM's epilogue where the
    /// device has one (`k::linear_gelu`). `backward` takes the saved values as from `forward`.
    pub fn forward_gelu(&self, cx: &Cx, x: &Tensor) -> Result<(Tensor, Tensor, Saved)> {
        if self.gather_output {
            let (y, s) = self.forward(cx, x)?;
            return Ok((k::gelu(&y)?, y, s));
        }
        let x = self.tp.enter(x)?;
        let b = self.bias.map(|b| cx.params.param(b)).transpose()?;
        let (a, y) = k::linear_gelu(&x, &cx.params.param(self.weight)?, b.as_ref())?;
        Ok((a, y, Saved::new(vec![x], vec![])))
    }
}

impl Module for ColumnParallelLinear {
    fn forward(&self, cx: &Cx, x: &Tensor) -> Result<(Tensor, Saved)> {
        let x = self.tp.enter(x)?;
        let w = cx.params.param(self.weight)?;
        let y = match self.bias {
            Some(b) => k::matmul_bias(&x, &w, &cx.params.param(b)?, false, true)?,
            None => k::matmul(&x, &w, false, true)?,
        };
        let y = if self.gather_output { self.tp.gather_last(&y)? } else { y };
        Ok((y, Saved::new(vec![x], vec![])))
    }

    fn backward(&self, cx: &Cx, saved: Saved, dy: &Tensor) -> Result<Tensor> {
        self.backward_with(cx, saved, dy, self.bias)
    }
}

impl ColumnParallelLinear {
    /// `backward` for a caller whose own kernel already summed dy into the bias gradient (the
    /// flash backward writing dQKV: `k::attention_bwd_qkv_into`); the weight's gradient and dx as
    /// `backward`. Only where dy is this rank's output as is (no `gather_output`).
    pub fn backward_bias_summed(&self, cx: &Cx, saved: Saved, dy: &Tensor) -> Result<Tensor> {
        if self.gather_output {
            return Err(invalid("ColumnParallelLinear::backward_bias_summed", "the output is gathered: use backward"));
        }
        self.backward_with(cx, saved, dy, None)
    }

    fn backward_with(&self, cx: &Cx, saved: Saved, dy: &Tensor, bias: Option<ParamId>) -> Result<Tensor> {
        let x = saved_one("ColumnParallelLinear::backward", &saved)?;
        let dy = if self.gather_output { self.tp.split_last(dy)? } else { dy.clone() };
        let dx = k::matmul(&dy, &cx.params.param(self.weight)?, false, false)?;
        param_grads(cx, self.weight, bias, x, &dy)?;
        self.tp.enter_bwd(&dx)
    }
}

#[derive(Debug, Clone)]
pub struct RowParallelLinear {
    pub weight: ParamId,
    pub bias: Option<ParamId>,
    /// Whole input width (all ranks).
    pub in_features: usize,
    pub out_features: usize,
    pub input_is_parallel: bool,
    pub tp: TensorParallel,
}

impl RowParallelLinear {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        p: &mut ParamTableBuilder,
        prefix: &str,
        in_features: usize,
        out_features: usize,
        bias: bool,
        std: f32,
        tp: &TensorParallel,
    ) -> Result<Self> {
        let shard = Shard::of(tp.rank(), tp.size());
        let weight = p.add(ParamMeta::split(
            format!("{prefix}.weight"),
            [out_features, in_features],
            1,
            shard,
            Init::Normal { std },
            true,
        )?)?;
        let bias = if bias {
            let m = ParamMeta::replicated(format!("{prefix}.bias"), [out_features], Init::Zeros, false);
            Some(p.add(m.on_sequence_shards(tp.sp()))?)
        } else {
            None
        };
        Ok(RowParallelLinear { weight, bias, in_features, out_features, input_is_parallel: true, tp: tp.clone() })
    }

    pub fn with_input_is_parallel(mut self, yes: bool) -> Self {
        self.input_is_parallel = yes;
        self
    }
}

impl Module for RowParallelLinear {
    fn forward(&self, cx: &Cx, x: &Tensor) -> Result<(Tensor, Saved)> {
        let x = if self.input_is_parallel { x.clone() } else { self.tp.split_last(x)? };
        let w = cx.params.param(self.weight)?;
        let y = match (self.tp.size(), self.bias) {
            // Alone: the bias rides in the GEMM epilogue.
            (1, Some(b)) => k::matmul_bias(&x, &w, &cx.params.param(b)?, false, true)?,
            (_, b) => {
                let y = self.tp.exit(&k::matmul(&x, &w, false, true)?)?;
                match b.filter(|_| self.tp.adds_bias()) {
                    Some(b) => k::bias_add(&y, &cx.params.param(b)?)?,
                    None => y,
                }
            }
        };
        Ok((y, Saved::new(vec![x], vec![])))
    }

    fn backward(&self, cx: &Cx, saved: Saved, dy: &Tensor) -> Result<Tensor> {
        self.backward_parts(cx, saved, dy, None, true)
    }

    fn out_bias(&self) -> Option<ParamId> {
        self.bias
    }

    fn backward_without_out_bias(&self, cx: &Cx, saved: Saved, dy: &Tensor) -> Result<Tensor> {
        self.backward_parts(cx, saved, dy, None, false)
    }
}

impl RowParallelLinear {
    /// `backward` followed by the GeLU backward of the layer before (whose pre-activation is
    /// `h`): gelu_bwd(h, dx), fused into the input-gradient GEMM where the device allows
    /// (`k::matmul_dgelu`).
    pub fn backward_dgelu(&self, cx: &Cx, saved: Saved, dy: &Tensor, h: &Tensor) -> Result<Tensor> {
        self.backward_parts(cx, saved, dy, Some(h), true)
    }

    /// The backward with the GeLU backward of the layer before (`dgelu_of`: its pre-activation)
    /// or not, and with the bias gradient (`bias_grad`) or without it (`out_bias`'s contract).
    pub fn backward_parts(
        &self,
        cx: &Cx,
        saved: Saved,
        dy: &Tensor,
        dgelu_of: Option<&Tensor>,
        bias_grad: bool,
    ) -> Result<Tensor> {
        let h = dgelu_of;
        let x = saved_one("RowParallelLinear::backward", &saved)?;
        if let Some(b) = self.bias.filter(|_| bias_grad) {
            // Under sequence parallelism dy is this rank's sequence slice: a partial bias grad,
            // summed over the group with the other sequence-parallel grads before the step.
            let (db, acc) = cx.params.grad_acc(b)?;
            k::bias_grad_into(&db, dy, acc)?;
        }
        let dy = self.tp.exit_bwd(dy)?;
        let w = cx.params.param(self.weight)?;
        let dx = match h {
            Some(h) if self.input_is_parallel => k::matmul_dgelu(&dy, &w, h)?,
            _ => k::matmul(&dy, &w, false, false)?,
        };
        param_grads(cx, self.weight, None, x, &dy)?;
        match (self.input_is_parallel, h) {
            (true, _) => Ok(dx),
            (false, None) => self.tp.gather_last(&dx),
            (false, Some(h)) => k::gelu_bwd(h, &self.tp.gather_last(&dx)?),
        }
    }
}
