//! One rank's shard file: its pieces as safetensors tensors, each tensor's piece in the header's
//! metadata (`{"key", "piece"}` JSON under the tensor's name), and `format` = [`SHARD_FORMAT`].
//!
//! A piece that is a whole tensor-parallel part is stored in the part's shape, so the file reads
//! like any safetensors file: under the key's own name, `@tp{rank}` added for a part of a split
//! tensor; a partial range (a distributed optimizer's share) is stored flat, `+{start}` added.

use crate::codec::{encode_as, stored_dtype, width};
use crate::{CheckpointError, Piece, Result, SHARD_FORMAT, io};
use ferrotron_core::DType;
use safetensors::Dtype;
use safetensors::tensor::View;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::borrow::Cow;
use std::collections::HashMap;
use std::path::Path;

/// One run of values to store: `values` (as f32) is `piece`'s range of tensor `key`, kept as `dtype`.
pub struct ShardEntry<'a> {
    pub key: String,
    pub piece: Piece,
    pub dtype: DType,
    pub values: Cow<'a, [f32]>,
}

/// What the header says about one stored tensor.
#[derive(Serialize, Deserialize)]
pub(crate) struct Stored {
    pub key: String,
    pub piece: Piece,
}

impl ShardEntry<'_> {
    /// The tensor's name in the file and its stored shape.
    fn stored_as(&self) -> (String, Vec<usize>) {
        let part = self.piece.part_shape();
        let mut name = self.key.clone();
        if let Some(s) = self.piece.split {
            name += &format!("@tp{}", s.rank);
        }
        if self.piece.start == 0 && self.piece.len == part.iter().product::<usize>() {
            (name, part)
        } else {
            (format!("{name}+{}", self.piece.start), vec![self.piece.len])
        }
    }
}

/// One tensor as the writer takes it: encoded only when the writer reaches it, so a file's
/// tensors are never all held as bytes at once.
struct Lazy<'a> {
    st: Dtype,
    shape: Vec<usize>,
    values: &'a [f32],
}

impl View for &Lazy<'_> {
    fn dtype(&self) -> Dtype {
        self.st
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        encode_as(self.st, self.values)
    }
    fn data_len(&self) -> usize {
        self.values.len() * width(self.st).unwrap_or(4)
    }
}

/// Writes `entries` to `path` (created or replaced), synced to disk; returns the file's SHA-256.
pub fn write_shard(path: &Path, entries: &[ShardEntry]) -> Result<String> {
    let mut meta = HashMap::from([("format".to_string(), SHARD_FORMAT.to_string())]);
    let mut named = Vec::with_capacity(entries.len());
    for e in entries {
        e.piece.validate(&e.key)?;
        if e.values.len() != e.piece.len {
            return Err(CheckpointError::BadPiece {
                key: e.key.clone(),
                why: format!("{} values for a piece of {}", e.values.len(), e.piece.len),
            });
        }
        let (name, shape) = e.stored_as();
        let stored = serde_json::to_string(&Stored { key: e.key.clone(), piece: e.piece.clone() })
            .map_err(|x| CheckpointError::BadPiece { key: e.key.clone(), why: x.to_string() })?;
        if name == "format" || meta.insert(name.clone(), stored).is_some() {
            return Err(CheckpointError::BadPiece { key: e.key.clone(), why: format!("stored twice as `{name}`") });
        }
        named.push((name, Lazy { st: stored_dtype(&e.key, e.dtype)?, shape, values: &e.values }));
    }
    let views = named.iter().map(|(name, lazy)| (name.as_str(), lazy));
    safetensors::serialize_to_file(views, Some(meta), path)
        .map_err(|x| CheckpointError::Io { path: path.to_path_buf(), source: std::io::Error::other(x.to_string()) })?;
    let mut f = std::fs::File::open(path).map_err(io(path))?;
    f.sync_all().map_err(io(path))?;
    sha256_file(&mut f).map_err(io(path))
}

/// SHA-256 of a file's bytes as lower-case hex, read in chunks.
pub fn sha256_file(f: &mut std::fs::File) -> std::io::Result<String> {
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
    Ok(hex(&h.finalize()))
}

/// SHA-256 of `bytes` as lower-case hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
