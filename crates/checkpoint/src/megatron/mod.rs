//! Megatron-LM's own checkpoints, read without PyTorch: `torch_dist` (its default, a PyTorch
//! distributed checkpoint, `dcp.rs`, with the run's arguments in `common.pt`) and the legacy
//! `torch` format (`mp_rank_*/model_optim_rng.pt`, one `torch.save` file per model-parallel
//! rank, `torch_file.rs`, joined into one model by `legacy.rs`). Both are pickles underneath
//! (`pickle.rs`), read as data: no code runs.
//!
//! This module gives the run's arguments (Megatron's argparse Namespace) and the model's tensors
//! by their Megatron names; which of the trainer's parameters each one is, is the trainer's
//! import. The way back writes torch_dist (`save.rs` over `dcp_write.rs`, `torch_save.rs`,
//! `pickle_write.rs`: each the inverse of its reader), for the trainer's export.

mod dcp;
mod dcp_write;
mod legacy;
pub mod pickle;
mod pickle_write;
mod save;
mod torch_file;
mod torch_save;

pub use dcp_write::DcpWriter;
pub use legacy::TpCut;
pub use pickle::{PickleError, Py};
pub use pickle_write::dump as pickle_dump;
pub use save::MegatronSave;
pub use torch_file::{TensorRef, TorchDtype, TorchFile};
pub use torch_save::{save as torch_save, tensor as torch_tensor};

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum MegatronError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: {source}")]
    Pickle { path: PathBuf, source: PickleError },
    #[error("{path}: {why}")]
    Format { path: PathBuf, why: String },
    #[error("the Megatron checkpoint has no tensor `{0}`")]
    Missing(String),
}

enum Files {
    Dist(dcp::Dcp),
    /// The legacy format's rank files, joined.
    Legacy(Box<legacy::Legacy>),
}

/// An open Megatron checkpoint (one iteration).
pub struct MegatronCheckpoint {
    /// The iteration folder read.
    pub dir: PathBuf,
    /// `torch_dist` or `torch`.
    pub format: &'static str,
    /// The run's arguments: Megatron's argparse Namespace (its flags, underscored).
    pub args: Py,
    /// The iteration it was saved at, where recorded.
    pub iteration: Option<i64>,
    files: Files,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> MegatronError + '_ {
    move |source| MegatronError::Io { path: path.to_path_buf(), source }
}

/// Whether `dir` holds a Megatron checkpoint (a tracker and iteration folders in Megatron's
/// formats, or one such iteration folder).
pub fn is_megatron(dir: &Path) -> bool {
    let it =
        |d: &Path| d.join("common.pt").is_file() || d.join("mp_rank_00").is_dir() || d.join("mp_rank_00_000").is_dir();
    it(dir)
        || std::fs::read_to_string(dir.join("latest_checkpointed_iteration.txt"))
            .ok()
            .and_then(|t| iteration_dir(dir, t.trim()))
            .is_some_and(|d| it(&d))
}

/// The folder of tracker text `t`: `iter_0000123` for 123, `release` for "release".
fn iteration_dir(dir: &Path, t: &str) -> Option<PathBuf> {
    if t == "release" {
        return Some(dir.join("release"));
    }
    t.parse::<u64>().ok().map(|i| dir.join(format!("iter_{i:07}")))
}

impl MegatronCheckpoint {
    /// A Megatron `--save` folder (its latest_checkpointed_iteration.txt names the iteration) or
    /// one iteration folder.
    pub fn open(path: &Path) -> Result<MegatronCheckpoint, MegatronError> {
        let tracker = path.join("latest_checkpointed_iteration.txt");
        let dir = if tracker.is_file() {
            let t = std::fs::read_to_string(&tracker).map_err(io(&tracker))?;
            iteration_dir(path, t.trim()).ok_or_else(|| MegatronError::Format {
                path: tracker.clone(),
                why: format!("`{}` is neither an iteration nor `release`", t.trim()),
            })?
        } else {
            path.to_path_buf()
        };
        if dir.join(".metadata").is_file() {
            let common = dir.join("common.pt");
            let f = std::fs::File::open(&common).map_err(io(&common))?;
            let state = TorchFile::new(std::io::BufReader::new(f), &common)?.object()?;
            let (args, iteration) = Self::header(&state, &common)?;
            let files = Files::Dist(dcp::Dcp::open(&dir)?);
            return Ok(MegatronCheckpoint { dir, format: "torch_dist", args, iteration, files });
        }
        let mut ranks: Vec<String> = std::fs::read_dir(&dir)
            .map_err(io(&dir))?
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n.starts_with("mp_rank_"))
            .collect();
        ranks.sort();
        if ranks.is_empty() {
            return Err(MegatronError::Format {
                path: dir,
                why: "neither a torch_dist checkpoint (.metadata, common.pt) nor a legacy one (mp_rank_00/model_optim_rng.pt)"
                    .into(),
            });
        }
        let l = legacy::Legacy::open(&dir, &ranks)?;
        let (args, iteration) = (l.args.clone(), l.iteration);
        Ok(MegatronCheckpoint { dir, format: "torch", args, iteration, files: Files::Legacy(Box::new(l)) })
    }

    pub(super) fn header(state: &Py, path: &Path) -> Result<(Py, Option<i64>), MegatronError> {
        let args = state.get("args").cloned().ok_or_else(|| MegatronError::Format {
            path: path.to_path_buf(),
            why: "no `args`: not saved by Megatron-LM's training loop (a checkpoint of megatron.core alone carries no model flags)".into(),
        })?;
        Ok((args, state.get("iteration").and_then(Py::as_int)))
    }

    /// Every tensor's name and global shape (the optimizer's and the RNG states' among them in
    /// torch_dist).
    pub fn shapes(&self) -> BTreeMap<String, Vec<usize>> {
        match &self.files {
            Files::Dist(d) => d.tensors.iter().map(|(k, t)| (k.clone(), t.shape.clone())).collect(),
            Files::Legacy(l) => l.shapes(),
        }
    }

    /// The byte objects' keys (torch_dist's sharded objects, e.g. `_extra_state/shard_0_2`);
    /// none in the legacy format.
    pub fn objects(&self) -> Vec<String> {
        match &self.files {
            Files::Dist(d) => d.objects.iter().cloned().collect(),
            Files::Legacy(_) => vec![],
        }
    }

    /// Tensor `name` with its leading dims fixed at `lead` (one layer, or one layer's expert, of
    /// a stacked tensor; empty: the whole tensor): (the remaining shape, row-major values). A
    /// legacy checkpoint of several tensor-parallel ranks joins the ranks' parts along `cut`
    /// (the model's split of the tensor; none: replicated); torch_dist's tensors are whole.
    pub fn read(
        &mut self,
        name: &str,
        lead: &[usize],
        cut: Option<TpCut>,
    ) -> Result<(Vec<usize>, Vec<f32>), MegatronError> {
        let d = match &mut self.files {
            Files::Dist(d) => d,
            Files::Legacy(l) if lead.is_empty() => return l.read(name, cut),
            Files::Legacy(_) => {
                return Err(MegatronError::Format {
                    path: self.dir.clone(),
                    why: format!("`{name}`: a legacy checkpoint's tensors are not stacked (asked for {lead:?})"),
                });
            }
        };
        let shape =
            d.tensors.get(name).map(|t| t.shape.clone()).ok_or_else(|| MegatronError::Missing(name.to_string()))?;
        if lead.len() > shape.len() || lead.iter().zip(&shape).any(|(i, d)| i >= d) {
            return Err(MegatronError::Format {
                path: self.dir.clone(),
                why: format!("`{name}` {shape:?} has no slice {lead:?}"),
            });
        }
        let mut start = vec![0; shape.len()];
        start[..lead.len()].copy_from_slice(lead);
        let mut size = shape.clone();
        size[..lead.len()].fill(1);
        Ok((shape[lead.len()..].to_vec(), d.read_box(name, &start, &size)?))
    }
}
