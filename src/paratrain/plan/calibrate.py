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
* **MoE costs**: the same step with a mixture of experts in every block, against the
  planner's count: what each expert's operators and each routed row's router and
  permutation kernels cost beyond it (``moe_costs``).
* **AdamW rate**: parameters per second of one ``torch.optim.AdamW`` step.
* **gloo α and β** of all-reduce, all-gather, reduce-scatter and all-to-all, for worlds of 2 and 4
  processes: the mean time of each collective (averaging, as data parallelism runs
  it) at several sizes, then the least-squares fit of ``comm.cost.fit_alpha_beta``.

The GEMM and AdamW rates are the fastest of a few repeats (other work on the machine only
adds time); the model steps are the median of single steps, the statistic a run's step
time is reported in; the collectives' times are means (``plan/calibrate_comm.py``
says why).

Everything here imports torch lazily: ``paratrain.plan`` itself stays torch-free.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from ..paths import write_atomic
from .calibrate_comm import comm_fits
from .hardware import DEFAULT_CALIBRATION, Calibration

CURVE_DIMS = (16, 32, 64, 128, 256, 512)
"""Smallest dimension d of the timed GEMMs: the range a small model's per-rank shapes
span on CPU (tp-split widths, short microbatches)."""
CURVE_OTHER = 512
"""The other two dimensions of the timed GEMMs."""
EFFICIENCY_BATCH = 4
"""Largest microbatch (sequences) the model step is timed at; the other is 1."""
EFFICIENCY_STEPS = 7
"""Single model steps timed per microbatch size, after a warm-up; their median counts, as
a run's step time is the median of its steps (the fastest of a few means, kept for the
GEMMs, reads 8-14% faster than the median step on this kind of shared machine)."""
EFFICIENCY_SEQ = 128
"""Tokens per sequence of the timed model steps (the ``small`` preset's context)."""
MOE_STEPS = 15
"""Steps of each model ``moe_costs`` times, dense and MoE in turn: it takes the
difference of the two, which needs more samples than either alone."""
MOE = {"n_experts": 4, "top_k": 2, "expert_ffn": 256}
"""The mixture of experts whose eager cost ``moe_costs`` measures (``benchmarks/
plan_vs_measured.py`` trains the same on the ``small`` GPT)."""


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


def _model_step(precision: str, b: int, experts: bool = False
                ) -> tuple[Callable[[], None], float]:
    """A forward and backward of paratrain's ``small`` GPT (``experts``: with ``MOE``'s
    mixture of experts in every block) on ``b`` sequences of ``EFFICIENCY_SEQ`` tokens
    (bf16: under autocast, as data parallelism runs it), and its FLOPs as the planner
    counts them."""
    import torch

    from ..models.gpt import GPT, PRESETS
    from .candidate import Training
    from .flops import step_flops
    from .models import from_gpt_config

    cfg = dataclasses.replace(PRESETS["small"], **MOE) if experts else PRESETS["small"]
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


def moe_costs(rates: dict, runs: int = MOE_STEPS) -> tuple[float, float]:
    """(seconds per expert, seconds per routed row) a MoE block costs per microbatch
    beyond the planner's count on the calibration ``rates`` so far (``compute_rates``):
    the ``small`` GPT's step with and without ``MOE``'s experts at 1 and
    ``EFFICIENCY_BATCH`` sequences, less the planner's times for the same. What remains
    is a line in the sequences: its slope is per routed row (the router's and the
    permutation's small kernels), its intercept per expert (each expert's operators).
    ``runs``: steps of each model at each size."""
    from ..layout import Layout
    from ..models.gpt import PRESETS
    from .candidate import Candidate, Training
    from .cost import step_time
    from .hardware import local_cluster
    from .models import from_gpt_config

    cluster = local_cluster(1, Calibration(cores=1, alpha=0.0, beta=1.0, memory=1, **rates))
    dense, mixture = PRESETS["small"], dataclasses.replace(PRESETS["small"], **MOE)
    residual = []
    for b in (1, EFFICIENCY_BATCH):
        steps = [_model_step("fp32", b, experts)[0] for experts in (True, False)]
        planned = [step_time(from_gpt_config(cfg, "small"), Training(b, EFFICIENCY_SEQ, "fp32"),
                             cluster, Candidate(Layout(), 0, b, 1)).compute
                   for cfg in (mixture, dense)]
        measured = _paired_median_times(steps, runs)
        residual.append(measured[0] - measured[1] - (planned[0] - planned[1]))
    per_sequence = (residual[1] - residual[0]) / (EFFICIENCY_BATCH - 1)
    layers = PRESETS["small"].n_layers
    row = max(0.0, per_sequence) / (layers * EFFICIENCY_SEQ * MOE["top_k"])
    expert = max(0.0, residual[0] - per_sequence) / (layers * MOE["n_experts"])
    return expert, row


def _paired_median_times(calls: list[Callable[[], object]], runs: int) -> list[float]:
    """Median seconds of ``runs`` single calls of each of ``calls``, taken in turn (after
    one warm-up each), so that a drift in the machine's speed reaches all alike."""
    for call in calls:
        call()
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(runs):
        for call, mine in zip(calls, times):
            start = time.perf_counter()
            call()
            mine.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def _median_time(call: Callable[[], object], runs: int) -> float:
    """Median seconds of ``runs`` single calls of ``call``, after one warm-up call."""
    return _paired_median_times([call], runs)[0]


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
        measured = dict(matmul_flops=rates, matmul_half_dim=halves, compute_efficiency=eff,
                        layer_overhead=overhead)
        expert, row = moe_costs(measured)
        log(f"MoE block         {expert * 1e3:.3f} ms per expert and {row * 1e6:.2f} us per "
            "routed row, per microbatch, beyond the matmul count")
        adam = adamw_rate()
        log(f"AdamW step        {adam / 1e6:.1f} M params/s")
    finally:
        torch.set_num_threads(threads)
    return dict(**measured, moe_expert_overhead=expert, moe_row_cost=row, optimizer_rate=adam)


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


def write_calibration(calibration: Calibration, path: str | Path | None = None) -> Path:
    """Store ``calibration`` where ``hardware.load_calibration`` looks (default
    ``~/.cache/paratrain/calibration.json``); returns the path."""
    path = Path(path) if path else DEFAULT_CALIBRATION
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, calibration.to_json())  # never a half-written file for the planner to read
    return path
