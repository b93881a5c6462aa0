//! ferrotron-trainer: the `ferrotron` program. Parses Megatron's flags (or a TOML file), builds the
//! model from a preset, trains with progress bar and metrics.jsonl, saves and resumes checkpoints,
//! and samples text. The only crate that reads user files, parses flags or prints progress.

pub mod checkpoint;
pub mod generate;
pub mod launch;
pub mod settings;
pub mod trace;
pub mod train;
