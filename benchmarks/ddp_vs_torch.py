"""paratrain DDP vs torch DistributedDataParallel: same model, data and world size, one run.

    python benchmarks/ddp_vs_torch.py [--nproc 2] [--steps 12] [--rounds 3] [--bucket-mb 4]

Each rank builds the same GPT; the two implementations alternate in rounds of ``steps``
optimizer steps (forward, backward with overlapped gradient all-reduce, AdamW), so machine
noise hits both alike. Reported: median step time over all timed steps of each.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
import torch.distributed as dist

from paratrain.launch import spawn
from paratrain.models.gpt import GPT, preset
from paratrain.parallel.data import DataParallel
from common import DDP_SETTINGS, at_least, check_model_flags, fast_ddp


def time_steps(model, optimizer, batches, finish) -> list[float]:
    times = []
    for tokens in batches:
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=False)
        (model(tokens, tokens) / tokens.numel()).backward()
        finish()
        optimizer.step()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return times


def worker(args) -> dict:
    torch.manual_seed(0)
    base = GPT(preset(args.model))
    ours = DataParallel(copy.deepcopy(base), dist.group.WORLD, bucket_mb=args.bucket_mb)
    theirs = fast_ddp(copy.deepcopy(base), bucket_cap_mb=args.bucket_mb)  # the same buckets
    opts = {"paratrain": torch.optim.AdamW(ours.parameters(), lr=1e-3),
            "torch DDP": torch.optim.AdamW(theirs.parameters(), lr=1e-3)}
    gen = torch.Generator().manual_seed(dist.get_rank())
    batches = [torch.randint(0, 256, (args.batch, args.seq), generator=gen) for _ in range(args.steps)]
    times = {"paratrain": [], "torch DDP": []}
    for r in range(args.rounds + 1):  # round 0 warms up both
        for name, model in (("paratrain", ours), ("torch DDP", theirs)):
            finish = ours.finish_grad_sync if model is ours else (lambda: None)
            t = time_steps(model, opts[name], batches, finish)
            if r > 0:
                times[name] += t
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=at_least(1), default=2)
    parser.add_argument("--model", default="small")
    parser.add_argument("--batch", type=at_least(1), default=8, help="sequences per rank")
    parser.add_argument("--seq", type=at_least(1), default=128)
    parser.add_argument("--steps", type=at_least(1), default=10)
    parser.add_argument("--rounds", type=at_least(1), default=3)
    parser.add_argument("--bucket-mb", type=float, default=4.0)
    args = parser.parse_args()
    check_model_flags(parser, args.model, args.seq)
    result = spawn(worker, args.nproc, args, backend="gloo")[0]
    ours, peer = result["paratrain"], result["torch DDP"]
    params = preset(args.model).num_params()
    print(f"DDP, model {args.model} ({params / 1e6:.2f}M params), {args.nproc} ranks x "
          f"{args.batch} x {args.seq} tokens, bucket {args.bucket_mb} MiB, "
          f"median of {args.rounds * args.steps} steps")
    print(f"torch DDP configured for speed: {DDP_SETTINGS}, "
          f"bucket_cap_mb={args.bucket_mb} (paratrain's bucket size)")
    print(f"{'implementation':<16}{'ms/step':>10}{'tokens/s':>12}")
    tokens = args.nproc * args.batch * args.seq
    for name, t in result.items():
        print(f"{name:<16}{t * 1e3:>10.1f}{tokens / t:>12,.0f}")
    print(json.dumps({"benchmark": "ddp_vs_torch", "metric": "step_time_s", "nproc": args.nproc,
                      "paratrain": round(ours, 5), "peer": round(peer, 5),
                      "ratio": round(ours / peer, 3)}))


if __name__ == "__main__":
    main()
