"""ZeRO-2/3 under pipeline parallelism: each stage's units sharded over its data-parallel
group, gradients accumulated over the step's microbatches and reduced once by each chunk's
final backward, ZeRO-3 parameters gathered once per step (or per use, when asked).

Parity with one process (per-step loss and grad norm, validation loss, final parameters;
clipping off, except in the test of active clipping), and with dp2 x pp2 at ZeRO-1."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from distributed import run_world
from paratrain.comm import collectives as C
from paratrain.mesh import Mesh
from paratrain.train.config import load
from paratrain.train.loop import train

RTOL = 1e-5


def config(tmp: str, **overrides):
    base = dict(preset="tiny", n_layers=4, tie_embeddings=False, seq_len=32, global_batch=8,
                steps=3, warmup_steps=1, lr=1e-3, grad_clip=0.0, eval_every=0, eval_batches=1,
                progress=False, run_dir=tmp, bucket_mb=0.05)
    return load(None, {**base, **overrides}).validate()


def run_all(configs):
    """Each config in turn in this world: (losses, grad norms, val losses, params on rank 0)."""
    out = []
    for cfg in configs:
        result = train(cfg, Mesh.build(cfg.layout), keep_params=True)
        norms = []
        if dist.get_rank() == 0:
            norms = [json.loads(line)["grad_norm"] for line in cfg.metrics_path.read_text().splitlines()]
        out.append((result.losses, norms, result.val_losses,
                    result.params if dist.get_rank() == 0 else None))
    return out


def assert_same(got, want, what: str) -> None:
    for (name, a, b) in zip(("loss", "grad_norm", "val"), got[:3], want[:3]):
        a = torch.tensor([x[1] if isinstance(x, tuple) else x for x in a])
        b = torch.tensor([x[1] if isinstance(x, tuple) else x for x in b])
        torch.testing.assert_close(a, b, rtol=RTOL, atol=0, msg=lambda m: f"{what} {name}: {m}")
    for name, ref in want[3].items():
        err = ((got[3][name] - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        assert err <= RTOL, f"{what}: parameter {name} off by {err:.2e}"


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("ref"))
    plain, clipped = run_world(run_all, 1, [config(tmp, nproc=1), config(tmp, nproc=1, grad_clip=0.3)])[0]
    assert max(plain[1]) > 0.3, "the clipping test needs a norm above its threshold"
    return plain, clipped


VARIANTS_4 = {
    "zero1 1f1b": dict(zero=1, schedule="1f1b"),
    "zero2 gpipe": dict(zero=2, schedule="gpipe"),
    "zero2 1f1b": dict(zero=2, schedule="1f1b"),
    "zero2 interleaved": dict(zero=2, schedule="interleaved", virtual_stages=2),
    "zero3 gpipe": dict(zero=3, schedule="gpipe"),
    "zero3 1f1b": dict(zero=3, schedule="1f1b"),
    "zero3 1f1b reshard": dict(zero=3, schedule="1f1b", reshard_after_forward="yes"),
    "zero3 interleaved": dict(zero=3, schedule="interleaved", virtual_stages=2),
}


def test_zero_with_pipeline_on_four_ranks(references, tmp_path):
    """dp2 x pp2, 4 microbatches per rank and step (accumulation through the schedule)."""
    plain, clipped = references
    configs = [config(str(tmp_path), dp=2, pp=2, microbatches=2, **v) for v in VARIANTS_4.values()]
    configs.append(config(str(tmp_path), dp=2, pp=2, microbatches=2, zero=3, grad_clip=0.3))
    results = run_world(run_all, 4, configs)[0]
    for name, got in zip(VARIANTS_4, results):
        assert_same(got, plain, name)
        assert_same(got, results[0], f"{name} vs zero1")
    assert_same(results[-1], clipped, "zero3 1f1b, clipping active")


def test_zero3_data_tensor_pipeline_on_eight_ranks(references, tmp_path):
    plain, _ = references
    configs = [config(str(tmp_path), dp=2, tp=2, pp=2, microbatches=2, zero=3),
               config(str(tmp_path), dp=2, tp=2, sp=True, pp=2, microbatches=2, zero=2,
                      schedule="interleaved", virtual_stages=2)]
    for name, got in zip(("dp2 tp2 pp2 zero3", "dp2 tp2+sp pp2 zero2 interleaved"),
                         run_world(run_all, 8, configs, timeout_s=240)[0]):
        assert_same(got, plain, name)


def count_gathers(configs):
    """All-gathers of ZeRO-3 parameter units during training steps (not evaluation)."""
    import paratrain.train.loop as loop

    loop.evaluate = lambda run: 0.0  # this spawned process's copy only
    counts = []
    for cfg in configs:
        calls = []
        original = C.all_gather

        def counting(out, inp, group, async_op=False):
            calls.append(out.numel())
            return original(out, inp, group, async_op=async_op)

        C.all_gather = counting
        try:
            train(cfg, Mesh.build(cfg.layout))
        finally:
            C.all_gather = original
        counts.append(len(calls))
    return counts


def test_zero3_gathers_once_per_step_under_a_pipeline(tmp_path):
    """One step of 4 microbatches on 2 stages: a stage's units are gathered once (kept
    through the step) or twice per microbatch (resharded after each forward)."""
    kw = dict(dp=2, pp=2, microbatches=4, zero=3, steps=1, eval_every=0)
    keep, reshard = run_world(count_gathers, 4, [config(str(tmp_path), **kw),
                                                 config(str(tmp_path), reshard_after_forward="yes", **kw)])[0]
    assert keep == 3, keep  # rank 0: the embedding and two blocks
    assert reshard == 4 * 3 + 4 * 2, reshard  # forwards, then backwards but the last unit's
