"""Hugging Face Llama-family models in and out: paratrain's GPT built from a local model
directory equals transformers (logits, loss, first-step gradients), trains under every
strategy with parity, and exports back bit-identically to a directory transformers loads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from distributed import run_world
from paratrain.models import hf, hf_check
from paratrain.models.gpt import GPT, preset

transformers = pytest.importorskip("transformers")

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(rope_scaling=LLAMA3_ROPE, rope_theta=500000.0, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=32)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    # every layer slides (max_window_layers 0); paratrain trains within the window, the
    # round trip below feeds transformers more tokens than it
    "qwen2-window": ("Qwen2Config", "Qwen2ForCausalLM",
                     dict(use_sliding_window=True, sliding_window=32, max_window_layers=0)),
}


def make(root, family: str):
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**COMMON, **extra))
    with torch.no_grad():  # biases are zero at init: make every tensor matter
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(root / family)
    return model.eval(), str(root / family)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {f: make(root, f) for f in FAMILIES}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_loss_and_gradients_equal_transformers(models, family):
    theirs, path = models[family]
    cfg = preset(path)
    ours = GPT(cfg)
    ours.load_state_dict(hf.load_weights(path, cfg))
    x = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(1))
    out = theirs(x, labels=x)
    loss = ours(x[:, :-1], x[:, 1:]) / x[:, 1:].numel()
    torch.testing.assert_close(ours.logits(x[:, :-1]), out.logits[:, :-1].detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, out.loss, rtol=1e-5, atol=0)
    loss.backward()
    out.loss.backward()
    grads = {n: p.grad for n, p in theirs.named_parameters()}
    for name, p in ours.named_parameters():
        want = hf._permute_rope(name, grads[hf.names(cfg)[name]], cfg, True)
        torch.testing.assert_close(p.grad, want, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_export_round_trip_is_bit_identical_and_loads(models, tmp_path):
    from safetensors.torch import load_file

    for family, (theirs, path) in models.items():
        cfg = preset(path)
        hf.export(hf.load_weights(path, cfg), cfg, tmp_path / family)
        before, after = load_file(f"{path}/model.safetensors"), load_file(tmp_path / family / "model.safetensors")
        assert before.keys() == after.keys(), family
        assert all(torch.equal(before[k], after[k]) for k in before), family
        again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / family).eval()
        assert type(again).__name__ == type(theirs).__name__
        x = torch.randint(0, 256, (1, 40))  # longer than qwen2-window's window
        torch.testing.assert_close(again(x).logits, theirs(x).logits, rtol=0, atol=0)


def test_configs_that_do_not_describe_their_weights_are_refused(models, tmp_path):
    """A config.json whose sizes differ from the tensors' (they used to be cut to fit), and
    a Qwen2 that slides its window on some layers only (paratrain has one attention for all)."""
    _, path = models["llama"]
    shutil.copytree(path, tmp_path / "edited")
    raw = json.loads((tmp_path / "edited" / "config.json").read_text())
    (tmp_path / "edited" / "config.json").write_text(json.dumps({**raw, "intermediate_size": 64}))
    with pytest.raises(hf.HFModelError, match=r"gate_proj.weight is \[128, 64\].*intermediate_size.*\[64, 64\]"):
        hf_check.check_complete(tmp_path / "edited", preset(str(tmp_path / "edited")),
                          hf.weight_files(tmp_path / "edited"))
    raw = json.loads(Path(models["qwen2-window"][1], "config.json").read_text())
    raw.pop("layer_types", None)
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "config.json").write_text(json.dumps({**raw, "max_window_layers": 1}))
    with pytest.raises(hf.HFModelError, match="max_window_layers=1"):
        preset(str(tmp_path / "mixed"))
    raw = json.loads(Path(path, "config.json").read_text())  # 4 heads over 3 key/value heads
    (tmp_path / "kv").mkdir()
    (tmp_path / "kv" / "config.json").write_text(json.dumps({**raw, "num_key_value_heads": 3}))
    with pytest.raises(hf.HFModelError, match=rf"^{tmp_path / 'kv'}: .*multiple of n_kv_heads=3 .*num_key_value_heads"):
        preset(str(tmp_path / "kv"))


def test_export_over_a_sharded_model_removes_its_index_and_shards(models, tmp_path):
    """Left beside the new model.safetensors, the old index would hand its reader the old
    weights; model.safetensors is read first in any case, as transformers does."""
    theirs, path = models["llama"]
    theirs.save_pretrained(tmp_path / "sharded", max_shard_size="50KB")
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 1
    source, cfg = models["qwen2"][1], preset(models["qwen2"][1])
    params = hf.load_weights(source, cfg)
    hf.export(params, cfg, tmp_path / "sharded", overwrite=True)
    assert not list((tmp_path / "sharded").glob("model-*")) and \
        not (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    again = hf.load_weights(tmp_path / "sharded", preset(str(tmp_path / "sharded")))
    assert all(torch.equal(again[k], params[k]) for k in params)


def test_export_records_the_dtype_it_stores(models, tmp_path):
    """config.json's torch_dtype follows --dtype (it said float32 whatever was stored)."""
    _, path = models["qwen2"]
    cfg = preset(path)
    hf.export(hf.load_weights(path, cfg), cfg, tmp_path / "bf16", dtype=torch.bfloat16)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype="auto")
    assert next(again.parameters()).dtype == torch.bfloat16


@pytest.mark.parametrize("config, name", [
    ({"architectures": ["MixtralForCausalLM"], "num_local_experts": 8}, "MixtralForCausalLM"),
    ({"architectures": ["T5ForConditionalGeneration"], "is_encoder_decoder": True}, "T5ForConditionalGeneration"),
    ({"model_type": "gpt2"}, "gpt2"),
])
def test_other_architectures_are_refused_by_name(tmp_path, config, name):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(hf.HFModelError, match=name):
        preset(str(tmp_path))


def test_an_incomplete_llama3_rope_scaling_is_named(tmp_path):
    rope = {k: v for k, v in LLAMA3_ROPE.items() if k != "low_freq_factor"}
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], **COMMON, "rope_scaling": rope}))
    with pytest.raises(hf.HFModelError, match="rope_type llama3 needs .*; low_freq_factor missing"):
        preset(str(tmp_path))


def train_variants(configs):
    import torch.distributed as dist

    from paratrain.mesh import Mesh
    from paratrain.train.loop import train

    out = []
    for cfg in configs:
        result = train(cfg, Mesh.build(cfg.layout), keep_params=True)
        out.append((result.losses, result.params if dist.get_rank() == 0 else None))
    return out


QWEN2_VARIANTS = {"tp2 sp": dict(tp=2, sp=True), "cp2 ring": dict(cp=2), "pp2": dict(pp=2, microbatches=2),
                  "dp2 zero3": dict(dp=2, zero=3)}
LLAMA_VARIANTS = {"dp2 zero1": dict(dp=2, zero=1), "dp2 zero3": dict(dp=2, zero=3),
                  "pp2": dict(dp=1, pp=2, microbatches=2)}  # a copy on the last stage


@pytest.fixture(scope="module")
def trained(models, tmp_path_factory) -> dict:
    """The qwen2 and the tied llama training runs, both tests' runs of one size in one world
    (worlds are slow to start): {family: (its settings, its one-process config, the
    reference run, {variant: run})}."""
    from paratrain.train.config import load

    tmp = str(tmp_path_factory.mktemp("train"))
    # The key bias's gradient nearly cancels (a bias shared by every key only moves the
    # softmax through RoPE's rotation), so Adam's m / (sqrt(v) + eps) turns last-bit
    # summation differences into visible updates at eps=1e-8; eps=1e-6 keeps the comparison
    # well conditioned while any wrong gradient scale still shows in every other tensor.
    bases = {family: dict(preset=models[family][1], seq_len=32, global_batch=4, steps=3, warmup_steps=1,
                          lr=1e-3, grad_clip=0.0, eval_every=0, eval_batches=1, progress=False,
                          run_dir=tmp, **extra) for family, extra in (("qwen2", dict(eps=1e-6)), ("llama", {}))}
    ones = {family: load(None, {**base, "nproc": 1}).validate() for family, base in bases.items()}
    refs = dict(zip(ones, run_world(train_variants, 1, list(ones.values()))[0]))
    two = [(family, name, load(None, {**bases[family], "nproc": 2, **v}).validate())
           for family, variants in (("qwen2", QWEN2_VARIANTS), ("llama", LLAMA_VARIANTS))
           for name, v in variants.items()]
    runs = {family: {} for family in bases}
    for (family, name, _), run in zip(two, run_world(train_variants, 2, [c for *_, c in two])[0]):
        runs[family][name] = run
    return {family: (bases[family], ones[family], refs[family], runs[family]) for family in bases}


def test_a_qwen2_directory_trains_with_parity_under_each_strategy(trained):
    """Qwen2 (q/k/v biases, untied) for 3 steps, clipping off: tp2+SP, cp2 ring, pp2 and
    dp2 x ZeRO-3 equal one process (losses, final parameters)."""
    *_, (ref_losses, ref_params), runs = trained["qwen2"]
    assert list(runs) == list(QWEN2_VARIANTS)
    for name, (losses, params) in runs.items():
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0,
                                   msg=lambda m: f"{name}: {m}")
        for key, want in ref_params.items():
            err = ((params[key] - want).norm() / want.norm()).item()
            assert err <= 1e-5, f"{name}: {key} off by {err:.2e}"


def test_a_tied_llama_trains_under_zero_with_parity_and_exports_tied(trained, tmp_path):
    """Llama with tie_word_embeddings (as Llama 3.2 1B/3B): dp2 x ZeRO-1 and dp2 x ZeRO-3,
    whose unit holds the one matrix the embedding and the head share, pp2 and dp2 x pp2 x
    ZeRO-1, whose last stage keeps a copy, equal one process (losses, final parameters); the
    result exports as a tied model transformers loads."""
    from paratrain.train.config import load

    base, cfg, (ref_losses, ref_params), two = trained["llama"]
    assert cfg.model.tie_embeddings and list(two) == list(LLAMA_VARIANTS)
    runs = list(two.items())
    wide = load(None, {**base, "nproc": 4, "dp": 2, "pp": 2, "zero": 1, "microbatches": 2}).validate()
    runs += list(zip(["dp2 pp2 zero1"], run_world(train_variants, 4, [wide])[0]))
    for name, (losses, params) in runs:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0,
                                   msg=lambda m: f"{name}: {m}")
        assert params.keys() == ref_params.keys(), name  # the tied matrix once
        for key, want in ref_params.items():
            err = ((params[key] - want).norm() / want.norm()).item()
            assert err <= 1e-5, f"{name}: {key} off by {err:.2e}"
    hf.export(params, cfg.model, tmp_path / "out")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert again.lm_head.weight.data_ptr() == again.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(again.model.embed_tokens.weight, params["tok_embeddings.weight"],
                               rtol=0, atol=0)


def _with_tokenizer(root: Path, model_dir: str) -> Path:
    """A copy of ``model_dir`` with a tokenizer trained here, its config and a generation config."""
    from helpers import tiny_bpe

    src = root / "with-tokenizer"
    shutil.copytree(model_dir, src)
    tiny_bpe(src / "tokenizer.json")
    (src / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}))
    transformers.GenerationConfig(bos_token_id=1, eos_token_id=2, max_new_tokens=5).save_pretrained(src)
    return src


def test_export_carries_the_tokenizer_and_special_token_ids(models, tmp_path):
    """An export is usable alone: AutoTokenizer loads from it and generate stops at the eos
    id, whether it re-writes a Hugging Face directory, or exports a checkpoint of a run that
    started from one, or of a run on a dataset prepared with a tokenizer."""
    from paratrain.cli import main
    from paratrain.data.prepare import prepare
    from paratrain.train import checkpoint

    src = _with_tokenizer(tmp_path, models["llama"][1])
    cfg = preset(str(src))
    tensors = {name: torch.zeros(shape) for name, shape in checkpoint.expected_shapes(cfg).items()}
    (tmp_path / "text.txt").write_text("the cat sat on the mat\n" * 50)
    prepare([str(tmp_path / "text.txt")], str(src / "tokenizer.json"), str(tmp_path / "data"))
    for name, run in (("from-hf", {"model_preset": str(src), "data": {"data": ""}}),
                      ("from-data", {"model_preset": "tiny", "data": {"data": str(tmp_path / "data")}})):
        checkpoint.write(tensors, tmp_path / name, {"format": checkpoint.FORMAT, "step": 1, "layout": "dp1",
                                                    "model": cfg.__dict__, "run": {"id": "r", "config": run}})
    for source, files in ((src, {"generation_config.json"}), (tmp_path / "from-hf", {"generation_config.json"}),
                          (tmp_path / "from-data", set())):
        out = tmp_path / f"out-{source.name}"
        assert main(["export", str(source), "--out", str(out)]) == 0
        assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "tokenizer.json",
                                                  "tokenizer_config.json", *files}, source
        tok = transformers.AutoTokenizer.from_pretrained(out)
        assert (tok.eos_token, tok.eos_token_id) == ("</s>", 2), source
        assert json.loads((out / "config.json").read_text())["eos_token_id"] == 2, source
        assert transformers.AutoModelForCausalLM.from_pretrained(out).generation_config.eos_token_id == 2


def test_export_into_its_own_source_directory_keeps_the_tokenizer(models, tmp_path):
    """`export DIR --out DIR --overwrite` (or into the model directory a checkpoint's run
    started from) ended in a shutil.SameFileError traceback: the tokenizer files were
    copied onto themselves after the weights had been written."""
    from paratrain.cli import main

    src = _with_tokenizer(tmp_path, models["llama"][1])
    tokenizer = (src / "tokenizer.json").read_text()
    before = hf.load_weights(src, preset(str(src)))
    assert main(["export", str(src), "--out", str(src), "--overwrite"]) == 0
    assert (src / "tokenizer.json").read_text() == tokenizer
    after = hf.load_weights(src, preset(str(src)))
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert transformers.AutoTokenizer.from_pretrained(src).eos_token == "</s>"


def test_a_pretrained_model_fed_another_tokenizers_ids_is_warned(models, tmp_path):
    """Its own tokenizer's data: no note; bytes, or another tokenizer of no larger vocabulary
    (which the vocabulary-size check lets through): a note naming the fix."""
    from tokenizers import Tokenizer

    from paratrain.data.prepare import prepare
    from paratrain.train import preflight
    from paratrain.train.config import load

    src = _with_tokenizer(tmp_path, models["llama"][1])
    (tmp_path / "text.txt").write_text("the cat sat on the mat\n" * 50)
    other = Tokenizer.from_file(str(src / "tokenizer.json"))
    other.add_tokens(["<extra>"])  # one token more: another mapping of ids to tokens
    other.save(str(tmp_path / "other.json"))
    notes = {}
    for name, tokenizer in (("own", str(src)), ("other", str(tmp_path / "other.json")), ("bytes", "bytes")):
        prepare([str(tmp_path / "text.txt")], tokenizer, str(tmp_path / name))
        cfg = load(None, dict(preset=str(src), data=str(tmp_path / name), seq_len=16, steps=30,
                              run_dir=str(tmp_path / "run"))).validate()
        notes[name] = [n for n in preflight.advice(cfg) if "tokeniz" in n]
    corpus = load(None, dict(preset=str(src), seq_len=16, steps=30, run_dir=str(tmp_path / "run"))).validate()
    assert notes["own"] == []
    assert len(notes["other"]) == 1 and "other.json" in notes["other"][0] and f"--tokenizer {src}" in notes["other"][0]
    assert len(notes["bytes"]) == 1 and "'bytes'" in notes["bytes"][0]
    assert any("a text file's bytes as token ids" in n for n in preflight.advice(corpus))


def test_errors_for_a_hugging_face_model_suggest_fixes_its_weights_allow(models, tmp_path):
    """--vocab-size and tie_embeddings = false are fixed by the weights: the errors said to
    change them, and the next check refused exactly that."""
    from tokenizers import Tokenizer

    from paratrain.data.prepare import prepare
    from paratrain.train import preflight
    from paratrain.train.config import ConfigError, load

    llama = models["llama"][1]  # ties its embeddings
    with pytest.raises(ConfigError, match=r"tied embeddings under a pipeline with ZeRO-2.*use zero = 0 or 1"):
        load(None, dict(preset=llama, seq_len=16, pp=2, zero=2, nproc=2)).validate()
    load(None, dict(preset=llama, seq_len=16, pp=2, nproc=2)).validate()  # a copy on the last stage
    load(None, dict(preset=llama, seq_len=16, zero=3, nproc=2)).validate()  # ZeRO keeps it in one unit
    src = _with_tokenizer(tmp_path, llama)
    wide = Tokenizer.from_file(str(src / "tokenizer.json"))
    wide.add_tokens([f"<extra{i}>" for i in range(80)])  # 280 tokens, over the model's 256
    wide.save(str(tmp_path / "wide.json"))
    (tmp_path / "text.txt").write_text("the cat sat on the mat\n" * 50)
    prepare([str(tmp_path / "text.txt")], str(tmp_path / "wide.json"), str(tmp_path / "data"))
    cfg = load(None, dict(preset=llama, data=str(tmp_path / "data"), seq_len=16)).validate()
    with pytest.raises(ConfigError, match=r"fix its vocabulary: train on text tokenized with its own tokenizer"):
        preflight.check_data(cfg)


@pytest.mark.parametrize("edit, words", [
    ({"hidden_size": "64"}, r"hidden_size must be a positive integer, got \"64\""),
    ({"vocab_size": 256.0}, r"vocab_size must be a positive integer, got 256.0"),
    ({"rope_theta": "abc"}, r"rope_theta must be a positive number, got \"abc\""),
    ({"rope_scaling": "llama3"}, r"rope_scaling must be a JSON object"),
])
def test_a_config_value_of_the_wrong_kind_is_named(tmp_path, edit, words):
    """Such values surfaced as Python's TypeError ("unsupported operand type(s) for //"),
    naming neither the field nor the file; a config.json that is a list, as AttributeError."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], **COMMON, **edit}))
    with pytest.raises(hf.HFModelError, match=words):
        preset(str(tmp_path))
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(hf.HFModelError, match="expected a JSON object"):
        preset(str(tmp_path))


def _rewrite(src: str, dst: Path, edit) -> str:
    """A copy of model directory ``src`` whose tensors ``edit`` changed in place."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return str(dst)


def test_tensors_the_config_does_not_describe_are_refused(models, tmp_path):
    """A third layer under num_hidden_layers=2 was dropped without a word: the model
    trained was cut to fit the config (transformers reports such keys as unexpected)."""
    def third_layer(t):
        t.update({k.replace("layers.1.", "layers.2."): v.clone() for k, v in list(t.items()) if "layers.1." in k})

    path = _rewrite(models["qwen2"][1], tmp_path / "deeper", third_layer)
    with pytest.raises(hf.HFModelError, match=r"tensor\(s\) that config.json .*model\.layers\.2\."):
        hf.load_weights(path, preset(path))
    # Before launch, the advice is config.json's, not "give a complete model.safetensors".
    from paratrain.train.config import ConfigError, load
    from paratrain.train.preflight import check_weights

    with pytest.raises(ConfigError, match="correct config.json") as refused:
        check_weights(load(None, dict(preset=path, seq_len=16, nproc=1)).validate())
    assert "cannot be read" not in str(refused.value)


def test_a_tied_config_beside_a_different_lm_head_is_refused(models, tmp_path):
    """transformers does not tie an lm_head.weight that differs from the embedding; paratrain
    tied it anyway and trained another model than the one transformers loads from the same
    directory. An identical copy of the embedding is no contradiction."""
    llama = models["llama"][1]  # tie_word_embeddings=true, no lm_head.weight stored
    emb = "model.embed_tokens.weight"
    same = _rewrite(llama, tmp_path / "same", lambda t: t.update({"lm_head.weight": t[emb].clone()}))
    hf.load_weights(same, preset(same))
    other = _rewrite(llama, tmp_path / "other", lambda t: t.update({"lm_head.weight": t[emb] + 1}))
    with pytest.raises(hf.HFModelError, match="tie_word_embeddings=true.*set tie_word_embeddings to false"):
        hf.load_weights(other, preset(other))
