//! Checkpoints: `{save}/iter_0000120/` holds `state.toml` and one
//! `model_optim_rank00003.safetensors` per rank that holds something to save;
//! `{save}/latest_checkpointed_iteration.txt` (Megatron's tracker name) names the newest.
//!
//! Format 3 is sharded (ferrotron-checkpoint): each rank writes what it holds and no other rank
//! does — its tensor-parallel part of each parameter (data-parallel rank 0; a parameter whole on
//! every tensor-parallel rank from tensor-parallel rank 0; the tied output weight's copy on the
//! last stage not at all) in the model dtype, by its Megatron name, and its share of the fp32
//! optimizer state (`optimizer.master.{name}`, `optimizer.exp_avg.{name}`,
//! `optimizer.exp_avg_sq.{name}`; under --optimizer sgd `optimizer.master.{name}` and
//! `optimizer.momentum_buffer.{name}`: every data-parallel rank's own under the distributed
//! optimizer, else data-parallel rank 0's), and the model's buffers (state that is not a
//! parameter, the MoE layers' expert biases) in fp32 from each stage's first tensor- and
//! data-parallel rank. Nothing is gathered, so no rank holds more than its
//! own part. A load lets each rank read its own parts under its own layout from whichever files
//! hold them, so a run resumes under another tensor-parallel, pipeline, data-parallel or
//! distributed-optimizer layout. Vocabulary padding may differ between layouts: rows past the
//! real vocabulary (`vocab_size` in state.toml) read as 0.
//! `state.toml` holds the iteration, data position, optimizer step, settings and each file's
//! SHA-256. A checkpoint converted from Hugging Face (`ParamsWriter`) holds the parameters alone
//! and says so (`optimizer_state = false`): it loads with --finetune or --no-load-optim.
//! Format 2 (every tensor whole, one file per pipeline stage, written by earlier builds) is
//! still read.
//!
//! Writes go to a temporary folder that is renamed into place, and the tracker is replaced
//! atomically after that, so a save that fails midway leaves the previous checkpoint and tracker as
//! they were.

use crate::settings::Settings;
use anyhow::{Context, bail};
use ferrotron_checkpoint::{Piece, ShardEntry, ShardReader};
use ferrotron_comm::ReduceOp;
use ferrotron_core::{DType, Device, ParamMeta, ParamTable, Tensor};
use ferrotron_optim::Optimizer;
use ferrotron_parallel::{ProcessGroups, global_flat_index};
use safetensors::SafeTensors;
use serde::{Deserialize, Serialize};
use std::borrow::Cow;
use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

pub const FORMAT_VERSION: u32 = 3;
/// Format 2: whole tensors, one file per pipeline stage (read, no longer written).
const WHOLE_FORMAT: u32 = 2;
pub const TRACKER: &str = "latest_checkpointed_iteration.txt";
/// Megatron's folder of non-persistent checkpoints inside --save (and --load).
pub const NON_PERSISTENT: &str = "non_persistent";
/// The shard file of world rank `rank`.
fn shard_file(rank: usize) -> String {
    format!("model_optim_rank{rank:05}.safetensors")
}
const STATE: &str = "state.toml";
/// Every optimizer state tensor's prefix (AdamW's three, SGD's momentum).
const OPT: [&str; 4] = ["optimizer.master", "optimizer.exp_avg", "optimizer.exp_avg_sq", "optimizer.momentum_buffer"];

#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct State {
    pub format_version: u32,
    pub iteration: u64,
    pub consumed_samples: u64,
    /// Validation samples read by the evaluations so far (each reads on from the last, as
    /// Megatron's); absent in checkpoints from before it was kept.
    #[serde(default)]
    pub consumed_valid_samples: u64,
    /// Model FLOPs trained so far (--log-progress's count across jobs, Megatron's
    /// `num_floating_point_operations_so_far`); absent in checkpoints from before it was kept.
    #[serde(default)]
    pub floating_point_operations: f64,
    pub optimizer_step: u64,
    /// False for parameters alone (`ferrotron convert` from Hugging Face): such a checkpoint
    /// loads with --finetune or --no-load-optim.
    #[serde(default = "yes")]
    pub optimizer_state: bool,
    pub params_dtype: String,
    /// The real vocabulary: embedding and output rows from here on are padding (format 3; format
    /// 2 did not store them).
    #[serde(default)]
    pub vocab_size: usize,
    /// Tensor files with their SHA-256: one per writing rank (format 2: one per pipeline stage).
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

/// Tensors whole in host memory, by name, as f32 (a format 2 checkpoint, or any checkpoint read
/// whole: `load`, `load_params`).
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
    /// Model FLOPs trained so far (`State::floating_point_operations`).
    pub floating_point_operations: f64,
    pub settings: &'a Settings,
    /// Real vocabulary: rows past it are padding.
    pub vocab_size: usize,
    /// The model's non-parameter state, whole and alike on every rank of a pipeline stage, by
    /// name (the MoE layers' expert biases): written in fp32 by the stage's first tensor- and
    /// data-parallel rank.
    pub buffers: Vec<(String, Vec<f32>)>,
}

/// A buffer's layout for the checkpoint's pieces: whole on every rank.
fn buffer_meta(name: &str, len: usize) -> ParamMeta {
    ParamMeta::replicated(name, [len], ferrotron_core::Init::Zeros, false)
}

/// One tensor this rank stores: its values copied to the host, or a range of the optimizer
/// state it took (moved to the writer with it, so an asynchronous write holds no second copy).
struct Planned {
    key: String,
    piece: Piece,
    dtype: DType,
    values: Values,
}

enum Values {
    Own(Vec<f32>),
    /// (which of the optimizer's state buffers, `Algorithm::state_names`; range in the owned
    /// state)
    State(usize, Range<usize>),
}

/// What this rank writes: its parameters' parts and its optimizer state's share (see the
/// module header for who writes what). Parameters are read from their device here.
fn my_entries(g: &ProcessGroups, table: &ParamTable, opt: &Optimizer, optimizer: bool) -> anyhow::Result<Vec<Planned>> {
    let mine = |m: &ParamMeta| !m.pipeline_copy && (m.split_dim.is_some() || g.tp.rank() == 0);
    // An expert's parameters are replicated over the expert-data-parallel group, the others over
    // the data × context-parallel one: the first rank of each writes them.
    let first = |m: &ParamMeta| if m.expert { g.edp.rank() == 0 } else { g.dp_cp.rank() == 0 };
    let dtype = table.flat_params().dtype();
    let mut out = vec![];
    for id in table.ids().filter(|&id| mine(table.meta(id)) && first(table.meta(id))) {
        let m = table.meta(id);
        let values = table.param(id)?.to_vec_f32()?;
        let piece = Piece::of(m, 0..values.len());
        out.push(Planned { key: m.name.clone(), piece, dtype, values: Values::Own(values) });
    }
    if optimizer {
        for (id, flat, at) in opt.owned_pieces(table) {
            let m = table.meta(id);
            if !mine(m) || !(opt.distributed() || first(m)) {
                continue;
            }
            let start = flat.start - table.range(id).start;
            for (k, name) in opt.config.algorithm.state_names().iter().enumerate() {
                out.push(Planned {
                    key: format!("optimizer.{name}.{}", m.name),
                    piece: Piece::of(m, start..start + flat.len()),
                    dtype: DType::F32,
                    values: Values::State(k, at..at + flat.len()),
                });
            }
        }
    }
    Ok(out)
}

/// Writes the planned tensors to `path`; returns the file's SHA-256.
fn write_planned(path: &Path, planned: &[Planned], state: &[Vec<f32>]) -> anyhow::Result<String> {
    let entries: Vec<ShardEntry> = planned
        .iter()
        .map(|p| ShardEntry {
            key: p.key.clone(),
            piece: p.piece.clone(),
            dtype: p.dtype,
            values: match &p.values {
                Values::Own(v) => Cow::Borrowed(v.as_slice()),
                Values::State(k, r) => Cow::Borrowed(&state[*k][r.clone()]),
            },
        })
        .collect();
    Ok(ferrotron_checkpoint::write_shard(path, &entries)?)
}

/// A save begun by `start_save`: this rank's shard written (or being written, --async-save);
/// `finish_save` makes it the checkpoint.
pub struct PendingSave {
    save_dir: PathBuf,
    tmp: PathBuf,
    iteration: u64,
    consumed_samples: u64,
    consumed_valid_samples: u64,
    floating_point_operations: f64,
    settings: Settings,
    vocab_size: usize,
    /// The optimizer's step; None when its state is not saved (--no-save-optim).
    step: Option<u64>,
    params_dtype: String,
    /// None where this rank stores nothing.
    writer: Option<Writer>,
}

enum Writer {
    Done(anyhow::Result<String>),
    Running(std::thread::JoinHandle<anyhow::Result<String>>),
}

/// How a save runs.
#[derive(Clone, Copy, Debug, Default)]
pub struct SaveMode {
    /// `--async-save`: the shard written by a thread while training goes on.
    pub background: bool,
    /// `--no-save-optim`: the parameters alone (the checkpoint says `optimizer_state = false`).
    pub params_only: bool,
}

/// Collective over the world: copies this rank's parts to the host and writes them to its shard
/// file in the checkpoint's temporary folder: in the background with `mode.background`, else
/// before returning. Nothing becomes the checkpoint until `finish_save`.
pub fn start_save(
    save_dir: &Path,
    g: &ProcessGroups,
    table: &ParamTable,
    opt: &Optimizer,
    info: &SaveInfo,
    mode: SaveMode,
) -> anyhow::Result<PendingSave> {
    table.settle_params()?; // pending gathers (--overlap-param-gather) before anything reads
    let (state, step) =
        if mode.params_only { (Default::default(), None) } else { opt.owned_state().map(|(s, n)| (s, Some(n)))? };
    let mut planned = my_entries(g, table, opt, !mode.params_only)?;
    if g.tp.rank() == 0 && g.dp_cp.rank() == 0 {
        for (name, v) in &info.buffers {
            let piece = Piece::of(&buffer_meta(name, v.len()), 0..v.len());
            planned.push(Planned { key: name.clone(), piece, dtype: DType::F32, values: Values::Own(v.clone()) });
        }
    }
    let tmp = save_dir.join(format!(".tmp-iter_{:07}", info.iteration));
    // World rank 0 prepares the folder; every rank then adds its file.
    let prepared = if g.world.rank() == 0 { prepare(save_dir, &tmp) } else { Ok(()) };
    agree(g, prepared.is_ok(), info.iteration)?;
    prepared?;
    let path = tmp.join(shard_file(g.world.rank()));
    let writer = (!planned.is_empty()).then(|| {
        if mode.background {
            Writer::Running(std::thread::spawn(move || write_planned(&path, &planned, &state)))
        } else {
            Writer::Done(write_planned(&path, &planned, &state))
        }
    });
    Ok(PendingSave {
        save_dir: save_dir.to_path_buf(),
        tmp,
        iteration: info.iteration,
        consumed_samples: info.consumed_samples,
        consumed_valid_samples: info.consumed_valid_samples,
        floating_point_operations: info.floating_point_operations,
        settings: info.settings.clone(),
        vocab_size: info.vocab_size,
        step,
        params_dtype: table.flat_params().dtype().to_string(),
        writer,
    })
}

/// Collective over the world: whether every rank's shard of `p` is written (--async-save's
/// check at log intervals; a save finished then waits for no one).
pub fn all_written(g: &ProcessGroups, p: &PendingSave) -> anyhow::Result<bool> {
    let mine = !matches!(&p.writer, Some(Writer::Running(h)) if !h.is_finished());
    let t = Tensor::from_vec(vec![if mine { 1f32 } else { 0.0 }], [1], &Device::Cpu)?;
    g.world.all_reduce(&t, ReduceOp::Min)?;
    Ok(t.to_vec_f32()?[0] == 1.0)
}

/// Collective over the world: waits for every rank's shard, then world rank 0 writes the state
/// and renames the folder into place, then the tracker. Returns the checkpoint folder on every
/// rank (or every rank's error if a write failed: the previous checkpoint stays the latest).
pub fn finish_save(g: &ProcessGroups, p: PendingSave) -> anyhow::Result<PathBuf> {
    let written = match p.writer {
        None => None,
        Some(Writer::Done(r)) => Some(r),
        Some(Writer::Running(h)) => {
            Some(h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("the checkpoint writer thread panicked"))))
        }
    };
    // Every rank learns every file's checksum (and whether its write worked).
    let ok = written.as_ref().is_none_or(|r| r.is_ok());
    let mut mine = vec![written.is_some() as u32, ok as u32];
    mine.extend(hex_words(written.as_ref().and_then(|r| r.as_ref().ok()).map_or("", |s| s.as_str())));
    let n = g.world.size();
    let all = Tensor::zeros([n * mine.len()], DType::U32, &Device::Cpu)?;
    g.world.all_gather(&Tensor::from_vec(mine.clone(), [mine.len()], &Device::Cpu)?, &all)?;
    let all = all.to_vec::<u32>()?;
    if let Some(Err(e)) = written {
        return Err(e.context(format!("saving iteration {}", p.iteration)));
    }
    let mut files = vec![];
    for (r, x) in all.chunks(mine.len()).enumerate() {
        if x[0] == 1 {
            if x[1] != 1 {
                bail!("saving iteration {}: rank {r} failed to write its shard (see its error)", p.iteration);
            }
            files.push(TensorFile { file: shard_file(r), sha256: words_hex(&x[2..]) });
        }
    }
    let info = SaveInfo {
        iteration: p.iteration,
        consumed_samples: p.consumed_samples,
        consumed_valid_samples: p.consumed_valid_samples,
        floating_point_operations: p.floating_point_operations,
        settings: &p.settings,
        vocab_size: p.vocab_size,
        buffers: vec![],
    };
    let rank0 = g.world.rank() == 0;
    let done = if rank0 { finish(&p.save_dir, &p.tmp, &p.params_dtype, files, p.step, &info) } else { Ok(()) };
    agree(g, done.is_ok(), p.iteration)?;
    done?;
    Ok(iter_dir(&p.save_dir, p.iteration))
}

impl PendingSave {
    /// (iteration, consumed samples, model FLOPs so far) of the save.
    pub fn position(&self) -> (u64, u64, f64) {
        (self.iteration, self.consumed_samples, self.floating_point_operations)
    }
}

/// `start_save` and `finish_save` in one (collective over the world).
pub fn save(
    save_dir: &Path,
    g: &ProcessGroups,
    table: &ParamTable,
    opt: &Optimizer,
    info: &SaveInfo,
) -> anyhow::Result<PathBuf> {
    finish_save(g, start_save(save_dir, g, table, opt, info, SaveMode::default())?)
}

/// A checkpoint of parameters alone at iteration 0 (`ferrotron convert`), written as its tensors
/// come: each whole, by Megatron name, with the dtype it is stored in, vocabulary rows unpadded,
/// in shard files of about `max_bytes` each (as stored; the f32 values held meanwhile are up to
/// twice that for bf16), so that an import holds one file's worth and never the model. Finished
/// as `save` finishes (a temporary folder renamed into place, then the tracker); state.toml says
/// `optimizer_state = false`. Dropped without `finish`, it removes what it wrote.
pub struct ParamsWriter {
    save_dir: PathBuf,
    tmp: PathBuf,
    /// Whether `save_dir` was made here (then removed again on a drop if left empty).
    made_dir: bool,
    max_bytes: usize,
    pending: Vec<(String, DType, Vec<usize>, Vec<f32>)>,
    pending_bytes: usize,
    files: Vec<TensorFile>,
    done: bool,
}

impl ParamsWriter {
    pub fn new(save_dir: &Path, max_bytes: usize) -> anyhow::Result<ParamsWriter> {
        let made_dir = !save_dir.exists();
        let tmp = save_dir.join(".tmp-iter_0000000");
        let w = ParamsWriter {
            save_dir: save_dir.to_path_buf(),
            tmp,
            made_dir,
            max_bytes: max_bytes.max(1),
            pending: vec![],
            pending_bytes: 0,
            files: vec![],
            done: false,
        };
        prepare(save_dir, &w.tmp)?;
        Ok(w)
    }

    /// One tensor; a shard file is written once the values held reach `max_bytes`.
    pub fn add(&mut self, name: String, dtype: DType, shape: Vec<usize>, values: Vec<f32>) -> anyhow::Result<()> {
        self.pending_bytes += values.len() * dtype.size_in_bytes();
        self.pending.push((name, dtype, shape, values));
        if self.pending_bytes >= self.max_bytes { self.flush() } else { Ok(()) }
    }

    /// The tensors held so far into the next shard file.
    fn flush(&mut self) -> anyhow::Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let file = shard_file(self.files.len());
        let entries: Vec<ShardEntry> = self
            .pending
            .iter()
            .map(|(name, d, shape, v)| ShardEntry {
                key: name.clone(),
                piece: Piece::whole(shape),
                dtype: *d,
                values: Cow::Borrowed(v),
            })
            .collect();
        let sha256 = ferrotron_checkpoint::write_shard(&self.tmp.join(&file), &entries)?;
        self.files.push(TensorFile { file, sha256 });
        self.pending.clear();
        self.pending_bytes = 0;
        Ok(())
    }

    /// The last file, state.toml (`dtype`: the run's parameter dtype) and the rename into place.
    pub fn finish(mut self, dtype: DType, settings: &Settings) -> anyhow::Result<PathBuf> {
        self.flush()?;
        let vocab_size = settings.model_config()?.vocab_size;
        let info = SaveInfo {
            iteration: 0,
            consumed_samples: 0,
            consumed_valid_samples: 0,
            floating_point_operations: 0.0,
            settings,
            vocab_size,
            buffers: vec![],
        };
        let files = std::mem::take(&mut self.files);
        finish(&self.save_dir, &self.tmp, &dtype.to_string(), files, None, &info)?;
        self.done = true;
        Ok(iter_dir(&self.save_dir, 0))
    }
}

impl Drop for ParamsWriter {
    /// Unfinished: removes the temporary folder, and `save_dir` if it was made here and holds
    /// nothing else.
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let _ = std::fs::remove_dir_all(&self.tmp);
        if self.made_dir {
            let _ = std::fs::remove_dir(&self.save_dir); // only if empty
        }
    }
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
        vocab_size: info.vocab_size,
        iteration,
        consumed_samples: info.consumed_samples,
        consumed_valid_samples: info.consumed_valid_samples,
        floating_point_operations: info.floating_point_operations,
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

fn write_synced(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    use std::io::Write;
    let mut f = std::fs::File::create(path).with_context(|| format!("cannot write {}", path.display()))?;
    f.write_all(bytes)?;
    f.sync_all()?;
    Ok(())
}

/// The folder of iteration `step`'s checkpoint in the --save folder `dir` (--ckpt-step).
pub fn at_step(dir: &Path, step: u64) -> anyhow::Result<PathBuf> {
    if dir.join(STATE).is_file() {
        bail!(
            "--ckpt-step {step}: --load {} is one checkpoint already; give the --save folder that holds it",
            dir.display()
        );
    }
    let d = iter_dir(dir, step);
    if !d.join(STATE).is_file() {
        let mut have: Vec<u64> = std::fs::read_dir(dir)
            .map(|r| r.filter_map(|e| e.ok()?.file_name().to_str()?.strip_prefix("iter_")?.parse().ok()).collect())
            .unwrap_or_default();
        have.sort();
        bail!("--ckpt-step {step}: {} holds no checkpoint of iteration {step} (it has {have:?})", dir.display());
    }
    Ok(d)
}

/// The iteration `dir`'s tracker names (None without a tracker; a corrupt one is an error).
pub fn tracked_iteration(dir: &Path) -> anyhow::Result<Option<u64>> {
    let tracker = dir.join(TRACKER);
    let text = match std::fs::read_to_string(&tracker) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", tracker.display())),
    };
    let it = text.trim().parse().with_context(|| {
        format!("{}: corrupt tracker (expected an iteration number, found {:?})", tracker.display(), text.trim())
    })?;
    Ok(Some(it))
}

/// Deletes the iteration folders of `dir` but the newest (world rank 0, before a non-persistent
/// save into `dir`: with the one being written, at most two are ever there, the last complete
/// one kept until the next is).
pub fn keep_newest(dir: &Path) -> anyhow::Result<()> {
    let mut its: Vec<(u64, PathBuf)> = match std::fs::read_dir(dir) {
        Ok(r) => r
            .filter_map(|e| {
                let e = e.ok()?;
                let it = e.file_name().to_str()?.strip_prefix("iter_")?.parse().ok()?;
                Some((it, e.path()))
            })
            .collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e).with_context(|| format!("cannot list {}", dir.display())),
    };
    its.sort();
    its.pop();
    for (_, p) in its {
        std::fs::remove_dir_all(&p)
            .with_context(|| format!("removing the older non-persistent checkpoint {}", p.display()))?;
    }
    Ok(())
}

/// Whether `dir` holds a checkpoint to load (its own state.toml, or a tracker). A missing or
/// empty folder holds none (Megatron then starts from the initialisation); a folder of
/// iteration folders without a tracker is an error, not a fresh start, so that no run silently
/// trains over checkpoints whose tracker was lost.
pub fn holds_checkpoint(dir: &Path) -> anyhow::Result<bool> {
    not_megatron(dir)?;
    if dir.join(STATE).is_file() || dir.join(TRACKER).is_file() {
        return Ok(true);
    }
    let mut have: Vec<String> = match std::fs::read_dir(dir) {
        Ok(r) => r
            .filter_map(|e| Some(e.ok()?.file_name().to_str()?.to_owned()))
            .filter(|n| n.strip_prefix("iter_").is_some_and(|i| i.parse::<u64>().is_ok()))
            .collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e).with_context(|| format!("--load {}: cannot list the folder", dir.display())),
    };
    if have.is_empty() {
        return Ok(false);
    }
    have.sort();
    bail!(
        "--load {}: holds {} but no {TRACKER}: pass --ckpt-step N to load one of them (or write N into {TRACKER})",
        dir.display(),
        have.join(", ")
    )
}

/// A Megatron-LM checkpoint is imported first, not loaded (or started over) as it is.
fn not_megatron(dir: &Path) -> anyhow::Result<()> {
    if !dir.join(STATE).is_file() && ferrotron_checkpoint::megatron::is_megatron(dir) {
        bail!(
            "--load {0}: a Megatron-LM checkpoint: import it first, `ferrotron convert --loader megatron --saver ferrotron --load-dir {0} --save-dir DIR`, then train with --load DIR --finetune --use-checkpoint-args",
            dir.display()
        );
    }
    Ok(())
}

/// The checkpoint folder `dir` names: a --save folder (follow its tracker) or an iter_* folder.
pub fn resolve(dir: &Path) -> anyhow::Result<PathBuf> {
    if dir.join(STATE).is_file() {
        return Ok(dir.to_path_buf());
    }
    not_megatron(dir)?;
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
    let mut v = Vec::with_capacity(t.shape().iter().product());
    if ferrotron_checkpoint::decode(t.dtype(), t.data(), &mut v).is_none() {
        bail!("{}: tensor `{name}` has dtype {:?} (f32, bf16 and f16 are read)", file.display(), t.dtype());
    }
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
    if state.format_version != FORMAT_VERSION && state.format_version != WHOLE_FORMAT {
        bail!(
            "{}: checkpoint format {} but this build reads formats {WHOLE_FORMAT} and {FORMAT_VERSION}",
            state_path.display(),
            state.format_version
        );
    }
    Ok(state)
}

/// A checkpoint as each rank reads it: its own parts of the tensors, under its own layout.
pub trait Parts {
    fn state(&self) -> &State;
    /// Flat `range` of this rank's part of tensor `key`, which has parameter `m`'s layout.
    fn part(&self, m: &ParamMeta, key: &str, range: Range<usize>) -> anyhow::Result<Vec<f32>>;
}

/// A format 3 checkpoint, its shard files memory-mapped (each checked against its SHA-256 when
/// first read from).
pub struct Sharded {
    pub state: State,
    reader: ShardReader,
}

impl Parts for Sharded {
    fn state(&self) -> &State {
        &self.state
    }

    fn part(&self, m: &ParamMeta, key: &str, range: Range<usize>) -> anyhow::Result<Vec<f32>> {
        let rows = (vocab_padded(&m.name) && self.state.vocab_size > 0).then_some(self.state.vocab_size);
        Ok(self.reader.read(key, &Piece::of(m, range), rows)?)
    }
}

impl Parts for Loaded {
    fn state(&self) -> &State {
        &self.state
    }

    fn part(&self, m: &ParamMeta, key: &str, range: Range<usize>) -> anyhow::Result<Vec<f32>> {
        let (shape, whole) = self
            .tensors
            .get(key)
            .with_context(|| format!("the checkpoint has no `{key}`: the model flags differ from the saved run"))?;
        local_part(m, shape, whole, range)
    }
}

/// Opens the checkpoint folder `dir` names (see `resolve`) for `restore` (`optimizer`) or
/// `restore_params`. Format 3 is mapped, not read; format 2 is read whole (its optimizer state
/// only with `optimizer`).
pub fn open(dir: &Path, optimizer: bool) -> anyhow::Result<Box<dyn Parts>> {
    let state = read_state(dir)?;
    if state.format_version == WHOLE_FORMAT {
        return Ok(Box::new(if optimizer { load(dir)? } else { load_params(dir)? }));
    }
    let dir = resolve(dir)?;
    let files: Vec<_> = state.tensor_files.iter().map(|f| (dir.join(&f.file), Some(f.sha256.clone()))).collect();
    let reader = ShardReader::open(&files)?;
    Ok(Box::new(Sharded { state, reader }))
}

/// Refuses a checkpoint whose parameters mean something else under this run's flags, where the
/// shapes are the same and so nothing else would tell: norm weights that are the scale less 1
/// (--apply-layernorm-1p) or the scale, query and key rows in interleaved rotary pairs
/// (--rotary-interleaved) or in halves, a GeLU MLP trained as erf or as tanh, a gated MLP
/// trained as SwiGLU or as the quick GeGLU (its offset and clamp too), attention rows
/// normalised with a sink logit or without (--softmax-type; a learnable sink's logits would
/// also be missing or left over).
pub fn check_meaning(saved: &State, s: &Settings, dir: &Path) -> anyhow::Result<()> {
    let with = |on: bool| if on { "with" } else { "without" };
    let (then, now) = (&saved.settings, s);
    let flag = |name: &str, then: bool, now: bool, consequence: &str| -> anyhow::Result<()> {
        if then != now {
            bail!(
                "{}: the checkpoint was saved {} {name} and this run is {} it, so {consequence}; give the flag as it was saved (or --use-checkpoint-args)",
                dir.display(),
                with(then),
                with(now),
            );
        }
        Ok(())
    };
    let scale = if then.apply_layernorm_1p { "1 less" } else { "1 more" };
    flag(
        "--apply-layernorm-1p",
        then.apply_layernorm_1p,
        now.apply_layernorm_1p,
        &format!("its norm weights would scale by {scale} than trained"),
    )?;
    flag(
        "--rotary-interleaved",
        then.rotary_interleaved,
        now.rotary_interleaved,
        "its query and key features would rotate in other pairs than trained",
    )?;
    if then.softmax_type != now.softmax_type {
        bail!(
            "{}: the checkpoint was saved with --softmax-type {} and this run's is {}, so its attention rows would be normalised otherwise than trained; give --softmax-type {} (or --use-checkpoint-args)",
            dir.display(),
            then.softmax_type,
            now.softmax_type,
            then.softmax_type
        );
    }
    // A gated MLP's fc1 has the same shape under SwiGLU and the quick GeGLU (and its offset and
    // clamp leave no trace in the weights).
    let gated = |x: &Settings| match (x.swiglu, x.quick_geglu) {
        (true, _) => "--swiglu".to_string(),
        (_, true) => format!(
            "--quick-geglu with --glu-linear-offset {} and {}",
            x.glu_linear_offset,
            x.activation_func_clamp_value.map_or("no clamp".into(), |c| format!("--activation-func-clamp-value {c}"))
        ),
        _ => String::new(),
    };
    let (g_then, g_now) = (gated(then), gated(now));
    if !g_then.is_empty() && !g_now.is_empty() && g_then != g_now {
        bail!(
            "{}: the checkpoint's MLPs were trained with {g_then} and this run's are {g_now}, so their gate and linear halves would be read otherwise than trained; give the flags as they were saved (or --use-checkpoint-args)",
            dir.display()
        );
    }
    // GeLU's form matters only to a GeLU MLP.
    let gelu = |x: &Settings| !x.swiglu && !x.squared_relu && !x.quick_geglu;
    if gelu(then) && gelu(now) && then.gelu_exact != now.gelu_exact {
        let form = |exact: bool| if exact { "erf" } else { "the tanh approximation" };
        bail!(
            "{}: the checkpoint's MLPs were trained with GeLU as {} and this run's is {} (Megatron's GeLU is tanh through the fused bias-GeLU, erf without it): give {} to match it (or --use-checkpoint-args)",
            dir.display(),
            form(then.gelu_exact),
            form(now.gelu_exact),
            if then.gelu_exact {
                "--no-bias-gelu-fusion (or, without biases, no --openai-gelu)"
            } else {
                "--openai-gelu"
            }
        );
    }
    Ok(())
}

/// The parameter an optimizer tensor's name is of (None for a parameter's own name).
fn optimizer_of(name: &str) -> Option<&str> {
    OPT.iter().find_map(|p| name.strip_prefix(p).and_then(|r| r.strip_prefix('.')))
}

/// Every tensor whole, in host memory (tests, inspection).
pub fn load(dir: &Path) -> anyhow::Result<Loaded> {
    load_where(dir, |_| true)
}

/// `load` without the optimizer state (a quarter of the memory of a trained checkpoint):
/// export, format 2's `--finetune`.
pub fn load_params(dir: &Path) -> anyhow::Result<Loaded> {
    load_where(dir, |name| optimizer_of(name).is_none())
}

/// A checkpoint's parameters read one whole tensor at a time, when asked for (an export: the
/// files are memory-mapped, each verified at its first read), vocabulary rows unpadded. Format
/// 2 checkpoints (whole tensors, earlier builds) are read whole at the start.
pub struct ParamsSource {
    pub state: State,
    source: Source,
}

enum Source {
    Shards(ShardReader),
    Loaded(HashMap<String, (Vec<usize>, Vec<f32>)>),
}

impl ParamsSource {
    pub fn open(dir: &Path) -> anyhow::Result<ParamsSource> {
        let state = read_state(dir)?;
        if state.format_version == WHOLE_FORMAT {
            let Loaded { state, tensors } = load_params(dir)?;
            return Ok(ParamsSource { state, source: Source::Loaded(tensors) });
        }
        let dir = resolve(dir)?;
        let files: Vec<_> = state.tensor_files.iter().map(|f| (dir.join(&f.file), Some(f.sha256.clone()))).collect();
        Ok(ParamsSource { source: Source::Shards(ShardReader::open(&files)?), state })
    }

    /// The parameters' names (optimizer state left out), sorted.
    pub fn names(&self) -> Vec<String> {
        let mut n: Vec<String> = match &self.source {
            Source::Shards(r) => r.keys().map(str::to_string).collect(),
            Source::Loaded(t) => t.keys().cloned().collect(),
        };
        n.retain(|k| optimizer_of(k).is_none());
        n.sort();
        n
    }

    /// Parameter `name` whole (None if the checkpoint has none).
    pub fn read(&self, name: &str) -> anyhow::Result<Option<(Vec<usize>, Vec<f32>)>> {
        match &self.source {
            Source::Loaded(t) => Ok(t.get(name).cloned()),
            Source::Shards(r) => {
                if optimizer_of(name).is_some() || r.global_shape(name).is_none() {
                    return Ok(None);
                }
                let rows = (vocab_padded(name) && self.state.vocab_size > 0).then_some(self.state.vocab_size);
                Ok(Some(r.read_whole(name, rows)?))
            }
        }
    }
}

/// `load` of the tensors whose names `keep` takes, vocabulary rows unpadded (every file read is
/// verified whole).
fn load_where(dir: &Path, keep: impl Fn(&str) -> bool) -> anyhow::Result<Loaded> {
    let state = read_state(dir)?;
    let dir = resolve(dir)?;
    let mut tensors = HashMap::new();
    if state.format_version != WHOLE_FORMAT {
        let files: Vec<_> = state.tensor_files.iter().map(|f| (dir.join(&f.file), Some(f.sha256.clone()))).collect();
        let reader = ShardReader::open(&files)?;
        for key in reader.keys().filter(|k| keep(k)) {
            let padded = vocab_padded(optimizer_of(key).unwrap_or(key)) && state.vocab_size > 0;
            let rows = padded.then_some(state.vocab_size);
            tensors.insert(key.to_string(), reader.read_whole(key, rows)?);
        }
        return Ok(Loaded { state, tensors });
    }
    for tf in &state.tensor_files {
        let file = dir.join(&tf.file);
        let bytes = std::fs::read(&file).with_context(|| format!("cannot read {}", file.display()))?;
        let sha = ferrotron_checkpoint::sha256_hex(&bytes);
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

/// Flat `range` of this rank's part of a whole tensor saved as `saved_shape`, for parameter `m`.
/// Vocabulary rows missing from the file (padding) read as 0.
fn local_part(m: &ParamMeta, saved_shape: &[usize], whole: &[f32], range: Range<usize>) -> anyhow::Result<Vec<f32>> {
    let g = m.global_shape.dims();
    let rows_differ = vocab_padded(&m.name) && saved_shape.len() == g.len() && saved_shape[1..] == g[1..];
    if saved_shape != g && !rows_differ {
        bail!(
            "checkpoint parameter `{}` is {saved_shape:?} but the model's is {g:?}: the model flags differ from the saved run",
            m.name
        );
    }
    let have = whole.len();
    Ok(range
        .map(|i| {
            let gi = global_flat_index(m, m.shard, i);
            if gi < have { whole[gi] } else { 0.0 }
        })
        .collect())
}

/// Puts a checkpoint into this rank's parameters and optimizer (any layout).
pub fn restore(ck: &dyn Parts, table: &ParamTable, opt: &mut Optimizer) -> anyhow::Result<()> {
    let st = ck.state();
    if !st.optimizer_state {
        bail!(
            "the checkpoint holds parameters only (no optimizer state, e.g. one converted from Hugging Face): load it with --finetune (or --no-load-optim)"
        );
    }
    let now = opt.config.algorithm.flag();
    if st.settings.optimizer != now {
        bail!(
            "the checkpoint's optimizer state is --optimizer {}'s and this run's is {now}'s: load its parameters alone with --no-load-optim (or --finetune), or give --optimizer {}",
            st.settings.optimizer,
            st.settings.optimizer
        );
    }
    restore_params(ck, table)?;
    let n: usize = opt.owned().iter().map(|r| r.len()).sum();
    let names = opt.config.algorithm.state_names();
    let mut state = vec![vec![0f32; n]; names.len()];
    for (id, flat, at) in opt.owned_pieces(table) {
        let m = table.meta(id);
        let start = flat.start - table.range(id).start;
        for (buf, p) in state.iter_mut().zip(names) {
            let v = ck.part(m, &format!("optimizer.{p}.{}", m.name), start..start + flat.len())?;
            buf[at..at + flat.len()].copy_from_slice(&v);
        }
    }
    opt.load_owned_state(&state, st.optimizer_step)?;
    Ok(())
}

/// The MoE layers' expert biases from the checkpoint (each rank its own layers'; every way of
/// loading a model that keeps them). A checkpoint saved without them (from a run without
/// --moe-router-enable-expert-bias, or converted from Hugging Face) is refused unless
/// `zero_if_absent` (--finetune: a new run from those weights, the absent biases from zero), which
/// returns whether any was absent.
pub fn restore_biases(
    ck: &dyn Parts,
    biases: &[std::sync::Arc<ferrotron_moe::ExpertBias>],
    zero_if_absent: bool,
) -> anyhow::Result<bool> {
    let mut absent = false;
    for b in biases {
        let n = b.values().len();
        let v = match ck.part(&buffer_meta(&b.name, n), &b.name, 0..n) {
            Ok(v) => v,
            // This one from zero; the others as saved (a model with layers the checkpoint lacks).
            Err(_) if zero_if_absent => {
                absent = true;
                continue;
            }
            Err(e) => {
                return Err(e.context(format!(
                    "the checkpoint has no expert bias `{}`: it was saved without --moe-router-enable-expert-bias (--finetune starts the biases from zero)",
                    b.name
                )));
            }
        };
        b.set_values(&v).map_err(anyhow::Error::msg)?;
    }
    Ok(absent)
}

/// Just the parameters (generation, `--finetune`, `--no-load-optim`).
pub fn restore_params(ck: &dyn Parts, table: &ParamTable) -> anyhow::Result<()> {
    table.settle_params()?; // no gather still pending may overwrite what is restored
    for id in table.ids() {
        let m = table.meta(id);
        table.param(id)?.copy_from_f32(&ck.part(m, &m.name, 0..m.local_shape.elem_count())?)?;
    }
    Ok(())
}
