//! AdamW and the sum of squares behind the global grad norm.

use super::*;
use cudarc::driver::{CudaSlice, DevicePtr};

/// The hyperparameter arguments the AdamW kernels end with (kernels/optim.cu `AdamH`): the bias
/// corrections folded into the step size and the second moment's divisor.
fn adam_hyper(h: &crate::AdamW) -> [Arg; 7] {
    let bc1 = 1.0 - (h.beta1 as f64).powi(h.step as i32);
    let bc2 = 1.0 - (h.beta2 as f64).powi(h.step as i32);
    [
        Arg::F32(h.beta1),
        Arg::F32(h.beta2),
        Arg::F32(h.eps),
        Arg::F32((h.lr as f64 / bc1) as f32),
        Arg::F32(bc2.sqrt() as f32),
        Arg::F32(1.0 - h.lr * h.weight_decay),
        Arg::F32(h.grad_scale),
    ]
}

pub fn adamw(be: &B, p: &Tensor, g: &Tensor, m: &Tensor, v: &Tensor, h: &crate::AdamW) -> Result<()> {
    let len = p.elem_count();
    let mut args = vec![ptr("adamw", p)?, ptr("adamw", g)?, ptr("adamw", m)?, ptr("adamw", v)?, n(len)];
    args.extend(adam_hyper(h));
    ew(be, "adamw", len, &args)
}

/// `adamw_runs`'s tensors: master weights, moments, gradients, parameters and the optional step
/// state (`adam_state`).
pub struct AdamTensors<'a> {
    pub p: &'a Tensor,
    pub m: &'a Tensor,
    pub v: &'a Tensor,
    pub g: &'a Tensor,
    pub params: &'a Tensor,
    pub state: Option<&'a Tensor>,
}

/// `adamw` over the runs in `table` (kernels/optim.cu `adamw_runs_*`, one block per chunk), writing
/// params too; with a state, its clip factor, bias corrections, decay and skip flag instead of `h`'s.
pub fn adamw_runs(be: &B, x: &AdamTensors, table: &Tensor, chunks: usize, h: &crate::AdamW) -> Result<()> {
    let op = "adamw_runs";
    let mut args = vec![ptr(op, x.p)?, ptr(op, x.g)?, ptr(op, x.m)?, ptr(op, x.v)?, ptr(op, x.params)?];
    args.extend([ptr(op, table)?, n(table.elem_count() / 8)]);
    args.push(match x.state {
        Some(s) => ptr(op, s)?,
        None => Arg::Ptr(0),
    });
    // Without a state `h.step` counts from 1 (checked by the caller); with one it is unused.
    args.extend(adam_hyper(&crate::AdamW { step: h.step.max(1), ..*h }));
    let (ps, gs) = (sfx_storage(op, x.params.dtype())?, sfx(op, x.g.dtype())?);
    // f32 moments keep the short name; a bf16 one names both (kernels/optim.cu).
    let moments = match (x.m.dtype(), x.v.dtype()) {
        (DType::F32, DType::F32) => String::new(),
        (m, v) => format!("_m{}_v{}", sfx(op, m)?, sfx(op, v)?),
    };
    be.launch(&format!("adamw_runs_{ps}_g{gs}{moments}"), chunks as u32, 256, 0, &args)
}

/// `sgd_runs`'s tensors: master weights, momentum buffer, gradients, parameters and the optional
/// step state (`adam_state`).
pub struct SgdTensors<'a> {
    pub p: &'a Tensor,
    pub buf: &'a Tensor,
    pub g: &'a Tensor,
    pub params: &'a Tensor,
    pub state: Option<&'a Tensor>,
}

/// SGD over the runs in `table` (kernels/optim.cu `sgd_runs_*`, one block per chunk, the run
/// table `adamw_runs`'), writing params too.
pub fn sgd_runs(be: &B, x: &SgdTensors, table: &Tensor, chunks: usize, h: &crate::Sgd) -> Result<()> {
    let op = "sgd_runs";
    let mut args = vec![ptr(op, x.p)?, ptr(op, x.g)?, ptr(op, x.buf)?, ptr(op, x.params)?];
    args.extend([ptr(op, table)?, n(table.elem_count() / 8)]);
    args.push(match x.state {
        Some(s) => ptr(op, s)?,
        None => Arg::Ptr(0),
    });
    args.extend([Arg::F32(h.momentum), Arg::F32(h.lr), Arg::F32(h.weight_decay), Arg::F32(h.grad_scale)]);
    let (ps, gs) = (sfx_storage(op, x.params.dtype())?, sfx(op, x.g.dtype())?);
    be.launch(&format!("sgd_runs_{ps}_g{gs}"), chunks as u32, 256, 0, &args)
}

/// Σ x² of every tensor into a one-element f32 tensor on the device: `sum_sq_all`'s partials,
/// then one block adding them in a fixed order (kernels/optim.cu `sum_partials_f32`). Nothing is
/// read back.
pub fn sum_sq_dev(be: &B, xs: &[&Tensor]) -> Result<Tensor> {
    partials_dev(be, xs, "sum_sq")
}

/// The count of zero elements of every tensor into a one-element f32 tensor on the device, as
/// `sum_sq_dev` sums squares (kernels/optim.cu `count_zeros_*`: exact f64 partials).
pub fn count_zeros_dev(be: &B, xs: &[&Tensor]) -> Result<Tensor> {
    partials_dev(be, xs, "count_zeros")
}

/// `kernel`'s per-block f64 partials of every tensor, then one block adding them in a fixed order
/// into a one-element f32 tensor (kernels/optim.cu `sum_partials_f32`).
fn partials_dev(be: &B, xs: &[&Tensor], kernel: &'static str) -> Result<Tensor> {
    let out = new(be, [1], DType::F32)?;
    let parts = partials(be, xs, kernel)?;
    let base = parts.device_ptr(be.dev.stream()).0;
    be.launch("sum_partials_f32", 1, 256, 0, &[Arg::Ptr(base), n(parts.len()), ptr(kernel, &out)?])?;
    Ok(out)
}

pub fn adam_prepare(be: &B, sq: &Tensor, state: &Tensor, p: &crate::AdamPrep) -> Result<()> {
    let op = "adam_prepare";
    let args = [ptr(op, sq)?, ptr(op, state)?, Arg::F32(p.beta1), Arg::F32(p.beta2), Arg::F32(p.clip_grad)];
    be.launch(op, 1, 32, 0, &args)
}

/// Σ x² of every tensor: BLOCKS fixed per-block partials each, in one buffer, one copy back, then
/// summed on the host tensor by tensor in block order (deterministic; the bits of adding
/// one-tensor sums in order). Eight elements per thread where a tensor allows (`_v8`).
pub fn sum_sq_all(be: &B, xs: &[&Tensor]) -> Result<f64> {
    let partial = partials(be, xs, "sum_sq")?;
    let host = be.dev.stream().clone_dtoh(&partial).map_err(|e| Error::Cuda(format!("{e:?}")))?;
    Ok(host.chunks(SUM_SQ_BLOCKS).fold(0.0, |total, c| total + c.iter().sum::<f64>()))
}

/// Enough 256-thread blocks to keep the loads in flight across the GPU (256 ran at 2 TB/s).
const SUM_SQ_BLOCKS: usize = 1024;

/// SUM_SQ_BLOCKS f64 partials per tensor of `kernel` (`sum_sq`: Σ x²; `count_zeros`), tensor by
/// tensor (at least one zero partial when there is no tensor).
fn partials(be: &B, xs: &[&Tensor], kernel: &'static str) -> Result<CudaSlice<f64>> {
    let partial: CudaSlice<f64> =
        be.dev.stream().alloc_zeros(SUM_SQ_BLOCKS * xs.len().max(1)).map_err(|e| Error::Cuda(format!("{e:?}")))?;
    let base = partial.device_ptr(be.dev.stream()).0;
    for (i, x) in xs.iter().enumerate() {
        let pp = Arg::Ptr(base + (i * SUM_SQ_BLOCKS * std::mem::size_of::<f64>()) as u64);
        let args = [ptr(kernel, x)?, pp, n(x.elem_count())];
        let v8 = if x.elem_count() % 8 == 0 && args_aligned16(&args) { "_v8" } else { "" };
        be.launch(&format!("{kernel}_{}{v8}", sfx(kernel, x.dtype())?), SUM_SQ_BLOCKS as u32, 256, 0, &args)?;
    }
    Ok(partial)
}
