//! Rotary position embedding on [B, T, H, D], or in place on the query and key heads of a fused
//! QKV tensor [B, T, Hkv·(G+2)·D] (math in `cpu::rope`).

use crate::{buf, check, cpu};
use ferrotron_core::{Result, Tensor, invalid, shape_mismatch};

pub use crate::cpu::rope::{RopeCfg, RopeScaling, RopeSplit, Yarn};

fn validate(op: &'static str, x: &Tensor, cfg: &RopeCfg) -> Result<(usize, usize, usize)> {
    check::float(op, x)?;
    check::rank(op, x, 4)?;
    let d = x.dims();
    validate_cfg(op, cfg, d[3])?;
    Ok((d[1], d[2], d[3]))
}

fn validate_cfg(op: &'static str, cfg: &RopeCfg, head_dim: usize) -> Result<()> {
    if cfg.rot == 0 || cfg.rot % 2 != 0 || cfg.rot > head_dim {
        return Err(invalid(
            op,
            format!("rotary dim {} must be even, non-zero and at most the head dim {head_dim}", cfg.rot),
        ));
    }
    if cfg.base <= 0.0 || !cfg.base.is_finite() {
        return Err(invalid(op, format!("rotary base {} must be positive", cfg.base)));
    }
    if let Some(problem) = cfg.scaling.and_then(|s| s.problem()).or_else(|| cfg.yarn.and_then(|y| y.problem())) {
        return Err(invalid(op, problem));
    }
    if let Some(s) = cfg.interpolation.filter(|s| !(s.is_finite() && *s > 0.0)) {
        return Err(invalid(op, format!("position interpolation factor {s} must be positive")));
    }
    if cfg.scaling.is_some() && cfg.yarn.is_some() {
        return Err(invalid(op, "Llama 3's scaling and YaRN both rescale the frequencies: keep one"));
    }
    Ok(())
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

/// RoPE in place on the query and key heads of fused QKV [B, T, hkv·(group+2)·d] (Megatron's
/// grouped layout: each group's `group` query heads, its key head, its value head); the value
/// heads are left as they are. Equal to `qkv_split`, `rope_fwd` on q and k, `qkv_merge`, without
/// the copies, so the core attention can then read Q, K and V in place.
pub fn rope_qkv_fwd_(qkv: &Tensor, hkv: usize, group: usize, d: usize, cfg: &RopeCfg) -> Result<()> {
    rope_qkv_("rope_qkv_fwd_", qkv, (hkv, group, d), cfg, 1.0)
}

/// The gradient of [`rope_qkv_fwd_`], in place on dQKV (the rotation by −θ of its query and key
/// heads).
pub fn rope_qkv_bwd_(dqkv: &Tensor, hkv: usize, group: usize, d: usize, cfg: &RopeCfg) -> Result<()> {
    rope_qkv_("rope_qkv_bwd_", dqkv, (hkv, group, d), cfg, -1.0)
}

fn rope_qkv_(op: &'static str, x: &Tensor, (hkv, g, d): (usize, usize, usize), cfg: &RopeCfg, sign: f32) -> Result<()> {
    check::float(op, x)?;
    check::rank(op, x, 3)?;
    let w = hkv * (g + 2) * d;
    if x.dims()[2] != w {
        return Err(shape_mismatch(op, format!("last dim {hkv}·({g}+2)·{d} = {w}"), x.dims()));
    }
    validate_cfg(op, cfg, d)?;
    let t = x.dims()[1];
    #[cfg(feature = "cuda")]
    if let Some(gpu) = crate::cuda::gpu(op, &[x])? {
        return crate::cuda::ops::rope_qkv_(&gpu, x, (hkv, g, d), cfg, sign);
    }
    check::on_cpu(op, &[x])?;
    x.update_f32(op, |v| cpu::rope::rope_qkv_(v, t, hkv, g, d, cfg, sign))
}
