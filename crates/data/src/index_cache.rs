//! Megatron's `--data-cache-path`: a dataset's indices kept between runs as .npy files, named as
//! Megatron names them: a GPT dataset's three (`<hash>-GPTDataset-<split>-{description.txt,
//! document_index.npy, sample_index.npy, shuffle_index.npy}`) and a blend's two
//! (`<hash>-BlendedDataset-<split>-{description.txt, dataset_index.npy, dataset_sample_index.npy}`),
//! the hash taken over a description of everything the indices depend on (for a GPT dataset its
//! path, sequence range and token count, the samples asked for, the sequence length and the seed;
//! for a blend its parts' descriptions, weights and size). Our hash is SHA-256 where Megatron's is
//! MD5 of its own description, and our sample indices are u32 where Megatron's are int64, so the
//! two tools do not read each other's files; each finds its own.
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

/// An element type of the index files: little-endian, its numpy `descr`.
pub trait Elem: bytemuck::Pod {
    const DESCR: &'static str;
    fn from_le(bytes: &[u8]) -> Self;
}

impl Elem for u32 {
    const DESCR: &'static str = "<u4";
    fn from_le(b: &[u8]) -> Self {
        u32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }
}

impl Elem for u16 {
    const DESCR: &'static str = "<u2";
    fn from_le(b: &[u8]) -> Self {
        u16::from_le_bytes([b[0], b[1]])
    }
}

/// An index array: built in memory, or the data of a cached .npy file mapped read-only.
pub struct Array<T: Elem>(Repr<T>);

/// The GPT dataset's indices and a blend's sample numbers.
pub type U32s = Array<u32>;
/// A blend's part numbers.
pub type U16s = Array<u16>;

enum Repr<T> {
    Owned(Vec<T>),
    /// `len` values from byte `start` of the map (aligned for T: checked when mapped).
    Mapped {
        map: Mmap,
        start: usize,
        len: usize,
    },
}

impl<T: Elem> Array<T> {
    /// Whether the values are a mapped file's (not copied into memory).
    pub fn is_mapped(&self) -> bool {
        matches!(self.0, Repr::Mapped { .. })
    }
}

impl<T: Elem> From<Vec<T>> for Array<T> {
    fn from(v: Vec<T>) -> Self {
        Array(Repr::Owned(v))
    }
}

impl<T: Elem> Deref for Array<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match &self.0 {
            Repr::Owned(v) => v,
            // Alignment and length were checked when the file was mapped, so this cannot fail.
            Repr::Mapped { map, start, len } => {
                bytemuck::try_cast_slice(&map[*start..*start + size_of::<T>() * len]).unwrap_or(&[])
            }
        }
    }
}

/// A blend's picks: sample i is sample `sample[i]` of part `part[i]` (Megatron's dataset_index
/// and dataset_sample_index; 6 bytes a sample).
pub struct BlendPicks {
    pub part: U16s,
    pub sample: U32s,
}

/// Where a dataset's files go: `dir/<hash>-<class>-<split>-`, `class` being Megatron's class name
/// (`GPTDataset`, `BlendedDataset`).
pub struct CacheEntry {
    base: PathBuf,
    description: String,
}

impl CacheEntry {
    pub fn new(dir: &Path, class: &str, split: &str, description: String) -> Self {
        let hash: String = Sha256::digest(description.as_bytes()).iter().take(16).map(|b| format!("{b:02x}")).collect();
        CacheEntry { base: dir.join(format!("{hash}-{class}-{split}-")), description }
    }

    /// The description the file names' hash is taken over.
    pub fn description(&self) -> &str {
        &self.description
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
        self.save_description()?;
        write_atomic(&self.file("document_index.npy"), &npy(ix.documents, &[ix.documents.len()]))?;
        write_atomic(&self.file("sample_index.npy"), &npy(ix.starts, &[ix.starts.len() / 2, 2]))?;
        write_atomic(&self.file("shuffle_index.npy"), &npy(ix.shuffle, &[ix.shuffle.len()]))
    }

    /// A blend's picks, if both files are there (None when either is missing); their lengths
    /// are checked equal here, their values by the caller, who knows the parts.
    pub fn load_blend(&self) -> Result<Option<BlendPicks>, DataError> {
        let files = ["dataset_index.npy", "dataset_sample_index.npy"].map(|w| self.file(w));
        if !files.iter().all(|f| f.exists()) {
            return Ok(None);
        }
        let (part, sample) = (read_npy::<u16>(&files[0], 1)?, read_npy::<u32>(&files[1], 1)?);
        if part.len() != sample.len() {
            let why = format!("{} entries against dataset_index.npy's {}", sample.len(), part.len());
            return Err(DataError::BadCache { path: files[1].clone(), why });
        }
        Ok(Some(BlendPicks { part, sample }))
    }

    /// Writes the description and a blend's picks.
    pub fn save_blend(&self, picks: &BlendPicks) -> Result<(), DataError> {
        self.save_description()?;
        write_atomic(&self.file("dataset_index.npy"), &npy(&picks.part, &[picks.part.len()]))?;
        write_atomic(&self.file("dataset_sample_index.npy"), &npy(&picks.sample, &[picks.sample.len()]))
    }

    fn save_description(&self) -> Result<(), DataError> {
        if let Some(dir) = self.base.parent() {
            fs::create_dir_all(dir).map_err(|e| DataError::Io { path: dir.to_path_buf(), source: e })?;
        }
        write_atomic(&self.file("description.txt"), self.description.as_bytes())
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

/// A little-endian array as a .npy file (format 1.0, header padded to 64 bytes).
fn npy<T: Elem>(values: &[T], shape: &[usize]) -> Vec<u8> {
    let dims = match shape {
        [n] => format!("({n},)"),
        _ => format!("({})", shape.iter().map(usize::to_string).collect::<Vec<_>>().join(", ")),
    };
    let mut header = format!("{{'descr': '{}', 'fortran_order': False, 'shape': {dims}, }}", T::DESCR);
    let unpadded = 10 + header.len() + 1;
    header.push_str(&" ".repeat(unpadded.next_multiple_of(64) - unpadded));
    header.push('\n');
    let mut out = Vec::with_capacity(10 + header.len() + size_of_val(values));
    out.extend_from_slice(b"\x93NUMPY\x01\x00");
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    if cfg!(target_endian = "little") {
        out.extend_from_slice(bytemuck::cast_slice(values));
    } else {
        for v in values {
            out.extend(bytemuck::bytes_of(v).iter().rev());
        }
    }
    out
}

/// A .npy file this module wrote, mapped: little-endian T, C order, `ndim` dimensions (the
/// second, if any, 2), its element count matching its shape (read flat).
fn read_npy<T: Elem>(path: &Path, ndim: usize) -> Result<Array<T>, DataError> {
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
    if !header.contains(&format!("'descr': '{}'", T::DESCR)) || !header.contains("'fortran_order': False") {
        return Err(bad(&format!("not a little-endian {}-byte unsigned array in C order", size_of::<T>())));
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
    let width = size_of::<T>();
    if data.len() != width * count {
        return Err(bad(&format!("{} bytes of data for {count} values", data.len())));
    }
    if cfg!(target_endian = "big") || bytemuck::try_cast_slice::<u8, T>(data).is_err() {
        // Values to decode, or data not aligned for T in the map: copied into memory.
        return Ok(data.chunks_exact(width).map(T::from_le).collect::<Vec<_>>().into());
    }
    Ok(Array(Repr::Mapped { map, start, len: count }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn indices_round_trip_and_corruption_is_named() {
        let dir = std::env::temp_dir().join(format!("ferrotron-index-cache-{}", std::process::id()));
        let entry = CacheEntry::new(&dir, "GPTDataset", "train", "a description".into());
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
        assert_ne!(CacheEntry::new(&dir, "GPTDataset", "train", "other".into()).base, entry.base);
        // A truncated index is an error that names the file, not a silent rebuild.
        let f = entry.path_of("sample_index.npy");
        let bytes = fs::read(&f).unwrap();
        fs::write(&f, &bytes[..bytes.len() - 3]).unwrap();
        let e = entry.load().err().expect("a truncated file is refused").to_string();
        assert!(e.contains("sample_index.npy") && e.contains("delete"), "{e}");
        // A blend's picks: 2-byte part numbers (an odd count, so the sample numbers' file pads
        // differently), mapped back.
        let blend = CacheEntry::new(&dir, "BlendedDataset", "train", "a blend".into());
        assert!(blend.load_blend().unwrap().is_none());
        let picks = BlendPicks { part: vec![1u16, 0, 1].into(), sample: vec![0u32, 0, 1].into() };
        blend.save_blend(&picks).unwrap();
        let back = blend.load_blend().unwrap().unwrap();
        assert_eq!((&back.part[..], &back.sample[..]), (&picks.part[..], &picks.sample[..]));
        assert!(back.part.is_mapped() && back.sample.is_mapped());
        // A part-number file read as sample numbers is refused by its element type.
        let swapped = blend.path_of("dataset_sample_index.npy");
        fs::copy(blend.path_of("dataset_index.npy"), &swapped).unwrap();
        let e = blend.load_blend().err().expect("a 2-byte file is not sample numbers").to_string();
        assert!(e.contains("dataset_sample_index.npy") && e.contains("4-byte"), "{e}");
        fs::remove_dir_all(&dir).unwrap();
    }
}
