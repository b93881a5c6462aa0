//! Merging two attention results over disjoint key sets (context parallelism's combine).
//!
//! Shapes: o, o_p [B, T, H, D]; lse, lse_p [B, H, T]. With m = max(lse, lse_p), wa = e^(lse − m)
//! and wb = e^(lse_p − m): o ← (wa·o + wb·o_p) / (wa + wb), lse ← m + ln(wa + wb). That is the
//! softmax over the union of the keys, because each o is its own keys' probability-weighted V and
//! e^lse their normaliser. A row with no keys on either side (both −∞) stays as it is.

use rayon::prelude::*;

/// (b, t, h, d) of the merged tensors.
pub type MergeDims = (usize, usize, usize, usize);

/// `o`, `lse` ← the merge of themselves with `o_p`, `lse_p` (see the module doc).
pub fn attention_merge(o: &mut [f32], lse: &mut [f32], o_p: &[f32], lse_p: &[f32], (_, t, h, d): MergeDims) {
    // One batch row at a time: its o rows [T, H, D] and its lse rows [H, T].
    o.par_chunks_mut(t * h * d).zip(lse.par_chunks_mut(h * t)).enumerate().for_each(|(bb, (ob, lb))| {
        for tt in 0..t {
            for hh in 0..h {
                let li = hh * t + tt;
                let (la, lp) = (lb[li], lse_p[bb * h * t + li]);
                let m = la.max(lp);
                if m == f32::NEG_INFINITY {
                    continue;
                }
                let (wa, wb) = ((la - m).exp(), (lp - m).exp());
                let s = wa + wb;
                let row = (tt * h + hh) * d;
                let src = &o_p[bb * t * h * d + row..][..d];
                for (y, &x) in ob[row..row + d].iter_mut().zip(src) {
                    *y = (wa * *y + wb * x) / s;
                }
                lb[li] = m + s.ln();
            }
        }
    });
}
