//! Reading a sharded checkpoint under any layout: the headers of every shard file are read once
//! (memory-mapped; the data pages are touched only when read), and each request — one piece
//! of one tensor under the reader's own layout — is assembled run by run from the stored pieces
//! that hold it. A file's SHA-256 is checked the first time a value is read from it, so a rank
//! hashes only the files it reads.

use crate::codec::{decode, width};
use crate::write::{Stored, sha256_hex};
use crate::{CheckpointError, Piece, Result, SHARD_FORMAT, io};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

struct ShardFile {
    path: PathBuf,
    map: Mmap,
    recorded: Option<String>,
    /// The hash found, once checked.
    found: OnceLock<String>,
}

struct Entry {
    file: usize,
    piece: Piece,
    dtype: Dtype,
    /// Byte range of the values within the file.
    bytes: Range<usize>,
}

pub struct ShardReader {
    files: Vec<ShardFile>,
    index: HashMap<String, Vec<Entry>>,
}

impl ShardReader {
    /// Opens shard files: (path, the SHA-256 recorded for it; None to skip the check).
    pub fn open(files: &[(PathBuf, Option<String>)]) -> Result<Self> {
        let mut out = ShardReader { files: vec![], index: HashMap::new() };
        for (path, recorded) in files {
            let f = std::fs::File::open(path).map_err(io(path))?;
            // SAFETY: the map is read-only; a checkpoint's files are not modified while a run
            // reads them (saves write a new folder and rename it into place).
            let map = unsafe { Mmap::map(&f) }.map_err(io(path))?;
            out.add(path, &map)?;
            out.files.push(ShardFile { path: path.clone(), map, recorded: recorded.clone(), found: OnceLock::new() });
        }
        Ok(out)
    }

    fn add(&mut self, path: &Path, map: &[u8]) -> Result<()> {
        let corrupt = |what: String| CheckpointError::Corrupt { path: path.to_path_buf(), what };
        let (n, meta) = SafeTensors::read_metadata(map).map_err(|e| corrupt(e.to_string()))?;
        let header = meta.metadata().clone().unwrap_or_default();
        if header.get("format").map(String::as_str) != Some(SHARD_FORMAT) {
            return Err(corrupt(format!("not a Ferrotron shard (metadata `format` is not {SHARD_FORMAT})")));
        }
        let data_start = 8 + n;
        for (name, info) in meta.tensors() {
            let text =
                header.get(&name).ok_or_else(|| corrupt(format!("tensor `{name}` has no piece in the header")))?;
            let Stored { key, piece } =
                serde_json::from_str(text).map_err(|e| corrupt(format!("piece of `{name}`: {e}")))?;
            piece.validate(&key)?;
            let w = width(info.dtype).ok_or_else(|| corrupt(format!("`{name}` has dtype {:?}", info.dtype)))?;
            let (a, b) = info.data_offsets;
            if b - a != piece.len * w {
                return Err(corrupt(format!("`{name}` holds {} bytes for {} values", b - a, piece.len)));
            }
            let entry =
                Entry { file: self.files.len(), piece, dtype: info.dtype, bytes: data_start + a..data_start + b };
            self.index.entry(key).or_default().push(entry);
        }
        Ok(())
    }

    /// Every tensor name stored.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(String::as_str)
    }

    /// The whole shape of tensor `key` as saved.
    pub fn global_shape(&self, key: &str) -> Option<&[usize]> {
        self.index.get(key).and_then(|e| e.first()).map(|e| e.piece.global_shape.as_slice())
    }

    fn check(&self, file: usize) -> Result<()> {
        let f = &self.files[file];
        let Some(recorded) = &f.recorded else { return Ok(()) };
        let found = f.found.get_or_init(|| sha256_hex(&f.map[..]));
        if found != recorded {
            return Err(CheckpointError::Checksum {
                path: f.path.clone(),
                found: found.clone(),
                recorded: recorded.clone(),
            });
        }
        Ok(())
    }

    /// The values of `want` (a range of a tensor-parallel part, under the caller's layout) of
    /// tensor `key`. With `rows` (a vocabulary's real size), dim 0 may differ from the saved
    /// tensor's (padding) and every row from `rows` on reads as 0.
    pub fn read(&self, key: &str, want: &Piece, rows: Option<usize>) -> Result<Vec<f32>> {
        want.validate(key)?;
        let saved = self.index.get(key).ok_or_else(|| CheckpointError::Missing(key.to_string()))?;
        let g = &want.global_shape;
        for e in saved {
            let s = &e.piece.global_shape;
            let rows_differ = rows.is_some() && s.len() == g.len() && !g.is_empty() && s[1..] == g[1..];
            if s != g && !rows_differ {
                return Err(CheckpointError::Shape { key: key.to_string(), saved: s.clone(), want: g.clone() });
            }
        }
        // With equal trailing dims a flat index means the same element in both shapes.
        let row = g.iter().skip(1).product::<usize>().max(1);
        let limit = rows.map(|r| r * row).unwrap_or(usize::MAX);
        let mut out = Vec::with_capacity(want.len);
        let (mut i, end, mut hint) = (want.start, want.start + want.len, 0);
        while i < end {
            let (gi, run) = want.to_global(i);
            let n = run.min(end - i);
            if gi >= limit {
                out.resize(out.len() + n, 0.0);
                i += n;
                continue;
            }
            let n = n.min(limit - gi);
            let hit = (0..saved.len()).map(|k| (hint + k) % saved.len()).find_map(|k| {
                let p = &saved[k].piece;
                let (j, prun) = p.to_local(gi)?;
                p.range().contains(&j).then(|| (k, j, n.min(prun).min(p.start + p.len - j)))
            });
            let Some((k, j, m)) = hit else {
                return Err(CheckpointError::Incomplete { key: key.to_string(), index: gi });
            };
            hint = k;
            let e = &saved[k];
            self.check(e.file)?;
            let w = width(e.dtype).unwrap_or(4);
            let at = e.bytes.start + (j - e.piece.start) * w;
            decode(e.dtype, &self.files[e.file].map[at..at + m * w], &mut out);
            i += m;
        }
        Ok(out)
    }

    /// Tensor `key` whole, as saved (with `rows`: its first `rows` rows).
    pub fn read_whole(&self, key: &str, rows: Option<usize>) -> Result<(Vec<usize>, Vec<f32>)> {
        let mut shape = self.global_shape(key).ok_or_else(|| CheckpointError::Missing(key.to_string()))?.to_vec();
        if let Some(r) = rows.filter(|&r| !shape.is_empty() && r < shape[0]) {
            shape[0] = r;
        }
        let v = self.read(key, &Piece::whole(&shape), rows)?;
        Ok((shape, v))
    }
}
