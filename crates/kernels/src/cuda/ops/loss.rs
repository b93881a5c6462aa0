//! Softmax cross-entropy.

use super::*;

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
