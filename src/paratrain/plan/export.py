"""Files a plan is written to: a TOML config ``paratrain train`` runs, and a PNG chart.

The config has three tables (the mapping from a plan):

``[model]``    ``GPTConfig`` fields: vocab_size, d_model, n_layers, n_heads, n_kv_heads,
               ffn_hidden, max_seq_len (at least the planned seq_len), tie_embeddings.
               paratrain's model is Llama-style, so a GPT-3/BLOOM shape becomes the
               Llama-style model of the same size.
``[parallel]`` dp, tp, pp, cp, cp_method, zero from the layout (and ep for a mixture of
               experts); sp = (tp > 1);
               schedule ("gpipe" | "1f1b" | "interleaved"; "1f1b" when pp = 1, where it
               has no effect); microbatches (per step per replica, i.e. gradient
               accumulation steps); virtual_stages; reshard_after_forward ("yes" |
               "no") where a ZeRO-3 plan departs from paratrain's auto choice.
``[train]``    global_batch (sequences), micro_batch, seq_len, precision ("fp32" | "bf16"),
               recompute ("none" | "selective" | "full").
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from .. import rules
from ..layout import LayoutError
from . import mla
from .candidate import Candidate, Training
from .hardware import GiB
from .memory import rank_memory
from .models import TRAIN_PRESETS, ModelSpec
from .report import MEMORY_PARTS, layout_label, time_parts
from .results import Plan


def config_tables(plan: Plan, model: ModelSpec, training: Training) -> dict[str, dict]:
    """The plan as the ``[model]``, ``[parallel]``, ``[data]`` and ``[train]`` tables of
    ``paratrain train --config`` (see train/config.py). Per step and data-parallel rank,
    ``global_batch / dp = micro_batch x microbatches``: pipeline microbatches when pp > 1,
    gradient-accumulation steps otherwise."""
    c = plan.cand
    why = refusal(c, model, training)
    if why:
        raise ValueError(f"{c.describe()}: {why}")
    return {
        "model": _model_table(model, training.seq_len),
        "parallel": {"dp": c.dp, "tp": c.tp, "pp": c.pp, "cp": c.cp,
                     **({"ep": c.ep} if model.n_experts else {}), "zero": c.zero,
                     **({"shard_group": c.shard_group} if c.hsdp else {}),
                     "sp": c.sp, "cp_method": c.cp_method,
                     "schedule": c.schedule if c.pp > 1 else "1f1b",
                     "microbatches": c.microbatches, "virtual_stages": c.virtual_stages,
                     **({"reshard_after_forward": "yes" if c.reshard_after_forward else "no"}
                        if c.zero == 3 and c.reshard_after_forward is not None else {})},
        "data": {"seq_len": training.seq_len},
        "train": {"global_batch": training.global_batch, "micro_batch": c.micro_batch,
                  "precision": training.precision, "recompute": c.recompute},
    }


def _model_table(model: ModelSpec, seq_len: int) -> dict:
    """``[model]`` as train builds this model: a Hugging Face directory that holds weights
    as its preset (train reads the shape from its config.json and loads its weights; only
    max_seq_len may change; ``model.preset`` is empty for a config.json alone), a
    paratrain preset by name (so that train reports the model it runs) with
    the fields that shape it, else the fields alone."""
    preset = model.preset or (model.name if model.name in TRAIN_PRESETS else "")
    fields = model.gpt_fields(seq_len)
    if preset and (Path(preset) / "config.json").is_file():
        return {"preset": preset, "max_seq_len": fields["max_seq_len"]}
    return {**({"preset": preset} if preset else {}), **fields}


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def to_toml(tables: dict[str, dict], comment: str = "") -> str:
    """TOML text of flat tables of scalars (all a config needs; no extra dependency)."""
    lines = [f"# {line}" for line in comment.splitlines()]
    for name, values in tables.items():
        lines += ["", f"[{name}]"] + [f"{k} = {_toml_value(v)}" for k, v in values.items()]
    return "\n".join(lines).lstrip("\n") + "\n"


def refusal(cand: Candidate, model: ModelSpec, training: Training) -> str | None:
    """Why ``paratrain train`` would refuse ``cand`` as a config, or None. The planner
    also models what other software runs (SGD, tied embeddings split over stages or
    shards, plain TP where SP's split does not divide), so a plan can rank without being
    trainable here."""
    why = mla.planner_only(model)  # latent attention, or heads not d_model / n_heads wide
    if why:
        return why
    if training.optimizer != "adam":
        return f"`paratrain train` trains with AdamW; optimizer {training.optimizer!r} is planner-only"
    try:
        rules.tied_embeddings(model.tie_embeddings, cand.pp, cand.zero, schedule=cand.schedule)
        rules.sequence_parallel(cand.sp, cand.tp, cand.cp, training.seq_len)
        rules.expert_strategies(model.n_experts, cand.ep, cand.zero, "none")
    except LayoutError as err:
        return str(err)
    return None


def trainable(plans: list[Plan], model: ModelSpec, training: Training,
              limit: float | None = None, backend: str = "gloo") -> Plan:
    """The best of ``plans`` that ``paratrain train`` runs (``refusal``), or the best of
    all when none is (writing it then fails with the reason). With ``limit`` (usable bytes
    per GPU), also one that fits it as paratrain's own runtime holds memory: GPU plans are
    ranked with Megatron-style fused kernels (``plan.memory``), and paratrain's eager
    block keeps more (``plan.runtime``), on ``backend`` (nccl for GPU plans)."""
    runnable = [p for p in plans if not refusal(p.cand, model, training)]
    if limit is None or not runnable:
        return (runnable or plans)[0]
    fitting = next((p for p in runnable if runtime_bytes(p, model, training, backend) <= limit),
                   None)
    if fitting is None:  # none does: the best one's reason, with its numbers
        check_trainable(runnable[0], model, training, limit, backend)
    return fitting


def check_trainable(plan: Plan, model: ModelSpec, training: Training,
                    limit: float | None = None, backend: str = "gloo") -> None:
    """Raise ValueError naming why ``paratrain train`` would not run ``plan`` as written:
    a planner-only choice (``refusal``) or, with ``limit`` (usable bytes per GPU), more
    memory than that as paratrain's own runtime holds it (``trainable``)."""
    why = refusal(plan.cand, model, training)
    if why:
        raise ValueError(f"{plan.cand.describe()}: {why}")
    need = runtime_bytes(plan, model, training, backend)
    if limit is not None and need > limit:
        raise ValueError(f"{plan.cand.describe()} fits as ranked ({plan.memory.total / GiB:.2f} "
                         f"GiB per GPU, fused kernels' activations) but paratrain's eager "
                         f"runtime would hold {need / GiB:.2f} GiB of {limit / GiB:.2f} usable; "
                         f"try rc=full, more sharding (zero3, tp, pp) or a smaller mb")


def runtime_bytes(plan: Plan, model: ModelSpec, training: Training,
                  backend: str = "gloo") -> float:
    """Peak bytes per rank of ``plan`` as paratrain's eager runtime holds them on
    ``backend``: what ``paratrain train`` predicts and checks before it starts
    (train/preflight.py)."""
    return rank_memory(model, training, plan.cand, paratrain=True, backend=backend).total


def write_config(path: str | Path, plan: Plan, model: ModelSpec, training: Training,
                 backend: str = "gloo") -> None:
    """Write ``plan`` as a config ``paratrain train --config`` reads."""
    Path(path).write_text(to_toml(config_tables(plan, model, training),
                                  header(plan, model, training, backend)))


def header(plan: Plan, model: ModelSpec, training: Training, backend: str = "gloo") -> str:
    """The config's comment: the plan and its predictions. Memory is given as ranked and,
    where that differs (GPU plans, ranked with fused kernels), as paratrain's runtime
    holds it, the number `paratrain train` checks, so that the two never look like one
    number that changed."""
    runtime = runtime_bytes(plan, model, training, backend)
    ranked = plan.memory.total
    if abs(runtime - ranked) < 0.005 * GiB:  # the local cluster ranks by the runtime's count
        memory = (f"{runtime / GiB:.2f} GiB per rank as paratrain's runtime holds it (what "
                  f"`paratrain train` checks before it starts)")
    else:
        memory = (f"{ranked / GiB:.2f} GiB per rank as ranked (fused kernels, as Megatron-core\n"
                  f"runs it); {runtime / GiB:.2f} GiB as paratrain's eager runtime holds it, "
                  f"the number\n`paratrain train` predicts and checks before it starts")
    return (f"Written by `paratrain plan` for {model.name}: {layout_label(plan)}\n"
            f"predicted {plan.time.step:.3g} s/step, MFU {plan.mfu:.1%}\n"
            f"memory: {memory}\n{SCALED_DOWN}")


SCALED_DOWN = ("Try the layout on a small model first: `paratrain train --config THIS --model tiny\n"
               "--seq-len 64 --global-batch 16 --microbatches 0 --steps 20` (--model replaces the\n"
               "file's [model] table and keeps its layout; one that tiny cannot split is named before launch)")
"""How to run a plan scaled down: said in the config and by ``plan --out``."""


def plot(path: str | Path, plans: list[Plan], limit: float, title: str = "") -> None:
    """Stacked bars of the memory (against the usable ``limit`` bytes) and the time
    breakdown of ``plans``."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    # Wrapped at spaces, so neighbouring labels do not run into each other.
    labels = [f"#{i}\n" + textwrap.fill(f"{layout_label(p)} mb{p.cand.micro_batch} "
                                        f"{p.cand.recompute}", 14, break_long_words=False)
              for i, p in enumerate(plans, 1)]
    fig, (mem_ax, time_ax) = plt.subplots(1, 2, figsize=(max(8, 2.4 * len(plans)), 5))
    for ax, parts, value, unit in (
            (mem_ax, MEMORY_PARTS, lambda p, k: getattr(p.memory, k) / GiB, "GiB per rank"),
            (time_ax, time_parts(plans[0].time), lambda p, k: getattr(p.time, k),
             "seconds per step")):
        bottom = [0.0] * len(plans)
        for part in parts:
            heights = [value(p, part) for p in plans]
            ax.bar(range(len(plans)), heights, bottom=bottom, label=part)
            bottom = [b + h for b, h in zip(bottom, heights)]
        ax.set_xticks(range(len(plans)), labels, fontsize=7)
        ax.set_ylabel(unit)
        ax.legend(fontsize=7)
    # Stacked bars start at 0, so plans a few percent apart look alike: say by how much.
    best = min(p.time.step for p in plans)
    for i, p in enumerate(plans):
        gap = "best" if p.time.step == best else f"+{p.time.step / best - 1:.1%}"
        time_ax.annotate(f"{p.time.step:.3g} s\n{gap}", (i, p.time.step), ha="center",
                         va="bottom", fontsize=7)
    mem_ax.axhline(limit / GiB, color="black", linestyle="--", linewidth=1)
    mem_ax.annotate("usable", (len(plans) - 0.5, limit / GiB), fontsize=7, ha="right",
                    va="bottom")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
