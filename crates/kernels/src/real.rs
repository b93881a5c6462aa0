//! The float types CPU kernels are generic over: f32 for training, f64 for finite-difference checks.

use num_traits::Float;
use std::fmt::Debug;
use std::iter::Sum;
use std::ops::AddAssign;

pub trait Real: Float + AddAssign + Sum + Debug + Default + Send + Sync + 'static {
    fn c(x: f64) -> Self;
    fn f64(self) -> f64;
    /// xs[i] = exp(xs[i] − m); returns their sum. Vectorised for f32 (`cpu::vexp`); f64 (the
    /// finite-difference checks) keeps libm.
    fn exp_sub_sum(xs: &mut [Self], m: Self) -> Self;
    /// e^x: `cpu::vexp::exp1` for f32 (vectorises inside `map1`/`map2`), libm for f64.
    fn fexp(self) -> Self;
    /// y[i] = f(x[i]); for f32 compiled for the widest vector unit here.
    fn map1(x: &[Self], y: &mut [Self], f: impl Fn(Self) -> Self) {
        y.iter_mut().zip(x).for_each(|(o, &v)| *o = f(v));
    }
    /// y[i] = f(x[i], g[i]), as `map1`.
    fn map2(x: &[Self], g: &[Self], y: &mut [Self], f: impl Fn(Self, Self) -> Self) {
        y.iter_mut().zip(x.iter().zip(g)).for_each(|(o, (&v, &w))| *o = f(v, w));
    }
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
    fn exp_sub_sum(xs: &mut [f32], m: f32) -> f32 {
        crate::cpu::vexp::exp_sub_sum_f32(xs, m)
    }
    #[inline(always)]
    fn fexp(self) -> f32 {
        crate::cpu::vexp::exp1(self)
    }
    fn map1(x: &[f32], y: &mut [f32], f: impl Fn(f32) -> f32) {
        crate::cpu::vexp::map1_f32(x, y, f)
    }
    fn map2(x: &[f32], g: &[f32], y: &mut [f32], f: impl Fn(f32, f32) -> f32) {
        crate::cpu::vexp::map2_f32(x, g, y, f)
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
    #[inline]
    fn fexp(self) -> f64 {
        self.exp()
    }
    fn exp_sub_sum(xs: &mut [f64], m: f64) -> f64 {
        let mut s = 0.0;
        for x in xs {
            *x = (*x - m).exp();
            s += *x;
        }
        s
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

/// (Σ f(i).0, Σ f(i).1) for i in 0..n in one pass, each through eight independent partial sums
/// combined in a fixed order: one running sum is a chain of dependent adds the compiler may not
/// reorder (float addition is not associative), eight vectorise. Deterministic for a given n, but
/// not the left-to-right sum.
#[inline(always)]
pub fn sum8x2<T: Real>(n: usize, f: impl Fn(usize) -> (T, T)) -> (T, T) {
    let (mut a, mut b) = ([T::zero(); 8], [T::zero(); 8]);
    let full = n - n % 8;
    for base in (0..full).step_by(8) {
        for l in 0..8 {
            let (x, y) = f(base + l);
            a[l] += x;
            b[l] += y;
        }
    }
    let (mut ta, mut tb) = (T::zero(), T::zero());
    for i in full..n {
        let (x, y) = f(i);
        ta += x;
        tb += y;
    }
    let fold = |v: [T; 8], t: T| ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])) + t;
    (fold(a, ta), fold(b, tb))
}

/// Σ f(i) for i in 0..n as `sum8x2` (one sum).
#[inline(always)]
pub fn sum8<T: Real>(n: usize, f: impl Fn(usize) -> T) -> T {
    sum8x2(n, |i| (f(i), T::zero())).0
}
