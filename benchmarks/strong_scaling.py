"""Strong scaling on this machine: tokens/s of one fixed global batch at 1, 2 and 4 processes.

    python benchmarks/strong_scaling.py [--model small] [--steps 8] [--nproc 1,2,4] [--plot PNG]

For each world size: DDP, ZeRO-3, and the best of a few other layouts (tp2, pp2 1F1B with
the rest data parallel), each trained through `paratrain train`'s loop on the same model,
global batch and data; reported: median tokens/s of the steps after the first two. The
ideal line is the single process's rate times the world size. On a machine with fewer
cores than processes the ideal cannot hold: the ranks share the cores (see the docs page).
The peer, in the same world: torch's DistributedDataParallel (gradient_as_bucket_view,
no buffer sync before each forward, the speed settings its documentation recommends) over
the same GPT, global batch and sequence length, with torch's AdamW, clipping the gradient
norm and averaging the loss for its log each step as paratrain's loop does; its rate is
what data parallelism reaches without paratrain. Last line: JSON with paratrain = the step seconds
of the fastest paratrain layout at the largest world, peer = torch DDP's there, ratio =
their quotient (lower is better); the scaling efficiency against the ideal is a field.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from paratrain.launch import spawn
from paratrain.layout import LayoutError
from paratrain.mesh import Mesh
from paratrain.models.gpt import GPT
from paratrain.train.config import ConfigError, load
from paratrain.train.loop import train

from common import DDP_SETTINGS, at_least, check_model_flags, fast_ddp, int_list

TIMED_FROM = 2
"""Steps before this index warm up and are not timed."""
PEER = "torch DDP"


def layouts(n: int) -> dict[str, dict]:
    out = {"DDP": dict(dp=n), "ZeRO-3": dict(dp=n, zero=3)}
    if n >= 2:
        out["tp2"] = dict(dp=n // 2, tp=2)
        out["pp2 1f1b"] = dict(dp=n // 2, pp=2, schedule="1f1b", microbatches=4)
    return out


def run(configs) -> list[float]:
    """Median tokens/s of each config, trained in turn in this world, then of torch DDP
    over the first config's model, batch and steps (the last value)."""
    rates = []
    for cfg in configs:
        train(cfg, Mesh.build(cfg.layout))
        lines = cfg.metrics_path.read_text().splitlines() if cfg.metrics_path.exists() else []
        rates.append(statistics.median(json.loads(x)["tokens_per_s"] for x in lines[TIMED_FROM:])
                     if lines else 0.0)
    return rates + [torch_ddp_rate(configs[0])]


def torch_ddp_rate(cfg) -> float:
    """Median tokens/s of torch DDP training ``cfg``'s model on random tokens, each rank
    its share of the global batch in one microbatch, as paratrain's DDP layout runs it,
    and doing what paratrain's loop does each step: clip the gradient norm, and average
    the loss over the ranks to log it."""
    torch.manual_seed(cfg.train.seed)
    model = fast_ddp(GPT(cfg.model))
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr)
    share, seq = cfg.train.global_batch // dist.get_world_size(), cfg.data.seq_len
    times = []
    for _ in range(cfg.train.steps):
        tokens = torch.randint(0, cfg.model.vocab_size, (share, seq + 1))
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = model(tokens[:, :-1], tokens[:, 1:]) / tokens[:, 1:].numel()
        loss.backward()
        if cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        optimizer.step()
        logged = loss.detach().clone()
        dist.all_reduce(logged)
        logged.item()
        times.append(time.perf_counter() - start)
    return cfg.train.global_batch * seq / statistics.median(times[TIMED_FROM:])


def configs(args, n: int, tmp: str) -> list:
    """The validated config of each layout at ``n`` processes (ConfigError, LayoutError)."""
    base = dict(preset=args.model, steps=args.steps, global_batch=args.global_batch, seq_len=args.seq,
                eval_every=0, eval_batches=1, progress=False, nproc=n, warmup_steps=1)
    return [load(None, {**base, **layout, "run_dir": os.path.join(tmp, f"{n}-{i}")}).validate()
            for i, layout in enumerate(layouts(n).values())]


def measure(args, n: int, tmp: str) -> dict[str, float]:
    rates = spawn(run, n, configs(args, n, tmp), backend="gloo", timeout_s=1800)[0]
    return dict(zip([*layouts(n), PEER], rates))


def check_flags(parser: argparse.ArgumentParser, args) -> None:
    """Exit with a usage error naming the flag before any world starts: every layout at
    every --nproc is validated first, not when its turn comes after minutes of others."""
    check_model_flags(parser, args.model, args.seq)
    odd = [n for n in args.nproc if n > 1 and n % 2]
    if odd:
        parser.error(f"--nproc {','.join(map(str, odd))}: give 1 or even sizes (tp2 and pp2 "
                     f"split each world in two), e.g. --nproc 1,2,4")
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.nproc:
            try:
                configs(args, n, tmp)
            except (ConfigError, LayoutError) as exc:
                parser.error(f"--nproc {n} with --global-batch {args.global_batch}: {exc}")


def plot(results: dict[int, dict[str, float]], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted(results)
    fig, ax = plt.subplots(figsize=(6, 4))
    one = results[sizes[0]]["DDP"] / sizes[0]
    ax.plot(sizes, [one * n for n in sizes], "k--", label="ideal (1 process × n)")
    for name in ("DDP", "ZeRO-3", "best"):
        ax.plot(sizes, [best(results[n]) if name == "best" else results[n][name] for n in sizes],
                "o-", label=name if name != "best" else "best layout")
    ax.plot(sizes, [results[n][PEER] for n in sizes], "s:", label=PEER)
    ax.set_xlabel("processes (2 CPU cores)")
    ax.set_ylabel("tokens / s")
    ax.set_xticks(sizes)
    ax.legend()
    ax.set_title("strong scaling, one global batch")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def best(rates: dict[str, float]) -> float:
    """The fastest paratrain layout's tokens/s."""
    return max(v for k, v in rates.items() if k != PEER)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--nproc", type=int_list(1), default="1,2,4",
                        help="world sizes (default: 1,2,4)")
    parser.add_argument("--steps", type=at_least(TIMED_FROM + 1, f" (the first {TIMED_FROM} steps "
                        f"warm up, the rest are timed)"), default=8)
    parser.add_argument("--global-batch", type=at_least(1), default=16)
    parser.add_argument("--seq", type=at_least(1), default=128)
    parser.add_argument("--plot", default="", help="write the picture here (PNG)")
    args = parser.parse_args()
    check_flags(parser, args)
    sizes = args.nproc
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            results[n] = measure(args, n, tmp)
            print(f"{n} process(es): " + ", ".join(f"{k} {v:,.0f}" for k, v in results[n].items())
                  + " tokens/s", flush=True)
    one = results[sizes[0]]["DDP"] / sizes[0]
    print(f"peer: torch DDP ({DDP_SETTINGS}), torch AdamW, gradient clipping and a logged "
          f"loss each step, the same model, batch and steps")
    print(f"{'processes':>9} {'DDP':>9} {'ZeRO-3':>9} {'best':>9} {'best layout':>12} "
          f"{'torch DDP':>9} {'ideal':>9} {'efficiency':>10}")
    for n in sizes:
        r = results[n]
        name = max((k for k in r if k != PEER), key=r.get)
        print(f"{n:>9} {r['DDP']:>9,.0f} {r['ZeRO-3']:>9,.0f} {best(r):>9,.0f} {name:>12} "
              f"{r[PEER]:>9,.0f} {one * n:>9,.0f} {best(r) / (one * n):>10.0%}")
    if args.plot:
        plot(results, args.plot)
        print(f"picture: {args.plot}")
    top = sizes[-1]
    tokens = args.global_batch * args.seq
    mine, peer = tokens / best(results[top]), tokens / results[top][PEER]
    print(json.dumps({"benchmark": "strong_scaling", "metric": "step seconds, fastest layout",
                      "nproc": top, "paratrain": round(mine, 5), "peer": round(peer, 5),
                      "peer_name": f"torch DDP ({DDP_SETTINGS})", "ratio": round(mine / peer, 3),
                      "scaling_efficiency": round(best(results[top]) / (one * top), 3),
                      "results": {str(n): r for n, r in results.items()}}))


if __name__ == "__main__":
    main()
