"""Draws docs/img/ddp-overlap.png: backward with bucketed all-reduce overlap, vs after-the-fact."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LAYERS, BWD, COMM = 6, 1.0, 1.4  # backward time per layer, all-reduce time per bucket
fig, axes = plt.subplots(2, 1, figsize=(9, 3.6), sharex=True)
for ax, overlap in zip(axes, (False, True)):
    for i in range(LAYERS):  # backward runs from the last layer to the first
        ax.barh(1, BWD, left=i * BWD, color="#f4a261", edgecolor="white")
        ax.text(i * BWD + BWD / 2, 1, f"bwd L{LAYERS - 1 - i}", ha="center", va="center", fontsize=8)
    comm_start = 0.0
    for b in range(LAYERS // 2):  # a bucket holds two layers' gradients
        ready = (2 * b + 2) * BWD if overlap else LAYERS * BWD
        start = max(ready, comm_start)
        ax.barh(0, COMM, left=start, color="#2a9d8f", edgecolor="white")
        ax.text(start + COMM / 2, 0, f"all-reduce\nbucket {b}", ha="center", va="center", fontsize=7, color="white")
        comm_start = start + COMM
    ax.axvline(comm_start, color="k", lw=0.8, ls="--")
    ax.text(comm_start + 0.1, 1.45, f"step ends at {comm_start:.1f}", fontsize=8)
    ax.set_yticks([0, 1], ["comm", "compute"])
    ax.set_ylim(-0.6, 1.8)
    ax.set_title("buckets reduced as soon as they fill (paratrain)" if overlap
                 else "gradients reduced after backward", fontsize=9, loc="left")
axes[1].set_xlabel("time")
fig.tight_layout()
fig.savefig("ddp-overlap.png", dpi=110)
