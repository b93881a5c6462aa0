//! LayerNorm / RMSNorm over the last dimension (see `cpu::norm` for the math). Statistics (mean,
//! rstd [rows]) and weight gradients are f32 whatever the activation dtype. A norm's scale is a
//! `Gamma`: its weight, or one plus it (zero-centred weights).

use crate::{buf, check, cpu};
use ferrotron_core::{DType, F32Read, Result, Tensor};

/// A norm's scale: the weight `w`, or `1 + w` with `one_plus` (zero-centred weights, initialised
/// to 0: Megatron's --apply-layernorm-1p, Gemma's and Nemotron's norms). The 1 is added in f32
/// inside the kernels: (1 + w) stored in bf16 keeps 8 bits of the offset from 1, what the
/// zero-centring exists to keep. The weight's gradient is the same either way.
#[derive(Clone, Copy, Debug)]
pub struct Gamma<'a> {
    pub w: &'a Tensor,
    pub one_plus: bool,
}

impl<'a> Gamma<'a> {
    /// `1 + w`.
    pub fn one_plus(w: &'a Tensor) -> Self {
        Gamma { w, one_plus: true }
    }

    /// What the kernels add to each weight.
    pub(crate) fn shift(&self) -> f32 {
        if self.one_plus { 1.0 } else { 0.0 }
    }

    /// The scale as f32 values (the CPU's kernels take it whole).
    fn read(&self) -> Result<F32Read<'a>> {
        let v = self.w.read_f32()?;
        Ok(if self.one_plus { F32Read::Owned(v.iter().map(|x| x + self.shift()).collect()) } else { v })
    }
}

impl<'a> From<&'a Tensor> for Gamma<'a> {
    fn from(w: &'a Tensor) -> Self {
        Gamma { w, one_plus: false }
    }
}

fn norm_checks(op: &'static str, x: &Tensor, w: &Tensor) -> Result<usize> {
    check::float(op, x)?;
    check::rank(op, w, 1)?;
    let c = x.shape().last();
    check::shape(op, w, &[c])?;
    Ok(c)
}

/// `norm_checks` plus the bias's shape.
fn ln_checks(op: &'static str, x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<usize> {
    let c = norm_checks(op, x, w)?;
    if let Some(b) = b {
        check::shape(op, b, &[c])?;
    }
    Ok(c)
}

/// Returns (y, mean, rstd).
pub fn layernorm_fwd<'a>(
    x: &Tensor,
    w: impl Into<Gamma<'a>>,
    b: Option<&Tensor>,
    eps: f64,
) -> Result<(Tensor, Tensor, Tensor)> {
    let w = w.into();
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu("layernorm_fwd", &[x, w.w])? {
        ln_checks("layernorm_fwd", x, w.w, b)?;
        let (y, m, r, _) = crate::cuda::ops::layernorm_fwd(&g, x, None, w, b, eps)?;
        return Ok((y, m, r));
    }
    layernorm_fwd_cpu(x, w, b, eps)
}

/// The residual add of a pre-norm layer with the norm after it: returns (x + x2, y, mean, rstd)
/// with y the LayerNorm of the sum (one kernel on a GPU; the sum is rounded to the activation
/// dtype before it is normalised, as two separate ops would).
pub fn add_layernorm_fwd<'a>(
    x: &Tensor,
    x2: &Tensor,
    w: impl Into<Gamma<'a>>,
    b: Option<&Tensor>,
    eps: f64,
) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
    const OP: &str = "add_layernorm_fwd";
    let w = w.into();
    ln_checks(OP, x, w.w, b)?;
    check::shape(OP, x2, x.dims())?;
    check::same_dtype(OP, x, x2)?;
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[x, x2, w.w])? {
        let (y, m, r, sum) = crate::cuda::ops::layernorm_fwd(&g, x, Some(x2), w, b, eps)?;
        return Ok((sum.ok_or_else(|| ferrotron_core::invalid(OP, "no sum from the fused kernel"))?, y, m, r));
    }
    let sum = crate::add(x, x2)?;
    let (y, m, r) = layernorm_fwd_cpu(&sum, w, b, eps)?;
    Ok((sum, y, m, r))
}

fn layernorm_fwd_cpu(x: &Tensor, w: Gamma, b: Option<&Tensor>, eps: f64) -> Result<(Tensor, Tensor, Tensor)> {
    const OP: &str = "layernorm_fwd";
    let c = ln_checks(OP, x, w.w, b)?;
    let mut all = vec![x, w.w];
    all.extend(b);
    check::on_cpu(OP, &all)?;
    let rows = x.shape().rows();
    let (xv, wv) = (x.read_f32()?, w.read()?);
    let bv = b.map(|b| b.read_f32()).transpose()?;
    // SAFETY: layernorm_fwd writes every row of y and its mean and rstd.
    let (mut y, mut mean, mut rstd) = unsafe { (buf::uninit(rows * c), buf::uninit(rows), buf::uninit(rows)) };
    cpu::norm::layernorm_fwd(&xv, &wv, bv.as_deref(), eps, c, &mut y, &mut mean, &mut rstd);
    Ok((
        check::out(y, x.shape().clone(), x.dtype(), x.device())?,
        check::out(mean, [rows], DType::F32, x.device())?,
        check::out(rstd, [rows], DType::F32, x.device())?,
    ))
}

/// Returns (dx, dweight, dbias); dweight and dbias are f32.
pub fn layernorm_bwd<'a>(
    dy: &Tensor,
    x: &Tensor,
    w: impl Into<Gamma<'a>>,
    mean: &Tensor,
    rstd: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    layernorm_bwd_res(dy, x, w.into(), mean, rstd, None, None, None, true)
}

/// `layernorm_bwd` with the residual stream's gradient added to dx: (dx + res, dweight, dbias)
/// (one kernel on a GPU).
pub fn layernorm_bwd_add<'a>(
    dy: &Tensor,
    x: &Tensor,
    w: impl Into<Gamma<'a>>,
    mean: &Tensor,
    rstd: &Tensor,
    res: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    layernorm_bwd_res(dy, x, w.into(), mean, rstd, Some(res), None, None, true)
}

/// `layernorm_bwd` (with `res` as `layernorm_bwd_add`) whose parameter gradients are added into
/// `dw` and `db` [C] (main_grad views; on a GPU, f32 or bf16 ones take the sums directly, with no add pass
/// after); returns dx (+ res).
pub fn layernorm_bwd_into<'a>(
    dy: &Tensor,
    x: &Tensor,
    w: impl Into<Gamma<'a>>,
    mean: &Tensor,
    rstd: &Tensor,
    res: Option<&Tensor>,
    dw: &Tensor,
    db: &Tensor,
    acc: bool,
) -> Result<Tensor> {
    layernorm_bwd_res(dy, x, w.into(), mean, rstd, res, Some([dw, db]), None, acc).map(|(dx, _, _)| dx)
}

/// `layernorm_bwd_into` with Σ rows of `res` added into `dres` [C] as well (stored, without
/// `acc`): the bias gradient of the linear layer whose output gradient is the residual stream's
/// (fc2's before the MLP's norm, the attention projection's before the input norm). On a GPU the
/// norm's kernel sums it from its own reads of `res`, so no separate pass reads them again.
pub fn layernorm_bwd_into_bias<'a>(
    dy: &Tensor,
    x: &Tensor,
    w: impl Into<Gamma<'a>>,
    mean: &Tensor,
    rstd: &Tensor,
    res: &Tensor,
    dw: &Tensor,
    db: &Tensor,
    dres: &Tensor,
    acc: bool,
) -> Result<Tensor> {
    layernorm_bwd_res(dy, x, w.into(), mean, rstd, Some(res), Some([dw, db]), Some(dres), acc).map(|(dx, _, _)| dx)
}

/// Σ rows of `res` into `dres` (as `acc`) where a norm's kernel did not already: the CPU's and
/// the fallback's part of the `_into_bias` backwards.
fn res_sum_into(op: &'static str, res: Option<&Tensor>, dres: Option<&Tensor>, acc: bool) -> Result<()> {
    match (res, dres) {
        (Some(r), Some(d)) => crate::bias_grad_into(d, r, acc),
        (None, Some(_)) => Err(ferrotron_core::invalid(op, "a residual bias gradient asked for without a residual")),
        _ => Ok(()),
    }
}

/// The parameter-gradient destinations of an `_into` backward: [C], float, apart from `inputs`.
fn check_into(op: &'static str, c: usize, into: &[&Tensor], inputs: &[&Tensor]) -> Result<()> {
    for d in into {
        check::float(op, d)?;
        check::shape(op, d, &[c])?;
        if inputs.iter().any(|t| t.shares_storage(d)) {
            return Err(ferrotron_core::invalid(op, "a gradient destination shares storage with an input"));
        }
    }
    Ok(())
}

/// Adds (`acc`) or copies each of `sums` into its destination in `into`, unless the kernel
/// already summed into it (then the sum is the destination itself).
fn add_into(into: Option<&[&Tensor]>, sums: &[&Tensor], acc: bool) -> Result<()> {
    for (d, s) in into.unwrap_or(&[]).iter().zip(sums) {
        if !d.shares_storage(s) {
            if acc { crate::add_(d, s)? } else { crate::copy_(d, s)? }
        }
    }
    Ok(())
}

/// How a CUDA backward sums a parameter gradient: straight into an f32 or bf16 destination (the
/// main_grad dtypes), else into a new tensor (`add_into` adds it after).
#[cfg(feature = "cuda")]
fn sum_to(d: Option<&Tensor>, acc: bool) -> crate::cuda::ops::SumTo<'_> {
    match d {
        Some(d) if sums_into(d) && acc => crate::cuda::ops::SumTo::Add(d),
        Some(d) if sums_into(d) => crate::cuda::ops::SumTo::Write(d),
        _ => crate::cuda::ops::SumTo::New,
    }
}

/// Whether the CUDA column sums can finish straight into `d`.
#[cfg(feature = "cuda")]
fn sums_into(d: &Tensor) -> bool {
    matches!(d.dtype(), DType::F32 | DType::BF16)
}

fn layernorm_bwd_res(
    dy: &Tensor,
    x: &Tensor,
    w: Gamma,
    mean: &Tensor,
    rstd: &Tensor,
    res: Option<&Tensor>,
    into: Option<[&Tensor; 2]>,
    dres: Option<&Tensor>,
    acc: bool,
) -> Result<(Tensor, Tensor, Tensor)> {
    const OP: &str = "layernorm_bwd";
    let (g, w) = (w, w.w);
    if let Some(res) = res {
        check::shape(OP, res, x.dims())?;
        check::same_dtype(OP, x, res)?;
    }
    let c = norm_checks(OP, x, w)?;
    check::shape(OP, dy, x.dims())?;
    let rows = x.shape().rows();
    check::shape(OP, mean, &[rows])?;
    check::shape(OP, rstd, &[rows])?;
    if let Some(d) = &into {
        check_into(OP, c, d, &[dy, x, w, mean, rstd])?;
    }
    if let (Some(d), Some(r)) = (dres, res) {
        check_into(OP, c, &[d], &[dy, x, w, mean, rstd, r])?;
    }
    #[cfg(feature = "cuda")]
    if let Some(be) = crate::cuda::gpu(OP, &[dy, x, w, mean, rstd])? {
        let to = [sum_to(into.map(|d| d[0]), acc), sum_to(into.map(|d| d[1]), acc)];
        let res_to = dres.filter(|d| sums_into(d)).map(|d| sum_to(Some(d), acc));
        let (dx, dw, db, _) = crate::cuda::ops::layernorm_bwd(&be, dy, x, g, mean, rstd, res, to, res_to)?;
        add_into(into.as_ref().map(|d| &d[..]), &[&dw, &db], acc)?;
        if res_to.is_none() {
            res_sum_into(OP, res, dres, acc)?;
        }
        return Ok((dx, dw, db));
    }
    check::on_cpu(OP, &[dy, x, w, mean, rstd])?;
    res_sum_into(OP, res, dres, acc)?;
    let (dyv, xv, wv, mv, rv) = (dy.read_f32()?, x.read_f32()?, g.read()?, mean.read_f32()?, rstd.read_f32()?);
    // SAFETY: layernorm_bwd writes (not adds) every row of dx.
    let mut dx = unsafe { buf::uninit(rows * c) };
    let (dw, db) = cpu::norm::layernorm_bwd(&dyv, &xv, &wv, &mv, &rv, c, &mut dx);
    let dx = check::out(dx, x.shape().clone(), x.dtype(), x.device())?;
    let (dw, db) = (check::out(dw, [c], DType::F32, x.device())?, check::out(db, [c], DType::F32, x.device())?);
    add_into(into.as_ref().map(|d| &d[..]), &[&dw, &db], acc)?;
    Ok((res.map_or(Ok(dx.clone()), |r| crate::add(&dx, r))?, dw, db))
}

/// Returns (y, rstd).
pub fn rmsnorm_fwd<'a>(x: &Tensor, w: impl Into<Gamma<'a>>, eps: f64) -> Result<(Tensor, Tensor)> {
    let w = w.into();
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu("rmsnorm_fwd", &[x, w.w])? {
        norm_checks("rmsnorm_fwd", x, w.w)?;
        let (y, r, _) = crate::cuda::ops::rmsnorm_fwd(&g, x, None, w, eps)?;
        return Ok((y, r));
    }
    rmsnorm_fwd_cpu(x, w, eps)
}

/// `add_layernorm_fwd` for RMSNorm: returns (x + x2, y, rstd).
pub fn add_rmsnorm_fwd<'a>(
    x: &Tensor,
    x2: &Tensor,
    w: impl Into<Gamma<'a>>,
    eps: f64,
) -> Result<(Tensor, Tensor, Tensor)> {
    const OP: &str = "add_rmsnorm_fwd";
    let w = w.into();
    norm_checks(OP, x, w.w)?;
    check::shape(OP, x2, x.dims())?;
    check::same_dtype(OP, x, x2)?;
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[x, x2, w.w])? {
        let (y, r, sum) = crate::cuda::ops::rmsnorm_fwd(&g, x, Some(x2), w, eps)?;
        return Ok((sum.ok_or_else(|| ferrotron_core::invalid(OP, "no sum from the fused kernel"))?, y, r));
    }
    let sum = crate::add(x, x2)?;
    let (y, r) = rmsnorm_fwd_cpu(&sum, w, eps)?;
    Ok((sum, y, r))
}

fn rmsnorm_fwd_cpu(x: &Tensor, w: Gamma, eps: f64) -> Result<(Tensor, Tensor)> {
    const OP: &str = "rmsnorm_fwd";
    let c = norm_checks(OP, x, w.w)?;
    check::on_cpu(OP, &[x, w.w])?;
    let rows = x.shape().rows();
    let (xv, wv) = (x.read_f32()?, w.read()?);
    // SAFETY: rmsnorm_fwd writes every row of y and its rstd.
    let (mut y, mut rstd) = unsafe { (buf::uninit(rows * c), buf::uninit(rows)) };
    cpu::norm::rmsnorm_fwd(&xv, &wv, eps, c, &mut y, &mut rstd);
    Ok((check::out(y, x.shape().clone(), x.dtype(), x.device())?, check::out(rstd, [rows], DType::F32, x.device())?))
}

/// Returns (dx, dweight); dweight is f32.
pub fn rmsnorm_bwd<'a>(dy: &Tensor, x: &Tensor, w: impl Into<Gamma<'a>>, rstd: &Tensor) -> Result<(Tensor, Tensor)> {
    rmsnorm_bwd_res(dy, x, w.into(), rstd, None, None, None, true)
}

/// `rmsnorm_bwd` with the residual stream's gradient added to dx: (dx + res, dweight).
pub fn rmsnorm_bwd_add<'a>(
    dy: &Tensor,
    x: &Tensor,
    w: impl Into<Gamma<'a>>,
    rstd: &Tensor,
    res: &Tensor,
) -> Result<(Tensor, Tensor)> {
    rmsnorm_bwd_res(dy, x, w.into(), rstd, Some(res), None, None, true)
}

/// `rmsnorm_bwd` (with `res` as `rmsnorm_bwd_add`) whose weight gradient is added into `dw` [C]
/// (as `layernorm_bwd_into`); returns dx (+ res).
pub fn rmsnorm_bwd_into<'a>(
    dy: &Tensor,
    x: &Tensor,
    w: impl Into<Gamma<'a>>,
    rstd: &Tensor,
    res: Option<&Tensor>,
    dw: &Tensor,
    acc: bool,
) -> Result<Tensor> {
    rmsnorm_bwd_res(dy, x, w.into(), rstd, res, Some(dw), None, acc).map(|(dx, _)| dx)
}

/// `rmsnorm_bwd_into` with Σ rows of `res` into `dres`, as `layernorm_bwd_into_bias`.
pub fn rmsnorm_bwd_into_bias<'a>(
    dy: &Tensor,
    x: &Tensor,
    w: impl Into<Gamma<'a>>,
    rstd: &Tensor,
    res: &Tensor,
    dw: &Tensor,
    dres: &Tensor,
    acc: bool,
) -> Result<Tensor> {
    rmsnorm_bwd_res(dy, x, w.into(), rstd, Some(res), Some(dw), Some(dres), acc).map(|(dx, _)| dx)
}

fn rmsnorm_bwd_res(
    dy: &Tensor,
    x: &Tensor,
    w: Gamma,
    rstd: &Tensor,
    res: Option<&Tensor>,
    into: Option<&Tensor>,
    dres: Option<&Tensor>,
    acc: bool,
) -> Result<(Tensor, Tensor)> {
    const OP: &str = "rmsnorm_bwd";
    let (g, w) = (w, w.w);
    if let Some(res) = res {
        check::shape(OP, res, x.dims())?;
        check::same_dtype(OP, x, res)?;
    }
    let c = norm_checks(OP, x, w)?;
    check::shape(OP, dy, x.dims())?;
    let rows = x.shape().rows();
    check::shape(OP, rstd, &[rows])?;
    if let Some(d) = into {
        check_into(OP, c, &[d], &[dy, x, w, rstd])?;
    }
    if let (Some(d), Some(r)) = (dres, res) {
        check_into(OP, c, &[d], &[dy, x, w, rstd, r])?;
    }
    #[cfg(feature = "cuda")]
    if let Some(be) = crate::cuda::gpu(OP, &[dy, x, w, rstd])? {
        let res_to = dres.filter(|d| sums_into(d)).map(|d| sum_to(Some(d), acc));
        let (dx, dw, _) = crate::cuda::ops::rmsnorm_bwd(&be, dy, x, g, rstd, res, sum_to(into, acc), res_to)?;
        add_into(into.as_ref().map(std::slice::from_ref), &[&dw], acc)?;
        if res_to.is_none() {
            res_sum_into(OP, res, dres, acc)?;
        }
        return Ok((dx, dw));
    }
    check::on_cpu(OP, &[dy, x, w, rstd])?;
    res_sum_into(OP, res, dres, acc)?;
    let (dyv, xv, wv, rv) = (dy.read_f32()?, x.read_f32()?, g.read()?, rstd.read_f32()?);
    // SAFETY: rmsnorm_bwd writes (not adds) every row of dx.
    let mut dx = unsafe { buf::uninit(rows * c) };
    let dw = cpu::norm::rmsnorm_bwd(&dyv, &xv, &wv, &rv, c, &mut dx);
    let dx = check::out(dx, x.shape().clone(), x.dtype(), x.device())?;
    let dw = check::out(dw, [c], DType::F32, x.device())?;
    add_into(into.as_ref().map(std::slice::from_ref), &[&dw], acc)?;
    Ok((res.map_or(Ok(dx.clone()), |r| crate::add(&dx, r))?, dw))
}
