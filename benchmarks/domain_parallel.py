"""Domain parallelism on a large field: halo exchange vs all-gather-before-every-conv vs one process.

    python benchmarks/domain_parallel.py [--nproc 2 4] [--size 256] [--batch 2] [--steps 2] [--rounds 2]

The model is the heat2d U-Net (width 16, 2 levels, 3x3 convolutions); the input is a
batch of ``size x size`` fields, split over ``nproc`` ranks along the height. Modes, on the
same world and the same batch:

* halo: paratrain's domain parallelism; each convolution exchanges only the rows its
  kernel reads past the block, and computes its interior while they travel;
* gather (the peer): the naive way to shard a sample with torch collectives alone: before
  every convolution all-gather the whole activation, convolve it, keep this rank's rows
  (backward: reduce-scatter). Its best settings: the native gloo/NCCL all-gather and
  reduce-scatter on contiguous memory, the same group norm (statistics all-reduced);
* single: one process trains the whole batch with the plain model (the others wait).

A step is forward, backward, gradient all-reduce over the domain group and SGD. Modes
alternate in rounds so machine noise hits them alike. Reported per mode: median step time;
per-rank peak activation memory, the bytes autograd saves in forward (distinct storages,
parameters excluded; the peak, held when backward starts); activation bytes each rank sends
per step (gradient all-reduce excluded: it is the same in both). Then the overlap: per
halo convolution, the time the exchange takes when nothing overlaps it, and the time the
rank still waits for halos after computing its interior.
Last line: JSON with paratrain = halo step time, peer = gather step time, at the largest nproc.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from paratrain.comm import collectives as C
from paratrain.launch import spawn
from paratrain.layout import Layout
from paratrain.mesh import Mesh
from paratrain.models.unet import UNet, UNetConfig
from paratrain.parallel.data import DataParallel
from paratrain.parallel.domain import DomainConv2d, Grid, apply_domain_parallel
from paratrain.parallel.domain.measure import saved_activation_bytes

from common import at_least

MODES = ("halo", "gather", "single")


class _GatherRows(torch.autograd.Function):
    """All-gather blocks of rows into the whole activation; backward: reduce-scatter."""

    @staticmethod
    def forward(ctx, x, group, sent: list):
        ctx.group, ctx.sent = group, sent
        n = C.size(group)
        front = x.transpose(0, 2).contiguous()  # rows first: collectives work on dim 0
        out = front.new_empty((front.shape[0] * n, *front.shape[1:]))
        C.all_gather(out, front, group)
        sent[0] += (n - 1) * front.numel() * front.element_size()  # ring all-gather, per rank
        return out.transpose(0, 2)

    @staticmethod
    def backward(ctx, grad):
        n = C.size(ctx.group)
        front = grad.transpose(0, 2).contiguous()
        out = front.new_empty((front.shape[0] // n, *front.shape[1:]))
        C.reduce_scatter(out, front, ctx.group)
        ctx.sent[0] += (n - 1) * out.numel() * out.element_size()
        return out.transpose(0, 2), None, None


class GatherConv2d(nn.Module):
    """The peer: gather the whole input, convolve it as the plain layer does, keep my rows."""

    def __init__(self, conv: nn.Conv2d, group, sent: list):
        super().__init__()
        self.conv, self.group, self.sent = conv, group, sent

    def forward(self, x):
        full = _GatherRows.apply(x, self.group, self.sent)
        out = self.conv(full)
        rows = out.shape[2] // C.size(self.group)
        return out[:, :, C.rank(self.group) * rows:(C.rank(self.group) + 1) * rows]


def swap_gather(module: nn.Module, group, sent: list) -> None:
    for name, child in module.named_children():
        if isinstance(child, DomainConv2d):
            conv = nn.Conv2d(child.weight.shape[1], child.weight.shape[0], child.weight.shape[2:],
                             stride=child.stride, padding=child.weight.shape[2] // 2 if child.stride == (1, 1) else 0)
            conv.weight, conv.bias = child.weight, child.bias
            setattr(module, name, GatherConv2d(conv, group, sent))
        else:
            swap_gather(child, group, sent)


def count_sends(sent: list):
    """Wrap C.send_recv to add the bytes this rank sends (the halo exchange's traffic)."""
    plain = C.send_recv

    def counting(ops, group):
        sent[0] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.kind == "send")
        return plain(ops, group)
    C.send_recv = counting


def build(mode: str, mesh: Mesh, ucfg: UNetConfig, sent: list):
    torch.manual_seed(0)
    model = UNet(ucfg)
    if mode == "single":
        return model
    apply_domain_parallel(model, Grid.from_mesh(mesh))
    if mode == "gather":
        swap_gather(model, mesh.group("dom"), sent)
    return DataParallel(model, mesh.group("dom"))


def step(model, opt, x, y, scale) -> float:
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=False)
    ((model(x) - y).pow(2).sum() * scale).backward()
    if isinstance(model, DataParallel):
        model.finish_grad_sync()
    opt.step()
    return time.perf_counter() - t0


def worker(args, nproc: int) -> dict:
    mesh = Mesh.build(Layout(domh=nproc))
    grid, me = Grid.from_mesh(mesh), dist.get_rank()
    ucfg = UNetConfig(width=args.width, levels=2, padding="zeros")
    gen = torch.Generator().manual_seed(1)
    x_full, y_full = (torch.randn(args.batch, 1, args.size, args.size, generator=gen) for _ in range(2))
    points = x_full.numel()
    sent = {m: [0] for m in MODES}
    count_sends(sent["halo"])
    runs = {}
    for mode in MODES:
        model = build(mode, mesh, ucfg, sent[mode])
        x, y = (x_full, y_full) if mode == "single" else (grid.local(x_full).contiguous(), grid.local(y_full).contiguous())
        scale = (1 if mode == "single" else nproc) / points
        if mode == "single" and me != 0:
            runs[mode] = dict(saved=0, times=[], sent=0)
            continue
        _, saved = saved_activation_bytes(lambda: (model(x) - y).pow(2).sum(), model.parameters())
        runs[mode] = dict(model=model, opt=torch.optim.SGD(model.parameters(), lr=1e-3), x=x, y=y,
                          scale=scale, saved=saved, times=[])
    for r in range(args.rounds + 1):  # round 0 warms up
        for mode, run in runs.items():
            sent[mode][0] = 0
            for _ in range(args.steps):
                if "model" in run:
                    t = step(run["model"], run["opt"], run["x"], run["y"], run["scale"])
                    if r > 0:
                        run["times"].append(t)
                dist.barrier()
            run["sent"] = sent[mode][0] // args.steps
    overlap = measure_overlap(runs["halo"]["model"], runs["halo"]["x"], args.steps)
    return {"overlap": overlap, **{m: {"step_s": statistics.median(run["times"]) if run["times"] else None,
                                      "saved": run["saved"], "sent": run["sent"]} for m, run in runs.items()}}


def measure_overlap(ddp: DataParallel, x: torch.Tensor, steps: int) -> dict:
    """Forward passes with and without overlap, recording each halo convolution's times."""
    convs = [m for m in ddp.module.modules() if isinstance(m, DomainConv2d) and any(m.halo.lo + m.halo.hi)]
    out = {}
    for overlap in (False, True):
        records: list = []
        for conv in convs:
            conv.overlap, conv.recorder = overlap, records
        with torch.no_grad():
            for _ in range(steps + 1):
                records.clear()  # keep the last pass
                dist.barrier()
                ddp.module(x)
        start = records[0][0]  # the ranks left a barrier together just before
        out["on" if overlap else "off"] = [(t0 - start, t1 - start, t2 - start, t3 - start)
                                           for t0, t1, t2, t3 in records]
    for conv in convs:
        conv.overlap, conv.recorder = True, None
    return out


def report(nproc: int, results: list[dict], args) -> dict:
    print(f"\n{nproc} ranks over the height: blocks of {args.size // nproc} x {args.size} per rank")
    print(f"{'mode':<34}{'ms/step':>10}{'saved MB/rank':>15}{'sent MB/rank':>14}")
    labels = {"halo": "halo exchange (paratrain)", "gather": "all-gather before every conv (peer)",
              "single": "single process"}
    row = {}
    for mode in MODES:
        step_s = results[0][mode]["step_s"]
        saved = max(r[mode]["saved"] for r in results)
        sent = max(r[mode]["sent"] for r in results)
        row[mode] = dict(step_s=step_s, saved=saved, sent=sent)
        print(f"{labels[mode]:<34}{step_s * 1e3:>10.1f}{saved / 2**20:>15.1f}{sent / 2**20:>14.2f}")
    mid = results[min(1, nproc - 1)]["overlap"]  # an inner rank: two neighbours
    off = statistics.mean(t2 - t0 for t0, _, t2, _ in mid["off"]) * 1e3
    on_wait = statistics.mean(t2 - t1 for _, t1, t2, _ in mid["on"]) * 1e3
    interior = statistics.mean(t1 - t0 for t0, t1, _, _ in mid["on"]) * 1e3
    hidden = max(0.0, 1 - on_wait / off)
    print(f"overlap (rank 1, mean per halo conv in one forward): the exchange alone takes "
          f"{off:.2f} ms; overlapped, the interior takes {interior:.2f} ms and the wait left after "
          f"it is {on_wait:.2f} ms: {hidden:.0%} of the exchange hidden")
    row["overlap"] = dict(exchange_alone_ms=round(off, 3), wait_after_interior_ms=round(on_wait, 3),
                          interior_ms=round(interior, 3), hidden=round(hidden, 3))
    return row


def check_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit with a usage error naming the flag before any rank starts: for every --nproc,
    not only once the smaller worlds have run."""
    try:
        UNetConfig(width=args.width, levels=2, padding="zeros")
    except ValueError as exc:
        parser.error(f"--width {args.width}: {exc}")
    for n in args.nproc:
        if args.size % (4 * n):
            parser.error(f"--size {args.size} must be a multiple of 4 x --nproc {n} = {4 * n} "
                         f"(each rank's rows halve twice in the U-Net)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=at_least(2, " (the halo exchange needs a neighbour; the "
                        "single-process mode is measured at every --nproc)"), nargs="+",
                        default=[2, 4])
    parser.add_argument("--size", type=at_least(1), default=256, help="height and width of each field")
    parser.add_argument("--batch", type=at_least(1), default=2)
    parser.add_argument("--width", type=at_least(1), default=16, help="U-Net channels at full resolution")
    parser.add_argument("--steps", type=at_least(1), default=2, help="timed steps per mode and round")
    parser.add_argument("--rounds", type=at_least(1), default=2)
    parser.add_argument("--timeline", metavar="FILE.json",
                        help="save every rank's overlapped forward at the largest nproc (for docs/img/make_domain.py)")
    args = parser.parse_args()
    check_flags(parser, args)
    print(f"domain parallelism: U-Net width {args.width}, 2 levels, batch {args.batch} x "
          f"{args.size}x{args.size}, median of {args.rounds * args.steps} steps; gloo on CPU; the "
          f"peer uses native all-gather / reduce-scatter (its best settings here)")
    rows = {}
    for n in args.nproc:
        results = spawn(worker, n, args, n, backend="gloo", timeout_s=1800)
        rows[n] = report(n, results, args)
        if args.timeline and n == max(args.nproc):
            with open(args.timeline, "w") as f:
                json.dump({"nproc": n, "size": args.size, "off": [r["overlap"]["off"] for r in results],
                           "on": [r["overlap"]["on"] for r in results]}, f)
    n = max(rows)
    halo, gather, single = (rows[n][m] for m in MODES)
    print(json.dumps({"benchmark": "domain_parallel", "metric": "step_time_s", "nproc": n,
                      "size": args.size, "paratrain": round(halo["step_s"], 5),
                      "peer": round(gather["step_s"], 5), "ratio": round(halo["step_s"] / gather["step_s"], 3),
                      "single_s": round(single["step_s"], 5),
                      "saved_vs_single": {k: round(rows[k]["halo"]["saved"] / rows[k]["single"]["saved"], 3) for k in rows},
                      "gather_saved_vs_single": {k: round(rows[k]["gather"]["saved"] / rows[k]["single"]["saved"], 3) for k in rows},
                      "ratio_by_nproc": {k: round(rows[k]["halo"]["step_s"] / rows[k]["gather"]["step_s"], 3) for k in rows},
                      "sent_bytes_per_rank": {k: {m: rows[k][m]["sent"] for m in ("halo", "gather")} for k in rows},
                      "overlap": {k: rows[k]["overlap"] for k in rows}}))


if __name__ == "__main__":
    main()
