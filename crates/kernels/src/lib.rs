//! ferrotron-kernels: every numeric op Ferrotron runs, one signature per op.
//!
//! Each op takes tensors, validates dtype/shape/device (bad input is a typed error naming the op and
//! the shapes, never a panic), dispatches on the device and returns new tensors. The CPU versions in
//! `cpu` are the reference: f32 math on any storage dtype, generic over f32/f64 so that the tests can
//! check every backward against finite differences in f64. CUDA launchers join them with the same
//! signatures.
//!
//! Families: `matmul`, `norm`, `activation` (incl. softmax), `attention`, `rope`, `embedding`, `loss`,
//! `optim`, `elementwise`, `qkv`, `moe` (routing), `ssm` (Mamba-2's mixer), `fp8` (tensorwise-scaled
//! FP8 quantization and products). Accumulation rule: activation gradients are returned (`=`); parameter
//! gradients are either returned as f32 for the caller to add, or added in place (`matmul_into` with
//! `accumulate`, `embedding_bwd`, the `_into` bias and norm backwards) into main_grad buffers (fp32,
//! or bf16 with the sums formed in fp32 and rounded once).
//!
//! Architecture Invariant: this crate knows nothing of ranks, process groups or models.

mod activation;
mod attention;
mod buf;
mod check;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
mod dropout;
mod elementwise;
mod embedding;
mod fp8;
mod lab_env;
mod loss;
mod matmul;
mod moe;
mod norm;
mod optim;
mod qkv;
pub mod real;
mod rope;
mod ssm;

pub use activation::{
    gelu, gelu_bwd, gelu_exact, gelu_exact_bwd, quick_geglu, quick_geglu_bwd, quick_gelu, quick_gelu_bwd, relu2,
    relu2_bwd, sigmoid_gate, sigmoid_gate_bwd, silu, silu_bwd, softmax, softmax_bwd, swiglu, swiglu_bwd,
};
pub use attention::{
    AttnCfg, AttnDropout, QkvHeads, attention_bwd, attention_bwd_qkv, attention_bwd_qkv_into, attention_fwd,
    attention_fwd_qkv, attention_merge_, attention_padded_width, attention_sink_, attention_sink_bwd,
    document_starts_error,
};
pub use check::set_device_ids_prechecked;
pub use dropout::{DropSplit, DropoutKey, dropout, normal, set_draw_shift};
pub use elementwise::{add, add_, bias_add, bias_grad, bias_grad_into, cast, copy_, scale, scale_};
pub use embedding::{embedding_bwd, embedding_bwd_shard, embedding_fwd, embedding_fwd_shard, position_embedding_bwd};
pub use ferrotron_core::Fp8Format;
pub use fp8::{
    Fp8, Fp8Act, Fp8Copies, Fp8Scaling, fp8_linear_bwd, fp8_linear_bwd_dgelu, fp8_linear_fwd, fp8_linear_fwd_after,
    fp8_matmul, fp8_matmul_into, fp8_scale_update, quantize_fp8, quantize_fp8_scaled,
};
pub use lab_env::check_lab_switches;
pub use loss::{
    CrossEntropyCfg, RowScale, ce_combine_shards, cross_entropy_bwd, cross_entropy_fwd, cross_entropy_fwd_bwd_,
};
pub use matmul::{linear_gelu, matmul, matmul_bias, matmul_bwd, matmul_dgelu, matmul_into};
pub use moe::{
    Capacity, DROPPED, DropPolicy, ExpertSort, Groups, RouterLoss, Score, TopK, moe_drop, moe_route, moe_route_bwd,
    moe_router_loss, moe_sort, moe_sort_capped, moe_unpermute, moe_unpermute_bwd,
};
pub use norm::{
    Gamma, add_layernorm_fwd, add_rmsnorm_fwd, layernorm_bwd, layernorm_bwd_add, layernorm_bwd_into,
    layernorm_bwd_into_bias, layernorm_fwd, rmsnorm_bwd, rmsnorm_bwd_add, rmsnorm_bwd_into, rmsnorm_bwd_into_bias,
    rmsnorm_fwd,
};
pub use optim::{
    AdamPrep, AdamRun, AdamRuns, AdamW, Sgd, adam_prepare, adam_state, adamw_runs, adamw_step, count_zeros_dev,
    global_l2_norm, sgd_runs, sum_sq, sum_sq_all, sum_sq_dev,
};
pub use qkv::{qkv_merge, qkv_split};
pub use rope::{RopeCfg, RopeScaling, RopeSplit, Yarn, rope_bwd, rope_fwd, rope_qkv_bwd_, rope_qkv_fwd_};
pub use ssm::{
    SCAN_CHUNK, ScanDims, ScanGrads, ScanParams, conv1d_silu, conv1d_silu_bwd, gated_rmsnorm, gated_rmsnorm_bwd,
    ssd_scan, ssd_scan_bwd,
};
