//! ferrotron-optim: the optimizer side of training.
//!
//! - `Optimizer`: AdamW with fp32 master weights and moments as flat buffers laid out by the
//!   model's `ParamTable` (one table drives params, grads, buckets and optimizer state); weight
//!   decay as Megatron (none on biases and norm weights); clipping by the global L2 norm, with
//!   parameters replicated across tensor-parallel ranks counted once. Under the distributed
//!   optimizer a rank keeps state only for its data-parallel shards.
//! - `GradSync`: data-parallel buckets over main_grad, all-reduce or reduce-scatter, overlapped
//!   with backward on a communication thread when asked; the parameter all-gather after a
//!   distributed step; the tensor-parallel sum of sequence-parallel grads.
//! - `train_step`: accumulation + sync + update for one global batch (`queue_train_step` queues it
//!   without reading the loss back; `QueuedStep::read` later).
//! - `StepGraph`: the whole step captured once as a CUDA graph and replayed (`graph`).
//! - `LrSchedule`: Megatron's warmup + constant/linear/cosine decay to min-lr.

mod adam;
mod ddp;
mod graph;
mod pipeline;
mod schedule;
mod step;

pub use adam::{AdamConfig, Algorithm, OptimError, Optimizer, StepStats};
pub use ddp::{BucketPlan, GradSync, default_bucket_size};
pub use graph::StepGraph;
pub use pipeline::{eval_pipelined, queue_train_step_pipelined, schedule_kind, train_step_pipelined};
pub use schedule::{DecayStyle, LrSchedule, WdSchedule, WdStyle, WsdStyle};
pub use step::{QueuedStep, StepError, StepOutput, loss_sums, queue_train_step, token_weighted, train_step};
