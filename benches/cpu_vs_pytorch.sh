#!/usr/bin/env bash
# CPU step time of Ferrotron vs PyTorch eager on the same GPT shapes (not part of CI).
# Installs CPU-capable torch from PyPI into target/bench-venv on first use (a large download).
# Usage: benches/cpu_vs_pytorch.sh            (tiny and small presets)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${BENCH_VENV:-target/bench-venv}  # an existing venv with torch can be reused
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q torch numpy
fi
cargo build --release -q --bin ferrotron
threads=$(nproc)
run() { # name, ferrotron flags..., -- torch flags...
  local name=$1; shift
  local fflags=() tflags=()
  while [ "$1" != "--" ]; do fflags+=("$1"); shift; done; shift
  tflags=("$@")
  local dir; dir=$(mktemp -d)
  ./target/release/ferrotron train "${fflags[@]}" --no-progress --eval-iters 1 --eval-interval 100000 \
      --metrics-file "$dir/metrics.jsonl" 2>/dev/null
  # Steady state, as PyTorch's figure: every iteration but the first (harmonic mean of the
  # per-iteration tokens/s = total tokens over total time).
  local ours; ours=$(grep '"kind":"train"' "$dir/metrics.jsonl" | tail -n +2 | python3 -c 'import json,sys; v=[json.loads(l)["tokens_per_s"] for l in sys.stdin]; print(len(v)/sum(1/x for x in v))')
  local theirs; theirs=$("$venv/bin/python" benches/torch_cpu_gpt.py "${tflags[@]}" --threads "$threads" | python3 -c 'import json,sys; print(json.load(sys.stdin)["tokens_per_s"])')
  rm -rf "$dir"
  python3 - "$name" "$ours" "$theirs" <<'PY'
import sys
name, ours, theirs = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
print(f"{name:8s} ferrotron {ours:10.0f} tok/s   pytorch-eager {theirs:10.0f} tok/s   ratio {ours/theirs:5.2f}")
PY
}
echo "$(date -u +%F) $(git rev-parse --short HEAD) $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
run tiny --preset tiny --train-iters 13 --log-interval 1 -- --layers 4 --hidden 128 --heads 4 --seq 128 --vocab 256 --micro 16 --global-batch 32 --iters 12
run small --preset small --train-iters 4 --log-interval 1 --micro-batch-size 8 --global-batch-size 8 --corpus-docs 3000 -- \
    --layers 6 --hidden 384 --heads 6 --seq 256 --vocab 50304 --micro 8 --global-batch 8 --iters 3
