//! Mamba-2's mixer ops: the causal depthwise convolution, the selective state-space scan (scalar A
//! per head, Mamba-2's SSD recurrence) and the gated grouped RMSNorm.
//!
//! Shapes: B sequences of T steps; H heads of P channels (d_inner = H·P); G groups of N state
//! channels (head h reads group h / (H/G)); Cd = H·P + 2·G·N (one row of xbc: x | B | C).
//!
//! - `conv_silu`: pre[b,t,c] = bias[c] + Σ_k w[c,k] · x[b, t−K+1+k, c] (zero before t = 0);
//!   y = silu(pre). Backward: dpre = dy · silu'(pre); dx[b,s,c] = Σ_k dpre[b, s+K−1−k, c] · w[c,k];
//!   dw[c,k] = Σ_{b,t} dpre[b,t,c] · x[b,t−K+1+k,c]; dbias = Σ dpre (both `=`, f32, summed per
//!   sequence then over sequences in order).
//! - `scan`: dt = softplus(dt_raw + dt_bias) (identity above 20, as Mamba's kernels), A = −exp(a_log).
//!   Per (b, h): S₀ = 0 [N, P]; S_t = exp(dt_t·A) · S_{t−1} + dt_t · B_t ⊗ x_t;
//!   y_t = S_tᵀ C_t + D · x_t. The state before every chunk of `CHUNK` steps is saved for the
//!   backward, which runs each chunk's steps again from it and walks back with G = ∂L/∂S_t:
//!   G += C_t ⊗ dy_t; dC_t = S_t dy_t; dx_t = dt_t · Gᵀ B_t + D·dy_t; dB_t = dt_t · G x_t;
//!   ddt = ⟨G, B_t ⊗ x_t⟩ + ⟨G, S_{t−1}⟩ · a_t · A; dA += ⟨G, S_{t−1}⟩ · a_t · dt_t; G ← a_t · G.
//!   dB and dC sum over the heads of a group. Parameter gradients (dt_bias, a_log, D) are `=`, f32,
//!   summed per sequence then over sequences in order.
//! - `gated_norm`: v = y · silu(z); per row and group of d_inner/G channels
//!   rstd = 1/√(mean(v²) + eps); out = v · rstd · w (Mamba-2's RMSNormGated, norm after the gate).

use super::activation::{silu, silu_grad};
use crate::real::Real;
use rayon::prelude::*;

/// Steps between the states the scan saves for its backward.
pub const CHUNK: usize = 64;

/// Scan dimensions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScanDims {
    pub batch: usize,
    pub seq: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub groups: usize,
    pub state: usize,
}

impl ScanDims {
    /// Columns of one xbc row: x | B | C.
    pub fn xbc_width(&self) -> usize {
        self.heads * self.head_dim + 2 * self.groups * self.state
    }
    pub fn chunks(&self) -> usize {
        self.seq.div_ceil(CHUNK)
    }
    /// Floats saved per (sequence, head): one [N, P] state per chunk.
    pub fn states_per_head(&self) -> usize {
        self.chunks() * self.state * self.head_dim
    }
}

/// softplus(x), Mamba's: x itself above 20.
fn softplus<T: Real>(x: T) -> T {
    if x > T::c(20.0) { x } else { (T::one() + x.fexp()).ln() }
}

fn softplus_grad<T: Real>(x: T) -> T {
    if x > T::c(20.0) { T::one() } else { T::one() / (T::one() + (-x).fexp()) }
}

/// x, w, bias → (y, pre) for sequence-major x [B, T, C] (`seq` = T), w [C, K].
fn conv_pre<T: Real>(x: &[T], w: &[T], bias: &[T], seq: usize, k: usize, pre: &mut [T]) {
    let c = bias.len();
    pre.par_chunks_mut(seq * c).zip(x.par_chunks(seq * c)).for_each(|(po, xs)| {
        for t in 0..seq {
            let row = &mut po[t * c..(t + 1) * c];
            row.copy_from_slice(bias);
            for j in 0..k {
                // tap j reads step t − (k − 1) + j
                let Some(s) = (t + j).checked_sub(k - 1) else { continue };
                let xr = &xs[s * c..(s + 1) * c];
                for (ch, o) in row.iter_mut().enumerate() {
                    *o += w[ch * k + j] * xr[ch];
                }
            }
        }
    });
}

/// y = silu(conv(x) + bias); x, y [B, T, C], w [C, K], bias [C].
pub fn conv_silu<T: Real>(x: &[T], w: &[T], bias: &[T], seq: usize, k: usize, y: &mut [T]) {
    conv_pre(x, w, bias, seq, k, y);
    y.par_iter_mut().for_each(|v| *v = silu(*v));
}

/// The backward of `conv_silu`: dx (`=`), and dw [C, K], dbias [C] (`=`).
#[allow(clippy::too_many_arguments)]
pub fn conv_silu_bwd<T: Real>(
    x: &[T],
    w: &[T],
    bias: &[T],
    dy: &[T],
    seq: usize,
    k: usize,
    dx: &mut [T],
    dw: &mut [T],
    dbias: &mut [T],
) {
    let c = bias.len();
    let mut dpre = vec![T::zero(); x.len()];
    conv_pre(x, w, bias, seq, k, &mut dpre);
    dpre.par_iter_mut().zip(dy).for_each(|(p, &g)| *p = g * silu_grad(*p));
    // Per sequence: dx and its share of dw, dbias.
    let parts: Vec<(Vec<T>, Vec<T>)> = dx
        .par_chunks_mut(seq * c)
        .zip(x.par_chunks(seq * c))
        .zip(dpre.par_chunks(seq * c))
        .map(|((dxs, xs), dps)| {
            dxs.fill(T::zero());
            let (mut dws, mut dbs) = (vec![T::zero(); c * k], vec![T::zero(); c]);
            for t in 0..seq {
                let dp = &dps[t * c..(t + 1) * c];
                dbs.iter_mut().zip(dp).for_each(|(a, &g)| *a += g);
                for j in 0..k {
                    let Some(s) = (t + j).checked_sub(k - 1) else { continue };
                    for ch in 0..c {
                        dxs[s * c + ch] += dp[ch] * w[ch * k + j];
                        dws[ch * k + j] += dp[ch] * xs[s * c + ch];
                    }
                }
            }
            (dws, dbs)
        })
        .collect();
    dw.fill(T::zero());
    dbias.fill(T::zero());
    for (dws, dbs) in parts {
        dw.iter_mut().zip(&dws).for_each(|(a, &g)| *a += g);
        dbias.iter_mut().zip(&dbs).for_each(|(a, &g)| *a += g);
    }
}

/// Per-head parameters of the scan: dt_bias, a_log, D, each [H].
pub struct ScanParams<'a, T> {
    pub dt_bias: &'a [T],
    pub a_log: &'a [T],
    pub d: &'a [T],
}

/// One step's inputs for head h of sequence b: (x [P], B [N], C [N], dt_raw).
struct Step<'a, T> {
    x: &'a [T],
    b: &'a [T],
    c: &'a [T],
}

fn step<'a, T>(xbc: &'a [T], dm: &ScanDims, bi: usize, t: usize, h: usize) -> Step<'a, T> {
    let (p, n) = (dm.head_dim, dm.state);
    let row = &xbc[(bi * dm.seq + t) * dm.xbc_width()..][..dm.xbc_width()];
    let g = h / (dm.heads / dm.groups);
    let hp = dm.heads * p;
    Step {
        x: &row[h * p..(h + 1) * p],
        b: &row[hp + g * n..hp + (g + 1) * n],
        c: &row[hp + dm.groups * n + g * n..hp + dm.groups * n + (g + 1) * n],
    }
}

/// The scan's forward: xbc [B, T, Cd], dt_raw [B, T, H] → y [B, T, H·P] (`=`) and the states
/// before each chunk, [B, H, chunks, N, P].
pub fn scan<T: Real>(xbc: &[T], dt_raw: &[T], prm: &ScanParams<T>, dm: &ScanDims, y: &mut [T], states: &mut [T]) {
    let (hh, p, n) = (dm.heads, dm.head_dim, dm.state);
    let per = dm.states_per_head();
    // One (sequence, head) per task; its y columns are strided, so they are gathered here and
    // written after.
    let outs: Vec<Vec<T>> = states
        .par_chunks_mut(per)
        .enumerate()
        .map(|(bh, saved)| {
            let (bi, h) = (bh / hh, bh % hh);
            let a = -prm.a_log[h].fexp();
            let mut s = vec![T::zero(); n * p];
            let mut ys = vec![T::zero(); dm.seq * p];
            for t in 0..dm.seq {
                if t % CHUNK == 0 {
                    saved[(t / CHUNK) * n * p..][..n * p].copy_from_slice(&s);
                }
                let st = step(xbc, dm, bi, t, h);
                let dt = softplus(dt_raw[(bi * dm.seq + t) * hh + h] + prm.dt_bias[h]);
                let decay = (dt * a).fexp();
                let yt = &mut ys[t * p..(t + 1) * p];
                for (i, &xp) in st.x.iter().enumerate() {
                    yt[i] = prm.d[h] * xp;
                }
                for (j, (&bj, &cj)) in st.b.iter().zip(st.c).enumerate() {
                    let row = &mut s[j * p..(j + 1) * p];
                    let db = dt * bj;
                    for (i, sv) in row.iter_mut().enumerate() {
                        *sv = decay * *sv + db * st.x[i];
                        yt[i] += cj * *sv;
                    }
                }
            }
            ys
        })
        .collect();
    let w = hh * p;
    y.par_chunks_mut(dm.seq * w).enumerate().for_each(|(bi, yb)| {
        for h in 0..hh {
            let ys = &outs[bi * hh + h];
            for t in 0..dm.seq {
                yb[t * w + h * p..t * w + (h + 1) * p].copy_from_slice(&ys[t * p..(t + 1) * p]);
            }
        }
    });
}

/// Gradients of the scan's per-head parameters, each [H] (`=`).
pub struct ScanParamGrads<'a, T> {
    pub dt_bias: &'a mut [T],
    pub a_log: &'a mut [T],
    pub d: &'a mut [T],
}

/// The scan's backward: dxbc [B, T, Cd] and ddt_raw [B, T, H] (`=`), and the parameters'.
#[allow(clippy::too_many_arguments)]
pub fn scan_bwd<T: Real>(
    xbc: &[T],
    dt_raw: &[T],
    prm: &ScanParams<T>,
    dm: &ScanDims,
    states: &[T],
    dy: &[T],
    dxbc: &mut [T],
    ddt: &mut [T],
    grads: ScanParamGrads<T>,
) {
    let (hh, p, n, gg) = (dm.heads, dm.head_dim, dm.state, dm.groups);
    let (cd, per, hpg) = (dm.xbc_width(), dm.states_per_head(), hh / gg);
    let w = hh * p;
    // One (sequence, group) per task: B and C are shared by the group's heads, so their
    // gradients sum there. Each task returns its dxbc rows' columns and ddt entries, and the
    // heads' parameter gradients.
    struct Part<T> {
        dx: Vec<T>,  // [hpg, T, P]
        dbc: Vec<T>, // [T, 2N]: dB | dC
        ddt: Vec<T>, // [hpg, T]
        prm: Vec<T>, // [hpg, 3]: dt_bias, a_log, D
    }
    let parts: Vec<Part<T>> = (0..dm.batch * gg)
        .into_par_iter()
        .map(|bg| {
            let (bi, g) = (bg / gg, bg % gg);
            let mut part = Part {
                dx: vec![T::zero(); hpg * dm.seq * p],
                dbc: vec![T::zero(); dm.seq * 2 * n],
                ddt: vec![T::zero(); hpg * dm.seq],
                prm: vec![T::zero(); hpg * 3],
            };
            let mut chunk_states = vec![T::zero(); (CHUNK + 1) * n * p];
            let mut gs = vec![T::zero(); n * p];
            for hl in 0..hpg {
                let h = g * hpg + hl;
                let a = -prm.a_log[h].fexp();
                gs.fill(T::zero());
                let (mut d_d, mut d_a, mut d_bias) = (T::zero(), T::zero(), T::zero());
                for ck in (0..dm.chunks()).rev() {
                    let t0 = ck * CHUNK;
                    let t1 = (t0 + CHUNK).min(dm.seq);
                    // chunk_states[i] = S_{t0 + i − 1} (i = 0: the saved state before the chunk).
                    chunk_states[..n * p].copy_from_slice(&states[(bi * hh + h) * per + ck * n * p..][..n * p]);
                    for t in t0..t1 {
                        let st = step(xbc, dm, bi, t, h);
                        let dt = softplus(dt_raw[(bi * dm.seq + t) * hh + h] + prm.dt_bias[h]);
                        let decay = (dt * a).fexp();
                        let i = t - t0;
                        let (prev, next) = chunk_states.split_at_mut((i + 1) * n * p);
                        let prev = &prev[i * n * p..];
                        for j in 0..n {
                            for q in 0..p {
                                next[j * p + q] = decay * prev[j * p + q] + dt * st.b[j] * st.x[q];
                            }
                        }
                    }
                    for t in (t0..t1).rev() {
                        let st = step(xbc, dm, bi, t, h);
                        let raw = dt_raw[(bi * dm.seq + t) * hh + h] + prm.dt_bias[h];
                        let dt = softplus(raw);
                        let decay = (dt * a).fexp();
                        let i = t - t0;
                        let (s_prev, s_t) =
                            (&chunk_states[i * n * p..][..n * p], &chunk_states[(i + 1) * n * p..][..n * p]);
                        let dyt = &dy[(bi * dm.seq + t) * w + h * p..][..p];
                        let dxt = &mut part.dx[(hl * dm.seq + t) * p..][..p];
                        let dbc = &mut part.dbc[t * 2 * n..][..2 * n];
                        for q in 0..p {
                            dxt[q] = prm.d[h] * dyt[q];
                            d_d += dyt[q] * st.x[q];
                        }
                        let (mut d_dt, mut d_decay) = (T::zero(), T::zero());
                        for j in 0..n {
                            let (sr, pr, gr) = (&s_t[j * p..][..p], &s_prev[j * p..][..p], &mut gs[j * p..][..p]);
                            let (mut dc, mut u, mut da) = (T::zero(), T::zero(), T::zero());
                            for q in 0..p {
                                dc += sr[q] * dyt[q];
                                gr[q] += st.c[j] * dyt[q];
                                u += gr[q] * st.x[q];
                                da += gr[q] * pr[q];
                                dxt[q] += dt * st.b[j] * gr[q];
                                gr[q] = gr[q] * decay;
                            }
                            dbc[n + j] += dc;
                            dbc[j] += dt * u;
                            d_dt += st.b[j] * u;
                            d_decay += da;
                        }
                        d_dt += d_decay * decay * a;
                        d_a += d_decay * decay * dt;
                        let d_raw = d_dt * softplus_grad(raw);
                        part.ddt[hl * dm.seq + t] = d_raw;
                        d_bias += d_raw;
                    }
                }
                part.prm[hl * 3] = d_bias;
                part.prm[hl * 3 + 1] = d_a * a;
                part.prm[hl * 3 + 2] = d_d;
            }
            part
        })
        .collect();
    grads.dt_bias.fill(T::zero());
    grads.a_log.fill(T::zero());
    grads.d.fill(T::zero());
    let hp = hh * p;
    for (bg, part) in parts.iter().enumerate() {
        let (bi, g) = (bg / gg, bg % gg);
        for t in 0..dm.seq {
            let row = &mut dxbc[(bi * dm.seq + t) * cd..][..cd];
            for hl in 0..hpg {
                let h = g * hpg + hl;
                row[h * p..(h + 1) * p].copy_from_slice(&part.dx[(hl * dm.seq + t) * p..][..p]);
                ddt[(bi * dm.seq + t) * hh + h] = part.ddt[hl * dm.seq + t];
            }
            let dbc = &part.dbc[t * 2 * n..][..2 * n];
            row[hp + g * n..hp + (g + 1) * n].copy_from_slice(&dbc[..n]);
            row[hp + gg * n + g * n..hp + gg * n + (g + 1) * n].copy_from_slice(&dbc[n..]);
        }
        for hl in 0..hpg {
            let h = g * hpg + hl;
            grads.dt_bias[h] += part.prm[hl * 3];
            grads.a_log[h] += part.prm[hl * 3 + 1];
            grads.d[h] += part.prm[hl * 3 + 2];
        }
    }
}

/// out = rmsnorm_groups(y · silu(z)) · w and rstd [rows, G]; y, z, out [rows, C], w [C].
pub fn gated_norm<T: Real>(y: &[T], z: &[T], w: &[T], groups: usize, eps: f64, out: &mut [T], rstd: &mut [T]) {
    let c = w.len();
    let gsz = c / groups;
    out.par_chunks_mut(c).zip(rstd.par_chunks_mut(groups)).enumerate().for_each(|(r, (o, rs))| {
        let (yr, zr) = (&y[r * c..(r + 1) * c], &z[r * c..(r + 1) * c]);
        for (g, rv) in rs.iter_mut().enumerate() {
            let cols = g * gsz..(g + 1) * gsz;
            let mut ss = T::zero();
            for i in cols.clone() {
                let v = yr[i] * silu(zr[i]);
                o[i] = v;
                ss += v * v;
            }
            *rv = T::one() / (ss / T::c(gsz as f64) + T::c(eps)).sqrt();
            for i in cols {
                o[i] = o[i] * *rv * w[i];
            }
        }
    });
}

/// The backward of `gated_norm`: dy, dz (`=`) and dw [C] (`=`, f32, summed in row order).
#[allow(clippy::too_many_arguments)]
pub fn gated_norm_bwd<T: Real>(
    dout: &[T],
    y: &[T],
    z: &[T],
    w: &[T],
    rstd: &[T],
    groups: usize,
    dy: &mut [T],
    dz: &mut [T],
    dw: &mut [T],
) {
    let c = w.len();
    let gsz = c / groups;
    dy.par_chunks_mut(c).zip(dz.par_chunks_mut(c)).enumerate().for_each(|(r, (dyr, dzr))| {
        let (yr, zr, gr) = (&y[r * c..(r + 1) * c], &z[r * c..(r + 1) * c], &dout[r * c..(r + 1) * c]);
        for g in 0..groups {
            let rs = rstd[r * groups + g];
            let cols = g * gsz..(g + 1) * gsz;
            // dv = rstd · (ĝ − v̂ · mean(ĝ · v̂)), ĝ = dout · w, v̂ = v · rstd.
            let mut m = T::zero();
            for i in cols.clone() {
                m += gr[i] * w[i] * yr[i] * silu(zr[i]) * rs;
            }
            m = m / T::c(gsz as f64);
            for i in cols {
                let sz = silu(zr[i]);
                let v = yr[i] * sz;
                let dv = rs * (gr[i] * w[i] - v * rs * m);
                dyr[i] = dv * sz;
                dzr[i] = dv * yr[i] * silu_grad(zr[i]);
            }
        }
    });
    let s = crate::real::par_row_sum::<T>(dout.len() / c, c, |rows, acc| {
        for r in rows {
            for g in 0..groups {
                let rs = rstd[r * groups + g];
                for i in g * gsz..(g + 1) * gsz {
                    acc[i] += dout[r * c + i] * y[r * c + i] * silu(z[r * c + i]) * rs;
                }
            }
        }
    });
    dw.copy_from_slice(&s);
}
