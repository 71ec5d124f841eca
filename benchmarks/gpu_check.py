"""The timing part of the GPU check (scripts/gpu_check.sh): on one CUDA GPU, the 837M
Llama shape of ``plan_vs_gpu.py`` at microbatches 1 and 8 (8 x 2048 tokens per step):

- paratrain eager: ``--precision bf16`` (autocast over fp32 weights), as docs/gpu.md ran it;
- paratrain compiled: ``--compile --precision bf16-params`` (each block compiled, bf16
  weights with fp32 masters);
- torch's recommended plain loop: fused AdamW, bf16 autocast, the model through
  ``torch.compile`` (``gpu_step.peer_step_time(compiled=True)``), on paratrain's own GPT.

Each with its MFU (the model's FLOPs per token as the run's metrics count them, over the
GPU's bf16 peak) and the planner's predicted step time (``plan_vs_gpu.predicted`` at the
runtime's speed profile, plan/speed.py: paratrain's eager profile for the eager run, the
compiled one, fitted on this script's H200 run, for the two compiled runs). Step times are
medians of the steps after the first two (the compiles). Each variant compiles from
scratch (``torch._dynamo.reset``), and prints its first step's time, compiles included.

    python benchmarks/gpu_check.py [--micro-batches 1 8] [--steps 8] [--gpu PRESET]
                                   [--variants eager compiled plain] [--profile-dir DIR]

The last line is JSON: "paratrain" = compiled step seconds at the last microbatch size,
"peer" = the compiled plain loop's, "ratio" their quotient; the issue's targets are MFU
>= 45% at microbatch 8 and a ratio <= 1.
"""

from __future__ import annotations

import argparse
import gc
import json

import torch

from paratrain.launch import spawn
from paratrain.plan.hardware import gpu_preset, preset_for_device
from paratrain.plan.speed import PARATRAIN_COMPILED, PARATRAIN_EAGER
from paratrain.train import logs
from paratrain.train.task import task_for

import gpu_step
import plan_vs_gpu
from common import at_least

VARIANTS = ("paratrain eager", "paratrain compiled", "torch plain loop compiled")


def variant_configs(mb: int, steps: int) -> dict:
    shape = argparse.Namespace(d_model=2048, n_layers=16, seq_len=2048, global_batch=8, steps=steps)
    eager = plan_vs_gpu.build_config(shape, f"/tmp/gpu-check-eager-{mb}", {"micro_batch": mb})
    compiled = plan_vs_gpu.build_config(shape, f"/tmp/gpu-check-compiled-{mb}",
                                        {"micro_batch": mb, "compile": True, "precision": "bf16-params"})
    return {"paratrain eager": eager, "paratrain compiled": compiled, "torch plain loop compiled": eager}


def measure(micro_batches: list[int], steps: int, variants: list[str],
            profile_dir: str | None) -> dict:
    """Median step seconds of each of ``variants`` at every microbatch size (one rank,
    nccl); with ``profile_dir``, each one's profile of one more step is written there."""
    out = {}
    for mb in micro_batches:
        cfgs = variant_configs(mb, steps)
        for name in variants:
            cfg, label = cfgs[name], f"{name} mb{mb}"
            to = f"{profile_dir}/{label.replace(' ', '_')}.txt" if profile_dir else None
            if name.startswith("torch"):
                seconds = gpu_step.peer_step_time(cfg, steps, compiled=True, label=label,
                                                  profile_to=to)
            else:
                seconds = gpu_step.paratrain_step_time(cfg, steps, profile=False, label=label,
                                                       profile_to=to)
            out[label] = seconds
            torch._dynamo.reset()  # each variant compiles from scratch, as a fresh run would
            gc.collect()
            torch.cuda.empty_cache()
    return out


SHORT = dict(zip(("eager", "compiled", "plain"), VARIANTS))
"""``--variants`` names."""


def _rows(seconds: dict, micro_batches: list[int], steps: int, gpu) -> dict:
    """Step seconds, MFU and the planner's prediction of each measured variant."""
    rows = {}
    for mb in micro_batches:
        cfg = variant_configs(mb, steps)["paratrain eager"]
        tokens = cfg.train.global_batch * cfg.data.seq_len
        flops = task_for(cfg).flops_per_unit(cfg) * tokens
        peak = logs.peak_flops(torch.device("cuda"), "bf16", 1) or gpu.peak_flops
        for name in VARIANTS:  # eager at paratrain's eager profile, the others compiled
            if f"{name} mb{mb}" not in seconds:
                continue
            speed = PARATRAIN_EAGER if name == VARIANTS[0] else PARATRAIN_COMPILED
            predicted = plan_vs_gpu.predicted(cfg, gpu, speed)[0]
            s = seconds[f"{name} mb{mb}"]
            rows[f"{name} mb{mb}"] = {"step_s": round(s, 5), "mfu": round(flops / s / peak, 4),
                                      "predicted_s": round(predicted, 5)}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--micro-batches", type=at_least(1), nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=at_least(3), default=8)
    parser.add_argument("--gpu", help="the planner's preset for the prediction (default: the "
                        "one this GPU's name matches, e.g. h200 for 'NVIDIA H200')")
    parser.add_argument("--variants", nargs="+", choices=SHORT, default=list(SHORT),
                        help="which to time (default all three)")
    parser.add_argument("--profile-dir", help="write each variant's torch.profiler tables of "
                        "one more step there, a file per variant and microbatch size")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check: needs a CUDA GPU (this machine has none)")
    gpu = gpu_preset(args.gpu) if args.gpu else preset_for_device(torch.cuda.get_device_name())
    if gpu is None:
        raise SystemExit(f"gpu_check: no planner preset matches {torch.cuda.get_device_name()!r}; "
                         "name one with --gpu")
    variants = [SHORT[v] for v in args.variants]
    seconds = spawn(measure, 1, args.micro_batches, args.steps, variants, args.profile_dir,
                    backend="nccl", timeout_s=1500)[0]
    rows = _rows(seconds, args.micro_batches, args.steps, gpu)
    print(f"{torch.cuda.get_device_name()}: 837M-parameter Llama shape, 8 x 2048 tokens per step; "
          f"planner preset {gpu.name}")
    print(f"{'variant':<36} {'step ms':>8} {'MFU':>6} {'planner ms':>11}")
    for label, r in rows.items():
        print(f"{label:<36} {r['step_s'] * 1e3:>8.1f} {r['mfu']:>6.1%} {r['predicted_s'] * 1e3:>11.1f}")
    last = args.micro_batches[-1]
    ours, peer = (rows.get(f"{name} mb{last}", {}).get("step_s") for name in VARIANTS[1:])
    print(json.dumps({"benchmark": "gpu_check", "metric": f"step time (s), microbatch {last}",
                      "paratrain": ours, "peer": peer, "peer_name": VARIANTS[2],
                      "ratio": round(ours / peer, 4) if ours and peer else None,
                      "device": torch.cuda.get_device_name(), "rows": rows}))


if __name__ == "__main__":
    main()
