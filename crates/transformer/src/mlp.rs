//! Dense MLP: linear_fc1 [C → F, or 2F gate|value for SwiGLU and quick GeGLU] → activation →
//! linear_fc2 [F → C]. Tensor parallel: fc1 column-parallel (the gate and value blocks split separately, so each
//! rank's activation is its slice of F), fc2 row-parallel.

use crate::spec::Activation;
use ferrotron_core::{Cx, Module, ParamId, ParamTableBuilder, Result, Saved, Tensor};
use ferrotron_kernels as k;
use ferrotron_parallel::{ColumnParallelLinear, RowParallelLinear, TensorParallel};

#[derive(Debug, Clone)]
pub struct Mlp {
    pub linear_fc1: ColumnParallelLinear,
    pub linear_fc2: RowParallelLinear,
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
        tp: &TensorParallel,
    ) -> Result<Self> {
        Self::projection(p, prefix, [hidden, ffn, hidden], activation, bias, [std, out_std], tp)
    }

    /// An MLP from width `input` through `ffn` to `output` (LLaVA's vision projection: the vision
    /// encoder's width into the language model's), fc1's init std then fc2's.
    pub fn projection(
        p: &mut ParamTableBuilder,
        prefix: &str,
        [input, ffn, output]: [usize; 3],
        activation: Activation,
        bias: bool,
        [std, out_std]: [f32; 2],
        tp: &TensorParallel,
    ) -> Result<Self> {
        let blocks = activation.fc1_blocks();
        Ok(Mlp {
            linear_fc1: ColumnParallelLinear::new(
                p,
                &format!("{prefix}.linear_fc1"),
                input,
                blocks * ffn,
                bias,
                std,
                tp,
                blocks,
            )?,
            linear_fc2: RowParallelLinear::new(p, &format!("{prefix}.linear_fc2"), ffn, output, bias, out_std, tp)?,
            activation,
        })
    }
}

impl Module for Mlp {
    fn forward(&self, cx: &Cx, x: &Tensor) -> Result<(Tensor, Saved)> {
        let in_cast = match self.activation {
            Activation::Gelu => Some(k::Fp8Act::Gelu),
            Activation::SwiGlu => Some(k::Fp8Act::Swiglu),
            _ => None,
        };
        if let Some(act) = in_cast.filter(|_| self.linear_fc2.fp8.is_some()) {
            // fc2 in FP8: the activation rides in the cast of fc2's input instead (never written).
            let (h, s1) = self.linear_fc1.forward(cx, x)?;
            let (y, s2) = self.linear_fc2.forward_after(cx, act, &h)?;
            return Ok((y, Saved::new(vec![h], vec![s1, s2])));
        }
        let (a, h, s1) = match self.activation {
            // GeLU in fc1's GEMM epilogue (and its gradient in fc2's input-gradient GEMM) on a GPU.
            Activation::Gelu => self.linear_fc1.forward_gelu(cx, x)?,
            Activation::SwiGlu => {
                let (h, s1) = self.linear_fc1.forward(cx, x)?;
                (k::swiglu(&h)?, h, s1)
            }
            Activation::SquaredRelu => {
                let (h, s1) = self.linear_fc1.forward(cx, x)?;
                (k::relu2(&h)?, h, s1)
            }
            Activation::QuickGelu => {
                let (h, s1) = self.linear_fc1.forward(cx, x)?;
                (k::quick_gelu(&h)?, h, s1)
            }
            Activation::GeluExact => {
                let (h, s1) = self.linear_fc1.forward(cx, x)?;
                (k::gelu_exact(&h)?, h, s1)
            }
            Activation::QuickGeGlu(g) => {
                let (h, s1) = self.linear_fc1.forward(cx, x)?;
                (k::quick_geglu(&h, g.offset as f32, g.clamp.map(|c| c as f32))?, h, s1)
            }
        };
        let (y, s2) = self.linear_fc2.forward(cx, &a)?;
        Ok((y, Saved::new(vec![h], vec![s1, s2])))
    }

    fn backward(&self, cx: &Cx, saved: Saved, dy: &Tensor) -> Result<Tensor> {
        self.backward_parts(cx, saved, dy, true)
    }

    fn out_bias(&self) -> Option<ParamId> {
        self.linear_fc2.out_bias()
    }

    fn backward_without_out_bias(&self, cx: &Cx, saved: Saved, dy: &Tensor) -> Result<Tensor> {
        self.backward_parts(cx, saved, dy, false)
    }
}

impl Mlp {
    /// fc1's and fc2's products in FP8 (`fp8`) or not: each its own FP8 layer.
    pub fn set_fp8(&mut self, fp8: Option<&ferrotron_core::Fp8Recipe>) {
        self.linear_fc1.fp8 = fp8.map(|r| r.linear(self.linear_fc1.weight));
        self.linear_fc2.fp8 = fp8.map(|r| r.linear(self.linear_fc2.weight));
    }

    /// The backward, with fc2's bias gradient or without it (`out_bias`).
    fn backward_parts(&self, cx: &Cx, saved: Saved, dy: &Tensor, fc2_bias: bool) -> Result<Tensor> {
        let Saved { tensors, children } = saved;
        let [s1, s2]: [Saved; 2] = children
            .try_into()
            .map_err(|_| ferrotron_core::invalid("Mlp::backward", "saved values do not match forward"))?;
        let h = tensors.first().ok_or_else(|| ferrotron_core::invalid("Mlp::backward", "nothing saved by forward"))?;
        if self.activation == Activation::Gelu && self.linear_fc1.fp8.is_some() && self.linear_fc2.input_is_parallel {
            // fc1 in FP8: the GeLU backward (and fc1's bias gradient) ride in the cast of its
            // output gradient instead.
            let da = self.linear_fc2.backward_parts(cx, s2, dy, None, fc2_bias)?;
            return self.linear_fc1.backward_after_gelu(cx, s1, &da, h);
        }
        let dh = match self.activation {
            Activation::Gelu => self.linear_fc2.backward_parts(cx, s2, dy, Some(h), fc2_bias)?,
            Activation::SwiGlu => k::swiglu_bwd(h, &self.linear_fc2.backward_parts(cx, s2, dy, None, fc2_bias)?)?,
            Activation::SquaredRelu => k::relu2_bwd(h, &self.linear_fc2.backward_parts(cx, s2, dy, None, fc2_bias)?)?,
            Activation::QuickGelu => {
                k::quick_gelu_bwd(h, &self.linear_fc2.backward_parts(cx, s2, dy, None, fc2_bias)?)?
            }
            Activation::GeluExact => {
                k::gelu_exact_bwd(h, &self.linear_fc2.backward_parts(cx, s2, dy, None, fc2_bias)?)?
            }
            Activation::QuickGeGlu(g) => {
                let da = self.linear_fc2.backward_parts(cx, s2, dy, None, fc2_bias)?;
                k::quick_geglu_bwd(h, &da, g.offset as f32, g.clamp.map(|c| c as f32))?
            }
        };
        self.linear_fc1.backward(cx, s1, &dh)
    }
}
