//! Compiles kernels/ into the kernel cache ahead of a first GPU run (feature `cuda`; NVRTC only,
//! no GPU): a fresh GPU machine then loads the CUBIN instead of compiling for a minute first.
//! The cache is `$FERROTRON_CACHE_DIR/ptx` (else `~/.cache/ferrotron/ptx`); carry that folder to
//! the GPU machine and point `FERROTRON_CACHE_DIR` at it there.
//!
//! `cargo run --release --features cuda -p ferrotron-examples --example kernel_cache -- sm_90a`

#[cfg(feature = "cuda")]
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let archs = if args.is_empty() { vec!["sm_90a".to_string()] } else { args };
    for arch in &archs {
        let start = std::time::Instant::now();
        let path = ferrotron_kernels::cuda::prebuild_kernels(arch)?;
        println!("{arch}: {} ({:.0} s)", path.display(), start.elapsed().as_secs_f64());
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!(
        "kernel_cache needs the cuda feature: cargo run --release --features cuda -p ferrotron-examples --example kernel_cache"
    );
    std::process::exit(2);
}
