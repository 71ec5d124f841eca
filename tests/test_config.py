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
    ({"pp": 2, "dp": 1, "zero": 2}, "use zero 1 with pp > 1"),
    ({"pp": 2, "dp": 1, "virtual_stages": 3}, "needs --schedule interleaved"),
    ({"pp": 2, "dp": 1, "virtual_stages": 2, "schedule": "interleaved", "preset": "tiny"}, "cannot be split into pp=2 x virtual_stages=2"),
    ({"pp": 3, "dp": 1, "preset": "tiny", "seq_len": 32}, "2 layers cannot be split"),
    ({"pp": 2, "dp": 1, "tie_embeddings": True}, "set tie_embeddings = false"),
    ({"zero": 1, "tie_embeddings": True}, "cannot shard tied embeddings"),
    ({"sp": True}, "needs --tp > 1"),
    ({"tp": 2, "sp": True, "seq_len": 31, "dp": 1}, "divisible by 2"),
    ({"tp": 4, "dp": 1, "nproc": 4}, "divide the 6 attention heads"),
    ({"tp": 3, "dp": 1, "nproc": 3}, "2 KV heads must divide"),
    ({"dp": 3, "nproc": 4}, "nproc=4 but dp"),
    ({"global_batch": 10, "dp": 4}, "not divisible by dp=4"),
    ({"micro_batch": 3}, "not a multiple of micro_batch=3"),
    ({"seq_len": 1024}, "exceeds the model's max_seq_len"),
    ({"precision": "fp8"}, "not one of fp32, bf16"),
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


def test_cli_reports_config_errors_without_spawning(capsys):
    assert main(["train", "--tp", "4", "--nproc", "4", "--dp", "1"]) == 2
    assert "tp=4 must divide the 6 attention heads" in capsys.readouterr().err
