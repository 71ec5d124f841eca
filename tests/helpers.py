"""Shared test helpers: tiny loop configs, training inside one spawned world, and the
comparisons every parity test makes (losses, per-step gradient norm, first-step gradients,
final parameters, replicas).

Parity runs have gradient clipping OFF (``grad_clip=0``): clipping rescales a wrong gradient
magnitude back to the threshold, and AdamW is nearly invariant to a constant gradient scale,
so a wrong loss scale or a sum instead of an average shows only in the gradients and their
norm. That is why ``assert_same_run`` compares those too.
"""

from __future__ import annotations

import functools
import gc
import json
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR
from torch.utils._pytree import tree_flatten

from paratrain.comm import collectives as C
from paratrain.mesh import Mesh
from paratrain.parallel.engine import drop_copy, merge_stages
from paratrain.train.config import Config, load

RTOL = 1e-5


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Norm-wise relative error of a tensor. Element-wise error is ill-conditioned for
    parameters: Adam divides by sqrt(v) + eps, so an entry whose gradient is near eps turns
    a last-bit difference in summation order into a visible one."""
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


def tiny_config(tmp_dir: str, **overrides) -> Config:
    """The tiny preset on the bundled corpus, 4 steps, clipping off (see the module doc)."""
    base = dict(preset="tiny", seq_len=32, global_batch=8, steps=4, warmup_steps=2, lr=3e-3,
                grad_clip=0.0, eval_every=2, eval_batches=1, progress=False,
                run_dir=tmp_dir, bucket_mb=0.05)
    return load(None, {**base, **overrides}).validate()


def torch_schedule(lr: float, min_lr: float, warmup: int, total: int) -> list[float]:
    """Linear warm-up from lr/warmup to lr over ``warmup`` steps, then cosine annealing to
    min_lr over the remaining steps: the learning rate in force at each step."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    cosine = CosineAnnealingLR(opt, T_max=max(1, total - warmup), eta_min=min_lr)
    if warmup:  # (one warm-up step is the full rate already: a constant factor 1)
        warm = LinearLR(opt, start_factor=1 / warmup, end_factor=1.0, total_iters=max(1, warmup - 1))
        sched = SequentialLR(opt, [warm, cosine], milestones=[warmup])
    else:
        sched = cosine
    out = []
    for _ in range(total):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out



# ---- inside a rank ---------------------------------------------------------------------------

@torch.no_grad()
def full_grads(engine) -> dict[str, torch.Tensor]:
    """The engine's current gradients, unsharded, under the plain model's names (collective:
    every rank calls it). Reads engine internals on purpose: this is an oracle's view."""
    tp = getattr(engine, "tp", None)
    ep = getattr(engine, "ep", None) or getattr(engine, "expert", None)
    experts = {n for n, p in engine.module.named_parameters() if ep is not None and ep.is_expert(p)}
    if hasattr(engine, "units"):  # ZeRO: each rank holds its slice of every unit's gradient
        local = {}
        for unit in engine.units:
            full = unit.grad_shard.new_empty(unit.flat.padded)
            C.all_gather(full, unit.grad_shard.contiguous(), engine._group_of(unit))
            for name, view in zip(unit.flat.names, unit.flat.copy_out(full)):
                local[name] = view.float().clone()
        if tp is not None:
            local = tp.full_state_dict(engine.module, local=local)
    elif tp is not None:
        local = {k: v.float() for k, v in tp.full_state_dict(engine.module, grads=True).items()}
    else:
        local = {n: p.grad.detach().float().clone()
                 for n, p in engine.module.named_parameters() if p.grad is not None}
    frozen = {n for n, p in engine.module.named_parameters() if not p.requires_grad}
    local = {n: ep.gather(g) if n in experts else g  # experts: all ep ranks'
             for n, g in local.items() if n not in frozen}
    return {k: v.cpu() for k, v in drop_copy(merge_stages(local, engine.pp_group), engine.plan).items()}


def _recording(box: dict):
    """A stand-in for the loop's ``build`` (any task) that makes the engine record, at every
    clip call, the global gradient norm, and at the first one the unsharded gradients
    (before clipping)."""
    from paratrain.train import loop

    original = loop.build

    def build(cfg, mesh):
        run = original(cfg, mesh)
        _record_clips(run.engine, box)
        return run

    def install(on: bool) -> None:
        loop.build = build if on else original

    return install


def _record_clips(engine, box: dict):
    clip = engine.clip_grad_norm_

    def clip_and_record(max_norm: float) -> float:
        if "grads" not in box:
            box["grads"] = full_grads(engine)
        norm = clip(max_norm)
        box["grad_norms"].append(float(norm))
        return norm

    engine.clip_grad_norm_ = clip_and_record
    return engine


def train_one(cfg: Config) -> dict:
    """Train ``cfg`` on this rank's mesh; what the parity checks compare, from this rank."""
    box: dict = {"grad_norms": []}
    from paratrain.train import loop

    install = _recording(box)
    install(True)
    try:
        result = loop.train(cfg, Mesh.build(cfg.layout), keep_params=True)
    finally:
        install(False)
    return {"losses": result.losses, "val": result.val_losses, "grad_norms": box["grad_norms"],
            "grads": box.get("grads", {}), "params": result.params,
            "state_bytes": result.state_bytes, "rank": dist.get_rank(), "compile_s": result.compile_s}


def after(tmp_dir: str, **overrides) -> functools.partial:
    """A ``tiny_config`` made inside the world when its turn comes in ``train_runs``: one
    that resumes from a checkpoint that an earlier run of the same world saves (validation
    reads the checkpoint, so the config cannot be made before the world starts)."""
    return functools.partial(tiny_config, tmp_dir, **overrides)


def train_runs(configs: dict[str, Config | functools.partial]) -> dict[str, dict]:
    """Train each named config in turn inside one world (worlds are slow to start). Each
    result also says how many bytes of tensors the finished run left alive."""
    results: dict[str, dict] = {}
    _frozen_tensors()  # before the first run: its leak check then scans only what runs made
    for name, cfg in configs.items():
        if callable(cfg):  # ``after``: made once every rank is done with the earlier runs' saves
            dist.barrier()
            cfg = cfg()
        results[name] = train_one(cfg)
        results[name]["leaked_bytes"] = leaked_bytes(list(results.values()))
    return results


LEAK_SLACK = 1024
"""Bytes a finished run may leave: a few 8-byte results of gloo's last all-gathers."""


@functools.cache
def _frozen_tensors() -> tuple[weakref.ref, ...]:
    """Once per process: collect, then move every object alive (torch's and the launcher's
    state, what earlier runs left) out of the collector's sight (``gc.freeze``, itself
    process-wide). Each later leak check then collects and scans only what was made
    since: a few milliseconds, not 0.2 s a run. Returns the tensors among the frozen
    objects, weakly: they are still counted while they live, so the count is the same as
    without freezing."""
    gc.collect()
    refs = tuple(weakref.ref(t) for t in gc.get_objects() if isinstance(t, torch.Tensor))
    gc.freeze()
    return refs


def _alive_tensors() -> list[torch.Tensor]:
    frozen = [t for t in (ref() for ref in _frozen_tensors()) if t is not None]
    return frozen + [t for t in gc.get_objects() if isinstance(t, torch.Tensor)]


def leaked_bytes(kept: list[dict], patience_s: float = 2.0) -> int:
    """Bytes of the tensors alive after a run that the results ``kept`` do not hold: a
    finished run frees everything it allocated (tests/test_leaks.py). gloo's threads drop
    a finished collective's buffers a moment after its ``wait`` returns (once, 64 KiB of
    a ZeRO-3 gather in CI), so a count over the slack is taken again for ``patience_s``:
    a leak stays, a buffer in flight goes."""
    deadline = time.monotonic() + patience_s
    _frozen_tensors()
    while True:
        gc.collect()
        held = {t.untyped_storage().data_ptr() for result in kept
                for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)}
        alive = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                 for t in _alive_tensors() if not t.is_meta}
        left = sum(n for ptr, n in alive.items() if ptr not in held)
        if left < LEAK_SLACK or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


# ---- in the test process ----------------------------------------------------------------------

def assert_close_list(got: list[float], want: list[float], rtol: float, what: str) -> None:
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64),
                               torch.tensor(want, dtype=torch.float64), rtol=rtol, atol=0, msg=what)


def assert_tensors_close(got: dict, want: dict, rtol: float, what: str) -> None:
    assert got.keys() == want.keys(), (what, sorted(set(got) ^ set(want)))
    if not want:
        return
    errors = {name: rel_error(got[name], ref) for name, ref in want.items()}
    worst = max(errors.items(), key=lambda kv: kv[1])
    assert worst[1] <= rtol, f"{what}: {worst[0]} is {worst[1]:.2e} away (tolerance {rtol:.0e})"


def assert_same_run(got: dict, want: dict, rtol: float = RTOL, what: str = "") -> None:
    """Losses, validation losses, per-step gradient norms, first-step gradients and final
    parameters all within ``rtol`` (norm-wise for tensors)."""
    assert_close_list(got["losses"], want["losses"], rtol, f"{what} losses")
    assert [s for s, _ in got["val"]] == [s for s, _ in want["val"]], what
    assert_close_list([v for _, v in got["val"]], [v for _, v in want["val"]], rtol, f"{what} val")
    assert_close_list(got["grad_norms"], want["grad_norms"], rtol, f"{what} grad norms")
    assert_tensors_close(got["grads"], want["grads"], rtol, f"{what} first-step gradients")
    assert_tensors_close(got["params"], want["params"], rtol, f"{what} parameters")
    assert got.get("leaked_bytes", 0) < LEAK_SLACK, f"{what}: {got['leaked_bytes']} bytes outlived the run"


def assert_bf16_close(got: dict, want: dict, lr: float, steps: int, what: str,
                      rounded: bool = False) -> None:
    """Two bf16 runs of the same training that differ only in how gradients are summed
    (over ranks or in one process).

    The tolerance follows from bf16's unit roundoff u = 2**-8 (8 significant bits):
    - gradients: the same forward (rows are independent), but one process rounds the whole
      batch's weight gradient x^T dy to bf16 once, while dp ranks each round their part and
      then add: two roundings, so within 2u (norm-wise; the same for the global norm);
    - parameters: Adam's step lr * m / sqrt(v) is scale-free, so a relative gradient
      perturbation of 2u moves each entry's step by about 2u * lr; over ``steps`` steps
      (lr never above its peak) the norm-wise drift is at most steps * 2u * lr * sqrt(N),
      relative to the parameter's norm;
    - losses: computed the same way on parameters that drifted as above; their relative
      error stays below one rounding, u.
    - ``rounded``: the parameters compared are bf16 weights, each run's masters rounded; two
      masters a hair apart can round to neighbouring bf16 values: one more rounding, u.
    A run whose bf16 weights never change, or whose gradients are scaled wrong, is off by
    far more (the loss falls by > 0.5 over these steps, a scale error is >= 2x)."""
    u = 2.0 ** -8
    assert_close_list(got["losses"], want["losses"], u, f"{what} losses")
    assert_close_list(got["grad_norms"], want["grad_norms"], 2 * u, f"{what} grad norms")
    assert_tensors_close(got["grads"], want["grads"], 2 * u, f"{what} first-step gradients")
    assert got["params"].keys() == want["params"].keys()
    for name, w in want["params"].items():
        tol = steps * 2 * u * lr * w.numel() ** 0.5 / w.float().norm().item() + (u if rounded else 0)
        assert_tensors_close({name: got["params"][name]}, {name: w}, tol, f"{what} parameters")


def tail(run: dict, since: int = 0) -> dict:
    """The part of a run after ``since`` steps: its later losses, validation losses and
    gradient norms, and its final parameters. (First-step gradients are left out: a resumed
    run's first step is the reference's step ``since + 1``.)"""
    return {"losses": run["losses"][since:], "val": [v for v in run["val"] if v[0] > since],
            "grad_norms": run["grad_norms"][since:], "grads": {}, "params": run["params"]}


def assert_identical_runs(got: dict, want: dict, what: str = "") -> None:
    """Bit-for-bit the same run (where the arithmetic is the same, e.g. recompute vs none)."""
    for key in ("losses", "val", "grad_norms"):
        assert got[key] == want[key], (what, key)
    for key in ("grads", "params"):
        assert got[key].keys() == want[key].keys(), (what, key)
        for name, ref in want[key].items():
            assert torch.equal(got[key][name], ref), (what, key, name)


def assert_replicas_equal(per_rank: list[dict], name: str) -> None:
    """Every rank ends with bit-identical weights: data- and context-parallel replicas hold
    the same parameters (each rank's full_state_dict is built from its own replica)."""
    first = per_rank[0][name]["params"]
    for rank_results in per_rank[1:]:
        params = rank_results[name]["params"]
        for key, ref in first.items():
            assert torch.equal(params[key], ref), (name, "rank", rank_results[name]["rank"], key)


def plan(*argv: str) -> int:
    """``paratrain plan ARGV`` in this process; returns its exit code."""
    import argparse

    from paratrain.plan import cli

    parser = argparse.ArgumentParser(prog="paratrain")
    cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["plan", *argv])
    return args.func(args)


TINY = ["--model", "tiny", "--seq-len", "32", "--eval-every", "0", "--no-progress", "--nproc", "2"]
"""CLI flags of a tiny, quick two-process run."""

LONG_STEPS = 300
"""Long enough that a signal sent at step 2-12 arrives before the end (tiny's steps take
milliseconds: at 24 a fast machine finished before the launcher passed it on)."""
LONG_RUN = [*TINY, "--steps", str(LONG_STEPS), "--save-every", str(LONG_STEPS), "--global-batch", "8"]
"""The run that test_preempt and test_slurm interrupt; its uninterrupted end is conftest's
``uninterrupted`` fixture."""


def final_files(run_dir: Path) -> dict:
    """The files (bytes, hash) of ``LONG_RUN``'s final checkpoint in ``run_dir``."""
    return json.loads((Path(run_dir) / "checkpoints" / f"step-{LONG_STEPS}" / "meta.json").read_text())["files"]


def strict_json(path: Path) -> list[dict]:
    """The JSON lines of ``path``, refusing NaN and Infinity (which strict JSON rejects)."""
    def refuse(token):
        raise AssertionError(f"{path} holds {token}, which strict JSON rejects")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def tiny_bpe(path: Path) -> Path:
    """A byte-level BPE tokenizer of 200 tokens (<unk>, <s>, </s> special), trained here on
    one sentence and saved as ``path`` (a tokenizer.json): no download, under a second."""
    from tokenizers import Tokenizer, models as tok_models, pre_tokenizers, trainers

    tok = Tokenizer(tok_models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["the cat sat on the mat"] * 20, trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))
    return path
