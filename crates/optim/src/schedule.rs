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
    pub warmup_iters: u64,
    pub decay_iters: u64,
    pub style: DecayStyle,
}

impl LrSchedule {
    /// The rate of the update after `done` completed iterations (iteration `done` + 1's).
    pub fn lr_at(&self, done: u64) -> f64 {
        if self.warmup_iters > 0 && done <= self.warmup_iters {
            return self.init_lr + (self.lr - self.init_lr) * done as f64 / self.warmup_iters as f64;
        }
        if self.style == DecayStyle::Constant {
            return self.lr;
        }
        if done > self.decay_iters {
            return self.min_lr;
        }
        let span = self.decay_iters.saturating_sub(self.warmup_iters).max(1) as f64;
        let ratio = (done - self.warmup_iters) as f64 / span;
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
            warmup_iters: 10,
            decay_iters: 110,
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
        let none = LrSchedule { warmup_iters: 0, ..s };
        assert_eq!(none.lr_at(0), 1e-3, "no warmup: the first update at the full rate");
    }
}
