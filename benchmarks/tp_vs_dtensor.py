"""paratrain tensor parallelism vs torch DTensor tensor parallelism: same model, data and
world size, one run.

    python benchmarks/tp_vs_dtensor.py [--nproc 2] [--steps 18] [--warmup 3] [--no-sp]

Both sides parallelize the whole plain GPT after building it from the same seed:
q/k/v and MLP gate/up column-wise, attention output and MLP down row-wise, the token
embedding over the vocabulary, the output projection column-wise with a vocab-parallel
loss (paratrain's ``VocabParallelCrossEntropy``; DTensor's ``loss_parallel``). The
attention reshapes by head_dim, so on both sides the local head count comes from the
sharded weights. With SP, norms run on sequence shards (paratrain's Megatron-SP;
DTensor's ``SequenceParallel`` + ``PrepareModuleInput``). "no overlap" is paratrain with
``overlap_comm=False``: the backward collective at each block's entry waits instead of
running under the weight-gradient matmuls. The variants take turns step by step
(forward, backward, AdamW), so load changes on a shared machine hit all alike;
reported: median step time over the timed steps.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, loss_parallel, parallelize_module)

from paratrain.launch import spawn
from paratrain.models.gpt import GPT, preset
from paratrain.parallel.tensor import apply_tensor_parallel

from common import at_least, check_model_flags


def dtensor_tp(model: GPT, sp: bool) -> GPT:
    """torchtitan's plan for a Llama block, on our module names."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    seq = Shard(1) if sp else Replicate()  # layout of the residual stream
    layer_plan = {
        "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
        "attn.wo": RowwiseParallel(output_layouts=seq),
        "mlp.w1": ColwiseParallel(), "mlp.w3": ColwiseParallel(),
        "mlp.w2": RowwiseParallel(output_layouts=seq),
    }
    if sp:
        layer_plan.update({
            "attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel(),
            "attn": PrepareModuleInput(input_layouts=(seq, None, None),
                                       desired_input_layouts=(Replicate(), None, None)),
            "mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
        })
    for layer in model.layers:
        parallelize_module(layer, mesh, layer_plan)
    top = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
           "output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)}
    if sp:
        top["norm"] = SequenceParallel()
    parallelize_module(model, mesh, top)
    return model


def one_step(model, optimizer, batch, after_backward, loss_context) -> tuple[float, float]:
    """Forward, backward, optimizer step; returns (seconds, loss)."""
    tokens, targets = batch
    dist.barrier()
    t0 = time.perf_counter()
    optimizer.zero_grad(set_to_none=False)
    with loss_context():
        loss = model(tokens, targets) / targets.numel()
        loss.backward()
    after_backward()
    optimizer.step()
    dist.barrier()
    elapsed = time.perf_counter() - t0
    return elapsed, (loss.full_tensor() if hasattr(loss, "full_tensor") else loss).item()


def worker(args) -> dict:
    torch.manual_seed(0)
    base = GPT(preset(args.model))
    gen = torch.Generator().manual_seed(1)  # every TP rank sees the same batch
    batches = [(torch.randint(0, 256, (args.batch, args.seq), generator=gen),
                torch.randint(0, 256, (args.batch, args.seq), generator=gen)) for _ in range(4)]
    runs = {}
    for sp in ([False] if args.no_sp else [False, True]):
        mode = "TP+SP" if sp else "TP"
        for impl, overlap in (("paratrain", True), ("no overlap", False)):
            ours = copy.deepcopy(base)
            tp = apply_tensor_parallel(ours, dist.group.WORLD, sequence_parallel=sp, overlap_comm=overlap)
            runs[(impl, mode)] = (ours, tp.sync_replicated_grads, torch.enable_grad)
        runs[("DTensor", mode)] = (dtensor_tp(copy.deepcopy(base), sp), lambda: None, loss_parallel)
    opts = {key: torch.optim.AdamW(model.parameters(), lr=1e-3) for key, (model, _, _) in runs.items()}
    times = {key: [] for key in runs}
    losses = {}
    # The variants take turns step by step, so load changes on a shared machine hit all alike.
    for step in range(args.warmup + args.steps):
        for key, (model, after, context) in runs.items():
            elapsed, loss = one_step(model, opts[key], batches[step % len(batches)], after, context)
            if step == 0:
                losses[key] = loss  # same weights, same batch: must agree across variants
            if step >= args.warmup:
                times[key].append(elapsed)
    return {key: (statistics.median(t), losses[key]) for key, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=at_least(1), default=2, help="tensor-parallel size")
    parser.add_argument("--model", default="small")
    parser.add_argument("--batch", type=at_least(1), default=8, help="sequences per step (same on every rank)")
    parser.add_argument("--seq", type=at_least(1), default=128)
    parser.add_argument("--steps", type=at_least(1), default=18, help="timed steps per variant")
    parser.add_argument("--warmup", type=at_least(0), default=3, help="untimed steps per variant")
    parser.add_argument("--no-sp", action="store_true", help="skip the sequence-parallel variant")
    args = parser.parse_args()
    check_model_flags(parser, args.model, args.seq)
    result = spawn(worker, args.nproc, args, backend="gloo")[0]
    cfg = preset(args.model)
    print(f"tensor parallel, model {args.model} ({cfg.num_params() / 1e6:.2f}M params, "
          f"{cfg.n_layers} layers, d_model {cfg.d_model}), tp={args.nproc}, {args.batch} x "
          f"{args.seq} tokens per step, median of {args.steps} steps; whole model "
          f"parallelized on both sides (embedding, blocks, output + vocab-parallel loss)")
    print(f"{'mode':<8}{'implementation':<16}{'ms/step':>10}{'tokens/s':>12}{'step-1 loss':>14}{'ratio':>8}")
    tokens = args.batch * args.seq
    summary = {}
    for mode in dict.fromkeys(m for _, m in result):
        ours, peer = result[("paratrain", mode)][0], result[("DTensor", mode)][0]
        summary[mode] = (ours, peer)
        for impl in ("paratrain", "no overlap", "DTensor"):
            t, loss = result[(impl, mode)]
            ratio = f"{t / peer:.3f}" if impl != "DTensor" else ""
            print(f"{mode:<8}{impl:<16}{t * 1e3:>10.1f}{tokens / t:>12,.0f}{loss:>14.6f}{ratio:>8}")
    ours, peer = summary["TP"]
    record = {"benchmark": "tp_vs_dtensor", "metric": "step_time_s", "nproc": args.nproc,
              "paratrain": round(ours, 5), "peer": round(peer, 5), "ratio": round(ours / peer, 3)}
    if "TP+SP" in summary:
        ours_sp, peer_sp = summary["TP+SP"]
        record.update(sp_paratrain=round(ours_sp, 5), sp_peer=round(peer_sp, 5),
                      sp_ratio=round(ours_sp / peer_sp, 3))
    print(json.dumps(record))


if __name__ == "__main__":
    main()
