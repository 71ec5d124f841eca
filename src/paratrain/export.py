"""``paratrain export CHECKPOINT --to hf --out DIR``: a checkpoint (any layout it was saved
under) as a Hugging Face model directory that ``AutoModelForCausalLM.from_pretrained`` loads."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a checkpoint as a Hugging Face model directory",
                       description="Write a paratrain checkpoint (or re-write a Hugging Face "
                                   "model directory) as config.json + model.safetensors.")
    p.add_argument("source", help="a checkpoint directory (RUN_DIR/checkpoints/step-N) or a "
                                  "Hugging Face model directory")
    p.add_argument("--to", choices=["hf"], default="hf", help="the format (hf: transformers)")
    p.add_argument("--out", required=True, help="the directory to write (new or empty)")
    p.add_argument("--overwrite", action="store_true",
                   help="write into a non-empty --out, replacing its config.json and model.safetensors")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="cast the tensors (default: as stored)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from .models import hf
    from .models.gpt import GPTConfig
    from .train import checkpoint

    source = Path(args.source)
    hf.check_export_target(args.out, args.overwrite)  # before any weights are read
    if (source / "meta.json").is_file():
        meta = checkpoint.read_meta(source)
        try:
            cfg = GPTConfig(**meta["model"])
        except TypeError:  # another model's fields (the heat2d task's U-Net)
            raise hf.HFModelError(f"{source}: a checkpoint of a model other than paratrain's "
                                  f"GPT (the --task heat2d U-Net?), which has no Hugging Face "
                                  f"form; export GPT checkpoints") from None
        params = checkpoint.load(source, cfg)[1]["param"]
        what = f"checkpoint at step {meta['step']}"
    elif hf.is_model_dir(str(source)):
        cfg = hf.read_config(source)
        params, what = hf.load_weights(source, cfg), "Hugging Face model"
    else:
        raise FileNotFoundError(f"{source}: neither a checkpoint (meta.json) nor a Hugging Face "
                                f"model directory (config.json)")
    dtype = getattr(torch, args.dtype) if args.dtype else None
    out = hf.export(params, cfg, args.out, dtype, overwrite=args.overwrite)
    print(f"exported      {what} -> {out} ({hf.hf_config(cfg)['architectures'][0]}, "
          f"{cfg.num_params() / 1e6:.2f}M params); load it with "
          f"transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})")
    return 0
