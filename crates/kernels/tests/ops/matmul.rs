use crate::device_test;
use crate::util::*;
use ferrotron_core::{Device, Error};
use ferrotron_kernels::{self as k, cpu::matmul as mm};
use proptest::prelude::*;

/// Naive C = op(A)·op(B) over a batch, row-major.
fn reference(batch: usize, m: usize, n: usize, kk: usize, a: &[f64], ta: bool, b: &[f64], tb: bool) -> Vec<f64> {
    let mut c = vec![0.0; batch * m * n];
    for z in 0..batch {
        let (a, b) = (&a[z * m * kk..], &b[z * kk * n..]);
        for i in 0..m {
            for j in 0..n {
                let mut s = 0.0;
                for p in 0..kk {
                    let av = if ta { a[p * m + i] } else { a[i * kk + p] };
                    let bv = if tb { b[j * kk + p] } else { b[p * n + j] };
                    s += av * bv;
                }
                c[z * m * n + i * n + j] = s;
            }
        }
    }
    c
}

fn shape(batch: usize, r: usize, c: usize, t: bool) -> Vec<usize> {
    if t { vec![batch, c, r] } else { vec![batch, r, c] }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn matches_reference(batch in 1usize..3, m in 1usize..7, n in 1usize..7, kk in 1usize..7, ta: bool, tb: bool, seed: u64) {
        let dev = Device::Cpu;
        let (a, b) = (randv(batch * m * kk, seed), randv(batch * kk * n, seed ^ 1));
        let at = t32(&dev, &a, &shape(batch, m, kk, ta));
        let bt = t32(&dev, &b, &shape(batch, kk, n, tb));
        let c = k::matmul(&at, &bt, ta, tb).unwrap();
        prop_assert_eq!(c.dims(), &[batch, m, n]);
        assert_close(&host(&c), &reference(batch, m, n, kk, &a, ta, &b, tb), 1e-5, 1e-5, "matmul");
    }

    #[test]
    fn backward_matches_finite_differences(batch in 1usize..3, m in 1usize..5, n in 1usize..5, kk in 1usize..5, ta: bool, tb: bool, seed: u64) {
        let (a, b, r) = (randv(batch * m * kk, seed), randv(batch * kk * n, seed ^ 1), randv(batch * m * n, seed ^ 2));
        let fwd = |a: &[f64], b: &[f64]| {
            let mut c = vec![0.0; batch * m * n];
            mm::gemm_batched(batch, m, n, kk, a, ta, b, tb, &mut c, false, 1.0);
            dot(&c, &r)
        };
        let (mut da, mut db) = (vec![0.0; a.len()], vec![0.0; b.len()]);
        mm::gemm_bwd(batch, m, n, kk, &a, ta, &b, tb, &r, Some(&mut da), Some(&mut db), false);
        fd_check(&a, &da, |x| fwd(x, &b), "dA");
        fd_check(&b, &db, |x| fwd(&a, x), "dB");
        // The tensor-level backward agrees with the f64 one.
        let dev = Device::Cpu;
        let (at, bt) = (t32(&dev, &a, &shape(batch, m, kk, ta)), t32(&dev, &b, &shape(batch, kk, n, tb)));
        let (dat, dbt) = k::matmul_bwd(&at, &bt, &t32(&dev, &r, &[batch, m, n]), ta, tb).unwrap();
        assert_close(&host(&dat), &da, 1e-4, 1e-5, "tensor dA");
        assert_close(&host(&dbt), &db, 1e-4, 1e-5, "tensor dB");
    }
}

device_test!(linear_layer_broadcasts_2d_weight, |dev: &Device| {
    // x [2, 3, 4] · Wᵀ with W [5, 4] stored as in a linear layer (tb).
    let (x, w) = (randv(24, 1), randv(20, 2));
    let y = k::matmul(&t32(dev, &x, &[2, 3, 4]), &t32(dev, &w, &[5, 4]), false, true).unwrap();
    assert_eq!(y.dims(), &[2, 3, 5]);
    assert_close(&host(&y), &reference(1, 6, 5, 4, &x, false, &w, true), 1e-5, 1e-5, "linear");
});

device_test!(matmul_into_accumulates, |dev: &Device| {
    let (a, b, c0) = (randv(6, 3), randv(6, 4), randv(4, 5));
    let c = t32(dev, &c0, &[2, 2]);
    k::matmul_into(&c, &t32(dev, &a, &[2, 3]), &t32(dev, &b, &[3, 2]), false, false, true).unwrap();
    let want: Vec<f64> = reference(1, 2, 2, 3, &a, false, &b, false).iter().zip(&c0).map(|(p, c)| p + c).collect();
    assert_close(&host(&c), &want, 1e-5, 1e-5, "c += ab");
    k::matmul_into(&c, &t32(dev, &a, &[2, 3]), &t32(dev, &b, &[3, 2]), false, false, false).unwrap();
    assert_close(&host(&c), &reference(1, 2, 2, 3, &a, false, &b, false), 1e-5, 1e-5, "c = ab");
});

device_test!(bf16_storage_stays_close, |dev: &Device| {
    let (a, b) = (randv(64 * 32, 6), randv(32 * 16, 7));
    let c = k::matmul(
        &tensor(dev, &a, &[64, 32], ferrotron_core::DType::BF16),
        &tensor(dev, &b, &[32, 16], ferrotron_core::DType::BF16),
        false,
        false,
    )
    .unwrap();
    assert_eq!(c.dtype(), ferrotron_core::DType::BF16);
    assert_close(&host(&c), &reference(1, 64, 16, 32, &a, false, &b, false), 2e-2, 0.15, "bf16 matmul");
});

/// A transposed (a weight gradient's Xᵀ) and large enough that `gemm_strided` splits C's rows
/// over the pool's threads (m ≥ 32 per thread, 2^18 multiply-adds): every row block, the ragged
/// last one included, equals the naive product, into a C with a row stride wider than n, written
/// and accumulated; the columns past n are left alone; and through `gemm_batched`. Run on pools
/// of 2, 3 and 4 threads.
#[test]
fn transposed_a_row_blocks_match_the_reference() {
    let (m, n, kk, ldc) = (203, 37, 300, 41);
    let (a, b) = (randv(kk * m, 11), randv(kk * n, 12));
    let want = reference(1, m, n, kk, &a, true, &b, false);
    let (a32, b32): (Vec<f32>, Vec<f32>) =
        (a.iter().map(|&x| x as f32).collect(), b.iter().map(|&x| x as f32).collect());
    for threads in [2, 3, 4] {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        for accumulate in [false, true] {
            let mut c = vec![0.5f32; (m - 1) * ldc + n + 3];
            pool.install(|| {
                mm::gemm_strided(
                    m,
                    n,
                    kk,
                    mm::MatRef::new(&a32, m, true),
                    mm::MatRef::new(&b32, n, false),
                    &mut c,
                    ldc,
                    accumulate,
                    1.0,
                    true,
                )
            });
            let got: Vec<f64> =
                (0..m * n).map(|x| c[(x / n) * ldc + x % n] as f64 - if accumulate { 0.5 } else { 0.0 }).collect();
            assert_close(&got, &want, 1e-4, 1e-4, &format!("{threads} threads, accumulate {accumulate}"));
            for r in 0..m - 1 {
                assert!(c[r * ldc + n..(r + 1) * ldc].iter().all(|&x| x == 0.5), "row {r}'s padding written");
            }
            assert!(c[(m - 1) * ldc + n..].iter().all(|&x| x == 0.5), "the tail past the last row written");
        }
        // The trainer's path (a batch of one, packed C): the same blocks.
        let mut c = vec![0f32; m * n];
        pool.install(|| mm::gemm_batched(1, m, n, kk, &a32, true, &b32, false, &mut c, false, 1.0));
        let got: Vec<f64> = c.iter().map(|&x| x as f64).collect();
        assert_close(&got, &want, 1e-4, 1e-4, &format!("batched, {threads} threads"));
    }
}

#[test]
fn shape_errors_name_the_op() {
    let dev = Device::Cpu;
    let e = k::matmul(&t32(&dev, &randv(6, 0), &[2, 3]), &t32(&dev, &randv(8, 0), &[4, 2]), false, false).unwrap_err();
    assert!(matches!(e, Error::ShapeMismatch { op: "matmul", .. }), "{e}");
    assert!(e.to_string().contains("[2, 3]") && e.to_string().contains("[4, 2]"), "{e}");
    let bf = tensor(&dev, &randv(6, 0), &[3, 2], ferrotron_core::DType::BF16);
    let e = k::matmul(&t32(&dev, &randv(6, 0), &[2, 3]), &bf, false, false).unwrap_err();
    assert!(matches!(e, Error::DTypeMismatch { op: "matmul", .. }), "{e}");
}

device_test!(matmul_bias_is_matmul_plus_bias, |dev: &Device| {
    let (x, w, b) = (randv(2 * 3 * 4, 11), randv(5 * 4, 12), randv(5, 13));
    let y =
        k::matmul_bias(&t32(dev, &x, &[2, 3, 4]), &t32(dev, &w, &[5, 4]), &t32(dev, &b, &[5]), false, true).unwrap();
    let want: Vec<f64> =
        reference(1, 6, 5, 4, &x, false, &w, true).iter().enumerate().map(|(i, v)| v + b[i % 5]).collect();
    assert_close(&host(&y), &want, 1e-5, 1e-5, "matmul_bias");
    assert!(
        k::matmul_bias(&t32(dev, &x, &[2, 3, 4]), &t32(dev, &w, &[5, 4]), &t32(dev, &b[..4], &[4]), false, true)
            .is_err()
    );
});
