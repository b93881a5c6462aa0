//! In-place optimizer ops over flat fp32 buffers: AdamW, squared norms and scaling.

use crate::{check, cpu};
use ferrotron_core::{DType, Result, Tensor, invalid};

pub use crate::cpu::optim::AdamW;

/// One AdamW step on param/m/v (f32, updated in place) from grad (f32), all the same shape.
pub fn adamw_step(param: &Tensor, grad: &Tensor, m: &Tensor, v: &Tensor, h: &AdamW) -> Result<()> {
    const OP: &str = "adamw_step";
    for t in [param, grad, m, v] {
        check::dtype(OP, t, DType::F32)?;
        check::shape(OP, t, param.dims())?;
    }
    if h.step == 0 {
        return Err(invalid(OP, "step counts from 1"));
    }
    let distinct = [param, grad, m, v]
        .iter()
        .enumerate()
        .all(|(i, a)| [param, grad, m, v][i + 1..].iter().all(|b| !a.shares_storage(b)));
    if !distinct {
        return Err(invalid(OP, "param, grad, m and v must be distinct buffers"));
    }
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[param, grad, m, v])? {
        return crate::cuda::ops::adamw(&g, param, grad, m, v, h);
    }
    check::on_cpu(OP, &[param, grad, m, v])?;
    let g = grad.read_f32()?;
    param.update_f32(OP, |p| {
        m.update_f32(OP, |mm| v.update_f32(OP, |vv| cpu::optim::adamw_step(p, &g, mm, vv, h)))
    })???;
    Ok(())
}

/// Σ x² in f64 (deterministic order).
pub fn sum_sq(x: &Tensor) -> Result<f64> {
    sum_sq_all(&[x])
}

/// Σ over tensors of Σ x², tensor by tensor in order (the same bits as adding their `sum_sq`s),
/// with one read back from the device for all of them.
pub fn sum_sq_all(ts: &[&Tensor]) -> Result<f64> {
    const OP: &str = "sum_sq_all";
    for t in ts {
        check::float(OP, t)?;
    }
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, ts)? {
        return crate::cuda::ops::sum_sq_all(&g, ts);
    }
    check::on_cpu(OP, ts)?;
    let mut total = 0.0;
    for t in ts {
        total += cpu::optim::sum_sq(&t.read_f32()?);
    }
    Ok(total)
}

/// √(Σ over tensors of Σ x²), the global L2 norm used for gradient clipping.
pub fn global_l2_norm(ts: &[&Tensor]) -> Result<f64> {
    Ok(sum_sq_all(ts)?.sqrt())
}
