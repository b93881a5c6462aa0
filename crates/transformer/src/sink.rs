//! The sink softmax of an attention module (`SoftmaxType::OffByOne` / `Learnable`, Megatron's
//! --softmax-type): one more logit a head in every row's softmax, a key with no value. It is
//! applied to the core attention's finished (o, lse) (`k::attention_sink_`), so every core
//! attention path (fused QKV, split, context-parallel, multi-latent) takes it unchanged, and
//! the core attention's backward on the new (o, lse) is already the sink softmax's; the sink's
//! own gradient is a column sum of per-row terms (`k::attention_sink_bwd`).
//!
//! The learned logits are `{prefix}.core_attention.softmax_offset` [heads], split over the
//! tensor-parallel ranks with their heads (Megatron's sharding), initialised as the other
//! weights, without weight decay (a 1-D parameter). Each rank's rows give its heads' whole
//! gradient; under context parallelism the ranks' parts are summed with the data-parallel
//! reduction, as every weight's.

use crate::spec::SoftmaxType;
use ferrotron_core::{Cx, DType, Init, ParamId, ParamMeta, ParamTableBuilder, Result, Shard, Tensor};
use ferrotron_kernels as k;
use ferrotron_parallel::TensorParallel;

#[derive(Debug, Clone, Copy)]
pub enum Sink {
    /// The logit is 0 for every head.
    OffByOne { heads: usize },
    /// This rank's heads' learned logits.
    Learned(ParamId),
}

impl Sink {
    /// The sink of `softmax` for `heads` heads (all ranks'), or None for the plain softmax.
    pub fn new(
        p: &mut ParamTableBuilder,
        prefix: &str,
        softmax: SoftmaxType,
        heads: usize,
        std: f32,
        tp: &TensorParallel,
    ) -> Result<Option<Self>> {
        Ok(match softmax {
            SoftmaxType::Vanilla => None,
            SoftmaxType::OffByOne => Some(Sink::OffByOne { heads: heads / tp.size() }),
            SoftmaxType::Learnable => {
                let meta = ParamMeta::split(
                    format!("{prefix}.core_attention.softmax_offset"),
                    [heads],
                    0,
                    Shard::of(tp.rank(), tp.size()),
                    Init::Normal { std },
                    false,
                )?;
                Some(Sink::Learned(p.add(meta)?))
            }
        })
    }

    /// The logits as the kernels take them: f32 [heads on this rank].
    fn logits(&self, cx: &Cx, like: &Tensor) -> Result<Tensor> {
        match *self {
            Sink::OffByOne { heads } => Tensor::zeros([heads], DType::F32, like.device()),
            Sink::Learned(id) => {
                let w = cx.params.param(id)?;
                if w.dtype() == DType::F32 { Ok(w) } else { k::cast(&w, DType::F32) }
            }
        }
    }

    /// (o, lse) of the plain softmax become the sink softmax's, in place.
    pub fn forward_(&self, cx: &Cx, o: &Tensor, lse: &Tensor) -> Result<()> {
        k::attention_sink_(o, lse, &self.logits(cx, o)?)
    }

    /// The learned logits' gradient for dO on the forward's (o, lse) (nothing for off-by-one).
    pub fn backward(&self, cx: &Cx, o: &Tensor, lse: &Tensor, d_o: &Tensor) -> Result<()> {
        let Sink::Learned(id) = *self else { return Ok(()) };
        let terms = k::attention_sink_bwd(o, lse, d_o, &self.logits(cx, o)?)?;
        let h = terms.dims()[2];
        let rows = terms.elem_count() / h;
        let (g, acc) = cx.params.grad_acc(id)?;
        k::bias_grad_into(&g, &terms.reshape([rows, h])?, acc)
    }
}
