//! Hidden dropout (Megatron's `--hidden-dropout`): on each branch's output before its residual add
//! and on the embedding's output, in training only. The mask's random words are indexed by global
//! sample, position and column from the micro-batch's `Draw`, with one Philox stream per site (a
//! hash of its name, the layer's global index in it), so one rank and any layout (data-parallel
//! ranks, micro-batches, pipeline stages, sequence-parallel shards, context-parallel chunks) draw the same mask for the same
//! sample, the backward and a recomputed forward draw it again, and nothing is saved for it.

use ferrotron_core::rng::fnv1a64;
use ferrotron_core::{Cx, Draw, Result, Tensor, invalid};
use ferrotron_kernels as k;
use ferrotron_parallel::{ContextParallel, TensorParallel};

/// Where a site's random words for a [B, T, width] activation come from: one Philox stream per
/// site, each element's word indexed by its global sample (the micro-batch's `Draw`), position
/// and column, whatever part of each sequence this rank holds. Shared by hidden dropout's masks
/// and the routers' random logits (--moe-router-force-load-balancing).
#[derive(Clone, Debug)]
pub struct TokenKey {
    stream: u64,
    width: usize,
    /// Sequence parallel: (tensor-parallel rank, size), the rows being that share of each
    /// sequence.
    shard: Option<(usize, usize)>,
    /// Context parallelism: the rows are two chunks of each sequence (their words are the whole
    /// sequence's).
    cp: Option<ContextParallel>,
}

impl TokenKey {
    /// The key of `site` (a name, e.g. `decoder.layers.3.mlp.dropout`) for rows `width` wide,
    /// this rank's `shard` of each sequence (sequence parallel), or the whole.
    pub fn new(site: &str, width: usize, shard: Option<(usize, usize)>) -> Self {
        TokenKey { stream: fnv1a64(site), width, shard, cp: None }
    }

    /// The rows are this rank's chunks of each sequence (more than one cp rank).
    pub fn set_context_parallel(&mut self, cp: &ContextParallel) {
        self.cp = (cp.size() > 1).then(|| cp.clone());
    }

    /// The words of an activation of `dims` [B, T (this rank's rows), width] for `draw`.
    pub fn key(&self, what: &'static str, draw: Draw, dims: &[usize]) -> Result<k::DropoutKey> {
        if dims.len() != 3 || dims[2] != self.width {
            return Err(invalid(what, format!("activations {dims:?}, expected [batch, seq, {}]", self.width)));
        }
        let (rank, size) = self.shard.unwrap_or((0, 1));
        let (rows, h) = (dims[1], self.width as u64);
        // This tensor's first row in the rank's sequence, and that sequence's length.
        let (first, held) = (rank * rows, rows * size);
        let (row, offset, split) = match &self.cp {
            None => ((held as u64) * h, first as u64 * h, None),
            Some(cp) => {
                // Rows first.. of the rank's two chunks of c; rows from c on are the second.
                let c = held / 2;
                let split = (first < c && first + rows > c)
                    .then(|| k::DropSplit { at: ((c - first) as u64) * h, offset: cp.position(c, c) as u64 * h });
                ((held * cp.size()) as u64 * h, cp.position(c, first) as u64 * h, split)
            }
        };
        Ok(k::DropoutKey {
            seed: draw.seed,
            stream: self.stream,
            base: draw.first_sample.wrapping_mul(row),
            batch_stride: row,
            offset,
            split,
        })
    }
}

/// One site's dropout: the rate and its words.
#[derive(Clone, Debug)]
pub struct HiddenDropout {
    p: f32,
    key: TokenKey,
}

impl HiddenDropout {
    /// The dropout at `site` (a name, e.g. `decoder.layers.3.mlp.dropout`), or None at rate 0.
    pub fn new(p: f32, site: &str, hidden: usize, tp: &TensorParallel) -> Option<Self> {
        (p > 0.0)
            .then(|| HiddenDropout { p, key: TokenKey::new(site, hidden, tp.sp().then(|| (tp.rank(), tp.size()))) })
    }

    /// Draws the masks of this rank's chunks of each sequence (more than one cp rank).
    pub fn set_context_parallel(&mut self, cp: &ContextParallel) {
        self.key.set_context_parallel(cp);
    }

    /// x [B, T (or this rank's T / tp under sequence parallelism; T this rank's two chunks under
    /// context parallelism), hidden] with the mask applied (the forward, and the backward on dy);
    /// x itself outside training.
    pub fn apply(&self, cx: &Cx, x: &Tensor) -> Result<Tensor> {
        if !cx.training {
            return Ok(x.clone());
        }
        let Some(draw) = cx.draw else {
            return Err(invalid(
                "hidden dropout",
                "a training micro-batch without its sample index: build it with Batch::with_draw (or set --hidden-dropout 0)",
            ));
        };
        k::dropout(x, self.p, &self.key.key("hidden dropout", draw, x.dims())?)
    }
}

/// `d.apply` where there is a dropout, else x.
pub fn maybe(d: &Option<HiddenDropout>, cx: &Cx, x: Tensor) -> Result<Tensor> {
    match d {
        Some(d) => d.apply(cx, &x),
        None => Ok(x),
    }
}
