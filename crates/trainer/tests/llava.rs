//! LLaVA-style runs through the trainer (--img-h, --img-w, --patch-dim, --encoder-*): the layouts
//! that split them train as one rank does, a run resumes bit for bit with Megatron's names,
//! --freeze-LM and --freeze-ViT leave exactly their parameters alone, and bad flags are refused
//! by name.

mod common;

use common::*;
use ferrotron_trainer::checkpoint;
use ferrotron_trainer::settings::{Paths, Settings, TrainArgs};
use ferrotron_trainer::train::train;

/// llava-tiny's shape at test size: 8 × 8 images in 4 × 4 patches (4 placeholders after the
/// class token is dropped) before 28 text tokens; a 2-layer encoder of width 16.
fn llava_args() -> TrainArgs {
    TrainArgs {
        preset: Some("llava-tiny".into()),
        img_h: Some(8),
        img_w: Some(8),
        patch_dim: Some(4),
        encoder_num_layers: Some(2),
        encoder_hidden_size: Some(16),
        encoder_num_attention_heads: Some(2),
        encoder_ffn_hidden_size: Some(32),
        ..tiny_args(true)
    }
}

/// Data parallel (distributed optimizer, overlap), tensor parallel with sequence parallelism
/// (the encoder's heads split, each rank placing the image rows of its sequence slice), and the
/// pipeline (the encoder on the first stage): one rank's losses, gradient norms and validation
/// losses.
#[test]
fn llava_layouts_follow_one_rank() {
    let s1 = settings(&llava_args());
    let one = run(&s1, 1);
    assert!(one.losses.last().unwrap().1 < one.losses[0].1, "it learns: {:?}", one.losses);
    let with = |f: &dyn Fn(&mut Settings)| {
        let mut s = s1.clone();
        f(&mut s);
        s
    };
    let dp = with(&|s| {
        s.use_distributed_optimizer = true;
        s.overlap_grad_reduce = true;
    });
    let tp = with(&|s| {
        s.tensor_model_parallel_size = 2;
        s.sequence_parallel = true;
    });
    let pp = with(&|s| s.pipeline_model_parallel_size = 2);
    for (tag, s) in [("dp2", &dp), ("tp2 sp", &tp), ("pp2", &pp)] {
        follows(tag, &run(s, 2), &one);
    }
    // --freeze-LM under pp2: the last stage holds only frozen parameters (nothing to update or
    // count in the norm there).
    let frozen = with(&|s| s.vision.as_mut().unwrap().freeze_lm = true);
    let frozen_pp = with(&|s| {
        s.vision.as_mut().unwrap().freeze_lm = true;
        s.pipeline_model_parallel_size = 2;
    });
    follows("pp2 --freeze-LM", &run(&frozen_pp, 2), &run(&frozen, 1));
}

/// Four steps, save, load, four steps: the straight run's losses and parameters, bit for bit;
/// the checkpoint holds Megatron's names and records the vision flags, which
/// --use-checkpoint-args takes back.
#[test]
fn llava_resume_is_bit_exact() {
    let s = settings(&llava_args());
    let (a, b, c) = (tmp("llava-a"), tmp("llava-b"), tmp("llava-c"));
    let straight = train(&s, &Paths { save: Some(a.clone()), ..Paths::default() }).unwrap();
    train(&s, &Paths { save: Some(b.clone()), exit_interval: Some(4), ..Paths::default() }).unwrap();
    let second = train(&s, &Paths { save: Some(c.clone()), load: Some(b.clone()), ..Paths::default() }).unwrap();
    assert_eq!(bits(&straight.losses[4..]), bits(&second.losses));
    let (ka, kc) = (checkpoint::load(&a).unwrap(), checkpoint::load(&c).unwrap());
    let shape = |n: &str| ka.tensors.get(n).unwrap_or_else(|| panic!("{n} missing")).0.clone();
    assert_eq!(shape("vision_model.conv1.weight"), vec![16, 3, 4, 4]);
    assert_eq!(shape("vision_model.class_token"), vec![1, 1, 16]);
    assert_eq!(shape("vision_model.position_embeddings.weight"), vec![5, 16]);
    assert_eq!(shape("vision_model.decoder.layers.1.mlp.linear_fc2.weight"), vec![16, 32]);
    assert_eq!(shape("vision_projection.encoder.linear_fc1.weight"), vec![32, 16]);
    assert_eq!(shape("vision_projection.encoder.linear_fc2.weight"), vec![32, 32]);
    assert!(ka.tensors.contains_key("vision_model.ln_pre.weight"));
    for (name, (_, x)) in &ka.tensors {
        assert!(x.iter().zip(&kc.tensors[name].1).all(|(x, y)| x.to_bits() == y.to_bits()), "{name} differs");
    }
    let v = ka.state.settings.vision.as_ref().expect("the vision flags are recorded");
    assert_eq!((v.img_h, v.patch_dim, v.encoder_hidden_size, v.disable_vision_class_token), (8, 4, 16, true));
    // --use-checkpoint-args rebuilds the multimodal model under another preset's name.
    let back = settings(&TrainArgs {
        preset: Some("tiny".into()),
        load: Some(a.clone()),
        use_checkpoint_args: true,
        ..TrainArgs::default()
    });
    assert_eq!(back.vision, ka.state.settings.vision);
    assert_eq!(back.model_config().unwrap().vocab_size, s.model_config().unwrap().vocab_size);
    for d in [a, b, c] {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// Megatron's freezing: with --freeze-LM only the vision encoder and projection move; with
/// --freeze-ViT everything but the encoder. Compared with the parameters the run started from
/// (the model built from the same settings and seed), bit for bit.
#[test]
fn freezing_leaves_exactly_its_parameters() {
    use ferrotron_core::{DType, Device};
    use ferrotron_parallel::{ProcessGroups, TensorParallel, pipeline::StagePlan};
    let s = settings(&llava_args());
    let (c, v) = (s.model_config().unwrap(), s.vision_spec().unwrap().unwrap());
    let tp = TensorParallel::new(ProcessGroups::single().tp, false);
    let plan = StagePlan::whole(c.num_layers);
    let recompute = ferrotron_transformer::Recompute::default();
    let (_, init) = ferrotron_transformer::GptModel::build_multimodal(
        c,
        &v,
        &tp,
        &plan,
        recompute,
        &Device::Cpu,
        DType::F32,
        s.seed,
        1,
    )
    .unwrap();
    let start: std::collections::HashMap<String, Vec<f32>> =
        init.ids().map(|id| (init.meta(id).name.clone(), init.param(id).unwrap().to_vec_f32().unwrap())).collect();
    let saved = |name: &str, f: &dyn Fn(&mut TrainArgs)| {
        let mut a = llava_args();
        f(&mut a);
        let dir = tmp(name);
        train(&settings(&a), &Paths { save: Some(dir.clone()), ..Paths::default() }).unwrap();
        let k = checkpoint::load(&dir).unwrap().tensors;
        let _ = std::fs::remove_dir_all(dir);
        k
    };
    let lm = saved("llava-freeze-lm", &|a| a.freeze_lm = true);
    let vit = saved("llava-freeze-vit", &|a| a.freeze_vit = true);
    let same = |k: &std::collections::HashMap<String, (Vec<usize>, Vec<f32>)>, n: &str| {
        // The checkpoint's vocabulary rows are unpadded: the table's first rows.
        k[n].1.iter().zip(&start[n]).all(|(x, y)| x.to_bits() == y.to_bits())
    };
    for name in start.keys() {
        let vision_model = name.starts_with("vision_model.");
        let projection = name.starts_with("vision_projection.");
        assert_eq!(same(&lm, name), !vision_model && !projection, "--freeze-LM: {name}");
        assert_eq!(same(&vit, name), vision_model, "--freeze-ViT: {name}");
    }
    assert!(start.len() > 30, "{} parameters compared", start.len());
}

/// What cannot work is refused by name.
#[test]
fn llava_flags_are_checked() {
    let err = |a: TrainArgs| Settings::resolve(&a).map(|_| ()).expect_err("refused").to_string();
    let e = err(TrainArgs { freeze_lm: true, ..tiny_args(true) });
    assert!(e.contains("--freeze-LM") && e.contains("--img-h"), "{e}");
    let e = err(TrainArgs { patch_dim: Some(3), ..llava_args() });
    assert!(e.contains("--patch-dim"), "{e}");
    let e = err(TrainArgs { seq_length: Some(4), max_position_embeddings: Some(4), ..llava_args() });
    assert!(e.contains("--seq-length 4 leaves no text"), "{e}");
    let e = err(TrainArgs { context_parallel_size: Some(2), nproc: Some(2), ..llava_args() });
    assert!(e.contains("vision encoder"), "{e}");
    let e = err(TrainArgs { image_token_id: Some(100_000), ..llava_args() });
    assert!(e.contains("image token id 100000"), "{e}");
}

/// 64 image-text pairs on disk (LLaVA-Pretrain's JSON): 8 × 8 PNGs, red or blue with noise,
/// captioned "colour red" or "colour blue" — or, with `informative` false, captioned without
/// regard to the colour.
fn pairs(name: &str, informative: bool) -> std::path::PathBuf {
    let d = tmp(name);
    std::fs::create_dir_all(d.join("img")).unwrap();
    let mut records = vec![];
    for i in 0..64u32 {
        let red = i % 2 == 0;
        let px = |x: u32, y: u32| ((x * 64 + y * 8 + i).wrapping_mul(2_654_435_761) >> 27) as u8;
        let img = image::RgbImage::from_fn(8, 8, |x, y| {
            let n = px(x, y);
            if red { image::Rgb([215 + n, n, n]) } else { image::Rgb([n, n, 215 + n]) }
        });
        img.save(d.join(format!("img/{i}.png"))).unwrap();
        let says_red = if informative { red } else { (i / 2) % 2 == 0 };
        // The first text token's label is the last placeholder's, out of the loss (as in
        // Megatron): the colour comes second.
        let caption = if says_red { "colour red" } else { "colour blue" };
        records.push(serde_json::json!({
            "id": i.to_string(),
            "image": format!("img/{i}.png"),
            "conversations": [{"from": "human", "value": "<image>\nWhat colour?"}, {"from": "gpt", "value": caption}],
        }));
    }
    std::fs::write(d.join("pairs.json"), serde_json::to_string(&records).unwrap()).unwrap();
    d
}

/// --image-text-data: records read (LLaVA's JSON, or a webdataset shard of the same pairs, which
/// trains the same bit for bit), images decoded and normalised, captions padded per record
/// (the padding out of the loss). A model that sees the images learns the captions that depend on
/// them below what the text alone allows (the same run with captions that do not match the
/// images); tensor parallelism with SP follows one rank on them; a missing image is named.
#[test]
fn image_text_pairs_train_and_the_images_inform_the_captions() {
    let args = |d: &std::path::Path| TrainArgs {
        image_text_data: Some(d.join("pairs.json")),
        split: Some("90,10,0".into()),
        train_iters: Some(200),
        lr: Some(3e-3),
        lr_warmup_iters: Some(10),
        eval_interval: Some(200),
        eval_iters: Some(4),
        ..llava_args()
    };
    let (good, noise) = (pairs("llava-pairs", true), pairs("llava-noise", false));
    let informed = run(&settings(&args(&good)), 1);
    let uninformed = run(&settings(&args(&noise)), 1);
    let (a, b) = (informed.evals.last().unwrap().1, uninformed.evals.last().unwrap().1);
    eprintln!("validation loss with matching images {a}, with unrelated ones {b}");
    assert!(a < b - 0.05, "with matching images {a}, with unrelated ones {b}");
    // The same pairs as a webdataset shard (KEY.png, KEY.txt), in the same order: the same run.
    let shard = good.join("pairs-000.tar");
    let mut t = tar::Builder::new(std::fs::File::create(&shard).unwrap());
    for i in 0..64 {
        t.append_path_with_name(good.join(format!("img/{i}.png")), format!("{i:03}.png")).unwrap();
        let caption = if i % 2 == 0 { "colour red" } else { "colour blue" };
        let mut h = tar::Header::new_gnu();
        h.set_size(caption.len() as u64);
        h.set_mode(0o644);
        h.set_cksum();
        t.append_data(&mut h, format!("{i:03}.txt"), caption.as_bytes()).unwrap();
    }
    t.finish().unwrap();
    drop(t);
    let from_shard = run(&settings(&TrainArgs { image_text_data: Some(shard), ..args(&good) }), 1);
    assert_eq!(bits(&from_shard.losses), bits(&informed.losses), "the shard trains as the JSON does");
    let mut tp = settings(&args(&good));
    tp.train_iters = 6;
    let mut one = tp.clone();
    one.train_iters = 6;
    tp.tensor_model_parallel_size = 2;
    tp.sequence_parallel = true;
    follows("tp2 sp on image files", &run(&tp, 2), &run(&one, 1));
    std::fs::remove_file(good.join("img/3.png")).unwrap();
    let e = ferrotron_trainer::train::train(&settings(&args(&good)), &Paths::default()).unwrap_err();
    assert!(format!("{e:#}").contains("3.png"), "{e:#}");
    let e = Settings::resolve(&TrainArgs { image_text_data: Some(good.join("pairs.json")), ..tiny_args(true) })
        .map(|_| ())
        .expect_err("refused");
    assert!(e.to_string().contains("--img-h"), "{e}");
    for d in [good, noise] {
        let _ = std::fs::remove_dir_all(d);
    }
}
