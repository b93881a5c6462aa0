//! Casts, accumulate, scale, add, bias and its gradient, activations.

use super::*;

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

/// x with its dropout mask applied (crate::dropout has the rule; `thr` the 24-bit threshold).
pub fn dropout(be: &B, x: &Tensor, row: usize, key: &crate::DropoutKey, thr: u32, scale: f32) -> Result<Tensor> {
    let y = new(be, x.shape().clone(), x.dtype())?;
    let name = format!("dropout_{}", sfx("dropout", x.dtype())?);
    let mut args = vec![ptr("dropout", x)?, ptr("dropout", &y)?, n(x.elem_count())];
    args.extend(key_words(row, key));
    args.extend([Arg::I64(thr as i64), Arg::F32(scale)]);
    args.extend(key_tail(be, row, key));
    ew(be, &name, x.elem_count(), &args)?;
    Ok(y)
}

/// The arguments elementwise.cu's keyed kernels (`dropout_*`, `normal_*`) take after their
/// tensors: the row length and the key's words (seed, stream, base, batch stride, offset).
fn key_words(row: usize, key: &crate::DropoutKey) -> [Arg; 6] {
    let w = |v: u64| Arg::I64(v as i64);
    [n(row.max(1)), w(key.seed), w(key.stream), w(key.base), w(key.batch_stride), w(key.offset)]
}

/// Their last arguments: the draw shift of a replayed graph, and the split (at the row's end when
/// there is none).
fn key_tail(be: &B, row: usize, key: &crate::DropoutKey) -> [Arg; 3] {
    [
        Arg::Ptr(be.draw_shift_ptr()),
        n(key.split.map_or(row.max(1), |s| s.at as usize)),
        Arg::I64(key.split.map_or(0, |s| s.offset) as i64),
    ]
}

/// Standard normal values of `shape`, keyed as dropout's words (elementwise.cu `normal_*`).
pub fn normal(be: &B, shape: Shape, dtype: DType, row: usize, key: &crate::DropoutKey) -> Result<Tensor> {
    let y = new(be, shape, dtype)?;
    let name = format!("normal_{}", sfx("normal", dtype)?);
    let mut args = vec![ptr("normal", &y)?, n(y.elem_count())];
    args.extend(key_words(row, key));
    args.extend(key_tail(be, row, key));
    ew(be, &name, y.elem_count(), &args)?;
    Ok(y)
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

/// Σ over rows of dy into `to` (a new f32 tensor, or added into one); returns where it went.
pub fn bias_grad(be: &B, dy: &Tensor, to: SumTo) -> Result<Tensor> {
    let (rows, c) = (dy.shape().rows(), dy.shape().last());
    let chunks = rows.div_ceil(COL_CHUNK);
    let partials = new(be, [chunks, c], DType::F32)?;
    let name = format!("bias_grad_{}", sfx("bias_grad", dy.dtype())?);
    col_partials(be, &name, chunks, c, &[ptr("bias_grad", dy)?, ptr("bias_grad", &partials)?, n(rows), n(c)])?;
    to.col_sum(be, &partials, chunks, c)
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

/// x·σ(g) (kernels/elementwise.cu `sigmoid_gate_fwd_*`).
pub fn sigmoid_gate(be: &B, x: &Tensor, g: &Tensor) -> Result<Tensor> {
    let op = "sigmoid_gate";
    let y = new(be, x.shape().clone(), x.dtype())?;
    let len = x.elem_count();
    let args = [ptr(op, x)?, ptr(op, g)?, ptr(op, &y)?, n(len)];
    ew8(be, &format!("sigmoid_gate_fwd_{}", sfx(op, x.dtype())?), len, 8, &args)?;
    Ok(y)
}

/// (dx, dg) of `sigmoid_gate` (kernels/elementwise.cu `sigmoid_gate_bwd_*`).
pub fn sigmoid_gate_bwd(be: &B, x: &Tensor, g: &Tensor, dy: &Tensor) -> Result<(Tensor, Tensor)> {
    let op = "sigmoid_gate_bwd";
    let (dx, dg) = (new(be, x.shape().clone(), x.dtype())?, new(be, x.shape().clone(), x.dtype())?);
    let len = x.elem_count();
    let args = [ptr(op, x)?, ptr(op, g)?, ptr(op, dy)?, ptr(op, &dx)?, ptr(op, &dg)?, n(len)];
    ew8(be, &format!("sigmoid_gate_bwd_{}", sfx(op, x.dtype())?), len, 8, &args)?;
    Ok((dx, dg))
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

/// gpt-oss's gated quick GeLU (activation.rs `quick_geglu`); `c` the clamp, ∞ for none.
pub fn quick_geglu(be: &B, x: &Tensor, f: usize, o: f32, c: f32, out_shape: Vec<usize>) -> Result<Tensor> {
    let y = new(be, out_shape, x.dtype())?;
    let name = format!("quick_geglu_fwd_{}", sfx("quick_geglu", x.dtype())?);
    let args = [ptr("quick_geglu", x)?, ptr("quick_geglu", &y)?, n(y.elem_count()), n(f), Arg::F32(o), Arg::F32(c)];
    ew8(be, &name, y.elem_count(), f, &args)?;
    Ok(y)
}

pub fn quick_geglu_bwd(be: &B, x: &Tensor, dy: &Tensor, f: usize, o: f32, c: f32) -> Result<Tensor> {
    let dx = new(be, x.shape().clone(), x.dtype())?;
    let name = format!("quick_geglu_bwd_{}", sfx("quick_geglu", x.dtype())?);
    let op = "quick_geglu_bwd";
    let args = [ptr(op, x)?, ptr(op, dy)?, ptr(op, &dx)?, n(dy.elem_count()), n(f), Arg::F32(o), Arg::F32(c)];
    ew8(be, &name, dy.elem_count(), f, &args)?;
    Ok(dx)
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
