//! Format 3, the sharded checkpoint: a four-rank save stores every value of every tensor exactly
//! once across its ranks' files (nothing gathered, nothing twice), holds the values a one-rank
//! run holds, and a format 2 checkpoint (whole tensors, written by earlier builds) still resumes
//! bit for bit. (tests/resume.rs resumes sharded checkpoints across layouts.)

mod common;

use common::*;
use ferrotron_trainer::checkpoint;
use ferrotron_trainer::settings::{Launch, Paths};
use ferrotron_trainer::train::train;
use std::collections::HashMap;

/// The tensor name a stored tensor holds part of (`…@tp1`, `…+start` taken off).
fn key_of(stored: &str) -> &str {
    let k = stored.split('+').next().unwrap_or(stored);
    k.split("@tp").next().unwrap_or(k)
}

#[test]
fn a_sharded_save_stores_every_value_once() {
    // Llama style: SwiGLU's fc1 is cut in two blocks, GQA's QKV grouped; TP 2 × DP 2 with
    // sequence parallelism and the distributed optimizer: two ranks write parameters and
    // moments, two moments only.
    let mut args = tiny_args(true);
    args.global_batch_size = Some(4);
    args.micro_batch_size = Some(1);
    let s1 = settings(&args);
    let mut s4 = s1.clone();
    s4.tensor_model_parallel_size = 2;
    s4.sequence_parallel = true;
    s4.use_distributed_optimizer = true;
    stored_once(&s1, &s4, "tp-dp", 4, 2);
    // GPT-2 style, TP 2 × PP 2: the tied embedding's copy on the last stage is not written; the
    // optimizer is not distributed, so each rank writes both.
    let mut args = tiny_args(false);
    args.global_batch_size = Some(4);
    args.micro_batch_size = Some(1);
    let s1 = settings(&args);
    let mut s4 = s1.clone();
    s4.tensor_model_parallel_size = 2;
    s4.pipeline_model_parallel_size = 2;
    stored_once(&s1, &s4, "tp-pp", 4, 0);
    // Context parallel 2 × data parallel 2, distributed optimizer: the parameters are replicated
    // over all four ranks (data × context), so one writes them; the moments are sharded over all.
    let mut args = tiny_args(true);
    args.global_batch_size = Some(4);
    args.micro_batch_size = Some(1);
    let s1 = settings(&args);
    let mut s4 = s1.clone();
    s4.context_parallel_size = 2;
    s4.use_distributed_optimizer = true;
    stored_once(&s1, &s4, "cp-dp", 4, 3);
}

/// Saves `s1` on one rank and `s4` on four, at iteration 4; checks the four-rank checkpoint's
/// files (`files` of them, `moments_only` without parameters) against the one-rank one.
fn stored_once(
    s1: &ferrotron_trainer::settings::Settings,
    s4: &ferrotron_trainer::settings::Settings,
    tag: &str,
    files: usize,
    moments_only: usize,
) {
    let (dir1, dir4) = (tmp(&format!("sharded-{tag}-1")), tmp(&format!("sharded-{tag}-4")));
    let save = |s, dir: &std::path::PathBuf, launch| {
        train(s, &Paths { save: Some(dir.clone()), exit_interval: Some(4), launch, ..Paths::default() }).unwrap()
    };
    save(s1, &dir1, Launch::Single);
    save(s4, &dir4, Launch::Threads(4));
    let state = checkpoint::read_state(&dir4).unwrap();
    assert_eq!(state.format_version, 3);
    assert_eq!(state.tensor_files.len(), files, "{tag}: {:?}", state.tensor_files);
    let mut count: HashMap<String, (usize, Vec<usize>)> = HashMap::new();
    let mut per_file = vec![];
    for f in &state.tensor_files {
        let bytes = std::fs::read(dir4.join("iter_0000004").join(&f.file)).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        let header = meta.metadata().clone().unwrap();
        per_file.push(st.names().iter().filter(|n| !n.starts_with("optimizer.")).count());
        for (name, t) in st.tensors() {
            let piece: serde_json::Value = serde_json::from_str(&header[&name]).unwrap();
            let global: Vec<usize> = serde_json::from_value(piece["piece"]["global_shape"].clone()).unwrap();
            let e = count.entry(key_of(&name).to_string()).or_insert((0, global));
            e.0 += t.shape().iter().product::<usize>();
        }
    }
    assert_eq!(per_file.iter().filter(|&&n| n == 0).count(), moments_only, "{tag}: parameters per file {per_file:?}");
    let one = checkpoint::load(&dir1).unwrap();
    let mut keys: Vec<&String> = count.keys().collect();
    keys.sort();
    let mut want: Vec<&String> = one.tensors.keys().collect();
    want.sort();
    assert_eq!(keys, want, "{tag}: the same tensors as a one-rank save");
    for (key, (n, global)) in &count {
        assert_eq!(*n, global.iter().product::<usize>(), "{tag} `{key}`: stored {n} values for a whole of {global:?}");
    }
    // The values: the four-rank run's state read whole against the one-rank run's (the layouts
    // differ in summation order only).
    let four = checkpoint::load(&dir4).unwrap();
    for (name, (shape, a)) in &one.tensors {
        let (shape4, b) = &four.tensors[name];
        assert_eq!(shape, shape4, "{tag} {name}");
        let scale = a.iter().fold(1e-6f32, |m, x| m.max(x.abs()));
        let worst = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(worst <= 1e-3 * scale, "{tag} {name}: {worst} apart (largest value {scale})");
    }
    for d in [dir1, dir4] {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// A checkpoint in format 2 (every tensor whole in one file, vocabulary rows unpadded), as
/// earlier builds wrote, made here from a format 3 one read whole: resuming from either gives
/// the same losses, bit for bit.
#[test]
fn a_format_2_checkpoint_still_resumes() {
    let s = settings(&tiny_args(false));
    let (dir3, dir2) = (tmp("format3"), tmp("format2"));
    train(&s, &Paths { save: Some(dir3.clone()), exit_interval: Some(4), ..Paths::default() }).unwrap();
    let whole = checkpoint::load(&dir3).unwrap();
    let iter = dir2.join("iter_0000004");
    std::fs::create_dir_all(&iter).unwrap();
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = whole
        .tensors
        .iter()
        .map(|(n, (shape, v))| (n.clone(), shape.clone(), v.iter().flat_map(|x| x.to_le_bytes()).collect()))
        .collect();
    let views = bytes.iter().map(|(n, shape, b)| {
        (n.as_str(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), b).unwrap())
    });
    let file = iter.join("model_optim.safetensors");
    safetensors::serialize_to_file(views, None, &file).unwrap();
    let mut state = whole.state.clone();
    state.format_version = 2;
    state.vocab_size = 0; // not in format 2
    state.tensor_files = vec![checkpoint::TensorFile {
        file: "model_optim.safetensors".into(),
        sha256: ferrotron_checkpoint::sha256_hex(&std::fs::read(&file).unwrap()),
    }];
    std::fs::write(iter.join("state.toml"), toml::to_string(&state).unwrap()).unwrap();
    std::fs::write(dir2.join(checkpoint::TRACKER), "4\n").unwrap();
    let from = |d: &std::path::PathBuf| train(&s, &Paths { load: Some(d.clone()), ..Paths::default() }).unwrap();
    let (a, b) = (from(&dir3), from(&dir2));
    assert_eq!(a.losses.len(), 4);
    assert_eq!(bits(&a.losses), bits(&b.losses));
    for d in [dir3, dir2] {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// --async-save: the same checkpoints as saving in place, bit for bit, every one completed
/// (none left in its temporary folder), and training unaffected; four thread ranks, TP 2 × DP 2
/// with the distributed optimizer, a save every 2 iterations.
#[test]
fn an_asynchronous_save_writes_the_synchronous_checkpoints() {
    let mut args = tiny_args(true);
    args.global_batch_size = Some(4);
    args.micro_batch_size = Some(1);
    args.save_interval = Some(2);
    let mut s = settings(&args);
    s.tensor_model_parallel_size = 2;
    s.use_distributed_optimizer = true;
    let (dir_sync, dir_async) = (tmp("save-sync"), tmp("save-async"));
    let run = |dir: &std::path::PathBuf, async_save| {
        let p = Paths { save: Some(dir.clone()), async_save, launch: Launch::Threads(4), ..Paths::default() };
        train(&s, &p).unwrap()
    };
    let (a, b) = (run(&dir_sync, false), run(&dir_async, true));
    assert_eq!(bits(&a.losses), bits(&b.losses));
    let names = |v: &[std::path::PathBuf]| v.iter().map(|d| d.file_name().unwrap().to_owned()).collect::<Vec<_>>();
    assert_eq!(names(&b.checkpoints), names(&a.checkpoints));
    assert_eq!(a.checkpoints.len(), 4);
    for (x, y) in a.checkpoints.iter().zip(&b.checkpoints) {
        let (x, y) = (checkpoint::load(x).unwrap(), checkpoint::load(y).unwrap());
        assert_eq!(x.state.iteration, y.state.iteration);
        assert_eq!(x.tensors.len(), y.tensors.len());
        for (name, (shape, v)) in &x.tensors {
            let (shape_y, w) = &y.tensors[name];
            assert_eq!(shape, shape_y);
            assert!(v.iter().zip(w).all(|(p, q)| p.to_bits() == q.to_bits()), "{name} at {}", x.state.iteration);
        }
    }
    let left: Vec<_> = std::fs::read_dir(&dir_async)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with(".tmp"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
    assert_eq!(checkpoint::read_state(&dir_async).unwrap().iteration, 8);
    for d in [dir_sync, dir_async] {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// --no-save-optim: the parameters alone, those of a full save bit for bit, marked as such;
/// resuming from it is refused with the way to load it, and --no-load-optim takes it (its first
/// loss is the full checkpoint's resumed one).
#[test]
fn a_save_without_the_optimizer_holds_the_parameters_alone() {
    use ferrotron_trainer::settings::LoadMode;
    let s = settings(&tiny_args(true));
    let (full, lean) = (tmp("save-full"), tmp("save-lean"));
    let save = |dir: &std::path::PathBuf, no_save_optim| {
        let p = Paths { save: Some(dir.clone()), exit_interval: Some(4), no_save_optim, ..Paths::default() };
        train(&s, &p).unwrap()
    };
    save(&full, false);
    save(&lean, true);
    let (a, b) = (checkpoint::load(&full).unwrap(), checkpoint::load(&lean).unwrap());
    assert!(a.state.optimizer_state && !b.state.optimizer_state);
    assert!(b.tensors.keys().all(|k| !k.starts_with("optimizer.")), "{:?}", b.tensors.keys());
    assert_eq!(b.tensors.len() * 4, a.tensors.len());
    for (name, t) in &b.tensors {
        assert!(a.tensors[name] == *t, "{name} differs from the full save's");
    }
    let e = train(&s, &Paths { load: Some(lean.clone()), ..Paths::default() }).err().unwrap().to_string();
    assert!(e.contains("--finetune") && e.contains("--no-load-optim"), "{e}");
    let load = |dir: &std::path::PathBuf, load_mode| {
        train(&s, &Paths { load: Some(dir.clone()), load_mode, ..Paths::default() }).unwrap()
    };
    let (resumed, fresh) = (load(&full, LoadMode::Resume), load(&lean, LoadMode::NoOptim));
    assert_eq!((resumed.losses[0].0, fresh.losses[0].0), (5, 5));
    assert_eq!(resumed.losses[0].1.to_bits(), fresh.losses[0].1.to_bits());
    for d in [full, lean] {
        let _ = std::fs::remove_dir_all(d);
    }
}
