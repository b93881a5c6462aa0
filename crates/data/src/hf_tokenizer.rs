//! Megatron's HuggingFaceTokenizer: a transformers tokenizer folder (tokenizer.json, with the
//! end-of-document token named by tokenizer_config.json's `eos_token`) read by HF's own
//! `tokenizers` crate. As Megatron's (`AutoTokenizer(...)(text).input_ids`), encoding adds the
//! tokenizer's special tokens (Llama's BOS) and decoding keeps them; the vocabulary counts the
//! added tokens, as `len(tokenizer)` does.

use crate::DataError;
use std::path::Path;

pub struct HfTokenizer {
    tok: tokenizers::Tokenizer,
    eod: u32,
    vocab: usize,
}

fn bad(path: &Path, msg: impl std::fmt::Display) -> DataError {
    DataError::Tokenizer(format!("--tokenizer-model {}: {msg}", path.display()))
}

impl HfTokenizer {
    /// `path`: a tokenizer folder, or the tokenizer.json in one.
    pub fn open(path: &Path) -> Result<HfTokenizer, DataError> {
        let (dir, file) = if path.is_file() {
            (path.parent().map(Path::to_path_buf).unwrap_or_default(), path.to_path_buf())
        } else {
            (path.to_path_buf(), path.join("tokenizer.json"))
        };
        if !file.is_file() {
            return Err(bad(
                path,
                "no tokenizer.json (name a transformers tokenizer folder; the slow tokenizer's files alone are not read)",
            ));
        }
        let tok = tokenizers::Tokenizer::from_file(&file).map_err(|e| bad(&file, e))?;
        let config = dir.join("tokenizer_config.json");
        let eos = std::fs::read_to_string(&config)
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .and_then(|v| match &v["eos_token"] {
                serde_json::Value::String(s) => Some(s.clone()),
                o => o["content"].as_str().map(str::to_string),
            })
            .ok_or_else(|| bad(&config, "no eos_token: the end-of-document token is the tokenizer's eos_token"))?;
        let eod =
            tok.token_to_id(&eos).ok_or_else(|| bad(&file, format!("eos_token {eos:?} is not in the vocabulary")))?;
        let vocab = tok.get_vocab_size(true);
        Ok(HfTokenizer { tok, eod, vocab })
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab
    }

    pub fn eod(&self) -> u32 {
        self.eod
    }

    pub fn encode(&self, text: &str) -> Result<Vec<u32>, DataError> {
        let e = self.tok.encode(text, true).map_err(|e| DataError::Tokenizer(e.to_string()))?;
        Ok(e.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String, DataError> {
        self.tok.decode(ids, false).map_err(|e| DataError::Tokenizer(e.to_string()))
    }
}
