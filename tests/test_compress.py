"""Gradient compression: exactness where the arithmetic allows it, the error-feedback
invariant, lossless settings equal to no compression, exact resume, and (slow) convergence.

Slow convergence check (about 20 min on a quiet 2-core machine):
    PYTHONPATH=src python -m pytest -q -m slow tests/test_compress.py -s
"""

from __future__ import annotations

import dataclasses
import math
import statistics

import pytest
import torch
import torch.distributed as dist

from distributed import run_world
from paratrain.comm import compress as Z
from paratrain.comm.reducer import GradReducer
from paratrain.comm.int8 import INT8_BLOCK
from paratrain.comm.powersgd import PowerSGD
from paratrain.train.config import ConfigError
from helpers import assert_same_run, rel_error, tail, tiny_config, train_runs

# A bucket as DDP builds them: a matrix, a vector, a 3-d tensor (viewed as 6 x 20), and a
# tall matrix (PowerSGD compresses its transpose, and writes it back in its own layout).
VIEWS = [(0, torch.Size([8, 24])), (192, torch.Size([24])), (216, torch.Size([6, 4, 5])),
         (336, torch.Size([24, 8]))]
NUMEL = 336 + 192


def _gather(t: torch.Tensor) -> torch.Tensor:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return torch.stack(out)


def _average(compressor: Z.Compressor, grad: torch.Tensor) -> torch.Tensor:
    bucket = grad.clone()
    compressor.reduce(bucket, dist.group.WORLD).wait()
    return bucket


def _grads(step: int, scale: float = 1.0) -> torch.Tensor:
    torch.manual_seed(100 * step + dist.get_rank())
    return torch.randn(NUMEL) * scale


def _restore_into_other_tensors(group) -> tuple:
    """State saved for a bucket is restored into a bucket of the same tensors only: one of
    other layers with as many entries (another pipeline split, e.g. virtual stages 1 -> 2,
    or another ZeRO stage) starts fresh. Returns (why same, why other, residual kept)."""
    spec = Z.CompressSpec("topk", fraction=0.5, place="here")
    names = [["layers.1.w", "layers.1.b", "layers.1.c", "layers.1.d"]]
    donor = GradReducer(spec, [(VIEWS, NUMEL)], names=names)
    _average(donor[0], _grads(0))
    same = GradReducer(spec, [(VIEWS, NUMEL)], names=names)
    other = GradReducer(spec, [(VIEWS, NUMEL)], names=[[n.replace("1", "2") for n in names[0]]])
    why_same, why_other = (c.load_state(donor.local_state(), group) for c in (same, other))
    return why_same, why_other is not None, other[0].residual.abs().max().item()


def compressor_checks() -> dict[str, float]:
    """Every check on compressors themselves, in one world; returns the measured errors."""
    p, group, out = dist.get_world_size(), dist.group.WORLD, {}
    # fp16 / bf16: exact when values, halves and sums are representable (k / 64, |k| <= 64).
    torch.manual_seed(dist.get_rank())
    grid = torch.randint(-64, 65, (NUMEL,)).float() / 64
    exact = _gather(grid).double().mean(0).float()
    for dtype in ("fp16", "bf16"):
        got = _average(Z.make_compressor(Z.parse(dtype), VIEWS, NUMEL), grid)
        out[f"{dtype}_exact"] = float(torch.equal(got, exact))
    # Lossless settings equal the plain average: top-k of everything, PowerSGD at full rank.
    plain = _gather(_grads(0)).mean(0)
    out["topk1_error"] = rel_error(_average(Z.make_compressor(Z.parse("topk:1.0"), VIEWS, NUMEL), _grads(0)), plain)
    full = PowerSGD(NUMEL, VIEWS, rank=8, min_compression=0)
    out["powersgd_full_error"] = rel_error(_average(full, _grads(0)), plain)
    out["powersgd_full_residual"] = full.residual.norm().item()
    # Error feedback: nothing is lost, only delayed, over several steps; replicas agree.
    for text in ("int8", "topk:0.1", "powersgd:2"):
        c = Z.make_compressor(Z.parse(text), VIEWS, NUMEL)
        fed, delivered = torch.zeros(NUMEL), torch.zeros(NUMEL)
        for step in range(4):
            g = _grads(step)
            avg = _average(c, g)
            out[f"{text}_replicas_differ"] = (_gather(avg) - avg).abs().max().item()
            fed += _gather(g).sum(0)
            delivered += p * avg
        left = _gather(c.residual).sum(0)
        out[f"{text}_invariant"] = rel_error(delivered + left, fed)
        out[f"{text}_left"] = rel_error(delivered, fed)  # > 0: something is really delayed
    # int8 is accurate (scale per chunk) and cannot overflow: large same-sign values.
    big = torch.full((NUMEL,), 120.0) + torch.rand(NUMEL)
    got = _average(Z.make_compressor(Z.parse("int8:noef"), VIEWS, NUMEL), big)
    out["int8_big_error"] = rel_error(got, _gather(big).mean(0))
    out["int8_error"] = rel_error(_average(Z.make_compressor(Z.parse("int8:noef"), VIEWS, NUMEL), _grads(0)), plain)
    # A bf16 bucket is averaged in an fp32 working copy and written back in bf16.
    half = _grads(0).bfloat16()
    want = _gather(half.float()).mean(0)
    for text in ("topk:1.0", "powersgd:8"):
        got = _average(Z.make_compressor(Z.parse(text), VIEWS, NUMEL), half)
        out[f"{text}_bf16_error"] = rel_error(got.float(), want) if got.dtype == torch.bfloat16 else 1.0
    # A block of denormal values (127 / max overflows fp32) and a block of zeros stay
    # finite, and lose nothing: sent plus residual is the gradient.
    tiny = _grads(0)
    tiny[:NUMEL // 4], tiny[NUMEL // 4:NUMEL // 2] = 1e-39, 0.0
    c = Z.make_compressor(Z.parse("int8"), VIEWS, NUMEL)
    avg = _average(c, tiny)
    out["int8_tiny_finite"] = bool(avg.isfinite().all() and c.residual.isfinite().all())
    out["int8_tiny_invariant"] = rel_error(p * avg + _gather(c.residual).sum(0), _gather(tiny).sum(0))
    # A scale per block of 256: blocks 100x apart in size (as a layer next to the embedding)
    # both keep their precision; one scale for a rank's whole chunk rounds the small to 0.
    n = 8 * INT8_BLOCK
    torch.manual_seed(5 + dist.get_rank())
    scales = torch.tensor([100.0, 0.01]).repeat(n // (2 * INT8_BLOCK)).repeat_interleave(INT8_BLOCK)
    g = torch.randn(n) * scales
    got = _average(Z.make_compressor(Z.parse("int8:noef"), [(0, torch.Size([n]))], n), g)
    small = scales == 0.01
    out["int8_small_block_error"] = rel_error(got[small], _gather(g).mean(0)[small])
    # A step skipped as non-finite leaves no trace when undoable: the state it started
    # from comes back, and later averages equal a twin's that never saw the step.
    for text in ("int8", "topk:0.25", "powersgd:1"):
        spec = dataclasses.replace(Z.parse(text), undoable=True)
        c, twin = (Z.make_compressor(spec, VIEWS, NUMEL) for _ in range(2))
        for step in range(2):
            _average(c, _grads(step)), _average(twin, _grads(step))
        bad = _grads(7, scale=1000.0)
        bad[3] = float("nan") if dist.get_rank() == 0 else bad[3]
        _average(c, bad)
        c.undo()
        later = [(_average(c, _grads(s)), _average(twin, _grads(s))) for s in (2, 3)]
        out[f"{text}_undo_error"] = max((a - b).abs().max().item() for a, b in later)
        out[f"{text}_undo_counts"] = (c.reductions, twin.reductions)
        # Not undoable (no copy kept): undo still clears the NaN the step left in the
        # residual and in PowerSGD's Q, or every later step would be non-finite too.
        plain = Z.make_compressor(Z.parse(text), VIEWS, NUMEL)
        _average(plain, bad)
        plain.undo()
        out[f"{text}_cleared"] = all(bool(t.isfinite().all()) for t in plain._state_tensors())
    # Saved state is restored on every rank or on none: here rank 3 finds none of its own.
    spec = Z.CompressSpec("topk", fraction=0.5, place="here")
    donor, fresh = GradReducer(spec, [(VIEWS, NUMEL)]), GradReducer(spec, [(VIEWS, NUMEL)])
    _average(donor[0], _grads(0))
    why = fresh.load_state({} if dist.get_rank() == 3 else donor.local_state(), group)
    out["partial_restore"] = (why is not None, fresh[0].reductions, fresh[0].residual.abs().max().item())
    out["other_tensors_restore"] = _restore_into_other_tensors(group)
    # compress_start: the first reductions are the plain average; then compression starts.
    late = Z.make_compressor(Z.CompressSpec("topk", fraction=0.1, start=2), VIEWS, NUMEL)
    out["start_errors"] = [rel_error(_average(late, _grads(s)), _gather(_grads(s)).mean(0)) for s in range(3)]
    # Each method's own work, timed by rank 0 alone (benchmarks/two_nodes.py prints it).
    from paratrain.bench.compress import arithmetic
    out["work_s"] = arithmetic(["none", "powersgd:2"], torch.nn.Sequential(torch.nn.Linear(24, 8), torch.nn.Linear(8, 24)))
    # Bytes: a quarter of the fp32 all-reduce for int8 (plus scales), half for fp16.
    for text in ("none", "fp16", "int8", "topk:0.1", "powersgd:2"):
        c = Z.make_compressor(Z.parse(text), VIEWS, NUMEL)
        _average(c, _grads(0))
        out[f"{text}_ratio"] = c.dense_bytes / c.sent_bytes
    return out


def test_topk_sparsity_warms_up_after_the_uncompressed_start_as_in_dgc():
    def densities(fraction: float, start: int, reductions: int) -> list[float]:
        c = Z.make_compressor(Z.CompressSpec("topk", fraction=fraction, start=start), VIEWS, NUMEL)
        out = []
        for c.reductions in range(start + 1, reductions + 1):  # the compressed reductions
            out.append(c.density())
        return out

    # Stages as long as the start: 25%, 6.25%, 1.5625%, then the target.
    assert densities(0.01, 2, 9) == [0.25, 0.25, 0.0625, 0.0625, 0.015625, 0.015625, 0.01]
    assert densities(0.1, 1, 4) == [0.25, 0.1, 0.1]  # a target above a stage ends it early
    assert densities(0.5, 3, 4) == [0.5]
    assert densities(0.01, 0, 2) == [0.01, 0.01]  # compressed from the start: no warm-up


def test_compressors_exact_lossless_and_error_feedback():
    results = run_world(compressor_checks, 4)
    r = results[0]
    assert r["fp16_exact"] == 1.0 and r["bf16_exact"] == 1.0
    assert r["topk1_error"] <= 1e-6
    assert r["powersgd_full_error"] <= 1e-5 and r["powersgd_full_residual"] <= 1e-4
    for text in ("int8", "topk:0.1", "powersgd:2"):
        assert r[f"{text}_invariant"] <= 1e-6, (text, r[f"{text}_invariant"])
        assert r[f"{text}_left"] > 1e-4, text
        assert all(x[f"{text}_replicas_differ"] == 0 for x in results), text
    assert r["int8_big_error"] <= 5e-3 and r["int8_error"] <= 2e-2, r
    assert r["int8_small_block_error"] <= 2e-2, r["int8_small_block_error"]
    assert set(r["work_s"]) == {"none", "powersgd:2"} and all(v > 0 for v in r["work_s"].values())
    assert all(x["work_s"] == {} for x in results[1:])
    assert r["topk:1.0_bf16_error"] <= 1e-2 and r["powersgd:8_bf16_error"] <= 1e-2, r
    assert all(x["int8_tiny_finite"] for x in results) and r["int8_tiny_invariant"] <= 1e-6, r
    assert max(r["start_errors"][:2]) <= 1e-6 and r["start_errors"][2] > 0.1, r["start_errors"]
    for text in ("int8", "topk:0.25", "powersgd:1"):
        assert all(x[f"{text}_undo_error"] == 0.0 for x in results), (text, r[f"{text}_undo_error"])
        assert r[f"{text}_undo_counts"] == (4, 4), text
        assert all(x[f"{text}_cleared"] for x in results), text
    assert all(x["partial_restore"] == (True, 0, 0.0) for x in results), [x["partial_restore"] for x in results]
    assert all(x["other_tensors_restore"] == (None, True, 0.0) for x in results), r["other_tensors_restore"]
    assert r["none_ratio"] == 1.0 and r["fp16_ratio"] == 2.0
    assert 3.5 < r["int8_ratio"] <= 4.0 and r["topk:0.1_ratio"] > 1.5 and r["powersgd:2_ratio"] > 1.5


def test_order_places_tp_inside_or_across_nodes():
    """The two placements of benchmarks/two_nodes.py: nodes hold ranks {0, 1} and {2, 3}."""
    from paratrain.layout import Layout

    inside, across = Layout(dp=2, tp=2), Layout(dp=2, tp=2, order="dp-tp-cp-pp")
    assert inside.groups("tp") == [[0, 1], [2, 3]] and inside.groups("dp") == [[0, 2], [1, 3]]
    assert across.groups("tp") == [[0, 2], [1, 3]] and across.groups("dp") == [[0, 1], [2, 3]]


def test_compress_setting_is_checked_before_launch(tmp_path):
    assert Z.parse("topk:0.01") == Z.CompressSpec("topk", fraction=0.01)
    assert Z.parse("powersgd:4:noef").text == "powersgd:4:noef"
    # compress_start: by default the larger of the warm-up and 10% of the steps (torch's advice)
    assert tiny_config(str(tmp_path), steps=100, warmup_steps=5, compress="int8").compress_spec.start == 10
    assert tiny_config(str(tmp_path), steps=100, warmup_steps=15, compress="int8").compress_spec.start == 15
    assert tiny_config(str(tmp_path), compress="int8", compress_start=0).compress_spec.start == 0
    with pytest.raises(ConfigError, match="compress_start"):
        tiny_config(str(tmp_path), compress="int8", compress_start=-2)
    for bad, match in [("gzip", "compress='gzip'"), ("topk", "compress="), ("topk:0", r"\(0, 1\]"),
                       ("powersgd:x", "positive integer"), ("fp16:noef", "residual"),
                       ("int8:3", "compress=")]:
        with pytest.raises(ConfigError, match=match):
            tiny_config(str(tmp_path), nproc=2, compress=bad)
    with pytest.raises(ConfigError, match="ZeRO-2/3"):
        tiny_config(str(tmp_path), nproc=2, compress="int8", zero=2, tie_embeddings=False)
    with pytest.raises(ConfigError, match="int8' with tp=2: .* drift apart"):  # see compress.check
        tiny_config(str(tmp_path), nproc=4, dp=2, tp=2, compress="int8")
    tiny_config(str(tmp_path), nproc=4, dp=2, tp=2, compress="powersgd:2")  # per tensor: fine


def test_lossless_compression_equals_none_with_accumulation_zero1_and_resume(tmp_path):
    """dp2: top-k 1.0 and PowerSGD at a rank too large to pay (nothing compressed) equal no
    compression, under no_sync accumulation too; ZeRO-1 composes; compressed runs resume
    exactly from a checkpoint (residuals and PowerSGD's Q restored)."""
    t = str(tmp_path)
    acc, z1 = dict(micro_batch=2), dict(zero=1, tie_embeddings=False)  # 8 / 2 ranks / 2: 2 microbatches
    saving = dict(lr=1e-3, steps=6, save_every=3)
    configs = {
        "none": tiny_config(t + "/a", nproc=2), "none-acc": tiny_config(t + "/b", nproc=2, **acc),
        "topk-acc": tiny_config(t + "/c", nproc=2, compress="topk:1.0", **acc),
        "powersgd-full": tiny_config(t + "/d", nproc=2, compress="powersgd:64"),
        "fp16-zero1": tiny_config(t + "/e", nproc=2, compress="fp16", **z1),
        "fp16": tiny_config(t + "/f", nproc=2, compress="fp16"),
        "powersgd": tiny_config(t + "/g", nproc=2, compress="powersgd:2", **saving),
        # compress_start=2 with a checkpoint at 3: a residual to restore, under ZeRO-1
        "int8-zero1": tiny_config(t + "/h", nproc=2, compress="int8", compress_start=2, **saving, **z1),
        "topk": tiny_config(t + "/i", nproc=2, compress="topk:0.1", compress_start=0, **saving),
    }
    runs = run_world(train_runs, 2, configs)[0]
    assert_same_run(runs["topk-acc"], runs["none-acc"])
    assert_same_run(runs["powersgd-full"], runs["none"])
    assert_same_run(runs["fp16-zero1"], runs["fp16"])
    resume = dict(lr=1e-3, steps=6)
    resumed = run_world(train_runs, 2, {
        "powersgd": tiny_config(t + "/g2", nproc=2, compress="powersgd:2",
                                resume=t + "/g/checkpoints/step-3", **resume),
        "int8-zero1": tiny_config(t + "/h2", nproc=2, compress="int8", compress_start=2,
                                  resume=t + "/h/checkpoints/step-3", **resume, **z1),
        # a later start (e.g. the default 10% of more steps): compression had started, stays on
        "topk": tiny_config(t + "/i2", nproc=2, compress="topk:0.1", compress_start=5,
                            resume=t + "/i/checkpoints/step-3", **resume),
        # other buckets: the saved state does not fit, so it starts fresh, and the run differs
        "other buckets": tiny_config(t + "/g3", nproc=2, compress="powersgd:2",
                                     resume=t + "/g/checkpoints/step-3", bucket_mb=1.0, **resume)})[0]
    assert_same_run(tail(resumed["powersgd"]), tail(runs["powersgd"], 3))
    assert_same_run(tail(resumed["int8-zero1"]), tail(runs["int8-zero1"], 3))
    assert_same_run(tail(resumed["topk"]), tail(runs["topk"], 3))
    fresh, kept = resumed["other buckets"]["params"], runs["powersgd"]["params"]
    assert max(rel_error(fresh[k], kept[k]) for k in kept) > 1e-4


def test_compressed_runs_resume_under_another_axis_order_and_another_layout(tmp_path):
    """Compression state belongs to a rank's place in the layout. Resumed under another
    axis order, each rank gets the state of the rank that held the same shards and the run
    continues exactly; under another layout every rank starts fresh together, rather than
    some ranks sending compressed messages to ranks that expect plain ones."""
    t = str(tmp_path)
    topk = dict(compress="topk:0.1", compress_start=0, lr=1e-3, dp=2, tp=2)
    fp16 = dict(compress="fp16", compress_start=2, lr=1e-3)
    runs = run_world(train_runs, 4, {
        "topk": tiny_config(t + "/a", nproc=4, steps=6, save_every=3, **topk),
        "fp16": tiny_config(t + "/b", nproc=4, steps=3, save_every=3, dp=2, pp=2, **fp16)})[0]
    resumed = run_world(train_runs, 4, {
        "topk": tiny_config(t + "/a2", nproc=4, steps=6, order="dp-tp-cp-pp",
                            resume=t + "/a/checkpoints/step-3", **topk),
        "fp16": tiny_config(t + "/b2", nproc=4, steps=5, dp=4,
                            resume=t + "/b/checkpoints/step-3", **fp16)})[0]
    assert_same_run(tail(resumed["topk"]), tail(runs["topk"], 3))
    assert len(resumed["fp16"]["losses"]) == 2 and all(map(math.isfinite, resumed["fp16"]["losses"]))


CONVERGENCE = ["none", "fp16", "bf16", "int8", "powersgd:4", "topk:0.01", "topk:0.01:noef",
               "topk:0.01:update", "topk:0.01:update:noef"]
PAIR = ("topk:0.01:update", "topk:0.01:update:noef")
PAIR_SEEDS = (1, 2)
"""More seeds for the top-k pair that meets the issue's bar: with and without error
feedback on the same data order."""


def final_val_losses(configs) -> list[float]:
    from paratrain.mesh import Mesh
    from paratrain.train.loop import train

    return [train(cfg, Mesh.build(cfg.layout)).val_losses[-1][1] for cfg in configs]


@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_compressed_training_converges_like_uncompressed(tmp_path):
    """Small model, bundled corpus, dp2, 300 steps: the final validation loss of each method
    against no compression, and top-k 1% without error feedback against with it on three
    seeds. Prints the numbers (run with -s to see them)."""
    from paratrain.train.config import load

    runs = [(0, m) for m in CONVERGENCE] + [(s, m) for s in PAIR_SEEDS for m in (*PAIR, "none")]
    configs = [load(None, dict(preset="small", seq_len=64, global_batch=8, steps=300, eval_every=0,
                               eval_batches=16, progress=False, nproc=2, compress=method, seed=seed,
                               run_dir=str(tmp_path / f"{method.replace(':', '_')}-{seed}"))).validate()
               for seed, method in runs]
    got = dict(zip(runs, run_world(final_val_losses, 2, configs, timeout_s=7200)[0]))
    losses = {m: got[0, m] for m in CONVERGENCE}
    base = losses["none"]
    print("\nfinal validation loss after 300 steps (dp2, small):")
    for method, loss in losses.items():
        print(f"  {method:<22} {loss:.4f}  {loss / base - 1:+.2%}")
    for seed in PAIR_SEEDS:
        print(f"  seed {seed}: " + ", ".join(f"{m} {got[seed, m]:.4f} ({got[seed, m] / got[seed, 'none'] - 1:+.2%})"
                                           for m in PAIR))
    # Error feedback, paired by seed: how much worse top-k 1% is without it.
    worse = [got[s, PAIR[1]] / got[s, PAIR[0]] - 1 for s in (0, *PAIR_SEEDS)]
    mean, sem = statistics.mean(worse), statistics.stdev(worse) / len(worse) ** 0.5
    print(f"  {PAIR[1]} worse than {PAIR[0]}, seeds 0, 1, 2: "
          + ", ".join(f"{w:+.2%}" for w in worse) + f" (mean {mean:+.2%} ± {sem:.2%})")
    # The bars: fp16, bf16, int8 within 3%; PowerSGD rank 4 and top-k 1% with error
    # feedback within 8% (top-k averaging AdamW's updates, parallel/local_update.py: top-k
    # of the gradients misses it, +11.0%, docs/compression.md). Measured 2026-11-24: fp16
    # -0.7%, bf16 -1.0%, int8 -1.1%, PowerSGD +5.2%, top-k of updates +1.6%, of gradients
    # +11.0% (+12.2% without error feedback).
    for method, bound in (("fp16", 1.03), ("bf16", 1.03), ("int8", 1.03), ("powersgd:4", 1.08),
                          ("topk:0.01:update", 1.08),
                          ("topk:0.01:noef", 1.30), ("topk:0.01", 1.30)):  # top-k of gradients: broken is far worse
        assert losses[method] <= base * bound, (method, losses[method] / base - 1)
    for seed in PAIR_SEEDS:  # the bar on the other seeds too
        assert got[seed, PAIR[0]] <= got[seed, "none"] * 1.08, (seed, got[seed, PAIR[0]] / got[seed, "none"] - 1)
    # "Measurably worse" without error feedback: worse on every seed, by a mean more than
    # twice its standard error.
    assert min(worse) > 0 and mean > 2 * sem, worse
