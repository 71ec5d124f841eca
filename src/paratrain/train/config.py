"""Training configuration: dataclasses with a docstring per field, read from TOML and flags.

A TOML file has one table per section (``[model]``, ``[parallel]``, ``[data]``,
``[optim]``, ``[train]``); ``[model]`` takes ``preset`` plus any ``GPTConfig`` field to
override (which preset a table without one starts from: ``models.shape_base``). Every field is also a command-line flag (``--d-model``, ``--dp``, ``--lr``...);
flags override the file, which overrides the defaults. Every value is checked against
its field's type and range as it is read (``schema``: types and choices come from the
annotations, ranges from ``schema.LIMITS``); ``Config.validate()`` then checks the
combination and returns a resolved copy, before any process is started.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from .. import rules
from ..comm import compress
from ..layout import Layout, LayoutError, parse_domain
from ..models import hf, shape_base
from ..data.dataset import read_meta
from ..models.gpt import PRESETS, GPTConfig, preset
from ..models.rope import parse_rope_scaling
from . import schema
from .sections import DataConfig, OptimConfig, ParallelConfig, TrainConfig
from .task import load_task, task_names, task_sections

if TYPE_CHECKING:
    from ..parallelize import ParallelOptions

ConfigError = schema.ConfigError  # defined with the checks that raise it; imported from here


CORE = {"parallel": ParallelConfig, "data": DataConfig, "optim": OptimConfig, "train": TrainConfig}
"""The tables every run reads."""
TASK_SECTIONS = {name: cls for name, (cls, _) in task_sections().items()}
"""The tables tasks add (``[NAME]``, read by task NAME only: ``task.task_sections``)."""
SECTIONS = {**CORE, **TASK_SECTIONS}
_SCHEMA = {"model": GPTConfig, **SECTIONS}  # every TOML table and the dataclass it fills

@dataclass
class Config:
    """Everything one training run needs."""

    model: GPTConfig = field(default_factory=lambda: PRESETS["small"])
    """Shape of the model."""
    model_preset: str = "small"
    """Name of the preset the model started from."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    tasks: dict[str, Any] = field(default_factory=lambda: {n: cls() for n, cls in TASK_SECTIONS.items()})
    """Each task's own table (``[NAME]``), by task name; only ``train.task``'s is read."""

    # ---- derived ---------------------------------------------------------------------------
    @property
    def layout(self) -> Layout:
        p = self.parallel
        domh, domw = parse_domain(p.domain)
        return Layout(dp=p.dp, tp=p.tp, pp=p.pp, cp=p.cp, order=p.order, domh=domh, domw=domw, ep=p.ep,
                      shard_group=p.shard_group)

    def describe_model(self) -> str:
        """The preset's name and what the run changed of it, e.g. ``small with d_model=2048,
        n_layers=16``: a preset's name alone would misname a model the flags resized."""
        base = PRESETS.get(self.model_preset)
        if base is None:
            return self.model_preset
        changed = [f"{f.name}={getattr(self.model, f.name)}" for f in dataclasses.fields(base)
                   if getattr(self.model, f.name) != getattr(base, f.name)]
        return f"{self.model_preset} with {', '.join(changed)}" if changed else self.model_preset

    def describe_layout(self) -> str:
        """The layout and the ZeRO stage, e.g. ``dp2xtp2 (world 4), zero1``."""
        zero = f", zero{self.parallel.zero}" if self.parallel.zero else ""
        return self.layout.describe() + zero

    @property
    def reshard_after_forward(self) -> bool:
        """ZeRO-3's choice (``parallel.reshard_after_forward``) resolved for this layout."""
        choice = self.parallel.reshard_after_forward
        return self.parallel.pp == 1 if choice == "auto" else choice == "yes"

    def parallel_options(self) -> "ParallelOptions":
        """What ``parallelize`` reads of this run (and nothing else of it)."""
        from ..parallelize import ParallelOptions

        t = self.train
        return ParallelOptions(self.parallel, self.optim, self.compress_spec, t.precision, t.recompute,
                               self.data.seq_len, self.micro_batch, self.model.d_model,
                               self.reshard_after_forward, t.timeline, t.compile)

    @property
    def compress_spec(self) -> compress.CompressSpec:
        """``parallel.compress`` parsed, with ``compress_start`` resolved (-1: the larger of
        the warm-up and 10% of the steps), undoable when non-finite steps are skipped."""
        p, start = self.parallel, self.parallel.compress_start
        if start < 0:
            start = max(self.optim.warmup_steps, self.train.steps // 10)
        return replace(compress.parse(p.compress), start=start,
                       undoable=self.train.on_nonfinite == "skip")

    @property
    def micro_batch(self) -> int:
        """Sequences per forward/backward on one rank: as given, else the rank's share of
        the global batch split into ``microbatches`` (default 2 x pp under a pipeline)."""
        if self.train.micro_batch:
            return self.train.micro_batch
        p = self.parallel
        parts = p.microbatches or (2 * p.pp if p.pp > 1 else 1)
        return max(1, self.train.global_batch // p.dp // parts)

    @property
    def accumulation(self) -> int:
        """Microbatches each rank runs per optimizer step."""
        return self.train.global_batch // (self.parallel.dp * self.micro_batch)

    def data_order(self) -> dict[str, Any]:
        """What the sampler's order depends on besides the step (kept by checkpoints, and
        compared on resume): the seed, the global batch and the data settings."""
        order = {"seed": self.train.seed, "global_batch": self.train.global_batch,
                 **dataclasses.asdict(self.data)}
        if self.data.data:  # the path alone does not say what it holds: prepared again, it moves
            order["dataset"] = read_meta(self.data.data).identity
        return order

    @property
    def metrics_path(self) -> Path:
        return Path(self.train.metrics or Path(self.train.run_dir) / "metrics.jsonl")

    # ---- checks ----------------------------------------------------------------------------
    def validate(self, launcher: Literal["local", "torchrun"] = "local") -> "Config":
        """A copy with the derived sizes (dp, nproc) filled in; raises ConfigError naming
        any problem and its fix. ``self`` is left as it was. Under ``torchrun``, nproc is
        the world torchrun started, and the fix for a mismatch names torchrun's flags."""
        _check_fields(self)
        _check_unused(self)
        cfg = dataclasses.replace(self, parallel=_resolve_world(self.parallel, launcher))
        load_task(cfg.train.task).validate(cfg)
        return cfg

    def check_model_layout(self) -> None:
        """The language model's checks: its shape against the layout, its preset, resume."""
        m, p = self.model, self.parallel
        try:
            # self.layout: the order string (--order) parses and names every axis once
            rules.check_split(m.shape, self.layout, virtual_stages=p.virtual_stages,
                              seq_len=self.data.seq_len, cp_method=p.cp_method)
            rules.sequence_parallel(p.sp, p.tp, p.cp, self.data.seq_len)
            rules.tied_embeddings(m.tie_embeddings, p.pp, p.zero, p.compress.endswith(":update"),
                                  schedule=p.schedule)
            rules.virtual_stages(p.virtual_stages, p.schedule)
            rules.expert_strategies(m.n_experts, p.ep, p.zero, p.compress,
                                    capacity_factor=m.capacity_factor,
                                    splits_sequences=p.cp > 1 or (p.sp and p.tp > 1))
            rules.compiled(self.train.compile, m.n_experts, self._split_backward())
        except LayoutError as exc:
            raise ConfigError(str(exc)) from None
        if m.rope_scaling:
            try:
                parse_rope_scaling(m.rope_scaling)
            except ValueError as exc:
                where = (f"from {self.model_preset}/config.json" if hf.is_model_dir(self.model_preset)
                         else "--rope-scaling")
                raise ConfigError(f"model.{exc} ({where})") from None
        self._check_strategies()
        self._check_batch()
        self._check_logs()

    def _split_backward(self) -> str:
        """The pipeline schedule if it splits backwards into B and W (zero bubble), else ''."""
        from ..parallel.pipeline.zero_bubble import KINDS

        p = self.parallel
        return p.schedule if p.pp > 1 and p.schedule in KINDS else ""

    def _check_logs(self) -> None:
        from . import logs

        t = self.train
        if t.log_every < 1:
            raise ConfigError(f"log_every={t.log_every}: log at least every step (--log-every 1)")
        try:
            logs.parse_sinks(t.log)
            logs.ProfileWindow.parse(t.profile, t.steps)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    def _check_strategies(self) -> None:
        p = self.parallel
        try:
            compress.check(p.compress, p.zero, p.tp, replicas=p.dp * p.cp, cp=p.cp)
        except compress.CompressError as exc:
            raise ConfigError(str(exc)) from None
        if self.train.precision == "bf16-params" and p.compress.endswith(":update"):
            raise ConfigError(f"--precision bf16-params with --compress {p.compress} is not supported: "
                              f"averaging AdamW's updates steps the weights themselves, not fp32 "
                              f"masters; use --precision bf16, or drop :update")
        if p.offload and not p.zero:
            raise ConfigError("--offload moves ZeRO's sharded optimizer state to the CPU: it needs --zero 1, 2 or 3")
        if p.shard_group and p.zero != 3:
            raise ConfigError(f"--shard-group {p.shard_group} is ZeRO-3's hybrid sharding (HSDP): "
                              f"add --zero 3, or drop --shard-group")
        if p.pp > 1:
            self._check_pipeline()

    def _check_pipeline(self) -> None:
        from ..parallel.pipeline import ScheduleError, check

        p = self.parallel
        try:
            check(p.schedule, p.pp, self.accumulation, p.virtual_stages)
        except ScheduleError as exc:
            raise ConfigError(str(exc)) from None

    def _check_batch(self) -> None:
        t, dp = self.train, self.parallel.dp
        try:
            rules.batch(t.global_batch, dp)
        except LayoutError as exc:
            raise ConfigError(str(exc)) from None
        share, m = t.global_batch // dp, self.parallel.microbatches
        if m and not t.micro_batch and share % m:  # the micro-batch is derived from them
            fits = [d for d in range(1, share + 1) if share % d == 0]
            raise ConfigError(f"microbatches={m} does not divide the {share} sequences each rank "
                              f"gets per step (global_batch={t.global_batch} / dp={dp}); use one of "
                              f"{', '.join(map(str, fits))}, or change --global-batch")
        try:
            rules.batch(t.global_batch, dp, self.micro_batch)
        except LayoutError as exc:
            raise ConfigError(str(exc)) from None
        if m and m != self.accumulation:
            raise ConfigError(f"microbatches={m} but global_batch / (dp x micro_batch) = "
                              f"{self.accumulation}; leave microbatches at 0 or make them agree")
        if self.model.sliding_window and self.data.seq_len > self.model.sliding_window:
            raise ConfigError(f"seq_len={self.data.seq_len} exceeds the model's sliding_window="
                              f"{self.model.sliding_window}; paratrain attends in full, so use "
                              f"--seq-len {self.model.sliding_window} or less")
        if self.data.seq_len > self.model.max_seq_len:
            raise ConfigError(f"seq_len={self.data.seq_len} exceeds the model's max_seq_len="
                              f"{self.model.max_seq_len}; raise --max-seq-len or lower --seq-len")
        if t.steps < 1:
            raise ConfigError(f"steps={t.steps}: train for at least one step")
        if self.data.corpus and not Path(self.data.corpus).is_file():
            raise ConfigError(f"data.corpus: corpus file {self.data.corpus!r} does not exist "
                              f"{schema.where('data', 'corpus')}")
        if t.resume and t.resume not in ("auto", "none"):  # auto: the launcher picks (runs.py)
            from .checkpoint import CheckpointError, check_model, read_meta

            try:
                meta = read_meta(t.resume)
                check_model(meta, self.model, t.resume)
            except CheckpointError as exc:
                raise ConfigError(str(exc)) from None
            if meta["step"] >= t.steps:
                raise ConfigError(f"the checkpoint is at step {meta['step']}, and steps={t.steps}: "
                                  f"raise --steps to train further")


def _check_unused(cfg: Config) -> None:
    """Refuse settings this run would silently ignore: another task's table, or a corpus
    split given for a prepared dataset (which carries its own). A task refuses the
    general settings it does not read in its own ``validate``."""
    if cfg.train.task not in task_names():
        raise ConfigError(f"train.task={cfg.train.task!r}: the tasks are {', '.join(task_names())}")
    for name, cls in TASK_SECTIONS.items():
        table = cfg.tasks[name]
        given = [f.name for f in dataclasses.fields(cls) if getattr(table, f.name) != getattr(cls(), f.name)]
        if name != cfg.train.task and given:
            raise ConfigError(f"[{name}] {', '.join(given)}: set{'s' if len(given) == 1 else ''} "
                              f"up the {name} task, and this run's task is {cfg.train.task}; add "
                              f"--task {name}, or drop "
                              f"{', '.join('--' + g.replace('_', '-') for g in given)}")
    if cfg.data.data and cfg.data.val_fraction != DataConfig.val_fraction:
        raise ConfigError("data.val_fraction splits a --corpus; a prepared dataset (--data) "
                          "has its own validation split, set by `paratrain data prepare "
                          "--val-fraction`: drop --val-fraction")


def unused_settings(cfg: Config, unused: dict[str, tuple[str, ...]]) -> list[str]:
    """The flags of ``unused`` (section -> field names) that ``cfg`` sets away from their
    defaults, and the model's fields when they differ from the default model's: what a
    task that does not read them refuses."""
    given = [f"--{name.replace('_', '-')}" for section, names in unused.items() for name in names
             if getattr(getattr(cfg, section), name) != getattr(type(getattr(cfg, section))(), name)]
    if cfg.model != Config().model:
        given.insert(0, "the [model] fields (--n-layers, --d-model, ...)")
    return given


def _resolve_world(p: ParallelConfig, launcher: str = "local") -> ParallelConfig:
    """``p`` with dp and nproc filled in (a copy). Under torchrun nproc is its world size."""
    try:
        domh, domw = parse_domain(p.domain)
    except LayoutError as exc:
        raise ConfigError(str(exc)) from None
    others = p.tp * p.pp * p.cp * domh * domw
    started = (f"parallel.nproc: torchrun started {p.nproc} processes" if launcher == "torchrun"
               else f"parallel.nproc: nproc={p.nproc or 2 * others}")
    dp = p.dp
    if dp == 0:
        # default: 2 replicas, or one when a domain grid already splits each sample
        nproc = p.nproc or (others if domh * domw > 1 else 2 * others)
        if nproc % others:
            fix = ("start torchrun with --nnodes x --nproc-per-node" if launcher == "torchrun"
                   else "set --nproc to")
            raise ConfigError(f"{started}, which is not divisible by tp*pp*cp*domain={others}; "
                              f"{fix} a multiple of {others}")
        dp = nproc // others
    nproc = p.nproc or dp * others
    if nproc != dp * others:
        fix = (f"start torchrun with --nnodes x --nproc-per-node = {dp * others} processes"
               if launcher == "torchrun" else f"set --nproc {dp * others}")
        raise ConfigError(f"{started} but dp*tp*pp*cp*domain = {dp * others}; {fix} "
                          f"or change the axis sizes")
    return dataclasses.replace(p, dp=dp, nproc=nproc)


def _check_fields(cfg: Config) -> None:
    """Types and ranges of every field (see ``schema``), and ranges across fields."""
    problems = []
    for section, cls in {"model": GPTConfig, **SECTIONS}.items():
        obj = cfg.tasks[section] if section in TASK_SECTIONS else getattr(cfg, section)
        problems += schema.check(cls, {f.name: getattr(obj, f.name)
                                       for f in dataclasses.fields(cls)}, section)[1]
    if not problems and cfg.optim.min_lr > cfg.optim.lr:
        problems.append(f"optim.min_lr={cfg.optim.min_lr} is above optim.lr={cfg.optim.lr}, so "
                        f"the decay would raise the learning rate; set --min-lr at most --lr")
    if problems:
        raise ConfigError("\n".join(problems))


def load(path: str | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Defaults, then the TOML file at ``path``, then ``overrides`` (flat field -> value);
    a ``preset`` among the overrides (``--model``) replaces the file's whole ``[model]``
    table, since its shape fields would otherwise resize the preset named on the command
    line. The model's base preset follows ``models.shape_base``. Every value is checked (``schema``) before a dataclass is built from it."""
    flat = schema.flatten(schema.read_toml(path), path, _SCHEMA) if path else {}
    given = {_qualify(key): value for key, value in (overrides or {}).items()}
    if "model.preset" in given:  # --model replaces the file's whole model: a flag beats the file
        flat = {key: value for key, value in flat.items() if not key.startswith("model.")}
    return _build({**flat, **given})


def _qualify(name: str) -> str:
    """'lr' -> 'optim.lr': every field name is unique across sections."""
    home = schema.home(name, _SCHEMA)
    if home is None:
        raise ConfigError(f"unknown setting {name!r}")
    return f"{home}.{name}"


def _build(flat: dict[str, Any]) -> Config:
    """Check every value against its field, then build the dataclasses."""
    tables: dict[str, dict[str, Any]] = {s: {} for s in ("model", *SECTIONS)}
    for key, value in flat.items():
        section, name = key.split(".", 1)
        tables[section][name] = value
    name = shape_base(tables["model"], tables["model"].pop("preset", None))
    problems = []
    if name not in PRESETS and not hf.is_model_dir(name):
        problems.append(f"model.preset: unknown preset {name!r}; known: "
                        f"{', '.join(PRESETS)}, or a local Hugging Face model directory "
                        f"(config.json + safetensors) {schema.where('model', 'preset')}")
    for section, cls in {"model": GPTConfig, **SECTIONS}.items():
        tables[section], found = schema.check(cls, tables[section], section)
        problems += found
    if problems:
        raise ConfigError("\n".join(problems))
    try:
        model = preset(name, **tables.pop("model"))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"[model]: {exc}") from None
    core = {s: cls(**tables[s]) for s, cls in CORE.items()}
    tasks = {s: cls(**tables[s]) for s, cls in TASK_SECTIONS.items()}
    return Config(model=model, model_preset=name, tasks=tasks, **core)
