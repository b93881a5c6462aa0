//! The fused cross-entropy forward + backward alone on a GPU (feature `cuda`): microseconds a call
//! and the memory rate over a GPT batch of logits (16,384 rows, bf16) at a GPT-2 vocabulary
//! (50,304: the row kept in shared memory between the passes) and a Llama-3 one (128,256: its first
//! 56,320 columns kept). `FERROTRON_CE_KEEP=0` times the kernel that keeps nothing, to compare.
//! Bytes counted: the row read once and the gradient written once (what a kernel keeping all of
//! it moves).
//!
//! `cargo run --release --features cuda -p ferrotron-examples --example loss_bench`

#[cfg(feature = "cuda")]
fn main() -> Result<(), Box<dyn std::error::Error>> {
    use ferrotron_core::{DType, Device, Tensor};
    use ferrotron_kernels::{self as k, CrossEntropyCfg};
    use std::time::Instant;
    let dev = Device::cuda(0)?;
    let Device::Cuda(cd) = &dev else { unreachable!() };
    let rows = 16_384usize;
    println!("| vocabulary | rows | µs a call | GB/s (read + write once) |");
    println!("|---|---|---|---|");
    for v in [50_304usize, 128_256] {
        let vals: Vec<f32> = (0..rows * v).map(|i| ((i * 7919 % 10007) as f32 / 10007.0 - 0.5) * 8.0).collect();
        let logits = Tensor::from_f32(&vals, [rows, v], DType::BF16, &dev)?;
        let targets = Tensor::from_vec((0..rows).map(|i| (i * 31 % v) as u32).collect(), [rows], &dev)?;
        let cfg = CrossEntropyCfg::default();
        let scale = k::RowScale::Value(1.0 / rows as f32);
        // Each call overwrites the logits with their gradient; later calls take those as logits
        // (finite values: the timing does not depend on them).
        let call = || k::cross_entropy_fwd_bwd_(&logits, &targets, None, cfg, scale).map(|_| ());
        call()?;
        cd.synchronize()?;
        let reps = 20;
        let t0 = Instant::now();
        for _ in 0..reps {
            call()?;
        }
        cd.synchronize()?;
        let s = t0.elapsed().as_secs_f64() / reps as f64;
        println!("| {v} | {rows} | {:.1} | {:.0} |", s * 1e6, (2 * rows * v * 2) as f64 / s / 1e9);
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!(
        "loss_bench needs a CUDA build: cargo run --release --features cuda -p ferrotron-examples --example loss_bench"
    );
    std::process::exit(2);
}
