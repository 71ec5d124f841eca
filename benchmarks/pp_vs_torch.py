"""Pipeline step time: paratrain's GPipe, 1F1B and zero-bubble schedules against
torch.distributed.pipelining.

Zero-bubble pairs (issue 43): paratrain's zbh1 against torch's ScheduleInterleavedZeroBubble
with one stage per rank (ZB-H1's order: 1F1B whose W's fill the cool-down), zbv against
ScheduleZBVZeroBubble and dualpipev against ScheduleDualPipeV, both on the V placement
(rank r holds stages r and 2p - 1 - r), over the same stages and microbatches.

Same GPT (8 layers, ~1.7M parameters), same split into stages, same microbatches and data,
same AdamW, in one world per pipeline size: each sweep times every (schedule, runner)
pair for a few steps, and the median over sweeps is reported (the machine is shared, so
interleaving the runners spreads the noise over both). A step is timed from a barrier to
the end of the optimizer step on the slowest rank; the CPU time all ranks spent on it is
reported too, a measure of work that other jobs on the machine do not inflate.
paratrain's executor also records its
timeline, giving the measured bubble (1 - compute / the step's makespan over the ranks;
median over steps, mean over ranks) next to the theory (p-1)/(m+p-1), split into the shares of the step spent
waiting for transfers and in the calls that post them (the rest: Python between actions,
or the rank not being scheduled on a busy machine).

    python benchmarks/pp_vs_torch.py [--pp 2,4] [--microbatches 8] [--sweeps 12] [--steps 1]
        [--schedules gpipe,1f1b,zbh1,zbv,dualpipev]

Prints a table, then one JSON line (the headline pair: 1F1B at pp=2, or the first
schedule run; every pair is in its "pairs").
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from paratrain.comm import collectives as C
from paratrain.launch import spawn
from paratrain.models.gpt import GPT, GPTConfig
from paratrain.parallel.pipeline import (Recorder, gather_timeline, run_schedule, schedule,
                                         split_model, theoretical_bubble)
from paratrain.parallel.pipeline.posting import GLOO_RECEIVES_AHEAD
from paratrain.parallel.pipeline.schedules import placement
from paratrain.parallel.pipeline.simulator import simulate
from paratrain.parallel.pipeline.timeline import StepRecord, step_bubbles
from paratrain.stages import PipelineSplitError, check_pipeline_split

from common import at_least, int_list

MODEL = GPTConfig(vocab_size=256, d_model=128, n_layers=8, n_heads=4, ffn_hidden=352,
                  max_seq_len=128)
SCHEDULES = ("gpipe", "1f1b", "zbh1", "zbv", "dualpipev")
CHUNKS = {"zbv": 2, "dualpipev": 2}
"""Chunks per rank of each schedule (1 unless named)."""
TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
                   "zbh1": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble",
                   "dualpipev": "ScheduleDualPipeV"}


class TorchStage(nn.Module):
    """A paratrain chunk as torch.distributed.pipelining wants a stage: one tensor in, one
    out (logits on the last stage, whose loss torch's schedule computes)."""

    def __init__(self, chunk):
        super().__init__()
        self.chunk = chunk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.chunk
        if not c.is_last:
            return c(x)
        cos, sin = c.block_args(torch.arange(x.shape[1]))
        h = c.tok_embeddings(x) if c.is_first else x
        for layer in c.blocks():
            h = layer(h, cos, sin)
        return c.output(c.norm(h))


def batch(args, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, MODEL.vocab_size, (args.batch, args.seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def paratrain_runner(args, pp: int, rank: int, kind: str):
    v = CHUNKS.get(kind, 1)
    chunks = split_model(_model(), rank, pp, v, placement=placement(kind))
    opt = torch.optim.AdamW([p for c in chunks for p in c.parameters()], lr=1e-3)
    table = schedule(kind, pp, args.microbatches, v)[rank]
    micro = args.batch // args.microbatches
    recorder = Recorder(rank=rank)

    def step(i: int) -> float:
        tokens, targets = batch(args, i)
        mbs = [(tokens[j * micro:(j + 1) * micro], targets[j * micro:(j + 1) * micro])
               for j in range(args.microbatches)]
        opt.zero_grad()
        loss = run_schedule(table, chunks, mbs, None if pp == 1 else dist.group.WORLD,
                            1 / tokens.numel(), torch.device("cpu"),
                            (micro, args.seq, MODEL.d_model), recorder=recorder,
                            receives_ahead=args.receives_ahead)
        opt.step()
        return loss.item() / tokens.numel()

    return step, recorder


def torch_runner(args, pp: int, rank: int, kind: str):
    import torch.distributed.pipelining as pipelining

    v = CHUNKS.get(kind, 1)
    chunks = split_model(_model(), rank, pp, v, placement=placement(kind))
    modules = [TorchStage(c) for c in chunks]
    opt = torch.optim.AdamW([p for m in modules for p in m.parameters()], lr=1e-3)
    stages = [pipelining.PipelineStage(m, m.chunk.stage, pp * v, torch.device("cpu"))
              for m in modules]
    last = next((m for m in modules if m.chunk.is_last), None)
    tokens_per_step = args.batch * args.seq

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return last.chunk.loss_fn(logits, targets) / tokens_per_step

    cls = getattr(pipelining, TORCH_SCHEDULES[kind])
    # The one-stage schedules take a stage, the others (zero bubble) a list of them.
    sched = cls(stages[0] if kind in ("gpipe", "1f1b") else stages, args.microbatches,
                loss_fn=loss_fn, scale_grads=False)
    first = any(m.chunk.is_first for m in modules)

    def step(i: int) -> float:
        tokens, targets = batch(args, i)
        opt.zero_grad()
        losses: list[torch.Tensor] = []
        inputs = (tokens,) if first else ()
        if last is not None:
            sched.step(*inputs, target=targets, losses=losses)
        else:
            sched.step(*inputs)
        opt.step()
        return float(sum(loss.detach() for loss in losses)) if losses else 0.0

    return step, None


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(MODEL)


def timed(step, i: int) -> tuple[float, float, float]:
    """(seconds of the slowest rank, CPU seconds of all ranks, loss of the last rank).

    CPU time (every thread of every rank) is the work a step costs, whoever else uses the
    machine: a rank waiting for a peer or for a core consumes none."""
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    loss = step(i)
    wall = torch.tensor([time.perf_counter() - start])
    cpu_loss = torch.tensor([time.process_time() - cpu, loss])
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    dist.all_reduce(cpu_loss)  # the loss: only the rank of the last stage has it (V: rank 0)
    return wall.item(), cpu_loss[0].item(), cpu_loss[1].item()


def _shares(recorder: Recorder, pp: int, kind: str, costs: tuple[float, float]) -> dict[str, float]:
    """Bubble (against each step's makespan over the ranks, ``step_bubbles``), and the
    shares of the step spent waiting for transfers and posting them: median over this
    rank's steps (on a shared machine a rank that is not scheduled looks idle, and a median
    resists those steps), averaged over ranks."""
    steps = recorder.steps[1:] if len(recorder.steps) > 1 else recorder.steps
    parts = [s.breakdown() for s in steps]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, [s.to_dict() for s in steps])
    bubbles = [step_bubbles([StepRecord.from_dict(r[i]) for r in everyone])[dist.get_rank()]
               for i in range(len(steps))]
    mine = torch.tensor([statistics.median(bubbles)]
                        + [statistics.median(p[k] for p in parts) for k in ("wait", "post")])
    dist.all_reduce(mine)
    stages, floor = _stage_bubble(steps, kind, pp, costs)
    return {**dict(zip(("bubble", "wait", "post"), (mine / pp).tolist())),
            "stages": stages, "floor": floor}


def _stage_bubble(steps, kind: str, pp: int, transfer: tuple[float, float]) -> tuple[float, float]:
    """The bubble of a perfect executor with this run's own stages (each virtual stage's
    median forward and backward time, measured, fed to the schedule simulator; a split
    backward's B and W added up, W taking half in the simulation): with free transfers,
    and with each transfer and each post costing what ``transfer_costs`` measured. Stages
    are not equal (the last one also runs the head and the loss), and the textbook
    (p - 1) / (m + p - 1) assumes they are; nor are transfers free."""
    mine: dict[tuple[str, int], float] = {}
    for s in {i.stage for st in steps for i in st.intervals if i.kind == "F"}:
        med = {k: statistics.median([i.end - i.start for st in steps for i in st.intervals
                                     if i.kind == k and i.stage == s] or [0.0]) for k in "FBW"}
        mine[("F", s)], mine[("B", s)] = med["F"], med["B"] + med["W"]
    everyone: list = [None] * pp
    dist.all_gather_object(everyone, mine)
    stage_costs = {k: c for costs in everyone for k, c in costs.items()}
    m = len([i for i in steps[0].intervals if i.kind == "F"]) // CHUNKS.get(kind, 1)
    tables = schedule(kind, pp, m, CHUNKS.get(kind, 1))
    return (simulate(tables, stage_costs=stage_costs).bubble,
            simulate(tables, stage_costs=stage_costs, comm_cost=transfer[0], post_cost=transfer[1]).bubble)


def transfer_costs(args, rounds: int = 200) -> tuple[float, float]:
    """What a transfer costs between ranks 0 and 1 with the others idle, as the executor
    makes one: (one-way time of one activation: half the median round trip; time to post
    a batch of one receive and one send: the median ``send_recv`` call). gloo over loopback;
    a transfer on a pipeline's critical path costs at least this."""
    act = torch.zeros(args.batch // args.microbatches, args.seq, MODEL.d_model)
    back = torch.zeros_like(act)
    rank, trips, posts = dist.get_rank(), [], []
    for _ in range(rounds):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(act, 1)
            dist.recv(act, 1)
        elif rank == 1:
            dist.recv(act, 0)
            dist.send(act, 0)
        trips.append(time.perf_counter() - start)
        dist.barrier()
        if rank < 2:
            start = time.perf_counter()
            works = C.send_recv([C.P2P("recv", back, 1 - rank), C.P2P("send", act, 1 - rank)],
                                dist.group.WORLD)
            posts.append(time.perf_counter() - start)
            C.wait_all(works)
    costs = torch.tensor([statistics.median(trips) / 2, statistics.median(posts) if posts else 0.0])
    dist.broadcast(costs, src=0)
    return costs[0].item(), costs[1].item()


def world(args, pp: int) -> dict:
    """Every (schedule, runner) pair, interleaved over sweeps, on this world of pp ranks."""
    rank = dist.get_rank()
    runners = {(kind, name): make(args, pp, rank, kind) for kind in args.schedules
               for name, make in (("paratrain", paratrain_runner), ("torch", torch_runner))}
    times = {key: [] for key in runners}
    first_loss = {}
    for key, (step, _) in runners.items():  # warm-up: shape inference, allocator
        first_loss[key] = timed(step, 0)[2]
    for sweep in range(args.sweeps):
        for key, (step, _) in runners.items():
            times[key] += [timed(step, 1 + sweep * args.steps + i)[:2] for i in range(args.steps)]
    bubbles, costs = {}, transfer_costs(args)
    for kind in args.schedules:
        recorder = runners[(kind, "paratrain")][1]
        bubbles[kind] = _shares(recorder, pp, kind, costs)
        if args.timeline:
            timeline = gather_timeline(recorder, dist.group.WORLD, kind, args.microbatches,
                                       CHUNKS.get(kind, 1))
            if rank == 0:
                timeline.save(f"{args.timeline}-{kind}-pp{pp}.json")
    return {"times": {k: statistics.median(w for w, _ in v) for k, v in times.items()},
            "cpu": {k: statistics.median(c for _, c in v) for k, v in times.items()},
            "first_loss": first_loss, "bubbles": bubbles, "transfer_s": costs[0], "post_s": costs[1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int_list(2, " (torch's pipeline and the transfer timing "
                        "need two stages)"), default="2,4", help="pipeline sizes (default: 2,4)")
    parser.add_argument("--microbatches", type=at_least(1), default=8)
    parser.add_argument("--schedules", type=_schedules, default=",".join(SCHEDULES),
                        help=f"schedules to pair (default: {','.join(SCHEDULES)})")
    parser.add_argument("--batch", type=at_least(1), default=8, help="sequences per step")
    parser.add_argument("--seq", type=at_least(1), default=128)
    parser.add_argument("--sweeps", type=at_least(1), default=12,
                        help="rounds over all (schedule, runner) pairs (default: 12)")
    parser.add_argument("--steps", type=at_least(1), default=1,
                        help="timed steps per pair and round (default: 1: runners alternate "
                             "step by step, so bursts of load on the machine hit both)")
    parser.add_argument("--receives-ahead", type=at_least(0), default=None, metavar="N",
                        help="post paratrain's receives N computations early (default: the "
                             "executor's, 2 on gloo; 0: where the schedule table puts them)")
    parser.add_argument("--timeline", default="", metavar="PREFIX",
                        help="save paratrain's timelines as PREFIX-<schedule>-pp<N>.json")
    args = parser.parse_args()
    check_flags(parser, args)
    pairs = {}
    for pp in args.pp:
        result = spawn(world, pp, args, pp, backend="gloo")[0]
        for kind in args.schedules:
            pairs[(pp, kind)] = _pair(result, kind, _theory(kind, pp, args.microbatches))
    _print_table(pairs, args.microbatches, args.receives_ahead)
    # The headline is 1F1B at pp=2; where that pair was not run, the first pair run.
    key = (2, "1f1b") if (2, "1f1b") in pairs else next(iter(pairs))
    head = pairs[key]
    print(json.dumps({"benchmark": "pp_vs_torch",
                      "metric": f"step time (ms), {key[1].upper()} pp={key[0]}",
                      "paratrain": head["paratrain_ms"], "peer": head["peer_ms"],
                      "peer_name": "torch.distributed.pipelining", "ratio": head["ratio"],
                      "cpu_ratio": head["cpu_ratio"], "microbatches": args.microbatches,
                      "zero_bubble_worst_ratio": max((v["ratio"] for (pp, kind), v in pairs.items()
                                                      if kind in CHUNKS or kind == "zbh1"),
                                                     default=None),
                      "pairs": {f"{kind} pp={pp}": v for (pp, kind), v in pairs.items()}}))


def _schedules(text: str) -> tuple[str, ...]:
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in kinds if k not in SCHEDULES]
    if unknown or not kinds:
        raise argparse.ArgumentTypeError(f"{','.join(unknown) or text!r}: pick from "
                                         f"{','.join(SCHEDULES)}")
    return kinds


def _theory(kind: str, pp: int, m: int) -> float:
    """(p - 1)/(m + p - 1) for GPipe and 1F1B; the zero-bubble tables simulated with
    equal stages, F = W = 1 and B = 1 (ZB-H1: the paper's (p - 1)(F + B - W))."""
    if kind in ("gpipe", "1f1b"):
        return theoretical_bubble(pp, m)
    return simulate(schedule(kind, pp, m, CHUNKS.get(kind, 1)), 1.0, 2.0).bubble


def check_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit with a usage error naming the flag, before any rank starts, where the ranks
    would fail deep in the model or in torch's schedule."""
    from paratrain.parallel.pipeline import ScheduleError, check

    # the batch's own flags first: the schedules' checks below assume its microbatches
    if args.batch % args.microbatches:
        parser.error(f"--batch {args.batch} must be a multiple of --microbatches {args.microbatches}: "
                     f"both runners cut the batch into equal microbatches")
    for pp in args.pp:
        for v in sorted({CHUNKS.get(k, 1) for k in args.schedules}):
            try:
                check_pipeline_split(MODEL.n_layers, pp, v)
            except PipelineSplitError as exc:
                parser.error(f"--pp {pp}: {exc}")
        for kind in args.schedules:
            try:
                check(kind, pp, args.microbatches, CHUNKS.get(kind, 1))
            except ScheduleError as exc:
                parser.error(f"--schedules {kind} at --pp {pp}: {exc}")
    if args.seq > MODEL.max_seq_len:
        parser.error(f"--seq {args.seq} is longer than the model's max_seq_len {MODEL.max_seq_len}; "
                     f"pass --seq {MODEL.max_seq_len} or less")


def _pair(result: dict, kind: str, theory: float) -> dict:
    ours, peer = (result["times"][(kind, n)] * 1e3 for n in ("paratrain", "torch"))
    cpu_ours, cpu_peer = (result["cpu"][(kind, n)] * 1e3 for n in ("paratrain", "torch"))
    first, shares = result["first_loss"], result["bubbles"][kind]
    return {"paratrain_ms": round(ours, 2), "peer_ms": round(peer, 2),
            "ratio": round(ours / peer, 3), "paratrain_cpu_ms": round(cpu_ours, 1),
            "peer_cpu_ms": round(cpu_peer, 1), "cpu_ratio": round(cpu_ours / cpu_peer, 3),
            "bubble_theory": round(theory, 4), "bubble_these_stages": round(shares["stages"], 4),
            "transfer_ms": round(result["transfer_s"] * 1e3, 3),
            "post_ms": round(result["post_s"] * 1e3, 3),
            "bubble_floor": round(shares["floor"], 4),
            "bubble_measured": round(shares["bubble"], 4),
            "waiting": round(shares["wait"], 4), "posting": round(shares["post"], 4),
            "same_first_loss": abs(first[(kind, "paratrain")] / first[(kind, "torch")] - 1) < 1e-5}


def _print_table(pairs: dict, microbatches: int, ahead: int | None) -> None:
    kinds = sorted({kind for _, kind in pairs}, key=SCHEDULES.index)
    print(f"peer settings: torch.distributed.pipelining "
          f"{' / '.join(TORCH_SCHEDULES[k] for k in kinds)} over the same "
          f"stage split and the same {microbatches} microbatches, scale_grads=False "
          f"(both scale the loss by the token count themselves)")
    print(f"paratrain: receives posted {GLOO_RECEIVES_AHEAD if ahead is None else ahead} "
          f"computations before the table places them (--receives-ahead)")
    print("bubble: theory = (p-1)/(m+p-1) for equal stages (zero bubble: the tables simulated, "
          "F = B = W); stages = a perfect executor with "
          "this run's measured per-stage forward/backward times (the simulator); floor = the "
          "same, each transfer and each post costing what it costs on this machine (measured below)")
    print(f"{'':>12} {'step time, median ms':^28} {'CPU ms, all ranks':^24} "
          f"{'paratrain bubble':^53}")
    print(f"{'pp':>3} {'schedule':>9} {'paratrain':>10} {'torch':>9} {'ratio':>7} "
          f"{'paratrain':>10} {'torch':>7} {'ratio':>6} {'theory':>8} {'stages':>8} {'floor':>8} "
          f"{'measured':>9} "
          f"{'waiting':>8} {'posting':>8}  same loss")
    for (pp, kind), r in pairs.items():
        print(f"{pp:>3} {kind:>9} {r['paratrain_ms']:>10.1f} {r['peer_ms']:>9.1f} "
              f"{r['ratio']:>7.2f} {r['paratrain_cpu_ms']:>10.0f} {r['peer_cpu_ms']:>7.0f} "
              f"{r['cpu_ratio']:>6.2f} {r['bubble_theory']:>8.1%} {r['bubble_these_stages']:>8.1%} "
              f"{r['bubble_floor']:>8.1%} "
              f"{r['bubble_measured']:>9.1%} "
              f"{r['waiting']:>8.1%} {r['posting']:>8.1%}  "
              f"{'yes' if r['same_first_loss'] else 'NO'}")
    for pp in sorted({pp for pp, _ in pairs}):
        r = next(r for (p, _), r in pairs.items() if p == pp)
        print(f"pp={pp}: one activation's one-way transfer (ranks idle) {r['transfer_ms']:.3f} ms; "
              f"posting a batch (one receive, one send) {r['post_ms']:.3f} ms")


if __name__ == "__main__":
    main()
