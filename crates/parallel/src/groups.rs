//! The communicators of one rank, for every group kind of the layout.

use crate::layout::{Dim, Layout};
use crate::{ParallelError, Result};
use ferrotron_comm::{Communicator, thread_world};
use std::sync::Arc;
use std::time::Duration;

pub type Comm = Arc<dyn Communicator>;

/// Every group this rank belongs to. Built collectively: every rank of the world calls `new` with
/// the same layout (NCCL's split is collective).
pub struct ProcessGroups {
    pub layout: Layout,
    pub world: Comm,
    /// Tensor parallel: splits layers.
    pub tp: Comm,
    /// Context parallel: splits sequences.
    pub cp: Comm,
    /// Data parallel (without context parallel).
    pub dp: Comm,
    /// Data × context parallel: where gradients are averaged.
    pub dp_cp: Comm,
    /// Pipeline stages.
    pub pp: Comm,
    /// Tensor × pipeline: one whole replica of the model (gradient norms sum over it).
    pub mp: Comm,
    /// First and last pipeline stage (tied embedding/output weights); `None` on middle stages.
    pub embd: Option<Comm>,
    /// Expert parallel and expert data parallel (the expert grid).
    pub ep: Comm,
    pub edp: Comm,
    /// Point-to-point groups between pipeline stages (activations, gradients).
    pub pipeline: crate::pipeline::PipelineComms,
}

impl ProcessGroups {
    pub fn new(world: Comm, layout: Layout) -> Result<ProcessGroups> {
        if world.size() != layout.world() {
            return Err(ParallelError::Layout(format!(
                "the layout needs {} ranks (tp {} × cp {} × dp {} × pp {}) but the world has {}",
                layout.world(),
                layout.tp,
                layout.cp,
                layout.dp,
                layout.pp,
                world.size()
            )));
        }
        let (dense, expert) = (layout.dense(), layout.expert());
        let split = |name: &str, groups: Vec<Vec<usize>>| -> Result<Option<Comm>> { Ok(world.split(name, &groups)?) };
        let must = |name: &'static str, c: Option<Comm>| {
            c.ok_or_else(|| ParallelError::Layout(format!("rank {} is in no {name} group", world.rank())))
        };
        let tp = must("tp", split("tp", dense.groups(&[Dim::Tp]))?)?;
        let cp = must("cp", split("cp", dense.groups(&[Dim::Cp]))?)?;
        let dp = must("dp", split("dp", dense.groups(&[Dim::Dp]))?)?;
        let dp_cp = must("dp-cp", split("dp-cp", dense.groups(&[Dim::Dp, Dim::Cp]))?)?;
        let pp_groups = dense.groups(&[Dim::Pp]);
        let pp = must("pp", split("pp", pp_groups.clone())?)?;
        let mp = must("mp", split("mp", dense.groups(&[Dim::Tp, Dim::Pp]))?)?;
        let embd_groups: Vec<Vec<usize>> =
            pp_groups.iter().map(|g| if g.len() == 1 { vec![g[0]] } else { vec![g[0], g[g.len() - 1]] }).collect();
        let embd = split("embd", embd_groups)?;
        let ep = must("ep", split("ep", expert.groups(&[Dim::Ep]))?)?;
        let edp = must("edp", split("edp", expert.groups(&[Dim::Dp]))?)?;
        let pipeline = crate::pipeline::PipelineComms::new(&world, &pp_groups)?;
        Ok(ProcessGroups { layout, world, tp, cp, dp, dp_cp, pp, mp, embd, ep, edp, pipeline })
    }

    /// One rank alone: every group has size 1 (no communication happens).
    pub fn single() -> ProcessGroups {
        let world = thread_world(1, Duration::from_secs(60)).remove(0);
        let layout = Layout { tp: 1, cp: 1, ep: 1, dp: 1, pp: 1, etp: 1 };
        ProcessGroups::new(world, layout).expect("a world of one fits the layout of one")
    }

    pub fn is_first_stage(&self) -> bool {
        self.pp.rank() == 0
    }
    pub fn is_last_stage(&self) -> bool {
        self.pp.rank() + 1 == self.pp.size()
    }

    /// One line per group kind: this rank's position and the group's members.
    pub fn describe(&self) -> String {
        let mut s = format!("world rank {}:", self.world.rank());
        for (k, c) in [("tp", &self.tp), ("cp", &self.cp), ("dp", &self.dp), ("pp", &self.pp)] {
            s += &format!(" {k} {}/{} {}", c.rank(), c.size(), c.name());
        }
        s
    }
}
