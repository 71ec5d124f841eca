"""Draws docs/img/tp-sp.png: one transformer sub-block (attention or MLP) at tp=2, under
plain tensor parallelism and under Megatron sequence parallelism."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyBboxPatch  # noqa: E402

REPLICATED, SHARDED, COMM = "#e9c46a", "#f4a261", "#2a9d8f"
LANES = (1.0, 0.0)  # y of rank 0 and rank 1


def box(ax, x, y, w, h, text, color, fontsize=7.5, text_color="black"):
    ax.add_patch(FancyBboxPatch((x, y - h / 2), w, h, boxstyle="round,pad=0.02",
                                facecolor=color, edgecolor="white"))
    ax.text(x + w / 2, y, text, ha="center", va="center", fontsize=fontsize, color=text_color)


def arrow(ax, x0, x1, y):
    ax.annotate("", (x1, y), (x0, y), arrowprops=dict(arrowstyle="->", lw=0.8))


def panel(ax, sp: bool):
    residual = "x: (b, s/2, h)\nown tokens" if sp else "x: (b, s, h)\nsame on both"
    enter = "all-gather\nalong seq\n(bwd: reduce-\nscatter)" if sp else "f: identity\n(bwd: all-\nreduce)"
    leave = "reduce-scatter\nalong seq\n(bwd: all-\ngather)" if sp else "g: all-reduce\n(bwd: identity)"
    for rank, y in enumerate(LANES):
        ax.text(-0.15, y, f"rank {rank}", ha="right", va="center", fontsize=8)
        box(ax, 0.0, y, 1.3, 0.7, residual + "\n+ norm", SHARDED if sp else REPLICATED)
        arrow(ax, 1.3, 1.45, y)
        box(ax, 2.9, y, 1.6, 0.7, f"column-parallel\nwq, wk, wv | w1, w3\nheads / ffn part {rank}", SHARDED)
        arrow(ax, 4.5, 4.65, y)
        box(ax, 4.65, y, 1.4, 0.7, f"row-parallel\nwo | w2 part {rank}\npartial sum", SHARDED)
        arrow(ax, 6.05, 6.2, y)
        box(ax, 7.65, y, 1.3, 0.7, residual.split("\n")[0] + "\n+ residual", SHARDED if sp else REPLICATED)
        arrow(ax, 2.75, 2.9, y)
        arrow(ax, 7.5, 7.65, y)
    # the collectives span both ranks
    box(ax, 1.45, 0.5, 1.3, 1.7, enter, COMM, fontsize=7, text_color="white")
    box(ax, 6.2, 0.5, 1.3, 1.7, leave, COMM, fontsize=7, text_color="white")
    ax.set_title("Megatron-SP: norms and residual on sequence shards" if sp
                 else "tensor parallel: one all-reduce per sub-block each way", fontsize=9, loc="left")
    ax.set_xlim(-0.9, 9.1)
    ax.set_ylim(-0.6, 1.6)
    ax.axis("off")


fig, axes = plt.subplots(2, 1, figsize=(10, 4.6))
for ax, sp in zip(axes, (False, True)):
    panel(ax, sp)
fig.text(0.5, 0.01, "yellow: same on every rank   orange: different on each rank   "
         "green: collective over the tp group", ha="center", fontsize=8)
fig.tight_layout(rect=(0, 0.03, 1, 1))
fig.savefig("tp-sp.png", dpi=110)
