//! Dense MLP: linear_fc1 [C → F, or 2F gate|value for SwiGLU] → activation → linear_fc2 [F → C].

use crate::linear::Linear;
use crate::spec::Activation;
use ferrotron_core::{Cx, Module, ParamTableBuilder, Result, Saved, Tensor};
use ferrotron_kernels as k;

#[derive(Debug, Clone)]
pub struct Mlp {
    pub linear_fc1: Linear,
    pub linear_fc2: Linear,
    pub activation: Activation,
}

impl Mlp {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        p: &mut ParamTableBuilder,
        prefix: &str,
        hidden: usize,
        ffn: usize,
        activation: Activation,
        bias: bool,
        std: f32,
        out_std: f32,
    ) -> Result<Self> {
        let fc1_out = match activation {
            Activation::Gelu => ffn,
            Activation::SwiGlu => 2 * ffn,
        };
        Ok(Mlp {
            linear_fc1: Linear::new(p, &format!("{prefix}.linear_fc1"), hidden, fc1_out, bias, std)?,
            linear_fc2: Linear::new(p, &format!("{prefix}.linear_fc2"), ffn, hidden, bias, out_std)?,
            activation,
        })
    }
}

impl Module for Mlp {
    fn forward(&self, cx: &Cx, x: &Tensor) -> Result<(Tensor, Saved)> {
        let (h, s1) = self.linear_fc1.forward(cx, x)?;
        let a = match self.activation {
            Activation::Gelu => k::gelu(&h)?,
            Activation::SwiGlu => k::swiglu(&h)?,
        };
        let (y, s2) = self.linear_fc2.forward(cx, &a)?;
        Ok((y, Saved::new(vec![h], vec![s1, s2])))
    }

    fn backward(&self, cx: &Cx, saved: Saved, dy: &Tensor) -> Result<Tensor> {
        let Saved { tensors, children } = saved;
        let [s1, s2]: [Saved; 2] = children
            .try_into()
            .map_err(|_| ferrotron_core::invalid("Mlp::backward", "saved values do not match forward"))?;
        let da = self.linear_fc2.backward(cx, s2, dy)?;
        let h = tensors.first().ok_or_else(|| ferrotron_core::invalid("Mlp::backward", "nothing saved by forward"))?;
        let dh = match self.activation {
            Activation::Gelu => k::gelu_bwd(h, &da)?,
            Activation::SwiGlu => k::swiglu_bwd(h, &da)?,
        };
        self.linear_fc1.backward(cx, s1, &dh)
    }
}
