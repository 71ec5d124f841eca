"""paratrain --compile vs the same run eager, on CPU: what inductor gains per step, and what
compiling costs.

    python benchmarks/compile.py [--model small] [--seq 128] [--global-batch 8]
                                 [--steps 6] [--rounds 3] [--layouts dp2,pp2]

For each layout (dp2: DDP over two ranks; pp2: two pipeline stages, 1F1B), every rank
builds the run twice through the training loop's own path (``loop.build``: parallelize,
then fill), once eager and once with ``--compile``, on the same seed and data. A warm-up
step of each compiles (its time is the compile time: torch's own count, on the rank that
compiled longest); then
``--rounds`` interleaved rounds of ``--steps`` optimizer steps each (eager, compiled,
eager, ...), so machine noise hits both alike. Reported per layout: the median over rounds
of each round's median step time, and compiled / eager.

The peer is paratrain eager on the same layout, not another library: the question is
what compiling the blocks buys this trainer (torch's own compiled plain loop is the GPU
check's peer, scripts/gpu_check.sh). The last line is JSON; its headline is dp2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from paratrain.launch import spawn
from paratrain.mesh import Mesh
from common import at_least, check_model_flags

LAYOUTS = {"dp2": {"dp": 2}, "pp2": {"pp": 2, "dp": 1, "schedule": "1f1b"}}


def config(args, layout: str, compiled: bool):
    from paratrain.train.config import load

    return load(None, {"preset": args.model, "seq_len": args.seq, "global_batch": args.global_batch,
                       "steps": 1 + args.steps * args.rounds, "nproc": 2, "compile": compiled,
                       "eval_every": 0, "val_fraction": 0.0, "progress": False, "quiet": True,
                       "run_dir": f"{args.run_dir}/{layout}-{'compiled' if compiled else 'eager'}",
                       **LAYOUTS[layout]}).validate()


def timed_steps(run, first: int, count: int) -> list[float]:
    from paratrain.train.loop import train_step

    times = []
    for step in range(first, first + count):
        dist.barrier()
        t0 = time.perf_counter()
        train_step(run, step)  # its one host read waits for the step's end
        times.append(time.perf_counter() - t0)
    return times


def worker(args) -> dict:
    from paratrain.parallel.compile import compile_seconds
    from paratrain.train.loop import build

    out = {}
    for layout in args.layouts:
        runs = {}
        for compiled in (False, True):
            cfg = config(args, layout, compiled)
            runs[compiled] = build(cfg, Mesh.build(cfg.layout))
        before = compile_seconds()
        warm = {c: timed_steps(runs[c], 0, 1)[0] for c in (False, True)}
        compile_s = compile_seconds() - before
        medians = {False: [], True: []}
        for r in range(args.rounds):
            for c in (False, True):
                medians[c].append(statistics.median(timed_steps(runs[c], 1 + r * args.steps, args.steps)))
        eager, comp = (statistics.median(medians[c]) for c in (False, True))
        out[layout] = {"eager_ms": round(eager * 1e3, 2), "compiled_ms": round(comp * 1e3, 2),
                       "ratio": round(comp / eager, 3), "compile_s": round(compile_s, 1),
                       "first_step_s": {"eager": round(warm[False], 2), "compiled": round(warm[True], 2)},
                       "round_medians_ms": {"eager": [round(m * 1e3, 2) for m in medians[False]],
                                            "compiled": [round(m * 1e3, 2) for m in medians[True]]}}
        del runs
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", help="GPT preset (default: small, 2.46M parameters)")
    parser.add_argument("--seq", type=at_least(8), default=128, help="tokens per sequence")
    parser.add_argument("--global-batch", type=at_least(2), default=8,
                        help="sequences per step over both ranks (pp2: 4 microbatches of 2)")
    parser.add_argument("--steps", type=at_least(1), default=6, help="timed steps per round")
    parser.add_argument("--rounds", type=at_least(1), default=3, help="interleaved rounds")
    parser.add_argument("--layouts", default="dp2,pp2", help=f"comma-separated, of {', '.join(LAYOUTS)}")
    parser.add_argument("--run-dir", default="runs/bench-compile", help="where the runs write metrics")
    args = parser.parse_args()
    check_model_flags(parser, args.model, args.seq)
    args.layouts = [name for name in args.layouts.split(",") if name]
    unknown = [name for name in args.layouts if name not in LAYOUTS]
    if unknown or not args.layouts:
        parser.error(f"--layouts {','.join(unknown) or '(none)'}: pick from {', '.join(LAYOUTS)}")
    ranks = spawn(worker, 2, args, backend="gloo", timeout_s=1800)
    result = ranks[0]
    for layout in result:  # a pipeline's stages compile different graphs: the slower rank's
        result[layout]["compile_s"] = max(r[layout]["compile_s"] for r in ranks)
    print(f"paratrain --compile vs eager, model {args.model}, seq {args.seq}, global batch "
          f"{args.global_batch}, {args.rounds} rounds of {args.steps} steps, 2 CPU processes (gloo)")
    print(f"{'layout':<8}{'eager ms':>10}{'compiled ms':>13}{'ratio':>8}{'compile s':>11}")
    for layout, r in result.items():
        print(f"{layout:<8}{r['eager_ms']:>10.1f}{r['compiled_ms']:>13.1f}{r['ratio']:>8.3f}{r['compile_s']:>11.1f}")
    head_name = "dp2" if "dp2" in result else next(iter(result))
    head = result[head_name]
    print(json.dumps({"benchmark": "compile", "metric": f"step time (ms), {head_name}",
                      "paratrain": head["compiled_ms"], "peer": head["eager_ms"],
                      "peer_name": "paratrain eager, same layout", "ratio": head["ratio"],
                      "compile_s": head["compile_s"], "layouts": result,
                      "torch": torch.__version__}))


if __name__ == "__main__":
    main()
