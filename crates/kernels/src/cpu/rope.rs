//! Rotary position embedding, rotate-half convention (GPT-NeoX, Llama, Megatron's default) or
//! interleaved (GPT-J, Megatron's --rotary-interleaved).
//!
//! Shapes: x, y [B, T, H, D]; the first `rot` (even, ≤ D) features of each head rotate, the rest pass.
//! Pair i (< rot/2) is (x[i], x[i + rot/2]) (interleaved: (x[2i], x[2i + 1]); written (a, b)
//! below) at angle θ = pos(t) · f_i, f_i = base^(−2i/rot), where
//! pos(t) = pos0 + t, or with a `RopeSplit` (context parallelism: a rank's rows are two chunks of
//! the sequence far apart) split.pos + t − split.at from row split.at on
//! (with `RopeScaling`, Llama 3.1's frequency-dependent rescaling of f_i; with `Yarn`, YaRN's
//! blend of f_i / factor and f_i along the pairs, and cos θ, sin θ times its attention factor m;
//! with `interpolation` s, linear position interpolation: θ = (pos(t) / s) · f_i):
//!   y[a] = m·(x[a]·cos θ − x[b]·sin θ),  y[b] = m·(x[b]·cos θ + x[a]·sin θ).
//! Backward is the rotation by −θ. `rope_qkv_` applies the same to the query and key heads of a
//! fused QKV row in place, leaving its value heads.

use crate::real::Real;
use rayon::prelude::*;

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeCfg {
    pub rot: usize,
    pub base: f64,
    /// Position of the first token (non-zero for continued generation).
    pub pos0: usize,
    /// Llama 3.x's scaled frequencies (Megatron's --use-rope-scaling), or None.
    pub scaling: Option<RopeScaling>,
    /// Where the rows jump to other positions, or None (every row at pos0 + row).
    pub split: Option<RopeSplit>,
    /// YaRN's scaled frequencies and attention factor (Megatron's --rope-type yarn), or None.
    pub yarn: Option<Yarn>,
    /// Linear position interpolation (Megatron's --rotary-seq-len-interpolation-factor,
    /// transformers' rope_type `linear`): every position divided by this factor, or None.
    pub interpolation: Option<f64>,
    /// Pair i is (x[2i], x[2i + 1]) (GPT-J's layout, Megatron's --rotary-interleaved, DeepSeek's
    /// MLA checkpoints) instead of (x[i], x[i + rot/2]).
    pub interleaved: bool,
}

/// YaRN (Megatron's YarnRotaryEmbedding, transformers' rope_type `yarn`): pair i's frequency
/// f_i / factor · ramp_i + f_i · (1 − ramp_i), the ramp rising linearly from 0 at pair `low` to 1
/// at pair `high` (the pairs that turn `beta_fast` and `beta_slow` times over the original
/// context, floored and ceiled), and cos / sin scaled by mscale(factor, mscale) /
/// mscale(factor, mscale_all_dim), mscale(s, m) = 0.1·m·ln s + 1 (1 for s ≤ 1).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Yarn {
    pub factor: f64,
    pub original_max_position_embeddings: f64,
    pub beta_fast: f64,
    pub beta_slow: f64,
    pub mscale: f64,
    pub mscale_all_dim: f64,
}

impl Yarn {
    /// Megatron's MLA defaults at scaling `factor`: original context 4096, β 32 and 1, mscale 1,
    /// mscale_all_dim 0.
    pub fn megatron(factor: f64) -> Yarn {
        Yarn {
            factor,
            original_max_position_embeddings: 4096.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            mscale: 1.0,
            mscale_all_dim: 0.0,
        }
    }

    /// Why these numbers cannot scale anything, if they cannot.
    pub fn problem(&self) -> Option<String> {
        let pos = |v: f64| v.is_finite() && v > 0.0;
        let ok = pos(self.factor)
            && pos(self.original_max_position_embeddings)
            && pos(self.beta_fast)
            && pos(self.beta_slow)
            && self.mscale.is_finite()
            && self.mscale_all_dim.is_finite();
        (!ok).then(|| format!("YaRN {self:?}: the factor, context and betas must be positive and finite"))
    }

    /// 0.1·m·ln s + 1, or 1 for s ≤ 1.
    pub fn mscale_of(s: f64, m: f64) -> f64 {
        if s <= 1.0 { 1.0 } else { 0.1 * m * s.ln() + 1.0 }
    }

    /// The factor on cos and sin.
    pub fn attention_factor(&self) -> f64 {
        Self::mscale_of(self.factor, self.mscale) / Self::mscale_of(self.factor, self.mscale_all_dim)
    }

    /// The factor on the softmax scale of an attention whose rotary part this is (MLA's):
    /// mscale(factor, mscale_all_dim)².
    pub fn softmax_factor(&self) -> f64 {
        Self::mscale_of(self.factor, self.mscale_all_dim).powi(2)
    }

    /// The ramp's ends (low, high) over the pairs of a `rot`-wide rotation at `base`.
    pub fn range(&self, rot: usize, base: f64) -> (f64, f64) {
        let dim = |turns: f64| {
            rot as f64 * (self.original_max_position_embeddings / (turns * 2.0 * std::f64::consts::PI)).ln()
                / (2.0 * base.ln())
        };
        let low = dim(self.beta_fast).floor().max(0.0);
        let high = dim(self.beta_slow).ceil().min(rot as f64 - 1.0);
        (low, if low == high { high + 0.001 } else { high })
    }

    /// Pair i's frequency from its unscaled `f`.
    pub fn apply(&self, i: usize, f: f64, (low, high): (f64, f64)) -> f64 {
        let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
        f / self.factor * ramp + f * (1.0 - ramp)
    }
}

/// Rows from `at` on sit at positions `pos`, `pos` + 1, … (the rows before at pos0, pos0 + 1, …).
/// Context parallelism's rank holds sequence chunks r and 2·cp − 1 − r: `at` is the chunk length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RopeSplit {
    pub at: usize,
    pub pos: usize,
}

/// Llama 3.1's RoPE scaling (HF's rope_type `llama3`): a frequency whose wavelength 2π/f exceeds
/// `original_max_position_embeddings / low_freq_factor` is divided by `factor`, one shorter than
/// `original_max_position_embeddings / high_freq_factor` is kept, and one between is blended
/// linearly in `original / wavelength`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeScaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: f64,
}

impl RopeScaling {
    /// Megatron's `--use-rope-scaling --rope-scaling-factor F` (its other constants fixed: low 1,
    /// high 4, original context 8192, as in every Llama 3.1 to 3.3 release).
    pub fn llama3(factor: f64) -> Self {
        RopeScaling { factor, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position_embeddings: 8192.0 }
    }

    /// Why these numbers cannot scale anything, if they cannot: every one positive and finite,
    /// the high-frequency factor above the low.
    pub fn problem(&self) -> Option<String> {
        let ok = |v: f64| v.is_finite() && v > 0.0;
        let all = [self.factor, self.low_freq_factor, self.high_freq_factor, self.original_max_position_embeddings];
        (!all.into_iter().all(ok) || self.high_freq_factor <= self.low_freq_factor).then(|| {
            format!("RoPE scaling {self:?}: the factors and context must be positive, high_freq_factor above low_freq_factor")
        })
    }

    /// The scaled frequency of unscaled frequency `f`.
    pub fn apply(&self, f: f64) -> f64 {
        let wavelen = 2.0 * std::f64::consts::PI / f;
        let orig = self.original_max_position_embeddings;
        if wavelen < orig / self.high_freq_factor {
            f
        } else if wavelen > orig / self.low_freq_factor {
            f / self.factor
        } else {
            let smooth = (orig / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor);
            (1.0 - smooth) * f / self.factor + smooth * f
        }
    }
}

impl RopeCfg {
    /// Plain RoPE over the first `rot` features at `base`: from position 0, rotate-half, no
    /// scaling, split or interpolation (the other fields by struct update where wanted).
    pub fn new(rot: usize, base: f64) -> Self {
        RopeCfg { rot, base, pos0: 0, scaling: None, split: None, yarn: None, interpolation: None, interleaved: false }
    }

    /// The features (a, b) of pair i.
    pub fn pair(&self, i: usize) -> (usize, usize) {
        if self.interleaved { (2 * i, 2 * i + 1) } else { (i, i + self.rot / 2) }
    }

    /// The position of row `p` of a sequence.
    pub fn position(&self, p: usize) -> usize {
        match self.split {
            Some(s) if p >= s.at => s.pos + (p - s.at),
            _ => self.pos0 + p,
        }
    }

    /// The angle of row `p` for a pair of frequency `f`: its position, divided by the
    /// interpolation factor, times f (in f64; rope.cu's `rope_cs` the same).
    pub fn angle(&self, p: usize, f: f64) -> f64 {
        let pos = self.position(p) as f64;
        self.interpolation.map_or(pos, |s| pos / s) * f
    }

    /// Pair i's frequency (radians per position), in f64. rope.cu's `rope_freq` is the same.
    pub fn freq(&self, i: usize) -> f64 {
        let f = self.base.powf(-(2.0 * i as f64) / self.rot as f64);
        let f = self.scaling.map_or(f, |s| s.apply(f));
        self.yarn.map_or(f, |y| y.apply(i, f, y.range(self.rot, self.base)))
    }
}

/// cos/sin tables [T, rot/2], computed in f64.
fn tables<T: Real>(t: usize, cfg: &RopeCfg) -> (Vec<T>, Vec<T>) {
    let half = cfg.rot / 2;
    let mut cos = Vec::with_capacity(t * half);
    let mut sin = Vec::with_capacity(t * half);
    let m = cfg.yarn.map_or(1.0, |y| y.attention_factor());
    // Each pair's frequency once (YaRN's ramp takes logarithms), not once per position.
    let freqs: Vec<f64> = (0..half).map(|i| cfg.freq(i)).collect();
    for p in 0..t {
        for f in &freqs {
            let a = cfg.angle(p, *f);
            cos.push(T::c(m * a.cos()));
            sin.push(T::c(m * a.sin()));
        }
    }
    (cos, sin)
}

/// Rotates every head of `x` [rows, h, d] in place, position `row % t`, except the heads that
/// `skip` names (the value heads of a fused QKV row: `head % (g + 2) == g + 1`).
fn rotate_<T: Real>(x: &mut [T], t: usize, h: usize, d: usize, cfg: &RopeCfg, sign: T, skip: Option<usize>) {
    let half = cfg.rot / 2;
    let (cos, sin) = tables::<T>(t, cfg);
    x.par_chunks_mut(h * d).enumerate().for_each(|(row, xr)| {
        let p = row % t;
        for (head, xs) in xr.chunks_mut(d).enumerate() {
            if skip.is_some_and(|period| head % period == period - 1) {
                continue;
            }
            for i in 0..half {
                let (c, s) = (cos[p * half + i], sign * sin[p * half + i]);
                let (ia, ib) = cfg.pair(i);
                let (a, b) = (xs[ia], xs[ib]);
                xs[ia] = a * c - b * s;
                xs[ib] = b * c + a * s;
            }
        }
    });
}

pub fn rope_fwd<T: Real>(x: &[T], t: usize, h: usize, d: usize, cfg: &RopeCfg, y: &mut [T]) {
    y.copy_from_slice(x);
    rotate_(y, t, h, d, cfg, T::one(), None);
}

pub fn rope_bwd<T: Real>(dy: &[T], t: usize, h: usize, d: usize, cfg: &RopeCfg, dx: &mut [T]) {
    dx.copy_from_slice(dy);
    rotate_(dx, t, h, d, cfg, -T::one(), None);
}

/// RoPE in place on the query and key heads of a fused QKV tensor [B, T, hkv·(g + 2)·d] (each
/// group: g query heads, its key head, its value head); `sign` −1 is the backward (on dQKV).
pub fn rope_qkv_<T: Real>(qkv: &mut [T], t: usize, hkv: usize, g: usize, d: usize, cfg: &RopeCfg, sign: T) {
    rotate_(qkv, t, hkv * (g + 2), d, cfg, sign, Some(g + 2));
}
