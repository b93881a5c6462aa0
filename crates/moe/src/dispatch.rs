//! Expert-parallel token dispatch (Megatron's all-to-all dispatcher, dropless).
//!
//! With E experts over P expert-parallel ranks, rank q holds experts q·E/P .. (q+1)·E/P. A rank's
//! token copies, sorted by global expert, are contiguous per destination rank:
//!   1. counts: all-to-all of each rank's copies per expert → R[s][e], the rows rank s sends for
//!      this rank's local expert e;
//!   2. rows: all-to-all-v (send: this rank's copies per destination; receive: Σ_e R[s][e] from
//!      each s), arriving ordered (source, local expert);
//!   3. a row gather (`order`) into (local expert, source) order, so each local expert's rows are
//!      contiguous.
//!
//! The way back is the inverse gather and the all-to-all-v with the splits swapped. The backward
//! sends the output gradient out the same way and the input gradient back: the same plan.

use ferrotron_comm::Communicator;
use ferrotron_core::{Device, Result, Tensor, invalid};
use ferrotron_kernels as k;

/// One forward's all-to-all plan, kept for the backward.
pub struct Dispatch {
    /// Rows this rank sends to each rank, and receives from each.
    pub send: Vec<usize>,
    pub recv: Vec<usize>,
    /// Rows of each local expert after the gather.
    pub local_counts: Vec<usize>,
    /// Received row of each (local expert, source)-ordered row, and the inverse.
    order: Tensor,
    inverse: Tensor,
}

impl Dispatch {
    /// The plan for copies counted `counts` per global expert (this rank's), over `ep`.
    pub fn plan(ep: &dyn Communicator, counts: &[usize], device: &Device) -> Result<Dispatch> {
        let p = ep.size();
        let local = counts.len() / p;
        let send: Vec<usize> = counts.chunks(local).map(|c| c.iter().sum()).collect();
        let mine: Vec<f32> = counts.iter().map(|&c| c as f32).collect();
        let got = ep
            .all_to_all_v(&Tensor::from_vec(mine, [p, local], &Device::Cpu)?, &vec![1; p], &vec![1; p])
            .map_err(comm)?;
        // r[s][e]: rows from source s for local expert e.
        let r: Vec<usize> = got.to_vec_f32()?.into_iter().map(|c| c as usize).collect();
        let recv: Vec<usize> = r.chunks(local).map(|c| c.iter().sum()).collect();
        let local_counts: Vec<usize> = (0..local).map(|e| (0..p).map(|s| r[s * local + e]).sum()).collect();
        // Where chunk (s, e) starts in the received rows.
        let mut start = vec![0usize; p * local];
        let mut at = 0;
        for (i, &n) in r.iter().enumerate() {
            start[i] = at;
            at += n;
        }
        let mut order = Vec::with_capacity(at);
        for e in 0..local {
            for s in 0..p {
                order.extend((start[s * local + e]..start[s * local + e] + r[s * local + e]).map(|x| x as u32));
            }
        }
        let mut inverse = vec![0u32; at];
        for (i, &o) in order.iter().enumerate() {
            inverse[o as usize] = i as u32;
        }
        Ok(Dispatch {
            send,
            recv,
            local_counts,
            order: Tensor::from_vec(order, [at], device)?,
            inverse: Tensor::from_vec(inverse, [at], device)?,
        })
    }

    /// The plan as tensors, for a forward's saved values: the splits (host u32: send, recv,
    /// local counts), the order and its inverse.
    pub fn into_tensors(self) -> Result<[Tensor; 3]> {
        let splits: Vec<u32> =
            self.send.iter().chain(&self.recv).chain(&self.local_counts).map(|&x| x as u32).collect();
        let n = splits.len();
        Ok([Tensor::from_vec(splits, [n], &Device::Cpu)?, self.order, self.inverse])
    }

    /// `into_tensors` read back, for `p` ranks.
    pub fn from_tensors(p: usize, [splits, order, inverse]: [Tensor; 3]) -> Result<Dispatch> {
        let v: Vec<usize> = splits.to_vec::<u32>()?.into_iter().map(|x| x as usize).collect();
        if v.len() < 2 * p {
            return Err(invalid("Dispatch::from_tensors", "saved splits do not match the expert-parallel group"));
        }
        Ok(Dispatch {
            send: v[..p].to_vec(),
            recv: v[p..2 * p].to_vec(),
            local_counts: v[2 * p..].to_vec(),
            order,
            inverse,
        })
    }

    /// Rows sorted by global expert (this rank's copies) → the local experts' rows.
    pub fn out(&self, ep: &dyn Communicator, rows: &Tensor) -> Result<Tensor> {
        let got = ep.all_to_all_v(rows, &self.send, &self.recv).map_err(comm)?;
        gather(&self.order, &got)
    }

    /// The local experts' rows → this rank's copies, sorted by global expert.
    pub fn back(&self, ep: &dyn Communicator, rows: &Tensor) -> Result<Tensor> {
        let received = gather(&self.inverse, rows)?;
        ep.all_to_all_v(&received, &self.recv, &self.send).map_err(comm)
    }
}

fn comm(e: ferrotron_comm::CommError) -> ferrotron_core::Error {
    ferrotron_core::Error::External(Box::new(e))
}

/// rows[index] (an empty index gives no rows).
fn gather(index: &Tensor, rows: &Tensor) -> Result<Tensor> {
    if index.elem_count() == 0 {
        let c = rows.dims().last().copied().unwrap_or(0);
        return Tensor::zeros([0, c], rows.dtype(), rows.device());
    }
    k::embedding_fwd(index, rows)
}
