//! Megatron's `--data-cache-path`: a GPT dataset's three indices kept between runs as .npy files,
//! named as Megatron names them (`<hash>-GPTDataset-<split>-{description.txt, document_index.npy,
//! sample_index.npy, shuffle_index.npy}`), the hash taken over a description of everything the
//! indices depend on (the dataset's path, its sequence range and token count, the samples asked
//! for, the sequence length and the seed). Our hash is SHA-256 where Megatron's is MD5 of its own
//! description, so the two tools do not read each other's files; each finds its own.
//!
//! Files are written to a temporary name of their own and renamed, so ranks (processes or
//! threads) that build the same indices at once leave whole files; a file that does not read back
//! as the indices it should hold is an error naming it (delete it and the run rebuilds it), never
//! a silent rebuild over it.

use crate::DataError;
use sha2::{Digest, Sha256};
use std::fs;
use std::path::{Path, PathBuf};

/// The cached indices of one dataset: document ids, sample starts (document position, offset)
/// and the sample permutation.
pub struct Indices {
    pub documents: Vec<u32>,
    pub starts: Vec<(u32, u32)>,
    pub shuffle: Vec<u32>,
}

/// The same, borrowed (what a freshly built dataset writes).
#[derive(Clone, Copy)]
pub struct IndicesRef<'a> {
    pub documents: &'a [u32],
    pub starts: &'a [(u32, u32)],
    pub shuffle: &'a [u32],
}

/// Where a dataset's files go: `dir/<hash>-GPTDataset-<split>-`.
pub struct CacheEntry {
    base: PathBuf,
    description: String,
}

impl CacheEntry {
    pub fn new(dir: &Path, split: &str, description: String) -> Self {
        let hash: String = Sha256::digest(description.as_bytes()).iter().take(16).map(|b| format!("{b:02x}")).collect();
        CacheEntry { base: dir.join(format!("{hash}-GPTDataset-{split}-")), description }
    }

    fn file(&self, what: &str) -> PathBuf {
        let mut s = self.base.clone().into_os_string();
        s.push(what);
        s.into()
    }

    /// The indices, if all three files are there (None when any is missing).
    pub fn load(&self) -> Result<Option<Indices>, DataError> {
        let files = ["document_index.npy", "sample_index.npy", "shuffle_index.npy"].map(|w| self.file(w));
        if !files.iter().all(|f| f.exists()) {
            return Ok(None);
        }
        let documents = read_npy(&files[0], 1)?;
        let flat = read_npy(&files[1], 2)?;
        let shuffle = read_npy(&files[2], 1)?;
        let starts = flat.chunks_exact(2).map(|p| (p[0], p[1])).collect();
        Ok(Some(Indices { documents, starts, shuffle }))
    }

    /// Writes the description and the three indices.
    pub fn save(&self, ix: IndicesRef) -> Result<(), DataError> {
        if let Some(dir) = self.base.parent() {
            fs::create_dir_all(dir).map_err(|e| DataError::Io { path: dir.to_path_buf(), source: e })?;
        }
        write_atomic(&self.file("description.txt"), self.description.as_bytes())?;
        write_atomic(&self.file("document_index.npy"), &npy(ix.documents, &[ix.documents.len()]))?;
        let flat: Vec<u32> = ix.starts.iter().flat_map(|&(d, o)| [d, o]).collect();
        write_atomic(&self.file("sample_index.npy"), &npy(&flat, &[ix.starts.len(), 2]))?;
        write_atomic(&self.file("shuffle_index.npy"), &npy(ix.shuffle, &[ix.shuffle.len()]))
    }

    /// The file a consistency check should name.
    pub fn path_of(&self, what: &str) -> PathBuf {
        self.file(what)
    }
}

/// `bytes` into `path` by way of a name no other writer uses (ranks are processes or threads of
/// one), renamed into place: a reader sees the old file or the whole new one.
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), DataError> {
    static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let io = |e| DataError::Io { path: path.to_path_buf(), source: e };
    let mut tmp = path.as_os_str().to_owned();
    let n = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    tmp.push(format!(".tmp{}-{n}", std::process::id()));
    let tmp = PathBuf::from(tmp);
    fs::write(&tmp, bytes).map_err(io)?;
    fs::rename(&tmp, path).map_err(io)
}

/// A little-endian u32 array as a .npy file (format 1.0, header padded to 64 bytes).
fn npy(values: &[u32], shape: &[usize]) -> Vec<u8> {
    let dims = match shape {
        [n] => format!("({n},)"),
        _ => format!("({})", shape.iter().map(usize::to_string).collect::<Vec<_>>().join(", ")),
    };
    let mut header = format!("{{'descr': '<u4', 'fortran_order': False, 'shape': {dims}, }}");
    let unpadded = 10 + header.len() + 1;
    header.push_str(&" ".repeat(unpadded.next_multiple_of(64) - unpadded));
    header.push('\n');
    let mut out = Vec::with_capacity(10 + header.len() + 4 * values.len());
    out.extend_from_slice(b"\x93NUMPY\x01\x00");
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend(values.iter().flat_map(|v| v.to_le_bytes()));
    out
}

/// A .npy file this module wrote: little-endian u32, C order, `ndim` dimensions (the second, if
/// any, 2), its element count matching its shape.
fn read_npy(path: &Path, ndim: usize) -> Result<Vec<u32>, DataError> {
    let bad = |why: &str| DataError::BadCache { path: path.to_path_buf(), why: why.to_string() };
    let bytes = fs::read(path).map_err(|e| DataError::Io { path: path.to_path_buf(), source: e })?;
    if bytes.len() < 10 || &bytes[..8] != b"\x93NUMPY\x01\x00" {
        return Err(bad("not a .npy file of format 1.0"));
    }
    let hlen = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    let header =
        bytes.get(10..10 + hlen).and_then(|h| std::str::from_utf8(h).ok()).ok_or_else(|| bad("header cut short"))?;
    if !header.contains("'descr': '<u4'") || !header.contains("'fortran_order': False") {
        return Err(bad("not a little-endian u32 array in C order"));
    }
    let shape: Vec<usize> = header
        .split("'shape': (")
        .nth(1)
        .and_then(|s| s.split(')').next())
        .ok_or_else(|| bad("no shape in the header"))?
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().map_err(|_| bad("a shape entry is not a number")))
        .collect::<Result<_, _>>()?;
    if shape.len() != ndim || (ndim == 2 && shape[1] != 2) {
        return Err(bad(&format!("shape {shape:?} where {ndim} dimension(s) were written")));
    }
    let data = &bytes[10 + hlen..];
    let count: usize = shape.iter().product();
    if data.len() != 4 * count {
        return Err(bad(&format!("{} bytes of data for {count} values", data.len())));
    }
    Ok(data.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn indices_round_trip_and_corruption_is_named() {
        let dir = std::env::temp_dir().join(format!("ferrotron-index-cache-{}", std::process::id()));
        let entry = CacheEntry::new(&dir, "train", "a description".into());
        assert!(entry.load().unwrap().is_none(), "nothing cached yet");
        let ix = Indices { documents: vec![3, 1, 2], starts: vec![(0, 0), (1, 5), (2, 9)], shuffle: vec![1, 0] };
        entry.save(IndicesRef { documents: &ix.documents, starts: &ix.starts, shuffle: &ix.shuffle }).unwrap();
        let back = entry.load().unwrap().unwrap();
        assert_eq!((back.documents, back.starts, back.shuffle), (ix.documents, ix.starts, ix.shuffle));
        // Another description, another file name.
        assert_ne!(CacheEntry::new(&dir, "train", "other".into()).base, entry.base);
        // A truncated index is an error that names the file, not a silent rebuild.
        let f = entry.path_of("sample_index.npy");
        let bytes = fs::read(&f).unwrap();
        fs::write(&f, &bytes[..bytes.len() - 3]).unwrap();
        let e = entry.load().err().expect("a truncated file is refused").to_string();
        assert!(e.contains("sample_index.npy") && e.contains("delete"), "{e}");
        fs::remove_dir_all(&dir).unwrap();
    }
}
