#!/usr/bin/env bash
# Every CI check, in order: the README's test command, then the CUDA build (compiles without CUDA thanks to dynamic
# loading), clippy with warnings as errors, and formatting.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never
command -v cargo >/dev/null || { echo "cargo not found: install the Rust toolchain (rustup)"; exit 1; }
rustup component add clippy rustfmt >/dev/null 2>&1 || true

start=$(date +%s)
step() { echo "== $* ($(( $(date +%s) - start ))s)"; }

step "cargo test --workspace"
cargo test --workspace

step "cargo build --workspace --features cuda"
cargo build --workspace --features cuda

step "cargo clippy (cuda on, all targets)"
cargo clippy --workspace --all-targets --features cuda -- -D warnings

step "cargo fmt --check"
cargo fmt --all --check

step "done"
