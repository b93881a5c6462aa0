//! Megatron-Core's GPTDataset sample order, index for index.
//!
//! A dataset is a range of sequence ids (a split of an indexed dataset, of Megatron's mock data
//! or of the built-in corpus held in memory) and a number of samples of `seq_length` + 1 tokens.
//! Megatron builds three indices from them, and so does this file, with the same arithmetic and
//! the same random draws:
//!
//! - document index: the ids repeated once per epoch (as many epochs as the samples need),
//!   shuffled by numpy's `RandomState(seed)`; when the last epoch would be used for less than 80%
//!   of its samples it is shuffled on its own after the others;
//! - sample index: where each sample starts, as (position in the document index, token offset);
//!   consecutive samples overlap by one token, the label of the last input;
//! - shuffle index: a permutation of the samples, the same random state drawing it (again the
//!   final epoch apart when the first index was split).
//!
//! Sample i is then the tokens from start `shuffle[i]` to start `shuffle[i] + 1`, plus one. The
//! last partial sample is dropped (Megatron's default for every split), so none is padded.
//! The oracle is Megatron-Core's own code (tests/fixtures/make_megatron_gpt_order.py).

use crate::index_cache::{CacheEntry, Indices, IndicesRef, U32s};
use crate::numpy_rng::NumpyRandomState;
use crate::{DataError, IndexedDataset};
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

/// Where a dataset's sequences live: the built-in corpus in memory, an indexed dataset, or
/// Megatron's mock dataset (`--mock-data`).
pub enum Sequences {
    Memory {
        tokens: Vec<u32>,
        starts: Vec<u64>,
    },
    Indexed(Arc<IndexedDataset>),
    /// Sequence i is 1, 2, … (modulo `vocab`) for `lengths[i]` − 1 tokens, then `eod`.
    Mock {
        lengths: Vec<u32>,
        vocab: u32,
        eod: u32,
    },
}

/// Megatron's MockGPTLowLevelDataset: 100,000 sequences, lengths drawn by numpy's
/// `default_rng(0).integers(1, 4096)`.
const MOCK_SEQUENCES: usize = 100_000;
const MOCK_MAX_LENGTH: u32 = 4096;

impl Sequences {
    /// Megatron's mock sequences for a tokenizer of `vocab` ids whose end of document is `eod`.
    pub fn mock(vocab: u32, eod: u32) -> Self {
        let lengths = crate::NumpyGenerator::new(0).integers_u32(1, MOCK_MAX_LENGTH, MOCK_SEQUENCES);
        Sequences::Mock { lengths, vocab, eod }
    }

    /// Documents as sequences, in memory.
    pub fn from_documents(docs: &[Vec<u32>]) -> Self {
        let mut starts = Vec::with_capacity(docs.len() + 1);
        let mut tokens = Vec::with_capacity(docs.iter().map(Vec::len).sum());
        starts.push(0);
        for d in docs {
            tokens.extend_from_slice(d);
            starts.push(tokens.len() as u64);
        }
        Sequences::Memory { tokens, starts }
    }

    pub fn len(&self) -> usize {
        match self {
            Sequences::Memory { starts, .. } => starts.len() - 1,
            Sequences::Indexed(d) => d.num_sequences(),
            Sequences::Mock { lengths, .. } => lengths.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Tokens in sequence `i` (below `len`).
    pub fn length(&self, i: usize) -> u64 {
        match self {
            Sequences::Memory { starts, .. } => starts[i + 1] - starts[i],
            Sequences::Indexed(d) => d.sequence_length(i),
            Sequences::Mock { lengths, .. } => lengths[i] as u64,
        }
    }

    /// Tokens `offset .. offset + n` of sequence `i`, appended to `out`.
    fn read(&self, i: usize, offset: u64, n: u64, out: &mut Vec<u32>) -> Result<(), DataError> {
        match self {
            Sequences::Memory { tokens, starts } => {
                let a = (starts[i] + offset) as usize;
                out.extend_from_slice(&tokens[a..a + n as usize]);
            }
            Sequences::Indexed(d) => {
                let at = out.len();
                out.resize(at + n as usize, 0);
                d.read(d.sequence_start(i) + offset, &mut out[at..])?;
            }
            Sequences::Mock { lengths, vocab, eod } => {
                let last = lengths[i] as u64 - 1;
                out.extend(
                    (offset..offset + n).map(|p| if p < last { ((p + 1) % *vocab as u64) as u32 } else { *eod }),
                );
            }
        }
        Ok(())
    }
}

/// One split's samples in Megatron's order (see the file's header).
pub struct GptDataset {
    seqs: Arc<Sequences>,
    seq_length: usize,
    tokens_per_epoch: u64,
    /// Sequence ids, epoch after epoch, shuffled.
    documents: U32s,
    /// Sample k starts at token `starts[2k + 1]` of sequence `documents[starts[2k]]` (Megatron's
    /// [samples + 1, 2] sample index, flat); one more pair than samples.
    starts: U32s,
    shuffle: U32s,
    /// What its cache files' names hash (built with --data-cache-path), for a blend's own.
    cached_as: Option<String>,
}

/// Megatron's `add_extra_token_to_sequence`: a sample holds its last input's label too.
const EXTRA: u64 = 1;

/// What a dataset's indices come to before they are drawn: tokens per epoch, epochs, whether the
/// final epoch is shuffled apart, and the samples (Megatron's arithmetic).
struct Plan {
    tokens_per_epoch: u64,
    epochs: u64,
    separate: bool,
    sans_final: u64,
    samples: u64,
}

impl Plan {
    fn new(
        name: &'static str,
        seqs: &Sequences,
        ids: &Range<usize>,
        num_samples: Option<u64>,
        seq: u64,
    ) -> Result<Self, DataError> {
        let tokens_per_epoch: u64 = ids.clone().map(|i| seqs.length(i)).sum();
        if tokens_per_epoch <= EXTRA || seq < 2 {
            return Err(DataError::TooSmall { split: name, tokens: tokens_per_epoch as usize, seq: seq as usize });
        }
        let epochs = match num_samples {
            None => 1,
            Some(n) => (n * seq + EXTRA).div_ceil(tokens_per_epoch).max(1),
        };
        // Megatron shuffles a final epoch that is used for less than 80% of its samples apart
        // from the others, so the extra epoch's documents are not spread over the whole run.
        let sans_final = epochs.saturating_sub(1) * tokens_per_epoch;
        let sans_final = sans_final.saturating_sub(EXTRA) / seq;
        let separate = match num_samples {
            Some(n) if epochs > 1 => {
                let per_epoch = (tokens_per_epoch - EXTRA) / seq;
                n - sans_final < (0.80 * per_epoch as f64) as u64
            }
            _ => false,
        };
        let samples = (epochs * tokens_per_epoch - EXTRA) / seq;
        if epochs * ids.len() as u64 > u32::MAX as u64 || ids.end > u32::MAX as usize || samples >= u32::MAX as u64 {
            return Err(DataError::TooManySamples { split: name });
        }
        Ok(Plan { tokens_per_epoch, epochs, separate, sans_final, samples })
    }
}

impl GptDataset {
    /// Samples of `seq_length` + 1 tokens over sequences `ids` of `seqs`: at least `num_samples`
    /// of them (whole epochs), or one epoch's worth when None (Megatron's blends by size). With
    /// `cache` (Megatron's --data-cache-path; index_cache.rs) an indexed dataset's indices are
    /// read from there when a run of the same data and settings wrote them, else built and
    /// written there; mock and in-memory sequences, cheap to index, are built each time.
    pub fn build(
        name: &'static str,
        seqs: Arc<Sequences>,
        ids: Range<usize>,
        num_samples: Option<u64>,
        seq_length: usize,
        seed: u32,
        cache: Option<&Path>,
    ) -> Result<Self, DataError> {
        let plan = Plan::new(name, &seqs, &ids, num_samples, seq_length as u64)?;
        let entry = match (cache, &*seqs) {
            (Some(dir), Sequences::Indexed(ds)) => {
                // The sequences' lengths, position-weighted: a dataset rewritten with other
                // documents of the same total gets other files too.
                let lengths =
                    ids.clone().map(|i| seqs.length(i).wrapping_mul(i as u64 + 1)).fold(0u64, u64::wrapping_add);
                let description = format!(
                    "ferrotron GPTDataset indices\ndataset: {}\nsequences: {}..{} of {}\ntokens per epoch: {}\n\
                     length checksum: {lengths}\nsamples asked: {num_samples:?}\nsequence length: {seq_length}\n\
                     seed: {seed}\nsplit: {name}\n",
                    ds.prefix().display(),
                    ids.start,
                    ids.end,
                    seqs.len(),
                    plan.tokens_per_epoch,
                );
                Some(CacheEntry::new(dir, "GPTDataset", name, description))
            }
            _ => None,
        };
        if let Some(entry) = &entry
            && let Some(ix) = entry.load()?
        {
            check_cached(entry, &ix, &plan, &ids)?;
            let Indices { documents, starts, shuffle } = ix;
            return Ok(GptDataset {
                seqs,
                seq_length,
                tokens_per_epoch: plan.tokens_per_epoch,
                documents,
                starts,
                shuffle,
                cached_as: Some(entry.description().to_string()),
            });
        }
        let mut d = Self::draw(seqs, ids, &plan, seq_length, seed);
        if let Some(entry) = &entry {
            // Written, then used from memory: the next run maps them.
            entry.save(IndicesRef { documents: &d.documents, starts: &d.starts, shuffle: &d.shuffle })?;
            d.cached_as = Some(entry.description().to_string());
        }
        Ok(d)
    }

    /// The three indices drawn as Megatron draws them.
    fn draw(seqs: Arc<Sequences>, ids: Range<usize>, plan: &Plan, seq_length: usize, seed: u32) -> Self {
        let seq = seq_length as u64;
        let mut rng = NumpyRandomState::new(seed);
        let epoch_ids = |k: u64| -> Vec<u32> { (0..k).flat_map(|_| ids.clone()).map(|i| i as u32).collect() };
        let documents = if plan.separate {
            let mut first = epoch_ids(plan.epochs - 1);
            rng.shuffle(&mut first);
            let mut last = epoch_ids(1);
            rng.shuffle(&mut last);
            first.extend(last);
            first
        } else {
            let mut all = epoch_ids(plan.epochs);
            rng.shuffle(&mut all);
            all
        };
        let samples = plan.samples;
        let starts = sample_starts(&seqs, &documents, seq, samples);
        let first = if plan.separate { plan.sans_final } else { samples } as u32;
        let mut shuffle: Vec<u32> = (0..first).collect();
        rng.shuffle(&mut shuffle);
        if (first as u64) < samples {
            let mut last: Vec<u32> = (first..samples as u32).collect();
            rng.shuffle(&mut last);
            shuffle.extend(last);
        }
        GptDataset {
            seqs,
            seq_length,
            tokens_per_epoch: plan.tokens_per_epoch,
            documents: documents.into(),
            starts: starts.into(),
            shuffle: shuffle.into(),
            cached_as: None,
        }
    }

    pub fn num_samples(&self) -> usize {
        self.shuffle.len()
    }

    /// Whether the indices are a cache's files mapped read-only (a run that found them under
    /// --data-cache-path) rather than built into memory.
    pub fn indices_mapped(&self) -> bool {
        self.documents.is_mapped() && self.starts.is_mapped() && self.shuffle.is_mapped()
    }

    /// The description its --data-cache-path files are named by (None when not cached: mock and
    /// in-memory sequences, or no cache path).
    pub fn cached_as(&self) -> Option<&str> {
        self.cached_as.as_deref()
    }

    /// Tokens in the dataset's sequences, once each.
    pub fn tokens_per_epoch(&self) -> u64 {
        self.tokens_per_epoch
    }

    /// The seq_length + 1 tokens of sample `i` (below `num_samples`).
    pub fn sample(&self, i: usize) -> Result<Vec<u32>, DataError> {
        let k = *self.shuffle.get(i).ok_or(DataError::SampleOutOfRange { index: i, samples: self.shuffle.len() })?;
        let k = 2 * k as usize;
        let ((d0, o0), (d1, o1)) = ((self.starts[k], self.starts[k + 1]), (self.starts[k + 2], self.starts[k + 3]));
        let mut out = Vec::with_capacity(self.seq_length + 1);
        for d in d0..=d1 {
            let id = self.documents[d as usize] as usize;
            let from = if d == d0 { o0 as u64 } else { 0 };
            let to = if d == d1 { o1 as u64 + EXTRA } else { self.seqs.length(id) };
            self.seqs.read(id, from, to - from, &mut out)?;
        }
        Ok(out)
    }
}

/// Cached indices that do not fit the dataset they were read for (another run's files put in
/// their place) are refused, naming the file.
fn check_cached(entry: &CacheEntry, ix: &Indices, plan: &Plan, ids: &Range<usize>) -> Result<(), DataError> {
    let bad = |what: &str, why: String| Err(DataError::BadCache { path: entry.path_of(what), why });
    let docs = (plan.epochs * ids.len() as u64) as usize;
    if ix.documents.len() != docs || ix.documents.iter().any(|&d| !ids.contains(&(d as usize))) {
        let n = ix.documents.len();
        return bad("document_index.npy", format!("{n} entries, or ids outside {ids:?}, where {docs} were built"));
    }
    let n = plan.samples as usize;
    if ix.starts.len() != 2 * (n + 1) || ix.starts.iter().step_by(2).any(|&d| d as usize >= docs) {
        return bad("sample_index.npy", format!("{} starts where {} were built", ix.starts.len() / 2, n + 1));
    }
    if ix.shuffle.len() != n || ix.shuffle.iter().any(|&k| k as usize >= n) {
        return bad("shuffle_index.npy", format!("{} entries where a permutation of {n} was built", ix.shuffle.len()));
    }
    Ok(())
}

/// Megatron's `build_sample_idx` (drop the last partial sample, one extra token a sample): each
/// sample takes seq + 1 tokens from where the last one ended, less the one they share.
fn sample_starts(seqs: &Sequences, documents: &[u32], seq: u64, samples: u64) -> Vec<u32> {
    let mut starts = Vec::with_capacity(2 * (samples as usize + 1));
    let (mut d, mut offset) = (0usize, 0i64);
    starts.extend([0, 0]);
    for _ in 0..samples {
        let mut remaining = (seq + EXTRA) as i64;
        while remaining != 0 {
            let len = seqs.length(documents[d] as usize) as i64 - offset;
            remaining -= len;
            if remaining <= 0 {
                offset += remaining + len - EXTRA as i64;
                remaining = 0;
            } else if d == documents.len() - 1 {
                // The end of the last epoch: only the last sample can get here.
                offset = seqs.length(documents[d] as usize) as i64 - EXTRA as i64;
                break;
            } else {
                d += 1;
                offset = 0;
            }
        }
        starts.extend([d as u32, offset as u32]);
    }
    starts
}
