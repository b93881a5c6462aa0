//! Model hyper-parameters (Megatron's names) and their validation.

use crate::mtp::MtpSpec;
use crate::spec::{LayerKind, LayerSpec, MlpSpec, NormSpec, PositionEmbedding, SoftmaxType};
use crate::{ModelError, Result};

#[derive(Clone, Debug)]
pub struct TransformerConfig {
    pub num_layers: usize,
    pub hidden_size: usize,
    pub num_attention_heads: usize,
    /// Key/value heads (GQA); equal to the attention heads for MHA.
    pub num_query_groups: usize,
    /// Width of a head (Megatron's --kv-channels); None: hidden size / attention heads.
    pub kv_channels: Option<usize>,
    pub ffn_hidden_size: usize,
    pub seq_length: usize,
    pub max_position_embeddings: usize,
    /// The tokenizer's vocabulary (token ids are below it).
    pub vocab_size: usize,
    /// The embedding and output layer are padded to a multiple of this × the tensor-parallel
    /// size (Megatron's --make-vocab-size-divisible-by, 128). Padding rows are never looked up
    /// and their logits are left out of the loss.
    pub make_vocab_size_divisible_by: usize,
    pub position_embedding: PositionEmbedding,
    pub untie_embeddings_and_output_weights: bool,
    pub layer: LayerSpec,
    pub norm_epsilon: f64,
    pub init_method_std: f32,
    /// The word and learned position embeddings' init std (Megatron's
    /// --embedding-init-method-std); None: `init_method_std`.
    pub embedding_init_method_std: Option<f32>,
    /// Dropout rate on each branch's output before its residual add and on the embedding's output
    /// (Megatron's --hidden-dropout), in training; 0: none.
    pub hidden_dropout: f32,
    /// Dropout rate on the attention probabilities after the softmax (Megatron's
    /// --attention-dropout), in training; 0: none.
    pub attention_dropout: f32,
    /// Multi-token prediction depths after the decoder (Megatron's --mtp-num-layers), or None.
    pub mtp: Option<MtpSpec>,
}

fn bad(msg: String) -> ModelError {
    ModelError::Config(msg)
}

impl TransformerConfig {
    /// Rows of the embedding table at tensor-parallel size `tp`.
    pub fn padded_vocab_size(&self, tp: usize) -> usize {
        let m = self.make_vocab_size_divisible_by.max(1) * tp.max(1);
        self.vocab_size.div_ceil(m) * m
    }

    /// Checks that tensor-parallel size `tp` divides what it must split, naming the flags.
    pub fn validate_tp(&self, tp: usize) -> Result<()> {
        for (v, flag) in [
            (self.num_attention_heads, "--num-attention-heads"),
            (self.num_query_groups, "--num-query-groups"),
            (self.ffn_hidden_size, "--ffn-hidden-size"),
        ] {
            if v % tp != 0 {
                return Err(bad(format!(
                    "{flag} {v} is not divisible by --tensor-model-parallel-size {tp}: pick a tensor-parallel size that divides it"
                )));
            }
        }
        for mlp in std::iter::once(&self.layer.mlp).chain(self.layer.other_mlp.as_ref().map(|o| &o.mlp)) {
            if let MlpSpec::Custom(f) = mlp {
                f.validate_tp(tp).map_err(bad)?;
            }
        }
        if let Some(f) = self.layer.hybrid.as_ref().and_then(|h| h.mixer.as_ref()) {
            f.validate_tp(tp).map_err(bad)?;
        }
        Ok(())
    }

    /// The attention's RoPE at position 0 (None without rotary embeddings): the rotary dim of
    /// --rotary-percent, the base, Llama 3's scaling, the linear interpolation, the pairs' layout.
    pub fn rope(&self) -> Option<ferrotron_kernels::RopeCfg> {
        let PositionEmbedding::Rope { base, scaling, interpolation, interleaved, .. } = self.position_embedding else {
            return None;
        };
        Some(ferrotron_kernels::RopeCfg {
            scaling,
            interpolation,
            interleaved,
            ..ferrotron_kernels::RopeCfg::new(self.rotary_dim(), base)
        })
    }

    /// The model's norms (every one but a vision encoder's, which has its own config).
    pub fn norm_spec(&self) -> NormSpec {
        NormSpec { kind: self.layer.norm, eps: self.norm_epsilon, zero_centred: self.layer.zero_centred_gamma }
    }

    pub fn head_dim(&self) -> usize {
        self.kv_channels.unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// The features of each head that RoPE rotates: ⌊head_dim · --rotary-percent⌋ (Megatron's
    /// `int(kv_channels * rotary_percent)`), the head dim without RoPE.
    pub fn rotary_dim(&self) -> usize {
        match self.position_embedding {
            PositionEmbedding::Rope { percent, .. } => (self.head_dim() as f64 * percent) as usize,
            _ => self.head_dim(),
        }
    }

    /// Checks every combination that cannot work, naming the Megatron flag and the fix.
    pub fn validate(&self) -> Result<()> {
        let c = self;
        if c.layer.attention.output_gate && c.layer.attention.mla.is_some() {
            return Err(bad(
                "--attention-output-gate with multi-latent attention: the gate is built for grouped-query attention's projection; drop one".into(),
            ));
        }
        if c.layer.attention.qk_layernorm && c.layer.attention.qk_l2_norm {
            return Err(bad("--qk-layernorm and --qk-l2-norm both normalise each query and key head: keep one".into()));
        }
        for (v, flag) in [
            (c.num_layers, "--num-layers"),
            (c.hidden_size, "--hidden-size"),
            (c.num_attention_heads, "--num-attention-heads"),
            (c.num_query_groups, "--num-query-groups"),
            (c.ffn_hidden_size, "--ffn-hidden-size"),
            (c.seq_length, "--seq-length"),
            (c.vocab_size, "vocabulary size"),
            (c.make_vocab_size_divisible_by, "--make-vocab-size-divisible-by"),
        ] {
            if v == 0 {
                return Err(bad(format!("{flag} must be at least 1")));
            }
        }
        if c.kv_channels == Some(0) {
            return Err(bad("--kv-channels must be at least 1 (or leave it out: hidden size / heads)".into()));
        }
        if c.kv_channels.is_none() && c.hidden_size % c.num_attention_heads != 0 {
            return Err(bad(format!(
                "--hidden-size {} is not divisible by --num-attention-heads {}: pick a head count that divides it",
                c.hidden_size, c.num_attention_heads
            )));
        }
        if c.num_attention_heads % c.num_query_groups != 0 {
            return Err(bad(format!(
                "--num-attention-heads {} is not divisible by --num-query-groups {}: use a group count that divides the heads",
                c.num_attention_heads, c.num_query_groups
            )));
        }
        if c.seq_length > c.max_position_embeddings {
            return Err(bad(format!(
                "--seq-length {} exceeds --max-position-embeddings {}: raise --max-position-embeddings or shorten --seq-length",
                c.seq_length, c.max_position_embeddings
            )));
        }
        if let PositionEmbedding::Rope { base, scaling, percent, interpolation, interleaved } = c.position_embedding {
            if let Some(s) = interpolation {
                if !(s.is_finite() && s > 0.0) {
                    return Err(bad(format!(
                        "--rotary-seq-len-interpolation-factor {s} must be positive (2 stretches the trained positions over twice the context)"
                    )));
                }
                if c.layer.attention.mla.is_some() {
                    return Err(bad(format!(
                        "--rotary-seq-len-interpolation-factor {s} with multi-latent attention: its rotary features take YaRN (--rope-type yarn); drop the factor"
                    )));
                }
            }
            if interleaved && c.layer.attention.mla.is_some() {
                return Err(bad(
                    "--rotary-interleaved with multi-latent attention: its rotary features are always interleaved (DeepSeek's layout); drop the flag".into(),
                ));
            }
            if !(percent > 0.0 && percent <= 1.0) {
                return Err(bad(format!("--rotary-percent {percent} must be in (0, 1] (1.0 rotates whole heads)")));
            }
            if percent != 1.0 && c.layer.attention.mla.is_some() {
                return Err(bad(format!(
                    "--rotary-percent {percent} with multi-latent attention: it rotates its own rotary features (--qk-pos-emb-head-dim) whole; drop --rotary-percent"
                )));
            }
            let rot = c.rotary_dim();
            if percent != 1.0 && (rot < 2 || rot % 2 != 0) {
                return Err(bad(format!(
                    "--rotary-percent {percent} rotates ⌊{} · {percent}⌋ = {rot} features of each head, which must be even and at least 2: pick a percent that gives one",
                    c.head_dim()
                )));
            }
            if c.head_dim() % 2 != 0 {
                return Err(bad(format!(
                    "rotary embeddings need an even head dim, but it is {} (--kv-channels, else --hidden-size {} / --num-attention-heads {}): change them, or use --position-embedding-type learned_absolute",
                    c.head_dim(),
                    c.hidden_size,
                    c.num_attention_heads
                )));
            }
            if base.is_nan() || base <= 0.0 || base.is_infinite() {
                return Err(bad(format!("--rotary-base {base} must be positive")));
            }
            if let Some(problem) = scaling.and_then(|s| s.problem()) {
                return Err(bad(format!("{problem} (--rope-scaling-factor)")));
            }
        }
        if let Some(o) = c.layer.other_mlp.as_ref().filter(|o| o.layers.len() != c.num_layers) {
            return Err(bad(format!(
                "the layer pattern (--moe-layer-freq) lists {} layers but --num-layers is {}: give one entry per layer",
                o.layers.len(),
                c.num_layers
            )));
        }
        if let Some(h) = &c.layer.hybrid {
            if h.kinds.len() != c.num_layers {
                return Err(bad(format!(
                    "the hybrid layer pattern (--hybrid-layer-pattern) has {} layers but --num-layers is {}: give one character per layer",
                    h.kinds.len(),
                    c.num_layers
                )));
            }
            if h.mixer.is_none() && h.kinds.contains(&LayerKind::Mixer) {
                return Err(bad("the hybrid layer pattern has mixer (M) layers but no mixer spec".into()));
            }
        }
        if c.layer.attention.window == Some(0) {
            return Err(bad("--window-size must be at least 1".into()));
        }
        if let Some(w) = &c.layer.window_layers {
            if c.layer.attention.window.is_none() {
                return Err(bad(
                    "--window-attn-skip-freq picks the layers a sliding window applies in, but there is none (--window-size with a finite left): add one or drop it".into(),
                ));
            }
            if w.len() != c.num_layers {
                return Err(bad(format!(
                    "--window-attn-skip-freq gives {} layers but --num-layers is {}: one entry per layer",
                    w.len(),
                    c.num_layers
                )));
            }
        }
        if !(0.0..1.0).contains(&c.hidden_dropout) {
            return Err(bad(format!("--hidden-dropout {} must be in [0, 1): a rate such as 0.1", c.hidden_dropout)));
        }
        if !(0.0..1.0).contains(&c.attention_dropout) {
            return Err(bad(format!(
                "--attention-dropout {} must be in [0, 1): a rate such as 0.1",
                c.attention_dropout
            )));
        }
        if c.norm_epsilon.is_nan() || c.norm_epsilon <= 0.0 {
            return Err(bad("--norm-epsilon must be positive".into()));
        }
        if let Some(m) = &c.layer.attention.mla {
            if let Some(problem) = m.problem() {
                return Err(bad(problem));
            }
            let refused = [
                (
                    !matches!(c.position_embedding, PositionEmbedding::Rope { .. }),
                    "learned or no position embeddings (it needs --position-embedding-type rope)",
                ),
                (c.layer.attention.qk_layernorm, "--qk-layernorm (its latents have norms of their own)"),
                (c.layer.attention.qk_l2_norm, "--qk-l2-norm"),
                (c.layer.attention.qkv_bias, "--add-qkv-bias"),
                (c.layer.attention.window.is_some(), "--window-size"),
                (c.attention_dropout > 0.0, "--attention-dropout"),
                (c.kv_channels.is_some(), "--kv-channels (--qk-head-dim and --v-head-dim size its heads)"),
            ];
            if let Some((_, what)) = refused.iter().find(|(on, _)| *on) {
                return Err(bad(format!("--multi-latent-attention is not built with {what}: drop one")));
            }
        }
        if let Some(m) = &c.mtp {
            if m.num_layers == 0 {
                return Err(bad(
                    "--mtp-num-layers must be at least 1 (or leave it out: no multi-token prediction)".into()
                ));
            }
            if !m.loss_scaling_factor.is_finite() || m.loss_scaling_factor < 0.0 {
                return Err(bad(format!(
                    "--mtp-loss-scaling-factor {} must be a finite weight of at least 0 (Megatron's default 0.1)",
                    m.loss_scaling_factor
                )));
            }
            if c.layer.hybrid.is_some() {
                return Err(bad(
                    "--mtp-num-layers is not built for hybrid (Mamba) layer patterns: drop it or use a transformer model".into(),
                ));
            }
        }
        Ok(())
    }

    /// Parameter count (untied output layer counted when untied). A custom MLP's parameters are
    /// its factory's `param_count`, else counted as a dense MLP's; the built `ParamTable::numel`
    /// is exact.
    pub fn num_params(&self) -> usize {
        self.count_params(false)
    }

    /// The parameters one token runs through: `num_params` with a mixture-of-experts layer's
    /// experts counted as the top-k it uses (what the model FLOPs count).
    pub fn active_params(&self) -> usize {
        self.count_params(true)
    }

    fn count_params(&self, active: bool) -> usize {
        let (h, v) = (self.hidden_size, self.padded_vocab_size(1));
        let emb = v * h
            + if self.position_embedding == PositionEmbedding::LearnedAbsolute {
                self.max_position_embeddings * h
            } else {
                0
            };
        let out = if self.untie_embeddings_and_output_weights { v * h } else { 0 };
        self.layer_params(active) + self.norm_params(h) + emb + out + self.mtp_params(active)
    }

    /// The multi-token prediction depths' parameters: per depth three norms, the [H, 2H]
    /// projection and a layer of the decoder's last layer's kind (0 without MTP).
    fn mtp_params(&self, active: bool) -> usize {
        let Some(m) = &self.mtp else { return 0 };
        let h = self.hidden_size;
        let last = self.num_layers.saturating_sub(1);
        m.num_layers * (3 * self.norm_params(h) + 2 * h * h + self.one_layer_params(last, active))
    }

    /// A norm's parameters over width `n`.
    fn norm_params(&self, n: usize) -> usize {
        match self.layer.norm {
            crate::spec::NormKind::LayerNorm => 2 * n,
            crate::spec::NormKind::RmsNorm => n,
        }
    }

    /// The layers' parameters alone (no embeddings, final norm or output layer): what a vision
    /// encoder built from this config holds in its layers. `active`: as `active_params`.
    pub fn layer_params(&self, active: bool) -> usize {
        (0..self.num_layers).map(|i| self.one_layer_params(i, active)).sum()
    }

    /// Layer `i`'s parameters (its kind and MLP from the spec).
    fn one_layer_params(&self, i: usize, active: bool) -> usize {
        let (h, f) = (self.hidden_size, self.ffn_hidden_size);
        let d = self.head_dim();
        let kv = self.num_query_groups * d;
        let bias_attn = self.layer.attention.bias;
        let norm = |n: usize| self.norm_params(n);
        let q = self.num_attention_heads * d;
        // An output gate projects one more head's width per query head.
        let qkv_out = q + 2 * kv + if self.layer.attention.output_gate { q } else { 0 };
        let qkv_bias = bias_attn || self.layer.attention.qkv_bias;
        let attn = match &self.layer.attention.mla {
            Some(m) => m.param_count(h, self.num_attention_heads, self.layer.norm, bias_attn),
            None => h * qkv_out + q * h + if qkv_bias { qkv_out } else { 0 } + if bias_attn { h } else { 0 },
        };
        let qk_ln = if self.layer.attention.qk_layernorm { 2 * norm(d) } else { 0 };
        // A learned sink logit a head (--softmax-type learnable), with either attention.
        let sink = if self.layer.attention.softmax == SoftmaxType::Learnable { self.num_attention_heads } else { 0 };
        let attn = attn + sink;
        let mlp = |spec: &MlpSpec| {
            let (fc1_out, bias_mlp) = match spec {
                MlpSpec::Dense { activation, bias } => (activation.fc1_blocks() * f, *bias),
                MlpSpec::Custom(_) => (f, false),
            };
            let dense = h * fc1_out + f * h + if bias_mlp { fc1_out + h } else { 0 };
            match spec {
                MlpSpec::Custom(m) => m.param_count(h).map_or(dense, |c| if active { c.active } else { c.total }),
                MlpSpec::Dense { .. } => dense,
            }
        };
        let mixer = || {
            let f = self.layer.hybrid.as_ref().and_then(|hy| hy.mixer.as_ref());
            f.and_then(|f| f.param_count(h)).map_or(0, |c| if active { c.active } else { c.total })
        };
        match self.layer.kind_of(i) {
            LayerKind::Transformer => attn + qk_ln + mlp(self.layer.mlp_of(i)) + 2 * norm(h),
            LayerKind::Attention => attn + qk_ln + norm(h),
            LayerKind::Mlp => mlp(self.layer.mlp_of(i)) + norm(h),
            LayerKind::Mixer => mixer() + norm(h),
        }
    }

    /// Model FLOPs per token for one forward + backward: 6·N + 12·L·H·T (N the active parameters
    /// without position embeddings, L the layers with attention, as in the MFU convention of PaLM /
    /// Megatron reports), plus a mixer's own (`ModuleFactory::flops_per_token`) per mixer layer and
    /// each multi-token prediction depth's layer and output-layer product.
    pub fn flops_per_token(&self) -> f64 {
        let kinds = (0..self.num_layers).map(|i| self.layer.kind_of(i));
        let attention_layers =
            kinds.clone().filter(|k| matches!(k, LayerKind::Transformer | LayerKind::Attention)).count();
        let mixers = kinds.filter(|k| *k == LayerKind::Mixer).count() as f64;
        let mixer_flops = self
            .layer
            .hybrid
            .as_ref()
            .and_then(|hy| hy.mixer.as_ref())
            .map_or(0.0, |f| f.flops_per_token(self.hidden_size, self.seq_length));
        let pos = if self.position_embedding == PositionEmbedding::LearnedAbsolute {
            self.max_position_embeddings * self.hidden_size
        } else {
            0
        };
        // Each MTP depth: its parameters (in `active_params`), one more product with the output
        // layer, and its layer's attention.
        let mtp = self.mtp.map_or(0, |m| m.num_layers);
        let mtp_logits = mtp * self.padded_vocab_size(1) * self.hidden_size;
        let n = (self.active_params() - pos + mtp_logits) as f64;
        // The hidden size unless --kv-channels; with MLA the mean of the score and value widths
        // (12·width·T = 6·T·heads·(score width + value width)).
        let width = match &self.layer.attention.mla {
            Some(m) => self.num_attention_heads * (m.qk_head_dim + m.qk_pos_emb_head_dim + m.v_head_dim) / 2,
            None => self.num_attention_heads * self.head_dim(),
        };
        let attention_layers = attention_layers + mtp;
        6.0 * n + 12.0 * (attention_layers * width * self.seq_length) as f64 + mixers * mixer_flops
    }
}
