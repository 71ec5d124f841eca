"""``paratrain plan --cluster local --calibrate``: measure this machine for the planner.

What the local cluster's time model needs, measured the way training ranks run (one
thread per process, ``torch.set_num_threads(1)``):

* **matmul curve**, fp32 and bf16: FLOP/s of GEMMs whose smallest dimension d runs from
  16 to 512 (as M, K and N in turn), fitted to the planner's saturating curve
  rate(d) = R·d/(d + half_dim) (``plan/compute.py``; ``fit_curve``).
* **eager costs**, per precision: a forward and backward of paratrain's ``small`` GPT
  at microbatches of 1 and 4 sequences. The time per extra sequence, against the time
  the planner counts for it at the matmul curve (``cost.step_time``), gives the
  efficiency (an eager block also runs norms, SwiGLU, RoPE, the attention kernel and,
  under autocast, casts that FLOP counts leave out); what a microbatch costs beyond its
  sequences is the fixed dispatch cost of its operators, per block.
* **AdamW rate**: parameters per second of one ``torch.optim.AdamW`` step.
* **gloo α and β** of all-reduce, all-gather, reduce-scatter and all-to-all, for worlds of 2 and 4
  processes: the mean time of each collective (averaging, as data parallelism runs
  it) at several sizes, then the least-squares fit of ``comm.cost.fit_alpha_beta``.

The GEMM and AdamW rates are the fastest of a few repeats (other work on the machine only
adds time); the model steps are the median of single steps, the statistic a run's step
time is reported in; the collectives' times are means of the slowest rank's (a
collective waits for it). Means, not medians: after compute, a gloo collective on this
kind of machine either finds its peers' threads awake or pays a wake-up of 2-4 ms, and
the median of such a two-valued sample flips between the two from one calibration to
the next (the 2-process all-to-all's α read 0.3, 0.8 and 1.2 ms in three calibrations),
while a step of many collectives pays their mean (1.3-2.0 ms in the same three).

Everything here imports torch lazily: ``paratrain.plan`` itself stays torch-free.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from ..paths import write_atomic
from .hardware import DEFAULT_CALIBRATION, Calibration

CURVE_DIMS = (16, 32, 64, 128, 256, 512)
"""Smallest dimension d of the timed GEMMs: the range a small model's per-rank shapes
span on CPU (tp-split widths, short microbatches)."""
CURVE_OTHER = 512
"""The other two dimensions of the timed GEMMs."""
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")
"""What data parallelism, ZeRO and Ulysses run; gloo's all-gather, reduce-scatter and
all-to-all do not cost what ring algorithms would next to its all-reduce, so each gets
its own fit."""
COLLECTIVE_SIZES = (64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)
"""Bytes of the timed collectives: from latency- to bandwidth-bound."""
EFFICIENCY_BATCH = 4
"""Largest microbatch (sequences) the model step is timed at; the other is 1."""
EFFICIENCY_STEPS = 7
"""Single model steps timed per microbatch size, after a warm-up; their median counts, as
a run's step time is the median of its steps (the fastest of a few means, kept for the
GEMMs, reads 8-14% faster than the median step on this kind of shared machine)."""
EFFICIENCY_SEQ = 128
"""Tokens per sequence of the timed model steps (the ``small`` preset's context)."""


def _best_time(call: Callable[[], object], budget_s: float = 0.15, repeats: int = 5) -> float:
    """Fastest over ``repeats`` of the mean time of ``call`` over about ``budget_s`` /
    ``repeats`` seconds of calls, after one warm-up call. The fastest, not the median:
    other work on the machine only ever adds time, and the planner predicts the
    machine's own speed."""
    call()
    times = []
    for _ in range(repeats):
        count, start = 0, time.perf_counter()
        while True:  # time-bounded, so a slow spell cannot stretch the measurement
            call()
            count += 1
            elapsed = time.perf_counter() - start
            if elapsed >= budget_s / repeats:
                break
        times.append(elapsed / count)
    return min(times)


def matmul_times(dtype_name: str) -> list[tuple[int, float]]:
    """(smallest dimension d, FLOP/s) of one thread's ``F.linear`` GEMMs with d as each of
    M, K and N in turn (the others ``CURVE_OTHER``), for every d in ``CURVE_DIMS``: total
    FLOPs over total time per d."""
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    big = CURVE_OTHER
    out = []
    for d in CURVE_DIMS:
        flops = seconds = 0.0
        for m, k, n in ((d, big, big), (big, d, big), (big, big, d)):
            # F.linear, as the model's layers run (on CPU its bf16 path is several
            # times faster than torch.mm's).
            a, w = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
            call = functools.partial(torch.nn.functional.linear, a, w)
            seconds += _best_time(call, budget_s=0.06, repeats=3)
            flops += 2 * m * k * n
        out.append((d, flops / seconds))
    return out


def fit_curve(samples: list[tuple[int, float]]) -> tuple[float, float]:
    """(asymptotic FLOP/s, half_dim) of the saturating curve rate(d) = R·d/(d + half_dim)
    (``plan/compute.py``) through (d, rate) samples: the least-squares line of 1/rate
    against 1/d, whose intercept is 1/R and slope half_dim/R. A negative slope (no
    saturation measured) gives half_dim 0 and the mean rate."""
    xs = [1 / d for d, _ in samples]
    ys = [1 / r for _, r in samples]
    n = len(samples)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    intercept = my - slope * mx
    if slope <= 0 or intercept <= 0:
        return n / sum(ys), 0.0
    return 1 / intercept, slope / intercept


def matmul_curve(dtype_name: str) -> tuple[float, float]:
    """(asymptotic FLOP/s, half_dim) of one thread's GEMMs in ``dtype_name``."""
    return fit_curve(matmul_times(dtype_name))


def _planned_compute(precision: str, rate: float, half_dim: float, b: int) -> float:
    """Seconds the planner counts for the ``small`` GPT's forward and backward on ``b``
    sequences at the curve (rate, half_dim), with efficiency 1 and no dispatch cost."""
    from ..models.gpt import PRESETS
    from ..layout import Layout
    from .candidate import Candidate, Training
    from .cost import step_time
    from .hardware import Calibration, local_cluster
    from .models import from_gpt_config

    curve = Calibration(matmul_flops={"fp32": rate, "bf16": rate}, cores=1, alpha=0.0,
                        beta=1.0, memory=1 << 30,
                        matmul_half_dim={"fp32": half_dim, "bf16": half_dim})
    model = from_gpt_config(PRESETS["small"], "small")
    return step_time(model, Training(b, EFFICIENCY_SEQ, precision), local_cluster(1, curve),
                     Candidate(Layout(), 0, b, 1)).compute


def _model_step(precision: str, b: int) -> tuple[Callable[[], None], float]:
    """A forward and backward of paratrain's ``small`` GPT on ``b`` sequences of
    ``EFFICIENCY_SEQ`` tokens (bf16: under autocast, as data parallelism runs it), and
    its FLOPs as the planner counts them."""
    import torch

    from ..models.gpt import GPT, PRESETS
    from .candidate import Training
    from .flops import step_flops
    from .models import from_gpt_config

    cfg = PRESETS["small"]
    torch.manual_seed(0)
    model = GPT(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (b, EFFICIENCY_SEQ))

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = model(tokens, tokens)
        loss.backward()
        model.zero_grad(set_to_none=True)

    flops = step_flops(from_gpt_config(cfg, "small"), Training(b, EFFICIENCY_SEQ, precision))
    return step, flops


def eager_costs(precision: str, rate: float, half_dim: float = 0.0) -> tuple[float, float]:
    """(efficiency, fixed seconds per block and microbatch) of the ``small`` GPT's
    forward and backward: the step time at 1 and ``EFFICIENCY_BATCH`` sequences is a
    line, its slope the per-sequence cost (efficiency = the planner's time per sequence
    at the matmul curve over it), its intercept the per-microbatch dispatch cost, spread
    over the blocks."""
    times = [_median_time(_model_step(precision, b)[0], EFFICIENCY_STEPS)
             for b in (1, EFFICIENCY_BATCH)]
    per_sequence = max((times[1] - times[0]) / (EFFICIENCY_BATCH - 1), 1e-9)
    planned = (_planned_compute(precision, rate, half_dim, EFFICIENCY_BATCH)
               - _planned_compute(precision, rate, half_dim, 1)) / (EFFICIENCY_BATCH - 1)
    efficiency = min(1.0, planned / per_sequence)
    from ..models.gpt import PRESETS

    return efficiency, max(0.0, times[0] - per_sequence) / PRESETS["small"].n_layers


def _median_time(call: Callable[[], object], runs: int) -> float:
    """Median seconds of ``runs`` single calls of ``call``, after one warm-up call."""
    call()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def reference_step_time(b: int = EFFICIENCY_BATCH, runs: int = 5) -> float:
    """Median seconds of ``runs`` single forward and backward steps of the ``small`` GPT
    (fp32, ``b`` sequences, one thread): the step ``eager_costs`` fits, timed again later
    to see how far the machine's own speed has moved since the calibration."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _median_time(_model_step("fp32", b)[0], runs)
    finally:
        torch.set_num_threads(threads)


def adamw_rate(numel: int = 1 << 21) -> float:
    """Parameters per second of one AdamW step (torch's default, foreach) on ``numel``
    parameters in tensors of a small model's sizes."""
    import torch

    params = [torch.nn.Parameter(torch.randn(numel // 16)) for _ in range(16)]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)
    return numel // 16 * 16 / _best_time(optimizer.step, budget_s=0.5, repeats=3)


def _collective_times(ops: list[str], sizes: list[int], iters: int
                      ) -> dict[str, list[float]] | None:
    """On every rank of a spawned world: for each op and size (nccl-tests' size: the
    full tensor), the mean over ``iters`` of the slowest rank's time (module docstring:
    why the mean). Rank 0 returns them, the others None."""
    import torch
    import torch.distributed as dist

    from ..comm import collectives as C

    group = dist.group.WORLD
    p = dist.get_world_size()
    times: dict[str, list[float]] = {op: [] for op in ops}
    for op in ops:
        for nbytes in sizes:
            full, part = torch.zeros(nbytes // 4), torch.zeros(nbytes // 4 // p)
            call = {"all-reduce": functools.partial(C.all_reduce, full, group, op="avg"),
                    "all-gather": functools.partial(C.all_gather, full, part, group),
                    "reduce-scatter": functools.partial(C.reduce_scatter, part, full, group,
                                                        op="avg"),
                    "all-to-all": functools.partial(C.all_to_all, torch.empty_like(full), full,
                                                    group)}[op]
            call()  # warm-up: connections, buffers
            samples = torch.zeros(iters, dtype=torch.float64)
            a = torch.randn(256, 256)
            for i in range(iters):
                dist.barrier(group)  # start together: no rank times its wait for a peer
                for _ in range(8):  # as in a training step, the collective follows compute:
                    a = torch.tanh(a @ a)  # gloo's threads have slept, caches hold other data
                start = time.perf_counter()
                call()
                samples[i] = time.perf_counter() - start
            dist.all_reduce(samples, op=dist.ReduceOp.MAX, group=group)  # the last rank's
            times[op].append(statistics.fmean(samples.tolist()))
    return times if dist.get_rank() == 0 else None


def collective_alpha_beta(n_procs: int, iters: int = 32) -> dict[str, list[float]]:
    """[α (s), β (bus bytes/s)] of each of ``COLLECTIVES`` for ``n_procs`` local
    processes."""
    from ..comm.cost import fit_alpha_beta
    from ..launch import spawn

    sizes = [n // (4 * n_procs) * 4 * n_procs for n in COLLECTIVE_SIZES]  # even chunks
    times = spawn(_collective_times, n_procs, list(COLLECTIVES), sizes, iters,
                  backend="gloo", timeout_s=300)[0]
    return {op: list(fit_alpha_beta(op, n_procs, sizes, times[op])) for op in COLLECTIVES}


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def total_memory() -> int:
    """Bytes of physical RAM."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return 8 * 2**30  # no sysconf (Windows): assume a modest machine


def compute_rates(log: Callable[[str], None] = print) -> dict:
    """The calibration's single-process measurements (matmul curves, eager model costs,
    AdamW rate), as ``Calibration`` fields: what ``calibrate`` measures before the
    collectives, and what drifts fastest on a shared machine."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as every training rank runs
    try:
        curves = {p: matmul_curve(p) for p in ("fp32", "bf16")}
        rates = {p: rate for p, (rate, _) in curves.items()}
        halves = {p: round(half, 2) for p, (_, half) in curves.items()}
        log("matmul, 1 thread  " + ", ".join(
            f"{p} {r / 1e9:.1f} GFLOP/s, half at d={halves[p]:.0f}" for p, r in rates.items()))
        costs = {p: eager_costs(p, rates[p], halves[p]) for p in rates}
        eff = {p: round(e, 4) for p, (e, _) in costs.items()}
        overhead = costs["fp32"][1]
        log("model efficiency  " + ", ".join(f"{p} {e:.0%}" for p, e in eff.items())
            + " of the matmul rate (small GPT, forward + backward), plus "
            f"{overhead * 1e3:.2f} ms per block and microbatch")
        adam = adamw_rate()
        log(f"AdamW step        {adam / 1e6:.1f} M params/s")
    finally:
        torch.set_num_threads(threads)
    return dict(matmul_flops=rates, matmul_half_dim=halves, compute_efficiency=eff,
                layer_overhead=overhead, optimizer_rate=adam)


def calibrate(worlds: tuple[int, ...] = (2, 4), log: Callable[[str], None] = print
              ) -> Calibration:
    """Measure everything the local cluster needs; ``log`` receives one line per result."""
    import torch

    rates = compute_rates(log)
    fits = comm_fits(worlds, log)
    cores = usable_cores()
    log(f"machine           {cores} cores, {total_memory() / 2**30:.1f} GiB RAM")
    return Calibration(cores=cores, memory=total_memory(), torch_version=torch.__version__,
                       **rates, **fits)


def comm_fits(worlds: tuple[int, ...] = (2, 4), log: Callable[[str], None] = print) -> dict:
    """gloo's α-β fits of every collective for each world size in ``worlds``, as
    ``Calibration`` fields (``comm``, and the first world's all-reduce as ``alpha``,
    ``beta`` and ``world_size``)."""
    comm = {}
    for n in worlds:
        comm[str(n)] = collective_alpha_beta(n)
        for op, (alpha, beta) in comm[str(n)].items():
            log(f"gloo {op:<15}{n} processes: alpha {alpha * 1e6:.0f} us, beta "
                f"{beta / 1e9:.2f} GB/s (bus bandwidth)")
    alpha, beta = comm[str(worlds[0])]["all-reduce"]
    return dict(comm=comm, alpha=alpha, beta=beta, world_size=worlds[0])


def write_calibration(calibration: Calibration, path: str | Path | None = None) -> Path:
    """Store ``calibration`` where ``hardware.load_calibration`` looks (default
    ``~/.cache/paratrain/calibration.json``); returns the path."""
    path = Path(path) if path else DEFAULT_CALIBRATION
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, calibration.to_json())  # never a half-written file for the planner to read
    return path
