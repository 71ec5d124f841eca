"""Accelerators, clusters and the links between ranks, as numbers the planner computes with.

Bandwidths are *achievable bus bandwidths per GPU* in bytes/s: what nccl-tests prints as
``busbw`` for a large all-reduce, so a user can measure their own and pass it with
``--intra-bw`` / ``--inter-bw``. The presets derive them from the nominal link rates:

* NVLink 3 (A100): 12 links x 25 GB/s = 300 GB/s per direction; ~230 GB/s achieved.
* NVLink 4 (H100, H200): 18 links x 25 GB/s = 450 GB/s per direction; ~360 GB/s achieved
  (without NVLink SHARP).
* Network: one InfiniBand NIC per GPU (rail-optimised, 8 NICs per node), HDR 200 Gb/s
  = 25 GB/s for A100 nodes and NDR 400 Gb/s = 50 GB/s for H100/H200 nodes; ~90% achieved.

Latencies α are per ring step, orders of magnitude from nccl-tests' small-message times.
The compute constants (``efficiency``, ``half_dim``, ``sms``, ``mamf_shape``,
``attention_efficiency``) describe the achievable rate of each operation from its shape;
their sources are in ``plan/compute.py``. None is fitted to a training run.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from functools import lru_cache
from pathlib import Path

from .keys import cached_hash

GiB = 2**30
GB = 10**9


@dataclass(frozen=True)
class GpuSpec:
    """One accelerator type and the links of the nodes it usually comes in."""

    def __hash__(self) -> int:  # a search cache key: hashed once (plan/keys.py)
        return cached_hash(self)

    name: str
    """Preset name, e.g. ``h100-80g``."""
    peak_flops: float
    """Dense bf16 tensor-core FLOP/s."""
    peak_flops_fp32: float
    """Dense fp32 FLOP/s (no TF32), used when training in fp32."""
    memory: int
    """Device memory in bytes, as the driver reports it."""
    hbm_bw: float
    """Device memory bandwidth in bytes/s (bounds small matmuls and the optimizer step)."""
    nvlink_bw: float
    """Achievable bus bandwidth per GPU inside a node, bytes/s."""
    network_bw: float
    """Achievable bus bandwidth per GPU across nodes (its own NIC), bytes/s."""
    nvlink_alpha: float = 1e-6
    """Latency of one ring step inside a node, seconds."""
    network_alpha: float = 5e-6
    """Latency of one ring step across nodes, seconds."""
    efficiency: float = 0.5
    """Achievable fraction of peak of large, well-shaped matmuls (GPUs: the measured
    maximum achievable matmul FLOPS over peak, ``plan/compute.py``; the local cluster: the
    measured efficiency of an eager model over its matmul curve)."""
    efficiency_fp32: float = 0.0
    """Achievable fraction of ``peak_flops_fp32`` (0: ``efficiency``)."""
    half_dim: float = 0.0
    """Smallest GEMM dimension at which the rate halves (a tile's fixed cost; 0: flat)."""
    half_dim_fp32: float = 0.0
    """``half_dim`` of fp32 matmuls (0: ``half_dim``)."""
    sms: int = 0
    """Streaming multiprocessors, for wave quantization (0: none, as on CPUs)."""
    mamf_shape: tuple[int, int, int] | None = None
    """(M, K, N) at which ``efficiency`` was measured: the curve passes through it."""
    attention_efficiency: float = 0.0
    """Fraction of peak a FlashAttention-style kernel reaches on long sequences (0: the
    precision's matmul efficiency, as for the local cluster's eager model)."""
    layer_overhead: float = 0.0
    """Fixed seconds per block and microbatch of forward and backward (an eager CPU
    framework's operator dispatch; 0 on GPUs, where kernels queue asynchronously)."""
    moe_expert_overhead: float = 0.0
    """Seconds per local expert of a MoE block per microbatch, forward and backward, beyond
    its GEMMs: each expert's own eager operators (0 on GPUs: a grouped GEMM)."""
    moe_row_cost: float = 0.0
    """Seconds per routed row (token x top_k) of a MoE block, forward and backward: the
    router's and the permutation's small kernels, which FLOP counts leave out (0 on GPUs,
    where the memory-bound model counts their bytes)."""
    optimizer_bw: float = 0.0
    """Bytes/s the optimizer update streams at (0: ``hbm_bw``)."""
    collectives: tuple[tuple[str, float, float], ...] = ()
    """Measured (op, α, β) that replace the link's α and β for that collective: a
    backend's all-gather and reduce-scatter need not cost half an all-reduce as rings
    do (gloo's do not)."""
    overlap_cost: float = 0.1
    """Fraction of communication hidden behind compute that still slows the step: on a GPU
    the collectives' kernels take SMs and memory bandwidth from the compute beside them (an
    assumption, not a fit)."""


# efficiency: measured maximum achievable matmul FLOPS over peak, with the shape it was
# measured at (stas00/ml-engineering); A100 attention: FlashAttention-2's forward + backward
# fraction of peak; H100 half_dim and attention: measured on an H100 (tests/data/
# h100_compute.json); SMs from the datasheets (plan/compute.py has the sources).
_A100 = dict(efficiency=267.9 / 312, half_dim=128, sms=108, mamf_shape=(6912, 2048, 16384),
             attention_efficiency=0.6)
_H100 = dict(efficiency=794.5 / 989, half_dim=224, sms=132, mamf_shape=(6144, 2816, 17920),
             attention_efficiency=0.47)
GRAND_TETON_RATE = 0.5388
"""The h100-96g's GEMM and attention rate over the H100 SXM curve. Fitted (plan/speed_fit.py)
so that torchtitan's compiled Llama 3.1 8B on 8 of them runs at its published 6,667 tokens/s
per GPU; it holds the 500 W clock and whatever else slowed that job's GEMMs. The same
trainer's A100 runs need no such factor (tests/test_plan_runtime_speed.py), so it is the
machine's, not torchtitan's."""
GPUS: dict[str, GpuSpec] = {
    "a100-40g": GpuSpec("a100-40g", 312e12, 19.5e12, 40 * GiB, 1.555e12,
                        230 * GB, 22.5 * GB, **_A100),
    "a100-80g": GpuSpec("a100-80g", 312e12, 19.5e12, 80 * GiB, 2.039e12,
                        230 * GB, 22.5 * GB, **_A100),
    # H100 SXM; memory is the 81559 MiB nvidia-smi shows.
    "h100-80g": GpuSpec("h100-80g", 989e12, 67e12, 81559 * 2**20, 3.35e12,
                        360 * GB, 45 * GB, **_H100),
    # The H100 of Meta's Grand Teton hosts, where torchtitan publishes its benchmarks: 96 GB
    # HBM2e at 2.4 TB/s, run at a 500 W power limit (tests/data/runtime_runs.toml).
    "h100-96g": GpuSpec("h100-96g", 989e12, 67e12, 96 * GB, 2.4e12, 360 * GB, 45 * GB,
                        **{**_H100, "efficiency": _H100["efficiency"] * GRAND_TETON_RATE,
                           "attention_efficiency": _H100["attention_efficiency"]
                           * GRAND_TETON_RATE}),
    # The H100 export part DeepSeek-V3 was trained on: the H100 SXM's compute and memory,
    # NVLink at 400 GB/s bidirectional (DeepSeek-V3 report, section 3.1), so 160 GB/s of
    # achievable bus bandwidth at the H100's 80%; 400 Gb/s InfiniBand per GPU.
    "h800": GpuSpec("h800", 989e12, 67e12, 81559 * 2**20, 3.35e12,
                    160 * GB, 45 * GB, **_H100),
    # Same compute and NVLink as H100; more and faster memory (143771 MiB, 4.8 TB/s).
    "h200": GpuSpec("h200", 989e12, 67e12, 143771 * 2**20, 4.8e12,
                    360 * GB, 45 * GB, **_H100),
}


def gpu_preset(name: str) -> GpuSpec:
    """The preset called ``name``; the error lists the known ones."""
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}") from None


def preset_for_device(device_name: str) -> GpuSpec | None:
    """The preset of the family (``h100`` of ``h100-80g``) ``torch.cuda.get_device_name``
    names, the one of its memory size where the name says it ('NVIDIA A100-SXM4-80GB' ->
    ``a100-80g``), else the family's first ('NVIDIA H200' -> ``h200``); None if unknown."""
    name = device_name.lower().replace(" ", "")
    family = [(key, gpu) for key, gpu in GPUS.items() if key.split("-")[0] in name]
    sized = [gpu for key, gpu in family if "-" in key and key.split("-")[1] + "b" in name]
    return (sized or [gpu for _, gpu in family] or [None])[0]


@dataclass(frozen=True)
class Link:
    """What one collective's ranks talk over."""

    bw: float
    """Achievable bus bandwidth per rank, bytes/s."""
    alpha: float
    """Latency per ring step, seconds."""
    kind: str
    """``nvlink`` (inside a node) or ``network``."""


@dataclass(frozen=True)
class Cluster:
    """The machines a job runs on."""

    def __hash__(self) -> int:  # a search cache key: hashed once (plan/keys.py)
        return cached_hash(self)

    gpu: GpuSpec
    """Accelerator type (for ``--cluster local``: one CPU process, see ``local_cluster``)."""
    n_gpus: int
    """Ranks in the job."""
    gpus_per_node: int = 8
    """Ranks sharing one node's fast links."""
    intra_bw: float | None = None
    """Override of the GPU's in-node bus bandwidth, bytes/s."""
    inter_bw: float | None = None
    """Override of the per-GPU network bus bandwidth, bytes/s."""
    usable_memory: float = 0.9
    """Fraction of device memory a rank may fill; the rest covers the CUDA context,
    NCCL buffers and allocator fragmentation."""
    kind: str = "gpu"
    """``gpu`` or ``local`` (CPU processes on this machine, numbers from a calibration)."""

    def __post_init__(self) -> None:
        if self.n_gpus < 1 or self.gpus_per_node < 1:
            raise ValueError("need at least one GPU and one GPU per node")
        if self.n_gpus > self.gpus_per_node and self.n_gpus % self.gpus_per_node:
            raise ValueError(f"{self.n_gpus} GPUs do not fill whole nodes of "
                             f"{self.gpus_per_node}; pass a multiple of --gpus-per-node")

    @property
    def node_size(self) -> int:
        """Ranks per node actually used (a job smaller than a node uses part of one)."""
        return min(self.gpus_per_node, self.n_gpus)

    @property
    def memory_limit(self) -> float:
        """Bytes a rank may hold."""
        return self.gpu.memory * self.usable_memory

    def link(self, sizes: dict[str, int], order: tuple[str, ...], axes: tuple[str, ...],
             p2p: bool = False) -> Link:
        """The link a group along ``axes`` communicates over, ranks numbered in ``order``
        (fastest axis first).

        A group inside one node uses NVLink. A group spread over nodes crosses the
        network. A collective over a group with k members per node drives their k NICs in
        parallel (NCCL runs one ring per NIC), so it gets ``min(nvlink, k * nic)``; a
        point-to-point hop between nodes (``p2p``) has one NIC.
        """
        return _link(self, tuple(sizes[a] for a in order), order, axes, p2p)


@lru_cache(maxsize=1 << 14)
def _link(cluster: Cluster, sizes_in_order: tuple[int, ...], order: tuple[str, ...],
          axes: tuple[str, ...], p2p: bool) -> Link:
    sizes = dict(zip(order, sizes_in_order))
    intra = cluster.intra_bw or cluster.gpu.nvlink_bw
    # Every group lies inside a block of `span` consecutive ranks; the blocks tile nodes
    # only if `span` divides the node size (tp=3 on 8-GPU nodes straddles nodes).
    slowest = max((order.index(a) for a in axes if sizes[a] > 1), default=0)
    span = math.prod(sizes_in_order[:slowest + 1])
    if cluster.node_size % span == 0:
        return Link(intra, cluster.gpu.nvlink_alpha, "nvlink")
    k = members_per_node(sizes, order, axes, cluster.node_size)
    inter = cluster.inter_bw or cluster.gpu.network_bw
    return Link(min(intra, (1 if p2p else k) * inter), cluster.gpu.network_alpha, "network")


def members_per_node(sizes: dict[str, int], order: tuple[str, ...], axes: tuple[str, ...],
                     node: int) -> int:
    """How many ranks of one group along ``axes`` share a node of ``node`` consecutive
    ranks (at least one; an estimate where groups straddle nodes unevenly)."""
    stride, members = 1, 1
    for axis in order:
        if axis in axes and stride < node:
            members *= max(1, min(sizes[axis], node // stride))
        stride *= sizes[axis]
    return members


# ---- the local cluster: CPU processes on this machine -------------------------------------

DEFAULT_CALIBRATION = Path.home() / ".cache" / "paratrain" / "calibration.json"


class CalibrationError(FileNotFoundError):
    """No usable calibration file; the message says how to make one."""


@dataclass(frozen=True)
class Calibration:
    """This machine's measured rates, stored as JSON with exactly these keys
    (``paratrain plan --cluster local --calibrate`` writes it, see ``plan/calibrate.py``)."""

    matmul_flops: dict[str, float]
    """FLOP/s one process reaches in the matmuls of a small model with one thread, by
    precision (``fp32``, optionally ``bf16``)."""
    cores: int
    """Cores the processes share; more processes than cores split them."""
    alpha: float
    """gloo all-reduce latency per ring step, seconds (``comm.cost.fit_alpha_beta``), in a
    world of ``world_size`` processes."""
    beta: float
    """gloo all-reduce bus bandwidth, bytes/s, in a world of ``world_size`` processes."""
    memory: int
    """Bytes of RAM all processes together may use."""
    world_size: int = 2
    """Processes in the world ``alpha`` and ``beta`` were measured with."""
    torch_version: str = ""
    """torch that measured it (informational)."""
    comm: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    """Per measured world size (keys are process counts as strings: JSON keys), the
    [α, β] fit of each collective (``all-reduce``, ``all-gather``, ``reduce-scatter``):
    gloo's all-gather and reduce-scatter do not cost the half of an all-reduce that
    rings would, and gloo slows down as more processes share the cores."""
    optimizer_rate: float = 0.0
    """Parameters per second one process's AdamW step updates (0: not measured, the
    update is then taken as free)."""
    matmul_half_dim: dict[str, float] = field(default_factory=dict)
    """By precision: the smallest GEMM dimension at which one thread's rate halves; with
    ``matmul_flops`` (the asymptotic rate) the least-squares fit of 1/rate = (1 +
    half_dim / d) / matmul_flops over GEMMs of several shapes (absent: a flat rate)."""
    compute_efficiency: dict[str, float] = field(default_factory=dict)
    """By precision: the time the planner counts for a small GPT's forward and backward
    per sequence at the matmul curve over its measured time; below 1 because an eager model
    also runs norms, activations, RoPE and casts that FLOP counts leave out (1 if
    absent)."""
    layer_overhead: float = 0.0
    """Seconds a microbatch's forward and backward cost per block whatever its size:
    the dispatch of an eager model's operators (fp32, measured with the efficiency)."""
    moe_expert_overhead: float = 0.0
    """Seconds per expert of a MoE block per microbatch beyond what the curve, the
    efficiency and ``layer_overhead`` count (fp32; ``calibrate.moe_costs``; 0: not measured)."""
    moe_row_cost: float = 0.0
    """Seconds per routed row (token x top_k) of a MoE block, likewise."""

    def __post_init__(self) -> None:
        if not isinstance(self.matmul_flops, dict) or "fp32" not in self.matmul_flops:
            raise ValueError("matmul_flops has no 'fp32' rate")
        for name in ("cores", "alpha", "beta", "memory", "world_size"):
            value, least = getattr(self, name), 0 if name == "alpha" else 1e-300  # a fit may give α 0
            if type(value) not in (int, float) or not value >= least:
                what = "0 or more" if name == "alpha" else "a positive number"
                raise ValueError(f"{name} must be {what}, got {json.dumps(value)}")
        for n, ops in self.comm.items():
            if not (n.isdigit() and isinstance(ops, dict)
                    and all(isinstance(v, list) and len(v) == 2 for v in ops.values())):
                raise ValueError(f"comm[{n!r}] must map each collective to [alpha, beta]")

    def to_json(self) -> str:
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)}, indent=2)

    def collectives(self, n_procs: int) -> dict[str, tuple[float, float]]:
        """(α, β) by collective for a world of ``n_procs``: its own fits if measured,
        else those of the largest measured world not above it (the smallest if all are
        above); at least the all-reduce of ``alpha`` and ``beta``."""
        fits = {int(n): {op: (ab[0], ab[1]) for op, ab in ops.items()}
                for n, ops in self.comm.items()}
        fits.setdefault(self.world_size, {"all-reduce": (self.alpha, self.beta)})
        below = [n for n in fits if n <= n_procs]
        return fits[max(below) if below else min(fits)]


def load_calibration(path: str | Path | None = None) -> Calibration:
    """Read a calibration file (default ``~/.cache/paratrain/calibration.json``)."""
    path = Path(path) if path else DEFAULT_CALIBRATION
    if not path.is_file():
        raise CalibrationError(
            f"no calibration at {path}: run `paratrain plan --cluster local --calibrate` "
            f"once to measure this machine's matmul rate and gloo all-reduce α/β")
    fix = "re-run `paratrain plan --cluster local --calibrate` to measure it again"
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc}); {fix}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a calibration (a JSON object of rates); {fix}")
    known = {f.name for f in fields(Calibration)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{path}: unknown keys {unknown}; expected {sorted(known)}")
    try:
        return Calibration(**data)
    except (TypeError, ValueError, AttributeError) as err:
        raise ValueError(f"{path}: {err}; {fix}") from None


def local_cluster(n_procs: int, calibration: Calibration) -> Cluster:
    """``n_procs`` CPU processes on one machine, as a one-node cluster.

    A process computes at the measured matmul rate times the measured efficiency of an
    eager model; processes beyond the cores time-share them, each computing at
    cores / n_procs of that. With every core computing, gloo's threads take their CPU
    time from the compute, so communication "hidden" behind backward still costs all of
    its time (``overlap_cost`` 1); with spare cores it hides as on a GPU.
    """
    if n_procs < 1:
        raise ValueError(f"need at least one process, got {n_procs}")
    share = min(1.0, calibration.cores / n_procs)
    rates = calibration.matmul_flops
    eff = calibration.compute_efficiency
    fits = calibration.collectives(n_procs)
    alpha, beta = fits.get("all-reduce", (calibration.alpha, calibration.beta))
    cpu = GpuSpec(
        name="local-cpu",
        peak_flops=rates.get("bf16", rates["fp32"]) * share,
        peak_flops_fp32=rates["fp32"] * share,
        memory=calibration.memory // n_procs,
        hbm_bw=math.inf,  # not measured: the matmul rates are already what a process achieves
        nvlink_bw=beta, network_bw=beta, nvlink_alpha=alpha, network_alpha=alpha,
        efficiency=eff.get("bf16", 1.0), efficiency_fp32=eff.get("fp32", 1.0),
        half_dim=calibration.matmul_half_dim.get("bf16", 0.0),
        half_dim_fp32=calibration.matmul_half_dim.get("fp32", 0.0),
        layer_overhead=calibration.layer_overhead / share,
        moe_expert_overhead=calibration.moe_expert_overhead / share,
        moe_row_cost=calibration.moe_row_cost / share,
        # Adam reads and writes 28 bytes per parameter (dp_cost.OPTIMIZER_BYTES).
        optimizer_bw=28 * calibration.optimizer_rate * share,
        overlap_cost=1.0 if n_procs >= calibration.cores else 0.1,
        collectives=tuple((op, a, b) for op, (a, b) in sorted(fits.items())),
    )
    return Cluster(cpu, n_procs, gpus_per_node=n_procs, usable_memory=1.0, kind="local")
