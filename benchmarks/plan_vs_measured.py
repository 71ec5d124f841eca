"""The planner's predicted step time vs paratrain's measured one, for several layouts on
this machine's CPU processes (data, ZeRO, tensor + sequence, context ring and Ulysses,
pipeline GPipe and 1F1B, and their combinations at 2 and 4 processes): is the ranking
right, and how far off are the seconds?

    python benchmarks/plan_vs_measured.py [--model small] [--steps 5] [--rounds 4]
                   [--global-batch 8] [--calibration FILE] [--recalibrate] [--no-refresh]

Each layout trains ``--steps`` steps through ``paratrain.train.loop.train``, ``--rounds``
times (the layouts of one world size share one spawned world per round); its time is
the median over all runs' steps but the first of each (warm-up). The prediction is
``plan.cost.step_time`` on the local cluster of the calibration file (measured first if
missing). The machine's own speed moves by 10-20% within minutes on a shared VM, so by
default (``--refresh``) every round first calibrates again (``calibrate.compute_rates``
and ``calibrate_comm.comm_fits``: matmul curves, the eager model's costs, AdamW, gloo's α and
β) and each layout's prediction is the median over the rounds' calibrations, as its
measured time is the median over the rounds' steps. The first calibration's errors are
printed beside them. Before each world the calibration's own model step is also timed,
against the first calibration's time for it: how far the machine has moved (a diagnosis,
printed, not the result). Prints a table, the Spearman rank correlation, and as the last
line a JSON object: "paratrain" = median absolute relative error of the predictions,
"ratio" = Spearman, "peer" = null (there is no torch-native planner to compare with).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from paratrain.launch import spawn
from paratrain.mesh import Mesh
from paratrain.models.gpt import PRESETS
from paratrain.plan.calibrate import (EFFICIENCY_BATCH, EFFICIENCY_SEQ, MOE, calibrate,
                                      compute_rates, reference_step_time, write_calibration)
from paratrain.plan.calibrate_comm import comm_fits
from paratrain.layout import Layout
from paratrain.plan.candidate import Candidate, Training
from paratrain.plan.cost import step_time
from paratrain.plan.hardware import DEFAULT_CALIBRATION, load_calibration, local_cluster
from paratrain.plan.models import from_gpt_config
from paratrain.train.config import Config, load
from paratrain.train.loop import train

from common import at_least

# The mixture of experts the ep layouts train (on the ``small`` preset: MLP width 512) is the
# one the calibration times (``calibrate.MOE``): 4 experts of width 256, top-2.

# (label, processes, config overrides): every strategy paratrain runs on CPU today; the
# data-parallel size is what the other axes leave of the processes.
LAYOUTS = [
    ("dp1", 1, {}),
    ("dp2", 2, {}),
    ("dp2 zero1", 2, {"zero": 1}),
    ("dp2 zero3", 2, {"zero": 3}),
    ("dp2 recompute full", 2, {"recompute": "full"}),
    ("dp2 bf16", 2, {"precision": "bf16"}),
    ("dp2 zero2 bf16", 2, {"zero": 2, "precision": "bf16"}),
    ("tp2", 2, {"tp": 2}),
    ("tp2 sp", 2, {"tp": 2, "sp": True}),
    ("cp2 ring", 2, {"cp": 2, "cp_method": "ring"}),
    ("cp2 ulysses", 2, {"cp": 2, "cp_method": "ulysses"}),
    ("pp2 gpipe", 2, {"pp": 2, "schedule": "gpipe", "microbatches": 4}),
    ("pp2 1f1b", 2, {"pp": 2, "schedule": "1f1b", "microbatches": 4}),
    ("dp4", 4, {}),
    ("dp4 zero3", 4, {"zero": 3}),
    ("dp2 tp2 sp", 4, {"tp": 2, "sp": True}),
    ("dp2 pp2 1f1b", 4, {"pp": 2, "schedule": "1f1b", "microbatches": 4}),
    ("tp2 cp2", 4, {"tp": 2, "cp": 2}),
    # a mixture of experts: 4 experts of half the MLP's width, top-2, ep folded over dp
    ("dp2 moe", 2, {**MOE}),
    ("dp2 ep2 moe", 2, {**MOE, "ep": 2}),
    ("dp4 ep4 moe", 4, {**MOE, "ep": 4}),
    ("dp4 ep2 zero1 moe", 4, {**MOE, "ep": 2, "zero": 1}),
    ("dp2 pp2 ep2 moe", 4, {**MOE, "ep": 2, "pp": 2, "schedule": "1f1b", "microbatches": 4}),
]


def build_config(args: argparse.Namespace, run_dir: str, nproc: int, overrides: dict) -> Config:
    model_parallel = (overrides.get("tp", 1) * overrides.get("pp", 1)
                      * overrides.get("cp", 1))
    return load(None, {"preset": args.model, "dp": nproc // model_parallel,
                       "seq_len": args.seq_len,
                       "global_batch": args.global_batch, "steps": args.steps,
                       "eval_every": 0, "eval_batches": 1, "progress": False,
                       "run_dir": run_dir, **overrides}).validate()


def run_layouts(configs: list[Config]) -> None:
    """On every rank: train each config in turn (rank 0 writes each metrics file)."""
    for cfg in configs:
        train(cfg, Mesh.build(cfg.layout))


def step_times(cfg: Config) -> list[float]:
    """Step times of a finished run, its first (warm-up) step left out."""
    records = [json.loads(line) for line in cfg.metrics_path.read_text().splitlines()]
    times = [r["step_time_s"] for r in records if "step_time_s" in r]
    return times[1:] or times


def measure(args: argparse.Namespace, tmp: str, calibration
            ) -> tuple[list[list[list[float]]], list[float], list]:
    """Step times of every layout in each of ``args.rounds`` rounds ([layout][round],
    warm-up steps left out), the reference timings and the rounds' calibrations. Each
    round visits every world size (layouts of one size share a world, in alternating
    order), so drift in the machine's load hits all layouts alike. Before each world, the calibration's own
    model step is timed again in this process: how fast the machine runs right now. With
    ``args.refresh``, each round starts by calibrating again (``compute_rates`` and
    ``comm_fits``, about 45 s): the calibrations the round's layouts are predicted from."""
    samples: list[list[list[float]]] = [[] for _ in LAYOUTS]  # [layout][round] -> steps
    reference: list[float] = []
    calibrations = []
    for round_ in range(args.rounds):
        if args.refresh:
            calibrations.append(replace(calibration, **compute_rates(_silent),
                                        **comm_fits(log=_silent)))
        for nproc in sorted({n for _, n, _ in LAYOUTS}):
            mine = [i for i, (_, n, _) in enumerate(LAYOUTS) if n == nproc][::(-1) ** round_]
            configs = [build_config(args, f"{tmp}/{round_}-{i}", nproc, LAYOUTS[i][2])
                       for i in mine]
            reference.append(reference_step_time())
            spawn(run_layouts, nproc, configs, timeout_s=900)
            for i, cfg in zip(mine, configs):
                samples[i].append(step_times(cfg))
    return samples, reference, calibrations


def split_half(samples: list[list[list[float]]]) -> tuple[float, float] | None:
    """How well the measurements rank the layouts against themselves: Spearman between
    the medians of the odd rounds and of the even rounds, and its Spearman-Brown
    extension to all the rounds (r_full = 2r / (1 + r)). No prediction can be expected to
    correlate with the measured medians better than about √r_full (the attenuation
    bound of classical test theory). None with fewer than two rounds."""
    if len(samples[0]) < 2:
        return None
    halves = [[statistics.median(t for r in rounds[k::2] for t in r) for rounds in samples]
              for k in (0, 1)]
    r = spearman(*halves)
    return r, 2 * r / (1 + r) if r > 0 else 0.0  # no agreement: nothing to extend


def _silent(line: str) -> None:
    """A calibration log that prints nothing (the rounds' calibrations)."""


def predicted_reference_time(calibration) -> float:
    """The planner's time for the calibration's model step (``reference_step_time``)."""
    model = from_gpt_config(PRESETS["small"], "small")
    cand = Candidate(Layout(), zero=0, micro_batch=EFFICIENCY_BATCH,
                     microbatches=1)
    return step_time(model, Training(EFFICIENCY_BATCH, EFFICIENCY_SEQ, "fp32"),
                     local_cluster(1, calibration), cand).compute


def predicted_step_time(cfg: Config, calibration) -> float:
    """The planner's step time for the run ``cfg`` describes."""
    p, t = cfg.parallel, cfg.train
    model = from_gpt_config(cfg.model, cfg.model_preset)
    training = Training(t.global_batch, cfg.data.seq_len, t.precision)
    cand = Candidate(cfg.layout, zero=p.zero,
                     micro_batch=cfg.micro_batch, microbatches=cfg.accumulation,
                     schedule=p.schedule, virtual_stages=p.virtual_stages,
                     recompute=t.recompute, sequence_parallel=p.sp, cp_method=p.cp_method)
    return step_time(model, training, local_cluster(p.nproc, calibration), cand).step


@dataclass
class Drift:
    """How fast the machine ran while measuring, against the first calibration: the
    calibration's model step timed before each world, and the planner's time for that
    step from the first calibration."""

    timings: list[float]
    """Seconds of the reference step, one median per world spawned."""
    predicted: float
    """The planner's seconds for the same step."""

    @property
    def factor(self) -> float:
        """Measured over predicted: above 1, the machine ran slower than calibrated."""
        return statistics.median(self.timings) / self.predicted


def ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties sharing their average rank."""
    order = sorted(range(len(values)), key=values.__getitem__)
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation: Pearson's correlation of the ranks."""
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else float("nan")


def get_calibration(path: str | None, recalibrate: bool):
    target = Path(path) if path else DEFAULT_CALIBRATION
    if recalibrate or not target.is_file():
        print(f"calibrating this machine into {target} ...")
        write_calibration(calibrate(log=lambda line: print("  " + line)), target)
    return load_calibration(target)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small", help="paratrain model preset")
    parser.add_argument("--steps", type=at_least(2), default=5, help="steps per run (first untimed)")
    parser.add_argument("--rounds", type=at_least(1), default=4,
                        help="runs of every layout (with 2, one layout's median moved by up to 27%% between benchmark runs)")
    parser.add_argument("--global-batch", type=at_least(1), default=8, help="sequences per step")
    parser.add_argument("--seq-len", type=at_least(1), default=128)
    parser.add_argument("--calibration", help="calibration file (default: the planner's)")
    parser.add_argument("--recalibrate", action="store_true", help="measure even if cached")
    parser.add_argument("--refresh", action=argparse.BooleanOptionalAction, default=True,
                        help="calibrate again at the start of every round and predict from "
                             "those (the machine's speed drifts by 10-20%% within minutes); "
                             "--no-refresh: the first calibration only")
    args = parser.parse_args()
    calibration = get_calibration(args.calibration, args.recalibrate)

    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="plan-vs-measured-") as tmp:
        samples, reference, refreshed = measure(args, tmp, calibration)
    measured = [statistics.median(t for r in rounds for t in r) for rounds in samples]
    load = (load_before + os.getloadavg()[0]) / 2
    configs = [build_config(args, "unused", nproc, overrides) for _, nproc, overrides in LAYOUTS]
    first = [predicted_step_time(cfg, calibration) for cfg in configs]
    # Each layout's prediction is the median over the rounds' calibrations, as its
    # measured time is the median over the rounds' steps.
    predicted = [statistics.median(predicted_step_time(cfg, c) for c in refreshed)
                 for cfg in configs] if refreshed else first
    drift = Drift(reference, predicted_reference_time(calibration))

    report(args, calibration, predicted, measured, load, drift, first, split_half(samples))


def report(args: argparse.Namespace, calibration, predicted: list[float],
           measured: list[float], load: float, drift: Drift, first: list[float],
           reliability: tuple[float, float] | None) -> None:
    """The table, the summary lines, and the JSON line (last)."""
    median, rho = _errors(predicted, measured)
    width = max(len(label) for label, _, _ in LAYOUTS)
    source = ("the median over the rounds' calibrations (one at each round's start)"
              if args.refresh else "the first calibration")
    print(f"\n{args.model}, global batch {args.global_batch} x {args.seq_len} tokens, "
          f"median of {args.rounds} x {args.steps - 1} steps per layout; calibration "
          f"{args.calibration or DEFAULT_CALIBRATION}\ncompute: the shape-aware matmul curve "
          f"(plan/compute.py), fp32 {calibration.matmul_flops['fp32'] / 1e9:.1f} GFLOP/s "
          f"asymptotic, half at d = {calibration.matmul_half_dim.get('fp32', 0):.0f}"
          f"\nload average {load:.1f} on {calibration.cores} "
          f"cores while measuring (other work slows the measured times; the predictions "
          f"are for an idle machine)\npredicted: {source}\n")
    print(f"{'layout':<{width}}  predicted ms  measured ms   error  first calibration")
    print(f"{'-' * width}  ------------  -----------  ------  -----------------")
    for (label, _, _), p, m, f in zip(LAYOUTS, predicted, measured, first):
        print(f"{label:<{width}}  {p * 1e3:>12.1f}  {m * 1e3:>11.1f}  {(p - m) / m:>+6.0%}  "
              f"{(f - m) / m:>+17.0%}")
    first_median, first_rho = _errors(first, measured)
    print(f"\nmedian |error| {median:.1%}, Spearman rank correlation {rho:.3f}"
          f"\nfrom the first calibration only: median |error| {first_median:.1%}, "
          f"Spearman {first_rho:.3f}")
    if reliability:
        r, full = reliability
        print(f"the measurements against themselves: odd and even rounds rank the layouts "
              f"with Spearman {r:.3f}; for all {args.rounds} rounds (Spearman-Brown) "
              f"{full:.3f}, so a perfect model's expected Spearman is about "
              f"{full ** 0.5:.3f}")
    scaled, _ = _errors([f * drift.factor for f in first], measured)
    print(f"machine speed while measuring: the calibration's model step ({EFFICIENCY_BATCH} "
          f"sequences, one process), timed before each world, took "
          f"{statistics.median(drift.timings) * 1e3:.0f} ms (median of {len(drift.timings)}, "
          f"{min(drift.timings) * 1e3:.0f}-{max(drift.timings) * 1e3:.0f}) against the first "
          f"calibration's {drift.predicted * 1e3:.0f} ms: {drift.factor:.2f}x; the first "
          f"calibration's predictions scaled by that factor: median |error| {scaled:.1%}")
    print(json.dumps({
        "benchmark": "plan_vs_measured", "paratrain": round(median, 4), "peer": None,
        "ratio": round(rho, 4),
        "metric": "paratrain: median |relative error| of the predicted step time; "
                  "ratio: Spearman correlation of predicted and measured",
        "model": args.model, "load_average": round(load, 2), "refresh": args.refresh,
        "compute_model": "shape-aware matmul curve",
        "matmul_half_dim": calibration.matmul_half_dim,
        "first_calibration": {"median_error": round(first_median, 4),
                              "spearman": round(first_rho, 4)},
        "reference_step_ms": [round(t * 1e3, 1) for t in drift.timings],
        "reference_predicted_ms": round(drift.predicted * 1e3, 1),
        "drift": round(drift.factor, 3), "median_error_drift_scaled": round(scaled, 4),
        "split_half_spearman": round(reliability[0], 4) if reliability else None,
        "reliability_spearman_brown": round(reliability[1], 4) if reliability else None,
        "layouts": {label: {"predicted_s": round(p, 5), "measured_s": round(m, 5),
                            "predicted_first_s": round(f, 5)}
                    for (label, _, _), p, m, f in zip(LAYOUTS, predicted, measured, first)}}))


def _errors(predicted: list[float], measured: list[float]) -> tuple[float, float]:
    """(median |relative error|, Spearman correlation) of predictions against measurements."""
    return (statistics.median(abs(p - m) / m for p, m in zip(predicted, measured)),
            spearman(predicted, measured))


if __name__ == "__main__":
    main()
