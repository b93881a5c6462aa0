//! FP8 quantization against a brute-force reference (the nearest of every finite code, ties to
//! the even one), the products against f64 products of the dequantized operands, and the FP8
//! linear layer against the same products written out.

use crate::device_test;
use crate::util::*;
use ferrotron_core::{AmaxAlgo, DType, DelayedScaling, Device, Tensor};
use ferrotron_kernels::{self as k, Fp8, Fp8Act, Fp8Copies, Fp8Format, Fp8Scaling};

/// Every finite value of an FP8 type with its code's low bit (for ties).
fn codes(dt: DType) -> Vec<(f64, bool)> {
    (0u8..=255)
        .map(|b| {
            let v = match dt {
                DType::F8E4M3 => float8::F8E4M3::from_bits(b).to_f64(),
                _ => float8::F8E5M2::from_bits(b).to_f64(),
            };
            (v, b & 1 == 1)
        })
        .filter(|(v, _)| v.is_finite())
        .collect()
}

/// The nearest finite code to v (so saturation at ±max), ties to the even code; NaN stays NaN.
fn nearest(codes: &[(f64, bool)], v: f64) -> f64 {
    if v.is_nan() {
        return f64::NAN;
    }
    if v.is_infinite() {
        let max = codes.iter().fold(0.0f64, |m, c| m.max(c.0));
        return max.copysign(v);
    }
    let mut best = (f64::INFINITY, 0.0, true);
    for &(c, odd) in codes {
        let d = (c - v).abs();
        if d < best.0 || (d == best.0 && best.2 && !odd) {
            best = (d, c, odd);
        }
    }
    best.1
}

/// The reference quantization of x (values as stored in x's dtype): (q values, scale_inv).
fn reference(x: &[f64], dt: DType) -> (Vec<f64>, f32) {
    let fmax: f32 = if dt == DType::F8E4M3 { 448.0 } else { 57344.0 };
    let amax = x.iter().fold(0.0f64, |m, v| if v.is_nan() || m.is_nan() { f64::NAN } else { m.max(v.abs()) }) as f32;
    let scale = if amax == 0.0 || amax.is_infinite() {
        1.0
    } else {
        let s = fmax / amax;
        if s.is_infinite() { f32::MAX } else { s }
    };
    let c = codes(dt);
    (x.iter().map(|&v| nearest(&c, ((v as f32) * scale) as f64)).collect(), 1.0 / scale)
}

fn transpose(v: &[f64], rows: usize, cols: usize) -> Vec<f64> {
    let mut t = vec![0.0; v.len()];
    for r in 0..rows {
        for c in 0..cols {
            t[c * rows + r] = v[r * cols + c];
        }
    }
    t
}

fn same_values(got: &[f64], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(g == w || (g.is_nan() && w.is_nan()), "{what}[{i}]: got {g}, want {w}");
    }
}

/// Values in x's dtype as the kernels read them.
fn stored(v: &[f64], dtype: DType) -> Vec<f64> {
    host(&tensor(&Device::Cpu, v, &[v.len()], dtype))
}

fn check_quantize(dev: &Device, x: &[f64], [rows, cols]: [usize; 2], src: DType, dt: DType) {
    let xs = stored(x, src);
    let t = tensor(dev, x, &[rows, cols], src);
    let (q, qt) = k::quantize_fp8(&t, dt, Fp8Copies::Both).unwrap();
    let (q, qt) = (q.unwrap(), qt.unwrap());
    let (want, scale_inv) = reference(&xs, dt);
    let what = format!("{src}→{dt} [{rows}, {cols}]");
    assert_eq!(q.data.dtype(), dt);
    assert_eq!(q.data.dims(), &[rows, cols]);
    assert_eq!(qt.data.dims(), &[cols, rows]);
    same_values(&host(&q.data), &want, &format!("{what} q"));
    same_values(&host(&qt.data), &transpose(&want, rows, cols), &format!("{what} qᵀ"));
    let si = q.scale_inv.to_vec_f32().unwrap()[0];
    assert!(si == scale_inv || (si.is_nan() && scale_inv.is_nan()), "{what} scale_inv {si}, want {scale_inv}");
    assert_eq!(qt.scale_inv.to_vec_f32().unwrap()[0].to_bits(), si.to_bits(), "{what}: one scale for both copies");
    // Only the transposed copy asked for: the same bytes.
    let (none, only_t) = k::quantize_fp8(&t, dt, Fp8Copies::Transposed).unwrap();
    assert!(none.is_none());
    same_values(&host(&only_t.unwrap().data), &transpose(&want, rows, cols), &format!("{what} qᵀ alone"));
}

device_test!(quantize_matches_nearest_code, |dev: &Device| {
    // Odd sizes cross the 32×32 tiles' edges; rows % 16 == 0 with cols % 8 == 0 take the 64×64
    // kernel (80 × 72, 48 × 136: part tiles both ways); magnitudes from 2^-20 to 2^12 reach FP8's
    // subnormals.
    for (i, &(rows, cols)) in [(1, 1), (37, 45), (64, 32), (3, 100), (80, 72), (48, 136)].iter().enumerate() {
        let x: Vec<f64> = randv(rows * cols, 40 + i as u64)
            .iter()
            .enumerate()
            .map(|(j, v)| v * 2f64.powi((j % 33) as i32 - 20))
            .collect();
        for src in [DType::F32, DType::BF16] {
            for dt in [DType::F8E4M3, DType::F8E5M2] {
                check_quantize(dev, &x, [rows, cols], src, dt);
            }
        }
    }
});

device_test!(quantize_edge_values, |dev: &Device| {
    for dt in [DType::F8E4M3, DType::F8E5M2] {
        // All zeros: scale 1, zeros out.
        check_quantize(dev, &[0.0; 12], [3, 4], DType::F32, dt);
        // An infinity: scale 1, the infinity and everything past fp8_max saturate.
        check_quantize(dev, &[1.0, f64::INFINITY, -1e6, 3.0, -0.001, 500.0], [2, 3], DType::F32, dt);
        // A NaN: amax NaN, so scale NaN and every value NaN (a step the loss check then skips).
        let (q, _) = k::quantize_fp8(&t32(dev, &[1.0, f64::NAN, 2.0, 0.5], &[2, 2]), dt, Fp8Copies::Plain).unwrap();
        let q = q.unwrap();
        assert!(q.scale_inv.to_vec_f32().unwrap()[0].is_nan(), "{dt}: NaN amax");
        assert!(host(&q.data).iter().all(|v| v.is_nan()), "{dt}: every value NaN");
    }
    // Not an FP8 type: a typed error naming the op.
    let e = k::quantize_fp8(&t32(dev, &[1.0], &[1]), DType::BF16, Fp8Copies::Plain).unwrap_err();
    assert!(e.to_string().contains("quantize_fp8"), "{e}");
});

fn quantized(dev: &Device, v: &[f64], shape: &[usize], dt: DType) -> Fp8 {
    k::quantize_fp8(&tensor(dev, v, shape, DType::BF16), dt, Fp8Copies::Plain).unwrap().0.unwrap()
}

/// `assert_close` for a product of FP8 operands: on the CPU (f32 sums of the quantized values)
/// within `rtol`/`atol`; on a GPU within 8e-3 of each element plus 2e-3 of the product's rms,
/// since Hopper's FP8 tensor cores sum with fewer mantissa bits than fp32 (about 14: an element
/// near zero from a cancelling sum carries the rounding of its larger terms). A wrong tile, index
/// or scale is off by the order of the rms.
#[track_caller]
fn product_close(dev: &Device, got: &[f64], want: &[f64], rtol: f64, atol: f64, what: &str) {
    if dev.is_cpu() {
        return assert_close(got, want, rtol, atol, what);
    }
    let rms = (want.iter().map(|w| w * w).sum::<f64>() / want.len().max(1) as f64).sqrt();
    assert_close(got, want, rtol.max(8e-3), atol.max(2e-3 * rms), what);
}

/// f64 c [m, n] = a [m, k] · b [n, k]ᵀ.
fn product_nt(a: &[f64], b: &[f64], m: usize, n: usize, kk: usize) -> Vec<f64> {
    let mut c = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            c[i * n + j] = (0..kk).map(|p| a[i * kk + p] * b[j * kk + p]).sum();
        }
    }
    c
}

device_test!(matmul_matches_dequantized_product, |dev: &Device| {
    let (m, n, kk) = (48, 32, 64);
    for (da, db) in [(DType::F8E4M3, DType::F8E4M3), (DType::F8E5M2, DType::F8E4M3), (DType::F8E4M3, DType::F8E5M2)] {
        let a = quantized(dev, &randv(m * kk, 1), &[2, m / 2, kk], da);
        let b = quantized(dev, &randv(n * kk, 2), &[n, kk], db);
        let (av, bv) = (host(&a.dequantize().unwrap()), host(&b.dequantize().unwrap()));
        let want = product_nt(&av, &bv, m, n, kk);
        let bias = randv(n, 3);
        let with_bias: Vec<f64> = want.iter().enumerate().map(|(i, v)| v + stored(&bias, DType::BF16)[i % n]).collect();
        let y = k::fp8_matmul(&a, &b, Some(&tensor(dev, &bias, &[n], DType::BF16)), DType::BF16).unwrap();
        assert_eq!((y.dims(), y.dtype()), (&[2, m / 2, n][..], DType::BF16));
        product_close(dev, &host(&y), &with_bias, 8e-3, 1e-3, &format!("{da}·{db}ᵀ + bias → bf16"));
        let y = k::fp8_matmul(&a, &b, None, DType::F32).unwrap();
        product_close(dev, &host(&y), &want, 1e-5, 1e-5, &format!("{da}·{db}ᵀ → f32"));
        // Into a main_grad: written, then added to.
        let a2 = Fp8 { data: a.data.reshape([m, kk]).unwrap(), scale_inv: a.scale_inv.clone() };
        let c0 = randv(m * n, 4);
        let c = t32(dev, &c0, &[m, n]);
        k::fp8_matmul_into(&c, &a2, &b, true).unwrap();
        let sum: Vec<f64> = want.iter().zip(&c0).map(|(p, c)| p + c).collect();
        product_close(dev, &host(&c), &sum, 1e-5, 1e-5, "c += a·bᵀ");
        k::fp8_matmul_into(&c, &a2, &b, false).unwrap();
        product_close(dev, &host(&c), &want, 1e-5, 1e-5, "c = a·bᵀ");
        // A main_grad view one element into its buffer (4-byte aligned: cuBLASLt's FP8 kernels
        // may refuse the address, and the product then goes through an aligned scratch).
        let flat = t32(dev, &[vec![7.0], c0.clone()].concat(), &[1 + m * n]);
        let view = flat.view(1, [m, n]).unwrap();
        k::fp8_matmul_into(&view, &a2, &b, true).unwrap();
        product_close(dev, &host(&view), &sum, 1e-5, 1e-5, "misaligned c += a·bᵀ");
        assert_eq!(host(&flat)[0], 7.0, "nothing written before the view");
    }
});

device_test!(matmul_refuses_what_cublaslt_cannot_multiply, |dev: &Device| {
    let a = quantized(dev, &randv(4 * 24, 1), &[4, 24], DType::F8E4M3);
    let b = quantized(dev, &randv(16 * 24, 2), &[16, 24], DType::F8E4M3);
    let e = k::fp8_matmul(&a, &b, None, DType::BF16).unwrap_err().to_string();
    assert!(e.contains("divisible by 16") && e.contains("24"), "{e}");
    let a = quantized(dev, &randv(4 * 32, 1), &[4, 32], DType::F8E5M2);
    let b = quantized(dev, &randv(16 * 32, 2), &[16, 32], DType::F8E5M2);
    let e = k::fp8_matmul(&a, &b, None, DType::BF16).unwrap_err().to_string();
    assert!(e.contains("e5m2"), "{e}");
});

device_test!(linear_layer_is_the_products_of_quantized_operands, |dev: &Device| {
    // x [2, 16, 64] → y [2, 16, 48] with w [48, 64], and 37 rows (an expert's token list: padded
    // to 48 with zero rows inside); hybrid: dy in E5M2.
    for (rows, lead) in [(32, vec![2, 16]), (37, vec![37])] {
        check_linear(dev, rows, &lead);
    }
});

fn check_linear(dev: &Device, rows: usize, lead: &[usize]) {
    let (inp, out) = (64, 48);
    let shape = |last: usize| [lead, &[last]].concat();
    let (x, w, dy, b) = (randv(rows * inp, 5), randv(out * inp, 6), randv(rows * out, 7), randv(out, 8));
    let (xs, ws, dys) = (stored(&x, DType::BF16), stored(&w, DType::BF16), stored(&dy, DType::BF16));
    for format in [Fp8Format::Hybrid, Fp8Format::E4M3] {
        let deq = |v: &[f64], dt| {
            let (q, s) = reference(v, dt);
            q.iter().map(|q| q * s as f64).collect::<Vec<_>>()
        };
        let (xq, wq, dyq) = (deq(&xs, DType::F8E4M3), deq(&ws, DType::F8E4M3), deq(&dys, format.gradient()));
        let xt = tensor(dev, &x, &shape(inp), DType::BF16);
        let wt = tensor(dev, &w, &[out, inp], DType::BF16);
        let bt = tensor(dev, &b, &[out], DType::BF16);
        let (y, saved, none) = k::fp8_linear_fwd(&xt, &wt, Some(&bt), format, true, None).unwrap();
        assert!(none.is_none(), "no scale of w under tensorwise scaling");
        let saved = saved.unwrap();
        let want: Vec<f64> = product_nt(&xq, &wq, rows, out, inp)
            .iter()
            .enumerate()
            .map(|(i, v)| v + stored(&b, DType::BF16)[i % out])
            .collect();
        let what = format!("{format:?} {rows} rows");
        assert_eq!(y.dims(), &shape(out)[..]);
        product_close(dev, &host(&y), &want, 8e-3, 1e-3, &format!("{what} y"));
        assert_eq!(saved.data.dims(), &[inp, rows.next_multiple_of(16)], "the saved input is xᵀ, rows padded");
        // Without a backward to follow: the same output, nothing kept.
        let (y_eval, none, _) = k::fp8_linear_fwd(&xt, &wt, Some(&bt), format, false, None).unwrap();
        assert!(none.is_none());
        same_values(&host(&y_eval), &host(&y), &format!("{what} evaluation y"));
        // Backward: dx = q(dy)·q(w), dW += q(dy)ᵀ·q(x) into an f32 main_grad holding g0.
        let g0 = randv(out * inp, 9);
        let dw = t32(dev, &g0, &[out, inp]);
        let dyt = tensor(dev, &dy, &shape(out), DType::BF16);
        let dx = k::fp8_linear_bwd(&dyt, &wt, &saved, (&dw, true), format, None).unwrap();
        assert_eq!(dx.dims(), &shape(inp)[..]);
        let wq_t = transpose(&wq, out, inp);
        product_close(dev, &host(&dx), &product_nt(&dyq, &wq_t, rows, inp, out), 8e-3, 1e-3, &format!("{what} dx"));
        let dw_want: Vec<f64> = product_nt(&transpose(&dyq, rows, out), &transpose(&xq, rows, inp), out, inp, rows)
            .iter()
            .zip(&g0)
            .map(|(p, g)| p + g)
            .collect();
        product_close(dev, &host(&dw), &dw_want, 1e-5, 1e-5, &format!("{what} dW"));
    }
}

/// x scaled by `scale` to the nearest code of `dt` (delayed scaling's quantization).
fn reference_scaled(x: &[f64], dt: DType, scale: f32) -> Vec<f64> {
    let c = codes(dt);
    x.iter().map(|&v| nearest(&c, ((v as f32) * scale) as f64)).collect()
}

device_test!(scaled_quantization_takes_the_given_scale_and_records_amax, |dev: &Device| {
    // The amax slot is column 3 of row 0 of a [2, 5] history holding `before` everywhere.
    for (i, &(rows, cols)) in [(37, 45), (3, 100), (80, 72)].iter().enumerate() {
        let x: Vec<f64> = randv(rows * cols, 60 + i as u64).iter().map(|v| v * 30.0).collect();
        for src in [DType::F32, DType::BF16] {
            let xs = stored(&x, src);
            let amax = xs.iter().fold(0.0f64, |m, v| m.max(v.abs()));
            for (dt, scale) in [(DType::F8E4M3, 3.0f32), (DType::F8E5M2, 1000.0), (DType::F8E4M3, 0.4)] {
                let what = format!("{src}→{dt} ×{scale} [{rows}, {cols}]");
                for before in [amax / 2.0, amax * 2.0] {
                    let hist = t32(dev, &[before; 10], &[2, 5]);
                    let slot = hist.view(3, [1]).unwrap();
                    let s = t32(dev, &[scale as f64], &[1]);
                    let t = tensor(dev, &x, &[rows, cols], src);
                    let (q, qt, used) = k::quantize_fp8_scaled(&t, dt, Fp8Copies::Both, &s, Some(&slot)).unwrap();
                    let (q, qt) = (q.unwrap(), qt.unwrap());
                    let want = reference_scaled(&xs, dt, scale);
                    same_values(&host(&q.data), &want, &format!("{what} q"));
                    same_values(&host(&qt.data), &transpose(&want, rows, cols), &format!("{what} qᵀ"));
                    assert_eq!(q.scale_inv.to_vec_f32().unwrap(), vec![1.0 / scale], "{what} scale_inv");
                    assert_eq!(qt.scale_inv.to_vec_f32().unwrap(), vec![1.0 / scale], "{what} qᵀ scale_inv");
                    assert_eq!(used.to_vec_f32().unwrap(), vec![scale], "{what}: the scale used");
                    let mut h = vec![before as f32; 10];
                    h[3] = h[3].max(amax as f32);
                    assert_eq!(hist.to_vec_f32().unwrap(), h, "{what}: the amax maxed into its slot only");
                }
                // No slot: nothing recorded, the same bytes.
                let s = t32(dev, &[scale as f64], &[1]);
                let t = tensor(dev, &x, &[rows, cols], src);
                let (q, _, _) = k::quantize_fp8_scaled(&t, dt, Fp8Copies::Plain, &s, None).unwrap();
                same_values(&host(&q.unwrap().data), &reference_scaled(&xs, dt, scale), &format!("{what} no slot"));
            }
        }
    }
    // A NaN reaches the slot (the update then keeps the scale); the values past fp8_max saturate.
    let hist = t32(dev, &[0.5; 2], &[2]);
    let slot = hist.view(1, [1]).unwrap();
    let x = t32(dev, &[1.0, f64::NAN, 1e6, -3.0], &[2, 2]);
    let (q, _, _) =
        k::quantize_fp8_scaled(&x, DType::F8E4M3, Fp8Copies::Plain, &t32(dev, &[2.0], &[1]), Some(&slot)).unwrap();
    let h = hist.to_vec_f32().unwrap();
    assert!(h[0] == 0.5 && h[1].is_nan(), "{h:?}");
    same_values(&host(&q.unwrap().data), &[2.0, f64::NAN, 448.0, -6.0], "NaN and saturation");
    let e = k::quantize_fp8_scaled(&x, DType::F8E4M3, Fp8Copies::Plain, &t32(dev, &[1.0, 2.0], &[2]), None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("quantize_fp8_scaled"), "{e}");
});

/// Transformer Engine's update written out for one column (history oldest-first after row 0).
fn update_reference(col: &[f32], scale: f32, fmax: f32, cfg: &DelayedScaling) -> (Vec<f32>, f32) {
    let len = col.len();
    let amax = match cfg.algo {
        AmaxAlgo::MostRecent => col[0],
        // NaN entries are passed over (as fmaxf does); all NaN gives NaN.
        AmaxAlgo::Max => {
            col.iter().copied().filter(|v| !v.is_nan()).fold(f32::NAN, |m, v| if m.is_nan() { v } else { m.max(v) })
        }
    };
    let target = fmax / 2f32.powi(cfg.margin);
    let new_scale = if amax.is_finite() && amax > 0.0 { (target / amax).min(f32::MAX) } else { scale };
    let mut rolled = vec![0.0f32; len];
    for i in 1..len {
        rolled[i] = if i + 1 < len { col[i + 1] } else { col[0] };
    }
    (rolled, new_scale)
}

device_test!(scale_update_follows_the_amax_history, |dev: &Device| {
    // Seven columns: ordinary amaxes, a zero column, a NaN now, an inf, a NaN in the history,
    // a tiny amax (the quotient overflows), one outside the updated range.
    let (n, cols) = (7usize, 0..6usize);
    for len in [1usize, 2, 5] {
        let mut h: Vec<f32> = randv(len * n, 70 + len as u64).iter().map(|v| (v.abs() * 10.0) as f32).collect();
        for i in 0..len {
            h[i * n + 1] = 0.0;
        }
        h[2] = f32::NAN;
        h[3] = f32::INFINITY;
        if len > 2 {
            h[n + 4] = f32::NAN;
        }
        h[5] = 1e-38;
        let scale0: Vec<f32> = (0..n).map(|c| 0.25 * (c + 1) as f32).collect();
        for (algo, margin, dt) in [
            (AmaxAlgo::MostRecent, 0, DType::F8E4M3),
            (AmaxAlgo::Max, 0, DType::F8E4M3),
            (AmaxAlgo::Max, 2, DType::F8E5M2),
            (AmaxAlgo::MostRecent, -1, DType::F8E5M2),
        ] {
            let cfg = DelayedScaling { history_len: len, algo, margin };
            let fmax = if dt == DType::F8E4M3 { 448.0 } else { 57344.0 };
            let hist = Tensor::from_vec(h.clone(), [len, n], dev).unwrap();
            let scale = Tensor::from_vec(scale0.clone(), [n], dev).unwrap();
            k::fp8_scale_update(&hist, &scale, cols.clone(), dt, &cfg).unwrap();
            let (got_h, got_s) = (hist.to_vec_f32().unwrap(), scale.to_vec_f32().unwrap());
            let what = format!("len {len} {algo:?} margin {margin} {dt}");
            for c in 0..n {
                let col: Vec<f32> = (0..len).map(|i| h[i * n + c]).collect();
                let (want_col, want_s) =
                    if cols.contains(&c) { update_reference(&col, scale0[c], fmax, &cfg) } else { (col, scale0[c]) };
                let got_col: Vec<f32> = (0..len).map(|i| got_h[i * n + c]).collect();
                let same = |a: f32, b: f32| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
                assert!(
                    got_col.iter().zip(&want_col).all(|(a, b)| same(*a, *b)),
                    "{what} column {c}: {got_col:?}, want {want_col:?}"
                );
                assert!(same(got_s[c], want_s), "{what} column {c}: scale {}, want {want_s}", got_s[c]);
            }
        }
    }
    let hist = t32(dev, &[0.0; 6], &[2, 3]);
    let cfg = DelayedScaling { history_len: 2, algo: AmaxAlgo::Max, margin: 0 };
    let e = k::fp8_scale_update(&hist, &t32(dev, &[1.0; 3], &[3]), 2..4, DType::F8E4M3, &cfg).unwrap_err();
    assert!(e.to_string().contains("columns 2..4"), "{e}");
});

device_test!(delayed_linear_layer_quantizes_by_its_slots, |dev: &Device| {
    // The forward quantizes x and w by their slots' scales and records their amaxes; the
    // backward quantizes dy by its slot and w by the scale the forward used (kept apart from
    // the slot, which changes after the forward in the meantime).
    let (rows, inp, out) = (37usize, 64usize, 48usize);
    let (x, w, dy) = (randv(rows * inp, 81), randv(out * inp, 82), randv(rows * out, 83));
    let (xs, ws, dys) = (stored(&x, DType::BF16), stored(&w, DType::BF16), stored(&dy, DType::BF16));
    let amax = |v: &[f64]| v.iter().fold(0.0f64, |m, x| m.max(x.abs())) as f32;
    let (sx, sw, sdy) = (50.0f32, 120.0f32, 3000.0f32);
    let format = Fp8Format::Hybrid;
    let hist = t32(dev, &[0.0; 3], &[1, 3]);
    let scales = t32(dev, &[sx as f64, sw as f64, sdy as f64], &[3]);
    let at = |t: &Tensor, i: usize| t.view(i, [1]).unwrap();
    let (xt, wt) = (tensor(dev, &x, &[rows, inp], DType::BF16), tensor(dev, &w, &[out, inp], DType::BF16));
    let (s0, s1, a0, a1) = (at(&scales, 0), at(&scales, 1), at(&hist, 0), at(&hist, 1));
    let by = [Fp8Scaling { scale: &s0, amax: Some(&a0) }, Fp8Scaling { scale: &s1, amax: Some(&a1) }];
    let (y, saved, used) = k::fp8_linear_fwd(&xt, &wt, None, format, true, Some(by)).unwrap();
    let deq = |v: &[f64], dt, s: f32| reference_scaled(v, dt, s).iter().map(|q| q / s as f64).collect::<Vec<_>>();
    let (xq, wq) = (deq(&xs, DType::F8E4M3, sx), deq(&ws, DType::F8E4M3, sw));
    product_close(dev, &host(&y), &product_nt(&xq, &wq, rows, out, inp), 8e-3, 1e-3, "delayed y");
    let [x_used, w_used] = used.unwrap();
    assert_eq!([x_used.to_vec_f32().unwrap(), w_used.to_vec_f32().unwrap()], [vec![sx], vec![sw]], "the scales used");
    assert_eq!(hist.to_vec_f32().unwrap(), vec![amax(&xs), amax(&ws), 0.0], "x's and w's amaxes");
    // The slot of w moves on before the backward: the backward still quantizes w by 120.
    scales.copy_from_f32(&[1.0, 1.0, sdy]).unwrap();
    let (s2, a2) = (at(&scales, 2), at(&hist, 2));
    let dw = t32(dev, &vec![0.0; out * inp], &[out, inp]);
    let dyt = tensor(dev, &dy, &[rows, out], DType::BF16);
    let by = (Fp8Scaling { scale: &s2, amax: Some(&a2) }, &w_used);
    let dx = k::fp8_linear_bwd(&dyt, &wt, saved.as_ref().unwrap(), (&dw, false), format, Some(by)).unwrap();
    let dyq = deq(&dys, DType::F8E5M2, sdy);
    product_close(
        dev,
        &host(&dx),
        &product_nt(&dyq, &transpose(&wq, out, inp), rows, inp, out),
        8e-3,
        1e-3,
        "delayed dx",
    );
    let dw_want = product_nt(&transpose(&dyq, rows, out), &transpose(&xq, rows, inp), out, inp, rows);
    product_close(dev, &host(&dw), &dw_want, 1e-5, 1e-5, "delayed dW");
    assert_eq!(hist.to_vec_f32().unwrap(), vec![amax(&xs), amax(&ws), amax(&dys)], "dy's amax; w's not again");
});

#[test]
fn format_names_round_trip() {
    for f in [Fp8Format::E4M3, Fp8Format::Hybrid] {
        assert_eq!(Fp8Format::parse(f.as_str()), Some(f));
    }
    assert_eq!(Fp8Format::parse("e5m2"), None);
    assert_eq!(Fp8Format::Hybrid.gradient(), DType::F8E5M2);
    assert_eq!(Fp8Format::E4M3.gradient(), DType::F8E4M3);
}

device_test!(activation_in_the_cast_quantizes_what_the_activation_stores, |dev: &Device| {
    // fp8_linear_fwd_after(act, h) against fp8_linear_fwd(act(h)) under delayed scaling, for
    // GeLU and SwiGLU: on CUDA the wide cast applies the activation itself (80 × 80: part tiles
    // both ways; 37 rows: padded to 48, the wide cast too), elsewhere the activation runs
    // first. The codes, the output, the saved xᵀ and the amax recorded are compared; in one
    // kernel or two, act(h) is rounded to bf16 alike, so a code may differ only where the two
    // evaluations' f32 roundings do.
    for act in [Fp8Act::Gelu, Fp8Act::Swiglu] {
        for (rows, cols) in [(80, 80), (37, 64)] {
            let (out, width) = (48, if act == Fp8Act::Swiglu { 2 * cols } else { cols });
            let h: Vec<f64> = randv(rows * width, 91).iter().map(|v| v * 3.0).collect();
            let (w, b) = (randv(out * cols, 92), randv(out, 93));
            let ht = tensor(dev, &h, &[rows, width], DType::BF16);
            let wt = tensor(dev, &w, &[out, cols], DType::BF16);
            let bt = tensor(dev, &b, &[out], DType::BF16);
            let run = |fused: bool| {
                let (sx, sw) = (t32(dev, &[20.0], &[1]), t32(dev, &[30.0], &[1]));
                let (ax, aw) = (t32(dev, &[0.0], &[1]), t32(dev, &[0.0], &[1]));
                let by = [Fp8Scaling { scale: &sx, amax: Some(&ax) }, Fp8Scaling { scale: &sw, amax: Some(&aw) }];
                let (y, xt, used) = if fused {
                    k::fp8_linear_fwd_after(act, &ht, &wt, Some(&bt), Fp8Format::Hybrid, true, Some(by)).unwrap()
                } else {
                    let a = match act {
                        Fp8Act::Gelu => k::gelu(&ht).unwrap(),
                        Fp8Act::Swiglu => k::swiglu(&ht).unwrap(),
                    };
                    k::fp8_linear_fwd(&a, &wt, Some(&bt), Fp8Format::Hybrid, true, Some(by)).unwrap()
                };
                let used = used.unwrap().map(|t| t.to_vec_f32().unwrap());
                (host(&y), host(&xt.unwrap().data), ax.to_vec_f32().unwrap(), aw.to_vec_f32().unwrap(), used)
            };
            let (got, want) = (run(true), run(false));
            let what = format!("{act:?} [{rows}, {cols}]");
            assert_eq!(got.0.len(), rows * out, "{what}: y has the unpadded rows");
            let near = |g: &[f64], w: &[f64], part: &str, rel: f64| {
                assert_eq!(g.len(), w.len());
                let diff: Vec<usize> = (0..g.len()).filter(|&i| g[i].to_bits() != w[i].to_bits()).collect();
                assert!(diff.len() * 200 <= g.len(), "{what} {part}: {} of {} differ", diff.len(), g.len());
                for &i in &diff {
                    assert!(
                        (g[i] - w[i]).abs() <= rel * w[i].abs().max(1e-3),
                        "{what} {part}[{i}]: {} against {}",
                        g[i],
                        w[i]
                    );
                }
            };
            // One E4M3 step is 2^-3 of a value's power of two: at most that where a code moved.
            near(&got.1, &want.1, "saved xᵀ codes", 0.13);
            near(&got.0, &want.0, "y", 0.02);
            assert!((got.2[0] - want.2[0]).abs() <= 1e-2 * want.2[0], "{what} amax: {:?} against {:?}", got.2, want.2);
            assert!(want.2[0] > 0.0, "{what}: an amax was recorded");
            assert_eq!(got.3, want.3, "{what} amax of w");
            assert_eq!(got.4, want.4, "{what} scales used");
        }
    }
});

device_test!(dgelu_in_the_cast_quantizes_what_gelu_bwd_stores, |dev: &Device| {
    // fp8_linear_bwd_dgelu(da, h) against gelu_bwd(h, da), bias_grad_into and fp8_linear_bwd under
    // delayed scaling: on CUDA the wide cast forms dh and its 64-row column sums itself (80 rows:
    // a part chunk; 37 rows: padded to 48; 80 columns: a part tile), elsewhere the passes run as
    // written. dx, dW, the bias gradient (added into one holding b0 and stored) and the amax
    // recorded are compared; a code may differ only where two GeLU-gradient evaluations' f32
    // roundings do, and the bias sums only in their order.
    for (rows, cols) in [(80, 80), (37, 64)] {
        let inp = 32;
        let (da, h) = (randv(rows * cols, 94), randv(rows * cols, 95).iter().map(|v| v * 3.0).collect::<Vec<_>>());
        let (w, x, b0) = (randv(cols * inp, 96), randv(rows * inp, 97), randv(cols, 98));
        let (dat, ht) = (tensor(dev, &da, &[rows, cols], DType::BF16), tensor(dev, &h, &[rows, cols], DType::BF16));
        let wt = tensor(dev, &w, &[cols, inp], DType::BF16);
        let xt = k::quantize_fp8(&tensor(dev, &x, &[rows, inp], DType::BF16), DType::F8E4M3, Fp8Copies::Transposed)
            .unwrap()
            .1
            .unwrap();
        // quantize_fp8 keeps the rows as they are; the layer's xᵀ has them padded to 16.
        let xt = if rows % 16 == 0 {
            xt
        } else {
            let padded = [x.clone(), vec![0.0; (rows.next_multiple_of(16) - rows) * inp]].concat();
            let t = tensor(dev, &padded, &[rows.next_multiple_of(16), inp], DType::BF16);
            k::quantize_fp8(&t, DType::F8E4M3, Fp8Copies::Transposed).unwrap().1.unwrap()
        };
        let run = |fused: bool, acc: bool| {
            let (sd, sw) = (t32(dev, &[2000.0], &[1]), t32(dev, &[30.0], &[1]));
            let ad = t32(dev, &[0.0], &[1]);
            let (dw, db) = (t32(dev, &vec![0.0; cols * inp], &[cols, inp]), t32(dev, &b0, &[cols]));
            let by = Some((Fp8Scaling { scale: &sd, amax: Some(&ad) }, &sw));
            let dx = if fused {
                k::fp8_linear_bwd_dgelu(&dat, &ht, Some((&db, acc)), &wt, &xt, (&dw, false), Fp8Format::Hybrid, by)
                    .unwrap()
            } else {
                let dh = k::gelu_bwd(&ht, &dat).unwrap();
                k::bias_grad_into(&db, &dh, acc).unwrap();
                k::fp8_linear_bwd(&dh, &wt, &xt, (&dw, false), Fp8Format::Hybrid, by).unwrap()
            };
            (host(&dx), host(&dw), db.to_vec_f32().unwrap(), ad.to_vec_f32().unwrap()[0])
        };
        for acc in [true, false] {
            let (got, want) = (run(true, acc), run(false, acc));
            let what = format!("[{rows}, {cols}] accumulate {acc}");
            assert_eq!(got.0.len(), rows * inp, "{what}: dx has the unpadded rows");
            let near = |g: &[f64], w: &[f64], part: &str| {
                let diff = (0..g.len()).filter(|&i| g[i].to_bits() != w[i].to_bits()).count();
                assert!(diff * 50 <= g.len(), "{what} {part}: {diff} of {} differ", g.len());
                let scale = w.iter().fold(0.0f64, |m, v| m.max(v.abs()));
                for i in 0..g.len() {
                    assert!((g[i] - w[i]).abs() <= 0.02 * scale, "{what} {part}[{i}]: {} against {}", g[i], w[i]);
                }
            };
            near(&got.0, &want.0, "dx");
            near(&got.1, &want.1, "dW");
            for (i, (g, w)) in got.2.iter().zip(&want.2).enumerate() {
                assert!((g - w).abs() <= 1e-3 * (1.0 + w.abs()), "{what} bias gradient[{i}]: {g} against {w}");
            }
            if !acc {
                assert!(got.2.iter().zip(&b0).any(|(g, b)| (*g as f64 - b).abs() > 1e-3), "{what}: stored over b0");
            }
            assert!(
                want.3 > 0.0 && (got.3 - want.3).abs() <= 1e-2 * want.3,
                "{what} amax {} against {}",
                got.3,
                want.3
            );
        }
    }
});
