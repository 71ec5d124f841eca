"""The planner's predicted step time and peak memory against paratrain's measured ones on
one CUDA GPU: the microbatch and recompute choices that remain when there is one rank.

    python benchmarks/plan_vs_gpu.py [--gpu h100-80g] [--steps 8] [--d-model 2048]
                                     [--n-layers 16] [--seq-len 2048] [--global-batch 8]

Needs a CUDA GPU (nccl, one process). A Llama-shaped model (grouped-query attention,
SwiGLU, 32,000-token vocabulary, random weights, bf16 compute with fp32 master weights and
AdamW) trains ``--steps`` steps of each layout through ``paratrain.train.loop.train`` in
one spawned world; its time is the median of the steps after the first two (warm-up and
the optimizer states' creation), its memory the peak ``torch.cuda.max_memory_allocated``
the run's records report. The prediction is ``plan.cost.step_time`` and
``plan.memory.rank_memory(paratrain=True)`` on the ``--gpu`` preset. Prints a table, the
Spearman rank correlation of the times, the median |error| of times and peaks, and as the
last line a JSON object: "paratrain" = the median |relative error| of the predicted step
time, "peer" = null (there is no torch-native planner), "ratio" = Spearman.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile

import torch

from paratrain.launch import spawn
from paratrain.mesh import Mesh
from paratrain.layout import Layout
from paratrain.plan.candidate import Candidate, Training
from paratrain.plan.cost import step_time
from paratrain.plan.hardware import Cluster, gpu_preset
from paratrain.plan.memory import rank_memory
from paratrain.plan.models import from_gpt_config
from paratrain.plan.speed import FUSED, Speed
from paratrain.train.config import Config, load
from paratrain.train.loop import train

from common import at_least
from plan_vs_measured import spearman

# (label, overrides): with one rank, what is left to choose.
LAYOUTS = [(f"mb{mb} {rc}", {"micro_batch": mb, "recompute": rc})
           for rc in ("none", "selective", "full") for mb in (1, 2, 4, 8)]


def build_config(args: argparse.Namespace, run_dir: str, overrides: dict) -> Config:
    heads = args.d_model // 128
    return load(None, {"vocab_size": 32000, "d_model": args.d_model, "n_layers": args.n_layers,
                       "n_heads": heads, "n_kv_heads": max(1, heads // 4), "ffn_hidden": 0,
                       "max_seq_len": args.seq_len, "seq_len": args.seq_len,
                       "global_batch": args.global_batch, "steps": args.steps,
                       "precision": "bf16", "backend": "nccl", "nproc": 1, "dp": 1, "eval_every": 0,
                       "eval_batches": 1, "progress": False, "run_dir": run_dir,
                       **overrides}).validate()


def run_layouts(configs: list[Config]) -> list[str | None]:
    """Train each config in turn; a layout that runs out of memory is reported, not fatal."""
    failures = []
    for cfg in configs:
        try:
            train(cfg, Mesh.build(cfg.layout))
            failures.append(None)
        except Exception as exc:  # noqa: BLE001 (the pipeline wraps the OOM)
            if "out of memory" not in str(exc):
                raise
            failures.append(f"out of memory: {str(exc).splitlines()[-1][:120]}")
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return failures


def measured(cfg: Config) -> tuple[float, int]:
    """(median step time after the first two steps, peak bytes) of a finished run."""
    records = [json.loads(line) for line in cfg.metrics_path.read_text().splitlines()]
    times = [r["step_time_s"] for r in records if "step_time_s" in r]
    peaks = [max(r["peak_mem_bytes"]) for r in records if r.get("peak_mem_bytes")]
    return statistics.median(times[2:] or times), max(peaks)


def predicted(cfg: Config, gpu, speed: Speed = FUSED) -> tuple[float, float]:
    """(step seconds, peak bytes) the planner gives the run ``cfg`` describes, timed at a
    runtime ``speed`` (plan/speed.py; default the fused model)."""
    t = cfg.train
    model = from_gpt_config(cfg.model, "bench")
    training = Training(t.global_batch, cfg.data.seq_len, t.precision, speed=speed)
    cand = Candidate(Layout(), zero=0, micro_batch=cfg.micro_batch,
                     microbatches=cfg.accumulation, recompute=t.recompute)
    time = step_time(model, training, Cluster(gpu, 1), cand).step
    return time, rank_memory(model, training, cand, paratrain=True, backend="nccl").total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", default="h100-80g", help="the planner's preset")
    parser.add_argument("--steps", type=at_least(3), default=8, help="steps per layout (first 2 untimed)")
    parser.add_argument("--d-model", type=at_least(1), default=2048)
    parser.add_argument("--n-layers", type=at_least(1), default=16)
    parser.add_argument("--seq-len", type=at_least(1), default=2048)
    parser.add_argument("--global-batch", type=at_least(1), default=8)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("plan_vs_gpu: needs a CUDA GPU (this machine has none)")
    gpu = gpu_preset(args.gpu)
    with tempfile.TemporaryDirectory(prefix="plan-vs-gpu-") as tmp:
        configs = [build_config(args, f"{tmp}/{i}", o) for i, (_, o) in enumerate(LAYOUTS)]
        failures = spawn(run_layouts, 1, configs, backend="nccl", timeout_s=1800)[0]
        for (label, _), failure in zip(LAYOUTS, failures):
            if failure:
                print(f"{label}: {failure}")
        keep = [i for i, f in enumerate(failures) if f is None]
        layouts = [LAYOUTS[i] for i in keep]
        configs = [configs[i] for i in keep]
        meas = [measured(cfg) for cfg in configs]
    pred = [predicted(cfg, gpu) for cfg in configs]
    params = from_gpt_config(configs[0].model, "bench").num_params()
    print(f"\n{torch.cuda.get_device_name()}: {params / 1e6:.0f}M parameters, "
          f"d_model {args.d_model}, {args.n_layers} layers, {args.global_batch} x "
          f"{args.seq_len} tokens per step, bf16, AdamW; planner preset {gpu.name}\n")
    print(f"{'layout':<14} pred ms  meas ms   error   pred GiB  meas GiB   error")
    for (label, _), (pt, pm), (mt, mm) in zip(layouts, pred, meas):
        print(f"{label:<14} {pt * 1e3:>7.1f}  {mt * 1e3:>7.1f}  {(pt - mt) / mt:>+6.0%}  "
              f"{pm / 2**30:>8.2f}  {mm / 2**30:>8.2f}  {(pm - mm) / mm:>+6.0%}")
    t_err = statistics.median(abs(p[0] - m[0]) / m[0] for p, m in zip(pred, meas))
    m_err = statistics.median(abs(p[1] - m[1]) / m[1] for p, m in zip(pred, meas))
    rho = spearman([p[0] for p in pred], [m[0] for m in meas])
    mfu = [6 * params * args.global_batch * args.seq_len / m[0] / gpu.peak_flops for m in meas]
    print(f"\nstep time: median |error| {t_err:.1%}, Spearman {rho:.3f}; peak memory: "
          f"median |error| {m_err:.1%}; measured MFU (6N only) {min(mfu):.0%}-{max(mfu):.0%}")
    print(json.dumps({
        "benchmark": "plan_vs_gpu", "paratrain": round(t_err, 4), "peer": None,
        "ratio": round(rho, 4), "memory_median_error": round(m_err, 4),
        "metric": "paratrain: median |relative error| of the predicted step time; "
                  "ratio: Spearman correlation of predicted and measured",
        "device": torch.cuda.get_device_name(),
        "layouts": {label: {"predicted_s": round(p[0], 5), "measured_s": round(m[0], 5),
                            "predicted_bytes": int(p[1]), "measured_bytes": m[1]}
                    for (label, _), p, m in zip(layouts, pred, meas)}}))


if __name__ == "__main__":
    main()
