"""The planner's compute curve (``plan/compute.py``) against one GPU's measured rates: bf16
GEMMs of the per-rank shapes tensor parallelism makes, and causal SDPA attention forward
and backward at several sequence lengths.

    python benchmarks/gpu_compute.py [--gpu h100-80g] [--out FILE.json] [--reps 20]

Needs a CUDA GPU. Each shape is timed as ``--reps`` launches captured in a CUDA graph
(so that the host's launch gaps do not count), on random normal data (zeros run faster). The GEMMs are those of Llama-3
8B/70B-shaped blocks at tp 1..8 (QKV, output, MLP in and out), for microbatch token
counts 512..16384, plus their backward shapes (input gradient M·N·K, weight gradient
K·M·N), as ``plan.cost._gemm_times`` charges them. The planner's time of each is
``plan.compute.matmul_time`` on the ``--gpu`` preset; attention's is
``plan.compute.attention_time`` (forward) and twice that (backward), as ``plan.cost``
charges it. Prints a table per kind, the median |error| and the ``half_dim`` and
attention efficiency that would fit the measurements best (reported, not applied), and as
the last line a JSON object: "paratrain" = the planner's total predicted seconds over all
shapes, "peer" = the measured total, "ratio" their quotient.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from paratrain.plan.compute import attention_time, matmul_time
from paratrain.plan.hardware import gpu_preset

from common import at_least

TOKENS = (512, 1024, 2048, 4096, 8192, 16384)
# (hidden, ffn, kv width) of Llama 3 8B and 70B blocks; the heads are 128 wide.
BLOCKS = ((4096, 14336, 1024), (8192, 28672, 1024))
SEQS = (512, 1024, 2048, 4096, 8192, 16384)


def gemm_shapes() -> list[tuple[int, int, int]]:
    """(M, K, N) of every forward and backward GEMM of the blocks at tp 1, 2, 4, 8."""
    shapes = set()
    for h, f, kv in BLOCKS:
        for tp in (1, 2, 4, 8):
            for m in TOKENS:
                for k, n in ((h, (h + 2 * kv) // tp), (h // tp, h), (h, 2 * f // tp),
                             (f // tp, h)):
                    shapes |= {(m, k, n), (m, n, k), (k, m, n)}
    return sorted(shapes)


def time_events(fn, reps: int) -> float:
    """Seconds of one ``fn()``: ``reps`` back-to-back calls between two CUDA events (for
    kernels of milliseconds, whose launch gaps are negligible)."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def time_cuda(fn, reps: int) -> float:
    """Seconds of one ``fn()`` on the GPU: ``reps`` calls captured in a CUDA graph and
    replayed, timed by CUDA events (median of 5 replays), so that the host's launch gaps,
    which dominate kernels of a few microseconds, are not counted."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / reps)
    return statistics.median(times)


def measure_gemms(reps: int) -> list[dict]:
    rows = []
    for m, k, n in gemm_shapes():
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        rows.append({"m": m, "k": k, "n": n, "s": time_cuda(lambda: a @ b, reps)})
    return rows


def measure_attention(reps: int, heads: int = 32, head_dim: int = 128,
                      tokens: int = 16384) -> list[dict]:
    """Causal SDPA forward and backward, ``tokens`` per launch split into sequences."""
    rows = []
    for s in SEQS:
        b = max(1, tokens // s)
        q, k, v = (torch.randn(b, heads, s, head_dim, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        grad = torch.randn_like(out)
        fwd = time_events(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), reps)

        def fwd_bwd():
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            torch.autograd.grad(o, (q, k, v), grad)

        rows.append({"b": b, "heads": heads, "head_dim": head_dim, "s": s, "fwd_s": fwd,
                     "bwd_s": max(0.0, time_events(fwd_bwd, reps) - fwd)})
    return rows


def predict(gpu, gemms: list[dict], attention: list[dict], half_dim: float | None = None,
            att_eff: float | None = None) -> tuple[list[float], list[tuple[float, float]]]:
    """The planner's seconds for every measured GEMM, and (forward, backward) for every
    attention row; ``half_dim``/``att_eff`` replace the preset's (for the fit)."""
    half = gpu.half_dim if half_dim is None else half_dim
    rate = gpu.peak_flops * gpu.efficiency
    g = [matmul_time(r["m"], r["k"], r["n"], rate, half, gpu, 2) for r in gemms]
    att_rate = gpu.peak_flops * (gpu.attention_efficiency if att_eff is None else att_eff)
    a = []
    for r in attention:
        # Megatron's count of QK^T and softmax·V without the causal skip (plan/flops.py).
        flops = 4 * r["b"] * r["heads"] * r["s"] ** 2 * r["head_dim"]
        fwd = attention_time(flops, r["s"], att_rate, half)
        a.append((fwd, 2 * fwd))
    return g, a


def errors(pred: list[float], meas: list[float]) -> list[float]:
    return [(p - m) / m for p, m in zip(pred, meas)]


def best_fit(gpu, gemms, attention) -> tuple[float, float]:
    """The half_dim and attention efficiency with the least median |error| (a report of
    what the measurements say, never applied by this script)."""
    meas = [r["s"] for r in gemms]
    half = min(range(0, 513, 8), key=lambda h: statistics.median(
        abs(e) for e in errors(predict(gpu, gemms, [], h)[0], meas)))
    total = [r["fwd_s"] + r["bwd_s"] for r in attention]
    eff = min((e / 1000 for e in range(100, 1000, 5)), key=lambda e: statistics.median(
        abs(x) for x in errors([f + b for f, b in predict(gpu, [], attention, half, e)[1]],
                               total)))
    return half, eff


def report(gpu, gemms, attention) -> dict:
    g_pred, a_pred = predict(gpu, gemms, attention)
    g_err = errors(g_pred, [r["s"] for r in gemms])
    print(f"{gpu.name}: {torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    print("bf16 GEMMs (M x K x N): measured TFLOP/s, the planner's, error of its time")
    for r, p, e in zip(gemms, g_pred, g_err):
        flops = 2 * r["m"] * r["k"] * r["n"]
        print(f"  {r['m']:>6} x {r['k']:>6} x {r['n']:>6}  {flops / r['s'] / 1e12:>6.0f}  "
              f"{flops / p / 1e12:>6.0f}  {e:>+6.0%}")
    print("\ncausal SDPA (batch x heads x seq x 128): forward, backward ms measured; "
          "errors of the planner's")
    a_err = []
    for r, (pf, pb) in zip(attention, a_pred):
        ef, eb = (pf - r["fwd_s"]) / r["fwd_s"], (pb - r["bwd_s"]) / r["bwd_s"]
        a_err.append((pf + pb - r["fwd_s"] - r["bwd_s"]) / (r["fwd_s"] + r["bwd_s"]))
        print(f"  {r['b']:>3} x {r['heads']} x {r['s']:>6}  {r['fwd_s'] * 1e3:>7.2f}  "
              f"{r['bwd_s'] * 1e3:>7.2f}  {ef:>+6.0%}  {eb:>+6.0%}")
    half, eff = best_fit(gpu, gemms, attention)
    g_med = statistics.median(abs(e) for e in g_err)
    a_med = statistics.median(abs(e) for e in a_err)
    print(f"\nGEMMs: median |error| {g_med:.1%} over {len(gemms)} shapes (half_dim "
          f"{gpu.half_dim:.0f}); the best-fitting half_dim would be {half}")
    print(f"attention: median |error| {a_med:.1%} (efficiency {gpu.attention_efficiency}); "
          f"the best-fitting efficiency would be {eff:.3f}")
    return {"gemm_median_error": g_med, "attention_median_error": a_med,
            "fit_half_dim": half, "fit_attention_efficiency": eff,
            "predicted_s": sum(g_pred) + sum(f + b for f, b in a_pred),
            "measured_s": sum(r["s"] for r in gemms) + sum(r["fwd_s"] + r["bwd_s"]
                                                           for r in attention)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", default="h100-80g", help="the planner's preset to check")
    parser.add_argument("--out", help="write the measurements here (JSON)")
    parser.add_argument("--reps", type=at_least(1), default=20, help="timed launches per shape")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_compute: needs a CUDA GPU (this machine has none)")
    gpu = gpu_preset(args.gpu)
    gemms, attention = measure_gemms(args.reps), measure_attention(args.reps)
    if args.out:
        Path(args.out).write_text(json.dumps({
            "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "preset": gpu.name, "reps": args.reps, "gemms": gemms, "attention": attention},
            indent=1))
    summary = report(gpu, gemms, attention)
    print(json.dumps({"benchmark": "gpu_compute", "paratrain": round(summary["predicted_s"], 6),
                      "peer": round(summary["measured_s"], 6),
                      "ratio": round(summary["predicted_s"] / summary["measured_s"], 4),
                      "metric": "paratrain: the planner's seconds over all shapes; peer: "
                                "measured on this GPU", **{k: round(v, 4) for k, v in
                                                           summary.items()}}))


if __name__ == "__main__":
    main()
