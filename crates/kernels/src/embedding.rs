//! Embedding lookup: ids (u32, any shape) into table [V, C] → [ids..., C]; backward scatter-adds into
//! a gradient table (`+=`). Ids ≥ V are an error naming the id and V.
//!
//! The `_shard` forms serve a vocabulary-parallel embedding: the table holds rows
//! `vocab_start .. vocab_start + V` of a vocabulary of `vocab_total` real ids (rows past it are
//! padding); ids must be below `vocab_total`; other shards' ids give zero rows and no gradient here (the tensor-parallel all-reduce adds the shard that has them).

use crate::{buf, check, cpu};
use ferrotron_core::{DType, Result, Tensor, shape_mismatch};

/// What an embedding's ids index, for the out-of-range error.
const WHAT: &str = "vocabulary (embedding rows)";

pub fn embedding_fwd(ids: &Tensor, table: &Tensor) -> Result<Tensor> {
    embedding_fwd_shard(ids, table, 0, table.dims().first().copied().unwrap_or(0))
}

/// dtable += scatter(dout by ids).
pub fn embedding_bwd(ids: &Tensor, dout: &Tensor, dtable: &Tensor) -> Result<()> {
    embedding_bwd_shard(ids, dout, dtable, 0, dtable.dims().first().copied().unwrap_or(0))
}

fn shard(op: &'static str, table: &Tensor) -> Result<(usize, usize)> {
    check::float(op, table)?;
    check::rank(op, table, 2)?;
    Ok((table.dims()[0], table.dims()[1]))
}

pub fn embedding_fwd_shard(ids: &Tensor, table: &Tensor, vocab_start: usize, vocab_total: usize) -> Result<Tensor> {
    const OP: &str = "embedding_fwd";
    let (v, c) = shard(OP, table)?;
    check::dtype(OP, ids, DType::U32)?;
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[ids, table])? {
        if check::read_ids(ids) {
            check::ids(OP, ids, vocab_total, WHAT)?;
        }
        return crate::cuda::ops::embedding_fwd(&g, ids, table, vocab_start);
    }
    let idv = check::ids(OP, ids, vocab_total, WHAT)?;
    check::on_cpu(OP, &[ids, table])?;
    let tv = table.read_f32()?;
    // SAFETY: embedding_fwd writes each id's row (zeros for ids outside this shard).
    let mut out = unsafe { buf::uninit(idv.len() * c) };
    cpu::embedding::embedding_fwd(&idv, &tv, c, vocab_start..vocab_start + v, &mut out);
    let mut shape = ids.dims().to_vec();
    shape.push(c);
    check::out(out, shape, table.dtype(), table.device())
}

pub fn embedding_bwd_shard(
    ids: &Tensor,
    dout: &Tensor,
    dtable: &Tensor,
    vocab_start: usize,
    vocab_total: usize,
) -> Result<()> {
    const OP: &str = "embedding_bwd";
    let (v, c) = shard(OP, dtable)?;
    check::dtype(OP, ids, DType::U32)?;
    let n = ids.elem_count();
    if dout.elem_count() != n * c || dout.shape().last() != c {
        return Err(shape_mismatch(OP, format!("dout [{n}, {c}]"), dout.dims()));
    }
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[ids, dout, dtable])? {
        if check::read_ids(ids) {
            check::ids(OP, ids, vocab_total, WHAT)?;
        }
        if dtable.dtype() == DType::F32 {
            return crate::cuda::ops::embedding_bwd(&g, ids, dout, dtable, vocab_start);
        }
        // A bf16 table through the device's scratch where it applies, else as on the CPU below.
        if crate::cuda::ops::embedding_bwd_scratch(&g, ids, dout, dtable, vocab_start)? {
            return Ok(());
        }
    }
    if dtable.dtype() != DType::F32 {
        // A bf16 main_grad (`--grad-reduce-in-bf16`): the rows summed in f32 first, then added and
        // rounded once, as PyTorch's embedding backward sums a row before storing it; scatter-adds
        // straight into bf16 would round at every position.
        let sums = Tensor::zeros(dtable.dims(), DType::F32, dtable.device())?;
        embedding_bwd_shard(ids, dout, &sums, vocab_start, vocab_total)?;
        return crate::add_(dtable, &sums);
    }
    let idv = check::ids(OP, ids, vocab_total, WHAT)?;
    check::on_cpu(OP, &[ids, dout, dtable])?;
    let dv = dout.read_f32()?;
    dtable.update_f32(OP, |t| cpu::embedding::embedding_bwd(&idv, &dv, c, vocab_start..vocab_start + v, t))
}

/// The gradient of learned position embeddings whose ids are `start..start + L` in every row of
/// the batch: `dtable[start + t] (+)= Σ_b dout[b, t]` for dout [B, L, C]. The same as
/// `embedding_bwd` with those ids (the same sums in the same order, so the same bits), where a GPU
/// needs no atomics or scratch table for it: one thread per (position, column) sums the batch.
pub fn position_embedding_bwd(dout: &Tensor, dtable: &Tensor, start: usize) -> Result<()> {
    const OP: &str = "position_embedding_bwd";
    let (v, c) = shard(OP, dtable)?;
    check::rank(OP, dout, 3)?;
    let (b, l) = (dout.dims()[0], dout.dims()[1]);
    if dout.dims()[2] != c {
        return Err(shape_mismatch(OP, format!("dout [{b}, {l}, {c}]"), dout.dims()));
    }
    if start + l > v {
        return Err(ferrotron_core::invalid(
            OP,
            format!("positions {start}..{} outside the table's {v} rows: raise --max-position-embeddings", start + l),
        ));
    }
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[dout, dtable])? {
        return crate::cuda::ops::position_embedding_bwd(&g, dout, dtable, (b, l, c), start);
    }
    let ids: Vec<u32> = (0..b).flat_map(|_| (start..start + l).map(|i| i as u32)).collect();
    let ids = Tensor::from_vec(ids, [b, l], dout.device())?;
    embedding_bwd(&ids, dout, dtable)
}
