"""Tensor parallelism and Megatron sequence parallelism: parity with one process, the
collectives each layer issues, and the activation memory SP saves.

Every rank builds the unsharded reference model from the same seed and computes the
single-process numbers itself, so one spawned world checks everything.
"""

from __future__ import annotations

import contextlib
import copy
from collections import Counter

import pytest
import torch
import torch.distributed as dist

from distributed import run_world
from helpers import RTOL, rel_error
from paratrain.comm import autograd as A
from paratrain.comm import collectives as C
from paratrain.layout import Layout
from paratrain.mesh import Mesh
from paratrain.models.gpt import GPT, GPTConfig, IGNORE_INDEX
from paratrain.parallel.data import DataParallel
from paratrain.parallel.tensor import apply_tensor_parallel

# n_kv_heads=2: split at tp=2, replicated at tp=4; vocab 250: padded at tp=4.
CFG = GPTConfig(vocab_size=250, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                ffn_hidden=128, max_seq_len=64)
# CLIP is above the gradient norms (~140 for the summed loss): parity with clipping off, so a
# wrong gradient magnitude is not rescaled away; tests/test_optim.py covers active clipping.
BATCH, SEQ, STEPS, CLIP = 4, 32, 3, 1000.0


def batches(n: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, CFG.vocab_size, (BATCH, SEQ), generator=g)
        targets = torch.randint(0, CFG.vocab_size, (BATCH, SEQ), generator=g)
        targets[0, :5] = IGNORE_INDEX  # masked positions must not count
        out.append((tokens, targets))
    return out


def reference(cfg: GPTConfig = CFG) -> GPT:
    torch.manual_seed(0)
    return GPT(cfg)


def check_operators(group) -> None:
    """Each f/g operator's forward and backward, on tensors that differ per rank."""
    t, r = C.size(group), C.rank(group)
    torch.manual_seed(0)  # the same on every rank: xs[i] and gs[i] are rank i's
    xs, gs = torch.randn(t, 2, 4 * t, 3), torch.randn(t, 2, 4 * t, 3)

    def chunk(z, i):
        return z.chunk(t, dim=1)[i]

    def own_chunks(z):  # rank i's chunk of rank i's tensor, concatenated
        return torch.cat([chunk(z[i], i) for i in range(t)], dim=1)

    def run(op, x, grad):
        x = x.clone().requires_grad_()
        y = op(x, group)
        y.backward(grad)
        return y.detach(), x.grad

    y, dx = run(A.copy_to_tp_region, xs[0], gs[r])  # f
    assert y.equal(xs[0]) and torch.allclose(dx, gs.sum(0))
    y, dx = run(A.reduce_from_tp_region, xs[r], gs[0])  # g
    assert torch.allclose(y, xs.sum(0)) and dx.equal(gs[0])
    y, dx = run(A.scatter_to_sequence_region, xs[0], chunk(gs[r], r))
    assert y.equal(chunk(xs[0], r)) and dx.equal(own_chunks(gs))
    y, dx = run(A.gather_from_sequence_region, chunk(xs[r], r), gs[r])
    assert y.equal(own_chunks(xs)) and torch.allclose(dx, chunk(gs.sum(0), r))
    y, dx = run(A.reduce_scatter_to_sequence_region, xs[r], chunk(gs[r], r))
    assert torch.allclose(y, chunk(xs.sum(0), r)) and dx.equal(own_chunks(gs))


def check_forward_backward(cfg: GPTConfig, group, sp: bool, overlap: bool = True) -> None:
    """Loss and every gathered gradient equal the single-process ones (element-wise)."""
    ref = reference(cfg)
    model = copy.deepcopy(ref)
    tp = apply_tensor_parallel(model, group, sequence_parallel=sp, overlap_comm=overlap)
    tokens, targets = batches(1)[0]
    want = ref(tokens, targets)
    want.backward()
    got = model(tokens, targets)
    got.backward()
    tp.sync_replicated_grads()
    torch.testing.assert_close(got, want, rtol=RTOL, atol=0)
    grads = tp.full_state_dict(model, grads=True)
    params = tp.full_state_dict(model)
    for name, p in ref.named_parameters():
        assert params[name].equal(p.detach()), f"{name}: shards are not the unsharded init"
        atol = 1e-6 * p.grad.abs().max().item()  # entries near zero: relative to the tensor
        torch.testing.assert_close(grads[name], p.grad, rtol=RTOL, atol=atol, msg=name)


def global_grad_norm(tp, group) -> torch.Tensor:
    """Measure with each replicated gradient counted once, then clip every local gradient."""
    sq = torch.stack([p.grad.pow(2).sum() for p in tp.owned_params()]).sum()
    C.all_reduce(sq, group)
    norm = sq.sqrt().item()
    coef = min(1.0, CLIP / (norm + 1e-6))
    for p in tp.sharded_params + tp.replicated_params:
        p.grad.mul_(coef)
    return norm


def check_training(group, sp: bool, dp_group=None, accumulate: bool = False) -> tuple[str, float]:
    """STEPS steps of AdamW with clipping: per-step loss, grad norm and final parameters.
    With ``dp_group`` the batch is split over it and DataParallel wraps the TP model;
    ``accumulate`` runs two microbatches per step (the first under no_sync) and sums the
    replicated gradients with hooks during backward instead of after it.
    Returns the parameter with the largest norm-wise relative error, and that error."""
    ref = reference()
    model = copy.deepcopy(ref)
    tp = apply_tensor_parallel(model, group, sequence_parallel=sp)
    if accumulate:
        tp.register_grad_sync_hooks()  # before wrapping, as ZeRO-2/3 needs
    dp, dp_rank = (C.size(dp_group), C.rank(dp_group)) if dp_group else (1, 0)
    wrapped = DataParallel(model, dp_group, bucket_mb=0.01) if dp_group else model
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    share = BATCH // dp
    micro = [slice(dp_rank * share + i, dp_rank * share + i + share // 2) for i in (0, share // 2)] \
        if accumulate else [slice(dp_rank * share, (dp_rank + 1) * share)]
    for step, (tokens, targets) in enumerate(batches()):
        # Backward of the summed loss (not the mean): Adam turns absolute summation noise in
        # gradients near its eps into visible update differences; larger gradients keep
        # the test about the parallelism, not about that conditioning.
        ref_opt.zero_grad()
        want = ref(tokens, targets)
        want.backward()
        want_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP).item()
        ref_opt.step()

        opt.zero_grad(set_to_none=False)
        loss = torch.zeros(())
        for i, rows in enumerate(micro):
            with wrapped.no_sync() if dp_group and i < len(micro) - 1 else contextlib.nullcontext():
                part = wrapped(tokens[rows], targets[rows])
                (part * dp).backward()  # DataParallel averages over dp: this sums
            loss += part.detach()
        if dp_group:
            wrapped.finish_grad_sync()
            C.all_reduce(loss, dp_group)
        tp.sync_replicated_grads()
        norm = global_grad_norm(tp, group)
        opt.step()
        torch.testing.assert_close(loss, want, rtol=RTOL, atol=0, msg=f"loss at step {step}")
        assert abs(norm - want_norm) <= RTOL * want_norm, (step, norm, want_norm)
    params = tp.full_state_dict(model)
    errors = {name: rel_error(params[name], p.detach()) for name, p in ref.named_parameters()}
    # the vocabulary padding (last rank at tp=4) never learns anything
    real = CFG.vocab_size - C.rank(group) * model.output.weight.shape[0]
    assert not model.output.weight[max(real, 0):].any()
    assert not model.tok_embeddings.weight[max(real, 0):].any()
    return max(errors.items(), key=lambda kv: kv[1])


def count_layer_collectives(group, sp: bool, overlap: bool = True) -> tuple[Counter, Counter]:
    """Collectives issued inside layers[1]: in forward between its entry and exit; in
    backward from the arrival of its output's gradient to the completion of its input's."""
    model = reference()
    apply_tensor_parallel(model, group, sequence_parallel=sp, overlap_comm=overlap)
    counts = {"fwd": Counter(), "bwd": Counter()}
    phase = [None]
    originals = {name: getattr(C, name) for name in ("all_reduce", "all_gather", "reduce_scatter")}

    def counting(name):
        def wrapper(*args, **kwargs):
            if phase[0]:
                counts[phase[0]][name] += 1
            return originals[name](*args, **kwargs)
        return wrapper

    def set_phase(value):
        def hook(*_):
            phase[0] = value
        return hook

    layer = model.layers[1]

    def on_entry(module, args):
        args[0].register_hook(set_phase(None))  # input's gradient complete: layer's backward done
        phase[0] = "fwd"

    def on_exit(module, args, output):
        phase[0] = None
        output.register_hook(set_phase("bwd"))

    handles = [layer.register_forward_pre_hook(on_entry), layer.register_forward_hook(on_exit)]
    for name in originals:
        setattr(C, name, counting(name))
    try:
        tokens, targets = batches(1)[0]
        model(tokens, targets).backward()
    finally:
        for name, fn in originals.items():
            setattr(C, name, fn)
        for h in handles:
            h.remove()
    return counts["fwd"], counts["bwd"]


def norm_saved_bytes(group, sp: bool) -> int:
    """Bytes the norms of layers[0] save for backward (activations only, each storage once)."""
    model = reference()
    apply_tensor_parallel(model, group, sequence_parallel=sp)
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in param_storages:
            storages[s.data_ptr()] = s.nbytes()
        return t

    contexts = []

    def enter(module, args):
        contexts.append(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
        contexts[-1].__enter__()

    def leave(module, args, output):
        contexts.pop().__exit__(None, None, None)

    block = model.layers[0]
    for norm in (block.attn_norm, block.mlp_norm):
        norm.register_forward_pre_hook(enter)
        norm.register_forward_hook(leave)
    tokens, targets = batches(1)[0]
    model(tokens, targets)
    return sum(storages.values())


def check_errors(group) -> None:
    with pytest.raises(ValueError, match="must divide the 3 attention heads"):
        apply_tensor_parallel(GPT(GPTConfig(vocab_size=64, d_model=48, n_heads=3, n_layers=1)), group)
    model = reference()
    apply_tensor_parallel(model, group, sequence_parallel=True)
    tokens = torch.zeros(1, SEQ + 1, dtype=torch.long)
    with pytest.raises(ValueError, match="not divisible by the tensor-parallel size"):
        model(tokens, tokens)
    with pytest.raises(ValueError, match="already applied"):
        apply_tensor_parallel(model, group)


def tp_world(with_dp: bool) -> dict:
    group = dist.group.WORLD
    t = C.size(group)
    worst = {}
    check_operators(group)
    for sp in (False, True):
        check_forward_backward(CFG, group, sp)
        check_forward_backward(CFG, group, sp, overlap=False)
        worst[f"tp{t} sp={sp}"] = check_training(group, sp)
    # hooks with replicated KV heads (t=4) or split ones (t=2)
    worst[f"tp{t} sp accumulate"] = check_training(group, True, accumulate=True)
    check_forward_backward(GPTConfig(**{**CFG.__dict__, "tie_embeddings": True}), group, sp=True)
    check_errors(group)
    if with_dp:  # dp2 x tp2 on the same ranks: DataParallel around the TP model
        mesh = Mesh.build(Layout(dp=2, tp=2))
        for sp in (False, True):
            worst[f"dp2 x tp2 sp={sp}"] = check_training(mesh.group("tp"), sp, mesh.group("dp"))
        worst["dp2 x tp2 sp accumulate"] = check_training(mesh.group("tp"), True, mesh.group("dp"),
                                                          accumulate=True)
    return {
        "worst": worst,
        "tp": [count_layer_collectives(group, False, overlap) for overlap in (True, False)],
        "sp": [count_layer_collectives(group, True, overlap) for overlap in (True, False)],
        "saved": (norm_saved_bytes(group, sp=False), norm_saved_bytes(group, sp=True)),
        "t": t,
    }


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "tp4"])
def world(request) -> list[dict]:
    """One world per tp size (tp4 also runs dp2 x tp2); the checks that compare tensors
    (operators, gradients, errors) assert inside it, the rest is returned."""
    return run_world(tp_world, request.param, request.param == 4, timeout_s=240)


def test_training_matches_single_process(world):
    for run, (name, error) in world[0]["worst"].items():
        assert error <= RTOL, f"{run}: {name} ends {error:.1e} away from one process"
    print({run: f"{name} {error:.1e}" for run, (name, error) in world[0]["worst"].items()})


def test_collectives_per_layer(world):
    for r in world:  # with and without the overlap of weight gradients
        # TP: g's all-reduce after attention and after the MLP in forward; f's before them
        # in backward
        assert r["tp"] == [(Counter(all_reduce=2), Counter(all_reduce=2))] * 2
        # SP: all-gather before each block, reduce-scatter after it; mirrored in backward
        both = Counter(all_gather=2, reduce_scatter=2)
        assert r["sp"] == [(both, both)] * 2


def test_sequence_parallel_shards_norm_activations(world):
    for r in world:
        plain, sharded = r["saved"]
        assert plain == r["t"] * sharded, (plain, sharded)


def _region_with_other_uses() -> dict:
    """A region whose entered input also feeds something besides its column layers (as a
    third model family may do): its gradient must still reach the input, exactly."""
    from paratrain.parallel.sequence import Regions
    from paratrain.parallel.tensor import ColumnParallelLinear

    torch.manual_seed(0)
    linear = torch.nn.Linear(8, 6, bias=True)
    x = torch.randn(2, 3, 8, requires_grad=True)
    (linear(x).pow(2).sum() + x.pow(3).sum()).backward()
    want = {"x": x.grad.clone(), "w": linear.weight.grad.clone(), "b": linear.bias.grad.clone()}

    column = ColumnParallelLinear(linear, dist.group.WORLD)
    x2 = x.detach().clone().requires_grad_()
    entered = Regions(dist.group.WORLD, sequence_parallel=False).enter_overlapped(x2, [column])
    (column(entered).pow(2).sum() + entered.pow(3).sum()).backward()
    got = {"x": x2.grad, "w": column.weight.grad, "b": column.bias.grad}
    return {k: torch.equal(got[k], want[k]) or rel_error(got[k], want[k]) for k in want}


def test_region_entry_keeps_gradients_of_other_uses():
    (result,) = run_world(_region_with_other_uses, 1)
    assert all(v is True or v < 1e-6 for v in result.values()), result
