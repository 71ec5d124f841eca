"""Split a built GPT into the chunks one pipeline rank runs.

Virtual stage ``k`` of ``pp * v`` gets a contiguous run of transformer blocks: evenly when
pp * v divides the layers, else balanced with the embedding and head counted
(``paratrain.stages``, the rule ``plan`` uses too); the token embedding joins the first
virtual stage and the final norm, output projection and loss the last. Rank ``r`` keeps the chunks of
virtual stages ``r, r + pp, r + 2pp, ...`` (Megatron's interleaving) and the parameters of
every other stage are released, so each rank holds about 1/pp of the model.

Chunks keep the GPT's module names (``layers.5.attn.wq.weight`` stays that), so gradients,
optimizer states and checkpoints line up with the unsplit model.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ... import rules
from ...layout import LayoutError
from ...models.gpt import GPT
from ...stages import head_costs, pipeline_split, split_layers  # noqa: F401 - re-exported


class PipelineChunk(nn.Module):
    """A contiguous slice of a GPT: optionally the embedding, some blocks, optionally the
    head and loss.

    ``forward(x, targets=None, positions=None)`` takes token ids on the first virtual
    stage and the residual stream (batch, seq, d_model) elsewhere; it returns the residual
    stream, or on the last virtual stage the summed token loss against ``targets``.
    """

    def __init__(self, model: GPT, stage: int, num_stages: int, layers: range):
        super().__init__()
        self.stage, self.num_stages = stage, num_stages
        self.layer_ids = layers
        first, last = stage == 0, stage == num_stages - 1
        self.tok_embeddings = model.tok_embeddings if first else None
        # Keyed by the original index so parameter names match the unsplit GPT.
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layers})
        self.norm = model.norm if last else None
        self.output = model.output if last else None
        self.loss_fn = model.loss_fn if last else None
        # Rotary tables are shared with the model (no copy); each chunk needs the angles
        # of the sequence positions it sees.
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of the rotary angles at ``positions`` (as ``GPT.rope``)."""
        return self.rope_cos[positions], self.rope_sin[positions]

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        if positions is None:
            positions = torch.arange(x.shape[1], device=x.device)
        cos, sin = self.rope(positions)
        h = self.tok_embeddings(x) if self.is_first else x
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        if not self.is_last:
            return h
        if targets is None:
            raise ValueError(f"virtual stage {self.stage} is the last one and computes the "
                             f"loss: pass targets")
        return self.loss_fn(self.output(self.norm(h)), targets)

    def extra_repr(self) -> str:
        ids = self.layer_ids
        return f"stage={self.stage}/{self.num_stages}, layers={ids.start}..{ids.stop - 1}"


def split_model(model: GPT, pp_rank: int, pp_size: int, virtual_stages: int = 1,
                layer_costs: Sequence[float] | None = None, embed_cost: float = 0.0,
                head_cost: float = 0.0) -> list[PipelineChunk]:
    """This rank's chunks of ``model``, in local order (chunk c is virtual stage
    c * pp_size + pp_rank). The model is consumed: parameters of other ranks' stages are
    released (their storage freed) and only the returned chunks remain usable."""
    cfg = model.cfg
    rules.pipeline_split(cfg.n_layers, pp_size, virtual_stages)
    rules.tied_embeddings(cfg.tie_embeddings, pp_size, zero=0)
    if not 0 <= pp_rank < pp_size:
        raise LayoutError(f"pp_rank={pp_rank} is outside a pipeline of {pp_size} ranks")
    num_stages = pp_size * virtual_stages
    if layer_costs is None and not embed_cost and not head_cost:  # train's rule (stages.py)
        d, kv = cfg.d_model, cfg.kv_heads * cfg.head_dim
        block = 2 * d + 2 * d * d + 2 * d * kv + 3 * d * cfg.ffn_dim
        runs = pipeline_split(cfg.n_layers, pp_size, virtual_stages,
                              *head_costs(cfg.vocab_size, d, block))
    else:
        runs = split_layers(cfg.n_layers, num_stages, layer_costs, embed_cost, head_cost)
    chunks = [PipelineChunk(model, s, num_stages, runs[s])
              for s in range(pp_rank, num_stages, pp_size)]
    _release_others(model, chunks)
    return chunks


@torch.no_grad()
def _release_others(model: nn.Module, chunks: list[PipelineChunk]) -> None:
    """Free the storage of every parameter no local chunk uses: the caller may still
    hold the model, and memory must fall by ~pp all the same."""
    kept = {p for chunk in chunks for p in chunk.parameters()}
    for p in model.parameters():
        if p not in kept:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            p.grad = None
