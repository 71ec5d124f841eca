"""Draws docs/img/cp-ring.png: the load-balanced chunk layout of context parallelism and
which blocks of the causal score matrix each rank computes at each ring step.

Left: the sequence in 2·cp chunks, coloured by the rank that holds them (rank i: chunks i
and 2·cp−1−i). Right: the causal (query × key) matrix at cp = 4; each computed block is
coloured by the rank that computes it and labelled with the ring step at which the keys
arrive. The layout and the blocks come from paratrain itself (``positions_for`` and
``ring.block_for``), so the picture shows exactly what the code does.

    python docs/img/make_cp.py      # writes cp-ring.png next to this script
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from paratrain.parallel.context.ring import block_for  # noqa: E402
from paratrain.parallel.context.sharding import chunk_ids, positions_for  # noqa: E402

CP, CHUNK = 4, 1  # draw in units of one chunk
SEQ = 2 * CP * CHUNK
COLORS = ["#264653", "#2a9d8f", "#e9c46a", "#e76f51"]


def draw_layout(ax) -> None:
    for r in range(CP):
        for c in chunk_ids(r, CP):
            ax.add_patch(Rectangle((c, 0), 1, 1, color=COLORS[r], ec="white", lw=2))
            ax.text(c + 0.5, 0.5, f"c{c}\nrank {r}", ha="center", va="center", fontsize=8,
                    color="white" if r in (0, 1, 3) else "black")
    ax.set_xlim(0, 2 * CP)
    ax.set_ylim(0, 1)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(f"sequence in 2·cp = {2 * CP} chunks; rank i holds chunks i and {2 * CP - 1}−i",
                 fontsize=9, loc="left")


def draw_blocks(ax) -> None:
    """Every (query rank, K/V rank) block, at the step the K/V block reaches the rank."""
    local = 2 * CHUNK
    work = [0] * CP
    for r in range(CP):
        q_pos = positions_for(r, CP, SEQ)
        for step in range(CP):
            src = (r - step) % CP
            blk = block_for(r, src, local)
            for qi in q_pos[blk.rows].tolist():
                for ki in positions_for(src, CP, SEQ)[blk.cols].tolist():
                    if ki > qi:  # masked inside the causal (step 0) block
                        continue
                    diagonal = qi == ki  # the causal triangle inside a diagonal chunk
                    ax.add_patch(Rectangle((ki, SEQ - 1 - qi), 1, 1, color=COLORS[r],
                                           alpha=0.55 if diagonal else 1.0, ec="white", lw=1))
                    ax.text(ki + 0.5, SEQ - 0.5 - qi, f"s{step}" + ("\n◣" if diagonal else ""),
                            ha="center", va="center", fontsize=7,
                            color="black" if r == 2 or diagonal else "white")
                    work[r] += 0.5 if diagonal else 1.0
    ax.set_xlim(0, SEQ)
    ax.set_ylim(0, SEQ)
    ax.set_aspect("equal")
    ax.set_xticks([c + 0.5 for c in range(SEQ)], [f"k{c}" for c in range(SEQ)], fontsize=7)
    ax.set_yticks([SEQ - 0.5 - c for c in range(SEQ)], [f"q{c}" for c in range(SEQ)], fontsize=7)
    ax.tick_params(length=0)
    ax.set_xlabel("key chunk", fontsize=8)
    ax.set_ylabel("query chunk", fontsize=8)
    for side in ax.spines.values():
        side.set_visible(False)
    ax.set_title(f"causal scores at cp={CP}: colour = computing rank, sN = ring step;\n"
                 f"blank = skipped (above the diagonal); chunk-blocks per rank: "
                 f"{', '.join(f'{w:g}' for w in work)}", fontsize=9, loc="left")


def main() -> None:
    fig = plt.figure(figsize=(6.6, 7.2))
    draw_layout(fig.add_axes([0.04, 0.86, 0.92, 0.1]))
    draw_blocks(fig.add_axes([0.1, 0.05, 0.86, 0.72]))
    out = Path(__file__).with_name("cp-ring.png")
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main()
