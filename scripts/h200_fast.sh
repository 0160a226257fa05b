#!/usr/bin/env bash
# The fast path on the H200, in two device calls (each well inside the 10-minute limit):
#   bash scripts/h200_fast.sh check   GPU tests of the kernels, fast engines and round graphs; kernel sweep
#   bash scripts/h200_fast.sh decode  one 8B-shaped decode step, fast vs reference, PDL on/off; kernel table
#   bash scripts/h200_fast.sh bench    xrun bench of the Qwen3-8B shape (+ 0.6B draft) on the fast backend
# Logs and JSON land in $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || exit 1
case "${1:-check}" in
check)
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/runtime/test_kernels.py tests/runtime/test_fast.py \
      tests/runtime/test_graphs.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
  timeout 330 python3 benchmarks/kernels.py ${SWEEP---sweep} --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log"
  [ "${DECODE:-1}" = 1 ] && timeout 200 python3 benchmarks/fast_decode.py --tiles "$OUT/kernels.json" \
      --json "$OUT/fast_decode.json" 2>&1 | tee "$OUT/fast_decode.log"
  ;;
decode)
  timeout 400 python3 benchmarks/fast_decode.py --json "$OUT/fast_decode.json" 2>&1 | tee "$OUT/fast_decode.log"
  SWEEP= timeout 150 python3 benchmarks/kernels.py --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log"
  ;;
bench)
  shift
  timeout 560 xrun bench --synthetic qwen3-8b --draft-model qwen3-0.6b --backend fast --device cuda \
      --json "$OUT/bench_fast.json" "$@" 2>&1 | tee "$OUT/bench_fast.log"
  ;;
esac
