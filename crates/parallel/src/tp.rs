//! Tensor- and sequence-parallel region mappings (Megatron's mappings.py), each a forward and the
//! backward it implies.
//!
//! Activations are [B, T, ...]. Without sequence parallelism they are whole on every rank of the
//! tensor-parallel group; with it, outside the tensor-parallel regions each rank holds
//! [B, T/tp, ...], its slice of every sequence (Megatron's layout is sequence-first, [T, B, ...];
//! the split is the same, along T).
//!
//! | region entry (column linear)  | fwd                  | bwd                    |
//! |-------------------------------|----------------------|------------------------|
//! | no SP: copy_to_tp             | identity             | all-reduce             |
//! | SP: gather_from_sp            | all-gather along T   | reduce-scatter along T |
//! | region exit (row linear)      |                      |                        |
//! | no SP: reduce_from_tp         | all-reduce           | identity               |
//! | SP: reduce_scatter_to_sp      | reduce-scatter on T  | all-gather along T     |
//!
//! `partial` (`TensorParallel::partial`): the same split with every entry and exit the identity,
//! for layers whose caller combines their partial sums itself, once for many of them (Megatron's
//! MoE experts: one reduction after the combine, not one per expert). A row-parallel linear's
//! bias is then added on rank 0 only, so that the caller's sum holds it once.

use crate::comm_err;
use crate::groups::Comm;
use ferrotron_comm::ReduceOp;
use ferrotron_core::{Result, Tensor, invalid, shape_mismatch};

#[derive(Clone)]
pub struct TensorParallel {
    pub comm: Comm,
    pub sequence_parallel: bool,
    /// Entries and exits left to the caller (no sequence parallelism then).
    partial: bool,
}

impl std::fmt::Debug for TensorParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let partial = if self.partial { ", partial sums" } else { "" };
        write!(f, "TensorParallel({}, sp={}{partial})", self.comm.name(), self.sequence_parallel)
    }
}

impl TensorParallel {
    pub fn new(comm: Comm, sequence_parallel: bool) -> Self {
        TensorParallel { comm, sequence_parallel, partial: false }
    }
    /// The group's split with the region mappings left to the caller: a column linear's input
    /// gradient and a row linear's output stay this rank's partial sums.
    pub fn partial(comm: Comm) -> Self {
        TensorParallel { comm, sequence_parallel: false, partial: true }
    }
    /// Whether a row-parallel linear adds its bias here: on every rank after the reduction, or
    /// with partial sums on rank 0 only.
    pub fn adds_bias(&self) -> bool {
        !self.partial || self.rank() == 0
    }
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }
    pub fn size(&self) -> usize {
        self.comm.size()
    }
    /// Sequence parallelism that actually splits (off at size 1).
    pub fn sp(&self) -> bool {
        self.sequence_parallel && self.size() > 1
    }

    /// Sum over the group, in place (no-op alone).
    pub fn all_reduce(&self, t: &Tensor) -> Result<()> {
        if self.size() == 1 {
            return Ok(());
        }
        self.comm.all_reduce(t, ReduceOp::Sum).map_err(comm_err)
    }

    /// [B, T, C...] → [B, T/tp, C...] view shape pieces: (b, t, rest).
    fn btc(&self, op: &'static str, x: &Tensor) -> Result<(usize, usize, Vec<usize>)> {
        let d = x.dims();
        if d.len() < 2 {
            return Err(shape_mismatch(op, "[batch, seq, ...]", d));
        }
        Ok((d[0], d[1], d[2..].to_vec()))
    }

    fn dims(b: usize, mid: &[usize], rest: &[usize]) -> Vec<usize> {
        let mut v = vec![b];
        v.extend_from_slice(mid);
        v.extend_from_slice(rest);
        v
    }

    /// All-gather along T: [B, T/tp, C] on each rank → [B, T, C], rank r's slice at r·T/tp.
    pub fn gather_seq(&self, x: &Tensor) -> Result<Tensor> {
        let n = self.size();
        if n == 1 {
            return Ok(x.clone());
        }
        let (b, tl, rest) = self.btc("gather_seq", x)?;
        // The collective writes every element of its output: no memset first.
        let buf = Tensor::empty(Self::dims(n, &[b, tl], &rest), x.dtype(), x.device())?;
        self.comm.all_gather(&x.contiguous()?, &buf).map_err(comm_err)?;
        buf.transpose(0, 1)?.contiguous()?.reshape(Self::dims(b, &[n * tl], &rest))
    }

    /// Reduce-scatter along T: [B, T, C] partial sums → this rank's [B, T/tp, C] of the sum.
    pub fn reduce_scatter_seq(&self, x: &Tensor) -> Result<Tensor> {
        let n = self.size();
        if n == 1 {
            return Ok(x.clone());
        }
        let (b, t, rest) = self.btc("reduce_scatter_seq", x)?;
        let tl = self.shard_len(t)?;
        let staged = x.contiguous()?.reshape(Self::dims(b, &[n, tl], &rest))?.transpose(0, 1)?.contiguous()?;
        let out = Tensor::empty(Self::dims(b, &[tl], &rest), x.dtype(), x.device())?;
        self.comm.reduce_scatter(&staged, &out, ReduceOp::Sum).map_err(comm_err)?;
        Ok(out)
    }

    /// This rank's slice along T (no communication): [B, T, C] → [B, T/tp, C].
    pub fn split_seq(&self, x: &Tensor) -> Result<Tensor> {
        let n = self.size();
        if n == 1 {
            return Ok(x.clone());
        }
        let (b, t, rest) = self.btc("split_seq", x)?;
        let tl = self.shard_len(t)?;
        let all = x.contiguous()?.reshape(Self::dims(b, &[n, tl], &rest))?.transpose(0, 1)?.contiguous()?;
        all.narrow0(self.rank()..self.rank() + 1)?.reshape(Self::dims(b, &[tl], &rest))
    }

    /// T / tp, or an error naming the sequence length.
    pub fn shard_len(&self, t: usize) -> Result<usize> {
        if t % self.size() != 0 {
            return Err(invalid(
                "sequence parallel",
                format!(
                    "sequence length {t} is not divisible by --tensor-model-parallel-size {}: change --seq-length or turn off --sequence-parallel",
                    self.size()
                ),
            ));
        }
        Ok(t / self.size())
    }

    /// All-gather along the last dim: [..., C/tp] → [..., C].
    pub fn gather_last(&self, x: &Tensor) -> Result<Tensor> {
        let n = self.size();
        if n == 1 {
            return Ok(x.clone());
        }
        let c = x.shape().last();
        let rows = x.elem_count() / c.max(1);
        let buf = Tensor::empty([n, rows, c], x.dtype(), x.device())?;
        self.comm.all_gather(&x.contiguous()?, &buf).map_err(comm_err)?;
        let mut dims = x.dims().to_vec();
        *dims.last_mut().unwrap_or(&mut 0) = n * c;
        buf.transpose(0, 1)?.contiguous()?.reshape(dims)
    }

    /// This rank's slice of the last dim: [..., C] → [..., C/tp].
    pub fn split_last(&self, x: &Tensor) -> Result<Tensor> {
        let n = self.size();
        if n == 1 {
            return Ok(x.clone());
        }
        let c = x.shape().last();
        if c % n != 0 {
            return Err(shape_mismatch("split_last", format!("last dim divisible by {n}"), x.dims()));
        }
        let rows = x.elem_count() / c;
        let all = x.contiguous()?.reshape([rows, n, c / n])?.transpose(0, 1)?.contiguous()?;
        let mut dims = x.dims().to_vec();
        *dims.last_mut().unwrap_or(&mut 0) = c / n;
        all.narrow0(self.rank()..self.rank() + 1)?.reshape(dims)
    }

    /// Entering a tensor-parallel region (column linear input).
    pub fn enter(&self, x: &Tensor) -> Result<Tensor> {
        if self.sp() { self.gather_seq(x) } else { Ok(x.clone()) }
    }
    /// Backward of `enter`: gradients of the replicated input are summed over the group.
    pub fn enter_bwd(&self, dx: &Tensor) -> Result<Tensor> {
        if self.partial {
            Ok(dx.clone())
        } else if self.sp() {
            self.reduce_scatter_seq(dx)
        } else {
            self.all_reduce(dx)?;
            Ok(dx.clone())
        }
    }
    /// Leaving a tensor-parallel region (row linear output): partial sums combined.
    pub fn exit(&self, y: &Tensor) -> Result<Tensor> {
        if self.partial {
            Ok(y.clone())
        } else if self.sp() {
            self.reduce_scatter_seq(y)
        } else {
            self.all_reduce(y)?;
            Ok(y.clone())
        }
    }
    /// Backward of `exit`.
    pub fn exit_bwd(&self, dy: &Tensor) -> Result<Tensor> {
        if self.sp() { self.gather_seq(dy) } else { Ok(dy.clone()) }
    }
}
