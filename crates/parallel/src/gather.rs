//! Whole parameters from tensor-parallel shards (for checks, checkpoints and layout tables).

use crate::Result;
use crate::groups::Comm;
use ferrotron_core::{DType, ParamMeta, Shard, Tensor};

/// Row-major flat index in the whole parameter of element `i` of the shard held by `shard.rank`.
pub fn global_flat_index(meta: &ParamMeta, shard: Shard, i: usize) -> usize {
    let Some(d) = meta.split_dim else { return i };
    let (local, global) = (meta.local_shape.dims(), meta.global_shape.dims());
    let inner: usize = local[d + 1..].iter().product();
    let (outer_i, rest) = (i / (local[d] * inner), i % (local[d] * inner));
    let (l, j) = (rest / inner, rest % inner);
    (outer_i * global[d] + shard.global_index(l, global[d])) * inner + j
}

/// The whole parameter as f32, on every rank of `tp` (collective over `tp`).
pub fn gather_param(tp: &Comm, meta: &ParamMeta, local: &Tensor) -> Result<Vec<f32>> {
    if meta.split_dim.is_none() || tp.size() == 1 {
        return Ok(local.to_vec_f32()?);
    }
    let n = local.elem_count();
    let src = Tensor::from_f32(&local.to_vec_f32()?, [n], DType::F32, &ferrotron_core::Device::Cpu)?;
    let all = Tensor::zeros([tp.size() * n], DType::F32, &ferrotron_core::Device::Cpu)?;
    tp.all_gather(&src, &all)?;
    let all = all.to_vec_f32()?;
    let mut out = vec![0f32; meta.global_shape.elem_count()];
    for r in 0..tp.size() {
        let shard = Shard { rank: r, ..meta.shard };
        for i in 0..n {
            out[global_flat_index(meta, shard, i)] = all[r * n + i];
        }
    }
    Ok(out)
}
