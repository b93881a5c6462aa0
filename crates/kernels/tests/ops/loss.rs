use crate::device_test;
use crate::util::*;
use ferrotron_core::{DType, Device, Error, Tensor};
use ferrotron_kernels::{self as k, CrossEntropyCfg, cpu::loss};
use proptest::prelude::*;

fn reference(logits: &[f64], v: usize, targets: &[u32], mask: &[f64], ignore: Option<u32>) -> Vec<f64> {
    logits
        .chunks(v)
        .enumerate()
        .map(|(n, row)| {
            if Some(targets[n]) == ignore {
                return 0.0;
            }
            let lse = row.iter().map(|x| x.exp()).sum::<f64>().ln();
            mask[n] * (lse - row[targets[n] as usize])
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn fwd_matches_naive_and_bwd_matches_fd(n in 1usize..6, v in 1usize..8, seed: u64, use_ignore: bool) {
        let dev = Device::Cpu;
        let logits = randv(n * v, seed);
        let targets: Vec<u32> = randv(n, seed ^ 1).iter().map(|x| ((x.abs() * 1000.0) as usize % v) as u32).collect();
        let mask: Vec<f64> = randv(n, seed ^ 2).iter().map(|x| if *x > 0.5 { 0.0 } else { 1.0 }).collect();
        let ignore = use_ignore.then_some(targets[0]);
        let cfg = CrossEntropyCfg { ignore_index: ignore, ..Default::default() };
        let (tt, mt) = (Tensor::from_vec(targets.clone(), [n], &dev).unwrap(), t32(&dev, &mask, &[n]));
        let (l, _) = k::cross_entropy_fwd(&t32(&dev, &logits, &[n, v]), &tt, Some(&mt), cfg).unwrap();
        assert_close(&host(&l), &reference(&logits, v, &targets, &mask, ignore), 1e-5, 1e-5, "ce");

        let m32: Vec<f32> = mask.iter().map(|&x| x as f32).collect();
        let dl = randv(n, seed ^ 3);
        let f = |x: &[f64]| {
            let (mut l, mut s) = (vec![0.0; n], vec![0.0; n]);
            loss::cross_entropy_fwd(x, v, &targets, Some(&m32), cfg, &mut l, &mut s);
            dot(&l, &dl)
        };
        let (mut l, mut s) = (vec![0.0; n], vec![0.0; n]);
        loss::cross_entropy_fwd(&logits, v, &targets, Some(&m32), cfg, &mut l, &mut s);
        let mut d = vec![0.0; n * v];
        loss::cross_entropy_bwd(&logits, v, &targets, Some(&m32), cfg, &s, &dl, &mut d);
        fd_check(&logits, &d, f, "dlogits");
    }
}

device_test!(bf16_logits_match_f32_and_backward_agrees, |dev: &Device| {
    let (n, v) = (6, 50);
    let logits = randv(n * v, 1);
    let targets = Tensor::from_vec(vec![3u32, 0, 49, 7, 7, 20], [n], dev).unwrap();
    let cfg = CrossEntropyCfg::default();
    let l32 = t32(dev, &logits, &[n, v]);
    let lbf = tensor(dev, &logits, &[n, v], DType::BF16);
    let (a, la) = k::cross_entropy_fwd(&l32, &targets, None, cfg).unwrap();
    let (b, lb) = k::cross_entropy_fwd(&lbf, &targets, None, cfg).unwrap();
    assert_close(&host(&b), &host(&a), 2e-2, 2e-2, "bf16 loss");
    let dl = t32(dev, &vec![1.0 / n as f64; n], &[n]);
    let da = k::cross_entropy_bwd(&l32, &targets, None, &la, &dl, cfg).unwrap();
    let db = k::cross_entropy_bwd(&lbf, &targets, None, &lb, &dl, cfg).unwrap();
    assert_eq!(db.dtype(), DType::BF16);
    assert_close(&host(&db), &host(&da), 2e-2, 2e-3, "bf16 dlogits");
    // Each row of dlogits sums to zero (softmax minus one-hot).
    for row in host(&da).chunks(v) {
        assert!(row.iter().sum::<f64>().abs() < 1e-6);
    }
});

device_test!(target_outside_vocab_is_an_error, |dev: &Device| {
    let targets = Tensor::from_vec(vec![1u32, 9], [2], dev).unwrap();
    let e =
        k::cross_entropy_fwd(&t32(dev, &randv(8, 0), &[2, 4]), &targets, None, CrossEntropyCfg::default()).unwrap_err();
    assert!(matches!(e, Error::IndexOutOfRange { index: 9, bound: 4, .. }), "{e}");
    // The ignore index may lie outside the vocabulary (Megatron uses -100).
    let ignore = CrossEntropyCfg { ignore_index: Some(9), ..Default::default() };
    let (l, _) = k::cross_entropy_fwd(&t32(dev, &randv(8, 0), &[2, 4]), &targets, None, ignore).unwrap();
    assert_eq!(host(&l)[1], 0.0);
});

// Vocabulary-parallel pieces against the whole-vocabulary op: shards' lse combine to the full lse,
// their losses to the full loss, and the backward with the full lse gives the full gradient's
// columns.
device_test!(vocab_shards_combine_to_the_whole, |dev: &Device| {
    let (n, v, parts) = (5usize, 12usize, 3usize);
    let logits = randv(n * v, 41).iter().map(|&x| x as f32 * 3.0).collect::<Vec<_>>();
    let targets = Tensor::from_vec(vec![0u32, 11, 4, 7, 4], [n], dev).unwrap();
    let full = Tensor::from_f32(&logits, [n, v], DType::F32, dev).unwrap();
    let cfg = CrossEntropyCfg::default();
    let (loss, lse) = k::cross_entropy_fwd(&full, &targets, None, cfg).unwrap();
    let dl = Tensor::from_f32(&[0.3, -0.2, 0.5, 1.0, 0.1], [n], DType::F32, dev).unwrap();
    let dfull = k::cross_entropy_bwd(&full, &targets, None, &lse, &dl, cfg).unwrap().to_vec_f32().unwrap();
    let (lse_v, loss_v) = (lse.to_vec_f32().unwrap(), loss.to_vec_f32().unwrap());
    let w = v / parts;
    let (mut sum_loss, mut sum_exp) = (vec![0f64; n], vec![0f64; n]);
    for p in 0..parts {
        let cols: Vec<f32> = (0..n).flat_map(|r| logits[r * v + p * w..r * v + (p + 1) * w].to_vec()).collect();
        let shard = Tensor::from_f32(&cols, [n, w], DType::F32, dev).unwrap();
        let c = CrossEntropyCfg { vocab_start: (p * w) as u32, vocab_total: Some(v as u32), ..cfg };
        let (l, s) = k::cross_entropy_fwd(&shard, &targets, None, c).unwrap();
        let (l, s) = (l.to_vec_f32().unwrap(), s.to_vec_f32().unwrap());
        for r in 0..n {
            sum_loss[r] += l[r] as f64 - s[r] as f64;
            sum_exp[r] += (s[r] as f64).exp();
        }
        let d = k::cross_entropy_bwd(&shard, &targets, None, &lse, &dl, c).unwrap().to_vec_f32().unwrap();
        for r in 0..n {
            for j in 0..w {
                assert!((d[r * w + j] - dfull[r * v + p * w + j]).abs() < 1e-6, "dlogits shard {p} [{r},{j}]");
            }
        }
    }
    for r in 0..n {
        assert!((sum_exp[r].ln() - lse_v[r] as f64).abs() < 1e-5, "lse row {r}");
        // Σ (loss_p - lse_p) = -logit[target]; loss = lse - logit[target].
        assert!((sum_loss[r] + lse_v[r] as f64 - loss_v[r] as f64).abs() < 1e-5, "loss row {r}");
    }
    let bad = Tensor::from_vec(vec![12u32; n], [n], dev).unwrap();
    let c = CrossEntropyCfg { vocab_start: 4, vocab_total: Some(v as u32), ..cfg };
    let shard = Tensor::from_f32(&vec![0.0; n * 4], [n, 4], DType::F32, dev).unwrap();
    let e = k::cross_entropy_fwd(&shard, &bad, None, c).unwrap_err();
    assert!(e.to_string().contains("index 12") && e.to_string().contains("size 12"), "{e}");
});

// Padding columns (vocabulary padded for tensor-parallel divisibility) leave the loss unchanged and
// get no gradient.
device_test!(padded_columns_do_not_change_the_loss, |dev: &Device| {
    let (n, v, pad) = (4usize, 7usize, 3usize);
    let x = randv(n * v, 9).iter().map(|&x| x as f32).collect::<Vec<_>>();
    let padded: Vec<f32> = x.chunks(v).flat_map(|r| r.iter().cloned().chain([5.0, -1.0, 9.0])).collect();
    let targets = Tensor::from_vec(vec![0u32, 6, 3, 2], [n], dev).unwrap();
    let dl = Tensor::from_f32(&[1.0; 4], [n], DType::F32, dev).unwrap();
    let run = |vals: &[f32], w: usize, cfg: CrossEntropyCfg| {
        let l = Tensor::from_f32(vals, [n, w], DType::F32, dev).unwrap();
        let (loss, lse) = k::cross_entropy_fwd(&l, &targets, None, cfg).unwrap();
        let d = k::cross_entropy_bwd(&l, &targets, None, &lse, &dl, cfg).unwrap();
        (loss.to_vec_f32().unwrap(), d.to_vec_f32().unwrap())
    };
    let (l0, d0) = run(&x, v, CrossEntropyCfg::default());
    let (l1, d1) = run(&padded, v + pad, CrossEntropyCfg { vocab_total: Some(v as u32), ..Default::default() });
    assert_eq!(l0, l1);
    for r in 0..n {
        assert_eq!(&d1[r * (v + pad)..r * (v + pad) + v], &d0[r * v..(r + 1) * v]);
        assert!(d1[r * (v + pad) + v..(r + 1) * (v + pad)].iter().all(|&g| g == 0.0));
    }
});

// The vocabulary-parallel combine against the whole vocabulary: the logits split into three
// column shards, each shard's forward (lse, loss) stacked in rank order, combined, equal the
// forward over all columns; masked rows (0 and ½) included, a target in every shard.
device_test!(shard_combine_equals_the_whole_vocabulary, |dev: &Device| {
    let (rows, v, n) = (6, 12, 3);
    let w = v / n;
    let x = randv(rows * v, 3);
    let targets = Tensor::from_vec(vec![0u32, 5, 11, 4, 8, 2], [rows], dev).unwrap();
    let mask = t32(dev, &[1.0, 0.0, 1.0, 0.5, 1.0, 1.0], &[rows]);
    let whole = t32(dev, &x, &[rows, v]);
    let (want_loss, want_lse) =
        k::cross_entropy_fwd(&whole, &targets, Some(&mask), CrossEntropyCfg::default()).unwrap();
    let mut all = Vec::with_capacity(n * 2 * rows);
    let mut parts = Vec::new();
    for r in 0..n {
        let shard: Vec<f64> = (0..rows).flat_map(|i| x[i * v + r * w..i * v + (r + 1) * w].to_vec()).collect();
        let cfg = CrossEntropyCfg { vocab_start: (r * w) as u32, vocab_total: Some(v as u32), ..Default::default() };
        let (loss, lse) = k::cross_entropy_fwd(&t32(dev, &shard, &[rows, w]), &targets, Some(&mask), cfg).unwrap();
        parts.push((host(&lse), host(&loss)));
    }
    for (lse, loss) in &parts {
        all.extend(lse);
        all.extend(loss);
    }
    let (loss, lse) = k::ce_combine_shards(&t32(dev, &all, &[n, 2, rows]), Some(&mask)).unwrap();
    assert_close(&host(&lse), &host(&want_lse), 1e-5, 1e-5, "lse");
    assert_close(&host(&loss), &host(&want_loss), 1e-5, 1e-5, "loss");
    let e = k::ce_combine_shards(&t32(dev, &all, &[n, rows, 2]), None).unwrap_err();
    assert!(e.to_string().contains("ce_combine_shards"), "{e}");
});

// The forward with its backward in one pass, the gradient over the logits, equals the two passes
// to the bit: f32 and bf16; 300 columns (one element a thread), 296 with 6 of padding (eight
// wide; on CUDA a bf16 row this short is kept in shared memory between the passes), 57,344 with
// 40 of padding and 128,256 with 56 (bf16 rows past the shared-memory limit: their first 56,320
// columns kept, the rest read again); a masked row, a half-weight row, an ignored target, a target
// in the last real column.
device_test!(forward_with_backward_in_place_equals_the_two_passes, |dev: &Device| {
    for dt in [DType::F32, DType::BF16] {
        for (v, total) in [(300usize, None), (296, Some(290u32)), (57_344, Some(57_304)), (128_256, Some(128_200))] {
            let logits = tensor(dev, &randv(6 * v, 51), &[6, v], dt);
            let last = total.map_or(v as u32, |t| t) - 1;
            let targets = Tensor::from_vec(vec![0u32, last, 5, 17, 17, 100], [6], dev).unwrap();
            let mask = Tensor::from_f32(&[1.0, 1.0, 1.0, 0.0, 0.5, 1.0], [6], DType::F32, dev).unwrap();
            let cfg = CrossEntropyCfg { ignore_index: Some(5), vocab_start: 0, vocab_total: total };
            let dscale = 1.0 / 4.5;
            let (loss, lse) = k::cross_entropy_fwd(&logits, &targets, Some(&mask), cfg).unwrap();
            let dl = Tensor::from_f32(&[dscale; 6], [6], DType::F32, dev).unwrap();
            let want = k::cross_entropy_bwd(&logits, &targets, Some(&mask), &lse, &dl, cfg).unwrap();
            let x = logits.deep_copy().unwrap();
            let (l2, lse2) =
                k::cross_entropy_fwd_bwd_(&x, &targets, Some(&mask), cfg, k::RowScale::Value(dscale)).unwrap();
            let what = format!("{dt:?} v {v}");
            assert_eq!(host(&l2), host(&loss), "{what}: loss");
            assert_eq!(host(&lse2), host(&lse), "{what}: lse");
            let (got, want) = (host(&x), host(&want));
            let bad: Vec<_> =
                (0..got.len()).filter(|&i| got[i] != want[i]).map(|i| (i, got[i], want[i])).take(5).collect();
            assert!(bad.is_empty(), "{what}: dlogits over the logits differ at (index, got, want) {bad:?}");
            // The row scale read from a tensor when the op runs: the same bits.
            let y = logits.deep_copy().unwrap();
            let s = Tensor::from_f32(&[dscale], [1], DType::F32, dev).unwrap();
            let (l3, _) = k::cross_entropy_fwd_bwd_(&y, &targets, Some(&mask), cfg, k::RowScale::Read(&s)).unwrap();
            assert_eq!(host(&l3), host(&loss), "{what}: loss, scale read from a tensor");
            assert_eq!(host(&y), got, "{what}: dlogits, scale read from a tensor");
        }
    }
    // A row scale tensor of more than one value is refused, naming it, before the logits change.
    let logits = tensor(dev, &randv(2 * 8, 3), &[2, 8], DType::F32);
    let targets = Tensor::from_vec(vec![1u32, 2], [2], dev).unwrap();
    let two = Tensor::from_f32(&[0.5, 0.5], [2], DType::F32, dev).unwrap();
    let before = host(&logits);
    let e = k::cross_entropy_fwd_bwd_(&logits, &targets, None, CrossEntropyCfg::default(), k::RowScale::Read(&two))
        .unwrap_err()
        .to_string();
    assert!(e.contains("row scale") && e.contains("one f32"), "{e}");
    assert_eq!(host(&logits), before, "the logits were touched");
});

#[test]
fn forward_with_backward_refuses_a_vocabulary_shard() {
    let dev = Device::Cpu;
    let logits = t32(&dev, &randv(2 * 8, 1), &[2, 8]);
    let targets = Tensor::from_vec(vec![9u32, 12], [2], &dev).unwrap();
    let cfg = CrossEntropyCfg { vocab_start: 8, ..Default::default() };
    let before = host(&logits);
    let e = k::cross_entropy_fwd_bwd_(&logits, &targets, None, cfg, k::RowScale::Value(1.0)).unwrap_err().to_string();
    assert!(e.contains("cross_entropy_fwd_bwd_") && e.contains("vocab_start"), "{e}");
    assert_eq!(host(&logits), before, "the logits were touched");
}
