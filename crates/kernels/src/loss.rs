//! Fused softmax cross-entropy (math in `cpu::loss`): logits [N, V] in f32/bf16/f16 are read in
//! place, one row at a time; per-token loss and lse come back as f32 [N].

use crate::cpu::loss::{CeCfg, Elem};
use crate::{buf, check, cpu};
use ferrotron_core::{CpuStorage, DType, Error, Result, Tensor, shape_mismatch};

pub use crate::cpu::loss::CeCfg as CrossEntropyCfg;

/// Checked shapes, and on the CPU the targets and mask the math reads (empty for a GPU run).
struct Inputs {
    n: usize,
    v: usize,
    targets: Vec<u32>,
    mask: Option<Vec<f32>>,
}

fn inputs(op: &'static str, logits: &Tensor, targets: &Tensor, mask: Option<&Tensor>, cfg: CeCfg) -> Result<Inputs> {
    check::float(op, logits)?;
    check::rank(op, logits, 2)?;
    if !logits.is_contiguous() {
        return Err(Error::NotContiguous { op });
    }
    let (n, v) = (logits.dims()[0], logits.dims()[1]);
    check::dtype(op, targets, DType::U32)?;
    if targets.elem_count() != n {
        return Err(shape_mismatch(op, format!("targets with {n} elements"), targets.dims()));
    }
    let mut all = vec![logits, targets];
    if let Some(m) = mask {
        if m.elem_count() != n {
            return Err(shape_mismatch(op, format!("loss mask with {n} elements"), m.dims()));
        }
        all.push(m);
    }
    #[cfg(not(feature = "cuda"))]
    let (on_gpu, read) = {
        check::on_cpu(op, &all)?;
        (false, true)
    };
    // On a GPU the targets are read back only to be checked, and not where the caller has
    // checked them (`set_device_ids_prechecked`): the read waits for all queued work.
    #[cfg(feature = "cuda")]
    let (on_gpu, read) = match crate::cuda::gpu(op, &all)? {
        Some(_) => (true, check::read_ids(targets)),
        None => (false, true),
    };
    let raw = if read { targets.to_vec::<u32>()? } else { Vec::new() };
    let bound = cfg.vocab_total.map_or(v, |t| t as usize);
    if let Some(&bad) = raw.iter().find(|&&t| t as usize >= bound && cfg.ignore_index != Some(t)) {
        return Err(Error::IndexOutOfRange {
            op,
            what: "vocabulary (logit columns)",
            index: bad as u64,
            bound: bound as u64,
        });
    }
    let mask = if on_gpu { None } else { mask.map(|m| m.to_vec_f32()).transpose()? };
    Ok(Inputs { n, v, targets: raw, mask })
}

/// Runs `f` on the logits' typed elements (f32, bf16 or f16).
fn with_logits<R>(op: &'static str, logits: &Tensor, f: &mut dyn FnMut(LogitSlice<'_>) -> R) -> Result<R> {
    let g = logits.storage();
    let r = logits.layout().contiguous_range().ok_or(Error::NotContiguous { op })?;
    Ok(match g.as_cpu() {
        Some(CpuStorage::F32(x)) => f(LogitSlice::F32(&x[r])),
        Some(CpuStorage::BF16(x)) => f(LogitSlice::BF16(&x[r])),
        Some(CpuStorage::F16(x)) => f(LogitSlice::F16(&x[r])),
        _ => return Err(Error::DTypeMismatch { op, expected: "f32, bf16 or f16 logits".into(), got: logits.dtype() }),
    })
}

enum LogitSlice<'a> {
    F32(&'a [f32]),
    BF16(&'a [half::bf16]),
    F16(&'a [half::f16]),
}

/// Returns (loss [N], lse [N]), both f32; masked and ignored rows have loss 0. On a vocabulary
/// shard (`cfg.vocab_start`), lse is the shard's and loss is `lse - logit[target]` with the target
/// logit taken as 0 when it lies in another shard; padding columns (`cfg.vocab_total`) are left out. On a vocabulary
/// shard (`cfg.vocab_start`), lse is the shard's and loss is `lse - logit[target]` with the target
/// logit taken as 0 when it lies in another shard.
pub fn cross_entropy_fwd(
    logits: &Tensor,
    targets: &Tensor,
    mask: Option<&Tensor>,
    cfg: CeCfg,
) -> Result<(Tensor, Tensor)> {
    const OP: &str = "cross_entropy_fwd";
    let inp = inputs(OP, logits, targets, mask, cfg)?;
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[logits])? {
        return crate::cuda::ops::ce_fwd(&g, logits, targets, mask, cfg);
    }
    // SAFETY: cross_entropy_fwd writes every row's loss (zero where masked) and lse.
    let (mut loss, mut lse) = unsafe { (buf::uninit(inp.n), buf::uninit(inp.n)) };
    let m = inp.mask.as_deref();
    with_logits(OP, logits, &mut |l| match l {
        LogitSlice::F32(x) => cpu::loss::cross_entropy_fwd(x, inp.v, &inp.targets, m, cfg, &mut loss, &mut lse),
        LogitSlice::BF16(x) => cpu::loss::cross_entropy_fwd(x, inp.v, &inp.targets, m, cfg, &mut loss, &mut lse),
        LogitSlice::F16(x) => cpu::loss::cross_entropy_fwd(x, inp.v, &inp.targets, m, cfg, &mut loss, &mut lse),
    })?;
    Ok((
        check::out(loss, [inp.n], DType::F32, logits.device())?,
        check::out(lse, [inp.n], DType::F32, logits.device())?,
    ))
}

fn bwd_typed<E: Elem + ferrotron_core::WithDType>(
    x: &[E],
    inp: &Inputs,
    cfg: CeCfg,
    lse: &[f32],
    dloss: &[f32],
    shape: &[usize],
    dev: &ferrotron_core::Device,
) -> Result<Tensor> {
    let mut d = vec![E::put(0f32); x.len()];
    cpu::loss::cross_entropy_bwd(x, inp.v, &inp.targets, inp.mask.as_deref(), cfg, lse, dloss, &mut d);
    Tensor::from_vec(d, shape.to_vec(), dev)
}

/// dlogits [N, V] in the logits' dtype, given the saved lse and dloss [N] (e.g. 1/tokens).
pub fn cross_entropy_bwd(
    logits: &Tensor,
    targets: &Tensor,
    mask: Option<&Tensor>,
    lse: &Tensor,
    dloss: &Tensor,
    cfg: CeCfg,
) -> Result<Tensor> {
    const OP: &str = "cross_entropy_bwd";
    let inp = inputs(OP, logits, targets, mask, cfg)?;
    check::shape(OP, lse, &[inp.n])?;
    if dloss.elem_count() != inp.n {
        return Err(shape_mismatch(OP, format!("dloss with {} elements", inp.n), dloss.dims()));
    }
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[logits, lse, dloss])? {
        return crate::cuda::ops::ce_bwd(&g, logits, targets, mask, cfg, lse, dloss);
    }
    check::on_cpu(OP, &[logits, lse, dloss])?;
    let (lv, dv) = (lse.to_vec_f32()?, dloss.to_vec_f32()?);
    let (shape, dev) = (logits.dims().to_vec(), logits.device().clone());
    with_logits(OP, logits, &mut |l| match l {
        LogitSlice::F32(x) => bwd_typed(x, &inp, cfg, &lv, &dv, &shape, &dev),
        LogitSlice::BF16(x) => bwd_typed(x, &inp, cfg, &lv, &dv, &shape, &dev),
        LogitSlice::F16(x) => bwd_typed(x, &inp, cfg, &lv, &dv, &shape, &dev),
    })?
}

/// The loss gradient given to every row by [`cross_entropy_fwd_bwd_`]: a value fixed when the op
/// is queued, or the one f32 of a tensor on the logits' device, read when the op runs. A CUDA
/// graph that captured the op then takes whatever was written there since, such as 1 / the loss
/// token count of each replayed step's batch.
#[derive(Clone, Copy, Debug)]
pub enum RowScale<'a> {
    Value(f32),
    Read(&'a Tensor),
}

/// [`cross_entropy_fwd`], then [`cross_entropy_bwd`] with dloss = `dscale` on every row, the
/// gradient written over `logits` in place (the same values, bit for bit); returns (loss, lse).
/// One read of the logits instead of two and no second [N, V] buffer. A whole vocabulary only
/// (`cfg.vocab_start` 0): a shard's gradient needs the whole lse, known after the shards combine.
pub fn cross_entropy_fwd_bwd_(
    logits: &Tensor,
    targets: &Tensor,
    mask: Option<&Tensor>,
    cfg: CeCfg,
    dscale: RowScale,
) -> Result<(Tensor, Tensor)> {
    const OP: &str = "cross_entropy_fwd_bwd_";
    if cfg.vocab_start != 0 {
        return Err(ferrotron_core::invalid(
            OP,
            "a vocabulary shard (vocab_start > 0) needs the whole lse: use cross_entropy_fwd, combine, then cross_entropy_bwd",
        ));
    }
    let inp = inputs(OP, logits, targets, mask, cfg)?;
    if let RowScale::Read(t) = dscale {
        if !t.device().same(logits.device()) {
            return Err(Error::DeviceMismatch { op: OP, a: logits.device().name(), b: t.device().name() });
        }
        if t.dtype() != DType::F32 || t.elem_count() != 1 {
            return Err(ferrotron_core::invalid(
                OP,
                format!(
                    "the row scale tensor is {:?} {:?}: give one f32 (1 / the loss token count)",
                    t.dtype(),
                    t.dims()
                ),
            ));
        }
    }
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[logits])? {
        return crate::cuda::ops::ce_fwd_bwd_(&g, logits, targets, mask, cfg, dscale);
    }
    let dscale = match dscale {
        RowScale::Value(x) => x,
        RowScale::Read(t) => t.to_vec_f32()?[0],
    };
    // SAFETY: cross_entropy_fwd_bwd_ writes every row's loss and lse.
    let (mut loss, mut lse) = unsafe { (buf::uninit(inp.n), buf::uninit(inp.n)) };
    let m = inp.mask.as_deref();
    logits.update_f32(OP, |x| {
        cpu::loss::cross_entropy_fwd_bwd_(x, inp.v, &inp.targets, m, cfg, dscale, &mut loss, &mut lse)
    })?;
    Ok((
        check::out(loss, [inp.n], DType::F32, logits.device())?,
        check::out(lse, [inp.n], DType::F32, logits.device())?,
    ))
}

/// The whole vocabulary's (loss [rows], lse [rows]) from the tensor-parallel shards' forward
/// results gathered in rank order, `all` [tp, 2, rows] f32 (each shard's lse row, then its loss
/// row), and the loss mask [rows]. On a GPU it runs there (no read-back inside a step).
pub fn ce_combine_shards(all: &Tensor, mask: Option<&Tensor>) -> Result<(Tensor, Tensor)> {
    const OP: &str = "ce_combine_shards";
    check::dtype(OP, all, DType::F32)?;
    check::rank(OP, all, 3)?;
    let (n, rows) = (all.dims()[0], all.dims()[2]);
    if all.dims()[1] != 2 {
        return Err(shape_mismatch(OP, "[shards, 2, rows] (lse, then loss)", all.dims()));
    }
    if let Some(m) = mask {
        check::dtype(OP, m, DType::F32)?;
        if m.elem_count() != rows {
            return Err(shape_mismatch(OP, format!("loss mask with {rows} elements"), m.dims()));
        }
    }
    let ts: Vec<&Tensor> = [Some(all), mask].into_iter().flatten().collect();
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &ts)? {
        return crate::cuda::ops::ce_combine(&g, all, mask, n, rows);
    }
    check::on_cpu(OP, &ts)?;
    let (av, mv) = (all.read_f32()?, mask.map(|m| m.read_f32()).transpose()?);
    // SAFETY: ce_combine_shards writes every row's loss and lse.
    let (mut loss, mut lse) = unsafe { (buf::uninit(rows), buf::uninit(rows)) };
    cpu::loss::ce_combine_shards(&av, n, rows, mv.as_deref(), &mut loss, &mut lse);
    Ok((check::out(loss, [rows], DType::F32, all.device())?, check::out(lse, [rows], DType::F32, all.device())?))
}
