//! FP8 delayed scaling's state in checkpoints. Each FP8 linear layer's slot is one fp32 buffer
//! named after its weight, `{weight}.fp8_meta` (a part of one: `{weight}.{part}.fp8_meta`, as
//! Mamba's in_proj blocks `z`, `xbc`, `dt`): the scales of x, w and dy, then x's, w's and
//! dy's amax histories (history_len values each, row order). The trainer reduces the amaxes over
//! every rank of a pipeline stage, so the state is alike on all of them and saved as the other
//! buffers are (by the stage's first tensor- and data-parallel rank); named by weight, it loads
//! into any other layout.

use crate::checkpoint::Parts;
use ferrotron_core::{Fp8Metas, ParamMeta, ParamTable};

fn name(weight: &str, part: &str) -> String {
    if part.is_empty() { format!("{weight}.fp8_meta") } else { format!("{weight}.{part}.fp8_meta") }
}

/// The buffers of every slot of `metas`, read from the device.
pub fn buffers(metas: &Fp8Metas, table: &ParamTable) -> anyhow::Result<Vec<(String, Vec<f32>)>> {
    let t = metas.tensors()?;
    let (len, n) = (metas.config.history_len, t.bwd_scale.elem_count());
    let (fh, fs, bh, bs) = (
        t.fwd_history.to_vec_f32()?,
        t.fwd_scale.to_vec_f32()?,
        t.bwd_history.to_vec_f32()?,
        t.bwd_scale.to_vec_f32()?,
    );
    let column = |h: &[f32], width: usize, c: usize| (0..len).map(move |r| h[r * width + c]).collect::<Vec<_>>();
    Ok(metas
        .weights()
        .into_iter()
        .enumerate()
        .map(|(i, (w, part))| {
            let mut v = vec![fs[2 * i], fs[2 * i + 1], bs[i]];
            v.extend(column(&fh, 2 * n, 2 * i));
            v.extend(column(&fh, 2 * n, 2 * i + 1));
            v.extend(column(&bh, n, i));
            (name(&table.meta(w).name, part), v)
        })
        .collect())
}

/// Sets `metas` from a checkpoint's buffers; returns how many slots it lacked (saved without
/// delayed scaling, with another --fp8-amax-history-len, or before a layer had FP8 products:
/// those start fresh, scale 1 and an empty history, as Transformer Engine's do).
pub fn restore(ck: &dyn Parts, metas: &Fp8Metas, table: &ParamTable) -> anyhow::Result<usize> {
    let t = metas.tensors()?;
    let (len, n) = (metas.config.history_len, t.bwd_scale.elem_count());
    let (mut fh, mut fs, mut bh, mut bs) = (
        t.fwd_history.to_vec_f32()?,
        t.fwd_scale.to_vec_f32()?,
        t.bwd_history.to_vec_f32()?,
        t.bwd_scale.to_vec_f32()?,
    );
    let mut absent = 0;
    let k = 3 + 3 * len;
    for (i, (w, part)) in metas.weights().into_iter().enumerate() {
        let key = name(&table.meta(w).name, part);
        let m = ParamMeta::replicated(&key, [k], ferrotron_core::Init::Zeros, false);
        let Ok(v) = ck.part(&m, &key, 0..k) else {
            absent += 1;
            continue;
        };
        (fs[2 * i], fs[2 * i + 1], bs[i]) = (v[0], v[1], v[2]);
        for r in 0..len {
            fh[r * 2 * n + 2 * i] = v[3 + r];
            fh[r * 2 * n + 2 * i + 1] = v[3 + len + r];
            bh[r * n + i] = v[3 + 2 * len + r];
        }
    }
    t.fwd_history.copy_from_f32(&fh)?;
    t.fwd_scale.copy_from_f32(&fs)?;
    t.bwd_history.copy_from_f32(&bh)?;
    t.bwd_scale.copy_from_f32(&bs)?;
    Ok(absent)
}
