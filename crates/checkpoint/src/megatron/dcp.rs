//! PyTorch distributed checkpoints (DCP), the files of Megatron's `torch_dist` format: `.metadata`
//! (a pickled `Metadata`: every tensor's global shape and the chunks it was saved in, and where
//! each chunk's bytes lie) and `__R_I.distcp` files, each chunk in them a `torch.save` archive of
//! its own. A read asks for a box of a tensor (one layer of a stacked one) and gets it assembled
//! from the chunks that overlap it, reading no other chunk.

use super::MegatronError;
use super::pickle::{self, Py};
use super::torch_file::{TensorRef, TorchFile};
use std::collections::BTreeMap;
use std::io::{Cursor, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

#[derive(Clone, Debug)]
struct Chunk {
    offsets: Vec<usize>,
    sizes: Vec<usize>,
    file: String,
    at: u64,
    len: u64,
}

/// (tensor, chunk offsets) → the chunk's file, offset and length there, or why it is unreadable.
type Places = BTreeMap<(String, Vec<usize>), Result<(String, u64, u64), String>>;

/// One tensor of the checkpoint: its global shape and its saved chunks.
#[derive(Clone, Debug)]
pub struct DcpTensor {
    pub shape: Vec<usize>,
    /// The chunks, or why they cannot be read: an error only for a read of this tensor, so an
    /// optimizer tensor in a layout not read here does not stop an import of the model's.
    chunks: Result<Vec<Chunk>, String>,
}

pub struct Dcp {
    dir: PathBuf,
    pub tensors: BTreeMap<String, DcpTensor>,
    /// The byte objects' keys (Megatron's sharded objects: `_extra_state/shard_…`).
    pub objects: std::collections::BTreeSet<String>,
}

fn usizes(v: Option<&Py>) -> Option<Vec<usize>> {
    v?.as_ints()?.into_iter().map(|x| usize::try_from(x).ok()).collect()
}

impl Dcp {
    pub fn open(dir: &Path) -> Result<Dcp, MegatronError> {
        let path = dir.join(".metadata");
        let bytes = std::fs::read(&path).map_err(|source| MegatronError::Io { path: path.clone(), source })?;
        let meta = pickle::load(&bytes).map_err(|source| MegatronError::Pickle { path: path.clone(), source })?;
        Self::from_metadata(dir, &meta)
    }

    /// The checkpoint in `dir` whose `.metadata` unpickled to `meta`.
    fn from_metadata(dir: &Path, meta: &Py) -> Result<Dcp, MegatronError> {
        let path = dir.join(".metadata");
        let bad = |why: &str| MegatronError::Format { path: path.clone(), why: why.into() };
        let tensors_meta =
            meta.get("state_dict_metadata").and_then(Py::items).ok_or_else(|| bad("no state_dict_metadata"))?;
        let storage = meta.get("storage_data").and_then(Py::items).ok_or_else(|| bad("no storage_data"))?;
        // (fqn, chunk offsets) → where the chunk's bytes are, or why they cannot be read.
        let mut places: Places = BTreeMap::new();
        for (index, info) in storage {
            let Some(fqn) = index.get("fqn").and_then(Py::as_str) else { continue };
            let Some(offsets) = usizes(index.get("offset")) else { continue };
            // Compression and other transforms (newer PyTorch) are not read.
            let plain = match info.get("transform_descriptors") {
                None | Some(Py::None) => true,
                Some(Py::List(l) | Py::Tuple(l)) => l.is_empty(),
                Some(_) => false,
            };
            let place = match (
                info.get("relative_path").and_then(Py::as_str),
                info.get("offset").and_then(Py::as_int).and_then(|x| u64::try_from(x).ok()),
                info.get("length").and_then(Py::as_int).and_then(|x| u64::try_from(x).ok()),
            ) {
                _ if !plain => Err(format!("`{fqn}` is stored transformed (compressed): not read here")),
                (Some(file), Some(at), Some(len)) => Ok((file.to_string(), at, len)),
                _ => Err(format!("`{fqn}` has a chunk without its file, offset or length")),
            };
            places.insert((fqn.to_string(), offsets), place);
        }
        let mut tensors = BTreeMap::new();
        let mut objects = std::collections::BTreeSet::new();
        for (name, m) in tensors_meta {
            if let (Some(name), Some((_, "BytesStorageMetadata"))) = (name.as_str(), m.class()) {
                objects.insert(name.to_string());
            }
            let (Some(name), Some((_, "TensorStorageMetadata"))) = (name.as_str(), m.class()) else { continue };
            let shape = usizes(m.get("size")).ok_or_else(|| bad(&format!("`{name}` has no size")))?;
            let chunks = Self::chunks(name, m, &shape, &places);
            tensors.insert(name.to_string(), DcpTensor { shape, chunks });
        }
        Ok(Dcp { dir: dir.to_path_buf(), tensors, objects })
    }

    /// Tensor `name`'s chunks (`m`: its TensorStorageMetadata) and where each one's bytes are.
    fn chunks(name: &str, m: &Py, shape: &[usize], places: &Places) -> Result<Vec<Chunk>, String> {
        let Some(Py::List(list)) = m.get("chunks") else { return Err(format!("`{name}` lists no chunks")) };
        let mut chunks = vec![];
        for c in list {
            let (Some(offsets), Some(sizes)) = (usizes(c.get("offsets")), usizes(c.get("sizes"))) else {
                return Err(format!("`{name}` has a chunk without offsets and sizes"));
            };
            if offsets.len() != shape.len()
                || sizes.len() != shape.len()
                || offsets.iter().zip(&sizes).zip(shape).any(|((o, s), d)| o + s > *d)
            {
                return Err(format!("`{name}` has a chunk {offsets:?}+{sizes:?} outside its shape {shape:?}"));
            }
            let (file, at, len) = places
                .get(&(name.to_string(), offsets.clone()))
                .cloned()
                .unwrap_or_else(|| Err(format!("`{name}`'s chunk at {offsets:?} is in no file")))?;
            chunks.push(Chunk { offsets, sizes, file, at, len });
        }
        Ok(chunks)
    }

    /// The box `start .. start + size` of tensor `name`, row-major, as f32.
    pub fn read_box(&self, name: &str, start: &[usize], size: &[usize]) -> Result<Vec<f32>, MegatronError> {
        let t = self.tensors.get(name).ok_or_else(|| MegatronError::Missing(name.to_string()))?;
        let chunks = t
            .chunks
            .as_ref()
            .map_err(|why| MegatronError::Format { path: self.dir.join(".metadata"), why: why.clone() })?;
        let rank = t.shape.len();
        assert!(start.len() == rank && size.len() == rank, "read_box: a box of the tensor's rank");
        let n: usize = size.iter().product();
        let mut out = vec![0f32; n];
        // Which elements a chunk gave: two chunks giving one (a corrupt .metadata) must not
        // leave another unfilled unnoticed.
        let mut given = vec![false; n];
        for c in chunks {
            // The overlap of the chunk and the box, per dim.
            let lo: Vec<usize> = (0..rank).map(|d| start[d].max(c.offsets[d])).collect();
            let hi: Vec<usize> = (0..rank).map(|d| (start[d] + size[d]).min(c.offsets[d] + c.sizes[d])).collect();
            if (0..rank).any(|d| lo[d] >= hi[d]) {
                continue;
            }
            let values = self.chunk(name, c)?;
            let ext: Vec<usize> = (0..rank).map(|d| hi[d] - lo[d]).collect();
            let count: usize = ext.iter().product();
            // Runs along the last dim are contiguous on both sides: copied a run at a time.
            let run = ext.last().copied().unwrap_or(1);
            let outer = rank.saturating_sub(1);
            let mut idx = vec![0usize; outer];
            for _ in 0..count / run.max(1) {
                let (mut src, mut dst) = (0usize, 0usize);
                for d in 0..rank {
                    let i = if d < outer { idx[d] } else { 0 };
                    src = src * c.sizes[d] + (lo[d] + i - c.offsets[d]);
                    dst = dst * size[d] + (lo[d] + i - start[d]);
                }
                if given[dst..dst + run].iter().any(|&g| g) {
                    return Err(MegatronError::Format {
                        path: self.dir.join(".metadata"),
                        why: format!(
                            "two chunks of `{name}` overlap (one at {:?}): the checkpoint is corrupt",
                            c.offsets
                        ),
                    });
                }
                given[dst..dst + run].fill(true);
                out[dst..dst + run].copy_from_slice(&values[src..src + run]);
                for d in (0..outer).rev() {
                    idx[d] += 1;
                    if idx[d] < ext[d] {
                        break;
                    }
                    idx[d] = 0;
                }
            }
        }
        if given.contains(&false) {
            return Err(MegatronError::Format {
                path: self.dir.join(".metadata"),
                why: format!("the chunks of `{name}` do not cover {start:?}+{size:?}: the checkpoint is incomplete"),
            });
        }
        Ok(out)
    }

    /// One chunk's values (its own torch.save archive inside a .distcp file).
    fn chunk(&self, name: &str, c: &Chunk) -> Result<Vec<f32>, MegatronError> {
        let path = self.dir.join(&c.file);
        let io = |source| MegatronError::Io { path: path.clone(), source };
        let mut f = std::fs::File::open(&path).map_err(io)?;
        f.seek(SeekFrom::Start(c.at)).map_err(io)?;
        let mut bytes = vec![0u8; usize::try_from(c.len).unwrap_or(usize::MAX)];
        f.read_exact(&mut bytes).map_err(io)?;
        let mut tf = TorchFile::new(Cursor::new(bytes), &path)?;
        let obj = tf.object()?;
        let t = TensorRef::of(&obj).ok_or_else(|| MegatronError::Format {
            path: path.clone(),
            why: format!("the chunk of `{name}` at {:?} is not a tensor", c.offsets),
        })?;
        if t.shape != c.sizes {
            return Err(MegatronError::Format {
                path: path.clone(),
                why: format!("the chunk of `{name}` at {:?} is {:?}, not {:?}", c.offsets, t.shape, c.sizes),
            });
        }
        tf.read(&t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn object(class: &str, attrs: Vec<(&str, Py)>) -> Py {
        Py::with_attrs("torch.distributed.checkpoint.metadata", class, attrs)
    }
    fn size(v: &[i64]) -> Py {
        Py::call("torch", "Size", vec![Py::Tuple(v.iter().map(|&x| Py::Int(x)).collect())])
    }
    fn tensor(shape: &[i64], chunks: &[(&[i64], &[i64])]) -> Py {
        let chunks = chunks
            .iter()
            .map(|(o, s)| object("ChunkStorageMetadata", vec![("offsets", size(o)), ("sizes", size(s))]))
            .collect();
        object("TensorStorageMetadata", vec![("size", size(shape)), ("chunks", Py::List(chunks))])
    }

    /// A tensor whose chunks cannot be read (an optimizer's in a layout not read here, a chunk in
    /// no file) is an error when read, not when the checkpoint is opened; the others read.
    #[test]
    fn unreadable_tensors_fail_only_when_read() {
        // The Llama fixture's final norm: its one chunk in __0_0.distcp.
        let dir =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../trainer/tests/fixtures/megatron/llama_dist/iter_0000020");
        let norm = "decoder.final_layernorm.weight";
        let meta = object(
            "Metadata",
            vec![
                (
                    "state_dict_metadata",
                    Py::Dict(vec![
                        (Py::Str(norm.into()), tensor(&[64], &[(&[0], &[64])])),
                        (Py::Str("optimizer.flat".into()), tensor(&[8], &[(&[0, 0], &[8])])),
                        (Py::Str("optimizer.lost".into()), tensor(&[8], &[(&[0], &[8])])),
                        (Py::Str("twice".into()), tensor(&[64], &[(&[0], &[64]), (&[0], &[64])])),
                    ]),
                ),
                (
                    "storage_data",
                    Py::Dict(
                        [norm, "twice"]
                            .iter()
                            .map(|n| {
                                (
                                    object(
                                        "MetadataIndex",
                                        vec![("fqn", Py::Str(n.to_string())), ("offset", size(&[0]))],
                                    ),
                                    object(
                                        "_StorageInfo",
                                        vec![
                                            ("relative_path", Py::Str("__0_0.distcp".into())),
                                            ("offset", Py::Int(173820)),
                                            ("length", Py::Int(1833)),
                                            ("transform_descriptors", Py::None),
                                        ],
                                    ),
                                )
                            })
                            .collect(),
                    ),
                ),
            ],
        );
        let d = Dcp::from_metadata(&dir, &meta).unwrap();
        let v = d.read_box(norm, &[8], &[4]).unwrap();
        let all = d.read_box(norm, &[0], &[64]).unwrap();
        assert_eq!(v, all[8..12]);
        assert!(all.iter().all(|x| (0.5..1.5).contains(x)), "the fixture's norm weights: {all:?}");
        let e = d.read_box("optimizer.flat", &[0], &[8]).unwrap_err().to_string();
        assert!(e.contains("outside its shape"), "{e}");
        let e = d.read_box("optimizer.lost", &[0], &[8]).unwrap_err().to_string();
        assert!(e.contains("in no file"), "{e}");
        // Two chunks over the same elements (a corrupt .metadata) are named, not summed.
        let e = d.read_box("twice", &[0], &[64]).unwrap_err().to_string();
        assert!(e.contains("overlap"), "{e}");
    }
}
