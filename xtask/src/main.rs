//! `cargo xtask <command>`: tidy (layering and house rules), bench (criterion CPU benches),
//! ptx (compile kernels/ with nvcc ahead of time) and gpu-test (build the CUDA test binaries and run
//! them where a GPU is, or stage them for a GPU machine).

use anyhow::{Context, bail};
use std::path::PathBuf;
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().map(PathBuf::from).unwrap_or_default()
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
        Some("bench") => {
            let status = Command::new(env!("CARGO"))
                .current_dir(root())
                .args(["bench", "-p", "ferrotron-kernels", "--bench", "cpu_kernels", "--"])
                .args(&args[1..])
                .status()
                .context("running cargo bench")?;
            if !status.success() {
                bail!("cargo bench failed");
            }
            Ok(())
        }
        Some("ptx") => ptx(args.get(1).map(String::as_str).unwrap_or("sm_90")),
        Some("gpu-test") => gpu_test(args.get(1).map(PathBuf::from)),
        _ => {
            eprintln!("usage: cargo xtask tidy | bench [criterion args] | ptx [sm_XX] | gpu-test [STAGE_DIR]");
            bail!("unknown command {:?}", args.first());
        }
    }
}

/// The CUDA sources as one translation unit, common header first (the order NVRTC sees them in).
fn cuda_source() -> anyhow::Result<String> {
    let dir = root().join("kernels");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .collect();
    files.sort();
    let mut src = std::fs::read_to_string(dir.join("common.cuh"))?;
    for f in files {
        src.push_str(&std::fs::read_to_string(&f)?);
    }
    Ok(src)
}

/// Compiles kernels/ with nvcc for `arch`: a check that the sources build ahead of time.
fn ptx(arch: &str) -> anyhow::Result<()> {
    let out = root().join("target/ptx");
    std::fs::create_dir_all(&out)?;
    let cu = out.join("ferrotron_kernels.cu");
    std::fs::write(&cu, cuda_source()?)?;
    let ptx = out.join(format!("ferrotron_kernels.{arch}.ptx"));
    let status = Command::new("nvcc")
        .args(["--ptx", &format!("-arch={arch}"), "-std=c++17", "-o"])
        .arg(&ptx)
        .arg(&cu)
        .status()
        .context("nvcc not found: install the CUDA toolkit or put nvcc on PATH")?;
    if !status.success() {
        bail!("nvcc failed on kernels/ for {arch}");
    }
    println!("ptx: {}", ptx.display());
    Ok(())
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
            for b in &bins {
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
