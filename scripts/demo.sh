#!/usr/bin/env bash
# README's first command: set everything up from scratch, then run the embedded demo pair end to end
# on the CPU: export to ONNX, check the graphs against PyTorch, generate with and without speculation,
# and build (not run) TensorRT-RTX engines. The pair ships in the package (compile/demo/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."

# the start of a held-out document (data/corpus.heldout.txt, the Python reference's "Class definitions")
PROMPT="A class definition defines a class object"
NEW_TOKENS=96
START=$SECONDS

section() {
    printf '\n==== %s\n' "$1"
}

section "setup: .venv with torch (CPU) and xcompile (scripts/setup.sh)"
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"

section "export: the demo target + its EAGLE3 head + its MTP module -> engines/demo (fp32 ONNX graphs)"
xcompile export --model demo --eagle3 --mtp --out engines/demo --dtype fp32 --max-seq-len 1024 --force

section "diff: ONNX Runtime vs the PyTorch reference, teacher-forced, through Polygraphy"
xcompile diff engines/demo --backend ort --prompt "$PROMPT"

# --backend auto picks ONNX Runtime here: a CPU and fp32 graphs (runtime/engines/load.py, pick_backend)
section "generate: plain greedy decoding (one target forward per token)"
echo "prompt: \"$PROMPT\", then $NEW_TOKENS new tokens:"
xrun generate engines/demo --prompt "$PROMPT" --max-new-tokens "$NEW_TOKENS" --drafter none

section "generate: EAGLE3 chain of 4 drafts per round (same tokens as plain greedy)"
xrun generate engines/demo --prompt "$PROMPT" --max-new-tokens "$NEW_TOKENS" --drafter eagle3 --gamma 4

section "generate: EAGLE3 dynamic tree, top-4 x depth 4, 16 drafts verified per round (same tokens)"
xrun generate engines/demo --prompt "$PROMPT" --max-new-tokens "$NEW_TOKENS" --drafter eagle3 \
    --tree-topk 4 --tree-depth 4 --tree-tokens 16

section "generate: MTP module, chain of 4 drafts per round (same tokens)"
xrun generate engines/demo --prompt "$PROMPT" --max-new-tokens "$NEW_TOKENS" --drafter mtp --gamma 4

section "build: TensorRT-RTX engines for compute capability 8.9 -> engines/demo-rtx"
echo "(built only: no GPU here can run them; xrun generate --backend trt needs a matching NVIDIA GPU)"
xcompile build --model demo --eagle3 --mtp --trt rtx --compute-capability 8.9 --out engines/demo-rtx --force

section "done in $((SECONDS - START)) s"
echo "tau = tokens emitted per verify round (the bonus token included; tokens cut by a stop or the length cap"
echo "not counted). On a CPU this 7M-parameter target is so cheap that a draft step"
echo "costs about as much as a target step, so speculation saves forwards but not time here."
