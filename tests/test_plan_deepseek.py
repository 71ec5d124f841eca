"""The planner on DeepSeek-V3 (issue 40 items 2 and 3): multi-head latent attention counted
from its ranks, the published 671B / 37B, the refusal to write a train config for it, the
load-imbalance headroom and the grouped GEMM of the routed experts. Pure logic, no
processes."""

from __future__ import annotations

import dataclasses
import json

import pytest

from helpers import plan
from paratrain.layout import Layout
from paratrain.plan import export, mla, moe
from paratrain.plan.candidate import Candidate, Training
from paratrain.plan.compute import matmul_time
from paratrain.plan.cost import _rates, step_time
from paratrain.plan.flops import attention_core_flops, step_flops
from paratrain.plan.hardware import Cluster, gpu_preset
from paratrain.plan.memory import rank_memory
from paratrain.plan.models import load_model
from paratrain.plan.search import search

FULL = "examples/deepseek-v3"
"""DeepSeek-V3's published config.json (the Hugging Face repository's, weights left out)."""
TINY = {"hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 16,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
        "q_lora_rank": 16, "kv_lora_rank": 8, "qk_rope_head_dim": 4, "qk_nope_head_dim": 8,
        "v_head_dim": 8, "vocab_size": 100, "max_position_embeddings": 256, "n_group": 2,
        "topk_group": 1}
"""DeepSeek-V3 at toy size: one dense block, two MoE blocks of 8 experts and a shared one."""


def deepseek(tmp_path, name: str = "ds", **changes):
    """A DeepSeek-V3 config.json with ``TINY``'s (and ``changes``') values in directory
    ``name``, as a ModelSpec."""
    raw = json.loads(open(f"{FULL}/config.json").read())
    raw.update(TINY, **changes)
    directory = tmp_path / name
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(raw))
    return load_model(str(directory))


def mla_hand_count(h, a, r_q, r_kv, d_r, d_n, d_v, tp=1):
    """One block's latent attention by hand: q_a, q_a_layernorm, q_b; kv_a_proj_with_mqa,
    kv_a_layernorm, kv_b; o_proj (per-head parts split by tp)."""
    heads = a // tp
    query = h * r_q + r_q + r_q * heads * (d_n + d_r) if r_q else h * heads * (d_n + d_r)
    return query + h * (r_kv + d_r) + r_kv + r_kv * heads * (d_n + d_v) + heads * d_v * h


def test_mla_parameters_match_a_hand_count_and_transformers(tmp_path):
    model = deepseek(tmp_path)
    assert model.mla == mla.LatentAttention(16, 8, 4, 8, 8)
    for tp in (1, 2, 4):
        assert mla.params(model, tp) == mla_hand_count(64, 4, 16, 8, 4, 8, 8, tp)
    no_q_latent = deepseek(tmp_path, "q_proj", q_lora_rank=None)
    assert mla.params(no_q_latent, 1) == mla_hand_count(64, 4, 0, 8, 4, 8, 8)
    # a block: the attention, two RMSNorms and the MLP (dense, or experts + shared + router)
    dense = mla_hand_count(64, 4, 16, 8, 4, 8, 8) + 2 * 64 + 3 * 64 * 96
    routed = 8 * 3 * 64 * 16
    sparse = mla_hand_count(64, 4, 16, 8, 4, 8, 8) + 2 * 64 + 64 * 8 + routed + 3 * 64 * 16
    assert model.num_params() == dense + 2 * sparse + 2 * 100 * 64 + 64
    assert model.active_params() == model.num_params() - 2 * (8 - 2) * 3 * 64 * 16

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    raw = json.loads((tmp_path / "ds" / "config.json").read_text())
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**raw))
    # the selection bias (e_score_correction_bias) is balanced, not trained: paratrain's
    # planner leaves it out of the parameters, as it does its own (moe.expert_bias_params)
    counted = sum(p.numel() for n, p in hf.named_parameters() if "e_score_correction_bias" not in n)
    assert model.num_params() == counted


def test_deepseek_v3_has_its_published_671b_total_and_37b_active():
    model = load_model(FULL)
    # DeepSeek-V3 report: 671B total, 37B activated per token, the MTP module's 14B not
    # included (num_nextn_predict_layers is not counted)
    assert model.num_params() == pytest.approx(671e9, rel=0.002)
    assert model.active_params() == pytest.approx(37e9, rel=0.02)
    assert model.active_params() < model.num_params()
    assert (model.n_experts, model.top_k, model.expert_ffn, model.shared_ffn,
            model.moe_first_dense, model.ffn_hidden) == (256, 8, 2048, 2048, 3, 18432)
    # FLOPs on the active weights: 6 x active x tokens plus attention, give or take the
    # embedding (no FLOPs) and the attention core
    training = Training(8, 4096)
    per_token = step_flops(model, training) / training.tokens
    assert 6 * (model.active_params() - 129280 * 7168) < per_token < 6 * model.active_params() * 1.3


def test_mla_attention_core_and_stored_activations():
    model = load_model(FULL)
    # QK^T over d_n + d_r = 192, softmax.V over d_v = 128, 128 heads split by tp
    assert attention_core_flops(model, 1, 4096, 4096, 8) == 2 * 4096 * 4096 * 16 * (192 + 128)
    plain = dataclasses.replace(model, mla=None)
    assert attention_core_flops(plain, 1, 4096, 4096, 8) == 4 * 4096 * 4096 * 7168 / 8
    inside, latent = mla.stored(model)
    assert (inside, latent) == (128 * (2 * 192 + 2 * 128), 2 * 1536 + 2 * 512 + 64)
    training = Training(64, 4096)
    cand = Candidate(Layout(dp=8, pp=8, ep=8), 1, 1, 8)
    assert (rank_memory(model, training, cand).activations
            != rank_memory(plain, training, cand).activations)


def test_out_refuses_latent_attention_by_name(tmp_path, capsys):
    model = deepseek(tmp_path)
    out = tmp_path / "train.toml"
    code = plan("--model", str(tmp_path / "ds"), "--gpus", "8", "--seq-len", "64",
                "--global-batch", "16", "--out", str(out))
    captured = capsys.readouterr()
    assert code == 2 and not out.exists()
    assert "multi-head latent attention (MLA" in captured.err and "planner-only" in captured.err
    assert "planner-only: `paratrain train` does not run it" in captured.out  # the model line
    assert export.refusal(Candidate(Layout(dp=8), 0, 1, 2), model, Training(16, 64)) == mla.REFUSAL
    with pytest.raises(ValueError, match="--cluster local plans paratrain's own processes"):
        mla.check_cluster(model, "local")  # its memory is paratrain's runtime's, which has no MLA
    mla.check_cluster(model, "gpu")


def test_imbalance_scales_the_busiest_ranks_expert_work(tmp_path):
    model = load_model(FULL)
    cluster = Cluster(gpu_preset("h100-80g"), 64, 8)
    cand = Candidate(Layout(dp=8, pp=8, ep=8), 1, 1, 8)
    times, memories = [], []
    for f in (1.0, 1.25, 1.5):
        training = Training(64, 4096, moe_imbalance=f)
        times.append(step_time(model, training, cluster, cand))
        memories.append(rank_memory(model, training, cand))
    balanced = Training(64, 4096)
    assert times[0] == step_time(model, balanced, cluster, cand)  # 1.0 is today's numbers
    assert memories[0] == rank_memory(model, balanced, cand)
    assert times[0].ep < times[1].ep < times[2].ep
    assert times[0].compute < times[1].compute < times[2].compute
    assert memories[0].activations < memories[1].activations < memories[2].activations
    assert times[2].ep == pytest.approx(1.5 * times[0].ep, rel=0.05)  # bytes x 1.5, same alpha
    # without expert parallelism a rank runs all its own rows: no headroom
    one = cand.but(layout=Layout(dp=8, pp=8))
    assert step_time(model, Training(64, 4096, moe_imbalance=1.5), cluster, one) == \
        step_time(model, balanced, cluster, one)
    with pytest.raises(ValueError, match="at least 1"):
        Training(64, 4096, moe_imbalance=0.5)


def test_the_grouped_gemm_is_slower_per_flop_with_fewer_rows_per_expert():
    model, cluster = load_model(FULL), Cluster(gpu_preset("h100-80g"), 8, 8)
    rate, _, half = _rates(Training(8, 4096), cluster)
    tokens, h, f = 4096, model.d_model, model.expert_ffn  # one sequence per rank

    def routed(ep: int) -> float:  # forward + backward seconds of the gate+up grouped GEMM
        (_, _, _, _), (m, k, n, count), _ = moe.matmuls(model, tokens, 1, ep)[:3]
        assert m * count == tokens * model.top_k  # the same rows, so the same FLOPs
        return sum(moe.grouped_gemm_times(m, k, n, count, rate, half, cluster.gpu, 2))

    # rows per local expert tokens * top_k * ep / E: 128 at ep1, 8192 at ep64
    assert moe.matmuls(model, tokens, 1, 1)[1][:1] == (128,)
    assert routed(1) > routed(8) > routed(64)
    one_gemm = matmul_time(tokens * model.top_k, h, 2 * f, rate, half, cluster.gpu, 2)
    assert routed(1) > 3 * one_gemm  # the forward alone is one third of this sum
    # imbalance: the busiest rank's experts run factor x the rows
    assert moe.matmuls(model, tokens, 1, 64, 1.5)[1][0] == 1.5 * 8192


def test_deepseek_v3_is_planned_with_expert_parallelism(tmp_path):
    model = load_model(FULL)
    # 256 GPUs without context parallelism: the full search at 2,048 is
    # benchmarks/plan_speed.py's
    training, cluster = Training(256, 4096), Cluster(gpu_preset("h100-80g"), 256, 8)
    result = search(model, training, cluster, context_parallel=False)
    assert result.plans
    best = result.plans[0]
    assert best.cand.ep > 1 and best.memory.total <= cluster.memory_limit
    assert best.time.ep > 0
