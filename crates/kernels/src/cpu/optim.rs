//! Optimizer math over flat fp32 buffers: AdamW, squared L2 norm, scaling.
//!
//! AdamW with decoupled weight decay (Loshchilov & Hutter; PyTorch's AdamW and Megatron's fused Adam
//! in adam_w_mode agree): m ← β1·m + (1−β1)·g, v ← β2·v + (1−β2)·g², p ← p·(1 − lr·wd) −
//! lr·m̂/(√v̂ + eps) with m̂ = m/(1−β1ᵗ), v̂ = v/(1−β2ᵗ). `grad_scale` multiplies g first (clipping).

use rayon::prelude::*;

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamW {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    /// 1-based step count, for bias correction.
    pub step: u64,
    pub grad_scale: f32,
}

const CHUNK: usize = 1 << 14;

pub fn adamw_step(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], h: &AdamW) {
    let bc1 = 1.0 - (h.beta1 as f64).powi(h.step as i32);
    let bc2 = 1.0 - (h.beta2 as f64).powi(h.step as i32);
    let step_size = (h.lr as f64 / bc1) as f32;
    let bc2_sqrt = bc2.sqrt() as f32;
    let decay = 1.0 - h.lr * h.weight_decay;
    p.par_chunks_mut(CHUNK)
        .zip(g.par_chunks(CHUNK))
        .zip(m.par_chunks_mut(CHUNK).zip(v.par_chunks_mut(CHUNK)))
        .for_each(|((p, g), (m, v))| {
            for i in 0..p.len() {
                let gi = g[i] * h.grad_scale;
                m[i] = h.beta1 * m[i] + (1.0 - h.beta1) * gi;
                v[i] = h.beta2 * v[i] + (1.0 - h.beta2) * gi * gi;
                let denom = v[i].sqrt() / bc2_sqrt + h.eps;
                p[i] = p[i] * decay - step_size * m[i] / denom;
            }
        });
}

/// SGD with momentum and L2 weight decay (PyTorch's SGD with dampening 0 and no Nesterov;
/// Megatron's --optimizer sgd): g ← scale·g + wd·p, buf ← μ·buf + g, p ← p − lr·buf. The buffer
/// starts at zero, so the first step's buf is g, as PyTorch's clone of it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sgd {
    pub lr: f32,
    pub momentum: f32,
    pub weight_decay: f32,
    pub grad_scale: f32,
}

pub fn sgd_step(p: &mut [f32], g: &[f32], buf: &mut [f32], h: &Sgd) {
    p.par_chunks_mut(CHUNK).zip(g.par_chunks(CHUNK)).zip(buf.par_chunks_mut(CHUNK)).for_each(|((p, g), b)| {
        for i in 0..p.len() {
            let gi = g[i] * h.grad_scale + h.weight_decay * p[i];
            b[i] = h.momentum * b[i] + gi;
            p[i] -= h.lr * b[i];
        }
    });
}

/// Σ x² in f64, summed per fixed-size chunk then in chunk order (same bits on any thread count).
pub fn sum_sq(x: &[f32]) -> f64 {
    let parts: Vec<f64> = x.par_chunks(CHUNK).map(|c| c.iter().map(|&v| v as f64 * v as f64).sum()).collect();
    parts.iter().sum()
}

/// How many elements are zero (±0; NaN is not).
pub fn count_zeros(x: &[f32]) -> u64 {
    x.par_chunks(CHUNK).map(|c| c.iter().filter(|&&v| v == 0.0).count() as u64).sum()
}

pub fn scale(x: &mut [f32], s: f32) {
    x.par_chunks_mut(CHUNK).for_each(|c| c.iter_mut().for_each(|v| *v *= s));
}
