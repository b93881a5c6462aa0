//! Philox-4x32 counter-based RNG (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3"):
//! 10 rounds for everything but attention dropout's mask, which takes 7 (`Philox::block_rounds`;
//! FlashAttention's choice too: Philox-4x32-7 passes BigCrush, and its mask is drawn again in the
//! backward, where the rounds are most of the cost).
//!
//! A random value is a pure function of (seed, stream, offset): no state advances, so the numbers a
//! parameter or a dropout mask gets do not depend on how many threads or ranks computed them, or in
//! which order. The parallel layers give each tensor-parallel rank its own `stream` where data is split
//! and a shared one where it is replicated (Megatron's RNG tracker), and index by global element.

const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

/// One Philox-4x32 block: 10 rounds over a 128-bit counter with a 64-bit key.
pub fn philox4x32_10(ctr: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    philox4x32(ctr, key, 10)
}

/// One Philox-4x32 block of `rounds` rounds (Random123's philox4x32_R).
pub fn philox4x32(ctr: [u32; 4], key: [u32; 2], rounds: u32) -> [u32; 4] {
    let mut c = ctr;
    let mut k = key;
    for round in 0..rounds {
        if round > 0 {
            k[0] = k[0].wrapping_add(W0);
            k[1] = k[1].wrapping_add(W1);
        }
        let p0 = (M0 as u64) * (c[0] as u64);
        let p1 = (M1 as u64) * (c[2] as u64);
        c = [((p1 >> 32) as u32) ^ c[1] ^ k[0], p1 as u32, ((p0 >> 32) as u32) ^ c[3] ^ k[1], p0 as u32];
    }
    c
}

/// FNV-1a (64-bit) of `s`: a stable id derived from a name, e.g. a parameter's RNG stream or a
/// cache key. Not cryptographic.
pub fn fnv1a64(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

/// A seeded generator: `stream` selects an independent sequence, `offset` an element within it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Philox {
    pub seed: u64,
    pub stream: u64,
}

impl Philox {
    pub fn new(seed: u64) -> Self {
        Philox { seed, stream: 0 }
    }

    /// The same seed on another stream (e.g. one per tensor-parallel rank, or per parameter).
    pub fn with_stream(self, stream: u64) -> Self {
        Philox { stream, ..self }
    }

    /// Four random words for block `block` (each block covers offsets 4·block .. 4·block+3).
    pub fn block(&self, block: u64) -> [u32; 4] {
        self.block_rounds(block, 10)
    }

    /// Block `block` of `rounds` rounds instead of 10 (attention dropout's mask: 7).
    pub fn block_rounds(&self, block: u64, rounds: u32) -> [u32; 4] {
        let key = [self.seed as u32, (self.seed >> 32) as u32];
        let ctr = [block as u32, (block >> 32) as u32, self.stream as u32, (self.stream >> 32) as u32];
        philox4x32(ctr, key, rounds)
    }

    /// The 32-bit word at `offset`.
    pub fn u32_at(&self, offset: u64) -> u32 {
        self.block(offset / 4)[(offset % 4) as usize]
    }

    /// Uniform in [0, 1) with 24 bits, for elements `offset .. offset + out.len()`.
    pub fn fill_uniform(&self, offset: u64, out: &mut [f32]) {
        for (i, o) in out.iter_mut().enumerate() {
            *o = to_unit(self.u32_at(offset + i as u64));
        }
    }

    /// Standard normal (Box–Muller on two words per value), for elements `offset ..`.
    pub fn fill_normal(&self, offset: u64, mean: f32, std: f32, out: &mut [f32]) {
        for (i, o) in out.iter_mut().enumerate() {
            *o = mean + std * self.normal_at(offset.wrapping_add(i as u64)) as f32;
        }
    }

    /// The standard normal value of element `offset`: Box–Muller (in f64) on the first two words
    /// of block `offset` (the CUDA kernels' `box_muller` computes the same).
    pub fn normal_at(&self, offset: u64) -> f64 {
        let b = self.block(offset);
        // u1 in (0, 1] so the log is finite.
        let u1 = 1.0 - to_unit(b[0]) as f64;
        let u2 = to_unit(b[1]) as f64;
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
}

#[inline]
fn to_unit(x: u32) -> f32 {
    (x >> 8) as f32 * (1.0 / (1u32 << 24) as f32)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Known-answer vectors published with Random123 (kat_vectors, philox4x32 with 10 rounds).
    #[test]
    fn known_answers() {
        assert_eq!(philox4x32_10([0; 4], [0; 2]), [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]);
        assert_eq!(philox4x32_10([u32::MAX; 4], [u32::MAX; 2]), [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]);
        assert_eq!(
            philox4x32_10([0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344], [0xa4093822, 0x299f31d0]),
            [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1]
        );
    }

    /// The same for 7 rounds (attention dropout's mask).
    #[test]
    fn known_answers_7_rounds() {
        assert_eq!(philox4x32([0; 4], [0; 2], 7), [0x5f6fb709, 0x0d893f64, 0x4f121f81, 0x4f730a48]);
        assert_eq!(philox4x32([u32::MAX; 4], [u32::MAX; 2], 7), [0x5207ddc2, 0x45165e59, 0x4d8ee751, 0x8c52f662]);
        assert_eq!(
            philox4x32([0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344], [0xa4093822, 0x299f31d0], 7),
            [0x4dfccaba, 0x190a87f0, 0xc47362ba, 0xb6b5242a]
        );
    }

    #[test]
    fn chunked_fill_equals_whole_fill() {
        let r = Philox::new(42).with_stream(3);
        let mut whole = vec![0f32; 37];
        r.fill_normal(100, 0.0, 1.0, &mut whole);
        let mut parts = vec![0f32; 37];
        let (a, b) = parts.split_at_mut(11);
        r.fill_normal(100, 0.0, 1.0, a);
        r.fill_normal(111, 0.0, 1.0, b);
        assert_eq!(whole, parts);
    }

    #[test]
    fn streams_differ_and_moments_are_right() {
        let a = Philox::new(7);
        let b = a.with_stream(1);
        assert_ne!(a.block(0), b.block(0));
        let mut v = vec![0f32; 20000];
        a.fill_normal(0, 0.0, 1.0, &mut v);
        let mean = v.iter().map(|&x| x as f64).sum::<f64>() / v.len() as f64;
        let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / v.len() as f64;
        assert!(mean.abs() < 0.03, "mean {mean}");
        assert!((var - 1.0).abs() < 0.05, "var {var}");
        let mut u = vec![0f32; 20000];
        a.fill_uniform(0, &mut u);
        assert!(u.iter().all(|&x| (0.0..1.0).contains(&x)));
    }
}
