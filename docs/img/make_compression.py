"""Draws docs/img/compression.png from the numbers benchmarks/two_nodes.py measured:

    python benchmarks/two_nodes.py --save docs/img/compression.json                       # as root
    python benchmarks/two_nodes.py --bandwidth 300mbit --tp-steps 4 --save docs/img/compression-300mbit.json
    python benchmarks/two_nodes.py --bandwidth 100mbit --save docs/img/compression-100mbit.json
    python docs/img/make_compression.py

One row per saved run (link rate), two panels over the same dp4 runs: step time (with the
same training without any communication, grey, where the run measured it: no compression
can beat that floor) and bytes node 0 sent over the link per step. On the right, what each
method costs in loss: the slow convergence test's 300-step validation losses
(convergence.json; the benchmark's own 20-step losses are too early to compare)."""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
files = [f for f in (HERE / "compression.json", HERE / "compression-300mbit.json", HERE / "compression-100mbit.json")
         if f.is_file()]
fig = plt.figure(figsize=(13, 3.9 * len(files)))
shape = fig.add_gridspec(len(files), 3)
grid = [[fig.add_subplot(shape[row, col]) for col in range(2)] for row in range(len(files))]
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
              ("MiB node 0 sent over the link per step", runs, [v["link"] / 2**20 for v in runs.values()])]
    for ax, (title, shown, values) in zip(axes, panels):
        ax.bar(range(len(values)), values, color=[color(k) for k in shown])
        ax.set_xticks(range(len(values)), [short(k) for k in shown], rotation=50, fontsize=7, ha="right")
        ax.set_title(title, fontsize=9)
    axes[0].text(0.01, 0.97, f"load avg {data['load_average']}", transform=axes[0].transAxes,
                 fontsize=7, va="top")
convergence = json.loads((HERE / "convergence.json").read_text())["losses"]
ax = fig.add_subplot(shape[:, 2])
base = convergence["none"]
ax.barh(range(len(convergence)), [100 * (v / base - 1) for v in convergence.values()], color="#2a9d8f")
ax.set_yticks(range(len(convergence)), list(convergence), fontsize=8)
ax.invert_yaxis()
ax.axvline(0, color="black", lw=0.8)
for bar in (3, 8):
    ax.axvline(bar, color="#999999", ls="--", lw=0.8)
ax.set_xlabel("validation loss vs no compression, % (bars at 3% and 8%)", fontsize=8)
ax.set_title("loss after 300 steps (dp2, small model; slow test)", fontsize=9)
fig.suptitle(f"{s['model']} model, dp4 over two nodes x 2 processes, {s['global_batch']} x {s['seq_len']} "
             "tokens/step; paratrain green, torch DDP (hooks) red; 2-core machine", fontsize=9)
fig.tight_layout()
fig.savefig(HERE / "compression.png", dpi=110)
