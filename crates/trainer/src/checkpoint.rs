//! Checkpoints: `{save}/iter_0000120/` holds one `model_optim.safetensors` per pipeline stage
//! (`model_optim_pp001.safetensors` for stage 1 when there are several) and `state.toml`;
//! `{save}/latest_checkpointed_iteration.txt` (Megatron's tracker name) names the newest.
//!
//! Format 2 stores every parameter whole, by its Megatron name (`{name}` in the model dtype) with
//! its fp32 optimizer state (`optimizer.master.{name}`, `optimizer.exp_avg.{name}`,
//! `optimizer.exp_avg_sq.{name}`), so a run can resume under another tensor-parallel, pipeline,
//! data-parallel or distributed-optimizer layout: each stage gathers its shards to its first rank,
//! which writes the stage's file; loading reads every file and lets each rank take its part.
//! `state.toml` holds the iteration, data position, optimizer step, settings and each file's
//! SHA-256. A checkpoint converted from Hugging Face (`save_params`) holds the parameters alone
//! and says so (`optimizer_state = false`): it loads with --finetune or --no-load-optim. Vocabulary padding may differ between layouts: rows past the real vocabulary are not
//! kept. A tied embedding held by the first and last stage is in both files (same values).
//!
//! Writes go to a temporary folder that is renamed into place, and the tracker is replaced
//! atomically after that, so a save that fails midway leaves the previous checkpoint and tracker as
//! they were. (Gathering to one rank bounds the model size; the sharded format of
//! ferrotron-checkpoint will replace this module.)

use crate::settings::Settings;
use anyhow::{Context, bail};
use ferrotron_comm::ReduceOp;
use ferrotron_core::{DType, Device, ParamMeta, ParamTable, Tensor, bf16};
use ferrotron_optim::Optimizer;
use ferrotron_parallel::{ProcessGroups, gather_param, global_flat_index};
use safetensors::{Dtype, SafeTensors, tensor::TensorView};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

pub const FORMAT_VERSION: u32 = 2;
pub const TRACKER: &str = "latest_checkpointed_iteration.txt";
/// The tensor file of pipeline stage `stage` (of `stages`).
fn tensor_file(stage: usize, stages: usize) -> String {
    if stages == 1 { "model_optim.safetensors".into() } else { format!("model_optim_pp{stage:03}.safetensors") }
}
const STATE: &str = "state.toml";
const OPT: [&str; 3] = ["optimizer.master", "optimizer.exp_avg", "optimizer.exp_avg_sq"];

#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct State {
    pub format_version: u32,
    pub iteration: u64,
    pub consumed_samples: u64,
    /// Validation samples read by the evaluations so far (each reads on from the last, as
    /// Megatron's); absent in checkpoints from before it was kept.
    #[serde(default)]
    pub consumed_valid_samples: u64,
    pub optimizer_step: u64,
    /// False for parameters alone (`ferrotron convert` from Hugging Face): such a checkpoint
    /// loads with --finetune or --no-load-optim.
    #[serde(default = "yes")]
    pub optimizer_state: bool,
    pub params_dtype: String,
    /// Tensor files, one per pipeline stage, with their SHA-256.
    pub tensor_files: Vec<TensorFile>,
    pub settings: Settings,
}

fn yes() -> bool {
    true
}

#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct TensorFile {
    pub file: String,
    pub sha256: String,
}

/// A checkpoint in host memory: every tensor whole, by name, as f32.
pub struct Loaded {
    pub state: State,
    pub tensors: HashMap<String, (Vec<usize>, Vec<f32>)>,
}

pub fn iter_dir(save: &Path, iteration: u64) -> PathBuf {
    save.join(format!("iter_{iteration:07}"))
}

fn vocab_padded(name: &str) -> bool {
    name.ends_with("word_embeddings.weight") || name == "output_layer.weight"
}

/// What one save records besides the tensors.
pub struct SaveInfo<'a> {
    pub iteration: u64,
    pub consumed_samples: u64,
    pub consumed_valid_samples: u64,
    pub settings: &'a Settings,
    /// Real vocabulary: rows past it (padding) are not written.
    pub vocab_size: usize,
}

/// Collective over the world: gathers params and optimizer state, world rank 0 writes atomically.
/// Returns the checkpoint folder on every rank (or every rank's error if the write failed).
pub fn save(
    save_dir: &Path,
    g: &ProcessGroups,
    table: &ParamTable,
    opt: &Optimizer,
    info: &SaveInfo,
) -> anyhow::Result<PathBuf> {
    table.settle_params()?; // pending gathers (--overlap-param-gather) before anything reads
    let (state, step) = opt.full_state(table.flat_len())?;
    let writer = g.tp.rank() == 0 && g.dp.rank() == 0; // one per pipeline stage
    let mut tensors: Vec<(String, DType, Vec<usize>, Vec<f32>)> = vec![];
    for id in table.ids() {
        let m = table.meta(id);
        let r = table.range(id);
        let mut shape = m.global_shape.dims().to_vec();
        if vocab_padded(&m.name) && shape[0] > info.vocab_size {
            shape[0] = info.vocab_size; // padding rows are not kept
        }
        let n: usize = shape.iter().product();
        let trim = |mut v: Vec<f32>| {
            v.truncate(n);
            v
        };
        let p = trim(gather_param(&g.tp, m, &table.param(id)?)?);
        let mut states = vec![];
        for buf in &state {
            let local = Tensor::from_f32(&buf[r.clone()], m.local_shape.clone(), DType::F32, &Device::Cpu)?;
            states.push(trim(gather_param(&g.tp, m, &local)?));
        }
        if writer {
            tensors.push((m.name.clone(), table.flat_params().dtype(), shape.clone(), p));
            for (prefix, v) in OPT.iter().zip(states) {
                tensors.push((format!("{prefix}.{}", m.name), DType::F32, shape.clone(), v));
            }
        }
    }
    drop(state); // the per-tensor copies above are what gets written
    let (stage, stages) = (g.pp.rank(), g.pp.size());
    let tmp = save_dir.join(format!(".tmp-iter_{:07}", info.iteration));
    // World rank 0 prepares the folder; every stage's writer then adds its file.
    let prepared = if g.world.rank() == 0 { prepare(save_dir, &tmp) } else { Ok(()) };
    agree(g, prepared.is_ok(), info.iteration)?;
    prepared?;
    let written = if writer { write_stage(&tmp, &tensor_file(stage, stages), &tensors) } else { Ok(String::new()) };
    // Every rank learns every stage's checksum (and whether its write worked).
    let mut mine = vec![writer as u32, stage as u32, written.is_ok() as u32];
    mine.extend(hex_words(written.as_deref().unwrap_or("")));
    let n = g.world.size();
    let all = Tensor::zeros([n * mine.len()], DType::U32, &Device::Cpu)?;
    g.world.all_gather(&Tensor::from_vec(mine.clone(), [mine.len()], &Device::Cpu)?, &all)?;
    let all = all.to_vec::<u32>()?;
    written?;
    let mut files: Vec<Option<TensorFile>> = vec![None; stages];
    for x in all.chunks(mine.len()) {
        if x[0] == 1 {
            if x[2] != 1 {
                bail!(
                    "saving iteration {}: the writer of pipeline stage {} failed (see its error)",
                    info.iteration,
                    x[1]
                );
            }
            files[x[1] as usize] =
                Some(TensorFile { file: tensor_file(x[1] as usize, stages), sha256: words_hex(&x[3..]) });
        }
    }
    let files: Vec<TensorFile> = files.into_iter().collect::<Option<_>>().context("a pipeline stage wrote no file")?;
    let dtype = table.flat_params().dtype().to_string();
    let done = if g.world.rank() == 0 { finish(save_dir, &tmp, &dtype, files, Some(step), info) } else { Ok(()) };
    agree(g, done.is_ok(), info.iteration)?;
    done?;
    Ok(iter_dir(save_dir, info.iteration))
}

/// Writes a checkpoint of parameters alone at iteration 0 (`ferrotron convert`): `tensors` whole,
/// by Megatron name, each with the dtype it is stored in, vocabulary rows unpadded; `dtype` is
/// the run's parameter dtype. Written as `save` writes (a temporary folder renamed into place,
/// then the tracker); state.toml says `optimizer_state = false`.
pub fn save_params(
    save_dir: &Path,
    tensors: &[(String, DType, Vec<usize>, Vec<f32>)],
    dtype: DType,
    settings: &Settings,
) -> anyhow::Result<PathBuf> {
    let tmp = save_dir.join(".tmp-iter_0000000");
    prepare(save_dir, &tmp)?;
    let file = tensor_file(0, 1);
    let sha256 = write_stage(&tmp, &file, tensors)?;
    // (vocab_size only trims gathered tensors in `save`; these come trimmed.)
    let info = SaveInfo { iteration: 0, consumed_samples: 0, consumed_valid_samples: 0, settings, vocab_size: 0 };
    finish(save_dir, &tmp, &dtype.to_string(), vec![TensorFile { file, sha256 }], None, &info)?;
    Ok(iter_dir(save_dir, 0))
}

/// Fails every rank when one rank's part failed (after all of them took part).
fn agree(g: &ProcessGroups, ok: bool, iteration: u64) -> anyhow::Result<()> {
    let t = Tensor::from_vec(vec![if ok { 1f32 } else { 0.0 }], [1], &Device::Cpu)?;
    g.world.all_reduce(&t, ReduceOp::Min)?;
    if t.to_vec_f32()?[0] != 1.0 && ok {
        bail!("saving iteration {iteration} failed on another rank (see its error)");
    }
    Ok(())
}

fn hex_words(hex: &str) -> Vec<u32> {
    let mut b = [0u8; 32];
    for (i, c) in b.iter_mut().enumerate() {
        *c = hex.get(2 * i..2 * i + 2).and_then(|h| u8::from_str_radix(h, 16).ok()).unwrap_or(0);
    }
    b.chunks(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

fn words_hex(w: &[u32]) -> String {
    w.iter().flat_map(|x| x.to_le_bytes()).map(|b| format!("{b:02x}")).collect()
}

fn prepare(save_dir: &Path, tmp: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(save_dir)
        .with_context(|| format!("--save {}: cannot create the folder", save_dir.display()))?;
    if tmp.exists() {
        std::fs::remove_dir_all(tmp)?;
    }
    std::fs::create_dir_all(tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
    Ok(())
}

/// Writes one stage's tensors, streamed to the file (f32 data straight from the gathered vectors:
/// no whole-file buffer), synced; returns the SHA-256 of the file as it lies on disk.
fn write_stage(tmp: &Path, file: &str, tensors: &[(String, DType, Vec<usize>, Vec<f32>)]) -> anyhow::Result<String> {
    let encoded: Vec<(Cow<[u8]>, Dtype)> =
        tensors.iter().map(|(_, d, _, v)| tensor_bytes(*d, v)).collect::<anyhow::Result<_>>()?;
    let views = tensors
        .iter()
        .zip(&encoded)
        .map(|((name, _, shape, _), (b, d))| Ok((name.as_str(), TensorView::new(*d, shape.clone(), b)?)))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let path = tmp.join(file);
    safetensors::serialize_to_file(views, None, &path).with_context(|| format!("cannot write {}", path.display()))?;
    let mut f = std::fs::File::open(&path)?;
    f.sync_all()?;
    sha256_file(&mut f)
}

pub(crate) fn tensor_bytes(dtype: DType, v: &[f32]) -> anyhow::Result<(Cow<'_, [u8]>, Dtype)> {
    Ok(match dtype {
        // safetensors is little-endian, like every target Ferrotron builds for today.
        DType::F32 if cfg!(target_endian = "little") => (Cow::Borrowed(bytemuck::cast_slice(v)), Dtype::F32),
        DType::F32 => (Cow::Owned(v.iter().flat_map(|x| x.to_le_bytes()).collect()), Dtype::F32),
        DType::BF16 => {
            (Cow::Owned(v.iter().flat_map(|&x| bf16::from_f32(x).to_bits().to_le_bytes()).collect()), Dtype::BF16)
        }
        d => bail!("saving {d} parameters is not supported"),
    })
}

/// SHA-256 of a file, read in chunks.
fn sha256_file(f: &mut std::fs::File) -> anyhow::Result<String> {
    use std::io::Read;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 8 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// World rank 0: state.toml, then the folder renamed into place, then the tracker. `step`: the
/// optimizer's step, None where no optimizer state is saved.
fn finish(
    save_dir: &Path,
    tmp: &Path,
    params_dtype: &str,
    tensor_files: Vec<TensorFile>,
    step: Option<u64>,
    info: &SaveInfo,
) -> anyhow::Result<()> {
    let iteration = info.iteration;
    let state = State {
        format_version: FORMAT_VERSION,
        iteration,
        consumed_samples: info.consumed_samples,
        consumed_valid_samples: info.consumed_valid_samples,
        optimizer_step: step.unwrap_or(0),
        optimizer_state: step.is_some(),
        params_dtype: params_dtype.to_string(),
        tensor_files,
        settings: info.settings.clone(),
    };
    write_synced(&tmp.join(STATE), toml::to_string(&state)?.as_bytes())?;
    let final_dir = iter_dir(save_dir, iteration);
    if final_dir.exists() {
        // Re-saving the same iteration: move the old one aside first so a crash never leaves neither.
        let old = save_dir.join(format!(".old-iter_{iteration:07}-{}", std::process::id()));
        std::fs::rename(&final_dir, &old)?;
        std::fs::rename(tmp, &final_dir)?;
        std::fs::remove_dir_all(&old)?;
    } else {
        std::fs::rename(tmp, &final_dir)?;
    }
    let tracker_tmp = save_dir.join(format!(".{TRACKER}.tmp"));
    write_synced(&tracker_tmp, format!("{iteration}\n").as_bytes())?;
    std::fs::rename(&tracker_tmp, save_dir.join(TRACKER))?;
    Ok(())
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

fn write_synced(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    use std::io::Write;
    let mut f = std::fs::File::create(path).with_context(|| format!("cannot write {}", path.display()))?;
    f.write_all(bytes)?;
    f.sync_all()?;
    Ok(())
}

/// The checkpoint folder `dir` names: a --save folder (follow its tracker) or an iter_* folder.
pub fn resolve(dir: &Path) -> anyhow::Result<PathBuf> {
    if dir.join(STATE).is_file() {
        return Ok(dir.to_path_buf());
    }
    let tracker = dir.join(TRACKER);
    let text = std::fs::read_to_string(&tracker)
        .with_context(|| format!("--load {}: no {TRACKER} and no {STATE}: not a checkpoint folder", dir.display()))?;
    let it: u64 = text.trim().parse().with_context(|| {
        format!("{}: corrupt tracker (expected an iteration number, found {:?})", tracker.display(), text.trim())
    })?;
    let d = iter_dir(dir, it);
    if !d.join(STATE).is_file() {
        bail!("{}: the tracker names iteration {it} but {} is missing", tracker.display(), d.display());
    }
    Ok(d)
}

/// A tensor of a safetensors file as f32 values (stored as f32, bf16 or f16).
pub(crate) fn f32_values(st: &SafeTensors, name: &str, file: &Path) -> anyhow::Result<(Vec<usize>, Vec<f32>)> {
    let t = st.tensor(name).with_context(|| format!("{}: corrupt checkpoint: no tensor `{name}`", file.display()))?;
    let data = t.data();
    let v: Vec<f32> = match t.dtype() {
        Dtype::F32 => data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        Dtype::BF16 => {
            data.chunks_exact(2).map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32()).collect()
        }
        Dtype::F16 => {
            data.chunks_exact(2).map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32()).collect()
        }
        d => bail!("{}: tensor `{name}` has dtype {d:?} (f32, bf16 and f16 are read)", file.display()),
    };
    if v.len() != t.shape().iter().product::<usize>() {
        bail!("{}: corrupt checkpoint: `{name}` has {} values for shape {:?}", file.display(), v.len(), t.shape());
    }
    Ok((t.shape().to_vec(), v))
}

/// The state.toml of the checkpoint folder `dir` names (see `resolve`), checked for its format.
pub fn read_state(dir: &Path) -> anyhow::Result<State> {
    let state_path = resolve(dir)?.join(STATE);
    let text = std::fs::read_to_string(&state_path).with_context(|| format!("cannot read {}", state_path.display()))?;
    let state: State =
        toml::from_str(&text).with_context(|| format!("{}: corrupt checkpoint state", state_path.display()))?;
    if state.format_version != FORMAT_VERSION {
        bail!(
            "{}: checkpoint format {} but this build reads format {FORMAT_VERSION}",
            state_path.display(),
            state.format_version
        );
    }
    Ok(state)
}

/// Loads and verifies a checkpoint folder (see `resolve`).
pub fn load(dir: &Path) -> anyhow::Result<Loaded> {
    load_where(dir, |_| true)
}

/// `load` without the optimizer state (a quarter of the memory of a trained checkpoint):
/// generation, export, `--finetune`.
pub fn load_params(dir: &Path) -> anyhow::Result<Loaded> {
    load_where(dir, |name| !OPT.iter().any(|p| name.strip_prefix(p).is_some_and(|r| r.starts_with('.'))))
}

/// `load` of the tensors whose names `keep` takes (every file is still verified whole).
fn load_where(dir: &Path, keep: impl Fn(&str) -> bool) -> anyhow::Result<Loaded> {
    let state = read_state(dir)?;
    let dir = resolve(dir)?;
    let mut tensors = HashMap::new();
    for tf in &state.tensor_files {
        let file = dir.join(&tf.file);
        let bytes = std::fs::read(&file).with_context(|| format!("cannot read {}", file.display()))?;
        let sha = sha256_hex(&bytes);
        if sha != tf.sha256 {
            bail!(
                "{}: corrupt checkpoint: SHA-256 {sha} does not match {} recorded in {STATE}",
                file.display(),
                tf.sha256
            );
        }
        let st = SafeTensors::deserialize(&bytes).with_context(|| format!("{}: corrupt checkpoint", file.display()))?;
        for name in st.names() {
            if keep(name) && !tensors.contains_key(name) {
                tensors.insert(name.to_string(), f32_values(&st, name, &file)?);
            }
        }
    }
    Ok(Loaded { state, tensors })
}

/// This rank's part of a whole tensor saved as `saved_shape`, for parameter `m`. Vocabulary rows
/// missing from the file (padding) read as 0.
fn local_part(m: &ParamMeta, saved_shape: &[usize], whole: &[f32]) -> anyhow::Result<Vec<f32>> {
    let g = m.global_shape.dims();
    let rows_differ = vocab_padded(&m.name) && saved_shape.len() == g.len() && saved_shape[1..] == g[1..];
    if saved_shape != g && !rows_differ {
        bail!(
            "checkpoint parameter `{}` is {saved_shape:?} but the model's is {g:?}: the model flags differ from the saved run",
            m.name
        );
    }
    let have = whole.len();
    Ok((0..m.local_shape.elem_count())
        .map(|i| {
            let gi = global_flat_index(m, m.shard, i);
            if gi < have { whole[gi] } else { 0.0 }
        })
        .collect())
}

/// Puts a loaded checkpoint into this rank's parameters and optimizer (any layout).
pub fn restore(ck: &Loaded, table: &ParamTable, opt: &mut Optimizer) -> anyhow::Result<()> {
    if !ck.state.optimizer_state {
        bail!(
            "the checkpoint holds parameters only (no optimizer state, e.g. one converted from Hugging Face): load it with --finetune (or --no-load-optim)"
        );
    }
    table.settle_params()?; // no gather still pending may overwrite what is restored
    if let Some(m) = table.metas().iter().find(|m| !ck.tensors.contains_key(&m.name)) {
        bail!("the checkpoint has no `{}`: the model flags differ from the saved run", m.name);
    }
    let n = table.flat_len();
    let mut state = [vec![0f32; n], vec![0f32; n], vec![0f32; n]];
    for id in table.ids() {
        let m = table.meta(id);
        let (shape, whole) = &ck.tensors[&m.name];
        table.param(id)?.copy_from_f32(&local_part(m, shape, whole)?)?;
        let r = table.range(id);
        for (buf, p) in state.iter_mut().zip(OPT) {
            let (shape, whole) = &ck.tensors[&format!("{p}.{}", m.name)];
            buf[r.clone()].copy_from_slice(&local_part(m, shape, whole)?);
        }
    }
    opt.load_full_state(&state, ck.state.optimizer_step)?;
    Ok(())
}

/// Just the parameters (generation, `--finetune`, `--no-load-optim`).
pub fn restore_params(ck: &Loaded, table: &ParamTable) -> anyhow::Result<()> {
    table.settle_params()?;
    for id in table.ids() {
        let m = table.meta(id);
        let (shape, whole) = ck.tensors.get(&m.name).with_context(|| {
            format!("the checkpoint has no `{}`: the model flags differ from the saved run", m.name)
        })?;
        table.param(id)?.copy_from_f32(&local_part(m, shape, whole)?)?;
    }
    Ok(())
}
