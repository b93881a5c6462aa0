//! Runs a schedule on one pipeline rank: receives each forward's input from the previous stage and
//! sends its output on; receives each backward's output gradient from the next stage and sends the
//! input gradient back. Shapes are agreed up front: every inter-stage tensor is the hidden state
//! of one micro-batch, `activation` here.
//!
//! All of it travels on one point-to-point group (as Megatron's), batched per step: the sends the
//! previous step owes and the receives this step needs go out together (`plan_steps`). NCCL's
//! sends wait for their receivers once a tensor outgrows its buffers and a rank's NCCL work runs
//! in order on one stream, so a rank must never wait in one exchange for what its peer posts in a
//! later one; and messages between a pair are matched in the order posted, so both ends must post
//! activations and gradients in the same order (with interleaving a pair carries both). A test
//! runs every schedule under those rules. (Two groups for the two directions looked tidier but
//! hung on two H200s: a batch spanning two NCCL communicators runs as one kernel per
//! communicator, one after the other.)

use super::schedule::Action;
use crate::groups::Comm;
use crate::{ParallelError, Result};
use ferrotron_comm::{P2p, exchange};
use ferrotron_core::{DType, Device, Tensor};

/// The point-to-point group of a pipeline (same ranks as the pp group).
pub struct PipelineComms {
    pub p2p: Comm,
}

impl PipelineComms {
    /// Collective over the world (splits are): call on every rank with the layout's pp groups.
    pub fn new(world: &Comm, pp_groups: &[Vec<usize>]) -> Result<PipelineComms> {
        match world.split("pp-p2p", pp_groups)? {
            Some(p2p) => {
                // Both neighbours, both directions, linked up front (see `Communicator::connect`).
                let (r, p) = (p2p.rank(), p2p.size());
                p2p.connect(&[(r + p - 1) % p, (r + 1) % p])?;
                Ok(PipelineComms { p2p })
            }
            None => Err(ParallelError::Layout(format!("rank {} is in no pipeline group", world.rank()))),
        }
    }
}

/// One pipeline rank's model chunks, driven by the executor. The runner keeps each pass's saved
/// activations until its backward.
pub trait StageRunner {
    /// Forward of micro-batch `micro` through chunk `chunk`; `input` is the previous stage's output
    /// (None on the first stage's first chunk, which embeds tokens). Returns the output to send on
    /// (None on the last stage's last chunk, which computes the loss).
    fn forward(&mut self, chunk: usize, micro: usize, input: Option<Tensor>) -> Result<Option<Tensor>>;
    /// Backward of that pass; `dy` is the next stage's input gradient (None where the loss is).
    /// Returns the gradient of this chunk's input (None on the first chunk of the first stage).
    fn backward(&mut self, chunk: usize, micro: usize, dy: Option<Tensor>) -> Result<Option<Tensor>>;
    /// Shape and dtype of the hidden state passed between stages, and where it lives.
    fn activation(&self) -> (Vec<usize>, DType, Device);
}

fn missing(what: &str, chunk: usize, micro: usize) -> ParallelError {
    ParallelError::Layout(format!("pipeline: chunk {chunk} produced no {what} for micro-batch {micro}"))
}

/// What a transfer carries (both travel on the pipeline's one group).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Dir {
    /// Activations, towards the next stage.
    Fwd,
    /// Input gradients, towards the previous stage.
    Bwd,
}

/// The transfers a rank issues together between two runs of compute: the sends the previous step's
/// passes owe and the receives this step's passes need, each (what, peer), activations first. Batching them keeps
/// backends whose sends wait for the receiver (NCCL) from deadlocking: neighbours that each send
/// and receive do both in one exchange, as Megatron's `send_forward_recv_backward`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Exchange {
    pub sends: Vec<(Dir, usize)>,
    pub recvs: Vec<(Dir, usize)>,
}

/// The passes of one step (a range of the schedule's actions) and the exchange before them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Step {
    pub actions: std::ops::Range<usize>,
    pub before: Exchange,
}

/// How pipeline rank `r` of `p` runs `actions` with `chunks` chunks per rank: steps of one pass,
/// except that with interleaving each forward + backward pair of the steady state is one step
/// with one exchange on either side, as Megatron batches that schedule's transfers (1F1B needs no
/// pairing: an exchange between its forward and backward is what Megatron does there too). The
/// last step holds no passes: it sends what the last pass owes.
pub fn plan_steps(actions: &[Action], r: usize, p: usize, chunks: usize) -> Vec<Step> {
    let (prev, next) = ((r + p - 1) % p, (r + 1) % p);
    let first = |c: usize| r == 0 && c == 0;
    let last = |c: usize| r == p - 1 && c == chunks - 1;
    // Steady state: after the leading forwards but one, alternating pairs; with no backward
    // inside the leading run (every forward first) there is none.
    let lead = actions.iter().take_while(|a| matches!(a, Action::Forward { .. })).count();
    let warmup = if 2 * lead >= actions.len() { lead } else { lead.saturating_sub(1) };
    let steady = warmup..actions.len() - warmup.min(actions.len());
    let mut steps: Vec<Step> = Vec::new();
    let mut owed: Vec<(Dir, usize)> = Vec::new();
    let mut i = 0;
    while i < actions.len() {
        let pair = chunks > 1
            && steady.contains(&i)
            && matches!(actions[i], Action::Forward { .. })
            && matches!(actions.get(i + 1), Some(Action::Backward { .. }));
        let end = if pair { i + 2 } else { i + 1 };
        let mut before = Exchange { sends: std::mem::take(&mut owed), recvs: vec![] };
        for a in &actions[i..end] {
            match *a {
                Action::Forward { chunk, .. } => {
                    before.recvs.extend((!first(chunk)).then_some((Dir::Fwd, prev)));
                    owed.extend((!last(chunk)).then_some((Dir::Fwd, next)));
                }
                Action::Backward { chunk, .. } => {
                    before.recvs.extend((!last(chunk)).then_some((Dir::Bwd, next)));
                    owed.extend((!first(chunk)).then_some((Dir::Bwd, prev)));
                }
            }
        }
        steps.push(Step { actions: i..end, before });
        i = end;
    }
    steps.push(Step { actions: i..i, before: Exchange { sends: owed, recvs: vec![] } });
    steps
}

/// Runs `actions` (this rank's schedule) with `chunks` model chunks per rank.
pub fn run_schedule(
    actions: &[Action],
    comms: &PipelineComms,
    chunks: usize,
    runner: &mut dyn StageRunner,
) -> Result<()> {
    let (r, p) = (comms.p2p.rank(), comms.p2p.size());
    let (first, last) = (|c: usize| r == 0 && c == 0, |c: usize| r == p - 1 && c == chunks - 1);
    let (shape, dtype, dev) = runner.activation();
    let comm = comms.p2p.as_ref();
    // What the previous step's passes owe their neighbours, in the plan's order.
    let mut owed: Vec<Tensor> = Vec::new();
    for step in plan_steps(actions, r, p, chunks) {
        if owed.len() != step.before.sends.len() {
            return Err(ParallelError::Layout(format!(
                "pipeline rank {r}: {} tensors to send where the plan has {} sends",
                owed.len(),
                step.before.sends.len()
            )));
        }
        let mut incoming = step
            .before
            .recvs
            .iter()
            .map(|_| Tensor::zeros(shape.clone(), dtype, &dev))
            .collect::<Result<Vec<_>, _>>()?;
        let sends = step.before.sends.iter().zip(&owed).map(|(&(_, dst), t)| P2p::Send { comm, t, dst });
        let recvs = step.before.recvs.iter().zip(&incoming).map(|(&(_, src), t)| P2p::Recv { comm, t, src });
        exchange(&sends.chain(recvs).collect::<Vec<_>>())?;
        // The sent tensors may be dropped now: the compute stream waits for NCCL before reusing
        // their memory.
        owed.clear();
        incoming.reverse();
        for a in &actions[step.actions] {
            match *a {
                Action::Forward { chunk, micro } => {
                    let input = if first(chunk) { None } else { incoming.pop() };
                    let out = runner.forward(chunk, micro, input)?;
                    if !last(chunk) {
                        owed.push(out.ok_or_else(|| missing("output", chunk, micro))?);
                    }
                }
                Action::Backward { chunk, micro } => {
                    let dy = if last(chunk) { None } else { incoming.pop() };
                    let dx = runner.backward(chunk, micro, dy)?;
                    if !first(chunk) {
                        owed.push(dx.ok_or_else(|| missing("input gradient", chunk, micro))?);
                    }
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::{ScheduleKind, schedule};
    use std::collections::HashMap;

    /// Runs every rank's exchanges under NCCL's rules for one group: messages between a pair are
    /// matched in the order posted (so both ends must agree on what the k-th one carries); a
    /// transfer completes only once both ends are posted, an exchange only once all its transfers
    /// have, and a rank posts its next exchange only after the current one completed (one stream,
    /// in order). Err says what went wrong.
    fn simulate(plans: &[Vec<Step>]) -> std::result::Result<(), String> {
        let p = plans.len();
        // Per pair (src, dst), in the order posted: (exchange index, what) of sends and receives.
        type Posts = HashMap<(usize, usize), Vec<(usize, Dir)>>;
        let (mut sends, mut recvs): (Posts, Posts) = Default::default();
        for (r, plan) in plans.iter().enumerate() {
            for (i, st) in plan.iter().enumerate() {
                for &(d, o) in &st.before.sends {
                    sends.entry((r, o)).or_default().push((i, d));
                }
                for &(d, o) in &st.before.recvs {
                    recvs.entry((o, r)).or_default().push((i, d));
                }
            }
        }
        // needs[r][i]: the (rank, exchange) each transfer of rank r's exchange i waits for.
        let mut needs: Vec<Vec<Vec<(usize, usize)>>> = plans.iter().map(|pl| vec![vec![]; pl.len()]).collect();
        for (&(src, dst), s) in &sends {
            let r = recvs.get(&(src, dst)).map_or(&[][..], Vec::as_slice);
            if r.len() != s.len() {
                return Err(format!("{src} → {dst}: {} sends, {} receives", s.len(), r.len()));
            }
            for (k, (&(si, sd), &(ri, rd))) in s.iter().zip(r).enumerate() {
                if sd != rd {
                    return Err(format!("{src} → {dst}: message {k} sent as {sd:?}, received as {rd:?}"));
                }
                needs[src][si].push((dst, ri));
                needs[dst][ri].push((src, si));
            }
        }
        if let Some((pair, _)) = recvs.iter().find(|(k, _)| !sends.contains_key(k)) {
            return Err(format!("{pair:?}: receives with no sends"));
        }
        let mut pos = vec![0usize; p];
        loop {
            let mut moved = false;
            for r in 0..p {
                while pos[r] < plans[r].len() && needs[r][pos[r]].iter().all(|&(o, j)| pos[o] >= j) {
                    pos[r] += 1;
                    moved = true;
                }
            }
            if pos.iter().zip(plans).all(|(&i, pl)| i == pl.len()) {
                return Ok(());
            }
            if !moved {
                return Err(format!("deadlock at exchange positions {pos:?}"));
            }
        }
    }

    #[test]
    fn every_schedule_completes_when_sends_wait_for_receivers() {
        let mut cases = 0;
        for p in 1..=5 {
            for m in 1..=12 {
                for v in 1..=3 {
                    let kind = match (p, v) {
                        (1, 1) => ScheduleKind::NoPipelining,
                        (_, 1) => ScheduleKind::OneFOneB,
                        (1, _) => continue,
                        (_, v) => ScheduleKind::Interleaved { chunks: v },
                    };
                    let Ok(plans) = (0..p)
                        .map(|r| schedule(kind, p, r, m).map(|a| plan_steps(&a, r, p, v)))
                        .collect::<Result<Vec<_>>>()
                    else {
                        continue; // e.g. interleaving with micro-batches not a multiple of pp
                    };
                    simulate(&plans).unwrap_or_else(|e| panic!("{kind:?} pp {p} micro {m}: {e}"));
                    cases += 1;
                }
            }
        }
        assert!(cases > 80, "only {cases} schedules checked");
    }

    #[test]
    fn simulator_catches_crossed_sends() {
        // Both neighbours send first and receive after, in separate exchanges: the classic
        // deadlock of unbatched blocking sends.
        let x = |sends, recvs| Step { actions: 0..0, before: Exchange { sends, recvs } };
        let s = |d| x(vec![(Dir::Fwd, d)], vec![]);
        let r = |d| x(vec![], vec![(Dir::Fwd, d)]);
        assert!(simulate(&[vec![s(1), r(1)], vec![s(0), r(0)]]).is_err());
        assert!(simulate(&[vec![s(1), r(1)], vec![r(0), s(0)]]).is_ok());
        // Activation then gradient sent, gradient then activation expected: a silent swap.
        let both = |sends, recvs| x(sends, recvs);
        let swapped = simulate(&[
            vec![both(vec![(Dir::Fwd, 1), (Dir::Bwd, 1)], vec![])],
            vec![both(vec![], vec![(Dir::Bwd, 0), (Dir::Fwd, 0)])],
        ]);
        assert!(swapped.unwrap_err().contains("sent as Fwd, received as Bwd"));
    }
}
