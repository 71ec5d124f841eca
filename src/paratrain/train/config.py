"""Training configuration: dataclasses with a docstring per field, read from TOML and flags.

A TOML file has one table per section (``[model]``, ``[parallel]``, ``[data]``,
``[optim]``, ``[train]``); ``[model]`` takes ``preset`` plus any ``GPTConfig`` field to
override. Every field is also a command-line flag (``--d-model``, ``--dp``, ``--lr``...);
flags override the file, which overrides the defaults. ``Config.validate()`` checks the
whole thing before any process is started.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..comm import compress
from ..layout import Layout, LayoutError
from ..models.gpt import PRESETS, GPTConfig, preset

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(ValueError):
    """A configuration that cannot run; the message says what to change."""


@dataclass
class ParallelConfig:
    """How the work is split across processes."""

    nproc: int = 0
    """Processes to start (0: the product dp*tp*pp*cp, or 2 when dp is also 0)."""
    dp: int = 0
    """Data-parallel replicas (0: whatever fills nproc)."""
    tp: int = 1
    """Tensor-parallel ranks."""
    pp: int = 1
    """Pipeline stages."""
    cp: int = 1
    """Context-parallel ranks."""
    zero: int = 0
    """ZeRO stage on the data-parallel axis: 0 (DDP), 1 (shard optimizer state), 2 (+ gradients), 3 (+ parameters)."""
    offload: bool = False
    """ZeRO: keep optimizer state (fp32 masters, Adam moments) in CPU memory (GPU runs only)."""
    sp: bool = False
    """Megatron sequence parallelism on the tensor-parallel axis."""
    cp_method: str = "ring"
    """Context-parallel attention: ring or ulysses."""
    schedule: str = "1f1b"
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
    backend: str = "auto"
    """Process-group backend: auto (nccl with GPUs, else gloo), gloo or nccl."""
    timeout_s: float = 300.0
    """Seconds a collective may wait for a peer before the job fails instead of hanging."""


@dataclass
class DataConfig:
    """Where the tokens come from."""

    corpus: str = ""
    """Text file to train on ('' : the bundled corpus). Bytes are the tokens."""
    seq_len: int = 128
    """Tokens per training sequence."""
    val_fraction: float = 0.05
    """Share of the corpus (its end) held out for validation."""
    remainder: str = "drop"
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
    precision: str = "fp32"
    """fp32, or bf16 (bf16 compute; fp32 master weights and optimizer state)."""
    recompute: str = "none"
    """Activation recomputation: none, selective (attention core), full (whole blocks)."""
    eval_every: int = 50
    """Validation every this many steps (0: never; always at the end)."""
    eval_batches: int = 4
    """Global batches of validation data per evaluation."""
    run_dir: str = "runs/latest"
    """Directory for this run's outputs."""
    metrics: str = ""
    """JSON-lines metrics file ('' : RUN_DIR/metrics.jsonl)."""
    progress: bool = True
    """Show a progress bar (rank 0)."""
    save_every: int = 0
    """Save a layout-independent checkpoint to RUN_DIR/checkpoints/step-N every this many
    steps and after the last (0: never)."""
    resume: str = ""
    """Checkpoint directory to resume from, written under any layout (same model shape)."""
    timeline: bool = False
    """Pipeline runs: record what each rank did when into RUN_DIR/timeline.json, for
    `paratrain trace --run`, and print the measured bubble."""


SECTIONS = {"parallel": ParallelConfig, "data": DataConfig, "optim": OptimConfig, "train": TrainConfig}
CHOICES = {"cp_method": ("ring", "ulysses"), "schedule": ("gpipe", "1f1b", "interleaved"),
           "backend": ("auto", "gloo", "nccl"), "remainder": ("drop", "pad"),
           "precision": ("fp32", "bf16"), "recompute": ("none", "selective", "full")}
# Strategies whose code has not landed: rejected up front, never silently ignored.


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

    # ---- derived ---------------------------------------------------------------------------
    @property
    def layout(self) -> Layout:
        p = self.parallel
        return Layout(dp=p.dp, tp=p.tp, pp=p.pp, cp=p.cp, zero=p.zero, order=p.order)

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
    def validate(self) -> "Config":
        """Fill in derived sizes and raise ConfigError naming any problem and its fix."""
        _resolve_world(self.parallel)
        for name, value in CHOICES.items():
            for section in (self.parallel, self.data, self.train):
                got = getattr(section, name, None)
                if got is not None and got not in value:
                    raise ConfigError(f"{name}={got!r} is not one of {', '.join(value)}")
        try:
            self.layout.check_model(n_heads=self.model.n_heads, n_kv_heads=self.model.kv_heads,
                                    n_layers=self.model.n_layers, seq_len=self.data.seq_len,
                                    virtual_stages=self.parallel.virtual_stages,
                                    cp_method=self.parallel.cp_method)
        except LayoutError as exc:
            raise ConfigError(str(exc)) from None
        self._check_strategies()
        self._check_batch()
        return self

    def _check_strategies(self) -> None:
        p = self.parallel
        if p.sp and p.tp == 1:
            raise ConfigError("--sp shards the sequence over the tensor-parallel group: it needs --tp > 1")
        if p.sp and (self.data.seq_len // p.cp) % p.tp:
            raise ConfigError(f"sequence parallelism splits each rank's {self.data.seq_len // p.cp} "
                              f"tokens over tp={p.tp}; use a seq_len divisible by {p.tp * p.cp}")
        if self.model.ffn_dim % p.tp:
            raise ConfigError(f"tp={p.tp} must divide the MLP width ffn_hidden={self.model.ffn_dim}")
        if p.zero and self.model.tie_embeddings:
            raise ConfigError("ZeRO shards each parameter once, so it cannot shard tied "
                              "embeddings; set tie_embeddings = false or --zero 0")
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
        if self.model.tie_embeddings:
            raise ConfigError("tied embeddings would live on the first and the last pipeline "
                              "stage at once; set tie_embeddings = false to use --pp")
        if p.virtual_stages > 1 and p.schedule != "interleaved":
            raise ConfigError(f"--virtual-stages {p.virtual_stages} needs --schedule interleaved")
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
        if self.data.seq_len > self.model.max_seq_len:
            raise ConfigError(f"seq_len={self.data.seq_len} exceeds the model's max_seq_len="
                              f"{self.model.max_seq_len}; raise --max-seq-len or lower --seq-len")
        if t.steps < 1:
            raise ConfigError(f"steps={t.steps}: train for at least one step")
        if self.data.corpus and not Path(self.data.corpus).is_file():
            raise ConfigError(f"corpus file {self.data.corpus!r} does not exist")
        if t.resume:
            from .checkpoint import CheckpointError, check_model, read_meta

            try:
                meta = read_meta(t.resume)
                check_model(meta, self.model, t.resume)
            except CheckpointError as exc:
                raise ConfigError(str(exc)) from None
            if meta["step"] >= t.steps:
                raise ConfigError(f"the checkpoint is at step {meta['step']}, and steps={t.steps}: "
                                  f"raise --steps to train further")


def _resolve_world(p: ParallelConfig) -> None:
    others = p.tp * p.pp * p.cp
    if p.dp == 0:
        nproc = p.nproc or 2 * others
        if nproc % others:
            raise ConfigError(f"nproc={nproc} is not divisible by tp*pp*cp={others}")
        p.dp = nproc // others
    p.nproc = p.nproc or p.dp * others
    if p.nproc != p.dp * others:
        raise ConfigError(f"nproc={p.nproc} but dp*tp*pp*cp = {p.dp * others}; set --nproc "
                          f"{p.dp * others} or change the axis sizes")


def load(path: str | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Defaults, then the TOML file at ``path``, then ``overrides`` (flat field -> value)."""
    data: dict[str, Any] = {}
    if path:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"config file {path!r} does not exist")
        try:
            data = tomllib.loads(file.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path!r} is not valid TOML: {exc}") from None
    unknown = set(data) - {"model", *SECTIONS}
    if unknown:
        raise ConfigError(f"unknown section(s) {sorted(unknown)} in {path}; "
                          f"sections are model, {', '.join(SECTIONS)}")
    flat = {f"{s}.{k}": v for s, table in data.items() for k, v in table.items()}
    for key, value in (overrides or {}).items():
        flat[_qualify(key)] = value
    return _build(flat)


def _qualify(name: str) -> str:
    """'lr' -> 'optim.lr': every field name is unique across sections."""
    for section, cls in {"model": GPTConfig, **SECTIONS}.items():
        if name in {f.name for f in dataclasses.fields(cls)} or (section, name) == ("model", "preset"):
            return f"{section}.{name}"
    raise ConfigError(f"unknown setting {name!r}")


def _build(flat: dict[str, Any]) -> Config:
    model_fields = {k[6:]: v for k, v in flat.items() if k.startswith("model.")}
    name = model_fields.pop("preset", "small")
    try:
        model = preset(name, **model_fields)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"[model]: {exc}") from None
    sections = {}
    for section, cls in SECTIONS.items():
        values = {k.split(".", 1)[1]: v for k, v in flat.items() if k.startswith(section + ".")}
        try:
            sections[section] = cls(**values)
        except TypeError as exc:
            known = ", ".join(f.name for f in dataclasses.fields(cls))
            raise ConfigError(f"[{section}]: {exc}; known fields: {known}") from None
    return Config(model=model, model_preset=name, **sections)
