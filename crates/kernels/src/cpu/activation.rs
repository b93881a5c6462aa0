//! Pointwise activations. Backward writes dx = dy · f'(x) (`=`).
//!
//! GeLU is the tanh approximation GPT-2 and Megatron use. SwiGLU takes x [N, 2F] whose first half is
//! the gate and second half the value (Megatron's `chunk(2, -1)` order): y [N, F] = silu(gate) · value.

use crate::real::Real;
use rayon::prelude::*;

/// Elements per parallel task (fixed, so results do not depend on the thread count).
const CHUNK: usize = 1 << 13;

fn par_map1<T: Real>(x: &[T], y: &mut [T], f: impl Fn(T) -> T + Sync + Send + Copy) {
    y.par_chunks_mut(CHUNK).zip(x.par_chunks(CHUNK)).for_each(|(yc, xc)| T::map1(xc, yc, f));
}

fn par_map2<T: Real>(x: &[T], dy: &[T], dx: &mut [T], f: impl Fn(T, T) -> T + Sync + Send + Copy) {
    dx.par_chunks_mut(CHUNK).zip(x.par_chunks(CHUNK).zip(dy.par_chunks(CHUNK))).for_each(|(o, (xc, gc))| {
        T::map2(xc, gc, o, f);
    });
}

const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
const GELU_C: f64 = 0.044_715;

/// tanh through one exp (`Real::fexp`): libm's tanhf was a quarter of a tiny-model training step,
/// then libm's expf a tenth. Absolute error ≈ 1e-7 in f32 (relative error grows only where tanh
/// itself is below ~1e-3, harmless in GeLU).
#[inline]
fn tanh_exp<T: Real>(u: T) -> T {
    T::one() - T::c(2.0) / ((u + u).fexp() + T::one())
}

#[inline]
fn gelu<T: Real>(x: T) -> T {
    let half = T::c(0.5);
    half * x * (T::one() + tanh_exp(T::c(SQRT_2_OVER_PI) * (x + T::c(GELU_C) * x * x * x)))
}

#[inline]
fn gelu_grad<T: Real>(x: T) -> T {
    let half = T::c(0.5);
    let u = T::c(SQRT_2_OVER_PI) * (x + T::c(GELU_C) * x * x * x);
    let t = tanh_exp(u);
    let du = T::c(SQRT_2_OVER_PI) * (T::one() + T::c(3.0 * GELU_C) * x * x);
    half * (T::one() + t) + half * x * (T::one() - t * t) * du
}

#[inline]
fn sigmoid<T: Real>(x: T) -> T {
    T::one() / (T::one() + (-x).fexp())
}

#[inline]
pub(crate) fn silu<T: Real>(x: T) -> T {
    x * sigmoid(x)
}

#[inline]
pub(crate) fn silu_grad<T: Real>(x: T) -> T {
    let s = sigmoid(x);
    s * (T::one() + x * (T::one() - s))
}

pub fn gelu_fwd<T: Real>(x: &[T], y: &mut [T]) {
    par_map1(x, y, gelu);
}
pub fn gelu_bwd<T: Real>(x: &[T], dy: &[T], dx: &mut [T]) {
    par_map2(x, dy, dx, |v, g| g * gelu_grad(v));
}
/// Squared ReLU: max(x, 0)² (Primer's; Megatron's --squared-relu), gradient 2·max(x, 0).
pub fn relu2_fwd<T: Real>(x: &[T], y: &mut [T]) {
    par_map1(x, y, |v| {
        let r = v.max(T::zero());
        r * r
    });
}
pub fn relu2_bwd<T: Real>(x: &[T], dy: &[T], dx: &mut [T]) {
    par_map2(x, dy, dx, |v, g| g * T::c(2.0) * v.max(T::zero()));
}
/// Exact GeLU: x·Φ(x) = ½·x·(1 + erf(x/√2)) (PyTorch's default `F.gelu`; LLaVA's projection).
pub fn gelu_exact_fwd<T: Real>(x: &[T], y: &mut [T]) {
    par_map1(x, y, |v| T::c(0.5) * v * (T::one() + erf(v * T::c(FRAC_1_SQRT_2))));
}
/// d/dx x·Φ(x) = Φ(x) + x·φ(x).
pub fn gelu_exact_bwd<T: Real>(x: &[T], dy: &[T], dx: &mut [T]) {
    par_map2(x, dy, dx, |v, g| {
        let cdf = T::c(0.5) * (T::one() + erf(v * T::c(FRAC_1_SQRT_2)));
        let pdf = T::c(FRAC_1_SQRT_2PI) * (T::c(-0.5) * v * v).fexp();
        g * (cdf + v * pdf)
    });
}
const FRAC_1_SQRT_2: f64 = std::f64::consts::FRAC_1_SQRT_2;
/// 1/√(2π).
const FRAC_1_SQRT_2PI: f64 = 0.398_942_280_401_432_7;
/// erf in f64 (libm's), for either precision: the reference, not a hot loop on a GPU run.
fn erf<T: Real>(x: T) -> T {
    T::c(libm::erf(x.f64()))
}
/// CLIP's quick GeLU: x·σ(1.702·x) (Megatron's quick_gelu, transformers' `quick_gelu`).
pub fn quick_gelu_fwd<T: Real>(x: &[T], y: &mut [T]) {
    par_map1(x, y, |v| v * sigmoid(T::c(QUICK_GELU) * v));
}
/// d/dx x·σ(a·x) = s + a·x·s·(1 − s), s = σ(a·x).
pub fn quick_gelu_bwd<T: Real>(x: &[T], dy: &[T], dx: &mut [T]) {
    par_map2(x, dy, dx, |v, g| {
        let s = sigmoid(T::c(QUICK_GELU) * v);
        g * (s + T::c(QUICK_GELU) * v * s * (T::one() - s))
    });
}
/// quick GeLU's slope inside the sigmoid.
const QUICK_GELU: f64 = 1.702;
pub fn silu_fwd<T: Real>(x: &[T], y: &mut [T]) {
    par_map1(x, y, silu);
}
pub fn silu_bwd<T: Real>(x: &[T], dy: &[T], dx: &mut [T]) {
    par_map2(x, dy, dx, |v, g| g * silu_grad(v));
}

/// Attention's output gate (Megatron's --attention-output-gate): y = x·σ(g).
pub fn sigmoid_gate_fwd<T: Real>(x: &[T], g: &[T], y: &mut [T]) {
    par_map2(x, g, y, |x, g| x * sigmoid(g));
}

/// dx = dy·σ(g), dg = dy·x·σ(g)·(1 − σ(g)).
pub fn sigmoid_gate_bwd<T: Real>(x: &[T], g: &[T], dy: &[T], dx: &mut [T], dg: &mut [T]) {
    dx.par_chunks_mut(CHUNK)
        .zip(dg.par_chunks_mut(CHUNK))
        .zip(x.par_chunks(CHUNK).zip(g.par_chunks(CHUNK)).zip(dy.par_chunks(CHUNK)))
        .for_each(|((dxc, dgc), ((xc, gc), dyc))| {
            for i in 0..dxc.len() {
                let s = sigmoid(gc[i]);
                dxc[i] = dyc[i] * s;
                dgc[i] = dyc[i] * xc[i] * s * (T::one() - s);
            }
        });
}

/// x [N, 2F] → y [N, F].
pub fn swiglu_fwd<T: Real>(x: &[T], f: usize, y: &mut [T]) {
    y.par_chunks_mut(f).zip(x.par_chunks(2 * f)).for_each(|(yr, xr)| {
        for i in 0..f {
            yr[i] = silu(xr[i]) * xr[f + i];
        }
    });
}

/// gpt-oss's gated quick GeLU (Megatron's --quick-geglu with --glu-linear-offset and
/// --activation-func-clamp-value): x [N, 2F] (gate | linear) → qgelu(min(g, c))·(clamp(v, −c, c)
/// + offset) [N, F]; `clamp` c = ∞ for none.
pub fn quick_geglu_fwd<T: Real>(x: &[T], f: usize, offset: f32, clamp: f32, y: &mut [T]) {
    let (o, c) = (T::c(offset as f64), T::c(clamp as f64));
    y.par_chunks_mut(f).zip(x.par_chunks(2 * f)).for_each(|(yr, xr)| {
        for i in 0..f {
            let (g, v) = (xr[i].min(c), xr[f + i].min(c).max(-c));
            yr[i] = g * sigmoid(T::c(QUICK_GELU) * g) * (v + o);
        }
    });
}

/// dy [N, F] → dx [N, 2F]; no gradient where the clamp held an input (as torch's clamp).
pub fn quick_geglu_bwd<T: Real>(x: &[T], dy: &[T], f: usize, offset: f32, clamp: f32, dx: &mut [T]) {
    let (o, c) = (T::c(offset as f64), T::c(clamp as f64));
    dx.par_chunks_mut(2 * f).zip(x.par_chunks(2 * f).zip(dy.par_chunks(f))).for_each(|(dxr, (xr, dyr))| {
        for i in 0..f {
            let (xg, xv) = (xr[i], xr[f + i]);
            let (g, v) = (xg.min(c), xv.min(c).max(-c));
            let s = sigmoid(T::c(QUICK_GELU) * g);
            let slope = s + T::c(QUICK_GELU) * g * s * (T::one() - s);
            dxr[i] = if xg <= c { dyr[i] * slope * (v + o) } else { T::zero() };
            dxr[f + i] = if xv <= c && xv >= -c { dyr[i] * g * s } else { T::zero() };
        }
    });
}

/// dy [N, F] → dx [N, 2F].
pub fn swiglu_bwd<T: Real>(x: &[T], dy: &[T], f: usize, dx: &mut [T]) {
    dx.par_chunks_mut(2 * f).zip(x.par_chunks(2 * f).zip(dy.par_chunks(f))).for_each(|(dxr, (xr, dyr))| {
        for i in 0..f {
            let (g, v) = (xr[i], xr[f + i]);
            dxr[i] = dyr[i] * v * silu_grad(g);
            dxr[f + i] = dyr[i] * silu(g);
        }
    });
}
