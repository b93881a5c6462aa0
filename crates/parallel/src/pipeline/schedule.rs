//! Pipeline schedules as data: for each pipeline rank, the ordered list of forward and backward
//! passes (model chunk, micro-batch) it runs. Megatron's three:
//!
//! - no pipelining: every forward then... for one stage, forward and backward of each micro-batch
//!   in turn (gradient accumulation);
//! - 1F1B: rank r first runs pp − r − 1 warm-up forwards, then alternates one forward and one
//!   backward, then drains the remaining backwards;
//! - interleaved 1F1B: with v model chunks per rank, micro-batches go through the chunks in groups
//!   of pp; warm-up is (pp − r − 1)·2 + (v − 1)·pp forwards. Needs the micro-batch count to be a
//!   multiple of pp.

use crate::{ParallelError, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    Forward { chunk: usize, micro: usize },
    Backward { chunk: usize, micro: usize },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScheduleKind {
    NoPipelining,
    OneFOneB,
    Interleaved { chunks: usize },
}

/// The actions of pipeline rank `rank` of `pp` for `micro` micro-batches.
pub fn schedule(kind: ScheduleKind, pp: usize, rank: usize, micro: usize) -> Result<Vec<Action>> {
    use Action::*;
    if micro == 0 {
        return Err(ParallelError::Layout("a step needs at least one micro-batch".into()));
    }
    Ok(match kind {
        ScheduleKind::NoPipelining => {
            (0..micro).flat_map(|m| [Forward { chunk: 0, micro: m }, Backward { chunk: 0, micro: m }]).collect()
        }
        ScheduleKind::OneFOneB => {
            let warmup = (pp - rank - 1).min(micro);
            let mut a: Vec<Action> = (0..warmup).map(|m| Forward { chunk: 0, micro: m }).collect();
            for i in 0..micro - warmup {
                a.push(Forward { chunk: 0, micro: warmup + i });
                a.push(Backward { chunk: 0, micro: i });
            }
            a.extend((micro - warmup..micro).map(|m| Backward { chunk: 0, micro: m }));
            a
        }
        ScheduleKind::Interleaved { chunks: v } => {
            if micro % pp != 0 {
                return Err(ParallelError::Layout(format!(
                    "the interleaved schedule needs the micro-batches per step ({micro}) to be a multiple of --pipeline-model-parallel-size {pp}: change --global-batch-size or --micro-batch-size"
                )));
            }
            let total = micro * v;
            let at = |k: usize, forward: bool| {
                let in_group = k % (pp * v);
                let c = in_group / pp;
                let chunk = if forward { c } else { v - 1 - c };
                (chunk, (k / (pp * v)) * pp + k % pp)
            };
            let warmup = if micro == pp { total } else { ((pp - rank - 1) * 2 + (v - 1) * pp).min(total) };
            let f = |k| {
                let (chunk, micro) = at(k, true);
                Forward { chunk, micro }
            };
            let b = |k| {
                let (chunk, micro) = at(k, false);
                Backward { chunk, micro }
            };
            let mut a: Vec<Action> = (0..warmup).map(f).collect();
            for k in 0..total - warmup {
                a.push(f(warmup + k));
                a.push(b(k));
            }
            a.extend((total - warmup..total).map(b));
            a
        }
    })
}

/// One line per stage: `stage r: F0 F1 B0 ...` (`F3.1` = micro-batch 3 through chunk 1 when
/// interleaved).
pub fn render(kind: ScheduleKind, pp: usize, micro: usize) -> Result<String> {
    let mut out = String::new();
    for r in 0..pp {
        let acts = schedule(kind, pp, r, micro)?;
        let items: Vec<String> = acts
            .iter()
            .map(|a| {
                let (l, c, m) = match *a {
                    Action::Forward { chunk, micro } => ('F', chunk, micro),
                    Action::Backward { chunk, micro } => ('B', chunk, micro),
                };
                if matches!(kind, ScheduleKind::Interleaved { .. }) { format!("{l}{m}.{c}") } else { format!("{l}{m}") }
            })
            .collect();
        out += &format!("stage {r}: {}\n", items.join(" "));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_f_one_b_orders() {
        let s = render(ScheduleKind::OneFOneB, 4, 6).unwrap();
        assert_eq!(
            s,
            "stage 0: F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5\n\
             stage 1: F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5\n\
             stage 2: F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5\n\
             stage 3: F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5\n"
        );
        // Fewer micro-batches than stages: all warm-up.
        assert_eq!(render(ScheduleKind::OneFOneB, 4, 2).unwrap().lines().next(), Some("stage 0: F0 F1 B0 B1"));
    }

    #[test]
    fn interleaved_orders() {
        // pp 2, 2 chunks, 4 micro-batches: groups of 2 micro-batches per chunk.
        let s = render(ScheduleKind::Interleaved { chunks: 2 }, 2, 4).unwrap();
        assert_eq!(
            s,
            "stage 0: F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 B2.1 B3.1 B2.0 B3.0\n\
             stage 1: F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 B2.0 B3.0\n"
        );
        let e = schedule(ScheduleKind::Interleaved { chunks: 2 }, 4, 0, 6).unwrap_err().to_string();
        assert!(e.contains("multiple of --pipeline-model-parallel-size 4"), "{e}");
    }

    #[test]
    fn every_pass_runs_once_and_backward_follows_forward() {
        for (kind, pp, m) in [
            (ScheduleKind::OneFOneB, 4, 8),
            (ScheduleKind::Interleaved { chunks: 3 }, 2, 4),
            (ScheduleKind::Interleaved { chunks: 2 }, 4, 8),
        ] {
            let v = if let ScheduleKind::Interleaved { chunks } = kind { chunks } else { 1 };
            for r in 0..pp {
                let a = schedule(kind, pp, r, m).unwrap();
                assert_eq!(a.len(), 2 * m * v);
                for (i, x) in a.iter().enumerate() {
                    if let Action::Backward { chunk, micro } = *x {
                        assert!(a[..i].contains(&Action::Forward { chunk, micro }), "{kind:?} rank {r}: {x:?}");
                        assert_eq!(a.iter().filter(|y| **y == *x).count(), 1);
                    }
                }
            }
        }
    }
}
