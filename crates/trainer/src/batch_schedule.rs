//! The global batch size as training goes on: constant, Megatron's `--rampup-batch-size START
//! INCREMENT SAMPLES` (a linear ramp in equal increments, the older flag) or its
//! `--step-batch-size-schedule "THRESHOLD:SIZE …"` (sizes from token thresholds, the newer
//! one). Both are functions of the samples consumed so far, as Megatron's micro-batch
//! calculators are, so a resumed run takes up the schedule where it stopped.

use anyhow::bail;

#[derive(Clone, Debug, PartialEq)]
pub enum BatchSchedule {
    Constant(u64),
    /// START + ⌊consumed / (SAMPLES / increments)⌋ · INCREMENT up to `global`, which holds once
    /// more than SAMPLES are consumed.
    Rampup {
        start: u64,
        increment: u64,
        samples: u64,
        global: u64,
    },
    /// (first sample, size) pairs, the first at sample 0, thresholds strictly increasing.
    Steps(Vec<(u64, u64)>),
}

impl BatchSchedule {
    /// `--rampup-batch-size START INCREMENT SAMPLES` towards --global-batch-size `global`.
    pub fn rampup(v: &[u64], global: u64) -> anyhow::Result<Self> {
        let &[start, increment, samples] = v else {
            bail!("--rampup-batch-size takes three numbers: START INCREMENT SAMPLES (e.g. 32 32 1000000)");
        };
        if start == 0 || increment == 0 {
            bail!(
                "--rampup-batch-size {start} {increment} {samples}: the start size and the increment must be positive"
            );
        }
        if start >= global || (global - start) % increment != 0 {
            bail!(
                "--rampup-batch-size {start} {increment} {samples}: --global-batch-size {global} must exceed the start size by a multiple of the increment"
            );
        }
        Ok(BatchSchedule::Rampup { start, increment, samples, global })
    }

    /// `--step-batch-size-schedule`: "THRESHOLD:SIZE" entries split by spaces or commas,
    /// thresholds in tokens (as Megatron's trainer passes them; turned into samples of
    /// `seq_length` tokens), numbers with an optional K, M, B or T suffix (10³ … 10¹²).
    pub fn steps(text: &str, seq_length: u64) -> anyhow::Result<Self> {
        let flag = "--step-batch-size-schedule";
        let mut out = vec![];
        for entry in text.replace(',', " ").split_whitespace() {
            let Some((t, b)) = entry.split_once(':') else {
                bail!("{flag} {text:?}: entry {entry:?} is not THRESHOLD:SIZE (e.g. \"0:256 100B:512\")");
            };
            let (t, b) = (number(t), number(b));
            let (Some(t), Some(b)) = (t, b) else {
                bail!("{flag} {text:?}: entry {entry:?} is not two numbers (with an optional K, M, B or T)");
            };
            if b == 0 {
                bail!("{flag} {text:?}: entry {entry:?} has no batch");
            }
            out.push((t / seq_length.max(1), b));
        }
        out.sort_by_key(|e| e.0);
        if out.first().is_none_or(|e| e.0 != 0) {
            bail!("{flag} {text:?}: the first entry's threshold must be 0");
        }
        if out.windows(2).any(|w| w[0].0 == w[1].0) {
            bail!(
                "{flag} {text:?}: two thresholds fall in the same sample of {seq_length} tokens: make them strictly increasing"
            );
        }
        Ok(BatchSchedule::Steps(out))
    }

    /// The global batch of the iteration that starts after `consumed` samples.
    pub fn at(&self, consumed: u64) -> u64 {
        match self {
            BatchSchedule::Constant(b) => *b,
            &BatchSchedule::Rampup { start, increment, samples, global } => {
                if consumed > samples {
                    return global;
                }
                let per_increment = samples as f64 / ((global - start) / increment) as f64;
                (start + (consumed as f64 / per_increment) as u64 * increment).min(global)
            }
            BatchSchedule::Steps(s) => s.iter().take_while(|e| e.0 <= consumed).last().map_or(s[0].1, |e| e.1),
        }
    }

    /// Every size the schedule can take.
    pub fn sizes(&self) -> Vec<u64> {
        match self {
            BatchSchedule::Constant(b) => vec![*b],
            &BatchSchedule::Rampup { start, increment, global, .. } => {
                (start..=global).step_by(increment as usize).collect()
            }
            BatchSchedule::Steps(s) => s.iter().map(|e| e.1).collect(),
        }
    }

    /// Iterations of a run of `train_samples` (Megatron's `update_train_iters`): with a ramp,
    /// its iterations while no more than its samples are consumed, then whole global batches (a
    /// partial last one dropped); with steps, iterations until the samples are reached.
    pub fn train_iters(&self, train_samples: u64) -> u64 {
        let (mut consumed, mut iters) = (0u64, 0u64);
        match self {
            BatchSchedule::Constant(b) => train_samples / b,
            &BatchSchedule::Rampup { samples, global, .. } => {
                while consumed <= samples && consumed <= train_samples {
                    consumed += self.at(consumed);
                    iters += 1;
                }
                iters + train_samples.saturating_sub(consumed) / global
            }
            BatchSchedule::Steps(_) => {
                while consumed < train_samples {
                    consumed += self.at(consumed);
                    iters += 1;
                }
                iters
            }
        }
    }
}

/// "250B" → 250·10⁹ (K, M, B, T suffixes; a decimal before one is allowed: "1.5M").
fn number(s: &str) -> Option<u64> {
    let s = s.trim().to_ascii_uppercase();
    let (digits, scale) = match s.chars().last()? {
        'K' => (&s[..s.len() - 1], 1e3),
        'M' => (&s[..s.len() - 1], 1e6),
        'B' => (&s[..s.len() - 1], 1e9),
        'T' => (&s[..s.len() - 1], 1e12),
        _ => return s.parse().ok(),
    };
    let v: f64 = digits.parse().ok()?;
    (v.is_finite() && v >= 0.0).then_some((v * scale) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A ramp worked by hand from Megatron's formulas: 2 → 6 in increments of 2 over 8 samples
    /// (4 samples an increment).
    #[test]
    fn a_ramp_follows_megatrons_formulas() {
        let r = BatchSchedule::rampup(&[2, 2, 8], 6).unwrap();
        let at: Vec<u64> = [0, 2, 3, 4, 7, 8, 9, 100].iter().map(|&c| r.at(c)).collect();
        assert_eq!(at, [2, 2, 2, 4, 4, 6, 6, 6]);
        // Consumed 0, 2, 4, 8, 14 in the ramp (4 iterations), then (30 − 14) / 6 = 2 more.
        assert_eq!(r.train_iters(30), 6);
        assert_eq!(r.sizes(), [2, 4, 6]);
        // Megatron's docstring example: 16 → 1024 by 8 over 300,000 samples, ≈ 2,381 a step.
        let g = BatchSchedule::rampup(&[16, 8, 300_000], 1024).unwrap();
        assert_eq!((g.at(2380), g.at(2381), g.at(300_000), g.at(300_001)), (16, 24, 1024, 1024));
        for bad in [&[0, 8, 10][..], &[16, 0, 10], &[16, 10, 10], &[1024, 8, 10], &[16, 8]] {
            assert!(BatchSchedule::rampup(bad, 1024).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn steps_read_token_thresholds() {
        let s = BatchSchedule::steps("0:2, 192:4 1K:8", 32).unwrap();
        assert_eq!(s, BatchSchedule::Steps(vec![(0, 2), (6, 4), (31, 8)]));
        let at: Vec<u64> = [0, 5, 6, 30, 31, 1000].iter().map(|&c| s.at(c)).collect();
        assert_eq!(at, [2, 2, 4, 4, 8, 8]);
        // 0 → 6 in 3 iterations of 2, 6 → 34 in 7 of 4 (sample 31 is reached after 34), then
        // one of 8: 42 ≥ 36.
        assert_eq!(s.train_iters(36), 3 + 7 + 1);
        assert_eq!(BatchSchedule::steps("0:768 250B:1536", 4096).unwrap().at(61_035_157), 1536);
        for bad in ["", "64:2", "0:2 x:4", "0:2 10", "0:0", "0:2 1:4"] {
            assert!(BatchSchedule::steps(bad, 32).is_err(), "{bad:?}");
        }
    }
}
