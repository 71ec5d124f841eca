"""Config files, flags and validation: pure, nothing is spawned."""

import dataclasses

import pytest

from paratrain.cli import build_parser, main
from paratrain.models.gpt import GPTConfig
from paratrain.train.config import SECTIONS, ConfigError, load


def test_defaults_are_the_demo():
    cfg = load().validate()
    assert cfg.parallel.nproc == 2 and cfg.parallel.dp == 2 and cfg.model_preset == "small"
    assert cfg.micro_batch == 8 and cfg.accumulation == 1


def test_file_then_flags(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[model]\npreset = "tiny"\nd_model = 32\n[parallel]\ndp = 4\n'
                    '[data]\nseq_len = 32\n[train]\nglobal_batch = 8\nmicro_batch = 1\n[optim]\nlr = 0.01\n')
    cfg = load(str(path), {"lr": 0.02}).validate()
    assert cfg.model.d_model == 32 and cfg.model.n_layers == 2
    assert cfg.parallel.nproc == 4 and cfg.optim.lr == 0.02 and cfg.accumulation == 2


def test_every_field_is_a_flag():
    parser = build_parser()
    train = parser._subparsers._group_actions[0].choices["train"]
    flags = {opt for action in train._actions for opt in action.option_strings}
    for cls in (GPTConfig, *SECTIONS.values()):
        for f in dataclasses.fields(cls):
            assert "--" + f.name.replace("_", "-") in flags, f.name


@pytest.mark.parametrize("overrides, words", [
    ({"pp": 2, "dp": 1, "virtual_stages": 3}, "needs --schedule interleaved"),
    ({"pp": 2, "dp": 1, "virtual_stages": 3, "schedule": "interleaved", "preset": "tiny"}, "cannot be split into pp=2 x virtual_stages=3"),
    ({"pp": 5, "dp": 1, "preset": "tiny", "seq_len": 32}, "2 layers cannot be split"),
    ({"pp": 2, "dp": 1, "zero": 2, "tie_embeddings": True}, "set tie_embeddings = false"),
    ({"pp": 2, "tie_embeddings": True, "zero": 3}, "tied embeddings under a pipeline with ZeRO-3"),
    ({"sp": True}, "needs --tp > 1"),
    ({"tp": 2, "sp": True, "seq_len": 31, "dp": 1}, "divisible by 2"),
    ({"tp": 4, "dp": 1, "nproc": 4}, "divide the 6 attention heads"),
    ({"tp": 3, "dp": 1, "nproc": 3}, "2 KV heads must divide"),
    ({"dp": 3, "nproc": 4}, "nproc=4 but dp"),
    ({"global_batch": 10, "dp": 4}, "not divisible by dp=4"),
    ({"micro_batch": 3}, "not a multiple of micro_batch=3"),
    ({"seq_len": 1024}, "exceeds the model's max_seq_len"),
    ({"precision": "fp8"}, "train.precision: must be one of 'fp32', 'bf16'"),
    ({"corpus": "/nonexistent.txt"}, "does not exist"),
])
def test_bad_configs_are_rejected_before_launch(overrides, words):
    with pytest.raises(ConfigError, match=words):
        load(None, overrides).validate()


def test_bad_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load(str(tmp_path / "missing.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load(str(bad))
    bad.write_text("[train]\nsteps_typo = 3\n")
    with pytest.raises(ConfigError, match="known fields"):
        load(str(bad))
    hf = tmp_path / "llama" / "config.json"  # a Hugging Face config given to --config
    hf.parent.mkdir()
    hf.write_text('{"model_type": "llama", "hidden_size": 64}')
    with pytest.raises(ConfigError, match=rf"is JSON, not a paratrain TOML file.*--model {tmp_path / 'llama'}$"):
        load(str(hf))


def test_cli_reports_config_errors_without_spawning(capsys):
    assert main(["train", "--tp", "4", "--nproc", "4", "--dp", "1"]) == 2
    assert "tp=4 must divide the 6 attention heads" in capsys.readouterr().err


def test_validate_returns_a_resolved_copy():
    cfg = load(None, {"tp": 2})
    resolved = cfg.validate()
    assert (cfg.parallel.dp, cfg.parallel.nproc) == (0, 0)  # left as it was
    assert (resolved.parallel.dp, resolved.parallel.nproc) == (2, 4)
    assert resolved.validate() == resolved


def test_every_field_is_type_checked():
    """Types come from the annotations: a field added to any section is checked with no
    further code (a list is no valid value of any config field)."""
    from paratrain.train import schema

    for section, cls in {"model": GPTConfig, **SECTIONS}.items():
        for f in dataclasses.fields(cls):
            _, problems = schema.check(cls, {f.name: [1]}, section)
            assert problems and problems[0].startswith(f"{section}.{f.name}: "), f.name
            _, problems = schema.check(cls, {f.name: getattr(cls(), f.name)}, section)
            assert not problems, problems  # every default is valid


@pytest.mark.parametrize("value, ok", [(5, True), (5.5, False), ("5", False), (True, False), (-1, False)])
def test_integer_fields_take_integers_only(value, ok):
    from paratrain.train import schema

    resolved, problems = schema.check(SECTIONS["train"], {"steps": value}, "train")
    assert (not problems) == ok and (not ok or resolved["steps"] == 5)


def test_float_fields_take_ints_and_finite_floats():
    from paratrain.train import schema

    resolved, problems = schema.check(SECTIONS["optim"], {"lr": 1, "eps": 1e-6}, "optim")
    assert not problems and type(resolved["lr"]) is float
    for bad in (float("nan"), float("inf"), "1e-3", False):
        assert schema.check(SECTIONS["optim"], {"lr": bad}, "optim")[1]


def test_help_shows_the_default_presets_values(capsys):
    from paratrain.models.gpt import PRESETS

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    small = PRESETS["small"]
    assert f"Width of the residual stream. (default: {small.d_model};" in text
    assert f"Transformer blocks. (default: {small.n_layers};" in text
    assert "--zero {0,1,2,3}" in text and "(default: 0.003; above 0)" in text


def test_warns_when_the_learning_rate_never_decays():
    from paratrain.train.preflight import advice

    assert any("never decays" in note for note in advice(load(None, {"steps": 20, "warmup_steps": 20})))
    assert advice(load(None, {"steps": 21, "warmup_steps": 20})) == []


def test_plan_out_keeps_the_preset_name(tmp_path):
    from paratrain.plan.candidate import Training
    from paratrain.plan.export import config_tables, to_toml
    from paratrain.plan.hardware import Cluster, gpu_preset
    from paratrain.plan.models import load_model
    from paratrain.plan.search import search

    model, training = load_model("tiny"), Training(global_batch=16, seq_len=64)
    plan = search(model, training, Cluster(gpu_preset("h100-80g"), n_gpus=2)).plans[0]
    path = tmp_path / "plan.toml"
    path.write_text(to_toml(config_tables(plan, model, training)))
    assert load(str(path)).validate().model_preset == "tiny"


def test_a_resized_preset_is_not_named_as_the_preset():
    """The header said "model small (836.83M params)" for a model the flags resized."""
    resized = load(None, {"d_model": 2048, "n_heads": 16, "vocab_size": 32000}).validate()
    assert resized.describe_model() == "small with vocab_size=32000, d_model=2048, n_heads=16"
    assert load(None, {}).validate().describe_model() == "small"
