//! One training step of a (possibly parallel) GPT: gradient accumulation over this rank's
//! micro-batches, data-parallel gradient sync (overlapped with the last backward when asked),
//! the optimizer update, and the parameter gather of the distributed optimizer.
//!
//! Loss scaling: each micro-batch's mean loss is scaled by 1 / (micro-batches on this rank) and
//! the data-parallel sync averages, so the update equals one rank's over all micro-batches of the
//! global batch.

use crate::{GradSync, OptimError, Optimizer, StepStats, ddp::Comm};
use ferrotron_comm::ReduceOp;
use ferrotron_core::{Cx, ParamTable, Tensor};
use ferrotron_transformer::{Batch, GptModel, MicroLoss, ModelError};

#[derive(Debug, thiserror::Error)]
pub enum StepError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Optim(#[from] OptimError),
    /// The step cannot be captured or replayed as a CUDA graph (`StepGraph`).
    #[error("CUDA graph of the training step: {0}")]
    Graph(String),
}

impl From<ferrotron_core::Error> for StepError {
    fn from(e: ferrotron_core::Error) -> Self {
        StepError::Optim(OptimError::Core(e))
    }
}

#[derive(Clone, Debug)]
pub struct StepOutput {
    /// Mean loss over the global batch (identical on every rank).
    pub loss: f64,
    /// Each multi-token prediction depth's loss (Megatron's `mtp_k loss`): the mean over the
    /// micro-batches of each one's mean, averaged over the data-parallel ranks; empty without MTP.
    pub mtp_losses: Vec<f64>,
    pub grad_norm: f64,
    pub applied: bool,
    /// Peak bytes of saved activations held at once on this rank during the step.
    pub saved_peak_bytes: usize,
}

/// A step whose work is queued on the device and whose results are not yet read back: the
/// micro-batches' losses and a copy of the optimizer's step state. [`QueuedStep::read`] waits for
/// it and gives its [`StepOutput`]. The read is collective over the data-parallel group (and the
/// pipeline group for a pipelined step), so every rank reads the same steps in the same order;
/// the trainer reads at log intervals, so steps in between queue one after another without the
/// host waiting (Megatron likewise reads losses back only to log them).
pub struct QueuedStep {
    pub(crate) losses: Vec<MicroLoss>,
    pub(crate) stats: Tensor,
    pub(crate) dp: Comm,
    /// Pipelined: the pipeline group, whose last stage holds the losses.
    pub(crate) pp: Option<Comm>,
    pub(crate) saved_peak_bytes: usize,
    /// The model's multi-token prediction depths (every stage knows them; the last has the losses).
    pub(crate) mtp_depths: usize,
}

impl QueuedStep {
    /// A step without a pipeline: its micro-batches' losses and a copy of the optimizer's step
    /// state (queued, not read).
    pub(crate) fn unpipelined(
        losses: Vec<MicroLoss>,
        sync: &GradSync,
        opt: &Optimizer,
        saved_peak_bytes: usize,
        mtp_depths: usize,
    ) -> Result<QueuedStep, StepError> {
        let (stats, dp) = (opt.stats_snapshot()?, sync.dp.clone());
        Ok(QueuedStep { losses, stats, dp, pp: None, saved_peak_bytes, mtp_depths })
    }

    /// Peak bytes of saved activations held at once on this rank during the step (known on the
    /// host as soon as the step is queued).
    pub fn saved_peak_bytes(&self) -> usize {
        self.saved_peak_bytes
    }

    /// Waits for the step and reads its loss (token-weighted over the global batch, as
    /// Megatron reports it) and stats.
    pub fn read(self) -> Result<StepOutput, StepError> {
        let values = match &self.pp {
            Some(pp) => crate::pipeline::stage_loss(&self.losses, pp, self.mtp_depths)?,
            None => loss_values(&self.losses, self.mtp_depths)?,
        };
        let loss = token_weighted(&self.dp, values[0], values[1])?;
        let mtp_losses = dp_mean(&self.dp, &values[2..])?;
        let stats = StepStats::read(&self.stats)?;
        Ok(StepOutput {
            loss,
            mtp_losses,
            grad_norm: stats.grad_norm,
            applied: stats.applied,
            saved_peak_bytes: self.saved_peak_bytes,
        })
    }
}

/// (loss sum, token count) over micro-batches.
pub fn loss_sums(losses: &[MicroLoss]) -> Result<(f64, f64), StepError> {
    let (mut sum, mut count) = (0.0, 0.0);
    for l in losses {
        let (s, n) = l.sum()?;
        (sum, count) = (sum + s, count + n);
    }
    Ok((sum, count))
}

/// [loss sum, token count, then each of `depths` MTP depths' mean over the micro-batches of each
/// one's mean] on this rank.
pub(crate) fn loss_values(losses: &[MicroLoss], depths: usize) -> Result<Vec<f64>, StepError> {
    let (sum, count) = loss_sums(losses)?;
    let mut v = vec![sum, count];
    for d in 0..depths {
        let mut total = 0.0;
        for l in losses {
            total += l.mtp.get(d).map(|m| m.mean()).transpose()?.unwrap_or(0.0);
        }
        v.push(if losses.is_empty() { 0.0 } else { total / losses.len() as f64 });
    }
    Ok(v)
}

/// The mean of each value over the ranks of `dp` (nothing to send for none).
fn dp_mean(dp: &Comm, values: &[f64]) -> Result<Vec<f64>, StepError> {
    if dp.size() == 1 || values.is_empty() {
        return Ok(values.to_vec());
    }
    let t = Tensor::from_vec(values.iter().map(|&v| v as f32).collect(), [values.len()], &ferrotron_core::Device::Cpu)
        .map_err(OptimError::from)?;
    dp.all_reduce(&t, ReduceOp::Sum).map_err(OptimError::from)?;
    let v = t.to_vec_f32().map_err(OptimError::from)?;
    Ok(v.iter().map(|&x| x as f64 / dp.size() as f64).collect())
}

/// Loss sum over token count across the ranks of `dp` (each giving its own): Megatron's reported
/// loss, the mean over every unmasked token of the global batch (0 when none is). Without masks
/// (every micro-batch the same count) it is the mean of the micro-batches' means that the
/// gradient follows; with `--eod-mask-loss` the two differ as they do in Megatron.
pub fn token_weighted(dp: &Comm, sum: f64, count: f64) -> Result<f64, StepError> {
    let (sum, count) = if dp.size() > 1 {
        let t = Tensor::from_vec(vec![sum as f32, count as f32], [2], &ferrotron_core::Device::Cpu)
            .map_err(OptimError::from)?;
        dp.all_reduce(&t, ReduceOp::Sum).map_err(OptimError::from)?;
        let v = t.to_vec_f32().map_err(OptimError::from)?;
        (v[0] as f64, v[1] as f64)
    } else {
        (sum, count)
    };
    Ok(if count > 0.0 { sum / count } else { 0.0 })
}

/// [`queue_train_step`], then [`QueuedStep::read`].
pub fn train_step(
    model: &GptModel,
    table: &ParamTable,
    sync: &mut GradSync,
    opt: &mut Optimizer,
    micro_batches: &[Batch],
    lr: f32,
) -> Result<StepOutput, StepError> {
    queue_train_step(model, table, sync, opt, micro_batches, lr)?.read()
}

/// One step over this rank's micro-batches, queued without reading anything back.
pub fn queue_train_step(
    model: &GptModel,
    table: &ParamTable,
    sync: &mut GradSync,
    opt: &mut Optimizer,
    micro_batches: &[Batch],
    lr: f32,
) -> Result<QueuedStep, StepError> {
    opt.set_lr(lr)?;
    let (losses, peak) = queue_step_work(model, table, sync, opt, micro_batches)?;
    QueuedStep::unpipelined(losses, sync, opt, peak, model.config.mtp.map_or(0, |m| m.num_layers))
}

/// The device work of a step at the learning rate already in the optimizer's state: every
/// micro-batch's forward and backward, the gradient sync, the update and the parameter gather.
/// Nothing is copied from or to the host, so `graph` captures exactly this. Gives the
/// micro-batches' losses and the peak bytes of saved activations.
pub(crate) fn queue_step_work(
    model: &GptModel,
    table: &ParamTable,
    sync: &mut GradSync,
    opt: &mut Optimizer,
    micro_batches: &[Batch],
) -> Result<(Vec<MicroLoss>, usize), StepError> {
    // main_grad is not cleared: each gradient's first op stores, later ones add (`ParamTable`).
    table.defer_zero_grads();
    let cx = Cx::new(table, true);
    let m = micro_batches.len();
    let mut losses = Vec::with_capacity(m);
    let mut peak = 0;
    for (i, b) in micro_batches.iter().enumerate() {
        let (l, saved) = model.forward_deferred(&cx, b)?;
        losses.push(l);
        peak = peak.max(saved.bytes());
        if i + 1 == m {
            sync.begin();
            model.backward_with(&cx, saved, 1.0 / m as f32, &mut |frontier| {
                sync.ready(table, frontier).map_err(|e| ferrotron_core::Error::External(Box::new(e)))
            })?;
        } else {
            model.backward(&cx, saved, 1.0 / m as f32)?;
        }
    }
    sync.finish(table).map_err(OptimError::from)?;
    opt.apply(table)?;
    // Unconditionally: whether the step applied is known on the device only (a skipped step's
    // gather copies the unchanged shards).
    sync.gather_params(table).map_err(OptimError::from)?;
    Ok((losses, peak))
}
