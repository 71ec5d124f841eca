"""How long `paratrain plan` searches: Llama 3 405B on 16,384 H100s (the largest published
dense run), or (``--case deepseek-v3``) DeepSeek-V3 on 2,048 H800-class GPUs at its
published sequence 4,096 and batch 15,360 (a mixture of experts with MLA: ep searched
with everything else), against the 5-second target. Pure arithmetic on one core, so the
figure is CPU seconds of the search itself; no peer publishes a layout search to compare with.

    python benchmarks/plan_speed.py [--rounds 3] [--case llama3-405b|deepseek-v3]

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
    args = parser.parse_args()
    load, training, n = CASES[args.case]
    model, cluster = load(), Cluster(gpu_preset("h100-80g"), n)
    cpu, wall = [], []
    for _ in range(args.rounds):
        start, start_wall = time.process_time(), time.perf_counter()
        result = search(model, training, cluster)
        cpu.append(time.process_time() - start)
        wall.append(time.perf_counter() - start_wall)
    best = result.plans[0]
    print(f"{args.case} on {n} x h100-80g: {len(result.plans)} plans ranked of "
          f"{result.considered:,} considered, best {best.cand.describe()}")
    print(f"search CPU seconds per round: {', '.join(f'{s:.2f}' for s in cpu)} "
          f"(wall {', '.join(f'{s:.2f}' for s in wall)}); target {TARGET_S:.0f} s")
    median = statistics.median(cpu)
    name = "plan_speed" + ("" if args.case == "llama3-405b" else f"_{args.case}")
    print(json.dumps({"benchmark": name, "paratrain": round(median, 3), "peer": None,
                      "ratio": round(median / TARGET_S, 3),
                      "unit": "CPU seconds (ratio: over the 5 s target)",
                      "rounds": args.rounds}))


if __name__ == "__main__":
    main()
