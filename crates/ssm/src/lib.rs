//! ferrotron-ssm: Mamba-2 mixer layers for hybrid models (Megatron-Core's MambaMixer in a
//! MambaStack whose layers follow `--hybrid-layer-pattern`).
//!
//! Why a crate of its own: the mixer plugs into the transformer crate's layers through the spec's
//! factory hook (`spec::Hybrid::mixer` with a [`MambaSpec`]), as the MoE layer plugs into the MLP
//! slot, so the transformer crate knows nothing of state spaces and a model without them pays
//! nothing.
//!
//! What runs (`mixer.rs`): in_proj → causal depthwise convolution with SiLU → Mamba-2's selective
//! scan (scalar decay per head, B and C shared by a group of heads, D's skip) → RMSNorm of the
//! output gated by SiLU(z) → out_proj. The numeric ops are ferrotron-kernels' `conv1d_silu`,
//! `ssd_scan` and `gated_rmsnorm` (CPU reference and CUDA).
//!
//! Tensor parallelism splits the mixer by groups of heads; context parallelism trades rows for
//! heads around the convolution and scan (mixer.rs's header, context.rs). Not yet: inference
//! caches; the spec and the trainer refuse what is not built, naming it.

mod context;
pub mod mixer;
pub mod spec;

pub use mixer::MambaMixer;
pub use spec::{MambaDims, MambaSpec};
