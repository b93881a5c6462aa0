//! AdamW (or SGD with momentum, Megatron's --optimizer sgd: `Algorithm`) with fp32 master
//! weights over flat buffers.
//!
//! Per step: global grad norm over main_grad → clip coefficient → one AdamW pass over every owned
//! piece of the master buffer (weight decay only where `ParamMeta::weight_decay`; the word
//! embedding and output layer at their own learning rate where one is set, Megatron's
//! --decoupled-lr) that also writes each new master weight (rounded) into the model's parameter
//! buffer. Non-finite gradients skip the step.
//!
//! The step is decided on the parameters' device: Σ g² stays there (summed across ranks by the
//! collective), `adam_prepare` turns it into the clip factor, the skip flag and the bias
//! corrections in a small state tensor, and the AdamW kernel reads them, so queuing a step reads
//! nothing back (no host synchronisation between the backward and the update). The state also
//! holds the step count; `last_stats` and `steps` read it when the caller wants them.
//!
//! The moments are f32, or bf16 under Megatron's precision-aware optimizer (`AdamConfig::
//! exp_avg_dtype`): widened for the update, stored rounded; the state leaves and enters through
//! f32 (`owned_state` / `load_owned_state`), so a checkpoint does not depend on it.
//!
//! Under `AdamConfig::cpu_offload` (Megatron's --optimizer-cpu-offload) the master weights and
//! moments live in host memory: the step is settled on the device as above, then it and the owned
//! gradients are copied down, the host runs the same update into its own copy of the parameters,
//! and each run's parameters go back up. This waits for the backward (no CUDA graph holds it).
//!
//! A rank keeps master weights and moments only for the flat ranges it owns: all of the buffer,
//! or under the distributed optimizer its slice of every data-parallel bucket (≈ 1/DP of the
//! state). The norm sums each rank's part over the model-parallel group (and the data-parallel
//! group when sharded), counting parameters replicated across tensor-parallel ranks once.

use crate::ddp::{Comm, GradSync};
use ferrotron_comm::{CommError, ReduceOp};
use ferrotron_core::{DType, Device, HostPin, ParamId, ParamTable, Result as CoreResult, Tensor};
use ferrotron_kernels::{self as k, AdamPrep, AdamRun, AdamRuns, AdamW, Sgd, adam_state};
use std::ops::Range;

#[derive(Debug, thiserror::Error)]
pub enum OptimError {
    #[error("optimizer state does not match the model: {0}")]
    StateMismatch(String),
    #[error(transparent)]
    Core(#[from] ferrotron_core::Error),
    #[error(transparent)]
    Comm(#[from] CommError),
    #[error(transparent)]
    Parallel(#[from] ferrotron_parallel::ParallelError),
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamConfig {
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    /// Clip main_grad to this global L2 norm; 0 disables clipping.
    pub clip_grad: f32,
    /// The update rule (the betas and eps are AdamW's alone).
    pub algorithm: Algorithm,
    /// AdamW's moments' storage, f32 or bf16 each (Megatron's precision-aware optimizer,
    /// --exp-avg-dtype / --exp-avg-sq-dtype): a bf16 moment is widened for the update and stored
    /// rounded, halving its memory. Checkpoints hold f32 either way.
    pub exp_avg_dtype: DType,
    pub exp_avg_sq_dtype: DType,
    /// Megatron's --optimizer-cpu-offload: the master weights and moments live in host memory and
    /// the update runs on the host (`Optimizer` header), freeing their device memory.
    pub cpu_offload: bool,
}

/// Megatron's --optimizer: adam (AdamW, decoupled weight decay) or sgd (momentum, L2 weight
/// decay, PyTorch's SGD: `k::Sgd`); both behind the same clipping, skip and schedules.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum Algorithm {
    #[default]
    AdamW,
    /// --sgd-momentum (Megatron's default 0.9).
    Sgd { momentum: f32 },
}

impl Algorithm {
    /// Megatron's --optimizer name of the rule.
    pub fn flag(&self) -> &'static str {
        match self {
            Algorithm::AdamW => "adam",
            Algorithm::Sgd { .. } => "sgd",
        }
    }

    /// The state buffers beside the master weights, by their checkpoint names.
    pub fn state_names(&self) -> &'static [&'static str] {
        match self {
            Algorithm::AdamW => &["master", "exp_avg", "exp_avg_sq"],
            Algorithm::Sgd { .. } => &["master", "momentum_buffer"],
        }
    }
}

impl Default for AdamConfig {
    fn default() -> Self {
        // Megatron's defaults.
        AdamConfig {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            clip_grad: 1.0,
            algorithm: Algorithm::AdamW,
            exp_avg_dtype: DType::F32,
            exp_avg_sq_dtype: DType::F32,
            cpu_offload: false,
        }
    }
}

/// A step's outcome, read back from the device state (`Optimizer::last_stats`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepStats {
    pub grad_norm: f64,
    /// False when the gradient norm was not finite and the update was skipped.
    pub applied: bool,
}

impl StepStats {
    /// From a step state (the optimizer's, or a snapshot of it): a read back.
    pub fn read(state: &Tensor) -> Result<Self, OptimError> {
        let s = state.to_vec_f32()?;
        Ok(StepStats { grad_norm: s[adam_state::GRAD_NORM] as f64, applied: s[adam_state::APPLIED] == 1.0 })
    }
}

pub struct Optimizer {
    pub config: AdamConfig,
    /// Flat ranges of the parameter buffer this rank updates, in flat order (all of it unless the
    /// optimizer is distributed); the state buffers hold them back to back.
    owned: Vec<Range<usize>>,
    master: Tensor,
    /// AdamW's first moment, or SGD's momentum buffer.
    exp_avg: Tensor,
    /// AdamW's second moment (empty under SGD).
    exp_avg_sq: Tensor,
    /// The owned pieces merged into runs (one AdamW launch per step for all of them).
    runs: AdamRuns,
    /// The step state on the parameters' device (kernels' `adam_state` slots: clip factor, norm,
    /// applied, bias corrections, steps so far).
    state: Tensor,
    /// Where gradient norms are summed: the model-parallel group (tensor × pipeline), and the
    /// data-parallel group when each rank holds only its shards.
    mp: Option<Comm>,
    dp: Option<Comm>,
    tp_rank: usize,
    /// Expert parallelism: the experts' region ends here, and its squares are summed over the
    /// expert-parallel group (each rank holds other experts) and, sharded, over the
    /// expert-data-parallel group instead of the data-parallel one.
    experts: Option<ExpertNorm>,
    /// The learning rate of the word embedding and output layer (`ParamMeta::embedding_or_output`)
    /// for the next updates; None: the main one.
    decoupled_lr: Option<f32>,
    /// Under `AdamConfig::cpu_offload`: the host side of the update.
    host: Option<HostStep>,
}

/// The host's buffers of an offloaded update, laid out as the state buffers (the owned ranges
/// back to back): the step's gradients copied down, the parameters written there by the update
/// and copied up (both page-locked), and the step state as the device settled it.
struct HostStep {
    grads: Tensor,
    params: Tensor,
    state: Tensor,
    /// (flat offset, host offset, length) of each run: what the update writes, and so what goes
    /// back up (frozen parameters stay as they are on the device).
    uploads: Vec<(usize, usize, usize)>,
    /// `grads` and `params` page-locked for the device's copies (nothing where it is the CPU).
    _pins: [HostPin; 2],
}

/// What [`Optimizer::total`] sums over the model.
#[derive(Clone, Copy)]
enum Measure {
    /// Σ g² of the gradients.
    GradSq,
    /// Σ w² of the fp32 master weights.
    MasterSq,
    /// The gradients equal to zero.
    GradZeros,
}

struct ExpertNorm {
    end: usize,
    ep: Option<Comm>,
    edp: Option<Comm>,
    /// Whole experts under tensor parallelism: tp / etp ranks of the model-parallel group hold
    /// the same sum after the expert groups' reductions, so it is divided by that before the
    /// model-parallel sum.
    tp_copies: usize,
}

impl Optimizer {
    /// One rank: master weights start as an fp32 copy of the parameters; moments at zero.
    pub fn new(table: &ParamTable, config: AdamConfig) -> CoreResult<Self> {
        let whole = std::iter::once(0..table.flat_len()).collect();
        Self::build(table, config, whole, None, None, 0)
    }

    /// A rank of a parallel run: it updates the ranges `sync` owns (its data-parallel shards under
    /// the distributed optimizer), and sums gradient norms over `mp` (tensor × pipeline ranks;
    /// parameters replicated across tensor-parallel ranks counted once).
    pub fn new_parallel(
        table: &ParamTable,
        config: AdamConfig,
        sync: &GradSync,
        mp: Comm,
        tp_rank: usize,
    ) -> CoreResult<Self> {
        let owned = sync.owned();
        let dp = sync.distributed.then(|| sync.dp.clone());
        let mut opt = Self::build(table, config, owned, Some(mp), dp, tp_rank)?;
        opt.experts = sync.expert.as_ref().and_then(|e| {
            let ep = e.ep.clone().filter(|ep| ep.size() > 1);
            (ep.is_some() || e.tp_copies > 1).then(|| ExpertNorm {
                end: e.region.end,
                ep,
                edp: sync.distributed.then(|| e.edp.clone()),
                tp_copies: e.tp_copies,
            })
        });
        Ok(opt)
    }

    fn build(
        table: &ParamTable,
        config: AdamConfig,
        owned: Vec<Range<usize>>,
        mp: Option<Comm>,
        dp: Option<Comm>,
        tp_rank: usize,
    ) -> CoreResult<Self> {
        let dev = table.flat_params().device().clone();
        let host_dev = if config.cpu_offload { Device::Cpu } else { dev.clone() };
        let n: usize = owned.iter().map(|r| r.len()).sum();
        let (m_dt, v_dt) = (config.exp_avg_dtype, config.exp_avg_sq_dtype);
        for (what, dt) in [("exp_avg", m_dt), ("exp_avg_sq", v_dt)] {
            if !matches!(dt, DType::F32 | DType::BF16) {
                return Err(ferrotron_core::invalid(
                    "optimizer",
                    format!("{what} in {dt}: the moments are f32 or bf16"),
                ));
            }
        }
        if matches!(config.algorithm, Algorithm::Sgd { .. }) && (m_dt, v_dt) != (DType::F32, DType::F32) {
            return Err(ferrotron_core::invalid(
                "optimizer",
                "SGD keeps an f32 momentum buffer: bf16 moments are AdamW's (--optimizer adam)",
            ));
        }
        let master = Tensor::zeros([n], DType::F32, &host_dev)?;
        let mut at = 0;
        for r in &owned {
            master
                .view(at, [r.len()])?
                .copy_from(&k::cast(&table.flat_params().view(r.start, [r.len()])?, DType::F32)?)?;
            at += r.len();
        }
        let mut runs = runs(table, &owned);
        let host = if config.cpu_offload {
            // The host's gradients and parameters hold the owned ranges back to back, as the state.
            let uploads = runs.iter().map(|r| (r.flat, r.state, r.len)).collect();
            runs.iter_mut().for_each(|r| r.flat = r.state);
            let (g, p) = (table.flat_grads(), table.flat_params());
            let grads = Tensor::zeros([n], g.dtype(), &Device::Cpu)?;
            let params = Tensor::zeros([n], p.dtype(), &Device::Cpu)?;
            // Page-locking only speeds the copies: where the system refuses it (a locked-memory
            // limit), they go through pageable memory.
            let pin = |t: &Tensor| t.pin_host(&dev).or_else(|_| t.pin_host(&Device::Cpu));
            let _pins = [pin(&grads)?, pin(&params)?];
            Some(HostStep {
                grads,
                params,
                state: Tensor::zeros([adam_state::LEN], DType::F32, &Device::Cpu)?,
                uploads,
                _pins,
            })
        } else {
            None
        };
        Ok(Optimizer {
            config,
            owned,
            master,
            exp_avg: Tensor::zeros([n], m_dt, &host_dev)?,
            exp_avg_sq: Tensor::zeros([if config.algorithm == Algorithm::AdamW { n } else { 0 }], v_dt, &host_dev)?,
            runs: AdamRuns::new(runs, &host_dev)?,
            state: Tensor::zeros([adam_state::LEN], DType::F32, &dev)?,
            mp,
            dp,
            tp_rank,
            experts: None,
            decoupled_lr: None,
            host,
        })
    }

    /// Updates applied so far (a read back from the device: it waits for queued work).
    pub fn steps(&self) -> Result<u64, OptimError> {
        Ok(self.state.to_vec_f32()?[adam_state::STEPS] as u64)
    }

    /// The last step's grad norm and whether it was applied (a read back: it waits for the step).
    pub fn last_stats(&self) -> Result<StepStats, OptimError> {
        StepStats::read(&self.state)
    }

    /// A copy of the step state as the queued work leaves it (a device copy, nothing read back),
    /// for [`StepStats::read`] later, after further steps.
    pub fn stats_snapshot(&self) -> Result<Tensor, OptimError> {
        let t = Tensor::zeros([adam_state::LEN], DType::F32, self.state.device())?;
        k::copy_(&t, &self.state)?;
        Ok(t)
    }

    /// Bytes of optimizer state held by this rank (master + two moments, or + the momentum), in
    /// host memory when offloaded.
    pub fn state_bytes(&self) -> usize {
        self.buffers().iter().map(|t| t.dtype().size_in_bytes() * t.elem_count()).sum()
    }

    /// The state buffers, in `Algorithm::state_names` order.
    fn buffers(&self) -> Vec<&Tensor> {
        match self.config.algorithm {
            Algorithm::AdamW => vec![&self.master, &self.exp_avg, &self.exp_avg_sq],
            Algorithm::Sgd { .. } => vec![&self.master, &self.exp_avg],
        }
    }

    /// The flat ranges this rank updates (state buffers hold them back to back).
    pub fn owned(&self) -> &[Range<usize>] {
        &self.owned
    }

    /// Whether each data-parallel rank holds only its share of the state.
    pub fn distributed(&self) -> bool {
        self.dp.is_some()
    }

    /// What this rank updates, parameter by parameter: (parameter, flat range of the whole
    /// buffer, offset of that range in the state buffers), in state order.
    pub fn owned_pieces(&self, table: &ParamTable) -> Vec<(ParamId, Range<usize>, usize)> {
        pieces(table, &self.owned)
    }

    /// L2 norm of the (synchronised) gradients over the whole model, identical on every rank (a
    /// read back).
    pub fn grad_norm(&self, table: &ParamTable) -> Result<f64, OptimError> {
        Ok((self.sum_sq(table)?.to_vec_f32()?[0] as f64).sqrt())
    }

    /// L2 norm of the fp32 master weights over the whole model (Megatron's --log-params-norm),
    /// each parameter counted once as `grad_norm` counts gradients; identical on every rank (a
    /// read back).
    pub fn params_norm(&self, table: &ParamTable) -> Result<f64, OptimError> {
        Ok((self.total(table, Measure::MasterSq)?.to_vec_f32()?[0] as f64).sqrt())
    }

    /// How many of the (synchronised) gradients are zero over the whole model (Megatron's
    /// --log-num-zeros-in-grad), each parameter counted once as `grad_norm` counts it; identical
    /// on every rank (a read back). Summed across ranks in f32 as Megatron sums it: exact below
    /// 2²⁴, within 2⁻²⁴ relative above.
    pub fn num_zeros_in_grad(&self, table: &ParamTable) -> Result<f64, OptimError> {
        table.settle_grads(0..table.flat_len())?;
        Ok(self.total(table, Measure::GradZeros)?.to_vec_f32()?[0] as f64)
    }

    /// Σ g² over the whole model as one f32 on the parameters' device, summed across the ranks
    /// that share the norm (nothing read back).
    fn sum_sq(&self, table: &ParamTable) -> Result<Tensor, OptimError> {
        // Gradients no backward op reached this step are zero (a no-op when the sync settled them).
        table.settle_grads(0..table.flat_len())?;
        self.total(table, Measure::GradSq)
    }

    /// `what` over the model, as `sum_sq` says.
    fn total(&self, table: &ParamTable, what: Measure) -> Result<Tensor, OptimError> {
        let g = table.flat_grads();
        // Ranges of the flat buffer counted here with their offsets in the state buffers,
        // neighbours merged (one kernel each on a GPU).
        let mut ranges: Vec<(Range<usize>, usize)> = Vec::new();
        for (id, r, at) in pieces(table, &self.owned) {
            // Replicated across tensor-parallel ranks: counted on one of them; a pipeline stage's
            // copy of the tied embedding: counted on the stage that owns it.
            let m = table.meta(id);
            if (m.replicated && self.tp_rank != 0) || m.pipeline_copy || m.frozen {
                continue;
            }
            let boundary = self.experts.as_ref().map_or(0, |e| e.end);
            match ranges.last_mut() {
                Some((last, o)) if last.end == r.start && *o + last.len() == at && r.start != boundary => {
                    last.end = r.end
                }
                _ => ranges.push((r, at)),
            }
        }
        let sum = |rs: &[(Range<usize>, usize)]| -> Result<Tensor, OptimError> {
            let views = rs
                .iter()
                .map(|(r, at)| match what {
                    Measure::MasterSq => self.master.view(*at, [r.len()]),
                    Measure::GradSq | Measure::GradZeros => g.view(r.start, [r.len()]),
                })
                .collect::<Result<Vec<_>, _>>()?;
            let views: Vec<_> = views.iter().collect();
            Ok(match what {
                Measure::GradZeros => k::count_zeros_dev(&views, g.device())?,
                Measure::GradSq => k::sum_sq_dev(&views, g.device())?,
                // Offloaded master weights are summed on the host, the sum then sent where the
                // ranks reduce it.
                Measure::MasterSq => k::sum_sq_dev(&views, self.master.device())?.to_device(g.device())?,
            })
        };
        // Summed in f32 across ranks: every rank gets the same bits.
        let reduce = |t: &Tensor, c: &Comm| -> Result<(), OptimError> {
            if c.size() > 1 {
                c.all_reduce(t, ReduceOp::Sum)?;
            }
            Ok(())
        };
        let sq = match &self.experts {
            None => {
                let sq = sum(&ranges)?;
                for c in [&self.mp, &self.dp].into_iter().flatten() {
                    reduce(&sq, c)?;
                }
                return Ok(sq);
            }
            Some(e) => {
                let (ex, dense): (Vec<_>, Vec<_>) = ranges.into_iter().partition(|(r, _)| r.start < e.end);
                let (sq, sq_e) = (sum(&dense)?, sum(&ex)?);
                if let Some(dp) = &self.dp {
                    reduce(&sq, dp)?;
                }
                if let Some(edp) = &e.edp {
                    reduce(&sq_e, edp)?;
                }
                if let Some(ep) = &e.ep {
                    reduce(&sq_e, ep)?;
                }
                if e.tp_copies > 1 {
                    k::scale_(&sq_e, 1.0 / e.tp_copies as f32)?;
                }
                k::add_(&sq, &sq_e)?;
                sq
            }
        };
        if let Some(mp) = &self.mp {
            reduce(&sq, mp)?;
        }
        Ok(sq)
    }

    /// Queues one update from the accumulated (and synchronised) main_grad at learning rate `lr`:
    /// the norm, clip factor and skip decision stay on the device (`last_stats` reads them). Under
    /// the distributed optimizer the caller then gathers the parameters
    /// (`GradSync::gather_params`; after a skipped step that copies the unchanged shards).
    pub fn step(&mut self, table: &ParamTable, lr: f32) -> Result<(), OptimError> {
        self.set_lr(lr)?;
        self.apply(table)
    }

    /// Writes the next update's learning rate (with `config.weight_decay` and the decoupled
    /// rate, `lr` without one) into the step state on the device (a small copy queued without
    /// waiting for the stream). Kept apart from [`Optimizer::apply`] so that a step captured as a
    /// CUDA graph reads each replay's own.
    pub fn set_lr(&self, lr: f32) -> Result<(), OptimError> {
        let rates = [lr, self.config.weight_decay, self.decoupled_lr.unwrap_or(lr)];
        self.state.view(adam_state::LR, [3])?.copy_from_f32(&rates)?;
        Ok(())
    }

    /// The learning rate of the word embedding and output layer in the next updates (Megatron's
    /// --decoupled-lr, moved by its own schedule), or None for the main rate: written to the
    /// device with it by [`Optimizer::set_lr`].
    pub fn set_decoupled_lr(&mut self, lr: Option<f32>) {
        self.decoupled_lr = lr;
    }

    /// The weight decay of the next updates (Megatron's --weight-decay-incr-style moves it over
    /// the run): written to the device with the learning rate by [`Optimizer::set_lr`].
    pub fn set_weight_decay(&mut self, wd: f32) {
        self.config.weight_decay = wd;
    }

    /// [`Optimizer::step`] at the learning rate [`Optimizer::set_lr`] last wrote: queued work
    /// only, nothing copied from or to the host.
    pub fn apply(&mut self, table: &ParamTable) -> Result<(), OptimError> {
        table.settle_params()?; // every parameter value in place before its shard is updated
        let c = self.config;
        let sq = self.sum_sq(table)?;
        let prep = AdamPrep { beta1: c.beta1, beta2: c.beta2, clip_grad: c.clip_grad };
        k::adam_prepare(&sq, &self.state, &prep)?;
        // Learning rate, weight decay, step count and clip factor come from the state.
        let h = AdamW {
            lr: 0.0,
            beta1: c.beta1,
            beta2: c.beta2,
            eps: c.eps,
            weight_decay: c.weight_decay,
            step: 0,
            grad_scale: 1.0,
        };
        let (p, g) = (table.flat_params(), table.flat_grads());
        let Some(host) = &self.host else {
            return self.update(g, p, &self.state, &h);
        };
        // Offloaded: the settled step state and the owned gradients down to the host (this waits
        // for the backward), the update there, the new parameters back up.
        host.state.copy_from(&self.state)?;
        let mut at = 0;
        for r in &self.owned {
            host.grads.view(at, [r.len()])?.copy_from(&g.view(r.start, [r.len()])?)?;
            at += r.len();
        }
        self.update(&host.grads, &host.params, &host.state, &h)?;
        // A skipped step (a non-finite gradient norm) wrote nothing to send.
        if host.state.to_vec_f32()?[adam_state::APPLIED] == 0.0 {
            return Ok(());
        }
        for &(flat, at, len) in &host.uploads {
            p.view(flat, [len])?.copy_from(&host.params.view(at, [len])?)?;
        }
        Ok(())
    }

    /// The update of `grads` into the master weights, moments and `params` (laid out as `runs`
    /// says) by the step `state`.
    fn update(&self, grads: &Tensor, params: &Tensor, state: &Tensor, h: &AdamW) -> Result<(), OptimError> {
        match self.config.algorithm {
            Algorithm::AdamW => {
                k::adamw_runs(&self.master, &self.exp_avg, &self.exp_avg_sq, grads, params, &self.runs, h, Some(state))?
            }
            Algorithm::Sgd { momentum } => {
                let h = Sgd { lr: 0.0, momentum, weight_decay: self.config.weight_decay, grad_scale: 1.0 };
                k::sgd_runs(&self.master, &self.exp_avg, grads, params, &self.runs, &h, Some(state))?
            }
        }
        Ok(())
    }

    /// Whether the master weights and moments live in host memory (`AdamConfig::cpu_offload`).
    pub fn offloaded(&self) -> bool {
        self.host.is_some()
    }

    /// The state buffers (`Algorithm::state_names`: master, exp_avg, exp_avg_sq, or master and
    /// momentum_buffer) laid out like the whole flat buffer (length `flat_len`), and the step.
    /// Collective over the data-parallel group under the distributed optimizer (each rank
    /// contributes its shards); every rank gets the whole state.
    pub fn full_state(&self, flat_len: usize) -> Result<(Vec<Vec<f32>>, u64), OptimError> {
        let bufs = self.buffers();
        let mut out = vec![vec![0f32; flat_len]; bufs.len()];
        for (buf, t) in out.iter_mut().zip(bufs) {
            let v = t.to_vec_f32()?;
            let mut at = 0;
            for o in &self.owned {
                buf[o.clone()].copy_from_slice(&v[at..at + o.len()]);
                at += o.len();
            }
        }
        if let Some(dp) = self.dp.as_ref().filter(|d| d.size() > 1) {
            for buf in &mut out {
                // Shards are disjoint: the sum is exact.
                let t = Tensor::from_vec(std::mem::take(buf), [flat_len], &ferrotron_core::Device::Cpu)?;
                dp.all_reduce(&t, ReduceOp::Sum)?;
                *buf = t.to_vec_f32()?;
            }
        }
        Ok((out, self.steps()?))
    }

    /// This rank's state buffers (`Algorithm::state_names`) for its `owned` ranges back to back,
    /// and the step; no collective (a sharded checkpoint stores each rank's own).
    pub fn owned_state(&self) -> Result<(Vec<Vec<f32>>, u64), OptimError> {
        let bufs = self.buffers().into_iter().map(|t| t.to_vec_f32()).collect::<Result<Vec<_>, _>>()?;
        Ok((bufs, self.steps()?))
    }

    /// Restores what `owned_state` returns (the `owned` ranges back to back) and the step.
    pub fn load_owned_state(&mut self, state: &[Vec<f32>], step: u64) -> Result<(), OptimError> {
        let n = self.master.elem_count();
        let names = self.config.algorithm.state_names();
        if state.len() != names.len() {
            return Err(OptimError::StateMismatch(format!(
                "{} state buffers given, {:?} holds {} ({names:?})",
                state.len(),
                self.config.algorithm,
                names.len()
            )));
        }
        for (name, v) in names.iter().zip(state) {
            if v.len() != n {
                return Err(OptimError::StateMismatch(format!("{name} has {} elements, this rank owns {n}", v.len())));
            }
        }
        for (t, v) in self.buffers().into_iter().zip(state) {
            t.copy_from_f32(v)?;
        }
        let mut st = vec![0f32; adam_state::LEN];
        st[adam_state::STEPS] = step as f32;
        self.state.copy_from_f32(&st)?;
        Ok(())
    }
}

/// (parameter, flat range within it, offset in the state buffers) for every owned piece.
fn pieces(table: &ParamTable, owned: &[Range<usize>]) -> Vec<(ParamId, Range<usize>, usize)> {
    let mut out = vec![];
    let mut base = 0;
    for o in owned {
        for id in table.ids() {
            let r = table.range(id);
            let (s, e) = (r.start.max(o.start), r.end.min(o.end));
            if s < e {
                out.push((id, s..e, base + s - o.start));
            }
        }
        base += o.len();
    }
    out
}

/// `pieces` merged where neighbours touch in both the flat buffer and the state and share
/// the weight-decay and learning-rate choices. AdamW is elementwise, so the runs give the same
/// bits as one update per parameter; all of them go to one `adamw_runs` (one launch per step on a
/// GPU, with the rounded copy into the parameters in the same pass).
fn runs(table: &ParamTable, owned: &[Range<usize>]) -> Vec<AdamRun> {
    let mut out: Vec<AdamRun> = Vec::new();
    for (id, r, at) in pieces(table, owned) {
        let meta = table.meta(id);
        if meta.frozen {
            continue;
        }
        let (decay, decoupled) = (meta.weight_decay, meta.embedding_or_output);
        match out.last_mut() {
            Some(last)
                if (last.decay, last.decoupled) == (decay, decoupled)
                    && last.flat + last.len == r.start
                    && last.state + last.len == at =>
            {
                last.len += r.len();
            }
            _ => out.push(AdamRun { flat: r.start, state: at, len: r.len(), decay, decoupled }),
        }
    }
    out
}
