"""``--compress METHOD:update`` (parallel/local_update.py): every data-parallel rank steps
AdamW on its own gradient and the compressed reduction averages the updates. Checked
against plain torch (one AdamW per rank, the updates averaged by hand), under tensor and
pipeline parallelism and gradient accumulation, with clipping active; exact resume with
each rank's own moments; what it cannot compose with is refused before launch."""

from __future__ import annotations

import math

import pytest
import torch
from distributed import run_world
from helpers import after, assert_same_run, tail, tiny_config, torch_schedule, train_runs

from paratrain.comm import compress as Z
from paratrain.models.gpt import GPT
from paratrain.train import data as D
from paratrain.train.config import ConfigError

DP = 2
CLIP = 0.5  # the tiny model's local gradient norms are 2-4: sqrt(2) x 0.5 acts at every step


def adamw(model: torch.nn.Module, o) -> torch.optim.AdamW:
    params = list(model.parameters())
    return torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
                              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                             lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)


def local_gradients(model, samples, sampler, step: int, cfg) -> float:
    """This rank's gradient as paratrain scales it (its summed loss x dp / the global batch's
    tokens: an estimate of the mean gradient); returns the rank's loss sum."""
    tokens = D.valid_tokens(sampler.global_indices(step), cfg.data.seq_len)
    model.zero_grad()
    loss = model(*samples.batch(sampler.local_indices(step)))
    (loss * DP / tokens).backward()
    return loss.item() / tokens


def reference_averaging_updates(cfg) -> dict:
    """dp2 with every rank's AdamW and the average of their updates, in one process: two
    replicas, each clipped by the shared factor sqrt(dp) x clip / rms of their norms, each
    stepped by its own AdamW from the same weights; the weights then move by the mean update,
    weight decay applied alike."""
    o, steps = cfg.optim, cfg.train.steps
    replicas = [GPT(cfg.model, seed=cfg.train.seed) for _ in range(DP)]
    optimizers = [adamw(m, o) for m in replicas]
    train, _ = D.split(D.load_corpus(cfg.data.corpus), cfg.data.val_fraction)
    samples = D.Samples(train, cfg.data.seq_len)
    samplers = [D.DistributedSampler(len(samples), cfg.train.global_batch, dp_rank=r, dp_size=DP,
                                     seed=cfg.train.seed) for r in range(DP)]
    lrs = torch_schedule(o.lr, o.min_lr, o.warmup_steps, steps)
    out = {"losses": [], "grad_norms": [], "val": []}
    for step in range(steps):
        loss = sum(local_gradients(m, samples, s, step, cfg) for m, s in zip(replicas, samplers))
        norms = [torch.nn.utils.get_total_norm([p.grad for p in m.parameters()]) for m in replicas]
        rms = torch.stack(norms).pow(2).mean().sqrt()
        if step == 0:
            out["grads"] = {n: p.grad.clone() for n, p in replicas[0].named_parameters()}
        coef = min(1.0, math.sqrt(DP) * o.grad_clip / (rms.item() + 1e-6)) if o.grad_clip else 1.0
        origin = [p.detach().clone() for p in replicas[0].parameters()]
        for m, opt in zip(replicas, optimizers):
            for p in m.parameters():
                p.grad.mul_(coef)
            for group in opt.param_groups:
                group["lr"] = lrs[step]
            opt.step()
        with torch.no_grad():
            for k, start in enumerate(origin):  # AdamW decays matrices only (build_adamw)
                keep = 1 - lrs[step] * (o.weight_decay if start.ndim >= 2 else 0.0)
                moved = [start * keep - list(m.parameters())[k] for m in replicas]
                for m in replicas:
                    list(m.parameters())[k].copy_(start * keep - sum(moved) / DP)
        out["losses"].append(loss)
        out["grad_norms"].append(rms.item())
    out["params"] = {n: p.detach().clone() for n, p in replicas[0].named_parameters()}
    return out


LAYOUTS = {"dp2": dict(nproc=2), "dp2 accumulation": dict(nproc=2, micro_batch=2),
           "dp2 tp2 sp": dict(nproc=4, dp=2, tp=2, sp=True),
           "dp2 pp2": dict(nproc=4, dp=2, pp=2, microbatches=2)}
CLIPS = {"no clipping": 0.0, "clipping": CLIP}
RESUMED = dict(nproc=2, lr=1e-3, steps=6, compress="topk:0.1:update", compress_start=1)


def test_averaging_adamw_updates_equals_plain_torch_and_resumes_exactly(tmp_path):
    """top-k 1.0 sends everything: the run is the reference's exactly, whatever the layout,
    with clipping active or not. And each rank's Adam moments are its own: a resumed run
    restores them with its residual and goes on exactly."""
    t = str(tmp_path)
    common = dict(eval_every=0, lr=1e-3, compress="topk:1.0:update")
    configs = {(clip, name): tiny_config(f"{t}/{clip}-{name}".replace(" ", "-"), grad_clip=value, **common, **layout)
               for clip, value in CLIPS.items() for name, layout in LAYOUTS.items()}
    two = {k: c for k, c in configs.items() if c.parallel.nproc == 2}
    two["full", "resumed"] = tiny_config(t + "/full", save_every=3, **RESUMED)
    # The resume in the saving world (one world fewer): its config is made there, after the save.
    two["resumed"] = after(t + "/resumed", resume=t + "/full/checkpoints/step-3", **RESUMED)
    runs = run_world(train_runs, 2, two)[0]
    runs.update(run_world(train_runs, 4, {k: c for k, c in configs.items() if c.parallel.nproc == 4})[0])
    assert_same_run(tail(runs.pop("resumed")), tail(runs.pop(("full", "resumed")), 3))
    for clip, value in CLIPS.items():
        want = reference_averaging_updates(tiny_config(t, nproc=2, grad_clip=value, **common))
        if value:
            assert min(want["grad_norms"]) > math.sqrt(DP) * value  # clipping acts at every step
        for name in LAYOUTS:
            assert_same_run({**runs[clip, name], "val": []}, want, what=f"{name}, {clip}")


def test_averaging_updates_is_refused_where_it_cannot_work(tmp_path):
    for overrides, match in [(dict(compress="topk:0.1:update", zero=1, tie_embeddings=False), "needs --zero 0"),
                             (dict(compress="powersgd:2:update", dp=2, cp=2, nproc=4), "needs --zero 0 and --cp 1"),
                             (dict(compress="fp16:update"), "only int8, topk and powersgd")]:
        with pytest.raises(ConfigError, match=match):
            tiny_config(str(tmp_path), **{"nproc": 2, **overrides})
    spec = Z.parse("topk:0.01:noef:update")
    assert spec.update and not spec.error_feedback and spec.text == "topk:0.01:update:noef"
