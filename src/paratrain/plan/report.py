"""Human and machine output of a search: tables, ``--explain``, ``--show-rejected``, JSON."""

from __future__ import annotations

from dataclasses import asdict

from .candidate import Training
from .hardware import GiB, Cluster
from .models import ModelSpec, describe
from .results import Plan, SearchResult

MEMORY_PARTS = ("params", "grads", "optimizer", "activations", "buffers")
TIME_PARTS = ("compute", "bubble", "tp", "cp", "pp", "dp", "optimizer")
MiB = 2**20


def time_parts(time) -> tuple[str, ...]:
    """The columns of a step time: ``TIME_PARTS``, with a mixture of experts' all-to-alls
    (``ep``) after pp's sends (a dense model's tables have no such column)."""
    if time is None or time.ep is None:
        return TIME_PARTS
    return TIME_PARTS[:5] + ("ep",) + TIME_PARTS[5:]


def _short(part: str) -> str:
    return "optim" if part == "optimizer" else part


def size(nbytes: float, signed: bool = False) -> str:
    """Bytes in GiB, or MiB below one GiB (local models are small)."""
    unit, scale = ("GiB", GiB) if abs(nbytes) >= GiB else ("MiB", MiB)
    return f"{nbytes / scale:{'+' if signed else ''}.1f} {unit}"


def table(headers: list[str], rows: list[list[str]]) -> str:
    """Columns right-aligned except the first two (rank and layout)."""
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]
    lines = []
    for row in [headers, *rows]:
        cells = [c.ljust(w) if i == 1 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def header(model: ModelSpec, training: Training, cluster: Cluster) -> str:
    nodes = max(1, cluster.n_gpus // cluster.node_size)
    return (f"model    {describe(model)}\n"
            f"cluster  {cluster.n_gpus} x {cluster.gpu.name} ({nodes} node(s) of "
            f"{cluster.node_size}), {cluster.memory_limit / GiB:.1f} GiB usable per rank\n"
            f"training global batch {training.global_batch} x {training.seq_len} tokens, "
            f"{training.precision}, {training.optimizer}")


def layout_label(plan: Plan) -> str:
    c = plan.cand
    sched = "" if c.pp == 1 else " " + c.schedule + (
        f"/v{c.virtual_stages}" if c.virtual_stages > 1 else "")
    hsdp = c.gather_choice + (f"/hsdp{c.shard_group}" if c.hsdp else "")
    uly = "/ulysses" if c.cp > 1 and c.cp_method == "ulysses" else ""
    uly += f" ep{c.ep}" if c.ep > 1 else ""
    return (f"dp{c.dp} tp{c.tp}{'+sp' if c.sp else ''} pp{c.pp} cp{c.cp}{uly} "
            f"zero{c.zero}{hsdp}{sched}")


def summary(result: SearchResult, model: ModelSpec, training: Training, cluster: Cluster,
            top: int = 5) -> str:
    """The three tables of the ``top`` plans and a line on the search itself."""
    plans = result.plans[:top]
    if not plans:
        return f"{header(model, training, cluster)}\n\nno valid layout fits\n{search_line(result)}"
    rows = [[str(i), layout_label(p), f"{p.cand.micro_batch}x{p.cand.microbatches}",
             p.cand.recompute, f"{p.time.step:.3g}", f"{p.tokens_per_s:,.0f}", f"{p.mfu:.1%}"]
            for i, p in enumerate(plans, 1)]
    unit, scale = ("GiB", GiB) if max(p.memory.total for p in plans) >= GiB else ("MiB", MiB)
    mem = [[str(i), layout_label(p)] + [f"{getattr(p.memory, k) / scale:.1f}" for k in MEMORY_PARTS]
           + [f"{p.memory.total / scale:.1f}"] for i, p in enumerate(plans, 1)]
    parts = time_parts(plans[0].time)
    times = [[str(i), layout_label(p)] + [f"{getattr(p.time, k):.3g}" for k in parts]
             + [f"{p.time.step:.3g}"] for i, p in enumerate(plans, 1)]
    return "\n\n".join([
        header(model, training, cluster),
        table(["#", "layout", "mb x m", "recompute", "step s", "tokens/s", "MFU"], rows),
        f"memory per rank, {unit} (worst pipeline stage)\n" + table(
            ["#", "layout", "params", "grads", "optim", "activ", "buffers", "total"], mem),
        "time per step, s (comm columns are the exposed part)\n" + table(
            ["#", "layout", *map(_short, parts), "step"], times),
        search_line(result),
    ])


def search_line(result: SearchResult) -> str:
    dropped = sum(r.count for r in result.rejected.values())
    return (f"searched {result.considered:,} candidates in {result.seconds:.2f} s: "
            f"{len(result.plans):,} ranked, {result.dominated:,} skipped (no faster or smaller "
            f"than less recompute or a lower ZeRO stage), {dropped:,} rejected "
            f"(--show-rejected for why)" + (f"; only plans within {result.within:g}x of the "
                                            f"fastest are ranked (--within)"
                                            if result.within else _slow_hint(result)))


SLOW_SEARCH_S = 5.0
"""A full search longer than this suggests ``--within``."""


def _slow_hint(result: SearchResult) -> str:
    if result.seconds <= SLOW_SEARCH_S:
        return ""
    return ("; --within 1.25 ranks only the plans within 25% of the fastest (the same ones) "
            "in a fraction of the time")


# ---- --explain ----------------------------------------------------------------------------

def _deltas(plan: Plan, other: Plan) -> str:
    """The time components that differ most, largest first."""
    diffs = [(getattr(other.time, k) - getattr(plan.time, k), k) for k in time_parts(plan.time)]
    diffs.sort(key=lambda d: -abs(d[0]))
    shown = [f"{k} {d:+.3g} s" for d, k in diffs if abs(d) >= 0.005 * plan.time.step][:3]
    mem = size(other.memory.total - plan.memory.total, signed=True)
    return (", ".join(shown) or "no component differs by 0.5%") + f"; memory {mem}"


def _versus(plan: Plan, other: Plan, what: str) -> str:
    slower = other.time.step / plan.time.step - 1
    name = (f"{what}: {layout_label(other)}, mb {other.cand.micro_batch}, recompute "
            f"{other.cand.recompute}: {other.time.step:.3g} s ({slower:+.1%})")
    if slower < 0.005:
        memory = size(other.memory.total - plan.memory.total, signed=True)
        return f"{name}, a tie within the model's precision; memory {memory}"
    return f"{name}: {_deltas(plan, other)}"


def explain(result: SearchResult, cluster: Cluster, training: Training | None = None) -> str:
    """Why the winner: its breakdown, the runner-up, and the best plan that changes each
    choice (tp, pp, cp, ZeRO stage, recompute) with the components that make it slower;
    for a mixture of experts the load-imbalance headroom of ``training``."""
    if not result.plans:
        return "nothing fits: see --show-rejected"
    best = result.plans[0]
    t, m = best.time, best.memory
    comm = t.tp + t.cp + t.pp + t.dp + (t.ep or 0.0)
    experts = "" if t.ep is None else f", ep {t.ep:.3g}"
    lines = [
        f"winner: {layout_label(best)}, microbatch {best.cand.micro_batch} x "
        f"{best.cand.microbatches}, recompute {best.cand.recompute}",
        f"  step {t.step:.3g} s = compute {t.compute:.3g} + bubble {t.bubble:.3g} + exposed "
        f"comm {comm:.3g} (tp {t.tp:.3g}, cp {t.cp:.3g}, pp {t.pp:.3g}{experts}, dp {t.dp:.3g}) + "
        f"optimizer {t.optimizer:.3g}",
        f"  memory {size(m.total)} of {size(cluster.memory_limit)} usable on stage {m.stage} "
        f"(states {size(m.states)}, activations {size(m.activations)}, "
        f"buffers {size(m.buffers)})",
    ]
    if t.ep is not None and training is not None:
        f = training.moe_imbalance
        effect = ("balanced routing" if f == 1 else f"the busiest ep rank's expert GEMM rows, "
                  f"routed activations and received all-to-all bytes x {f:g} when ep > 1")
        lines.append(f"  experts: load imbalance {f:g} (--moe-imbalance: {effect})")
    if len(result.plans) > 1:
        lines.append("  " + _versus(best, result.plans[1], "runner-up"))
    for knob in ("tp", "pp", "cp", *(("ep",) if t.ep is not None else ()), "zero", "recompute"):
        mine = getattr(best.cand, knob)
        other = next((p for p in result.plans if getattr(p.cand, knob) != mine), None)
        if other is None:
            lines.append(f"  every ranked plan has {knob}={mine}: the others are invalid, "
                         f"do not fit, or are " + (f"not within {result.within:g}x of it "
                                                   f"(--within)" if result.within
                                                   else "never faster"))
        else:
            what = f"best with {knob}={getattr(other.cand, knob)}"
            lines.append("  " + _versus(best, other, what))
    return "\n".join(lines)


# ---- --show-rejected ----------------------------------------------------------------------

def rejected(result: SearchResult) -> str:
    """One row per reason: how many, and the candidate that came closest."""
    groups = sorted(result.rejected.values(), key=lambda r: -r.count)
    if not groups:
        return "nothing was rejected"
    lines = ["rejected candidates, by reason (example: the one closest to fitting)"]
    for g in groups:
        lines.append(f"  {g.count:>8,}  {g.reason}\n            e.g. {g.example}: {g.detail}")
    return "\n".join(lines)


# ---- --json -------------------------------------------------------------------------------

def plan_dict(plan: Plan) -> dict:
    c = plan.cand
    return {
        "layout": {**c.as_dict(), "reshards": c.reshards},
        "memory_bytes": {**{k: getattr(plan.memory, k) for k in MEMORY_PARTS},
                         "total": plan.memory.total, "stage": plan.memory.stage},
        "time_s": {**{k: getattr(plan.time, k) for k in time_parts(plan.time)},
                   "step": plan.time.step},
        "tokens_per_s": plan.tokens_per_s,
        "mfu": plan.mfu,
    }


def setting_dict(model: ModelSpec, training: Training, cluster: Cluster) -> dict:
    """The model, cluster (with its usable memory) and training a plan is for."""
    return {
        "model": {**asdict(model), "params": model.num_params(),
                  **({"active_params": model.active_params()} if model.n_experts else {})},
        "cluster": {"gpu": {k: v if v != float("inf") else None  # JSON has no infinity
                            for k, v in asdict(cluster.gpu).items()}, "n_gpus": cluster.n_gpus,
                    "gpus_per_node": cluster.node_size, "intra_bw": cluster.intra_bw,
                    "inter_bw": cluster.inter_bw, "memory_limit": cluster.memory_limit,
                    "kind": cluster.kind},
        "training": asdict(training),
    }


def to_json(result: SearchResult, model: ModelSpec, training: Training, cluster: Cluster,
            top: int = 5) -> dict:
    """Everything the tables show, in bytes and seconds."""
    return {
        **setting_dict(model, training, cluster),
        "search": {"considered": result.considered, "ranked": len(result.plans),
                   "dominated": result.dominated, "seconds": result.seconds},
        "plans": [plan_dict(p) for p in result.plans[:top]],
        "rejected": [{"reason": r.reason, "count": r.count, "example": r.example,
                      "detail": r.detail} for r in result.rejected.values()],
    }


# ---- --layout and --compare ---------------------------------------------------------------

def _eval_label(ev) -> str:
    c = ev.cand
    return (f"{layout_label(Plan(c, ev.memory, ev.time, 0, 0))} mb{c.micro_batch}x"
            f"{c.microbatches} rc={c.recompute}")


def _status(ev) -> str:
    if ev.fits:
        return "fits"
    return "REJECTED: " + "; ".join(ev.problems)


def _rank_line(ev, result: SearchResult) -> str:
    if ev.rank is None:
        return f"rank: not ranked: {ev.unranked}"
    best = result.plans[0]
    where = "would rank" if not ev.fits else "ranks"
    return (f"rank: {where} #{ev.rank} of {ev.ranked} ranked layouts by step time; the "
            f"winner is {layout_label(best)} mb{best.cand.micro_batch} rc="
            f"{best.cand.recompute} at {best.time.step:.3g} s "
            f"({ev.time.step / best.time.step - 1:+.1%} for this one)")


def layout_report(evaluations: list, result: SearchResult, model: ModelSpec,
                  training: Training, cluster: Cluster) -> str:
    """``--layout`` (one) or ``--compare`` (several, side by side)."""
    if len(evaluations) == 1:
        ev = evaluations[0]
        lines = [header(model, training, cluster), "",
                 f"layout   {_eval_label(ev)}", f"status   {_status(ev)}",
                 _rank_line(ev, result)]
        if ev.memory is not None:
            unit, scale = ("GiB", GiB) if ev.memory.total >= GiB else ("MiB", MiB)
            lines += ["", f"memory per rank, {unit} (worst pipeline stage: {ev.memory.stage})",
                      table(["#", "layout"] + list(MEMORY_PARTS) + ["total", "usable"],
                            [["1", _eval_label(ev)]
                             + [f"{getattr(ev.memory, k) / scale:.2f}" for k in MEMORY_PARTS]
                             + [f"{ev.memory.total / scale:.2f}",
                                f"{cluster.memory_limit / scale:.2f}"]]),
                      "", "time per step, s (comm columns are the exposed part)",
                      table(["#", "layout"] + list(time_parts(ev.time)) + ["step", "tokens/s", "MFU"],
                            [["1", _eval_label(ev)]
                             + [f"{getattr(ev.time, k):.4g}" for k in time_parts(ev.time)]
                             + [f"{ev.time.step:.4g}", f"{ev.tokens_per_s:,.0f}",
                                f"{ev.mfu:.1%}"]])]
        return "\n".join(lines)
    # Columns are numbered and the layouts listed above the table: five layouts' labels as
    # column heads made it 230 characters wide.
    legend = [f"#{i}  {_eval_label(ev)}" for i, ev in enumerate(evaluations, 1)]
    rows = [["layout"], ["status"], ["rank"]]
    rows += [[f"mem {k}"] for k in MEMORY_PARTS] + [["mem total"]]
    parts = time_parts(next((ev.time for ev in evaluations if ev.time is not None), None))
    rows += [[f"time {k}, s"] for k in parts] + [["step, s"], ["tokens/s"], ["MFU"]]
    for i, ev in enumerate(evaluations, 1):
        col = [f"#{i}", "fits" if ev.fits else "REJECTED",
               f"#{ev.rank} of {ev.ranked}" if ev.rank else "-"]
        if ev.memory is None:
            col += ["-"] * (len(rows) - 3)
        else:
            col += [size(getattr(ev.memory, k)) for k in MEMORY_PARTS] + [size(ev.memory.total)]
            col += [f"{getattr(ev.time, k):.4g}" for k in parts]
            col += [f"{ev.time.step:.4g}", f"{ev.tokens_per_s:,.0f}", f"{ev.mfu:.1%}"]
        for row, cell in zip(rows, col):
            row.append(cell)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    text = "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
    why = [f"  {i}: {'; '.join(ev.problems)}" for i, ev in enumerate(evaluations, 1)
           if not ev.fits]
    return "\n".join([header(model, training, cluster), ""] + legend + ["", text]
                     + (["", "rejected:"] + why if why else []))


def evaluation_dict(ev) -> dict:
    """One ``--layout`` / ``--compare`` entry for ``--json``."""
    data = {"fits": ev.fits, "problems": ev.problems, "overflow_bytes": ev.overflow,
            "rank": ev.rank, "ranked": ev.ranked, "unranked": ev.unranked}
    if ev.memory is None:
        return {"layout": ev.cand.as_dict(), **data}
    return {**plan_dict(Plan(ev.cand, ev.memory, ev.time, ev.tokens_per_s, ev.mfu)), **data}
