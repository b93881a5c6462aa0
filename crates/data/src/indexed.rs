//! Megatron's indexed dataset: PREFIX.bin holds every document's tokens back to back, PREFIX.idx
//! says where each sequence starts. Both are memory-mapped and read in place, so a dataset of
//! any size opens in the time it takes to check its index.
//!
//! The .idx layout (little-endian), as Megatron-Core's `IndexedDataset` writes it:
//!
//! ```text
//! 9 bytes   "MMIDIDX\0\0"
//! u64       version: 1
//! u8        token dtype code: 1 u8, 2 i8, 3 i16, 4 i32, 5 i64, 6 f64, 7 f32, 8 u16
//! u64       S: sequences
//! u64       D: entries of the document index (documents + 1)
//! i32 × S   tokens in each sequence
//! i64 × S   byte offset of each sequence in the .bin
//! i64 × D   document boundaries, in sequences: 0, …, S
//! [i8 × S]  each sequence's mode (multimodal datasets only; not read here)
//! ```
//!
//! Architecture Invariant: a dataset that opens is contiguous (sequence i starts where i − 1 ends,
//! the last ends at the .bin's end) and its document index runs 0 ≤ … ≤ S, so a range of
//! documents is one range of tokens. Anything else is refused at `open` with the file named.

use crate::DataError;
use memmap2::Mmap;
use std::fs::File;
use std::io::Write;
use std::ops::Range;
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 9] = b"MMIDIDX\x00\x00";
const HEADER: usize = 9 + 8 + 1 + 8 + 8;

/// The token types Megatron's preprocessing writes (u16 below 65,500 ids, i32 above) and the other
/// integer codes of its format. The float codes are refused: they cannot hold token ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenDtype {
    U8,
    I8,
    I16,
    I32,
    I64,
    U16,
}

impl TokenDtype {
    fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            1 => Self::U8,
            2 => Self::I8,
            3 => Self::I16,
            4 => Self::I32,
            5 => Self::I64,
            8 => Self::U16,
            _ => return None,
        })
    }

    pub fn code(self) -> u8 {
        match self {
            Self::U8 => 1,
            Self::I8 => 2,
            Self::I16 => 3,
            Self::I32 => 4,
            Self::I64 => 5,
            Self::U16 => 8,
        }
    }

    pub fn size(self) -> usize {
        match self {
            Self::U8 | Self::I8 => 1,
            Self::I16 | Self::U16 => 2,
            Self::I32 => 4,
            Self::I64 => 8,
        }
    }

    /// The type Megatron's preprocessing picks for a vocabulary of `vocab` ids.
    pub fn for_vocab(vocab: usize) -> Self {
        if vocab < 65_500 { Self::U16 } else { Self::I32 }
    }

    /// The token at the start of `b` (at least `size()` bytes); None if negative or past u32.
    fn read(self, b: &[u8]) -> Option<u32> {
        let v: i64 = match self {
            Self::U8 => b[0] as i64,
            Self::I8 => b[0] as i8 as i64,
            Self::I16 => i16::from_le_bytes([b[0], b[1]]) as i64,
            Self::U16 => u16::from_le_bytes([b[0], b[1]]) as i64,
            Self::I32 => i32::from_le_bytes(b[..4].try_into().unwrap_or_default()) as i64,
            Self::I64 => i64::from_le_bytes(b[..8].try_into().unwrap_or_default()),
        };
        u32::try_from(v).ok()
    }

    fn write(self, t: u32, out: &mut Vec<u8>) -> Option<()> {
        match self {
            Self::U8 => out.push(u8::try_from(t).ok()?),
            Self::I8 => out.push(i8::try_from(t).ok()? as u8),
            Self::I16 => out.extend(i16::try_from(t).ok()?.to_le_bytes()),
            Self::U16 => out.extend(u16::try_from(t).ok()?.to_le_bytes()),
            Self::I32 => out.extend(i32::try_from(t).ok()?.to_le_bytes()),
            Self::I64 => out.extend((t as i64).to_le_bytes()),
        }
        Some(())
    }
}

/// An opened PREFIX.bin / PREFIX.idx pair.
pub struct IndexedDataset {
    prefix: PathBuf,
    idx: Mmap,
    bin: Mmap,
    dtype: TokenDtype,
    sequences: usize,
    doc_entries: usize,
    /// The index ends with one mode byte per sequence (Megatron's multimodal form).
    multimodal: bool,
}

fn map(path: &Path) -> Result<Mmap, DataError> {
    let io = |e: std::io::Error| DataError::Io { path: path.to_path_buf(), source: e };
    let f = File::open(path).map_err(io)?;
    // Safety: the map is read only; a file changed underneath a run is outside what any reader
    // can guard against (Megatron maps it the same way).
    unsafe { Mmap::map(&f) }.map_err(io)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap_or_default())
}

fn i64_at(b: &[u8], at: usize) -> i64 {
    i64::from_le_bytes(b[at..at + 8].try_into().unwrap_or_default())
}

impl IndexedDataset {
    /// Opens PREFIX.idx and PREFIX.bin (the prefix as Megatron's `--data-path` takes it, without
    /// an extension) and checks the index against the data.
    pub fn open(prefix: impl AsRef<Path>) -> Result<Self, DataError> {
        let prefix = prefix.as_ref().to_path_buf();
        let (idx_path, bin_path) = (with_ext(&prefix, ".idx"), with_ext(&prefix, ".bin"));
        let idx = map(&idx_path)?;
        let bin = map(&bin_path)?;
        let bad = |what: String| DataError::BadFile { path: idx_path.clone(), what };
        if idx.len() < HEADER || &idx[..9] != MAGIC {
            return Err(bad("it does not start with Megatron's MMIDIDX header".into()));
        }
        let version = u64_at(&idx, 9);
        if version != 1 {
            return Err(bad(format!("index version {version}; only version 1 is read")));
        }
        let code = idx[17];
        let dtype = TokenDtype::from_code(code)
            .ok_or_else(|| bad(format!("token dtype code {code} is not an integer type (1–5 or 8)")))?;
        let (s, d) = (u64_at(&idx, 18), u64_at(&idx, 26));
        let need = (s as u128) * 12 + (d as u128) * 8 + HEADER as u128;
        // The multimodal form appends one mode byte per sequence.
        if idx.len() as u128 != need && idx.len() as u128 != need + s as u128 {
            return Err(bad(format!(
                "{s} sequences and {d} document entries need {need} bytes, the file has {}: it is truncated or not an index",
                idx.len()
            )));
        }
        let multimodal = idx.len() as u128 == need + s as u128;
        let ds = IndexedDataset { prefix, idx, bin, dtype, sequences: s as usize, doc_entries: d as usize, multimodal };
        ds.check(&idx_path, &bin_path)?;
        Ok(ds)
    }

    fn check(&self, idx_path: &Path, bin_path: &Path) -> Result<(), DataError> {
        let bad = |what: String| DataError::BadFile { path: idx_path.to_path_buf(), what };
        let size = self.dtype.size() as u64;
        let mut at = 0u64;
        for i in 0..self.sequences {
            let len = self.len_raw(i);
            if len < 0 {
                return Err(bad(format!("sequence {i} has a negative length {len}")));
            }
            let ptr = i64_at(&self.idx, HEADER + 4 * self.sequences + 8 * i);
            if ptr as u64 != at {
                let want = if i == 0 { "0".to_string() } else { format!("{at}, where sequence {} ends", i - 1) };
                return Err(bad(format!(
                    "sequence {i} starts at byte {ptr} of the .bin, not {want}: the index is corrupt or the sequences are not back to back; preprocess the data again"
                )));
            }
            at += len as u64 * size;
        }
        if at != self.bin.len() as u64 {
            return Err(DataError::BadFile {
                path: bin_path.to_path_buf(),
                what: format!(
                    "the index's sequences end at byte {at}, the file has {} bytes: the .bin and .idx are not one pair (or one was cut short); preprocess the data again",
                    self.bin.len()
                ),
            });
        }
        if self.doc_entries == 0 || self.doc_at(0) != 0 || self.doc_at(self.doc_entries - 1) != self.sequences as i64 {
            return Err(bad(format!("the document index must run from 0 to the {} sequences", self.sequences)));
        }
        for k in 1..self.doc_entries {
            if self.doc_at(k) < self.doc_at(k - 1) {
                return Err(bad(format!("document {} ends before it starts", k - 1)));
            }
        }
        Ok(())
    }

    fn len_raw(&self, i: usize) -> i32 {
        i32::from_le_bytes(self.idx[HEADER + 4 * i..HEADER + 4 * i + 4].try_into().unwrap_or_default())
    }

    fn doc_at(&self, k: usize) -> i64 {
        i64_at(&self.idx, HEADER + 12 * self.sequences + 8 * k)
    }

    pub fn prefix(&self) -> &Path {
        &self.prefix
    }

    pub fn dtype(&self) -> TokenDtype {
        self.dtype
    }

    pub fn num_sequences(&self) -> usize {
        self.sequences
    }

    pub fn num_documents(&self) -> usize {
        self.doc_entries - 1
    }

    pub fn num_tokens(&self) -> u64 {
        self.bin.len() as u64 / self.dtype.size() as u64
    }

    /// Tokens in sequence `i` (below `num_sequences`; `open` checked every length).
    pub fn sequence_length(&self, i: usize) -> u64 {
        self.len_raw(i).max(0) as u64
    }

    /// Where sequence `i` starts, as a token position in the .bin.
    pub fn sequence_start(&self, i: usize) -> u64 {
        i64_at(&self.idx, HEADER + 4 * self.sequences + 8 * i).max(0) as u64 / self.dtype.size() as u64
    }

    /// The tokens (as positions in the .bin) of documents `docs`.
    pub fn document_tokens(&self, docs: Range<usize>) -> Range<u64> {
        let tok = |s: usize| -> u64 {
            if s == self.sequences {
                self.num_tokens()
            } else {
                i64_at(&self.idx, HEADER + 4 * self.sequences + 8 * s) as u64 / self.dtype.size() as u64
            }
        };
        let (a, b) = (docs.start.min(self.num_documents()), docs.end.min(self.num_documents()));
        tok(self.doc_at(a) as usize)..tok(self.doc_at(b) as usize)
    }

    /// Tokens `at .. at + out.len()` of the .bin into `out`.
    pub fn read(&self, at: u64, out: &mut [u32]) -> Result<(), DataError> {
        let size = self.dtype.size();
        let start = at as usize * size;
        let bytes = self.bin.get(start..start + out.len() * size).ok_or_else(|| DataError::BadFile {
            path: self.prefix.clone(),
            what: format!("tokens {at}..{} are past the data's {} tokens", at as usize + out.len(), self.num_tokens()),
        })?;
        for (k, (o, b)) in out.iter_mut().zip(bytes.chunks_exact(size)).enumerate() {
            *o = self.dtype.read(b).ok_or_else(|| DataError::BadFile {
                path: self.prefix.clone(),
                what: format!("token {} of the .bin is negative or past u32", at as usize + k),
            })?;
        }
        Ok(())
    }
}

/// PREFIX + ext as a path (the prefix may contain dots of its own).
fn with_ext(prefix: &Path, ext: &str) -> PathBuf {
    let mut p = prefix.to_path_buf().into_os_string();
    p.push(ext);
    PathBuf::from(p)
}

/// Writes an indexed dataset one document at a time (one sequence each, as Megatron's GPT
/// preprocessing does, or several: `add_sequences`), or whole datasets after one another
/// (`add_dataset`, Megatron's tools/merge_datasets.py): the tokens stream into PREFIX.bin.tmp,
/// the lengths and document boundaries stay in memory (12 bytes a sequence), and `finish` writes
/// the index and only then renames both into place, so a failed or interrupted run leaves no
/// pair that looks complete (a builder dropped unfinished removes its temporary file).
pub struct IndexedBuilder {
    prefix: PathBuf,
    dtype: TokenDtype,
    bin: std::io::BufWriter<File>,
    lengths: Vec<i32>,
    /// Document boundaries in sequences: 0, then each document's end.
    docs: Vec<i64>,
    buf: Vec<u8>,
    done: bool,
}

impl Drop for IndexedBuilder {
    fn drop(&mut self) {
        if !self.done {
            let _ = std::fs::remove_file(with_ext(&self.prefix, ".bin.tmp"));
        }
    }
}

impl IndexedBuilder {
    pub fn create(prefix: impl AsRef<Path>, dtype: TokenDtype) -> Result<Self, DataError> {
        let prefix = prefix.as_ref().to_path_buf();
        let tmp = with_ext(&prefix, ".bin.tmp");
        let f = File::create(&tmp).map_err(|e| DataError::Io { path: tmp, source: e })?;
        Ok(IndexedBuilder {
            prefix,
            dtype,
            bin: std::io::BufWriter::new(f),
            lengths: Vec::new(),
            docs: vec![0],
            buf: Vec::new(),
            done: false,
        })
    }

    /// One document of one sequence.
    pub fn add_document(&mut self, tokens: &[u32]) -> Result<(), DataError> {
        self.add_sequences(&[tokens])
    }

    /// One document of these sequences (Megatron's sentence-split documents).
    pub fn add_sequences(&mut self, sequences: &[&[u32]]) -> Result<(), DataError> {
        let mut lens = Vec::with_capacity(sequences.len());
        self.buf.clear();
        for tokens in sequences {
            lens.push(i32::try_from(tokens.len()).map_err(|_| DataError::TooLong { tokens: tokens.len() })?);
            for &t in *tokens {
                self.dtype.write(t, &mut self.buf).ok_or(DataError::TokenDoesNotFit { id: t, dtype: self.dtype })?;
            }
        }
        let tmp = with_ext(&self.prefix, ".bin.tmp");
        self.bin.write_all(&self.buf).map_err(|e| DataError::Io { path: tmp, source: e })?;
        self.lengths.extend(lens);
        self.docs.push(self.lengths.len() as i64);
        Ok(())
    }

    /// Every document of `ds` after those added so far, its tokens copied as they are (Megatron's
    /// `add_index`): its token type must be this builder's, and a multimodal index (mode bytes)
    /// is refused, as its modes would be lost.
    pub fn add_dataset(&mut self, ds: &IndexedDataset) -> Result<(), DataError> {
        let bad = |what: String| DataError::BadFile { path: with_ext(&ds.prefix, ".idx"), what };
        if ds.dtype != self.dtype {
            return Err(bad(format!(
                "its tokens are {:?}, the merged dataset's {:?} (from the first input): preprocess them with one tokenizer",
                ds.dtype, self.dtype
            )));
        }
        if ds.multimodal {
            return Err(bad("a multimodal index (a mode byte per sequence): merging those is not built".into()));
        }
        let tmp = with_ext(&self.prefix, ".bin.tmp");
        self.bin.write_all(&ds.bin).map_err(|e| DataError::Io { path: tmp, source: e })?;
        let offset = self.lengths.len() as i64;
        self.lengths.extend((0..ds.sequences).map(|i| ds.len_raw(i)));
        self.docs.extend((1..ds.doc_entries).map(|k| offset + ds.doc_at(k)));
        Ok(())
    }

    pub fn num_documents(&self) -> usize {
        self.docs.len() - 1
    }

    /// Writes PREFIX.idx and moves PREFIX.bin into place.
    pub fn finish(mut self) -> Result<(), DataError> {
        let (tmp, bin, idx_tmp, idx_path) = (
            with_ext(&self.prefix, ".bin.tmp"),
            with_ext(&self.prefix, ".bin"),
            with_ext(&self.prefix, ".idx.tmp"),
            with_ext(&self.prefix, ".idx"),
        );
        self.bin.flush().map_err(|e| DataError::Io { path: tmp.clone(), source: e })?;
        let n = self.lengths.len();
        let mut idx = Vec::with_capacity(HEADER + n * 12 + self.docs.len() * 8);
        idx.extend_from_slice(MAGIC);
        idx.extend(1u64.to_le_bytes());
        idx.push(self.dtype.code());
        idx.extend((n as u64).to_le_bytes());
        idx.extend((self.docs.len() as u64).to_le_bytes());
        for l in &self.lengths {
            idx.extend(l.to_le_bytes());
        }
        let mut at = 0i64;
        for l in &self.lengths {
            idx.extend(at.to_le_bytes());
            at += *l as i64 * self.dtype.size() as i64;
        }
        for k in &self.docs {
            idx.extend(k.to_le_bytes());
        }
        File::create(&idx_tmp)
            .and_then(|mut f| f.write_all(&idx))
            .map_err(|e| DataError::Io { path: idx_tmp.clone(), source: e })?;
        std::fs::rename(&tmp, &bin).map_err(|e| DataError::Io { path: bin, source: e })?;
        self.done = true;
        std::fs::rename(&idx_tmp, &idx_path).map_err(|e| DataError::Io { path: idx_path, source: e })
    }
}

/// Writes PREFIX.bin and PREFIX.idx from documents of tokens (`IndexedBuilder` over them).
pub fn write_indexed(prefix: impl AsRef<Path>, docs: &[Vec<u32>], dtype: TokenDtype) -> Result<(), DataError> {
    let mut b = IndexedBuilder::create(prefix, dtype)?;
    for d in docs {
        b.add_document(d)?;
    }
    b.finish()
}
