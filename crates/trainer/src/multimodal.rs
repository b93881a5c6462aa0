//! LLaVA-style runs: Megatron's vision flags (`--img-h`, `--img-w`, `--patch-dim`,
//! `--encoder-num-layers`, `--disable-vision-class-token`, `--freeze-LM`, `--freeze-ViT`) as a run
//! records them, the spec they make, and the images a sample brings.
//!
//! A sample of a multimodal run is one image and text: the language model's sequence
//! (`--seq-length`) is the image's placeholder tokens, then `--seq-length` − placeholders text
//! tokens. The placeholders' labels do not count in the loss (Megatron masks the image
//! positions). Images come from:
//! - `--image-text-data`: each record's image file (ferrotron-data's `image_text`; train.rs's
//!   `multimodal_batch` reads them);
//! - `--mock-data`: seeded noise per sample (Megatron's mock multimodal data);
//! - otherwise a synthetic captioning task over the text data (`image`): the image shows the
//!   sample's first text tokens, patch q a fixed random pattern of token q.

use crate::settings::TrainArgs;
use anyhow::bail;
use ferrotron_core::rng::Philox;
use ferrotron_transformer::VisionSpec;
use ferrotron_transformer::vision::clip_encoder;
use serde::{Deserialize, Serialize};

/// A multimodal run's image and encoder sizes, as Megatron names the flags.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct VisionSettings {
    pub img_h: usize,
    pub img_w: usize,
    pub patch_dim: usize,
    pub encoder_num_layers: usize,
    pub encoder_hidden_size: usize,
    pub encoder_num_attention_heads: usize,
    pub encoder_ffn_hidden_size: usize,
    pub disable_vision_class_token: bool,
    /// The placeholder token; None: one id past the tokenizer's vocabulary (the model's
    /// vocabulary grows by one, as LLaVA adds `<image>`).
    #[serde(default)]
    pub image_token_id: Option<u32>,
    #[serde(default)]
    pub freeze_lm: bool,
    #[serde(default)]
    pub freeze_vit: bool,
}

impl VisionSettings {
    /// The flags gathered; the encoder's sizes default to the language model's (Megatron's
    /// pretrain_vlm copies its config). None without --img-h / --img-w / --patch-dim (a vision
    /// flag is then an error naming it).
    pub fn from_args(a: &TrainArgs, lm: [usize; 4]) -> anyhow::Result<Option<VisionSettings>> {
        let [layers, hidden, heads, ffn] = lm;
        let (Some(img_h), Some(img_w), Some(patch_dim)) = (a.img_h, a.img_w, a.patch_dim) else {
            for (flag, given) in [
                ("--img-h", a.img_h.is_some()),
                ("--img-w", a.img_w.is_some()),
                ("--patch-dim", a.patch_dim.is_some()),
                ("--encoder-num-layers", a.encoder_num_layers.is_some()),
                ("--encoder-hidden-size", a.encoder_hidden_size.is_some()),
                ("--encoder-num-attention-heads", a.encoder_num_attention_heads.is_some()),
                ("--encoder-ffn-hidden-size", a.encoder_ffn_hidden_size.is_some()),
                ("--disable-vision-class-token", a.disable_vision_class_token),
                ("--image-token-id", a.image_token_id.is_some()),
                ("--freeze-LM", a.freeze_lm),
                ("--freeze-ViT", a.freeze_vit),
            ] {
                if given {
                    bail!(
                        "{flag} configures a vision encoder: give --img-h, --img-w and --patch-dim together (or drop it)"
                    );
                }
            }
            return Ok(None);
        };
        Ok(Some(VisionSettings {
            img_h,
            img_w,
            patch_dim,
            encoder_num_layers: a.encoder_num_layers.unwrap_or(layers),
            encoder_hidden_size: a.encoder_hidden_size.unwrap_or(hidden),
            encoder_num_attention_heads: a.encoder_num_attention_heads.unwrap_or(heads),
            encoder_ffn_hidden_size: a.encoder_ffn_hidden_size.unwrap_or(ffn),
            disable_vision_class_token: a.disable_vision_class_token,
            image_token_id: a.image_token_id,
            freeze_lm: a.freeze_lm,
            freeze_vit: a.freeze_vit,
        }))
    }

    /// The spec for a language model of width `hidden` over a tokenizer of `vocab` ids: a CLIP
    /// encoder, a GeLU projection through the language model's width (LLaVA-1.5's).
    pub fn spec(&self, hidden: usize, vocab: usize, std: f32) -> VisionSpec {
        let encoder = clip_encoder(
            self.encoder_num_layers,
            self.encoder_hidden_size,
            self.encoder_num_attention_heads,
            self.encoder_ffn_hidden_size,
            std,
        );
        let token = self.image_token_id.unwrap_or(vocab as u32);
        VisionSpec::llava(
            (self.img_h, self.img_w, self.patch_dim),
            encoder,
            self.disable_vision_class_token,
            hidden,
            token,
        )
    }

    /// The language model's vocabulary: the tokenizer's, plus the placeholder when it is new.
    pub fn model_vocab(&self, tokenizer_vocab: usize) -> usize {
        tokenizer_vocab + self.image_token_id.is_none() as usize
    }

    /// Sets the flags that rebuild these settings (--use-checkpoint-args).
    pub fn to_args(&self, a: &mut TrainArgs) {
        // The spec's sizes are these flags' (the vocabulary only decides a default token id).
        spec_args(&self.spec(1, 0, 0.02), a);
        a.image_token_id = self.image_token_id;
    }
}

/// The flags that build `v`'s image and encoder sizes and class token (a LLaVA preset's, an
/// import's, a run's); the placeholder id is the caller's to set.
pub fn spec_args(v: &VisionSpec, a: &mut TrainArgs) {
    (a.img_h, a.img_w, a.patch_dim) = (Some(v.img_h), Some(v.img_w), Some(v.patch_dim));
    a.encoder_num_layers = Some(v.encoder.num_layers);
    a.encoder_hidden_size = Some(v.encoder.hidden_size);
    a.encoder_num_attention_heads = Some(v.encoder.num_attention_heads);
    a.encoder_ffn_hidden_size = Some(v.encoder.ffn_hidden_size);
    a.disable_vision_class_token = v.drop_class_token;
}

/// One sample's image, [3, H, W] pixel values: noise seeded by the sample (`mock`), or the
/// synthetic caption image of `text` (patch q: token q's pattern; past the text, zeros).
pub fn image(spec: &VisionSpec, text: &[u32], sample: u64, mock: bool, seed: u64) -> Vec<f32> {
    let (h, w, p, ch) = (spec.img_h, spec.img_w, spec.patch_dim, spec.channels);
    let mut px = vec![0f32; ch * h * w];
    if mock {
        Philox::new(seed ^ 0x1a7a).with_stream(sample).fill_normal(0, 0.0, 1.0, &mut px);
        return px;
    }
    let gw = w / p;
    let mut pattern = vec![0f32; spec.patch_len()];
    for (q, &tok) in text.iter().take(spec.patches()).enumerate() {
        Philox::new(seed ^ 0x9a7c).with_stream(tok as u64).fill_normal(0, 0.0, 1.0, &mut pattern);
        let (gy, gx) = (q / gw, q % gw);
        for c in 0..ch {
            for py in 0..p {
                let dst = c * h * w + (gy * p + py) * w + gx * p;
                px[dst..dst + p].copy_from_slice(&pattern[(c * p + py) * p..(c * p + py + 1) * p]);
            }
        }
    }
    px
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> VisionSettings {
        VisionSettings {
            img_h: 4,
            img_w: 4,
            patch_dim: 2,
            encoder_num_layers: 1,
            encoder_hidden_size: 8,
            encoder_num_attention_heads: 2,
            encoder_ffn_hidden_size: 16,
            disable_vision_class_token: true,
            image_token_id: None,
            freeze_lm: false,
            freeze_vit: false,
        }
    }

    /// The caption image's patches are the text tokens' patterns: equal tokens, equal patches.
    #[test]
    fn a_caption_image_shows_its_tokens() {
        let spec = settings().spec(16, 100, 0.02);
        assert_eq!(spec.image_token, 100, "one id past the tokenizer's");
        let px = image(&spec, &[7, 9, 7, 3], 0, false, 1);
        let rows = spec.patchify(&px, 1).unwrap();
        let k = spec.patch_len();
        let patch = |q: usize| &rows[(1 + q) * k..(2 + q) * k];
        assert_eq!(patch(0), patch(2));
        assert_ne!(patch(0), patch(1));
        assert!(patch(3).iter().any(|&v| v != 0.0));
        let mock = image(&spec, &[7, 9, 7, 3], 5, true, 1);
        assert_ne!(mock, image(&spec, &[7, 9, 7, 3], 6, true, 1), "noise differs per sample");
    }
}
