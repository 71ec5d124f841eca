"""Draws docs/img/compression.png from the numbers benchmarks/two_nodes.py measured:

    python benchmarks/two_nodes.py --save docs/img/compression.json   # as root
    cd docs/img && python make_compression.py

Three panels over the same runs (dp4, two nodes joined by a shaped link): step time,
gradient bytes a rank sends per step, and validation loss after the run's steps."""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

data = json.loads((Path(__file__).parent / "compression.json").read_text())
runs = {k: v for k, v in data["results"].items() if "step_s" in v and " x " not in k}
labels = [k.replace("paratrain ", "").replace("torch ", "torch\n").replace("_compress_hook", "")
          .replace("_hook", "") for k in runs]
colors = ["#2a9d8f" if k.startswith("paratrain") else "#e76f51" for k in runs]
link = [v["link"] / 2**20 for v in runs.values()]
fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
panels = [("step time (ms)", [v["step_s"] * 1e3 for v in runs.values()]),
          ("MiB over the link per step (node 0)", link),
          (f"validation loss after {data['settings']['steps']} steps", [v["loss"] for v in runs.values()])]
for ax, (title, values) in zip(axes, panels):
    ax.bar(range(len(values)), values, color=colors)
    ax.set_xticks(range(len(values)), labels, rotation=60, fontsize=7, ha="right")
    ax.set_title(title, fontsize=9)
    if "loss" in title:
        ax.set_ylim(min(values) * 0.97, max(values) * 1.01)
s = data["settings"]
fig.suptitle(f"{s['model']} model, dp4 over two nodes x 2 processes, {s['bandwidth']} link, "
             f"{s['global_batch']} x {s['seq_len']} tokens/step (paratrain green, torch DDP hooks red; "
             f"load average {data['load_average']})", fontsize=9)
fig.tight_layout()
fig.savefig(Path(__file__).parent / "compression.png", dpi=110)
