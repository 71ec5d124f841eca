"""Checks that a Hugging Face model directory's safetensors files are exactly the model
its ``config.json`` describes: every tensor present with the implied shape, none beyond
them, and tied embeddings only where transformers ties them. A directory that fails is
refused before any rank reads it (``train/preflight.py``) rather than cut to fit."""

from __future__ import annotations

from pathlib import Path

import torch

from . import param_shapes
from .gpt import GPTConfig
from .hf import _TOP, HFModelError, names, stacked_names

_FIELDS = {"tok_embeddings": "vocab_size, hidden_size", "output": "vocab_size, hidden_size",
           "attn.w": "num_attention_heads, num_key_value_heads, head_dim, hidden_size",
           "mlp.w": "intermediate_size, hidden_size", "norm": "hidden_size",
           "mlp.router": "num_experts, hidden_size",
           "mlp.experts": "moe_intermediate_size (Mixtral: intermediate_size), hidden_size",
           "mlp.shared": "shared_expert_intermediate_size, hidden_size"}
"""config.json fields that set the shape of each kind of tensor (for the error message)."""


class ConfigMismatch(HFModelError):
    """config.json does not describe the weights beside it (a shape, a tensor it does not
    name, a tie transformers would not make); the message says what to correct there."""


def check_complete(directory, cfg: GPTConfig, files: dict[str, str]) -> None:
    """Every tensor config.json implies is in the safetensors files, with the shape it
    implies: a config that does not describe the weights is refused, not cut to fit."""
    from safetensors import safe_open

    shapes = param_shapes(cfg)
    theirs_of = [(ours, theirs, shapes[ours]) for ours, theirs in names(cfg).items()]
    for ours, experts in stacked_names(cfg).items():  # each expert's own tensor
        theirs_of += [(ours, theirs, shapes[ours][1:]) for theirs in experts]
    missing = sorted(theirs for _, theirs, _ in theirs_of if theirs not in files)
    if missing:
        raise HFModelError(f"{directory}: tensors missing from the safetensors files: {missing[:5]}")
    _check_no_extra(directory, cfg, files, {theirs for _, theirs, _ in theirs_of})
    _check_tied(directory, cfg, files)
    by_file: dict[str, list[tuple[str, str, tuple]]] = {}
    for ours, theirs, shape in theirs_of:
        by_file.setdefault(files[theirs], []).append((ours, theirs, shape))
    for file, triples in sorted(by_file.items()):
        with safe_open(str(Path(directory) / file), framework="pt") as f:
            got = {theirs: tuple(f.get_slice(theirs).get_shape()) for _, theirs, _ in triples}
        for ours, theirs, shape in triples:
            if got[theirs] != shape:
                fields = next(v for k, v in _FIELDS.items() if k in ours)
                raise ConfigMismatch(
                    f"{directory}: {theirs} is {list(got[theirs])} in {file}, but config.json "
                    f"({fields}) implies {list(shape)}: the config does not describe "
                    f"these weights")


IGNORED = ("rotary_emb.inv_freq",)
"""Tensors some checkpoints carry that transformers recomputes (not weights)."""


def _check_no_extra(directory, cfg: GPTConfig, files: dict[str, str], expected: set[str]) -> None:
    """Refuse tensors the config does not account for (a third layer under
    num_hidden_layers=2, q/k/v biases of a Llama): paratrain would drop them and train a
    model cut to fit, where transformers at least reports them as unexpected."""
    extra = sorted(k for k in files if k not in expected and not k.endswith(IGNORED)
                   and not (cfg.tie_embeddings and k == _TOP["output.weight"]))
    if extra:
        raise ConfigMismatch(
            f"{directory}: the safetensors files hold {len(extra)} tensor(s) that config.json "
            f"(num_hidden_layers, attention_bias, tie_word_embeddings) does not describe, "
            f"e.g. {extra[:3]}; they would be dropped: correct config.json to describe "
            f"every tensor, or remove them from the files")


def _check_tied(directory, cfg: GPTConfig, files: dict[str, str], rows: int = 4096) -> None:
    """tie_word_embeddings=true beside an lm_head.weight that differs from the embedding:
    transformers then keeps the two apart (it does not tie), so tying would train another
    model than the one it loads. Compared a block of rows at a time (bounded memory)."""
    from safetensors import safe_open

    emb, head = _TOP["tok_embeddings.weight"], _TOP["output.weight"]
    if not cfg.tie_embeddings or head not in files:
        return
    with safe_open(str(Path(directory) / files[emb]), framework="pt") as fe, \
            safe_open(str(Path(directory) / files[head]), framework="pt") as fh:
        a, b = fe.get_slice(emb), fh.get_slice(head)
        n = a.get_shape()[0]
        if tuple(b.get_shape()) == tuple(a.get_shape()) and all(
                torch.equal(a[i:i + rows], b[i:i + rows]) for i in range(0, n, rows)):
            return
    raise ConfigMismatch(f"{directory}: config.json sets tie_word_embeddings=true, but the files "
                       f"hold an {head} that differs from {emb}; transformers then does not "
                       f"tie them, so paratrain would train another model: set "
                       f"tie_word_embeddings to false in config.json")
