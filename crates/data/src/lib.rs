//! ferrotron-data: what the trainer feeds the model.
//!
//! For now: the built-in corpus (made by the project's own seeded generator, so no download is ever
//! needed), byte-level and GPT-2 BPE tokenizers, a train/valid split by document, fixed-length
//! samples of seq_length + 1 tokens, and a sampler whose order is a pure function of (seed, epoch),
//! so a run resumed from `consumed_samples` sees exactly the batches it would have seen.
//! Megatron's indexed .bin/.idx datasets and blending join this crate later.

pub mod corpus;
mod dataset;
mod tokenizer;

pub use dataset::{Sampler, TokenSplit, split_documents};
pub use tokenizer::{Tokenizer, TokenizerKind};

#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("unknown tokenizer `{0}`: use `byte` or `gpt2`")]
    UnknownTokenizer(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("token id {id} is outside the tokenizer's vocabulary of {vocab}")]
    TokenOutOfRange { id: u32, vocab: usize },
    #[error(
        "the {split} split has {tokens} tokens, fewer than one sample of --seq-length {seq} + 1: use more data or a shorter --seq-length"
    )]
    TooSmall { split: &'static str, tokens: usize, seq: usize },
}
