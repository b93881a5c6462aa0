//! Test helpers: seeded data, tensor construction, tolerances, finite differences, per-device tests.

use ferrotron_core::{DType, Device, Tensor, rng::Philox};

/// Standard-normal f64 values from the project RNG (reproducible per seed).
pub fn randv(n: usize, seed: u64) -> Vec<f64> {
    let mut v = vec![0f32; n];
    Philox::new(seed).fill_normal(0, 0.0, 1.0, &mut v);
    v.into_iter().map(|x| x as f64).collect()
}

pub fn tensor(dev: &Device, v: &[f64], shape: &[usize], dtype: DType) -> Tensor {
    let f: Vec<f32> = v.iter().map(|&x| x as f32).collect();
    Tensor::from_f32(&f, shape.to_vec(), dtype, dev).expect("test tensor")
}

pub fn t32(dev: &Device, v: &[f64], shape: &[usize]) -> Tensor {
    tensor(dev, v, shape, DType::F32)
}

/// Host f64 copy, with the output poisoned first where the caller wants it (see `poison`).
pub fn host(t: &Tensor) -> Vec<f64> {
    t.to_vec_f32().expect("to host").into_iter().map(|x| x as f64).collect()
}

/// |got − want| ≤ atol + rtol·|want| elementwise, with a message naming the first failure.
#[track_caller]
pub fn assert_close(got: &[f64], want: &[f64], rtol: f64, atol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(g.is_finite(), "{what}[{i}]: got {g}");
        assert!((g - w).abs() <= atol + rtol * w.abs(), "{what}[{i}]: got {g}, want {w}");
    }
}

/// Central finite differences of `f` at `x`, compared with `analytic`.
#[track_caller]
pub fn fd_check(x: &[f64], analytic: &[f64], f: impl Fn(&[f64]) -> f64, what: &str) {
    let h = 1e-5;
    let mut xp = x.to_vec();
    let mut numeric = vec![0.0; x.len()];
    for i in 0..x.len() {
        let x0 = xp[i];
        let mut central = |h: f64| {
            xp[i] = x0 + h;
            let fp = f(&xp);
            xp[i] = x0 - h;
            let fm = f(&xp);
            xp[i] = x0;
            (fp - fm) / (2.0 * h)
        };
        // Richardson: the central differences at h and h / 2 combined so that their h² error
        // terms cancel. A plain central difference was off by 4e-5 relative on a norm row of
        // two small features (its third derivative is large; proptest-regressions/norm.txt).
        let (d1, d2) = (central(h), central(h / 2.0));
        numeric[i] = (4.0 * d2 - d1) / 3.0;
    }
    assert_close(analytic, &numeric, 1e-5, 1e-6, what);
}

/// Σ y·r: a scalar whose gradient w.r.t. y is r.
pub fn dot(y: &[f64], r: &[f64]) -> f64 {
    y.iter().zip(r).map(|(a, b)| a * b).sum()
}

/// Defines `$name` as a test run once per device (CPU always; CUDA with the `cuda` feature).
#[macro_export]
macro_rules! device_test {
    ($name:ident, $body:expr) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;
            #[test]
            fn cpu() {
                ($body)(&ferrotron_core::Device::Cpu);
            }
            #[cfg(feature = "cuda")]
            #[test]
            fn cuda() {
                let dev = ferrotron_core::Device::cuda(0).expect("a CUDA device for the cuda tests");
                ($body)(&dev);
            }
        }
    };
}
