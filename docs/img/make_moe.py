"""Draws docs/img/moe-dispatch.png: one MoE layer at ep2, tokens to their experts and back."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyBboxPatch  # noqa: E402

COLORS = ["#e63946", "#f4a261", "#2a9d8f", "#457b9d"]  # experts 0..3
ROUTED = [[0, 2, 1, 3, 0, 0], [3, 2, 2, 0, 1, 3]]  # each rank's tokens' chosen expert (top-1)

fig, ax = plt.subplots(figsize=(9, 4.2))
for r, tokens in enumerate(ROUTED):
    y = 2.6 - r * 2.2
    ax.text(-0.3, y + 0.55, f"rank {r}", ha="right", fontsize=10, weight="bold")
    for i, e in enumerate(tokens):  # this rank's tokens, routed
        ax.add_patch(FancyBboxPatch((i * 0.42, y + 0.3), 0.32, 0.5, boxstyle="round,pad=0.02",
                                    fc=COLORS[e], ec="none"))
    for i, e in enumerate(sorted(tokens)):  # sorted by expert, cut by destination rank
        ax.add_patch(FancyBboxPatch((3.0 + i * 0.42, y + 0.3), 0.32, 0.5,
                                    boxstyle="round,pad=0.02", fc=COLORS[e], ec="none"))
    for k, e in enumerate((2 * r, 2 * r + 1)):  # the experts this rank holds
        ax.add_patch(FancyBboxPatch((6.6 + k * 1.1, y + 0.2), 0.9, 0.7, boxstyle="round,pad=0.04",
                                    fc=COLORS[e] + "55", ec=COLORS[e], lw=2))
        ax.text(7.05 + k * 1.1, y + 0.5, f"expert {e}", ha="center", fontsize=8)
    ax.annotate("", xy=(2.9, y + 0.55), xytext=(2.55, y + 0.55), arrowprops=dict(arrowstyle="->"))
    ax.annotate("", xy=(6.5, y + 0.55), xytext=(5.6, y + 0.55),  # rows for its own experts
                arrowprops=dict(arrowstyle="->", color="#1d3557", lw=1.2))
ax.text(1.2, 3.6, "route (top-k)", ha="center", fontsize=9)
ax.text(4.2, 3.6, "sort by expert; counts all-to-all", ha="center", fontsize=9)
ax.text(7.6, 3.6, "tokens all-to-all → grouped GEMM\n← results all-to-all, weighted", ha="center", fontsize=9)
for y0, y1 in ((2.8, 0.7), (0.7, 2.8)):
    ax.annotate("", xy=(6.5, y1 + 0.2), xytext=(5.6, y0 + 0.2),
                arrowprops=dict(arrowstyle="->", color="#1d3557", lw=1.2, connectionstyle="arc3,rad=0.1"))
ax.set_xlim(-1.2, 9.2)
ax.set_ylim(0.0, 4.1)
ax.axis("off")
fig.tight_layout()
fig.savefig("moe-dispatch.png", dpi=110)
