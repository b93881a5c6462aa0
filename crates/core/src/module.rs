//! The Module interface: a named forward and backward per layer, no autograd tape.
//!
//! `forward` returns its output and the activations backward will need, as a value (`Saved`), not
//! kept inside the module: the schedule owns them, so pipeline 1F1B can hold several micro-batches
//! and recompute can drop them and run forward again.
//!
//! Accumulation rule: `backward` returns dx (`=`) and adds parameter gradients (`+=`) into the fp32
//! main_grad views of the `ParamTable` (gradient accumulation across micro-batches); the residual
//! stream adds its two branches' gradients.

use crate::params::ParamTable;
use crate::{Result, Tensor};

/// Activations saved by a forward for its backward: its own tensors, in push order, and the saved
/// values of the sub-modules it ran, in call order.
#[derive(Default, Debug)]
pub struct Saved {
    pub tensors: Vec<Tensor>,
    pub children: Vec<Saved>,
}

impl Saved {
    pub fn new(tensors: Vec<Tensor>, children: Vec<Saved>) -> Self {
        Saved { tensors, children }
    }
    /// Bytes held, sub-modules included (what activation recompute saves).
    pub fn bytes(&self) -> usize {
        self.tensors.iter().map(|t| t.elem_count() * t.dtype().size_in_bytes()).sum::<usize>()
            + self.children.iter().map(Saved::bytes).sum::<usize>()
    }
}

/// What a module needs at run time: the parameters (and their grads) and whether it is training.
pub struct Cx<'a> {
    pub params: &'a ParamTable,
    /// A backward follows this forward, so a module may do part of it now (the GPT loss head on
    /// one tensor-parallel rank writes dlogits over its logits while it has them in hand).
    pub training: bool,
    /// The random draws of the micro-batch being run (dropout), when it has any.
    pub draw: Option<Draw>,
    /// What the backward multiplies the micro-batch's loss by (1 / its rank's micro-batches): a
    /// module that adds a loss of its own (an MoE router's load-balancing loss) scales that
    /// loss's gradient by it, as the language-model loss's is.
    pub grad_scale: f32,
    /// Under --calculate-per-token-loss, the factor such a module's own loss gradient takes in
    /// place of the default (× cp for an MoE router): 1 / a micro-batch's share of the global
    /// batch's loss tokens, so that, as in Megatron, those gradients are summed and divided by the
    /// global count like the language-model loss's. None: the default.
    pub own_loss_scale: Option<f32>,
    /// A recomputed forward under FP8 delayed scaling: the forward scales (`MetaTensors::
    /// fwd_scale`) its first run quantized with, so that it quantizes alike and records no amax.
    pub fp8_replay: Option<&'a Tensor>,
    /// The micro-batch's document-wise attention masks (Megatron's --reset-attention-mask): u32
    /// [B, T], each position's first key (the start of its document); None: plain causal.
    pub docs: Option<&'a Tensor>,
}

impl<'a> Cx<'a> {
    /// A context with no random draws.
    pub fn new(params: &'a ParamTable, training: bool) -> Self {
        Cx { params, training, draw: None, grad_scale: 1.0, own_loss_scale: None, fp8_replay: None, docs: None }
    }
    /// The same context for a micro-batch with `draw`.
    pub fn with_draw(&self, draw: Option<Draw>) -> Cx<'a> {
        Cx { draw, ..*self }
    }
    /// The same context for a backward at `grad_scale`.
    pub fn with_grad_scale(&self, grad_scale: f32) -> Cx<'a> {
        Cx { grad_scale, ..*self }
    }
    /// The same context for a backward whose modules' own losses take `own_loss_scale`.
    pub fn with_own_loss_scale(&self, own_loss_scale: Option<f32>) -> Cx<'a> {
        Cx { own_loss_scale, ..*self }
    }
    /// The same context for a recomputed forward replaying these FP8 forward scales.
    pub fn with_fp8_replay<'b>(&self, scales: Option<&'b Tensor>) -> Cx<'b>
    where
        'a: 'b,
    {
        Cx { fp8_replay: scales, ..*self }
    }
    /// The same context for a micro-batch with these document starts (`docs`).
    pub fn with_docs<'b>(&self, docs: Option<&'b Tensor>) -> Cx<'b>
    where
        'a: 'b,
    {
        Cx { docs, ..*self }
    }
}

/// Where a micro-batch's random numbers come from: the run's seed and the global index of its first
/// sample (samples counted over the whole run, in the order the data sampler hands them out). A
/// module indexes its random words by sample, position and column from there, so the draws depend
/// on which samples a rank holds, not on the layout (data-parallel rank, micro-batch, pipeline
/// stage, a tensor-parallel shard), and a recomputed forward or the backward draws them again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Draw {
    pub seed: u64,
    pub first_sample: u64,
}

/// A layer with an explicit forward and backward.
pub trait Module: Send + Sync {
    /// y = f(x); also returns what backward needs.
    fn forward(&self, cx: &Cx, x: &Tensor) -> Result<(Tensor, Saved)>;
    /// dx from dy; parameter gradients are added into main_grad.
    fn backward(&self, cx: &Cx, saved: Saved, dy: &Tensor) -> Result<Tensor>;

    /// The bias whose gradient is Σ rows of `dy` (the module ends in a biased linear layer), for a
    /// caller that reads `dy` anyway and sums it there (the norm backward after a residual add):
    /// it then runs `backward_without_out_bias`. None (the default): the caller runs `backward`.
    fn out_bias(&self) -> Option<crate::ParamId> {
        None
    }

    /// `backward` leaving `out_bias`'s gradient to the caller. A module whose `out_bias` is Some
    /// implements it; the default refuses (rather than count that gradient twice).
    fn backward_without_out_bias(&self, cx: &Cx, saved: Saved, dy: &Tensor) -> Result<Tensor> {
        let _ = (cx, saved, dy);
        Err(crate::invalid("Module::backward_without_out_bias", "this module leaves no bias gradient to its caller"))
    }

    /// The module's linear products in FP8 (`fp8`: --fp8-format and the recipe) or not (None).
    /// The default, for a module without FP8 products, takes None and refuses a recipe.
    fn set_fp8(&mut self, fp8: Option<&crate::Fp8Recipe>) -> Result<()> {
        match fp8 {
            None => Ok(()),
            Some(r) => Err(crate::invalid(
                "Module::set_fp8",
                format!("this module has no FP8 products ({})", r.format.as_str()),
            )),
        }
    }
}
