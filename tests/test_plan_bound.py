"""The bounded search (``search(within=F)``, ``paratrain plan --within F``): its lower
bound never exceeds a plan's step time, and it ranks exactly the plans the full search
ranks within F of the fastest, on dense, mixture-of-experts, interleaved, fixed-choice,
trainer-restricted and local (paratrain's own runtime) searches. Pure arithmetic."""

from __future__ import annotations

import collections

import pytest

from helpers import plan
from paratrain.plan.candidate import RECOMPUTE, Training
from paratrain.plan.flops import step_flops
from paratrain.plan.hardware import Calibration, Cluster, gpu_preset, local_cluster
from paratrain.plan.models import PRESETS, load_model
from paratrain.plan.runtimes import RUNTIMES, refuser, restrict, search_options
from paratrain.plan.search import search
from paratrain.plan.bound import family_reach
from paratrain.plan.sweep import Problem

H100 = gpu_preset("h100-80g")
CAL = Calibration(matmul_flops={"fp32": 40e9}, cores=2, alpha=100e-6, beta=1e9,
                  memory=2 * 2**30, optimizer_rate=300e6, compute_efficiency={"fp32": 0.5},
                  layer_overhead=1e-3)


def _moe(tmp_path):
    path = tmp_path / "moe.toml"
    path.write_text('[model]\npreset = "small"\nn_experts = 8\ntop_k = 2\nexpert_ffn = 128\n')
    return load_model(str(path))


def _key(p):
    return p.cand.describe(), p.cand.shard_group, p.cand.reshard_after_forward


def _within(result, factor: float, fastest: float) -> dict:
    return {_key(p): p.time.step for p in result.plans if p.time.step <= factor * fastest}


CASES = {
    "dense": lambda tmp: (PRESETS["llama3-8b"], Training(64, 4096), Cluster(H100, 64), {}),
    "moe": lambda tmp: (_moe(tmp), Training(256, 1024), Cluster(H100, 32), {}),
    "fixed": lambda tmp: (PRESETS["llama3-70b"], Training(128, 4096), Cluster(H100, 64),
                          dict(micro_batch=1, recompute="selective")),
    "local": lambda tmp: (load_model("small"), Training(32, 128, precision="fp32"),
                          local_cluster(4, CAL), {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bounded_search_ranks_the_same_plans_within_its_factor(case, tmp_path):
    model, training, cluster, fixed = CASES[case](tmp_path)
    full = search(model, training, cluster, **fixed)
    fastest = full.plans[0].time.step
    for factor in (1.0, 1.25):
        bounded = search(model, training, cluster, within=factor, **fixed)
        assert bounded.plans[0].time.step == fastest and bounded.within == factor
        assert _within(bounded, factor, fastest) == _within(full, factor, fastest), factor
        assert len(bounded.plans) <= len(full.plans)
    skipped = sum(r.count for k, r in bounded.rejected.items() if "within" in k)
    assert skipped > 0, "the bound skipped nothing: it is not pruning"


@pytest.mark.parametrize("case", ["dense", "moe", "local"])
def test_the_family_bound_never_exceeds_a_plan_of_its_family(case, tmp_path):
    """Over every plan of a full search (ranked or shadowed): the bound of its layout and
    schedule, at any ZeRO stage, recompute and microbatch, is at most its step time, and
    its microbatch is among the sizes the bound lets through."""
    model, training, cluster, _ = CASES[case](tmp_path)
    full = search(model, training, cluster)
    problem = Problem(model, training, cluster, None, RECOMPUTE, step_flops(model, training),
                      within=1.25)
    families = collections.defaultdict(list)
    for p in full.plans + full.shadowed:
        c = p.cand
        families[c.but(zero=0, shard_group=0, reshard_after_forward=None, micro_batch=1,
                       microbatches=1, recompute="none")].append(p)
    for family, plans in families.items():
        bounds, sizes = family_reach(problem, family)
        for p in plans:
            assert bounds[p.cand.recompute] <= p.time.step * (1 + 1e-12), p.cand.describe()
        assert {p.cand.micro_batch for p in plans} <= set(sizes), family.describe()


def test_a_trainers_refusals_are_tallied_inside_the_bounded_search():
    """With a trainer that cannot run every plan, the bound measures from the fastest plan
    it runs: the same plans within the factor as a full search restricted afterwards."""
    model, training, cluster = PRESETS["llama3-8b"], Training(64, 4096), Cluster(H100, 64)
    rt = RUNTIMES["megatron"]
    full = restrict(search(model, training, cluster, **search_options(rt)), rt, model, training)
    bounded = search(model, training, cluster, within=1.1, refuse=refuser(rt, model, training),
                     **search_options(rt))
    fastest = full.plans[0].time.step
    assert _within(bounded, 1.1, fastest) == _within(full, 1.1, fastest)
    assert any(k.startswith("megatron cannot run it") for k in bounded.rejected)


def test_within_on_the_command_line(capsys):
    assert plan("--model", "llama3-8b", "--gpus", "64", "--global-batch", "64", "--within", "0.5") == 2
    assert "--within must be a factor of at least 1" in capsys.readouterr().err
    base = ["--model", "llama3-8b", "--gpus", "64", "--global-batch", "64", "--seq-len", "4096"]
    assert plan(*base, "--within", "1.1", "--explain") == 0
    out = capsys.readouterr().out
    assert "only plans within 1.1x of the fastest are ranked (--within)" in out
    # a layout that fits but is slower than that is evaluated, and said to be beyond it
    assert plan(*base, "--within", "1.05", "--layout", "dp32 tp2 z1 mb1") == 0
    out = capsys.readouterr().out
    assert "status   fits" in out and "1.10x the fastest step, and only plans within 1.05x " \
        "are ranked (--within)" in out, out
    assert plan(*base, "--within", "1.1", "--layout", "dp64 z1 mb1") == 0
    assert "ranks #10 of" in capsys.readouterr().out  # within it: ranked as by a full search


def test_a_slow_full_search_suggests_within():
    from paratrain.plan.report import SLOW_SEARCH_S, search_line
    from paratrain.plan.results import SearchResult

    slow, quick = SearchResult(plans=[], seconds=SLOW_SEARCH_S + 1), SearchResult(plans=[])
    assert "--within 1.25 ranks only the plans within 25%" in search_line(slow)
    assert "--within" not in search_line(quick)
    assert "(--within)" in search_line(SearchResult(plans=[], seconds=60, within=1.5))


def test_a_layout_beyond_the_bound_completes_as_a_full_search_completes_it(capsys):
    """A bounded search times some plans beyond its reach but not all: ``--layout``'s best
    completion there comes from enumerating, not from the plans the search happened to time."""
    import json

    base = ["--model", "llama3-8b", "--gpus", "64", "--global-batch", "64", "--seq-len", "4096",
            "--json", "--layout"]
    got = {}
    for spec in ("dp16 tp4", "dp32 tp2"):
        for within in ((), ("--within", "1.05")):
            assert plan(*base, spec, *within) == 0
            ev = json.loads(capsys.readouterr().out)["layouts"][0]
            got[spec, bool(within)] = (ev["layout"], ev["time_s"]["step"])
        assert got[spec, True] == got[spec, False], spec
