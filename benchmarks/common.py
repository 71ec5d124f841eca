"""Shared by the benchmarks: torch's DistributedDataParallel at the settings its
documentation recommends for speed (whichever torch is installed), and checks of their
flags, made before any process starts."""

from __future__ import annotations

import argparse
import inspect
from typing import TYPE_CHECKING

from paratrain.bench.flags import at_least, int_list  # noqa: F401  (the benchmarks import them from here)

if TYPE_CHECKING:  # torch is imported where a peer is built: two_nodes' driver never needs it
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

DDP_SETTINGS = "gradient_as_bucket_view=True, no buffer sync before each forward"


def fast_ddp(module: nn.Module, **kwargs) -> DistributedDataParallel:
    """DDP with gradients as views into its buckets (no copy) and no buffer sync before
    each forward: the model's only buffers, the rotary tables, are equal on every rank.
    torch 2.13 names that switch ``forward_sync_buffers`` and deprecates the older
    ``broadcast_buffers``, which the GPU machines' torch 2.11 still needs."""
    from torch.nn.parallel import DistributedDataParallel

    names = inspect.signature(DistributedDataParallel).parameters
    no_sync = "forward_sync_buffers" if "forward_sync_buffers" in names else "broadcast_buffers"
    return DistributedDataParallel(module, gradient_as_bucket_view=True, **{no_sync: False},
                                   **kwargs)


def fsdp2_gpt(model_config) -> nn.Module:
    """The FSDP2 peer's model: paratrain's GPT of ``model_config`` built on the meta
    device, ``fully_shard`` on every block and on the root (FSDP2's defaults), then
    materialised on CPU, each rank drawing its own shard of every parameter from N(0, 0.02)."""
    import torch
    from torch.distributed.fsdp import fully_shard

    from paratrain.models.gpt import GPT

    with torch.device("meta"):
        model = GPT(model_config)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device="cpu")
    model.init_buffers("cpu")
    with torch.no_grad():
        for p in model.parameters():  # each rank's shard of each DTensor
            p.normal_(0.0, 0.02)
    return model


def stepped_adamw(model: nn.Module):
    """AdamW over ``model`` after one step on a random batch, so its moments exist."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, 256, (1, 16))
    (model(tokens, tokens) / tokens.numel()).backward()
    opt.step()
    return opt


def check_model_flags(parser: argparse.ArgumentParser, model: str, seq: int) -> None:
    """Exit with a usage error naming the flag unless ``--model`` is a GPT preset whose
    rotary tables reach ``--seq`` tokens."""
    from paratrain.models.gpt import preset

    try:
        longest = preset(model).max_seq_len
    except ValueError as exc:
        parser.error(f"--model: {exc}")
    if seq > longest:
        parser.error(f"--seq {seq} is longer than model {model}'s max_seq_len {longest}; "
                     f"pass --seq {longest} or less, or a larger --model")
