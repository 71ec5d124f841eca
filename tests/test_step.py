"""The one step path (parallel/step.py) against the hand-written accumulation it replaced.

Without pipeline parallelism ``engine.forward_backward`` runs the one-stage 1F1B table
(``F0 B0 F1 B1 ...``) through the schedule executor. That is the same arithmetic as the old
loop's accumulation (every backward but the last under ``no_sync``, each microbatch's
summed loss times dp / tokens), so losses and every gradient must be equal bit for bit, and
forward-only evaluation must equal calling the model.
"""

from __future__ import annotations

import contextlib

import torch

from distributed import run_world
from helpers import full_grads, tiny_config
from paratrain.mesh import Mesh
from paratrain.models.gpt import GPT
from paratrain.parallelize import parallelize
from paratrain.train import data as D

VARIANTS = {"ddp": {}, "zero1": {"zero": 1}, "zero2": {"zero": 2}, "zero3": {"zero": 3}}


def _old_accumulate(engine, batches, scale: float) -> torch.Tensor:
    """The loop's accumulation before the engine owned the step."""
    loss_sum = torch.zeros(())
    for i, (tokens, targets) in enumerate(batches):
        with contextlib.nullcontext() if i == len(batches) - 1 else engine.no_sync():
            loss = engine(tokens, targets)
            (loss * scale).backward()
        loss_sum += loss.detach().float()
    engine.finish_grad_sync()
    return loss_sum


def _compare(tmp: str) -> dict:
    out = {}
    for name, overrides in VARIANTS.items():
        cfg = tiny_config(tmp, dp=2, nproc=2, micro_batch=2, **overrides)
        mesh = Mesh.build(cfg.layout)
        torch.manual_seed(0)
        engine = parallelize(GPT(cfg.model), mesh, cfg.parallel_options())
        samples = D.Samples(D.load_tokens(cfg.data)[0], cfg.data.seq_len)
        rank = mesh.coord("dp")
        batches = [samples.batch([rank * 4 + 2 * i, rank * 4 + 2 * i + 1]) for i in range(2)]
        tokens = 8 * cfg.data.seq_len
        engine.zero_grad()
        new = engine.forward_backward(batches, 1 / tokens)
        new_grads = full_grads(engine)
        engine.zero_grad()
        old = _old_accumulate(engine, batches, mesh.size("dp-cp") / tokens)
        old_grads = full_grads(engine)
        with torch.no_grad():
            plain = sum(engine.module(t, y).float() for t, y in batches)
        evaluated = engine.forward_backward(batches, 1.0, training=False)
        out[name] = {"new": new.local, "old": old, "new_grads": new_grads, "old_grads": old_grads,
                     "eval": evaluated.local, "plain": plain}
    return out


def test_single_step_path_equals_the_old_accumulation_bit_for_bit(tmp_path):
    for rank, results in enumerate(run_world(_compare, 2, str(tmp_path), timeout_s=240)):
        for name, r in results.items():
            assert torch.equal(r["new"], r["old"]), (rank, name, "loss")
            assert r["new_grads"].keys() == r["old_grads"].keys()
            for key, ref in r["old_grads"].items():
                assert torch.equal(r["new_grads"][key], ref), (rank, name, key)
            assert torch.equal(r["eval"], r["plain"]), (rank, name, "evaluation")
