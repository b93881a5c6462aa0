//! A Megatron-LM `--save` folder written in its `torch_dist` format, as a checkpoint that
//! Megatron's `--load` takes: `iter_NNNNNNN/` with the DCP files (`dcp_write.rs`), `common.pt`
//! (the run's arguments and iteration, torch.save'd) and `metadata.json` (the backends), and the
//! tracker `latest_checkpointed_iteration.txt`. The iteration folder is written under a
//! temporary name and renamed when whole, and the tracker written last, so an export that
//! fails leaves nothing a load would take; a folder that holds a checkpoint already is refused.

use super::MegatronError;
use super::dcp_write::DcpWriter;
use super::pickle::Py;
use super::torch_save;
use std::path::{Path, PathBuf};

const TRACKER: &str = "latest_checkpointed_iteration.txt";

/// An export into a Megatron `--save` folder, under way.
pub struct MegatronSave {
    save_dir: PathBuf,
    iteration: u64,
    /// The iteration folder's temporary name while it is written.
    tmp: PathBuf,
    dcp: Option<DcpWriter>,
    /// Whether the folder was put in place (else a drop removes the temporary one).
    placed: bool,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> MegatronError + '_ {
    move |source| MegatronError::Io { path: path.to_path_buf(), source }
}

impl MegatronSave {
    /// Starts the checkpoint of `iteration` in `save_dir` (created if absent), its .distcp files
    /// closed past `max_file` bytes.
    pub fn create(save_dir: &Path, iteration: u64, max_file: u64) -> Result<MegatronSave, MegatronError> {
        let name = format!("iter_{iteration:07}");
        if save_dir.join(TRACKER).exists() || save_dir.join(&name).exists() {
            return Err(MegatronError::Format {
                path: save_dir.to_path_buf(),
                why: "holds a Megatron checkpoint already: pick a new folder (nothing was written)".into(),
            });
        }
        std::fs::create_dir_all(save_dir).map_err(io(save_dir))?;
        // A leftover of an export that stopped: its name is this writer's own.
        let tmp = save_dir.join(format!(".{name}.partial"));
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp).map_err(io(&tmp))?;
        }
        std::fs::create_dir(&tmp).map_err(io(&tmp))?;
        let dcp = Some(DcpWriter::new(&tmp, max_file));
        Ok(MegatronSave { save_dir: save_dir.to_path_buf(), iteration, tmp, dcp, placed: false })
    }

    /// The distributed checkpoint the tensors (`DcpWriter::chunk`) and sharded objects
    /// (`DcpWriter::object`) go into.
    pub fn dcp(&mut self) -> &mut DcpWriter {
        self.dcp.as_mut().expect("present until finish")
    }

    /// Writes `.metadata`, `common.pt` (`common`: the state dict Megatron keeps beside the
    /// tensors: `args`, `checkpoint_version`, `iteration`) and `metadata.json`, then puts the
    /// folder and the tracker in place. Returns the iteration folder.
    pub fn finish(mut self, common: &Py) -> Result<PathBuf, MegatronError> {
        self.dcp.take().expect("present until finish").finish()?;
        // (`dcp` is gone from here on; a failure still removes the folder: `placed` is false.)
        let bytes = torch_save::save("common", common, &[])
            .map_err(|e| MegatronError::Format { path: self.tmp.join("common.pt"), why: e.to_string() })?;
        let write = |name: &str, bytes: &[u8]| {
            let path = self.tmp.join(name);
            std::fs::write(&path, bytes).map_err(io(&path))
        };
        write("common.pt", &bytes)?;
        write(
            "metadata.json",
            br#"{"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch", "common_backend_version": 1}"#,
        )?;
        let dir = self.save_dir.join(format!("iter_{:07}", self.iteration));
        std::fs::rename(&self.tmp, &dir).map_err(io(&dir))?;
        self.placed = true;
        let tracker = self.save_dir.join(TRACKER);
        let tmp = self.save_dir.join(format!(".{TRACKER}.tmp"));
        std::fs::write(&tmp, self.iteration.to_string()).map_err(io(&tmp))?;
        std::fs::rename(&tmp, &tracker).map_err(io(&tracker))?;
        Ok(dir)
    }
}

impl Drop for MegatronSave {
    /// An export dropped before `finish` (an error on the way) removes its partial folder.
    fn drop(&mut self) {
        if !self.placed {
            let _ = std::fs::remove_dir_all(&self.tmp);
        }
    }
}
