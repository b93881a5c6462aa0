//! A LLaVA-style model (vision encoder + projection + language model): every parameter's gradient
//! against finite differences, where the image features go, and what the placeholders' own
//! embedding receives.

mod common;

use common::{config, directional_derivatives};
use ferrotron_core::{Cx, DType, Device, ParamTable, Tensor, rng::Philox};
use ferrotron_parallel::pipeline::StagePlan;
use ferrotron_parallel::{ProcessGroups, TensorParallel};
use ferrotron_transformer::spec::Activation;
use ferrotron_transformer::vision::clip_encoder;
use ferrotron_transformer::{Batch, GptModel, Images, Recompute, TransformerConfig, VisionSpec};

const IMAGE_TOKEN: u32 = 10;
/// Tokens a row: room for an image's 7 rows (class token kept) from position 2.
const T: usize = 10;

fn spec(drop_class_token: bool) -> VisionSpec {
    VisionSpec {
        img_h: 4,
        img_w: 6,
        patch_dim: 2,
        channels: 3,
        class_token: true,
        drop_class_token,
        encoder: clip_encoder(2, 8, 2, 12, 0.3),
        projector_ffn: 10,
        projector_activation: Activation::GeluExact,
        projector_bias: true,
        image_token: IMAGE_TOKEN,
    }
}

fn build(cfg: TransformerConfig, vision: &VisionSpec) -> (GptModel, ParamTable) {
    let tp = TensorParallel::new(ProcessGroups::single().tp, false);
    let plan = StagePlan::whole(cfg.num_layers);
    GptModel::build_multimodal(cfg, vision, &tp, &plan, Recompute::default(), &Device::Cpu, DType::F32, 3, 1).unwrap()
}

/// Two rows of `t` tokens: row r has one image's placeholders from position 1 + r on, the
/// other tokens random text; every label counts but the placeholders'.
fn tokens(vision: &VisionSpec, t: usize, seed: u64) -> (Vec<u32>, Vec<u32>, Vec<f32>) {
    let n = vision.image_tokens();
    let mut ids: Vec<u32> = (0..2 * t).map(|i| Philox::new(seed).u32_at(i as u64) % IMAGE_TOKEN).collect();
    for r in 0..2 {
        ids[r * t + 1 + r..r * t + 1 + r + n].fill(IMAGE_TOKEN);
    }
    let labels = (0..2 * t).map(|i| Philox::new(seed + 1).u32_at(i as u64) % 11).collect();
    let mask = ids.iter().map(|&x| if x == IMAGE_TOKEN { 0.0 } else { 1.0 }).collect();
    (ids, labels, mask)
}

fn pixels(vision: &VisionSpec, seed: u64) -> Vec<f32> {
    let mut v = vec![0f32; 2 * vision.channels * vision.img_h * vision.img_w];
    Philox::new(seed).fill_normal(0, 0.0, 1.0, &mut v);
    v
}

fn batch(vision: &VisionSpec, t: usize, pix: &[f32], seed: u64) -> Batch {
    let dev = Device::Cpu;
    let (ids, labels, mask) = tokens(vision, t, seed);
    let (s, k) = (vision.seq_len(), vision.patch_len());
    let patches = Tensor::from_vec(vision.patchify(pix, 2).unwrap(), [2, s, k], &dev).unwrap();
    let images = Images::new(patches, &ids, IMAGE_TOKEN);
    let ids = Tensor::from_vec(ids, [2, t], &dev).unwrap();
    Batch::masked(ids, Tensor::from_vec(labels, [2, t], &dev).unwrap(), mask).unwrap().with_images(images)
}

fn loss(model: &GptModel, table: &ParamTable, b: &Batch) -> f64 {
    model.forward(&Cx::new(table, true), b).unwrap().0
}

fn multimodal_config(llama: bool) -> TransformerConfig {
    TransformerConfig { seq_length: T, max_position_embeddings: T, ..config(llama) }
}

#[test]
fn every_parameter_gradient_matches_finite_differences() {
    for (llama, drop) in [(false, true), (true, false)] {
        let vision = spec(drop);
        let (model, table) = build(multimodal_config(llama), &vision);
        let b = batch(&vision, T, &pixels(&vision, 5), 7);
        let cx = Cx::new(&table, true);
        let (_, saved) = model.forward(&cx, &b).unwrap();
        model.backward(&cx, saved, 1.0).unwrap();
        let mut seen_vision = 0;
        for d in directional_derivatives(&table, || loss(&model, &table, &b)) {
            if d.name.starts_with("vision_") {
                seen_vision += 1;
                assert!(d.grad.iter().any(|&v| v.abs() > 1e-6), "{}: no gradient reached it", d.name);
            }
            d.assert_close(&format!("llama {llama}, drop {drop}: "));
        }
        // conv1, class token, positions, ln_pre (2), 2 layers × 12, projection (4).
        assert_eq!(seen_vision, 5 + 2 * 12 + 4, "llama {llama}");
        assert_eq!(
            table.ids().map(|id| table.meta(id).local_shape.elem_count()).sum::<usize>(),
            multimodal_config(llama).num_params() + vision.num_params(16),
            "the table holds what num_params counts"
        );
    }
}

/// The k-th placeholder takes feature row k: changing the second image moves only the second
/// row's logits from its first placeholder on, and rows swapped with their images give the same
/// losses per row.
#[test]
fn image_features_go_to_their_placeholders() {
    let vision = spec(true);
    let (model, table) = build(multimodal_config(false), &vision);
    let cx = Cx::new(&table, false);
    let pix = pixels(&vision, 5);
    let per_row = |b: &Batch| -> Vec<f32> {
        let (l, _) = model.forward_deferred(&cx, b).unwrap();
        l.per_token.to_vec_f32().unwrap()
    };
    let base = per_row(&batch(&vision, T, &pix, 7));
    let mut other = pix.clone();
    let half = other.len() / 2;
    other[half..].iter_mut().for_each(|v| *v = -*v);
    let moved = per_row(&batch(&vision, T, &other, 7));
    for i in 0..2 * T {
        let (r, t) = (i / T, i % T);
        let changed = (base[i] - moved[i]).abs() > 1e-6;
        // Row 1's placeholders start at 2 (masked: loss 0); later text positions see them.
        assert_eq!(changed, r == 1 && t >= 2 + vision.image_tokens(), "row {r} position {t}");
    }
    // With no images at all the placeholders' own embeddings are used: other losses.
    let (ids, labels, mask) = tokens(&vision, T, 7);
    let dev = Device::Cpu;
    let text = Batch::masked(
        Tensor::from_vec(ids, [2, T], &dev).unwrap(),
        Tensor::from_vec(labels, [2, T], &dev).unwrap(),
        mask,
    )
    .unwrap();
    let text_only = per_row(&text);
    assert!(text_only.iter().zip(&base).any(|(a, b)| (a - b).abs() > 1e-4));
    // What the images' forward keeps counts in the activations held: at least the encoder's
    // input and the rows each of its layers saves.
    let held = |b: &Batch| model.forward_deferred(&Cx::new(&table, true), b).unwrap().1.bytes();
    let (with, without) = (held(&batch(&vision, T, &pix, 7)), held(&text));
    let (s, cv) = (vision.seq_len(), vision.encoder.hidden_size);
    assert!(with >= without + 4 * 2 * s * (vision.patch_len() + 2 * cv), "{with} vs {without}");
}

/// The placeholders' rows were replaced, so the image token's word embedding gets no gradient
/// from them; the text tokens' rows do.
#[test]
fn placeholder_embedding_gets_no_gradient() {
    let vision = spec(true);
    let (model, table) = build(multimodal_config(true), &vision);
    let cx = Cx::new(&table, true);
    let (_, saved) = model.forward(&cx, &batch(&vision, T, &pixels(&vision, 5), 7)).unwrap();
    model.backward(&cx, saved, 1.0).unwrap();
    let g = table.grad(model.word_embeddings().unwrap()).unwrap().to_vec_f32().unwrap();
    let row = |t: usize| &g[t * 16..(t + 1) * 16];
    assert!(row(IMAGE_TOKEN as usize).iter().all(|&v| v == 0.0), "placeholder row: {:?}", row(10));
    assert!((0..IMAGE_TOKEN as usize).any(|t| row(t).iter().any(|&v| v != 0.0)));
}

/// Bad input is refused by name: a placeholder count that does not match the images, images
/// for a text model.
#[test]
fn mismatched_images_are_refused() {
    let vision = spec(true);
    let (model, table) = build(multimodal_config(false), &vision);
    let cx = Cx::new(&table, false);
    let mut b = batch(&vision, T, &pixels(&vision, 5), 7);
    let mut images = b.images.clone().unwrap();
    images.placeholders = std::sync::Arc::new(images.placeholders[1..].to_vec());
    b.images = Some(images);
    let err = model.forward(&cx, &b).err().unwrap().to_string();
    assert!(err.contains("11 image placeholder tokens") && err.contains("12 feature rows"), "{err}");
    let (text_model, text_table) = GptModel::build(multimodal_config(false), &Device::Cpu, DType::F32, 3).unwrap();
    let err = text_model.forward(&Cx::new(&text_table, false), &batch(&vision, T, &pixels(&vision, 5), 7));
    assert!(err.err().unwrap().to_string().contains("no vision encoder"));
}
