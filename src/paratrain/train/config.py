"""Training configuration: dataclasses with a docstring per field, read from TOML and flags.

A TOML file has one table per section (``[model]``, ``[parallel]``, ``[data]``,
``[optim]``, ``[train]``); ``[model]`` takes ``preset`` plus any ``GPTConfig`` field to
override. Every field is also a command-line flag (``--d-model``, ``--dp``, ``--lr``...);
flags override the file, which overrides the defaults. Every value is checked against
its field's type and range as it is read (``schema``: types and choices come from the
annotations, ranges from ``schema.LIMITS``); ``Config.validate()`` then checks the
combination and returns a resolved copy, before any process is started.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .. import rules
from ..comm import compress
from ..layout import Layout, LayoutError, parse_domain
from ..models import hf
from ..models.gpt import PRESETS, GPTConfig, preset
from . import schema
from .heat2d import Heat2DConfig

ConfigError = schema.ConfigError  # defined with the checks that raise it; imported from here


@dataclass
class ParallelConfig:
    """How the work is split across processes."""

    nproc: int = 0
    """Processes to start (0: the product dp*tp*pp*cp*domain; when dp is also 0, with dp=2,
    or dp=1 under domain parallelism)."""
    dp: int = 0
    """Data-parallel replicas (0: whatever fills nproc)."""
    tp: int = 1
    """Tensor-parallel ranks."""
    pp: int = 1
    """Pipeline stages."""
    cp: int = 1
    """Context-parallel ranks."""
    zero: Literal[0, 1, 2, 3] = 0
    """ZeRO stage on the data-parallel axis: 0 (DDP), 1 (shard optimizer state), 2 (+ gradients), 3 (+ parameters)."""
    reshard_after_forward: Literal["auto", "yes", "no"] = "auto"
    """ZeRO-3: free a unit's gathered parameters after each forward and gather them again
    for backward ("yes": least memory, two gathers per microbatch), or keep them from the
    first forward of a step to the unit's last backward ("no": one gather per step). "auto":
    "no" under a pipeline, which runs many microbatches on a stage holding 1/pp of the model
    (torchtitan's choice), "yes" otherwise."""
    offload: bool = False
    """ZeRO: keep optimizer state (fp32 masters, Adam moments) in CPU memory (GPU runs only)."""
    sp: bool = False
    """Megatron sequence parallelism on the tensor-parallel axis."""
    cp_method: Literal["ring", "ulysses"] = "ring"
    """Context-parallel attention: ring or ulysses."""
    schedule: Literal["gpipe", "1f1b", "interleaved"] = "1f1b"
    """Pipeline schedule: gpipe, 1f1b or interleaved."""
    microbatches: int = 0
    """Microbatches per step and data-parallel rank: pipeline microbatches when pp > 1,
    gradient-accumulation steps otherwise (0: derived from micro_batch)."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (interleaved schedule)."""
    order: str = "tp-cp-pp-dp"
    """Axes from fastest- to slowest-varying rank: tp first keeps its peers on one node."""
    bucket_mb: float = 4.0
    """Size of a gradient bucket, in MiB, for overlapped gradient reduction."""
    compress: str = "none"
    """Gradient compression of the data-parallel reduction: none, fp16, bf16, int8,
    topk:FRACTION or powersgd:RANK; int8/topk/powersgd keep an error-feedback residual
    (append :noef to drop it). With --zero 0 or 1."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Process-group backend: auto (nccl with GPUs, else gloo), gloo or nccl."""
    timeout_s: float = 300.0
    """Seconds a collective may wait for a peer before the job fails instead of hanging."""
    max_time_s: float = 0.0
    """Limit on the whole run's wall time, in seconds: past it the job is ended (0: none)."""
    domain: str = "1"
    """Domain parallelism (--task heat2d): N ranks over each sample's height, or HxW, e.g. 2x2."""


@dataclass
class DataConfig:
    """Where the tokens come from."""

    corpus: str = ""
    """Text file to train on ('' : the bundled corpus). Bytes are the tokens."""
    data: str = ""
    """A dataset directory made by `paratrain data prepare` (its tokenizer's tokens, its own
    validation split); replaces the corpus."""
    seq_len: int = 128
    """Tokens per training sequence."""
    val_fraction: float = 0.05
    """Share of the corpus (its end) held out for validation (0: no validation set, and no
    validation loss)."""
    remainder: Literal["drop", "pad"] = "drop"
    """Samples that do not fill the last global batch of an epoch: drop, or pad (pad and mask)."""


@dataclass
class OptimConfig:
    """AdamW with linear warm-up and cosine decay."""

    lr: float = 3e-3
    """Peak learning rate."""
    min_lr: float = 3e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 20
    """Steps of linear warm-up from 0 to lr."""
    weight_decay: float = 0.1
    """Decoupled weight decay on matrices (embeddings included); norm weights are not decayed."""
    beta1: float = 0.9
    """Adam first-moment decay."""
    beta2: float = 0.95
    """Adam second-moment decay."""
    eps: float = 1e-8
    """Adam epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0: no clipping)."""


@dataclass
class TrainConfig:
    """The loop."""

    steps: int = 200
    """Optimizer steps."""
    global_batch: int = 16
    """Sequences per optimizer step, over all data-parallel ranks."""
    micro_batch: int = 0
    """Sequences per forward/backward on one rank (0: global_batch / dp, no accumulation)."""
    seed: int = 0
    """Seed for initialisation and data order."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """fp32, or bf16 (bf16 compute; fp32 master weights and optimizer state)."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recomputation: none, selective (attention core), full (whole blocks)."""
    eval_every: int = 50
    """Validation every this many steps (0: never; always at the end)."""
    eval_batches: int = 4
    """Global batches of validation data per evaluation."""
    run_dir: str = ""
    """Directory for this run's outputs, exactly ('': a new runs/<UTC time>-<name>, with
    runs/latest pointing at it; with resume auto, the run runs/latest points at)."""
    name: str = ""
    """Name that ends the default run directory runs/<UTC time>-<name> ('': the model preset)."""
    metrics: str = ""
    """JSON-lines metrics file ('' : RUN_DIR/metrics.jsonl)."""
    progress: bool = True
    """Show progress (rank 0): a bar on a terminal, else a plain line every log_every steps."""
    log_every: int = 10
    """Steps between plain progress lines (output not a terminal) and per-rank peak-memory
    records in the metrics."""
    log: str = ""
    """Extra metric sinks besides metrics.jsonl, comma-separated: csv, tensorboard, wandb."""
    profile: str = ""
    """START:END: record steps START to END (1-based) with torch.profiler into
    RUN_DIR/profile-rank{N}.json (Chrome trace format)."""
    save_every: int = 0
    """Save a layout-independent checkpoint to RUN_DIR/checkpoints/step-N every this many
    steps and after the last (0: never)."""
    resume: str = ""
    """auto: the newest complete checkpoint of the run directory, or a fresh start if there is
    none; none: start fresh; or a checkpoint directory, written under any layout (same model
    shape). '': auto under torchrun, else none."""
    timeline: bool = False
    """Pipeline runs: record what each rank did when into RUN_DIR/timeline.json, for
    `paratrain trace --run`, and print the measured bubble."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """A step whose loss or gradient norm is NaN or inf: stop the run (naming the step, the
    rank and the last good checkpoint), or skip its update and go on."""
    max_skips: int = 10
    """With --on-nonfinite skip: the run fails at the next non-finite step after this many."""
    task: Literal["lm", "heat2d"] = "lm"
    """lm: a GPT on text; heat2d: a U-Net on generated 2-D heat-equation fields (--domain)."""


SECTIONS = {"parallel": ParallelConfig, "data": DataConfig, "optim": OptimConfig, "train": TrainConfig,
            "heat2d": Heat2DConfig}
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
    heat2d: Heat2DConfig = field(default_factory=Heat2DConfig)

    # ---- derived ---------------------------------------------------------------------------
    @property
    def layout(self) -> Layout:
        p = self.parallel
        domh, domw = parse_domain(p.domain)
        return Layout(dp=p.dp, tp=p.tp, pp=p.pp, cp=p.cp, order=p.order, domh=domh, domw=domw)

    def describe_layout(self) -> str:
        """The layout and the ZeRO stage, e.g. ``dp2xtp2 (world 4), zero1``."""
        zero = f", zero{self.parallel.zero}" if self.parallel.zero else ""
        return self.layout.describe() + zero

    @property
    def reshard_after_forward(self) -> bool:
        """ZeRO-3's choice (``parallel.reshard_after_forward``) resolved for this layout."""
        choice = self.parallel.reshard_after_forward
        return self.parallel.pp == 1 if choice == "auto" else choice == "yes"

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

    @property
    def metrics_path(self) -> Path:
        return Path(self.train.metrics or Path(self.train.run_dir) / "metrics.jsonl")

    # ---- checks ----------------------------------------------------------------------------
    def validate(self, launcher: Literal["local", "torchrun"] = "local") -> "Config":
        """A copy with the derived sizes (dp, nproc) filled in; raises ConfigError naming
        any problem and its fix. ``self`` is left as it was. Under ``torchrun``, nproc is
        the world torchrun started, and the fix for a mismatch names torchrun's flags."""
        _check_fields(self)
        cfg = dataclasses.replace(self, parallel=_resolve_world(self.parallel, launcher))
        if cfg.train.task == "heat2d" or parse_domain(cfg.parallel.domain) != (1, 1):
            from .task_heat2d import validate as validate_heat2d

            validate_heat2d(cfg)  # the convolutional task and domain parallelism
            return cfg
        cfg._check()
        return cfg

    def _check(self) -> None:
        m, p = self.model, self.parallel
        try:
            rules.check_split(rules.Shape(m.n_heads, m.kv_heads, m.n_layers, m.ffn_dim),
                              rules.Split(p.tp, p.cp, p.pp, p.virtual_stages, self.data.seq_len,
                                          p.cp_method))
            rules.sequence_parallel(p.sp, p.tp, p.cp, self.data.seq_len)
            rules.tied_embeddings(m.tie_embeddings, p.pp, p.zero)
            rules.virtual_stages(p.virtual_stages, p.schedule)
        except LayoutError as exc:
            raise ConfigError(str(exc)) from None
        self._check_strategies()
        self._check_batch()
        self._check_logs()

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
            compress.check(p.compress, p.zero)
        except compress.CompressError as exc:
            raise ConfigError(str(exc)) from None
        if p.offload and not p.zero:
            raise ConfigError("--offload moves ZeRO's sharded optimizer state to the CPU: it needs --zero 1, 2 or 3")
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
        if t.global_batch % dp:
            raise ConfigError(f"global_batch={t.global_batch} is not divisible by dp={dp}; "
                              f"use a multiple of {dp}")
        if (t.global_batch // dp) % self.micro_batch:
            raise ConfigError(f"each rank gets {t.global_batch // dp} sequences per step, not a "
                              f"multiple of micro_batch={self.micro_batch}")
        m = self.parallel.microbatches
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
        obj = getattr(cfg, section)
        problems += schema.check(cls, {f.name: getattr(obj, f.name)
                                       for f in dataclasses.fields(cls)}, section)[1]
    if not problems and cfg.optim.min_lr > cfg.optim.lr:
        problems.append(f"optim.min_lr={cfg.optim.min_lr} is above optim.lr={cfg.optim.lr}, so "
                        f"the decay would raise the learning rate; set --min-lr at most --lr")
    if problems:
        raise ConfigError("\n".join(problems))


def load(path: str | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Defaults, then the TOML file at ``path``, then ``overrides`` (flat field -> value).
    Every value is checked (``schema``) before a dataclass is built from it."""
    flat = schema.flatten(schema.read_toml(path), path, _SCHEMA) if path else {}
    for key, value in (overrides or {}).items():
        flat[_qualify(key)] = value
    return _build(flat)


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
    name = tables["model"].pop("preset", "small")
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
    sections = {s: cls(**tables[s]) for s, cls in SECTIONS.items()}
    return Config(model=model, model_preset=name, **sections)
