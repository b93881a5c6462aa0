//! A split's samples, and which sequences and how many samples each dataset gives it.
//!
//! A split is one GPT dataset (gpt.rs) or a blend of several. The arithmetic around them is
//! Megatron-Core's BlendedMegatronDatasetBuilder's: `--split` cuts every dataset's sequences at
//! rounded cumulative fractions; a blend with weights builds each part for its share of the
//! split's samples plus 0.5% (the mid-level surplus) and picks parts greedily by weight; a blend
//! without weights weighs each part by one epoch of its samples. So `--data-path`, `--split`,
//! `--seed` and the batch sizes give the samples a Megatron run with the same flags reads, in the
//! same order.

use crate::DataError;
use crate::gpt::{GptDataset, Sequences};
use crate::index_cache::{BlendPicks, CacheEntry};
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

/// The names Megatron gives its three splits, in order.
pub const SPLIT_NAMES: [&str; 3] = ["train", "valid", "test"];

/// Megatron-Core's `mid_level_dataset_surplus`: a blend's parts build this share more samples
/// than their weight asks for.
pub const MID_LEVEL_SURPLUS: f64 = 0.005;

pub struct TokenSplit {
    pub name: &'static str,
    source: Source,
}

enum Source {
    Gpt(GptDataset),
    /// Sample i is sample `picks.sample[i]` of part `picks.part[i]` (6 bytes a sample: a part's
    /// samples are fewer than 2³², `GptDataset`'s limit; mapped from --data-cache-path's files
    /// where they are cached).
    Blend {
        parts: Vec<GptDataset>,
        picks: BlendPicks,
    },
    /// Sample i is record `picks[i]`'s tokens, whole (image-text pairs:
    /// `image_text::record_split`), padded to `seq` + 1 with `eod`.
    Records {
        records: Arc<Vec<Vec<u32>>>,
        picks: Vec<u32>,
        seq: usize,
        eod: u32,
    },
}

impl TokenSplit {
    pub fn gpt(name: &'static str, ds: GptDataset) -> Self {
        TokenSplit { name, source: Source::Gpt(ds) }
    }

    /// Samples that are records given whole (`picks[i]` the record of sample i), each its tokens
    /// then `eod`, padded or cut to `seq` + 1 (`image_text::record_tokens`).
    pub fn records(name: &'static str, records: Arc<Vec<Vec<u32>>>, picks: Vec<u32>, seq: usize, eod: u32) -> Self {
        TokenSplit { name, source: Source::Records { records, picks, seq, eod } }
    }

    /// The record sample `i` is, for splits of records (None for token streams).
    pub fn record(&self, i: usize) -> Option<usize> {
        match &self.source {
            Source::Records { picks, .. } => picks.get(i).map(|&r| r as usize),
            _ => None,
        }
    }

    pub fn num_samples(&self) -> usize {
        match &self.source {
            Source::Gpt(d) => d.num_samples(),
            Source::Blend { picks, .. } => picks.part.len(),
            Source::Records { picks, .. } => picks.len(),
        }
    }

    /// Whether every index behind the samples is a --data-cache-path file mapped read-only.
    pub fn indices_mapped(&self) -> bool {
        match &self.source {
            Source::Gpt(d) => d.indices_mapped(),
            Source::Blend { parts, picks } => {
                picks.part.is_mapped() && picks.sample.is_mapped() && parts.iter().all(GptDataset::indices_mapped)
            }
            Source::Records { .. } => false,
        }
    }

    /// The seq_length + 1 tokens of sample `i` (below `num_samples`).
    pub fn sample(&self, i: usize) -> Result<Vec<u32>, DataError> {
        match &self.source {
            Source::Gpt(d) => d.sample(i),
            Source::Blend { parts, picks } => {
                let out = DataError::SampleOutOfRange { index: i, samples: picks.part.len() };
                let (&p, &j) = picks.part.get(i).zip(picks.sample.get(i)).ok_or(out)?;
                parts[p as usize].sample(j as usize)
            }
            Source::Records { records, picks, seq, eod } => {
                let &r = picks.get(i).ok_or(DataError::SampleOutOfRange { index: i, samples: picks.len() })?;
                Ok(crate::image_text::record_tokens(&records[r as usize], *eod, *seq).0)
            }
        }
    }
}

/// `--split` as Megatron writes it ("969,30,1", "98,2", or with slashes): the train, valid and
/// test weights, normalised to sum to 1.
pub fn parse_split(s: &str) -> Result<[f64; 3], DataError> {
    let bad = || DataError::BadSplit(s.to_string());
    let sep = if s.contains(',') { ',' } else { '/' };
    let vals: Vec<f64> = s.split(sep).map(|x| x.trim().parse::<f64>()).collect::<Result<_, _>>().map_err(|_| bad())?;
    if vals.is_empty() || vals.len() > 3 || vals.iter().any(|v| !v.is_finite() || *v < 0.0) {
        return Err(bad());
    }
    let sum: f64 = vals.iter().sum();
    if sum <= 0.0 {
        return Err(bad());
    }
    let mut w = [0.0; 3];
    for (o, v) in w.iter_mut().zip(&vals) {
        *o = v / sum;
    }
    Ok(w)
}

/// The sequences of a dataset of `n` that each split takes for `weights` (`parse_split`), as
/// Megatron-Core cuts them: the split's bounds are the running sums of the weights, each times
/// n rounded half to even. A split of weight 0 is None (Megatron builds no dataset for it).
pub fn split_ranges(n: usize, weights: [f64; 3]) -> [Option<Range<usize>>; 3] {
    let mut out = [None, None, None];
    let mut begin = 0.0;
    for (k, w) in weights.iter().enumerate() {
        let end = begin + w;
        if end > begin {
            let at = |x: f64| (x * n as f64).round_ties_even() as usize;
            out[k] = Some(at(begin)..at(end));
        }
        begin = end;
    }
    out
}

/// One dataset of a blend: its weight (None for Megatron's prefixes given without weights) and
/// its sequences.
pub type Part = (Option<f64>, Arc<Sequences>);

/// A part and the range of its sequences a split takes.
pub type PartRange = (Option<f64>, Arc<Sequences>, Range<usize>);

/// Split `k` of datasets `parts`, each cut by `split` (`--data-path` with `--split`), built for
/// `size` samples; None where the split's weight is 0. `cache`: --data-cache-path (indexed
/// datasets' indices kept there between runs).
pub fn split_of(
    parts: &[Part],
    split: [f64; 3],
    k: usize,
    size: u64,
    seq_length: usize,
    seed: u32,
    cache: Option<&Path>,
) -> Result<Option<TokenSplit>, DataError> {
    let mut cut = Vec::with_capacity(parts.len());
    for (w, seqs) in parts {
        match split_ranges(seqs.len(), split)[k].clone() {
            Some(r) => cut.push((*w, seqs.clone(), r)),
            None => return Ok(None),
        }
    }
    blend_split(SPLIT_NAMES[k], cut, size, seq_length, seed, cache).map(Some)
}

/// Split `k` made of every sequence of `parts` (`--train-data-path`, `--valid-data-path`).
pub fn whole_split(
    parts: &[Part],
    k: usize,
    size: u64,
    seq_length: usize,
    seed: u32,
    cache: Option<&Path>,
) -> Result<TokenSplit, DataError> {
    let all = parts.iter().map(|(w, s)| (*w, s.clone(), 0..s.len())).collect();
    blend_split(SPLIT_NAMES[k], all, size, seq_length, seed, cache)
}

/// One split from its parts' sequence ranges: a lone part without a weight is a GPT dataset of
/// `size` samples; otherwise a blend, its parts built and weighed as Megatron's builder does.
pub fn blend_split(
    name: &'static str,
    parts: Vec<PartRange>,
    size: u64,
    seq_length: usize,
    seed: u32,
    cache: Option<&Path>,
) -> Result<TokenSplit, DataError> {
    if parts.len() >= i16::MAX as usize {
        return Err(DataError::BadDataPath(format!(
            "{} datasets in one blend: Megatron's limit is 32766",
            parts.len()
        )));
    }
    if let [(None, seqs, ids)] = &parts[..] {
        return Ok(TokenSplit::gpt(
            name,
            GptDataset::build(name, seqs.clone(), ids.clone(), Some(size), seq_length, seed, cache)?,
        ));
    }
    let weights: Option<Vec<f64>> = parts.iter().map(|p| p.0).collect();
    let (built, weights, size) = match weights {
        Some(w) => {
            if w.iter().any(|x| !(x.is_finite() && *x > 0.0)) {
                return Err(DataError::BadDataPath(format!("blend weights must be positive numbers, got {w:?}")));
            }
            let w = normalize(&w);
            let target = blend_sizes(&w, size, 0.0);
            let buffer = blend_sizes(&w, size, MID_LEVEL_SURPLUS);
            let built = parts
                .into_iter()
                .zip(buffer)
                .map(|((_, seqs, ids), n)| GptDataset::build(name, seqs, ids, Some(n), seq_length, seed, cache))
                .collect::<Result<Vec<_>, _>>()?;
            (built, w, target.iter().sum())
        }
        None if parts.iter().any(|p| p.0.is_some()) => {
            return Err(DataError::BadDataPath("give a weight to every dataset of a blend, or to none".into()));
        }
        None => {
            // One epoch of each part, weighed by its samples; the blend as long as asked for or
            // as all of them together, whichever is fewer.
            let built = parts
                .into_iter()
                .map(|(_, seqs, ids)| GptDataset::build(name, seqs, ids, None, seq_length, seed, cache))
                .collect::<Result<Vec<_>, _>>()?;
            let lens: Vec<f64> = built.iter().map(|d| d.num_samples() as f64).collect();
            if let Some(d) = built.iter().find(|d| d.num_samples() == 0) {
                return Err(DataError::TooSmall {
                    split: name,
                    tokens: d.tokens_per_epoch() as usize,
                    seq: seq_length,
                });
            }
            let total = lens.iter().sum::<f64>() as u64;
            (built, normalize(&lens), size.min(total))
        }
    };
    let picks = blend_picks(name, &built, &weights, size, cache)?;
    Ok(TokenSplit { name, source: Source::Blend { picks, parts: built } })
}

/// The blend's picks: read from --data-cache-path where a run of the same parts, weights and size
/// wrote them (every part cached too: mock and in-memory parts are cheap to pick again), else
/// picked and written there.
fn blend_picks(
    name: &'static str,
    parts: &[GptDataset],
    weights: &[f64],
    size: u64,
    cache: Option<&Path>,
) -> Result<BlendPicks, DataError> {
    let described: Option<Vec<&str>> = parts.iter().map(GptDataset::cached_as).collect();
    let (Some(dir), Some(described)) = (cache, described) else { return Ok(blending_indices(weights, size)) };
    // Weights by their bits: the picks follow them exactly.
    let mut description = format!(
        "ferrotron BlendedDataset indices\nsplit: {name}\nsize: {size}\nweights: {:?}\n",
        weights.iter().map(|w| format!("{:016x}", w.to_bits())).collect::<Vec<_>>()
    );
    for (k, d) in described.iter().enumerate() {
        description.push_str(&format!("part {k}:\n{d}"));
    }
    let entry = CacheEntry::new(dir, "BlendedDataset", name, description);
    if let Some(picks) = entry.load_blend()? {
        check_picks(&entry, &picks, parts, size)?;
        return Ok(picks);
    }
    let picks = blending_indices(weights, size);
    entry.save_blend(&picks)?;
    Ok(picks)
}

/// Cached picks that do not fit the blend they were read for are refused, naming the file.
fn check_picks(entry: &CacheEntry, picks: &BlendPicks, parts: &[GptDataset], size: u64) -> Result<(), DataError> {
    let bad = |what: &str, why: String| Err(DataError::BadCache { path: entry.path_of(what), why });
    if picks.part.len() as u64 != size {
        return bad("dataset_index.npy", format!("{} entries where {size} were picked", picks.part.len()));
    }
    if let Some(p) = picks.part.iter().find(|&&p| p as usize >= parts.len()) {
        return bad("dataset_index.npy", format!("part {p} in a blend of {}", parts.len()));
    }
    if let Some(i) =
        (0..picks.part.len()).find(|&i| picks.sample[i] as usize >= parts[picks.part[i] as usize].num_samples())
    {
        let (p, j) = (picks.part[i], picks.sample[i]);
        let n = parts[p as usize].num_samples();
        return bad("dataset_sample_index.npy", format!("entry {i} is sample {j} of part {p}, which has {n}"));
    }
    Ok(())
}

/// Megatron's `normalize`: each weight over their sum.
fn normalize(w: &[f64]) -> Vec<f64> {
    let sum: f64 = w.iter().sum();
    w.iter().map(|x| x / sum).collect()
}

/// The samples each part of a blend builds for a split of `target` samples: ⌈⌈target · w⌉ ·
/// (1 + surplus)⌉ (Megatron's `_get_size_per_split_per_dataset`).
pub fn blend_sizes(weights: &[f64], target: u64, surplus: f64) -> Vec<u64> {
    weights.iter().map(|w| ((target as f64 * w).ceil() * (1.0 + surplus)).ceil() as u64).collect()
}

/// Megatron's `build_blending_indices`: sample i comes from the part furthest behind its share,
/// weight · max(i, 1) − samples taken so far (the first part on a tie), taking that part's
/// samples in order.
fn blending_indices(weights: &[f64], size: u64) -> BlendPicks {
    let mut taken = vec![0u64; weights.len()];
    let (mut part, mut sample) = (Vec::with_capacity(size as usize), Vec::with_capacity(size as usize));
    for i in 0..size {
        let x = (i as f64).max(1.0);
        let mut best = 0;
        let mut best_err = weights[0] * x - taken[0] as f64;
        for (k, w) in weights.iter().enumerate().skip(1) {
            let err = w * x - taken[k] as f64;
            if err > best_err {
                (best, best_err) = (k, err);
            }
        }
        // Past u32 a pick is past its part's samples (fewer than 2³²): kept out of range, so
        // reading it is the part's out-of-range error.
        part.push(best as u16);
        sample.push(u32::try_from(taken[best]).unwrap_or(u32::MAX));
        taken[best] += 1;
    }
    BlendPicks { part: part.into(), sample: sample.into() }
}

/// Tokenized documents, each followed by the end-of-document token, as in-memory sequences;
/// the last `valid_fraction` of them (at least one, and one fewer than all) are for validation.
/// Returns the train and valid parts, ready for `blend_split`.
pub fn documents_in_memory(
    docs: &[String],
    tok: &crate::Tokenizer,
    valid_fraction: f64,
) -> Result<[PartRange; 2], DataError> {
    let n_valid = ((docs.len() as f64 * valid_fraction).ceil() as usize).clamp(1, docs.len().saturating_sub(1).max(1));
    let cut = docs.len() - n_valid;
    let mut seqs = Vec::with_capacity(docs.len());
    for d in docs {
        let mut t = tok.encode(d)?;
        t.push(tok.eod());
        seqs.push(t);
    }
    let seqs = Arc::new(Sequences::from_documents(&seqs));
    Ok([(None, seqs.clone(), 0..cut), (None, seqs, cut..docs.len())])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memory(docs: &[Vec<u32>]) -> Arc<Sequences> {
        Arc::new(Sequences::from_documents(docs))
    }

    #[test]
    fn samples_overlap_by_one_token_and_cover_the_stream() {
        // One document of 0..21 and one epoch's worth of samples of 4 + 1: five of them, which
        // together (less the shared tokens) are the stream's first 21 tokens.
        let d = GptDataset::build("train", memory(&[(0..21).collect()]), 0..1, Some(5), 4, 7, None).unwrap();
        assert_eq!(d.num_samples(), 5);
        let mut seen: Vec<Vec<u32>> = (0..5).map(|i| d.sample(i).unwrap()).collect();
        seen.sort();
        assert_eq!(seen, (0..5).map(|k| (4 * k..4 * k + 5).collect::<Vec<u32>>()).collect::<Vec<_>>());
        assert!(matches!(d.sample(5), Err(DataError::SampleOutOfRange { index: 5, samples: 5 })));
        let tiny = GptDataset::build("valid", memory(&[vec![1]]), 0..1, Some(1), 4, 7, None);
        assert!(matches!(tiny, Err(DataError::TooSmall { split: "valid", .. })));
    }

    #[test]
    fn blending_keeps_every_prefix_within_a_sample_of_its_share() {
        let picks = blending_indices(&[0.25, 0.75], 40);
        assert_eq!(picks.part[0], 1);
        for k in 1..=40 {
            let from_b = picks.part[..k].iter().filter(|&&p| p == 1).count() as f64;
            assert!((from_b - 0.75 * k as f64).abs() <= 1.0, "after {k}: {from_b} from the second");
        }
        // Each part's samples are taken in order.
        let b: Vec<u32> = (0..40).filter(|&i| picks.part[i] == 1).map(|i| picks.sample[i]).collect();
        assert_eq!(b, (0..b.len() as u32).collect::<Vec<_>>());
    }
}
