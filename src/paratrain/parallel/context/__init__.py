"""Context parallelism: shard the sequence over the cp ranks and make attention see it whole.

Two methods replace ``Attention.core`` of the plain GPT:

* ``RingAttention`` (``ring.py``): K/V blocks travel around the cp ring with P2P while
  each rank computes; online softmax; any number of heads.
* ``UlyssesAttention`` (``ulysses.py``): all-to-all to head sharding and back; needs cp to
  divide the query and KV heads.

Both use the load-balanced layout of ``sharding.py``. Everything outside attention
(embeddings, norms, MLP, loss) is per token and runs on the local shard unchanged.
"""

from __future__ import annotations

from torch import nn
from torch.distributed import ProcessGroup

from ...comm import collectives as C
from ...models.description import ModelDescription, describe
from .ring import RingAttention
from .sharding import (chunk_ids, gather_sequence, positions_for, shard_batch, shard_sequence,
                       unshard_sequence)
from .ulysses import UlyssesAttention, check_heads

METHODS = {"ring": RingAttention, "ulysses": UlyssesAttention}

__all__ = ["METHODS", "RingAttention", "UlyssesAttention", "apply_context_parallel",
           "chunk_ids", "gather_sequence", "positions_for", "shard_batch", "shard_sequence",
           "unshard_sequence"]


def apply_context_parallel(model: nn.Module, cp_group: ProcessGroup, method: str = "ring",
                           description: ModelDescription | None = None) -> None:
    """Make every attention block of ``model`` attend across the ranks of ``cp_group``.

    Swaps each block's attention core (``description.attention_core``; default: the
    model's own description) in place, after any tensor parallelism: head counts are read
    from the query and key weights this rank holds. What the caller must do besides:

    * feed each cp rank its shard: ``tokens, targets, positions = shard_batch(tokens,
      targets, cp_rank, cp_size)`` and call ``model(tokens, targets, positions)`` (the
      positions keep RoPE right); the sequence length must divide by 2·cp;
    * normalise the loss by the token count of the *global* batch over all dp × cp ranks:
      ``loss_sum * (dp·cp / global_tokens)`` before backward, so that averaging gradients
      over dp × cp yields the full-batch mean gradient;
    * reduce gradients over dp × cp (``DataParallel(model, mesh.group(DP_CP))``): cp
      ranks hold the same weights but see different tokens.
    """
    if method not in METHODS:
        raise ValueError(f"cp method {method!r} is not one of {', '.join(METHODS)}")
    desc = description or describe(model)
    for block in model.get_submodule(desc.blocks):
        if method == "ulysses":  # fail at set-up, not in the first forward
            heads = [block.get_submodule(path).weight.shape[0] // desc.shape.head_dim for path in (desc.q, desc.k)]
            check_heads(*heads, C.size(cp_group))
        block.set_submodule(desc.attention_core, METHODS[method](cp_group))
