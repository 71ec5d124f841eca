"""Rank math and validation of Layout: pure, no processes."""

import itertools

import pytest

from paratrain.layout import Layout, LayoutError


def test_default_order_puts_tp_peers_on_consecutive_ranks():
    layout = Layout(dp=2, tp=2)
    assert [layout.coords(r) for r in range(4)] == [
        {"dp": 0, "pp": 0, "cp": 0, "tp": 0}, {"dp": 0, "pp": 0, "cp": 0, "tp": 1},
        {"dp": 1, "pp": 0, "cp": 0, "tp": 0}, {"dp": 1, "pp": 0, "cp": 0, "tp": 1}]
    assert layout.groups("tp") == [[0, 1], [2, 3]]
    assert layout.groups("dp") == [[0, 2], [1, 3]]


def test_coords_and_rank_of_are_inverse_for_every_rank():
    layout = Layout(dp=2, pp=3, cp=2, tp=2, order="cp-tp-dp-pp")
    for rank in range(layout.world_size):
        assert layout.rank_of(**layout.coords(rank)) == rank
    assert len({tuple(layout.coords(r).values()) for r in range(layout.world_size)}) == 24


@pytest.mark.parametrize("axes", ["dp", "pp", "cp", "tp", "dp-cp", "tp-pp"])
def test_groups_partition_the_world_and_vary_only_their_axes(axes):
    layout = Layout(dp=2, pp=2, cp=2, tp=2)
    groups = layout.groups(axes)
    assert sorted(itertools.chain(*groups)) == list(range(16))
    assert all(len(g) == layout.size(axes) for g in groups)
    names = axes.split("-")
    for group in groups:
        coords = [layout.coords(r) for r in group]
        for axis in {"dp", "pp", "cp", "tp"} - set(names):
            assert len({c[axis] for c in coords}) == 1  # fixed off the group's axes


def test_ranks_along_contains_the_rank():
    layout = Layout(dp=4, tp=2)
    for rank in range(8):
        assert rank in layout.ranks_along("dp", rank)
    assert layout.ranks_along("dp", 3) == [1, 3, 5, 7]


@pytest.mark.parametrize("kwargs, words", [
    (dict(dp=0), "positive integer"),
    (dict(zero=4), "ZeRO stage"),
    (dict(order="tp-dp"), "exactly once"),
    (dict(order="tp-cp-pp-xx"), "unknown axis"),
])
def test_bad_layouts_name_the_problem(kwargs, words):
    with pytest.raises(LayoutError, match=words):
        Layout(**kwargs)


def test_world_size_mismatch_names_the_fix():
    with pytest.raises(LayoutError, match="change --nproc to 4"):
        Layout(dp=2, tp=2).check_world(8)


@pytest.mark.parametrize("layout, shape, words", [
    (Layout(tp=3), dict(n_heads=4, n_kv_heads=4, n_layers=2, seq_len=64), "divide the 4 attention heads"),
    (Layout(tp=4), dict(n_heads=8, n_kv_heads=3, n_layers=2, seq_len=64), "KV heads"),
    (Layout(pp=5), dict(n_heads=4, n_kv_heads=4, n_layers=4, seq_len=64), "4 layers cannot be split"),
    (Layout(cp=4), dict(n_heads=4, n_kv_heads=4, n_layers=4, seq_len=60), "multiple of 8"),
])
def test_model_checks_name_the_fix(layout, shape, words):
    with pytest.raises(LayoutError, match=words):
        layout.check_model(**shape)


def test_model_check_accepts_replicated_kv_heads():
    Layout(tp=4).check_model(n_heads=8, n_kv_heads=2, n_layers=2, seq_len=64)


def test_describe():
    assert Layout(dp=2, tp=2, zero=1).describe() == "dp2xtp2 (world 4, zero1)"
    assert Layout().describe() == "single (world 1)"
