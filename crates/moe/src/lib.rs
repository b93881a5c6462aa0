//! ferrotron-moe: mixture-of-experts layers (Megatron-Core's MoELayer with its top-k router and
//! SequentialMLP experts), in place of a transformer layer's dense MLP.
//!
//! Why a crate of its own: the MoE layer is built from the transformer crate's pieces (the plain
//! linear as the router's gate, the dense `Mlp` as each expert) and plugs back into a layer through
//! the spec's factory hook (`MlpSpec::Custom` with a [`MoeSpec`]), so the transformer crate knows
//! nothing of experts and a model without them pays nothing.
//!
//! What runs (`layer.rs`): router logits → top-k experts and weights → token copies sorted by
//! expert → each expert's MLP on its rows → copies combined, weighted, per token. The router's
//! load-balancing and z-losses add their gradients in the backward at the micro-batch's loss scale
//! (`Cx::grad_scale`), as Megatron's MoEAuxLossAutoScaler does; their values are kept in
//! [`MoeMetrics`] for the log.
//!
//! Expert parallelism (`dispatch.rs`): with an expert-parallel group each rank holds its share of
//! the experts (parameters marked `ParamMeta::expert`, reduced over the expert-data-parallel
//! group by the optimizer crate's `GradSync::with_experts`) and tokens travel by all-to-all.
//! Shared experts: a dense MLP beside the routed ones.
//!
//! Tensor parallelism (`layer.rs`'s header): every expert split over the tensor-parallel group,
//! its partial sums reduced once per layer; or, with an expert tensor-parallel size of 1, every
//! expert whole and each tensor-parallel rank routing its own slice of the sequence.
//!
//! Routing (`ferrotron_kernels::TopK`): softmax after or before the top-k, or a per-expert score
//! (sigmoid, √softplus) renormalised over the chosen experts; group-limited routing; and
//! DeepSeek-V3's aux-loss-free balancing by a per-expert bias the trainer moves after each step
//! (`bias.rs`, [`ExpertBiases`]).
//!
//! Token dropping (`RouterSpec::capacity`): each expert takes at most its capacity of the rank's
//! token copies, the rest skip it, as Megatron's capacity factor does.
//!
//! Shared experts' gate (`gate.rs`): their output scaled per token by a sigmoid, Qwen-MoE's.
//!
//! Load-balancing losses: the micro-batch's (`aux_loss`), each sequence's (`seq_aux_loss`), and
//! the global batch's (`global_aux_loss`: counts summed over the data-parallel ranks and
//! averaged over the step's micro-batches, `global.rs`).
//!
//! Not yet: expert tensor-parallel sizes other than 1 and the tensor-parallel size, padding
//! experts' inputs to their capacity, sinkhorn routing; the spec and the trainer refuse what is
//! not built, naming it.

pub mod bias;
pub mod dispatch;
pub mod gate;
pub mod global;
pub mod layer;
pub mod metrics;
pub mod spec;

pub use bias::{ExpertBias, ExpertBiases};
pub use ferrotron_kernels::{Capacity, DropPolicy, Groups, Score};
pub use global::GlobalCounts;
pub use layer::MoeLayer;
pub use metrics::{MoeMetrics, RouterLossValues};
pub use spec::{ExpertGroup, LoadBalancing, MoeSpec, RouterSpec};
