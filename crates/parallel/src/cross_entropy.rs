//! Vocabulary-parallel cross-entropy over logits split along the vocabulary: [N, V/tp] per rank.
//!
//! Each rank computes its shard's lse and `lse − logit[target]` (target logit 0 when another
//! shard holds it); the group exchanges those 2·N numbers and every rank combines them, in rank
//! order, into the whole-vocabulary loss (`ferrotron_kernels::ce_combine_shards`, on the logits'
//! device): lse = log Σ_r exp(lse_r), loss = lse − logit[target].
//! Padding columns (past the real vocabulary) are outside the softmax, so the padding that makes
//! the vocabulary divide the group changes nothing. The backward needs no communication: the
//! softmax of each shard against the whole lse, minus the one-hot where the shard holds it.
//! On one rank the forward can take the backward along (`vocab_parallel_ce_fwd_bwd_`): one pass
//! over the logits, the gradient written over them.

use crate::comm_err;
use crate::tp::TensorParallel;
use ferrotron_core::{DType, Result, Tensor};
use ferrotron_kernels::{self as k, CrossEntropyCfg};

/// Where this rank's logits sit in the vocabulary.
#[derive(Clone, Copy, Debug)]
pub struct VocabParallelCe {
    pub vocab_size: usize,
    pub padded_vocab_size: usize,
}

impl VocabParallelCe {
    fn cfg(&self, tp: &TensorParallel) -> CrossEntropyCfg {
        CrossEntropyCfg {
            ignore_index: None,
            vocab_start: (tp.rank() * self.padded_vocab_size / tp.size()) as u32,
            vocab_total: Some(self.vocab_size as u32),
        }
    }
}

/// (loss [N], lse [N]) over the whole vocabulary, identical on every rank of the group.
pub fn vocab_parallel_ce_fwd(
    v: VocabParallelCe,
    tp: &TensorParallel,
    logits: &Tensor,
    targets: &Tensor,
    mask: Option<&Tensor>,
) -> Result<(Tensor, Tensor)> {
    let (loss, lse) = k::cross_entropy_fwd(logits, targets, mask, v.cfg(tp))?;
    let n = tp.size();
    if n == 1 {
        return Ok((loss, lse));
    }
    let rows = loss.elem_count();
    let mine = Tensor::zeros([2, rows], DType::F32, logits.device())?;
    k::copy_(&mine.view(0, [rows])?, &lse)?;
    k::copy_(&mine.view(rows, [rows])?, &loss)?;
    let all = Tensor::zeros([n, 2, rows], DType::F32, logits.device())?;
    tp.comm.all_gather(&mine, &all).map_err(comm_err)?;
    // Combined where the logits are (on a GPU, no read-back inside the step).
    k::ce_combine_shards(&all, mask)
}

/// dlogits [N, V/tp] for this rank's shard, from the whole lse the forward returned.
pub fn vocab_parallel_ce_bwd(
    v: VocabParallelCe,
    tp: &TensorParallel,
    logits: &Tensor,
    targets: &Tensor,
    mask: Option<&Tensor>,
    lse: &Tensor,
    dloss: &Tensor,
) -> Result<Tensor> {
    k::cross_entropy_bwd(logits, targets, mask, lse, dloss, v.cfg(tp))
}

/// The forward and the backward in one pass over the logits on a group of one rank (a shard's
/// gradient needs the whole lse, known only after the combine): (loss [N], lse [N]) as
/// [`vocab_parallel_ce_fwd`], and `logits` overwritten with dlogits for dloss = `dscale` on every
/// row (`k::cross_entropy_fwd_bwd_`). `None`, touching nothing, on a larger group.
pub fn vocab_parallel_ce_fwd_bwd_(
    v: VocabParallelCe,
    tp: &TensorParallel,
    logits: &Tensor,
    targets: &Tensor,
    mask: Option<&Tensor>,
    dscale: k::RowScale,
) -> Result<Option<(Tensor, Tensor)>> {
    if tp.size() != 1 {
        return Ok(None);
    }
    k::cross_entropy_fwd_bwd_(logits, targets, mask, v.cfg(tp), dscale).map(Some)
}
