use crate::device_test;
use crate::util::*;
use ferrotron_core::{DType, Device, Tensor};
use ferrotron_kernels as k;
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn bias_add_and_its_gradient(rows in 1usize..6, c in 1usize..7, seed: u64) {
        let dev = Device::Cpu;
        let (x, b, r) = (randv(rows * c, seed), randv(c, seed ^ 1), randv(rows * c, seed ^ 2));
        let y = k::bias_add(&t32(&dev, &x, &[rows, c]), &t32(&dev, &b, &[c])).unwrap();
        let want: Vec<f64> = x.iter().enumerate().map(|(i, v)| v + b[i % c]).collect();
        assert_close(&host(&y), &want, 1e-6, 1e-6, "bias_add");
        // d/db Σ (x + b)·r, by finite differences of the naive forward.
        let db = k::bias_grad(&t32(&dev, &r, &[rows, c])).unwrap();
        fd_check(&b, &host(&db), |b| x.iter().enumerate().map(|(i, v)| (v + b[i % c]) * r[i]).sum(), "bias grad");
    }
}

device_test!(add_scale_and_accumulate, |dev: &Device| {
    let (a, b) = (randv(10, 1), randv(10, 2));
    let (at, bt) = (t32(dev, &a, &[2, 5]), t32(dev, &b, &[2, 5]));
    let sum: Vec<f64> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
    assert_close(&host(&k::add(&at, &bt).unwrap()), &sum, 1e-6, 1e-6, "add");
    assert_close(
        &host(&k::scale(&at, 3.0).unwrap()),
        &a.iter().map(|x| 3.0 * x).collect::<Vec<_>>(),
        1e-6,
        1e-6,
        "scale",
    );
    // add_ into an f32 accumulator from bf16 values (main_grad += bf16 grad).
    let acc = t32(dev, &a, &[2, 5]);
    let bb = tensor(dev, &b, &[2, 5], DType::BF16);
    k::add_(&acc, &bb).unwrap();
    let bround = host(&bb);
    assert_close(&host(&acc), &a.iter().zip(&bround).map(|(x, y)| x + y).collect::<Vec<_>>(), 1e-6, 1e-6, "add_");
    k::scale_(&acc, 0.0).unwrap();
    assert!(host(&acc).iter().all(|&x| x == 0.0));
    assert!(k::add_(&acc, &acc).is_err());
    assert!(k::add(&at, &t32(dev, &a[..5], &[5])).is_err());
});

device_test!(cast_round_trips_through_bf16_and_f16, |dev: &Device| {
    let vals: Vec<f64> = (-20..20).map(|i| i as f64 * 0.25).collect();
    let t = t32(dev, &vals, &[40]);
    for d in [DType::BF16, DType::F16] {
        let narrow = k::cast(&t, d).unwrap();
        assert_eq!(narrow.dtype(), d);
        assert_eq!(host(&k::cast(&narrow, DType::F32).unwrap()), vals, "{d}");
    }
    let ids = Tensor::from_vec(vec![1u32, 2], [2], dev).unwrap();
    assert!(k::cast(&ids, DType::F32).is_err());
});
