//! QKV split/merge between the fused projection [..., Hkv·(G+2)·D] and per-head q/k/v
//! [..., heads, D] (Megatron's grouped layout; see `cpu::qkv`).

use crate::{buf, check, cpu};
use ferrotron_core::{Result, Tensor, shape_mismatch};

/// x [B, T, Hkv·(G+2)·D] → (q [B, T, Hkv·G, D], k [B, T, Hkv, D], v [B, T, Hkv, D]).
pub fn qkv_split(x: &Tensor, hkv: usize, group: usize, d: usize) -> Result<(Tensor, Tensor, Tensor)> {
    const OP: &str = "qkv_split";
    check::float(OP, x)?;
    check::rank(OP, x, 3)?;
    let (b, t, w) = (x.dims()[0], x.dims()[1], x.dims()[2]);
    if w != hkv * (group + 2) * d {
        return Err(shape_mismatch(
            OP,
            format!("last dim {}·({}+2)·{} = {}", hkv, group, d, hkv * (group + 2) * d),
            x.dims(),
        ));
    }
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[x])? {
        return crate::cuda::ops::qkv_split(&g, x, hkv, group, d);
    }
    check::on_cpu(OP, &[x])?;
    let xv = x.read_f32()?;
    let n = b * t;
    // SAFETY: qkv_split copies every row's q, k and v segments.
    let (mut q, mut k, mut v) =
        unsafe { (buf::uninit(n * hkv * group * d), buf::uninit(n * hkv * d), buf::uninit(n * hkv * d)) };
    cpu::qkv::qkv_split(&xv, hkv, group, d, &mut q, &mut k, &mut v);
    let (dt, dev) = (x.dtype(), x.device());
    Ok((
        check::out(q, [b, t, hkv * group, d], dt, dev)?,
        check::out(k, [b, t, hkv, d], dt, dev)?,
        check::out(v, [b, t, hkv, d], dt, dev)?,
    ))
}

/// The inverse of `qkv_split` (used for the gradient).
pub fn qkv_merge(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
    const OP: &str = "qkv_merge";
    check::float(OP, q)?;
    check::rank(OP, q, 4)?;
    check::rank(OP, k, 4)?;
    let (b, t, hq, d) = (q.dims()[0], q.dims()[1], q.dims()[2], q.dims()[3]);
    let hkv = k.dims()[2];
    if hkv == 0 || hq % hkv != 0 {
        return Err(shape_mismatch(OP, "query heads a multiple of kv heads", (q.dims(), k.dims())));
    }
    check::shape(OP, k, &[b, t, hkv, d])?;
    check::shape(OP, v, &[b, t, hkv, d])?;
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[q, k, v])? {
        return crate::cuda::ops::qkv_merge(&g, q, k, v);
    }
    check::on_cpu(OP, &[q, k, v])?;
    let g = hq / hkv;
    let (qv, kv, vv) = (q.read_f32()?, k.read_f32()?, v.read_f32()?);
    // SAFETY: qkv_merge copies into every segment of every row.
    let mut x = unsafe { buf::uninit(b * t * hkv * (g + 2) * d) };
    cpu::qkv::qkv_merge(&qv, &kv, &vv, hkv, g, d, &mut x);
    check::out(x, [b, t, hkv * (g + 2) * d], q.dtype(), q.device())
}
