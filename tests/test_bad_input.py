"""Bad input ends with exit code 2 and a message naming the field, before any process starts.

One table of cases, each run through the real CLI in-process (``paratrain.cli.main``), with
the spawner and the torchrun worker replaced by functions that fail the test if called.
Two cases also run as a real subprocess, to prove the exit code end to end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from paratrain import launch
from paratrain.cli import build_parser, main
from paratrain.train import preflight, worker  # noqa: F401 - imported before any patching
from paratrain.train.worker import TORCHRUN_VARS, started_by_torchrun

# Import every sub-command's modules now: a module first imported while `launch.spawn` is
# patched would keep the patched function for the rest of the session.
build_parser()

TINY = ["--model", "tiny", "--seq-len", "16", "--nproc", "1"]
LLAMA_JSON = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
              "num_attention_heads": 4, "vocab_size": 256}
TORCHRUN_ENV = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x"}


def toml(text: str) -> dict:
    return {"run.toml": text}


def hf(**changes) -> dict:
    return {"m/config.json": json.dumps({**LLAMA_JSON, **changes})}


CFG = ["--config", "{tmp}/run.toml"]
PLAN_HF = ["plan", "--model", "{tmp}/m/config.json"]
# (id, argv, files written under tmp, environment, text the message must contain)
CASES = [
    # ---- the list ---------------------------------------------------------------
    ("toml-steps-float", ["train", *CFG], toml("[train]\nsteps = 5.5\n"), {}, "train.steps"),
    ("toml-steps-string", ["train", *CFG], toml('[train]\nsteps = "5"\n'), {}, "train.steps"),
    ("lr-nan", ["train", "--lr", "nan"], {}, {}, "optim.lr"),
    ("lr-inf", ["train", "--lr", "inf"], {}, {}, "optim.lr"),
    ("lr-negative", ["train", "--lr", "-1"], {}, {}, "optim.lr"),
    ("timeout-negative", ["train", "--timeout-s", "-1"], {}, {}, "parallel.timeout_s"),
    ("timeout-too-short", ["train", "--timeout-s", "0.01"], {}, {}, "parallel.timeout_s"),
    ("n-heads-0", ["train", "--n-heads", "0"], {}, {}, "model.n_heads"),
    ("val-fraction-1.5", ["train", "--val-fraction", "1.5"], {}, {}, "data.val_fraction"),
    ("plan-gpus-0", ["plan", "--model", "llama3-8b", "--gpus", "0"], {}, {}, "--gpus"),
    ("plan-nodes-0", ["plan", "--model", "llama3-8b", "--nodes", "0"], {}, {}, "--nodes"),
    ("plan-gpus-1e9", ["plan", "--model", "llama3-8b", "--gpus", "1000000000"], {}, {},
     "--gpus 1,000,000,000 is more than the 1,048,576 GPUs plan searches"),
    ("plan-global-batch-0", ["plan", "--model", "llama3-8b", "--global-batch", "0"], {}, {},
     "--global-batch"),
    ("plan-seq-len-0", ["plan", "--model", "llama3-8b", "--seq-len", "0"], {}, {}, "--seq-len"),
    ("hf-zero-layers", PLAN_HF, hf(num_hidden_layers=0), {}, "num_hidden_layers"),
    ("hf-negative-heads", PLAN_HF, hf(num_attention_heads=-4), {}, "num_attention_heads"),
    ("hf-zero-vocab", PLAN_HF, hf(vocab_size=0), {}, "vocab_size"),
    ("hf-true-layers", PLAN_HF, hf(num_hidden_layers=True), {}, "num_hidden_layers"),
    ("lr-in-train-section", ["train", *CFG], toml("[train]\nlr = 0.1\n"), {}, "belongs in [optim]"),
    ("stray-torchrun-vars", ["train"], {}, {"RANK": "0", "WORLD_SIZE": "2"}, "LOCAL_RANK"),
    # ---- more ---------------------------------------------------------------------------
    ("dp-3-nproc-4", ["train", "--dp", "3", "--nproc", "4"], {}, {}, "parallel.nproc"),
    ("zero-4", ["train", "--zero", "4"], {}, {}, "--zero"),
    ("cp-method-foo", ["train", "--cp-method", "foo"], {}, {}, "--cp-method"),
    ("schedule-x", ["train", "--schedule", "x"], {}, {}, "--schedule"),
    ("precision-fp8", ["train", "--precision", "fp8"], {}, {}, "--precision"),
    ("micro-batch-negative", ["train", "--micro-batch", "-1"], {}, {}, "train.micro_batch"),
    ("bucket-mb-0", ["train", "--bucket-mb", "0"], {}, {}, "parallel.bucket_mb"),
    ("eval-every-negative", ["train", "--eval-every", "-1"], {}, {}, "train.eval_every"),
    ("eval-batches-0", ["train", "--eval-batches", "0"], {}, {}, "train.eval_batches"),
    ("seq-len-0", ["train", "--seq-len", "0"], {}, {}, "data.seq_len"),
    ("global-batch-0", ["train", "--global-batch", "0"], {}, {}, "train.global_batch"),
    ("steps-flag-float", ["train", "--steps", "5.5"], {}, {}, "--steps"),
    ("timeout-inf", ["train", "--timeout-s", "inf"], {}, {}, "parallel.timeout_s"),
    ("seed-negative", ["train", "--seed", "-1"], {}, {}, "train.seed"),
    ("seed-huge", ["train", "--seed", str(2**64)], {}, {}, "train.seed"),
    ("timeout-overflows", ["train", "--timeout-s", "1e15"], {}, {}, "parallel.timeout_s"),
    ("warmup-negative", ["train", "--warmup-steps", "-5"], {}, {}, "optim.warmup_steps"),
    ("beta2-1", ["train", "--beta2", "1"], {}, {}, "optim.beta2"),
    ("min-lr-above-lr", ["train", "--lr", "0.001", "--min-lr", "0.01"], {}, {}, "optim.min_lr"),
    ("unknown-preset", ["train", "--model", "huge"], {}, {}, "--model"),
    ("toml-unknown-section", ["train", *CFG], toml("[training]\nsteps = 5\n"), {}, "[training]"),
    ("toml-unknown-field", ["train", *CFG], toml("[train]\nstpes = 5\n"), {}, "stpes"),
    ("toml-top-level-field", ["train", *CFG], toml("steps = 5\n"), {}, "[train]"),
    ("toml-zero-true", ["train", *CFG], toml("[parallel]\nzero = true\n"), {}, "parallel.zero"),
    ("toml-bool-as-int", ["train", *CFG], toml("[train]\nprogress = 1\n"), {}, "train.progress"),
    ("toml-lr-string", ["train", *CFG], toml('[optim]\nlr = "3e-3"\n'), {}, "optim.lr"),
    ("toml-corpus-int", ["train", *CFG], toml("[data]\ncorpus = 5\n"), {}, "data.corpus"),
    ("toml-preset-unknown", ["train", *CFG], toml('[model]\npreset = "huge"\n'), {}, "model.preset"),
    ("toml-heads-indivisible", ["train", *CFG], toml("[model]\nd_model = 100\nn_heads = 3\n"),
     {}, "n_heads=3"),
    ("config-missing", ["train", "--config", "{tmp}/missing.toml"], {}, {}, "missing.toml"),
    ("config-directory", ["train", "--config", "{tmp}"], {}, {}, "is a directory"),
    ("config-not-utf8", ["train", *CFG], {"run.toml": b"[train]\nsteps = 5 # \xff\xfe\n"}, {},
     "not UTF-8"),
    ("corpus-missing", ["train", "--corpus", "{tmp}/none.txt"], {}, {}, "none.txt"),
    ("vocab-below-data", ["train", *TINY, "--vocab-size", "100"], {}, {}, "model.vocab_size"),
    ("corpus-empty", ["train", *TINY, "--corpus", "{tmp}/c.txt"], {"c.txt": ""}, {}, "data.corpus"),
    ("corpus-too-short", ["train", *TINY, "--corpus", "{tmp}/c.txt"], {"c.txt": "x" * 100}, {},
     "data.corpus"),
    ("no-validation-sample", ["train", *TINY, "--corpus", "{tmp}/c.txt", "--val-fraction", "0.001"],
     {"c.txt": "x" * 4000}, {}, "data.val_fraction"),
    ("torchrun-world-mismatch", ["train", "--dp", "3"], {}, TORCHRUN_ENV, "--nproc-per-node"),
    ("torchrun-nproc-given", ["train", "--nproc", "2"], {}, TORCHRUN_ENV, "--nnodes"),
    ("torchrun-bad-rank", ["train"], {}, {**TORCHRUN_ENV, "RANK": "7"}, "RANK=7"),
    ("plan-top-0", ["plan", "--model", "llama3-8b", "--top", "0"], {}, {}, "--top"),
    ("plan-gpus-per-node-0", ["plan", "--model", "llama3-8b", "--gpus-per-node", "0"], {}, {},
     "--gpus-per-node"),
    ("plan-intra-bw-nan", ["plan", "--model", "llama3-8b", "--intra-bw", "nan"], {}, {},
     "--intra-bw"),
    ("plan-micro-batch-0", ["plan", "--model", "llama3-8b", "--micro-batch", "0"], {}, {},
     "--micro-batch"),
    ("plan-hf-string-width", PLAN_HF, hf(hidden_size="64"), {}, "hidden_size"),
    ("plan-hf-float-heads", PLAN_HF, hf(num_attention_heads=4.5), {}, "num_attention_heads"),
    ("plan-toml-zero-heads", ["plan", "--model", "{tmp}/m.toml"],
     {"m.toml": "[model]\nn_layers = 2\nd_model = 64\nn_heads = 0\n"}, {}, "n_heads"),
    ("plan-out-no-directory", ["plan", "--model", "llama3-8b", "--out", "{tmp}/no/plan.toml"],
     {}, {}, "--out"),
    ("plan-toml-model-not-table", ["plan", "--model", "{tmp}/m.toml"], {"m.toml": "model = 5\n"},
     {}, "[model]"),
    ("microbatches-not-dividing", ["train", *TINY, "--microbatches", "3"], {}, {}, "use one of 1, 2, 4"),
    ("heat2d-field-for-lm", ["train", *TINY, "--grid-size", "32"], {}, {}, "add --task heat2d"),
    ("heat2d-compressed", ["train", "--task", "heat2d", "--compress", "fp16"], {}, {}, "drop --compress"),
    ("heat2d-with-a-model", ["train", "--task", "heat2d", "--model", "tiny"], {}, {}, "drop --model"),
    ("val-fraction-with-data", ["train", *TINY, "--data", "{tmp}", "--val-fraction", "0.3"], {}, {},
     "data.val_fraction"),
    ("order-missing-axes", ["train", *TINY, "--order", "dp-tp"], {}, {}, "order='dp-tp'"),
    ("compress-without-dp", ["train", *TINY, "--compress", "int8"], {}, {}, "dp x cp = 1"),
    ("rope-scaling-form", ["train", *TINY, "--rope-scaling", "foo"], {}, {}, "model.rope_scaling"),
    ("rope-scaling-zero-factor", ["train", *TINY, "--rope-scaling", "llama3:0:1:4:8192"], {}, {},
     "FACTOR > 0"),
    ("heat2d-grid-0", ["train", "--task", "heat2d", "--grid-size", "0"], {}, {}, "grid_size"),
    ("heat2d-width-0", ["train", "--task", "heat2d", "--unet-width", "0"], {}, {}, "unet_width=0"),
    ("heat2d-kernel-even", ["train", "--task", "heat2d", "--unet-kernel", "2"], {}, {}, "odd kernel"),
    ("run-dir-a-file", ["train", *TINY, "--run-dir", "{tmp}/afile"], {"afile": "x"}, {}, "is a file"),
    ("run-dir-of-another-run", ["train", *TINY, "--run-dir", "{tmp}/r"], {"r/metrics.jsonl": "{}\n"},
     {}, "holds another run's metrics.jsonl"),
    ("hf-without-weights", ["train", "--model", "{tmp}/m", "--seq-len", "16", "--nproc", "1"],
     hf(intermediate_size=128), {}, "cannot be read"),
    ("hf-truncated-weights", ["train", "--model", "{tmp}/m", "--seq-len", "16", "--nproc", "1"],
     {**hf(intermediate_size=128), "m/model.safetensors": b"\x40\x00\x00\x00\x00\x00\x00\x00{"},
     {}, "cannot be read"),
    ("hf-without-weights-resume-auto", ["train", "--model", "{tmp}/m", "--seq-len", "16", "--nproc", "1",
                                        "--resume", "auto", "--run-dir", "{tmp}/run"],
     hf(intermediate_size=128), {}, "cannot be read"),
    ("hf-bad-index", ["train", "--model", "{tmp}/m", "--seq-len", "16", "--nproc", "1"],
     {**hf(intermediate_size=128), "m/model.safetensors.index.json": "{}"}, {}, "cannot be read"),
    ("hf-without-ffn-size", ["train", "--model", "{tmp}/m", "--seq-len", "16", "--nproc", "1"], hf(),
     {}, "intermediate_size missing"),
    ("plan-toml-true-layers", ["plan", "--model", "{tmp}/m.toml"],
     {"m.toml": "[model]\nn_layers = true\nd_model = 64\nn_heads = 4\n"}, {}, "n_layers"),
]
if not torch.cuda.is_available():
    CASES.append(("nccl-without-cuda", ["train", "--backend", "nccl"], {}, {}, "parallel.backend"))


def _must_not_start(*args, **kwargs):
    raise AssertionError("a process was started for bad input")


def run_cli(argv: list[str], monkeypatch, capsys) -> tuple[int, str]:
    """The CLI in-process, with every way of starting or joining a world disabled."""
    monkeypatch.setattr(launch, "spawn", _must_not_start)
    monkeypatch.setattr(launch, "init_world", _must_not_start)
    monkeypatch.setattr(worker, "run_worker", _must_not_start)
    monkeypatch.setattr(torch.multiprocessing, "start_processes", _must_not_start)
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.mark.parametrize("argv, files, env, words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_exits_2_naming_the_field(argv, files, env, words, tmp_path, monkeypatch, capsys):
    for name, content in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    for key in TORCHRUN_VARS:
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    code, output = run_cli([a.replace("{tmp}", str(tmp_path)) for a in argv], monkeypatch, capsys)
    assert code == 2, output
    assert words in output, output
    assert "Traceback" not in output
    if env == TORCHRUN_ENV:
        assert "set --nproc" not in output  # torchrun does not take --nproc


def test_messages_say_where_the_field_is_set(monkeypatch, capsys):
    code, output = run_cli(["train", "--lr", "nan"], monkeypatch, capsys)
    assert code == 2
    assert "optim.lr: expected a finite number, got nan (TOML [optim] lr / --lr)" in output


def test_torchrun_detection_is_explicit():
    assert started_by_torchrun({}) is False
    assert started_by_torchrun({"MASTER_ADDR": "node0", "MASTER_PORT": "1"}) is False
    assert started_by_torchrun(TORCHRUN_ENV) is True


@pytest.mark.parametrize("argv, words", [
    (["train", "--timeout-s", "-1"], "parallel.timeout_s"),
    (["plan", "--model", "llama3-8b", "--gpus", "0"], "--gpus"),
])
def test_exit_code_2_end_to_end(argv, words):
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    env["PYTHONPATH"] = str(Path(__file__).parents[1] / "src")
    done = subprocess.run([sys.executable, "-m", "paratrain", *argv], capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode == 2, done.stderr
    assert words in done.stderr and "Traceback" not in done.stderr + done.stdout


def test_no_validation_set_means_no_validation_loss(tmp_path):
    """--val-fraction 0: nothing is evaluated, printed or written as a validation loss."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    env["PYTHONPATH"] = str(Path(__file__).parents[1] / "src")
    done = subprocess.run([sys.executable, "-m", "paratrain", "train", *TINY, "--steps", "2",
                           "--warmup-steps", "1", "--val-fraction", "0", "--eval-every", "1",
                           "--no-progress", "--run-dir", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=180)
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 and not any("val_loss" in r for r in records)
    assert "val loss" not in done.stdout and "warning" not in done.stderr


def test_heat2d_on_one_rank_with_zero_padding_may_be_thinner_than_the_kernel():
    """Zero padding pads any size; only a circular pad (or a halo between ranks) needs the
    deepest level at least as thick as the kernel's reach."""
    from paratrain.train.config import load

    load(None, dict(task="heat2d", boundary="zeros", grid_size=8, unet_levels=3, unet_kernel=5,
                    heat_samples=64, global_batch=8)).validate()
