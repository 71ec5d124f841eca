"""Draws docs/img/checkpoints.png: one weight matrix in a sharded checkpoint. Saved at
dp2 x ZeRO-3, each rank writes the boxes its flat range covers; a tp2 rank (row-parallel
layer, split by columns) later reads only the intersections of those boxes with its shard."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
from paratrain.train.slices import flat_boxes, intersect  # noqa: E402

ROWS, COLS, CUT = 6, 8, 21  # rank 0 of the ZeRO-3 unit owns flat elements [0, 21)
COLOURS = ["#457b9d", "#e76f51"]
saved = [(rank, box) for rank, (a, b) in enumerate([(0, CUT), (CUT, ROWS * COLS)])
         for box in flat_boxes((ROWS, COLS), a, b)]
shard = ((0, 0), (ROWS, COLS // 2))  # tp rank 0 of a row-parallel layer: the first columns


def draw(ax, box, **kw):
    (r, c), (h, w) = box
    ax.add_patch(Rectangle((c, ROWS - r - h), w, h, **kw))


fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
for ax, title in zip(axes, ["saved at dp2 x ZeRO-3: each rank writes the boxes of its flat range",
                            "loaded at tp2: tp rank 0 reads only the hatched parts"]):
    for rank, box in saved:
        draw(ax, box, color=COLOURS[rank], alpha=0.85 if ax is axes[0] else 0.25, ec="white", lw=2)
    ax.set_title(title, fontsize=9)
    ax.set_xlim(-0.2, COLS + 0.2)
    ax.set_ylim(-0.2, ROWS + 0.2)
    ax.set_aspect("equal")
    ax.axis("off")
for rank, box in saved:
    part = intersect(box, shard)
    if part is not None:
        draw(axes[1], part, fill=False, hatch="///", ec=COLOURS[rank], lw=1.5)
draw(axes[1], shard, fill=False, ec="black", lw=2, ls="--")
handles = [Rectangle((0, 0), 1, 1, color=c) for c in COLOURS]
fig.legend(handles, ["written by rank 0", "written by rank 1"], loc="lower center", ncol=2, fontsize=8)
fig.tight_layout(rect=(0, 0.08, 1, 1))
fig.savefig(Path(__file__).with_name("checkpoints.png"), dpi=110)
