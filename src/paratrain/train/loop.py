"""The training loop, run by every rank. Reads top to bottom: build, then step, then report.

Loss normalisation: the model returns the *sum* of token losses over a microbatch; each
rank scales it by ``dp * cp / tokens_in_global_batch`` before backward, and the average of
gradients over the dp x cp group then equals the gradient of the mean loss over the whole
global batch — the same number a single process computes on the same batch, whatever the
data- or context-parallel size, the accumulation steps or the padding.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from ..comm import collectives as C
from ..mesh import Mesh
from ..models import hf
from ..models.gpt import GPT
from ..optim import lr_at
from ..parallel.context import shard_batch
from ..parallel.pipeline import Recorder, forward_schedule, gather_timeline, run_schedule, schedule
from ..parallelize import parallelize
from . import checkpoint, logs
from . import data as D
from .config import Config
from .metrics import MetricsWriter, comm_metrics, state_bytes, summary
from .nonfinite import NonFiniteGuard, culprits


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
    engine: torch.nn.Module
    """The parallel model and its optimizer (parallel/engine.py)."""
    train_data: D.Samples
    val_data: D.Samples
    sampler: D.DistributedSampler
    recorder: Recorder | None = None
    """Collects this rank's pipeline timeline when ``train.timeline`` is set."""
    start_step: int = 0
    """Steps already taken (a resumed run starts there)."""
    run_id: str = ""
    """This run's identity, kept by its checkpoints (a resumed run keeps the one it resumes)."""
    last_checkpoint: str = ""
    """The newest checkpoint this run wrote or resumed from."""

    @property
    def is_logger(self) -> bool:
        return self.mesh.rank == 0


def build(cfg: Config, mesh: Mesh) -> Run:
    """Model, parallel wrapper, optimizer and data for this rank."""
    torch.manual_seed(cfg.train.seed)  # same initial weights on every rank
    model = GPT(cfg.model).to(mesh.device)
    start_step, state = checkpoint.load(cfg.train.resume, cfg.model) if cfg.train.resume else (0, None)
    run_id = (checkpoint.read_meta(cfg.train.resume).get("run", {}).get("id") if cfg.train.resume
              else None) or uuid.uuid4().hex
    if state is not None:  # the plain model takes the full tensors; parallelize cuts them
        model.load_state_dict(state["param"])
    elif hf.is_model_dir(cfg.model_preset):  # a Hugging Face directory: start from its weights
        model.load_state_dict(hf.load_weights(cfg.model_preset, cfg.model))
    engine = parallelize(model, mesh, cfg)
    if state is not None:
        engine.load_optimizer_state(state, start_step)
    train_tokens, val_tokens = D.load_tokens(cfg.data)
    train_data = D.Samples(train_tokens, cfg.data.seq_len)
    sampler = D.DistributedSampler(len(train_data), cfg.train.global_batch,
                                   dp_rank=mesh.coord("dp"), dp_size=mesh.size("dp"),
                                   seed=cfg.train.seed, remainder=cfg.data.remainder)
    recorder = Recorder(rank=mesh.coord("pp")) if cfg.train.timeline and cfg.parallel.pp > 1 else None
    return Run(cfg, mesh, engine, train_data, D.Samples(val_tokens, cfg.data.seq_len), sampler,
               recorder, start_step, run_id, cfg.train.resume)


def train_step(run: Run, step: int) -> dict[str, float]:
    """One optimizer step over a global batch; returns its loss, grad norm and lr."""
    cfg, mesh, engine = run.cfg, run.mesh, run.engine
    local = run.sampler.local_indices(step)
    global_tokens = D.valid_tokens(run.sampler.global_indices(step), cfg.data.seq_len)
    scale = mesh.size("dp-cp") / global_tokens
    engine.zero_grad()
    micro = [local[i:i + cfg.micro_batch] for i in range(0, len(local), cfg.micro_batch)]
    if cfg.parallel.pp > 1:
        loss_sum = _pipeline(run, run.train_data, micro, scale, training=True)
    else:
        loss_sum = _accumulate(run, micro, scale)
    engine.finish_grad_sync()
    local_loss = loss_sum.clone()  # names the rank if the total turns out not finite
    _sum_loss(loss_sum, mesh)
    grad_norm = engine.clip_grad_norm_(cfg.optim.grad_clip)
    lr = lr_at(step, cfg.train.steps, cfg.optim)
    record = {"loss": loss_sum.item() / global_tokens, "grad_norm": grad_norm, "lr": lr,
              "tokens": global_tokens}
    if not (math.isfinite(record["loss"]) and math.isfinite(grad_norm)):
        return {**record, "nonfinite_ranks": culprits(local_loss)}  # no update: the loop decides
    engine.step(lr)
    return record


def _accumulate(run: Run, micro: list[list[int]], scale: float) -> torch.Tensor:
    """Forward and backward of each microbatch in turn; gradients accumulate."""
    loss_sum = torch.zeros((), device=run.mesh.device)
    for i, indices in enumerate(micro):
        tokens, targets, positions = _local_batch(run.train_data, indices, run.mesh)
        last = i == len(micro) - 1
        # Only the last microbatch's backward reduces gradients; the context must cover
        # backward, which is where the reduction is launched.
        with contextlib.nullcontext() if last else run.engine.no_sync():
            with _autocast(run.cfg, run.mesh):
                loss = run.engine(tokens, targets, positions)
            (loss * scale).backward()
        loss_sum += loss.detach().float()
    return loss_sum


def _pipeline(run: Run, samples: D.Samples, micro: list[list[int]], scale: float,
              training: bool) -> torch.Tensor:
    """This rank's part of the pipeline schedule over the microbatches (forward only when
    not training); the summed loss is non-zero on the last stage only."""
    cfg, mesh = run.cfg, run.mesh
    p = cfg.parallel
    batches = [_local_batch(samples, indices, mesh) for indices in micro]
    seq = batches[0][0].shape[1]
    positions = batches[0][2]
    if p.sp:  # the stream between stages is cut along the sequence; attention sees all of it
        positions = positions if positions is not None else torch.arange(seq, device=mesh.device)
        seq //= p.tp
    tables = (schedule(p.schedule, p.pp, len(micro), p.virtual_stages) if training
              else forward_schedule(p.pp, len(micro), p.virtual_stages))
    dtype = next(run.engine.module.parameters()).dtype
    return run_schedule(tables[mesh.coord("pp")], list(run.engine.module),
                        [(t, y) for t, y, _ in batches], mesh.group("pp"), scale, mesh.device,
                        act_shape=(cfg.micro_batch, seq, cfg.model.d_model), act_dtype=dtype,
                        no_sync=run.engine.no_sync if training else None, positions=positions,
                        recorder=run.recorder if training else None,
                        autocast=lambda: _autocast(cfg, mesh)).detach().float()


def _sum_loss(loss_sum: torch.Tensor, mesh: Mesh) -> None:
    """Total loss over the pipeline (only its last stage has it) and the dp x cp ranks."""
    C.all_reduce(loss_sum, mesh.group("pp"))
    C.all_reduce(loss_sum, mesh.group("dp-cp"))


@torch.no_grad()
def evaluate(run: Run) -> float:
    """Mean loss over the first ``eval_batches`` global batches of validation data."""
    cfg, mesh = run.cfg, run.mesh
    total = torch.zeros((), device=mesh.device)
    count = 0
    share = cfg.train.global_batch // mesh.size("dp")
    for b in range(cfg.train.eval_batches):
        indices = D.eval_indices(len(run.val_data), cfg.train.global_batch, b)
        count += D.valid_tokens(indices, cfg.data.seq_len)
        mine = indices[mesh.coord("dp") * share:(mesh.coord("dp") + 1) * share]
        micro = [mine[i:i + cfg.micro_batch] for i in range(0, share, cfg.micro_batch)]
        if cfg.parallel.pp > 1:
            total += _pipeline(run, run.val_data, micro, 1.0, training=False)
            continue
        for indices_mb in micro:
            tokens, targets, positions = _local_batch(run.val_data, indices_mb, mesh)
            with _autocast(cfg, mesh):
                total += run.engine.module(tokens, targets, positions).float()
    _sum_loss(total, mesh)
    return total.item() / max(count, 1)


def train(cfg: Config, mesh: Mesh, keep_params: bool = False) -> RunResult:
    """Train for ``cfg.train.steps`` steps; every rank of the mesh calls this."""
    if cfg.train.task == "heat2d":  # the U-Net task has its own build and step
        from .task_heat2d import train as train_heat2d

        return train_heat2d(cfg, mesh, keep_params)
    run = build(cfg, mesh)
    result = RunResult()
    resumed_at = run.start_step if cfg.train.resume else None  # append after its records
    writer = MetricsWriter(cfg.metrics_path if run.is_logger else None, resumed_at)
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
    guard = NonFiniteGuard(cfg.train.on_nonfinite, cfg.train.max_skips)
    start = time.perf_counter()
    for step in range(run.start_step, cfg.train.steps):
        profiler.before(step + 1)
        t0 = time.perf_counter()
        record = train_step(run, step)
        _sync(mesh)
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
            _save(run, step + 1)
        trace = profiler.after(step + 1)
        if trace is not None and run.is_logger:
            print(f"profile       {trace} (and one file per rank)", flush=True)
        progress.update(record)
    progress.close()
    for sink in [writer, *sinks]:
        sink.close()
    if run.recorder is not None:
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
    config = {"layout": cfg.layout.describe(), "model": cfg.model_preset, "seed": cfg.train.seed}
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


def _save(run: Run, step: int) -> None:
    cfg = run.cfg
    directory = Path(cfg.train.run_dir) / "checkpoints" / f"step-{step}"
    # The data position: the sampler's order is a function of (seed, global batch, step).
    data = {"step": step, "samples_seen": step * cfg.train.global_batch, "seed": cfg.train.seed,
            "global_batch": cfg.train.global_batch, **dataclasses.asdict(cfg.data)}
    run_meta = {"run": {"id": run.run_id, "seed": cfg.train.seed, "config": dataclasses.asdict(cfg)},
                "data": data}
    checkpoint.save(directory, step, run.engine, cfg.model, cfg.layout.describe(),
                    is_writer=run.is_logger, run_meta=run_meta)
    run.last_checkpoint = str(directory)


def _save_timeline(run: Run) -> None:
    """Gather the pipeline's recorded steps (collective over pp) and save them."""
    p = run.cfg.parallel
    timeline = gather_timeline(run.recorder, run.mesh.group("pp"), p.schedule, run.cfg.accumulation,
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
    return (f"paratrain: {cfg.layout.describe()}, model {cfg.model_preset} "
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


def _local_batch(samples: D.Samples, indices: list[int], mesh: Mesh):
    """This rank's tokens, targets and their positions in the sequence: the whole
    sequences, or under context parallelism this rank's load-balanced share of each."""
    tokens, targets = samples.batch(indices, mesh.device)
    if mesh.size("cp") == 1:
        return tokens, targets, None
    return shard_batch(tokens, targets, mesh.coord("cp"), mesh.size("cp"))


def _autocast(cfg: Config, mesh: Mesh):
    # bf16 under plain DDP: autocast over fp32 weights. Under ZeRO the weights themselves
    # are bf16 (with fp32 masters in the sharded optimizer) and need no autocast.
    enabled = cfg.train.precision == "bf16" and not cfg.parallel.zero
    return torch.autocast(mesh.device.type, dtype=torch.bfloat16, enabled=enabled)


def _sync(mesh: Mesh) -> None:
    if mesh.device.type == "cuda":
        torch.cuda.synchronize()


def _gather(mine: dict[str, int]) -> list[dict[str, int]]:
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone
