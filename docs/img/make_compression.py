"""Draws docs/img/compression.png from the numbers benchmarks/two_nodes.py measured:

    python benchmarks/two_nodes.py --save docs/img/compression.json                       # as root
    python benchmarks/two_nodes.py --bandwidth 300mbit --tp-steps 4 --save docs/img/compression-300mbit.json
    python benchmarks/two_nodes.py --bandwidth 100mbit --save docs/img/compression-100mbit.json
    python docs/img/make_compression.py

One row per saved run (link rate), three panels over the same dp4 runs: step time (with the
same training without any communication, grey, where the run measured it: no compression
can beat that floor), bytes node 0 sent over the link per step, validation loss at the end."""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
files = [f for f in (HERE / "compression.json", HERE / "compression-300mbit.json", HERE / "compression-100mbit.json")
         if f.is_file()]
fig, grid = plt.subplots(len(files), 3, figsize=(13, 3.9 * len(files)), squeeze=False)
for axes, path in zip(grid, files):
    data = json.loads(path.read_text())
    timed = {k: v for k, v in data["results"].items() if "loss" in v and " x " not in k}
    runs = {k: v for k, v in timed.items() if k.startswith(("paratrain", "torch"))}

    def short(k: str) -> str:
        return (k.replace("paratrain ", "").replace("_compress_hook", "").replace("_hook", "")
                .replace(" (no communication)", ""))

    def color(k: str) -> str:
        return "#2a9d8f" if k.startswith("paratrain") else "#e76f51" if k.startswith("torch") else "#999999"
    s = data["settings"]
    panels = [(f"step time, ms ({s['bandwidth']} link)", timed, [v["step_s"] * 1e3 for v in timed.values()]),
              ("MiB node 0 sent over the link per step", runs, [v["link"] / 2**20 for v in runs.values()]),
              (f"validation loss after {s['steps']} steps", runs, [v["loss"] for v in runs.values()])]
    for ax, (title, shown, values) in zip(axes, panels):
        ax.bar(range(len(values)), values, color=[color(k) for k in shown])
        ax.set_xticks(range(len(values)), [short(k) for k in shown], rotation=50, fontsize=7, ha="right")
        ax.set_title(title, fontsize=9)
        if "loss" in title:
            ax.set_ylim(min(values) * 0.97, max(values) * 1.01)
    axes[0].text(0.01, 0.97, f"load avg {data['load_average']}", transform=axes[0].transAxes,
                 fontsize=7, va="top")
fig.suptitle(f"{s['model']} model, dp4 over two nodes x 2 processes, {s['global_batch']} x {s['seq_len']} "
             "tokens/step; paratrain green, torch DDP (hooks) red; a loaded 2-core machine", fontsize=9)
fig.tight_layout()
fig.savefig(HERE / "compression.png", dpi=110)
