//! Context parallelism for layers that run along the whole sequence (a Mamba mixer's causal
//! convolution and scan): an all-to-all trades this rank's rows of every channel for every row
//! of its share of the channels, and back (Megatron's `cp2hp` / `hp2cp`).
//!
//! `to_channels`: x [B, 2c, W], this rank's two chunks (`ContextParallel::chunks`), W the sum
//! of `blocks` (e.g. a mixer's x | B | C) → [B, T, W/cp], T = 2c·cp in sequence order, rank r
//! holding columns r·w/cp .. (r+1)·w/cp of each block of width w, the blocks in order.
//! `to_sequence` is its inverse. Both are permutations, so each one's backward is the other.
//!
//! The moves are rectangle copies (`Tensor::copy_from` on `narrow` views): into a send buffer
//! [cp, B, 2c, W/cp] (one rectangle a destination and block), one all-to-all of equal parts,
//! then out of the receive buffer (one rectangle a source, chunk and block; a row of B each).

use crate::comm_err;
use crate::context::{ContextParallel, chunks_of};
use ferrotron_core::{Result, Tensor, invalid, shape_mismatch};

impl ContextParallel {
    /// This rank's rows of every channel → every row of this rank's share of each block.
    pub fn to_channels(&self, x: &Tensor, blocks: &[usize]) -> Result<Tensor> {
        const OP: &str = "ContextParallel::to_channels";
        let n = self.size();
        let [b, t2, w] = dims3(OP, x)?;
        self.check_blocks(OP, w, blocks)?;
        if n == 1 {
            return Ok(x.clone());
        }
        let c = t2 / 2;
        let wn = w / n;
        let send = Tensor::empty([n, b, t2, wn], x.dtype(), x.device())?;
        for j in 0..n {
            let piece = part(&send, j)?;
            for (from, to, s) in block_cols(blocks, n, j) {
                piece.narrow(2, to..to + s)?.copy_from(&x.narrow(2, from..from + s)?)?;
            }
        }
        let recv = self.exchange(&send)?;
        let out = Tensor::empty([b, 2 * c * n, wn], x.dtype(), x.device())?;
        for j in 0..n {
            let piece = part(&recv, j)?;
            for (h, q) in chunks_of(j, n).into_iter().enumerate() {
                out.narrow(1, q * c..(q + 1) * c)?.copy_from(&piece.narrow(1, h * c..(h + 1) * c)?)?;
            }
        }
        Ok(out)
    }

    /// The inverse of `to_channels`: y [B, T, W/cp] → this rank's rows [B, 2c, W] of every channel.
    pub fn to_sequence(&self, y: &Tensor, blocks: &[usize]) -> Result<Tensor> {
        const OP: &str = "ContextParallel::to_sequence";
        let n = self.size();
        let [b, t, wn] = dims3(OP, y)?;
        let w = wn * n;
        self.check_blocks(OP, w, blocks)?;
        if t % (2 * n) != 0 {
            return Err(shape_mismatch(OP, format!("[B, a multiple of {}, {wn}]", 2 * n), y.dims()));
        }
        if n == 1 {
            return Ok(y.clone());
        }
        let c = t / (2 * n);
        let send = Tensor::empty([n, b, 2 * c, wn], y.dtype(), y.device())?;
        for j in 0..n {
            let piece = part(&send, j)?;
            for (h, q) in chunks_of(j, n).into_iter().enumerate() {
                piece.narrow(1, h * c..(h + 1) * c)?.copy_from(&y.narrow(1, q * c..(q + 1) * c)?)?;
            }
        }
        let recv = self.exchange(&send)?;
        let out = Tensor::empty([b, 2 * c, w], y.dtype(), y.device())?;
        for j in 0..n {
            let piece = part(&recv, j)?;
            for (to, from, s) in block_cols(blocks, n, j) {
                out.narrow(2, to..to + s)?.copy_from(&piece.narrow(2, from..from + s)?)?;
            }
        }
        Ok(out)
    }

    /// Every block splits evenly over the group and the blocks make up the width.
    fn check_blocks(&self, op: &'static str, w: usize, blocks: &[usize]) -> Result<()> {
        let n = self.size();
        if blocks.iter().sum::<usize>() != w || blocks.iter().any(|b| b % n != 0) {
            return Err(invalid(
                op,
                format!(
                    "channel blocks {blocks:?} do not make up {w} channels, each a multiple of --context-parallel-size {n}"
                ),
            ));
        }
        Ok(())
    }

    /// Part j of `send` [n, …] to rank j, part j of the result from rank j.
    fn exchange(&self, send: &Tensor) -> Result<Tensor> {
        let n = self.size();
        let dims = send.dims().to_vec();
        let rows = dims[1] * dims[2];
        let flat = send.reshape([n * rows, dims[3]])?;
        let recv = self.comm.all_to_all_v(&flat, &vec![rows; n], &vec![rows; n]).map_err(comm_err)?;
        recv.reshape(dims)
    }
}

/// For rank j's share: (first column in the whole width, first column in the share, width) of
/// each block.
fn block_cols(blocks: &[usize], n: usize, j: usize) -> Vec<(usize, usize, usize)> {
    let (mut whole, mut share) = (0, 0);
    let mut out = Vec::with_capacity(blocks.len());
    for &wb in blocks {
        let s = wb / n;
        if s > 0 {
            out.push((whole + j * s, share, s));
        }
        whole += wb;
        share += s;
    }
    out
}

fn dims3(op: &'static str, x: &Tensor) -> Result<[usize; 3]> {
    match *x.dims() {
        [b, t, w] if t % 2 == 0 => Ok([b, t, w]),
        _ => Err(shape_mismatch(op, "[batch, 2 × chunk, channels]", x.dims())),
    }
}

/// Part `i` of the outermost dimension, without it.
fn part(x: &Tensor, i: usize) -> Result<Tensor> {
    x.narrow0(i..i + 1)?.reshape(x.dims()[1..].to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrotron_comm::thread_world;
    use ferrotron_core::Device;
    use std::time::Duration;

    /// Against the whole tensor: rank r's `to_channels` is every row of its columns of each
    /// block, and `to_sequence` gives its rows back; at 2 and 3 ranks, batch 1 and 2.
    #[test]
    fn channels_and_sequence_are_the_whole_tensors_cuts() {
        for (n, b) in [(2, 1), (2, 2), (3, 2)] {
            let (c, blocks) = (2, vec![2 * n, n, 3 * n]);
            let (t, w) = (2 * c * n, blocks.iter().sum::<usize>());
            let whole: Vec<f32> = (0..b * t * w).map(|i| i as f32).collect();
            let worlds = thread_world(n, Duration::from_secs(10));
            std::thread::scope(|sc| {
                for comm in worlds {
                    let (whole, blocks) = (&whole, &blocks);
                    sc.spawn(move || {
                        let cp = ContextParallel::new(comm);
                        let r = cp.rank();
                        let rows: Vec<usize> = cp.chunks().iter().flat_map(|&q| q * c..(q + 1) * c).collect();
                        let local: Vec<f32> = (0..b)
                            .flat_map(|s| {
                                rows.iter().flat_map(move |&p| (0..w).map(move |k| whole[(s * t + p) * w + k]))
                            })
                            .collect();
                        let x = Tensor::from_vec(local.clone(), [b, 2 * c, w], &Device::Cpu).unwrap();
                        let y = cp.to_channels(&x, blocks).unwrap();
                        let cols: Vec<usize> =
                            block_cols(blocks, n, r).iter().flat_map(|&(f, _, s)| f..f + s).collect();
                        let want: Vec<f32> =
                            (0..b * t).flat_map(|row| cols.iter().map(move |&k| whole[row * w + k])).collect();
                        assert_eq!(y.dims(), [b, t, w / n]);
                        assert_eq!(y.to_vec_f32().unwrap(), want, "rank {r} of {n}, batch {b}");
                        assert_eq!(cp.to_sequence(&y, blocks).unwrap().to_vec_f32().unwrap(), local);
                        let e = cp.to_channels(&x, &[w - 1, 1]).unwrap_err().to_string();
                        assert!(e.contains("--context-parallel-size"), "{e}");
                    });
                }
            });
        }
    }
}
