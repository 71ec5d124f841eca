"""Data parallelism: parity with one process, with torch DDP, and real overlap."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from distributed import run_world
from paratrain.layout import Layout
from paratrain.mesh import Mesh
from paratrain.models.gpt import GPT, PRESETS
from paratrain.parallel.data import DataParallel
from paratrain.train.config import load
from paratrain.train.loop import train

RTOL = 1e-5


def tiny_config(tmp_dir: str, **overrides):
    base = dict(preset="tiny", seq_len=32, global_batch=8, steps=4, warmup_steps=2, lr=3e-3,
                grad_clip=0.5, eval_every=2, eval_batches=1, progress=False,
                run_dir=tmp_dir, bucket_mb=0.05)
    return load(None, {**base, **overrides}).validate()


def train_runs(configs):
    """Train each config in turn inside one world (worlds are slow to start)."""
    results = []
    for cfg in configs:
        result = train(cfg, Mesh.build(cfg.layout), keep_params=True)
        results.append((result.losses, result.val_losses, result.params if dist.get_rank() == 0 else None))
    return results


def assert_same_run(got, want):
    losses, val, params = got
    ref_losses, ref_val, ref_params = want
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=0)
    torch.testing.assert_close(torch.tensor([v for _, v in val]), torch.tensor([v for _, v in ref_val]),
                               rtol=RTOL, atol=0)
    for name, ref in ref_params.items():
        assert rel_error(params[name], ref) <= RTOL, (name, rel_error(params[name], ref))


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Norm-wise relative error of a tensor. Element-wise error is ill-conditioned for
    parameters: Adam divides by sqrt(v) + eps, so an entry whose gradient is near eps turns
    a last-bit difference in summation order into a visible one."""
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A corpus of 9 samples of 32 tokens: with global batch 4 the third step of each epoch
    is one real sample and three padding rows."""
    path = tmp_path_factory.mktemp("corpus") / "small.txt"
    path.write_bytes(bytes(range(32, 127)) * 4)  # 380 bytes -> 9 train samples after the split
    return str(path)


def variants(tmp: str, nproc: int, corpus: str):
    return [
        tiny_config(tmp, nproc=nproc),
        tiny_config(tmp, nproc=nproc, micro_batch=8 // nproc // 2),  # 2-step accumulation
        tiny_config(tmp, nproc=nproc, recompute="full"),  # recomputation changes no number
        tiny_config(tmp, nproc=nproc, corpus=corpus, remainder="pad", global_batch=4,
                    val_fraction=0.2, steps=4),  # crosses a padded, masked batch
    ]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus):
    tmp = str(tmp_path_factory.mktemp("ref"))
    return [r for i, r in enumerate(run_world(train_runs, 1, variants(tmp, 1, corpus))[0]) if i != 2]


@pytest.mark.parametrize("nproc", [2, 4])
def test_ddp_matches_single_process(nproc, reference, tmp_path, corpus):
    results = run_world(train_runs, nproc, variants(str(tmp_path), nproc, corpus))
    want = [reference[0], reference[1], reference[0], reference[2]]  # recompute == plain
    for got, ref in zip(results[0], want):
        assert_same_run(got, ref)
    # every replica ends with the same weights; losses are identical on every rank
    for rank_result in results[1:]:
        assert [r[0] for r in rank_result] == [r[0] for r in results[0]]


def ddp_checks():
    """Against torch DDP on the same inputs, including no_sync accumulation; and overlap."""
    rank = dist.get_rank()
    mesh = Mesh.build(Layout(dp=2))
    torch.manual_seed(0)
    model = GPT(PRESETS["tiny"])
    ours = DataParallel(copy.deepcopy(model), mesh.group("dp"), bucket_mb=0.05)
    theirs = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    torch.manual_seed(1 + rank)  # different data on each rank
    batches = [torch.randint(0, 256, (2, 32)) for _ in range(3)]

    # overlap: record when buckets launch relative to the first layer's gradients
    events = []
    launch = ours.start_grad_sync


    def record_launch(bucket):
        if bucket.work is None:  # finish_grad_sync re-calls it for launched buckets: no-ops
            events.append("launch")
        launch(bucket)

    ours.start_grad_sync = record_launch
    for p in ours.module.layers[0].parameters():
        p.register_post_accumulate_grad_hook(lambda p: events.append("layer0"))

    for i, x in enumerate(batches):  # two microbatches under no_sync, the last one synced
        last = i == len(batches) - 1
        if last:
            events.clear()  # only the synced backward communicates
        with (ours.no_sync() if not last else torch.enable_grad()):
            (ours(x, x) / x.numel()).backward()
        with (theirs.no_sync() if not last else torch.enable_grad()):
            (theirs(x, x) / x.numel()).backward()
    ours.finish_grad_sync()
    grads = {n: p.grad for n, p in ours.module.named_parameters()}
    for name, p in theirs.module.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-6, atol=1e-8, msg=name)
    return events, len(ours.buckets)


def test_gradients_equal_torch_ddp_and_overlap_backward():
    for events, n_buckets in run_world(ddp_checks, 2):
        assert n_buckets > 2
        assert events.count("launch") == n_buckets
        # the first bucket (last layers) is reduced while layer 0's gradients are pending
        assert events.index("launch") < events.index("layer0")
