//! `cargo xtask <command>`: tidy (layering and house rules), bench (criterion CPU benches; `--gpu`
//! for Ferrotron against PyTorch on one GPU, `--gpu-profile` for its time by kernel, `--gpu-trace`
//! for the GPU timeline of running steps, `--attention` for flash attention beside SDPA,
//! `--scaling` for several GPUs), trace (summarise GPU
//! timelines), gpu-parity (every
//! multi-GPU layout against one GPU), ptx (compile kernels/ with nvcc ahead of time), sass-diff
//! (which kernels a change reached, to the instruction) and gpu-test
//! (build the CUDA test binaries and run them where a GPU is, or stage them for a GPU machine).

mod gpuwatch;
mod multi;
mod tracerun;

use anyhow::{Context, bail};
use std::path::PathBuf;
use std::process::Command;

/// The workspace root: where xtask was built, or the current folder when the binary was carried to
/// another machine (the GPU runs).
fn root() -> PathBuf {
    let built = PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().map(PathBuf::from).unwrap_or_default();
    if built.join("Cargo.toml").is_file() { built } else { std::env::current_dir().unwrap_or_default() }
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("tidy") => {
            let v = xtask::tidy::check(&root())?;
            for x in &v {
                eprintln!("tidy: {x}");
            }
            if !v.is_empty() {
                bail!("{} tidy violation(s)", v.len());
            }
            println!("tidy: ok");
            Ok(())
        }
        Some("bench") if args.get(1).map(String::as_str) == Some("--gpu") => gpu_bench(&args[2..]),
        Some("bench") if args.get(1).map(String::as_str) == Some("--gpu-profile") => gpu_profile(&args[2..]),
        Some("bench") if args.get(1).map(String::as_str) == Some("--gpu-trace") => tracerun::gpu_trace(&args[2..]),
        Some("bench") if args.get(1).map(String::as_str) == Some("--attention") => attention_bench(&args[2..]),
        Some("trace") => tracerun::trace(&args[1..]),
        Some("bench") if args.get(1).map(String::as_str) == Some("--scaling") => {
            multi::scaling(&args[2..], root().join("target/release/ferrotron"))
        }
        Some("gpu-parity") => multi::parity(&args[1..], root().join("target/release/ferrotron")),
        Some("bench") => {
            // `--checkpoint`: the shard files' write and read paths instead of the CPU kernels.
            let (krate, bench, rest) = match args.get(1).map(String::as_str) {
                Some("--checkpoint") => ("ferrotron-checkpoint", "shards", &args[2..]),
                _ => ("ferrotron-kernels", "cpu_kernels", &args[1..]),
            };
            let status = Command::new(env!("CARGO"))
                .current_dir(root())
                .args(["bench", "-p", krate, "--bench", bench, "--"])
                .args(rest)
                .status()
                .context("running cargo bench")?;
            if !status.success() {
                bail!("cargo bench failed");
            }
            Ok(())
        }
        Some("ptx") => ptx(args.get(1).map(String::as_str).unwrap_or("sm_90a")),
        Some("sass-diff") => match args.get(1) {
            Some(rev) => sass_diff(rev, args.get(2).map(String::as_str).unwrap_or("sm_90a")),
            None => bail!("usage: cargo xtask sass-diff REV [sm_XX]: kernels/ at commit REV against the working tree"),
        },
        Some("gpu-test") => gpu_test(args.get(1).map(PathBuf::from)),
        _ => {
            eprintln!(
                "usage: cargo xtask tidy | bench [criterion args] | bench --gpu [FERROTRON_BIN] [PRESET...] | bench --gpu-profile [FERROTRON_BIN] [PRESET...] | bench --gpu-trace [FERROTRON_BIN] [PRESET...] | bench --attention [ATTENTION_BENCH_BIN] | trace FILE [FILE2] | bench --scaling [FERROTRON_BIN] [--gpus N] [--plot FILE] | gpu-parity [FERROTRON_BIN] [--gpus N] | ptx [sm_XX] | sass-diff REV [sm_XX] | gpu-test [STAGE_DIR]"
            );
            bail!("unknown command {:?}", args.first());
        }
    }
}

/// The CUDA sources as one translation unit, in the order NVRTC sees them: the order of the
/// `include_str!` list in crates/kernels/src/cuda/mod.rs (later files use earlier ones' helpers).
fn cuda_source() -> anyhow::Result<String> {
    cuda_source_from(|path| Ok(std::fs::read_to_string(root().join(path))?))
}

/// `cuda_source` with each file (a path from the workspace root) read by `read`: the working tree's
/// or a commit's (`git show REV:PATH`).
fn cuda_source_from(read: impl Fn(&str) -> anyhow::Result<String>) -> anyhow::Result<String> {
    let list = read("crates/kernels/src/cuda/mod.rs")?;
    let mut src = String::new();
    for part in list.split("include_str!(\"../../../../kernels/").skip(1) {
        let name = part.split('"').next().context("malformed include_str! in cuda/mod.rs")?;
        src.push_str(&read(&format!("kernels/{name}"))?);
        src.push('\n');
    }
    if src.is_empty() {
        bail!("no kernels/ sources listed in crates/kernels/src/cuda/mod.rs");
    }
    Ok(src)
}

/// Compiles kernels/ with nvcc for `arch` (a check that the sources build ahead of time) and
/// prints each kernel's registers, spills and shared memory from ptxas. nvcc comes with the CUDA
/// toolkit, or from PyPI: `pip install nvidia-cuda-nvcc` puts it in site-packages/nvidia/cu13/bin.
fn ptx(arch: &str) -> anyhow::Result<()> {
    let (cubin, log) = nvcc_cubin(arch, &cuda_source()?, "ferrotron_kernels")?;
    println!("| kernel | registers | spill stores / loads (bytes) | shared memory (static) |");
    println!("|---|---|---|---|");
    for row in ptxas_table(&log) {
        println!("| {} | {} | {} / {} | {} |", row.0, row.1, row.2, row.3, row.4);
    }
    // ptxas's performance warnings (e.g. C7512: wgmma serialized for want of registers).
    for line in log.lines().filter(|l| l.contains("Performance Loss")) {
        println!("warning: {}", line.trim());
    }
    println!("cubin: {}", cubin.display());
    Ok(())
}

/// Compiles `src` with nvcc for `arch` into target/ptx/STEM.ARCH.cubin: the cubin and ptxas's
/// `-v` log.
fn nvcc_cubin(arch: &str, src: &str, stem: &str) -> anyhow::Result<(PathBuf, String)> {
    let out = root().join("target/ptx");
    std::fs::create_dir_all(&out)?;
    let cu = out.join(format!("{stem}.cu"));
    std::fs::write(&cu, src)?;
    let cubin = out.join(format!("{stem}.{arch}.cubin"));
    let mut cmd = cuda_tool("nvcc")?;
    let res = cmd
        .args(["--cubin", &format!("-arch={arch}"), "-std=c++17", "-Xptxas", "-v", "-o"])
        .arg(&cubin)
        .arg(&cu)
        .output()
        .context(
            "nvcc not found: install the CUDA toolkit and put nvcc on PATH, or here without one: \
             python3 -m venv target/ci-venv && target/ci-venv/bin/pip install \
             'nvidia-cuda-nvcc==13.0.*' 'nvidia-nvvm==13.0.*' 'nvidia-cuda-crt==13.0.*' 'nvidia-cuda-runtime==13.0.*' \
             (one version for all four: a newer front end writes PTX that ptxas 13.0 refuses)",
        )?;
    let log = String::from_utf8_lossy(&res.stderr).into_owned();
    if !res.status.success() {
        bail!("nvcc failed on kernels/ for {arch}:\n{log}");
    }
    Ok((cubin, log))
}

/// `cargo xtask sass-diff REV [sm_XX]`: kernels/ at commit REV and in the working tree compiled
/// for the same arch, their SASS compared kernel by kernel (`xtask::sass`): which kernels changed
/// and how many instructions each has, which are the same to the instruction. cuobjdump and
/// nvdisasm come with the CUDA toolkit, or from PyPI into target/ci-venv beside nvcc.
fn sass_diff(rev: &str, arch: &str) -> anyhow::Result<()> {
    let at_rev = |path: &str| -> anyhow::Result<String> {
        let out = Command::new("git").current_dir(root()).args(["show", &format!("{rev}:{path}")]).output()?;
        if !out.status.success() {
            bail!("git show {rev}:{path}: {}", String::from_utf8_lossy(&out.stderr).trim());
        }
        Ok(String::from_utf8(out.stdout)?)
    };
    let (old, _) = nvcc_cubin(arch, &cuda_source_from(at_rev)?, "ferrotron_kernels_old")?;
    let (new, _) = nvcc_cubin(arch, &cuda_source()?, "ferrotron_kernels")?;
    let sass = |cubin: &PathBuf| -> anyhow::Result<String> {
        let out = cuda_tool("cuobjdump")?.arg("-sass").arg(cubin).output().context(
            "cuobjdump not found: install the CUDA toolkit, or here without one: target/ci-venv/bin/pip install \
             'nvidia-cuda-cuobjdump==13.2.*' 'nvidia-cuda-nvdisasm==13.2.*' (13.2 reads 13.0's cubins)",
        )?;
        if !out.status.success() {
            bail!("cuobjdump -sass {}: {}", cubin.display(), String::from_utf8_lossy(&out.stderr).trim());
        }
        Ok(String::from_utf8(out.stdout)?)
    };
    let d = xtask::sass::diff(&xtask::sass::functions(&sass(&old)?), &xtask::sass::functions(&sass(&new)?));
    println!(
        "{rev} → working tree, {arch}: {} kernels the same to the instruction, {} changed",
        d.same,
        d.changed.len()
    );
    if !d.changed.is_empty() {
        println!("| kernel | instructions at {rev} | now |");
        println!("|---|---|---|");
        for (name, a, b) in &d.changed {
            println!("| {name} | {a} | {b} |");
        }
    }
    for name in &d.removed {
        println!("removed: {name}");
    }
    for name in &d.added {
        println!("added: {name}");
    }
    Ok(())
}

/// A CUDA tool (nvcc, cuobjdump): from PATH, or from the folder pip installs them into in
/// target/ci-venv (site-packages/nvidia/cu13/bin), put first on the command's PATH (nvcc finds
/// ptxas and cicc, cuobjdump nvdisasm, only through it).
fn cuda_tool(name: &str) -> anyhow::Result<Command> {
    let on_path = std::env::var_os("PATH").is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(name).is_file()));
    let venv = || {
        let lib = root().join("target/ci-venv/lib");
        std::fs::read_dir(lib).ok()?.flatten().find_map(|py| {
            let bin = py.path().join("site-packages/nvidia/cu13/bin");
            bin.join(name).is_file().then_some(bin)
        })
    };
    match venv().filter(|_| !on_path) {
        Some(bin) => {
            let path = std::env::var_os("PATH").unwrap_or_default();
            let joined = std::env::join_paths(std::iter::once(bin.clone()).chain(std::env::split_paths(&path)))?;
            let mut cmd = Command::new(bin.join(name));
            cmd.env("PATH", joined);
            Ok(cmd)
        }
        None => Ok(Command::new(name)),
    }
}

/// (kernel, registers, spill store bytes, spill load bytes, static shared bytes) from `ptxas -v`.
fn ptxas_table(log: &str) -> Vec<(String, u64, u64, u64, u64)> {
    let num = |line: &str, before: &str| -> u64 {
        line.split(before).next().and_then(|s| s.split_whitespace().last()).and_then(|n| n.parse().ok()).unwrap_or(0)
    };
    let mut rows: Vec<(String, u64, u64, u64, u64)> = Vec::new();
    for line in log.lines() {
        if let Some(name) = line.split("Function properties for ").nth(1) {
            rows.push((name.trim().to_string(), 0, 0, 0, 0));
        } else if let Some(r) = rows.last_mut() {
            if line.contains("spill stores") {
                (r.2, r.3) = (num(line, " bytes spill stores"), num(line, " bytes spill loads"));
            } else if line.contains("Used ") {
                r.1 = num(line, " registers");
                r.4 = num(line, " bytes smem");
            }
        }
    }
    rows
}

/// Builds every test binary with `--features cuda`; runs them when a GPU is visible, otherwise
/// copies them (stripped) to `stage` for a GPU machine.
fn gpu_test(stage: Option<PathBuf>) -> anyhow::Result<()> {
    let out = Command::new(env!("CARGO"))
        .current_dir(root())
        .args([
            "test",
            "--release",
            "--features",
            "cuda",
            "--no-run",
            "--message-format=json",
            "-p",
            "ferrotron-core",
            "-p",
            "ferrotron-kernels",
            "-p",
            "ferrotron-comm",
            "-p",
            "ferrotron-parallel",
            "-p",
            "ferrotron-trainer",
        ])
        .output()
        .context("building the CUDA test binaries")?;
    if !out.status.success() {
        bail!("cargo test --no-run --features cuda failed:\n{}", String::from_utf8_lossy(&out.stderr));
    }
    let mut bins = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let (Some(exe), true) = (json_field(line, "executable"), line.contains("\"test\":true")) else { continue };
        bins.push(PathBuf::from(exe));
    }
    let gpu = std::path::Path::new("/dev/nvidia0").exists();
    match (gpu, stage) {
        (true, _) => {
            let gpus = Command::new("nvidia-smi")
                .arg("-L")
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).lines().filter(|l| l.starts_with("GPU ")).count())
                .unwrap_or(1);
            for b in &bins {
                let name = b.file_name().and_then(|n| n.to_str()).unwrap_or("");
                if name.starts_with("nccl_watchdog") && gpus < 2 {
                    // Two ranks are needed to leave a collective unmatched (see the test's doc).
                    println!("== {}: SKIPPED, needs 2 GPUs and this machine has {gpus}", b.display());
                    continue;
                }
                println!("== {}", b.display());
                let s = Command::new(b).status()?;
                if !s.success() {
                    bail!("{} failed", b.display());
                }
            }
        }
        (false, Some(dir)) => {
            std::fs::create_dir_all(&dir)?;
            for b in &bins {
                let name = b.file_name().and_then(|n| n.to_str()).unwrap_or("test");
                let short = name.rsplit_once('-').map_or(name, |x| x.0);
                let dst = dir.join(short);
                std::fs::copy(b, &dst)?;
                let _ = Command::new("strip").arg(&dst).status();
                println!("staged {}", dst.display());
            }
        }
        (false, None) => {
            bail!("no GPU here (/dev/nvidia0): pass a folder to stage the test binaries for a GPU machine")
        }
    }
    Ok(())
}

/// The string value of `"key":"..."` in a JSON line (cargo's messages; no escapes in paths).
fn json_field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let pat = format!("\"{key}\":\"");
    let start = line.find(&pat)? + pat.len();
    Some(&line[start..start + line[start..].find('"')?])
}

/// A GPU bench preset: the GPT's shape (layers, hidden, heads, seq, micro-batch) and the extra
/// arguments that make benches/torch_gpu_gpt.py build the same model.
struct BenchShape {
    layers: usize,
    hidden: usize,
    heads: usize,
    seq: usize,
    micro: usize,
    torch_style: &'static [&'static str],
    /// The matched bench's default steps and log window (its first window is warm-up): long
    /// enough that both sides are timed at the power cap's steady clock. A 124M step takes ≈ 29
    /// ms, so 30 steps timed 0.6 s after 0.3 s of warm-up, before the cap had settled: 1.18
    /// there against 1.154 over 300 steps (benches/NOTES.md, session 25).
    iters: u64,
    every: u64,
}

/// The presets issue 7 measures: GPT-2 124M, GPT 1.3B and the Llama-style 1B (GQA 32/8, seq 4096).
fn bench_shape(preset: &str) -> Option<BenchShape> {
    let (layers, hidden, heads, seq, micro, torch_style): (_, _, _, _, _, &'static [&'static str]) = match preset {
        "124m" => (12, 768, 12, 1024, 16, &[]),
        "1.3b" => (24, 2048, 16, 2048, 8, &[]),
        "llama-1b" => (16, 2048, 32, 4096, 4, &["--style", "llama", "--groups", "8", "--ffn", "8192"]),
        _ => return None,
    };
    // Warm-up ≥ 2.5 s and ≥ 5 s timed on the H200 (1.3B and Llama-1B steps take ≈ 250 ms).
    let (iters, every) = if preset == "124m" { (300, 100) } else { (30, 10) };
    Some(BenchShape { layers, hidden, heads, seq, micro, torch_style, iters, every })
}

/// benches/torch_gpu_gpt.py and its arguments for the same model as `shape` at micro-batch
/// `micro` (`flops` per token for its MFU; 0 where it is not timed); callers add the run's own.
fn torch_args(shape: &BenchShape, micro: usize, flops: f64) -> Vec<String> {
    let mut a = vec![root().join("benches/torch_gpu_gpt.py").display().to_string()];
    a.extend(multi::owned(&["--layers", &shape.layers.to_string(), "--hidden", &shape.hidden.to_string()]));
    a.extend(multi::owned(&["--heads", &shape.heads.to_string(), "--seq", &shape.seq.to_string()]));
    a.extend(multi::owned(&["--micro", &micro.to_string(), "--flops-per-token", &flops.to_string()]));
    a.extend(multi::owned(shape.torch_style));
    if let Some(p) = bench_attn_dropout() {
        a.extend(multi::owned(&["--attn-dropout", &p]));
    }
    a
}

/// BENCH_ATTN_DROPOUT=P: both sides train with attention dropout at rate P (ours
/// `--attention-dropout P`, PyTorch SDPA's `dropout_p`).
fn bench_attn_dropout() -> Option<String> {
    std::env::var("BENCH_ATTN_DROPOUT").ok().filter(|p| p.parse::<f64>().is_ok_and(|p| p > 0.0))
}

/// BENCH_GRAD_BF16=1: our main_grad in bf16 (`--grad-reduce-in-bf16`). With one micro-batch a
/// step (the bench's), that rounds each weight gradient to bf16 once, as the PyTorch reference's
/// autocast products do before their cast to its fp32 `.grad`.
fn bench_grad_bf16() -> bool {
    std::env::var("BENCH_GRAD_BF16").is_ok_and(|v| v == "1")
}

/// BENCH_MOMENTS_BF16=1: our AdamW moments in bf16 (the precision-aware optimizer's
/// `--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16`); PyTorch's stay fp32.
fn bench_moments_bf16() -> bool {
    std::env::var("BENCH_MOMENTS_BF16").is_ok_and(|v| v == "1")
}

/// `ferrotron train`'s `--profile` range over steps `start` + 1 to `end`.
fn profile_args(start: u64, end: u64) -> Vec<String> {
    multi::owned(&["--profile", "--profile-step-start", &start.to_string(), "--profile-step-end", &end.to_string()])
}

/// `ferrotron train` arguments of a GPU bench run: bf16 on CUDA, one evaluation batch (at the
/// end), a log line (and so a loss read back) every `log` steps, `micro` as both micro and global
/// batch.
fn bench_train_args(preset: &str, micro: usize, iters: u64, log: u64) -> Vec<String> {
    let mut a = multi::owned(&["train", "--device", "cuda", "--bf16", "--preset", preset, "--no-progress"]);
    // Each log line carries the memory pool's peak: the memory column's per-process figure.
    a.push("--log-memory-to-tensorboard".into());
    a.extend(multi::owned(&["--log-interval", &log.to_string(), "--eval-iters", "1", "--eval-interval", "1000000"]));
    a.extend(multi::owned(&["--corpus-docs", "3000", "--micro-batch-size", &micro.to_string()]));
    a.extend(multi::owned(&["--global-batch-size", &micro.to_string(), "--train-iters", &iters.to_string()]));
    if let Some(p) = bench_attn_dropout() {
        a.extend(multi::owned(&["--attention-dropout", &p]));
    }
    if bench_grad_bf16() {
        a.push("--grad-reduce-in-bf16".into());
    }
    if bench_moments_bf16() {
        a.extend(multi::owned(&["--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16"]));
        a.extend(multi::owned(&["--exp-avg-sq-dtype", "bf16"]));
    }
    // BENCH_FP8=FORMAT: our linear products in FP8 (`--fp8-format FORMAT`, with
    // `--fp8-recipe` BENCH_FP8_RECIPE: delayed, the default, or tensorwise); the PyTorch
    // reference stays bf16.
    if let Ok(f) = std::env::var("BENCH_FP8") {
        let recipe = std::env::var("BENCH_FP8_RECIPE").unwrap_or_else(|_| "delayed".into());
        a.extend(multi::owned(&["--fp8-format", &f, "--fp8-recipe", &recipe]));
    }
    // BENCH_CUDA_GRAPH=N: the step graphed after N eager steps (`--cuda-graph-impl local`).
    if let Some(n) = std::env::var("BENCH_CUDA_GRAPH").ok().and_then(|v| v.parse::<u64>().ok()) {
        a.extend(multi::owned(&["--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration"]));
        a.extend(multi::owned(&["--cuda-graph-warmup-steps", &n.to_string()]));
    }
    a
}

/// A thread reading all of a child's pipe (so that a full pipe never stalls it).
fn read_all<R: std::io::Read + Send + 'static>(r: Option<R>) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut s = String::new();
        if let Some(mut r) = r {
            let _ = r.read_to_string(&mut s);
        }
        s
    })
}

/// FLOPs per token from ferrotron's startup line `… parameters (X MFLOP/token …`.
fn header_flops_per_token(log: &str) -> Option<f64> {
    let m = log.split("parameters (").nth(1)?.split(" MFLOP/token").next()?;
    m.parse::<f64>().ok().map(|x| x * 1e6)
}

/// `cargo xtask bench --gpu-profile [FERROTRON_BIN] [PRESET...]`: where a bench step's GPU time
/// goes, beside the PyTorch reference's. Both sides run under Nsight Compute with
/// `--profile-from-start off`, timing every kernel (`gpu__time_duration`, clocks left alone) of
/// PROFILE_ITERS training steps (default 2) after three warm-up steps: Ferrotron through its
/// `--profile` range, benches/torch_gpu_gpt.py through `--profile` (BENCH_TORCH=0 skips it).
/// Prints each side's kernels by total time (PROFILE_TOP rows, default 30), then the time per part
/// of the step (GEMMs, attention, norms, optimizer, …) side by side. ncu runs each kernel alone,
/// so these are kernel times at the clock an idle card holds, not a loaded step's.
fn gpu_profile(args: &[String]) -> anyhow::Result<()> {
    let (bin, presets) = bench_bin_and_presets(args);
    let steps = std::env::var("PROFILE_ITERS").ok().and_then(|v| v.parse().ok()).filter(|&n| n > 0).unwrap_or(2u64);
    let top = std::env::var("PROFILE_TOP").ok().and_then(|v| v.parse().ok()).unwrap_or(30usize);
    let torch = !std::env::var("BENCH_TORCH").is_ok_and(|v| v == "0");
    let ncu = ["ncu", "/usr/local/cuda/bin/ncu"]
        .into_iter()
        .find(|c| Command::new(c).arg("--version").output().is_ok_and(|o| o.status.success()))
        .context("Nsight Compute (ncu) not found on PATH or in /usr/local/cuda/bin")?;
    // Steps before the range: first allocations and GEMM algorithm choices (Ferrotron), the
    // compile (PyTorch).
    const WARM: u64 = 3;
    for p in &presets {
        let shape =
            bench_shape(p).with_context(|| format!("no GPU bench shape for preset {p}: use 124m, 1.3b or llama-1b"))?;
        let mut ours_args = bench_train_args(p, shape.micro, WARM + steps, WARM + steps);
        ours_args.extend(profile_args(WARM, WARM + steps));
        let ours = ncu_kernel_times(ncu, bin.as_os_str(), &ours_args)?;
        print!("{}", xtask::profile::table(&format!("{p} ferrotron, {steps} steps"), &ours, top));
        let theirs = if torch {
            let mut a = torch_args(&shape, shape.micro, 0.0);
            a.extend(multi::owned(&["--warmup", &WARM.to_string(), "--profile", &steps.to_string()]));
            let t = ncu_kernel_times(ncu, std::ffi::OsStr::new("python3"), &a)?;
            print!("{}", xtask::profile::table(&format!("{p} pytorch compile+SDPA, {steps} steps"), &t, top));
            t
        } else {
            Vec::new()
        };
        print!("{}", xtask::profile::compare_table(&ours, &theirs, (steps as f64, steps as f64)));
    }
    Ok(())
}

/// Kernel times of `program args` under ncu, recording only inside the program's CUDA profiler
/// range.
fn ncu_kernel_times(
    ncu: &str,
    program: &std::ffi::OsStr,
    args: &[String],
) -> anyhow::Result<Vec<xtask::profile::KernelTime>> {
    let what = program.to_string_lossy();
    // Inductor's compile workers are processes of their own: ncu is kept out of them, and
    // TORCHINDUCTOR_COMPILE_THREADS=1 keeps the compile in the profiled process.
    let out = Command::new(ncu)
        .args(["--target-processes", "application-only", "--profile-from-start", "off", "--clock-control", "none"])
        .args(["--metrics", "gpu__time_duration.sum", "--csv"])
        .arg(program)
        .args(args)
        .env("TORCHINDUCTOR_COMPILE_THREADS", "1")
        .output()
        .with_context(|| format!("running {ncu} on {what}"))?;
    if !out.status.success() {
        bail!("{ncu} on {what} exited with {}: {}", out.status, String::from_utf8_lossy(&out.stderr));
    }
    xtask::profile::kernel_times(&String::from_utf8_lossy(&out.stdout)).with_context(|| format!("{ncu} on {what}"))
}

/// The ferrotron binary (an explicit first argument, else target/release/ferrotron) and the
/// presets (all three when none is named).
fn bench_bin_and_presets(args: &[String]) -> (PathBuf, Vec<String>) {
    let (bin, presets): (PathBuf, Vec<String>) = match args.first() {
        Some(a) if bench_shape(a).is_none() => (PathBuf::from(a), args[1..].to_vec()),
        _ => (root().join("target/release/ferrotron"), args.to_vec()),
    };
    let presets = if presets.is_empty() { multi::owned(&["124m", "1.3b", "llama-1b"]) } else { presets };
    (bin, presets)
}

/// `cargo xtask bench --attention [ATTENTION_BENCH_BIN]`: flash attention alone (causal, bf16,
/// head dims 64 and 128, 1k–16k tokens; examples/attention_bench, built with `--features cuda`,
/// default target/release/examples/attention_bench) and PyTorch SDPA on the same shapes
/// (benches/torch_sdpa.py; BENCH_TORCH=0 skips it) in one command: both tables as they ran, then
/// one table side by side with the ratios. attention_bench's own variables (ATTN_BENCH_*) pass on;
/// ATTN_BENCH_DROPOUT=P (attention dropout at rate P) and ATTN_BENCH_DIMS (head dims) reach SDPA
/// too (`--dropout P`, `--dims`).
fn attention_bench(args: &[String]) -> anyhow::Result<()> {
    let bin = args.first().map(PathBuf::from).unwrap_or_else(|| root().join("target/release/examples/attention_bench"));
    let out = Command::new(&bin).output().with_context(|| {
        format!(
            "running {} (cargo build --release --features cuda -p ferrotron-examples --example attention_bench)",
            bin.display()
        )
    })?;
    let ours = String::from_utf8_lossy(&out.stdout).to_string();
    print!("{ours}");
    if !out.status.success() {
        bail!("{} failed: {}", bin.display(), String::from_utf8_lossy(&out.stderr));
    }
    let sdpa = if std::env::var("BENCH_TORCH").is_ok_and(|v| v == "0") {
        String::new()
    } else {
        let mut py = Command::new("python3");
        py.arg(root().join("benches/torch_sdpa.py"));
        if let Ok(p) = std::env::var("ATTN_BENCH_DROPOUT") {
            py.args(["--dropout", &p]);
        }
        if let Ok(d) = std::env::var("ATTN_BENCH_DIMS") {
            py.args(["--dims", &d]);
        }
        let py = py.output().context("running python3 benches/torch_sdpa.py")?;
        if !py.status.success() {
            bail!("benches/torch_sdpa.py failed: {}", String::from_utf8_lossy(&py.stderr));
        }
        String::from_utf8_lossy(&py.stdout).to_string()
    };
    print!("{sdpa}\n{}", xtask::attn::merge(&ours, &sdpa));
    Ok(())
}

/// `cargo xtask bench --gpu [FERROTRON_BIN] [PRESET...]`: Ferrotron (bf16) and the PyTorch reference
/// (torch.compile + SDPA, bf16 autocast) on the same GPT in the same command: tokens/s, MFU, peak
/// memory and the ratio. Runs on the GPU machine (no cargo needed there). Environment:
/// BENCH_ITERS (steps, default 300 at 124M and 30 otherwise, rounded up to whole log windows),
/// BENCH_MICRO (micro-batch override),
/// BENCH_CUDA_GRAPH=N (Ferrotron's step replayed as a CUDA graph after N eager steps),
/// BENCH_TORCH=0 (Ferrotron only), BENCH_ATTN_DROPOUT=P (both sides with attention dropout at
/// rate P), BENCH_GRAD_BF16=1 (our main_grad in bf16, `--grad-reduce-in-bf16`), BENCH_MOMENTS_BF16=1
/// (our AdamW moments in bf16, the precision-aware optimizer's), BENCH_LOG_INTERVAL (steps per log line and loss read-back,
/// default 100 at 124M and 10 otherwise, as in Megatron runs; 1 reads the loss every step),
/// BENCH_COOL_C (before each side, wait up to two minutes for the card to cool to this many °C:
/// both sides then start alike), BENCH_ROUNDS
/// (default 1: each side runs that many times per preset, PyTorch first in odd rounds, and the
/// ratio of the means follows the per-round ratios), BENCH_GEMM_TUNE=0 (both sides on their
/// GEMM libraries' heuristics instead of tuned choices, below: ours with FERROTRON_GEMM_TUNE=0,
/// which also leaves stored choices unread).
///
/// GEMM algorithms are tuned on both sides by default, each by its own means: ours timed under
/// sustained load once per shape and stored (`FERROTRON_GEMM_TUNE_HOLD_MS=150`, the choices kept
/// in the kernel cache folder), PyTorch's by TunableOp (`PYTORCH_TUNABLEOP_ENABLED=1`, its results
/// kept in the temp folder). A first run on a machine spends a minute or so on that in its warm-up
/// window. Session 26 on the H200: TunableOp moved PyTorch by +0.1–0.3%, the stored choices ours by
/// +0.4–0.9%. A variable already set in the environment is left as it is.
///
/// Both sides are timed over the same steps: the first log window is warm-up (PyTorch's compile and
/// Ferrotron's first allocations and GEMM algorithm choices fall in it), the rest is timed as total
/// tokens over total time. The card is power-capped (700 W on the H200): under sustained load its
/// clock falls from 1980 to ≈ 1450–1710 MHz within seconds, so a side timed over earlier steps than
/// the other would be measured at a higher clock.
fn gpu_bench(args: &[String]) -> anyhow::Result<()> {
    let (bin, presets) = bench_bin_and_presets(args);
    let every_env = std::env::var("BENCH_LOG_INTERVAL").ok().and_then(|v| v.parse::<u64>().ok()).filter(|&l| l > 0);
    let iters_env = std::env::var("BENCH_ITERS").ok().and_then(|v| v.parse::<u64>().ok());
    let rounds = std::env::var("BENCH_ROUNDS").ok().and_then(|v| v.parse().ok()).filter(|&r| r > 0).unwrap_or(1usize);
    let torch = !std::env::var("BENCH_TORCH").is_ok_and(|v| v == "0");
    let cool = std::env::var("BENCH_COOL_C").ok().and_then(|v| v.parse::<f64>().ok());
    let tuned = !std::env::var("BENCH_GEMM_TUNE").is_ok_and(|v| v == "0");
    println!(
        "| model | implementation | tokens/s | MFU | peak memory GiB | SM clock / power (busy) | last train loss |"
    );
    println!("|---|---|---|---|---|---|---|");
    for p in &presets {
        let shape =
            bench_shape(p).with_context(|| format!("no GPU bench shape for preset {p}: use 124m, 1.3b or llama-1b"))?;
        // BENCH_MICRO overrides the micro-batch (e.g. 1 for a quick look at a slow build).
        let micro = std::env::var("BENCH_MICRO").ok().and_then(|v| v.parse().ok()).unwrap_or(shape.micro);
        let every = every_env.unwrap_or(shape.every);
        // At least two windows, each whole: the first is warm-up on both sides.
        let iters = iters_env.unwrap_or(shape.iters).max(2 * every).div_ceil(every) * every;
        let run = BenchRun { preset: p, bin: &bin, shape: &shape, micro, iters, every, cool, tuned };
        let mut pairs = Vec::new();
        let mut flops = None;
        for round in 0..rounds {
            // Odd rounds run PyTorch first: over an even number of rounds neither side always
            // starts on a card the other has just heated.
            let torch_first = torch && round % 2 == 1;
            let mut t = None;
            if let (true, Some(f)) = (torch_first, flops) {
                t = run.pytorch(f);
            }
            let (o, f) = run.ferrotron()?;
            flops = Some(f);
            if torch && !torch_first {
                t = run.pytorch(f);
            }
            if let Some(t) = t {
                pairs.push((o, t));
                println!("| {p} | ratio ferrotron / pytorch | {:.3} | | | | |", o / t);
            }
        }
        if !torch {
            // The PyTorch half compiles the model first (minutes at 1.3B): skippable when its
            // figure for this card is already in benches/NOTES.md.
            println!("| {p} | pytorch skipped (BENCH_TORCH=0) | | | | | |");
        }
        if let Some(r) = mean_ratio(&pairs).filter(|_| rounds > 1) {
            println!(
                "| {p} | ratio of the means over {rounds} rounds (alternating which side runs first) | {r:.3} | | | | |"
            );
        }
    }
    Ok(())
}

/// mean(ours) / mean(theirs) over the rounds both sides finished, given as (ours, theirs) pairs
/// (None with none).
fn mean_ratio(pairs: &[(f64, f64)]) -> Option<f64> {
    let (o, t) = pairs.iter().fold((0.0, 0.0), |(o, t), &(a, b)| (o + a, t + b));
    (!pairs.is_empty()).then_some(o / t)
}

/// One preset's bench settings: each side's run prints its rows.
struct BenchRun<'a> {
    preset: &'a str,
    bin: &'a std::path::Path,
    shape: &'a BenchShape,
    micro: usize,
    iters: u64,
    every: u64,
    cool: Option<f64>,
    /// GEMM algorithms tuned on both sides (BENCH_GEMM_TUNE, default on).
    tuned: bool,
}

/// `vars` for a child process, each unless the caller's environment sets it.
fn env_unless_set(cmd: &mut Command, vars: &[(&str, String)]) {
    for (k, v) in vars {
        if std::env::var_os(k).is_none() {
            cmd.env(k, v);
        }
    }
}

impl BenchRun<'_> {
    /// Ferrotron's run: (tokens/s over the timed windows, FLOPs a token from its header).
    fn ferrotron(&self) -> anyhow::Result<(f64, f64)> {
        let (p, micro) = (self.preset, self.micro);
        let dir = std::env::temp_dir().join(format!("ferrotron-bench-{p}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        if let Some(c) = self.cool {
            gpuwatch::cool_to(c);
        }
        let mut cmd = Command::new(self.bin);
        cmd.args(bench_train_args(p, micro, self.iters, self.every))
            .arg("--metrics-file")
            .arg(dir.join("metrics.jsonl"))
            .stderr(std::process::Stdio::piped());
        // Untuned: FERROTRON_GEMM_TUNE=0 also leaves choices stored by an earlier run unread.
        let ours = if self.tuned { ("FERROTRON_GEMM_TUNE_HOLD_MS", "150") } else { ("FERROTRON_GEMM_TUNE", "0") };
        env_unless_set(&mut cmd, &[(ours.0, ours.1.into())]);
        let mut child = cmd.spawn().with_context(|| format!("running {}", self.bin.display()))?;
        let reader = read_all(child.stderr.take());
        let gpu = gpuwatch::watch(&mut child, "ferrotron")?;
        let log = reader.join().unwrap_or_default();
        let flops = header_flops_per_token(&log).context("no MFLOP/token in ferrotron's header")?;
        let metrics = std::fs::read_to_string(dir.join("metrics.jsonl"))?;
        let _ = std::fs::remove_dir_all(&dir);
        let ours = multi::steady_rate(&metrics, "tokens_per_s");
        let loss = multi::last_finite_loss(&metrics)
            .map_or_else(|| "not finite: the figure is invalid".to_string(), |l| format!("{l:.3}"));
        // This process's peak in the device's memory pool (the run's --log-memory-to-tensorboard
        // lines), PyTorch's max_allocated's counterpart; nvidia-smi's whole-device figure (every
        // process and context on the card) only where the pool reported nothing.
        let pool = multi::series(&metrics, "mem_max_allocated_bytes").into_iter().fold(0.0, f64::max);
        let memory = if pool > 0.0 {
            format!("{:.1} (pool peak)", pool / (1u64 << 30) as f64)
        } else {
            format!("{:.1} (device total)", gpu.peak_mem_gib)
        };
        // The row says what ran: FP8 products (and their recipe) where BENCH_FP8 asked for them.
        let fp8 = std::env::var("BENCH_FP8").map_or(String::new(), |f| {
            format!(", FP8 {f} {}", std::env::var("BENCH_FP8_RECIPE").unwrap_or_else(|_| "delayed".into()))
        });
        println!(
            "| {p} | ferrotron bf16{fp8}{}{}{} | {ours:.0} | {:.1}% | {memory} | {} | {loss} |",
            if bench_grad_bf16() { ", bf16 main_grad" } else { "" },
            if bench_moments_bf16() { ", bf16 moments" } else { "" },
            if self.tuned { ", GEMMs tuned" } else { "" },
            100.0 * ours * flops / 989e12,
            gpu.clock_power()
        );
        // The host's least queueing time per step against the step: the GPU waits on the host
        // (launch gaps: the case for CUDA graphs) only as the first nears the second.
        let host = multi::series(&metrics, "host_ms_min").get(1..).and_then(|v| v.iter().copied().reduce(f64::min));
        if let Some(h) = host {
            let step_ms = 1e3 * (micro * self.shape.seq) as f64 / ours.max(1e-9);
            println!("| {p} | host queue per step (least) | {h:.1} ms of a {step_ms:.1} ms step | | | | |");
        }
        Ok((ours, flops))
    }

    /// PyTorch's run of the same model (`flops` a token, for its MFU): its tokens/s, or None
    /// (the failure printed as a row).
    fn pytorch(&self, flops: f64) -> Option<f64> {
        let p = self.preset;
        // PyTorch compiles for a while before its first step (the card cools meanwhile); the
        // wait here only brings it down from the run before.
        if let Some(c) = self.cool {
            gpuwatch::cool_to(c);
        }
        let mut cmd = Command::new("python3");
        cmd.args(torch_args(self.shape, self.micro, flops))
            .args(["--warmup", &self.every.to_string(), "--iters", &(self.iters - self.every).to_string()])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        let results = std::env::temp_dir().join("ferrotron-bench-tunableop.csv");
        if self.tuned {
            env_unless_set(
                &mut cmd,
                &[
                    ("PYTORCH_TUNABLEOP_ENABLED", "1".into()),
                    ("PYTORCH_TUNABLEOP_TUNING", "1".into()),
                    ("PYTORCH_TUNABLEOP_FILENAME", results.display().to_string()),
                ],
            );
        }
        let spawned = cmd.spawn();
        let mut py = match spawned {
            Ok(c) => c,
            Err(e) => {
                println!("| {p} | pytorch failed: running python3 benches/torch_gpu_gpt.py: {e} | | | | | |");
                return None;
            }
        };
        let (out, err) = (read_all(py.stdout.take()), read_all(py.stderr.take()));
        let watched = gpuwatch::watch(&mut py, "python3 benches/torch_gpu_gpt.py");
        let (out, err) = (out.join().unwrap_or_default(), err.join().unwrap_or_default());
        let field = |k: &str| {
            out.split(&format!("\"{k}\": "))
                .nth(1)
                .and_then(|r| r.split([',', '}']).next())
                .and_then(|x| x.parse::<f64>().ok())
        };
        match (&watched, field("tokens_per_s"), field("mfu"), field("peak_mem_gib")) {
            (Ok(w), Some(t), Some(m), Some(g)) => {
                let cp = w.clock_power();
                let label = if self.tuned { "pytorch compile+SDPA, TunableOp" } else { "pytorch compile+SDPA" };
                println!("| {p} | {label} | {t:.0} | {:.1}% | {g:.1} (allocated) | {cp} | |", 100.0 * m);
                Some(t)
            }
            _ => {
                println!("| {p} | pytorch failed: {} | | | | | |", err.lines().last().unwrap_or(""));
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mean_ratio_is_the_ratio_of_the_means() {
        assert_eq!(mean_ratio(&[(110.0, 100.0), (130.0, 100.0)]), Some(1.2));
        assert_eq!(mean_ratio(&[(100.0, 80.0), (140.0, 120.0)]), Some(1.2));
        assert_eq!(mean_ratio(&[]), None);
    }

    #[test]
    fn ptxas_report_becomes_rows() {
        let log = "ptxas info    : Compiling entry function 'a' for 'sm_90'\n\
ptxas info    : Function properties for flash_bwd_dkv_mma_bf16_128\n\
    48 bytes stack frame, 52 bytes spill stores, 144 bytes spill loads\n\
ptxas info    : Used 255 registers, used 1 barriers, 48 bytes cumulative stack size\n\
ptxas info    : Function properties for flash_bwd_dq_mma_bf16_64\n\
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
ptxas info    : Used 168 registers, used 1 barriers, 18432 bytes smem\n";
        let rows = ptxas_table(log);
        assert_eq!(
            rows,
            vec![
                ("flash_bwd_dkv_mma_bf16_128".to_string(), 255, 52, 144, 0),
                ("flash_bwd_dq_mma_bf16_64".to_string(), 168, 0, 0, 18432),
            ]
        );
    }

    #[test]
    fn bench_train_args_carry_the_log_interval_and_batch() {
        let a = bench_train_args("124m", 16, 20, 5);
        let arg = |k: &str| a.iter().position(|x| x == k).map(|i| a[i + 1].as_str());
        assert_eq!(arg("--log-interval"), Some("5"));
        assert_eq!(arg("--train-iters"), Some("20"));
        assert_eq!((arg("--micro-batch-size"), arg("--global-batch-size")), (Some("16"), Some("16")));
        assert!(a.iter().any(|x| x == "--log-memory-to-tensorboard"), "the memory column's source");
    }

    #[test]
    fn bench_shapes_are_the_presets_and_the_torch_twin_gets_the_rest() {
        for name in ["124m", "1.3b", "llama-1b"] {
            let s = bench_shape(name).unwrap();
            let c = ferrotron_models::preset(name).unwrap();
            // Whole log windows, the first of them warm-up, at least as many timed steps after it.
            assert!(
                s.iters.is_multiple_of(s.every) && s.iters >= 3 * s.every,
                "{name}: {} steps, windows of {}",
                s.iters,
                s.every
            );
            assert_eq!(
                (s.layers, s.hidden, s.heads, s.seq),
                (c.num_layers, c.hidden_size, c.num_attention_heads, c.seq_length),
                "{name}"
            );
            let arg = |k: &str| s.torch_style.iter().position(|a| *a == k).map(|i| s.torch_style[i + 1]);
            if c.num_query_groups != c.num_attention_heads || c.untie_embeddings_and_output_weights {
                assert_eq!(arg("--style"), Some("llama"), "{name}");
                assert_eq!(arg("--groups"), Some(c.num_query_groups.to_string().as_str()), "{name}");
                assert_eq!(arg("--ffn"), Some(c.ffn_hidden_size.to_string().as_str()), "{name}");
            } else {
                assert!(s.torch_style.is_empty(), "{name}");
            }
        }
        assert!(bench_shape("6.7b").is_none());
    }

    #[test]
    fn cuda_source_follows_the_nvrtc_order() {
        let src = cuda_source().unwrap();
        let at = |needle: &str| src.find(needle).unwrap_or_else(|| panic!("{needle} missing"));
        // Helpers come before their users, as NVRTC compiles them.
        assert!(at("block_sum(") < at("layernorm_fwd_"));
        assert!(at("void mma_bf16(") < at("flash_bwd_dq_mma"));
    }
}
