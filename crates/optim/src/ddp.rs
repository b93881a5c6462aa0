//! Data-parallel gradient synchronisation over buckets of the flat main_grad buffer.
//!
//! Buckets are ranges of the flat buffer taken from its end (backward finishes the last layers
//! first), each a multiple of the data-parallel size long, so that under the distributed optimizer
//! rank d owns the d-th equal slice of every bucket (Megatron's layout). A bucket is averaged over
//! the data-parallel group with an all-reduce, or with a reduce-scatter into the owner's slice
//! under the distributed optimizer.
//!
//! Overlap (`--overlap-grad-reduce`): the model reports, after each layer's backward on the last
//! micro-batch, the lowest flat offset whose gradients are final (`ready`); every bucket above it
//! starts at once while the backward goes on: on a communication thread for the host backends,
//! on the DP communicator's NCCL stream (the compute stream not waiting) on GPUs. `finish` starts the
//! rest and waits for all.
//!
//! Gradients of replicated parameters used on sequence shards (`ParamMeta::sequence_parallel`)
//! are then summed over the tensor-parallel group, on the part of the buffer this rank keeps.
//!
//! Under the distributed optimizer each rank then gathers the updated parameters, bucket by
//! bucket. With `--overlap-param-gather` (`with_overlap_param_gather`) the gathers wait for the
//! next forward: `ParamTable::param` waits for its parameter's bucket (`ParamGather`), which
//! issues bucket k + 1 once bucket k is waited for, in ascending flat order (the forward's) on
//! every rank; on a GPU asynchronously, so each bucket's gather runs beside the layers of the one
//! before.

use ferrotron_comm::{CommError, Communicator, ReduceOp};
use ferrotron_core::{ParamTable, PendingParams, Tensor};
use ferrotron_kernels as k;
use std::ops::Range;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, channel};

pub type Comm = Arc<dyn Communicator>;

/// Megatron's default bucket size (elements): max(40M, 1M × dp).
pub fn default_bucket_size(dp: usize) -> usize {
    (40_000_000).max(1_000_000 * dp)
}

/// How the flat buffer is cut into buckets and shards.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BucketPlan {
    /// Flat ranges, highest offsets first.
    pub buckets: Vec<Range<usize>>,
    pub dp: usize,
    pub dp_rank: usize,
}

impl BucketPlan {
    /// Buckets of about `bucket_size` elements over a flat buffer of `flat_len` (a multiple of
    /// `dp`: build the table with `build_padded(.., dp)`).
    pub fn new(flat_len: usize, bucket_size: usize, dp: usize, dp_rank: usize) -> BucketPlan {
        Self::over(0..flat_len, bucket_size, dp, dp_rank)
    }

    /// Buckets over the flat range `region` (its length a multiple of `dp`).
    pub fn over(region: Range<usize>, bucket_size: usize, dp: usize, dp_rank: usize) -> BucketPlan {
        let size = bucket_size.max(1).div_ceil(dp) * dp;
        let mut buckets = vec![];
        let mut end = region.end;
        while end > region.start {
            let start = end.saturating_sub(size).max(region.start);
            buckets.push(start..end);
            end = start;
        }
        BucketPlan { buckets, dp, dp_rank }
    }

    /// The slice of bucket `b` this rank owns under the distributed optimizer.
    pub fn shard(&self, b: usize) -> Range<usize> {
        let r = &self.buckets[b];
        let part = r.len() / self.dp;
        r.start + self.dp_rank * part..r.start + (self.dp_rank + 1) * part
    }

    /// Every flat range this rank owns, in flat order.
    pub fn owned(&self, distributed: bool) -> Vec<Range<usize>> {
        let mut v: Vec<Range<usize>> =
            if distributed { (0..self.buckets.len()).map(|b| self.shard(b)).collect() } else { self.buckets.clone() };
        v.sort_by_key(|r| r.start);
        v
    }
}

/// The communication thread: runs jobs in order, one result per job.
struct Worker {
    jobs: Sender<Box<dyn FnOnce() -> Result<(), CommError> + Send>>,
    done: Receiver<Result<(), CommError>>,
}

impl Worker {
    fn new() -> Worker {
        let (jobs, rx) = channel::<Box<dyn FnOnce() -> Result<(), CommError> + Send>>();
        let (tx, done) = channel();
        std::thread::Builder::new()
            .name("grad-reduce".into())
            .spawn(move || {
                for job in rx {
                    if tx.send(job()).is_err() {
                        return;
                    }
                }
            })
            .expect("spawning the gradient-reduce thread");
        Worker { jobs, done }
    }
}

/// The expert parameters' region (`ParamTable::expert_range`, below the rest): its buckets are
/// reduced over the expert-data-parallel group, after the others. Each expert's gradient holds
/// the contributions of every token its expert-parallel group sent it, each already scaled as
/// its own rank's loss; the data-parallel average of the whole model is then the sum over the
/// expert-data-parallel group divided by the data-parallel size: the average over the group
/// times 1 / ep. With whole experts under tensor parallelism (an expert tensor-parallel size of
/// one) the tensor-parallel ranks hold different tokens of one micro-batch (sequence parallel),
/// whose contributions add: times tp / ep (`tp_copies` = tp / etp).
pub struct ExpertSync {
    pub region: Range<usize>,
    pub plan: BucketPlan,
    pub edp: Comm,
    /// None: one expert-parallel rank.
    pub ep: Option<Comm>,
    /// The tensor-parallel size over the experts' (1 when the experts split as the rest).
    pub tp_copies: usize,
    bucket_size: usize,
}

pub struct GradSync {
    /// The buckets of the parameters other than the experts'.
    pub plan: BucketPlan,
    /// The experts' buckets; None without expert parameters.
    pub expert: Option<ExpertSync>,
    pub dp: Comm,
    pub tp: Comm,
    pub distributed: bool,
    worker: Option<Worker>,
    /// Overlap on a device backend: buckets go out as `*_async` collectives.
    detached: bool,
    /// Buckets started this step (from the top).
    started: usize,
    in_flight: usize,
    /// Flat ranges of sequence-parallel grads within the owned part of the buffer.
    sp_ranges: Vec<Range<usize>>,
    /// The tied embedding (or its copy) on the first / last pipeline stage, and the group of those
    /// two stages: its grads are summed there before the data-parallel reduce.
    tied: Option<(Range<usize>, Comm)>,
    /// `--overlap-param-gather`: the gathers put off until the forward reaches each bucket.
    overlap_gather: bool,
}

impl GradSync {
    pub fn new(
        table: &ParamTable,
        dp: Comm,
        tp: Comm,
        bucket_size: usize,
        distributed: bool,
        overlap: bool,
    ) -> GradSync {
        let experts = table.expert_range();
        let plan = BucketPlan::over(experts.end..table.flat_len(), bucket_size, dp.size(), dp.rank());
        // Without an expert-parallel group the experts' region is reduced as the rest is (over
        // the data-parallel group, one expert-parallel rank); `with_experts` sets the groups.
        let expert = (!experts.is_empty()).then(|| ExpertSync {
            region: experts.clone(),
            plan: BucketPlan::over(experts.clone(), bucket_size, dp.size(), dp.rank()),
            edp: dp.clone(),
            ep: None,
            tp_copies: 1,
            bucket_size,
        });
        // Sequence-parallel parameters (norms, biases) are never an expert's: the other region.
        let owned = plan.owned(distributed);
        let mut sp_ranges = vec![];
        if tp.size() > 1 {
            for id in table.ids().filter(|&id| table.meta(id).sequence_parallel) {
                let r = table.range(id);
                for o in &owned {
                    let (s, e) = (r.start.max(o.start), r.end.min(o.end));
                    if s < e {
                        sp_ranges.push(s..e);
                    }
                }
            }
        }
        // The comm thread drives host collectives (thread/TCP backends). Device collectives (NCCL)
        // are enqueued on the DP communicator's stream without making the compute stream wait
        // (`*_async`) until `finish`.
        let on_host = table.flat_grads().device().is_cpu();
        let worker = (overlap && dp.size() > 1 && on_host).then(Worker::new);
        let detached = overlap && dp.size() > 1 && !on_host;
        GradSync {
            plan,
            expert,
            dp,
            tp,
            distributed,
            worker,
            detached,
            started: 0,
            in_flight: 0,
            sp_ranges,
            tied: None,
            overlap_gather: false,
        }
    }

    /// Expert parallelism: the experts' region is reduced over `edp` (the expert-data-parallel
    /// group) and scaled by `tp_copies` / `ep`'s size (see `ExpertSync`; `tp_copies` the
    /// tensor-parallel size over the experts'). The region is padded to a multiple of `edp`'s
    /// size.
    pub fn with_experts(mut self, edp: Comm, ep: Comm, tp_copies: usize) -> Self {
        if let Some(e) = self.expert.as_mut() {
            e.plan = BucketPlan::over(e.region.clone(), e.bucket_size, edp.size(), edp.rank());
            e.edp = edp;
            e.ep = Some(ep);
            e.tp_copies = tp_copies.max(1);
        }
        self
    }

    /// Every flat range this rank's optimizer updates: the others' and the experts', in flat
    /// order.
    pub fn owned(&self) -> Vec<Range<usize>> {
        let mut v = self.plan.owned(self.distributed);
        if let Some(e) = &self.expert {
            v.extend(e.plan.owned(self.distributed));
        }
        v.sort_by_key(|r| r.start);
        v
    }

    /// The experts' buckets: scaled by tp_copies / ep, then averaged over the expert-data-parallel
    /// group (reduce-scattered under the distributed optimizer). Synchronous, after the rest.
    fn reduce_experts(&self, table: &ParamTable) -> Result<(), CommError> {
        let Some(e) = &self.expert else { return Ok(()) };
        let grads = table.flat_grads();
        let ep = e.ep.as_ref().map_or(1, |ep| ep.size());
        for (b, r) in e.plan.buckets.iter().enumerate() {
            let bucket = grads.view(r.start, [r.len()])?;
            if e.tp_copies != ep {
                k::scale_(&bucket, e.tp_copies as f32 / ep as f32)?;
            }
            if e.edp.size() == 1 {
                continue;
            }
            let shard = e.plan.shard(b);
            if self.distributed {
                e.edp.reduce_scatter(&bucket, &grads.view(shard.start, [shard.len()])?, ReduceOp::Avg)?;
            } else {
                e.edp.all_reduce(&bucket, ReduceOp::Avg)?;
            }
        }
        Ok(())
    }

    /// Megatron's `--overlap-param-gather` (distributed optimizer only; see the module's doc).
    pub fn with_overlap_param_gather(mut self, yes: bool) -> Self {
        self.overlap_gather = yes;
        self
    }

    /// Sums the grads of flat range `range` (the tied embedding or its pipeline copy) over `embd`
    /// (first and last pipeline stage) before the data-parallel reduce. Overlap is switched off:
    /// under pipelining the buckets wait for `finish`.
    pub fn with_tied(mut self, range: Range<usize>, embd: Comm) -> Self {
        if embd.size() > 1 {
            self.tied = Some((range, embd));
            self.worker = None;
            self.detached = false;
        }
        self
    }

    /// Call before the last micro-batch's backward.
    pub fn begin(&mut self) {
        self.started = 0;
    }

    fn launch(&mut self, table: &ParamTable, b: usize) -> Result<(), CommError> {
        if self.dp.size() == 1 {
            return Ok(());
        }
        let r = self.plan.buckets[b].clone();
        // Parameters of the bucket no backward op reached are final at zero (`ParamTable`'s
        // deferred zeroing), cleared on the compute stream before the reduction reads them.
        table.settle_grads(r.clone())?;
        let grads = table.flat_grads().clone();
        let shard = self.plan.shard(b);
        let (dp, distributed, detached) = (self.dp.clone(), self.distributed, self.detached);
        let job = move || -> Result<(), CommError> {
            let bucket = grads.view(r.start, [r.len()])?;
            let shard = grads.view(shard.start, [shard.len()])?;
            match (distributed, detached) {
                (true, false) => dp.reduce_scatter(&bucket, &shard, ReduceOp::Avg),
                (true, true) => dp.reduce_scatter_async(&bucket, &shard, ReduceOp::Avg),
                (false, false) => dp.all_reduce(&bucket, ReduceOp::Avg),
                (false, true) => dp.all_reduce_async(&bucket, ReduceOp::Avg),
            }
        };
        match &self.worker {
            Some(w) => {
                w.jobs.send(Box::new(job)).map_err(|_| worker_gone())?;
                self.in_flight += 1;
                Ok(())
            }
            None => job(),
        }
    }

    /// Gradients at flat offsets ≥ `frontier` are final: start every bucket above it (overlap only).
    pub fn ready(&mut self, table: &ParamTable, frontier: usize) -> Result<(), CommError> {
        if self.worker.is_none() && !self.detached {
            return Ok(());
        }
        while self.started < self.plan.buckets.len() && self.plan.buckets[self.started].start >= frontier {
            self.launch(table, self.started)?;
            self.started += 1;
        }
        Ok(())
    }

    /// Starts what is left, waits for every bucket, then sums sequence-parallel grads over TP.
    pub fn finish(&mut self, table: &ParamTable) -> Result<(), CommError> {
        table.settle_grads(0..table.flat_len())?;
        if let Some((r, embd)) = &self.tied {
            embd.all_reduce(&table.flat_grads().view(r.start, [r.len()])?, ReduceOp::Sum)?;
        }
        while self.started < self.plan.buckets.len() {
            self.launch(table, self.started)?;
            self.started += 1;
        }
        let mut first_err = None;
        if let Some(w) = &self.worker {
            for _ in 0..self.in_flight {
                if let Err(e) = w.done.recv().map_err(|_| worker_gone())? {
                    first_err.get_or_insert(e);
                }
            }
        }
        self.in_flight = 0;
        self.started = 0; // the next step starts from the top again
        if self.detached {
            self.dp.wait_async()?;
        }
        if let Some(e) = first_err {
            return Err(e);
        }
        self.reduce_experts(table)?;
        self.reduce_sequence_parallel(table)
    }

    fn reduce_sequence_parallel(&self, table: &ParamTable) -> Result<(), CommError> {
        let n: usize = self.sp_ranges.iter().map(|r| r.len()).sum();
        if n == 0 {
            return Ok(());
        }
        let g = table.flat_grads();
        let packed = Tensor::zeros([n], g.dtype(), g.device())?;
        let mut at = 0;
        for r in &self.sp_ranges {
            k::copy_(&packed.view(at, [r.len()])?, &g.view(r.start, [r.len()])?)?;
            at += r.len();
        }
        self.tp.all_reduce(&packed, ReduceOp::Sum)?;
        at = 0;
        for r in &self.sp_ranges {
            k::copy_(&g.view(r.start, [r.len()])?, &packed.view(at, [r.len()])?)?;
            at += r.len();
        }
        Ok(())
    }

    /// After the optimizer updated this rank's slices of the parameters: every rank gets all of
    /// them (distributed optimizer only), now or, with `with_overlap_param_gather`, as the next
    /// forward reaches each bucket (`ParamTable::set_pending`).
    pub fn gather_params(&self, table: &ParamTable) -> Result<(), CommError> {
        if !self.distributed {
            return Ok(());
        }
        table.settle_params()?;
        let p = table.flat_params();
        // The experts' shards first, at once: the pending gathers below cover the rest only.
        if let Some(e) = self.expert.as_ref().filter(|e| e.edp.size() > 1) {
            for (b, r) in e.plan.buckets.iter().enumerate().rev() {
                let s = e.plan.shard(b);
                e.edp.all_gather(&p.view(s.start, [s.len()])?, &p.view(r.start, [r.len()])?)?;
            }
        }
        if self.dp.size() == 1 {
            return Ok(());
        }
        // Ascending flat order: the forward's.
        let buckets: Vec<_> =
            (0..self.plan.buckets.len()).rev().map(|b| (self.plan.buckets[b].clone(), self.plan.shard(b))).collect();
        if self.overlap_gather {
            let device = !p.device().is_cpu();
            let mut st = GatherState { buckets, issued: 0, done: 0, dp: self.dp.clone(), params: p.clone(), device };
            st.issue()?; // the first bucket at once: it runs beside whatever comes before the forward
            table.set_pending(Arc::new(ParamGather(std::sync::Mutex::new(st))))?;
            return Ok(());
        }
        for (r, s) in buckets {
            self.dp.all_gather(&p.view(s.start, [s.len()])?, &p.view(r.start, [r.len()])?)?;
        }
        Ok(())
    }
}

/// The pending parameter gathers of `--overlap-param-gather` (`GradSync::gather_params`).
struct ParamGather(std::sync::Mutex<GatherState>);

struct GatherState {
    /// (bucket, this rank's shard of it), ascending.
    buckets: Vec<(Range<usize>, Range<usize>)>,
    /// Buckets issued, and buckets the compute stream (or host) has waited for: done ≤ issued.
    issued: usize,
    done: usize,
    dp: Comm,
    params: Tensor,
    /// On a GPU: issued on the DP communicator's stream, the compute stream waiting only in `wait`.
    device: bool,
}

impl GatherState {
    fn issue(&mut self) -> Result<(), CommError> {
        let (r, s) = self.buckets[self.issued].clone();
        let (whole, mine) = (self.params.view(r.start, [r.len()])?, self.params.view(s.start, [s.len()])?);
        if self.device {
            self.dp.all_gather_async(&mine, &whole)?
        } else {
            self.dp.all_gather(&mine, &whole)?
        }
        self.issued += 1;
        Ok(())
    }

    /// Every bucket that starts below `end` gathered, the next one issued behind it.
    fn wait_below(&mut self, end: usize) -> Result<(), CommError> {
        while self.done < self.buckets.len() && self.buckets[self.done].0.start < end {
            if self.issued == self.done {
                self.issue()?;
            }
            if self.device {
                // Only bucket `done` is in flight (one ahead): the compute stream waits for it.
                self.dp.wait_async()?;
            }
            self.done += 1;
            if self.issued == self.done && self.issued < self.buckets.len() {
                self.issue()?;
            }
        }
        Ok(())
    }
}

impl PendingParams for ParamGather {
    fn wait(&self, range: Range<usize>) -> ferrotron_core::Result<()> {
        let mut st = self.0.lock().unwrap_or_else(|e| e.into_inner());
        st.wait_below(range.end).map_err(|e| ferrotron_core::Error::External(Box::new(e)))
    }
}

fn worker_gone() -> CommError {
    CommError::Invalid { op: "grad reduce", group: "dp".into(), msg: "the communication thread stopped".into() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_tile_the_buffer_and_shards_tile_each_bucket() {
        let p = BucketPlan::new(24, 10, 2, 1);
        assert_eq!(p.buckets, vec![14..24, 4..14, 0..4]);
        assert_eq!((p.shard(0), p.shard(2)), (19..24, 2..4));
        assert_eq!(p.owned(true), vec![2..4, 9..14, 19..24]);
        assert_eq!(p.owned(false), vec![0..4, 4..14, 14..24]);
    }
}
