//! Vocabulary-parallel embedding: rank r holds rows r·V/tp .. of the padded table [V, C]. Each
//! rank looks up the ids it holds (zeros elsewhere) and the partial rows are summed over the group
//! (or reduce-scattered along T under sequence parallelism).

use crate::tp::TensorParallel;
use ferrotron_core::{Cx, Init, ParamId, ParamMeta, ParamTableBuilder, Result, Shard, Tensor};
use ferrotron_kernels as k;

#[derive(Debug, Clone)]
pub struct VocabParallelEmbedding {
    pub weight: ParamId,
    /// Real vocabulary (ids must be below it).
    pub vocab_size: usize,
    /// Padded vocabulary, a multiple of the group size.
    pub padded_vocab_size: usize,
    pub tp: TensorParallel,
}

impl VocabParallelEmbedding {
    pub fn new(
        p: &mut ParamTableBuilder,
        name: &str,
        vocab_size: usize,
        padded_vocab_size: usize,
        hidden: usize,
        std: f32,
        tp: &TensorParallel,
    ) -> Result<Self> {
        let shard = Shard::of(tp.rank(), tp.size());
        let weight =
            p.add(ParamMeta::split(name, [padded_vocab_size, hidden], 0, shard, Init::Normal { std }, true)?)?;
        Ok(VocabParallelEmbedding { weight, vocab_size, padded_vocab_size, tp: tp.clone() })
    }

    /// First vocabulary row this rank holds.
    pub fn vocab_start(&self) -> usize {
        self.tp.rank() * self.padded_vocab_size / self.tp.size()
    }

    /// ids [B, T] → [B, T, C] (or [B, T/tp, C] under sequence parallelism).
    pub fn forward(&self, cx: &Cx, ids: &Tensor) -> Result<Tensor> {
        let w = cx.params.param(self.weight)?;
        let partial = k::embedding_fwd_shard(ids, &w, self.vocab_start(), self.vocab_size)?;
        self.tp.exit(&partial)
    }

    /// dW += scatter(dy) for the rows this rank holds.
    pub fn backward(&self, cx: &Cx, ids: &Tensor, dy: &Tensor) -> Result<()> {
        let dy = self.tp.exit_bwd(dy)?;
        k::embedding_bwd_shard(ids, &dy, &cx.params.grad(self.weight)?, self.vocab_start(), self.vocab_size)
    }
}
