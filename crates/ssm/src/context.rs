//! The mixer under context parallelism (Megatron's MambaContextParallel): the all-to-alls around
//! the convolution and scan, and which rows of the small parameters a rank's share of the heads
//! takes.
//!
//! A rank of cp gets heads r·H/cp .. (r+1)·H/cp of its tensor-parallel rank's H (x by those
//! heads' channels, dt by head) and the groups of B and C they read. With at least cp groups
//! that is groups r·G/cp ..; with fewer (cp a multiple of G), the one group ⌊r·G/cp⌋: B and C
//! are repeated cp/G times before the all-to-all, and in the backward the copies' gradients are
//! summed after it (the repeat's adjoint). Ranks that share a group each add their share of its
//! convolution weights' gradient; the data × context-parallel reduction sums them.

use crate::spec::MambaDims;
use ferrotron_core::{Result, Tensor, invalid};
use ferrotron_kernels as k;
use ferrotron_parallel::ContextParallel;

/// Rows of a parameter (or of its gradient) that a context-parallel rank's share takes: (first
/// row in the parameter, first row in the share, count).
pub(crate) type Rows = Vec<(usize, usize, usize)>;

#[derive(Clone, Debug)]
pub(crate) struct MixerCp {
    pub cp: ContextParallel,
    /// A tensor-parallel rank's sizes, and this rank's share of them between the all-to-alls.
    dims: MambaDims,
    pub seq: MambaDims,
    /// Copies of each group sent (cp / G with fewer groups than ranks, else 1).
    repeat: usize,
}

impl MixerCp {
    /// Checks that the heads split evenly and the groups either split or repeat evenly.
    pub fn new(cp: ContextParallel, dims: MambaDims, tp: usize) -> Result<MixerCp> {
        let n = cp.size();
        let g = dims.groups;
        if dims.heads % n != 0 || !(g % n == 0 || n % g == 0) {
            return Err(invalid(
                "MambaMixer::new",
                format!(
                    "--context-parallel-size {n} must divide a tensor-parallel rank's {} Mamba heads, and its {g} groups divide it or it them: pick --mamba-num-groups and --mamba-num-heads multiples of {}, or --mamba-num-groups {tp} × a divisor of {n}",
                    dims.heads,
                    tp * n
                ),
            ));
        }
        let repeat = if g >= n { 1 } else { n / g };
        let seq = MambaDims { d_inner: dims.d_inner / n, heads: dims.heads / n, groups: (g / n).max(1), ..dims };
        Ok(MixerCp { cp, dims, seq, repeat })
    }

    fn gn(&self) -> usize {
        self.dims.groups * self.dims.state
    }

    /// xbc [B, 2c, d_inner + 2·G·N] of this rank's rows → [B, T, its share's channels].
    pub fn xbc_to_heads(&self, xbc: &Tensor) -> Result<Tensor> {
        let (di, gn, r) = (self.dims.d_inner, self.gn(), self.repeat);
        if r == 1 {
            return self.cp.to_channels(xbc, &[di, gn, gn]);
        }
        let [b, t, _] = dims3(xbc)?;
        let rep = Tensor::empty([b, t, di + 2 * gn * r], xbc.dtype(), xbc.device())?;
        rep.narrow(2, 0..di)?.copy_from(&xbc.narrow(2, 0..di)?)?;
        let ns = self.dims.state;
        for (from, to) in self.group_copies() {
            rep.narrow(2, to..to + ns)?.copy_from(&xbc.narrow(2, from..from + ns)?)?;
        }
        self.cp.to_channels(&rep, &[di, gn * r, gn * r])
    }

    /// The inverse direction for xbc's gradient: [B, T, share] → [B, 2c, d_inner + 2·G·N] of this
    /// rank's rows, the repeated groups' copies summed.
    pub fn dxbc_to_sequence(&self, dxbc: &Tensor) -> Result<Tensor> {
        let (di, gn, r) = (self.dims.d_inner, self.gn(), self.repeat);
        if r == 1 {
            return self.cp.to_sequence(dxbc, &[di, gn, gn]);
        }
        let rep = self.cp.to_sequence(dxbc, &[di, gn * r, gn * r])?;
        let [b, t, _] = dims3(&rep)?;
        let out = Tensor::empty([b, t, di + 2 * gn], rep.dtype(), rep.device())?;
        out.narrow(2, 0..di)?.copy_from(&rep.narrow(2, 0..di)?)?;
        let ns = self.dims.state;
        // Each group's copies lie together: their gradients summed into the group's columns.
        for copies in self.group_copies().chunks(r) {
            // Dense copies as rectangles (`contiguous` would take the host for many rows).
            let piece = |to: usize| -> Result<Tensor> {
                let p = Tensor::empty([b, t, ns], rep.dtype(), rep.device())?;
                p.copy_from(&rep.narrow(2, to..to + ns)?)?;
                Ok(p)
            };
            let sum = piece(copies[0].1)?;
            for &(_, to) in &copies[1..] {
                k::add_(&sum, &piece(to)?)?;
            }
            out.narrow(2, copies[0].0..copies[0].0 + ns)?.copy_from(&sum)?;
        }
        Ok(out)
    }

    /// (column in xbc, column in the repeated xbc) of every copy of every group's B, then C, in
    /// the repeated order (each group's copies together).
    fn group_copies(&self) -> Vec<(usize, usize)> {
        let (di, gn, r, ns) = (self.dims.d_inner, self.gn(), self.repeat, self.dims.state);
        let mut out = Vec::with_capacity(2 * self.dims.groups * r);
        for part in 0..2 {
            for g in 0..self.dims.groups {
                for copy in 0..r {
                    out.push((di + part * gn + g * ns, di + part * gn * r + (g * r + copy) * ns));
                }
            }
        }
        out
    }

    /// The convolution's channel rows (x | B | C) and the heads' rows this rank's share takes.
    pub fn share_rows(&self) -> (Rows, Rows) {
        let (d, s, r, n) = (&self.dims, &self.seq, self.cp.rank(), self.cp.size());
        let (gn, sgn) = (d.groups * d.state, s.groups * s.state);
        // The share's first group: r·G/cp (⌊r·G/cp⌋ when groups repeat).
        let g0 = r * d.groups / n * d.state;
        let conv = vec![
            (r * s.d_inner, 0, s.d_inner),
            (d.d_inner + g0, s.d_inner, sgn),
            (d.d_inner + gn + g0, s.d_inner + sgn, sgn),
        ];
        (conv, vec![(r * s.heads, 0, s.heads)])
    }
}

fn dims3(x: &Tensor) -> Result<[usize; 3]> {
    match *x.dims() {
        [b, t, w] => Ok([b, t, w]),
        _ => Err(invalid("MixerCp", format!("{:?} is not [batch, rows, channels]", x.dims()))),
    }
}
