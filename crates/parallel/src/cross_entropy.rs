//! Vocabulary-parallel cross-entropy over logits split along the vocabulary: [N, V/tp] per rank.
//!
//! Each rank computes its shard's lse and `lse − logit[target]` (target logit 0 when another
//! shard holds it); the group exchanges those 2·N numbers and every rank combines them, in rank
//! order, into the whole-vocabulary loss: lse = log Σ_r exp(lse_r), loss = lse − logit[target].
//! Padding columns (past the real vocabulary) are outside the softmax, so the padding that makes
//! the vocabulary divide the group changes nothing. The backward needs no communication: the
//! softmax of each shard against the whole lse, minus the one-hot where the shard holds it.

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
    let all = all.to_vec_f32()?;
    let m: Vec<f32> = match mask {
        Some(m) => m.to_vec_f32()?,
        None => vec![1.0; rows],
    };
    let (mut out_loss, mut out_lse) = (vec![0f32; rows], vec![0f32; rows]);
    for i in 0..rows {
        let shard = |r: usize| (all[r * 2 * rows + i] as f64, all[r * 2 * rows + rows + i] as f64);
        let top = (0..n).map(|r| shard(r).0).fold(f64::NEG_INFINITY, f64::max);
        let (mut z, mut mx) = (0.0, 0.0);
        for r in 0..n {
            let (lse_r, loss_r) = shard(r);
            if lse_r.is_finite() {
                z += (lse_r - top).exp();
                mx += m[i] as f64 * lse_r - loss_r; // = m·logit[target] from the shard holding it
            }
        }
        let lse = top + z.ln();
        out_lse[i] = lse as f32;
        out_loss[i] = if m[i] == 0.0 { 0.0 } else { (m[i] as f64 * lse - mx) as f32 };
    }
    let dev = logits.device();
    Ok((Tensor::from_f32(&out_loss, [rows], DType::F32, dev)?, Tensor::from_f32(&out_lse, [rows], DType::F32, dev)?))
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
