"""The optimizer's pieces against torch's own: the learning-rate schedule against
``torch.optim.lr_scheduler``, and gradient clipping across tensor-, pipeline- and ZeRO
shards against ``torch.nn.utils.clip_grad_norm_`` on the unsharded model, through the
training loop with clipping active at every step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from distributed import run_world
from helpers import assert_replicas_equal, assert_same_run, tiny_config, torch_schedule, train_runs
from paratrain.models.gpt import GPT
from paratrain.optim import lr_at
from paratrain.train import data as D

CLIP = 0.5  # the tiny model's gradient norms are 1.5-3: clipping acts at every step


@pytest.mark.parametrize("warmup,total", [(0, 20), (1, 10), (2, 10), (5, 50), (20, 200)])
def test_lr_schedule_equals_torch_schedulers(warmup, total):
    cfg = SimpleNamespace(lr=3e-3, min_lr=3e-4, warmup_steps=warmup)
    ours = [lr_at(step, total, cfg) for step in range(total)]
    torch.testing.assert_close(torch.tensor(ours, dtype=torch.float64),
                               torch.tensor(torch_schedule(3e-3, 3e-4, warmup, total), dtype=torch.float64),
                               rtol=1e-9, atol=0)


def reference_with_torch_clip(cfg) -> dict:
    """The run a single process makes with torch's pieces only: AdamW (decay on matrices),
    the torch scheduler above and ``clip_grad_norm_`` on the whole model."""
    model = GPT(cfg.model, seed=cfg.train.seed)  # train's initial weights
    o = cfg.optim
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    lrs = torch_schedule(o.lr, o.min_lr, o.warmup_steps, cfg.train.steps)
    train, _ = D.split(D.load_corpus(cfg.data.corpus), cfg.data.val_fraction)
    samples = D.Samples(train, cfg.data.seq_len)
    sampler = D.DistributedSampler(len(samples), cfg.train.global_batch, dp_rank=0, dp_size=1,
                                   seed=cfg.train.seed, remainder=cfg.data.remainder)
    out = {"losses": [], "grad_norms": [], "val": []}
    for step in range(cfg.train.steps):
        indices = sampler.global_indices(step)
        tokens, targets = samples.batch(indices)
        opt.zero_grad()
        loss = model(tokens, targets) / D.valid_tokens(indices, cfg.data.seq_len)
        loss.backward()
        if step == 0:
            out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
        out["grad_norms"].append(torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip).item())
        for group in opt.param_groups:
            group["lr"] = lrs[step]
        opt.step()
        out["losses"].append(loss.item())
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


# (tensor shards, pipeline stages, ZeRO shards) combined: the squared norm must be summed
# over every group that partitions ownership, and each replicated gradient counted once.
LAYOUTS = {"dp2 tp2 sp zero2": dict(dp=2, tp=2, sp=True, zero=2),
           "tp2 pp2": dict(tp=2, pp=2, microbatches=2),
           "dp2 pp2 zero1": dict(dp=2, pp=2, zero=1, microbatches=2)}


def test_clipping_across_shards_equals_torch_clip_grad_norm(tmp_path):
    common = dict(grad_clip=CLIP, eval_every=0, lr=1e-3)
    want = reference_with_torch_clip(tiny_config(str(tmp_path), nproc=1, **common))
    assert min(want["grad_norms"]) > 2 * CLIP  # clipping acts at every step
    configs = {name: tiny_config(str(tmp_path), nproc=4, **common, **layout)
               for name, layout in LAYOUTS.items()}
    results = run_world(train_runs, 4, configs)
    for name in configs:
        got = {**results[0][name], "val": []}  # the reference does not evaluate
        assert_same_run(got, want, what=name)
        assert_replicas_equal(results, name)


def test_a_resumed_adam_count_lives_where_the_kernel_wants_it():
    """torch's fused AdamW (paratrain's on CUDA) refuses a step count on the CPU, so a
    resumed state puts it on the parameter's device there, and on the CPU otherwise
    (scripts/gpu_smoke.sh resumes a fused run on a GPU bit-exactly)."""
    from paratrain.optim import adam_step_count

    p = torch.nn.Parameter(torch.ones(2))
    elsewhere = torch.device("meta")  # stands in for the GPU: any device but the CPU
    fused = torch.optim.AdamW([p], fused=True)
    assert adam_step_count(fused, 3, elsewhere).device == elsewhere
    count = adam_step_count(torch.optim.AdamW([p]), 3, elsewhere)
    assert count.device.type == "cpu" and count.item() == 3.0


def test_adamw_is_fused_on_cuda_only():
    """The decision ``build_adamw`` makes, checkable without a GPU: fused on CUDA (measured
    faster on an H100, docs/gpu.md), torch's foreach default elsewhere (what the CPU parity
    tests' peers run)."""
    from types import SimpleNamespace

    from paratrain.optim import build_adamw, fused_on

    assert fused_on(torch.device("cuda")) and fused_on(torch.device("cuda", 1))
    assert not fused_on(torch.device("cpu")) and not fused_on(torch.device("meta"))
    cfg = SimpleNamespace(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    optimizer = build_adamw([torch.nn.Parameter(torch.ones(2, 2))], cfg)
    assert not optimizer.defaults["fused"] and optimizer.defaults["foreach"] is None


def test_the_squared_norm_is_fp32_whatever_the_gradients_dtype():
    """``optim.squared_norm`` (the replicated engines' clipping norm) against float64: bf16
    gradients' norms rounded to bf16 would be off by about 2**-9."""
    from paratrain.optim import squared_norm

    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(shape, generator=gen).to(dtype) for shape, dtype in
             (((64, 48), torch.bfloat16), ((300,), torch.bfloat16), ((7, 9), torch.float32))]
    exact = sum(g.double().pow(2).sum() for g in grads)
    got = squared_norm(grads)
    assert got.dtype == torch.float32
    assert got.item() == pytest.approx(exact.item(), rel=1e-6)
    assert squared_norm([]).item() == 0.0
