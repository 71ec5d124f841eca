"""The language-model task (``--task lm``, the default): paratrain's GPT, or a Hugging Face
Llama-family model, on tokenized text.

Loss normalisation: the model returns the *sum* of token losses over a microbatch; each
rank scales it by ``dp * cp / tokens_in_global_batch`` before backward, and the average of
gradients over the dp x cp group then equals the gradient of the mean loss over the whole
global batch: the same number a single process computes on the same batch, whatever the
data- or context-parallel size, the accumulation steps or the padding.
"""

from __future__ import annotations

import torch

from ..api import build_model
from ..layout import DP, parse_domain
from ..models.gpt import GPTConfig
from ..mesh import Mesh
from ..parallel.engine import Engine
from ..parallelize import parallelize
from . import checkpoint, logs
from . import data as D
from .config import Config, ConfigError
from .materialize import fill, initial_source
from .rundir import continued_run_id
from .task import Run, load_task, task_names


class LanguageModel:
    """The ``Task`` of a GPT on tokens (train/task.py)."""

    def build(self, cfg: Config, mesh: Mesh) -> Run:
        torch.manual_seed(cfg.train.seed)
        meta = checkpoint.read_meta(cfg.train.resume) if cfg.train.resume else {}
        engine, start_step = build_engine(cfg, mesh)
        train_tokens, val_tokens = D.load_tokens(cfg.data)
        source, vocab = cfg.data.data or cfg.data.corpus, cfg.model.vocab_size
        train_data = D.Samples(train_tokens, cfg.data.seq_len, vocab, source)
        sampler = D.DistributedSampler(len(train_data), cfg.train.global_batch,
                                       dp_rank=mesh.coord(DP), dp_size=mesh.size(DP),
                                       seed=cfg.train.seed, remainder=cfg.data.remainder)
        return Run(cfg, mesh, self, engine, train_data, D.Samples(val_tokens, cfg.data.seq_len, vocab, source),
                   sampler, start_step, continued_run_id(meta), cfg.train.resume,
                   checkpoint.skipped_steps(meta))

    def microbatches(self, run: Run, data: D.Samples, indices: list[int]) -> list[tuple]:
        size = run.cfg.micro_batch
        return [data.batch(indices[i:i + size], run.mesh.device) for i in range(0, len(indices), size)]

    def count(self, run: Run, step: int) -> int:
        return D.valid_tokens(run.sampler.global_indices(step), run.cfg.data.seq_len)

    @torch.no_grad()
    def evaluate(self, run: Run) -> float | None:
        """Mean loss over the first ``eval_batches`` global batches of validation data."""
        cfg, mesh = run.cfg, run.mesh
        if len(run.val_data) == 0:
            return None
        total, count = 0.0, 0
        share = cfg.train.global_batch // mesh.size(DP)
        for b in range(cfg.train.eval_batches):
            indices = D.eval_indices(len(run.val_data), cfg.train.global_batch, b)
            count += D.valid_tokens(indices, cfg.data.seq_len)
            mine = indices[mesh.coord(DP) * share:(mesh.coord(DP) + 1) * share]
            total += run.engine.forward_backward(self.microbatches(run, run.val_data, mine), 1.0,
                                                 training=False).total.item()
        return total / max(count, 1)

    def describe(self, run: Run) -> str:
        cfg, s = run.cfg, run.sampler
        remainder = ("pad: the last batch of each epoch is padded and masked" if cfg.data.remainder == "pad"
                     else f"drop: {s.dropped_per_epoch} samples per epoch that do not fill a global batch are skipped")
        return (f"paratrain: {cfg.describe_layout()}, model {cfg.describe_model()} "
                f"({cfg.model.num_params() / 1e6:.2f}M params), {cfg.train.global_batch} x "
                f"{cfg.data.seq_len} tokens per step, micro-batch {cfg.micro_batch} x "
                f"{cfg.accumulation} {'pipeline microbatches' if cfg.parallel.pp > 1 else 'accumulation'}, "
                f"{cfg.train.precision}\n"
                f"data: {len(run.train_data)} train samples, {s.steps_per_epoch} steps per epoch; "
                f"remainder {remainder}" + _offload_note(run) + _experts_note(cfg))

    def model_config(self, cfg: Config):
        return cfg.model

    def model_label(self, cfg: Config) -> str:
        return cfg.model_preset

    def flops_per_unit(self, cfg: Config) -> float:
        m = cfg.model
        untied = 0 if m.tie_embeddings else 1
        # A token's FLOPs follow the parameters it uses: of a mixture, top_k experts.
        matmul = (m.shape.active_params() - 2 * m.d_model * m.n_layers - m.d_model
                  - untied * m.vocab_size * m.d_model)
        return logs.flops_per_token(m.n_layers, m.d_model, cfg.data.seq_len, matmul)

    def data_position(self, cfg: Config, step: int) -> dict:
        # The sampler's order is a function of (seed, global batch, step).
        return {"step": step, "samples_seen": step * cfg.train.global_batch, **cfg.data_order()}

    reads_corpus = True
    spatial = False
    model_type = GPTConfig
    model_kind = "a language model"

    def validate(self, cfg: Config) -> None:
        p = cfg.parallel
        if parse_domain(p.domain) != (1, 1):
            spatial = [n for n in task_names() if load_task(n).spatial]
            raise ConfigError(f"--domain {p.domain} splits images over ranks; it needs "
                              f"{' or '.join('--task ' + n for n in spatial)} (a language "
                              f"model has no spatial axes)")
        if cfg.train.timeline and p.pp == 1:
            raise ConfigError("train.timeline records a pipeline's schedule, and this run has "
                              "none; add --pp 2 (or more), or drop --timeline")
        cfg.check_model_layout()


TASK = LanguageModel


def build_engine(cfg: Config, mesh: Mesh) -> tuple[Engine, int]:
    """This rank's engine with its share of the weights, and the steps already taken. The
    model is built without storage; each rank materialises only its share
    (train/materialize.py), from the checkpoint it resumes, else the Hugging Face weights
    or the seeded initialiser."""
    engine = parallelize(build_model(cfg, mesh.device, meta=True), mesh, cfg.parallel_options())
    if cfg.train.resume:  # each rank reads the slices of its own shards (train/checkpoint.py)
        return engine, checkpoint.load_into(engine, cfg.train.resume, cfg.model)
    fill(engine, initial_source(cfg))
    return engine, 0


def _offload_note(run: Run) -> str:
    if not run.cfg.parallel.offload:
        return ""
    if run.mesh.device.type != "cuda":
        return "\noffload: this run computes on the CPU already, so --offload has no effect"
    return "\noffload: optimizer state (fp32 masters, Adam moments) kept in CPU memory"


def _experts_note(cfg: Config) -> str:
    """The mixture of experts, where the model has one."""
    m = cfg.model
    if not m.n_experts:
        return ""
    shared = f" + a shared expert {m.shared_ffn} wide" if m.shared_ffn else ""
    balance = " and ".join(b for b, on in ((f"aux loss x {m.aux_loss_coef:g}", m.aux_loss_coef),
                                           (f"selection bias step {m.bias_update:g}", m.bias_update)) if on)
    return (f"\nexperts: {m.n_experts} x {m.expert_dim} wide{shared}, top-{m.top_k}, in "
            f"{len(m.moe_layers)} of {m.n_layers} blocks, over ep={cfg.parallel.ep} ranks; "
            f"{m.shape.active_params() / 1e6:.2f}M params active per token; balanced by "
            f"{balance or 'nothing'}; {'capacity ' + format(m.capacity_factor, 'g') if m.capacity_factor else 'dropless'}")

