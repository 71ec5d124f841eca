"""Starting worlds: a failing rank ends the job fast; torchrun (two agents) and the CLI run."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from distributed import run_world
from paratrain.launch import RankFailed
from paratrain.mesh import Mesh
from paratrain.train import loop

TINY = ["--model", "tiny", "--seq-len", "32", "--steps", "3", "--eval-every", "0", "--no-progress"]


def fail_mid_step(cfg):
    """Rank 1 raises inside its second step, after forward; rank 0 goes on into the
    gradient all-reduce, which can then never complete."""
    run = loop.build(cfg, Mesh.build(cfg.layout))
    if dist.get_rank() == 1:
        chunk = run.engine.plan.chunks[-1]  # the engine's step runs it (here the whole model)
        forward = chunk.forward

        def broken(*args, **kwargs):
            loss = forward(*args, **kwargs)
            if run.engine.optimizer.state:  # past the first step
                raise FloatingPointError("injected: loss became nan on rank 1")
            return loss

        chunk.forward = broken
    for step in range(3):
        loop.train_step(run, step)


def test_failing_rank_ends_the_job_within_seconds_with_its_traceback(tmp_path):
    from helpers import tiny_config

    start = time.monotonic()
    with pytest.raises(RankFailed) as info:
        run_world(fail_mid_step, 2, tiny_config(str(tmp_path), nproc=2), timeout_s=120)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert "rank 1 failed first" in message
    assert "FloatingPointError: injected: loss became nan on rank 1" in message
    assert "in broken" in message  # the traceback, not just the message
    assert elapsed < 90, f"took {elapsed:.1f} s"  # named at once, not after the 120 s timeout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_metrics(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_two_torchrun_agents_train_as_two_nodes(tmp_path, background):
    port = free_port()
    agents = [background(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "paratrain-test",
         "-m", "paratrain", "train", *TINY, "--run-dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = [a.communicate(timeout=180)[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], "\n".join(outputs)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert len(records) == 3 and "dp2 (world 2)" in "".join(outputs)


def test_cli_trains_and_writes_metrics(tmp_path):
    metrics = tmp_path / "m.jsonl"
    done = subprocess.run([sys.executable, "-m", "paratrain", "train", *TINY, "--nproc", "2",
                           "--zero", "1", "--offload",
                           "--metrics", str(metrics), "--run-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    records = read_metrics(metrics)
    for key in ("step", "loss", "lr", "tokens_per_s", "step_time_s", "param_bytes", "grad_bytes",
                "optim_bytes", "grad_norm"):
        assert key in records[0], key
    assert records[-1]["loss"] < records[0]["loss"]
    assert records[0]["optim_bytes"] == records[0]["param_bytes"]  # ZeRO-1: m, v over 2 ranks
    assert "throughput" in done.stdout and "memory/rank" in done.stdout
    assert "--offload has no effect" in done.stdout
