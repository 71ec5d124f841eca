"""The training loop, run by every rank for any task. Reads top to bottom: build, then
step, then report. What differs between tasks (the model, its data, what a loss unit is,
validation) is the task's (train/task.py); the loss normalisation each task uses is in
its own module (task_NAME.py).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from .. import console
from ..layout import PP
from ..mesh import Mesh
from ..optim import lr_at
from ..parallel.compile import compile_seconds
from ..parallel.pipeline import gather_timeline
from . import checkpoint, logs
from .config import Config
from .metrics import MetricsWriter, comm_metrics, state_bytes, summary
from .nonfinite import NonFiniteGuard, culprits
from .rundir import claim_records, run_record
from .async_save import AsyncSaver
from .preempt import Preemption, write_marker
from .saved import how_to_resume, keep_newest
from .task import Run, task_for

log = console.get(__name__)


@dataclass
class RunResult:
    """What one rank saw."""

    losses: list[float] = field(default_factory=list)
    """Training loss of every step (mean over the global batch's tokens)."""
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    """(step, validation loss) of every evaluation."""
    state_bytes: list[dict[str, int]] = field(default_factory=list)
    """Bytes of parameters, gradients and optimizer state on every rank."""
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    """Final parameters of this rank's model (if asked for)."""
    preempted_at: int | None = None
    """The step a preemption signal stopped the run after (train/preempt.py), or None."""
    compile_s: float | None = None
    """Seconds this rank spent compiling (``--compile``), or None without it."""


def build(cfg: Config, mesh: Mesh) -> Run:
    """Model, parallel wrapper, optimizer and data for this rank, as its task builds them."""
    return task_for(cfg).build(cfg, mesh)


def train_step(run: Run, step: int) -> dict[str, float]:
    """One optimizer step over a global batch; returns its loss, grad norm and lr."""
    microbatches = run.task.microbatches(run, run.train_data, run.sampler.local_indices(step))
    return optimizer_step(run, step, microbatches, run.task.count(run, step))


def optimizer_step(run: Run, step: int, microbatches: list, count: int) -> dict[str, float]:
    """Forward and backward over this rank's ``microbatches``, their summed losses divided
    by ``count`` (the global batch's tokens or points: the same on every rank), then clip
    and step."""
    cfg, engine = run.cfg, run.engine
    engine.zero_grad()
    loss = engine.forward_backward(microbatches, loss_scale=1 / count)
    grad_norm = engine.clip_grad_norm_(cfg.optim.grad_clip)
    loss_sum, norm = torch.stack([loss.total, grad_norm.float()]).tolist()  # the one host sync
    lr = lr_at(step, cfg.train.steps, cfg.optim)
    record = {"loss": loss_sum / count, "grad_norm": norm, "lr": lr, "tokens": count}
    finite = math.isfinite(loss_sum) and math.isfinite(norm)
    if engine.plan.balance is not None:  # mixture of experts: the step's routing (collective)
        record.update(engine.plan.balance.after_step(cfg.train.global_batch, update=finite))
    if not finite:
        engine.reducer.undo_step()  # so a skipped step's NaN does not poison the next ones
        return {**record, "nonfinite_ranks": culprits(loss.local)}  # no update: the loop decides
    engine.step(lr)
    return record


def evaluate(run: Run) -> float | None:
    """The task's validation loss (collective), or None without validation data."""
    return run.task.evaluate(run)


def train(cfg: Config, mesh: Mesh, keep_params: bool = False) -> RunResult:
    """Train for ``cfg.train.steps`` steps; every rank of the mesh calls this."""
    run = build(cfg, mesh)
    result = RunResult()
    resumed_at = run.start_step if cfg.train.resume else None  # append after its records
    writer = MetricsWriter(cfg.metrics_path if run.is_logger else None, resumed_at)
    if run.is_logger:
        claim_records(Path(cfg.train.run_dir), run.run_id)
    sinks = _sinks(run, resumed_at) if run.is_logger else []
    if run.is_logger:
        log.info(run.task.describe(run))
    progress = logs.Progress(cfg.train.steps, run.start_step,
                             run.is_logger and cfg.train.progress and not cfg.train.quiet, cfg.train.log_every)
    profiler = logs.Profiler(logs.ProfileWindow.parse(cfg.train.profile, cfg.train.steps),
                             Path(cfg.train.run_dir), mesh.rank, mesh.device)
    flops = run.task.flops_per_unit(cfg)
    peak = logs.peak_flops(mesh.device, cfg.train.compute_precision, mesh.layout.world_size)
    records = []
    guard = NonFiniteGuard(cfg.train.on_nonfinite, cfg.train.max_skips, run.skipped)
    saver = (AsyncSaver(mesh.rank, mesh.layout.world_size, cfg.parallel.timeout_s, pin=mesh.device.type == "cuda")
             if cfg.train.async_save else None)
    start = time.perf_counter()
    with Preemption() as preempt:
        for step in range(run.start_step, cfg.train.steps):
            profiler.before(step + 1)
            record = _measured_step(run, step, result, flops, peak)
            last = step + 1 == cfg.train.steps
            stop = guard.check(record, run.last_checkpoint) if "nonfinite_ranks" in record else None
            for sink in [writer, *sinks]:
                sink.write(record)
            if stop is not None:
                raise stop
            records.append(record)
            saving = bool(cfg.train.save_every) and (last or (step + 1) % cfg.train.save_every == 0)
            if saving:
                _save(run, step + 1, guard.skips, saver)
            trace = profiler.after(step + 1)
            if trace is not None and run.is_logger:
                log.info(f"profile       {trace} (and one file per rank)")
            progress.update(record)
            if not last and preempt.agreed(mesh.device):  # a scheduler wants the machines back
                if not saving:
                    _save(run, step + 1, guard.skips, saver)
                result.preempted_at = step + 1
                break
    progress.close()
    if saver is not None:  # the last save, published or failed on every rank
        _published(run, saver.wait(checkpoint.agree))
    if result.preempted_at and run.is_logger:
        marker = write_marker(Path(cfg.train.run_dir), result.preempted_at, run.last_checkpoint,
                              how_to_resume(cfg))
        log.info(f"preempted     at step {result.preempted_at}: saved {run.last_checkpoint} ({marker})")
    for sink in [writer, *sinks]:
        sink.close()
    if run.engine.plan.recorder is not None:
        _save_timeline(run)
    return finish(cfg, run.engine, records, result, start, run.is_logger, keep_params)


def _measured_step(run: Run, step: int, result: RunResult, flops: float | None,
                   peak: float | None) -> dict:
    """One step with its record: time, throughput, state bytes, traffic, and the
    evaluation and peak memory on the steps that take them (collective)."""
    cfg, mesh = run.cfg, run.mesh
    t0 = time.perf_counter()
    record = train_step(run, step)  # its host read of the loss waits for the device
    elapsed = time.perf_counter() - t0
    if not result.state_bytes:  # after the first step run: optimizer state exists
        result.state_bytes = _gather(state_bytes(run.engine.state_tensors()))
    record.update(step=step + 1, step_time_s=elapsed, tokens_per_s=record["tokens"] / elapsed,
                  mfu=flops * record["tokens"] / elapsed / peak if peak and flops else None,
                  **result.state_bytes[0], **comm_metrics(run.engine))
    result.losses.append(record["loss"])
    last = step + 1 == cfg.train.steps
    evaluating = last or (cfg.train.eval_every and (step + 1) % cfg.train.eval_every == 0)
    val_loss = evaluate(run) if evaluating else None
    if val_loss is not None:  # no validation set: no validation loss
        record["val_loss"] = val_loss
        result.val_losses.append((step + 1, val_loss))
    if last or (step + 1) % cfg.train.log_every == 0:  # same steps on every rank: collective
        record["peak_mem_bytes"] = _gather_peak_memory(mesh)
        record["peak_mem_is"] = logs.peak_memory_kind(mesh.device)
    return record


def finish(cfg: Config, engine, records: list[dict], result: RunResult, start: float,
           is_logger: bool, keep_params: bool) -> RunResult:
    """The closing summary on the logging rank; the final parameters when asked for
    (collective: every rank calls this)."""
    if cfg.train.compile:
        result.compile_s = compile_seconds()
    if is_logger:
        log.info(summary(records, result.state_bytes, time.perf_counter() - start, result.compile_s))
        log.info(f"metrics       {cfg.metrics_path}")
    if keep_params:
        result.params = {k: v.cpu() for k, v in engine.full_state_dict().items()}
    return result


def _sinks(run: Run, resumed_at: int | None = None) -> list:
    cfg = run.cfg
    names = logs.parse_sinks(cfg.train.log)
    config = {"layout": cfg.describe_layout(), "task": cfg.train.task,
              "model": run.task.model_label(cfg), "seed": cfg.train.seed}
    return logs.make_sinks(names, Path(cfg.train.run_dir), config, resume_step=resumed_at)


def _gather_peak_memory(mesh: Mesh) -> list[int]:
    mine = torch.tensor([logs.peak_memory_bytes(mesh.device)], dtype=torch.int64, device=mesh.device)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [int(t.item()) for t in everyone]


def _save(run: Run, step: int, skipped: int, saver: AsyncSaver | None = None) -> None:
    cfg = run.cfg
    directory = Path(cfg.train.run_dir) / "checkpoints" / f"step-{step}"
    run_meta = {"run": run_record(cfg, run.run_id), "nonfinite": {"skipped": skipped}}
    data = run.task.data_position(cfg, step)
    if data is not None:
        run_meta["data"] = data
    if saver is not None:  # the previous one, published now (or its failure raised)
        meta = checkpoint.index_meta(step, run.task.model_config(cfg), cfg.describe_layout(), run_meta)
        _published(run, saver.submit(directory, run.engine, meta, checkpoint.agree))
        return
    checkpoint.save(directory, step, run.engine, run.task.model_config(cfg), cfg.describe_layout(),
                    run_meta=run_meta)
    _published(run, directory)


def _published(run: Run, directory: Path | None) -> None:
    """``directory`` is a whole checkpoint now: the newest, and old ones may go."""
    if directory is None:
        return
    run.last_checkpoint = str(directory)
    if run.cfg.train.keep_last and run.is_logger:  # after the new one is published, whole
        keep_newest(Path(run.cfg.train.run_dir), run.cfg.train.keep_last)


def _save_timeline(run: Run) -> None:
    """Gather the pipeline's recorded steps (collective over pp) and save them."""
    p = run.cfg.parallel
    timeline = gather_timeline(run.engine.plan.recorder, run.mesh.group(PP), p.schedule, run.cfg.accumulation,
                               p.virtual_stages)
    if run.is_logger:
        path = Path(run.cfg.train.run_dir) / "timeline.json"
        timeline.save(path)
        log.info(f"timeline      {path} (measured bubble {timeline.bubble():.1%}; "
              f"`paratrain trace --run {path}` draws it)")


def _gather(mine: dict[str, int]) -> list[dict[str, int]]:
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone
