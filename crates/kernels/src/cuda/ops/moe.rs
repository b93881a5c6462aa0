//! Mixture-of-experts routing on the GPU (kernels/moe.cu): the router's kernels one warp per
//! token row, the combine grid-stride. Same results as `cpu::moe` within float rounding.

use super::*;
use crate::{RouterLoss, Score, TopK};

/// One warp (a 32-thread block) per row.
fn per_row(be: &B, name: &str, rows: usize, args: &[Arg]) -> Result<()> {
    be.launch(name, rows as u32, 32, 0, args)
}

fn score_arg(s: Score) -> Arg {
    Arg::I64(match s {
        Score::Softmax => 0,
        Score::Sigmoid => 1,
        Score::SqrtSoftplus => 2,
    })
}

pub fn moe_route(be: &B, logits: &Tensor, r: &TopK, bias: Option<&Tensor>) -> Result<(Tensor, Tensor)> {
    let (rows, e) = (logits.dims()[0], logits.dims()[1]);
    let probs = new(be, [rows, r.k], DType::F32)?;
    let experts = new(be, [rows, r.k], DType::U32)?;
    let name = format!("moe_route_{}", sfx("moe_route", logits.dtype())?);
    let (groups, gtopk) = r.groups.map_or((0, 0), |g| (g.num, g.topk));
    // The row's selection scores and the groups' scores in shared memory.
    let shared = 4 * (e + groups);
    if shared > 200 * 1024 {
        return Err(ferrotron_core::invalid(
            "moe_route",
            format!("{e} experts' scores do not fit a GPU block's shared memory"),
        ));
    }
    let args = [
        ptr("moe_route", logits)?,
        opt_ptr("moe_route", bias)?,
        ptr("moe_route", &probs)?,
        ptr("moe_route", &experts)?,
        n(e),
        n(r.k),
        Arg::I64(i64::from(r.pre_softmax)),
        Arg::F32(r.scale),
        score_arg(r.score),
        n(groups),
        n(gtopk),
    ];
    be.launch(&name, rows as u32, 32, shared as u32, &args)?;
    Ok((probs, experts))
}

pub fn moe_route_bwd(be: &B, logits: &Tensor, experts: &Tensor, dprobs: &Tensor, r: &TopK) -> Result<Tensor> {
    let (rows, e) = (logits.dims()[0], logits.dims()[1]);
    let dprobs = in_dtype(dprobs, DType::F32)?;
    let dl = new(be, [rows, e], logits.dtype())?;
    let name = format!("moe_route_bwd_{}", sfx("moe_route_bwd", logits.dtype())?);
    let args = [
        ptr("moe_route_bwd", logits)?,
        ptr("moe_route_bwd", experts)?,
        ptr("moe_route_bwd", &dprobs)?,
        ptr("moe_route_bwd", &dl)?,
        n(e),
        n(r.k),
        Arg::I64(i64::from(r.pre_softmax)),
        Arg::F32(r.scale),
        score_arg(r.score),
    ];
    per_row(be, &name, rows, &args)?;
    Ok(dl)
}

pub fn moe_router_loss(be: &B, logits: &Tensor, counts: &Tensor, l: &RouterLoss) -> Result<(Tensor, Tensor)> {
    let (rows, e) = (logits.dims()[0], logits.dims()[1]);
    let counts = in_dtype(counts, DType::F32)?;
    let dl = new(be, [rows, e], DType::F32)?;
    // Summed by atomics: starts at zero.
    let values = Tensor::zeros([2], DType::F32, logits.device())?;
    let seqs = l.seqs.max(1);
    let per_seq = l.total_tokens as f32 / seqs as f32;
    let w = e as f32 / ((l.topk * seqs) as f32 * per_seq * per_seq);
    let name = format!("moe_router_loss_{}", sfx("moe_router_loss", logits.dtype())?);
    let args = [
        ptr("moe_router_loss", logits)?,
        ptr("moe_router_loss", &counts)?,
        ptr("moe_router_loss", &dl)?,
        ptr("moe_router_loss", &values)?,
        n(e),
        // moe.cu's `n`: the z-loss's mean's count.
        n(l.total_tokens),
        Arg::F32(w),
        Arg::F32(l.aux_coeff),
        Arg::F32(l.z_coeff),
        Arg::F32(l.grad_scale),
        score_arg(l.score),
        // Rows of one sequence: the counts' row.
        n(rows / seqs),
    ];
    per_row(be, &name, rows, &args)?;
    Ok((values, dl))
}

pub fn moe_unpermute(be: &B, yp: &Tensor, slot: &Tensor, probs: &Tensor) -> Result<Tensor> {
    let (rows, k) = (slot.dims()[0], slot.dims()[1]);
    let c = yp.dims()[1];
    let probs = in_dtype(probs, DType::F32)?;
    let y = new(be, [rows, c], yp.dtype())?;
    let name = format!("moe_unpermute_{}", sfx("moe_unpermute", yp.dtype())?);
    let args = [
        ptr("moe_unpermute", yp)?,
        ptr("moe_unpermute", slot)?,
        ptr("moe_unpermute", &probs)?,
        ptr("moe_unpermute", &y)?,
        n(rows),
        n(k),
        n(c),
        n(yp.dims()[0]),
    ];
    ew(be, &name, rows * c, &args)?;
    Ok(y)
}

pub fn moe_unpermute_bwd(be: &B, yp: &Tensor, slot: &Tensor, probs: &Tensor, dy: &Tensor) -> Result<(Tensor, Tensor)> {
    let (rows, k) = (slot.dims()[0], slot.dims()[1]);
    let c = yp.dims()[1];
    let probs = in_dtype(probs, DType::F32)?;
    let dy = in_dtype(dy, yp.dtype())?;
    // Every kept copy writes its row of dyp; a dropped one (slot DROPPED) has none.
    let yp_rows = yp.dims()[0];
    let dyp = new(be, [yp_rows, c], yp.dtype())?;
    let dp = new(be, [rows, k], DType::F32)?;
    let s = sfx("moe_unpermute_bwd", yp.dtype())?;
    let op = "moe_unpermute_bwd";
    let args = [ptr(op, &dy)?, ptr(op, slot)?, ptr(op, &probs)?, ptr(op, &dyp)?, n(rows), n(k), n(c), n(yp_rows)];
    ew(be, &format!("moe_unpermute_bwd_dyp_{s}"), rows * k * c, &args)?;
    let args = [ptr(op, yp)?, ptr(op, slot)?, ptr(op, &dy)?, ptr(op, &dp)?, n(rows), n(k), n(c), n(yp_rows)];
    per_row(be, &format!("moe_unpermute_bwd_dp_{s}"), rows * k, &args)?;
    Ok((dyp, dp))
}
