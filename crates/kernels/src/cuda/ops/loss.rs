//! Softmax cross-entropy.

use super::*;

/// The arguments both cross-entropy kernels start with: logits, targets, mask, ignore index,
/// the shard's first vocabulary column and its real (unpadded) column count.
fn ce_args(logits: &Tensor, targets: &Tensor, mask: Option<&Tensor>, cfg: crate::CrossEntropyCfg) -> Result<Vec<Arg>> {
    let v = logits.dims()[1];
    Ok(vec![
        ptr("ce", logits)?,
        ptr("ce", targets)?,
        opt_ptr("ce", mask)?,
        Arg::I64(cfg.ignore_index.map_or(-1, |i| i as i64)),
        n(cfg.vocab_start as usize),
        n(cfg.real_columns(v)),
    ])
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
    let mut name = format!("ce_fwd_{}", sfx("cross_entropy_fwd", logits.dtype())?);
    let wide = v % 8 == 0 && aligned16(&[logits])?;
    if wide {
        name += "_v8";
    }
    let mut args = ce_args(logits, targets, mask, cfg)?;
    args.extend([ptr("ce", &loss)?, ptr("ce", &lse)?, n(v)]);
    ce_launch(be, &name, rows, wide, &args)?;
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
    let mut name = format!("ce_bwd_{}", sfx("cross_entropy_bwd", logits.dtype())?);
    if v % 8 == 0 && aligned16(&[logits, &d])? {
        name += "_v8";
    }
    let mut args = ce_args(logits, targets, mask, cfg)?;
    args.extend([ptr("ce", lse)?, ptr("ce", dloss)?, ptr("ce", &d)?, n(v)]);
    rows_launch(be, &name, rows, &args)?;
    Ok(d)
}

/// `ce_fwd` and `ce_bwd` (dloss = `dscale` on every row) in one launch, the gradient written over
/// the logits (a whole vocabulary: no shard offset).
pub fn ce_fwd_bwd_(
    be: &B,
    logits: &Tensor,
    targets: &Tensor,
    mask: Option<&Tensor>,
    cfg: crate::CrossEntropyCfg,
    dscale: crate::RowScale,
) -> Result<(Tensor, Tensor)> {
    let (rows, v) = (logits.dims()[0], logits.dims()[1]);
    let (loss, lse) = (new(be, [rows], DType::F32)?, new(be, [rows], DType::F32)?);
    let mut name = format!("ce_fwdbwd_{}", sfx("cross_entropy_fwd_bwd_", logits.dtype())?);
    let wide = v % 8 == 0 && aligned16(&[logits])?;
    // A bf16 row's first 110 KB (56,320 columns: all of a GPT-2 vocabulary, 44% of a 128k one)
    // kept in shared memory between the passes (two blocks an SM), as much as the card lets a
    // block have besides the reductions' 1 KB.
    let kcap = v.min(KEEP_BYTES / 2).min(be.smem_optin.saturating_sub(1024) / 2) / 8 * 8;
    let keep = wide && logits.dtype() == DType::BF16 && kcap > 0 && keep_row();
    if wide {
        name += "_v8";
    }
    let mut args = vec![
        ptr("ce", logits)?,
        ptr("ce", targets)?,
        opt_ptr("ce", mask)?,
        Arg::I64(cfg.ignore_index.map_or(-1, |i| i as i64)),
        n(cfg.real_columns(v)),
        ptr("ce", &loss)?,
        ptr("ce", &lse)?,
        Arg::F32(if let crate::RowScale::Value(x) = dscale { x } else { 0.0 }),
        opt_ptr("ce", if let crate::RowScale::Read(t) = dscale { Some(t) } else { None })?,
        n(v),
    ];
    if keep {
        args.push(n(kcap));
        be.launch("ce_fwdbwd_bf16_keep", rows as u32, 1024, (kcap * 2) as u32, &args)?;
    } else {
        ce_launch(be, &name, rows, wide, &args)?;
    }
    Ok((loss, lse))
}

/// One block per row: 1024 threads for the eight-wide forwards (the kept-row kernel's count, so
/// the three sum each row's groups alike and agree to the bit; session 21 timed 1024 a row at
/// least as fast as 128–512), else 256.
fn ce_launch(be: &B, name: &str, rows: usize, wide: bool, args: &[Arg]) -> Result<()> {
    be.launch(name, rows as u32, if wide { 1024 } else { 256 }, 0, args)
}

/// The most of a bf16 row the fused cross-entropy keeps in shared memory.
const KEEP_BYTES: usize = 110 << 10;

/// Whether the fused cross-entropy keeps its row in shared memory (`FERROTRON_CE_KEEP=0`: not; a
/// measurement switch).
fn keep_row() -> bool {
    static ENV: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ENV.get_or_init(|| std::env::var("FERROTRON_CE_KEEP").as_deref() != Ok("0"))
}

/// The vocabulary-parallel combine of the shards' (lse, loss): one thread per row.
pub fn ce_combine(be: &B, all: &Tensor, mask: Option<&Tensor>, shards: usize, rows: usize) -> Result<(Tensor, Tensor)> {
    let (loss, lse) = (new(be, [rows], DType::F32)?, new(be, [rows], DType::F32)?);
    let args = [
        ptr("ce_combine", all)?,
        opt_ptr("ce_combine", mask)?,
        ptr("ce_combine", &loss)?,
        ptr("ce_combine", &lse)?,
        n(shards),
        n(rows),
    ];
    ew(be, "ce_combine_f32", rows, &args)?;
    Ok((loss, lse))
}
