"""paratrain's expert-parallel MoE layer vs DeepSpeed's, at ep2 and ep4, in one run.

    pip install deepspeed einops   # the peer (CPU: DS_BUILD_OPS=0 pip install deepspeed)
    python benchmarks/moe_vs_peers.py [--d-model 256] [--experts 8] [--top-k 2] \
        [--expert-ffn 512] [--tokens 1024] [--iters 8] [--rounds 3]

One MoE layer (router, top-k, the token all-to-alls, the experts, the weighted combine)
forward and backward on ``--tokens`` tokens per rank, in worlds of 2 and 4 ranks with the
experts split over all of them (ep = world). The peer is DeepSpeed's
``deepspeed.moe.layer.MoE`` on the same width, experts, top-k and tokens, dropless
(``drop_tokens=False``: its capacity grows to the busiest expert), deterministic top-2
(``top2_2nd_expert_sampling=False``, ``use_rts=False``), its own gate and
dispatch (GShard's one-hot einsums). torchtitan's MoE layer is the other peer named by the
issue; it needs CUDA here (``torch.histc`` on integer tensors, ``torch._grouped_mm``), so
it does not run on this CPU machine. Also timed: a dense SwiGLU with the MoE's active
width (top_k x expert_ffn), the same FLOPs per token without routing or communication.
The implementations alternate in rounds; medians of all timed iterations.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from common import at_least
from paratrain.launch import spawn
from paratrain.models.description import ModelDescription
from paratrain.models.gpt import GPTConfig, SwiGLU
from paratrain.models.moe import MoE
from paratrain.parallel.expert import apply_expert_parallel

PEER_SETTINGS = "drop_tokens=False, use_rts=False, top2_2nd_expert_sampling=False, k=top_k, ep_size=world"


class _Holder(nn.Module):
    """One block holding the layer at ``mlp``, as expert parallelism finds MoE layers."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layers = nn.ModuleList([nn.Module()])
        self.layers[0].mlp = layer


def _ours(cfg: GPTConfig, group) -> MoE:
    layer = MoE(cfg)
    holder = _Holder(layer)
    apply_expert_parallel(holder, ModelDescription(shape=cfg.shape), group, group)
    return layer


def _peer(cfg: GPTConfig, world: int) -> nn.Module:
    import deepspeed
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    deepspeed.init_distributed(dist_backend="gloo")
    expert = SwiGLU(cfg, hidden=cfg.expert_dim)
    layer = DeepSpeedMoE(cfg.d_model, expert, num_experts=cfg.n_experts, ep_size=world,
                         k=cfg.top_k, drop_tokens=False, use_rts=False,
                         top2_2nd_expert_sampling=False)
    layer.set_deepspeed_parallelism()
    return layer


def _step(layer: nn.Module, x: torch.Tensor) -> float:
    t0 = time.perf_counter()
    out = layer(x)
    out = out[0] if isinstance(out, tuple) else out  # DeepSpeed returns (y, aux, counts)
    (out.float().sum() / out.numel()).backward()
    dist.barrier()
    return time.perf_counter() - t0


def worker(args) -> dict:
    torch.set_num_threads(1)
    world = dist.get_world_size()
    torch.manual_seed(0)
    cfg = GPTConfig(d_model=args.d_model, n_heads=4, n_experts=args.experts, top_k=args.top_k,
                    expert_ffn=args.expert_ffn, aux_loss_coef=0.01)
    layers = {"paratrain": _ours(cfg, dist.group.WORLD), "DeepSpeed": _peer(cfg, world),
              "dense (paratrain)": SwiGLU(cfg, hidden=args.top_k * args.expert_ffn)}
    for layer in layers.values():
        layer.train()
    gen = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(1, args.tokens, args.d_model, generator=gen).requires_grad_()
    times: dict[str, list[float]] = {name: [] for name in layers}
    for r in range(args.rounds + 1):  # round 0 warms every implementation up
        for name, layer in layers.items():
            t = [_step(layer, x) for _ in range(args.iters)]
            if r:
                times[name] += t
    load = layers["paratrain"].stats.load.float()
    return {"times": {n: statistics.median(t) for n, t in times.items()},
            "busiest_over_mean": float(load.max() / load.mean())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=at_least(8), default=256)
    parser.add_argument("--experts", type=at_least(4), default=8)
    parser.add_argument("--top-k", type=at_least(1), default=2)
    parser.add_argument("--expert-ffn", type=at_least(1), default=512)
    parser.add_argument("--tokens", type=at_least(1), default=1024, help="tokens per rank")
    parser.add_argument("--iters", type=at_least(1), default=8)
    parser.add_argument("--rounds", type=at_least(1), default=3)
    args = parser.parse_args()
    if args.experts % 4:
        parser.error(f"--experts {args.experts}: must divide over ep4 (a multiple of 4)")
    print(f"MoE layer, d_model {args.d_model}, {args.experts} experts x {args.expert_ffn} wide, "
          f"top-{args.top_k}, {args.tokens} tokens per rank, forward + backward, median of "
          f"{args.rounds * args.iters} iterations per implementation")
    print(f"DeepSpeed MoE configured: {PEER_SETTINGS}")
    print(f"{'ep':<4}{'implementation':<20}{'ms/iter':>10}{'tokens/s':>12}")
    summary = {}
    for ep in (2, 4):
        result = spawn(worker, ep, args, backend="gloo", timeout_s=1800)[0]
        for name, t in result["times"].items():
            print(f"{ep:<4}{name:<20}{t * 1e3:>10.1f}{ep * args.tokens / t:>12,.0f}")
        times = result["times"]
        summary[ep] = (times["paratrain"], times["DeepSpeed"], times["dense (paratrain)"],
                       result["busiest_over_mean"])
        print(f"    busiest expert {result['busiest_over_mean']:.2f}x the mean load (paratrain, "
              f"last round); MoE / dense of equal active width: "
              f"{times['paratrain'] / times['dense (paratrain)']:.2f}x")
    ours = sum(s[0] for s in summary.values())
    peer = sum(s[1] for s in summary.values())
    print(json.dumps({"benchmark": "moe_vs_peers", "metric": "layer_time_s_ep2_plus_ep4",
                      "paratrain": round(ours, 5), "peer": round(peer, 5),
                      "ratio": round(ours / peer, 3),
                      **{f"ep{ep}_ratio": round(s[0] / s[1], 3) for ep, s in summary.items()},
                      **{f"ep{ep}_vs_dense": round(s[0] / s[2], 3) for ep, s in summary.items()},
                      "peer_name": "deepspeed.moe.layer.MoE"}))


if __name__ == "__main__":
    main()
