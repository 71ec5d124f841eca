"""Checks of a validated config against this machine and the data, before any process starts.

``Config.validate`` judges the config alone; these read the world outside it: which
backends the machine can run, and whether the corpus fills a batch, a validation set and
the model's vocabulary. ``paratrain train`` runs them in the launcher (and under torchrun
in each rank, before it joins the group), so a bad run ends with exit code 2 and a message
naming the field, never inside a rank.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..launch import pick_backend
from ..layout import parse_domain
from . import data as D
from .config import Config, ConfigError
from .schema import where
from .task import load_task


def check_machine(cfg: Config, torchrun: bool = False) -> None:
    """The backend can run here: nccl needs CUDA, and (when paratrain starts the processes
    itself) one GPU per process."""
    p = cfg.parallel
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if p.backend == "nccl" and gpus == 0:
        raise ConfigError(f"parallel.backend: nccl runs on CUDA GPUs and this machine has none; "
                          f"use --backend gloo (or auto) {where('parallel', 'backend')}")
    if not torchrun and pick_backend(p.backend) == "nccl" and p.nproc > gpus:
        raise ConfigError(f"parallel.nproc: nccl needs one GPU per process: {p.nproc} processes, "
                          f"{gpus} GPUs here; lower --nproc or use --backend gloo "
                          f"{where('parallel', 'nproc')}")


def check_memory(cfg: Config, local_ranks: int) -> None:
    """The planner's per-rank memory prediction for this layout fits what each local rank
    can have: its GPU's free memory, or on CPU the machine's available RAM shared by the
    local ranks. Refused with both numbers, before any rank starts or allocates."""
    if cfg.train.task != "lm" or parse_domain(cfg.parallel.domain) != (1, 1):
        return  # the planner models language models (dense or mixtures of experts)
    predicted = predicted_memory(cfg)
    available, what = available_memory(cfg, max(local_ranks, 1))
    if predicted.total > available:
        gib = 1 << 30
        raise ConfigError(
            f"memory: the planner predicts {predicted.total / gib:.2f} GiB per rank (paratrain's "
            f"runtime) for "
            f"{cfg.describe_layout()} (parameters {predicted.params / gib:.2f}, gradients "
            f"{predicted.grads / gib:.2f}, optimizer {predicted.optimizer / gib:.2f}, "
            f"activations {predicted.activations / gib:.2f}, buffers {predicted.buffers / gib:.2f}), "
            f"and {what} is {available / gib:.2f} GiB; shard more (--zero 3, --tp, --pp, more "
            f"ranks), recompute (--recompute full) or lower --micro-batch; `paratrain plan "
            f"--model ... --layout ...` shows where the bytes go")


def predicted_memory(cfg: Config):
    """The planner's peak bytes of the fullest rank (plan/memory.py, paratrain's runtime)."""
    from ..plan.candidate import Candidate, Training
    from ..plan.memory import rank_memory
    from ..plan.models import from_gpt_config

    p, t = cfg.parallel, cfg.train
    schedule = p.schedule if p.pp > 1 else "1f1b"
    cand = Candidate(cfg.layout, p.zero, cfg.micro_batch, cfg.accumulation, schedule,
                     p.virtual_stages, t.recompute, sequence_parallel=p.sp, cp_method=p.cp_method)
    training = Training(t.global_batch, cfg.data.seq_len, t.compute_precision)
    return rank_memory(from_gpt_config(cfg.model, cfg.model_preset), training, cand, paratrain=True,
                       backend=pick_backend(cfg.parallel.backend))


def available_memory(cfg: Config, local_ranks: int) -> tuple[int, str]:
    """Bytes one rank can use, and what they are: the least free memory of the GPUs under
    nccl, else available RAM (``MemAvailable``) divided among the local ranks."""
    if pick_backend(cfg.parallel.backend) == "nccl":
        free = min(torch.cuda.mem_get_info(i)[0] for i in range(min(local_ranks, torch.cuda.device_count())))
        return free, "the free memory of a GPU"
    return _available_ram() // local_ranks, f"this machine's available RAM / {local_ranks} local ranks"


def _available_ram() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_data(cfg: Config) -> None:
    """The corpus gives at least one global batch of training samples, at least one
    validation sample when there is a validation set, and only tokens the model knows."""
    d, t = cfg.data, cfg.train
    if not load_task(t.task).reads_corpus:  # a task that makes its own data
        return
    if d.data:  # a prepared dataset: its metadata says all we need
        check_dataset(cfg)
        return
    try:
        if d.corpus and Path(d.corpus).stat().st_size == 0:
            raise ConfigError(f"data.corpus: {d.corpus!r} is empty; give a text file to train "
                              f"on {where('data', 'corpus')}")
        tokens = D.load_corpus(d.corpus)
    except OSError as exc:
        raise ConfigError(f"data.corpus: cannot read {d.corpus!r}: {exc.strerror} "
                          f"{where('data', 'corpus')}") from None
    train, val = D.split(tokens, d.val_fraction)
    samples = len(D.Samples(train, d.seq_len))
    needed = 1 if d.remainder == "pad" else t.global_batch
    if samples < needed:
        raise ConfigError(f"data.corpus: {len(train)} training tokens make {samples} samples of "
                          f"seq_len={d.seq_len}, fewer than one global batch of {needed}; use a "
                          f"longer corpus, or a smaller --global-batch or --seq-len "
                          f"{where('data', 'corpus')}")
    if d.val_fraction > 0 and len(D.Samples(val, d.seq_len)) == 0:
        raise ConfigError(f"data.val_fraction: the validation split ({len(val)} tokens) holds no "
                          f"sample of seq_len={d.seq_len}; raise --val-fraction, lower "
                          f"--seq-len, or set --val-fraction 0 for no validation "
                          f"{where('data', 'val_fraction')}")
    top = int(tokens.max()) if len(tokens) else 0
    if top >= cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size: the corpus holds token {top}, and the model's "
                          f"vocabulary has {cfg.model.vocab_size}; "
                          f"{_vocab_fix(cfg, top + 1, '(256 covers every byte) ')}"
                          f"{where('model', 'vocab_size')}")


def check_weights(cfg: Config) -> None:
    """A Hugging Face model directory that a fresh run initialises from: its safetensors
    files are there, readable and hold every tensor, before any rank reads slices of them."""
    from safetensors import SafetensorError, safe_open

    from ..models import hf, hf_check

    if cfg.train.resume not in ("", "auto", "none") or not hf.is_model_dir(cfg.model_preset):
        return  # resuming a checkpoint ("auto" may still start from the weights)
    try:
        files = hf.weight_files(cfg.model_preset)
        hf_check.check_complete(cfg.model_preset, cfg.model, files)
        for name in sorted(set(files.values())):
            with safe_open(str(Path(cfg.model_preset) / name), framework="pt"):
                pass  # the header parses and the file is as long as it says
    except hf_check.ConfigMismatch as exc:  # the files are fine; config.json says what to fix
        raise ConfigError(f"model.preset: {exc}") from None
    except (hf.HFModelError, SafetensorError, OSError, ValueError, KeyError) as exc:  # a bad index too
        raise ConfigError(f"model.preset: the weights of {cfg.model_preset!r} cannot be read: {exc}; "
                          f"give a directory with a complete model.safetensors (or its index "
                          f"and shards), as save_pretrained(safe_serialization=True) writes") from None


def advice(cfg: Config) -> list[str]:
    """Settings that run but probably do not do what was meant."""
    o, t = cfg.optim, cfg.train
    notes = []
    if t.steps <= o.warmup_steps:
        notes.append(f"steps={t.steps} is not above warmup_steps={o.warmup_steps}: the learning "
                     f"rate only warms up and never decays; lower --warmup-steps or raise --steps")
    start = cfg.compress_spec.start
    if cfg.parallel.compress != "none" and start >= t.steps:
        why = " (the default: the larger of --warmup-steps and 10% of --steps)" if cfg.parallel.compress_start < 0 else ""
        notes.append(f"--compress {cfg.parallel.compress} never starts: compression begins after "
                     f"{start} optimizer steps{why}, and the run takes {t.steps}; set "
                     f"--compress-start below {t.steps} (e.g. 1)")
    return notes + _tokenizer_advice(cfg)


def _tokenizer_advice(cfg: Config) -> list[str]:
    """A pretrained model (a Hugging Face directory with its tokenizer) trained on tokens of
    another tokenizer: its embedding reads each id as the token its own tokenizer gave it.
    A vocabulary-size check passes whenever the other tokenizer is no larger."""
    from ..models import hf

    own = Path(cfg.model_preset) / "tokenizer.json"
    if not hf.is_model_dir(cfg.model_preset) or not own.is_file():
        return []
    if not cfg.data.data:
        return [f"the model {cfg.model_preset!r} comes with its tokenizer, and this run feeds it a "
                f"text file's bytes as token ids; prepare the text with `paratrain data prepare "
                f"TEXT --tokenizer {cfg.model_preset} --out DATA` and train with --data DATA"]
    from tokenizers import Tokenizer

    from ..data.dataset import read_meta

    used = read_meta(cfg.data.data).tokenizer
    try:
        same = Path(used).is_file() and Tokenizer.from_file(used).get_vocab() == \
            Tokenizer.from_file(str(own)).get_vocab()
    except Exception:  # tokenizers raises a bare Exception on a damaged file
        same = False
    if same:
        return []
    return [f"the dataset {cfg.data.data!r} was tokenized with {used!r}, not with the model's own "
            f"{str(own)!r}: its ids name other tokens to the pretrained embedding; prepare it again "
            f"with --tokenizer {cfg.model_preset}"]


def _vocab_fix(cfg: Config, needed: int, note: str = "") -> str:
    """How to make the vocabulary cover ``needed`` tokens: a wider model, unless its
    Hugging Face weights fix the vocabulary; then data from its own tokenizer."""
    from ..models import hf

    if hf.is_model_dir(cfg.model_preset):
        return (f"the weights of {cfg.model_preset!r} fix its vocabulary: train on text "
                f"tokenized with its own tokenizer (`paratrain data prepare TEXT --tokenizer "
                f"{cfg.model_preset} --out DATA`, then --data DATA) ")
    return f"set --vocab-size {needed} (or more) {note}"


def check_dataset(cfg: Config) -> None:
    """A prepared dataset (--data): readable, within the model's vocabulary, a batch long."""
    from ..data.dataset import read_meta
    from ..data.prepare import DataError

    d = cfg.data
    if d.corpus:
        raise ConfigError("data.data and data.corpus both given: train on a prepared dataset "
                          "(--data) or on a text file's bytes (--corpus), not both")
    try:
        meta = read_meta(d.data)
    except DataError as exc:
        raise ConfigError(f"data.data: {exc}") from None
    if meta.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size: the dataset's tokenizer has {meta.vocab_size} "
                          f"tokens but the model only {cfg.model.vocab_size}; "
                          f"{_vocab_fix(cfg, meta.vocab_size)}")
    samples = max(0, meta.train_tokens - 1) // cfg.data.seq_len  # as data.Samples windows them
    needed = 1 if d.remainder == "pad" else cfg.train.global_batch
    if samples < needed:
        raise ConfigError(f"data.data: {meta.train_tokens} training tokens make {samples} samples "
                          f"of seq_len={cfg.data.seq_len}, fewer than one global batch of {needed}; "
                          f"prepare more text, or lower --global-batch or --seq-len")
    val_tokens = meta.tokens - meta.train_tokens
    if val_tokens > 0 and max(0, val_tokens - 1) // cfg.data.seq_len == 0:
        raise ConfigError(f"data.data: the dataset's validation split ({val_tokens} tokens) holds "
                          f"no sample of seq_len={cfg.data.seq_len}, so the run would report no "
                          f"validation loss; lower --seq-len, or prepare the data with a larger "
                          f"--val-fraction (or 0, for no validation split)")
