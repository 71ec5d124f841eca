"""Context parallelism (ring attention, Ulysses): parity with full attention and with
single-process training; saved activations fall as 1/cp.

One spawned world per cp size checks many cases: starting a world costs seconds.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from distributed import run_world
from paratrain.comm import collectives as C
from paratrain.layout import Layout
from paratrain.mesh import Mesh
from paratrain.models.gpt import GPT, IGNORE_INDEX, preset
from paratrain.parallel import context as cp_mod
from paratrain.parallel.context import (RingAttention, UlyssesAttention, apply_context_parallel,
                                        gather_sequence, positions_for, shard_batch,
                                        shard_sequence, unshard_sequence)
from paratrain.parallel.context import blocks, ring
from paratrain.parallel.data import DataParallel

RTOL = 1e-5
# (seq_len, heads, kv_heads): lengths 64 to 512, grouped and plain KV heads; every case
# divides by 4 so Ulysses runs it at cp=2 and cp=4.
CASES = [(64, 8, 4), (128, 4, 4), (512, 8, 4)]
RING_ONLY = [(128, 4, 1)]  # multi-query: one KV head, which Ulysses cannot split
# Attention cores by test name: ring with its default block kernel (fused flash on CPU)
# and with the plain-math one, and Ulysses.
CORES = {"ring": RingAttention, "ring-math": lambda group: RingAttention(group, kernel="math"),
         "ulysses": UlyssesAttention}


# ---- pure: the layout and the block schedule -----------------------------------------------

@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_shard_positions_and_unshard(cp):
    seq = 8 * cp
    x = torch.arange(2 * seq).view(2, seq)
    shards = [shard_sequence(x, r, cp) for r in range(cp)]
    assert torch.equal(unshard_sequence(shards), x)
    c = seq // (2 * cp)
    for r, shard in enumerate(shards):
        pos = positions_for(r, cp, seq)
        assert torch.equal(shard[0], pos)  # row 0 of x is 0..seq-1: shard == its positions
        assert pos.tolist() == [*range(r * c, (r + 1) * c),
                                *range((2 * cp - 1 - r) * c, (2 * cp - r) * c)]
    with pytest.raises(ValueError, match="multiple of"):
        shard_sequence(torch.zeros(1, 2 * cp + 1), 0, cp)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_blocks_cover_the_causal_mask_once_with_equal_work(cp):
    """Over all (query rank, K/V rank) pairs, the computed blocks cover every causal
    (query, key) pair exactly once and nothing above the diagonal; each rank computes the
    same number of scores."""
    seq, n = 8 * cp, 8
    cover = torch.zeros(seq, seq, dtype=torch.int64)
    work = []
    for r in range(cp):
        q_pos, done = positions_for(r, cp, seq), 0
        for j in range(cp):
            blk = ring.block_for(r, j, n)
            qp, kp = q_pos[blk.rows], positions_for(j, cp, seq)[blk.cols]
            allowed = qp[:, None] >= kp[None, :]
            # a non-causal block must be entirely below the diagonal
            assert blk.causal or allowed.all(), (r, j)
            mask = allowed if blk.causal else torch.ones_like(allowed)
            cover[qp[:, None].expand_as(mask)[mask], kp[None, :].expand_as(mask)[mask]] += 1
            done += mask.numel()
        work.append(done)
    assert torch.equal(cover, torch.ones(seq, seq, dtype=torch.int64).tril())
    assert len(set(work)) == 1, work


# ---- multiprocess: attention parity --------------------------------------------------------

def full_attention(q, k, v, dout):
    """Output and input gradients of plain causal attention on the whole sequence."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1),
                                         v.repeat_interleave(rep, 1), is_causal=True)
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


def mismatch(got: torch.Tensor, want: torch.Tensor) -> str | None:
    """None if got equals want to rtol 1e-5 element-wise and norm-wise. The absolute
    floor, 1e-5 of the tensor's largest entry, covers entries that are sums cancelling to
    ~0: there even SDPA's own fp32 result is ~1e-6 off the float64 one."""
    norm_err = ((got - want).norm() / want.norm()).item()
    try:
        torch.testing.assert_close(got, want, rtol=RTOL, atol=RTOL * want.abs().max().item())
    except AssertionError as exc:
        return f"norm-wise {norm_err:.1e}; {exc}"
    return None if norm_err <= RTOL else f"norm-wise {norm_err:.1e}"


def attention_checks(cases, methods) -> list[str]:
    """Every (case, method) on the world as one cp group; returns the failures."""
    group, r, p = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    failures = []
    for seq, heads, kv_heads in cases:
        gen = torch.Generator().manual_seed(seq + heads + kv_heads)
        q, dout = (torch.randn(2, heads, seq, 16, generator=gen) for _ in range(2))
        k, v = (torch.randn(2, kv_heads, seq, 16, generator=gen) for _ in range(2))
        want = full_attention(q, k, v, dout)
        for method in methods:
            local = [shard_sequence(t, r, p, dim=2).requires_grad_() for t in (q, k, v)]
            out = CORES[method](group)(*local)
            out.backward(shard_sequence(dout, r, p, dim=2))
            got = [out.detach()] + [t.grad for t in local]
            for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
                problem = mismatch(gather_sequence(g, group, dim=2), w)
                if problem:
                    failures.append(f"{method} cp={p} seq={seq} heads={heads}/{kv_heads} {name}: {problem}")
    return failures


def overlap_order() -> list[str]:
    """The order of ring P2P posts and block computations in forward and backward."""
    events = []
    math = blocks.KERNELS["math"]
    recording = blocks.BlockKernel("recording",
                                   lambda *a: events.append("compute") or math.forward(*a),
                                   lambda *a: events.append("compute") or math.backward(*a))
    rotate = ring.rotate
    ring.rotate = lambda *a: events.append("post") or rotate(*a)
    try:
        x = [torch.randn(1, 2, 8, 4, requires_grad=True) for _ in range(3)]
        RingAttention(dist.group.WORLD, kernel=recording)(*x).sum().backward()
    finally:
        ring.rotate = rotate
    return events


def ulysses_rejects(heads: int, kv_heads: int) -> str:
    model = GPT(preset("tiny", n_heads=heads, n_kv_heads=kv_heads, d_model=16 * heads))
    try:
        apply_context_parallel(model, dist.group.WORLD, "ulysses")
    except ValueError as exc:
        return str(exc)
    return "no error"


# ---- multiprocess: training parity ---------------------------------------------------------

def make_batches(steps: int, batch: int, seq: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    batches = []
    for _ in range(steps):
        data = torch.randint(0, 256, (batch, seq + 1), generator=gen)
        targets = data[:, 1:].clone()
        targets[-1, -5:] = IGNORE_INDEX  # padding: the loss counts valid tokens only
        batches.append((data[:, :-1], targets))
    return batches


def reference_run(model: GPT, batches, lr: float) -> tuple[list[float], dict, dict]:
    """Single-process training on the full batches (run on each rank, no communication)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, grads = [], None
    for tokens, targets in batches:
        opt.zero_grad()
        loss = model(tokens, targets) / (targets != IGNORE_INDEX).sum()
        loss.backward()
        grads = grads or {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        losses.append(loss.item())
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def cp_run(model: GPT, mesh: Mesh, method: str, batches, lr: float) -> tuple[list[float], dict, dict]:
    """The same training under the mesh's dp x cp: each rank its rows and sequence shard."""
    dp, cp = mesh.size("dp"), mesh.size("cp")
    apply_context_parallel(model, mesh.group("cp"), method)
    ddp = DataParallel(model, mesh.group("dp-cp"), bucket_mb=0.05)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, grads = [], None
    for tokens, targets in batches:
        rows = slice(mesh.coord("dp") * len(tokens) // dp, (mesh.coord("dp") + 1) * len(tokens) // dp)
        local = shard_batch(tokens[rows], targets[rows], mesh.coord("cp"), cp)
        global_tokens = (targets != IGNORE_INDEX).sum()
        ddp.zero_grad()
        loss_sum = ddp(*local)
        # DataParallel averages over dp*cp ranks: scaling by dp*cp makes it the global mean.
        (loss_sum * (dp * cp / global_tokens)).backward()
        ddp.finish_grad_sync()
        grads = grads or {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        total = loss_sum.detach().clone()
        C.all_reduce(total, mesh.group("dp-cp"))
        losses.append((total / global_tokens).item())
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def training_parity(layout: Layout, method: str, steps: int = 3, seq: int = 32,
                    batch: int = 4, lr: float = 1e-3) -> dict:
    """Per-step losses of both runs and the norm-wise error of each final parameter.

    The gradients differ from the single process only in summation order (each cp rank
    sums its tokens, then the ranks are summed). AdamW's first steps move every entry by
    about ±lr whatever its gradient's size, so an entry whose gradient is at rounding level
    can move the other way: the parameter error grows with lr (measured: gradients agree to
    ~4e-7 norm-wise; parameters to <= 3.5e-6 at lr 1e-3 but up to 9e-6 at 3e-3), hence the
    smaller lr."""
    mesh = Mesh.build(layout)
    torch.manual_seed(0)
    model = GPT(preset("tiny", max_seq_len=seq))
    batches = make_batches(steps, batch, seq)
    want_losses, want_grads, want = reference_run(copy.deepcopy(model), batches, lr)
    got_losses, got_grads, got = cp_run(model, mesh, method, batches, lr)
    errors = {n: ((got[n] - w).norm() / w.norm()).item() for n, w in want.items()}
    grad_problems = {n: mismatch(got_grads[n], w) for n, w in want_grads.items()}
    return {"what": f"{method} {layout.describe()}", "losses": got_losses,
            "want_losses": want_losses, "param_errors": errors,
            "grad_problems": {n: m for n, m in grad_problems.items() if m}}


def check_training(result: dict) -> None:
    assert result["grad_problems"] == {}, result["what"]  # first step's reduced gradients
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(result["want_losses"]),
                               rtol=RTOL, atol=0, msg=result["what"])
    worst = max(result["param_errors"].items(), key=lambda kv: kv[1])
    assert worst[1] <= RTOL, (result["what"], worst)


# ---- multiprocess: memory ------------------------------------------------------------------

def saved_bytes(core, q, k, v) -> int:
    """Bytes of the distinct storages autograd saves for backward in one call of ``core``."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        core(q, k, v)
    return sum(storages.values())


def saved_bytes_by_cp(seq: int = 256) -> dict[tuple[str, int], int]:
    """Saved bytes of each method at cp = 1, 2, 4 (cp groups of three meshes of one world)."""
    meshes = [Mesh.build(Layout(dp=4)), Mesh.build(Layout(dp=2, cp=2)), Mesh.build(Layout(cp=4))]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, seq, 16, generator=gen)
    k, v = (torch.randn(2, 4, seq, 16, generator=gen) for _ in range(2))
    result = {}
    for mesh in meshes:
        group, p = mesh.group("cp"), mesh.size("cp")
        for method in ("ring", "ulysses"):
            local = [shard_sequence(t, mesh.coord("cp"), p, dim=2).requires_grad_() for t in (q, k, v)]
            result[(method, p)] = saved_bytes(cp_mod.METHODS[method](group), *local)
    return result


# ---- the worlds ----------------------------------------------------------------------------

def world_of_two() -> dict:
    return {
        "attention": (attention_checks(CASES, ["ring", "ring-math", "ulysses"])
                      + attention_checks(RING_ONLY, ["ring", "ring-math"])),
        "overlap": overlap_order(),
        "ulysses_error": ulysses_rejects(heads=6, kv_heads=3),
        "training": [training_parity(Layout(cp=2), "ring"),
                     training_parity(Layout(cp=2), "ulysses")],
    }


def world_of_four() -> dict:
    return {
        "attention": (attention_checks(CASES, ["ring", "ring-math", "ulysses"])
                      + attention_checks(RING_ONLY, ["ring", "ring-math"])),
        "training": [training_parity(Layout(cp=4), "ring"),
                     training_parity(Layout(dp=2, cp=2), "ring"),
                     training_parity(Layout(dp=2, cp=2), "ulysses")],
        "memory": saved_bytes_by_cp(),
    }


@pytest.fixture(scope="module")
def two():
    return run_world(world_of_two, 2)


@pytest.fixture(scope="module")
def four():
    return run_world(world_of_four, 4)


def test_attention_equals_full_attention_cp2(two):
    for rank_result in two:
        assert rank_result["attention"] == []


def test_attention_equals_full_attention_cp4(four):
    for rank_result in four:
        assert rank_result["attention"] == []


def test_ring_posts_next_block_before_computing(two):
    # p=2, forward: post, compute, compute; backward: post K/V, compute, post dK/dV, for
    # each of the two steps.
    assert two[0]["overlap"] == ["post", "compute", "compute",
                                 "post", "compute", "post", "compute", "post"]


def test_ulysses_rejects_heads_not_divisible_by_cp(two):
    message = two[0]["ulysses_error"]
    assert "cp=2" in message and "3 KV heads" in message and "--cp-method ring" in message


def test_training_matches_single_process_cp2(two):
    for rank_result in two:
        for result in rank_result["training"]:
            check_training(result)


def test_training_matches_single_process_cp4_and_dp2_cp2(four):
    for rank_result in four:  # every rank: the same loss, and its replica of the weights
        for result in rank_result["training"]:
            check_training(result)


def test_saved_attention_activations_fall_as_one_over_cp(four):
    """Every tensor either method saves (q, k, v or their head-sharded / repeated forms,
    the output, the LSE) holds s/cp tokens' worth of entries, so the ratio is exact; the
    1% tolerance only leaves room for a shape-independent scalar an SDPA kernel may save."""
    for rank_result in four:
        memory = rank_result["memory"]
        for method in ("ring", "ulysses"):
            for cp in (2, 4):
                ratio = memory[(method, cp)] / memory[(method, 1)]
                assert ratio == pytest.approx(1 / cp, rel=0.01), (method, cp, memory)
