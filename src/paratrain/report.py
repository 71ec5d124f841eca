"""``paratrain report RUN_DIR``: a run's metrics as one picture (loss and validation loss,
tokens/s, peak memory per rank, learning rate), drawn from ``metrics.jsonl``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


FORMATS = (".png", ".svg", ".pdf")


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The step records of a run directory's ``metrics.jsonl`` (or of that file itself);
    lines that are not a step's record, such as the one a killed run tore, are skipped
    with a note."""
    path = run_dir if run_dir.is_file() else run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics at {path}: pass the directory of a run "
                                f"(e.g. runs/latest), or a metrics.jsonl file")
    records, skipped = [], 0
    for line in path.read_text(errors="replace").splitlines():  # a torn tail may not be UTF-8
        try:
            record = json.loads(line) if line.strip() else None
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
        elif line.strip():
            skipped += 1
    if skipped:
        print(f"paratrain report: skipped {skipped} line(s) of {path} that are not a step's "
              f"record (a run killed mid-write tears its last line)", file=sys.stderr)
    if not records:
        raise FileNotFoundError(f"{path} holds no step record: the run wrote no step yet")
    return records


def check_out(out: str) -> Path:
    """``--out``: a .png/.svg/.pdf file in an existing directory."""
    path = Path(out)
    if path.is_dir() or path.suffix.lower() not in FORMATS:
        raise ValueError(f"--out {out}: name a {', '.join(FORMATS)} file (the format follows "
                         f"the extension)")
    if not path.resolve().parent.is_dir():
        raise ValueError(f"--out {out}: the directory {path.parent} does not exist")
    return path


def draw(records: list[dict[str, Any]], out: Path, title: str) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    moe = any("expert_load" in r for r in records)  # a mixture of experts: a third column
    fig, axes = plt.subplots(2, 3 if moe else 2, figsize=(15 if moe else 10, 6.5))
    ax = axes[0][0]
    ax.plot(steps, [r["loss"] for r in records], label="train")
    evals = [r for r in records if r.get("val_loss") is not None]
    if evals:
        ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o-", label="validation")
    ax.set(title="loss", xlabel="step")
    ax.legend()
    ax = axes[0][1]
    ax.plot(steps, [r["tokens_per_s"] for r in records])
    ax.set(title="tokens / s", xlabel="step")
    ax = axes[1][0]
    mem = [r for r in records if r.get("peak_mem_bytes")]
    # A run resumed at another world size appends records with more or fewer ranks: each
    # rank's line covers the records that have it (the first record's count used to index
    # past the end of a shorter list, or leave the added ranks out).
    for rank in range(max((len(r["peak_mem_bytes"]) for r in mem), default=0)):
        have = [r for r in mem if len(r["peak_mem_bytes"]) > rank]
        # Samples every --log-every steps of a peak so far: points, not a line that
        # suggests growth between them.
        ax.plot([r["step"] for r in have], [r["peak_mem_bytes"][rank] / 2**20 for r in have],
                "o:", label=f"rank {rank}")
    if mem:
        ax.legend(fontsize="small")
    kind = {"cpu_max_rss": "peak resident set", "cuda_max_allocated": "peak allocated"}.get(
        mem[-1].get("peak_mem_is", "") if mem else "", "peak memory")
    ax.set(title=f"{kind} per rank so far (MiB)", xlabel="step")
    ax = axes[1][1]
    ax.plot(steps, [r["lr"] for r in records])
    ax.set(title="learning rate", xlabel="step")
    if moe:
        routed = [r for r in records if "expert_load" in r]
        axes[0][2].plot([r["step"] for r in routed], [r["expert_load"] for r in routed])
        axes[0][2].axhline(1.0, color="grey", lw=0.8, ls=":")
        axes[0][2].set(title="busiest expert / mean load (worst layer)", xlabel="step")
        axes[1][2].plot([r["step"] for r in routed], [r["aux_loss"] for r in routed])
        axes[1][2].set(title="balancing loss, summed over MoE layers", xlabel="step")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="draw a run's metrics as a PNG",
                       description="Draw loss, validation loss, tokens/s, peak memory per rank "
                                   "and learning rate of a run into one PNG.")
    p.add_argument("run_dir", nargs="?", default="runs/latest", help="the run's directory (default: runs/latest)")
    p.add_argument("--out", default="", help="where to write the PNG (default: RUN_DIR/report.png)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    try:
        out = check_out(args.out) if args.out else None  # before reading: a bad flag costs nothing
    except ValueError as exc:
        print(f"paratrain report: error: {exc}", file=sys.stderr)
        return 2
    records = read_metrics(run_dir)
    home = run_dir.parent if run_dir.is_file() else run_dir
    # runs/latest is a link: the title names the run it points at
    out = draw(records, out or home / "report.png", home.resolve().name)
    print(f"report        {out} ({len(records)} steps)")
    return 0
