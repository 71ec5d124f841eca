"""How fast a trainer runs the step the planner counts: one ``Speed`` per runtime and mode.

The planner's compute model (``plan/compute.py``) is a *fused* runtime: GEMMs and the
attention core at the measured curve, every other operation memory-bound at HBM
bandwidth with the bytes a fused kernel moves, and a GPU that never waits for the host.
Megatron-core with its fused kernels is close to that; an eager PyTorch model is not.
A ``Speed`` says, with two numbers, how far a trainer is from it:

    block_gpu  = GEMMs + attention + elementwise_bytes · elementwise / HBM
    block_time = max(block_gpu, host_block · passes)

* ``elementwise``: the bytes its non-matmul operations move over the fused count: eager
  kernels each read and write the whole tensor, and autocast adds casts;
* ``host_block``: seconds of Python and kernel launches per block forward (a backward is
  two passes); the GPU waits for the host when its own work is shorter, as at small
  microbatches.

Each profile names the published or measured runs that set it and those that check it;
``tests/test_plan_runtime_speed.py`` recomputes both. ``FUSED`` is the planner's model
unchanged: Megatron's profile, and every profile on the local (CPU) cluster, whose
``--calibrate`` measures paratrain's own eager step directly.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Speed:
    """A trainer's speed relative to the planner's fused model (module docstring)."""

    name: str
    """What the output calls it, e.g. ``paratrain, eager``."""
    elementwise: float = 1.0
    """Bytes moved by non-matmul operations over a fused kernel's count."""
    host_block: float = 0.0
    """Host seconds per block forward pass (launches and Python); 0: never host-bound."""
    calibrated: str = ""
    """The runs whose measured times set the numbers above."""
    checked: str = ""
    """Held-out runs the profile is checked on (``tests/test_plan_runtime_speed.py``)."""

    def __post_init__(self) -> None:
        if self.elementwise < 1.0 or self.host_block < 0.0:
            raise ValueError(f"Speed {self.name!r}: elementwise must be >= 1 and host_block >= 0")

    @property
    def fused(self) -> bool:
        return self.elementwise == 1.0 and self.host_block == 0.0


FUSED = Speed("fused kernels (the planner's model)",
              calibrated="the compute curve (plan/compute.py) and the published Megatron and "
                         "NeMo runs (tests/data/published_runs.toml)")
"""The planner's own model: Megatron-style fused kernels, never host-bound."""

PARATRAIN_EAGER = Speed(
    "paratrain, eager", elementwise=8.757, host_block=1.71e-3,
    calibrated="paratrain on one H100 80GB (tests/data/runtime_runs.toml, 837M Llama shape, "
               "bf16 autocast): mb8 without recompute (297.5 ms) sets elementwise, the fp32 "
               "residual stream and autocast's casts (its profile put 113 ms there); mb1 "
               "(662.3 ms, 23,000 launches per step) sets host_block",
    checked="the other 10 runs of that sweep (mb1-mb8 x none, selective, full)")
"""paratrain's eager step on a GPU. Its GEMMs run at the curve (100 ms profiled against
102 ms predicted at mb8)."""

PARATRAIN_COMPILED = Speed(
    "paratrain, compiled (--compile)", elementwise=3.62, host_block=0.80e-3,
    calibrated="paratrain --compile --precision bf16-params on one H200 (tests/data/"
               "runtime_runs.toml, 837M Llama shape, scripts/gpu_check.sh): mb8 (172.5 ms) "
               "sets elementwise, what the fused blocks, the master-weight copies and the "
               "gradient norm still move; mb1 (310.8 ms) sets host_block, one compiled graph "
               "per block forward plus the gradient hooks",
    checked="mb2 and mb4 of the same run")
"""paratrain with ``--compile``: 3.6x the fused model's elementwise bytes (eager: 8.8x) and
half the eager host time per block."""

TORCHTITAN_EAGER = Speed(
    "torchtitan, eager", elementwise=4.126,
    calibrated="torchtitan's Llama 3.1 8B on 8 H100s (tests/data/runtime_runs.toml: its "
               "December 2024 benchmark, FSDP, local batch 2, 5,762 tokens/s per GPU)",
    checked="the same job on 128 H100s (5,605), Llama 3.1 405B on 128 of them (tp8, 109) and "
            "six April 2024 runs on 64 A100s (Llama 3 8B and 70B, Llama 2 13B and 70B)")
"""torchtitan without compile: FSDP2 with bf16 parameters (no autocast casts, so fewer
bytes than paratrain's eager step)."""

TORCHTITAN_COMPILED = Speed(
    "torchtitan, compiled (training.compile)",
    calibrated="the fused model: its 8B run with torch.compile on 8 H100s (6,667 tokens/s per "
               "GPU) sets the h100-96g preset's GEMM efficiency instead (plan/hardware.py)",
    checked="the same job on 128 H100s (6,514 tokens/s per GPU)")
"""torchtitan with ``training.compile``."""

PROFILES: dict[tuple[str, bool], Speed] = {
    ("paratrain", False): PARATRAIN_EAGER,
    ("paratrain", True): PARATRAIN_COMPILED,
    ("torchtitan", False): TORCHTITAN_EAGER,
    ("torchtitan", True): TORCHTITAN_COMPILED,
}
"""The measured profiles by (runtime, compiled); a runtime not here runs at ``FUSED``."""


def profile(runtime: str, compiled: bool) -> Speed:
    """The speed ``runtime`` runs at, compiled or eager (``FUSED`` if not measured)."""
    return PROFILES.get((runtime, compiled), FUSED)
