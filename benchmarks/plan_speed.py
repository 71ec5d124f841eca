"""How long `paratrain plan` searches: Llama 3 405B on 16,384 H100s (the largest published
dense run), against the 5-second target. Pure arithmetic on one core, so the figure is CPU
seconds of the search itself; no peer publishes a layout search to compare with.

    python benchmarks/plan_speed.py [--rounds 3]

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
from paratrain.plan.models import PRESETS
from paratrain.plan.search import search

TARGET_S = 5.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=at_least(1), default=3, help="searches to time (default 3)")
    args = parser.parse_args()
    model, training = PRESETS["llama3-405b"], Training(2048, 8192)
    cluster = Cluster(gpu_preset("h100-80g"), 16384)
    cpu, wall = [], []
    for _ in range(args.rounds):
        start, start_wall = time.process_time(), time.perf_counter()
        result = search(model, training, cluster)
        cpu.append(time.process_time() - start)
        wall.append(time.perf_counter() - start_wall)
    best = result.plans[0]
    print(f"llama3-405b on 16384 x h100-80g: {len(result.plans)} plans ranked, best {best.cand}")
    print(f"search CPU seconds per round: {', '.join(f'{s:.2f}' for s in cpu)} "
          f"(wall {', '.join(f'{s:.2f}' for s in wall)}); target {TARGET_S:.0f} s")
    median = statistics.median(cpu)
    print(json.dumps({"benchmark": "plan_speed", "paratrain": round(median, 3), "peer": None,
                      "ratio": round(median / TARGET_S, 3), "unit": "CPU seconds (ratio: over the 5 s target)",
                      "rounds": args.rounds}))


if __name__ == "__main__":
    main()
