//! Our own GEMM kernels (kernels/gemm.cu) beside cuBLASLt on the MLP's products (feature `cuda`, an
//! sm_90 GPU): fc1 with its GeLU epilogue and fc2's input gradient with the GeLU's gradient, at the
//! GPT-2 124M (hidden 768) and GPT 1.3B (hidden 2048) shapes over 16,384 tokens, each with the
//! same product without an epilogue, the plain products whose output is only hidden wide, and
//! (`GEMM_BENCH_LM=1`) the LM head's two products with the vocabulary wide. µs a call (the mean of
//! 20 after one warm-up) and TFLOP/s. cuBLASLt runs first in each row, on a cooler card than the
//! builds after it: to compare them at the card's power cap, time 1,000 calls or more
//! (`GEMM_BENCH_REPS`).
//!
//! `cargo run --release --features cuda -p ferrotron-examples --example gemm_bench`

#[cfg(feature = "cuda")]
fn main() -> Result<(), Box<dyn std::error::Error>> {
    use ferrotron_core::{DType, Device, Tensor};
    use ferrotron_kernels::{self as k, cuda};
    use std::time::Instant;
    let dev = Device::cuda(0)?;
    let Device::Cuda(cd) = &dev else { unreachable!() };
    let rnd = |rows: usize, cols: usize, seed: usize| -> Result<Tensor, Box<dyn std::error::Error>> {
        let v: Vec<f32> =
            (0..rows * cols).map(|i| (((i + seed) * 7919 % 10007) as f32 / 10007.0 - 0.5) * 0.2).collect();
        Ok(Tensor::from_f32(&v, [rows, cols], DType::BF16, &dev)?)
    };
    println!(
        "| model | product (m × n × k) | cuBLASLt µs | TFLOP/s | ours, ping-pong µs | TFLOP/s | ours, clusters of 2 µs | TFLOP/s | ours, 256 × 128 µs | TFLOP/s | ours, 128 × 256 µs | TFLOP/s | ours, 128 × 256 in clusters of 2 µs | TFLOP/s | cuBLASLt / best of ours |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    // GEMM_BENCH_ONLY=124M or 1.3B: that model alone; GEMM_BENCH_REPS: calls timed (Nsight
    // Compute runs take 1).
    let only = std::env::var("GEMM_BENCH_ONLY").ok();
    // GEMM_BENCH_ROW=TEXT: only the products whose name contains TEXT (e.g. "LM head h").
    let row_only = std::env::var("GEMM_BENCH_ROW").ok();
    let reps: usize = std::env::var("GEMM_BENCH_REPS").ok().and_then(|v| v.parse().ok()).unwrap_or(20);
    for (model, h) in [("124M", 768usize), ("1.3B", 2048)] {
        if only.as_deref().is_some_and(|o| o != model) {
            continue;
        }
        let (m, f) = (16_384usize, 4 * h);
        let (x, w, b) = (rnd(m, h, 1)?, rnd(f, h, 2)?, rnd(1, f, 3)?.reshape([f])?);
        let (dy, w2) = (rnd(m, h, 4)?, rnd(h, f, 5)?);
        let (_, hh) = k::linear_gelu(&x, &w, Some(&b))?;
        // None: cuBLASLt; else ours in that build, for the fused and the plain products.
        let time = |build: Option<cuda::OwnGemmBuild>,
                    f: &dyn Fn() -> ferrotron_core::Result<()>|
         -> ferrotron_core::Result<f64> {
            cuda::set_own_gemm(build.is_some());
            cuda::set_own_gemm_plain(build.is_some());
            cuda::set_own_gemm_build(build.unwrap_or(cuda::OwnGemmBuild::PingPong));
            f()?;
            cd.synchronize()?;
            let t0 = Instant::now();
            for _ in 0..reps {
                f()?;
            }
            cd.synchronize()?;
            Ok(t0.elapsed().as_secs_f64() / reps as f64)
        };
        let row = |what: &str,
                   (rm, rn, rk): (usize, usize, usize),
                   call: &dyn Fn() -> ferrotron_core::Result<()>|
         -> ferrotron_core::Result<()> {
            use cuda::OwnGemmBuild as G;
            if row_only.as_deref().is_some_and(|r| !what.contains(r)) {
                return Ok(());
            }
            let flop = 2.0 * (rm * rn * rk) as f64;
            let lt = time(None, call)?;
            let mut line =
                format!("| {model} | {what} ({rm} × {rn} × {rk}) | {:.1} | {:.0} |", lt * 1e6, flop / lt / 1e12);
            let mut best = f64::INFINITY;
            for b in G::ALL {
                let s = time(Some(b), call)?;
                best = best.min(s);
                line += &format!(" {:.1} | {:.0} |", s * 1e6, flop / s / 1e12);
            }
            println!("{line} {:.3} |", lt / best);
            Ok(())
        };
        let mlp = (m, f, h);
        row("x·wᵀ", mlp, &|| k::matmul(&x, &w, false, true).map(drop))?;
        row("fc1 + bias + GeLU (h kept)", mlp, &|| k::linear_gelu(&x, &w, Some(&b)).map(drop))?;
        row("dy·w", mlp, &|| k::matmul(&dy, &w2, false, false).map(drop))?;
        row("fc2 input gradient + dGeLU", mlp, &|| k::matmul_dgelu(&dy, &w2, &hh).map(drop))?;
        // The products h columns wide (cuBLASLt splits their k, with memsets before them in the
        // step): fc2 forward with its bias, fc1's and the QKV projection's input gradients.
        let (a4, w4, bh) = (rnd(m, f, 6)?, rnd(h, f, 7)?, rnd(1, h, 8)?.reshape([h])?);
        let (dq, wq) = (rnd(m, 3 * h, 9)?, rnd(3 * h, h, 10)?);
        row("fc2 + bias", (m, h, f), &|| k::matmul_bias(&a4, &w4, &bh, false, true).map(drop))?;
        row("fc1 input gradient", (m, h, f), &|| k::matmul(&a4, &w, false, false).map(drop))?;
        row("QKV input gradient", (m, h, 3 * h), &|| k::matmul(&dq, &wq, false, false).map(drop))?;
        // GEMM_BENCH_LM=1: the LM head's logits and input gradient too (GPT-2's 50,304-column
        // vocabulary; 1.65 GB of dlogits made on the host first).
        if std::env::var("GEMM_BENCH_LM").is_ok_and(|v| v == "1") {
            let v = 50_304usize;
            let (wv, dl) = (rnd(v, h, 11)?, rnd(m, v, 12)?);
            row("LM head h·wᵀ", (m, v, h), &|| k::matmul(&x, &wv, false, true).map(drop))?;
            row("LM head dlogits·w", (m, h, v), &|| k::matmul(&dl, &wv, false, false).map(drop))?;
        }
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!(
        "gemm_bench needs a CUDA build: cargo run --release --features cuda -p ferrotron-examples --example gemm_bench"
    );
    std::process::exit(2);
}
