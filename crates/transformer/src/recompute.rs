//! Activation recompute (Megatron's `--recompute-granularity/-method/-num-layers`).
//!
//! - Full: a group of layers keeps only its input; the backward runs the group's forward again,
//!   then its backward. `uniform` cuts a stage's layers into groups of N; `block` recomputes the
//!   first N layers of each stage (one group each) and keeps everything for the rest.
//! - Selective: the core attention (softmax(QKᵀ)V and its log-sum-exp) is recomputed from Q, K, V
//!   in the backward; its output is not kept (Megatron's selective recompute, whose big saving is
//!   the attention probabilities; with a fused attention those are never stored, so what it saves
//!   here is the attention output).
//!
//! Forward passes are deterministic, so recomputing gives the same gradients bit for bit.

use std::ops::Range;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Granularity {
    #[default]
    None,
    Selective,
    Full,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Method {
    #[default]
    Uniform,
    Block,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Recompute {
    pub granularity: Granularity,
    pub method: Method,
    /// Layers per group (uniform) or layers recomputed per stage (block).
    pub num_layers: usize,
}

impl Recompute {
    pub fn parse(granularity: Option<&str>, method: Option<&str>, num_layers: Option<usize>) -> Result<Self, String> {
        let granularity = match granularity {
            None => Granularity::None,
            Some("full") => Granularity::Full,
            Some("selective") => Granularity::Selective,
            Some(o) => return Err(format!("--recompute-granularity {o}: use full or selective")),
        };
        let method = match method {
            None | Some("uniform") => Method::Uniform,
            Some("block") => Method::Block,
            Some(o) => return Err(format!("--recompute-method {o}: use uniform or block")),
        };
        let num_layers = num_layers.unwrap_or(1);
        if granularity == Granularity::Full && num_layers == 0 {
            return Err("--recompute-num-layers must be at least 1 with --recompute-granularity full".into());
        }
        Ok(Recompute { granularity, method, num_layers })
    }

    /// Groups of a stage's `n` layers (local indices) and whether each is recomputed.
    pub fn groups(&self, n: usize) -> Vec<(Range<usize>, bool)> {
        match (self.granularity, self.method) {
            (Granularity::Full, Method::Uniform) => {
                let k = self.num_layers.max(1);
                (0..n).step_by(k).map(|s| (s..(s + k).min(n), true)).collect()
            }
            (Granularity::Full, Method::Block) => (0..n).map(|i| (i..i + 1, i < self.num_layers)).collect(),
            _ => (0..n).map(|i| (i..i + 1, false)).collect(),
        }
    }

    pub fn selective(&self) -> bool {
        self.granularity == Granularity::Selective
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_follow_the_method() {
        let full = |method, num_layers| Recompute { granularity: Granularity::Full, method, num_layers };
        assert_eq!(full(Method::Uniform, 2).groups(5), vec![(0..2, true), (2..4, true), (4..5, true)]);
        assert_eq!(full(Method::Block, 2).groups(3), vec![(0..1, true), (1..2, true), (2..3, false)]);
        assert_eq!(Recompute::default().groups(2), vec![(0..1, false), (1..2, false)]);
        assert!(Recompute::parse(Some("most"), None, None).unwrap_err().contains("--recompute-granularity most"));
    }
}
