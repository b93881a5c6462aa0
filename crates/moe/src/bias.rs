//! Aux-loss-free load balancing (DeepSeek-V3's expert bias, Megatron's
//! --moe-router-enable-expert-bias): each MoE layer keeps a per-expert bias [E] in fp32 that is
//! added to the router's scores when it picks a token's experts (never to the weights), and that
//! moves after every step against the experts' load:
//!
//!   bias_e += rate · sign(mean_e(count) − count_e)
//!
//! where count_e is the token copies routed to expert e over the step's micro-batches (counted in
//! the backward, so a recomputed forward counts nothing twice), summed by the trainer over every
//! rank of the pipeline stage. The bias is not a parameter: no gradient, no optimizer state; the
//! checkpoint keeps it under Megatron's name `{layer}.mlp.router.expert_bias`.

use ferrotron_core::{Device, Result, Tensor};
use std::sync::{Arc, Mutex};

/// One layer's bias and the counts it moves by.
#[derive(Debug)]
pub struct ExpertBias {
    /// `{prefix}.router.expert_bias`.
    pub name: String,
    state: Mutex<BiasState>,
}

#[derive(Debug)]
struct BiasState {
    values: Vec<f32>,
    /// `values` on the layer's device, made at the first forward after a change.
    on_device: Option<Tensor>,
    /// Token copies per expert since the last update.
    counts: Vec<f64>,
}

impl ExpertBias {
    fn new(name: String, experts: usize) -> Self {
        let state = BiasState { values: vec![0.0; experts], on_device: None, counts: vec![0.0; experts] };
        ExpertBias { name, state: Mutex::new(state) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BiasState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The bias as an [E] f32 tensor on `dev`.
    pub fn tensor(&self, dev: &Device) -> Result<Tensor> {
        let mut s = self.lock();
        match &s.on_device {
            Some(t) if t.device().same(dev) => Ok(t.clone()),
            _ => {
                let t = Tensor::from_vec(s.values.clone(), [s.values.len()], &Device::Cpu)?.to_device(dev)?;
                s.on_device = Some(t.clone());
                Ok(t)
            }
        }
    }

    /// Adds one micro-batch's routed copies per expert.
    pub fn count(&self, per_expert: &[usize]) {
        let mut s = self.lock();
        s.counts.iter_mut().zip(per_expert).for_each(|(c, &n)| *c += n as f64);
    }

    pub fn values(&self) -> Vec<f32> {
        self.lock().values.clone()
    }

    /// Replaces the values (a checkpoint's); their number must be the experts'.
    pub fn set_values(&self, v: &[f32]) -> std::result::Result<(), String> {
        let mut s = self.lock();
        if v.len() != s.values.len() {
            return Err(format!(
                "`{}` holds {} values but the layer has {} experts",
                self.name,
                v.len(),
                s.values.len()
            ));
        }
        s.values.copy_from_slice(v);
        s.on_device = None;
        Ok(())
    }
}

/// Every expert bias of a rank's model (shared by the clones of one `MoeSpec`), in build order.
#[derive(Clone, Debug, Default)]
pub struct ExpertBiases {
    layers: Arc<Mutex<Vec<Arc<ExpertBias>>>>,
}

impl ExpertBiases {
    /// A layer's bias, zero to start (a second call with the same name returns the first's).
    pub fn register(&self, name: String, experts: usize) -> Arc<ExpertBias> {
        let mut l = self.layers.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(b) = l.iter().find(|b| b.name == name) {
            return b.clone();
        }
        let b = Arc::new(ExpertBias::new(name, experts));
        l.push(b.clone());
        b
    }

    pub fn layers(&self) -> Vec<Arc<ExpertBias>> {
        self.layers.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// One step's update: every layer's counts (back to back, f32) summed over the ranks by
    /// `sum` (one collective for all layers), then each bias moved by `rate` against its layer's
    /// mean and the counts cleared. Experts at the mean (or a layer with no tokens) stay.
    pub fn update(&self, rate: f32, sum: impl FnOnce(&mut Vec<f32>) -> Result<()>) -> Result<()> {
        let layers = self.layers();
        if layers.is_empty() {
            // A pipeline stage without MoE layers (--moe-layer-freq): every rank of its groups
            // alike, so none of them joins the collective.
            return Ok(());
        }
        let mut all: Vec<f32> = vec![];
        for b in &layers {
            all.extend(b.lock().counts.iter().map(|&c| c as f32));
        }
        sum(&mut all)?;
        let mut at = 0;
        for b in &layers {
            let mut s = b.lock();
            let e = s.values.len();
            let counts = &all[at..at + e];
            at += e;
            let mean = counts.iter().map(|&c| c as f64).sum::<f64>() / e as f64;
            for (v, &c) in s.values.iter_mut().zip(counts) {
                let off = mean - c as f64;
                if off != 0.0 {
                    *v += rate * off.signum() as f32;
                }
            }
            s.counts.fill(0.0);
            s.on_device = None;
        }
        Ok(())
    }
}
