//! Megatron's rank layout as pure arithmetic (its RankGenerator).
//!
//! The world is a grid of sizes in the order `tp-cp-ep-dp-pp` (tensor parallel varies fastest).
//! A group kind is a mask over those dimensions: e.g. `dp` groups are the ranks that share every
//! coordinate except dp. Experts use a second grid `tp-ep-edp-pp` over the same ranks whose pp
//! groups are the same as the first's.

use crate::{ParallelError, Result};

/// One dimension of the grid.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dim {
    Tp,
    Cp,
    Ep,
    Dp,
    Pp,
}

impl Dim {
    pub fn name(self) -> &'static str {
        match self {
            Dim::Tp => "tp",
            Dim::Cp => "cp",
            Dim::Ep => "ep",
            Dim::Dp => "dp",
            Dim::Pp => "pp",
        }
    }
}

/// Sizes of a grid, fastest-varying first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Grid {
    pub dims: Vec<(Dim, usize)>,
}

impl Grid {
    pub fn world(&self) -> usize {
        self.dims.iter().map(|d| d.1).product()
    }

    /// Every group of the kind spanning `span` (e.g. `[Tp]` or `[Tp, Pp]`), each listing its
    /// ranks in order of the spanned coordinates; groups ordered by the remaining coordinates.
    pub fn groups(&self, span: &[Dim]) -> Vec<Vec<usize>> {
        let mut stride = 1;
        let (mut inside, mut outside) = (vec![], vec![]); // (size, stride)
        for &(d, n) in &self.dims {
            if span.contains(&d) {
                inside.push((n, stride))
            } else {
                outside.push((n, stride))
            }
            stride *= n;
        }
        let count = |v: &[(usize, usize)]| v.iter().map(|x| x.0).product::<usize>();
        let at = |v: &[(usize, usize)], mut i: usize| {
            v.iter().fold(0, |acc, &(n, s)| {
                let c = i % n;
                i /= n;
                acc + c * s
            })
        };
        (0..count(&outside)).map(|g| (0..count(&inside)).map(|r| at(&outside, g) + at(&inside, r)).collect()).collect()
    }

    /// This rank's coordinate along `d`.
    pub fn coord(&self, rank: usize, d: Dim) -> usize {
        let mut r = rank;
        for &(dd, n) in &self.dims {
            if dd == d {
                return r % n;
            }
            r /= n;
        }
        0
    }
}

/// Parallel sizes of a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub tp: usize,
    pub cp: usize,
    pub ep: usize,
    pub dp: usize,
    pub pp: usize,
    /// The experts' tensor-parallel size (--expert-tensor-parallel-size): tp (Megatron's
    /// default) or 1 (`with_expert_tp`).
    pub etp: usize,
}

impl Layout {
    /// Derives dp from the world size, as Megatron does; errors name the flags.
    pub fn new(world: usize, tp: usize, pp: usize, cp: usize, ep: usize) -> Result<Layout> {
        for (v, flag) in [
            (tp, "--tensor-model-parallel-size"),
            (pp, "--pipeline-model-parallel-size"),
            (cp, "--context-parallel-size"),
            (ep, "--expert-model-parallel-size"),
        ] {
            if v == 0 {
                return Err(ParallelError::Layout(format!("{flag} must be at least 1")));
            }
        }
        let mp = tp * pp * cp;
        if world % mp != 0 {
            return Err(ParallelError::Layout(format!(
                "world size {world} is not divisible by --tensor-model-parallel-size {tp} × --pipeline-model-parallel-size {pp} × --context-parallel-size {cp} = {mp}: change the sizes or the number of ranks"
            )));
        }
        let dp = world / mp;
        if (dp * cp) % ep != 0 {
            return Err(ParallelError::Layout(format!(
                "data-parallel × context-parallel size {} is not divisible by --expert-model-parallel-size {ep}",
                dp * cp
            )));
        }
        Ok(Layout { tp, cp, ep, dp, pp, etp: tp })
    }

    /// `new` with the experts split over `etp` ranks (--expert-tensor-parallel-size) instead of
    /// tp: the expert grid's etp × ep must divide a pipeline stage's tp × cp × dp ranks.
    pub fn with_expert_tp(world: usize, tp: usize, pp: usize, cp: usize, ep: usize, etp: usize) -> Result<Layout> {
        if etp == tp {
            return Self::new(world, tp, pp, cp, ep);
        }
        let dense = Self::new(world, tp, pp, cp, 1)?;
        let stage = tp * cp * dense.dp;
        if etp == 0 || ep == 0 || stage % (etp * ep) != 0 {
            return Err(ParallelError::Layout(format!(
                "--expert-tensor-parallel-size {etp} × --expert-model-parallel-size {ep} does not divide the {stage} ranks of a pipeline stage (tensor × context × data parallel)"
            )));
        }
        Ok(Layout { ep, etp, ..dense })
    }

    pub fn world(&self) -> usize {
        self.tp * self.cp * self.dp * self.pp
    }

    /// The dense grid `tp-cp-ep-dp-pp` (ep is 1 here: dense layers do not split over experts).
    pub fn dense(&self) -> Grid {
        Grid {
            dims: vec![(Dim::Tp, self.tp), (Dim::Cp, self.cp), (Dim::Ep, 1), (Dim::Dp, self.dp), (Dim::Pp, self.pp)],
        }
    }

    /// The expert grid `etp-ep-edp-pp` (cp folded into data parallel); `Dim::Tp` stands for the
    /// expert tensor-parallel dimension, `Dim::Dp` for the expert data-parallel one.
    pub fn expert(&self) -> Grid {
        let edp = self.tp * self.dp * self.cp / (self.etp * self.ep);
        Grid { dims: vec![(Dim::Tp, self.etp), (Dim::Ep, self.ep), (Dim::Dp, edp), (Dim::Pp, self.pp)] }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn megatrons_documented_example() {
        // parallel_state.initialize_model_parallel: 16 GPUs, tp 2, pp 4 → dp 2.
        let l = Layout::new(16, 2, 4, 1, 1).unwrap();
        assert_eq!(l.dp, 2);
        let g = l.dense();
        assert_eq!(g.groups(&[Dim::Tp]), vec![[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]);
        assert_eq!(g.groups(&[Dim::Dp]), vec![[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]);
        assert_eq!(g.groups(&[Dim::Pp]), vec![[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]);
        // Model-parallel groups (tp × pp) hold one whole replica of the model.
        assert_eq!(g.groups(&[Dim::Tp, Dim::Pp])[0], vec![0, 1, 4, 5, 8, 9, 12, 13]);
        assert_eq!((g.coord(13, Dim::Tp), g.coord(13, Dim::Dp), g.coord(13, Dim::Pp)), (1, 0, 3));
    }

    #[test]
    fn context_parallel_example() {
        // 16 ranks, tp 2, cp 2, pp 2 → dp 2: strides tp 1, cp 2, dp 4, pp 8 in the order tp-cp-ep-dp-pp.
        let g = Layout::new(16, 2, 2, 2, 1).unwrap().dense();
        assert_eq!(g.groups(&[Dim::Cp])[..4], [vec![0, 2], vec![1, 3], vec![4, 6], vec![5, 7]]);
        assert_eq!(g.groups(&[Dim::Dp])[0], vec![0, 4]);
        assert_eq!(g.groups(&[Dim::Dp, Dim::Cp])[0], vec![0, 2, 4, 6]);
        assert_eq!(g.groups(&[Dim::Pp])[0], vec![0, 8]);
    }

    #[test]
    fn expert_grid_shares_pipeline_groups() {
        let l = Layout::new(16, 2, 2, 1, 2).unwrap();
        let (d, e) = (l.dense(), l.expert());
        assert_eq!(d.groups(&[Dim::Pp]), e.groups(&[Dim::Pp]));
        assert_eq!(e.groups(&[Dim::Ep])[0], vec![0, 2]);
        assert_eq!(e.groups(&[Dim::Dp])[0], vec![0, 4]);
        // Every group kind partitions the world.
        for span in [[Dim::Tp], [Dim::Ep], [Dim::Dp], [Dim::Pp]] {
            let mut all: Vec<usize> = e.groups(&span).concat();
            all.sort();
            assert_eq!(all, (0..16).collect::<Vec<_>>());
        }
    }

    #[test]
    fn experts_unsplit_under_tensor_parallelism() {
        // 8 ranks, tp 2, ep 4, etp 1 (Megatron's expert grid etp-ep-edp-pp): each expert-parallel
        // group spans tensor-parallel ranks, the experts' data parallelism what is left.
        let l = Layout::with_expert_tp(8, 2, 1, 1, 4, 1).unwrap();
        let e = l.expert();
        assert_eq!(e.groups(&[Dim::Ep]), vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]);
        assert_eq!(e.groups(&[Dim::Dp]), vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]);
        let e = Layout::with_expert_tp(8, 2, 1, 1, 2, 1).unwrap().expert();
        assert_eq!(e.groups(&[Dim::Ep])[..2], [vec![0, 1], vec![2, 3]]);
        let err = Layout::with_expert_tp(6, 2, 1, 1, 3, 4).unwrap_err().to_string();
        assert!(err.contains("--expert-tensor-parallel-size 4"), "{err}");
        // ep 4 over tp 2 × dp 2, which the experts split over tp could not take (dp 2 < 4).
        assert!(Layout::new(4, 2, 1, 1, 4).is_err());
        assert_eq!(
            Layout::with_expert_tp(4, 2, 1, 1, 4, 1).unwrap().expert().groups(&[Dim::Ep]),
            vec![vec![0, 1, 2, 3]]
        );
    }

    #[test]
    fn sizes_that_do_not_divide_are_named() {
        let e = Layout::new(6, 4, 1, 1, 1).unwrap_err().to_string();
        assert!(e.contains("--tensor-model-parallel-size 4") && e.contains('6'), "{e}");
        assert!(Layout::new(8, 2, 1, 1, 3).unwrap_err().to_string().contains("--expert-model-parallel-size 3"));
    }
}
