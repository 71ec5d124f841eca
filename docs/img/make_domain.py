"""Draws docs/img/domain-halo.png: a heat2d field cut into a 2x2 grid of blocks, the halo
one block receives for a 3x3 convolution, and the halo-to-interior ratio as ranks grow.

Left: a generated heat2d field (paratrain's own generator), the block boundaries of a
2 x 2 domain grid, and the halo of the top-left block: one row from the block below, one
column from the block to the right, one corner cell from the diagonal block, and zeros
(or, periodic, the opposite edges) outside the image. Right: halo cells / own cells for a
256 x 256 field, a 3x3 (r=1) and a 5x5 (r=2) kernel, split along the height (n x 1) or
as square grids (sqrt(n) x sqrt(n)).

    python docs/img/make_domain.py      # writes domain-halo.png next to this script

With ``--timeline FILE.json`` (written by ``benchmarks/domain_parallel.py --timeline``) it
also draws domain-overlap.png: every rank's halo convolutions in one forward pass, without
overlap (wait for the halos, then convolve) and with it (the interior is computed while the
halos travel, then the wait that is left, then the border strips).
"""

import argparse
import json

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, Rectangle  # noqa: E402

from paratrain.train.heat2d import initial_fields  # noqa: E402

G, GRID, R = 16, 2, 1  # field size, ranks per side, halo width
COLORS = ["#264653", "#2a9d8f", "#c9a227", "#e76f51"]


def draw_field(ax) -> None:
    field = initial_fields(1, G, "circular", seed=3)[0, 0]
    ax.imshow(field, cmap="coolwarm", extent=(0, G, G, 0), alpha=0.55)
    b = G // GRID
    for i in range(GRID):
        for j in range(GRID):
            ax.add_patch(Rectangle((j * b, i * b), b, b, fill=False, ec=COLORS[i * GRID + j], lw=3))
            ax.text(j * b + b / 2, i * b + b / 2, f"rank {i * GRID + j}\n({i},{j})", ha="center",
                    va="center", fontsize=10, color=COLORS[i * GRID + j], weight="bold")
    # the halo of rank 0: the ring just outside its block
    halo = dict(hatch="////", fill=False, lw=0)
    ax.add_patch(Rectangle((0, b), b, R, ec=COLORS[2], **halo))  # row from rank 2 (below)
    ax.add_patch(Rectangle((b, 0), R, b, ec=COLORS[1], **halo))  # column from rank 1 (right)
    ax.add_patch(Rectangle((b, b), R, R, ec=COLORS[3], **halo))  # corner from rank 3
    ax.add_patch(Rectangle((-R, -R), b + 2 * R, b + 2 * R, fill=False, ec="black", ls="--", lw=1.5))
    for start, end in (((b / 2, b + 1.6), (b / 2, b + 0.5)), ((b + 1.6, b / 2), (b + 0.5, b / 2)),
                       ((b + 1.6, b + 1.6), (b + 0.5, b + 0.5))):
        ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=12, color="black"))
    ax.text(-R - 0.2, -R - 0.4, "padded block of rank 0 (dashed): its 8x8 cells + a 1-cell halo;\n"
            "outside the image: zeros, or the opposite edge when periodic", fontsize=8, va="bottom")
    ax.set_xlim(-R - 0.5, G + 0.5)
    ax.set_ylim(G + 0.5, -R - 2.5)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title("a 16x16 field on a 2x2 domain grid; hatched: what rank 0 receives for a 3x3 conv",
                 fontsize=9, loc="left")


def halo_ratio(size: int, rows: int, cols: int, r: int) -> float:
    h, w = size / rows, size / cols
    hh = h + 2 * r * (rows > 1)
    ww = w + 2 * r * (cols > 1)
    return (hh * ww - h * w) / (h * w)


def draw_ratio(ax, size: int = 256) -> None:
    ns = [2, 4, 8, 16, 32, 64]
    for r, ls in ((1, "-"), (2, "--")):
        ax.plot(ns, [halo_ratio(size, n, 1, r) for n in ns], ls, color=COLORS[0], marker="o",
                label=f"n x 1 strips, {2 * r + 1}x{2 * r + 1} kernel")
        squares = [n for n in ns if int(n**0.5) ** 2 == n]
        ax.plot(squares, [halo_ratio(size, int(n**0.5), int(n**0.5), r) for n in squares], ls,
                color=COLORS[3], marker="s", label=f"√n x √n grid, {2 * r + 1}x{2 * r + 1} kernel")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks per sample")
    ax.set_ylabel("halo cells / own cells")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"halo-to-interior ratio, {size}x{size} field", fontsize=9, loc="left")


def draw_timeline(path: str) -> Path:
    data = json.loads(Path(path).read_text())
    n = data["nproc"]
    fig, axes = plt.subplots(2, 1, figsize=(12, 2 + 1.2 * n), sharex=True)
    rest = (("waiting for halos", "#d62828"), ("convolution after the wait (all / border strips)", COLORS[2]))
    for ax, mode, title in ((axes[0], "off", "without overlap: post, wait, then convolve"),
                            (axes[1], "on", "with overlap: post, interior, then the wait left, then strips")):
        first = ("posting the exchange", "#999999") if mode == "off" else \
            ("posting the exchange + interior conv (halos in flight)", COLORS[1])
        parts = (first, *rest)
        for rank, calls in enumerate(data[mode]):
            for i, (t0, t1, t2, t3) in enumerate(calls):
                for (label, color), (a, b) in zip(parts, ((t0, t1), (t1, t2), (t2, t3))):
                    ax.barh(rank, (b - a) * 1e3, left=a * 1e3, color=color, height=0.6,
                            label=label if rank == 0 and i == 0 else None)
        ax.set_yticks(range(n), [f"rank {r}" for r in range(n)])
        ax.invert_yaxis()
        ax.set_title(f"{title} ({data['size']}x{data['size']} fields, {n} ranks, halo convolutions "
                     f"of one U-Net forward; gaps: other layers)", fontsize=9, loc="left")
    axes[1].set_xlabel("ms since the forward pass started")
    for ax in axes:
        ax.legend(loc="lower right", fontsize=7, framealpha=0.9)
    fig.tight_layout()
    out = Path(__file__).with_name("domain-overlap.png")
    fig.savefig(out, dpi=110)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeline", metavar="FILE.json")
    args = parser.parse_args()
    if args.timeline:
        print(draw_timeline(args.timeline))
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5.5), gridspec_kw={"width_ratios": [1.1, 1]})
    draw_field(left)
    draw_ratio(right)
    fig.tight_layout()
    out = Path(__file__).with_name("domain-halo.png")
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main()
