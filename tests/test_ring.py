"""Ring collectives (comm/ring.py) against the backend's native ones; the α-β cost model.

Each spawned world checks many shapes, dtypes and ops at once: starting a world costs
seconds, a check inside it milliseconds.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist
from distributed import run_world

from paratrain.comm import collectives as C
from paratrain.comm import cost
from paratrain.comm.ring import chunk_sizes, ring_all_gather, ring_all_reduce, ring_reduce_scatter

# Element counts that do and do not divide by 2, 3 and 4 (1 < p leaves chunks empty),
# 2-D shapes (dim 0 of 13 divides by none of 2, 3, 4), and an empty tensor.
SHAPES = [(1,), (7,), (1000,), (1001,), (3, 5), (13, 7), (0,)]
DTYPES = [torch.float32, torch.int64]


def _data(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=gen, dtype=dtype)


def _same(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    # The ring adds in a different order than the backend: allow rounding for floats,
    # demand exact equality for integers.
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6, msg=lambda m: f"{what}: {m}")


def _native_all_gather(chunk: torch.Tensor, total: int, group) -> torch.Tensor:
    """Native all_gather of possibly uneven chunks: gloo's list all_gather needs equal
    sizes, so pad each chunk to the largest and trim afterwards."""
    p = dist.get_world_size(group)
    sizes = chunk_sizes(total, p)
    padded = torch.zeros(max(sizes), dtype=chunk.dtype)
    padded[: chunk.numel()] = chunk.reshape(-1)
    parts = [torch.empty_like(padded) for _ in range(p)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([part[:n] for part, n in zip(parts, sizes)])


def _check_group(group, seed: int) -> int:
    """Every ring collective on ``group`` against the native one; returns checks made."""
    p, r = C.size(group), C.rank(group)
    checks = 0
    for dtype in DTYPES:
        for shape in SHAPES:
            x = _data(shape, dtype, seed * 1000 + r * 100 + len(shape) * 10 + shape[0])
            tag = f"p={p} rank={r} {dtype} {shape}"

            expected = x.clone()
            dist.all_reduce(expected, group=group)
            got = x.clone()
            ring_all_reduce(got, group)
            _same(got, expected, f"all-reduce {tag}")

            before = x.clone()
            mine = ring_reduce_scatter(x, group)
            assert torch.equal(x, before), f"reduce-scatter changed its input ({tag})"
            _same(mine, expected.reshape(-1).tensor_split(p)[r], f"reduce-scatter {tag}")
            if shape[0] % p == 0 and x.numel() > 0:  # native needs even dim-0 chunks
                native = torch.empty((shape[0] // p, *shape[1:]), dtype=dtype)
                C.reduce_scatter(native, x, group)
                _same(mine.view(native.shape), native, f"reduce-scatter vs native {tag}")

            total = x.numel()
            chunk = x.reshape(-1)[: chunk_sizes(total, p)[r]].clone()
            gathered = ring_all_gather(chunk, group, out=torch.empty(shape, dtype=dtype))
            expected = _native_all_gather(chunk, total, group)
            _same(gathered.reshape(-1), expected, f"all-gather {tag}")
            checks += 3
    return checks + _check_ops_and_layouts(group, seed)


def _check_ops_and_layouts(group, seed: int) -> int:
    """avg/max/min, a non-contiguous tensor, even all-gather without ``out``."""
    p, r = C.size(group), C.rank(group)
    x = _data((9, 11), torch.float32, seed + r)
    for op, native_op in (("avg", dist.ReduceOp.AVG), ("max", dist.ReduceOp.MAX),
                          ("min", dist.ReduceOp.MIN)):
        expected = x.clone()
        dist.all_reduce(expected, op=native_op, group=group)
        got = x.clone()
        ring_all_reduce(got, group, op=op)
        _same(got, expected, f"all-reduce op={op} p={p}")

    strided = x.clone().t()  # non-contiguous: the result must land in the original storage
    expected = strided.contiguous()
    dist.all_reduce(expected, group=group)
    ring_all_reduce(strided, group)
    _same(strided, expected, f"all-reduce of a transposed tensor p={p}")

    chunk = _data((2, 3), torch.int64, seed + r)
    parts = [torch.empty_like(chunk) for _ in range(p)]
    dist.all_gather(parts, chunk, group=group)
    _same(ring_all_gather(chunk, group), torch.cat(parts).reshape(-1), f"even all-gather p={p}")
    return 5


def _world_checks(partitions: list[list[list[int]]]) -> dict:
    """Run in every rank: checks on the default (world) group, then, for each partition of
    the world into sub-groups, on the sub-group holding this rank."""
    world = dist.group.WORLD
    checks = {dist.get_world_size(): _check_group(world, seed=1)}
    for seed, partition in enumerate(partitions, start=2):
        mine = None
        for ranks in partition:  # new_group is collective: every rank creates every group
            group = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                mine = group
        checks[C.size(mine)] = _check_group(mine, seed)

    with pytest.raises(ValueError, match="chunk has 3 elements"):
        ring_all_gather(torch.zeros(3), world, out=torch.zeros(dist.get_world_size()))
    with pytest.raises(TypeError, match="floating-point"):
        ring_all_reduce(torch.zeros(3, dtype=torch.int64), world, op="avg")
    return {"rank": dist.get_rank(), "checks": checks}


def test_ring_collectives_match_native_world_of_2() -> None:
    """The default group of 2 ranks, and groups of one rank (a copy or a no-op)."""
    results = run_world(_world_checks, 2, [[[0], [1]]])
    assert [res["checks"] for res in results] == [{2: 47, 1: 47}] * 2


def test_ring_collectives_match_native_world_of_4() -> None:
    """The default group of 4; groups of 3 and 1; non-consecutive groups of 2 ({1, 3}),
    whose group-relative ranks differ from the global ones. One world instead of three:
    starting a world costs more than all its checks."""
    results = run_world(_world_checks, 4, [[[0, 1, 2], [3]], [[1, 3], [0, 2]]])
    group_sizes = [sorted(res["checks"]) for res in results]
    assert group_sizes == [[2, 3, 4], [2, 3, 4], [2, 3, 4], [1, 2, 4]]


# ---- pure tests: chunk convention and cost model -------------------------------------


def test_chunk_sizes_follow_tensor_split() -> None:
    for numel in (0, 1, 7, 1000, 1001):
        for parts in (1, 2, 3, 4, 8):
            expected = [c.numel() for c in torch.arange(numel).tensor_split(parts)]
            assert chunk_sizes(numel, parts) == expected


def test_cost_formulas() -> None:
    a, b, n = 5e-6, 10e9, 64e6
    for p in (2, 3, 4, 8, 64):
        assert math.isclose(cost.all_reduce_time(n, p, a, b),
                            2 * (p - 1) * a + 2 * (p - 1) / p * n / b)
        for fn in (cost.all_gather_time, cost.reduce_scatter_time, cost.all_to_all_time):
            assert math.isclose(fn(n, p, a, b), (p - 1) * a + (p - 1) / p * n / b)
        assert math.isclose(cost.broadcast_time(n, p, a, b), (p - 1) * a + n / b)
        # all-reduce = reduce-scatter + all-gather, term by term
        assert math.isclose(cost.all_reduce_time(n, p, a, b),
                            cost.reduce_scatter_time(n, p, a, b) + cost.all_gather_time(n, p, a, b))
    assert math.isclose(cost.p2p_time(n, a, b), a + n / b)
    for op in cost.OPS[:-1]:
        assert cost.collective_time(op, n, 1, a, b) == 0.0  # one rank moves nothing
    assert cost.collective_time("all_reduce", n, 4, a, b) == cost.all_reduce_time(n, 4, a, b)
    with pytest.raises(ValueError, match="unknown collective"):
        cost.collective_time("gather", n, 4, a, b)
    with pytest.raises(ValueError, match="beta > 0"):
        cost.all_reduce_time(n, 4, a, 0)


def test_busbw_factors_match_nccl_tests() -> None:
    for p in (1, 2, 4, 8):
        assert cost.busbw_factor("all-reduce", p) == pytest.approx(2 * (p - 1) / p)
        assert cost.busbw_factor("all-gather", p) == pytest.approx((p - 1) / p)
        assert cost.busbw_factor("reduce-scatter", p) == pytest.approx((p - 1) / p)
        assert cost.busbw_factor("broadcast", p) == 1.0
        assert cost.busbw_factor("p2p", p) == 1.0
    # 1 GB all-reduced in 1 s on 8 ranks: algbw 1 GB/s, busbw 1.75 GB/s
    assert cost.algbw(1e9, 1.0) == 1e9
    assert cost.busbw("all-reduce", 1e9, 1.0, 8) == pytest.approx(1.75e9)
    # With no latency busbw recovers the link bandwidth β, whatever op and p
    for op in cost.OPS:
        for p in (2, 3, 8):
            t = cost.collective_time(op, 1e8, p, 0.0, 25e9)
            assert cost.busbw(op, 1e8, t, p) == pytest.approx(25e9)


def test_fit_alpha_beta_recovers_the_model() -> None:
    sizes = [2.0**k for k in range(10, 25, 2)]
    for op, p in (("all-reduce", 4), ("all-gather", 2), ("p2p", 2)):
        times = [cost.collective_time(op, n, p, 3e-5, 2e9) for n in sizes]
        alpha, beta = cost.fit_alpha_beta(op, p, sizes, times)
        assert alpha == pytest.approx(3e-5) and beta == pytest.approx(2e9)
    with pytest.raises(ValueError, match="two different sizes"):
        cost.fit_alpha_beta("all-reduce", 2, [1.0, 1.0], [1.0, 2.0])


# ---- the benchmark's argument parsing and one tiny run -------------------------------


def _bench_parser():
    import argparse

    from paratrain.bench import comm

    parser = argparse.ArgumentParser()
    comm.add_parser(parser.add_subparsers())
    return parser


def test_bench_comm_arguments() -> None:
    from paratrain.bench.comm import parse_size

    assert [parse_size(s) for s in ("1024", "64K", "1M", "16MiB", "2kb", "1.5K")] == \
        [1024, 65536, 1 << 20, 16 << 20, 2048, 1536]
    parser = _bench_parser()
    args = parser.parse_args(["comm", "--sizes", "64K,1M", "--ops", "all-reduce"])
    assert args.sizes == [65536, 1 << 20] and args.ops == ["all-reduce"]
    for bad in (["comm", "--nproc", "1"], ["comm", "--sizes", "12Q"], ["comm", "--ops", "gather"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)


def test_bench_comm_runs(capsys: pytest.CaptureFixture[str]) -> None:
    args = _bench_parser().parse_args(
        ["comm", "--sizes", "1K,16K", "--iters", "3", "--warmup", "1", "--backend", "gloo"])
    assert args.func(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert summary["benchmark"] == "comm" and summary["paratrain"] > 0 and summary["peer"] > 0
    assert sum(line.split()[:1] in (["all-reduce"], ["all-gather"], ["reduce-scatter"])
               for line in lines) == 3 * 2 * 2  # ops x impls x sizes
