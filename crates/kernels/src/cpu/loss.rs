//! Fused softmax + cross-entropy over vocab rows.
//!
//! Shapes: logits, dlogits [N, V] (any storage element `E`, math in `T`); targets [N]; mask, loss,
//! lse, dloss [N]. Forward: loss[n] = mask[n] · (lse[n] − logits[n, target]), 0 for ignored rows.
//! Backward: dlogits[n] = (softmax(logits[n]) − onehot(target)) · dloss[n] · mask[n], recomputing the
//! softmax from logits and the saved lse one row at a time: at no point is a full-precision copy
//! of all logits held.

use crate::real::Real;
use rayon::prelude::*;

/// A storage element that widens to and narrows from the math type.
pub trait Elem: Copy + Send + Sync {
    fn get<T: Real>(self) -> T;
    fn put<T: Real>(v: T) -> Self;
}

impl Elem for f32 {
    fn get<T: Real>(self) -> T {
        T::c(self as f64)
    }
    fn put<T: Real>(v: T) -> Self {
        v.f64() as f32
    }
}
impl Elem for f64 {
    fn get<T: Real>(self) -> T {
        T::c(self)
    }
    fn put<T: Real>(v: T) -> Self {
        v.f64()
    }
}
// Narrowed through f32 (exact for f32 math): `half`'s from_f64 drops the low 32 bits before it
// rounds, so a value just past a tie could round the other way than from_f32 (and the GPU) do.
impl Elem for half::bf16 {
    fn get<T: Real>(self) -> T {
        T::c(self.to_f64())
    }
    fn put<T: Real>(v: T) -> Self {
        half::bf16::from_f32(v.f64() as f32)
    }
}
impl Elem for half::f16 {
    fn get<T: Real>(self) -> T {
        T::c(self.to_f64())
    }
    fn put<T: Real>(v: T) -> Self {
        half::f16::from_f32(v.f64() as f32)
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CeCfg {
    /// Rows whose target equals this contribute no loss and no gradient.
    pub ignore_index: Option<u32>,
    /// Vocabulary-parallel shard: these logits are columns `vocab_start ..` of the whole
    /// vocabulary. A row whose target lies outside the shard has no one-hot term here (its loss
    /// is the shard's lse, and its gradient the softmax alone).
    pub vocab_start: u32,
    /// The real vocabulary size: targets must be below it, and logit columns at or past it are
    /// padding (the vocabulary is padded for tensor-parallel divisibility): left out of the
    /// softmax, zero gradient. `None`: every column is real.
    pub vocab_total: Option<u32>,
}

impl CeCfg {
    /// The column of `target` in this shard, if it is here.
    #[inline]
    pub fn column(&self, target: u32, v: usize) -> Option<usize> {
        target.checked_sub(self.vocab_start).map(|c| c as usize).filter(|&c| c < v)
    }

    /// How many of a shard's `v` columns are real (not padding).
    #[inline]
    pub fn real_columns(&self, v: usize) -> usize {
        self.vocab_total.map_or(v, |t| (t as usize).saturating_sub(self.vocab_start as usize).min(v))
    }
}

fn active(target: u32, mask: Option<&[f32]>, n: usize, cfg: CeCfg) -> Option<f64> {
    if cfg.ignore_index == Some(target) {
        return None;
    }
    let m = mask.map_or(1.0, |m| m[n] as f64);
    (m != 0.0).then_some(m)
}

pub fn cross_entropy_fwd<E: Elem, T: Real>(
    logits: &[E],
    v: usize,
    targets: &[u32],
    mask: Option<&[f32]>,
    cfg: CeCfg,
    loss: &mut [T],
    lse: &mut [T],
) {
    loss.par_iter_mut().zip(lse.par_iter_mut()).enumerate().for_each_init(Vec::new, |buf, (n, (l, s))| {
        let row = &logits[n * v..n * v + cfg.real_columns(v)];
        buf.clear();
        buf.extend(row.iter().map(|x| x.get::<T>()));
        let max = buf.iter().copied().fold(T::neg_infinity(), T::max);
        let sum = T::exp_sub_sum(buf, max);
        let lse_n = max + sum.ln();
        *s = lse_n;
        *l = match active(targets[n], mask, n, cfg) {
            Some(m) => T::c(m) * (lse_n - cfg.column(targets[n], v).map_or(T::zero(), |c| row[c].get::<T>())),
            None => T::zero(),
        };
    });
}

#[allow(clippy::too_many_arguments)]
pub fn cross_entropy_bwd<E: Elem, T: Real>(
    logits: &[E],
    v: usize,
    targets: &[u32],
    mask: Option<&[f32]>,
    cfg: CeCfg,
    lse: &[T],
    dloss: &[T],
    dlogits: &mut [E],
) {
    dlogits.par_chunks_mut(v).enumerate().for_each_init(Vec::new, |buf, (n, dr)| {
        let row = &logits[n * v..n * v + cfg.real_columns(v)];
        let Some(m) = active(targets[n], mask, n, cfg) else {
            dr.iter_mut().for_each(|x| *x = E::put(T::zero()));
            return;
        };
        let g = dloss[n] * T::c(m);
        let tgt = cfg.column(targets[n], v);
        dr[row.len()..].iter_mut().for_each(|x| *x = E::put(T::zero()));
        buf.clear();
        buf.extend(row.iter().map(|x| x.get::<T>()));
        T::exp_sub_sum(buf, lse[n]);
        for (j, (d, &p)) in dr.iter_mut().zip(buf.iter()).enumerate() {
            let onehot = if Some(j) == tgt { T::one() } else { T::zero() };
            *d = E::put((p - onehot) * g);
        }
    });
}

/// `cross_entropy_fwd`, then `cross_entropy_bwd` with dloss = `dscale` on every row, the gradient
/// written over the logits `x` [N, V] in place (a whole vocabulary: `cfg.vocab_start` 0). The
/// same arithmetic as the two passes, so the same bits.
#[allow(clippy::too_many_arguments)]
pub fn cross_entropy_fwd_bwd_<T: Real>(
    x: &mut [T],
    v: usize,
    targets: &[u32],
    mask: Option<&[f32]>,
    cfg: CeCfg,
    dscale: T,
    loss: &mut [T],
    lse: &mut [T],
) {
    let real = cfg.real_columns(v);
    x.par_chunks_mut(v).zip(loss.par_iter_mut().zip(lse.par_iter_mut())).enumerate().for_each_init(
        Vec::new,
        |buf, (n, (row, (l, s)))| {
            buf.clear();
            buf.extend_from_slice(&row[..real]);
            let max = buf.iter().copied().fold(T::neg_infinity(), T::max);
            let lse_n = max + T::exp_sub_sum(buf, max).ln();
            *s = lse_n;
            let tgt = cfg.column(targets[n], v);
            let Some(m) = active(targets[n], mask, n, cfg) else {
                *l = T::zero();
                row.iter_mut().for_each(|x| *x = T::zero());
                return;
            };
            *l = T::c(m) * (lse_n - tgt.map_or(T::zero(), |c| row[c]));
            let g = dscale * T::c(m);
            buf.clear();
            buf.extend_from_slice(&row[..real]);
            T::exp_sub_sum(buf, lse_n);
            for (j, (d, &p)) in row.iter_mut().zip(buf.iter()).enumerate() {
                let onehot = if Some(j) == tgt { T::one() } else { T::zero() };
                *d = (p - onehot) * g;
            }
            row[real..].iter_mut().for_each(|x| *x = T::zero());
        },
    );
}

/// The whole vocabulary's (loss, lse) per row from the tensor-parallel shards' (`all` [n, 2, rows]:
/// each shard's lse row, then its loss row, in rank order), in f64: lse = log Σ_r exp(lse_r),
/// loss = m·lse − Σ_r (m·lse_r − loss_r) over the shards with a finite lse (the term is
/// m·logit[target] on the shard holding the target, 0 elsewhere); 0 where the mask is 0.
pub fn ce_combine_shards(all: &[f32], n: usize, rows: usize, mask: Option<&[f32]>, loss: &mut [f32], lse: &mut [f32]) {
    for i in 0..rows {
        let shard = |r: usize| (all[r * 2 * rows + i] as f64, all[r * 2 * rows + rows + i] as f64);
        let top = (0..n).map(|r| shard(r).0).fold(f64::NEG_INFINITY, f64::max);
        let m = mask.map_or(1.0, |m| m[i] as f64);
        let (mut z, mut mx) = (0.0, 0.0);
        for r in 0..n {
            let (lse_r, loss_r) = shard(r);
            if lse_r.is_finite() {
                z += (lse_r - top).exp();
                mx += m * lse_r - loss_r;
            }
        }
        let whole = top + z.ln();
        lse[i] = whole as f32;
        loss[i] = if m == 0.0 { 0.0 } else { (m * whole - mx) as f32 };
    }
}
