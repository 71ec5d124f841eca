"""A new user's first day, as journeys: each step is what the README or a printed hint
tells them to type, and it must work as written."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from paratrain.cli import main
from paratrain.models import param_shapes
from paratrain.models.gpt import PRESETS
from paratrain.plan.models import from_toml
from paratrain.train.config import load

SRC = str(Path(__file__).resolve().parents[1] / "src")


def test_the_tiny_preset_trains_with_every_other_setting_at_its_default(tmp_path):
    run = subprocess.run([sys.executable, "-m", "paratrain", "train", "--model", "tiny", "--steps", "2",
                          "--nproc", "2", "--run-dir", str(tmp_path / "run"), "--no-progress"],
                         env={**os.environ, "PYTHONPATH": SRC}, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 2


def test_a_plans_config_runs_scaled_down_as_its_hint_says(tmp_path, capsys):
    """``plan --out`` for Llama 3 8B, then the command its hint prints: ``--model tiny``
    replaces the file's shape (it used to keep the 8B shape and be refused for memory) and
    keeps the planned layout."""
    out = tmp_path / "plan.toml"
    assert main(["plan", "--model", "llama3-8b", "--gpu", "h100-80g", "--gpus", "8", "--out", str(out)]) == 0
    printed = capsys.readouterr()
    hint = next(line for line in (printed.out + printed.err).splitlines() if "--model tiny" in line)
    assert f"--config {out}" in hint and "--model tiny" in out.read_text()  # said in both places
    argv = shlex.split(hint.split("`")[1])[2:]  # after `paratrain train`
    flags = dict(zip(argv[::2], argv[1::2]))
    planned = load(str(out))
    cfg = load(str(out), {"preset": flags["--model"], "seq_len": int(flags["--seq-len"]),
                          "global_batch": int(flags["--global-batch"]),
                          "microbatches": int(flags["--microbatches"])}).validate()
    assert cfg.model == PRESETS["tiny"] and cfg.model_preset == "tiny"
    assert (cfg.parallel.nproc, cfg.parallel.cp, cfg.parallel.zero) == (
        planned.parallel.nproc or 8, planned.parallel.cp, planned.parallel.zero)
    assert load(str(out), {"preset": "tiny", "d_model": 128}).model.d_model == 128  # flags still apply


def test_a_whole_shape_without_kv_heads_plans_and_trains_as_multi_head_attention(tmp_path):
    """A [model] table that writes out a shape and names no preset takes nothing from the
    default preset (whose 2 key/value heads made a 96-head 145B GPT plan as 122B)."""
    path = tmp_path / "gpt.toml"
    path.write_text("[model]\nvocab_size = 50257\nn_layers = 2\nd_model = 96\nn_heads = 6\n")
    cfg = load(str(path)).validate()
    assert cfg.model.kv_heads == cfg.model.n_heads == 6 and cfg.model_preset == "custom"
    shapes = param_shapes(cfg.model)
    assert shapes["layers.0.attn.wk.weight"] == (96, 96)  # one key head per query head
    planned = from_toml(path)
    assert planned.n_kv_heads == 6 and planned.ffn_hidden == cfg.model.ffn_dim
    built = sum(torch.Size(s).numel() for s in shapes.values())
    assert planned.num_params() == built, (planned.num_params(), built)
    # a partial table still changes the default preset, as documented
    path.write_text("[model]\nd_model = 96\nn_heads = 6\n")
    assert load(str(path)).model.n_kv_heads == PRESETS["small"].n_kv_heads


def test_export_from_another_directory_carries_the_datasets_tokenizer(tmp_path):
    """Prepare, train and export with relative paths, the export run from elsewhere: the run
    recorded its dataset relative to where it trained, so the export said "no tokenizer
    carried"."""
    from helpers import tiny_bpe

    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    tiny_bpe(work / "tokenizer.json")
    (work / "text.txt").write_text("the cat sat on the mat\n" * 400)
    env = {**os.environ, "PYTHONPATH": SRC}
    for cwd, argv in ((work, ["data", "prepare", "text.txt", "--tokenizer", "tokenizer.json", "--out", "data"]),
                      (work, ["train", "--model", "tiny", "--data", "data", "--vocab-size", "259", "--steps", "2",
                              "--save-every", "2", "--nproc", "2", "--run-dir", "run", "--seq-len", "32",
                              "--no-progress"]),
                      (elsewhere, ["export", "../work/run/checkpoints/step-2", "--to", "hf", "--out", "out"])):
        done = subprocess.run([sys.executable, "-m", "paratrain", *argv], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "no tokenizer carried" not in done.stdout + done.stderr
    assert (elsewhere / "out" / "tokenizer.json").is_file()
    assert json.loads((elsewhere / "out" / "config.json").read_text())["eos_token_id"] == 2


def test_compression_that_never_starts_within_the_run_is_warned():
    from paratrain.train.preflight import advice

    late = load(None, {"preset": "tiny", "compress": "int8", "steps": 5}).validate()
    assert any("--compress int8 never starts: compression begins after 20 optimizer steps" in n
               for n in advice(late))
    early = load(None, {"preset": "tiny", "compress": "int8", "steps": 5, "compress_start": 1}).validate()
    assert not any("never starts" in n for n in advice(early))


@pytest.mark.timeout(400)
def test_the_readme_two_node_example_compresses(tmp_path):
    """It ran 5 steps with compression starting after 20: it compressed nothing."""
    import re

    from test_cluster import TOOL, _skip_reason

    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    line = next(ln for ln in readme.splitlines() if ln.startswith("python scripts/cluster.py"))
    argv = shlex.split(line.split("#")[0])[2:]  # after `python scripts/cluster.py`
    tag = f"j{os.getpid() % 100000}"
    done = subprocess.run([sys.executable, str(TOOL), "--tag", tag, *argv, "--run-dir", str(tmp_path / "run"),
                           "--no-progress"], env={**os.environ, "PYTHONPATH": SRC},
                          capture_output=True, text=True, timeout=360)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    last = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["comm_ratio"] > 1, last
    assert not re.search("never starts", done.stderr)


def test_the_output_says_what_it_shows(tmp_path, capsys, monkeypatch):
    """Help, plot and report as a new user met them: the heat2d flags looked like language-
    model ones, the small preset's defaults were shown under --model DIR, plan --optimizer
    had no help, the report was titled 'runs/latest' and CPU memory did not say it was RSS."""
    from paratrain.cli import build_parser
    from paratrain.report import read_metrics

    helps = {a.dest: a.help for a in build_parser()._subparsers._group_actions[0].choices["plan"]._actions}
    assert helps["optimizer"] and "sgd" in helps["optimizer"]
    train_help = build_parser()._subparsers._group_actions[0].choices["train"].format_help()
    assert "heat2d (read only with --task heat2d" in train_help
    assert "a Hugging Face --model DIR fixes all but max_seq_len" in train_help
    run = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "paratrain", "train", "--model", "tiny", "--steps", "2",
                           "--nproc", "1", "--seq-len", "32", "--run-dir", str(run), "--no-progress",
                           "--log-every", "1"], env={**os.environ, "PYTHONPATH": SRC},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert read_metrics(run)[-1]["peak_mem_is"] == "cpu_max_rss"
    (tmp_path / "latest").symlink_to(run)
    from paratrain import report

    titles, draw = [], report.draw
    monkeypatch.setattr(report, "draw", lambda records, out, title: (titles.append(title), draw(records, out, title))[1])
    assert main(["report", str(tmp_path / "latest")]) == 0
    assert titles == ["run"] and (run / "report.png").is_file()  # the run's name, not 'latest'


def test_quiet_prints_nothing_but_warnings_and_a_library_user_can_capture_the_rest(tmp_path, caplog, monkeypatch):
    import logging

    run = subprocess.run([sys.executable, "-m", "paratrain", "train", "--model", "tiny", "--steps", "2",
                          "--nproc", "2", "--seq-len", "32", "--run-dir", str(tmp_path / "q"), "--quiet"],
                         env={**os.environ, "PYTHONPATH": SRC}, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout == "", run.stdout
    assert "warning: steps=2 is not above warmup_steps=20" in run.stderr  # warnings stay
    assert (tmp_path / "q" / "metrics.jsonl").read_text().count("\n") == 2
    from paratrain.train import runs

    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.INFO, logger="paratrain"):
        runs.place_and_print(load(None, {"preset": "tiny"}).validate(), torchrun=False)
    assert any(r.getMessage().startswith("run directory runs/") for r in caplog.records)
