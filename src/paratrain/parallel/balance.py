"""The mixture-of-experts layers of a rank's model chunks, as the step sees them: the scale
of their auxiliary loss's gradient, and what a step routed (tokens per expert, the
auxiliary loss, dropped assignments), summed over the ranks that saw different tokens and
turned into metrics and the selection bias's update.

Found by what the layers do, not by their class (``models/moe.py``'s ``MoE`` has them):
a ``stats`` record, ``update_bias`` and ``loss_scale``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed import ProcessGroup

from ..comm import collectives as C


class Balance:
    """This rank's MoE layers and the groups their step figures are summed over."""

    def __init__(self, layers: list[nn.Module], data_groups: tuple[ProcessGroup, ...],
                 stage_group: ProcessGroup | None):
        self.layers = layers
        self.data_groups, self.stage_group = data_groups, stage_group
        """The groups whose ranks routed different tokens (dp x cp; tp under sequence
        parallelism), and the pipeline stages (holding different layers)."""

    @classmethod
    def find(cls, chunks: list[nn.Module], data_groups: tuple[ProcessGroup, ...] = (),
             stage_group: ProcessGroup | None = None) -> "Balance | None":
        """The MoE layers of ``chunks``, or None where there are none (a dense model, or a
        pipeline stage without MoE blocks; a stage group still needs every stage's figures,
        so a pipeline gets a Balance on every stage)."""
        layers = [m for chunk in chunks for m in chunk.modules()
                  if hasattr(m, "update_bias") and hasattr(m, "stats")]
        if not layers and stage_group is None:
            return None
        return cls(layers, data_groups, stage_group)

    def set_loss_scale(self, scale: float) -> None:
        """d(objective)/d(summed token loss) for the step about to run (parallel/step.py)."""
        for m in self.layers:
            m.loss_scale = scale

    @torch.no_grad()
    def after_step(self, sequences: int, update: bool) -> dict[str, float]:
        """The step's figures over the global batch of ``sequences``: ``aux_loss`` (Σ over
        MoE layers of the mean over sequences, without its coefficient), ``expert_load``
        (the busiest expert's tokens over the mean, at the worst layer) and
        ``dropped_tokens``; with ``update``, the selection bias moves (collective)."""
        if self.layers:
            load = torch.stack([m.stats.load for m in self.layers]).float()
        else:
            load = torch.zeros(0, 1)
        aux = torch.tensor([m.stats.aux for m in self.layers] + [sum(m.stats.dropped for m in self.layers)],
                           dtype=torch.float64)
        device = next((p.device for m in self.layers for p in m.parameters()), torch.device("cpu"))
        load, aux = load.to(device), aux.to(device)
        for group in self.data_groups:  # each rank routed tokens of its own
            if load.numel():  # a stage without MoE layers has none (its dp peers neither)
                C.all_reduce(load, group)
            C.all_reduce(aux, group)
        for m, layer_load in zip(self.layers, load):
            if update:
                m.update_bias(layer_load)
            m.stats.reset()
        busiest = (load.max(1).values / load.mean(1).clamp_min(1e-9)).max() if len(load) else load.new_zeros(())
        figures = torch.stack([aux[:-1].sum() / sequences, busiest.double(), aux[-1]])
        if self.stage_group is not None:  # each stage holds its own layers
            totals, worst = figures[[0, 2]].clone(), figures[1:2].clone()
            C.all_reduce(totals, self.stage_group)
            C.all_reduce(worst, self.stage_group, op="max")
            figures = torch.stack([totals[0], worst[0], totals[1]])
        aux_loss, expert_load, dropped = figures.tolist()
        return {"aux_loss": aux_loss, "expert_load": expert_load, "dropped_tokens": int(dropped)}
