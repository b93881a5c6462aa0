//! xtask: the project's automation, as a library so that `cargo test` runs the same checks as
//! `cargo xtask tidy`. `tidy` and the pure halves of `bench --attention` (both tables side by
//! side), `bench --gpu-profile` (ncu's CSV to a table), `trace` (Chrome traces to step timelines)
//! and `sass-diff` (two SASS listings compared per kernel) live here; the binary adds the commands
//! that shell out.

pub mod attn;
pub mod profile;
pub mod sass;
pub mod tidy;
pub mod trace;
