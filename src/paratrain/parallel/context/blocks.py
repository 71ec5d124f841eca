"""Attention on one block, the unit ring attention is made of: some query rows against
one K/V block, returning the log-sum-exp (LSE) of each score row next to the output, and
in backward taking the *final* LSE and output of those rows (after all blocks were
merged) so that the recomputed probabilities are the true ones.

Shapes: q (b, heads, n, d); k, v (b, kv_heads, m, d) with heads a multiple of kv_heads
(grouped-query attention); out (b, heads, n, d) and lse (b, heads, n) in fp32. Backward
returns dq like q and dk, dv like k, in fp32. ``causal`` masks key j > query i inside the
block (the diagonal block, where n == m); otherwise every query sees every key.

Two kernels compute the same thing:

* ``math``: the formulas in plain tensor ops, in fp32; runs anywhere and is the readable
  reference. It materialises the (n, m) scores of the block.
* ``flash_cpu``: torch's fused CPU flash-attention kernel, which returns the LSE and
  accepts the final output and LSE in its backward; several times faster on CPU and never
  materialises the scores. It needs as many K/V heads as query heads, so grouped K/V are
  repeated for the block and dK/dV summed back onto the KV heads.

``pick_kernel("auto", device)`` takes flash_cpu on CPU when this torch has it, math
otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_CPU_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(b, h, n, d) -> (b, kv_heads, h / kv_heads, n, d): the query heads sharing a KV head."""
    b, h, n, d = q.shape
    return q.reshape(b, kv_heads, h // kv_heads, n, d)


def _scores(q5: torch.Tensor, k: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """Scaled scores (b, g, rep, n, m); K broadcasts over the rep query heads sharing it."""
    s = torch.matmul(q5, k.unsqueeze(2).transpose(-1, -2)).mul_(scale)
    if causal:
        n, m = s.shape[-2:]
        s.masked_fill_(torch.ones(n, m, dtype=torch.bool, device=s.device).triu_(1), float("-inf"))
    return s


def math_forward(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    q5 = _grouped(q.float(), k.shape[1])
    s = _scores(q5, k.float(), scale, causal)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(s.sub_(lse.unsqueeze(-1)).exp_(), v.float().unsqueeze(2))
    return out.flatten(1, 2), lse.flatten(1, 2)


def math_backward(dout, q, k, v, out, lse, causal: bool,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = k.shape[1]
    q5, dout5 = _grouped(q.float(), g), _grouped(dout.float(), g)
    k, v = k.float(), v.float()
    delta = (dout5 * _grouped(out.float(), g)).sum(-1, keepdim=True)  # rowsum(dO * O)
    p = _scores(q5, k, scale, causal).sub_(_grouped(lse.unsqueeze(-1), g)).exp_()
    dv = torch.matmul(p.transpose(-1, -2), dout5).sum(2)  # sum over rep: back to KV heads
    dp = torch.matmul(dout5, v.unsqueeze(2).transpose(-1, -2))
    ds = p.mul_(dp.sub_(delta)).mul_(scale)  # softmax backward, the 1/sqrt(d) folded in
    dq = torch.matmul(ds, k.unsqueeze(2))
    dk = torch.matmul(ds.transpose(-1, -2), q5).sum(2)
    return dq.flatten(1, 2), dk, dv


def _repeat_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def flash_cpu_forward(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    h = q.shape[1]
    out, lse = _FLASH_CPU(q, _repeat_kv(k, h), _repeat_kv(v, h), is_causal=causal, scale=scale)
    return out.float(), lse.float()


def flash_cpu_backward(dout, q, k, v, out, lse, causal: bool,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, h, n, d = q.shape
    g, m = k.shape[1], k.shape[2]
    dq, dk, dv = _FLASH_CPU_BACKWARD(dout.to(q.dtype), q, _repeat_kv(k, h), _repeat_kv(v, h),
                                     out.to(q.dtype), lse, 0.0, causal, scale=scale)
    dk, dv = (t.float().view(b, g, h // g, m, d).sum(2) for t in (dk, dv))
    return dq.float(), dk, dv


@dataclass(frozen=True)
class BlockKernel:
    """A pair of functions computing attention on one block (see the module docstring)."""

    name: str
    """Short name, as accepted by ``pick_kernel``."""
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    """(q, k, v, causal, scale) -> (out, lse), fp32."""
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    """(dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv), fp32; out and lse final."""


KERNELS = {"math": BlockKernel("math", math_forward, math_backward)}
if _FLASH_CPU is not None and _FLASH_CPU_BACKWARD is not None:
    KERNELS["flash_cpu"] = BlockKernel("flash_cpu", flash_cpu_forward, flash_cpu_backward)


def pick_kernel(name: str | BlockKernel, device: torch.device) -> BlockKernel:
    """The kernel called ``name`` ("auto": flash_cpu on CPU if available, else math)."""
    if isinstance(name, BlockKernel):
        return name
    if name == "auto":
        name = "flash_cpu" if device.type == "cpu" and "flash_cpu" in KERNELS else "math"
    if name not in KERNELS:
        raise ValueError(f"unknown ring attention kernel {name!r}; this torch has "
                         f"{', '.join(KERNELS)} (or 'auto')")
    if name == "flash_cpu" and device.type != "cpu":
        raise ValueError(f"the flash_cpu kernel runs on CPU tensors, these are on {device}; "
                         f"use kernel='auto' or 'math'")
    return KERNELS[name]
