"""The Python API example trains a Hugging Face Llama in its own loop, and its losses are
the ones ``paratrain train`` gets for the same model, layout and data."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_llama_example_trains_like_paratrain_train(tmp_path):
    model = tmp_path / "tiny-llama"
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "train_llama.py"), "--make-tiny", str(model),
                           "--nproc", "2", "--tp", "2", "--steps", "3", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    example = json.loads(done.stdout.strip().splitlines()[-1])["losses"]
    run = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "paratrain", "train", "--model", str(model), "--nproc", "2",
                           "--tp", "2", "--seq-len", "64", "--global-batch", "8", "--micro-batch", "2",
                           "--steps", "3", "--lr", "1e-3", "--warmup-steps", "1", "--eval-every", "0",
                           "--no-progress", "--run-dir", str(run)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    cli = [m["loss"] for m in metrics if "loss" in m]
    assert len(example) == len(cli) == 3
    assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(example, cli)), (example, cli)
