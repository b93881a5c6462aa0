//! LLaVA's image path (Megatron-Core's CLIPViTModel and MultimodalProjector): a CLIP-style
//! vision transformer over image patches, an MLP projecting its rows into the language model's
//! width, and `Placement`, which puts the projected rows where the image placeholder tokens are.
//!
//! Shapes (N images, P = (H/p)·(W/p) patches an image, S = P + 1 rows with the class token,
//! K = channels·p·p, Cv the encoder's width, C the language model's):
//!   patches [N, S, K] (`VisionSpec::patchify`: row 0 zeros where the class token goes)
//!   → conv1 as one product [N, S, Cv] → + position embeddings, the class token added on row 0
//!   → ln_pre → encoder layers (every row sees every other; no final norm) [N, S, Cv]
//!   → projection: fc1, activation, fc2 [N, S, C].
//! An image's feature rows are its S rows, less the class token's with `drop_class_token`; the
//! k-th placeholder token of a micro-batch (row-major over [B, T]) takes feature row k (as
//! transformers' LLaVA does with its expanded image tokens).
//!
//! Backward: the gradient rows at the placeholders flow into the projection and encoder; the
//! placeholders' own embedding rows get none (they were replaced). Parameter gradients add into
//! main_grad as everywhere. Tensor parallel: the encoder and projection split heads and MLP
//! columns as the language model's layers do, without sequence parallelism (every rank holds
//! every image row, as in Megatron); under the language model's sequence parallelism each rank
//! holds the gradient rows of its sequence slice, so the feature gradient is summed over the group.

use crate::config::TransformerConfig;
use crate::layer::TransformerBlock;
use crate::mlp::Mlp;
use crate::norm::Norm;
use crate::recompute::Recompute;
use crate::spec::Activation;
use crate::{ModelError, Result};
use ferrotron_core::{Cx, Init, Module, ParamId, ParamMeta, ParamTableBuilder, Saved, Tensor};
use ferrotron_kernels as k;
use ferrotron_parallel::TensorParallel;
use std::sync::Arc;

/// A LLaVA model's vision encoder and projection.
#[derive(Clone, Debug)]
pub struct VisionSpec {
    /// Image height and width in pixels (Megatron's --img-h, --img-w).
    pub img_h: usize,
    pub img_w: usize,
    /// Square patch side in pixels (--patch-dim).
    pub patch_dim: usize,
    pub channels: usize,
    /// CLIP's class token in front of the patch rows (Megatron's class_token_len 1).
    pub class_token: bool,
    /// The class token's row is no image feature (Megatron's --disable-vision-class-token;
    /// transformers' `vision_feature_select_strategy: "default"`).
    pub drop_class_token: bool,
    /// The encoder's layers: width, depth, heads, MLP, norms (Megatron copies the language
    /// model's config and sets --encoder-num-layers; CLIP ViT-L/14 has its own). Attention must
    /// be bidirectional (`AttentionSpec::causal` false).
    pub encoder: TransformerConfig,
    /// The projection's inner width and activation (an MLP from the encoder's width to the
    /// language model's), and whether its linears have biases.
    pub projector_ffn: usize,
    pub projector_activation: Activation,
    pub projector_bias: bool,
    /// The token id whose positions take image features (transformers' `image_token_index`).
    pub image_token: u32,
}

fn bad(msg: String) -> ModelError {
    ModelError::Config(msg)
}

impl VisionSpec {
    /// LLaVA-1.5's image path: `img_h` × `img_w` RGB images in `patch` × `patch` patches
    /// through a CLIP `encoder` (`clip_encoder`) with a class token (its row dropped from the
    /// features with `drop_class_token`), and a GeLU (erf) projection with biases through the
    /// language model's width `hidden`; `image_token` the placeholder id.
    pub fn llava(
        (img_h, img_w, patch_dim): (usize, usize, usize),
        encoder: TransformerConfig,
        drop_class_token: bool,
        hidden: usize,
        image_token: u32,
    ) -> VisionSpec {
        VisionSpec {
            img_h,
            img_w,
            patch_dim,
            channels: 3,
            class_token: true,
            drop_class_token,
            encoder,
            projector_ffn: hidden,
            projector_activation: Activation::GeluExact,
            projector_bias: true,
            image_token,
        }
    }

    /// Patches an image.
    pub fn patches(&self) -> usize {
        (self.img_h / self.patch_dim.max(1)) * (self.img_w / self.patch_dim.max(1))
    }

    /// Rows of the encoder's sequence: the patches and the class token.
    pub fn seq_len(&self) -> usize {
        self.patches() + self.class_token as usize
    }

    /// Values in one patch (conv1's input width).
    pub fn patch_len(&self) -> usize {
        self.channels * self.patch_dim * self.patch_dim
    }

    /// Feature rows an image gives, so the placeholder tokens each image needs.
    pub fn image_tokens(&self) -> usize {
        self.seq_len() - self.first_feature()
    }

    /// The first of an image's rows that is a feature.
    fn first_feature(&self) -> usize {
        (self.class_token && self.drop_class_token) as usize
    }

    /// Checks what cannot work, naming the flag and the fix.
    pub fn validate(&self, language_vocab: usize) -> Result<()> {
        for (v, flag) in [(self.img_h, "--img-h"), (self.img_w, "--img-w"), (self.patch_dim, "--patch-dim")] {
            if v == 0 {
                return Err(bad(format!("{flag} must be at least 1")));
            }
        }
        if self.img_h % self.patch_dim != 0 || self.img_w % self.patch_dim != 0 {
            return Err(bad(format!(
                "--img-h {} and --img-w {} must be multiples of --patch-dim {}: resize the images or pick a patch size that divides both",
                self.img_h, self.img_w, self.patch_dim
            )));
        }
        if self.channels == 0 || self.projector_ffn == 0 {
            return Err(bad("image channels and the projection's width must be at least 1".into()));
        }
        if self.drop_class_token && !self.class_token {
            return Err(bad("--disable-vision-class-token drops a class token this encoder does not have".into()));
        }
        if self.image_tokens() == 0 {
            return Err(bad("an image gives no feature rows: keep the class token or use larger images".into()));
        }
        if self.encoder.layer.attention.causal {
            return Err(bad(
                "the vision encoder's attention must see every patch (bidirectional), not be causal".into()
            ));
        }
        if self.image_token as usize >= language_vocab {
            return Err(bad(format!(
                "the image token id {} is not below the language model's vocabulary size {language_vocab}: use a token the tokenizer has",
                self.image_token
            )));
        }
        self.encoder.validate()
    }

    /// Images [N, channels, H, W] (row-major pixel values, normalised) as the encoder's patch
    /// rows [N, S, K]: row 0 zeros when there is a class token, then patch (y, x) at row
    /// y·(W/p) + x (+ 1), its values in conv1's weight order (channel, row, column).
    pub fn patchify(&self, pixels: &[f32], n: usize) -> Result<Vec<f32>> {
        let (h, w, p, ch) = (self.img_h, self.img_w, self.patch_dim, self.channels);
        if pixels.len() != n * ch * h * w {
            return Err(bad(format!(
                "{} pixel values for {n} images of {ch} × {h} × {w}: every image must be resized to --img-h × --img-w",
                pixels.len()
            )));
        }
        let (s, kk, gw) = (self.seq_len(), self.patch_len(), w / p);
        let first = self.class_token as usize;
        let mut out = vec![0f32; n * s * kk];
        for i in 0..n {
            let img = &pixels[i * ch * h * w..(i + 1) * ch * h * w];
            for q in 0..self.patches() {
                let (gy, gx) = (q / gw, q % gw);
                let row = &mut out[(i * s + first + q) * kk..(i * s + first + q + 1) * kk];
                for c in 0..ch {
                    for py in 0..p {
                        let src = c * h * w + (gy * p + py) * w + gx * p;
                        row[(c * p + py) * p..(c * p + py + 1) * p].copy_from_slice(&img[src..src + p]);
                    }
                }
            }
        }
        Ok(out)
    }

    /// The encoder's and projection's parameters for a language model of width `hidden`.
    pub fn num_params(&self, hidden: usize) -> usize {
        let cv = self.encoder.hidden_size;
        // The layers, ln_pre (a LayerNorm's two vectors), conv1, the class token, the positions.
        let enc = self.encoder.layer_params(false) + 2 * cv;
        let blocks = self.projector_activation.fc1_blocks();
        let bias = self.projector_bias as usize;
        let proj = (cv + bias) * blocks * self.projector_ffn + (self.projector_ffn + bias) * hidden;
        enc + cv * self.patch_len() + cv * self.class_token as usize + self.seq_len() * cv + proj
    }

    /// Model FLOPs of one image, forward and backward (6 × parameters per row, plus attention's
    /// 12·L·Cv·S per row), for the throughput's MFU.
    pub fn flops_per_image(&self, hidden: usize) -> f64 {
        let (s, c) = (self.seq_len() as f64, &self.encoder);
        let att = 12.0 * c.num_layers as f64 * c.head_dim() as f64 * c.num_attention_heads as f64 * s;
        s * (6.0 * (self.num_params(hidden) - self.seq_len() * c.hidden_size) as f64 + att)
    }
}

/// A CLIP vision encoder's layers (ViT): `layers` of width `hidden` with `heads` heads and an
/// MLP of width `ffn`; LayerNorm (ε 1e-5), biases, quick GeLU, bidirectional attention, no
/// dropout. Its embedding fields are unused (the patches come in through conv1).
pub fn clip_encoder(layers: usize, hidden: usize, heads: usize, ffn: usize, std: f32) -> TransformerConfig {
    use crate::spec::{AttentionSpec, LayerSpec, MlpSpec, NormKind, PositionEmbedding, SoftmaxType};
    TransformerConfig {
        num_layers: layers,
        hidden_size: hidden,
        num_attention_heads: heads,
        num_query_groups: heads,
        kv_channels: None,
        ffn_hidden_size: ffn,
        seq_length: 1,
        max_position_embeddings: 1,
        vocab_size: 1,
        make_vocab_size_divisible_by: 1,
        position_embedding: PositionEmbedding::None,
        untie_embeddings_and_output_weights: true,
        layer: LayerSpec {
            norm: NormKind::LayerNorm,
            zero_centred_gamma: false,
            attention: AttentionSpec {
                bias: true,
                qkv_bias: false,
                qk_layernorm: false,
                qk_l2_norm: false,
                output_gate: false,
                softmax: SoftmaxType::Vanilla,
                window: None,
                causal: false,
                mla: None,
            },
            mlp: MlpSpec::Dense { activation: Activation::QuickGelu, bias: true },
            other_mlp: None,
            hybrid: None,
            window_layers: None,
        },
        norm_epsilon: 1e-5,
        init_method_std: std,
        embedding_init_method_std: None,
        hidden_dropout: 0.0,
        attention_dropout: 0.0,
        mtp: None,
    }
}

/// Images of one micro-batch, as the model takes them.
#[derive(Clone, Debug)]
pub struct Images {
    /// [N, S, K] patch rows (`VisionSpec::patchify`), in the model's dtype on its device.
    pub patches: Tensor,
    /// Positions over the flattened [B, T] tokens of the image placeholders, in order (host).
    pub placeholders: Arc<Vec<usize>>,
}

impl Images {
    /// The placeholders are the positions of `image_token` in `tokens` (row-major [B, T], host).
    pub fn new(patches: Tensor, tokens: &[u32], image_token: u32) -> Images {
        let placeholders = tokens.iter().enumerate().filter(|(_, t)| **t == image_token).map(|(i, _)| i).collect();
        Images { patches, placeholders: Arc::new(placeholders) }
    }
}

pub struct VisionModel {
    pub spec: VisionSpec,
    pub conv1: ParamId,
    pub class_token: Option<ParamId>,
    pub position_embeddings: ParamId,
    pub ln_pre: Norm,
    pub encoder: TransformerBlock,
    pub projection: Mlp,
    /// The language model's tensor-parallel group (the encoder runs on it without sequence
    /// parallelism).
    tp: TensorParallel,
}

/// What the vision forward keeps for its backward.
pub struct VisionSaved {
    patches: Tensor,
    ln_pre: Saved,
    encoder: Saved,
    projection: Saved,
    placement: Placement,
}

impl VisionSaved {
    /// Activation bytes held (tensors counted as they are referenced).
    pub fn bytes(&self) -> usize {
        let b = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        let p = &self.placement;
        b(&self.patches)
            + self.ln_pre.bytes()
            + self.encoder.bytes()
            + self.projection.bytes()
            + b(&p.gather)
            + b(&p.scatter)
    }
}

impl VisionModel {
    /// Registers the encoder's and projection's parameters (Megatron's names: `vision_model.*`,
    /// `vision_projection.encoder.*`) for a language model of width `hidden` on `tp`.
    pub fn build(
        p: &mut ParamTableBuilder,
        spec: &VisionSpec,
        language_vocab: usize,
        hidden: usize,
        tp: &TensorParallel,
    ) -> Result<Self> {
        spec.validate(language_vocab)?;
        let c = &spec.encoder;
        c.validate_tp(tp.size())?;
        if spec.projector_ffn % tp.size() != 0 {
            return Err(bad(format!(
                "the vision projection's width {} is not divisible by --tensor-model-parallel-size {}",
                spec.projector_ffn,
                tp.size()
            )));
        }
        let (cv, std) = (c.hidden_size, c.init_method_std);
        let whole = TensorParallel::new(tp.comm.clone(), false);
        let (pd, ch) = (spec.patch_dim, spec.channels);
        let conv1 =
            p.add(ParamMeta::replicated("vision_model.conv1.weight", [cv, ch, pd, pd], Init::Normal { std }, true))?;
        let class_token = match spec.class_token {
            true => Some(p.add(ParamMeta::replicated(
                "vision_model.class_token",
                [1, 1, cv],
                Init::Normal { std },
                false,
            ))?),
            false => None,
        };
        let position_embeddings = p.add(ParamMeta::replicated(
            "vision_model.position_embeddings.weight",
            [spec.seq_len(), cv],
            Init::Normal { std },
            true,
        ))?;
        let ln_pre = Norm::new(p, "vision_model.ln_pre", c.norm_spec(), cv, false)?;
        let encoder = TransformerBlock::stage(
            p,
            "vision_model.decoder",
            c,
            &whole,
            0..c.num_layers,
            false,
            Recompute::default(),
        )?;
        let projection = Mlp::projection(
            p,
            "vision_projection.encoder",
            [cv, spec.projector_ffn, hidden],
            spec.projector_activation,
            spec.projector_bias,
            [std, std],
            &whole,
        )?;
        Ok(VisionModel {
            spec: spec.clone(),
            conv1,
            class_token,
            position_embeddings,
            ln_pre,
            encoder,
            projection,
            tp: tp.clone(),
        })
    }

    /// The encoder's input: conv1's product plus the position embeddings (the class token on
    /// row 0).
    fn embed(&self, cx: &Cx, patches: &Tensor) -> Result<Tensor> {
        let (cv, s, kk) = (self.spec.encoder.hidden_size, self.spec.seq_len(), self.spec.patch_len());
        let n = patches.dims()[0];
        if patches.dims() != [n, s, kk] {
            return Err(ferrotron_core::shape_mismatch(
                "VisionModel::forward",
                format!("patches [N, {s}, {kk}]"),
                patches.dims(),
            )
            .into());
        }
        let w = cx.params.param(self.conv1)?.reshape([cv, kk])?;
        let x = k::matmul(patches, &w, false, true)?;
        let mut table = cx.params.param(self.position_embeddings)?;
        if let Some(c) = self.class_token {
            table = table.deep_copy()?;
            k::add_(&table.narrow0(0..1)?, &cx.params.param(c)?.reshape([1, cv])?)?;
        }
        let ids: Vec<u32> = (0..n).flat_map(|_| 0..s as u32).collect();
        let ids = Tensor::from_vec(ids, [n, s], patches.device())?;
        Ok(k::add(&x, &k::embedding_fwd(&ids, &table)?)?)
    }

    /// Runs the images through the encoder and projection and puts their feature rows in place
    /// of the placeholders in `x` ([B, T, C], or [B, T/tp, C] under sequence parallelism:
    /// this rank's slice of every sequence).
    pub fn forward(&self, cx: &Cx, x: &Tensor, images: &Images) -> Result<(Tensor, VisionSaved)> {
        let n = images.patches.dims().first().copied().unwrap_or(0);
        let want = n * self.spec.image_tokens();
        if images.placeholders.len() != want {
            return Err(bad(format!(
                "the micro-batch has {} image placeholder tokens (id {}) but its {n} images give {want} feature rows: each image needs {} placeholders in its sample",
                images.placeholders.len(),
                self.spec.image_token,
                self.spec.image_tokens()
            )));
        }
        let h = self.embed(cx, &images.patches)?;
        let (h, ln_pre) = self.ln_pre.forward(cx, &h)?;
        let (h, encoder) = self.encoder.forward(cx, &h)?;
        let (feats, projection) = self.projection.forward(cx, &h)?;
        let placement = Placement::new(&self.spec, &self.tp, x, n, &images.placeholders)?;
        let y = placement.forward(x, &feats)?;
        let saved = VisionSaved { patches: images.patches.clone(), ln_pre, encoder, projection, placement };
        Ok((y, saved))
    }

    /// From the gradient of `forward`'s output: adds the encoder's and projection's parameter
    /// gradients and returns the gradient of `x` (zero at the placeholders).
    pub fn backward(&self, cx: &Cx, saved: VisionSaved, dy: &Tensor) -> Result<Tensor> {
        let (dx, dfeats) = saved.placement.backward(dy)?;
        if self.tp.sp() {
            self.tp.all_reduce(&dfeats)?;
        }
        let d = self.projection.backward(cx, saved.projection, &dfeats)?;
        let d = self.encoder.backward_with(cx, saved.encoder, &d, &mut |_| Ok(()))?;
        let d = self.ln_pre.backward(cx, saved.ln_pre, &d)?;
        let (n, s, cv) = (d.dims()[0], d.dims()[1], d.dims()[2]);
        // Position embeddings: Σ over images per row; the class token: the same sum at row 0.
        k::position_embedding_bwd(&d, &cx.params.grad(self.position_embeddings)?, 0)?;
        if let Some(c) = self.class_token {
            let rows = Tensor::from_vec((0..n).map(|i| (i * s) as u32).collect::<Vec<_>>(), [n, 1], d.device())?;
            let first = k::embedding_fwd(&rows, &d.reshape([n * s, cv])?)?;
            k::position_embedding_bwd(&first, &cx.params.grad(c)?.reshape([1, cv])?, 0)?;
        }
        let kk = self.spec.patch_len();
        let (dw, acc) = cx.params.grad_acc(self.conv1)?;
        k::matmul_into(
            &dw.reshape([cv, kk])?,
            &d.reshape([n * s, cv])?,
            &saved.patches.reshape([n * s, kk])?,
            true,
            false,
            acc,
        )?;
        Ok(dx)
    }
}

/// Where a micro-batch's feature rows go among this rank's embedding rows, as two row gathers:
/// forward from [x rows; feature rows], backward from [dy rows; a zero row].
struct Placement {
    /// [R]: each output row's source (its own row, or R + its feature row).
    gather: Tensor,
    /// [R + N·S]: each gradient row's source in [dy; 0] (R: the zero row).
    scatter: Tensor,
    rows: usize,
    /// [N, S]: images and rows an image.
    images: [usize; 2],
}

impl Placement {
    fn new(spec: &VisionSpec, tp: &TensorParallel, x: &Tensor, n: usize, placeholders: &[usize]) -> Result<Placement> {
        let (b, tl) = (x.dims()[0], x.dims()[1]);
        let t = if tp.sp() { tl * tp.size() } else { tl };
        let start = if tp.sp() { tp.rank() * tl } else { 0 };
        let (rows, s) = (b * tl, spec.seq_len());
        let mut gather: Vec<u32> = (0..rows as u32).collect();
        let mut scatter: Vec<u32> = (0..rows as u32).chain(std::iter::repeat_n(rows as u32, n * s)).collect();
        for (k, &pos) in placeholders.iter().enumerate() {
            let (bi, ti) = (pos / t, pos % t);
            if bi >= b {
                return Err(bad(format!("image placeholder at {pos} is outside the micro-batch's {b} × {t} tokens")));
            }
            if !(start..start + tl).contains(&ti) {
                continue;
            }
            let local = bi * tl + ti - start;
            let feat = (k / spec.image_tokens()) * s + spec.first_feature() + k % spec.image_tokens();
            gather[local] = (rows + feat) as u32;
            scatter[local] = rows as u32;
            scatter[rows + feat] = local as u32;
        }
        let dev = x.device();
        Ok(Placement {
            gather: Tensor::from_vec(gather, [rows], dev)?,
            scatter: Tensor::from_vec(scatter, [rows + n * s], dev)?,
            rows,
            images: [n, s],
        })
    }

    fn forward(&self, x: &Tensor, feats: &Tensor) -> Result<Tensor> {
        let c = x.shape().last();
        let table = cat_rows(&x.reshape([self.rows, c])?, &feats.reshape([feats.elem_count() / c, c])?)?;
        Ok(k::embedding_fwd(&self.gather, &table)?.reshape(x.dims().to_vec())?)
    }

    /// (dx with the placeholders' rows zero, the feature rows' gradient [N, S, C]).
    fn backward(&self, dy: &Tensor) -> Result<(Tensor, Tensor)> {
        let c = dy.shape().last();
        let zero = Tensor::zeros([1, c], dy.dtype(), dy.device())?;
        let d = k::embedding_fwd(&self.scatter, &cat_rows(&dy.reshape([self.rows, c])?, &zero)?)?;
        let [n, s] = self.images;
        let feats = d.narrow0(self.rows..self.rows + n * s)?.reshape([n, s, c])?;
        Ok((d.narrow0(0..self.rows)?.reshape(dy.dims().to_vec())?, feats))
    }
}

/// [a; b] along rows (both [_, C], one dtype).
fn cat_rows(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let (ra, rb, c) = (a.dims()[0], b.dims()[0], a.shape().last());
    let t = Tensor::empty([ra + rb, c], a.dtype(), a.device())?;
    k::copy_(&t.narrow0(0..ra)?, a)?;
    k::copy_(&t.narrow0(ra..ra + rb)?, b)?;
    Ok(t)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(class_token: bool, drop: bool) -> VisionSpec {
        let encoder = clip_encoder(2, 8, 2, 16, 0.02);
        VisionSpec {
            img_h: 4,
            img_w: 6,
            patch_dim: 2,
            channels: 3,
            class_token,
            drop_class_token: drop,
            encoder,
            projector_ffn: 8,
            projector_activation: Activation::GeluExact,
            projector_bias: true,
            image_token: 3,
        }
    }

    #[test]
    fn patchify_puts_each_patch_in_conv1_weight_order() {
        let s = spec(true, true);
        let pixels: Vec<f32> = (0..2 * 3 * 4 * 6).map(|i| i as f32).collect();
        let out = s.patchify(&pixels, 2).unwrap();
        let (sl, kk) = (s.seq_len(), s.patch_len());
        assert_eq!((sl, kk, s.image_tokens()), (7, 12, 6));
        assert!(out[..kk].iter().all(|&v| v == 0.0), "the class token's row is zeros");
        // Image 1, patch (y 1, x 2) = row 1 + 1·3 + 2; value (channel 2, row 1, column 0).
        let (img, gy, gx, c, py, px) = (1, 1, 2, 2, 1, 0);
        let row = img * sl + 1 + gy * 3 + gx;
        let pixel = img * 72 + c * 24 + (gy * 2 + py) * 6 + gx * 2 + px;
        assert_eq!(out[row * kk + (c * 2 + py) * 2 + px], pixel as f32);
        assert!(s.patchify(&pixels[1..], 2).unwrap_err().to_string().contains("--img-h"));
    }

    #[test]
    fn bad_specs_name_the_flag() {
        let mut s = spec(true, true);
        s.patch_dim = 4;
        assert!(s.validate(10).unwrap_err().to_string().contains("--patch-dim"));
        let s = spec(false, true);
        assert!(s.validate(10).unwrap_err().to_string().contains("--disable-vision-class-token"));
        let mut s = spec(true, false);
        s.encoder.layer.attention.causal = true;
        assert!(s.validate(10).unwrap_err().to_string().contains("bidirectional"));
        assert!(spec(true, false).validate(3).unwrap_err().to_string().contains("image token id 3"));
        spec(true, false).validate(10).unwrap();
    }
}
