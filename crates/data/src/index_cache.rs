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
//! a silent rebuild over it. Read back, the indices are memory-mapped as Megatron's are (numpy's
//! `mmap_mode='r'`): a run of a billion samples holds no 12 GB of them in each rank's memory, and a
//! rename by another rank leaves the mapped file as it was.

use crate::DataError;
use memmap2::Mmap;
use sha2::{Digest, Sha256};
use std::fs;
use std::ops::Deref;
use std::path::{Path, PathBuf};

/// The cached indices of one dataset: document ids, sample starts (document position, offset
/// pairs, flat) and the sample permutation.
pub struct Indices {
    pub documents: U32s,
    pub starts: U32s,
    pub shuffle: U32s,
}

/// The same, borrowed (what a freshly built dataset writes).
#[derive(Clone, Copy)]
pub struct IndicesRef<'a> {
    pub documents: &'a [u32],
    pub starts: &'a [u32],
    pub shuffle: &'a [u32],
}

/// An index array: built in memory, or the data of a cached .npy file mapped read-only.
pub struct U32s(Repr);

enum Repr {
    Owned(Vec<u32>),
    /// `len` values from byte `start` of the map (4-byte aligned: checked when mapped).
    Mapped {
        map: Mmap,
        start: usize,
        len: usize,
    },
}

impl U32s {
    /// Whether the values are a mapped file's (not copied into memory).
    pub fn is_mapped(&self) -> bool {
        matches!(self.0, Repr::Mapped { .. })
    }
}

impl From<Vec<u32>> for U32s {
    fn from(v: Vec<u32>) -> Self {
        U32s(Repr::Owned(v))
    }
}

impl Deref for U32s {
    type Target = [u32];
    fn deref(&self) -> &[u32] {
        match &self.0 {
            Repr::Owned(v) => v,
            // Alignment and length were checked when the file was mapped, so this cannot fail.
            Repr::Mapped { map, start, len } => bytemuck::try_cast_slice(&map[*start..*start + 4 * len]).unwrap_or(&[]),
        }
    }
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
        let starts = read_npy(&files[1], 2)?;
        let shuffle = read_npy(&files[2], 1)?;
        Ok(Some(Indices { documents, starts, shuffle }))
    }

    /// Writes the description and the three indices.
    pub fn save(&self, ix: IndicesRef) -> Result<(), DataError> {
        if let Some(dir) = self.base.parent() {
            fs::create_dir_all(dir).map_err(|e| DataError::Io { path: dir.to_path_buf(), source: e })?;
        }
        write_atomic(&self.file("description.txt"), self.description.as_bytes())?;
        write_atomic(&self.file("document_index.npy"), &npy(ix.documents, &[ix.documents.len()]))?;
        write_atomic(&self.file("sample_index.npy"), &npy(ix.starts, &[ix.starts.len() / 2, 2]))?;
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

/// A .npy file this module wrote, mapped: little-endian u32, C order, `ndim` dimensions (the
/// second, if any, 2), its element count matching its shape (read flat).
fn read_npy(path: &Path, ndim: usize) -> Result<U32s, DataError> {
    let bad = |why: &str| DataError::BadCache { path: path.to_path_buf(), why: why.to_string() };
    let io = |e| DataError::Io { path: path.to_path_buf(), source: e };
    let file = fs::File::open(path).map_err(io)?;
    // SAFETY: the map is read-only and writers replace cache files by renaming a new file over
    // them (`write_atomic`), so the mapped file itself never changes underneath.
    let map = unsafe { Mmap::map(&file) }.map_err(io)?;
    let bytes = &map[..];
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
    let start = 10 + hlen;
    let data = &bytes[start..];
    let count: usize = shape.iter().product();
    if data.len() != 4 * count {
        return Err(bad(&format!("{} bytes of data for {count} values", data.len())));
    }
    if cfg!(target_endian = "big") || bytemuck::try_cast_slice::<u8, u32>(data).is_err() {
        // Values to decode, or data not 4-byte aligned in the map: copied into memory.
        return Ok(data
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect::<Vec<_>>()
            .into());
    }
    Ok(U32s(Repr::Mapped { map, start, len: count }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn indices_round_trip_and_corruption_is_named() {
        let dir = std::env::temp_dir().join(format!("ferrotron-index-cache-{}", std::process::id()));
        let entry = CacheEntry::new(&dir, "train", "a description".into());
        assert!(entry.load().unwrap().is_none(), "nothing cached yet");
        let (documents, starts, shuffle) = (vec![3, 1, 2], vec![0, 0, 1, 5, 2, 9], vec![1, 0]);
        entry.save(IndicesRef { documents: &documents, starts: &starts, shuffle: &shuffle }).unwrap();
        let back = entry.load().unwrap().unwrap();
        assert_eq!(
            (&back.documents[..], &back.starts[..], &back.shuffle[..]),
            (&documents[..], &starts[..], &shuffle[..])
        );
        // Read back mapped (the .npy header pads the data to 64 bytes), not copied.
        assert!(back.documents.is_mapped() && back.starts.is_mapped() && back.shuffle.is_mapped());
        drop(back);
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
