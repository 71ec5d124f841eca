"""Draws docs/img/mesh.png: 8 ranks as dp2 x pp2 x tp2 with the default order tp-cp-pp-dp."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyBboxPatch  # noqa: E402

from paratrain.layout import Layout  # noqa: E402

layout = Layout(dp=2, pp=2, tp=2)
fig, ax = plt.subplots(figsize=(8, 3.6))
for rank in range(layout.world_size):
    c = layout.coords(rank)
    x, y = c["dp"] * 4.6 + c["tp"] * 1.9, 1.6 - c["pp"] * 1.6
    ax.add_patch(FancyBboxPatch((x, y), 1.6, 1.1, boxstyle="round,pad=0.05",
                                fc=["#a8dadc", "#f1c40f55"][c["pp"]], ec="#1d3557"))
    ax.text(x + 0.8, y + 0.72, f"rank {rank}", ha="center", fontsize=10, weight="bold")
    ax.text(x + 0.8, y + 0.3, f"dp{c['dp']} pp{c['pp']} tp{c['tp']}", ha="center", fontsize=8)
for dp in range(2):  # tp groups: consecutive ranks on one node
    for pp in range(2):
        x, y = dp * 4.6, 1.6 - pp * 1.6
        ax.plot([x + 1.65, x + 1.85], [y + 0.55] * 2, color="#e63946", lw=3)
    ax.annotate("", xy=(dp * 4.6 + 0.8, 1.25), xytext=(dp * 4.6 + 0.8, 1.6),
                arrowprops=dict(arrowstyle="<->", color="#457b9d", lw=1.5))
ax.annotate("", xy=(3.5, 2.9), xytext=(4.5, 2.9), arrowprops=dict(arrowstyle="<->", color="#2a9d8f", lw=1.5))
ax.text(4.0, 3.0, "dp: gradients, once a step", ha="center", fontsize=8, color="#2a9d8f")
ax.text(-0.1, 1.35, "pp: activations\nper microbatch", ha="right", fontsize=8, color="#457b9d")
ax.text(1.75, 2.85, "tp: every layer\n(fastest links)", ha="center", fontsize=8, color="#e63946")
ax.set_xlim(-1.6, 8.9)
ax.set_ylim(-0.2, 3.4)
ax.axis("off")
fig.tight_layout()
fig.savefig("mesh.png", dpi=110)
