//! Tokenizers: byte-level (vocab 256, end-of-document = byte 0, which text never contains),
//! GPT-2 BPE through tiktoken-rs (r50k_base, end-of-document = `<|endoftext|>` 50256), and
//! Megatron's NullTokenizer for data tokenized elsewhere (`--vocab-size N`: text is the ids written
//! out, the vocabulary N + 1 with end-of-document N), Megatron's HuggingFaceTokenizer
//! (`--tokenizer-model FOLDER`: a transformers tokenizer.json, `hf_tokenizer.rs`) and its
//! TikTokenizer (`--tokenizer-model FILE.json` with `--tiktoken-pattern`, `tiktoken.rs`), and its
//! two SentencePiece tokenizers (`--tokenizer-model FILE.model`, `sentencepiece/`):
//! Llama2Tokenizer (BOS before each text, as Megatron's `tokenize` adds it) and
//! GPTSentencePieceTokenizer (the pieces alone); both end documents with the model's EOS.

use crate::DataError;
use crate::hf_tokenizer::HfTokenizer;
use crate::sentencepiece::SentencePiece;
use crate::tiktoken::{TIKTOKEN_REQUIRED, TikPattern, TikTokenSpec, TikTokenizer};
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TokenizerKind {
    Byte,
    Gpt2,
    /// Ids below this, plus end-of-document = this.
    Null(u32),
    /// A transformers tokenizer folder (or its tokenizer.json).
    HuggingFace(PathBuf),
    /// NeMo's tokenizer file through tiktoken (Megatron's TikTokenizer).
    TikToken(TikTokenSpec),
    /// A SentencePiece .model file: Megatron's Llama2Tokenizer (`bos`: a BOS before each text)
    /// or GPTSentencePieceTokenizer.
    SentencePiece {
        path: PathBuf,
        bos: bool,
    },
}

/// The tokenizer flags besides `--tokenizer-type`, as Megatron names them.
#[derive(Clone, Copy, Debug, Default)]
pub struct TokenizerFlags<'a> {
    /// `--vocab-size`: NullTokenizer's ids, TikTokenizer's whole vocabulary.
    pub vocab_size: Option<usize>,
    /// `--tokenizer-model`: HuggingFaceTokenizer's folder, TikTokenizer's JSON file.
    pub model: Option<&'a Path>,
    pub tiktoken_pattern: Option<&'a str>,
    pub tiktoken_num_special_tokens: Option<usize>,
    pub tiktoken_special_tokens: Option<&'a [String]>,
}

impl TokenizerFlags<'_> {
    /// These flags without the ones `tokenizer` does not read but Megatron passes over in
    /// silence (its scripts give them so: `--tiktoken-pattern` with NullTokenizer, `--vocab-size`
    /// with HuggingFaceTokenizer), and those flags' names; `from_flags` refuses them, so a caller
    /// that follows Megatron takes the kept flags and says what it dropped.
    pub fn without_megatron_ignored(self, tokenizer: &str) -> (Self, Vec<&'static str>) {
        let (mut kept, mut dropped) = (self, vec![]);
        if tokenizer != "TikTokenizer" {
            for (flag, given) in [
                ("--tiktoken-pattern", self.tiktoken_pattern.is_some()),
                ("--tiktoken-num-special-tokens", self.tiktoken_num_special_tokens.is_some()),
                ("--tiktoken-special-tokens", self.tiktoken_special_tokens.is_some()),
            ] {
                if given {
                    dropped.push(flag);
                }
            }
            (kept.tiktoken_pattern, kept.tiktoken_num_special_tokens, kept.tiktoken_special_tokens) =
                (None, None, None);
        }
        let from_file = ["HuggingFaceTokenizer", "Llama2Tokenizer", "GPTSentencePieceTokenizer"];
        if from_file.contains(&tokenizer) && self.vocab_size.is_some() {
            dropped.push("--vocab-size (the vocabulary is the file's)");
            kept.vocab_size = None;
        }
        (kept, dropped)
    }
}

impl TokenizerKind {
    pub fn parse(s: &str) -> Result<Self, DataError> {
        Self::parse_with(s, None, None)
    }

    /// `--tokenizer-type` with `--vocab-size`, which NullTokenizer needs and the others refuse
    /// (their vocabularies are fixed), and `--tokenizer-model`, which HuggingFaceTokenizer needs.
    pub fn parse_with(s: &str, vocab_size: Option<usize>, model: Option<&Path>) -> Result<Self, DataError> {
        Self::from_flags(s, &TokenizerFlags { vocab_size, model, ..TokenizerFlags::default() })
    }

    /// `--tokenizer-type` with the other tokenizer flags: each belongs to the tokenizers that read
    /// it, and is refused with any other.
    pub fn from_flags(s: &str, f: &TokenizerFlags) -> Result<Self, DataError> {
        let tik = s == "TikTokenizer";
        let spm = matches!(s, "Llama2Tokenizer" | "GPTSentencePieceTokenizer");
        if let (Some(m), false) = (f.model, s == "HuggingFaceTokenizer" || tik || spm) {
            return Err(DataError::ModelFileOnly { tokenizer: s.into(), model: m.to_path_buf() });
        }
        let tik_flags = [
            ("--tiktoken-pattern", f.tiktoken_pattern.is_some()),
            ("--tiktoken-num-special-tokens", f.tiktoken_num_special_tokens.is_some()),
            ("--tiktoken-special-tokens", f.tiktoken_special_tokens.is_some()),
        ];
        if let (Some((flag, _)), false) = (tik_flags.iter().find(|(_, given)| *given), tik) {
            return Err(DataError::Tokenizer(format!("{flag} belongs to TikTokenizer, not the {s} tokenizer")));
        }
        if tik {
            let path = f.model.ok_or_else(|| {
                DataError::Tokenizer("TikTokenizer needs --tokenizer-model FILE.json (NeMo's tokenizer file)".into())
            })?;
            let pattern = f.tiktoken_pattern.ok_or_else(|| {
                DataError::Tokenizer(
                    "TikTokenizer needs --tiktoken-pattern v1 or v2 (the one the file was made with)".into(),
                )
            })?;
            return Ok(TokenizerKind::TikToken(TikTokenSpec {
                path: path.to_path_buf(),
                pattern: TikPattern::parse(pattern)?,
                vocab_size: f.vocab_size.unwrap_or(TikTokenSpec::DEFAULT_VOCAB),
                num_special_tokens: f.tiktoken_num_special_tokens.unwrap_or(TikTokenSpec::DEFAULT_SPECIAL),
                special_tokens: f
                    .tiktoken_special_tokens
                    .map_or_else(|| TIKTOKEN_REQUIRED.iter().map(|t| t.to_string()).collect(), <[String]>::to_vec),
            }));
        }
        let (vocab_size, model) = (f.vocab_size, f.model);
        let kind = match s {
            "byte" => TokenizerKind::Byte,
            "gpt2" | "GPT2BPETokenizer" => TokenizerKind::Gpt2,
            "HuggingFaceTokenizer" => TokenizerKind::HuggingFace(model.ok_or(DataError::HfModel)?.to_path_buf()),
            "Llama2Tokenizer" | "GPTSentencePieceTokenizer" => TokenizerKind::SentencePiece {
                path: model
                    .ok_or_else(|| {
                        DataError::Tokenizer(format!("{s} needs --tokenizer-model FILE.model (a SentencePiece model)"))
                    })?
                    .to_path_buf(),
                bos: s == "Llama2Tokenizer",
            },
            "NullTokenizer" => {
                let n = vocab_size.ok_or(DataError::NullVocab)?;
                return u32::try_from(n)
                    .ok()
                    .filter(|&n| n > 0 && n < u32::MAX)
                    .map(TokenizerKind::Null)
                    .ok_or(DataError::NullVocab);
            }
            _ => return Err(DataError::UnknownTokenizer(s.into())),
        };
        match vocab_size {
            Some(n) => Err(DataError::FixedVocab { tokenizer: kind.as_str(), given: n }),
            None => Ok(kind),
        }
    }

    pub fn as_str(&self) -> &'static str {
        match self {
            TokenizerKind::Byte => "byte",
            TokenizerKind::Gpt2 => "gpt2",
            TokenizerKind::Null(_) => "NullTokenizer",
            TokenizerKind::HuggingFace(_) => "HuggingFaceTokenizer",
            TokenizerKind::TikToken(_) => "TikTokenizer",
            TokenizerKind::SentencePiece { bos: true, .. } => "Llama2Tokenizer",
            TokenizerKind::SentencePiece { bos: false, .. } => "GPTSentencePieceTokenizer",
        }
    }
}

#[derive(Clone)]
pub enum Tokenizer {
    Byte,
    Gpt2(Arc<tiktoken_rs::CoreBPE>),
    Null(u32),
    HuggingFace(Arc<HfTokenizer>, PathBuf),
    TikToken(Arc<TikTokenizer>),
    SentencePiece { model: Arc<SentencePiece>, path: PathBuf, bos: bool },
}

impl Tokenizer {
    pub fn new(kind: TokenizerKind) -> Result<Self, DataError> {
        Ok(match kind {
            TokenizerKind::Byte => Tokenizer::Byte,
            TokenizerKind::Gpt2 => {
                Tokenizer::Gpt2(Arc::new(tiktoken_rs::r50k_base().map_err(|e| DataError::Tokenizer(e.to_string()))?))
            }
            TokenizerKind::Null(n) => Tokenizer::Null(n),
            TokenizerKind::HuggingFace(p) => Tokenizer::HuggingFace(Arc::new(HfTokenizer::open(&p)?), p),
            TokenizerKind::TikToken(spec) => Tokenizer::TikToken(Arc::new(TikTokenizer::open(&spec)?)),
            TokenizerKind::SentencePiece { path, bos } => {
                let model = SentencePiece::open(&path)?;
                let name = if bos { "Llama2Tokenizer" } else { "GPTSentencePieceTokenizer" };
                let missing = |what: &str| {
                    DataError::Tokenizer(format!(
                        "{name} --tokenizer-model {}: the model has no {what} piece, which the end of a document (and Llama2Tokenizer's start) needs",
                        path.display()
                    ))
                };
                model.eos().ok_or_else(|| missing("EOS"))?;
                if bos {
                    model.bos().ok_or_else(|| missing("BOS"))?;
                }
                Tokenizer::SentencePiece { model: Arc::new(model), path, bos }
            }
        })
    }

    pub fn kind(&self) -> TokenizerKind {
        match self {
            Tokenizer::Byte => TokenizerKind::Byte,
            Tokenizer::Gpt2(_) => TokenizerKind::Gpt2,
            Tokenizer::Null(n) => TokenizerKind::Null(*n),
            Tokenizer::HuggingFace(_, p) => TokenizerKind::HuggingFace(p.clone()),
            Tokenizer::TikToken(t) => TokenizerKind::TikToken(t.spec().clone()),
            Tokenizer::SentencePiece { path, bos, .. } => {
                TokenizerKind::SentencePiece { path: path.clone(), bos: *bos }
            }
        }
    }

    /// Vocabulary size before padding.
    pub fn vocab_size(&self) -> usize {
        match self {
            Tokenizer::Byte => 256,
            Tokenizer::Gpt2(_) => 50257,
            Tokenizer::Null(n) => *n as usize + 1,
            Tokenizer::HuggingFace(t, _) => t.vocab_size(),
            Tokenizer::TikToken(t) => t.vocab_size(),
            Tokenizer::SentencePiece { model, .. } => model.vocab_size(),
        }
    }

    pub fn eod(&self) -> u32 {
        match self {
            Tokenizer::Byte => 0,
            Tokenizer::Gpt2(_) => 50256,
            Tokenizer::Null(n) => *n,
            Tokenizer::HuggingFace(t, _) => t.eod(),
            Tokenizer::TikToken(t) => t.eod(),
            // Checked present in `new`.
            Tokenizer::SentencePiece { model, .. } => model.eos().unwrap_or_default(),
        }
    }

    /// The ids of `text`. NullTokenizer reads them written out, separated by white space; a word
    /// that is not an id below the vocabulary is an error.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, DataError> {
        Ok(match self {
            Tokenizer::Byte => text.bytes().map(u32::from).collect(),
            Tokenizer::Gpt2(b) => b.encode_ordinary(text).into_iter().collect(),
            Tokenizer::Null(_) => {
                let vocab = self.vocab_size();
                text.split_whitespace()
                    .map(|w| match w.parse::<u32>() {
                        Ok(id) if (id as usize) < vocab => Ok(id),
                        Ok(id) => Err(DataError::TokenOutOfRange { id, vocab }),
                        Err(_) => Err(DataError::NotAnId(w.chars().take(40).collect())),
                    })
                    .collect::<Result<_, _>>()?
            }
            Tokenizer::HuggingFace(t, _) => t.encode(text)?,
            Tokenizer::TikToken(t) => t.encode(text),
            Tokenizer::SentencePiece { model, bos, .. } => {
                let ids = model.encode(text);
                match model.bos().filter(|_| *bos) {
                    Some(b) => std::iter::once(b).chain(ids).collect(),
                    None => ids,
                }
            }
        })
    }

    /// Megatron's `--vocab-file` / `--merge-file` for GPT2BPETokenizer, checked to be GPT-2's (the
    /// built-in tokenizer's); with any other tokenizer they are refused.
    pub fn check_gpt2_files(
        &self,
        vocab: Option<&std::path::Path>,
        merges: Option<&std::path::Path>,
    ) -> Result<(), DataError> {
        match self {
            Tokenizer::Gpt2(bpe) => {
                if let Some(v) = vocab {
                    crate::gpt2_files::check_vocab_file(v, bpe)?;
                }
                if let Some(m) = merges {
                    crate::gpt2_files::check_merge_file(m)?;
                }
                Ok(())
            }
            _ if vocab.is_none() && merges.is_none() => Ok(()),
            _ => Err(DataError::Gpt2FilesOnly(self.kind().as_str())),
        }
    }

    /// Text of `ids`; ids past the vocabulary (padding rows of the output layer) are an error.
    pub fn decode(&self, ids: &[u32]) -> Result<String, DataError> {
        let vocab = self.vocab_size();
        if let Some(&id) = ids.iter().find(|&&i| i as usize >= vocab) {
            return Err(DataError::TokenOutOfRange { id, vocab });
        }
        match self {
            Tokenizer::Byte => {
                Ok(String::from_utf8_lossy(&ids.iter().map(|&i| i as u8).collect::<Vec<_>>()).into_owned())
            }
            Tokenizer::Gpt2(b) => b.decode(ids).map_err(|e| DataError::Tokenizer(e.to_string())),
            Tokenizer::Null(_) => Ok(ids.iter().map(u32::to_string).collect::<Vec<_>>().join(" ")),
            Tokenizer::HuggingFace(t, _) => t.decode(ids),
            Tokenizer::TikToken(t) => t.decode(ids),
            Tokenizer::SentencePiece { model, .. } => model.decode(ids),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Megatron passes over the tiktoken flags outside TikTokenizer and --vocab-size where the
    /// vocabulary comes from a file; the rest stays for `from_flags` to check.
    #[test]
    fn flags_megatron_ignores_are_dropped_and_named() {
        let special = ["<s>".to_string()];
        let f = TokenizerFlags {
            vocab_size: Some(1000),
            model: Some(Path::new("m")),
            tiktoken_pattern: Some("v2"),
            tiktoken_num_special_tokens: Some(10),
            tiktoken_special_tokens: Some(&special),
        };
        let (kept, dropped) = f.without_megatron_ignored("NullTokenizer");
        assert_eq!(dropped, ["--tiktoken-pattern", "--tiktoken-num-special-tokens", "--tiktoken-special-tokens"]);
        assert_eq!((kept.vocab_size, kept.tiktoken_pattern, kept.model), (Some(1000), None, Some(Path::new("m"))));
        let (kept, dropped) = f.without_megatron_ignored("TikTokenizer");
        assert!(dropped.is_empty() && kept.tiktoken_pattern == Some("v2") && kept.vocab_size == Some(1000));
        for t in ["HuggingFaceTokenizer", "Llama2Tokenizer", "GPTSentencePieceTokenizer"] {
            let (kept, dropped) = f.without_megatron_ignored(t);
            assert_eq!((dropped.len(), kept.vocab_size), (4, None), "{t}");
        }
        let (kept, _) = f.without_megatron_ignored("gpt2");
        assert_eq!(kept.vocab_size, Some(1000), "a fixed vocabulary's --vocab-size is still refused");
    }

    #[test]
    fn byte_and_gpt2_round_trip() {
        let text = "Once upon a time, Mia the owl found 12 + 7 = 19.";
        for kind in [TokenizerKind::Byte, TokenizerKind::Gpt2] {
            let t = Tokenizer::new(kind.clone()).unwrap();
            let ids = t.encode(text).unwrap();
            assert_eq!(t.decode(&ids).unwrap(), text, "{kind:?}");
            assert!(ids.iter().all(|&i| (i as usize) < t.vocab_size()));
        }
        let g = Tokenizer::new(TokenizerKind::Gpt2).unwrap();
        // "Hello world" is two GPT-2 tokens: 15496, 995.
        assert_eq!(g.encode("Hello world").unwrap(), vec![15496, 995]);
        assert!(matches!(g.decode(&[50300]), Err(DataError::TokenOutOfRange { id: 50300, .. })));
    }

    #[test]
    fn null_tokenizer_reads_ids_and_needs_its_vocabulary() {
        let k = TokenizerKind::parse_with("NullTokenizer", Some(1000), None).unwrap();
        let t = Tokenizer::new(k).unwrap();
        assert_eq!((t.vocab_size(), t.eod(), t.kind().as_str()), (1001, 1000, "NullTokenizer"));
        assert_eq!(t.encode(" 5 999\n1000 0 ").unwrap(), vec![5, 999, 1000, 0]);
        assert_eq!(t.decode(&[5, 999, 1000]).unwrap(), "5 999 1000");
        assert!(matches!(t.encode("5 1001"), Err(DataError::TokenOutOfRange { id: 1001, vocab: 1001 })));
        assert!(matches!(t.encode("5 cat"), Err(DataError::NotAnId(w)) if w == "cat"));
        assert!(matches!(TokenizerKind::parse("NullTokenizer"), Err(DataError::NullVocab)));
        assert!(matches!(
            TokenizerKind::parse_with("gpt2", Some(1000), None),
            Err(DataError::FixedVocab { tokenizer: "gpt2", given: 1000 })
        ));
    }
}
