//! CPU reference implementations on slices, generic over f32/f64 where a finite-difference check
//! needs f64. The tensor-level functions in the crate root validate inputs and call these.

pub mod activation;
pub mod attention;
pub mod attn_merge;
pub mod attn_sink;
pub mod embedding;
pub mod loss;
pub mod matmul;
pub mod moe;
pub mod norm;
pub mod optim;
pub mod qkv;
pub mod rope;
pub mod softmax;
pub mod ssm;
pub mod vexp;
