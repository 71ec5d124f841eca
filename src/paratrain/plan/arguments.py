"""``paratrain plan``'s flags, their defaults, and the checks made on them before any
work is done (``plan.cli`` runs the command)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from .candidate import OPTIMIZERS, PRECISIONS, RECOMPUTE
from .hardware import GPUS
from .models import LOCAL_PRESETS, PRESETS
from .moe import IMBALANCE_HELP as MOE_IMBALANCE_HELP
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


def register(subparsers) -> argparse.ArgumentParser:
    """Add ``plan`` and its flags to ``subparsers`` (from ``ArgumentParser.add_subparsers``)."""
    p = subparsers.add_parser(
        "plan", help="recommend a layout; predict per-rank memory and step time",
        description="Enumerate every valid dp x tp x pp x cp x ZeRO layout (with schedule, "
                    "microbatch and recompute), drop those that do not fit memory, and rank "
                    "the rest by predicted step time.")
    models = ", ".join([*PRESETS, *LOCAL_PRESETS])
    p.add_argument("--model",
                   help=f"preset ({models}), a .toml model config, or a Hugging Face "
                        "config.json (or its directory); required unless only calibrating")
    _cluster_flags(p.add_argument_group("cluster"))
    _training_flags(p.add_argument_group("training"))
    _output_flags(p.add_argument_group("output"))
    return p


def _cluster_flags(cl) -> None:
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


def _training_flags(tr) -> None:
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


def _output_flags(out) -> None:
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
