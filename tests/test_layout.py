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
    (dict(order="tp-dp"), "exactly once"),
    (dict(order="tp-cp-pp-xx"), "unknown axis"),
])
def test_bad_layouts_name_the_problem(kwargs, words):
    with pytest.raises(LayoutError, match=words):
        Layout(**kwargs)


def test_world_size_mismatch_names_the_fix():
    with pytest.raises(LayoutError, match="change --nproc to 4"):
        Layout(dp=2, tp=2).check_world(8)


def test_describe():
    assert Layout(dp=2, tp=2).describe() == "dp2xtp2 (world 4)"
    assert Layout().describe() == "single (world 1)"
