"""Fit and check the runtime speed profiles of ``plan/speed.py`` on measured runs.

    python -m paratrain.plan.speed_fit tests/data/runtime_runs.toml [--plot FILE.png]

Each run is one trainer's published or measured step time for a layout the planner can
time (``tests/data/runtime_runs.toml`` names the sources). A profile's free numbers are
solved, one at a time, so that the planner reproduces its ``calibrate`` runs; its
``check`` runs are then predicted with no further change. Each number is found by
bisection: the predicted step time grows monotonically as ``gemm`` falls and as
``elementwise`` or ``host_block`` grow.
"""

from __future__ import annotations

import argparse
import statistics
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path

from ..layout import Layout
from .candidate import Candidate, Training
from .cost import step_time
from .hardware import _H100, GRAND_TETON_RATE, Cluster, GpuSpec, gpu_preset
from .models import PRESETS, ModelSpec
from .speed import FUSED, PROFILES, Speed

MODELS = {
    "837m": ModelSpec(16, 2048, 16, 4, 5472, 32000, 2048, name="837m"),
    "llama2-13b": ModelSpec(40, 5120, 40, 40, 13824, 32000, 4096, name="llama2-13b"),
    "llama2-70b": ModelSpec(80, 8192, 64, 8, 28672, 32000, 4096, name="llama2-70b"),
    **PRESETS}
"""The models the runs name: benchmarks/plan_vs_gpu.py's Llama shape, Llama 2 (Touvron et
al. 2023, Table 1 and its config.json files) and the presets."""


@dataclass(frozen=True)
class Point:
    """One measured step of one runtime."""

    runtime: str
    compiled: bool
    model: str
    gpu: str
    gpus: int
    seq_len: int
    micro_batch: int
    microbatches: int
    recompute: str
    step_s: float
    """Measured seconds per optimizer step."""
    role: str
    """``calibrate`` (sets the profile) or ``check`` (held out)."""
    tp: int = 1
    """Tensor-parallel size (with sequence parallelism); the rest is data parallel."""

    @property
    def label(self) -> str:
        return (f"{self.runtime}{' compiled' if self.compiled else ' eager'} {self.model} "
                f"{self.gpus} x {self.gpu}{f' tp{self.tp}' if self.tp > 1 else ''} "
                f"mb{self.micro_batch} {self.recompute}")


def load_points(path: str | Path) -> list[Point]:
    """Every measured step in the runs file, one ``Point`` each."""
    points = []
    for run in tomllib.loads(Path(path).read_text())["run"]:
        kind = dict(runtime=run["runtime"], compiled=run["compiled"], gpu=run["gpu"],
                    tp=run.get("tp", 1))
        for model, seq, mb, recompute, gpus, tokens, role in run.get("points", []):
            points.append(Point(**kind, model=model, gpus=gpus, seq_len=seq, micro_batch=mb,
                                microbatches=1, recompute=recompute,
                                step_s=mb * seq / (tokens * kind["tp"]), role=role))
        if "model" not in run:
            continue
        common = dict(**kind, model=run["model"], seq_len=run["seq_len"])
        for mb, recompute, step_s, role in run.get("step_s", []):
            points.append(Point(**common, gpus=run["gpus"], micro_batch=mb,
                                microbatches=run["global_batch"] // (mb * run["gpus"]),
                                recompute=recompute, step_s=step_s, role=role))
        for gpus, tokens, role in run.get("tokens_per_gpu", []):
            mb = run["micro_batch"]
            points.append(Point(**common, gpus=gpus, micro_batch=mb, microbatches=1,
                                recompute=run["recompute"], step_s=mb * run["seq_len"] / tokens,
                                role=role))
    return points


def predict(point: Point, speed: Speed, gpu: GpuSpec | None = None) -> float:
    """The planner's step seconds for ``point``'s layout (tensor parallel as given, data
    parallel over the rest, FSDP-style ZeRO-3 when that is more than one) at ``speed``, on ``gpu`` (default: the
    point's preset)."""
    training = Training(point.micro_batch * point.microbatches * point.gpus, point.seq_len,
                        speed=speed)
    dp = point.gpus // point.tp
    cand = Candidate(Layout(dp=dp, tp=point.tp), zero=3 if dp > 1 else 0,
                     micro_batch=point.micro_batch, microbatches=point.microbatches,
                     recompute=point.recompute)
    gpu = gpu or gpu_preset(point.gpu)
    return step_time(MODELS[point.model], training, Cluster(gpu, point.gpus), cand).step


def solve(point: Point, speed: Speed, field: str, lo: float, hi: float) -> Speed:
    """``speed`` with ``field`` set so that ``predict(point)`` equals the measured time."""
    slower_up = field != "gemm"  # a larger gemm fraction is faster; the others slower
    for _ in range(60):
        mid = (lo + hi) / 2
        too_slow = predict(point, replace(speed, **{field: mid})) > point.step_s
        if too_slow == slower_up:
            hi = mid
        else:
            lo = mid
    return replace(speed, **{field: round((lo + hi) / 2, 6)})


def errors(points: list[Point], speed: Speed) -> list[tuple[Point, float, float]]:
    """(point, predicted seconds, relative error of the predicted tokens/s) per point."""
    out = []
    for p in points:
        t = predict(p, speed)
        out.append((p, t, p.step_s / t - 1.0))
    return out


def report(points: list[Point], speed: Speed) -> str:
    """A table of one profile's points: measured, predicted, error; the held-out median."""
    rows = errors(points, speed)
    lines = [f"{speed.name}: elementwise {speed.elementwise}, "
             f"host_block {speed.host_block * 1e3:.2f} ms"]
    for p, t, err in rows:
        lines.append(f"  {p.role:<9} {p.label:<52} measured {p.step_s:7.3f} s  "
                     f"predicted {t:7.3f} s  tokens/s error {err:+6.1%}")
    held = [abs(e) for p, _, e in rows if p.role == "check"]
    if held:
        lines.append(f"  held out: median |error| {statistics.median(held):.1%} over {len(held)}")
    return "\n".join(lines)


def fit_grand_teton(points: list[Point]) -> float:
    """``hardware.GRAND_TETON_RATE``: the h100-96g's rate over the H100 SXM curve that
    makes the planner's fused model reproduce torchtitan's compiled calibration run."""
    point = next(p for p in points if (p.runtime, p.compiled, p.role, p.gpu)
                 == ("torchtitan", True, "calibrate", "h100-96g"))
    base = gpu_preset("h100-96g")
    lo, hi = 0.05, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        gpu = replace(base, efficiency=_H100["efficiency"] * mid,
                      attention_efficiency=_H100["attention_efficiency"] * mid)
        if predict(point, PROFILES[("torchtitan", True)], gpu) > point.step_s:
            lo = mid
        else:
            hi = mid
    return round((lo + hi) / 2, 4)


def fit_profile(key: tuple[str, bool], points: list[Point]) -> Speed:
    """The profile of ``key`` = (runtime, compiled) solved from its ``calibrate`` points:

    * paratrain, eager or compiled: ``elementwise`` from its largest microbatch
      (GPU-bound) and ``host_block`` from its smallest (host-bound), alternated until both
      hold;
    * torchtitan compiled: the fused model (its run sets the GPU's rate: ``fit_grand_teton``);
    * torchtitan eager: ``elementwise`` from its own run on the same GPUs.
    """
    base = PROFILES[key]
    cal = [p for p in points if (p.runtime, p.compiled) == key and p.role == "calibrate"]
    if key[0] == "paratrain":
        big = max(cal, key=lambda p: p.micro_batch)
        small = min(cal, key=lambda p: p.micro_batch)
        speed = replace(base, elementwise=1.0, host_block=0.0)
        for _ in range(4):
            speed = solve(big, speed, "elementwise", 1.0, 50.0)
            speed = solve(small, speed, "host_block", 0.0, 0.05)
        return speed
    if key == ("torchtitan", True):
        return base  # fused: its run sets the h100-96g's rate instead (fit_grand_teton)
    if key == ("torchtitan", False):
        return solve(cal[0], replace(base, elementwise=1.0), "elementwise", 1.0, 100.0)
    raise ValueError(f"no calibration rule for {key}")


def matches(fitted: Speed, shipped: Speed) -> bool:
    """The shipped profile is the fit, to the 4 significant figures it is written with."""
    return (abs(fitted.elementwise - shipped.elementwise) <= 1e-3 * shipped.elementwise
            and abs(fitted.host_block - shipped.host_block) <= 1e-2 * shipped.host_block + 1e-9)


def main(argv: list[str] | None = None) -> None:

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", help="the runs file (tests/data/runtime_runs.toml)")
    parser.add_argument("--plot", metavar="FILE.png", help="draw predicted against measured")
    args = parser.parse_args(argv)
    points = load_points(args.runs)
    rate = fit_grand_teton(points)
    print(f"h100-96g rate over the H100 SXM curve: {rate} (plan/hardware.py: {GRAND_TETON_RATE})")
    for key, speed in PROFILES.items():
        mine = [p for p in points if (p.runtime, p.compiled) == key]
        if not mine:
            continue
        fitted = fit_profile(key, points)
        print(report(mine, fitted))
        print("  matches plan/speed.py" if matches(fitted, speed) else
              f"  plan/speed.py has elementwise {speed.elementwise}, host_block {speed.host_block}")
    if args.plot:
        plot(args.plot, points)
        print(f"wrote {args.plot}")


def plot(path: str, points: list[Point]) -> None:
    """Measured against predicted step time, each runtime at its own profile and at the
    fused model (hollow): the distance the profile closes."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 5.2))
    colours = {("paratrain", False): "tab:blue", ("paratrain", True): "tab:purple",
               ("torchtitan", False): "tab:orange", ("torchtitan", True): "tab:green"}
    for key, colour in colours.items():
        mine = [p for p in points if (p.runtime, p.compiled) == key]
        speed = PROFILES[key]
        ax.scatter([predict(p, FUSED) for p in mine], [p.step_s for p in mine],
                   facecolors="none", edgecolors=colour, alpha=0.6)
        for role, marker in (("calibrate", "s"), ("check", "o")):
            sel = [p for p in mine if p.role == role]
            ax.scatter([predict(p, speed) for p in sel], [p.step_s for p in sel], color=colour,
                       marker=marker, label=f"{speed.name}: {role}" if sel else None)
    lo, hi = 0.1, 60.0
    ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8)
    ax.fill_between([lo, hi], [lo / 1.15, hi / 1.15], [lo * 1.15, hi * 1.15], color="grey",
                    alpha=0.12, label="±15%")
    ax.set(xscale="log", yscale="log", xlabel="predicted step (s); hollow: the fused model",
           ylabel="measured step (s)", title="Runtime speed profiles: predicted vs measured")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
