"""A model of a third shape, with attribute names of its own, is parallelized through its
own ``ModelDescription``, with no change to ``parallel/``: tensor (+ sequence), context and
pipeline parallelism and recomputation give the losses and gradients of the plain model."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from distributed import run_world
from helpers import rel_error, tiny_config
from paratrain.mesh import Mesh
from paratrain.models.description import ModelDescription
from paratrain.models.shape import ModelShape
from paratrain.models.gpt import CausalAttention, CrossEntropySum, GPTConfig, RMSNorm, apply_rope, rope_tables
from paratrain.parallelize import parallelize

D, HEADS, KV, FFN, LAYERS, VOCAB, SEQ = 64, 4, 2, 128, 2, 256, 32


class Mixer(nn.Module):
    def __init__(self):
        super().__init__()
        self.head_dim = D // HEADS
        self.query = nn.Linear(D, D, bias=False)
        self.key = nn.Linear(D, KV * self.head_dim, bias=False)
        self.value = nn.Linear(D, KV * self.head_dim, bias=False)
        self.proj = nn.Linear(D, D, bias=False)
        self.inner = CausalAttention()

    def forward(self, x, cos, sin):
        b, s, _ = x.shape  # head counts from the weights: a tensor-parallel shard has fewer
        q, k, v = (f(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for f in (self.query, self.key, self.value))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.proj(self.inner(q, k, v).transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(D, FFN, bias=False), nn.Linear(D, FFN, bias=False), nn.Linear(FFN, D, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre_mix, self.mixer, self.pre_ff, self.ff = RMSNorm(D, 1e-5), Mixer(), RMSNorm(D, 1e-5), FeedForward()

    def forward(self, x, cos, sin):
        x = x + self.mixer(self.pre_mix(x), cos, sin)
        return x + self.ff(self.pre_ff(x))


class OtherLM(nn.Module):
    """Not paratrain's GPT: every attribute is named differently."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.trunk = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.final = RMSNorm(D, 1e-5)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)
        self.criterion = CrossEntropySum()
        cos, sin = rope_tables(GPTConfig(d_model=D, n_heads=HEADS, max_seq_len=SEQ))
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def description(self) -> ModelDescription:
        return ModelDescription(
            shape=ModelShape(n_layers=LAYERS, d_model=D, n_heads=HEADS, n_kv_heads=KV,
                             ffn_hidden=FFN, vocab_size=VOCAB, max_seq_len=SEQ),
            blocks="trunk", embedding="embed", final_norm="final", head="lm_head",
            loss="criterion", attention="mixer", attention_core="mixer.inner", q="mixer.query",
            k="mixer.key", v="mixer.value", o="mixer.proj", mlp="ff", mlp_in=("ff.gate", "ff.up"),
            mlp_out="ff.down")

    def rope(self, positions):
        return self.cos[positions], self.sin[positions]

    def forward(self, tokens, targets, positions=None):
        if positions is None:
            positions = torch.arange(tokens.shape[1])
        cos, sin = self.rope(positions)
        h = self.embed(tokens)
        for layer in self.trunk:
            h = layer(h, cos, sin)
        return self.criterion(self.lm_head(self.final(h)), targets)


LAYOUTS = {"tp2": dict(tp=2), "tp2 sp": dict(tp=2, sp=True), "cp2 ring": dict(cp=2),
           "cp2 ulysses": dict(cp=2, cp_method="ulysses"), "tp2 selective": dict(tp=2, recompute="selective"),
           "pp2 1f1b": dict(pp=2), "pp2 full recompute": dict(pp=2, recompute="full")}


def _parity(tmp: str) -> dict:
    from helpers import full_grads

    torch.manual_seed(0)
    plain = OtherLM()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, VOCAB, (2, SEQ), generator=g), torch.randint(0, VOCAB, (2, SEQ), generator=g))
               for _ in range(2)]
    tokens = 2 * 2 * SEQ
    ref = copy.deepcopy(plain)
    want_loss = sum(ref(t, y) for t, y in batches)
    (want_loss / tokens).backward()
    want = {n: p.grad for n, p in ref.named_parameters()}
    errors = {}
    for name, overrides in LAYOUTS.items():
        cfg = tiny_config(tmp, nproc=2, seq_len=SEQ, micro_batch=2, **overrides)
        engine = parallelize(copy.deepcopy(plain), Mesh.build(cfg.layout), cfg.parallel_options())
        loss = engine.forward_backward(batches, 1 / tokens)
        got = full_grads(engine)
        errors[name] = max([abs(loss.total.item() - want_loss.item()) / want_loss.item()]
                           + [rel_error(got[n], w) for n, w in want.items()])
    return errors


def test_a_third_model_family_parallelizes_through_its_description(tmp_path):
    for errors in run_world(_parity, 2, str(tmp_path), timeout_s=300):
        assert all(e < 1e-5 for e in errors.values()), errors


def test_a_description_that_does_not_match_the_model_is_refused():
    """A wrong count (here KV heads, or the vocabulary) would cut the projections at the
    wrong heads and pair query heads with the wrong keys, silently."""
    import dataclasses

    import pytest

    from paratrain.parallel.tensor import _check_shapes

    model = OtherLM()
    _check_shapes(model, model.description())
    for field, wrong, match in (("n_kv_heads", KV // 2, r"n_kv_heads x head_dim = .* trunk.0.mixer.key"),
                                ("vocab_size", VOCAB + 1, "vocab_size = .* embed has")):
        desc = model.description()
        desc = dataclasses.replace(desc, shape=dataclasses.replace(desc.shape, **{field: wrong}))
        with pytest.raises(ValueError, match=match):
            _check_shapes(model, desc)
