"""Domain parallelism: sharded layers equal the unsharded ones, forward and backward; the
U-Net trains under dp x domain exactly as on one process; what cannot work is refused."""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_world
from helpers import assert_same_run, torch_schedule, train_runs
from torch import nn

from paratrain.cli import main
from paratrain.layout import Layout, parse_domain
from paratrain.mesh import Mesh
from paratrain.models.unet import UNet
from paratrain.parallel.domain import DomainError, Grid, apply_domain_parallel
from paratrain.parallel.domain.halo import Halo, check_thickness
from paratrain.parallel.domain.layers import conv_halo
from paratrain.parallel.domain.measure import saved_activation_bytes
from paratrain.train.checkpoint import read_meta
from paratrain.train.config import ConfigError, load
from paratrain.train.data import DistributedSampler
from paratrain.train.heat2d import make_fields
from paratrain.train.rundir import RunDirLock, records_owner
from paratrain.train.task_heat2d import unet_config

TOL = dict(rtol=1e-5, atol=1e-5)

# (layout, layer, (H, W), padding mode): kernels 3 and 5, zero and circular padding, 2 and
# 4 ranks along one axis and a 2x2 grid, even and uneven blocks, strided down-sampling.
LAYER_CASES = {
    "h2-k3-zeros-even": (dict(dp=2, domh=2), ("conv", 3, 1), (16, 12), "zeros"),
    "h2-k5-circular-uneven": (dict(dp=2, domh=2), ("conv", 5, 1), (15, 10), "circular"),
    "w2-k3-circular-even": (dict(dp=2, domw=2), ("conv", 3, 1), (10, 16), "circular"),
    "h4-k3-circular-even": (dict(domh=4), ("conv", 3, 1), (16, 12), "circular"),
    "h4-k5-zeros-uneven": (dict(domh=4), ("conv", 5, 1), (18, 9), "zeros"),
    "2x2-k3-zeros-uneven": (dict(domh=2, domw=2), ("conv", 3, 1), (13, 11), "zeros"),
    "2x2-k5-circular-even": (dict(domh=2, domw=2), ("conv", 5, 1), (16, 16), "circular"),
    "2x2-k5-zeros-even": (dict(domh=2, domw=2), ("conv", 5, 1), (12, 16), "zeros"),
    "2x2-k3-circular-uneven": (dict(domh=2, domw=2), ("conv", 3, 1), (9, 11), "circular"),
    "2x2-down-k2s2": (dict(domh=2, domw=2), ("conv", 2, 2), (16, 16), "zeros"),
    "h4-down-k3s2": (dict(domh=4), ("conv", 3, 2), (16, 8), "zeros"),
    "2x2-down-k3s2-circular": (dict(domh=2, domw=2), ("conv", 3, 2), (16, 12), "circular"),
    "2x2-up-k2s2": (dict(domh=2, domw=2), ("up", 2, 2), (8, 8), "zeros"),
    "2x2-groupnorm-uneven": (dict(domh=2, domw=2), ("norm", 3, 0), (13, 11), "zeros"),
    "h4-groupnorm": (dict(domh=4), ("norm", 1, 0), (16, 8), "zeros"),
}


def _layer(kind: str, k: int, s: int, mode: str) -> nn.Module:
    if kind == "conv":
        return nn.Conv2d(3, 4, k, stride=s, padding=k // 2 if k % 2 else 0, padding_mode=mode)
    if kind == "up":
        return nn.ConvTranspose2d(3, 4, k, stride=s)
    return nn.GroupNorm(k, 3)


def _layer_check(layout_kw, spec, hw, mode) -> dict[str, float]:
    """Max error of output, input gradient and parameter gradients against the plain layer."""
    mesh = Mesh.build(Layout(**layout_kw))
    grid = Grid.from_mesh(mesh)
    torch.manual_seed(0)
    plain = _layer(*spec, mode)
    x = torch.randn(2, 3, *hw, requires_grad=True)
    ref = plain(x)
    probe = torch.randn_like(ref)
    (ref * probe).sum().backward()
    sharded = apply_domain_parallel(nn.Sequential(copy.deepcopy(plain)), grid)
    xl = grid.local(x.detach()).clone().requires_grad_()
    out = sharded(xl)
    (out * grid.local(probe)).sum().backward()
    errors = {"out": (out - grid.local(ref)).abs().max().item(),
              "dx": (xl.grad - grid.local(x.grad)).abs().max().item()}
    for (name, p), q in zip(sharded.named_parameters(), plain.parameters()):
        g = p.grad.clone()
        dist.all_reduce(g, group=grid.group)  # each block's share of the weight gradient
        errors[f"d{name}"] = ((g - q.grad).norm() / q.grad.norm()).item()  # summed over blocks: norm-wise
    return errors


def _memory_check() -> tuple[int, int]:
    """Saved bytes of a 3x3 convolution on one block of four over the height, and of the
    plain convolution on the whole input."""
    mesh = Mesh.build(Layout(domh=4))
    grid = Grid.from_mesh(mesh)
    conv = nn.Conv2d(3, 4, 3, padding=1)
    x = torch.randn(2, 3, 32, 8, requires_grad=True)
    _, whole = saved_activation_bytes(lambda: conv(x), conv.parameters())
    sharded = apply_domain_parallel(nn.Sequential(copy.deepcopy(conv)), grid)
    xl = grid.local(x.detach()).clone().requires_grad_()
    _, mine = saved_activation_bytes(lambda: sharded(xl), sharded.parameters())
    return whole, mine


def four_rank_checks(configs):
    errors = {name: _layer_check(*case) for name, case in LAYER_CASES.items()}
    return errors, _memory_check(), train_runs(configs)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("four"))
    configs = {"dp2 x dom2": heat_config(tmp, domain="2", nproc=4, boundary="zeros"),
               "dom2x2 zero1": heat_config(tmp, domain="2x2", zero=1)}  # ZeRO-1 over the grid
    return run_world(four_rank_checks, 4, configs, timeout_s=400)


@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_sharded_layer_equals_plain_layer(four_ranks, case):
    for rank, (errors, *_) in enumerate(four_ranks):
        for what, err in errors[case].items():
            assert err <= 1e-5, (case, rank, what, err)


def test_saved_activations_are_a_quarter_plus_the_halo_strips(four_ranks):
    # Per sample and channel (N=2, C=3, W=8 columns, fp32): the plain conv saves its 32 input
    # rows. A rank of four saves its 8 rows, plus the two 3-row windows its border strips are
    # computed from (1 halo row + 2 of its own rows each): 1/4 of the plain figure + 6 rows.
    row = 2 * 3 * 8 * 4
    for whole, mine in (m for _, m, _ in four_ranks):
        assert whole == 32 * row
        assert mine == whole // 4 + 6 * row


# ---- training parity: the U-Net on heat2d, against one process --------------------------

def heat_config(tmp: str, **overrides):
    base = dict(task="heat2d", grid_size=16, heat_samples=48, unet_width=8, unet_levels=1,
                steps=4, global_batch=4, warmup_steps=1, lr=3e-3, grad_clip=0.0, eval_every=2,
                progress=False, run_dir=tmp, bucket_mb=0.01)
    return load(None, {**base, **overrides}).validate()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Domain 2 (periodic), saving a checkpoint at step 2."""
    tmp = str(tmp_path_factory.mktemp("two"))
    cfg = heat_config(tmp, domain="2", save_every=2)
    zero3 = heat_config(tmp + "/z3", nproc=2, dp=2, zero=3, unet_levels=2, boundary="zeros")
    runs = run_world(train_runs, 2, {"dom2": cfg, "dp2 zero3 levels2": zero3})[0]
    return runs["dom2"], tmp, runs


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, two_ranks):
    """References for each boundary, and the domain-2 checkpoint resumed on one process."""
    tmp = str(tmp_path_factory.mktemp("one"))
    resume = f"{two_ranks[1]}/checkpoints/step-2"
    configs = {"circular": heat_config(tmp, nproc=1), "zeros": heat_config(tmp, nproc=1, boundary="zeros"),
               "resumed": heat_config(tmp, nproc=1, resume=resume),
               "levels2": heat_config(tmp + "/l2", nproc=1, unet_levels=2, boundary="zeros"),
               "observed": heat_config(tmp + "/observed", nproc=1, log="csv", profile="1:1")}
    results = run_world(train_runs, 1, configs)[0]
    results["observed"]["run_dir"] = tmp + "/observed"
    return results


def test_domain2_trains_like_one_process(two_ranks, one_rank):
    assert_same_run(two_ranks[0], one_rank["circular"])


def test_dp2_x_domain2_trains_like_one_process(four_ranks, one_rank):
    assert_same_run(four_ranks[0][2]["dp2 x dom2"], one_rank["zeros"])


def test_domain_2x2_with_zero1_trains_like_one_process(four_ranks, one_rank):
    assert_same_run(four_ranks[0][2]["dom2x2 zero1"], one_rank["circular"])


def plain_heat2d_run(cfg) -> dict:
    """What one process makes of the heat2d config with torch's pieces only: the U-Net,
    the mean squared error over the batch, AdamW (decay on kernels), the torch schedule.
    paratrain's one-process run is the reference of every domain parity test above, so
    this is what makes a wrong loss normaliser or gradient scale show."""
    torch.manual_seed(cfg.train.seed)
    model = UNet(unet_config(cfg))
    o, params = cfg.optim, list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    lrs = torch_schedule(o.lr, o.min_lr, o.warmup_steps, cfg.train.steps)
    train, val = make_fields(cfg.tasks["heat2d"], cfg.train.seed)
    sampler = DistributedSampler(len(train), cfg.train.global_batch, dp_rank=0, dp_size=1,
                                 seed=cfg.train.seed)
    out = {"losses": [], "grad_norms": [], "val": []}
    for step in range(cfg.train.steps):
        indices = sampler.global_indices(step)
        opt.zero_grad()
        loss = F.mse_loss(model(train.inputs[indices]), train.targets[indices])
        loss.backward()
        if step == 0:
            out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
        out["grad_norms"].append(torch.nn.utils.clip_grad_norm_(params, math.inf).item())
        for group in opt.param_groups:
            group["lr"] = lrs[step]
        opt.step()
        out["losses"].append(loss.item())
        if (step + 1) % cfg.train.eval_every == 0 or step + 1 == cfg.train.steps:
            with torch.no_grad():
                out["val"].append((step + 1, F.mse_loss(model(val.inputs), val.targets).item()))
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def test_one_process_heat2d_trains_as_plain_torch_does(one_rank, tmp_path):
    assert_same_run(one_rank["circular"], plain_heat2d_run(heat_config(str(tmp_path), nproc=1)))


def test_domain_checkpoints_name_their_run_so_it_resumes_into_its_directory(two_ranks):
    """Without its run's id in the index, every checkpoint of a heat2d run counted as
    another run's, and --resume auto into its own directory was refused."""
    tmp = two_ranks[1]
    newest = f"{tmp}/checkpoints/step-4"
    ids = [read_meta(p).get("run", {}).get("id") for p in (newest, f"{tmp}/checkpoints/step-2")]
    assert ids[0] == ids[1] is not None
    assert records_owner(tmp) == ids[0]  # and its records too (rank 0 writes run.json)
    RunDirLock(heat_config(tmp, domain="2", save_every=2, steps=6, resume=newest)).acquire().release()


def test_a_domain_checkpoint_is_not_exported_to_hugging_face(two_ranks, tmp_path, capsys):
    assert main(["export", f"{two_ranks[1]}/checkpoints/step-4", "--to", "hf",
                 "--out", str(tmp_path / "out")]) == 2
    assert "a checkpoint of a model other than paratrain's GPT" in capsys.readouterr().err


def test_domain_checkpoint_resumes_on_one_process(one_rank):
    losses, params = one_rank["resumed"]["losses"], one_rank["resumed"]["params"]
    ref_losses, ref_params = one_rank["circular"]["losses"], one_rank["circular"]["params"]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses[2:]), rtol=1e-5, atol=0)
    for name, ref in ref_params.items():
        torch.testing.assert_close(params[name], ref, rtol=1e-5, atol=1e-6)


# ---- the domain axes of Layout (pure rank math) -------------------------------------------

def test_domain_axes_are_two_ordinary_axes_varying_fastest():
    layout = Layout(dp=2, domh=2, domw=2)
    assert layout.world_size == 8 and layout.describe() == "dp2xdom2x2 (world 8)"
    assert layout.groups("domw") == [[0, 1], [2, 3], [4, 5], [6, 7]]  # row neighbours: consecutive
    assert layout.groups("domh") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("dom") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.groups("dp-dom") == [list(range(8))]
    assert set(Layout(dp=2, tp=2).coords(3)) == {"dp", "pp", "cp", "tp"}  # unchanged without one
    placed = Layout(dp=2, tp=2, domh=2, order="tp-domh-cp-pp-dp")
    assert placed.groups("domh") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert parse_domain("2x2") == (2, 2) and parse_domain(4) == (4, 1)


# ---- refusals, before any process starts ---------------------------------------------------

@pytest.mark.parametrize("overrides, words", [
    (dict(domain="3"), "not divisible by the 3 ranks over the height"),
    (dict(domain="2x3"), "not divisible by the 3 ranks over the width"),
    (dict(domain="4", unet_kernel=7), "thinner than the 3-row halo"),
    (dict(domain="2", tp=2, nproc=4), "dp and ZeRO only"),
    (dict(domain="2x", nproc=2), "give N"),
])
def test_bad_domain_layouts_are_refused(tmp_path, overrides, words):
    with pytest.raises(ConfigError, match=words):
        heat_config(str(tmp_path), **overrides)


def test_domain_needs_the_heat2d_task():
    with pytest.raises(ConfigError, match="needs --task heat2d"):
        load(None, {"domain": "2"}).validate()
    assert main(["train", "--task", "heat2d", "--domain", "3"]) == 2


def test_layers_refuse_what_would_compute_wrong():
    grid = Grid((2, 1), (0, 0), {}, None)
    with pytest.raises(DomainError, match="use fewer ranks"):
        check_thickness(torch.Size([1, 1, 1, 8]), grid, Halo(lo=(2, 0), hi=(2, 0)))
    with pytest.raises(DomainError, match="does not map blocks"):
        conv_halo(3, 2, 0)  # its outputs would not tile the plain layer's
    with pytest.raises(DomainError, match="batch norm"):
        apply_domain_parallel(nn.Sequential(nn.BatchNorm2d(3)), grid)
    with pytest.raises(DomainError, match="kernel = stride"):
        apply_domain_parallel(nn.Sequential(nn.ConvTranspose2d(3, 3, 3, stride=2)), grid)


def test_a_nan_loss_stops_or_skips_the_heat2d_task_as_it_does_the_language_model(tmp_path):
    """Before, the U-Net task applied NaN updates, logged null losses and exited 0."""
    import json

    from paratrain.launch import RankFailed

    blow_up = dict(lr=1e6, warmup_steps=0, steps=4, eval_every=0, nproc=1)
    skip = heat_config(str(tmp_path / "skip"), on_nonfinite="skip", max_skips=8, **blow_up)
    stop = heat_config(str(tmp_path / "stop"), **blow_up)
    with pytest.raises(RankFailed, match=r"NonFiniteError: non-finite loss nan.* at step 2"):
        run_world(train_runs, 1, {"skip": skip, "stop": stop})
    skipped = [json.loads(line) for line in (tmp_path / "skip" / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("skipped") for r in skipped] == [None, 1, 2, 3]
    stopped = (tmp_path / "stop" / "metrics.jsonl").read_text().splitlines()
    assert len(stopped) == 2  # the bad step is logged, and nothing after it


def test_heat2d_runs_in_the_one_loop_with_its_sinks_profiler_and_peak_memory(one_rank):
    """The task is a plug-in of the language model's loop, so what the loop gives one task
    it gives every task (heat2d's own loop had neither sinks, a profiler nor peak memory)."""
    import json
    from pathlib import Path

    run = Path(one_rank["observed"]["run_dir"])
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert (run / "metrics.csv").read_text().count("\n") == len(records) + 1  # a header, a row a step
    assert (run / "profile-rank0.json").is_file()
    assert records[-1]["peak_mem_bytes"] and records[-1]["mfu"] is None  # convolutions: no MFU


@pytest.mark.parametrize("setting, named", [
    (dict(seq_len=100000), "--seq-len"),
    (dict(schedule="gpipe"), "--schedule"), (dict(n_layers=4), "[model] fields"),
    (dict(eval_batches=3), "--eval-batches")])
def test_heat2d_refuses_language_model_settings_it_would_ignore(tmp_path, setting, named):
    """They ran silently or were refused for the wrong reason (a corpus too short for
    --seq-len, which the task never reads)."""
    from paratrain.train import preflight

    with pytest.raises(ConfigError, match=rf"{re.escape(named)}.*does not use"):
        heat_config(str(tmp_path), **setting)
    preflight.check_data(heat_config(str(tmp_path)))  # reads no corpus
    with pytest.raises(ConfigError, match="records a pipeline's schedule"):
        load(None, {"timeline": True}).validate()


def test_zero3_prefetches_in_the_order_the_unet_runs(two_ranks, one_rank):
    """A two-level U-Net registers down0, down1, enc0, enc1, up0, up1, dec0, dec1 and runs
    down0, enc0, down1, enc1, up1, dec1, up0, dec0: ZeRO-3 prefetches by the order the
    first forward ran. By registration order it gathered units already done and freed
    them under the pending gather, and the second forward read freed storage."""
    assert_same_run(two_ranks[2]["dp2 zero3 levels2"], one_rank["levels2"])
