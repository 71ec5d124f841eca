"""Context parallelism at a long sequence: ring attention vs Ulysses vs no context parallelism.

    python benchmarks/cp_methods.py [--nproc 2] [--seq 4096] [--batch 2] [--steps 4] [--rounds 2]

All modes run on the same world of ``nproc`` ranks, the same GPT and the same global batch
of ``batch`` sequences of ``seq`` tokens:

* ring / ulysses: cp = nproc, every rank holds a 1/cp shard of every sequence;
* none: dp = nproc, every rank holds batch/nproc whole sequences (plain SDPA attention).
  The fair peer for time: same world size and tokens per rank. It only exists while one
  sequence fits on a rank, which is what context parallelism removes;
* single: every rank trains the whole batch alone (no communication), the reference for
  memory: what one process would hold without any parallelism (2x the tokens at nproc 2).

A step is forward, backward, gradient all-reduce (over the dp x cp group) and AdamW. The
modes alternate in rounds so machine noise hits them alike; reported: median step time,
and the bytes autograd saves per rank during forward (distinct storages, parameters
excluded): in total, which is the peak held before backward starts, and inside the
attention cores alone. Last line: JSON with ratio = ring step time / Ulysses step time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from paratrain.launch import spawn
from paratrain.layout import Layout
from paratrain.mesh import Mesh
from paratrain.models.gpt import GPT, preset
from paratrain.parallel.context import apply_context_parallel, shard_batch
from paratrain.parallel.data import DataParallel

from common import at_least

MODES = ("ring", "ulysses", "none", "single")
LABELS = {"ring": "ring (cp={n})", "ulysses": "ulysses (cp={n})", "none": "none (dp={n})",
          "single": "single process"}


class SavedBytes:
    """Counts the distinct non-parameter storages autograd saves, overall and per region."""

    def __init__(self, model: torch.nn.Module):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.total: dict[int, int] = {}
        self.attention: dict[int, int] = {}
        self.in_attention = False

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.params:
            self.total[storage.data_ptr()] = storage.nbytes()
            if self.in_attention:
                self.attention[storage.data_ptr()] = storage.nbytes()
        return t

    def watch(self, core: torch.nn.Module) -> None:
        core.register_forward_pre_hook(lambda *_: setattr(self, "in_attention", True))
        core.register_forward_hook(lambda *_: setattr(self, "in_attention", False))


def build(mode: str, args) -> tuple[DataParallel, Mesh]:
    layout = Layout(dp=args.nproc) if mode in ("none", "single") else Layout(cp=args.nproc)
    mesh = Mesh.build(layout)
    torch.manual_seed(0)
    model = GPT(preset(args.model, max_seq_len=args.seq))
    if mode in ("ring", "ulysses"):
        apply_context_parallel(model, mesh.group("cp"), mode)
    # "single" reduces over its cp group, which is this rank alone: no communication.
    return DataParallel(model, mesh.group("cp" if mode == "single" else "dp-cp")), mesh


def local_batch(mode: str, mesh: Mesh, tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """This rank's rows (dp) and sequence shard (cp) of a (batch, seq + 1) sample."""
    dp, rank = mesh.size("dp"), mesh.coord("dp")
    if mode == "single":
        dp, rank = 1, 0
    rows = tokens[rank * len(tokens) // dp:(rank + 1) * len(tokens) // dp]
    return shard_batch(rows[:, :-1], rows[:, 1:], mesh.coord("cp"), mesh.size("cp"))


def step(ddp: DataParallel, opt, local, scale: float) -> float:
    t0 = time.perf_counter()
    ddp.zero_grad()
    (ddp(*local) * scale).backward()
    ddp.finish_grad_sync()
    opt.step()
    dist.barrier()
    return time.perf_counter() - t0


def measure_saved(ddp: DataParallel, local) -> tuple[int, int]:
    counter = SavedBytes(ddp.module)
    for block in ddp.module.layers:
        counter.watch(block.attn.core)
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        loss = ddp(*local)
    loss.backward()  # completes the gradient all-reduce the other ranks also launch
    ddp.finish_grad_sync()
    return sum(counter.total.values()), sum(counter.attention.values())


def torch_context_parallel_status(nproc: int) -> str:
    """Whether torch's own context-parallel attention (``context_parallel``: ring attention
    over DTensor SDPA) runs here; on CPU torch 2.13 has no sharding rule for the CPU flash
    kernel, so it is reported instead of timed."""
    try:
        import torch.nn.functional as F
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel

        mesh = init_device_mesh("cpu", (nproc,))
        q, k, v = (torch.randn(1, 2, 8 * nproc, 8) for _ in range(3))
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
    except Exception as exc:  # noqa: BLE001 - any failure is the answer we report
        return f"not run: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    return "runs on this machine, not yet timed here"


def worker(args) -> dict:
    status = torch_context_parallel_status(args.nproc)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (args.batch, args.seq + 1), generator=gen)  # same everywhere
    runs = {}
    for mode in MODES:
        ddp, mesh = build(mode, args)
        local = local_batch(mode, mesh, tokens)
        scale = (1 if mode == "single" else mesh.size("dp-cp")) / tokens[:, 1:].numel()
        saved, attention = measure_saved(ddp, local)
        runs[mode] = dict(ddp=ddp, opt=torch.optim.AdamW(ddp.parameters(), lr=1e-4), local=local,
                          scale=scale, saved=saved, attention=attention, times=[])
    for r in range(args.rounds + 1):  # round 0 warms up
        for mode, run in runs.items():
            times = [step(run["ddp"], run["opt"], run["local"], run["scale"])
                     for _ in range(args.steps)]
            if r > 0:
                run["times"] += times
    out = {mode: {"step_s": statistics.median(run["times"]), "saved": run["saved"],
                  "attention": run["attention"], "tokens": run["local"][0].numel()}
           for mode, run in runs.items()}
    return {**out, "torch_cp": status}


def check_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit with a usage error naming the flag, before any rank starts, where every rank
    would fail (an unknown preset, a sequence or heads that do not split over the ranks)."""
    n = args.nproc
    try:
        cfg = preset(args.model, max_seq_len=args.seq)
    except ValueError as exc:
        parser.error(f"--model: {exc}")
    if args.batch % n:
        parser.error(f"--batch {args.batch} must be a multiple of --nproc {n} (the no-CP peer "
                     f"splits it over dp)")
    if args.seq % (2 * n):
        parser.error(f"--seq {args.seq} must be a multiple of 2 x --nproc = {2 * n}: ring "
                     f"attention cuts each sequence into two chunks per rank")
    if cfg.n_heads % n or cfg.kv_heads % n:
        fits = [c for c in range(1, cfg.kv_heads + 1) if cfg.kv_heads % c == 0]
        parser.error(f"--nproc {n} must divide model {args.model}'s {cfg.n_heads} query heads and "
                     f"{cfg.kv_heads} KV heads (Ulysses splits the heads over the ranks); use "
                     f"--nproc from {fits}, or another --model")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=at_least(1), default=2, help="world size (cp, or dp for 'none')")
    parser.add_argument("--model", default="tiny", help="GPT preset (max_seq_len is raised to --seq)")
    parser.add_argument("--seq", type=at_least(1), default=4096)
    parser.add_argument("--batch", type=at_least(1), default=2, help="sequences in the global batch")
    parser.add_argument("--steps", type=at_least(1), default=3, help="timed steps per mode and round")
    parser.add_argument("--rounds", type=at_least(1), default=2)
    args = parser.parse_args()
    check_flags(parser, args)
    results = spawn(worker, args.nproc, args, backend="gloo", timeout_s=1800)
    cfg = preset(args.model)
    print(f"context parallelism, model {args.model} (d_model {cfg.d_model}, {cfg.n_layers} layers, "
          f"{cfg.n_heads}/{cfg.kv_heads} heads), {args.nproc} ranks, global batch {args.batch} x "
          f"{args.seq} tokens, median of {args.rounds * args.steps} steps")
    print(f"{'mode':<18}{'ms/step':>10}{'tokens/rank':>13}{'saved MB/rank':>15}{'attention MB':>14}")
    for mode in MODES:
        label = LABELS[mode].format(n=args.nproc)
        worst = max(results, key=lambda res: res[mode]["saved"])[mode]  # peak over ranks
        step_s = results[0][mode]["step_s"]
        print(f"{label:<18}{step_s * 1e3:>10.1f}{worst['tokens']:>13,}"
              f"{worst['saved'] / 2**20:>15.1f}{worst['attention'] / 2**20:>14.1f}")
    print(f"peer: torch context_parallel (torch.distributed.tensor.experimental): {results[0]['torch_cp']}")
    ring, ulysses, none, _ = (results[0][m]["step_s"] for m in MODES)
    print(json.dumps({"benchmark": "cp_methods", "metric": "step_time_s", "nproc": args.nproc,
                      "seq": args.seq, "paratrain": round(ring, 5), "peer": round(ulysses, 5),
                      "ratio": round(ring / ulysses, 3), "none_s": round(none, 5),
                      "torch_context_parallel": results[0]["torch_cp"],
                      "saved_bytes_per_rank": {m: max(r[m]["saved"] for r in results) for m in MODES}}))


if __name__ == "__main__":
    main()
