"""Split a built model into the chunks one pipeline rank runs, through its description.

Virtual stage ``k`` of ``pp * v`` gets a contiguous run of transformer blocks: evenly when
pp * v divides the layers, else balanced with the embedding and head counted
(``paratrain.stages``, the rule ``plan`` uses too); the token embedding joins the first
virtual stage and the final norm, output projection and loss the last. Rank ``r`` keeps the chunks of
virtual stages ``r, r + pp, r + 2pp, ...`` (Megatron's interleaving), or on a V (ZBV,
DualPipeV: ``schedules.placement``) stages ``r`` and ``2pp - 1 - r``, and the parameters of
every other stage are released, so each rank holds about 1/pp of the model.

Chunks keep the model's module names (``layers.5.attn.wq.weight`` stays that), so gradients,
optimizer states and checkpoints line up with the unsplit model.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ... import rules
from ...layout import LayoutError
from ...models.description import ModelDescription, describe
from ...stages import head_costs, pipeline_split, split_layers  # noqa: F401 - re-exported
from .schedules import rank_stages
from .tied import untie


class PipelineChunk(nn.Module):
    """A contiguous slice of a model: optionally the embedding, some blocks, optionally the
    final norm, head and loss, found through the model's description.

    ``forward(x, targets=None, positions=None)`` takes token ids on the first virtual
    stage and the residual stream (batch, seq, d_model) elsewhere; it returns the residual
    stream, or on the last virtual stage the summed token loss against ``targets``. Every
    block is called as ``block(h, *model.<block_args>(positions))`` (the rotary tables for
    paratrain's GPT).
    """

    def __init__(self, model: nn.Module, desc: ModelDescription, stage: int, num_stages: int,
                 layers: range):
        super().__init__()
        self.stage, self.num_stages, self.desc = stage, num_stages, desc
        self.layer_ids = layers
        # Modules sit at the model's own paths (blocks keyed by their original index), so
        # parameter names match the unsplit model's, and are registered in the order they
        # run (ZeRO's units and prefetching follow it).
        blocks = model.get_submodule(desc.blocks)
        if self.is_first:
            _attach(self, desc.embedding, model.get_submodule(desc.embedding))
        _attach(self, desc.blocks, nn.ModuleDict({str(i): blocks[i] for i in layers}))
        for path in [desc.final_norm, desc.head, desc.loss] if self.is_last else []:
            _attach(self, path, model.get_submodule(path))
        # The extra arguments of every block (GPT: cos and sin of the rotary angles) come
        # from the model's method; its tables are shared, not copied.
        self.block_args = getattr(model, desc.block_args)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def blocks(self) -> list[nn.Module]:
        """This chunk's transformer blocks, in order."""
        return list(self.get_submodule(self.desc.blocks).values())

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        if positions is None:
            positions = torch.arange(x.shape[1], device=x.device)
        args = self.block_args(positions)
        h = self.get_submodule(self.desc.embedding)(x) if self.is_first else x
        for block in self.blocks():
            h = block(h, *args)
        if not self.is_last:
            return h
        if targets is None:
            raise ValueError(f"virtual stage {self.stage} is the last one and computes the "
                             f"loss: pass targets")
        d = self.desc
        logits = self.get_submodule(d.head)(self.get_submodule(d.final_norm)(h))
        return self.get_submodule(d.loss)(logits, targets)

    def extra_repr(self) -> str:
        ids = self.layer_ids
        return f"stage={self.stage}/{self.num_stages}, layers={ids.start}..{ids.stop - 1}"


def _attach(root: nn.Module, path: str, module: nn.Module) -> None:
    """Register ``module`` at the dotted ``path`` under ``root``, creating empty parents."""
    *parents, name = path.split(".")
    for parent in parents:
        if not hasattr(root, parent):
            root.add_module(parent, nn.Module())
        root = getattr(root, parent)
    root.add_module(name, module)


def split_model(model: nn.Module, pp_rank: int, pp_size: int, virtual_stages: int = 1,
                layer_costs: Sequence[float] | None = None, embed_cost: float = 0.0,
                head_cost: float = 0.0,
                description: ModelDescription | None = None,
                placement: str = "loop") -> list[PipelineChunk]:
    """This rank's chunks of ``model``, in local order (chunk c is virtual stage
    c * pp_size + pp_rank; with ``placement="v"`` stages pp_rank and 2 pp_size - 1 - pp_rank).
    The model is consumed: parameters of other ranks' stages are
    released (their storage freed) and only the returned chunks remain usable."""
    desc = description or describe(model)
    rules.pipeline_split(desc.shape.n_layers, pp_size, virtual_stages)
    tied = model.get_submodule(desc.head).weight is model.get_submodule(desc.embedding).weight
    if not 0 <= pp_rank < pp_size:
        raise LayoutError(f"pp_rank={pp_rank} is outside a pipeline of {pp_size} ranks")
    num_stages = pp_size * virtual_stages
    if layer_costs is None and not embed_cost and not head_cost:  # train's rule (stages.py)
        runs = desc.shape.stage_runs(pp_size, virtual_stages)
    else:
        runs = split_layers(desc.shape.n_layers, num_stages, layer_costs, embed_cost, head_cost)
    if placement not in ("loop", "v") or (placement == "v" and virtual_stages != 2):
        raise LayoutError(f"placement={placement!r} with virtual_stages={virtual_stages}: use "
                          f"'loop', or 'v' with two chunks per rank")
    chunks = [PipelineChunk(model, desc, s, num_stages, runs[s])
              for s in rank_stages(pp_rank, pp_size, virtual_stages, placement)]
    if tied and placement == "v":
        raise LayoutError("a V placement (zbv, dualpipev) holds the embedding and the head on "
                          "pipeline rank 0; tied embeddings are not supported there: untie "
                          "them (model.tie_embeddings false) or use --schedule zbh1")
    if tied:  # the last stage projects with a copy of its own (pipeline/tied.py)
        untie(chunks, desc.head)
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
