//! Embedding lookup. Shapes: ids [N]; table, dtable [V, C]; out, dout [N, C].
//! Backward is a scatter-add into dtable (`+=`, the main_grad rule), sequential in id order so that
//! repeated ids sum deterministically. Ids are checked by the caller. The table holds the rows
//! `rows` of the vocabulary (all of it unless vocabulary-parallel); other ids read as zero rows and
//! add no gradient.

use crate::real::Real;
use rayon::prelude::*;
use std::ops::Range;

pub fn embedding_fwd<T: Real>(ids: &[u32], table: &[T], c: usize, rows: Range<usize>, out: &mut [T]) {
    out.par_chunks_mut(c).zip(ids.par_iter()).for_each(|(o, &id)| {
        if !rows.contains(&(id as usize)) {
            o.fill(T::zero());
            return;
        }
        let r = (id as usize - rows.start) * c;
        o.copy_from_slice(&table[r..r + c]);
    });
}

pub fn embedding_bwd<T: Real>(ids: &[u32], dout: &[T], c: usize, rows: Range<usize>, dtable: &mut [T]) {
    for (n, &id) in ids.iter().enumerate() {
        if !rows.contains(&(id as usize)) {
            continue;
        }
        let r = (id as usize - rows.start) * c;
        for (d, &g) in dtable[r..r + c].iter_mut().zip(&dout[n * c..(n + 1) * c]) {
            *d += g;
        }
    }
}
