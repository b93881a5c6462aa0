//! GPT model: token (+ learned position) embedding → decoder layers → final norm → output layer →
//! cross-entropy; or, under pipeline parallelism, this rank's part of it.
//!
//! Shapes: tokens, labels [B, T] u32 (the same on every tensor-parallel rank); loss_mask [B, T]
//! f32; hidden [B, T, C] ([B, T/tp, C] under sequence parallelism); logits [B, T, V/tp] (this
//! rank's vocabulary shard). The loss is the mean over unmasked tokens. Backward takes
//! `grad_scale` (1 / micro-batches for gradient accumulation) and adds every parameter gradient
//! into main_grad. With tied weights the output layer is the word embedding, so both paths add
//! into the same main_grad view; when the first and last pipeline stages differ, the last holds a
//! copy (`ParamMeta::pipeline_copy`) whose grads the optimizer sums with the first stage's.
//!
//! A pipeline rank holds one model chunk per virtual stage (`StagePlan::chunks`); chunk `c` runs
//! with `forward_chunk`/`backward_chunk`. The first stage's first chunk embeds tokens, the last
//! stage's last chunk computes the loss; other chunks map hidden states to hidden states.
//!
//! Under context parallelism (`set_context_parallel`) a micro-batch's tokens are this rank's two
//! chunks of each sequence ([`ContextParallel::shard_host`]), T above is their count, and the
//! batch's token count is the whole sequences' over the cp size (so the loss's gradient, averaged
//! over data × context parallel ranks, is the whole batch's mean's).

use crate::config::TransformerConfig;
use crate::dropout::{HiddenDropout, maybe};
use crate::layer::TransformerBlock;
use crate::mtp::{Mtp, MtpLayer, MtpLayerSaved, roll_left};
use crate::recompute::Recompute;
use crate::spec::PositionEmbedding;
use crate::vision::{Images, VisionModel, VisionSaved, VisionSpec};
use crate::{ModelError, Result};
use ferrotron_core::{
    Cx, DType, Device, Draw, Init, Module, ParamId, ParamMeta, ParamTable, ParamTableBuilder, Saved, Shard, Tensor,
};
use ferrotron_kernels as k;
use ferrotron_parallel::pipeline::StagePlan;
use ferrotron_parallel::{
    ContextParallel, CpCommType, ProcessGroups, TensorParallel, VocabParallelCe, VocabParallelEmbedding,
    vocab_parallel_ce_bwd, vocab_parallel_ce_fwd, vocab_parallel_ce_fwd_bwd_,
};

/// One micro-batch. Built by `new` or `unmasked`, which count the loss-mask tokens once, so
/// the count always matches the mask.
#[derive(Clone, Debug)]
pub struct Batch {
    pub tokens: Tensor,
    pub labels: Tensor,
    pub loss_mask: Tensor,
    /// Σ loss_mask, counted once when the batch is made (so a step never reads it back from the
    /// device).
    num_tokens: f64,
    /// Σ over the batch's rows of the mask at each position [T]: the multi-token prediction
    /// depths' counts (a depth k counts the positions from k on), known without a read back.
    mask_by_position: Vec<f64>,
    /// 1 / num_tokens (0 for none) as one f32 on the batch's device: the fused cross-entropy reads
    /// its gradient scale from here when it runs, so a CUDA graph captured on one batch replays
    /// the right mean for a batch with another loss-token count (copied into this tensor).
    inv_tokens: Tensor,
    /// Where its random draws (hidden dropout) come from: the trainer gives each training
    /// micro-batch the global index of its first sample.
    pub draw: Option<Draw>,
    /// A multimodal model's images, whose features replace the placeholder tokens' embeddings.
    pub images: Option<Images>,
    /// Under --calculate-per-token-loss, the scale of its modules' own losses' gradients
    /// (`Cx::own_loss_scale`); set with the token count by `per_token`.
    own_loss_scale: Option<f32>,
    /// Under context parallelism, the multi-token prediction depths' inputs, rolled along the
    /// whole sequences before they were split (`with_mtp_rolled`); None: rolled here.
    mtp_rolled: Option<MtpRolled>,
    /// The learned position embedding's ids of the tokens [B, T] on the host (Megatron's
    /// --reset-position-ids: counting from 0 again after each end of document), or None: each
    /// row's own (global) position.
    position_ids: Option<Vec<u32>>,
    /// Document-wise attention masks (Megatron's --reset-attention-mask): u32 [B, T] on the
    /// tokens' device, each position's first key (`AttnCfg::docs`); under context parallelism
    /// the whole rows' [B, S] (`with_whole_row_document_starts`); None: plain causal.
    docs: Option<Tensor>,
}

/// The MTP depths' tokens, labels and loss masks for one context-parallel rank: each depth k's
/// moved k places left along the whole sequences (`mtp::roll_left`), then cut to the rank's
/// chunks, with the counts as the main loss takes them (the whole sequences' over the cp size).
#[derive(Clone, Debug)]
pub struct MtpRolled {
    /// Depth k at index k − 1: (tokens, labels, mask) [B, local T] and the depth's count.
    pub depths: Vec<(Tensor, Tensor, Tensor, f64)>,
    /// The main loss's count (depth 0's), on the same scale.
    pub all: f64,
}

impl Batch {
    /// A batch; counts the mask's tokens (one read of `loss_mask`, before any compute is queued).
    pub fn new(tokens: Tensor, labels: Tensor, loss_mask: Tensor) -> Result<Batch> {
        let mask = loss_mask.to_vec_f32()?;
        let num_tokens = mask.iter().map(|&m| m as f64).sum();
        let mask_by_position = by_position(&mask, tokens.dims());
        Batch::from_counts(tokens, labels, loss_mask, num_tokens, mask_by_position)
    }

    /// A batch whose mask's count (and per-position counts) are known.
    fn from_counts(
        tokens: Tensor,
        labels: Tensor,
        loss_mask: Tensor,
        num_tokens: f64,
        mask_by_position: Vec<f64>,
    ) -> Result<Batch> {
        let inv_tokens = inverse_count(num_tokens, loss_mask.device())?;
        Ok(Batch {
            tokens,
            labels,
            loss_mask,
            num_tokens,
            mask_by_position,
            inv_tokens,
            draw: None,
            images: None,
            own_loss_scale: None,
            mtp_rolled: None,
            position_ids: None,
            docs: None,
        })
    }

    /// The batch with document-wise attention masks: `starts` [B·T], each token's document's
    /// first position in its row (`ferrotron_data::document_starts`), at most its own and never
    /// before the previous token's.
    pub fn with_document_starts(self, starts: Vec<u32>) -> Result<Batch> {
        let t = self.tokens.dims().get(1).copied().unwrap_or(0);
        self.with_whole_row_document_starts(starts, t)
    }

    /// `with_document_starts` for a context-parallel rank, whose tokens are its chunks of rows of
    /// `seq` tokens: `starts` [B·seq] are the whole rows' (global positions), which the
    /// all-to-all attention reads after trading rows for heads.
    pub fn with_whole_row_document_starts(self, starts: Vec<u32>, seq: usize) -> Result<Batch> {
        let dims = self.tokens.dims().to_vec();
        let [b, local] = dims[..] else {
            return Err(ModelError::Config(format!("document starts need tokens [B, T], got {dims:?}")));
        };
        if seq == 0 || seq % local.max(1) != 0 {
            return Err(ModelError::Config(format!(
                "document starts of rows of {seq} tokens for a batch of {local} tokens a row: a rank's rows are a part of the whole rows"
            )));
        }
        if starts.len() != b * seq {
            return Err(ModelError::Config(format!(
                "{} document starts for a batch of {} tokens: give one per token",
                starts.len(),
                b * seq
            )));
        }
        if let Some(e) = k::document_starts_error(&starts, seq) {
            return Err(ModelError::Config(e));
        }
        let docs = Tensor::from_vec(starts, [b, seq], self.tokens.device())?;
        Ok(Batch { docs: Some(docs), ..self })
    }

    /// The batch with its tokens' learned-position ids (`position_ids`), as many as tokens.
    pub fn with_position_ids(self, ids: Vec<u32>) -> Result<Batch> {
        if ids.len() != self.tokens.elem_count() {
            return Err(ModelError::Config(format!(
                "{} position ids for a batch of {} tokens: give one per token",
                ids.len(),
                self.tokens.elem_count()
            )));
        }
        Ok(Batch { position_ids: Some(ids), ..self })
    }

    /// The document-wise attention masks (`with_document_starts`), if any.
    pub fn docs(&self) -> Option<&Tensor> {
        self.docs.as_ref()
    }

    /// The batch with its random draws' origin (see `Draw`).
    pub fn with_draw(self, draw: Draw) -> Batch {
        Batch { draw: Some(draw), ..self }
    }

    /// The batch with images (a multimodal model's micro-batch).
    pub fn with_images(self, images: Images) -> Batch {
        Batch { images: Some(images), ..self }
    }

    /// A batch whose every label counts: an all-ones mask on the tokens' device, no read back.
    pub fn unmasked(tokens: Tensor, labels: Tensor) -> Result<Batch> {
        let n = tokens.elem_count();
        let loss_mask = Tensor::from_vec(vec![1f32; n], tokens.dims().to_vec(), tokens.device())?;
        let rows = tokens.dims().first().copied().unwrap_or(1) as f64;
        let mask_by_position = vec![rows; tokens.dims().get(1).copied().unwrap_or(n)];
        Batch::from_counts(tokens, labels, loss_mask, n as f64, mask_by_position)
    }

    /// The batch with `num_tokens` as its token count (the mean's denominator) instead of its
    /// mask's: a context-parallel rank's share of the whole sequences' count.
    pub fn with_num_tokens(self, num_tokens: f64) -> Result<Batch> {
        let inv_tokens = inverse_count(num_tokens, self.tokens.device())?;
        Ok(Batch { num_tokens, inv_tokens, ..self })
    }

    /// --calculate-per-token-loss: `share` (the global batch's loss tokens over its micro-batches
    /// on all data × context-parallel ranks) as the count, and the routers' losses' gradients at
    /// 1 / share of their default per-micro-batch scale, so that every gradient is the sum over
    /// the global batch divided by its token count, as Megatron's are.
    pub fn per_token(self, share: f64) -> Result<Batch> {
        let own = if share > 0.0 { (1.0 / share) as f32 } else { 0.0 };
        Ok(Batch { own_loss_scale: Some(own), ..self.with_num_tokens(share)? })
    }

    /// A batch with a loss mask made on the host (`mask` as long as the tokens): counted there and
    /// uploaded to the tokens' device, with no read back.
    pub fn masked(tokens: Tensor, labels: Tensor, mask: Vec<f32>) -> Result<Batch> {
        let num_tokens = mask.iter().map(|&m| m as f64).sum();
        let mask_by_position = by_position(&mask, tokens.dims());
        let loss_mask = Tensor::from_vec(mask, tokens.dims().to_vec(), tokens.device())?;
        Batch::from_counts(tokens, labels, loss_mask, num_tokens, mask_by_position)
    }

    /// Σ loss_mask.
    pub fn num_tokens(&self) -> f64 {
        self.num_tokens
    }

    /// 1 / Σ loss_mask (0 where nothing counts) as one f32 on the batch's device.
    pub fn inv_tokens(&self) -> &Tensor {
        &self.inv_tokens
    }

    /// Loss tokens at positions k.. of the rows: what multi-token prediction depth k counts.
    pub fn mask_count_from(&self, k: usize) -> f64 {
        match &self.mtp_rolled {
            Some(r) if k == 0 => r.all,
            Some(r) => r.depths.get(k - 1).map_or(0.0, |d| d.3),
            None => self.mask_by_position.iter().skip(k).sum(),
        }
    }

    /// The batch with its MTP depths' inputs rolled along the whole sequences (context
    /// parallelism: a rank's chunks do not hold the tokens that roll into them).
    pub fn with_mtp_rolled(self, rolled: MtpRolled) -> Batch {
        Batch { mtp_rolled: Some(rolled), ..self }
    }

    /// MTP depth k's (tokens, labels, mask): rolled here, or as `with_mtp_rolled` gave them.
    fn mtp_inputs(&self, k: usize) -> Result<(Tensor, Tensor, Tensor)> {
        match &self.mtp_rolled {
            Some(r) => {
                let d =
                    r.depths.get(k - 1).ok_or_else(|| ModelError::Config(format!("the batch has no MTP depth {k}")))?;
                Ok((d.0.clone(), d.1.clone(), d.2.clone()))
            }
            None => Ok((roll_left(&self.tokens, k)?, roll_left(&self.labels, k)?, roll_left(&self.loss_mask, k)?)),
        }
    }

    /// Depth k's denominator: its own count, scaled as `num_tokens` is scaled from the mask's
    /// (under `--calculate-per-token-loss` a share of the global batch: Megatron weighs an MTP
    /// depth's per-token losses by the main loss's count over the depth's, before that share).
    fn depth_denominator(&self, k: usize) -> f64 {
        let (all, from) = (self.mask_count_from(0), self.mask_count_from(k));
        if all > 0.0 { self.num_tokens * from / all } else { 0.0 }
    }
}

/// Σ over the rows of a [B, T] mask, per position (a mask of another shape: one entry).
fn by_position(mask: &[f32], dims: &[usize]) -> Vec<f64> {
    let t = match dims {
        [_, t] if *t > 0 => *t,
        _ => return vec![mask.iter().map(|&m| m as f64).sum()],
    };
    let mut out = vec![0.0; t];
    for row in mask.chunks(t) {
        out.iter_mut().zip(row).for_each(|(o, &m)| *o += m as f64);
    }
    out
}

/// The mean's scale, 1 / count (0 for an empty count), as a one-element f32 tensor on `dev`.
fn inverse_count(count: f64, dev: &Device) -> Result<Tensor> {
    let inv = if count > 0.0 { (1.0 / count) as f32 } else { 0.0 };
    Ok(Tensor::from_f32(&[inv], [1], DType::F32, dev)?)
}

/// The last stage's per-token losses of one micro-batch, left on the device until `mean` reads
/// them (after the step's work is queued: no host synchronisation inside the step).
pub struct MicroLoss {
    /// Masked per-token losses [N].
    pub per_token: Tensor,
    pub num_tokens: f64,
    /// The multi-token prediction depths' losses (1..D; each over its own loss tokens), not in
    /// `mean` (Megatron logs them apart, as `mtp_k loss`).
    pub mtp: Vec<MicroLoss>,
}

impl MicroLoss {
    /// Losses without multi-token prediction depths.
    pub fn new(per_token: Tensor, num_tokens: f64) -> MicroLoss {
        MicroLoss { per_token, num_tokens, mtp: vec![] }
    }

    /// Mean over the unmasked tokens (0 when there are none), summed in f64.
    pub fn mean(&self) -> Result<f64> {
        let (total, n) = self.sum()?;
        Ok(if n <= 0.0 { 0.0 } else { total / n })
    }

    /// (the unmasked tokens' losses summed in f64, their count): Megatron reports a batch's loss
    /// as the one over the other across all its micro-batches and data-parallel ranks.
    pub fn sum(&self) -> Result<(f64, f64)> {
        let total: f64 = self.per_token.to_vec_f32()?.iter().map(|&l| l as f64).sum();
        Ok((total, self.num_tokens))
    }
}

pub struct GptModel {
    pub config: TransformerConfig,
    /// First stage only.
    pub embedding: Option<VocabParallelEmbedding>,
    pub position_embeddings: Option<ParamId>,
    /// One block of layers per model chunk; the last stage's last chunk ends with the final norm.
    pub chunks: Vec<TransformerBlock>,
    /// Last stage only (the word embedding, or its copy, when tied).
    pub output_layer: Option<ParamId>,
    pub plan: StagePlan,
    pub tp: TensorParallel,
    /// Hidden dropout on the embedding's output (first stage, rate above 0).
    embedding_dropout: Option<HiddenDropout>,
    /// The position ids uploaded (learned absolute positions), the last few shapes: every step of
    /// a run asks for the same ones, and a step captured as a CUDA graph may copy nothing from the
    /// host, also when it follows a step of another shape (a shorter last batch, an evaluation).
    positions: std::sync::Mutex<Vec<Tensor>>,
    /// Context parallelism over more than one rank, or None.
    cp: Option<ContextParallel>,
    /// A multimodal (LLaVA) model's vision encoder and projection (first stage only).
    pub vision: Option<VisionModel>,
    /// Multi-token prediction depths (last stage, with the last chunk).
    pub mtp: Option<Mtp>,
    /// The FP8 recipe set (`set_fp8`), and under delayed scaling each chunk's layer slots (the
    /// MTP depths' with the last chunk's): after a chunk's training forward its forward slots
    /// move on, after its backward its backward slots.
    fp8: Option<(ferrotron_core::Fp8Recipe, Vec<std::ops::Range<usize>>)>,
}

/// What the loss end of a forward keeps.
struct PostSaved {
    hidden: Tensor,
    /// The logits, or (`grad_done`) already dlogits for the mean loss (dloss = 1 / num_tokens).
    logits: Tensor,
    grad_done: bool,
    labels: Tensor,
    loss_mask: Tensor,
    lse: Tensor,
    num_tokens: f64,
    /// The loss's weight in the objective (1 for the next token's; an MTP depth's share).
    weight: f64,
}

/// What an MTP depth's forward keeps.
struct MtpSaved {
    /// The depth's (rolled) tokens and learned positions, for the embedding's backward.
    tokens: Tensor,
    positions: Option<Tensor>,
    layer: MtpLayerSaved,
    post: PostSaved,
}

/// What a forward keeps for its backward.
pub struct GptSaved {
    tokens: Option<Tensor>,
    /// The learned positions' ids, and whether they are the batch's own (`Batch::position_ids`)
    /// rather than the rows' positions.
    positions: Option<Tensor>,
    explicit_positions: bool,
    decoder: Saved,
    post: Option<PostSaved>,
    /// The micro-batch's draws, for the backward's dropout masks.
    draw: Option<Draw>,
    /// The micro-batch's `Batch::own_loss_scale`, for the routers' backward.
    own_loss_scale: Option<f32>,
    /// The micro-batch's document masks (`Batch::docs`), for the attention backward.
    docs: Option<Tensor>,
    vision: Option<VisionSaved>,
    /// The MTP depths', in order (last stage).
    mtp: Vec<MtpSaved>,
}

impl GptSaved {
    /// Activation bytes held (tensors counted as they are referenced).
    pub fn bytes(&self) -> usize {
        let b = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        let post = |p: &PostSaved| b(&p.hidden) + b(&p.logits) + b(&p.lse);
        self.decoder.bytes()
            + self.post.as_ref().map_or(0, post)
            + self.vision.as_ref().map_or(0, VisionSaved::bytes)
            + self.mtp.iter().map(|m| m.layer.bytes() + post(&m.post)).sum::<usize>()
    }
}

/// What a chunk's forward produced.
pub enum ChunkOut {
    Hidden(Tensor),
    /// The micro-batch's losses (last stage, last chunk).
    Loss(MicroLoss),
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
        let plan = StagePlan::whole(config.num_layers);
        Self::build_stage(config, &tp, &plan, Recompute::default(), device, dtype, seed, 1)
    }

    /// `build_stage` for a multimodal (LLaVA) model: the first stage also holds `vision`'s
    /// encoder and projection, whose parameters come first in its table.
    #[allow(clippy::too_many_arguments)]
    pub fn build_multimodal(
        config: TransformerConfig,
        vision: &VisionSpec,
        tp: &TensorParallel,
        plan: &StagePlan,
        recompute: Recompute,
        device: &Device,
        dtype: DType,
        seed: u64,
        pad_to: usize,
    ) -> Result<(GptModel, ParamTable)> {
        Self::build_inner(config, Some(vision), tp, plan, recompute, device, dtype, seed, pad_to)
    }

    /// This rank's part under tensor (and sequence) parallelism `tp`, all layers (no pipeline).
    pub fn build_parallel(
        config: TransformerConfig,
        tp: &TensorParallel,
        device: &Device,
        dtype: DType,
        seed: u64,
        pad_to: usize,
    ) -> Result<(GptModel, ParamTable)> {
        let plan = StagePlan::whole(config.num_layers);
        Self::build_stage(config, tp, &plan, Recompute::default(), device, dtype, seed, pad_to)
    }

    /// This rank's part: the layers of `plan` (one pipeline rank's chunks) under `tp`, with
    /// `recompute`. Parameters hold exactly their part of what `build` makes with the same seed.
    /// The flat buffers are padded to a multiple of `pad_to` (the data-parallel size).
    #[allow(clippy::too_many_arguments)]
    pub fn build_stage(
        config: TransformerConfig,
        tp: &TensorParallel,
        plan: &StagePlan,
        recompute: Recompute,
        device: &Device,
        dtype: DType,
        seed: u64,
        pad_to: usize,
    ) -> Result<(GptModel, ParamTable)> {
        Self::build_inner(config, None, tp, plan, recompute, device, dtype, seed, pad_to)
    }

    #[allow(clippy::too_many_arguments)]
    fn build_inner(
        config: TransformerConfig,
        vision: Option<&VisionSpec>,
        tp: &TensorParallel,
        plan: &StagePlan,
        recompute: Recompute,
        device: &Device,
        dtype: DType,
        seed: u64,
        pad_to: usize,
    ) -> Result<(GptModel, ParamTable)> {
        let (model, p) = Self::declare(config, vision, tp, plan, recompute)?;
        Ok((model, p.build_padded(device, dtype, seed, pad_to)?))
    }

    /// Every parameter of the whole model on one rank (names, shapes, initialisation), nothing
    /// allocated: what an import checks a checkpoint's tensors against.
    pub fn param_metas(config: TransformerConfig, vision: Option<&VisionSpec>) -> Result<Vec<ParamMeta>> {
        let tp = TensorParallel::new(ProcessGroups::single().tp, false);
        let plan = StagePlan::whole(config.num_layers);
        Ok(Self::declare(config, vision, &tp, &plan, Recompute::default())?.1.into_metas())
    }

    /// The model and its parameters' declarations, before any buffer exists.
    fn declare(
        config: TransformerConfig,
        vision: Option<&VisionSpec>,
        tp: &TensorParallel,
        plan: &StagePlan,
        recompute: Recompute,
    ) -> Result<(GptModel, ParamTableBuilder)> {
        config.validate()?;
        config.validate_tp(tp.size())?;
        if config.mtp.is_some() && vision.is_some() {
            return Err(ModelError::Config(
                "--mtp-num-layers is not built for multimodal (LLaVA-style) models: drop it".into(),
            ));
        }
        let mut p = ParamTableBuilder::default();
        let (h, v) = (config.hidden_size, config.padded_vocab_size(tp.size()));
        let vision = match (vision, plan.pre_process) {
            (Some(spec), true) => Some(VisionModel::build(&mut p, spec, config.vocab_size, h, tp)?),
            _ => None,
        };
        // The embeddings' own std (the output layer, untied, takes init_method_std as Megatron's).
        let std = config.embedding_init_method_std.unwrap_or(config.init_method_std);
        let word = "embedding.word_embeddings.weight";
        let embedding = if plan.pre_process {
            Some(VocabParallelEmbedding::new(&mut p, word, config.vocab_size, v, h, std, tp)?)
        } else {
            None
        };
        let position_embeddings = match (plan.pre_process, config.position_embedding) {
            (true, PositionEmbedding::LearnedAbsolute) => Some(
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
        let n = plan.chunks.len();
        let chunks = plan
            .chunks
            .iter()
            .enumerate()
            .map(|(c, layers)| {
                let ends = plan.post_process && c + 1 == n;
                TransformerBlock::stage(&mut p, "decoder", &config, tp, layers.clone(), ends, recompute)
            })
            .collect::<ferrotron_core::Result<Vec<_>>>()?;
        let shard = Shard::of(tp.rank(), tp.size());
        let output_layer = match (plan.post_process, config.untie_embeddings_and_output_weights, &embedding) {
            (false, ..) => None,
            (true, true, _) => {
                let init = Init::Normal { std: config.init_method_std };
                Some(p.add(ParamMeta::split("output_layer.weight", [v, h], 0, shard, init, true)?)?)
            }
            (true, false, Some(e)) => Some(e.weight),
            (true, false, None) => {
                // The last stage's copy of the tied embedding: same name and std, so the same
                // initial values.
                let mut m = ParamMeta::split(word, [v, h], 0, shard, Init::Normal { std }, true)?;
                m.pipeline_copy = true;
                Some(p.add(m)?)
            }
        };
        let mtp = match (config.mtp, plan.post_process) {
            (Some(spec), true) => {
                // The depths embed their tokens: with the model's own table on a stage that has
                // it, else with the last stage's copy (the tied output layer, or one of its own).
                let embedding = match (&embedding, output_layer, config.untie_embeddings_and_output_weights) {
                    (Some(e), ..) => e.clone(),
                    (None, Some(out), false) => VocabParallelEmbedding {
                        weight: out,
                        vocab_size: config.vocab_size,
                        padded_vocab_size: v,
                        tp: tp.clone(),
                    },
                    (None, ..) => {
                        let mut m = ParamMeta::split(word, [v, h], 0, shard, Init::Normal { std }, true)?;
                        m.pipeline_copy = true;
                        let weight = p.add(m)?;
                        VocabParallelEmbedding {
                            weight,
                            vocab_size: config.vocab_size,
                            padded_vocab_size: v,
                            tp: tp.clone(),
                        }
                    }
                };
                if config.position_embedding == PositionEmbedding::LearnedAbsolute && position_embeddings.is_none() {
                    return Err(ModelError::Config(
                        "--mtp-num-layers with learned absolute position embeddings needs the whole model on one pipeline stage (the depths look up positions): use --position-embedding-type rope, or --pipeline-model-parallel-size 1".into(),
                    ));
                }
                let layers = (0..spec.num_layers)
                    .map(|k| MtpLayer::new(&mut p, k, &config, tp))
                    .collect::<ferrotron_core::Result<Vec<_>>>()?;
                Some(Mtp { spec, layers, embedding, position_embeddings })
            }
            _ => None,
        };
        // Megatron's decoupled learning-rate group: the word embedding and the output layer,
        // every stage's copy (the tied last-stage copy, the depths' own).
        let heads = [embedding.as_ref().map(|e| e.weight), output_layer, mtp.as_ref().map(|m| m.embedding.weight)];
        for id in heads.into_iter().flatten() {
            p.mark_embedding_or_output(id);
        }
        let embedding_dropout = if embedding.is_some() {
            HiddenDropout::new(config.hidden_dropout, "embedding.dropout", config.hidden_size, tp)
        } else {
            None
        };
        let model = GptModel {
            config,
            embedding,
            position_embeddings,
            chunks,
            output_layer,
            plan: plan.clone(),
            tp: tp.clone(),
            embedding_dropout,
            positions: std::sync::Mutex::new(Vec::new()),
            cp: None,
            vision,
            mtp,
            fp8: None,
        };
        Ok((model, p))
    }

    /// Every transformer layer's attention and MLP (dense, or a factory's that takes it: the MoE
    /// layer's experts) products in FP8 (`fp8`: Megatron's --fp8-format with --fp8-recipe
    /// tensorwise or delayed, `ferrotron_kernels::fp8`), the MTP depths' layers and projections
    /// too; the embeddings, the output layer and the attention itself stay in the model's dtype,
    /// as Megatron keeps them. `bf16_ends` [first, last]: that many decoder layers at each end
    /// keep bf16 products (Megatron's --first-last-layers-bf16 with
    /// --num-layers-at-start-in-bf16 / --num-layers-at-end-in-bf16; [0, 0] for none). Refused for
    /// what has no FP8 products yet. Under delayed scaling the layers take their slots in
    /// `fp8.delayed` here, in chunk order; the caller allocates its state after.
    pub fn set_fp8(&mut self, fp8: Option<ferrotron_core::Fp8Recipe>, [first, last]: [usize; 2]) -> Result<()> {
        let name = fp8.as_ref().map_or("", |r| r.format.as_str());
        let flag =
            |what: &str| ModelError::Config(format!("--fp8-format {name}: {what}; train in bf16 (drop --fp8-format)"));
        if fp8.is_some() && self.vision.is_some() {
            return Err(flag("multimodal (LLaVA-style) models have no FP8 products yet"));
        }
        let slots = |r: &ferrotron_core::Fp8Recipe| r.delayed.as_ref().map_or(0, |m| m.layers());
        let mut ranges = vec![];
        let n_chunks = self.chunks.len();
        for (c, chunk) in self.chunks.iter_mut().enumerate() {
            let start = fp8.as_ref().map_or(0, slots);
            chunk.fp8_metas = fp8.as_ref().and_then(|r| r.delayed.clone());
            for (i, layer) in chunk.layers.iter_mut().enumerate() {
                let index = chunk.first_layer + i;
                let bf16 = index < first || index + last >= self.config.num_layers;
                let r = fp8.as_ref().filter(|_| !bf16);
                layer.set_fp8(r).map_err(|e| flag(&format!("decoder layer {index}: {e}")))?;
            }
            if c + 1 == n_chunks {
                if let Some(m) = &mut self.mtp {
                    for (depth, l) in m.layers.iter_mut().enumerate() {
                        l.eh_proj.fp8 = fp8.as_ref().map(|r| r.linear(l.eh_proj.weight));
                        l.layer
                            .set_fp8(fp8.as_ref())
                            .map_err(|e| flag(&format!("multi-token prediction depth {depth}: {e}")))?;
                    }
                }
            }
            ranges.push(start..fp8.as_ref().map_or(0, slots));
        }
        self.fp8 = fp8.map(|r| (r, ranges));
        Ok(())
    }

    /// Delayed scaling after chunk `c`'s training forward (`forward`) or backward: that chunk's
    /// slots' amaxes reduced over the ranks (`Fp8Metas::reduce`), then their scales and
    /// histories moved on (`k::fp8_scale_update`).
    fn fp8_pass_done(&self, c: usize, forward: bool) -> Result<()> {
        let Some((recipe, ranges)) = &self.fp8 else { return Ok(()) };
        let (Some(m), Some(r)) = (&recipe.delayed, ranges.get(c)) else { return Ok(()) };
        if r.is_empty() {
            return Ok(());
        }
        let t = m.tensors()?;
        let (hist, scale, cols, dt) = if forward {
            (&t.fwd_history, &t.fwd_scale, 2 * r.start..2 * r.end, recipe.format.forward())
        } else {
            (&t.bwd_history, &t.bwd_scale, r.clone(), recipe.format.gradient())
        };
        m.reduce(&hist.view(cols.start, [cols.len()])?)?;
        Ok(k::fp8_scale_update(hist, scale, cols, dt, &m.config)?)
    }

    /// Splits every sequence over `cp`'s ranks (nothing changes at size 1), every layer's
    /// attention by `cp.kind`'s exchange.
    pub fn set_context_parallel(&mut self, cp: ContextParallel) -> Result<()> {
        let kinds = vec![cp.kind; self.config.num_layers];
        self.set_context_parallel_by_layer(cp, &kinds)
    }

    /// Splits every sequence over `cp`'s ranks, decoder layer i's attention (global index) by
    /// `kinds[i]`'s exchange (Megatron's per-layer --cp-comm-type list), the MTP depths' by
    /// `kinds[0]`. Dropout masks stay the whole sequence's (hidden: by position; attention under
    /// the all-gather: the whole mask's tiles, which needs chunks of a multiple of 16 tokens). A
    /// sliding window needs the all-to-all in every layer with attention.
    pub fn set_context_parallel_by_layer(&mut self, cp: ContextParallel, kinds: &[CpCommType]) -> Result<()> {
        if kinds.len() != self.config.num_layers {
            return Err(ModelError::Config(format!(
                "--cp-comm-type lists {} types for {} layers: give one for all or one a layer",
                kinds.len(),
                self.config.num_layers
            )));
        }
        if cp.size() == 1 {
            return Ok(());
        }
        let gathered = |i: usize| kinds[i] == CpCommType::AllGather;
        use crate::spec::LayerKind;
        let attends = |i: usize| matches!(self.config.layer.kind_of(i), LayerKind::Transformer | LayerKind::Attention);
        let any_gathered = (0..kinds.len()).any(|i| attends(i) && gathered(i)) || (self.mtp.is_some() && gathered(0));
        if self.config.layer.attention.window.is_some() && any_gathered {
            return Err(ModelError::Config(format!(
                "--context-parallel-size {} with a sliding window (--window-size) needs --cp-comm-type a2a in every layer with attention (the all-gather splits keys into chunks)",
                cp.size()
            )));
        }
        if let Some(m) = &self.mtp
            && m.position_embeddings.is_some()
        {
            return Err(ModelError::Config(format!(
                "--context-parallel-size {} with multi-token prediction (--mtp-num-layers) and learned absolute positions: the depths' positions are not split over context-parallel ranks; use --position-embedding-type rope or drop one",
                cp.size()
            )));
        }
        if self.vision.is_some() {
            return Err(ModelError::Config(format!(
                "--context-parallel-size {} is not built for multimodal (LLaVA-style) models yet: drop it",
                cp.size()
            )));
        }
        if (0..self.config.num_layers).any(|i| self.config.layer.kind_of(i) == crate::spec::LayerKind::Mixer) {
            // A mixer runs along the whole sequence: its factory must have built it for the group.
            let mixer = self.config.layer.hybrid.as_ref().and_then(|h| h.mixer.as_ref());
            let verdict = mixer.map_or(Err("the spec has no mixer".to_string()), |m| m.validate_cp(cp.size()));
            if let Err(e) = verdict {
                return Err(ModelError::Config(format!("--context-parallel-size {}: {e}", cp.size())));
            }
        }
        for b in &mut self.chunks {
            for (i, l) in b.layers.iter_mut().enumerate() {
                l.set_context_parallel(&cp.with_kind(kinds[b.first_layer + i]))?;
            }
        }
        // The MTP depths' layers attend over the whole sequence as the decoder's do; their inputs
        // come rolled along the whole sequences (`Batch::with_mtp_rolled`).
        let depth_cp = cp.with_kind(kinds[0]);
        for d in self.mtp.iter_mut().flat_map(|m| m.layers.iter_mut()) {
            d.layer.set_context_parallel(&depth_cp)?;
            if let Some(drop) = d.dropout.as_mut() {
                drop.set_context_parallel(&cp);
            }
        }
        if let Some(d) = self.embedding_dropout.as_mut() {
            d.set_context_parallel(&cp);
        }
        // Position ids made before are the unsplit sequence's.
        self.positions.lock().unwrap_or_else(|e| e.into_inner()).clear();
        self.cp = Some(cp);
        Ok(())
    }

    /// The context-parallel size (1 without).
    pub fn cp_size(&self) -> usize {
        self.cp.as_ref().map_or(1, |c| c.size())
    }

    fn ce(&self) -> VocabParallelCe {
        VocabParallelCe {
            vocab_size: self.config.vocab_size,
            padded_vocab_size: self.config.padded_vocab_size(self.tp.size()),
        }
    }

    /// Shape of the hidden state one micro-batch of `seq` tokens a row (as this rank holds them:
    /// its context-parallel chunks) passes between pipeline stages.
    pub fn activation_shape(&self, micro_batch: usize, seq: usize) -> Vec<usize> {
        let t = if self.tp.sp() { seq / self.tp.size() } else { seq };
        vec![micro_batch, t, self.config.hidden_size]
    }

    /// Position ids of this rank's tokens: [B, T], or its [B, T/tp] slice under SP; under context
    /// parallelism the global positions of its two chunks' rows.
    fn positions(&self, tokens: &Tensor) -> Result<Option<Tensor>> {
        let Some(_) = self.position_embeddings else { return Ok(None) };
        let (b, t) = (tokens.dims()[0], tokens.dims()[1]);
        let whole = t * self.cp_size();
        if whole > self.config.max_position_embeddings {
            return Err(ModelError::Config(format!(
                "sequence of {whole} tokens exceeds --max-position-embeddings {}",
                self.config.max_position_embeddings
            )));
        }
        let (start, len) = self.seq_part(t)?;
        let mut cached = self.positions.lock().unwrap_or_else(|e| e.into_inner());
        // The start is rank × len under SP and 0 otherwise, and the cp rank is the model's, so
        // (b, len) decide the ids.
        if let Some(p) = cached.iter().find(|p| p.dims() == [b, len] && p.device().same(tokens.device())) {
            return Ok(Some(p.clone()));
        }
        let pos = |i: usize| match &self.cp {
            Some(cp) => cp.position(t / 2, i),
            None => i,
        };
        let ids: Vec<u32> = (0..b).flat_map(|_| (start..start + len).map(|i| pos(i) as u32)).collect();
        let p = Tensor::from_vec(ids, [b, len], tokens.device())?;
        // A few shapes (b · len · 4 bytes each), the oldest dropped first.
        if cached.len() == 4 {
            cached.remove(0);
        }
        cached.push(p.clone());
        Ok(Some(p))
    }

    /// The rows of each sequence of `t` tokens this rank holds: (first, count); a part under
    /// sequence parallelism.
    fn seq_part(&self, t: usize) -> Result<(usize, usize)> {
        Ok(if self.tp.sp() {
            let tl = self.tp.shard_len(t)?;
            (self.tp.rank() * tl, tl)
        } else {
            (0, t)
        })
    }

    /// MTP depth `k`'s (1-based) input embedding of its rolled `tokens` [B, T]: word + learned
    /// position (ids i + k, uploaded: returned for the backward) + the depth's dropout.
    fn mtp_embed(&self, cx: &Cx, m: &Mtp, k: usize, tokens: &Tensor) -> Result<(Tensor, Option<Tensor>)> {
        let mut x = m.embedding.forward(cx, tokens)?;
        let positions = match m.position_embeddings {
            Some(pe) => {
                let (b, t) = (tokens.dims()[0], tokens.dims()[1]);
                let (start, len) = self.seq_part(t)?;
                let ids = Tensor::from_vec(Mtp::positions(b, t, start, len, k), [b, len], tokens.device())?;
                x = k::add(&x, &k::embedding_fwd(&ids, &cx.params.param(pe)?)?)?;
                Some(ids)
            }
            None => None,
        };
        Ok((maybe(&m.layers[k - 1].dropout, cx, x)?, positions))
    }

    /// The batch's own position ids (`Batch::position_ids`) of this rank's rows: the [B, T/tp]
    /// slice under sequence parallelism, uploaded; None without learned positions.
    fn batch_positions(&self, tokens: &Tensor, ids: &[u32]) -> Result<Option<Tensor>> {
        if self.position_embeddings.is_none() {
            return Ok(None);
        }
        let (b, t) = (tokens.dims()[0], tokens.dims()[1]);
        let (start, len) = self.seq_part(t)?;
        let max = self.config.max_position_embeddings;
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= max) {
            return Err(ModelError::Config(format!("position id {bad} is not below --max-position-embeddings {max}")));
        }
        let rows: Vec<u32> = ids.chunks(t).take(b).flat_map(|r| r[start..start + len].to_vec()).collect();
        Ok(Some(Tensor::from_vec(rows, [b, len], tokens.device())?))
    }

    fn embed(&self, cx: &Cx, tokens: &Tensor, ids: Option<&[u32]>) -> Result<(Tensor, Option<Tensor>)> {
        if tokens.shape().rank() != 2 {
            return Err(
                ferrotron_core::shape_mismatch("GptModel::forward", "tokens [batch, seq]", tokens.dims()).into()
            );
        }
        if self.tp.sp() {
            self.tp.shard_len(tokens.dims()[1])?;
        }
        let e = self.embedding.as_ref().ok_or_else(|| ModelError::Config("this stage has no embedding".into()))?;
        let mut x = e.forward(cx, tokens)?;
        let positions = match ids {
            Some(ids) => self.batch_positions(tokens, ids)?,
            None => self.positions(tokens)?,
        };
        if let (Some(pos), Some(pe)) = (&positions, self.position_embeddings) {
            x = k::add(&x, &k::embedding_fwd(pos, &cx.params.param(pe)?)?)?;
        }
        Ok((maybe(&self.embedding_dropout, cx, x)?, positions))
    }

    fn output(&self) -> Result<ParamId> {
        self.output_layer.ok_or_else(|| ModelError::Config("this stage has no output layer".into()))
    }

    /// Logits [B, T, V] over the whole padded vocabulary (one stage holding the whole model).
    pub fn logits(&self, cx: &Cx, tokens: &Tensor) -> Result<Tensor> {
        self.logits_with(cx, tokens, None)
    }

    /// `logits` of a multimodal model, the images' features at their placeholders.
    pub fn logits_with(&self, cx: &Cx, tokens: &Tensor, images: Option<&Images>) -> Result<Tensor> {
        let (mut x, _) = self.embed(cx, tokens, None)?;
        match (&self.vision, images) {
            (Some(v), Some(images)) => x = v.forward(cx, &x, images)?.0,
            (None, Some(_)) => {
                return Err(ModelError::Config("images given to a model without a vision encoder".into()));
            }
            (_, None) => {}
        }
        let mut h = x;
        for c in &self.chunks {
            h = c.forward(cx, &h)?.0;
        }
        let h = self.tp.enter(&h)?;
        let local = k::matmul(&h, &cx.params.param(self.output()?)?, false, true)?;
        Ok(self.tp.gather_last(&local)?)
    }

    /// Forward of chunk `c` for one micro-batch: from tokens (first chunk of the first stage) or
    /// from `input`, to the next stage's input or (last chunk of the last stage) the loss.
    pub fn forward_chunk(
        &self,
        cx: &Cx,
        c: usize,
        batch: &Batch,
        input: Option<Tensor>,
    ) -> Result<(ChunkOut, GptSaved)> {
        let out = self.forward_chunk_passes(cx, c, batch, input)?;
        if cx.training && cx.fp8_replay.is_none() {
            self.fp8_pass_done(c, true)?;
        }
        Ok(out)
    }

    /// `forward_chunk` up to delayed scaling's update.
    fn forward_chunk_passes(
        &self,
        cx: &Cx,
        c: usize,
        batch: &Batch,
        input: Option<Tensor>,
    ) -> Result<(ChunkOut, GptSaved)> {
        let block = self.chunks.get(c).ok_or_else(|| ModelError::Config(format!("no model chunk {c}")))?;
        let draw = batch.draw.or(cx.draw);
        let cx = &cx.with_draw(draw).with_docs(batch.docs.as_ref());
        let pre = self.plan.pre_process && c == 0;
        let post = self.plan.post_process && c + 1 == self.chunks.len();
        let mut vision = None;
        let explicit_positions = pre && batch.position_ids.is_some();
        let (x, tokens, positions) = match (pre, input) {
            (true, _) => {
                let (mut x, pos) = self.embed(cx, &batch.tokens, batch.position_ids.as_deref())?;
                match (&self.vision, &batch.images) {
                    (Some(v), Some(images)) => {
                        let (y, s) = v.forward(cx, &x, images)?;
                        (x, vision) = (y, Some(s));
                    }
                    (None, Some(_)) => {
                        return Err(ModelError::Config(
                            "the micro-batch has images but the model has no vision encoder: build it multimodal (a LLaVA preset, or --img-h/--img-w/--patch-dim)".into(),
                        ));
                    }
                    // A multimodal model also trains on text alone.
                    (_, None) => {}
                }
                (x, Some(batch.tokens.clone()), pos)
            }
            (false, Some(x)) => (x, None, None),
            (false, None) => return Err(ModelError::Config(format!("chunk {c} needs the previous stage's output"))),
        };
        let (h, decoder) = block.forward(cx, &x)?;
        if !post {
            let own_loss_scale = batch.own_loss_scale;
            let saved = GptSaved {
                tokens,
                positions,
                explicit_positions,
                decoder,
                post: None,
                draw,
                own_loss_scale,
                docs: batch.docs.clone(),
                vision,
                mtp: vec![],
            };
            return Ok((ChunkOut::Hidden(h), saved));
        }
        // The mean's 1 / num_tokens read from the batch's tensor when the kernel runs.
        let main = (&batch.labels, &batch.loss_mask, batch.num_tokens, 1.0, k::RowScale::Read(&batch.inv_tokens));
        let (mut loss, post) = self.head_forward(cx, &h, main)?;
        let mut mtp = vec![];
        if let Some(m) = &self.mtp {
            if self.cp.is_some() && batch.mtp_rolled.is_none() {
                return Err(ModelError::Config(
                    "under context parallelism the MTP depths' inputs must be rolled along the whole sequences before the split (Batch::with_mtp_rolled)".into(),
                ));
            }
            let mut prev = h;
            for (i, layer) in m.layers.iter().enumerate() {
                let k = i + 1;
                let (tokens, labels, mask) = batch.mtp_inputs(k)?;
                let (e, positions) = self.mtp_embed(cx, m, k, &tokens)?;
                let (out, saved) = layer.forward(cx, &e, &prev)?;
                let (count, weight) = (batch.depth_denominator(k), m.spec.depth_weight());
                let dscale = k::RowScale::Value(if count > 0.0 { (weight / count) as f32 } else { 0.0 });
                let (l, post) = self.head_forward(cx, &out, (&labels, &mask, count, weight, dscale))?;
                loss.mtp.push(MicroLoss::new(l.per_token, batch.mask_count_from(k)));
                mtp.push(MtpSaved { tokens, positions, layer: saved, post });
                prev = out;
            }
        }
        let own_loss_scale = batch.own_loss_scale;
        let saved = GptSaved {
            tokens,
            positions,
            explicit_positions,
            decoder,
            post: Some(post),
            draw,
            own_loss_scale,
            docs: batch.docs.clone(),
            vision,
            mtp,
        };
        Ok((ChunkOut::Loss(loss), saved))
    }

    /// The output layer and cross-entropy of one prediction (the next token's, or an MTP
    /// depth's): h [B, T(/tp), H] → logits [N, V/tp] → the masked per-token losses of `labels`.
    /// `head` = (labels, mask, the mean's denominator, the loss's weight in the objective, dloss
    /// of each row (weight / denominator) for a fused forward-backward).
    fn head_forward(
        &self,
        cx: &Cx,
        h: &Tensor,
        (labels, mask, num_tokens, weight, dscale): (&Tensor, &Tensor, f64, f64, k::RowScale),
    ) -> Result<(MicroLoss, PostSaved)> {
        let h = self.tp.enter(h)?;
        let logits = k::matmul(&h, &cx.params.param(self.output()?)?, false, true)?;
        let n = labels.elem_count();
        let flat = logits.reshape([n, logits.shape().last()])?;
        let labels = labels.reshape([n])?;
        let mask = mask.reshape([n])?;
        // Training on one tensor-parallel rank: the backward's dlogits (for grad_scale 1) are
        // written over the logits in the same pass, one read of [N, V] instead of two.
        let fused = if cx.training {
            vocab_parallel_ce_fwd_bwd_(self.ce(), &self.tp, &flat, &labels, Some(&mask), dscale)?
        } else {
            None
        };
        let grad_done = fused.is_some();
        let (loss, lse) = match fused {
            Some(r) => r,
            None => vocab_parallel_ce_fwd(self.ce(), &self.tp, &flat, &labels, Some(&mask))?,
        };
        let post = PostSaved { hidden: h, logits: flat, grad_done, labels, loss_mask: mask, lse, num_tokens, weight };
        Ok((MicroLoss::new(loss, num_tokens), post))
    }

    /// Backward of `head_forward` for `grad_scale` × weight × loss: adds the output layer's
    /// gradient and returns the gradient of h (this rank's part under sequence parallelism).
    fn head_backward(&self, cx: &Cx, p: PostSaved, grad_scale: f32) -> Result<Tensor> {
        let n = p.labels.elem_count();
        let (h, hid) = (&p.hidden, self.config.hidden_size);
        let mut h2 = h.reshape([n, hid])?;
        // Fused in the forward for grad_scale 1: any other scale goes on the two products'
        // small operands (h, dh: hidden / vocab of dlogits' size) rather than on dlogits.
        let rescale = p.grad_done && grad_scale != 1.0;
        let dlogits = if p.grad_done {
            p.logits
        } else {
            let g = if p.num_tokens > 0.0 { (grad_scale as f64 * p.weight / p.num_tokens) as f32 } else { 0.0 };
            let dloss = Tensor::from_vec(vec![g; n], [n], p.logits.device())?;
            vocab_parallel_ce_bwd(self.ce(), &self.tp, &p.logits, &p.labels, Some(&p.loss_mask), &p.lse, &dloss)?
        };
        if rescale {
            h2 = k::scale(&h2, grad_scale)?;
        }
        let out = self.output()?;
        let dh = k::matmul(&dlogits, &cx.params.param(out)?, false, false)?.reshape(h.dims().to_vec())?;
        if rescale {
            k::scale_(&dh, grad_scale)?;
        }
        let (dw, acc) = cx.params.grad_acc(out)?;
        k::matmul_into(&dw, &dlogits, &h2, true, false, acc)?;
        Ok(self.tp.enter_bwd(&dh)?)
    }

    /// Backward of chunk `c`: from the loss (`grad_scale · loss`) or from `dy`; adds parameter
    /// grads into main_grad and returns the gradient of the chunk's input (None where tokens came
    /// in). `done(offset)` is called whenever every gradient at flat offsets ≥ `offset` that this
    /// pass touches is final.
    pub fn backward_chunk(
        &self,
        cx: &Cx,
        c: usize,
        saved: GptSaved,
        dy: Option<&Tensor>,
        grad_scale: f32,
        done: &mut dyn FnMut(usize) -> ferrotron_core::Result<()>,
    ) -> Result<Option<Tensor>> {
        let dx = self.backward_chunk_passes(cx, c, saved, dy, grad_scale, done)?;
        self.fp8_pass_done(c, false)?;
        Ok(dx)
    }

    /// `backward_chunk` up to delayed scaling's update.
    fn backward_chunk_passes(
        &self,
        cx: &Cx,
        c: usize,
        saved: GptSaved,
        dy: Option<&Tensor>,
        grad_scale: f32,
        done: &mut dyn FnMut(usize) -> ferrotron_core::Result<()>,
    ) -> Result<Option<Tensor>> {
        let block = self.chunks.get(c).ok_or_else(|| ModelError::Config(format!("no model chunk {c}")))?;
        let docs = saved.docs.clone();
        let cx = &cx
            .with_draw(saved.draw)
            .with_grad_scale(grad_scale)
            .with_own_loss_scale(saved.own_loss_scale)
            .with_docs(docs.as_ref());
        let dh = match (saved.post, dy) {
            (Some(p), _) => {
                // The MTP depths first, last to first: each one's output gradient is its head's
                // plus the next depth's through its hnorm; the first's reaches the decoder's.
                let mut from_mtp: Option<Tensor> = None;
                if let Some(m) = &self.mtp {
                    for (i, s) in saved.mtp.into_iter().enumerate().rev() {
                        let dout = self.head_backward(cx, s.post, grad_scale)?;
                        if let Some(d) = &from_mtp {
                            k::add_(&dout, d)?;
                        }
                        let (de, dh) = m.layers[i].backward(cx, s.layer, &dout)?;
                        let de = maybe(&m.layers[i].dropout, cx, de)?;
                        m.embedding.backward(cx, &s.tokens, &de)?;
                        if let (Some(ids), Some(pe)) = (&s.positions, m.position_embeddings) {
                            k::embedding_bwd(ids, &de, &cx.params.grad(pe)?)?;
                        }
                        from_mtp = Some(dh);
                    }
                }
                let dh = self.head_backward(cx, p, grad_scale)?;
                if let Some(d) = &from_mtp {
                    k::add_(&dh, d)?;
                }
                if self.config.untie_embeddings_and_output_weights {
                    // Every head has added its part (the MTP depths' parameters lie above).
                    done(cx.params.range(self.output()?).start)?;
                }
                dh
            }
            (None, Some(dy)) => dy.clone(),
            (None, None) => return Err(ModelError::Config(format!("chunk {c} needs the next stage's gradient"))),
        };
        let dx = block.backward_with(cx, saved.decoder, &dh, done)?;
        let Some(tokens) = &saved.tokens else { return Ok(Some(dx)) };
        let dx = match (saved.vision, &self.vision) {
            (Some(s), Some(v)) => v.backward(cx, s, &dx)?,
            _ => dx,
        };
        let dx = maybe(&self.embedding_dropout, cx, dx)?;
        if let Some(e) = &self.embedding {
            e.backward(cx, tokens, &dx)?;
        }
        if let (Some(pos), Some(pe), true) = (&saved.positions, self.position_embeddings, saved.explicit_positions) {
            // The batch's own ids (reset at documents' ends): scattered by id.
            let c = dx.shape().last();
            k::embedding_bwd(pos, &dx.reshape([pos.elem_count(), c])?, &cx.params.grad(pe)?)?;
        } else if let (Some(pos), Some(pe)) = (&saved.positions, self.position_embeddings) {
            // `positions`' ids: start..start + len of the local rows in every batch row (their
            // global positions: under context parallelism two runs, split where chunk 2·cp − 1 − r
            // begins, each summed in position order by the same kernel).
            let (t, len) = (tokens.dims()[1], pos.dims()[1]);
            let start = if self.tp.sp() { self.tp.rank() * self.tp.shard_len(t)? } else { 0 };
            let (b, c) = (pos.dims()[0], dx.shape().last());
            let dx = dx.reshape([b, len, c])?;
            let grad = cx.params.grad(pe)?;
            match &self.cp {
                None => k::position_embedding_bwd(&dx, &grad, start)?,
                Some(cp) => {
                    let half = t / 2;
                    let by_row = dx.transpose(0, 1)?.contiguous()?;
                    for (lo, hi) in [(start, (start + len).min(half)), (start.max(half), start + len)] {
                        if lo < hi {
                            let part = by_row.narrow0(lo - start..hi - start)?.transpose(0, 1)?.contiguous()?;
                            k::position_embedding_bwd(&part, &grad, cp.position(half, lo))?;
                        }
                    }
                }
            }
        }
        done(0)?;
        Ok(None)
    }

    /// Whole-model forward on one stage: the mean loss and what the backward needs.
    pub fn forward(&self, cx: &Cx, batch: &Batch) -> Result<(f64, GptSaved)> {
        let (l, s) = self.forward_deferred(cx, batch)?;
        Ok((l.mean()?, s))
    }

    /// `forward` with the losses left on the device (read them with `MicroLoss::mean` once the
    /// step's work is queued).
    pub fn forward_deferred(&self, cx: &Cx, batch: &Batch) -> Result<(MicroLoss, GptSaved)> {
        if self.chunks.len() != 1 || !self.plan.pre_process || !self.plan.post_process {
            return Err(ModelError::Config("forward needs the whole model on this rank; use forward_chunk".into()));
        }
        match self.forward_chunk(cx, 0, batch, None)? {
            (ChunkOut::Loss(l), s) => Ok((l, s)),
            (ChunkOut::Hidden(_), _) => Err(ModelError::Config("the model did not end in a loss".into())),
        }
    }

    /// Gradients of `grad_scale · loss`, added into main_grad.
    pub fn backward(&self, cx: &Cx, saved: GptSaved, grad_scale: f32) -> Result<()> {
        self.backward_with(cx, saved, grad_scale, &mut |_| Ok(()))
    }

    /// `backward` with the `done` hook of `backward_chunk`.
    pub fn backward_with(
        &self,
        cx: &Cx,
        saved: GptSaved,
        grad_scale: f32,
        done: &mut dyn FnMut(usize) -> ferrotron_core::Result<()>,
    ) -> Result<()> {
        self.backward_chunk(cx, 0, saved, None, grad_scale, done).map(|_| ())
    }

    /// The parameter the output layer uses (the word embedding or its copy when tied).
    pub fn output_weight(&self) -> Option<ParamId> {
        self.output_layer
    }

    /// The word embedding parameter (first stage).
    pub fn word_embeddings(&self) -> Option<ParamId> {
        self.embedding.as_ref().map(|e| e.weight)
    }

    /// With tied weights split over pipeline stages: this stage's side of the tie (the embedding
    /// on the first stage, its copy on the last), whose grads are summed across the two.
    /// Untied, the same holds with multi-token prediction: its depths look words up on the
    /// last stage in a copy of the embedding of their own.
    pub fn tied_weight(&self) -> Option<ParamId> {
        let shared = !self.config.untie_embeddings_and_output_weights || self.config.mtp.is_some();
        if !shared || (self.plan.pre_process && self.plan.post_process) {
            return None;
        }
        match &self.mtp {
            _ if self.plan.pre_process => self.word_embeddings(),
            Some(m) => Some(m.embedding.weight),
            None => self.output_layer,
        }
    }
}

impl From<ferrotron_core::Error> for ModelError {
    fn from(e: ferrotron_core::Error) -> Self {
        ModelError::Core(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrotron_core::Device;

    #[test]
    fn a_batch_counts_its_mask_once_whichever_way_it_is_made() {
        let dev = Device::Cpu;
        let ids = || Tensor::from_vec(vec![1u32, 2, 3, 4, 5, 6], [2, 3], &dev).unwrap();
        let mask = Tensor::from_vec(vec![1f32, 0.0, 1.0, 1.0, 0.0, 0.5], [2, 3], &dev).unwrap();
        assert_eq!(Batch::new(ids(), ids(), mask).unwrap().num_tokens(), 3.5);
        let m = Batch::masked(ids(), ids(), vec![1.0, 0.0, 1.0, 1.0, 0.0, 0.5]).unwrap();
        assert_eq!((m.num_tokens(), m.inv_tokens().to_vec_f32().unwrap()[0]), (3.5, (1.0 / 3.5) as f32));
        assert_eq!(m.loss_mask.to_vec_f32().unwrap(), [1.0, 0.0, 1.0, 1.0, 0.0, 0.5]);
        assert_eq!(m.loss_mask.dims(), [2, 3]);
        let all = Batch::unmasked(ids(), ids()).unwrap();
        assert_eq!(all.num_tokens(), 6.0);
        assert_eq!(all.loss_mask.to_vec_f32().unwrap(), vec![1.0; 6]);
        assert_eq!(all.loss_mask.dims(), &[2, 3]);
    }
}
