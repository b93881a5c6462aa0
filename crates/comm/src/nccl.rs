//! NCCL communicator: one process per GPU, the unique id handed out by the TCP rendezvous.
//! Collectives run on the rank's compute stream for now, so they are ordered with the kernels
//! around them (overlap on the communication stream comes with the data-parallel work).

use crate::{CommError, Communicator, DistEnv, ReduceOp, Result, rendezvous};
use cudarc::nccl::safe::{Comm, Id, ReduceOp as NcclOp};
use ferrotron_core::cuda::{CudaDevice, CudaStorage};
use ferrotron_core::{Device, Error, Storage, Tensor};
use std::time::Duration;

pub struct NcclComm {
    comm: Comm,
    rank: usize,
    size: usize,
}

// SAFETY: a NCCL communicator may be used from any thread as long as calls are not concurrent;
// Ferrotron calls each communicator from its one rank thread.
unsafe impl Send for NcclComm {}
unsafe impl Sync for NcclComm {}

fn nccl_err(op: &'static str, e: impl std::fmt::Debug) -> CommError {
    CommError::Nccl { op, msg: format!("{e:?}") }
}

impl NcclComm {
    /// Joins the world described by `env` on `dev`.
    pub fn new(dev: &CudaDevice, env: &DistEnv, timeout: Duration) -> Result<Self> {
        // SAFETY: only probes for the shared library.
        if !unsafe { cudarc::nccl::sys::is_culib_present() } {
            return Err(CommError::Nccl {
                op: "init",
                msg: "the NCCL library (libnccl.so.2) was not found: add its folder (e.g. PyTorch's nvidia/nccl/lib) to LD_LIBRARY_PATH".into(),
            });
        }
        let bytes = rendezvous(
            env,
            || {
                let id = Id::new().map_err(|e| nccl_err("get unique id", e))?;
                Ok(id.internal().iter().map(|&c| c as u8).collect())
            },
            timeout,
        )?;
        let mut raw = [0 as std::ffi::c_char; 128];
        if bytes.len() != raw.len() {
            return Err(CommError::Nccl {
                op: "init",
                msg: format!("unique id of {} bytes, expected 128", bytes.len()),
            });
        }
        for (r, b) in raw.iter_mut().zip(&bytes) {
            *r = *b as std::ffi::c_char;
        }
        let comm = Comm::from_rank(dev.stream().clone(), env.rank, env.world_size, Id::uninit(raw))
            .map_err(|e| nccl_err("init", e))?;
        Ok(NcclComm { comm, rank: env.rank, size: env.world_size })
    }
}

fn cuda_view(op: &'static str, t: &Tensor) -> Result<std::ops::Range<usize>> {
    if !matches!(t.device(), Device::Cuda(_)) {
        return Err(Error::DeviceMismatch { op, a: "cuda".into(), b: t.device().name() }.into());
    }
    Ok(t.layout().contiguous_range().ok_or(Error::NotContiguous { op })?)
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }

    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<()> {
        const OP: &str = "all_reduce";
        let r = cuda_view(OP, t)?;
        let op = match op {
            ReduceOp::Sum => NcclOp::Sum,
            ReduceOp::Avg => NcclOp::Avg,
            ReduceOp::Max => NcclOp::Max,
            ReduceOp::Min => NcclOp::Min,
        };
        let mut g = t.storage_mut();
        match &mut *g {
            Storage::Cuda(CudaStorage::F32(s)) => self.comm.all_reduce_in_place(&mut s.slice_mut(r), &op),
            Storage::Cuda(CudaStorage::BF16(s)) => self.comm.all_reduce_in_place(&mut s.slice_mut(r), &op),
            _ => return Err(Error::NotImplemented { op: OP, device: format!("NCCL for {}", t.dtype()) }.into()),
        }
        .map(|_| ())
        .map_err(|e| nccl_err(OP, e))
    }

    fn broadcast(&self, t: &Tensor, root: usize) -> Result<()> {
        const OP: &str = "broadcast";
        let r = cuda_view(OP, t)?;
        let mut g = t.storage_mut();
        match &mut *g {
            Storage::Cuda(CudaStorage::F32(s)) => self.comm.broadcast_in_place(&mut s.slice_mut(r), root as i32),
            Storage::Cuda(CudaStorage::BF16(s)) => self.comm.broadcast_in_place(&mut s.slice_mut(r), root as i32),
            _ => return Err(Error::NotImplemented { op: OP, device: format!("NCCL for {}", t.dtype()) }.into()),
        }
        .map(|_| ())
        .map_err(|e| nccl_err(OP, e))
    }
}
