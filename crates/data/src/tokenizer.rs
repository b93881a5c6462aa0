//! Tokenizers: byte-level (vocab 256, end-of-document = byte 0, which text never contains) and
//! GPT-2 BPE through tiktoken-rs (r50k_base, end-of-document = `<|endoftext|>` 50256).

use crate::DataError;
use std::sync::Arc;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenizerKind {
    Byte,
    Gpt2,
}

impl TokenizerKind {
    pub fn parse(s: &str) -> Result<Self, DataError> {
        match s {
            "byte" => Ok(TokenizerKind::Byte),
            "gpt2" | "GPT2BPETokenizer" => Ok(TokenizerKind::Gpt2),
            _ => Err(DataError::UnknownTokenizer(s.into())),
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            TokenizerKind::Byte => "byte",
            TokenizerKind::Gpt2 => "gpt2",
        }
    }
}

#[derive(Clone)]
pub enum Tokenizer {
    Byte,
    Gpt2(Arc<tiktoken_rs::CoreBPE>),
}

impl Tokenizer {
    pub fn new(kind: TokenizerKind) -> Result<Self, DataError> {
        Ok(match kind {
            TokenizerKind::Byte => Tokenizer::Byte,
            TokenizerKind::Gpt2 => {
                Tokenizer::Gpt2(Arc::new(tiktoken_rs::r50k_base().map_err(|e| DataError::Tokenizer(e.to_string()))?))
            }
        })
    }

    pub fn kind(&self) -> TokenizerKind {
        match self {
            Tokenizer::Byte => TokenizerKind::Byte,
            Tokenizer::Gpt2(_) => TokenizerKind::Gpt2,
        }
    }

    /// Vocabulary size before padding.
    pub fn vocab_size(&self) -> usize {
        match self {
            Tokenizer::Byte => 256,
            Tokenizer::Gpt2(_) => 50257,
        }
    }

    pub fn eod(&self) -> u32 {
        match self {
            Tokenizer::Byte => 0,
            Tokenizer::Gpt2(_) => 50256,
        }
    }

    pub fn encode(&self, text: &str) -> Vec<u32> {
        match self {
            Tokenizer::Byte => text.bytes().map(u32::from).collect(),
            Tokenizer::Gpt2(b) => b.encode_ordinary(text).into_iter().collect(),
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
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_and_gpt2_round_trip() {
        let text = "Once upon a time, Mia the owl found 12 + 7 = 19.";
        for kind in [TokenizerKind::Byte, TokenizerKind::Gpt2] {
            let t = Tokenizer::new(kind).unwrap();
            let ids = t.encode(text);
            assert_eq!(t.decode(&ids).unwrap(), text, "{kind:?}");
            assert!(ids.iter().all(|&i| (i as usize) < t.vocab_size()));
        }
        let g = Tokenizer::new(TokenizerKind::Gpt2).unwrap();
        // "Hello world" is two GPT-2 tokens: 15496, 995.
        assert_eq!(g.encode("Hello world"), vec![15496, 995]);
        assert!(matches!(g.decode(&[50300]), Err(DataError::TokenOutOfRange { id: 50300, .. })));
    }
}
