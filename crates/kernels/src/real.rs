//! The float types CPU kernels are generic over: f32 for training, f64 for finite-difference checks.

use num_traits::Float;
use std::fmt::Debug;
use std::iter::Sum;
use std::ops::AddAssign;

pub trait Real: Float + AddAssign + Sum + Debug + Default + Send + Sync + 'static {
    fn c(x: f64) -> Self;
    fn f64(self) -> f64;
}

impl Real for f32 {
    #[inline]
    fn c(x: f64) -> Self {
        x as f32
    }
    #[inline]
    fn f64(self) -> f64 {
        self as f64
    }
}

impl Real for f64 {
    #[inline]
    fn c(x: f64) -> Self {
        x
    }
    #[inline]
    fn f64(self) -> f64 {
        self
    }
}

/// Rows per task for row-parallel kernels: fixed (not derived from the thread count) so that
/// reductions over rows sum in the same order on every machine.
pub const ROW_CHUNK: usize = 64;

/// Per-chunk partial sums of `f(row_range)` in parallel, then added in chunk order: deterministic.
pub fn par_row_sum<T: Real>(rows: usize, width: usize, f: impl Fn(std::ops::Range<usize>, &mut [T]) + Sync) -> Vec<T> {
    use rayon::prelude::*;
    let chunks = rows.div_ceil(ROW_CHUNK);
    let parts: Vec<Vec<T>> = (0..chunks)
        .into_par_iter()
        .map(|c| {
            let mut acc = vec![T::zero(); width];
            f(c * ROW_CHUNK..((c + 1) * ROW_CHUNK).min(rows), &mut acc);
            acc
        })
        .collect();
    let mut out = vec![T::zero(); width];
    for p in parts {
        for (o, v) in out.iter_mut().zip(p) {
            *o += v;
        }
    }
    out
}
