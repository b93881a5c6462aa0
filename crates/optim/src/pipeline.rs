//! One training step (and one evaluation) of a pipeline-parallel GPT: the schedule runs this
//! rank's forward and backward passes of every micro-batch through its model chunks, activations
//! and gradients moving between stages; then the same sync / update / gather as `train_step`.
//!
//! Saved activations live in the runner from a pass's forward to its backward; the peak of their
//! bytes on this rank is reported (1F1B holds up to pp − rank micro-batches at once).

use crate::step::{QueuedStep, StepError, StepOutput};
use crate::{GradSync, OptimError, Optimizer};
use ferrotron_core::{Cx, DType, Device, ParamTable, Tensor};
use ferrotron_parallel::pipeline::{Action, PipelineComms, ScheduleKind, StageRunner, run_schedule, schedule};
use ferrotron_parallel::{ParallelError, groups::Comm};
use ferrotron_transformer::{Batch, ChunkOut, GptModel, GptSaved, MicroLoss, ModelError};
use std::collections::HashMap;

struct Runner<'a> {
    model: &'a GptModel,
    cx: Cx<'a>,
    batches: &'a [Batch],
    saved: HashMap<(usize, usize), GptSaved>,
    losses: Vec<MicroLoss>,
    grad_scale: f32,
    keep: bool,
    held: usize,
    peak: usize,
}

fn wrap(e: ModelError) -> ParallelError {
    ParallelError::Core(ferrotron_core::Error::External(Box::new(e)))
}

impl StageRunner for Runner<'_> {
    fn forward(&mut self, chunk: usize, micro: usize, input: Option<Tensor>) -> Result<Option<Tensor>, ParallelError> {
        let (out, s) = self.model.forward_chunk(&self.cx, chunk, &self.batches[micro], input).map_err(wrap)?;
        if self.keep {
            self.held += s.bytes();
            self.peak = self.peak.max(self.held);
            self.saved.insert((chunk, micro), s);
        }
        Ok(match out {
            ChunkOut::Hidden(h) => Some(h),
            ChunkOut::Loss(l) => {
                self.losses.push(l);
                None
            }
        })
    }

    fn backward(&mut self, chunk: usize, micro: usize, dy: Option<Tensor>) -> Result<Option<Tensor>, ParallelError> {
        let s = self.saved.remove(&(chunk, micro)).ok_or_else(|| {
            ParallelError::Layout(format!("pipeline: backward of micro-batch {micro} chunk {chunk} before its forward"))
        })?;
        self.held -= s.bytes();
        self.model.backward_chunk(&self.cx, chunk, s, dy.as_ref(), self.grad_scale, &mut |_| Ok(())).map_err(wrap)
    }

    fn activation(&self) -> (Vec<usize>, DType, Device) {
        let b = &self.batches[0].tokens;
        let shape = self.model.activation_shape(b.dims()[0], b.dims()[1]);
        (shape, self.cx.params.flat_params().dtype(), self.cx.params.flat_params().device().clone())
    }
}

/// The schedule kind for `chunks` model chunks on `pp` stages.
pub fn schedule_kind(pp: usize, chunks: usize) -> ScheduleKind {
    match (pp, chunks) {
        (1, 1) => ScheduleKind::NoPipelining,
        (_, 1) => ScheduleKind::OneFOneB,
        (_, v) => ScheduleKind::Interleaved { chunks: v },
    }
}

/// The last stage's [loss sum, token count, MTP depths' means] over its micro-batches
/// (`crate::step::loss_values`), given to every pipeline rank.
pub(crate) fn stage_loss(losses: &[MicroLoss], pp: &Comm, mtp_depths: usize) -> Result<Vec<f64>, StepError> {
    let v = crate::step::loss_values(losses, mtp_depths)?;
    if pp.size() == 1 {
        return Ok(v);
    }
    let t =
        Tensor::from_vec(v.iter().map(|&x| x as f32).collect(), [v.len()], &Device::Cpu).map_err(OptimError::from)?;
    pp.broadcast(&t, pp.size() - 1).map_err(OptimError::from)?;
    Ok(t.to_vec_f32().map_err(OptimError::from)?.iter().map(|&x| x as f64).collect())
}

/// A pipelined training step over this rank's micro-batches (all of the data-parallel rank's):
/// [`queue_train_step_pipelined`], then [`QueuedStep::read`].
#[allow(clippy::too_many_arguments)]
pub fn train_step_pipelined(
    model: &GptModel,
    table: &ParamTable,
    sync: &mut GradSync,
    opt: &mut Optimizer,
    comms: &PipelineComms,
    pp: &Comm,
    micro_batches: &[Batch],
    lr: f32,
) -> Result<StepOutput, StepError> {
    queue_train_step_pipelined(model, table, sync, opt, comms, pp, micro_batches, lr)?.read()
}

/// The pipelined step queued without reading anything back (its activations cross stages as the
/// schedule runs; the losses and stats wait for [`QueuedStep::read`]).
#[allow(clippy::too_many_arguments)]
pub fn queue_train_step_pipelined(
    model: &GptModel,
    table: &ParamTable,
    sync: &mut GradSync,
    opt: &mut Optimizer,
    comms: &PipelineComms,
    pp: &Comm,
    micro_batches: &[Batch],
    lr: f32,
) -> Result<QueuedStep, StepError> {
    // main_grad is not cleared: each gradient's first op stores, later ones add (`ParamTable`).
    table.defer_zero_grads();
    let kind = schedule_kind(pp.size(), model.chunks.len());
    let actions = schedule(kind, pp.size(), pp.rank(), micro_batches.len()).map_err(OptimError::from)?;
    let mut runner = Runner {
        model,
        cx: Cx::new(table, true),
        batches: micro_batches,
        saved: HashMap::new(),
        losses: vec![],
        grad_scale: 1.0 / micro_batches.len() as f32,
        keep: true,
        held: 0,
        peak: 0,
    };
    run_schedule(&actions, comms, model.chunks.len(), &mut runner).map_err(OptimError::from)?;
    sync.finish(table).map_err(OptimError::from)?;
    opt.step(table, lr)?;
    // Unconditionally: whether the step applied is known on the device only (a skipped step's
    // gather copies the unchanged shards).
    sync.gather_params(table).map_err(OptimError::from)?;
    Ok(QueuedStep {
        losses: runner.losses,
        stats: opt.stats_snapshot()?,
        dp: sync.dp.clone(),
        pp: Some(pp.clone()),
        saved_peak_bytes: runner.peak,
        mtp_depths: model.config.mtp.map_or(0, |m| m.num_layers),
    })
}

/// (loss sum, token count) of `micro_batches` through the pipeline without gradients (every rank
/// gets it).
pub fn eval_pipelined(
    model: &GptModel,
    table: &ParamTable,
    comms: &PipelineComms,
    pp: &Comm,
    micro_batches: &[Batch],
) -> Result<(f64, f64), StepError> {
    let v = model.chunks.len();
    let actions: Vec<Action> =
        (0..micro_batches.len()).flat_map(|m| (0..v).map(move |c| Action::Forward { chunk: c, micro: m })).collect();
    let mut runner = Runner {
        model,
        cx: Cx::new(table, false),
        batches: micro_batches,
        saved: HashMap::new(),
        losses: vec![],
        grad_scale: 0.0,
        keep: false,
        held: 0,
        peak: 0,
    };
    run_schedule(&actions, comms, v, &mut runner).map_err(OptimError::from)?;
    let v = stage_loss(&runner.losses, pp, 0)?;
    Ok((v[0], v[1]))
}
