//! Dropout by a counter-based mask: element j of batch row b keeps its value, scaled by
//! 1 / (1 − p), unless Philox word `base + b · batch_stride + offset + j` (past a `DropSplit`,
//! `split.offset + j − split.at`) of the key's (seed,
//! stream), as a uniform in [0, 1) with 24 bits, is below p. The mask is a pure function of the
//! key and the element's place, so the backward (the same op on dy), a recomputed forward and a
//! run on another layout (the key's words indexed by global sample, position and column) all
//! draw the same mask, on either device.

use crate::check;
use ferrotron_core::rng::Philox;
use ferrotron_core::{DType, Device, Result, Shape, Tensor, invalid};
use rayon::prelude::*;

/// Where a dropout mask's random words come from (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DropoutKey {
    pub seed: u64,
    pub stream: u64,
    /// Word of element 0 of batch row 0.
    pub base: u64,
    /// Words between consecutive batch rows (the whole row's elements, of which this tensor may
    /// hold a part: a sequence-parallel shard).
    pub batch_stride: u64,
    /// Word of this tensor's first element within its row (the shard's start).
    pub offset: u64,
    /// Where this tensor's row jumps to another place in the whole row, or None (a context-
    /// parallel rank's rows are two chunks of each sequence, far apart).
    pub split: Option<DropSplit>,
}

/// Elements from `at` on (within this tensor's row) take words from `offset` on in the whole row;
/// the ones before, from `DropoutKey::offset` on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DropSplit {
    pub at: u64,
    pub offset: u64,
}

impl DropoutKey {
    /// The word of element j of batch row b.
    pub fn word(&self, b: u64, j: u64) -> u64 {
        let within = match self.split {
            Some(s) if j >= s.at => s.offset.wrapping_add(j - s.at),
            _ => self.offset.wrapping_add(j),
        };
        self.base.wrapping_add(b.wrapping_mul(self.batch_stride)).wrapping_add(within)
    }
}

/// The samples by which a replayed CUDA graph's step is ahead of the step it captured: the dropout
/// kernels (hidden and attention) captured in a graph add it to their keys' first sample, so a
/// replay draws its own step's masks from the captured keys (eager kernels do not read it). Queued
/// on the device's stream: set it before each launch of the graph (0 for the captured step's own).
/// The CPU has no graphs: only 0 is accepted there.
pub fn set_draw_shift(device: &ferrotron_core::Device, samples: u64) -> Result<()> {
    match device {
        ferrotron_core::Device::Cpu if samples == 0 => Ok(()),
        ferrotron_core::Device::Cpu => Err(invalid(
            "set_draw_shift",
            format!("a shift of {samples} samples on the CPU, which replays no CUDA graph: its masks follow the keys"),
        )),
        #[cfg(feature = "cuda")]
        ferrotron_core::Device::Cuda(d) => crate::cuda::backend(d)?.set_draw_shift(samples),
    }
}

/// Whether the word `u` (as Philox gives it) keeps its element: its top 24 bits, a uniform in
/// [0, 1), at least p (`threshold`). The CUDA kernel (kernels/elementwise.cu `dropout_*`)
/// compares the same integers, so both devices draw the same mask.
pub(crate) fn keep(u: u32, threshold: u32) -> bool {
    (u >> 8) >= threshold
}

/// p as the 24-bit threshold `keep` compares against: ⌈p · 2²⁴⌉.
pub(crate) fn threshold(p: f32) -> u32 {
    ((p as f64) * (1u64 << 24) as f64).ceil() as u32
}

/// Attention dropout's rule (`AttnDropout`: two probabilities a word): whether half `half` of
/// word `w` (0: the low 16 bits), a uniform in [0, 1) with 16 bits, keeps its probability: at
/// least `threshold16`. The CUDA kernels (kernels/attention.cu `drop_mul`) compare the same
/// integers.
pub(crate) fn keep16(w: u32, half: usize, threshold: u32) -> bool {
    (w >> (16 * half)) & 0xffff >= threshold
}

/// p as the 16-bit threshold `keep16` compares against: ⌈p · 2¹⁶⌉.
pub(crate) fn threshold16(p: f32) -> u32 {
    ((p as f64) * 65536.0).ceil() as u32
}

/// x [B, …] with its dropout mask applied (the forward, and the backward on dy with the same key).
/// p in [0, 1); p = 0 returns x.
pub fn dropout(x: &Tensor, p: f32, key: &DropoutKey) -> Result<Tensor> {
    const OP: &str = "dropout";
    check::float(OP, x)?;
    if !(0.0..1.0).contains(&p) {
        return Err(invalid(OP, format!("probability {p} outside [0, 1): pass a dropout rate such as 0.1")));
    }
    if p == 0.0 {
        return Ok(x.clone());
    }
    let rows = x.dims().first().copied().unwrap_or(1).max(1);
    let row = x.elem_count() / rows;
    let (t, scale) = (threshold(p), 1.0 / (1.0 - p));
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[x])? {
        return crate::cuda::ops::dropout(&g, x, row, key, t, scale);
    }
    check::on_cpu(OP, &[x])?;
    let rng = Philox::new(key.seed).with_stream(key.stream);
    let mut y = x.read_f32()?.to_vec();
    y.par_chunks_mut(row.max(1)).enumerate().for_each(|(b, r)| {
        // Wrapping, as the CUDA kernel's 64-bit arithmetic does.
        for (j, v) in r.iter_mut().enumerate() {
            *v = if keep(rng.u32_at(key.word(b as u64, j as u64)), t) { *v * scale } else { 0.0 };
        }
    });
    check::out(y, x.shape().clone(), x.dtype(), x.device())
}

/// Standard normal values of `shape` [B, …] keyed as a dropout mask's words: element j of batch
/// row b is Box–Muller (`Philox::normal_at`) on block `key.word(b, j)` of the key's (seed,
/// stream), so, as the masks, the values depend only on the element's global place (the routers'
/// random logits of --moe-router-force-load-balancing are one rank's under any layout). f32 or
/// bf16.
pub fn normal(shape: impl Into<Shape>, dtype: DType, device: &Device, key: &DropoutKey) -> Result<Tensor> {
    const OP: &str = "normal";
    let shape = shape.into();
    if !matches!(dtype, DType::F32 | DType::BF16) {
        return Err(invalid(OP, format!("{dtype:?} values: ask for f32 or bf16")));
    }
    let rows = shape.dims().first().copied().unwrap_or(1).max(1);
    let row = shape.elem_count() / rows;
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = device {
        return crate::cuda::ops::normal(&*crate::cuda::backend(d)?, shape, dtype, row, key);
    }
    let rng = Philox::new(key.seed).with_stream(key.stream);
    let mut y = vec![0f32; shape.elem_count()];
    y.par_chunks_mut(row.max(1)).enumerate().for_each(|(b, r)| {
        for (j, v) in r.iter_mut().enumerate() {
            *v = rng.normal_at(key.word(b as u64, j as u64)) as f32;
        }
    });
    check::out(y, shape, dtype, device)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrotron_core::{DType, Device};

    fn ones(dims: &[usize]) -> Tensor {
        let n = dims.iter().product();
        Tensor::from_f32(&vec![1.0; n], dims.to_vec(), DType::F32, &Device::Cpu).unwrap()
    }

    #[test]
    fn drops_about_p_scales_the_rest_and_the_backward_draws_the_same_mask() {
        let key = DropoutKey { seed: 5, stream: 9, base: 1000, batch_stride: 4096, offset: 0, split: None };
        let x = ones(&[4, 4096]);
        let y = dropout(&x, 0.25, &key).unwrap().to_vec_f32().unwrap();
        let dropped = y.iter().filter(|&&v| v == 0.0).count() as f64 / y.len() as f64;
        assert!((dropped - 0.25).abs() < 0.02, "dropped {dropped}");
        assert!(y.iter().all(|&v| v == 0.0 || (v - 1.0 / 0.75).abs() < 1e-6));
        let dy = dropout(&ones(&[4, 4096]), 0.25, &key).unwrap().to_vec_f32().unwrap();
        assert_eq!(y, dy, "the same key gives the same mask");
        let other = DropoutKey { stream: 10, ..key };
        assert_ne!(y, dropout(&x, 0.25, &other).unwrap().to_vec_f32().unwrap(), "another stream, another mask");
        assert_eq!(dropout(&x, 0.0, &key).unwrap().to_vec_f32().unwrap(), vec![1.0; 4 * 4096]);
    }

    #[test]
    fn a_split_row_draws_the_whole_rows_words_of_both_chunks() {
        // A [2, 8, 3] tensor as 4 chunks of 2 positions; a context-parallel rank holding chunks
        // 1 and 2 ([2, 4, 3]: positions 2, 3 then 4, 5) draws the whole tensor's mask there, as
        // does the rank holding chunks 0 and 3 (positions 0, 1 then 6, 7).
        let key = DropoutKey { seed: 3, stream: 4, base: 9, batch_stride: 24, offset: 0, split: None };
        let whole = dropout(&ones(&[2, 8, 3]), 0.5, &key).unwrap().to_vec_f32().unwrap();
        for (first, second) in [(1usize, 2usize), (0, 3)] {
            let k = DropoutKey {
                offset: (first * 6) as u64,
                split: Some(DropSplit { at: 6, offset: (second * 6) as u64 }),
                ..key
            };
            let part = dropout(&ones(&[2, 4, 3]), 0.5, &k).unwrap().to_vec_f32().unwrap();
            for b in 0..2 {
                let row = &whole[b * 24..(b + 1) * 24];
                let want: Vec<f32> =
                    row[first * 6..first * 6 + 6].iter().chain(&row[second * 6..second * 6 + 6]).copied().collect();
                assert_eq!(part[b * 12..(b + 1) * 12], want, "chunks {first} and {second}");
            }
        }
    }

    #[test]
    fn a_shard_draws_its_part_of_the_whole_mask() {
        // A [2, 8, 3] tensor split along its second dim in two (sequence parallel): each half,
        // keyed by its offset in the row, holds the whole tensor's mask for its rows.
        let key = DropoutKey { seed: 1, stream: 2, base: 77, batch_stride: 24, offset: 0, split: None };
        let whole = dropout(&ones(&[2, 8, 3]), 0.5, &key).unwrap().to_vec_f32().unwrap();
        for half in 0..2 {
            let k = DropoutKey { offset: (half * 12) as u64, ..key };
            let part = dropout(&ones(&[2, 4, 3]), 0.5, &k).unwrap().to_vec_f32().unwrap();
            for b in 0..2 {
                assert_eq!(
                    part[b * 12..b * 12 + 12],
                    whole[b * 24 + half * 12..b * 24 + half * 12 + 12],
                    "half {half}"
                );
            }
        }
    }

    #[test]
    fn a_rate_outside_zero_to_one_is_an_error_naming_it() {
        let key = DropoutKey { seed: 0, stream: 0, base: 0, batch_stride: 1, offset: 0, split: None };
        for p in [1.0, -0.1, f32::NAN] {
            let e = dropout(&ones(&[1, 4]), p, &key).unwrap_err().to_string();
            assert!(e.contains("outside [0, 1)"), "{e}");
        }
    }

    #[test]
    fn thresholds_are_exact_at_the_ends() {
        assert_eq!(threshold(0.5), 1 << 23);
        assert!(keep(u32::MAX, threshold(0.999_999)));
        assert!(!keep(0, threshold(1e-7)));
    }
}
