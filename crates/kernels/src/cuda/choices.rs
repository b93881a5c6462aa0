//! GEMM algorithm choices timed under sustained load (`FERROTRON_GEMM_TUNE_HOLD_MS`, tune.rs),
//! kept on disk so that later runs on the same GPU model and cuBLASLt take them without timing
//! (the timing costs 15–50 s at a start; session 21 measured the choices +1.0% at 124M).
//!
//! One file per GPU name and cuBLASLt version, `$FERROTRON_CACHE_DIR/gemm/<tag>.txt` (else
//! `~/.cache/ferrotron/gemm`), one line per problem: the chosen algorithm's place in the
//! heuristic's list, a tab, the problem as `lt` keys it. Lines that do not parse are skipped, so
//! a damaged file costs the choices it loses and nothing else; a later timing appends anew.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

pub(crate) struct Choices {
    file: Option<PathBuf>,
    map: HashMap<String, usize>,
}

impl Choices {
    /// The choices stored for `tag` under `dir` (none when there is no file or folder).
    pub(crate) fn load(dir: Option<&Path>, tag: &str) -> Choices {
        let file = dir.map(|d| d.join(format!("{}.txt", file_tag(tag))));
        let map = file.as_ref().and_then(|f| std::fs::read_to_string(f).ok()).map(|t| parse(&t)).unwrap_or_default();
        Choices { file, map }
    }

    /// The place in the heuristic's list chosen for `problem`, if stored.
    pub(crate) fn get(&self, problem: &str) -> Option<usize> {
        self.map.get(problem).copied()
    }

    /// Records a choice and appends it to the file (best effort: a folder that cannot be
    /// written keeps the choice for this process only).
    pub(crate) fn put(&mut self, problem: &str, index: usize) {
        if problem.contains(['\n', '\t']) {
            return;
        }
        self.map.insert(problem.to_string(), index);
        let Some(f) = &self.file else { return };
        if let Some(d) = f.parent() {
            let _ = std::fs::create_dir_all(d);
        }
        if let Ok(mut out) = std::fs::OpenOptions::new().create(true).append(true).open(f) {
            let _ = writeln!(out, "{index}\t{problem}");
        }
    }
}

/// The cache folder's `gemm` subfolder.
pub(crate) fn dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("FERROTRON_CACHE_DIR") {
        return Some(PathBuf::from(d).join("gemm"));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/ferrotron/gemm"))
}

/// A file name from a GPU name and library version: letters, digits, dots and dashes only.
fn file_tag(tag: &str) -> String {
    tag.chars().map(|c| if c.is_ascii_alphanumeric() || c == '.' { c } else { '-' }).collect()
}

/// Later lines win, as `put` appends.
fn parse(text: &str) -> HashMap<String, usize> {
    text.lines()
        .filter_map(|l| {
            let (i, p) = l.split_once('\t')?;
            Some((p.to_string(), i.trim().parse().ok()?))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choices_survive_a_reload_and_damaged_lines_are_skipped() {
        let dir = std::env::temp_dir().join(format!("ferrotron-gemm-choices-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let tag = "NVIDIA H200 / cuBLASLt 130000";
        let mut c = Choices::load(Some(&dir), tag);
        assert_eq!(c.get("Key { m: 1 }"), None);
        c.put("Key { m: 1 }", 3);
        c.put("Key { m: 2 }", 0);
        c.put("Key { m: 1 }", 5);
        c.put("bad\tproblem", 1);
        let file = dir.join("NVIDIA-H200---cuBLASLt-130000.txt");
        let mut text = std::fs::read_to_string(&file).unwrap();
        text.push_str("not a number\tKey { m: 3 }\nno tab at all\n");
        std::fs::write(&file, text).unwrap();
        let again = Choices::load(Some(&dir), tag);
        assert_eq!(again.get("Key { m: 1 }"), Some(5), "the later line wins");
        assert_eq!(again.get("Key { m: 2 }"), Some(0));
        assert_eq!((again.get("Key { m: 3 }"), again.get("bad\tproblem")), (None, None));
        assert_eq!(Choices::load(Some(&dir), "another GPU").get("Key { m: 1 }"), None);
        assert_eq!(Choices::load(None, tag).get("Key { m: 1 }"), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
