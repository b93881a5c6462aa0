//! `cargo xtask trace FILE [FILE2]` and `cargo xtask bench --gpu-trace`: GPU timelines of running
//! training steps (xtask::trace), Ferrotron's from `ferrotron train --profile-trace`, PyTorch's
//! from its profiler.

use crate::{bench_bin_and_presets, bench_shape, bench_train_args, multi, profile_args, torch_args};
use anyhow::{Context, bail};
use std::path::{Path, PathBuf};
use std::process::Command;
use xtask::trace::{Steps, gap_pair_table, gap_table, kernel_table, spans, step_table, steps};

/// A trace file's whole steps, and the side's name: Ferrotron's files carry a "ferrotron" key.
fn load(path: &Path) -> anyhow::Result<(&'static str, Steps)> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let side = if text.contains("\"ferrotron\":{") { "Ferrotron" } else { "PyTorch" };
    let st = steps(&spans(&text).with_context(|| path.display().to_string())?)
        .with_context(|| path.display().to_string())?;
    Ok((side, st))
}

/// Prints the step table, the time per part of the step and the longest gaps of one or two traces
/// (Ferrotron's first where there are two), and with TRACE_KERNELS=N each side's N kernels that
/// take the most time, with TRACE_GAPS=N the N neighbour pairs with the most idle time between.
fn report(files: &[PathBuf]) -> anyhow::Result<()> {
    let mut sides = files.iter().map(|f| load(f)).collect::<anyhow::Result<Vec<_>>>()?;
    sides.sort_by_key(|s| s.0 != "Ferrotron");
    let named: Vec<(&str, &Steps)> = sides.iter().map(|(n, s)| (*n, s)).collect();
    print!("{}", step_table(&named));
    let n = |s: &Steps| s.bounds.len() as f64;
    let (ours, theirs) = (&sides[0].1, sides.get(1).map(|s| &s.1));
    let (tk, tn) = theirs.map_or((Vec::new(), 1.0), |t| (t.kernel_times(), n(t)));
    println!("\nGPU time per part of the step, at the running step's clocks:");
    print!("{}", xtask::profile::compare_table(&ours.kernel_times(), &tk, (n(ours), tn)));
    let n = |var: &str| std::env::var(var).ok().and_then(|v| v.parse().ok()).unwrap_or(0);
    let (top, pairs) = (n("TRACE_KERNELS"), n("TRACE_GAPS"));
    for (name, st) in &named {
        print!("{}", gap_table(name, st, 8));
        if top > 0 {
            print!("{}", kernel_table(name, st, top));
        }
        if pairs > 0 {
            print!("{}", gap_pair_table(name, st, pairs));
        }
    }
    Ok(())
}

/// `cargo xtask trace FILE [FILE2]`.
pub fn trace(args: &[String]) -> anyhow::Result<()> {
    if args.is_empty() || args.len() > 2 {
        bail!("usage: cargo xtask trace FILE [FILE2] (Chrome traces: ferrotron --profile-trace, torch.profiler)");
    }
    report(&args.iter().map(PathBuf::from).collect::<Vec<_>>())
}

/// `cargo xtask bench --gpu-trace [FERROTRON_BIN] [PRESET...]`: a GPU timeline of TRACE_ITERS
/// (default 4) running training steps after 3 warm-up steps, Ferrotron's (`--profile-trace`) and
/// PyTorch's (benches/torch_gpu_gpt.py `--trace`, BENCH_TORCH=0 skips it), then `report`. The
/// first step traced is cut by the trace's start, so the tables cover the others. Traces are kept
/// in TRACE_DIR (default the temp folder).
pub fn gpu_trace(args: &[String]) -> anyhow::Result<()> {
    let (bin, presets) = bench_bin_and_presets(args);
    let n = std::env::var("TRACE_ITERS").ok().and_then(|v| v.parse().ok()).filter(|&n: &u64| n >= 2).unwrap_or(4);
    let torch = !std::env::var("BENCH_TORCH").is_ok_and(|v| v == "0");
    let dir = std::env::var("TRACE_DIR").map(PathBuf::from).unwrap_or_else(|_| std::env::temp_dir());
    const WARM: u64 = 3;
    for p in &presets {
        let shape =
            bench_shape(p).with_context(|| format!("no GPU bench shape for preset {p}: use 124m, 1.3b or llama-1b"))?;
        let ours = dir.join(format!("ferrotron-{p}.trace.json"));
        // One log line at the end, so no loss is read back inside the traced steps.
        let mut a = bench_train_args(p, shape.micro, WARM + n + 1, WARM + n + 1);
        a.extend(profile_args(WARM, WARM + n));
        a.extend(["--profile-trace".to_string(), ours.display().to_string()]);
        run(Command::new(&bin).args(&a), "ferrotron")?;
        let mut files = vec![ours];
        if torch {
            let theirs = dir.join(format!("pytorch-{p}.trace.json"));
            let mut a = torch_args(&shape, shape.micro, 0.0);
            a.extend(multi::owned(&["--warmup", &WARM.to_string(), "--iters", &n.to_string()]));
            a.extend(["--trace".to_string(), theirs.display().to_string()]);
            run(Command::new("python3").args(&a), "benches/torch_gpu_gpt.py")?;
            files.push(theirs);
        }
        println!("\n## {p}: {n} steps traced after {WARM} warm-up steps");
        report(&files)?;
    }
    Ok(())
}

/// Runs a command to the end, its output passed through; an error names it on failure.
fn run(cmd: &mut Command, what: &str) -> anyhow::Result<()> {
    let status = cmd.status().with_context(|| format!("starting {what}"))?;
    if !status.success() {
        bail!("{what} exited with {status}");
    }
    Ok(())
}
