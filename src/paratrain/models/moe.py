"""A mixture-of-experts MLP: a router picks ``top_k`` of ``n_experts`` SwiGLU experts for
each token, plus optional shared experts every token goes through.

Written like the rest of the model, with no parallel code. Two seams exist:
``MoE.dispatcher`` takes the tokens sorted by expert and the count per expert and returns
the experts' outputs in the same order. On one process it runs the local experts
(``run_experts``); ``parallel/expert.py`` replaces it with an all-to-all to the ranks that
hold each expert and back. ``MoE.sequences`` turns this rank's routing counts per sequence
into the whole sequence's: on one process they are; where context or sequence parallelism
gives each rank part of every sequence, ``parallel/expert.py`` sums them over those ranks.

Balancing (docs/moe.md has the formulas): with ``aux_loss_coef`` > 0, each MoE layer adds
the Switch/GShard loss computed per sequence,

    aux(seq) = n_experts · Σ_i f_i · P_i,   f_i = tokens of seq sent to i / (T · k),
                                             P_i = mean over seq's T tokens of p_i,

so that it depends on no layout: a sequence is never split between data-parallel ranks
or microbatches. It enters the objective as ``aux_loss_coef · T · Σ_seq aux(seq)`` next
to the summed token loss (the loop divides both by the tokens N of the global batch, so
with no masked targets that is ``coef ·`` the mean over sequences). Its gradient is
injected where the router runs (``_AuxGrad``), so a pipeline does not carry it between
stages; its value is reported beside the loss, not inside it. With ``bias_update`` > 0
(DeepSeek-V3's auxiliary-loss-free balancing) a per-expert bias is added to the scores
for selection only, and moved by ``bias_update · sign(mean load - load)`` after each
optimizer step from the load of the whole global batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def run_experts(x: torch.Tensor, counts: list[int], w1: torch.Tensor, w3: torch.Tensor,
                w2: torch.Tensor) -> torch.Tensor:
    """SwiGLU of each expert on its rows of ``x`` (rows sorted by expert, ``counts`` per
    expert): one grouped GEMM where torch has one for the device (``torch._grouped_mm`` on
    CUDA, bf16), else one GEMM per expert with rows."""
    grouped = getattr(torch, "_grouped_mm", None)
    if grouped is not None and x.is_cuda and x.dtype == torch.bfloat16 and x.shape[0]:
        offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        gate = grouped(x, w1.transpose(-2, -1), offs=offs)
        up = grouped(x, w3.transpose(-2, -1), offs=offs)
        return grouped(F.silu(gate) * up, w2.transpose(-2, -1), offs=offs)
    # Experts without rows run too (on zero rows): the output stays connected to ``x`` and to
    # every weight, so backward reaches the all-to-all that brought ``x`` on every rank, and
    # every expert gets a gradient (zero), whatever the routing. Skipping them hangs the
    # ranks that did receive rows in that all-to-all's backward. ``unbind``, not ``w1[e]``:
    # each indexing's backward writes a zero-filled gradient of the whole stacked weight
    # (n² work for n experts), unbind's stacks the experts' gradients once.
    return torch.cat([F.linear(F.silu(F.linear(rows, g)) * F.linear(rows, u), d)
                      for rows, g, u, d in zip(x.split(counts), w1.unbind(0), w3.unbind(0),
                                               w2.unbind(0))])


class Experts(nn.Module):
    """``n`` SwiGLU experts as three stacked weights (expert, out, in): one tensor per
    projection, so a rank's share under expert parallelism is a slice of dim 0."""

    def __init__(self, n: int, d_model: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n, hidden, d_model))  # gate
        self.w3 = nn.Parameter(torch.empty(n, hidden, d_model))  # up
        self.w2 = nn.Parameter(torch.empty(n, d_model, hidden))  # down

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return run_experts(x, counts, self.w1, self.w3, self.w2)


class _AuxGrad(torch.autograd.Function):
    """Returns ``x`` unchanged; in backward gives ``aux`` the gradient ``scale``: the
    auxiliary loss joins the objective without travelling with the activations."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, grad.new_tensor(ctx.scale, dtype=torch.float32), None


class LocalDispatch(nn.Module):
    """The experts' outputs for rows sorted by expert, all experts on this rank: the seam
    expert parallelism replaces with an all-to-all (``parallel/expert.py``)."""

    def forward(self, rows: torch.Tensor, counts: torch.Tensor, experts: Experts) -> torch.Tensor:
        return experts(rows, counts.tolist())


class WholeSequences(nn.Module):
    """Each sequence's tokens per expert, from this rank's: the same where every rank holds
    whole sequences; the seam sequence-splitting layouts replace (``parallel/expert.py``)."""

    parts = 1
    """Ranks each sequence is split over."""

    def forward(self, per_seq: torch.Tensor) -> torch.Tensor:
        return per_seq


class MoE(nn.Module):
    """Router, routed experts and optional shared experts of one block (see module doc)."""

    def __init__(self, cfg):
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.router_kind, self.norm_topk = cfg.router, cfg.norm_topk
        self.aux_coef, self.bias_update = cfg.aux_loss_coef, cfg.bias_update
        self.capacity_factor, self.routed_scale = cfg.capacity_factor, cfg.routed_scale
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.experts = Experts(cfg.n_experts, cfg.d_model, cfg.expert_dim)
        self.dispatcher = LocalDispatch()
        self.sequences = WholeSequences()
        self.shared = None
        if cfg.shared_ffn:
            from .gpt import SwiGLU  # the dense MLP, at the shared experts' width

            self.shared = SwiGLU(cfg, hidden=cfg.shared_ffn)
        self.shared_gate = nn.Linear(cfg.d_model, 1, bias=False) if cfg.shared_gate else None
        # Selection bias (auxiliary-loss-free balancing): moved by update_bias, never by a
        # gradient; a parameter so that checkpoints, exports of the state and every layout's
        # bookkeeping carry it like the weights.
        self.expert_bias = nn.Parameter(torch.zeros(cfg.n_experts), requires_grad=False)
        self.loss_scale = 1.0
        """d(objective)/d(summed token loss) of the step running: the aux loss's gradient
        is ``loss_scale · aux_coef · T`` (set by the step, parallel/step.py)."""
        self.stats = MoEStats(cfg.n_experts)
        """What this layer routed since the stats were last read (metrics)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        flat = x.reshape(-1, d)
        logits = self.router(flat).float()
        scores = logits.softmax(-1) if self.router_kind == "softmax" else logits.sigmoid()
        chosen = (scores + self.expert_bias if self.bias_update else scores).topk(self.top_k, -1).indices
        weights = scores.gather(-1, chosen)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = (weights * self.routed_scale).to(x.dtype)
        counts = torch.bincount(chosen.reshape(-1), minlength=self.n_experts)
        keep = self._capacity_mask(chosen.view(b, s * self.top_k)) if self.capacity_factor else None
        out = self._route(flat, chosen, weights, keep)
        if self.shared is not None:
            shared = self.shared(flat)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(flat)) * shared
            out = out + shared
        out = out.view(b, s, d)
        if self.training and torch.is_grad_enabled():
            out = self._balance(out, scores.view(b, s, -1), chosen.view(b, s, -1), counts, keep)
        return out

    def _route(self, flat: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor,
               keep: torch.Tensor | None) -> torch.Tensor:
        """Σ_k weight_k · expert_k(x) per token: assignments sorted by expert, run, unsorted."""
        k = self.top_k
        assignments = chosen.reshape(-1)
        if keep is not None:  # dropped assignments go to no expert and add nothing
            assignments = torch.where(keep.reshape(-1), assignments, self.n_experts)
        order = torch.argsort(assignments, stable=True)
        counts = torch.bincount(assignments, minlength=self.n_experts + 1)[:self.n_experts]
        routed = int(counts.sum())
        rows = order[:routed]
        y = self.dispatcher(flat[rows // k], counts, self.experts)
        full = y.new_zeros(flat.shape[0] * k, flat.shape[1]).index_copy(0, rows, y)
        w = weights.reshape(-1, 1) if keep is None else (weights * keep).reshape(-1, 1)
        return (full * w).view(-1, k, flat.shape[1]).sum(1)

    def _capacity_mask(self, per_seq: torch.Tensor) -> torch.Tensor:
        """Which assignments fit (``per_seq``: each sequence's T · k chosen experts, in
        token order): each expert takes at most capacity_factor · T · k / E of a sequence's
        assignments, earliest tokens first, the rest dropped (counted). Per sequence, like
        the balancing statistics, so that no layout or microbatch size changes what drops."""
        capacity = int(self.capacity_factor * per_seq.shape[1] / self.n_experts)
        onehot = F.one_hot(per_seq, self.n_experts)
        place = (onehot.cumsum(1) * onehot).sum(-1) - 1  # each assignment's place in its expert
        return (place < capacity).view(-1, self.top_k)

    def _balance(self, out, scores, chosen, counts, keep) -> torch.Tensor:
        """Record the load, and attach the auxiliary loss's gradient to ``out``."""
        dropped = int((~keep).sum()) if keep is not None else 0
        if not self.aux_coef:
            self.stats.add(counts, dropped, 0.0)
            return out
        b, s, _ = scores.shape
        # f from the whole sequence (summed over the ranks holding its parts); P's sum over
        # this rank's tokens only: the ranks' parts of aux then add up to aux, and each
        # rank's tokens get exactly their share of its gradient.
        per_seq = self.sequences(F.one_hot(chosen, self.n_experts).sum((1, 2)).float())  # (b, E)
        tokens = s * self.sequences.parts
        f = per_seq / (tokens * self.top_k)
        probs = scores if self.router_kind == "softmax" else scores / scores.sum(-1, keepdim=True)
        aux = self.n_experts * (f * probs.sum(1) / tokens).sum()  # this rank's part, Σ over seqs
        self.stats.add(counts, dropped, float(aux.detach()))
        return _AuxGrad.apply(out, aux, self.loss_scale * self.aux_coef * tokens)

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor) -> None:
        """After an optimizer step: move the selection bias toward balance, from the
        global batch's tokens per expert ``load`` (the same on every rank)."""
        if self.bias_update:
            self.expert_bias += self.bias_update * torch.sign(load.float().mean() - load.float()).to(
                self.expert_bias.device)


class MoEStats:
    """Tokens per expert, dropped assignments and this rank's part of Σ_seq aux since the
    last read (summed over the step's microbatches; recomputed forwards are not counted)."""

    def __init__(self, n_experts: int):
        self.n_experts = n_experts
        self.reset()

    def reset(self) -> None:
        self.load = torch.zeros(self.n_experts, dtype=torch.int64, device="cpu")  # not meta
        self.dropped = 0
        self.aux = 0.0

    def add(self, counts: torch.Tensor, dropped: int, aux: float) -> None:
        if torch._C._current_graph_task_id() == -1:  # not a recompute inside backward
            self.load += counts.detach().cpu()
            self.dropped += dropped
            self.aux += aux
