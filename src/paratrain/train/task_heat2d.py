"""The heat2d task (``--task heat2d``): a U-Net learns one long step of the 2-D heat equation,
under dp x domain parallelism (and ZeRO over the same ranks).

The one training loop (loop.py) drives it as a ``Task`` (train/task.py): metrics and
their sinks, the profiler, peak memory, the progress bar, the non-finite rule and
layout-independent checkpoints work as they do for the GPT. A grid point plays the part of
a token in the metrics (``tokens``, ``tokens_per_s``).

The step is the engine's, as for the GPT (parallel/step.py): the U-Net and its squared
error are the one chunk of a one-stage schedule. Loss normalisation: each rank sums the
squared error over its block of its samples and scales it by ``dp * dom /
points_in_global_batch``; the average of gradients over the dp x dom group is then the
gradient of the mean squared error over the whole global batch, what one process
computes, whatever the grid (even blocks of unequal size).
"""

from __future__ import annotations



import torch

from .. import rules
from ..comm import collectives as C
from ..layout import DOMAIN_AXES, DP, DP_DOM, LayoutError
from ..mesh import Mesh
from ..models.unet import UNet, UNetConfig
from ..parallel.data import DataParallel
from ..parallel.domain import Grid, apply_domain_parallel
from ..parallel.engine import ReplicatedEngine
from ..parallel.step import StepPlan
from ..parallel.zero import ZeroDataParallel
from . import checkpoint
from . import data as D
from .config import Config, unused_settings
from .schema import ConfigError
from .heat2d import Fields, Heat2DConfig, make_fields
from .rundir import continued_run_id
from .task import Run


NORM_GROUPS = 4


def unet_config(cfg: Config) -> UNetConfig:
    h = settings(cfg)
    return UNetConfig(width=h.unet_width, levels=h.unet_levels, kernel=h.unet_kernel,
                      norm_groups=NORM_GROUPS, padding=h.boundary)


UNUSED = {"data": ("corpus", "data", "seq_len", "val_fraction"),
          "parallel": ("cp_method", "schedule", "virtual_stages"),
          "train": ("timeline", "eval_batches", "compile")}
"""Language-model settings this task never reads (it makes its own fields, runs neither a
pipeline nor context parallelism, and validates on all its fields)."""


def settings(cfg: Config) -> Heat2DConfig:
    """This task's ``[heat2d]`` table."""
    return cfg.tasks["heat2d"]


def check(cfg: Config) -> None:
    """Refuse, before any process starts, what the task or domain parallelism cannot do."""
    p, h, t = cfg.parallel, settings(cfg), cfg.train
    if cfg.model_preset != Config.model_preset or p.sp:
        raise ConfigError("--task heat2d trains its own U-Net (shaped by --unet-width, "
                          "--unet-levels, --unet-kernel) without tensor parallelism: drop "
                          "--model and --sp")
    if p.compress != "none":
        raise ConfigError(f"compress={p.compress!r}: --task heat2d averages its gradients "
                          f"uncompressed; drop --compress")
    given = unused_settings(cfg, UNUSED)
    if given:
        raise ConfigError(f"{', '.join(given)}: language-model settings, which --task heat2d "
                          f"does not use (it generates its own fields); drop them")
    if p.tp > 1 or p.pp > 1 or p.cp > 1:
        raise ConfigError("--task heat2d composes domain parallelism with dp and ZeRO only; "
                          "set --tp 1 --pp 1 --cp 1")
    if t.precision != "fp32" or t.recompute != "none" or cfg.data.remainder != "drop":
        raise ConfigError("--task heat2d trains in fp32 without recomputation and drops the "
                          "last partial batch: leave --precision, --recompute and --remainder "
                          "at their defaults")
    try:
        ucfg = unet_config(cfg)
    except ValueError as exc:
        raise ConfigError(f"[heat2d] unet_{exc}") from None
    if not 0 < h.heat_diffusivity <= 0.25:
        raise ConfigError(f"heat_diffusivity={h.heat_diffusivity}: explicit steps are stable "
                          f"for 0 < r <= 0.25")
    try:
        layout = cfg.layout
    except LayoutError as exc:
        raise ConfigError(str(exc)) from None
    for axis, parts in (("height", layout.domh), ("width", layout.domw)):
        check_grid(h.grid_size, parts, ucfg, axis)
    _check_batch(cfg)
    if t.resume and t.resume not in ("auto", "none"):  # auto: the launcher picks (train/runs.py)
        _check_resume(cfg, ucfg)


def check_grid(size: int, parts: int, ucfg: UNetConfig, axis: str = "height") -> None:
    """The U-Net halves its blocks ``levels`` times and its convolutions read ``kernel // 2``
    rows past a block: every block at every level must be whole and at least that thick."""
    unit = parts * 2**ucfg.levels
    if size % unit:
        raise ConfigError(f"grid_size={size} is not divisible by the {parts} ranks over the {axis} "
                          f"x 2**unet_levels={2**ucfg.levels}: use a grid_size that is a "
                          f"multiple of {unit}")
    deepest, halo = size // unit, max(1, ucfg.kernel // 2)
    if deepest < halo and (parts > 1 or ucfg.padding == "circular"):  # a circular pad
        # wider than the image wraps around; zeros pad any size
        raise ConfigError(f"at the U-Net's deepest level each rank's block is {deepest} rows "
                          f"over the {axis}, thinner than the {halo}-row halo a {ucfg.kernel}x"
                          f"{ucfg.kernel} convolution needs: use a grid_size of at least "
                          f"{unit * halo}, fewer ranks over the {axis} or fewer unet_levels")


def _check_batch(cfg: Config) -> None:
    t, dp, h = cfg.train, cfg.parallel.dp, settings(cfg)
    try:
        rules.batch(t.global_batch, dp, cfg.micro_batch)
    except LayoutError as exc:
        raise ConfigError(str(exc)) from None
    if h.heat_samples - max(1, h.heat_samples // 8) < t.global_batch:
        raise ConfigError(f"heat_samples={h.heat_samples} leave fewer training samples than one "
                          f"global batch of {t.global_batch}; raise --heat-samples")
    if t.steps < 1:
        raise ConfigError(f"steps={t.steps}: train for at least one step")


def _check_resume(cfg: Config, ucfg: UNetConfig) -> None:
    try:
        meta = checkpoint.read_meta(cfg.train.resume)
        checkpoint.check_model(meta, ucfg, cfg.train.resume)
    except checkpoint.CheckpointError as exc:
        raise ConfigError(str(exc)) from None
    if meta["step"] >= cfg.train.steps:
        raise ConfigError(f"the checkpoint is at step {meta['step']}, and steps={cfg.train.steps}: "
                          f"raise --steps to train further")


class Heat2D:
    """The ``Task`` of a U-Net on heat-equation fields (train/task.py): domain-parallel over
    the grid of ranks, its engine over dp x dom."""

    def __init__(self) -> None:
        self.grid: Grid | None = None
        """The grid of ranks each field is cut over (set by ``build``)."""

    def build(self, cfg: Config, mesh: Mesh) -> Run:
        ucfg, p = unet_config(cfg), cfg.parallel
        torch.manual_seed(cfg.train.seed)
        model = UNet(ucfg).to(mesh.device)
        start_step, state = checkpoint.load(cfg.train.resume, ucfg) if cfg.train.resume else (0, None)
        if state is not None:
            model.load_state_dict(state["param"])
        self.grid = Grid.from_mesh(mesh)
        if mesh.size(DOMAIN_AXES) > 1:
            apply_domain_parallel(model, self.grid)
        group = mesh.group(DP_DOM)  # every rank of the grid holds the same weights
        plan = StepPlan([SquaredError(model)], mesh.device, (), torch.float32, loss_groups=(group,),
                        average_over=C.size(group))
        engine = (ZeroDataParallel(model, group, p.zero, cfg.optim, plan=plan) if p.zero else
                  ReplicatedEngine(DataParallel(model, group, bucket_mb=p.bucket_mb), cfg.optim, plan=plan))
        if state is not None:
            engine.load_optimizer_state(state, start_step)
        train_data, val_data = make_fields(settings(cfg), cfg.train.seed)
        sampler = D.DistributedSampler(len(train_data), cfg.train.global_batch, dp_rank=mesh.coord(DP),
                                       dp_size=mesh.size(DP), seed=cfg.train.seed)
        meta = checkpoint.read_meta(cfg.train.resume) if cfg.train.resume else {}
        return Run(cfg, mesh, self, engine, train_data, val_data, sampler, start_step,
                   continued_run_id(meta), cfg.train.resume, checkpoint.skipped_steps(meta))

    def microbatches(self, run: Run, fields: Fields, indices: list[int]) -> list[tuple]:
        size = run.cfg.micro_batch
        return [self._batch(run, fields, indices[i:i + size]) for i in range(0, len(indices), size)]

    def _batch(self, run: Run, fields: Fields, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's blocks of the samples ``indices``."""
        x, y = fields.inputs[indices], fields.targets[indices]
        dev = run.mesh.device
        return self.grid.local(x).contiguous().to(dev), self.grid.local(y).contiguous().to(dev)

    def count(self, run: Run, step: int) -> int:
        return run.cfg.train.global_batch * settings(run.cfg).grid_size**2

    @torch.no_grad()
    def evaluate(self, run: Run) -> float:
        """Mean squared error over the validation fields."""
        mesh = run.mesh
        mine = list(range(mesh.coord(DP), len(run.val_data), mesh.size(DP)))
        total = run.engine.forward_backward(self.microbatches(run, run.val_data, mine), 1.0,
                                            training=False)
        return total.total.item() / (len(run.val_data) * settings(run.cfg).grid_size**2)

    def describe(self, run: Run) -> str:
        cfg, h = run.cfg, settings(run.cfg)
        G, (gh, gw) = h.grid_size, self.grid.shape
        return (f"paratrain: {cfg.describe_layout()}, task heat2d, U-Net "
                f"({unet_config(cfg).num_params() / 1e6:.3f}M params), {cfg.train.global_batch} fields "
                f"of {G}x{G} per step, each rank's block {G // gh}x{G // gw}, micro-batch "
                f"{cfg.micro_batch} x {cfg.accumulation} accumulation, boundary {h.boundary}\n"
                f"data: {len(run.train_data)} train / {len(run.val_data)} validation fields generated "
                f"from seed {cfg.train.seed}; a grid point counts as a token in the metrics")

    def model_config(self, cfg: Config) -> UNetConfig:
        return unet_config(cfg)

    def model_label(self, cfg: Config) -> str:
        return f"unet-w{settings(cfg).unet_width}-l{settings(cfg).unet_levels}"

    def flops_per_unit(self, cfg: Config) -> float:
        return 0.0  # convolutions: not counted, so no MFU

    def data_position(self, cfg: Config, step: int) -> None:
        return None  # the fields are a function of the seed; the sampler's order of the step

    reads_corpus = False  # it generates its fields
    spatial = True  # domain parallelism cuts its fields
    model_type = UNetConfig
    model_kind = "a heat2d U-Net"

    def validate(self, cfg: Config) -> None:
        check(cfg)


TASK = Heat2D


class SquaredError(torch.nn.Module):
    """The model and its loss as one chunk: the summed squared error of its prediction."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor, positions: None = None) -> torch.Tensor:
        return (self.model(x) - y).pow(2).sum()
