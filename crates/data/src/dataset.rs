//! Token splits and the sampler.
//!
//! A split is one token stream (documents joined by the end-of-document token): generated text
//! held in memory, or a range of an indexed dataset's documents read from its memory map, or a
//! blend of splits by weight. Sample i of a stream is the seq_length + 1 tokens starting at
//! i·seq_length: inputs are the first seq_length, labels the last. The sampler visits samples in
//! a fresh Philox-driven permutation per epoch.

use crate::{DataError, IndexedDataset, Tokenizer};
use ferrotron_core::rng::Philox;
use std::borrow::Cow;
use std::ops::Range;
use std::sync::Arc;

pub struct TokenSplit {
    pub name: &'static str,
    source: Source,
}

enum Source {
    Memory(Vec<u32>),
    /// Tokens `tokens` of the dataset's .bin (a range of whole documents).
    Indexed {
        data: Arc<IndexedDataset>,
        tokens: Range<u64>,
    },
    /// Sample i is sample `picks[i].1` of part `picks[i].0`, for samples of `seq` + 1 tokens.
    Blend {
        seq: usize,
        parts: Vec<TokenSplit>,
        picks: Vec<(u32, u64)>,
    },
}

impl TokenSplit {
    pub fn from_tokens(name: &'static str, tokens: Vec<u32>) -> Self {
        TokenSplit { name, source: Source::Memory(tokens) }
    }

    /// Documents `docs` of an indexed dataset.
    pub fn indexed(name: &'static str, data: Arc<IndexedDataset>, docs: Range<usize>) -> Self {
        let tokens = data.document_tokens(docs);
        TokenSplit { name, source: Source::Indexed { data, tokens } }
    }

    pub fn num_tokens(&self) -> u64 {
        match &self.source {
            Source::Memory(t) => t.len() as u64,
            Source::Indexed { tokens, .. } => tokens.end - tokens.start,
            Source::Blend { parts, .. } => parts.iter().map(|p| p.num_tokens()).sum(),
        }
    }

    pub fn num_samples(&self, seq: usize) -> usize {
        match &self.source {
            Source::Blend { picks, .. } => picks.len(),
            _ => (self.num_tokens().saturating_sub(1) / seq as u64) as usize,
        }
    }

    /// The seq + 1 tokens of sample `i` (below `num_samples(seq)`).
    pub fn sample(&self, i: usize, seq: usize) -> Result<Cow<'_, [u32]>, DataError> {
        match &self.source {
            Source::Memory(t) => Ok(Cow::Borrowed(&t[i * seq..i * seq + seq + 1])),
            Source::Indexed { data, tokens } => {
                let mut out = vec![0u32; seq + 1];
                data.read(tokens.start + (i * seq) as u64, &mut out)?;
                Ok(Cow::Owned(out))
            }
            Source::Blend { seq: built, parts, picks } => {
                if *built != seq {
                    return Err(DataError::BlendSeq { split: self.name, built: *built, asked: seq });
                }
                let (p, j) = picks[i];
                parts[p as usize].sample(j as usize, seq)
            }
        }
    }

    pub fn check(&self, seq: usize) -> Result<(), DataError> {
        if self.num_samples(seq) == 0 {
            return Err(DataError::TooSmall { split: self.name, tokens: self.num_tokens() as usize, seq });
        }
        Ok(())
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

/// An indexed dataset's documents cut into train, valid and test by `weights` (`parse_split`),
/// with Megatron's arithmetic: each boundary rounded (half to even) from the running sum, the
/// rounding's overshoot taken back from every boundary after the first, so the same `--split`
/// gives the same documents in each split as Megatron's.
pub fn split_indexed(data: &Arc<IndexedDataset>, weights: [f64; 3]) -> [TokenSplit; 3] {
    let n = data.num_documents() as i64;
    let mut b = [0i64; 4];
    for k in 0..3 {
        b[k + 1] = b[k] + (weights[k] * n as f64).round_ties_even() as i64;
    }
    let over = b[3] - n;
    for x in &mut b[1..] {
        *x -= over;
    }
    let r = |k: usize| b[k].clamp(0, n) as usize..b[k + 1].clamp(0, n) as usize;
    [
        TokenSplit::indexed("train", data.clone(), r(0)),
        TokenSplit::indexed("valid", data.clone(), r(1)),
        TokenSplit::indexed("test", data.clone(), r(2)),
    ]
}

/// Splits blended by weight for samples of `seq` + 1 tokens: one epoch of the blend has as many
/// samples as its parts together, and sample i comes from the part furthest behind its share
/// (weight · (i + 1) − samples taken so far, the lowest index on a tie: Megatron's blending
/// rule), taking that part's samples in order and from its start again once they run out.
/// A weight of None is the part's number of samples (Megatron's prefixes without weights); parts
/// with no sample drop out, their weight going to the rest. One part is returned as it is.
pub fn blend(name: &'static str, mut parts: Vec<(Option<f64>, TokenSplit)>, seq: usize) -> TokenSplit {
    if parts.len() == 1 {
        if let Some((_, p)) = parts.pop() {
            return p;
        }
    }
    let parts: Vec<(f64, TokenSplit)> = parts
        .into_iter()
        .map(|(w, p)| (w.unwrap_or_else(|| p.num_samples(seq) as f64), p))
        .filter(|(w, p)| *w > 0.0 && p.num_samples(seq) > 0)
        .collect();
    let total: f64 = parts.iter().map(|(w, _)| w).sum();
    let sizes: Vec<u64> = parts.iter().map(|(_, p)| p.num_samples(seq) as u64).collect();
    let n: u64 = sizes.iter().sum();
    let mut taken = vec![0u64; parts.len()];
    let mut picks = Vec::with_capacity(n as usize);
    for i in 0..n {
        let mut best = 0;
        let mut best_err = f64::NEG_INFINITY;
        for (k, (w, _)) in parts.iter().enumerate() {
            let err = w / total * (i + 1) as f64 - taken[k] as f64;
            if err > best_err {
                (best, best_err) = (k, err);
            }
        }
        picks.push((best as u32, taken[best] % sizes[best]));
        taken[best] += 1;
    }
    TokenSplit { name, source: Source::Blend { seq, parts: parts.into_iter().map(|(_, p)| p).collect(), picks } }
}

/// Tokenizes documents and splits them: the last `valid_fraction` of documents is validation.
pub fn split_documents(
    docs: &[String],
    tok: &Tokenizer,
    valid_fraction: f64,
) -> Result<(TokenSplit, TokenSplit), DataError> {
    let n_valid = ((docs.len() as f64 * valid_fraction).ceil() as usize).clamp(1, docs.len().saturating_sub(1).max(1));
    let cut = docs.len() - n_valid;
    let join = |ds: &[String]| -> Result<Vec<u32>, DataError> {
        let mut out = Vec::new();
        for d in ds {
            out.extend(tok.encode(d)?);
            out.push(tok.eod());
        }
        Ok(out)
    };
    Ok((TokenSplit::from_tokens("train", join(&docs[..cut])?), TokenSplit::from_tokens("valid", join(&docs[cut..])?)))
}

/// Deterministic sample order: epoch e is a Fisher–Yates shuffle driven by Philox(seed, stream e).
pub struct Sampler {
    n: usize,
    seed: u64,
    epoch: Option<(u64, Vec<u32>)>,
}

impl Sampler {
    pub fn new(num_samples: usize, seed: u64) -> Self {
        Sampler { n: num_samples, seed, epoch: None }
    }

    /// The sample index visited `consumed` samples into training.
    pub fn index(&mut self, consumed: u64) -> usize {
        let (epoch, pos) = (consumed / self.n as u64, (consumed % self.n as u64) as usize);
        if self.epoch.as_ref().map(|e| e.0) != Some(epoch) {
            let rng = Philox::new(self.seed).with_stream(epoch);
            let mut perm: Vec<u32> = (0..self.n as u32).collect();
            for i in (1..self.n).rev() {
                let j = rng.u32_at(i as u64) as usize % (i + 1);
                perm.swap(i, j);
            }
            self.epoch = Some((epoch, perm));
        }
        self.epoch.as_ref().map_or(pos, |e| e.1[pos] as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampler_is_a_permutation_per_epoch_and_resumable() {
        let mut s = Sampler::new(10, 3);
        let e0: Vec<usize> = (0..10).map(|c| s.index(c)).collect();
        let mut sorted = e0.clone();
        sorted.sort();
        assert_eq!(sorted, (0..10).collect::<Vec<_>>());
        let e1: Vec<usize> = (10..20).map(|c| s.index(c)).collect();
        assert_ne!(e0, e1);
        // A fresh sampler jumping straight to consumed = 13 agrees.
        assert_eq!(Sampler::new(10, 3).index(13), e1[3]);
    }

    #[test]
    fn samples_overlap_by_one_token() {
        let s = TokenSplit::from_tokens("train", (0..21).collect());
        assert_eq!(s.num_samples(4), 5);
        assert_eq!(&*s.sample(1, 4).unwrap(), &[4, 5, 6, 7, 8]);
        assert!(TokenSplit::from_tokens("valid", vec![1, 2]).check(4).is_err());
    }
}
