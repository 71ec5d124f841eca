"""``paratrain plan``: rank every layout of a model on a cluster by predicted step time.

Registered on the main parser's sub-commands by ``add_parser``; ``run`` does the work.
The planner is arithmetic; torch comes in only through paratrain's own model presets.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from .candidate import OPTIMIZERS, PRECISIONS, RECOMPUTE, Training
from .hardware import GB, GPUS, Cluster, gpu_preset, load_calibration, local_cluster
from .mla import check_cluster
from .models import LOCAL_PRESETS, PRESETS, ModelSpec, load_model
from .moe import IMBALANCE_HELP as MOE_IMBALANCE_HELP
from . import runtimes
from .runtimes import DEFAULT_RUNTIME, RUNTIMES

DEFAULT_TOKENS = {"gpu": 2**22, "local": 2**13}
"""Tokens per step when --global-batch is not given: ~4M on GPUs (what Llama 3 and
GPT-3 started with), 8K for CPU processes."""
DEFAULT_GPU = "h100-80g"
DEFAULT_TOP = 5
DEFAULT_SEQ_CAP = 8192
"""--seq-len when not given: the model's context, at most 8K, the length Llama 3 and most
published runs pre-train at (long contexts are a later phase, asked for by --seq-len)."""
PLOT_FORMATS = (".png", ".svg", ".pdf")
DEFAULT_GPUS_PER_NODE = 8
GPU_CLUSTER_FLAGS = ("gpu", "nodes", "gpus_per_node", "intra_bw", "inter_bw")
"""Flags that describe GPUs; a local cluster's rates and memory come from its calibration.
They default to None (the defaults above apply later) so that giving one can be told
apart from leaving it out."""


def add_parser(subparsers) -> None:
    """Register ``plan`` on ``subparsers`` (from ``ArgumentParser.add_subparsers``)."""
    p = subparsers.add_parser(
        "plan", help="recommend a layout; predict per-rank memory and step time",
        description="Enumerate every valid dp x tp x pp x cp x ZeRO layout (with schedule, "
                    "microbatch and recompute), drop those that do not fit memory, and rank "
                    "the rest by predicted step time.")
    models = ", ".join([*PRESETS, *LOCAL_PRESETS])
    p.add_argument("--model",
                   help=f"preset ({models}), a .toml model config, or a Hugging Face "
                        "config.json (or its directory); required unless only calibrating")
    cl = p.add_argument_group("cluster")
    cl.add_argument("--cluster", choices=("gpu", "local"), default="gpu",
                    help="gpu presets, or CPU processes on this machine (needs a calibration)")
    cl.add_argument("--gpu", choices=list(GPUS), help="accelerator preset (default h100-80g)")
    cl.add_argument("--gpus", type=int, help="ranks in the job (default: one node)")
    cl.add_argument("--nodes", type=int, help="nodes (alternative to --gpus)")
    cl.add_argument("--gpus-per-node", type=int, help="GPUs in one node (default 8)")
    cl.add_argument("--intra-bw", type=float, metavar="GB/s",
                    help="bus bandwidth per GPU inside a node (nccl-tests busbw)")
    cl.add_argument("--inter-bw", type=float, metavar="GB/s",
                    help="bus bandwidth per GPU across nodes (its NIC)")
    cl.add_argument("--calibration", metavar="FILE",
                    help="calibration for --cluster local (default "
                         "~/.cache/paratrain/calibration.json)")
    cl.add_argument("--calibrate", action="store_true",
                    help="first measure this machine (matmul rates, eager-model efficiency, "
                         "AdamW rate, α and β of gloo's collectives with 2 and 4 processes; "
                         "a few minutes on 2 cores, with progress) and write the calibration "
                         "file --cluster local reads")
    tr = p.add_argument_group("training")
    tr.add_argument("--global-batch", type=int,
                    help="sequences per step (default: ~4M tokens on GPUs, 8K locally)")
    tr.add_argument("--seq-len", type=int,
                    help=f"tokens per sequence (default: the model's context, at most {DEFAULT_SEQ_CAP})")
    tr.add_argument("--micro-batch", default="search", help="sequences per microbatch, or search")
    tr.add_argument("--precision", choices=PRECISIONS,
                    help="default bf16 on GPUs, fp32 for --cluster local")
    tr.add_argument("--optimizer", choices=OPTIMIZERS, default="adam",
                    help="whose state is counted: adam (AdamW: an fp32 master copy and two "
                         "fp32 moments per parameter) or sgd (SGD with momentum: one); default adam")
    tr.add_argument("--recompute", choices=(*RECOMPUTE, "search"), default="search")
    tr.add_argument("--moe-imbalance", type=float, default=1.0, metavar="F", help=MOE_IMBALANCE_HELP)
    out = p.add_argument_group("output")
    out.add_argument("--top", type=int, metavar="N", help=f"plans to show (default {DEFAULT_TOP})")
    out.add_argument("--within", type=float, metavar="F",
                     help="rank only the plans within F times the fastest step (1.25: up to "
                          "25%% slower), skipping what a lower bound shows cannot come that "
                          "close: the same plans in that range, several times faster on "
                          "thousands of GPUs (default: rank every plan that fits)")
    out.add_argument("--explain", action="store_true", help="why the winner wins")
    out.add_argument("--show-rejected", action="store_true", help="why layouts were dropped")
    out.add_argument("--json", action="store_true", help="machine-readable output")
    out.add_argument("--layout", metavar="SPEC",
                     help="evaluate one layout, e.g. 'dp8 tp8 pp4 v2 zero1 mb1 "
                          "recompute=selective' (any subset; the rest is searched): its full "
                          "breakdown even if it does not fit, why, and its rank")
    out.add_argument("--compare", nargs="+", metavar="SPEC",
                     help="evaluate several layouts side by side (same syntax as --layout)")
    out.add_argument("--plot", metavar="FILE.png",
                     help="memory and time breakdown chart of the top plans (with --layout or "
                          "--compare: of the layouts given)")
    out.add_argument("--out", metavar="FILE.toml",
                     help="write the winner (with --layout: that layout) as a train config")
    out.add_argument("--runtime", choices=list(RUNTIMES), default=DEFAULT_RUNTIME,
                     help="the trainer the plan is for: the search proposes only what it "
                          "runs, timed at its measured speed; --emit writes its config "
                          "(default paratrain)")
    out.add_argument("--eager", action="store_true",
                     help="time --runtime's eager step (default: compiled, as train "
                          "--compile and torchtitan's training.compile run it)")
    out.add_argument("--emit", metavar="FILE",
                     help="write the winner (with --layout: that layout) as --runtime's own "
                          "config: torchtitan job TOML, Megatron-LM arguments, DeepSpeed JSON "
                          "(paratrain: as --out)")
    p.set_defaults(func=run)


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


MAX_GPUS = 2**20
"""The largest cluster plan searches: above any built, below where a search takes minutes."""

POSITIVE_ARGS = ("gpus", "nodes", "gpus_per_node", "global_batch", "seq_len", "top",
                 "intra_bw", "inter_bw")
"""Numeric arguments that must be above 0 when given (None: not given, a default applies)."""


def check_args(args: argparse.Namespace) -> None:
    """Refuse numeric arguments out of range (argparse has checked their types): a 0 must
    not silently mean "the default"."""
    for name in POSITIVE_ARGS:
        value = getattr(args, name, None)
        if value is not None and not (math.isfinite(value) and value > 0):
            flag = "--" + name.replace("_", "-")
            kind = "integer" if isinstance(value, int) else "number"
            raise ValueError(f"{flag} must be a positive {kind}, got {value}; leave {flag} "
                             f"out for the default")
    for flag, path in (("--out", args.out), ("--plot", args.plot), ("--emit", args.emit)):
        if path and not Path(path).resolve().parent.is_dir():
            raise ValueError(f"{flag} {path}: the directory {Path(path).parent} does not exist")
        if path and Path(path).is_dir():
            raise ValueError(f"{flag} {path}: a directory; give a file name")
    if args.within is not None and not (math.isfinite(args.within) and args.within >= 1):
        raise ValueError(f"--within must be a factor of at least 1 (1.25: plans up to 25% "
                         f"slower than the fastest), got {args.within}")
    if args.plot and Path(args.plot).suffix.lower() not in PLOT_FORMATS:
        raise ValueError(f"--plot {args.plot}: name a {', '.join(PLOT_FORMATS)} file (the format "
                         f"follows the extension)")
    check_combinations(args)


def check_combinations(args: argparse.Namespace) -> None:
    """Refuse flags that contradict each other, or that the rest of the command would
    silently ignore, before any work is done."""
    given = [("--layout", t) for t in ([args.layout] if args.layout is not None else [])]
    blank = [flag for flag, t in given + [("--compare", t) for t in args.compare or []] if not t.strip()]
    if blank:  # --layout "" printed the whole ranking, as if no layout had been given
        raise ValueError(f"{blank[0]}: an empty layout; write e.g. 'dp8 tp8 pp4 zero1 mb1' "
                         f"(any subset), or drop {blank[0]} to see the ranking")
    if args.layout and args.compare:
        raise ValueError("--layout and --compare both given: --layout evaluates one layout, "
                         "--compare several side by side; put every layout after --compare "
                         "(--compare 'A' 'B')")
    ignored = [flag for flag, given in (("--top", args.top is not None), ("--explain", args.explain),
                                        ("--show-rejected", args.show_rejected)) if given]
    if (args.layout or args.compare) and ignored:
        raise ValueError(f"{', '.join(ignored)} shape{'s' if len(ignored) == 1 else ''} the "
                         f"search's table, which --layout and --compare do not print; drop "
                         f"{', '.join(ignored)}, or drop --layout/--compare to see the ranking")
    if args.compare and args.emit:
        raise ValueError("--emit writes one layout and --compare gives several; pass the one "
                         "to write as --layout SPEC, or drop --compare to write the winner")
    if args.compare and args.out:
        raise ValueError("--out writes one layout as a train config and --compare gives "
                         "several; pass the one to write as --layout SPEC, or drop --compare "
                         "to write the winner")
    if args.cluster == "local":
        given = ["--" + name.replace("_", "-") for name in GPU_CLUSTER_FLAGS
                 if getattr(args, name) is not None]
        if given:
            raise ValueError(f"{', '.join(given)}: describe{'s' if len(given) == 1 else ''} "
                             f"a GPU cluster, but --cluster local plans CPU processes on this "
                             f"machine, whose rates and memory come from its calibration "
                             f"(--calibration FILE); drop {', '.join(given)} or use "
                             f"--cluster gpu")
    elif args.calibration and not args.calibrate:
        raise ValueError("--calibration is read by --cluster local only; add --cluster local, "
                         "or drop --calibration (with --calibrate it names the file written)")


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
