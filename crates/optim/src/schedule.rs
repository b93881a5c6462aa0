//! Learning-rate schedule, Megatron's OptimizerParamScheduler: linear warmup from `init_lr` to
//! `lr`, then constant, linear, cosine, inverse-square-root or WSD (warmup-stable-decay) decay to
//! `min_lr`, then `min_lr`. Lengths are in samples, as Megatron counts them (`--lr-*-iters` are
//! that many global batches), and the scheduler steps after each update: an iteration trains at
//! the rate of the samples consumed before it, the first at `init_lr` under a warmup
//! (`--lr-warmup-init`, default 0). Weight decay has its own schedule (`WdSchedule`).

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecayStyle {
    Constant,
    Linear,
    Cosine,
    InverseSquareRoot,
    /// Stable at `lr` until the last `wsd_decay` samples of the decay, then down to `min_lr`.
    Wsd(WsdStyle),
}

/// How WSD's final stretch falls (Megatron's --lr-wsd-decay-style).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WsdStyle {
    Exponential,
    Linear,
    Cosine,
    MinusSqrt,
}

impl DecayStyle {
    /// `--lr-decay-style` (and for WSD `--lr-wsd-decay-style`, Megatron's default exponential).
    pub fn parse(style: &str, wsd: &str) -> Option<Self> {
        Some(match style {
            "constant" => DecayStyle::Constant,
            "linear" => DecayStyle::Linear,
            "cosine" => DecayStyle::Cosine,
            "inverse-square-root" => DecayStyle::InverseSquareRoot,
            "WSD" => DecayStyle::Wsd(match wsd {
                "exponential" => WsdStyle::Exponential,
                "linear" => WsdStyle::Linear,
                "cosine" => WsdStyle::Cosine,
                "minus_sqrt" => WsdStyle::MinusSqrt,
                _ => return None,
            }),
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
    /// Samples of warmup, of decay (the warmup's included), and of WSD's final fall.
    pub warmup: f64,
    pub decay: f64,
    pub wsd_decay: f64,
    pub style: DecayStyle,
}

impl LrSchedule {
    /// The rate of the update made after `consumed` samples (Megatron's `get_lr` at `num_steps`).
    pub fn lr_at(&self, consumed: u64) -> f64 {
        let n = consumed as f64;
        if self.warmup > 0.0 && n <= self.warmup {
            return self.init_lr + (self.lr - self.init_lr) * n / self.warmup;
        }
        if self.style == DecayStyle::Constant {
            return self.lr;
        }
        if n > self.decay {
            return self.min_lr;
        }
        if self.style == DecayStyle::InverseSquareRoot {
            return self.min_lr.max(self.lr * (self.warmup.max(1.0) / n.max(1.0)).sqrt());
        }
        // Here warmup < n <= decay, so the span is positive.
        let ratio = (n - self.warmup) / (self.decay - self.warmup);
        let cosine = |r: f64| 0.5 * ((std::f64::consts::PI * r).cos() + 1.0);
        let coeff = match self.style {
            DecayStyle::Linear => 1.0 - ratio,
            DecayStyle::Wsd(w) => {
                let start = self.decay - self.wsd_decay;
                if n <= start {
                    1.0
                } else {
                    let r = (n - start) / self.wsd_decay;
                    match w {
                        WsdStyle::Linear => 1.0 - r,
                        WsdStyle::Cosine => cosine(r),
                        WsdStyle::Exponential => 2.0 * 0.5f64.powf(r) - 1.0,
                        WsdStyle::MinusSqrt => 1.0 - r.sqrt(),
                    }
                }
            }
            _ => cosine(ratio),
        };
        self.min_lr + coeff * (self.lr - self.min_lr)
    }
}

/// How weight decay moves from its start to its end (Megatron's --weight-decay-incr-style).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WdStyle {
    Constant,
    Linear,
    Cosine,
}

impl WdStyle {
    pub fn parse(style: &str) -> Option<Self> {
        Some(match style {
            "constant" => WdStyle::Constant,
            "linear" => WdStyle::Linear,
            "cosine" => WdStyle::Cosine,
            _ => return None,
        })
    }
}

/// Weight decay over the run, Megatron's `get_wd`: from `start` to `end` over the first `incr`
/// samples (the whole run), then `end`; constant is `end` throughout (and start = end).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WdSchedule {
    pub start: f64,
    pub end: f64,
    pub incr: f64,
    pub style: WdStyle,
}

impl WdSchedule {
    /// The weight decay of the update made after `consumed` samples (read with `lr_at`'s rate).
    pub fn wd_at(&self, consumed: u64) -> f64 {
        let n = consumed as f64;
        if self.style == WdStyle::Constant || n > self.incr || self.incr <= 0.0 {
            return self.end;
        }
        let r = n / self.incr;
        let coeff = match self.style {
            WdStyle::Linear => r,
            _ => 0.5 * ((std::f64::consts::PI * (1.0 - r)).cos() + 1.0),
        };
        self.start + coeff * (self.end - self.start)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_each_decay_to_min() {
        // In samples: 10 of warmup, 110 of decay (a global batch of 1, so samples are iterations).
        let s = LrSchedule {
            lr: 1e-3,
            min_lr: 1e-4,
            init_lr: 0.0,
            warmup: 10.0,
            decay: 110.0,
            wsd_decay: 20.0,
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
        let none = LrSchedule { warmup: 0.0, ..s };
        assert_eq!(none.lr_at(0), 1e-3, "no warmup: the first update at the full rate");
        // A warmup of 2.5 global batches (e.g. 80 samples at 32, counted here in batches).
        let half = LrSchedule { warmup: 2.5, ..s };
        assert!((half.lr_at(2) - 0.8e-3).abs() < 1e-15 && half.lr_at(3) < 1e-3 && half.lr_at(3) > 0.99e-3);
        // Inverse square root: lr·√(warmup / n) after the warmup, never below min_lr.
        let isr = LrSchedule { style: DecayStyle::InverseSquareRoot, ..s };
        assert!((isr.lr_at(40) - 0.5e-3).abs() < 1e-15);
        assert_eq!(isr.lr_at(109), 1e-4_f64.max(1e-3 * (10.0f64 / 109.0).sqrt()));
        let isr0 = LrSchedule { warmup: 0.0, ..isr };
        assert_eq!((isr0.lr_at(0), isr0.lr_at(4)), (1e-3, 0.5e-3), "the warmup and the count clamped at 1");
        // WSD: stable to sample 90, then the last 20 fall.
        for (w, mid) in [
            (WsdStyle::Linear, 0.5),
            (WsdStyle::Cosine, 0.5),
            (WsdStyle::Exponential, 2.0 * 0.5f64.sqrt() - 1.0),
            (WsdStyle::MinusSqrt, 1.0 - 0.5f64.sqrt()),
        ] {
            let d = LrSchedule { style: DecayStyle::Wsd(w), ..s };
            assert_eq!((d.lr_at(11), d.lr_at(90)), (1e-3, 1e-3), "{w:?}: stable");
            assert!((d.lr_at(100) - (1e-4 + mid * 9e-4)).abs() < 1e-12, "{w:?} halfway");
            assert!((d.lr_at(110) - 1e-4).abs() < 1e-12, "{w:?} ends at min_lr");
        }
        assert_eq!(DecayStyle::parse("WSD", "exponential"), Some(DecayStyle::Wsd(WsdStyle::Exponential)));
        assert_eq!(DecayStyle::parse("WSD", "bogus"), None);
        assert_eq!(DecayStyle::parse("inverse-square-root", ""), Some(DecayStyle::InverseSquareRoot));
    }

    #[test]
    fn weight_decay_rises_from_start_to_end_over_the_run() {
        let w = WdSchedule { start: 0.0, end: 0.1, incr: 100.0, style: WdStyle::Linear };
        assert_eq!((w.wd_at(0), w.wd_at(100), w.wd_at(1000)), (0.0, 0.1, 0.1));
        assert!((w.wd_at(25) - 0.025).abs() < 1e-15);
        // Cosine: half-way at the midpoint, slow at both ends.
        let c = WdSchedule { style: WdStyle::Cosine, ..w };
        assert!((c.wd_at(50) - 0.05).abs() < 1e-15 && c.wd_at(0).abs() < 1e-15);
        assert!(c.wd_at(10) < w.wd_at(10) && c.wd_at(90) > w.wd_at(90));
        let k = WdSchedule { start: 0.1, end: 0.1, incr: 100.0, style: WdStyle::Constant };
        assert_eq!((k.wd_at(0), k.wd_at(50)), (0.1, 0.1));
        // Falling works the same way.
        let down = WdSchedule { start: 0.1, end: 0.0, ..w };
        assert!((down.wd_at(75) - 0.025).abs() < 1e-15);
        assert_eq!(WdStyle::parse("cosine"), Some(WdStyle::Cosine));
        assert_eq!(WdStyle::parse("exponential"), None);
    }
}
