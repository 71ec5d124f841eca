"""``paratrain bench comm``: time collectives the way nccl-tests does, native vs ring.

For each op and size, every rank times the backend's native collective (through
``paratrain.comm.collectives``) and the ring built from send/recv
(``paratrain.comm.ring``) on the same tensors. Each iteration starts after a barrier;
an iteration's time is the slowest rank's, and the reported time is the median over
iterations. Size is nccl-tests' "size": the bytes of the full tensor (the all-reduced
tensor, the gathered output, the reduce-scatter input), so

    algbw = size / time        busbw = algbw × factor    (see ``paratrain.comm.cost``)

and busbw is comparable across ops and world sizes. The table is printed by the parent,
followed by one JSON line (the last line) comparing ring to native at the largest size.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from ..comm import collectives as C
from ..comm import cost
from ..comm.ring import ring_all_gather, ring_all_reduce, ring_reduce_scatter
from ..launch import RankFailed, pick_backend, spawn
from .flags import at_least

OPS = ("all-reduce", "all-gather", "reduce-scatter")
IMPLS = ("native", "ring")
DEFAULT_SIZES = "1K,4K,16K,64K,256K,1M,4M,16M"
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_ELEMENT = torch.float32
_ELEMENT_BYTES = 4

# ---- command line ---------------------------------------------------------------------


def parse_size(text: str) -> int:
    """Bytes from '1024', '64K', '1M', '16MiB', '2kb', '1.5K' (units are powers of 1024)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]?)(?:i?b)?\s*", text, re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(
            f"size {text!r} is not a number of bytes with an optional K, M or G (e.g. 64K, 1M)")
    nbytes = int(float(match[1]) * _UNITS[match[2].upper()])
    if nbytes < 1:
        raise argparse.ArgumentTypeError(f"size {text!r} must be at least 1 byte")
    return nbytes


def _sizes(text: str) -> list[int]:
    sizes = sorted({parse_size(part) for part in text.split(",") if part.strip()})
    if not sizes:
        raise argparse.ArgumentTypeError(f"give at least one size, e.g. 1M,64M; got {text!r}")
    return sizes


MAX_NPROC = 64
"""Processes one machine's benchmark starts at most (each imports torch: ~300 MB)."""
BUFFERS = 3
"""Tensors of the largest size each rank holds at once (input, output, a ring's scratch)."""


def _check_scale(nproc: int, sizes: list[int]) -> None:
    """Before spawning: a world this machine can start, and buffers its memory holds."""
    if nproc > MAX_NPROC:
        raise ValueError(f"--nproc {nproc}: more than {MAX_NPROC} processes on one machine; "
                         f"lower --nproc")
    need = nproc * BUFFERS * max(sizes)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > total:
        raise ValueError(f"--sizes: {nproc} ranks x {BUFFERS} buffers of {max(sizes):,} bytes "
                         f"need {need / 2**30:.1f} GiB, and this machine has "
                         f"{total / 2**30:.1f} GiB; lower the largest size or --nproc")


def _ops(text: str) -> list[str]:
    ops = [op.strip().replace("_", "-") for op in text.split(",") if op.strip()]
    unknown = [op for op in ops if op not in OPS]
    if unknown or not ops:
        raise argparse.ArgumentTypeError(f"ops must be a comma list of {', '.join(OPS)}; "
                                         f"got {text!r}")
    return list(dict.fromkeys(ops))


_nproc = at_least(2, ": a collective needs at least 2 processes to communicate, with 1 "
                     "there is nothing to measure (try --nproc 2)")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``comm`` sub-command (under ``paratrain bench``); it runs ``run(args)``."""
    parser = subparsers.add_parser(
        "comm", help="time collectives (algbw/busbw like nccl-tests), native vs ring",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=_nproc, default=2, help="processes (default 2)")
    parser.add_argument("--sizes", type=_sizes, default=_sizes(DEFAULT_SIZES),
                        help=f"comma list of full-tensor sizes in bytes, K/M/G = 1024-based "
                             f"(default {DEFAULT_SIZES})")
    parser.add_argument("--ops", type=_ops, default=list(OPS),
                        help=f"comma list of {', '.join(OPS)} (default all)")
    parser.add_argument("--iters", type=at_least(1), default=20,
                        help="timed iterations per op and size (default 20)")
    parser.add_argument("--warmup", type=at_least(0), default=5,
                        help="untimed iterations first (default 5)")
    parser.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                        help="auto = nccl with GPUs, gloo otherwise")
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="also write every measurement and the summary to PATH")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Spawn the world, measure, print the table and the JSON summary line."""
    try:
        if args.json:
            check_writable(args.json, "--json")  # before minutes of measuring, not after
        backend = pick_backend(args.backend)
        if args.nproc < 2:
            raise ValueError("a collective needs at least 2 processes; use --nproc 2 or more")
        _check_scale(args.nproc, args.sizes)
        results = spawn(_measure_all, args.nproc, list(args.ops), list(args.sizes),
                        args.iters, args.warmup, backend=backend, timeout_s=900)
    except (ValueError, RankFailed) as exc:
        print(f"paratrain bench comm: error: {exc}", file=sys.stderr)
        return 2
    rows = results[0]
    summary = summarize(rows, args.nproc, backend)
    print(f"paratrain bench comm: {args.nproc} ranks, {backend}, {_ELEMENT}, "
          f"median of {args.iters} iterations after {args.warmup} warm-up\n")
    print(format_table(rows))
    if args.json:
        config = {"nproc": args.nproc, "backend": backend, "iters": args.iters,
                  "warmup": args.warmup, "dtype": str(_ELEMENT)}
        with open(args.json, "w") as f:
            json.dump({"config": config, "rows": rows, "summary": summary}, f, indent=2)
    print(json.dumps(summary))
    return 0


def check_writable(path: str, flag: str) -> None:
    """Raise ValueError, naming ``flag``, unless a file can be written at ``path``: its
    directory exists and is writable, and the path is not a directory or read-only file."""
    target = Path(path)
    folder = target.parent
    if target.is_dir():
        raise ValueError(f"{flag} {path}: is a directory; give a file name such as "
                         f"{target / 'comm.json'}")
    if not folder.is_dir():
        raise ValueError(f"{flag} {path}: the directory {folder} does not exist; create it "
                         f"(mkdir -p {folder}) or choose another path")
    writable = os.access(target, os.W_OK) if target.exists() else os.access(folder, os.W_OK | os.X_OK)
    if not writable:
        raise ValueError(f"{flag} {path}: not writable (permissions); choose another path")


# ---- on every rank --------------------------------------------------------------------


def _measure_all(ops: list[str], sizes: list[int], iters: int, warmup: int) -> list[dict] | None:
    """Time every (op, size, impl); rank 0 returns the rows, the others None."""
    group = dist.group.WORLD
    p = C.size(group)
    device = torch.device("cuda", torch.cuda.current_device()) \
        if dist.get_backend(group) == "nccl" else torch.device("cpu")
    rows = []
    for op in ops:
        for size in sizes:
            # Whole elements, and a multiple of p: the native collectives need even chunks.
            numel = max(p, size // _ELEMENT_BYTES // p * p)
            for impl in IMPLS:  # interleaved, so drift in machine load hits both alike
                call = _make_call(op, impl, numel, group, device)
                seconds = _time(call, iters, warmup, group, device)
                rows.append(_row(op, impl, numel * _ELEMENT_BYTES, seconds, p))
    return rows if C.rank(group) == 0 else None


def _make_call(op: str, impl: str, numel: int, group: dist.ProcessGroup,
               device: torch.device) -> Callable[[], object]:
    """A closure running one ``op`` on preallocated tensors, so allocation is not timed.

    Tensors hold zeros: repeated sums stay finite, and the values do not affect speed.
    """
    p = C.size(group)
    full = torch.zeros(numel, dtype=_ELEMENT, device=device)
    part = torch.zeros(numel // p, dtype=_ELEMENT, device=device)
    calls = {
        ("all-reduce", "native"): lambda: C.all_reduce(full, group),
        ("all-reduce", "ring"): lambda: ring_all_reduce(full, group),
        ("all-gather", "native"): lambda: C.all_gather(full, part, group),
        ("all-gather", "ring"): lambda: ring_all_gather(part, group, out=full),
        ("reduce-scatter", "native"): lambda: C.reduce_scatter(part, full, group),
        ("reduce-scatter", "ring"): lambda: ring_reduce_scatter(full, group, out=part),
    }
    return calls[(op, impl)]


def _time(call: Callable[[], object], iters: int, warmup: int,
          group: dist.ProcessGroup, device: torch.device) -> float:
    """Median over iterations of the slowest rank's time for one ``call``, in seconds."""
    for _ in range(warmup):
        call()
    _sync(device)
    times = torch.zeros(iters, dtype=torch.float64)
    for i in range(iters):
        dist.barrier(group)  # start together, so no rank's time includes waiting for a peer
        start = time.perf_counter()
        call()
        _sync(device)
        times[i] = time.perf_counter() - start
    # The op is done when its slowest rank is done.
    times = times.to(device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    return statistics.median(times.cpu().tolist())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _row(op: str, impl: str, nbytes: int, seconds: float, p: int) -> dict:
    return {"op": op, "impl": impl, "bytes": nbytes, "time_us": seconds * 1e6,
            "algbw_GBps": cost.algbw(nbytes, seconds) / 1e9,
            "busbw_GBps": cost.busbw(op, nbytes, seconds, p) / 1e9}


# ---- reporting (in the parent) --------------------------------------------------------


def format_size(nbytes: int) -> str:
    """'16 MiB', '1020 B': the largest binary unit that divides evenly, else bytes."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def format_table(rows: list[dict]) -> str:
    """One aligned line per measurement, native and ring of one op and size adjacent."""
    header = ("op", "impl", "size", "time_us", "algbw GB/s", "busbw GB/s")
    lines = [(r["op"], r["impl"], format_size(r["bytes"]), f"{r['time_us']:.1f}",
              f"{r['algbw_GBps']:.3f}", f"{r['busbw_GBps']:.3f}") for r in rows]
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    left = 2  # op and impl read better left-aligned, numbers right-aligned

    def fmt(cells: tuple[str, ...]) -> str:
        return "  ".join(c.ljust(w) if i < left else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths)))

    out, previous = [fmt(header), "  ".join("-" * w for w in widths)], None
    for row, line in zip(rows, lines):
        if previous is not None and row["op"] != previous:
            out.append("")
        out.append(fmt(line))
        previous = row["op"]
    return "\n".join(out)


def summarize(rows: list[dict], nproc: int, backend: str) -> dict:
    """ring (paratrain) vs native (peer) busbw at the largest size, per op; the headline
    is all-reduce when it was measured."""
    per_op = {}
    for op in dict.fromkeys(r["op"] for r in rows):
        largest = max(r["bytes"] for r in rows if r["op"] == op)
        bw = {r["impl"]: r["busbw_GBps"] for r in rows if r["op"] == op and r["bytes"] == largest}
        per_op[op] = {"bytes": largest, "paratrain": round(bw["ring"], 4),
                      "peer": round(bw["native"], 4), "ratio": round(bw["ring"] / bw["native"], 3)}
    headline = "all-reduce" if "all-reduce" in per_op else next(iter(per_op))
    return {"benchmark": "comm", "nproc": nproc, "backend": backend, "op": headline,
            "size_bytes": per_op[headline]["bytes"], "metric": "busbw_GBps",
            "paratrain": per_op[headline]["paratrain"], "peer": per_op[headline]["peer"],
            "ratio": per_op[headline]["ratio"],
            "note": "bus bandwidth, higher is better; paratrain = ring on send/recv, "
                    "peer = the backend's native collective, ratio = paratrain / peer",
            "per_op": per_op}
