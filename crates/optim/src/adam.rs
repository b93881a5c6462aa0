//! AdamW with fp32 master weights over flat buffers.
//!
//! Per step: global grad norm over main_grad → clip coefficient → one AdamW update per parameter
//! view of the master buffer (weight decay only where `ParamMeta::weight_decay`) → master copied
//! (rounded) into the model's parameter buffer. Non-finite gradients skip the step.

use ferrotron_core::{DType, ParamTable, Result as CoreResult, Tensor};
use ferrotron_kernels::{self as k, AdamW};

#[derive(Debug, thiserror::Error)]
pub enum OptimError {
    #[error("optimizer state does not match the model: {0}")]
    StateMismatch(String),
    #[error(transparent)]
    Core(#[from] ferrotron_core::Error),
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamConfig {
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    /// Clip main_grad to this global L2 norm; 0 disables clipping.
    pub clip_grad: f32,
}

impl Default for AdamConfig {
    fn default() -> Self {
        // Megatron's defaults.
        AdamConfig { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01, clip_grad: 1.0 }
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepStats {
    pub grad_norm: f64,
    /// False when the gradient norm was not finite and the update was skipped.
    pub applied: bool,
}

pub struct Optimizer {
    pub config: AdamConfig,
    master: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    step: u64,
}

impl Optimizer {
    /// Master weights start as an fp32 copy of the parameters; moments at zero.
    pub fn new(table: &ParamTable, config: AdamConfig) -> CoreResult<Self> {
        let dev = table.flat_params().device().clone();
        let n = table.numel();
        Ok(Optimizer {
            config,
            master: k::cast(table.flat_params(), DType::F32)?,
            exp_avg: Tensor::zeros([n], DType::F32, &dev)?,
            exp_avg_sq: Tensor::zeros([n], DType::F32, &dev)?,
            step: 0,
        })
    }

    /// Steps taken so far.
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// Bytes of optimizer state (master + two moments).
    pub fn state_bytes(&self) -> usize {
        3 * 4 * self.master.elem_count()
    }

    /// One update from the accumulated main_grad at learning rate `lr`.
    pub fn step(&mut self, table: &ParamTable, lr: f32) -> CoreResult<StepStats> {
        let grad_norm = k::global_l2_norm(&[table.flat_grads()])?;
        if !grad_norm.is_finite() {
            return Ok(StepStats { grad_norm, applied: false });
        }
        let c = self.config;
        let grad_scale = if c.clip_grad > 0.0 && grad_norm > c.clip_grad as f64 {
            (c.clip_grad as f64 / (grad_norm + 1e-6)) as f32
        } else {
            1.0
        };
        self.step += 1;
        for id in table.ids() {
            let r = table.range(id);
            let shape = [r.len()];
            let h = AdamW {
                lr,
                beta1: c.beta1,
                beta2: c.beta2,
                eps: c.eps,
                weight_decay: if table.meta(id).weight_decay { c.weight_decay } else { 0.0 },
                step: self.step,
                grad_scale,
            };
            k::adamw_step(
                &self.master.view(r.start, shape)?,
                &table.flat_grads().view(r.start, shape)?,
                &self.exp_avg.view(r.start, shape)?,
                &self.exp_avg_sq.view(r.start, shape)?,
                &h,
            )?;
        }
        k::copy_(table.flat_params(), &self.master)?;
        Ok(StepStats { grad_norm, applied: true })
    }

    /// (master, exp_avg, exp_avg_sq, step) for checkpointing.
    pub fn state(&self) -> (&Tensor, &Tensor, &Tensor, u64) {
        (&self.master, &self.exp_avg, &self.exp_avg_sq, self.step)
    }

    /// Restores state saved by `state`; sizes must match the model.
    pub fn load_state(
        &mut self,
        master: &[f32],
        exp_avg: &[f32],
        exp_avg_sq: &[f32],
        step: u64,
    ) -> Result<(), OptimError> {
        let n = self.master.elem_count();
        for (name, v) in
            [("master weights", master.len()), ("exp_avg", exp_avg.len()), ("exp_avg_sq", exp_avg_sq.len())]
        {
            if v != n {
                return Err(OptimError::StateMismatch(format!(
                    "{name} has {v} elements, the model has {n} parameters"
                )));
            }
        }
        self.master.copy_from_f32(master)?;
        self.exp_avg.copy_from_f32(exp_avg)?;
        self.exp_avg_sq.copy_from_f32(exp_avg_sq)?;
        self.step = step;
        Ok(())
    }
}
