"""Planner memory model against the ZeRO paper and Korthikanti et al. (pure arithmetic)."""

from decimal import ROUND_HALF_UP, Decimal

import pytest

from paratrain.layout import Layout
from paratrain.plan.candidate import Candidate, Training
from paratrain.plan.memory import (bytes_per_param, inflight_microbatches,
                                   korthikanti_layer_bytes, layer_activation_bytes,
                                   model_state_bytes, rank_memory, stage_memory)
from paratrain.plan.models import PRESETS, ModelSpec

# ZeRO paper (Rajbhandari et al. 2020) Table 1, 7.5B column, in GB:
# N_d -> (P_os, P_os+g, P_os+g+p) as printed; the baseline is 120 GB at every N_d.
ZERO_TABLE_7B5 = {
    1: ("120", "120", "120"),
    4: ("52.5", "41.3", "30"),
    16: ("35.6", "21.6", "7.5"),
    64: ("31.4", "16.6", "1.88"),
    256: ("30.4", "15.4", "0.47"),
    1024: ("30.1", "15.1", "0.12"),
}


def _printed(value_gb: float, printed: str) -> bool:
    """Whether ``value_gb`` prints as ``printed`` (rounding half up, as the paper does)."""
    step = Decimal(1).scaleb(Decimal(printed).as_tuple().exponent)
    return Decimal(repr(value_gb)).quantize(step, ROUND_HALF_UP) == Decimal(printed)


@pytest.mark.parametrize("n", sorted(ZERO_TABLE_7B5))
def test_zero_table_1_reproduced_to_printed_precision(n):
    psi = 7.5e9
    assert sum(model_state_bytes(psi, n, 0)) / 1e9 == 120
    for stage, printed in zip((1, 2, 3), ZERO_TABLE_7B5[n]):
        assert _printed(sum(model_state_bytes(psi, n, stage)) / 1e9, printed), (n, stage)


@pytest.mark.parametrize("n,expected", [(4, (896, 704, 512)), (16, (608, 368, 128)),
                                        (64, (536, 284, 32)), (256, (518, 263, 8))])
def test_zero_table_1_128b_column(n, expected):
    got = [sum(model_state_bytes(128e9, n, s)) / 1e9 for s in (1, 2, 3)]
    assert got == pytest.approx(expected, abs=0.5)


def test_bytes_per_param():
    assert sum(bytes_per_param("bf16", "adam")) == 16  # 2 + 2 + 12
    assert sum(bytes_per_param("fp32", "adam")) == 16  # 4 + 4 + 8
    assert bytes_per_param("bf16", "sgd") == (2, 2, 8)
    assert bytes_per_param("fp32", "sgd") == (4, 4, 4)


# A standard GPT block: the one Korthikanti et al. count (GELU MLP 4h, dropout, MHA).
GPT_BLOCK = ModelSpec(96, 12288, 96, 96, 4 * 12288, 51200, dropout=True,
                      gated_mlp=False, bias=True, norm="layernorm", name="gpt")


def test_korthikanti_published_forms():
    s, b, h, a = 2048, 1, 12288, 96
    sbh = s * b * h
    assert korthikanti_layer_bytes(s, b, h, a) == sbh * (34 + 5 * a * s / h)
    assert korthikanti_layer_bytes(s, b, h, a, t=8) == sbh * (10 + 24 / 8 + 5 * a * s / (h * 8))
    assert korthikanti_layer_bytes(s, b, h, a, t=8, sp=True) == pytest.approx(
        sbh * (34 / 8 + 5 * a * s / (h * 8)))
    assert korthikanti_layer_bytes(s, b, h, a, t=8, sp=True, recompute="selective") == \
        pytest.approx(sbh * 34 / 8)
    assert korthikanti_layer_bytes(s, b, h, a, recompute="full") == 2 * sbh
    # GPT-3 175B, one sequence, no parallelism: 114 bytes per token and hidden unit.
    assert korthikanti_layer_bytes(s, b, h, a) == pytest.approx(2048 * 12288 * 114)


@pytest.mark.parametrize("t,sp", [(1, False), (2, False), (8, False), (2, True), (8, True)])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_general_activation_count_reduces_to_korthikanti(t, sp, recompute):
    s, b = 2048, 2
    ours = layer_activation_bytes(GPT_BLOCK, s, b, t, sp, recompute, elem=2, flash=False)
    assert ours == pytest.approx(korthikanti_layer_bytes(s, b, GPT_BLOCK.d_model,
                                                         GPT_BLOCK.n_heads, t, sp, recompute))


def test_grouped_kv_and_no_dropout_store_less():
    llama = PRESETS["llama3-70b"]
    mha = ModelSpec(80, 8192, 64, 64, 28672, 128256, name="mha")
    assert layer_activation_bytes(llama, 4096, 1, 8, True, "none") < \
        layer_activation_bytes(mha, 4096, 1, 8, True, "none")
    assert layer_activation_bytes(llama, 4096, 1, 1, False, "none", elem=4) > \
        layer_activation_bytes(llama, 4096, 1, 1, False, "none", elem=2)



def test_swiglu_block_counted_tensor_by_tensor():
    """A Llama block under FlashAttention, no dropout, TP t with SP, every tensor it keeps:
    norm inputs, QKV input and MLP input (4 sbh, sequence-sharded); Q (sbh/t) and K, V
    (grouped heads); the attention output; gate, up and product (3 ffn each, as
    Megatron-core's fused SwiGLU keeps them: silu(gate) is recomputed); the fp32
    log-sum-exp per row and head."""
    llama, s, b, t, e = PRESETS["llama3-405b"], 8192, 1, 8, 2
    h, f = llama.d_model, llama.ffn_hidden
    kv = llama.n_kv_heads * h // llama.n_heads
    expected = (e * s * b * 4 * h / t
                + e * s * b * (h + 2 * kv + h + 3 * f) / t
                + 4 * llama.n_heads * s * b / t)
    assert layer_activation_bytes(llama, s, b, t, True, "none") == pytest.approx(expected)

def test_inflight_microbatches():
    assert inflight_microbatches("gpipe", 4, 16) == 16
    assert inflight_microbatches("1f1b", 4, 16) == 4
    assert inflight_microbatches("1f1b", 4, 16, stage=3) == 1
    assert inflight_microbatches("1f1b", 4, 2) == 2
    assert inflight_microbatches("1f1b", 1, 16) == 1  # no pipeline: accumulation only
    # Korthikanti: interleaving multiplies stage 0's memory by 1 + (p - 1)/(p v).
    p, v = 8, 4
    assert inflight_microbatches("interleaved", p, 64, v) / p == pytest.approx(
        1 + (p - 1) / (p * v))


def test_rank_memory_model_states_follow_zero_and_sharding():
    model = PRESETS["llama3-8b"]
    training = Training(64, 4096)
    base = Candidate(Layout(dp=8), zero=0, micro_batch=1, microbatches=8)
    psi = model.num_params()
    mem = rank_memory(model, training, base)
    assert (mem.params, mem.grads, mem.optimizer) == (2 * psi, 2 * psi, 12 * psi)
    for zero in (1, 2, 3):
        m = rank_memory(model, training, Candidate(Layout(dp=8), zero, 1, 8))
        assert (m.params, m.grads, m.optimizer) == model_state_bytes(psi, 8, zero)
    # TP and PP shard the parameters; the worst stage holds the embedding or the head.
    tp_pp = rank_memory(model, training, Candidate(Layout(dp=2, tp=2, pp=2), 0, 1, 32))
    assert tp_pp.params == 2 * model.stage_params(2, 2, tp_pp.stage)
    assert tp_pp.params < mem.params / 3.5


def test_stage_params_add_up():
    for name in ("llama3-8b", "gpt3-175b"):
        model = PRESETS[name]
        stages = sum(model.stage_params(1, 4, s) for s in range(4))
        tied_copy = model.vocab_size * model.d_model if model.tie_embeddings else 0
        assert stages == model.num_params() + tied_copy


def test_full_recompute_and_cp_shrink_activations():
    model, training = PRESETS["llama3-70b"], Training(64, 8192)
    none = rank_memory(model, training, Candidate(Layout(dp=8, tp=8), 1, 1, 8, recompute="none"))
    full = rank_memory(model, training, Candidate(Layout(dp=8, tp=8), 1, 1, 8, recompute="full"))
    cp = rank_memory(model, training, Candidate(Layout(dp=4, tp=8, cp=2), 1, 1, 16, recompute="none"))
    assert full.activations < none.activations / 10
    # Flash attention stores no s x s scores: every stored tensor halves with cp = 2.
    assert cp.activations == pytest.approx(none.activations / 2)


def test_flash_attention_stores_no_scores_and_selective_adds_none():
    """SDPA/FlashAttention: 4 bytes of log-sum-exp per row and head instead of s x s
    scores; selective recompute then saves exactly that, and its recompute buffer holds
    no score matrix either (the issue's overcount)."""
    model, s, b = PRESETS["llama3-8b"], 8192, 1
    a, elem = model.n_heads, 2
    none = layer_activation_bytes(model, s, b, 1, False, "none")
    selective = layer_activation_bytes(model, s, b, 1, False, "selective")
    assert none - selective == 4 * a * s * b
    korth = layer_activation_bytes(model, s, b, 1, False, "none", flash=False)
    assert korth - selective == elem * a * s * s * b  # the softmax output (no dropout)
    training = Training(8, s)
    sel = rank_memory(model, training, Candidate(Layout(dp=8), 1, 1, 1, recompute="selective"))
    nothing = rank_memory(model, training, Candidate(Layout(dp=8), 1, 1, 1, recompute="none"))
    assert sel.buffers - nothing.buffers == 4 * a * s * b  # the recomputed core's output


def test_logits_counted_once_except_gpipe():
    model, training = PRESETS["llama3-8b"], Training(64, 4096)
    logits = 4096 * model.vocab_size / 8 * (2 + 4)
    last = {}
    for schedule, v in (("1f1b", 1), ("interleaved", 2), ("gpipe", 1)):
        cand = Candidate(Layout(tp=8, pp=4), 0, 1, 64, schedule, v)
        last[schedule] = stage_memory(model, training, cand, 3).buffers
    assert last["interleaved"] == pytest.approx(logits)  # one microbatch, not the in-flight count
    assert last["1f1b"] == pytest.approx(logits)
    assert last["gpipe"] == pytest.approx(64 * logits)


def test_uneven_stage_activations_follow_the_split():
    """126 blocks on 16 stages: stage 1 holds 8 blocks, stage 0 seven (and the embedding)."""
    model, training = PRESETS["llama3-405b"], Training(2048, 8192)
    cand = Candidate(Layout(dp=16, tp=8, pp=16), 1, 1, 128)
    per_layer = layer_activation_bytes(model, 8192, 1, 8, True, "none")
    for stage, layers in ((0, 7), (1, 8), (15, 7)):
        inflight = 16 - stage
        assert stage_memory(model, training, cand, stage).activations == pytest.approx(
            per_layer * layers * min(inflight, 128))


def test_held_buffers_are_counted_from_a_table_of_at_most_3_pp_microbatches():
    """The planner's paratrain memory counts receive buffers and sent tensors from the
    schedule table; it caps the table at 3·pp microbatches (past the warm-up the tables
    repeat), so that the search's shapes share a few tables. The cap must not change any
    rank's count."""
    from paratrain.parallel.pipeline import posting, schedules
    from paratrain.plan.runtime import held_buffers

    for kind, chunks in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3)):
        for pp in range(2, 7):
            for m in range(pp, 6 * pp + 1, pp if kind == "interleaved" else 1):
                tables = schedules.schedule(kind, pp, m, chunks)
                for ahead in (0, 2):
                    want = [posting.held_buffers(t, ahead) for t in tables]
                    got = [held_buffers(kind, pp, m, chunks, r, ahead) for r in range(pp)]
                    assert got == want, (kind, pp, m, chunks, ahead)


def test_paratrain_memory_counts_early_receives_on_gloo_only():
    """On gloo paratrain's pipelines post receives early and hold more buffers; the planner
    counts them there and not under NCCL: the difference is exactly the extra buffers."""
    from paratrain.parallel.pipeline import posting, schedules
    from paratrain.plan.memory import rank_memory
    from paratrain.plan.models import load_model

    model = load_model("tiny")
    training = Training(global_batch=16, seq_len=64, precision="fp32")
    for kind in ("gpipe", "1f1b"):
        cand = Candidate(Layout(pp=2), 0, 2, 8, kind)
        gloo = rank_memory(model, training, cand, paratrain=True, backend="gloo")
        nccl = rank_memory(model, training, cand, paratrain=True, backend="nccl")
        table = schedules.schedule(kind, 2, 8)[gloo.stage]
        extra = (sum(posting.held_buffers(table, posting.GLOO_RECEIVES_AHEAD))
                 - sum(posting.held_buffers(table, 0)))
        assert extra > 0
        activation = 4 * 2 * 64 * model.d_model  # fp32, micro_batch x seq x d_model
        assert gloo.stage == nccl.stage and gloo.buffers - nccl.buffers == extra * activation


def test_paratrain_memory_counts_sent_tensors_until_waited():
    """GPipe's first stage sends every output before its first backward waits for them
    (``posting.sends_before``): each microbatch more is one more activation held."""
    from paratrain.plan.memory import _paratrain_stage_memory
    from paratrain.plan.models import load_model

    model = load_model("tiny")
    activation = 4 * 2 * 64 * model.d_model  # fp32, micro_batch x seq x d_model
    buffers = {}
    for m in (4, 8):
        cand = Candidate(Layout(pp=2), 0, 2, m, "gpipe")
        training = Training(global_batch=2 * m, seq_len=64, precision="fp32")
        buffers[m] = _paratrain_stage_memory(model, training, cand, 0, 2).buffers
    assert buffers[8] - buffers[4] == 4 * activation


def test_first_backwards_of_each_chunk_from_the_tables():
    """The moments a ZeRO-2/3 gradient chunk is allocated: the first is the activation
    peak; with two microbatches per chunk every forward comes first and the second
    chunk's backward starts after the first chunk's drained; in 1F1B's steady state the
    in-flight count holds while every chunk is reached."""
    from paratrain.parallel.pipeline.schedules import inflight_at_first_backwards, peak_inflight

    assert inflight_at_first_backwards("interleaved", 2, 2, 2) == [(2.0, 1.0), (1.5, 1.0)]
    for kind, p, m, v in (("interleaved", 4, 8, 2), ("interleaved", 16, 32, 8),
                          ("1f1b", 4, 8, 1), ("gpipe", 2, 4, 1)):
        moments = inflight_at_first_backwards(kind, p, m, v)
        assert [first[0] for first in moments] == peak_inflight(kind, p, m, v)
        assert all(len(chunks) == v for chunks in moments)
    assert set(inflight_at_first_backwards("interleaved", 16, 32, 8)[0]) == {143 / 8}
    assert inflight_at_first_backwards("interleaved", 16, 16, 8)[1] == tuple(
        16 - 2 * k for k in range(8))
    # The planner's closed form (the search cannot afford to walk the tables) agrees.
    from paratrain.plan.memory import first_backward_inflight
    for p, m, v in ((2, 2, 2), (2, 4, 2), (4, 4, 3), (4, 8, 2), (4, 12, 5), (8, 8, 4),
                    (8, 24, 2), (16, 16, 8), (16, 32, 8), (16, 64, 7)):
        tables = inflight_at_first_backwards("interleaved", p, m, v)
        assert [first_backward_inflight(p, m, v, r) for r in range(p)] == tables, (p, m, v)


def test_accumulated_gradient_counted_at_the_worst_moment():
    """Llama 3 405B on 16,384 GPUs (tp8 pp16 v8, 16 microbatches per replica): ZeRO-2's
    gradient is one chunk's at the activation peak, so it fits where ZeRO-1's persistent
    gradient does not; with 32 microbatches the steady state holds the peak's
    activations with every chunk's gradient."""
    model, training = PRESETS["llama3-405b"], Training(2048, 8192)
    psi, grads = {}, {}
    for m in (16, 32):
        for zero in (1, 2):
            cand = Candidate(Layout(dp=2048 // m, tp=8, pp=16), zero, 1, m, "interleaved", 8, "none")
            mem = stage_memory(model, training, cand, 1)
            psi[m, zero], grads[m, zero] = mem.total, mem.buffers
    stage = model.stage_params(8, 16, 1, 8) * 2  # bf16 gradient
    assert grads[16, 2] - grads[16, 1] == pytest.approx(stage / 8)
    assert grads[32, 2] - grads[32, 1] == pytest.approx(stage)
    assert psi[16, 2] < 71.7 * 2**30 < psi[16, 1]


def test_paratrain_memory_allocates_the_chunk_gradients_as_its_zero_does():
    """paratrain's ZeRO-2 under a pipeline allocates a unit's flat gradient at its first
    backward (parallel/zero/units.py): with two microbatches per replica the second
    chunk's is not yet there at the peak (measured in tests/test_plan_peaks.py)."""
    from paratrain.plan.memory import _paratrain_stage_memory
    from paratrain.plan.models import load_model
    from paratrain.plan.runtime import held_grad_bytes

    model = load_model("tiny")
    training = Training(global_batch=4, seq_len=64, precision="fp32")
    interleaved = Candidate(Layout(dp=2, pp=2), 2, 1, 2, "interleaved", 2)
    zero1 = _paratrain_stage_memory(model, training, Candidate(Layout(dp=2, pp=2), 1, 1, 2,
                                                               "interleaved", 2), 0, 2)
    zero2 = _paratrain_stage_memory(model, training, interleaved, 0, 2)
    held = held_grad_bytes(model, interleaved, 0, "fp32")
    assert held > 0 and zero2.activations == zero1.activations
    assert zero2.buffers - zero1.buffers == held / 2


def test_peak_moment_can_fall_between_the_first_and_last_chunk():
    """Stage 3 of pp4 x v4 with 4 microbatches: the first backwards of its chunks run with
    13, 12, 8 and 4 chunk-forwards alive (of 1/4 microbatch each). With a gradient twice a
    microbatch's activations the worst moment is the second chunk's: 3 microbatches of
    activations plus half the gradient (4.0, against 3.75, 3.5 and 3)."""
    from paratrain.plan.memory import first_backward_inflight, peak_moment

    assert first_backward_inflight(4, 4, 4, 3) == (13 / 4, 12 / 4, 8 / 4, 4 / 4)
    cand = Candidate(Layout(dp=2, pp=4), 2, 1, 4, "interleaved", 4)
    assert peak_moment(cand, 3, 1.0, 2.0) == (3.0, 0.5)
    assert peak_moment(cand, 3, 1.0, 0.0) == (13 / 4, 0.25)  # no gradient: activation peak
    assert peak_moment(cand.but(zero=1), 3, 1.0, 2.0) == (13 / 4, 1.0)  # persistent gradient
