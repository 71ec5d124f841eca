"""``paratrain trace``: draw a pipeline schedule, or a recorded run, and print its bubble.

    paratrain trace --schedule 1f1b --pp 4 --microbatches 8 --out schedule.png
    paratrain trace --schedule interleaved --pp 4 --microbatches 8 --virtual-stages 2
    paratrain trace --run timeline.json --out run.png

The first form simulates the schedule's tables (unit costs unless ``--b-cost`` says
otherwise) and prints the simulated bubble next to the theory, (p-1)/(v*m+p-1). The
second draws a timeline the pipeline executor recorded (``Timeline.save``) and prints the
measured bubble of every rank.
"""

from __future__ import annotations

import argparse
import sys

from .parallel.pipeline.schedules import KINDS, notes
from .parallel.pipeline.timeline import Timeline, theoretical_bubble


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the ``trace`` sub-command."""
    p = subparsers.add_parser(
        "trace", help="draw a pipeline schedule or a recorded run (PNG or SVG)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schedule", choices=KINDS, default="1f1b",
                   help="pipeline schedule (default: 1f1b)")
    p.add_argument("--pp", type=int, default=4, help="pipeline stages (default: 4)")
    p.add_argument("--microbatches", type=int, default=8, help="microbatches per step (default: 8)")
    p.add_argument("--virtual-stages", type=int, default=1,
                   help="chunks per rank, for --schedule interleaved (default: 1)")
    p.add_argument("--f-cost", type=float, default=1.0, help="time of a forward (default: 1)")
    p.add_argument("--b-cost", type=float, default=1.0,
                   help="time of a backward (default: 1; 2 is closer to real models)")
    p.add_argument("--run", metavar="TIMELINE.json",
                   help="draw this recorded run instead of simulating a schedule")
    p.add_argument("--step", type=int, default=-1,
                   help="which recorded step to draw (default: the last)")
    p.add_argument("--out", default="schedule.png",
                   help="output file, .png or .svg (default: schedule.png)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from .trace import RenderError, render_schedule, render_timeline

    # A bad schedule raises ScheduleError, a LayoutError: cli.main prints it like any other.
    try:
        if args.run:
            _trace_run(args, render_timeline)
        else:
            _trace_schedule(args, render_schedule)
    except RenderError as exc:
        print(f"paratrain trace: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


def _trace_schedule(args: argparse.Namespace, render_schedule) -> None:
    p, m, v = args.pp, args.microbatches, args.virtual_stages
    sim = render_schedule(args.schedule, p, m, v, args.out, args.f_cost, args.b_cost)
    theory = theoretical_bubble(p, m, v)
    print(f"schedule {args.schedule}: pp={p}, microbatches={m}, virtual stages={v}; "
          f"forward {args.f_cost:g}, backward {args.b_cost:g}")
    print(f"bubble      simulated {sim.bubble:.2%}   theory (p-1)/(v*m+p-1) = {theory:.2%}")
    print("in flight   peak microbatches per rank: "
          + " ".join(f"{x:g}" for x in sim.peak_inflight))
    for note in notes(args.schedule, p, m, v):
        print(f"note        {note}")


def _trace_run(args: argparse.Namespace, render_timeline) -> None:
    from .trace import RenderError

    try:
        timeline = Timeline.load(args.run)
    except ValueError as exc:
        raise RenderError(str(exc)) from None
    render_timeline(timeline, args.out, args.step)
    steps = len(timeline.ranks[0])
    skip = 1 if steps > 1 else 0
    per_rank = " ".join(f"{b:.2%}" for b in timeline.bubbles(skip))
    print(f"recorded run: {timeline.schedule}, pp={timeline.stages}, "
          f"microbatches={timeline.microbatches}, virtual stages={timeline.chunks}, {steps} steps")
    print(f"bubble      measured {timeline.bubble(skip):.2%} (per rank {per_rank}; steps "
          f"{skip + 1}..{steps})   theory {timeline.theory:.2%}")
    shares = timeline.breakdown(skip)
    print(f"step        compute {shares['compute']:.1%}, waiting for transfers "
          f"{shares['wait']:.1%}, posting them {shares['post']:.1%}, other {shares['other']:.1%}")
