//! Pipeline parallelism: which layers each stage holds (`stages`), the order in which a stage runs
//! forward and backward passes of micro-batches (`schedule`: no pipelining, 1F1B, interleaved 1F1B
//! as Megatron has them), and the executor that runs a schedule, moving activations and their
//! gradients between neighbouring stages (`exec`).

pub mod exec;
pub mod layout;
pub mod schedule;
pub mod stages;

pub use exec::{Dir, Exchange, PipelineComms, StageRunner, Step, plan_steps, run_schedule};
pub use layout::{LayoutStage, PipelineLayout};
pub use schedule::{Action, ScheduleKind, render, schedule};
pub use stages::{StagePlan, stage_layers, stage_layers_of, stage_layers_sized};
