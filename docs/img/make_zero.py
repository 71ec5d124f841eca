"""Draws docs/img/zero-stages.png: what each of 4 ranks holds under DDP and ZeRO-1/2/3."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

N = 4
KINDS = [("params", 2, "#457b9d"), ("grads", 2, "#e9c46a"), ("optimizer (fp32 master, m, v)", 12, "#e76f51")]
STAGES = [("DDP", set()), ("ZeRO-1", {"optimizer (fp32 master, m, v)"}),
          ("ZeRO-2", {"optimizer (fp32 master, m, v)", "grads"}),
          ("ZeRO-3", {"optimizer (fp32 master, m, v)", "grads", "params"})]
fig, axes = plt.subplots(1, 4, figsize=(12, 3.2), sharey=True)
for ax, (stage, sharded) in zip(axes, STAGES):
    total = 0.0
    for rank in range(N):
        x = 0.0
        for kind, width, colour in KINDS:
            if kind in sharded:  # the rank keeps one slice out of N
                ax.add_patch(Rectangle((x + rank * width / N, rank), width / N, 0.8, color=colour))
                ax.add_patch(Rectangle((x, rank), width, 0.8, fill=False, ec=colour, lw=0.6, ls=":"))
            else:
                ax.add_patch(Rectangle((x, rank), width, 0.8, color=colour))
            x += width
    per_rank = sum(w / N if k in sharded else w for k, w, _ in KINDS)
    ax.set_title(f"{stage}: {per_rank:g} bytes/param per rank", fontsize=9)
    ax.set_xlim(0, 16)
    ax.set_ylim(-0.2, N)
    ax.set_yticks([r + 0.4 for r in range(N)], [f"rank {r}" for r in range(N)])
    ax.set_xticks([])
handles = [Rectangle((0, 0), 1, 1, color=c) for _, _, c in KINDS]
fig.legend(handles, [f"{k} ({w} B/param)" for k, w, _ in KINDS], loc="lower center", ncol=3, fontsize=8)
fig.tight_layout(rect=(0, 0.1, 1, 1))
fig.savefig("zero-stages.png", dpi=110)
