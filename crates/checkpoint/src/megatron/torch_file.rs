//! `torch.save` files: a zip archive (stored, not compressed) holding `PREFIX/data.pkl` and one
//! entry `PREFIX/data/KEY` per storage. A tensor in the pickle is a call of
//! `torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)` whose storage is a
//! persistent id `('storage', torch.<Type>Storage, KEY, location, numel)`; its values are read
//! here on demand, one tensor at a time.

use super::MegatronError;
use super::pickle::{self, Py};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

/// The element types a storage can hold (by its class: FloatStorage, BFloat16Storage, ...).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TorchDtype {
    F64,
    F32,
    BF16,
    F16,
    I64,
    I32,
    I16,
    I8,
    U8,
    Bool,
}

impl TorchDtype {
    fn of_storage(class: &str) -> Option<TorchDtype> {
        Some(match class {
            "DoubleStorage" => TorchDtype::F64,
            "FloatStorage" => TorchDtype::F32,
            "BFloat16Storage" => TorchDtype::BF16,
            "HalfStorage" => TorchDtype::F16,
            "LongStorage" => TorchDtype::I64,
            "IntStorage" => TorchDtype::I32,
            "ShortStorage" => TorchDtype::I16,
            "CharStorage" => TorchDtype::I8,
            "ByteStorage" => TorchDtype::U8,
            "BoolStorage" => TorchDtype::Bool,
            _ => return None,
        })
    }
    pub fn size(self) -> usize {
        match self {
            TorchDtype::F64 | TorchDtype::I64 => 8,
            TorchDtype::F32 | TorchDtype::I32 => 4,
            TorchDtype::BF16 | TorchDtype::F16 | TorchDtype::I16 => 2,
            TorchDtype::I8 | TorchDtype::U8 | TorchDtype::Bool => 1,
        }
    }
    fn to_f32(self, b: &[u8]) -> f32 {
        match self {
            TorchDtype::F64 => f64::from_le_bytes(b.try_into().expect("8 bytes")) as f32,
            TorchDtype::F32 => f32::from_le_bytes(b.try_into().expect("4 bytes")),
            TorchDtype::BF16 => half::bf16::from_le_bytes([b[0], b[1]]).to_f32(),
            TorchDtype::F16 => half::f16::from_le_bytes([b[0], b[1]]).to_f32(),
            TorchDtype::I64 => i64::from_le_bytes(b.try_into().expect("8 bytes")) as f32,
            TorchDtype::I32 => i32::from_le_bytes(b.try_into().expect("4 bytes")) as f32,
            TorchDtype::I16 => i16::from_le_bytes([b[0], b[1]]) as f32,
            TorchDtype::I8 => b[0] as i8 as f32,
            TorchDtype::U8 | TorchDtype::Bool => b[0] as f32,
        }
    }
}

/// Where a pickled tensor's values are: its storage's entry and the view into it.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorRef {
    pub dtype: TorchDtype,
    pub shape: Vec<usize>,
    pub stride: Vec<usize>,
    pub offset: usize,
    pub key: String,
}

impl TensorRef {
    /// The tensor a pickled value stands for: a `_rebuild_tensor_v2` call (or an
    /// `nn.Parameter` around one); `None` for anything else.
    pub fn of(v: &Py) -> Option<TensorRef> {
        let Py::Object { callable, args, .. } = v else { return None };
        if callable.is_global("torch._utils", "_rebuild_parameter")
            || callable.is_global("torch._utils", "_rebuild_parameter_with_state")
        {
            return TensorRef::of(args.first()?);
        }
        if !callable.is_global("torch._utils", "_rebuild_tensor_v2") {
            return None;
        }
        let Py::Persistent(pid) = args.first()? else { return None };
        let Py::Tuple(pid) = pid.as_ref() else { return None };
        let (Some(Py::Str(tag)), Some(Py::Global(_, class)), Some(key)) = (pid.first(), pid.get(1), pid.get(2)) else {
            return None;
        };
        if tag != "storage" {
            return None;
        }
        let key = match key {
            Py::Str(s) => s.clone(),
            Py::Int(i) => i.to_string(),
            _ => return None,
        };
        let ints = |i: usize| -> Option<Vec<usize>> {
            args.get(i)?.as_ints()?.into_iter().map(|x| usize::try_from(x).ok()).collect()
        };
        Some(TensorRef {
            dtype: TorchDtype::of_storage(class)?,
            offset: usize::try_from(args.get(1)?.as_int()?).ok()?,
            shape: ints(2)?,
            stride: ints(3)?,
            key,
        })
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// An open `torch.save` archive.
pub struct TorchFile<R: Read + Seek> {
    zip: zip::ZipArchive<R>,
    prefix: String,
    path: PathBuf,
}

impl<R: Read + Seek> TorchFile<R> {
    /// `path` names the file (or the file a byte range came from) in errors.
    pub fn new(reader: R, path: &Path) -> Result<Self, MegatronError> {
        let bad = |why: String| MegatronError::Format { path: path.to_path_buf(), why };
        let zip = zip::ZipArchive::new(reader).map_err(|e| bad(format!("not a torch.save zip archive ({e})")))?;
        let pkl = zip
            .file_names()
            .filter_map(Result::ok)
            .find(|n| n.ends_with("/data.pkl") && n.matches('/').count() == 1)
            .ok_or_else(|| bad("no data.pkl in the archive (a torch.save file from before PyTorch 1.6?)".into()))?;
        let prefix = pkl.trim_end_matches("data.pkl").to_string();
        Ok(TorchFile { zip, prefix, path: path.to_path_buf() })
    }

    fn entry(&mut self, name: &str) -> Result<Vec<u8>, MegatronError> {
        let full = format!("{}{name}", self.prefix);
        let path = self.path.clone();
        let mut f = self
            .zip
            .by_name(&full)
            .map_err(|e| MegatronError::Format { path: path.clone(), why: format!("entry {full}: {e}") })?;
        let mut out = Vec::with_capacity(f.size() as usize);
        f.read_to_end(&mut out).map_err(|e| MegatronError::Format { path, why: format!("entry {full}: {e}") })?;
        Ok(out)
    }

    /// The pickled object (tensors as `_rebuild_tensor_v2` calls: see `TensorRef::of`).
    pub fn object(&mut self) -> Result<Py, MegatronError> {
        let bytes = self.entry("data.pkl")?;
        pickle::load(&bytes).map_err(|source| MegatronError::Pickle { path: self.path.clone(), source })
    }

    /// Bytes `start .. start + len` of a stored entry, read without the rest of it (a model
    /// saved beside a distributed optimizer has every parameter a view into one large buffer).
    fn range(&mut self, name: &str, start: u64, len: usize) -> Result<Option<Vec<u8>>, MegatronError> {
        let full = format!("{}{name}", self.prefix);
        let fail = |e: &dyn std::fmt::Display| MegatronError::Format {
            path: self.path.clone(),
            why: format!("entry {full}: {e} (torch.save stores its entries uncompressed)"),
        };
        let mut f = self.zip.by_name_seek(&full).map_err(|e| fail(&e))?;
        let total = f.seek(SeekFrom::End(0)).map_err(|e| fail(&e))?;
        if start + len as u64 > total {
            return Ok(None);
        }
        f.seek(SeekFrom::Start(start)).map_err(|e| fail(&e))?;
        let mut out = vec![0u8; len];
        f.read_exact(&mut out).map_err(|e| fail(&e))?;
        Ok(Some(out))
    }

    /// A tensor's values as f32, in row-major order.
    pub fn read(&mut self, t: &TensorRef) -> Result<Vec<f32>, MegatronError> {
        let path = self.path.clone();
        let bad = |why: String| MegatronError::Format { path: path.clone(), why };
        if t.shape.len() != t.stride.len() {
            return Err(bad(format!("storage {}: a view of shape {:?} with strides {:?}", t.key, t.shape, t.stride)));
        }
        let es = t.dtype.size();
        let n = t.numel();
        // Only the bytes from the view's first element to its last are read; indices below are
        // relative to the first.
        let last = t.shape.iter().zip(&t.stride).map(|(&d, &s)| d.saturating_sub(1) * s).sum::<usize>();
        let span = if n == 0 { 0 } else { (last + 1) * es };
        let Some(storage) = self.range(&format!("data/{}", t.key), (t.offset * es) as u64, span)? else {
            return Err(bad(format!(
                "storage {} is too short for a {:?} view of shape {:?} at element {}",
                t.key, t.dtype, t.shape, t.offset
            )));
        };
        // Row-major and dense (what torch.save writes for a whole tensor): one pass over the bytes.
        let mut dense = 1usize;
        let contiguous = t.shape.iter().zip(&t.stride).rev().all(|(&d, &s)| {
            let ok = d <= 1 || s == dense;
            dense *= d;
            ok
        });
        if contiguous {
            return Ok(storage.chunks_exact(es).map(|b| t.dtype.to_f32(b)).collect());
        }
        let mut out = Vec::with_capacity(n);
        let mut idx = vec![0usize; t.shape.len()];
        for _ in 0..n {
            let at = idx.iter().zip(&t.stride).map(|(i, s)| i * s).sum::<usize>();
            out.push(t.dtype.to_f32(&storage[at * es..(at + 1) * es]));
            for d in (0..idx.len()).rev() {
                idx[d] += 1;
                if idx[d] < t.shape[d] {
                    break;
                }
                idx[d] = 0;
            }
        }
        Ok(out)
    }
}
