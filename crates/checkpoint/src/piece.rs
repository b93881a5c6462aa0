//! Where a stored run of values lies in its whole tensor.
//!
//! A rank holds a tensor-parallel part of each parameter (`Split`: the dim cut, seen as blocks —
//! `chunks` equal ones, 2 for SwiGLU's gate|value, or blocks of the lengths in `sizes`, Mamba's
//! in_proj z|x|B|C|dt — each cut into `size` parts, part `rank` of every block, in block order;
//! core's `Shard` plus the dim). A `Piece` is a flat range of that part, row-major in the part's
//! own shape: the whole part for a parameter, the distributed optimizer's share of it for a
//! moment buffer. Both directions of the index map walk in runs (`to_global`, `to_local` return
//! how many elements stay contiguous on both sides), so copying between two layouts moves
//! slices, not single values.

use crate::{CheckpointError, Result};
use ferrotron_core::{Blocks, ParamMeta, Shard};
use serde::{Deserialize, Serialize};
use std::ops::Range;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Split {
    pub dim: usize,
    pub rank: usize,
    pub size: usize,
    /// Equal blocks (where `sizes` is absent: checkpoints from before unequal blocks read so).
    pub chunks: usize,
    /// Unequal blocks' lengths along the dim, zeros past the last.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sizes: Option<[usize; 5]>,
}

impl Split {
    pub fn of(dim: usize, shard: Shard) -> Split {
        let (chunks, sizes) = match shard.blocks {
            Blocks::Equal(n) => (n, None),
            Blocks::Sizes(s) => (shard.blocks.count(), Some(s)),
        };
        Split { dim, rank: shard.rank, size: shard.size, chunks, sizes }
    }

    pub fn shard(&self) -> Shard {
        let blocks = self.sizes.map_or(Blocks::Equal(self.chunks), Blocks::Sizes);
        Shard { rank: self.rank, size: self.size, blocks }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Piece {
    /// Shape of the whole tensor.
    pub global_shape: Vec<usize>,
    /// The tensor-parallel part the range is taken from (None: the whole tensor).
    pub split: Option<Split>,
    /// Flat range within the part.
    pub start: usize,
    pub len: usize,
}

impl Piece {
    /// The whole of a tensor of this shape.
    pub fn whole(shape: &[usize]) -> Piece {
        Piece { global_shape: shape.to_vec(), split: None, start: 0, len: shape.iter().product() }
    }

    /// `range` (flat, within this rank's part) of parameter `m`.
    pub fn of(m: &ParamMeta, range: Range<usize>) -> Piece {
        let split = m.split_dim.map(|dim| Split::of(dim, m.shard));
        Piece { global_shape: m.global_shape.dims().to_vec(), split, start: range.start, len: range.len() }
    }

    /// Shape of the tensor-parallel part the range is taken from.
    pub fn part_shape(&self) -> Vec<usize> {
        let mut s = self.global_shape.clone();
        if let Some(sp) = self.split {
            s[sp.dim] /= sp.size;
        }
        s
    }

    pub fn range(&self) -> Range<usize> {
        self.start..self.start + self.len
    }

    /// Checks that the split divides the shape and the range lies within the part.
    pub fn validate(&self, key: &str) -> Result<()> {
        let bad = |why: String| Err(CheckpointError::BadPiece { key: key.to_string(), why });
        if let Some(s) = self.split {
            if s.dim >= self.global_shape.len() {
                return bad(format!("split dim {} of a {}-dim tensor", s.dim, self.global_shape.len()));
            }
            if !s.shard().divides(self.global_shape[s.dim]) {
                return bad(format!(
                    "part {} of {} ({:?}) does not divide dim {} of {:?}",
                    s.rank,
                    s.size,
                    s.shard().blocks,
                    s.dim,
                    self.global_shape
                ));
            }
        }
        let n: usize = self.part_shape().iter().product();
        match self.start.checked_add(self.len) {
            Some(end) if end <= n => Ok(()),
            _ => bad(format!("range {}..+{} outside the part's {n} values", self.start, self.len)),
        }
    }

    /// Global flat index of part-local flat index `i`, and how many elements from `i` on stay
    /// contiguous in both (at least 1).
    pub fn to_global(&self, i: usize) -> (usize, usize) {
        let Some(s) = self.split else {
            return (i, self.global_shape.iter().product::<usize>() - i);
        };
        let g = &self.global_shape;
        let (gd, inner) = (g[s.dim], g[s.dim + 1..].iter().product::<usize>());
        let ld = gd / s.size;
        let (outer, rest) = (i / (ld * inner), i % (ld * inner));
        let (l, j) = (rest / inner, rest % inner);
        let (gl, run) = s.shard().locate(l, gd);
        ((outer * gd + gl) * inner + j, run * inner - j)
    }

    /// Part-local flat index of global flat index `g` if this piece's rank holds it (the range is
    /// not checked), and the contiguous run from there.
    pub fn to_local(&self, g: usize) -> Option<(usize, usize)> {
        let Some(s) = self.split else {
            return Some((g, self.global_shape.iter().product::<usize>() - g));
        };
        let gs = &self.global_shape;
        let (gd, inner) = (gs[s.dim], gs[s.dim + 1..].iter().product::<usize>());
        let ld = gd / s.size;
        let (outer, rest) = (g / (gd * inner), g % (gd * inner));
        let (x, j) = (rest / inner, rest % inner);
        let (l, run) = s.shard().local_of(x, gd)?;
        Some(((outer * ld + l) * inner + j, run * inner - j))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every index of every part maps to a distinct global index and back, and each run's
    /// successors are the next global indices.
    #[test]
    fn to_global_and_to_local_are_inverse() {
        // The last two: unequal blocks (Mamba's in_proj z | x | B | C | dt, 2 ranks; a
        // convolution's x | B | C along a middle dim, 3 ranks).
        for (shape, dim, size, chunks, sizes) in [
            (vec![12, 6], 0, 3, 2, None),
            (vec![4, 12], 1, 2, 3, None),
            (vec![2, 8, 3], 1, 4, 1, None),
            (vec![8], 0, 8, 1, None),
            (vec![6, 4], 0, 1, 2, None),
            (vec![22, 3], 0, 2, 5, Some([8, 8, 2, 2, 2])),
            (vec![2, 15, 2], 1, 3, 3, Some([9, 3, 3, 0, 0])),
        ] {
            let total: usize = shape.iter().product();
            let mut seen = vec![false; total];
            for rank in 0..size {
                let p = Piece {
                    global_shape: shape.clone(),
                    split: Some(Split { dim, rank, size, chunks, sizes }),
                    start: 0,
                    len: total / size,
                };
                p.validate("t").unwrap();
                for i in 0..p.len {
                    let (g, run) = p.to_global(i);
                    assert!(!seen[g], "{shape:?} rank {rank}: {g} twice");
                    seen[g] = true;
                    let (back, run2) = p.to_local(g).unwrap();
                    assert_eq!((back, run2), (i, run), "{shape:?} rank {rank} index {i}");
                    for k in 1..run.min(p.len - i) {
                        assert_eq!(p.to_global(i + k).0, g + k, "{shape:?} run from {i}");
                    }
                    for other in (0..size).filter(|&r| r != rank) {
                        let q = Piece { split: Some(Split { dim, rank: other, size, chunks, sizes }), ..p.clone() };
                        assert!(q.to_local(g).is_none());
                    }
                }
            }
            assert!(seen.iter().all(|&s| s), "{shape:?}: some global index is in no part");
        }
    }

    #[test]
    fn pieces_that_do_not_fit_are_refused() {
        let p = Piece {
            global_shape: vec![6, 4],
            split: Some(Split { dim: 0, rank: 0, size: 4, chunks: 1, sizes: None }),
            start: 0,
            len: 6,
        };
        assert!(p.validate("w").unwrap_err().to_string().contains("does not divide"));
        // Unequal blocks that do not make up the dim, or one not a multiple of the ranks.
        for sizes in [[2, 2, 0, 0, 0], [3, 3, 0, 0, 0]] {
            let split = Some(Split { dim: 0, rank: 0, size: 2, chunks: 2, sizes: Some(sizes) });
            let p = Piece { global_shape: vec![6, 4], split, start: 0, len: 2 };
            assert!(p.validate("w").unwrap_err().to_string().contains("does not divide"), "{sizes:?}");
        }
        let p = Piece { global_shape: vec![6, 4], split: None, start: 20, len: 5 };
        assert!(p.validate("w").unwrap_err().to_string().contains("outside"));
    }
}
