#!/usr/bin/env bash
# Every CI check, in order: the README's test command, then the CUDA build (compiles without CUDA thanks to dynamic
# loading), the CUDA kernels through nvcc and through NVRTC, clippy with warnings as errors, and formatting.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never
# One build per step, nothing to reuse: incremental caches only cost disk (2 GiB once, on a machine that ran out).
export CARGO_INCREMENTAL=0
command -v cargo >/dev/null || { echo "cargo not found: install the Rust toolchain (rustup)"; exit 1; }
rustup component add clippy rustfmt >/dev/null 2>&1 || true

start=$(date +%s)
step() { echo "== $* ($(( $(date +%s) - start ))s; $(df -h --output=avail . | tail -1 | tr -d ' ') free here)"; }

step "cargo test --workspace"
cargo test --workspace

step "cargo build --workspace --features cuda"
cargo build --workspace --features cuda

step "kernels/ compiled by nvcc for sm_90a (wgmma) and sm_80 (nvcc from PyPI; no GPU needed)"
# The GPU tests need the device machine; this at least proves every kernel compiles (registers and
# spills printed). nvcc comes as a Python wheel into target/ci-venv; if PyPI cannot be reached
# the step says so and is skipped (a network problem, not a code one).
venv=target/ci-venv
if { [ -x "$venv/bin/pip" ] || python3 -m venv "$venv"; } && "$venv/bin/pip" install -q "nvidia-cuda-nvcc>=13,<14"; then
  nv=$("$venv/bin/python" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13", "bin"))')
  PATH="$nv:$PATH" cargo run -q -p xtask -- ptx sm_90a
  PATH="$nv:$PATH" cargo run -q -p xtask -- ptx sm_80 > /dev/null  # the non-Hopper side of wgmma.cuh
else
  echo "nvidia-cuda-nvcc could not be installed here: kernels/ compile check skipped"
fi

step "the CUDA backend's host-side unit tests (no GPU needed)"
cargo test -q -p ferrotron-kernels --features cuda --lib -- cuda::choices cuda::tests::own_matmul cuda::tests::empty_tensor_lists

step "kernels/ compiled by NVRTC 13.0, the GPU machine's version (from PyPI; no GPU needed)"
# NVRTC is what the backend runs, and it refuses some code nvcc takes (generic lambdas).
if [ -x "$venv/bin/pip" ] && "$venv/bin/pip" install -q "nvidia-cuda-nvrtc==13.0.*"; then
  lib=$("$venv/bin/python" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13", "lib"))')
  LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    cargo test -q -p ferrotron-kernels --features cuda --lib kernels_compile_under_nvrtc
else
  echo "nvidia-cuda-nvrtc could not be installed here: NVRTC compile check skipped"
fi

step "cargo clippy (cuda on, all targets)"
cargo clippy --workspace --all-targets --features cuda -- -D warnings

step "cargo fmt --check"
cargo fmt --all --check

step "done"
