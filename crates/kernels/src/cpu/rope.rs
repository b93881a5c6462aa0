//! Rotary position embedding, rotate-half convention (GPT-NeoX, Llama, Megatron's default).
//!
//! Shapes: x, y [B, T, H, D]; the first `rot` (even, ≤ D) features of each head rotate, the rest pass.
//! Pair i (< rot/2) is (x[i], x[i + rot/2]) at angle θ = (pos0 + t) · base^(−2i/rot):
//!   y[i] = x[i]·cos θ − x[i+rot/2]·sin θ,  y[i+rot/2] = x[i+rot/2]·cos θ + x[i]·sin θ.
//! Backward is the rotation by −θ.

use crate::real::Real;
use rayon::prelude::*;

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeCfg {
    pub rot: usize,
    pub base: f64,
    /// Position of the first token (non-zero for continued generation).
    pub pos0: usize,
}

/// cos/sin tables [T, rot/2], computed in f64.
fn tables<T: Real>(t: usize, cfg: &RopeCfg) -> (Vec<T>, Vec<T>) {
    let half = cfg.rot / 2;
    let mut cos = Vec::with_capacity(t * half);
    let mut sin = Vec::with_capacity(t * half);
    for p in 0..t {
        for i in 0..half {
            let inv_freq = cfg.base.powf(-(2.0 * i as f64) / cfg.rot as f64);
            let a = (cfg.pos0 + p) as f64 * inv_freq;
            cos.push(T::c(a.cos()));
            sin.push(T::c(a.sin()));
        }
    }
    (cos, sin)
}

fn rotate<T: Real>(x: &[T], t: usize, h: usize, d: usize, cfg: &RopeCfg, sign: T, y: &mut [T]) {
    let half = cfg.rot / 2;
    let (cos, sin) = tables::<T>(t, cfg);
    y.par_chunks_mut(h * d).zip(x.par_chunks(h * d)).enumerate().for_each(|(row, (yr, xr))| {
        let p = row % t;
        for head in 0..h {
            let (xs, ys) = (&xr[head * d..(head + 1) * d], &mut yr[head * d..(head + 1) * d]);
            for i in 0..half {
                let (c, s) = (cos[p * half + i], sign * sin[p * half + i]);
                let (a, b) = (xs[i], xs[i + half]);
                ys[i] = a * c - b * s;
                ys[i + half] = b * c + a * s;
            }
            ys[cfg.rot..].copy_from_slice(&xs[cfg.rot..]);
        }
    });
}

pub fn rope_fwd<T: Real>(x: &[T], t: usize, h: usize, d: usize, cfg: &RopeCfg, y: &mut [T]) {
    rotate(x, t, h, d, cfg, T::one(), y);
}

pub fn rope_bwd<T: Real>(dy: &[T], t: usize, h: usize, d: usize, cfg: &RopeCfg, dx: &mut [T]) {
    rotate(dy, t, h, d, cfg, -T::one(), dx);
}
