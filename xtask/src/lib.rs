//! xtask: the project's automation, as a library so that `cargo test` runs the same checks as
//! `cargo xtask tidy`. `tidy`, the pure half of `bench --gpu-profile` (ncu's CSV to a table) and
//! of `trace` (Chrome traces to step timelines) live here; the binary adds the commands that shell out.

pub mod profile;
pub mod tidy;
pub mod trace;
