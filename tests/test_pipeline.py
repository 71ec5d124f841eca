"""Pipeline parallelism: partitioning, and training parity with one process for every
schedule at pp=2 and pp=4 (m=4 and m=8), for dp2 x pp2 with DataParallel and for tp2 x pp2
with sequence parallelism."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from distributed import run_world
from helpers import RTOL, rel_error
from paratrain.comm import collectives as C
from paratrain.layout import Layout, LayoutError
from paratrain.mesh import Mesh
from paratrain.models.gpt import GPT, GPTConfig
from paratrain.parallel.data import DataParallel
from paratrain.parallel.pipeline import (Recorder, forward_schedule, gather_timeline,
                                         run_schedule, schedule, split_layers, split_model)
from paratrain.parallel.pipeline.posting import GLOO_RECEIVES_AHEAD, posting_order
from paratrain.parallel.pipeline.schedules import placement

CFG = GPTConfig(vocab_size=64, d_model=32, n_layers=8, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                max_seq_len=16)
BATCH, SEQ, STEPS = 8, 16, 3
TOKENS = BATCH * SEQ
# (schedule, virtual stages, microbatches): every schedule with m=4 and m=8.
VARIANTS = [(kind, v, m) for kind, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2))
            for m in (4, 8)]


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, CFG.vocab_size, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def adamw(params) -> torch.optim.Optimizer:
    # eps well above the gradients' rounding noise: with eps=1e-8 an entry whose gradient
    # cancels to ~1e-9 moves by lr * g / (|g| + eps), and a last-bit difference in the
    # summation order of microbatches then shows at 1e-5 (it is Adam, not the pipeline).
    return torch.optim.AdamW(params, lr=3e-3, eps=1e-5, weight_decay=0.1, foreach=False)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Intra-op threads only contend on a loaded 2-core machine (ranks use one each)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference():
    """Full model, full batch, one process: losses per step, the first step's gradients,
    the final parameters and an evaluation loss after training."""
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = adamw(model.parameters())
    losses = []
    for step in range(STEPS):
        tokens, targets = data(step)
        opt.zero_grad()
        loss = model(tokens, targets) / TOKENS
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        evaluation = model(*data(99)).item() / TOKENS
    return {"losses": losses, "grads": grads, "eval": evaluation,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


# ---- multiprocess worlds --------------------------------------------------------------------


def microbatches(step: int, dp_rank: int, dp: int, m: int):
    tokens, targets = data(step)
    share = BATCH // dp
    tokens, targets = (t[dp_rank * share:(dp_rank + 1) * share] for t in (tokens, targets))
    micro = share // m
    return [(tokens[i * micro:(i + 1) * micro], targets[i * micro:(i + 1) * micro])
            for i in range(m)]


def build_chunks(mesh: Mesh, v: int, shape: str = "loop"):
    """This rank's chunks of the seed-0 GPT, made tensor-parallel (with Megatron-SP) first
    when the mesh has a tp axis: the order parallelize() composes in. ``shape``: the
    schedule's placement (loop, or v)."""
    torch.manual_seed(0)
    model, tp = GPT(CFG), None
    if mesh.size("tp") > 1:
        from paratrain.parallel.tensor import apply_tensor_parallel

        tp = apply_tensor_parallel(model, mesh.group("tp"), sequence_parallel=True)
    return split_model(model, mesh.coord("pp"), mesh.size("pp"), v, placement=shape), tp


def by_name(chunks, tp, grads: bool = False) -> dict[str, torch.Tensor]:
    """This rank's parameters (or gradients) by GPT name, unsharded over tp."""
    if tp is not None:
        return {n: t for c in chunks for n, t in tp.full_state_dict(c, grads=grads).items()}
    return {n: (p.grad if grads else p).detach().clone()
            for c in chunks for n, p in c.named_parameters()}


def train_pipeline(mesh: Mesh, kind: str, v: int, m: int, recorder: Recorder | None = None,
                   ahead: int | None = None):
    """Train STEPS steps under the mesh's pp (and dp, tp) axes, then evaluate; return what
    ``reference`` returns, with this rank's tensors by their GPT names. ``ahead``: the
    executor's ``receives_ahead`` (None: its gloo default)."""
    pp, dp, tp_size = mesh.size("pp"), mesh.size("dp"), mesh.size("tp")
    pp_rank, dp_rank = mesh.coord("pp"), mesh.coord("dp")
    where = placement(kind)
    chunks, tp = build_chunks(mesh, v, where)
    container = nn.ModuleList(chunks)
    dp_model = DataParallel(container, mesh.group("dp"), bucket_mb=0.01) if dp > 1 else None
    opt = adamw(container.parameters())
    table = schedule(kind, pp, m, v)[pp_rank]
    # Under SP the stream between stages is cut along the sequence; RoPE needs all of it.
    shape, positions = (BATCH // dp // m, SEQ // tp_size, CFG.d_model), torch.arange(SEQ)
    losses, launches, grads = [], [], {}
    for step in range(STEPS):
        mbs = microbatches(step, dp_rank, dp, m)
        if dp_model is not None:
            dp_model.zero_grad()
        else:
            opt.zero_grad()
        loss = run_schedule(table, chunks, mbs, mesh.group("pp"), loss_scale=dp / TOKENS,
                            device=torch.device("cpu"), act_shape=shape,
                            no_sync=dp_model.no_sync if dp_model else None, recorder=recorder,
                            positions=positions, receives_ahead=ahead)
        if dp_model is not None:
            # Every bucket must already be in flight: launched by each chunk's last backward.
            in_flight = [b.work is not None for b in dp_model.buckets]
            launches.append(sum(in_flight) / len(in_flight))
            dp_model.finish_grad_sync()
        if tp is not None:
            tp.sync_replicated_grads()
        if step == 0:
            grads = by_name(chunks, tp, grads=True)
        opt.step()
        C.all_reduce(loss, mesh.group("pp"))  # only the last stage's rank has it
        C.all_reduce(loss, mesh.group("dp"))
        losses.append(loss.item() / TOKENS)
    evaluation = run_schedule(forward_schedule(pp, m, v, where)[pp_rank], chunks,
                              microbatches(99, dp_rank, dp, m), mesh.group("pp"), 1.0,
                              torch.device("cpu"), shape, positions=positions,
                              receives_ahead=ahead)
    C.all_reduce(evaluation, mesh.group("pp"))
    C.all_reduce(evaluation, mesh.group("dp"))
    return {"losses": losses, "grads": grads, "eval": evaluation.item() / TOKENS,
            "params": by_name(chunks, tp), "launches": launches}


def sent_alive_at_backwards(mesh: Mesh) -> list[int]:
    """Train GPipe (m=4) with the executor watched: after each backward's wait for its
    gradient, how many of the tensors this rank sent are still alive. gloo reports a send
    complete only when waited for, so they stay unless the executor waits for them."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from paratrain.parallel.pipeline.executor import _Executor
    refs, alive = [], []
    post, wait = _Executor._post, _Executor._await

    def watched_post(self, actions):
        for a in actions:
            held = {"SEND_F": self.outputs, "SEND_B": self.input_grads}.get(a.kind, {})
            if (a.microbatch, a.stage) in held:
                refs.append(StorageWeakRef(held[(a.microbatch, a.stage)].untyped_storage()))
        post(self, actions)

    def watched_await(self, key):
        wait(self, key)
        if key[0] == "g":
            alive.append(sum(not ref.expired() for ref in refs))

    _Executor._post, _Executor._await = watched_post, watched_await
    try:
        train_pipeline(mesh, "gpipe", 1, 4)
    finally:
        _Executor._post, _Executor._await = post, wait
    return alive


def pp_world(pp: int, with_dp: bool):
    """Every variant at this pp; on 4 ranks also dp2 x pp2 with the no_sync trick, and
    tp2 (with sequence parallelism) x pp2."""
    results = {}
    mesh = Mesh.build(Layout(pp=pp))
    for kind, v, m in VARIANTS:
        recorder = Recorder(rank=mesh.coord("pp")) if (kind, m) == ("1f1b", 8) else None
        results[(f"pp{pp}", kind, m)] = train_pipeline(mesh, kind, v, m, recorder)
        if recorder is not None:
            results["timeline"] = gather_timeline(recorder, mesh.group("pp"), kind, m, v)
    if pp == 2:  # receives where the table puts them (NCCL's posting), and far ahead
        for ahead, (kind, v, m) in ((0, ("interleaved", 2, 8)), (8, ("1f1b", 1, 8))):
            results[(f"ahead{ahead}", kind, m)] = train_pipeline(mesh, kind, v, m, ahead=ahead)
        results["sent_alive"] = sent_alive_at_backwards(mesh)
    if with_dp:
        mesh = Mesh.build(Layout(dp=2, pp=2))
        for kind, v in (("1f1b", 1), ("interleaved", 2)):
            results[("dp2pp2", kind, 4)] = train_pipeline(mesh, kind, v, 4)
        mesh = Mesh.build(Layout(tp=2, pp=2))
        results[("tp2pp2", "interleaved", 4)] = train_pipeline(mesh, "interleaved", 2, 4)
    return results


def assert_matches(results: list[dict], key, reference) -> None:
    """Every rank's losses (training and evaluation) equal the reference's; the first
    gradients and final parameters gathered by name from the stages cover the whole model
    and equal the reference's."""
    for rank_results in results:
        got = rank_results[key]
        torch.testing.assert_close(torch.tensor(got["losses"] + [got["eval"]]),
                                   torch.tensor(reference["losses"] + [reference["eval"]]),
                                   rtol=RTOL, atol=0, msg=f"{key}: losses")
    for what in ("grads", "params"):
        ref = reference[what]
        merged: dict[str, torch.Tensor] = {}
        for rank_results in results:
            for name, value in rank_results[key][what].items():
                if name in merged:  # a data-parallel replica: identical tensors
                    assert torch.equal(merged[name], value), (key, what, name)
                merged[name] = value
        assert merged.keys() == ref.keys(), key
        for name, want in ref.items():
            err = rel_error(merged[name], want)
            assert err <= RTOL, (key, what, name, err)


def test_pp2_every_schedule_matches_single_process(reference):
    results = run_world(pp_world, 2, 2, False)
    for kind, v, m in VARIANTS:
        assert_matches(results, ("pp2", kind, m), reference)
    assert_matches(results, ("ahead0", "interleaved", 8), reference)
    assert_matches(results, ("ahead8", "1f1b", 8), reference)
    timeline = results[0]["timeline"]
    assert timeline.ranks == results[1]["timeline"].ranks  # gathered on every rank
    for rank, steps in enumerate(timeline.ranks):
        assert len(steps) == STEPS
        kinds = [i.kind for i in steps[-1].intervals]
        assert kinds.count("F") == kinds.count("B") == 8
        # On gloo receives go out early, each alone: one post per batch of that order.
        posts = posting_order(schedule("1f1b", 2, 8)[rank], GLOO_RECEIVES_AHEAD)
        assert kinds.count("POST") == sum(isinstance(item, list) for item in posts)
    assert 0.0 <= timeline.bubble() < 1.0
    # GPipe's first stage sent every output before its first backward, whose wait covers
    # them all (posting.sends_before): none may outlive it.
    assert results[0]["sent_alive"] == [0] * 4 * STEPS
    assert results[1]["sent_alive"] == []  # the last stage receives no gradient


def test_pp4_dp2_pp2_and_tp2_pp2_match_single_process(reference):
    results = run_world(pp_world, 4, 4, True)
    for kind, v, m in VARIANTS:
        assert_matches(results, ("pp4", kind, m), reference)
    assert_matches(results, ("tp2pp2", "interleaved", 4), reference)
    for kind in ("1f1b", "interleaved"):
        assert_matches(results, ("dp2pp2", kind, 4), reference)
        for rank_results in results:  # reductions started during backward, not after it
            assert rank_results[("dp2pp2", kind, 4)]["launches"] == [1.0] * STEPS


# ---- one process ----------------------------------------------------------------------------


def test_receives_ahead_must_be_non_negative():
    chunks = split_model(GPT(CFG), 0, 1)
    tokens, targets = data(0)
    with pytest.raises(ValueError, match="receives_ahead=-1"):
        run_schedule(schedule("1f1b", 1, 1)[0], chunks, [(tokens, targets)], None, 1.0,
                     torch.device("cpu"), (BATCH, SEQ, CFG.d_model), receives_ahead=-1)


@pytest.mark.parametrize("kind,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2),
                                    ("interleaved", 4)])
def test_one_rank_runs_every_table_and_hands_chunks_over_in_memory(kind, v):
    torch.manual_seed(0)
    model = GPT(CFG)
    ref = copy.deepcopy(model)
    tokens, targets = data(0)
    (ref(tokens, targets) / TOKENS).backward()
    chunks = split_model(model, 0, 1, v)
    mbs = [(tokens[i:i + 2], targets[i:i + 2]) for i in range(0, BATCH, 2)]
    loss = run_schedule(schedule(kind, 1, 4, v)[0], chunks, mbs, None, 1 / TOKENS,
                        torch.device("cpu"), (2, SEQ, CFG.d_model))
    evaluation = run_schedule(forward_schedule(1, 4, v)[0], chunks, mbs, None, 1.0,
                              torch.device("cpu"), (2, SEQ, CFG.d_model))
    want = ref(tokens, targets).detach()
    torch.testing.assert_close(torch.stack([loss, evaluation]), torch.stack([want, want]),
                               rtol=RTOL, atol=0)
    grads = {n: p.grad for n, p in ref.named_parameters()}
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            assert rel_error(p.grad, grads[name]) <= RTOL, name
    # The same microbatches accumulated one after the other (the loop without pipeline):
    # the same arithmetic in the same order, so the same bits.
    torch.manual_seed(0)
    accumulated = GPT(CFG)
    total = torch.zeros(())
    for x, y in mbs:
        part = accumulated(x, y)
        (part * (1 / TOKENS)).backward()
        total += part.detach().float()
    assert torch.equal(loss, total)
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            assert torch.equal(p.grad, accumulated.get_parameter(name).grad), (kind, v, name)


def test_split_keeps_names_and_frees_other_stages():
    torch.manual_seed(0)
    model = GPT(CFG)
    total = sum(p.numel() for p in model.parameters())
    names = [n for n, _ in model.named_parameters()]
    chunks = split_model(model, 1, 4, virtual_stages=2)  # virtual stages 1 and 5
    assert [c.stage for c in chunks] == [1, 5]
    assert [list(c.layer_ids) for c in chunks] == [[1], [5]]
    local = {n for c in chunks for n, _ in c.named_parameters()}
    assert local == {n for n in names if n.startswith(("layers.1.", "layers.5."))}
    left = sum(p.numel() for p in model.parameters())  # the rest is released
    assert left == sum(p.numel() for c in chunks for p in c.parameters())
    assert left < total / 4
    first, last = split_model(GPT(CFG), 0, 2)[0], split_model(GPT(CFG), 1, 2)[0]
    assert first.is_first and hasattr(first, "tok_embeddings") and not hasattr(first, "output")
    assert last.is_last and hasattr(last, "output") and not hasattr(last, "tok_embeddings")


def test_split_layers_balances_costs_and_rejects_bad_sizes():
    assert split_layers(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    # a head as heavy as two blocks pushes layers toward the first stage
    assert split_layers(8, 2, head_cost=2.0) == [range(0, 5), range(5, 8)]
    assert split_layers(4, 2, layer_costs=[3, 1, 1, 1]) == [range(0, 1), range(1, 4)]
    with pytest.raises(LayoutError, match="at least one layer"):
        split_model(GPT(CFG), 0, CFG.n_layers + 3)
    tied = split_model(GPT(GPTConfig(n_layers=2, tie_embeddings=True)), 1, 2)  # the last stage
    head = tied[0].get_submodule("output").weight
    assert head.numel() and head is not tied[0].get_submodule("norm").weight  # a copy of its own
