"""``paratrain trace``: draw a pipeline schedule, or a recorded run, and print its bubble.

    paratrain trace --schedule 1f1b --pp 4 --microbatches 8 --out schedule.png
    paratrain trace --schedule interleaved --pp 4 --microbatches 8 --virtual-stages 2
    paratrain trace --run RUN_DIR/timeline.json --step 2 --out run.png

The first form simulates the schedule's tables (unit costs unless ``--f-cost`` and
``--b-cost`` say otherwise; both must be positive) and prints the simulated bubble next to
the theory, (p-1)/(v*m+p-1). The second draws one step of a timeline the pipeline executor
recorded (``paratrain train --timeline`` writes RUN_DIR/timeline.json) and prints the
measured bubble of every rank; the flags of the first form are refused with it (the file
holds the run's schedule, stages and microbatches). Recorded steps are numbered from 1, as
the printout numbers them; ``--step`` picks one (default: the last).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from .parallel.pipeline.schedules import KINDS, notes
from .parallel.pipeline.timeline import Timeline, step_bubbles, theoretical_bubble


def _cost(text: str) -> float:
    """An argparse type: a finite time > 0 (a zero or negative cost makes the simulated
    bubble meaningless, e.g. 100%)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text} must be a positive time (e.g. 1 or 2)")
    return value


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the ``trace`` sub-command."""
    p = subparsers.add_parser(
        "trace", help="draw a pipeline schedule or a recorded run (PNG or SVG)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # Defaults None, filled in by run(): a recorded run must see which of these were given.
    p.add_argument("--schedule", choices=KINDS, help="pipeline schedule (default: 1f1b)")
    p.add_argument("--pp", type=int, help="pipeline stages (default: 4)")
    p.add_argument("--microbatches", type=int, help="microbatches per step (default: 8)")
    p.add_argument("--virtual-stages", type=int,
                   help="chunks per rank, for --schedule interleaved (zbv, dualpipev: 2) "
                        "(default: 1)")
    p.add_argument("--f-cost", type=_cost, help="time of a forward, > 0 (default: 1)")
    p.add_argument("--b-cost", type=_cost,
                   help="time of a backward, > 0 (default: 1; 2 is closer to real models)")
    p.add_argument("--run", metavar="TIMELINE.json",
                   help="draw this recorded run instead of simulating a schedule")
    p.add_argument("--step", type=int, default=None,
                   help="with --run: which recorded step to draw, numbered from 1 as the "
                        "printout numbers them (default: the last)")
    p.add_argument("--out", default="schedule.png",
                   help="output file, .png or .svg (default: schedule.png)")
    p.set_defaults(func=run)
    return p


SCHEDULE_DEFAULTS = {"schedule": "1f1b", "pp": 4, "microbatches": 8, "virtual_stages": 1,
                     "f_cost": 1.0, "b_cost": 1.0}
"""The flags that describe a simulated schedule, and their values when not given."""

MAX_TASKS = 100_000
"""Forward and backward boxes of a simulated schedule worth drawing (pp x m x v)."""


def run(args: argparse.Namespace) -> int:
    from .trace import RenderError, render_schedule, render_timeline

    # A bad schedule raises ScheduleError, a LayoutError: cli.main prints it like any other.
    try:
        if not Path(args.out).resolve().parent.is_dir():
            raise RenderError(f"--out {args.out}: the directory {Path(args.out).parent} does not exist")
        if args.step is not None and not args.run:
            raise RenderError(f"--step {args.step} picks a step of a recorded run: give --run "
                              f"TIMELINE.json too (a simulated schedule has one step)")
        if args.run:
            _refuse_schedule_flags(args)
            _trace_run(args, render_timeline)
        else:
            for name, value in SCHEDULE_DEFAULTS.items():
                if getattr(args, name) is None:
                    setattr(args, name, value)
            _trace_schedule(args, render_schedule)
    except RenderError as exc:
        print(f"paratrain trace: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


def _refuse_schedule_flags(args: argparse.Namespace) -> None:
    """A recorded run has its own schedule, stages and microbatches: a flag describing a
    simulated one would be ignored, and the picture not be what the user asked for."""
    from .trace import RenderError

    given = ["--" + name.replace("_", "-") for name in SCHEDULE_DEFAULTS
             if getattr(args, name) is not None]
    if given:
        verb = "describes" if len(given) == 1 else "describe"
        raise RenderError(f"{', '.join(given)} {verb} a simulated schedule; --run {args.run} draws "
                          f"the recorded one, whose schedule, stages and microbatches the file holds: "
                          f"leave {', '.join(given)} out, or leave --run out to simulate")


def _trace_schedule(args: argparse.Namespace, render_schedule) -> None:
    p, m, v = args.pp, args.microbatches, args.virtual_stages
    if p * m * v > MAX_TASKS:
        from .trace import RenderError

        raise RenderError(f"--pp {p} x --microbatches {m} x --virtual-stages {v} = {p * m * v:,} "
                          f"boxes to draw, more than {MAX_TASKS:,} (no one could read them); "
                          f"lower --pp or --microbatches")
    sim = render_schedule(args.schedule, p, m, v, args.out, args.f_cost, args.b_cost)
    theory = theoretical_bubble(p, m, v)
    print(f"schedule {args.schedule}: pp={p}, microbatches={m}, virtual stages={v}; "
          f"forward {args.f_cost:g}, backward {args.b_cost:g}")
    if args.schedule == "zbh1":  # Qi et al.: (p - 1)(F + B - W), W half the backward
        idle = (p - 1) * args.f_cost
        formula = f"(p-1)(F+B-W)/(m(F+B+W)+(p-1)(F+B-W)) = {idle / (m * (args.f_cost + args.b_cost) + idle):.2%}"
    else:
        formula = f"(p-1)/(v*m+p-1) = {theory:.2%}" + (
            " (1F1B's; W fills part of it)" if args.schedule in ("zbv", "dualpipev") else "")
    print(f"bubble      simulated {sim.bubble:.2%}   theory {formula}")
    print("in flight   peak microbatches per rank: "
          + " ".join(f"{x:g}" for x in sim.peak_inflight))
    for note in notes(args.schedule, p, m, v):
        print(f"note        {note}")


def _trace_run(args: argparse.Namespace, render_timeline) -> None:
    from .trace import RenderError, step_index

    try:
        timeline = Timeline.load(args.run)
    except OSError as exc:
        raise RenderError(f"--run {args.run}: {exc.strerror or exc}") from None
    except (ValueError, TypeError, KeyError) as exc:  # a file that is not a timeline
        raise RenderError(f"--run {args.run}: not a timeline paratrain wrote ({exc})") from None
    drawn = step_index(timeline, args.step) + 1  # checks --step before any drawing
    render_timeline(timeline, args.out, drawn)
    steps = step_index(timeline, None) + 1  # the count --step is checked against
    skip = 1 if steps > 1 else 0
    per_rank = " ".join(f"{b:.2%}" for b in timeline.bubbles(skip))
    drawn_ranks = " ".join(f"{b:.2%}" for b in step_bubbles(timeline.step(drawn - 1)))
    print(f"recorded run: {timeline.schedule}, pp={timeline.stages}, "
          f"microbatches={timeline.microbatches}, virtual stages={timeline.chunks}, {steps} steps; "
          f"drawing step {drawn}")
    # Two figures, named: the mean the run is judged by, and the drawn step's (the title's).
    print("bubble      each rank's idle share of the pipeline's step (all ranks on one clock)")
    print(f"            mean of steps {skip + 1}..{steps}: {timeline.bubble(skip):.2%} (per rank "
          f"{per_rank})   theory (p-1)/(v*m+p-1) = {timeline.theory:.2%}")
    print(f"            step {drawn}, drawn: per rank {drawn_ranks}")
    shares = timeline.breakdown(skip)
    print(f"step        compute {shares['compute']:.1%}, waiting for transfers "
          f"{shares['wait']:.1%}, posting them {shares['post']:.1%}, other {shares['other']:.1%}")
