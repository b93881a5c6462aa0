//! CUDA implementations of the ops, called by the tensor-level functions after validation (so
//! shapes here are already checked). Same signatures and results as the CPU reference.

use super::{Arg, Backend, ptr};
use crate::cpu::attention::{AttnDims, AttnMask};
use cudarc::cublas::{Gemm, GemmConfig, StridedBatchedConfig, sys::cublasOperation_t as Op};
use cudarc::cublaslt::MatmulConfig;
use cudarc::driver::{CudaSlice, DevicePtr};
use ferrotron_core::cuda::CudaStorage;
use ferrotron_core::{DType, Device, Error, Result, Shape, Storage, Tensor};

type B = Backend;

fn sfx(op: &'static str, dt: DType) -> Result<&'static str> {
    match dt {
        DType::F32 => Ok("f32"),
        DType::BF16 => Ok("bf16"),
        d => Err(Error::NotImplemented { op, device: format!("cuda for {d}") }),
    }
}

/// A contiguous tensor's device address.
fn raw(op: &'static str, t: &Tensor) -> Result<u64> {
    match ptr(op, t)? {
        Arg::Ptr(p) => Ok(p),
        _ => Err(Error::NotContiguous { op }),
    }
}

/// A fresh output, not cleared (every kernel writing into one sets every element). With
/// poisoning on (tests), float outputs start as NaN so that a kernel that leaves an element
/// unwritten fails the comparison instead of passing on leftover memory.
pub(crate) fn new(be: &B, shape: impl Into<Shape>, dt: DType) -> Result<Tensor> {
    let t = Tensor::empty(shape, dt, &Device::Cuda(be.dev.clone()))?;
    if super::poisoning() && (dt == DType::F32 || dt == DType::BF16) {
        let name = format!("fill_{}", sfx("fill", dt)?);
        ew(be, &name, t.elem_count(), &[ptr("fill", &t)?, Arg::F32(f32::NAN), n(t.elem_count())])?;
    }
    Ok(t)
}

fn n(x: usize) -> Arg {
    Arg::I64(x as i64)
}

const NULL: Arg = Arg::Ptr(0);

/// A tensor's address, or a null pointer for an absent optional input (kernels test for null).
fn opt_ptr(op: &'static str, t: Option<&Tensor>) -> Result<Arg> {
    t.map_or(Ok(NULL), |t| ptr(op, t))
}

/// Elementwise launch over `len` elements.
fn ew(be: &B, name: &str, len: usize, args: &[Arg]) -> Result<()> {
    be.launch(name, Backend::grid_for(len), 256, 0, args)
}

/// Elementwise launch of a kernel with a `_v8` twin (eight elements per thread, 16-byte accesses):
/// the twin when `len` and `unit` (a span its groups of eight must not cross: a bias row, a SwiGLU
/// half; 8 when there is none) divide by 8 and every pointer is 16-byte aligned.
fn ew8(be: &B, name: &str, len: usize, unit: usize, args: &[Arg]) -> Result<()> {
    let aligned = args.iter().all(|a| !matches!(a, Arg::Ptr(p) if p % 16 != 0));
    if len % 8 == 0 && unit % 8 == 0 && aligned {
        be.launch(&format!("{name}_v8"), Backend::grid_for(len / 8), 256, 0, args)
    } else {
        ew(be, name, len, args)
    }
}

/// Storage types the cast and accumulate kernels take (f16 too; the math kernels take f32/bf16).
fn sfx_storage(op: &'static str, dt: DType) -> Result<&'static str> {
    if dt == DType::F16 { Ok("f16") } else { sfx(op, dt) }
}

pub fn cast(be: &B, x: &Tensor, dt: DType) -> Result<Tensor> {
    let y = new(be, x.shape().clone(), dt)?;
    cast_into(be, x, &y)?;
    Ok(y)
}

pub fn cast_into(be: &B, x: &Tensor, y: &Tensor) -> Result<()> {
    let name = format!("cast_{}_{}", sfx_storage("cast", x.dtype())?, sfx_storage("cast", y.dtype())?);
    ew8(be, &name, x.elem_count(), 8, &[ptr("cast", x)?, ptr("cast", y)?, n(x.elem_count())])
}

pub fn acc(be: &B, dst: &Tensor, src: &Tensor) -> Result<()> {
    let name = format!("acc_{}_{}", sfx_storage("add_", src.dtype())?, sfx_storage("add_", dst.dtype())?);
    ew8(be, &name, dst.elem_count(), 8, &[ptr("add_", dst)?, ptr("add_", src)?, n(dst.elem_count())])
}

pub fn scale(be: &B, x: &Tensor, y: &Tensor, s: f32) -> Result<()> {
    let name = format!("scale_{}", sfx("scale", x.dtype())?);
    ew8(be, &name, x.elem_count(), 8, &[ptr("scale", x)?, ptr("scale", y)?, Arg::F32(s), n(x.elem_count())])
}

pub fn add(be: &B, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let y = new(be, a.shape().clone(), a.dtype())?;
    ew8(
        be,
        &format!("add_{}", sfx("add", a.dtype())?),
        a.elem_count(),
        8,
        &[ptr("add", a)?, ptr("add", b)?, ptr("add", &y)?, n(a.elem_count())],
    )?;
    Ok(y)
}

pub fn bias_add(be: &B, x: &Tensor, b: &Tensor) -> Result<Tensor> {
    let y = new(be, x.shape().clone(), x.dtype())?;
    let name = format!("bias_add_{}", sfx("bias_add", x.dtype())?);
    ew8(
        be,
        &name,
        x.elem_count(),
        x.shape().last(),
        &[ptr("bias_add", x)?, ptr("bias_add", b)?, ptr("bias_add", &y)?, n(x.elem_count()), n(x.shape().last())],
    )?;
    Ok(y)
}

pub fn bias_grad(be: &B, dy: &Tensor) -> Result<Tensor> {
    let (rows, c) = (dy.shape().rows(), dy.shape().last());
    let chunks = rows.div_ceil(COL_CHUNK);
    let partials = new(be, [chunks, c], DType::F32)?;
    let name = format!("bias_grad_{}", sfx("bias_grad", dy.dtype())?);
    ew8(be, &name, chunks * c, c, &[ptr("bias_grad", dy)?, ptr("bias_grad", &partials)?, n(rows), n(c)])?;
    col_sum(be, &partials, chunks, c)
}

/// Rows per partial sum of the two-pass column sums (`COL_CHUNK` in kernels/common.cuh).
const COL_CHUNK: usize = 64;

/// The second pass of a column sum: `partials` [chunks, c] (chunk order) → [c].
fn col_sum(be: &B, partials: &Tensor, chunks: usize, c: usize) -> Result<Tensor> {
    let y = new(be, [c], DType::F32)?;
    let chunks = n(chunks);
    be.launch(
        "col_sum_f32",
        c.div_ceil(32) as u32,
        256,
        0,
        &[ptr("col_sum", partials)?, ptr("col_sum", &y)?, chunks, n(c)],
    )?;
    Ok(y)
}

/// gelu/silu forward (`x → y`) or backward (`x, dy → dx`); `fam` is the kernel family.
pub fn pointwise(be: &B, fam: &'static str, x: &Tensor, dy: Option<&Tensor>) -> Result<Tensor> {
    let s = sfx(fam, x.dtype())?;
    let y = new(be, x.shape().clone(), x.dtype())?;
    let len = x.elem_count();
    match dy {
        None => ew8(be, &format!("{fam}_fwd_{s}"), len, 8, &[ptr(fam, x)?, ptr(fam, &y)?, n(len)])?,
        Some(dy) => ew8(be, &format!("{fam}_bwd_{s}"), len, 8, &[ptr(fam, x)?, ptr(fam, dy)?, ptr(fam, &y)?, n(len)])?,
    }
    Ok(y)
}

pub fn swiglu(be: &B, x: &Tensor, f: usize, out_shape: Vec<usize>) -> Result<Tensor> {
    let y = new(be, out_shape, x.dtype())?;
    ew8(
        be,
        &format!("swiglu_fwd_{}", sfx("swiglu", x.dtype())?),
        y.elem_count(),
        f,
        &[ptr("swiglu", x)?, ptr("swiglu", &y)?, n(y.elem_count()), n(f)],
    )?;
    Ok(y)
}

pub fn swiglu_bwd(be: &B, x: &Tensor, dy: &Tensor, f: usize) -> Result<Tensor> {
    let dx = new(be, x.shape().clone(), x.dtype())?;
    ew8(
        be,
        &format!("swiglu_bwd_{}", sfx("swiglu", x.dtype())?),
        dy.elem_count(),
        f,
        &[ptr("swiglu", x)?, ptr("swiglu", dy)?, ptr("swiglu", &dx)?, n(dy.elem_count()), n(f)],
    )?;
    Ok(dx)
}

fn rows_launch(be: &B, name: &str, rows: usize, args: &[Arg]) -> Result<()> {
    be.launch(name, rows as u32, 256, 0, args)
}

/// Whether every tensor in `ts` starts on a 16-byte boundary (the eight-wide kernels' accesses).
fn aligned16(ts: &[&Tensor]) -> Result<bool> {
    for t in ts {
        if !matches!(ptr("aligned16", t)?, Arg::Ptr(p) if p % 16 == 0) {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Groups of eight a thread of the eight-wide row kernels holds, and their largest block
/// (`NORM_V`, `NORM_THREADS` in kernels/norm.cu).
const NORM_V: usize = 4;
const NORM_THREADS: usize = 512;

/// A row kernel with an eight-wide twin (the row held in registers, one 16-byte access per group):
/// the twin, with a block sized to the row, when `c` divides by 8, fits `NORM_V` groups per
/// thread of a `NORM_THREADS` block, and every pointer is 16-byte aligned.
fn rows_launch8(be: &B, name: &str, rows: usize, c: usize, args: &[Arg]) -> Result<()> {
    let aligned = args.iter().all(|a| !matches!(a, Arg::Ptr(p) if p % 16 != 0));
    if c % 8 == 0 && c <= 8 * NORM_V * NORM_THREADS && aligned {
        let threads = (c / 8).next_multiple_of(32).min(NORM_THREADS) as u32;
        be.launch(&format!("{name}_v8"), rows as u32, threads, 0, args)
    } else {
        rows_launch(be, name, rows, args)
    }
}

/// The sum x + x2 of a fused residual add (written by the norm's forward kernel), or none.
fn residual_sum(be: &B, x: &Tensor, x2: Option<&Tensor>) -> Result<(Arg, Arg, Option<Tensor>)> {
    let Some(x2) = x2 else { return Ok((NULL, NULL, None)) };
    let sum = new(be, x.shape().clone(), x.dtype())?;
    Ok((ptr("norm", x2)?, ptr("norm", &sum)?, Some(sum)))
}

/// LayerNorm of x (or of x + x2, returned as the fourth value): (y, mean, rstd, sum).
pub fn layernorm_fwd(
    be: &B,
    x: &Tensor,
    x2: Option<&Tensor>,
    w: &Tensor,
    b: Option<&Tensor>,
    eps: f64,
) -> Result<(Tensor, Tensor, Tensor, Option<Tensor>)> {
    let (rows, c) = (x.shape().rows(), x.shape().last());
    let y = new(be, x.shape().clone(), x.dtype())?;
    let (x2p, sump, sum) = residual_sum(be, x, x2)?;
    let (mean, rstd) = (new(be, [rows], DType::F32)?, new(be, [rows], DType::F32)?);
    let bp = opt_ptr("layernorm_fwd", b)?;
    let name = format!("layernorm_fwd_{}", sfx("layernorm_fwd", x.dtype())?);
    rows_launch8(
        be,
        &name,
        rows,
        c,
        &[
            ptr("ln", x)?,
            x2p,
            sump,
            ptr("ln", w)?,
            bp,
            ptr("ln", &y)?,
            ptr("ln", &mean)?,
            ptr("ln", &rstd)?,
            n(c),
            Arg::F32(eps as f32),
        ],
    )?;
    Ok((y, mean, rstd, sum))
}

/// LayerNorm backward: (dx + res, dw, db).
pub fn layernorm_bwd(
    be: &B,
    dy: &Tensor,
    x: &Tensor,
    w: &Tensor,
    mean: &Tensor,
    rstd: &Tensor,
    res: Option<&Tensor>,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (rows, c) = (x.shape().rows(), x.shape().last());
    let s = sfx("layernorm_bwd", x.dtype())?;
    let dx = new(be, x.shape().clone(), x.dtype())?;
    rows_launch8(
        be,
        &format!("layernorm_bwd_{s}"),
        rows,
        c,
        &[
            ptr("ln", dy)?,
            ptr("ln", x)?,
            ptr("ln", w)?,
            ptr("ln", mean)?,
            ptr("ln", rstd)?,
            opt_ptr("ln", res)?,
            ptr("ln", &dx)?,
            n(c),
        ],
    )?;
    let chunks = rows.div_ceil(COL_CHUNK);
    let (pw, pb) = (new(be, [chunks, c], DType::F32)?, new(be, [chunks, c], DType::F32)?);
    let args = [
        ptr("ln", dy)?,
        ptr("ln", x)?,
        ptr("ln", mean)?,
        ptr("ln", rstd)?,
        ptr("ln", &pw)?,
        ptr("ln", &pb)?,
        n(rows),
        n(c),
    ];
    ew8(be, &format!("norm_param_grad_{s}"), chunks * c, c, &args)?;
    let (dw, db) = (col_sum(be, &pw, chunks, c)?, col_sum(be, &pb, chunks, c)?);
    Ok((dx, dw, db))
}

/// RMSNorm of x (or of x + x2, returned as the third value): (y, rstd, sum).
pub fn rmsnorm_fwd(
    be: &B,
    x: &Tensor,
    x2: Option<&Tensor>,
    w: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor, Option<Tensor>)> {
    let (rows, c) = (x.shape().rows(), x.shape().last());
    let y = new(be, x.shape().clone(), x.dtype())?;
    let (x2p, sump, sum) = residual_sum(be, x, x2)?;
    let rstd = new(be, [rows], DType::F32)?;
    let name = format!("rmsnorm_fwd_{}", sfx("rmsnorm_fwd", x.dtype())?);
    rows_launch8(
        be,
        &name,
        rows,
        c,
        &[ptr("rms", x)?, x2p, sump, ptr("rms", w)?, ptr("rms", &y)?, ptr("rms", &rstd)?, n(c), Arg::F32(eps as f32)],
    )?;
    Ok((y, rstd, sum))
}

/// RMSNorm backward: (dx + res, dw).
pub fn rmsnorm_bwd(
    be: &B,
    dy: &Tensor,
    x: &Tensor,
    w: &Tensor,
    rstd: &Tensor,
    res: Option<&Tensor>,
) -> Result<(Tensor, Tensor)> {
    let (rows, c) = (x.shape().rows(), x.shape().last());
    let s = sfx("rmsnorm_bwd", x.dtype())?;
    let dx = new(be, x.shape().clone(), x.dtype())?;
    rows_launch8(
        be,
        &format!("rmsnorm_bwd_{s}"),
        rows,
        c,
        &[
            ptr("rms", dy)?,
            ptr("rms", x)?,
            ptr("rms", w)?,
            ptr("rms", rstd)?,
            opt_ptr("rms", res)?,
            ptr("rms", &dx)?,
            n(c),
        ],
    )?;
    let chunks = rows.div_ceil(COL_CHUNK);
    let pw = new(be, [chunks, c], DType::F32)?;
    let args = [ptr("rms", dy)?, ptr("rms", x)?, NULL, ptr("rms", rstd)?, ptr("rms", &pw)?, NULL, n(rows), n(c)];
    ew8(be, &format!("norm_param_grad_{s}"), chunks * c, c, &args)?;
    Ok((dx, col_sum(be, &pw, chunks, c)?))
}

pub fn softmax(be: &B, x: &Tensor) -> Result<Tensor> {
    let y = new(be, x.shape().clone(), x.dtype())?;
    let name = format!("softmax_fwd_{}", sfx("softmax", x.dtype())?);
    rows_launch(be, &name, x.shape().rows(), &[ptr("softmax", x)?, ptr("softmax", &y)?, n(x.shape().last())])?;
    Ok(y)
}

pub fn softmax_bwd(be: &B, y: &Tensor, dy: &Tensor) -> Result<Tensor> {
    let dx = new(be, y.shape().clone(), y.dtype())?;
    let name = format!("softmax_bwd_{}", sfx("softmax_bwd", y.dtype())?);
    rows_launch(
        be,
        &name,
        y.shape().rows(),
        &[ptr("softmax_bwd", y)?, ptr("softmax_bwd", dy)?, ptr("softmax_bwd", &dx)?, n(y.shape().last())],
    )?;
    Ok(dx)
}

fn ignore_arg(ignore: Option<u32>) -> Arg {
    Arg::I64(ignore.map_or(-1, |i| i as i64))
}

pub fn ce_fwd(
    be: &B,
    logits: &Tensor,
    targets: &Tensor,
    mask: Option<&Tensor>,
    cfg: crate::CrossEntropyCfg,
) -> Result<(Tensor, Tensor)> {
    let (rows, v) = (logits.dims()[0], logits.dims()[1]);
    let (loss, lse) = (new(be, [rows], DType::F32)?, new(be, [rows], DType::F32)?);
    let mp = opt_ptr("ce", mask)?;
    let mut name = format!("ce_fwd_{}", sfx("cross_entropy_fwd", logits.dtype())?);
    if v % 8 == 0 && aligned16(&[logits])? {
        name += "_v8";
    }
    rows_launch(
        be,
        &name,
        rows,
        &[
            ptr("ce", logits)?,
            ptr("ce", targets)?,
            mp,
            ignore_arg(cfg.ignore_index),
            n(cfg.vocab_start as usize),
            n(cfg.real_columns(v)),
            ptr("ce", &loss)?,
            ptr("ce", &lse)?,
            n(v),
        ],
    )?;
    Ok((loss, lse))
}

pub fn ce_bwd(
    be: &B,
    logits: &Tensor,
    targets: &Tensor,
    mask: Option<&Tensor>,
    cfg: crate::CrossEntropyCfg,
    lse: &Tensor,
    dloss: &Tensor,
) -> Result<Tensor> {
    let (rows, v) = (logits.dims()[0], logits.dims()[1]);
    let d = new(be, logits.shape().clone(), logits.dtype())?;
    let mp = opt_ptr("ce", mask)?;
    let mut name = format!("ce_bwd_{}", sfx("cross_entropy_bwd", logits.dtype())?);
    if v % 8 == 0 && aligned16(&[logits, &d])? {
        name += "_v8";
    }
    rows_launch(
        be,
        &name,
        rows,
        &[
            ptr("ce", logits)?,
            ptr("ce", targets)?,
            mp,
            ignore_arg(cfg.ignore_index),
            n(cfg.vocab_start as usize),
            n(cfg.real_columns(v)),
            ptr("ce", lse)?,
            ptr("ce", dloss)?,
            ptr("ce", &d)?,
            n(v),
        ],
    )?;
    Ok(d)
}

pub fn adamw(be: &B, p: &Tensor, g: &Tensor, m: &Tensor, v: &Tensor, h: &crate::AdamW) -> Result<()> {
    let bc1 = 1.0 - (h.beta1 as f64).powi(h.step as i32);
    let bc2 = 1.0 - (h.beta2 as f64).powi(h.step as i32);
    let len = p.elem_count();
    ew(
        be,
        "adamw",
        len,
        &[
            ptr("adamw", p)?,
            ptr("adamw", g)?,
            ptr("adamw", m)?,
            ptr("adamw", v)?,
            n(len),
            Arg::F32(h.beta1),
            Arg::F32(h.beta2),
            Arg::F32(h.eps),
            Arg::F32((h.lr as f64 / bc1) as f32),
            Arg::F32(bc2.sqrt() as f32),
            Arg::F32(1.0 - h.lr * h.weight_decay),
            Arg::F32(h.grad_scale),
        ],
    )
}

/// Σ x² of every tensor: 256 fixed per-block partials each, in one buffer, one copy back, then
/// summed on the host tensor by tensor in block order (deterministic; the bits of adding
/// one-tensor sums in order).
pub fn sum_sq_all(be: &B, xs: &[&Tensor]) -> Result<f64> {
    const BLOCKS: usize = 256;
    if xs.is_empty() {
        return Ok(0.0);
    }
    let partial: CudaSlice<f64> =
        be.dev.stream().alloc_zeros(BLOCKS * xs.len()).map_err(|e| Error::Cuda(format!("{e:?}")))?;
    let base = partial.device_ptr(be.dev.stream()).0;
    for (i, x) in xs.iter().enumerate() {
        let pp = Arg::Ptr(base + (i * BLOCKS * std::mem::size_of::<f64>()) as u64);
        be.launch(
            &format!("sum_sq_{}", sfx("sum_sq", x.dtype())?),
            BLOCKS as u32,
            256,
            0,
            &[ptr("sum_sq", x)?, pp, n(x.elem_count())],
        )?;
    }
    let host = be.dev.stream().clone_dtoh(&partial).map_err(|e| Error::Cuda(format!("{e:?}")))?;
    Ok(host.chunks(BLOCKS).fold(0.0, |total, c| total + c.iter().sum::<f64>()))
}

pub fn rope(be: &B, x: &Tensor, cfg: &crate::RopeCfg, sign: f32) -> Result<Tensor> {
    let d = x.dims();
    let (rows, t, h, hd) = (d[0] * d[1], d[1], d[2], d[3]);
    let y = new(be, x.shape().clone(), x.dtype())?;
    let work = rows * h * (cfg.rot / 2 + (hd - cfg.rot));
    let name = format!("rope_{}", sfx("rope", x.dtype())?);
    ew(
        be,
        &name,
        work,
        &[
            ptr("rope", x)?,
            ptr("rope", &y)?,
            n(rows),
            n(t),
            n(h),
            n(hd),
            n(cfg.rot),
            n(cfg.pos0),
            Arg::F64(cfg.base),
            Arg::F32(sign),
        ],
    )?;
    Ok(y)
}

pub fn embedding_fwd(be: &B, ids: &Tensor, table: &Tensor, vocab_start: usize) -> Result<Tensor> {
    let c = table.dims()[1];
    let mut shape = ids.dims().to_vec();
    shape.push(c);
    let out = new(be, shape, table.dtype())?;
    let name = format!("embedding_fwd_{}", sfx("embedding_fwd", table.dtype())?);
    ew(
        be,
        &name,
        out.elem_count(),
        &[
            ptr("emb", ids)?,
            ptr("emb", table)?,
            ptr("emb", &out)?,
            n(ids.elem_count()),
            n(c),
            n(vocab_start),
            n(table.dims()[0]),
        ],
    )?;
    Ok(out)
}

pub fn embedding_bwd(be: &B, ids: &Tensor, dout: &Tensor, dtable: &Tensor, vocab_start: usize) -> Result<()> {
    if dtable.dtype() != DType::F32 {
        return Err(Error::NotImplemented { op: "embedding_bwd", device: "cuda into a non-f32 gradient table".into() });
    }
    let c = dtable.dims()[1];
    let name = format!("embedding_bwd_{}", sfx("embedding_bwd", dout.dtype())?);
    ew(
        be,
        &name,
        dout.elem_count(),
        &[
            ptr("emb", ids)?,
            ptr("emb", dout)?,
            ptr("emb", dtable)?,
            n(ids.elem_count()),
            n(c),
            n(vocab_start),
            n(dtable.dims()[0]),
        ],
    )
}

/// The QKV split/merge over `len` elements of head segments of `d`: eight per thread when d divides
/// by 8 and every tensor is 16-byte aligned, else a warp per segment.
fn qkv_launch(be: &B, name: &str, len: usize, d: usize, ts: &[&Tensor], args: &[Arg]) -> Result<()> {
    if d % 8 == 0 && aligned16(ts)? {
        ew(be, &format!("{name}_v8"), len / 8, args)
    } else {
        ew(be, name, len / d.max(1) * 32, args)
    }
}

pub fn qkv_split(be: &B, x: &Tensor, hkv: usize, g: usize, d: usize) -> Result<(Tensor, Tensor, Tensor)> {
    let (b, t) = (x.dims()[0], x.dims()[1]);
    let q = new(be, [b, t, hkv * g, d], x.dtype())?;
    let k = new(be, [b, t, hkv, d], x.dtype())?;
    let v = new(be, [b, t, hkv, d], x.dtype())?;
    let name = format!("qkv_split_{}", sfx("qkv_split", x.dtype())?);
    qkv_launch(
        be,
        &name,
        x.elem_count(),
        d,
        &[x, &q, &k, &v],
        &[ptr("qkv", x)?, ptr("qkv", &q)?, ptr("qkv", &k)?, ptr("qkv", &v)?, n(b * t), n(hkv), n(g), n(d)],
    )?;
    Ok((q, k, v))
}

pub fn qkv_merge(be: &B, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
    let (b, t, hq, d) = (q.dims()[0], q.dims()[1], q.dims()[2], q.dims()[3]);
    let hkv = k.dims()[2];
    let g = hq / hkv;
    let x = new(be, [b, t, hkv * (g + 2) * d], q.dtype())?;
    let name = format!("qkv_merge_{}", sfx("qkv_merge", q.dtype())?);
    qkv_launch(
        be,
        &name,
        x.elem_count(),
        d,
        &[q, k, v, &x],
        &[ptr("qkv", q)?, ptr("qkv", k)?, ptr("qkv", v)?, ptr("qkv", &x)?, n(b * t), n(hkv), n(g), n(d)],
    )?;
    Ok(x)
}

/// The reference attention kernels' shape arguments: the CPU's dims and mask plus the scale.
pub struct AttnShape<'a> {
    pub dims: &'a AttnDims,
    pub mask: AttnMask,
    pub scale: f32,
}

fn attn_tail(a: &AttnShape) -> [Arg; 8] {
    let d = a.dims;
    [
        n(d.t),
        n(d.s),
        n(d.hq),
        n(d.hkv),
        n(d.d),
        Arg::F32(a.scale),
        Arg::I64(a.mask.causal as i64),
        n(a.mask.window.unwrap_or(0)),
    ]
}

fn attn_launch(be: &B, name: &str, a: &AttnShape, args: Vec<Arg>) -> Result<()> {
    let shared = (a.dims.s * 4) as u32;
    if shared > 48 * 1024 {
        return Err(Error::NotImplemented {
            op: "attention",
            device: format!(
                "cuda with {} keys (the reference kernel holds one score row in 48 KiB of shared memory)",
                a.dims.s
            ),
        });
    }
    be.launch(name, (a.dims.b * a.dims.hq * a.dims.t) as u32, 128, shared, &args)
}

/// Head dims with a flash kernel (kernels/flash.cu); others use the reference kernel.
const FLASH_DIMS: [usize; 3] = [32, 64, 128];
/// Threads per flash block: 32 rows × a quad of 4.
const FLASH_THREADS: u32 = 128;

fn flash(a: &AttnShape) -> bool {
    FLASH_DIMS.contains(&a.dims.d)
}

/// Dynamic shared memory of the tensor-core kernels that stream K/V: two stages of a 64-key K
/// tile and V tile, rows padded by 8 bf16.
fn kv_stages(d: usize) -> u32 {
    (2 * 2 * 64 * (d + 8) * 2) as u32
}

/// The tensor-core forward for head dim `d` over `t` query rows, and its query rows per block (4
/// warps × 16 rows × m-tiles per warp: `FLASH_MMA` in kernels/flash_mma.cu). Two m-tiles per warp
/// at head dim 64 from 2048 rows on (H200, 16k tokens per call: 112 → 141–176 TFLOP/s from 2k to
/// 16k, but slower at 1k than one m-tile); one otherwise (at 128 two do not fit the registers).
fn fwd_kernel(d: usize, t: usize) -> (String, usize) {
    if d == 64 && t >= 2048 { ("flash_fwd_mma_bf16_64x2".into(), 128) } else { (format!("flash_fwd_mma_bf16_{d}"), 64) }
}

/// Whether the tensor-core kernels take these tensors: bf16, head dim 64 or 128, and every tile
/// source 16-byte aligned (their loads move 16 bytes at a time; a view at an odd offset is not).
fn mma_ok(q: &Tensor, tiles: &[&Tensor], a: &AttnShape) -> Result<bool> {
    if q.dtype() != DType::BF16 || !matches!(a.dims.d, 64 | 128) {
        return Ok(false);
    }
    for t in tiles {
        if t.dtype() != DType::BF16 || !matches!(ptr("attn", t)?, Arg::Ptr(p) if p % 16 == 0) {
            return Ok(false);
        }
    }
    Ok(true)
}

pub fn attention_fwd(be: &B, q: &Tensor, k: &Tensor, v: &Tensor, a: &AttnShape) -> Result<(Tensor, Tensor)> {
    let o = new(be, q.shape().clone(), q.dtype())?;
    let lse = new(be, [a.dims.b, a.dims.hq, a.dims.t], DType::F32)?;
    let mut args = vec![ptr("attn", q)?, ptr("attn", k)?, ptr("attn", v)?, ptr("attn", &o)?, ptr("attn", &lse)?];
    args.extend(attn_tail(a));
    let sfx = sfx("attention_fwd", q.dtype())?;
    if mma_ok(q, &[q, k, v], a)? {
        // Tensor cores (kernels/flash_mma.cu): 64 query rows per block of 4 warps.
        let d = a.dims;
        let (name, rows) = fwd_kernel(d.d, d.t);
        be.launch(&name, (d.b * d.hq * d.t.div_ceil(rows)) as u32, FLASH_THREADS, kv_stages(d.d), &args)?;
    } else if flash(a) {
        let d = a.dims;
        let grid = d.b * d.hq * d.t.div_ceil(32);
        be.launch(&format!("flash_fwd_{sfx}_{}", d.d), grid as u32, FLASH_THREADS, 0, &args)?;
    } else {
        attn_launch(be, &format!("attn_fwd_{sfx}"), a, args)?;
    }
    Ok((o, lse))
}

/// Flash backward: dQ (and delta = rowsum(dO∘O)) per query tile, then dK/dV per key tile; no
/// atomics, so the result does not depend on scheduling. Gradients in bf16 from the tensor-core
/// kernels, fp32 from the SIMT ones.
#[allow(clippy::too_many_arguments)]
fn flash_bwd(
    be: &B,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    a: &AttnShape,
) -> Result<(Tensor, Tensor, Tensor)> {
    let d = a.dims;
    let sfx = sfx("attention_bwd", q.dtype())?;
    let delta = new(be, [d.b, d.hq, d.t], DType::F32)?;
    if mma_ok(q, &[q, k, v, dout], a)? {
        // Tensor cores (kernels/flash_bwd_mma.cu), gradients straight in bf16.
        let dq = new(be, q.shape().clone(), DType::BF16)?;
        let (dk, dv) = (new(be, k.shape().clone(), DType::BF16)?, new(be, v.shape().clone(), DType::BF16)?);
        let rows = d.b * d.t * d.hq;
        let args = [ptr("attn", o)?, ptr("attn", dout)?, ptr("attn", &delta)?, n(rows), n(d.t), n(d.hq), n(d.d)];
        be.launch("flash_bwd_delta_bf16", rows.div_ceil(8) as u32, 256, 0, &args)?;
        let head = |outs: &[&Tensor]| -> Result<Vec<Arg>> {
            let mut v = vec![ptr("attn", q)?, ptr("attn", k)?, ptr("attn", v)?, ptr("attn", lse)?];
            v.extend([ptr("attn", &delta)?, ptr("attn", dout)?]);
            for t in outs {
                v.push(ptr("attn", t)?);
            }
            v.extend(attn_tail(a));
            Ok(v)
        };
        let grid = d.b * d.hq * d.t.div_ceil(64);
        be.launch(
            &format!("flash_bwd_dq_mma_bf16_{}", d.d),
            grid as u32,
            FLASH_THREADS,
            kv_stages(d.d),
            &head(&[&dq])?,
        )?;
        // K and V tiles, two stages of (Q, dO) tiles and of the rows' (lse, delta).
        let shared = ((2 * 64 + 4 * 64) * (d.d + 8) * 2 + 4 * 64 * 4) as u32;
        let grid = d.b * d.hkv * d.s.div_ceil(64);
        be.launch(&format!("flash_bwd_dkv_mma_bf16_{}", d.d), grid as u32, FLASH_THREADS, shared, &head(&[&dk, &dv])?)?;
        return Ok((dq, dk, dv));
    }
    let dq = new(be, q.shape().clone(), DType::F32)?;
    let (dk, dv) = (new(be, k.shape().clone(), DType::F32)?, new(be, v.shape().clone(), DType::F32)?);
    let mut args = vec![
        ptr("attn", q)?,
        ptr("attn", k)?,
        ptr("attn", v)?,
        ptr("attn", o)?,
        ptr("attn", lse)?,
        ptr("attn", dout)?,
        ptr("attn", &dq)?,
        ptr("attn", &delta)?,
    ];
    args.extend(attn_tail(a));
    be.launch(&format!("flash_bwd_dq_{sfx}_{}", d.d), (d.b * d.hq * d.t.div_ceil(32)) as u32, FLASH_THREADS, 0, &args)?;
    let mut args = vec![
        ptr("attn", q)?,
        ptr("attn", k)?,
        ptr("attn", v)?,
        ptr("attn", lse)?,
        ptr("attn", &delta)?,
        ptr("attn", dout)?,
        ptr("attn", &dk)?,
        ptr("attn", &dv)?,
    ];
    args.extend(attn_tail(a));
    be.launch(
        &format!("flash_bwd_dkv_{sfx}_{}", d.d),
        (d.b * d.hkv * d.s.div_ceil(32)) as u32,
        FLASH_THREADS,
        0,
        &args,
    )?;
    Ok((dq, dk, dv))
}

pub fn attention_bwd(
    be: &B,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    a: &AttnShape,
) -> Result<(Tensor, Tensor, Tensor)> {
    if flash(a) {
        let (dq, dk, dv) = flash_bwd(be, q, k, v, o, lse, dout, a)?;
        let dt = dout.dtype();
        if dq.dtype() == dt {
            return Ok((dq, dk, dv));
        }
        return Ok((cast(be, &dq, dt)?, cast(be, &dk, dt)?, cast(be, &dv, dt)?));
    }
    // dk and dv are sums of fp32 atomics: they must start at zero (never poisoned).
    let dev = Device::Cuda(be.dev.clone());
    let dq = new(be, q.shape().clone(), DType::F32)?;
    let (dk, dv) =
        (Tensor::zeros(k.shape().clone(), DType::F32, &dev)?, Tensor::zeros(v.shape().clone(), DType::F32, &dev)?);
    let mut args = vec![
        ptr("attn", q)?,
        ptr("attn", k)?,
        ptr("attn", v)?,
        ptr("attn", o)?,
        ptr("attn", lse)?,
        ptr("attn", dout)?,
        ptr("attn", &dq)?,
        ptr("attn", &dk)?,
        ptr("attn", &dv)?,
    ];
    args.extend(attn_tail(a));
    attn_launch(be, &format!("attn_bwd_{}", sfx("attention_bwd", q.dtype())?), a, args)?;
    let dt = dout.dtype();
    if dt == DType::F32 {
        return Ok((dq, dk, dv));
    }
    Ok((cast(be, &dq, dt)?, cast(be, &dk, dt)?, cast(be, &dv, dt)?))
}

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
    let cfg = MatmulConfig {
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
    };
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
            // The bias rides in cuBLASLt's epilogue (one per output feature: the rows of Cᵀ).
            let epi = match bias {
                Some(t) if t.dtype() == DType::BF16 => super::lt::Epilogue::Bias(raw("matmul_bias", t)?),
                Some(_) => {
                    return Err(Error::NotImplemented {
                        op: "matmul_bias",
                        device: "cuda with a non-bf16 bias".into(),
                    });
                }
                None => super::lt::Epilogue::None,
            };
            // SAFETY: the tensors are contiguous bf16 of the shapes `cfg` describes (validated by
            // the caller); the bias has `nn` elements.
            unsafe { super::lt::matmul(be, &cfg, raw("matmul", b)?, raw("matmul", a)?, raw("matmul", c)?, epi) }
        }
        _ => Err(Error::NotImplemented {
            op: "matmul",
            device: format!("cuda for {} x {} -> {}", a.dtype(), b.dtype(), c.dtype()),
        }),
    }
}

/// C (+)= op(A)·op(B) for bf16 A, B and an f32 C (the weight gradient straight into fp32 main_grad,
/// Megatron's gradient-accumulation fusion), through cublasGemmStridedBatchedEx with fp32 compute.
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
    let (Arg::Ptr(pa), Arg::Ptr(pb), Arg::Ptr(pc)) =
        (ptr("matmul_into", a)?, ptr("matmul_into", b)?, ptr("matmul_into", c)?)
    else {
        return Err(Error::Cuda("matmul_into: expected device pointers".into()));
    };
    let op = |t: bool| if t { Op::CUBLAS_OP_T } else { Op::CUBLAS_OP_N };
    let alpha = 1.0f32;
    let bf = sys::cudaDataType_t::CUDA_R_16BF;
    // SAFETY: pointers come from live tensors whose shapes the caller validated against (m, n, k, batch).
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
            (if tb { k } else { nn }) as i32,
            (k * nn) as i64,
            pa as *const std::ffi::c_void,
            bf,
            (if ta { m } else { k }) as i32,
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

/// cuBLASLt's config for `a [rows, k] · bᵀ` (tb) or `a · b` (b [k, n]) as one GEMM, as `gemm` builds it.
fn linear_cfg(rows: usize, n: usize, k: usize, tb: bool) -> MatmulConfig {
    MatmulConfig {
        transa: tb,
        transb: false,
        transc: false,
        m: n as u64,
        n: rows as u64,
        k: k as u64,
        alpha: 1.0,
        lda: if tb { k } else { n } as i64,
        ldb: k as i64,
        beta: 0.0,
        ldc: n as i64,
        stride_a: None,
        stride_b: None,
        stride_c: None,
        stride_bias: None,
        batch_size: None,
    }
}

/// The linear layer with GeLU in its epilogue (bf16): a = gelu(x·wᵀ + bias), h = x·wᵀ + bias.
/// None when cuBLASLt has no algorithm for it (the caller composes the two ops instead).
pub fn linear_gelu(
    be: &B,
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    (rows, n, k): (usize, usize, usize),
    out: Vec<usize>,
) -> Result<Option<(Tensor, Tensor)>> {
    let (a, h) = (new(be, out.clone(), x.dtype())?, new(be, out, x.dtype())?);
    let bias = bias.map(|b| raw("linear_gelu", b)).transpose()?;
    let epi = super::lt::Epilogue::GeluAux { bias, aux: raw("linear_gelu", &h)? };
    let cfg = linear_cfg(rows, n, k, true);
    // SAFETY: x [rows, k], w [n, k], a and h [rows, n], bias [n]: contiguous bf16 (validated by the caller).
    match unsafe {
        super::lt::matmul(be, &cfg, raw("linear_gelu", w)?, raw("linear_gelu", x)?, raw("linear_gelu", &a)?, epi)
    } {
        Ok(()) => Ok(Some((a, h))),
        Err(e) if super::lt::unsupported(&e) => Ok(None),
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
    let epi = super::lt::Epilogue::DGelu { aux: raw("matmul_dgelu", h)? };
    let cfg = linear_cfg(rows, n, k, false);
    // SAFETY: dy [rows, k], w [k, n], h and dh [rows, n]: contiguous bf16 (validated by the caller).
    match unsafe {
        super::lt::matmul(be, &cfg, raw("matmul_dgelu", w)?, raw("matmul_dgelu", dy)?, raw("matmul_dgelu", &dh)?, epi)
    } {
        Ok(()) => Ok(Some(dh)),
        Err(e) if super::lt::unsupported(&e) => Ok(None),
        Err(e) => Err(e),
    }
}
