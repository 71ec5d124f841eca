"""The planner on mixtures of experts (issue 39 item 7): total and active parameters,
FLOPs on the active ones, expert states split over ep, the all-to-all traffic, the search
over ep through train's own rules, and ``--out`` configs train reads. Pure logic, no
processes (the measured peaks and state bytes are in test_plan_peaks.py and
test_plan_vs_runs.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from helpers import plan
from paratrain import rules
from paratrain.comm.cost import collective_time
from paratrain.layout import Layout, LayoutError
from paratrain.plan import moe
from paratrain.plan.candidate import Candidate, Training
from paratrain.plan.cost import step_time
from paratrain.plan.evaluate import parse_layout
from paratrain.plan.flops import step_flops
from paratrain.plan.hardware import Calibration, gpu_preset, Cluster
from paratrain.plan.memory import rank_memory, rank_states
from paratrain.plan.models import load_model
from paratrain.plan.search import search

EXPERTS = "n_experts = 4\ntop_k = 2\nexpert_ffn = 48\n"


def toml_model(tmp_path, body: str = EXPERTS, name: str = "moe.toml"):
    """A train config's [model] table on the tiny preset (h 64, 2 layers, ffn 128)."""
    path = tmp_path / name
    path.write_text(f'[model]\npreset = "tiny"\n{body}')
    return load_model(str(path))


def gpus(n: int = 8, node: int = 8) -> Cluster:
    return Cluster(gpu_preset("h100-80g"), n, node)


def test_total_and_active_parameters_are_the_models(tmp_path):
    from paratrain.models.gpt import GPT, PRESETS

    model = toml_model(tmp_path, EXPERTS + "shared_ffn = 32\nshared_gate = true\nmoe_first_dense = 1\n")
    gpt = GPT(dataclasses.replace(PRESETS["tiny"], n_experts=4, top_k=2, expert_ffn=48,
                                  shared_ffn=32, shared_gate=True, moe_first_dense=1))
    trained = sum(p.numel() for p in gpt.parameters() if p.requires_grad)
    assert model.num_params() == trained  # the selection bias is not trained
    h = 64
    idle = (4 - 2) * 3 * h * 48  # one MoE block (the first is dense): two experts unused
    assert model.active_params() == model.num_params() - idle
    assert "(0.11M active)" in plan_line(model) and "4 experts x 48 top-2 + shared 32 in 1 MoE" in plan_line(model)


def plan_line(model) -> str:
    from paratrain.plan.models import describe

    return describe(model)


def test_flops_count_the_router_and_top_k_experts(tmp_path):
    # One expert per token as wide as the dense MLP: the same FLOPs but the router's,
    # whatever the number of experts.
    dense = load_model("tiny")
    training = Training(8, 64, "fp32")
    for n in (4, 8):
        model = toml_model(tmp_path, f"n_experts = {n}\ntop_k = 1\nexpert_ffn = 128\n")
        router = 2 * training.tokens * 64 * n * model.n_layers
        assert step_flops(model, training) == pytest.approx(step_flops(dense, training) + 3 * router)
    assert step_flops(dense, training) == step_flops(toml_model(tmp_path, "n_experts = 0\n"), training)


def test_expert_states_are_split_over_ep_and_sharded_over_the_ranks_holding_them(tmp_path):
    model = toml_model(tmp_path)
    training = Training(16, 64, "bf16")
    experts = 2 * moe.expert_params(model)  # two MoE blocks
    psi = model.num_params() - experts
    states = {ep: rank_states(model, training, Candidate(Layout(dp=4, ep=ep), 0, 1, 4))
              for ep in (1, 2, 4)}
    for ep in (1, 2, 4):  # 2 + 2 + 12 bytes per parameter; each rank 4 / ep experts
        assert states[ep] == 16 * (psi + experts // ep)
    # ZeRO-1 shards the dense optimizer states over dp x cp = 4, the experts' over the
    # dp x cp / ep = 2 ranks holding the same experts.
    zero1 = rank_states(model, training, Candidate(Layout(dp=4, ep=2), 1, 1, 4))
    assert zero1 == 4 * psi + 12 * psi / 4 + 4 * experts / 2 + 12 * experts / 2 / 2
    mem = rank_memory(model, training, Candidate(Layout(dp=4, ep=2), 0, 1, 4))
    dense = rank_memory(load_model("tiny"), training, Candidate(Layout(dp=4), 0, 1, 4))
    tokens = 64
    delta = moe.activation_delta(model, tokens, 1, 2)
    assert mem.activations == pytest.approx(dense.activations + 2 * delta)
    assert delta == 2 * tokens * 2 * (2 * 64 + 3 * 48) + tokens * (4 * 4 + 8 * 2) - 2 * tokens * 3 * 128


def test_all_to_all_traffic_per_moe_layer(tmp_path):
    model = toml_model(tmp_path, EXPERTS + "moe_first_dense = 1\n")  # one MoE block
    training, cluster = Training(16, 64, "bf16"), gpus()
    b = 2
    cand = Candidate(Layout(dp=8, ep=4), 0, b, 1)
    time = step_time(model, training, cluster, cand)
    nbytes = b * 64 * 2 * 64 * 2  # each rank's tokens x top_k x d_model x bf16
    one = collective_time("all-to-all", nbytes, 4, cluster.gpu.nvlink_alpha, cluster.gpu.nvlink_bw)
    assert one > collective_time("all-to-all", nbytes, 4, 0.0, cluster.gpu.nvlink_bw) > 0
    assert time.ep == pytest.approx(4 * one)  # dispatch + combine, forward and backward
    assert moe.all_to_all_bytes(model, b * 64, 2, 4) == nbytes * 3 / 4  # what leaves the rank
    full = step_time(model, training, cluster, cand.but(recompute="full"))
    assert full.ep == pytest.approx(6 * one)  # the recomputed forward exchanges again
    assert step_time(model, training, cluster, cand.but(layout=Layout(dp=8))).ep == 0.0
    assert step_time(load_model("tiny"), training, cluster, Candidate(Layout(dp=8), 0, b, 1)).ep is None
    # ep folded on the dp ranks: with pp8 its ranks are 0, 8, 16, 24, one per node of 8;
    # with tp4 it is ranks 0 and 4 of one node
    big = Cluster(cluster.gpu, 32, 8)
    assert moe.expert_group(Layout(dp=4, pp=8, ep=4)) == (0, 8, 16, 24)
    assert moe.group_link(big, moe.expert_group(Layout(dp=4, pp=8, ep=4))).kind == "network"
    assert moe.group_link(big, moe.expert_group(Layout(dp=8, tp=4, ep=2))).kind == "nvlink"
    assert time.step == pytest.approx(sum(getattr(time, k) for k in
                                          ("compute", "bubble", "tp", "cp", "pp", "dp", "optimizer", "ep")))


def test_the_search_tries_ep_as_trains_rules_allow(tmp_path, monkeypatch):
    model = toml_model(tmp_path)
    training, cluster = Training(16, 64, "bf16"), gpus()
    result = search(model, training, cluster)
    assert {p.cand.ep for p in result.plans} == {1, 2, 4}
    for p in result.plans:  # each passes train's rules, whatever they allow today
        rules.check_split(model, p.cand.layout, seq_len=64, cp_method=p.cand.cp_method)
        rules.expert_strategies(model.n_experts, p.cand.ep, p.cand.zero, "none")
    assert search(load_model("tiny"), training, cluster).plans[0].cand.ep == 1

    def refuse(n_experts, ep, zero, compress):  # a stricter train: the planner follows
        if ep > 1 or (n_experts and zero):
            raise LayoutError("a stricter train")

    monkeypatch.setattr(rules, "expert_strategies", refuse)
    strict = search(model, training, cluster)
    assert strict.plans and {(p.cand.ep, p.cand.zero) for p in strict.plans} == {(1, 0)}


def test_layout_specs_name_ep(tmp_path, capsys):
    assert parse_layout("dp4 ep2 z0").ep == 2
    with pytest.raises(ValueError, match="sizes must be positive"):
        parse_layout("ep0")
    path = tmp_path / "moe.toml"
    path.write_text(f'[model]\npreset = "tiny"\n{EXPERTS}')
    assert plan("--model", str(path), "--gpus", "8", "--global-batch", "16", "--seq-len", "64",
                "--layout", "dp8 ep4 z0", "--json") == 0
    layout = json.loads(capsys.readouterr().out)["layouts"][0]
    assert layout["layout"]["ep"] == 4 and layout["time_s"]["ep"] > 0
    assert plan("--model", "tiny", "--gpus", "8", "--layout", "dp8 ep2") == 2
    assert "has none" in capsys.readouterr().err


FAKE = Calibration(
    matmul_flops={"fp32": 40e9, "bf16": 100e9}, cores=2, alpha=100e-6, beta=1e9,
    memory=8 * 2**30, comm={"2": {"all-reduce": [100e-6, 1e9], "all-gather": [50e-6, 0.5e9],
                                  "reduce-scatter": [50e-6, 0.25e9], "all-to-all": [80e-6, 0.5e9]}},
    optimizer_rate=300e6, compute_efficiency={"fp32": 0.5, "bf16": 0.25}, layer_overhead=1e-3)


def _write_and_read(tmp_path, capsys, model: str, *flags: str):
    from paratrain.train.config import load

    cal, out = tmp_path / "cal.json", tmp_path / "plan.toml"
    cal.write_text(FAKE.to_json())
    assert plan("--cluster", "local", "--calibration", str(cal), "--model", model, "--gpus", "2",
                "--global-batch", "8", "--seq-len", "32", "--out", str(out), *flags) == 0, \
        capsys.readouterr().err
    capsys.readouterr()
    return load(str(out)).validate()


def test_out_writes_a_config_train_runs_with_the_chosen_ep(tmp_path, capsys):
    path = tmp_path / "moe.toml"
    path.write_text(f'[model]\npreset = "tiny"\n{EXPERTS}')
    cfg = _write_and_read(tmp_path, capsys, str(path), "--layout", "dp2 ep2")
    assert (cfg.parallel.ep, cfg.layout.ep, cfg.parallel.dp) == (2, 2, 2)
    assert (cfg.model.n_experts, cfg.model.top_k, cfg.model.expert_dim) == (4, 2, 48)
    searched = _write_and_read(tmp_path, capsys, str(path))  # the search's own choice
    assert searched.model.n_experts == 4 and searched.parallel.ep in (1, 2)


def test_a_mixtral_config_json_is_planned_and_written_back(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    directory = tmp_path / "tiny-mixtral"
    transformers.MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=96,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               num_local_experts=4, num_experts_per_tok=2,
                               max_position_embeddings=128).save_pretrained(directory)
    model = load_model(str(directory))
    assert (model.n_experts, model.top_k, model.expert_ffn, model.ffn_hidden) == (4, 2, 96, 96)
    assert model.num_params() > model.active_params()
    cfg = _write_and_read(tmp_path, capsys, str(directory), "--layout", "dp2 ep2")
    assert (cfg.parallel.ep, cfg.model.n_experts, cfg.model.expert_dim) == (2, 4, 96)
    assert cfg.model.norm_topk and cfg.model.shape == dataclasses.replace(
        cfg.model.shape, **{k: getattr(model, k) for k in moe.SHAPE_FIELDS})


def test_preflight_predicts_a_mixture_of_experts(tmp_path, monkeypatch):
    from paratrain.plan.runtime import paratrain_state_bytes
    from paratrain.train import preflight
    from paratrain.train.config import ConfigError, load

    cfg = load(None, {"preset": "tiny", "dp": 2, "ep": 2, "n_experts": 4, "top_k": 2,
                      "expert_ffn": 48, "seq_len": 32, "global_batch": 4,
                      "run_dir": str(tmp_path)}).validate()
    mem = preflight.predicted_memory(cfg)
    model = load_model("tiny")  # the experts make it larger than the dense tiny model
    states = paratrain_state_bytes(dataclasses.replace(
        model, n_experts=4, top_k=2, expert_ffn=48), Candidate(cfg.layout, 0, 2, 1), "fp32")
    assert (mem.params, mem.grads, mem.optimizer) == tuple(states.values())
    monkeypatch.setattr(preflight, "available_memory", lambda cfg, ranks: (1024, "a tiny machine"))
    with pytest.raises(ConfigError, match="the planner predicts"):
        preflight.check_memory(cfg, 2)


@pytest.mark.parametrize("mode", ["fp32", "autocast", "bf16"])
def test_a_moe_blocks_saved_activations_are_counted_exactly(mode):
    import torch

    from paratrain.models.gpt import GPT, PRESETS
    from paratrain.plan.models import from_gpt_config
    from paratrain.plan.runtime import paratrain_layer_activation_bytes

    b, s = 3, 40
    for extra in (dict(top_k=2), dict(top_k=1, shared_ffn=32, shared_gate=True, norm_topk=False)):
        cfg = dataclasses.replace(PRESETS["tiny"], n_experts=4, expert_ffn=48, **extra)
        torch.manual_seed(0)
        gpt = GPT(cfg)
        block, rope = gpt.layers[0], gpt.rope(torch.arange(s))
        dtype = torch.bfloat16 if mode == "bf16" else torch.float32
        for p in block.parameters():
            p.data = p.data.to(dtype)
        skip = {t.untyped_storage().data_ptr() for t in (*block.parameters(), *rope)}
        # autocast's bf16 copies of the weights (each expert's too) are the runtime's buffers
        matrices = [w for p in block.parameters() for w in (p if p.dim() == 3 else [p]) if w.dim() == 2]
        casts = [w.detach().to(torch.bfloat16) for w in matrices]
        saved: dict[int, int] = {}

        def is_copy(t) -> bool:
            return t.dim() == 2 and t.dtype == torch.bfloat16 and any(
                c.shape == t.shape and torch.equal(c, t) or c.t().shape == t.shape and
                torch.equal(c.t(), t) for c in casts)

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in skip and not (mode == "autocast" and is_copy(t)):
                saved[ptr] = t.untyped_storage().nbytes()
            return t

        x = torch.randn(b, s, 64, dtype=dtype, requires_grad=True)
        with (torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
              torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast")):
            block(x, *rope).float().sum().backward()
        spec = from_gpt_config(cfg, "moe")
        predicted = paratrain_layer_activation_bytes(spec, s, b, mode=mode) + \
            moe.paratrain_activation_delta(cfg, s * b, b, mode)
        assert sum(saved.values()) == predicted, (extra, mode)
