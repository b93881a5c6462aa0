//! Megatron-LM's legacy `torch` format: one `model_optim_rng.pt` per model-parallel rank, in
//! `mp_rank_TT` (tensor rank), `mp_rank_TT_PPP` (and pipeline stage) or with `_EEE` (expert
//! rank) folders, each the rank's own part of the model by its local names. Joined here into
//! the whole model's names: a stage's layers numbered on from the stages before it (counted in
//! the files, so uneven stages need no flags), an expert-parallel rank's experts on from the
//! ranks before it; a tensor-parallel tensor is one part per tensor rank, joined when read with
//! the cut the caller names (`TpCut`: which dim, in which blocks), since that is the model's
//! knowledge, not the file's.

use super::torch_file::{TensorRef, TorchFile};
use super::{MegatronError, Py};
use crate::piece::{Piece, Split};
use ferrotron_core::{Blocks, Shard};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

/// A tensor-parallel tensor's cut: the dim, cut into blocks whose rank parts each rank holds in
/// block order (SwiGLU's fc1: two blocks, gate and up), as `ferrotron_core::Shard`.
pub type TpCut = (usize, Blocks);

/// One rank's part of a tensor: its file and view.
struct Part {
    file: usize,
    tensor: TensorRef,
}

pub(super) struct Legacy {
    files: Vec<(PathBuf, TorchFile<BufReader<File>>)>,
    /// Whole-model name → one part per tensor rank, in rank order.
    tensors: BTreeMap<String, Vec<Part>>,
    /// The run's arguments and iteration (the first file's).
    pub args: Py,
    pub iteration: Option<i64>,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> MegatronError + '_ {
    move |source| MegatronError::Io { path: path.to_path_buf(), source }
}

/// `mp_rank_…`'s numbers: (tensor rank, the rest).
fn rank_numbers(name: &str) -> Option<Vec<usize>> {
    name.strip_prefix("mp_rank_")?.split('_').map(|n| n.parse().ok()).collect()
}

/// One more than the largest `prefix{N}.` index among `keys` (0 if none): the local count.
fn count(keys: &[String], prefix: &str) -> usize {
    keys.iter()
        .filter_map(|k| k.split_once(prefix)?.1.split('.').next()?.parse::<usize>().ok())
        .map(|n| n + 1)
        .max()
        .unwrap_or(0)
}

/// `key` with the number after `prefix` moved on by `by`.
fn renumber(key: &str, prefix: &str, by: usize) -> String {
    let Some((head, rest)) = key.split_once(prefix) else { return key.to_string() };
    let Some((n, tail)) = rest.split_once('.') else { return key.to_string() };
    match n.parse::<usize>() {
        Ok(n) => format!("{head}{prefix}{}.{tail}", n + by),
        Err(_) => key.to_string(),
    }
}

/// Where the expert number starts in a grouped GEMM's weight name (`….mlp.experts.linear_fc1.weight3`).
fn grouped_index(name: &str) -> Option<usize> {
    let (head, n) = name.rsplit_once(".weight")?;
    let grouped = head.ends_with(".mlp.experts.linear_fc1") || head.ends_with(".mlp.experts.linear_fc2");
    (grouped && !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit())).then_some(head.len() + ".weight".len())
}

/// How many experts each grouped GEMM of a file holds: its weights' count by name less number.
fn grouped_counts(keys: &[String]) -> BTreeMap<&str, usize> {
    let mut counts = BTreeMap::new();
    for k in keys {
        if let Some(at) = grouped_index(k) {
            *counts.entry(&k[..at]).or_insert(0) += 1;
        }
    }
    counts
}

const LAYERS: &str = "decoder.layers.";
const EXPERTS: &str = ".mlp.experts.local_experts.";

impl Legacy {
    /// The rank folders `ranks` (names `mp_rank_…`) of iteration folder `dir`.
    pub fn open(dir: &Path, ranks: &[String]) -> Result<Legacy, MegatronError> {
        let bad = |why: String| MegatronError::Format { path: dir.to_path_buf(), why };
        let mut numbered = vec![];
        for r in ranks {
            let n = rank_numbers(r).filter(|n| (1..=3).contains(&n.len()));
            numbered.push((n.ok_or_else(|| bad(format!("`{r}` is not a rank folder name Megatron writes")))?, r));
        }
        let mut opened = vec![];
        for (n, r) in &numbered {
            let path = dir.join(r).join("model_optim_rng.pt");
            let f = File::open(&path).map_err(io(&path))?;
            let mut tf = TorchFile::new(BufReader::new(f), &path)?;
            let state = tf.object()?;
            opened.push((n.clone(), path, tf, state));
        }
        let (args, iteration) = super::MegatronCheckpoint::header(&opened[0].3, &opened[0].1)?;
        let size = |field: &str| args.get(field).and_then(Py::as_int).unwrap_or(1).max(1) as usize;
        let (tp, pp, ep) = (
            size("tensor_model_parallel_size"),
            size("pipeline_model_parallel_size"),
            size("expert_model_parallel_size"),
        );
        // Each folder's (tensor, pipeline, expert) ranks: a two-number name is a pipeline stage
        // or an expert rank as the run's sizes say.
        let place = |n: &[usize]| -> (usize, usize, usize) {
            match n {
                [t] => (*t, 0, 0),
                [t, x] if pp > 1 => (*t, *x, 0),
                [t, x] => (*t, 0, *x),
                [t, p, e] => (*t, *p, *e),
                _ => unreachable!("1 to 3 numbers"),
            }
        };
        let mut by_rank = BTreeMap::new();
        for (i, (n, ..)) in opened.iter().enumerate() {
            by_rank.insert(place(n), i);
        }
        if by_rank.len() != opened.len() || by_rank.len() != tp * pp * ep {
            return Err(bad(format!(
                "{} rank folders for tensor × pipeline × expert parallel sizes {tp} × {pp} × {ep} (the run's arguments): a rank's file is missing or extra",
                opened.len()
            )));
        }
        let mut files = vec![];
        let mut models = vec![];
        for (_, path, tf, state) in opened {
            let fail = |why: &str| MegatronError::Format { path: path.clone(), why: why.into() };
            if state.get("model0").is_some() {
                return Err(fail(
                    "a legacy checkpoint with virtual pipeline stages (model0, model1, ...): save it as torch_dist",
                ));
            }
            let model = state.get("model").and_then(Py::items).ok_or_else(|| fail("no `model` state dict"))?;
            let tensors: Vec<(String, TensorRef)> =
                model.iter().filter_map(|(k, v)| Some((k.as_str()?.to_string(), TensorRef::of(v)?))).collect();
            models.push(tensors);
            files.push((path, tf));
        }
        // Layers of stage p start after those of stages 0..p (counted in their first file).
        let mut layer_at = vec![0; pp];
        for p in 1..pp {
            let keys: Vec<String> = models[by_rank[&(0, p - 1, 0)]].iter().map(|(k, _)| k.clone()).collect();
            layer_at[p] = layer_at[p - 1] + count(&keys, LAYERS);
        }
        let tied = !matches!(args.get("untie_embeddings_and_output_weights"), Some(Py::Bool(true)));
        let mut tensors: BTreeMap<String, Vec<Option<Part>>> = BTreeMap::new();
        for (&(t, p, e), &i) in &by_rank {
            let keys: Vec<String> = models[i].iter().map(|(k, _)| k.clone()).collect();
            let local_experts = count(&keys, EXPERTS);
            let grouped = grouped_counts(&keys);
            for (k, tensor) in std::mem::take(&mut models[i]) {
                let expert = k.contains(EXPERTS);
                // Every expert rank holds the model's other tensors: taken from the first.
                // A tied output layer is the last stage's copy of the embedding, as is an
                // embedding on a later stage (multi-token prediction's).
                if (e > 0 && !expert) || (tied && k == "output_layer.weight") || (p > 0 && k.starts_with("embedding."))
                {
                    continue;
                }
                let mut name = renumber(&k, LAYERS, layer_at[p]);
                if expert {
                    name = renumber(&name, EXPERTS, e * local_experts);
                } else if let Some(at) = grouped_index(&name).filter(|_| ep > 1) {
                    // Transformer Engine's grouped GEMM numbers its experts in the name's end.
                    let n: usize = name[at..].parse().expect("digits");
                    // (counted under the file's own name: its layer not yet moved on)
                    let here = grouped[&k[..k.len() - (name.len() - at)]];
                    name = format!("{}{}", &name[..at], n + e * here);
                }
                let parts = tensors.entry(name.clone()).or_insert_with(|| (0..tp).map(|_| None).collect());
                if parts[t].is_some() {
                    return Err(bad(format!(
                        "`{name}` comes from two rank files of tensor rank {t}: their layout is not the one the run's arguments give"
                    )));
                }
                parts[t] = Some(Part { file: i, tensor });
            }
        }
        let mut joined = BTreeMap::new();
        for (name, parts) in tensors {
            let parts: Option<Vec<Part>> = parts.into_iter().collect();
            let parts = parts.ok_or_else(|| bad(format!("`{name}` is missing from a tensor-parallel rank's file")))?;
            if parts.iter().any(|p| p.tensor.shape != parts[0].tensor.shape) {
                return Err(bad(format!("`{name}`'s parts differ in shape across the tensor-parallel ranks")));
            }
            joined.insert(name, parts);
        }
        Ok(Legacy { files, tensors: joined, args, iteration })
    }

    /// Each tensor's name and the shape of one tensor-parallel rank's part.
    pub fn shapes(&self) -> BTreeMap<String, Vec<usize>> {
        self.tensors.iter().map(|(k, p)| (k.clone(), p[0].tensor.shape.clone())).collect()
    }

    /// Tensor `name` whole: its parts joined along `cut` (none: replicated, one rank's read).
    pub fn read(&mut self, name: &str, cut: Option<TpCut>) -> Result<(Vec<usize>, Vec<f32>), MegatronError> {
        let parts = self.tensors.get(name).ok_or_else(|| MegatronError::Missing(name.to_string()))?;
        let local = parts[0].tensor.shape.clone();
        let read = |files: &mut Vec<(PathBuf, TorchFile<BufReader<File>>)>, p: &Part| files[p.file].1.read(&p.tensor);
        let Some((dim, blocks)) = cut.filter(|_| parts.len() > 1) else {
            return Ok((local, read(&mut self.files, &parts[0])?));
        };
        let size = parts.len();
        let mut global = local.clone();
        let path = self.files[parts[0].file].0.clone();
        let fail = |why: String| MegatronError::Format { path: path.clone(), why };
        if dim >= global.len() {
            return Err(fail(format!("`{name}` {local:?} has no dim {dim} to join its parts along")));
        }
        global[dim] *= size;
        let mut out = vec![0f32; global.iter().product()];
        for (rank, p) in parts.iter().enumerate() {
            let piece = Piece {
                global_shape: global.clone(),
                split: Some(Split::of(dim, Shard { rank, size, blocks })),
                start: 0,
                len: local.iter().product(),
            };
            piece.validate(name).map_err(|e| fail(e.to_string()))?;
            let values = read(&mut self.files, p)?;
            let mut i = 0;
            while i < values.len() {
                let (g, run) = piece.to_global(i);
                let run = run.min(values.len() - i);
                out[g..g + run].copy_from_slice(&values[i..i + run]);
                i += run;
            }
        }
        Ok((global, out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stage_and_expert_numbers_move_on() {
        let k = "decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight";
        assert_eq!(renumber(k, LAYERS, 2), "decoder.layers.3.mlp.experts.local_experts.0.linear_fc1.weight");
        assert_eq!(renumber(k, EXPERTS, 4), "decoder.layers.1.mlp.experts.local_experts.4.linear_fc1.weight");
        assert_eq!(renumber("output_layer.weight", LAYERS, 2), "output_layer.weight");
        let keys: Vec<String> = ["decoder.layers.0.x", "decoder.layers.2.y", "embedding.w"].map(String::from).into();
        assert_eq!(count(&keys, LAYERS), 3);
        assert_eq!(count(&keys, EXPERTS), 0);
        assert_eq!(rank_numbers("mp_rank_01_002"), Some(vec![1, 2]));
        let g = "decoder.layers.1.mlp.experts.linear_fc1.weight12";
        assert_eq!(grouped_index(g).map(|at| &g[at..]), Some("12"));
        assert_eq!(grouped_index("decoder.layers.1.mlp.linear_fc1.weight"), None);
        let keys: Vec<String> = (0..3).map(|e| format!("decoder.layers.1.mlp.experts.linear_fc1.weight{e}")).collect();
        assert_eq!(grouped_counts(&keys).get(&g[..grouped_index(g).unwrap()]), Some(&3));
        assert_eq!(rank_numbers("mp_rank_x"), None);
    }
}
