#!/usr/bin/env bash
# The closing H200 call of a session (after onnxruntime-gpu's pieces are in /tmp/bigwhl, DEVELOPERS.md):
# the fast backend's bf16 agreement and tau on the demo pair (torch vs fast), the sampling round on the
# H200 (GPU tests: one graph replay; xrun bench greedy vs sampled rounds), then ONNX Runtime on CUDA
# (scripts/h200_ort.sh). Each step has its own time limit; logs land in $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
install() { python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1; }
# an image whose setuptools predates SPDX license strings (< 77): install with the table form
install || { sed -i 's/^license = "Apache-2.0"/license = { text = "Apache-2.0" }/' pyproject.toml && install; } || exit 1
step() { echo "== [$(date +%T)] $*"; }
step "demo pair, bf16: fast vs torch backend"
xcompile export --model demo --eagle3 --out /tmp/demo-bf16 --dtype bf16 --max-seq-len 1024 --force -q >/dev/null 2>&1
timeout 120 python3 benchmarks/fast_agreement.py /tmp/demo-bf16 --num-prompts 8 2>&1 | tee "$OUT/agreement.log"
step "sampling on the GPU: tests, then greedy vs sampled rounds (demo, fast backend)"
timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/runtime/test_sampling_gpu.py 2>&1 | tail -3
for T in 0 0.6 1.0; do
  timeout 60 xrun bench /tmp/demo-bf16 --backend fast --device cuda --contexts 128 --gammas 4 --tree 10,6,32 \
      --new-tokens 64 --num-prompts 4 --prompts data/corpus.heldout.txt --repeats 5 --temperature $T --seed 1 -q 2>&1 | grep -E "^ *128|sampl|accept" | head -12
done
step "ONNX Runtime on CUDA"
SKIP_8B=${SKIP_8B:-1} timeout 200 bash scripts/h200_ort.sh 2>&1 | tail -25
