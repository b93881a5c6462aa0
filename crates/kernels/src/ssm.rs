//! Mamba-2's mixer ops (`cpu/ssm.rs` has the math and the shapes): the causal depthwise
//! convolution with SiLU, the selective state-space scan and the gated grouped RMSNorm. Their
//! parameter gradients are returned as f32 tensors for the caller to add into main_grad (they
//! are a few values per channel or head).

use crate::{check, cpu};
pub use cpu::ssm::{CHUNK as SCAN_CHUNK, ScanDims};
use ferrotron_core::{DType, Result, Tensor, invalid};

fn dims3(op: &'static str, t: &Tensor) -> Result<(usize, usize, usize)> {
    check::rank(op, t, 3)?;
    Ok((t.dims()[0], t.dims()[1], t.dims()[2]))
}

/// The convolution's checks: x [B, T, C], w [C, K] or [C, 1, K] (PyTorch's Conv1d layout), bias [C].
fn conv_shape(op: &'static str, x: &Tensor, w: &Tensor, bias: &Tensor) -> Result<(usize, usize, usize, usize)> {
    check::float(op, x)?;
    let (b, t, c) = dims3(op, x)?;
    let k = *w.dims().last().unwrap_or(&0);
    if w.dims().first() != Some(&c) || w.shape().elem_count() != c * k || k == 0 {
        return Err(invalid(op, format!("weight {:?} must be [{c}, 1, K] for x {:?}", w.dims(), x.dims())));
    }
    check::shape(op, bias, &[c])?;
    Ok((b, t, c, k))
}

/// y = silu(conv(x) + bias): the causal depthwise convolution of x [B, T, C] over time with
/// w [C, (1,) K] (step t reads steps t − K + 1 ..= t), as x's dtype.
pub fn conv1d_silu(x: &Tensor, w: &Tensor, bias: &Tensor) -> Result<Tensor> {
    const OP: &str = "conv1d_silu";
    let (_, t, _, k) = conv_shape(OP, x, w, bias)?;
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[x, w, bias])? {
        return crate::cuda::ops::conv1d_silu(&g, x, w, bias);
    }
    check::on_cpu(OP, &[x, w, bias])?;
    let (xv, wv, bv) = (x.read_f32()?, w.read_f32()?, bias.read_f32()?);
    let mut y = vec![0f32; xv.len()];
    cpu::ssm::conv_silu(&xv, &wv, &bv, t, k, &mut y);
    check::out(y, x.shape().clone(), x.dtype(), x.device())
}

/// The backward of `conv1d_silu`: (dx as x's dtype, dw [C, K] f32, dbias [C] f32).
pub fn conv1d_silu_bwd(x: &Tensor, w: &Tensor, bias: &Tensor, dy: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
    const OP: &str = "conv1d_silu_bwd";
    let (_, t, c, k) = conv_shape(OP, x, w, bias)?;
    check::float(OP, dy)?;
    check::shape(OP, dy, x.dims())?;
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[x, w, bias, dy])? {
        return crate::cuda::ops::conv1d_silu_bwd(&g, x, w, bias, dy);
    }
    check::on_cpu(OP, &[x, w, bias, dy])?;
    let (xv, wv, bv, gv) = (x.read_f32()?, w.read_f32()?, bias.read_f32()?, dy.read_f32()?);
    let (mut dx, mut dw, mut db) = (vec![0f32; xv.len()], vec![0f32; c * k], vec![0f32; c]);
    cpu::ssm::conv_silu_bwd(&xv, &wv, &bv, &gv, t, k, &mut dx, &mut dw, &mut db);
    Ok((
        check::out(dx, x.shape().clone(), x.dtype(), x.device())?,
        Tensor::from_vec(dw, [c, k], x.device())?,
        Tensor::from_vec(db, [c], x.device())?,
    ))
}

/// The scan's per-head parameters, each [H] (any float dtype).
#[derive(Clone, Copy)]
pub struct ScanParams<'a> {
    pub dt_bias: &'a Tensor,
    pub a_log: &'a Tensor,
    pub d: &'a Tensor,
}

fn scan_shape(op: &'static str, xbc: &Tensor, dt: &Tensor, p: &ScanParams, dm: &ScanDims) -> Result<()> {
    if dm.heads == 0 || dm.head_dim == 0 || dm.groups == 0 || dm.state == 0 || dm.heads % dm.groups != 0 {
        return Err(invalid(op, format!("{dm:?}: every size must be positive and the heads a multiple of the groups")));
    }
    check::float(op, xbc)?;
    check::shape(op, xbc, &[dm.batch, dm.seq, dm.xbc_width()])?;
    check::float(op, dt)?;
    check::shape(op, dt, &[dm.batch, dm.seq, dm.heads])?;
    for t in [p.dt_bias, p.a_log, p.d] {
        check::float(op, t)?;
        check::shape(op, t, &[dm.heads])?;
    }
    Ok(())
}

/// Mamba-2's selective scan: xbc [B, T, H·P + 2·G·N] (x | B | C, as the convolution leaves them) and
/// dt_raw [B, T, H] (before dt_bias and softplus) → (y [B, T, H·P] as xbc's dtype, D's skip
/// included; the states the backward starts its chunks from, [B, H, chunks, N, P] f32).
pub fn ssd_scan(xbc: &Tensor, dt_raw: &Tensor, p: &ScanParams, dm: &ScanDims) -> Result<(Tensor, Tensor)> {
    const OP: &str = "ssd_scan";
    scan_shape(OP, xbc, dt_raw, p, dm)?;
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[xbc, dt_raw, p.dt_bias, p.a_log, p.d])? {
        return crate::cuda::ops::ssd_scan(&g, xbc, dt_raw, p, dm);
    }
    check::on_cpu(OP, &[xbc, dt_raw, p.dt_bias, p.a_log, p.d])?;
    let (xv, dv) = (xbc.read_f32()?, dt_raw.read_f32()?);
    let (bias, a_log, d) = (p.dt_bias.read_f32()?, p.a_log.read_f32()?, p.d.read_f32()?);
    let prm = cpu::ssm::ScanParams { dt_bias: &bias, a_log: &a_log, d: &d };
    let mut y = vec![0f32; dm.batch * dm.seq * dm.heads * dm.head_dim];
    let mut states = vec![0f32; dm.batch * dm.heads * dm.states_per_head()];
    cpu::ssm::scan(&xv, &dv, &prm, dm, &mut y, &mut states);
    let sshape = [dm.batch, dm.heads, dm.chunks(), dm.state, dm.head_dim];
    Ok((
        check::out(y, [dm.batch, dm.seq, dm.heads * dm.head_dim], xbc.dtype(), xbc.device())?,
        Tensor::from_vec(states, sshape, xbc.device())?,
    ))
}

/// The scan's gradients: the inputs' as their dtypes, the parameters' [H] f32.
pub struct ScanGrads {
    pub dxbc: Tensor,
    pub ddt_raw: Tensor,
    pub dt_bias: Tensor,
    pub a_log: Tensor,
    pub d: Tensor,
}

/// The backward of `ssd_scan` from dy [B, T, H·P] and the states it saved.
pub fn ssd_scan_bwd(
    xbc: &Tensor,
    dt_raw: &Tensor,
    p: &ScanParams,
    dm: &ScanDims,
    states: &Tensor,
    dy: &Tensor,
) -> Result<ScanGrads> {
    const OP: &str = "ssd_scan_bwd";
    scan_shape(OP, xbc, dt_raw, p, dm)?;
    check::dtype(OP, states, DType::F32)?;
    check::shape(OP, states, &[dm.batch, dm.heads, dm.chunks(), dm.state, dm.head_dim])?;
    check::float(OP, dy)?;
    check::shape(OP, dy, &[dm.batch, dm.seq, dm.heads * dm.head_dim])?;
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[xbc, dt_raw, p.dt_bias, p.a_log, p.d, states, dy])? {
        return crate::cuda::ops::ssd_scan_bwd(&g, xbc, dt_raw, p, dm, states, dy);
    }
    check::on_cpu(OP, &[xbc, dt_raw, p.dt_bias, p.a_log, p.d, states, dy])?;
    let (xv, dv, sv, gv) = (xbc.read_f32()?, dt_raw.read_f32()?, states.read_f32()?, dy.read_f32()?);
    let (bias, a_log, d) = (p.dt_bias.read_f32()?, p.a_log.read_f32()?, p.d.read_f32()?);
    let prm = cpu::ssm::ScanParams { dt_bias: &bias, a_log: &a_log, d: &d };
    let (mut dx, mut ddt) = (vec![0f32; xv.len()], vec![0f32; dv.len()]);
    let (mut gb, mut ga, mut gd) = (vec![0f32; dm.heads], vec![0f32; dm.heads], vec![0f32; dm.heads]);
    let grads = cpu::ssm::ScanParamGrads { dt_bias: &mut gb, a_log: &mut ga, d: &mut gd };
    cpu::ssm::scan_bwd(&xv, &dv, &prm, dm, &sv, &gv, &mut dx, &mut ddt, grads);
    let dev = xbc.device();
    Ok(ScanGrads {
        dxbc: check::out(dx, xbc.shape().clone(), xbc.dtype(), dev)?,
        ddt_raw: check::out(ddt, dt_raw.shape().clone(), dt_raw.dtype(), dev)?,
        dt_bias: Tensor::from_vec(gb, [dm.heads], dev)?,
        a_log: Tensor::from_vec(ga, [dm.heads], dev)?,
        d: Tensor::from_vec(gd, [dm.heads], dev)?,
    })
}

fn gated_shape(op: &'static str, y: &Tensor, z: &Tensor, w: &Tensor, groups: usize) -> Result<(usize, usize)> {
    check::float(op, y)?;
    check::float(op, z)?;
    check::float(op, w)?;
    let c = y.shape().last();
    check::shape(op, z, y.dims())?;
    check::shape(op, w, &[c])?;
    if groups == 0 || c % groups != 0 {
        return Err(invalid(op, format!("{groups} groups must divide the {c} channels")));
    }
    Ok((y.shape().rows(), c))
}

/// Mamba-2's gated RMSNorm: y, z [..., C], w [C] → (rmsnorm over each of `groups` column groups of
/// y · silu(z), times w, as y's dtype; rstd [rows, groups] f32).
pub fn gated_rmsnorm(y: &Tensor, z: &Tensor, w: &Tensor, groups: usize, eps: f64) -> Result<(Tensor, Tensor)> {
    const OP: &str = "gated_rmsnorm";
    let (rows, _) = gated_shape(OP, y, z, w, groups)?;
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[y, z, w])? {
        return crate::cuda::ops::gated_rmsnorm(&g, y, z, w, groups, eps);
    }
    check::on_cpu(OP, &[y, z, w])?;
    let (yv, zv, wv) = (y.read_f32()?, z.read_f32()?, w.read_f32()?);
    let (mut out, mut rstd) = (vec![0f32; yv.len()], vec![0f32; rows * groups]);
    cpu::ssm::gated_norm(&yv, &zv, &wv, groups, eps, &mut out, &mut rstd);
    Ok((
        check::out(out, y.shape().clone(), y.dtype(), y.device())?,
        Tensor::from_vec(rstd, [rows, groups], y.device())?,
    ))
}

/// The backward of `gated_rmsnorm`: (dy, dz as y's dtype, dw [C] f32).
pub fn gated_rmsnorm_bwd(
    dout: &Tensor,
    y: &Tensor,
    z: &Tensor,
    w: &Tensor,
    rstd: &Tensor,
    groups: usize,
) -> Result<(Tensor, Tensor, Tensor)> {
    const OP: &str = "gated_rmsnorm_bwd";
    let (rows, c) = gated_shape(OP, y, z, w, groups)?;
    check::float(OP, dout)?;
    check::shape(OP, dout, y.dims())?;
    check::dtype(OP, rstd, DType::F32)?;
    check::shape(OP, rstd, &[rows, groups])?;
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[dout, y, z, w, rstd])? {
        return crate::cuda::ops::gated_rmsnorm_bwd(&g, dout, y, z, w, rstd, groups);
    }
    check::on_cpu(OP, &[dout, y, z, w, rstd])?;
    let (gv, yv, zv, wv, rv) = (dout.read_f32()?, y.read_f32()?, z.read_f32()?, w.read_f32()?, rstd.read_f32()?);
    let (mut dy, mut dz, mut dw) = (vec![0f32; yv.len()], vec![0f32; yv.len()], vec![0f32; c]);
    cpu::ssm::gated_norm_bwd(&gv, &yv, &zv, &wv, &rv, groups, &mut dy, &mut dz, &mut dw);
    let dev = y.device();
    Ok((
        check::out(dy, y.shape().clone(), y.dtype(), dev)?,
        check::out(dz, y.shape().clone(), y.dtype(), dev)?,
        Tensor::from_vec(dw, [c], dev)?,
    ))
}
