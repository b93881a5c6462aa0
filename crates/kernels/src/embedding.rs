//! Embedding lookup: ids (u32, any shape) into table [V, C] → [ids..., C]; backward scatter-adds into
//! a gradient table (`+=`). Ids ≥ V are an error naming the id and V.

use crate::{check, cpu};
use ferrotron_core::{Result, Tensor, shape_mismatch};

pub fn embedding_fwd(ids: &Tensor, table: &Tensor) -> Result<Tensor> {
    const OP: &str = "embedding_fwd";
    check::float(OP, table)?;
    check::rank(OP, table, 2)?;
    let (v, c) = (table.dims()[0], table.dims()[1]);
    let idv = check::ids(OP, ids, v, "vocabulary (embedding rows)")?;
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[ids, table])? {
        return crate::cuda::ops::embedding_fwd(&g, ids, table);
    }
    check::on_cpu(OP, &[ids, table])?;
    let tv = table.read_f32()?;
    let mut out = vec![0f32; idv.len() * c];
    cpu::embedding::embedding_fwd(&idv, &tv, c, &mut out);
    let mut shape = ids.dims().to_vec();
    shape.push(c);
    check::out(out, shape, table.dtype(), table.device())
}

/// dtable += scatter(dout by ids).
pub fn embedding_bwd(ids: &Tensor, dout: &Tensor, dtable: &Tensor) -> Result<()> {
    const OP: &str = "embedding_bwd";
    check::float(OP, dtable)?;
    check::rank(OP, dtable, 2)?;
    let (v, c) = (dtable.dims()[0], dtable.dims()[1]);
    let idv = check::ids(OP, ids, v, "vocabulary (embedding rows)")?;
    if dout.elem_count() != idv.len() * c || dout.shape().last() != c {
        return Err(shape_mismatch(OP, format!("dout [{}, {c}]", idv.len()), dout.dims()));
    }
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[ids, dout, dtable])? {
        return crate::cuda::ops::embedding_bwd(&g, ids, dout, dtable);
    }
    check::on_cpu(OP, &[ids, dout, dtable])?;
    let dv = dout.read_f32()?;
    dtable.update_f32(OP, |t| cpu::embedding::embedding_bwd(&idv, &dv, c, t))
}
