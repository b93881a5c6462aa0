//! Every collective over point-to-point messages (thread and TCP backends).
//!
//! A call takes the group's next sequence number; each rank sends its part to every peer, takes
//! every peer's part from its mailbox (waiting at most the group's timeout) and computes its result
//! locally. Reductions run in f64 over contributions in group-rank order, so every rank gets the
//! same bits whatever the arrival order. Send/recv use a per-pair sequence instead.

use crate::transport::{Key, Message, Take, Transport};
use crate::{CommError, Communicator, ReduceOp, Result};
use ferrotron_core::{DType, Tensor, rng::fnv1a64};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Tag bit that keeps point-to-point traffic apart from the group's collectives.
const P2P: u64 = 1 << 63;

pub struct MeshComm {
    transport: Arc<dyn Transport>,
    /// World ranks of the members, in group order.
    members: Vec<usize>,
    me: usize,
    id: u64,
    name: String,
    seq: AtomicU64,
    sent: Mutex<HashMap<usize, u64>>,
    received: Mutex<HashMap<usize, u64>>,
    timeout: Duration,
}

impl MeshComm {
    /// The group of every rank the transport reaches.
    pub fn world(transport: Arc<dyn Transport>, timeout: Duration) -> MeshComm {
        let members = (0..transport.world_size()).collect();
        MeshComm::group(transport, "world", members, timeout)
    }

    fn group(transport: Arc<dyn Transport>, name: &str, members: Vec<usize>, timeout: Duration) -> MeshComm {
        let me = members.iter().position(|&r| r == transport.world_rank()).unwrap_or(0);
        let name = format!("{name}{members:?}");
        MeshComm {
            id: fnv1a64(&name) & !P2P,
            transport,
            members,
            me,
            name,
            seq: AtomicU64::new(0),
            sent: Mutex::default(),
            received: Mutex::default(),
            timeout,
        }
    }

    fn invalid(&self, op: &'static str, msg: impl Into<String>) -> CommError {
        CommError::Invalid { op, group: self.name.clone(), msg: msg.into() }
    }

    fn post(&self, op: &'static str, to: usize, key: Key, data: Vec<u8>) -> Result<()> {
        let dst = self.members[to];
        self.transport.send(dst, key, Message { op: op.to_string(), data }).map_err(|e| CommError::Link {
            op,
            group: self.name.clone(),
            peer: dst,
            msg: e.to_string(),
        })
    }

    /// Takes the messages of `from` (group ranks) under `seq`; names every missing rank on timeout.
    fn collect(&self, op: &'static str, group: u64, seqs: &[(usize, u64)]) -> Result<HashMap<usize, Vec<u8>>> {
        let deadline = Instant::now() + self.timeout;
        let mut got = HashMap::new();
        for (i, &(r, seq)) in seqs.iter().enumerate() {
            let src = self.members[r];
            match self.transport.inbox().take(Key { src, group, seq }, deadline) {
                Take::Got(m) if m.op == op => {
                    got.insert(r, m.data);
                }
                Take::Got(m) => {
                    return Err(CommError::Mismatch { op, group: self.name.clone(), peer: src, peer_op: m.op });
                }
                Take::Broken(msg) => return Err(CommError::Link { op, group: self.name.clone(), peer: src, msg }),
                Take::TimedOut => {
                    let mut missing = vec![src];
                    for &(r2, seq2) in &seqs[i + 1..] {
                        let src2 = self.members[r2];
                        if let Take::TimedOut =
                            self.transport.inbox().take(Key { src: src2, group, seq: seq2 }, Instant::now())
                        {
                            missing.push(src2);
                        }
                    }
                    return Err(CommError::Timeout { op, group: self.name.clone(), timeout: self.timeout, missing });
                }
            }
        }
        Ok(got)
    }

    /// Sends `part(r)` to every other member r and returns every member's part for this rank
    /// (its own included), indexed by group rank.
    fn exchange(&self, op: &'static str, part: impl Fn(usize) -> Vec<u8>) -> Result<Vec<Vec<u8>>> {
        let seq = self.seq.fetch_add(1, Ordering::SeqCst);
        let n = self.members.len();
        for r in (0..n).filter(|&r| r != self.me) {
            self.post(op, r, Key { src: self.transport.world_rank(), group: self.id, seq }, part(r))?;
        }
        let peers: Vec<(usize, u64)> = (0..n).filter(|&r| r != self.me).map(|r| (r, seq)).collect();
        let mut got = self.collect(op, self.id, &peers)?;
        Ok((0..n).map(|r| if r == self.me { part(r) } else { got.remove(&r).unwrap_or_default() }).collect())
    }

    fn check_group_rank(&self, op: &'static str, r: usize) -> Result<()> {
        if r >= self.members.len() {
            return Err(self.invalid(op, format!("rank {r} is not in a group of {}", self.members.len())));
        }
        Ok(())
    }
}

/// Values of `dtype` as f64 (exact for every supported dtype, u32 included).
fn decode(dtype: DType, b: &[u8]) -> Result<Vec<f64>> {
    let s = ferrotron_core::CpuStorage::from_bytes(dtype, b)?;
    Ok(match s.as_slice::<u32>() {
        Ok(u) => u.iter().map(|&x| x as f64).collect(),
        Err(_) => s.gather_f32(0..s.len()).into_iter().map(f64::from).collect(),
    })
}

fn encode_into(t: &Tensor, v: &[f64]) -> Result<()> {
    if t.dtype() == DType::U32 {
        let u: Vec<u32> = v.iter().map(|&x| x as u32).collect();
        t.copy_from_bytes(bytemuck::cast_slice(&u))?;
    } else {
        t.copy_from_f32(&v.iter().map(|&x| x as f32).collect::<Vec<_>>())?;
    }
    Ok(())
}

fn reduce(op: ReduceOp, dtype: DType, parts: &[Vec<u8>]) -> Result<Vec<f64>> {
    let mut acc = decode(dtype, &parts[0])?;
    for p in &parts[1..] {
        for (a, b) in acc.iter_mut().zip(decode(dtype, p)?) {
            *a = match op {
                ReduceOp::Sum | ReduceOp::Avg => *a + b,
                ReduceOp::Max => a.max(b),
                ReduceOp::Min => a.min(b),
            };
        }
    }
    if op == ReduceOp::Avg {
        let n = parts.len() as f64;
        acc.iter_mut().for_each(|a| *a /= n);
    }
    Ok(acc)
}

impl Communicator for MeshComm {
    fn rank(&self) -> usize {
        self.me
    }
    fn size(&self) -> usize {
        self.members.len()
    }
    fn name(&self) -> &str {
        &self.name
    }

    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<()> {
        let mine = t.to_bytes()?;
        let parts = self.exchange("all_reduce", |_| mine.clone())?;
        encode_into(t, &reduce(op, t.dtype(), &parts)?)
    }

    fn reduce_scatter(&self, input: &Tensor, output: &Tensor, op: ReduceOp) -> Result<()> {
        const OP: &str = "reduce_scatter";
        let n = self.size();
        if input.elem_count() != n * output.elem_count() || input.dtype() != output.dtype() {
            return Err(self.invalid(
                OP,
                format!("input of {} elements for {n} outputs of {}", input.elem_count(), output.elem_count()),
            ));
        }
        let bytes = input.to_bytes()?;
        let chunk = bytes.len() / n;
        let parts = self.exchange(OP, |r| bytes[r * chunk..(r + 1) * chunk].to_vec())?;
        encode_into(output, &reduce(op, input.dtype(), &parts)?)
    }

    fn all_gather(&self, input: &Tensor, output: &Tensor) -> Result<()> {
        const OP: &str = "all_gather";
        if output.elem_count() != self.size() * input.elem_count() || input.dtype() != output.dtype() {
            return Err(self.invalid(
                OP,
                format!(
                    "output of {} elements for {} inputs of {}",
                    output.elem_count(),
                    self.size(),
                    input.elem_count()
                ),
            ));
        }
        let mine = input.to_bytes()?;
        output.copy_from_bytes(&self.exchange(OP, |_| mine.clone())?.concat())?;
        Ok(())
    }

    fn all_gather_v(&self, input: &Tensor, counts: &[usize]) -> Result<Tensor> {
        const OP: &str = "all_gather_v";
        let (rows, row) = crate::rows_of(input);
        if counts.len() != self.size() || counts[self.me] != rows {
            return Err(self.invalid(OP, format!("counts {counts:?} do not match {rows} rows on rank {}", self.me)));
        }
        let mine = input.to_bytes()?;
        let parts = self.exchange(OP, |_| mine.clone())?;
        let esize = input.dtype().size_in_bytes();
        for (r, p) in parts.iter().enumerate() {
            if p.len() != counts[r] * row * esize {
                return Err(self.invalid(OP, format!("rank {r} sent {} bytes, expected {} rows", p.len(), counts[r])));
            }
        }
        let mut dims = input.dims().to_vec();
        if dims.is_empty() {
            dims.push(1);
        }
        dims[0] = counts.iter().sum();
        let out = Tensor::zeros(dims, input.dtype(), input.device())?;
        out.copy_from_bytes(&parts.concat())?;
        Ok(out)
    }

    fn broadcast(&self, t: &Tensor, root: usize) -> Result<()> {
        const OP: &str = "broadcast";
        self.check_group_rank(OP, root)?;
        let seq = self.seq.fetch_add(1, Ordering::SeqCst);
        let key = Key { src: self.transport.world_rank(), group: self.id, seq };
        if self.me == root {
            let mine = t.to_bytes()?;
            for r in (0..self.size()).filter(|&r| r != root) {
                self.post(OP, r, key, mine.clone())?;
            }
            return Ok(());
        }
        let mut got = self.collect(OP, self.id, &[(root, seq)])?;
        t.copy_from_bytes(&got.remove(&root).unwrap_or_default())?;
        Ok(())
    }

    fn send(&self, t: &Tensor, dst: usize) -> Result<()> {
        self.check_group_rank("send", dst)?;
        let seq = {
            let mut s = self.sent.lock().unwrap_or_else(|p| p.into_inner());
            let e = s.entry(dst).or_insert(0);
            *e += 1;
            *e - 1
        };
        let key = Key { src: self.transport.world_rank(), group: self.id | P2P, seq };
        self.post("send", dst, key, t.to_bytes()?)
    }

    fn recv(&self, t: &Tensor, src: usize) -> Result<()> {
        self.check_group_rank("recv", src)?;
        let seq = {
            let mut s = self.received.lock().unwrap_or_else(|p| p.into_inner());
            let e = s.entry(src).or_insert(0);
            *e += 1;
            *e - 1
        };
        // The sender labels its message "send".
        let mut got = self.collect("send", self.id | P2P, &[(src, seq)]).map_err(|e| match e {
            CommError::Timeout { group, timeout, missing, .. } => {
                CommError::Timeout { op: "recv", group, timeout, missing }
            }
            e => e,
        })?;
        let data = got.remove(&src).unwrap_or_default();
        if data.len() != t.elem_count() * t.dtype().size_in_bytes() {
            return Err(self.invalid(
                "recv",
                format!(
                    "rank {src} sent {} bytes into a {} tensor of {} elements",
                    data.len(),
                    t.dtype(),
                    t.elem_count()
                ),
            ));
        }
        t.copy_from_bytes(&data)?;
        Ok(())
    }

    fn all_to_all_v(&self, input: &Tensor, send_counts: &[usize], recv_counts: &[usize]) -> Result<Tensor> {
        const OP: &str = "all_to_all_v";
        let n = self.size();
        let (rows, row) = crate::rows_of(input);
        if send_counts.len() != n || recv_counts.len() != n || send_counts.iter().sum::<usize>() != rows {
            return Err(self.invalid(
                OP,
                format!("send counts {send_counts:?} / recv counts {recv_counts:?} for {rows} rows and {n} ranks"),
            ));
        }
        let esize = input.dtype().size_in_bytes() * row;
        let bytes = input.to_bytes()?;
        let starts: Vec<usize> = send_counts.iter().scan(0, |a, &c| Some(std::mem::replace(a, *a + c))).collect();
        let parts = self.exchange(OP, |r| bytes[starts[r] * esize..(starts[r] + send_counts[r]) * esize].to_vec())?;
        for (r, p) in parts.iter().enumerate() {
            if p.len() != recv_counts[r] * esize {
                return Err(self.invalid(
                    OP,
                    format!("rank {r} sent {} rows, expected {}", p.len() / esize.max(1), recv_counts[r]),
                ));
            }
        }
        let mut dims = input.dims().to_vec();
        if dims.is_empty() {
            dims.push(1);
        }
        dims[0] = recv_counts.iter().sum();
        let out = Tensor::zeros(dims, input.dtype(), input.device())?;
        out.copy_from_bytes(&parts.concat())?;
        Ok(out)
    }

    fn barrier(&self) -> Result<()> {
        self.exchange("barrier", |_| Vec::new()).map(|_| ())
    }

    fn split(&self, name: &str, groups: &[Vec<usize>]) -> Result<Option<Arc<dyn Communicator>>> {
        for &r in groups.iter().flatten() {
            self.check_group_rank("split", r)?;
        }
        let Some((g, _)) = crate::find_group(groups, self.me) else { return Ok(None) };
        let members = groups[g].iter().map(|&r| self.members[r]).collect();
        Ok(Some(Arc::new(MeshComm::group(self.transport.clone(), name, members, self.timeout))))
    }
}
