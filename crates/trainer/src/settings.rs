//! Training settings: Megatron's flag names, a TOML file with the same keys, and a preset, merged as
//! preset < file < flags, then checked. Errors name the flag and the fix.

use crate::batch_schedule::BatchSchedule;
use anyhow::{Context, bail};
use ferrotron_core::{AmaxAlgo, DelayedScaling};
use ferrotron_data::{TokenizerFlags, TokenizerKind};
use ferrotron_models::{VOCAB_DIVISIBLE_BY, preset};
use ferrotron_moe::{Capacity, DropPolicy, Groups, LoadBalancing, MoeSpec, RouterSpec, Score};
use ferrotron_optim::{DecayStyle, WdSchedule, WdStyle};
use ferrotron_transformer::mla::MlaSpec;
use ferrotron_transformer::spec::{
    Activation, AttentionSpec, GluParams, LayerKind, LayerSpec, MlpSpec, NormKind, OtherMlp, PositionEmbedding,
    RopeScaling, SoftmaxType,
};
use ferrotron_transformer::{MtpSpec, TransformerConfig};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Every setting, optional so that layers can be merged. Field names are Megatron's flags with
/// underscores; the TOML file uses the flag spelling (dashes).
#[derive(clap::Args, Clone, Debug, Default, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct TrainArgs {
    /// Model preset: tiny, small, 124m, 1.3b, 6.7b, llama-tiny, llama-1b, mixtral-tiny, deepseek-v3-tiny, mamba-tiny,
    /// llava-tiny.
    #[arg(long)]
    pub preset: Option<String>,
    /// TOML file with the same keys as these flags; flags override it.
    #[arg(long)]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    #[arg(long)]
    pub num_layers: Option<usize>,
    #[arg(long)]
    pub hidden_size: Option<usize>,
    #[arg(long)]
    pub num_attention_heads: Option<usize>,
    #[arg(long)]
    pub num_query_groups: Option<usize>,
    /// Width of a head (default --hidden-size / --num-attention-heads).
    #[arg(long)]
    pub kv_channels: Option<usize>,
    #[arg(long)]
    pub ffn_hidden_size: Option<usize>,
    #[arg(long)]
    pub seq_length: Option<usize>,
    #[arg(long)]
    pub max_position_embeddings: Option<usize>,
    /// learned_absolute, rope or none.
    #[arg(long)]
    pub position_embedding_type: Option<String>,
    #[arg(long)]
    pub rotary_base: Option<f64>,
    /// Llama 3.x's RoPE frequency scaling (low 1, high 4, original context 8192), by
    /// --rope-scaling-factor.
    #[arg(long)]
    pub use_rope_scaling: bool,
    /// With --use-rope-scaling: the factor low frequencies are divided by (default 8; Llama 3.2: 32).
    #[arg(long)]
    pub rope_scaling_factor: Option<f64>,
    /// LayerNorm or RMSNorm.
    #[arg(long)]
    pub normalization: Option<String>,
    #[arg(long)]
    pub swiglu: bool,
    /// Squared ReLU, max(x, 0)², in the MLPs (Nemotron-H's); GeLU without it or --swiglu.
    #[arg(long)]
    pub squared_relu: bool,
    /// gpt-oss's gated quick GeLU in the MLPs: qgelu(gate)·(linear + --glu-linear-offset), both
    /// halves clamped by --activation-func-clamp-value where given; qgelu(z) = z·σ(1.702·z).
    #[arg(long)]
    pub quick_geglu: bool,
    /// Added to the linear half of --quick-geglu's gated unit (gpt-oss: 1.0).
    #[arg(long, allow_hyphen_values = true)]
    pub glu_linear_offset: Option<f64>,
    /// --quick-geglu's inputs clamped: the gate to at most C, the linear half to [−C, C] (gpt-oss: 7.0).
    #[arg(long)]
    pub activation_func_clamp_value: Option<f64>,
    #[arg(long)]
    pub untie_embeddings_and_output_weights: bool,
    #[arg(long)]
    pub disable_bias_linear: bool,
    /// A bias on the QKV projection even with --disable-bias-linear (Qwen2's attention).
    #[arg(long)]
    pub add_qkv_bias: bool,
    #[arg(long)]
    pub qk_layernorm: bool,
    /// Llama 4's parameter-free L2 norm over each query and key head (instead of --qk-layernorm).
    #[arg(long)]
    pub qk_l2_norm: bool,
    /// A sigmoid gate on each attention head's output, projected beside the queries (Qwen3-Next's
    /// gated attention): the QKV projection grows by one head's width per query head.
    #[arg(long)]
    pub attention_output_gate: bool,
    /// The attention softmax: vanilla (default), off-by-one (one more logit 0 in every row, a
    /// key with no value) or learnable (that logit learned per head: gpt-oss's attention sinks,
    /// `core_attention.softmax_offset`).
    #[arg(long)]
    pub softmax_type: Option<String>,
    /// Zero-centred norm weights: every norm (LayerNorm or RMSNorm, QK-norm and the final one
    /// too) scales by 1 + w, w initialised to 0 and the 1 added in f32 inside the kernels.
    #[arg(long)]
    pub apply_layernorm_1p: bool,
    /// Multi-latent attention (DeepSeek-V2/V3's): queries and keys/values through low-rank
    /// latents, a rotary part whose key all heads share. Sized by the five flags below.
    #[arg(long)]
    pub multi_latent_attention: bool,
    /// MLA: the query's latent width (default: none, queries straight from the hidden state).
    #[arg(long)]
    pub q_lora_rank: Option<usize>,
    /// MLA: the keys' and values' latent width (default 32).
    #[arg(long)]
    pub kv_lora_rank: Option<usize>,
    /// MLA: a head's width without position (default 128).
    #[arg(long)]
    pub qk_head_dim: Option<usize>,
    /// MLA: a head's rotary width, its key shared by the heads (default 64).
    #[arg(long)]
    pub qk_pos_emb_head_dim: Option<usize>,
    /// MLA: a value head's width (default 128).
    #[arg(long)]
    pub v_head_dim: Option<usize>,
    /// rope or yarn (Megatron's: multi-latent attention's default is yarn, other attention's
    /// rope). YaRN is built for multi-latent attention's rotary part.
    #[arg(long)]
    pub rope_type: Option<String>,
    /// YaRN's scaling factor (default 1: plain RoPE), at Megatron's original context 4096 and
    /// betas 32 and 1.
    #[arg(long)]
    pub rotary_scaling_factor: Option<f64>,
    /// YaRN's mscale: cos and sin scaled by 0.1·mscale·ln(factor) + 1 over the same with
    /// --mscale-all-dim (default 1).
    #[arg(long)]
    pub mscale: Option<f64>,
    /// YaRN's mscale_all_dim (default 0): the softmax scaled by (0.1·mscale_all_dim·ln(factor) + 1)².
    #[arg(long)]
    pub mscale_all_dim: Option<f64>,
    /// YaRN's correction range: the pairs turning --yarn-beta-fast (default 32) and
    /// --yarn-beta-slow (default 1) times over --yarn-original-max-position-embeddings (default
    /// 4096) bound the ramp from extrapolated to interpolated frequencies.
    #[arg(long)]
    pub yarn_beta_fast: Option<f64>,
    #[arg(long)]
    pub yarn_beta_slow: Option<f64>,
    #[arg(long)]
    pub yarn_original_max_position_embeddings: Option<f64>,
    /// The correction range's ends floored and ceiled (Megatron's and transformers' default):
    /// accepted; --no-yarn-correction-range-round-to-int is refused by name.
    #[arg(long)]
    pub yarn_correction_range_round_to_int: bool,
    #[arg(long)]
    pub no_yarn_correction_range_round_to_int: bool,
    /// The norms' ε (default 1e-5).
    #[arg(long)]
    pub norm_epsilon: Option<f64>,
    /// The embedding and output layer padded to a multiple of this × the tensor-parallel size
    /// (default 128).
    #[arg(long)]
    pub make_vocab_size_divisible_by: Option<usize>,
    /// Dropout rate on each layer's attention and MLP outputs before their residual adds and on
    /// the embedding's output, in training (default 0: none; Megatron's default is 0.1, GPT-2
    /// recipes use it, Llama's 0).
    #[arg(long)]
    pub hidden_dropout: Option<f64>,
    /// Dropout rate on the attention probabilities after the softmax, in training (default 0;
    /// Megatron's is 0.1). On the CPU and the GPU alike (the same mask).
    #[arg(long)]
    pub attention_dropout: Option<f64>,
    /// Sliding-window attention as Megatron's (left, right), e.g. "(4096,0)": each token sees
    /// itself and the `left` tokens before it (-1: all of them). The GPT is causal, so right is 0.
    #[arg(long, allow_hyphen_values = true)]
    pub window_size: Option<String>,
    /// The layers --window-size's window applies in, as Megatron's: an integer N (every Nth layer,
    /// counting from 1, attends to the whole context: N − 1 windowed layers to one full), or a
    /// Python list expression of 1s (windowed) and 0s (full), one a layer, e.g. "[1,1,1,0]*3".
    #[arg(long)]
    pub window_attn_skip_freq: Option<String>,
    /// Accepted for Megatron's scripts: --num-query-groups takes effect with or without it.
    #[arg(long)]
    pub group_query_attention: bool,
    /// Accepted for Megatron's scripts: flash attention runs wherever its kernels apply.
    #[arg(long)]
    pub use_flash_attn: bool,
    /// byte, gpt2 (GPT2BPETokenizer), NullTokenizer (data tokenized elsewhere: --vocab-size),
    /// HuggingFaceTokenizer (--tokenizer-model) or TikTokenizer (--tokenizer-model FILE.json,
    /// --tiktoken-pattern).
    #[arg(long)]
    pub tokenizer_type: Option<String>,
    /// NullTokenizer's vocabulary: ids below N, end-of-document N (Megatron's flag); TikTokenizer's
    /// whole vocabulary, special tokens included (default 131072).
    #[arg(long)]
    pub vocab_size: Option<usize>,
    /// HuggingFaceTokenizer's transformers tokenizer folder (tokenizer.json and
    /// tokenizer_config.json, whose eos_token ends each document); TikTokenizer's JSON file.
    #[arg(long)]
    pub tokenizer_model: Option<PathBuf>,
    /// TikTokenizer's split pattern: v1 or v2, Megatron's two (no default).
    #[arg(long)]
    pub tiktoken_pattern: Option<String>,
    /// TikTokenizer's special tokens before the file's ranks (default 1000).
    #[arg(long)]
    pub tiktoken_num_special_tokens: Option<usize>,
    /// TikTokenizer's named special tokens in id order (default <unk> <s> </s>; those three
    /// must be among them; </s> ends each document).
    #[arg(long, num_args = 1..)]
    pub tiktoken_special_tokens: Option<Vec<String>>,
    /// GPT2BPETokenizer's vocab.json, as Megatron's scripts pass it: checked to be GPT-2's (the
    /// tokenizer is built in).
    #[arg(long)]
    pub vocab_file: Option<PathBuf>,
    /// GPT2BPETokenizer's merges.txt: checked to be GPT-2's.
    #[arg(long)]
    pub merge_file: Option<PathBuf>,
    #[arg(long)]
    pub init_method_std: Option<f32>,
    /// The word and learned position embeddings' init std (default --init-method-std).
    #[arg(long)]
    pub embedding_init_method_std: Option<f32>,
    /// Accepted, no effect: parameters are always initialised on the host, then copied.
    #[arg(long)]
    pub use_cpu_initialization: bool,
    /// Accepted, no effect, as in Megatron Core, whose layers read it nowhere (legacy Megatron's
    /// residual from after the layer norm); a warning says so.
    #[arg(long)]
    pub apply_residual_connection_post_layernorm: bool,
    #[arg(long)]
    pub micro_batch_size: Option<usize>,
    #[arg(long)]
    pub global_batch_size: Option<usize>,
    #[arg(long)]
    pub train_iters: Option<u64>,
    /// The run's length in samples instead of --train-iters (iterations: this over the global
    /// batch); its schedule then in samples too: --lr-warmup-samples, --lr-decay-samples.
    #[arg(long)]
    pub train_samples: Option<u64>,
    /// With --train-samples: the warm-up in samples.
    #[arg(long)]
    pub lr_warmup_samples: Option<u64>,
    /// With --train-samples: samples the learning rate decays over (default --train-samples).
    #[arg(long)]
    pub lr_decay_samples: Option<u64>,
    #[arg(long)]
    pub lr: Option<f64>,
    /// What the decay ends at (Megatron's default 0 where --lr is given without it; a preset's
    /// own otherwise).
    #[arg(long)]
    pub min_lr: Option<f64>,
    /// The warmup's starting learning rate (default 0: the first update, as Megatron's, at 0).
    #[arg(long)]
    pub lr_warmup_init: Option<f64>,
    /// A learning rate of its own for the word embedding and output layer, on the same warmup
    /// and decay as --lr (Megatron's decoupled parameter group).
    #[arg(long)]
    pub decoupled_lr: Option<f64>,
    /// What --decoupled-lr decays to (default --min-lr).
    #[arg(long)]
    pub decoupled_min_lr: Option<f64>,
    /// constant, linear, cosine, inverse-square-root or WSD.
    #[arg(long)]
    pub lr_decay_style: Option<String>,
    /// WSD's final fall: exponential (default), linear, cosine or minus_sqrt.
    #[arg(long)]
    pub lr_wsd_decay_style: Option<String>,
    /// WSD: iterations of the final fall (the end of the decay).
    #[arg(long)]
    pub lr_wsd_decay_iters: Option<u64>,
    /// WSD with --train-samples: samples of the final fall.
    #[arg(long)]
    pub lr_wsd_decay_samples: Option<u64>,
    #[arg(long)]
    pub lr_warmup_iters: Option<u64>,
    /// Warm-up as a fraction of the decay iterations (instead of --lr-warmup-iters).
    #[arg(long)]
    pub lr_warmup_fraction: Option<f64>,
    /// Iterations the learning rate decays over (default --train-iters); min-lr after.
    #[arg(long)]
    pub lr_decay_iters: Option<u64>,
    #[arg(long)]
    pub weight_decay: Option<f32>,
    /// Weight decay at the start and end of the run, with --weight-decay-incr-style linear or
    /// cosine (constant, the default, keeps --weight-decay throughout).
    #[arg(long)]
    pub start_weight_decay: Option<f32>,
    #[arg(long)]
    pub end_weight_decay: Option<f32>,
    /// constant, linear or cosine: how weight decay moves from its start to its end over the run.
    #[arg(long)]
    pub weight_decay_incr_style: Option<String>,
    #[arg(long)]
    pub adam_beta1: Option<f32>,
    #[arg(long)]
    pub adam_beta2: Option<f32>,
    /// Adam's ε (default 1e-8).
    #[arg(long)]
    pub adam_eps: Option<f32>,
    #[arg(long)]
    pub clip_grad: Option<f32>,
    #[arg(long)]
    pub seed: Option<u64>,
    #[arg(long)]
    pub log_interval: Option<u64>,
    #[arg(long)]
    pub eval_interval: Option<u64>,
    #[arg(long)]
    pub eval_iters: Option<u64>,
    /// Folder for checkpoints (and metrics.jsonl).
    #[arg(long)]
    pub save: Option<PathBuf>,
    /// Folder to resume from (a --save folder). As in Megatron, a folder that holds no
    /// checkpoint yet (or does not exist) starts the run from its initialisation with a warning,
    /// so one command with `--save D --load D` both starts and resumes a run.
    #[arg(long)]
    pub load: Option<PathBuf>,
    /// With --load: stop with an error instead of starting afresh when --load holds no
    /// checkpoint (a mistyped path, say).
    #[arg(long)]
    pub exit_on_missing_checkpoint: bool,
    /// With --load: the checkpoint of this iteration instead of the latest one (Megatron's
    /// --ckpt-step).
    #[arg(long)]
    #[serde(skip)]
    pub ckpt_step: Option<u64>,
    /// With --load: take the parameters only, and start at iteration 0 with a fresh optimizer
    /// and the data from its start.
    #[arg(long)]
    pub finetune: bool,
    /// With --load: take the parameters and the iteration, with a fresh optimizer.
    #[arg(long)]
    pub no_load_optim: bool,
    /// With --load: the model's flags and tokenizer from the checkpoint, where not given here
    /// (Megatron's flag), e.g. for a checkpoint `ferrotron convert` made from Hugging Face.
    #[arg(long)]
    pub use_checkpoint_args: bool,
    /// Where the JSONL metrics go (default: metrics.jsonl in the --save folder); benchmarks use
    /// it to measure without writing checkpoints.
    #[arg(long)]
    pub metrics_file: Option<PathBuf>,
    /// Megatron's --tensorboard-dir: TensorBoard event files of the logged scalars under
    /// Megatron's tags (lm loss, learning-rate, grad-norm, batch-size and their "vs samples"
    /// twins, lm loss validation, the MoE routers' losses), at each --log-interval iteration.
    #[arg(long)]
    pub tensorboard_dir: Option<PathBuf>,
    /// Of the logged iterations, those that are multiples of N go to TensorBoard (default 1).
    #[arg(long)]
    pub tensorboard_log_interval: Option<usize>,
    /// Accepted for Megatron's scripts: events are written as they come, flushed at each log line.
    #[arg(long)]
    pub tensorboard_queue_size: Option<usize>,
    /// Also "lm loss validation ppl" (exp of the loss, capped at e^20 as Megatron's).
    #[arg(long)]
    pub log_validation_ppl_to_tensorboard: bool,
    /// Also "iteration-time": seconds an iteration over the log window.
    #[arg(long)]
    pub log_timers_to_tensorboard: bool,
    /// Also "world-size" (the number of ranks).
    #[arg(long)]
    pub log_world_size_to_tensorboard: bool,
    /// Also the GPU's memory pool (allocated and reserved bytes, the allocated high) on each log
    /// line of metrics.jsonl and in TensorBoard (Megatron's mem-* tags); nothing on the CPU.
    #[arg(long)]
    pub log_memory_to_tensorboard: bool,
    /// Also how many of the (synchronised) gradients are zero, on each log line and in
    /// TensorBoard ("num-zeros"): counted at log intervals only, each parameter once.
    #[arg(long)]
    pub log_num_zeros_in_grad: bool,
    #[arg(long)]
    pub save_interval: Option<u64>,
    /// Write checkpoints in the background (Megatron's --async-save): a save copies this rank's
    /// parts to the host and training goes on while a thread writes them; the checkpoint becomes
    /// the latest once every rank's file is written (checked at log intervals, and before the
    /// next save and the end of the run).
    #[arg(long)]
    #[serde(skip)]
    pub async_save: bool,
    /// Append the run's progress to progress.txt in the --save folder (Megatron's
    /// --log-progress): each job's start and each checkpoint with its throughput, the model
    /// FLOPs and tokens so far.
    #[arg(long)]
    #[serde(skip)]
    pub log_progress: bool,
    /// Save the parameters without the optimizer state (Megatron's --no-save-optim): a quarter
    /// of the size; such a checkpoint loads with --finetune or --no-load-optim.
    #[arg(long)]
    #[serde(skip)]
    pub no_save_optim: bool,
    /// Megatron's batch-size ramp (its older flag): START INCREMENT SAMPLES — the global batch
    /// starts at START and grows by INCREMENT in equal shares of SAMPLES to
    /// --global-batch-size. Needs --train-samples.
    #[arg(long, num_args = 3, value_names = ["START", "INCREMENT", "SAMPLES"])]
    #[serde(default)]
    pub rampup_batch_size: Vec<u64>,
    /// Megatron's step-wise global batch (its newer flag): "THRESHOLD:SIZE …", thresholds in
    /// tokens consumed (K, M, B, T suffixes), the first 0, e.g. "0:256 10B:512". Instead of
    /// --global-batch-size (which evaluation then takes as micro-batch × data-parallel size, as
    /// Megatron's does); needs --train-samples.
    #[arg(long)]
    pub step_batch_size_schedule: Option<String>,
    /// Megatron's checkpoint format flag: `torch_dist` (its sharded format, whose part Ferrotron's
    /// sharded checkpoints play) is accepted; the others are refused by name.
    #[arg(long)]
    pub ckpt_format: Option<String>,
    /// bf16 parameters and activations with fp32 master weights and grads.
    #[arg(long)]
    pub bf16: bool,
    /// Stop at a step whose loss or gradient norm is not finite (Megatron's default; the update of
    /// such a step is skipped either way, so the parameters stay the last finite step's).
    #[arg(long)]
    pub check_for_nan_in_loss_and_grad: bool,
    /// Skip such steps' updates and go on, counting them in the log.
    #[arg(long)]
    pub no_check_for_nan_in_loss_and_grad: bool,
    /// fp16 with loss scaling is not implemented: refused with a pointer to --bf16 (accepted as a
    /// flag so Megatron's scripts get that answer rather than an unknown-argument one).
    #[arg(long)]
    pub fp16: bool,
    /// Documents of the built-in corpus to generate (without --data-path).
    #[arg(long)]
    pub corpus_docs: Option<usize>,
    /// Megatron indexed datasets to train on instead of the built-in corpus: PREFIX (for
    /// PREFIX.bin and PREFIX.idx), several prefixes (blended by their sizes), or weight-prefix
    /// pairs ("0.7 web 0.3 code"). The tokens must come from --tokenizer-type's tokenizer.
    #[arg(long, num_args = 1..)]
    pub data_path: Vec<String>,
    /// Instead of --data-path and --split: the datasets training reads, whole (same spellings).
    #[arg(long, num_args = 1..)]
    pub train_data_path: Vec<String>,
    /// With --train-data-path: the datasets validation reads, whole.
    #[arg(long, num_args = 1..)]
    pub valid_data_path: Vec<String>,
    /// A text file holding what --data-path would (prefixes, or weight-prefix pairs, separated
    /// by whitespace): for blends too long for a command line (Megatron's).
    #[arg(long)]
    pub data_args_path: Option<PathBuf>,
    /// A JSON file {"train": [...], "valid": [...], "test": [...]} holding what
    /// --train-data-path / --valid-data-path would (Megatron's; "test" is read and not used:
    /// no test evaluation runs).
    #[arg(long)]
    pub per_split_data_args_path: Option<PathBuf>,
    /// Leave out of the loss the positions whose input is the end-of-document id (Megatron's
    /// --eod-mask-loss), in training and validation.
    #[arg(long)]
    pub eod_mask_loss: bool,
    /// The gradient of the mean over every loss token of the global batch, rather than the mean
    /// of the micro-batches' means (Megatron's --calculate-per-token-loss; they differ where the
    /// micro-batches count different tokens: --eod-mask-loss).
    #[arg(long)]
    pub calculate_per_token_loss: bool,
    /// Megatron's mock data instead of a dataset: 100,000 sequences 1, 2, 3, … of lengths
    /// below 4096 drawn by numpy's default_rng(0), each ending in the end-of-document id, split
    /// 1,1,1 (as Megatron forces it). Samples equal a Megatron run's with --mock-data.
    #[arg(long)]
    pub mock_data: bool,
    /// A LLaVA run's image-text pairs: LLaVA-Pretrain's JSON (image paths and conversations, the
    /// `gpt` turns the text) or JSON lines of {"image", "text"}, images (JPEG, PNG) under
    /// --image-folder; or a webdataset tar shard, or a folder of them (KEY.jpg/.png with
    /// KEY.txt/.json, as Energon's captioning datasets hold them).
    #[arg(long)]
    pub image_text_data: Option<PathBuf>,
    /// The folder --image-text-data's image paths are relative to (default: the file's folder).
    #[arg(long)]
    pub image_folder: Option<PathBuf>,
    /// The indexed datasets' documents cut into train, valid and test by these weights, as
    /// Megatron's --split (default "969, 30, 1").
    #[arg(long)]
    pub split: Option<String>,
    /// A folder for the indexed datasets' sample indices (document, sample and shuffle index,
    /// as .npy files under Megatron's names): read from there when a run with the same data and
    /// settings wrote them, built and written there otherwise. Without it they are built in memory
    /// each run (Megatron then caches beside the dataset; Ferrotron writes nothing unasked)
    #[arg(long)]
    pub data_cache_path: Option<PathBuf>,
    /// Stop (saving first when --save is set) once the iteration is a multiple of this.
    #[arg(long)]
    #[serde(skip)]
    pub exit_interval: Option<u64>,
    /// Megatron's non-persistent checkpoints: every this many iterations (between the
    /// --save-interval ones) a checkpoint goes to --non-persistent-global-ckpt-dir (default
    /// SAVE/non_persistent), where only the newest is kept; --load takes it when it is at least as
    /// new as the persistent one.
    #[arg(long)]
    pub non_persistent_save_interval: Option<u64>,
    /// global (the one built); local and in_memory are refused by name.
    #[arg(long)]
    pub non_persistent_ckpt_type: Option<String>,
    #[arg(long)]
    pub non_persistent_global_ckpt_dir: Option<PathBuf>,
    /// Stop (saving first when --save is set) after the iteration that ends past this many
    /// minutes of training (Megatron's --exit-duration-in-mins).
    #[arg(long)]
    #[serde(skip)]
    pub exit_duration_in_mins: Option<u64>,
    /// On SIGTERM (a scheduler's preemption), save at the end of the iteration and stop
    /// (Megatron's --exit-signal-handler).
    #[arg(long)]
    #[serde(skip)]
    pub exit_signal_handler: bool,
    /// Hide the progress bar (log lines still go to stderr).
    #[arg(long)]
    #[serde(skip)]
    pub no_progress: bool,
    /// Same bits on every run on a GPU: the flash backward's dQ by its own kernel instead of sums
    /// in scheduling order (slower). CPU runs are always deterministic.
    #[arg(long)]
    #[serde(skip)]
    pub deterministic_mode: bool,
    /// bf16 products' split-K partial sums added in fp32 only (PyTorch's
    /// allow_bf16_reduced_precision_reduction off): cuBLASLt is offered no algorithm that adds
    /// them in bf16. Off, its heuristic's own first choice may.
    #[arg(long)]
    #[serde(skip)]
    pub disable_bf16_reduced_precision_matmul: bool,
    /// cpu, cuda or cuda:N (CUDA needs a build with `--features cuda`).
    #[arg(long)]
    #[serde(skip)]
    pub device: Option<String>,
    /// Open a CUDA profiler range (cudaProfilerStart/Stop) over steps profile-step-start + 1 to
    /// profile-step-end, for `ncu --profile-from-start off` or `nsys --capture-range=cudaProfilerApi`.
    #[arg(long)]
    #[serde(skip)]
    pub profile: bool,
    /// Steps done before the range opens (default 10).
    #[arg(long)]
    #[serde(skip)]
    pub profile_step_start: Option<u64>,
    /// Steps done when the range closes (default 12).
    #[arg(long)]
    #[serde(skip)]
    pub profile_step_end: Option<u64>,
    /// Global ranks that profile (default 0).
    #[arg(long, num_args = 1..)]
    #[serde(skip)]
    pub profile_ranks: Vec<usize>,
    /// With --profile: record the range's GPU timeline (every kernel, copy and memset, with the
    /// GPU's start and end times, through CUPTI) into this Chrome trace file (Perfetto,
    /// chrome://tracing; `cargo xtask trace` summarises it). A rank other than 0 writes
    /// FILE.rankN.
    #[arg(long)]
    #[serde(skip)]
    pub profile_trace: Option<PathBuf>,
    /// Megatron's CUDA graph implementation: none (default) or local (Ferrotron's own capture).
    #[arg(long)]
    #[serde(skip)]
    pub cuda_graph_impl: Option<String>,
    /// What the graph covers; full_iteration (the whole step: forward, backward, optimizer) is
    /// the scope Ferrotron captures.
    #[arg(long, num_args = 1..)]
    #[serde(skip)]
    pub cuda_graph_scope: Vec<String>,
    /// Eager steps before the step is captured (default 3, as Megatron; at least 1).
    #[arg(long)]
    #[serde(skip)]
    pub cuda_graph_warmup_steps: Option<usize>,
    /// Ranks as threads of this process (CPU); a launcher's WORLD_SIZE is the other way.
    #[arg(long)]
    #[serde(skip)]
    pub nproc: Option<usize>,
    #[arg(long)]
    pub tensor_model_parallel_size: Option<usize>,
    /// Split activations along the sequence outside the tensor-parallel regions.
    #[arg(long)]
    pub sequence_parallel: bool,
    /// Shard fp32 master weights and Adam state over data-parallel ranks.
    #[arg(long)]
    pub use_distributed_optimizer: bool,
    /// Reduce gradient buckets during the backward.
    #[arg(long)]
    pub overlap_grad_reduce: bool,
    /// Keep main_grad in bf16 instead of fp32 (with --bf16): weight gradients leave their GEMMs
    /// in bf16 and the data-parallel reduction and the optimizer read half the bytes. Gradients
    /// accumulated over micro-batches then add in bf16.
    #[arg(long)]
    pub grad_reduce_in_bf16: bool,
    /// Gather the distributed optimizer's parameter buckets during the next forward, each just
    /// ahead of the layers that use it.
    #[arg(long)]
    pub overlap_param_gather: bool,
    /// Elements per data-parallel gradient bucket (default max(40M, 1M × DP)).
    #[arg(long)]
    pub ddp_bucket_size: Option<usize>,
    /// Seconds a collective may wait for the other ranks.
    #[arg(long)]
    #[serde(skip)]
    pub distributed_timeout_s: Option<u64>,
    /// Megatron's name for the same wait, in minutes (default 10).
    #[arg(long)]
    #[serde(skip)]
    pub distributed_timeout_minutes: Option<u64>,
    #[arg(long)]
    pub pipeline_model_parallel_size: Option<usize>,
    /// Context parallelism: every sequence split over this many ranks (Megatron's load-balanced
    /// chunks; the attention all-gathers keys and values over them).
    #[arg(long)]
    pub context_parallel_size: Option<usize>,
    /// How context-parallel attention communicates: allgather, p2p (Megatron's default; run as
    /// allgather, the same attention) or a2a (all-to-all over the heads); one for every layer or
    /// one a layer. a2a+p2p is refused by name.
    #[arg(long, num_args = 1..)]
    pub cp_comm_type: Option<Vec<String>>,
    /// Refused by name: the inner (all-to-all) and outer (p2p) group sizes of --cp-comm-type
    /// a2a+p2p, which is not built.
    #[arg(long, num_args = 1..)]
    pub hierarchical_context_parallel_sizes: Vec<usize>,
    /// Layers per virtual stage: interleaved 1F1B with num-layers / (pp × this) chunks per rank.
    #[arg(long)]
    pub num_layers_per_virtual_pipeline_stage: Option<usize>,
    #[arg(long)]
    pub decoder_first_pipeline_num_layers: Option<usize>,
    #[arg(long)]
    pub decoder_last_pipeline_num_layers: Option<usize>,
    /// full or selective.
    #[arg(long)]
    pub recompute_granularity: Option<String>,
    /// uniform or block (with full).
    #[arg(long)]
    pub recompute_method: Option<String>,
    #[arg(long)]
    pub recompute_num_layers: Option<usize>,
    /// Mixture of experts: every layer's MLP is this many experts behind a top-k router
    /// (Megatron's --num-experts; none: dense).
    #[arg(long)]
    pub num_experts: Option<usize>,
    /// Each expert's hidden width (default --ffn-hidden-size).
    #[arg(long)]
    pub moe_ffn_hidden_size: Option<usize>,
    /// Experts per token (default 2).
    #[arg(long)]
    pub moe_router_topk: Option<usize>,
    /// aux_loss (default: GShard's load-balancing loss over the micro-batch, weighted by
    /// --moe-aux-loss-coeff), seq_aux_loss (DeepSeek's: the same per sequence, averaged),
    /// global_aux_loss (the counts of the global batch: summed over data-parallel ranks and
    /// averaged over the step's micro-batches) or none.
    #[arg(long)]
    pub moe_router_load_balancing_type: Option<String>,
    /// The load-balancing loss's weight (default 0; 1e-2 is usual).
    #[arg(long)]
    pub moe_aux_loss_coeff: Option<f64>,
    /// The router z-loss's weight (default none; 1e-3 is usual).
    #[arg(long)]
    pub moe_z_loss_coeff: Option<f64>,
    /// Softmax over all experts before the top-k (the weights then not renormalised).
    #[arg(long)]
    pub moe_router_pre_softmax: bool,
    /// Multiplies the router's top-k weights.
    #[arg(long)]
    pub moe_router_topk_scaling_factor: Option<f64>,
    /// softmax (default), sigmoid (DeepSeek-V3: σ per expert, the chosen k renormalised) or
    /// sqrtsoftplus.
    #[arg(long)]
    pub moe_router_score_function: Option<String>,
    /// Group-limited routing: the experts in this many equal groups, a token's experts taken
    /// from its --moe-router-group-topk best groups (each scored by its top-k / group-top-k best).
    #[arg(long)]
    pub moe_router_num_groups: Option<usize>,
    #[arg(long)]
    pub moe_router_group_topk: Option<usize>,
    /// Aux-loss-free balancing (DeepSeek-V3): a per-expert bias on the choice, moved by
    /// --moe-router-bias-update-rate (default 1e-3) against each expert's load after every step.
    /// Needs --moe-router-score-function sigmoid.
    #[arg(long)]
    pub moe_router_enable_expert_bias: bool,
    #[arg(long)]
    pub moe_router_bias_update_rate: Option<f64>,
    /// fp32: the router's product and logits in fp32 under --bf16 (DeepSeek-V3's recipes).
    #[arg(long)]
    pub moe_router_dtype: Option<String>,
    /// Expert-parallel size: the experts split over this many data-parallel ranks (all-to-all
    /// dispatch).
    #[arg(long)]
    pub expert_model_parallel_size: Option<usize>,
    /// Megatron's expert tensor-parallel size: accepted where it equals
    /// --tensor-model-parallel-size (every expert split as a dense MLP is: its default).
    #[arg(long)]
    pub expert_tensor_parallel_size: Option<usize>,
    /// allgather (default) or alltoall: the same result on one expert-parallel rank.
    #[arg(long)]
    pub moe_token_dispatcher_type: Option<String>,
    /// Accepted for Megatron's scripts: the experts' products run one per expert.
    #[arg(long)]
    pub moe_grouped_gemm: bool,
    /// Which layers are MoE layers, the others dense (--ffn-hidden-size): N (one in N, from
    /// layer 0) or a list such as "([0]+[1]*23)" (default 1: all).
    #[arg(long)]
    pub moe_layer_freq: Option<String>,
    /// Shared experts: a dense MLP of this width beside the routed ones, run by every token.
    #[arg(long)]
    pub moe_shared_expert_intermediate_size: Option<usize>,
    /// Accepted for Megatron's scripts: the shared experts run in the same stream.
    #[arg(long)]
    pub moe_shared_expert_overlap: bool,
    /// A sigmoid gate on the shared experts' output, σ(x · gate_weightᵀ) per token (Qwen-MoE's).
    #[arg(long)]
    pub moe_shared_expert_gate: bool,
    /// Token dropping: each expert takes at most ⌈copies / experts · factor⌉ of a micro-batch's
    /// token copies on its rank, the rest skip it (default: none, dropless; a negative factor is
    /// none too, as in Megatron). Needs --moe-token-dispatcher-type alltoall.
    #[arg(long, allow_hyphen_values = true)]
    pub moe_expert_capacity_factor: Option<f64>,
    /// Which copies an expert over capacity keeps: probs (the largest weights, default) or
    /// position (the earliest tokens).
    #[arg(long)]
    pub moe_token_drop_policy: Option<String>,
    /// Pads each expert's input to its capacity (Megatron's static shapes): accepted, the same run
    /// (padded rows carry no weight, so none is padded here); needs the capacity factor, refused
    /// with the expert bias (whose counts padding would flatten).
    #[arg(long)]
    pub moe_pad_expert_input_to_capacity: bool,
    /// Multi-token prediction (DeepSeek-V3's MTP): this many depths after the decoder, depth k
    /// predicting the token k + 1 places ahead (default: none; 0 is none too).
    #[arg(long)]
    pub mtp_num_layers: Option<usize>,
    /// The MTP losses' weight against the language-model loss, shared by the depths (default
    /// 0.1, Megatron's).
    #[arg(long)]
    pub mtp_loss_scaling_factor: Option<f64>,
    /// A Mamba hybrid: one character per layer, M (Mamba-2 mixer), * (attention), - (MLP), E
    /// (mixture-of-experts MLP), | between pipeline stages, e.g. M-M*-; it sets --num-layers.
    #[arg(long)]
    pub hybrid_layer_pattern: Option<String>,
    /// The same, by its earlier (deprecated) name.
    #[arg(long)]
    pub hybrid_override_pattern: Option<String>,
    /// State channels per group (default 128).
    #[arg(long)]
    pub mamba_state_dim: Option<usize>,
    /// Channels per Mamba head (default 64).
    #[arg(long)]
    pub mamba_head_dim: Option<usize>,
    /// Groups of heads sharing B and C (default 8).
    #[arg(long)]
    pub mamba_num_groups: Option<usize>,
    /// Mamba heads (default 2 · hidden / head dim).
    #[arg(long)]
    pub mamba_num_heads: Option<usize>,
    /// Accepted for Megatron's scripts: --hybrid-layer-pattern makes the hybrid.
    #[arg(long)]
    pub is_hybrid_model: bool,
    /// Megatron's --spec MODULE FUNCTION (a layer spec by Python path): its Mamba stack (all
    /// Mamba layers unless a pattern or ratios place others) and its two GPT layer specs
    /// (Transformer Engine's or the local one: the same layers here) are accepted; any other is
    /// refused by name.
    #[arg(long, num_args = 2, value_names = ["MODULE", "FUNCTION"])]
    #[serde(default)]
    pub spec: Vec<String>,
    /// The Mamba mixer's gated RMSNorm over its whole width, as transformers' Mamba2 computes it,
    /// instead of per group of heads (Megatron's and mamba_ssm's); set by `convert` from
    /// transformers.
    #[arg(long)]
    pub mamba_norm_ungrouped: bool,
    /// Megatron's deprecated allocation: this share of --num-layers attention layers spread evenly
    /// among Mamba ones (--hybrid-mlp-ratio: then that share MLP layers among the Mamba ones).
    #[arg(long)]
    pub hybrid_attention_ratio: Option<f64>,
    #[arg(long)]
    pub hybrid_mlp_ratio: Option<f64>,
    /// A LLaVA-style model: images of this height and width (pixels) through a CLIP vision
    /// encoder into the language model (with --img-w and --patch-dim).
    #[arg(long)]
    pub img_h: Option<usize>,
    #[arg(long)]
    pub img_w: Option<usize>,
    /// The vision encoder's square patch side in pixels.
    #[arg(long)]
    pub patch_dim: Option<usize>,
    /// The vision encoder's layers, width, heads and MLP width (default: the language model's).
    #[arg(long)]
    pub encoder_num_layers: Option<usize>,
    #[arg(long)]
    pub encoder_hidden_size: Option<usize>,
    #[arg(long)]
    pub encoder_num_attention_heads: Option<usize>,
    #[arg(long)]
    pub encoder_ffn_hidden_size: Option<usize>,
    /// Drop the vision encoder's class token from the image features.
    #[arg(long)]
    pub disable_vision_class_token: bool,
    /// The image placeholder token (default: one id past the tokenizer's vocabulary).
    #[arg(long)]
    pub image_token_id: Option<u32>,
    /// Train the vision encoder and projection only (Megatron's --freeze-LM).
    #[arg(long = "freeze-LM")]
    pub freeze_lm: bool,
    /// Leave the vision encoder as it is (Megatron's --freeze-ViT).
    #[arg(long = "freeze-ViT")]
    pub freeze_vit: bool,

    // Megatron's switches between implementations of the same computation (fusions, backends,
    // loaders): accepted where the run computes the same thing either way, a value that would
    // change it refused by name (`compat::apply`).
    /// Also the throughput per GPU (model TFLOP/s) on each log line and in TensorBoard.
    #[arg(long)]
    pub log_throughput: bool,
    /// MoE runs: each layer's router losses too (TensorBoard `moe/load_balancing_loss_layer_I`,
    /// `moe/z_loss_layer_I`, I over every layer, dense ones 0; metrics.jsonl `moe_layer_losses`).
    #[arg(long)]
    pub moe_per_layer_logging: bool,
    /// Also the L2 norm of the (fp32 master) parameters on each log line and in TensorBoard.
    #[arg(long)]
    pub log_params_norm: bool,
    /// Megatron's shorthand for --recompute-granularity selective.
    #[arg(long)]
    pub recompute_activations: bool,
    /// Megatron's switch off of learned positions: with rope nothing changes, otherwise the model
    /// has none (--position-embedding-type none).
    #[arg(long)]
    pub no_position_embedding: bool,
    /// nccl or gloo: accepted (ranks on a GPU talk NCCL, on the CPU their own transport).
    #[arg(long)]
    pub distributed_backend: Option<String>,
    /// transformer_engine or local: accepted (Ferrotron's kernels either way).
    #[arg(long)]
    pub transformer_impl: Option<String>,
    /// flash, fused, unfused, local or auto: accepted (the flash kernels where they apply).
    #[arg(long)]
    pub attention_backend: Option<String>,
    /// single (Megatron's pretraining sampler: the split's samples in turn) or cyclic (Megatron's
    /// random sampler: each epoch over the split in a fresh torch.randperm order); external is
    /// refused.
    #[arg(long)]
    pub dataloader_type: Option<String>,
    /// Under --dataloader-type cyclic: every data-parallel rank draws from the whole split rather
    /// than from its own bucket of it (Megatron's --no-data-sharding).
    #[arg(long)]
    pub no_data_sharding: bool,
    /// The share of each head that rotary embeddings rotate (default 1.0: whole heads; Megatron
    /// rotates the first ⌊head_dim · percent⌋ features, the rest pass).
    #[arg(long)]
    pub rotary_percent: Option<f64>,
    /// Only disabled is built.
    #[arg(long)]
    pub rerun_mode: Option<String>,
    /// Optimizer state dtypes (with --use-precision-aware-optimizer): AdamW's moments fp32 or
    /// bf16 (--exp-avg-dtype, --exp-avg-sq-dtype: half their memory, each widened for the update
    /// and stored rounded); main grads fp32 or bf16 (bf16 is --grad-reduce-in-bf16); master
    /// weights fp32.
    #[arg(long)]
    pub main_grads_dtype: Option<String>,
    #[arg(long)]
    pub main_params_dtype: Option<String>,
    #[arg(long)]
    pub exp_avg_dtype: Option<String>,
    #[arg(long)]
    pub exp_avg_sq_dtype: Option<String>,
    /// Accepted, no effect: data loading needs no worker processes here.
    #[arg(long)]
    pub num_workers: Option<usize>,
    /// Accepted, no effect (Python's garbage collector).
    #[arg(long)]
    pub manual_gc_interval: Option<usize>,
    /// Accepted, no effect: the log line carries the step's timing.
    #[arg(long)]
    pub timing_log_level: Option<usize>,
    /// Accepted, no effect: memory is pooled and reused, never emptied between steps.
    #[arg(long)]
    pub empty_unused_memory_level: Option<usize>,
    /// Accepted switches that change no result here: softmax is always fp32; fusions are
    /// where the kernels have them; gradients accumulate and reduce in fp32 (unless
    /// --grad-reduce-in-bf16); no attention mask is built; datasets are always memory-mapped;
    /// every rank saves and loads its own shard.
    #[arg(long)]
    pub use_mcore_models: bool,
    #[arg(long)]
    pub attention_softmax_in_fp32: bool,
    #[arg(long)]
    pub no_masked_softmax_fusion: bool,
    #[arg(long)]
    pub no_bias_gelu_fusion: bool,
    #[arg(long)]
    pub no_bias_swiglu_fusion: bool,
    #[arg(long)]
    pub no_bias_dropout_fusion: bool,
    #[arg(long)]
    pub no_rope_fusion: bool,
    #[arg(long)]
    pub no_gradient_accumulation_fusion: bool,
    #[arg(long)]
    pub cross_entropy_loss_fusion: bool,
    #[arg(long)]
    pub moe_permute_fusion: bool,
    /// The MoE scripts' dispatch and fusion switches (DeepEP / HybridEP transports, the fused
    /// router, TE's cross-entropy, delayed weight gradients, expert-parallel overlap, TE's RNG
    /// tracker): accepted, the experts' all-to-all and the math are the same either way.
    #[arg(long)]
    pub moe_enable_deepep: bool,
    #[arg(long)]
    pub moe_flex_dispatcher_backend: Option<String>,
    #[arg(long)]
    pub moe_flex_dispatcher_num_sms: Option<usize>,
    #[arg(long)]
    pub moe_router_fusion: bool,
    #[arg(long)]
    pub cross_entropy_fusion_impl: Option<String>,
    #[arg(long)]
    pub delay_wgrad_compute: bool,
    #[arg(long)]
    pub overlap_moe_expert_parallel_comm: bool,
    #[arg(long)]
    pub te_rng_tracker: bool,
    /// What selective recompute recomputes (Megatron's --recompute-modules): accepted; Ferrotron's
    /// selective recompute is the core attention's (`core_attn`), other modules are kept, which
    /// computes the same run with more memory.
    #[arg(long, num_args = 1..)]
    pub recompute_modules: Vec<String>,
    /// GeLU as its tanh approximation even where Megatron's MLP would take erf (without the fused
    /// bias-GeLU: `Settings::gelu_exact`).
    #[arg(long)]
    pub openai_gelu: bool,
    /// Pipelines' and data-parallel buckets' scheduling and padding, checkpoint and
    /// dataset-loading switches: accepted, the same run.
    #[arg(long)]
    pub no_overlap_p2p_communication: bool,
    #[arg(long)]
    pub overlap_param_gather_with_optimizer_step: bool,
    #[arg(long)]
    pub no_align_param_gather: bool,
    #[arg(long)]
    pub ddp_average_in_collective: bool,
    #[arg(long)]
    pub ddp_pad_buckets_for_high_nccl_busbw: bool,
    #[arg(long)]
    pub ddp_num_buckets: Option<usize>,
    #[arg(long)]
    pub use_dist_ckpt: bool,
    /// torch_dist only (the layout Ferrotron's checkpoints play the part of).
    #[arg(long)]
    pub dist_ckpt_format: Option<String>,
    #[arg(long)]
    pub num_dataset_builder_threads: Option<usize>,
    #[arg(long)]
    pub dataloader_fast_cache_load: bool,
    #[arg(long)]
    pub dataloader_defer_npy_index_mmap: bool,
    /// Weight decay on the QK-norms' parameters too (every parameter named `q_layernorm.` or
    /// `k_layernorm.`; Qwen3-Next's recipe), where other norms and biases take none.
    #[arg(long)]
    pub apply_wd_to_qk_layernorm: bool,
    /// Megatron's older spelling: `apply_wd_to_qk_layernorm` is --apply-wd-to-qk-layernorm.
    #[arg(long)]
    pub no_weight_decay_cond_type: Option<String>,
    /// Refused by name: Xavier initialisation, and Megatron's old spelling of full recompute.
    #[arg(long)]
    pub init_method_xavier_uniform: bool,
    /// Accepted for Megatron's gpt-oss script: ModelOpt's export takes local core attention
    /// instead of Transformer Engine's (one core attention here; training is the same).
    #[arg(long)]
    pub export_force_local_attention: bool,
    /// Refused by name: ModelOpt's gpt-oss mode, YaRN rotary features on grouped-query attention.
    #[arg(long)]
    pub enable_gpt_oss: bool,
    #[arg(long)]
    pub checkpoint_activations: bool,
    /// A benchmark of balanced experts (Megatron's RandomSTE): every router's logits replaced by
    /// standard normal ones (keyed by sample, position and expert), their gradient passed
    /// straight through to the router.
    #[arg(long)]
    pub moe_router_force_load_balancing: bool,
    /// The pieces of each pipeline stage, stages separated by '|': E the embedding, t a decoder
    /// layer, m an MTP depth, L the loss; `x*n` and `(...)*n` repeat (e.g. `Et*3|(tt|)*2,tL`).
    /// pp × (virtual stages) stages, so it sets the virtual stages too. `None` is no layout.
    #[arg(long)]
    pub pipeline_model_parallel_layout: Option<String>,
    /// Count the embedding as a layer when splitting the layers over the pipeline stages: the
    /// first stage holds one decoder layer fewer (Megatron's).
    #[arg(long)]
    pub account_for_embedding_in_pipeline_split: bool,
    /// Count the loss as a layer likewise: the last stage holds one decoder layer fewer.
    #[arg(long)]
    pub account_for_loss_in_pipeline_split: bool,
    #[arg(long)]
    pub no_async_tensor_model_parallel_allreduce: bool,
    #[arg(long)]
    pub accumulate_allreduce_grads_in_fp32: bool,
    #[arg(long)]
    pub manual_gc: bool,
    #[arg(long)]
    pub tp_comm_overlap: bool,
    #[arg(long)]
    pub overlap_p2p_communication: bool,
    #[arg(long)]
    pub no_create_attention_mask_in_dataloader: bool,
    #[arg(long)]
    pub mmap_bin_files: bool,
    #[arg(long)]
    pub no_mmap_bin_files: bool,
    #[arg(long)]
    pub ckpt_fully_parallel_save: bool,
    #[arg(long)]
    pub ckpt_fully_parallel_load: bool,
    /// Megatron's precision-aware optimizer: lets --exp-avg-dtype / --exp-avg-sq-dtype /
    /// --main-grads-dtype take bf16.
    #[arg(long)]
    pub use_precision_aware_optimizer: bool,
    /// Megatron's --optimizer-cpu-offload: the master weights and moments in host memory and the
    /// update on the host (each step's gradients copied down, the parameters back up); not with
    /// --cuda-graph-impl local.
    #[arg(long)]
    pub optimizer_cpu_offload: bool,
    /// The share of the optimizer state offloaded: 1.0 (all of it, the default) is the one built.
    #[arg(long)]
    pub optimizer_offload_fraction: Option<f64>,
    /// Accepted, no effect on the results: the offloaded update's copies run in order.
    #[arg(long)]
    pub overlap_cpu_optimizer_d2h_h2d: bool,
    /// adam (AdamW, as Megatron's adam with decoupled weight decay) or sgd (momentum
    /// --sgd-momentum, L2 weight decay: PyTorch's SGD, as Megatron's).
    #[arg(long)]
    pub optimizer: Option<String>,
    /// SGD's momentum (Megatron's default 0.9).
    #[arg(long)]
    pub sgd_momentum: Option<f64>,
    /// Megatron's older spelling of --position-embedding-type rope.
    #[arg(long)]
    pub use_rotary_position_embeddings: bool,
    /// Linear position interpolation for rotary embeddings: positions divided by this factor
    /// (2 stretches the trained positions over twice the context; transformers' rope_type linear).
    #[arg(long)]
    pub rotary_seq_len_interpolation_factor: Option<f64>,
    /// Rotary pairs of adjacent features (x[2i], x[2i + 1]), GPT-J's layout, rather than a head's
    /// two halves (x[i], x[i + d/2]).
    #[arg(long)]
    pub rotary_interleaved: bool,
    /// num_layers / (pipeline size × N) layers a virtual stage: --num-layers-per-virtual-pipeline-stage's
    /// other spelling.
    #[arg(long)]
    pub num_virtual_stages_per_pipeline_rank: Option<usize>,
    /// Only the pipeline size (Megatron's default) is built.
    #[arg(long)]
    pub microbatch_group_size_per_virtual_pipeline_stage: Option<usize>,
    /// The learning-rate schedule (and weight decay) of --load's checkpoint instead of the
    /// flags'. Without it the flags' schedule runs (Megatron's --override-opt_param-scheduler,
    /// accepted).
    #[arg(long = "use-checkpoint-opt_param-scheduler", alias = "use-checkpoint-opt-param-scheduler")]
    pub use_checkpoint_opt_param_scheduler: bool,
    #[arg(long = "override-opt_param-scheduler", alias = "override-opt-param-scheduler")]
    pub override_opt_param_scheduler: bool,
    /// Accepted, no effect: dropout masks are drawn from counters of the sample and position,
    /// so there is no random state to save or load.
    #[arg(long)]
    pub no_load_rng: bool,
    #[arg(long)]
    pub no_save_rng: bool,
    /// Accepted, no effect: fp16 loss scaling (--fp16 itself is refused).
    #[arg(long)]
    pub loss_scale: Option<f64>,
    #[arg(long)]
    pub initial_loss_scale: Option<f64>,
    #[arg(long)]
    pub min_loss_scale: Option<f64>,
    #[arg(long)]
    pub loss_scale_window: Option<f64>,
    #[arg(long)]
    pub hysteresis: Option<usize>,
    /// Accepted, no effect: every rank reads its own shard and the loader checks every piece.
    #[arg(long)]
    pub dist_ckpt_strictness: Option<String>,
    #[arg(long)]
    pub ckpt_assume_constant_structure: bool,
    #[arg(long)]
    pub auto_detect_ckpt_format: bool,
    #[arg(long)]
    pub bias_swiglu_fusion: bool,
    #[arg(long)]
    pub no_persist_layer_norm: bool,
    #[arg(long)]
    pub defer_embedding_wgrad_compute: bool,
    /// Accepted and not read: no test evaluation runs.
    #[arg(long, num_args = 1..)]
    pub test_data_path: Vec<String>,
    /// Megatron's --skip-train: no training step; one evaluation at the loaded iteration, then exit.
    #[arg(long)]
    pub skip_train: bool,
    /// The transformer layers' linear products in FP8: e4m3 (every operand E4M3) or hybrid
    /// (gradients in E5M2). Needs --bf16.
    #[arg(long)]
    pub fp8_format: Option<String>,
    /// How FP8 tensors are scaled: delayed (the default, as Megatron's: by scales from each
    /// tensor's amax history, Transformer Engine's DelayedScaling) or tensorwise (each tensor by
    /// its own amax, its current scaling). mxfp8 / blockwise are refused by name.
    #[arg(long)]
    pub fp8_recipe: Option<String>,
    /// Delayed scaling: how many passes' amaxes each tensor's history keeps (default 1).
    #[arg(long)]
    pub fp8_amax_history_len: Option<usize>,
    /// Delayed scaling: the scale follows the history's max or its most_recent amax (default).
    #[arg(long)]
    pub fp8_amax_compute_algo: Option<String>,
    /// Delayed scaling: scales are fp8_max / amax / 2^margin (default 0).
    #[arg(long, allow_negative_numbers = true)]
    pub fp8_margin: Option<i32>,
    /// Refused by name: FP8 parameters (and their all-gather in FP8) are not built; the
    /// parameters stay bf16, cast to FP8 in each forward.
    #[arg(long)]
    pub fp8_param_gather: bool,
    /// Under --fp8-format: the first --num-layers-at-start-in-bf16 and the last
    /// --num-layers-at-end-in-bf16 decoder layers (1 and 1 by default) keep bf16 products.
    #[arg(long)]
    pub first_last_layers_bf16: bool,
    #[arg(long)]
    pub num_layers_at_start_in_bf16: Option<usize>,
    #[arg(long)]
    pub num_layers_at_end_in_bf16: Option<usize>,
    /// Learned absolute positions count from 0 again after each end of document in a sample
    /// (Megatron's). As in Megatron Core, rotary embeddings take no position ids: it changes
    /// nothing with --position-embedding-type rope.
    #[arg(long)]
    pub reset_position_ids: bool,
    /// Document-wise attention masks (Megatron's): a token sees only the tokens of its own
    /// document in a sample (an end of document closes the document before it). With
    /// --context-parallel-size above 1 it needs --cp-comm-type a2a; on a GPU in fp32 it runs on
    /// the reference attention kernels (bf16: the flash kernels).
    #[arg(long)]
    pub reset_attention_mask: bool,
    /// Refused by name: Weights & Biases logging is not built (--tensorboard-dir is).
    #[arg(long)]
    pub wandb_project: Option<String>,
    /// Refused by name: FSDP is not built (--use-distributed-optimizer shards the optimizer).
    #[arg(long)]
    pub use_torch_fsdp2: bool,
}

macro_rules! merge_opts {
    ($dst:ident, $src:ident; $($f:ident),*) => { $( if $src.$f.is_some() { $dst.$f = $src.$f.clone(); } )* };
}
macro_rules! merge_flags {
    ($dst:ident, $src:ident; $($f:ident),*) => { $( $dst.$f |= $src.$f; )* };
}

impl TrainArgs {
    /// Overlays `o` on `self` (set values in `o` win; switches are or-ed).
    fn overlay(&mut self, o: &TrainArgs) {
        // A later layer's activation replaces an earlier one's (a preset's SwiGLU gives way to
        // --squared-relu on the command line); within one layer both is an error.
        if [o.swiglu, o.squared_relu, o.quick_geglu].iter().filter(|&&on| on).count() == 1 {
            (self.swiglu, self.squared_relu, self.quick_geglu) = (false, false, false);
        }
        // A later layer's way of placing hybrid layers replaces an earlier one's (a preset's
        // pattern gives way to a flag's, or to its ratios).
        if o.hybrid_layer_pattern.is_some()
            || o.hybrid_override_pattern.is_some()
            || o.hybrid_attention_ratio.is_some()
            || o.hybrid_mlp_ratio.is_some()
        {
            (self.hybrid_layer_pattern, self.hybrid_override_pattern) = (None, None);
            (self.hybrid_attention_ratio, self.hybrid_mlp_ratio) = (None, None);
        }
        merge_opts!(self, o; preset, num_layers, hidden_size, num_attention_heads, num_query_groups, kv_channels, ffn_hidden_size, seq_length,
            max_position_embeddings, position_embedding_type, rotary_base, rope_scaling_factor, q_lora_rank, kv_lora_rank, qk_head_dim, qk_pos_emb_head_dim, v_head_dim, rope_type, rotary_scaling_factor, mscale, mscale_all_dim, yarn_beta_fast, yarn_beta_slow, yarn_original_max_position_embeddings, normalization, tokenizer_type, vocab_size, tokenizer_model, tiktoken_pattern, tiktoken_num_special_tokens, tiktoken_special_tokens, vocab_file, merge_file, init_method_std, embedding_init_method_std,
            micro_batch_size, global_batch_size, train_iters, train_samples, lr_warmup_samples, lr_decay_samples, lr, min_lr, lr_warmup_init, lr_decay_style, lr_wsd_decay_style, lr_wsd_decay_iters, lr_wsd_decay_samples, lr_warmup_iters, lr_warmup_fraction,
            lr_decay_iters, weight_decay, start_weight_decay, end_weight_decay, weight_decay_incr_style, adam_beta1, adam_beta2, adam_eps, clip_grad, norm_epsilon, make_vocab_size_divisible_by,
            hidden_dropout, attention_dropout, window_size, window_attn_skip_freq, glu_linear_offset, activation_func_clamp_value, seed, log_interval, eval_interval, eval_iters, save, load, metrics_file, save_interval, ckpt_format, step_batch_size_schedule, corpus_docs, split,
            tensorboard_dir, tensorboard_log_interval, tensorboard_queue_size, exit_interval, exit_duration_in_mins, non_persistent_save_interval, non_persistent_ckpt_type, non_persistent_global_ckpt_dir, device, cuda_graph_impl, cuda_graph_warmup_steps, profile_step_start, profile_step_end, profile_trace, nproc, tensor_model_parallel_size, ddp_bucket_size, distributed_timeout_s, distributed_timeout_minutes,
            pipeline_model_parallel_size, context_parallel_size, cp_comm_type, num_layers_per_virtual_pipeline_stage, decoder_first_pipeline_num_layers,
            decoder_last_pipeline_num_layers, recompute_granularity, recompute_method, recompute_num_layers,
            num_experts, moe_ffn_hidden_size, moe_router_topk, moe_router_load_balancing_type, moe_aux_loss_coeff,
            moe_z_loss_coeff, moe_router_topk_scaling_factor, moe_router_score_function, moe_router_num_groups, moe_router_group_topk,
            moe_router_bias_update_rate, moe_router_dtype, expert_model_parallel_size, expert_tensor_parallel_size, moe_token_dispatcher_type,
            moe_expert_capacity_factor, moe_token_drop_policy, mtp_num_layers, mtp_loss_scaling_factor,
            moe_layer_freq, moe_shared_expert_intermediate_size, hybrid_layer_pattern, hybrid_override_pattern, mamba_state_dim, mamba_head_dim,
            mamba_num_groups, mamba_num_heads, hybrid_attention_ratio, hybrid_mlp_ratio, img_h, img_w, patch_dim,
            encoder_num_layers, encoder_hidden_size, encoder_num_attention_heads, encoder_ffn_hidden_size, image_token_id,
            image_text_data, image_folder, data_cache_path, data_args_path, per_split_data_args_path,
            distributed_backend, transformer_impl, attention_backend, dataloader_type, rotary_percent, rerun_mode,
            main_grads_dtype, main_params_dtype, exp_avg_dtype, exp_avg_sq_dtype, num_workers, manual_gc_interval,
            timing_log_level, empty_unused_memory_level, wandb_project, optimizer, rotary_seq_len_interpolation_factor, softmax_type, no_weight_decay_cond_type, sgd_momentum,
            num_virtual_stages_per_pipeline_rank, microbatch_group_size_per_virtual_pipeline_stage, loss_scale,
            initial_loss_scale, min_loss_scale, loss_scale_window, hysteresis, dist_ckpt_strictness, fp8_format, fp8_recipe, fp8_amax_history_len, fp8_amax_compute_algo, fp8_margin, num_layers_at_start_in_bf16, num_layers_at_end_in_bf16,
            moe_flex_dispatcher_backend, moe_flex_dispatcher_num_sms, cross_entropy_fusion_impl, pipeline_model_parallel_layout,
            ddp_num_buckets, dist_ckpt_format, num_dataset_builder_threads, decoupled_lr, decoupled_min_lr,
            optimizer_offload_fraction);
        merge_flags!(self, o; check_for_nan_in_loss_and_grad, no_check_for_nan_in_loss_and_grad, use_rope_scaling, swiglu, squared_relu, quick_geglu, untie_embeddings_and_output_weights, disable_bias_linear, add_qkv_bias, qk_layernorm, qk_l2_norm, attention_output_gate, multi_latent_attention, bf16, fp16, first_last_layers_bf16, no_progress, deterministic_mode, disable_bf16_reduced_precision_matmul,
            sequence_parallel, use_distributed_optimizer, overlap_grad_reduce, grad_reduce_in_bf16, overlap_param_gather, profile, group_query_attention,
            use_flash_attn, finetune, no_load_optim, exit_on_missing_checkpoint, no_data_sharding, use_checkpoint_args, mock_data, eod_mask_loss, calculate_per_token_loss, log_validation_ppl_to_tensorboard, log_timers_to_tensorboard,
            use_cpu_initialization, apply_residual_connection_post_layernorm, log_world_size_to_tensorboard, log_memory_to_tensorboard, log_num_zeros_in_grad, async_save, log_progress, no_save_optim, exit_signal_handler,
            moe_router_pre_softmax, moe_router_enable_expert_bias, moe_grouped_gemm, moe_shared_expert_overlap, moe_shared_expert_gate, moe_pad_expert_input_to_capacity, is_hybrid_model,
            mamba_norm_ungrouped, disable_vision_class_token, freeze_lm, freeze_vit,
            log_throughput, moe_per_layer_logging, log_params_norm, recompute_activations, no_position_embedding, use_mcore_models, attention_softmax_in_fp32,
            no_masked_softmax_fusion, no_bias_gelu_fusion, no_bias_swiglu_fusion, no_bias_dropout_fusion, no_rope_fusion,
            no_gradient_accumulation_fusion, cross_entropy_loss_fusion, moe_permute_fusion,
            no_async_tensor_model_parallel_allreduce, accumulate_allreduce_grads_in_fp32, manual_gc, tp_comm_overlap,
            overlap_p2p_communication, no_create_attention_mask_in_dataloader, mmap_bin_files, no_mmap_bin_files,
            ckpt_fully_parallel_save, ckpt_fully_parallel_load, use_precision_aware_optimizer, use_torch_fsdp2,
            apply_layernorm_1p, use_rotary_position_embeddings, rotary_interleaved, use_checkpoint_opt_param_scheduler,
            override_opt_param_scheduler, no_load_rng, no_save_rng, ckpt_assume_constant_structure, auto_detect_ckpt_format,
            bias_swiglu_fusion, no_persist_layer_norm, defer_embedding_wgrad_compute, reset_position_ids, reset_attention_mask,
            skip_train, yarn_correction_range_round_to_int, no_yarn_correction_range_round_to_int, moe_enable_deepep, moe_router_fusion, delay_wgrad_compute, overlap_moe_expert_parallel_comm, te_rng_tracker,
            moe_router_force_load_balancing, account_for_embedding_in_pipeline_split, account_for_loss_in_pipeline_split,
            openai_gelu, no_overlap_p2p_communication, overlap_param_gather_with_optimizer_step, no_align_param_gather,
            ddp_average_in_collective, ddp_pad_buckets_for_high_nccl_busbw, use_dist_ckpt, dataloader_fast_cache_load,
            dataloader_defer_npy_index_mmap, apply_wd_to_qk_layernorm, init_method_xavier_uniform, export_force_local_attention, enable_gpt_oss, checkpoint_activations,
            optimizer_cpu_offload, overlap_cpu_optimizer_d2h_h2d, fp8_param_gather);
        if !o.test_data_path.is_empty() {
            self.test_data_path = o.test_data_path.clone();
        }
        if !o.profile_ranks.is_empty() {
            self.profile_ranks = o.profile_ranks.clone();
        }
        if !o.rampup_batch_size.is_empty() {
            self.rampup_batch_size = o.rampup_batch_size.clone();
        }
        if !o.spec.is_empty() {
            self.spec = o.spec.clone();
        }
        if !o.cuda_graph_scope.is_empty() {
            self.cuda_graph_scope = o.cuda_graph_scope.clone();
        }
        if !o.hierarchical_context_parallel_sizes.is_empty() {
            self.hierarchical_context_parallel_sizes = o.hierarchical_context_parallel_sizes.clone();
        }
        if !o.recompute_modules.is_empty() {
            self.recompute_modules = o.recompute_modules.clone();
        }
        for (dst, src) in [
            (&mut self.data_path, &o.data_path),
            (&mut self.train_data_path, &o.train_data_path),
            (&mut self.valid_data_path, &o.valid_data_path),
        ] {
            if !src.is_empty() {
                *dst = src.clone();
            }
        }
    }
}

/// --data-path, --train-data-path and --valid-data-path as given, or as the files of
/// --data-args-path / --per-split-data-args-path hold them (Megatron's, for blends too long for
/// a command line). Errors name the flag, the file and the fix.
fn data_paths(a: &TrainArgs) -> anyhow::Result<[Vec<String>; 3]> {
    let mut out = [a.data_path.clone(), a.train_data_path.clone(), a.valid_data_path.clone()];
    if let Some(f) = &a.data_args_path {
        if !a.data_path.is_empty() {
            bail!("--data-args-path {} and --data-path both name the data: give one", f.display());
        }
        let text =
            std::fs::read_to_string(f).with_context(|| format!("--data-args-path {}: cannot read it", f.display()))?;
        out[0] = text.split_whitespace().map(String::from).collect();
        if out[0].is_empty() {
            bail!(
                "--data-args-path {} is empty: it holds what --data-path would (prefixes, or weight-prefix pairs)",
                f.display()
            );
        }
    }
    if let Some(f) = &a.per_split_data_args_path {
        if a.data_args_path.is_some() || out.iter().any(|v| !v.is_empty()) {
            bail!(
                "--per-split-data-args-path {} names the data per split: leave out --data-path / --data-args-path / --train-data-path / --valid-data-path",
                f.display()
            );
        }
        let text = std::fs::read_to_string(f)
            .with_context(|| format!("--per-split-data-args-path {}: cannot read it", f.display()))?;
        let bad = |why: String| {
            anyhow::anyhow!(
                "--per-split-data-args-path {}: {why}; it holds {{\"train\": [...], \"valid\": [...], \"test\": [...]}}, each a list of what --train-data-path would take",
                f.display()
            )
        };
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(format!("not JSON ({e})")))?;
        let obj = v.as_object().ok_or_else(|| bad("not a JSON object".into()))?;
        if let Some(k) = obj.keys().find(|k| !["train", "valid", "test"].contains(&k.as_str())) {
            return Err(bad(format!("unknown key \"{k}\"")));
        }
        // "test" is checked and not used (no test evaluation runs).
        for (slot, key) in [(Some(1), "train"), (Some(2), "valid"), (None, "test")] {
            let Some(list) = obj.get(key).filter(|l| !l.is_null()) else { continue };
            let items = list.as_array().ok_or_else(|| bad(format!("\"{key}\" is not a list")))?;
            let mut words = Vec::new();
            for x in items {
                let s = x.as_str().ok_or_else(|| bad(format!("\"{key}\" holds {x}, not a string")))?;
                words.extend(s.split_whitespace().map(String::from));
            }
            if let Some(i) = slot {
                out[i] = words;
            }
        }
    }
    Ok(out)
}

/// Fully resolved settings; this is what a checkpoint records.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct Settings {
    pub preset: String,
    pub num_layers: usize,
    pub hidden_size: usize,
    pub num_attention_heads: usize,
    pub num_query_groups: usize,
    #[serde(default)]
    pub kv_channels: Option<usize>,
    pub ffn_hidden_size: usize,
    pub seq_length: usize,
    pub max_position_embeddings: usize,
    pub position_embedding_type: String,
    pub rotary_base: f64,
    /// `--rotary-percent` (absent from older checkpoints: whole heads).
    #[serde(default = "whole")]
    pub rotary_percent: f64,
    /// `--rotary-seq-len-interpolation-factor` (absent from older checkpoints: none).
    #[serde(default)]
    pub rotary_seq_len_interpolation_factor: Option<f64>,
    /// `--rotary-interleaved` (absent from older checkpoints: half-split pairs, as they ran).
    #[serde(default)]
    pub rotary_interleaved: bool,
    /// `--use-rope-scaling` with `--rope-scaling-factor` (absent from older checkpoints: off).
    #[serde(default)]
    pub use_rope_scaling: bool,
    #[serde(default = "rope_scaling_factor")]
    pub rope_scaling_factor: f64,
    pub normalization: String,
    pub swiglu: bool,
    #[serde(default)]
    pub squared_relu: bool,
    /// --quick-geglu with its offset and clamp (absent from older checkpoints: off).
    #[serde(default)]
    pub quick_geglu: bool,
    #[serde(default)]
    pub glu_linear_offset: f64,
    #[serde(default)]
    pub activation_func_clamp_value: Option<f64>,
    pub untie_embeddings_and_output_weights: bool,
    pub disable_bias_linear: bool,
    /// GeLU as erf rather than its tanh approximation: Megatron's MLP without its fused bias-GeLU
    /// (--no-bias-gelu-fusion, or no biases: --disable-bias-linear) unless --openai-gelu (absent
    /// from older checkpoints: tanh, as they ran).
    #[serde(default)]
    pub gelu_exact: bool,
    /// Absent from older checkpoints' settings.
    #[serde(default)]
    pub add_qkv_bias: bool,
    pub qk_layernorm: bool,
    /// --qk-l2-norm (absent from older checkpoints' settings: off).
    #[serde(default)]
    pub qk_l2_norm: bool,
    /// --attention-output-gate (absent from older checkpoints' settings: off).
    #[serde(default)]
    pub attention_output_gate: bool,
    /// --softmax-type (absent from older checkpoints' settings: vanilla).
    #[serde(default = "vanilla")]
    pub softmax_type: String,
    /// --apply-layernorm-1p (absent from older checkpoints' settings: plain weights, as they ran).
    #[serde(default)]
    pub apply_layernorm_1p: bool,
    /// Multi-latent attention's sizes (`--multi-latent-attention`); None: grouped-query attention.
    #[serde(default)]
    pub mla: Option<MlaSettings>,
    pub tokenizer_type: String,
    pub init_method_std: f32,
    /// --embedding-init-method-std (absent from older checkpoints: none).
    #[serde(default)]
    pub embedding_init_method_std: Option<f32>,
    pub micro_batch_size: usize,
    pub global_batch_size: usize,
    pub train_iters: u64,
    /// `--train-samples` (train_iters is then this over the global batch), and the schedule in
    /// samples; absent from older checkpoints' settings.
    #[serde(default)]
    pub train_samples: Option<u64>,
    /// `--rampup-batch-size` (empty: none) and `--step-batch-size-schedule`: see `batch_schedule`.
    #[serde(default)]
    pub rampup_batch_size: Vec<u64>,
    #[serde(default)]
    pub step_batch_size_schedule: Option<String>,
    #[serde(default)]
    pub lr_warmup_samples: Option<u64>,
    #[serde(default)]
    pub lr_decay_samples: Option<u64>,
    /// `--lr-warmup-fraction` as given (lr_warmup_iters holds it rounded down).
    #[serde(default)]
    pub lr_warmup_fraction: Option<f64>,
    pub lr: f64,
    pub min_lr: f64,
    /// `--lr-warmup-init` (absent from older checkpoints' settings: 0).
    #[serde(default)]
    pub lr_warmup_init: f64,
    /// `--decoupled-lr` / `--decoupled-min-lr` (absent from older checkpoints' settings: none).
    #[serde(default)]
    pub decoupled_lr: Option<f64>,
    #[serde(default)]
    pub decoupled_min_lr: Option<f64>,
    pub lr_decay_style: String,
    #[serde(default)]
    pub lr_wsd_decay_style: Option<String>,
    #[serde(default)]
    pub lr_wsd_decay_iters: Option<u64>,
    #[serde(default)]
    pub lr_wsd_decay_samples: Option<u64>,
    pub lr_warmup_iters: u64,
    pub weight_decay: f32,
    /// --start-weight-decay, --end-weight-decay, --weight-decay-incr-style (absent from older
    /// checkpoints: constant).
    #[serde(default)]
    pub start_weight_decay: Option<f32>,
    #[serde(default)]
    pub end_weight_decay: Option<f32>,
    #[serde(default)]
    pub weight_decay_incr_style: Option<String>,
    /// --apply-wd-to-qk-layernorm (absent from older checkpoints' settings: off).
    #[serde(default)]
    pub apply_wd_to_qk_layernorm: bool,
    pub adam_beta1: f32,
    pub adam_beta2: f32,
    pub clip_grad: f32,
    pub seed: u64,
    pub log_interval: u64,
    pub eval_interval: u64,
    pub eval_iters: u64,
    pub save_interval: u64,
    pub bf16: bool,
    /// --fp8-format: the transformer layers' linear products in FP8 (absent from older
    /// checkpoints' settings: none).
    #[serde(default)]
    pub fp8_format: Option<String>,
    /// --fp8-recipe under --fp8-format: tensorwise or delayed (older checkpoints': tensorwise,
    /// the only one built then).
    #[serde(default = "tensorwise")]
    pub fp8_recipe: String,
    /// Delayed scaling's --fp8-amax-history-len, --fp8-amax-compute-algo and --fp8-margin.
    #[serde(default = "one")]
    pub fp8_amax_history_len: usize,
    #[serde(default = "most_recent")]
    pub fp8_amax_compute_algo: String,
    #[serde(default)]
    pub fp8_margin: i32,
    /// Decoder layers at the start and the end that keep bf16 products under --fp8-format
    /// (--first-last-layers-bf16; [0, 0] without it).
    #[serde(default)]
    pub fp8_bf16_ends: [usize; 2],
    pub corpus_docs: usize,
    #[serde(default = "one")]
    pub tensor_model_parallel_size: usize,
    #[serde(default)]
    pub sequence_parallel: bool,
    #[serde(default)]
    pub use_distributed_optimizer: bool,
    #[serde(default)]
    pub overlap_grad_reduce: bool,
    #[serde(default)]
    pub grad_reduce_in_bf16: bool,
    /// AdamW's moments in bf16 (--exp-avg-dtype / --exp-avg-sq-dtype bf16).
    #[serde(default)]
    pub exp_avg_bf16: bool,
    #[serde(default)]
    pub exp_avg_sq_bf16: bool,
    /// The optimizer's state and update on the host (--optimizer-cpu-offload).
    #[serde(default)]
    pub optimizer_cpu_offload: bool,
    #[serde(default)]
    pub overlap_param_gather: bool,
    #[serde(default)]
    pub ddp_bucket_size: Option<usize>,
    #[serde(default = "one")]
    pub pipeline_model_parallel_size: usize,
    #[serde(default = "one")]
    pub context_parallel_size: usize,
    /// --cp-comm-type: one for every layer or one a layer (absent from older checkpoints'
    /// settings: allgather).
    #[serde(default)]
    pub cp_comm_type: Vec<String>,
    #[serde(default)]
    pub num_layers_per_virtual_pipeline_stage: Option<usize>,
    #[serde(default)]
    pub decoder_first_pipeline_num_layers: Option<usize>,
    #[serde(default)]
    pub decoder_last_pipeline_num_layers: Option<usize>,
    /// --pipeline-model-parallel-layout (absent from older checkpoints' settings: none).
    #[serde(default)]
    pub pipeline_model_parallel_layout: Option<String>,
    /// --account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split (absent
    /// from older checkpoints' settings: off).
    #[serde(default)]
    pub account_for_embedding_in_pipeline_split: bool,
    #[serde(default)]
    pub account_for_loss_in_pipeline_split: bool,
    #[serde(default)]
    pub recompute_granularity: Option<String>,
    #[serde(default)]
    pub recompute_method: Option<String>,
    #[serde(default)]
    pub recompute_num_layers: Option<usize>,
    /// None: --train-iters.
    #[serde(default)]
    pub lr_decay_iters: Option<u64>,
    #[serde(default = "adam_eps")]
    pub adam_eps: f32,
    #[serde(default = "norm_epsilon")]
    pub norm_epsilon: f64,
    #[serde(default = "vocab_divisible_by")]
    pub make_vocab_size_divisible_by: usize,
    #[serde(default)]
    pub hidden_dropout: f32,
    /// Dropout of the attention probabilities.
    #[serde(default)]
    pub attention_dropout: f32,
    /// Tokens before itself that each token's attention sees (`--window-size`'s left); None: all.
    #[serde(default)]
    pub window_size: Option<usize>,
    /// The layers the window applies in (`--window-attn-skip-freq` as given); None: all.
    #[serde(default)]
    pub window_attn_skip_freq: Option<String>,
    /// `--data-path` as given; empty (and no --train-data-path): the built-in corpus.
    #[serde(default)]
    pub data_path: Vec<String>,
    #[serde(default)]
    pub train_data_path: Vec<String>,
    #[serde(default)]
    pub valid_data_path: Vec<String>,
    /// `--mock-data`: Megatron's mock sequences instead of a dataset.
    #[serde(default)]
    pub mock_data: bool,
    /// `--image-text-data` and `--image-folder` (a LLaVA run's image-text pairs).
    #[serde(default)]
    pub image_text_data: Option<PathBuf>,
    #[serde(default)]
    pub image_folder: Option<PathBuf>,
    /// `--eod-mask-loss`.
    #[serde(default)]
    pub eod_mask_loss: bool,
    /// `--optimizer` (absent from older checkpoints' settings: adam).
    #[serde(default = "adam")]
    pub optimizer: String,
    /// `--sgd-momentum`.
    #[serde(default = "sgd_momentum")]
    pub sgd_momentum: f32,
    /// `--dataloader-type` (absent from older checkpoints' settings: single).
    #[serde(default = "single")]
    pub dataloader_type: String,
    /// `--no-data-sharding` (cyclic only).
    #[serde(default)]
    pub no_data_sharding: bool,
    /// `--reset-position-ids` (absent from older checkpoints' settings: off).
    #[serde(default)]
    pub reset_position_ids: bool,
    /// `--reset-attention-mask` (absent from older checkpoints' settings: off).
    #[serde(default)]
    pub reset_attention_mask: bool,
    /// `--calculate-per-token-loss`.
    #[serde(default)]
    pub calculate_per_token_loss: bool,
    /// `--tensorboard-dir` and what goes there (`--tensorboard-log-interval`,
    /// `--log-validation-ppl-to-tensorboard`, `--log-timers-to-tensorboard`).
    #[serde(default)]
    pub tensorboard_dir: Option<PathBuf>,
    #[serde(default = "one")]
    pub tensorboard_log_interval: usize,
    #[serde(default)]
    pub log_validation_ppl_to_tensorboard: bool,
    #[serde(default)]
    pub log_timers_to_tensorboard: bool,
    #[serde(default)]
    pub log_world_size_to_tensorboard: bool,
    /// `--skip-train`.
    #[serde(default)]
    pub skip_train: bool,
    /// `--log-throughput`, `--moe-per-layer-logging`, `--log-params-norm`, `--log-num-zeros-in-grad`.
    #[serde(default)]
    pub log_throughput: bool,
    #[serde(default)]
    pub moe_per_layer_logging: bool,
    #[serde(default)]
    pub log_params_norm: bool,
    #[serde(default)]
    pub log_num_zeros_in_grad: bool,
    /// `--log-memory-to-tensorboard`.
    #[serde(default)]
    pub log_memory_to_tensorboard: bool,
    /// NullTokenizer's `--vocab-size`.
    #[serde(default)]
    pub vocab_size: Option<usize>,
    /// HuggingFaceTokenizer's `--tokenizer-model` folder, TikTokenizer's file.
    #[serde(default)]
    pub tokenizer_model: Option<PathBuf>,
    /// TikTokenizer's `--tiktoken-pattern`, `--tiktoken-num-special-tokens` and
    /// `--tiktoken-special-tokens`.
    #[serde(default)]
    pub tiktoken_pattern: Option<String>,
    #[serde(default)]
    pub tiktoken_num_special_tokens: Option<usize>,
    #[serde(default)]
    pub tiktoken_special_tokens: Option<Vec<String>>,
    #[serde(default = "default_split")]
    pub split: String,
    /// --data-cache-path.
    #[serde(default)]
    pub data_cache_path: Option<PathBuf>,
    /// Multi-token prediction depths (`--mtp-num-layers`); None: none.
    #[serde(default)]
    pub mtp_num_layers: Option<usize>,
    #[serde(default = "mtp_loss_scaling_factor")]
    pub mtp_loss_scaling_factor: f32,
    /// Mixture of experts (`--num-experts` and the `--moe-*` flags); None: dense MLPs.
    #[serde(default)]
    pub moe: Option<MoeSettings>,
    /// A Mamba hybrid (`--hybrid-override-pattern` and the `--mamba-*` flags); None: every layer
    /// attention then MLP.
    #[serde(default)]
    pub mamba: Option<crate::hybrid::MambaSettings>,
    /// A LLaVA-style model's vision encoder (`--img-h`, `--img-w`, `--patch-dim` and the
    /// `--encoder-*` flags); None: text only.
    #[serde(default)]
    pub vision: Option<crate::multimodal::VisionSettings>,
    /// Stop at a step whose gradient norm is not finite (else skip its update and go on).
    #[serde(default = "yes")]
    pub check_for_nan_in_loss_and_grad: bool,
}

fn yes() -> bool {
    true
}

/// The MoE flags of a run, as Megatron names them.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct MoeSettings {
    pub num_experts: usize,
    pub moe_ffn_hidden_size: usize,
    pub moe_router_topk: usize,
    pub moe_router_load_balancing_type: String,
    pub moe_aux_loss_coeff: f32,
    pub moe_z_loss_coeff: Option<f32>,
    pub moe_router_pre_softmax: bool,
    pub moe_router_topk_scaling_factor: Option<f32>,
    pub expert_model_parallel_size: usize,
    pub moe_token_dispatcher_type: String,
    /// Absent from checkpoints of earlier builds: none.
    #[serde(default)]
    pub moe_shared_expert_intermediate_size: Option<usize>,
    /// `--moe-layer-freq` as given; None: every layer (1).
    #[serde(default)]
    pub moe_layer_freq: Option<String>,
    /// --expert-tensor-parallel-size where it differs from the tensor-parallel size (1: whole
    /// experts); None: the tensor-parallel size.
    #[serde(default)]
    pub expert_tensor_parallel_size: Option<usize>,
    /// Absent from checkpoints of earlier builds: softmax.
    #[serde(default = "softmax")]
    pub moe_router_score_function: String,
    #[serde(default)]
    pub moe_router_num_groups: Option<usize>,
    #[serde(default)]
    pub moe_router_group_topk: Option<usize>,
    /// --moe-router-bias-update-rate with --moe-router-enable-expert-bias; None without it.
    #[serde(default)]
    pub moe_router_bias_update_rate: Option<f32>,
    /// --moe-router-dtype fp32.
    #[serde(default)]
    pub moe_router_fp32: bool,
    /// --moe-expert-capacity-factor (None: dropless).
    #[serde(default)]
    pub moe_expert_capacity_factor: Option<f64>,
    /// --moe-token-drop-policy (probs or position).
    #[serde(default = "probs")]
    pub moe_token_drop_policy: String,
    /// --moe-shared-expert-gate.
    #[serde(default)]
    pub moe_shared_expert_gate: bool,
    /// --moe-router-force-load-balancing (a benchmark: random router logits). A run setting, not
    /// the model's: left out of the model flags a checkpoint keeps.
    #[serde(default)]
    pub moe_router_force_load_balancing: bool,
}

fn adam() -> String {
    "adam".into()
}

fn tensorwise() -> String {
    "tensorwise".into()
}

fn most_recent() -> String {
    "most_recent".into()
}

/// --fp8-format checked with its recipe and --bf16.
fn fp8_format(a: &TrainArgs) -> anyhow::Result<Option<String>> {
    let Some(f) = &a.fp8_format else {
        if let Some(r) = &a.fp8_recipe {
            eprintln!("warning: --fp8-recipe {r} without --fp8-format: the run is not in FP8");
        }
        return Ok(None);
    };
    if ferrotron_kernels::Fp8Format::parse(f).is_none() {
        bail!("--fp8-format {f}: the formats are e4m3 (every operand E4M3) and hybrid (gradients in E5M2)");
    }
    if !a.bf16 {
        bail!("--fp8-format {f} needs --bf16: what is not multiplied in FP8 trains in bf16");
    }
    Ok(Some(f.clone()))
}

/// --fp8-recipe (Megatron's default: delayed) and delayed scaling's settings, checked under
/// --fp8-format: (recipe, history length, compute algorithm, margin). Without it the defaults
/// (the run is not in FP8; `fp8_format` warns of a recipe given).
fn fp8_recipe(a: &TrainArgs) -> anyhow::Result<(String, usize, String, i32)> {
    if a.fp8_format.is_none() {
        return Ok(("delayed".into(), 1, most_recent(), 0));
    }
    let recipe = match a.fp8_recipe.as_deref() {
        None | Some("delayed") => "delayed",
        Some("tensorwise") => "tensorwise",
        Some(r @ ("mxfp8" | "blockwise")) => bail!(
            "--fp8-recipe {r} (block-scaled FP8) is not built: pass --fp8-recipe delayed or tensorwise (one scale a tensor)"
        ),
        Some(r) => bail!("--fp8-recipe {r}: the recipes are delayed, tensorwise, mxfp8 and blockwise"),
    };
    let len = a.fp8_amax_history_len.unwrap_or(1);
    let algo = a.fp8_amax_compute_algo.clone().unwrap_or_else(most_recent);
    let margin = a.fp8_margin.unwrap_or(0);
    if recipe == "tensorwise" {
        for (flag, set) in [
            ("--fp8-amax-history-len", a.fp8_amax_history_len.is_some()),
            ("--fp8-amax-compute-algo", a.fp8_amax_compute_algo.is_some()),
            ("--fp8-margin", a.fp8_margin.is_some()),
        ] {
            if set {
                bail!(
                    "{flag} sets delayed scaling's history: --fp8-recipe tensorwise scales each tensor by its own amax (drop {flag}, or pass --fp8-recipe delayed)"
                );
            }
        }
    }
    if len == 0 {
        bail!("--fp8-amax-history-len 0: each tensor keeps at least its last amax (1, the default)");
    }
    if ferrotron_core::AmaxAlgo::parse(&algo).is_none() {
        bail!("--fp8-amax-compute-algo {algo}: the choices are most_recent and max");
    }
    if !(-64..=64).contains(&margin) {
        bail!("--fp8-margin {margin}: scales are fp8_max / amax / 2^margin; pick a margin within ±64");
    }
    Ok((recipe.into(), len, algo, margin))
}

/// --first-last-layers-bf16's [start, end] layer counts ([0, 0] without it).
fn fp8_bf16_ends(a: &TrainArgs) -> anyhow::Result<[usize; 2]> {
    let (start, end) = (a.num_layers_at_start_in_bf16, a.num_layers_at_end_in_bf16);
    if !a.first_last_layers_bf16 {
        if start.is_some() || end.is_some() {
            bail!(
                "--num-layers-at-start-in-bf16 / --num-layers-at-end-in-bf16 count the layers --first-last-layers-bf16 keeps in bf16: add it"
            );
        }
        return Ok([0, 0]);
    }
    if a.fp8_format.is_none() {
        bail!("--first-last-layers-bf16 keeps layers out of FP8: it goes with --fp8-format");
    }
    Ok([start.unwrap_or(1), end.unwrap_or(1)])
}

fn sgd_momentum() -> f32 {
    0.9
}

fn single() -> String {
    "single".into()
}

fn probs() -> String {
    "probs".into()
}

fn softmax() -> String {
    "softmax".into()
}

/// A QK-norm's parameter by Megatron's name test (--apply-wd-to-qk-layernorm): `q_layernorm.`
/// or `k_layernorm.` in its name (multi-latent attention's query-latent norm is named so too).
pub fn qk_layernorm_param(m: &ferrotron_core::ParamMeta) -> bool {
    m.name.contains("q_layernorm.") || m.name.contains("k_layernorm.")
}

fn vanilla() -> String {
    "vanilla".into()
}

impl MoeSettings {
    /// The flags gathered, defaults filled in as Megatron's; None without --num-experts (any
    /// other MoE flag is then an error naming it).
    fn from_args(a: &TrainArgs, ffn_hidden_size: usize) -> anyhow::Result<Option<MoeSettings>> {
        let Some(num_experts) = a.num_experts else {
            let given = [
                ("--moe-ffn-hidden-size", a.moe_ffn_hidden_size.is_some()),
                ("--moe-router-topk", a.moe_router_topk.is_some()),
                ("--moe-router-load-balancing-type", a.moe_router_load_balancing_type.is_some()),
                ("--moe-aux-loss-coeff", a.moe_aux_loss_coeff.is_some()),
                ("--moe-z-loss-coeff", a.moe_z_loss_coeff.is_some()),
                ("--moe-router-pre-softmax", a.moe_router_pre_softmax),
                ("--moe-router-topk-scaling-factor", a.moe_router_topk_scaling_factor.is_some()),
                ("--moe-router-score-function", a.moe_router_score_function.is_some()),
                ("--moe-router-num-groups", a.moe_router_num_groups.is_some()),
                ("--moe-router-group-topk", a.moe_router_group_topk.is_some()),
                ("--moe-router-enable-expert-bias", a.moe_router_enable_expert_bias),
                ("--moe-router-bias-update-rate", a.moe_router_bias_update_rate.is_some()),
                ("--moe-router-dtype", a.moe_router_dtype.is_some()),
                ("--expert-model-parallel-size", a.expert_model_parallel_size.is_some_and(|e| e != 1)),
                ("--moe-token-dispatcher-type", a.moe_token_dispatcher_type.is_some()),
                ("--moe-grouped-gemm", a.moe_grouped_gemm),
                ("--moe-layer-freq", a.moe_layer_freq.is_some()),
                ("--moe-shared-expert-intermediate-size", a.moe_shared_expert_intermediate_size.is_some()),
                ("--moe-shared-expert-overlap", a.moe_shared_expert_overlap),
                ("--moe-shared-expert-gate", a.moe_shared_expert_gate),
                ("--moe-expert-capacity-factor", a.moe_expert_capacity_factor.is_some()),
                ("--moe-token-drop-policy", a.moe_token_drop_policy.is_some()),
                ("--moe-pad-expert-input-to-capacity", a.moe_pad_expert_input_to_capacity),
                ("--moe-router-force-load-balancing", a.moe_router_force_load_balancing),
            ];
            if let Some((flag, _)) = given.iter().find(|(_, g)| *g) {
                bail!("{flag} configures mixture-of-experts layers: add --num-experts N (or drop it)");
            }
            return Ok(None);
        };
        // Megatron: a negative factor means no dropping.
        let capacity_factor = a.moe_expert_capacity_factor.filter(|&f| f >= 0.0);
        // Megatron pads each expert's rows to its capacity with tokens not routed to it, at weight
        // 0: no output or gradient changes, so the flag is accepted and nothing is padded here.
        // Its one visible effect is on the expert bias, whose counts then read the padded
        // capacity of every expert (no bias would move): that pair is refused.
        if a.moe_pad_expert_input_to_capacity {
            if capacity_factor.is_none() {
                bail!(
                    "--moe-pad-expert-input-to-capacity pads to each expert's capacity: add --moe-expert-capacity-factor"
                );
            }
            if a.moe_router_enable_expert_bias {
                bail!(
                    "--moe-pad-expert-input-to-capacity with --moe-router-enable-expert-bias: Megatron counts the padded rows as every expert's load, so the bias would not move; drop one"
                );
            }
        }
        if capacity_factor.is_none() && a.moe_token_drop_policy.is_some() {
            bail!(
                "--moe-token-drop-policy chooses which tokens an expert over capacity drops: add --moe-expert-capacity-factor"
            );
        }
        if capacity_factor.is_some() && a.moe_token_dispatcher_type.as_deref() != Some("alltoall") {
            bail!(
                "--moe-expert-capacity-factor drops tokens in the all-to-all dispatcher: add --moe-token-dispatcher-type alltoall (Megatron's rule)"
            );
        }
        let tp = a.tensor_model_parallel_size.unwrap_or(1);
        let etp = a.expert_tensor_parallel_size.filter(|&e| e != tp);
        match etp {
            None => {}
            Some(1) if a.sequence_parallel => {}
            Some(1) => bail!(
                "--expert-tensor-parallel-size 1 under --tensor-model-parallel-size {tp}: each rank routes its own slice of the sequence, so add --sequence-parallel (Megatron requires it with experts)"
            ),
            Some(e) => bail!(
                "--expert-tensor-parallel-size {e} differs from --tensor-model-parallel-size {tp} and from 1: the experts split over the tensor-parallel group (Megatron's default) or not at all; pick one of those"
            ),
        }
        Ok(Some(MoeSettings {
            num_experts,
            moe_ffn_hidden_size: a.moe_ffn_hidden_size.unwrap_or(ffn_hidden_size),
            moe_router_topk: a.moe_router_topk.unwrap_or(2),
            moe_router_load_balancing_type: a
                .moe_router_load_balancing_type
                .clone()
                .unwrap_or_else(|| "aux_loss".into()),
            moe_aux_loss_coeff: a.moe_aux_loss_coeff.unwrap_or(0.0) as f32,
            moe_z_loss_coeff: a.moe_z_loss_coeff.map(|z| z as f32),
            moe_router_pre_softmax: a.moe_router_pre_softmax,
            moe_router_topk_scaling_factor: a.moe_router_topk_scaling_factor.map(|s| s as f32),
            expert_model_parallel_size: a.expert_model_parallel_size.unwrap_or(1),
            expert_tensor_parallel_size: etp,
            moe_token_dispatcher_type: a.moe_token_dispatcher_type.clone().unwrap_or_else(|| "allgather".into()),
            moe_shared_expert_intermediate_size: a.moe_shared_expert_intermediate_size,
            moe_layer_freq: a.moe_layer_freq.clone().filter(|f| f.trim() != "1"),
            moe_router_score_function: a.moe_router_score_function.clone().unwrap_or_else(softmax),
            moe_router_num_groups: a.moe_router_num_groups,
            moe_router_group_topk: a.moe_router_group_topk,
            moe_router_bias_update_rate: match (a.moe_router_enable_expert_bias, a.moe_router_bias_update_rate) {
                (true, r) => Some(r.unwrap_or(1e-3) as f32),
                (false, Some(_)) => bail!(
                    "--moe-router-bias-update-rate moves the expert bias: add --moe-router-enable-expert-bias (or drop the rate)"
                ),
                (false, None) => None,
            },
            moe_router_fp32: match a.moe_router_dtype.as_deref() {
                None => false,
                Some("fp32") => true,
                Some("fp64") => bail!("--moe-router-dtype fp64 is not built: use fp32 (or leave it out)"),
                Some(o) => bail!("--moe-router-dtype {o}: use fp32 (or leave it out: the model's dtype)"),
            },
            moe_expert_capacity_factor: capacity_factor,
            moe_token_drop_policy: a.moe_token_drop_policy.clone().unwrap_or_else(probs),
            moe_shared_expert_gate: a.moe_shared_expert_gate,
            moe_router_force_load_balancing: a.moe_router_force_load_balancing,
        }))
    }

    /// The spec the layers are built from (checked, errors naming the flag).
    fn spec(&self, activation: Activation, bias: bool) -> anyhow::Result<MoeSpec> {
        let load_balancing = match self.moe_router_load_balancing_type.as_str() {
            "aux_loss" => LoadBalancing::AuxLoss,
            "seq_aux_loss" => LoadBalancing::SeqAuxLoss,
            "global_aux_loss" => LoadBalancing::GlobalAuxLoss,
            "none" => LoadBalancing::None,
            o @ ("sinkhorn" | "quantile_balancing") => bail!(
                "--moe-router-load-balancing-type {o} is not built yet: use aux_loss, seq_aux_loss, global_aux_loss or none"
            ),
            o => bail!("--moe-router-load-balancing-type {o}: use aux_loss, seq_aux_loss, global_aux_loss or none"),
        };
        match self.moe_token_dispatcher_type.as_str() {
            // flex (DeepEP, HybridEP) is another transport for the same all-to-all.
            "allgather" | "alltoall" | "flex" => {}
            o => bail!("--moe-token-dispatcher-type {o}: use allgather, alltoall or flex"),
        }
        let score = match self.moe_router_score_function.as_str() {
            "softmax" => Score::Softmax,
            "sigmoid" => Score::Sigmoid,
            "sqrtsoftplus" => Score::SqrtSoftplus,
            o => bail!("--moe-router-score-function {o}: use softmax, sigmoid or sqrtsoftplus"),
        };
        let capacity = match (self.moe_expert_capacity_factor, self.moe_token_drop_policy.as_str()) {
            (None, _) => None,
            (Some(factor), "probs") => Some(Capacity { factor, policy: DropPolicy::Probs }),
            (Some(factor), "position") => Some(Capacity { factor, policy: DropPolicy::Position }),
            (_, o) => bail!("--moe-token-drop-policy {o}: use probs or position"),
        };
        let groups = match (self.moe_router_num_groups, self.moe_router_group_topk) {
            (Some(num), Some(topk)) => Some(Groups { num, topk }),
            (None, None) => None,
            (Some(n), None) => bail!(
                "--moe-router-num-groups {n} limits each token to its best groups: add --moe-router-group-topk (how many)"
            ),
            (None, Some(k)) => {
                bail!("--moe-router-group-topk {k} picks among expert groups: add --moe-router-num-groups (how many)")
            }
        };
        let spec = MoeSpec {
            num_experts: self.num_experts,
            ffn_hidden_size: self.moe_ffn_hidden_size,
            activation,
            bias,
            shared_expert_ffn: self.moe_shared_expert_intermediate_size,
            shared_expert_gate: self.moe_shared_expert_gate,
            router: RouterSpec {
                topk: self.moe_router_topk,
                pre_softmax: self.moe_router_pre_softmax,
                topk_scaling_factor: self.moe_router_topk_scaling_factor,
                load_balancing,
                aux_loss_coeff: self.moe_aux_loss_coeff,
                z_loss_coeff: self.moe_z_loss_coeff,
                score,
                groups,
                expert_bias_update_rate: self.moe_router_bias_update_rate,
                fp32: self.moe_router_fp32,
                capacity,
                force_load_balancing: self.moe_router_force_load_balancing,
            },
            expert_parallel_size: self.expert_model_parallel_size,
            expert_tensor_parallel_size: self.expert_tensor_parallel_size,
            ep_group: None,
            cp_group: None,
            dp_group: None,
            metrics: Default::default(),
            global_counts: Default::default(),
            biases: Default::default(),
        };
        spec.validate().map_err(anyhow::Error::msg)?;
        Ok(spec)
    }
}

/// `--window-size` as Megatron writes it, "(left,right)" (brackets and spaces optional): the
/// tokens before itself each token sees, None for -1 (all). Right must be 0 (or -1, which a
/// causal mask makes the same): later tokens are never seen.
fn parse_window(v: &str) -> anyhow::Result<Option<usize>> {
    let bad = || {
        anyhow::anyhow!(
            "--window-size {v}: write (left,right) as Megatron does, e.g. (4096,0); left -1 is no window, right must be 0"
        )
    };
    let inner = v.trim().trim_start_matches(['(', '[']).trim_end_matches([')', ']']);
    let parts: Vec<i64> =
        inner.split(',').map(|x| x.trim().parse::<i64>()).collect::<Result<_, _>>().map_err(|_| bad())?;
    let [left, right] = parts[..] else { return Err(bad()) };
    if left < -1 || !matches!(right, 0 | -1) {
        return Err(bad());
    }
    Ok(usize::try_from(left).ok())
}

fn one() -> usize {
    1
}

fn default_split() -> String {
    "969, 30, 1".into()
}

// Defaults of the settings added after checkpoints recorded them (older ones lack the keys).
fn adam_eps() -> f32 {
    1e-8
}

/// Megatron's --rope-scaling-factor default.
/// Rotary embeddings over whole heads (`--rotary-percent`'s default).
fn whole() -> f64 {
    1.0
}

fn rope_scaling_factor() -> f64 {
    8.0
}

fn norm_epsilon() -> f64 {
    1e-5
}

/// Multi-latent attention's sizes, as the checkpoint's settings keep them.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct MlaSettings {
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_head_dim: usize,
    pub qk_pos_emb_head_dim: usize,
    pub v_head_dim: usize,
    /// YaRN on the rotary part, None: plain RoPE.
    #[serde(default)]
    pub yarn: Option<YarnSettings>,
}

/// `--rotary-scaling-factor`, `--mscale`, `--mscale-all-dim`, `--yarn-beta-fast`,
/// `--yarn-beta-slow`, `--yarn-original-max-position-embeddings` (absent from older checkpoints:
/// Megatron's defaults).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct YarnSettings {
    pub factor: f64,
    pub mscale: f64,
    pub mscale_all_dim: f64,
    #[serde(default = "yarn_beta_fast")]
    pub beta_fast: f64,
    #[serde(default = "yarn_beta_slow")]
    pub beta_slow: f64,
    #[serde(default = "yarn_original")]
    pub original_max_position_embeddings: f64,
}

fn yarn_beta_fast() -> f64 {
    ferrotron_kernels::Yarn::megatron(1.0).beta_fast
}

fn yarn_beta_slow() -> f64 {
    ferrotron_kernels::Yarn::megatron(1.0).beta_slow
}

fn yarn_original() -> f64 {
    ferrotron_kernels::Yarn::megatron(1.0).original_max_position_embeddings
}

impl YarnSettings {
    pub fn yarn(&self) -> ferrotron_kernels::Yarn {
        ferrotron_kernels::Yarn {
            mscale: self.mscale,
            mscale_all_dim: self.mscale_all_dim,
            beta_fast: self.beta_fast,
            beta_slow: self.beta_slow,
            original_max_position_embeddings: self.original_max_position_embeddings,
            ..ferrotron_kernels::Yarn::megatron(self.factor)
        }
    }
}

impl MlaSettings {
    /// `--multi-latent-attention` and its sizes (Megatron's defaults) and rotary type (yarn unless
    /// --rope-type rope; at factor 1 plain RoPE), or None without it; the sizes without it, and
    /// YaRN's flags without YaRN, refused by name.
    fn from_args(a: &TrainArgs) -> anyhow::Result<Option<MlaSettings>> {
        let sizes = [
            ("--q-lora-rank", a.q_lora_rank),
            ("--kv-lora-rank", a.kv_lora_rank),
            ("--qk-head-dim", a.qk_head_dim),
            ("--qk-pos-emb-head-dim", a.qk_pos_emb_head_dim),
            ("--v-head-dim", a.v_head_dim),
        ];
        // Megatron's: multi-latent attention takes yarn unless told rope, other attention rope.
        let yarn = match a.rope_type.as_deref() {
            None => a.multi_latent_attention,
            Some("yarn") => true,
            Some("rope") => false,
            Some(other) => bail!("--rope-type {other}: pick rope or yarn"),
        };
        let factor = a.rotary_scaling_factor.unwrap_or(1.0);
        let shape = [a.yarn_beta_fast, a.yarn_beta_slow, a.yarn_original_max_position_embeddings];
        if !yarn
            && (factor != 1.0 || a.mscale.is_some() || a.mscale_all_dim.is_some() || shape.iter().any(Option::is_some))
        {
            bail!(
                "--rotary-scaling-factor, --mscale, --mscale-all-dim and --yarn-* are YaRN's (--rope-type yarn); for Llama 3's scaling use --use-rope-scaling"
            );
        }
        if a.no_yarn_correction_range_round_to_int {
            bail!(
                "--no-yarn-correction-range-round-to-int: YaRN's correction range is floored and ceiled here (Megatron's default); drop it"
            );
        }
        if !a.multi_latent_attention {
            if yarn && factor != 1.0 {
                bail!(
                    "--rope-type yarn with --rotary-scaling-factor {factor}: YaRN is built for multi-latent attention's rotary part (--multi-latent-attention)"
                );
            }
            if let Some((flag, _)) = sizes.iter().find(|(_, v)| v.is_some()) {
                bail!("{flag} sizes multi-latent attention: add --multi-latent-attention (or drop it)");
            }
            return Ok(None);
        }
        // At factor 1 YaRN changes no frequency and no scale: plain RoPE.
        let yarn = (yarn && factor != 1.0).then(|| YarnSettings {
            factor,
            mscale: a.mscale.unwrap_or(1.0),
            mscale_all_dim: a.mscale_all_dim.unwrap_or(0.0),
            beta_fast: a.yarn_beta_fast.unwrap_or_else(yarn_beta_fast),
            beta_slow: a.yarn_beta_slow.unwrap_or_else(yarn_beta_slow),
            original_max_position_embeddings: a.yarn_original_max_position_embeddings.unwrap_or_else(yarn_original),
        });
        if let Some(problem) = yarn.and_then(|y| y.yarn().problem()) {
            bail!(
                "{problem}: --rotary-scaling-factor, --yarn-beta-fast, --yarn-beta-slow and --yarn-original-max-position-embeddings must be positive, --mscale and --mscale-all-dim finite"
            );
        }
        Ok(Some(MlaSettings {
            q_lora_rank: a.q_lora_rank,
            kv_lora_rank: a.kv_lora_rank.unwrap_or(32),
            qk_head_dim: a.qk_head_dim.unwrap_or(128),
            qk_pos_emb_head_dim: a.qk_pos_emb_head_dim.unwrap_or(64),
            v_head_dim: a.v_head_dim.unwrap_or(128),
            yarn,
        }))
    }
}

/// Megatron's --mtp-loss-scaling-factor default.
fn mtp_loss_scaling_factor() -> f32 {
    0.1
}

fn vocab_divisible_by() -> usize {
    VOCAB_DIVISIBLE_BY
}

/// How the ranks come to be: threads of this process, or one process each under a launcher.
#[derive(Clone, Debug, Default)]
pub enum Launch {
    /// One rank.
    #[default]
    Single,
    /// `--nproc N`: N thread ranks here (CPU).
    Threads(usize),
    /// WORLD_SIZE > 1 from torchrun / `ferrotron launch` / SLURM / Open MPI.
    Processes(ferrotron_comm::DistEnv),
}

impl Launch {
    pub fn world_size(&self) -> usize {
        match self {
            Launch::Single => 1,
            Launch::Threads(n) => *n,
            Launch::Processes(e) => e.world_size,
        }
    }
}

/// Where files go; not part of the recorded settings.
#[derive(Clone, Debug)]
pub struct Paths {
    pub save: Option<PathBuf>,
    pub load: Option<PathBuf>,
    /// What --load takes (Megatron's --finetune and --no-load-optim).
    pub load_mode: LoadMode,
    pub metrics: Option<PathBuf>,
    pub progress: bool,
    /// Megatron's non-persistent checkpoints (`--non-persistent-save-interval`): where and how
    /// often; the folder keeps only its newest.
    pub non_persistent: Option<NonPersistent>,
    /// Megatron's --exit-interval: stop after an iteration that is a multiple of it.
    pub exit_interval: Option<u64>,
    /// Megatron's --exit-duration-in-mins: stop once training has run this long.
    pub exit_duration: Option<std::time::Duration>,
    /// Megatron's --exit-signal-handler: stop (saving) on SIGTERM.
    pub exit_signal: bool,
    /// Megatron's --async-save: shards written by a background thread.
    pub async_save: bool,
    /// Megatron's --log-progress: progress.txt in the --save folder (`progress_log`).
    pub log_progress: bool,
    /// Megatron's --no-save-optim: checkpoints of the parameters alone.
    pub no_save_optim: bool,
    pub device: ferrotron_core::Device,
    pub launch: Launch,
    /// How long a collective waits for the other ranks.
    pub timeout: std::time::Duration,
    /// Megatron's --deterministic-mode: GPU kernels without order-dependent sums.
    pub deterministic: bool,
    /// --disable-bf16-reduced-precision-matmul: split-K sums in fp32 only.
    pub fp32_split_k_sums: bool,
    /// Megatron's --profile: the steps a CUDA profiler range covers on the ranks that profile.
    pub profile: Option<ProfileRange>,
    /// `--cuda-graph-impl local --cuda-graph-scope full_iteration`: the whole step replayed as a
    /// CUDA graph after this many eager warm-up steps.
    pub cuda_graph_warmup: Option<usize>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NonPersistent {
    pub dir: PathBuf,
    pub interval: u64,
}

/// What `--load` restores.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LoadMode {
    /// Everything: the run goes on where it stopped.
    #[default]
    Resume,
    /// `--no-load-optim`: parameters and position, a fresh optimizer (its fp32 master weights
    /// from the loaded parameters).
    NoOptim,
    /// `--finetune`: parameters only; iteration 0, a fresh optimizer, the data from its start.
    Finetune,
}

/// `--profile`: the range opens before step `start + 1` is queued and closes after step `end` is,
/// on the global ranks listed; with `trace`, the GPU's timeline of the range is written there.
#[derive(Clone, Debug, PartialEq)]
pub struct ProfileRange {
    pub start: u64,
    pub end: u64,
    pub ranks: Vec<usize>,
    pub trace: Option<PathBuf>,
}

impl Default for Paths {
    fn default() -> Self {
        Paths {
            save: None,
            load: None,
            load_mode: LoadMode::Resume,
            metrics: None,
            progress: false,
            non_persistent: None,
            exit_interval: None,
            exit_duration: None,
            exit_signal: false,
            async_save: false,
            log_progress: false,
            no_save_optim: false,
            device: ferrotron_core::Device::Cpu,
            launch: Launch::Single,
            timeout: std::time::Duration::from_secs(600),
            deterministic: false,
            fp32_split_k_sums: false,
            profile: None,
            cuda_graph_warmup: None,
        }
    }
}

/// Megatron's non-persistent checkpoint flags, checked: an interval needs --save (the default
/// folder is under it); only the global type is built.
fn non_persistent(a: &TrainArgs) -> anyhow::Result<Option<NonPersistent>> {
    match a.non_persistent_ckpt_type.as_deref() {
        None | Some("global") => {}
        Some(t @ ("local" | "in_memory")) => bail!(
            "--non-persistent-ckpt-type {t} keeps checkpoints on each node through nvidia-resiliency-ext, which is not built: use global (a folder every rank reaches)"
        ),
        Some(t) => bail!("--non-persistent-ckpt-type {t}: use global"),
    }
    let Some(interval) = a.non_persistent_save_interval else { return Ok(None) };
    if interval == 0 {
        bail!("--non-persistent-save-interval must be at least 1");
    }
    let Some(save) = &a.save else {
        bail!("--non-persistent-save-interval {interval} saves between --save's checkpoints: add --save FOLDER");
    };
    let dir = a.non_persistent_global_ckpt_dir.clone().unwrap_or_else(|| save.join(crate::checkpoint::NON_PERSISTENT));
    // The folder keeps only its newest checkpoint: never the persistent ones'.
    let same = |x: &Path, y: &Path| x == y || x.canonicalize().ok().is_some_and(|c| Some(c) == y.canonicalize().ok());
    if same(&dir, save) {
        bail!(
            "--non-persistent-global-ckpt-dir {} is the --save folder, whose older checkpoints it would delete: give another folder (default SAVE/non_persistent)",
            dir.display()
        );
    }
    Ok(Some(NonPersistent { dir, interval }))
}

/// `--profile`'s range, checked: it needs a CUDA device and a step range that is not empty.
fn profile_range(a: &TrainArgs, device: &ferrotron_core::Device) -> anyhow::Result<Option<ProfileRange>> {
    let (start, end) = (a.profile_step_start.unwrap_or(10), a.profile_step_end.unwrap_or(12));
    if !a.profile {
        if a.profile_step_start.is_some()
            || a.profile_step_end.is_some()
            || !a.profile_ranks.is_empty()
            || a.profile_trace.is_some()
        {
            bail!(
                "--profile-step-start, --profile-step-end, --profile-ranks and --profile-trace take effect with --profile: add it"
            );
        }
        return Ok(None);
    }
    if end <= start {
        bail!(
            "--profile-step-end {end} must be greater than --profile-step-start {start}: the range covers steps start + 1 to end"
        );
    }
    if device.is_cpu() {
        bail!("--profile opens a CUDA profiler range: run with --device cuda (or drop --profile)");
    }
    if let Some(t) = &a.profile_trace {
        ferrotron_core::gpu_trace::available().with_context(|| format!("--profile-trace {}", t.display()))?;
    }
    let ranks = if a.profile_ranks.is_empty() { vec![0] } else { a.profile_ranks.clone() };
    Ok(Some(ProfileRange { start, end, ranks, trace: a.profile_trace.clone() }))
}

/// `--cuda-graph-impl`, `--cuda-graph-scope` and `--cuda-graph-warmup-steps`, checked: the
/// warm-up steps before the step is graphed, or None without graphs.
fn cuda_graph(a: &TrainArgs, device: &ferrotron_core::Device, world: usize) -> anyhow::Result<Option<usize>> {
    match a.cuda_graph_impl.as_deref() {
        None | Some("none") => {
            if !a.cuda_graph_scope.is_empty() || a.cuda_graph_warmup_steps.is_some() {
                bail!(
                    "--cuda-graph-scope and --cuda-graph-warmup-steps take effect with --cuda-graph-impl local: add it"
                );
            }
            return Ok(None);
        }
        Some("local") if a.mtp_num_layers.is_some_and(|n| n > 0) => bail!(
            "--cuda-graph-impl local with --mtp-num-layers: the multi-token prediction depths' loss counts change the launches from batch to batch; drop one"
        ),
        Some("local") if a.optimizer_cpu_offload => bail!(
            "--cuda-graph-impl local with --optimizer-cpu-offload: the offloaded update copies to and from the host inside the step, which a graph cannot hold; drop one"
        ),
        Some("local") => {}
        Some("transformer_engine") => bail!(
            "--cuda-graph-impl transformer_engine: Ferrotron has no Transformer Engine; use --cuda-graph-impl local"
        ),
        Some(o) => bail!("--cuda-graph-impl {o}: use none or local"),
    }
    if let Some(o) = a.cuda_graph_scope.iter().find(|x| x.as_str() != "full_iteration") {
        bail!(
            "--cuda-graph-scope {o}: Ferrotron graphs the whole step only; use --cuda-graph-scope full_iteration (the default with --cuda-graph-impl local)"
        );
    }
    if world > 1 {
        bail!(
            "--cuda-graph-impl local runs on one GPU for now ({world} ranks asked for): graphs with collectives inside are not yet tested; drop it for multi-GPU runs"
        );
    }
    if a.cuda_graph_warmup_steps == Some(0) {
        bail!(
            "--cuda-graph-warmup-steps 0: at least one eager step must come first (it picks the GEMM algorithms and makes the buffers the graph reuses)"
        );
    }
    if device.is_cpu() {
        bail!("--cuda-graph-impl local captures CUDA work: run with --device cuda (or drop it)");
    }
    Ok(Some(a.cuda_graph_warmup_steps.unwrap_or(3)))
}

/// The model flags that build `c` (all but the tokenizer's).
pub fn model_args(c: &TransformerConfig) -> TrainArgs {
    let mut a = transformer_args(c);
    crate::hybrid::model_args(c, &mut a);
    a
}

/// `model_args` but a hybrid's pattern and Mamba sizes.
fn transformer_args(c: &TransformerConfig) -> TrainArgs {
    let (pe, base, percent, interpolation, interleaved) = match c.position_embedding {
        PositionEmbedding::LearnedAbsolute => ("learned_absolute", 10000.0, 1.0, None, false),
        PositionEmbedding::Rope { base, percent, interpolation, interleaved, .. } => {
            ("rope", base, percent, interpolation, interleaved)
        }
        PositionEmbedding::None => ("none", 10000.0, 1.0, None, false),
    };
    let moe = ferrotron_models::moe_spec(c);
    let (activation, bias) = match (&c.layer.mlp, moe) {
        (MlpSpec::Dense { activation, bias }, _) => (*activation, *bias),
        (MlpSpec::Custom(_), Some(m)) => (m.activation, m.bias),
        (MlpSpec::Custom(_), None) => (Activation::Gelu, true),
    };
    let (swiglu, squared_relu) = (activation == Activation::SwiGlu, activation == Activation::SquaredRelu);
    let glu = match activation {
        Activation::QuickGeGlu(g) => Some(g),
        _ => None,
    };
    let scaling = match c.position_embedding {
        PositionEmbedding::Rope { scaling, .. } => scaling,
        _ => None,
    };
    // Multi-latent attention's YaRN.
    let yarn = c.layer.attention.mla.and_then(|m| m.yarn);
    TrainArgs {
        num_layers: Some(c.num_layers),
        hidden_size: Some(c.hidden_size),
        num_attention_heads: Some(c.num_attention_heads),
        num_query_groups: Some(c.num_query_groups),
        kv_channels: c.kv_channels,
        ffn_hidden_size: Some(c.ffn_hidden_size),
        seq_length: Some(c.seq_length),
        max_position_embeddings: Some(c.max_position_embeddings),
        position_embedding_type: Some(pe.into()),
        rotary_base: Some(base),
        rotary_percent: Some(percent).filter(|&p| p != 1.0),
        rotary_seq_len_interpolation_factor: interpolation,
        rotary_interleaved: interleaved,
        use_rope_scaling: scaling.is_some(),
        rope_scaling_factor: scaling.map(|s| s.factor),
        normalization: Some(if c.layer.norm == NormKind::LayerNorm { "LayerNorm" } else { "RMSNorm" }.into()),
        swiglu,
        squared_relu,
        quick_geglu: glu.is_some(),
        glu_linear_offset: glu.map(|g| g.offset).filter(|&o| o != 0.0),
        activation_func_clamp_value: glu.and_then(|g| g.clamp),
        untie_embeddings_and_output_weights: c.untie_embeddings_and_output_weights,
        disable_bias_linear: !bias,
        // Megatron's GeLU is tanh through the fused bias-GeLU, erf without it: the flag that
        // gives this model's where the default would not.
        no_bias_gelu_fusion: activation == Activation::GeluExact && bias,
        openai_gelu: activation == Activation::Gelu && !bias,
        add_qkv_bias: c.layer.attention.qkv_bias && !c.layer.attention.bias,
        qk_layernorm: c.layer.attention.qk_layernorm,
        qk_l2_norm: c.layer.attention.qk_l2_norm,
        attention_output_gate: c.layer.attention.output_gate,
        softmax_type: Some(c.layer.attention.softmax.flag().into()),
        apply_layernorm_1p: c.layer.zero_centred_gamma,
        multi_latent_attention: c.layer.attention.mla.is_some(),
        q_lora_rank: c.layer.attention.mla.and_then(|m| m.q_lora_rank),
        kv_lora_rank: c.layer.attention.mla.map(|m| m.kv_lora_rank),
        qk_head_dim: c.layer.attention.mla.map(|m| m.qk_head_dim),
        qk_pos_emb_head_dim: c.layer.attention.mla.map(|m| m.qk_pos_emb_head_dim),
        v_head_dim: c.layer.attention.mla.map(|m| m.v_head_dim),
        rope_type: c.layer.attention.mla.map(|m| if m.yarn.is_some() { "yarn" } else { "rope" }.into()),
        rotary_scaling_factor: yarn.map(|y| y.factor),
        mscale: yarn.map(|y| y.mscale),
        mscale_all_dim: yarn.map(|y| y.mscale_all_dim),
        yarn_beta_fast: yarn.map(|y| y.beta_fast),
        yarn_beta_slow: yarn.map(|y| y.beta_slow),
        yarn_original_max_position_embeddings: yarn.map(|y| y.original_max_position_embeddings),
        norm_epsilon: Some(c.norm_epsilon),
        make_vocab_size_divisible_by: Some(c.make_vocab_size_divisible_by),
        // The config's window keeps the token and left before it: left = window − 1.
        window_size: c.layer.attention.window.map(|w| format!("({},0)", w - 1)),
        window_attn_skip_freq: c.layer.window_layers.as_deref().map(crate::layer_freq::render),
        init_method_std: Some(c.init_method_std),
        embedding_init_method_std: c.embedding_init_method_std,
        hidden_dropout: Some(c.hidden_dropout as f64),
        attention_dropout: Some(c.attention_dropout as f64),
        num_experts: moe.map(|m| m.num_experts),
        moe_ffn_hidden_size: moe.map(|m| m.ffn_hidden_size),
        moe_router_topk: moe.map(|m| m.router.topk),
        moe_router_load_balancing_type: moe.map(|m| {
            match m.router.load_balancing {
                LoadBalancing::AuxLoss => "aux_loss",
                LoadBalancing::SeqAuxLoss => "seq_aux_loss",
                LoadBalancing::GlobalAuxLoss => "global_aux_loss",
                LoadBalancing::None => "none",
            }
            .into()
        }),
        moe_aux_loss_coeff: moe.map(|m| m.router.aux_loss_coeff as f64),
        moe_z_loss_coeff: moe.and_then(|m| m.router.z_loss_coeff).map(f64::from),
        moe_router_pre_softmax: moe.is_some_and(|m| m.router.pre_softmax),
        moe_router_topk_scaling_factor: moe.and_then(|m| m.router.topk_scaling_factor).map(f64::from),
        moe_router_score_function: moe.map(|m| {
            match m.router.score {
                Score::Softmax => "softmax",
                Score::Sigmoid => "sigmoid",
                Score::SqrtSoftplus => "sqrtsoftplus",
            }
            .into()
        }),
        moe_router_num_groups: moe.and_then(|m| m.router.groups).map(|g| g.num),
        moe_router_group_topk: moe.and_then(|m| m.router.groups).map(|g| g.topk),
        moe_router_enable_expert_bias: moe.is_some_and(|m| m.router.expert_bias_update_rate.is_some()),
        moe_router_bias_update_rate: moe.and_then(|m| m.router.expert_bias_update_rate).map(f64::from),
        moe_router_dtype: moe.filter(|m| m.router.fp32).map(|_| "fp32".into()),
        moe_expert_capacity_factor: moe.and_then(|m| m.router.capacity).map(|c| c.factor),
        moe_token_drop_policy: moe.and_then(|m| m.router.capacity).map(|c| {
            match c.policy {
                DropPolicy::Probs => "probs",
                DropPolicy::Position => "position",
            }
            .into()
        }),
        // The dispatcher a capacity needs (the same one runs either way).
        moe_token_dispatcher_type: moe.and_then(|m| m.router.capacity).map(|_| "alltoall".into()),
        expert_model_parallel_size: moe.map(|m| m.expert_parallel_size),
        moe_shared_expert_intermediate_size: moe.and_then(|m| m.shared_expert_ffn),
        moe_shared_expert_gate: moe.is_some_and(|m| m.shared_expert_gate),
        mtp_num_layers: c.mtp.map(|m| m.num_layers),
        mtp_loss_scaling_factor: c.mtp.map(|m| m.loss_scaling_factor as f64),
        moe_layer_freq: c
            .layer
            .other_mlp
            .as_ref()
            .filter(|_| moe.is_some())
            .map(|o| crate::layer_freq::render(&o.layers.iter().map(|&dense| !dense).collect::<Vec<_>>())),
        ..TrainArgs::default()
    }
}

impl TrainArgs {
    /// Takes the model's flags and tokenizer from `m` (whose model flags are all set, as
    /// `model_args` sets them), replacing this one's (--use-checkpoint-args).
    fn set_model(&mut self, m: &TrainArgs) {
        macro_rules! take {
            ($($f:ident),*) => { $(self.$f = m.$f.clone();)* };
        }
        take!(
            num_layers,
            hidden_size,
            num_attention_heads,
            num_query_groups,
            kv_channels,
            ffn_hidden_size,
            seq_length,
            max_position_embeddings,
            position_embedding_type,
            rotary_base,
            rotary_percent,
            rotary_seq_len_interpolation_factor,
            rotary_interleaved,
            use_rope_scaling,
            rope_scaling_factor,
            normalization,
            swiglu,
            squared_relu,
            quick_geglu,
            glu_linear_offset,
            activation_func_clamp_value,
            untie_embeddings_and_output_weights,
            disable_bias_linear,
            no_bias_gelu_fusion,
            openai_gelu,
            add_qkv_bias,
            qk_layernorm,
            qk_l2_norm,
            attention_output_gate,
            softmax_type,
            apply_layernorm_1p,
            multi_latent_attention,
            q_lora_rank,
            kv_lora_rank,
            qk_head_dim,
            qk_pos_emb_head_dim,
            v_head_dim,
            rope_type,
            rotary_scaling_factor,
            mscale,
            mscale_all_dim,
            yarn_beta_fast,
            yarn_beta_slow,
            yarn_original_max_position_embeddings,
            norm_epsilon,
            make_vocab_size_divisible_by,
            window_size,
            window_attn_skip_freq,
            init_method_std,
            embedding_init_method_std,
            hidden_dropout,
            attention_dropout,
            tokenizer_type,
            vocab_size,
            tokenizer_model,
            tiktoken_pattern,
            tiktoken_num_special_tokens,
            tiktoken_special_tokens,
            num_experts,
            moe_ffn_hidden_size,
            moe_router_topk,
            moe_router_load_balancing_type,
            moe_aux_loss_coeff,
            moe_z_loss_coeff,
            moe_router_pre_softmax,
            moe_router_topk_scaling_factor,
            moe_router_score_function,
            moe_router_num_groups,
            moe_router_group_topk,
            moe_router_enable_expert_bias,
            moe_router_bias_update_rate,
            moe_router_dtype,
            moe_expert_capacity_factor,
            moe_token_drop_policy,
            moe_token_dispatcher_type,
            expert_model_parallel_size,
            moe_shared_expert_intermediate_size,
            moe_shared_expert_gate,
            mtp_num_layers,
            mtp_loss_scaling_factor,
            moe_layer_freq,
            hybrid_layer_pattern,
            hybrid_override_pattern,
            mamba_state_dim,
            mamba_head_dim,
            mamba_num_groups,
            mamba_num_heads,
            mamba_norm_ungrouped,
            img_h,
            img_w,
            patch_dim,
            encoder_num_layers,
            encoder_hidden_size,
            encoder_num_attention_heads,
            encoder_ffn_hidden_size,
            disable_vision_class_token,
            image_token_id
        );
    }
}

/// The model and tokenizer flags of the run saved in `load` (--use-checkpoint-args).
pub(crate) fn checkpoint_args(load: &Path) -> anyhow::Result<TrainArgs> {
    let s = crate::checkpoint::read_state(load)
        .with_context(|| format!("--use-checkpoint-args reads the model from --load {}", load.display()))?
        .settings;
    let mut m = model_args(&s.model_config()?);
    m.tokenizer_type = Some(s.tokenizer_type.clone());
    m.vocab_size = s.vocab_size;
    m.tokenizer_model = s.tokenizer_model.clone();
    (m.tiktoken_pattern, m.tiktoken_num_special_tokens) = (s.tiktoken_pattern.clone(), s.tiktoken_num_special_tokens);
    m.tiktoken_special_tokens = s.tiktoken_special_tokens.clone();
    if let Some(v) = &s.vision {
        v.to_args(&mut m);
    }
    Ok(m)
}

fn preset_defaults(name: &str) -> anyhow::Result<TrainArgs> {
    let Some(c) = preset(name) else {
        bail!("--preset {name}: unknown preset; choose one of {}", ferrotron_models::PRESETS.join(", "));
    };
    let tiny = c.vocab_size <= 256;
    Ok(TrainArgs {
        preset: Some(name.into()),
        tokenizer_type: Some(if tiny { "byte" } else { "gpt2" }.into()),
        micro_batch_size: Some(if tiny { 16 } else { 8 }),
        global_batch_size: Some(if tiny { 32 } else { 64 }),
        train_iters: Some(if tiny { 240 } else { 2000 }),
        lr: Some(if tiny { 3e-3 } else { 6e-4 }),
        min_lr: Some(if tiny { 3e-4 } else { 6e-5 }),
        lr_decay_style: Some("cosine".into()),
        lr_warmup_iters: Some(if tiny { 20 } else { 100 }),
        weight_decay: Some(0.1),
        adam_beta1: Some(0.9),
        adam_beta2: Some(0.95),
        clip_grad: Some(1.0),
        seed: Some(1234),
        log_interval: Some(10),
        eval_interval: Some(if tiny { 60 } else { 200 }),
        eval_iters: Some(8),
        save_interval: Some(if tiny { 120 } else { 500 }),
        corpus_docs: Some(if tiny { 6000 } else { 20000 }),
        ..preset_model_args(name, &c)
    })
}

/// A preset's model flags: its language model's, and a LLaVA preset's vision flags.
fn preset_model_args(name: &str, c: &TransformerConfig) -> TrainArgs {
    let mut a = model_args(c);
    if let Some(v) = ferrotron_models::llava_vision(name) {
        crate::multimodal::spec_args(&v, &mut a);
    }
    a
}

/// The tokenizer flags Megatron ignores with this tokenizer
/// (`TokenizerFlags::without_megatron_ignored`) dropped, with a warning naming them.
fn ignore_other_tokenizers_flags(a: &mut TrainArgs) {
    let t = a.tokenizer_type.clone().unwrap_or_default();
    let (pattern, special) = (a.tiktoken_pattern.clone(), a.tiktoken_special_tokens.clone());
    let flags = TokenizerFlags {
        vocab_size: a.vocab_size,
        model: None,
        tiktoken_pattern: pattern.as_deref(),
        tiktoken_num_special_tokens: a.tiktoken_num_special_tokens,
        tiktoken_special_tokens: special.as_deref(),
    };
    let (kept, dropped) = flags.without_megatron_ignored(&t);
    if dropped.is_empty() {
        return;
    }
    eprintln!("warning: --tokenizer-type {t} does not read {}: ignored, as in Megatron", dropped.join(", "));
    a.vocab_size = kept.vocab_size;
    a.tiktoken_pattern = kept.tiktoken_pattern.map(str::to_string);
    a.tiktoken_num_special_tokens = kept.tiktoken_num_special_tokens;
    a.tiktoken_special_tokens = kept.tiktoken_special_tokens.map(<[String]>::to_vec);
}

fn need<T: Clone>(v: &Option<T>, flag: &str) -> anyhow::Result<T> {
    v.clone().with_context(|| format!("{flag} is required (or pick a --preset that sets it)"))
}

impl Settings {
    /// preset (default `tiny`) < --config file < flags, then validated.
    pub fn resolve(flags: &TrainArgs) -> anyhow::Result<(Settings, Paths)> {
        let file = match &flags.config {
            Some(p) => {
                let text = std::fs::read_to_string(p)
                    .with_context(|| format!("--config {}: cannot read the file", p.display()))?;
                toml::from_str::<TrainArgs>(&text)
                    .with_context(|| format!("--config {}: not a valid settings file", p.display()))?
            }
            None => TrainArgs::default(),
        };
        let name = flags.preset.clone().or(file.preset.clone()).unwrap_or_else(|| "tiny".into());
        let mut a = preset_defaults(&name)?;
        // --ckpt-step: the load is that iteration's folder from here on.
        let load = match (flags.load.as_ref().or(file.load.as_ref()), flags.ckpt_step) {
            (Some(l), Some(n)) => {
                check_dir(l, "--load")?;
                Some(crate::checkpoint::at_step(l, n)?)
            }
            (l, None) => l.cloned(),
            (None, Some(n)) => bail!("--ckpt-step {n} picks an iteration of --load: add --load FOLDER"),
        };
        if flags.use_checkpoint_args || file.use_checkpoint_args {
            let Some(load) = load.as_ref() else {
                bail!("--use-checkpoint-args takes the model from the checkpoint: add --load FOLDER");
            };
            check_dir(load, "--load")?;
            a.set_model(&checkpoint_args(load)?);
        }
        a.overlay(&file);
        a.overlay(flags);
        a.load = load;
        // A preset's minimum goes with its own --lr: one given here decays to Megatron's
        // default (0) unless --min-lr comes with it.
        if file.lr.or(flags.lr).is_some() && file.min_lr.or(flags.min_lr).is_none() {
            a.min_lr = Some(0.0);
        }
        ignore_other_tokenizers_flags(&mut a);
        crate::compat::apply(&mut a)?;
        let [data_path, train_data_path, valid_data_path] = data_paths(&a)?;
        let (fp8_recipe, fp8_amax_history_len, fp8_amax_compute_algo, fp8_margin) = fp8_recipe(&a)?;
        let mut s = Settings {
            preset: name,
            num_layers: need(&a.num_layers, "--num-layers")?,
            hidden_size: need(&a.hidden_size, "--hidden-size")?,
            num_attention_heads: need(&a.num_attention_heads, "--num-attention-heads")?,
            num_query_groups: a.num_query_groups.or(a.num_attention_heads).context("--num-query-groups")?,
            kv_channels: a.kv_channels,
            ffn_hidden_size: need(&a.ffn_hidden_size, "--ffn-hidden-size")?,
            seq_length: need(&a.seq_length, "--seq-length")?,
            max_position_embeddings: need(&a.max_position_embeddings, "--max-position-embeddings")?,
            position_embedding_type: need(&a.position_embedding_type, "--position-embedding-type")?,
            rotary_base: need(&a.rotary_base, "--rotary-base")?,
            rotary_percent: a.rotary_percent.unwrap_or_else(whole),
            // 1 (Megatron scripts pass it so) interpolates nothing.
            rotary_seq_len_interpolation_factor: a.rotary_seq_len_interpolation_factor.filter(|&f| f != 1.0),
            rotary_interleaved: a.rotary_interleaved,
            use_rope_scaling: a.use_rope_scaling,
            rope_scaling_factor: a.rope_scaling_factor.unwrap_or_else(rope_scaling_factor),
            normalization: need(&a.normalization, "--normalization")?,
            swiglu: a.swiglu,
            squared_relu: a.squared_relu,
            quick_geglu: a.quick_geglu,
            glu_linear_offset: a.glu_linear_offset.unwrap_or(0.0),
            activation_func_clamp_value: a.activation_func_clamp_value,
            untie_embeddings_and_output_weights: a.untie_embeddings_and_output_weights,
            disable_bias_linear: a.disable_bias_linear,
            gelu_exact: !a.openai_gelu && (a.no_bias_gelu_fusion || a.disable_bias_linear),
            add_qkv_bias: a.add_qkv_bias,
            qk_layernorm: a.qk_layernorm,
            qk_l2_norm: a.qk_l2_norm,
            attention_output_gate: a.attention_output_gate,
            softmax_type: a.softmax_type.clone().unwrap_or_else(vanilla),
            apply_layernorm_1p: a.apply_layernorm_1p,
            mla: MlaSettings::from_args(&a)?,
            tokenizer_type: need(&a.tokenizer_type, "--tokenizer-type")?,
            init_method_std: need(&a.init_method_std, "--init-method-std")?,
            embedding_init_method_std: a.embedding_init_method_std,
            micro_batch_size: need(&a.micro_batch_size, "--micro-batch-size")?,
            global_batch_size: need(&a.global_batch_size, "--global-batch-size")?,
            rampup_batch_size: a.rampup_batch_size.clone(),
            step_batch_size_schedule: a.step_batch_size_schedule.clone(),
            train_iters: need(&a.train_iters, "--train-iters")?,
            lr: need(&a.lr, "--lr")?,
            min_lr: need(&a.min_lr, "--min-lr")?,
            lr_warmup_init: a.lr_warmup_init.unwrap_or(0.0),
            decoupled_lr: a.decoupled_lr,
            decoupled_min_lr: a.decoupled_min_lr,
            lr_decay_style: need(&a.lr_decay_style, "--lr-decay-style")?,
            lr_wsd_decay_style: a.lr_wsd_decay_style.clone(),
            lr_wsd_decay_iters: a.lr_wsd_decay_iters,
            lr_wsd_decay_samples: a.lr_wsd_decay_samples,
            lr_warmup_iters: need(&a.lr_warmup_iters, "--lr-warmup-iters")?,
            weight_decay: need(&a.weight_decay, "--weight-decay")?,
            start_weight_decay: a.start_weight_decay,
            end_weight_decay: a.end_weight_decay,
            weight_decay_incr_style: a.weight_decay_incr_style.clone(),
            apply_wd_to_qk_layernorm: a.apply_wd_to_qk_layernorm,
            adam_beta1: need(&a.adam_beta1, "--adam-beta1")?,
            adam_beta2: need(&a.adam_beta2, "--adam-beta2")?,
            clip_grad: need(&a.clip_grad, "--clip-grad")?,
            seed: need(&a.seed, "--seed")?,
            log_interval: need(&a.log_interval, "--log-interval")?,
            eval_interval: need(&a.eval_interval, "--eval-interval")?,
            eval_iters: need(&a.eval_iters, "--eval-iters")?,
            save_interval: need(&a.save_interval, "--save-interval")?,
            bf16: a.bf16,
            fp8_format: fp8_format(&a)?,
            fp8_recipe,
            fp8_amax_history_len,
            fp8_amax_compute_algo,
            fp8_margin,
            fp8_bf16_ends: fp8_bf16_ends(&a)?,
            corpus_docs: need(&a.corpus_docs, "--corpus-docs")?,
            data_path,
            train_data_path,
            valid_data_path,
            mock_data: a.mock_data,
            image_text_data: a.image_text_data.clone(),
            image_folder: a.image_folder.clone(),
            eod_mask_loss: a.eod_mask_loss,
            dataloader_type: a.dataloader_type.clone().unwrap_or_else(single),
            optimizer: a.optimizer.clone().unwrap_or_else(adam),
            sgd_momentum: match a.sgd_momentum {
                Some(m) if !(0.0..1.0).contains(&m) => bail!("--sgd-momentum {m} must be in [0, 1)"),
                m => m.unwrap_or(0.9) as f32,
            },
            no_data_sharding: a.no_data_sharding,
            reset_position_ids: a.reset_position_ids,
            reset_attention_mask: a.reset_attention_mask,
            calculate_per_token_loss: a.calculate_per_token_loss,
            tensorboard_dir: a.tensorboard_dir.clone(),
            tensorboard_log_interval: match a.tensorboard_log_interval {
                Some(0) => bail!("--tensorboard-log-interval must be at least 1"),
                i => i.unwrap_or(1),
            },
            log_validation_ppl_to_tensorboard: a.log_validation_ppl_to_tensorboard,
            log_timers_to_tensorboard: a.log_timers_to_tensorboard,
            log_world_size_to_tensorboard: a.log_world_size_to_tensorboard,
            log_throughput: a.log_throughput,
            moe_per_layer_logging: a.moe_per_layer_logging,
            log_params_norm: a.log_params_norm,
            log_num_zeros_in_grad: a.log_num_zeros_in_grad,
            log_memory_to_tensorboard: a.log_memory_to_tensorboard,
            skip_train: a.skip_train,
            vocab_size: a.vocab_size,
            tokenizer_model: a.tokenizer_model.clone(),
            tiktoken_pattern: a.tiktoken_pattern.clone(),
            tiktoken_num_special_tokens: a.tiktoken_num_special_tokens,
            tiktoken_special_tokens: a.tiktoken_special_tokens.clone(),
            split: a.split.clone().unwrap_or_else(default_split),
            data_cache_path: a.data_cache_path.clone(),
            tensor_model_parallel_size: a.tensor_model_parallel_size.unwrap_or(1),
            sequence_parallel: a.sequence_parallel,
            use_distributed_optimizer: a.use_distributed_optimizer,
            overlap_grad_reduce: a.overlap_grad_reduce,
            grad_reduce_in_bf16: a.grad_reduce_in_bf16,
            exp_avg_bf16: a.exp_avg_dtype.as_deref() == Some("bf16"),
            exp_avg_sq_bf16: a.exp_avg_sq_dtype.as_deref() == Some("bf16"),
            optimizer_cpu_offload: a.optimizer_cpu_offload,
            overlap_param_gather: a.overlap_param_gather,
            ddp_bucket_size: a.ddp_bucket_size,
            pipeline_model_parallel_size: a.pipeline_model_parallel_size.unwrap_or(1),
            context_parallel_size: a.context_parallel_size.unwrap_or(1),
            cp_comm_type: a.cp_comm_type.clone().unwrap_or_default(),
            num_layers_per_virtual_pipeline_stage: a.num_layers_per_virtual_pipeline_stage,
            pipeline_model_parallel_layout: a.pipeline_model_parallel_layout.clone().filter(|l| l != "None"),
            account_for_embedding_in_pipeline_split: a.account_for_embedding_in_pipeline_split,
            account_for_loss_in_pipeline_split: a.account_for_loss_in_pipeline_split,
            decoder_first_pipeline_num_layers: a.decoder_first_pipeline_num_layers,
            decoder_last_pipeline_num_layers: a.decoder_last_pipeline_num_layers,
            recompute_granularity: a.recompute_granularity.clone(),
            recompute_method: a.recompute_method.clone(),
            recompute_num_layers: a.recompute_num_layers,
            lr_decay_iters: a.lr_decay_iters,
            train_samples: a.train_samples,
            lr_warmup_samples: a.lr_warmup_samples,
            lr_decay_samples: a.lr_decay_samples,
            lr_warmup_fraction: a.lr_warmup_fraction,
            adam_eps: a.adam_eps.unwrap_or_else(adam_eps),
            norm_epsilon: a.norm_epsilon.unwrap_or_else(norm_epsilon),
            make_vocab_size_divisible_by: a.make_vocab_size_divisible_by.unwrap_or_else(vocab_divisible_by),
            hidden_dropout: a.hidden_dropout.unwrap_or(0.0) as f32,
            attention_dropout: a.attention_dropout.unwrap_or(0.0) as f32,
            window_size: a.window_size.as_deref().map(parse_window).transpose()?.flatten(),
            window_attn_skip_freq: a.window_attn_skip_freq.clone(),
            // Megatron takes 0 as none.
            mtp_num_layers: a.mtp_num_layers.filter(|&n| n > 0),
            mtp_loss_scaling_factor: a.mtp_loss_scaling_factor.map_or_else(mtp_loss_scaling_factor, |f| f as f32),
            moe: None,
            mamba: None,
            vision: None,
            check_for_nan_in_loss_and_grad: !a.no_check_for_nan_in_loss_and_grad,
        };
        if a.check_for_nan_in_loss_and_grad && a.no_check_for_nan_in_loss_and_grad {
            bail!("--check-for-nan-in-loss-and-grad and --no-check-for-nan-in-loss-and-grad: keep one");
        }
        s.moe = MoeSettings::from_args(&a, s.ffn_hidden_size)?;
        s.mamba = crate::hybrid::MambaSettings::from_args(&a)?;
        s.vision = crate::multimodal::VisionSettings::from_args(
            &a,
            [s.num_layers, s.hidden_size, s.num_attention_heads, s.ffn_hidden_size],
        )?;
        if let Some(m) = &s.mamba {
            // Megatron's: the pattern sets the layer count, over a --num-layers that differs.
            let n = ferrotron_models::hybrid::parse_pattern(&m.hybrid_layer_pattern)
                .map_err(anyhow::Error::msg)?
                .kinds
                .len();
            let given = flags.num_layers.or(file.num_layers);
            if given.is_some_and(|g| g != n) {
                eprintln!(
                    "warning: --hybrid-layer-pattern {} has {n} layers: --num-layers {} is ignored",
                    m.hybrid_layer_pattern, s.num_layers
                );
            }
            s.num_layers = n;
        }
        s.cp_comm_types()?;
        // Megatron's two ways to measure a run, not to be mixed: iterations, or samples (the
        // schedule then in samples as well).
        let warmup_iters_given = file.lr_warmup_iters.or(flags.lr_warmup_iters).is_some();
        if a.step_batch_size_schedule.is_some() {
            if file.global_batch_size.or(flags.global_batch_size).is_some() {
                bail!("--step-batch-size-schedule sets the global batch: drop --global-batch-size");
            }
            if !a.rampup_batch_size.is_empty() {
                bail!("--rampup-batch-size and --step-batch-size-schedule both set the global batch: keep one");
            }
            // Megatron's global batch under a schedule: one micro-batch per data-parallel rank
            // (what evaluation uses); `resolve` sets it once the data-parallel size is known.
            s.global_batch_size = s.micro_batch_size;
        }
        if let Some(n) = a.train_samples {
            if file.train_iters.or(flags.train_iters).is_some() {
                bail!("--train-samples and --train-iters both set the run's length: keep one");
            }
            if a.lr_decay_iters.is_some() || warmup_iters_given || a.lr_wsd_decay_iters.is_some() {
                bail!(
                    "with --train-samples the schedule is in samples too: use --lr-warmup-samples, --lr-decay-samples and --lr-wsd-decay-samples (or --lr-warmup-fraction), not their -iters forms"
                );
            }
            s.train_iters = s.batch_schedule()?.train_iters(n);
            if s.train_iters == 0 {
                bail!("--train-samples {n} is less than one global batch of {}", s.global_batch_size);
            }
            s.lr_warmup_iters = a.lr_warmup_samples.unwrap_or(0) / s.global_batch_size as u64;
        } else if !a.rampup_batch_size.is_empty() || a.step_batch_size_schedule.is_some() {
            bail!(
                "--rampup-batch-size and --step-batch-size-schedule go with --train-samples (a run and its schedule measured in samples, as Megatron's ramp requires)"
            );
        } else if a.lr_warmup_samples.is_some() || a.lr_decay_samples.is_some() || a.lr_wsd_decay_samples.is_some() {
            bail!(
                "--lr-warmup-samples, --lr-decay-samples and --lr-wsd-decay-samples go with --train-samples (with --train-iters: their -iters forms)"
            );
        }
        if let Some(f) = a.lr_warmup_fraction {
            if warmup_iters_given || a.lr_warmup_samples.is_some() {
                bail!(
                    "--lr-warmup-fraction and --lr-warmup-iters / --lr-warmup-samples both set the warm-up: keep one"
                );
            }
            if !(0.0..=1.0).contains(&f) {
                bail!("--lr-warmup-fraction {f} must lie in [0, 1]");
            }
            s.lr_warmup_iters = (f * s.decay_iters() as f64) as u64;
        }
        if a.rope_scaling_factor.is_some() && !a.use_rope_scaling {
            bail!("--rope-scaling-factor takes effect with --use-rope-scaling: add it");
        }
        if a.use_rope_scaling && s.position_embedding_type != "rope" {
            bail!(
                "--use-rope-scaling scales rotary embeddings, but --position-embedding-type is {}: use rope",
                s.position_embedding_type
            );
        }
        if a.fp16 {
            bail!(
                "--fp16: fp16 training with loss scaling is not implemented in Ferrotron; use --bf16 (bf16 parameters and activations, fp32 master weights and grads, no loss scale needed)"
            );
        }
        s.validate()?;
        // Megatron's non-persistent checkpoint of --load, taken when at least as new as the
        // persistent one (not under --ckpt-step, which names a persistent iteration).
        if let Some(l) = a.load.clone()
            && flags.ckpt_step.is_none()
        {
            let np =
                a.non_persistent_global_ckpt_dir.clone().unwrap_or_else(|| l.join(crate::checkpoint::NON_PERSISTENT));
            if let Some(n) = crate::checkpoint::tracked_iteration(&np)? {
                let persistent = crate::checkpoint::tracked_iteration(&l)?;
                if persistent.is_none_or(|p| n >= p) {
                    eprintln!(
                        "--load {}: the non-persistent checkpoint of iteration {n} in {} is the newest; loading it",
                        l.display(),
                        np.display()
                    );
                    a.load = Some(np);
                }
            }
        }
        if let Some(l) = a.load.clone()
            && !crate::checkpoint::holds_checkpoint(&l)?
        {
            a.load = None;
            let why = if a.exit_on_missing_checkpoint {
                Some("--exit-on-missing-checkpoint")
            } else if a.finetune {
                Some("--finetune")
            } else if a.use_checkpoint_opt_param_scheduler {
                Some("--use-checkpoint-opt_param-scheduler")
            } else {
                None
            };
            match why {
                Some(flag) => bail!(
                    "--load {}: holds no checkpoint (no {} there), and {flag} needs one: check the path, or drop --load to start afresh",
                    l.display(),
                    crate::checkpoint::TRACKER
                ),
                None => eprintln!(
                    "warning: --load {}: no checkpoint there yet; starting from the initialisation (--exit-on-missing-checkpoint stops instead)",
                    l.display()
                ),
            }
        }
        let load_mode = match (a.finetune, a.no_load_optim) {
            // Megatron's scripts pass them without --load too (its Mixtral example): nothing to do.
            _ if a.load.is_none() => {
                if a.finetune || a.no_load_optim {
                    eprintln!(
                        "warning: --finetune and --no-load-optim say what --load takes; without --load they do nothing"
                    );
                }
                LoadMode::Resume
            }
            (true, _) => LoadMode::Finetune,
            (false, true) => LoadMode::NoOptim,
            (false, false) => LoadMode::Resume,
        };
        match a.ckpt_format.as_deref() {
            None | Some("torch_dist") => {}
            Some(f) => bail!(
                "--ckpt-format {f}: Ferrotron writes one checkpoint format, sharded like Megatron's torch_dist (any parallel layout loads it; `ferrotron convert` makes Hugging Face files): drop the flag or pass torch_dist"
            ),
        }
        if a.exit_interval == Some(0) {
            bail!("--exit-interval must be at least 1");
        }
        let dist = ferrotron_comm::DistEnv::from_env()?;
        let launch = match (a.nproc, dist.world_size) {
            (Some(0), _) => bail!("--nproc must be at least 1"),
            (Some(n), 1) if n > 1 => Launch::Threads(n),
            (Some(n), w) if n > 1 => bail!(
                "--nproc {n} starts thread ranks, but this process is already rank {} of {w} ({} variables): use one or the other",
                dist.rank,
                dist.source
            ),
            (_, 1) => Launch::Single,
            _ => Launch::Processes(dist.clone()),
        };
        if s.step_batch_size_schedule.is_some() {
            let mp = s.tensor_model_parallel_size * s.pipeline_model_parallel_size * s.context_parallel_size;
            s.global_batch_size = s.micro_batch_size * (launch.world_size() / mp.max(1)).max(1);
        }
        s.validate_layout(launch.world_size())?;
        if a.vocab_file.is_some() || a.merge_file.is_some() {
            ferrotron_data::Tokenizer::new(s.tokenizer()?)?
                .check_gpt2_files(a.vocab_file.as_deref(), a.merge_file.as_deref())?;
        }
        let device = match a.device.as_deref() {
            // Under a launcher, plain `cuda` means this process's local GPU.
            Some("cuda") => ferrotron_core::Device::cuda(dist.local_rank).context("--device cuda")?,
            Some(d) => ferrotron_core::Device::parse(d).with_context(|| format!("--device {d}"))?,
            None => ferrotron_core::Device::Cpu,
        };
        let timeout_s = match (a.distributed_timeout_s, a.distributed_timeout_minutes) {
            (Some(_), Some(_)) => {
                bail!("--distributed-timeout-s and --distributed-timeout-minutes set the same wait: keep one")
            }
            (s, m) => s.or(m.map(|m| m.saturating_mul(60))).unwrap_or(600),
        };
        let timeout = std::time::Duration::from_secs(timeout_s.max(1));
        let profile = profile_range(&a, &device)?;
        let cuda_graph_warmup = cuda_graph(&a, &device, launch.world_size())?;
        if s.vision.is_some() && cuda_graph_warmup.is_some() {
            bail!(
                "--cuda-graph-impl local with a vision encoder (--img-h): each micro-batch's image placements are uploaded from the host, which a captured graph cannot do: drop --cuda-graph-impl"
            );
        }
        let learned_reset = s.reset_position_ids && s.position_embedding_type == "learned_absolute";
        if learned_reset && (s.mtp_num_layers.is_some_and(|n| n > 0) || s.vision.is_some()) {
            bail!(
                "--reset-position-ids with learned positions and {}: its positions are not reset; use --position-embedding-type rope (which takes no position ids) or drop one",
                if s.vision.is_some() {
                    "a vision encoder"
                } else {
                    "--mtp-num-layers (the depths look up shifted positions)"
                }
            );
        }
        if s.reset_attention_mask && s.vision.is_some() {
            bail!(
                "--reset-attention-mask with a vision encoder (--img-h): a multimodal sample holds one image and its caption, with no documents to keep apart; drop --reset-attention-mask"
            );
        }
        if s.reset_attention_mask
            && s.context_parallel_size > 1
            && s.cp_comm_types()?.iter().any(|&k| k != ferrotron_parallel::CpCommType::AllToAll)
        {
            bail!(
                "--reset-attention-mask with --context-parallel-size {} needs --cp-comm-type a2a for every layer (the all-gather splits the keys into blocks the masks would cut): pass --cp-comm-type a2a or drop one",
                s.context_parallel_size
            );
        }
        if s.reset_attention_mask && !device.is_cpu() && !s.bf16 {
            eprintln!(
                "note: --reset-attention-mask in fp32 on the GPU runs attention on the reference kernels (the flash kernels that take document masks are bf16): expect a slower step; --bf16 runs them"
            );
        }
        if learned_reset && cuda_graph_warmup.is_some() {
            bail!(
                "--cuda-graph-impl local with --reset-position-ids: each micro-batch's position ids are uploaded from the host, which a captured graph cannot do: drop one"
            );
        }
        if s.moe.is_some() && cuda_graph_warmup.is_some() {
            bail!(
                "--cuda-graph-impl local with --num-experts: an MoE layer reads its tokens per expert back to the host to size each expert's products, which a captured graph cannot do: drop --cuda-graph-impl"
            );
        }
        let non_persistent = non_persistent(&a)?;
        let metrics = a.metrics_file.or_else(|| a.save.as_ref().map(|d| d.join("metrics.jsonl")));
        let paths = Paths {
            save: a.save,
            load: a.load,
            load_mode,
            metrics,
            progress: !a.no_progress,
            non_persistent,
            exit_interval: a.exit_interval,
            exit_duration: a.exit_duration_in_mins.map(|m| std::time::Duration::from_secs(60 * m)),
            exit_signal: a.exit_signal_handler,
            async_save: a.async_save,
            log_progress: a.log_progress,
            no_save_optim: a.no_save_optim,
            device,
            launch,
            timeout,
            deterministic: a.deterministic_mode,
            fp32_split_k_sums: a.disable_bf16_reduced_precision_matmul,
            profile,
            cuda_graph_warmup,
        };
        if a.use_checkpoint_opt_param_scheduler {
            let Some(load) = &paths.load else {
                bail!("--use-checkpoint-opt_param-scheduler takes the schedule from the checkpoint: add --load FOLDER");
            };
            let ck = crate::checkpoint::read_state(load)
                .with_context(|| format!("--use-checkpoint-opt_param-scheduler reads --load {}", load.display()))?
                .settings;
            s.take_scheduler(&ck);
        }
        Ok((s, paths))
    }

    /// Checks the non-model settings; the model's own checks run in `model_config`.
    /// The learning-rate schedule and weight decay of `ck` (--use-checkpoint-opt_param-scheduler).
    fn take_scheduler(&mut self, ck: &Settings) {
        self.lr = ck.lr;
        self.min_lr = ck.min_lr;
        self.lr_warmup_init = ck.lr_warmup_init;
        self.lr_decay_style = ck.lr_decay_style.clone();
        self.lr_wsd_decay_style = ck.lr_wsd_decay_style.clone();
        self.lr_wsd_decay_iters = ck.lr_wsd_decay_iters;
        self.lr_wsd_decay_samples = ck.lr_wsd_decay_samples;
        self.lr_warmup_iters = ck.lr_warmup_iters;
        self.lr_warmup_fraction = ck.lr_warmup_fraction;
        self.lr_warmup_samples = ck.lr_warmup_samples;
        self.lr_decay_iters = ck.lr_decay_iters;
        self.lr_decay_samples = ck.lr_decay_samples;
        self.weight_decay = ck.weight_decay;
        self.start_weight_decay = ck.start_weight_decay;
        self.end_weight_decay = ck.end_weight_decay;
        self.weight_decay_incr_style = ck.weight_decay_incr_style.clone();
    }

    pub fn validate(&self) -> anyhow::Result<()> {
        self.tokenizer()?;
        self.data_blend(&self.data_path, "--data-path")?;
        self.data_blend(&self.train_data_path, "--train-data-path")?;
        self.data_blend(&self.valid_data_path, "--valid-data-path")?;
        match (self.data_path.is_empty(), self.train_data_path.is_empty(), self.valid_data_path.is_empty()) {
            (_, true, true) => {}
            (true, false, false) => {}
            (false, _, _) => {
                bail!("--data-path and --train-data-path / --valid-data-path are two ways to name the data: give one")
            }
            _ => bail!("--train-data-path and --valid-data-path go together (validation runs every --eval-interval)"),
        }
        if let Some(f) = &self.image_text_data {
            if self.vision.is_none() {
                bail!(
                    "--image-text-data {} trains a vision encoder: add --img-h, --img-w and --patch-dim (or a LLaVA preset)",
                    f.display()
                );
            }
            if self.mock_data || !self.data_path.is_empty() || !self.train_data_path.is_empty() {
                bail!(
                    "--image-text-data {} is the run's data: leave out --mock-data / --data-path / --train-data-path",
                    f.display()
                );
            }
        } else if self.image_folder.is_some() {
            bail!("--image-folder goes with --image-text-data (the folder its image paths are relative to)");
        }
        if self.mock_data && !(self.data_path.is_empty() && self.train_data_path.is_empty()) {
            bail!("--mock-data stands in for a dataset: leave out --data-path / --train-data-path, or --mock-data");
        }
        ferrotron_data::parse_split(&self.split)?;
        if u32::try_from(self.seed).is_err() {
            return Err(ferrotron_data::DataError::BadSeed(self.seed).into());
        }
        self.decay_style()?;
        self.wd_schedule()?;
        let model = self.model_config()?;
        model.validate()?;
        if let Some(v) = self.vision_spec()? {
            v.validate(model.vocab_size)?;
            self.text_seq_length()?;
        }
        for (v, flag) in [
            (self.micro_batch_size as u64, "--micro-batch-size"),
            (self.train_iters, "--train-iters"),
            (self.log_interval, "--log-interval"),
            (self.eval_interval, "--eval-interval"),
            (self.save_interval, "--save-interval"),
        ] {
            if v == 0 {
                bail!("{flag} must be at least 1");
            }
        }
        if self.global_batch_size == 0 || self.global_batch_size % self.micro_batch_size != 0 {
            bail!(
                "--global-batch-size {} is not a multiple of --micro-batch-size {}: make it a multiple",
                self.global_batch_size,
                self.micro_batch_size
            );
        }
        if self.lr.is_nan() || self.lr <= 0.0 || self.min_lr < 0.0 || self.min_lr > self.lr {
            bail!("--lr {} and --min-lr {} must satisfy 0 <= min-lr <= lr and lr > 0", self.lr, self.min_lr);
        }
        if !(self.lr_warmup_init >= 0.0 && self.lr_warmup_init <= self.lr) {
            bail!("--lr-warmup-init {} must satisfy 0 <= lr-warmup-init <= lr ({})", self.lr_warmup_init, self.lr);
        }
        match (self.decoupled_lr, self.decoupled_min_lr) {
            (None, Some(m)) => bail!(
                "--decoupled-min-lr {m} is what --decoupled-lr decays to: add --decoupled-lr, or drop it (the embedding and output layer then follow --lr)"
            ),
            (Some(lr), min) => {
                let (min, from) = match min {
                    Some(m) => (m, "--decoupled-min-lr"),
                    None => (self.min_lr, "--min-lr"),
                };
                if !(lr.is_finite() && min >= 0.0 && min <= lr) {
                    bail!(
                        "--decoupled-lr {lr} decays to {from} {min}: they must satisfy 0 <= {min} <= {lr} (give --decoupled-min-lr at most --decoupled-lr)"
                    );
                }
            }
            (None, None) => {}
        }
        if !(0.0..1.0).contains(&self.adam_beta1) || !(0.0..1.0).contains(&self.adam_beta2) {
            bail!("--adam-beta1 and --adam-beta2 must lie in [0, 1)");
        }
        if self.grad_reduce_in_bf16 && !self.bf16 {
            bail!(
                "--grad-reduce-in-bf16 keeps bf16 training's gradients in bf16: add --bf16 (fp32 training keeps fp32 gradients)"
            );
        }
        if self.overlap_param_gather && !self.use_distributed_optimizer {
            bail!(
                "--overlap-param-gather overlaps the distributed optimizer's gathers: add --use-distributed-optimizer"
            );
        }
        let positive = |x: f64| x.is_finite() && x > 0.0;
        if !positive(self.adam_eps as f64) || !positive(self.norm_epsilon) {
            bail!("--adam-eps {} and --norm-epsilon {} must be positive", self.adam_eps, self.norm_epsilon);
        }
        if self.lr_decay_iters == Some(0) {
            bail!("--lr-decay-iters must be at least 1 (or leave it out: --train-iters)");
        }
        Ok(())
    }

    /// Iterations the learning rate decays over: --lr-decay-iters, else --train-iters.
    pub fn decay_iters(&self) -> u64 {
        self.lr_decay_iters.unwrap_or(self.train_iters)
    }

    /// The schedule's (warmup, decay, WSD fall) in samples, as Megatron's scheduler counts them:
    /// the decay --lr-decay-samples, else --train-samples, else decay_iters global batches; the
    /// warmup a fraction of that, or --lr-warmup-samples, or --lr-warmup-iters global batches;
    /// WSD's fall --lr-wsd-decay-samples or --lr-wsd-decay-iters global batches.
    /// The optimizer's update rule (--optimizer, --sgd-momentum).
    pub fn algorithm(&self) -> ferrotron_optim::Algorithm {
        match self.optimizer.as_str() {
            "sgd" => ferrotron_optim::Algorithm::Sgd { momentum: self.sgd_momentum },
            _ => ferrotron_optim::Algorithm::AdamW,
        }
    }

    pub fn schedule_samples(&self) -> (f64, f64, f64) {
        let gbs = self.global_batch_size as f64;
        let decay = match (self.lr_decay_samples, self.train_samples) {
            (Some(d), _) | (None, Some(d)) => d as f64,
            (None, None) => self.decay_iters() as f64 * gbs,
        };
        let warmup = match (self.lr_warmup_fraction, self.lr_warmup_samples) {
            (Some(f), _) => f * decay,
            (None, Some(w)) => w as f64,
            (None, None) => self.lr_warmup_iters as f64 * gbs,
        };
        let wsd = match (self.lr_wsd_decay_samples, self.lr_wsd_decay_iters) {
            (Some(w), _) => w as f64,
            (None, Some(w)) => w as f64 * gbs,
            (None, None) => 0.0,
        };
        (warmup, decay, wsd)
    }

    /// Model chunks per pipeline rank (interleaving), from --num-layers-per-virtual-pipeline-stage.
    pub fn virtual_stages(&self) -> anyhow::Result<usize> {
        let pp = self.pipeline_model_parallel_size;
        if let Some(l) = self.pipeline_layout()? {
            return Ok(l.virtual_stages(pp)?);
        }
        if let Some(stages) = self.pattern_stages()? {
            // Megatron's: the pattern's segments are the stages, pp × (virtual stages) of them.
            if self.num_layers_per_virtual_pipeline_stage.is_some() {
                bail!(
                    "--hybrid-layer-pattern marks the pipeline stages with '|': drop --num-layers-per-virtual-pipeline-stage (the segments give the virtual stages)"
                );
            }
            if stages.len() % pp != 0 {
                bail!(
                    "--hybrid-layer-pattern has {} pipeline segments, not a multiple of --pipeline-model-parallel-size {pp}: mark pp × (virtual stages) segments with '|'",
                    stages.len()
                );
            }
            return Ok(stages.len() / pp);
        }
        let Some(n) = self.num_layers_per_virtual_pipeline_stage else { return Ok(1) };
        let layers = self.split_layers();
        if n == 0 || layers % (pp * n) != 0 {
            bail!(
                "--num-layers-per-virtual-pipeline-stage {n} does not divide --num-layers {}{} over --pipeline-model-parallel-size {pp}: pick a count that divides num-layers / pp",
                self.num_layers,
                self.accounted().map_or(String::new(), |(flags, _, _)| format!(" (counted as {layers} under {flags})"))
            );
        }
        Ok(layers / (pp * n))
    }

    pub fn recompute(&self) -> anyhow::Result<ferrotron_transformer::Recompute> {
        ferrotron_transformer::Recompute::parse(
            self.recompute_granularity.as_deref(),
            self.recompute_method.as_deref(),
            self.recompute_num_layers,
        )
        .map_err(|e| anyhow::anyhow!(e))
    }

    /// Layers per pipeline stage when the hybrid pattern marks them with '|'.
    fn pattern_stages(&self) -> anyhow::Result<Option<Vec<usize>>> {
        let Some(m) = &self.mamba else { return Ok(None) };
        let p = ferrotron_models::hybrid::parse_pattern(&m.hybrid_layer_pattern).map_err(anyhow::Error::msg)?;
        Ok(p.stages)
    }

    /// The layers the split over the stages counts: --num-layers, one more for the embedding and
    /// for the loss where --account-for-embedding/loss-in-pipeline-split counts them.
    fn split_layers(&self) -> usize {
        self.num_layers
            + self.account_for_embedding_in_pipeline_split as usize
            + self.account_for_loss_in_pipeline_split as usize
    }

    /// The --account-for-…-in-pipeline-split flags given (their names), and which, or None.
    fn accounted(&self) -> Option<(String, bool, bool)> {
        let (e, l) = (self.account_for_embedding_in_pipeline_split, self.account_for_loss_in_pipeline_split);
        let names = [("--account-for-embedding-in-pipeline-split", e), ("--account-for-loss-in-pipeline-split", l)];
        let given: Vec<&str> = names.iter().filter(|(_, on)| *on).map(|(n, _)| *n).collect();
        (!given.is_empty()).then(|| (given.join(" and "), e, l))
    }

    /// Every stage's decoder layers under --account-for-embedding/loss-in-pipeline-split: the
    /// counted layers split evenly over the pp × vpp stages, the first (last) holding one fewer
    /// for the embedding (loss), as Megatron splits them.
    fn accounted_stages(&self, flags: &str, e: bool, l: bool) -> anyhow::Result<Vec<usize>> {
        if self.decoder_first_pipeline_num_layers.is_some() || self.decoder_last_pipeline_num_layers.is_some() {
            bail!(
                "{flags} counts the embedding or loss into an even split, which --decoder-first/last-pipeline-num-layers replace: give one of them"
            );
        }
        let n = self.pipeline_model_parallel_size * self.virtual_stages()?;
        let layers = self.split_layers();
        if layers % n != 0 {
            bail!(
                "--num-layers {} counted as {layers} under {flags} does not divide over {n} pipeline stages: change --num-layers or the stages",
                self.num_layers
            );
        }
        let mut sizes = vec![layers / n; n];
        sizes[0] -= e as usize;
        if sizes[n - 1] < l as usize {
            bail!("{flags} on one stage of one layer leaves it no decoder layer for the loss's: add layers or stages");
        }
        sizes[n - 1] -= l as usize;
        Ok(sizes)
    }

    /// --pipeline-model-parallel-layout parsed and checked against the model and the other
    /// stage flags, or None without one.
    pub fn pipeline_layout(&self) -> anyhow::Result<Option<ferrotron_parallel::pipeline::PipelineLayout>> {
        let Some(layout) = &self.pipeline_model_parallel_layout else { return Ok(None) };
        let other = [
            ("--decoder-first-pipeline-num-layers", self.decoder_first_pipeline_num_layers.is_some()),
            ("--decoder-last-pipeline-num-layers", self.decoder_last_pipeline_num_layers.is_some()),
            (
                "--num-layers-per-virtual-pipeline-stage (or --num-virtual-stages-per-pipeline-rank)",
                self.num_layers_per_virtual_pipeline_stage.is_some(),
            ),
            ("a hybrid model (its pattern's '|' marks the stages)", self.mamba.is_some()),
            ("--account-for-embedding/loss-in-pipeline-split", self.accounted().is_some()),
        ];
        if let Some((flag, _)) = other.iter().find(|(_, on)| *on) {
            bail!("--pipeline-model-parallel-layout {layout} places every layer, and so does {flag}: give one of them");
        }
        let mtp = self.mtp_num_layers.unwrap_or(0);
        Ok(Some(ferrotron_parallel::pipeline::PipelineLayout::parse(layout, self.num_layers, mtp)?))
    }

    /// The layers of every pipeline rank, checked (errors name the flags).
    pub fn stage_plan(&self, pp_rank: usize) -> anyhow::Result<ferrotron_parallel::pipeline::StagePlan> {
        let (pp, vpp) = (self.pipeline_model_parallel_size, self.virtual_stages()?);
        if let Some(l) = self.pipeline_layout()? {
            return Ok(l.plan(pp, pp_rank)?);
        }
        if let Some((flags, e, l)) = self.accounted() {
            if self.mamba.is_some() {
                bail!("{flags} with a hybrid model: its pattern's '|' marks the stages; drop {flags}");
            }
            let sizes = self.accounted_stages(&flags, e, l)?;
            return Ok(ferrotron_parallel::pipeline::stage_layers_of(&sizes, pp, pp_rank)?);
        }
        if let Some(stages) = self.pattern_stages()? {
            if self.decoder_first_pipeline_num_layers.is_some() || self.decoder_last_pipeline_num_layers.is_some() {
                bail!(
                    "--hybrid-layer-pattern marks the pipeline stages with '|': drop --decoder-first/last-pipeline-num-layers"
                );
            }
            return Ok(ferrotron_parallel::pipeline::stage_layers_sized(&stages, pp, vpp, pp_rank)?);
        }
        Ok(ferrotron_parallel::pipeline::stage_layers(
            self.num_layers,
            self.pipeline_model_parallel_size,
            self.virtual_stages()?,
            pp_rank,
            self.decoder_first_pipeline_num_layers,
            self.decoder_last_pipeline_num_layers,
        )?)
    }

    /// The parallel layout on `world` ranks, checked against the model and the batch sizes.
    pub fn validate_layout(&self, world: usize) -> anyhow::Result<ferrotron_parallel::Layout> {
        let tp = self.tensor_model_parallel_size;
        let pp = self.pipeline_model_parallel_size;
        let ep = self.moe.as_ref().map_or(1, |m| m.expert_model_parallel_size);
        let etp = self.moe.as_ref().and_then(|m| m.expert_tensor_parallel_size).unwrap_or(tp);
        let cp = self.context_parallel_size;
        let layout = ferrotron_parallel::Layout::with_expert_tp(world, tp, pp, cp, ep, etp)?;
        if cp > 1 {
            self.validate_cp(cp)?;
        }
        self.recompute()?;
        self.stage_plan(0)?;
        let v = self.virtual_stages()?;
        let config = self.model_config()?;
        config.validate_tp(tp)?;
        config.validate()?;
        self.validate_fp8()?;
        if pp > 1 && self.mtp_num_layers.is_some() && config.position_embedding == PositionEmbedding::LearnedAbsolute {
            bail!(
                "--mtp-num-layers with learned absolute position embeddings needs the whole model on one pipeline stage (the depths look up positions on the last): use --position-embedding-type rope, or --pipeline-model-parallel-size 1"
            );
        }
        let per_step = self.micro_batch_size * layout.dp;
        let schedule = self.batch_schedule()?;
        // Every global batch the run will take (the ramp's or the steps' too), checked now
        // rather than when training reaches it.
        for size in std::iter::once(self.global_batch_size as u64).chain(schedule.sizes()) {
            let flag = match schedule {
                BatchSchedule::Constant(_) => "--global-batch-size",
                _ if size == self.global_batch_size as u64 => "--global-batch-size",
                BatchSchedule::Rampup { .. } => "a global batch of --rampup-batch-size",
                BatchSchedule::Steps(_) => "a global batch of --step-batch-size-schedule",
            };
            if size % per_step as u64 != 0 {
                bail!(
                    "{flag} {size} is not a multiple of --micro-batch-size {} × data-parallel size {}: make it a multiple of {per_step}",
                    self.micro_batch_size,
                    layout.dp
                );
            }
            if v > 1 {
                let kind = ferrotron_parallel::pipeline::ScheduleKind::Interleaved { chunks: v };
                ferrotron_parallel::pipeline::schedule(kind, pp, 0, (size as usize / per_step).max(1))
                    .with_context(|| format!("{flag} {size}"))?;
            }
        }
        if self.sequence_parallel && tp > 1 && (self.seq_length / cp) % tp != 0 {
            bail!(
                "--sequence-parallel splits --seq-length {} (over --context-parallel-size {cp}) over --tensor-model-parallel-size {tp}: make the length a multiple of {}",
                self.seq_length,
                cp * tp
            );
        }
        Ok(layout)
    }

    /// What context parallelism over `cp` > 1 ranks needs of the run (errors name the flags).
    /// Each layer's context-parallel exchange (--cp-comm-type: one for all, or one a layer in
    /// order; Megatron's default p2p passes key/value blocks round a ring, and the all-gather
    /// here gives the same attention, so scripts that name p2p run).
    /// --fp8-format as the kernels take it and, under --fp8-recipe delayed, delayed scaling's
    /// settings (None: no FP8).
    pub fn fp8(&self) -> anyhow::Result<Option<(ferrotron_kernels::Fp8Format, Option<DelayedScaling>)>> {
        let Some(f) = &self.fp8_format else { return Ok(None) };
        let format = ferrotron_kernels::Fp8Format::parse(f)
            .ok_or_else(|| anyhow::anyhow!("--fp8-format {f}: the formats are e4m3 and hybrid"))?;
        let delayed = match self.fp8_recipe.as_str() {
            "tensorwise" => None,
            "delayed" => {
                let algo = AmaxAlgo::parse(&self.fp8_amax_compute_algo).ok_or_else(|| {
                    anyhow::anyhow!(
                        "--fp8-amax-compute-algo {}: the choices are most_recent and max",
                        self.fp8_amax_compute_algo
                    )
                })?;
                Some(DelayedScaling { history_len: self.fp8_amax_history_len, algo, margin: self.fp8_margin })
            }
            r => bail!("--fp8-recipe {r}: the recipes built are delayed and tensorwise"),
        };
        Ok(Some((format, delayed)))
    }

    /// FP8 products need each rank's linear layers' widths to be multiples of 16 (cuBLASLt's FP8
    /// alignment; rows are padded inside) and a model whose layers have FP8 products.
    fn validate_fp8(&self) -> anyhow::Result<()> {
        let Some(f) = &self.fp8_format else { return Ok(()) };
        if self.vision.is_some() {
            bail!(
                "--fp8-format {f}: multimodal models (--img-h) have no FP8 products yet; train in bf16 (drop --fp8-format)"
            );
        }
        let tp = self.tensor_model_parallel_size;
        let config = self.model_config()?;
        let head = config.head_dim();
        let gate = if config.layer.attention.output_gate { config.num_attention_heads } else { 0 };
        let qkv = (config.num_attention_heads + gate + 2 * config.num_query_groups) * head;
        let mut widths = vec![("--hidden-size", config.hidden_size)];
        let ffn = config.ffn_hidden_size;
        let dense = |a: &Activation| {
            [
                ("--ffn-hidden-size / --tensor-model-parallel-size", ffn / tp),
                (
                    "fc1's width (--ffn-hidden-size, × 2 for SwiGLU) / --tensor-model-parallel-size",
                    a.fc1_blocks() * ffn / tp,
                ),
            ]
        };
        if let MlpSpec::Dense { activation, .. } = &config.layer.mlp {
            widths.extend(dense(activation));
        }
        if let Some(m) = ferrotron_models::moe_spec(&config) {
            // Whole experts (--expert-tensor-parallel-size 1) or split as the dense MLPs.
            let etp = self.moe.as_ref().and_then(|m| m.expert_tensor_parallel_size).unwrap_or(tp);
            let (expert, blocks) = (m.ffn_hidden_size, m.activation.fc1_blocks());
            widths.extend([
                ("--moe-ffn-hidden-size / --expert-tensor-parallel-size", expert / etp),
                ("an expert's fc1 width (× 2 for SwiGLU) / --expert-tensor-parallel-size", blocks * expert / etp),
            ]);
            if let Some(f) = m.shared_expert_ffn {
                widths.extend([
                    ("--moe-shared-expert-intermediate-size / --tensor-model-parallel-size", f / tp),
                    ("the shared experts' fc1 width (× 2 for SwiGLU) / --tensor-model-parallel-size", blocks * f / tp),
                ]);
            }
            if let Some(MlpSpec::Dense { activation, .. }) = config.layer.other_mlp.as_ref().map(|o| &o.mlp) {
                widths.extend(dense(activation));
            }
        }
        if let Some(m) = &config.layer.attention.mla {
            let heads = config.num_attention_heads / tp;
            let (qk, pos, v) = (m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim);
            widths.extend(m.q_lora_rank.map(|r| ("--q-lora-rank", r)));
            widths.extend([
                ("--kv-lora-rank", m.kv_lora_rank),
                ("--kv-lora-rank + --qk-pos-emb-head-dim", m.kv_lora_rank + pos),
                ("heads × (--qk-head-dim + --qk-pos-emb-head-dim) / --tensor-model-parallel-size", heads * (qk + pos)),
                ("heads × (--qk-head-dim + --v-head-dim) / --tensor-model-parallel-size", heads * (qk + v)),
                ("heads × --v-head-dim / --tensor-model-parallel-size", heads * v),
            ]);
        } else {
            widths.extend([
                ("the QKV projection's width / --tensor-model-parallel-size", qkv / tp),
                ("heads × head dim / --tensor-model-parallel-size", config.num_attention_heads * head / tp),
            ]);
        }
        if let Some(m) = ferrotron_models::hybrid::mamba_spec(&config) {
            // in_proj's z | xBC | dt blocks and out_proj, each an FP8 product on this rank's heads.
            let d = m.dims(config.hidden_size).map_err(anyhow::Error::msg)?;
            widths.extend([
                ("the Mamba width (--mamba-num-heads × --mamba-head-dim) / --tensor-model-parallel-size", d.d_inner / tp),
                (
                    "the Mamba convolution's width (the Mamba width + 2 × --mamba-num-groups × --mamba-state-dim) / --tensor-model-parallel-size",
                    d.conv_dim() / tp,
                ),
                ("--mamba-num-heads / --tensor-model-parallel-size", d.heads / tp),
            ]);
        }
        for (what, n) in widths {
            if n % 16 != 0 {
                bail!(
                    "--fp8-format {f}: {what} is {n}, and FP8 products need multiples of 16 (cuBLASLt's FP8 alignment): pick sizes that give one, or drop --fp8-format"
                );
            }
        }
        Ok(())
    }

    pub fn cp_comm_types(&self) -> anyhow::Result<Vec<ferrotron_parallel::CpCommType>> {
        let kinds = self
            .cp_comm_type
            .iter()
            .map(|t| ferrotron_parallel::CpCommType::parse(t).map_err(anyhow::Error::msg))
            .collect::<anyhow::Result<Vec<_>>>()?;
        match kinds.len() {
            0 => Ok(vec![Default::default(); self.num_layers]),
            1 => Ok(vec![kinds[0]; self.num_layers]),
            n if n == self.num_layers => Ok(kinds),
            n => bail!(
                "--cp-comm-type lists {n} types for {} layers: give one for every layer, or one a layer",
                self.num_layers
            ),
        }
    }

    fn validate_cp(&self, cp: usize) -> anyhow::Result<()> {
        if self.seq_length % (2 * cp) != 0 {
            bail!(
                "--context-parallel-size {cp} cuts each sequence into 2 × {cp} chunks: --seq-length {} is not a multiple of {}",
                self.seq_length,
                2 * cp
            );
        }
        if self.vision.is_some() {
            bail!(
                "--context-parallel-size {cp} with a vision encoder (--img-h): multimodal sequences are not split over context-parallel ranks yet; drop one"
            );
        }
        if let Some(m) = ferrotron_models::hybrid::mamba_spec(&self.model_config()?) {
            m.validate_cp(self.tensor_model_parallel_size, cp).map_err(anyhow::Error::msg)?;
        }
        if self.mtp_num_layers.is_some()
            && self.model_config()?.position_embedding == PositionEmbedding::LearnedAbsolute
        {
            bail!(
                "--context-parallel-size {cp} with --mtp-num-layers and learned absolute position embeddings: the depths' positions are not split over context-parallel ranks; use --position-embedding-type rope, or drop one"
            );
        }
        let kinds = self.cp_comm_types()?;
        let config = self.model_config()?;
        let attends = |i: usize| !matches!(config.layer.kind_of(i), LayerKind::Mixer | LayerKind::Mlp);
        let gathered =
            kinds.iter().enumerate().any(|(i, &k)| k == ferrotron_parallel::CpCommType::AllGather && attends(i))
                || (self.mtp_num_layers.is_some() && kinds[0] == ferrotron_parallel::CpCommType::AllGather);
        if self.window_size.is_some() && gathered {
            bail!(
                "--context-parallel-size {cp} with --window-size: the all-gather exchange does not split sliding-window attention; use --cp-comm-type a2a (in every layer) or drop one"
            );
        }
        if kinds.contains(&ferrotron_parallel::CpCommType::AllToAll) {
            let tp = self.tensor_model_parallel_size;
            let heads = self.num_attention_heads / tp;
            let groups = if config.layer.attention.mla.is_some() { heads } else { self.num_query_groups / tp };
            if heads % cp != 0 || groups % cp != 0 {
                bail!(
                    "--cp-comm-type a2a gives each of the --context-parallel-size {cp} ranks 1/{cp} of a tensor-parallel rank's heads: its {heads} attention heads and {groups} query groups must both be multiples of {cp}; use --cp-comm-type allgather or another context-parallel size"
                );
            }
        }
        if gathered && self.attention_dropout > 0.0 && (self.seq_length / (2 * cp)) % 16 != 0 {
            bail!(
                "--attention-dropout with --context-parallel-size {cp}: each rank's chunks must be a multiple of 16 tokens to draw the whole sequence's mask (they are {}): make --seq-length a multiple of {}",
                self.seq_length / (2 * cp),
                32 * cp
            );
        }
        Ok(())
    }

    /// The tokenizer the run's data is read with.
    pub fn tokenizer(&self) -> anyhow::Result<TokenizerKind> {
        let kind = self.tokenizer_kind()?;
        // Megatron's mock sequences are ids already: they go with any tokenizer.
        let tokenized = !self.data_path.is_empty() || !self.train_data_path.is_empty() || self.mock_data;
        if matches!(kind, TokenizerKind::Null(_)) && !tokenized {
            bail!(
                "--tokenizer-type NullTokenizer reads data tokenized elsewhere: give it with --data-path or --mock-data (the built-in corpus is text)"
            );
        }
        Ok(kind)
    }

    /// The tokenizer the flags name, whatever the data (the model's vocabulary needs no data).
    fn tokenizer_kind(&self) -> anyhow::Result<TokenizerKind> {
        let flags = TokenizerFlags {
            vocab_size: self.vocab_size,
            model: self.tokenizer_model.as_deref(),
            tiktoken_pattern: self.tiktoken_pattern.as_deref(),
            tiktoken_num_special_tokens: self.tiktoken_num_special_tokens,
            tiktoken_special_tokens: self.tiktoken_special_tokens.as_deref(),
        };
        TokenizerKind::from_flags(&self.tokenizer_type, &flags)
            .map_err(|e| anyhow::anyhow!("--tokenizer-type {}: {e}", self.tokenizer_type))
    }

    /// A data-path flag's values as (weight, prefix) pairs, Megatron's two spellings: prefixes
    /// alone (weight None: each by its size) or weight-prefix pairs.
    pub fn data_blend(&self, d: &[String], flag: &str) -> anyhow::Result<Vec<(Option<f64>, PathBuf)>> {
        let weighted = d.len() % 2 == 0 && d.iter().step_by(2).all(|w| w.parse::<f64>().is_ok());
        if !weighted {
            if let Some(w) = d.iter().find(|x| x.parse::<f64>().is_ok()) {
                bail!(
                    "{flag} {}: `{w}` reads as a weight, but not every prefix has one: write `W1 PREFIX1 W2 PREFIX2 …` or prefixes alone",
                    d.join(" ")
                );
            }
            return Ok(d.iter().map(|p| (None, PathBuf::from(p))).collect());
        }
        d.chunks(2)
            .map(|c| {
                let w: f64 = c[0].parse()?;
                if !w.is_finite() || w <= 0.0 {
                    bail!("{flag}: weight {w} of {} must be a positive number (leave out a dataset not to use)", c[1]);
                }
                Ok((Some(w), PathBuf::from(&c[1])))
            })
            .collect()
    }

    /// The weight decay over the run (Megatron's: constant at --weight-decay, or from
    /// --start-weight-decay to --end-weight-decay over the run's samples).
    pub fn wd_schedule(&self) -> anyhow::Result<WdSchedule> {
        let name = self.weight_decay_incr_style.as_deref().unwrap_or("constant");
        let Some(style) = WdStyle::parse(name) else {
            bail!("--weight-decay-incr-style {name}: use constant, linear or cosine");
        };
        let incr = match self.train_samples {
            Some(n) => n as f64,
            None => self.train_iters as f64 * self.global_batch_size as f64,
        };
        match (style, self.start_weight_decay, self.end_weight_decay) {
            (WdStyle::Constant, None, None) => {
                let wd = self.weight_decay as f64;
                Ok(WdSchedule { start: wd, end: wd, incr, style })
            }
            (WdStyle::Constant, ..) => bail!(
                "--start-weight-decay / --end-weight-decay move the weight decay over the run: add --weight-decay-incr-style linear or cosine (constant keeps --weight-decay)"
            ),
            (_, Some(start), Some(end)) => Ok(WdSchedule { start: start as f64, end: end as f64, incr, style }),
            _ => bail!("--weight-decay-incr-style {name} needs both --start-weight-decay and --end-weight-decay"),
        }
    }

    pub fn decay_style(&self) -> anyhow::Result<DecayStyle> {
        let wsd = self.lr_wsd_decay_style.as_deref().unwrap_or("exponential");
        let style = DecayStyle::parse(&self.lr_decay_style, wsd).with_context(|| {
            format!(
                "--lr-decay-style {} (--lr-wsd-decay-style {wsd}): use constant, linear, cosine, inverse-square-root or WSD; WSD's fall exponential, linear, cosine or minus_sqrt",
                self.lr_decay_style
            )
        })?;
        if matches!(style, DecayStyle::Wsd(_)) && self.lr_wsd_decay_iters.or(self.lr_wsd_decay_samples).is_none() {
            bail!("--lr-decay-style WSD needs the length of its final fall: --lr-wsd-decay-iters (or -samples)");
        }
        Ok(style)
    }

    /// The samples a Megatron run of these settings asks of its train and valid splits:
    /// --train-samples or train_iters · global batch, and eval_iters global batches per evaluation, one evaluation
    /// every eval_interval iterations and one more.
    pub fn split_samples(&self) -> [u64; 2] {
        let gbs = self.global_batch_size as u64;
        let train = self.train_samples.unwrap_or(self.train_iters * gbs);
        [train, (self.train_iters / self.eval_interval.max(1) + 1) * self.eval_iters * gbs]
    }

    pub fn num_micro_batches(&self) -> usize {
        self.global_batch_size / self.micro_batch_size
    }

    /// The global batch as training goes on (constant, ramped or stepped).
    pub fn batch_schedule(&self) -> anyhow::Result<BatchSchedule> {
        if let Some(t) = &self.step_batch_size_schedule {
            return BatchSchedule::steps(t, self.seq_length as u64);
        }
        if !self.rampup_batch_size.is_empty() {
            return BatchSchedule::rampup(&self.rampup_batch_size, self.global_batch_size as u64);
        }
        Ok(BatchSchedule::Constant(self.global_batch_size as u64))
    }

    /// A multimodal run's vision encoder and projection (None: text only).
    pub fn vision_spec(&self) -> anyhow::Result<Option<ferrotron_transformer::VisionSpec>> {
        let Some(v) = &self.vision else { return Ok(None) };
        let vocab = ferrotron_data::Tokenizer::new(self.tokenizer_kind()?)?.vocab_size();
        Ok(Some(v.spec(self.hidden_size, vocab, self.init_method_std)))
    }

    /// Text tokens a sample: --seq-length, less a multimodal sample's image placeholders.
    pub fn text_seq_length(&self) -> anyhow::Result<usize> {
        let Some(v) = self.vision_spec()? else { return Ok(self.seq_length) };
        let n = v.image_tokens();
        if self.seq_length <= n {
            bail!(
                "--seq-length {} leaves no text after an image's {n} placeholder tokens: raise --seq-length past {n} (or use smaller images / larger patches)",
                self.seq_length
            );
        }
        Ok(self.seq_length - n)
    }

    pub fn model_config(&self) -> anyhow::Result<TransformerConfig> {
        if self.rotary_interleaved && self.position_embedding_type != "rope" {
            bail!(
                "--rotary-interleaved lays out rotary pairs, but --position-embedding-type is {}: use rope, or drop the flag",
                self.position_embedding_type
            );
        }
        if let Some(f) = self.rotary_seq_len_interpolation_factor.filter(|_| self.position_embedding_type != "rope") {
            bail!(
                "--rotary-seq-len-interpolation-factor {f} interpolates rotary positions, but --position-embedding-type is {}: use rope, or drop the factor",
                self.position_embedding_type
            );
        }
        let position_embedding = match self.position_embedding_type.as_str() {
            "learned_absolute" => PositionEmbedding::LearnedAbsolute,
            "rope" => PositionEmbedding::Rope {
                base: self.rotary_base,
                scaling: self.use_rope_scaling.then(|| RopeScaling::llama3(self.rope_scaling_factor)),
                percent: self.rotary_percent,
                interpolation: self.rotary_seq_len_interpolation_factor,
                interleaved: self.rotary_interleaved,
            },
            "none" => PositionEmbedding::None,
            o => bail!("--position-embedding-type {o}: use learned_absolute, rope or none"),
        };
        let softmax = match self.softmax_type.as_str() {
            "vanilla" => SoftmaxType::Vanilla,
            "off-by-one" => SoftmaxType::OffByOne,
            "learnable" => SoftmaxType::Learnable,
            o => bail!("--softmax-type {o}: use vanilla, off-by-one or learnable"),
        };
        let norm = match self.normalization.as_str() {
            "LayerNorm" => NormKind::LayerNorm,
            "RMSNorm" => NormKind::RmsNorm,
            o => bail!("--normalization {o}: use LayerNorm or RMSNorm"),
        };
        let mut vocab = ferrotron_data::Tokenizer::new(self.tokenizer_kind()?)?.vocab_size();
        if let Some(v) = &self.vision {
            vocab = v.model_vocab(vocab);
        }
        let activation = match (self.swiglu, self.squared_relu, self.quick_geglu) {
            (true, false, false) => Activation::SwiGlu,
            (false, true, false) => Activation::SquaredRelu,
            (false, false, true) => Activation::QuickGeGlu(GluParams {
                offset: self.glu_linear_offset,
                clamp: self.activation_func_clamp_value,
            }),
            (false, false, false) if self.gelu_exact => Activation::GeluExact,
            (false, false, false) => Activation::Gelu,
            _ => bail!("--swiglu, --squared-relu and --quick-geglu each pick the MLP's activation: keep one"),
        };
        if !self.quick_geglu && (self.glu_linear_offset != 0.0 || self.activation_func_clamp_value.is_some()) {
            bail!(
                "--glu-linear-offset and --activation-func-clamp-value shape --quick-geglu's gated unit (gpt-oss's); add it or drop them"
            );
        }
        if let Some(c) = self.activation_func_clamp_value.filter(|c| !(c.is_finite() && *c > 0.0)) {
            bail!("--activation-func-clamp-value {c}: give a positive bound (gpt-oss: 7.0)");
        }
        let bias = !self.disable_bias_linear;
        let dense = MlpSpec::Dense { activation, bias };
        let (mlp, other_mlp) = match &self.moe {
            Some(m) => {
                let other = match &m.moe_layer_freq {
                    Some(f) => {
                        let moe = crate::layer_freq::parse(f, self.num_layers)?;
                        Some(OtherMlp { mlp: dense.clone(), layers: moe.iter().map(|&m| !m).collect() })
                    }
                    None => None,
                };
                (MlpSpec::Custom(Arc::new(m.spec(activation, bias)?)), other)
            }
            None => (dense.clone(), None),
        };
        let mut c = TransformerConfig {
            num_layers: self.num_layers,
            hidden_size: self.hidden_size,
            num_attention_heads: self.num_attention_heads,
            num_query_groups: self.num_query_groups,
            kv_channels: self.kv_channels,
            ffn_hidden_size: self.ffn_hidden_size,
            seq_length: self.seq_length,
            max_position_embeddings: self.max_position_embeddings,
            vocab_size: vocab,
            make_vocab_size_divisible_by: self.make_vocab_size_divisible_by,
            position_embedding,
            untie_embeddings_and_output_weights: self.untie_embeddings_and_output_weights,
            layer: LayerSpec {
                norm,
                zero_centred_gamma: self.apply_layernorm_1p,
                attention: AttentionSpec {
                    bias: !self.disable_bias_linear,
                    qkv_bias: self.add_qkv_bias,
                    qk_layernorm: self.qk_layernorm,
                    qk_l2_norm: self.qk_l2_norm,
                    output_gate: self.attention_output_gate,
                    softmax,
                    // The mask keeps |i − j| < w: the token itself and the `left` before it.
                    window: self.window_size.map(|left| left + 1),
                    causal: true,
                    mla: self.mla.map(|m| MlaSpec {
                        q_lora_rank: m.q_lora_rank,
                        kv_lora_rank: m.kv_lora_rank,
                        qk_head_dim: m.qk_head_dim,
                        qk_pos_emb_head_dim: m.qk_pos_emb_head_dim,
                        v_head_dim: m.v_head_dim,
                        yarn: m.yarn.map(|y| y.yarn()),
                    }),
                },
                mlp,
                other_mlp,
                hybrid: None,
                window_layers: self
                    .window_attn_skip_freq
                    .as_deref()
                    .map(|f| crate::layer_freq::window_layers(f, self.num_layers))
                    .transpose()?,
            },
            norm_epsilon: self.norm_epsilon,
            init_method_std: self.init_method_std,
            embedding_init_method_std: self.embedding_init_method_std,
            hidden_dropout: self.hidden_dropout,
            attention_dropout: self.attention_dropout,
            mtp: self
                .mtp_num_layers
                .map(|num_layers| MtpSpec { num_layers, loss_scaling_factor: self.mtp_loss_scaling_factor }),
        };
        if let Some(m) = &self.mamba {
            ferrotron_models::hybrid::make_hybrid(&mut c, &m.hybrid_layer_pattern, m.spec(self.norm_epsilon), dense)
                .map_err(anyhow::Error::msg)?;
        }
        Ok(c)
    }
}

pub fn check_dir(p: &Path, flag: &str) -> anyhow::Result<()> {
    if !p.is_dir() {
        bail!("{flag} {}: no such folder; pass the --save folder of an earlier run", p.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn preset_then_file_then_flags() {
        let dir = std::env::temp_dir().join(format!("ferrotron-settings-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("run.toml");
        std::fs::write(&file, "preset = \"llama-tiny\"\nnum-layers = 3\nlr = 0.01\nswiglu = true\n").unwrap();
        let flags = TrainArgs { config: Some(file.clone()), lr: Some(0.02), ..TrainArgs::default() };
        let (s, _) = Settings::resolve(&flags).unwrap();
        assert_eq!(s.preset, "llama-tiny");
        assert_eq!(s.num_layers, 3, "file overrides preset");
        assert_eq!(s.lr, 0.02, "flag overrides file");
        assert_eq!(s.normalization, "RMSNorm", "preset fills the rest");
        assert_eq!(s.num_query_groups, 2);
        // Unknown keys in the file are an error naming the file.
        std::fs::write(&file, "num-layerz = 3\n").unwrap();
        let e = format!("{:#}", Settings::resolve(&flags).unwrap_err());
        assert!(e.contains("run.toml") && e.contains("num-layerz"), "{e}");
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn settings_round_trip_through_toml() {
        let (s, _) = Settings::resolve(&TrainArgs::default()).unwrap();
        let back: Settings = toml::from_str(&toml::to_string(&s).unwrap()).unwrap();
        assert_eq!(back, s);
        assert_eq!(s.preset, "tiny");
        // A checkpoint written before a setting existed loads with that setting's default.
        let mut old: toml::Table = toml::from_str(&toml::to_string(&s).unwrap()).unwrap();
        for k in ["lr-decay-iters", "adam-eps", "norm-epsilon", "make-vocab-size-divisible-by"] {
            old.remove(k);
        }
        let back: Settings = toml::from_str(&toml::to_string(&old).unwrap()).unwrap();
        assert_eq!((back.adam_eps, back.norm_epsilon, back.make_vocab_size_divisible_by), (1e-8, 1e-5, 128));
        assert_eq!(back.decay_iters(), s.train_iters);
    }

    /// Resolves a command line as `ferrotron train` does.
    fn resolve_line(line: &str) -> anyhow::Result<(Settings, Paths)> {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: TrainArgs,
        }
        let cli = <Cli as clap::Parser>::try_parse_from(std::iter::once("train").chain(line.split_whitespace()))?;
        Settings::resolve(&cli.args)
    }

    fn parse(line: &str) -> anyhow::Result<Settings> {
        Ok(resolve_line(line)?.0)
    }

    fn parse_paths(line: &str) -> anyhow::Result<Paths> {
        Ok(resolve_line(line)?.1)
    }

    /// Flags of a tokenizer not in use are dropped (Megatron ignores them), not refused.
    #[test]
    fn other_tokenizers_flags_are_dropped() {
        let s = parse("--tokenizer-type NullTokenizer --vocab-size 1000 --tiktoken-pattern v2 --mock-data").unwrap();
        assert_eq!((s.vocab_size, s.tiktoken_pattern.as_deref()), (Some(1000), None));
        let hf = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/hf/llama");
        let s = parse(&format!(
            "--tokenizer-type HuggingFaceTokenizer --tokenizer-model {hf} --vocab-size 128256 --mock-data"
        ))
        .unwrap();
        assert_eq!(s.vocab_size, None, "the file's vocabulary");
    }

    /// Megatron's --spec: its Mamba stack alone makes every layer Mamba (pretrain_mamba.py's
    /// default ratios); beside a pattern it changes nothing, nor do its GPT layer specs; others
    /// are refused by name.
    #[test]
    fn megatron_layer_specs() {
        const MAMBA: &str = "--spec megatron.core.models.mamba.mamba_layer_specs mamba_stack_spec";
        let s = parse(&format!("{MAMBA} --num-layers 3 --mamba-num-groups 1")).unwrap();
        assert_eq!(s.mamba.as_ref().unwrap().hybrid_layer_pattern, "MMM");
        assert_eq!(parse(&format!("--preset mamba-tiny {MAMBA}")).unwrap(), parse("--preset mamba-tiny").unwrap());
        for f in ["get_gpt_layer_local_spec", "get_gpt_layer_with_transformer_engine_spec"] {
            let line = format!("--spec megatron.core.models.gpt.gpt_layer_specs {f}");
            assert_eq!(parse(&line).unwrap(), parse("").unwrap(), "{f}");
            let e = parse(&format!("{line} --hybrid-layer-pattern M*")).unwrap_err().to_string();
            assert!(e.contains("is a GPT layer spec"), "{e}");
        }
        let e = parse("--spec my.module my_spec").unwrap_err().to_string();
        assert!(e.contains("--spec my.module my_spec: Ferrotron builds its layer specs from the flags"), "{e}");
        let e = parse(&format!("--spec my.module my_spec {MAMBA} --num-layers 2 --mamba-num-groups 1")).unwrap();
        assert_eq!(e.mamba.unwrap().hybrid_layer_pattern, "MM", "the last --spec holds");
    }

    /// Megatron's --distributed-timeout-minutes and our --distributed-timeout-s set one wait.
    #[test]
    fn collective_timeout_in_minutes_or_seconds() {
        use std::time::Duration;
        assert_eq!(parse_paths("").unwrap().timeout, Duration::from_secs(600), "Megatron's 10 minutes");
        assert_eq!(parse_paths("--distributed-timeout-minutes 60").unwrap().timeout, Duration::from_secs(3600));
        assert_eq!(parse_paths("--distributed-timeout-s 90").unwrap().timeout, Duration::from_secs(90));
        let e = parse_paths("--distributed-timeout-s 90 --distributed-timeout-minutes 2").unwrap_err().to_string();
        assert!(e.contains("keep one"), "{e}");
    }

    /// A preset's --min-lr goes with its --lr; an --lr given alone decays to Megatron's default 0
    /// (a Megatron script's --lr below the tiny preset's minimum used to be refused).
    #[test]
    fn an_lr_given_alone_decays_to_zero() {
        let preset = parse("--preset 124m").unwrap();
        assert_eq!((preset.lr, preset.min_lr), (6e-4, 6e-5));
        let alone = parse("--lr 6e-5").unwrap();
        assert_eq!((alone.lr, alone.min_lr), (6e-5, 0.0));
        let both = parse("--lr 6e-5 --min-lr 6e-6").unwrap();
        assert_eq!((both.lr, both.min_lr), (6e-5, 6e-6));
        let min_alone = parse("--min-lr 1e-4").unwrap();
        assert_eq!((min_alone.lr, min_alone.min_lr), (3e-3, 1e-4));
    }

    /// Megatron's --cp-comm-type takes one type or one a layer (nargs '+'), p2p as the all-gather.
    #[test]
    fn cp_comm_type_takes_one_or_one_a_layer() {
        use ferrotron_parallel::CpCommType::{AllGather, AllToAll};
        let s = parse("--preset llama-tiny --cp-comm-type a2a p2p allgather a2a --seq-length 64").unwrap();
        assert_eq!(s.cp_comm_types().unwrap(), [AllToAll, AllGather, AllGather, AllToAll]);
        assert_eq!(s.seq_length, 64, "the list ends at the next flag");
        assert_eq!(parse("--preset llama-tiny --cp-comm-type a2a").unwrap().cp_comm_types().unwrap(), [AllToAll; 4]);
        assert_eq!(parse("--preset llama-tiny").unwrap().cp_comm_types().unwrap(), [AllGather; 4]);
        let e = parse("--preset llama-tiny --cp-comm-type a2a p2p").unwrap_err().to_string();
        assert!(e.contains("2 types for 4 layers"), "{e}");
    }

    #[test]
    fn megatron_schedule_norm_and_vocab_flags() {
        let s = parse("--train-iters 50 --lr-decay-iters 100 --lr-warmup-fraction 0.1").unwrap();
        assert_eq!((s.decay_iters(), s.lr_warmup_iters), (100, 10));
        let s = parse("--lr-warmup-fraction 0.25").unwrap();
        assert_eq!(s.lr_warmup_iters, s.train_iters / 4, "the fraction of --train-iters without --lr-decay-iters");
        let e = parse("--lr-warmup-fraction 0.1 --lr-warmup-iters 5").unwrap_err().to_string();
        assert!(e.contains("--lr-warmup-fraction") && e.contains("--lr-warmup-iters"), "{e}");
        assert!(parse("--lr-warmup-fraction 1.5").unwrap_err().to_string().contains("[0, 1]"));
        assert!(parse("--lr-decay-iters 0").unwrap_err().to_string().contains("--lr-decay-iters"));
        let s = parse("--norm-epsilon 1e-6 --adam-eps 1e-6 --make-vocab-size-divisible-by 96").unwrap();
        assert_eq!((s.norm_epsilon, s.adam_eps), (1e-6, 1e-6));
        let c = s.model_config().unwrap();
        assert_eq!((c.norm_epsilon, c.make_vocab_size_divisible_by), (1e-6, 96));
        assert_eq!(c.padded_vocab_size(1), 288, "the byte tokenizer's 256 ids padded to a multiple of 96");
        assert!(parse("--adam-eps 0").unwrap_err().to_string().contains("--adam-eps"));
        let s = parse("--kv-channels 16").unwrap();
        assert_eq!((s.kv_channels, s.model_config().unwrap().head_dim()), (Some(16), 16));
        assert!(parse("--kv-channels 0").unwrap_err().to_string().contains("--kv-channels"));
        let e = parse("--make-vocab-size-divisible-by 0").unwrap_err().to_string();
        assert!(e.contains("--make-vocab-size-divisible-by"), "{e}");
    }

    /// Megatron's sample-based runs: --train-samples sets the iterations (over the global
    /// batch) and the train split's size; the schedule is in samples, so its lengths may be
    /// fractional iterations; the two ways are not mixed.
    #[test]
    fn llama3_rope_scaling_flags() {
        let s = parse("--preset llama-tiny --use-rope-scaling --rope-scaling-factor 32").unwrap();
        let want = PositionEmbedding::Rope {
            base: 500000.0,
            scaling: Some(RopeScaling::llama3(32.0)),
            percent: 1.0,
            interpolation: None,
            interleaved: false,
        };
        assert_eq!(s.model_config().unwrap().position_embedding, want);
        let s = parse("--preset llama-tiny --use-rope-scaling").unwrap();
        let eight = PositionEmbedding::Rope {
            base: 500000.0,
            scaling: Some(RopeScaling::llama3(8.0)),
            percent: 1.0,
            interpolation: None,
            interleaved: false,
        };
        assert_eq!(s.model_config().unwrap().position_embedding, eight, "Megatron's default factor");
        // The flags a config gives back build the same config (--use-checkpoint-args, imports).
        let a = model_args(&s.model_config().unwrap());
        assert!(a.use_rope_scaling && a.rope_scaling_factor == Some(8.0));
        let e = parse("--preset llama-tiny --rope-scaling-factor 32").unwrap_err().to_string();
        assert!(e.contains("--use-rope-scaling"), "{e}");
        let e = parse("--preset tiny --use-rope-scaling").unwrap_err().to_string();
        assert!(e.contains("learned_absolute") && e.contains("rope"), "{e}");
        let e = parse("--preset llama-tiny --use-rope-scaling --rope-scaling-factor 0").unwrap_err().to_string();
        assert!(e.contains("--rope-scaling-factor"), "{e}");
    }

    #[test]
    fn runs_measured_in_samples() {
        let s = parse("--global-batch-size 32 --train-samples 100 --lr-warmup-samples 48").unwrap();
        assert_eq!((s.train_iters, s.split_samples()[0]), (3, 100));
        assert_eq!(s.schedule_samples(), (48.0, 100.0, 0.0));
        let s =
            parse("--global-batch-size 32 --train-samples 100 --lr-decay-samples 80 --lr-warmup-fraction 0.5").unwrap();
        assert_eq!(s.schedule_samples(), (40.0, 80.0, 0.0));
        let s = parse("--train-iters 10 --lr-warmup-fraction 0.25").unwrap();
        assert_eq!((s.lr_warmup_iters, s.schedule_samples()), (2, (80.0, 320.0, 0.0)), "the fraction kept whole");
        let s =
            parse("--train-iters 10 --lr-decay-style WSD --lr-wsd-decay-iters 3 --lr-wsd-decay-style cosine").unwrap();
        let wsd = (s.schedule_samples().2, s.decay_style().unwrap());
        assert_eq!(wsd, (96.0, DecayStyle::Wsd(ferrotron_optim::WsdStyle::Cosine)));
        assert!(parse("--lr-decay-style WSD").unwrap_err().to_string().contains("--lr-wsd-decay-iters"));
        assert!(parse("--lr-decay-style inverse-square-root").is_ok());
        let e =
            parse("--lr-decay-style WSD --lr-wsd-decay-iters 2 --lr-wsd-decay-style steep").unwrap_err().to_string();
        assert!(e.contains("minus_sqrt"), "{e}");
        for (line, needle) in [
            ("--train-samples 100 --train-iters 3", "keep one"),
            ("--train-samples 100 --lr-warmup-iters 2", "--lr-warmup-samples"),
            ("--train-samples 100 --lr-decay-iters 2", "--lr-decay-samples"),
            ("--lr-warmup-samples 64", "go with --train-samples"),
            ("--global-batch-size 32 --train-samples 31", "less than one global batch"),
            ("--train-samples 640 --lr-warmup-samples 64 --lr-warmup-fraction 0.1", "keep one"),
        ] {
            let e = parse(line).unwrap_err().to_string();
            assert!(e.contains(needle), "{line}: {e}");
        }
    }

    #[test]
    fn cuda_graph_flags_are_checked() {
        let paths = parse_paths;
        assert_eq!(paths("").unwrap().cuda_graph_warmup, None);
        assert_eq!(paths("--cuda-graph-impl none").unwrap().cuda_graph_warmup, None);
        let err = |line: &str| paths(line).unwrap_err().to_string();
        let e = err("--cuda-graph-impl local");
        assert!(e.contains("--device cuda"), "{e}");
        let e = err("--cuda-graph-impl local --cuda-graph-scope attn");
        assert!(e.contains("--cuda-graph-scope attn") && e.contains("full_iteration"), "{e}");
        // Dropout is graphed too (replays shift the masks' first sample): only the device is missing.
        let e = err("--cuda-graph-impl local --hidden-dropout 0.1 --attention-dropout 0.1");
        assert!(e.contains("--device cuda"), "{e}");
        let e = err("--cuda-graph-impl local --nproc 2");
        assert!(e.contains("one GPU"), "{e}");
        let e = err("--cuda-graph-impl transformer_engine");
        assert!(e.contains("--cuda-graph-impl local"), "{e}");
        assert!(err("--cuda-graph-impl cudagraph").contains("none or local"));
        assert!(err("--cuda-graph-impl local --cuda-graph-warmup-steps 0").contains("at least one eager step"));
        let e = err("--cuda-graph-scope full_iteration --cuda-graph-warmup-steps 2");
        assert!(e.contains("--cuda-graph-impl local"), "{e}");
    }

    #[test]
    fn megatron_switches_accepted() {
        let plain = parse("").unwrap();
        let s = parse("--use-flash-attn --group-query-attention --hidden-dropout 0 --attention-dropout 0.0").unwrap();
        assert_eq!(s, plain, "these change nothing");
        // Without --load they have nothing to say (a warning; Megatron's scripts pass them so).
        assert_eq!(parse_paths("--finetune --no-load-optim").unwrap().load_mode, LoadMode::Resume);
        let e = parse("--overlap-param-gather").unwrap_err().to_string();
        assert!(e.contains("--overlap-param-gather") && e.contains("--use-distributed-optimizer"), "{e}");
        assert!(parse("--overlap-param-gather --use-distributed-optimizer").unwrap().overlap_param_gather);
        let e = parse("--fp16").unwrap_err().to_string();
        assert!(e.contains("--fp16") && e.contains("not implemented") && e.contains("--bf16"), "{e}");
        assert_eq!(parse("--attention-dropout 0.1").unwrap().attention_dropout, 0.1);
        let e = parse("--attention-dropout 1").unwrap_err().to_string();
        assert!(e.contains("--attention-dropout 1") && e.contains("[0, 1)"), "{e}");
        assert_eq!(parse("--hidden-dropout 0.1").unwrap().hidden_dropout, 0.1);
        let e = parse("--hidden-dropout 1").unwrap_err().to_string();
        assert!(e.contains("--hidden-dropout 1") && e.contains("[0, 1)"), "{e}");
    }

    #[test]
    fn window_attn_skip_freq_picks_the_windowed_layers() {
        let s = parse("--window-size (3,0) --num-layers 4 --window-attn-skip-freq 2").unwrap();
        let c = s.model_config().unwrap();
        assert_eq!(c.layer.window_layers, Some(vec![true, false, true, false]));
        let windows: Vec<_> = (0..4).map(|i| c.layer.attention_of(i).window).collect();
        assert_eq!(windows, [Some(4), None, Some(4), None]);
        // --use-checkpoint-args gives it back as the list.
        assert_eq!(model_args(&c).window_attn_skip_freq.as_deref(), Some("[1,0,1,0]"));
        let s = parse("--window-size (3,0) --num-layers 3 --window-attn-skip-freq [0]+[1]*2").unwrap();
        assert_eq!(s.model_config().unwrap().layer.window_layers, Some(vec![false, true, true]));
        for (line, needle) in [
            ("--num-layers 4 --window-attn-skip-freq 2", "there is none"),
            ("--window-size (-1,0) --num-layers 4 --window-attn-skip-freq 2", "there is none"),
            ("--window-size (3,0) --num-layers 4 --window-attn-skip-freq [1,0]", "gives 2 layers"),
            ("--window-size (3,0) --num-layers 4 --window-attn-skip-freq 0", "N ≥ 1"),
        ] {
            let e = format!("{:#}", parse(line).unwrap_err());
            assert!(e.contains("--window-attn-skip-freq") && e.contains(needle), "{line}: {e}");
        }
    }

    #[test]
    fn window_size_is_megatrons_left_and_right() {
        // Each token sees itself and `left` before it: the mask's |i − j| < left + 1.
        for (flag, left) in
            [("(128,0)", Some(128)), ("4,0", Some(4)), ("[0,0]", Some(0)), ("(-1,0)", None), ("(7,-1)", Some(7))]
        {
            let s = parse(&format!("--window-size {flag}")).unwrap();
            assert_eq!(s.window_size, left, "{flag}");
            assert_eq!(s.model_config().unwrap().layer.attention.window, left.map(|l| l + 1), "{flag}");
        }
        assert_eq!(parse("").unwrap().window_size, None);
        for bad in ["(4,2)", "(4)", "(a,0)", "(-2,0)", "(1,0,0)"] {
            let e = parse(&format!("--window-size {bad}")).unwrap_err().to_string();
            assert!(e.contains("--window-size") && e.contains("(left,right)"), "{bad}: {e}");
        }
    }
}
