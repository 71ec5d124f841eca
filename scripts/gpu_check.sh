#!/usr/bin/env bash
# The GPU check of issue 42 in one command, on one lent CUDA GPU (327 s on one H200;
# its figures are in docs/gpu.md):
#  1. the 837M Llama shape at microbatches 1 and 8: paratrain eager, paratrain compiled
#     (--compile --precision bf16-params) and torch's recommended plain loop (fused AdamW,
#     autocast, torch.compile), each with its MFU and the planner's predicted step time
#     (benchmarks/gpu_check.py);
#  2. scripts/gpu_smoke.sh with --compile --precision bf16-params: checkpoints, a resume
#     that must match the uninterrupted run bit for bit, a Hugging Face Llama in and out.
# Without CUDA it stops at once, saying so (exit 2).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: needs a CUDA GPU, and torch sees none on this machine (torch.cuda.is_available() is False)" >&2
    exit 2
fi
start=$SECONDS
echo "== 1/2 step times, MFU and the planner's predictions (benchmarks/gpu_check.py)"
python3 benchmarks/gpu_check.py --micro-batches 1 8 --steps 8
echo "== 2/2 exact resume and a Hugging Face model in and out, compiled (scripts/gpu_smoke.sh)"
bash scripts/gpu_smoke.sh --compile --precision bf16-params
echo "gpu_check: all steps ran in $((SECONDS - start)) s"
