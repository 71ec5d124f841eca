"""How long a checkpoint blocks the step: paratrain's synchronous save, its asynchronous one
(``--async-save``) and torch.distributed.checkpoint's ``async_save`` with FSDP2, same model,
same 2-rank gloo world, one run.

    python benchmarks/async_save.py [--layers 14] [--d-model 1024] [--vocab 32000] [--rounds 2]

Defaults: the ~300M-parameter GPT of ``init_and_checkpoint.py`` (dp2 x ZeRO-3 for
paratrain; FSDP2 ``fully_shard`` per block and root for the peer), after one AdamW step, so
both save parameters and Adam's two moments.

* blocked: what the training thread waits for. Synchronous: the whole ``checkpoint.save``.
  Asynchronous: ``AsyncSaver.submit`` (agreeing on a fresh directory and copying the rank's
  slices to host memory). DCP: ``get_state_dict`` and ``dcp.async_save`` until it returns
  its future (its documented default: staging to CPU, then a background thread writes).
  Each saves twice, and the second save is reported (``first_*``: the first): a run saves
  again and again, and paratrain stages into the buffers of its previous save.
* background: from the start of the save until the checkpoint is written and published.

The last line is JSON: paratrain's blocked time with ``--async-save`` over DCP's
``async_save`` (lower is better), and ``async_over_sync``, the blocked time asynchronous
over synchronous (the issue's target: at most 0.10).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from paratrain.launch import spawn

from common import at_least, fsdp2_gpt, stepped_adamw
from init_and_checkpoint import config, model_arguments


def paratrain_worker(args) -> dict:
    from paratrain.mesh import Mesh
    from paratrain.train import checkpoint, loop
    from paratrain.train.async_save import AsyncSaver

    torch.set_num_threads(1)
    cfg = config(args, f"{args.dir}/paratrain", zero=3)
    mesh = Mesh.build(cfg.layout)
    run = loop.build(cfg, mesh)
    loop.train_step(run, 0)
    out, root = {}, Path(args.dir) / "paratrain"
    dist.barrier()
    t0 = time.perf_counter()
    checkpoint.save(root / "sync", 1, run.engine, cfg.model, cfg.layout.describe())
    out["sync_blocked"] = time.perf_counter() - t0
    saver = AsyncSaver(dist.get_rank(), dist.get_world_size(), timeout_s=1800)
    meta = checkpoint.index_meta(1, cfg.model, cfg.layout.describe())
    for save in ("first", "async"):  # a run's first save allocates the host buffers; later ones reuse them
        dist.barrier()
        t0 = time.perf_counter()
        saver.submit(root / save, run.engine, meta, checkpoint.agree)
        out[f"{save}_blocked"] = time.perf_counter() - t0
        out["staged_mb"] = saver.staged_bytes / 2**20
        saver.wait(checkpoint.agree)
        out[f"{save}_background"] = time.perf_counter() - t0
    return out


def dcp_worker(args) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.set_num_threads(1)
    model = fsdp2_gpt(config(args, f"{args.dir}/dcp").model)
    opt = stepped_adamw(model)
    out = {}
    for save in ("first", "async"):  # as paratrain: the second save is the one reported
        dist.barrier()
        t0 = time.perf_counter()
        msd, osd = get_state_dict(model, opt)
        future = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=str(Path(args.dir) / "dcp" / save))
        out[f"{save}_blocked"] = time.perf_counter() - t0
        (future.result() if hasattr(future, "result") else future.upload_completion.result())
        out[f"{save}_background"] = time.perf_counter() - t0
    return out


def worker(args, system: str) -> dict:
    result = paratrain_worker(args) if system == "paratrain" else dcp_worker(args)
    dist.barrier()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_arguments(parser)
    parser.add_argument("--dir", default="/tmp/paratrain-bench-async")
    parser.add_argument("--rounds", type=at_least(1), default=2, help="rounds of each (medians)")
    args = parser.parse_args()
    print("paratrain: dp2 x ZeRO-3, checkpoint.save (sync) then AsyncSaver.submit (--async-save); "
          "peer: FSDP2 + dcp.async_save (defaults: CPU staging, background thread, FileSystemWriter)",
          flush=True)
    shutil.rmtree(args.dir, ignore_errors=True)
    results: dict[str, list[dict]] = {"paratrain": [], "dcp": []}
    for _ in range(args.rounds):  # alternate, so the machine's load hits both alike
        for system in results:
            per_rank = spawn(worker, 2, args, system, backend="gloo", timeout_s=1800)
            slowest = {k: max(r[k] for r in per_rank) for k in per_rank[0]}
            results[system].append(slowest)
            print(f"{system:10s} " + "  ".join(f"{k} {v:.3f}" for k, v in slowest.items()), flush=True)
            shutil.rmtree(args.dir, ignore_errors=True)

    def median(system: str, key: str) -> float:
        return round(statistics.median(r[key] for r in results[system]), 4)

    ours, peer, sync = median("paratrain", "async_blocked"), median("dcp", "async_blocked"), \
        median("paratrain", "sync_blocked")
    print(json.dumps({"benchmark": "async_save", "rounds": args.rounds,
                      "metric": "seconds the training thread is blocked by one save (slowest rank, median)",
                      "paratrain": ours, "peer": peer, "ratio": round(ours / peer, 3),
                      "sync_blocked": sync, "async_over_sync": round(ours / sync, 3),
                      "background": {"paratrain": median("paratrain", "async_background"),
                                     "dcp": median("dcp", "async_background")}}))


if __name__ == "__main__":
    main()
