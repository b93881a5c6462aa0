//! `ferrotron preprocess`: JSON lines into a Megatron indexed dataset, with the flags of Megatron's
//! `tools/preprocess_data.py` for GPT data: each line's `--json-keys` fields (default `text`)
//! tokenized, `--append-eod` ending every document with the end-of-document token, written to
//! OUTPUT_PREFIX_KEY_document.{bin,idx} (what `train --data-path` then takes). Lines are tokenized
//! on all cores in batches, in order.

use anyhow::{Context, bail};
use ferrotron_data::{IndexedBuilder, TokenDtype, Tokenizer, TokenizerFlags, TokenizerKind};
use rayon::prelude::*;
use std::io::BufRead;
use std::path::PathBuf;

#[derive(clap::Args, Clone, Debug)]
pub struct PreprocessArgs {
    /// A JSON-lines file: one object per line.
    #[arg(long)]
    pub input: PathBuf,
    /// Outputs go to OUTPUT_PREFIX_KEY_document.bin and .idx, one pair per --json-keys key.
    #[arg(long)]
    pub output_prefix: String,
    /// byte, gpt2 (Megatron's GPT2BPETokenizer), NullTokenizer (text already ids, with
    /// --vocab-size), HuggingFaceTokenizer (--tokenizer-model) or TikTokenizer
    /// (--tokenizer-model FILE.json, --tiktoken-pattern): the tokenizer the model will train with.
    #[arg(long)]
    pub tokenizer_type: String,
    /// NullTokenizer's vocabulary: ids below N, end-of-document N; TikTokenizer's whole
    /// vocabulary (default 131072).
    #[arg(long)]
    pub vocab_size: Option<usize>,
    /// HuggingFaceTokenizer's transformers tokenizer folder (tokenizer.json); TikTokenizer's
    /// JSON file.
    #[arg(long)]
    pub tokenizer_model: Option<PathBuf>,
    /// TikTokenizer's pattern (v1 or v2), special-token count (default 1000) and named special
    /// tokens (default <unk> <s> </s>), as `train` takes them.
    #[arg(long)]
    pub tiktoken_pattern: Option<String>,
    #[arg(long)]
    pub tiktoken_num_special_tokens: Option<usize>,
    #[arg(long, num_args = 1..)]
    pub tiktoken_special_tokens: Option<Vec<String>>,
    /// GPT2BPETokenizer's vocab.json and merges.txt, as Megatron's scripts pass them: checked to
    /// be GPT-2's (the tokenizer is built in).
    #[arg(long)]
    pub vocab_file: Option<PathBuf>,
    #[arg(long)]
    pub merge_file: Option<PathBuf>,
    #[arg(long, num_args = 1.., default_values_t = ["text".to_string()])]
    pub json_keys: Vec<String>,
    /// End every document with the tokenizer's end-of-document token.
    #[arg(long)]
    pub append_eod: bool,
    /// Accepted for Megatron's scripts; the work is spread over all cores either way.
    #[arg(long)]
    pub workers: Option<usize>,
}

/// What one key's output holds.
#[derive(Debug, PartialEq)]
pub struct Written {
    pub prefix: PathBuf,
    pub documents: usize,
    pub tokens: u64,
}

pub fn preprocess(a: &PreprocessArgs) -> anyhow::Result<Vec<Written>> {
    let flags = TokenizerFlags {
        vocab_size: a.vocab_size,
        model: a.tokenizer_model.as_deref(),
        tiktoken_pattern: a.tiktoken_pattern.as_deref(),
        tiktoken_num_special_tokens: a.tiktoken_num_special_tokens,
        tiktoken_special_tokens: a.tiktoken_special_tokens.as_deref(),
    };
    let kind = TokenizerKind::from_flags(&a.tokenizer_type, &flags)
        .map_err(|e| anyhow::anyhow!("--tokenizer-type {}: {e}", a.tokenizer_type))?;
    let tok = Tokenizer::new(kind)?;
    let dtype = TokenDtype::for_vocab(tok.vocab_size());
    let input = std::fs::File::open(&a.input).with_context(|| format!("--input {}", a.input.display()))?;
    let prefixes: Vec<PathBuf> =
        a.json_keys.iter().map(|k| PathBuf::from(format!("{}_{k}_document", a.output_prefix))).collect();
    let mut builders = prefixes.iter().map(|p| IndexedBuilder::create(p, dtype)).collect::<Result<Vec<_>, _>>()?;
    let mut tokens = vec![0u64; prefixes.len()];
    let mut lines = std::io::BufReader::new(input).lines().enumerate();
    loop {
        let batch: Vec<(usize, String)> = lines
            .by_ref()
            .take(4096)
            .map(|(i, l)| l.map(|l| (i + 1, l)).with_context(|| format!("{}: line {}", a.input.display(), i + 1)))
            .collect::<anyhow::Result<_>>()?;
        if batch.is_empty() {
            break;
        }
        let docs: Vec<Vec<Vec<u32>>> = batch
            .par_iter()
            .filter(|(_, l)| !l.trim().is_empty())
            .map(|(n, line)| {
                let v: serde_json::Value = serde_json::from_str(line)
                    .with_context(|| format!("{}: line {n} is not a JSON object", a.input.display()))?;
                a.json_keys
                    .iter()
                    .map(|k| {
                        let Some(text) = v.get(k).and_then(|t| t.as_str()) else {
                            bail!("{}: line {n} has no string field `{k}` (--json-keys)", a.input.display());
                        };
                        let mut ids = tok
                            .encode(text)
                            .with_context(|| format!("{}: line {n}, field `{k}`", a.input.display()))?;
                        if a.append_eod {
                            ids.push(tok.eod());
                        }
                        Ok(ids)
                    })
                    .collect()
            })
            .collect::<anyhow::Result<_>>()?;
        for per_key in docs {
            for (k, ids) in per_key.into_iter().enumerate() {
                tokens[k] += ids.len() as u64;
                builders[k].add_document(&ids)?;
            }
        }
    }
    let mut out = Vec::new();
    for ((b, prefix), tokens) in builders.into_iter().zip(prefixes).zip(tokens) {
        let documents = b.num_documents();
        b.finish()?;
        out.push(Written { prefix, documents, tokens });
    }
    Ok(out)
}
