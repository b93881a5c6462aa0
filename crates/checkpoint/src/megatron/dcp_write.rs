//! PyTorch distributed checkpoints written, as one rank of Megatron's `torch_dist` saves them:
//! each chunk a `torch.save` archive of its own appended to a `__0_I.distcp` file (a new file
//! past a size), each byte object (`_extra_state`) its torch.save'd bytes, and `.metadata` the
//! pickled `Metadata` naming every tensor's global shape, its chunks and where their bytes lie.
//! The inverse of `dcp.rs`; chunks are written as they come, so an export holds one at a time.

use super::MegatronError;
use super::pickle::Py;
use super::pickle_write;
use super::torch_file::TorchDtype;
use super::torch_save;
use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

const META: &str = "torch.distributed.checkpoint.metadata";

struct TensorMeta {
    dtype: TorchDtype,
    shape: Vec<usize>,
    /// Each chunk's sizes by its offsets (one chunk a place).
    chunks: BTreeMap<Vec<usize>, Vec<usize>>,
}

/// Where one item's bytes went: (fqn, chunk offsets or none for bytes) → (file, offset, length).
type Stored = Vec<((String, Option<Vec<usize>>), (String, u64, u64))>;

pub struct DcpWriter {
    dir: PathBuf,
    max_file: u64,
    file: Option<(String, BufWriter<File>, u64)>,
    files: usize,
    tensors: BTreeMap<String, TensorMeta>,
    objects: BTreeSet<String>,
    stored: Stored,
}

fn size(v: &[usize]) -> Py {
    Py::call("torch", "Size", vec![Py::Tuple(v.iter().map(|&x| Py::Int(x as i64)).collect())])
}

impl DcpWriter {
    /// A checkpoint written into `dir` (which exists), its .distcp files closed past `max_file`
    /// bytes (one item alone may exceed it).
    pub fn new(dir: &Path, max_file: u64) -> DcpWriter {
        DcpWriter {
            dir: dir.to_path_buf(),
            max_file,
            file: None,
            files: 0,
            tensors: BTreeMap::new(),
            objects: BTreeSet::new(),
            stored: vec![],
        }
    }

    fn bad(&self, why: String) -> MegatronError {
        MegatronError::Format { path: self.dir.join(".metadata"), why }
    }

    /// Appends `bytes` to the open file (a new one if it would pass the size), and returns
    /// where they went.
    fn append(&mut self, bytes: &[u8]) -> Result<(String, u64, u64), MegatronError> {
        if self.file.as_ref().is_some_and(|(_, _, at)| *at > 0 && at + bytes.len() as u64 > self.max_file) {
            self.close()?;
        }
        if self.file.is_none() {
            let name = format!("__0_{}.distcp", self.files);
            let path = self.dir.join(&name);
            let f = File::create(&path).map_err(|source| MegatronError::Io { path, source })?;
            self.files += 1;
            self.file = Some((name, BufWriter::new(f), 0));
        }
        let (name, f, at) = self.file.as_mut().expect("opened above");
        let path = self.dir.join(name.as_str());
        f.write_all(bytes).map_err(|source| MegatronError::Io { path, source })?;
        let place = (name.clone(), *at, bytes.len() as u64);
        *at += bytes.len() as u64;
        Ok(place)
    }

    fn close(&mut self) -> Result<(), MegatronError> {
        if let Some((name, f, _)) = self.file.take() {
            let path = self.dir.join(name);
            let f = f.into_inner().map_err(|e| MegatronError::Io { path: path.clone(), source: e.into_error() })?;
            f.sync_all().map_err(|source| MegatronError::Io { path, source })?;
        }
        Ok(())
    }

    /// The chunk at `offsets` (its values `bytes`, of `sizes`) of tensor `name` of global
    /// `shape`; every chunk of a tensor gives the same type and shape.
    pub fn chunk(
        &mut self,
        name: &str,
        dtype: TorchDtype,
        shape: &[usize],
        offsets: &[usize],
        sizes: &[usize],
        bytes: &[u8],
    ) -> Result<(), MegatronError> {
        let inside = offsets.len() == shape.len()
            && sizes.len() == shape.len()
            && offsets.iter().zip(sizes).zip(shape).all(|((o, s), d)| o + s <= *d);
        if !inside || bytes.len() != sizes.iter().product::<usize>() * dtype.size() {
            return Err(self.bad(format!(
                "a chunk {offsets:?}+{sizes:?} of {} bytes does not fit `{name}` {shape:?} of {dtype:?}",
                bytes.len()
            )));
        }
        if let Some(t) = self.tensors.get(name) {
            if t.dtype != dtype || t.shape != shape {
                return Err(self.bad(format!("`{name}` was {:?} {:?}, now {dtype:?} {shape:?}", t.dtype, t.shape)));
            }
            if t.chunks.contains_key(offsets) {
                return Err(self.bad(format!("`{name}` has a chunk at {offsets:?} already")));
            }
        }
        let archive = torch_save::save("archive", &torch_save::tensor("0", dtype, sizes), &[("0", bytes)])
            .map_err(|e| self.bad(format!("`{name}`: {e}")))?;
        let place = self.append(&archive)?;
        self.stored.push(((name.to_string(), Some(offsets.to_vec())), place));
        let t = self.tensors.entry(name.to_string()).or_insert_with(|| TensorMeta {
            dtype,
            shape: shape.to_vec(),
            chunks: BTreeMap::new(),
        });
        t.chunks.insert(offsets.to_vec(), sizes.to_vec());
        Ok(())
    }

    /// A byte object `key` (Megatron's sharded objects, `_extra_state/shard_…`): `obj` as
    /// torch.save writes it.
    pub fn object(&mut self, key: &str, obj: &Py) -> Result<(), MegatronError> {
        if self.objects.contains(key) || self.tensors.contains_key(key) {
            return Err(self.bad(format!("`{key}` is written already")));
        }
        let bytes = torch_save::save("archive", obj, &[]).map_err(|e| self.bad(format!("`{key}`: {e}")))?;
        let place = self.append(&bytes)?;
        self.stored.push(((key.to_string(), None), place));
        self.objects.insert(key.to_string());
        Ok(())
    }

    /// Closes the files and writes `.metadata`; a tensor whose chunks do not cover it is refused.
    pub fn finish(mut self) -> Result<(), MegatronError> {
        self.close()?;
        for (name, t) in &self.tensors {
            let covered: usize = t.chunks.values().map(|s| s.iter().product::<usize>()).sum();
            if covered != t.shape.iter().product::<usize>() {
                return Err(self.bad(format!("the chunks of `{name}` {:?} do not cover it", t.shape)));
            }
        }
        // (dtype, layout, requires_grad, memory_format, pin_memory): its __getstate__'s five
        // fields, which every PyTorch reads (newer ones add strides).
        let properties = |dtype: TorchDtype| {
            let state = Py::Tuple(vec![
                Py::Global("torch".into(), dtype.torch_name().into()),
                Py::call("torch.serialization", "_get_layout", vec![Py::Str("torch.strided".into())]),
                Py::Bool(false),
                Py::call(META, "_MEM_FORMAT_ENCODING", vec![Py::Int(0)]),
                Py::Bool(false),
            ]);
            Py::instance(META, "TensorProperties", state)
        };
        let mut entries = vec![];
        for (name, t) in &self.tensors {
            let chunks = t
                .chunks
                .iter()
                .map(|(o, s)| {
                    Py::with_attrs(META, "ChunkStorageMetadata", vec![("offsets", size(o)), ("sizes", size(s))])
                })
                .collect();
            let m = Py::with_attrs(
                META,
                "TensorStorageMetadata",
                vec![("properties", properties(t.dtype)), ("size", size(&t.shape)), ("chunks", Py::List(chunks))],
            );
            entries.push((Py::Str(name.clone()), m));
        }
        for key in &self.objects {
            entries.push((Py::Str(key.clone()), Py::call(META, "BytesStorageMetadata", vec![])));
        }
        let storage = self
            .stored
            .iter()
            .map(|((fqn, offsets), (file, at, len))| {
                let index = Py::with_attrs(
                    META,
                    "MetadataIndex",
                    vec![
                        ("fqn", Py::Str(fqn.clone())),
                        ("offset", offsets.as_deref().map_or(Py::None, size)),
                        ("index", Py::None),
                    ],
                );
                let info = Py::with_attrs(
                    "torch.distributed.checkpoint.filesystem",
                    "_StorageInfo",
                    vec![
                        ("relative_path", Py::Str(file.clone())),
                        ("offset", Py::Int(*at as i64)),
                        ("length", Py::Int(*len as i64)),
                    ],
                );
                (index, info)
            })
            .collect();
        let meta = Py::with_attrs(
            META,
            "Metadata",
            vec![
                ("state_dict_metadata", Py::Dict(entries)),
                ("planner_data", Py::None),
                ("storage_data", Py::Dict(storage)),
                ("storage_meta", Py::None),
                ("version", Py::Str("1.0.0".into())),
            ],
        );
        let path = self.dir.join(".metadata");
        std::fs::write(&path, pickle_write::dump(&meta)).map_err(|source| MegatronError::Io { path, source })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Chunks read back through `Dcp` by box; a second chunk at one place, a chunk outside its
    /// tensor, and a tensor its chunks do not cover are refused.
    #[test]
    fn chunks_read_back_and_bad_layouts_are_refused() {
        let dir = std::env::temp_dir().join(format!("ferrotron-dcp-write-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let rows = |r: std::ops::Range<u32>| -> Vec<u8> { r.flat_map(|x| (x as f32).to_le_bytes()).collect() };
        // Tiny files: every item past the first opens a new one.
        let mut w = DcpWriter::new(&dir, 1);
        w.chunk("t", TorchDtype::F32, &[2, 3], &[1, 0], &[1, 3], &rows(3..6)).unwrap();
        w.chunk("t", TorchDtype::F32, &[2, 3], &[0, 0], &[1, 3], &rows(0..3)).unwrap();
        let e = w.chunk("t", TorchDtype::F32, &[2, 3], &[0, 0], &[1, 3], &rows(0..3)).unwrap_err();
        assert!(e.to_string().contains("has a chunk at [0, 0] already"), "{e}");
        let e = w.chunk("t", TorchDtype::F32, &[2, 3], &[2, 0], &[1, 3], &rows(0..3)).unwrap_err();
        assert!(e.to_string().contains("does not fit"), "{e}");
        w.object("o/shard_0_1", &Py::List(vec![Py::None])).unwrap();
        w.finish().unwrap();
        let d = super::super::dcp::Dcp::open(&dir).unwrap();
        assert_eq!(d.read_box("t", &[0, 0], &[2, 3]).unwrap(), vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
        assert!(d.objects.contains("o/shard_0_1"));
        assert!(dir.join("__0_2.distcp").exists(), "a file an item");
        let mut w = DcpWriter::new(&dir, 1 << 20);
        w.chunk("half", TorchDtype::F32, &[2, 3], &[0, 0], &[1, 3], &rows(0..3)).unwrap();
        let e = w.finish().unwrap_err();
        assert!(e.to_string().contains("do not cover"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
