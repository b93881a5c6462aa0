//! SentencePiece `.model` files, Megatron's Llama2Tokenizer and GPTSentencePieceTokenizer, read
//! without Google's C++ library: the ModelProto through prost (`proto.rs`), SentencePiece's
//! normaliser (the precompiled rules, `charsmap.rs`; the dummy prefix; extra whitespace; spaces
//! as ▁), its two encoders (`bpe.rs`, `unigram.rs`), byte fallback, and its decoder. Checked
//! against the ids and text of the Python package on models it trained
//! (tests/fixtures/sentencepiece).

mod bpe;
mod charsmap;
mod proto;
mod unigram;

use crate::DataError;
use charsmap::CharsMap;
use prost::Message;
use std::collections::HashMap;
use std::path::Path;

const SPACE: &str = "\u{2581}";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PieceKind {
    Normal,
    Unknown,
    Control,
    UserDefined,
    Unused,
    /// `<0xHH>`: the byte it stands for.
    Byte(u8),
}

/// The pieces and what the encoders look up in them.
struct Vocab {
    pieces: Vec<(String, f32, PieceKind)>,
    /// Normal, user-defined and unused pieces: what text can become.
    matchable: HashMap<String, u32>,
    /// Control, unknown and byte pieces (`<0x41>`), looked up by their written form.
    reserved: HashMap<String, u32>,
    /// User-defined symbols by their first byte, longest first: matched whole before anything
    /// else. The buckets keep a model with hundreds of them (`<extra_id_N>`) from testing each at
    /// every character.
    user_defined: Vec<Vec<String>>,
    max_piece_chars: usize,
    min_score: f32,
    max_score: f32,
}

impl Vocab {
    fn piece(&self, text: &str) -> Option<u32> {
        self.matchable.get(text).copied()
    }
    fn id_of(&self, text: &str) -> Option<u32> {
        self.reserved.get(text).or_else(|| self.matchable.get(text)).copied()
    }
    fn score(&self, id: u32) -> f32 {
        self.pieces[id as usize].1
    }
    fn kind(&self, id: u32) -> PieceKind {
        self.pieces[id as usize].2
    }
    /// Length in bytes of the symbol `text` starts with, and whether it is a user-defined one.
    fn symbol_at(&self, text: &str) -> (usize, bool) {
        let bucket = text.as_bytes().first().map_or(&[][..], |&b| &self.user_defined[b as usize][..]);
        match bucket.iter().find(|u| text.starts_with(u.as_str())) {
            Some(u) => (u.len(), true),
            None => (text.chars().next().map_or(0, char::len_utf8), false),
        }
    }
}

struct Normalizer {
    charsmap: Option<CharsMap>,
    add_dummy_prefix: bool,
    remove_extra_whitespaces: bool,
    escape_whitespaces: bool,
    whitespace_as_suffix: bool,
}

pub struct SentencePiece {
    vocab: Vocab,
    norm: Normalizer,
    bpe: bool,
    byte_fallback: bool,
    byte_ids: [Option<u32>; 256],
    unk: u32,
    unk_surface: String,
    bos: Option<u32>,
    eos: Option<u32>,
    pad: Option<u32>,
}

fn corrupt(path: &Path, why: impl std::fmt::Display) -> DataError {
    DataError::Tokenizer(format!("--tokenizer-model {}: not a SentencePiece model ({why})", path.display()))
}

impl SentencePiece {
    /// A `.model` file, or a folder holding `tokenizer.model` (a Hugging Face Llama folder).
    pub fn open(path: &Path) -> Result<SentencePiece, DataError> {
        let in_folder = path.join("tokenizer.model");
        let path = if path.is_dir() && in_folder.is_file() { in_folder.as_path() } else { path };
        let bytes = std::fs::read(path)
            .map_err(|e| DataError::Tokenizer(format!("--tokenizer-model {}: {e}", path.display())))?;
        Self::from_bytes(&bytes).map_err(|why| corrupt(path, why))
    }

    fn from_bytes(bytes: &[u8]) -> Result<SentencePiece, String> {
        let m = proto::ModelProto::decode(bytes).map_err(|e| e.to_string())?;
        if m.pieces.is_empty() {
            return Err("no pieces".into());
        }
        let t = m.trainer_spec.unwrap_or_default();
        let n = m.normalizer_spec.unwrap_or_default();
        let bpe = match t.model_type.unwrap_or(1) {
            1 => false,
            2 => true,
            k => return Err(format!("model type {k}: the unigram (1) and BPE (2) models are read, not word or char")),
        };
        let mut v = Vocab {
            pieces: Vec::with_capacity(m.pieces.len()),
            matchable: HashMap::new(),
            reserved: HashMap::new(),
            user_defined: vec![vec![]; 256],
            max_piece_chars: 1,
            min_score: f32::MAX,
            max_score: f32::MIN_POSITIVE,
        };
        let mut byte_ids = [None; 256];
        let mut unk = None;
        for (i, p) in m.pieces.into_iter().enumerate() {
            let text = p.piece.filter(|t| !t.is_empty()).ok_or_else(|| format!("piece {i} is empty"))?;
            let kind = match p.kind.unwrap_or(1) {
                1 => PieceKind::Normal,
                2 => PieceKind::Unknown,
                3 => PieceKind::Control,
                4 => PieceKind::UserDefined,
                5 => PieceKind::Unused,
                6 => PieceKind::Byte(
                    text.strip_prefix("<0x")
                        .and_then(|h| h.strip_suffix('>'))
                        .filter(|h| h.len() == 2)
                        .and_then(|h| u8::from_str_radix(h, 16).ok())
                        .ok_or_else(|| format!("byte piece `{text}` is not <0xHH>"))?,
                ),
                k => return Err(format!("piece {i} `{text}` has type {k}")),
            };
            let score = p.score.unwrap_or(0.0);
            let id = i as u32;
            let map = match kind {
                PieceKind::Normal | PieceKind::UserDefined | PieceKind::Unused => &mut v.matchable,
                _ => &mut v.reserved,
            };
            if map.insert(text.clone(), id).is_some() {
                return Err(format!("piece `{text}` appears twice"));
            }
            match kind {
                PieceKind::Normal => {
                    v.min_score = v.min_score.min(score);
                    v.max_score = v.max_score.max(score);
                }
                PieceKind::UserDefined => v.user_defined[text.as_bytes()[0] as usize].push(text.clone()),
                PieceKind::Unknown => unk = Some(id),
                PieceKind::Byte(b) => byte_ids[b as usize] = Some(id),
                _ => {}
            }
            if matches!(kind, PieceKind::Normal | PieceKind::UserDefined | PieceKind::Unused) {
                v.max_piece_chars = v.max_piece_chars.max(text.chars().count());
            }
            v.pieces.push((text, score, kind));
        }
        for bucket in &mut v.user_defined {
            bucket.sort_by_key(|u| std::cmp::Reverse(u.len()));
        }
        let unk = unk.ok_or("no unknown piece")?;
        let byte_fallback = t.byte_fallback.unwrap_or(false);
        if byte_fallback && byte_ids.iter().any(Option::is_none) {
            return Err("byte fallback without the 256 byte pieces".into());
        }
        let count = v.pieces.len();
        let special = |id: Option<i32>, default: i32| -> Result<Option<u32>, String> {
            match id.unwrap_or(default) {
                -1 => Ok(None),
                i if i >= 0 && (i as usize) < count => Ok(Some(i as u32)),
                i => Err(format!("special id {i} is outside the {count} pieces")),
            }
        };
        let charsmap = match n.precompiled_charsmap.filter(|c| !c.is_empty()) {
            Some(c) => Some(CharsMap::parse(&c).ok_or("the precompiled normalisation rules are cut short")?),
            None => None,
        };
        Ok(SentencePiece {
            norm: Normalizer {
                charsmap,
                add_dummy_prefix: n.add_dummy_prefix.unwrap_or(true),
                remove_extra_whitespaces: n.remove_extra_whitespaces.unwrap_or(true),
                escape_whitespaces: n.escape_whitespaces.unwrap_or(true),
                whitespace_as_suffix: t.treat_whitespace_as_suffix.unwrap_or(false),
            },
            bpe,
            byte_fallback,
            byte_ids,
            unk,
            unk_surface: t.unk_surface.unwrap_or_else(|| " \u{2047} ".into()),
            bos: special(t.bos_id, 1)?,
            eos: special(t.eos_id, 2)?,
            pad: special(t.pad_id, -1)?,
            vocab: v,
        })
    }

    /// Pieces in the model (sentencepiece's `vocab_size()`).
    pub fn vocab_size(&self) -> usize {
        self.vocab.pieces.len()
    }
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }
    pub fn eos(&self) -> Option<u32> {
        self.eos
    }
    pub fn pad(&self) -> Option<u32> {
        self.pad
    }
    pub fn unk(&self) -> u32 {
        self.unk
    }

    /// The text of the unit `s` starts with, and its length in `s`: a user-defined symbol kept
    /// whole, else the longest normalisation rule's replacement, else one character.
    fn unit<'a>(&'a self, s: &'a str) -> (std::borrow::Cow<'a, str>, usize) {
        let (len, user) = self.vocab.symbol_at(s);
        // A rule must end on a character boundary (a corrupt table's may not: ignored).
        let rule = self.norm.charsmap.as_ref().and_then(|c| c.longest_prefix(s.as_bytes()));
        if !user && let Some((l, rep)) = rule.filter(|&(l, _)| s.is_char_boundary(l)) {
            return (String::from_utf8_lossy(rep), l);
        }
        (std::borrow::Cow::Borrowed(&s[..len]), len)
    }

    /// SentencePiece's normalisation of `text`.
    fn normalize(&self, text: &str) -> String {
        let nm = &self.norm;
        let space = if nm.escape_whitespaces { SPACE } else { " " };
        let mut rest = text;
        if nm.remove_extra_whitespaces {
            loop {
                let (u, l) = self.unit(rest);
                if l == 0 || u != " " {
                    break;
                }
                rest = &rest[l..];
            }
        }
        let mut out = String::with_capacity(text.len() + 8);
        if rest.is_empty() {
            return out;
        }
        if nm.add_dummy_prefix && !nm.whitespace_as_suffix {
            out.push_str(space);
        }
        let mut prev_space = nm.remove_extra_whitespaces;
        while !rest.is_empty() {
            let (u, l) = self.unit(rest);
            let mut piece = &*u;
            if prev_space {
                piece = piece.trim_start_matches(' ');
            }
            if !piece.is_empty() {
                for c in piece.chars() {
                    match c {
                        ' ' => out.push_str(space),
                        c => out.push(c),
                    }
                }
                prev_space = piece.ends_with(' ');
            }
            rest = &rest[l.max(1)..];
            if !nm.remove_extra_whitespaces {
                prev_space = false;
            }
        }
        if nm.remove_extra_whitespaces {
            while out.ends_with(space) {
                out.truncate(out.len() - space.len());
            }
        }
        if nm.add_dummy_prefix && nm.whitespace_as_suffix {
            out.push_str(space);
        }
        out
    }

    /// The ids of `text`, as sentencepiece's `encode_as_ids` (no BOS or EOS).
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let normalized = self.normalize(text);
        let pieces =
            if self.bpe { bpe::encode(&self.vocab, &normalized) } else { unigram::encode(&self.vocab, &normalized) };
        let mut ids = Vec::with_capacity(pieces.len());
        let mut prev_unk = false;
        for (w, id) in pieces {
            let id = id.unwrap_or(self.unk);
            let is_unk = id == self.unk;
            if is_unk && self.byte_fallback {
                ids.extend(w.bytes().filter_map(|b| self.byte_ids[b as usize]));
                prev_unk = false;
                continue;
            }
            // A run of unknown characters is one unknown id.
            if !(is_unk && prev_unk) {
                ids.push(id);
            }
            prev_unk = is_unk;
        }
        ids
    }

    /// The text of `ids`, as sentencepiece's `decode_ids`: control pieces vanish, the unknown
    /// piece is written as its surface (" ⁇ "), runs of byte pieces are read as UTF-8 (each
    /// malformed byte as U+FFFD), ▁ is a space, and the dummy prefix's space is dropped.
    pub fn decode(&self, ids: &[u32]) -> Result<String, DataError> {
        let mut out = String::new();
        let mut bytes: Vec<u8> = vec![];
        let mut at_start = true;
        let flush = |bytes: &mut Vec<u8>, out: &mut String, at_start: &mut bool| {
            if bytes.is_empty() {
                return;
            }
            let mut rest = &bytes[..];
            while !rest.is_empty() {
                match std::str::from_utf8(rest) {
                    Ok(s) => {
                        out.push_str(s);
                        break;
                    }
                    Err(e) => {
                        let ok = e.valid_up_to();
                        out.push_str(std::str::from_utf8(&rest[..ok]).unwrap_or_default());
                        out.push('\u{fffd}');
                        rest = &rest[ok + 1..];
                    }
                }
            }
            bytes.clear();
            *at_start = false;
        };
        for &id in ids {
            let Some((piece, _, kind)) = self.vocab.pieces.get(id as usize) else {
                return Err(DataError::TokenOutOfRange { id, vocab: self.vocab_size() });
            };
            if let PieceKind::Byte(b) = kind {
                bytes.push(*b);
                continue;
            }
            flush(&mut bytes, &mut out, &mut at_start);
            let surface = match kind {
                PieceKind::Control => continue,
                PieceKind::Unknown => self.unk_surface.clone(),
                _ => {
                    let mut p = piece.as_str();
                    if at_start && (self.norm.add_dummy_prefix || self.norm.remove_extra_whitespaces) {
                        p = p.strip_prefix(SPACE).unwrap_or(p);
                    }
                    p.replace(SPACE, " ")
                }
            };
            out.push_str(&surface);
            at_start = false;
        }
        flush(&mut bytes, &mut out, &mut at_start);
        Ok(out)
    }
}
