"""Initialisation, checkpoint save and load: paratrain's sharded checkpoints vs
torch.distributed.checkpoint (DCP) with FSDP2, same model, same world size, one run.

    python benchmarks/init_and_checkpoint.py [--layers 14] [--d-model 1024] [--vocab 32000] [--rounds 2]

Defaults: a ~300M-parameter GPT (d_model 1024, 14 layers, MLP 4096, vocabulary 32000; the
largest tensor is an embedding of 131 MB). Layouts, each in its own 2-rank gloo world:

* paratrain dp2 x ZeRO-3 and paratrain tp2: ``task_lm.build_engine`` (the model built on
  the meta device; each rank materialises and initialises only its share), one AdamW
  step, then ``checkpoint.save`` (each rank writes its slices) and ``checkpoint.load_into``
  (reads only its slices; it also checks each file's SHA-256, which DCP does not);
* the peer: the same GPT built on the meta device, ``fully_shard`` on every block and the
  root (FSDP2 defaults), then ``to_empty`` and initialisation of each rank's shards (the
  meta-device recipe FSDP2's documentation gives for large models), torch AdamW, one
  step, then ``get_state_dict`` + ``dcp.save`` of model *and* optimizer
  (DCP's default FileSystemWriter: one file per rank, its documented default), and
  ``dcp.load`` + ``set_state_dict``.

Per rank: wall time of each phase, and peak memory during it as the rise of the process's
anonymous RSS (sampled every 2 ms after ``gc.collect`` + ``malloc_trim``; file pages that
safetensors maps for reading are not counted, they are page cache). Both save the same
state: parameters and Adam's two moments (12 bytes per parameter). The last line is JSON:
save time of paratrain ZeRO-3 over DCP + FSDP2 (lower is better).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import shutil
import statistics
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from paratrain.launch import spawn

from common import at_least, fsdp2_gpt, stepped_adamw


class AnonPeak:
    """Peak rise of the process's anonymous RSS while the block runs (sampled)."""

    def __enter__(self):
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        self.base = self.peak = _rss_anon()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        self.t0 = time.perf_counter()
        return self

    def _sample(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss_anon())

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_anon())

    def result(self) -> dict:
        return {"s": round(self.seconds, 3), "peak_mb": round((self.peak - self.base) / 2**20, 1)}


def _rss_anon() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def config(args, tmp: str, **layout):
    from paratrain.train.config import load

    return load(None, dict(preset="tiny", d_model=args.d_model, n_layers=args.layers, n_heads=args.d_model // 64,
                           n_kv_heads=args.d_model // 64, ffn_hidden=args.ffn, vocab_size=args.vocab,
                           max_seq_len=64, seq_len=16, global_batch=2, steps=1, warmup_steps=0,
                           grad_clip=0.0, eval_every=0, progress=False, run_dir=tmp, nproc=2,
                           **layout)).validate()


def paratrain_worker(args, name: str, layout: dict) -> dict:
    from paratrain.mesh import Mesh
    from paratrain.train import checkpoint, loop, task_lm

    torch.set_num_threads(1)
    cfg = config(args, f"{args.dir}/{name}", **layout)
    out, mesh = {}, Mesh.build(cfg.layout)  # process groups: not initialisation
    with AnonPeak() as m:
        task_lm.build_engine(cfg, mesh)
    out["init"] = m.result()
    run = loop.build(cfg, mesh)
    loop.train_step(run, 0)
    state = run.engine.state_tensors()
    from paratrain.accounting import storage_bytes
    out["state_mb"] = round(storage_bytes([*state["params"], *state["optim"]]) / 2**20, 1)
    directory = Path(args.dir) / name / "ckpt"
    with AnonPeak() as m:
        checkpoint.save(directory, 1, run.engine, cfg.model, cfg.layout.describe())
    out["save"] = m.result()
    with AnonPeak() as m:
        checkpoint.load_into(run.engine, directory, cfg.model)
    out["load"] = m.result()
    return out


def fsdp2_worker(args, name: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    torch.set_num_threads(1)
    cfg = config(args, f"{args.dir}/{name}")
    out = {}
    with AnonPeak() as m:
        model = fsdp2_gpt(cfg.model)
    out["init"] = m.result()
    opt = stepped_adamw(model)
    local = [p.to_local() for p in model.parameters()]
    moments = [v.to_local() for s in opt.state.values() for v in s.values() if v.dim() > 0]
    out["state_mb"] = round(sum(t.numel() * t.element_size() for t in local + moments) / 2**20, 1)
    directory = str(Path(args.dir) / name / "ckpt")
    with AnonPeak() as m:
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=directory)
        del msd, osd
    out["save"] = m.result()
    with AnonPeak() as m:
        msd, osd = get_state_dict(model, opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=directory)
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        del msd, osd
    out["load"] = m.result()
    return out


def worker(args, system: str, name: str, layout: dict) -> dict:
    result = paratrain_worker(args, name, layout) if system == "paratrain" else fsdp2_worker(args, name)
    dist.barrier()
    return result


def model_arguments(parser: argparse.ArgumentParser) -> None:
    """The GPT's shape (``config`` reads them): ~300M parameters by default."""
    parser.add_argument("--layers", type=at_least(1), default=14)
    parser.add_argument("--d-model", type=at_least(1), default=1024)
    parser.add_argument("--ffn", type=at_least(1), default=4096)
    parser.add_argument("--vocab", type=at_least(1), default=32000)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_arguments(parser)
    parser.add_argument("--dir", default="/tmp/paratrain-bench-ckpt")
    parser.add_argument("--rounds", type=at_least(1), default=2, help="rounds of the ZeRO-3 / DCP pair (medians)")
    args = parser.parse_args()
    from paratrain.models.gpt import GPTConfig

    params = GPTConfig(d_model=args.d_model, n_layers=args.layers, n_heads=args.d_model // 64,
                       n_kv_heads=args.d_model // 64, ffn_hidden=args.ffn, vocab_size=args.vocab).num_params()
    print(f"model: {params / 1e6:.0f}M parameters (d_model {args.d_model}, {args.layers} layers, MLP {args.ffn}, "
          f"vocabulary {args.vocab}); largest tensor {args.vocab * args.d_model * 4 / 2**20:.0f} MiB; "
          f"2 ranks, gloo, CPU", flush=True)
    print("peer: torch FSDP2 (fully_shard per block + root, defaults) with DCP get_state_dict + "
          "dcp.save/dcp.load (FileSystemWriter defaults: one file per rank), model and optimizer", flush=True)
    shutil.rmtree(args.dir, ignore_errors=True)
    runs = {"paratrain dp2 x ZeRO-3": ("paratrain", "zero3", {"zero": 3}),
            "paratrain tp2": ("paratrain", "tp2", {"dp": 1, "tp": 2}),
            "DCP + FSDP2 (2 ranks)": ("fsdp2", "fsdp2", {})}
    for system, name, layout in runs.values():  # a shape the layouts cannot split: say so now
        try:
            config(args, f"{args.dir}/{name}", **layout)
        except ValueError as err:
            parser.error(f"--d-model {args.d_model} ({args.d_model // 64} heads of 64), "
                         f"--layers, --ffn: {err}")
    results: dict[str, list] = {label: [] for label in runs}
    for round_ in range(args.rounds):  # alternate, so the machine's load hits all alike
        for label, (system, name, layout) in runs.items():
            if round_ and system == "paratrain" and name == "tp2":
                continue  # the pair the ratio compares is repeated; tp2 is shown once
            per_rank = spawn(worker, 2, args, system, name, layout, backend="gloo", timeout_s=1800)
            results[label].append(per_rank)
            for rank, r in enumerate(per_rank):
                print(f"{label:24s} rank {rank}: state {r['state_mb']:8.1f} MiB | init {r['init']['s']:7.2f} s "
                      f"+{r['init']['peak_mb']:7.1f} MiB | save {r['save']['s']:6.2f} s +{r['save']['peak_mb']:7.1f} MiB"
                      f" | load {r['load']['s']:6.2f} s +{r['load']['peak_mb']:7.1f} MiB", flush=True)
            shutil.rmtree(Path(args.dir) / name, ignore_errors=True)

    def median(label: str, phase: str, key: str) -> float:  # over rounds, of the slowest rank
        return statistics.median(max(r[phase][key] for r in rs) for rs in results[label])

    ours, peer = median("paratrain dp2 x ZeRO-3", "save", "s"), median("DCP + FSDP2 (2 ranks)", "save", "s")
    summary = {label: {phase: {"s": median(label, phase, "s"), "peak_mb": median(label, phase, "peak_mb")}
                       for phase in ("init", "save", "load")} for label in runs}
    print(json.dumps({"benchmark": "init_and_checkpoint", "rounds": args.rounds,
                      "metric": "save wall time, s (slowest rank, median over rounds)",
                      "pair": "paratrain dp2 x ZeRO-3 vs DCP + FSDP2", "params_m": round(params / 1e6),
                      "paratrain": ours, "peer": peer, "ratio": round(ours / peer, 3),
                      "init_peak_ratio": round(summary["paratrain dp2 x ZeRO-3"]["init"]["peak_mb"]
                                               / max(summary["DCP + FSDP2 (2 ranks)"]["init"]["peak_mb"], 1e-9), 3),
                      "detail": summary}))


if __name__ == "__main__":
    main()
