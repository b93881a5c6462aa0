//! CPU kernel benchmarks: matmul, LayerNorm, attention and Mamba-2's scan at training-like shapes.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use ferrotron_core::{DType, Device, Tensor, rng::Philox};
use ferrotron_kernels as k;
use std::hint::black_box;

fn randn(shape: &[usize], seed: u64) -> Tensor {
    let n = shape.iter().product();
    let mut v = vec![0f32; n];
    Philox::new(seed).fill_normal(0, 0.0, 1.0, &mut v);
    Tensor::from_f32(&v, shape.to_vec(), DType::F32, &Device::Cpu).expect("bench tensor")
}

fn matmul(c: &mut Criterion) {
    let mut g = c.benchmark_group("matmul");
    for &(m, n, kk) in &[(512usize, 512usize, 512usize), (2048, 768, 768), (2048, 3072, 768)] {
        let (a, b) = (randn(&[m, kk], 1), randn(&[kk, n], 2));
        g.throughput(Throughput::Elements((2 * m * n * kk) as u64));
        g.bench_function(format!("{m}x{n}x{kk}"), |bch| {
            bch.iter(|| k::matmul(black_box(&a), black_box(&b), false, false).expect("matmul"))
        });
    }
    g.finish();
}

fn layernorm(c: &mut Criterion) {
    let mut g = c.benchmark_group("layernorm");
    let (x, w, b) = (randn(&[4096, 768], 3), randn(&[768], 4), randn(&[768], 5));
    g.throughput(Throughput::Bytes((4096 * 768 * 4 * 2) as u64));
    g.bench_function("fwd 4096x768", |bch| bch.iter(|| k::layernorm_fwd(&x, &w, Some(&b), 1e-5).expect("ln")));
    let (_, mean, rstd) = k::layernorm_fwd(&x, &w, Some(&b), 1e-5).expect("ln");
    g.bench_function("bwd 4096x768", |bch| bch.iter(|| k::layernorm_bwd(&x, &x, &w, &mean, &rstd).expect("ln bwd")));
    g.finish();
}

fn attention(c: &mut Criterion) {
    let mut g = c.benchmark_group("attention");
    g.sample_size(10);
    let (b, t, h, d) = (4, 256, 12, 64);
    let (q, kk, v) = (randn(&[b, t, h, d], 6), randn(&[b, t, h, d], 7), randn(&[b, t, h, d], 8));
    let cfg = k::AttnCfg::default();
    // Causal: half of the 4·B·H·T²·D multiply-adds count.
    g.throughput(Throughput::Elements((2 * b * h * t * t * d) as u64));
    g.bench_function("fwd causal b4 t256 h12 d64", |bch| {
        bch.iter(|| k::attention_fwd(&q, &kk, &v, &cfg).expect("attn"))
    });
    let (o, lse) = k::attention_fwd(&q, &kk, &v, &cfg).expect("attn");
    g.bench_function("bwd causal b4 t256 h12 d64", |bch| {
        bch.iter(|| k::attention_bwd(&q, &kk, &v, &o, &lse, &o, &cfg).expect("attn bwd"))
    });
    g.finish();
}

fn ssd_scan(c: &mut Criterion) {
    let mut g = c.benchmark_group("ssd_scan");
    g.sample_size(10);
    // mamba-tiny's mixer: 8 heads of 32 channels, 2 groups of 16 state channels, 2 × 128 steps.
    let dm = k::ScanDims { batch: 2, seq: 128, heads: 8, head_dim: 32, groups: 2, state: 16 };
    let xbc = randn(&[dm.batch, dm.seq, dm.xbc_width()], 9);
    let dt = randn(&[dm.batch, dm.seq, dm.heads], 10);
    let (bias, a_log, d) = (randn(&[dm.heads], 11), randn(&[dm.heads], 12), randn(&[dm.heads], 13));
    let p = k::ScanParams { dt_bias: &bias, a_log: &a_log, d: &d };
    // The state update and read-out: 3 multiply-adds per state element and step.
    g.throughput(Throughput::Elements((3 * dm.batch * dm.seq * dm.heads * dm.head_dim * dm.state) as u64));
    g.bench_function("fwd b2 t128 h8 p32 n16", |bch| bch.iter(|| k::ssd_scan(&xbc, &dt, &p, &dm).expect("scan")));
    let (y, states) = k::ssd_scan(&xbc, &dt, &p, &dm).expect("scan");
    g.bench_function("bwd b2 t128 h8 p32 n16", |bch| {
        bch.iter(|| k::ssd_scan_bwd(&xbc, &dt, &p, &dm, &states, &y).expect("scan bwd"))
    });
    g.finish();
}

criterion_group!(benches, matmul, layernorm, attention, ssd_scan);
criterion_main!(benches);
