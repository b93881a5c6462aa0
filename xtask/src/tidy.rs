//! Tidy: the layering rule and house rules, checked on every Cargo.toml and source file.
//!
//! The allowed internal dependency edges are written once, in `ALLOWED` below (ARCHITECTURE.md
//! copies the picture). A crate may depend only on crates listed for it; a crate missing from the
//! table is itself a violation, so new crates must take a place in the order.

use std::path::{Path, PathBuf};

/// Short crate name (without `ferrotron-`) → the internal crates it may depend on.
pub const ALLOWED: &[(&str, &[&str])] = &[
    ("core", &[]),
    ("kernels", &["core"]),
    ("comm", &["core", "kernels"]),
    ("parallel", &["core", "kernels", "comm"]),
    ("transformer", &["core", "kernels", "comm", "parallel"]),
    ("moe", &["core", "kernels", "comm", "parallel", "transformer"]),
    ("ssm", &["core", "kernels", "comm", "parallel", "transformer"]),
    ("models", &["core", "kernels", "comm", "parallel", "transformer", "moe", "ssm"]),
    ("data", &["core"]),
    ("optim", &["core", "kernels", "comm", "parallel", "transformer"]),
    ("checkpoint", &["core", "kernels", "comm", "parallel"]),
    ("trainer", &["*"]),
    ("examples", &["*"]),
];

const PREFIX: &str = "ferrotron-";

#[derive(Debug)]
pub struct Violation(pub String);

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Checks the workspace at `root`. Errors are I/O or parse failures; rule breaks are violations.
pub fn check(root: &Path) -> anyhow::Result<Vec<Violation>> {
    let mut out = Vec::new();
    let mut manifests = Vec::new();
    let crates = root.join("crates");
    if crates.is_dir() {
        for e in std::fs::read_dir(&crates)? {
            let p = e?.path().join("Cargo.toml");
            if p.is_file() {
                manifests.push(p);
            }
        }
    }
    let examples = root.join("examples/Cargo.toml");
    if examples.is_file() {
        manifests.push(examples);
    }
    manifests.sort();
    for m in &manifests {
        check_manifest(m, &mut out)?;
    }
    for m in manifests.iter().chain(std::iter::once(&root.join("xtask/Cargo.toml"))) {
        if m.is_file() {
            check_header(m.parent().unwrap_or(root), &mut out)?;
        }
    }
    let mut files = Vec::new();
    for dir in ["crates", "xtask", "examples"] {
        rust_files(&root.join(dir), &mut files)?;
    }
    let needle = concat!("#[", "ignore");
    for f in files {
        let text = std::fs::read_to_string(&f)?;
        if text.contains(needle) {
            out.push(Violation(format!("{}: ignored test: fix or delete it; `{needle}]` hides failures", f.display())));
        }
    }
    Ok(out)
}

fn check_manifest(path: &Path, out: &mut Vec<Violation>) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(path)?;
    let doc: toml::Table = text.parse().map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    let Some(name) = doc.get("package").and_then(|p| p.get("name")).and_then(|n| n.as_str()) else {
        out.push(Violation(format!("{}: no [package] name", path.display())));
        return Ok(());
    };
    let short = name.strip_prefix(PREFIX).unwrap_or(name);
    let Some((_, allowed)) = ALLOWED.iter().find(|(n, _)| *n == short) else {
        out.push(Violation(format!(
            "{}: crate `{name}` has no place in the layering table; add it to ALLOWED in xtask/src/tidy.rs and ARCHITECTURE.md",
            path.display()
        )));
        return Ok(());
    };
    for section in ["dependencies", "dev-dependencies", "build-dependencies"] {
        let Some(deps) = doc.get(section).and_then(|d| d.as_table()) else { continue };
        for dep in deps.keys() {
            let Some(dshort) = dep.strip_prefix(PREFIX) else { continue };
            if !allowed.contains(&"*") && !allowed.contains(&dshort) {
                out.push(Violation(format!(
                    "{}: `{name}` may not depend on `{dep}` ([{section}]): dependencies point one way, see ARCHITECTURE.md",
                    path.display()
                )));
            }
        }
    }
    Ok(())
}

fn check_header(crate_dir: &Path, out: &mut Vec<Violation>) -> anyhow::Result<()> {
    for root in ["src/lib.rs", "src/main.rs"] {
        let p = crate_dir.join(root);
        if p.is_file() {
            let text = std::fs::read_to_string(&p)?;
            if !text.trim_start().starts_with("//!") {
                out.push(Violation(format!(
                    "{}: crate root must start with a `//!` header saying what the crate is for and why",
                    p.display()
                )));
            }
            return Ok(());
        }
    }
    Ok(())
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) -> anyhow::Result<()> {
    if !dir.is_dir() {
        return Ok(());
    }
    for e in std::fs::read_dir(dir)? {
        let p = e?.path();
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if p.is_dir() {
            // Fixtures hold deliberate violations for tidy's own tests.
            if name != "target" && name != "fixtures" {
                rust_files(&p, out)?;
            }
        } else if name.ends_with(".rs") {
            out.push(p);
        }
    }
    Ok(())
}
