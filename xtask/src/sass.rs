//! Which kernels a change to kernels/ touched, to the machine instruction: the per-function SASS
//! of two cubins (`cuobjdump -sass`) compared (`cargo xtask sass-diff REV`). A refactor that
//! should leave the generated code alone shows no kernel changed; a tuning change shows which
//! builds it reached and how their instruction counts moved.

use std::collections::BTreeMap;

/// Each function's instruction lines in a `cuobjdump -sass` listing, by name: the address comment
/// that starts a line (`/*0a40*/`) dropped, the rest (the instruction and its encoding words)
/// kept, so two functions compare equal only if their machine code is the same.
pub fn functions(dump: &str) -> BTreeMap<String, Vec<String>> {
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in dump.lines() {
        let t = line.trim();
        if let Some(name) = t.strip_prefix("Function : ") {
            current = Some(name.trim().to_string());
            out.entry(name.trim().to_string()).or_default();
            continue;
        }
        let Some(name) = &current else { continue };
        // Instruction lines start with their address comment; encoding continuations with `/* 0x`.
        let body = match t.strip_prefix("/*") {
            Some(rest) if rest.starts_with(|c: char| c.is_ascii_hexdigit()) => {
                rest.split_once("*/").map_or(t, |(_, after)| after.trim())
            }
            Some(_) => t,
            None => continue,
        };
        if let Some(v) = out.get_mut(name) {
            v.push(body.to_string());
        }
    }
    out
}

/// How two listings' functions compare.
#[derive(Debug, Default, PartialEq)]
pub struct Diff {
    /// Only in the old listing.
    pub removed: Vec<String>,
    /// Only in the new one.
    pub added: Vec<String>,
    /// In both with different code: (name, old instructions, new instructions).
    pub changed: Vec<(String, usize, usize)>,
    /// In both, the same code.
    pub same: usize,
}

/// Instructions of a function (lines with an address; not encoding continuations).
fn instructions(lines: &[String]) -> usize {
    lines.iter().filter(|l| !l.starts_with("/*")).count()
}

pub fn diff(old: &BTreeMap<String, Vec<String>>, new: &BTreeMap<String, Vec<String>>) -> Diff {
    let mut d = Diff::default();
    for (name, code) in old {
        match new.get(name) {
            None => d.removed.push(name.clone()),
            Some(n) if n == code => d.same += 1,
            Some(n) => d.changed.push((name.clone(), instructions(code), instructions(n))),
        }
    }
    d.added = new.keys().filter(|k| !old.contains_key(*k)).cloned().collect();
    d
}

#[cfg(test)]
mod tests {
    use super::*;

    const OLD: &str = "
\tcode for sm_90a
\t\tFunction : add_f32
\t.headerflags\t@\"EF_CUDA_SM90\"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                /* 0x00000a00ff017b82 */
                                                                         /* 0x000fe40000000f00 */
        /*0010*/                   EXIT ;                                /* 0x000000000000794d */
                                                                         /* 0x000fea0003800000 */
\t\tFunction : scale_f32
        /*0000*/                   FMUL R0, R2, R3 ;                     /* 0x0000000302007220 */
                                                                         /* 0x000fe40000400000 */
\t\tFunction : gone
        /*0000*/                   EXIT ;                                /* 0x000000000000794d */
";

    #[test]
    fn functions_keep_code_and_drop_addresses() {
        let f = functions(OLD);
        assert_eq!(f.keys().collect::<Vec<_>>(), ["add_f32", "gone", "scale_f32"]);
        assert_eq!(f["add_f32"].len(), 4, "two instructions, two encoding continuations");
        assert!(f["add_f32"][0].starts_with("LDC R1"), "{:?}", f["add_f32"][0]);
        assert_eq!(instructions(&f["add_f32"]), 2);
    }

    #[test]
    fn moved_code_is_the_same_changed_code_is_not() {
        // add_f32 at other addresses (same code), scale_f32 with one more instruction, `gone`
        // removed, `fresh` added.
        let new = OLD
            .replace("/*0010*/", "/*0020*/")
            .replace(
                "FMUL R0, R2, R3 ;                     /* 0x0000000302007220 */",
                "FMUL R0, R2, R3 ;                     /* 0x0000000302007220 */\n        /*0010*/ FADD R0, R0, R0 ; /* 0x0000000000007221 */",
            )
            .replace("Function : gone", "Function : fresh");
        let d = diff(&functions(OLD), &functions(&new));
        assert_eq!(d.same, 1, "{d:?}");
        assert_eq!(d.changed, [("scale_f32".to_string(), 1, 2)]);
        assert_eq!(d.removed, ["gone"]);
        assert_eq!(d.added, ["fresh"]);
    }
}
