"""``paratrain plan`` end to end, through its argparse registration (in-process)."""

import argparse
import json
import subprocess
import sys

import pytest

from paratrain.plan import cli
from paratrain.plan.hardware import Calibration
from paratrain.plan.models import load_model

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


def plan(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="paratrain")
    cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["plan", *argv])
    return args.func(args)


def test_table_explain_and_rejected(capsys):
    assert plan("--model", "llama3-8b", "--gpus", "16", "--explain", "--show-rejected") == 0
    out = capsys.readouterr().out
    for text in ("tokens/s", "memory per rank", "time per step", "winner:", "runner-up",
                 "best with tp=", "rejected candidates, by reason"):
        assert text in out


def test_json_output_parses(capsys):
    assert plan("--model", "llama3-70b", "--gpu", "h100-80g", "--gpus", "64", "--json",
                "--top", "3", "--explain") == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["plans"]) == 3
    best = data["plans"][0]
    assert best["layout"]["dp"] * best["layout"]["tp"] * best["layout"]["pp"] * \
        best["layout"]["cp"] == 64
    assert best["time_s"]["step"] == pytest.approx(sum(
        v for k, v in best["time_s"].items() if k != "step"))
    assert best["memory_bytes"]["total"] <= data["cluster"]["memory_limit"]
    assert data["search"]["ranked"] > 0 and data["explain"].startswith("winner")


def test_out_writes_a_train_config(tmp_path, capsys):
    path = tmp_path / "plan.toml"
    assert plan("--model", "llama3-8b", "--gpus", "8", "--global-batch", "32",
                "--seq-len", "4096", "--out", str(path)) == 0
    config = tomllib.loads(path.read_text())
    assert set(config["model"]) == {"preset", "vocab_size", "d_model", "n_layers", "n_heads",
                                    "n_kv_heads", "ffn_hidden", "max_seq_len", "tie_embeddings"}
    assert config["model"]["preset"] == "llama3-8b"  # train builds the same preset (rope_theta too)
    par, train = config["parallel"], config["train"]
    assert set(par) - {"reshard_after_forward"} == {  # that one where ZeRO-3 departs from auto
        "dp", "tp", "pp", "cp", "zero", "sp", "cp_method", "schedule", "microbatches",
        "virtual_stages"}
    assert par["dp"] * par["tp"] * par["pp"] * par["cp"] == 8
    assert par["schedule"] in ("gpipe", "1f1b", "interleaved", "zbh1", "zbv", "dualpipev")
    assert train["global_batch"] == 32 and config["data"]["seq_len"] == 4096
    assert train["precision"] == "bf16" and train["recompute"] in ("none", "selective", "full")
    assert par["dp"] * train["micro_batch"] * par["microbatches"] == 32
    assert load_model(str(path)).num_params() == load_model("llama3-8b").num_params()
    from paratrain.train.config import load

    cfg = load(str(path))  # `paratrain train --config` reads it: every field is known
    assert cfg.parallel.dp == par["dp"] and cfg.train.recompute == train["recompute"]


def test_bad_inputs_exit_2(capsys, tmp_path):
    assert plan("--model", "gpt-5") == 2
    assert "unknown model 'gpt-5'" in capsys.readouterr().err
    assert plan("--model", "llama3-8b", "--gpus", "16", "--nodes", "3") == 2
    assert plan("--model", "llama3-8b", "--micro-batch", "big") == 2
    assert plan("--model", "llama3-8b", "--cluster", "local",
                "--calibration", str(tmp_path / "none.json")) == 2
    assert "--calibrate" in capsys.readouterr().err


def test_nothing_fits_exits_1(capsys):
    assert plan("--model", "llama3-405b", "--gpu", "a100-40g", "--gpus", "8") == 1
    assert "model states exceed memory" in capsys.readouterr().out


def test_local_cluster_from_calibration(tmp_path, capsys):
    cal = tmp_path / "cal.json"
    cal.write_text(Calibration({"fp32": 40e9}, cores=2, alpha=30e-6, beta=0.8e9,
                               memory=4 * 2**30).to_json())
    model = tmp_path / "tiny.toml"
    model.write_text("d_model = 64\nn_layers = 2\nn_heads = 4\nn_kv_heads = 2\n"
                     "ffn_hidden = 128\nmax_seq_len = 64\n")
    assert plan("--model", str(model), "--cluster", "local", "--calibration", str(cal),
                "--gpus", "4", "--json") == 0
    data = json.loads(capsys.readouterr().out)
    assert data["training"]["precision"] == "fp32" and data["cluster"]["kind"] == "local"
    assert data["plans"][0]["time_s"]["optimizer"] == 0  # no memory bandwidth measured


def test_plot(tmp_path, capsys, monkeypatch):
    path = tmp_path / "plan.png"
    args = ("--model", "llama3-8b", "--gpus", "8", "--plot", str(path))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert plan(*args) == 2
    else:
        assert plan(*args) == 0 and path.read_bytes()[:4] == b"\x89PNG"
        monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
        assert plan(*args) == 2
    assert "pip install matplotlib" in capsys.readouterr().err


def test_plan_does_not_import_torch():
    code = ("import sys, paratrain.plan.cli, paratrain.plan.search, paratrain.plan.export;"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_every_ranked_plan_writes_a_config_train_accepts(tmp_path):
    """The planner and the trainer agree on what is valid: each plan of a search over all
    layouts (tp, pp, cp, zero, interleaving, recompute) validates as a training config."""
    from paratrain.plan.candidate import Training
    from paratrain.plan.export import config_tables, to_toml
    from paratrain.plan.hardware import Cluster, gpu_preset
    from paratrain.plan.search import search
    from paratrain.train.config import load

    model = load_model("tiny")
    training = Training(global_batch=16, seq_len=64)
    result = search(model, training, Cluster(gpu_preset("h100-80g"), n_gpus=8))
    assert len(result.plans) > 10
    seen = set()
    for i, plan in enumerate(result.plans):
        path = tmp_path / f"plan{i}.toml"
        path.write_text(to_toml(config_tables(plan, model, training)))
        cfg = load(str(path)).validate()  # raises ConfigError naming the problem
        seen.add((cfg.parallel.tp > 1, cfg.parallel.pp > 1, cfg.parallel.cp > 1))
    assert len(seen) > 2  # the search really offered different strategies


def test_nothing_fits_suggests_the_nearest_global_batches(capsys):
    # Microbatches of 4 cannot divide 6 sequences over any data-parallel size.
    assert plan("--model", "llama3-8b", "--gpus", "8", "--global-batch", "6",
                "--micro-batch", "4") == 1
    assert "nearest that do: 4, 8, 16 (--global-batch N)" in capsys.readouterr().err
    assert plan("--model", "llama3-405b", "--gpus", "8", "--global-batch", "6") == 1
    assert "no global batch near 6 fits either" in capsys.readouterr().err
    # A million GPUs for 512 sequences: no memory problem, only shapes that cannot split.
    assert plan("--model", "llama3-8b", "--gpus", "1000000") == 1
    err = capsys.readouterr().err
    assert "none is memory): use fewer --gpus" in err and "larger devices" not in err


def test_24_gpus_with_the_default_batch_plan(capsys):
    """The issue's case: 3 stages of 32 layers (uneven) make 24 GPUs plannable."""
    assert plan("--model", "llama3-8b", "--gpus", "24", "--json", "--top", "1") == 0
    best = json.loads(capsys.readouterr().out)["plans"][0]["layout"]
    assert best["dp"] * best["tp"] * best["pp"] * best["cp"] == 24
