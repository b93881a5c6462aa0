//! The RNG tracker: Philox streams for dropout and other randomness, chosen so that results do
//! not depend on the layout. Data replicated across the tensor-parallel group (activations
//! outside the TP regions) draws from a stream shared by the group; data split across it (inside
//! the regions, e.g. attention probabilities of this rank's heads) draws from a stream distinct
//! per tensor-parallel rank, as Megatron's `model-parallel-rng` does.

use ferrotron_core::rng::{Philox, fnv1a64};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RngStream {
    /// Same on every tensor-parallel rank (and distinct per pipeline stage/layer by name).
    Shared,
    /// Distinct per tensor-parallel rank.
    TensorParallel,
}

#[derive(Clone, Copy, Debug)]
pub struct RngTracker {
    pub seed: u64,
    pub tp_rank: usize,
}

impl RngTracker {
    /// Megatron offsets the model-parallel seed by 2718 plus the tensor-parallel rank.
    const TP_OFFSET: u64 = 2718;

    pub fn new(seed: u64, tp_rank: usize) -> Self {
        RngTracker { seed, tp_rank }
    }

    /// The generator for `site` (e.g. `decoder.layers.3.attention.dropout`) in `stream`.
    pub fn philox(&self, stream: RngStream, site: &str) -> Philox {
        let seed = match stream {
            RngStream::Shared => self.seed,
            RngStream::TensorParallel => self.seed.wrapping_add(Self::TP_OFFSET + self.tp_rank as u64),
        };
        Philox::new(seed).with_stream(fnv1a64(site))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_streams_agree_and_tp_streams_differ_across_ranks() {
        let draw = |t: RngTracker, s| {
            let mut v = [0f32; 8];
            t.philox(s, "layer.0.dropout").fill_uniform(0, &mut v);
            v
        };
        let (a, b) = (RngTracker::new(7, 0), RngTracker::new(7, 1));
        assert_eq!(draw(a, RngStream::Shared), draw(b, RngStream::Shared));
        assert_ne!(draw(a, RngStream::TensorParallel), draw(b, RngStream::TensorParallel));
        assert_ne!(draw(a, RngStream::Shared), draw(a, RngStream::TensorParallel));
        assert_ne!(draw(a, RngStream::Shared), draw(RngTracker::new(8, 0), RngStream::Shared));
    }
}
