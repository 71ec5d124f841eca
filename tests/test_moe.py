"""Mixtures of experts: the model against transformers (Mixtral, Qwen2-MoE, Qwen3-MoE) and
the export back, the balancing loss exactly as docs/moe.md writes it (per sequence, so
that no layout or accumulation changes it), and expert parallelism against one process."""

from __future__ import annotations

import json

import pytest
import torch

from distributed import run_world
from helpers import RTOL, assert_same_run, assert_tensors_close, tail, tiny_config, train_runs
from paratrain.comm.compress import all_reduce_bytes
from paratrain.models import hf
from paratrain.models.gpt import GPT, GPTConfig
from paratrain.models.moe import MoE

MOE = dict(n_experts=4, top_k=2, expert_ffn=64)
"""The tiny preset with 4 experts of width 64, 2 per token, in every block."""


def _families(vocab_size: int = 96):
    from transformers import (MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig,
                              Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

    shape = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2)
    return {
        "mixtral": MixtralForCausalLM(MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **shape)),
        "qwen2_moe": Qwen2MoeForCausalLM(Qwen2MoeConfig(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, mlp_only_layers=[0], **shape)),
        "qwen3_moe": Qwen3MoeForCausalLM(Qwen3MoeConfig(
            num_experts=6, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True,
            decoder_sparse_step=2, **shape)),
    }


def test_logits_equal_transformers_and_the_export_loads_back(tmp_path):
    torch.manual_seed(0)
    tokens = torch.randint(0, 96, (2, 12))
    for name, theirs in _families().items():
        with torch.no_grad():  # norms away from 1: Qwen3's q/k norms must move with q and k's rows
            for key, p in theirs.named_parameters():
                if "norm" in key:
                    p.uniform_(0.5, 1.5)
        theirs.eval().save_pretrained(tmp_path / name)
        cfg = hf.read_config(tmp_path / name)
        ours = GPT(cfg)
        ours.load_state_dict(hf.load_weights(tmp_path / name, cfg))
        ours.eval()
        with torch.no_grad():
            want = theirs(tokens).logits
            torch.testing.assert_close(ours.logits(tokens), want, rtol=1e-5, atol=1e-5, msg=name)
        out = hf.export(dict(ours.named_parameters()), cfg, tmp_path / f"{name}-out")
        back = type(theirs).from_pretrained(out).eval()
        with torch.no_grad():
            torch.testing.assert_close(back(tokens).logits, want, rtol=1e-5, atol=1e-5, msg=name)
    assert [cfg.is_moe(i) for i in range(3)] == [False, True, False]  # decoder_sparse_step=2


# Each family's directory under a layout that cuts what it has: Qwen3-MoE's per-head q/k
# norms under plain tp (SP sums every replicated gradient anyway), Qwen2-MoE's gated
# shared expert under ZeRO-3, Mixtral over cp.
FAMILY_LAYOUTS = {"qwen3_moe": dict(dp=2, tp=2, ep=2),
                  "qwen2_moe": dict(dp=4, ep=2, zero=3),
                  "mixtral": dict(dp=2, cp=2, ep=4, zero=1)}


def test_hugging_face_directories_train_with_parity_under_expert_parallel_layouts(tmp_path):
    """The three families' directories (byte vocabulary: they train on the bundled corpus),
    3 steps, each at 4 ranks under its layout against one process."""
    paths = {}
    for name, model in _families(vocab_size=256).items():
        model.save_pretrained(tmp_path / name)
        paths[name] = str(tmp_path / name)

    def configs(nproc: int, layouts: dict) -> dict:
        return {name: tiny_config(str(tmp_path / f"run{nproc}" / name), preset=paths[name], nproc=nproc,
                                  steps=3, warmup_steps=1, lr=1e-3, eps=1e-6, eval_every=0,
                                  **layouts.get(name, {})) for name in paths}
    want = run_world(train_runs, 1, configs(1, {}))[0]
    got = run_world(train_runs, 4, configs(4, FAMILY_LAYOUTS))
    for name in paths:
        for rank, run in enumerate(got):
            assert_same_run(run[name], want[name], what=f"{name} {FAMILY_LAYOUTS[name]} rank {rank}")


def _aux_reference(model: GPT, tokens: torch.Tensor) -> torch.Tensor:
    """Σ over MoE layers and sequences of n_experts · Σ_i f_i P_i, written out directly."""
    captured = []
    hooks = [m.router.register_forward_hook(lambda mod, inp, out: captured.append(out))
             for m in model.modules() if isinstance(m, MoE)]
    model(tokens, tokens)
    for h in hooks:
        h.remove()
    cfg, (b, s) = model.cfg, tokens.shape
    total = torch.zeros(())
    for logits in captured:
        probs = logits.float().softmax(-1).view(b, s, -1)
        chosen = probs.topk(cfg.top_k, -1).indices
        for seq in range(b):
            f = torch.bincount(chosen[seq].flatten(), minlength=cfg.n_experts) / (s * cfg.top_k)
            total = total + cfg.n_experts * (f * probs[seq].mean(0)).sum()
    return total


def test_the_aux_loss_is_per_sequence_and_its_gradient_is_exact():
    """The gradient the router receives is that of CE_sum + coef · T · Σ_seq aux(seq), and
    two microbatches of two sequences give what one of four gives (accumulation)."""
    cfg = GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, aux_loss_coef=0.1, **MOE)
    model = GPT(cfg, seed=1).train()
    tokens = torch.randint(0, 64, (4, 16))
    model(tokens, tokens).backward()
    injected = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    plain = GPT(cfg, seed=1).train()
    for m in plain.modules():
        if isinstance(m, MoE):
            m.aux_coef = 0.0  # no injection: the reference adds the aux loss by hand
    (plain(tokens, tokens) + 0.1 * 16 * _aux_reference(plain, tokens)).backward()
    assert_tensors_close(injected, {n: p.grad for n, p in plain.named_parameters() if p.requires_grad},
                         RTOL, "aux")
    for half in tokens.split(2):
        model(half, half).backward()
    assert_tensors_close({n: p.grad for n, p in model.named_parameters() if p.requires_grad}, injected, RTOL,
                         "two microbatches")


def test_the_selection_bias_chooses_but_never_weighs():
    """DeepSeek-V3's bias changes which experts a token picks, not the weights the picked
    ones get, receives no gradient, and moves against the load: down for the busiest."""
    cfg = GPTConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, router="sigmoid",
                    norm_topk=False, aux_loss_coef=0.0, bias_update=0.1, **MOE)
    model = GPT(cfg, seed=2).train()
    moe = model.layers[0].mlp
    tokens = torch.randint(0, 64, (2, 8))
    x = model.embed(tokens)
    with torch.no_grad():
        moe.expert_bias.copy_(torch.tensor([10.0, 10.0, -10.0, -10.0]))  # forces experts 0, 1
    captured = {}
    moe.dispatcher.register_forward_hook(lambda m, args, out: captured.update(counts=args[1]))
    out = moe(x)
    assert captured["counts"].tolist() == [16, 16, 0, 0]
    weights = moe.router(x.reshape(-1, 32)).float().sigmoid()[:, :2]  # the unbiased scores
    rows = x.reshape(-1, 32)
    want = sum(weights[:, [e]] * (torch.nn.functional.silu(rows @ moe.experts.w1[e].T)
                                  * (rows @ moe.experts.w3[e].T)) @ moe.experts.w2[e].T
               for e in range(2))
    torch.testing.assert_close(out.reshape(-1, 32), want, rtol=1e-5, atol=1e-6)
    out.sum().backward()
    assert moe.expert_bias.grad is None
    moe.update_bias(torch.tensor([30, 2, 0, 0]))
    torch.testing.assert_close(moe.expert_bias, torch.tensor([9.9, 10.1, -9.9, -9.9]))


def _tiny_moe_fields() -> dict:
    """The fields of the tiny preset with MOE's experts (what tiny_config(**MOE) builds)."""
    from paratrain.models.gpt import PRESETS

    return {**PRESETS["tiny"].__dict__, **MOE}


def _configs(tmp: str, nproc: int, ep: int) -> dict:
    return {"aux": tiny_config(tmp, nproc=nproc, ep=ep, **MOE),
            "bias": tiny_config(tmp, nproc=nproc, ep=ep, aux_loss_coef=0.0, bias_update=0.01, **MOE),
            "accumulate": tiny_config(tmp, nproc=nproc, ep=ep, micro_batch=8 // nproc // 2, **MOE),
            "recompute": tiny_config(tmp, nproc=nproc, ep=ep, recompute="full", **MOE),
            # recomputed forwards must not count their tokens again: the bias moves as without
            "bias recompute": tiny_config(tmp, nproc=nproc, ep=ep, aux_loss_coef=0.0, bias_update=0.01,
                                          recompute="full", **MOE),
            "capacity": tiny_config(tmp, nproc=nproc, ep=ep, capacity_factor=1.0, **MOE)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run_world(train_runs, 1, _configs(str(tmp_path_factory.mktemp("ref")), 1, 1))[0]


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> dict:
    """ep2 and ep4 on four ranks in one world (worlds are slow to start), each in its own run
    directory: {ep: (each rank's runs, the run directory)}."""
    dirs = {ep: tmp_path_factory.mktemp(f"ep{ep}") for ep in (2, 4)}
    configs = {(ep, name): cfg for ep, d in dirs.items() for name, cfg in _configs(str(d), 4, ep).items()}
    per_rank = run_world(train_runs, 4, configs)
    return {ep: ([{name: runs[e, name] for e, name in runs if e == ep} for runs in per_rank], d)
            for ep, d in dirs.items()}


@pytest.mark.parametrize("nproc, ep", [(2, 2), (4, 2), (4, 4)])
def test_expert_parallel_matches_one_process(nproc, ep, reference, tmp_path, request):
    if nproc == 4:  # both four-rank cases' runs come from one world
        runs, tmp_path = request.getfixturevalue("four_ranks")[ep]
    else:
        runs = run_world(train_runs, nproc, _configs(str(tmp_path), nproc, ep))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["dropped_tokens"] for r in records) > 0  # capacity 1.0 drops some: per sequence
    # comm_bytes counts the experts' reduction over their dp / ep replicas too
    model = GPT(GPTConfig(**_tiny_moe_fields()))
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    dense = sum(p.numel() for p in model.parameters() if p.requires_grad) - experts
    assert records[0]["comm_bytes"] == all_reduce_bytes(4 * dense, nproc) + \
        all_reduce_bytes(4 * experts // ep, nproc // ep)
    for name, want in reference.items():
        for rank, got in enumerate(runs):
            assert_same_run(got[name], want, what=f"{name} dp{nproc} ep{ep} rank {rank}")
            assert_same_run(got["bias recompute"], reference["bias"], what=f"bias recompute rank {rank}")


def test_pipeline_stages_carry_the_aux_loss(reference, tmp_path):
    """dp2 x pp2 x ep2: each stage injects its own layers' aux gradient, 1F1B over two
    microbatches per replica."""
    configs = {name: tiny_config(str(tmp_path), nproc=4, dp=2, pp=2, ep=2, micro_batch=2,
                                 **{**MOE, **kw}) for name, kw in
               [("aux", {}), ("bias", dict(aux_loss_coef=0.0, bias_update=0.01)), ("accumulate", {}),
                ("recompute", dict(recompute="full")), ("capacity", dict(capacity_factor=1.0)),
                ("bias recompute", dict(aux_loss_coef=0.0, bias_update=0.01, recompute="full"))]}
    runs = run_world(train_runs, 4, configs)
    for name, want in reference.items():
        for rank, got in enumerate(runs):
            assert_same_run(got[name], want, what=f"{name} pp2 ep2 rank {rank}")


MIXED = dict(MOE, n_layers=4, moe_first_dense=1, shared_ffn=32, shared_gate=True, eps=1e-6)
"""Four blocks, the first dense, the others with a gated shared expert: every path a
layout cuts (the dense MLP, experts, the shared expert) in one model. Adam's eps=1e-6 as
in test_hybrid: at 1e-8, entries whose gradient is near eps turn tensor parallelism's
last-bit differences into 3e-5 parameter differences after one step (measured on the
dense MLP of block 0 under tp2 SP); the gradients and norms, compared first, still show
a wrong scale."""

COMPOSED = {
    "dp2 ep2 ZeRO-1": (2, dict(ep=2, zero=1)),
    "dp2 ep2 ZeRO-3": (2, dict(ep=2, zero=3)),
    "dp2 ZeRO-2, experts whole": (2, dict(zero=2)),
    "dp2 ep2 tp2 SP": (4, dict(dp=2, tp=2, sp=True, ep=2)),
    "tp2 without SP": (2, dict(tp=2)),
    "ep2 cp2": (2, dict(cp=2, ep=2)),
    "dp2 cp2 ep4 ZeRO-1": (4, dict(dp=2, cp=2, ep=4, zero=1)),
    "dp2 ep2 pp2 interleaved": (4, dict(dp=2, pp=2, ep=2, schedule="interleaved", virtual_stages=2,
                                        micro_batch=1)),
    "dp2 ep2 pp2 ZeRO-1": (4, dict(dp=2, pp=2, ep=2, zero=1, micro_batch=2)),
}
"""Layouts that cut a mixture of experts with other strategies: (processes, fields)."""

COMPOSED_SLOW = {"dp2 ZeRO-2, experts whole", "tp2 without SP", "dp2 ep2 pp2 ZeRO-1"}
"""Paths the others cover too (ZeRO's units, tp's replicated experts, pipelines): ``-m slow``."""

CLIP = 0.5
"""Active clipping (the reference's norms are above it): a wrong gradient scale shows."""


def _mixed(tmp: str, nproc: int, **layout) -> dict:
    return {"aux": tiny_config(tmp, nproc=nproc, **layout, **MIXED),
            "bias": tiny_config(tmp, nproc=nproc, aux_loss_coef=0.0, bias_update=0.01, **layout, **MIXED),
            "clipped": tiny_config(tmp, nproc=nproc, grad_clip=CLIP, **layout, **MIXED)}


@pytest.fixture(scope="module")
def mixed_reference(tmp_path_factory):
    runs = run_world(train_runs, 1, _mixed(str(tmp_path_factory.mktemp("mixed")), 1))[0]
    assert min(runs["clipped"]["grad_norms"]) > CLIP  # clipping acts at every step
    return runs


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in COMPOSED_SLOW else n
                                  for n in COMPOSED])
def test_expert_parallel_composes_with_every_strategy(name, mixed_reference, tmp_path):
    """Each layout equals one process with the aux loss, with bias balancing, and with
    clipping active."""
    nproc, layout = COMPOSED[name]
    runs = run_world(train_runs, nproc, _mixed(str(tmp_path), nproc, **layout))
    for config, want in mixed_reference.items():
        for rank, got in enumerate(runs):
            assert_same_run(got[config], want, what=f"{config} {name} rank {rank}")


def _collapsed_router_runs(configs: dict) -> dict:
    """``train_runs`` with every router starting at zero: all scores tie, so every token
    picks the first top_k experts and the ranks holding the others receive nothing."""
    from paratrain.models import gpt

    original = gpt.init_tensor

    def init(cfg, name, shape, seed, device="cpu"):
        value = original(cfg, name, shape, seed, device)
        return value.zero_() if ".router." in name else value

    gpt.init_tensor = init
    try:
        return train_runs(configs)
    finally:
        gpt.init_tensor = original


def test_experts_without_tokens_neither_hang_nor_change_the_result(tmp_path):
    """Every token to expert 0 (top-1), or to experts 0 and 1 (top-2), at ep4: three or two
    ranks get no rows in the first step's all-to-alls, and still take part in them."""
    def configs(tmp, nproc, ep):
        return {f"top{k}": tiny_config(f"{tmp}/{k}", nproc=nproc, ep=ep, steps=2, eval_every=0,
                                       **{**MOE, "top_k": k}) for k in (1, 2)}
    want = run_world(_collapsed_router_runs, 1, configs(str(tmp_path / "one"), 1, 1))[0]
    got = run_world(_collapsed_router_runs, 4, configs(str(tmp_path / "ep4"), 4, 4))
    for name in want:
        first = json.loads((tmp_path / "ep4" / name[-1] / "metrics.jsonl").read_text().splitlines()[0])
        assert first["expert_load"] == pytest.approx(4 / int(name[-1]))  # busiest / mean
        for rank, run in enumerate(got):
            assert_same_run(run[name], want[name], what=f"{name} rank {rank}")


def _ep4_config(tmp, nproc, ep=1, resume="", **kw):
    return tiny_config(str(tmp), nproc=nproc, ep=ep, steps=4, eval_every=0, resume=resume,
                       bias_update=0.01, **MOE, **kw)


def _zero3_config(tmp, nproc, resume="", **kw):
    return tiny_config(str(tmp), nproc=nproc, steps=4, eval_every=0, resume=resume,
                       aux_loss_coef=0.0, bias_update=0.01, **MIXED, **kw)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> dict:
    """Both checkpoint tests' runs, three worlds instead of six (worlds are slow to start):
    the two four-rank saves in one, the one-process references and resumes in one, the
    two-rank resumes in one. {test: (the one-process runs, each two-rank rank's run)}."""
    tmp = tmp_path_factory.mktemp("resumed")
    run_world(train_runs, 4, {"ep4": _ep4_config(tmp / "ep4-a", 4, ep=4, save_every=2),
                              "zero3": _zero3_config(tmp / "zero3-a", 4, ep=2, zero=3, save_every=2)})
    ckpt = {k: str(tmp / f"{k}-a" / "checkpoints" / "step-2") for k in ("ep4", "zero3")}
    one = run_world(train_runs, 1, {
        ("ep4", "ref"): _ep4_config(tmp / "ep4-ref", 1),
        ("ep4", "one"): _ep4_config(tmp / "ep4-one", 1, resume=ckpt["ep4"]),
        ("zero3", "ref"): _zero3_config(tmp / "zero3-ref", 1),
        ("zero3", "one"): _zero3_config(tmp / "zero3-one", 1, resume=ckpt["zero3"])})[0]
    two = run_world(train_runs, 2, {"ep4": _ep4_config(tmp / "ep4-b", 2, ep=2, resume=ckpt["ep4"]),
                                    "zero3": _zero3_config(tmp / "zero3-b", 2, ep=2, zero=1,
                                                           resume=ckpt["zero3"])})
    return {k: ({"ref": one[k, "ref"], "one": one[k, "one"]}, [got[k] for got in two]) for k in ckpt}


def test_a_checkpoint_at_ep4_resumes_at_ep2_and_on_one_process(resumed):
    """Experts are saved as slices of the stacked tensors, the selection bias with them."""
    one, two = resumed["ep4"]
    want = tail(one["ref"], since=2)
    assert_same_run(tail(one["one"]), want, what="one process")
    assert any(float(v.abs().sum()) for k, v in one["one"]["params"].items() if "expert_bias" in k)
    for rank, got in enumerate(two):
        assert_same_run(tail(got), want, what=f"ep2 rank {rank}")


def test_a_zero3_checkpoint_of_sharded_experts_resumes_anywhere(resumed):
    """dp4 x ep2 under ZeRO-3: each expert's state is cut over the two ranks holding it,
    and the frozen selection bias is whole on every rank; one process and dp2 x ep2 under
    ZeRO-1 resume it exactly."""
    one, two = resumed["zero3"]
    want = tail(one["ref"], since=2)
    assert_same_run(tail(one["one"]), want, what="one process")
    for rank, got in enumerate(two):
        assert_same_run(tail(got), want, what=f"dp2 ep2 ZeRO-1 rank {rank}")


def built_with_different_seeds(zero: int) -> dict:
    """Each rank builds the model from its own seed; the engine's full state after wrapping."""
    import torch.distributed as dist
    from paratrain.layout import Layout
    from paratrain.mesh import Mesh
    from paratrain.models.description import describe
    from paratrain.parallel.data import DataParallel
    from paratrain.parallel.engine import ReplicatedEngine
    from paratrain.parallel.expert import apply_expert_parallel
    from paratrain.parallel.zero import ZeroDataParallel
    from paratrain.train.sections import OptimConfig

    mesh = Mesh.build(Layout(dp=2, ep=2))
    model = GPT(GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, **MOE), seed=dist.get_rank())
    ep = apply_expert_parallel(model, describe(model), mesh.group("ep"), mesh.group("edp"))
    if zero:
        engine = ZeroDataParallel(model, mesh.group("dp"), zero, OptimConfig(), expert=ep)
    else:
        engine = ReplicatedEngine(DataParallel(model, mesh.group("dp"), expert=ep), OptimConfig())
    return engine.full_state_dict()


@pytest.mark.parametrize("zero", [0, 3])
def test_replicas_start_from_the_first_ranks_dense_weights_and_each_ep_ranks_experts(zero):
    """Wrapping makes replicas identical, whatever their seeds: the dense weights become
    the first rank's, while each expert-parallel rank keeps its own experts (at dp2 x ep2
    no other rank holds them)."""
    got = run_world(built_with_different_seeds, 2, zero)
    models = [GPT(GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, **MOE), seed=s)
              for s in (0, 1)]
    for name, want in models[0].state_dict().items():
        if ".experts." in name:
            want = torch.cat([want[:2], models[1].state_dict()[name][2:]])
        for rank in (0, 1):
            torch.testing.assert_close(got[rank][name], want, msg=f"{name} rank {rank}")


def hang_in_an_moe_layer(report_path: str) -> None:
    """Rank 1 never reaches the first MoE layer's all-to-all; rank 0's watchdog names it."""
    import os
    import time

    import torch.distributed as dist
    from paratrain.layout import Layout
    from paratrain.mesh import Mesh
    from paratrain.models.description import describe
    from paratrain.parallel.expert import apply_expert_parallel
    from paratrain.watchdog import Watchdog

    mesh = Mesh.build(Layout(dp=2, ep=2))
    model = GPT(GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, moe_first_dense=1, **MOE))
    apply_expert_parallel(model, describe(model), mesh.group("ep"), mesh.group("edp"))
    if dist.get_rank() == 1:
        time.sleep(20)
        os._exit(0)

    def on_hang(report: str) -> None:
        with open(report_path, "w") as f:
            f.write(report)
        os._exit(0)

    Watchdog(rank=0, timeout_s=1.0, on_hang=on_hang).start().attach(
        dist.distributed_c10d._get_default_store())
    tokens = torch.randint(0, 64, (2, 8))
    model(tokens, tokens)


def test_a_hang_inside_an_moe_layer_names_the_layer_and_the_ep_group(tmp_path):
    from paratrain.launch import RankFailed

    report = tmp_path / "report.txt"
    with pytest.raises(RankFailed):
        run_world(hang_in_an_moe_layer, 2, str(report), timeout_s=120)
    text = report.read_text()
    assert "on group ep (ranks [0, 1]) inside mixture-of-experts layer layers.1.mlp" in text, text
    assert "did not arrive: rank 1" in text, text


def test_recomputed_forwards_do_not_count_their_tokens_again():
    """Under full recomputation each MoE layer's forward runs again inside backward: the
    load, aux and drops it records count each token once (the metrics, the bias's input)."""
    from paratrain.parallel.recompute import apply_recompute

    cfg = GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, **MOE)
    model = GPT(cfg, seed=3).train()
    apply_recompute(model.layers, "full", core="attn.core")
    tokens = torch.randint(0, 64, (2, 8))
    # torch stops a recomputation once it has the tensors backward needs, which today is
    # before the statistics; without that early stop the whole forward runs again
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        model(tokens, tokens).backward()
    for block in model.layers:
        assert int(block.mlp.stats.load.sum()) == tokens.numel() * cfg.top_k
