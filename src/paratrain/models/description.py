"""Where things are in a model: the description the strategies act through.

Tensor, sequence, context and pipeline parallelism and recomputation never import a model
class. They read a ``ModelDescription``: the module paths of the blocks and, inside each
block, of the attention projections, the MLP's layers and the attention core, plus the
embedding, final norm, head and loss, and the shape numbers the rules need. The
tensor-parallel split is then a table of (module path, style) and a list of regions,
applied by one loop (``parallel/tensor.py``); the same description tells context
parallelism which core to swap, recomputation what to wrap, and the pipeline what to cut.

paratrain's GPT (and the Hugging Face Llama-family models loaded into it) is described by
``gpt_description``; a model with other attribute names gets a description of its own
(docs/models.md has a worked example).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .shape import ModelShape

Style = Literal["colwise", "colwise_kv", "rowwise", "vocab_embedding", "vocab_head"]
"""How one module is split over the tensor-parallel group:

- ``colwise``: output features (query heads, MLP hidden units) split; the input replicated.
- ``colwise_kv``: like ``colwise`` over the KV heads; when there are fewer KV heads than
  ranks, each rank keeps the one head its query heads use (replicated over ``tp /
  kv_heads`` ranks).
- ``rowwise``: input features split; the output is a partial sum the region's exit completes.
- ``vocab_embedding`` / ``vocab_head``: split over the vocabulary (padded to a multiple
  of tp); the head's loss is computed without gathering the logits.
"""


@dataclass(frozen=True)
class ModelDescription:
    """A decoder-only transformer's layout: its shape and the module paths of its parts."""

    shape: ModelShape
    """The numbers the rules and the splits need (heads, KV heads, MLP width, layers,
    vocabulary before any padding for tensor parallelism): the shape the planner reads."""
    blocks: str = "layers"
    """The module list of transformer blocks."""
    embedding: str = "tok_embeddings"
    """The token embedding."""
    final_norm: str = "norm"
    """The norm after the last block."""
    head: str = "output"
    """The output projection to the vocabulary."""
    loss: str = "loss_fn"
    """The module computing the summed token loss from the logits and targets."""
    attention: str = "attn"
    """In a block: the attention sub-layer (a tensor-parallel region)."""
    attention_core: str = "attn.core"
    """In a block: softmax(QK^T)V on (batch, heads, seq, head_dim) q, k, v; context
    parallelism replaces it and selective recomputation wraps it."""
    q: str = "attn.wq"
    """In a block: the query projection."""
    k: str = "attn.wk"
    """In a block: the key projection."""
    v: str = "attn.wv"
    """In a block: the value projection."""
    o: str = "attn.wo"
    """In a block: the attention output projection."""
    head_norms: tuple[str, ...] = ("attn.q_norm", "attn.k_norm")
    """In a block: norms applied to each head's queries or keys (Qwen3), where the model has
    them. Whole on every tensor-parallel rank, which applies them to its own heads only."""
    mlp: str = "mlp"
    """In a block: the MLP sub-layer (a tensor-parallel region)."""
    mlp_in: tuple[str, ...] = ("mlp.w1", "mlp.w3")
    """In a block: the MLP's input projections (gate and up for SwiGLU)."""
    mlp_out: str = "mlp.w2"
    """In a block: the MLP's output (down) projection."""
    experts: str = "mlp.experts"
    """In a mixture-of-experts block: the stacked experts (parameters of shape (expert,
    ...), split over dim 0 by expert parallelism); dense blocks have none."""
    dispatcher: str = "mlp.dispatcher"
    """In a mixture-of-experts block: the module that runs rows sorted by expert through
    the experts (expert parallelism replaces it with an all-to-all)."""
    sequences: str = "mlp.sequences"
    """In a mixture-of-experts block: the module summing each sequence's routing counts
    over the ranks holding its parts (context and sequence parallelism replace it)."""
    block_args: str = "rope"
    """The model's method giving, from the tokens' positions, the extra arguments every
    block is called with after the residual stream (GPT: cos and sin of the rotary angles);
    pipeline stages call it."""

    def has_experts(self, block) -> bool:
        """Whether ``block`` (a module of the block list) is a mixture-of-experts block."""
        try:
            block.get_submodule(self.experts)
        except AttributeError:
            return False
        return True

    def block_plan(self, experts: bool = False) -> list[tuple[str, Style]]:
        """The tensor-parallel split of one block: (path in the block, style). A block
        with ``experts`` splits its attention only: experts are whole on every rank, each
        routing its own tokens (docs/moe.md)."""
        attention = [(self.q, "colwise"), (self.k, "colwise_kv"), (self.v, "colwise_kv"),
                     (self.o, "rowwise")]
        if experts:
            return attention
        return [*attention, *((path, "colwise") for path in self.mlp_in), (self.mlp_out, "rowwise")]

    def block_regions(self, experts: bool = False) -> list[tuple[str, tuple[str, ...]]]:
        """A block's tensor-parallel regions: (region path, the column layers reading its
        input). The entry collective runs before the region, the exit after it."""
        attention = (self.attention, (self.q, self.k, self.v))
        return [attention] if experts else [attention, (self.mlp, self.mlp_in)]

    def model_plan(self) -> list[tuple[str, Style]]:
        """The split outside the blocks: the embedding and the head, over the vocabulary."""
        return [(self.embedding, "vocab_embedding"), (self.head, "vocab_head")]


def gpt_description(cfg) -> ModelDescription:
    """paratrain's GPT (models/gpt.py) with its config ``cfg``."""
    return ModelDescription(shape=cfg.shape)


def describe(model) -> ModelDescription:
    """``model.description()``: how a model tells the strategies where things are."""
    describe_model = getattr(model, "description", None)
    if describe_model is None:
        raise TypeError(f"{type(model).__name__} has no description(): pass a ModelDescription "
                        f"(models/description.py) saying where its blocks, projections and head are")
    return describe_model()
