//! exp over slices (and pointwise maps that call it), the softmax- and activation-shaped loops' hot spot (libm's expf was 15% of a CPU step, called
//! one element at a time). For f32: Cody–Waite range reduction x = n·ln2 + r and a degree-6
//! polynomial for e^r (max relative error ≈ 2 ulp over the float range), branch-free so LLVM
//! vectorises the loop; compiled three times (AVX-512, AVX2, baseline) and picked at run time.
//! Plain mul/add (never FMA) and a fixed 16-lane sum keep the results identical on every x86 CPU,
//! whatever vector width it has.

const LANES: usize = 16;

/// `pub fn $name(args) [-> R]` that runs `$body(args)` compiled for AVX-512, AVX2 or the
/// baseline, whichever this CPU has (`is_x86_feature_detected!` is a cached load). `$body` is
/// `#[inline(always)]`, so each copy is vectorised for its instruction set.
macro_rules! multiversion {
    ($(#[$m:meta])* pub fn $name:ident($($a:ident: $t:ty),*) $(-> $r:ty)? = $body:ident;) => {
        $(#[$m])*
        pub fn $name($($a: $t),*) $(-> $r)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f")]
                fn avx512($($a: $t),*) $(-> $r)? {
                    $body($($a),*)
                }
                #[target_feature(enable = "avx2")]
                fn avx2($($a: $t),*) $(-> $r)? {
                    $body($($a),*)
                }
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: the CPU has AVX-512F (checked above).
                    return unsafe { avx512($($a),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2") {
                    // SAFETY: the CPU has AVX2 (checked above).
                    return unsafe { avx2($($a),*) };
                }
            }
            $body($($a),*)
        }
    };
}

/// e^x for one f32 (inlined into vectorised loops; `Real::fexp`).
#[inline(always)]
pub fn exp1(x: f32) -> f32 {
    // Below −87.3 the result is under f32's normal range: flush to exactly 0 (as expf does, give
    // or take denormals); above 88.7 it overflows to +inf.
    let xc = x.clamp(-87.3, 88.72);
    // n = round(x / ln 2) by the 1.5·2²³ trick (round-to-nearest-even, vectorises); at most 127
    // so that 2ⁿ stays finite (just below ln(f32::MAX) r then reaches ≈ ln 2, still accurate).
    let magic = 12_582_912.0f32;
    let t = xc * std::f32::consts::LOG2_E + magic;
    let n = (t - magic).min(127.0);
    // The same n as an integer, read from t's low mantissa bits: Rust's saturating `as i32` made
    // LLVM convert lane by lane (scalar compares and inserts inside the vector loop).
    let ni = (t.to_bits() as i32).wrapping_sub(magic.to_bits() as i32).min(127);
    // r = x − n·ln2 in two parts (ln2_hi has trailing zero bits, so n·ln2_hi is exact).
    let r = (xc - n * 0.693_359_4) - n * -2.121_944_4e-4;
    // e^r on |r| ≤ ln2/2: Taylor–Cephes coefficients.
    let p = ((((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 1.666_666_5e-1)
        * r
        + 0.5)
        * r
        + 1.0)
        * r
        + 1.0;
    let scale = f32::from_bits(((ni + 127) << 23) as u32);
    let y = p * scale;
    if x < -87.3 {
        0.0
    } else if x > 88.722_84 {
        f32::INFINITY
    } else {
        y
    }
}

/// xs[i] = exp(xs[i] − m); returns Σ of the results (summed in 16 fixed lanes).
#[inline(always)]
fn exp_sub_sum_body(xs: &mut [f32], m: f32) -> f32 {
    let mut acc = [0.0f32; LANES];
    let mut chunks = xs.chunks_exact_mut(LANES);
    for c in &mut chunks {
        for (a, x) in acc.iter_mut().zip(c.iter_mut()) {
            *x = exp1(*x - m);
            *a += *x;
        }
    }
    for (a, x) in acc.iter_mut().zip(chunks.into_remainder()) {
        *x = exp1(*x - m);
        *a += *x;
    }
    acc.iter().fold(0.0, |s, &a| s + a)
}

multiversion! {
    /// xs[i] = exp(xs[i] − m); returns their sum (`Real::exp_sub_sum` for f32).
    pub fn exp_sub_sum_f32(xs: &mut [f32], m: f32) -> f32 = exp_sub_sum_body;
}

#[inline(always)]
fn map1_body(x: &[f32], y: &mut [f32], f: impl Fn(f32) -> f32) {
    for (o, &v) in y.iter_mut().zip(x) {
        *o = f(v);
    }
}

#[inline(always)]
fn map2_body(x: &[f32], g: &[f32], y: &mut [f32], f: impl Fn(f32, f32) -> f32) {
    for (o, (&v, &w)) in y.iter_mut().zip(x.iter().zip(g)) {
        *o = f(v, w);
    }
}

multiversion! {
    /// y[i] = f(x[i]), the loop compiled for the widest vector unit here (f made of plain float
    /// ops and `exp1` vectorises; no FMA contraction, so every CPU gets the same bits).
    pub fn map1_f32(x: &[f32], y: &mut [f32], f: impl Fn(f32) -> f32) = map1_body;
}

multiversion! {
    /// y[i] = f(x[i], g[i]), as `map1_f32`.
    pub fn map2_f32(x: &[f32], g: &[f32], y: &mut [f32], f: impl Fn(f32, f32) -> f32) = map2_body;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_libm_within_a_few_ulp_over_the_range() {
        let mut worst = 0.0f64;
        let n = 200_000;
        let xs: Vec<f32> = (0..n).map(|i| -87.0 + 175.0 * i as f32 / n as f32).collect();
        let mut ys = xs.clone();
        exp_sub_sum_f32(&mut ys, 0.0);
        for (x, y) in xs.iter().zip(&ys) {
            let want = (*x as f64).exp();
            worst = worst.max(((*y as f64) - want).abs() / want);
        }
        assert!(worst < 4.0 * f32::EPSILON as f64, "max relative error {worst:e}");
        // Just below overflow (2ⁿ capped at 2¹²⁷): finite and close.
        let mut top: Vec<f32> = (0..100).map(|i| 88.3 + 0.0042 * i as f32).collect();
        let want: Vec<f64> = top.iter().map(|&x| (x as f64).exp()).collect();
        exp_sub_sum_f32(&mut top, 0.0);
        for (y, w) in top.iter().zip(&want) {
            assert!(y.is_finite() && ((*y as f64) - w).abs() / w < 1e-5, "{y} vs {w}");
        }
        // The sum, where it stays finite.
        let mut zs: Vec<f32> = xs.iter().map(|x| x / 4.0).collect();
        let want_sum: f64 = zs.iter().map(|&z| (z as f64 - 1.5).exp()).sum();
        let sum = exp_sub_sum_f32(&mut zs, 1.5);
        assert!((sum as f64 - want_sum).abs() / want_sum < 1e-5, "{sum} vs {want_sum}");
    }

    #[test]
    fn edges_flush_and_overflow_like_expf() {
        let mut v = [f32::NEG_INFINITY, -100.0, -87.5, 0.0, 89.0, f32::INFINITY, 1.0];
        let s = exp_sub_sum_f32(&mut v, 0.0);
        assert_eq!(&v[..4], &[0.0, 0.0, 0.0, 1.0]);
        assert!(v[4].is_infinite() && v[5].is_infinite() && s.is_infinite());
        assert!((v[6] - std::f32::consts::E).abs() <= f32::EPSILON * 3.0);
        // The shift is applied first: exp(x − m).
        let mut w = [3.0f32; 37];
        let s = exp_sub_sum_f32(&mut w, 3.0);
        assert_eq!((w[36], s), (1.0, 37.0));
    }

    #[test]
    fn every_instruction_set_gives_the_same_bits() {
        let xs: Vec<f32> = (0..1001).map(|i| ((i * 7919) % 1000) as f32 * -0.05).collect();
        let (mut a, mut b) = (xs.clone(), xs.clone());
        let sa = exp_sub_sum_body(&mut a, 0.25);
        let sb = exp_sub_sum_f32(&mut b, 0.25);
        assert_eq!(sa.to_bits(), sb.to_bits());
        assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
        let f = |v: f32| v / (1.0 + exp1(-v));
        let (mut c, mut d) = (vec![0.0; xs.len()], vec![0.0; xs.len()]);
        map1_body(&xs, &mut c, f);
        map1_f32(&xs, &mut d, f);
        assert!(c.iter().zip(&d).all(|(x, y)| x.to_bits() == y.to_bits()));
        let g = |v: f32, w: f32| w * exp1(v);
        map2_body(&xs, &c, &mut a, g);
        map2_f32(&xs, &c, &mut b, g);
        assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
    }
}
