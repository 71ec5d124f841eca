"""paratrain: train a model under any parallel layout, plan the layout before launch, measure collectives, trace pipeline schedules."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import signal
import sys
import textwrap
from functools import lru_cache

from . import __version__
from .errors import RunError
from .layout import LayoutError
from .models.gpt import PRESETS, GPTConfig
from .train.config import SECTIONS, ConfigError


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


def add_dataclass_flags(parser: argparse.ArgumentParser, cls: type, title: str) -> list[str]:
    """One ``--field-name`` flag per field of ``cls``; returns the field names.

    Defaults are suppressed so that only flags the user gave override the config file.
    """
    group = parser.add_argument_group(title)
    docs = field_docs(cls)
    names = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else None
        kind = type(default)
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{docs.get(f.name, '')} (default: {default!r})"
        if kind is bool:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=help_text)
        else:
            group.add_argument(flag, dest=f.name, type=kind, default=argparse.SUPPRESS,
                               metavar=f.name.upper(), help=help_text)
        names.append(f.name)
    return names


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a model under any layout",
                       description="Train a GPT with several processes. With no arguments: the "
                                   "small GPT on the bundled corpus, 2 CPU processes (dp=2).")
    p.add_argument("--config", metavar="FILE.toml", help="read settings from a TOML file "
                   "(flags override it)")
    p.add_argument("--model", dest="preset", default=argparse.SUPPRESS, choices=sorted(PRESETS),
                   help="model preset (default: small)")
    fields = add_dataclass_flags(p, GPTConfig, "model (override the preset)")
    for title, cls in SECTIONS.items():
        fields += add_dataclass_flags(p, cls, title)
    p.set_defaults(func=_run_train, config_fields=["preset", *fields])


def _run_train(args: argparse.Namespace) -> int:
    from .launch import RankFailed, spawn, torchrun_world
    from .train import config as config_mod
    from .train.checkpoint import verify
    from .train.rundir import RunDirLock
    from .train.worker import run_worker

    overrides = {k: getattr(args, k) for k in args.config_fields if hasattr(args, k)}
    cfg = config_mod.load(args.config, overrides)
    world = torchrun_world(cfg.parallel.backend, cfg.parallel.timeout_s)
    if world is not None:  # started by torchrun: this process is one rank of its world
        cfg.parallel.nproc = cfg.parallel.nproc or world.world_size
        cfg.validate()
        if cfg.parallel.nproc != world.world_size:
            raise ConfigError(f"torchrun started {world.world_size} processes but the layout "
                              f"needs {cfg.parallel.nproc}")
        run_worker(cfg, world)
        return 0
    cfg.validate()
    if cfg.train.resume:
        verify(cfg.train.resume, cfg.model)  # every tensor's checksum, before any rank starts
    previous = signal.signal(signal.SIGTERM, _terminated)  # the launcher's cleanup runs on SIGTERM too
    try:
        with RunDirLock(cfg):
            spawn(run_worker, cfg.parallel.nproc, cfg, None, backend=cfg.parallel.backend,
                  timeout_s=cfg.parallel.max_time_s or None, collective_timeout_s=cfg.parallel.timeout_s)
    except RankFailed as exc:
        print(f"paratrain train: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


def _terminated(signum, frame) -> None:
    raise KeyboardInterrupt("SIGTERM")


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="paratrain", description=__doc__)
    parser.add_argument("--version", action="version", version=f"paratrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_train(sub)
    _add_plan(sub)
    _add_bench(sub)
    _add_trace(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, LayoutError, FileNotFoundError, RunError) as exc:
        print(f"paratrain {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # one line, not a traceback; every rank was stopped
        terminated = bool(exc.args)
        print(f"paratrain {args.command}: {'terminated (SIGTERM)' if terminated else 'interrupted (Ctrl-C)'}; "
              f"stopped", file=sys.stderr)
        return 143 if terminated else 130
