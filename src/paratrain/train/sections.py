"""The sections of a training config (``[parallel]``, ``[data]``, ``[optim]``, ``[train]``):
one dataclass each, a docstring per field. ``train/config.py`` reads, checks and combines
them; every field is also a command-line flag.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class ParallelConfig:
    """How the work is split across processes."""

    nproc: int = 0
    """Processes to start (0: the product dp*tp*pp*cp*domain; when dp is also 0, with dp=2,
    or dp=1 under domain parallelism)."""
    dp: int = 0
    """Data-parallel replicas (0: whatever fills nproc)."""
    tp: int = 1
    """Tensor-parallel ranks."""
    pp: int = 1
    """Pipeline stages."""
    cp: int = 1
    """Context-parallel ranks."""
    ep: int = 1
    """Expert-parallel ranks, folded onto the data-parallel ones (ep divides dp): each
    mixture-of-experts layer's experts are split over ep of them (docs/moe.md)."""
    zero: Literal[0, 1, 2, 3] = 0
    """ZeRO stage on the data-parallel axis: 0 (DDP), 1 (shard optimizer state), 2 (+ gradients), 3 (+ parameters)."""
    shard_group: int = 0
    """ZeRO-3 hybrid sharding (HSDP): shard parameters, gradients and optimizer state within
    groups of this many consecutive dp x cp ranks and replicate them across groups, whose
    gradients are all-reduced once per step (0: shard over all dp x cp ranks)."""
    reshard_after_forward: Literal["auto", "yes", "no"] = "auto"
    """ZeRO-3: free a unit's gathered parameters after each forward and gather them again
    for backward ("yes": least memory, two gathers per microbatch), or keep them from the
    first forward of a step to the unit's last backward ("no": one gather per step). "auto":
    "no" under a pipeline, which runs many microbatches on a stage holding 1/pp of the model
    (torchtitan's choice), "yes" otherwise."""
    offload: bool = False
    """ZeRO: keep optimizer state (fp32 masters, Adam moments) in CPU memory (GPU runs only)."""
    sp: bool = False
    """Megatron sequence parallelism on the tensor-parallel axis."""
    cp_method: Literal["ring", "ulysses"] = "ring"
    """Context-parallel attention: ring or ulysses."""
    schedule: Literal["gpipe", "1f1b", "interleaved", "zbh1", "zbv", "dualpipev"] = "1f1b"
    """Pipeline schedule: gpipe, 1f1b, interleaved, or the zero-bubble zbh1, zbv and
    dualpipev (zbv and dualpipev: --virtual-stages 2)."""
    microbatches: int = 0
    """Microbatches per step and data-parallel rank: pipeline microbatches when pp > 1,
    gradient-accumulation steps otherwise (0: derived from micro_batch)."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (interleaved schedule)."""
    order: str = "tp-cp-pp-dp"
    """Axes from fastest- to slowest-varying rank: tp first keeps its peers on one node."""
    bucket_mb: float = 4.0
    """Size of a gradient bucket, in MiB, for overlapped gradient reduction."""
    compress: str = "none"
    """Gradient compression of the data-parallel reduction: none, fp16, bf16, int8,
    topk:FRACTION or powersgd:RANK; int8/topk/powersgd keep an error-feedback residual
    (append :noef to drop it), and with :update average AdamW's updates instead of the
    gradients (--zero 0, --cp 1; docs/compression.md). With --zero 0 or 1."""
    compress_start: int = -1
    """Optimizer steps averaged uncompressed before compression starts (torch's
    start_powerSGD_iter): early steps are the most sensitive to a compressed gradient.
    -1: the larger of the learning-rate warm-up and 10% of the steps, as torch's PowerSGD
    documentation advises. top-k then warms its sparsity up in stages of this length."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Process-group backend: auto (nccl with GPUs, else gloo), gloo or nccl."""
    timeout_s: float = 300.0
    """Seconds a collective may wait for a peer before the job fails instead of hanging."""
    max_time_s: float = 0.0
    """Limit on the whole run's wall time, in seconds: past it the job is ended (0: none)."""
    domain: str = "1"
    """Domain parallelism (tasks on images): N ranks over each sample's height, or HxW, e.g. 2x2."""


@dataclass
class DataConfig:
    """Where the tokens come from."""

    corpus: str = ""
    """Text file to train on ('' : the bundled corpus). Bytes are the tokens."""
    data: str = ""
    """A dataset directory made by `paratrain data prepare` (its tokenizer's tokens, its own
    validation split); replaces the corpus."""
    seq_len: int = 128
    """Tokens per training sequence."""
    val_fraction: float = 0.05
    """Share of the corpus (its end) held out for validation (0: no validation set, and no
    validation loss)."""
    remainder: Literal["drop", "pad"] = "drop"
    """Samples that do not fill the last global batch of an epoch: drop, or pad (pad and mask)."""


@dataclass
class OptimConfig:
    """AdamW with linear warm-up and cosine decay."""

    lr: float = 3e-3
    """Peak learning rate."""
    min_lr: float = 3e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 20
    """Steps of linear warm-up from 0 to lr."""
    weight_decay: float = 0.1
    """Decoupled weight decay on matrices (embeddings included); norm weights are not decayed."""
    beta1: float = 0.9
    """Adam first-moment decay."""
    beta2: float = 0.95
    """Adam second-moment decay."""
    eps: float = 1e-8
    """Adam epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0: no clipping)."""


@dataclass
class TrainConfig:
    """The loop."""

    steps: int = 200
    """Optimizer steps."""
    global_batch: int = 16
    """Sequences per optimizer step, over all data-parallel ranks."""
    micro_batch: int = 0
    """Sequences per forward/backward on one rank (0: global_batch / dp, no accumulation)."""
    seed: int = 0
    """Seed for initialisation and data order."""
    precision: Literal["fp32", "bf16", "bf16-params"] = "fp32"
    """fp32; bf16: bf16 compute with fp32 master weights and optimizer state (DDP: autocast
    over fp32 weights; ZeRO: bf16 weights); bf16-params: bf16 weights under every engine,
    fp32 masters and moments in the optimizer, no autocast, so the residual stream and
    norms run in bf16 (the loss, softmax and norm statistics stay fp32: docs/compile.md)."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recomputation: none, selective (attention core), full (whole blocks)."""
    compile: bool = False
    """torch.compile each transformer block and the loss (regional compilation, after the
    model is parallelized; docs/compile.md). The first step pays the compile time, which
    the summary reports."""
    eval_every: int = 50
    """Validation every this many steps (0: never; always at the end)."""
    eval_batches: int = 4
    """Global batches of validation data per evaluation."""
    run_dir: str = ""
    """Directory for this run's outputs, exactly ('': a new runs/<UTC time>-<name>, with
    runs/latest pointing at it; with resume auto, the run runs/latest points at)."""
    name: str = ""
    """Name that ends the default run directory runs/<UTC time>-<name> ('': the model preset)."""
    metrics: str = ""
    """JSON-lines metrics file ('' : RUN_DIR/metrics.jsonl)."""
    progress: bool = True
    """Show progress (rank 0): a bar on a terminal, else a plain line every log_every steps."""
    log_every: int = 10
    """Steps between plain progress lines (output not a terminal) and per-rank peak-memory
    records in the metrics."""
    log: str = ""
    """Extra metric sinks besides metrics.jsonl, comma-separated: csv, tensorboard, wandb."""
    profile: str = ""
    """START:END: record steps START to END (1-based) with torch.profiler into
    RUN_DIR/profile-rank{N}.json (Chrome trace format)."""
    save_every: int = 0
    """Save a layout-independent checkpoint to RUN_DIR/checkpoints/step-N every this many
    steps and after the last (0: never)."""
    quiet: bool = False
    """Print only warnings and errors: no run description, progress, summary or notes
    (the metrics are written as always)."""
    async_save: bool = False
    """Write checkpoints in the background: the step waits only while each rank copies its
    slices to host memory; at most one save is in flight (train/async_save.py)."""
    keep_last: int = 0
    """Keep only the newest N checkpoints of the run, removing older ones after each save
    (0: keep all), so that a long run does not fill its disk."""
    resume: str = ""
    """auto: the newest complete checkpoint of the run directory, or a fresh start if there is
    none; none: start fresh; or a checkpoint directory, written under any layout (same model
    shape). '': auto under torchrun, else none."""
    timeline: bool = False
    """Pipeline runs: record what each rank did when into RUN_DIR/timeline.json, for
    `paratrain trace --run`, and print the measured bubble."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """A step whose loss or gradient norm is NaN or inf: stop the run (naming the step, the
    rank and the last good checkpoint), or skip its update and go on."""
    max_skips: int = 10
    """With --on-nonfinite skip: the run fails at the next non-finite step after this many."""
    task: str = "lm"
    """lm: a GPT on text; or another task, a train/task_NAME.py (an unknown name is refused
    with the list)."""

    @property
    def compute_precision(self) -> str:
        """What the matrix multiplies run in, in the planner's and the peak-FLOPs'
        vocabulary: 'fp32', or 'bf16' under either bf16 policy."""
        return "fp32" if self.precision == "fp32" else "bf16"
