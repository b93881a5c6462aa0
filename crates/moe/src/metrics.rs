//! The routers' auxiliary-loss values for the log (Megatron's "load_balancing_loss" and "z_loss"
//! lines): each MoE layer records its values once per micro-batch backward; the trainer takes them
//! at a log interval.

use ferrotron_core::{Result, Tensor};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// Shared by every layer built from one `MoeSpec` (clones share the record).
#[derive(Clone, Debug, Default)]
pub struct MoeMetrics {
    record: Arc<Mutex<BTreeMap<String, Vec<Tensor>>>>,
}

/// Means since the last `take`: over this rank's MoE layers of each layer's mean over its
/// recorded micro-batches, without the coefficients.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RouterLossValues {
    /// Σ over layers of the layer's mean load-balancing loss.
    pub load_balancing_sum: f64,
    /// Σ over layers of the layer's mean z-loss.
    pub z_sum: f64,
    /// Layers with at least one record.
    pub layers: usize,
    /// Each such layer's name (its MoE module's prefix, `decoder.layers.3.mlp`) and mean
    /// load-balancing loss and z-loss, in name order.
    pub per_layer: Vec<(String, f64, f64)>,
}

impl MoeMetrics {
    /// Records one micro-batch's values ([2]: load-balancing loss, z-loss) for the layer `name`.
    /// Kept as a tensor: read back only when taken.
    pub fn record(&self, name: &str, values: Tensor) {
        let mut r = self.record.lock().unwrap_or_else(|e| e.into_inner());
        r.entry(name.to_string()).or_default().push(values);
    }

    /// The values recorded since the last call, cleared.
    pub fn take(&self) -> Result<RouterLossValues> {
        let taken = std::mem::take(&mut *self.record.lock().unwrap_or_else(|e| e.into_inner()));
        let mut out = RouterLossValues::default();
        for (name, values) in taken.iter().filter(|(_, v)| !v.is_empty()) {
            let (mut lb, mut z) = (0.0, 0.0);
            for t in values {
                let v = t.to_vec_f32()?;
                lb += v.first().copied().unwrap_or(0.0) as f64;
                z += v.get(1).copied().unwrap_or(0.0) as f64;
            }
            let (lb, z) = (lb / values.len() as f64, z / values.len() as f64);
            out.load_balancing_sum += lb;
            out.z_sum += z;
            out.layers += 1;
            out.per_layer.push((name.clone(), lb, z));
        }
        Ok(out)
    }
}
