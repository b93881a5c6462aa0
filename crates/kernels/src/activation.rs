//! GeLU (tanh, and exact by erf), quick GeLU (CLIP's), SiLU, squared ReLU, SwiGLU, the sigmoid
//! output gate and softmax, forward and backward, in the input's dtype.

use crate::{buf, check, cpu};
use ferrotron_core::{Result, Tensor, shape_mismatch};

fn unary(op: &'static str, x: &Tensor, f: fn(&[f32], &mut [f32])) -> Result<Tensor> {
    check::float(op, x)?;
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(op, &[x])? {
        return crate::cuda::ops::pointwise(&g, op, x, None);
    }
    check::on_cpu(op, &[x])?;
    let xv = x.read_f32()?;
    // SAFETY: the activations write every element (elementwise maps).
    let mut y = unsafe { buf::uninit(xv.len()) };
    f(&xv, &mut y);
    check::out(y, x.shape().clone(), x.dtype(), x.device())
}

fn unary_bwd(op: &'static str, x: &Tensor, dy: &Tensor, f: fn(&[f32], &[f32], &mut [f32])) -> Result<Tensor> {
    check::float(op, x)?;
    check::shape(op, dy, x.dims())?;
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(op, &[x, dy])? {
        return crate::cuda::ops::pointwise(&g, op.trim_end_matches("_bwd"), x, Some(dy));
    }
    check::on_cpu(op, &[x, dy])?;
    let (xv, dyv) = (x.read_f32()?, dy.read_f32()?);
    // SAFETY: as `unary`.
    let mut dx = unsafe { buf::uninit(xv.len()) };
    f(&xv, &dyv, &mut dx);
    check::out(dx, x.shape().clone(), dy.dtype(), x.device())
}

pub fn gelu(x: &Tensor) -> Result<Tensor> {
    unary("gelu", x, cpu::activation::gelu_fwd)
}
pub fn gelu_bwd(x: &Tensor, dy: &Tensor) -> Result<Tensor> {
    unary_bwd("gelu_bwd", x, dy, cpu::activation::gelu_bwd)
}
/// max(x, 0)².
pub fn relu2(x: &Tensor) -> Result<Tensor> {
    unary("relu2", x, cpu::activation::relu2_fwd)
}
pub fn relu2_bwd(x: &Tensor, dy: &Tensor) -> Result<Tensor> {
    unary_bwd("relu2_bwd", x, dy, cpu::activation::relu2_bwd)
}
/// Exact (erf) GeLU, x·Φ(x): PyTorch's `F.gelu`, LLaVA's projection.
pub fn gelu_exact(x: &Tensor) -> Result<Tensor> {
    unary("gelu_exact", x, cpu::activation::gelu_exact_fwd)
}
pub fn gelu_exact_bwd(x: &Tensor, dy: &Tensor) -> Result<Tensor> {
    unary_bwd("gelu_exact_bwd", x, dy, cpu::activation::gelu_exact_bwd)
}
/// x·σ(1.702·x): CLIP's vision MLPs.
pub fn quick_gelu(x: &Tensor) -> Result<Tensor> {
    unary("quick_gelu", x, cpu::activation::quick_gelu_fwd)
}
pub fn quick_gelu_bwd(x: &Tensor, dy: &Tensor) -> Result<Tensor> {
    unary_bwd("quick_gelu_bwd", x, dy, cpu::activation::quick_gelu_bwd)
}
pub fn silu(x: &Tensor) -> Result<Tensor> {
    unary("silu", x, cpu::activation::silu_fwd)
}
pub fn silu_bwd(x: &Tensor, dy: &Tensor) -> Result<Tensor> {
    unary_bwd("silu_bwd", x, dy, cpu::activation::silu_bwd)
}

/// x·σ(g), elementwise (attention's output gate, Megatron's --attention-output-gate), in x's dtype.
pub fn sigmoid_gate(x: &Tensor, g: &Tensor) -> Result<Tensor> {
    const OP: &str = "sigmoid_gate";
    check::float(OP, x)?;
    check::shape(OP, g, x.dims())?;
    check::dtype(OP, g, x.dtype())?;
    #[cfg(feature = "cuda")]
    if let Some(gpu) = crate::cuda::gpu(OP, &[x, g])? {
        return crate::cuda::ops::sigmoid_gate(&gpu, x, g);
    }
    check::on_cpu(OP, &[x, g])?;
    let (xv, gv) = (x.read_f32()?, g.read_f32()?);
    // SAFETY: the gate writes every element.
    let mut y = unsafe { buf::uninit(xv.len()) };
    cpu::activation::sigmoid_gate_fwd(&xv, &gv, &mut y);
    check::out(y, x.shape().clone(), x.dtype(), x.device())
}

/// [`sigmoid_gate`]'s backward: (dx, dg) from dy, in dy's dtype.
pub fn sigmoid_gate_bwd(x: &Tensor, g: &Tensor, dy: &Tensor) -> Result<(Tensor, Tensor)> {
    const OP: &str = "sigmoid_gate_bwd";
    check::float(OP, x)?;
    for t in [g, dy] {
        check::shape(OP, t, x.dims())?;
        check::dtype(OP, t, x.dtype())?;
    }
    #[cfg(feature = "cuda")]
    if let Some(gpu) = crate::cuda::gpu(OP, &[x, g, dy])? {
        return crate::cuda::ops::sigmoid_gate_bwd(&gpu, x, g, dy);
    }
    check::on_cpu(OP, &[x, g, dy])?;
    let (xv, gv, dyv) = (x.read_f32()?, g.read_f32()?, dy.read_f32()?);
    // SAFETY: the backward writes every element of both.
    let (mut dx, mut dg) = unsafe { (buf::uninit(xv.len()), buf::uninit(xv.len())) };
    cpu::activation::sigmoid_gate_bwd(&xv, &gv, &dyv, &mut dx, &mut dg);
    Ok((
        check::out(dx, x.shape().clone(), dy.dtype(), x.device())?,
        check::out(dg, x.shape().clone(), dy.dtype(), x.device())?,
    ))
}

fn swiglu_width(op: &'static str, x: &Tensor) -> Result<usize> {
    let c = x.shape().last();
    if x.shape().rank() == 0 || c % 2 != 0 {
        return Err(shape_mismatch(op, "last dim even (gate and value halves)", x.dims()));
    }
    Ok(c / 2)
}

/// x [..., 2F] (gate | value) → silu(gate)·value [..., F].
pub fn swiglu(x: &Tensor) -> Result<Tensor> {
    const OP: &str = "swiglu";
    check::float(OP, x)?;
    let f = swiglu_width(OP, x)?;
    let mut shape = x.dims().to_vec();
    *shape.last_mut().unwrap_or(&mut 0) = f;
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[x])? {
        return crate::cuda::ops::swiglu(&g, x, f, shape);
    }
    check::on_cpu(OP, &[x])?;
    let xv = x.read_f32()?;
    // SAFETY: swiglu_fwd writes each of a row's f outputs.
    let mut y = unsafe { buf::uninit(xv.len() / 2) };
    cpu::activation::swiglu_fwd(&xv, f, &mut y);
    check::out(y, shape, x.dtype(), x.device())
}

pub fn swiglu_bwd(x: &Tensor, dy: &Tensor) -> Result<Tensor> {
    const OP: &str = "swiglu_bwd";
    check::float(OP, x)?;
    let f = swiglu_width(OP, x)?;
    let mut yshape = x.dims().to_vec();
    *yshape.last_mut().unwrap_or(&mut 0) = f;
    check::shape(OP, dy, &yshape)?;
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[x, dy])? {
        return crate::cuda::ops::swiglu_bwd(&g, x, dy, f);
    }
    check::on_cpu(OP, &[x, dy])?;
    let (xv, dyv) = (x.read_f32()?, dy.read_f32()?);
    // SAFETY: swiglu_bwd writes both halves of every row.
    let mut dx = unsafe { buf::uninit(xv.len()) };
    cpu::activation::swiglu_bwd(&xv, &dyv, f, &mut dx);
    check::out(dx, x.shape().clone(), dy.dtype(), x.device())
}

/// gpt-oss's gated quick GeLU (Megatron's --quick-geglu): x [..., 2F] (gate | linear) →
/// qgelu(min(gate, c))·(clamp(linear, −c, c) + `offset`) [..., F], qgelu(z) = z·σ(1.702·z); `clamp`
/// c (--activation-func-clamp-value) None for none.
pub fn quick_geglu(x: &Tensor, offset: f32, clamp: Option<f32>) -> Result<Tensor> {
    const OP: &str = "quick_geglu";
    check::float(OP, x)?;
    let f = swiglu_width(OP, x)?;
    let c = clamp.unwrap_or(f32::INFINITY);
    let mut shape = x.dims().to_vec();
    *shape.last_mut().unwrap_or(&mut 0) = f;
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[x])? {
        return crate::cuda::ops::quick_geglu(&g, x, f, offset, c, shape);
    }
    check::on_cpu(OP, &[x])?;
    let xv = x.read_f32()?;
    // SAFETY: quick_geglu_fwd writes each of a row's f outputs.
    let mut y = unsafe { buf::uninit(xv.len() / 2) };
    cpu::activation::quick_geglu_fwd(&xv, f, offset, c, &mut y);
    check::out(y, shape, x.dtype(), x.device())
}

/// `quick_geglu`'s input gradient: dy [..., F] → dx [..., 2F], zero where the clamp held an input.
pub fn quick_geglu_bwd(x: &Tensor, dy: &Tensor, offset: f32, clamp: Option<f32>) -> Result<Tensor> {
    const OP: &str = "quick_geglu_bwd";
    check::float(OP, x)?;
    let f = swiglu_width(OP, x)?;
    let c = clamp.unwrap_or(f32::INFINITY);
    let mut yshape = x.dims().to_vec();
    *yshape.last_mut().unwrap_or(&mut 0) = f;
    check::shape(OP, dy, &yshape)?;
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[x, dy])? {
        return crate::cuda::ops::quick_geglu_bwd(&g, x, dy, f, offset, c);
    }
    check::on_cpu(OP, &[x, dy])?;
    let (xv, dyv) = (x.read_f32()?, dy.read_f32()?);
    // SAFETY: quick_geglu_bwd writes both halves of every row.
    let mut dx = unsafe { buf::uninit(xv.len()) };
    cpu::activation::quick_geglu_bwd(&xv, &dyv, f, offset, c, &mut dx);
    check::out(dx, x.shape().clone(), dy.dtype(), x.device())
}

/// Softmax over the last dimension.
pub fn softmax(x: &Tensor) -> Result<Tensor> {
    const OP: &str = "softmax";
    check::float(OP, x)?;
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[x])? {
        return crate::cuda::ops::softmax(&g, x);
    }

    check::on_cpu(OP, &[x])?;
    let xv = x.read_f32()?;
    let mut y = vec![0f32; xv.len()];
    cpu::softmax::softmax_fwd(&xv, x.shape().last(), &mut y);
    check::out(y, x.shape().clone(), x.dtype(), x.device())
}

/// dx from the softmax output y and dy.
pub fn softmax_bwd(y: &Tensor, dy: &Tensor) -> Result<Tensor> {
    const OP: &str = "softmax_bwd";
    check::float(OP, y)?;
    check::shape(OP, dy, y.dims())?;
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[y, dy])? {
        return crate::cuda::ops::softmax_bwd(&g, y, dy);
    }
    check::on_cpu(OP, &[y, dy])?;
    let (yv, dyv) = (y.read_f32()?, dy.read_f32()?);
    let mut dx = vec![0f32; yv.len()];
    cpu::softmax::softmax_bwd(&yv, &dyv, y.shape().last(), &mut dx);
    check::out(dx, y.shape().clone(), dy.dtype(), y.device())
}
