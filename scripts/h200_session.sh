#!/usr/bin/env bash
# The fast-backend H200 calls of a session, in parts of under ten minutes each (logs in $OUT):
#   PART=0  tuning: benchmarks/kernels.py --gemv (one-row GEMV tiles, streaming included; then the tile
#           kernel's tiles at the verify row counts) -> $OUT/gemv.json, then benchmarks/fast_decode.py with
#           those tiles against the built-in ones and with attention chunks CHUNKS (64,128,256)
#   PART=1  the gpu-marked tests (kernels, fast engines, round graphs,
#           sampling), then benchmarks/fast_decode.py at contexts 128 and 4096 (4352-slot cache): decode
#           and verify steps, also without PDL and without the one-row GEMV (tile kernel), in the same run,
#           the EAGLE3 step, prefill TTFT against the matmul rate
#   PART=2  `xrun bench --synthetic qwen3-8b` greedy and sampled (Qwen3's recommended temperature 0.6 /
#           top-k 20 / top-p 0.95): chain gamma 6 and tree 10/6/32 rounds; then the demo pair in bf16: tau
#           of chains and tree on held-out text at temperature 0 / 0.6 / 1.0, and
#           benchmarks/fast_agreement.py (fast vs reference, speculative vs plain greedy; AGREE_PROMPTS=16;
#           SKIP_DEMO_TAU=1 leaves the tau runs out)
#   PART=3  a quick re-check after a kernel change: `xrun bench --synthetic qwen3-8b` greedy, the gpu tests of
#           kernels, fast engines and round graphs, benchmarks/fast_decode.py at contexts 128,4096
#   PART=4  the kernel schedule (kernels.SCHEDULE: evict-first weights, early PDL trigger, norm_late): its
#           tests, benchmarks/kernels.py --gemv on CALLS (8b qkv, gate/up) under SCHED (norm_late on), then
#           benchmarks/fast_decode.py --variants "$VARIANTS" (tiles=1: the sweep's tiles) at contexts 128,4096
#   PART=5  the norm_late test on the GPU, then benchmarks/fast_agreement.py on the demo with every one-row
#           projection on a GEMV (--gemv-all GEMV_ALL: the 8B shapes' numerics on trained weights) under
#           SCHED (--schedule, e.g. norm_late=0); SKIP_TEST=1 leaves the test out; CUDA_ALL (cols,warps,stages):
#           every one of them on gemv.cu's kernel instead (--cuda-all)
#   PART=6  the RMSNorm pre-pass span (kernels.SCHEDULE rstd_span): the schedule tests on the GPU, the verify
#           tiles of CALLS (8b qkv, gate/up) swept under rstd_span=SPAN (2048) -> $OUT/span.json, then
#           benchmarks/fast_decode.py --variants "$VARIANTS" (spans 512..4096; tiles=1: span.json's) at 128,4096
#   PART=7  the verify and one-row tiles of every decode shape (lm_heads included) swept as the engines call
#           them (benchmarks/kernels.py --gemv) -> $OUT/gemv.json, then benchmarks/fast_decode.py --variants
#           "$VARIANTS" (tiles=1: gemv.json's) at 128,4096
#   PART=8  norm_apart and hand-picked tiles (TILES, a kernels.json-style file): its gpu tests (or those
#           -k TESTS picks), then benchmarks/fast_decode.py --tiles TILES --variants "$VARIANTS" at 128,4096
#   PART=9  the final check: PART=3 (bench, gpu tests, fast_decode), then benchmarks/fast_agreement.py on the
#           demo pair in bf16 (fast vs reference, speculative vs plain greedy; AGREE_PROMPTS=16)
#   PART=10 the greedy `xrun bench` alone (a round-only change)
#   PART=11 the gpu tests -k TESTS (the tree kernels and round graphs) picks, then the greedy `xrun bench`
#   PART=12 benchmarks/host_loop.py: plain and chain rounds through Generator, pipelined or not
#   PART=13 the gpu tests -k TESTS picks, benchmarks/host_loop.py (HOST_LOOP=0: not), then
#           benchmarks/fast_decode.py --variants "$VARIANTS" at FD_CONTEXTS (128,4096), within FD_LIMIT
#           seconds (200), its last FD_LINES (12) lines echoed
#   PART=14 benchmarks/fast_agreement.py on the demo pair in bf16 alone (PART=9's last step)
#   PART=15 (TESTS set: the gpu tests -k TESTS picks) benchmarks/step_timeline.py (each kernel's share of a
#           graphed step, contexts TIMELINE_CONTEXTS (128,4096), TIMELINE_TOKENS (1,32) tokens) under
#           TIMELINE_VARIANTS, then (VARIANTS set) benchmarks/fast_decode.py --variants "$VARIANTS" at contexts
#           FD_CONTEXTS (128,4096), its last FD_LINES (14) lines echoed
#   PART=16 the CUDA C++ GEMV: the gpu tests of tests/runtime/test_cuda_gemv.py (and -k TESTS of the other
#           kernel tests, if set), benchmarks/fast_decode.py at FD_CONTEXTS (the CUDA GEMV on and off), then
#           (VARIANTS set) benchmarks/fast_decode.py --variants "$VARIANTS" at VAR_CONTEXTS (128), its last
#           FD_LINES (14) lines echoed
# DRAFT_MODEL (e.g. qwen3-0.6b): the greedy bench is followed by one with that synthetic draft model (its step
# and chain round; logged in bench_draft.log). CONTEXTS (default 128) sets the greedy bench's --contexts (128,4096: a 4352-slot cache for both), BENCH_LIMIT
# its time limit in seconds (240).
# ONNX Runtime on CUDA is scripts/h200_ort.sh. Usage (device tool): PART=1 bash scripts/h200_session.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PART=${PART:-1}
install() { python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1; }
# an image whose setuptools predates SPDX license strings (< 77): install with the table form
install || { sed -i 's/^license = "Apache-2.0"/license = { text = "Apache-2.0" }/' pyproject.toml && install; } || exit 1
step() { echo "== [$(date +%T)] $*" | tee -a "$OUT/summary.log"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$OUT/summary.log"

BENCH=(--synthetic qwen3-8b --backend fast --device cuda --contexts "${CONTEXTS:-128}" --gammas 6 --tree 10,6,32 --num-prompts 1)
SHOW="^ +(128|4096) +yes|^target|^eagle3|^sampl|^accept|floor"     # the bench lines echoed back
bench_greedy() {
  step "xrun bench ${BENCH[*]} (greedy)"
  timeout "${BENCH_LIMIT:-240}" xrun bench "${BENCH[@]}" > "$OUT/bench_greedy.log" 2>&1
  echo "   exit $?" | tee -a "$OUT/summary.log"
  [ -z "${DRAFT_MODEL:-}" ] && return
  step "xrun bench --synthetic qwen3-8b --draft-model $DRAFT_MODEL --contexts 128 --gammas 6 (greedy)"
  timeout 240 xrun bench --synthetic qwen3-8b --draft-model "$DRAFT_MODEL" --backend fast --device cuda \
    --contexts 128 --gammas 6 --num-prompts 1 > "$OUT/bench_draft.log" 2>&1
  echo "   exit $?" | tee -a "$OUT/summary.log"
}
bench_8b() {
  bench_greedy
  step "xrun bench ${BENCH[*]} --temperature 0.6 --top-k 20 --top-p 0.95 --seed 0"
  timeout 240 xrun bench "${BENCH[@]}" --temperature 0.6 --top-k 20 --top-p 0.95 --seed 0 \
    > "$OUT/bench_sampled.log" 2>&1
  echo "   exit $?" | tee -a "$OUT/summary.log"
  grep -hE "$SHOW" "$OUT/bench_greedy.log" "$OUT/bench_sampled.log"
}
# gpu_tests SECONDS TEST_FILE...: the gpu-marked tests of those files -> $OUT/gpu_tests.log
gpu_tests() {
  local limit=$1; shift
  timeout "$limit" python3 -m pytest -q -m gpu -p no:cacheprovider -rs "$@" > "$OUT/gpu_tests.log" 2>&1
  echo "   exit $?: $(tail -1 "$OUT/gpu_tests.log")" | tee -a "$OUT/summary.log"
  grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -20
}
# fast_decode SECONDS LINES [ARG...]: benchmarks/fast_decode.py --contexts FD_CONTEXTS (128,4096) ARG... -> $OUT/fast_decode.log
# (every part's fast_decode call takes FD_CONTEXTS, and FD_MAX_SEQ_LEN (4352) for its caches, as PART=15's
# timeline does)
fast_decode() {
  local limit=$1 lines=$2; shift 2
  timeout "$limit" python3 benchmarks/fast_decode.py --contexts "${FD_CONTEXTS:-128,4096}" \
    --max-seq-len "${FD_MAX_SEQ_LEN:-4352}" "$@" > "$OUT/fast_decode.log" 2>&1
  echo "   exit $?" | tee -a "$OUT/summary.log"
  grep -vE "^tiles(:|=1 variants take)|^one-row" "$OUT/fast_decode.log" | tail -"$lines"
}
# sweep_variants SCHED NAME LINES VARIANTS: benchmarks/kernels.py --gemv on CALLS (8b qkv, gate/up) under
# --schedule SCHED -> $OUT/NAME.json, then benchmarks/fast_decode.py --variants VARIANTS (tiles=1: its tiles)
sweep_variants() {
  local sched=$1 name=$2 lines=$3 v=$4
  step "benchmarks/kernels.py --gemv --calls ${CALLS:-8b qkv,8b gate/up} --schedule $sched"
  timeout 240 python3 benchmarks/kernels.py --gemv --calls "${CALLS:-8b qkv,8b gate/up}" --schedule "$sched" \
    --json "$OUT/$name.json" > "$OUT/${name}_sweep.log" 2>&1
  echo "   exit $?" | tee -a "$OUT/summary.log"
  grep -vE "^device" "$OUT/${name}_sweep.log" | tail -40
  step "benchmarks/fast_decode.py --tiles $name.json --variants $v"
  fast_decode 300 "$lines" --tiles "$OUT/$name.json" --variants "$v" --json "$OUT/variants.json"
}
KERNEL_TESTS=(tests/runtime/test_kernels.py tests/runtime/test_cuda_gemv.py tests/runtime/test_fast.py
              tests/runtime/test_graphs.py)

if [ "$PART" = 0 ]; then
  step "benchmarks/kernels.py --gemv (one-row GEMV and verify tiles)"
  timeout 330 python3 benchmarks/kernels.py --gemv --json "$OUT/gemv.json" > "$OUT/gemv_sweep.log" 2>&1
  echo "   exit $?" | tee -a "$OUT/summary.log"
  cat "$OUT/gemv_sweep.log"
  TILES=(); [ -f "$OUT/gemv.json" ] && TILES=(--tiles "$OUT/gemv.json")
  step "benchmarks/fast_decode.py --contexts 128,4096 --tiles gemv.json --chunks ${CHUNKS:-64,128,256}"
  fast_decode 240 24 "${TILES[@]}" --chunks "${CHUNKS:-64,128,256}" --json "$OUT/fast_decode.json"
fi

if [ "$PART" = 1 ]; then
  step "gpu tests"
  gpu_tests 300 "${KERNEL_TESTS[@]}" tests/runtime/test_sampling_gpu.py
  step "benchmarks/fast_decode.py --contexts 128,4096 (decode steps, PDL / GEMV off, prefill TTFT)"
  fast_decode 240 20
fi

if [ "$PART" = 2 ]; then
  bench_8b
  xcompile export --model demo --eagle3 --out /tmp/demo-bf16 --dtype bf16 --max-seq-len 1024 --force -q >/dev/null 2>&1
  [ "${SKIP_DEMO_TAU:-0}" = 1 ] || step "demo pair bf16: tau at temperature 0 / 0.6 / 1.0 (fast backend, held-out text)"
  [ "${SKIP_DEMO_TAU:-0}" = 1 ] || for T in 0 0.6 1.0; do
    timeout 70 xrun bench /tmp/demo-bf16 --backend fast --device cuda --contexts 128 --gammas 4,6 --tree 10,6,32 \
      --new-tokens 128 --num-prompts 8 --prompts data/corpus.heldout.txt --repeats 5 --temperature $T --seed 1 \
      > "$OUT/demo_T$T.log" 2>&1
    echo "   T=$T exit $?" | tee -a "$OUT/summary.log"
    grep -E "^ +128 +yes" "$OUT/demo_T$T.log"
  done
  step "benchmarks/fast_agreement.py on the demo (${AGREE_PROMPTS:-16} prompts)"
  timeout 150 python3 benchmarks/fast_agreement.py /tmp/demo-bf16 --num-prompts "${AGREE_PROMPTS:-16}" --max-gap 0.0625 \
    > "$OUT/agreement.log" 2>&1
  echo "   exit $?" | tee -a "$OUT/summary.log"
  tail -12 "$OUT/agreement.log"
fi
if [ "$PART" = 3 ] || [ "$PART" = 9 ]; then
  bench_greedy
  grep -hE "$SHOW" "$OUT/bench_greedy.log"
  step "gpu tests (kernels, fast engines, round graphs)"
  gpu_tests 300 "${KERNEL_TESTS[@]}"
  step "benchmarks/fast_decode.py --contexts 128,4096"
  fast_decode 100 16
fi
if [ "$PART" = 4 ]; then
  step "tests of the schedule and norm_late (gpu-marked, and the small-shape norm_late test on the GPU)"
  gpu_tests 150 tests/runtime/test_kernels.py tests/runtime/test_fast.py -k schedule
  timeout 100 python3 -m pytest -q -p no:cacheprovider tests/runtime/test_kernels.py -k norm_late 2>&1 | tail -1 \
    | tee -a "$OUT/summary.log"
  sweep_variants "${SCHED:-norm_late=1,norm_late_tile=1}" gemv_late 30 \
    "${VARIANTS:-"tiles=1,norm_late=1;tiles=1,norm_late=1,norm_late_tile=1;norm_late_tile=1;norm_late=1"}"
fi
if [ "$PART" = 5 ]; then
  [ "${SKIP_TEST:-0}" = 1 ] || step "the small-shape norm_late test on the GPU"
  [ "${SKIP_TEST:-0}" = 1 ] || timeout 100 python3 -m pytest -q -p no:cacheprovider tests/runtime/test_kernels.py \
    -k norm_late 2>&1 | tail -1 | tee -a "$OUT/summary.log"
  xcompile export --model demo --eagle3 --out /tmp/demo-bf16 --dtype bf16 --max-seq-len 1024 --force -q >/dev/null 2>&1
  step "benchmarks/fast_agreement.py on the demo, every one-row projection on GEMV ${GEMV_ALL:-4,64,4} (norm_late)"
  timeout 240 python3 benchmarks/fast_agreement.py /tmp/demo-bf16 --num-prompts "${AGREE_PROMPTS:-16}" --max-gap 0.0625 \
    --gemv-all "${GEMV_ALL:-4,64,4}" ${CUDA_ALL:+--cuda-all "$CUDA_ALL"} --schedule "${SCHED:-}" \
    > "$OUT/agreement_gemv.log" 2>&1
  echo "   exit $?" | tee -a "$OUT/summary.log"
  tail -14 "$OUT/agreement_gemv.log"
fi
if [ "$PART" = 6 ]; then
  step "schedule and norm_late tests on the GPU (rstd_span among the switches)"
  gpu_tests 200 tests/runtime/test_kernels.py tests/runtime/test_fast.py -k "schedule or norm_late or rstd"
  SPAN=${SPAN:-2048}
  sweep_variants "rstd_span=$SPAN" span 16 \
    "${VARIANTS:-"rstd_span=512;rstd_span=1024;rstd_span=2048;rstd_span=4096;tiles=1,rstd_span=$SPAN"}"
fi
if [ "$PART" = 7 ]; then
  step "benchmarks/kernels.py --gemv (verify tiles at 1 / 7 / 32 rows, then one-row GEMVs, every decode shape)"
  timeout 330 python3 benchmarks/kernels.py --gemv --json "$OUT/gemv.json" > "$OUT/gemv_sweep.log" 2>&1
  echo "   exit $?" | tee -a "$OUT/summary.log"
  grep -vE "^device" "$OUT/gemv_sweep.log" | tail -80
  step "benchmarks/fast_decode.py --tiles gemv.json --variants ${VARIANTS:-tiles=1}"
  fast_decode 200 8 --tiles "$OUT/gemv.json" --variants "${VARIANTS:-tiles=1}" --json "$OUT/variants.json"
fi
if [ "$PART" = 8 ]; then
  step "gpu tests: ${TESTS:-norm_apart or schedule}"
  gpu_tests 200 tests/runtime/test_kernels.py tests/runtime/test_fast.py -k "${TESTS:-norm_apart or schedule}"
  V=${VARIANTS:-"tiles=1;norm_apart=1;tiles=1,norm_apart=1"}
  step "benchmarks/fast_decode.py --tiles ${TILES:-docs/runs/2026-12-01-h200-s6-tiles.json} --variants $V"
  fast_decode 200 12 --tiles "${TILES:-docs/runs/2026-12-01-h200-s6-tiles.json}" --variants "$V" \
    --json "$OUT/variants.json"
fi
if [ "$PART" = 9 ] || [ "$PART" = 14 ]; then
  xcompile export --model demo --eagle3 --out /tmp/demo-bf16 --dtype bf16 --max-seq-len 1024 --force -q >/dev/null 2>&1
  step "benchmarks/fast_agreement.py on the demo (${AGREE_PROMPTS:-16} prompts)"
  timeout 150 python3 benchmarks/fast_agreement.py /tmp/demo-bf16 --num-prompts "${AGREE_PROMPTS:-16}" --max-gap 0.0625 \
    > "$OUT/agreement.log" 2>&1
  echo "   exit $?" | tee -a "$OUT/summary.log"
  tail -12 "$OUT/agreement.log"
fi
if [ "$PART" = 10 ]; then
  bench_greedy
  grep -hE "$SHOW" "$OUT/bench_greedy.log"
fi
if [ "$PART" = 13 ]; then
  step "gpu tests: ${TESTS:-chain_accept or schedule or round_graphs}"
  gpu_tests 200 tests/runtime/test_kernels.py tests/runtime/test_fast.py tests/runtime/test_graphs.py \
    -k "${TESTS:-chain_accept or schedule or round_graphs}"
fi
if [ "$PART" = 12 ] || { [ "$PART" = 13 ] && [ "${HOST_LOOP:-1}" = 1 ]; }; then
  step "benchmarks/host_loop.py (Generator rounds with and without pipelining)"
  (cd benchmarks && timeout 200 python3 host_loop.py > "$OUT/host_loop.log" 2>&1)
  echo "   exit $?" | tee -a "$OUT/summary.log"
  tail -9 "$OUT/host_loop.log"
fi
if [ "$PART" = 13 ]; then
  step "benchmarks/fast_decode.py --contexts ${FD_CONTEXTS:-128,4096} --variants ${VARIANTS:-attn_preload=1}"
  fast_decode "${FD_LIMIT:-200}" "${FD_LINES:-12}" --variants "${VARIANTS:-attn_preload=1}" --json "$OUT/variants.json"
fi
if [ "$PART" = 11 ]; then
  step "gpu tests: ${TESTS:-tree or round_graphs}"
  gpu_tests 240 tests/runtime/test_kernels.py tests/runtime/test_fast.py tests/runtime/test_graphs.py \
    -k "${TESTS:-tree or round_graphs}"
  bench_greedy
  grep -hE "$SHOW" "$OUT/bench_greedy.log"
fi
if [ "$PART" = 15 ]; then
  [ -n "${TESTS:-}" ] && step "gpu tests: $TESTS"
  [ -n "${TESTS:-}" ] && gpu_tests 200 "${KERNEL_TESTS[@]}" -k "$TESTS"
  step "benchmarks/step_timeline.py --variants ${TIMELINE_VARIANTS:-}"
  (cd benchmarks && timeout 240 python3 step_timeline.py --variants "${TIMELINE_VARIANTS:-}" \
     --contexts "${TIMELINE_CONTEXTS:-128,4096}" --tokens "${TIMELINE_TOKENS:-1,32}" \
     --max-seq-len "${FD_MAX_SEQ_LEN:-4352}" > "$OUT/timeline.log" 2>&1)
  echo "   exit $?" | tee -a "$OUT/summary.log"
  grep -E "^==|_split|_combine|gemv|^kernel" "$OUT/timeline.log"
  [ -n "${VARIANTS:-}" ] && step "benchmarks/fast_decode.py --contexts ${FD_CONTEXTS:-128,4096} --variants $VARIANTS"
  [ -n "${VARIANTS:-}" ] && fast_decode 300 "${FD_LINES:-14}" --variants "$VARIANTS" --json "$OUT/variants.json"
fi
if [ "$PART" = 16 ]; then
  step "gpu tests: tests/runtime/test_cuda_gemv.py"
  gpu_tests 150 tests/runtime/test_cuda_gemv.py
  cp "$OUT/gpu_tests.log" "$OUT/gpu_tests_cuda.log"
  [ -n "${TESTS:-}" ] && step "gpu tests: $TESTS"
  [ -n "${TESTS:-}" ] && gpu_tests 150 "${KERNEL_TESTS[@]}" -k "$TESTS"
  step "benchmarks/fast_decode.py --contexts ${FD_CONTEXTS:-128,4096}"
  fast_decode 150 20
  cp "$OUT/fast_decode.log" "$OUT/fast_decode_default.log"
  [ -n "${VARIANTS:-}" ] && step "benchmarks/fast_decode.py --contexts ${VAR_CONTEXTS:-128} --variants $VARIANTS"
  [ -n "${VARIANTS:-}" ] && FD_CONTEXTS=${VAR_CONTEXTS:-128} fast_decode 240 "${FD_LINES:-14}" --variants "$VARIANTS" \
    --json "$OUT/variants.json"
fi
step "done"
