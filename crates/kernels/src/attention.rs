//! Causal self-attention with GQA, an optional sliding window and optional document-wise masks
//! (math in `cpu::attention`). q [B, T, Hq, D], k/v [B, S, Hkv, D] → o [B, T, Hq, D] and lse
//! [B, Hq, T] (f32).

pub use crate::cpu::attention::AttnDropout;
use crate::cpu::attention::{AttnDims, AttnMask};
use crate::{buf, check, cpu};
use ferrotron_core::{DType, Device, Result, Tensor, invalid, shape_mismatch};

#[derive(Clone, Copy, Debug)]
pub struct AttnCfg<'a> {
    pub causal: bool,
    /// Sliding window: query i sees keys j with |i − j| < window.
    pub window: Option<usize>,
    /// Softmax scale; 1/√D when None.
    pub scale: Option<f64>,
    /// Dropout of the probabilities (training).
    pub dropout: Option<AttnDropout>,
    /// Document-wise masks (Megatron's --reset-attention-mask), causal self-attention only: u32
    /// [B, T] on q's device, each query's first key (the start of its document: every value at
    /// most its own position, and along a row never smaller than the one before:
    /// `document_starts_error`). The CPU checks both; a GPU reads no values back to check
    /// (`Batch::with_document_starts` checks them on the host), and its flash kernels rely on
    /// the second to skip key tiles. On a GPU these run on the tensor-core flash kernels in bf16
    /// (the warp-specialised `_docs` builds where they apply), on the reference kernels in fp32.
    pub docs: Option<&'a Tensor>,
}

impl Default for AttnCfg<'_> {
    fn default() -> Self {
        AttnCfg { causal: true, window: None, scale: None, dropout: None, docs: None }
    }
}

/// The document masks' checks that need no read: u32 [B, T] on the queries' device, for causal
/// self-attention.
fn check_docs(op: &'static str, cfg: &AttnCfg, d: &AttnDims, device: &Device) -> Result<()> {
    let Some(docs) = cfg.docs else { return Ok(()) };
    if !cfg.causal || d.s != d.t {
        return Err(invalid(op, "document masks (--reset-attention-mask) are for causal self-attention"));
    }
    if docs.dtype() != DType::U32 {
        return Err(invalid(op, format!("document starts must be u32, got {}", docs.dtype())));
    }
    check::shape(op, docs, &[d.b, d.t])?;
    if !docs.device().same(device) {
        return Err(invalid(op, format!("document starts on {}, the queries on {device}", docs.device())));
    }
    Ok(())
}

/// What is wrong with document starts of rows of `t` positions (`AttnCfg::docs`), if anything:
/// a start after its own position, or smaller than the one before it in the row (documents follow
/// each other).
pub fn document_starts_error(starts: &[u32], t: usize) -> Option<String> {
    let (at, &bad) = starts.iter().enumerate().find(|&(at, &x)| {
        let i = at % t;
        x as usize > i || (i > 0 && x < starts[at - 1])
    })?;
    let (i, row) = (at % t, at / t);
    Some(if bad as usize > i {
        format!(
            "document start {bad} of position {i} in batch row {row} lies after it: each token's document starts at or before it"
        )
    } else {
        format!(
            "document start {bad} of position {i} in batch row {row} lies before the previous position's ({}): a row's documents follow each other, so its starts never decrease",
            starts[at - 1]
        )
    })
}

/// The CPU's copy of the document starts, checked (`document_starts_error`).
fn host_docs(op: &'static str, cfg: &AttnCfg, d: &AttnDims) -> Result<Option<Vec<u32>>> {
    let Some(docs) = cfg.docs else { return Ok(None) };
    let v = docs.to_vec::<u32>()?;
    if let Some(e) = document_starts_error(&v, d.t) {
        return Err(invalid(op, e));
    }
    Ok(Some(v))
}

/// The checks `dims` and `fused_dims` share: the window and the dropout rate.
fn check_cfg(op: &'static str, cfg: &AttnCfg) -> Result<()> {
    if cfg.window == Some(0) {
        return Err(invalid(op, "sliding window must be at least 1"));
    }
    if let Some(p) = cfg.dropout.map(|d| d.p).filter(|p| !(0.0..1.0).contains(p)) {
        return Err(invalid(op, format!("attention dropout {p} outside [0, 1): pass a rate such as 0.1")));
    }
    Ok(())
}

fn dims(op: &'static str, q: &Tensor, k: &Tensor, v: &Tensor, cfg: &AttnCfg) -> Result<AttnDims> {
    check::float(op, q)?;
    check::same_dtype(op, q, k)?;
    check::same_dtype(op, q, v)?;
    check::rank(op, q, 4)?;
    check::rank(op, k, 4)?;
    let (qd, kd) = (q.dims(), k.dims());
    check::shape(op, v, kd)?;
    let (b, t, hq, d) = (qd[0], qd[1], qd[2], qd[3]);
    let (s, hkv) = (kd[1], kd[2]);
    if kd[0] != b || kd[3] != d {
        return Err(shape_mismatch(op, format!("k/v [{b}, S, Hkv, {d}]"), kd));
    }
    if hkv == 0 || hq % hkv != 0 {
        return Err(invalid(op, format!("query heads {hq} must be a multiple of kv heads {hkv} (GQA groups)")));
    }
    if cfg.causal && s != t {
        return Err(shape_mismatch(op, format!("causal self-attention with S == T = {t}"), kd));
    }
    check_cfg(op, cfg)?;
    let dims = AttnDims { b, t, s, hq, hkv, d };
    check_docs(op, cfg, &dims, q.device())?;
    Ok(dims)
}

/// The kernels' mask: `docs` the host's copy of the document starts (the CPU's), or None.
fn mask<'a>(cfg: &AttnCfg, docs: Option<&'a [u32]>) -> AttnMask<'a> {
    AttnMask { causal: cfg.causal, window: cfg.window, dropout: cfg.dropout.filter(|d| d.p > 0.0), docs }
}

fn scale(cfg: &AttnCfg, d: usize) -> f64 {
    cfg.scale.unwrap_or(1.0 / (d as f64).sqrt())
}

/// The GPU kernels' view of the call.
#[cfg(feature = "cuda")]
fn gpu_shape<'a>(d: &'a AttnDims, cfg: &AttnCfg<'a>) -> crate::cuda::ops::AttnShape<'a> {
    crate::cuda::ops::AttnShape { dims: d, mask: mask(cfg, None), scale: scale(cfg, d.d) as f32, docs: cfg.docs }
}

/// The head width at which attention over heads of `d` real columns in `dtype` on `device` runs
/// fastest: on a GPU in bf16 the next head dim with tensor-core kernels (64, 128, 192) where d is
/// at most 192, else d. A caller that pads its heads with zeros to it (multi-latent attention,
/// with the softmax scale set from its real width) changes no score and no kept output.
pub fn attention_padded_width(d: usize, dtype: DType, device: &Device) -> usize {
    #[cfg(feature = "cuda")]
    if dtype == DType::BF16 && matches!(device, Device::Cuda(_)) {
        return crate::cuda::ops::TC_HEAD_DIMS.into_iter().find(|&w| w >= d).unwrap_or(d);
    }
    let _ = (dtype, device);
    d
}

/// Returns (o, lse).
pub fn attention_fwd(q: &Tensor, k: &Tensor, v: &Tensor, cfg: &AttnCfg) -> Result<(Tensor, Tensor)> {
    const OP: &str = "attention_fwd";
    let d = dims(OP, q, k, v, cfg)?;
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[q, k, v])? {
        return crate::cuda::ops::attention_fwd(&g, q, k, v, &gpu_shape(&d, cfg));
    }
    check::on_cpu(OP, &[q, k, v])?;
    let docs = host_docs(OP, cfg, &d)?;
    let (qv, kv, vv) = (q.read_f32()?, k.read_f32()?, v.read_f32()?);
    // SAFETY: attention_fwd copies every (batch, head)'s rows of o and lse.
    let (mut o, mut lse) = unsafe { (buf::uninit(qv.len()), buf::uninit(d.b * d.hq * d.t)) };
    cpu::attention::attention_fwd(&qv, &kv, &vv, d, mask(cfg, docs.as_deref()), scale(cfg, d.d), &mut o, &mut lse);
    Ok((
        check::out(o, q.shape().clone(), q.dtype(), q.device())?,
        check::out(lse, [d.b, d.hq, d.t], DType::F32, q.device())?,
    ))
}

/// Returns (dq, dk, dv).
pub fn attention_bwd(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    cfg: &AttnCfg,
) -> Result<(Tensor, Tensor, Tensor)> {
    const OP: &str = "attention_bwd";
    let d = dims(OP, q, k, v, cfg)?;
    check::shape(OP, o, q.dims())?;
    check::shape(OP, dout, q.dims())?;
    check::shape(OP, lse, &[d.b, d.hq, d.t])?;
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[q, k, v, o, lse, dout])? {
        return crate::cuda::ops::attention_bwd(&g, q, k, v, o, lse, dout, &gpu_shape(&d, cfg));
    }
    check::on_cpu(OP, &[q, k, v, o, lse, dout])?;
    let docs = host_docs(OP, cfg, &d)?;
    let (qv, kv, vv) = (q.read_f32()?, k.read_f32()?, v.read_f32()?);
    let (ov, lv, dov) = (o.read_f32()?, lse.read_f32()?, dout.read_f32()?);
    // SAFETY: attention_bwd copies (`=`) every head's rows of dq, dk and dv.
    let (mut dq, mut dk, mut dv) = unsafe { (buf::uninit(qv.len()), buf::uninit(kv.len()), buf::uninit(vv.len())) };
    cpu::attention::attention_bwd(
        &qv,
        &kv,
        &vv,
        &ov,
        &lv,
        &dov,
        d,
        mask(cfg, docs.as_deref()),
        scale(cfg, d.d),
        &mut dq,
        &mut dk,
        &mut dv,
    );
    let dt = dout.dtype();
    Ok((
        check::out(dq, q.shape().clone(), dt, q.device())?,
        check::out(dk, k.shape().clone(), dt, q.device())?,
        check::out(dv, v.shape().clone(), dt, q.device())?,
    ))
}

/// How the heads sit in a fused QKV projection output [B, T, Hkv·(G+2)·D] (Megatron's grouped
/// layout, as [`qkv_split`](crate::qkv_split) reads it): `hkv` groups, each its `group` query
/// heads then its key and its value head, every head `d` wide.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QkvHeads {
    pub hkv: usize,
    pub group: usize,
    pub d: usize,
}

impl QkvHeads {
    pub fn new(hkv: usize, group: usize, d: usize) -> Self {
        QkvHeads { hkv, group, d }
    }
}

/// [`attention_fwd`] on the fused QKV projection output `qkv` [B, T, Hkv·(G+2)·D] laid out as
/// `heads` says: the same (o, lse). Q, K and V
/// are read where they sit (no split copy) on the CPU and by the GPU's tensor-core kernels; the
/// GPU's other kernels take the split first.
pub fn attention_fwd_qkv(qkv: &Tensor, heads: QkvHeads, cfg: &AttnCfg) -> Result<(Tensor, Tensor)> {
    const OP: &str = "attention_fwd_qkv";
    let dm = fused_dims(qkv, heads, cfg)?;
    let d = heads.d;
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[qkv])? {
        if let Some(out) = crate::cuda::ops::attention_fwd_qkv(&g, qkv, &gpu_shape(&dm, cfg))? {
            return Ok(out);
        }
        let (q, k, v) = crate::qkv_split(qkv, heads.hkv, heads.group, d)?;
        return attention_fwd(&q, &k, &v, cfg);
    }
    check::on_cpu(OP, &[qkv])?;
    let docs = host_docs(OP, cfg, &dm)?;
    let x = qkv.read_f32()?;
    // SAFETY: attention_fwd_fused copies every (batch, head)'s rows of o and lse.
    let (mut o, mut lse) = unsafe { (buf::uninit(dm.b * dm.t * dm.hq * d), buf::uninit(dm.b * dm.hq * dm.t)) };
    cpu::attention::attention_fwd_fused(&x, dm, mask(cfg, docs.as_deref()), scale(cfg, d), &mut o, &mut lse);
    Ok((
        check::out(o, [dm.b, dm.t, dm.hq, d], qkv.dtype(), qkv.device())?,
        check::out(lse, [dm.b, dm.hq, dm.t], DType::F32, qkv.device())?,
    ))
}

/// The gradient of [`attention_fwd_qkv`]: dQKV [B, T, Hkv·(G+2)·D] (as
/// [`qkv_merge`](crate::qkv_merge) of [`attention_bwd`]'s dq, dk, dv). On a GPU the tensor-core
/// kernels read Q, K, V in place and write each gradient into its slots of dQKV.
pub fn attention_bwd_qkv(
    qkv: &Tensor,
    o: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    heads: QkvHeads,
    cfg: &AttnCfg,
) -> Result<Tensor> {
    bwd_qkv(qkv, o, lse, dout, heads, cfg, None).map(|(dqkv, _)| dqkv)
}

/// [`attention_bwd_qkv`] with Σ over rows of dQKV (the QKV projection's bias gradient) added into
/// `db` [Hkv·(G+2)·D] (`acc`), or stored there: a main_grad view, as
/// [`bias_grad_into`](crate::bias_grad_into). On a GPU whose flash backward can (the default;
/// `cuda::set_flash_bias_grad(false)` turns it off), its own kernels sum the tiles they write, so
/// dQKV is not read again for the bias; the sums have the bits `bias_grad_into` would give.
pub fn attention_bwd_qkv_into(
    qkv: &Tensor,
    o: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    heads: QkvHeads,
    cfg: &AttnCfg,
    db: &Tensor,
    acc: bool,
) -> Result<Tensor> {
    const OP: &str = "attention_bwd_qkv_into";
    check::float(OP, db)?;
    check::shape(OP, db, &[qkv.shape().last()])?;
    if [qkv, o, lse, dout].iter().any(|t| t.shares_storage(db)) {
        return Err(invalid(OP, "the bias gradient destination shares storage with an input"));
    }
    let (dqkv, summed) = bwd_qkv(qkv, o, lse, dout, heads, cfg, Some((db, acc)))?;
    if !summed {
        crate::bias_grad_into(db, &dqkv, acc)?;
    }
    Ok(dqkv)
}

/// dQKV, and whether Σ rows of it went into `db` already (the GPU kernels' partials).
fn bwd_qkv(
    qkv: &Tensor,
    o: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    heads: QkvHeads,
    cfg: &AttnCfg,
    #[allow(unused_variables)] db: Option<(&Tensor, bool)>,
) -> Result<(Tensor, bool)> {
    const OP: &str = "attention_bwd_qkv";
    let dm = fused_dims(qkv, heads, cfg)?;
    let qd = [dm.b, dm.t, dm.hq, dm.d];
    check::shape(OP, o, &qd)?;
    check::shape(OP, dout, &qd)?;
    check::shape(OP, lse, &[dm.b, dm.hq, dm.t])?;
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[qkv, o, lse, dout])? {
        if let Some(r) = crate::cuda::ops::attention_bwd_qkv(&g, qkv, o, lse, dout, &gpu_shape(&dm, cfg), db)? {
            return Ok(r);
        }
        let (q, k, v) = crate::qkv_split(qkv, heads.hkv, heads.group, heads.d)?;
        let (dq, dk, dv) = attention_bwd(&q, &k, &v, o, lse, dout, cfg)?;
        return Ok((crate::qkv_merge(&dq, &dk, &dv)?, false));
    }
    check::on_cpu(OP, &[qkv, o, lse, dout])?;
    let docs = host_docs(OP, cfg, &dm)?;
    let (x, ov, lv, dov) = (qkv.read_f32()?, o.read_f32()?, lse.read_f32()?, dout.read_f32()?);
    // SAFETY: attention_bwd_fused copies (`=`) every head's rows of dq, dk and dv into their slots,
    // which tile dqkv.
    let mut dqkv = unsafe { buf::uninit(x.len()) };
    let m = mask(cfg, docs.as_deref());
    cpu::attention::attention_bwd_fused(&x, &ov, &lv, &dov, dm, m, scale(cfg, heads.d), &mut dqkv);
    Ok((check::out(dqkv, qkv.shape().clone(), dout.dtype(), qkv.device())?, false))
}

/// The attention dims of a fused projection output, checked as `qkv_split` and `dims` check them.
fn fused_dims(qkv: &Tensor, heads: QkvHeads, cfg: &AttnCfg) -> Result<AttnDims> {
    const OP: &str = "attention_qkv";
    let QkvHeads { hkv, group, d } = heads;
    check::float(OP, qkv)?;
    check::rank(OP, qkv, 3)?;
    let (b, t, w) = (qkv.dims()[0], qkv.dims()[1], qkv.dims()[2]);
    if hkv == 0 || group == 0 || w != hkv * (group + 2) * d {
        return Err(shape_mismatch(OP, format!("last dim {hkv}·({group}+2)·{d}"), qkv.dims()));
    }
    check_cfg(OP, cfg)?;
    let dims = AttnDims { b, t, s: t, hq: hkv * group, hkv, d };
    check_docs(OP, cfg, &dims, qkv.device())?;
    Ok(dims)
}

/// Context parallelism's combine: `o` [B, T, H, D] and `lse` [B, H, T] (both f32), the attention
/// of some keys, become in place the attention of those keys and the disjoint ones that gave
/// `o_part` (any float dtype) and `lse_part` (f32), as one softmax over both would (math in
/// `cpu::attn_merge`).
pub fn attention_merge_(o: &Tensor, lse: &Tensor, o_part: &Tensor, lse_part: &Tensor) -> Result<()> {
    const OP: &str = "attention_merge_";
    check::rank(OP, o, 4)?;
    check::float(OP, o_part)?;
    for t in [o, lse, lse_part] {
        if t.dtype() != DType::F32 {
            return Err(invalid(OP, format!("o, lse and lse_part must be f32 (the running sums), got {}", t.dtype())));
        }
    }
    let od = o.dims();
    let (b, t, h, d) = (od[0], od[1], od[2], od[3]);
    check::shape(OP, o_part, od)?;
    check::shape(OP, lse, &[b, h, t])?;
    check::shape(OP, lse_part, &[b, h, t])?;
    if [o_part, lse_part].iter().any(|x| x.shares_storage(o) || x.shares_storage(lse)) || o.shares_storage(lse) {
        return Err(invalid(OP, "the running (o, lse) must not share storage with each other or the part"));
    }
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[o, lse, o_part, lse_part])? {
        return crate::cuda::ops::attention_merge_(&g, o, lse, o_part, lse_part);
    }
    check::on_cpu(OP, &[o, lse, o_part, lse_part])?;
    let (op, lp) = (o_part.read_f32()?, lse_part.read_f32()?);
    o.update_f32(OP, |ov| lse.update_f32(OP, |lv| cpu::attn_merge::attention_merge(ov, lv, &op, &lp, (b, t, h, d))))?
}

/// (b, t, h, d, n) of a sink softmax call, checked: `o` [B, T, H, D] of a float dtype; `lse` f32,
/// [B, H, T] or context parallelism's chunk-major [n, B, H, T/n]; `sink` f32 [H].
fn sink_dims(op: &'static str, o: &Tensor, lse: &Tensor, sink: &Tensor) -> Result<cpu::attn_sink::SinkDims> {
    check::float(op, o)?;
    check::rank(op, o, 4)?;
    if lse.dtype() != DType::F32 || sink.dtype() != DType::F32 {
        return Err(invalid(
            op,
            format!("lse and the sink logits must be f32, got {} and {}", lse.dtype(), sink.dtype()),
        ));
    }
    let od = o.dims();
    let (b, t, h, d) = (od[0], od[1], od[2], od[3]);
    let n = match lse.dims() {
        [lb, lh, lt] if (*lb, *lh, *lt) == (b, h, t) => 1,
        [n, lb, lh, lc] if *n > 0 && (*lb, *lh, n * lc) == (b, h, t) => *n,
        ld => return Err(shape_mismatch(op, format!("lse [{b}, {h}, {t}] or chunk-major [n, {b}, {h}, {t}/n]"), ld)),
    };
    check::shape(op, sink, &[h])?;
    if o.shares_storage(lse) {
        return Err(invalid(op, "o and lse must not share storage"));
    }
    Ok((b, t, h, d, n))
}

/// The sink softmax (Megatron's --softmax-type off-by-one / learnable) on a finished attention:
/// `o` [B, T, H, D] and `lse` (f32, [B, H, T] or context parallelism's [n, B, H, T/n]) become in
/// place those of a softmax with one more logit `sink` [H] (f32) a head, a key with no value
/// (math in `cpu::attn_sink`). The attention backward on the new (o, lse) is then the sink
/// softmax's; [`attention_sink_bwd`] gives the sink's own gradient.
pub fn attention_sink_(o: &Tensor, lse: &Tensor, sink: &Tensor) -> Result<()> {
    const OP: &str = "attention_sink_";
    let dims = sink_dims(OP, o, lse, sink)?;
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[o, lse, sink])? {
        return crate::cuda::ops::attention_sink_(&g, o, lse, sink, dims);
    }
    check::on_cpu(OP, &[o, lse, sink])?;
    let s = sink.read_f32()?;
    o.update_f32(OP, |ov| lse.update_f32(OP, |lv| cpu::attn_sink::sink_fwd(ov, lv, &s, dims)))?
}

/// The sink logits' gradient terms of [`attention_sink_`]'s (o, lse) for dO: [B, T, H] f32, row
/// (b, t) of head h −e^(sink_h − lse)·⟨dO, O⟩. Their column sums over the B·T rows
/// ([`bias_grad_into`](crate::bias_grad_into) of [B·T, H]) are the gradient.
pub fn attention_sink_bwd(o: &Tensor, lse: &Tensor, d_o: &Tensor, sink: &Tensor) -> Result<Tensor> {
    const OP: &str = "attention_sink_bwd";
    let dims = sink_dims(OP, o, lse, sink)?;
    check::shape(OP, d_o, o.dims())?;
    check::same_dtype(OP, o, d_o)?;
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[o, lse, d_o, sink])? {
        return crate::cuda::ops::attention_sink_bwd(&g, o, lse, d_o, sink, dims);
    }
    check::on_cpu(OP, &[o, lse, d_o, sink])?;
    let (b, t, h, _, _) = dims;
    let mut term = vec![0.0f32; b * t * h];
    cpu::attn_sink::sink_bwd_terms(
        &o.read_f32()?,
        &lse.read_f32()?,
        &d_o.read_f32()?,
        &sink.read_f32()?,
        dims,
        &mut term,
    );
    check::out(term, [b, t, h], DType::F32, o.device())
}
