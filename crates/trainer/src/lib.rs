//! ferrotron-trainer: the `ferrotron` program. Parses Megatron's flags (or a TOML file), builds the
//! model from a preset, trains with progress bar and metrics.jsonl, saves and resumes checkpoints,
//! samples text, turns JSON lines into Megatron indexed datasets (`preprocess`), and converts
//! Hugging Face checkpoints to and from its own (`convert`). The only crate
//! that parses flags or prints progress.

pub mod batch_schedule;
pub mod checkpoint;
mod compat;
pub mod convert;
mod convert_megatron;
mod convert_megatron_export;
mod fp8_state;
pub mod generate;
pub mod hybrid;
pub mod launch;
pub mod layer_freq;
pub mod merge;
pub mod multimodal;
pub mod preprocess;
pub mod progress_log;
pub mod settings;
pub mod tensorboard;
pub mod trace;
pub mod train;
