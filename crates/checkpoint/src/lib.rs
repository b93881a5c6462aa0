//! ferrotron-checkpoint: sharded checkpoints that any parallel layout can read.
//!
//! Megatron's `torch_dist` idea in safetensors: at a save every rank writes only what it holds
//! (its tensor-parallel part of each parameter, its distributed-optimizer share of the moments),
//! with no gather, so no rank ever holds more than its own part; each stored run of values says
//! where it lies in the whole tensor (`Piece`). At a load each rank asks for its own parts under
//! its own layout and gets them assembled from whichever files hold them (`ShardReader`), so a
//! run saved under one tensor/pipeline/data-parallel layout resumes under another.
//!
//! The crate knows files and index arithmetic only: which tensors a rank writes, the folder
//! layout, state.toml and the collectives that agree on a save are the trainer's. It also decodes
//! the block-scaled FP8 weights some published models ship (`fp8`) and reads Megatron-LM's own
//! checkpoints (`megatron`: torch_dist and the legacy torch format), for the trainer's imports.

mod codec;
pub mod fp8;
pub mod megatron;
mod piece;
mod read;
mod write;

pub use codec::{decode, encode};
pub use piece::{Piece, Split};
pub use read::ShardReader;
pub use write::{ShardEntry, sha256_file, sha256_hex, write_shard};

use std::path::PathBuf;

/// The `format` value in every shard file's safetensors metadata.
pub const SHARD_FORMAT: &str = "ferrotron-shard-1";

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: corrupt checkpoint shard: {what}")]
    Corrupt { path: PathBuf, what: String },
    #[error("{path}: corrupt checkpoint: SHA-256 {found} does not match {recorded} recorded in state.toml")]
    Checksum { path: PathBuf, found: String, recorded: String },
    #[error("the checkpoint has no `{0}`: the model flags differ from the saved run")]
    Missing(String),
    #[error(
        "checkpoint tensor `{key}` is {saved:?} but the model's is {want:?}: the model flags differ from the saved run"
    )]
    Shape { key: String, saved: Vec<usize>, want: Vec<usize> },
    #[error(
        "no saved piece holds element {index} of `{key}`: the checkpoint is incomplete (a shard file missing from state.toml?)"
    )]
    Incomplete { key: String, index: usize },
    #[error("`{key}`: {why}")]
    BadPiece { key: String, why: String },
    #[error("`{key}`: {dtype} values cannot be stored (f32, bf16 and f16 can)")]
    Dtype { key: String, dtype: String },
}

pub type Result<T> = std::result::Result<T, CheckpointError>;

pub(crate) fn io(path: &std::path::Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io { path: path.to_path_buf(), source }
}
