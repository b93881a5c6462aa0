//! Embedding lookup. Shapes: ids [N]; table, dtable [V, C]; out, dout [N, C].
//! Backward is a scatter-add into dtable (`+=`, the main_grad rule), sequential in id order so that
//! repeated ids sum deterministically. Ids are checked by the caller.

use crate::real::Real;
use rayon::prelude::*;

pub fn embedding_fwd<T: Real>(ids: &[u32], table: &[T], c: usize, out: &mut [T]) {
    out.par_chunks_mut(c).zip(ids.par_iter()).for_each(|(o, &id)| {
        let r = id as usize * c;
        o.copy_from_slice(&table[r..r + c]);
    });
}

pub fn embedding_bwd<T: Real>(ids: &[u32], dout: &[T], c: usize, dtable: &mut [T]) {
    for (n, &id) in ids.iter().enumerate() {
        let r = id as usize * c;
        for (d, &g) in dtable[r..r + c].iter_mut().zip(&dout[n * c..(n + 1) * c]) {
            *d += g;
        }
    }
}
