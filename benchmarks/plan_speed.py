"""How long `paratrain plan` searches: Llama 3 405B on 16,384 H100s (the largest published
dense run), or (``--case deepseek-v3``) DeepSeek-V3 on 2,048 H800-class GPUs at its
published sequence 4,096 and batch 15,360 (a mixture of experts with MLA: ep searched
with everything else), against the 5-second target. Pure arithmetic on one core, so the
figure is CPU seconds of the search itself; no peer publishes a layout search to compare with.

    python benchmarks/plan_speed.py [--rounds 3] [--case llama3-405b|deepseek-v3] [--within F]
                                    [--full-rounds N]

``--within F`` times the bounded search (``paratrain plan --within F``: the same plans
within F of the fastest as the full search) and the full one in the same run
(``--full-rounds`` times: the full DeepSeek-V3 search takes minutes).

The last line is JSON: "paratrain" is the median CPU seconds, "ratio" that over the target.
A speed target is a benchmark, not a test: machines of this kind differ by 3x in Python speed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from paratrain.bench.flags import at_least
from paratrain.plan.candidate import Training
from paratrain.plan.hardware import Cluster, gpu_preset
from paratrain.plan.models import PRESETS, load_model
from paratrain.plan.search import search

TARGET_S = 5.0
CASES = {"llama3-405b": (lambda: PRESETS["llama3-405b"], Training(2048, 8192), 16384),
         # examples/deepseek-v3: the published config.json; 2,048 GPUs, 4K sequences, 15,360
         # sequences a step (DeepSeek-V3 technical report)
         "deepseek-v3": (lambda: load_model("examples/deepseek-v3"), Training(15360, 4096), 2048)}
"""name -> (model, training, GPUs)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=at_least(1), default=3, help="searches to time (default 3)")
    parser.add_argument("--case", choices=list(CASES), default="llama3-405b",
                        help="the model searched (default llama3-405b)")
    parser.add_argument("--within", type=float, metavar="F",
                        help="also time the bounded search (plans within F of the fastest)")
    parser.add_argument("--full-rounds", type=at_least(1), metavar="N",
                        help="full searches to time (default: --rounds)")
    args = parser.parse_args()
    if args.within is not None and not args.within >= 1:
        parser.error(f"--within must be a factor of at least 1, got {args.within}")
    load, training, n = CASES[args.case]
    model, cluster = load(), Cluster(gpu_preset("h100-80g"), n)
    full = _timed(model, training, cluster, None, args.full_rounds or args.rounds, args.case)
    median = bounded = statistics.median(full)
    if args.within:
        bounded = statistics.median(_timed(model, training, cluster, args.within, args.rounds,
                                           args.case))
        print(f"bounded over full: {bounded / median:.3f}")
    name = "plan_speed" + ("" if args.case == "llama3-405b" else f"_{args.case}")
    print(json.dumps({"benchmark": name, "paratrain": round(bounded, 3), "peer": None,
                      "ratio": round(bounded / TARGET_S, 3),
                      "unit": "CPU seconds (ratio: over the 5 s target)", "full": round(median, 3),
                      "within": args.within, "rounds": args.rounds,
                      "full_rounds": args.full_rounds or args.rounds}))


def _timed(model, training, cluster, within, rounds: int, case: str) -> list[float]:
    """CPU seconds of ``rounds`` searches (``within``: the bounded one), with its result."""
    cpu, wall = [], []
    for _ in range(rounds):
        start, start_wall = time.process_time(), time.perf_counter()
        result = search(model, training, cluster, within=within)
        cpu.append(time.process_time() - start)
        wall.append(time.perf_counter() - start_wall)
    best = result.plans[0]
    what = f"within {within:g}x" if within else "full"
    print(f"{case} on {cluster.n_gpus} x h100-80g, {what}: {len(result.plans):,} plans ranked of "
          f"{result.considered:,} considered, best {best.cand.describe()} at "
          f"{best.time.step:.4g} s")
    print(f"  search CPU seconds per round: {', '.join(f'{s:.2f}' for s in cpu)} "
          f"(wall {', '.join(f'{s:.2f}' for s in wall)}); target {TARGET_S:.0f} s")
    return cpu


if __name__ == "__main__":
    main()
