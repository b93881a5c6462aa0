//! Megatron's global load-balancing loss (--moe-router-load-balancing-type global_aux_loss): the
//! switch loss of each micro-batch taken with, in place of its own per-expert counts, the mean
//! over the step's micro-batches so far of the counts summed over every data-, context- (and,
//! with whole experts, tensor-) parallel rank. Over a step the balance it asks for is the global
//! batch's rather than one micro-batch's.
//!
//! The running sums live here, one per layer, on the layers' device (nothing is read back). A
//! layer adds to its sum in the backward, which runs once per micro-batch in forward order on
//! every schedule (a recomputed forward adds nothing); whoever runs the steps calls
//! [`GlobalCounts::reset`] after each one (the trainer does), as Megatron's
//! `reset_global_aux_loss_tracker`.

use ferrotron_core::{Result, Tensor};
use ferrotron_kernels as k;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// Shared by every layer built from one `MoeSpec` (clones share the sums).
#[derive(Clone, Debug, Default)]
pub struct GlobalCounts {
    layers: Arc<Mutex<BTreeMap<String, (Tensor, u32)>>>,
}

impl GlobalCounts {
    /// Adds one micro-batch's per-expert counts (f32, already summed over the ranks) to `layer`'s
    /// sum and returns `scale` × the mean over the micro-batches added since the last reset (a
    /// new tensor).
    pub fn add(&self, layer: &str, counts: &Tensor, scale: f32) -> Result<Tensor> {
        let mut l = self.layers.lock().unwrap_or_else(|e| e.into_inner());
        let (sum, n) = match l.get_mut(layer) {
            Some((sum, n)) => {
                k::add_(sum, counts)?;
                *n += 1;
                (sum, *n)
            }
            None => {
                let sum = Tensor::zeros(counts.dims().to_vec(), counts.dtype(), counts.device())?;
                k::copy_(&sum, counts)?;
                let (sum, n) = l.entry(layer.to_string()).or_insert((sum, 1));
                (sum, *n)
            }
        };
        k::scale(sum, scale / n as f32)
    }

    /// Starts a new step: every layer's sum cleared.
    pub fn reset(&self) {
        self.layers.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }

    /// Micro-batches `layer` has added since the last reset.
    pub fn steps(&self, layer: &str) -> u32 {
        self.layers.lock().unwrap_or_else(|e| e.into_inner()).get(layer).map_or(0, |e| e.1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrotron_core::Device;

    #[test]
    fn running_mean_per_layer_until_reset() {
        let g = GlobalCounts::default();
        let t = |v: &[f32]| Tensor::from_vec(v.to_vec(), [v.len()], &Device::Cpu).unwrap();
        let c1 = t(&[4.0, 0.0, 2.0]);
        assert_eq!(g.add("a", &c1, 1.0).unwrap().to_vec_f32().unwrap(), vec![4.0, 0.0, 2.0]);
        assert_eq!(c1.to_vec_f32().unwrap(), vec![4.0, 0.0, 2.0], "the caller's counts are not the sum");
        assert_eq!(g.add("a", &t(&[0.0, 2.0, 2.0]), 1.0).unwrap().to_vec_f32().unwrap(), vec![2.0, 1.0, 2.0]);
        assert_eq!(g.add("b", &t(&[1.0, 1.0, 1.0]), 0.5).unwrap().to_vec_f32().unwrap(), vec![0.5, 0.5, 0.5]);
        assert_eq!((g.steps("a"), g.steps("b")), (2, 1));
        g.reset();
        assert_eq!(g.steps("a"), 0);
        assert_eq!(g.add("a", &t(&[6.0, 0.0, 0.0]), 1.0).unwrap().to_vec_f32().unwrap(), vec![6.0, 0.0, 0.0]);
    }
}
