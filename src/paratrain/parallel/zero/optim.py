"""AdamW over the shards a rank owns, with fp32 master weights when parameters are not fp32."""

from __future__ import annotations

import torch

from .units import Unit


class ShardedAdamW:
    """torch's AdamW applied to this rank's slices of every unit.

    Parameters are updated element-wise, so updating slices of flat buffers gives exactly
    the update AdamW would make to the whole tensors. With bf16 parameters (or offload) the
    update runs on an fp32 master copy of the slice, which is then copied back.
    """

    def __init__(self, units: list[Unit], cfg, offload: bool = False):
        self.units = units
        self.shards = [u.shard if u.shard is not None else u.flat.own_slice(u.flat.flat) for u in units]
        self.offload = offload and self.shards[0].device.type == "cuda"
        self.master_copy = self.offload or self.shards[0].dtype != torch.float32
        device = "cpu" if self.offload else self.shards[0].device
        self.masters = [s.detach().float().to(device).clone() if self.master_copy else s for s in self.shards]
        # (optimizer tensor, gradient) pairs, split at the weight-decay boundary. The view
        # objects are made once: the optimizer keys its state on them and reads their .grad.
        self.pairs: list[tuple[torch.Tensor, torch.Tensor, bool]] = []
        self.unit_views: list[list[torch.Tensor]] = []  # each unit's optimizer tensors, in order
        for unit, master in zip(units, self.masters):
            views = zip(unit.flat.decay_split(master), unit.flat.decay_split(unit.grad_shard), (True, False))
            pairs = [(m, g, decay) for m, g, decay in views if m.numel()]
            self.pairs += pairs
            self.unit_views.append([m for m, _, _ in pairs])
        self.optimizer = torch.optim.AdamW(
            [{"params": [m for m, _, d in self.pairs if d], "weight_decay": cfg.weight_decay},
             {"params": [m for m, _, d in self.pairs if not d], "weight_decay": 0.0}],
            lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
        if not self.master_copy:
            self._bind_grads(lambda g: g)  # the grad shards themselves, once

    def _bind_grads(self, convert) -> None:
        for master, grad, _ in self.pairs:
            master.grad = convert(grad)

    @torch.no_grad()
    def step(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.master_copy:
            self._bind_grads(lambda g: g.to(self.masters[0].device, torch.float32))
        self.optimizer.step()
        if self.master_copy:
            for shard, master in zip(self.shards, self.masters):
                shard.copy_(master)
            self._bind_grads(lambda g: None)  # free the fp32 copies of the gradients

    @torch.no_grad()
    def squared_norm(self, units: list[Unit], not_owned: set = frozenset()) -> torch.Tensor:
        """This rank's part of the squared gradient norm: ``units``' shards, less the
        parameters in ``not_owned`` (replicated ones another rank counts)."""
        device = self.units[0].grad_shard.device if self.units else "cpu"
        sq = torch.zeros((), device=device)
        for g in (u.grad_shard for u in units):
            sq = sq + g.float().pow(2).sum()
        for unit in units if not_owned else []:
            start, end = unit.flat.shard_range
            for p, offset in zip(unit.flat.params, unit.flat.offsets):
                lo, hi = max(offset, start), min(offset + p.numel(), end)
                if p in not_owned and lo < hi:
                    sq -= unit.grad_shard[lo - start:hi - start].float().pow(2).sum()
        return sq

    def state_tensors(self) -> list[torch.Tensor]:
        state = [v for s in self.optimizer.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor) and v.dim() > 0]
        return state + (self.masters if self.master_copy else [])
