//! LayerNorm / RMSNorm (with the fused residual adds) and softmax over rows.

use super::*;
use crate::Gamma;

/// Groups of eight a thread of the eight-wide row kernels holds, and their largest block
/// (`NORM_V`, `NORM_THREADS` in kernels/norm.cu).
const NORM_V: usize = 4;
const NORM_THREADS: usize = 512;

/// A row kernel with an eight-wide twin (the row held in registers, one 16-byte access per group):
/// the twin, with a block sized to the row, when `c` divides by 8, fits `NORM_V` groups per
/// thread of a `NORM_THREADS` block, and every pointer is 16-byte aligned; its one-group build
/// (`_v8n1`, a quarter of the registers) when one group per thread covers the row.
fn rows_launch8(be: &B, name: &str, rows: usize, c: usize, args: &[Arg]) -> Result<()> {
    if c % 8 == 0 && c <= 8 * NORM_V * NORM_THREADS && args_aligned16(args) {
        let threads = (c / 8).next_multiple_of(32).min(NORM_THREADS) as u32;
        let build = if c <= 8 * NORM_THREADS { "v8n1" } else { "v8" };
        be.launch(&format!("{name}_{build}"), rows as u32, threads, 0, args)
    } else {
        rows_launch(be, name, rows, args)
    }
}

/// The block of the backward with its parameter gradients' first pass fused (kernels/norm.cu
/// `norm_bwd_cols`, one block per COL_CHUNK rows): teams of c / 8 threads, whole warps
/// (c % 256 == 0), as many as fit 512 threads but at most 8 (named barriers 1–8), and the dynamic
/// shared memory (two row-sum slots per warp and team, or the teams' column sums at the end):
/// (threads, bytes). None where it does not apply or `cuda::set_norm_fused(false)` /
/// `FERROTRON_NORM_FUSED=0` keeps the two launches. (H200, 16k rows: blocks of 32 rows lost to
/// 64, their twice as many partials costing the column sums more than the blocks gained; 16 lost
/// more.)
/// `ln`: a LayerNorm (a bias's sums too); `res_sum`: the residual's column sums as well (held in
/// shared memory, also with one team).
fn bwd_cols_block(c: usize, ln: bool, res_sum: bool, args: &[Arg]) -> Option<(u32, u32)> {
    if c % 256 != 0 || c > 4096 || !args_aligned16(args) || !crate::cuda::norm_fused() {
        return None;
    }
    let team = c / 8;
    let teams = (512 / team).min(8);
    let sums = 1 + usize::from(ln) + usize::from(res_sum);
    // The v6 builds keep a LayerNorm's bias sums in the bias region during the rows, so it is
    // there with one team too.
    let floats = (2 * teams * (team / 32) * 2).max(if teams > 1 || res_sum || ln { teams * c * sums } else { 0 });
    Some(((teams * team) as u32, (floats * 4) as u32))
}

/// The residual gradient's column sums (a bias gradient, `res_to`): partials [chunks, c] for the
/// fused kernel's `pr` when it runs (`fused`), else summed by bias_grad's own pass here. Returns
/// the kernel's `pr` and the partials to finish.
fn res_partials(
    be: &B,
    fused: bool,
    res: Option<&Tensor>,
    res_to: &Option<SumTo>,
    chunks: usize,
    c: usize,
) -> Result<(Arg, Option<Tensor>, Option<Tensor>)> {
    let (Some(res), Some(to)) = (res, res_to) else { return Ok((NULL, None, None)) };
    if !fused {
        return Ok((NULL, None, Some(super::elementwise::bias_grad(be, res, *to)?)));
    }
    let pr = new(be, [chunks, c], DType::F32)?;
    Ok((ptr("norm", &pr)?, Some(pr), None))
}

/// The sum x + x2 of a fused residual add (written by the norm's forward kernel), or none.
fn residual_sum(be: &B, x: &Tensor, x2: Option<&Tensor>) -> Result<(Arg, Arg, Option<Tensor>)> {
    let Some(x2) = x2 else { return Ok((NULL, NULL, None)) };
    let sum = new(be, x.shape().clone(), x.dtype())?;
    Ok((ptr("norm", x2)?, ptr("norm", &sum)?, Some(sum)))
}

/// LayerNorm of x (or of x + x2, returned as the fourth value): (y, mean, rstd, sum).
pub fn layernorm_fwd(
    be: &B,
    x: &Tensor,
    x2: Option<&Tensor>,
    w: Gamma,
    b: Option<&Tensor>,
    eps: f64,
) -> Result<(Tensor, Tensor, Tensor, Option<Tensor>)> {
    let (rows, c) = (x.shape().rows(), x.shape().last());
    let y = new(be, x.shape().clone(), x.dtype())?;
    let (x2p, sump, sum) = residual_sum(be, x, x2)?;
    let (mean, rstd) = (new(be, [rows], DType::F32)?, new(be, [rows], DType::F32)?);
    let bp = opt_ptr("layernorm_fwd", b)?;
    let name = format!("layernorm_fwd_{}", sfx("layernorm_fwd", x.dtype())?);
    rows_launch8(
        be,
        &name,
        rows,
        c,
        &[
            ptr("ln", x)?,
            x2p,
            sump,
            ptr("ln", w.w)?,
            bp,
            ptr("ln", &y)?,
            ptr("ln", &mean)?,
            ptr("ln", &rstd)?,
            n(c),
            Arg::F32(eps as f32),
            Arg::F32(w.shift()),
        ],
    )?;
    Ok((y, mean, rstd, sum))
}

/// LayerNorm backward: (dx + res, dw, db), dw and db summed into `to` (new tensors or added
/// into f32 ones).
pub fn layernorm_bwd(
    be: &B,
    dy: &Tensor,
    x: &Tensor,
    w: Gamma,
    mean: &Tensor,
    rstd: &Tensor,
    res: Option<&Tensor>,
    to: [SumTo; 2],
    res_to: Option<SumTo>,
) -> Result<(Tensor, Tensor, Tensor, Option<Tensor>)> {
    let (rows, c) = (x.shape().rows(), x.shape().last());
    let s = sfx("layernorm_bwd", x.dtype())?;
    let dx = new(be, x.shape().clone(), x.dtype())?;
    let (dyp, xp, wp, mp, rp) = (ptr("ln", dy)?, ptr("ln", x)?, ptr("ln", w.w)?, ptr("ln", mean)?, ptr("ln", rstd)?);
    let (resp, dxp) = (opt_ptr("ln", res)?, ptr("ln", &dx)?);
    let plan = bwd_cols_block(c, true, res.is_some() && res_to.is_some(), &[dyp, xp, wp, resp, dxp]);
    let chunks = rows.div_ceil(COL_CHUNK);
    let (pw, pb) = (new(be, [chunks, c], DType::F32)?, new(be, [chunks, c], DType::F32)?);
    let (pwp, pbp) = (ptr("ln", &pw)?, ptr("ln", &pb)?);
    let (prp, pr, res_sum) = res_partials(be, plan.is_some(), res, &res_to, chunks, c)?;
    if let Some((threads, shared)) = plan {
        let args = [dyp, xp, wp, mp, rp, resp, dxp, pwp, pbp, prp, n(rows), n(c), Arg::F32(w.shift())];
        let build = crate::cuda::norm_bwd_build();
        be.launch(&format!("layernorm_bwd_cols{build}_{s}"), chunks as u32, threads, shared, &args)?;
    } else {
        rows_launch8(
            be,
            &format!("layernorm_bwd_{s}"),
            rows,
            c,
            &[dyp, xp, wp, mp, rp, resp, dxp, n(c), Arg::F32(w.shift())],
        )?;
        let args = [dyp, xp, mp, rp, pwp, pbp, n(rows), n(c)];
        col_partials(be, &format!("norm_param_grad_{s}"), chunks, c, &args)?;
    }
    let [tw, tb] = to;
    // The weight's, the bias's and the residual's second passes in one launch.
    let mut sums = vec![(&pw, tw), (&pb, tb)];
    if let (Some(pr), Some(to)) = (&pr, res_to) {
        sums.push((pr, to));
    }
    let mut ys = col_sums(be, &sums, chunks, c)?.into_iter();
    let (dw, db) = (ys.next(), ys.next());
    let res_sum = ys.next().or(res_sum);
    let missing = || Error::Cuda("col_sums returned fewer sums than asked".into());
    Ok((dx, dw.ok_or_else(missing)?, db.ok_or_else(missing)?, res_sum))
}

/// RMSNorm of x (or of x + x2, returned as the third value): (y, rstd, sum).
pub fn rmsnorm_fwd(
    be: &B,
    x: &Tensor,
    x2: Option<&Tensor>,
    w: Gamma,
    eps: f64,
) -> Result<(Tensor, Tensor, Option<Tensor>)> {
    let (rows, c) = (x.shape().rows(), x.shape().last());
    let y = new(be, x.shape().clone(), x.dtype())?;
    let (x2p, sump, sum) = residual_sum(be, x, x2)?;
    let rstd = new(be, [rows], DType::F32)?;
    let name = format!("rmsnorm_fwd_{}", sfx("rmsnorm_fwd", x.dtype())?);
    rows_launch8(
        be,
        &name,
        rows,
        c,
        &[
            ptr("rms", x)?,
            x2p,
            sump,
            ptr("rms", w.w)?,
            ptr("rms", &y)?,
            ptr("rms", &rstd)?,
            n(c),
            Arg::F32(eps as f32),
            Arg::F32(w.shift()),
        ],
    )?;
    Ok((y, rstd, sum))
}

/// RMSNorm backward: (dx + res, dw), dw summed into `to`.
pub fn rmsnorm_bwd(
    be: &B,
    dy: &Tensor,
    x: &Tensor,
    w: Gamma,
    rstd: &Tensor,
    res: Option<&Tensor>,
    to: SumTo,
    res_to: Option<SumTo>,
) -> Result<(Tensor, Tensor, Option<Tensor>)> {
    let (rows, c) = (x.shape().rows(), x.shape().last());
    let s = sfx("rmsnorm_bwd", x.dtype())?;
    let dx = new(be, x.shape().clone(), x.dtype())?;
    let (dyp, xp, wp, rp) = (ptr("rms", dy)?, ptr("rms", x)?, ptr("rms", w.w)?, ptr("rms", rstd)?);
    let (resp, dxp) = (opt_ptr("rms", res)?, ptr("rms", &dx)?);
    let plan = bwd_cols_block(c, false, res.is_some() && res_to.is_some(), &[dyp, xp, wp, resp, dxp]);
    let chunks = rows.div_ceil(COL_CHUNK);
    let pw = new(be, [chunks, c], DType::F32)?;
    let pwp = ptr("rms", &pw)?;
    let (prp, pr, res_sum) = res_partials(be, plan.is_some(), res, &res_to, chunks, c)?;
    if let Some((threads, shared)) = plan {
        let args = [dyp, xp, wp, rp, resp, dxp, pwp, prp, n(rows), n(c), Arg::F32(w.shift())];
        let build = crate::cuda::norm_bwd_build();
        be.launch(&format!("rmsnorm_bwd_cols{build}_{s}"), chunks as u32, threads, shared, &args)?;
    } else {
        rows_launch8(
            be,
            &format!("rmsnorm_bwd_{s}"),
            rows,
            c,
            &[dyp, xp, wp, rp, resp, dxp, n(c), Arg::F32(w.shift())],
        )?;
        let args = [dyp, xp, NULL, rp, pwp, NULL, n(rows), n(c)];
        col_partials(be, &format!("norm_param_grad_{s}"), chunks, c, &args)?;
    }
    let mut sums = vec![(&pw, to)];
    if let (Some(pr), Some(rt)) = (&pr, res_to) {
        sums.push((pr, rt));
    }
    let mut ys = col_sums(be, &sums, chunks, c)?.into_iter();
    let dw = ys.next().ok_or_else(|| Error::Cuda("col_sums returned no sum".into()))?;
    Ok((dx, dw, ys.next().or(res_sum)))
}

pub fn softmax(be: &B, x: &Tensor) -> Result<Tensor> {
    let y = new(be, x.shape().clone(), x.dtype())?;
    let name = format!("softmax_fwd_{}", sfx("softmax", x.dtype())?);
    rows_launch(be, &name, x.shape().rows(), &[ptr("softmax", x)?, ptr("softmax", &y)?, n(x.shape().last())])?;
    Ok(y)
}

pub fn softmax_bwd(be: &B, y: &Tensor, dy: &Tensor) -> Result<Tensor> {
    let dx = new(be, y.shape().clone(), y.dtype())?;
    let name = format!("softmax_bwd_{}", sfx("softmax_bwd", y.dtype())?);
    rows_launch(
        be,
        &name,
        y.shape().rows(),
        &[ptr("softmax_bwd", y)?, ptr("softmax_bwd", dy)?, ptr("softmax_bwd", &dx)?, n(y.shape().last())],
    )?;
    Ok(dx)
}
