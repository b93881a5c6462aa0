//! FP8 quantization (kernels/fp8.cu) and FP8 GEMMs on cuBLASLt (cuda/lt.rs `matmul_fp8`).

use super::*;
use crate::cuda::lt;
use crate::fp8::CastOf;

fn format_sfx(op: &'static str, dt: DType) -> Result<&'static str> {
    match dt {
        DType::F8E4M3 => Ok("e4m3"),
        DType::F8E5M2 => Ok("e5m2"),
        d => Err(Error::NotImplemented { op, device: format!("cuda FP8 quantization to {d}") }),
    }
}

fn fp8_device(be: &B, op: &'static str) -> Result<()> {
    if be.fp8 {
        Ok(())
    } else {
        Err(Error::NotImplemented { op, device: "cuda below compute capability 8.9 (FP8 needs Ada or Hopper)".into() })
    }
}

/// Whether x viewed as [rows, cols] takes the wide 64 × 64 cast (kernels/fp8.cu `fp8_cast64_*`):
/// the only one with the activations' builds.
pub fn fp8_cast_wide(x: &Tensor, [rows, cols]: [usize; 2]) -> Result<bool> {
    Ok(cols % 8 == 0 && rows % 16 == 0 && aligned16(&[x])? && !narrow_fp8_cast())
}

/// x viewed as [rows, cols] in `dt` with one scale: (q [rows, cols] where `plain`, qᵀ [cols,
/// rows] where `transposed`, scale_inv). With `given` (delayed scaling: the scale [1] and the
/// amax slot to max |x| into, or none) x is scaled by it and scale_inv is [2]: [1 / scale,
/// scale]; else by its own amax, scale_inv [1]. `of` says what of x is quantized: x, gelu(x),
/// x · gelu'(h) or swiglu(x) (x then [rows, 2 · cols]) (the activations under delayed scaling
/// and on `fp8_cast_wide` shapes only, h too: the caller checks). Nothing is read back to the host.
#[allow(clippy::too_many_arguments)]
pub fn fp8_quantize(
    be: &B,
    x: &Tensor,
    [rows, cols]: [usize; 2],
    dt: DType,
    [plain, transposed]: [bool; 2],
    given: Option<(&Tensor, Option<&Tensor>)>,
    of: CastOf,
) -> Result<(Option<Tensor>, Option<Tensor>, Tensor)> {
    const OP: &str = "quantize_fp8";
    fp8_device(be, OP)?;
    let wide = fp8_cast_wide(x, [rows, cols])?;
    let h_wide = match of {
        CastOf::Dgelu { h, .. } => fp8_cast_wide(h, [rows, cols])? && h.elem_count() == rows * cols,
        _ => true,
    };
    if !matches!(of, CastOf::X) && (given.is_none() || !wide || !h_wide) {
        return Err(Error::InvalidArgument {
            op: OP,
            msg: format!(
                "an activation in the cast needs a given scale and the wide kernel's shapes ([{rows}, {cols}])"
            ),
        });
    }
    let (src, f) = (sfx(OP, x.dtype())?, format_sfx(OP, dt)?);
    let len = rows * cols;
    let (amax, scale) = match given {
        Some((scale, slot)) => (slot.cloned(), Some(scale)),
        None => {
            let amax = new(be, [1], DType::F32)?;
            ew(be, "fill_f32", 1, &[ptr(OP, &amax)?, Arg::F32(0.0), n(1)])?;
            ew8(be, &format!("fp8_amax_{src}"), len, 8, &[ptr(OP, x)?, ptr(OP, &amax)?, n(len)])?;
            (Some(amax), None)
        }
    };
    let q = plain.then(|| new(be, [rows, cols], dt)).transpose()?;
    let qt = transposed.then(|| new(be, [cols, rows], dt)).transpose()?;
    let scale_inv = new(be, [if given.is_some() { 2 } else { 1 }], DType::F32)?;
    // dGeLU's bias gradient: the column sums of 64-row chunks here, `col_sum_f32`'s pass after.
    let chunks = rows.div_ceil(COL_CHUNK);
    let (h, part) = match of {
        CastOf::Dgelu { h, bias } => (Some(h), bias.map(|_| new(be, [chunks, cols], DType::F32)).transpose()?),
        _ => (None, None),
    };
    let common =
        [opt_ptr(OP, amax.as_ref())?, opt_ptr(OP, scale)?, opt_ptr(OP, q.as_ref())?, opt_ptr(OP, qt.as_ref())?];
    // The 64 × 64 kernel where its wide accesses fit (see kernels/fp8.cu), else the 32 × 32 one.
    let (kernel, tile) = match (wide, of) {
        (true, CastOf::X) => ("fp8_cast64", 64),
        (true, CastOf::Gelu) => ("fp8_cast64_gelu", 64),
        (true, CastOf::Dgelu { .. }) => ("fp8_cast64_dgelu", 64),
        (true, CastOf::Swiglu) => ("fp8_cast64_swiglu", 64),
        (false, _) => ("fp8_cast", 32),
    };
    let mut args = vec![ptr(OP, x)?];
    if wide {
        args.push(opt_ptr(OP, h)?);
    }
    args.extend(common);
    args.push(ptr(OP, &scale_inv)?);
    if wide {
        args.push(opt_ptr(OP, part.as_ref())?);
    }
    args.extend([n(rows), n(cols)]);
    let tiles = rows.div_ceil(tile) * cols.div_ceil(tile);
    if tiles > 0 {
        be.launch(&format!("{kernel}_{src}_{f}"), tiles as u32, 256, 0, &args)?;
    }
    if let (CastOf::Dgelu { bias: Some((db, acc)), .. }, Some(part)) = (of, &part) {
        let to = if acc { SumTo::Add(db) } else { SumTo::Write(db) };
        to.col_sum(be, part, chunks, cols)?;
    }
    Ok((q, qt, scale_inv))
}

/// `FERROTRON_FP8_CAST=32`: every cast on the 32 × 32 kernel (a lab switch, to compare).
fn narrow_fp8_cast() -> bool {
    static NARROW: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *NARROW.get_or_init(|| std::env::var("FERROTRON_FP8_CAST").is_ok_and(|v| v == "32"))
}

/// Delayed scaling's update of history columns `c0..c1` of hist [len, n] and scale [n]
/// (kernels/fp8.cu `fp8_delayed_update`).
pub fn fp8_delayed_update(
    be: &B,
    hist: &Tensor,
    scale: &Tensor,
    [len, nn]: [usize; 2],
    [c0, c1]: [usize; 2],
    scaled_max: f32,
    algo_max: bool,
) -> Result<()> {
    const OP: &str = "fp8_scale_update";
    if c1 <= c0 {
        return Ok(());
    }
    let args =
        [ptr(OP, hist)?, ptr(OP, scale)?, n(len), n(nn), n(c0), n(c1), Arg::F32(scaled_max), Arg::I64(algo_max as i64)];
    be.launch("fp8_delayed_update", (c1 - c0).div_ceil(256) as u32, 256, 0, &args)
}

/// c [m, nn] = a [m, k] · b [nn, k]ᵀ · a_scale_inv · b_scale_inv (+ bias [nn]) + beta · c, for FP8
/// a and b (not both E5M2) into a bf16 or f32 c. Shapes and alignment checked by the caller.
#[allow(clippy::too_many_arguments)]
pub fn fp8_gemm(
    be: &B,
    (a, a_scale_inv): (&Tensor, &Tensor),
    (b, b_scale_inv): (&Tensor, &Tensor),
    c: &Tensor,
    (m, nn, k): (usize, usize, usize),
    beta: f32,
    bias: Option<&Tensor>,
) -> Result<()> {
    const OP: &str = "fp8_matmul";
    fp8_device(be, OP)?;
    let out_f32 = match c.dtype() {
        DType::BF16 => false,
        DType::F32 => true,
        d => return Err(Error::NotImplemented { op: OP, device: format!("cuda FP8 products into {d}") }),
    };
    // Row-major C = A·Bᵀ is column-major Cᵀ = B·Aᵀ: cuBLASLt's A is our b (transposed), its B our a.
    let cfg = cudarc::cublaslt::MatmulConfig {
        transa: true,
        transb: false,
        transc: false,
        m: nn as u64,
        n: m as u64,
        k: k as u64,
        alpha: 1.0,
        lda: k as i64,
        ldb: k as i64,
        beta,
        ldc: nn as i64,
        stride_a: None,
        stride_b: None,
        stride_c: None,
        stride_bias: None,
        batch_size: None,
    };
    let epi = match bias {
        Some(t) => lt::Epilogue::Bias(raw(OP, t)?),
        None => lt::Epilogue::None,
    };
    let fp8 = lt::Fp8In {
        a_e5m2: b.dtype() == DType::F8E5M2,
        b_e5m2: a.dtype() == DType::F8E5M2,
        a_scale_inv: raw(OP, b_scale_inv)?,
        b_scale_inv: raw(OP, a_scale_inv)?,
    };
    // SAFETY: the caller validated a [m, k], b [nn, k], c [m, nn] (contiguous, on this device),
    // the bias [nn] and the two one-element f32 scales.
    unsafe { lt::matmul_fp8(be, &cfg, (raw(OP, b)?, raw(OP, a)?, raw(OP, c)?), epi, fp8, out_f32) }
}

/// `fp8_gemm` overwriting c, with the bias in cuBLASLt's epilogue for a bf16 c and a 16-byte
/// aligned bias (it loads the vector 16 bytes at a time), else added after the product.
pub fn fp8_gemm_bias(
    be: &B,
    a: (&Tensor, &Tensor),
    b: (&Tensor, &Tensor),
    c: &Tensor,
    (m, nn, k): (usize, usize, usize),
    bias: Option<&Tensor>,
) -> Result<()> {
    const OP: &str = "fp8_matmul";
    match bias {
        Some(t) if c.dtype() != DType::BF16 || raw(OP, t)? % 16 != 0 => {
            fp8_gemm(be, a, b, c, (m, nn, k), 0.0, None)?;
            let len = c.elem_count();
            let args = [ptr(OP, c)?, ptr(OP, t)?, ptr(OP, c)?, n(len), n(nn)];
            ew8(be, &format!("bias_add_{}", sfx(OP, c.dtype())?), len, nn, &args)
        }
        _ => fp8_gemm(be, a, b, c, (m, nn, k), 0.0, bias),
    }
}

/// `fp8_gemm` into an existing c (a main_grad view), added to it where `accumulate`: straight
/// into c where cuBLASLt takes its address, else (a view after an odd-sized parameter in the flat
/// buffer, misaligned for its FP8 kernels) into an aligned f32 scratch added or copied over.
pub fn fp8_gemm_into(
    be: &B,
    a: (&Tensor, &Tensor),
    b: (&Tensor, &Tensor),
    c: &Tensor,
    (m, nn, k): (usize, usize, usize),
    accumulate: bool,
) -> Result<()> {
    let beta = if accumulate { 1.0 } else { 0.0 };
    match fp8_gemm(be, a, b, c, (m, nn, k), beta, None) {
        Err(e) if lt::unsupported(&e) => {}
        r => return r,
    }
    let t = new(be, [m, nn], DType::F32)?;
    fp8_gemm(be, a, b, &t, (m, nn, k), 0.0, None)?;
    if accumulate { acc(be, c, &t) } else { cast_into(be, &t, c) }
}
