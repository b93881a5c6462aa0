//! Rotary position embedding on [B, T, H, D] (math in `cpu::rope`).

use crate::{buf, check, cpu};
use ferrotron_core::{Result, Tensor, invalid};

pub use crate::cpu::rope::RopeCfg;

fn validate(op: &'static str, x: &Tensor, cfg: &RopeCfg) -> Result<(usize, usize, usize)> {
    check::float(op, x)?;
    check::rank(op, x, 4)?;
    let d = x.dims();
    if cfg.rot == 0 || cfg.rot % 2 != 0 || cfg.rot > d[3] {
        return Err(invalid(
            op,
            format!("rotary dim {} must be even, non-zero and at most the head dim {}", cfg.rot, d[3]),
        ));
    }
    if cfg.base <= 0.0 || !cfg.base.is_finite() {
        return Err(invalid(op, format!("rotary base {} must be positive", cfg.base)));
    }
    Ok((d[1], d[2], d[3]))
}

pub fn rope_fwd(x: &Tensor, cfg: &RopeCfg) -> Result<Tensor> {
    const OP: &str = "rope_fwd";
    let (t, h, d) = validate(OP, x, cfg)?;
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[x])? {
        return crate::cuda::ops::rope(&g, x, cfg, 1.0);
    }
    check::on_cpu(OP, &[x])?;
    let xv = x.read_f32()?;
    // SAFETY: the rotation writes each head's rotated pairs and copies the rest.
    let mut y = unsafe { buf::uninit(xv.len()) };
    cpu::rope::rope_fwd(&xv, t, h, d, cfg, &mut y);
    check::out(y, x.shape().clone(), x.dtype(), x.device())
}

pub fn rope_bwd(dy: &Tensor, cfg: &RopeCfg) -> Result<Tensor> {
    const OP: &str = "rope_bwd";
    let (t, h, d) = validate(OP, dy, cfg)?;
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[dy])? {
        return crate::cuda::ops::rope(&g, dy, cfg, -1.0);
    }
    check::on_cpu(OP, &[dy])?;
    let dyv = dy.read_f32()?;
    // SAFETY: as rope_fwd.
    let mut dx = unsafe { buf::uninit(dyv.len()) };
    cpu::rope::rope_bwd(&dyv, t, h, d, cfg, &mut dx);
    check::out(dx, dy.shape().clone(), dy.dtype(), dy.device())
}
