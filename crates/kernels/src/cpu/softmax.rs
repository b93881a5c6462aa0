//! Softmax over the last dimension. Shapes: x, y, dy, dx [N, C]. Backward: dx = y·(dy − Σ dy·y).

use crate::real::Real;
use rayon::prelude::*;

pub fn softmax_fwd<T: Real>(x: &[T], c: usize, y: &mut [T]) {
    y.par_chunks_mut(c).zip(x.par_chunks(c)).for_each(|(yr, xr)| {
        softmax_row(xr, yr);
    });
}

/// Stable softmax of one row; returns log Σ exp(x).
pub fn softmax_row<T: Real>(x: &[T], y: &mut [T]) -> T {
    let max = x.iter().copied().fold(T::neg_infinity(), T::max);
    y.copy_from_slice(x);
    let sum = T::exp_sub_sum(y, max);
    let inv = T::one() / sum;
    y.iter_mut().for_each(|o| *o = *o * inv);
    max + sum.ln()
}

pub fn softmax_bwd<T: Real>(y: &[T], dy: &[T], c: usize, dx: &mut [T]) {
    dx.par_chunks_mut(c).zip(y.par_chunks(c).zip(dy.par_chunks(c))).for_each(|(dxr, (yr, dyr))| {
        let dot = yr.iter().zip(dyr).map(|(&a, &b)| a * b).sum::<T>();
        for i in 0..c {
            dxr[i] = yr[i] * (dyr[i] - dot);
        }
    });
}
