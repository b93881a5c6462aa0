//! `ferrotron preprocess`: JSON lines into a Megatron indexed dataset, with the flags of Megatron's
//! `tools/preprocess_data.py` for GPT data: each line's `--json-keys` fields (default `text`)
//! tokenized, `--append-eod` ending every document with the end-of-document token, written to
//! OUTPUT_PREFIX_KEY_document.{bin,idx} (what `train --data-path` then takes). Lines are tokenized
//! on all cores in batches, in order (or in `--partitions`' dealt order, as Megatron writes it).

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
    /// --vocab-size), HuggingFaceTokenizer (--tokenizer-model), TikTokenizer (--tokenizer-model
    /// FILE.json, --tiktoken-pattern), Llama2Tokenizer or GPTSentencePieceTokenizer
    /// (--tokenizer-model FILE.model): the tokenizer the model will train with.
    #[arg(long)]
    pub tokenizer_type: String,
    /// NullTokenizer's vocabulary: ids below N, end-of-document N; TikTokenizer's whole
    /// vocabulary (default 131072).
    #[arg(long)]
    pub vocab_size: Option<usize>,
    /// HuggingFaceTokenizer's transformers tokenizer folder (tokenizer.json); TikTokenizer's
    /// JSON file; the SentencePiece tokenizers' .model file.
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
    /// Megatron's --partitions N: its input dealt out line by line to N partitions, whose
    /// outputs are joined in partition order: the documents come out in that order (lines 0, N,
    /// 2N, …, then 1, N + 1, …), unless --keep-sequential-samples (contiguous partitions: the
    /// input's order).
    #[arg(long, default_value_t = 1)]
    pub partitions: usize,
    #[arg(long)]
    pub keep_sequential_samples: bool,
    /// A progress line every this many documents (Megatron's default 100).
    #[arg(long)]
    pub log_interval: Option<u64>,
    /// Refused by name: sentence splitting (NLTK's punkt in Megatron) is not built.
    #[arg(long)]
    pub split_sentences: bool,
    /// Accepted: they take effect only with --split-sentences.
    #[arg(long)]
    pub keep_newlines: bool,
    #[arg(long)]
    pub lang: Option<String>,
}

/// What one key's output holds.
#[derive(Debug, PartialEq)]
pub struct Written {
    pub prefix: PathBuf,
    pub documents: usize,
    pub tokens: u64,
}

pub fn preprocess(a: &PreprocessArgs) -> anyhow::Result<Vec<Written>> {
    let given = TokenizerFlags {
        vocab_size: a.vocab_size,
        model: a.tokenizer_model.as_deref(),
        tiktoken_pattern: a.tiktoken_pattern.as_deref(),
        tiktoken_num_special_tokens: a.tiktoken_num_special_tokens,
        tiktoken_special_tokens: a.tiktoken_special_tokens.as_deref(),
    };
    // What Megatron's preprocess_data.py passes over with this tokenizer: dropped, named.
    let (flags, dropped) = given.without_megatron_ignored(&a.tokenizer_type);
    if !dropped.is_empty() {
        eprintln!(
            "warning: --tokenizer-type {} does not read {}: ignored, as in Megatron",
            a.tokenizer_type,
            dropped.join(", ")
        );
    }
    let kind = TokenizerKind::from_flags(&a.tokenizer_type, &flags)
        .map_err(|e| anyhow::anyhow!("--tokenizer-type {}: {e}", a.tokenizer_type))?;
    if a.split_sentences {
        bail!(
            "--split-sentences: sentence splitting (NLTK's punkt) is not built; preprocess whole documents (drop it)"
        );
    }
    if a.partitions == 0 {
        bail!("--partitions must be at least 1");
    }
    let tok = Tokenizer::new(kind)?;
    let dtype = TokenDtype::for_vocab(tok.vocab_size());
    let prefixes: Vec<PathBuf> =
        a.json_keys.iter().map(|k| PathBuf::from(format!("{}_{k}_document", a.output_prefix))).collect();
    let mut builders = prefixes.iter().map(|p| IndexedBuilder::create(p, dtype)).collect::<Result<Vec<_>, _>>()?;
    let mut tokens = vec![0u64; prefixes.len()];
    // Partitions dealt line by line: one pass over the input for each, in partition order.
    let passes = if a.keep_sequential_samples { 1 } else { a.partitions };
    let (start, mut done) = (std::time::Instant::now(), 0u64);
    for pass in 0..passes {
        let input = std::fs::File::open(&a.input).with_context(|| format!("--input {}", a.input.display()))?;
        let mut lines = std::io::BufReader::new(input).lines().enumerate().filter(|(i, _)| i % passes == pass);
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
                done += 1;
                if a.log_interval.is_some_and(|n| n > 0 && done % n == 0) {
                    eprintln!("processed {done} documents ({:.0} docs/s)", done as f64 / start.elapsed().as_secs_f64());
                }
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
