//! Mixture-of-experts routing and combining, Megatron-Core's top-k router (softmax score).
//!
//! Shapes: logits, dlogits [N, E] (N tokens, E experts); probs, dprobs and experts [N, K] (the K
//! experts a token goes to, best first); yp, dyp [N·K, C] (the tokens' copies sorted by expert);
//! slot [N, K] (the row of yp holding token n's j-th copy); y, dy [N, C].
//!
//! - `topk_route`: the K largest logits of a row (ties to the lower expert), then either softmax
//!   over those K (Megatron's default, Mixtral's renormalised top-k) or, with `pre_softmax`, the
//!   softmax over all E read at the K places; both times `scale`.
//! - `router_loss`: the load-balancing loss E / (K·T²) · Σ_e (Σ_n S[n, e]) · c_e (S the softmax over
//!   all experts, c_e the copies routed to e, T the tokens the counts were taken over) and the
//!   z-loss Σ_n logsumexp(logits_n)² / total_tokens (the mean over the micro-batch); the gradient `dlogits` of grad_scale · (a·aux + z·zloss)
//!   is written (`=`); the counts are constants, as in Megatron.
//! - `unpermute`: y[n] = Σ_j probs[n, j] · yp[slot[n, j]], summed in j order; its backward writes
//!   dyp (each row of yp has one reader) and dprobs[n, j] = ⟨yp[slot[n, j]], dy[n]⟩.

use crate::real::Real;
use rayon::prelude::*;

/// Softmax of `x` into `s` (max subtracted), returning log Σ exp(x).
fn softmax_row<T: Real>(x: &[T], s: &mut [T]) -> T {
    let m = x.iter().copied().fold(T::neg_infinity(), T::max);
    let mut sum = T::zero();
    for (o, &v) in s.iter_mut().zip(x) {
        *o = (v - m).exp();
        sum += *o;
    }
    s.iter_mut().for_each(|o| *o = *o / sum);
    m + sum.ln()
}

/// The `k` largest entries of `row`, best first; ties go to the lower index.
fn topk<T: Real>(row: &[T], out: &mut [u32]) {
    for j in 0..out.len() {
        let mut best: Option<usize> = None;
        for (e, &v) in row.iter().enumerate() {
            if out[..j].contains(&(e as u32)) {
                continue;
            }
            if best.is_none_or(|b| v > row[b]) {
                best = Some(e);
            }
        }
        out[j] = best.unwrap_or(0) as u32;
    }
}

pub fn topk_route<T: Real>(
    logits: &[T],
    e: usize,
    k: usize,
    pre_softmax: bool,
    scale: T,
    probs: &mut [T],
    experts: &mut [u32],
) {
    probs.par_chunks_mut(k).zip(experts.par_chunks_mut(k)).zip(logits.par_chunks(e)).for_each(|((p, ix), row)| {
        topk(row, ix);
        if pre_softmax {
            let mut s = vec![T::zero(); e];
            softmax_row(row, &mut s);
            p.iter_mut().zip(ix.iter()).for_each(|(o, &i)| *o = scale * s[i as usize]);
        } else {
            let sel: Vec<T> = ix.iter().map(|&i| row[i as usize]).collect();
            softmax_row(&sel, p);
            p.iter_mut().for_each(|o| *o = scale * *o);
        }
    });
}

#[allow(clippy::too_many_arguments)]
pub fn topk_route_bwd<T: Real>(
    logits: &[T],
    experts: &[u32],
    dprobs: &[T],
    e: usize,
    k: usize,
    pre_softmax: bool,
    scale: T,
    dlogits: &mut [T],
) {
    dlogits.par_chunks_mut(e).zip(logits.par_chunks(e)).enumerate().for_each(|(n, (dl, row))| {
        let (ix, dp) = (&experts[n * k..(n + 1) * k], &dprobs[n * k..(n + 1) * k]);
        dl.fill(T::zero());
        if pre_softmax {
            let mut s = vec![T::zero(); e];
            softmax_row(row, &mut s);
            let mut g = vec![T::zero(); e];
            ix.iter().zip(dp).for_each(|(&i, &d)| g[i as usize] += scale * d);
            let dot: T = s.iter().zip(&g).map(|(&a, &b)| a * b).sum();
            dl.iter_mut().zip(s.iter().zip(&g)).for_each(|(o, (&si, &gi))| *o = si * (gi - dot));
        } else {
            let sel: Vec<T> = ix.iter().map(|&i| row[i as usize]).collect();
            let mut q = vec![T::zero(); k];
            softmax_row(&sel, &mut q);
            let dot: T = q.iter().zip(dp).map(|(&a, &d)| a * scale * d).sum();
            for ((&i, &qi), &d) in ix.iter().zip(&q).zip(dp) {
                dl[i as usize] = qi * (scale * d - dot);
            }
        }
    });
}

/// Coefficients of `router_loss`.
#[derive(Clone, Copy, Debug)]
pub struct RouterLossCoeffs<T> {
    pub topk: usize,
    /// Tokens the expert counts were taken over, and the z-loss's mean's count: the micro-batch's
    /// (more than these rows when its tokens lie on several context-parallel ranks).
    pub total_tokens: T,
    pub aux: T,
    pub z: T,
    pub grad_scale: T,
}

/// Returns (load-balancing loss, z-loss), both without their coefficients.
pub fn router_loss<T: Real>(logits: &[T], e: usize, counts: &[T], c: RouterLossCoeffs<T>, dlogits: &mut [T]) -> (T, T) {
    let w = T::c(e as f64) / (T::c(c.topk as f64) * c.total_tokens * c.total_tokens);
    // Per row: (Σ_e S[n, e] c_e, lse_n²), written into dlogits' row as S first.
    let rows: Vec<(T, T)> = dlogits
        .par_chunks_mut(e)
        .zip(logits.par_chunks(e))
        .map(|(dl, row)| {
            let lse = softmax_row(row, dl);
            let sc: T = dl.iter().zip(counts).map(|(&s, &cnt)| s * cnt).sum();
            let dz = c.z * T::c(2.0) * lse / c.total_tokens;
            // d aux / d logits = S ⊙ (w·c − Σ S w c); d z / d logits = 2·lse·S / N.
            for (o, &cnt) in dl.iter_mut().zip(counts) {
                let s = *o;
                *o = c.grad_scale * (c.aux * s * (w * cnt - w * sc) + dz * s);
            }
            (sc, lse * lse)
        })
        .collect();
    let (sc, z2) = rows.iter().fold((T::zero(), T::zero()), |(a, b), &(x, y)| (a + x, b + y));
    (w * sc, z2 / c.total_tokens)
}

pub fn unpermute<T: Real>(yp: &[T], slot: &[u32], probs: &[T], c: usize, k: usize, y: &mut [T]) {
    y.par_chunks_mut(c).enumerate().for_each(|(n, o)| {
        o.fill(T::zero());
        for j in 0..k {
            let (r, p) = (slot[n * k + j] as usize, probs[n * k + j]);
            o.iter_mut().zip(&yp[r * c..(r + 1) * c]).for_each(|(a, &b)| *a += p * b);
        }
    });
}

#[allow(clippy::too_many_arguments)]
pub fn unpermute_bwd<T: Real>(
    yp: &[T],
    slot: &[u32],
    probs: &[T],
    dy: &[T],
    c: usize,
    k: usize,
    dyp: &mut [T],
    dprobs: &mut [T],
) {
    dprobs.par_chunks_mut(k).enumerate().for_each(|(n, dp)| {
        let g = &dy[n * c..(n + 1) * c];
        for (j, d) in dp.iter_mut().enumerate() {
            let r = slot[n * k + j] as usize;
            *d = yp[r * c..(r + 1) * c].iter().zip(g).map(|(&a, &b)| a * b).sum();
        }
    });
    // Rows of dyp in token order: each is written once.
    for n in 0..slot.len() / k.max(1) {
        let g = &dy[n * c..(n + 1) * c];
        for j in 0..k {
            let (r, p) = (slot[n * k + j] as usize, probs[n * k + j]);
            dyp[r * c..(r + 1) * c].iter_mut().zip(g).for_each(|(o, &b)| *o = p * b);
        }
    }
}

/// Sorts the tokens' copies by expert: `perm[row]` is the token of each row (experts in order,
/// tokens ascending within one, as Megatron's permute), `slot[n·K + j]` the row of token n's j-th
/// copy, `counts[e]` the rows of expert e.
pub fn sort_by_expert(experts: &[u32], k: usize, num_experts: usize) -> (Vec<u32>, Vec<u32>, Vec<usize>) {
    let mut counts = vec![0usize; num_experts];
    experts.iter().for_each(|&x| counts[x as usize] += 1);
    let mut next: Vec<usize> = counts
        .iter()
        .scan(0, |acc, &c| {
            let start = *acc;
            *acc += c;
            Some(start)
        })
        .collect();
    let mut perm = vec![0u32; experts.len()];
    let mut slot = vec![0u32; experts.len()];
    for (i, &x) in experts.iter().enumerate() {
        let row = next[x as usize];
        next[x as usize] += 1;
        perm[row] = (i / k.max(1)) as u32;
        slot[i] = row as u32;
    }
    (perm, slot, counts)
}
