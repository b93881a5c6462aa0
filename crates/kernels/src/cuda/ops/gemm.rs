//! GEMMs: cuBLAS f32, cuBLASLt bf16 (cuda/lt.rs) with its epilogues, bf16 into fp32 main_grad.

use super::*;
use cudarc::cublas::{Gemm, GemmConfig, StridedBatchedConfig, sys::cublasOperation_t as Op};
use cudarc::cublaslt::MatmulConfig;
use ferrotron_core::cuda::CudaStorage;

/// C (+)= op(A)·op(B) with cuBLAS (f32) or cuBLASLt (bf16), row-major, via the column-major identity Cᵀ = op(B)ᵀ·op(A)ᵀ.
#[allow(clippy::too_many_arguments)]
pub fn gemm(
    be: &B,
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    batch: usize,
    m: usize,
    nn: usize,
    k: usize,
    ta: bool,
    tb: bool,
    beta: f32,
    bias: Option<&Tensor>,
) -> Result<()> {
    let cfg = lt_cfg(batch, m, nn, k, ta, tb, beta);
    let (ga, gb) = (a.storage(), b.storage());
    let mut gc = c.storage_mut();
    let ra = a.layout().contiguous_range().ok_or(Error::NotContiguous { op: "matmul" })?;
    let rb = b.layout().contiguous_range().ok_or(Error::NotContiguous { op: "matmul" })?;
    let rc = c.layout().contiguous_range().ok_or(Error::NotContiguous { op: "matmul" })?;
    match (&*ga, &*gb, &mut *gc) {
        (
            Storage::Cuda(CudaStorage::F32(x)),
            Storage::Cuda(CudaStorage::F32(y)),
            Storage::Cuda(CudaStorage::F32(z)),
        ) => {
            let op = |t: bool| if t { Op::CUBLAS_OP_T } else { Op::CUBLAS_OP_N };
            let g = GemmConfig {
                transa: op(cfg.transa),
                transb: op(cfg.transb),
                m: cfg.m as i32,
                n: cfg.n as i32,
                k: cfg.k as i32,
                alpha: 1.0f32,
                lda: cfg.lda as i32,
                ldb: cfg.ldb as i32,
                beta,
                ldc: cfg.ldc as i32,
            };
            let sb = StridedBatchedConfig {
                gemm: g,
                batch_size: batch as i32,
                stride_a: (k * nn) as i64,
                stride_b: (m * k) as i64,
                stride_c: (m * nn) as i64,
            };
            // SAFETY: the views cover exactly the shapes described by the config (validated by the caller).
            unsafe { be.blas.gemm_strided_batched(sb, &y.slice(rb), &x.slice(ra), &mut z.slice_mut(rc)) }
                .map_err(|e| Error::Cuda(format!("cuBLAS sgemm: {e:?}")))?;
            if let Some(bias) = bias {
                drop((ga, gb, gc));
                // cuBLAS has no bias epilogue: add it in place.
                ew(
                    be,
                    "bias_add_f32",
                    c.elem_count(),
                    &[
                        ptr("matmul_bias", c)?,
                        ptr("matmul_bias", bias)?,
                        ptr("matmul_bias", c)?,
                        n(c.elem_count()),
                        n(nn),
                    ],
                )?;
            }
            Ok(())
        }
        (
            Storage::Cuda(CudaStorage::BF16(_)),
            Storage::Cuda(CudaStorage::BF16(_)),
            Storage::Cuda(CudaStorage::BF16(_)),
        ) => {
            drop((ga, gb, gc));
            if batch == 1 && !ta && beta == 0.0 && crate::cuda::own_gemm_plain() {
                // Our kernel where it takes the product (with the bias in its epilogue when aligned).
                let pb = match bias {
                    Some(t) if t.dtype() == DType::BF16 && bias_aligned(t)? => Some(raw("matmul_bias", t)?),
                    Some(_) => None,
                    None => Some(0),
                };
                let io = (raw("matmul", a)?, raw("matmul", b)?, raw("matmul", c)?, 0, pb.unwrap_or(0));
                if pb.is_some() && gemm_ws::fits(be, (m, nn, k), &[io.0, io.1, io.2, io.4]) {
                    gemm_ws::launch(be, gemm_ws::Epi::Plain, io, tb, (m, nn, k))?;
                    crate::cuda::count_own_gemm_run();
                    return Ok(());
                }
            }
            // The bias rides in cuBLASLt's epilogue (one per output feature: the rows of Cᵀ) when
            // it is 16-byte aligned; a bias elsewhere (a view after an odd-sized parameter in the
            // flat buffer) is added in place after the product.
            let (epi, after) = match bias {
                Some(t) if t.dtype() == DType::BF16 && bias_aligned(t)? => {
                    (crate::cuda::lt::Epilogue::Bias(raw("matmul_bias", t)?), None)
                }
                Some(t) if t.dtype() == DType::BF16 => (crate::cuda::lt::Epilogue::None, Some(t)),
                Some(_) => {
                    return Err(Error::NotImplemented {
                        op: "matmul_bias",
                        device: "cuda with a non-bf16 bias".into(),
                    });
                }
                None => (crate::cuda::lt::Epilogue::None, None),
            };
            // SAFETY: the tensors are contiguous bf16 of the shapes `cfg` describes (validated by
            // the caller); the bias has `nn` elements.
            unsafe { crate::cuda::lt::matmul(be, &cfg, raw("matmul", b)?, raw("matmul", a)?, raw("matmul", c)?, epi)? };
            if let Some(t) = after {
                let len = c.elem_count();
                let args = [ptr("matmul_bias", c)?, ptr("matmul_bias", t)?, ptr("matmul_bias", c)?, n(len), n(nn)];
                ew8(be, "bias_add_bf16", len, nn, &args)?;
            }
            Ok(())
        }
        _ => Err(Error::NotImplemented {
            op: "matmul",
            device: format!("cuda for {} x {} -> {}", a.dtype(), b.dtype(), c.dtype()),
        }),
    }
}

/// C (+)= op(A)·op(B) for bf16 A, B and an f32 C (the weight gradient straight into fp32 main_grad,
/// Megatron's gradient-accumulation fusion), on cuBLASLt (its algorithm cached, and timed on
/// request, like the bf16 products'), else cublasGemmStridedBatchedEx with fp32 compute.
#[allow(clippy::too_many_arguments)]
pub fn gemm_bf16_into_f32(
    be: &B,
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    batch: usize,
    m: usize,
    nn: usize,
    k: usize,
    ta: bool,
    tb: bool,
    beta: f32,
) -> Result<()> {
    use cudarc::cublas::sys;
    let (pa, pb, pc) = (raw("matmul_into", a)?, raw("matmul_into", b)?, raw("matmul_into", c)?);
    let cfg = lt_cfg(batch, m, nn, k, ta, tb, beta);
    // SAFETY: pointers come from live tensors whose shapes the caller validated against (m, n, k, batch).
    match unsafe { crate::cuda::lt::matmul_into_f32(be, &cfg, pb, pa, pc) } {
        Err(e) if crate::cuda::lt::unsupported(&e) => {}
        r => return r,
    }
    let op = |t: bool| if t { Op::CUBLAS_OP_T } else { Op::CUBLAS_OP_N };
    let alpha = 1.0f32;
    let bf = sys::cudaDataType_t::CUDA_R_16BF;
    // SAFETY: as above.
    let status = unsafe {
        sys::cublasGemmStridedBatchedEx(
            *be.blas.handle(),
            op(tb),
            op(ta),
            nn as i32,
            m as i32,
            k as i32,
            (&alpha as *const f32).cast(),
            pb as *const std::ffi::c_void,
            bf,
            cfg.lda as i32,
            (k * nn) as i64,
            pa as *const std::ffi::c_void,
            bf,
            cfg.ldb as i32,
            (m * k) as i64,
            (&beta as *const f32).cast(),
            pc as *mut std::ffi::c_void,
            sys::cudaDataType_t::CUDA_R_32F,
            nn as i32,
            (m * nn) as i64,
            batch as i32,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    };
    if status != sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        return Err(Error::Cuda(format!("cublasGemmStridedBatchedEx: {status:?}")));
    }
    Ok(())
}

/// The column-major config of row-major C [m, nn] = op(a)·op(b) (batched when `batch` > 1): Cᵀ =
/// op(B)ᵀ·op(A)ᵀ, so cuBLAS's A is our b and its B our a. cuBLAS (f32) reads the same fields.
fn lt_cfg(batch: usize, m: usize, nn: usize, k: usize, ta: bool, tb: bool, beta: f32) -> MatmulConfig {
    MatmulConfig {
        transa: tb,
        transb: ta,
        transc: false,
        m: nn as u64,
        n: m as u64,
        k: k as u64,
        alpha: 1.0,
        lda: if tb { k } else { nn } as i64,
        ldb: if ta { m } else { k } as i64,
        beta,
        ldc: nn as i64,
        stride_a: (batch > 1).then_some((k * nn) as i64),
        stride_b: (batch > 1).then_some((m * k) as i64),
        stride_c: (batch > 1).then_some((m * nn) as i64),
        stride_bias: None,
        batch_size: (batch > 1).then_some(batch as i32),
    }
}

/// Whether cuBLASLt's bias epilogue may read `bias`: it loads the vector 16 bytes at a time
/// (Marian found misaligned biases fail on A100), so a bias at another address is added apart.
fn bias_aligned(bias: &Tensor) -> Result<bool> {
    Ok(raw("matmul_bias", bias)? % 16 == 0)
}

/// The linear layer with GeLU in its epilogue (bf16): a = gelu(x·wᵀ + bias), h = x·wᵀ + bias.
/// None when cuBLASLt has no algorithm for it or the bias is not 16-byte aligned (the caller
/// composes the two ops instead).
pub fn linear_gelu(
    be: &B,
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    (rows, n, k): (usize, usize, usize),
    out: Vec<usize>,
) -> Result<Option<(Tensor, Tensor)>> {
    if let Some(b) = bias {
        if !bias_aligned(b)? {
            return Ok(None);
        }
    }
    let (a, h) = (new(be, out.clone(), x.dtype())?, new(be, out, x.dtype())?);
    let bias = bias.map(|b| raw("linear_gelu", b)).transpose()?;
    let (px, pw, pa, ph) =
        (raw("linear_gelu", x)?, raw("linear_gelu", w)?, raw("linear_gelu", &a)?, raw("linear_gelu", &h)?);
    let io = (px, pw, pa, ph, bias.unwrap_or(0));
    if crate::cuda::own_gemm() && gemm_ws::fits(be, (rows, n, k), &[px, pw, pa, ph, io.4]) {
        gemm_ws::launch(be, gemm_ws::Epi::Gelu, io, true, (rows, n, k))?;
        crate::cuda::count_own_gemm_run();
        return Ok(Some((a, h)));
    }
    let epi = crate::cuda::lt::Epilogue::GeluAux { bias, aux: raw("linear_gelu", &h)? };
    let cfg = lt_cfg(1, rows, n, k, false, true, 0.0);
    // SAFETY: x [rows, k], w [n, k], a and h [rows, n], bias [n]: contiguous bf16 (validated by the caller).
    match unsafe {
        crate::cuda::lt::matmul(be, &cfg, raw("linear_gelu", w)?, raw("linear_gelu", x)?, raw("linear_gelu", &a)?, epi)
    } {
        Ok(()) => Ok(Some((a, h))),
        Err(e) if crate::cuda::lt::unsupported(&e) => Ok(None),
        Err(e) => Err(e),
    }
}

/// The GeLU backward in the epilogue of the next layer's input gradient (bf16):
/// dh = (dy·w) ∘ gelu'(h). None when cuBLASLt has no algorithm for it.
pub fn matmul_dgelu(
    be: &B,
    dy: &Tensor,
    w: &Tensor,
    h: &Tensor,
    (rows, n, k): (usize, usize, usize),
) -> Result<Option<Tensor>> {
    let dh = new(be, h.shape().clone(), h.dtype())?;
    let io = (raw("matmul_dgelu", dy)?, raw("matmul_dgelu", w)?, raw("matmul_dgelu", &dh)?, raw("matmul_dgelu", h)?, 0);
    if crate::cuda::own_gemm() && gemm_ws::fits(be, (rows, n, k), &[io.0, io.1, io.2, io.3]) {
        gemm_ws::launch(be, gemm_ws::Epi::DGelu, io, false, (rows, n, k))?;
        crate::cuda::count_own_gemm_run();
        return Ok(Some(dh));
    }
    let epi = crate::cuda::lt::Epilogue::DGelu { aux: raw("matmul_dgelu", h)? };
    let cfg = lt_cfg(1, rows, n, k, false, false, 0.0);
    // SAFETY: dy [rows, k], w [k, n], h and dh [rows, n]: contiguous bf16 (validated by the caller).
    match unsafe {
        crate::cuda::lt::matmul(
            be,
            &cfg,
            raw("matmul_dgelu", w)?,
            raw("matmul_dgelu", dy)?,
            raw("matmul_dgelu", &dh)?,
            epi,
        )
    } {
        Ok(()) => Ok(Some(dh)),
        Err(e) if crate::cuda::lt::unsupported(&e) => Ok(None),
        Err(e) => Err(e),
    }
}
