//! NCCL communicator: one process per GPU, the unique id handed out by the TCP rendezvous; sub-groups
//! through ncclCommSplit. Collectives run on the communicator's own stream, ordered after the
//! compute stream's queued work by an event, with the compute stream waiting on the collective by
//! another (`ordered`). One stream per communicator, as PyTorch gives each process group its own:
//! a tensor-parallel all-reduce the forward waits for does not queue behind a data-parallel
//! gather or reduce left running to overlap (`*_async`).
//!
//! Timeouts: NCCL calls are asynchronous; a rank that never arrives shows up as a kernel that never
//! ends. Every operation is therefore tracked by a `Watchdog` (an event recorded after it on the
//! communicator's stream); past the timeout it aborts every communicator of the process
//! (ncclCommAbort makes the stuck kernels return) and the next call fails with
//! `CommError::Stuck` naming the operation and group.

use crate::{CommError, Communicator, DistEnv, ReduceOp, Result, Watchdog, rendezvous};
use cudarc::driver::CudaStream;
use cudarc::nccl::result;
use cudarc::nccl::sys::{self, ncclDataType_t as NT, ncclRedOp_t as NO};
use ferrotron_core::cuda::CudaDevice;
use ferrotron_core::{DType, Device, Error, Storage, Tensor};
use std::mem::MaybeUninit;
use std::sync::Arc;
use std::time::Duration;

thread_local! {
    /// While this thread is inside `p2p_group` (NCCL groups are per thread, not per comm): the
    /// stream of the communicator that leads it, which every transfer of the batch goes on.
    static P2P_STREAM: std::cell::Cell<Option<sys::cudaStream_t>> = const { std::cell::Cell::new(None) };
}

pub struct NcclComm {
    comm: sys::ncclComm_t,
    dev: CudaDevice,
    /// This communicator's stream: its collectives, in issue order.
    stream: Arc<CudaStream>,
    rank: usize,
    size: usize,
    name: String,
    /// World ranks of the members (for names of sub-groups).
    members: Vec<usize>,
    /// Shared with every communicator split from the same world.
    watchdog: Watchdog,
    /// This communicator's abort hook in the watchdog.
    hook: u64,
}

/// A communicator handle the watchdog thread may abort.
struct AbortHandle(sys::ncclComm_t);
// SAFETY: ncclCommAbort is documented as callable from another thread to end a hung communicator.
unsafe impl Send for AbortHandle {}

impl AbortHandle {
    fn abort(&self) {
        // SAFETY: a live handle; after this the communicator is freed and `Drop` skips it.
        unsafe {
            let _ = result::comm_abort(self.0);
        }
    }
}

// SAFETY: a NCCL communicator may be used from any thread as long as calls are not concurrent;
// Ferrotron calls each communicator from one thread at a time.
unsafe impl Send for NcclComm {}
unsafe impl Sync for NcclComm {}

impl Drop for NcclComm {
    fn drop(&mut self) {
        // After this the watchdog can no longer abort it; if it already did, NCCL freed it.
        self.watchdog.forget(self.hook);
        if self.watchdog.aborted() {
            return;
        }
        // SAFETY: the handle came from ncclCommInitRank/ncclCommSplit and is dropped once.
        unsafe {
            let _ = result::comm_destroy(self.comm);
        }
    }
}

fn nccl_err(op: &'static str, e: impl std::fmt::Debug) -> CommError {
    CommError::Nccl { op, msg: format!("{e:?}") }
}

/// (device address of the first element, element count, NCCL type) of a contiguous CUDA tensor.
fn buf(op: &'static str, t: &Tensor, reduce: bool) -> Result<(u64, usize, NT)> {
    let Device::Cuda(d) = t.device() else {
        return Err(Error::DeviceMismatch { op, a: "cuda".into(), b: t.device().name() }.into());
    };
    let r = t.layout().contiguous_range().ok_or(Error::NotContiguous { op })?;
    let g = t.storage();
    let Storage::Cuda(c) = &*g else { return Err(Error::NotContiguous { op }.into()) };
    let es = t.dtype().size_in_bytes();
    let ty = match t.dtype() {
        DType::F32 => NT::ncclFloat32,
        DType::BF16 => NT::ncclBfloat16,
        DType::F16 => NT::ncclFloat16,
        DType::U32 => NT::ncclUint32,
        DType::F8E4M3 | DType::F8E5M2 if !reduce => NT::ncclUint8,
        dt => return Err(Error::NotImplemented { op, device: format!("NCCL reductions in {dt}") }.into()),
    };
    Ok((c.raw_ptr(d) + (r.start * es) as u64, r.len(), ty))
}

/// Copies the device result `d` back into the host tensor `host`.
fn unstage(host: &Tensor, d: &Tensor) -> Result<()> {
    Ok(host.copy_from_bytes(&d.to_bytes()?)?)
}

fn red(op: ReduceOp) -> NO {
    match op {
        ReduceOp::Sum => NO::ncclSum,
        ReduceOp::Avg => NO::ncclAvg,
        ReduceOp::Max => NO::ncclMax,
        ReduceOp::Min => NO::ncclMin,
    }
}

impl NcclComm {
    /// Joins the world described by `env` on `dev`.
    pub fn new(dev: &CudaDevice, env: &DistEnv, timeout: Duration) -> Result<Self> {
        // SAFETY: only probes for the shared library.
        if !unsafe { sys::is_culib_present() } {
            return Err(CommError::Nccl {
                op: "init",
                msg: "the NCCL library (libnccl.so.2) was not found: add its folder (e.g. PyTorch's nvidia/nccl/lib) to LD_LIBRARY_PATH".into(),
            });
        }
        let bytes = rendezvous(
            env,
            || {
                let id = result::get_uniqueid().map_err(|e| nccl_err("get unique id", e))?;
                Ok(id.internal.iter().map(|&c| c as u8).collect())
            },
            timeout,
        )?;
        let mut id = sys::ncclUniqueId { internal: [0; 128] };
        if bytes.len() != id.internal.len() {
            return Err(CommError::Nccl {
                op: "init",
                msg: format!("unique id of {} bytes, expected 128", bytes.len()),
            });
        }
        for (r, b) in id.internal.iter_mut().zip(&bytes) {
            *r = *b as std::ffi::c_char;
        }
        dev.context().bind_to_thread().map_err(|e| nccl_err("init", e))?;
        let mut comm = MaybeUninit::uninit();
        // SAFETY: `comm` is written by NCCL on success.
        let comm = unsafe {
            result::comm_init_rank(comm.as_mut_ptr(), env.world_size as i32, id, env.rank as i32)
                .map_err(|e| nccl_err("init", e))?;
            comm.assume_init()
        };
        let members = (0..env.world_size).collect::<Vec<_>>();
        let stream = dev.context().new_stream().map_err(|e| nccl_err("init", e))?;
        let watchdog = Watchdog::new(timeout, Duration::from_millis(100));
        let h = AbortHandle(comm);
        let hook = watchdog.on_timeout(move || h.abort());
        Ok(NcclComm {
            comm,
            dev: dev.clone(),
            stream,
            rank: env.rank,
            size: env.world_size,
            name: format!("world{members:?}"),
            members,
            watchdog,
            hook,
        })
    }

    /// Enqueues `f`'s NCCL work on this communicator's stream, after everything the compute
    /// stream has queued so far (an event), and makes the compute stream wait for it (another
    /// event): kernels before and after see the collective in order, while other work already
    /// queued on the compute stream is not held up by it.
    fn ordered<R>(&self, op: &'static str, f: impl FnOnce(sys::cudaStream_t) -> Result<R>) -> Result<R> {
        let (compute, comm) = (self.dev.stream(), &self.stream);
        if let Some(lead) = P2P_STREAM.get() {
            // Inside `p2p_group`, which fences (and watches) the whole batch once, on its
            // leader's stream.
            return f(lead);
        }
        self.watchdog.check()?;
        comm.join(compute).map_err(|e| nccl_err(op, e))?;
        let r = f(comm.cu_stream() as _);
        self.watch(op)?;
        compute.join(comm).map_err(|e| nccl_err(op, e))?;
        r
    }

    /// Hands the operation just enqueued on this communicator's stream to the watchdog.
    fn watch(&self, op: &'static str) -> Result<()> {
        let flags = cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING;
        let ev = self.stream.record_event(Some(flags)).map_err(|e| nccl_err(op, e))?;
        let ctx = self.dev.context().clone();
        self.watchdog.track(op, &self.name, move || ctx.bind_to_thread().is_ok() && ev.is_complete());
        Ok(())
    }

    /// A device copy of `t` (contiguous).
    fn on_device(&self, t: &Tensor) -> Result<Tensor> {
        Ok(t.contiguous()?.to_device(&Device::Cuda(self.dev.clone()))?)
    }

    /// Host tensors (small control values: losses, norms, layout checks) travel through a device
    /// copy: Some(copy) when `t` is on the host.
    fn staged(&self, t: &Tensor) -> Result<Option<Tensor>> {
        if !t.device().is_cpu() {
            return Ok(None);
        }
        if P2P_STREAM.get().is_some() {
            // Inside a group the transfer only starts at its end: a staged copy could not be
            // read back in time.
            let msg = "host tensors cannot travel in a grouped send/recv: put them on the GPU".into();
            return Err(self.invalid("grouped send/recv", msg));
        }
        self.on_device(t).map(Some)
    }

    /// `ordered` without the compute stream's wait (see `Communicator::all_reduce_async`).
    fn detached<R>(&self, op: &'static str, f: impl FnOnce(sys::cudaStream_t) -> Result<R>) -> Result<R> {
        let (compute, comm) = (self.dev.stream(), &self.stream);
        self.watchdog.check()?;
        comm.join(compute).map_err(|e| nccl_err(op, e))?;
        let r = f(comm.cu_stream() as _);
        self.watch(op)?;
        r
    }

    /// Enqueues `f` after the compute stream's work; with `wait` the compute stream waits for it.
    fn fenced(&self, op: &'static str, wait: bool, f: impl FnOnce(sys::cudaStream_t) -> Result<()>) -> Result<()> {
        if wait { self.ordered(op, f) } else { self.detached(op, f) }
    }

    fn all_reduce_on(&self, t: &Tensor, op: ReduceOp, wait: bool) -> Result<()> {
        let (p, n, ty) = buf("all_reduce", t, true)?;
        self.fenced("all_reduce", wait, |s| {
            // SAFETY: in place on a live device buffer of n elements.
            unsafe { result::all_reduce(p as _, p as _, n, ty, red(op), self.comm, s) }
                .map(|_| ())
                .map_err(|e| nccl_err("all_reduce", e))
        })
    }

    /// `all_gather` of device buffers; with `wait` false the compute stream does not wait for it
    /// (`all_gather_async`).
    fn all_gather_on(&self, input: &Tensor, output: &Tensor, wait: bool) -> Result<()> {
        let (pi, ni, ty) = buf("all_gather", input, false)?;
        let (po, no, _) = buf("all_gather", output, false)?;
        if no != ni * self.size || input.dtype() != output.dtype() {
            return Err(self.invalid("all_gather", format!("output of {no} elements for inputs of {ni}")));
        }
        self.fenced("all_gather", wait, |s| {
            // SAFETY: both buffers live and sized as NCCL expects.
            unsafe { result::all_gather(pi as _, po as _, ni, ty, self.comm, s) }
                .map(|_| ())
                .map_err(|e| nccl_err("all_gather", e))
        })
    }

    fn reduce_scatter_on(&self, input: &Tensor, output: &Tensor, op: ReduceOp, wait: bool) -> Result<()> {
        let (pi, ni, ty) = buf("reduce_scatter", input, true)?;
        let (po, no, _) = buf("reduce_scatter", output, true)?;
        if ni != no * self.size || input.dtype() != output.dtype() {
            return Err(self.invalid("reduce_scatter", format!("input of {ni} elements for outputs of {no}")));
        }
        self.fenced("reduce_scatter", wait, |s| {
            // SAFETY: both buffers live and sized as NCCL expects.
            unsafe { result::reduce_scatter(pi as _, po as _, no, ty, red(op), self.comm, s) }
                .map(|_| ())
                .map_err(|e| nccl_err("reduce_scatter", e))
        })
    }

    fn group<R>(&self, op: &'static str, f: impl FnOnce() -> Result<R>) -> Result<R> {
        result::group_start().map_err(|e| nccl_err(op, e))?;
        let r = f();
        result::group_end().map_err(|e| nccl_err(op, e))?;
        r
    }

    fn invalid(&self, op: &'static str, msg: String) -> CommError {
        CommError::Invalid { op, group: self.name.clone(), msg }
    }
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn name(&self) -> &str {
        &self.name
    }

    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<()> {
        if let Some(d) = self.staged(t)? {
            self.all_reduce(&d, op)?;
            return unstage(t, &d);
        }
        self.all_reduce_on(t, op, true)
    }

    fn all_reduce_async(&self, t: &Tensor, op: ReduceOp) -> Result<()> {
        self.all_reduce_on(t, op, false)
    }

    fn wait_async(&self) -> Result<()> {
        self.dev.stream().join(&self.stream).map_err(|e| nccl_err("wait", e))
    }

    fn reduce_scatter(&self, input: &Tensor, output: &Tensor, op: ReduceOp) -> Result<()> {
        if input.device().is_cpu() || output.device().is_cpu() {
            let (i, o) = (self.on_device(input)?, self.on_device(output)?);
            self.reduce_scatter(&i, &o, op)?;
            return unstage(output, &o);
        }
        self.reduce_scatter_on(input, output, op, true)
    }

    fn reduce_scatter_async(&self, input: &Tensor, output: &Tensor, op: ReduceOp) -> Result<()> {
        self.reduce_scatter_on(input, output, op, false)
    }

    fn all_gather(&self, input: &Tensor, output: &Tensor) -> Result<()> {
        if input.device().is_cpu() || output.device().is_cpu() {
            let (i, o) = (self.on_device(input)?, self.on_device(output)?);
            self.all_gather(&i, &o)?;
            return unstage(output, &o);
        }
        self.all_gather_on(input, output, true)
    }

    fn all_gather_async(&self, input: &Tensor, output: &Tensor) -> Result<()> {
        if input.device().is_cpu() || output.device().is_cpu() {
            return self.all_gather(input, output);
        }
        self.all_gather_on(input, output, false)
    }

    fn all_gather_v(&self, input: &Tensor, counts: &[usize]) -> Result<Tensor> {
        if input.device().is_cpu() {
            return Ok(self.all_gather_v(&self.on_device(input)?, counts)?.to_device(&Device::Cpu)?);
        }
        const OP: &str = "all_gather_v";
        let rows = input.dims().first().copied().unwrap_or(1);
        if counts.len() != self.size || counts[self.rank] != rows {
            return Err(self.invalid(OP, format!("counts {counts:?} do not match {rows} rows")));
        }
        let row = input.elem_count() / rows.max(1);
        let mut dims = input.dims().to_vec();
        dims[0] = counts.iter().sum();
        let out = Tensor::zeros(dims, input.dtype(), input.device())?;
        let (pi, _, ty) = buf(OP, input, false)?;
        let (po, _, _) = buf(OP, &out, false)?;
        let es = input.dtype().size_in_bytes() as u64;
        self.ordered(OP, |s| {
            self.group(OP, || {
                let mut off = 0u64;
                for (r, &c) in counts.iter().enumerate() {
                    let src = if r == self.rank { pi } else { po + off * es };
                    // SAFETY: each broadcast writes its rows of `out`.
                    unsafe { result::broadcast(src as _, (po + off * es) as _, c * row, ty, r as i32, self.comm, s) }
                        .map_err(|e| nccl_err(OP, e))?;
                    off += (c * row) as u64;
                }
                Ok(())
            })
        })?;
        Ok(out)
    }

    fn broadcast(&self, t: &Tensor, root: usize) -> Result<()> {
        if let Some(d) = self.staged(t)? {
            self.broadcast(&d, root)?;
            return unstage(t, &d);
        }
        let (p, n, ty) = buf("broadcast", t, false)?;
        self.ordered("broadcast", |s| {
            // SAFETY: in place on a live device buffer.
            unsafe { result::broadcast(p as _, p as _, n, ty, root as i32, self.comm, s) }
                .map(|_| ())
                .map_err(|e| nccl_err("broadcast", e))
        })
    }

    fn send(&self, t: &Tensor, dst: usize) -> Result<()> {
        if let Some(d) = self.staged(t)? {
            return self.send(&d, dst);
        }
        let (p, n, ty) = buf("send", t, false)?;
        self.ordered("send", |s| {
            // SAFETY: a live device buffer of n elements.
            unsafe { result::send(p as _, n, ty, dst as i32, self.comm, s) }
                .map(|_| ())
                .map_err(|e| nccl_err("send", e))
        })
    }

    fn recv(&self, t: &Tensor, src: usize) -> Result<()> {
        if let Some(d) = self.staged(t)? {
            self.recv(&d, src)?;
            return unstage(t, &d);
        }
        let (p, n, ty) = buf("recv", t, false)?;
        self.ordered("recv", |s| {
            // SAFETY: a live device buffer of n elements.
            unsafe { result::recv(p as _, n, ty, src as i32, self.comm, s) }
                .map(|_| ())
                .map_err(|e| nccl_err("recv", e))
        })
    }

    fn all_to_all_v(&self, input: &Tensor, send_counts: &[usize], recv_counts: &[usize]) -> Result<Tensor> {
        const OP: &str = "all_to_all_v";
        let (rows, row) = crate::rows_of(input);
        if send_counts.len() != self.size || recv_counts.len() != self.size || send_counts.iter().sum::<usize>() != rows
        {
            return Err(self.invalid(OP, format!("send {send_counts:?} / recv {recv_counts:?} for {rows} rows")));
        }
        let mut dims = input.dims().to_vec();
        if dims.is_empty() {
            dims.push(1);
        }
        dims[0] = recv_counts.iter().sum();
        let out = Tensor::zeros(dims, input.dtype(), input.device())?;
        let (pi, _, ty) = buf(OP, input, false)?;
        let (po, _, _) = buf(OP, &out, false)?;
        let es = (input.dtype().size_in_bytes() * row) as u64;
        self.ordered(OP, |s| {
            self.group(OP, || {
                let (mut so, mut ro) = (0u64, 0u64);
                for r in 0..self.size {
                    // SAFETY: row ranges inside the live input/output buffers.
                    unsafe {
                        result::send((pi + so * es) as _, send_counts[r] * row, ty, r as i32, self.comm, s)
                            .map_err(|e| nccl_err(OP, e))?;
                        result::recv((po + ro * es) as _, recv_counts[r] * row, ty, r as i32, self.comm, s)
                            .map_err(|e| nccl_err(OP, e))?;
                    }
                    so += send_counts[r] as u64;
                    ro += recv_counts[r] as u64;
                }
                Ok(())
            })
        })?;
        Ok(out)
    }

    fn barrier(&self) -> Result<()> {
        let t = Tensor::zeros([1], DType::F32, &Device::Cuda(self.dev.clone()))?;
        self.all_reduce(&t, ReduceOp::Sum)?;
        self.dev.synchronize()?;
        Ok(())
    }

    fn p2p_group(&self, ops: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        const OP: &str = "grouped send/recv";
        if P2P_STREAM.get().is_some() {
            return Err(self.invalid(OP, "p2p groups do not nest".into()));
        }
        self.ordered(OP, |s| {
            P2P_STREAM.set(Some(s));
            let r = self.group(OP, &mut *ops);
            P2P_STREAM.set(None);
            r
        })
    }

    fn connect(&self, peers: &[usize]) -> Result<()> {
        const OP: &str = "connect";
        if let Some(p) = peers.iter().find(|&&p| p >= self.size) {
            return Err(self.invalid(OP, format!("peer {p} outside a group of {}", self.size)));
        }
        let mut peers: Vec<usize> = peers.iter().copied().filter(|&p| p != self.rank).collect();
        peers.sort_unstable();
        peers.dedup();
        if peers.is_empty() {
            return Ok(());
        }
        // One element each way to every peer, all in one batch: both directions of every link
        // are set up in the same handshake on both ends.
        let d = Device::Cuda(self.dev.clone());
        let bufs = peers.iter().map(|_| Ok((Tensor::zeros([1], DType::F32, &d)?, Tensor::zeros([1], DType::F32, &d)?)));
        let bufs = bufs.collect::<Result<Vec<_>>>()?;
        self.p2p_group(&mut || {
            for (&p, (out, inp)) in peers.iter().zip(&bufs) {
                self.send(out, p)?;
                self.recv(inp, p)?;
            }
            Ok(())
        })
    }

    fn split(&self, name: &str, groups: &[Vec<usize>]) -> Result<Option<Arc<dyn Communicator>>> {
        // ncclCommSplit is collective over the parent: every rank calls it once per kind of
        // group; the colour is the index of the group holding this rank, NO_COLOR when none does.
        let mine = crate::find_group(groups, self.rank);
        let (color, key) = match mine {
            Some((g, i)) => (g as i32, i as i32),
            None => (-1, 0), // NCCL_SPLIT_NOCOLOR
        };
        let mut comm = MaybeUninit::uninit();
        // SAFETY: `comm` is written by NCCL on success; a null config inherits the parent's.
        let comm = unsafe {
            sys::ncclCommSplit(self.comm, color, key, comm.as_mut_ptr(), std::ptr::null_mut())
                .result()
                .map_err(|e| nccl_err("split", e))?;
            comm.assume_init()
        };
        let Some((g, me)) = mine else { return Ok(None) };
        let members: Vec<usize> = groups[g].iter().map(|&r| self.members[r]).collect();
        let h = AbortHandle(comm);
        let hook = self.watchdog.on_timeout(move || h.abort());
        let stream = match self.dev.context().new_stream() {
            Ok(s) => s,
            Err(e) => {
                self.watchdog.forget(hook);
                // SAFETY: the handle just came from ncclCommSplit and is not used again.
                unsafe {
                    let _ = result::comm_destroy(comm);
                }
                return Err(nccl_err("split", e));
            }
        };
        Ok(Some(Arc::new(NcclComm {
            comm,
            dev: self.dev.clone(),
            stream,
            rank: me,
            size: members.len(),
            name: format!("{name}{members:?}"),
            members,
            watchdog: self.watchdog.clone(),
            hook,
        })))
    }
}
