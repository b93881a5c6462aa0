//! Megatron's TikTokenizer (`--tokenizer-type TikTokenizer`, its CustomTikTokenizer): NeMo's
//! tokenizer file (`--tokenizer-model FILE.json`, a list of {"rank", "token_bytes" in base64,
//! "token_str"}, ranks 0–255 the single bytes in order) run by tiktoken-rs's byte-pair encoder,
//! the text split first by one of Megatron's two patterns (`--tiktoken-pattern v1|v2`).
//!
//! Ids: the special tokens come first (`--tiktoken-num-special-tokens`, default 1000): the given
//! ones (`--tiktoken-special-tokens`, which must hold `<unk>`, `<s>` and `</s>`; those three by
//! default), then `<SPECIAL_i>` fillers up to the count; the file's ranks follow, shifted by the
//! count and cut so that the whole vocabulary is `--vocab-size` (default 2^17). `</s>` ends each
//! document. Text is encoded as plain text (a special token's spelling in it is not matched), and
//! decoding replaces invalid UTF-8, as Megatron's tokenize / detokenize do.

use crate::DataError;
use base64::Engine;
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

/// Megatron's `PATTERN_TIKTOKEN` (`v1`) and `PATTERN_TIKTOKEN_V2` (`v2`, which also splits
/// words at case changes and keeps `/` with the punctuation before it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TikPattern {
    V1,
    V2,
}

impl TikPattern {
    pub fn parse(s: &str) -> Result<Self, DataError> {
        match s {
            "v1" => Ok(TikPattern::V1),
            "v2" => Ok(TikPattern::V2),
            o => Err(DataError::Tokenizer(format!("--tiktoken-pattern {o}: use v1 or v2"))),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            TikPattern::V1 => "v1",
            TikPattern::V2 => "v2",
        }
    }

    fn regex(self) -> &'static str {
        match self {
            TikPattern::V1 => r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
            TikPattern::V2 => concat!(
                r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+",
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*",
                r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
            ),
        }
    }
}

/// The special tokens every TikTokenizer holds (Megatron's defaults).
pub const TIKTOKEN_REQUIRED: [&str; 3] = ["<unk>", "<s>", "</s>"];

/// A TikTokenizer's settings, as Megatron's flags give them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TikTokenSpec {
    /// `--tokenizer-model`: the JSON vocabulary file.
    pub path: PathBuf,
    pub pattern: TikPattern,
    /// The whole vocabulary, special tokens included (`--vocab-size`, default 2^17).
    pub vocab_size: usize,
    /// `--tiktoken-num-special-tokens` (default 1000).
    pub num_special_tokens: usize,
    /// `--tiktoken-special-tokens`, in id order (default `<unk> <s> </s>`).
    pub special_tokens: Vec<String>,
}

impl TikTokenSpec {
    pub const DEFAULT_VOCAB: usize = 1 << 17;
    pub const DEFAULT_SPECIAL: usize = 1000;

    /// Every special token in id order: the given ones, then the fillers. Checked as Megatron
    /// checks them.
    fn specials(&self) -> Result<Vec<String>, DataError> {
        let flag = |m: String| DataError::Tokenizer(m);
        let given: HashSet<&str> = self.special_tokens.iter().map(String::as_str).collect();
        if given.len() != self.special_tokens.len() {
            return Err(flag(format!("--tiktoken-special-tokens {:?}: each must be given once", self.special_tokens)));
        }
        if let Some(missing) = TIKTOKEN_REQUIRED.iter().find(|t| !given.contains(*t)) {
            return Err(flag(format!("--tiktoken-special-tokens must include {missing} (and <unk>, <s>, </s>)")));
        }
        let n = self.num_special_tokens;
        if self.special_tokens.len() > n || n >= self.vocab_size {
            return Err(flag(format!(
                "--tiktoken-num-special-tokens {n} must hold the {} special tokens given and stay below --vocab-size {}",
                self.special_tokens.len(),
                self.vocab_size
            )));
        }
        let mut all = self.special_tokens.clone();
        all.extend((all.len()..n).map(|i| format!("<SPECIAL_{i}>")));
        if all.iter().collect::<HashSet<_>>().len() != n {
            return Err(flag(format!(
                "--tiktoken-special-tokens {:?} repeat a <SPECIAL_i> filler's name",
                self.special_tokens
            )));
        }
        Ok(all)
    }
}

pub struct TikTokenizer {
    bpe: tiktoken_rs::CoreBPE,
    eod: u32,
    spec: TikTokenSpec,
}

/// One entry of NeMo's tokenizer file.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    rank: u64,
    token_bytes: String,
    #[allow(dead_code)]
    token_str: String,
}

/// The file's first `keep` byte sequences, by rank, checked as Megatron's `reload_mergeable_ranks`.
fn read_ranks(path: &Path, keep: usize) -> Result<Vec<Vec<u8>>, DataError> {
    let bad = |what: String| DataError::BadFile { path: path.to_path_buf(), what };
    let text = std::fs::read_to_string(path).map_err(|e| DataError::Io { path: path.to_path_buf(), source: e })?;
    let entries: Vec<Entry> = serde_json::from_str(&text).map_err(|e| {
        bad(format!("not a TikTokenizer vocabulary (a JSON list of {{\"rank\", \"token_bytes\", \"token_str\"}}): {e}"))
    })?;
    if entries.len() < keep {
        return Err(bad(format!(
            "holds {} tokens; the vocabulary asked for needs {keep} besides the special tokens: lower --vocab-size or raise --tiktoken-num-special-tokens",
            entries.len()
        )));
    }
    let mut seen = HashSet::new();
    entries[..keep]
        .iter()
        .enumerate()
        .map(|(i, e)| {
            if e.rank != i as u64 {
                return Err(bad(format!("entry {i} has rank {}: ranks must run 0, 1, 2, … in order", e.rank)));
            }
            let b = base64::engine::general_purpose::STANDARD
                .decode(&e.token_bytes)
                .map_err(|err| bad(format!("entry {i}'s token_bytes is not base64: {err}")))?;
            if i < 256 && b != [i as u8] {
                return Err(bad(format!("entry {i} must be the single byte {i} (ranks 0-255 are the bytes in order)")));
            }
            if !seen.insert(b.clone()) {
                return Err(bad(format!("entry {i} repeats an earlier token's bytes")));
            }
            Ok(b)
        })
        .collect()
}

impl TikTokenizer {
    pub fn open(spec: &TikTokenSpec) -> Result<TikTokenizer, DataError> {
        let specials = spec.specials()?;
        let n = specials.len();
        let ranks = read_ranks(&spec.path, spec.vocab_size - n)?;
        let rank = |i: usize| {
            u32::try_from(i)
                .map_err(|_| DataError::Tokenizer(format!("--vocab-size {} is above 2^32", spec.vocab_size)))
        };
        let encoder = ranks
            .into_iter()
            .enumerate()
            .map(|(i, b)| Ok((b, rank(i + n)?)))
            .collect::<Result<HashMap<_, _>, DataError>>()?;
        let special: HashMap<String, u32> =
            specials.iter().enumerate().map(|(i, s)| Ok((s.clone(), rank(i)?))).collect::<Result<_, DataError>>()?;
        let eod = special["</s>"];
        let bpe = tiktoken_rs::CoreBPE::new(
            encoder.into_iter().collect(),
            special.into_iter().collect(),
            spec.pattern.regex(),
        )
        .map_err(|e| DataError::Tokenizer(format!("TikTokenizer {}: {e}", spec.path.display())))?;
        Ok(TikTokenizer { bpe, eod, spec: spec.clone() })
    }

    pub fn spec(&self) -> &TikTokenSpec {
        &self.spec
    }

    pub fn vocab_size(&self) -> usize {
        self.spec.vocab_size
    }

    /// `</s>`.
    pub fn eod(&self) -> u32 {
        self.eod
    }

    pub fn encode(&self, text: &str) -> Vec<u32> {
        self.bpe.encode_ordinary(text)
    }

    /// Ids below the vocabulary (the caller checks); invalid UTF-8 replaced.
    pub fn decode(&self, ids: &[u32]) -> Result<String, DataError> {
        let bytes = self.bpe.decode_bytes(ids).map_err(|e| DataError::Tokenizer(e.to_string()))?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }
}
