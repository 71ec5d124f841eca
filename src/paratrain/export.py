"""``paratrain export CHECKPOINT --to hf --out DIR``: a checkpoint (any layout it was saved
under) as a Hugging Face model directory that ``AutoModelForCausalLM.from_pretrained`` loads,
with the tokenizer and special-token ids it was trained with, so that ``AutoTokenizer`` and
``generate`` work from the directory alone."""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "generation_config.json")
"""What transformers reads beside the weights to tokenize and to generate."""
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
"""config.json's special-token ids (``generate`` stops at the eos id)."""


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
        except TypeError:  # another task's model (its fields are not GPTConfig's)
            raise hf.HFModelError(f"{source}: a checkpoint of a model other than paratrain's "
                                  f"GPT (another --task's), which has no Hugging Face form; "
                                  f"export GPT checkpoints") from None
        params = checkpoint.load(source, cfg)[1]["param"]
        what = f"checkpoint at step {meta['step']}"
    elif hf.is_model_dir(str(source)):
        cfg = hf.read_config(source)
        params, what = hf.load_weights(source, cfg), "Hugging Face model"
    else:
        raise FileNotFoundError(f"{source}: neither a checkpoint (meta.json) nor a Hugging Face "
                                f"model directory (config.json){_checkpoints_hint(source)}")
    dtype = getattr(torch, args.dtype) if args.dtype else None
    extra = companions(source, meta if (source / "meta.json").is_file() else None)
    out = hf.export(params, cfg, args.out, dtype, overwrite=args.overwrite, extra=extra.ids)
    extra.write(out)
    print(f"exported      {what} -> {out} ({hf.hf_config(cfg)['architectures'][0]}, "
          f"{cfg.num_params() / 1e6:.2f}M params); load it with "
          f"transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})")
    print(f"              {extra.describe()}")
    return 0


@dataclass
class Companions:
    """The tokenizer files and special-token ids that go with the exported weights."""

    origin: str = ""
    """Where they come from ('' : nowhere known)."""
    ids: dict[str, int] = field(default_factory=dict)
    """config.json's ``TOKEN_IDS`` that are known."""
    files: list[Path] = field(default_factory=list)
    """Files copied beside the weights."""
    tokenizer_config: dict | None = None
    """A tokenizer_config.json to write, where the origin has a bare tokenizer.json."""

    def write(self, out: Path) -> None:
        for path in self.files:
            # Exporting into the source's own directory (--out SOURCE --overwrite, or the
            # model directory the run started from) finds its tokenizer already there:
            # copying a file onto itself raised shutil.SameFileError after the weights
            # were written.
            if not (out / path.name).exists() or not (out / path.name).samefile(path):
                shutil.copy2(path, out / path.name)
        if self.tokenizer_config is not None:
            (out / "tokenizer_config.json").write_text(json.dumps(self.tokenizer_config, indent=2))

    def describe(self) -> str:
        if not self.origin:
            return ("no tokenizer carried: none beside the source, nor in its run's model "
                    "directory or dataset (a run on a text corpus reads bytes as tokens)")
        names = [p.name for p in self.files] + (["tokenizer_config.json"] if self.tokenizer_config else [])
        ids = ", ".join(f"{k}={v}" for k, v in self.ids.items())
        return f"with {', '.join(names) or 'no tokenizer files'}{f' and {ids}' if ids else ''} from {self.origin}"


def companions(source: Path, meta: dict | None) -> Companions:
    """Those of the Hugging Face directory exported (``meta`` None) or that the checkpoint's
    run started from; else those of the dataset the run trained on (its tokenizer.json and
    end-of-text id)."""
    from .models import hf

    run = (meta or {}).get("run", {}).get("config", {})
    model_dir = source if meta is None else None
    if run.get("model_preset") and hf.is_model_dir(run["model_preset"]):
        model_dir = Path(run["model_preset"])
    if model_dir is not None:
        raw = json.loads((model_dir / "config.json").read_text())
        found = Companions(str(model_dir), {k: raw[k] for k in TOKEN_IDS if raw.get(k) is not None},
                           [model_dir / n for n in TOKENIZER_FILES if (model_dir / n).is_file()])
        if found.ids or found.files:
            return found
    return _dataset_companions(run.get("data", {}).get("data", ""))


def _dataset_companions(dataset: str) -> Companions:
    from tokenizers import Tokenizer

    from .data.dataset import read_meta
    from .data.prepare import DataError

    try:
        data = read_meta(dataset) if dataset else None
    except DataError:
        data = None
    if data is None or not Path(data.tokenizer).is_file():  # bytes, or moved away
        return Companions()
    try:
        eos = Tokenizer.from_file(data.tokenizer).id_to_token(data.eos_id)
    except Exception:  # tokenizers raises a bare Exception on a damaged file
        return Companions()
    return Companions(f"the dataset {dataset}", {"eos_token_id": data.eos_id}, [Path(data.tokenizer)],
                      {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos})


def _checkpoints_hint(source: Path) -> str:
    """A run directory was given: name its newest checkpoint, which is what exports."""
    from .train.saved import checkpoints, step_of

    steps = [p for p in checkpoints(source) if (p / "meta.json").is_file()]
    newest = max(steps, key=step_of, default=None)
    return f"; it is a run directory: export one of its checkpoints, e.g. {newest}" if newest else ""
