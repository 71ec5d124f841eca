"""Strong scaling on this machine: tokens/s of one fixed global batch at 1, 2 and 4 processes.

    python benchmarks/strong_scaling.py [--model small] [--steps 8] [--nproc 1,2,4] [--plot PNG]

For each world size: DDP, ZeRO-3, and the best of a few other layouts (tp2, pp2 1F1B with
the rest data parallel), each trained through `paratrain train`'s loop on the same model,
global batch and data; reported: median tokens/s of the steps after the first two. The
ideal line is the single process's rate times the world size. On a machine with fewer
cores than processes the ideal cannot hold: the ranks share the cores (see the docs page).
Last line: JSON with paratrain = best tokens/s at the largest world, peer = the ideal
there, ratio = their quotient (the scaling efficiency; higher is better here).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

from paratrain.launch import spawn
from paratrain.mesh import Mesh
from paratrain.train.config import load
from paratrain.train.loop import train

from common import at_least


def layouts(n: int) -> dict[str, dict]:
    out = {"DDP": dict(dp=n), "ZeRO-3": dict(dp=n, zero=3)}
    if n >= 2:
        out["tp2"] = dict(dp=n // 2, tp=2)
        out["pp2 1f1b"] = dict(dp=n // 2, pp=2, schedule="1f1b", microbatches=4)
    return out


def run(configs) -> list[float]:
    """Median tokens/s of each config, trained in turn in this world."""
    rates = []
    for cfg in configs:
        train(cfg, Mesh.build(cfg.layout))
        lines = cfg.metrics_path.read_text().splitlines() if cfg.metrics_path.exists() else []
        rates.append(statistics.median(json.loads(x)["tokens_per_s"] for x in lines[2:]) if lines else 0.0)
    return rates


def measure(args, n: int, tmp: str) -> dict[str, float]:
    names = list(layouts(n))
    base = dict(preset=args.model, steps=args.steps, global_batch=args.global_batch, seq_len=args.seq,
                eval_every=0, eval_batches=1, progress=False, nproc=n, warmup_steps=1)
    configs = [load(None, {**base, **layouts(n)[name], "run_dir": os.path.join(tmp, f"{n}-{i}")}).validate()
               for i, name in enumerate(names)]
    return dict(zip(names, spawn(run, n, configs, backend="gloo", timeout_s=1800)[0]))


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
    ax.set_xlabel("processes (2 CPU cores)")
    ax.set_ylabel("tokens / s")
    ax.set_xticks(sizes)
    ax.legend()
    ax.set_title("strong scaling, one global batch")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def best(rates: dict[str, float]) -> float:
    return max(rates.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--nproc", default="1,2,4")
    parser.add_argument("--steps", type=at_least(1), default=8)
    parser.add_argument("--global-batch", type=at_least(1), default=16)
    parser.add_argument("--seq", type=at_least(1), default=128)
    parser.add_argument("--plot", default="", help="write the picture here (PNG)")
    args = parser.parse_args()
    sizes = [int(x) for x in args.nproc.split(",")]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            results[n] = measure(args, n, tmp)
            print(f"{n} process(es): " + ", ".join(f"{k} {v:,.0f}" for k, v in results[n].items())
                  + " tokens/s", flush=True)
    one = results[sizes[0]]["DDP"] / sizes[0]
    print(f"{'processes':>9} {'DDP':>9} {'ZeRO-3':>9} {'best':>9} {'best layout':>12} {'ideal':>9} {'efficiency':>10}")
    for n in sizes:
        r = results[n]
        name = max(r, key=r.get)
        print(f"{n:>9} {r['DDP']:>9,.0f} {r['ZeRO-3']:>9,.0f} {best(r):>9,.0f} {name:>12} "
              f"{one * n:>9,.0f} {best(r) / (one * n):>10.0%}")
    if args.plot:
        plot(results, args.plot)
        print(f"picture: {args.plot}")
    top = sizes[-1]
    print(json.dumps({"benchmark": "strong_scaling", "metric": "tokens_per_s", "nproc": top,
                      "paratrain": round(best(results[top]), 1), "peer": round(one * top, 1),
                      "peer_name": "ideal linear scaling", "ratio": round(best(results[top]) / (one * top), 3),
                      "results": {str(n): r for n, r in results.items()}}))


if __name__ == "__main__":
    main()
