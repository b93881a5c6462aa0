//! Megatron's cyclic sampler (`--dataloader-type cyclic`, MegatronPretrainingRandomSampler): each
//! epoch over a split's samples a fresh permutation, drawn by `torch.randperm` on a CPU generator
//! seeded with the epoch number, handed out one micro-batch per data-parallel rank at a time.
//!
//! With data sharding (Megatron's default) rank r owns the bucket of samples
//! r·B .. (r + 1)·B, B = ⌊total / (mbs·dp)⌋·mbs, and reads it in the order of randperm(B); without,
//! every rank reads randperm(⌊total / mbs⌋·mbs) strided by dp from its rank. An epoch is
//! total − (total mod mbs·dp) samples: the partial last global micro-batch is dropped. Where a
//! micro-batch lies follows from the samples consumed before it alone, so a resumed run reads on
//! where it stopped, as Megatron's does. (Without sharding, where dp does not divide the bucket's
//! tail, Megatron's ranks run out of an epoch at different steps and fall out of step; here each
//! micro-batch is placed by the samples consumed, so every rank turns the epoch together.)

use crate::DataError;
use rand_mt::Mt;
use std::sync::Mutex;

/// `torch.randperm(n, generator=torch.Generator().manual_seed(seed))` on the CPU: Fisher–Yates
/// from the front, element i swapped with i + (draw mod (n − i)), the draws MT19937's 32-bit
/// outputs from `init_genrand(seed mod 2³²)` (PyTorch's CPU generator). The oracle is PyTorch
/// itself (tests/fixtures/torch_randperm.json).
pub fn torch_randperm(n: usize, seed: u64) -> Vec<usize> {
    let mut mt = Mt::new(seed as u32);
    let mut p: Vec<usize> = (0..n).collect();
    for i in 0..n.saturating_sub(1) {
        let z = mt.next_u32() as usize % (n - i);
        p.swap(i, i + z);
    }
    p
}

/// One split's cyclic sampler (see the module doc).
#[derive(Debug)]
pub struct CyclicSampler {
    total: usize,
    micro_batch: usize,
    dp: usize,
    sharding: bool,
    /// The last epoch's permutation: (epoch, order).
    order: Mutex<Option<(u64, Vec<usize>)>>,
}

impl CyclicSampler {
    /// The sampler of a split of `total` samples for micro-batches of `micro_batch` on `dp`
    /// data-parallel ranks; an error names a split too small for one global micro-batch.
    pub fn new(split: &str, total: usize, micro_batch: usize, dp: usize, sharding: bool) -> Result<Self, DataError> {
        if micro_batch == 0 || dp == 0 || total < micro_batch * dp {
            return Err(DataError::Sampler(format!(
                "the {split} split's {total} samples do not fill one micro-batch of {micro_batch} on each of {dp} data-parallel ranks; use more data or a smaller --micro-batch-size"
            )));
        }
        Ok(CyclicSampler { total, micro_batch, dp, sharding, order: Mutex::new(None) })
    }

    /// Samples in an epoch: the whole global micro-batches.
    pub fn epoch_len(&self) -> u64 {
        (self.total - self.total % (self.micro_batch * self.dp)) as u64
    }

    /// The sample indices of data-parallel rank `rank`'s micro-batch taken after `consumed`
    /// samples (a multiple of micro-batch × dp, as the sampler hands them out).
    pub fn micro_batch(&self, consumed: u64, rank: usize) -> Result<Vec<usize>, DataError> {
        let global = (self.micro_batch * self.dp) as u64;
        if consumed % global != 0 || rank >= self.dp {
            return Err(DataError::Sampler(format!(
                "a micro-batch after {consumed} samples for rank {rank} of {} (micro-batches of {} a rank): the samples consumed must be whole global micro-batches",
                self.dp, self.micro_batch
            )));
        }
        let active = self.epoch_len();
        let (epoch, within) = (consumed / active, (consumed % active) as usize);
        let mb = self.micro_batch;
        if self.sharding {
            let bucket = self.total / (mb * self.dp) * mb;
            let first = within / self.dp;
            Ok(self.with_order(epoch, bucket, |o| o[first..first + mb].iter().map(|&i| rank * bucket + i).collect()))
        } else {
            let (full, dp) = (self.total / mb * mb, self.dp);
            Ok(self.with_order(epoch, full, |o| (0..mb).map(|i| o[within + rank + dp * i]).collect()))
        }
    }

    /// `f` of randperm(n) of `epoch`, drawn once an epoch.
    fn with_order<T>(&self, epoch: u64, n: usize, f: impl FnOnce(&[usize]) -> T) -> T {
        let mut cached = self.order.lock().unwrap_or_else(|e| e.into_inner());
        if cached.as_ref().is_none_or(|(e, o)| *e != epoch || o.len() != n) {
            *cached = Some((epoch, torch_randperm(n, epoch)));
        }
        f(cached.as_ref().map_or(&[], |(_, o)| o))
    }
}
