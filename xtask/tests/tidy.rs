//! Tidy on the real workspace (must be clean) and on a fixture with one violation of each kind.

use std::path::Path;

fn messages(root: &Path) -> Vec<String> {
    xtask::tidy::check(root).expect("tidy runs").into_iter().map(|v| v.0).collect()
}

#[test]
fn workspace_is_tidy() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root");
    let v = messages(root);
    assert!(v.is_empty(), "tidy violations:\n{}", v.join("\n"));
}

#[test]
fn fixture_violations_are_each_reported() {
    let v = messages(&Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/bad"));
    let has = |needle: &str| v.iter().any(|m| m.contains(needle));
    assert!(has("`ferrotron-core` may not depend on `ferrotron-trainer`"), "{v:#?}");
    assert!(has("crate `ferrotron-widgets` has no place in the layering table"), "{v:#?}");
    assert!(has("kernels/src/lib.rs: crate root must start with a `//!` header"), "{v:#?}");
    assert!(has("ignored test"), "{v:#?}");
    // kernels → core in dev-dependencies is allowed; nothing else is reported.
    assert_eq!(v.len(), 4, "{v:#?}");
}
