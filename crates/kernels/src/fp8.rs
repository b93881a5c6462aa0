//! FP8 with one scale per tensor: Megatron's `--fp8-recipe tensorwise` (Transformer Engine's
//! current scaling) and `delayed` (its DelayedScaling). Quantization, the products of FP8
//! operands, and the linear layer built from them (`fp8_linear_fwd` / `fp8_linear_bwd`).
//!
//! Delayed scaling (`quantize_fp8_scaled`, `fp8_scale_update`; the state is ferrotron-core's
//! `Fp8Metas`): x is scaled by a scale chosen from earlier passes' amaxes, and its own amax is
//! maxed into a history slot; after a pass each slot's scale follows its history (the update's
//! doc) and the history rolls on.
//!
//! Quantizing x: amax = max |x| (NaN when any element is NaN), scale = fp8_max / amax (448 for
//! E4M3, 57344 for E5M2; 1 where amax is 0 or inf, f32::MAX where the quotient overflows), q =
//! round_nearest_even(x·scale) saturated to ±fp8_max (NaN stays NaN), scale_inv = 1 / scale,
//! each step one IEEE f32 operation on the CPU and on CUDA alike: the same bytes on both.
//!
//! Products: `fp8_matmul` is c [..., n] = a [..., k] · b [n, k]ᵀ · a.scale_inv · b.scale_inv with
//! fp32 sums: the one form cuBLASLt multiplies FP8 in (both operands k-contiguous, "TN"), so the
//! backward's products take transposed copies, which quantization writes in the same pass. k and
//! n must be multiples of 16 (cuBLASLt's FP8 alignment), on the CPU too, so that a model that
//! trains here trains on the GPU; E5M2 × E5M2 has no kernel and is refused. The linear layer
//! pads its rows (the weight gradient's k) with zeros to a multiple of 16 itself.
//!
//! The linear layer (y = x·wᵀ + b, w [out, in]) under Megatron's formats: x, w and so dx's w in
//! E4M3; dy in E4M3 (`--fp8-format e4m3`) or E5M2 (`hybrid`). Forward y = q(x)·q(w)ᵀ; backward
//! dx = q(dy)·q(wᵀ)ᵀ and dW (+)= q(dyᵀ)·q(xᵀ)ᵀ into main_grad. The forward saves q(xᵀ) for the
//! weight gradient (one byte an element instead of x's two) and the backward quantizes w again
//! (the same bytes: w has not changed, and under delayed scaling the forward's scale of w is
//! kept for it) rather than keeping an FP8 copy per micro-batch in flight.

use crate::{check, cpu};
use ferrotron_core::{
    AmaxAlgo, DType, DelayedScaling, Device, Error, Fp8Format, Result, Tensor, invalid, shape_mismatch,
};

/// A tensor in FP8 and its scale: value ≈ data · scale_inv (scale_inv an f32 [1] on data's
/// device, never read back to the host by the CUDA ops).
#[derive(Debug, Clone)]
pub struct Fp8 {
    pub data: Tensor,
    pub scale_inv: Tensor,
}

impl Fp8 {
    /// data · scale_inv in f32 (the values the products multiply).
    pub fn dequantize(&self) -> Result<Tensor> {
        let s = self.scale_inv.to_vec_f32()?[0];
        // Read on the host (the codes have no device read of their own).
        let codes = self.data.to_device(&ferrotron_core::Device::Cpu)?;
        let v: Vec<f32> = codes.read_f32()?.iter().map(|q| q * s).collect();
        Tensor::from_f32(&v, self.data.dims().to_vec(), DType::F32, self.data.device())
    }
}

/// Which copies `quantize_fp8` writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fp8Copies {
    /// q in x's shape.
    Plain,
    /// qᵀ [cols, rows] only.
    Transposed,
    /// Both, from one pass.
    Both,
}

/// The largest finite value of an FP8 type.
pub(crate) fn fp8_max(op: &'static str, dt: DType) -> Result<f32> {
    match dt {
        DType::F8E4M3 => Ok(448.0),
        DType::F8E5M2 => Ok(57344.0),
        d => Err(Error::DTypeMismatch { op, expected: "f8e4m3 or f8e5m2".into(), got: d }),
    }
}

/// The scale for a tensor whose largest magnitude is `amax` (the rule in the file header).
fn scale_for(amax: f32, fmax: f32) -> f32 {
    if amax == 0.0 || amax == f32::INFINITY {
        return 1.0;
    }
    let s = fmax / amax;
    if s == f32::INFINITY { f32::MAX } else { s }
}

/// x (viewed as [rows, cols], cols its last dim) in FP8 type `dt` with one scale: (q in x's
/// shape, qᵀ [cols, rows]), each present as `copies` asks.
pub fn quantize_fp8(x: &Tensor, dt: DType, copies: Fp8Copies) -> Result<(Option<Fp8>, Option<Fp8>)> {
    let (q, qt, _) = quantize(x, dt, copies, None, CastOf::X)?;
    Ok((q, qt))
}

/// Delayed scaling's quantization: x scaled by `scale` (an f32 [1], chosen before x is seen)
/// instead of its own amax, and max |x| maxed into `amax` (an f32 [1]: an amax history's
/// current slot) where given. Returns `quantize_fp8`'s copies and the scale used (a [1] copy of
/// it, which the slot's later updates leave alone).
pub fn quantize_fp8_scaled(
    x: &Tensor,
    dt: DType,
    copies: Fp8Copies,
    scale: &Tensor,
    amax: Option<&Tensor>,
) -> Result<(Option<Fp8>, Option<Fp8>, Tensor)> {
    quantize_scaled(x, dt, copies, (scale, amax), CastOf::X)
}

/// `quantize_fp8_scaled` of what `of` says (see `quantize`).
fn quantize_scaled(
    x: &Tensor,
    dt: DType,
    copies: Fp8Copies,
    (scale, amax): (&Tensor, Option<&Tensor>),
    of: CastOf,
) -> Result<(Option<Fp8>, Option<Fp8>, Tensor)> {
    const OP: &str = "quantize_fp8_scaled";
    for t in std::iter::once(scale).chain(amax) {
        check::dtype(OP, t, DType::F32)?;
        check::shape(OP, t, &[1])?;
    }
    let (q, qt, used) = quantize(x, dt, copies, Some((scale, amax)), of)?;
    Ok((q, qt, used.ok_or_else(|| invalid(OP, "no scale copy"))?))
}

/// What a cast quantizes of its input x (kernels/fp8.cu's activation builds spare the bf16
/// tensor in between).
#[derive(Clone, Copy, Debug)]
pub(crate) enum CastOf<'a> {
    /// x itself.
    X,
    /// gelu(x), x a GeLU's input, as `gelu` stores it.
    Gelu,
    /// x · gelu'(h) as `gelu_bwd(h, x)` stores it (x: the gradient of gelu(h)), and its column
    /// sums into `bias` (a bias gradient: added where its flag says, else stored) where given.
    Dgelu { h: &'a Tensor, bias: Option<(&'a Tensor, bool)> },
    /// swiglu(x), x a SwiGLU's input (rows of gate, then value), as `swiglu` stores it: what is
    /// quantized has half x's last dim.
    Swiglu,
}

/// Both quantizations (`given`: delayed scaling's scale and amax slot); the scale used where
/// given. Of what `of` says: in the cast itself where CUDA's wide cast takes x (and h) under
/// delayed scaling, else by `gelu` / `gelu_bwd` (and `bias_grad_into`) first.
fn quantize(
    x: &Tensor,
    dt: DType,
    copies: Fp8Copies,
    given: Option<(&Tensor, Option<&Tensor>)>,
    of: CastOf,
) -> Result<(Option<Fp8>, Option<Fp8>, Option<Tensor>)> {
    const OP: &str = "quantize_fp8";
    check::float(OP, x)?;
    match of {
        CastOf::X => {}
        CastOf::Gelu if !in_cast(x, None, given.is_some())? => {
            return quantize(&crate::gelu(x)?, dt, copies, given, CastOf::X);
        }
        // (in_cast checks x's rows of 2 · f as the cast's: f % 8 == 0 makes them pass alike.)
        CastOf::Swiglu
            if x.shape().rank() == 0 || x.shape().last() % 16 != 0 || !in_cast(x, None, given.is_some())? =>
        {
            return quantize(&crate::swiglu(x)?, dt, copies, given, CastOf::X);
        }
        CastOf::Dgelu { h, bias } => {
            check::shape(OP, h, x.dims())?;
            check::same_dtype(OP, h, x)?;
            if !in_cast(x, Some(h), given.is_some())? {
                let dh = crate::gelu_bwd(h, x)?;
                if let Some((db, acc)) = bias {
                    crate::bias_grad_into(db, &dh, acc)?;
                }
                return quantize(&dh, dt, copies, given, CastOf::X);
            }
            if let Some((db, _)) = bias {
                check::float(OP, db)?;
                check::shape(OP, db, &[x.shape().last()])?;
            }
        }
        CastOf::Gelu | CastOf::Swiglu => {}
    }
    let fmax = fp8_max(OP, dt)?;
    if x.shape().rank() == 0 {
        return Err(shape_mismatch(OP, "a tensor of rank >= 1", x.dims()));
    }
    // What is quantized: x's shape, or a SwiGLU's output (half the last dim).
    let halve = matches!(of, CastOf::Swiglu);
    let mut dims = x.dims().to_vec();
    if let Some(last) = dims.last_mut().filter(|_| halve) {
        *last /= 2;
    }
    let cols = *dims.last().unwrap_or(&1);
    let rows = dims.iter().product::<usize>() / cols.max(1);
    let (plain, transposed) = (copies != Fp8Copies::Transposed, copies != Fp8Copies::Plain);
    let all: Vec<&Tensor> =
        std::iter::once(x).chain(given.iter().flat_map(|(s, a)| std::iter::once(*s).chain(*a))).collect();
    // The caller's handles: q in x's shape, and scale_inv, or (delayed) [scale_inv, scale] split.
    let finish =
        |q: Option<Tensor>, qt: Option<Tensor>, s: Tensor| -> Result<(Option<Fp8>, Option<Fp8>, Option<Tensor>)> {
            let (s, used) = if given.is_some() { (s.narrow0(0..1)?, Some(s.narrow0(1..2)?)) } else { (s, None) };
            let q = q.map(|q| q.reshape(dims.clone())).transpose()?;
            Ok((q.map(|data| Fp8 { data, scale_inv: s.clone() }), qt.map(|data| Fp8 { data, scale_inv: s }), used))
        };
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &all)? {
        let (q, qt, s) = crate::cuda::ops::fp8_quantize(&g, x, [rows, cols], dt, [plain, transposed], given, of)?;
        return finish(q, qt, s);
    }
    check::on_cpu(OP, &all)?;
    let xv = x.read_f32()?;
    // |x|'s bits order as the magnitudes, NaN above inf: the largest keeps a NaN (as on CUDA).
    let amax_bits = xv.iter().map(|v| v.to_bits() & 0x7fff_ffff).max().unwrap_or(0);
    let (scale, scale_inv) = match given {
        Some((s, slot)) => {
            if let Some(slot) = slot {
                slot.update_f32(OP, |v| v[0] = f32::from_bits(v[0].to_bits().max(amax_bits)))?;
            }
            let scale = s.to_vec_f32()?[0];
            (scale, vec![1.0 / scale, scale])
        }
        None => {
            let scale = scale_for(f32::from_bits(amax_bits), fmax);
            (scale, vec![1.0 / scale])
        }
    };
    let n = scale_inv.len();
    let scale_inv = Tensor::from_vec(scale_inv, [n], &Device::Cpu)?;
    let scaled: Vec<f32> = xv.iter().map(|v| v * scale).collect();
    let q = plain.then(|| Tensor::from_f32(&scaled, x.dims().to_vec(), dt, &Device::Cpu)).transpose()?;
    let qt = if transposed {
        let mut t = vec![0.0f32; scaled.len()];
        for (r, row) in scaled.chunks(cols.max(1)).enumerate() {
            for (c, v) in row.iter().enumerate() {
                t[c * rows + r] = *v;
            }
        }
        Some(Tensor::from_f32(&t, [cols, rows], dt, &Device::Cpu)?)
    } else {
        None
    };
    finish(q, qt, scale_inv)
}

/// Whether `quantize` applies an activation inside the cast: CUDA, delayed scaling, x (and h)
/// on the wide cast's shapes; elsewhere the activation runs first.
fn in_cast(x: &Tensor, h: Option<&Tensor>, given: bool) -> Result<bool> {
    #[cfg(feature = "cuda")]
    if given && x.shape().rank() > 0 && std::iter::once(x).chain(h).all(|t| matches!(t.device(), Device::Cuda(_))) {
        let cols = x.shape().last();
        let shape = [x.elem_count() / cols.max(1), cols];
        let mut wide = crate::cuda::ops::fp8_cast_wide(x, shape)?;
        if let Some(h) = h {
            wide &= crate::cuda::ops::fp8_cast_wide(h, shape)?;
        }
        return Ok(wide);
    }
    let _ = (x, h, given);
    Ok(false)
}

/// Delayed scaling's update after a pass, of columns `cols` of `history` [len, n] and `scale`
/// [n] (f32; `dt`: the columns' FP8 type): amax = the column's largest
/// (`AmaxAlgo::Max`, NaNs skipped) or row 0 (`MostRecent`); scale = fp8_max · 2^-margin / amax
/// (f32::MAX where that overflows), kept where amax is 0 or not finite; then the history rolls
/// one place (row 0 to the end, the oldest dropped) and row 0 is cleared.
pub fn fp8_scale_update(
    history: &Tensor,
    scale: &Tensor,
    cols: std::ops::Range<usize>,
    dt: DType,
    config: &DelayedScaling,
) -> Result<()> {
    const OP: &str = "fp8_scale_update";
    check::dtype(OP, history, DType::F32)?;
    check::dtype(OP, scale, DType::F32)?;
    check::rank(OP, history, 2)?;
    let (len, n) = (history.dims()[0], history.dims()[1]);
    check::shape(OP, scale, &[n])?;
    if cols.end > n || cols.start > cols.end {
        return Err(invalid(OP, format!("columns {cols:?} of a history of {n}")));
    }
    let scaled_max = fp8_max(OP, dt)? * 2f32.powi(-config.margin);
    let algo_max = config.algo == AmaxAlgo::Max;
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[history, scale])? {
        let c = [cols.start, cols.end];
        return crate::cuda::ops::fp8_delayed_update(&g, history, scale, [len, n], c, scaled_max, algo_max);
    }
    check::on_cpu(OP, &[history, scale])?;
    let mut amaxes = vec![];
    history.update_f32(OP, |h| {
        for c in cols.clone() {
            let cur = h[c];
            let a = if algo_max { (1..len).fold(cur, |a, i| a.max(h[i * n + c])) } else { cur };
            amaxes.push(a);
            for i in 1..len.saturating_sub(1) {
                h[i * n + c] = h[(i + 1) * n + c];
            }
            if len > 1 {
                h[(len - 1) * n + c] = cur;
            }
            h[c] = 0.0;
        }
    })?;
    scale.update_f32(OP, |s| {
        for (c, a) in cols.zip(amaxes) {
            if a.is_finite() && a > 0.0 {
                let v = scaled_max / a;
                s[c] = if v == f32::INFINITY { f32::MAX } else { v };
            }
        }
    })
}

/// (m, n, k) of a [..., k] · b [n, k]ᵀ, checked as the header says.
fn fp8_dims(op: &'static str, a: &Fp8, b: &Fp8) -> Result<(usize, usize, usize)> {
    for t in [&a.data, &b.data] {
        fp8_max(op, t.dtype())?;
    }
    for s in [&a.scale_inv, &b.scale_inv] {
        check::dtype(op, s, DType::F32)?;
        check::shape(op, s, &[1])?;
    }
    if a.data.dtype() == DType::F8E5M2 && b.data.dtype() == DType::F8E5M2 {
        return Err(invalid(op, "both operands are f8e5m2: FP8 products take at most one E5M2 operand"));
    }
    check::rank(op, &b.data, 2)?;
    let (n, k) = (b.data.dims()[0], b.data.dims()[1]);
    if a.data.shape().rank() < 1 || a.data.shape().last() != k {
        return Err(shape_mismatch(op, format!("a [..., {k}] for b [{n}, {k}]"), a.data.dims()));
    }
    if k % 16 != 0 || n % 16 != 0 {
        return Err(invalid(
            op,
            format!(
                "FP8 products need both the inner dim and the output width divisible by 16, got {k} and {n} (a [{}, {k}] · b [{n}, {k}]ᵀ): pick layer widths (hidden, FFN, heads × head dim) that are multiples of 16, or train without --fp8-format",
                a.data.elem_count() / k.max(1)
            ),
        ));
    }
    Ok((a.data.elem_count() / k.max(1), n, k))
}

/// a · bᵀ · scales (+ bias [n]) in `out` (bf16 or f32 on CUDA): the header's product form.
pub fn fp8_matmul(a: &Fp8, b: &Fp8, bias: Option<&Tensor>, out: DType) -> Result<Tensor> {
    const OP: &str = "fp8_matmul";
    let (m, n, k) = fp8_dims(OP, a, b)?;
    if let Some(t) = bias {
        check::dtype(OP, t, out)?;
        check::shape(OP, t, &[n])?;
    }
    let mut dims = a.data.dims().to_vec();
    *dims.last_mut().expect("rank checked") = n;
    #[cfg(feature = "cuda")]
    {
        let mut all = vec![&a.data, &b.data, &a.scale_inv, &b.scale_inv];
        all.extend(bias);
        if let Some(g) = crate::cuda::gpu(OP, &all)? {
            let c = crate::cuda::ops::new(&g, dims, out)?;
            crate::cuda::ops::fp8_gemm_bias(&g, (&a.data, &a.scale_inv), (&b.data, &b.scale_inv), &c, (m, n, k), bias)?;
            return Ok(c);
        }
    }
    let mut all = vec![&a.data, &b.data, &a.scale_inv, &b.scale_inv];
    all.extend(bias);
    check::on_cpu(OP, &all)?;
    let alpha = a.scale_inv.to_vec_f32()?[0] * b.scale_inv.to_vec_f32()?[0];
    let (av, bv) = (a.data.read_f32()?, b.data.read_f32()?);
    let mut c = cpu::matmul::gemm_batched_new(1, m, n, k, &av, false, &bv, true, alpha);
    if let Some(t) = bias {
        let bv = t.read_f32()?;
        for row in c.chunks_mut(n.max(1)) {
            row.iter_mut().zip(bv.iter()).for_each(|(y, b)| *y += b);
        }
    }
    check::out(c, dims, out, a.data.device())
}

/// c = a · bᵀ · scales, or c += it where `accumulate` (c [m, n] f32 or bf16: a main_grad).
pub fn fp8_matmul_into(c: &Tensor, a: &Fp8, b: &Fp8, accumulate: bool) -> Result<()> {
    const OP: &str = "fp8_matmul_into";
    let (m, n, k) = fp8_dims(OP, a, b)?;
    check::float(OP, c)?;
    if c.elem_count() != m * n {
        return Err(shape_mismatch(OP, [m, n], c.dims()));
    }
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[c, &a.data, &b.data, &a.scale_inv, &b.scale_inv])? {
        let (a, b) = ((&a.data, &a.scale_inv), (&b.data, &b.scale_inv));
        return crate::cuda::ops::fp8_gemm_into(&g, a, b, c, (m, n, k), accumulate);
    }
    check::on_cpu(OP, &[c, &a.data, &b.data, &a.scale_inv, &b.scale_inv])?;
    let alpha = a.scale_inv.to_vec_f32()?[0] * b.scale_inv.to_vec_f32()?[0];
    let (av, bv) = (a.data.read_f32()?, b.data.read_f32()?);
    c.update_f32(OP, |cv| cpu::matmul::gemm_batched(1, m, n, k, &av, false, &bv, true, cv, accumulate, alpha))
}

/// Delayed scaling's handles for one quantized operand: the scale to quantize by and, where
/// the pass records amaxes, the history slot to max the operand's amax into.
#[derive(Clone, Copy, Debug)]
pub struct Fp8Scaling<'a> {
    pub scale: &'a Tensor,
    pub amax: Option<&'a Tensor>,
}

/// What `of` says of `x` quantized by its own amax, or (`delayed`) by the given scale; with the
/// scale used.
fn quantize_by(
    x: &Tensor,
    dt: DType,
    copies: Fp8Copies,
    delayed: Option<Fp8Scaling>,
    of: CastOf,
) -> Result<(Option<Fp8>, Option<Fp8>, Option<Tensor>)> {
    match delayed {
        Some(d) => quantize_scaled(x, dt, copies, (d.scale, d.amax), of).map(|(q, qt, s)| (q, qt, Some(s))),
        None => quantize(x, dt, copies, None, of),
    }
}

/// The FP8 linear layer's forward (header): y = q(x)·q(w)ᵀ (+ bias) in x's dtype, x [..., in], w
/// [out, in]; returns y and, where a backward follows (`for_backward`), q(xᵀ) [in, rows padded to
/// a multiple of 16] for `fp8_linear_bwd`. Any row count: the rows are padded with zeros inside.
/// Under delayed scaling (`delayed`: x's and w's handles) also the scales x and w were quantized
/// by (the backward quantizes w by its again; a recomputed x is quantized by x's).
pub fn fp8_linear_fwd(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    format: Fp8Format,
    for_backward: bool,
    delayed: Option<[Fp8Scaling; 2]>,
) -> Result<(Tensor, Option<Fp8>, Option<[Tensor; 2]>)> {
    linear_fwd(x, w, bias, format, for_backward, delayed, CastOf::X)
}

/// The activation an FP8 linear layer's input comes from, applied inside the input's cast
/// (`fp8_linear_fwd_after`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fp8Act {
    /// GPT's tanh GeLU (`gelu`).
    Gelu,
    /// SwiGLU over rows of gate then value (`swiglu`).
    Swiglu,
}

/// `fp8_linear_fwd` on act(h), h the activation's input: on CUDA under delayed scaling the cast
/// applies the activation (act(h) is never written), elsewhere the activation runs first. What
/// it returns is `fp8_linear_fwd(&act(h), …)`'s.
pub fn fp8_linear_fwd_after(
    act: Fp8Act,
    h: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    format: Fp8Format,
    for_backward: bool,
    delayed: Option<[Fp8Scaling; 2]>,
) -> Result<(Tensor, Option<Fp8>, Option<[Tensor; 2]>)> {
    let of = match act {
        Fp8Act::Gelu => CastOf::Gelu,
        Fp8Act::Swiglu => CastOf::Swiglu,
    };
    linear_fwd(h, w, bias, format, for_backward, delayed, of)
}

fn linear_fwd(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    format: Fp8Format,
    for_backward: bool,
    delayed: Option<[Fp8Scaling; 2]>,
    of: CastOf,
) -> Result<(Tensor, Option<Fp8>, Option<[Tensor; 2]>)> {
    const OP: &str = "fp8_linear_fwd";
    check::rank(OP, w, 2)?;
    let copies = if for_backward { Fp8Copies::Both } else { Fp8Copies::Plain };
    // Padding rows are zeros, and gelu(0) = swiglu(0) = 0: they stay zeros through either.
    let (xp, rows) = padded_rows(x)?;
    let (xq, xt, x_scale) = quantize_by(&xp, format.forward(), copies, delayed.map(|d| d[0]), of)?;
    let (wq, _, w_scale) = quantize_by(w, format.forward(), Fp8Copies::Plain, delayed.map(|d| d[1]), CastOf::X)?;
    let (xq, wq) = (xq.ok_or_else(|| gone(OP))?, wq.ok_or_else(|| gone(OP))?);
    let y = fp8_matmul(&xq, &wq, bias, x.dtype())?;
    let mut dims = x.dims().to_vec();
    *dims.last_mut().expect("rank checked by quantize_fp8") = w.dims()[0];
    let used = x_scale.zip(w_scale).map(|(x, w)| [x, w]);
    Ok((y.narrow0(0..rows)?.reshape(dims)?, xt, used))
}

/// x as [rows, cols] (cols its last dim) with zero rows after it up to a multiple of 16, and its
/// row count: a weight gradient's inner dim is the rows (a mixture-of-experts expert's token
/// list has any length), and zero rows change no amax, no output row and no weight gradient.
fn padded_rows(x: &Tensor) -> Result<(Tensor, usize)> {
    if x.shape().rank() == 0 {
        return Err(shape_mismatch("fp8_linear", "a tensor of rank >= 1", x.dims()));
    }
    let cols = x.shape().last();
    let rows = x.elem_count() / cols.max(1);
    let x2 = x.reshape([rows, cols])?;
    if rows % 16 == 0 {
        return Ok((x2, rows));
    }
    let p = Tensor::zeros([rows.next_multiple_of(16), cols], x.dtype(), x.device())?;
    crate::copy_(&p.narrow0(0..rows)?, &x2)?;
    Ok((p, rows))
}

/// The FP8 linear layer's backward: dx = q(dy)·q(wᵀ)ᵀ in dy's dtype, and dw (main_grad, [out,
/// in]) = or += q(dyᵀ)·xtᵀ (xt from `fp8_linear_fwd`) as `accumulate` says. Under delayed
/// scaling (`delayed`: dy's handles and the scale the forward quantized w by) w's bytes are the
/// forward's again, and no amax of w is recorded twice.
pub fn fp8_linear_bwd(
    dy: &Tensor,
    w: &Tensor,
    xt: &Fp8,
    (dw, accumulate): (&Tensor, bool),
    format: Fp8Format,
    delayed: Option<(Fp8Scaling, &Tensor)>,
) -> Result<Tensor> {
    linear_bwd(dy, None, w, xt, (dw, accumulate), format, delayed)
}

/// `fp8_linear_bwd` of the layer before a GeLU: `da` is the gradient of gelu(h), h this layer's
/// output, and dy = gelu_bwd(h, da), with its column sums into `bias` (a bias gradient, added
/// where its flag says, else stored) where given. On CUDA under delayed scaling dy is formed
/// inside its cast and never written; elsewhere `gelu_bwd` and `bias_grad_into` run first.
#[allow(clippy::too_many_arguments)]
pub fn fp8_linear_bwd_dgelu(
    da: &Tensor,
    h: &Tensor,
    bias: Option<(&Tensor, bool)>,
    w: &Tensor,
    xt: &Fp8,
    dw: (&Tensor, bool),
    format: Fp8Format,
    delayed: Option<(Fp8Scaling, &Tensor)>,
) -> Result<Tensor> {
    linear_bwd(da, Some((h, bias)), w, xt, dw, format, delayed)
}

type DgeluOf<'a> = Option<(&'a Tensor, Option<(&'a Tensor, bool)>)>;

fn linear_bwd(
    dy: &Tensor,
    dgelu: DgeluOf,
    w: &Tensor,
    xt: &Fp8,
    (dw, accumulate): (&Tensor, bool),
    format: Fp8Format,
    delayed: Option<(Fp8Scaling, &Tensor)>,
) -> Result<Tensor> {
    const OP: &str = "fp8_linear_bwd";
    check::rank(OP, w, 2)?;
    let (dyp, rows) = padded_rows(dy)?;
    // h padded as dy: zero rows of dy give zero rows of dy · gelu'(h), whatever h holds there.
    let hp = dgelu.map(|(h, _)| padded_rows(h)).transpose()?;
    let of = match (dgelu, &hp) {
        (Some((_, bias)), Some((h, _))) => CastOf::Dgelu { h, bias },
        _ => CastOf::X,
    };
    let (dyq, dyt, _) = quantize_by(&dyp, format.gradient(), Fp8Copies::Both, delayed.map(|d| d.0), of)?;
    let w_by = delayed.map(|(_, scale)| Fp8Scaling { scale, amax: None });
    let (_, wt, _) = quantize_by(w, format.forward(), Fp8Copies::Transposed, w_by, CastOf::X)?;
    let (dyq, dyt, wt) = (dyq.ok_or_else(|| gone(OP))?, dyt.ok_or_else(|| gone(OP))?, wt.ok_or_else(|| gone(OP))?);
    let dx = fp8_matmul(&dyq, &wt, None, dy.dtype())?;
    fp8_matmul_into(dw, &dyt, xt, accumulate)?;
    let mut dims = dy.dims().to_vec();
    *dims.last_mut().expect("rank checked by padded_rows") = w.dims()[1];
    dx.narrow0(0..rows)?.reshape(dims)
}

fn gone(op: &'static str) -> Error {
    invalid(op, "quantize_fp8 left out a copy it was asked for")
}
