//! Every kernel against a naive f64 reference, and every backward against finite differences of the
//! kernel's own f64 instantiation. Shapes come from proptest, including size-1 and odd dims.

mod util;

mod activation;
mod attention;
mod cross_device;
mod elementwise;
mod embedding;
mod fp8;
mod loss;
mod matmul;
mod moe;
mod norm;
mod optim;
mod qkv;
mod rope;
mod ssm;
