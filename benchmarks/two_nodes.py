"""Gradient compression and tensor-parallel placement, measured on a two-node cluster made
of two network namespaces whose link is shaped with tc (scripts/cluster.py). Needs root.

    python benchmarks/two_nodes.py [--bandwidth 1gbit] [--latency 0.5ms]    (as root)
        [--steps 20] [--repeats 2] [--model small] [--global-batch 4] [--seq-len 64] [--save FILE.json]

dp4 (2 processes per node) trains the same model on the same data with each paratrain
``--compress`` method and with torch DDP and its communication hooks (fp16_compress_hook,
bf16_compress_hook, powerSGD_hook at the same rank; DDP configured with
gradient_as_bucket_view=True, no buffer sync before each forward and paratrain's bucket size; PowerSGD
from the second step, warm start and error feedback on, batch_tensors_with_same_shape=True).
Every run uses the same bucket size, by default one bucket for the whole model: with
several, torch's powerSGD_hook aborts on gloo ("Received data size doesn't match expected
size. Is there a distributed collective mismatch", torch 2.13, CPU), as its chained
collectives are issued from gloo's worker threads in different orders on different ranks.
Then dp2 x tp2 runs with tp inside a node (order tp-cp-pp-dp) and with tp across the link
(order dp-tp-cp-pp), next to the planner's predictions for both on this cluster.

Each paratrain run sits next to its torch counterpart and the list runs ``--repeats`` times
(every other time backwards), so that load drifting during the benchmark hits both sides
of a ratio alike. Two more runs measure the link's share of the uncompressed step: the same
training with no gradient communication at all ("compute only": the floor no compression
can beat, so none / compute-only bounds any method's speed-up, Amdahl's law) and the fp32
gradient all-reduce with no compute ("all-reduce alone").

Step time is the median over the steps after the first three, of all repeats; "work" is a
method's own arithmetic per reduction, timed by rank 0 alone; "link bytes/step" is what
node 0's end of the veth pair sent per step (measured, every rank of node 0 included);
"sent bytes/step" is paratrain's own count for one rank (``comm_bytes``). The last line is
JSON: paratrain = the best paratrain method's step time, peer = torch's powerSGD_hook's,
ratio = paratrain / peer; also powersgd_vs_torch (paratrain's PowerSGD / torch's hook),
comm_share (what communication adds to the uncompressed step) and max_speedup (the Amdahl
bound).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from common import at_least

ROOT = Path(__file__).resolve().parents[1]
UNTIMED = 3  # the first steps of every run: start-up, not step time
METHODS = ["none", "fp16", "bf16", "int8", "topk:0.01", "topk:0.01:update", "powersgd:{r}"]
PEERS = {"none": "ddp", "fp16": "fp16_compress_hook", "bf16": "bf16_compress_hook",
         "powersgd:{r}": "powerSGD_hook"}
"""torch's counterpart of a paratrain method: DDP and its communication hooks."""
COMPUTE_ONLY = "compute only"
PLACEMENTS = {"tp2 in node x dp2 across": "tp-cp-pp-dp", "tp2 across x dp2 in node": "dp-tp-cp-pp"}


# ---- on every rank, inside the cluster --------------------------------------------------------
def config(args, run_dir: str, **overrides):
    from paratrain.train.config import load

    base = dict(preset=args.model, seq_len=args.seq_len, global_batch=args.global_batch,
                steps=args.steps, eval_every=0, eval_batches=2, progress=False, run_dir=run_dir,
                warmup_steps=min(20, args.steps // 3), nproc=4, bucket_mb=args.bucket_mb,
                compress_start=2)  # as the hook's start_powerSGD_iter=2: the same steps compressed
    return load(None, {**base, **overrides}).validate()


def placement_config(args, run_dir: str, order: str):
    """dp2 x tp2 with ranks placed by ``order``, on batches whose activations (what tp
    moves, every block) outweigh the gradients (what dp moves, once a step)."""
    return config(args, run_dir, dp=2, tp=2, order=order, global_batch=args.tp_global_batch,
                  seq_len=args.tp_seq_len, steps=args.tp_steps)


def link_tx() -> int:
    """Bytes this node's veth end has sent (the cluster tool names it in GLOO_SOCKET_IFNAME)."""
    dev = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    return int(Path(f"/sys/class/net/{dev}/statistics/tx_bytes").read_text())


def paratrain_run(cfg) -> dict:
    import torch.distributed as dist
    from paratrain.mesh import Mesh
    from paratrain.train.loop import train

    dist.barrier()
    before = link_tx()
    result = train(cfg, Mesh.build(cfg.layout))
    link = link_tx() - before
    if dist.get_rank() != 0:
        return {}
    records = [json.loads(line) for line in cfg.metrics_path.read_text().splitlines()]
    return {"times": [r["step_time_s"] for r in records[UNTIMED:]],
            "sent": records[-1].get("comm_bytes"), "link": link / cfg.train.steps,
            "loss": result.val_losses[-1][1]}


def torch_run(cfg, hook: str, rank_r: int) -> dict:
    """The same training as paratrain_run, with torch DDP and a communication hook; with
    hook="compute only", every rank trains its own replica with no gradient communication
    (the lower bound of any compressed step: the same compute, the same CPU contention)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook as psgd
    from common import fast_ddp
    from paratrain.models.gpt import GPT
    from paratrain.optim import build_adamw, lr_at, set_lr
    from paratrain.train import data as D

    torch.manual_seed(cfg.train.seed)
    model = GPT(cfg.model)
    ddp = model if hook == COMPUTE_ONLY else fast_ddp(model, bucket_cap_mb=cfg.parallel.bucket_mb)
    if hook == "powerSGD_hook":
        state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=rank_r,
                                   start_powerSGD_iter=2, use_error_feedback=True, warm_start=True,
                                   batch_tensors_with_same_shape=True)
        ddp.register_comm_hook(state, psgd.powerSGD_hook)
    elif hook not in ("ddp", COMPUTE_ONLY):
        try:
            ddp.register_comm_hook(None, getattr(default_hooks, hook))
        except TypeError as exc:  # bf16_compress_hook: torch allows it with NCCL/XCCL only
            return {"error": str(exc)}
    opt = build_adamw(list(model.parameters()), cfg.optim)
    train_tokens, val_tokens = D.split(D.load_corpus(cfg.data.corpus), cfg.data.val_fraction)
    samples = D.Samples(train_tokens, cfg.data.seq_len)
    rank, world = dist.get_rank(), dist.get_world_size()
    sampler = D.DistributedSampler(len(samples), cfg.train.global_batch, dp_rank=rank, dp_size=world,
                                   seed=cfg.train.seed, remainder=cfg.data.remainder)
    times = []
    dist.barrier()
    before = link_tx()
    for step in range(cfg.train.steps):
        t0 = time.perf_counter()
        tokens, targets = samples.batch(sampler.local_indices(step), torch.device("cpu"))
        global_tokens = D.valid_tokens(sampler.global_indices(step), cfg.data.seq_len)
        opt.zero_grad(set_to_none=False)
        loss = ddp(tokens, targets)
        (loss * world / global_tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        set_lr(opt, lr_at(step, cfg.train.steps, cfg.optim))
        opt.step()
        dist.all_reduce(loss.detach())  # as paratrain's loop sums the loss: a sync point
        times.append(time.perf_counter() - t0)
    link = link_tx() - before
    val = D.Samples(val_tokens, cfg.data.seq_len)
    total, count = torch.zeros(()), 0
    share = cfg.train.global_batch // world
    with torch.no_grad():
        for b in range(cfg.train.eval_batches):
            indices = D.eval_indices(len(val), cfg.train.global_batch, b)
            count += D.valid_tokens(indices, cfg.data.seq_len)
            x, y = val.batch(indices[rank * share:(rank + 1) * share], torch.device("cpu"))
            total += model(x, y)
    dist.all_reduce(total)
    return {"times": times[UNTIMED:], "sent": None, "link": link / cfg.train.steps,
            "loss": total.item() / count}


def allreduce_alone(numel: int, repeats: int) -> dict:
    """The uncompressed gradient all-reduce (fp32, one bucket, as the 'none' run sends it)
    with no compute around it: the link's share of a step."""
    import torch
    import torch.distributed as dist

    grad, times = torch.ones(numel), []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(grad)
        times.append(time.perf_counter() - t0)
    return {"times": times[1:]}


def runs(args) -> list[tuple[str, Callable[[str], dict]]]:
    """Every dp4 run, paratrain's next to torch's counterpart (interleaved, so that load
    drifting during the benchmark hits both sides of a ratio alike)."""
    out: list = [("compute only (no communication)", lambda tmp: torch_run(config(args, tmp), COMPUTE_ONLY, args.rank)),
                 ("all-reduce alone (no compute)", lambda tmp: allreduce_alone(model_numel(args), args.steps))]
    for method in METHODS:
        spec = method.format(r=args.rank)
        out.append((f"paratrain {spec}", lambda tmp, m=spec: paratrain_run(config(args, tmp, compress=m))))
        if method in PEERS:
            out.append((f"torch {PEERS[method]}", lambda tmp, h=PEERS[method]: torch_run(config(args, tmp), h, args.rank)))
    return out


def model_numel(args) -> int:
    from paratrain.models.gpt import GPT

    return sum(p.numel() for p in GPT(config(args, "unused").model).parameters())


def worker(args) -> None:
    import torch.distributed as dist
    from paratrain.launch import init_world, torchrun_world

    init_world(torchrun_world("gloo", 600))
    out, tmp = {}, tempfile.mkdtemp(prefix="two-nodes-")
    plan = runs(args)
    for repeat in range(args.repeats):  # odd repeats run the list backwards: torch before paratrain
        for i, (label, run) in enumerate(plan if repeat % 2 == 0 else plan[::-1]):
            got = run(f"{tmp}/{repeat}-{i}")
            if got and "times" in got:
                got["times"] = out.get(label, {}).get("times", []) + got["times"]
            out[label] = got
    for label, order in PLACEMENTS.items():
        out[label] = paratrain_run(placement_config(args, f"{tmp}/{order}", order))
    for r in out.values():
        if r and "times" in r:
            r["step_s"] = statistics.median(r.pop("times"))
    from paratrain.bench.compress import arithmetic
    from paratrain.models.gpt import GPT

    out["arithmetic"] = arithmetic([m.format(r=args.rank) for m in METHODS], GPT(config(args, "unused").model))
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


# ---- the launcher: cluster, planner, report -------------------------------------------------
def rate_bytes(text: str) -> float:
    """tc rate ('1gbit', '100mbit') in bytes/s."""
    for unit, factor in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if text.endswith(unit):
            return float(text[:-len(unit)]) * factor / 8
    raise ValueError(f"bandwidth {text!r}: use kbit, mbit or gbit")


def seconds(text: str) -> float:
    return float(text[:-2]) / 1e3 if text.endswith("ms") else float(text.rstrip("s"))


def predictions(args, delayed: bool) -> dict[str, float]:
    """The planner's step time for both placements: this machine's calibration inside a
    node, the shaped link (rate, and latency if the kernel applied it) across nodes."""
    from paratrain.layout import Layout
    from paratrain.plan.candidate import Candidate, Training
    from paratrain.plan.cost import step_time
    from paratrain.plan.hardware import Cluster, _link, load_calibration, local_cluster
    from paratrain.plan.models import from_gpt_config

    @dataclasses.dataclass(frozen=True)
    class Placed(Cluster):
        """A cluster whose ranks follow ``order`` (the planner's cost model assumes tp first)."""
        order: tuple = ("tp", "cp", "pp", "dp")

        def link(self, sizes, order, axes, p2p=False):
            return _link(self, tuple(sizes[a] for a in self.order), self.order, axes, p2p)

    local = local_cluster(4, load_calibration(args.calibration))
    # gloo's latency per ring step is the same over veth as over loopback, plus the link's
    # delay if applied; per-collective fits describe loopback only: the two links decide.
    alpha = local.gpu.nvlink_alpha + (seconds(args.latency) if delayed else 0.0)
    gpu = dataclasses.replace(local.gpu, collectives=(), network_bw=min(
        rate_bytes(args.bandwidth), local.gpu.nvlink_bw), network_alpha=alpha)
    cfg = placement_config(args, "unused", "tp-cp-pp-dp")
    model = from_gpt_config(cfg.model, cfg.model_preset)
    training = Training(cfg.train.global_batch, cfg.data.seq_len, "fp32")
    cand = Candidate(Layout(dp=2, tp=2), zero=0, micro_batch=cfg.micro_batch,
                     microbatches=cfg.accumulation, recompute="none")
    return {label: step_time(model, training, Placed(gpu, 4, gpus_per_node=2, usable_memory=1.0,
                                                     kind="local", order=tuple(order.split("-"))), cand).step
            for label, order in PLACEMENTS.items()}


def run_cluster(args, out: str) -> tuple[str, int]:
    forwarded = ("steps", "model", "rank", "global_batch", "seq_len", "tp_global_batch", "tp_seq_len",
                 "tp_steps", "bucket_mb", "repeats")
    cmd = [sys.executable, str(ROOT / "scripts" / "cluster.py"), "--bandwidth", args.bandwidth,
           "--latency", args.latency, "--measure-link", "--", str(Path(__file__).resolve()), "--worker",
           "--out", out, *(x for k in forwarded for x in ("--" + k.replace("_", "-"), str(getattr(args, k))))]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    return done.stdout + done.stderr, done.returncode


def comm_share(results: dict) -> dict[str, float]:
    """How much of the uncompressed step the link costs, measured two ways: the all-reduce
    alone against the step, and the step against the same training without communication
    (whose ratio bounds what any compression can gain: Amdahl's law)."""
    none = results["paratrain none"]["step_s"]
    alone = results["all-reduce alone (no compute)"]["step_s"]
    compute = results["compute only (no communication)"]["step_s"]
    return {"allreduce_s": alone, "allreduce_share": alone / none, "compute_only_s": compute,
            "comm_share": max(0.0, 1 - compute / none), "max_speedup": none / compute}


def report(args, results: dict, planned: dict, log: str, load: float) -> None:
    from common import DDP_SETTINGS

    print(*(line for line in log.splitlines() if line.startswith("cluster:")), sep="\n")
    print(f"\n{args.model} model, dp4 on 2 nodes x 2 processes, {args.global_batch} x {args.seq_len} "
          f"tokens per step, {args.steps} steps; load average {load:.1f} (the machine is shared: "
          f"times are noisy, compare within this run)")
    print(f"bucket size {args.bucket_mb:g} MiB for every run (torch's powerSGD_hook aborts on gloo with "
          "several buckets: 'collective mismatch')")
    print(f"torch peers: DDP({DDP_SETTINGS}, same bucket_cap_mb), "
          f"powerSGD_hook(rank {args.rank}, start_powerSGD_iter=2, error feedback, warm start, "
          "batch_tensors_with_same_shape=True); paratrain: compress_start=2 (the same two "
          "uncompressed steps)\n")
    none = results["paratrain none"]["step_s"]
    work = results.get("arithmetic", {})
    print(f"{'run':<32} {'step ms':>8} {'vs none':>8} {'work ms':>8} {'sent B/step':>12} {'link B/step':>12} {'val loss':>9}")
    print("(work: the method's own arithmetic for one reduction, on one core with no transfer; sent: one "
          "rank's gradient bytes, paratrain's count; link: node 0's bytes over the shaped link for the "
          "whole run, start-up and evaluation included, / steps)")
    for label, r in results.items():
        if label in PLACEMENTS or "loss" not in r and "error" not in r:
            continue
        if "error" in r:
            print(f"{label:<32} not run: {r['error']}")
            continue
        sent = f"{r['sent']:,}" if r.get("sent") is not None else "-"
        own = work.get(label.removeprefix("paratrain "))
        own = f"{own * 1e3:.1f}" if own is not None else "-"
        print(f"{label:<32} {r['step_s'] * 1e3:>8.1f} {none / r['step_s']:>7.2f}x {own:>8} {sent:>12} "
              f"{r['link']:>12,.0f} {r['loss']:>9.4f}")
    share = comm_share(results)
    print(f"\ncommunication share of the uncompressed step at {args.bandwidth}: the fp32 all-reduce of the "
          f"gradient alone takes {share['allreduce_s'] * 1e3:.1f} ms ({share['allreduce_share']:.0%} of paratrain "
          f"none's {none * 1e3:.1f} ms step); the same training with no communication at all takes "
          f"{share['compute_only_s'] * 1e3:.1f} ms, so communication adds {share['comm_share']:.0%} of the step.")
    print(f"Amdahl: compression that made communication free would make the step at most "
          f"{share['max_speedup']:.2f}x faster than none" + (" (2x is out of reach at this link rate on this "
          "machine: the step is mostly compute)" if share["max_speedup"] < 2 else ""))
    print(f"\ndp2 x tp2, {args.tp_global_batch} x {args.tp_seq_len} tokens per step, {args.tp_steps} steps; "
          f"planned = the planner's step time on this cluster (link rate as inter-node bandwidth)")
    print(f"{'placement (no compression)':<28} {'step ms':>8} {'planned':>8} {'link B/step':>12}")
    for label in PLACEMENTS:
        r = results[label]
        print(f"{label:<28} {r['step_s'] * 1e3:>8.1f} {planned.get(label, float('nan')) * 1e3:>8.1f} "
              f"{r['link']:>12,.0f}")
    ours = {k: v["step_s"] for k, v in results.items() if k.startswith("paratrain") and "step_s" in v}
    best = min(ours, key=ours.get)
    peer = results["torch powerSGD_hook"]["step_s"]
    print(json.dumps({"benchmark": "two_nodes", "paratrain": round(ours[best], 5), "peer": round(peer, 5),
                      "ratio": round(ours[best] / peer, 4), "best": best,
                      "speedup_vs_none": round(none / ours[best], 3),
                      f"paratrain_powersgd:{args.rank}_s": round(ours[f"paratrain powersgd:{args.rank}"], 5),
                      "powersgd_vs_torch": round(ours[f"paratrain powersgd:{args.rank}"] / peer, 4),
                      "comm_share": round(share["comm_share"], 3), "max_speedup": round(share["max_speedup"], 3),
                      "bandwidth": args.bandwidth, "load_average": round(load, 1)}))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bandwidth", default="1gbit")
    p.add_argument("--latency", default="0.5ms")
    p.add_argument("--steps", type=at_least(UNTIMED + 1), default=20,
                   help=f"dp4 runs: steps (the first {UNTIMED} untimed)")
    p.add_argument("--model", default="small")
    p.add_argument("--global-batch", type=at_least(1), default=4)
    p.add_argument("--seq-len", type=at_least(1), default=64)
    p.add_argument("--tp-global-batch", type=at_least(1), default=16, help="placement runs: sequences per step")
    p.add_argument("--tp-seq-len", type=at_least(1), default=128, help="placement runs: tokens per sequence")
    p.add_argument("--tp-steps", type=at_least(UNTIMED + 1), default=8,
                   help=f"placement runs: steps (the first {UNTIMED} untimed)")
    p.add_argument("--bucket-mb", type=float, default=100.0, help="gradient bucket size for every "
                   "run (default 100: one bucket; torch's powerSGD_hook aborts on gloo with several)")
    p.add_argument("--repeats", type=at_least(1), default=2, help="times every dp4 run is repeated (in "
                   "alternating order); step time is the median over all repeats' steps")
    p.add_argument("--rank", type=at_least(1), default=4, help="PowerSGD rank, both implementations")
    p.add_argument("--calibration", help="planner calibration (default: the planner's cache; "
                   "made by `paratrain plan --cluster local --calibrate`)")
    p.add_argument("--save", metavar="FILE.json", help="also write every number to this file")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    try:  # bad sizes fail here, before the cluster starts
        config(args, "unused"), placement_config(args, "unused", "tp-cp-pp-dp")
    except ValueError as exc:
        raise SystemExit(f"two_nodes: {exc}") from None
    if os.geteuid() != 0:
        print("two_nodes: needs root to build the cluster (scripts/cluster.py)", file=sys.stderr)
        return 2
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        log, code = run_cluster(args, f"{tmp}/results.json")
        if code != 0:
            print(log, file=sys.stderr)
            return code
        results = json.loads(Path(f"{tmp}/results.json").read_text())
    load = (load + os.getloadavg()[0]) / 2
    try:
        planned = predictions(args, delayed="NO added delay" not in log)
    except FileNotFoundError as exc:
        print(f"(no planner predictions: {exc})")
        planned = {}
    report(args, results, planned, log, load)
    if args.save:  # for docs/img/make_compression.py
        Path(args.save).write_text(json.dumps({"settings": {k: v for k, v in vars(args).items() if k not in ("worker", "out", "save")},
                                               "load_average": round(load, 1), "results": results,
                                               "planned": planned}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
