"""HSDP against ZeRO-3 where it matters: two nodes joined by a slow link (scripts/cluster.py:
two network namespaces, a tc-shaped veth pair, one torchrun agent each). Needs root.

    python benchmarks/hsdp_two_nodes.py [--bandwidth 200mbit] [--latency 0.5ms] [--steps 12]
        [--model small] [--global-batch 8] [--seq-len 64] [--repeats 2]

dp4 (2 processes per node) trains the same model on the same data with ``--zero 3`` (every
unit sharded over the 4 ranks: each gather and reduce-scatter crosses the link) and with
``--zero 3 --shard-group 2`` (HSDP: sharded within each node, each shard's gradient
all-reduced with the other node's replica once per step). The runs alternate ``--repeats``
times. Step time: the median over every run's steps after the first three; link bytes: what
crossed the veth pair per step, as the cluster tool counts it.

The last line is JSON: paratrain = HSDP's step time, peer = ZeRO-3's (the same trainer at
the layout HSDP replaces), ratio = HSDP / ZeRO-3 (lower is better).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import at_least

ROOT = Path(__file__).resolve().parents[1]
UNTIMED = 3
"""Steps left out of the median (start-up, first gathers)."""


def run(args, label: str, extra: list[str]) -> dict:
    run_dir = tempfile.mkdtemp(prefix=f"hsdp-{label}-")
    cmd = [sys.executable, str(ROOT / "scripts" / "cluster.py"), "--bandwidth", args.bandwidth,
           "--latency", args.latency, "--", "-m", "paratrain", "train", "--model", args.model,
           "--dp", "4", "--zero", "3", *extra, "--steps", str(args.steps), "--global-batch",
           str(args.global_batch), "--seq-len", str(args.seq_len), "--eval-every", "0", "--no-progress",
           "--run-dir", run_dir]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    if done.returncode:
        raise SystemExit(f"{label}: the cluster run failed:\n{(done.stdout + done.stderr)[-3000:]}")
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    sent = [int(x.replace(",", "")) for x in re.findall(r"node0->node1 ([\d,]+), node1->node0 ([\d,]+)",
                                                           done.stdout)[0]]
    return {"step_s": [r["step_time_s"] for r in records[UNTIMED:]], "link_bytes": sum(sent) / args.steps,
            "loss": records[-1]["loss"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bandwidth", default="200mbit")
    p.add_argument("--latency", default="0.5ms")
    p.add_argument("--steps", type=at_least(UNTIMED + 1), default=12)
    p.add_argument("--model", default="small")
    p.add_argument("--global-batch", type=at_least(4), default=8)
    p.add_argument("--seq-len", type=at_least(1), default=64)
    p.add_argument("--repeats", type=at_least(1), default=2)
    args = p.parse_args()
    layouts = {"ZeRO-3 (dp4)": [], "HSDP (dp4, shard group 2)": ["--shard-group", "2"]}
    results: dict[str, list[dict]] = {label: [] for label in layouts}
    print(f"two nodes x 2 processes, link {args.bandwidth} each way, {args.latency} one way; "
          f"model {args.model}, {args.global_batch} x {args.seq_len} tokens per step", flush=True)
    for repeat in range(args.repeats):  # every other repeat backwards: drifting load hits both
        for label in (list(layouts) if repeat % 2 == 0 else list(layouts)[::-1]):
            result = run(args, label, layouts[label])
            results[label].append(result)
            print(f"{label:28s} step {statistics.median(result['step_s']) * 1e3:8.1f} ms  "
                  f"link {result['link_bytes'] / 2**20:8.2f} MiB/step  loss {result['loss']:.4f}", flush=True)
    step = {label: statistics.median(s for r in rs for s in r["step_s"]) for label, rs in results.items()}
    link = {label: statistics.median(r["link_bytes"] for r in rs) for label, rs in results.items()}
    hsdp, zero3 = step["HSDP (dp4, shard group 2)"], step["ZeRO-3 (dp4)"]
    print(json.dumps({"benchmark": "hsdp_two_nodes", "bandwidth": args.bandwidth, "latency": args.latency,
                      "model": args.model, "repeats": args.repeats,
                      "metric": "step time, s (median of the timed steps of all repeats)",
                      "paratrain": round(hsdp, 4), "peer": round(zero3, 4), "ratio": round(hsdp / zero3, 3),
                      "peer_is": "paratrain ZeRO-3 at dp4 (the layout HSDP replaces)",
                      "link_mib_per_step": {k: round(v / 2**20, 2) for k, v in link.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
