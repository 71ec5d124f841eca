"""Achievable compute rate from the shapes each rank actually multiplies.

A GEMM of shape (M, K, N) on one rank (M tokens of the microbatch on this rank, K and N
the hidden, ffn or head widths after the tensor-parallel split) runs at

    rate(M, K, N) = peak · efficiency · sat(min(M, K, N)) / sat(ref) · waves(M, N)

capped at peak · efficiency, and never faster than its bytes over HBM (the roofline):

* ``efficiency`` (``GpuSpec.efficiency``) is the *maximum achievable matmul FLOPS*
  over the datasheet peak, measured with bf16 inputs by S. Bekman's ``mamf-finder.py``
  (github.com/stas00/ml-engineering, compute/accelerator/README.md, "Maximum Achievable
  Matmul FLOPS comparison table"): A100 SXM 267.9 of 312 TFLOP/s (85.9%, best shape
  6912x16384x2048), H100 SXM 792.1 of 989 (80.1%, 6144x17920x2816), H100/H200 SXM
  794.5 (80.3%). ``ref`` is that best shape: the curve passes through the measurement.
* ``sat(d) = d / (d + half_dim)``: a tile's fixed cost (filling its software pipeline
  along K, writing its output tile) amortised over the smallest dimension; half of the
  asymptotic rate at d = ``half_dim``. On the H100 it is measured: 224 fits best the 433
  bf16 GEMMs of tp-split Llama 3 8B/70B block shapes that ``benchmarks/gpu_compute.py``
  timed on one H100 (cuBLAS, torch 2.11; tests/data/h100_compute.json; median |error|
  10%). The A100 keeps 128, an assumption from a CUTLASS / cuBLAS mainloop running 3-4
  stages of 32-64 elements of K ahead of its math. On the local cluster ``--calibrate``
  measures it.
* ``waves``: wave quantization (NVIDIA, "Matrix Multiplication Background User's
  Guide", "Wave Quantization"): an M x N output is cut into 128 x 128 tiles; with T
  tiles on S streaming multiprocessors the last of ceil(T/S) waves is partly idle, so
  the GPU is busy T / (ceil(T/S) · S) of the time. S = 108 on A100, 132 on H100/H200
  (datasheets). Tile quantization (partial tiles at the edges) is the same formula's
  T counting partial tiles as whole. CPUs have no waves (``sms`` = 0).

Attention's core (QK^T and softmax·V) runs in a FlashAttention-style kernel at
``GpuSpec.attention_efficiency`` of peak on long sequences (A100: FlashAttention-2, Dao
2023, forward + backward at about 60% of peak with head dimension 128; H100: 47%, what
torch 2.11's SDPA (cuDNN attention) reached forward + backward at head dimension 128 and
sequences of 2K-16K on one H100, tests/data/h100_compute.json; FlashAttention-2's paper
gives 35% there), scaled by ``sat`` of the per-rank query length (short sequences leave
the kernel's tiles and SMs idle) and causal: the kernel skips the blocks above the
diagonal, half of the FLOPs Megatron's count (``flops.step_flops``) includes.

Without FlashAttention (``Training.flash_attention`` False: runs before 2022) the core
is two batched GEMMs per head at the curve plus the s x s scores' HBM traffic
(``unfused_attention_time``).

Everything that is not a matmul (norms, residual adds, the MLP's activation, RoPE,
dropout) is memory-bound: ``elementwise_bytes`` counts the bytes each block's forward
reads and writes, timed at the HBM bandwidth; backward moves twice as many.
"""

from __future__ import annotations

import math
from functools import lru_cache

from .mla import head_dims, rope_and_norm_elems
from .models import ModelSpec

TILE = (128, 128)
"""Output tile (rows, columns) for wave quantization: the guide's A100 example tile."""


@lru_cache(maxsize=1 << 16)
def gemm_efficiency(m: int, k: int, n: int, half_dim: float, sms: int,
                    ref: tuple[int, int, int] | None, batch: int = 1) -> float:
    """Fraction of ``peak · efficiency`` a GEMM of shape (m, k, n) reaches (at most 1);
    ``batch`` GEMMs of that shape in one strided-batched launch share the waves."""
    d = min(m, k, n)
    sat = d / (d + half_dim) if half_dim else 1.0
    if ref is not None and half_dim:
        r = min(ref)
        sat /= r / (r + half_dim)
    wave = 1.0
    if sms:
        tiles = batch * math.ceil(m / TILE[0]) * math.ceil(n / TILE[1])
        wave = tiles / (math.ceil(tiles / sms) * sms)
        wave *= m * n / (math.ceil(m / TILE[0]) * TILE[0] * math.ceil(n / TILE[1]) * TILE[1])
    return min(1.0, sat * wave)


def matmul_time(m: int, k: int, n: int, rate: float, half_dim: float, gpu, elem: int,
                batch: int = 1) -> float:
    """Seconds of ``batch`` (m, k, n) GEMMs in one launch: FLOPs at the shape's rate, or
    their bytes at HBM bandwidth, whichever is longer. ``rate`` is peak · efficiency of
    the precision."""
    eff = gemm_efficiency(m, k, n, half_dim, gpu.sms, gpu.mamf_shape, batch)
    return batch * max(2 * m * k * n / (rate * eff), elem * (m * k + k * n + m * n) / gpu.hbm_bw)


def attention_time(flops: float, s_q: int, rate: float, half_dim: float) -> float:
    """Seconds of an attention core of ``flops`` (counted without the causal mask) whose
    queries are ``s_q`` tokens per sequence on this rank, at ``rate`` on long ones."""
    sat = s_q / (s_q + half_dim) if half_dim else 1.0
    return 0.5 * flops / (rate * sat)


def unfused_attention_time(model: ModelSpec, b: int, s_q: int, s_kv: int, tp: int,
                           rate: float, half_dim: float, gpu, elem: int) -> float:
    """Seconds of one block's attention core forward without FlashAttention: QK^T and
    softmax·V, (s_q, head_dim, s_kv) and (s_q, s_kv, head_dim) per head, each one
    strided-batched GEMM over every head of the microbatch (Megatron's ``baddbmm`` and
    ``bmm``), at the GEMM curve with the heads' tiles sharing the waves, plus the scores' traffic at HBM bandwidth: QK^T writes them,
    a fused scale-mask-softmax reads and writes them, softmax·V reads them, and with
    dropout its kernel reads, writes and stores a 1-byte mask (no causal skipping: the
    masked half is computed and moved too)."""
    heads = b * model.n_heads // tp
    qk, v = head_dims(model)  # head_dim twice; MLA's d_n + d_r and d_v
    gemms = (matmul_time(s_q, qk, s_kv, rate, half_dim, gpu, elem, heads)
             + matmul_time(s_q, s_kv, v, rate, half_dim, gpu, elem, heads))
    passes = 4 * elem + ((2 * elem + 1) if model.dropout else 0)
    return gemms + heads * s_q * s_kv * passes / gpu.hbm_bw


def elementwise_bytes(model: ModelSpec, tokens: int, tp: int, sp: bool, elem: int) -> float:
    """Bytes one block's forward reads and writes outside its matmuls, per rank, for
    ``tokens`` tokens of the microbatch on this rank. Each pass reads its inputs and
    writes its output: two norms (read h, write h), two residual adds (read 2h, write
    h), RoPE on q and k, the MLP activation (SwiGLU: read 2f, write f; GELU: read f,
    write f) and, when trained with dropout, two dropouts (read h, write h and a 1-byte
    mask). Norms, adds and dropout run on the rank's sequence shard under sequence
    parallelism and on the whole sequence, replicated, under plain TP; the activation
    and RoPE on the rank's heads and ffn columns."""
    h, f = model.d_model, model.ffn_hidden
    kv = model.kv_heads_per_rank(tp) * model.head_dim
    replicated = 2 * (2 * h) + 2 * (3 * h) + (2 * (2 * h) + 2 * h / elem if model.dropout else 0)
    sharded = 2 * (model.q_dim // tp + kv) + (3 if model.gated_mlp else 2) * f // tp
    if model.mla is not None:  # RoPE on the rotary parts only, and the latents' norms
        sharded += rope_and_norm_elems(model, tp)
    return tokens * elem * (replicated / (tp if sp else 1) + sharded)
