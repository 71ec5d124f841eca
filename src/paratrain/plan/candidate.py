"""What the planner chooses between: the training shape (fixed) and a candidate layout."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

from ..layout import Layout
from .keys import cached_hash
from .speed import FUSED, Speed

PRECISIONS = ("bf16", "fp32")
OPTIMIZERS = ("adam", "sgd")
RECOMPUTE = ("none", "selective", "full")
DEFAULT_RANK_ORDER = ("tp", "cp", "pp", "dp")
"""paratrain's rank order, fastest-varying first (``layout.DEFAULT_ORDER``)."""
SCHEDULES = ("gpipe", "1f1b", "interleaved")


@dataclass(frozen=True)
class Training:
    """The part of a run every layout shares."""

    def __hash__(self) -> int:  # a search cache key: hashed once (plan/keys.py)
        return cached_hash(self)

    global_batch: int
    """Sequences per optimizer step, over all data-parallel replicas."""
    seq_len: int
    """Tokens per sequence."""
    precision: str = "bf16"
    """``bf16`` (bf16 compute, fp32 master weights) or ``fp32``."""
    optimizer: str = "adam"
    """``adam`` (two fp32 states) or ``sgd`` (SGD with momentum: one fp32 state)."""
    flash_attention: bool = True
    """Attention runs in a fused FlashAttention-style kernel (no s x s scores in memory);
    False: the unfused attention of software before 2022 (batched QK^T and softmax·V
    GEMMs, the scores written and read by softmax and dropout)."""
    tp_backward_overlap: bool = True
    """In backward, the input-gradient all-reduce (with SP: the reduce-scatter) at each
    tensor-parallel region's entry runs while the column-parallel layers reading that
    input compute their weight gradients: paratrain's ``sequence.EnterColumnParallel``,
    and Megatron's ``LinearWithGradAccumulationAndAsyncCommunication`` (Megatron-LM and
    apex since 2022). False: software that runs them in turn (Megatron-LM in 2021)."""
    dp_overlap: bool = True
    """The data-parallel gradient reduction runs beside the last microbatch's backward,
    bucket by bucket (paratrain, torch DDP, DeepSpeed, Megatron-core's
    ``overlap_grad_reduce``). False: it starts after the whole backward (Megatron-LM in
    2021, whose default ``local`` DDP called ``allreduce_gradients`` after
    ``forward_backward_func`` returned)."""
    fp32_grad_copy: bool = False
    """The optimizer keeps an fp32 copy of each 16-bit gradient beside its master weight
    through the next step's forward and backward: 4 more bytes per parameter, sharded
    with the optimizer state. Megatron-LM in 2021 did (``Float16OptimizerWithFloat16Params``
    set ``main_param.grad = grad.float()`` and its ``zero_grad`` left those alone until
    July 2021)."""
    moe_imbalance: float = 1.0
    """Load-imbalance headroom of a mixture of experts (``--moe-imbalance``, ``plan/moe.py``):
    the routed rows of the busiest expert-parallel rank over the mean. Its experts' GEMM
    rows, the all-to-all bytes it receives and its routed activations are scaled by it
    when ep > 1. 1.0: balanced routing."""
    rank_order: tuple[str, ...] = DEFAULT_RANK_ORDER
    """Axes from fastest- to slowest-varying rank (the runtime's, ``--runtime``): which
    groups share a node. paratrain puts pp inside dp; Megatron, torchtitan and DeepSpeed
    put pp outermost, so that dp (and ep folded over it) are neighbours."""
    speed: Speed = FUSED
    """How fast the trainer runs the counted work (``plan/speed.py``, ``--runtime``): the
    fused model unless the runtime's measured profile says otherwise."""

    def __post_init__(self) -> None:
        if self.global_batch < 1 or self.seq_len < 1:
            raise ValueError("global batch and sequence length must be positive")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision {self.precision!r}: pick one of {PRECISIONS}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer {self.optimizer!r}: pick one of {OPTIMIZERS}")
        if not 1.0 <= self.moe_imbalance < float("inf"):
            raise ValueError(f"--moe-imbalance {self.moe_imbalance}: the busiest rank's load over "
                             f"the mean is at least 1 (1: balanced)")

    @property
    def act_bytes(self) -> int:
        """Bytes of one activation element (compute dtype)."""
        return 2 if self.precision == "bf16" else 4

    @property
    def tokens(self) -> int:
        return self.global_batch * self.seq_len


@dataclass(frozen=True)
class Candidate:
    """One way to run the step: a layout plus the schedule and memory choices."""

    def __hash__(self) -> int:  # a search cache key: hashed once (plan/keys.py)
        return cached_hash(self)

    layout: Layout
    """The parallel axes' sizes (dp, tp, pp, cp), the trainer's own layout type; the
    fields below are the strategy choices made on top of it."""
    zero: int
    """ZeRO stage over the dp x cp ranks that hold the same parameters."""
    micro_batch: int
    """Sequences per microbatch."""
    microbatches: int
    """Microbatches per step per replica (gradient accumulation steps)."""
    schedule: str = "1f1b"
    """``gpipe``, ``1f1b`` or ``interleaved`` (only meaningful when pp > 1)."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (interleaved schedule)."""
    recompute: str = "none"
    """Activation recomputation: ``none``, ``selective`` (attention core) or ``full``."""
    sequence_parallel: bool = True
    """Sequence parallelism with tp > 1 (the search always uses it: same communication
    volume as plain TP, less memory); False describes a plain-TP run to compare with."""
    shard_group: int = 0
    """Ranks one ZeRO-3 shard spans: 0 for all dp x cp ranks; fewer is hybrid sharding
    (HSDP: shard within the group, replicate across groups). 0 takes the layout's
    (``Layout.shard_group``, what ``train`` builds from ``[parallel] shard_group``)."""
    cp_method: str = "ring"
    """Context parallelism's attention: ``ring`` (K,V passed around, overlapped with the
    attention core) or ``ulysses`` (all-to-alls to head sharding and back, exposed)."""
    reshard_after_forward: bool | None = None
    """ZeRO-3: free a unit's gathered parameters after each microbatch's forward and
    gather them again for its backward (True), or keep them from the step's first forward
    to its last backward, one gather per step (False). None: paratrain's ``auto``, True
    without a pipeline and False under one (parallel/zero/engine.py)."""

    def but(self, **changes) -> Candidate:
        """A copy with ``changes``: ``dataclasses.replace`` without its per-call field
        checks (the search makes tens of thousands)."""
        unknown = set(changes) - set(_CANDIDATE_FIELDS)
        if unknown:
            raise TypeError(f"Candidate has no field {', '.join(sorted(unknown))}")
        new = object.__new__(Candidate)  # the fields and the layout's sizes, copied as they are
        state = {k: v for k, v in self.__dict__.items() if k != "_hash"}
        state.update(changes)
        if "layout" in changes:
            state.update(dp=changes["layout"].dp, tp=changes["layout"].tp,
                         pp=changes["layout"].pp, cp=changes["layout"].cp)
        new.__dict__.update(state)
        return new

    @property
    def reshards(self) -> bool:
        """ZeRO-3 gathers each unit for every microbatch's forward and backward."""
        if self.reshard_after_forward is None:
            return self.pp == 1
        return self.reshard_after_forward

    @property
    def gather_choice(self) -> str:
        """``/reshard`` or ``/keep`` where ZeRO-3's choice departs from paratrain's auto,
        else empty: the suffix the tables print after the ZeRO stage."""
        if self.zero != 3 or self.reshards == (self.pp == 1):
            return ""
        return "/reshard" if self.reshards else "/keep"

    def __post_init__(self) -> None:
        # The layout's sizes as plain attributes: the search reads them millions of times,
        # and a property costs a call each (benchmarks/plan_speed.py: 8%).
        for axis in ("dp", "tp", "pp", "cp"):
            object.__setattr__(self, axis, getattr(self.layout, axis))
        if not self.shard_group and self.layout.shard_group:
            object.__setattr__(self, "shard_group", self.layout.shard_group)

    dp: ClassVar[int]
    """Data-parallel replicas (``layout.dp``)."""
    tp: ClassVar[int]
    """Tensor-parallel ranks, with sequence parallelism whenever tp > 1 (``layout.tp``)."""
    pp: ClassVar[int]
    """Pipeline stages (``layout.pp``)."""
    cp: ClassVar[int]
    """Context-parallel ranks, ``cp_method``: ring attention or Ulysses (``layout.cp``)."""

    @property
    def sp(self) -> bool:
        """Sequence parallelism is on."""
        return self.tp > 1 and self.sequence_parallel

    @property
    def n_gpus(self) -> int:
        return self.layout.world_size

    @property
    def shard(self) -> int:
        """Ranks one ZeRO shard group and one gradient reduction span (dp x cp)."""
        return self.dp * self.cp

    @property
    def ep(self) -> int:
        """Expert-parallel ranks (``layout.ep``, folded onto the dp x cp ranks): each MoE
        block's experts are split over them."""
        return self.layout.ep

    @property
    def expert_shard(self) -> int:
        """Ranks holding the same experts (dp x cp / ep): the expert gradients' reduction
        group, which ZeRO shards expert states over."""
        return self.shard // self.layout.ep

    @property
    def zero_shard(self) -> int:
        """Ranks the ZeRO states are sharded over (the HSDP group, else ``shard``)."""
        return self.shard_group or self.shard

    @property
    def hsdp(self) -> bool:
        """Hybrid sharding: ZeRO-3 within groups smaller than dp x cp."""
        return 0 < self.shard_group < self.shard

    def sizes(self) -> dict[str, int]:
        return {"dp": self.dp, "pp": self.pp, "cp": self.cp, "tp": self.tp}

    def as_dict(self) -> dict[str, object]:
        """The flat form ``plan --json`` prints: axis sizes, then the strategy choices."""
        choices = {name: getattr(self, name) for name in _CANDIDATE_FIELDS if name != "layout"}
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp, "cp": self.cp, "ep": self.layout.ep,
                **choices, "sp": self.sp}

    def describe(self) -> str:
        """Compact form such as ``dp8 tp8 pp2 cp1 z1 1f1b mb1 rc=sel`` (``tp8-sp``: without
        sequence parallelism)."""
        sched = "" if self.pp == 1 else (
            f" {self.schedule}" + (f"/v{self.virtual_stages}" if self.virtual_stages > 1 else ""))
        hsdp = f"/hsdp{self.shard_group}" if self.hsdp else ""
        hsdp += self.gather_choice
        uly = "/ulysses" if self.cp > 1 and self.cp_method == "ulysses" else ""
        uly += f" ep{self.layout.ep}" if self.layout.ep > 1 else ""
        plain = "-sp" if self.tp > 1 and not self.sequence_parallel else ""
        return (f"dp{self.dp} tp{self.tp}{plain} pp{self.pp} cp{self.cp}{uly} z{self.zero}{hsdp}{sched} "
                f"mb{self.micro_batch}x{self.microbatches} rc={self.recompute}")


_CANDIDATE_FIELDS = tuple(f.name for f in fields(Candidate))
