//! Runs a schedule on one pipeline rank: receives each forward's input from the previous stage and
//! sends its output on; receives each backward's output gradient from the next stage and sends the
//! input gradient back. Activations and gradients travel on two separate groups over the same
//! ranks, so the two streams of messages between a pair of ranks never mix (with interleaving a
//! pair carries both directions). Shapes are agreed up front: every inter-stage tensor is the
//! hidden state of one micro-batch, `activation` here.
//!
//! Sends do not wait for the receiver on the thread and TCP backends (a message waits in the
//! peer's mailbox), so any schedule whose passes respect data dependencies runs without deadlock.

use super::schedule::Action;
use crate::groups::Comm;
use crate::{ParallelError, Result};
use ferrotron_core::{DType, Device, Tensor};

/// The two point-to-point groups of a pipeline (same ranks as the pp group).
pub struct PipelineComms {
    pub fwd: Comm,
    pub bwd: Comm,
}

impl PipelineComms {
    /// Collective over the world (splits are): call on every rank with the layout's pp groups.
    pub fn new(world: &Comm, pp_groups: &[Vec<usize>]) -> Result<PipelineComms> {
        let f = world.split("pp-fwd", pp_groups)?;
        let b = world.split("pp-bwd", pp_groups)?;
        match (f, b) {
            (Some(fwd), Some(bwd)) => Ok(PipelineComms { fwd, bwd }),
            _ => Err(ParallelError::Layout(format!("rank {} is in no pipeline group", world.rank()))),
        }
    }
}

/// One pipeline rank's model chunks, driven by the executor. The runner keeps each pass's saved
/// activations until its backward.
pub trait StageRunner {
    /// Forward of micro-batch `micro` through chunk `chunk`; `input` is the previous stage's output
    /// (None on the first stage's first chunk, which embeds tokens). Returns the output to send on
    /// (None on the last stage's last chunk, which computes the loss).
    fn forward(&mut self, chunk: usize, micro: usize, input: Option<Tensor>) -> Result<Option<Tensor>>;
    /// Backward of that pass; `dy` is the next stage's input gradient (None where the loss is).
    /// Returns the gradient of this chunk's input (None on the first chunk of the first stage).
    fn backward(&mut self, chunk: usize, micro: usize, dy: Option<Tensor>) -> Result<Option<Tensor>>;
    /// Shape and dtype of the hidden state passed between stages, and where it lives.
    fn activation(&self) -> (Vec<usize>, DType, Device);
}

fn missing(what: &str, chunk: usize, micro: usize) -> ParallelError {
    ParallelError::Layout(format!("pipeline: chunk {chunk} produced no {what} for micro-batch {micro}"))
}

/// Runs `actions` (this rank's schedule) with `chunks` model chunks per rank.
pub fn run_schedule(
    actions: &[Action],
    comms: &PipelineComms,
    chunks: usize,
    runner: &mut dyn StageRunner,
) -> Result<()> {
    let (r, p) = (comms.fwd.rank(), comms.fwd.size());
    let (prev, next) = ((r + p - 1) % p, (r + 1) % p);
    let (shape, dtype, dev) = runner.activation();
    let first = |c: usize| r == 0 && c == 0;
    let last = |c: usize| r == p - 1 && c == chunks - 1;
    for a in actions {
        match *a {
            Action::Forward { chunk, micro } => {
                let input = if first(chunk) {
                    None
                } else {
                    let t = Tensor::zeros(shape.clone(), dtype, &dev)?;
                    comms.fwd.recv(&t, prev)?;
                    Some(t)
                };
                let out = runner.forward(chunk, micro, input)?;
                if !last(chunk) {
                    comms.fwd.send(&out.ok_or_else(|| missing("output", chunk, micro))?, next)?;
                }
            }
            Action::Backward { chunk, micro } => {
                let dy = if last(chunk) {
                    None
                } else {
                    let t = Tensor::zeros(shape.clone(), dtype, &dev)?;
                    comms.bwd.recv(&t, next)?;
                    Some(t)
                };
                let dx = runner.backward(chunk, micro, dy)?;
                if !first(chunk) {
                    comms.bwd.send(&dx.ok_or_else(|| missing("input gradient", chunk, micro))?, prev)?;
                }
            }
        }
    }
    Ok(())
}
