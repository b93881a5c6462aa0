//! Matrix products: `matmul` (batched, with transposes), `matmul_into` (write or accumulate into an
//! existing tensor, e.g. a weight gradient into fp32 main_grad) and `matmul_bwd`.
//!
//! Shapes: a [..., m, k] (or [..., k, m] with `ta`), b [..., k, n] (or [..., n, k] with `tb`) with equal
//! batch dims, → [..., m, n]. A 2-D b with an untransposed a of any rank is one big GEMM over all of
//! a's rows (the linear-layer case).

use crate::{check, cpu};
#[cfg(feature = "cuda")]
use ferrotron_core::DType;
use ferrotron_core::{Result, Tensor, shape_mismatch};

#[derive(Debug, Clone, PartialEq)]
struct MmDims {
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
    out: Vec<usize>,
}

fn dims(op: &'static str, a: &Tensor, b: &Tensor, ta: bool, tb: bool) -> Result<MmDims> {
    let (ad, bd) = (a.dims(), b.dims());
    if ad.len() < 2 || bd.len() < 2 {
        return Err(shape_mismatch(op, "both operands of rank >= 2", (ad, bd)));
    }
    let (bk, n) = if tb { (bd[bd.len() - 1], bd[bd.len() - 2]) } else { (bd[bd.len() - 2], bd[bd.len() - 1]) };
    let mismatch = || shape_mismatch(op, format!("a {ad:?} (ta={ta}) and b {bd:?} (tb={tb}) to agree on k"), (ad, bd));
    if bd.len() == 2 && !ta {
        let k = ad[ad.len() - 1];
        if k != bk {
            return Err(mismatch());
        }
        let mut out = ad.to_vec();
        let last = out.len() - 1;
        out[last] = n;
        return Ok(MmDims { batch: 1, m: a.shape().rows(), n, k, out });
    }
    if ad.len() != bd.len() || ad[..ad.len() - 2] != bd[..bd.len() - 2] {
        return Err(shape_mismatch(op, "equal batch dims", (ad, bd)));
    }
    let (m, k) = if ta { (ad[ad.len() - 1], ad[ad.len() - 2]) } else { (ad[ad.len() - 2], ad[ad.len() - 1]) };
    if k != bk {
        return Err(mismatch());
    }
    let batch = ad[..ad.len() - 2].iter().product();
    let mut out = ad[..ad.len() - 2].to_vec();
    out.extend([m, n]);
    Ok(MmDims { batch, m, n, k, out })
}

/// op(a) · op(b), in a's dtype.
pub fn matmul(a: &Tensor, b: &Tensor, ta: bool, tb: bool) -> Result<Tensor> {
    const OP: &str = "matmul";
    check::float(OP, a)?;
    check::same_dtype(OP, a, b)?;
    let d = dims(OP, a, b, ta, tb)?;
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[a, b])? {
        // Uncleared: with beta = 0 the GEMM writes every element without reading C.
        let c = crate::cuda::ops::new(&g, d.out.clone(), a.dtype())?;
        crate::cuda::ops::gemm(&g, a, b, &c, d.batch, d.m, d.n, d.k, ta, tb, 0.0, None)?;
        return Ok(c);
    }
    check::on_cpu(OP, &[a, b])?;
    let (av, bv) = (a.read_f32()?, b.read_f32()?);
    let c = cpu::matmul::gemm_batched_new(d.batch, d.m, d.n, d.k, &av, ta, &bv, tb, 1.0);
    check::out(c, d.out, a.dtype(), a.device())
}

/// op(a)·op(b) + bias (bias [n], one per output column), in a's dtype: the linear layer. On CUDA
/// the bias is fused into cuBLASLt's epilogue for bf16.
pub fn matmul_bias(a: &Tensor, b: &Tensor, bias: &Tensor, ta: bool, tb: bool) -> Result<Tensor> {
    const OP: &str = "matmul_bias";
    check::float(OP, a)?;
    check::same_dtype(OP, a, b)?;
    check::same_dtype(OP, a, bias)?;
    let d = dims(OP, a, b, ta, tb)?;
    check::shape(OP, bias, &[d.n])?;
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[a, b, bias])? {
        if d.batch == 1 {
            let c = crate::cuda::ops::new(&g, d.out.clone(), a.dtype())?;
            crate::cuda::ops::gemm(&g, a, b, &c, 1, d.m, d.n, d.k, ta, tb, 0.0, Some(bias))?;
            return Ok(c);
        }
    }
    check::on_cpu(OP, &[a, b, bias])?;
    // Bias added in f32 before the single rounding to a's dtype, exactly as the fused epilogue does.
    let (av, bv, biasv) = (a.read_f32()?, b.read_f32()?, bias.read_f32()?);
    let mut c = cpu::matmul::gemm_batched_new(d.batch, d.m, d.n, d.k, &av, ta, &bv, tb, 1.0);
    {
        use rayon::prelude::*;
        // Rows in parallel (each row's sums are independent: same bits on any thread count).
        c.par_chunks_mut(d.n.max(1) * 64).for_each(|rows| {
            for row in rows.chunks_mut(d.n.max(1)) {
                row.iter_mut().zip(biasv.iter()).for_each(|(y, b)| *y += b);
            }
        });
    }
    check::out(c, d.out, a.dtype(), a.device())
}

/// The MLP's first linear layer with its GeLU: returns (gelu(h), h) with h = x·wᵀ + bias (x
/// [..., k], w [n, k], bias [n]). On a GPU in bf16 one cuBLASLt GEMM with the GeLU in its
/// epilogue (h kept as its aux output for `matmul_dgelu`); elsewhere the two ops.
pub fn linear_gelu(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<(Tensor, Tensor)> {
    const OP: &str = "linear_gelu";
    check::float(OP, x)?;
    check::same_dtype(OP, x, w)?;
    let d = dims(OP, x, w, false, true)?;
    if let Some(b) = bias {
        check::same_dtype(OP, x, b)?;
        check::shape(OP, b, &[d.n])?;
    }
    #[cfg(feature = "cuda")]
    if x.dtype() == DType::BF16 && d.batch == 1 {
        let mut all = vec![x, w];
        all.extend(bias);
        if let Some(g) = crate::cuda::gpu(OP, &all)? {
            if let Some(r) = crate::cuda::ops::linear_gelu(&g, x, w, bias, (d.m, d.n, d.k), d.out.clone())? {
                return Ok(r);
            }
        }
    }
    let h = match bias {
        Some(b) => matmul_bias(x, w, b, false, true)?,
        None => matmul(x, w, false, true)?,
    };
    Ok((crate::gelu(&h)?, h))
}

/// The GeLU backward fused into the product before it: gelu_bwd(h, dy·w) (dy [..., k], w [k, n],
/// h [..., n] from `linear_gelu`). On a GPU in bf16 one cuBLASLt GEMM with the GeLU gradient in
/// its epilogue; elsewhere the two ops.
pub fn matmul_dgelu(dy: &Tensor, w: &Tensor, h: &Tensor) -> Result<Tensor> {
    const OP: &str = "matmul_dgelu";
    check::float(OP, dy)?;
    check::same_dtype(OP, dy, w)?;
    check::same_dtype(OP, dy, h)?;
    let d = dims(OP, dy, w, false, false)?;
    check::shape(OP, h, &d.out)?;
    #[cfg(feature = "cuda")]
    if dy.dtype() == DType::BF16 && d.batch == 1 {
        if let Some(g) = crate::cuda::gpu(OP, &[dy, w, h])? {
            if let Some(r) = crate::cuda::ops::matmul_dgelu(&g, dy, w, h, (d.m, d.n, d.k))? {
                return Ok(r);
            }
        }
    }
    crate::gelu_bwd(h, &matmul(dy, w, false, false)?)
}

/// c = op(a)·op(b), or c += op(a)·op(b) when `accumulate`. c may have a wider dtype than a and b.
pub fn matmul_into(c: &Tensor, a: &Tensor, b: &Tensor, ta: bool, tb: bool, accumulate: bool) -> Result<()> {
    const OP: &str = "matmul_into";
    check::float(OP, a)?;
    check::same_dtype(OP, a, b)?;
    check::float(OP, c)?;
    let d = dims(OP, a, b, ta, tb)?;
    if c.elem_count() != d.batch * d.m * d.n {
        return Err(shape_mismatch(OP, &d.out, c.dims()));
    }
    if c.shares_storage(a) || c.shares_storage(b) {
        return Err(ferrotron_core::invalid(OP, "the output must not share storage with an input"));
    }
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[a, b, c])? {
        let beta = if accumulate { 1.0 } else { 0.0 };
        if c.dtype() == a.dtype() {
            return crate::cuda::ops::gemm(&g, a, b, c, d.batch, d.m, d.n, d.k, ta, tb, beta, None);
        }
        if a.dtype() == DType::BF16 && c.dtype() == DType::F32 {
            // bf16 operands straight into an f32 output (main_grad) with fp32 accumulation.
            return crate::cuda::ops::gemm_bf16_into_f32(&g, a, b, c, d.batch, d.m, d.n, d.k, ta, tb, beta);
        }
        return Err(ferrotron_core::Error::NotImplemented {
            op: OP,
            device: format!("cuda for {} operands into {}", a.dtype(), c.dtype()),
        });
    }
    check::on_cpu(OP, &[a, b, c])?;
    let (av, bv) = (a.read_f32()?, b.read_f32()?);
    c.update_f32(OP, |cv| cpu::matmul::gemm_batched(d.batch, d.m, d.n, d.k, &av, ta, &bv, tb, cv, accumulate, 1.0))
}

/// Gradients (da, db) of c = op(a)·op(b) given dc, shaped like a and b.
pub fn matmul_bwd(a: &Tensor, b: &Tensor, dc: &Tensor, ta: bool, tb: bool) -> Result<(Tensor, Tensor)> {
    const OP: &str = "matmul_bwd";
    check::float(OP, a)?;
    check::same_dtype(OP, a, b)?;
    let d = dims(OP, a, b, ta, tb)?;
    check::shape(OP, dc, &d.out)?;
    #[cfg(feature = "cuda")]
    if crate::cuda::gpu(OP, &[a, b, dc])?.is_some() {
        // dA = dC·op(B)ᵀ (stored transposed when ta), dB = op(A)ᵀ·dC (stored transposed when tb).
        // A 2-D b shared by all of a's rows: fold the batch into rows so dB sums over it.
        let (a2, dc2) = if b.shape().rank() == 2 && !ta {
            (a.reshape([d.m, d.k])?, dc.reshape([d.m, d.n])?)
        } else {
            (a.clone(), dc.clone())
        };
        let da = if ta { matmul(b, &dc2, tb, true)? } else { matmul(&dc2, b, false, !tb)? };
        let db = if tb { matmul(&dc2, &a2, true, ta)? } else { matmul(&a2, &dc2, !ta, false)? };
        return Ok((da.reshape(a.shape().clone())?, db.reshape(b.shape().clone())?));
    }
    check::on_cpu(OP, &[a, b, dc])?;
    let (av, bv, dcv) = (a.read_f32()?, b.read_f32()?, dc.read_f32()?);
    let mut da = vec![0f32; a.elem_count()];
    let mut db = vec![0f32; b.elem_count()];
    cpu::matmul::gemm_bwd(d.batch, d.m, d.n, d.k, &av, ta, &bv, tb, &dcv, Some(&mut da), Some(&mut db), false);
    Ok((
        check::out(da, a.shape().clone(), a.dtype(), a.device())?,
        check::out(db, b.shape().clone(), b.dtype(), b.device())?,
    ))
}
