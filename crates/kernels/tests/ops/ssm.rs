use crate::device_test;
use crate::util::*;
use ferrotron_core::{DType, Device, Tensor};
use ferrotron_kernels::{self as k, cpu::ssm as s};
use proptest::prelude::*;

fn sp(x: f64) -> f64 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

/// The scan in its quadratic form (SSD's "attention" view, no recurrence):
/// y_t = Σ_{u ≤ t} ⟨C_t, B_u⟩ · exp(A · Σ_{u < r ≤ t} dt_r) · dt_u · x_u + D · x_t.
fn scan_ref(xbc: &[f64], dt_raw: &[f64], bias: &[f64], a_log: &[f64], d: &[f64], dm: &s::ScanDims) -> Vec<f64> {
    let (hh, p, n, gg) = (dm.heads, dm.head_dim, dm.state, dm.groups);
    let cd = dm.xbc_width();
    let mut y = vec![0.0; dm.batch * dm.seq * hh * p];
    for b in 0..dm.batch {
        for h in 0..hh {
            let g = h / (hh / gg);
            let a = -a_log[h].exp();
            let dt = |t: usize| sp(dt_raw[(b * dm.seq + t) * hh + h] + bias[h]);
            let row = |t: usize| &xbc[(b * dm.seq + t) * cd..(b * dm.seq + t + 1) * cd];
            for t in 0..dm.seq {
                for q in 0..p {
                    let mut acc = d[h] * row(t)[h * p + q];
                    for u in 0..=t {
                        let cb: f64 =
                            (0..n).map(|j| row(t)[hh * p + gg * n + g * n + j] * row(u)[hh * p + g * n + j]).sum();
                        let decay: f64 = (u + 1..=t).map(|r| a * dt(r)).sum::<f64>().exp();
                        acc += cb * decay * dt(u) * row(u)[h * p + q];
                    }
                    y[((b * dm.seq + t) * hh + h) * p + q] = acc;
                }
            }
        }
    }
    y
}

struct ScanCase {
    dm: s::ScanDims,
    xbc: Vec<f64>,
    dt: Vec<f64>,
    bias: Vec<f64>,
    a_log: Vec<f64>,
    d: Vec<f64>,
}

fn scan_case(
    batch: usize,
    seq: usize,
    groups: usize,
    hpg: usize,
    head_dim: usize,
    state: usize,
    seed: u64,
) -> ScanCase {
    let dm = s::ScanDims { batch, seq, heads: groups * hpg, head_dim, groups, state };
    let h = dm.heads;
    ScanCase {
        xbc: randv(batch * seq * dm.xbc_width(), seed).iter().map(|v| v * 0.5).collect(),
        dt: randv(batch * seq * h, seed ^ 1),
        bias: randv(h, seed ^ 2).iter().map(|v| v * 0.5 - 1.0).collect(),
        a_log: randv(h, seed ^ 3).iter().map(|v| v * 0.5).collect(),
        d: randv(h, seed ^ 4),
        dm,
    }
}

fn run_scan(c: &ScanCase, xbc: &[f64], dt: &[f64], bias: &[f64], a_log: &[f64], d: &[f64]) -> Vec<f64> {
    let dm = &c.dm;
    let mut y = vec![f64::NAN; dm.batch * dm.seq * dm.heads * dm.head_dim];
    let mut st = vec![f64::NAN; dm.batch * dm.heads * dm.states_per_head()];
    s::scan(xbc, dt, &s::ScanParams { dt_bias: bias, a_log, d }, dm, &mut y, &mut st);
    y
}

/// Every gradient of the scan against finite differences of its f64 forward.
fn scan_fd(c: &ScanCase, seed: u64) {
    let dm = &c.dm;
    let dy = randv(dm.batch * dm.seq * dm.heads * dm.head_dim, seed ^ 9);
    let mut y = vec![f64::NAN; dy.len()];
    let mut st = vec![f64::NAN; dm.batch * dm.heads * dm.states_per_head()];
    let prm = s::ScanParams { dt_bias: &c.bias, a_log: &c.a_log, d: &c.d };
    s::scan(&c.xbc, &c.dt, &prm, dm, &mut y, &mut st);
    let (mut dx, mut ddt) = (vec![f64::NAN; c.xbc.len()], vec![f64::NAN; c.dt.len()]);
    let (mut gb, mut ga, mut gd) = (vec![f64::NAN; dm.heads], vec![f64::NAN; dm.heads], vec![f64::NAN; dm.heads]);
    let grads = s::ScanParamGrads { dt_bias: &mut gb, a_log: &mut ga, d: &mut gd };
    s::scan_bwd(&c.xbc, &c.dt, &prm, dm, &st, &dy, &mut dx, &mut ddt, grads);
    fd_check(&c.xbc, &dx, |v| dot(&run_scan(c, v, &c.dt, &c.bias, &c.a_log, &c.d), &dy), "dxbc");
    fd_check(&c.dt, &ddt, |v| dot(&run_scan(c, &c.xbc, v, &c.bias, &c.a_log, &c.d), &dy), "ddt_raw");
    fd_check(&c.bias, &gb, |v| dot(&run_scan(c, &c.xbc, &c.dt, v, &c.a_log, &c.d), &dy), "ddt_bias");
    fd_check(&c.a_log, &ga, |v| dot(&run_scan(c, &c.xbc, &c.dt, &c.bias, v, &c.d), &dy), "da_log");
    fd_check(&c.d, &gd, |v| dot(&run_scan(c, &c.xbc, &c.dt, &c.bias, &c.a_log, v), &dy), "dD");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn scan_matches_quadratic_form(batch in 1usize..3, seq in 1usize..9, groups in 1usize..3, hpg in 1usize..3,
                                   head_dim in 1usize..4, state in 1usize..4, seed: u64) {
        let c = scan_case(batch, seq, groups, hpg, head_dim, state, seed);
        let got = run_scan(&c, &c.xbc, &c.dt, &c.bias, &c.a_log, &c.d);
        assert_close(&got, &scan_ref(&c.xbc, &c.dt, &c.bias, &c.a_log, &c.d, &c.dm), 1e-10, 1e-12, "scan y");
    }

    #[test]
    fn scan_backward_fd(batch in 1usize..3, seq in 1usize..7, groups in 1usize..3, hpg in 1usize..3,
                        head_dim in 1usize..3, state in 1usize..3, seed: u64) {
        scan_fd(&scan_case(batch, seq, groups, hpg, head_dim, state, seed), seed);
    }

    #[test]
    fn conv_fwd_and_fd(batch in 1usize..3, seq in 1usize..9, c in 1usize..5, kk in 1usize..5, seed: u64) {
        let x = randv(batch * seq * c, seed);
        let w = randv(c * kk, seed ^ 1);
        let b = randv(c, seed ^ 2);
        let mut y = vec![f64::NAN; x.len()];
        s::conv_silu(&x, &w, &b, seq, kk, &mut y);
        let mut want = vec![0.0; x.len()];
        for bi in 0..batch {
            for t in 0..seq {
                for ch in 0..c {
                    let mut pre = b[ch];
                    for j in 0..kk {
                        if t + j >= kk - 1 {
                            pre += w[ch * kk + j] * x[(bi * seq + t + j + 1 - kk) * c + ch];
                        }
                    }
                    want[(bi * seq + t) * c + ch] = silu(pre);
                }
            }
        }
        assert_close(&y, &want, 1e-12, 1e-12, "conv y");
        let dy = randv(x.len(), seed ^ 3);
        let (mut dx, mut dw, mut db) = (vec![f64::NAN; x.len()], vec![f64::NAN; w.len()], vec![f64::NAN; c]);
        s::conv_silu_bwd(&x, &w, &b, &dy, seq, kk, &mut dx, &mut dw, &mut db);
        let f = |x: &[f64], w: &[f64], b: &[f64]| {
            let mut y = vec![0.0; x.len()];
            s::conv_silu(x, w, b, seq, kk, &mut y);
            dot(&y, &dy)
        };
        fd_check(&x, &dx, |v| f(v, &w, &b), "conv dx");
        fd_check(&w, &dw, |v| f(&x, v, &b), "conv dw");
        fd_check(&b, &db, |v| f(&x, &w, v), "conv dbias");
    }

    #[test]
    fn gated_norm_fwd_and_fd(rows in 1usize..5, groups in 1usize..4, gsz in 1usize..5, seed: u64) {
        let c = groups * gsz;
        let (y, z, w) = (randv(rows * c, seed), randv(rows * c, seed ^ 1), randv(c, seed ^ 2));
        let eps = 1e-5;
        let (mut out, mut rstd) = (vec![f64::NAN; rows * c], vec![f64::NAN; rows * groups]);
        s::gated_norm(&y, &z, &w, groups, eps, &mut out, &mut rstd);
        let mut want = vec![0.0; rows * c];
        for r in 0..rows {
            for g in 0..groups {
                let cols = g * gsz..(g + 1) * gsz;
                let v: Vec<f64> = cols.clone().map(|i| y[r * c + i] * silu(z[r * c + i])).collect();
                let ms = v.iter().map(|a| a * a).sum::<f64>() / gsz as f64;
                for (k, i) in cols.enumerate() {
                    want[r * c + i] = v[k] / (ms + eps).sqrt() * w[i];
                }
            }
        }
        assert_close(&out, &want, 1e-12, 1e-12, "gated norm");
        let dout = randv(rows * c, seed ^ 3);
        let (mut dy, mut dz, mut dw) = (vec![f64::NAN; rows * c], vec![f64::NAN; rows * c], vec![f64::NAN; c]);
        s::gated_norm_bwd(&dout, &y, &z, &w, &rstd, groups, &mut dy, &mut dz, &mut dw);
        let f = |y: &[f64], z: &[f64], w: &[f64]| {
            let (mut o, mut r) = (vec![0.0; rows * c], vec![0.0; rows * groups]);
            s::gated_norm(y, z, w, groups, eps, &mut o, &mut r);
            dot(&o, &dout)
        };
        fd_check(&y, &dy, |v| f(v, &z, &w), "gated dy");
        fd_check(&z, &dz, |v| f(&y, v, &w), "gated dz");
        fd_check(&w, &dw, |v| f(&y, &z, v), "gated dw");
    }
}

/// Sequences longer than a chunk: the backward restarts its recurrence from saved states.
#[test]
fn scan_backward_across_chunks() {
    let c = scan_case(1, k::SCAN_CHUNK + 7, 1, 2, 2, 2, 11);
    assert_eq!(c.dm.chunks(), 2);
    scan_fd(&c, 5);
}

/// `ssd_scan` and its backward on `dev` against the f64 CPU functions, f32 and bf16 (poisoned
/// outputs on CUDA).
fn scan_on(dev: &Device, c: &ScanCase) {
    let dm = c.dm;
    let hp = dm.heads * dm.head_dim;
    let dy = randv(dm.batch * dm.seq * hp, 8);
    let mut st = vec![0.0; dm.batch * dm.heads * dm.states_per_head()];
    let mut y = vec![0.0; dm.batch * dm.seq * hp];
    let prm = s::ScanParams { dt_bias: &c.bias, a_log: &c.a_log, d: &c.d };
    s::scan(&c.xbc, &c.dt, &prm, &dm, &mut y, &mut st);
    let (mut dx, mut ddt) = (vec![0.0; c.xbc.len()], vec![0.0; c.dt.len()]);
    let (mut gb, mut ga, mut gd) = (vec![0.0; dm.heads], vec![0.0; dm.heads], vec![0.0; dm.heads]);
    s::scan_bwd(
        &c.xbc,
        &c.dt,
        &prm,
        &dm,
        &st,
        &dy,
        &mut dx,
        &mut ddt,
        s::ScanParamGrads { dt_bias: &mut gb, a_log: &mut ga, d: &mut gd },
    );
    for (dt, tol) in [(DType::F32, 2e-4), (DType::BF16, 6e-2)] {
        // bf16 inputs are rounded: the reference takes the rounded values.
        let round = |v: &[f64]| host(&tensor(&Device::Cpu, v, &[v.len()], dt));
        let want = run_scan(c, &round(&c.xbc), &round(&c.dt), &round(&c.bias), &round(&c.a_log), &round(&c.d));
        let xbc = tensor(dev, &c.xbc, &[dm.batch, dm.seq, dm.xbc_width()], dt);
        let dtr = tensor(dev, &c.dt, &[dm.batch, dm.seq, dm.heads], dt);
        let (b, a, d) = (
            tensor(dev, &c.bias, &[dm.heads], dt),
            tensor(dev, &c.a_log, &[dm.heads], dt),
            tensor(dev, &c.d, &[dm.heads], dt),
        );
        let p = k::ScanParams { dt_bias: &b, a_log: &a, d: &d };
        let (yt, states) = k::ssd_scan(&xbc, &dtr, &p, &dm).unwrap();
        assert_eq!(yt.dtype(), dt);
        let what = format!("ssd_scan {dm:?} {dt:?} on {dev:?}");
        assert_close(&host(&yt), &want, tol, tol, &what);
        let g = k::ssd_scan_bwd(&xbc, &dtr, &p, &dm, &states, &tensor(dev, &dy, &[dm.batch, dm.seq, hp], dt)).unwrap();
        if dt == DType::F32 {
            // The saved states too: the chunked kernels form them by another route.
            assert_close(&host(&states), &st, tol, tol, &format!("states of {what}"));
            assert_close(&host(&g.dxbc), &dx, tol, tol, &format!("dxbc of {what}"));
            assert_close(&host(&g.ddt_raw), &ddt, tol, tol, &format!("ddt_raw of {what}"));
            assert_close(&host(&g.dt_bias), &gb, tol, tol, &format!("ddt_bias of {what}"));
            assert_close(&host(&g.a_log), &ga, tol, tol, &format!("da_log of {what}"));
            assert_close(&host(&g.d), &gd, tol, tol, &format!("dD of {what}"));
        } else {
            // bf16: the gradients agree with f32's to bf16's precision on the whole.
            // ‖got − want‖ / max(‖want‖, 1): relative, or absolute where want is small (a single
            // chunk's start state is all zeros).
            let rel = |got: &Tensor, want: &[f64]| {
                let g = host(got);
                assert_eq!(g.len(), want.len());
                let num: f64 = g.iter().zip(want).map(|(a, b)| (a - b).powi(2)).sum();
                (num / want.iter().map(|b| b * b).sum::<f64>().max(1.0)).sqrt()
            };
            // (On CUDA, Mamba-2's shapes take the tensor-core kernels here.)
            for (name, got, want) in [
                ("states", &states, &st),
                ("dxbc", &g.dxbc, &dx),
                ("ddt_raw", &g.ddt_raw, &ddt),
                ("ddt_bias", &g.dt_bias, &gb),
                ("da_log", &g.a_log, &ga),
                ("dD", &g.d, &gd),
            ] {
                let r = rel(got, want);
                assert!(r < 3e-2, "bf16 {name} of {what}: relative error {r}");
            }
        }
    }
}

/// The convolution with SiLU (PyTorch's [C, 1, K] weight) on `dev` against the f64 CPU functions on
/// the same rounded inputs, f32 and bf16, forward and backward.
fn conv_on(dev: &Device, batch: usize, seq: usize, cc: usize, kk: usize) {
    let len = batch * seq * cc;
    let (xv, w, bias, dyc) = (randv(len, 2), randv(cc * kk, 3), randv(cc, 4), randv(len, 5));
    for (dt, tol) in [(DType::F32, 2e-4), (DType::BF16, 6e-2)] {
        let round = |v: &[f64]| host(&tensor(&Device::Cpu, v, &[v.len()], dt));
        let what = format!("conv {batch}×{seq}×{cc}, {kk} taps, {dt:?}");
        let (xt, wt, bt) =
            (tensor(dev, &xv, &[batch, seq, cc], dt), tensor(dev, &w, &[cc, 1, kk], dt), tensor(dev, &bias, &[cc], dt));
        let yt = k::conv1d_silu(&xt, &wt, &bt).unwrap();
        let (xr, wr, bb) = (round(&xv), round(&w), round(&bias));
        let mut want = vec![0.0; len];
        s::conv_silu(&xr, &wr, &bb, seq, kk, &mut want);
        assert_close(&host(&yt), &want, tol, tol, &format!("{what}: y"));
        let (gx, gw, gbias) = k::conv1d_silu_bwd(&xt, &wt, &bt, &tensor(dev, &dyc, &[batch, seq, cc], dt)).unwrap();
        let (mut wdx, mut wdw, mut wdb) = (vec![0.0; len], vec![0.0; w.len()], vec![0.0; cc]);
        s::conv_silu_bwd(&xr, &wr, &bb, &round(&dyc), seq, kk, &mut wdx, &mut wdw, &mut wdb);
        assert_close(&host(&gx), &wdx, tol, tol, &format!("{what}: dx"));
        assert_close(&host(&gw), &wdw, tol, tol * 10.0, &format!("{what}: dw"));
        assert_close(&host(&gbias), &wdb, tol, tol * 10.0, &format!("{what}: dbias"));
    }
}

/// The gated grouped RMSNorm on `dev` against the f64 CPU functions on the same rounded inputs.
fn gated_on(dev: &Device, rows: usize, hp: usize, groups: usize) {
    let (yv, zv, nw, dout) = (randv(rows * hp, 6), randv(rows * hp, 7), randv(hp, 8), randv(rows * hp, 9));
    for (dt, tol) in [(DType::F32, 2e-4), (DType::BF16, 6e-2)] {
        let round = |v: &[f64]| host(&tensor(&Device::Cpu, v, &[v.len()], dt));
        let what = format!("gated norm {rows}×{hp}, {groups} groups, {dt:?}");
        let (yt, zt, wt) =
            (tensor(dev, &yv, &[rows, hp], dt), tensor(dev, &zv, &[rows, hp], dt), tensor(dev, &nw, &[hp], dt));
        let (out, rstd) = k::gated_rmsnorm(&yt, &zt, &wt, groups, 1e-5).unwrap();
        let (yr, zr, nr) = (round(&yv), round(&zv), round(&nw));
        let (mut wo, mut wr2) = (vec![0.0; rows * hp], vec![0.0; rows * groups]);
        s::gated_norm(&yr, &zr, &nr, groups, 1e-5, &mut wo, &mut wr2);
        assert_close(&host(&out), &wo, tol, tol, &format!("{what}: out"));
        assert_close(&host(&rstd), &wr2, 1e-3, 1e-4, &format!("{what}: rstd"));
        let (gy, gz, gw) =
            k::gated_rmsnorm_bwd(&tensor(dev, &dout, &[rows, hp], dt), &yt, &zt, &wt, &rstd, groups).unwrap();
        let (mut wy, mut wz, mut ww) = (vec![0.0; rows * hp], vec![0.0; rows * hp], vec![0.0; hp]);
        s::gated_norm_bwd(&round(&dout), &yr, &zr, &nr, &wr2, groups, &mut wy, &mut wz, &mut ww);
        assert_close(&host(&gy), &wy, tol, tol, &format!("{what}: dy"));
        assert_close(&host(&gz), &wz, tol, tol, &format!("{what}: dz"));
        assert_close(&host(&gw), &ww, tol, tol * 10.0, &format!("{what}: dw"));
    }
}

/// The tensor ops on `dev` against the f64 CPU functions, f32 and bf16 (poisoned outputs). The
/// scan at four shapes: tiny and ragged (one part-filled chunk); two chunks of head dim 6 and 5
/// state channels (neither a multiple of the kernels' 4 × 4 patches); Mamba-2's head dim 64 and 128
/// state channels over three chunks, the last part-filled (on CUDA the chunked kernels); head dim
/// 96 with 256 state channels, whose chunk does not fit a block's shared memory on an H200 (on
/// CUDA the step-by-step kernels).
fn ssm_ops_on(dev: &Device) {
    #[cfg(feature = "cuda")]
    k::cuda::set_poisoning(true);
    let c = scan_case(2, 37, 2, 2, 4, 3, 21);
    scan_on(dev, &c);
    scan_on(dev, &scan_case(1, k::SCAN_CHUNK + 6, 1, 3, 6, 5, 24));
    scan_on(dev, &scan_case(2, 2 * k::SCAN_CHUNK + 22, 2, 2, 64, 128, 22));
    scan_on(dev, &scan_case(1, k::SCAN_CHUNK + 6, 1, 2, 96, 256, 23));
    // The convolution: ragged runs of 64 steps, two blocks of channels (the second part-filled; on
    // CUDA four channels a thread, then one), one tap, six (on CUDA the 8-tap build), five in four
    // channels a thread.
    for (batch, seq, cc, kk) in
        [(2, 37, 20, 4), (2, 150, 1100, 4), (1, 70, 301, 3), (1, 130, 5, 6), (2, 9, 3, 1), (1, 100, 12, 5)]
    {
        conv_on(dev, batch, seq, cc, kk);
    }
    // The gated norm: groups of 8 and 1,024 channels (on CUDA the eight-channel kernels, the
    // backward's row blocks part-filled), of 6 and 1,280 (the per-row kernels), of 256 in three groups.
    for (rows, cc, groups) in [(74, 16, 2), (37, 12, 2), (150, 2048, 2), (70, 2560, 2), (65, 768, 3)] {
        gated_on(dev, rows, cc, groups);
    }
}

device_test!(ssm_ops_match_reference, ssm_ops_on);

#[test]
fn ssm_ops_refuse_bad_shapes() {
    let dev = Device::Cpu;
    let dm = s::ScanDims { batch: 1, seq: 4, heads: 3, head_dim: 2, groups: 2, state: 2 };
    let x = Tensor::zeros([1, 4, 14], DType::F32, &dev).unwrap();
    let dt = Tensor::zeros([1, 4, 3], DType::F32, &dev).unwrap();
    let h = Tensor::zeros([3], DType::F32, &dev).unwrap();
    let p = k::ScanParams { dt_bias: &h, a_log: &h, d: &h };
    let e = k::ssd_scan(&x, &dt, &p, &dm).unwrap_err().to_string();
    assert!(e.contains("multiple of the groups"), "{e}");
    let dm = s::ScanDims { groups: 1, heads: 3, ..dm };
    let e = k::ssd_scan(&x, &dt, &p, &dm).unwrap_err().to_string();
    assert!(e.contains("ssd_scan") && e.contains("[1, 4, 10]"), "{e}");
    let w = Tensor::zeros([5, 1, 4], DType::F32, &dev).unwrap();
    let e = k::conv1d_silu(&x, &w, &Tensor::zeros([14], DType::F32, &dev).unwrap()).unwrap_err().to_string();
    assert!(e.contains("conv1d_silu") && e.contains("[5, 1, 4]"), "{e}");
    let y = Tensor::zeros([4, 6], DType::F32, &dev).unwrap();
    let e = k::gated_rmsnorm(&y, &y, &Tensor::zeros([6], DType::F32, &dev).unwrap(), 4, 1e-5).unwrap_err().to_string();
    assert!(e.contains("4 groups must divide the 6 channels"), "{e}");
}
