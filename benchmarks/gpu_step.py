"""paratrain's training step on one CUDA GPU against a plain PyTorch loop over the same
model: where does the time go?

    python benchmarks/gpu_step.py [--micro-batches 1 8] [--steps 8] [--profile]

Needs a CUDA GPU. The model is ``plan_vs_gpu.py``'s (837M parameters at its defaults),
bf16 autocast over fp32 weights, 8 x 2048 tokens per step. The peer is the loop torch's
documentation recommends for speed: ``torch.optim.AdamW(fused=True)``, autocast,
``zero_grad(set_to_none=True)``, gradient accumulation with one synchronisation per step,
on paratrain's own ``GPT`` module (so only the step machinery differs). paratrain runs
``train.loop.train_step`` on a built run (one rank, nccl). Each side's time is the median
of the steps after the first two. ``--profile`` prints torch.profiler's table of one
paratrain step (self CPU and CUDA time by operator). The last line is a JSON object:
"paratrain" and "peer" = step seconds at the first microbatch size, "ratio" their
quotient.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

from paratrain.launch import spawn
from paratrain.mesh import Mesh
from paratrain.models.gpt import GPT
from paratrain.train import loop

import plan_vs_gpu
from common import at_least


def _timed(step, steps: int, label: str = "") -> float:
    """Median seconds of the steps after the first two; with a ``label``, prints the first
    step's seconds (compiles included) and the median."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    median = statistics.median(times[2:])
    if label:
        print(f"  {label}: first step {times[0]:.1f} s (compiles included), then a median of "
              f"{median * 1e3:.1f} ms", flush=True)
    return median


def profile_step(step, title: str, path: str | None = None) -> None:
    """torch.profiler's tables of one more ``step``: operators by self CUDA time, then by
    self CPU time (the host's share: Python, dispatch, launches). Printed, or written to
    ``path``."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        step()
        torch.cuda.synchronize()
    table = prof.key_averages()
    text = (f"profile of one step: {title}\n"
            f"{table.table(sort_by='self_cuda_time_total', row_limit=30)}\n"
            f"{table.table(sort_by='self_cpu_time_total', row_limit=20)}\n")
    if path is None:
        print(text)
    else:
        with open(path, "w") as f:
            f.write(text)
        print(f"  wrote {path}", flush=True)


def peer_step_time(cfg, steps: int, compiled: bool = False, label: str = "",
                   profile_to: str | None = None) -> float:
    """The plain loop's median step seconds on ``cfg``'s model, batch and microbatch;
    ``compiled``: the model through ``torch.compile`` too (torch's recommended loop), with
    static shapes as paratrain's ``--compile`` has them; ``profile_to``: a file for the
    profile of one more step."""
    model = GPT(cfg.model, seed=0).cuda()
    if compiled:
        model.compile(dynamic=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    mb, seq = cfg.micro_batch, cfg.data.seq_len
    micro = [torch.randint(cfg.model.vocab_size, (mb, seq + 1), device="cuda")
             for _ in range(cfg.accumulation)]

    def step():
        opt.zero_grad(set_to_none=True)
        for batch in micro:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(batch[:, :-1], batch[:, 1:]) / (mb * seq * cfg.accumulation)
            loss.backward()
        opt.step()

    result = _timed(step, steps, label)
    if profile_to:
        profile_step(step, label, profile_to)
    del model, opt
    return result


def paratrain_step_time(cfg, steps: int, profile: bool, label: str = "",
                        profile_to: str | None = None) -> float:
    """paratrain's median step seconds on ``cfg`` (one rank); ``profile``: print the profile
    of one more step, ``profile_to``: write it to that file."""
    run = loop.build(cfg, Mesh.build(cfg.layout))
    counter = iter(range(10**9))
    step = lambda: loop.train_step(run, next(counter))  # noqa: E731
    result = _timed(step, steps, label)
    if profile or profile_to:
        profile_step(step, f"paratrain at micro-batch {cfg.micro_batch}", profile_to)
    del run
    return result


def compare(cfgs, steps: int, profile: bool) -> list[tuple[float, float]]:
    out = []
    for cfg in cfgs:
        mine = paratrain_step_time(cfg, steps, profile)
        gc.collect()
        torch.cuda.empty_cache()
        out.append((mine, peer_step_time(cfg, steps)))
        gc.collect()
        torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--micro-batches", type=at_least(1), nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=at_least(3), default=8)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_step: needs a CUDA GPU (this machine has none)")
    shape = argparse.Namespace(d_model=2048, n_layers=16, seq_len=2048, global_batch=8,
                               steps=args.steps)
    cfgs = [plan_vs_gpu.build_config(shape, f"/tmp/gpu-step-{mb}", {"micro_batch": mb})
            for mb in args.micro_batches]
    results = spawn(compare, 1, cfgs, args.steps, args.profile, backend="nccl",
                    timeout_s=1200)[0]
    print("peer: torch.optim.AdamW(fused=True), bf16 autocast, zero_grad(set_to_none=True), "
          "paratrain's GPT module")
    print(f"{'micro-batch':>11}  paratrain ms  peer ms  ratio")
    for mb, (mine, peer) in zip(args.micro_batches, results):
        print(f"{mb:>11}  {mine * 1e3:>12.1f}  {peer * 1e3:>7.1f}  {mine / peer:>5.2f}")
    mine, peer = results[0]
    print(json.dumps({"benchmark": "gpu_step", "paratrain": round(mine, 5),
                      "peer": round(peer, 5), "ratio": round(mine / peer, 4),
                      "micro_batch": args.micro_batches[0], "device": torch.cuda.get_device_name(),
                      "all": {str(mb): {"paratrain_s": round(a, 5), "peer_s": round(b, 5)}
                              for mb, (a, b) in zip(args.micro_batches, results)}}))


if __name__ == "__main__":
    main()
