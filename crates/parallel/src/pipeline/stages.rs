//! Which decoder layers each pipeline stage holds.
//!
//! The model is cut into pp × vpp stages of consecutive layers; stage s = chunk c on pipeline rank
//! r with s = c·pp + r (Megatron's interleaving: rank r holds chunks r, r + pp, ...). Without
//! virtual stages the first and last stage may hold a different count
//! (`--decoder-first-pipeline-num-layers`, `--decoder-last-pipeline-num-layers`) and the middle
//! stages split the rest evenly.

use crate::{ParallelError, Result};
use std::ops::Range;

/// The layer ranges of one pipeline rank, one per model chunk, and whether it embeds (first stage)
/// or computes the loss (last stage).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StagePlan {
    pub chunks: Vec<Range<usize>>,
    pub pre_process: bool,
    pub post_process: bool,
}

impl StagePlan {
    /// One rank holding every layer (no pipeline).
    pub fn whole(layers: usize) -> StagePlan {
        StagePlan { chunks: std::iter::once(0..layers).collect(), pre_process: true, post_process: true }
    }
}

fn err(msg: String) -> ParallelError {
    ParallelError::Layout(msg)
}

/// Layer ranges of every stage in model order (pp·vpp of them).
pub fn all_stages(
    layers: usize,
    pp: usize,
    vpp: usize,
    first: Option<usize>,
    last: Option<usize>,
) -> Result<Vec<Range<usize>>> {
    let n = pp * vpp;
    if vpp > 1 && (first.is_some() || last.is_some()) {
        return Err(err(
            "--decoder-first/last-pipeline-num-layers cannot be combined with --num-layers-per-virtual-pipeline-stage"
                .into(),
        ));
    }
    if n == 1 {
        return Ok(std::iter::once(0..layers).collect());
    }
    let f = first.unwrap_or(0);
    let l = last.unwrap_or(0);
    let fixed = first.is_some() as usize + last.is_some() as usize;
    let rest_stages = n - fixed;
    if f + l > layers || (rest_stages == 0 && f + l != layers) {
        return Err(err(format!(
            "--decoder-first-pipeline-num-layers {f} and --decoder-last-pipeline-num-layers {l} do not fit --num-layers {layers} over {n} stages"
        )));
    }
    let rest = layers - f - l;
    if rest_stages > 0 && rest % rest_stages != 0 {
        let what = if vpp > 1 {
            format!("{pp} pipeline stages × {vpp} virtual stages")
        } else {
            format!("{rest_stages} pipeline stages")
        };
        return Err(err(format!(
            "{rest} layers do not divide evenly over {what}: change --num-layers, --pipeline-model-parallel-size, or fix the first/last stage with --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers"
        )));
    }
    let each = rest.checked_div(rest_stages).unwrap_or(0);
    let mut out = Vec::with_capacity(n);
    let mut at = 0;
    for s in 0..n {
        let len = match (s, first, last) {
            (0, Some(f), _) => f,
            (s, _, Some(l)) if s == n - 1 => l,
            _ => each,
        };
        out.push(at..at + len);
        at += len;
    }
    Ok(out)
}

/// The plan of pipeline rank `rank`.
pub fn stage_layers(
    layers: usize,
    pp: usize,
    vpp: usize,
    rank: usize,
    first: Option<usize>,
    last: Option<usize>,
) -> Result<StagePlan> {
    let all = all_stages(layers, pp, vpp, first, last)?;
    Ok(StagePlan {
        chunks: (0..vpp).map(|c| all[c * pp + rank].clone()).collect(),
        pre_process: rank == 0,
        post_process: rank == pp - 1,
    })
}

/// The plan of pipeline rank `rank` when every stage's layer count is given, in model order
/// (a hybrid pattern's `|` marks): stage k is chunk k / pp of rank k mod pp.
pub fn stage_layers_sized(sizes: &[usize], pp: usize, vpp: usize, rank: usize) -> Result<StagePlan> {
    if sizes.len() != pp * vpp || sizes.contains(&0) {
        return Err(err(format!(
            "the pattern's {} pipeline stages ({sizes:?} layers) do not match --pipeline-model-parallel-size {pp} × {vpp} virtual stages, or one is empty: give one non-empty stage per pipeline (and virtual) stage",
            sizes.len()
        )));
    }
    stage_layers_of(sizes, pp, rank)
}

/// The plan of rank `rank` out of `pp` when stage k (chunk k / pp of rank k mod pp) holds
/// `sizes[k]` layers, some maybe none (an explicit layout's stage of only the embedding or the
/// loss); `sizes` has pp × (virtual stages) entries.
pub fn stage_layers_of(sizes: &[usize], pp: usize, rank: usize) -> Result<StagePlan> {
    if pp == 0 || rank >= pp || sizes.is_empty() || sizes.len() % pp != 0 {
        return Err(err(format!(
            "{} pipeline stages ({sizes:?} layers) for pipeline rank {rank} of {pp}: give pp × (virtual stages) stages",
            sizes.len()
        )));
    }
    let mut all = Vec::with_capacity(sizes.len());
    let mut at = 0;
    for &n in sizes {
        all.push(at..at + n);
        at += n;
    }
    Ok(StagePlan {
        chunks: (0..sizes.len() / pp).map(|c| all[c * pp + rank].clone()).collect(),
        pre_process: rank == 0,
        post_process: rank == pp - 1,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stages_of_given_sizes() {
        let p = stage_layers_sized(&[1, 3], 2, 1, 1).unwrap();
        assert_eq!((p.chunks.len(), p.chunks[0].clone(), p.pre_process, p.post_process), (1, 1..4, false, true));
        let p = stage_layers_sized(&[1, 2, 2, 1], 2, 2, 0).unwrap();
        assert_eq!(p.chunks, vec![0..1, 3..5]);
        let e = stage_layers_sized(&[2, 2], 4, 1, 0).unwrap_err().to_string();
        assert!(e.contains("2 pipeline stages") && e.contains("--pipeline-model-parallel-size 4"), "{e}");
        assert!(stage_layers_sized(&[0, 4], 2, 1, 0).is_err());
        // Empty stages where the sizes are given as they are.
        assert_eq!(stage_layers_of(&[0, 4], 2, 0).unwrap().chunks, vec![0..0]);
        assert!(stage_layers_of(&[1, 2, 3], 2, 0).is_err());
        assert!(stage_layers_of(&[1, 2], 2, 2).is_err());
    }

    #[test]
    fn even_uneven_and_interleaved() {
        assert_eq!(all_stages(8, 4, 1, None, None).unwrap(), vec![0..2, 2..4, 4..6, 6..8]);
        assert_eq!(all_stages(8, 3, 1, Some(2), Some(2)).unwrap(), vec![0..2, 2..6, 6..8]);
        assert_eq!(all_stages(7, 3, 1, Some(1), None).unwrap(), vec![0..1, 1..4, 4..7]);
        let p = stage_layers(8, 2, 2, 1, None, None).unwrap();
        assert_eq!(p.chunks, vec![2..4, 6..8]);
        assert!(!p.pre_process && p.post_process);
    }

    #[test]
    fn layouts_that_do_not_fit_are_named() {
        let e = all_stages(7, 2, 1, None, None).unwrap_err().to_string();
        assert!(e.contains("7 layers do not divide evenly over 2 pipeline stages"), "{e}");
        let e = all_stages(8, 2, 3, None, None).unwrap_err().to_string();
        assert!(e.contains("2 pipeline stages × 3 virtual stages"), "{e}");
        assert!(all_stages(8, 2, 2, Some(1), None).is_err());
    }
}
