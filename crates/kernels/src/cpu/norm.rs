//! LayerNorm and RMSNorm over the last dimension.
//!
//! Shapes: x, y, dx [N, C]; weight, bias, dweight, dbias [C]; mean, rstd [N] (saved for backward).
//! LayerNorm: y = (x − mean)·rstd·w + b, rstd = 1/√(var + eps).  RMSNorm: y = x·rstd·w, rstd =
//! 1/√(mean(x²) + eps). Backward writes dx (`=`) and returns dweight/dbias summed over rows in a fixed
//! order; callers add them into main_grad.

use crate::real::{Real, par_row_sum, sum8, sum8x2};
use rayon::prelude::*;

pub fn layernorm_fwd<T: Real>(
    x: &[T],
    w: &[T],
    b: Option<&[T]>,
    eps: f64,
    c: usize,
    y: &mut [T],
    mean: &mut [T],
    rstd: &mut [T],
) {
    let eps = T::c(eps);
    let inv_c = T::c(1.0 / c as f64);
    y.par_chunks_mut(c).zip(mean.par_iter_mut().zip(rstd.par_iter_mut())).enumerate().for_each(|(r, (yr, (m, s)))| {
        let xr = &x[r * c..(r + 1) * c];
        let mu = sum8(c, |i| xr[i]) * inv_c;
        let var = sum8(c, |i| (xr[i] - mu) * (xr[i] - mu)) * inv_c;
        let rs = T::one() / (var + eps).sqrt();
        for i in 0..c {
            let n = (xr[i] - mu) * rs * w[i];
            yr[i] = match b {
                Some(b) => n + b[i],
                None => n,
            };
        }
        *m = mu;
        *s = rs;
    });
}

/// Returns (dweight, dbias).
#[allow(clippy::too_many_arguments)]
pub fn layernorm_bwd<T: Real>(
    dy: &[T],
    x: &[T],
    w: &[T],
    mean: &[T],
    rstd: &[T],
    c: usize,
    dx: &mut [T],
) -> (Vec<T>, Vec<T>) {
    let inv_c = T::c(1.0 / c as f64);
    dx.par_chunks_mut(c).enumerate().for_each(|(r, dxr)| {
        let (xr, dyr) = (&x[r * c..(r + 1) * c], &dy[r * c..(r + 1) * c]);
        let (mu, rs) = (mean[r], rstd[r]);
        let (sg, sgx) = sum8x2(c, |i| {
            let g = dyr[i] * w[i];
            (g, g * (xr[i] - mu) * rs)
        });
        let (mean_g, mean_gx) = (sg * inv_c, sgx * inv_c);
        for i in 0..c {
            let xhat = (xr[i] - mu) * rs;
            dxr[i] = rs * (dyr[i] * w[i] - mean_g - xhat * mean_gx);
        }
    });
    let rows = mean.len();
    let sums = par_row_sum(rows, 2 * c, |range, acc| {
        for r in range {
            for i in 0..c {
                let g = dy[r * c + i];
                acc[i] += g * (x[r * c + i] - mean[r]) * rstd[r];
                acc[c + i] += g;
            }
        }
    });
    (sums[..c].to_vec(), sums[c..].to_vec())
}

pub fn rmsnorm_fwd<T: Real>(x: &[T], w: &[T], eps: f64, c: usize, y: &mut [T], rstd: &mut [T]) {
    let eps = T::c(eps);
    let inv_c = T::c(1.0 / c as f64);
    y.par_chunks_mut(c).zip(rstd.par_iter_mut()).enumerate().for_each(|(r, (yr, s))| {
        let xr = &x[r * c..(r + 1) * c];
        let ms = sum8(c, |i| xr[i] * xr[i]) * inv_c;
        let rs = T::one() / (ms + eps).sqrt();
        for i in 0..c {
            yr[i] = xr[i] * rs * w[i];
        }
        *s = rs;
    });
}

/// Returns dweight.
pub fn rmsnorm_bwd<T: Real>(dy: &[T], x: &[T], w: &[T], rstd: &[T], c: usize, dx: &mut [T]) -> Vec<T> {
    let inv_c = T::c(1.0 / c as f64);
    dx.par_chunks_mut(c).enumerate().for_each(|(r, dxr)| {
        let (xr, dyr) = (&x[r * c..(r + 1) * c], &dy[r * c..(r + 1) * c]);
        let rs = rstd[r];
        let mean_gx = sum8(c, |i| dyr[i] * w[i] * xr[i] * rs) * inv_c;
        for i in 0..c {
            dxr[i] = rs * (dyr[i] * w[i] - xr[i] * rs * mean_gx);
        }
    });
    par_row_sum(rstd.len(), c, |range, acc| {
        for r in range {
            for i in 0..c {
                acc[i] += dy[r * c + i] * x[r * c + i] * rstd[r];
            }
        }
    })
}
