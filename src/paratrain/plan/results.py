"""What a search returns: the ranked plans, the rejections grouped by reason, and the
order plans are ranked in (``plan.search`` fills them)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .candidate import Candidate
from .cost import StepTime
from .memory import Memory


@dataclass(frozen=True)
class Plan:
    """One candidate with its predictions."""

    cand: Candidate
    """The layout and its choices."""
    memory: Memory
    """Peak bytes on the worst rank."""
    time: StepTime
    """Seconds per step by component."""
    tokens_per_s: float
    """Training throughput of the whole job."""
    mfu: float
    """Model FLOPs (no recompute) per second over the peak of all GPUs."""


@dataclass
class Rejected:
    """Candidates dropped for one reason; ``example`` is the one closest to working."""

    reason: str
    """The rule, with numbers blanked so alike rejections group together."""
    count: int = 0
    """Candidates dropped for it."""
    example: str = ""
    """One of them (``Candidate.describe`` or a shape)."""
    detail: str = ""
    """The full message for ``example``."""
    overflow: float = float("inf")
    """Bytes over the limit of ``example`` (memory rejections)."""


@dataclass
class SearchResult:
    """Ranked plans, the rejections, and what the search cost."""

    plans: list[Plan]
    """Fitting candidates, fastest first (equal at 3 significant figures: least memory)."""
    rejected: dict[str, Rejected] = field(default_factory=dict)
    """Rejections grouped by reason."""
    dominated: int = 0
    """Fitting candidates not ranked because the same candidate with less recompute fits
    and is at least as fast, or with a lower ZeRO stage is at least as fast and small."""
    shadowed: list[Plan] = field(default_factory=list)
    """The timed ones of those (a lower ZeRO stage as fast and small): not ranked, but
    ``--layout`` completes to them."""
    seconds: float = 0.0
    """Wall time of the search."""
    fastest: float = float("inf")
    """The fastest step time timed so far (the search's bound measures from it)."""
    within: float | None = None
    """The factor of the fastest within which plans were ranked (``search(within=)``);
    None: every fitting plan was timed."""

    @property
    def reach(self) -> float:
        """The slowest step time still ranked: ``within`` times the fastest so far (and a
        hair more: a bound that equals a plan's time, summed in another order, may exceed
        it in the last bit); without ``within``, every time."""
        return self.within * self.fastest * (1 + 1e-9) if self.within else float("inf")

    @property
    def considered(self) -> int:
        """Candidates enumerated: fitting, rejected or dominated."""
        return len(self.plans) + self.dominated + sum(r.count for r in self.rejected.values())

    def add(self, plan: Plan) -> None:
        """Rank ``plan`` (the search sorts them at the end)."""
        self.plans.append(plan)
        self.fastest = min(self.fastest, plan.time.step)

    def reject(self, reason: str, example: str, detail: str, count: int = 1,
               overflow: float = float("inf")) -> None:
        key = re.sub(r"\d+(\.\d+)?", "N", reason)
        group = self.rejected.setdefault(key, Rejected(key))
        group.count += count
        if overflow < group.overflow or not group.example:  # ``detail`` may be a callable:
            group.example, group.overflow = example, overflow  # built only when shown
            group.detail = detail() if callable(detail) else detail


def rank_key(step: float, memory: float) -> tuple[float, float]:
    """Order of plans: the model is not finer than 3 significant figures of step time;
    within that, less memory wins."""
    return float(f"{step:.3g}"), memory
