"""Step time of `paratrain train` in two source trees, interleaved (a refactor's before/after).

    git worktree add /tmp/before <commit>
    python scripts/before_after.py /tmp/before/src src [ROUNDS]

Prints, per layout, the median step time (steps 3-12 of a 12-step run of the small model)
in each tree and after / before, then one JSON line."""
import json, os, statistics, subprocess, sys, tempfile
TREES = {"before": sys.argv[1], "after": sys.argv[2]}
LAYOUTS = {"dp2": ["--dp", "2"], "dp2 zero3": ["--dp", "2", "--zero", "3"], "tp2 sp": ["--tp", "2", "--sp"],
           "pp2 1f1b": ["--pp", "2"], "dp2 accum4": ["--dp", "2", "--micro-batch", "2"]}
ROUNDS = int(sys.argv[3]) if len(sys.argv) > 3 else 3
def run(tree, args):
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", "paratrain", "train", "--model", "small", "--steps", "12", "--global-batch", "16",
               "--eval-every", "0", "--no-progress", "--run-dir", d, *args]
        subprocess.run(cmd, env={**os.environ, "PYTHONPATH": tree}, check=True, capture_output=True, text=True)
        recs = [json.loads(l) for l in open(os.path.join(d, "metrics.jsonl"))]
        return statistics.median(r["step_time_s"] for r in recs[2:])
res = {k: {t: [] for t in TREES} for k in LAYOUTS}
for r in range(ROUNDS):
    for name, args in LAYOUTS.items():
        for tree in (TREES if r % 2 == 0 else dict(reversed(list(TREES.items())))):
            res[name][tree].append(run(TREES[tree], args))
for name, v in res.items():
    b, a = statistics.median(v["before"]), statistics.median(v["after"])
    print(f"{name:12s} before {b:.4f}s after {a:.4f}s ratio after/before {a / b:.3f}  ({v})")
print(json.dumps({"benchmark": "step_path_before_after", "ratios": {n: round(statistics.median(v['after']) / statistics.median(v['before']), 3) for n, v in res.items()}, "rounds": ROUNDS, "load": os.getloadavg()[0]}))
