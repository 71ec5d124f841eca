#!/usr/bin/env bash
# The user's path on one CUDA GPU (nccl, one rank): train with checkpoints, resume, a
# Hugging Face Llama built from a config, export it back and generate with transformers.
# Each step prints what it checks; any failure stops the script (docs/gpu.md).
# Arguments are added to every training run (scripts/gpu_check.sh: --compile --precision bf16-params).
set -euo pipefail
extra=("$@")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
run() { echo "+ paratrain $*"; python3 -m paratrain "$@" 2>&1 | grep -v "Warning\|return func\|ProcessGroupNCCL"; }

run train --nproc 1 --steps 30 --save-every 15 --precision bf16 --run-dir "$work/a" "${extra[@]}"
run train --nproc 1 --steps 30 --save-every 15 --precision bf16 --run-dir "$work/b" --max-time-s 600 "${extra[@]}"
run train --nproc 1 --steps 30 --precision bf16 --run-dir "$work/b" --resume "$work/b/checkpoints/step-15" "${extra[@]}"
python3 - "$work" <<'PY'
import json, sys
def last(d):
    rows = [json.loads(l) for l in open(f"{sys.argv[1]}/{d}/metrics.jsonl")]
    return [r for r in rows if r.get("step") == 30 and "loss" in r][-1]["loss"]
a, b = last("a"), last("b")
print(f"step 30 loss: uninterrupted {a:.6f}, resumed at 15 {b:.6f}, |diff| {abs(a - b):.2e}")
if a != b:
    sys.exit("gpu_smoke: the resumed run is not the uninterrupted one bit for bit")
PY
python3 - "$work/llama" <<'PY'
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=2, vocab_size=256, max_position_embeddings=256)
LlamaForCausalLM(cfg).save_pretrained(sys.argv[1])
PY
run train --nproc 1 --model "$work/llama" --steps 20 --save-every 20 --precision bf16 --run-dir "$work/hf" "${extra[@]}"
run export "$work/hf/checkpoints/step-20" --out "$work/exported"
python3 - "$work/exported" <<'PY'
import sys, torch
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained(sys.argv[1]).cuda()
out = m.generate(torch.tensor([[84, 104, 101, 32]], device="cuda"), max_new_tokens=16, do_sample=False)
print("exported model generates on the GPU:", bytes(out[0].tolist()).decode("latin-1"))
PY
echo "gpu_smoke: all steps ran"
