"""The training loop, run by every rank. Reads top to bottom: build, then step, then report.

Loss normalisation: the model returns the *sum* of token losses over a microbatch; each
rank scales it by ``dp * cp / tokens_in_global_batch`` before backward, and the average of
gradients over the dp x cp group then equals the gradient of the mean loss over the whole
global batch — the same number a single process computes on the same batch, whatever the
data- or context-parallel size, the accumulation steps or the padding.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from ..layout import DP, PP
from ..mesh import Mesh
from ..optim import lr_at
from ..parallel.engine import Engine
from ..parallel.pipeline import gather_timeline
from ..api import build_model
from ..parallelize import parallelize
from . import checkpoint, logs
from . import data as D
from .config import Config
from .materialize import fill, initial_source
from .metrics import MetricsWriter, comm_metrics, state_bytes, summary
from .nonfinite import NonFiniteGuard, culprits
from .rundir import claim_records, continued_run_id, run_record


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


@dataclass
class Run:
    """Everything the steps share."""

    cfg: Config
    mesh: Mesh
    engine: Engine
    """The parallel model, its optimizer and its step (parallel/engine.py)."""
    train_data: D.Samples
    val_data: D.Samples
    sampler: D.DistributedSampler
    start_step: int = 0
    """Steps already taken (a resumed run starts there)."""
    run_id: str = ""
    """This run's identity, kept by its checkpoints (a resumed run keeps the one it resumes)."""
    last_checkpoint: str = ""
    """The newest checkpoint this run wrote or resumed from."""
    skipped: int = 0
    """Steps skipped as non-finite before ``start_step`` (kept by checkpoints)."""

    @property
    def is_logger(self) -> bool:
        return self.mesh.rank == 0


def build(cfg: Config, mesh: Mesh) -> Run:
    """Model, parallel wrapper, optimizer and data for this rank."""
    torch.manual_seed(cfg.train.seed)
    meta = checkpoint.read_meta(cfg.train.resume) if cfg.train.resume else {}
    run_id = continued_run_id(meta)
    engine, start_step = build_engine(cfg, mesh)
    train_tokens, val_tokens = D.load_tokens(cfg.data)
    train_data = D.Samples(train_tokens, cfg.data.seq_len)
    sampler = D.DistributedSampler(len(train_data), cfg.train.global_batch,
                                   dp_rank=mesh.coord(DP), dp_size=mesh.size(DP),
                                   seed=cfg.train.seed, remainder=cfg.data.remainder)
    return Run(cfg, mesh, engine, train_data, D.Samples(val_tokens, cfg.data.seq_len), sampler,
               start_step, run_id, cfg.train.resume, checkpoint.skipped_steps(meta))


def build_engine(cfg: Config, mesh: Mesh) -> tuple[Engine, int]:
    """This rank's engine with its share of the weights, and the steps already taken. The
    model is built without storage; each rank materialises only its share
    (train/materialize.py), from the checkpoint it resumes, else the Hugging Face weights
    or the seeded initialiser."""
    engine = parallelize(build_model(cfg, mesh.device, meta=True), mesh, cfg)
    if cfg.train.resume:  # each rank reads the slices of its own shards (train/checkpoint.py)
        return engine, checkpoint.load_into(engine, cfg.train.resume, cfg.model)
    fill(engine, initial_source(cfg))
    return engine, 0


def train_step(run: Run, step: int) -> dict[str, float]:
    """One optimizer step over a global batch; returns its loss, grad norm and lr."""
    tokens = D.valid_tokens(run.sampler.global_indices(step), run.cfg.data.seq_len)
    return optimizer_step(run, step, _microbatches(run, run.train_data,
                                                   run.sampler.local_indices(step)), tokens)


def optimizer_step(run, step: int, microbatches: list, count: int) -> dict[str, float]:
    """Forward and backward over this rank's ``microbatches``, their summed losses divided
    by ``count`` (the global batch's tokens or points: the same on every rank), then clip
    and step. Every task's step (language model, heat2d) is this one."""
    cfg, engine = run.cfg, run.engine
    engine.zero_grad()
    loss = engine.forward_backward(microbatches, loss_scale=1 / count)
    grad_norm = engine.clip_grad_norm_(cfg.optim.grad_clip)
    loss_sum, norm = torch.stack([loss.total, grad_norm.float()]).tolist()  # the one host sync
    lr = lr_at(step, cfg.train.steps, cfg.optim)
    record = {"loss": loss_sum / count, "grad_norm": norm, "lr": lr, "tokens": count}
    if not (math.isfinite(loss_sum) and math.isfinite(norm)):
        engine.forget_nonfinite()  # so a skipped step's NaN does not poison the next ones
        return {**record, "nonfinite_ranks": culprits(loss.local)}  # no update: the loop decides
    engine.step(lr)
    return record


def _microbatches(run: Run, samples: D.Samples, indices: list[int]) -> list[tuple[torch.Tensor, ...]]:
    """This data-parallel rank's samples ``indices``, cut into microbatches."""
    size = run.cfg.micro_batch
    return [samples.batch(indices[i:i + size], run.mesh.device) for i in range(0, len(indices), size)]


@torch.no_grad()
def evaluate(run: Run) -> float:
    """Mean loss over the first ``eval_batches`` global batches of validation data."""
    cfg, mesh = run.cfg, run.mesh
    total, count = 0.0, 0
    share = cfg.train.global_batch // mesh.size(DP)
    for b in range(cfg.train.eval_batches):
        indices = D.eval_indices(len(run.val_data), cfg.train.global_batch, b)
        count += D.valid_tokens(indices, cfg.data.seq_len)
        mine = indices[mesh.coord(DP) * share:(mesh.coord(DP) + 1) * share]
        total += run.engine.forward_backward(_microbatches(run, run.val_data, mine), 1.0,
                                             training=False).total.item()
    return total / max(count, 1)


def train(cfg: Config, mesh: Mesh, keep_params: bool = False) -> RunResult:
    """Train for ``cfg.train.steps`` steps; every rank of the mesh calls this."""
    if cfg.train.task == "heat2d":  # the U-Net task has its own build and step
        from .task_heat2d import train as train_heat2d

        return train_heat2d(cfg, mesh, keep_params)
    run = build(cfg, mesh)
    result = RunResult()
    resumed_at = run.start_step if cfg.train.resume else None  # append after its records
    writer = MetricsWriter(cfg.metrics_path if run.is_logger else None, resumed_at)
    if run.is_logger:
        claim_records(Path(cfg.train.run_dir), run.run_id)
    sinks = _sinks(cfg, resumed_at) if run.is_logger else []
    if run.is_logger:
        print(describe(run), flush=True)
    progress = logs.Progress(cfg.train.steps, run.start_step, run.is_logger and cfg.train.progress,
                             cfg.train.log_every)
    profiler = logs.Profiler(logs.ProfileWindow.parse(cfg.train.profile, cfg.train.steps),
                             Path(cfg.train.run_dir), mesh.rank, mesh.device)
    flops = _flops_per_token(cfg)
    peak = logs.peak_flops(mesh.device, cfg.train.precision, mesh.layout.world_size)
    records = []
    guard = NonFiniteGuard(cfg.train.on_nonfinite, cfg.train.max_skips, run.skipped)
    start = time.perf_counter()
    for step in range(run.start_step, cfg.train.steps):
        profiler.before(step + 1)
        t0 = time.perf_counter()
        record = train_step(run, step)  # its host read of the loss waits for the device
        elapsed = time.perf_counter() - t0
        if not result.state_bytes:  # after the first step run: optimizer state exists
            result.state_bytes = _gather(state_bytes(run.engine.state_tensors()))
        record.update(step=step + 1, step_time_s=elapsed, tokens_per_s=record["tokens"] / elapsed,
                      mfu=flops * record["tokens"] / elapsed / peak if peak else None,
                      **result.state_bytes[0], **comm_metrics(run.engine))
        result.losses.append(record["loss"])
        last = step + 1 == cfg.train.steps
        evaluating = last or (cfg.train.eval_every and (step + 1) % cfg.train.eval_every == 0)
        if evaluating and len(run.val_data) > 0:  # no validation set: no validation loss
            record["val_loss"] = evaluate(run)
            result.val_losses.append((step + 1, record["val_loss"]))
        if last or (step + 1) % cfg.train.log_every == 0:  # same steps on every rank: collective
            record["peak_mem_bytes"] = _gather_peak_memory(mesh)
        stop = guard.check(record, run.last_checkpoint) if "nonfinite_ranks" in record else None
        for sink in [writer, *sinks]:
            sink.write(record)
        if stop is not None:
            raise stop
        records.append(record)
        if cfg.train.save_every and (last or (step + 1) % cfg.train.save_every == 0):
            _save(run, step + 1, guard.skips)
        trace = profiler.after(step + 1)
        if trace is not None and run.is_logger:
            print(f"profile       {trace} (and one file per rank)", flush=True)
        progress.update(record)
    progress.close()
    for sink in [writer, *sinks]:
        sink.close()
    if run.engine.plan.recorder is not None:
        _save_timeline(run)
    return finish(cfg, run.engine, records, result, start, run.is_logger, keep_params)


def finish(cfg: Config, engine, records: list[dict], result: RunResult, start: float,
           is_logger: bool, keep_params: bool) -> RunResult:
    """The closing summary on the logging rank; the final parameters when asked for
    (collective: every rank calls this)."""
    if is_logger:
        print(summary(records, result.state_bytes, time.perf_counter() - start), flush=True)
        print(f"metrics       {cfg.metrics_path}", flush=True)
    if keep_params:
        result.params = {k: v.cpu() for k, v in engine.full_state_dict().items()}
    return result


def _sinks(cfg: Config, resumed_at: int | None = None) -> list:
    names = logs.parse_sinks(cfg.train.log)
    config = {"layout": cfg.describe_layout(), "model": cfg.model_preset, "seed": cfg.train.seed}
    return logs.make_sinks(names, Path(cfg.train.run_dir), config, resume_step=resumed_at)


def _flops_per_token(cfg: Config) -> float:
    m = cfg.model
    untied = 0 if m.tie_embeddings else 1
    matmul = m.num_params() - 2 * m.d_model * m.n_layers - m.d_model - untied * m.vocab_size * m.d_model
    return logs.flops_per_token(m.n_layers, m.d_model, cfg.data.seq_len, matmul)


def _gather_peak_memory(mesh: Mesh) -> list[int]:
    mine = torch.tensor([logs.peak_memory_bytes(mesh.device)], dtype=torch.int64, device=mesh.device)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [int(t.item()) for t in everyone]


def _save(run: Run, step: int, skipped: int) -> None:
    cfg = run.cfg
    directory = Path(cfg.train.run_dir) / "checkpoints" / f"step-{step}"
    # The data position: the sampler's order is a function of (seed, global batch, step).
    data = {"step": step, "samples_seen": step * cfg.train.global_batch, **cfg.data_order()}
    run_meta = {"run": run_record(cfg, run.run_id), "data": data, "nonfinite": {"skipped": skipped}}
    checkpoint.save(directory, step, run.engine, cfg.model, cfg.describe_layout(),
                    run_meta=run_meta)
    run.last_checkpoint = str(directory)


def _save_timeline(run: Run) -> None:
    """Gather the pipeline's recorded steps (collective over pp) and save them."""
    p = run.cfg.parallel
    timeline = gather_timeline(run.engine.plan.recorder, run.mesh.group(PP), p.schedule, run.cfg.accumulation,
                               p.virtual_stages)
    if run.is_logger:
        path = Path(run.cfg.train.run_dir) / "timeline.json"
        timeline.save(path)
        print(f"timeline      {path} (measured bubble {timeline.bubble():.1%}; "
              f"`paratrain trace --run {path}` draws it)", flush=True)


def describe(run: Run) -> str:
    cfg, s = run.cfg, run.sampler
    remainder = ("pad: the last batch of each epoch is padded and masked" if cfg.data.remainder == "pad"
                 else f"drop: {s.dropped_per_epoch} samples per epoch that do not fill a global batch are skipped")
    return (f"paratrain: {cfg.describe_layout()}, model {cfg.describe_model()} "
            f"({cfg.model.num_params() / 1e6:.2f}M params), {cfg.train.global_batch} x "
            f"{cfg.data.seq_len} tokens per step, micro-batch {cfg.micro_batch} x "
            f"{cfg.accumulation} {'pipeline microbatches' if cfg.parallel.pp > 1 else 'accumulation'}, "
            f"{cfg.train.precision}\n"
            f"data: {len(run.train_data)} train samples, {s.steps_per_epoch} steps per epoch; "
            f"remainder {remainder}" + _offload_note(run))


def _offload_note(run: Run) -> str:
    if not run.cfg.parallel.offload:
        return ""
    if run.mesh.device.type != "cuda":
        return "\noffload: this run computes on the CPU already, so --offload has no effect"
    return "\noffload: optimizer state (fp32 masters, Adam moments) kept in CPU memory"


def _gather(mine: dict[str, int]) -> list[dict[str, int]]:
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone
