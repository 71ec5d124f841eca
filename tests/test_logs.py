"""Logs people read: CSV and TensorBoard sinks next to metrics.jsonl, plain progress lines
when output is not a terminal, per-rank peak memory, MFU, a profiler window, and
``paratrain report``'s picture."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest
import torch

from paratrain.train.logs import ProfileWindow, flops_per_token, parse_sinks


def test_a_logged_run_writes_every_sink_and_the_report(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "paratrain", "train", "--model", "tiny", "--seq-len", "32",
           "--steps", "4", "--global-batch", "8", "--eval-every", "2", "--eval-batches", "1",
           "--log", "csv,tensorboard", "--log-every", "2", "--profile", "2:3",
           "--run-dir", str(run)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    # Not a terminal: plain lines every 2 steps instead of a progress bar.
    lines = [x for x in out.stdout.splitlines() if " step " in f" {x}" and "/4" in x]
    assert [x.split("step ")[1].split()[0] for x in lines] == ["2/4", "4/4"], out.stdout
    assert "\r" not in out.stdout + out.stderr
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [len(r.get("peak_mem_bytes", [])) for r in records] == [0, 2, 0, 2]
    assert all(b > 0 for b in records[-1]["peak_mem_bytes"])

    rows = list(csv.DictReader(open(run / "metrics.csv")))
    assert [float(r["loss"]) for r in rows] == pytest.approx([r["loss"] for r in records], rel=1e-12)
    assert rows[1]["val_loss"] and not rows[0]["val_loss"]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    tb_loss = [e.value for e in events.Scalars("train/loss")]
    assert tb_loss == pytest.approx([r["loss"] for r in records], rel=1e-6)
    assert [e.step for e in events.Scalars("val/loss")] == [2, 4]
    assert "memory/peak_bytes_rank1" in events.Tags()["scalars"]

    for rank in (0, 1):
        trace = json.loads((run / f"profile-rank{rank}.json").read_text())
        assert trace["traceEvents"], "an empty profiler trace"

    report = subprocess.run([sys.executable, "-m", "paratrain", "report", str(run)],
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    assert (run / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sink_and_profile_values_are_checked():
    assert parse_sinks(" csv, tensorboard ") == ("csv", "tensorboard")
    with pytest.raises(ValueError, match="unknown log sink"):
        parse_sinks("csv,mlflow")
    assert ProfileWindow.parse("", 10) is None
    assert ProfileWindow.parse("3:5", 10) == ProfileWindow(3, 5)
    for bad in ("5", "a:b", "0:2", "4:3", "9:11"):
        with pytest.raises(ValueError, match="profile="):
            ProfileWindow.parse(bad, 10)


def test_flops_per_token_follows_the_palm_count():
    # 6 per matmul weight plus 12 * layers * d_model * seq for attention.
    assert flops_per_token(n_layers=2, d_model=64, seq_len=32, matmul_params=1000) == 6 * 1000 + 12 * 2 * 64 * 32


def test_report_draws_a_run_resumed_at_another_world_size(tmp_path, capsys, monkeypatch):
    """A run resumed with fewer ranks appends records with shorter peak_mem_bytes lists:
    report ended in IndexError; with more ranks, the added ranks were left out."""
    import matplotlib

    from paratrain.cli import main
    from paratrain.report import draw

    record = {"loss": 2.0, "tokens_per_s": 1.0, "lr": 1e-3}
    mems = ([10, 20], [10, 20], [30], [30, 40, 50])
    lines = [json.dumps({"step": s + 1, **record, "peak_mem_bytes": [m * 2**20 for m in mem]})
             for s, mem in enumerate(mems)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert main(["report", str(tmp_path)]) == 0
    assert "(4 steps)" in capsys.readouterr().out
    seen = {}
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: seen.update(fig=fig))
    draw([json.loads(x) for x in lines], tmp_path / "r.png", "run")
    memory = seen["fig"].axes[2]
    assert [(line.get_label(), list(line.get_xdata())) for line in memory.lines] == [
        ("rank 0", [1, 2, 3, 4]), ("rank 1", [1, 2, 4]), ("rank 2", [4])]


def test_the_profiler_window_prints_nothing_on_the_terminal(tmp_path, capfd):
    """torch.profiler's C++ side wrote "profiler_start" / "profiler_stop" lines straight to
    the terminal's stderr, between paratrain's own lines."""
    from paratrain.train.logs import Profiler, ProfileWindow

    profiler = Profiler(ProfileWindow.parse("1:1", 2), tmp_path, 0, torch.device("cpu"))
    capfd.readouterr()
    profiler.before(1)
    torch.ones(8, 8) @ torch.ones(8, 8)
    assert profiler.after(1) == tmp_path / "profile-rank0.json" and profiler.path.is_file()
    out, err = capfd.readouterr()
    assert out == "" and err == "", (out, err)


@pytest.mark.parametrize("device_name, preset", [
    ("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100-80g"),
    ("NVIDIA A100-SXM4-80GB", "a100-80g"), ("NVIDIA A100-SXM4-40GB", "a100-40g"),
    ("Tesla T4", None)])
def test_a_gpu_finds_its_preset_by_name_and_memory(device_name, preset):
    """MFU's peak and gpu_check's planner preset come from the device's name; where the
    family has several memory sizes, the name's own size picks."""
    from paratrain.plan.hardware import preset_for_device

    found = preset_for_device(device_name)
    assert (found.name if found else None) == preset
