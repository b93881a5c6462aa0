//! ferrotron-examples: runnable programs showing single crates in use (`cargo run -p
//! ferrotron-examples --example NAME`). The library itself is empty on purpose: the examples are
//! the content, and this crate sits at the top of the layering so they may use anything.
