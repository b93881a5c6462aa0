//! Linear layer y = x·Wᵀ + b with W [out, in] (Megatron/PyTorch layout).
//!
//! Shapes: x [..., in] → y [..., out]. Backward: dx = dy·W (`=`); dW += dyᵀ·x and db += Σ dy into
//! main_grad.

use ferrotron_core::{Cx, Init, Module, ParamId, ParamMeta, ParamTableBuilder, Result, Saved, Tensor, invalid};
use ferrotron_kernels as k;

#[derive(Debug, Clone)]
pub struct Linear {
    pub weight: ParamId,
    pub bias: Option<ParamId>,
    pub in_features: usize,
    pub out_features: usize,
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
        Ok(Linear { weight, bias, in_features, out_features })
    }
}

impl Module for Linear {
    fn forward(&self, cx: &Cx, x: &Tensor) -> Result<(Tensor, Saved)> {
        let w = cx.params.param(self.weight)?;
        let y = match self.bias {
            Some(b) => k::matmul_bias(x, &w, &cx.params.param(b)?, false, true)?,
            None => k::matmul(x, &w, false, true)?,
        };
        Ok((y, Saved::new(vec![x.clone()], vec![])))
    }

    fn backward(&self, cx: &Cx, saved: Saved, dy: &Tensor) -> Result<Tensor> {
        let x = saved.tensors.first().ok_or_else(|| invalid("Linear::backward", "nothing saved by forward"))?;
        let w = cx.params.param(self.weight)?;
        let dx = k::matmul(dy, &w, false, false)?;
        let rows = dy.shape().rows();
        let dy2 = dy.reshape([rows, self.out_features])?;
        let x2 = x.reshape([rows, self.in_features])?;
        let (dw, acc) = cx.params.grad_acc(self.weight)?;
        k::matmul_into(&dw, &dy2, &x2, true, false, acc)?;
        if let Some(b) = self.bias {
            let (db, acc) = cx.params.grad_acc(b)?;
            k::bias_grad_into(&db, dy, acc)?;
        }
        Ok(dx)
    }
}
