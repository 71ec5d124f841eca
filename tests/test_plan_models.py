"""Planner model shapes: presets, Hugging Face config.json, TOML (pure, no torch needed)."""

import json

import pytest

from paratrain.plan.models import PRESETS, from_gpt_config, load_model


@pytest.mark.parametrize("name,billions", [("llama3-8b", 8.03), ("llama3-70b", 70.55),
                                           ("llama3-405b", 405.85), ("gpt3-175b", 174.6),
                                           ("bloom-176b", 176.25)])
def test_preset_parameter_counts(name, billions):
    assert PRESETS[name].num_params() / 1e9 == pytest.approx(billions, abs=0.01)


def test_paratrain_presets_match_gpt_config():
    gpt = pytest.importorskip("paratrain.models.gpt")
    for name, cfg in gpt.PRESETS.items():
        spec = load_model(name)
        assert spec.num_params() == cfg.num_params()
        assert from_gpt_config(cfg, name) == spec


LLAMA3_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 8192,
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "vocab_size": 128256,
}
GPT2_CONFIG = {"model_type": "gpt2", "activation_function": "gelu_new", "n_ctx": 1024,
               "n_embd": 768, "n_head": 12, "n_inner": None, "n_layer": 12,
               "n_positions": 1024, "resid_pdrop": 0.1, "vocab_size": 50257}
NEOX_CONFIG = {"model_type": "gpt_neox", "hidden_act": "gelu", "hidden_size": 512,
               "intermediate_size": 2048, "max_position_embeddings": 2048,
               "num_attention_heads": 8, "num_hidden_layers": 6, "vocab_size": 50304,
               "tie_word_embeddings": False}


def _write(tmp_path, name, data):
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(data))
    return path


def test_hf_llama_config_equals_the_preset(tmp_path):
    spec = load_model(str(_write(tmp_path, "llama", LLAMA3_8B_CONFIG) / "config.json"))
    assert spec.num_params() == PRESETS["llama3-8b"].num_params()
    assert spec.gated_mlp and spec.n_kv_heads == 8 and spec.max_seq_len == 8192


def test_hf_gpt2_config_counts_gpt2_small(tmp_path):
    spec = load_model(str(_write(tmp_path, "gpt2", GPT2_CONFIG)))  # a directory works too
    assert spec.num_params() == 124_439_808  # GPT-2 small as Hugging Face counts it
    assert spec.tie_embeddings and spec.learned_pos and spec.dropout and not spec.gated_mlp
    assert spec.ffn_hidden == 4 * 768


def test_hf_neox_config(tmp_path):
    spec = load_model(str(_write(tmp_path, "neox", NEOX_CONFIG)))
    assert spec.norm == "layernorm" and spec.bias and not spec.tie_embeddings
    assert spec.n_kv_heads == 8 and spec.ffn_hidden == 2048


def test_hf_config_missing_field(tmp_path):
    path = _write(tmp_path, "bad", {"hidden_size": 64, "vocab_size": 10})
    with pytest.raises(ValueError, match="num_hidden_layers"):
        load_model(str(path))


def test_toml_model_config(tmp_path):
    path = tmp_path / "model.toml"
    path.write_text("[model]\nd_model = 64\nn_layers = 2\nn_heads = 4\nn_kv_heads = 2\n"
                    "ffn_hidden = 128\nmax_seq_len = 64\nrope_theta = 10000.0\n"
                    "[train]\nseq_len = 64\n")
    spec = load_model(str(path))
    assert (spec.d_model, spec.n_layers, spec.n_kv_heads, spec.vocab_size) == (64, 2, 2, 256)
    assert spec.num_params() == 106_816  # paratrain's tiny GPT


def test_toml_defaults_follow_gpt_config(tmp_path):
    path = tmp_path / "m.toml"
    path.write_text("d_model = 192\nn_layers = 6\nn_heads = 6\n")
    spec = load_model(str(path))
    assert spec.n_kv_heads == 6 and spec.ffn_hidden == 512  # 8/3 * 192 rounded up to 32


def test_toml_unknown_field(tmp_path):
    path = tmp_path / "m.toml"
    path.write_text("[model]\nd_model = 64\nn_layers = 2\nn_heads = 4\nwidth = 3\n")
    with pytest.raises(ValueError, match="unknown model fields \\['width'\\]"):
        load_model(str(path))


def test_unknown_preset_and_missing_files(tmp_path):
    with pytest.raises(ValueError, match="llama3-70b.*tiny"):
        load_model("llama-7")
    with pytest.raises(FileNotFoundError):
        load_model(str(tmp_path / "none.toml"))
    with pytest.raises(FileNotFoundError):
        load_model(str(tmp_path / "none.json"))


def test_bad_shapes_are_refused():
    from paratrain.plan.models import ModelSpec
    with pytest.raises(ValueError, match="divisible"):
        ModelSpec(2, 100, 3, 3, 400, 10, name="x")
    with pytest.raises(ValueError, match="multiple"):
        ModelSpec(2, 96, 6, 4, 400, 10, name="x")


MIXTRAL = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
           "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
           "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
           "vocab_size": 32000, "max_position_embeddings": 32768}
T5 = {"architectures": ["T5ForConditionalGeneration"], "model_type": "t5", "d_model": 768,
      "d_ff": 3072, "num_heads": 12, "num_layers": 12, "num_decoder_layers": 12,
      "vocab_size": 32128, "is_encoder_decoder": True}


DEEPSEEK = {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
            "hidden_size": 5120, "intermediate_size": 12288, "num_attention_heads": 128,
            "num_hidden_layers": 60, "n_routed_experts": 160, "vocab_size": 102400}
"""DeepSeek-V2: a mixture of experts the planner does not read (DeepSeek-V3 it does:
tests/test_plan_deepseek.py)."""


@pytest.mark.parametrize("cfg, words", [(DEEPSEEK, "mixture of experts (n_routed_experts = 160)"),
                                        (T5, "encoder-decoder")])
def test_unmodelled_moe_and_encoder_decoder_configs_are_refused_by_name(tmp_path, cfg, words, capsys):
    """A mixture of experts the planner does not read (DeepSeek-V2) and an encoder-decoder;
    the ones train runs are planned (tests/test_plan_moe.py), and DeepSeek-V3
    (tests/test_plan_deepseek.py)."""
    import json
    import re

    from test_plan_cli import plan

    directory = tmp_path / ("deepseek-v2" if cfg is DEEPSEEK else "t5-base")
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=re.escape(words)):
        load_model(str(directory))
    assert plan("--model", str(directory)) == 2
    err = capsys.readouterr().err
    assert directory.name in err and cfg["model_type"] in err and words in err
    renamed = tmp_path / "configs" / f"{directory.name}.json"  # not config.json: named as given
    renamed.parent.mkdir()
    renamed.write_text(json.dumps(cfg))
    assert plan("--model", str(renamed)) == 2
    assert f"{renamed} (model_type" in capsys.readouterr().err
    dense = {**MIXTRAL, "num_local_experts": 1, "model_type": "mistral"}
    (directory / "config.json").write_text(json.dumps(dense))
    assert load_model(str(directory)).n_layers == 32  # one expert is a dense model


@pytest.mark.parametrize("edit, words", [
    (dict(tie_word_embeddings="false"), r"tie_word_embeddings must be true or false, got \"false\""),
    (dict(attention_dropout=[0.1]), r"attention_dropout must be a number in \[0, 1\), got \[0.1\]"),
    (dict(attention_dropout="0.1x"), r"attention_dropout must be a number"),
    (dict(num_hidden_layers=1_000_003), r"num_hidden_layers = 1000003: more than 10,000 layers"),
    (dict(hidden_size=4100), r"hidden_size = 4100 is not divisible by num_attention_heads = 32"),
])
def test_hf_fields_that_would_be_misread_are_refused_by_name(tmp_path, edit, words):
    """A string "false", a list as a rate: each read wrongly, or a traceback, before; now
    one line naming the field."""
    with pytest.raises(ValueError, match=words):
        load_model(str(_write(tmp_path, "m", {**LLAMA3_8B_CONFIG, **edit})))


def test_hf_reading_of_windows_gates_files_and_paths(tmp_path, monkeypatch):
    bad = tmp_path / "bad.json"
    bad.write_text("{'hidden_size': 1}")
    with pytest.raises(ValueError, match=r"bad.json: not valid JSON"):
        load_model(str(bad))
    gemma = load_model(str(_write(tmp_path, "gemma", {**LLAMA3_8B_CONFIG, "model_type": "gemma",
                                                       "hidden_act": "gelu_pytorch_tanh"})))
    assert gemma.gated_mlp  # GeGLU
    mistral = load_model(str(_write(tmp_path, "mistral", {**LLAMA3_8B_CONFIG, "model_type": "mistral",
                                                          "max_position_embeddings": 32768,
                                                          "sliding_window": 4096})))
    assert mistral.max_seq_len == 4096  # paratrain trains within the window
    monkeypatch.chdir(tmp_path)
    assert load_model("mistral").preset == ""  # a config.json alone: no weights to train from
    (tmp_path / "mistral" / "model.safetensors").touch()
    assert load_model("mistral").preset == str(tmp_path / "mistral")  # absolute: --out from anywhere


def test_a_head_dim_other_than_hidden_over_heads_is_planned_and_not_trained(tmp_path):
    """Mistral-NeMo's shape (hidden 5120, 32 heads of 128): the planner counts q and the
    attention output 4096 wide, as transformers builds it; train's reader refuses it by
    name, and --out says it is planner-only."""
    import torch
    import transformers

    from paratrain.layout import Layout
    from paratrain.models.hf_config import HFModelError, read_shape
    from paratrain.plan.candidate import Candidate, Training
    from paratrain.plan.export import refusal
    from paratrain.plan.mla import HEAD_DIM_REFUSAL

    small = {**LLAMA3_8B_CONFIG, "hidden_size": 320, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 512,
             "num_hidden_layers": 2, "vocab_size": 1000}
    path = _write(tmp_path, "nemo", small)
    model = load_model(str(path))
    assert (model.head_dim, model.q_dim, model.explicit_head_dim) == (64, 256, 64)
    hf_config = transformers.LlamaConfig(**{k: v for k, v in small.items()
                                            if k not in ("architectures", "model_type")})
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(hf_config)
    assert model.num_params() == sum(p.numel() for p in hf.parameters())
    from paratrain.plan.flops import layer_matmuls  # the GEMMs timed are the weights counted
    assert sum(k * n for _, k, n in layer_matmuls(model, 1, 1)) == model.layer_params(1) - 2 * 320
    with pytest.raises(HFModelError, match="head_dim = 64 differs from hidden_size"):
        read_shape(small, path)
    cand = Candidate(Layout(dp=1), zero=0, micro_batch=1, microbatches=1)
    assert refusal(cand, model, Training(1, 64)) == HEAD_DIM_REFUSAL
