"""``paratrain plan``: rank every layout of a model on a cluster by predicted step time.

Registered on the main parser's sub-commands by ``add_parser`` (its flags and their
checks: ``plan.arguments``); ``run`` does the work.
The planner is arithmetic; torch comes in only through paratrain's own model presets.
"""

from __future__ import annotations

import argparse
import json
import sys

from .candidate import Training
from .hardware import GB, Cluster, gpu_preset, load_calibration, local_cluster
from .mla import check_cluster
from .models import ModelSpec, load_model
from . import runtimes
from .runtimes import DEFAULT_RUNTIME, RUNTIMES

from .arguments import (DEFAULT_GPU, DEFAULT_GPUS_PER_NODE, DEFAULT_SEQ_CAP, DEFAULT_TOKENS,
                        DEFAULT_TOP, MAX_GPUS, check_args, register)


def add_parser(subparsers) -> None:
    """Register ``plan`` on ``subparsers`` (from ``ArgumentParser.add_subparsers``)."""
    register(subparsers).set_defaults(func=run)


def build_cluster(args: argparse.Namespace) -> Cluster:
    """The cluster the flags describe."""
    if args.cluster == "local":
        calibration = load_calibration(args.calibration)
        return local_cluster(args.gpus or calibration.cores, calibration)
    per_node = args.gpus_per_node or DEFAULT_GPUS_PER_NODE
    gpus = args.gpus or (args.nodes or 1) * per_node
    if gpus > MAX_GPUS:  # the search grows with the divisors: minutes, then a failure
        raise ValueError(f"--gpus {gpus:,} is more than the {MAX_GPUS:,} GPUs plan searches (the "
                         f"largest training runs use ~10^5); give the job's GPU count")
    if args.gpus and args.nodes and args.gpus != args.nodes * per_node:
        raise ValueError(f"--gpus {args.gpus} disagrees with --nodes {args.nodes} x "
                         f"--gpus-per-node {per_node}")
    return Cluster(gpu_preset(args.gpu or DEFAULT_GPU), gpus, per_node,
                   intra_bw=args.intra_bw * GB if args.intra_bw else None,
                   inter_bw=args.inter_bw * GB if args.inter_bw else None)


def build_training(args: argparse.Namespace, model: ModelSpec, cluster: Cluster) -> Training:
    seq = args.seq_len or min(model.max_seq_len, DEFAULT_SEQ_CAP)
    batch = args.global_batch or max(1, DEFAULT_TOKENS[cluster.kind] // seq)
    precision = args.precision or ("fp32" if cluster.kind == "local" else "bf16")
    return Training(batch, seq, precision, args.optimizer, moe_imbalance=args.moe_imbalance,
                    rank_order=RUNTIMES[args.runtime].rank_order,
                    speed=runtimes.speed(args.runtime, args.eager, cluster.kind))


def _micro_batch(value: str) -> int | None:
    if value == "search":
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"--micro-batch must be a positive integer or 'search', got {value!r}")
    return int(value)


def run(args: argparse.Namespace) -> int:
    """Search and print; 0 on success, 1 if nothing fits, 2 on bad input."""
    from .search import search

    log = sys.stderr if args.json else sys.stdout  # keep stdout parseable
    try:
        check_args(args)  # first: a contradiction must not cost a minute of calibrating
    except ValueError as err:
        print(f"paratrain plan: error: {err}", file=sys.stderr)
        return 2
    if args.calibrate:
        code = _calibrate(args.calibration, log)
        if code or not args.model:
            return code
    try:
        if not args.model:
            raise ValueError("--model is required (a preset, a .toml or a config.json); "
                             "only --calibrate runs without one")
        model = load_model(args.model)
        cluster = build_cluster(args)
        training = build_training(args, model, cluster)
        micro = _micro_batch(args.micro_batch)
        check_cluster(model, cluster.kind)
    except (ValueError, OSError) as err:
        print(f"paratrain plan: error: {err}", file=sys.stderr)
        return 2
    recompute = None if args.recompute == "search" else args.recompute
    rt = RUNTIMES[args.runtime]
    result = runtimes.restrict(search(model, training, cluster, micro_batch=micro,
                                      recompute=recompute, within=args.within,
                                      refuse=runtimes.refuser(rt, model, training),
                                      **runtimes.search_options(rt)),
                               rt, model, training)
    if args.layout or args.compare:
        return _evaluate(args, result, model, training, cluster, log, micro, recompute)
    _print_search(args, result, model, training, cluster)
    if not result.plans:
        print("paratrain plan: no layout fits; see the rejections above", file=sys.stderr)
        _suggest_batches(model, training, cluster, micro, recompute, result)
        return 1
    if args.out and _write_out(args.out, result, model, training, cluster, log):
        return 2
    if args.emit and _emit(args, result, model, training, cluster, log, micro, recompute):
        return 2
    if args.plot and _plot(args.plot, result.plans[:args.top or DEFAULT_TOP], model, cluster, log):
        return 2
    return 0


def _print_search(args: argparse.Namespace, result, model: ModelSpec, training: Training,
                  cluster: Cluster) -> None:
    from . import report

    if args.json:
        data = report.to_json(result, model, training, cluster, args.top or DEFAULT_TOP)
        data["runtime"] = args.runtime
        data["speed"] = training.speed.name
        if args.explain:
            data["explain"] = report.explain(result, cluster, training)
        print(json.dumps(data, indent=2))
        return
    print(report.summary(result, model, training, cluster, args.top or DEFAULT_TOP))
    print(RUNTIMES[args.runtime].line(training.speed))
    if args.explain:
        print("\n" + report.explain(result, cluster, training))
    if args.show_rejected or not result.plans:
        print("\n" + report.rejected(result))


def _plot(path: str, plans: list, model: ModelSpec, cluster: Cluster, log) -> int:
    """``--plot``: the chart of ``plans`` (search plans or evaluated layouts); 2 if it
    cannot be drawn."""
    from . import export

    try:
        export.plot(path, plans, cluster.memory_limit,
                    title=f"{model.name} on {cluster.n_gpus} x {cluster.gpu.name}")
    except RuntimeError as err:
        print(f"paratrain plan: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {path}", file=log)
    return 0


def _runtime_limit(cluster: Cluster) -> float | None:
    """The usable bytes a written plan must also fit as paratrain's runtime holds memory
    (GPU plans are ranked with fused kernels); None on the local cluster, which counts
    paratrain's own runtime already."""
    return cluster.memory_limit if cluster.kind != "local" else None


def _backend(cluster: Cluster) -> str:
    """What ``paratrain train`` runs the plan on: gloo on the local cluster, NCCL on GPUs."""
    return "gloo" if cluster.kind == "local" else "nccl"


def _write_out(path: str, result, model, training, cluster, log) -> int:
    """``--out``: the best plan ``paratrain train`` runs, as its config; 2 if there is none."""
    from . import export

    try:
        chosen = export.trainable(result.plans, model, training, _runtime_limit(cluster),
                                  _backend(cluster))
        export.write_config(path, chosen, model, training, _backend(cluster))
    except ValueError as err:  # no plan is one `paratrain train` runs
        print(f"paratrain plan: error: --out: {err}", file=sys.stderr)
        return 2
    if chosen is not result.plans[0]:
        print(f"--out: plan #{result.plans.index(chosen) + 1} ({chosen.cand.describe()}), the "
              f"best that paratrain train runs and fits as its runtime holds memory", file=log)
    print(f"wrote {path}: run it with `paratrain train --config {path}`\n"
          + export.SCALED_DOWN.replace("THIS", path).replace("\n", " "), file=log)
    return 0


def _emit(args: argparse.Namespace, result, model: ModelSpec, training: Training,
          cluster: Cluster, log, micro: int | None, recompute: str | None, ev=None) -> int:
    """``--emit``: the plan as --runtime's config; 2 (nothing written) where it cannot."""
    from . import emit

    if args.runtime == DEFAULT_RUNTIME:  # paratrain's own config is --out's
        return (_write_layout(args.emit, ev, model, training, cluster, log) if ev
                else _write_out(args.emit, result, model, training, cluster, log))
    err = emit.emit_plan(args.emit, RUNTIMES[args.runtime], result, model, training, cluster,
                         micro, recompute, log, ev)
    if err:
        print(f"paratrain plan: error: --emit --runtime {args.runtime}: {err}", file=sys.stderr)
    return 2 if err else 0


def _calibrate(path: str | None, log) -> int:
    """Measure this machine and write the calibration file; 0 on success, 2 on failure."""
    from ..launch import RankFailed
    from .calibrate import calibrate, write_calibration

    print("paratrain plan: calibrating this machine (one thread per process)", file=log)
    try:
        written = write_calibration(calibrate(log=lambda line: print(line, file=log)), path)
    except (OSError, RankFailed) as err:
        print(f"paratrain plan: error: calibration failed: {err}", file=sys.stderr)
        return 2
    print(f"wrote {written}", file=log)
    return 0


def _evaluate(args: argparse.Namespace, result, model: ModelSpec, training: Training,
              cluster: Cluster, log, micro: int | None, recompute: str | None) -> int:
    """``--layout`` / ``--compare``: 0 if every given layout fits, 1 otherwise, 2 on a
    spec that cannot be read or an ``--out`` / ``--plot`` that cannot be written."""
    from . import report
    from .evaluate import with_search

    specs = [args.layout] if args.layout else list(args.compare)
    try:
        evaluations = with_search(specs, model, training, cluster, result, micro, recompute)
    except ValueError as err:  # the parser names --layout; say the flag the user gave
        flag = "--layout" if args.layout else "--compare"
        print(f"paratrain plan: error: {str(err).replace('--layout', flag, 1)}", file=sys.stderr)
        return 2
    if args.json:
        data = {**report.setting_dict(model, training, cluster),
                "layouts": [report.evaluation_dict(ev) for ev in evaluations],
                "winner": report.plan_dict(result.plans[0]) if result.plans else None,
                "search": {"ranked": len(result.plans), "seconds": result.seconds},
                "runtime": args.runtime}
        print(json.dumps(data, indent=2))
    else:
        print(report.layout_report(evaluations, result, model, training, cluster))
        print(RUNTIMES[args.runtime].line(training.speed))
    if args.out and _write_layout(args.out, evaluations[0], model, training, cluster, log):
        return 2
    if args.emit and _emit(args, result, model, training, cluster, log, micro, recompute,
                           evaluations[0]):
        return 2
    # A layout that cannot be costed has no bars; the others are drawn, fitting or not
    # (the chart's "usable" line shows by how much).
    costed = [ev for ev in evaluations if ev.memory is not None]
    if args.plot and not costed:
        print(f"paratrain plan: error: --plot: no layout given can be costed (see above); "
              f"{args.plot} not written", file=sys.stderr)
        return 2
    if args.plot and _plot(args.plot, costed, model, cluster, log):
        return 2
    return 0 if all(ev.fits for ev in evaluations) else 1


def _write_layout(path: str, ev, model: ModelSpec, training: Training, cluster: Cluster,
                  log) -> int:
    """``--layout SPEC --out FILE``: that layout as a train config; 2 (nothing written)
    if it is rejected or is not one ``paratrain train`` runs."""
    from . import export
    from .results import Plan

    try:
        if not ev.fits:
            raise ValueError(f"{ev.cand.describe()} is rejected ({'; '.join(ev.problems)}); "
                             f"change the layout or drop --layout to write the winner")
        plan = Plan(ev.cand, ev.memory, ev.time, ev.tokens_per_s, ev.mfu)
        export.check_trainable(plan, model, training, _runtime_limit(cluster), _backend(cluster))
        export.write_config(path, plan, model, training, _backend(cluster))
    except ValueError as err:
        print(f"paratrain plan: error: --out: {err}; {path} not written", file=sys.stderr)
        return 2
    print(f"wrote {path}: run it with `paratrain train --config {path}`\n"
          + export.SCALED_DOWN.replace("THIS", path).replace("\n", " "), file=log)
    return 0


def _suggest_batches(model: ModelSpec, training: Training, cluster: Cluster,
                     micro: int | None, recompute: str | None, result) -> None:
    """When nothing fits: the nearest global batches for which a layout does, else why
    none can (memory, or only shapes that do not split over this many ranks)."""
    from .evaluate import nearest_batches

    batches = nearest_batches(model, training, cluster, micro, recompute)
    if batches:
        print(f"paratrain plan: global batch {training.global_batch} has no fitting layout "
              f"on {cluster.n_gpus} ranks; nearest that do: "
              f"{', '.join(map(str, batches))} (--global-batch N)", file=sys.stderr)
    elif not any(r.overflow < float("inf") for r in result.rejected.values()):
        print(f"paratrain plan: no layout of {cluster.n_gpus:,} ranks splits this model and a "
              f"batch near {training.global_batch} (every rejection above is a shape, none is "
              f"memory): use fewer --gpus, or a larger --global-batch", file=sys.stderr)
    else:
        print(f"paratrain plan: no global batch near {training.global_batch} fits either: "
              f"the model needs more or larger devices, or a shorter --seq-len (now "
              f"{training.seq_len:,})", file=sys.stderr)
