"""Draws docs/img/published.png: where each published layout of tests/data/published_runs.toml
ranks in the planner's search for its model, cluster and batch (searching what its software
could run), as its predicted step time over the winner's. The test's bar (top 5, or within
5% of the winner) decides the colour; strict expected failures are marked with their rank.

    PYTHONPATH=src python docs/img/make_published.py      (about 20 s)
"""

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parents[1] / "tests"))
from test_plan_published import CASES, TOP, WITHIN, published_rank  # noqa: E402

rows = []
for case in CASES:
    if case.get("expect") == "skip":
        continue
    rank, ratio, _, _ = published_rank(case)
    rows.append((case["name"], case["source"], rank, ratio))

fig, ax = plt.subplots(figsize=(9, 0.28 * len(rows) + 1.2))
for y, (name, source, rank, ratio) in enumerate(reversed(rows)):
    passed = rank is not None and (rank <= TOP or ratio <= WITHIN)
    shown = min(ratio, 1.6) - 1
    # a winner's bar has no length: a sliver keeps its colour visible
    ax.barh(y, max(shown * 100, 0.3), color="tab:green" if passed else "tab:red", height=0.7)
    ax.annotate(f"#{rank}", (shown * 100 + 0.4, y), va="center", fontsize=7)
ax.set_yticks(range(len(rows)), [r[0] for r in reversed(rows)], fontsize=7)
ax.axvline((WITHIN - 1) * 100, color="black", linestyle="--", linewidth=1)
ax.annotate(f"within {round((WITHIN - 1) * 100)}%", ((WITHIN - 1) * 100 + 0.3, len(rows) - 0.6),
            fontsize=7)
ax.set_xlabel("predicted step time over the planner's winner, %\n"
              "(label: the published layout's rank; green: top 5 or within 5%)")
ax.set_title(f"{sum(1 for *_, r, q in rows if r and (r <= TOP or q <= WITHIN))} of {len(rows)} "
             f"published layouts pass")
fig.tight_layout()
fig.savefig(HERE / "published.png", dpi=120)
print(f"wrote {HERE / 'published.png'}")
