//! Mamba-2's mixer ops on the GPU (kernels/ssm.cu, ssd_chunk.cu): the convolution a thread per
//! channel walking runs of `CONV_RUN` steps, the scan in its chunked form (one block per (sequence,
//! head, chunk of `SCAN_CHUNK` steps), the steps of a chunk as products in shared memory) or, where
//! a chunk's operands do not fit in shared memory, step by step (one block per (sequence, head), one
//! thread per head channel), the gated norm a warp per (row, group) (a block where a group is over
//! 1,024 channels or not a multiple of 8). Same results as `cpu::ssm` within float rounding;
//! parameter gradients are summed in a fixed order (no atomics).

use super::*;
use crate::{ScanDims, ScanGrads, ScanParams};

/// Rows of 128 threads for the gated norm; `block_sum` wants a multiple of 32.
const NORM_THREADS: u32 = 128;
/// kernels/ssm.cu's limits.
const MAX_STATE: usize = 256;
const MAX_TAPS: usize = 8;
/// Steps a convolution thread walks (CONV_RUN) and its threads a block.
const CONV_RUN: usize = 64;
const CONV_THREADS: usize = 256;
// kernels/ssd_chunk.cu's SSD_Q: the chunks of the saved states are the chunked kernels' chunks.
const _: () = assert!(crate::SCAN_CHUNK == 64);
/// Threads of a chunked scan block (kernels/ssd_chunk.cu: 4 × 4 output patches each).
const CHUNK_THREADS: u32 = 256;

/// Threads of the chunked output and backward blocks: 512, twice `CHUNK_THREADS`, as their shared
/// memory leaves one or two blocks an SM (on an H200 the backward 2.04 → 1.83 ms a layer of the
/// 68M model, session 44; the chunk states, four blocks an SM, were slower at 512).
const BIG_THREADS: u32 = 512;

/// Threads of the chunked kernels' blocks (chunk state, output, backward): `FERROTRON_SSD_THREADS`
/// (a multiple of 128 up to 1024; the kernels loop over whatever they get) sets all three for A/B
/// runs.
fn chunk_threads() -> [u32; 3] {
    static T: std::sync::OnceLock<[u32; 3]> = std::sync::OnceLock::new();
    *T.get_or_init(|| {
        let t = std::env::var("FERROTRON_SSD_THREADS").ok().and_then(|v| v.parse::<u32>().ok());
        match t.filter(|t| t % 128 == 0 && (128..=1024).contains(t)) {
            Some(t) => [t; 3],
            None => [CHUNK_THREADS, BIG_THREADS, BIG_THREADS],
        }
    })
}

/// Shared memory (bytes) of the chunked scan's kernels: (chunk state, chunk output, backward).
fn chunk_smem(dm: &ScanDims) -> (usize, usize, usize) {
    let q = crate::SCAN_CHUNK;
    let (n4, p4) = (dm.state.next_multiple_of(4), dm.head_dim.next_multiple_of(4));
    let state = 4 * q + q * (n4 + p4);
    let out = 3 * q + q * (2 * n4 + p4) + q * q;
    let bwd = 7 * q + 2 * q * (n4 + p4) + 4 * q * q + q * n4 / 4;
    (4 * state, 4 * out, 4 * bwd)
}

/// Shared memory (bytes) of the tensor-core chunk state, output and backward (kernels/ssd_chunk_tc.cu).
fn tc_smem(dm: &ScanDims) -> (usize, usize, usize) {
    let (q, l, n, p) = (crate::SCAN_CHUNK, crate::SCAN_CHUNK + 4, dm.state, dm.head_dim);
    let state = 4 * q + q * (n + 4) + q * (p + 4);
    let out = 3 * q + q * (n + 4) + n * l + q * (p + 4) + q * l;
    let bwd = 7 * q + 2 * p * l + n * l + q * (n + 4) + 4 * q * l + q * n / 32;
    (4 * state, 4 * out, 4 * bwd)
}

/// bf16 scans whose head dim and state are multiples of 32 multiply on tensor cores (TF32) where
/// the backward fits, unless `FERROTRON_SSD_TC=0` keeps the f32 FMAs (A/B runs).
fn tensor_cores(be: &B, dm: &ScanDims, dt: DType) -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let off = *OFF.get_or_init(|| std::env::var("FERROTRON_SSD_TC").as_deref() == Ok("0"));
    !off && dt == DType::BF16 && dm.head_dim % 32 == 0 && dm.state % 32 == 0 && tc_smem(dm).2 + 1024 <= be.smem_optin
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

/// The convolution's kernels for `k` taps: the 4-tap build up to 4 (Mamba's d_conv), the 8-tap one
/// past that, four channels a thread where the channels divide by 4 and the pointers are aligned;
/// one block per (run of `CONV_RUN` steps of a sequence, 256 threads' channels). Returns the kernel
/// name's suffix and the grid.
fn conv_grid(op: &'static str, rows: usize, seq: usize, c: usize, k: usize, args: &[Arg]) -> Result<(String, u32)> {
    if k == 0 || k > MAX_TAPS {
        return Err(Error::NotImplemented { op, device: format!("cuda for {k} taps (1 to {MAX_TAPS})") });
    }
    let v = if c % 4 == 0 && args_aligned16(args) { 4 } else { 1 };
    let blocks = u32::try_from(conv_runs(rows, seq) * (c / v).div_ceil(CONV_THREADS)).map_err(|_| {
        Error::NotImplemented { op, device: format!("cuda for {rows} rows of {c} channels in one call") }
    })?;
    Ok((format!("k{}v{v}", if k <= 4 { 4 } else { 8 }), blocks))
}

/// Runs of `CONV_RUN` steps in `rows` rows of sequences of `seq`.
fn conv_runs(rows: usize, seq: usize) -> usize {
    (rows / seq.max(1)) * seq.div_ceil(CONV_RUN)
}

pub fn conv1d_silu(be: &B, x: &Tensor, w: &Tensor, bias: &Tensor) -> Result<Tensor> {
    let op = "conv1d_silu";
    let (rows, seq, c, k) = conv_dims(x, w);
    let (w, bias) = (in_dtype(w, DType::F32)?, in_dtype(bias, DType::F32)?);
    let y = new(be, x.shape().clone(), x.dtype())?;
    let args = [ptr(op, x)?, ptr(op, &w)?, ptr(op, &bias)?, ptr(op, &y)?, n(seq), n(c), n(k)];
    let (taps, blocks) = conv_grid(op, rows, seq, c, k, &args)?;
    if blocks > 0 {
        be.launch(&format!("conv1d_silu_{taps}_{}", sfx(op, x.dtype())?), blocks, CONV_THREADS as u32, 0, &args)?;
    }
    Ok(y)
}

pub fn conv1d_silu_bwd(be: &B, x: &Tensor, w: &Tensor, bias: &Tensor, dy: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
    let op = "conv1d_silu_bwd";
    let (rows, seq, c, k) = conv_dims(x, w);
    let s = sfx(op, x.dtype())?;
    let (w, bias, dy) = (in_dtype(w, DType::F32)?, in_dtype(bias, DType::F32)?, in_dtype(dy, x.dtype())?);
    let dx = new(be, x.shape().clone(), x.dtype())?;
    let runs = conv_runs(rows, seq);
    let part = new(be, [runs, k + 1, c], DType::F32)?;
    let args =
        [ptr(op, x)?, ptr(op, &w)?, ptr(op, &bias)?, ptr(op, &dy)?, ptr(op, &dx)?, ptr(op, &part)?, n(seq), n(c), n(k)];
    let (taps, blocks) = conv_grid(op, rows, seq, c, k, &args)?;
    if blocks > 0 {
        be.launch(&format!("conv1d_silu_bwd_{taps}_{s}"), blocks, CONV_THREADS as u32, 0, &args)?;
    }
    let (dw, db) = (new(be, [c, k], DType::F32)?, new(be, [c], DType::F32)?);
    ew(be, "conv1d_dw_sum", c * (k + 1), &[ptr(op, &part)?, ptr(op, &dw)?, ptr(op, &db)?, n(c), n(k), n(runs)])?;
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
        let (_, sm_out, _) = chunk_smem(dm);
        let blocks = (dm.batch * dm.heads * dm.chunks()) as u32;
        passed_states(be, op, [xbc, xbc, &dtr, &bias, &a_log], &states, dm, Pass::Forward)?;
        let mut args = vec![ptr(op, xbc)?, ptr(op, &dtr)?, ptr(op, &bias)?, ptr(op, &a_log)?, ptr(op, &d)?];
        args.extend([ptr(op, &states)?, ptr(op, &y)?]);
        args.extend(chunk_sizes(dm));
        if tensor_cores(be, dm, xbc.dtype()) {
            be.launch("ssd_chunk_out_tc_bf16", blocks, chunk_threads()[1], tc_smem(dm).1 as u32, &args)?;
        } else {
            be.launch(&format!("ssd_chunk_out_{s}"), blocks, chunk_threads()[1], sm_out as u32, &args)?;
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

/// Which way `passed_states` carries the chunks' states.
enum Pass {
    /// Mode 0: each chunk's B ⊗ x, passed forward: every chunk's start state.
    Forward,
    /// Mode 1: each chunk's C ⊗ dy, passed in reverse: the gradient of every chunk's end state.
    Reverse,
}

/// Each chunk's own state (`ssd_chunk_state`: on tensor cores where the scan's products are), then
/// `ssd_state_pass` over them in place, into `out` [batch, heads, chunks, state, head dim] (f32).
/// `ins`: xbc, the source of the outer products (xbc again forward, dy in reverse), dt_raw, dt_bias
/// and A_log.
fn passed_states(be: &B, op: &'static str, ins: [&Tensor; 5], out: &Tensor, dm: &ScanDims, pass: Pass) -> Result<()> {
    let chunks = dm.batch * dm.heads * dm.chunks();
    let decay = new(be, [chunks], DType::F32)?;
    let mut args = ins.iter().map(|t| ptr(op, t)).collect::<Result<Vec<_>>>()?;
    args.extend([ptr(op, out)?, ptr(op, &decay)?]);
    args.extend(chunk_sizes(dm));
    args.push(n(matches!(pass, Pass::Reverse) as usize));
    let dt = ins[0].dtype();
    if tensor_cores(be, dm, dt) {
        be.launch("ssd_chunk_state_tc_bf16", chunks as u32, chunk_threads()[0], tc_smem(dm).0 as u32, &args)?;
    } else {
        let name = format!("ssd_chunk_state_{}", sfx("ssd_scan", dt)?);
        be.launch(&name, chunks as u32, chunk_threads()[0], chunk_smem(dm).0 as u32, &args)?;
    }
    state_pass(be, op, out, &decay, dm, matches!(pass, Pass::Reverse))
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
        let (_, _, sm_bwd) = chunk_smem(dm);
        let blocks = (bh * dm.chunks()) as u32;
        let gstates = new(be, states.shape().clone(), DType::F32)?;
        passed_states(be, op, [xbc, &dy, &dtr, &bias, &a_log], &gstates, dm, Pass::Reverse)?;
        let mut args = vec![ptr(op, xbc)?, ptr(op, &dtr)?, ptr(op, &bias)?, ptr(op, &a_log)?, ptr(op, &d)?];
        for t in [states, &gstates, &dy, &dxbc, &ddt, &dbh, &dch, &prm] {
            args.push(ptr(op, t)?);
        }
        args.extend(chunk_sizes(dm));
        if tensor_cores(be, dm, dt) {
            be.launch("ssd_chunk_bwd_tc_bf16", blocks, chunk_threads()[2], tc_smem(dm).2 as u32, &args)?;
        } else {
            be.launch(&format!("ssd_chunk_bwd_{s}"), blocks, chunk_threads()[2], sm_bwd as u32, &args)?;
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
    // Eight state channels a thread where the B and C columns start at multiples of 8.
    let unit = if (dm.heads * dm.head_dim) % 8 == 0 { dm.state } else { 1 };
    ew8(be, &format!("ssd_bc_sum_{s}"), rows * dm.groups * dm.state, unit, &args)?;
    let (gb, ga, gd) =
        (new(be, [dm.heads], DType::F32)?, new(be, [dm.heads], DType::F32)?, new(be, [dm.heads], DType::F32)?);
    let args = [ptr(op, &prm)?, ptr(op, &gb)?, ptr(op, &ga)?, ptr(op, &gd)?, n(dm.batch), n(dm.heads), n(per)];
    be.launch("ssd_prm_sum", dm.heads as u32, 32, 0, &args)?; // a warp per head
    Ok(ScanGrads { dxbc, ddt_raw: ddt, dt_bias: gb, a_log: ga, d: gd })
}

/// The gated norm's eight-channel kernels take groups of up to this many channels (GN_CHUNKS × 256)
/// that divide by 8; a backward block sums the weight gradient over `GN_ROWS` rows.
const GN_MAX_GROUP: usize = 1024;
const GN_ROWS: usize = 64;

/// Whether the eight-channel kernels fit this group size and these pointers.
fn gated_v8(c: usize, groups: usize, args: &[Arg]) -> bool {
    let gsz = c / groups.max(1);
    gsz % 8 == 0 && gsz <= GN_MAX_GROUP && args_aligned16(args)
}

pub fn gated_rmsnorm(be: &B, y: &Tensor, z: &Tensor, w: &Tensor, groups: usize, eps: f64) -> Result<(Tensor, Tensor)> {
    let op = "gated_rmsnorm";
    let (rows, c) = (y.shape().rows(), y.shape().last());
    let (z, w) = (in_dtype(z, y.dtype())?, in_dtype(w, DType::F32)?);
    let out = new(be, y.shape().clone(), y.dtype())?;
    let rstd = new(be, [rows, groups], DType::F32)?;
    let s = sfx(op, y.dtype())?;
    let mut args = vec![ptr(op, y)?, ptr(op, &z)?, ptr(op, &w)?, ptr(op, &out)?, ptr(op, &rstd)?];
    if gated_v8(c, groups, &args) {
        // One warp per (row, group), eight a block.
        args.extend([n(rows), n(c), n(groups), Arg::F32(eps as f32)]);
        be.launch(&format!("gated_rmsnorm_fwd_v8_{s}"), (rows * groups).div_ceil(8) as u32, 256, 0, &args)?;
    } else {
        args.extend([n(c), n(groups), Arg::F32(eps as f32)]);
        be.launch(&format!("gated_rmsnorm_fwd_{s}"), (rows * groups) as u32, NORM_THREADS, 0, &args)?;
    }
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
    let s = sfx(op, y.dtype())?;
    let mut args = vec![ptr(op, &dout)?, ptr(op, y)?, ptr(op, &z)?, ptr(op, &w)?, ptr(op, rstd)?];
    args.extend([ptr(op, &dy)?, ptr(op, &dz)?]);
    // The weight gradient's terms: summed over row blocks (eight-channel kernel) or per element.
    let blocks = rows.div_ceil(GN_ROWS);
    let terms = if gated_v8(c, groups, &args) {
        let part = new(be, [blocks, c], DType::F32)?;
        args.extend([ptr(op, &part)?, n(rows), n(c), n(groups)]);
        be.launch(&format!("gated_rmsnorm_bwd_v8_{s}"), (blocks * groups) as u32, 256, 0, &args)?;
        part
    } else {
        let wterm = new(be, [rows, c], DType::F32)?;
        args.extend([ptr(op, &wterm)?, n(c), n(groups)]);
        be.launch(&format!("gated_rmsnorm_bwd_{s}"), (rows * groups) as u32, NORM_THREADS, 0, &args)?;
        wterm
    };
    Ok((dy, dz, crate::bias_grad(&terms)?))
}
