//! `torch.save` archives written: the object pickled into `PREFIX/data.pkl`, each storage's bytes
//! in `PREFIX/data/KEY` (stored, each entry's data aligned to 64 bytes as PyTorch aligns them,
//! so a memory-mapped `torch.load` works too), and the records PyTorch writes beside them. The
//! inverse of `torch_file.rs`.

use super::pickle::Py;
use super::pickle_write;
use super::torch_file::TorchDtype;
use sha2::{Digest, Sha256};
use std::io::{Cursor, Write};
use zip::write::SimpleFileOptions;

impl TorchDtype {
    /// The storage class a tensor of this type is rebuilt from.
    fn storage_class(self) -> &'static str {
        match self {
            TorchDtype::F64 => "DoubleStorage",
            TorchDtype::F32 => "FloatStorage",
            TorchDtype::BF16 => "BFloat16Storage",
            TorchDtype::F16 => "HalfStorage",
            TorchDtype::I64 => "LongStorage",
            TorchDtype::I32 => "IntStorage",
            TorchDtype::I16 => "ShortStorage",
            TorchDtype::I8 => "CharStorage",
            TorchDtype::U8 => "ByteStorage",
            TorchDtype::Bool => "BoolStorage",
        }
    }

    /// The `torch.<dtype>` constant (a tensor's properties in DCP metadata, `params_dtype`).
    pub fn torch_name(self) -> &'static str {
        match self {
            TorchDtype::F64 => "float64",
            TorchDtype::F32 => "float32",
            TorchDtype::BF16 => "bfloat16",
            TorchDtype::F16 => "float16",
            TorchDtype::I64 => "int64",
            TorchDtype::I32 => "int32",
            TorchDtype::I16 => "int16",
            TorchDtype::I8 => "int8",
            TorchDtype::U8 => "uint8",
            TorchDtype::Bool => "bool",
        }
    }
}

fn ints(v: &[usize]) -> Py {
    Py::Tuple(v.iter().map(|&x| Py::Int(x as i64)).collect())
}

/// A contiguous tensor of `shape` whose values are storage `key` (the pickle of
/// `torch._utils._rebuild_tensor_v2`, as `torch.save` writes a tensor).
pub fn tensor(key: &str, dtype: TorchDtype, shape: &[usize]) -> Py {
    let mut stride = vec![1usize; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        stride[d] = stride[d + 1] * shape[d + 1];
    }
    let numel: usize = shape.iter().product();
    let pid = Py::Tuple(vec![
        Py::Str("storage".into()),
        Py::Global("torch".into(), dtype.storage_class().into()),
        Py::Str(key.into()),
        Py::Str("cpu".into()),
        Py::Int(numel as i64),
    ]);
    Py::call(
        "torch._utils",
        "_rebuild_tensor_v2",
        vec![
            Py::Persistent(Box::new(pid)),
            Py::Int(0),
            ints(shape),
            ints(&stride),
            Py::Bool(false),
            Py::call("collections", "OrderedDict", vec![]),
        ],
    )
}

/// `obj` saved as `torch.save` writes it, its tensors' storages `(key, bytes)` beside it;
/// `prefix` is the archive's folder (PyTorch names it after the file: `common` for common.pt).
pub fn save(prefix: &str, obj: &Py, storages: &[(&str, &[u8])]) -> zip::result::ZipResult<Vec<u8>> {
    let pickle = pickle_write::dump(obj);
    let mut zip = zip::ZipWriter::new(Cursor::new(Vec::new()));
    let mut entry = |name: &str, bytes: &[u8]| -> zip::result::ZipResult<()> {
        let options = SimpleFileOptions::default()
            .compression_method(zip::CompressionMethod::Stored)
            .with_alignment(64)
            .large_file(bytes.len() as u64 >= u32::MAX as u64);
        zip.start_file(format!("{prefix}/{name}"), options)?;
        zip.write_all(bytes)?;
        Ok(())
    };
    entry("data.pkl", &pickle)?;
    entry(".format_version", b"1")?;
    entry(".storage_alignment", b"64")?;
    entry("byteorder", b"little")?;
    for (key, bytes) in storages {
        entry(&format!("data/{key}"), bytes)?;
    }
    entry("version", b"3\n")?;
    // Forty decimal digits, as PyTorch's; from the contents, so a save is reproducible.
    let digest = Sha256::digest(&pickle);
    let id: String = digest.iter().take(20).map(|b| format!("{:02}", b % 100)).collect();
    entry(".data/serialization_id", id.as_bytes())?;
    Ok(zip.finish()?.into_inner())
}

#[cfg(test)]
mod tests {
    use super::super::torch_file::{TensorRef, TorchFile};
    use super::*;

    /// A saved dict of two tensors reads back through `TorchFile`: the views, the values, and
    /// each storage's data at a multiple of 64 bytes in the archive.
    #[test]
    fn saved_tensors_read_back() {
        let a: Vec<f32> = (0..6).map(|i| i as f32 * 0.5 - 1.0).collect();
        let b: Vec<half::bf16> = (0..4).map(|i| half::bf16::from_f32(i as f32 + 0.25)).collect();
        let obj = Py::Dict(vec![
            (Py::Str("a".into()), tensor("0", TorchDtype::F32, &[2, 3])),
            (Py::Str("b".into()), tensor("1", TorchDtype::BF16, &[4])),
            (Py::Str("n".into()), Py::Int(7)),
        ]);
        let bytes = save(
            "archive",
            &obj,
            &[("0", bytemuck::cast_slice(&a)), ("1", bytemuck::cast_slice::<half::bf16, u8>(&b))],
        )
        .unwrap();
        let mut f = TorchFile::new(Cursor::new(bytes.clone()), "t.pt".as_ref()).unwrap();
        let back = f.object().unwrap();
        assert_eq!(back, obj);
        let ta = TensorRef::of(back.get("a").unwrap()).unwrap();
        assert_eq!((ta.shape.clone(), ta.stride.clone()), (vec![2, 3], vec![3, 1]));
        assert_eq!(f.read(&ta).unwrap(), a);
        let tb = TensorRef::of(back.get("b").unwrap()).unwrap();
        assert_eq!(f.read(&tb).unwrap(), b.iter().map(|x| x.to_f32()).collect::<Vec<_>>());
        let mut zip = zip::ZipArchive::new(Cursor::new(bytes)).unwrap();
        for key in ["archive/data/0", "archive/data/1", "archive/data.pkl"] {
            let at = zip.by_name(key).unwrap().data_start().unwrap();
            assert_eq!(at % 64, 0, "{key} at {at}");
        }
    }
}
