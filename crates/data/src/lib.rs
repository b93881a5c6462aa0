//! ferrotron-data: what the trainer feeds the model.
//!
//! The built-in corpus (made by the project's own seeded generator, so no download is ever
//! needed), byte-level, GPT-2 BPE and Megatron's Null, HuggingFace, TikToken and SentencePiece (Llama2,
//! GPTSentencePiece) tokenizers,
//! Megatron's indexed datasets (`--data-path PREFIX`: PREFIX.bin + PREFIX.idx, memory-mapped)
//! and Megatron's mock data
//! (`--mock-data`, drawn with numpy's generators: numpy_rng.rs). Every kind of data becomes
//! samples of seq_length + 1 tokens in Megatron-Core's GPTDataset order (gpt.rs), split and
//! blended as its dataset builder does (dataset.rs), so a run reads the samples a Megatron run
//! with the same flags reads, and a resumed run the ones it would have read; `--dataloader-type
//! cyclic` reads them in Megatron's per-epoch random order (sampler.rs).

pub mod corpus;
mod dataset;
mod gpt;
mod gpt2_files;
mod hf_tokenizer;
pub mod image_text;
mod index_cache;
mod indexed;
mod numpy_rng;
mod positions;
mod sampler;
pub mod sentencepiece;
mod tiktoken;
mod tokenizer;

pub use dataset::{
    MID_LEVEL_SURPLUS, Part, PartRange, SPLIT_NAMES, TokenSplit, blend_sizes, blend_split, documents_in_memory,
    parse_split, split_of, split_ranges, whole_split,
};
pub use gpt::{GptDataset, Sequences};
pub use indexed::{IndexedBuilder, IndexedDataset, TokenDtype, write_indexed};
pub use numpy_rng::{NumpyGenerator, NumpyRandomState};
pub use positions::{document_starts, reset_position_ids};
pub use sampler::{CyclicSampler, torch_randperm};
pub use tiktoken::{TikPattern, TikTokenSpec};
pub use tokenizer::{Tokenizer, TokenizerFlags, TokenizerKind};

#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error(
        "unknown tokenizer `{0}`: use `byte`, `gpt2` (GPT2BPETokenizer), `NullTokenizer` with --vocab-size, `HuggingFaceTokenizer` with --tokenizer-model, `TikTokenizer` with --tokenizer-model and --tiktoken-pattern, or `Llama2Tokenizer` / `GPTSentencePieceTokenizer` with --tokenizer-model FILE.model"
    )]
    UnknownTokenizer(String),
    #[error("NullTokenizer needs --vocab-size N (ids 0..N, end-of-document N), 1 ≤ N < 2^32 - 1")]
    NullVocab,
    #[error(
        "HuggingFaceTokenizer needs --tokenizer-model FOLDER (a transformers tokenizer folder with tokenizer.json)"
    )]
    HfModel,
    #[error("--tokenizer-model {} belongs to HuggingFaceTokenizer, TikTokenizer, Llama2Tokenizer and GPTSentencePieceTokenizer, not the {tokenizer} tokenizer", model.display())]
    ModelFileOnly { tokenizer: String, model: std::path::PathBuf },
    #[error(
        "--vocab-size {given} applies to NullTokenizer and TikTokenizer only: the {tokenizer} tokenizer's vocabulary is fixed"
    )]
    FixedVocab { tokenizer: &'static str, given: usize },
    #[error("`{0}` is not a token id: NullTokenizer reads text as ids separated by white space")]
    NotAnId(String),
    #[error("--vocab-file and --merge-file belong to GPT2BPETokenizer, not the {0} tokenizer")]
    Gpt2FilesOnly(&'static str),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("token id {id} is outside the tokenizer's vocabulary of {vocab}")]
    TokenOutOfRange { id: u32, vocab: usize },
    #[error(
        "the {split} split has {tokens} tokens, fewer than one sample of --seq-length {seq} + 1: use more data, a shorter --seq-length or (with --data-path) a larger share of --split"
    )]
    TooSmall { split: &'static str, tokens: usize, seq: usize },
    #[error("{}: {source}", path.display())]
    Io { path: std::path::PathBuf, source: std::io::Error },
    #[error("{}: {why}; it is not an index this tool wrote for these settings: delete it and the run rebuilds it (--data-cache-path)", path.display())]
    BadCache { path: std::path::PathBuf, why: String },
    #[error("{}: {what}", path.display())]
    BadFile { path: std::path::PathBuf, what: String },
    #[error("a document of {tokens} tokens is longer than an indexed dataset's sequence can be (2^31 - 1)")]
    TooLong { tokens: usize },
    #[error("token id {id} does not fit the indexed dataset's {dtype:?} tokens: write it as I32")]
    TokenDoesNotFit { id: u32, dtype: TokenDtype },
    #[error("--split {0}: give up to three non-negative weights for train, valid and test, e.g. 969,30,1 (or 98/2/0)")]
    BadSplit(String),
    #[error("--data-path: {0}")]
    BadDataPath(String),
    #[error("sample {index} asked of a split of {samples} samples")]
    SampleOutOfRange { index: usize, samples: usize },
    #[error("--dataloader-type cyclic: {0}")]
    Sampler(String),
    #[error(
        "the {split} split would need 2^32 or more sequences or samples: use fewer --train-iters or a larger --seq-length"
    )]
    TooManySamples { split: &'static str },
    #[error("--seed {0}: Megatron's datasets shuffle with numpy's RandomState, whose seed must be below 2^32")]
    BadSeed(u64),
}
