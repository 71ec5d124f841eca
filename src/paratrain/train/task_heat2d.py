"""The heat2d task (``--task heat2d``): a U-Net learns one long step of the 2-D heat equation,
under dp x domain parallelism (and ZeRO over the same ranks).

The language-model loop (loop.py) hands a heat2d config to ``train`` here. The loop reads
the same way: build, then step, then report; metrics, progress bar, evaluation and
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

import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ..comm import collectives as C
from ..layout import DOMAIN_AXES, DP, DP_DOM, LayoutError
from ..mesh import Mesh
from ..models.unet import UNet, UNetConfig
from ..parallel.data import DataParallel
from ..parallel.domain import Grid, apply_domain_parallel
from ..parallel.engine import Engine, ReplicatedEngine
from ..parallel.step import StepPlan
from ..parallel.zero import ZeroDataParallel
from . import checkpoint, logs
from . import data as D
from .config import Config, ConfigError
from .heat2d import Fields, make_fields
from .loop import RunResult, finish, optimizer_step
from .metrics import MetricsWriter, state_bytes
from .nonfinite import NonFiniteGuard
from .rundir import claim_records, continued_run_id, run_record

NORM_GROUPS = 4


def unet_config(cfg: Config) -> UNetConfig:
    h = cfg.heat2d
    return UNetConfig(width=h.unet_width, levels=h.unet_levels, kernel=h.unet_kernel,
                      norm_groups=NORM_GROUPS, padding=h.boundary)


def validate(cfg: Config) -> None:
    """Refuse, before any process starts, what the task or domain parallelism cannot do."""
    p, h, t = cfg.parallel, cfg.heat2d, cfg.train
    if t.task != "heat2d":
        raise ConfigError(f"--domain {p.domain} splits images over ranks; it needs --task heat2d "
                          f"(a language model has no spatial axes)")
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
    t, dp, h = cfg.train, cfg.parallel.dp, cfg.heat2d
    if t.global_batch % dp or (t.global_batch // dp) % cfg.micro_batch:
        raise ConfigError(f"global_batch={t.global_batch} must split over dp={dp} into "
                          f"micro-batches of {cfg.micro_batch}")
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


@dataclass
class Heat2DRun:
    """Everything the steps share."""

    cfg: Config
    mesh: Mesh
    engine: Engine
    grid: Grid
    train_data: Fields
    val_data: Fields
    sampler: D.DistributedSampler
    start_step: int = 0
    run_id: str = ""
    """The run this one is or continues, named in its checkpoints (``rundir.run_record``)."""
    last_checkpoint: str = ""
    """The newest checkpoint this run wrote or resumed from."""
    skipped: int = 0
    """Steps skipped as non-finite before ``start_step`` (kept by checkpoints)."""


def build(cfg: Config, mesh: Mesh) -> Heat2DRun:
    """U-Net (domain-parallel over the grid of ranks), engine over dp x dom, data."""
    ucfg, p = unet_config(cfg), cfg.parallel
    torch.manual_seed(cfg.train.seed)
    model = UNet(ucfg).to(mesh.device)
    start_step, state = checkpoint.load(cfg.train.resume, ucfg) if cfg.train.resume else (0, None)
    if state is not None:
        model.load_state_dict(state["param"])
    grid = Grid.from_mesh(mesh)
    if mesh.size(DOMAIN_AXES) > 1:
        apply_domain_parallel(model, grid)
    group = mesh.group(DP_DOM)  # every rank of the grid holds the same weights
    plan = StepPlan([SquaredError(model)], mesh.device, (), torch.float32, loss_groups=(group,),
                    average_over=C.size(group))
    engine = (ZeroDataParallel(model, group, p.zero, cfg.optim, plan=plan) if p.zero else
              ReplicatedEngine(DataParallel(model, group, bucket_mb=p.bucket_mb), cfg.optim, plan=plan))
    if state is not None:
        engine.load_optimizer_state(state, start_step)
    train_data, val_data = make_fields(cfg.heat2d, cfg.train.seed)
    sampler = D.DistributedSampler(len(train_data), cfg.train.global_batch, dp_rank=mesh.coord(DP),
                                   dp_size=mesh.size(DP), seed=cfg.train.seed)
    meta = checkpoint.read_meta(cfg.train.resume) if cfg.train.resume else {}
    return Heat2DRun(cfg, mesh, engine, grid, train_data, val_data, sampler, start_step,
                     continued_run_id(meta), cfg.train.resume, checkpoint.skipped_steps(meta))


def _batch(run: Heat2DRun, fields: Fields, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's blocks of the samples ``indices``."""
    x, y = fields.inputs[indices], fields.targets[indices]
    dev = run.mesh.device
    return run.grid.local(x).contiguous().to(dev), run.grid.local(y).contiguous().to(dev)


class SquaredError(torch.nn.Module):
    """The model and its loss as one chunk: the summed squared error of its prediction."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor, positions: None = None) -> torch.Tensor:
        return (self.model(x) - y).pow(2).sum()


def _microbatches(run: Heat2DRun, fields: Fields, indices: list[int]) -> list:
    size = run.cfg.micro_batch
    return [_batch(run, fields, indices[i:i + size]) for i in range(0, len(indices), size)]


def train_step(run: Heat2DRun, step: int) -> dict[str, float]:
    """One optimizer step over a global batch; returns its loss, grad norm and lr."""
    points = run.cfg.train.global_batch * run.cfg.heat2d.grid_size**2
    return optimizer_step(run, step, _microbatches(run, run.train_data,
                                                   run.sampler.local_indices(step)), points)


@torch.no_grad()
def evaluate(run: Heat2DRun) -> float:
    """Mean squared error over the validation fields."""
    mesh = run.mesh
    mine = list(range(mesh.coord(DP), len(run.val_data), mesh.size(DP)))
    total = run.engine.forward_backward(_microbatches(run, run.val_data, mine), 1.0, training=False)
    return total.total.item() / (len(run.val_data) * run.cfg.heat2d.grid_size**2)


def train(cfg: Config, mesh: Mesh, keep_params: bool = False) -> RunResult:
    """Train for ``cfg.train.steps`` steps; every rank of the mesh calls this."""
    run, result, records = build(cfg, mesh), RunResult(), []
    is_logger = mesh.rank == 0
    writer = MetricsWriter(cfg.metrics_path if is_logger else None,
                           run.start_step if cfg.train.resume else None)
    if is_logger:
        claim_records(Path(cfg.train.run_dir), run.run_id)
    if is_logger:
        print(describe(run), flush=True)
    progress = logs.Progress(cfg.train.steps, run.start_step, is_logger and cfg.train.progress,
                             cfg.train.log_every)
    guard = NonFiniteGuard(cfg.train.on_nonfinite, cfg.train.max_skips, run.skipped)
    start = time.perf_counter()
    for step in range(run.start_step, cfg.train.steps):
        t0 = time.perf_counter()
        record = train_step(run, step)
        elapsed = time.perf_counter() - t0
        if not result.state_bytes:
            result.state_bytes = _gather(state_bytes(run.engine.state_tensors()))
        record.update(step=step + 1, step_time_s=elapsed, tokens_per_s=record["tokens"] / elapsed,
                      **result.state_bytes[0])
        result.losses.append(record["loss"])
        last = step + 1 == cfg.train.steps
        if last or (cfg.train.eval_every and (step + 1) % cfg.train.eval_every == 0):
            record["val_loss"] = evaluate(run)
            result.val_losses.append((step + 1, record["val_loss"]))
        stop = guard.check(record, run.last_checkpoint) if "nonfinite_ranks" in record else None
        writer.write(record)
        if stop is not None:
            raise stop
        records.append(record)
        if cfg.train.save_every and (last or (step + 1) % cfg.train.save_every == 0):
            directory = Path(cfg.train.run_dir) / "checkpoints" / f"step-{step + 1}"
            checkpoint.save(directory, step + 1, run.engine, unet_config(cfg), cfg.describe_layout(),
                            run_meta={"run": run_record(cfg, run.run_id),
                                      "nonfinite": {"skipped": guard.skips}})
            run.last_checkpoint = str(directory)
        progress.update(record)
    progress.close()
    writer.close()
    return finish(cfg, run.engine, records, result, start, is_logger, keep_params)


def describe(run: Heat2DRun) -> str:
    cfg, h = run.cfg, run.cfg.heat2d
    G, (gh, gw) = h.grid_size, run.grid.shape
    return (f"paratrain: {cfg.describe_layout()}, task heat2d, U-Net "
            f"({unet_config(cfg).num_params() / 1e6:.3f}M params), {cfg.train.global_batch} fields "
            f"of {G}x{G} per step, each rank's block {G // gh}x{G // gw}, micro-batch "
            f"{cfg.micro_batch} x {cfg.accumulation} accumulation, boundary {h.boundary}\n"
            f"data: {len(run.train_data)} train / {len(run.val_data)} validation fields generated "
            f"from seed {cfg.train.seed}; a grid point counts as a token in the metrics")


def _gather(mine: dict[str, int]) -> list[dict[str, int]]:
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone
