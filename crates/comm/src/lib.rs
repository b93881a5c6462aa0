//! ferrotron-comm: how ranks talk.
//!
//! `DistEnv` reads who this process is from the launcher's environment (torchrun / `ferrotron
//! launch`: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT; SLURM_*; OMPI_*). `rendezvous`
//! is the TCP store at MASTER_ADDR:MASTER_PORT through which rank 0 hands every rank the same bytes
//! (NCCL's unique id), with a timeout that names the ranks that never arrived. `Communicator` is the
//! collective interface; `NcclComm` (feature `cuda`) implements it for one process per GPU.
//! `thread_world` (N ranks as threads of one process) and `tcp_world` (CPU processes, a TCP mesh
//! set up through the same rendezvous) share one implementation of every collective (`MeshComm`)
//! over point-to-point messages: each rank receives every contribution and reduces them itself in
//! rank order, so all ranks get the same bits. Slow for big tensors, simple to prove right.
//!
//! Architecture Invariant: comm knows nothing of models; it moves tensors.

mod env;
mod mesh;
#[cfg(feature = "cuda")]
mod nccl;
mod store;
mod tcp;
mod threads;
mod transport;
mod watchdog;

pub use env::DistEnv;
pub use mesh::MeshComm;
#[cfg(feature = "cuda")]
pub use nccl::NcclComm;
pub use store::{rendezvous, rendezvous_all};
pub use tcp::tcp_world;
pub use threads::{PEER_LEFT, all_ok, run_ranks, thread_world};
pub use watchdog::Watchdog;

use ferrotron_core::Tensor;
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum CommError {
    #[error("launcher environment: {0}")]
    Env(String),
    #[error("rendezvous at {addr}: {msg}")]
    Rendezvous { addr: String, msg: String },
    #[error(
        "{op} on group {group}: timed out after {timeout:?} waiting for world rank(s) {missing:?} (a rank skipped or is stuck before this collective)"
    )]
    Timeout { op: &'static str, group: String, timeout: Duration, missing: Vec<usize> },
    #[error(
        "{op} on group {group}: world rank {peer} called {peer_op} instead (ranks disagree on the order of collectives)"
    )]
    Mismatch { op: &'static str, group: String, peer: usize, peer_op: String },
    #[error("{op} on group {group}: the connection to world rank {peer} failed: {msg}")]
    Link { op: &'static str, group: String, peer: usize, msg: String },
    #[error("{op} on group {group}: {msg}")]
    Invalid { op: &'static str, group: String, msg: String },
    #[error("NCCL {op}: {msg}")]
    Nccl { op: &'static str, msg: String },
    #[error(
        "{op} on group {group} did not complete within {timeout:?} (a rank skipped it or is stuck; NCCL cannot say which): the communicators were aborted"
    )]
    Stuck { op: &'static str, group: String, timeout: Duration },
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
/// order; reductions give the same bits on every rank. Tensors are contiguous; "rows" means the
/// first dimension. Every operation gives up after the group's timeout with an error naming the
/// group, the operation and the ranks that did not arrive.
pub trait Communicator: Send + Sync {
    /// This rank's index in the group.
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// The group's name and world ranks, e.g. `tp[2, 3]` (for errors and layout tables).
    fn name(&self) -> &str;
    /// In place: every rank ends with the reduction of all ranks' `t`.
    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<()>;
    /// `input` holds `size` equal chunks; rank r gets the reduction of every rank's chunk r in
    /// `output`.
    fn reduce_scatter(&self, input: &Tensor, output: &Tensor, op: ReduceOp) -> Result<()>;
    /// `output` (size × `input`'s elements) gets every rank's `input`, in rank order.
    fn all_gather(&self, input: &Tensor, output: &Tensor) -> Result<()>;
    /// Uneven gather along rows: rank r contributes `counts[r]` rows; returns all rows in rank order.
    fn all_gather_v(&self, input: &Tensor, counts: &[usize]) -> Result<Tensor>;
    /// In place: every rank ends with `root`'s `t`.
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<()>;
    fn send(&self, t: &Tensor, dst: usize) -> Result<()>;
    /// Fills `t` with what `src` sent (same element count and dtype).
    fn recv(&self, t: &Tensor, src: usize) -> Result<()>;
    /// Rows `send_counts[r]`-sized slices of `input` go to rank r; returns the rows received, in
    /// source-rank order, `recv_counts[r]` from rank r (uneven counts allowed, as MoE needs).
    fn all_to_all_v(&self, input: &Tensor, send_counts: &[usize], recv_counts: &[usize]) -> Result<Tensor>;
    fn barrier(&self) -> Result<()>;
    /// `all_reduce` that later device work need not wait for, until [`Communicator::wait_async`]
    /// (NCCL: enqueued on this communicator's stream, the compute stream left running; gradient
    /// buckets reduced while the backward goes on). Host backends run it at once.
    fn all_reduce_async(&self, t: &Tensor, op: ReduceOp) -> Result<()> {
        self.all_reduce(t, op)
    }
    /// `reduce_scatter` in the manner of `all_reduce_async`.
    fn reduce_scatter_async(&self, input: &Tensor, output: &Tensor, op: ReduceOp) -> Result<()> {
        self.reduce_scatter(input, output, op)
    }
    /// `all_gather` in the manner of `all_reduce_async` (the distributed optimizer's parameter
    /// gathers overlapped with the next forward).
    fn all_gather_async(&self, input: &Tensor, output: &Tensor) -> Result<()> {
        self.all_gather(input, output)
    }
    /// Later device work waits for every `*_async` operation issued so far on this communicator
    /// (on NCCL each communicator has a stream of its own: wait on the one the work went to).
    fn wait_async(&self) -> Result<()> {
        Ok(())
    }
    /// Runs `ops` (sends and receives on this and other groups of the same backend) as one batch
    /// whose transfers may complete in any order (NCCL's grouped send/recv). Called through
    /// [`exchange`]. The mesh backends need nothing: their sends never wait for the receiver.
    fn p2p_group(&self, ops: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        ops()
    }
    /// Sets up the point-to-point links to `peers` now, every rank of the group at once (each
    /// names the peers it will exchange with; the relation must be symmetric). NCCL connects a
    /// peer lazily, on the host, inside the first batch that names it, and that handshake needs
    /// the peer inside a batch naming this rank too: a batch opening a new direction while the
    /// peer sits in an older one waits forever, before any kernel (and so any watchdog) runs.
    /// The interleaved pipeline hung that way on two H200s. The mesh backends need nothing.
    fn connect(&self, peers: &[usize]) -> Result<()> {
        let _ = peers;
        Ok(())
    }
    /// Sub-groups: `groups` lists disjoint sets of this group's ranks (e.g. every tensor-parallel
    /// group of the layout); each rank gets the one holding it, `None` when none does. Every rank
    /// of this group calls it with the same arguments (NCCL's split is collective).
    fn split(&self, name: &str, groups: &[Vec<usize>]) -> Result<Option<std::sync::Arc<dyn Communicator>>>;
}

/// One transfer of an [`exchange`]: a tensor, the group it travels on and the peer's rank there.
pub enum P2p<'a> {
    Send { comm: &'a dyn Communicator, t: &'a Tensor, dst: usize },
    Recv { comm: &'a dyn Communicator, t: &'a Tensor, src: usize },
}

/// Sends and receives issued together, as Megatron's batched isend/irecv: two ranks that each
/// send to and receive from the other in one exchange cannot deadlock, even where a send waits
/// for its receiver (NCCL with tensors larger than its buffers). Sends go first (the mesh
/// backends never block on a send); every group must be of one backend.
pub fn exchange(ops: &[P2p<'_>]) -> Result<()> {
    let Some(first) = ops.first() else { return Ok(()) };
    let lead = match first {
        P2p::Send { comm, .. } | P2p::Recv { comm, .. } => *comm,
    };
    lead.p2p_group(&mut || {
        for op in ops {
            if let P2p::Send { comm, t, dst } = op {
                comm.send(t, *dst)?;
            }
        }
        for op in ops {
            if let P2p::Recv { comm, t, src } = op {
                comm.recv(t, *src)?;
            }
        }
        Ok(())
    })
}

/// (index of the group holding `rank`, its position there).
pub(crate) fn find_group(groups: &[Vec<usize>], rank: usize) -> Option<(usize, usize)> {
    groups.iter().enumerate().find_map(|(g, m)| m.iter().position(|&r| r == rank).map(|i| (g, i)))
}

/// (rows, elements per row) of a tensor sent by rows (`all_to_all_v`): its first dimension and
/// the product of the rest, so a tensor of no rows still knows its row size (a rank with nothing
/// to send may have rows to receive); a scalar is one row of one.
pub(crate) fn rows_of(t: &Tensor) -> (usize, usize) {
    match t.dims() {
        [] => (1, 1),
        [rows, rest @ ..] => (*rows, rest.iter().product()),
    }
}
