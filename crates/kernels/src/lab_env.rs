//! The lab switches read from the environment (`FERROTRON_*`: kernel choices kept for experiments
//! and A/B measurements, documented where each is read). Each is read once, where it is used, and
//! an unrecognised value there means the default; so every one that is set is checked here when
//! the first CUDA backend starts, and a value the code would not recognise
//! (`FERROTRON_OWN_GEMM_BUILD=n265`) stops the run with the accepted values instead of
//! silently measuring the default. Variables of other names are left alone.

use ferrotron_core::{Error, Result};

/// What a switch accepts.
enum Accepts {
    /// One of these words.
    Words(&'static [&'static str]),
    /// A whole number from the first to the second, both included.
    Whole(u64, u64),
    /// A number above zero.
    Positive,
}

const OFF_ON: Accepts = Accepts::Words(&["0", "1"]);

/// `FERROTRON_OWN_GEMM_BUILD`'s words, in `cuda::OwnGemmBuild::ALL`'s order: its parser reads
/// them from here, and the two lists' lengths are checked equal at compile time.
pub(crate) const OWN_GEMM_BUILDS: &[&str] = &["pingpong", "c2", "m256", "n256", "n256c2"];

/// Every switch the kernels and the trainer read, with what it accepts.
const SWITCHES: &[(&str, Accepts)] = &[
    ("FERROTRON_FLASH_FWD", Accepts::Words(&["ws", "ws64", "ws128", "wg"])),
    ("FERROTRON_FLASH_BWD", Accepts::Words(&["ws", "wg"])),
    ("FERROTRON_FLASH_PERSIST", OFF_ON),
    ("FERROTRON_FLASH_DYN", OFF_ON),
    ("FERROTRON_FLASH_BWD_DYN", OFF_ON),
    ("FERROTRON_FLASH_TMA", OFF_ON),
    ("FERROTRON_FLASH_BIAS_GRAD", OFF_ON),
    ("FERROTRON_FLASH_FWD_CONSUMERS", Accepts::Words(&["2", "3"])),
    ("FERROTRON_FLASH_GROUP_MB", Accepts::Whole(1, u64::MAX)),
    ("FERROTRON_FLASH_WG", Accepts::Whole(1, u64::MAX)),
    ("FERROTRON_NORM_FUSED", OFF_ON),
    ("FERROTRON_NORM_BWD", Accepts::Words(&["v5", "v6", "v6np"])),
    ("FERROTRON_CE_KEEP", OFF_ON),
    ("FERROTRON_FP8_CAST", Accepts::Words(&["32", "64"])),
    ("FERROTRON_PDL", OFF_ON),
    ("FERROTRON_OWN_GEMM", OFF_ON),
    ("FERROTRON_OWN_GEMM_PLAIN", OFF_ON),
    ("FERROTRON_OWN_GEMM_BUILD", Accepts::Words(OWN_GEMM_BUILDS)),
    ("FERROTRON_GEMM_TUNE", OFF_ON),
    ("FERROTRON_GEMM_TUNE_REPORT", OFF_ON),
    ("FERROTRON_GEMM_TUNE_HOLD_MS", Accepts::Positive),
    ("FERROTRON_GEMM_CANDIDATES", Accepts::Whole(1, 64)),
    ("FERROTRON_GEMM_WORKSPACE_MB", Accepts::Whole(0, u64::MAX)),
    ("FERROTRON_SSD_SCAN", Accepts::Words(&["chunked", "steps"])),
    ("FERROTRON_SSD_TC", OFF_ON),
    ("FERROTRON_SSD_THREADS", Accepts::Words(&["128", "256", "384", "512", "640", "768", "896", "1024"])),
];

/// Checks every switch set in this process's environment.
pub fn check_lab_switches() -> Result<()> {
    check_with(|name| std::env::var(name).ok())
}

/// Checks the switches `get` returns a value for.
fn check_with(get: impl Fn(&str) -> Option<String>) -> Result<()> {
    for (name, accepts) in SWITCHES {
        let Some(v) = get(name) else { continue };
        let ok = match accepts {
            Accepts::Words(w) => w.contains(&v.as_str()),
            Accepts::Whole(lo, hi) => v.parse::<u64>().is_ok_and(|n| (*lo..=*hi).contains(&n)),
            Accepts::Positive => v.parse::<f64>().is_ok_and(|x| x > 0.0 && x.is_finite()),
        };
        if !ok {
            let want = match accepts {
                Accepts::Words(w) => format!("one of {}", w.join(", ")),
                Accepts::Whole(lo, u64::MAX) => format!("a whole number of at least {lo}"),
                Accepts::Whole(lo, hi) => format!("a whole number from {lo} to {hi}"),
                Accepts::Positive => "a number above zero".into(),
            };
            return Err(Error::InvalidArgument {
                op: "environment",
                msg: format!("{name}={v} is not a value this switch takes: set it to {want}, or unset it"),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(vars: &[(&str, &str)]) -> Result<()> {
        check_with(|n| vars.iter().find(|(k, _)| *k == n).map(|(_, v)| v.to_string()))
    }

    #[test]
    fn known_values_pass_and_typos_name_the_switch_and_its_values() {
        check(&[]).unwrap();
        check(&[("FERROTRON_OWN_GEMM_BUILD", "n256"), ("FERROTRON_FLASH_DYN", "0"), ("FERROTRON_OTHER", "x")]).unwrap();
        check(&[("FERROTRON_GEMM_TUNE_HOLD_MS", "150"), ("FERROTRON_GEMM_WORKSPACE_MB", "0")]).unwrap();
        let e = check(&[("FERROTRON_OWN_GEMM_BUILD", "n265")]).unwrap_err().to_string();
        assert!(e.contains("FERROTRON_OWN_GEMM_BUILD=n265") && e.contains("pingpong, c2, m256, n256"), "{e}");
        let e = check(&[("FERROTRON_FLASH_TMA", "off")]).unwrap_err().to_string();
        assert!(e.contains("one of 0, 1"), "{e}");
        let e = check(&[("FERROTRON_GEMM_TUNE_HOLD_MS", "-3")]).unwrap_err().to_string();
        assert!(e.contains("above zero"), "{e}");
        let e = check(&[("FERROTRON_FLASH_GROUP_MB", "0")]).unwrap_err().to_string();
        assert!(e.contains("at least 1"), "{e}");
        check(&[("FERROTRON_GEMM_CANDIDATES", "64")]).unwrap();
        let e = check(&[("FERROTRON_GEMM_CANDIDATES", "65")]).unwrap_err().to_string();
        assert!(e.contains("from 1 to 64"), "{e}");
    }

    /// Every switch read in the kernels' CUDA code (`std::env::var("FERROTRON_…")` there) has an
    /// entry here, so a new switch cannot skip the check.
    #[test]
    fn every_switch_read_by_the_cuda_code_is_listed() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/cuda");
        let mut files = vec![];
        for d in [dir.clone(), dir.join("ops")] {
            for e in std::fs::read_dir(d).unwrap() {
                let p = e.unwrap().path();
                if p.extension().is_some_and(|x| x == "rs") {
                    files.push(p);
                }
            }
        }
        let mut seen = 0;
        for f in files {
            let src = std::fs::read_to_string(&f).unwrap();
            for part in src.split("\"FERROTRON_").skip(1) {
                let name = format!("FERROTRON_{}", part.split('"').next().unwrap());
                if name == "FERROTRON_CACHE_DIR" {
                    continue; // a folder, not a switch
                }
                seen += 1;
                assert!(SWITCHES.iter().any(|(n, _)| *n == name), "{name} (read in {}) is not checked", f.display());
            }
        }
        assert!(seen >= 15, "found only {seen} switches: has the source moved?");
    }
}
