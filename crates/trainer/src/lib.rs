//! ferrotron-trainer: the `ferrotron` program. Parses Megatron's flags (or a TOML file), builds the
//! model from a preset, trains with progress bar and metrics.jsonl, saves and resumes checkpoints,
//! samples text, and turns JSON lines into Megatron indexed datasets (`preprocess`). The only crate
//! that parses flags or prints progress.

pub mod checkpoint;
pub mod generate;
pub mod launch;
pub mod preprocess;
pub mod settings;
pub mod trace;
pub mod train;
