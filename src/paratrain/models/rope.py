"""Rotary position embeddings: the angle tables (with Llama 3.1's long-context scaling)
and the rotation of adjacent pairs, computed in fp32 the way transformers does."""

from __future__ import annotations

import math

import torch


def rope_tables(cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, shape (max_seq_len, head_dim / 2), computed in
    fp32 the way transformers does, so imported Llama-family models match it."""
    freqs = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim))
    if cfg.rope_scaling:
        freqs = _llama3_scaling(freqs, cfg.rope_scaling)
    angles = torch.outer(torch.arange(cfg.max_seq_len).float(), freqs)
    return angles.cos(), angles.sin()


def parse_rope_scaling(spec: str) -> tuple[float, float, float, float]:
    """``llama3:FACTOR:LOW:HIGH:ORIGINAL_MAX_LEN`` as (factor, low, high, original), or
    ValueError naming what is wrong (a zero factor or low == high make NaN angles)."""
    form = "'llama3:FACTOR:LOW_FREQ_FACTOR:HIGH_FREQ_FACTOR:ORIGINAL_MAX_LEN', e.g. 'llama3:8:1:4:8192'"
    parts = spec.split(":")
    if len(parts) != 5 or parts[0] != "llama3":
        raise ValueError(f"rope_scaling={spec!r}: expected {form}")
    try:
        factor, low, high, original = map(float, parts[1:])
    except ValueError:
        raise ValueError(f"rope_scaling={spec!r}: its four values must be numbers, as in {form}") from None
    if not (math.isfinite(factor) and factor > 0 and 0 < low < high < math.inf and 0 < original < math.inf):
        raise ValueError(f"rope_scaling={spec!r}: need FACTOR > 0, 0 < LOW_FREQ_FACTOR < "
                         f"HIGH_FREQ_FACTOR and ORIGINAL_MAX_LEN > 0, as in {form}")
    return factor, low, high, original


def _llama3_scaling(freqs: torch.Tensor, spec: str) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by ``factor``, short ones kept, a smooth blend
    between (Meta's reference; transformers' ``rope_type="llama3"``)."""
    factor, low, high, original = parse_rope_scaling(spec)
    wavelen = 2 * math.pi / freqs
    scaled = torch.where(wavelen > original / low, freqs / factor, freqs)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(medium, blended, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of x (batch, heads, seq, head_dim) by each position's angle."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)
