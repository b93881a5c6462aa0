//! Local checkpoints (one rank): `{save}/iter_0000120/` holds `model_optim.safetensors` (params in
//! the model dtype, fp32 master weights and Adam moments, flat) and `state.toml` (iteration, data
//! position, optimizer step, settings, parameter names and shapes, and the SHA-256 of the tensor
//! file). `{save}/latest_checkpointed_iteration.txt` (Megatron's tracker name) names the newest.
//!
//! Writes go to a temporary folder that is renamed into place, and the tracker is replaced
//! atomically after that, so a save that fails midway leaves the previous checkpoint and tracker as
//! they were. The sharded, reshardable format of ferrotron-checkpoint will replace this module.

use crate::settings::Settings;
use anyhow::{Context, bail};
use ferrotron_core::{DType, ParamTable, Tensor, bf16};
use safetensors::{Dtype, SafeTensors, tensor::TensorView};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

pub const FORMAT_VERSION: u32 = 1;
pub const TRACKER: &str = "latest_checkpointed_iteration.txt";
const TENSORS: &str = "model_optim.safetensors";
const STATE: &str = "state.toml";

#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct State {
    pub format_version: u32,
    pub iteration: u64,
    pub consumed_samples: u64,
    pub optimizer_step: u64,
    pub params_dtype: String,
    pub tensors_sha256: String,
    pub param_names: Vec<String>,
    pub param_shapes: Vec<Vec<usize>>,
    pub settings: Settings,
}

/// What a checkpoint holds, loaded into host memory.
pub struct Loaded {
    pub state: State,
    pub params: Vec<f32>,
    pub master: Vec<f32>,
    pub exp_avg: Vec<f32>,
    pub exp_avg_sq: Vec<f32>,
}

pub fn iter_dir(save: &Path, iteration: u64) -> PathBuf {
    save.join(format!("iter_{iteration:07}"))
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Saves atomically; returns the checkpoint folder.
pub fn save(
    save_dir: &Path,
    table: &ParamTable,
    opt: (&Tensor, &Tensor, &Tensor, u64),
    iteration: u64,
    consumed_samples: u64,
    settings: &Settings,
) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(save_dir)
        .with_context(|| format!("--save {}: cannot create the folder", save_dir.display()))?;
    let final_dir = iter_dir(save_dir, iteration);
    let tmp = save_dir.join(format!(".tmp-iter_{iteration:07}-{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp)?;
    }
    std::fs::create_dir_all(&tmp)?;
    let params = table.flat_params();
    let (pbytes, pdtype) = match params.dtype() {
        DType::F32 => (f32_bytes(&params.to_vec::<f32>()?), Dtype::F32),
        DType::BF16 => (params.to_vec::<bf16>()?.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(), Dtype::BF16),
        d => bail!("saving {d} parameters is not supported"),
    };
    let (master, m, v, step) = opt;
    let (mb, eb, vb) =
        (f32_bytes(&master.to_vec::<f32>()?), f32_bytes(&m.to_vec::<f32>()?), f32_bytes(&v.to_vec::<f32>()?));
    let n = table.numel();
    let views = vec![
        ("params", TensorView::new(pdtype, vec![n], &pbytes)?),
        ("master", TensorView::new(Dtype::F32, vec![n], &mb)?),
        ("exp_avg", TensorView::new(Dtype::F32, vec![n], &eb)?),
        ("exp_avg_sq", TensorView::new(Dtype::F32, vec![n], &vb)?),
    ];
    let bytes = safetensors::serialize(views, None)?;
    let sha = sha256_hex(&bytes);
    write_synced(&tmp.join(TENSORS), &bytes)?;
    let state = State {
        format_version: FORMAT_VERSION,
        iteration,
        consumed_samples,
        optimizer_step: step,
        params_dtype: params.dtype().to_string(),
        tensors_sha256: sha,
        param_names: table.metas().iter().map(|m| m.name.clone()).collect(),
        param_shapes: table.metas().iter().map(|m| m.local_shape.dims().to_vec()).collect(),
        settings: settings.clone(),
    };
    write_synced(&tmp.join(STATE), toml::to_string(&state)?.as_bytes())?;
    if final_dir.exists() {
        // Re-saving the same iteration: move the old one aside first so a crash never leaves neither.
        let old = save_dir.join(format!(".old-iter_{iteration:07}-{}", std::process::id()));
        std::fs::rename(&final_dir, &old)?;
        std::fs::rename(&tmp, &final_dir)?;
        std::fs::remove_dir_all(&old)?;
    } else {
        std::fs::rename(&tmp, &final_dir)?;
    }
    let tracker_tmp = save_dir.join(format!(".{TRACKER}.tmp"));
    write_synced(&tracker_tmp, format!("{iteration}\n").as_bytes())?;
    std::fs::rename(&tracker_tmp, save_dir.join(TRACKER))?;
    Ok(final_dir)
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

fn f32_vec(st: &SafeTensors, name: &str, n: usize, file: &Path) -> anyhow::Result<Vec<f32>> {
    let t = st.tensor(name).with_context(|| format!("{}: corrupt checkpoint: no tensor `{name}`", file.display()))?;
    let data = t.data();
    let v: Vec<f32> = match t.dtype() {
        Dtype::F32 => data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        Dtype::BF16 => {
            data.chunks_exact(2).map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32()).collect()
        }
        d => bail!("{}: corrupt checkpoint: tensor `{name}` has dtype {d:?}", file.display()),
    };
    if v.len() != n {
        bail!("{}: corrupt checkpoint: `{name}` has {} values, expected {n}", file.display(), v.len());
    }
    Ok(v)
}

/// Loads and verifies a checkpoint folder (see `resolve`).
pub fn load(dir: &Path) -> anyhow::Result<Loaded> {
    let dir = resolve(dir)?;
    let state_path = dir.join(STATE);
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
    let file = dir.join(TENSORS);
    let bytes = std::fs::read(&file).with_context(|| format!("cannot read {}", file.display()))?;
    let sha = sha256_hex(&bytes);
    if sha != state.tensors_sha256 {
        bail!(
            "{}: corrupt checkpoint: SHA-256 {sha} does not match {} recorded in {STATE}",
            file.display(),
            state.tensors_sha256
        );
    }
    let st = SafeTensors::deserialize(&bytes).with_context(|| format!("{}: corrupt checkpoint", file.display()))?;
    let n: usize = state.param_shapes.iter().map(|s| s.iter().product::<usize>()).sum();
    Ok(Loaded {
        params: f32_vec(&st, "params", n, &file)?,
        master: f32_vec(&st, "master", n, &file)?,
        exp_avg: f32_vec(&st, "exp_avg", n, &file)?,
        exp_avg_sq: f32_vec(&st, "exp_avg_sq", n, &file)?,
        state,
    })
}

/// Checks that the checkpoint's parameters are the model's, name by name.
pub fn check_matches(state: &State, table: &ParamTable) -> anyhow::Result<()> {
    let names: Vec<&str> = table.metas().iter().map(|m| m.name.as_str()).collect();
    for (i, m) in table.metas().iter().enumerate() {
        match (state.param_names.get(i), state.param_shapes.get(i)) {
            (Some(n), Some(s)) if *n == m.name && s.as_slice() == m.local_shape.dims() => {}
            (Some(n), Some(s)) => bail!(
                "checkpoint parameter {i} is `{n}` {s:?} but the model has `{}` {:?}: the model flags differ from the saved run",
                m.name,
                m.local_shape.dims()
            ),
            _ => bail!(
                "checkpoint has {} parameters, the model {}: the model flags differ from the saved run",
                state.param_names.len(),
                names.len()
            ),
        }
    }
    if state.param_names.len() != names.len() {
        bail!(
            "checkpoint has {} parameters, the model {}: the model flags differ from the saved run",
            state.param_names.len(),
            names.len()
        );
    }
    Ok(())
}
