"""``paratrain plan`` as a new user meets it: --out / --plot with --layout, train configs
as --model, flags that contradict each other, and the numbers the docs and the written
config quote."""

import dataclasses
import importlib
import json
import re
from pathlib import Path

import pytest

from paratrain.plan import cli
from paratrain.plan.hardware import Calibration
from paratrain.plan.evaluate import parse_layout
from paratrain.plan.models import _IGNORED_GPT_FIELDS, ModelSpec, from_gpt_config, load_model
from test_plan_cli import plan

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
TINY8 = ("--model", "tiny", "--gpus", "8", "--global-batch", "16", "--seq-len", "64")


def _no_search(monkeypatch):
    """Make the search fail loudly: a refusal must come before any work."""
    def search(*args, **kwargs):
        raise AssertionError("the search ran before the flags were refused")
    # paratrain.plan re-exports the function under the module's name: patch the module.
    monkeypatch.setattr(importlib.import_module("paratrain.plan.search"), "search", search)


# ---- --out / --plot with --layout and --compare ---------------------------------------------

def test_layout_out_writes_that_layout(tmp_path, capsys):
    path = tmp_path / "lay.toml"
    assert plan(*TINY8, "--layout", "dp2 tp2 pp2 zero1 mb1", "--out", str(path)) == 0
    config = tomllib.loads(path.read_text())
    par = config["parallel"]
    assert (par["dp"], par["tp"], par["pp"], par["zero"]) == (2, 2, 2, 1)
    assert config["train"]["micro_batch"] == 1
    assert f"wrote {path}" in capsys.readouterr().out
    from paratrain.train.config import load

    load(str(path)).validate()  # `paratrain train --config` runs it


def test_layout_out_refuses_a_rejected_or_untrainable_layout(tmp_path, capsys):
    path = tmp_path / "lay.toml"
    # 405B on one node does not fit: nothing is written, and the error says why.
    assert plan("--model", "llama3-405b", "--gpus", "8", "--layout", "tp8",
                "--out", str(path)) == 2
    err = capsys.readouterr().err
    assert "--out:" in err and "does not fit" in err and "not written" in err
    assert not path.exists()
    # SGD is planner-only: the layout fits, but train would not run it as written.
    assert plan(*TINY8, "--optimizer", "sgd", "--layout", "dp8", "--out", str(path)) == 2
    assert "AdamW" in capsys.readouterr().err and not path.exists()


def test_layout_and_compare_plot_the_given_layouts(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "lay.png"
    assert plan(*TINY8, "--layout", "dp8", "--plot", str(path)) == 0
    assert path.read_bytes()[:4] == b"\x89PNG"
    path.unlink()
    assert plan(*TINY8, "--compare", "dp8", "tp2 pp4", "--plot", str(path)) == 0
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_compare_with_out_and_layout_with_compare_are_refused_first(tmp_path, capsys,
                                                                    monkeypatch):
    _no_search(monkeypatch)
    path = tmp_path / "lay.toml"
    assert plan(*TINY8, "--compare", "dp8", "tp2", "--out", str(path)) == 2
    assert "--out writes one layout" in capsys.readouterr().err and not path.exists()
    assert plan(*TINY8, "--layout", "dp8", "--compare", "tp2") == 2
    assert "--layout and --compare both given" in capsys.readouterr().err


# ---- contradictory flags -------------------------------------------------------------------

@pytest.mark.parametrize("flags, named", [
    (("--gpu", "h100-80g", "--intra-bw", "5"), "--gpu, --intra-bw: describe a GPU cluster"),
    (("--nodes", "2"), "--nodes: describes a GPU cluster"),
    (("--gpus-per-node", "4"), "--gpus-per-node: describes a GPU cluster"),
])
def test_gpu_flags_with_a_local_cluster_are_refused(flags, named, capsys, monkeypatch):
    _no_search(monkeypatch)
    monkeypatch.setattr(cli, "_calibrate", lambda *a: pytest.fail("calibrated first"))
    assert plan("--model", "tiny", "--cluster", "local", "--calibrate", *flags) == 2
    assert named in capsys.readouterr().err


def test_calibration_file_with_a_gpu_cluster_is_refused(tmp_path, capsys, monkeypatch):
    _no_search(monkeypatch)
    assert plan("--model", "tiny", "--calibration", str(tmp_path / "c.json")) == 2
    assert "--calibration is read by --cluster local only" in capsys.readouterr().err


@pytest.mark.parametrize("text, word", [("tp2 tp4", "tp given twice (tp2, then tp4)"),
                                        ("z1 reshard=yes", "ZeRO stage given twice"),
                                        ("interleaved/v2 v4", "v given twice"),
                                        ("cp2/ulysses ring", "given twice")])
def test_a_layout_choice_given_twice_is_refused(text, word):
    with pytest.raises(ValueError, match=re.escape(word)):
        parse_layout(text)


def test_a_choice_repeated_with_the_same_value_is_kept():
    assert parse_layout("z3 reshard=no").reshard_after_forward is False
    assert parse_layout("hsdp8 z3").shard_group == 8


def test_layout_given_twice_exits_2_naming_the_axis(capsys):
    assert plan(*TINY8, "--layout", "tp2 tp4") == 2
    assert "tp given twice" in capsys.readouterr().err


def test_an_empty_or_unreadable_compare_spec_names_the_flag_given(capsys, monkeypatch):
    """--layout "" printed the whole ranking as if no layout were asked for; a typo in a
    --compare spec was reported as --layout's."""
    assert plan(*TINY8, "--compare", "dp8", "dpp4") == 2
    assert capsys.readouterr().err.startswith("paratrain plan: error: --compare: cannot read 'dpp4'")
    _no_search(monkeypatch)
    for flag, specs in (("--layout", [""]), ("--compare", ["dp8", "  "])):
        assert plan(*TINY8, flag, *specs) == 2
        assert f"{flag}: an empty layout" in capsys.readouterr().err


# ---- train configs as --model ---------------------------------------------------------------

def _as_train_reads_it(path: Path) -> ModelSpec:
    from paratrain.train.config import load

    return dataclasses.replace(from_gpt_config(load(str(path)).model, ""), name=path.name)


@pytest.mark.parametrize("text", [
    # The README's config: a preset and an override.
    '[model]\npreset = "small"\nn_layers = 8\n\n[parallel]\ndp = 4\n\n[train]\n'
    'global_batch = 32\nmicro_batch = 4\n',
    # No preset: train starts from "small" all the same.
    "[model]\nd_model = 96\nn_heads = 4\n",
    # qkv_bias adds parameters: counted.
    '[model]\npreset = "tiny"\nqkv_bias = true\nrope_scaling = "llama3:8:1:4:64"\n',
])
def test_train_config_model_table_plans_what_train_builds(tmp_path, text):
    path = tmp_path / "run.toml"
    path.write_text(text)
    assert load_model(str(path)) == _as_train_reads_it(path)


def test_config_toml_of_a_run_is_a_model(tmp_path, capsys):
    from paratrain.train.config import load
    from paratrain.train.runs import record

    cfg = load(None, {"preset": "tiny", "seq_len": 32, "run_dir": str(tmp_path / "run"),
                      "qkv_bias": True, "sliding_window": 64}).validate()
    record(cfg)  # what `paratrain train` writes into RUN_DIR
    path = tmp_path / "run" / "config.toml"
    spec = load_model(str(path))
    assert spec.num_params() == cfg.model.num_params() and spec.qkv_bias
    assert plan("--model", str(path), "--gpus", "2", "--global-batch", "8") == 0


@pytest.fixture
def local(tmp_path) -> tuple[str, ...]:
    """``--cluster local`` with a calibration of its own: a clean machine has none."""
    cal = tmp_path / "cal.json"
    cal.write_text(Calibration({"fp32": 40e9}, cores=2, alpha=30e-6, beta=0.8e9,
                               memory=4 * 2**30).to_json())
    return ("--cluster", "local", "--calibration", str(cal))


def test_out_trains_the_model_of_the_train_config_it_read(tmp_path, capsys, local):
    """Settings the planner does not model (rope_theta, ...) still reach the written config:
    `train --config` on it builds the model the user planned."""
    from paratrain.train.config import load

    cfg = load(None, {"preset": "tiny", "seq_len": 32, "rope_theta": 500000.0, "norm_eps": 1e-6,
                      "rope_scaling": "llama3:8:1:4:64"}).validate()
    model = tmp_path / "m.toml"
    model.write_text("[model]\npreset = \"tiny\"\nrope_theta = 500000.0\nnorm_eps = 1e-6\n"
                     "rope_scaling = \"llama3:8:1:4:64\"\n")
    out = tmp_path / "plan.toml"
    assert plan("--model", str(model), *local, "--gpus", "2", "--global-batch", "8",
                "--seq-len", "32", "--out", str(out)) == 0
    assert load(str(out)).validate().model == cfg.model


def test_every_gpt_config_field_is_modelled_or_ignored():
    """A new ``GPTConfig`` field must be classified, or train's configs stop planning."""
    gpt = pytest.importorskip("paratrain.models.gpt")
    modelled = {f.name for f in dataclasses.fields(ModelSpec)}
    unclassified = {f.name for f in dataclasses.fields(gpt.GPTConfig)} - modelled - set(
        _IGNORED_GPT_FIELDS)
    assert not unclassified


def test_qkv_bias_params_as_paratrain_builds_them():
    gpt = pytest.importorskip("paratrain.models.gpt")
    from paratrain.plan.runtime import unit_params

    cfg = gpt.preset("tiny", qkv_bias=True)
    spec = from_gpt_config(cfg, "tiny")
    assert spec.num_params() == cfg.num_params() == sum(unit_params(spec))
    assert spec.gpt_fields()["qkv_bias"] is True  # --out keeps it


# ---- the numbers the written config and the docs quote --------------------------------------

def test_out_header_states_the_number_train_checks(tmp_path, capsys):
    from paratrain.train.config import load
    from paratrain.train.preflight import predicted_memory

    path = tmp_path / "plan.toml"
    assert plan("--model", "llama3-8b", "--gpus", "8", "--out", str(path)) == 0
    header = path.read_text().split("\n[")[0]
    train_predicts = predicted_memory(load(str(path)).validate()).total / 2**30
    assert f"{train_predicts:.2f} GiB as paratrain's eager runtime holds it" in header
    assert "GiB per rank as ranked" in header and "`paratrain train` predicts and checks" in header


def test_docs_rejected_layout_example_is_what_plan_prints(capsys):
    doc = (ROOT / "docs" / "plan.md").read_text()
    example = re.search(r"\(Llama 3 405B as `([^`]+)` with\s+`--global-batch (\d+)` on 8192 "
                        r"H100s: \"([^\"]+)\"\)", doc)
    assert example, "docs/plan.md lost its rejected-layout example"
    layout, batch, quoted = example.groups()
    assert plan("--model", "llama3-405b", "--gpus", "8192", "--global-batch", batch,
                "--layout", layout) == 1
    assert quoted in capsys.readouterr().out


def test_out_of_a_hugging_face_model_fine_tunes_it(tmp_path, capsys, local):
    """Planned from a Hugging Face directory (or a run's config.toml naming one), --out
    names the directory as the preset: train loads its weights, not a fresh model of that
    shape."""
    from paratrain.models import hf
    from paratrain.models.gpt import GPT, PRESETS
    from paratrain.train.config import load

    cfg = PRESETS["tiny"]
    source = hf.export(GPT(cfg).state_dict(), cfg, tmp_path / "hf")
    for model in (str(source), str(source / "config.json")):
        out = tmp_path / "plan.toml"
        assert plan("--model", model, *local, "--gpus", "2", "--global-batch", "8",
                    "--seq-len", "32", "--out", str(out)) == 0
        written = load(str(out)).validate()
        assert written.model_preset == str(source) and written.model == hf.read_config(source)
        out.unlink()


def test_out_of_a_config_json_without_weights_trains_its_shape(tmp_path, capsys):
    """examples/llama3-8b/config.json (no weights beside it): --out named its directory as
    the preset and said "run it with paratrain train", which then refused it, finding no
    model.safetensors. It writes the shape now, as for --model llama3-8b."""
    from paratrain.plan.models import PRESETS
    from paratrain.train.config import load

    example = Path(__file__).resolve().parents[1] / "examples" / "llama3-8b" / "config.json"
    out = tmp_path / "plan.toml"
    assert plan("--model", str(example), "--gpus", "64", "--out", str(out)) == 0
    written = load(str(out)).validate()
    spec = PRESETS["llama3-8b"]
    assert written.model_preset != str(example.parent)
    assert (written.model.d_model, written.model.n_layers, written.model.vocab_size,
            written.model.n_kv_heads) == (spec.d_model, spec.n_layers, spec.vocab_size, spec.n_kv_heads)
    assert (written.model.rope_theta, written.model.norm_eps) == (500000.0, 1e-5)


def test_bad_files_and_paths_are_one_line_errors(tmp_path, capsys, monkeypatch):
    """Each was a traceback (TypeError, IsADirectoryError, matplotlib's ValueError) or
    silently another thing (--plot chart wrote chart.png)."""
    monkeypatch.chdir(tmp_path)
    cal = tmp_path / "cal.json"
    good = {"matmul_flops": {"fp32": 5e10}, "cores": 2, "alpha": 2e-5, "beta": 8e8, "memory": 8 << 30}
    for content, words in (("3", "not a calibration"), ("{", "not valid JSON"),
                           (json.dumps({**good, "memory": -5}), "memory must be a positive number"),
                           (json.dumps({**good, "cores": 0}), "cores must be a positive number")):
        cal.write_text(content)
        assert plan("--model", "tiny", "--cluster", "local", "--calibration", str(cal)) == 2
        assert words in capsys.readouterr().err, words
    (tmp_path / "m.toml").write_text("[model]\ncarried = 5\n")
    assert plan("--model", str(tmp_path / "m.toml")) == 2
    err = capsys.readouterr().err
    assert "unknown model fields ['carried']" in err and "'preset'" not in err
    for flags, words in ((("--out", str(tmp_path)), "a directory; give a file name"),
                         (("--plot", "chart.xyz"), "name a .png, .svg, .pdf file"),
                         (("--plot", "chart"), "name a .png, .svg, .pdf file")):
        assert plan(*TINY8, *flags) == 2
        assert words in capsys.readouterr().err, flags


def test_the_default_sequence_is_at_most_8k_and_nothing_fits_names_it(tmp_path, capsys):
    """A 1M-token context (Mistral-Nemo-like) made the default --seq-len 1,024,000, and
    "nothing fits" then blamed the devices only."""
    config = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
              "vocab_size": 128256, "max_position_embeddings": 1_024_000}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert plan("--model", str(tmp_path / "config.json"), "--gpus", "8", "--json") == 0
    assert json.loads(capsys.readouterr().out)["training"]["seq_len"] == 8192
    assert plan("--model", "llama3-405b", "--gpu", "a100-40g", "--gpus", "8") == 1
    assert "or a shorter --seq-len (now 8,192)" in capsys.readouterr().err
