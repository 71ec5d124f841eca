"""Uneven pipeline stages (layers % pp != 0), one rule for plan, train and the partition
(``paratrain.stages``): the planner's split is the one ``train`` cuts, and training on
uneven stages matches a single process (losses, grad norms, parameters at 1e-5, fp32,
clipping off)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distributed import run_world
from paratrain import rules
from paratrain.layout import LayoutError
from paratrain.mesh import Mesh
from paratrain.models.gpt import GPT, PRESETS as GPT_PRESETS
from paratrain.parallel.pipeline import split_model
from paratrain.plan.models import from_gpt_config
from paratrain.stages import check_pipeline_split, pipeline_split
from paratrain.train import loop
from paratrain.train.config import load
from helpers import rel_error

RTOL = 1e-5


def test_train_cuts_the_planners_split():
    """126 blocks on 16 stages (a width-16 model, so it builds in a blink): the chunks
    ``split_model`` gives each rank have the planner's block counts, 7, 8 x 14, 7."""
    cfg = GPT_PRESETS["tiny"].__class__(d_model=16, n_layers=126, n_heads=2, n_kv_heads=1,
                                        ffn_hidden=32, vocab_size=2048, max_seq_len=16)
    spec = from_gpt_config(cfg, "deep")
    counts = [len(split_model(GPT(cfg), rank, 16)[0].layer_ids) for rank in range(16)]
    assert tuple(counts) == spec.stage_layer_counts(16)
    assert counts[0] < counts[1] and counts[-1] < counts[1] and sum(counts) == 126
    for n, pp, v in ((5, 2, 1), (7, 3, 1), (5, 2, 2), (8, 4, 1)):
        small = GPT_PRESETS["tiny"].__class__(**{**GPT_PRESETS["tiny"].__dict__, "n_layers": n})
        got = [sum(len(c.layer_ids) for c in split_model(GPT(small), r, pp, v)) for r in range(pp)]
        assert tuple(got) == from_gpt_config(small, "tiny").stage_layer_counts(pp, v), (n, pp, v)
    assert [len(r) for r in pipeline_split(8, 4)] == [2, 2, 2, 2]  # even: Megatron's split


def test_one_rule_refuses_empty_stages_but_the_ends():
    with pytest.raises(ValueError, match="at least one layer"):
        check_pipeline_split(4, 7)
    with pytest.raises(LayoutError, match="at least one layer"):
        rules.pipeline_split(5, pp=4, virtual_stages=2)
    rules.pipeline_split(7, pp=3)  # uneven: fine
    rules.pipeline_split(4, pp=3, virtual_stages=2)  # 6 chunks: the embedding and head alone
    assert [len(r) for r in pipeline_split(4, 3, 2, 0.5, 0.7)] == [0, 1, 1, 1, 1, 0]
    assert [len(r) for r in pipeline_split(4, 5, 1, 0.5, 0.7)] == [1, 1, 1, 1, 0]


def test_llama3_interleaves_one_layer_per_chunk_with_the_ends_alone():
    """Llama 3 405B's own interleaving (§3.3.2): 126 layers on 16 ranks x 8 chunks, the
    embedding and the head as chunks of their own; the planner searches it."""
    from paratrain.plan.models import PRESETS
    from paratrain.plan.search import _virtual_stages

    llama = PRESETS["llama3-405b"]
    runs = pipeline_split(126, 16, 8, *llama_costs(llama))
    assert [len(r) for r in runs] == [0] + [1] * 126 + [0]
    assert llama.stage_layer_counts(16, 8) == (7,) + (8,) * 14 + (7,)
    assert 8 in _virtual_stages(126, 16) and 7 in _virtual_stages(126, 16)
    # Software with even stages only (Megatron-LM before 2023) cannot give the embedding
    # and the head chunks of their own: 30 layers on 2 ranks split into 15, not 16.
    assert 16 in _virtual_stages(30, 2) and _virtual_stages(30, 2, uneven=False) == [3, 5, 15]


def llama_costs(spec):
    from paratrain.stages import head_costs
    return head_costs(spec.vocab_size, spec.d_model, spec.layer_params(1))


def config(tmp: str, n_layers: int, **parallel):
    return load(None, {"preset": "tiny", "n_layers": n_layers, "seq_len": 32,
                       "global_batch": 8, "steps": 3, "warmup_steps": 1, "lr": 1e-3,
                       "grad_clip": 0.0, "eval_every": 0, "eval_batches": 1,
                       "progress": False, "run_dir": tmp, "nproc": parallel.pop("nproc", 1),
                       **parallel}).validate()


def run_steps(configs):
    """Per config: each step's loss and gradient norm, and the final full parameters."""
    out = []
    for cfg in configs:
        run = loop.build(cfg, Mesh.build(cfg.layout))
        records = [loop.train_step(run, step) for step in range(cfg.train.steps)]
        params = run.engine.full_state_dict()
        out.append(([r["loss"] for r in records], [float(r["grad_norm"]) for r in records],
                    {k: v.detach().clone() for k, v in params.items()}
                    if dist.get_rank() == 0 else None))
    return out


def assert_parity(got, want, what):
    for name, a, b in (("loss", got[0], want[0]), ("grad_norm", got[1], want[1])):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=RTOL, atol=0,
                                   msg=lambda m: f"{what} {name}: {m}")
    for name, ref in want[2].items():
        assert rel_error(got[2][name], ref) <= RTOL, (what, name)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("uneven-ref"))
    two, three, five, seven = run_world(run_steps, 1, [config(tmp, n) for n in (2, 3, 5, 7)])[0]
    return {2: two, 3: three, 5: five, 7: seven}


def test_five_layers_on_two_stages_match_one_process(references, tmp_path):
    variants = [dict(schedule="1f1b", microbatches=4),
                dict(schedule="interleaved", virtual_stages=2, microbatches=4),
                dict(schedule="gpipe", microbatches=2)]
    cfgs = [config(str(tmp_path), 5, nproc=2, pp=2, **v) for v in variants]
    for got, variant in zip(run_world(run_steps, 2, cfgs)[0], variants):
        assert_parity(got, references[5], variant)


def test_seven_layers_on_three_stages_match_one_process(references, tmp_path):
    cfg = config(str(tmp_path), 7, nproc=3, pp=3, schedule="1f1b", microbatches=4)
    assert_parity(run_world(run_steps, 3, [cfg])[0][0], references[7], "7 layers pp3")


def test_chunks_holding_only_the_embedding_or_the_head_match_one_process(references, tmp_path):
    """More chunks than blocks: 2 layers on pp2 x v2 put the embedding and the head in
    chunks of their own; 3 layers leave one end alone."""
    cfgs = [config(str(tmp_path), n, nproc=2, pp=2, schedule="interleaved", virtual_stages=2,
                   microbatches=4) for n in (2, 3)]
    for got, n in zip(run_world(run_steps, 2, cfgs)[0], (2, 3)):
        assert_parity(got, references[n], f"{n} layers on 4 chunks")


def test_sharded_chunks_holding_only_the_embedding_or_the_head_match_one_process(
        references, tmp_path):
    """ZeRO-2 and ZeRO-3 shard a chunk's units over its data-parallel group; an end chunk
    with no block still shards (and gathers) the embedding or the head alone."""
    cfgs = [config(str(tmp_path), 2, nproc=4, dp=2, pp=2, zero=zero, schedule="interleaved",
                   virtual_stages=2, microbatches=4) for zero in (2, 3)]
    for got, zero in zip(run_world(run_steps, 4, cfgs)[0], (2, 3)):
        assert_parity(got, references[2], f"2 layers on 4 chunks, dp2 zero{zero}")
