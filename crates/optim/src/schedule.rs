//! Learning-rate schedule: linear warmup from `init_lr` to `lr`, then constant, linear or cosine
//! decay to `min_lr` at `decay_iters`, then `min_lr` (Megatron's OptimizerParamScheduler).
//! Megatron steps its scheduler after each update, so iteration k trains at the rate of k − 1
//! completed iterations: the first at `init_lr` under a warmup (`--lr-warmup-init`, default 0).

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecayStyle {
    Constant,
    Linear,
    Cosine,
}

impl DecayStyle {
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "constant" => DecayStyle::Constant,
            "linear" => DecayStyle::Linear,
            "cosine" => DecayStyle::Cosine,
            _ => return None,
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LrSchedule {
    pub lr: f64,
    pub min_lr: f64,
    /// The warmup's starting rate (Megatron's --lr-warmup-init).
    pub init_lr: f64,
    /// Warmup and decay lengths in iterations: fractional where Megatron's are in samples
    /// (`--lr-warmup-samples`, `--lr-decay-samples`, a warmup fraction) that a global batch does
    /// not divide.
    pub warmup_iters: f64,
    pub decay_iters: f64,
    pub style: DecayStyle,
}

impl LrSchedule {
    /// The rate of the update after `done` completed iterations (iteration `done` + 1's).
    pub fn lr_at(&self, done: u64) -> f64 {
        let done = done as f64;
        if self.warmup_iters > 0.0 && done <= self.warmup_iters {
            return self.init_lr + (self.lr - self.init_lr) * done / self.warmup_iters;
        }
        if self.style == DecayStyle::Constant {
            return self.lr;
        }
        if done > self.decay_iters {
            return self.min_lr;
        }
        // Here warmup < done <= decay, so the span is positive.
        let ratio = (done - self.warmup_iters) / (self.decay_iters - self.warmup_iters);
        let coeff = match self.style {
            DecayStyle::Linear => 1.0 - ratio,
            _ => 0.5 * ((std::f64::consts::PI * ratio).cos() + 1.0),
        };
        self.min_lr + coeff * (self.lr - self.min_lr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_cosine_to_min() {
        let s = LrSchedule {
            lr: 1e-3,
            min_lr: 1e-4,
            init_lr: 0.0,
            warmup_iters: 10.0,
            decay_iters: 110.0,
            style: DecayStyle::Cosine,
        };
        assert_eq!(s.lr_at(0), 0.0, "the first update, as Megatron's, at the warmup's start");
        assert!((s.lr_at(1) - 1e-4).abs() < 1e-12);
        assert!((s.lr_at(10) - 1e-3).abs() < 1e-12);
        assert!((s.lr_at(60) - 5.5e-4).abs() < 1e-9, "midpoint is the mean of lr and min_lr");
        assert!((s.lr_at(110) - 1e-4).abs() < 1e-12);
        assert_eq!(s.lr_at(500), 1e-4);
        let l = LrSchedule { style: DecayStyle::Linear, ..s };
        assert!((l.lr_at(35) - (1e-4 + 0.75 * 9e-4)).abs() < 1e-12);
        let c = LrSchedule { style: DecayStyle::Constant, ..s };
        assert_eq!(c.lr_at(1000), 1e-3);
        let w = LrSchedule { init_lr: 2e-4, ..s };
        assert!((w.lr_at(0) - 2e-4).abs() < 1e-15 && (w.lr_at(5) - 6e-4).abs() < 1e-12);
        let none = LrSchedule { warmup_iters: 0.0, ..s };
        assert_eq!(none.lr_at(0), 1e-3, "no warmup: the first update at the full rate");
        // A warmup of 2.5 iterations (e.g. 80 samples at a global batch of 32).
        let half = LrSchedule { warmup_iters: 2.5, ..s };
        assert!((half.lr_at(2) - 0.8e-3).abs() < 1e-15 && half.lr_at(3) < 1e-3 && half.lr_at(3) > 0.99e-3);
    }
}
