//! The sink softmax (Megatron's --softmax-type off-by-one / learnable; gpt-oss's attention sinks):
//! each head h has one more logit s_h in every row's softmax, a key with no value. It only
//! lowers the row's other probabilities, so it is applied to a finished attention (o, lse):
//!
//!   o ← o · σ(lse − s_h)          (the old normaliser e^lse over the new one e^lse + e^s_h)
//!   lse ← ln(e^lse + e^s_h)
//!
//! Backward: the attention backward on the new (o, lse) is already the sink softmax's for
//! dq, dk, dv (its rowsum D = ⟨dO, O⟩ sums over the keys with a value, and the sink has none),
//! and ds_h = Σ_rows −p_sink · D with p_sink = e^(s_h − lse), the new lse.
//!
//! Shapes: o, dO [B, T, H, D]; s [H]; lse [B, H, T], or context parallelism's chunk-major
//! [n, B, H, T/n] (`n` chunks of each sequence: row t is chunk t / (T/n), position t mod (T/n)).

use crate::real::Real;
use rayon::prelude::*;

/// (b, t, h, d, n): the attention's dims and the chunks its lse is laid out in.
pub type SinkDims = (usize, usize, usize, usize, usize);

/// Where row (bb, tt) of head hh sits in lse.
fn lse_at((b, t, h, _, n): SinkDims, bb: usize, tt: usize, hh: usize) -> usize {
    let c = t / n;
    ((tt / c * b + bb) * h + hh) * c + tt % c
}

/// ln(e^a + e^b) without overflow; −∞ only if both are.
fn log_add<T: Real>(a: T, b: T) -> T {
    let m = a.max(b);
    if m == T::neg_infinity() {
        return m;
    }
    m + ((a - m).exp() + (b - m).exp()).ln()
}

/// `o`, `lse` ← the sink softmax's (see the module doc).
pub fn sink_fwd<T: Real>(o: &mut [T], lse: &mut [T], sink: &[T], dims: SinkDims) {
    let (_, t, h, d, _) = dims;
    // Each row's factor σ(lse − s) = e^lse / (e^lse + e^s), read before lse changes.
    let factor: Vec<T> = (0..o.len() / d)
        .into_par_iter()
        .map(|row| {
            let (bb, tt, hh) = (row / (t * h), row / h % t, row % h);
            let l = lse[lse_at(dims, bb, tt, hh)];
            (l - log_add(l, sink[hh])).exp()
        })
        .collect();
    o.par_chunks_mut(d).zip(&factor).for_each(|(r, &f)| r.iter_mut().for_each(|x| *x = *x * f));
    // lse's index i is of head i / (T/n) mod H in either layout.
    let c = t / dims.4;
    lse.par_iter_mut().enumerate().for_each(|(i, l)| *l = log_add(*l, sink[i / c % h]));
}

/// The sink's gradient terms, one a row: term[(bb·T + tt)·H + hh] = −e^(s_h − lse)·⟨dO, O⟩ on
/// the forward's new (o, lse); ds = Σ over rows (a bias gradient's column sums of [B·T, H]).
pub fn sink_bwd_terms<T: Real>(o: &[T], lse: &[T], d_o: &[T], sink: &[T], dims: SinkDims, term: &mut [T]) {
    let (_, t, h, d, _) = dims;
    term.par_iter_mut().enumerate().for_each(|(row, out)| {
        let (bb, tt, hh) = (row / (t * h), row / h % t, row % h);
        let dot: T = o[row * d..][..d].iter().zip(&d_o[row * d..][..d]).map(|(&x, &g)| x * g).sum();
        *out = -(sink[hh] - lse[lse_at(dims, bb, tt, hh)]).exp() * dot;
    });
}
