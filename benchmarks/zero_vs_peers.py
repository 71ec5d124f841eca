"""paratrain ZeRO-1/2/3 vs torch's ZeroRedundancyOptimizer and FSDP2 (and DeepSpeed if
installed): step time and per-rank state bytes, same model, data and world size, one run.

    python benchmarks/zero_vs_peers.py [--nproc 2] [--model small] [--steps 6] [--rounds 2]

Implementations alternate in rounds so machine noise hits all alike; the step time is the
median over every timed step. State bytes are summed from the tensors each rank holds
(parameters, gradients, optimizer state), which is exact; RSS would hide the differences.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from paratrain.launch import spawn
from paratrain.models.gpt import GPT, preset
from paratrain.parallel.zero import ZeroDataParallel
from paratrain.train.config import OptimConfig
from paratrain.train.metrics import state_bytes
from common import DDP_SETTINGS, at_least, check_model_flags, fast_ddp

LR = 1e-3


class Peer:
    """A uniform face over each implementation: step(tokens) and state bytes."""

    def __init__(self, name, model, step, tensors):
        self.name, self.model, self._step, self._tensors = name, model, step, tensors

    def step(self, tokens):
        self._step(tokens)

    def state(self) -> dict[str, int | None]:
        if self._tensors is None:  # an implementation whose buffers we cannot enumerate
            return {"param_bytes": None, "grad_bytes": None, "optim_bytes": None}
        return state_bytes(self._tensors())


def phase(name: str) -> record_function:
    """A labelled span of a step, for ``--profile``'s breakdown (free when not profiling)."""
    return record_function(f"phase: {name}")


def phased_step(zero_grad, model, update, sync=None):
    """One training step in labelled phases: forward, backward, the gradient sync where
    the implementation has a separate one (paratrain's; the others sync inside backward),
    and the optimizer step."""
    def step(tokens):
        zero_grad()
        with phase("forward"):
            loss = model(tokens, tokens) / tokens.numel()
        with phase("backward"):
            loss.backward()
        if sync is not None:
            with phase("gradient sync"):
                sync()
        with phase("optimizer step"):
            update()
    return step


def paratrain_zero(base, stage: int) -> Peer:
    engine = ZeroDataParallel(copy.deepcopy(base), dist.group.WORLD, stage, OptimConfig(lr=LR))
    step = phased_step(engine.zero_grad, engine, lambda: engine.step(LR), engine.finish_grad_sync)
    return Peer(f"paratrain ZeRO-{stage}", engine, step, engine.state_tensors)


def _torch_tensors(model, opt, local):
    def tensors():
        params = [local(p) for p in model.parameters()]
        grads = [local(p.grad) for p in model.parameters() if p.grad is not None]
        state = getattr(opt, "optim", opt).state  # ZeroRedundancyOptimizer keeps its shard's in .optim
        optim = [local(v) for s in state.values() for v in s.values()
                 if isinstance(v, torch.Tensor) and v.dim() > 0]
        return {"params": params, "grads": grads, "optim": optim}
    return tensors


def _plain_step(model, opt):
    return phased_step(lambda: opt.zero_grad(set_to_none=False), model, opt.step)


PEER_SETTINGS = [
    "torch's AdamW with foreach=True for both torch peers (its docs: foreach is faster than "
    "the per-parameter loop, which torch picks by default on CPU)",
    "torch ZeroRedundancyOptimizer: overlap_with_ddp=True where torch allows it (its step runs "
    f"bucket by bucket inside DDP's communication hook), DDP with {DDP_SETTINGS}",
    "torch FSDP2: fully_shard per block, embedding, final norm and head (paratrain's units), "
    "then the root; reshard_after_forward=True (paratrain ZeRO-3's default without a pipeline); "
    "explicit forward/backward prefetch of the next unit",
    "DeepSpeed: overlap_comm=True, contiguous_gradients=True (when installed); torch's "
    "F.linear restored after DeepSpeed ZeRO-3 replaces it, so all run the same layers",
]


def torch_zero_redundancy(base) -> Peer:
    """With overlap_with_ddp where torch allows it (it refuses gloo: 'Gloo backend using
    Overlapping DDP with ZeRO may meet hangs'); then the plain step after DDP's backward."""
    from torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook import hook_with_zero_step
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.distributed.optim import ZeroRedundancyOptimizer

    def build(overlap: bool):
        model = fast_ddp(copy.deepcopy(base))
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                      lr=LR, foreach=True, overlap_with_ddp=overlap)
        if overlap:
            model.register_comm_hook(None, hook_with_zero_step(allreduce_hook, model, opt))
            warm = torch.zeros(1, 8, dtype=torch.long)
            for _ in range(2):  # DDP's buckets are final after two passes; no update in them
                model(warm, warm).backward()
        return model, opt

    try:
        model, opt = build(overlap=True)
    except RuntimeError as exc:
        if dist.get_rank() == 0:
            print(f"peer settings: ZeroRedundancyOptimizer overlap_with_ddp not used: {exc}")
        model, opt = build(overlap=False)
    return Peer("torch ZeroRedundancyOptimizer", model, _plain_step(model, opt),
                _torch_tensors(model, opt, lambda t: t))


def torch_fsdp2(base) -> Peer:
    from torch.distributed.fsdp import fully_shard

    model = copy.deepcopy(base)
    units = [model.tok_embeddings, *model.layers, model.norm, model.output]
    for unit in units:
        fully_shard(unit)
    fully_shard(model)
    for unit, nxt in zip(units, units[1:]):  # prefetch the next unit, as paratrain does
        unit.set_modules_to_forward_prefetch([nxt])
        nxt.set_modules_to_backward_prefetch([unit])
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    return Peer("torch FSDP2 fully_shard", model, _plain_step(model, opt), _torch_tensors(model, opt, local))


def worker(args) -> dict:
    torch.manual_seed(0)
    base = GPT(preset(args.model))
    peers = [paratrain_zero(base, s) for s in (1, 2, 3)] + [torch_zero_redundancy(base), torch_fsdp2(base)]
    if args.deepspeed:
        linear = torch.nn.functional.linear
        peers += [deepspeed_zero(base, s) for s in (1, 2, 3)]
        # DeepSpeed ZeRO-3 swaps torch's F.linear for its own autograd function for good;
        # put torch's back so that every implementation runs the same linear layers
        torch.nn.functional.linear = linear
    gen = torch.Generator().manual_seed(dist.get_rank())
    batches = [torch.randint(0, 256, (args.batch, args.seq), generator=gen) for _ in range(args.steps)]
    times = {p.name: [] for p in peers}
    for r in range(args.rounds + 1):  # round 0 warms up everyone
        for peer in peers:
            for tokens in batches:
                dist.barrier()
                t0 = time.perf_counter()
                peer.step(tokens)
                dist.barrier()
                if r:
                    times[peer.name].append(time.perf_counter() - t0)
    out = {p.name: {"step_s": statistics.median(times[p.name]), **p.state()} for p in peers}
    if args.profile:
        for peer in peers:
            out[peer.name]["profile"] = profile(peer, batches)
    return out


def profile(peer: Peer, batches, top: int = 6) -> dict:
    """Where one implementation's steps go on this rank (``torch.profiler``, CPU): the wall
    time of each phase of the step, the training thread's time inside c10d calls (posting
    and waiting; gloo's transfers run on its own threads), and the operators with the most
    self time. Milliseconds per step."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    dist.barrier()
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for tokens in batches:
            peer.step(tokens)
    dist.barrier()
    n, events = len(batches), prof.key_averages()
    phases = {e.key.removeprefix("phase: "): e.cpu_time_total / 1e3 / n
              for e in events if e.key.startswith("phase: ")}
    c10d = sum(e.self_cpu_time_total for e in events if e.key.startswith("c10d::")) / 1e3 / n
    ops = sorted((e for e in events if not e.key.startswith("phase: ")),
                 key=lambda e: e.self_cpu_time_total, reverse=True)
    return {"phases": phases, "c10d_ms": c10d,
            "top": [(e.key, e.self_cpu_time_total / 1e3 / n) for e in ops[:top]]}


def deepspeed_zero(base, stage: int) -> Peer:
    """DeepSpeed's ZeRO stage on the same world (its launcher's variables set by hand)."""
    os.environ.update(RANK=str(dist.get_rank()), WORLD_SIZE=str(dist.get_world_size()),
                      LOCAL_RANK=str(dist.get_rank()), MASTER_ADDR="127.0.0.1", MASTER_PORT="29501")
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}},
              "zero_optimization": {"stage": stage, "overlap_comm": True,
                                    "contiguous_gradients": True}}
    engine, *_ = deepspeed.initialize(model=copy.deepcopy(base), config=config,
                                      model_parameters=None)

    def step(tokens):
        with phase("forward"):
            loss = engine(tokens, tokens) / tokens.numel()
        with phase("backward"):
            engine.backward(loss)
        with phase("optimizer step"):
            engine.step()

    return Peer(f"DeepSpeed ZeRO-{stage}", engine, step, None)


def deepspeed_available() -> bool:
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return False
    return True


def print_profiles(rank0: dict) -> None:
    names = ("forward", "backward", "gradient sync", "optimizer step")
    print("profile, rank 0, ms per step: phases of the step (wall), time in c10d calls, "
          "and the operators with the most self time")
    print(f"{'implementation':<32}" + "".join(f"{n:>15}" for n in names) + f"{'c10d calls':>12}")
    for name, r in rank0.items():
        prof = r["profile"]
        cells = "".join(f"{prof['phases'][n]:>15.1f}" if n in prof["phases"] else f"{'-':>15}"
                        for n in names)
        print(f"{name:<32}{cells}{prof['c10d_ms']:>12.1f}")
    for name, r in rank0.items():
        ops = ", ".join(f"{k.removeprefix('aten::')[:40]} {ms:.1f}" for k, ms in r["profile"]["top"])
        print(f"  {name}: {ops}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=at_least(1), default=2)
    parser.add_argument("--model", default="small")
    parser.add_argument("--batch", type=at_least(1), default=8, help="sequences per rank")
    parser.add_argument("--seq", type=at_least(1), default=128)
    parser.add_argument("--steps", type=at_least(1), default=6)
    parser.add_argument("--rounds", type=at_least(1), default=2)
    parser.add_argument("--profile", action="store_true",
                        help="also profile each implementation's steps on rank 0 (torch.profiler)")
    args = parser.parse_args()
    check_model_flags(parser, args.model, args.seq)
    args.deepspeed = deepspeed_available()
    results = spawn(worker, args.nproc, args, backend="gloo", timeout_s=1800)
    rank0 = results[0]
    print(f"ZeRO, model {args.model} ({preset(args.model).num_params() / 1e6:.2f}M params), "
          f"{args.nproc} ranks x {args.batch} x {args.seq} tokens, median of "
          f"{args.rounds * args.steps} steps; bytes on rank 0")
    for line in PEER_SETTINGS:
        print("peer settings: " + line)
    print(f"{'implementation':<32}{'ms/step':>9}{'params MB':>11}{'grads MB':>10}{'optim MB':>10}")
    mb = lambda b: f"{b / 1e6:.2f}" if b is not None else "n/a"  # noqa: E731
    for name, r in rank0.items():
        print(f"{name:<32}{r['step_s'] * 1e3:>9.1f}{mb(r['param_bytes']):>11}"
              f"{mb(r['grad_bytes']):>10}{mb(r['optim_bytes']):>10}")
    if args.profile:
        print_profiles(rank0)
    extra = {}
    if args.deepspeed:
        for s in (1, 2):
            extra[f"zero{s}_vs_deepspeed_ratio"] = round(
                rank0[f"paratrain ZeRO-{s}"]["step_s"] / rank0[f"DeepSpeed ZeRO-{s}"]["step_s"], 3)
    else:
        print("DeepSpeed is not installed: its ZeRO stages were not measured "
              "(optional: DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed)")
    ours, peer = rank0["paratrain ZeRO-3"]["step_s"], rank0["torch FSDP2 fully_shard"]["step_s"]
    z1, zro = rank0["paratrain ZeRO-1"]["step_s"], rank0["torch ZeroRedundancyOptimizer"]["step_s"]
    print(json.dumps({"benchmark": "zero_vs_peers", "pair": "paratrain ZeRO-3 vs torch FSDP2",
                      "metric": "step_time_s", "nproc": args.nproc, "paratrain": round(ours, 5),
                      "peer": round(peer, 5), "ratio": round(ours / peer, 3),
                      "zero1_vs_zero_redundancy_ratio": round(z1 / zro, 3), **extra}))


if __name__ == "__main__":
    main()
