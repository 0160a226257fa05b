#!/usr/bin/env bash
# One device call on the H200: install, decode-attention micro-benchmark, GPU tests, the demo pair's
# speculative speed on held-out text, then the synthetic Qwen3-8B benchmark. Results land in $OUT.
# Usage (device tool): bash scripts/h200.sh [extra args for the 8B bench...]
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
python3 benchmarks/attention_decode.py 2>&1 | tee "$OUT/attention.log"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  python3 -m pytest -q -m gpu -p no:cacheprovider tests/runtime/test_graphs.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -4
fi
if [ "${SKIP_DEMO:-0}" != 1 ]; then
  xcompile export --model demo --eagle3 --out /tmp/demo-bf16 --dtype bf16 --max-seq-len 1024 --force >/dev/null &&
  xrun bench /tmp/demo-bf16 --backend torch --device cuda --contexts 128 --gammas 1,2,4,6,8 --tree 10,6,32 \
    --new-tokens 64 --num-prompts 8 --prompts data/corpus.heldout.txt --json "$OUT/demo_bench.json" 2>&1 \
    | tee "$OUT/demo_bench.log" | grep -v "^#"
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  xrun bench --synthetic qwen3-8b --device cuda --json "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.log"
fi
