//! Elementwise ops: add (residual stream), in-place accumulate, bias add and its gradient, scale and
//! cast between dtypes.

use crate::{check, cpu};
use ferrotron_core::{DType, Result, Tensor, invalid};
use rayon::prelude::*;

/// a + b, same shape and dtype.
pub fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    const OP: &str = "add";
    check::float(OP, a)?;
    check::same_dtype(OP, a, b)?;
    check::shape(OP, b, a.dims())?;
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[a, b])? {
        return crate::cuda::ops::add(&g, a, b);
    }
    check::on_cpu(OP, &[a, b])?;
    let (av, bv) = (a.read_f32()?, b.read_f32()?);
    let y: Vec<f32> = av.par_iter().zip(bv.par_iter()).map(|(x, y)| x + y).collect();
    check::out(y, a.shape().clone(), a.dtype(), a.device())
}

/// Checks shared by the in-place two-tensor ops: both float, same shape, distinct storage.
fn dst_src(op: &'static str, dst: &Tensor, src: &Tensor) -> Result<()> {
    check::float(op, dst)?;
    check::float(op, src)?;
    check::shape(op, src, dst.dims())?;
    if dst.shares_storage(src) {
        return Err(invalid(op, "dst and src must not share storage"));
    }
    Ok(())
}

/// dst += src (same element count; dst may be wider, e.g. an f32 main_grad view).
pub fn add_(dst: &Tensor, src: &Tensor) -> Result<()> {
    const OP: &str = "add_";
    dst_src(OP, dst, src)?;
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[dst, src])? {
        return crate::cuda::ops::acc(&g, dst, src);
    }
    check::on_cpu(OP, &[dst, src])?;
    let s = src.read_f32()?;
    dst.update_f32(OP, |d| d.par_iter_mut().zip(s.par_iter()).for_each(|(d, s)| *d += s))
}

/// x [..., C] + bias [C].
pub fn bias_add(x: &Tensor, bias: &Tensor) -> Result<Tensor> {
    const OP: &str = "bias_add";
    check::float(OP, x)?;
    let c = x.shape().last();
    check::shape(OP, bias, &[c])?;
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[x, bias])? {
        return crate::cuda::ops::bias_add(&g, x, bias);
    }
    check::on_cpu(OP, &[x, bias])?;
    let (xv, bv) = (x.read_f32()?, bias.read_f32()?);
    let mut y = xv.to_vec();
    y.par_chunks_mut(c.max(1)).for_each(|r| r.iter_mut().zip(bv.iter()).for_each(|(v, b)| *v += b));
    check::out(y, x.shape().clone(), x.dtype(), x.device())
}

/// Σ over rows of dy [..., C] → [C] f32: the bias gradient.
pub fn bias_grad(dy: &Tensor) -> Result<Tensor> {
    const OP: &str = "bias_grad";
    check::float(OP, dy)?;
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[dy])? {
        return crate::cuda::ops::bias_grad(&g, dy, crate::cuda::ops::SumTo::New);
    }
    check::on_cpu(OP, &[dy])?;
    let c = dy.shape().last();
    let v = dy.read_f32()?;
    let s = crate::real::par_row_sum::<f32>(dy.shape().rows(), c, |rows, acc| {
        for r in rows {
            for (a, g) in acc.iter_mut().zip(&v[r * c..(r + 1) * c]) {
                *a += g;
            }
        }
    });
    check::out(s, [c], DType::F32, dy.device())
}

/// dst [C] += Σ over rows of dy [..., C] (`acc`), or dst = Σ: the bias gradient into main_grad
/// (on a GPU an f32 or bf16 `dst` takes the column sums directly, with no add pass after).
pub fn bias_grad_into(dst: &Tensor, dy: &Tensor, acc: bool) -> Result<()> {
    const OP: &str = "bias_grad_into";
    check::float(OP, dst)?;
    check::shape(OP, dst, &[dy.shape().last()])?;
    if dst.shares_storage(dy) {
        return Err(invalid(OP, "dst and dy must not share storage"));
    }
    #[cfg(feature = "cuda")]
    if matches!(dst.dtype(), DType::F32 | DType::BF16)
        && let Some(g) = crate::cuda::gpu(OP, &[dst, dy])?
    {
        check::float(OP, dy)?;
        let to = if acc { crate::cuda::ops::SumTo::Add(dst) } else { crate::cuda::ops::SumTo::Write(dst) };
        return crate::cuda::ops::bias_grad(&g, dy, to).map(drop);
    }
    if acc { add_(dst, &bias_grad(dy)?) } else { crate::copy_(dst, &bias_grad(dy)?) }
}

/// x · s as a new tensor.
pub fn scale(x: &Tensor, s: f32) -> Result<Tensor> {
    const OP: &str = "scale";
    check::float(OP, x)?;
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[x])? {
        let y = crate::cuda::ops::new(&g, x.shape().clone(), x.dtype())?;
        crate::cuda::ops::scale(&g, x, &y, s)?;
        return Ok(y);
    }
    check::on_cpu(OP, &[x])?;
    let mut y = x.read_f32()?.to_vec();
    cpu::optim::scale(&mut y, s);
    check::out(y, x.shape().clone(), x.dtype(), x.device())
}

/// x ← x · s in place.
pub fn scale_(x: &Tensor, s: f32) -> Result<()> {
    const OP: &str = "scale_";
    check::float(OP, x)?;
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[x])? {
        return crate::cuda::ops::scale(&g, x, x, s);
    }
    check::on_cpu(OP, &[x])?;
    x.update_f32("scale_", |v| cpu::optim::scale(v, s))
}

/// dst ← src, converting to dst's dtype (same element count; e.g. fp32 master weights into bf16
/// parameters).
pub fn copy_(dst: &Tensor, src: &Tensor) -> Result<()> {
    const OP: &str = "copy_";
    dst_src(OP, dst, src)?;
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[dst, src])? {
        return crate::cuda::ops::cast_into(&g, src, dst);
    }
    check::on_cpu(OP, &[dst, src])?;
    let s = src.read_f32()?;
    dst.update_f32(OP, |d| d.copy_from_slice(&s))
}

/// A copy of x in `dtype` (round to nearest even when narrowing).
pub fn cast(x: &Tensor, dtype: DType) -> Result<Tensor> {
    const OP: &str = "cast";
    if x.dtype() == DType::U32 || dtype == DType::U32 {
        if x.dtype() == dtype {
            return x.deep_copy();
        }
        return Err(invalid("cast", format!("cannot cast {} to {dtype}: ids are not values", x.dtype())));
    }
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[x])? {
        return crate::cuda::ops::cast(&g, x, dtype);
    }
    check::on_cpu(OP, &[x])?;
    check::out(x.read_f32()?.to_vec(), x.shape().clone(), dtype, x.device())
}
