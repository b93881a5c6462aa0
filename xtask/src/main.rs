//! `cargo xtask <command>`: tidy (layering and house rules) and bench (criterion CPU benches).

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
        _ => {
            eprintln!("usage: cargo xtask tidy | bench [criterion args]");
            bail!("unknown command {:?}", args.first());
        }
    }
}
