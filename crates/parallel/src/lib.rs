//! ferrotron-parallel: how a model is split over ranks.
//!
//! - `layout`: Megatron's rank layout (order tp-cp-ep-dp-pp, expert grid tp-ep-edp-pp) as pure
//!   arithmetic.
//! - `groups`: `ProcessGroups`, the communicators of one rank for every group kind, built once
//!   from the world and passed explicitly to everything that communicates (no globals).
//! - `tp`: the tensor/sequence-parallel region mappings (Megatron's copy/reduce/gather/scatter),
//!   each a forward and its backward.
//! - `linear`, `embedding`, `cross_entropy`: ColumnParallelLinear, RowParallelLinear,
//!   VocabParallelEmbedding and the vocabulary-parallel cross-entropy, as `Module`s or named
//!   forward/backward pairs over the parameter table.
//! - `context`: context parallelism (the load-balanced sequence split, positions, the core
//!   attention over the whole sequence from K/V gathered over the group); `context_channels`:
//!   the all-to-all between a sequence split and a channel split, for layers that run along the
//!   whole sequence (Mamba's scan); `context_heads`: the core attention by that all-to-all over
//!   the heads instead (`--cp-comm-type a2a`).
//! - `rng`: the RNG tracker (streams shared across tensor-parallel ranks or distinct per rank).
//!
//! Architecture Invariant: parallel knows ranks and groups but not models; the transformer
//! crate above composes these layers. With every group of size 1 the layers do no communication
//! and compute exactly what the unsplit layers compute.

pub mod context;
mod context_channels;
mod context_heads;
pub mod cross_entropy;
pub mod embedding;
pub mod gather;
pub mod groups;
pub mod layout;
pub mod linear;
pub mod pipeline;
pub mod rng;
pub mod tp;

pub use context::{ContextParallel, CpCommType};
pub use cross_entropy::{VocabParallelCe, vocab_parallel_ce_bwd, vocab_parallel_ce_fwd, vocab_parallel_ce_fwd_bwd_};
pub use embedding::VocabParallelEmbedding;
pub use gather::{gather_param, global_flat_index};
pub use groups::ProcessGroups;
pub use layout::{Dim, Grid, Layout};
pub use linear::{ColumnParallelLinear, RowParallelLinear};
pub use rng::{RngStream, RngTracker};
pub use tp::TensorParallel;

#[derive(Debug, thiserror::Error)]
pub enum ParallelError {
    #[error("parallel layout: {0}")]
    Layout(String),
    #[error(transparent)]
    Comm(#[from] ferrotron_comm::CommError),
    #[error(transparent)]
    Core(#[from] ferrotron_core::Error),
}

pub type Result<T, E = ParallelError> = std::result::Result<T, E>;

/// A collective's failure inside a Module (whose errors are core's), kept whole.
pub(crate) fn comm_err(e: ferrotron_comm::CommError) -> ferrotron_core::Error {
    ferrotron_core::Error::External(Box::new(e))
}
