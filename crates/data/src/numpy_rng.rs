//! numpy's random generators, to the bit, as far as Megatron's datasets draw from them:
//! `RandomState(seed).shuffle` (GPTDataset's indices) and `default_rng(seed).integers` (the mock
//! dataset's sequence lengths). The oracle is numpy itself (tests/fixtures).

/// numpy's legacy `RandomState(seed)` as far as Megatron's datasets use it: MT19937 seeded by
/// `init_genrand`, and `shuffle` of a 1-D array.
pub struct NumpyRandomState(rand_mt::Mt);

impl NumpyRandomState {
    pub fn new(seed: u32) -> Self {
        NumpyRandomState(rand_mt::Mt::new(seed))
    }

    /// A uniform integer in 0..=max, drawn as numpy's `random_interval`: the draw masked to the
    /// smallest all-ones number covering `max`, redrawn while above it.
    pub fn interval(&mut self, max: u64) -> u64 {
        if max == 0 {
            return 0;
        }
        let mask = u64::MAX >> max.leading_zeros();
        loop {
            let v = if max <= u32::MAX as u64 {
                self.0.next_u32() as u64
            } else {
                // Two draws, the first the high half (numpy's `mt19937_next64`); no shuffle here
                // reaches 2^32 elements.
                (self.0.next_u32() as u64) << 32 | self.0.next_u32() as u64
            } & mask;
            if v <= max {
                return v;
            }
        }
    }

    /// numpy's `shuffle` of a 1-D array: Fisher–Yates from the last element down.
    pub fn shuffle<T>(&mut self, xs: &mut [T]) {
        for i in (1..xs.len()).rev() {
            let j = self.interval(i as u64) as usize;
            xs.swap(i, j);
        }
    }
}

/// numpy's `default_rng(seed)` for a non-negative integer seed: PCG64 (XSL-RR output) seeded
/// through `SeedSequence`.
pub struct NumpyGenerator {
    state: u128,
    inc: u128,
    /// PCG64 hands out 32-bit draws as the two halves of a 64-bit one, low half first.
    spare: Option<u32>,
}

const PCG_MULT: u128 = 0x2360_ed05_1fc6_5da4_4385_df64_9fcc_f645;

impl NumpyGenerator {
    pub fn new(seed: u64) -> Self {
        let w = seed_sequence_state(seed);
        let word = |k: usize| (w[2 * k + 1] as u64) << 32 | w[2 * k] as u64;
        let (init_state, init_seq) =
            ((word(0) as u128) << 64 | word(1) as u128, (word(2) as u128) << 64 | word(3) as u128);
        let mut g = NumpyGenerator { state: 0, inc: init_seq << 1 | 1, spare: None };
        g.step();
        g.state = g.state.wrapping_add(init_state);
        g.step();
        g
    }

    fn step(&mut self) {
        self.state = self.state.wrapping_mul(PCG_MULT).wrapping_add(self.inc);
    }

    pub fn next_u64(&mut self) -> u64 {
        self.step();
        let (hi, lo) = ((self.state >> 64) as u64, self.state as u64);
        (hi ^ lo).rotate_right((self.state >> 122) as u32)
    }

    pub fn next_u32(&mut self) -> u32 {
        if let Some(x) = self.spare.take() {
            return x;
        }
        let x = self.next_u64();
        self.spare = Some((x >> 32) as u32);
        x as u32
    }

    /// `integers(low, high)` for a 32-bit dtype: uniform in low..high by Lemire's multiply and
    /// reject, as numpy draws it.
    pub fn integers_u32(&mut self, low: u32, high: u32, n: usize) -> Vec<u32> {
        let range = high - low - 1;
        (0..n)
            .map(|_| {
                if range == 0 {
                    return low;
                }
                let excl = range.wrapping_add(1);
                let mut m = self.next_u32() as u64 * excl as u64;
                if (m as u32) < excl {
                    let threshold = (u32::MAX - range) % excl;
                    while (m as u32) < threshold {
                        m = self.next_u32() as u64 * excl as u64;
                    }
                }
                low + (m >> 32) as u32
            })
            .collect()
    }
}

/// `SeedSequence(seed).generate_state(8, uint32)`: the seed's 32-bit words hashed into a pool of
/// four, then drawn out through a second hash.
fn seed_sequence_state(seed: u64) -> [u32; 8] {
    const MULT_A: u32 = 0x931e_8875;
    const MULT_B: u32 = 0x58f3_8ded;
    let entropy: Vec<u32> = if seed >> 32 == 0 { vec![seed as u32] } else { vec![seed as u32, (seed >> 32) as u32] };
    let mut hash_const: u32 = 0x43b0_d7e5;
    let mut hashmix = |v: u32| -> u32 {
        let mut v = v ^ hash_const;
        hash_const = hash_const.wrapping_mul(MULT_A);
        v = v.wrapping_mul(hash_const);
        v ^ v >> 16
    };
    let mix = |x: u32, y: u32| -> u32 {
        let r = 0xca01_f9dd_u32.wrapping_mul(x).wrapping_sub(0x4973_f715_u32.wrapping_mul(y));
        r ^ r >> 16
    };
    let mut pool = [0u32; 4];
    for (i, p) in pool.iter_mut().enumerate() {
        *p = hashmix(entropy.get(i).copied().unwrap_or(0));
    }
    for src in 0..4 {
        for dst in 0..4 {
            if src != dst {
                let h = hashmix(pool[src]);
                pool[dst] = mix(pool[dst], h);
            }
        }
    }
    let mut hash_const: u32 = 0x8b51_f9dd;
    let mut out = [0u32; 8];
    for (i, o) in out.iter_mut().enumerate() {
        let mut v = pool[i % 4] ^ hash_const;
        hash_const = hash_const.wrapping_mul(MULT_B);
        v = v.wrapping_mul(hash_const);
        *o = v ^ v >> 16;
    }
    out
}
