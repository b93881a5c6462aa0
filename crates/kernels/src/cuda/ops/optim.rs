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

/// `adamw` over the runs in `table` (kernels/optim.cu `adamw_runs_*`, one block per chunk), writing
/// params too.
#[allow(clippy::too_many_arguments)]
pub fn adamw_runs(
    be: &B,
    p: &Tensor,
    m: &Tensor,
    v: &Tensor,
    g: &Tensor,
    params: &Tensor,
    table: &Tensor,
    chunks: usize,
    h: &crate::AdamW,
) -> Result<()> {
    let op = "adamw_runs";
    let mut args = vec![ptr(op, p)?, ptr(op, g)?, ptr(op, m)?, ptr(op, v)?, ptr(op, params)?, ptr(op, table)?];
    args.push(n(table.elem_count() / 8));
    args.extend(adam_hyper(h));
    be.launch(&format!("adamw_runs_{}", sfx_storage(op, params.dtype())?), chunks as u32, 256, 0, &args)
}

/// Σ x² of every tensor: BLOCKS fixed per-block partials each, in one buffer, one copy back, then
/// summed on the host tensor by tensor in block order (deterministic; the bits of adding
/// one-tensor sums in order). Eight elements per thread where a tensor allows (`_v8`).
pub fn sum_sq_all(be: &B, xs: &[&Tensor]) -> Result<f64> {
    // Enough 256-thread blocks to keep the loads in flight across the GPU (256 ran at 2 TB/s).
    const BLOCKS: usize = 1024;
    if xs.is_empty() {
        return Ok(0.0);
    }
    let partial: CudaSlice<f64> =
        be.dev.stream().alloc_zeros(BLOCKS * xs.len()).map_err(|e| Error::Cuda(format!("{e:?}")))?;
    let base = partial.device_ptr(be.dev.stream()).0;
    for (i, x) in xs.iter().enumerate() {
        let pp = Arg::Ptr(base + (i * BLOCKS * std::mem::size_of::<f64>()) as u64);
        let args = [ptr("sum_sq", x)?, pp, n(x.elem_count())];
        let v8 = if x.elem_count() % 8 == 0 && args_aligned16(&args) { "_v8" } else { "" };
        be.launch(&format!("sum_sq_{}{v8}", sfx("sum_sq", x.dtype())?), BLOCKS as u32, 256, 0, &args)?;
    }
    let host = be.dev.stream().clone_dtoh(&partial).map_err(|e| Error::Cuda(format!("{e:?}")))?;
    Ok(host.chunks(BLOCKS).fold(0.0, |total, c| total + c.iter().sum::<f64>()))
}
