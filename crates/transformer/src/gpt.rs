//! GPT model: token (+ learned position) embedding → decoder block → output layer → cross-entropy.
//!
//! Shapes: tokens, labels [B, T] u32; loss_mask [B, T] f32; hidden [B, T, C]; logits [B, T, V].
//! The loss is the mean over unmasked tokens. Backward takes `grad_scale` (1 / micro-batches for
//! gradient accumulation) and adds every parameter gradient into main_grad. With tied weights the
//! output layer is the word embedding, so both paths add into the same main_grad view.

use crate::config::TransformerConfig;
use crate::layer::TransformerBlock;
use crate::spec::PositionEmbedding;
use crate::{ModelError, Result};
use ferrotron_core::{
    Cx, DType, Device, Init, Module, ParamId, ParamMeta, ParamTable, ParamTableBuilder, Saved, Tensor,
};
use ferrotron_kernels::{self as k, CrossEntropyCfg};

/// One micro-batch.
#[derive(Clone, Debug)]
pub struct Batch {
    pub tokens: Tensor,
    pub labels: Tensor,
    pub loss_mask: Tensor,
}

pub struct GptModel {
    pub config: TransformerConfig,
    pub word_embeddings: ParamId,
    pub position_embeddings: Option<ParamId>,
    pub decoder: TransformerBlock,
    pub output_layer: ParamId,
}

/// What the forward keeps for the backward.
pub struct GptSaved {
    tokens: Tensor,
    positions: Option<Tensor>,
    decoder: Saved,
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
    /// Validates the config, then builds the model and its parameter table on `device`.
    pub fn build(
        config: TransformerConfig,
        device: &Device,
        dtype: DType,
        seed: u64,
    ) -> Result<(GptModel, ParamTable)> {
        config.validate()?;
        let mut p = ParamTableBuilder::default();
        let (h, v) = (config.hidden_size, config.padded_vocab_size);
        let std = Init::Normal { std: config.init_method_std };
        let word_embeddings = p.add(ParamMeta::replicated("embedding.word_embeddings.weight", [v, h], std, true))?;
        let position_embeddings = match config.position_embedding {
            PositionEmbedding::LearnedAbsolute => Some(p.add(ParamMeta::replicated(
                "embedding.position_embeddings.weight",
                [config.max_position_embeddings, h],
                std,
                true,
            ))?),
            _ => None,
        };
        let decoder = TransformerBlock::new(&mut p, "decoder", &config)?;
        let output_layer = if config.untie_embeddings_and_output_weights {
            p.add(ParamMeta::replicated("output_layer.weight", [v, h], std, true))?
        } else {
            word_embeddings
        };
        let table = p.build(device, dtype, seed)?;
        Ok((GptModel { config, word_embeddings, position_embeddings, decoder, output_layer }, table))
    }

    fn positions(&self, tokens: &Tensor) -> Result<Option<Tensor>> {
        let Some(_) = self.position_embeddings else { return Ok(None) };
        let (b, t) = (tokens.dims()[0], tokens.dims()[1]);
        if t > self.config.max_position_embeddings {
            return Err(ModelError::Config(format!(
                "sequence of {t} tokens exceeds --max-position-embeddings {}",
                self.config.max_position_embeddings
            )));
        }
        let ids: Vec<u32> = (0..b).flat_map(|_| 0..t as u32).collect();
        Ok(Some(Tensor::from_vec(ids, [b, t], tokens.device())?))
    }

    /// Final hidden states [B, T, C] and what the decoder saved.
    fn hidden(&self, cx: &Cx, tokens: &Tensor) -> Result<(Tensor, Option<Tensor>, Saved)> {
        if tokens.shape().rank() != 2 {
            return Err(
                ferrotron_core::shape_mismatch("GptModel::forward", "tokens [batch, seq]", tokens.dims()).into()
            );
        }
        let mut x = k::embedding_fwd(tokens, &cx.params.param(self.word_embeddings)?)?;
        let positions = self.positions(tokens)?;
        if let (Some(pos), Some(pe)) = (&positions, self.position_embeddings) {
            x = k::add(&x, &k::embedding_fwd(pos, &cx.params.param(pe)?)?)?;
        }
        let (h, s) = self.decoder.forward(cx, &x)?;
        Ok((h, positions, s))
    }

    /// Logits [B, T, V] (for generation and evaluation).
    pub fn logits(&self, cx: &Cx, tokens: &Tensor) -> Result<Tensor> {
        let (h, _, _) = self.hidden(cx, tokens)?;
        Ok(k::matmul(&h, &cx.params.param(self.output_layer)?, false, true)?)
    }

    /// Mean loss over unmasked tokens, and what the backward needs.
    pub fn forward(&self, cx: &Cx, batch: &Batch) -> Result<(f64, GptSaved)> {
        let (h, positions, decoder) = self.hidden(cx, &batch.tokens)?;
        let logits = k::matmul(&h, &cx.params.param(self.output_layer)?, false, true)?;
        let n = batch.tokens.elem_count();
        let flat = logits.reshape([n, self.config.padded_vocab_size])?;
        let labels = batch.labels.reshape([n])?;
        let mask = batch.loss_mask.reshape([n])?;
        let (loss, lse) = k::cross_entropy_fwd(&flat, &labels, Some(&mask), CrossEntropyCfg::default())?;
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
        let n = saved.labels.elem_count();
        if saved.num_tokens <= 0.0 {
            return Ok(());
        }
        let g = (grad_scale as f64 / saved.num_tokens) as f32;
        let dloss = Tensor::from_vec(vec![g; n], [n], saved.logits.device())?;
        let dlogits = k::cross_entropy_bwd(
            &saved.logits,
            &saved.labels,
            Some(&saved.loss_mask),
            &saved.lse,
            &dloss,
            CrossEntropyCfg::default(),
        )?;
        let (h, c) = (&saved.hidden, self.config.hidden_size);
        let w_out = cx.params.param(self.output_layer)?;
        let dh = k::matmul(&dlogits, &w_out, false, false)?.reshape(h.dims().to_vec())?;
        k::matmul_into(&cx.params.grad(self.output_layer)?, &dlogits, &h.reshape([n, c])?, true, false, true)?;
        let dx = self.decoder.backward(cx, saved.decoder, &dh)?;
        k::embedding_bwd(&saved.tokens, &dx, &cx.params.grad(self.word_embeddings)?)?;
        if let (Some(pos), Some(pe)) = (&saved.positions, self.position_embeddings) {
            k::embedding_bwd(pos, &dx, &cx.params.grad(pe)?)?;
        }
        Ok(())
    }

    /// The parameter the output layer uses (the word embedding when tied).
    pub fn output_weight(&self) -> ParamId {
        self.output_layer
    }
}

impl From<ferrotron_core::Error> for ModelError {
    fn from(e: ferrotron_core::Error) -> Self {
        ModelError::Core(e)
    }
}
