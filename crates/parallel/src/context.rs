//! Context parallelism (Megatron's `--context-parallel-size`): every sequence split over the
//! ranks of the cp group, so each holds 1/cp of the activations of a long sequence.
//!
//! The split is Megatron's load-balanced one: the sequence of T tokens is cut into 2·cp chunks of
//! c = T / (2·cp) and rank r holds chunks r and 2·cp − 1 − r, in that order, as its local sequence
//! of 2c rows. Under a causal mask every rank then has the same attention work.
//!
//! Everything but the core attention is per token and runs on the local rows as it is (RoPE and
//! position ids take the rows' global positions: [`ContextParallel::rope`],
//! [`ContextParallel::position`]). The core attention (`attention_fwd` / `attention_bwd`, the
//! signatures of `k::attention_fwd` / `k::attention_bwd`) gathers every rank's K and V over the
//! group (Megatron's `--cp-comm-type allgather`) and works chunk against chunk: query chunk at
//! global index p sees key chunk p′ whole when p′ < p, causally when p′ = p, not at all after.
//! The chunk results merge by their log-sum-exps (`k::attention_merge_`). The backward gathers
//! K and V again (nothing gathered is kept), runs each block's backward from the merged output
//! and log-sum-exp (exact: a block's probabilities are the whole softmax's on its keys), and
//! reduce-scatters the key and value gradients back to the ranks that own those rows. Attention
//! dropout draws the whole sequence's mask: each block's key points at its tiles of it
//! (`AttnDropout::tiles`; chunks of a multiple of 16 tokens). With `CpCommType::AllToAll` the
//! core attention trades rows for heads instead (`context_heads`).
//!
//! Shapes: q, o, dq [B, 2c, Hq, D]; k, v, dk, dv [B, 2c, Hkv, D]; the lse this forward returns
//! is [2, B, Hq, c] (chunk-major, for its backward; not `k::attention_fwd`'s layout). Inside,
//! tensors are chunk-major [2, B, c, …] so that a chunk is a contiguous block (a view when
//! B = 1, Megatron's usual long-context micro-batch; one copy each way otherwise).

use crate::comm_err;
use crate::groups::Comm;
use ferrotron_comm::ReduceOp;
use ferrotron_core::{DType, Result, Tensor, invalid, shape_mismatch};
use ferrotron_kernels::{self as k, AttnCfg, AttnDropout, RopeCfg, RopeSplit};

/// How the core attention reaches the rest of the sequence (Megatron's `--cp-comm-type`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CpCommType {
    /// Every rank's K and V gathered, this rank's queries against them (`allgather`; Megatron's
    /// default `p2p` passes the same blocks round a ring and gives the same attention, so it
    /// runs as this).
    #[default]
    AllGather,
    /// An all-to-all trades this rank's rows of every head for every row of 1/cp of the heads,
    /// whole-sequence attention runs on those, and a second all-to-all trades back (`a2a`,
    /// DeepSpeed-Ulysses; `context_heads`). Needs the heads and query groups divisible by cp;
    /// takes sliding windows and any mask.
    AllToAll,
}

impl CpCommType {
    /// Megatron's spelling, or an error naming the ones built.
    pub fn parse(s: &str) -> std::result::Result<Self, String> {
        match s {
            "allgather" | "p2p" => Ok(CpCommType::AllGather),
            "a2a" => Ok(CpCommType::AllToAll),
            "a2a+p2p" => Err(
                "--cp-comm-type a2a+p2p (hierarchical context parallelism, --hierarchical-context-parallel-sizes) is not built: use a2a, allgather or p2p".into(),
            ),
            t => Err(format!("--cp-comm-type {t}: use allgather, p2p or a2a")),
        }
    }
}

#[derive(Clone)]
pub struct ContextParallel {
    pub comm: Comm,
    pub kind: CpCommType,
}

impl std::fmt::Debug for ContextParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ContextParallel({}, rank {} of {}, {:?})", self.comm.name(), self.rank(), self.size(), self.kind)
    }
}

/// Document-wise masks (`AttnCfg::docs`) refused by the all-gather, whose blocks of one query
/// chunk against another key chunk the masks would leave with rows that see no key; the
/// all-to-all takes them (whole rows: `context_heads`).
fn no_docs(op: &'static str, cfg: &AttnCfg) -> Result<()> {
    if cfg.docs.is_some() {
        return Err(invalid(
            op,
            "document-wise attention masks (--reset-attention-mask) under context parallelism need --cp-comm-type a2a (the all-gather splits the keys into blocks): use it or drop one",
        ));
    }
    Ok(())
}

impl ContextParallel {
    /// The all-gather exchange (Megatron's allgather / p2p).
    pub fn new(comm: Comm) -> Self {
        ContextParallel { comm, kind: CpCommType::AllGather }
    }

    /// The same group with the core attention's exchange `kind`.
    pub fn with_kind(&self, kind: CpCommType) -> Self {
        ContextParallel { comm: self.comm.clone(), kind }
    }
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }
    pub fn size(&self) -> usize {
        self.comm.size()
    }

    /// The global chunk indices this rank holds, in local order: r and 2·cp − 1 − r.
    pub fn chunks(&self) -> [usize; 2] {
        chunks_of(self.rank(), self.size())
    }

    /// c = T / (2·cp) for a whole sequence of `seq` tokens, or an error naming the fix.
    pub fn chunk_len(&self, seq: usize) -> Result<usize> {
        let parts = 2 * self.size();
        if seq == 0 || seq % parts != 0 {
            return Err(invalid(
                "context parallel",
                format!(
                    "sequence length {seq} is not divisible by 2 × --context-parallel-size {} = {parts} (each rank holds two chunks): change --seq-length or the context-parallel size",
                    self.size()
                ),
            ));
        }
        Ok(seq / parts)
    }

    /// The global position of row `i` of this rank's local sequence of 2c rows.
    pub fn position(&self, c: usize, i: usize) -> usize {
        let [a, b] = self.chunks();
        if i < c { a * c + i } else { b * c + (i - c) }
    }

    /// This rank's rows of a whole batch laid out on the host [batch, seq] (tokens, labels, a
    /// loss mask): [batch, 2c], chunk r then chunk 2·cp − 1 − r of every sequence.
    pub fn shard_host<T: Copy>(&self, x: &[T], batch: usize, seq: usize) -> Result<Vec<T>> {
        let c = self.chunk_len(seq)?;
        if x.len() != batch * seq {
            return Err(shape_mismatch("ContextParallel::shard_host", format!("[{batch}, {seq}]"), [x.len()]));
        }
        let mut out = Vec::with_capacity(2 * c * batch);
        for row in x.chunks(seq) {
            for p in self.chunks() {
                out.extend_from_slice(&row[p * c..(p + 1) * c]);
            }
        }
        Ok(out)
    }

    /// `cfg` for a local sequence of `t` = 2c rows: its first chunk from position r·c, its second
    /// from (2·cp − 1 − r)·c.
    pub fn rope(&self, cfg: &RopeCfg, t: usize) -> RopeCfg {
        let c = t / 2;
        let [a, b] = self.chunks();
        RopeCfg { pos0: cfg.pos0 + a * c, split: Some(RopeSplit { at: c, pos: cfg.pos0 + b * c }), ..*cfg }
    }

    /// What the core attention accepts under context parallelism: causal, no window; with
    /// dropout, chunks of c a multiple of 16 tokens (a block then covers whole tiles of the
    /// sequence's mask).
    fn check_cfg(&self, op: &'static str, cfg: &AttnCfg, c: usize) -> Result<()> {
        no_docs(op, cfg)?;
        if !cfg.causal || cfg.window.is_some() {
            return Err(invalid(
                op,
                "context parallelism splits causal attention without a sliding window: drop the window or set --context-parallel-size 1",
            ));
        }
        if cfg.dropout.is_some() && c % 16 != 0 {
            return Err(invalid(
                op,
                format!(
                    "attention dropout under --context-parallel-size {} needs chunks of a multiple of 16 tokens (they are {c}): make --seq-length a multiple of {}",
                    self.size(),
                    32 * self.size()
                ),
            ));
        }
        Ok(())
    }

    /// The settings of the block of query chunk `p` against key chunk `pk` (global indices, c
    /// tokens each): causal on the diagonal, whole below it; dropout drawn from the whole
    /// sequence's mask, at the block's tiles.
    fn block_cfg<'a>(&self, cfg: &AttnCfg<'a>, p: usize, pk: usize, c: usize) -> AttnCfg<'a> {
        let dropout = cfg.dropout.map(|d| {
            let tiles = (2 * self.size() * c).div_ceil(16) as u64;
            let first = ((p * c / 16) as u64).wrapping_mul(tiles).wrapping_add((pk * c / 16) as u64);
            AttnDropout { base: d.base.wrapping_add(first.wrapping_mul(32)), tiles: Some((tiles, tiles)), ..d }
        });
        AttnCfg { causal: p == pk, dropout, ..*cfg }
    }

    /// K or V of every rank, chunk-major: [2·cp, B, c, H, D] (rank j's chunk g at 2j + g).
    fn gather(&self, x_cm: &Tensor) -> Result<Tensor> {
        let mut dims = vec![2 * self.size()];
        dims.extend_from_slice(&x_cm.dims()[1..]);
        // The collective writes every element of its output.
        let all = Tensor::empty(dims, x_cm.dtype(), x_cm.device())?;
        self.comm.all_gather(&x_cm.contiguous()?, &all).map_err(comm_err)?;
        Ok(all)
    }

    /// The (key rank, key chunk) blocks that query chunk `h` of this rank sees, the diagonal (its
    /// own chunk, causal) first, then every chunk before it (whole).
    fn blocks(&self, h: usize) -> Vec<(usize, usize)> {
        let p = self.chunks()[h];
        let mut out = vec![(self.rank(), h)];
        for j in 0..self.size() {
            for (g, pj) in chunks_of(j, self.size()).into_iter().enumerate() {
                if pj < p {
                    out.push((j, g));
                }
            }
        }
        out
    }

    /// Core attention over the whole sequence for this rank's queries: (o [B, 2c, Hq, D], lse
    /// [2, B, Hq, c] under the all-gather, [B, Hq, 2c] under the all-to-all).
    pub fn attention_fwd(&self, q: &Tensor, kk: &Tensor, v: &Tensor, cfg: &AttnCfg) -> Result<(Tensor, Tensor)> {
        if self.kind == CpCommType::AllToAll {
            return self.heads_attention_fwd(q, kk, v, cfg);
        }
        const OP: &str = "context-parallel attention_fwd";
        let [b, t, hq, d] = dims4(OP, q)?;
        self.check_cfg(OP, cfg, t / 2)?;
        let (q_cm, k_cm, v_cm) = (chunk_major(q)?, chunk_major(kk)?, chunk_major(v)?);
        let (k_all, v_all) = (self.gather(&k_cm)?, self.gather(&v_cm)?);
        let c = t / 2;
        let o_cm = Tensor::empty([2, b, c, hq, d], DType::F32, q.device())?;
        let lse_cm = Tensor::empty([2, b, hq, c], DType::F32, q.device())?;
        let n = self.size();
        for h in 0..2 {
            let (qh, oh, lh) = (chunk(&q_cm, h)?, chunk(&o_cm, h)?, chunk(&lse_cm, h)?);
            for (i, (j, g)) in self.blocks(h).into_iter().enumerate() {
                let (kb, vb) = (chunk(&k_all, 2 * j + g)?, chunk(&v_all, 2 * j + g)?);
                let bc = self.block_cfg(cfg, self.chunks()[h], chunks_of(j, n)[g], c);
                let (o, lse) = k::attention_fwd(&qh, &kb, &vb, &bc)?;
                if i == 0 {
                    k::copy_(&oh, &o)?;
                    k::copy_(&lh, &lse)?;
                } else {
                    k::attention_merge_(&oh, &lh, &o, &lse)?;
                }
            }
        }
        let o_cm = if q.dtype() == DType::F32 { o_cm } else { k::cast(&o_cm, q.dtype())? };
        Ok((batch_major(&o_cm)?, lse_cm))
    }

    /// The gradients (dq, dk, dv) of `attention_fwd`'s (o, lse) for dout, in q's and k's layouts.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_bwd(
        &self,
        q: &Tensor,
        kk: &Tensor,
        v: &Tensor,
        o: &Tensor,
        lse: &Tensor,
        dout: &Tensor,
        cfg: &AttnCfg,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        if self.kind == CpCommType::AllToAll {
            return self.heads_attention_bwd(q, kk, v, o, lse, dout, cfg);
        }
        const OP: &str = "context-parallel attention_bwd";
        let [b, t, hq, d] = dims4(OP, q)?;
        let [_, _, hkv, _] = dims4(OP, kk)?;
        let c = t / 2;
        self.check_cfg(OP, cfg, c)?;
        if lse.dims() != [2, b, hq, c] {
            return Err(shape_mismatch(OP, format!("lse [2, {b}, {hq}, {c}] (the forward's)"), lse.dims()));
        }
        let (q_cm, k_cm, v_cm) = (chunk_major(q)?, chunk_major(kk)?, chunk_major(v)?);
        let (o_cm, do_cm) = (chunk_major(o)?, chunk_major(dout)?);
        let (k_all, v_all) = (self.gather(&k_cm)?, self.gather(&v_cm)?);
        let n = self.size();
        let dev = q.device();
        let dq_cm = Tensor::zeros([2, b, c, hq, d], DType::F32, dev)?;
        let dk_all = Tensor::zeros([2 * n, b, c, hkv, d], DType::F32, dev)?;
        let dv_all = Tensor::zeros([2 * n, b, c, hkv, d], DType::F32, dev)?;
        for h in 0..2 {
            let (qh, oh, lh, doh, dqh) =
                (chunk(&q_cm, h)?, chunk(&o_cm, h)?, chunk(lse, h)?, chunk(&do_cm, h)?, chunk(&dq_cm, h)?);
            for (j, g) in self.blocks(h) {
                let kv = 2 * j + g;
                let (kb, vb) = (chunk(&k_all, kv)?, chunk(&v_all, kv)?);
                let bc = self.block_cfg(cfg, self.chunks()[h], chunks_of(j, n)[g], c);
                let (dq, dk, dv) = k::attention_bwd(&qh, &kb, &vb, &oh, &lh, &doh, &bc)?;
                k::add_(&dqh, &dq)?;
                k::add_(&chunk(&dk_all, kv)?, &dk)?;
                k::add_(&chunk(&dv_all, kv)?, &dv)?;
            }
        }
        // Each rank's key rows' gradients, summed over every rank's queries.
        let scatter = |all: &Tensor| -> Result<Tensor> {
            let mine = Tensor::empty([2, b, c, hkv, d], DType::F32, dev)?;
            self.comm.reduce_scatter(all, &mine, ReduceOp::Sum).map_err(comm_err)?;
            Ok(mine)
        };
        let (dk_cm, dv_cm) = (scatter(&dk_all)?, scatter(&dv_all)?);
        let back = |x: Tensor, dt: DType| -> Result<Tensor> {
            let x = if dt == DType::F32 { x } else { k::cast(&x, dt)? };
            batch_major(&x)
        };
        let dt = dout.dtype();
        Ok((back(dq_cm, dt)?, back(dk_cm, dt)?, back(dv_cm, dt)?))
    }
}

/// Rank r's global chunk indices among 2·n: r and 2n − 1 − r.
pub(crate) fn chunks_of(r: usize, n: usize) -> [usize; 2] {
    [r, 2 * n - 1 - r]
}

pub(crate) fn dims4(op: &'static str, x: &Tensor) -> Result<[usize; 4]> {
    match *x.dims() {
        [b, t, h, d] if t % 2 == 0 => Ok([b, t, h, d]),
        _ => Err(shape_mismatch(op, "[batch, 2 × chunk, heads, head dim]", x.dims())),
    }
}

/// [B, 2c, …] → [2, B, c, …] (a view when B = 1).
fn chunk_major(x: &Tensor) -> Result<Tensor> {
    let d = x.dims();
    let (b, c) = (d[0], d[1] / 2);
    let rest: usize = d[2..].iter().product();
    let mut out = vec![2, b, c];
    out.extend_from_slice(&d[2..]);
    let x = x.contiguous()?;
    if b == 1 {
        return x.reshape(out);
    }
    x.reshape([b, 2, c * rest])?.transpose(0, 1)?.contiguous()?.reshape(out)
}

/// [2, B, c, …] → [B, 2c, …], the inverse of `chunk_major`.
fn batch_major(x: &Tensor) -> Result<Tensor> {
    let d = x.dims();
    let (b, c) = (d[1], d[2]);
    let rest: usize = d[3..].iter().product();
    let mut out = vec![b, 2 * c];
    out.extend_from_slice(&d[3..]);
    if b == 1 {
        return x.contiguous()?.reshape(out);
    }
    x.contiguous()?.reshape([2, b, c * rest])?.transpose(0, 1)?.contiguous()?.reshape(out)
}

/// Block `i` of the outermost dimension, without it: a contiguous view.
fn chunk(x: &Tensor, i: usize) -> Result<Tensor> {
    let v = x.narrow0(i..i + 1)?;
    v.reshape(x.dims()[1..].to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrotron_comm::thread_world;
    use std::time::Duration;

    #[test]
    fn each_rank_holds_a_chunk_from_each_end() {
        let worlds = thread_world(1, Duration::from_secs(5));
        let cp = ContextParallel::new(worlds[0].clone());
        assert_eq!(cp.chunks(), [0, 1]);
        assert_eq!(chunks_of(1, 4), [1, 6]);
        assert_eq!(chunks_of(3, 4), [3, 4]);
        let e = cp.chunk_len(7).unwrap_err().to_string();
        assert!(e.contains("--seq-length") && e.contains("7"), "{e}");
        // [2 samples, 4 tokens] at cp 1: chunks 0 and 1 of two tokens each, in order.
        let x: Vec<u32> = (0..8).collect();
        assert_eq!(cp.shard_host(&x, 2, 4).unwrap(), x);
    }

    #[test]
    fn chunk_major_round_trips() {
        let dev = ferrotron_core::Device::Cpu;
        for b in [1, 3] {
            let x = Tensor::from_vec((0..b * 6 * 2).map(|i| i as f32).collect(), [b, 6, 2], &dev).unwrap();
            let cm = chunk_major(&x).unwrap();
            // Chunk 1 of batch row 0 is rows 3..6 of it.
            assert_eq!(chunk(&cm, 1).unwrap().to_vec_f32().unwrap()[..6], [6.0, 7.0, 8.0, 9.0, 10.0, 11.0]);
            assert_eq!(batch_major(&cm).unwrap().to_vec_f32().unwrap(), x.to_vec_f32().unwrap());
        }
    }
}
