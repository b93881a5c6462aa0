//! Flash attention alone on a GPU (feature `cuda`): forward and backward TFLOP/s for causal
//! attention at head dims 64 and 128 (and 192 on request) over sequence lengths 1k–16k, bf16, as
//! issue 7's table asks.
//! `benches/torch_sdpa.py` prints PyTorch SDPA's figures for the same shapes; run both in one
//! command on the GPU machine. FLOPs follow FlashAttention's convention: 4·B·H·T²·D forward
//! (halved for causal), 2.5× that for the backward.
//!
//! `cargo run --release --features cuda -p ferrotron-examples --example attention_bench`

#[cfg(feature = "cuda")]
fn main() -> Result<(), Box<dyn std::error::Error>> {
    use ferrotron_core::{DType, Device, Tensor};
    use ferrotron_kernels::{self as k, AttnCfg};
    use std::time::Instant;
    let dev = Device::cuda(0)?;
    let Device::Cuda(cd) = &dev else { unreachable!() };
    // ATTN_BENCH_DROPOUT=P: attention dropout at rate P (the kernels' `_drop` builds).
    let dropout: Option<f32> = std::env::var("ATTN_BENCH_DROPOUT").ok().and_then(|p| p.parse().ok());
    // On sm_90 the kernels run on wgmma; the mma.sync kernels are timed beside them (the same
    // kernels elsewhere). ATTN_BENCH_ONLY=DxT (e.g. 128x4096) keeps one shape and ATTN_BENCH_REPS
    // sets the timed repetitions (5): for a profiler. ATTN_BENCH_FUSED=1 reads Q, K and V in place
    // from one [B, T, H·3·D] projection output, as the GPT layers do (`attention_fwd_qkv`), in the
    // fwd and bwd columns. ATTN_BENCH_DATA=pattern fills the inputs with the short repeating
    // pattern of the tables before 2026-12-01 instead of pseudo-random values: on a power-capped
    // card the data moves the clock (fewer bits flipping, less power). ATTN_BENCH_FWD_ONLY=1
    // times the forward alone (and `benches/torch_sdpa.py --dropout P` is SDPA's side of it).
    // ATTN_BENCH_DIMS=64,128,192 picks the head dims (default 64,128; 192 is multi-latent
    // attention's, on the mma.sync kernels alone; `benches/torch_sdpa.py --dims` for SDPA).
    // ATTN_BENCH_DOC_LEN=L: document masks (--reset-attention-mask), each row packed with
    // documents of L tokens (the last one shorter); FLOPs then count each document's causal
    // square alone (4·B·H·D·Σ L²/2 forward), the work a varlen kernel would do.
    let only = std::env::var("ATTN_BENCH_ONLY").ok();
    let reps: usize = std::env::var("ATTN_BENCH_REPS").ok().and_then(|r| r.parse().ok()).unwrap_or(5);
    let fused = std::env::var("ATTN_BENCH_FUSED").is_ok_and(|v| v == "1");
    let pattern = std::env::var("ATTN_BENCH_DATA").is_ok_and(|v| v == "pattern");
    let fwd_only = std::env::var("ATTN_BENCH_FWD_ONLY").is_ok_and(|v| v == "1");
    let dims: Vec<usize> = match std::env::var("ATTN_BENCH_DIMS") {
        Ok(v) => v.split(',').map(|d| d.trim().parse()).collect::<Result<_, _>>()?,
        Err(_) => vec![64, 128],
    };
    let doc_len: Option<usize> = std::env::var("ATTN_BENCH_DOC_LEN").ok().and_then(|l| l.parse().ok());
    // Uniform in [-1, 1) from a splitmix64 hash of the index (the same values on every run).
    let value = |i: usize| -> f32 {
        if pattern {
            return ((i * 7919 % 1000) as f32 / 1000.0 - 0.5) * 0.5;
        }
        let mut z = (i as u64).wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    };
    // The backward also runs deterministic (dQ by its own kernel instead of bulk reductions).
    println!(
        "| head dim | seq | batch × heads | fwd TFLOP/s | bwd TFLOP/s | bwd deterministic | fwd mma.sync | bwd mma.sync |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for d in dims {
        for t in [1024usize, 2048, 4096, 8192, 16384] {
            if only.as_ref().is_some_and(|o| *o != format!("{d}x{t}")) {
                continue;
            }
            // 16k tokens per call, 2048 hidden (heads = 2048 / d, rounded down).
            let (b, h) = ((16384 / t).max(1), 2048 / d);
            let n = b * t * h * d;
            let dropout = dropout.map(|p| k::AttnDropout {
                p,
                seed: 1,
                stream: 2,
                base: 0,
                batch_stride: k::AttnDropout::blocks_per_sample(h, t, t),
                head_offset: 0,
                tiles: None,
            });
            let docs = match doc_len {
                Some(l) => {
                    let row = (0..t).map(|i| (i - i % l) as u32);
                    Some(Tensor::from_vec(row.cycle().take(b * t).collect(), [b, t], &dev)?)
                }
                None => None,
            };
            let cfg = AttnCfg { causal: true, window: None, scale: None, dropout, docs: docs.as_ref() };
            // The causal squares the mask leaves: the whole row's, or each document's.
            let square = match doc_len {
                Some(l) => ((t / l) * l * l + (t % l) * (t % l)) as f64,
                None => (t * t) as f64,
            };
            let mk = |salt: usize| {
                let vals: Vec<f32> = (0..n).map(|i| value(i + salt * n)).collect();
                Tensor::from_f32(&vals, [b, t, h, d], DType::BF16, &dev)
            };
            let (q, kk, v, dout) = (mk(0)?, mk(1)?, mk(2)?, mk(3)?);
            let qkv_vals: Vec<f32> = (0..3 * n).map(|i| value(i + 4 * n)).collect();
            let qkv = Tensor::from_f32(&qkv_vals, [b, t, h * 3 * d], DType::BF16, &dev)?;
            let time = |f: &mut dyn FnMut() -> Result<(), Box<dyn std::error::Error>>| {
                f()?; // warm-up (and NVRTC compile on the first call)
                cd.synchronize()?;
                let start = Instant::now();
                for _ in 0..reps {
                    f()?;
                }
                cd.synchronize()?;
                Ok::<f64, Box<dyn std::error::Error>>(start.elapsed().as_secs_f64() / reps as f64)
            };
            let (fwd, bwd) = if fused {
                let fwd = time(&mut || {
                    k::attention_fwd_qkv(&qkv, k::QkvHeads::new(h, 1, d), &cfg)?;
                    Ok(())
                })?;
                let (o, lse) = k::attention_fwd_qkv(&qkv, k::QkvHeads::new(h, 1, d), &cfg)?;
                let bwd = time(&mut || {
                    k::attention_bwd_qkv(&qkv, &o, &lse, &dout, k::QkvHeads::new(h, 1, d), &cfg)?;
                    Ok(())
                })?;
                (fwd, bwd)
            } else {
                let fwd = time(&mut || {
                    k::attention_fwd(&q, &kk, &v, &cfg)?;
                    Ok(())
                })?;
                let (o, lse) = k::attention_fwd(&q, &kk, &v, &cfg)?;
                let bwd = time(&mut || {
                    k::attention_bwd(&q, &kk, &v, &o, &lse, &dout, &cfg)?;
                    Ok(())
                })?;
                (fwd, bwd)
            };
            if fwd_only {
                let flops = 4.0 * (b * h) as f64 * square * d as f64 / 2.0;
                println!("| {d} | {t} | {b} × {h} | {:.1} | – | – | – | – |", flops / fwd / 1e12);
                continue;
            }
            let (o, lse) = k::attention_fwd(&q, &kk, &v, &cfg)?;
            k::cuda::set_deterministic(true);
            let bwd_det = time(&mut || {
                k::attention_bwd(&q, &kk, &v, &o, &lse, &dout, &cfg)?;
                Ok(())
            })?;
            k::cuda::set_deterministic(false);
            k::cuda::set_wgmma(false);
            let fwd_mma = time(&mut || {
                k::attention_fwd(&q, &kk, &v, &cfg)?;
                Ok(())
            })?;
            let bwd_mma = time(&mut || {
                k::attention_bwd(&q, &kk, &v, &o, &lse, &dout, &cfg)?;
                Ok(())
            })?;
            k::cuda::set_wgmma(true);
            let flops = 4.0 * (b * h) as f64 * square * d as f64 / 2.0;
            let tf = |secs: f64| flops / secs / 1e12;
            println!(
                "| {d} | {t} | {b} × {h} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} |",
                tf(fwd),
                2.5 * tf(bwd),
                2.5 * tf(bwd_det),
                tf(fwd_mma),
                2.5 * tf(bwd_mma)
            );
        }
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!(
        "attention_bench needs a CUDA build: cargo run --release --features cuda -p ferrotron-examples --example attention_bench"
    );
    std::process::exit(2);
}
