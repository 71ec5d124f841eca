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
import statistics
import time

import torch
import torch.distributed as dist

from paratrain.launch import spawn
from paratrain.models.gpt import GPT, preset
from paratrain.parallel.zero import ZeroDataParallel
from paratrain.train.config import OptimConfig
from paratrain.train.metrics import state_bytes

LR = 1e-3


class Peer:
    """A uniform face over each implementation: step(tokens) and state bytes."""

    def __init__(self, name, model, step, tensors):
        self.name, self.model, self._step, self._tensors = name, model, step, tensors

    def step(self, tokens):
        self._step(tokens)

    def state(self) -> dict[str, int]:
        return state_bytes(self._tensors())


def paratrain_zero(base, stage: int) -> Peer:
    engine = ZeroDataParallel(copy.deepcopy(base), dist.group.WORLD, stage, OptimConfig(lr=LR))

    def step(tokens):
        engine.zero_grad()
        (engine(tokens, tokens) / tokens.numel()).backward()
        engine.finish_grad_sync()
        engine.step(LR)

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
    def step(tokens):
        opt.zero_grad(set_to_none=False)
        (model(tokens, tokens) / tokens.numel()).backward()
        opt.step()
    return step


def torch_zero_redundancy(base) -> Peer:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)
    return Peer("torch ZeroRedundancyOptimizer", model, _plain_step(model, opt),
                _torch_tensors(model, opt, lambda t: t))


def torch_fsdp2(base) -> Peer:
    from torch.distributed.fsdp import fully_shard

    model = copy.deepcopy(base)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    return Peer("torch FSDP2 fully_shard", model, _plain_step(model, opt), _torch_tensors(model, opt, local))


def worker(args) -> dict:
    torch.manual_seed(0)
    base = GPT(preset(args.model))
    peers = [paratrain_zero(base, s) for s in (1, 2, 3)] + [torch_zero_redundancy(base), torch_fsdp2(base)]
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
    return {p.name: {"step_s": statistics.median(times[p.name]), **p.state()} for p in peers}


def deepspeed_note() -> str:
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return ("DeepSpeed is not installed: its ZeRO stages were not measured "
                "(optional: DS_BUILD_OPS=0 pip install deepspeed, then run under torchrun)")
    return "DeepSpeed is installed but this script does not drive it yet"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--model", default="small")
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    results = spawn(worker, args.nproc, args, backend="gloo", timeout_s=1800)
    rank0 = results[0]
    print(f"ZeRO, model {args.model} ({preset(args.model).num_params() / 1e6:.2f}M params), "
          f"{args.nproc} ranks x {args.batch} x {args.seq} tokens, median of "
          f"{args.rounds * args.steps} steps; bytes on rank 0")
    print(f"{'implementation':<32}{'ms/step':>9}{'params MB':>11}{'grads MB':>10}{'optim MB':>10}")
    for name, r in rank0.items():
        print(f"{name:<32}{r['step_s'] * 1e3:>9.1f}{r['param_bytes'] / 1e6:>11.2f}"
              f"{r['grad_bytes'] / 1e6:>10.2f}{r['optim_bytes'] / 1e6:>10.2f}")
    print(deepspeed_note())
    ours, peer = rank0["paratrain ZeRO-3"]["step_s"], rank0["torch FSDP2 fully_shard"]["step_s"]
    z1, zro = rank0["paratrain ZeRO-1"]["step_s"], rank0["torch ZeroRedundancyOptimizer"]["step_s"]
    print(json.dumps({"benchmark": "zero_vs_peers", "pair": "paratrain ZeRO-3 vs torch FSDP2",
                      "metric": "step_time_s", "nproc": args.nproc, "paratrain": round(ours, 5),
                      "peer": round(peer, 5), "ratio": round(ours / peer, 3),
                      "zero1_vs_zero_redundancy_ratio": round(z1 / zro, 3)}))


if __name__ == "__main__":
    main()
