//! xtask: the project's automation, as a library so that `cargo test` runs the same checks as
//! `cargo xtask tidy`. Only `tidy` lives here; the binary adds the commands that shell out.

pub mod tidy;
