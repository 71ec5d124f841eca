"""paratrain: train a model under any parallel layout, plan the layout before launch, measure collectives, trace pipeline schedules."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import os
import signal
import sys
import textwrap
import time
from functools import lru_cache

from . import __version__
from . import console
from .errors import RunError
from .layout import LayoutError
from .models.gpt import PRESETS, GPTConfig
from .data.prepare import DataError
from .models.hf import HFModelError
from .train import schema
from .train.config import SECTIONS, Config, ConfigError
from .train.task import task_sections

log = console.get(__name__)
DEFAULT_PRESET = Config.model_preset
"""The model ``paratrain train`` builds when no preset is named."""


@lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a dataclass."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, following in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant) and isinstance(following.value.value, str)):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def add_dataclass_flags(parser: argparse.ArgumentParser, cls: type, title: str,
                        defaults: object = None) -> list[str]:
    """One ``--field-name`` flag per field of ``cls``; returns the field names.

    The flag's type and choices come from the field's annotation (``schema``), and its help
    shows the default (read from ``defaults``, an instance, when given: a preset's values)
    and the range. Defaults are suppressed so that only flags the user gave override the
    config file.
    """
    group = parser.add_argument_group(title)
    docs = field_docs(cls)
    kinds = schema.hints(cls)
    names = []
    for f in dataclasses.fields(cls):
        default = (getattr(defaults, f.name) if defaults is not None
                   else f.default if f.default is not dataclasses.MISSING else None)
        options = schema.choices(kinds[f.name])
        kind = _flag_kind(kinds[f.name], options, default)
        flag = "--" + f.name.replace("_", "-")
        limits = f"; {schema.describe_limits(f.name)}" if kind in (int, float) and not options else ""
        # argparse %-formats help strings: a literal % in a docstring must be doubled.
        help_text = f"{docs.get(f.name, '')} (default: {default!r}{limits})".replace("%", "%%")
        if kind is bool:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=help_text)
        else:
            group.add_argument(flag, dest=f.name, type=_parse(kind), default=argparse.SUPPRESS,
                               choices=options, metavar=f.name.upper() if not options else None,
                               help=help_text)
        names.append(f.name)
    return names


def _flag_kind(annotation, options: tuple | None, default) -> type:
    """The Python type a flag's text converts to: the choices' type, the annotated type,
    else (an annotation argparse cannot use) the default's type."""
    if options:
        return type(options[0])
    return annotation if isinstance(annotation, type) else type(default)


def _parse(kind: type):
    """``kind`` as an argparse type whose error names what was expected."""
    if kind not in (int, float):
        return kind

    def parse(text: str):
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, "
                                             f"got {text!r}") from None
    parse.__name__ = kind.__name__
    return parse




def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a model under any layout",
                       description="Train a GPT with several processes. With no arguments: the "
                                   "small GPT on the bundled corpus, 2 CPU processes (dp=2).")
    p.add_argument("--config", metavar="FILE.toml", help="read settings from a TOML file "
                   "(flags override it)")
    p.add_argument("--model", dest="preset", default=argparse.SUPPRESS, metavar="PRESET|DIR",
                   help=f"model preset ({', '.join(sorted(PRESETS))}; default: {DEFAULT_PRESET}) or "
                        f"a local Hugging Face Llama/Mistral/Qwen2 directory, whose weights are loaded")
    fields = add_dataclass_flags(p, GPTConfig, f"model (override the preset's fields; the defaults "
                                 f"shown are the {DEFAULT_PRESET} preset's; a Hugging Face --model "
                                 f"DIR fixes all but max_seq_len and init_std)", PRESETS[DEFAULT_PRESET])
    titles = {name: title for name, (_, title) in task_sections().items()}  # a task's own table
    for name, cls in SECTIONS.items():
        fields += add_dataclass_flags(p, cls, titles.get(name, name))
    p.set_defaults(func=_run_train, config_fields=["preset", *fields])


def _run_train(args: argparse.Namespace) -> int:
    from .launch import RankFailed, spawn, torchrun_world
    from .slurm import slurm_world, started_by_srun
    from .train import config as config_mod
    from .train import runs, saved
    from .train.checkpoint import verify
    from .train.rundir import RunDirLock
    from .train.preempt import EXIT_PREEMPTED
    from .train.worker import run_worker, started_by_torchrun

    overrides = {k: getattr(args, k) for k in args.config_fields if hasattr(args, k)}
    cfg = config_mod.load(args.config, overrides)
    console.configure(cfg.train.quiet)
    if started_by_torchrun(os.environ) or started_by_srun(os.environ):  # one rank of a world
        world = (torchrun_world(cfg.parallel.backend, cfg.parallel.timeout_s)  # made by torchrun,
                 or slurm_world(os.environ, cfg.parallel.backend, cfg.parallel.timeout_s))  # or srun
        cfg = _preflight(_torchrun_config(cfg, world.world_size), torchrun=True,
                         report=world.rank == 0, local_ranks=world.local_world_size)
        return EXIT_PREEMPTED if run_worker(cfg, world) else 0
    cfg = cfg.validate()
    cfg = _preflight(cfg, torchrun=False, report=True, local_ranks=cfg.parallel.nproc)
    if cfg.train.resume not in ("", *runs.RESUME_CHOICES):  # every tensor's checksum, before any rank starts
        verify(cfg.train.resume, runs.model_config(cfg))
    cfg = runs.place_and_print(cfg, torchrun=False)
    preempt = _Preempt()
    previous = {sig: signal.signal(sig, preempt) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    start = time.perf_counter()
    try:
        with RunDirLock(cfg):
            runs.record(cfg)
            stopped = spawn(run_worker, cfg.parallel.nproc, cfg, None, backend=cfg.parallel.backend,
                            timeout_s=cfg.parallel.max_time_s or None,
                            collective_timeout_s=cfg.parallel.timeout_s,
                            scratch=cfg.train.run_dir)  # the run owns its launcher's files: no /tmp to lose
    except RankFailed as exc:
        print(f"paratrain train: {exc}", file=sys.stderr)
        print(f"paratrain train: {saved.how_to_resume(cfg)}", file=sys.stderr)
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    log.info(f"wall time     {time.perf_counter() - start:.1f} s with process start-up and teardown")
    if any(stopped or ()):  # the step each rank was preempted after, if any
        print(f"paratrain train: preempted after step {max(stopped)}; {saved.how_to_resume(cfg)}",
              file=sys.stderr)
        return EXIT_PREEMPTED
    return 0


class _Preempt:
    """The launcher's SIGTERM or SIGUSR1 (a scheduler preempting the job): the first is
    passed to the ranks, which save after their step and end resumable
    (train/preempt.py); the second stops them at once, as Ctrl-C does."""

    def __init__(self):
        self.calls = 0

    def __call__(self, signum, frame) -> None:
        self.calls += 1
        import multiprocessing

        ranks = multiprocessing.active_children()
        if self.calls > 1 or not ranks:
            raise KeyboardInterrupt("SIGTERM")
        print(f"paratrain train: {signal.Signals(signum).name}: the ranks save after this step and "
              f"stop (send it again to stop at once)", file=sys.stderr)
        for process in ranks:
            os.kill(process.pid, signal.SIGTERM)


def _torchrun_config(cfg: Config, world_size: int) -> Config:
    """The config validated for the world torchrun started (its size is not ours to set)."""
    if cfg.parallel.nproc and cfg.parallel.nproc != world_size:
        raise ConfigError(f"parallel.nproc={cfg.parallel.nproc}, but torchrun (or srun) started "
                          f"{world_size} processes; under torchrun leave --nproc out: "
                          f"torchrun's --nnodes x --nproc-per-node set the world (srun's --ntasks)")
    parallel = dataclasses.replace(cfg.parallel, nproc=world_size)
    return dataclasses.replace(cfg, parallel=parallel).validate(launcher="torchrun")


def _preflight(cfg: Config, *, torchrun: bool, report: bool, local_ranks: int) -> Config:
    """The config checked against this machine, its memory and the data; ``report``:
    print advice."""
    from .train import preflight

    preflight.check_machine(cfg, torchrun)
    preflight.check_memory(cfg, local_ranks)
    preflight.check_data(cfg)
    preflight.check_weights(cfg)
    for note in preflight.advice(cfg) if report else ():
        log.warning(f"paratrain train: warning: {note}")
    return cfg


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from .bench import comm

    p = sub.add_parser("bench", help="measure collectives and strategies")
    comm.add_parser(p.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK"))


def _add_plan(sub: argparse._SubParsersAction) -> None:
    from .plan import cli as plan_cli

    plan_cli.add_parser(sub)


def _add_trace(sub: argparse._SubParsersAction) -> None:
    from . import trace_cli

    trace_cli.add_parser(sub)


def _add_report(sub: argparse._SubParsersAction) -> None:
    from . import report

    report.add_parser(sub)


def _add_data(sub: argparse._SubParsersAction) -> None:
    from .data import cli as data_cli

    data_cli.add_parser(sub)


def _add_export(sub: argparse._SubParsersAction) -> None:
    from . import export

    export.add_parser(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="paratrain", description=__doc__)
    parser.add_argument("--version", action="version", version=f"paratrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_train(sub)
    _add_plan(sub)
    _add_bench(sub)
    _add_trace(sub)
    _add_report(sub)
    _add_data(sub)
    _add_export(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
        sys.stdout.flush()  # a reader gone away (`| head`) shows here, not at interpreter exit
        return code
    except BrokenPipeError:
        return _stdout_closed()
    except (ConfigError, LayoutError, FileNotFoundError, DataError, HFModelError, RunError) as exc:
        print(f"paratrain {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # one line, not a traceback; every rank was stopped
        terminated = bool(exc.args)
        print(f"paratrain {args.command}: {'terminated (SIGTERM)' if terminated else 'interrupted (Ctrl-C)'}; "
              f"stopped", file=sys.stderr)
        return 143 if terminated else 130


def _stdout_closed() -> int:
    """The reader of stdout went away (``paratrain plan --json | head``): stop quietly,
    with the status of a command killed by SIGPIPE, as a shell reports it. Python flushes
    stdout again at exit; pointing it at /dev/null keeps that flush from printing an error."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):  # stdout has no file descriptor (captured, or closed)
        pass
    return 141  # 128 + SIGPIPE (13)
