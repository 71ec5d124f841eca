"""Pictures of pipeline timelines: ranks down, time across, one colour per microbatch.

Forwards are drawn in a light tint of their microbatch's colour, backwards in the full
colour with hatching, waits for transfers as thin grey bars and the posting of transfers
(recorded runs) as thin black ones. A label names the
microbatch, with a letter for the chunk when ranks hold several (``3b``: microbatch 3 on
the rank's second chunk). The same drawing serves a simulated schedule
(``render_schedule``) and a recorded run (``render_timeline``), so the two can be laid
side by side. PNG or SVG, chosen by the file's extension.

matplotlib is imported only when drawing, so the rest of paratrain runs without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from .parallel.pipeline.schedules import schedule
from .parallel.pipeline.simulator import Simulation, simulate
from .parallel.pipeline.timeline import (Interval, Timeline, on_one_clock, step_bubbles,
                                         theoretical_bubble)

FORMATS = (".png", ".svg")


class RenderError(RuntimeError):
    """The picture cannot be drawn (matplotlib missing, unknown format)."""


def _figure(width: float, height: float) -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise RenderError("drawing timelines needs matplotlib: pip install matplotlib") from None
    # A bare Figure, not pyplot: no global figure registry, no GUI backend.
    return Figure(figsize=(width, height), layout="constrained")


def _tint(rgb: Sequence[float], amount: float) -> tuple[float, ...]:
    """Mix ``rgb`` with white: 0 keeps it, 1 gives white."""
    return tuple(c + (1.0 - c) * amount for c in rgb[:3])


def render(rows: list[list[Interval]], path: str | Path, title: str, stages: int,
           span: float | None = None) -> Path:
    """Draw each rank's intervals as one row; return the written path."""
    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise RenderError(f"cannot write {path.name!r}: use a .png or .svg file name")
    span = span or max((i.end for row in rows for i in row), default=1.0)
    chunks = max((i.stage for row in rows for i in row), default=0) // max(stages, 1) + 1
    busiest = max((sum(i.kind in ("F", "B", "W") for i in row) for row in rows), default=1)
    fig = _figure(min(24.0, max(8.0, 0.22 * busiest)), 1.2 + 0.55 * len(rows))
    ax = fig.add_subplot()
    from matplotlib import colormaps  # imported with the figure above

    palette = colormaps["tab10"]  # ten distinct hues; tab20 pairs dark and light
    for r, row in enumerate(rows):
        for i in row:
            width = i.end - i.start
            if i.kind in ("WAIT", "POST"):  # thin bars: light waiting, dark posting
                shade = "0.75" if i.kind == "WAIT" else "0.15"
                ax.broken_barh([(i.start, width)], (r - 0.08, 0.16), color=shade, lw=0)
                continue
            rgb = palette(i.microbatch % 10)
            forward = i.kind == "F"
            ax.broken_barh([(i.start, width)], (r - 0.4, 0.8), edgecolor="0.2", lw=0.4,
                           facecolor=_tint(rgb, 0.55) if forward else rgb,
                           hatch=None if forward else "..." if i.kind == "W" else "///")
            if width / span > 0.012:
                chunk = "" if chunks == 1 else chr(ord("a") + (i.stage // stages) % 26)
                ax.text(i.start + width / 2, r, f"{i.microbatch}{chunk}", ha="center",
                        va="center", fontsize=7, color="black" if forward else "white")
    ax.set_yticks(range(len(rows)), [f"rank {r}" for r in range(len(rows))])
    ax.set_ylim(len(rows) - 0.5, -0.5)  # rank 0 on top
    ax.set_xlim(0, span)
    ax.set_xlabel("time" if span > 50 or span != int(span) else "time (cost units)")
    ax.set_title(title, fontsize=10)
    legend = "forward: light   backward: dark, hatched   grey: waiting for a transfer"
    if any(i.kind == "W" for row in rows for i in row):
        legend = ("forward: light   B (input gradient): dark, hatched   W (weight gradients): "
                  "dark, dotted   grey: waiting for a transfer")
    if any(i.kind == "POST" for row in rows for i in row):
        legend += "   black: posting transfers"
    ax.text(1.0, -0.9 / (len(rows) + 1), legend, transform=ax.transAxes, ha="right",
            va="top", fontsize=7, color="0.3")
    fig.savefig(path, dpi=130)
    return path


def render_schedule(kind: str, stages: int, microbatches: int, chunks: int, path: str | Path,
                    f_cost: float = 1.0, b_cost: float = 1.0) -> Simulation:
    """Simulate the schedule's tables with the given costs and draw them."""
    sim = simulate(schedule(kind, stages, microbatches, chunks), f_cost, b_cost)
    theory = theoretical_bubble(stages, microbatches, chunks)
    if kind == "zbh1":  # the paper's (p - 1)(F + B - W), W half the backward
        idle = (stages - 1) * f_cost
        theory = idle / (microbatches * (f_cost + b_cost) + idle)
    elif kind in ("zbv", "dualpipev"):  # no closed form: the equal-stage tables' own
        theory = sim.bubble
    v = f", v={chunks}" if chunks > 1 else ""
    title = (f"{kind} pp={stages} m={microbatches}{v} (forward {f_cost:g}, backward "
             f"{b_cost:g}): bubble {sim.bubble:.1%}, theory {theory:.1%}")
    render(sim.intervals, path, title, stages, sim.makespan)
    return sim


def step_index(timeline: Timeline, step: int | None) -> int:
    """The list index of recorded step ``step``, numbered from 1 as ``trace`` prints them
    (None: the last); raises RenderError naming the valid range."""
    count = min((len(steps) for steps in timeline.ranks), default=0)
    if count == 0:
        raise RenderError("the timeline records no steps; train with --timeline for at least "
                          "one step")
    if step is None:
        return count - 1
    if not 1 <= step <= count:
        raise RenderError(f"--step {step}: the run recorded {count} step(s), numbered 1..{count}; "
                          f"give one of them (default: the last, {count})")
    return step - 1


def render_timeline(timeline: Timeline, path: str | Path, step: int | None = None) -> None:
    """Draw recorded step ``step`` (1 = the first recorded; None: the last) of every rank,
    in seconds from the step's start."""
    index = step_index(timeline, step)
    records = timeline.step(index)
    # On one clock: a rank that finished its part early shows idle until the pipeline's
    # last rank ends, as the bubble counts it.
    lanes, span = on_one_clock(records)
    bubbles = " ".join(f"{b:.1%}" for b in step_bubbles(records))
    v = f", v={timeline.chunks}" if timeline.chunks > 1 else ""
    title = (f"recorded {timeline.schedule} pp={timeline.stages} m={timeline.microbatches}{v}, "
             f"step {index + 1}: {span * 1e3:.1f} ms; this step's bubble per rank "
             f"{bubbles} (theory {timeline.theory:.1%})")
    render(lanes, path, title, timeline.stages, span)
