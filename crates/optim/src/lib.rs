//! ferrotron-optim: the optimizer side of training.
//!
//! `Optimizer` keeps fp32 master weights and Adam moments as flat buffers laid out by the model's
//! `ParamTable`, so one table drives params, grads and optimizer state (and later DDP buckets and
//! the distributed optimizer's shards). Weight decay follows Megatron: none on biases and norm
//! weights (`ParamMeta::weight_decay`). Clipping is by global L2 norm of main_grad. `LrSchedule` is
//! Megatron's warmup + constant/linear/cosine decay to min-lr.

mod adam;
mod schedule;

pub use adam::{AdamConfig, OptimError, Optimizer, StepStats};
pub use schedule::{DecayStyle, LrSchedule};
