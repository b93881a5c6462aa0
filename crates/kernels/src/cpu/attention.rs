//! Scaled dot-product self-attention with GQA, causal and sliding-window masks. A straightforward
//! version: one [T, S] score matrix per head at a time (flash tiling is the GPU's job).
//!
//! Shapes (batch-major, heads inside): q, o, dq [B, T, Hq, D]; k, v, dk, dv [B, S, Hkv, D];
//! lse [B, Hq, T] (log-sum-exp of each score row, saved for backward). Query head h reads kv head
//! h / (Hq / Hkv). Backward recomputes P = exp(scale·qkᵀ − lse) and writes dq, dk, dv (`=`); the
//! group's query heads add into one dk/dv before that write. The `_fused` twins read q, k, v in
//! place from the QKV projection output [B, T, Hkv·(G+2)·D] and write dq, dk, dv into its slots
//! (`Place`), with the same arithmetic.
//!
//! With `AttnMask::dropout` (training), P is masked after the softmax: P̃ = P ∘ M / (1 − p), O =
//! P̃ V. The backward: dV = P̃ᵀ dO, dP = (dO Vᵀ) ∘ M / (1 − p), dS = P ∘ (dP − rowsum(dO ∘ O))
//! (rowsum(dO ∘ O) = Σ_j P̃ dP̃ = Σ_j P dP still holds, so the same δ serves).

use crate::cpu::matmul::{MatRef, gemm_strided};
use crate::real::Real;
use rayon::prelude::*;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnDims {
    pub b: usize,
    pub t: usize,
    pub s: usize,
    pub hq: usize,
    pub hkv: usize,
    pub d: usize,
}

/// Which keys a query may see: `causal` keeps j ≤ i; `window` w keeps |i − j| < w; `docs`
/// (document-wise masks, Megatron's --reset-attention-mask) keeps j ≥ docs[b·T + i], the first
/// position of query i's document in batch row b; and, in training, which of the probabilities
/// dropout keeps.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AttnMask<'a> {
    pub causal: bool,
    pub window: Option<usize>,
    pub dropout: Option<AttnDropout>,
    /// [B, T]: each query's document start (≤ the query's own position).
    pub docs: Option<&'a [u32]>,
}

/// Dropout of the attention probabilities (Megatron's `--attention-dropout`): probability (i, j)
/// of local head h of batch row b is kept, scaled by 1 / (1 − p), unless its 16-bit random value
/// of (seed, stream), as a uniform in [0, 1), is below p (`dropout::keep16`: p rounded up to a
/// multiple of 2⁻¹⁶). Within a 16 × 16 tile (rows i, columns j taken mod 16), the eight probabilities
/// {i, i + 8} × {j, j + 1, j + 8, j + 9} (i < 8, j < 8 even) share Philox block
///
/// `base + b · batch_stride + ((H · ⌈T/16⌉ + ⌊i/16⌋) · ⌈S/16⌉ + ⌊j/16⌋) · 32 + (i mod 8) · 4 + (j mod 8) div 2`
///
/// (with `tiles`, its two counts in place of ⌈T/16⌉ and ⌈S/16⌉)
///
/// (H = head_offset + h), a block of Philox-4x32-7 ([`AttnDropout::PHILOX_ROUNDS`]): probability
/// (i, j) is half `j mod 2` (low 16 bits first) of word `((i mod 16) div 8) · 2 + (j mod 16) div 8`.
/// Why this grouping: a tensor core's accumulator fragment gives each thread rows {r, r + 8} and
/// columns {c, c + 1, c + 8, c + 9} of a 16 × 16 tile, so where the rows are the queries (the
/// forward, dQ) one Philox call serves a thread's eight probabilities; where they are the keys
/// (dK/dV compute Sᵀ) two neighbouring threads each compute one block and swap the halves the
/// other needs. The block is a pure function of the element's global place, so the backward, a
/// recomputed forward, micro-batches (`base`) and heads split over tensor-parallel ranks
/// (`head_offset`) all draw the same mask, on either device.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnDropout {
    pub p: f32,
    pub seed: u64,
    pub stream: u64,
    /// Philox block of batch row 0's first probabilities.
    pub base: u64,
    /// Blocks between consecutive batch rows: [`AttnDropout::blocks_per_sample`] of all heads.
    pub batch_stride: u64,
    /// The global index of this tensor's head 0 (tensor parallelism splits the heads).
    pub head_offset: u64,
    /// The (query, key) tile counts of the whole mask this call's probabilities lie in, when the
    /// call is one block of it (context parallelism: a query chunk against a key chunk, `base`
    /// then pointing at the block's first tile); None: ⌈T/16⌉ and ⌈S/16⌉ of the call itself.
    pub tiles: Option<(u64, u64)>,
}

impl AttnDropout {
    /// Philox rounds of the mask's blocks: 7, not 10 (FlashAttention's count; Philox-4x32-7
    /// passes BigCrush). The backward draws the mask again, and the rounds are most of its cost.
    pub const PHILOX_ROUNDS: u32 = 7;

    /// Philox blocks one sample's mask spans: `heads` · ⌈T/16⌉ · ⌈S/16⌉ tiles of 32 blocks.
    pub fn blocks_per_sample(heads: usize, t: usize, s: usize) -> u64 {
        (heads as u64) * (t.div_ceil(16) as u64) * (s.div_ceil(16) as u64) * 32
    }

    /// Rows i0 .. i0 + 16 (i0 a multiple of 16; those below t) of local head h of batch row b,
    /// keys 0..s: each key's multiplier, 1 / (1 − p) where kept, 0 where dropped, row i − i0 at
    /// `out[(i − i0) · s ..]`. Rows i and i + 8 share their blocks, so a tile's rows are drawn
    /// together: one block per eight probabilities, as on the GPU.
    fn tile_rows<T: Real>(&self, b: usize, h: usize, i0: usize, t: usize, s: usize, out: &mut [T]) {
        let rng = ferrotron_core::rng::Philox::new(self.seed).with_stream(self.stream);
        let (thr, scale) = (crate::dropout::threshold16(self.p), T::c(1.0 / (1.0 - self.p as f64)));
        let m = |w: u32, half: usize| if crate::dropout::keep16(w, half, thr) { scale } else { T::zero() };
        // In wrapping 64-bit arithmetic, as the kernels (a long run's sample index times the
        // blocks per sample may pass 2⁶⁴).
        let (tt, st) = self.tiles.unwrap_or((t.div_ceil(16) as u64, s.div_ceil(16) as u64));
        let tile_row = self.head_offset.wrapping_add(h as u64).wrapping_mul(tt).wrapping_add((i0 / 16) as u64);
        let first = self
            .base
            .wrapping_add((b as u64).wrapping_mul(self.batch_stride))
            .wrapping_add(tile_row.wrapping_mul(st * 32));
        for r in 0..8.min(t - i0) {
            let lower = i0 + r + 8 < t; // row r + 8 of the tile exists
            for j0 in (0..s).step_by(16) {
                // Keys j, j + 1, j + 8, j + 9 of the tile (j even): words x (row r) and 2 + x
                // (row r + 8) of one block, half j mod 2.
                let tile = first.wrapping_add((j0 / 16 * 32 + r * 4) as u64);
                for pair in 0..4 {
                    let w = rng.block_rounds(tile.wrapping_add(pair as u64), Self::PHILOX_ROUNDS);
                    for (x, half) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
                        let j = j0 + 8 * x + 2 * pair + half;
                        if j < s {
                            out[r * s + j] = m(w[x], half);
                            if lower {
                                out[(r + 8) * s + j] = m(w[2 + x], half);
                            }
                        }
                    }
                }
            }
        }
    }
}

impl AttnMask<'_> {
    /// The keys query i of batch row b (of t queries) sees among s, as one range [lo, hi).
    #[inline]
    pub fn range(&self, b: usize, t: usize, i: usize, s: usize) -> (usize, usize) {
        let hi = if self.causal { (i + 1).min(s) } else { s };
        let lo = self.window.map_or(0, |w| (i + 1).saturating_sub(w));
        let lo = self.docs.map_or(lo, |d| lo.max(d[b * t + i] as usize));
        let hi = self.window.map_or(hi, |w| hi.min(i + w));
        (lo.min(hi), hi)
    }

    #[inline]
    pub fn allows(&self, b: usize, t: usize, i: usize, j: usize) -> bool {
        (!self.causal || j <= i)
            && self.window.is_none_or(|w| i.abs_diff(j) < w)
            && self.docs.is_none_or(|d| j >= d[b * t + i] as usize)
    }
}

/// Where a head's rows sit in a [B, len, ·] buffer: `row` elements per token, and head h at slot
/// (h / per) · stride + offset + h % per of D elements each. Separate tensors ([B, len, H, D]):
/// slot h. The fused projection output ([B, T, Hkv, G + 2, D]: each group's G query heads, then
/// its key head and its value head): q per G, k and v one per group, at G and G + 1.
#[derive(Clone, Copy, Debug)]
struct Place {
    row: usize,
    per: usize,
    stride: usize,
    offset: usize,
    d: usize,
}

impl Place {
    fn separate(heads: usize, d: usize) -> Place {
        Place { row: heads * d, per: heads, stride: 0, offset: 0, d }
    }

    /// Slot `which` (0 q, 1 k, 2 v) of the fused output of `hkv` groups of `group` query heads.
    fn fused(hkv: usize, group: usize, d: usize, which: usize) -> Place {
        let per = if which == 0 { group } else { 1 };
        Place { row: hkv * (group + 2) * d, per, stride: group + 2, offset: [0, group, group + 1][which], d }
    }

    /// Element index of token i of batch b (of `len` tokens), head h.
    fn at(&self, b: usize, len: usize, i: usize, h: usize) -> usize {
        (b * len + i) * self.row + ((h / self.per) * self.stride + self.offset + h % self.per) * self.d
    }
}

struct Heads<'a, T> {
    x: &'a [T],
    place: Place,
    len: usize,
}

impl<'a, T> Heads<'a, T> {
    /// Head `h` of batch `b` as a [len, d] matrix with row stride `place.row`.
    fn mat(&self, b: usize, h: usize, transposed: bool) -> MatRef<'a, T> {
        let (data, ld) = (&self.x[self.place.at(b, self.len, 0, h)..], self.place.row);
        if transposed { MatRef { data, rs: 1, cs: ld } } else { MatRef { data, rs: ld, cs: 1 } }
    }
}

/// scores[T, S] = scale · q_h k_hᵀ, then P = softmax(masked scores) using `lse` if given (backward)
/// or computing it (forward, written to `lse_out`).
#[allow(clippy::too_many_arguments)]
fn probs<T: Real>(
    dims: &AttnDims,
    mask: AttnMask,
    scale: T,
    q: &Heads<T>,
    k: &Heads<T>,
    b: usize,
    h: usize,
    kvh: usize,
    p: &mut [T],
    lse_in: Option<&[T]>,
    lse_out: &mut [T],
) {
    let (t, s, d) = (dims.t, dims.s, dims.d);
    gemm_strided(t, s, d, q.mat(b, h, false), k.mat(b, kvh, true), p, s, false, scale, false);
    for i in 0..t {
        let row = &mut p[i * s..(i + 1) * s];
        // The keys row i may see form one range (causal: j ≤ i; window: |i − j| < w; its
        // document's: j ≥ its start).
        let (lo, hi) = mask.range(b, t, i, s);
        row[..lo].fill(T::zero());
        row[hi..].fill(T::zero());
        let seen = &mut row[lo..hi];
        match lse_in {
            Some(l) => {
                T::exp_sub_sum(seen, l[i]);
            }
            None if seen.is_empty() => lse_out[i] = T::neg_infinity(),
            None => {
                let max = seen.iter().copied().fold(T::neg_infinity(), T::max);
                let sum = T::exp_sub_sum(seen, max);
                lse_out[i] = max + sum.ln();
                let inv = T::one() / sum;
                seen.iter_mut().for_each(|v| *v = *v * inv);
            }
        }
    }
}

/// Writes o [B, T, Hq, D] and lse [B, Hq, T].
#[allow(clippy::too_many_arguments)]
pub fn attention_fwd<T: Real>(
    q: &[T],
    k: &[T],
    v: &[T],
    dims: AttnDims,
    mask: AttnMask,
    scale: f64,
    o: &mut [T],
    lse: &mut [T],
) {
    let [qh, kh, vh] = separate(q, k, v, &dims);
    fwd(qh, kh, vh, dims, mask, scale, o, lse);
}

/// [`attention_fwd`] reading Q, K and V where they sit in the fused projection output `qkv`
/// [B, T, Hkv·(G+2)·D] (no split copy); the same values.
pub fn attention_fwd_fused<T: Real>(qkv: &[T], dims: AttnDims, mask: AttnMask, scale: f64, o: &mut [T], lse: &mut [T]) {
    let [qh, kh, vh] = fused(qkv, &dims);
    fwd(qh, kh, vh, dims, mask, scale, o, lse);
}

fn separate<'a, T>(q: &'a [T], k: &'a [T], v: &'a [T], dims: &AttnDims) -> [Heads<'a, T>; 3] {
    let (hkv, d) = (dims.hkv, dims.d);
    [
        Heads { x: q, place: Place::separate(dims.hq, d), len: dims.t },
        Heads { x: k, place: Place::separate(hkv, d), len: dims.s },
        Heads { x: v, place: Place::separate(hkv, d), len: dims.s },
    ]
}

fn fused<'a, T>(qkv: &'a [T], dims: &AttnDims) -> [Heads<'a, T>; 3] {
    let (hkv, group, d) = (dims.hkv, dims.hq / dims.hkv, dims.d);
    [0, 1, 2].map(|w| Heads { x: qkv, place: Place::fused(hkv, group, d, w), len: dims.t })
}

#[allow(clippy::too_many_arguments)]
fn fwd<T: Real>(
    qh: Heads<T>,
    kh: Heads<T>,
    vh: Heads<T>,
    dims: AttnDims,
    mask: AttnMask,
    scale: f64,
    o: &mut [T],
    lse: &mut [T],
) {
    let AttnDims { b: nb, t, s, hq, hkv, d } = dims;
    let group = hq / hkv;
    let scale = T::c(scale);
    let results: Vec<(Vec<T>, Vec<T>)> = (0..nb * hkv)
        .into_par_iter()
        .map(|task| {
            let (b, kvh) = (task / hkv, task % hkv);
            // SAFETY: each head's P·V product (not accumulating) writes its t × d block of `out`,
            // and `probs` its t log-sum-exps.
            let (mut out, mut l) = unsafe { (crate::buf::uninit(group * t * d), crate::buf::uninit(group * t)) };
            let mut p = vec![T::zero(); t * s];
            let mut keep = vec![T::zero(); if mask.dropout.is_some() { 16 * s } else { 0 }];
            for g in 0..group {
                let h = kvh * group + g;
                probs(&dims, mask, scale, &qh, &kh, b, h, kvh, &mut p, None, &mut l[g * t..(g + 1) * t]);
                if let Some(dr) = &mask.dropout {
                    // P̃ = P ∘ M / (1 − p); lse stays the undropped softmax's.
                    for i in 0..t {
                        if i % 16 == 0 {
                            dr.tile_rows(b, h, i, t, s, &mut keep);
                        }
                        let keep = &keep[i % 16 * s..][..s];
                        p[i * s..(i + 1) * s].iter_mut().zip(keep).for_each(|(x, m)| *x = *x * *m);
                    }
                }
                let pm = MatRef { data: &p[..], rs: s, cs: 1 };
                gemm_strided(t, d, s, pm, vh.mat(b, kvh, false), &mut out[g * t * d..], d, false, T::one(), false);
            }
            (out, l)
        })
        .collect();
    let outs: Vec<&[T]> = results.iter().map(|r| &r.0[..]).collect();
    scatter(&outs, &dims, group, t, Place::separate(hq, d), o);
    // A task's log-sum-exps are its group's heads' rows of lse [B, Hq, T]: one contiguous block.
    lse.par_chunks_mut((group * t).max(1)).zip(results.par_iter()).for_each(|(dst, r)| dst.copy_from_slice(&r.1));
}

/// Writes dq, dk, dv (`=`).
#[allow(clippy::too_many_arguments)]
pub fn attention_bwd<T: Real>(
    q: &[T],
    k: &[T],
    v: &[T],
    o: &[T],
    lse: &[T],
    dout: &[T],
    dims: AttnDims,
    mask: AttnMask,
    scale: f64,
    dq: &mut [T],
    dk: &mut [T],
    dv: &mut [T],
) {
    let [qh, kh, vh] = separate(q, k, v, &dims);
    let (pq, pk, pv) = (qh.place, kh.place, vh.place);
    let parts = bwd(qh, kh, vh, o, lse, dout, dims, mask, scale);
    for (which, place, out) in [(0, pq, dq), (1, pk, dk), (2, pv, dv)] {
        scatter_part(&parts, &dims, which, place, out);
    }
}

/// [`attention_bwd`] reading Q, K and V in place from the fused projection output `qkv` and
/// writing (`=`) each gradient into its slots of `dqkv` (the same layout); the same values.
#[allow(clippy::too_many_arguments)]
pub fn attention_bwd_fused<T: Real>(
    qkv: &[T],
    o: &[T],
    lse: &[T],
    dout: &[T],
    dims: AttnDims,
    mask: AttnMask,
    scale: f64,
    dqkv: &mut [T],
) {
    let heads = fused(qkv, &dims);
    let places = heads.each_ref().map(|h| h.place);
    let [qh, kh, vh] = heads;
    let parts = bwd(qh, kh, vh, o, lse, dout, dims, mask, scale);
    for (which, place) in places.into_iter().enumerate() {
        scatter_part(&parts, &dims, which, place, dqkv);
    }
}

/// Per (batch, kv head) task: the group's dq [G, T, D], then dk and dv [S, D].
type Parts<T> = Vec<[Vec<T>; 3]>;

#[allow(clippy::too_many_arguments)]
fn bwd<T: Real>(
    qh: Heads<T>,
    kh: Heads<T>,
    vh: Heads<T>,
    o: &[T],
    lse: &[T],
    dout: &[T],
    dims: AttnDims,
    mask: AttnMask,
    scale: f64,
) -> Parts<T> {
    let AttnDims { b: nb, t, s, hq, hkv, d } = dims;
    let group = hq / hkv;
    let scale = T::c(scale);
    let doh = Heads { x: dout, place: Place::separate(hq, d), len: t };
    (0..nb * hkv)
        .into_par_iter()
        .map(|task| {
            let (b, kvh) = (task / hkv, task % hkv);
            // SAFETY: each head's dS·K product (not accumulating) writes its t × d block.
            let mut dq_g = unsafe { crate::buf::uninit(group * t * d) };
            let mut dk_acc = vec![T::zero(); s * d];
            let mut dv_acc = vec![T::zero(); s * d];
            let mut p = vec![T::zero(); t * s];
            let mut ds = vec![T::zero(); t * s];
            let mut keep = vec![T::zero(); if mask.dropout.is_some() { 16 * s } else { 0 }];
            let mut unused = [];
            for g in 0..group {
                let h = kvh * group + g;
                let lse_h = &lse[(b * hq + h) * t..(b * hq + h + 1) * t];
                probs(&dims, mask, scale, &qh, &kh, b, h, kvh, &mut p, Some(lse_h), &mut unused);
                // dP̃ = dO Vᵀ
                gemm_strided(t, s, d, doh.mat(b, h, false), vh.mat(b, kvh, true), &mut ds, s, false, T::one(), false);
                // dS = P ∘ (dP − rowsum(dO ∘ O)), dP = dP̃ ∘ M / (1 − p) with dropout; then P
                // becomes P̃ for dV.
                for i in 0..t {
                    let base = ((b * t + i) * hq + h) * d;
                    let di = (0..d).map(|e| dout[base + e] * o[base + e]).sum::<T>();
                    let (pr, dr) = (&mut p[i * s..(i + 1) * s], &mut ds[i * s..(i + 1) * s]);
                    match &mask.dropout {
                        Some(drop) => {
                            if i % 16 == 0 {
                                drop.tile_rows(b, h, i, t, s, &mut keep);
                            }
                            let keep = &keep[i % 16 * s..][..s];
                            for j in 0..s {
                                dr[j] = pr[j] * (dr[j] * keep[j] - di);
                                pr[j] = pr[j] * keep[j];
                            }
                        }
                        None => (0..s).for_each(|j| dr[j] = pr[j] * (dr[j] - di)),
                    }
                }
                // dV += P̃ᵀ dO
                let pt = MatRef { data: &p[..], rs: 1, cs: s };
                gemm_strided(s, d, t, pt, doh.mat(b, h, false), &mut dv_acc, d, true, T::one(), false);
                let dsm = MatRef { data: &ds[..], rs: s, cs: 1 };
                let dst = MatRef { data: &ds[..], rs: 1, cs: s };
                // dQ = scale · dS K ; dK += scale · dSᵀ Q
                gemm_strided(t, d, s, dsm, kh.mat(b, kvh, false), &mut dq_g[g * t * d..], d, false, scale, false);
                gemm_strided(s, d, t, dst, qh.mat(b, h, false), &mut dk_acc, d, true, scale, false);
            }
            [dq_g, dk_acc, dv_acc]
        })
        .collect()
}

/// Copies part `which` (0 dq, 1 dk, 2 dv) of every task into `out` at `place`.
fn scatter_part<T: Copy + Send + Sync>(parts: &Parts<T>, dims: &AttnDims, which: usize, place: Place, out: &mut [T]) {
    let srcs: Vec<&[T]> = parts.iter().map(|p| &p[which][..]).collect();
    let (heads, len) = if which == 0 { (dims.hq / dims.hkv, dims.t) } else { (1, dims.s) };
    scatter(&srcs, dims, heads, len, place, out);
}

/// Copies each (batch, kv head) task's `heads` × [len, D] rows (its group's query heads, or its
/// one key or value head) into `out` at `place`, a batch per thread (each batch's rows are one
/// contiguous block of `out`).
fn scatter<T: Copy + Send + Sync>(
    srcs: &[&[T]],
    dims: &AttnDims,
    heads: usize,
    len: usize,
    place: Place,
    out: &mut [T],
) {
    let (d, hkv) = (dims.d, dims.hkv);
    // (At least 1: a zero-length sequence has no rows, and chunks may not be empty.)
    out.par_chunks_mut((len * place.row).max(1)).enumerate().for_each(|(b, out)| {
        for (kvh, src) in srcs[b * hkv..(b + 1) * hkv].iter().enumerate() {
            for g in 0..heads {
                for i in 0..len {
                    let dst = place.at(0, len, i, kvh * heads + g);
                    out[dst..dst + d].copy_from_slice(&src[(g * len + i) * d..(g * len + i + 1) * d]);
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::AttnMask;

    #[test]
    fn mask_range_is_the_set_of_allowed_keys() {
        // Two rows of 20 queries: row 0 one document, row 1 documents from 0, 3, 4 and 11.
        let row1 = |i: u32| match i {
            0..3 => 0,
            3 => 3,
            4..11 => 4,
            _ => 11,
        };
        let starts: Vec<u32> = (0..20).map(|_| 0).chain((0..20).map(row1)).collect();
        for causal in [false, true] {
            for window in [None, Some(1), Some(3), Some(40)] {
                for docs in [None, Some(&starts[..])] {
                    let m = AttnMask { causal, window, dropout: None, docs };
                    for s in [1, 5, 17] {
                        for (b, i) in (0..2).flat_map(|b| (0..20).map(move |i| (b, i))) {
                            let (lo, hi) = m.range(b, 20, i, s);
                            let want: Vec<usize> = (0..s).filter(|&j| m.allows(b, 20, i, j)).collect();
                            let got: Vec<usize> = (lo..hi).collect();
                            assert_eq!(got, want, "{m:?} s {s} row {b}, {i}");
                        }
                    }
                }
            }
        }
    }
}
