//! A whole training step captured once as a CUDA graph and replayed every step after it
//! (Megatron's `--cuda-graph-impl local --cuda-graph-scope full_iteration`). One launch queues
//! the step's several hundred kernels, memsets and GEMMs, so the GPU runs them without the gaps
//! of launching them one by one.
//!
//! A replay repeats what was captured: the same kernels with the same arguments on the same
//! buffers. So before each replay the step's batches are copied into the captured batches'
//! buffers (their 1 / loss-token count too, which the fused cross-entropy reads when it runs, and
//! their document starts under --reset-attention-mask, which the attention kernels read) and
//! its learning rate into the optimizer's state (`Optimizer::set_lr`), and after it the losses the
//! graph wrote are copied out. A step whose batches differ from the captured ones in shape (a
//! shorter last batch, another micro-batch count) releases the graph, so that its memory does not
//! sit beside the eager step's activations, and runs eagerly; the warm-up then starts again and
//! the step that follows it is captured anew.
//!
//! Dropout (hidden and attention) keys its masks by the micro-batch's first sample, which moves
//! on every step while the captured kernels hold the captured step's. The captured dropout kernels
//! add a shift they read from the device (`k::set_draw_shift`; eager ones do not read it): before
//! each launch it is set to how many samples the step's batches are ahead of the captured ones (0
//! for the captured step itself; the same lead for every micro-batch of a step, else the step runs
//! eagerly as one of another shape).
//!
//! Architecture invariant: a replayed step gives the bits an eager step gives on the same inputs
//! (the same kernels run in the same order; the trainer's `cuda_graph` test compares 20 steps of
//! both under `--deterministic-mode`, where two eager runs agree to the bit).

use crate::{GradSync, Optimizer, QueuedStep, StepError, queue_train_step, step::queue_step_work};
use ferrotron_core::{DType, Graph, ParamTable, Tensor};
use ferrotron_transformer::{Batch, GptModel, MicroLoss};

/// The steps of a run with the step graphed: `warmup` eager steps (GEMM algorithm choices,
/// kernel loading and the allocator's pool settle in them), then a capture, then replays.
pub struct StepGraph {
    warmup: usize,
    eager: usize,
    captured: Option<Captured>,
    launches: u64,
    captures: u64,
}

struct Captured {
    graph: Graph,
    /// The batches the graph reads; each replay's batches are copied into them.
    inputs: Vec<Batch>,
    /// Per micro-batch, the per-token losses the graph writes (allocated before the capture, so
    /// they outlive each replay).
    losses: Vec<Tensor>,
    saved_peak_bytes: usize,
}

impl StepGraph {
    /// Graphs the steps after the first `warmup_steps` (Megatron's `--cuda-graph-warmup-steps`),
    /// at least one: the first step chooses GEMM algorithms (timing some) and uploads what later
    /// steps reuse, none of which a capture may do.
    pub fn new(warmup_steps: usize) -> Self {
        StepGraph { warmup: warmup_steps.max(1), eager: 0, captured: None, launches: 0, captures: 0 }
    }

    /// Steps run by launching the graph (the captured one included).
    pub fn launches(&self) -> u64 {
        self.launches
    }

    /// Graphs captured so far (a step of another shape releases the graph; a later one captures
    /// again).
    pub fn captures(&self) -> u64 {
        self.captures
    }

    /// Whether a captured graph replays the steps that fit it.
    pub fn is_captured(&self) -> bool {
        self.captured.is_some()
    }

    /// `queue_train_step`, eagerly during the warm-up and for batches the graph does not fit
    /// (releasing the graph: the warm-up starts again), else by replaying the captured step
    /// (capturing it first).
    pub fn queue(
        &mut self,
        model: &GptModel,
        table: &ParamTable,
        sync: &mut GradSync,
        opt: &mut Optimizer,
        micro_batches: &[Batch],
        lr: f32,
    ) -> Result<QueuedStep, StepError> {
        let dev = match micro_batches.first() {
            Some(b) => b.tokens.device().clone(),
            None => return Err(StepError::Graph("a step of no micro-batches has nothing to run".into())),
        };
        if model.mtp.is_some() {
            // Its depths' loss counts are the batch's, baked into the kernels' launches.
            return Err(StepError::Graph(
                "multi-token prediction (--mtp-num-layers) is not captured as a CUDA graph: drop --cuda-graph-impl"
                    .into(),
            ));
        }
        let drops = model.config.hidden_dropout > 0.0 || model.config.attention_dropout > 0.0;
        // With dropout, the masks' shift: the batches' lead on the captured ones (None: unequal
        // leads, which a replay cannot follow).
        let shift = match &self.captured {
            Some(c) if drops => c.shift(micro_batches),
            _ => Some(0),
        };
        if let Some(c) = self.captured.take_if(|c| !c.fits(micro_batches) || shift.is_none()) {
            // Its pool would hold a step's activations beside the eager step's (twice the memory
            // at 1.3B): released, and captured again after the warm-up.
            c.graph.release()?;
            self.eager = 0;
        }
        if self.eager < self.warmup {
            self.eager += 1;
            return queue_train_step(model, table, sync, opt, micro_batches, lr);
        }
        let q = match &self.captured {
            Some(c) => {
                if let (true, Some(lead)) = (drops, shift) {
                    ferrotron_kernels::set_draw_shift(&dev, lead)?;
                }
                c.replay(sync, opt, micro_batches, lr)?
            }
            None => {
                let c = Captured::capture(model, table, sync, opt, micro_batches, lr)?;
                if drops {
                    ferrotron_kernels::set_draw_shift(&dev, 0)?;
                }
                c.graph.launch()?;
                let q = c.queued(sync, opt, micro_batches)?;
                self.captured = Some(c);
                self.captures += 1;
                q
            }
        };
        self.launches += 1;
        Ok(q)
    }
}

impl Captured {
    fn capture(
        model: &GptModel,
        table: &ParamTable,
        sync: &mut GradSync,
        opt: &mut Optimizer,
        micro_batches: &[Batch],
        lr: f32,
    ) -> Result<Captured, StepError> {
        let dev = match micro_batches.first() {
            Some(b) => b.tokens.device().clone(),
            None => return Err(StepError::Graph("a step of no micro-batches has nothing to capture".into())),
        };
        // Allocated before the capture: buffers inside it belong to the graph and are freed in it.
        let losses = micro_batches
            .iter()
            .map(|b| Tensor::zeros([b.tokens.elem_count()], DType::F32, &dev))
            .collect::<Result<Vec<_>, _>>()?;
        let inputs = micro_batches.to_vec();
        opt.set_lr(lr)?;
        let (graph, saved_peak_bytes) = dev.capture(|| -> Result<usize, StepError> {
            let (step_losses, peak) = queue_step_work(model, table, sync, opt, &inputs)?;
            for (l, keep) in step_losses.iter().zip(&losses) {
                if l.per_token.elem_count() != keep.elem_count() {
                    return Err(StepError::Graph(format!(
                        "the loss has {} values for a micro-batch of {} tokens",
                        l.per_token.elem_count(),
                        keep.elem_count()
                    )));
                }
                keep.copy_from(&l.per_token)?;
            }
            Ok(peak)
        })?;
        Ok(Captured { graph, inputs, losses, saved_peak_bytes })
    }

    /// Whether `micro_batches` can take the captured batches' place: as many, each of the same
    /// shapes and dtypes, with document masks where the captured ones had them (the loss-token
    /// count may differ: it travels in `inv_tokens`).
    fn fits(&self, micro_batches: &[Batch]) -> bool {
        let same = |a: &Tensor, b: &Tensor| a.dims() == b.dims() && a.dtype() == b.dtype();
        let same_docs = |a: Option<&Tensor>, b: Option<&Tensor>| match (a, b) {
            (Some(a), Some(b)) => same(a, b),
            (None, None) => true,
            _ => false,
        };
        self.inputs.len() == micro_batches.len()
            && self.inputs.iter().zip(micro_batches).all(|(c, b)| {
                same(&c.tokens, &b.tokens)
                    && same(&c.labels, &b.labels)
                    && same(&c.loss_mask, &b.loss_mask)
                    && same_docs(c.docs(), b.docs())
            })
    }

    /// How many samples `micro_batches` are ahead of the captured batches, if by the same for
    /// every micro-batch (their dropout masks then follow from the captured keys by one shift).
    fn shift(&self, micro_batches: &[Batch]) -> Option<u64> {
        let mut lead = None;
        for (c, b) in self.inputs.iter().zip(micro_batches) {
            match (c.draw, b.draw) {
                (Some(c), Some(b)) if c.seed == b.seed => {
                    let d = b.first_sample.wrapping_sub(c.first_sample);
                    if lead.is_some_and(|l| l != d) {
                        return None;
                    }
                    lead = Some(d);
                }
                (None, None) => {}
                _ => return None,
            }
        }
        Some(lead.unwrap_or(0))
    }

    fn replay(
        &self,
        sync: &GradSync,
        opt: &Optimizer,
        micro_batches: &[Batch],
        lr: f32,
    ) -> Result<QueuedStep, StepError> {
        for (c, b) in self.inputs.iter().zip(micro_batches) {
            let pairs = [
                (&c.tokens, &b.tokens),
                (&c.labels, &b.labels),
                (&c.loss_mask, &b.loss_mask),
                (c.inv_tokens(), b.inv_tokens()),
            ];
            for (to, from) in pairs {
                to.copy_from(from)?;
            }
            // --reset-attention-mask: the batch's document starts, where the kernels read them.
            if let (Some(to), Some(from)) = (c.docs(), b.docs()) {
                to.copy_from(from)?;
            }
        }
        opt.set_lr(lr)?;
        self.graph.launch()?;
        self.queued(sync, opt, micro_batches)
    }

    /// The launched step's results, copied out of the graph's buffers (queued work: the next
    /// replay may overwrite them before the host reads the losses).
    fn queued(&self, sync: &GradSync, opt: &Optimizer, micro_batches: &[Batch]) -> Result<QueuedStep, StepError> {
        let mut losses = Vec::with_capacity(self.losses.len());
        for (l, b) in self.losses.iter().zip(micro_batches) {
            let per_token = Tensor::empty(l.shape().clone(), DType::F32, l.device())?;
            per_token.copy_from(l)?;
            losses.push(MicroLoss::new(per_token, b.num_tokens()));
        }
        QueuedStep::unpipelined(losses, sync, opt, self.saved_peak_bytes, 0)
    }
}
