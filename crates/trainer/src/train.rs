//! The training loop: ranks (one, threads of this process, or processes under a launcher), the
//! parallel layout, gradient accumulation over this rank's micro-batches, the data-parallel sync and
//! AdamW step, logging (world rank 0), evaluation, checkpointing and resume.

use crate::checkpoint::{self, SaveInfo};
use crate::progress_log::ProgressLog;
use crate::settings::{Launch, LoadMode, Paths, Settings};
use anyhow::{Context, bail};
use ferrotron_comm::{ReduceOp, run_ranks, thread_world};
use ferrotron_core::{Cx, DType, Device, Draw, ParamTable, Tensor};
use ferrotron_data::{
    CyclicSampler, DataError, IndexedDataset, Part, Sequences, TokenSplit, Tokenizer, blend_split, corpus,
    documents_in_memory, parse_split, split_of, whole_split,
};
use ferrotron_optim::{
    AdamConfig, GradSync, LrSchedule, Optimizer, QueuedStep, StepGraph, default_bucket_size, eval_pipelined, loss_sums,
    queue_train_step, queue_train_step_pipelined, token_weighted,
};
use ferrotron_parallel::{ContextParallel, Dim, ProcessGroups, TensorParallel};
use ferrotron_transformer::gpt::MtpRolled;
use ferrotron_transformer::{Batch, GptModel};

type Comm = std::sync::Arc<dyn ferrotron_comm::Communicator>;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use std::io::Write;
use std::sync::Arc;
use std::time::Instant;

/// One line of metrics.jsonl.
// One value a log line: the training line's size costs nothing worth a box.
#[allow(clippy::large_enum_variant)]
#[derive(Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Metric {
    Train {
        iteration: u64,
        loss: f64,
        lr: f64,
        /// --decoupled-lr: the word embedding and output layer's rate.
        #[serde(skip_serializing_if = "Option::is_none")]
        decoupled_lr: Option<f64>,
        grad_norm: f64,
        tokens_per_s: f64,
        /// The least wall time the host took over one step of the window to build its batch and
        /// queue its work. On a GPU, when it is well under the step's time the device never
        /// waits for the host (launch gaps, the case for CUDA graphs, would show as it nears the
        /// step time); on CPU the work runs as it is queued, so it is the step time.
        host_ms_min: f64,
        elapsed_s: f64,
        consumed_samples: u64,
        /// The global batch of the log line's iteration (it changes under a batch-size schedule).
        global_batch_size: u64,
        /// MoE runs: the routers' load-balancing loss and z-loss (see `Summary::router_losses`).
        #[serde(skip_serializing_if = "Option::is_none")]
        load_balancing_loss: Option<f64>,
        #[serde(skip_serializing_if = "Option::is_none")]
        z_loss: Option<f64>,
        /// `--moe-per-layer-logging`: each layer's (load-balancing loss, z-loss), by layer number
        /// over the decoder's layers then the prediction depths' (dense layers 0, as Megatron's).
        #[serde(skip_serializing_if = "Vec::is_empty")]
        moe_layer_losses: Vec<(f64, f64)>,
        /// Multi-token prediction runs: each depth's loss (Megatron's `mtp_k loss`, k from 1).
        #[serde(skip_serializing_if = "Vec::is_empty")]
        mtp_losses: Vec<f64>,
        /// `--log-throughput`: model TFLOP/s per GPU (rank) over the log window.
        #[serde(skip_serializing_if = "Option::is_none")]
        tflops_per_gpu: Option<f64>,
        /// `--log-params-norm`: the L2 norm of the fp32 master weights after the update.
        #[serde(skip_serializing_if = "Option::is_none")]
        params_norm: Option<f64>,
        /// `--log-num-zeros-in-grad`: how many of the log line's iteration's gradients are zero.
        #[serde(skip_serializing_if = "Option::is_none")]
        num_zeros_in_grad: Option<f64>,
        /// `--log-memory-to-tensorboard` on a GPU: this rank's memory pool after the step.
        #[serde(skip_serializing_if = "Option::is_none", flatten)]
        memory: Option<MemoryLine>,
    },
    Eval {
        iteration: u64,
        loss: f64,
        /// Training samples consumed when it ran.
        consumed_samples: u64,
    },
}

/// The GPU memory of a log line (`--log-memory-to-tensorboard`), in bytes, as Megatron's
/// TensorBoard tags name it.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct MemoryLine {
    pub mem_allocated_bytes: u64,
    pub mem_max_allocated_bytes: u64,
    pub mem_reserved_bytes: u64,
}

impl From<ferrotron_core::MemoryStats> for MemoryLine {
    fn from(m: ferrotron_core::MemoryStats) -> Self {
        MemoryLine {
            mem_allocated_bytes: m.allocated,
            mem_max_allocated_bytes: m.max_allocated,
            mem_reserved_bytes: m.reserved,
        }
    }
}

/// What a run reports when it ends.
#[derive(Debug, Clone)]
pub struct Summary {
    /// (iteration, training loss) for every iteration run.
    pub losses: Vec<(u64, f64)>,
    /// (iteration, gradient norm before clipping) for every iteration run.
    pub grad_norms: Vec<(u64, f64)>,
    /// (iteration, validation loss), including iteration 0 for a fresh run.
    pub evals: Vec<(u64, f64)>,
    pub checkpoints: Vec<std::path::PathBuf>,
    /// This rank is the one that logs (global rank 0): a launched run's other processes print no
    /// summary either, so their lines cannot cut into rank 0's.
    pub logs: bool,
    /// Steps run by replaying the step's CUDA graph (`--cuda-graph-impl local`).
    pub graphed_steps: u64,
    /// (iteration, load-balancing loss, z-loss) at each log line of an MoE run: Megatron's
    /// logged values (without their coefficients), averaged over the MoE layers and the window's
    /// micro-batches.
    pub router_losses: Vec<(u64, f64, f64)>,
    /// `--moe-per-layer-logging`: (iteration, each layer's (load-balancing loss, z-loss)) at each
    /// log line, by layer number (the decoder's then the prediction depths'; dense layers 0).
    pub router_losses_per_layer: Vec<(u64, Vec<(f64, f64)>)>,
    /// (iteration, each depth's loss) for every iteration of a multi-token prediction run.
    pub mtp_losses: Vec<(u64, Vec<f64>)>,
    /// Iterations whose update was skipped: their gradient norm was not finite
    /// (`--no-check-for-nan-in-loss-and-grad`; with the check the run stops at the first).
    pub skipped: Vec<u64>,
}

/// The data the run trains and evaluates on.
pub struct Data {
    pub tokenizer: Tokenizer,
    pub train: TokenSplit,
    /// None where `--split` gives validation no share: no evaluation runs (as in Megatron).
    pub valid: Option<TokenSplit>,
    /// `--image-text-data`'s image files, by record (the splits' `TokenSplit::record`).
    pub images: Option<Arc<Vec<ferrotron_data::image_text::ImageRef>>>,
}

impl Data {
    /// The splits in Megatron's sample order (ferrotron-data's gpt.rs), each built for the
    /// samples a Megatron run of these settings would ask of it.
    pub fn build(s: &Settings) -> anyhow::Result<Data> {
        let tokenizer = Tokenizer::new(s.tokenizer()?)?;
        let seed = u32::try_from(s.seed).map_err(|_| DataError::BadSeed(s.seed))?;
        let [n_train, n_valid] = s.split_samples();
        let cache = s.data_cache_path.as_deref();
        // A multimodal sample's text: the sequence less its image's placeholders.
        let seq = s.text_seq_length()?;
        let mut images = None;
        let (train, valid) = if let Some(file) = &s.image_text_data {
            let folder = match &s.image_folder {
                Some(f) => f.clone(),
                None => file.parent().map(std::path::Path::to_path_buf).unwrap_or_default(),
            };
            let records = ferrotron_data::image_text::read_image_text(file, &folder)?;
            let tokens = records.iter().map(|r| tokenizer.encode(&r.text)).collect::<Result<Vec<_>, _>>()?;
            let tokens = Arc::new(tokens);
            let ranges = ferrotron_data::split_ranges(records.len(), parse_split(&s.split)?);
            let part = |k: usize, name, n| {
                ranges[k].clone().map(|r| {
                    let how = (seq, tokenizer.eod(), s.seed);
                    ferrotron_data::image_text::record_split(name, tokens.clone(), r, n as usize, how)
                })
            };
            let train = part(0, "train", n_train).with_context(|| {
                format!("--split {}: the train split has no share of the records: give it one", s.split)
            })?;
            images = Some(Arc::new(records.into_iter().map(|r| r.image).collect()));
            (train, part(1, "valid", n_valid))
        } else if s.mock_data {
            // Megatron builds its mock dataset with the tokenizer's vocabulary and split 1,1,1.
            let mock = Sequences::mock(tokenizer.vocab_size() as u32, tokenizer.eod());
            let (parts, split) = ([(None, Arc::new(mock))], parse_split("1,1,1")?);
            let train = split_of(&parts, split, 0, n_train, seq, seed, cache)?.context("mock train split")?;
            (train, split_of(&parts, split, 1, n_valid, seq, seed, cache)?)
        } else if !s.data_path.is_empty() {
            let parts = open_parts(s, &s.data_path, "--data-path")?;
            let split = parse_split(&s.split)?;
            let train = split_of(&parts, split, 0, n_train, seq, seed, cache)?
                .with_context(|| format!("--split {}: the train split has no share: give it one", s.split))?;
            (train, split_of(&parts, split, 1, n_valid, seq, seed, cache)?)
        } else if !s.train_data_path.is_empty() {
            let train = open_parts(s, &s.train_data_path, "--train-data-path")?;
            let valid = open_parts(s, &s.valid_data_path, "--valid-data-path")?;
            (
                whole_split(&train, 0, n_train, seq, seed, cache)?,
                Some(whole_split(&valid, 1, n_valid, seq, seed, cache)?),
            )
        } else {
            let docs = corpus::documents(s.seed, s.corpus_docs);
            let [train, valid] = documents_in_memory(&docs, &tokenizer, 0.05)?;
            (
                blend_split("train", vec![train], n_train, seq, seed, None)?,
                Some(blend_split("valid", vec![valid], n_valid, seq, seed, None)?),
            )
        };
        Ok(Data { tokenizer, train, valid, images })
    }
}

/// A data-path flag's datasets, opened, with their weights.
fn open_parts(s: &Settings, values: &[String], flag: &str) -> anyhow::Result<Vec<Part>> {
    s.data_blend(values, flag)?
        .into_iter()
        .map(|(w, prefix)| Ok((w, Arc::new(Sequences::Indexed(Arc::new(IndexedDataset::open(&prefix)?))))))
        .collect()
}

/// How samples become a micro-batch: the model's sequence length and vocabulary, with
/// `--eod-mask-loss` the end-of-document id whose positions do not count in the loss, and under
/// context parallelism which chunks of each sequence this rank holds.
#[derive(Clone)]
struct BatchSpec {
    seq: usize,
    vocab: usize,
    eod_mask: Option<u32>,
    /// The end-of-document id (a record's text ends with it, then padding).
    eod: u32,
    cp: Option<ContextParallel>,
    /// Multi-token prediction depths: under context parallelism their inputs are rolled here,
    /// along the whole sequences, before the split.
    mtp_depths: usize,
    /// --reset-position-ids with learned positions: each token's position id, from 0 again
    /// after each end of document (`ferrotron_data::reset_position_ids`), goes with the batch.
    reset_positions: bool,
    /// --reset-attention-mask: each token's document start (`ferrotron_data::document_starts`)
    /// goes with the batch, for document-wise attention masks.
    reset_attention: bool,
    /// A multimodal run's images: the spec, where they come from, the seed, the model's dtype.
    vision: Option<(ferrotron_transformer::VisionSpec, ImageSource, u64, DType)>,
}

fn batch(split: &TokenSplit, indices: &[usize], spec: &BatchSpec, dev: &Device) -> anyhow::Result<Batch> {
    if let Some(v) = &spec.vision {
        return multimodal_batch(split, indices, spec, v, dev);
    }
    let BatchSpec { seq, vocab, eod_mask, eod, ref cp, mtp_depths, reset_positions, reset_attention, .. } = *spec;
    let (mut tokens, mut labels) = (Vec::with_capacity(indices.len() * seq), Vec::with_capacity(indices.len() * seq));
    for &i in indices {
        let s = split.sample(i)?;
        // Checked here, on the host, so that the kernels need not read the ids back from a GPU
        // (`set_device_ids_prechecked`): a read there would wait for all the work queued before.
        if let Some(&bad) = s.iter().find(|&&t| t as usize >= vocab) {
            bail!(
                "token id {bad} in sample {i} is not below the model's vocabulary size {vocab}: the data was tokenized with another tokenizer than the one the model is built for"
            );
        }
        tokens.extend_from_slice(&s[..seq]);
        labels.extend_from_slice(&s[1..]);
    }
    let b = indices.len();
    // The whole sequences' position ids, before any split.
    let positions = reset_positions.then(|| ferrotron_data::reset_position_ids(&tokens, seq, eod));
    // Megatron's --eod-mask-loss: a position whose input is the end of a document (so its label
    // starts the next one) does not count.
    let mask = eod_mask.map(|eod| tokens.iter().map(|&t| if t == eod { 0.0 } else { 1.0 }).collect::<Vec<f32>>());
    if let Some(cp) = cp {
        // This rank's chunks; the loss's denominator is the whole sequences' count over the cp
        // size, so that the mean over data × context-parallel ranks is the whole batch's.
        let whole = mask.as_ref().map_or((b * seq) as f64, |m| m.iter().map(|&x| x as f64).sum());
        let local = cp.chunk_len(seq)? * 2;
        let shard =
            |x: &[u32]| -> anyhow::Result<Tensor> { Ok(Tensor::from_vec(cp.shard_host(x, b, seq)?, [b, local], dev)?) };
        let (t, l) = (shard(&tokens)?, shard(&labels)?);
        let m = match &mask {
            Some(m) => cp.shard_host(m, b, seq)?,
            None => vec![1.0; b * local],
        };
        let all = whole / cp.size() as f64;
        let mut batch = Batch::masked(t, l, m)?.with_num_tokens(all)?;
        if let Some(p) = &positions {
            batch = batch.with_position_ids(cp.shard_host(p, b, seq)?)?;
        }
        if reset_attention {
            // The whole rows' starts: the all-to-all attention runs on whole rows (the settings
            // refuse the all-gather with the masks).
            batch = batch.with_whole_row_document_starts(ferrotron_data::document_starts(&tokens, seq, eod), seq)?;
        }
        if mtp_depths == 0 {
            return Ok(batch);
        }
        // Depth k's inputs: the whole rows moved k places left (zeros at the end, out of the
        // loss), then this rank's chunks of them.
        let ones;
        let mask = match &mask {
            Some(m) => m,
            None => {
                ones = vec![1f32; b * seq];
                &ones
            }
        };
        let mut depths = Vec::with_capacity(mtp_depths);
        for k in 1..=mtp_depths {
            let (tk, lk, mk) = (roll_rows(&tokens, seq, k), roll_rows(&labels, seq, k), roll_rows(mask, seq, k));
            let count = mk.iter().map(|&x| x as f64).sum::<f64>() / cp.size() as f64;
            let mk = Tensor::from_vec(cp.shard_host(&mk, b, seq)?, [b, local], dev)?;
            depths.push((shard(&tk)?, shard(&lk)?, mk, count));
        }
        return Ok(batch.with_mtp_rolled(MtpRolled { depths, all }));
    }
    let starts = reset_attention.then(|| ferrotron_data::document_starts(&tokens, seq, eod));
    let (tokens, labels) = (Tensor::from_vec(tokens, [b, seq], dev)?, Tensor::from_vec(labels, [b, seq], dev)?);
    let mut batch = match mask {
        Some(m) => Batch::masked(tokens, labels, m)?,
        None => Batch::unmasked(tokens, labels)?,
    };
    if let Some(starts) = starts {
        batch = batch.with_document_starts(starts)?;
    }
    Ok(match positions {
        Some(p) => batch.with_position_ids(p)?,
        None => batch,
    })
}

/// Rows of `x` [rows, seq] moved `k` places left, zeros in the last k: `mtp::roll_left` on the
/// host, over whole sequences.
fn roll_rows<T: Copy + Default>(x: &[T], seq: usize, k: usize) -> Vec<T> {
    x.chunks(seq).flat_map(|r| (0..seq).map(move |t| if t + k < seq { r[t + k] } else { T::default() })).collect()
}

/// Where a multimodal run's images come from.
#[derive(Clone)]
enum ImageSource {
    /// `--image-text-data`: each record's image file.
    Files(Arc<Vec<ferrotron_data::image_text::ImageRef>>),
    /// `--mock-data`: seeded noise.
    Mock,
    /// The synthetic caption images of the text (`crate::multimodal::image`).
    Captions,
}

/// A multimodal micro-batch: each sample's image placeholders, then its text (the placeholders'
/// labels masked), and the images (`crate::multimodal::image`).
fn multimodal_batch(
    split: &TokenSplit,
    indices: &[usize],
    spec: &BatchSpec,
    (vision, source, seed, dtype): &(ferrotron_transformer::VisionSpec, ImageSource, u64, DType),
    dev: &Device,
) -> anyhow::Result<Batch> {
    let (seq, n) = (spec.seq, vision.image_tokens());
    let (b, text) = (indices.len(), seq - n);
    let (mut tokens, mut labels, mut mask) = (Vec::with_capacity(b * seq), Vec::with_capacity(b * seq), vec![]);
    let mut pixels = Vec::new();
    for &i in indices {
        let s = split.sample(i)?;
        if let Some(&bad) = s.iter().find(|&&t| t as usize >= spec.vocab || t == vision.image_token) {
            bail!(
                "token id {bad} in sample {i} is the image placeholder or not below the model's vocabulary size {}: the data was tokenized with another tokenizer than the one the model is built for",
                spec.vocab
            );
        }
        tokens.extend(std::iter::repeat_n(vision.image_token, n));
        tokens.extend_from_slice(&s[..text]);
        labels.extend(std::iter::repeat_n(s[0], n));
        labels.extend_from_slice(&s[1..]);
        mask.extend(std::iter::repeat_n(0.0, n));
        match (source, split.record(i)) {
            (ImageSource::Files(files), Some(r)) => {
                // A record's text, its end-of-document, then padding that does not count.
                let counted = s[1..].iter().position(|&t| t == spec.eod).map_or(text, |p| (p + 1).min(text));
                mask.extend((0..text).map(|j| if j < counted { 1.0 } else { 0.0 }));
                pixels.extend(ferrotron_data::image_text::load_image(&files[r], vision.img_h, vision.img_w)?);
            }
            (ImageSource::Files(_), None) => bail!("internal: image files without records"),
            (source, _) => {
                mask.extend(s[..text].iter().map(|&t| if spec.eod_mask == Some(t) { 0.0 } else { 1.0 }));
                let mock = matches!(source, ImageSource::Mock);
                pixels.extend(crate::multimodal::image(vision, &s[..text], i as u64, mock, *seed));
            }
        }
    }
    let patches =
        Tensor::from_f32(&vision.patchify(&pixels, b)?, [b, vision.seq_len(), vision.patch_len()], *dtype, dev)?;
    let images = ferrotron_transformer::Images::new(patches, &tokens, vision.image_token);
    let (tokens, labels) = (Tensor::from_vec(tokens, [b, seq], dev)?, Tensor::from_vec(labels, [b, seq], dev)?);
    Ok(Batch::masked(tokens, labels, mask)?.with_images(images))
}

/// This rank's micro-batches of one evaluation, Megatron's: `eval_iters` global batches from
/// sample `start` of the split on (wrapping at its end), each split over data-parallel ranks and
/// micro-batches as a training step's is.
fn eval_micro_batches(
    valid: &TokenSplit,
    cyclic: Option<&CyclicSampler>,
    s: &Settings,
    start: u64,
    (dp, dp_rank): (usize, usize),
    spec: &BatchSpec,
    dev: &Device,
) -> anyhow::Result<Vec<Batch>> {
    let (n, mb, gbs) = (valid.num_samples() as u64, s.micro_batch_size as u64, s.global_batch_size as u64);
    let mut out = Vec::new();
    for it in 0..s.eval_iters {
        for m in 0..s.num_micro_batches() / dp {
            let idx = micro_indices(cyclic, start + it * gbs, m, (dp, dp_rank), mb, Some(n))?;
            out.push(batch(valid, &idx, spec, dev)?);
        }
    }
    Ok(out)
}

/// The sample indices of this rank's micro-batch `m` of the global batch starting at sample
/// `batch_start`: the single sampler's run of `mb` from `micro_first_sample` (wrapped at `wrap`
/// samples where given: the validation split, read on past its end), or the cyclic sampler's
/// (placed by the samples consumed before the micro-batch: m · dp micro-batches into the batch).
fn micro_indices(
    cyclic: Option<&CyclicSampler>,
    batch_start: u64,
    m: usize,
    (dp, dp_rank): (usize, usize),
    mb: u64,
    wrap: Option<u64>,
) -> anyhow::Result<Vec<usize>> {
    if let Some(c) = cyclic {
        return Ok(c.micro_batch(micro_first_sample(batch_start, m, (dp, 0), mb), dp_rank)?);
    }
    let first = micro_first_sample(batch_start, m, (dp, dp_rank), mb);
    Ok((first..first + mb).map(|i| wrap.map_or(i, |n| i % n) as usize).collect())
}

/// The first sample of this rank's micro-batch `m` of the global batch starting at sample
/// `batch_start`: micro-batch j = m · dp + rank of the global batch, as Megatron's sampler deals
/// them out.
fn micro_first_sample(batch_start: u64, m: usize, (dp, dp_rank): (usize, usize), mb: u64) -> u64 {
    batch_start + (m * dp + dp_rank) as u64 * mb
}

/// Where world rank 0's metrics go: the JSONL file, and TensorBoard (`--tensorboard-dir`).
struct Metrics(Option<std::fs::File>, Option<crate::tensorboard::RunEvents>);

impl Metrics {
    fn write(&mut self, m: &Metric) -> anyhow::Result<()> {
        if let Some(f) = &mut self.0 {
            writeln!(f, "{}", serde_json::to_string(m)?)?;
        }
        if let Some(tb) = &mut self.1 {
            tb.write(m)?;
        }
        Ok(())
    }
}

fn progress(total: u64, start: u64, show: bool) -> ProgressBar {
    let pb = if show { ProgressBar::new(total) } else { ProgressBar::hidden() };
    pb.set_style(
        ProgressStyle::with_template("{bar:30} it {pos}/{len} | {msg} | ETA {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    pb.set_position(start);
    pb
}

/// Trains from `settings` on the ranks `paths.launch` describes; returns world rank 0's summary.
pub fn train(s: &Settings, paths: &Paths) -> anyhow::Result<Summary> {
    let summary = train_ranks(s, paths);
    // FERROTRON_GEMM_TUNE_REPORT=1: each GEMM shape's timed algorithms (the heuristic's first
    // against the one chosen), for the kernel notes.
    #[cfg(feature = "cuda")]
    if std::env::var("FERROTRON_GEMM_TUNE_REPORT").is_ok_and(|v| v == "1") {
        for t in ferrotron_kernels::cuda::gemm_tuning_report() {
            let gain = t.first_ms / t.best_ms;
            eprintln!(
                "gemm tuning: {}: {} candidates, first {:.4} ms, chosen #{} {:.4} ms ({gain:.3}x)",
                t.problem, t.candidates, t.first_ms, t.best, t.best_ms
            );
        }
    }
    summary
}

fn train_ranks(s: &Settings, paths: &Paths) -> anyhow::Result<Summary> {
    match &paths.launch {
        Launch::Single => in_pool(&paths.device, || train_rank(s, paths, thread_world(1, paths.timeout).remove(0))),
        Launch::Threads(n) => {
            let results =
                run_ranks(*n, paths.timeout, |_, world| train_rank(s, paths, world).map_err(|e| format!("{e:#}")));
            // The first error a rank had of its own: the others' then only say that it left.
            let mut summary = None;
            let mut failures = vec![];
            for (r, res) in results.into_iter().enumerate() {
                match res {
                    Ok(Ok(sm)) if r == 0 => summary = Some(sm),
                    Ok(Ok(_)) => {}
                    Ok(Err(e)) => failures.push(format!("rank {r}: {e}")),
                    Err(p) => failures.push(format!("rank {r} panicked: {p}")),
                }
            }
            if let Some(first) = failures.iter().find(|e| !e.contains(ferrotron_comm::PEER_LEFT)).or(failures.first()) {
                bail!("{first}");
            }
            summary.context("rank 0 returned nothing")
        }
        Launch::Processes(env) => {
            let world = world_for(env, &paths.device, paths.timeout)?;
            in_pool(&paths.device, || train_rank(s, paths, world))
        }
    }
}

/// On CPU, runs `f` on a worker of the kernels' thread pool: each parallel kernel it calls then
/// starts on this thread and shares the work, instead of the caller handing every kernel to the
/// pool and sleeping until it ends (two thread wake-ups per kernel, a tenth of a CPU step). GPU
/// runs stay on the calling thread (the one their CUDA context and NCCL were set up on).
fn in_pool<R: Send>(device: &Device, f: impl FnOnce() -> R + Send) -> R {
    if device.is_cpu() { rayon::scope(|_| f()) } else { f() }
}

/// The world communicator of one process under a launcher: NCCL on a GPU, TCP on CPU.
fn world_for(env: &ferrotron_comm::DistEnv, dev: &Device, timeout: std::time::Duration) -> anyhow::Result<Comm> {
    match dev {
        #[cfg(feature = "cuda")]
        Device::Cuda(d) => Ok(std::sync::Arc::new(ferrotron_comm::NcclComm::new(d, env, timeout)?)),
        _ => Ok(ferrotron_comm::tcp_world(env, timeout)?),
    }
}

/// Per-rank layout and memory, gathered to rank 0 as one line per rank.
fn layout_table(g: &ProcessGroups, table: &ParamTable, opt: &Optimizer, sp: bool) -> anyhow::Result<Option<String>> {
    const MIB: f32 = 1024.0 * 1024.0;
    let (pb, gb) = (table.flat_len() * table.flat_params().dtype().size_in_bytes(), table.flat_len() * 4);
    let mine = [
        g.tp.rank() as f32,
        g.cp.rank() as f32,
        g.dp.rank() as f32,
        g.pp.rank() as f32,
        table.numel() as f32,
        pb as f32 / MIB,
        gb as f32 / MIB,
        opt.state_bytes() as f32 / MIB,
    ];
    let n = g.world.size();
    let all = Tensor::zeros([n * mine.len()], DType::F32, &Device::Cpu)?;
    g.world.all_gather(&Tensor::from_vec(mine.to_vec(), [mine.len()], &Device::Cpu)?, &all)?;
    if g.world.rank() != 0 {
        return Ok(None);
    }
    let v = all.to_vec_f32()?;
    let mut out = format!(
        "layout: tp {}{} × dp {} × pp {}{}\n rank  tp  cp  dp  pp  params(local)  params MiB  grads MiB  optimizer MiB{}\n",
        g.layout.tp,
        if g.layout.cp > 1 { format!(" × cp {}", g.layout.cp) } else { String::new() },
        g.layout.dp,
        g.layout.pp,
        if sp && g.tp.size() > 1 { ", sequence parallel" } else { "" },
        if opt.offloaded() { " (host)" } else { "" }
    );
    for (r, x) in v.chunks(mine.len()).enumerate() {
        out += &format!(
            "{r:>5} {:>3} {:>3} {:>3} {:>3} {:>14} {:>11.2} {:>10.2} {:>14.2}\n",
            x[0] as usize, x[1] as usize, x[2] as usize, x[3] as usize, x[4] as usize, x[5], x[6], x[7]
        );
    }
    Ok(Some(out))
}

/// Peak saved-activation bytes of each pipeline stage (the largest over its ranks), one line.
fn saved_bytes_table(g: &ProcessGroups, peak: usize) -> anyhow::Result<String> {
    let n = g.world.size();
    let all = Tensor::zeros([n * 2], DType::F32, &Device::Cpu)?;
    let mine = Tensor::from_vec(vec![g.pp.rank() as f32, peak as f32 / (1024.0 * 1024.0)], [2], &Device::Cpu)?;
    g.world.all_gather(&mine, &all)?;
    let v = all.to_vec_f32()?;
    let mut per_stage = vec![0f32; g.pp.size()];
    for x in v.chunks(2) {
        let st = x[0] as usize;
        per_stage[st] = per_stage[st].max(x[1]);
    }
    let cells: Vec<String> = per_stage.iter().enumerate().map(|(st, m)| format!("stage {st} {m:.2} MiB")).collect();
    Ok(format!("saved activations at peak (per rank): {}\n", cells.join(", ")))
}

/// The kernels' per-thread switches for a rank's run, back to their defaults when it ends (under
/// `Launch::Single` the rank runs on the caller's thread, which may call kernels afterwards).
struct RankThreadFlags;

impl RankThreadFlags {
    fn set(deterministic: bool, fp32_split_k_sums: bool) -> RankThreadFlags {
        #[cfg(feature = "cuda")]
        {
            ferrotron_kernels::cuda::set_deterministic(deterministic);
            ferrotron_kernels::cuda::set_fp32_split_k_sums(fp32_split_k_sums);
        }
        #[cfg(not(feature = "cuda"))]
        let _ = (deterministic, fp32_split_k_sums);
        // Every batch's ids are checked on the host (`batch`) before they reach a device.
        ferrotron_kernels::set_device_ids_prechecked(true);
        RankThreadFlags
    }
}

impl Drop for RankThreadFlags {
    fn drop(&mut self) {
        #[cfg(feature = "cuda")]
        {
            ferrotron_kernels::cuda::set_deterministic(false);
            ferrotron_kernels::cuda::set_fp32_split_k_sums(false);
        }
        ferrotron_kernels::set_device_ids_prechecked(false);
    }
}

/// The routers' loss values recorded since the last log line, averaged over every rank's MoE
/// layers (a collective over the world); None where no layer recorded any (both losses off).
/// With `layers` (the decoder's layers and prediction depths: --moe-per-layer-logging) also each
/// layer's, averaged over the ranks that hold it (dense layers 0).
#[allow(clippy::type_complexity)]
fn router_losses(
    g: &ProcessGroups,
    m: &ferrotron_moe::MoeMetrics,
    layers: Option<(usize, usize)>,
) -> anyhow::Result<(Option<(f64, f64)>, Vec<(f64, f64)>)> {
    let v = m.take()?;
    let mut sums = vec![v.load_balancing_sum as f32, v.z_sum as f32, v.layers as f32];
    // Per layer: load-balancing sum, z sum, ranks that recorded it.
    let total = layers.map_or(0, |(decoder, mtp)| decoder + mtp);
    let mut per = vec![0f32; 3 * total];
    if let Some((decoder, _)) = layers {
        for (name, lb, z) in &v.per_layer {
            let index = moe_layer_index(name, decoder)
                .with_context(|| format!("an MoE layer named {name} has no layer number"))?;
            if let Some(slot) = per.get_mut(3 * index..3 * index + 3) {
                slot.copy_from_slice(&[*lb as f32, *z as f32, 1.0]);
            }
        }
    }
    sums.extend(per);
    let n = sums.len();
    let t = Tensor::from_vec(sums, [n], &Device::Cpu)?;
    g.world.all_reduce(&t, ReduceOp::Sum)?;
    let t = t.to_vec_f32()?;
    let mean = (t[2] > 0.0).then(|| (t[0] as f64 / t[2] as f64, t[1] as f64 / t[2] as f64));
    let each = t[3..]
        .chunks(3)
        .map(|c| if c[2] > 0.0 { (c[0] as f64 / c[2] as f64, c[1] as f64 / c[2] as f64) } else { (0.0, 0.0) })
        .collect();
    Ok((mean, each))
}

/// An MoE module's layer number over the decoder's `decoder` layers then the prediction depths
/// (`decoder.layers.3.mlp` → 3, `mtp.layers.0.transformer_layer.mlp` → decoder).
fn moe_layer_index(name: &str, decoder: usize) -> Option<usize> {
    let number = |rest: &str| rest.split('.').next()?.parse::<usize>().ok();
    match (name.strip_prefix("decoder.layers."), name.strip_prefix("mtp.layers.")) {
        (Some(rest), _) => number(rest),
        (_, Some(rest)) => number(rest).map(|d| decoder + d),
        _ => None,
    }
}

/// `--calculate-per-token-loss`: every micro-batch's loss divided by the global batch's loss
/// tokens over (micro-batches × data × context-parallel ranks) instead of by its own count, so
/// that the gradient (the mean over micro-batches, averaged over data × context-parallel ranks)
/// is that of the mean over every loss token of the global batch. The count is summed over the
/// data-parallel group (a context-parallel rank's batch holds its sequences' whole count over cp).
fn per_token(micros: Vec<Batch>, g: &ProcessGroups, cp: usize) -> anyhow::Result<Vec<Batch>> {
    let whole: f64 = micros.iter().map(|b| (b.num_tokens() * cp as f64).round()).sum();
    let t = Tensor::from_vec(vec![u32::try_from(whole as u64)?], [1], &Device::Cpu)?;
    g.dp.all_reduce(&t, ReduceOp::Sum)?;
    let total = t.to_vec::<u32>()?[0] as f64;
    let share = total / (micros.len() * g.dp.size() * cp) as f64;
    Ok(micros.into_iter().map(|b| b.per_token(share)).collect::<Result<_, _>>()?)
}

/// The least common multiple of two sizes.
fn lcm(a: usize, b: usize) -> usize {
    let gcd = |mut a: usize, mut b: usize| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    a / gcd(a, b) * b
}

/// One rank's training run.
fn train_rank(s: &Settings, paths: &Paths, world: Comm) -> anyhow::Result<Summary> {
    let _flags = RankThreadFlags::set(paths.deterministic, paths.fp32_split_k_sums);
    let layout = s.validate_layout(world.size())?;
    let g = ProcessGroups::new(world, layout)?;
    let rank0 = g.world.rank() == 0;
    let tp = TensorParallel::new(g.tp.clone(), s.sequence_parallel);
    let data = Data::build(s)?;
    let dtype = if s.bf16 { DType::BF16 } else { DType::F32 };
    let dev = paths.device.clone();
    let plan = s.stage_plan(g.pp.rank())?;
    let mut config = s.model_config()?;
    if let Some(m) =
        ferrotron_models::moe_spec(&config).filter(|m| m.expert_parallel_size > 1 || layout.cp > 1 || layout.dp > 1)
    {
        // This rank's layers dispatch their tokens over its expert-parallel group, and count a
        // micro-batch's tokens for the routers' losses over its context-parallel group (and,
        // for the global-batch loss, its data-parallel group).
        let mut m = m.clone();
        if m.expert_parallel_size > 1 {
            m = m.with_group(g.ep.clone());
        }
        if layout.cp > 1 {
            m = m.with_context_parallel(g.cp.clone());
        }
        if layout.dp > 1 {
            m = m.with_data_parallel(g.dp.clone());
        }
        config.layer.mlp = ferrotron_transformer::spec::MlpSpec::Custom(Arc::new(m));
    }
    if let (true, Some(m)) = (layout.cp > 1, ferrotron_models::hybrid::mamba_spec(&config)) {
        // This rank's Mamba mixers trade rows for heads over its context-parallel group.
        let m = m.with_context_parallel(ContextParallel::new(g.cp.clone()));
        if let Some(h) = config.layer.hybrid.as_mut() {
            h.mixer = Some(Arc::new(m));
        }
    }
    let moe_metrics = ferrotron_models::moe_spec(&config).map(|m| m.metrics.clone());
    // The global-batch load-balancing loss's running counts, cleared after every step.
    let global_counts = ferrotron_models::moe_spec(&config).map(|m| m.global_counts.clone());
    // DeepSeek-V3's expert biases: registered by the layers as they are built, moved after every
    // step at this rate.
    let expert_bias = ferrotron_models::moe_spec(&config)
        .and_then(|m| m.router.expert_bias_update_rate.map(|rate| (m.biases.clone(), rate)));
    // Padded for the gradient reduction and the distributed optimizer's shards: over data ×
    // context-parallel ranks, and over the experts' data-parallel ranks (more than those with
    // whole experts under tensor parallelism).
    let pad = lcm(layout.dp * layout.cp, g.edp.size());
    let (mut model, mut table) = match s.vision_spec()? {
        Some(v) => GptModel::build_multimodal(config, &v, &tp, &plan, s.recompute()?, &dev, dtype, s.seed, pad)?,
        None => GptModel::build_stage(config, &tp, &plan, s.recompute()?, &dev, dtype, s.seed, pad)?,
    };
    if let Some(v) = &s.vision {
        // Megatron's --freeze-LM / --freeze-ViT: the vision projection always trains.
        table.freeze(|m| {
            let vit = m.name.starts_with("vision_model.");
            (v.freeze_vit && vit) || (v.freeze_lm && !vit && !m.name.starts_with("vision_projection."))
        });
    }
    if s.apply_wd_to_qk_layernorm {
        table.decay(crate::settings::qk_layernorm_param);
    }
    let cp = (layout.cp > 1).then(|| ContextParallel::new(g.cp.clone()));
    if let Some(cp) = &cp {
        model.set_context_parallel_by_layer(cp.clone(), &s.cp_comm_types()?)?;
    }
    // FP8 delayed scaling's state: the layers take their slots, then it is made on the device,
    // its amaxes reduced (max) over the stage's ranks so that all of them quantize alike
    // (Megatron's amax reduction group: tensor × data × context parallel).
    let fp8_metas = match s.fp8()? {
        Some((format, delayed)) => {
            let delayed = delayed.map(ferrotron_core::Fp8Metas::new);
            model.set_fp8(Some(ferrotron_core::Fp8Recipe { format, delayed: delayed.clone() }), s.fp8_bf16_ends)?;
            if let Some(m) = &delayed {
                m.allocate(&dev)?;
                // A group of its own: the gradient reduction's worker thread (CPU overlap) may
                // be using the data-parallel one meanwhile.
                let stage = g.layout.dense().groups(&[Dim::Tp, Dim::Dp, Dim::Cp]);
                let c = g.world.split("fp8-amax", &stage)?.context("this rank is in no pipeline stage's group")?;
                if c.size() > 1 {
                    m.set_reduce(Box::new(move |row| {
                        c.all_reduce(row, ReduceOp::Max)
                            .map_err(|e| ferrotron_core::invalid("fp8 amax reduction", e.to_string()))
                    }));
                }
            }
            delayed
        }
        None => None,
    };
    let model = model;
    if s.grad_reduce_in_bf16 {
        table.set_grad_dtype(DType::BF16)?;
    }
    let pipelined = layout.pp > 1 || plan.chunks.len() > 1;
    let bucket = s.ddp_bucket_size.unwrap_or_else(|| default_bucket_size(layout.dp * layout.cp));
    let mut sync = GradSync::new(
        &table,
        g.dp_cp.clone(),
        g.tp.clone(),
        bucket,
        s.use_distributed_optimizer,
        s.overlap_grad_reduce,
    )
    .with_overlap_param_gather(s.overlap_param_gather);
    if layout.ep > 1 || layout.etp != layout.tp {
        // Whole experts under tensor parallelism: tp ranks' tokens add into each expert.
        sync = sync.with_experts(g.edp.clone(), g.ep.clone(), layout.tp / layout.etp);
    }
    if let (Some(id), Some(embd)) = (model.tied_weight(), &g.embd) {
        sync = sync.with_tied(table.range(id), embd.clone());
    }
    let adam = AdamConfig {
        beta1: s.adam_beta1,
        beta2: s.adam_beta2,
        eps: s.adam_eps,
        weight_decay: s.weight_decay,
        clip_grad: s.clip_grad,
        algorithm: s.algorithm(),
        exp_avg_dtype: if s.exp_avg_bf16 { DType::BF16 } else { DType::F32 },
        exp_avg_sq_dtype: if s.exp_avg_sq_bf16 { DType::BF16 } else { DType::F32 },
        cpu_offload: s.optimizer_cpu_offload,
    };
    let mut opt = Optimizer::new_parallel(&table, adam, &sync, g.mp.clone(), g.tp.rank())?;
    let (warmup, decay, wsd_decay) = s.schedule_samples();
    let wd_sched = s.wd_schedule()?;
    let sched = LrSchedule {
        lr: s.lr,
        min_lr: s.min_lr,
        init_lr: s.lr_warmup_init,
        warmup,
        decay,
        wsd_decay,
        style: s.decay_style()?,
    };
    // The word embedding and output layer's rate on the same warmup and decay (Megatron's
    // decoupled parameter group: its own max and min, the warmup's start shared).
    let decoupled = s.decoupled_lr.map(|lr| LrSchedule { lr, min_lr: s.decoupled_min_lr.unwrap_or(s.min_lr), ..sched });
    let (mut iteration, mut consumed, mut consumed_valid) = (0u64, 0u64, 0u64);
    // Model FLOPs trained before this job (--log-progress counts across jobs).
    let mut flops_before = 0.0;
    if let Some(dir) = &paths.load {
        let ck = checkpoint::open(dir, paths.load_mode == LoadMode::Resume)?;
        checkpoint::check_meaning(ck.state(), s, dir)?;
        if let Some(m) = &fp8_metas {
            let absent = crate::fp8_state::restore(ck.as_ref(), m, &table)?;
            if absent > 0 && rank0 {
                eprintln!(
                    "fp8: the checkpoint lacks the delayed-scaling state of {absent} of {} FP8 layers (saved without --fp8-recipe delayed, or with another --fp8-amax-history-len): those start from scale 1",
                    m.layers()
                );
            }
        }
        if let Some((biases, _)) = &expert_bias {
            let finetune = paths.load_mode == LoadMode::Finetune;
            if checkpoint::restore_biases(ck.as_ref(), &biases.layers(), finetune)? && rank0 {
                eprintln!("the checkpoint lacks expert biases: those start from zero (--finetune)");
            }
        }
        if paths.load_mode == LoadMode::Resume {
            checkpoint::restore(ck.as_ref(), &table, &mut opt)?;
        } else {
            checkpoint::restore_params(ck.as_ref(), &table)?;
            // A fresh optimizer: fp32 master weights from the loaded parameters, no moments.
            opt = Optimizer::new_parallel(&table, adam, &sync, g.mp.clone(), g.tp.rank())?;
        }
        if paths.load_mode != LoadMode::Finetune {
            let st = ck.state();
            (iteration, consumed, consumed_valid) = (st.iteration, st.consumed_samples, st.consumed_valid_samples);
            flops_before = st.floating_point_operations;
        }
        if rank0 {
            let what = match paths.load_mode {
                LoadMode::Resume => "resumed",
                LoadMode::NoOptim => "loaded (parameters and position; fresh optimizer)",
                LoadMode::Finetune => "loaded for fine-tuning (parameters only)",
            };
            eprintln!("{what} from {} at iteration {iteration}", dir.display());
        }
    }
    let mut metrics = Metrics(
        match (&paths.metrics, rank0) {
            (Some(f), true) => {
                if let Some(d) = f.parent().filter(|d| !d.as_os_str().is_empty()) {
                    std::fs::create_dir_all(d).with_context(|| format!("{}: cannot create the folder", d.display()))?;
                }
                let file = std::fs::OpenOptions::new().create(true).append(true).open(f);
                Some(file.with_context(|| format!("metrics file {}", f.display()))?)
            }
            _ => None,
        },
        match (&s.tensorboard_dir, rank0) {
            (Some(d), true) => Some(crate::tensorboard::RunEvents::create(d, s, g.world.size())?),
            _ => None,
        },
    );
    let mut summary = Summary {
        losses: vec![],
        grad_norms: vec![],
        evals: vec![],
        checkpoints: vec![],
        logs: rank0,
        graphed_steps: 0,
        router_losses: vec![],
        router_losses_per_layer: vec![],
        mtp_losses: vec![],
        skipped: vec![],
    };
    let (dp, dp_rank) = (layout.dp, g.dp.rank());
    // --dataloader-type cyclic: each split read in Megatron's random sampler's order (a
    // micro-batch placed by the samples consumed before it, so a resumed run reads on).
    let cyclic = |name: &str, split: &TokenSplit| {
        CyclicSampler::new(name, split.num_samples(), s.micro_batch_size, dp, !s.no_data_sharding)
    };
    let (cyclic_train, cyclic_valid) = match s.dataloader_type.as_str() {
        // The validation split's only where evaluations read it.
        "cyclic" => (
            Some(cyclic("train", &data.train)?),
            data.valid.as_ref().filter(|_| s.eval_iters > 0).map(|v| cyclic("valid", v)).transpose()?,
        ),
        _ => (None, None),
    };
    let schedule = s.batch_schedule()?;
    let micros_at = |consumed: u64| (schedule.at(consumed) / s.micro_batch_size as u64) as usize / dp;
    let micro_per_rank = micros_at(consumed);
    let table_text = layout_table(&g, &table, &opt, s.sequence_parallel)?;
    // A LLaVA run's encoder and projection: one image per sample of --seq-length tokens.
    let flops_per_token = model.config.flops_per_token()
        + s.vision_spec()?.map_or(0.0, |v| v.flops_per_image(s.hidden_size) / s.seq_length as f64);
    if rank0 {
        eprintln!(
            "{dev}: {} parameters ({:.2} MFLOP/token), {} layers, hidden {}, {} heads; data: {} train / {} valid samples; {} micro-batches of {} per step on each of {dp} data-parallel rank(s)",
            model.config.num_params() + s.vision_spec()?.map_or(0, |v| v.num_params(s.hidden_size)),
            flops_per_token / 1e6,
            s.num_layers,
            s.hidden_size,
            s.num_attention_heads,
            data.train.num_samples(),
            data.valid.as_ref().map_or(0, |v| v.num_samples()),
            micro_per_rank,
            s.micro_batch_size
        );
        if g.world.size() > 1 {
            eprint!("{}", table_text.unwrap_or_default());
        }
        if let Some(f) = &s.fp8_format {
            let [first, last] = s.fp8_bf16_ends;
            let kept = if first + last > 0 {
                format!("; the first {first} and last {last} layers in bf16")
            } else {
                String::new()
            };
            let scaling = match s.fp8_recipe.as_str() {
                "delayed" => format!(
                    "delayed scaling: amax history {}, {}, margin {}",
                    s.fp8_amax_history_len, s.fp8_amax_compute_algo, s.fp8_margin
                ),
                r => format!("{r} scaling"),
            };
            eprintln!("fp8: the transformer layers' linear products in FP8 ({f}, {scaling}){kept}");
        }
        if s.log_memory_to_tensorboard && dev.is_cpu() {
            eprintln!("--log-memory-to-tensorboard: the CPU has no device memory pool; no memory is logged");
        }
    }
    let spec = BatchSpec {
        seq: s.seq_length,
        vocab: model.config.vocab_size,
        eod_mask: s.eod_mask_loss.then(|| data.tokenizer.eod()),
        eod: data.tokenizer.eod(),
        cp,
        mtp_depths: model.config.mtp.map_or(0, |m| m.num_layers),
        // Rotary embeddings take no position ids (as Megatron Core's): only learned ones use them.
        reset_positions: s.reset_position_ids
            && model.config.position_embedding == ferrotron_transformer::spec::PositionEmbedding::LearnedAbsolute,
        reset_attention: s.reset_attention_mask,
        vision: s.vision_spec()?.map(|v| {
            let source = match (&data.images, s.mock_data) {
                (Some(files), _) => ImageSource::Files(files.clone()),
                (None, true) => ImageSource::Mock,
                (None, false) => ImageSource::Captions,
            };
            (v, source, s.seed, dtype)
        }),
    };
    // The validation loss over one evaluation's batches (`eval_micro_batches`) from sample
    // `start` on; None without a validation split (`--split` gave it no share) or with
    // `--eval-iters 0`, as in Megatron.
    let eval = |model: &GptModel, table: &ParamTable, start: u64| -> anyhow::Result<Option<f64>> {
        let Some(valid) = data.valid.as_ref().filter(|_| s.eval_iters > 0) else { return Ok(None) };
        let micros = eval_micro_batches(valid, cyclic_valid.as_ref(), s, start, (dp, dp_rank), &spec, &dev)?;
        // Token-weighted over all of them, across data-parallel ranks too, as Megatron's.
        let (sum, count) = if pipelined {
            eval_pipelined(model, table, &g.pipeline, &g.pp, &micros)?
        } else {
            let cx = Cx::new(table, false);
            let losses =
                micros.iter().map(|b| Ok(model.forward_deferred(&cx, b)?.0)).collect::<anyhow::Result<Vec<_>>>()?;
            loss_sums(&losses)?
        };
        Ok(Some(token_weighted(&g.dp_cp, sum, count)?))
    };
    // Iteration 0's evaluation (which Megatron does not run) reads the samples the first one at
    // --eval-interval reads; each later one moves on by its eval_iters global batches. With
    // --skip-train (Megatron's) that evaluation, at the loaded iteration, is the whole run.
    if iteration == 0 || s.skip_train {
        if let Some(l) = eval(&model, &table, consumed_valid)? {
            if rank0 {
                eprintln!("iteration {iteration}: validation loss {l:.4}");
            }
            metrics.write(&Metric::Eval { iteration, loss: l, consumed_samples: consumed })?;
            summary.evals.push((iteration, l));
        }
        if s.skip_train {
            return Ok(summary);
        }
    }
    let pb = progress(s.train_iters, iteration, paths.progress && rank0);
    // Model FLOPs after `consumed` samples: this job's at the per-token count from where it began.
    let consumed_at_start = consumed;
    let flops_at =
        |consumed: u64| flops_before + (consumed - consumed_at_start) as f64 * s.seq_length as f64 * flops_per_token;
    let progress = match (&paths.save, paths.log_progress && rank0) {
        (Some(dir), true) => Some(Progress {
            log: ProgressLog::start(dir, g.world.size(), flops_before)?,
            background: paths.async_save,
            seq_length: s.seq_length as u64,
        }),
        _ => None,
    };
    let start = Instant::now();
    // The window's start and the samples trained in it.
    let mut window = (Instant::now(), 0u64);
    let mut host_min = f64::INFINITY;
    let mb = s.micro_batch_size as u64;
    // Steps queued since the last log line: their losses are read back together at the next log
    // interval (or the end of training), not after every step.
    let mut queued: Vec<(u64, QueuedStep)> = Vec::new();
    let mut pending: Option<checkpoint::PendingSave> = None;
    // --exit-signal-handler: SIGTERM sets the flag; the loop saves and stops after the iteration.
    let signal = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let _sigterm = match paths.exit_signal {
        true => Some(SigTerm(
            signal_hook::flag::register(signal_hook::consts::SIGTERM, signal.clone())
                .context("--exit-signal-handler: installing the SIGTERM handler")?,
        )),
        false => None,
    };
    let first_iteration = iteration + 1;
    let mut last_gbs = 0u64;
    // --cuda-graph-impl local: the step graphed after its warm-up steps (one GPU, checked).
    let mut graph = paths.cuda_graph_warmup.map(StepGraph::new);
    // Megatron's --profile: a CUDA profiler range over steps start + 1 ..= end on the ranks listed.
    let profile = paths.profile.as_ref().filter(|p| p.ranks.contains(&g.world.rank()));
    while iteration < s.train_iters {
        if let Some(p) = profile.filter(|p| p.start == iteration) {
            dev.profiler_range(true).context("--profile: opening the CUDA profiler range")?;
            if p.trace.is_some() {
                ferrotron_core::gpu_trace::start().context("--profile-trace: starting the GPU trace")?;
            }
        }
        iteration += 1;
        let host_start = Instant::now();
        // The split's own order is Megatron's shuffled one, so its samples are taken in turn. A
        // micro-batch's random draws (dropout) start at its first sample's place in the run,
        // whatever rank or micro-batch holds it.
        let gbs = schedule.at(consumed);
        if rank0 && last_gbs != 0 && gbs != last_gbs {
            let n = micros_at(consumed);
            pb.suspend(|| {
                eprintln!("iteration {iteration}: global batch size {gbs} ({n} micro-batches per data-parallel rank)")
            });
        }
        last_gbs = gbs;
        let micros = (0..micros_at(consumed))
            .map(|m| {
                let first = micro_first_sample(consumed, m, (dp, dp_rank), mb);
                let idx = micro_indices(cyclic_train.as_ref(), consumed, m, (dp, dp_rank), mb, None)?;
                let draw = Draw { seed: s.seed, first_sample: first };
                Ok(batch(&data.train, &idx, &spec, &dev)?.with_draw(draw))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        let micros = if s.calculate_per_token_loss { per_token(micros, &g, layout.cp)? } else { micros };
        // Megatron's scheduler steps after each update: an iteration trains at the rate of the
        // samples consumed before it.
        let lr = sched.lr_at(consumed);
        let decoupled_lr = decoupled.map(|d| d.lr_at(consumed));
        opt.set_weight_decay(wd_sched.wd_at(consumed) as f32);
        opt.set_decoupled_lr(decoupled_lr.map(|l| l as f32));
        consumed += gbs;
        let step = if pipelined {
            queue_train_step_pipelined(&model, &table, &mut sync, &mut opt, &g.pipeline, &g.pp, &micros, lr as f32)?
        } else if let Some(gr) = graph.as_mut() {
            let was = gr.is_captured();
            let q = gr.queue(&model, &table, &mut sync, &mut opt, &micros, lr as f32)?;
            if !was && gr.is_captured() && rank0 {
                pb.suspend(|| eprintln!("iteration {iteration}: step captured as a CUDA graph, replayed from here on"));
            }
            if was && !gr.is_captured() && rank0 {
                pb.suspend(|| {
                    eprintln!(
                        "iteration {iteration}: a batch of another shape: the CUDA graph released, this step run \
                         eagerly, the step captured again after the warm-up"
                    )
                });
            }
            q
        } else {
            queue_train_step(&model, &table, &mut sync, &mut opt, &micros, lr as f32)?
        };
        if let Some(c) = &global_counts {
            c.reset();
        }
        if let Some((biases, rate)) = &expert_bias {
            // Each expert's copies over the step's micro-batches, summed over the stage's ranks
            // (tensor-parallel ranks routing the same tokens count them alike: the signs stay).
            biases.update(*rate, |v| {
                let n = v.len();
                let t = Tensor::from_vec(std::mem::take(v), [n], &Device::Cpu)?;
                let sum = |c: &Comm| {
                    c.all_reduce(&t, ReduceOp::Sum)
                        .map_err(|e| ferrotron_core::invalid("expert bias counts", e.to_string()))
                };
                sum(&g.dp_cp)?;
                sum(&g.tp)?;
                *v = t.to_vec_f32()?;
                Ok(())
            })?;
        }
        host_min = host_min.min(1e3 * host_start.elapsed().as_secs_f64());
        if iteration == first_iteration {
            let text = saved_bytes_table(&g, step.saved_peak_bytes())?;
            if rank0 {
                pb.suspend(|| eprint!("{text}"));
            }
        }
        queued.push((iteration, step));
        window.1 += gbs;
        if let Some(p) = profile.filter(|p| p.end == iteration) {
            dev.profiler_range(false).context("--profile: closing the CUDA profiler range")?;
            if let Some(path) = &p.trace {
                finish_trace(&dev, path, g.world.rank(), p, &pb)?;
            }
        }
        if iteration % s.log_interval == 0 || iteration == s.train_iters {
            let skipped_before = summary.skipped.len();
            let out = read_queued(&mut queued, &mut summary)?.context("no step queued at a log interval")?;
            if let Some(&first) = summary.skipped.get(skipped_before) {
                // Every rank reads the same norms (summed over the world), so all stop here together.
                let at = |l: &[(u64, f64)]| l.iter().find(|x| x.0 == first).map_or(f64::NAN, |x| x.1);
                let (loss, norm) = (at(&summary.losses), at(&summary.grad_norms));
                if s.check_for_nan_in_loss_and_grad {
                    finish_pending(&g, &mut pending, &mut summary, &pb, rank0, progress.as_ref())?;
                    bail!(
                        "iteration {first}: the loss is {loss} and the gradient norm {norm}, not finite; its update was skipped, so the parameters and optimizer state are iteration {}'s. Stopped (--check-for-nan-in-loss-and-grad, Megatron's default): resume from the last checkpoint with a lower --lr or a --clip-grad, or pass --no-check-for-nan-in-loss-and-grad to skip such steps and go on",
                        first - 1
                    );
                }
                if rank0 {
                    let n = summary.skipped.len() - skipped_before;
                    pb.suspend(|| {
                        eprintln!(
                            "iteration {iteration}: {n} update(s) skipped since the last log line (gradient norm not finite, first at iteration {first}); {} in the run",
                            summary.skipped.len()
                        )
                    });
                }
            }
            let loss = out.loss;
            let secs = window.0.elapsed().as_secs_f64();
            let tps = (window.1 * s.seq_length as u64) as f64 / secs.max(1e-9);
            window.1 = 0;
            let per_layer = s.moe_per_layer_logging.then(|| (s.num_layers, s.mtp_num_layers.unwrap_or(0)));
            let (router, moe_layer_losses) = match &moe_metrics {
                Some(m) => router_losses(&g, m, per_layer)?,
                None => (None, vec![]),
            };
            if let Some((lb, z)) = router {
                summary.router_losses.push((iteration, lb, z));
            }
            if !moe_layer_losses.is_empty() {
                summary.router_losses_per_layer.push((iteration, moe_layer_losses.clone()));
            }
            // A collective over the model- and data-parallel groups: every rank, after the update.
            let params_norm = if s.log_params_norm { Some(opt.params_norm(&table)?) } else { None };
            // The gradients stay as the log line's step left them until the next step starts.
            let num_zeros_in_grad = if s.log_num_zeros_in_grad { Some(opt.num_zeros_in_grad(&table)?) } else { None };
            let memory = if s.log_memory_to_tensorboard { dev.memory_stats()?.map(MemoryLine::from) } else { None };
            let tflops_per_gpu = s.log_throughput.then(|| tps * flops_per_token / g.world.size() as f64 / 1e12);
            let m = Metric::Train {
                iteration,
                loss,
                lr,
                decoupled_lr,
                grad_norm: out.grad_norm,
                tokens_per_s: tps,
                host_ms_min: std::mem::replace(&mut host_min, f64::INFINITY),
                elapsed_s: start.elapsed().as_secs_f64(),
                consumed_samples: consumed,
                global_batch_size: gbs,
                load_balancing_loss: router.map(|r| r.0),
                z_loss: router.map(|r| r.1),
                moe_layer_losses,
                mtp_losses: out.mtp_losses.clone(),
                tflops_per_gpu,
                params_norm,
                num_zeros_in_grad,
                memory,
            };
            metrics.write(&m)?;
            pb.set_message(format!("loss {loss:.4} | lr {lr:.2e} | {tps:.0} tok/s"));
            if pb.is_hidden() && rank0 {
                let moe = router.map_or(String::new(), |(lb, z)| format!(" load-balancing {lb:.4} z-loss {z:.4}"));
                let tflops = tflops_per_gpu.map_or(String::new(), |t| format!(" {t:.3} TFLOP/s/GPU"));
                let pn = params_norm.map_or(String::new(), |p| format!(" params-norm {p:.3}"));
                let zeros = num_zeros_in_grad.map_or(String::new(), |z| format!(" num-zeros {z:.0}"));
                let dlr = decoupled_lr.map_or(String::new(), |l| format!(" decoupled-lr {l:.3e}"));
                let mtp: String =
                    out.mtp_losses.iter().enumerate().map(|(k, l)| format!(" mtp_{} loss {l:.4}", k + 1)).collect();
                eprintln!(
                    "iteration {iteration}/{}: loss {loss:.4}{mtp} lr {lr:.3e}{dlr} grad-norm {:.3}{pn}{zeros}{moe} {tps:.0} tokens/s{tflops}",
                    s.train_iters, out.grad_norm
                );
            }
        }
        pb.set_position(iteration);
        if iteration % s.eval_interval == 0 || iteration == s.train_iters {
            let l = eval(&model, &table, consumed_valid)?;
            consumed_valid += s.eval_iters * s.global_batch_size as u64;
            if let Some(l) = l {
                if rank0 {
                    pb.suspend(|| eprintln!("iteration {iteration}: validation loss {l:.4}"));
                }
                metrics.write(&Metric::Eval { iteration, loss: l, consumed_samples: consumed })?;
                summary.evals.push((iteration, l));
            }
        }
        let mut exit = paths.exit_interval.is_some_and(|e| iteration % e == 0).then_some("--exit-interval");
        if exit.is_none() && (paths.exit_signal || paths.exit_duration.is_some()) {
            // Every rank stops at the same iteration: the reasons are agreed over the world.
            let mine = [
                signal.load(std::sync::atomic::Ordering::Relaxed) as u8 as f32,
                paths.exit_duration.is_some_and(|d| start.elapsed() > d) as u8 as f32,
            ];
            let t = Tensor::from_vec(mine.to_vec(), [2], &Device::Cpu)?;
            g.world.all_reduce(&t, ReduceOp::Max)?;
            let any = t.to_vec_f32()?;
            exit = if any[0] > 0.0 {
                Some("SIGTERM, --exit-signal-handler")
            } else {
                (any[1] > 0.0).then_some("--exit-duration-in-mins")
            };
        }
        // An asynchronous save completes at a log interval once every rank's file is written.
        let written = match &pending {
            Some(p) if iteration % s.log_interval == 0 => checkpoint::all_written(&g, p)?,
            _ => false,
        };
        if written {
            finish_pending(&g, &mut pending, &mut summary, &pb, rank0, progress.as_ref())?;
        }
        // A persistent save at --save-interval, the end and an exit; between them Megatron's
        // non-persistent ones, into a folder that keeps only the newest.
        let persistent = iteration % s.save_interval == 0 || iteration == s.train_iters || exit.is_some();
        let target = match (&paths.save, &paths.non_persistent) {
            (Some(dir), _) if persistent => Some(dir),
            (Some(_), Some(np)) if iteration % np.interval == 0 => {
                finish_pending(&g, &mut pending, &mut summary, &pb, rank0, progress.as_ref())?;
                if rank0 {
                    checkpoint::keep_newest(&np.dir)?;
                }
                Some(&np.dir)
            }
            _ => None,
        };
        if let Some(dir) = target {
            finish_pending(&g, &mut pending, &mut summary, &pb, rank0, progress.as_ref())?;
            let info = SaveInfo {
                iteration,
                consumed_samples: consumed,
                consumed_valid_samples: consumed_valid,
                floating_point_operations: flops_at(consumed),
                settings: s,
                vocab_size: model.config.vocab_size,
                buffers: expert_bias
                    .iter()
                    .flat_map(|(b, _)| b.layers())
                    .map(|b| (b.name.clone(), b.values()))
                    .chain(
                        fp8_metas
                            .iter()
                            .map(|m| crate::fp8_state::buffers(m, &table))
                            .collect::<anyhow::Result<Vec<_>>>()?
                            .into_iter()
                            .flatten(),
                    )
                    .collect(),
            };
            let mode = checkpoint::SaveMode { background: paths.async_save, params_only: paths.no_save_optim };
            pending = Some(checkpoint::start_save(dir, &g, &table, &opt, &info, mode)?);
            if let Some(p) = progress.as_ref().filter(|p| p.background) {
                p.log.saved(iteration, info.floating_point_operations, consumed * p.seq_length, false)?;
            }
            if !paths.async_save {
                finish_pending(&g, &mut pending, &mut summary, &pb, rank0, progress.as_ref())?;
            }
        }
        if let Some(why) = exit {
            finish_pending(&g, &mut pending, &mut summary, &pb, rank0, progress.as_ref())?;
            read_queued(&mut queued, &mut summary)?;
            if rank0 {
                pb.suspend(|| eprintln!("exiting at iteration {iteration} ({why})"));
            }
            break;
        }
        if window.1 == 0 {
            // A window of training steps starts after this iteration's logging, eval and save.
            window.0 = Instant::now();
        }
    }
    finish_pending(&g, &mut pending, &mut summary, &pb, rank0, progress.as_ref())?;
    read_queued(&mut queued, &mut summary)?;
    pb.finish_and_clear();
    summary.graphed_steps = graph.map_or(0, |g| g.launches());
    Ok(summary)
}

/// A SIGTERM handler, removed when the run ends (however it ends).
struct SigTerm(signal_hook::SigId);

impl Drop for SigTerm {
    fn drop(&mut self) {
        signal_hook::low_level::unregister(self.0);
    }
}

/// --log-progress on rank 0: the log, and what its lines take beyond a save's position.
struct Progress {
    log: ProgressLog,
    /// --async-save: a save's line when it is handed over, another when it is committed.
    background: bool,
    seq_length: u64,
}

/// Completes the save in `pending`, if any (collective: every rank has the same one pending),
/// and logs it to progress.txt (`progress`, rank 0 under --log-progress).
fn finish_pending(
    g: &ProcessGroups,
    pending: &mut Option<checkpoint::PendingSave>,
    summary: &mut Summary,
    pb: &ProgressBar,
    rank0: bool,
    progress: Option<&Progress>,
) -> anyhow::Result<()> {
    let Some(p) = pending.take() else { return Ok(()) };
    let (iteration, consumed, flops) = p.position();
    let d = checkpoint::finish_save(g, p)?;
    if rank0 {
        pb.suspend(|| eprintln!("saved {}", d.display()));
    }
    match progress {
        Some(p) if p.background => p.log.committed(iteration)?,
        Some(p) => p.log.saved(iteration, flops, consumed * p.seq_length, true)?,
        None => {}
    }
    summary.checkpoints.push(d);
    Ok(())
}

/// Reads the queued steps back in order (collective: every rank reads the same steps), records
/// their losses, and returns the last one's output.
/// `--profile-trace`: waits for the range's steps to finish on the GPU (a synchronisation the
/// steps after the range pay once), stops the GPU trace and writes it.
fn finish_trace(
    dev: &Device,
    path: &std::path::Path,
    rank: usize,
    p: &crate::settings::ProfileRange,
    pb: &ProgressBar,
) -> anyhow::Result<()> {
    dev.synchronize().context("--profile-trace: waiting for the traced steps")?;
    let trace = ferrotron_core::gpu_trace::stop().context("--profile-trace: stopping the GPU trace")?;
    let path = crate::trace::rank_path(path, rank);
    let steps = crate::trace::TraceSteps { first: p.start + 1, last: p.end };
    crate::trace::write_chrome_trace(&path, &trace, steps)?;
    let dropped = if trace.dropped > 0 { format!(" ({} dropped)", trace.dropped) } else { String::new() };
    pb.suspend(|| {
        eprintln!(
            "GPU trace of steps {}-{}: {} kernels, copies and memsets{dropped} in {}",
            steps.first,
            steps.last,
            trace.activities.len(),
            path.display()
        )
    });
    Ok(())
}

fn read_queued(
    queued: &mut Vec<(u64, QueuedStep)>,
    summary: &mut Summary,
) -> anyhow::Result<Option<ferrotron_optim::StepOutput>> {
    let mut last = None;
    for (iteration, step) in queued.drain(..) {
        let out = step.read()?;
        summary.losses.push((iteration, out.loss));
        summary.grad_norms.push((iteration, out.grad_norm));
        if !out.mtp_losses.is_empty() {
            summary.mtp_losses.push((iteration, out.mtp_losses.clone()));
        }
        if !out.applied {
            summary.skipped.push(iteration);
        }
        last = Some(out);
    }
    Ok(last)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_with_an_id_past_the_vocabulary_is_refused_before_upload() {
        let seqs = Arc::new(Sequences::from_documents(&[vec![1, 2, 3, 4, 9, 5, 6, 7, 8]]));
        let split = blend_split("train", vec![(None, seqs, 0..1)], 2, 4, 1234, None).unwrap();
        // Both samples (tokens 0..=4 and 4..=8, in some order) hold 9.
        let spec = |vocab| BatchSpec {
            seq: 4,
            vocab,
            eod_mask: None,
            eod: 0,
            cp: None,
            mtp_depths: 0,
            reset_positions: false,
            reset_attention: false,
            vision: None,
        };
        let ok = batch(&split, &[0, 1], &spec(10), &Device::Cpu).unwrap();
        let (mut t, mut l) = (ok.tokens.to_vec::<u32>().unwrap(), ok.labels.to_vec::<u32>().unwrap());
        if t[0] != 1 {
            t.rotate_left(4);
            l.rotate_left(4);
        }
        assert_eq!(t, [1, 2, 3, 4, 9, 5, 6, 7]);
        assert_eq!(l, [2, 3, 4, 9, 5, 6, 7, 8]);
        let e = batch(&split, &[1], &spec(9), &Device::Cpu).unwrap_err().to_string();
        assert!(e.contains("token id 9 in sample 1") && e.contains("vocabulary size 9"), "{e}");
        assert_eq!(ok.num_tokens(), 8.0, "no --eod-mask-loss: every position counts");
    }

    #[test]
    fn eod_mask_loss_drops_the_positions_whose_input_ends_a_document() {
        // Documents 1 2 0 | 3 0 | 4 5 6 0 (0: the end of document); one sample of all 10 tokens.
        let docs = [vec![1, 2, 0], vec![3, 0], vec![4, 5, 6, 0]];
        let seqs = Arc::new(Sequences::from_documents(&docs));
        let split = blend_split("train", vec![(None, seqs, 0..3)], 1, 8, 1234, None).unwrap();
        let spec = BatchSpec {
            seq: 8,
            vocab: 10,
            eod_mask: Some(0),
            eod: 0,
            cp: None,
            mtp_depths: 0,
            reset_positions: false,
            reset_attention: false,
            vision: None,
        };
        let b = batch(&split, &[0], &spec, &Device::Cpu).unwrap();
        let tokens = b.tokens.to_vec::<u32>().unwrap();
        let want: Vec<f32> = tokens.iter().map(|&t| if t == 0 { 0.0 } else { 1.0 }).collect();
        assert!(want.contains(&0.0), "the sample holds an end of document: {tokens:?}");
        assert_eq!(b.loss_mask.to_vec_f32().unwrap(), want);
        assert_eq!(b.num_tokens(), want.iter().sum::<f32>() as f64);
        assert!(b.docs().is_none(), "no --reset-attention-mask: no document masks");
        // --reset-attention-mask: each position's document start goes with the batch.
        let with_docs =
            batch(&split, &[0], &BatchSpec { reset_attention: true, ..spec.clone() }, &Device::Cpu).unwrap();
        let starts = with_docs.docs().expect("document starts").to_vec::<u32>().unwrap();
        assert_eq!(starts, ferrotron_data::document_starts(&tokens, 8, 0));
        assert!(starts.iter().any(|&s| s > 0), "a document starts inside the sample: {tokens:?}");
        // Context parallel rank 1 of 2: chunks 1 and 2 of four (positions 2..6), its mask's part,
        // and half the whole sample's count as the mean's denominator.
        let world = thread_world(2, std::time::Duration::from_secs(5));
        let cp = BatchSpec { cp: Some(ContextParallel::new(world[1].clone())), ..spec };
        let part = batch(&split, &[0], &cp, &Device::Cpu).unwrap();
        assert_eq!(part.tokens.to_vec::<u32>().unwrap(), tokens[2..6]);
        assert_eq!(part.loss_mask.to_vec_f32().unwrap(), want[2..6]);
        assert_eq!(part.num_tokens(), want.iter().sum::<f32>() as f64 / 2.0);
    }
}
