#!/usr/bin/env bash
# One device call on the H200: install, GPU tests, then the benchmark. Results land in $OUT.
# Usage (device tool): bash scripts/h200.sh [bench args...]
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  xrun bench --synthetic qwen3-8b --device cuda --json "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.log"
fi
