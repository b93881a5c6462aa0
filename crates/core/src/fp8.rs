//! What a module's FP8 products need to know (`Module::set_fp8`): the format, and under delayed
//! scaling (Megatron's `--fp8-recipe delayed`, Transformer Engine's DelayedScaling) where each
//! quantized tensor's scale and amax history live.
//!
//! Delayed scaling quantizes a tensor with a scale chosen before it is seen (from the amaxes of
//! earlier passes) and records the tensor's amax for later ones. Per FP8 linear layer three
//! tensors are tracked: its input x and weight w (forward slots 2i and 2i + 1) and its output
//! gradient dy (backward slot i). `Fp8Metas` holds one stage's slots as four tensors on the
//! model's device: histories [history_len, slots] (row 0 collects the current pass's amax, as
//! Transformer Engine's staging row) and scales [slots], starting at 1. The math (quantizing,
//! the update after a pass) is ferrotron-kernels'; who reduces the amaxes across ranks is the
//! trainer's (`set_reduce`).

use crate::{DType, Device, Fp8Format, ParamId, Result, Tensor, invalid};
use std::sync::{Arc, Mutex, MutexGuard};

/// Which amax the scale follows: Megatron's `--fp8-amax-compute-algo`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AmaxAlgo {
    /// The last pass's.
    MostRecent,
    /// The largest in the history.
    Max,
}

impl AmaxAlgo {
    pub fn parse(s: &str) -> Option<AmaxAlgo> {
        match s {
            "most_recent" => Some(AmaxAlgo::MostRecent),
            "max" => Some(AmaxAlgo::Max),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            AmaxAlgo::MostRecent => "most_recent",
            AmaxAlgo::Max => "max",
        }
    }
}

/// Delayed scaling's settings: `--fp8-amax-history-len`, `--fp8-amax-compute-algo`,
/// `--fp8-margin` (the scale is fp8_max / amax / 2^margin).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DelayedScaling {
    pub history_len: usize,
    pub algo: AmaxAlgo,
    pub margin: i32,
}

/// The four state tensors of one stage's slots (f32, on the model's device).
#[derive(Debug, Clone)]
pub struct MetaTensors {
    /// [history_len, 2 · layers]: x and w of each layer.
    pub fwd_history: Tensor,
    pub fwd_scale: Tensor,
    /// [history_len, layers]: dy of each layer.
    pub bwd_history: Tensor,
    pub bwd_scale: Tensor,
}

/// Reduces an amax row across the ranks that quantize the same tensors (max): the trainer's.
pub type AmaxReduce = Box<dyn Fn(&Tensor) -> Result<()> + Send + Sync>;

/// One pipeline stage's delayed-scaling state (module header).
pub struct Fp8Metas {
    pub config: DelayedScaling,
    /// Each slot's layer weight and part ("" for the whole; Mamba's in_proj is three), in slot
    /// order (checkpoints name the state after them).
    weights: Mutex<Vec<(ParamId, &'static str)>>,
    tensors: Mutex<Option<MetaTensors>>,
    reduce: Mutex<Option<AmaxReduce>>,
}

impl std::fmt::Debug for Fp8Metas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fp8Metas").field("config", &self.config).field("layers", &self.layers()).finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Fp8Metas {
    pub fn new(config: DelayedScaling) -> Arc<Fp8Metas> {
        Arc::new(Fp8Metas { config, weights: Mutex::new(vec![]), tensors: Mutex::new(None), reduce: Mutex::new(None) })
    }

    /// A new layer slot for the linear layer of weight `w` (its `part` of it, "" for all of it),
    /// before `allocate`.
    pub fn add(&self, w: ParamId, part: &'static str) -> usize {
        let mut v = lock(&self.weights);
        v.push((w, part));
        v.len() - 1
    }

    /// Layer slots registered.
    pub fn layers(&self) -> usize {
        lock(&self.weights).len()
    }

    /// Each slot's weight and part, in slot order.
    pub fn weights(&self) -> Vec<(ParamId, &'static str)> {
        lock(&self.weights).clone()
    }

    /// Makes the state tensors on `device` for the slots registered: zero histories, unit scales
    /// (one unused slot where none is: a stage whose layers all keep bf16 holds no empty buffers).
    pub fn allocate(&self, device: &Device) -> Result<()> {
        let (len, n) = (self.config.history_len, self.layers().max(1));
        if len == 0 {
            return Err(invalid(
                "Fp8Metas::allocate",
                "an amax history of length 0: --fp8-amax-history-len is at least 1",
            ));
        }
        let ones = |k: usize| Tensor::from_vec(vec![1.0f32; k], [k], device);
        *lock(&self.tensors) = Some(MetaTensors {
            fwd_history: Tensor::zeros([len, 2 * n], DType::F32, device)?,
            fwd_scale: ones(2 * n)?,
            bwd_history: Tensor::zeros([len, n], DType::F32, device)?,
            bwd_scale: ones(n)?,
        });
        Ok(())
    }

    /// The state tensors (handles onto the same storage).
    pub fn tensors(&self) -> Result<MetaTensors> {
        lock(&self.tensors)
            .clone()
            .ok_or_else(|| invalid("Fp8Metas", "the delayed-scaling state was not allocated (Fp8Metas::allocate)"))
    }

    pub fn set_reduce(&self, reduce: AmaxReduce) {
        *lock(&self.reduce) = Some(reduce);
    }

    /// Reduces `row` across the ranks set by `set_reduce` (nothing without one).
    pub fn reduce(&self, row: &Tensor) -> Result<()> {
        match &*lock(&self.reduce) {
            Some(f) => f(row),
            None => Ok(()),
        }
    }
}

/// How a module runs its products in FP8 (`Module::set_fp8`'s argument).
#[derive(Clone, Debug)]
pub struct Fp8Recipe {
    pub format: Fp8Format,
    /// Delayed scaling's state; None: each tensor scaled by its own amax (tensorwise).
    pub delayed: Option<Arc<Fp8Metas>>,
}

impl Fp8Recipe {
    /// The settings of one linear layer of weight `w`: under delayed scaling a new slot.
    pub fn linear(&self, w: ParamId) -> Fp8Linear {
        self.linear_part(w, "")
    }

    /// The settings of a linear layer whose weight is `part` of `w`'s rows (a name unique
    /// among the parts).
    pub fn linear_part(&self, w: ParamId, part: &'static str) -> Fp8Linear {
        let slot = self.delayed.as_ref().map(|m| Fp8Slot { index: m.add(w, part), metas: m.clone() });
        Fp8Linear { format: self.format, slot }
    }
}

/// One FP8 linear layer's settings.
#[derive(Clone, Debug)]
pub struct Fp8Linear {
    pub format: Fp8Format,
    /// Its delayed-scaling slot; None: tensorwise.
    pub slot: Option<Fp8Slot>,
}

#[derive(Clone, Debug)]
pub struct Fp8Slot {
    pub metas: Arc<Fp8Metas>,
    pub index: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metas_hold_three_slots_a_layer() {
        let cfg = DelayedScaling { history_len: 3, algo: AmaxAlgo::Max, margin: 0 };
        let recipe = Fp8Recipe { format: Fp8Format::Hybrid, delayed: Some(Fp8Metas::new(cfg)) };
        let m = recipe.delayed.clone().unwrap();
        assert!(m.tensors().is_err(), "nothing before allocate");
        let (a, b) = (recipe.linear(ParamId(7)), recipe.linear_part(ParamId(3), "z"));
        assert_eq!((a.slot.unwrap().index, b.slot.unwrap().index), (0, 1));
        assert_eq!(m.weights(), vec![(ParamId(7), ""), (ParamId(3), "z")]);
        m.allocate(&Device::Cpu).unwrap();
        let t = m.tensors().unwrap();
        assert_eq!((t.fwd_history.dims(), t.bwd_history.dims()), (&[3, 4][..], &[3, 2][..]));
        assert_eq!(t.fwd_scale.to_vec_f32().unwrap(), vec![1.0; 4]);
        assert!(t.fwd_history.to_vec_f32().unwrap().iter().all(|&v| v == 0.0));
        // Tensorwise: no slot.
        assert!(Fp8Recipe { format: Fp8Format::E4M3, delayed: None }.linear(ParamId(1)).slot.is_none());
        let none = Fp8Metas::new(DelayedScaling { history_len: 0, ..cfg });
        assert!(none.allocate(&Device::Cpu).unwrap_err().to_string().contains("--fp8-amax-history-len"));
        for a in [AmaxAlgo::Max, AmaxAlgo::MostRecent] {
            assert_eq!(AmaxAlgo::parse(a.as_str()), Some(a));
        }
        assert_eq!(AmaxAlgo::parse("mean"), None);
    }
}
