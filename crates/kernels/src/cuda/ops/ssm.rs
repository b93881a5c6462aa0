//! Mamba-2's mixer ops on the GPU (kernels/ssm.cu, ssd_chunk.cu): the convolution grid-stride, the
//! scan in its chunked form (one block per (sequence, head, chunk of `SCAN_CHUNK` steps), the steps
//! of a chunk as products in shared memory) or, where a chunk's operands do not fit in shared
//! memory, step by step (one block per (sequence, head), one thread per head channel), the gated
//! norm one block per (row, group). Same results as `cpu::ssm` within float rounding; parameter
//! gradients are summed in a fixed order (no atomics).

use super::*;
use crate::{ScanDims, ScanGrads, ScanParams};

/// Rows of 128 threads for the gated norm; `block_sum` wants a multiple of 32.
const NORM_THREADS: u32 = 128;
/// kernels/ssm.cu's limits.
const MAX_STATE: usize = 256;
const MAX_TAPS: usize = 8;
const CONV_ROW_BLOCKS: usize = 64;
// kernels/ssd_chunk.cu's SSD_Q: the chunks of the saved states are the chunked kernels' chunks.
const _: () = assert!(crate::SCAN_CHUNK == 64);
/// Threads of a chunked scan block (kernels/ssd_chunk.cu: 4 × 4 output patches each).
const CHUNK_THREADS: u32 = 256;

/// Shared memory (bytes) of the chunked scan's kernels: (chunk state, chunk output, backward).
fn chunk_smem(dm: &ScanDims) -> (usize, usize, usize) {
    let q = crate::SCAN_CHUNK;
    let (n4, p4) = (dm.state.next_multiple_of(4), dm.head_dim.next_multiple_of(4));
    let state = 4 * q + q * (n4 + p4);
    let out = 3 * q + q * (2 * n4 + p4) + q * q;
    let bwd = 7 * q + 2 * q * (n4 + p4) + 4 * q * q + q * n4 / 4;
    (4 * state, 4 * out, 4 * bwd)
}

/// Shared memory (bytes) of the tensor-core output and backward (kernels/ssd_chunk_tc.cu).
fn tc_smem(dm: &ScanDims) -> (usize, usize) {
    let (q, l, n, p) = (crate::SCAN_CHUNK, crate::SCAN_CHUNK + 4, dm.state, dm.head_dim);
    let out = 3 * q + q * (n + 4) + n * l + q * (p + 4) + q * l;
    let bwd = 7 * q + 2 * p * l + n * l + q * (n + 4) + 4 * q * l + q * n / 32;
    (4 * out, 4 * bwd)
}

/// bf16 scans whose head dim and state are multiples of 32 multiply on tensor cores (TF32) where
/// the backward fits, unless `FERROTRON_SSD_TC=0` keeps the f32 FMAs (A/B runs).
fn tensor_cores(be: &B, dm: &ScanDims, dt: DType) -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let off = *OFF.get_or_init(|| std::env::var("FERROTRON_SSD_TC").as_deref() == Ok("0"));
    !off && dt == DType::BF16 && dm.head_dim % 32 == 0 && dm.state % 32 == 0 && tc_smem(dm).1 + 1024 <= be.smem_optin
}

/// The chunked scan runs where its backward's operands fit in a block's shared memory (beside
/// `block_sum`'s), in the tensor-core form or the f32 one, unless `FERROTRON_SSD_SCAN=steps` asks
/// for the step-by-step kernels (A/B runs).
fn chunked(be: &B, dm: &ScanDims, dt: DType) -> bool {
    static STEPS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let steps = *STEPS.get_or_init(|| std::env::var("FERROTRON_SSD_SCAN").as_deref() == Ok("steps"));
    !steps && (tensor_cores(be, dm, dt) || chunk_smem(dm).2 + 1024 <= be.smem_optin)
}

fn conv_dims(x: &Tensor, w: &Tensor) -> (usize, usize, usize, usize) {
    let (b, t, c) = (x.dims()[0], x.dims()[1], x.dims()[2]);
    (b * t, t, c, w.elem_count() / c.max(1))
}

/// The convolution's elementwise kernels: a block per row (at most 2^20 blocks, grid-stride past
/// that), 256 threads over the row's channels.
fn conv_rows(be: &B, name: &str, rows: usize, args: &[Arg]) -> Result<()> {
    be.launch(name, rows.min(1 << 20) as u32, 256, 0, args)
}

pub fn conv1d_silu(be: &B, x: &Tensor, w: &Tensor, bias: &Tensor) -> Result<Tensor> {
    let op = "conv1d_silu";
    let (rows, seq, c, k) = conv_dims(x, w);
    let (w, bias) = (in_dtype(w, DType::F32)?, in_dtype(bias, DType::F32)?);
    let y = new(be, x.shape().clone(), x.dtype())?;
    let name = format!("conv1d_silu_{}", sfx(op, x.dtype())?);
    let args = [ptr(op, x)?, ptr(op, &w)?, ptr(op, &bias)?, ptr(op, &y)?, n(rows), n(seq), n(c), n(k)];
    conv_rows(be, &name, rows, &args)?;
    Ok(y)
}

pub fn conv1d_silu_bwd(be: &B, x: &Tensor, w: &Tensor, bias: &Tensor, dy: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
    let op = "conv1d_silu_bwd";
    let (rows, seq, c, k) = conv_dims(x, w);
    if k > MAX_TAPS {
        return Err(Error::NotImplemented { op, device: format!("cuda for more than {MAX_TAPS} taps (got {k})") });
    }
    let s = sfx(op, x.dtype())?;
    let (w, bias, dy) = (in_dtype(w, DType::F32)?, in_dtype(bias, DType::F32)?, in_dtype(dy, x.dtype())?);
    let dpre = new(be, [rows, c], DType::F32)?;
    let args =
        [ptr(op, x)?, ptr(op, &w)?, ptr(op, &bias)?, ptr(op, &dy)?, ptr(op, &dpre)?, n(rows), n(seq), n(c), n(k)];
    conv_rows(be, &format!("conv1d_silu_dpre_{s}"), rows, &args)?;
    let dx = new(be, x.shape().clone(), x.dtype())?;
    let args = [ptr(op, &dpre)?, ptr(op, &w)?, ptr(op, &dx)?, n(rows), n(seq), n(c), n(k)];
    conv_rows(be, &format!("conv1d_dx_{s}"), rows, &args)?;
    let part = new(be, [CONV_ROW_BLOCKS, c, k + 1], DType::F32)?;
    let args = [ptr(op, x)?, ptr(op, &dpre)?, ptr(op, &part)?, n(rows), n(seq), n(c), n(k)];
    be.launch(&format!("conv1d_dw_part_{s}"), (CONV_ROW_BLOCKS * c.div_ceil(32)) as u32, 256, 0, &args)?;
    let (dw, db) = (new(be, [c, k], DType::F32)?, new(be, [c], DType::F32)?);
    ew(be, "conv1d_dw_sum", c * (k + 1), &[ptr(op, &part)?, ptr(op, &dw)?, ptr(op, &db)?, n(c), n(k)])?;
    Ok((dx, dw, db))
}

fn scan_limits(be: &B, op: &'static str, dm: &ScanDims) -> Result<()> {
    if dm.state > MAX_STATE || dm.head_dim > 1024 || step_bwd_smem(dm) > be.smem_optin {
        return Err(Error::NotImplemented {
            op,
            device: format!(
                "cuda for state {} and head dim {}: a block's shared memory on this card ({} bytes) holds \
                 neither the chunked scan's backward ({} bytes) nor the step-by-step one's ({} bytes; state \
                 ≤ {MAX_STATE}); use fewer state channels or a smaller --mamba-head-dim",
                dm.state,
                dm.head_dim,
                be.smem_optin,
                chunk_smem(dm).2 + 1024,
                step_bwd_smem(dm),
            ),
        });
    }
    Ok(())
}

/// Shared memory (bytes) of the step-by-step backward.
fn step_bwd_smem(dm: &ScanDims) -> usize {
    4 * (2 * dm.state * dm.head_dim + dm.head_dim + dm.state)
}

/// The scan kernels' trailing sizes, the steps between saved states last.
fn scan_sizes(dm: &ScanDims) -> [Arg; 6] {
    [n(dm.seq), n(dm.heads), n(dm.head_dim), n(dm.groups), n(dm.state), n(crate::SCAN_CHUNK)]
}

pub fn ssd_scan(be: &B, xbc: &Tensor, dt_raw: &Tensor, p: &ScanParams, dm: &ScanDims) -> Result<(Tensor, Tensor)> {
    let op = "ssd_scan";
    let dtr = in_dtype(dt_raw, xbc.dtype())?;
    let (bias, a_log, d) =
        (in_dtype(p.dt_bias, DType::F32)?, in_dtype(p.a_log, DType::F32)?, in_dtype(p.d, DType::F32)?);
    let y = new(be, [dm.batch, dm.seq, dm.heads * dm.head_dim], xbc.dtype())?;
    let states = new(be, [dm.batch, dm.heads, dm.chunks(), dm.state, dm.head_dim], DType::F32)?;
    let s = sfx(op, xbc.dtype())?;
    if chunked(be, dm, xbc.dtype()) {
        let (sm_state, sm_out, _) = chunk_smem(dm);
        let blocks = (dm.batch * dm.heads * dm.chunks()) as u32;
        let decay = new(be, [dm.batch * dm.heads * dm.chunks()], DType::F32)?;
        let mut args = vec![ptr(op, xbc)?, ptr(op, xbc)?, ptr(op, &dtr)?, ptr(op, &bias)?, ptr(op, &a_log)?];
        args.extend([ptr(op, &states)?, ptr(op, &decay)?]);
        args.extend(chunk_sizes(dm));
        args.push(n(0)); // mode 0: B ⊗ x
        be.launch(&format!("ssd_chunk_state_{s}"), blocks, CHUNK_THREADS, sm_state as u32, &args)?;
        state_pass(be, op, &states, &decay, dm, false)?;
        let mut args = vec![ptr(op, xbc)?, ptr(op, &dtr)?, ptr(op, &bias)?, ptr(op, &a_log)?, ptr(op, &d)?];
        args.extend([ptr(op, &states)?, ptr(op, &y)?]);
        args.extend(chunk_sizes(dm));
        if tensor_cores(be, dm, xbc.dtype()) {
            be.launch("ssd_chunk_out_tc_bf16", blocks, CHUNK_THREADS, tc_smem(dm).0 as u32, &args)?;
        } else {
            be.launch(&format!("ssd_chunk_out_{s}"), blocks, CHUNK_THREADS, sm_out as u32, &args)?;
        }
        return Ok((y, states));
    }
    scan_limits(be, op, dm)?;
    let mut args = vec![ptr(op, xbc)?, ptr(op, &dtr)?, ptr(op, &bias)?, ptr(op, &a_log)?, ptr(op, &d)?, ptr(op, &y)?];
    args.push(ptr(op, &states)?);
    args.extend(scan_sizes(dm));
    be.launch(&format!("ssd_scan_fwd_{s}"), (dm.batch * dm.heads) as u32, dm.head_dim as u32, 0, &args)?;
    Ok((y, states))
}

/// The chunked kernels' trailing sizes: seq, heads, head dim, groups, state (`ssd_chunk_state`
/// takes its mode after them).
fn chunk_sizes(dm: &ScanDims) -> [Arg; 5] {
    [n(dm.seq), n(dm.heads), n(dm.head_dim), n(dm.groups), n(dm.state)]
}

/// `ssd_state_pass` over every (sequence, head) and state element, in place.
fn state_pass(be: &B, op: &'static str, st: &Tensor, decay: &Tensor, dm: &ScanDims, reverse: bool) -> Result<()> {
    let (bhs, np) = (dm.batch * dm.heads, dm.state * dm.head_dim);
    let args = [ptr(op, st)?, ptr(op, decay)?, n(bhs), n(dm.chunks()), n(np), n(reverse as usize)];
    ew(be, "ssd_state_pass", bhs * np, &args)
}

pub fn ssd_scan_bwd(
    be: &B,
    xbc: &Tensor,
    dt_raw: &Tensor,
    p: &ScanParams,
    dm: &ScanDims,
    states: &Tensor,
    dy: &Tensor,
) -> Result<ScanGrads> {
    let op = "ssd_scan_bwd";
    let dt = xbc.dtype();
    let s = sfx(op, dt)?;
    let (dtr, dy) = (in_dtype(dt_raw, dt)?, in_dtype(dy, dt)?);
    let (bias, a_log, d) =
        (in_dtype(p.dt_bias, DType::F32)?, in_dtype(p.a_log, DType::F32)?, in_dtype(p.d, DType::F32)?);
    let (bh, rows) = (dm.batch * dm.heads, dm.batch * dm.seq);
    let dxbc = new(be, xbc.shape().clone(), dt)?;
    let ddt = new(be, dt_raw.shape().clone(), dt)?;
    let dbh = new(be, [rows, dm.heads, dm.state], DType::F32)?;
    let dch = new(be, [rows, dm.heads, dm.state], DType::F32)?;
    // Parameter partials per (sequence, head) and, chunked, per chunk.
    let chunk = chunked(be, dm, dt);
    let per = if chunk { dm.chunks() } else { 1 };
    let prm = new(be, [bh * per, 3], DType::F32)?;
    if chunk {
        let (sm_state, _, sm_bwd) = chunk_smem(dm);
        let blocks = (bh * dm.chunks()) as u32;
        let gstates = new(be, states.shape().clone(), DType::F32)?;
        let decay = new(be, [bh * dm.chunks()], DType::F32)?;
        let mut args = vec![ptr(op, xbc)?, ptr(op, &dy)?, ptr(op, &dtr)?, ptr(op, &bias)?, ptr(op, &a_log)?];
        args.extend([ptr(op, &gstates)?, ptr(op, &decay)?]);
        args.extend(chunk_sizes(dm));
        args.push(n(1)); // mode 1: C ⊗ dy
        be.launch(&format!("ssd_chunk_state_{s}"), blocks, CHUNK_THREADS, sm_state as u32, &args)?;
        state_pass(be, op, &gstates, &decay, dm, true)?;
        let mut args = vec![ptr(op, xbc)?, ptr(op, &dtr)?, ptr(op, &bias)?, ptr(op, &a_log)?, ptr(op, &d)?];
        for t in [states, &gstates, &dy, &dxbc, &ddt, &dbh, &dch, &prm] {
            args.push(ptr(op, t)?);
        }
        args.extend(chunk_sizes(dm));
        if tensor_cores(be, dm, dt) {
            be.launch("ssd_chunk_bwd_tc_bf16", blocks, CHUNK_THREADS, tc_smem(dm).1 as u32, &args)?;
        } else {
            be.launch(&format!("ssd_chunk_bwd_{s}"), blocks, CHUNK_THREADS, sm_bwd as u32, &args)?;
        }
    } else {
        scan_limits(be, op, dm)?;
        let scratch = new(be, [bh, crate::SCAN_CHUNK + 1, dm.state, dm.head_dim], DType::F32)?;
        let mut args =
            vec![ptr(op, xbc)?, ptr(op, &dtr)?, ptr(op, &bias)?, ptr(op, &a_log)?, ptr(op, &d)?, ptr(op, states)?];
        for t in [&dy, &dxbc, &ddt, &dbh, &dch, &prm, &scratch] {
            args.push(ptr(op, t)?);
        }
        args.extend(scan_sizes(dm));
        be.launch(&format!("ssd_scan_bwd_{s}"), bh as u32, dm.head_dim as u32, step_bwd_smem(dm) as u32, &args)?;
    }
    let args = [
        ptr(op, &dbh)?,
        ptr(op, &dch)?,
        ptr(op, &dxbc)?,
        n(rows),
        n(dm.heads),
        n(dm.head_dim),
        n(dm.groups),
        n(dm.state),
    ];
    ew(be, &format!("ssd_bc_sum_{s}"), rows * dm.groups * dm.state, &args)?;
    let (gb, ga, gd) =
        (new(be, [dm.heads], DType::F32)?, new(be, [dm.heads], DType::F32)?, new(be, [dm.heads], DType::F32)?);
    let args = [ptr(op, &prm)?, ptr(op, &gb)?, ptr(op, &ga)?, ptr(op, &gd)?, n(dm.batch), n(dm.heads), n(per)];
    ew(be, "ssd_prm_sum", dm.heads, &args)?;
    Ok(ScanGrads { dxbc, ddt_raw: ddt, dt_bias: gb, a_log: ga, d: gd })
}

pub fn gated_rmsnorm(be: &B, y: &Tensor, z: &Tensor, w: &Tensor, groups: usize, eps: f64) -> Result<(Tensor, Tensor)> {
    let op = "gated_rmsnorm";
    let (rows, c) = (y.shape().rows(), y.shape().last());
    let (z, w) = (in_dtype(z, y.dtype())?, in_dtype(w, DType::F32)?);
    let out = new(be, y.shape().clone(), y.dtype())?;
    let rstd = new(be, [rows, groups], DType::F32)?;
    let args = [
        ptr(op, y)?,
        ptr(op, &z)?,
        ptr(op, &w)?,
        ptr(op, &out)?,
        ptr(op, &rstd)?,
        n(c),
        n(groups),
        Arg::F32(eps as f32),
    ];
    be.launch(&format!("gated_rmsnorm_fwd_{}", sfx(op, y.dtype())?), (rows * groups) as u32, NORM_THREADS, 0, &args)?;
    Ok((out, rstd))
}

pub fn gated_rmsnorm_bwd(
    be: &B,
    dout: &Tensor,
    y: &Tensor,
    z: &Tensor,
    w: &Tensor,
    rstd: &Tensor,
    groups: usize,
) -> Result<(Tensor, Tensor, Tensor)> {
    let op = "gated_rmsnorm_bwd";
    let (rows, c) = (y.shape().rows(), y.shape().last());
    let (dout, z, w) = (in_dtype(dout, y.dtype())?, in_dtype(z, y.dtype())?, in_dtype(w, DType::F32)?);
    let (dy, dz) = (new(be, y.shape().clone(), y.dtype())?, new(be, y.shape().clone(), y.dtype())?);
    let wterm = new(be, [rows, c], DType::F32)?;
    let mut args = vec![ptr(op, &dout)?, ptr(op, y)?, ptr(op, &z)?, ptr(op, &w)?, ptr(op, rstd)?];
    args.extend([ptr(op, &dy)?, ptr(op, &dz)?, ptr(op, &wterm)?, n(c), n(groups)]);
    be.launch(&format!("gated_rmsnorm_bwd_{}", sfx(op, y.dtype())?), (rows * groups) as u32, NORM_THREADS, 0, &args)?;
    Ok((dy, dz, crate::bias_grad(&wterm)?))
}
