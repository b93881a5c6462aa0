//! LayerNorm / RMSNorm over the last dimension as a module (weight initialised to 1, bias to 0; no
//! weight decay on either). Zero-centred (`NormSpec::zero_centred`): the weight starts at 0 and
//! the kernels scale by 1 + w (`k::Gamma`). `partial_grad`: the norm runs on part of the data of a
//! tensor-parallel group (sequence shards, or this rank's heads for QK-norm), so its gradients are
//! summed over the group before the step (`ParamMeta::sequence_parallel`).

use crate::spec::{NormKind, NormSpec};
use ferrotron_core::{Cx, Init, Module, ParamId, ParamMeta, ParamTableBuilder, Result, Saved, Tensor, invalid};
use ferrotron_kernels as k;

#[derive(Debug, Clone)]
pub struct Norm {
    pub kind: NormKind,
    pub weight: ParamId,
    pub bias: Option<ParamId>,
    pub eps: f64,
    pub zero_centred: bool,
}

impl Norm {
    pub fn new(
        p: &mut ParamTableBuilder,
        prefix: &str,
        spec: NormSpec,
        width: usize,
        partial_grad: bool,
    ) -> Result<Self> {
        let NormSpec { kind, eps, zero_centred } = spec;
        let meta = |n: &str, init| ParamMeta::replicated(format!("{prefix}.{n}"), [width], init, false);
        let w_init = if zero_centred { Init::Zeros } else { Init::Ones };
        let weight = p.add(meta("weight", w_init).on_sequence_shards(partial_grad))?;
        let bias = match kind {
            NormKind::LayerNorm => Some(p.add(meta("bias", Init::Zeros).on_sequence_shards(partial_grad))?),
            NormKind::RmsNorm => None,
        };
        Ok(Norm { kind, weight, bias, eps, zero_centred })
    }
}

impl Norm {
    /// The weight as the kernels' scale.
    fn gamma<'a>(&self, w: &'a Tensor) -> k::Gamma<'a> {
        k::Gamma { w, one_plus: self.zero_centred }
    }

    /// The residual add before this norm, fused with it: returns (x + r, norm(x + r), saved). The
    /// saved values are those of `forward` on the sum, so `backward` and `backward_add` take them.
    pub fn forward_add(&self, cx: &Cx, x: &Tensor, r: &Tensor) -> Result<(Tensor, Tensor, Saved)> {
        let w = cx.params.param(self.weight)?;
        match self.bias {
            Some(b) => {
                let (sum, y, mean, rstd) =
                    k::add_layernorm_fwd(x, r, self.gamma(&w), Some(&cx.params.param(b)?), self.eps)?;
                Ok((sum.clone(), y, Saved::new(vec![sum, mean, rstd], vec![])))
            }
            None => {
                let (sum, y, rstd) = k::add_rmsnorm_fwd(x, r, self.gamma(&w), self.eps)?;
                Ok((sum.clone(), y, Saved::new(vec![sum, rstd], vec![])))
            }
        }
    }

    /// `backward` with the residual stream's gradient `res` added to the result (dx + res).
    pub fn backward_add(&self, cx: &Cx, saved: Saved, dy: &Tensor, res: &Tensor) -> Result<Tensor> {
        self.backward_res(cx, saved, dy, Some(res), None)
    }

    /// `backward_add` that also adds Σ rows of `res` into `res_bias`'s gradient: the bias of the
    /// linear layer whose output gradient `res` is (a branch's `Module::out_bias`), summed in the
    /// norm's own pass over `res` on a GPU.
    pub fn backward_add_bias(
        &self,
        cx: &Cx,
        saved: Saved,
        dy: &Tensor,
        res: &Tensor,
        res_bias: ParamId,
    ) -> Result<Tensor> {
        self.backward_res(cx, saved, dy, Some(res), Some(res_bias))
    }

    fn backward_res(
        &self,
        cx: &Cx,
        saved: Saved,
        dy: &Tensor,
        res: Option<&Tensor>,
        res_bias: Option<ParamId>,
    ) -> Result<Tensor> {
        let w = cx.params.param(self.weight)?;
        let g_w = self.gamma(&w);
        let s = &saved.tensors;
        if s.len() != if self.bias.is_some() { 3 } else { 2 } {
            return Err(invalid("Norm::backward", "saved tensors do not match forward"));
        }
        let mut ids = vec![self.weight];
        ids.extend(self.bias);
        ids.extend(res_bias);
        let (g, acc) = cx.params.grads_acc(&ids)?;
        match (self.bias, res_bias, res) {
            (Some(_), Some(_), Some(r)) => {
                k::layernorm_bwd_into_bias(dy, &s[0], g_w, &s[1], &s[2], r, &g[0], &g[1], &g[2], acc)
            }
            (Some(_), None, _) => k::layernorm_bwd_into(dy, &s[0], g_w, &s[1], &s[2], res, &g[0], &g[1], acc),
            (None, Some(_), Some(r)) => k::rmsnorm_bwd_into_bias(dy, &s[0], g_w, &s[1], r, &g[0], &g[1], acc),
            (None, None, _) => k::rmsnorm_bwd_into(dy, &s[0], g_w, &s[1], res, &g[0], acc),
            (_, Some(_), None) => Err(invalid("Norm::backward", "a residual bias gradient without a residual")),
        }
    }
}

impl Module for Norm {
    fn forward(&self, cx: &Cx, x: &Tensor) -> Result<(Tensor, Saved)> {
        let w = cx.params.param(self.weight)?;
        match self.bias {
            Some(b) => {
                let (y, mean, rstd) = k::layernorm_fwd(x, self.gamma(&w), Some(&cx.params.param(b)?), self.eps)?;
                Ok((y, Saved::new(vec![x.clone(), mean, rstd], vec![])))
            }
            None => {
                let (y, rstd) = k::rmsnorm_fwd(x, self.gamma(&w), self.eps)?;
                Ok((y, Saved::new(vec![x.clone(), rstd], vec![])))
            }
        }
    }

    fn backward(&self, cx: &Cx, saved: Saved, dy: &Tensor) -> Result<Tensor> {
        self.backward_res(cx, saved, dy, None, None)
    }
}

/// A norm over each attention head (`q_layernorm` / `k_layernorm`): QK-norm's own (`Norm`), or
/// Llama 4's L2 norm (Megatron's --qk-l2-norm), x / √(mean(x²) + eps) with no parameters: the
/// RMSNorm kernels at a scale of 1 (`k::Gamma::one_plus` of zeros), their weight gradient unused.
#[derive(Debug, Clone)]
pub enum HeadNorm {
    Learned(Norm),
    L2 { eps: f64 },
}

impl HeadNorm {
    /// The unit scale of the L2 norm over the last dimension of `x`.
    fn unit(x: &Tensor) -> Result<Tensor> {
        Tensor::zeros([x.shape().last()], x.dtype(), x.device())
    }
}

impl Module for HeadNorm {
    fn forward(&self, cx: &Cx, x: &Tensor) -> Result<(Tensor, Saved)> {
        match self {
            HeadNorm::Learned(n) => n.forward(cx, x),
            HeadNorm::L2 { eps } => {
                let (y, rstd) = k::rmsnorm_fwd(x, k::Gamma::one_plus(&Self::unit(x)?), *eps)?;
                Ok((y, Saved::new(vec![x.clone(), rstd], vec![])))
            }
        }
    }

    fn backward(&self, cx: &Cx, saved: Saved, dy: &Tensor) -> Result<Tensor> {
        match self {
            HeadNorm::Learned(n) => n.backward(cx, saved, dy),
            HeadNorm::L2 { .. } => {
                let [x, rstd] = &saved.tensors[..] else {
                    return Err(invalid("HeadNorm::backward", "saved tensors do not match forward"));
                };
                Ok(k::rmsnorm_bwd(dy, x, k::Gamma::one_plus(&Self::unit(x)?), rstd)?.0)
            }
        }
    }
}
