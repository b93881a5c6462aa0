//! GPT model: token (+ learned position) embedding → decoder block → output layer → cross-entropy.
//!
//! Shapes: tokens, labels [B, T] u32 (the same on every tensor-parallel rank); loss_mask [B, T]
//! f32; hidden [B, T, C] ([B, T/tp, C] under sequence parallelism); logits [B, T, V/tp] (this
//! rank's vocabulary shard). The loss is the mean over unmasked tokens. Backward takes
//! `grad_scale` (1 / micro-batches for gradient accumulation) and adds every parameter gradient
//! into main_grad. With tied weights the output layer is the word embedding, so both paths add
//! into the same main_grad view.

use crate::config::TransformerConfig;
use crate::layer::TransformerBlock;
use crate::spec::PositionEmbedding;
use crate::{ModelError, Result};
use ferrotron_core::{
    Cx, DType, Device, Init, Module, ParamId, ParamMeta, ParamTable, ParamTableBuilder, Saved, Shard, Tensor,
};
use ferrotron_kernels as k;
use ferrotron_parallel::{
    ProcessGroups, TensorParallel, VocabParallelCe, VocabParallelEmbedding, vocab_parallel_ce_bwd,
    vocab_parallel_ce_fwd,
};

/// One micro-batch.
#[derive(Clone, Debug)]
pub struct Batch {
    pub tokens: Tensor,
    pub labels: Tensor,
    pub loss_mask: Tensor,
}

pub struct GptModel {
    pub config: TransformerConfig,
    pub embedding: VocabParallelEmbedding,
    pub position_embeddings: Option<ParamId>,
    pub decoder: TransformerBlock,
    pub output_layer: ParamId,
    pub tp: TensorParallel,
}

/// What the forward keeps for the backward.
pub struct GptSaved {
    tokens: Tensor,
    positions: Option<Tensor>,
    decoder: Saved,
    /// Final hidden states entering the output layer (gathered along T under SP).
    hidden: Tensor,
    logits: Tensor,
    labels: Tensor,
    loss_mask: Tensor,
    lse: Tensor,
    num_tokens: f64,
}

impl GptSaved {
    pub fn bytes(&self) -> usize {
        let b = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        self.decoder.bytes() + b(&self.hidden) + b(&self.logits) + b(&self.lse)
    }
}

impl GptModel {
    /// One rank: validates the config, then builds the model and its parameter table on `device`.
    pub fn build(
        config: TransformerConfig,
        device: &Device,
        dtype: DType,
        seed: u64,
    ) -> Result<(GptModel, ParamTable)> {
        let tp = TensorParallel::new(ProcessGroups::single().tp, false);
        Self::build_parallel(config, &tp, device, dtype, seed, 1)
    }

    /// This rank's part of the model under tensor (and sequence) parallelism `tp`. Parameters
    /// hold exactly their part of what `build` makes with the same seed. The flat buffers are
    /// padded to a multiple of `pad_to` (the data-parallel size, so buckets split evenly).
    pub fn build_parallel(
        config: TransformerConfig,
        tp: &TensorParallel,
        device: &Device,
        dtype: DType,
        seed: u64,
        pad_to: usize,
    ) -> Result<(GptModel, ParamTable)> {
        config.validate()?;
        config.validate_tp(tp.size())?;
        let mut p = ParamTableBuilder::default();
        let (h, v) = (config.hidden_size, config.padded_vocab_size(tp.size()));
        let std = config.init_method_std;
        let embedding =
            VocabParallelEmbedding::new(&mut p, "embedding.word_embeddings.weight", config.vocab_size, v, h, std, tp)?;
        let position_embeddings = match config.position_embedding {
            PositionEmbedding::LearnedAbsolute => Some(
                p.add(
                    ParamMeta::replicated(
                        "embedding.position_embeddings.weight",
                        [config.max_position_embeddings, h],
                        Init::Normal { std },
                        true,
                    )
                    .on_sequence_shards(tp.sp()),
                )?,
            ),
            _ => None,
        };
        let decoder = TransformerBlock::new(&mut p, "decoder", &config, tp)?;
        let output_layer = if config.untie_embeddings_and_output_weights {
            let shard = Shard { rank: tp.rank(), size: tp.size(), chunks: 1 };
            p.add(ParamMeta::split("output_layer.weight", [v, h], 0, shard, Init::Normal { std }, true)?)?
        } else {
            embedding.weight
        };
        let table = p.build_padded(device, dtype, seed, pad_to)?;
        let model = GptModel { config, position_embeddings, decoder, output_layer, embedding, tp: tp.clone() };
        Ok((model, table))
    }

    fn ce(&self) -> VocabParallelCe {
        VocabParallelCe {
            vocab_size: self.config.vocab_size,
            padded_vocab_size: self.config.padded_vocab_size(self.tp.size()),
        }
    }

    /// Position ids of this rank's tokens: [B, T], or its [B, T/tp] slice under SP.
    fn positions(&self, tokens: &Tensor) -> Result<Option<Tensor>> {
        let Some(_) = self.position_embeddings else { return Ok(None) };
        let (b, t) = (tokens.dims()[0], tokens.dims()[1]);
        if t > self.config.max_position_embeddings {
            return Err(ModelError::Config(format!(
                "sequence of {t} tokens exceeds --max-position-embeddings {}",
                self.config.max_position_embeddings
            )));
        }
        let (start, len) = if self.tp.sp() {
            let tl = self.tp.shard_len(t)?;
            (self.tp.rank() * tl, tl)
        } else {
            (0, t)
        };
        let ids: Vec<u32> = (0..b).flat_map(|_| (start..start + len).map(|i| i as u32)).collect();
        Ok(Some(Tensor::from_vec(ids, [b, len], tokens.device())?))
    }

    /// Final hidden states [B, T, C] (this rank's [B, T/tp, C] under SP) and what the decoder saved.
    fn hidden(&self, cx: &Cx, tokens: &Tensor) -> Result<(Tensor, Option<Tensor>, Saved)> {
        if tokens.shape().rank() != 2 {
            return Err(
                ferrotron_core::shape_mismatch("GptModel::forward", "tokens [batch, seq]", tokens.dims()).into()
            );
        }
        if self.tp.sp() {
            self.tp.shard_len(tokens.dims()[1])?;
        }
        let mut x = self.embedding.forward(cx, tokens)?;
        let positions = self.positions(tokens)?;
        if let (Some(pos), Some(pe)) = (&positions, self.position_embeddings) {
            x = k::add(&x, &k::embedding_fwd(pos, &cx.params.param(pe)?)?)?;
        }
        let (h, s) = self.decoder.forward(cx, &x)?;
        Ok((h, positions, s))
    }

    /// Logits [B, T, V] over the whole padded vocabulary (for generation and evaluation).
    pub fn logits(&self, cx: &Cx, tokens: &Tensor) -> Result<Tensor> {
        let (h, _, _) = self.hidden(cx, tokens)?;
        let h = self.tp.enter(&h)?;
        let local = k::matmul(&h, &cx.params.param(self.output_layer)?, false, true)?;
        Ok(self.tp.gather_last(&local)?)
    }

    /// Mean loss over unmasked tokens, and what the backward needs.
    pub fn forward(&self, cx: &Cx, batch: &Batch) -> Result<(f64, GptSaved)> {
        let (h, positions, decoder) = self.hidden(cx, &batch.tokens)?;
        let h = self.tp.enter(&h)?;
        let logits = k::matmul(&h, &cx.params.param(self.output_layer)?, false, true)?;
        let n = batch.tokens.elem_count();
        let flat = logits.reshape([n, logits.shape().last()])?;
        let labels = batch.labels.reshape([n])?;
        let mask = batch.loss_mask.reshape([n])?;
        let (loss, lse) = vocab_parallel_ce_fwd(self.ce(), &self.tp, &flat, &labels, Some(&mask))?;
        let num_tokens: f64 = mask.to_vec_f32()?.iter().map(|&m| m as f64).sum();
        let total: f64 = loss.to_vec_f32()?.iter().map(|&l| l as f64).sum();
        let mean = if num_tokens > 0.0 { total / num_tokens } else { 0.0 };
        let saved = GptSaved {
            tokens: batch.tokens.clone(),
            positions,
            decoder,
            hidden: h,
            logits: flat,
            labels,
            loss_mask: mask,
            lse,
            num_tokens,
        };
        Ok((mean, saved))
    }

    /// Gradients of `grad_scale · loss`, added into main_grad.
    pub fn backward(&self, cx: &Cx, saved: GptSaved, grad_scale: f32) -> Result<()> {
        self.backward_with(cx, saved, grad_scale, &mut |_| Ok(()))
    }

    /// `backward` that calls `done(offset)` whenever every gradient at flat offsets ≥ `offset` is
    /// final: after the output layer, the final norm, each layer, and (0) the embeddings.
    pub fn backward_with(
        &self,
        cx: &Cx,
        saved: GptSaved,
        grad_scale: f32,
        done: &mut dyn FnMut(usize) -> ferrotron_core::Result<()>,
    ) -> Result<()> {
        let n = saved.labels.elem_count();
        if saved.num_tokens <= 0.0 {
            return Ok(());
        }
        let g = (grad_scale as f64 / saved.num_tokens) as f32;
        let dloss = Tensor::from_vec(vec![g; n], [n], saved.logits.device())?;
        let dlogits = vocab_parallel_ce_bwd(
            self.ce(),
            &self.tp,
            &saved.logits,
            &saved.labels,
            Some(&saved.loss_mask),
            &saved.lse,
            &dloss,
        )?;
        let (h, c) = (&saved.hidden, self.config.hidden_size);
        let w_out = cx.params.param(self.output_layer)?;
        let dh = k::matmul(&dlogits, &w_out, false, false)?.reshape(h.dims().to_vec())?;
        k::matmul_into(&cx.params.grad(self.output_layer)?, &dlogits, &h.reshape([n, c])?, true, false, true)?;
        let dh = self.tp.enter_bwd(&dh)?;
        if self.config.untie_embeddings_and_output_weights {
            done(cx.params.range(self.output_layer).start)?;
        }
        let dx = self.decoder.backward_with(cx, saved.decoder, &dh, done)?;
        self.embedding.backward(cx, &saved.tokens, &dx)?;
        if let (Some(pos), Some(pe)) = (&saved.positions, self.position_embeddings) {
            k::embedding_bwd(pos, &dx, &cx.params.grad(pe)?)?;
        }
        done(0)?;
        Ok(())
    }

    /// The parameter the output layer uses (the word embedding when tied).
    pub fn output_weight(&self) -> ParamId {
        self.output_layer
    }

    /// The word embedding parameter.
    pub fn word_embeddings(&self) -> ParamId {
        self.embedding.weight
    }
}

impl From<ferrotron_core::Error> for ModelError {
    fn from(e: ferrotron_core::Error) -> Self {
        ModelError::Core(e)
    }
}
