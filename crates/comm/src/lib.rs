//! ferrotron-comm: how ranks talk.
//!
//! `DistEnv` reads who this process is from the launcher's environment (torchrun / `ferrotron
//! launch`: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT; SLURM_*; OMPI_*). `rendezvous`
//! is the TCP store at MASTER_ADDR:MASTER_PORT through which rank 0 hands every rank the same bytes
//! (NCCL's unique id), with a timeout that names the ranks that never arrived. `Communicator` is the
//! collective interface; `NcclComm` (feature `cuda`) implements it for one process per GPU.
//! The thread and TCP backends, sub-groups and the remaining collectives join with the
//! tensor/data-parallel work.
//!
//! Architecture Invariant: comm knows nothing of models; it moves tensors.

mod env;
#[cfg(feature = "cuda")]
mod nccl;
mod store;

pub use env::DistEnv;
#[cfg(feature = "cuda")]
pub use nccl::NcclComm;
pub use store::rendezvous;

use ferrotron_core::Tensor;
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum CommError {
    #[error("launcher environment: {0}")]
    Env(String),
    #[error("rendezvous at {addr}: {msg}")]
    Rendezvous { addr: String, msg: String },
    #[error("{op} on group of {size}: timed out after {timeout:?} waiting for rank(s) {missing:?}")]
    Timeout { op: &'static str, size: usize, timeout: Duration, missing: Vec<usize> },
    #[error("NCCL {op}: {msg}")]
    Nccl { op: &'static str, msg: String },
    #[error(transparent)]
    Core(#[from] ferrotron_core::Error),
}

pub type Result<T, E = CommError> = std::result::Result<T, E>;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    Avg,
    Max,
    Min,
}

/// Collectives over one group of ranks. Every rank of the group calls each operation in the same
/// order; results are identical on every rank.
pub trait Communicator: Send + Sync {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// In place: every rank ends with the reduction of all ranks' `t`.
    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<()>;
    /// In place: every rank ends with `root`'s `t`.
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<()>;
}
