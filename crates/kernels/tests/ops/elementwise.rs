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

device_test!(a_reordered_tensor_copies_on_its_own_device, |dev: &Device| {
    // Outer dimensions swapped (the sequence- and context-parallel reorders: a few long runs,
    // copied on the device), the last two swapped (runs of one element), in f32, bf16 and u32.
    let v: Vec<f64> = (0..3 * 4 * 5).map(|i| i as f64).collect();
    for dt in [DType::F32, DType::BF16] {
        let x = tensor(dev, &v, &[3, 4, 5], dt);
        let c = tensor(&Device::Cpu, &v, &[3, 4, 5], dt);
        for (a, b) in [(0, 1), (1, 2), (0, 2)] {
            let got = x.transpose(a, b).unwrap().contiguous().unwrap();
            let want = c.transpose(a, b).unwrap().contiguous().unwrap();
            assert!(got.device().same(dev), "{dt} transpose({a}, {b}) left its device");
            assert_eq!(got.dims(), want.dims());
            assert_eq!(host(&got), host(&want), "{dt} transpose({a}, {b})");
        }
        // A view at an offset, reordered: rows 1..3 of the outer dimension.
        let got = x.narrow0(1..3).unwrap().transpose(0, 1).unwrap().contiguous().unwrap();
        let want = c.narrow0(1..3).unwrap().transpose(0, 1).unwrap().contiguous().unwrap();
        assert_eq!(host(&got), host(&want), "{dt} narrowed then transposed");
    }
    let ids = ferrotron_core::Tensor::from_vec((0u32..24).collect(), [2, 3, 4], dev).unwrap();
    let got = ids.transpose(0, 1).unwrap().contiguous().unwrap().to_vec::<u32>().unwrap();
    assert_eq!(&got[..8], [0, 1, 2, 3, 12, 13, 14, 15]);
});

// Random normal values keyed as dropout's words: each element Box–Muller on the first two words
// of its own Philox block (naive here, from the block's words), a shard and a context-parallel
// split at their words of the whole row, standard moments over many values.
device_test!(normal_values_are_box_muller_of_their_words, |dev: &Device| {
    use ferrotron_core::rng::Philox;
    let key = k::DropoutKey { seed: 9, stream: 0xabc, base: (1 << 34) + 3, batch_stride: 500, offset: 40, split: None };
    let naive = |key: &k::DropoutKey, rows: usize, row: usize| -> Vec<f64> {
        let rng = Philox::new(key.seed).with_stream(key.stream);
        let unit = |w: u32| (w >> 8) as f64 / (1u64 << 24) as f64;
        (0..rows * row)
            .map(|i| {
                let w = rng.block(key.word((i / row) as u64, (i % row) as u64));
                (-2.0 * (1.0 - unit(w[0])).ln()).sqrt() * (2.0 * std::f64::consts::PI * unit(w[1])).cos()
            })
            .collect()
    };
    for dt in [DType::F32, DType::BF16] {
        let tol = if dt == DType::F32 { 1e-6 } else { 8e-3 };
        let y = k::normal([3, 40], dt, dev, &key).unwrap();
        assert_eq!((y.dims(), y.dtype()), (&[3usize, 40][..], dt));
        assert_close(&host(&y), &naive(&key, 3, 40), tol, tol, &format!("normal {dt:?}"));
        let split = k::DropoutKey { split: Some(k::DropSplit { at: 16, offset: 300 }), ..key };
        assert_close(&host(&k::normal([3, 40], dt, dev, &split).unwrap()), &naive(&split, 3, 40), tol, tol, "split");
    }
    // Columns 10.. of the whole row are a shard from offset 50 on.
    let whole = host(&k::normal([2, 30], DType::F32, dev, &k::DropoutKey { offset: 40, ..key }).unwrap());
    let shard = host(&k::normal([2, 20], DType::F32, dev, &k::DropoutKey { offset: 50, ..key }).unwrap());
    assert_eq!(shard[..20], whole[10..30]);
    let many = host(&k::normal([4, 5000], DType::F32, dev, &key).unwrap());
    let mean = many.iter().sum::<f64>() / many.len() as f64;
    let var = many.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / many.len() as f64;
    assert!(mean.abs() < 0.03 && (var - 1.0).abs() < 0.05, "mean {mean}, variance {var}");
    assert!(k::normal([2, 3], DType::F16, dev, &key).is_err());
});
