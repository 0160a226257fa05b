#!/usr/bin/env bash
# The fast backend checked on the H200, one part a device call (each a few minutes; logs in $OUT):
#   tests    the gpu-marked tests of tests/runtime/engines and tests/runtime/decoding (TESTS: other pytest arguments)
#   bench    xrun bench --synthetic qwen3-8b --backend fast (contexts 128,4096, chain gamma 6, tree 10/6/32), then
#            benchmarks/fast_decode.py (graphed steps with PDL / the CUDA GEMV off, prefill TTFT, agreement)
#   agree    benchmarks/fast_agreement.py on the demo pair in bf16 (fast vs reference, speculative vs plain greedy)
#   agree8b  the same on the Qwen3-8B shape's synthetic weights (8 prompts x 512 tokens; issue 38 item 3), by
#            default counted on the fast backend alone, row-invariant, for chains of 1-8 and the 32- and 64-node
#            trees (AGREE8B_ARGS: other options instead, "--drafters draft-model --draft-model qwen3-0.6b" say)
#   quant    the quantized kernels' tests (all, compiled), benchmarks/qlinear_tiles.py at one row, qgemv.cu's tiles
#            beside the Triton GEMV (TILES_ARGS: its options),
#            benchmarks/step_timeline.py --quantize $QUANTIZE (fp8) at 1 and 7 tokens
#   steptune benchmarks/step_tune.py: the one-row launches per projection tuned inside a graphed decode step
#            (STEPTUNE_ARGS: its options; default --quantize fp8,int4, qgemv.cu's launches; STEPTUNE_LIMIT: its
#            seconds, 420), the tables (written after each kind) in
#            $OUT/steptiles.json, then copied over this machine's runtime/engines/kernels/tiles.json (parts after
#            it in the call run them: qbench say), and benchmarks/step_timeline.py of that step with them
#   stalls   benchmarks/qgemv_stalls.py: qgemv.cu's FP8 and INT4 one-row calls at the 8B shapes, timed alone, then
#            under Nsight Compute (ncu): DRAM throughput, warps active, issue slots used, why warps waited
#   qbench   xrun bench --synthetic qwen3-8b --backend fast --quantize fp8, then int4 (QBENCH: those kinds instead;
#            context 128, chain gamma 6, tree 10/6/32)
#   sample   the sampler's and the sampled chain acceptance's tests (compiled; SAMPLE_TESTS: other pytest arguments),
#            benchmarks/sample_kernels.py (one row's draw, tie or not, against the torch sampler), then the bf16
#            bench greedy and sampled (T 0.6, top-k 20, top-p 0.95; context 128), in one call so their ratios come
#            from one machine
#   paradigms  xrun bench --synthetic qwen3-8b with an MTP module (32,000-row draft vocabulary) and a Qwen3-0.6B-shape
#            draft model beside the EAGLE3 head: chains at gamma 2, 4, 6 and trees 10/6/32 (context 128)
#   batch    benchmarks/batch_decode.py: the continuous-batching loop on the fast backend at --max-batch 1, 4, 16, 64,
#            plain and verifying EAGLE3 chains of 3 and 6 (one stream vs all, decode step ms, TTFT, the projection at
#            tau 3.7; the batch-1 loop beside), Qwen3-8B shape, 256 tokens each (BATCH_ARGS: its other options)
#   open     benchmarks/open_dir.py: opening the Qwen3-8B shape on the fast backend (weights drawn on the GPU; then
#            written as a safetensors checkpoint and opened from it; OPEN_ARGS: its options instead), the warm-up,
#            an 8-token prefill, the prefills of 16-79 tokens, a round
#   long     benchmarks/attention_splits.py (one layer's attention per chunk size and row tile at 16K and 32K,
#            1 / 7 / 32 rows; then 7 / 32 rows on one 32,256-slot cache at 128-32000, fixed chunks against the
#            even layout, each at 2 and 3 stages); xrun bench --synthetic qwen3-8b --backend fast, one run a
#            context of LONG_CONTEXTS (128 4096 16384 32000; chain gamma 6, tree 10/6/32): decode and verify
#            against the floor counting KV bytes, and the prompt's prefill against the matmul rate; the same at
#            32000 with an FP8 KV cache
#   long128k xrun bench --synthetic qwen3-8b --yarn 4 (Qwen3's model card: 131,072 positions) at a 130,000-token
#            context, chain gamma 6: decode, verify and round there, the prefill, and torch's peak GPU memory
#            (not yet run, so its time is not known; the prefill of 130,000 tokens is timed six times)
#   serve    a Qwen3-8B-shape synthetic export (--max-batch 16, EAGLE3) served by `xrun serve` and driven by
#            benchmarks/serve_load.py at 1 / 4 / 16 streams (SERVE_STREAMS) of 256 tokens, then 64 prompt lengths one at a time
#            (SERVE_LENGTHS: how many; carry .whl: fastapi, uvicorn, openai, httpx2...); SERVE_FIRST=1: then
#            benchmarks/first_request.py on the same dir (the first requests after the warm-up in-process); then xrun
#            bench's chain round of gamma 4 (the server's default), beside the server's own mean round at one stream
#            (SERVE_BENCH=0: not that). SERVE_LAYERS=N: the shape cut to N layers (a quicker export, for probes)
#   exact    row-invariant decoding (KernelConfig.row_invariant, issue 38): xrun bench at context 128 without and with
#            --row-invariant, one after the other (what bit-exact speculation costs plain decoding; EXACT_BENCH=0: not
#            that); EXACT_AGREE=1: then benchmarks/fast_agreement.py --row-invariant on the demo target with its
#            EAGLE3 head, MTP module and draft model in bf16 (speculative vs plain greedy; AGREE_ARGS: its other
#            options, --gammas 1,2,3,4,5,6,7,8 --tree 16,8,64 say)
#   onerow   the one_row tile table (issue 38: one-row calls under row_invariant): benchmarks/kernels.py --one-row at
#            the 8B shapes (ONEROW_CALLS: other --calls), each candidate checked bit for bit, its table in
#            $OUT/one_row.json; then benchmarks/fast_decode.py --row-invariant --tiles that file at context 128 (the
#            shipped kernels, row_invariant, and row_invariant with the tuned one_row table in one process)
#   compare  OLD=DIR, an older tree in the repo (DEVELOPERS.md): installs it and runs its fast_decode.py, the bench
#            and benchmarks/dump_logits.py; then this tree the same; then whether the logits are bit-identical
# Usage (device tool): bash scripts/h200_check.sh PART [PART...]. $OUT/summary.log says what passed; the exit
# status is 1 when a step failed. The parts of one call share BUDGET seconds (570; the device stops a command at
# 600): a step gets what is left, and a step with no time left counts as failed. SKIP="NAME..." leaves out those
# steps (the names in summary.log, attention_splits say), so a call spends its minutes on the steps it needs.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BUDGET=${BUDGET:-570}
HERE=$PWD
FAILED=()
[ $# -gt 0 ] || { echo "usage: bash scripts/h200_check.sh PART... (tests, bench, agree, agree8b, compare, quant, stalls, qbench," \
  "sample, paradigms, batch, open, long, long128k, serve, exact, onerow, steptune: see its header)"
  exit 2; }
for part in "$@"; do
  case $part in
  tests|bench|agree|agree8b|compare|quant|stalls|qbench|sample|paradigms|batch|open|long|long128k|serve|exact|onerow|steptune) ;;
  *) echo "unknown part '$part': tests, bench, agree, agree8b, compare, quant, stalls, qbench, sample, paradigms, batch, open," \
       "long, long128k, serve, exact, onerow or steptune"
     exit 2;;
  esac
done

note() { echo "== [$(date +%T)] $*" | tee -a "$OUT/summary.log"; }
# run NAME SECONDS CMD...: CMD within SECONDS (or what is left of BUDGET), its output in $OUT/NAME.log
run() {
  local name=$1 limit=$2; shift 2
  local left=$((BUDGET - SECONDS))
  [[ " ${SKIP:-} " == *" $name "* ]] && { note "$name: skipped (SKIP)"; return 1; }
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 20 ]; then FAILED+=("$name"); note "$name: not run, out of time"; return 1; fi
  note "$name: $*"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  if [ $rc = 0 ]; then echo "   pass" | tee -a "$OUT/summary.log"
  else FAILED+=("$name"); echo "   FAILED (exit $rc$([ $rc = 124 ] && echo ", over ${limit} s")): $OUT/$name.log" \
    | tee -a "$OUT/summary.log"; fi
  return $rc
}
# install DIR: the tree in DIR as the installed xcompile (an image whose setuptools predates SPDX license strings,
# < 77, gets pyproject's license as a table)
install() {
  (cd "$1" && { python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || {
    sed -i 's/^license = "Apache-2.0"/license = { text = "Apache-2.0" }/' pyproject.toml &&
    python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1; }; }) ||
    { note "FAILED: pip install -e $1"; exit 1; }
}
BENCH=(--synthetic qwen3-8b --backend fast --device cuda --gammas 6 --tree 10,6,32 --num-prompts 1)
SHOW="^ +(128|4096) +yes|^target|^eagle3|floor"             # the bench lines echoed back

# carried wheels (DEVELOPERS.md), byte-compiled as pip does by default: a module compiled from source on its first
# import is a cold path no user's install has
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
install "$HERE"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$OUT/summary.log"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  | tee -a "$OUT/summary.log"

for part in "$@"; do
  case $part in
  tests)
    # TESTS: other pytest arguments (default: every gpu-marked test of the engines and the loop)
    run gpu_tests 420 python3 -m pytest -q -p no:cacheprovider -rfEs ${TESTS:--m gpu tests/runtime/engines tests/runtime/decoding}
    tail -1 "$OUT/gpu_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -20
    ;;
  bench)
    run bench 300 xrun bench "${BENCH[@]}" --contexts 128,4096 --json "$OUT/bench.json"
    grep -E "$SHOW" "$OUT/bench.log"
    run fast_decode 240 python3 benchmarks/fast_decode.py --contexts 128,4096
    cat "$OUT/fast_decode.log"
    ;;
  quant)
    run qlinear_tests 240 python3 -m pytest -q -p no:cacheprovider -rfEs tests/runtime/engines/kernels/test_qlinear.py \
      tests/runtime/engines/kernels/test_cuda_qgemv.py
    tail -1 "$OUT/qlinear_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/qlinear_tests.log" | head -20
    run qlinear_tiles 280 python3 benchmarks/qlinear_tiles.py --rows 1 --cuda ${TILES_ARGS:-}
    grep -E "^BEST" "$OUT/qlinear_tiles.log"
    run qlinear_timeline 200 python3 benchmarks/step_timeline.py --quantize "${QUANTIZE:-fp8}" --contexts 128 --tokens 1,7
    grep -E "^== |^ *(linear|qlinear|_q|_linear|attention|rope)" "$OUT/qlinear_timeline.log" | head -40
    ;;
  steptune)
    args=(${STEPTUNE_ARGS:---quantize fp8,int4})
    run step_tune "${STEPTUNE_LIMIT:-420}" python3 benchmarks/step_tune.py "${args[@]}" --out "$OUT/steptiles.json" --json "$OUT/step_tune.json"
    grep -E "^(==|WON|STEP)" "$OUT/step_tune.log"
    if [ -s "$OUT/steptiles.json" ]; then
      cp "$OUT/steptiles.json" runtime/engines/kernels/tiles.json && note "tiles.json: the tuned tables from here on"
      # the step just tuned (its --model; the first --quantize kind), profiled with them
      tl=(); [[ " ${args[*]} " == *" --model qwen3-0.6b "* ]] && tl+=(--model qwen3-0.6b)
      [[ " ${args[*]} " =~ " --quantize "(fp8|int4) ]] && tl+=(--quantize "${BASH_REMATCH[1]}")
      run steptune_timeline 150 python3 benchmarks/step_timeline.py "${tl[@]}" --contexts 128 --tokens 1
      grep -A 30 "^== " "$OUT/steptune_timeline.log"
    fi
    ;;
  stalls)
    run qgemv_stalls 200 python3 benchmarks/qgemv_stalls.py
    cat "$OUT/qgemv_stalls.log"
    ;;
  qbench)
    for q in ${QBENCH:-fp8 int4}; do
      run "bench_$q" 270 xrun bench "${BENCH[@]}" --contexts 128 --quantize "$q" --json "$OUT/bench_$q.json"
      grep -E "$SHOW|quantized" "$OUT/bench_$q.log"
    done
    ;;
  sample)
    # 330: on a fresh H100 the kernels' and loops' tests (61) ran past 240 s with their first compiles (2026-12-06)
    run sample_tests 330 python3 -m pytest -q -p no:cacheprovider -rfEs ${SAMPLE_TESTS:-tests/runtime/decoding/kernels/test_sample.py \
      tests/runtime/decoding/kernels/test_accept_sampled.py tests/runtime/decoding/test_sampling_gpu.py}
    tail -1 "$OUT/sample_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/sample_tests.log" | head -20
    run sample_kernels 60 python3 benchmarks/sample_kernels.py
    cat "$OUT/sample_kernels.log"
    run bench_greedy 200 xrun bench "${BENCH[@]}" --contexts 128 --json "$OUT/bench_greedy.json"
    grep -E "$SHOW|sample|accept" "$OUT/bench_greedy.log"
    run bench_sampled 270 xrun bench "${BENCH[@]}" --contexts 128 --temperature 0.6 --top-k 20 --top-p 0.95 \
      --json "$OUT/bench_sampled.json"
    grep -E "$SHOW|sample|accept" "$OUT/bench_sampled.log"
    ;;
  agree8b)
    run agree8b 540 python3 benchmarks/fast_agreement.py --synthetic qwen3-8b --num-prompts 8 --new-tokens 512 \
      ${AGREE8B_ARGS:---fast-only --row-invariant --gammas 1,2,3,4,5,6,7,8 --tree 10,6,32 --tree 16,8,64}
    grep -E "teacher-forced|tau" "$OUT/agree8b.log"
    ;;
  batch)
    run batch_decode 420 python3 benchmarks/batch_decode.py ${BATCH_ARGS:-} --json "$OUT/batch_decode.json"
    cat "$OUT/batch_decode.log" | grep -v "^ *$" | tail -8
    ;;
  open)
    run open_dir 300 python3 benchmarks/open_dir.py ${OPEN_ARGS---checkpoint /tmp/ckpt-qwen3-8b} --json "$OUT/open_dir.json"
    cat "$OUT/open_dir.log"
    ;;
  long)
    run attention_splits 120 python3 benchmarks/attention_splits.py --contexts 16384,32000 --chunks 128,256,512,1024
    cat "$OUT/attention_splits.log"
    # several rows on one 32,256-slot cache at every context, as the bench's graphs run them: fixed chunks against
    # the even layout (attention's even) over 32 splits, each at 2 and 3 stages (VERIFY_STAGES)
    run attention_even 120 python3 benchmarks/attention_splits.py --contexts 128,4096,16384,32000 --cache 32256 \
      --rows 7,32 --chunks 1024 --even 32 --stages 2,3
    cat "$OUT/attention_even.log"
    # one bench a context (a bench times the verify and the rounds at its first context only), each on a cache
    # sized for that context; the chain of 6 and the 32-node tree
    for ctx in ${LONG_CONTEXTS:-128 4096 16384 32000}; do
      run "long_bench_$ctx" 120 xrun bench --synthetic qwen3-8b --backend fast --device cuda --gammas 6 \
        --tree 10,6,32 --num-prompts 1 --contexts "$ctx" --json "$OUT/long_bench_$ctx.json"
      grep -E "$SHOW|^ +$ctx +yes|prefill" "$OUT/long_bench_$ctx.log"
    done
    run long_bench_fp8 120 xrun bench --synthetic qwen3-8b --backend fast --device cuda --gammas 6 --tree 10,6,32 \
      --num-prompts 1 --contexts 32000 --kv-cache-dtype fp8 --json "$OUT/long_bench_fp8.json"
    grep -E "$SHOW|^ +32000 +yes|prefill" "$OUT/long_bench_fp8.log"
    ;;
  long128k)
    run long_bench_128k 420 xrun bench --synthetic qwen3-8b --yarn 4 --backend fast --device cuda --gammas 6 --tree "" \
      --num-prompts 1 --contexts 130000 --repeats 5 --json "$OUT/long_bench_128k.json"
    grep -E "$SHOW|^ +130000 +yes|prefill|peak" "$OUT/long_bench_128k.log"
    ;;
  serve)
    run serve_export 300 xcompile export --model qwen3-8b --synthetic --eagle3 --dtype bf16 --max-batch 16 \
      --out /tmp/serve-8b --force ${SERVE_LAYERS:+--synthetic-layers $SERVE_LAYERS}
    run serve_load 300 python3 benchmarks/serve_load.py /tmp/serve-8b --serve-args "--device cuda" --streams "${SERVE_STREAMS:-1,4,16}" \
      --max-tokens 256 --lengths "${SERVE_LENGTHS:-64}" --json "$OUT/serve_load.json"
    tail -14 "$OUT/serve_load.log"
    # SERVE_FIRST=1: the first requests after the warm-up in-process, each step timed, the first two profiled
    [ "${SERVE_FIRST:-0}" = 1 ] && { run serve_first 200 python3 benchmarks/first_request.py /tmp/serve-8b \
      --device cuda --json "$OUT/serve_first.json"; grep -E "^(open|request)" "$OUT/serve_first.log"; }
    # the batch-1 round a lone request runs in the server (xrun serve's default drafter: the EAGLE3 chain, gamma 4)
    [ "${SERVE_BENCH:-1}" = 0 ] && continue
    run serve_bench 150 xrun bench --synthetic qwen3-8b --backend fast --device cuda --gammas 4 --tree "" \
      --contexts 128 --num-prompts 1 --json "$OUT/serve_bench.json"
    grep -E "$SHOW" "$OUT/serve_bench.log"
    ;;
  exact)
    [ "${EXACT_BENCH:-1}" = 0 ] || for mode in off on; do
      run "bench_exact_$mode" 150 xrun bench "${BENCH[@]}" --contexts 128 $([ $mode = on ] && echo --row-invariant) \
        --json "$OUT/bench_exact_$mode.json"
      grep -E "$SHOW" "$OUT/bench_exact_$mode.log"
    done
    [ "${EXACT_AGREE:-0}" = 1 ] || continue
    run demo_export 120 xcompile export --model demo --eagle3 --mtp --draft-model demo --out /tmp/demo-bf16 \
      --dtype bf16 --max-seq-len 1024 --force
    run agree_exact 420 python3 benchmarks/fast_agreement.py /tmp/demo-bf16 --num-prompts "${AGREE_PROMPTS:-16}" \
      --row-invariant ${AGREE_ARGS:-}
    grep -E "teacher-forced|tau" "$OUT/agree_exact.log"
    ;;
  onerow)
    run one_row_sweep 330 python3 benchmarks/kernels.py --one-row --calls "${ONEROW_CALLS:-8b}" --out "$OUT/one_row.json"
    grep -E "^(8b|0\.6b|eagle3)|chosen|keep the bits" "$OUT/one_row_sweep.log"
    [ -f "$OUT/one_row.json" ] && run one_row_decode 200 python3 benchmarks/fast_decode.py --contexts 128 --row-invariant \
      --tiles "$OUT/one_row.json"
    [ -f "$OUT/one_row.json" ] && cat "$OUT/one_row_decode.log"
    ;;
  paradigms)
    run paradigms 400 xrun bench --synthetic qwen3-8b --mtp --draft-model qwen3-0.6b --backend fast --device cuda \
      --contexts 128 --gammas 2,4,6 --tree 10,6,32 --num-prompts 1 --json "$OUT/paradigms.json"
    grep -E "$SHOW|^(mtp|draft) |round" "$OUT/paradigms.log" | head -30
    ;;
  agree)
    run demo_export 120 xcompile export --model demo --eagle3 --mtp --draft-model demo --out /tmp/demo-bf16 \
      --dtype bf16 --max-seq-len 1024 --force
    run agree 240 python3 benchmarks/fast_agreement.py /tmp/demo-bf16 --num-prompts "${AGREE_PROMPTS:-16}" \
      --max-gap 0.0625
    tail -6 "$OUT/agree.log"
    ;;
  compare)
    if [ ! -f "${OLD:-}/pyproject.toml" ]; then
      FAILED+=(compare); note "compare: OLD=DIR, a tree, not given"; continue
    fi
    OLD=$(cd "$OLD" && pwd)
    for side in old new; do
      tree=$([ $side = old ] && echo "$OLD" || echo "$HERE")
      note "compare, $side: $tree"
      install "$tree"
      run "logits_$side" 100 python3 "$HERE/benchmarks/dump_logits.py" --out "/tmp/logits_$side.pt"
      cd "$tree"                                           # each tree's own fast_decode.py
      run "fast_decode_$side" 150 python3 benchmarks/fast_decode.py --contexts 128
      cd "$HERE"
      run "bench_$side" 180 xrun bench "${BENCH[@]}" --contexts 128
    done
    run logits_compare 60 python3 benchmarks/dump_logits.py --compare /tmp/logits_old.pt /tmp/logits_new.pt
    for side in old new; do
      echo "--- $side"
      grep -E "^(what|target step|eagle3)" "$OUT/fast_decode_$side.log"
      grep -E "$SHOW" "$OUT/bench_$side.log"
    done
    cat "$OUT/logits_compare.log"
    ;;
  esac
done

if [ ${#FAILED[@]} -eq 0 ]; then note "all passed"; else note "FAILED: ${FAILED[*]}"; exit 1; fi
