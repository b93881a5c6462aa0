//! LayerNorm / RMSNorm over the last dimension (see `cpu::norm` for the math). Statistics (mean,
//! rstd [rows]) and weight gradients are f32 whatever the activation dtype.

use crate::{check, cpu};
use ferrotron_core::{DType, Result, Tensor};

fn norm_checks(op: &'static str, x: &Tensor, w: &Tensor) -> Result<usize> {
    check::float(op, x)?;
    check::rank(op, w, 1)?;
    let c = x.shape().last();
    check::shape(op, w, &[c])?;
    Ok(c)
}

/// Returns (y, mean, rstd).
pub fn layernorm_fwd(x: &Tensor, w: &Tensor, b: Option<&Tensor>, eps: f64) -> Result<(Tensor, Tensor, Tensor)> {
    const OP: &str = "layernorm_fwd";
    let c = norm_checks(OP, x, w)?;
    let mut all = vec![x, w];
    if let Some(b) = b {
        check::shape(OP, b, &[c])?;
        all.push(b);
    }
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[x, w])? {
        return crate::cuda::ops::layernorm_fwd(&g, x, w, b, eps);
    }
    check::on_cpu(OP, &all)?;
    let rows = x.shape().rows();
    let (xv, wv) = (x.read_f32()?, w.read_f32()?);
    let bv = b.map(|b| b.read_f32()).transpose()?;
    let (mut y, mut mean, mut rstd) = (vec![0f32; rows * c], vec![0f32; rows], vec![0f32; rows]);
    cpu::norm::layernorm_fwd(&xv, &wv, bv.as_deref(), eps, c, &mut y, &mut mean, &mut rstd);
    Ok((
        check::out(y, x.shape().clone(), x.dtype(), x.device())?,
        check::out(mean, [rows], DType::F32, x.device())?,
        check::out(rstd, [rows], DType::F32, x.device())?,
    ))
}

/// Returns (dx, dweight, dbias); dweight and dbias are f32.
pub fn layernorm_bwd(
    dy: &Tensor,
    x: &Tensor,
    w: &Tensor,
    mean: &Tensor,
    rstd: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    const OP: &str = "layernorm_bwd";
    let c = norm_checks(OP, x, w)?;
    check::shape(OP, dy, x.dims())?;
    let rows = x.shape().rows();
    check::shape(OP, mean, &[rows])?;
    check::shape(OP, rstd, &[rows])?;
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[dy, x, w, mean, rstd])? {
        return crate::cuda::ops::layernorm_bwd(&g, dy, x, w, mean, rstd);
    }
    check::on_cpu(OP, &[dy, x, w, mean, rstd])?;
    let (dyv, xv, wv, mv, rv) = (dy.read_f32()?, x.read_f32()?, w.read_f32()?, mean.read_f32()?, rstd.read_f32()?);
    let mut dx = vec![0f32; rows * c];
    let (dw, db) = cpu::norm::layernorm_bwd(&dyv, &xv, &wv, &mv, &rv, c, &mut dx);
    Ok((
        check::out(dx, x.shape().clone(), x.dtype(), x.device())?,
        check::out(dw, [c], DType::F32, x.device())?,
        check::out(db, [c], DType::F32, x.device())?,
    ))
}

/// Returns (y, rstd).
pub fn rmsnorm_fwd(x: &Tensor, w: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    const OP: &str = "rmsnorm_fwd";
    let c = norm_checks(OP, x, w)?;
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[x, w])? {
        return crate::cuda::ops::rmsnorm_fwd(&g, x, w, eps);
    }
    check::on_cpu(OP, &[x, w])?;
    let rows = x.shape().rows();
    let (xv, wv) = (x.read_f32()?, w.read_f32()?);
    let (mut y, mut rstd) = (vec![0f32; rows * c], vec![0f32; rows]);
    cpu::norm::rmsnorm_fwd(&xv, &wv, eps, c, &mut y, &mut rstd);
    Ok((check::out(y, x.shape().clone(), x.dtype(), x.device())?, check::out(rstd, [rows], DType::F32, x.device())?))
}

/// Returns (dx, dweight); dweight is f32.
pub fn rmsnorm_bwd(dy: &Tensor, x: &Tensor, w: &Tensor, rstd: &Tensor) -> Result<(Tensor, Tensor)> {
    const OP: &str = "rmsnorm_bwd";
    let c = norm_checks(OP, x, w)?;
    check::shape(OP, dy, x.dims())?;
    let rows = x.shape().rows();
    check::shape(OP, rstd, &[rows])?;
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[dy, x, w, rstd])? {
        return crate::cuda::ops::rmsnorm_bwd(&g, dy, x, w, rstd);
    }
    check::on_cpu(OP, &[dy, x, w, rstd])?;
    let (dyv, xv, wv, rv) = (dy.read_f32()?, x.read_f32()?, w.read_f32()?, rstd.read_f32()?);
    let mut dx = vec![0f32; rows * c];
    let dw = cpu::norm::rmsnorm_bwd(&dyv, &xv, &wv, &rv, c, &mut dx);
    Ok((check::out(dx, x.shape().clone(), x.dtype(), x.device())?, check::out(dw, [c], DType::F32, x.device())?))
}
