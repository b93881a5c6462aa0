//! Linear layer y = x·Wᵀ + b with W [out, in] (Megatron/PyTorch layout).
//!
//! Shapes: x [..., in] → y [..., out]. Backward: dx = dy·W (`=`); dW += dyᵀ·x and db += Σ dy into
//! main_grad.
//!
//! With a compute dtype (`in_fp32`: Megatron's --moe-router-dtype fp32 for the MoE router) the
//! product runs on x and W cast to it, y comes out in it, and the backward takes dy in it: dx is
//! cast back to x's dtype, dW computed in it and added into main_grad (rounded to main_grad's
//! dtype when that is narrower). Only x is saved (cast again in the backward).
//!
//! With an FP8 format (`fp8`, multi-latent attention's down-projections under --fp8-format) the
//! products run as the parallel linears' do (ferrotron-parallel's `linear::product`), saving the
//! FP8 xᵀ.

use ferrotron_core::Fp8Linear;
use ferrotron_core::{Cx, DType, Init, Module, ParamId, ParamMeta, ParamTableBuilder, Result, Saved, Tensor, invalid};
use ferrotron_kernels as k;
use ferrotron_parallel::linear::{product, product_bwd};

#[derive(Debug, Clone)]
pub struct Linear {
    pub weight: ParamId,
    pub bias: Option<ParamId>,
    pub in_features: usize,
    pub out_features: usize,
    /// The dtype the product runs in, when not the input's (None: the input's).
    pub compute: Option<DType>,
    /// The products in FP8 (module header; not with `compute`).
    pub fp8: Option<Fp8Linear>,
}

impl Linear {
    pub fn new(
        p: &mut ParamTableBuilder,
        prefix: &str,
        in_features: usize,
        out_features: usize,
        bias: bool,
        std: f32,
    ) -> Result<Self> {
        Self::on_sequence_shards(p, prefix, [in_features, out_features], bias, std, false)
    }

    /// `new`, its parameters marked as seeing only this rank's slice of the sequence where
    /// `sequence_shards` (a replicated layer under sequence parallelism: the gradients are
    /// summed over the tensor-parallel group before the step).
    pub fn on_sequence_shards(
        p: &mut ParamTableBuilder,
        prefix: &str,
        [in_features, out_features]: [usize; 2],
        bias: bool,
        std: f32,
        sequence_shards: bool,
    ) -> Result<Self> {
        let weight = p.add(
            ParamMeta::replicated(format!("{prefix}.weight"), [out_features, in_features], Init::Normal { std }, true)
                .on_sequence_shards(sequence_shards),
        )?;
        let bias = if bias {
            let m = ParamMeta::replicated(format!("{prefix}.bias"), [out_features], Init::Zeros, false);
            Some(p.add(m.on_sequence_shards(sequence_shards))?)
        } else {
            None
        };
        Ok(Linear { weight, bias, in_features, out_features, compute: None, fp8: None })
    }

    /// A bias-free layer whose weight has its own full name (Megatron's
    /// `shared_experts.gate_weight`), marked as `on_sequence_shards` marks it.
    pub fn named_weight(
        p: &mut ParamTableBuilder,
        weight: &str,
        [in_features, out_features]: [usize; 2],
        std: f32,
        sequence_shards: bool,
    ) -> Result<Self> {
        let meta = ParamMeta::replicated(weight, [out_features, in_features], Init::Normal { std }, true);
        let weight = p.add(meta.on_sequence_shards(sequence_shards))?;
        Ok(Linear { weight, bias: None, in_features, out_features, compute: None, fp8: None })
    }

    /// This layer computing in fp32 whatever its input's and parameters' dtype.
    pub fn in_fp32(self) -> Self {
        Linear { compute: Some(DType::F32), ..self }
    }

    /// `t` in the compute dtype.
    fn widen(&self, t: &Tensor) -> Result<Tensor> {
        match self.compute {
            Some(d) if d != t.dtype() => k::cast(t, d),
            _ => Ok(t.clone()),
        }
    }
}

impl Module for Linear {
    fn forward(&self, cx: &Cx, x: &Tensor) -> Result<(Tensor, Saved)> {
        if self.fp8.is_some() {
            return product(cx, self.weight, self.bias, x, self.fp8.as_ref());
        }
        let (xc, w) = (self.widen(x)?, self.widen(&cx.params.param(self.weight)?)?);
        let y = match self.bias {
            Some(b) => k::matmul_bias(&xc, &w, &self.widen(&cx.params.param(b)?)?, false, true)?,
            None => k::matmul(&xc, &w, false, true)?,
        };
        Ok((y, Saved::new(vec![x.clone()], vec![])))
    }

    fn backward(&self, cx: &Cx, saved: Saved, dy: &Tensor) -> Result<Tensor> {
        if self.fp8.is_some() {
            return product_bwd("Linear::backward", cx, (self.weight, self.bias), &saved, dy, self.fp8.as_ref());
        }
        let x = saved.tensors.first().ok_or_else(|| invalid("Linear::backward", "nothing saved by forward"))?;
        let (xc, dy) = (self.widen(x)?, &self.widen(dy)?);
        let w = self.widen(&cx.params.param(self.weight)?)?;
        let dx = k::matmul(dy, &w, false, false)?;
        let dx = if dx.dtype() == x.dtype() { dx } else { k::cast(&dx, x.dtype())? };
        let rows = dy.shape().rows();
        let dy2 = dy.reshape([rows, self.out_features])?;
        let x2 = xc.reshape([rows, self.in_features])?;
        let (dw, acc) = cx.params.grad_acc(self.weight)?;
        if self.compute.is_some_and(|d| d != dw.dtype()) {
            // main_grad narrower than the compute dtype (--grad-reduce-in-bf16): the product in
            // the compute dtype, rounded once as it is added.
            let g = k::matmul(&dy2, &x2, true, false)?;
            let g = k::cast(&g, dw.dtype())?;
            if acc { k::add_(&dw, &g)? } else { k::copy_(&dw, &g)? }
        } else {
            k::matmul_into(&dw, &dy2, &x2, true, false, acc)?;
        }
        if let Some(b) = self.bias {
            let (db, acc) = cx.params.grad_acc(b)?;
            k::bias_grad_into(&db, dy, acc)?;
        }
        Ok(dx)
    }
}
